"""Exact causal informative / upstream / downstream scores by activation patching (docs/scores.md §4).

>>> exact = causal_scores(base, diff, batch)                       # per token
>>> exact = causal_scores(base, diff, batch, per="component")      # whole components
>>> exact.per, exact.values.shape
('component', torch.Size([3, 4, 5, 1]))
>>> exact = causal_scores(base, diff, batch, top_k=5)              # AtP*-style

The engine, not a loop of full forwards:
- the base run is cached once (residual stream at every boundary, keys and values);
- a patch of component ``c`` at position ``t`` adds ``Δy = y_new - y`` to the cached stream
  right after ``c`` and resumes from there: the heads of layer ``l`` re-enter before MLP ``l``
  (after it, for parallel blocks), MLP ``l`` re-enters before layer ``l + 1``;
- positions before ``t`` are unchanged (causal attention), so only positions ``>= t`` are
  recomputed, reading earlier keys and values from the cache (TransformerLens's KV cache);
- many (prompt, component) interventions share one pass, stacked along the batch axis in
  chunks of at most ``max_batch`` rows;
- patch values come from cached quantities: ``f_c(z_c, W'_c)`` from the finetuned layer on the
  cached base input, ``f_c(z'_c, W_c)`` from the base layer on the finetuned run's input, and
  ``y*``; upstream's ``W_late`` runs resume inside ``B.shifted(model, diff)`` (``W + Δ``
  supplied to the pieces, never written into the model), entering at ``passes.entry``.

The resumed passes run through ``backend.run_blocks``; each kind's patch values and how its
exact score combines the patch's effects are in ``scoring/kinds/``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import Tensor

from extractive_lens import backend as B
from extractive_lens.arguments import in_range
from extractive_lens.batch import PromptBatch
from extractive_lens.interrupts import guarded, one_call_per_model
from extractive_lens.results import ComponentScores
from extractive_lens.rewards import Reward, reads_answer_positions_only
from extractive_lens.scoring import passes
from extractive_lens.scoring.ablation import AblationTable, table_for
from extractive_lens.scoring.assemble import (
    assemble,
    base_metadata,
    plan_chunks,
    progress,
    recorded_options,
)
from extractive_lens.scoring.kinds import KINDS
from extractive_lens.scoring.options import (
    CausalOptions,
    Per,
    ScoreOptions,
    check_arguments,
    prepare,
)
from extractive_lens.scoring.runs import AnswerRows, Run, forward_run, readout, wide
from extractive_lens.types import SCORE_KINDS, Ablation, Component, ScoreKind
from extractive_lens.weight_diff import WeightDiff


def causal_scores(
    model: Any,
    diff: WeightDiff,
    batch: PromptBatch,
    *,
    kinds: Sequence[ScoreKind] | ScoreKind = SCORE_KINDS,
    per: Per = "token",
    ablation: Ablation = "mean",
    reference: PromptBatch | None = None,
    reward: str | Reward | None = None,
    max_batch: int = 128,
    top_k: int | None = None,
    linear: ComponentScores | None = None,
    layers: Sequence[int] | None = None,
    batch_size: int | None = 16,
    resample_k: int = 10,
    seed: int = 3,
    show_progress: bool | None = None,
    rows: Sequence[int] | None = None,
    compute_dtype: torch.dtype | str | None = None,
    convention: str = "paper",
    positions: Literal["all", "prompt"] = "all",
) -> ComponentScores:
    """Exact scores of every head and MLP, per output position (``per="token"``) or with all
    positions patched at once (``per="component"``). Definitions: ``docs/scores.md``.

    Args:
        kinds: as in ``linear_scores``.
        ablation: as in ``linear_scores`` (the paper convention's default, ``"mean"``).
        reference: as in ``linear_scores``.
        reward: as in ``linear_scores``.
        max_batch: interventions per resumed pass (memory bound).
        top_k: score only the ``k`` components the linear scores rank highest (by |total|,
            per kind, among ``layers`` when given); the others are NaN (never computed: absent
            from ``top()``, shown as "not computed") and listed in ``metadata["skipped"]``.
        linear: precomputed linear scores for ``top_k`` (computed if not given).
        layers: score only the components of these layers (the others are NaN).
        compute_dtype: as in ``linear_scores`` (float32 for bf16/fp16 models by default).
        positions: as in ``linear_scores`` (``"prompt"``: the answer continuations left out;
            the totals still patch every position at once).
        convention: ``"paper"`` only: exact scores exist in the paper's convention (the authors'
            code has only linear approximations; ``"authors_code"`` says so in an error).

    Whole-component totals (``totals``) are always the exact whole-component patch, also for
    ``per="token"`` (where they are not the sum of the per-token scores). The options are those
    of ``CausalOptions``.
    """
    check_arguments("causal_scores", model, diff, batch)
    options = CausalOptions(
        kinds=kinds, per=per, ablation=ablation, reference=reference, reward=reward,
        max_batch=max_batch, top_k=top_k, linear=linear, layers=layers, batch_size=batch_size,
        resample_k=resample_k, seed=seed, show_progress=show_progress, rows=rows,
        compute_dtype=compute_dtype, convention=convention,  # type: ignore[arg-type]
        positions=positions,
    )  # fmt: skip
    return causal_scores_with(model, diff, batch, options)


@one_call_per_model
def causal_scores_with(
    model: Any, diff: WeightDiff, batch: PromptBatch, options: CausalOptions
) -> ComponentScores:
    """``causal_scores`` with its options as one ``CausalOptions`` object."""
    cdt = prepare("causal_scores", model, diff, batch, options)
    skipped = skipped_of(model, diff, batch, options, cdt)
    scored, plan = plan_chunks(batch, options.rows, options.batch_size)
    chunks = [c for c, _ in plan]
    partial = options.top_k is not None or options.layers is not None
    meta = base_metadata(
        model, diff, options, batch, cdt, method="causal", per=options.per, top_k=options.top_k,
        layers=None if options.layers is None else list(options.layers),
        skipped={k: list(v) for k, v in skipped.items()} if partial else None,
    )  # fmt: skip
    per_token, totals = [], []
    with guarded(model), B.standard_flags(model), B.computing_in(model, cdt), B.reusing():
        first = forward_run(model, chunks[0], options.reward_fn, capture=("z", "k", "v"))
        table = table_for(model, batch, options, chunks, first)
        for i, chunk in enumerate(chunks):
            base = first if i == 0 else forward_run(model, chunk, options.reward_fn,
                                                     capture=("z", "k", "v"))  # fmt: skip
            c = CausalChunk(model, diff, chunk, base, plan[i][1], table, options)
            v, t = c.scores(skipped)
            per_token.append(v)
            totals.append(t)
    result = assemble(model, scored, options.score_kinds, per_token if options.per == "token" else None,
                      totals, method="causal", other=None, metadata=meta)  # fmt: skip
    return result.at_positions(options.positions)


def skipped_of(
    model: Any, diff: WeightDiff, batch: PromptBatch, options: CausalOptions, cdt: torch.dtype
) -> dict[str, list[str]]:
    """Per kind, the component labels not to patch: outside the linear top k, or outside
    ``layers``."""
    skipped: dict[str, list[str]] = {}
    L, H = model.cfg.n_layers, model.cfg.n_heads
    labels = [f"H{h}" for h in range(H)] + (["MLP"] if B.has_mlp(model) else [])
    if options.layers is not None:
        in_range("layers", options.layers, L, "model's layers")
    within = range(L) if options.layers is None else sorted(set(options.layers))
    if options.top_k is not None:
        linear = options.linear
        if linear is not None:
            check_linear(
                model, diff, batch, options, linear, "causal_scores(top_k=..., linear=...)"
            )
        if linear is None:
            from extractive_lens.scoring.linear import linear_scores

            linear = linear_scores(
                model, diff, batch, kinds=options.kinds, reward=options.reward_fn,
                ablation=options.ablation, reference=options.reference, show_progress=False,
                compute_dtype=cdt,
            )  # fmt: skip
        for kind in options.kinds:
            keep = {lab for _, lab, _ in linear.top(options.top_k, kind, layers=within)}
            skipped[kind] = [f"L{l}{c}" for l in range(L) for c in labels if f"L{l}{c}" not in keep]
    if options.layers is not None:
        outside = {f"L{l}{c}" for l in range(L) if l not in options.layers for c in labels}
        for kind in options.kinds:
            skipped[kind] = sorted(set(skipped.get(kind, [])) | outside)
    return skipped


def check_linear(model: Any, diff: WeightDiff, batch: PromptBatch, options: ScoreOptions,
                 linear: Any, caller: str) -> None:  # fmt: skip
    """Refuse linear scores handed in to rank components (``caller``: the call they were handed
    to, named in the error) that are not of this model, batch, Δ, function and kinds."""
    from extractive_lens.scoring.assemble import prompts_digest

    L, H = model.cfg.n_layers, model.cfg.n_heads
    labels = [f"H{h}" for h in range(H)] + (["MLP"] if B.has_mlp(model) else [])
    digest = linear.metadata.get("prompts_digest")
    if (digest is not None and digest != prompts_digest(batch)) or (
        linear.n_layers != L or len(linear.component_labels) != len(labels)
    ):
        raise ValueError(
            f"{caller}: these linear scores were computed on "
            "other prompts (or another model), so their top components are not this "
            "batch's. Pass linear_scores(model, diff, batch) of this batch, or leave "
            "linear=None to compute them."
        )
    other = _other_diff(linear.metadata, diff)
    if other is not None:
        raise ValueError(
            f"{caller}: these linear scores were computed for "
            f"another weight change ({other}), so their top components are not this "
            "diff's. Pass linear_scores(model, diff, batch) of this diff, or leave "
            "linear=None to compute them."
        )
    unlike = _other_function(linear.metadata, model, diff, batch, options)
    if unlike:
        raise ValueError(
            f"{caller}: these linear scores are of another "
            f"function ({'; '.join(unlike)}), so their top components are not this "
            "call's. Pass linear_scores(model, diff, batch) with the same reward and "
            "options, or leave linear=None to compute them."
        )
    missing = [k for k in options.kinds if k not in linear.kinds]
    if missing:
        raise ValueError(
            f"{caller}: these linear scores have no "
            f"{', '.join(missing)} scores to rank components by (they have "
            f"{', '.join(linear.kinds)}). Pass kinds={tuple(linear.kinds)!r}, linear "
            "scores of every kind asked for, or leave linear=None to compute them."
        )


SHARED_WITH_LINEAR = ("ablation", "reference", "convention", "resample_k", "seed", "positions")
"""The options that change what linear scores rank components by (and mean the same there)."""


def _other_function(meta: Mapping[str, Any], model: Any, diff: WeightDiff, batch: PromptBatch,
                    options: ScoreOptions) -> list[str]:  # fmt: skip
    """How the function a result's record (``extractive_lens.record``) is of differs from this
    call's, in the model, the batch, the reward and the options linear scores share; Δ is
    compared by ``_other_diff`` (to rounding). A result saved before records: not judged."""
    from extractive_lens.record import BATCH, MODEL, differences, function_record

    recorded = meta.get("function_record")
    if recorded is None:
        return []
    reward = options.reward_name if options.reward is None or isinstance(options.reward, str) \
        else options.reward_fn  # fmt: skip
    mine = function_record(model, diff, batch, recorded_options(options), reward,
                           exact_diff=False)  # fmt: skip
    keys = [*MODEL, *BATCH, "reward", *(f"option {k}" for k in SHARED_WITH_LINEAR)]
    return differences(mine, recorded, "this call", keys)


def _other_diff(meta: Mapping[str, Any], diff: WeightDiff) -> str | None:
    """How a result's recorded Δ differs from ``diff`` (``None``: the same Δ). Its content
    fingerprint (``WeightDiff._fingerprint``: projections of each tensor) where it has one; a
    result saved before fingerprints, by its per-component norms; one with neither, not
    judged."""
    import math

    from extractive_lens.fingerprint import differs

    recorded = meta.get("diff_fingerprint")
    if recorded is not None:
        name = differs(recorded, diff._fingerprint)
        return None if name is None else f"their Δ[{name}] differs from this diff's"
    norms, other = meta.get("diff_norms"), meta.get("diff_other_norm")
    if norms is None or other is None:
        return None
    mine = torch.as_tensor(diff.norms().to_numpy().copy(), dtype=torch.float64)
    theirs = torch.as_tensor(norms, dtype=torch.float64)
    same = (
        theirs.shape == mine.shape
        and torch.allclose(theirs, mine, rtol=1e-6, atol=1e-12)
        and math.isclose(float(other), diff.other_norm(), rel_tol=1e-6, abs_tol=1e-12)
    )
    return None if same else "their per-component norms of Δ differ from this diff's"


class _RowsKV(Mapping[int, tuple[Tensor, Tensor]]):
    """The cached keys and values of rows ``pb``, positions before ``s``, per layer: gathered
    when the layer asks for them, so one layer's copy exists at a time, not every later
    layer's (at 8B width, rows x positions x 4096 x 8 bytes per layer)."""

    def __init__(self, kv: dict[int, tuple[Tensor, Tensor]], pb: Tensor, s: int) -> None:
        self.kv, self.pb, self.s = kv, pb, s

    def __getitem__(self, layer: int) -> tuple[Tensor, Tensor]:
        k, v = self.kv[layer]
        return k[self.pb, : self.s], v[self.pb, : self.s]

    def __iter__(self) -> Iterator[int]:
        return iter(self.kv)

    def __len__(self) -> int:
        return len(self.kv)


def mark_uncomputed(vals: Tensor, tots: Tensor, kinds: Sequence[str],
                    skipped: dict[str, list[str]], n_heads: int) -> None:  # fmt: skip
    """Never computed (``top_k``, ``layers``): NaN in ``vals [kind batch layer comp pos]`` and
    ``tots [kind batch layer comp]``, not a score of 0."""
    for k, kind in enumerate(kinds):
        for label in skipped.get(kind, ()):
            comp = Component.parse(label)
            c = n_heads if comp.is_mlp else comp.head
            vals[k, :, comp.layer, c] = float("nan")
            tots[k, :, comp.layer, c] = float("nan")


@dataclass
class _Context:
    """Where interventions resume: the stream at a boundary, its keys/values, its reward."""

    layer: int
    stream: Tensor  # [batch pos d_model] right after the component group
    part: str  # "mid" (before this layer's MLP) or "post" (after the layer)
    kv: dict[int, tuple[Tensor, Tensor]]  # later layer -> (k, v) [batch pos kv_head d_head]
    reward: Tensor  # [batch] unpatched reward in this context
    finetuned: bool
    post: Tensor | None = None  # part "mid": the stream after this layer's MLP, unpatched
    mlp_out: Tensor | None = None  # part "mid": this layer's MLP output, unpatched


@dataclass
class CausalChunk:
    """The exact engine on one chunk of prompts (module docstring): contexts, patched passes."""

    model: Any
    diff: WeightDiff
    batch: PromptBatch
    base: Run
    rows: list[int]
    table: AblationTable | None
    options: CausalOptions
    _cache: dict[str, Any] = field(default_factory=dict)

    def cached(self, key: str, make: Any) -> Any:
        """``make()``, computed once per chunk (the finetuned run, ``y*``)."""
        if key not in self._cache:
            self._cache[key] = make()
        return self._cache[key]

    def __post_init__(self) -> None:
        self.L, self.H = self.model.cfg.n_layers, self.model.cfg.n_heads
        self.has_mlp, self.parallel = B.has_mlp(self.model), B.parallel(self.model)
        self.suffix_ok = reads_answer_positions_only(self.options.reward_fn)
        self.kv_prefix = B.kv_prefix(self.model)  # else patched passes run whole sequences
        self.by_rows = passes.by_rows(self.model, self.batch)  # passes a block of rows at a time
        # the last position any reward reads, per prompt: later patches cannot change R
        ch = self.batch
        n_ans = (ch.answer_targets >= 0).sum(-1)
        self.last_read = (ch.last_prompt_pos + n_ans - 1).clamp(max=ch.lengths - 1).tolist()
        self.min_prompt_last = int(ch.last_prompt_pos.min())

    # ------------------------------------------------------------------ contexts
    def context(self, layer: int, group: str, finetuned: bool) -> _Context:
        base = self.base
        part = passes.boundary(self.model, group)
        stream = base.post[layer] if part == "post" else base.mid[layer]
        if not finetuned:
            kv = {
                l: (base.captured[l]["k"], base.captured[l]["v"]) for l in range(layer + 1, self.L)
            }
            if part == "mid":
                return _Context(layer, stream, part, kv, base.reward, False, base.post[layer],  # type: ignore[arg-type]
                                base.mlp_out[layer])  # fmt: skip
            return _Context(layer, stream, part, kv, base.reward, False)  # type: ignore[arg-type]
        stream, (_, part) = passes.entry(self.model, self.diff, base, layer, group)
        kv = {}

        def keep_kv(step: B.LayerRun) -> None:
            kv[step.layer] = (step.captured["k"], step.captured["v"])

        with torch.no_grad(), B.shifted(self.model, self.diff):
            post = mlp_out = None
            if part == "mid":
                mlp_out = B.mlp(self.model, layer, stream)
                post = stream + mlp_out
            x = B.run_blocks(self.model, stream if post is None else post, start=(layer, "post"),
                             capture=("k", "v"), observe=keep_kv)  # fmt: skip
            R, _, _ = readout(self.model, x, self.batch, self.options.reward_fn)  # type: ignore[arg-type]
        return _Context(layer, stream, part, kv, R, True, post, mlp_out)

    def patched_rewards(self, ctx: _Context, delta: Tensor, per: str) -> Tensor:
        """R with ``delta [batch pos comp d_model]`` added in ``ctx``: ``[batch, comp, pos]``
        (per token; unaffected positions keep the context's reward) or ``[batch, comp]``."""
        b, pos, n_comp, _ = delta.shape
        dev = delta.device
        if per == "component":
            grid = torch.cartesian_prod(torch.arange(b), torch.arange(n_comp))
            jobs = torch.cat([grid, torch.full((len(grid), 1), -1)], dim=1)
            out = torch.empty(b, n_comp, dtype=ctx.reward.dtype, device=ctx.reward.device)
        else:
            grid = torch.cartesian_prod(torch.arange(pos), torch.arange(b), torch.arange(n_comp))
            jobs = grid[:, [1, 2, 0]]  # (prompt, component, position), sorted by position
            last = torch.tensor(self.last_read)
            jobs = jobs[jobs[:, 2] <= last[jobs[:, 0]]]
            out = ctx.reward[:, None, None].expand(b, n_comp, pos).clone()
        jobs = jobs.to(dev)
        applied = B.shifted(self.model, self.diff) if ctx.finetuned else contextlib.nullcontext()
        max_batch = self.options.max_batch
        with torch.no_grad(), applied:
            for i in range(0, len(jobs), max_batch):
                part = jobs[i : i + max_batch]
                pb, c, t = part[:, 0], part[:, 1], part[:, 2]
                s = 0 if per == "component" else self._start(int(t.min()))
                x, entry = self._patched_stream(ctx, delta, per, pb, c, t, s)
                kv = None if s == 0 else _RowsKV(ctx.kv, pb, s)
                rows = AnswerRows.of(self.batch, pb) if self.suffix_ok else None
                read = None if rows is None else rows.read_positions(s)
                x = passes.resume(self.model, x, (ctx.layer, entry), by_rows=self.by_rows,  # type: ignore[arg-type]
                                  past_kv=kv, read_pos=read)  # fmt: skip
                view = rows if rows is not None else self.batch.subset(pb.tolist(), trim=False)
                R, _, _ = readout(self.model, x, view, self.options.reward_fn, offset=s,  # type: ignore[arg-type]
                                  gathered=read is not None)  # fmt: skip
                if per == "component":
                    out[pb, c] = R.to(out.dtype)
                else:
                    out[pb, c, t] = R.to(out.dtype)
        return out

    def _patched_stream(
        self, ctx: _Context, delta: Tensor, per: str, pb: Tensor, c: Tensor, t: Tensor, s: int
    ) -> tuple[Tensor, str]:
        """The context's stream from position ``s`` on with each row's patch added, and the
        boundary it enters at."""
        if per == "component":
            return ctx.stream[pb, s:] + delta[pb, s:, c].to(ctx.stream.dtype), ctx.part
        rows = torch.arange(len(pb), device=delta.device)
        if ctx.part == "mid" and self.has_mlp:
            # Only position t changed: this layer's MLP runs on that position alone.
            d = delta[pb, t, c].to(ctx.stream.dtype)
            xm = ctx.stream[pb, t] + d
            m = B.mlp(self.model, ctx.layer, xm[:, None])[:, 0]
            x = ctx.post[pb, s:].clone()  # type: ignore[index]
            x[rows, t - s] += d + m - ctx.mlp_out[pb, t]  # type: ignore[index]
            return x, "post"
        x = ctx.stream[pb, s:].clone()
        x[rows, t - s] += delta[pb, t, c].to(x.dtype)
        return x, ctx.part

    def _start(self, t: int | None) -> int:
        if t is None or not (self.suffix_ok and self.kv_prefix):
            return 0
        return min(t, self.min_prompt_last)

    # ------------------------------------------------------------------ all scores
    def scores(self, skipped: dict[str, list[str]]) -> tuple[Tensor, Tensor]:
        kinds, per = self.options.kinds, self.options.per
        b, pos = self.batch.tokens.shape
        C = self.H + self.has_mlp
        dtype = wide(self.base.pre[0]).dtype
        dev = self.base.pre[0].device
        vals = torch.zeros(len(kinds), b, self.L, C, pos, dtype=dtype, device=dev)
        tots = torch.zeros(len(kinds), b, self.L, C, dtype=dtype, device=dev)
        steps = [(k, kind, layer) for k, kind in enumerate(kinds) for layer in range(self.L)]
        for k, kind, layer in progress(
            steps, len(steps), "causal scores", self.options.show_progress
        ):
            for _, group, delta, idx in patch_groups(self, kind, skipped.get(kind, []), [layer]):
                whole, tok = self._effects(KINDS[kind], layer, group, delta, per)
                idx = idx.to(dev)
                tots[k, :, layer, idx] = whole.to(dtype)
                if tok is not None:
                    vals[k, :, layer, idx] = tok.to(dtype)
        mask = self.batch.position_mask.to(dev)
        vals = vals * mask[None, :, None, None, :]
        mark_uncomputed(vals, tots, kinds, skipped, self.H)
        return vals, tots

    def _effects(self, kind: Any, layer: int, group: str, delta: Tensor, per: str
                 ) -> tuple[Tensor, Tensor | None]:  # fmt: skip
        """The kind's exact score of a group's components: whole and (per token) per position."""
        whole: dict[str, Tensor] = {}
        tok: dict[str, Tensor] = {}
        for name in kind.CONTEXTS:
            ctx = self.context(layer, group, finetuned=name == "finetuned_late")
            whole[name] = self.patched_rewards(ctx, delta, "component") - ctx.reward[:, None]
            if per == "token":
                tok[name] = self.patched_rewards(ctx, delta, "token") - ctx.reward[:, None, None]
        return kind.exact(whole), (kind.exact(tok) if per == "token" else None)


def patch_groups(
    cc: CausalChunk, kind: str, skip: list[str], layers: Iterable[int] | None = None
) -> Iterator[tuple[int, str, Tensor, Tensor]]:
    """Per layer (of ``layers``, default all) and component group with a component not in
    ``skip``: ``(layer, group, the kept components' patches [batch, pos, comp, d_model], their
    component indices)``, the kind's patch values formed one layer at a time."""
    H = cc.model.cfg.n_heads
    skip_set = set(skip)
    for layer in range(cc.model.cfg.n_layers) if layers is None else layers:
        labels = [f"L{layer}H{h}" for h in range(H)] + ([f"L{layer}MLP"] if cc.has_mlp else [])
        if all(lab in skip_set for lab in labels):
            continue
        dh, dm = KINDS[kind].patch_values(cc, layer)
        groups = [("heads", dh, 0)]
        if dm is not None:
            groups.append(("mlp", dm[:, :, None], H))
        for group, delta, offset in groups:
            keep = [j for j in range(delta.shape[2]) if labels[offset + j] not in skip_set]
            if keep:
                yield layer, group, delta[:, :, keep], torch.tensor(keep) + offset

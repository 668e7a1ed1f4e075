"""Exact causal informative / upstream / downstream scores by activation patching (docs/scores.md §4).

>>> exact = causal_scores(base, diff, batch)                       # doctest: +SKIP  per token
>>> exact = causal_scores(base, diff, batch, per="component")      # doctest: +SKIP  whole components
>>> exact = causal_scores(base, diff, batch, top_k=5)              # doctest: +SKIP  AtP*-style

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
  ``y*``; upstream's ``W_late`` runs resume inside ``diff.applied``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor, nn

from extractive_lens import model as M
from extractive_lens.batch import PromptBatch
from extractive_lens.interrupts import guarded, refuse_attached_hooks
from extractive_lens.results import ComponentScores
from extractive_lens.rewards import Reward, resolve_reward
from extractive_lens.scoring.engine import (
    AblationTable,
    Run,
    assemble,
    base_metadata,
    check_arguments,
    forward_run,
    plan_chunks,
    progress,
    prompts_digest,
    read_positions,
    readout,
    resolve_kinds,
    wide,
)
from extractive_lens.types import SCORE_KINDS, Ablation, ScoreKind
from extractive_lens.weight_diff import WeightDiff


def causal_scores(
    model: nn.Module,
    diff: WeightDiff,
    batch: PromptBatch,
    *,
    kinds: Sequence[ScoreKind] | ScoreKind = SCORE_KINDS,
    per: Literal["token", "component"] = "token",
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
) -> ComponentScores:
    """Exact scores of every head and MLP, per output position (``per="token"``) or with all
    positions patched at once (``per="component"``). Definitions: ``docs/scores.md``.

    Args:
        kinds, ablation, reference, reward: as in ``linear_scores`` (paper convention).
        max_batch: interventions per resumed pass (memory bound).
        top_k: score only the ``k`` components the linear scores rank highest (by |total|,
            per kind); the others are reported as 0 and listed in ``metadata["skipped"]``.
        linear: precomputed linear scores for ``top_k`` (computed if not given).
        layers: score only the components of these layers (others are reported as 0).
        compute_dtype: as in ``linear_scores`` (float32 for bf16/fp16 models by default).

    Whole-component totals (``totals``) are always the exact whole-component patch, also for
    ``per="token"`` (where they are not the sum of the per-token scores).
    """
    check_arguments("causal_scores", model, diff, batch)
    M.check_scorable(model)
    refuse_attached_hooks(model, "causal_scores")
    kinds = resolve_kinds(kinds)
    if per not in ("token", "component"):
        raise ValueError(f"per must be 'token' or 'component', got {per!r}")
    reward_fn, reward_name = resolve_reward(reward)
    if ablation not in ("mean", "zero", "resample"):
        raise ValueError(f"ablation must be 'mean', 'zero' or 'resample', got {ablation!r}")
    if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
        raise ValueError(
            f"max_batch must be a positive number of interventions per pass, got {max_batch!r}"
        )
    cdt = M.resolve_compute_dtype(model, compute_dtype)
    diff._check_compatible(model)
    selected = _top_k(model, diff, batch, kinds, top_k, linear, reward_fn, ablation, reference, cdt)
    if layers is not None:
        bad = [layer for layer in layers if not 0 <= layer < model.cfg.n_layers]
        if bad:
            raise ValueError(f"layers {bad} out of range 0..{model.cfg.n_layers - 1}")
        layer_set = set(layers)
        for kind in kinds:
            selected.setdefault(kind, [])
            selected[kind] = sorted(
                set(selected[kind])
                | {
                    f"L{l}{c}"
                    for l in range(model.cfg.n_layers)
                    if l not in layer_set
                    for c in [f"H{h}" for h in range(model.cfg.n_heads)]
                    + (["MLP"] if M.has_mlp(model) else [])
                }
            )
    scored, plan = plan_chunks(batch, rows, batch_size)
    chunks = [c for c, _ in plan]
    meta = base_metadata(
        model,
        diff,
        method="causal",
        reward=reward_name,
        per=per,
        ablation=ablation if "upstream" in kinds else None,
        convention="paper",
        reference="batch (leave-one-out)" if reference is None else f"{len(reference)} prompts",
        resample_k=resample_k if ablation == "resample" else None,
        seed=seed,
        top_k=top_k,
        layers=None if layers is None else sorted(layers),
        skipped={k: list(v) for k, v in selected.items()}
        if (top_k or layers is not None)
        else None,
        compute_dtype=str(cdt),
        prepend_bos=batch.prepend_bos,
    )
    per_token, totals = [], []
    with guarded(model), M.standard_flags(model), M.computing_in(model, cdt):
        first = forward_run(model, chunks[0], reward_fn, capture=("z", "k", "v"))
        table = None
        if "upstream" in kinds:
            reuse = (
                [(chunks[0], first)]
                if reference is None and rows is None and len(chunks) == 1
                else None
            )
            table = AblationTable(
                model,
                batch,
                ablation,
                reference=reference,
                k=resample_k,
                seed=seed,
                batch_size=batch_size,
                runs=reuse,
            )
        for i, chunk in enumerate(chunks):
            global_rows = plan[i][1]
            base = (
                first if i == 0 else forward_run(model, chunk, reward_fn, capture=("z", "k", "v"))
            )
            engine = _Engine(model, diff, chunk, base, reward_fn, max_batch)
            v, t = engine.scores(kinds, table, global_rows, per, selected, show_progress)
            per_token.append(v)
            totals.append(t)
    meta["rows"] = None if rows is None else list(rows)
    batch = scored
    meta["prompts_digest"] = prompts_digest(batch)
    if per == "component":
        b = len(batch)
        roles = tuple(("all",) for _ in range(b))
        pv = torch.cat(totals, dim=1)[..., None]
        one = PromptBatch(
            tokens=torch.zeros(b, 1, dtype=torch.long),
            lengths=torch.ones(b, dtype=torch.long),
            prompt_lengths=torch.ones(b, dtype=torch.long),
            answer_targets=batch.answer_targets,
            candidates=batch.candidates,
            counterfactual=batch.counterfactual,
            roles=roles,
            prompts=batch.prompts,
            answers=batch.answers,
        )
        return assemble(model, one, kinds, [pv], totals, method="causal", other=None, metadata=meta)
    return assemble(
        model, batch, kinds, per_token, totals, method="causal", other=None, metadata=meta
    )


def _top_k(
    model, diff, batch, kinds, top_k, linear, reward_fn, ablation, reference, cdt
) -> dict[str, list[str]]:
    """Per kind, the component labels to skip (everything outside the linear top k)."""
    if top_k is None:
        return {}
    if not isinstance(top_k, int) or top_k < 1:
        raise ValueError(
            f"top_k must be a positive number of components per kind (or None for all), got {top_k!r}"
        )
    if linear is None:
        from extractive_lens.scoring.linear import linear_scores

        linear = linear_scores(
            model,
            diff,
            batch,
            kinds=kinds,
            reward=reward_fn,
            ablation=ablation,
            reference=reference,
            show_progress=False,
            compute_dtype=cdt,
        )
    skipped = {}
    for kind in kinds:
        keep = {lab for _, lab, _ in linear.top(top_k, kind)}
        tot = linear.totals[linear.kind_index(kind)]
        skipped[kind] = [
            f"L{l}{c}"
            for l in range(tot.shape[0])
            for c in linear.component_labels
            if f"L{l}{c}" not in keep
        ]
    return skipped


@dataclass
class _Context:
    """Where interventions resume: the stream at a boundary, its keys/values, its reward."""

    stream: Tensor  # [batch pos d_model] right after the component group
    part: str  # "mid" (before this layer's MLP) or "post" (after the layer)
    kv: dict[int, tuple[Tensor, Tensor]]  # later layer -> (k, v) [batch pos kv_head d_head]
    reward: Tensor  # [batch] unpatched reward in this context
    finetuned: bool
    post: Tensor | None = None  # part "mid": the stream after this layer's MLP, unpatched
    mlp_out: Tensor | None = None  # part "mid": this layer's MLP output, unpatched


class _Engine:
    def __init__(
        self,
        model: nn.Module,
        diff: WeightDiff,
        chunk: PromptBatch,
        base: Run,
        reward_fn: Reward,
        max_batch: int,
    ) -> None:
        self.model, self.diff, self.chunk, self.base = model, diff, chunk, base
        self.reward_fn, self.max_batch = reward_fn, max_batch
        cfg = model.cfg
        self.L, self.H = cfg.n_layers, cfg.n_heads
        self.has_mlp = M.has_mlp(model)
        self.parallel = cfg.parallel_attn_mlp
        self.suffix_ok = bool(getattr(reward_fn, "answer_positions_only", False))
        # the last position any reward reads, per prompt: later patches cannot change R
        n_ans = (chunk.answer_targets >= 0).sum(-1)
        self.last_read = (chunk.last_prompt_pos + n_ans - 1).clamp(max=chunk.lengths - 1).tolist()
        self.min_prompt_last = int(chunk.last_prompt_pos.min())

    # ------------------------------------------------------------------ patch values Δy
    def deltas(
        self, kind: ScoreKind, table: AblationTable | None, rows: list[int]
    ) -> list[tuple[Tensor, Tensor | None]]:
        """Per layer: ``(Δ heads [batch pos head d_model], Δ MLP [batch pos d_model])``."""
        base, model = self.base, self.model
        out = []
        with torch.no_grad():
            if kind == "informative":
                new = []
                with self.diff.applied(model):
                    for layer in range(self.L):
                        _, cap = M.attention(model, layer, base.pre[layer])
                        W_O = M.W_O(model, layer).detach().clone()
                        m = M.mlp(model, layer, base.mlp_in[layer]) if self.has_mlp else None
                        new.append((cap["z"], W_O, m))
                for layer, (z_new, W_O_new, m_new) in enumerate(new):
                    dh = _head_out(z_new, W_O_new) - _head_out(base.z[layer], base.W_O[layer])
                    dm = None if m_new is None else wide(m_new) - wide(base.mlp_out[layer])
                    out.append((dh, dm))
            elif kind == "downstream":
                with self.diff.applied(model):
                    ft = forward_run(model, self.chunk)
                for layer in range(self.L):
                    _, cap = M.attention(model, layer, ft.pre[layer])
                    dz = wide(cap["z"]) - wide(base.z[layer])
                    dh = _head_out(dz, base.W_O[layer])
                    dm = None
                    if self.has_mlp:
                        dm = wide(M.mlp(model, layer, ft.mlp_in[layer])) - wide(base.mlp_out[layer])
                    out.append((dh, dm))
            else:
                z_star, m_star = table.for_rows(rows, self.chunk, base)
                for layer in range(self.L):
                    dh = _head_out(z_star[:, :, layer] - wide(base.z[layer]), base.W_O[layer])
                    dm = None if m_star is None else m_star[:, :, layer] - wide(base.mlp_out[layer])
                    out.append((dh, dm))
        return out

    # ------------------------------------------------------------------ contexts
    def context(self, layer: int, group: str, finetuned: bool) -> _Context:
        base = self.base
        part = "post" if (group == "mlp" or self.parallel or not self.has_mlp) else "mid"
        stream = base.post[layer] if part == "post" else base.mid[layer]
        if not finetuned:
            kv = {
                l: (base.captured[l]["k"], base.captured[l]["v"]) for l in range(layer + 1, self.L)
            }
            if part == "mid":
                return _Context(
                    stream, part, kv, base.reward, False, base.post[layer], base.mlp_out[layer]
                )
            return _Context(stream, part, kv, base.reward, False)
        if group == "heads":
            d_bO = self.diff.deltas.get(f"blocks.{layer}.attn.b_O")
            if d_bO is not None:
                stream = stream + d_bO.to(device=stream.device, dtype=stream.dtype)
        with torch.no_grad(), self.diff.applied(self.model):
            post = mlp_out = None
            if part == "mid":
                mlp_out = M.mlp(self.model, layer, stream)
                post = stream + mlp_out
            x, kv = self.resume(
                stream if post is None else post, layer, "post", start=0, kv=None, capture_kv=True
            )
            R, _, _ = readout(self.model, x, self.chunk, self.reward_fn)
        return _Context(stream, part, kv, R, True, post, mlp_out)

    def resume(
        self,
        x: Tensor,
        layer: int,
        part: str,
        start: int,
        kv: dict | None,
        capture_kv: bool = False,
        read_pos: Tensor | None = None,
    ) -> tuple[Tensor, dict[int, tuple[Tensor, Tensor]]]:
        """Continue the forward pass from boundary ``(layer, part)`` on positions ``start..``.

        ``read_pos`` ``[rows, K]``: the only positions the reward reads (relative to ``start``);
        the last layer's MLP then runs on those alone and the gathered stream is returned.
        """
        model = self.model
        if part == "mid" and self.has_mlp:
            x = x + M.mlp(model, layer, x)
        if read_pos is not None and layer + 1 >= self.L:
            return _gather(x, read_pos), {}
        kvs = {}
        for l in range(layer + 1, self.L):
            x = M.on_block(model, l, x)
            past = None if kv is None else kv[l]
            out, cap = M.attention(model, l, x, ("k", "v") if capture_kv else (), past_kv=past)
            if capture_kv:
                kvs[l] = (cap["k"], cap["v"])
            last = read_pos is not None and l == self.L - 1
            if not self.has_mlp:
                x = x + out
            elif self.parallel:
                x = x + out + M.mlp(model, l, x)
            else:
                mid = x + out
                if last:
                    mid = _gather(mid, read_pos)
                x = mid + M.mlp(model, l, mid)
                continue
            if last:
                x = _gather(x, read_pos)
        return x, kvs

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
        with (
            torch.no_grad(),
            self.diff.applied(self.model) if ctx.finetuned else contextlib.nullcontext(),
        ):
            for i in range(0, len(jobs), self.max_batch):
                part = jobs[i : i + self.max_batch]
                pb, c, t = part[:, 0], part[:, 1], part[:, 2]
                s = 0 if per == "component" else self._start(int(t.min()))
                entry = ctx.part
                if per == "component":
                    x = ctx.stream[pb, s:] + delta[pb, s:, c].to(ctx.stream.dtype)
                elif ctx.part == "mid" and self.has_mlp:
                    # Only position t changed: this layer's MLP runs on that position alone.
                    rows = torch.arange(len(part), device=dev)
                    d = delta[pb, t, c].to(ctx.stream.dtype)
                    xm = ctx.stream[pb, t] + d
                    m = M.mlp(self.model, self._layer, xm[:, None])[:, 0]
                    x = ctx.post[pb, s:].clone()
                    x[rows, t - s] += d + m - ctx.mlp_out[pb, t]
                    entry = "post"
                else:
                    rows = torch.arange(len(part), device=dev)
                    x = ctx.stream[pb, s:].clone()
                    x[rows, t - s] += delta[pb, t, c].to(x.dtype)
                kv = None if s == 0 else {l: (k[pb, :s], v[pb, :s]) for l, (k, v) in ctx.kv.items()}
                rows_batch = self._rows(pb)
                read = self._read_pos(rows_batch, s)
                x, _ = self.resume(x, self._layer, entry, s, kv, read_pos=read)
                R, _, _ = readout(
                    self.model, x, rows_batch, self.reward_fn, offset=s, gathered=read is not None
                )
                if per == "component":
                    out[pb, c] = R.to(out.dtype)
                else:
                    out[pb, c, t] = R.to(out.dtype)
        return out

    def _read_pos(self, rows: Any, start: int) -> Tensor | None:
        """Positions (relative to ``start``) the built-in rewards read, per row: ``[rows, K]``."""
        if not getattr(self.reward_fn, "answer_positions_only", False):
            return None
        return read_positions(rows, start)

    def _rows(self, index: Tensor) -> Any:
        """The chunk's prompts ``index`` (repeats allowed), as the reward needs them."""
        ch = self.chunk
        if getattr(self.reward_fn, "answer_positions_only", False):
            i = index.to(ch.lengths.device)
            return _Rows(
                ch.lengths[i],
                ch.prompt_lengths[i],
                ch.answer_targets[i],
                None if ch.candidates is None else ch.candidates[i],
                None if ch.counterfactual is None else ch.counterfactual[i],
            )
        return ch.subset(index.tolist(), trim=False)

    def _start(self, t: int | None) -> int:
        if t is None or not self.suffix_ok:
            return 0
        return min(t, self.min_prompt_last)

    # ------------------------------------------------------------------ all scores
    def scores(
        self,
        kinds: tuple[ScoreKind, ...],
        table: AblationTable | None,
        rows: list[int],
        per: str,
        skipped: dict[str, list[str]],
        show_progress: bool | None,
    ) -> tuple[Tensor, Tensor]:
        b, pos = self.chunk.tokens.shape
        C = self.H + self.has_mlp
        dtype = wide(self.base.pre[0]).dtype
        dev = self.base.pre[0].device
        vals = torch.zeros(len(kinds), b, self.L, C, pos, dtype=dtype, device=dev)
        tots = torch.zeros(len(kinds), b, self.L, C, dtype=dtype, device=dev)
        steps = [(k, kind, layer) for k, kind in enumerate(kinds) for layer in range(self.L)]
        deltas: dict[str, list] = {}
        for k, kind, layer in progress(steps, len(steps), "causal scores", show_progress):
            n_layer_comps = self.H + self.has_mlp
            if (
                sum(
                    lab.startswith(f"L{layer}H") or lab == f"L{layer}MLP"
                    for lab in skipped.get(kind, ())
                )
                == n_layer_comps
            ):
                continue
            if kind not in deltas:
                deltas = {kind: self.deltas(kind, table, rows)}
            dh, dm = deltas[kind][layer]
            groups = [("heads", dh, slice(0, self.H))]
            if dm is not None:
                groups.append(("mlp", dm[:, :, None], slice(self.H, self.H + 1)))
            for group, delta, cols in groups:
                labels = (
                    [f"L{layer}H{h}" for h in range(self.H)]
                    if group == "heads"
                    else [f"L{layer}MLP"]
                )
                keep = [i for i, lab in enumerate(labels) if lab not in set(skipped.get(kind, ()))]
                if not keep:
                    continue
                delta = delta[:, :, keep]
                self._layer = layer
                ctx = self.context(layer, group, finetuned=False)
                whole = self.patched_rewards(ctx, delta, "component")
                tok = self.patched_rewards(ctx, delta, "token") if per == "token" else None
                if kind == "upstream":
                    late = self.context(layer, group, finetuned=True)
                    whole = (
                        late.reward[:, None] - self.patched_rewards(late, delta, "component")
                    ) - (ctx.reward[:, None] - whole)
                    if tok is not None:
                        tok = (
                            late.reward[:, None, None] - self.patched_rewards(late, delta, "token")
                        ) - (ctx.reward[:, None, None] - tok)
                else:
                    whole = whole - ctx.reward[:, None]
                    if tok is not None:
                        tok = tok - ctx.reward[:, None, None]
                idx = torch.tensor(keep, device=dev) + cols.start
                tots[k, :, layer, idx] = whole.to(dtype)
                if tok is not None:
                    vals[k, :, layer, idx] = tok.to(dtype)
        mask = self.chunk.position_mask.to(dev)
        return vals * mask[None, :, None, None, :], tots


@dataclass(frozen=True)
class _Rows:
    """Rows of a batch with the fields the built-in rewards and ``readout`` read."""

    lengths: Tensor
    prompt_lengths: Tensor
    answer_targets: Tensor
    candidates: Tensor | None
    counterfactual: Tensor | None

    def __len__(self) -> int:
        return self.lengths.shape[0]

    @property
    def last_prompt_pos(self) -> Tensor:
        return self.prompt_lengths - 1


def _gather(x: Tensor, pos: Tensor) -> Tensor:
    return x.gather(1, pos[..., None].expand(-1, -1, x.shape[-1]))


def _head_out(z: Tensor, W_O: Tensor) -> Tensor:
    """Each head's write ``z_h W_O[h]``: ``[batch pos head d_model]`` (one layer at a time)."""
    return torch.einsum("bphe,hed->bphd", wide(z), W_O.to(wide(z).dtype))

"""Linearized informative / upstream / downstream scores (docs/scores.md §5, §7).

>>> scores = linear_scores(base, diff, batch)
>>> scores["informative"].shape     # [layer, component, pos]
torch.Size([4, 5, 11])
>>> authors = linear_scores(base, diff, batch, convention="authors_code")

One model in memory: the finetuned weights are ``W + Δ`` supplied to each piece while it runs
(``B.shifted(model, diff)``), never written into the model. Cost per batch:
one forward+backward of the base model (``ŷ``), one forward-mode pass per layer along Δ
(informative), one forward of the finetuned model plus one base pass per layer (downstream),
and for upstream one resumed finetuned pass: the base residual stream enters at every layer
boundary as extra rows of a growing batch ("staircase"), so ``ŷ'`` for all ``2·n_layers``
boundaries comes from one forward and one backward (``upstream_group`` bounds its memory).
Where gradients go one layer at a time (large models) the finetuned run, the staircase and
every kind's per-layer work are one layer-major pass (``passes.layer_major``): each layer's Δ
is read once forward and once backward, whatever the depth.
Each kind's own computation is in ``scoring/kinds/``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, cast

import torch
from torch import Tensor

from extractive_lens import backend as B
from extractive_lens.batch import PromptBatch
from extractive_lens.interrupts import guarded, one_call_per_model
from extractive_lens.results import ComponentScores
from extractive_lens.rewards import Reward
from extractive_lens.scoring import passes
from extractive_lens.scoring.ablation import AblationTable, table_for
from extractive_lens.scoring.assemble import assemble, base_metadata, plan_chunks, progress
from extractive_lens.scoring.kinds import KINDS
from extractive_lens.scoring.kinds.protocols import LayerStep
from extractive_lens.scoring.options import LinearOptions, check_arguments, prepare
from extractive_lens.scoring.runs import HeadGrads, Run, forward_run, layerwise, sizing, wide
from extractive_lens.types import SCORE_KINDS, Ablation, Convention, ScoreKind
from extractive_lens.weight_diff import WeightDiff


def linear_scores(
    model: Any,
    diff: WeightDiff,
    batch: PromptBatch,
    *,
    reward: str | Reward | None = None,
    kinds: Sequence[ScoreKind] | ScoreKind = SCORE_KINDS,
    ablation: Ablation | None = None,
    reference: PromptBatch | None = None,
    convention: Convention = "paper",
    batch_size: int | None = 16,
    upstream_group: int | Literal["auto"] | None = "auto",
    resample_k: int = 10,
    seed: int = 3,
    show_progress: bool | None = None,
    rows: Sequence[int] | None = None,
    compute_dtype: torch.dtype | str | None = None,
    positions: Literal["all", "prompt"] = "all",
) -> ComponentScores:
    """Linearized scores of every head and MLP at every token (definitions: ``docs/scores.md``).

    Args:
        model: the base ``HookedTransformer`` (weights W). It is left bit-identical.
        diff: ``Δ = W' - W``.
        batch: prompts and answers from ``make_batch``.
        reward: ``"answer_logprob"`` (default), ``"logit_margin"`` (default for
            ``convention="authors_code"``), ``"logit_diff"`` or a callable.
        kinds: any of ``"informative"``, ``"upstream"``, ``"downstream"``.
        ablation: ``y*`` for upstream: ``"mean"`` (default), ``"zero"`` or ``"resample"``
            (default for the authors' convention; ``resample_k`` prompts drawn with ``seed``).
        reference: prompts whose role-aligned mean is ``y*`` (default: the batch's other prompts).
        convention: ``"paper"`` (docs/scores.md §5) or ``"authors_code"`` (docs/scores.md §7).
        batch_size: prompts per pass (progress bar over passes).
        rows: score only these prompts of ``batch`` (``y*`` still comes from the whole batch);
            used to shard a dataset across processes.
        upstream_group: layer boundaries per resumed pass for ``ŷ'``. ``None``: all ``2·n_layers``
            in one pass (fastest for small models; activation memory grows to about
            ``n_layers`` times one forward's). ``1``: one boundary per pass (activation memory
            at most one forward's; same FLOPs, more passes). ``"auto"`` (default): all in one
            pass when that stays under ``UPSTREAM_AUTO_BYTES``, else 1. Where gradients go one
            layer at a time (``runs.layerwise``) it is the boundaries per layer-major pass
            (``passes.layer_major``, which keeps each boundary's stream at every later layer);
            ``"auto"``: as many as keep that under ``passes.SWEEP_BYTES`` (2 GiB). Each
            further pass reads Δ of the layers after its first boundary again.
        positions: ``"all"`` (default) or ``"prompt"``: the map of the prompt's own positions,
            the answer's teacher-forced continuations left out (``ComponentScores.at_positions``;
            docs/scores.md §6 says when each fits).
        compute_dtype: the dtype every activation, gradient and score is computed in. Default:
            float32 for bf16/fp16 models (weights stay stored as they are; each layer is upcast
            while it runs), the model's dtype otherwise. Recorded in ``metadata``.

    With ``"informative"`` the result also carries an additivity check:
    ``metadata["additivity"]`` compares ``Σ informative + other`` (the first-order change of R)
    with the actual change ``R(W') - R(W)`` from one extra forward; an ``AdditivityWarning``
    says when their gap passes ``ADDITIVITY_WARN`` (``docs/scores.md`` §11).
    The options are those of ``LinearOptions``.
    """
    check_arguments("linear_scores", model, diff, batch)
    options = LinearOptions(
        kinds=kinds, reward=reward, ablation=ablation, reference=reference, convention=convention,
        batch_size=batch_size, upstream_group=upstream_group, resample_k=resample_k, seed=seed,
        show_progress=show_progress, rows=rows, compute_dtype=compute_dtype, positions=positions,
    )  # fmt: skip
    return linear_scores_with(model, diff, batch, options)


@one_call_per_model
def linear_scores_with(
    model: Any, diff: WeightDiff, batch: PromptBatch, options: LinearOptions
) -> ComponentScores:
    """``linear_scores`` with its options as one ``LinearOptions`` object."""
    cdt = prepare("linear_scores", model, diff, batch, options)
    per_query_head = options.authors and "informative" in options.kinds  # K/V at the key pos.
    deltas = diff.deltas  # read one layer at a time (moved to the device where it is used)
    _check_covered(deltas)
    scored, plan = plan_chunks(batch, options.rows, options.batch_size)
    meta = base_metadata(model, diff, options, batch, cdt, method="linear")
    with guarded(model), B.standard_flags(model), B.computing_in(model, cdt), B.reusing():
        with B.ungrouped_kv(model) if per_query_head else contextlib.nullcontext():
            chunks = _scores(model, diff, deltas, batch, plan, options)
    per_token = [cast(Tensor, c.scores) for c in chunks]
    other = [cast(Tensor, c.other) for c in chunks]
    result = assemble(model, scored, options.score_kinds, per_token, [v.sum(-1) for v in per_token],
                      method="linear", other=other, metadata=meta)  # fmt: skip
    if "informative" in options.kinds:
        changes = [cast(Tensor, c.change) for c in chunks]
        meta["additivity"] = additivity_check(result, torch.cat(changes).cpu())
    return result.at_positions(options.positions)


@dataclass
class LinearChunk:
    """One chunk of prompts and everything the kinds' ``linear`` functions read."""

    model: Any
    diff: WeightDiff
    deltas: Mapping[str, Tensor]
    batch: PromptBatch
    base: Run
    rows: list[int]
    options: LinearOptions
    table: AblationTable | None
    g_z: Sequence[Tensor]  # ŷ_h W_O[h]^T per layer: [batch pos head d_head]
    ft: Run | None = None  # the finetuned run
    other: Tensor | None = None  # [batch] the "other" parameters' informative share
    scores: Tensor | None = None  # [kind batch layer component pos]
    change: Tensor | None = None  # [batch] R(W') - R(W) (informative only)
    # kinds' scores computed a layer or a boundary at a time (``_finetuned_passes``), by kind
    swept: dict[str, Tensor] = field(default_factory=dict)

    @property
    def dtype(self) -> torch.dtype:
        return wide(self.base.pre[0]).dtype

    @property
    def informative_blocks(self) -> tuple[Tensor, Tensor] | None:
        """Informative's scores of the blocks and ``b_O``'s "other" share, where a layer-major
        pass computed them layer by layer (``None`` elsewhere)."""
        inf = self.swept.get("informative")
        return None if inf is None or self.other is None else (inf, self.other)

    def new_scores(self) -> Tensor:
        """A zero ``[batch, layer, component, pos]`` tensor for one kind."""
        cfg = self.model.cfg
        b, pos = self.batch.tokens.shape
        C = cfg.n_heads + B.has_mlp(self.model)
        return torch.zeros(
            b, cfg.n_layers, C, pos, dtype=self.dtype, device=self.base.pre[0].device
        )


def _scores(
    model: Any, diff: WeightDiff, deltas: Mapping[str, Tensor], batch: PromptBatch,
    plan: list[tuple[PromptBatch, list[int]]], options: LinearOptions,
) -> list[LinearChunk]:  # fmt: skip
    """Every chunk's scores, "other" shares and ``R(W') - R(W)``."""
    kinds = options.kinds
    capture = ("z", *dict.fromkeys(c for k in kinds for c in KINDS[k].capture(options)))
    needs = set().union(*(KINDS[k].needs(options) for k in kinds))
    chunks = [c for c, _ in plan]

    def base_run(chunk: PromptBatch) -> Run:
        return forward_run(model, chunk, options.reward_fn, grad=True, capture=capture)

    first = base_run(chunks[0])
    table = table_for(model, batch, options, chunks, first)
    out = []
    bar = progress(chunks, len(chunks), "linear scores", options.show_progress)
    for i, chunk in enumerate(bar):
        base = first if i == 0 else base_run(chunk)
        c = LinearChunk(model, diff, deltas, chunk, base, plan[i][1], options, table,
                        HeadGrads(base))  # fmt: skip
        _finetuned_passes(c, needs, options.score_kinds)
        values = torch.stack([KINDS[k].linear(c) for k in kinds])
        mask = chunk.position_mask.to(values.device)
        c.scores = values * mask[None, :, None, None, :]
        if c.other is None:
            c.other = torch.zeros(len(chunk), dtype=c.dtype, device=values.device)
        c.change = (
            wide(c.ft.reward) - wide(base.reward)  # type: ignore[union-attr,arg-type]
            if "informative" in kinds
            else values.new_zeros(0)
        )
        out.append(c)
    return out


def _finetuned_passes(c: LinearChunk, needs: set[str], kinds: Sequence[ScoreKind]) -> None:
    """The finetuned run and the resumed ``ŷ'`` pass, under one application of Δ.

    ``ŷ'``: the base stream entering the finetuned model right after each component (heads of
    layer l: where they re-enter, with ``b_O'``; MLP l: after the MLP), an entry per boundary
    whose gradient goes to the kinds as it arrives (``KINDS[kind].layer_linear``, into
    ``c.swept[kind]``), then dropped. Small models: every boundary's rows in one growing batch
    and one backward (``passes.stacked``, ``upstream_group`` boundaries a pass), then the
    finetuned run. Where gradients go one layer at a time (``runs.layerwise``: large models)
    all of it is one layer-major pass (``passes.layer_major``): the finetuned rows a lane, the
    kinds' scores of each layer computed while its streams are at hand (informative's
    forward-mode pass and downstream's base layer on the finetuned inputs, with the base
    weights in force), and none of the layer's streams kept after; each layer's Δ is read
    once forward and once backward."""
    want_run = bool(needs & {"finetuned", "finetuned_grad"})
    model, grads = c.model, "upstream_grads" in needs
    entries = _boundaries(c) if grads else {}
    if layerwise(model, c.batch) and "finetuned_grad" not in needs:
        for kind in kinds:
            c.swept[kind] = c.new_scores()

        def on_layer(layer: int, step: Any) -> None:
            with B.unshifted(model):
                for kind in kinds:
                    KINDS[kind].layer_linear(c, LayerStep(layer, finetuned=step), c.swept[kind])

        with B.shifted(model, c.diff) as s:
            lanes = [passes.Lane(s, on_layer)] if want_run else []
            passes.layer_major(model, c.batch, c.options.reward_fn, lanes, list(entries.values()),
                               s, c.options.upstream_group)  # fmt: skip
        if lanes:
            c.ft = Run(reward=lanes[0].reward, post_final=lanes[0].read)
        return
    with B.shifted(model, c.diff):
        if grads:
            c.swept["upstream"] = c.new_scores()
            g = c.options.upstream_group
            group = _auto_group(model, c.batch) if g == "auto" else g
            passes.stacked(model, c.batch, c.options.reward_fn, entries, group)
        if want_run:
            c.ft = forward_run(model, c.batch, c.options.reward_fn, grad="finetuned_grad" in needs)


def _boundaries(c: LinearChunk) -> dict[tuple[int, str], passes.Entry]:
    """Upstream's rows: per ``(layer, "attn" | "mlp")``, the base stream entering the finetuned
    model right after that component group, its ``ŷ'`` handed as it arrives to the kinds whose
    scores ``c.swept`` holds."""
    model = c.model

    def boundary(layer: int, part: str) -> passes.Entry:
        def done(g: Tensor) -> None:
            for kind, out in c.swept.items():
                KINDS[kind].layer_linear(c, LayerStep(layer, part=part, g=g), out)

        start = (layer, passes.boundary(model, part))
        return passes.Entry(start, 1, lambda: passes.entry(model, c.diff, c.base, layer, part)[0],
                            True, done)  # fmt: skip

    parts = ("attn", "mlp") if B.has_mlp(model) else ("attn",)
    return {(l, p): boundary(l, p) for l in range(model.cfg.n_layers) for p in parts}


ADDITIVITY_TOLERANCE = 0.3
"""Relative gap between ``Σ informative + other`` and the actual change ``R(W') - R(W)`` within
which the linear scores count as adding up to the whole change (``docs/scores.md`` §11)."""

ADDITIVITY_WARN = 0.5
"""The gap past which ``linear_scores`` warns: the scores' sum misses the change by more than
half, or has the other sign."""


class AdditivityWarning(UserWarning):
    """The linear informative scores (plus 'other') do not add up to the whole change of R."""


LinearizationWarning = AdditivityWarning  # the name before 0.2: still caught by old filters


def additivity_check(
    scores: ComponentScores, change: Tensor, *, warn: bool = True
) -> dict[str, Any]:
    """Compare ``Σ_{c,t} Ī + other`` with ``R(W') - R(W)`` prompt by prompt (the changes
    reported are means over prompts).

    ``relative_gap = Σ_p |linear_p - exact_p| / Σ_p max(|linear_p|, |exact_p|)``: 0 when the
    scores add up to each prompt's change, 1 when their sums miss them entirely, at least 1
    when they have the wrong sign; per prompt, so that two prompts' misses of opposite sign do
    not cancel. It says whether
    the scores *decompose the change*, not whether they *rank components* as exact scores do:
    ``compare()`` says that.
    """
    import warnings

    k = scores.kind_index("informative")
    if scores.other is None:
        raise ValueError("The additivity check needs linear informative scores (with 'other').")
    linear_total = scores.prompt_totals[k].sum((1, 2)) + scores.other
    lin, ex = float(linear_total.mean()), float(change.mean())
    per_prompt = change.to(linear_total)
    scale = float(torch.maximum(linear_total.abs(), per_prompt.abs()).sum())
    gap = float((linear_total - per_prompt).abs().sum()) / scale if scale > 0 else 0.0
    other = float(scores.other.mean())
    out = {
        "exact_change": ex,
        "linear_change": lin,
        "relative_gap": gap,
        "other_share": other / lin if lin else float("nan"),
        "tolerance": ADDITIVITY_TOLERANCE,
        "ok": gap <= ADDITIVITY_TOLERANCE,
        "prompt_changes": [float(x) for x in change],
    }
    if warn and gap > ADDITIVITY_WARN:
        warnings.warn(
            f"The linear informative scores and 'other' miss each prompt's R(W') - R(W) by "
            f"{gap:.0%} (summed over prompts; on average they add up to {lin:.4g} against "
            f"{ex:.4g}): read them as a ranking "
            "of components, not as shares of the change (the update is large, or components "
            "interact). Whether the ranking holds is what compare(lin, causal_scores(..., "
            "top_k=...)) tells. See docs/scores.md §11.",
            AdditivityWarning,
            stacklevel=_user_stacklevel(),
        )
    return out


def _user_stacklevel() -> int:
    """The ``stacklevel`` that points a warning at the first frame outside extractive_lens."""
    import sys
    from pathlib import Path

    package = str(Path(__file__).resolve().parents[1])
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(package):
        frame, level = frame.f_back, level + 1  # type: ignore[assignment]
    return level


UPSTREAM_AUTO_BYTES = 256 * 2**20


def _auto_group(model: Any, chunk: PromptBatch) -> int | None:
    """All boundaries in one staircase pass if its activations stay small, else one at a time."""
    cfg = sizing(model).cfg
    per_layer = len(chunk) * chunk.n_pos * (cfg.d_model * 4 + (cfg.d_mlp or 0) * 2) * 4  # bytes
    staircase = per_layer * cfg.n_layers * cfg.n_layers  # ~2L entries, ~L/2 layers each
    return None if staircase <= UPSTREAM_AUTO_BYTES else 1


def _check_covered(deltas: Mapping[str, Tensor]) -> None:
    for n in deltas:
        if B.param_role(n).part == "unknown":
            raise NotImplementedError(
                f"Scores do not know how to credit the change of parameter {n!r}."
            )

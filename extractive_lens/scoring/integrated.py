"""Path-integrated informative / upstream / downstream scores (docs/scores.md §12).

>>> ig = integrated_scores(base, diff, batch)                  # per token, 4 Gauss nodes
>>> ig.method, ig.metadata["integrated"]["rule"]
('integrated', 'gauss')
>>> ig = integrated_scores(base, diff, batch, steps="auto")    # until complete within 1%

The linear scores take one gradient at one end of a change; these average the gradient along
the straight path of the change, so that they add up to the change itself (up to the
quadrature error, recorded in ``metadata["integrated"]``):

- **informative**: the path ``W + αΔ`` of the weights, all at once. At each node the linear
  informative split (per component and token, and "other") at the model ``W + αΔ``; their
  weighted sum adds up to ``R(W') - R(W)``.
- **upstream** and **downstream**: the exact engine's patch of component ``c`` (the value it
  adds to the stream right after ``c``: ``δ_c``) applied gradually, ``x + γ·δ_c`` for ``γ`` from
  0 to 1, in each context the exact score reads (``KINDS[kind].CONTEXTS``: the base model, and
  the layers after ``c`` finetuned). ``∫ <dR/dx(x + γδ_c), δ_c> dγ = R(x + δ_c) - R(x)``, the
  patch's exact effect, split by position: per token, the terms at that position. The exact
  score combines the contexts' effects (``kind.exact``), so whole components equal the exact
  whole-component scores up to the quadrature error.
- ``path="layer"``: one path per component group (all heads of a layer, or its MLP),
  ``x + γ·Σ_c δ_c``, split between the components by ``<g, δ_c>``: cheap (no factor of the
  number of heads), but the components' interactions are shared out, not separated.

The rows run on the pass executor (``scoring/passes.py``): a path's rows are nodes x
components x prompts entering at the component's boundary (``nodes.PathRows``), one backward
per ``max_batch`` rows through the whole graph (``passes.whole``). Where gradients go one layer
at a time (``runs.layerwise``: large models) the nodes of the weights' path, the finetuned run
and the finetuned-late paths run layer by layer together instead (``nodes.run_layer_major``),
each layer's Δ read once forward and once backward.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, cast

import torch
from torch import Tensor

from extractive_lens import backend as B
from extractive_lens.arguments import count
from extractive_lens.batch import PromptBatch
from extractive_lens.interrupts import guarded, one_call_per_model
from extractive_lens.results import ComponentScores
from extractive_lens.rewards import Reward
from extractive_lens.scoring import passes
from extractive_lens.scoring.ablation import table_for
from extractive_lens.scoring.assemble import assemble, base_metadata, plan_chunks, progress
from extractive_lens.scoring.causal import CausalChunk, mark_uncomputed, patch_groups, skipped_of
from extractive_lens.scoring.kinds import KINDS
from extractive_lens.scoring.nodes import PathRows, run_layer_major
from extractive_lens.scoring.options import CausalOptions, Per, check_arguments, prepare
from extractive_lens.scoring.runs import (
    Run,
    forward_run,
    head_grad,
    layerwise,
    wide,
)
from extractive_lens.types import SCORE_KINDS, Ablation, ScoreKind
from extractive_lens.weight_diff import WeightDiff

Path = Literal["component", "layer"]
Rule = Literal["gauss", "midpoint"]
DEFAULT_STEPS = 4
AUTO_TOLERANCE = 0.01
AUTO_MAX_STEPS = 32
MAX_STEPS = 256
"""The most nodes ``steps`` takes without ``force=True``: each node is one gradient pass along
every path, so the cost grows linearly with ``steps`` (Gauss–Legendre at 32 nodes is already
exact for polynomials of degree 63)."""
FORCE_MAX_STEPS = 4096
"""The most nodes ``steps`` takes at all (4096 Gauss–Legendre nodes take numpy ~20 s to form)."""
COMPLETENESS_WARN = 0.05
"""The completeness error past which ``integrated_scores`` warns (``CompletenessWarning``) and
``compare`` will not call the result a stand-in for the exact one."""


class CompletenessWarning(UserWarning):
    """The integrated scores miss the change they integrate by more than ``COMPLETENESS_WARN``."""


def nodes(steps: int, rule: Rule) -> tuple[list[float], list[float]]:
    """Quadrature nodes and weights on ``[0, 1]``: ``midpoint`` (error O(1/m²)) or
    Gauss–Legendre (``gauss``: exact for polynomials of degree 2m - 1).

    >>> nodes(2, "midpoint")
    ([0.25, 0.75], [0.5, 0.5])
    >>> [round(x, 4) for x in nodes(2, "gauss")[0]]
    [0.2113, 0.7887]
    """
    if rule == "midpoint":
        return [(i + 0.5) / steps for i in range(steps)], [1.0 / steps] * steps
    import numpy as np

    x, w = np.polynomial.legendre.leggauss(steps)
    return [float((xi + 1) / 2) for xi in x], [float(wi / 2) for wi in w]


@dataclass(frozen=True)
class IntegratedOptions(CausalOptions):
    """``integrated_scores``' options: the exact engine's, and the path and its quadrature."""

    steps: int | Literal["auto"] = DEFAULT_STEPS
    path: Path = "component"
    rule: Rule = "gauss"
    tolerance: float = AUTO_TOLERANCE
    force: bool = False

    def __post_init__(self) -> None:
        if self.convention != "paper":
            raise ValueError(
                f"integrated_scores(convention={self.convention!r}): path-integrated scores are "
                "defined in the paper's convention (they add up to its exact scores); use "
                "linear_scores(..., convention='authors_code') for the authors' approximations."
            )
        super().__post_init__()
        if self.steps != "auto":
            s = count("steps", self.steps, "quadrature nodes per path (or 'auto')")
            cost = (
                f"steps={s} is {s} gradient passes along every path (per kind, component and "
                f"prompt): {s / DEFAULT_STEPS:.4g} times the cost of the default steps="
                f"{DEFAULT_STEPS}"
            )
            if s > FORCE_MAX_STEPS:
                raise ValueError(
                    f"{cost}; at most {FORCE_MAX_STEPS} nodes are taken. Use steps='auto' (nodes "
                    f"doubled until complete within tolerance) or a few dozen nodes."
                )
            if s > MAX_STEPS and self.force is not True:
                raise ValueError(
                    f"{cost}. Past {MAX_STEPS} nodes pass force=True to run it anyway, or use "
                    "steps='auto' (nodes doubled until complete within tolerance)."
                )
            object.__setattr__(self, "steps", s)
        if self.path not in ("component", "layer"):
            raise ValueError(f"path must be 'component' or 'layer', got {self.path!r}")
        if self.rule not in ("gauss", "midpoint"):
            raise ValueError(f"rule must be 'gauss' or 'midpoint', got {self.rule!r}")
        if not (isinstance(self.tolerance, (int, float)) and self.tolerance > 0):
            raise ValueError(f"tolerance must be a positive number, got {self.tolerance!r}")


def integrated_scores(
    model: Any,
    diff: WeightDiff,
    batch: PromptBatch,
    *,
    kinds: Sequence[ScoreKind] | ScoreKind = SCORE_KINDS,
    steps: int | Literal["auto"] = DEFAULT_STEPS,
    path: Path = "component",
    rule: Rule = "gauss",
    tolerance: float = AUTO_TOLERANCE,
    force: bool = False,
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
    """Path-integrated scores of every head and MLP (module docstring; ``docs/scores.md`` §12).

    Args:
        steps: quadrature nodes per path, or ``"auto"``: 2, 4, 8 … (up to 32) until every
            kind's completeness error is under ``tolerance``.
        path: ``"component"`` (one path per component: whole components equal the exact
            scores up to the quadrature error) or ``"layer"`` (one per component group: cheap).
        rule: ``"gauss"`` (Gauss–Legendre, default) or ``"midpoint"``.
        tolerance: for ``steps="auto"``: the completeness error to reach.
        force: take more than ``MAX_STEPS`` (256) nodes: the cost grows linearly with
            ``steps`` (at most ``FORCE_MAX_STEPS``, 4096).
        per, ablation, reference, reward, max_batch, top_k, linear, layers, batch_size,
        resample_k, seed, show_progress, rows, compute_dtype, positions: as in
            ``causal_scores``.

    ``metadata["integrated"]`` records the nodes, the weights, the rule, the path and, per kind,
    the completeness error: informative ``Σ_p |Σ + other - (R(W') - R(W))|_p / Σ_p |R(W') -
    R(W)|_p`` over prompts; upstream and downstream ``Σ|path integral - endpoint difference| /
    Σ|endpoint difference|`` over components and prompts (the endpoints' rewards are one forward
    pass per path).
    """
    check_arguments("integrated_scores", model, diff, batch)
    options = IntegratedOptions(
        kinds=kinds, steps=steps, path=path, rule=rule, tolerance=tolerance, force=force, per=per,
        ablation=ablation, reference=reference, reward=reward, max_batch=max_batch, top_k=top_k,
        linear=linear, layers=layers, batch_size=batch_size, resample_k=resample_k, seed=seed,
        show_progress=show_progress, rows=rows, compute_dtype=compute_dtype,
        convention=convention, positions=positions,  # type: ignore[arg-type]
    )  # fmt: skip
    return integrated_scores_with(model, diff, batch, options)


@one_call_per_model
def integrated_scores_with(
    model: Any, diff: WeightDiff, batch: PromptBatch, options: IntegratedOptions
) -> ComponentScores:
    """``integrated_scores`` with its options as one ``IntegratedOptions`` object."""
    cdt = prepare("integrated_scores", model, diff, batch, options)
    skipped = skipped_of(model, diff, batch, options, cdt)
    scored, plan = plan_chunks(batch, options.rows, options.batch_size)
    chunks = [c for c, _ in plan]
    partial = options.top_k is not None or options.layers is not None
    meta = base_metadata(
        model, diff, options, batch, cdt, method="integrated", per=options.per,
        top_k=options.top_k, layers=None if options.layers is None else list(options.layers),
        skipped={k: list(v) for k, v in skipped.items()} if partial else None,
    )  # fmt: skip
    m = DEFAULT_STEPS if options.steps == "auto" else int(options.steps)
    tried: list[dict[str, Any]] = []
    with guarded(model), B.standard_flags(model), B.computing_in(model, cdt), B.reusing():
        while True:
            xs, ws = nodes(m, options.rule)
            out = _run(model, diff, batch, plan, chunks, options, skipped, xs, ws)
            errors = {k: out.completeness(k) for k in options.kinds}
            tried.append({"steps": m, "completeness": errors})
            done = all(e <= options.tolerance for e in errors.values() if e == e)
            if options.steps != "auto" or done or m >= AUTO_MAX_STEPS:
                break
            m *= 2
    meta["integrated"] = {
        "steps": m, "rule": options.rule, "path": options.path, "nodes": xs, "weights": ws,
        "completeness": errors, "tolerance": options.tolerance if options.steps == "auto" else None,
        "tried": tried, "R_change": out.change_summary(),
    }  # fmt: skip
    _warn_if_incomplete(errors, m, options)
    result = assemble(model, scored, options.score_kinds,
                      out.per_token if options.per == "token" else None, out.totals,
                      method="integrated", other=out.other if "informative" in options.kinds else None,
                      metadata=meta)  # fmt: skip
    return result.at_positions(options.positions)


def _warn_if_incomplete(errors: dict[str, float], m: int, options: IntegratedOptions) -> None:
    """``steps='auto'`` that did not reach its tolerance, or a fixed ``steps`` whose completeness
    error is past ``COMPLETENESS_WARN``: a ``CompletenessWarning`` that says what to rerun."""
    import warnings

    from extractive_lens.scoring.linear import _user_stacklevel

    shown = ", ".join(f"{k} {_share(v)}" for k, v in errors.items() if v == v)
    if options.steps == "auto":
        if all(e <= options.tolerance for e in errors.values() if e == e):
            return
        said = f"integrated_scores(steps='auto') stopped at {m} nodes with completeness errors " \
            f"{shown}, above tolerance {_share(options.tolerance)}"  # fmt: skip
    elif any(e > COMPLETENESS_WARN for e in errors.values() if e == e):
        said = f"integrated_scores(steps={m}) misses the change it integrates by {shown} " \
            f"(completeness error past {COMPLETENESS_WARN:.0%})"  # fmt: skip
    else:
        return
    warnings.warn(
        f"{said}: the path has too few nodes for how curved it is, so the scores do not add up "
        "to the change and are not yet a stand-in for the exact ones. Rerun with steps='auto' "
        "(or more steps, e.g. steps=16). See docs/scores.md §12.",
        CompletenessWarning,
        stacklevel=_user_stacklevel(),
    )


def _share(x: float) -> str:
    """A fraction as a percentage, or in scientific notation where a percentage with one
    decimal would round it to 0.0% (an error of 1.2e-05 against a tolerance of 1e-30)."""
    return f"{x:.1%}" if abs(x) >= 1e-3 or x == 0 else f"{x:.2g}"


@dataclass
class _Result:
    per_token: list[Tensor]  # per chunk [kind batch layer comp pos]
    totals: list[Tensor]  # per chunk [kind batch layer comp]
    other: list[Tensor]  # per chunk [batch]
    path_sums: dict[str, list[float]]  # kind -> [Σ|integral - endpoints|, Σ|endpoints|]
    change: list[Tensor]  # per chunk: R(W') - R(W)
    informative_sum: list[Tensor] = field(default_factory=list)  # per chunk [batch], every comp

    def completeness(self, kind: str) -> float:
        """``Σ_p |error_p| / Σ_p |change_p|`` over prompts (docs/scores.md §12): per prompt, so
        that errors of opposite sign in two prompts do not cancel."""
        if kind == "informative":  # every component's share (computed even where not reported)
            parts = zip(self.informative_sum, self.other, self.change)
            err = sum(float((t + o - c).abs().sum()) for t, o, c in parts)
            scale = sum(float(c.abs().sum()) for c in self.change)
        else:
            err, scale = self.path_sums[kind]
        return err / scale if scale else 0.0

    def change_summary(self) -> float | None:
        if not self.change:
            return None
        return float(torch.cat(self.change).mean())


def _run(
    model: Any, diff: WeightDiff, batch: PromptBatch, plan: list[tuple[PromptBatch, list[int]]],
    chunks: list[PromptBatch], options: IntegratedOptions, skipped: dict[str, list[str]],
    xs: list[float], ws: list[float],
) -> _Result:  # fmt: skip
    L, H, has_mlp = model.cfg.n_layers, model.cfg.n_heads, B.has_mlp(model)
    C = H + has_mlp
    kinds = options.score_kinds
    res = _Result([], [], [], {k: [0.0, 0.0] for k in kinds}, [])
    first = forward_run(model, chunks[0], options.reward_fn, capture=("z", "k", "v"))
    table = table_for(model, batch, options, chunks, first) if "upstream" in kinds else None
    bar = progress(range(len(chunks)), len(chunks), "integrated scores", options.show_progress)
    for i in bar:
        chunk = chunks[i]
        base = first if i == 0 else forward_run(model, chunk, options.reward_fn,
                                                 capture=("z", "k", "v"))  # fmt: skip
        b, pos = chunk.tokens.shape
        dtype, dev = wide(base.pre[0]).dtype, base.pre[0].device
        vals = torch.zeros(len(kinds), b, L, C, pos, dtype=dtype, device=dev)
        other = torch.zeros(b, dtype=dtype, device=dev)
        cc = CausalChunk(model, diff, chunk, base, plan[i][1], table, options)
        # where gradients go one layer at a time, every row that runs a shifted model (the
        # nodes, the finetuned run, upstream's finetuned-late paths) in one layer-major pass
        done = (
            run_layer_major(cc, options, options.path, skipped, xs, ws)
            if layerwise(model, chunk)
            else None
        )
        for k, kind in enumerate(kinds):
            if kind == "informative":
                if done is not None:
                    vals[k], other, change = done.informative
                else:
                    vals[k], other, change, ft = _informative(model, diff, chunk, options, base,
                                                              xs, ws)  # fmt: skip
                    cc.cached("finetuned_run", lambda: ft)  # downstream's patches read it
                res.change.append(change)
            else:
                late = None if done is None else done.late
                vals[k] = _along_patches(cc, kind, skipped.get(kind, []), options, xs, ws,
                                         res.path_sums[kind], late)  # fmt: skip
        vals = vals * chunk.position_mask.to(dev)[None, :, None, None, :]
        if "informative" in kinds:
            res.informative_sum.append(vals[kinds.index("informative")].sum((1, 2, 3)))
        tots = vals.sum(-1)
        mark_uncomputed(vals, tots, kinds, skipped, H)
        res.per_token.append(vals)
        res.totals.append(tots)
        res.other.append(other)
    return res


def _informative(
    model: Any, diff: WeightDiff, chunk: PromptBatch, options: IntegratedOptions, base: Any,
    xs: list[float], ws: list[float],
) -> tuple[Tensor, Tensor, Tensor, Run]:  # fmt: skip
    """Σ_i w_i · (linear informative at ``W + x_i Δ``), its "other" share, R(W') - R(W) and
    the finetuned run, node after node through the whole graph (where gradients go one layer
    at a time the nodes run in the layer-major pass instead: ``nodes.run_layer_major``)."""
    from extractive_lens.scoring.linear import LinearChunk, LinearOptions

    lin_options = LinearOptions(kinds=("informative",), reward=options.reward_fn,
                                ablation=options.ablation, rows=None)  # fmt: skip
    total = other = None
    for x, w in zip(xs, ws):
        with B.shifted(model, diff, x, keep=False):  # one node's W + xΔ at a time
            run = forward_run(model, chunk, options.reward_fn, grad=True)
            g_z = [head_grad(wide(g), W) for g, W in zip(run.g_attn, run.W_O)]
            c = LinearChunk(model, diff, diff.deltas, chunk, run, [], lin_options, None, g_z)
            inf = KINDS["informative"].linear(c)
        total = w * inf if total is None else total + w * inf
        o = cast(Tensor, c.other)
        other = w * o if other is None else other + w * o
    with torch.no_grad(), B.shifted(model, diff):
        ft = forward_run(model, chunk, options.reward_fn)
    change = wide(cast(Tensor, ft.reward)) - wide(cast(Tensor, base.reward))
    return cast(Tensor, total), cast(Tensor, other), change, ft


def _along_patches(
    cc: CausalChunk, kind: str, skip: list[str], options: IntegratedOptions, xs: list[float],
    ws: list[float], sums: list[float], late: dict[tuple[int, str], PathRows] | None = None,
) -> Tensor:  # fmt: skip
    """``[batch, layer, comp, pos]``: the kind's score from path integrals of its patches in each
    of its contexts, combined as the exact score combines patch effects. ``late``: the
    finetuned-late contexts' paths already run (``nodes.run_layer_major``)."""
    model = cc.model
    L, H = model.cfg.n_layers, model.cfg.n_heads
    b, pos = cc.batch.tokens.shape
    out = torch.zeros(b, L, H + cc.has_mlp, pos, dtype=wide(cc.base.pre[0]).dtype,
                      device=cc.base.pre[0].device)  # fmt: skip
    spec = KINDS[kind]
    for layer, group, d, idx in patch_groups(cc, kind, skip):
        effects, ends = {}, {}
        for name in spec.CONTEXTS:
            finetuned = name == "finetuned_late"
            if finetuned and late is not None:
                effects[name], ends[name] = late[(layer, group)].result()
                continue
            x0, start = passes.entry(model, cc.diff if finetuned else None, cc.base, layer, group)
            path = PathRows(x0, start, d, options.path, options.max_batch, xs, ws,
                        None if finetuned else cc.base.reward)  # fmt: skip
            with B.shifted(model, cc.diff) if finetuned else contextlib.nullcontext():
                passes.whole(model, cc.batch, options.reward_fn, path.entries, rows=cc.by_rows)
            effects[name], ends[name] = path.result()
        tok = spec.exact(effects)  # [b, comp, pos]
        whole_end = spec.exact(ends)  # [b, comp] (or [b] for the layer path)
        whole = tok.sum(-1) if options.path == "component" else tok.sum((-1, -2))
        sums[0] += float((whole - whole_end).abs().sum())
        sums[1] += float(whole_end.abs().sum())
        out[:, layer, idx.to(out.device)] = tok.to(out.dtype)
    return out

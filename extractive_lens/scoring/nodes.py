"""The integrated method's rows: its nodes and its paths, run on the pass executor.

At each quadrature node ``x_i`` integrated informative needs the linear informative split at
the model ``W + x_iΔ``: a forward and a backward pass and each layer's forward-mode pass along
Δ. Upstream and downstream need, per component group and context, a path integral: rows that
enter the model at the group's boundary, the path's rows ``x + γ_iδ`` (forward, and their
gradient back to the boundary), the endpoints ``x + δ`` and the context's ``x`` (forward, for
their rewards): ``PathRows``, whose rows run through the whole graph (``passes.whole``) or in a
layer-major pass.

Run one after another, every node and every finetuned-late path reads every later layer's Δ
again. Where gradients go one layer at a time (``runs.layerwise``), ``run_layer_major`` puts
them in one ``passes.layer_major`` pass: the nodes and the finetuned run (downstream's patches
read it) as lanes, one per weight setting (``shift.Shift``, sharing one store of Δ), upstream's
finetuned-late paths as entries. Each node's backward step (``_back``) re-runs its layer with a
graph, carries the gradient back and computes the layer's informative scores by a forward-mode
pass at that node's weights, reading the Δ the shifts have loaded: each layer's Δ is read once
forward and once backward for the whole call. Kept between the two sweeps: each node's stream
entering each layer and each path's gradient rows entering each layer after its boundary (up to
``passes.SWEEP_BYTES``; past it the paths are split into passes).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import Tensor

from extractive_lens import backend as B
from extractive_lens.backend import LayerRun, shift
from extractive_lens.scoring import passes, runs
from extractive_lens.scoring.causal import CausalChunk, patch_groups
from extractive_lens.scoring.kinds import KINDS
from extractive_lens.scoring.kinds.protocols import LayerStep
from extractive_lens.scoring.options import CausalOptions
from extractive_lens.scoring.runs import LayerW_O, Run, head_grad, wide

if TYPE_CHECKING:  # pragma: no cover
    from extractive_lens.backend.blocks import Where


class PathRows:
    """One component group's path integral in one context as ``passes.Entry`` rows: the
    context's stream ``x0`` at boundary ``start``, each component's patch ``δ_c`` (``delta
    [batch, pos, comp, d_model]``; the layer path moves all components at once along
    ``x + γΣδ_c``), nodes ``xs`` with weights ``ws``, at most ``max_batch`` rows a pass.
    ``entries``: the path's rows (with their gradient), the endpoints ``x0 + δ`` and, unless
    the context's reward is given, ``x0``. After they ran, ``result()``."""

    def __init__(self, x0: Tensor, start: tuple[int, Where], delta: Tensor, path: str,
                 max_batch: int, xs: list[float], ws: list[float],
                 reward: Tensor | None = None) -> None:  # fmt: skip
        d = delta.to(x0.dtype)
        if path == "layer":
            d = d.sum(2, keepdim=True)  # one path: [b, pos, 1, d_model]
        b, paths = x0.shape[0], d.shape[2]
        self.delta, self.d, self.ws, self.path, self.R0 = delta, d, ws, path, reward
        per_pass = max(1, max_batch // b)
        # rows: (node, path, prompt), prompts innermost so that each pass holds whole copies
        jobs = [(i, p) for i in range(len(xs)) for p in range(paths)]

        def rows(part: list[tuple[float, int]]) -> Any:
            return lambda: torch.cat([x0 + a * d[:, :, p] for a, p in part])

        self.jobs = [jobs[j : j + per_pass] for j in range(0, len(jobs), per_pass)]
        self.grads = [passes.Entry(start, len(part), rows([(xs[i], p) for i, p in part]), True)
                      for part in self.jobs]  # fmt: skip
        ends = [list(range(j, min(j + per_pass, paths))) for j in range(0, paths, per_pass)]
        self.ends = [(ps, passes.Entry(start, len(ps), rows([(1.0, p) for p in ps]), False))
                     for ps in ends]  # fmt: skip
        self.context = None if reward is not None else passes.Entry(start, 1, lambda: x0, False)
        self.entries = [*self.grads, *(e for _, e in self.ends)]
        self.entries += [] if self.context is None else [self.context]

    def result(self) -> tuple[Tensor, Tensor]:
        """``∫ <dR/dx(x + γδ_c), δ_c> dγ`` by position, ``[batch, comp, pos]``, and the endpoint
        differences ``R(x + δ_c) - R(x)`` (``[batch, comp]``; for the layer path ``[batch]``)."""
        b, pos, n_comp, _ = self.delta.shape
        g0 = cast(Tensor, self.grads[0].g)
        integrand = torch.zeros(b, n_comp, pos, dtype=wide(g0).dtype, device=g0.device)
        for part, e in zip(self.jobs, self.grads):
            g = cast(Tensor, e.g)
            for r, (i, p) in enumerate(part):
                gi = wide(g[r * b : (r + 1) * b])  # [b, pos, d_model]
                if self.path == "layer":
                    integrand += self.ws[i] * torch.einsum("bpd,bpcd->bcp", gi, wide(self.delta))
                else:
                    integrand[:, p] += self.ws[i] * (gi * wide(self.d[:, :, p])).sum(-1)
        R0 = wide(cast(Tensor, self.R0 if self.context is None else self.context.reward))
        ends = torch.zeros(b, self.d.shape[2], dtype=R0.dtype, device=R0.device)
        for ps, e in self.ends:
            ends[:, ps] = wide(cast(Tensor, e.reward)).reshape(len(ps), b).T - R0[:, None]
        return integrand, (ends[:, 0] if self.path == "layer" else ends)


@dataclass
class Done:
    """The layer-major pass's results for one chunk: informative's ``(Σ, other, R(W') -
    R(W))`` (``None`` without it) and upstream's finetuned-late paths by ``(layer, group)``."""

    informative: Any
    late: dict[tuple[int, str], PathRows]


def run_layer_major(
    cc: CausalChunk, options: CausalOptions, path: str, skipped: dict[str, list[str]],
    xs: list[float], ws: list[float],
) -> Done:  # fmt: skip
    """The informative nodes, the finetuned run (downstream's patches read it) and upstream's
    finetuned-late paths in one layer-major pass (module docstring)."""
    from extractive_lens.scoring.linear import LinearChunk, LinearOptions

    model, diff, chunk, kinds = cc.model, cc.diff, cc.batch, options.score_kinds
    late: dict[tuple[int, str], PathRows] = {}
    if "upstream" in kinds:
        for layer, group, d, _ in patch_groups(cc, "upstream", skipped.get("upstream", [])):
            x0, start = passes.entry(model, diff, cc.base, layer, group)
            late[(layer, group)] = PathRows(x0, start, d, path, options.max_batch, xs, ws)
    informative = "informative" in kinds
    lin_options = LinearOptions(kinds=("informative",), reward=options.reward_fn,
                                ablation=options.ablation, rows=None)  # fmt: skip
    store = shift.store_of(model, diff)
    ft_shift = shift.Shift(model, diff, 1.0, store)
    chunks: list[Any] = []
    lanes = []
    for x in xs if informative else ():
        s = shift.Shift(model, diff, x, store)
        run = _empty_run(model, s)
        g_z: list[Any] = [None] * model.cfg.n_layers  # filled layer by layer
        c = LinearChunk(model, diff, diff.deltas, chunk, run, [], lin_options, None, g_z)
        lane = passes.Lane(s, back=functools.partial(_back, c))
        run.pre = lane.kept  # the stream entering each layer, kept by the pass
        chunks.append(c)
        lanes.append(lane)
    ft = Run() if informative or "downstream" in kinds else None
    if ft is not None:
        lanes.append(passes.Lane(ft_shift, on_layer=lambda layer, step: _record(ft, step)))
    entries = [e for p in late.values() for e in p.entries]
    passes.layer_major(model, chunk, options.reward_fn, lanes, entries, ft_shift)
    result = None
    if ft is not None:
        ft.reward, ft.post_final, ft.W_O = (
            lanes[-1].reward,
            lanes[-1].read,
            LayerW_O(model, ft_shift),
        )
        cc.cached("finetuned_run", lambda: ft)
    if informative:
        total = other = None
        for c, lane, w in zip(chunks, lanes, ws):
            c.base.reward, c.base.post_final, c.base.g_logits = (
                lane.reward,
                lane.read,
                lane.g_logits,
            )
            c.base.g_embed = lane.g
            with shift.within(lane.shift):
                inf = KINDS["informative"].linear(c)
            o = cast(Tensor, c.other)
            total = w * inf if total is None else total + w * inf
            other = w * o if other is None else other + w * o
        change = wide(cast(Tensor, lanes[-1].reward)) - wide(cast(Tensor, cc.base.reward))
        result = (total, other, change)
    return Done(result, late)


def _record(ft: Run, step: LayerRun) -> None:
    """The finetuned run's record of a layer, as ``runs.forward_run`` keeps it."""
    ft.pre.append(step.pre)
    ft.mid.append(step.mid)
    if step.mlp_out is not None:
        ft.mlp_in.append(step.mlp_in)  # type: ignore[arg-type]
        ft.mlp_out.append(step.mlp_out)
    ft.post.append(step.post)
    ft.z.append(step.captured["z"])
    ft.captured.append(dict(step.captured))


def _empty_run(model: Any, s: shift.Shift) -> Run:
    """A node's run, its per-layer lists filled by the backward sweep (and emptied after)."""
    none: list[Any] = [None] * model.cfg.n_layers
    run = Run(mlp_in=list(none), z=list(none), g_attn=list(none),
              g_mlp=list(none) if B.has_mlp(model) else [],
              g_captured=[{} for _ in none])  # fmt: skip
    run.W_O = LayerW_O(model, s)
    return run


def _back(c: Any, layer: int, x: Tensor, g: Tensor) -> Tensor:
    """One node's layer, backward: the layer re-run on its kept input with a graph, the
    gradient carried back through it, and the layer's informative scores (forward-mode pass at
    this node's weights, reading the Δ the shifts have loaded) into ``c.swept``.
    The layer's values and gradients are dropped after: the run keeps no layer."""
    run: Run = c.base
    if "informative" not in c.swept:
        c.swept["informative"] = c.new_scores()
    live: list[LayerRun] = []
    g_in, step = runs.layer_vjp(c.model, x, (layer, "pre"), g, ("z",), live)
    assert step is not None
    values = live[0]
    run.z[layer] = values.captured["z"].detach()
    run.g_attn[layer] = step.attn_out
    if values.mlp_in is not None:
        run.mlp_in[layer] = values.mlp_in.detach()
        run.g_mlp[layer] = cast(Tensor, step.mlp_out)
    c.g_z[layer] = head_grad(wide(step.attn_out), run.W_O[layer])
    with torch.no_grad():
        KINDS["informative"].layer_linear(c, LayerStep(layer), c.swept["informative"])
    for field in (run.z, run.g_attn, run.mlp_in, c.g_z, run.g_mlp):
        if field:
            cast(list[Any], field)[layer] = None
    return g_in

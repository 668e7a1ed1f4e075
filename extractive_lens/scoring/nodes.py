"""The integrated method's layer-major pass (#41): every row that runs the finetuned or a
shifted model moves through the layers together, so each layer's Δ is read once forward and
once backward for the whole call.

At each quadrature node ``x_i`` integrated informative needs the linear informative split at
the model ``W + x_iΔ``: a forward and a backward pass and each layer's forward-mode pass along
Δ. Upstream's finetuned-late context needs, per component group, rows that enter the
finetuned model at the group's boundary: the path's rows ``x + γ_iδ`` (forward, and their
gradient back to the boundary), the endpoints ``x + δ`` and the context ``x`` (forward, for
their rewards). Run one after another, every node and every path reads every later layer's Δ
again. Here, where gradients go one layer at a time (``runs.layerwise``), they advance
together: forward, layer by layer, every node's rows, the finetuned model's (``R(W')``, and
the finetuned run downstream reads) and every path's rows from their boundary on (``Entry``)
through the layer while its Δ is loaded; then backward, layer by layer, every node's
vector-Jacobian product and its forward-mode pass, and every path's. The shifts share one
store of Δ (``shift.Store``), so each layer's Δ is read once forward and once backward.

Kept between the two sweeps: each node's stream entering each layer (one ``[batch, pos,
d_model]`` per node and layer) and each path's gradient rows entering each layer after its
boundary; the values the informative scores read at a layer (``z``, the MLP's input) come from
the backward pass's re-run of that layer. Paths' rows run ``runs.BLOCK_TOKENS`` tokens at a
time through a layer. Where the paths' kept rows would pass ``upstream.SWEEP_BYTES``, they are
split into passes (``layer_major``), each further pass reading the layers after its first
boundary again.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import Tensor

from extractive_lens import backend as B
from extractive_lens.backend import LayerRun, shift
from extractive_lens.backend.blocks import Where
from extractive_lens.scoring import passes, runs
from extractive_lens.scoring.kinds import KINDS
from extractive_lens.scoring.kinds.protocols import LayerStep
from extractive_lens.scoring.runs import LayerW_O, Run, head_grad, readout, wide

if TYPE_CHECKING:  # pragma: no cover
    from extractive_lens.batch import PromptBatch
    from extractive_lens.rewards import Reward
    from extractive_lens.scoring.linear import LinearOptions
    from extractive_lens.weight_diff import WeightDiff


@dataclass
class Entry:
    """Rows that enter the finetuned model at boundary ``start`` (``(layer, "mid")``: before
    the layer's MLP; ``(layer, "post")``: after the layer) and run with the pass's finetuned
    rows: ``copies`` stacked copies of the chunk, formed by ``make()`` when they enter. After
    the pass: ``reward`` (``[copies · batch]``) and, with ``grad``, ``g``: ``dR/d rows`` at
    the boundary."""

    start: tuple[int, Where]
    copies: int
    make: Callable[[], Tensor]
    grad: bool
    reward: Tensor | None = None
    g: Tensor | None = None


@dataclass
class Pass:
    """What ``layer_major`` returns: informative's ``Σ_i w_i Ī(W + x_iΔ)`` and its "other"
    share (``None`` without nodes), the finetuned run (``None`` when not asked for)."""

    informative: Tensor | None
    other: Tensor | None
    finetuned: Run | None


def layer_major(
    model: Any, diff: WeightDiff, chunk: PromptBatch, reward_fn: Reward, *,
    xs: Sequence[float] = (), ws: Sequence[float] = (), options: LinearOptions | None = None,
    finetuned: bool = False, entries: Sequence[Entry] = (),
) -> Pass:  # fmt: skip
    """The nodes ``xs`` (weights ``ws``; informative with ``options``), the finetuned run
    (``finetuned``, or whenever there are nodes: ``R(W')``) and the paths' ``entries`` in
    layer-major passes (module docstring): the first pass carries the nodes, the finetuned
    rows and the entries that fit in ``upstream.SWEEP_BYTES`` of kept rows, first boundaries
    first; each further pass the next entries."""
    packs = _packs(model, chunk, list(entries))
    out = _one_pass(model, diff, chunk, reward_fn, list(xs), list(ws), options,
                    finetuned or bool(xs), packs[0] if packs else [])  # fmt: skip
    for pack in packs[1:]:
        _one_pass(model, diff, chunk, reward_fn, [], [], None, False, pack)
    return out


def _packs(model: Any, chunk: PromptBatch, entries: list[Entry]) -> list[list[Entry]]:
    """The entries by boundary, split so that each pass's rows (the gradient rows at every
    layer after their boundary, the others once) stay under ``upstream.SWEEP_BYTES``."""
    from extractive_lens.backend import compute
    from extractive_lens.scoring.kinds import upstream

    L = model.cfg.n_layers
    dtype = compute.compute_dtype() or model.cfg.dtype
    item = torch.empty(0, dtype=torch.promote_types(dtype, torch.float32)).element_size()
    copy = len(chunk) * chunk.n_pos * runs.sizing(model).cfg.d_model * item

    def cost(e: Entry) -> int:
        return e.copies * copy * ((L - e.start[0]) if e.grad else 1)

    return passes.packs(sorted(entries, key=lambda e: e.start[0]), cost, upstream.SWEEP_BYTES)


def _one_pass(
    model: Any, diff: WeightDiff, chunk: PromptBatch, reward_fn: Reward, xs: list[float],
    ws: list[float], options: LinearOptions | None, with_ft: bool, entries: list[Entry],
) -> Pass:  # fmt: skip
    """One layer-major pass (``layer_major``)."""
    from extractive_lens.scoring.linear import LinearChunk

    L = model.cfg.n_layers
    store = shift.store_of(model, diff)
    lanes = [shift.Shift(model, diff, x, store) for x in xs]
    ft_shift = shift.Shift(model, diff, 1.0, store)
    ft = Run() if with_ft else None
    node_runs = [_empty_run(L, model, s) for s in lanes]
    kept = [cast(list[Any], run.pre) for run in node_runs]  # each node's stream entering each layer
    rows = runs.block_rows(chunk.n_pos)  # the paths' rows per block: BLOCK_TOKENS tokens
    live: dict[int, Tensor] = {}  # entry -> its rows now
    entry_kept: dict[int, dict[tuple[int, Where], Tensor]] = {}  # entry -> its rows entering a step

    def observe(step: LayerRun) -> None:  # the finetuned run: forward_run's record
        assert ft is not None
        ft.pre.append(step.pre)
        ft.mid.append(step.mid)
        if step.mlp_out is not None:
            ft.mlp_in.append(step.mlp_in)  # type: ignore[arg-type]
            ft.mlp_out.append(step.mlp_out)
        ft.post.append(step.post)
        ft.z.append(step.captured["z"])
        ft.captured.append(dict(step.captured))

    def step(i: int, x: Tensor, at: tuple[int, Where]) -> Tensor:
        """Entry ``i``'s rows from boundary ``at`` to the end of its layer, kept for backward."""
        if entries[i].grad:
            entry_kept.setdefault(i, {})[at] = x
        return runs.through(model, x, at, rows)

    tokens = chunk.tokens.to(model.cfg.device)
    whole = [*lanes, ft_shift] if ft is not None else lanes
    if not whole and not entries:  # nothing runs a shifted model (every path skipped)
        return Pass(None, None, None)
    first = 0 if whole else min(e.start[0] for e in entries)
    with B.frozen_parameters(model):
        with torch.no_grad():
            xs_now: list[Tensor] = []
            for s in whole:
                with shift.within(s):
                    xs_now.append(B.embed(model, tokens))
            for layer in range(first, L):
                for k, s in enumerate(whole):
                    if k < len(lanes):
                        kept[k][layer] = xs_now[k]
                    with shift.within(s):
                        y = B.run_blocks(model, xs_now[k], start=(layer, "pre"), stop=layer + 1,
                                         capture=("z",), observe=None if k < len(lanes) else observe)  # fmt: skip
                    xs_now[k] = cast(Tensor, y)
                with shift.within(ft_shift):
                    for i, x in live.items():  # the paths already in: through this layer
                        live[i] = step(i, x, (layer, "pre"))
                    for i, e in enumerate(entries):  # the paths entering in this layer
                        if e.start[0] == layer:
                            x = e.make()
                            live[i] = x if e.start[1] == "post" else step(i, x, e.start)
            if ft is not None and lanes:  # R(W'): informative's change (downstream reads no R)
                with shift.within(ft_shift):
                    R, _, x_read = readout(model, xs_now[-1], chunk, reward_fn)
                ft.reward, ft.post_final = R, x_read
            if ft is not None:
                ft.W_O = LayerW_O(model, ft_shift)
        grads: list[Tensor] = []
        for k, s in enumerate(lanes):
            with shift.within(s), torch.enable_grad():
                xf = xs_now[k].detach().requires_grad_(True)
                R, logits, x_read = readout(model, xf, chunk, reward_fn)
                g, g_logits = torch.autograd.grad(R.sum(), [xf, logits])
            grads.append(g)
            node_runs[k].reward, node_runs[k].post_final = R.detach(), x_read.detach()
            node_runs[k].g_logits = g_logits
        entry_grads: dict[int, Tensor] = {}
        for i, e in enumerate(entries):
            with shift.within(ft_shift), torch.set_grad_enabled(e.grad):
                xf = live.pop(i).detach().requires_grad_(e.grad)
                R, _, _ = readout(model, xf, chunk, reward_fn, groups=e.copies)
                if e.grad:
                    (entry_grads[i],) = torch.autograd.grad(R.sum(), [xf])
            e.reward = R.detach()
        chunks = []
        for run in node_runs:
            g_z: list[Tensor] = [None] * L  # type: ignore[list-item]  # filled layer by layer
            c = LinearChunk(model, diff, diff.deltas, chunk, run, [], cast(Any, options), None, g_z)
            c.swept["informative"] = c.new_scores()
            chunks.append(c)
        for layer in reversed(range(first, L)):
            for k, s in enumerate(lanes):
                with shift.within(s):
                    grads[k] = _back(chunks[k], layer, cast(Tensor, kept[k][layer]), grads[k])
                if layer > 0:  # layer 0's stays: the chunk reads its dtype and device
                    kept[k][layer] = None
            with shift.within(ft_shift):
                for i in list(entry_grads):
                    entry_grads[i] = _path_back(model, entries[i], layer, entry_kept.setdefault(i, {}),
                                                entry_grads[i], rows)  # fmt: skip
                    if entries[i].start[0] == layer:
                        entries[i].g = entry_grads.pop(i)
        scores = []
        for k, s in enumerate(lanes):
            node_runs[k].g_embed = grads[k]
            with shift.within(s):
                scores.append(KINDS["informative"].linear(chunks[k]))
    total = other = None
    for inf, c, w in zip(scores, chunks, ws):
        o = cast(Tensor, c.other)
        total = w * inf if total is None else total + w * inf
        other = w * o if other is None else other + w * o
    return Pass(total, other, ft)


def _path_back(
    model: Any, e: Entry, layer: int, kept: dict[tuple[int, Where], Tensor], g: Tensor, rows: int
) -> Tensor:
    """A path's gradient carried back through ``layer`` (from its boundary, in the layer where
    it entered), ``rows`` rows at a time, each step's kept rows dropped after."""
    for at in ((layer, "pre"), e.start):
        x = kept.pop(at, None) if at[0] == layer else None
        if x is not None:
            g = runs.back(model, x, at, g, rows)
    return g


def _empty_run(L: int, model: Any, s: shift.Shift) -> Run:
    """A node's run, its per-layer lists filled by the backward sweep (and emptied after)."""
    none: list[Any] = [None] * L
    run = Run(pre=list(none), mlp_in=list(none), z=list(none), g_attn=list(none),
              g_mlp=list(none) if B.has_mlp(model) else [], g_captured=[{} for _ in range(L)])  # fmt: skip
    run.W_O = LayerW_O(model, s)
    return run


def _back(c: Any, layer: int, x: Tensor, g: Tensor) -> Tensor:
    """One node's layer, backward: the layer re-run on its kept input with a graph, the
    gradient carried back through it, and the layer's informative scores (forward-mode pass at
    this node's weights, reading the Δ the shifts have loaded) into ``c.swept``.
    The layer's values and gradients are dropped after: the run keeps no layer."""
    run: Run = c.base
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

"""The integrated method's informative nodes, layer by layer side by side (#41).

At each quadrature node ``x_i`` integrated informative needs the linear informative split at
the model ``W + x_iΔ``: a forward and a backward pass and each layer's forward-mode pass along
Δ. Run node after node, every node reads every layer's Δ again (three times: forward,
backward and its forward-mode pass). Here, where gradients go one layer at a time
(``runs.layerwise``), the nodes advance together: forward, layer by layer, every node's rows
and the finetuned model's (``R(W')``, and the finetuned run downstream reads) through the
layer while its Δ is loaded; then backward, layer by layer, every node's vector-Jacobian
product and its forward-mode pass. The shifts of the nodes share one store of Δ
(``shift.Store``), so each layer's Δ is read once forward and once backward for all nodes.

Kept between the two sweeps: each node's stream entering each layer (one ``[batch, pos,
d_model]`` per node and layer); the values the informative scores read at a layer (``z``, the
MLP's input) come from the backward pass's re-run of that layer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import torch
from torch import Tensor

from extractive_lens import backend as B
from extractive_lens.backend import LayerRun, shift
from extractive_lens.scoring.kinds import KINDS
from extractive_lens.scoring.kinds.informative import layer_linear
from extractive_lens.scoring.runs import LayerW_O, Run, head_grad, layer_vjp, readout, wide

if TYPE_CHECKING:  # pragma: no cover
    from extractive_lens.batch import PromptBatch
    from extractive_lens.rewards import Reward
    from extractive_lens.scoring.linear import LinearOptions
    from extractive_lens.weight_diff import WeightDiff


def informative_nodes(
    model: Any, diff: WeightDiff, chunk: PromptBatch, reward_fn: Reward, xs: list[float],
    ws: list[float], options: LinearOptions,
) -> tuple[Tensor, Tensor, Tensor, Run]:  # fmt: skip
    """``(Σ_i w_i Ī(W + x_iΔ), Σ_i w_i other_i, R(W'), the finetuned run)`` (module docstring)."""
    from extractive_lens.scoring.linear import LinearChunk

    L, b = model.cfg.n_layers, len(chunk)
    store = shift.store_of(model, diff)
    lanes = [shift.Shift(model, diff, x, store) for x in xs]
    finetuned = shift.Shift(model, diff, 1.0, store)
    ft = Run()
    runs = [_empty_run(L, model, s) for s in lanes]
    kept = [cast(list[Any], run.pre) for run in runs]  # each node's stream entering each layer

    def observe(step: LayerRun) -> None:  # the finetuned run: forward_run's record
        ft.pre.append(step.pre)
        ft.mid.append(step.mid)
        if step.mlp_out is not None:
            ft.mlp_in.append(step.mlp_in)  # type: ignore[arg-type]
            ft.mlp_out.append(step.mlp_out)
        ft.post.append(step.post)
        ft.z.append(step.captured["z"])
        ft.captured.append(dict(step.captured))

    tokens = chunk.tokens.to(model.cfg.device)
    with B.frozen_parameters(model):
        with torch.no_grad():
            xs_now: list[Tensor] = []
            for s in [*lanes, finetuned]:
                with shift.within(s):
                    xs_now.append(B.embed(model, tokens))
            for layer in range(L):
                for k, s in enumerate([*lanes, finetuned]):
                    if k < len(lanes):
                        kept[k][layer] = xs_now[k]
                    with shift.within(s):
                        y = B.run_blocks(model, xs_now[k], start=(layer, "pre"), stop=layer + 1,
                                         capture=("z",), observe=None if k < len(lanes) else observe)  # fmt: skip
                    xs_now[k] = cast(Tensor, y)
            with shift.within(finetuned):
                R, _, x_read = readout(model, xs_now[-1], chunk, reward_fn)
            ft.reward, ft.post_final = R, x_read
            ft.W_O = LayerW_O(model, finetuned)
        grads: list[Tensor] = []
        for k, s in enumerate(lanes):
            with shift.within(s), torch.enable_grad():
                xf = xs_now[k].detach().requires_grad_(True)
                R, logits, x_read = readout(model, xf, chunk, reward_fn)
                g, g_logits = torch.autograd.grad(R.sum(), [xf, logits])
            grads.append(g)
            runs[k].reward, runs[k].post_final = R.detach(), x_read.detach()
            runs[k].g_logits = g_logits
        chunks = []
        for run in runs:
            g_z: list[Tensor] = [None] * L  # type: ignore[list-item]  # filled layer by layer
            c = LinearChunk(model, diff, diff.deltas, chunk, run, [], options, None, g_z)
            inf = c.new_scores()
            c.informative_blocks = (inf, torch.zeros(b, dtype=c.dtype, device=inf.device))
            chunks.append(c)
        for layer in reversed(range(L)):
            for k, s in enumerate(lanes):
                with shift.within(s):
                    grads[k] = _back(chunks[k], layer, cast(Tensor, kept[k][layer]), grads[k])
                if layer > 0:  # layer 0's stays: the chunk reads its dtype and device
                    kept[k][layer] = None
        for k, s in enumerate(lanes):
            runs[k].g_embed = grads[k]
            with shift.within(s):
                chunks[k].informative_blocks = (
                    KINDS["informative"].linear(chunks[k]),
                    cast(Tensor, chunks[k].other),
                )
    total = other = None
    for c, w in zip(chunks, ws):
        inf, o = cast(tuple[Tensor, Tensor], c.informative_blocks)
        total = w * inf if total is None else total + w * inf
        other = w * o if other is None else other + w * o
    return cast(Tensor, total), cast(Tensor, other), cast(Tensor, ft.reward), ft


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
    this node's weights, reading the Δ the shifts have loaded) into ``c.informative_blocks``.
    The layer's values and gradients are dropped after: the run keeps no layer."""
    run: Run = c.base
    live: list[LayerRun] = []
    g_in, step = layer_vjp(c.model, x, (layer, "pre"), g, ("z",), live)
    assert step is not None
    values = live[0]
    run.z[layer] = values.captured["z"].detach()
    run.g_attn[layer] = step.attn_out
    if values.mlp_in is not None:
        run.mlp_in[layer] = values.mlp_in.detach()
        run.g_mlp[layer] = cast(Tensor, step.mlp_out)
    c.g_z[layer] = head_grad(wide(step.attn_out), run.W_O[layer])
    inf, other = c.informative_blocks
    with torch.no_grad():
        layer_linear(c, [layer], inf, other)
    for field in (run.z, run.g_attn, run.mlp_in, c.g_z, run.g_mlp):
        if field:
            cast(list[Any], field)[layer] = None
    return g_in

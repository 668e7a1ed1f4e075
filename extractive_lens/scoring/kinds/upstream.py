"""Upstream scores (docs/scores.md §4–5, §7): how much each component's output matters to R
*through* the finetuned later layers. Exact: the effect of ablating the component to ``y*``
with the layers after it finetuned, minus the same effect in the base model (a double
difference). Linear: ``<ŷ'_c - ŷ_c, y_c - y*_c>`` with ``ŷ'`` the gradient at the base
activations with the later layers finetuned ("staircase" pass, below).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from extractive_lens import backend as B
from extractive_lens.scoring.runs import Run, grad_at, head_grad, head_out, layerwise, readout, wide

if TYPE_CHECKING:  # pragma: no cover
    from extractive_lens.batch import PromptBatch
    from extractive_lens.rewards import Reward
    from extractive_lens.scoring.kinds.protocols import CausalChunk, LinearChunk
    from extractive_lens.scoring.options import ScoreOptions
    from extractive_lens.weight_diff import WeightDiff

CONTEXTS = ("base", "finetuned_late")


def needs(options: ScoreOptions) -> set[str]:
    # the authors' code takes ŷ' from the finetuned model's own run, the paper at base activations
    return {"finetuned_grad"} if options.authors else {"upstream_grads"}


def capture(options: ScoreOptions) -> tuple[str, ...]:
    return ()


def linear(chunk: LinearChunk) -> Tensor:
    model, base = chunk.model, chunk.base
    H, has_mlp = model.cfg.n_heads, B.has_mlp(model)
    assert chunk.table is not None
    z_star, m_star = chunk.table.for_rows(chunk.rows, chunk.batch, base)
    if chunk.options.authors:
        assert chunk.ft is not None
        gp_z = [head_grad(wide(g), W) for g, W in zip(chunk.ft.g_attn, chunk.ft.W_O)]
        gp_mlp = chunk.ft.g_mlp
    else:
        assert chunk.gp_attn is not None and chunk.gp_mlp is not None
        gp_z = [head_grad(wide(g), W) for g, W in zip(chunk.gp_attn, base.W_O)]
        gp_mlp = chunk.gp_mlp
    out = chunk.new_scores()
    for layer in range(model.cfg.n_layers):
        dz = wide(base.z[layer]) - z_star[:, :, layer]
        out[:, layer, :H] = ((gp_z[layer] - chunk.g_z[layer]) * dz).sum(-1).transpose(1, 2)
        if has_mlp:
            assert m_star is not None
            dm = wide(base.mlp_out[layer]) - m_star[:, :, layer]
            g = wide(gp_mlp[layer]) - wide(base.g_mlp[layer])
            out[:, layer, H] = (g * dm).sum(-1)
    return out


def upstream_gradients(
    model: Any, diff: WeightDiff, chunk: PromptBatch, base: Run, reward_fn: Reward,
    group: int | None = None,
) -> tuple[list[Tensor], list[Tensor]]:  # fmt: skip
    """``ŷ'`` at every layer boundary: ``dR/dy_c`` with ``W_late`` finetuned, at base activations.

    Call with the finetuned weights applied (``with diff.applied(model):``); ``base`` is the
    cached base run.

    The base residual stream enters the finetuned model right after each component (heads of
    layer l: where they re-enter, with ``b_O'``; MLP l: after the MLP) as extra rows of one
    growing batch; one backward gives every boundary's gradient. ``group`` bounds how many
    boundaries share a pass (memory).
    """
    L, has_mlp = model.cfg.n_layers, B.has_mlp(model)
    parts = ("attn", "mlp") if has_mlp else ("attn",)
    boundaries = [(layer, part) for layer in range(L) for part in parts]
    group = group or len(boundaries)
    grads: dict[tuple[int, str], Tensor] = {}
    if layerwise(model, chunk):  # one boundary at a time, one layer's graph at a time
        with B.frozen_parameters(model):
            for layer, part in boundaries:
                source, start = _entry(model, diff, base, layer, part)
                grads[(layer, part)] = grad_at(model, source, start, chunk, reward_fn)
        return _split(grads, L, has_mlp)
    for g0 in range(0, len(boundaries), group):
        todo = set(boundaries[g0 : g0 + group])
        entries: list[Tensor] = []

        def inject(layer: int, part: str, x: Tensor | None) -> Tensor | None:
            if (layer, part) not in todo:
                return x
            e = _entry(model, diff, base, layer, part)[0].detach().requires_grad_(True)
            entries.append(e)
            return e if x is None else torch.cat([x, e])

        with B.frozen_parameters(model), torch.enable_grad():
            first = boundaries[g0][0]
            rows = B.run_blocks(model, None, start=(first, "pre"), inject=inject)
            assert rows is not None
            R, _, _ = readout(model, rows, chunk, reward_fn, groups=len(entries))
            got = torch.autograd.grad(R.sum(), entries)
        order = [b for b in boundaries[g0 : g0 + group]]
        for key, g in zip(order, got):
            grads[key] = g
    return _split(grads, L, has_mlp)


def _split(grads: dict[tuple[int, str], Tensor], L: int, has_mlp: bool
           ) -> tuple[list[Tensor], list[Tensor]]:  # fmt: skip
    gp_attn = [grads[(layer, "attn")] for layer in range(L)]
    gp_mlp = [grads[(layer, "mlp")] for layer in range(L)] if has_mlp else []
    return gp_attn, gp_mlp


def _entry(model: Any, diff: WeightDiff, base: Run, layer: int, part: str
           ) -> tuple[Tensor, tuple[int, str]]:  # fmt: skip
    """The base stream right after a component group (heads: with ``b_O'``) and the boundary it
    enters the finetuned model at."""
    if part == "mlp":
        return base.post[layer], (layer, "post")
    d_bO = diff.deltas.get(B.attn_out_names(layer)[1])
    sequential = B.has_mlp(model) and not B.parallel(model)
    source = base.mid[layer] if sequential else base.post[layer]
    if d_bO is not None:
        source = source + d_bO.to(device=source.device, dtype=source.dtype)
    return source, ((layer, "mid") if sequential else (layer, "post"))


def patch_values(chunk: CausalChunk, layer: int) -> tuple[Tensor, Tensor | None]:
    base, table = chunk.base, chunk.table
    assert table is not None
    z_star, m_star = chunk.cached("y_star", lambda: table.for_rows(chunk.rows, chunk.batch, base))
    with torch.no_grad():
        dh = head_out(z_star[:, :, layer] - wide(base.z[layer]), base.W_O[layer])
        dm = None if m_star is None else m_star[:, :, layer] - wide(base.mlp_out[layer])
    return dh, dm


def exact(effects: dict[str, Any]) -> Any:
    """``[R_late(W) - R_late(patched)] - [R(W) - R(patched)]``, effects being patched - unpatched."""
    return effects["base"] - effects["finetuned_late"]

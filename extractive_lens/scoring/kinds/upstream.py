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
from extractive_lens.scoring import passes
from extractive_lens.scoring.runs import Run, head_grad, head_out, readout, wide

if TYPE_CHECKING:  # pragma: no cover
    from extractive_lens.batch import PromptBatch
    from extractive_lens.rewards import Reward
    from extractive_lens.scoring.kinds.protocols import CausalChunk, LayerStep, LinearChunk
    from extractive_lens.scoring.options import ScoreOptions
    from extractive_lens.weight_diff import WeightDiff

CONTEXTS = ("base", "finetuned_late")


def needs(options: ScoreOptions) -> set[str]:
    # the authors' code takes ŷ' from the finetuned model's own run, the paper at base activations
    return {"finetuned_grad"} if options.authors else {"upstream_grads"}


def capture(options: ScoreOptions) -> tuple[str, ...]:
    return ()


def linear(chunk: LinearChunk) -> Tensor:
    swept = chunk.swept.get("upstream")
    if swept is not None:  # computed boundary by boundary in the sweep's backward pass
        return swept
    model, base = chunk.model, chunk.base
    has_mlp = B.has_mlp(model)
    out = chunk.new_scores()
    for layer in range(model.cfg.n_layers):
        if chunk.options.authors:
            assert chunk.ft is not None
            g_attn, W_O = chunk.ft.g_attn[layer], chunk.ft.W_O[layer]
            g_mlp = chunk.ft.g_mlp[layer] if has_mlp else None
        else:
            assert chunk.gp_attn is not None and chunk.gp_mlp is not None
            g_attn, W_O = chunk.gp_attn[layer], base.W_O[layer]
            g_mlp = chunk.gp_mlp[layer] if has_mlp else None
        _boundary(chunk, layer, "attn", g_attn, out, W_O)
        if g_mlp is not None:
            _boundary(chunk, layer, "mlp", g_mlp, out)
    return out


def layer_linear(chunk: LinearChunk, step: LayerStep, out: Tensor) -> None:
    """The sweep's backward step: the scores of the boundary whose ``ŷ'`` it reached."""
    if step.g is not None:
        assert step.part is not None
        _boundary(chunk, step.layer, step.part, step.g, out)


def _boundary(
    chunk: LinearChunk, layer: int, part: str, g: Tensor, out: Tensor, W_O: Tensor | None = None
) -> None:
    """One boundary's upstream scores into ``out``: ``g`` is ``ŷ'`` there (``dR/d attn_out``
    of the heads of ``layer``, read per head through ``W_O``, default the base run's; or
    ``dR/d mlp_out``), ``y*`` formed for this layer alone. The sweep calls it as each
    boundary's gradient arrives, so that no layer's ``ŷ'`` is kept."""
    base, H = chunk.base, chunk.model.cfg.n_heads
    assert chunk.table is not None
    z_star, m_star = chunk.table.for_rows(chunk.rows, chunk.batch, base, slice(layer, layer + 1))
    with torch.no_grad():
        if part == "attn":
            gp_z = head_grad(wide(g), base.W_O[layer] if W_O is None else W_O)
            dz = wide(base.z[layer]) - z_star[:, :, 0]
            out[:, layer, :H] = ((gp_z - chunk.g_z[layer]) * dz).sum(-1).transpose(1, 2)
        else:
            assert m_star is not None
            dm = wide(base.mlp_out[layer]) - m_star[:, :, 0]
            out[:, layer, H] = ((wide(g) - wide(base.g_mlp[layer])) * dm).sum(-1)


def upstream_gradients(
    model: Any, diff: WeightDiff, chunk: PromptBatch, base: Run, reward_fn: Reward,
    group: int | None = None,
) -> tuple[list[Tensor], list[Tensor]]:  # fmt: skip
    """``ŷ'`` at every layer boundary: ``dR/dy_c`` with ``W_late`` finetuned, at base activations.

    Call inside ``B.shifted(model, diff)`` (the finetuned weights supplied, never written);
    ``base`` is the cached base run.

    The base residual stream enters the finetuned model right after each component (heads of
    layer l: where they re-enter, with ``b_O'``; MLP l: after the MLP) as extra rows of one
    growing batch; one backward gives every boundary's gradient. ``group`` bounds how many
    boundaries share a pass (memory). Where gradients go one layer at a time (``layerwise``)
    the engine runs these rows in its layer-major pass instead (``linear._swept``).
    """
    L, has_mlp = model.cfg.n_layers, B.has_mlp(model)
    parts = ("attn", "mlp") if has_mlp else ("attn",)
    boundaries = [(layer, part) for layer in range(L) for part in parts]
    group = group or len(boundaries)
    grads: dict[tuple[int, str], Tensor] = {}
    for g0 in range(0, len(boundaries), group):
        todo = set(boundaries[g0 : g0 + group])
        entries: list[Tensor] = []

        def inject(layer: int, part: str, x: Tensor | None) -> Tensor | None:
            if (layer, part) not in todo:
                return x
            e = passes.entry(model, diff, base, layer, part)[0].detach().requires_grad_(True)
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
            grads[key] = owned(g)
    return _split(grads, L, has_mlp)


def owned(g: Tensor) -> Tensor:
    """``g`` in storage of its own. The gradient of a row block ``torch.cat`` joined is a view
    of the whole gradient: kept as it is, each boundary's ``ŷ'`` would hold every row of its
    layer (memory growing with the square of the depth)."""
    return g if g.untyped_storage().nbytes() == g.nbytes else g.clone()


def _split(grads: dict[tuple[int, str], Tensor], L: int, has_mlp: bool
           ) -> tuple[list[Tensor], list[Tensor]]:  # fmt: skip
    gp_attn = [grads[(layer, "attn")] for layer in range(L)]
    gp_mlp = [grads[(layer, "mlp")] for layer in range(L)] if has_mlp else []
    return gp_attn, gp_mlp


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

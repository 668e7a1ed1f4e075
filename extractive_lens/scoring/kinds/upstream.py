"""Upstream scores (docs/scores.md §4–5, §7): how much each component's output matters to R
*through* the finetuned later layers. Exact: the effect of ablating the component to ``y*``
with the layers after it finetuned, minus the same effect in the base model (a double
difference). Linear: ``<ŷ'_c - ŷ_c, y_c - y*_c>`` with ``ŷ'`` the gradient at the base
activations with the later layers finetuned: the base stream entering the finetuned model
right after each component (the linear engine's boundary rows, ``passes.stacked`` or
``passes.layer_major``), its scores computed as each boundary's ``ŷ'`` arrives (``layer_linear``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from extractive_lens import backend as B
from extractive_lens.scoring.runs import head_grad, head_out, wide

if TYPE_CHECKING:  # pragma: no cover
    from extractive_lens.scoring.kinds.protocols import CausalChunk, LayerStep, LinearChunk
    from extractive_lens.scoring.options import ScoreOptions

CONTEXTS = ("base", "finetuned_late")


def needs(options: ScoreOptions) -> set[str]:
    # the authors' code takes ŷ' from the finetuned model's own run, the paper at base activations
    return {"finetuned_grad"} if options.authors else {"upstream_grads"}


def capture(options: ScoreOptions) -> tuple[str, ...]:
    return ()


def linear(chunk: LinearChunk) -> Tensor:
    swept = chunk.swept.get("upstream")
    if swept is not None:  # the paper's: computed boundary by boundary as each ŷ' arrived
        return swept
    model = chunk.model
    has_mlp = B.has_mlp(model)
    out = chunk.new_scores()
    ft = chunk.ft  # the authors' code: ŷ' from the finetuned model's own run
    assert ft is not None and chunk.options.authors
    for layer in range(model.cfg.n_layers):
        _boundary(chunk, layer, "attn", ft.g_attn[layer], out, ft.W_O[layer])
        if has_mlp:
            _boundary(chunk, layer, "mlp", ft.g_mlp[layer], out)
    return out


def layer_linear(chunk: LinearChunk, step: LayerStep, out: Tensor) -> None:
    """The scores of the boundary whose ``ŷ'`` arrived (``step.g``)."""
    if step.g is not None:
        assert step.part is not None
        _boundary(chunk, step.layer, step.part, step.g, out)


def _boundary(
    chunk: LinearChunk, layer: int, part: str, g: Tensor, out: Tensor, W_O: Tensor | None = None
) -> None:
    """One boundary's upstream scores into ``out``: ``g`` is ``ŷ'`` there (``dR/d attn_out``
    of the heads of ``layer``, read per head through ``W_O``, default the base run's; or
    ``dR/d mlp_out``), ``y*`` formed for this layer alone. The engine calls it as each
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

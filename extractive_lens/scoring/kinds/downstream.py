"""Downstream scores (docs/scores.md §4–5): how much each component's *reading* of the
finetuned stream moves R. Exact: patch ``f_c(z'_c, W_c) - f_c(z_c, W_c)`` (the base component on
the finetuned run's input) into the base run. Linear: ``<ŷ_c, f_c(z'_c, W_c) - y_c>``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from extractive_lens import backend as B
from extractive_lens.scoring.runs import forward_run, head_out, wide

if TYPE_CHECKING:  # pragma: no cover
    from extractive_lens.scoring.kinds.protocols import CausalChunk, LayerStep, LinearChunk
    from extractive_lens.scoring.options import ScoreOptions

CONTEXTS = ("base",)


def needs(options: ScoreOptions) -> set[str]:
    return {"finetuned"}


def capture(options: ScoreOptions) -> tuple[str, ...]:
    return ()


def linear(chunk: LinearChunk) -> Tensor:
    swept = chunk.swept.get("downstream")
    if swept is not None:  # computed layer by layer in the large-model pass
        return swept
    ft, has_mlp = chunk.ft, B.has_mlp(chunk.model)
    assert ft is not None
    out = chunk.new_scores()
    for layer in range(chunk.model.cfg.n_layers):
        _layer(chunk, layer, ft.pre[layer], ft.mlp_in[layer] if has_mlp else None, out)
    return out


def layer_linear(chunk: LinearChunk, step: LayerStep, out: Tensor) -> None:
    """The large-model pass's forward step: the layer's scores from the finetuned rows' inputs."""
    if step.g is None:
        assert step.finetuned is not None  # "finetuned" is needed: the finetuned rows ran
        _layer(chunk, step.layer, step.finetuned.pre, step.finetuned.mlp_in, out)


def _layer(chunk: LinearChunk, layer: int, pre: Tensor, mlp_in: Tensor | None, out: Tensor) -> None:
    """One layer's downstream scores into ``out``: the base layer re-run on the finetuned
    run's inputs of that layer (``pre``, and ``mlp_in`` for its MLP). Call with the base
    weights (the large-model pass calls it unshifted, as each layer's finetuned inputs are formed)."""
    model, base = chunk.model, chunk.base
    H = model.cfg.n_heads
    with torch.no_grad():
        _, cap = B.attention(model, layer, pre)
        dz = wide(cap["z"]) - wide(base.z[layer])
        out[:, layer, :H] = (chunk.g_z[layer] * dz).sum(-1).transpose(1, 2)
        if mlp_in is not None:
            dy = wide(B.mlp(model, layer, mlp_in)) - wide(base.mlp_out[layer])
            out[:, layer, H] = (wide(base.g_mlp[layer]) * dy).sum(-1)


def patch_values(chunk: CausalChunk, layer: int) -> tuple[Tensor, Tensor | None]:
    model, base = chunk.model, chunk.base

    def finetuned_run() -> Any:
        with B.shifted(model, chunk.diff):
            return forward_run(model, chunk.batch)

    with torch.no_grad():
        ft = chunk.cached("finetuned_run", finetuned_run)
        _, cap = B.attention(model, layer, ft.pre[layer])
        dh = head_out(wide(cap["z"]) - wide(base.z[layer]), base.W_O[layer])
        dm = None
        if B.has_mlp(model):
            dm = wide(B.mlp(model, layer, ft.mlp_in[layer])) - wide(base.mlp_out[layer])
    return dh, dm


def exact(effects: dict[str, Any]) -> Any:
    return effects["base"]

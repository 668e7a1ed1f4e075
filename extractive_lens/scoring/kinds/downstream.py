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
    from extractive_lens.scoring.kinds.protocols import CausalChunk, LinearChunk
    from extractive_lens.scoring.options import ScoreOptions

CONTEXTS = ("base",)


def needs(options: ScoreOptions) -> set[str]:
    return {"finetuned"}


def capture(options: ScoreOptions) -> tuple[str, ...]:
    return ()


def linear(chunk: LinearChunk) -> Tensor:
    model, base, ft = chunk.model, chunk.base, chunk.ft
    assert ft is not None
    H, has_mlp = model.cfg.n_heads, B.has_mlp(model)
    out = chunk.new_scores()
    with torch.no_grad():
        for layer in range(model.cfg.n_layers):
            _, cap = B.attention(model, layer, ft.pre[layer])
            dz = wide(cap["z"]) - wide(base.z[layer])
            out[:, layer, :H] = (chunk.g_z[layer] * dz).sum(-1).transpose(1, 2)
            if has_mlp:
                dy = wide(B.mlp(model, layer, ft.mlp_in[layer])) - wide(base.mlp_out[layer])
                out[:, layer, H] = (wide(base.g_mlp[layer]) * dy).sum(-1)
    return out


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

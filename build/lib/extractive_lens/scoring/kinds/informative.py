"""Informative scores (docs/scores.md §4–5, §7): how much each component's *weight change*
moves R. Exact: patch ``f_c(z_c, W'_c) - f_c(z_c, W_c)`` (the finetuned component on the base
run's input) into the base run. Linear: ``<ŷ_c, J_c Δ_c>`` from one forward-mode pass along Δ;
parameters no component owns (embeddings, ``b_O``, final norm, unembedding) go to "other".
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from extractive_lens import backend as B
from extractive_lens.scoring.runs import head_grad, head_out, wide

if TYPE_CHECKING:  # pragma: no cover
    from extractive_lens.scoring.causal import CausalChunk
    from extractive_lens.scoring.linear import LinearChunk
    from extractive_lens.scoring.options import ScoreOptions

CONTEXTS = ("base",)


def needs(options: ScoreOptions) -> set[str]:
    return {"finetuned"}  # for the additivity check, R(W') - R(W)


def capture(options: ScoreOptions) -> tuple[str, ...]:
    return ("q", "k", "v") if options.authors else ()


def linear(chunk: LinearChunk) -> Tensor:
    """``Ī[batch, layer, component, pos]``; sets ``chunk.other`` to the "other" parameters' share.

    One forward-mode pass: every layer's attention and MLP re-run on its cached base input with
    the weights' tangent set to Δ (``b_O`` excluded, and ``W_O`` in the authors' convention: they
    are credited separately).
    """
    model, base, deltas, authors = chunk.model, chunk.base, chunk.deltas, chunk.options.authors
    L, H, has_mlp = model.cfg.n_layers, model.cfg.n_heads, B.has_mlp(model)
    dtype = chunk.dtype
    inf = chunk.new_scores()
    other = torch.zeros(inf.shape[0], dtype=dtype, device=inf.device)
    parts = {"attn", "mlp", "embed", "final"} | (set() if authors else {"attn_out"})
    tang = {n: d for n, d in deltas.items() if B.param_role(n).part in parts}
    tokens = chunk.batch.tokens.to(model.cfg.device)
    capture = ("z", "q", "k", "v") if authors else ("z",)

    def pieces(m: Any) -> tuple[list[dict[str, Tensor]], list[Tensor], Tensor, Tensor]:
        caps = [B.attention(m, l, base.pre[l], capture)[1] for l in range(L)]
        outs = [B.mlp(m, l, base.mlp_in[l]) for l in range(L)] if has_mlp else []
        return caps, outs, B.embed(m, tokens), B.unembed(m, base.post_final)  # type: ignore[arg-type]

    with torch.no_grad():  # one forward-mode pass for every component and the "other" parameters
        _, (cap_dot, mlp_dot, e_dot, l_dot) = B.jvp(model, pieces, (), tang)
    for layer in range(L):
        dot = cap_dot[layer]
        if authors:  # Q credited at the query position, K and V at the key position
            g = base.g_captured[layer]
            per = sum((wide(g[n]) * wide(dot[n])).sum(-1) for n in ("q", "k", "v"))
        else:
            per = (chunk.g_z[layer] * wide(dot["z"])).sum(-1)
        inf[:, layer, :H] = per.transpose(1, 2)  # type: ignore[union-attr]
        W_O_name, b_O_name = B.attn_out_names(layer)
        d_WO = deltas.get(W_O_name)
        if d_WO is not None:  # <ŷ, z_h ΔW_O[h]> = <ŷ ΔW_O[h]^T, z_h>, at the output position
            w_o = (head_grad(wide(base.g_attn[layer]), d_WO) * wide(base.z[layer])).sum(-1)
            inf[:, layer, :H] += w_o.transpose(1, 2)
        d_bO = deltas.get(b_O_name)
        if d_bO is not None:
            other += (wide(base.g_attn[layer]).sum(1) * d_bO.to(dtype)).sum(-1)
        if has_mlp:
            inf[:, layer, H] = (wide(base.g_mlp[layer]) * wide(mlp_dot[layer])).sum(-1)
    other += (wide(base.g_embed) * wide(e_dot)).sum((-1, -2))  # type: ignore[arg-type]
    other += (wide(base.g_logits) * wide(l_dot)).sum((-1, -2))  # type: ignore[arg-type]
    chunk.other = other
    return inf


def patch_values(chunk: CausalChunk) -> list[tuple[Tensor, Tensor | None]]:
    model, base = chunk.model, chunk.base
    has_mlp = B.has_mlp(model)
    new = []
    with torch.no_grad():
        with chunk.diff.applied(model):
            for layer in range(model.cfg.n_layers):
                _, cap = B.attention(model, layer, base.pre[layer])
                W_O = B.W_O(model, layer).detach().clone()
                m = B.mlp(model, layer, base.mlp_in[layer]) if has_mlp else None
                new.append((cap["z"], W_O, m))
        out = []
        for layer, (z_new, W_O_new, m_new) in enumerate(new):
            dh = head_out(z_new, W_O_new) - head_out(base.z[layer], base.W_O[layer])
            dm = None if m_new is None else wide(m_new) - wide(base.mlp_out[layer])
            out.append((dh, dm))
    return out


def exact(effects: dict[str, Any]) -> Any:
    return effects["base"]

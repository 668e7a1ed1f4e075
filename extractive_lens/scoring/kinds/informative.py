"""Informative scores (docs/scores.md §4–5, §7): how much each component's *weight change*
moves R. Exact: patch ``f_c(z_c, W'_c) - f_c(z_c, W_c)`` (the finetuned component on the base
run's input) into the base run. Linear: ``<ŷ_c, J_c Δ_c>`` from one forward-mode pass along Δ;
parameters no component owns (embeddings, ``b_O``, final norm, unembedding) go to "other".
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import einops
import torch
from torch import Tensor

from extractive_lens import backend as B
from extractive_lens.backend import shift
from extractive_lens.backend.lowrank import LowRank
from extractive_lens.scoring.runs import head_grad, head_out, layerwise, wide

if TYPE_CHECKING:  # pragma: no cover
    from extractive_lens.scoring.kinds.protocols import CausalChunk, LayerStep, LinearChunk
    from extractive_lens.scoring.options import ScoreOptions

CONTEXTS = ("base",)


def needs(options: ScoreOptions) -> set[str]:
    return {"finetuned"}  # for the additivity check, R(W') - R(W)


def capture(options: ScoreOptions) -> tuple[str, ...]:
    return ("q", "k", "v") if options.authors else ()


def linear(chunk: LinearChunk) -> Tensor:
    """``Ī[batch, layer, component, pos]``; sets ``chunk.other`` to the "other" parameters' share.

    Forward-mode passes: every layer's attention and MLP re-run on their cached base inputs with
    the weights' tangent set to Δ (``b_O`` excluded, and ``W_O`` in the authors' convention: they
    are credited separately), then the embedding and the unembedding ("other"). Small models
    take one pass; large ones (``runs.layerwise``) one per layer, so that one layer's Δ and duals
    exist at a time.
    """
    model = chunk.model
    L = model.cfg.n_layers
    dtype, device = chunk.dtype, model.cfg.device
    swept = chunk.swept.get("informative")
    if swept is not None:  # the blocks' share, computed while each layer's Δ was loaded
        inf = swept
        other = torch.zeros(inf.shape[0], dtype=dtype, device=inf.device)
        other = other if chunk.other is None else chunk.other
    else:
        inf = chunk.new_scores()
        other = torch.zeros(inf.shape[0], dtype=dtype, device=inf.device)
        # one forward-mode pass for all layers on small models; one per layer (one layer's Δ
        # and duals at a time) where activations or weights are large
        groups = [[l] for l in range(L)] if layerwise(model, chunk.batch) else [list(range(L))]
        for group in groups:
            _layers(chunk, group, inf, other)
    base = chunk.base
    tokens = chunk.batch.tokens.to(device)
    # the embedding and the unembedding ("other"): together on small models, else one at a time
    # (a vocabulary-sized weight and its Δ are the largest tensors there are); their tangents
    # read through the store like the layers' (a vocabulary matrix's a part at a time)
    post_final = cast(Tensor, base.post_final)
    sides = [(shift.EMBED, cast(Tensor, base.g_embed), lambda m: B.embed(m, tokens)),
             (shift.UNEMBED, cast(Tensor, base.g_logits), lambda m: B.unembed(m, post_final))]  # fmt: skip
    for together in [[side] for side in sides] if layerwise(model, chunk.batch) else [sides]:
        tang = {
            n: t for g, _, _ in together for n, t in shift.tangents(model, chunk.diff, g).items()
        }
        with torch.no_grad():
            _, dots = B.jvp_raw(model, lambda m: [f(m) for _, _, f in together], (), tang)
        for (_, g, _), d in zip(together, dots):
            other += (wide(g) * wide(d)).sum((-1, -2))
    chunk.other = other
    return inf


def layer_linear(chunk: LinearChunk, step: LayerStep, out: Tensor) -> None:
    """The large-model pass's forward step: the layer's scores into ``out``, ``b_O``'s share into
    ``chunk.other`` (``_layers``, reading the Δ the finetuned rows' shift has loaded)."""
    if step.g is not None:
        return
    if chunk.other is None:
        chunk.other = torch.zeros(out.shape[0], dtype=chunk.dtype, device=out.device)
    _layers(chunk, [step.layer], out, chunk.other)


def _layers(chunk: LinearChunk, group: list[int], inf: Tensor, other: Tensor) -> None:
    """The informative scores of the layers ``group`` into ``inf`` (``b_O``'s share into
    ``other``): one forward-mode pass, each layer's attention and MLP re-run on their cached
    base inputs with the weights' tangent set to that layer's Δ. The tangents are Δ as loaded
    for the shifts of this model and diff (``shift.tangents``): run while a finetuned pass has
    the layer loaded, it reads no Δ of its own."""
    model, base, authors = chunk.model, chunk.base, chunk.options.authors
    has_mlp = B.has_mlp(model)
    capture = ("z", "q", "k", "v") if authors else ("z",)

    def pieces(m: Any, layer: int) -> dict[str, Any]:
        out: dict[str, Any] = {"cap": B.attention(m, layer, base.pre[layer], capture)[1]}
        if has_mlp:
            out["mlp"] = B.mlp(m, layer, base.mlp_in[layer])
        return out

    # every tensor of the layer's Δ is a tangent: those credited apart (W_O, b_O) change
    # nothing the pieces return (z, q, k, v are read before W_O; the MLP from its own input)
    tang = {n: t for l in group for n, t in shift.tangents(model, chunk.diff, l).items()}
    with torch.no_grad():
        _, dots = B.jvp_raw(model, lambda m: {l: pieces(m, l) for l in group}, (), tang)
    for layer in group:
        _layer_scores(chunk, layer, dots[layer], inf, other)


def _W_O_grad(g_attn: Tensor, d: Tensor | LowRank) -> Tensor:
    """``ŷ ΔW_O[h]^T`` per head (``head_grad`` with ``ΔW_O``); for low-rank factors
    (``heads_in``: ``ΔW_O`` is ``(head d_head) d_model``) as ``(ŷ R^T) L^T``."""
    if not isinstance(d, LowRank):
        return head_grad(g_attn, d)
    L, R = d.left.to(g_attn.dtype), d.right.to(device=d.left.device, dtype=g_attn.dtype)
    per = (g_attn @ R.T) @ L.T
    return einops.rearrange(per, "... (head d_head) -> ... head d_head", head=d.n_heads)


def _layer_scores(chunk: LinearChunk, layer: int, dot: dict[str, Any], inf: Tensor,
                  other: Tensor) -> None:  # fmt: skip
    """One layer's informative scores from its forward-mode tangents (``dot``), into ``inf``;
    ``b_O``'s share into ``other``."""
    model, base = chunk.model, chunk.base
    H, has_mlp, authors = model.cfg.n_heads, B.has_mlp(model), chunk.options.authors
    dtype = chunk.dtype
    if authors:  # Q credited at the query position, K and V at the key position
        g = base.g_captured[layer]
        per = sum((wide(g[n]) * wide(dot["cap"][n])).sum(-1) for n in ("q", "k", "v"))
    else:
        per = (chunk.g_z[layer] * wide(dot["cap"]["z"])).sum(-1)
    inf[:, layer, :H] = per.transpose(1, 2)  # type: ignore[union-attr]
    # ΔW_O and Δb_O from the layer loaded (``shift.read``: counted where read on their own)
    W_O_name, b_O_name = B.attn_out_names(layer)
    d_WO = shift.read(model, chunk.diff, W_O_name)
    if d_WO is not None:  # <ŷ, z_h ΔW_O[h]> = <ŷ ΔW_O[h]^T, z_h>, at the output position
        w_o = (_W_O_grad(wide(base.g_attn[layer]), d_WO) * wide(base.z[layer])).sum(-1)
        inf[:, layer, :H] += w_o.transpose(1, 2)
    d_bO = shift.read(model, chunk.diff, b_O_name)
    if d_bO is not None:
        assert isinstance(d_bO, Tensor)  # a bias has no low-rank factors
        d_bO = d_bO.to(device=base.g_attn[layer].device, dtype=dtype)
        other += (wide(base.g_attn[layer]).sum(1) * d_bO).sum(-1)
    if has_mlp:
        inf[:, layer, H] = (wide(base.g_mlp[layer]) * wide(dot["mlp"])).sum(-1)


def patch_values(chunk: CausalChunk, layer: int) -> tuple[Tensor, Tensor | None]:
    model, base = chunk.model, chunk.base
    with torch.no_grad(), B.shifted(model, chunk.diff):
        _, cap = B.attention(model, layer, base.pre[layer])
        dh = head_out(cap["z"], B.W_O(model, layer)) - head_out(base.z[layer], base.W_O[layer])
        dm = None
        if B.has_mlp(model):
            dm = wide(B.mlp(model, layer, base.mlp_in[layer])) - wide(base.mlp_out[layer])
    return dh, dm


def exact(effects: dict[str, Any]) -> Any:
    return effects["base"]

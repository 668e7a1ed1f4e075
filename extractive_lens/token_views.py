"""One prompt's tokens as circuitsvis views: coloured by a component's per-token score
(``token_view``), or a layer's attention patterns (``attention_view``)."""

from __future__ import annotations

from typing import Any

from extractive_lens.score_maps import _safe_token
from extractive_lens.types import ScoreKind
from extractive_lens.views import ScoresView


def token_view(scores: ScoresView, kind: ScoreKind, component: str, prompt: int = 0) -> Any:
    """A prompt's tokens coloured by one component's per-token score (circuitsvis).

    ``component``: ``"L3H2"``, ``"L3MLP"`` or ``"L3ATTN"`` (heads summed). Returns circuitsvis's
    ``RenderedHTML``; use ``.local_src`` for offline HTML (its ``_repr_html_`` loads from a CDN).
    """
    from circuitsvis.tokens import colored_tokens

    from extractive_lens.types import Component

    v = scores.prompt_values[scores.kind_index(kind), prompt]  # layer component pos
    n = len(scores.prompt_roles[prompt])
    if component.endswith("ATTN"):
        layer = int(component[1:-4])
        vals = v[layer, [i for i, c in enumerate(scores.component_labels) if c != "MLP"], :n].sum(0)
    else:
        c = Component.parse(component)
        vals = v[c.layer, scores.component_labels.index(c.short_label), :n]
    tokens = (scores.metadata.get("prompt_tokens") or [list(r) for r in scores.prompt_roles])[
        prompt
    ][:n]
    if bool(vals.isnan().all()):
        raise ValueError(f"{component}'s {kind} scores were never computed in this result.")
    vals = vals.nan_to_num(0.0)
    lim = float(vals.abs().max()) or 1.0
    return colored_tokens(
        [_safe_token(t) for t in tokens],
        vals.double().tolist(),
        min_value=-lim,
        max_value=lim,
        negative_color="#b2182b",
        positive_color="#2166ac",
    )  # as RdBu


def attention_view(
    model: Any, batch: Any, layer: int, heads: list[int] | None = None, prompt: int = 0
) -> Any:
    """Attention patterns of ``heads`` of ``layer`` on one prompt (circuitsvis ``attention_patterns``)."""
    import torch
    from circuitsvis.attention import attention_patterns

    from extractive_lens import backend as B

    n = int(batch.lengths[prompt])
    tokens = batch.tokens[prompt : prompt + 1, :n].to(model.cfg.device)
    with torch.no_grad():
        x = B.run_blocks(model, B.embed(model, tokens), stop=layer)
        assert x is not None  # run_blocks returns the residual when it stops before the end
        _, cap = B.attention(model, layer, x, ("pattern",))
    pattern = cap["pattern"][0]
    if heads is not None:
        pattern = pattern[heads]
    tok = getattr(model, "tokenizer", None)
    strs = [tok.decode([int(t)]) if tok is not None else f"t{int(t)}" for t in tokens[0].tolist()]
    return attention_patterns([_safe_token(t) for t in strs], pattern.float().cpu())

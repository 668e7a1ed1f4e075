"""What a ``TransformerBridge``'s pieces hook: the keyword arguments the wrapped model passes
to attention (causal mask, rotary tables), recorded once per sequence length
(``attention_kwargs``); a frozen key/value prefix given through the wrapped model's cache
interface (``Prefix``); and the values at attention hook points, in TransformerLens's shapes
(``capturing``). Every hook acts for the calling thread only.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor, nn

from extractive_lens.backend.compute import this_thread_only


class Prefix:
    """A Hugging Face cache stand-in holding frozen keys and values of earlier positions:
    ``update`` returns them followed by the new ones (layout ``[batch, kv_head, pos, d_head]``)."""

    def __init__(self, k: Tensor, v: Tensor) -> None:  # [batch, pos, kv_head, d_head]
        self.k, self.v = k.transpose(1, 2), v.transpose(1, 2)

    def update(self, k: Tensor, v: Tensor, *args: Any, **kwargs: Any) -> tuple[Tensor, Tensor]:
        return (
            torch.cat([self.k.to(k.dtype), k], dim=2),
            torch.cat([self.v.to(v.dtype), v], dim=2),
        )

    def get_seq_length(self, *args: Any, **kwargs: Any) -> int:
        return int(self.k.shape[2])


_KWARGS: weakref.WeakKeyDictionary[nn.Module, dict[tuple[int, str], list[dict[str, Any]]]] = (
    weakref.WeakKeyDictionary()
)
_DROP = {"hidden_states", "past_key_values", "past_key_value", "layer_past", "use_cache",
         "output_attentions", "cache_position"}  # fmt: skip


def recorded(model: Any, n: int, device: torch.device) -> list[dict[str, Any]]:
    """Per layer, the keyword arguments the wrapped model passes to attention on ``n`` tokens
    (causal mask, rotary tables, positions): recorded from one forward pass, once."""
    cache = _KWARGS.setdefault(model, {})
    key = (n, str(device))
    if key not in cache:
        rec: dict[int, dict[str, Any]] = {}

        def save(layer: int, _m: Any, _args: Any, kwargs: dict[str, Any]) -> None:
            rec[layer] = {k: v for k, v in kwargs.items() if k not in _DROP}

        handles = [
            b.attn.register_forward_pre_hook(
                this_thread_only(lambda m, a, kw, layer=layer: save(layer, m, a, kw)),
                with_kwargs=True,
            )
            for layer, b in enumerate(model.blocks)
        ]
        try:
            with torch.no_grad():
                model(torch.zeros(1, n, dtype=torch.long, device=device))
        finally:
            for h in handles:
                h.remove()
        cache[key] = [rec[layer] for layer in range(len(model.blocks))]
    return cache[key]


def attention_kwargs(model: Any, layer: int, x: Tensor, offset: int) -> dict[str, Any]:
    """Attention's keyword arguments for the positions ``offset .. offset + x.shape[1]``, with
    rotary tables in the compute dtype."""
    n = x.shape[1]
    kw = dict(recorded(model, offset + n, x.device)[layer])
    if "position_embeddings" in kw and hasattr(model, "rotary_emb"):
        pos = torch.arange(offset + n, device=x.device)[None]
        with torch.no_grad():
            kw["position_embeddings"] = model.rotary_emb(x[:1, :1].expand(1, offset + n, -1), pos)
    if offset:
        for k, v in list(kw.items()):
            if k == "position_embeddings" and v is not None:
                kw[k] = tuple(t[..., offset:, :] for t in v)
            elif k == "position_ids" and v is not None:
                kw[k] = v[..., offset:]
            elif k == "attention_mask" and v is not None and v.ndim == 4:
                kw[k] = v[..., offset:, :]
    return kw


_HOOK_POINTS: weakref.WeakKeyDictionary[nn.Module, dict[str, Any]] = weakref.WeakKeyDictionary()


def hook_point(model: Any, name: str) -> Any:
    """The hook point behind a TransformerLens hook name (aliases resolved once per model)."""
    points = _HOOK_POINTS.get(model)
    if points is None:
        points = dict(model.hook_dict)
        _HOOK_POINTS[model] = points
    return points.get(name)


@contextlib.contextmanager
def capturing(model: Any, layer: int, capture: tuple[str, ...]) -> Iterator[dict[str, Tensor]]:
    """The values at attention hook points ``capture`` of ``layer``, in TransformerLens's shapes,
    kept on the autograd path (each hook returns what it stored)."""
    captured: dict[str, Tensor] = {}
    handles = []
    try:
        for name in capture:
            points = [f"hook_{name}"]
            if name == "k":
                # keys as a cache holds them, after rotary where it fires (later, so it wins);
                # per position and head their inner products are those before it (a rotation)
                points.append("hook_rot_k")
            for point in points:
                hp = hook_point(model, f"blocks.{layer}.attn.{point}")
                if hp is None:
                    continue
                conv = getattr(hp, "hook_conversion", None)

                def hook(_m: Any, _i: Any, out: Tensor, name: str = name, conv: Any = conv) -> Any:
                    t = out if conv is None else conv.convert(out)
                    captured[name] = t
                    return t if conv is None else conv.revert(t)

                handles.append(hp.register_forward_hook(this_thread_only(hook)))
        yield captured
    finally:
        for h in handles:
            h.remove()

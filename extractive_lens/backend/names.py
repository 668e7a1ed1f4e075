"""TransformerLens parameter and hook names: the vocabulary every backend speaks.

A ``WeightDiff`` is keyed by these names (``blocks.3.attn.W_Q``), whatever class the model is:
a ``HookedTransformer`` has them as its own parameter names, a TransformerBridge exposes them
through ``tl_parameters()``. This module is the only place that parses or spells parameter
names (hook names: ``hook_names.py``); the rest of the package asks what a name *is*
(``param_role``), which components own it (``slices_for_names``, docs/scores.md §2) or what
shape it has (``expected_shape``).

>>> param_role("blocks.3.attn.W_O")
ParamRole(layer=3, part='attn_out')
>>> param_role("unembed.W_U")
ParamRole(layer=None, part='final')
>>> [s.index for s in slices_for_names(["blocks.0.attn.W_Q"], n_heads=2)]
[0, 1]
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from extractive_lens.backend import hook_names
from extractive_lens.types import Component

Part = Literal["embed", "attn", "attn_out", "attn_out_bias", "mlp", "final", "unknown"]
"""What a parameter feeds: the embeddings, a layer's attention heads (with ``ln1``; ``W_O`` is
``attn_out``, the shared output bias ``b_O`` is ``attn_out_bias``), a layer's MLP (with ``ln2``),
the final norm and unembedding, or something the scores do not know how to credit."""


@dataclass(frozen=True)
class ParamRole:
    """Where a parameter sits: its block (``None`` outside the blocks) and what it feeds."""

    layer: int | None
    part: Part


@dataclass(frozen=True)
class ParamSlice:
    """A slice ``param[index]`` (``index=None``: the whole tensor) and the components owning it.

    ``owners == ()`` is the "other" group (embeddings, ``b_O``, final norm, unembedding).
    Shared slices (a layer's ``ln1``, a GQA key/value group) list every head that reads them;
    each head is credited through its own copy, so per-head scores still add up.
    """

    name: str
    index: int | None
    owners: tuple[Component, ...]


_BLOCK = re.compile(r"^blocks\.(\d+)\.(.+)\.(\w+)$")
_HEAD_PARAMS = {"W_Q", "W_K", "W_V", "W_O", "b_Q", "b_K", "b_V", "sinks"}
_KV_PARAMS = {"_W_K", "_W_V", "_b_K", "_b_V"}
_HEAD_SHARED_MODULES = {"ln1", "attn.q_norm", "attn.k_norm"}
_MLP_MODULES = {"mlp", "ln2", "ln2_post"}
_EMBED_PREFIXES = ("embed.", "pos_embed.")
_FINAL_PREFIXES = ("ln_final.", "unembed.")


def param_role(name: str) -> ParamRole:
    """What parameter ``name`` feeds (see ``Part``)."""
    if name.startswith(_EMBED_PREFIXES):
        return ParamRole(None, "embed")
    if name.startswith(_FINAL_PREFIXES):
        return ParamRole(None, "final")
    m = _BLOCK.match(name)
    if m is None:
        return ParamRole(None, "unknown")
    layer, module, leaf = int(m.group(1)), m.group(2), m.group(3)
    if module == "attn" and leaf == "W_O":
        return ParamRole(layer, "attn_out")
    if module == "attn" and leaf == "b_O":
        return ParamRole(layer, "attn_out_bias")
    if module.split(".")[0] in ("attn", "ln1"):
        return ParamRole(layer, "attn")
    if module.split(".")[0] in _MLP_MODULES:
        return ParamRole(layer, "mlp")
    return ParamRole(layer, "unknown")


def layer_of(name: str) -> int | None:
    """The block a parameter belongs to (``None`` for embeddings, final norm, unembedding)."""
    return param_role(name).layer


def attn_out_names(layer: int) -> tuple[str, str]:
    """``(W_O, b_O)`` of a layer's attention: the output weight and the shared output bias."""
    return f"blocks.{layer}.attn.W_O", f"blocks.{layer}.attn.b_O"


_SHAPES: dict[str, tuple[str, ...]] = {
    "embed.W_E": ("d_vocab", "d_model"), "pos_embed.W_pos": ("n_ctx", "d_model"),
    "unembed.W_U": ("d_model", "d_vocab"), "unembed.b_U": ("d_vocab",),
    "ln1.w": ("d_model",), "ln1.b": ("d_model",), "ln2.w": ("d_model",),
    "ln2.b": ("d_model",), "ln_final.w": ("d_model",), "ln_final.b": ("d_model",),
    "attn.W_Q": ("n_heads", "d_model", "d_head"), "attn.W_K": ("n_heads", "d_model", "d_head"),
    "attn.W_V": ("n_heads", "d_model", "d_head"), "attn.W_O": ("n_heads", "d_head", "d_model"),
    "attn._W_K": ("n_kv", "d_model", "d_head"), "attn._W_V": ("n_kv", "d_model", "d_head"),
    "attn.b_Q": ("n_heads", "d_head"), "attn.b_K": ("n_heads", "d_head"),
    "attn.b_V": ("n_heads", "d_head"), "attn._b_K": ("n_kv", "d_head"),
    "attn._b_V": ("n_kv", "d_head"), "attn.b_O": ("d_model",),
    "mlp.W_in": ("d_model", "d_mlp"), "mlp.W_gate": ("d_model", "d_mlp"),
    "mlp.b_in": ("d_mlp",), "mlp.W_out": ("d_mlp", "d_model"), "mlp.b_out": ("d_model",),
}  # fmt: skip
"""Each TransformerLens parameter's axes (within a block, without the ``blocks.{l}.`` prefix)."""


def expected_shape(name: str, sig: Mapping[str, Any]) -> tuple[int, ...] | None:
    """The shape of TransformerLens parameter ``name`` in a model with this signature
    (``backend.signature``): ``()`` for a layer the model does not have, ``None`` where the
    signature does not say (a name or size it does not record).

    >>> expected_shape("blocks.1.attn._W_K", {"n_layers": 2, "n_heads": 4, "n_key_value_heads": 2,
    ...                                       "d_model": 8, "d_head": 2})
    (2, 8, 2)
    """
    g = {k: sig.get(k) for k in ("d_model", "d_vocab", "n_ctx", "n_heads", "d_head", "d_mlp")}
    g["n_kv"] = sig.get("n_key_value_heads") or g["n_heads"]
    m = re.fullmatch(r"blocks\.(\d+)\.(.+)", name)
    if m is not None:
        n_layers = sig.get("n_layers")
        if isinstance(n_layers, int) and int(m.group(1)) >= n_layers:
            return ()  # no such layer: no shape fits
        name = m.group(2)
    dims = _SHAPES.get(name)
    if dims is None or any(not isinstance(g[d], int) for d in dims):
        return None
    return tuple(int(g[d]) for d in dims)  # type: ignore[arg-type]


def slices_for_names(
    names: Iterable[str], n_heads: int, n_key_value_heads: int | None = None
) -> list[ParamSlice]:
    """The ownership partition of the parameters ``names`` (docs/scores.md §2), from the names
    and head counts alone (so a ``WeightDiff`` can say it without a model)."""
    n_kv = n_key_value_heads or n_heads
    out: list[ParamSlice] = []
    for name in names:
        m = _BLOCK.match(name)
        if m is None:
            out.append(ParamSlice(name, None, ()))
            continue
        layer, module, leaf = int(m.group(1)), m.group(2), m.group(3)
        heads = tuple(Component(layer, h) for h in range(n_heads))
        if module == "attn" and leaf in _HEAD_PARAMS:
            out.extend(ParamSlice(name, h, (heads[h],)) for h in range(n_heads))
        elif module == "attn" and leaf in _KV_PARAMS:
            group = n_heads // n_kv
            out.extend(ParamSlice(name, g, heads[g * group : (g + 1) * group]) for g in range(n_kv))
        elif module in _HEAD_SHARED_MODULES:
            out.append(ParamSlice(name, None, heads))
        elif module.split(".")[0] in _MLP_MODULES:
            out.append(ParamSlice(name, None, (Component(layer, None),)))
        else:  # attn.b_O, ln1_post, ...
            out.append(ParamSlice(name, None, ()))
    return out


def hook_name(component: Component) -> str:
    """The TransformerLens hook holding a component's output (``hook_names.hook_name``).

    >>> hook_name(Component(3, 1)), hook_name(Component(3))
    ('blocks.3.attn.hook_z', 'blocks.3.hook_mlp_out')
    """
    return hook_names.hook_name(component.layer, component.head)

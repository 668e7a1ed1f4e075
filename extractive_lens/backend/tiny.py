"""Tiny models: small, seeded, randomly initialised ``HookedTransformer``s or
``TransformerBridge``s for tests and examples, the same weights in both (``tiny_model``).

>>> base = tiny_model({"n_layers": 2}, seed=0)          # a seeded HookedTransformer
>>> base.cfg.d_model
32
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import Tensor

from extractive_lens.backend.building import as_bridge, native_bridge, write_native
from extractive_lens.backend.installed import (
    has_hooked,
    hooked_tl,
    quiet_transformer_lens,
    resolve_backend,
)
from extractive_lens.backend.tokenizer import named_tokenizer

TINY_DEFAULTS: dict[str, Any] = dict(
    n_layers=2,
    d_model=32,
    n_heads=4,
    d_head=8,
    d_mlp=64,
    d_vocab=50,
    n_ctx=32,
    act_fn="gelu",
    normalization_type="LN",
    positional_embedding_type="standard",
    dtype=torch.float32,
)


def tiny_model(
    cfg_overrides: dict[str, Any] | None = None,
    seed: int = 0,
    *,
    tokenizer: Any = None,
    init_scale: float = 1.0,
    device: str | torch.device = "cpu",
    backend: str = "auto",
) -> Any:
    """A small, seeded, randomly initialised model for tests and examples: a
    ``HookedTransformer`` (``backend="hooked"``, the default where TransformerLens has it) or a
    TransformerLens native ``TransformerBridge`` (``"bridge"``, the default on TransformerLens 4).

    >>> m = tiny_model({"n_layers": 3, "dtype": torch.float64}, seed=1)
    >>> m.cfg.n_layers
    3

    Biases and LayerNorm parameters are randomised too (TransformerLens initialises them to
    zero / one), so that every parameter matters in tests. ``init_scale`` scales the random
    weights for models that should be far from linear. The same ``seed`` gives the same weights
    in both backends: parameters draw their noise in the ``HookedTransformer``'s order (biases
    the native bridge does not have, a gated MLP's, stay zero there). Block variants the native
    bridge does not compute (parallel blocks, rotary on halves) are refused, saying what to use.
    """
    backend = resolve_backend(backend)
    cfg_dict = dict(TINY_DEFAULTS)
    cfg_dict.update(cfg_overrides or {})
    cfg_dict["seed"] = seed
    cfg_dict["device"] = str(device)
    if backend == "bridge":
        return _tiny_bridge(cfg_dict, seed, tokenizer=tokenizer, init_scale=init_scale)
    tl = hooked_tl("tiny_model(backend='hooked')")
    with quiet_transformer_lens():
        cfg = tl.HookedTransformerConfig(**cfg_dict)
        model = tl.HookedTransformer(cfg, tokenizer=named_tokenizer(tokenizer))
    values = _tiny_weights(
        {n: (tuple(p.shape), p.dtype) for n, p in model.named_parameters()}, seed, init_scale
    )
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(values[name])
    model.eval()
    return model


def _tiny_weights(
    shapes: dict[str, tuple[tuple[int, ...], torch.dtype]], seed: int, init_scale: float
) -> dict[str, Tensor]:
    """``tiny_model``'s random weights: one seeded stream drawn in ``HookedTransformer``
    parameter order (``hooked_order``), whichever class holds the parameters."""
    gen = torch.Generator().manual_seed(seed + 12345)
    out: dict[str, Tensor] = {}
    gated = any(n.endswith("mlp.W_gate") for n in shapes)
    for name in sorted(shapes, key=lambda n: hooked_order(n, gated)):
        shape, dtype = shapes[name]
        noise = torch.randn(shape, generator=gen, dtype=torch.float64)
        if re.search(r"\.(ln\w*|q_norm|k_norm)\.w$", name) or name.endswith("ln_final.w"):
            out[name] = (1.0 + 0.1 * noise).to(dtype)
        elif re.search(r"\.b(_\w+)?$", name) or name.endswith("b_U"):
            out[name] = (0.05 * noise).to(dtype)
        else:
            fan_in = shape[-2] if len(shape) >= 2 else shape[-1]
            out[name] = (init_scale * noise / fan_in**0.5).to(dtype)
    return out


# A HookedTransformer block registers its parameters in this order (TransformerLens 3.9); a
# gated MLP registers W_gate after W_out and its biases last.
_BLOCK_ORDER = (
    "ln1.w", "ln1.b", "ln2.w", "ln2.b",
    "attn.W_Q", "attn.W_O", "attn.b_Q", "attn.b_O",
    "attn.W_K", "attn.W_V", "attn.b_K", "attn.b_V",
    "attn._W_K", "attn._W_V", "attn._b_K", "attn._b_V",
)  # fmt: skip
_MLP_ORDER = ("mlp.W_in", "mlp.b_in", "mlp.W_out", "mlp.b_out")
_GATED_ORDER = ("mlp.W_in", "mlp.W_out", "mlp.W_gate", "mlp.b_in", "mlp.b_out")
_TOP_ORDER = ("embed.W_E", "pos_embed.W_pos", "blocks", "ln_final.w", "ln_final.b",
              "unembed.W_U", "unembed.b_U")  # fmt: skip


def hooked_order(name: str, gated: bool = False) -> tuple[int, int, int]:
    """The sort key that puts TransformerLens parameter names in ``HookedTransformer`` order.

    >>> sorted(["unembed.W_U", "blocks.0.attn.W_K", "blocks.0.ln1.w", "embed.W_E"], key=hooked_order)
    ['embed.W_E', 'blocks.0.ln1.w', 'blocks.0.attn.W_K', 'unembed.W_U']
    """
    blocks = _TOP_ORDER.index("blocks")
    m = re.fullmatch(r"blocks\.(\d+)\.(.+)", name)
    if m is None:
        return (_TOP_ORDER.index(name) if name in _TOP_ORDER else len(_TOP_ORDER), 0, 0)
    order = _BLOCK_ORDER + (_GATED_ORDER if gated else _MLP_ORDER)
    rest = m.group(2)
    return (blocks, int(m.group(1)), order.index(rest) if rest in order else len(order))


def _tiny_bridge(cfg: dict[str, Any], seed: int, *, tokenizer: Any, init_scale: float) -> Any:
    """``tiny_model`` as a TransformerLens native ``TransformerBridge``: the ``HookedTransformer``'s
    weights (the same seed draws the same values), except biases the native model does not have
    (a gated MLP's ``b_in``...), which stay 0. On TransformerLens 3.9 it is ``as_bridge`` of that
    ``HookedTransformer`` (which checks that the native architecture computes the same logits);
    on 4.x it is built directly."""
    refusal = _native_refusal(cfg, hooked_checks=has_hooked())
    if refusal:
        raise NotImplementedError(refusal)
    cfg = dict(cfg)
    dtype, device = cfg.pop("dtype", torch.float32), cfg.pop("device", "cpu")
    out = native_bridge(cfg, named_tokenizer(tokenizer), {}, device=device, dtype=dtype,
                        model_name=cfg.get("model_name", "tiny"))  # fmt: skip
    keep = _native_names(out)
    if has_hooked():
        hooked = tiny_model(
            dict(cfg, dtype=dtype, device=device), seed, tokenizer=tokenizer,
            init_scale=init_scale, backend="hooked",
        )  # fmt: skip
        with torch.no_grad():
            for name, p in hooked.named_parameters():
                if name not in keep:
                    p.zero_()
        return as_bridge(hooked)
    from extractive_lens.backend import bridge as bridge_backend

    params = bridge_backend.parameters(out)
    values = _tiny_weights({n: (tuple(p.shape), p.dtype) for n, p in params.items()}, seed,
                           init_scale)  # fmt: skip
    write_native(out, {n: v for n, v in values.items() if n in keep})
    return out


def _native_names(bridge: Any) -> set[str]:
    """The TransformerLens names a native bridge holds weights for (the biases it lacks are
    zeros TransformerLens shows)."""
    from extractive_lens.backend import bridge as bridge_backend

    keep = bridge_backend.stored_names(bridge)
    if "bias" in dict(bridge.unembed.original_component.named_buffers(recurse=False)):
        keep.add("unembed.b_U")  # a fixed buffer in TransformerLens 4: write_native sets it
    return keep


def _native_refusal(cfg: dict[str, Any], hooked_checks: bool) -> str | None:
    """Why TransformerLens's native ``TransformerBridge`` cannot compute this configuration (a
    sentence saying what to use instead), or ``None``. ``hooked_checks``: TransformerLens 3.9,
    where ``as_bridge`` checks the bridge against the ``HookedTransformer`` to the dtype's
    rounding."""
    if cfg.get("parallel_attn_mlp"):
        return (
            "TransformerLens's native TransformerBridge has no parallel attention/MLP blocks: "
            "use tiny_model(..., backend='hooked') (TransformerLens 3.9), or save a tiny Hugging "
            "Face GPT-NeoX checkpoint and load_checkpoint(dir, backend='bridge') it."
        )
    if cfg.get("positional_embedding_type") == "rotary" and not cfg.get("rotary_adjacent_pairs"):
        return (
            "TransformerLens's native TransformerBridge rotates adjacent pairs of dimensions "
            "(GPT-J style): pass rotary_adjacent_pairs=True to tiny_model, use "
            "backend='hooked' (TransformerLens 3.9), or load a Hugging Face checkpoint with "
            "load_checkpoint(dir, backend='bridge')."
        )
    rms = str(cfg.get("normalization_type")).startswith("RMS")
    rotary = cfg.get("positional_embedding_type") == "rotary"
    if hooked_checks and cfg.get("dtype") == torch.float64 and (rms or rotary):
        return (
            "TransformerLens 3.9's native TransformerBridge computes RMS norms and rotary "
            "embeddings to about 1e-7 of the logits, not to float64's rounding: build this "
            "bridge with dtype=torch.float32, use backend='hooked', or load a Hugging Face "
            "checkpoint with load_checkpoint(dir, backend='bridge')."
        )
    return None

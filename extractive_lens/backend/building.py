"""Models built in memory from a TransformerLens configuration and TransformerLens-named weights:
``build`` (a ``HookedTransformer``), ``native_bridge`` (TransformerLens's native
``TransformerBridge``, offline) and ``as_bridge`` (a ``HookedTransformer`` as such a bridge,
checked to compute the same logits). ``tiny.py`` and the world model build on these.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from extractive_lens.backend.hooked import notes
from extractive_lens.backend.installed import (
    bridge_class,
    hooked_tl,
    quiet_transformer_lens,
    quiet_transformers,
)
from extractive_lens.backend.tokenizer import BOS_NOTE, named_tokenizer

if TYPE_CHECKING:  # pragma: no cover
    from transformer_lens import HookedTransformer


def record_processing(model: Any, processed: bool) -> None:
    """Note on ``model`` whether its weights were folded / centred (results say so)."""
    notes(model)["processed"] = bool(processed)


def build(
    cfg: dict[str, Any],
    tokenizer: Any = None,
    *,
    notes_: dict[str, Any] | None = None,
    **kwargs: Any,
) -> HookedTransformer:
    """A ``HookedTransformer`` from a configuration dict (TransformerLens's own initialisation,
    seeded by ``cfg["seed"]`` when given), unprocessed, with ``notes_`` recorded on it."""
    tl = hooked_tl("Building a world model from its configuration")
    with quiet_transformer_lens():
        model = tl.HookedTransformer(
            tl.HookedTransformerConfig(**cfg), tokenizer=named_tokenizer(tokenizer), **kwargs
        )
    record_processing(model, processed=False)
    notes(model).update(notes_ or {})
    notes(model).setdefault(BOS_NOTE, "builder")
    return model


def native_bridge(
    cfg: dict[str, Any],
    tokenizer: Any,
    parameters: dict[str, Tensor],
    *,
    notes_: dict[str, Any] | None = None,
    device: str | torch.device | None = "cpu",
    dtype: torch.dtype = torch.float32,
    model_name: str = "custom",
) -> Any:
    """A TransformerLens native ``TransformerBridge`` (``boot_native``, offline) with this
    configuration and these weights (TransformerLens names), in eval mode. Needs no
    ``HookedTransformer``, so it works on TransformerLens 4 too."""
    import copy

    TransformerBridge = bridge_class()
    with quiet_transformer_lens(), quiet_transformers():
        from transformer_lens.config import TransformerBridgeConfig

    cfg = dict(cfg, dtype=dtype, device=device, init_weights=False, architecture=None)
    cfg.update(original_architecture=None)
    with quiet_transformer_lens(), quiet_transformers():
        tok = None if tokenizer is None else copy.deepcopy(tokenizer)  # the bridge mutates it
        out = TransformerBridge.boot_native(
            TransformerBridgeConfig.from_dict(cfg), tokenizer=tok, device=device, dtype=dtype,
            model_name=model_name,
        )  # fmt: skip
    write_native(out, parameters)
    notes(out).update(copy.deepcopy(notes_ or {}))
    notes(out).setdefault(BOS_NOTE, "builder")
    out.eval()
    return out


def write_native(bridge: Any, parameters: dict[str, Tensor]) -> None:
    """Write TransformerLens-named weights into a native bridge, the unembedding bias included
    (TransformerLens 4 gives the native head a fixed bias: a buffer, not a weight)."""
    from extractive_lens.backend import bridge as bridge_backend

    parameters = dict(parameters)
    head = bridge.unembed.original_component
    if "bias" in dict(head.named_buffers(recurse=False)) and "unembed.b_U" in parameters:
        with torch.no_grad():
            head.bias.copy_(parameters.pop("unembed.b_U"))
    bridge_backend.write_parameters(bridge, parameters)


AS_BRIDGE_TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-4, torch.float16: 1e-2,
                       torch.bfloat16: 5e-2}  # fmt: skip
"""``as_bridge``'s self-check: the largest logit difference, relative to the largest logit, that
rounding in each dtype explains (two implementations that round differently); a bridge that
computes another function (rotary, RMS or parallel blocks in TransformerLens 3.9's native
model) differs by tens of percent."""


def as_bridge(model: HookedTransformer) -> Any:
    """A TransformerLens ``TransformerBridge`` with ``model``'s configuration, weights, tokenizer
    and notes: TransformerLens's native architecture, booted offline (``boot_native``).

    >>> from extractive_lens.backend.tiny import tiny_model
    >>> bridge = as_bridge(tiny_model({"n_layers": 2}))
    >>> type(bridge).__name__
    'TransformerBridge'
    """
    from extractive_lens.backend import hooked

    if not hooked.handles(model):
        raise TypeError(f"as_bridge converts a HookedTransformer, not a {type(model).__name__}.")
    out = native_bridge(
        model.cfg.to_dict(), model.tokenizer, hooked.parameters(model), notes_=notes(model),
        device=model.cfg.device, dtype=model.cfg.dtype, model_name=model.cfg.model_name,
    )  # fmt: skip
    probe = torch.arange(min(8, model.cfg.n_ctx), device=model.cfg.device)[None] % model.cfg.d_vocab
    with torch.no_grad():
        want, got = model(probe), out(probe)
    err = float((got - want).abs().max() / (want.abs().max() + 1e-30))
    if not err <= AS_BRIDGE_TOLERANCE.get(model.cfg.dtype, 1e-4):
        raise NotImplementedError(
            "TransformerLens's native TransformerBridge does not compute what this "
            f"HookedTransformer computes (logits differ by {err:.1e} of their largest value; it "
            "implements sequential LayerNorm blocks with learned positions exactly, not parallel "
            "blocks, rotary or RMS norms in float64). Load a Hugging Face checkpoint with "
            "load_checkpoint(dir, backend='bridge') instead."
        )
    return out

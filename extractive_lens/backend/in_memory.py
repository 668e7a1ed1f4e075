"""A Hugging Face model already in memory as a TransformerLens model (``from_hf``).

>>> hf = transformers.AutoModelForCausalLM.from_pretrained("runs/base")  # doctest: +SKIP
>>> base = from_hf(hf, tokenizer)                                        # doctest: +SKIP

The same rules as ``load_checkpoint``: weights unprocessed (as trained), the BOS setting taken
from the tokenizer (``tokenizer(text)`` with special tokens, as under Hugging Face), the model
family's conversion on ``backend="hooked"`` (a copy of the weights) and
``TransformerBridge.boot_transformers(hf_model=...)`` on ``backend="bridge"`` (the bridge runs
*this* model object: no copy; scoring restores its weights exactly).
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from extractive_lens.backend.building import record_processing
from extractive_lens.backend.converting import drop_tokenizer, hooked_from_hf, placeholder_tokenizer
from extractive_lens.backend.hooked import notes
from extractive_lens.backend.installed import (
    bridge_class,
    quiet_transformer_lens,
    quiet_transformers,
    resolve_backend,
)
from extractive_lens.backend.tokenizer import BOS_NOTE, named_tokenizer, tokenizer_prepends_bos


def from_hf(
    model: Any,
    tokenizer: Any = None,
    *,
    backend: str = "auto",
    dtype: torch.dtype | None = None,
    device: str | torch.device | None = None,
) -> Any:
    """A ``transformers`` causal LM object (and its tokenizer) as an unprocessed TransformerLens
    model: a ``HookedTransformer`` (``backend="hooked"``, the model family's conversion; a copy
    of the weights) or a ``TransformerBridge`` around this very object (``"bridge"``).
    ``"auto"`` (default): a ``HookedTransformer`` where TransformerLens has one (3.x), else a
    bridge (4.x). ``dtype`` and ``device`` default to the model's own.

    A PEFT model is refused: load its base with ``from_hf`` (or ``load_checkpoint``) and its
    adapter as the weight change, ``WeightDiff.from_peft(base, peft_model)``.
    """
    _refuse(model)
    backend = resolve_backend(backend)
    first = next(model.parameters())
    dtype = first.dtype if dtype is None else dtype
    device = first.device if device is None else device
    name = str(getattr(model.config, "_name_or_path", "") or type(model).__name__)
    tokenizer = named_tokenizer(tokenizer)
    config = model.config
    if not getattr(config, "architectures", None):  # a config made in memory: the class says
        config = copy.copy(config)
        config.architectures = [type(model).__name__]
    if backend == "hooked":
        return hooked_from_hf(
            config, lambda: model, name=name, tokenizer=tokenizer, dtype=dtype, device=device
        )
    TransformerBridge = bridge_class()

    if dtype != first.dtype or torch.device(device) != first.device:
        raise ValueError(
            f"from_hf(backend='bridge') runs this very model object, so dtype={dtype} / "
            f"device={device} would convert your model in place (it is {first.dtype} on "
            f"{first.device}): convert it yourself first (model.to(...)) and call from_hf "
            "without them, or use backend='hooked', which copies the weights."
        )
    # no tokenizer given: none (as for a HookedTransformer), not one looked up by the model's
    # name (offline, that fails); the bridge boots with a placeholder, dropped at once
    given = placeholder_tokenizer() if tokenizer is None else copy.deepcopy(tokenizer)
    with quiet_transformer_lens(), quiet_transformers():
        out = TransformerBridge.boot_transformers(
            name, hf_model=model, dtype=dtype, tokenizer=given
        )
    if tokenizer is None:
        drop_tokenizer(out)
    if tokenizer is not None:
        out.cfg.default_prepend_bos = tokenizer_prepends_bos(tokenizer)
    record_processing(out, processed=False)
    notes(out)[BOS_NOTE] = "tokenizer"
    out.eval()
    return out


def _refuse(model: Any) -> None:
    """Say what to pass instead of a PEFT model or an object that is no ``transformers`` LM."""
    if hasattr(model, "peft_config") and hasattr(model, "get_base_model"):
        raise TypeError(
            "from_hf got a PEFT model (base weights with adapters attached). Load the base "
            "without the adapter (from_hf(AutoModelForCausalLM.from_pretrained(base_dir)) or "
            "el.load_checkpoint(base_dir)) and the adapter as the weight change: "
            "el.WeightDiff.from_peft(base, peft_model)."
        )
    if not (hasattr(model, "config") and hasattr(model, "parameters")):
        raise TypeError(
            f"from_hf takes a transformers model (AutoModelForCausalLM.from_pretrained(...)), "
            f"not a {type(model).__name__}; for a directory use el.load_checkpoint(dir)."
        )
    if getattr(model.config, "auto_map", None):
        raise ValueError(
            "from_hf refuses a model built from code shipped with its checkpoint (config.auto_map): "
            "extractive_lens converts the architectures it knows, and never runs such code."
        )

"""A ``transformers`` model as a TransformerLens model: ``hooked_from_hf`` (its family's config and
weight conversion) and ``boot_bridge`` (``TransformerBridge.boot_transformers``).

Every checkpoint format converts through these (``loading.py``'s Hugging Face directories,
``gguf.py``, ``in_memory.py``'s ``from_hf``); they read no files of their own choosing and
import no format, so a format can use them without importing ``loading`` back.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from extractive_lens.backend.building import record_processing
from extractive_lens.backend.families import family_of, hf_config_to_tl
from extractive_lens.backend.hooked import notes
from extractive_lens.backend.installed import (
    bridge_class,
    hooked_tl,
    quiet_transformer_lens,
    quiet_transformers,
)
from extractive_lens.backend.tokenizer import BOS_NOTE, named_tokenizer, tokenizer_prepends_bos

if TYPE_CHECKING:  # pragma: no cover
    from transformer_lens import HookedTransformer

NO_PROCESSING = dict(
    fold_ln=False,
    center_writing_weights=False,
    center_unembed=False,
    fold_value_biases=False,
    refactor_factored_attn_matrices=False,
)
"""``load_and_process_state_dict``'s switches, all off: weights exactly as trained."""


def hooked_from_hf(
    hf_config: Any,
    hf_model: Callable[[], Any],
    *,
    name: str,
    tokenizer: Any,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> HookedTransformer:
    """An unprocessed ``HookedTransformer`` from a ``transformers`` model: its config converted
    by its family (``families.py``), its weights by TransformerLens's conversion function.
    ``hf_model()`` builds the ``transformers`` model in ``dtype``; it is called only once the
    config converted, so an unsupported architecture is refused before any weight is read."""
    tl = hooked_tl("load_checkpoint(backend='hooked')")
    cfg = hf_config_to_tl(hf_config, dtype=dtype, device=str(device))
    cfg.model_name = name
    tokenizer = named_tokenizer(tokenizer)
    if tokenizer is not None:  # before TransformerLens gives a BOS-less tokenizer its EOS as BOS
        cfg.default_prepend_bos = tokenizer_prepends_bos(tokenizer)
    source = hf_model()
    state_dict = family_of(hf_config).weights(source, cfg)
    with quiet_transformer_lens():
        model = tl.HookedTransformer(cfg, tokenizer=tokenizer, move_to_device=False)
        model.load_and_process_state_dict(
            {k: v.to(dtype) for k, v in state_dict.items()}, **NO_PROCESSING
        )
    model.to(device, print_details=False)
    record_processing(model, processed=False)
    notes(model)[BOS_NOTE] = "tokenizer"
    del source
    model.eval()
    return model


def boot_bridge(
    path: Path | str,
    *,
    tokenizer: Any,
    dtype: torch.dtype = torch.float32,
    device: Any = None,
    hf_model: Any = None,
) -> Any:
    """``TransformerBridge.boot_transformers`` on a local directory (or on ``hf_model``, already
    loaded), quietly, with a tokenizer of its own (the bridge changes the tokenizer it is given).
    A directory's refusals (``loading.refuse_remote_code``, ``refuse_incomplete_weights``) are
    the caller's, before this reads it."""
    import copy

    TransformerBridge = bridge_class()

    tokenizer = named_tokenizer(tokenizer)
    with quiet_transformer_lens(), quiet_transformers():
        model = TransformerBridge.boot_transformers(
            str(path), tokenizer=None if tokenizer is None else copy.deepcopy(tokenizer),
            dtype=dtype, device=device, trust_remote_code=False, hf_model=hf_model,
        )  # fmt: skip
    model.cfg.model_name = Path(path).name
    if tokenizer is not None:
        model.cfg.default_prepend_bos = tokenizer_prepends_bos(tokenizer)
    record_processing(model, processed=False)
    notes(model)[BOS_NOTE] = "tokenizer"
    model.eval()
    return model

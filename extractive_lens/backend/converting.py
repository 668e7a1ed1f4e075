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
    find_tokenizer: bool = True,
) -> Any:
    """``TransformerBridge.boot_transformers`` on a local directory (or on ``hf_model``, already
    loaded), quietly, with a tokenizer of its own (the bridge changes the tokenizer it is given).
    A directory's refusals (``loading.refuse_remote_code``, ``refuse_incomplete_weights``) are
    the caller's, before this reads it.

    ``tokenizer=None``: with ``find_tokenizer`` the bridge loads the one ``path`` names (a Hub
    model's); without, the model has none (``model.tokenizer is None``, as a
    ``HookedTransformer`` loaded without one): a checkpoint saved without tokenizer files loads,
    and only what needs a tokenizer (text prompts) says it is missing. TransformerLens 4's
    ``boot_transformers`` always builds one, so it boots with a one-word placeholder that is
    dropped at once."""
    import copy

    TransformerBridge = bridge_class()

    tokenizer = named_tokenizer(tokenizer)
    given = tokenizer if tokenizer is not None or find_tokenizer else placeholder_tokenizer()
    with quiet_transformer_lens(), quiet_transformers():
        model = TransformerBridge.boot_transformers(
            str(path), tokenizer=None if given is None else copy.deepcopy(given),
            dtype=dtype, device=device, trust_remote_code=False, hf_model=hf_model,
        )  # fmt: skip
    if tokenizer is None and not find_tokenizer:
        drop_tokenizer(model)
    model.cfg.model_name = Path(path).name
    if tokenizer is not None:
        model.cfg.default_prepend_bos = tokenizer_prepends_bos(tokenizer)
    record_processing(model, processed=False)
    notes(model)[BOS_NOTE] = "tokenizer"
    model.eval()
    return model


def drop_tokenizer(model: Any) -> None:
    """A bridge booted with ``placeholder_tokenizer`` left without a tokenizer."""
    model.tokenizer = None
    driver = getattr(model, "_driver", None)
    if driver is not None and hasattr(driver, "tokenizer"):
        driver.tokenizer = None


def placeholder_tokenizer() -> Any:
    """A one-word tokenizer (``<unk>``) to boot a bridge for a checkpoint that has none
    (``boot_bridge(find_tokenizer=False)``); dropped once the bridge is built."""
    import tokenizers
    import transformers

    word = tokenizers.Tokenizer(tokenizers.models.WordLevel({"<unk>": 0}, unk_token="<unk>"))
    return transformers.PreTrainedTokenizerFast(tokenizer_object=word, unk_token="<unk>")

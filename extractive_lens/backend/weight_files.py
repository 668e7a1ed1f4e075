"""A checkpoint directory's weight files, chosen as ``transformers`` chooses them and read with
plain file reads at the offsets their headers give.

- ``weight_files(dir)``: the files ``transformers`` would load: the file ``config.json`` names
  (``transformers_weights``), else ``model.safetensors``, else the files
  ``model.safetensors.index.json`` names. Nothing else in the folder is read: stale shards of an
  older save or an optimizer's ``.safetensors`` beside them change nothing.
- ``SafetensorsFiles(dir)``: their tensors by name, a name held by two of them refused. Each
  file is read through the file layer (``extractive_lens.files.SafetensorsFile``: regular files
  only, opened once, identity checked around every read, tensors copied out), so a file
  truncated or rewritten in place is refused by name, and one renamed over is read as it was.
- ``hf_model(dir, hf_config, dtype=...)``: the ``transformers`` model of a checkpoint folder,
  its weights read from ``SafetensorsFiles`` (never through ``transformers``' own memory map of
  the files: a file another process cuts short while it loads would kill the process with
  SIGBUS, and one rewritten in place would give a model holding weights of both versions). Each
  tensor is read when ``transformers`` sets it (``Stored``: one tensor's bytes at a time beyond
  the model itself), and every file's identity is checked again after the load, so a file that
  changed during it is refused by name. ``load_checkpoint`` builds every backend's model on it.
- ``loading_info(dir, hf_config)``: what ``transformers`` would report missing, unexpected or
  mis-shaped in that load, from the headers alone (``refuse_incomplete_weights``).
- ``refuse_special_files(dir)``: a checkpoint folder holds regular files (or links to them).

>>> import tempfile; from pathlib import Path
>>> weight_files(Path(tempfile.mkdtemp()))  # doctest: +IGNORE_EXCEPTION_DETAIL
Traceback (most recent call last):
FileNotFoundError: ... has no model.safetensors ...
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

from torch import Tensor

from extractive_lens import files
from extractive_lens.files import not_regular

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
DTYPES = files.safetensors_dtypes()
FIX = (
    "the checkpoint is damaged or was not written completely; re-save it "
    "(model.save_pretrained(dir))."
)
CHANGED = (
    "build the diff again once the file is complete; write a new checkpoint to a new folder, "
    "or rename it into place (an open diff keeps reading the file it opened)"
)
CHANGED_WHILE_LOADING = (
    "load the checkpoint again once the file is complete; write a new checkpoint to a new "
    "folder, or rename it into place (a load reads the files it opened)"
)
_FOLDER_FIX = (
    "a checkpoint folder holds regular files (or links to them); replace it with the file itself."
)


def refuse_special_files(folder: str | Path) -> None:
    """Refuse a checkpoint folder holding a FIFO, socket, device or link loop (following
    links), which ``transformers`` or our own reads could block on forever; subfolders are
    left alone."""
    files.refuse_special_files(folder, _FOLDER_FIX)


def SafetensorsFile(path: Path, changed: str = CHANGED) -> files.SafetensorsFile:  # noqa: N802
    """One of a checkpoint's weight files (``files.SafetensorsFile``), refusals saying to
    re-save the checkpoint (or, for a file changed since it was opened, ``changed``)."""
    return files.SafetensorsFile(path, fix=FIX, changed=changed)


def _inside(folder: Path, name: object, source: Path) -> Path:
    if not isinstance(name, str) or not name:
        raise ValueError(f"{source} names a weight file {name!r}, which is not a file name.")
    path = folder / name
    if os.path.isabs(name) or ".." in Path(name).parts:
        raise ValueError(
            f"{source} names {name!r}, outside {folder}: a checkpoint's weight files are inside "
            "its folder."
        )
    return path


def read_index(path: Path) -> dict[str, str]:
    """The ``weight_map`` (tensor name -> shard file) of a sharded checkpoint's index, checked."""
    try:
        index = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(
            f"{path} is not valid JSON ({e}): the sharded checkpoint's index is damaged; re-save "
            "the checkpoint (model.save_pretrained(dir))."
        ) from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
    ):
        raise ValueError(
            f"{path} has no weight_map of tensor names to shard files: the sharded checkpoint's "
            "index is damaged; re-save the checkpoint (model.save_pretrained(dir))."
        )
    return weight_map


def weight_files(folder: str | Path) -> list[Path]:
    """The safetensors files ``transformers`` loads from ``folder``, in its order of preference
    (``config.json``'s ``transformers_weights``, ``model.safetensors``, the index's shards)."""
    return _chosen(Path(folder))[0]


def _chosen(folder: Path) -> tuple[list[Path], tuple[Path, dict[str, str]] | None]:
    """``weight_files`` and the index they came from with its ``weight_map`` (``None``: one
    file)."""
    chosen: Path | None = None
    config = folder / "config.json"
    if config.is_file():
        try:
            explicit = json.loads(config.read_text(encoding="utf-8")).get("transformers_weights")
        except (ValueError, UnicodeDecodeError, AttributeError):
            explicit = None  # the config loader says what is wrong with it
        if explicit is not None:
            chosen = _inside(folder, explicit, config)
    if chosen is None:
        chosen = folder / SINGLE if os.path.lexists(folder / SINGLE) else folder / INDEX
    if not os.path.lexists(chosen):
        raise FileNotFoundError(
            f"{folder} has no {SINGLE} or {INDEX}: load_checkpoint and "
            "WeightDiff.from_checkpoints read safetensors checkpoints (save with "
            "model.save_pretrained(dir), the default format), or load the models yourself and "
            "use from_hf and WeightDiff.from_models."
        )
    if not chosen.name.endswith(".index.json"):
        return [chosen], None
    _regular(chosen)
    weight_map = read_index(chosen)
    return [_inside(folder, s, chosen) for s in sorted(set(weight_map.values()))], (
        chosen,
        weight_map,
    )


def _regular(path: Path) -> None:
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise FileNotFoundError(
            f"{path} is missing: the checkpoint is incomplete (every file its index names must "
            "be there)."
        ) from None
    if not stat.S_ISREG(mode):
        raise not_regular(path, mode, _FOLDER_FIX)


class SafetensorsFiles:
    """The tensors of the weight files ``transformers`` would load from a checkpoint directory
    (``weight_files``), by name, one read at a time; ``changed`` ends the refusal of a file
    changed since it was opened (what to do)."""

    def __init__(self, path: str | Path, changed: str = CHANGED) -> None:
        self.path = Path(path)
        refuse_special_files(self.path)
        paths, index = _chosen(self.path)
        for p in paths:
            _regular(p)
        self.files = [SafetensorsFile(p, changed) for p in paths]
        self.where: dict[str, files.SafetensorsFile] = {}
        for f in self.files:
            for name in f.entries:
                other = self.where.setdefault(name, f)
                if other is not f:
                    raise ValueError(
                        f"{self.path}: {name} is in both {other.path.name} and {f.path.name}: "
                        "which one transformers keeps depends on its load order. Re-save the "
                        "checkpoint (model.save_pretrained(dir)) so each tensor is in one file."
                    )
        if index is not None:
            index_path, weight_map = index
            for name, shard in weight_map.items():
                holder = self.where.get(name)
                if holder is None or holder.path != self.path / shard:
                    held = "no file" if holder is None else holder.path.name
                    raise ValueError(
                        f"{index_path} says {name} is in {shard}, but {held} holds it: the index "
                        "and the shards are from different saves; re-save the checkpoint "
                        "(model.save_pretrained(dir))."
                    )

    def __contains__(self, name: object) -> bool:
        return name in self.where

    def get(self, name: str) -> Tensor:
        return self.where[name].read_tensor(name)


class Stored:
    """One tensor of a checkpoint's weight file, read (copied out through the file layer) only
    when ``transformers`` asks for it with ``stored[...]``, as it reads a ``safetensors`` slice:
    a ``state_dict`` of these holds no weights, so a load holds one copy of them, the model's.
    ``read=False``: an empty tensor of its shape and dtype on the meta device, nothing read
    (``loading_info``)."""

    def __init__(self, file: files.SafetensorsFile, name: str, read: bool = True) -> None:
        self.file, self.name, self.read = file, name, read
        self.dtype, shape, _, _ = file.entries[name]
        self.shape = tuple(shape)

    def __getitem__(self, index: Any) -> Tensor:
        import torch

        if not self.read:
            return torch.empty(self.shape, dtype=self.dtype, device="meta")[index]
        return self.file.read_tensor(self.name)[index]


def _model_class(folder: str | Path, hf_config: Any) -> Any:
    import transformers

    model_class = transformers.MODEL_FOR_CAUSAL_LM_MAPPING.get(type(hf_config), None)
    if model_class is None:
        raise ValueError(
            f"{Path(folder) / 'config.json'} describes a {type(hf_config).__name__}, which "
            "transformers has no causal language model class for: pass a checkpoint of a "
            "causal language model."
        )
    return model_class


def loading_info(folder: str | Path, hf_config: Any) -> dict[str, Any]:
    """``transformers``' report of a load of the folder's weights into the model of
    ``hf_config`` (``missing_keys``, ``unexpected_keys``, ``mismatched_keys``), made on the meta
    device from the files' headers: no weight is read (``transformers``' own check of a folder
    reads every tensor through its memory map)."""
    weights = SafetensorsFiles(folder)
    try:
        state_dict = {name: Stored(f, name, read=False) for name, f in weights.where.items()}
        _, info = _model_class(folder, hf_config).from_pretrained(
            None, config=hf_config, state_dict=state_dict, device_map="meta",
            output_loading_info=True,
        )  # fmt: skip
    finally:
        for f in weights.files:
            f.close()
    return dict(info)


def hf_model(folder: str | Path, hf_config: Any, *, dtype: Any, **kwargs: Any) -> Any:
    """The ``transformers`` model of ``hf_config`` holding the weights of the checkpoint folder
    ``folder``, read through the file layer (module docstring) in ``dtype``; ``kwargs`` go to
    ``from_pretrained`` (``attn_implementation``). The files' identities are checked after the
    load: one truncated or rewritten while it loaded is refused by name."""
    model_class = _model_class(folder, hf_config)
    weights = SafetensorsFiles(folder, CHANGED_WHILE_LOADING)
    try:
        state_dict = {name: Stored(f, name) for name, f in weights.where.items()}
        model = model_class.from_pretrained(
            None, config=hf_config, state_dict=state_dict, dtype=dtype, **kwargs
        )
        for f in weights.files:
            f.check()  # a file changed after its last tensor was read: refused too
    finally:
        for f in weights.files:
            f.close()
    model.config._name_or_path = model.name_or_path = str(folder)  # as a load by its name
    return model.eval()

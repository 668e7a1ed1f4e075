"""A checkpoint directory's weight files, chosen as ``transformers`` chooses them and read with
plain file reads at the offsets their headers give.

- ``weight_files(dir)``: the files ``transformers`` would load: the file ``config.json`` names
  (``transformers_weights``), else ``model.safetensors``, else the files
  ``model.safetensors.index.json`` names. Nothing else in the folder is read: stale shards of an
  older save or an optimizer's ``.safetensors`` beside them change nothing.
- ``SafetensorsFiles(dir)``: their tensors by name, a name held by two of them refused. Each
  file is opened once (only a regular file: a FIFO or a device would block forever) and its
  identity (device, inode, size, modification time) recorded; every read
  checks it before and after (``os.fstat`` of the open file), so a file truncated or rewritten
  in place (``cp``, ``dd``, ``rsync --inplace``) is refused by name instead of faulting (an mmap
  of a truncated file kills the process with SIGBUS) or silently giving a second answer. A file
  replaced by renaming a new one over it is still read as it was when opened.
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
import weakref
from pathlib import Path

import torch
from torch import Tensor

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
MAX_HEADER = 100 * 2**20  # safetensors' own limit on the JSON header

DTYPES: dict[str, torch.dtype] = {
    name: dt
    for name, dt in {
        "F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
        "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32, "I16": torch.int16,
        "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
        "F8_E4M3": getattr(torch, "float8_e4m3fn", None),
        "F8_E5M2": getattr(torch, "float8_e5m2", None),
        "U16": getattr(torch, "uint16", None), "U32": getattr(torch, "uint32", None),
        "U64": getattr(torch, "uint64", None),
    }.items()
    if dt is not None
}  # fmt: skip


def _kind(mode: int) -> str:
    for test, what in ((stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISDIR, "a directory")):  # fmt: skip
        if test(mode):
            return what
    return "not a regular file"


def _not_regular(path: Path, mode: int) -> ValueError:
    return ValueError(
        f"{path} is {_kind(mode)}, not a regular file: a checkpoint folder holds regular files "
        "(or links to them); reading anything else could block forever. Replace it with the "
        "file itself."
    )


def refuse_special_files(folder: str | Path) -> None:
    """Refuse a checkpoint folder holding a FIFO, socket or device (following links), which
    ``transformers`` or our own reads could block on forever; subfolders are left alone."""
    folder = Path(folder)
    if not folder.is_dir():
        return  # the loaders say what a checkpoint directory is
    for entry in sorted(folder.iterdir()):
        try:
            mode = os.stat(entry).st_mode
        except OSError:
            continue  # a dangling link: the loader names what is missing
        if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
            raise _not_regular(entry, mode)


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
            f"{folder} has no {SINGLE} or {INDEX}: WeightDiff.from_checkpoints reads safetensors "
            "checkpoints (save with model.save_pretrained(dir), the default format), or load "
            "both models and use WeightDiff.from_models."
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
        raise _not_regular(path, mode)


def _pread_into(fd: int, view: memoryview, offset: int) -> int:
    """Read into ``view`` at ``offset`` (no shared file position: threads may read at once)."""
    if hasattr(os, "preadv"):
        return os.preadv(fd, [view], offset)
    chunk = os.pread(fd, len(view), offset)
    view[: len(chunk)] = chunk
    return len(chunk)


def _identity(st: os.stat_result) -> tuple[int, ...]:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)  # not ctime: a rename over it
    # changes that, and the open file still holds the bytes it had


class SafetensorsFile:
    """One safetensors file, opened once (regular files only), its header parsed and checked;
    ``read(name)`` reads one tensor with ``os.pread`` after checking the file is unchanged."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd: int | None = None
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))  # a FIFO would block
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise _not_regular(path, st.st_mode)
            if hasattr(os, "set_blocking"):
                os.set_blocking(fd, True)
            self._identity = _identity(st)
            self.entries, self._data_start = self._header(fd, st.st_size)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        self._closer = weakref.finalize(self, os.close, fd)  # also at exit, os still there

    def _damaged(self, why: str) -> ValueError:
        return ValueError(
            f"{self.path} is not a valid safetensors file ({why}): the checkpoint is damaged or "
            "was not written completely; re-save it (model.save_pretrained(dir))."
        )

    def _header(self, fd: int, size: int) -> tuple[dict[str, tuple[torch.dtype, tuple[int, ...], int, int]], int]:  # fmt: skip
        head = os.pread(fd, 8, 0)
        if len(head) < 8:
            raise self._damaged(f"{size} bytes, shorter than a header")
        n = int.from_bytes(head, "little")
        if n > min(MAX_HEADER, size - 8):
            raise self._damaged(f"a header of {n} bytes in a file of {size}")
        raw = os.pread(fd, n, 8)
        try:
            header = json.loads(raw.decode("utf-8"))
        except (ValueError, UnicodeDecodeError) as e:
            raise self._damaged(f"its header is not JSON: {e}") from None
        if not isinstance(header, dict):
            raise self._damaged("its header is not a JSON object")
        data_start, data_size = 8 + n, size - 8 - n
        entries = {}
        for name, info in header.items():
            if name == "__metadata__":
                continue
            try:
                dtype = DTYPES[info["dtype"]]
                shape = tuple(int(s) for s in info["shape"])
                begin, end = (int(x) for x in info["data_offsets"])
            except (KeyError, TypeError, ValueError):
                raise self._damaged(
                    f"{name!r} has no valid dtype, shape and data_offsets"
                ) from None
            numel = 1
            for s in shape:
                numel *= s
            nbytes = numel * torch.empty((), dtype=dtype).element_size()
            if min(shape, default=0) < 0 or not 0 <= begin <= end <= data_size:
                raise self._damaged(f"{name!r} lies outside the file's {data_size} data bytes")
            if end - begin != nbytes:
                raise self._damaged(f"{name!r} has {end - begin} bytes for shape {list(shape)}")
            entries[name] = (dtype, shape, begin, end)
        return entries, data_start

    def _check(self, fd: int) -> None:
        now = _identity(os.fstat(fd))
        if now != self._identity:
            what = "size" if now[2] != self._identity[2] else "modification time"
            raise ValueError(
                f"{self.path} changed on disk after it was opened (its {what} differs): the "
                "weights read from it would mix two versions of the checkpoint. Build the diff "
                "again once the file is complete; write a new checkpoint to a new folder, or "
                "rename it into place (an open diff keeps reading the file it opened)."
            )

    def read(self, name: str) -> Tensor:
        dtype, shape, begin, end = self.entries[name]
        fd = self._fd
        if fd is None:
            raise ValueError(f"{self.path} was closed.")
        self._check(fd)
        out = torch.empty(end - begin, dtype=torch.uint8)
        view = memoryview(out.numpy())  # type: ignore[arg-type]
        got, offset = 0, self._data_start + begin
        while got < len(view):
            n = _pread_into(fd, view[got:], offset + got)
            if n == 0:
                self._check(fd)  # truncated since the check above: say so
                raise self._damaged(f"{name!r} ends past the end of the file")
            got += n
        self._check(fd)  # not rewritten while it was read
        return out.view(dtype).reshape(shape)

    def close(self) -> None:
        self._fd = None
        self._closer()


class SafetensorsFiles:
    """The tensors of the weight files ``transformers`` would load from a checkpoint directory
    (``weight_files``), by name, one read at a time."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        refuse_special_files(self.path)
        paths, index = _chosen(self.path)
        for p in paths:
            _regular(p)
        self.files = [SafetensorsFile(p) for p in paths]
        self.where: dict[str, SafetensorsFile] = {}
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
        return self.where[name].read(name)

"""Writing files so that a reader never sees half of one, and never through a planted link.

- ``replacing(path)``: a temporary file beside ``path`` for a writer to fill, renamed over
  ``path`` in one step at the end. An overwritten file keeps its mode (a private 0600 diff stays
  private); a new one gets the umask's. Temporaries that killed saves left behind (hidden
  ``.{name}.*.tmp``, as large as the file) are removed by the next save of that name; one a
  live writer holds (it keeps an ``flock`` on it) is left alone.
- ``locked(folder)``: one writer at a time in a folder (``ComponentScores.save``, whose
  ``scores.json`` is the manifest naming its tensor file: switched last, in one step).

>>> import tempfile, pathlib
>>> p = write_text_atomic(pathlib.Path(tempfile.mkdtemp()) / "a.txt", "done")
>>> p.read_text()
'done'
"""

from __future__ import annotations

import contextlib
import glob
import os
import secrets
import stat
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from torch import Tensor

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows: no advisory locks; open files cannot be removed
    fcntl = None  # type: ignore[assignment]


def write_text_atomic(path: str | Path, text: str) -> Path:
    """Write ``text`` to ``path`` through a temporary file in the same folder, renamed over
    ``path`` at the end: an interrupted write leaves the old file (or none), and a symlink at
    ``path`` is replaced, never written through."""
    return write_bytes_atomic(path, text.encode("utf-8"))


def write_bytes_atomic(path: str | Path, data: bytes) -> Path:
    """``write_text_atomic`` for bytes."""
    with replacing(path) as tmp:
        with open(tmp, "wb") as f:
            f.write(data)
    return Path(path)


def save_safetensors(
    tensors: Mapping[str, Tensor], path: str | Path, metadata: Mapping[str, str] | None = None
) -> None:
    """Write ``tensors`` to ``path`` in the safetensors format, one tensor at a time: a mapping
    that forms each tensor when read (``LazyDeltas``, with a ``spec(name)`` giving its shape and
    dtype) is never held whole. Unlike ``safetensors.torch.save_file`` it writes ``path``
    itself, not a temporary of its own renamed over it: inside ``replacing`` the temporary stays
    the one ``replacing`` holds (locked, with the right mode), and a killed save leaves nothing
    else."""
    import json

    import torch

    from extractive_lens.backend.weight_files import DTYPES

    codes = {dt: code for code, dt in DTYPES.items()}
    names = sorted(tensors)
    header: dict[str, Any] = {}
    offset = 0
    for name in names:
        spec = getattr(tensors, "spec", None)
        if spec is not None:
            shape, dtype = spec(name)
        else:
            shape, dtype = tuple(tensors[name].shape), tensors[name].dtype
        n = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        header[name] = {"dtype": codes[dtype], "shape": list(shape),
                        "data_offsets": [offset, offset + n]}  # fmt: skip
        offset += n
    if metadata:
        header["__metadata__"] = dict(metadata)
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw)
        for name in names:
            flat = tensors[name].detach().cpu().contiguous().reshape(-1)
            want = header[name]
            if codes[flat.dtype] != want["dtype"] or flat.numel() * flat.element_size() != (
                want["data_offsets"][1] - want["data_offsets"][0]
            ):
                raise ValueError(f"{name}: its tensor does not match the shape and dtype given.")
            if flat.numel():
                f.write(memoryview(flat.view(torch.uint8).numpy()))  # type: ignore[arg-type]


def _lock(fd: int, block: bool) -> bool | None:
    """An exclusive ``flock`` on ``fd``: ``True`` once held, ``False`` if another process holds
    one (``block`` false), ``None`` where locks are unsupported (no fcntl, some network file
    systems)."""
    if fcntl is None:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | (0 if block else fcntl.LOCK_NB))
    except BlockingIOError:
        return False
    except OSError:
        return None
    return True


def remove_if_unheld(path: Path) -> bool:
    """Remove ``path`` (a regular file, not followed through a link) unless a live writer holds
    a lock on it; ``True`` if it was removed."""
    try:
        fd = os.open(
            path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
        )
    except OSError:
        return False  # gone, a link, or not ours to read
    try:
        held = _lock(fd, block=False)
        if not stat.S_ISREG(os.fstat(fd).st_mode) or held is False:
            return False
        if held is None and fcntl is not None:
            return False  # cannot tell a live writer's file from litter here: leave it
        path.unlink(missing_ok=True)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def temporaries(path: Path) -> list[Path]:
    """The hidden temporaries of saves of ``path`` (``.{name}.*.tmp``), this one's and killed
    ones'."""
    return [Path(p) for p in glob.glob(str(path.parent / f".{glob.escape(path.name)}.*.tmp"))]


def remove_stale(paths: Iterable[Path]) -> None:
    """Remove each of ``paths`` that no live writer holds (litter of killed saves)."""
    for p in paths:
        remove_if_unheld(p)


def _new_temporary(path: Path) -> tuple[Path, int]:
    """A new, locked, empty temporary beside ``path``, created with mode 0666 less the umask."""
    while True:
        tmp = path.parent / f".{path.name}.{secrets.token_hex(4)}.tmp"
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
        fd = os.open(tmp, flags, 0o666)
        _lock(fd, block=True)
        try:  # a cleaner may have removed it between creation and lock: then make another
            if os.path.samestat(os.fstat(fd), os.stat(tmp, follow_symlinks=False)):
                return tmp, fd
        except FileNotFoundError:
            pass
        os.close(fd)


def _fsync_folder(folder: Path) -> None:
    """Make a rename in ``folder`` durable (where folders can be opened: not on Windows)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def replacing(path: str | Path, *, mode_of: str | Path | None = None) -> Iterator[Path]:
    """A temporary path beside ``path`` for a writer to fill (``save_file(..., tmp)``); on a clean
    exit it is flushed to disk and renamed over ``path`` in one step, on any exception (an
    interrupt included) it is removed and ``path`` is left as it was.

    The new file keeps the mode of the file it replaces (of ``mode_of`` if given: the file a new
    name supersedes), else gets the umask's; a symlink at ``path`` is replaced, never followed.
    Temporaries of earlier, killed saves of ``path`` are removed first."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale(temporaries(path))
    mode = _mode(Path(mode_of) if mode_of is not None else path)
    tmp, fd = _new_temporary(path)
    if mode is None:
        mode = stat.S_IMODE(os.fstat(fd).st_mode)  # 0666 less the umask: what open() gives
    try:
        yield tmp
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
            if stat.S_IMODE(os.fstat(f.fileno()).st_mode) != mode:  # a writer may have put
                os.chmod(tmp, mode)  # a file of its own there (safetensors' save_file does)
        os.replace(tmp, path)
        _fsync_folder(path.parent)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    finally:
        os.close(fd)  # releases the lock


def _mode(path: Path) -> int | None:
    """The permission bits of the regular file at ``path`` (not through a link), or ``None``."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return stat.S_IMODE(st.st_mode) if stat.S_ISREG(st.st_mode) else None


@contextlib.contextmanager
def locked(folder: str | Path) -> Iterator[None]:
    """Hold an exclusive lock on ``folder`` (an ``flock`` on the folder itself, released when the
    block ends or the process dies): saves into one folder take turns."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:  # folders cannot be opened here (Windows): no lock
        yield
        return
    try:
        _lock(fd, block=True)
        yield
    finally:
        os.close(fd)

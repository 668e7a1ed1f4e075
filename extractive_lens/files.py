"""The file layer: every file extractive_lens reads or writes goes through this module.

Reading (checkpoints, GGUF files, adapters, saved diffs, saved results, data files):

- ``opened(path, fix=...)``: a regular file, opened once. A FIFO, socket, device, folder or a
  link loop is refused in one sentence before anything blocks on it; ``fix`` is the sentence
  saying what to do, appended to every refusal about the file.
- ``read_bytes``, ``read_text``, ``read_json``: a small file whole, its identity (device, inode,
  size, modification time) the same before and after the read.
- ``SafetensorsFile(path, fix=...)``: a safetensors file's header parsed and checked against
  the file's size; ``read(name)`` copies one tensor out with ``os.pread`` (never a view of a
  memory map: a map of a file truncated later kills the process with SIGBUS, and one
  rewritten in place by ``cp`` changes values already loaded), checking the file's identity
  before and after, so a file rewritten while it is read is refused by name. Copying costs one
  tensor's bytes at a time: peak memory is what the caller keeps, never the whole file twice.
- ``RegularFile(path, fix=...).private_copy()``: the whole file copied into anonymous memory,
  for a library that memory-maps a file by its name (the ``gguf`` package): it maps the copy,
  which no other process can truncate under the map (SIGBUS) or rewrite; the file's identity
  is checked around the copy and again after the library's read.
- ``refuse_special_files(folder)``: a folder a loader lists holds regular files (or links to
  them) and folders, nothing a read could block on.

Writing, so that a reader never sees half of a file, and never through a planted link:

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
from typing import TYPE_CHECKING, Any, TypeVar

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

    codes = {dt: code for code, dt in safetensors_dtypes().items()}
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


# ------------------------------------------------------------------ reading (module docstring)

CHANGED = (
    "read it again once it is complete; write a new file under a new name, or rename it into "
    "place (a reader keeps reading the file it opened)"
)


def _kind(mode: int) -> str:
    for test, what in ((stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISDIR, "a directory")):  # fmt: skip
        if test(mode):
            return what
    return "not a regular file"


def not_regular(path: Path, mode: int, fix: str | None = None) -> ValueError:
    """The refusal of ``path``, which is a FIFO, socket, device or folder, not a regular file."""
    if stat.S_ISDIR(mode):
        return ValueError(f"{path} is a directory, not a file: " + (fix or "pass the file."))
    return ValueError(
        f"{path} is {_kind(mode)}, not a regular file, and reading it could block forever: "
        + (fix or "replace it with the file itself (or remove it).")
    )


def _unreadable(path: Path, e: OSError, fix: str) -> OSError | ValueError:
    import errno

    if e.errno == errno.ENOENT:
        return FileNotFoundError(f"{path} does not exist: {fix}")
    if e.errno == errno.ELOOP:
        return ValueError(
            f"{path} is a loop of symbolic links (or a chain too long to follow), not a file: "
            f"replace the link with the file itself; {fix}"
        )
    if e.errno in (errno.EACCES, errno.EPERM):
        return PermissionError(f"{path} cannot be read (permission denied): {fix}")
    return OSError(f"{path} cannot be read ({e.strerror}): {fix}")


def opened(path: str | Path, *, fix: str) -> int:
    """A read-only descriptor of the regular file at ``path`` (links followed): anything else
    (FIFO, socket, device, folder, a link loop, a missing file) is refused in one sentence
    ending with ``fix``, before anything could block on it. The caller closes it."""
    path = Path(path)
    try:
        mode = os.stat(path).st_mode
        if not stat.S_ISREG(mode):
            raise not_regular(path, mode, fix)
        # non-blocking: a FIFO swapped in since the stat is refused below, not waited on
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise _unreadable(path, e, fix) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise not_regular(path, st.st_mode, fix)
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def identity(st: os.stat_result) -> tuple[int, ...]:
    """What says a file is unchanged: device, inode, size, modification time (not ctime: a
    rename over the name changes that, and the open file still holds the bytes it had)."""
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


_File = TypeVar("_File", bound="RegularFile")


class RegularFile:
    """A regular file opened once (``opened``), its identity recorded: every read checks it
    before and after, so a file truncated or rewritten in place (``cp``, ``dd``,
    ``rsync --inplace``) is refused by name instead of giving a mix of two versions. A file
    replaced by renaming a new one over its name is still read as it was when opened.

    ``fix``: what to do about a damaged file, the end of every refusal (``damaged``)."""

    def __init__(self, path: str | Path, *, fix: str, changed: str = CHANGED) -> None:
        import weakref

        self.path, self.fix, self._changed = Path(path), fix, changed
        fd = opened(self.path, fix=fix)
        st = os.fstat(fd)
        self._identity, self.size = identity(st), st.st_size
        self._fd: int | None = fd
        self._closer = weakref.finalize(self, os.close, fd)  # also at exit, os still there

    def damaged(self, why: str) -> ValueError:
        """The refusal of a file whose content is not what it should be: ``why``, then ``fix``."""
        return ValueError(f"{self.path} is damaged ({why}): {self.fix}")

    def check(self) -> None:
        """Refuse the file if it changed on disk since it was opened."""
        if self._fd is None:
            raise ValueError(f"{self.path} was closed.")
        now = identity(os.fstat(self._fd))
        if now != self._identity:
            what = "size" if now[2] != self._identity[2] else "modification time"
            raise ValueError(
                f"{self.path} changed on disk after it was opened (its {what} differs), so what "
                f"was read from it would mix two versions: {self._changed}."
            )

    def read_into(self, view: memoryview, offset: int) -> None:
        """Fill ``view`` with the bytes at ``offset`` (``os.pread``: no shared file position,
        threads may read at once), the file unchanged before and after."""
        self.check()
        assert self._fd is not None
        got = 0
        while got < len(view):
            if hasattr(os, "preadv"):
                n = os.preadv(self._fd, [view[got:]], offset + got)
            else:  # pragma: no cover - no preadv (macOS before 11, Windows)
                chunk = os.pread(self._fd, len(view) - got, offset + got)
                view[got : got + len(chunk)] = chunk
                n = len(chunk)
            if n == 0:
                self.check()  # truncated since the check above: say so
                raise self.damaged(f"it ends at byte {offset + got}, inside what it holds")
            got += n
        self.check()  # not rewritten while it was read

    def read(self, n: int, offset: int = 0) -> bytes:
        """``n`` bytes at ``offset`` (``read_into``)."""
        out = bytearray(n)
        self.read_into(memoryview(out), offset)
        return bytes(out)

    def private_copy(self) -> PrivateCopy:
        """The whole file copied into anonymous memory (``PrivateCopy``), read by ``read_into``
        (its identity checked before and after; a file cut short meanwhile is refused by
        name, never a SIGBUS)."""
        return PrivateCopy(self)

    def close(self) -> None:
        self._fd = None
        self._closer()

    def __enter__(self: _File) -> _File:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class PrivateCopy:
    """A regular file's bytes in anonymous memory of this process (a ``memfd`` on Linux, else
    an unlinked temporary file), reachable by ``path`` for a library that memory-maps a file
    by its name (the ``gguf`` package, and ``transformers`` through it): a map of the user's
    file dies with SIGBUS when another process truncates the file while it is read; a map of
    this copy cannot, as no other process holds it. Costs the file's size in memory (or
    temporary disk) until ``close``.

    >>> import tempfile, pathlib
    >>> p = pathlib.Path(tempfile.mkdtemp()) / "w.bin"
    >>> _ = p.write_bytes(b"weights")
    >>> with RegularFile(p, fix="write it again") as f, f.private_copy() as copy:
    ...     copy.path.read_bytes()
    b'weights'
    """

    def __init__(self, source: RegularFile) -> None:
        import mmap
        import weakref

        if hasattr(os, "memfd_create"):
            fd = os.memfd_create(source.path.name[:200], getattr(os, "MFD_CLOEXEC", 0))
        else:  # pragma: no cover - macOS, Windows: a temporary file no other name reaches
            import tempfile

            fd = os.dup(tempfile.TemporaryFile().fileno())
        self._closer = weakref.finalize(self, os.close, fd)
        try:
            os.ftruncate(fd, source.size)
            if source.size:
                with mmap.mmap(fd, source.size) as m, memoryview(m) as view:
                    source.read_into(view, 0)
        except BaseException:
            self._closer()
            raise
        self.fd = fd
        proc = Path(f"/proc/self/fd/{fd}")
        self.path = proc if proc.exists() else Path(f"/dev/fd/{fd}")

    def close(self) -> None:
        self._closer()

    def __enter__(self) -> PrivateCopy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_bytes(path: str | Path, *, fix: str, limit: int = 2**30) -> bytes:
    """The whole regular file at ``path`` (``RegularFile``), at most ``limit`` bytes."""
    with RegularFile(path, fix=fix) as f:
        if f.size > limit:
            raise f.damaged(f"{f.size} bytes, more than the {limit} such a file can hold")
        return f.read(f.size)


def read_text(path: str | Path, *, fix: str) -> str:
    """``read_bytes`` as UTF-8 text; other bytes refused by name."""
    try:
        return read_bytes(path, fix=fix).decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(
            f"{path} is not UTF-8 text ({e.reason} at byte {e.start}): {fix}"
        ) from None


def read_json(path: str | Path, *, fix: str) -> Any:
    """``read_text`` parsed as JSON; invalid JSON refused by name with its line."""
    import json

    try:
        return json.loads(read_text(path, fix=fix))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON ({e.msg} at line {e.lineno}): {fix}") from None


def refuse_special_files(folder: str | Path, fix: str | None = None) -> None:
    """Refuse a folder holding a FIFO, socket, device or link loop (links followed), which a
    library listing the folder could block on forever or fail on; subfolders are left alone,
    and so are dangling links (the loader names what is missing)."""
    import errno

    folder = Path(folder)
    if not folder.is_dir():
        return  # the loaders say what they expected
    for entry in sorted(folder.iterdir()):
        try:
            mode = os.stat(entry).st_mode
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise _unreadable(entry, e, fix or "or remove it.") from None
            continue
        if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
            raise not_regular(entry, mode, fix)


def safetensors_dtypes() -> dict[str, Any]:
    """safetensors' dtype codes -> torch dtypes (those this torch has)."""
    import torch

    return {
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


MAX_HEADER = 100 * 2**20  # safetensors' own limit on the JSON header


class SafetensorsFile(RegularFile):
    """One safetensors file (``RegularFile``), its header parsed and checked against the file's
    size; ``read(name)`` copies one tensor out (module docstring), ``metadata`` is the header's
    ``__metadata__``. Never executes anything, never maps the file."""

    def __init__(self, path: str | Path, *, fix: str, changed: str = CHANGED) -> None:
        super().__init__(path, fix=fix, changed=changed)
        try:
            self.entries, self.metadata, self._data_start = self._header()
        except BaseException:
            self.close()
            raise

    def damaged(self, why: str) -> ValueError:
        return ValueError(f"{self.path} is not a valid safetensors file ({why}): {self.fix}")

    def _header(self) -> tuple[dict[str, tuple[Any, tuple[int, ...], int, int]], dict[str, str], int]:  # fmt: skip
        import json

        import torch

        size = self.size
        if size < 8:
            raise self.damaged(f"{size} bytes, shorter than a header")
        n = int.from_bytes(self.read(8), "little")
        if n > min(MAX_HEADER, size - 8):
            raise self.damaged(f"a header of {n} bytes in a file of {size}")
        try:
            header = json.loads(self.read(n, 8).decode("utf-8"))
        except (ValueError, UnicodeDecodeError) as e:
            raise self.damaged(f"its header is not JSON: {e}") from None
        if not isinstance(header, dict):
            raise self.damaged("its header is not a JSON object")
        metadata = header.pop("__metadata__", None) or {}
        if not isinstance(metadata, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
        ):
            raise self.damaged("its __metadata__ is not a map of strings to strings")
        dtypes = safetensors_dtypes()
        data_start, data_size = 8 + n, size - 8 - n
        entries = {}
        for name, info in header.items():
            try:
                dtype = dtypes[info["dtype"]]
                shape = tuple(int(s) for s in info["shape"])
                begin, end = (int(x) for x in info["data_offsets"])
            except (KeyError, TypeError, ValueError):
                raise self.damaged(f"{name!r} has no valid dtype, shape and data_offsets") from None
            numel = 1
            for s in shape:
                numel *= s
            nbytes = numel * torch.empty((), dtype=dtype).element_size()
            if min(shape, default=0) < 0 or not 0 <= begin <= end <= data_size:
                raise self.damaged(f"{name!r} lies outside the file's {data_size} data bytes")
            if end - begin != nbytes:
                raise self.damaged(f"{name!r} has {end - begin} bytes for shape {list(shape)}")
            entries[name] = (dtype, shape, begin, end)
        spans = sorted((b, e, k) for k, (_, _, b, e) in entries.items() if e > b)
        for (_, e0, k0), (b1, _, k1) in zip(spans, spans[1:]):
            if b1 < e0:
                raise self.damaged(f"{k0!r} and {k1!r} share bytes")
        return entries, metadata, data_start

    def read_tensor(self, name: str) -> Tensor:
        """The tensor ``name``, copied out of the file (a tensor of its own, not a view)."""
        import torch

        dtype, shape, begin, end = self.entries[name]
        out = torch.empty(end - begin, dtype=torch.uint8)
        if end > begin:
            self.read_into(memoryview(out.numpy()), self._data_start + begin)  # type: ignore[arg-type]
        else:
            self.check()
        return out.view(dtype).reshape(shape)

    def tensors(self) -> dict[str, Tensor]:
        """Every tensor, each copied out as it is read (``read_tensor``)."""
        return {name: self.read_tensor(name) for name in self.entries}

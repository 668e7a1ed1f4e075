"""Writing files so that a reader never sees half of one, and never through a planted link.

>>> import tempfile, pathlib
>>> p = write_text_atomic(pathlib.Path(tempfile.mkdtemp()) / "a.txt", "done")
>>> p.read_text()
'done'
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path


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


@contextlib.contextmanager
def replacing(path: str | Path) -> Iterator[Path]:
    """A temporary path beside ``path`` for a writer to fill (``save_file(..., tmp)``); on a clean
    exit it is flushed to disk and renamed over ``path`` in one step, on any exception (an
    interrupt included) it is removed and ``path`` is left as it was."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise

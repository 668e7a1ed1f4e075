"""Round 3 of the reliability campaign (#42), saves: a save killed (SIGKILL) at any file-system
call leaves the old result or the new one, always loadable; what killed saves leave behind is
removed by the next save; an overwritten file keeps its mode and a new one follows the umask."""

from __future__ import annotations

import json
import os
import signal
import stat
import time

import pytest
from _pytest.monkeypatch import MonkeyPatch

from extractive_lens.files import write_text_atomic
from tests.test_reliability import SAVES, _fs_calls, _same, litter


def _target(tmp_path, kind: str, name: str):
    return tmp_path / name / ("scores" if kind == "ComponentScores" else "d.st")


def _files(path):
    """The files of a saved result: a diff's one file, or a scores directory's two."""
    if not path.is_dir():
        return [path]
    return [path / "scores.json", path / json.loads((path / "scores.json").read_text())["tensors"]]


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def _killed_save(save, obj, path, when: str, k: int) -> int:
    """Fork; the child saves ``obj`` over ``path`` and SIGKILLs itself before or after the k-th
    file-system call of the save. Returns the child's wait status."""
    pid = os.fork()
    if pid == 0:  # the child: never returns to pytest
        try:
            with MonkeyPatch.context() as m:
                _fs_calls(m, when, k, fire=lambda name: os.kill(os.getpid(), signal.SIGKILL))
                save(obj, path)
        finally:
            os._exit(3)  # reached only when the save had fewer than k calls
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return status
        time.sleep(0.01)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    pytest.fail("the forked save hung")


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
@pytest.mark.parametrize("kind", list(SAVES))
def test_sigkill_at_any_file_system_call_leaves_old_or_new(kind, tmp_path):
    """A real SIGKILL before or after each file-system call of a save over an earlier result:
    the path loads as the old result or the new one, every time (a ComponentScores directory
    is switched by replacing its scores.json last); the next save leaves no litter."""
    make, save, load = SAVES[kind]
    old, new = make(1), make(2)
    count = _target(tmp_path, kind, "count")
    save(old, count)
    with MonkeyPatch.context() as m:
        seen = _fs_calls(m, "never", 0)
        save(new, count)
        n = len(seen)
    outcomes = []
    for when in ("before", "after"):
        for k in range(1, n + 1):
            path = _target(tmp_path, kind, f"{when}{k}")
            save(old, path)
            status = _killed_save(save, new, path, when, k)
            assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, status
            got = load(path)  # never refused
            assert _same(got, old) or _same(got, new), (when, k, seen[k - 1])
            outcomes.append("old" if _same(got, old) else "new")
            save(old, path)
            assert litter(path) == [], (when, k, litter(path))
    assert "old" in outcomes and "new" in outcomes


@pytest.mark.parametrize("kind", list(SAVES))
def test_temporaries_of_killed_saves_are_removed_by_the_next_save(kind, tmp_path):
    """Hidden temporaries (a killed WeightDiff.save leaves one as large as the diff) and tensor
    files no scores.json names are removed by the next save; a temporary a live writer holds
    (an flock on it) is left alone."""
    fcntl = pytest.importorskip("fcntl")
    make, save, load = SAVES[kind]
    path = _target(tmp_path, kind, "r")
    save(make(1), path)
    folder = path if kind == "ComponentScores" else path.parent
    stale = [folder / f".{path.name}.deadbeef.tmp", folder / f".{path.name}.0badf00d.tmp"]
    if kind == "ComponentScores":
        stale = [path / ".scores.json.deadbeef.tmp", path / ".scores.0123.safetensors.ab.tmp",
                 path / "scores.0123456789abcdef.safetensors", path / "scores.safetensors"]  # fmt: skip
    for f in stale:
        f.write_bytes(b"\0" * 2**16)
    live = folder / f".{'scores.json' if kind == 'ComponentScores' else path.name}.live0001.tmp"
    live.write_bytes(b"being written")
    with open(live, "rb") as held:
        fcntl.flock(held.fileno(), fcntl.LOCK_EX)
        save(make(2), path)
    assert [f.name for f in stale if f.exists()] == []
    assert live.exists()  # another process's save in progress
    assert _same(load(path), make(2))


@pytest.mark.parametrize("kind", list(SAVES))
@pytest.mark.parametrize("mode", [0o600, 0o640])
def test_an_overwritten_result_keeps_its_mode(kind, mode, tmp_path):
    """Re-saving over a private diff must not make it world-readable."""
    make, save, _ = SAVES[kind]
    path = _target(tmp_path, kind, "m")
    save(make(1), path)
    for f in _files(path):
        os.chmod(f, mode)
    save(make(2), path)
    assert {f.name: oct(_mode(f)) for f in _files(path)} == {
        f.name: oct(mode) for f in _files(path)
    }


@pytest.mark.parametrize("kind", list(SAVES))
@pytest.mark.parametrize("umask", [0o077, 0o002])
def test_new_files_follow_the_umask(kind, umask, tmp_path):
    make, save, _ = SAVES[kind]
    path = _target(tmp_path, kind, "u")
    old = os.umask(umask)
    try:
        save(make(1), path)
        page = write_text_atomic(tmp_path / "report.html", "<p>")
    finally:
        os.umask(old)
    for f in [*_files(path), page]:
        assert _mode(f) == 0o666 & ~umask, (f.name, oct(_mode(f)))


def test_a_symlink_is_replaced_with_the_umask_mode_not_its_targets(tmp_path):
    """A link planted at the output path is replaced (never written through), and the new file
    does not take the mode of whatever the link pointed to."""
    target = tmp_path / "elsewhere.txt"
    target.write_text("keep")
    os.chmod(target, 0o777)
    (tmp_path / "out.txt").symlink_to(target)
    old = os.umask(0o022)
    try:
        write_text_atomic(tmp_path / "out.txt", "new")
    finally:
        os.umask(old)
    assert target.read_text() == "keep" and not (tmp_path / "out.txt").is_symlink()
    assert _mode(tmp_path / "out.txt") == 0o644


def test_save_safetensors_is_read_back_by_safetensors(tmp_path):
    """Our streaming writer (no temporary of its own) against safetensors' reader: every dtype
    a diff or a result holds, a scalar, an empty tensor, a non-contiguous view."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import load_file

    from extractive_lens.files import save_safetensors

    g = torch.Generator().manual_seed(0)
    tensors = {
        "f64": torch.randn(3, 4, generator=g, dtype=torch.float64),
        "f32": torch.randn(5, generator=g),
        "bf16": torch.randn(2, 3, generator=g).bfloat16(),
        "f16": torch.randn(7, generator=g).half(),
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 3),
        "view": torch.randn(4, 6, generator=g).t(),
        "i64": torch.arange(5),
        "bool": torch.tensor([True, False, True]),
    }
    save_safetensors(tensors, tmp_path / "t.safetensors", metadata={"k": "v"})
    back = load_file(str(tmp_path / "t.safetensors"))
    assert back.keys() == tensors.keys()
    for name, t in tensors.items():
        assert back[name].dtype == t.dtype and torch.equal(back[name], t), name
    with safe_open(str(tmp_path / "t.safetensors"), "pt") as f:
        assert f.metadata() == {"k": "v"}

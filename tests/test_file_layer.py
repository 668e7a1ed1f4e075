"""The file layer (``extractive_lens.files``): every public reader, attacked the same way.

Each reader of ``tests/file_readers.READERS`` gets every attack on every file it reads: the
file truncated, rewritten in place after loading, replaced by a FIFO or by a symlink loop, its
header damaged. A refusal is one sentence of the package's own (``ValueError`` / ``OSError``,
never a library's raw error) naming the file; nothing blocks; nothing loaded changes when the
file changes afterwards (it was copied out, not mapped)."""

from __future__ import annotations

import importlib
import inspect
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

import extractive_lens as el
from tests.file_readers import READERS, WRITERS, Reader

pytest.importorskip("transformers")
pytest.importorskip("peft")
pytest.importorskip("gguf")

ROOT = str(Path(__file__).resolve().parents[1])
OWN = (ValueError, OSError, FileNotFoundError, PermissionError, NotImplementedError)


def _id(reader: Reader) -> str:
    return f"{reader.name}[{reader.make.__name__.removeprefix('make_')}]"


@pytest.fixture(scope="session")
def shared(tmp_path_factory):
    return tmp_path_factory.mktemp("file_readers_shared")


def _refusal(reader: Reader, arg: Path, shared: Path, file: Path, wait: float = 30) -> str:
    """Call the reader expecting a refusal of the package's own that names ``file``. Where
    ``file`` is a FIFO, a shell opens it for writing after ``wait`` s (and so ends a read that
    blocked on it, even one holding the interpreter's lock): a call that took that long
    blocked."""
    unblock = None
    if file.is_fifo():
        unblock = subprocess.Popen(["sh", "-c", f"sleep {wait}; : > '{file}'"])
    start = time.monotonic()
    try:
        reader.read(arg, shared)
    except BaseException as e:  # noqa: BLE001 - judged below
        error: BaseException | None = e
    else:
        error = None
    finally:
        if unblock is not None:
            unblock.kill()
            unblock.wait()
    if unblock is not None and time.monotonic() - start >= wait:
        pytest.fail(f"{_id(reader)} blocked on the FIFO {file.name}")
    if error is None:
        pytest.fail(f"{_id(reader)} loaded a damaged {file.name} without a word")
    assert type(error) in OWN, (
        f"{_id(reader)}: {type(error).__module__}.{type(error).__name__}: {error}"
    )
    said = str(error)
    assert file.name in said, f"{_id(reader)} does not name {file.name}: {said}"
    assert "\n" not in said.strip(), said
    return said


def _cases():
    return [pytest.param(r, id=_id(r)) for r in READERS]


def _files(reader: Reader, tmp_path: Path, shared: Path):
    arg, files = reader.make(tmp_path, shared)
    return arg, files


ATTACKS = ["truncated", "damaged header", "fifo", "symlink loop", "emptied"]


@pytest.mark.parametrize("attack", ATTACKS)
@pytest.mark.parametrize("reader", _cases())
def test_every_reader_refuses_a_broken_file_by_name(reader, attack, tmp_path, shared):
    arg, files = reader.make(tmp_path, shared)
    for i, file in enumerate(files):
        if i:  # a fresh copy of the input for each file attacked
            arg, files = reader.make(tmp_path / f"again{i}", shared)
            file = files[i]
        data = file.read_bytes()
        if attack == "truncated":
            file.write_bytes(data[: len(data) // 2])
        elif attack == "emptied":
            file.write_bytes(b"")
        elif attack == "damaged header":
            file.write_bytes(b"\xff" * 16 + data[16:])
        elif attack == "fifo":
            file.unlink()
            os.mkfifo(file)
        elif attack == "symlink loop":
            file.unlink()
            file.symlink_to(file.name)
        said = _refusal(reader, arg, shared, file)
        if attack == "fifo":
            assert "FIFO" in said, said
        if attack == "symlink loop":
            assert "loop" in said, said


@pytest.mark.parametrize("reader", _cases())
def test_what_a_reader_loaded_does_not_change_with_its_file(reader, tmp_path, shared):
    """``cp`` of other bytes over the file after loading (in place, same size): what was
    loaded is a copy, not a view of the file's memory map."""
    arg, files = reader.make(tmp_path, shared)
    loaded = reader.read(arg, shared)
    values = reader.values(loaded)
    before = [v.clone() if isinstance(v, torch.Tensor) else v for v in values]
    for file in files:
        data = file.read_bytes()
        with open(file, "r+b") as f:  # in place, as cp, dd and rsync --inplace write
            f.write(data[: len(data) // 2] + bytes(255 - b for b in data[len(data) // 2 :]))
    for i, (v, b) in enumerate(zip(values, before)):
        same = torch.equal(v, b) if isinstance(v, torch.Tensor) else v == b
        assert same, f"{_id(reader)}: loaded value {i} changed with the file"


def _public_path_functions() -> set[str]:
    """Public functions and methods (``el``, its submodules) with a parameter typed as a path."""
    found = set()
    modules = [el] + [importlib.import_module(f"extractive_lens.{m}") for m in el._SUBMODULES]
    for m in modules:
        for name in getattr(m, "__all__", None) or [n for n in dir(m) if not n.startswith("_")]:
            obj = getattr(m, name, None)
            if not str(getattr(obj, "__module__", "")).startswith("extractive_lens"):
                continue
            members = (
                [(f"{name}.{a}", getattr(obj, a)) for a in vars(obj) if not a.startswith("_")]
                if inspect.isclass(obj)
                else [(name, obj)]
            )
            for label, f in members:
                try:
                    params = inspect.signature(f).parameters.values()
                except (TypeError, ValueError):
                    continue
                if any("Path" in str(p.annotation) for p in params):
                    found.add(label)
    return found


def test_every_public_loading_function_is_in_the_table():
    found = _public_path_functions() - {"integrated_scores"}  # its ``path`` is an integration path
    assert {r.name for r in READERS} | WRITERS == found


def test_a_loaded_diff_survives_its_file_being_truncated(tmp_path):
    """In a child process (a SIGBUS would kill it): after ``WeightDiff.load`` and
    ``ComponentScores.load`` the files are truncated to nothing, and what was loaded is read."""
    from tests.file_readers import make_diff, make_scores

    diff, _ = make_diff(tmp_path, tmp_path)
    scores, files = make_scores(tmp_path, tmp_path)
    code = f"""
import os, extractive_lens as el
d = el.WeightDiff.load({str(diff)!r}); s = el.ComponentScores.load({str(scores)!r})
for f in [{str(diff)!r}] + {[str(f) for f in files]!r}:
    os.truncate(f, 0)
print(sum(float(t.sum()) for t in d.deltas.values()) + float(s.values.nansum()))
"""
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT})  # fmt: skip
    assert run.returncode == 0, f"exit {run.returncode}: {run.stderr[-500:]}"


def test_loads_racing_saves_return_one_save_or_the_other(tmp_path):
    """Two diffs saved over one name again and again while it is loaded: each load is one of
    them, whole (a save renames a complete file over the name; a load reads the file it
    opened)."""
    from tests.file_readers import _pair

    base, ft = _pair()
    a = el.WeightDiff.from_models(base, ft)
    b = a * 2.0
    path = tmp_path / "d.safetensors"
    a.save(path)
    stop = threading.Event()

    def saver() -> None:
        while not stop.is_set():
            for d in (a, b):
                d.save(path)

    worker = threading.Thread(target=saver, daemon=True)
    worker.start()
    try:
        for _ in range(40):
            got = el.WeightDiff.load(path)
            same_a = all(torch.equal(got.deltas[n], a.deltas[n]) for n in a.deltas)
            same_b = all(torch.equal(got.deltas[n], b.deltas[n]) for n in b.deltas)
            assert same_a or same_b, "a load mixed two saves"
    finally:
        stop.set()
        worker.join(10)


# ------------------------------------------------------------------ the command line's paths


def _cli(argv, capsys) -> tuple[int, str]:
    from extractive_lens.cli import main

    with pytest.raises(SystemExit) as done:
        main([str(a) for a in argv])
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err, err
    return done.value.code, err


@pytest.mark.parametrize(
    "argv",
    [
        ["score", "--base", "world", "--diff", "d.safetensors", "--data", "p.json", "--out", ""],
        ["finetune", "--model", "world", "--data", "p.json", "--out", ""],
        ["report", "scores", "--out", ""],
        ["data", "first-hop", "--out", ""],
        ["experiment", "graft", "--out", ""],
        ["demo", "--out", ""],
    ],
    ids=lambda a: a[0] if a[0] != "data" else "data",
)
def test_an_empty_out_is_refused_not_read_as_the_current_directory(argv, tmp_path, capsys,
                                                                   monkeypatch):  # fmt: skip
    """``Path("")`` is ``.``: ``--out ''`` wrote a run's files into the current directory."""
    monkeypatch.chdir(tmp_path)
    code, err = _cli(argv, capsys)
    assert code == 2 and "--out is empty" in err, err
    assert list(tmp_path.iterdir()) == []


def test_the_cli_loads_a_gguf_file_it_is_given(tmp_path, capsys, shared):
    """``--base x.gguf``: the API takes the file; the command line called it "no such
    checkpoint directory"."""
    from tests.file_readers import make_gguf

    gguf, _ = make_gguf(tmp_path, shared)
    data = tmp_path / "pairs.json"
    data.write_text('[{"prompt": "the capital is", "answer": " the"}, '
                    '{"prompt": "this is", "answer": " the"}]')  # fmt: skip
    code, err = _cli(
        ["score", "--base", gguf, "--finetuned", gguf, "--data", data, "--out", tmp_path / "s",
         "--method", "linear"],
        capsys,
    )  # fmt: skip
    assert code == 0, err
    assert any((tmp_path / "s").rglob("scores.json"))


@pytest.mark.parametrize(
    "damage, match",
    [
        (lambda t: {k: (v[:, :1] if k.endswith("lora_B.weight") else v) for k, v in t.items()},
         "do not multiply"),
        (lambda t: {k: (v[0] if k.endswith("lora_B.weight") else v) for k, v in t.items()},
         "not a floating-point matrix"),
        (lambda t: {k: (v[:0] if k.endswith("lora_A.weight") else v) for k, v in t.items()},
         "not a floating-point matrix"),
    ],
    ids=["factors that do not multiply", "a factor of one axis", "rank 0"],
)  # fmt: skip
def test_an_adapter_whose_factors_are_damaged_is_refused_by_name(damage, match, tmp_path, shared):
    """A raw shape error, ``IndexError`` or ``ZeroDivisionError`` before: one sentence now."""
    from extractive_lens.files import SafetensorsFile, save_safetensors
    from tests.file_readers import make_adapter, read_adapter

    path, files = make_adapter(tmp_path, shared)
    with SafetensorsFile(files[0], fix="") as f:
        tensors = damage(f.tensors())
    save_safetensors(tensors, files[0])
    with pytest.raises(ValueError, match=match) as e:
        read_adapter(path, shared)
    assert "adapter" in str(e.value) and "\n" not in str(e.value)

"""GGUF files whose metadata and tensors disagree, or that are damaged, are refused in one
sentence naming the file (``backend/gguf.py``: ``checked`` before the load, every weight from
the file and every tensor read after it); the file's own tokenizer is used, whatever lies beside
it; a load leaves no temporary folder behind."""

from __future__ import annotations

import gc
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

from extractive_lens import load_checkpoint  # noqa: E402
from tests.test_gguf import _tokens, write_tiny_gguf  # noqa: E402


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("gguf_good") / "tiny.gguf"
    write_tiny_gguf(path)
    return path


def _refused(path: Path, *, match: str = "") -> str:
    with pytest.raises(ValueError) as e:
        load_checkpoint(path)
    said = str(e.value)
    assert type(e.value) is ValueError, f"{type(e.value).__name__}: {said}"
    assert str(path) in said and "\n" not in said, said
    assert match in said, said
    return said


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(block_count=3), "block_count = 3"),
        (dict(block_count=1), "block_count = 1"),
        (dict(rename=("blk.1.attn_q.weight", "blk.1.attn_qq.weight")), "blk.1.attn_qq.weight"),
        (dict(arch="qwen2"), "weights not in the file"),
    ],
    ids=["more blocks than layers", "fewer blocks than layers", "renamed tensor", "other family"],
)
def test_metadata_that_disagrees_with_the_tensors_is_refused(kwargs, match, tmp_path):
    """transformers would fill a layer with random weights, drop one, drop a renamed tensor,
    or read a Llama's tensors as a Qwen2 with random query/key/value biases: all silently."""
    path = tmp_path / "bad.gguf"
    write_tiny_gguf(path, **kwargs)
    _refused(path, match=match)


def test_a_vocabulary_larger_than_the_embedding_is_refused(tmp_path):
    path = tmp_path / "vocab.gguf"
    write_tiny_gguf(path, extra_tokens=5)
    _refused(path, match="vocabulary of")


def _tensor_offset_positions(path: Path) -> list[tuple[int, int]]:
    """Where each tensor's data offset is stored in the file, and its value."""
    reader = gguf.GGUFReader(path)
    out = []
    for t in reader.tensors:
        parts = t.field.parts
        at = t.field.offset + sum(p.nbytes for p in parts[:-1])
        out.append((at, int(parts[-1][0])))
    return out


def test_tensors_sharing_bytes_are_refused(good, tmp_path):
    path = Path(shutil.copy(good, tmp_path / "overlap.gguf"))
    (at0, off0), (at1, _) = _tensor_offset_positions(path)[:2]
    with open(path, "r+b") as f:  # the second tensor's data where the first's is
        f.seek(at1)
        f.write(off0.to_bytes(8, "little"))
    _refused(path, match="share bytes")


DAMAGE = {
    **{f"truncated at {q}": q for q in (0.001, 0.01, 0.05, 0.2, 0.5, 0.9, 0.999)},
    "bad magic": b"GGUX",
    "version 99": (4, (99).to_bytes(4, "little")),
    "2^40 tensors": (8, (2**40).to_bytes(8, "little")),
    "2^40 metadata entries": (16, (2**40).to_bytes(8, "little")),
    "a key 2^40 bytes long": (24, (2**40).to_bytes(8, "little")),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_gguf_file_is_refused_in_one_sentence(damage, good, tmp_path):
    """Raw errors of numpy and the gguf package (``cannot reshape array of size 0``,
    IndexError, ...) are one refusal naming the file."""
    path = Path(shutil.copy(good, tmp_path / "damaged.gguf"))
    how = DAMAGE[damage]
    data = path.read_bytes()
    if isinstance(how, float):
        path.write_bytes(data[: max(1, int(len(data) * how))])
    elif isinstance(how, bytes):
        path.write_bytes(how + data[len(how) :])
    else:
        at, raw = how
        path.write_bytes(data[:at] + raw + data[at + len(raw) :])
    _refused(path)


def test_the_files_own_tokenizer_wins_over_a_tokenizer_beside_it(good, tmp_path):
    """``load_checkpoint("dir/x.gguf")`` with another model's tokenizer.json in ``dir``."""
    from tests.lora_models import save_tokenizer

    folder = tmp_path / "beside"
    folder.mkdir()
    path = Path(shutil.copy(good, folder / good.name))
    save_tokenizer(folder)  # a word-level tokenizer of 64 tokens
    tok = load_checkpoint(path).tokenizer
    vocab = _tokens()
    assert len(tok) == len(vocab)
    ids = tok(" the is", add_special_tokens=False)["input_ids"]
    assert [vocab[i] for i in ids] == ["Ġthe", "Ġ", "is"]


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
@pytest.mark.parametrize("name", ["tokenizer.json", "generation_config.json", "config.json"])
@pytest.mark.parametrize("by", ["file", "folder"])
def test_a_fifo_beside_a_gguf_file_is_never_read(by, name, good, tmp_path):
    """A FIFO named like a file of a checkpoint beside the GGUF file: loading the file never
    opens it, loading the folder refuses it (a shell opens it for writing after 20 s, which
    would end a read blocked on it)."""
    folder = tmp_path / "fifo"
    folder.mkdir()
    path = Path(shutil.copy(good, folder / good.name))
    fifo = folder / name
    os.mkfifo(fifo)
    unblock = subprocess.Popen(["sh", "-c", f"sleep 20; : > '{fifo}'"])
    start = time.monotonic()
    try:
        model = load_checkpoint(path if by == "file" else folder)
    except ValueError as e:
        assert time.monotonic() - start < 20, "the load blocked on the FIFO"
        assert by == "folder" and str(fifo) in str(e) and "FIFO" in str(e), str(e)
        return
    finally:
        unblock.kill()
        unblock.wait()
    assert time.monotonic() - start < 20, "the load blocked on the FIFO"
    assert len(model.tokenizer) == len(_tokens())


def test_a_load_leaves_no_temporary_folder_behind(good):
    """The tokenizer's temporary folder (which TransformerLens reloads the tokenizer from) lives
    while the model does, and goes with it."""
    model = load_checkpoint(good)
    folder = Path(model.tokenizer.name_or_path)
    assert folder.is_dir() and folder.name.startswith("el-gguf")
    assert Path(tempfile.gettempdir()) in folder.parents
    del model
    gc.collect()
    assert not folder.exists()


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
@pytest.mark.parametrize("by", ["file", "folder"])
def test_a_fifo_named_like_a_gguf_file_is_refused_not_waited_on(by, tmp_path):
    """``load_checkpoint(folder)`` of a folder whose one ``.gguf`` is a FIFO blocked forever
    (the gguf package maps the file); given as a file it was called missing."""
    fifo = tmp_path / "tiny.gguf"
    os.mkfifo(fifo)
    unblock = subprocess.Popen(["sh", "-c", f"sleep 20; : > '{fifo}'"])
    start = time.monotonic()
    try:
        said = _refused(fifo if by == "file" else tmp_path, match="FIFO")
    finally:
        unblock.kill()
        unblock.wait()
    assert time.monotonic() - start < 20, "the load blocked on the FIFO"
    assert str(fifo) in said


CUT_DURING_THE_LOAD = """
import subprocess, sys
import torch
torch.set_num_threads(1)
import gguf
from extractive_lens import load_checkpoint

path, real = sys.argv[1], gguf.dequantize

def cut_then_dequantize(data, qtype):  # transformers' first tensor: the file is mapped by now
    if not getattr(cut_then_dequantize, "done", False):
        cut_then_dequantize.done = True
        subprocess.run(["truncate", "-s", "64", path], check=True)  # another process cuts it
        print("CUT", flush=True)
    return real(data, qtype)

gguf.dequantize = cut_then_dequantize
try:
    load_checkpoint(path)
except ValueError as e:
    print("REFUSED", e, flush=True)
    sys.exit(3)
print("LOADED", flush=True)
"""


@pytest.mark.skipif(shutil.which("truncate") is None, reason="needs coreutils' truncate")
def test_a_gguf_file_cut_short_by_another_process_while_it_loads_is_refused(tmp_path):
    """The gguf package memory-maps the file it reads: a file another process truncated while
    transformers dequantized its tensors killed the loading process with SIGBUS. It reads a
    private copy in memory now, and the file's identity, checked after the load, refuses it
    by name."""
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path)
    assert path.stat().st_size > 4 * 4096  # tensors on pages past the one the cut keeps
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=str(root), OMP_NUM_THREADS="1")
    run = subprocess.run(
        [sys.executable, "-c", CUT_DURING_THE_LOAD, str(path)],
        capture_output=True, text=True, timeout=300, env=env, cwd=root,
    )  # fmt: skip
    said = run.stdout + run.stderr[-2000:]
    assert run.returncode != -signal.SIGBUS, "the load died with SIGBUS:\n" + said
    assert "CUT" in run.stdout, said  # the file was cut while it loaded
    assert run.returncode == 3 and f"REFUSED {path} changed on disk" in run.stdout, said

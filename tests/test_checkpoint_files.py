"""Round 3 of the reliability campaign (#42), the checkpoint files ``WeightDiff.from_checkpoints``
reads: exactly those ``transformers`` would load, regular files only, and never a file that
changed on disk after the diff opened it (refused by name; no SIGBUS, no second answer)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import extractive_lens as el
from extractive_lens.backend import weight_files
from extractive_lens.backend.loading import load_checkpoint

transformers = pytest.importorskip("transformers")
ROOT = str(Path(__file__).resolve().parents[1])


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A base and a finetuned tiny Llama checkpoint (grouped-query attention, rotary)."""
    from tests.test_backend_bridge import _hf_config, _save_tokenizer

    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(_hf_config("llama")).float().eval()
    paths = []
    for i in range(2):
        with torch.no_grad():
            for p in hf.parameters():
                p.add_(0.02 * torch.randn_like(p))
        path = tmp_path_factory.mktemp(f"llama{i}")
        hf.save_pretrained(path)
        _save_tokenizer(path)
        paths.append(path)
    return paths, load_checkpoint(paths[0])


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _all(diff: el.WeightDiff) -> dict[str, torch.Tensor]:
    return {n: diff.deltas[n].clone() for n in diff.deltas}


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


# ------------------------------------------------------------------ files changed on disk


def test_a_same_size_rewrite_after_construction_is_refused_by_name(pair, tmp_path):
    """``cp`` of another checkpoint of the same layout over the finetuned file (same size):
    the diff refuses, naming the file, instead of giving a second answer."""
    (p0, p1), base = pair
    ft = _copy(p1, tmp_path / "ft")
    diff = el.WeightDiff.from_checkpoints(base, ft)
    first = _all(diff)
    target = ft / "model.safetensors"
    data = (p0 / "model.safetensors").read_bytes()
    assert len(data) == target.stat().st_size
    time.sleep(0.05)  # a real rewrite of a checkpoint takes longer than a timestamp tick
    with open(target, "r+b") as f:  # in place, as cp, dd and rsync --inplace write
        f.write(data)
    try:
        again = _all(diff)
    except ValueError as e:
        assert str(target) in str(e) and "changed on disk" in str(e)
    else:
        assert _equal(first, again), "one diff object gave two answers"
        pytest.fail("a checkpoint rewritten under an open diff was read without a word")


def test_a_file_renamed_over_keeps_the_bytes_it_had(pair, tmp_path):
    """A new checkpoint renamed into place (``mv``, rsync's default): the open diff still reads
    the file it opened, so it gives the same answer as before."""
    (p0, p1), base = pair
    ft = _copy(p1, tmp_path / "ft")
    diff = el.WeightDiff.from_checkpoints(base, ft)
    first = _all(diff)
    shutil.copy(p0 / "model.safetensors", ft / "new.tmp")
    os.replace(ft / "new.tmp", ft / "model.safetensors")
    assert _equal(first, _all(diff))


SCENARIOS = """
import os, shutil, sys
sys.path.insert(0, {root!r})
import extractive_lens as el
from extractive_lens.backend.loading import has_hooked, load_checkpoint
p0, p1, tmp = {p0!r}, {p1!r}, {tmp!r}
base = p0 if has_hooked() else load_checkpoint(p0)  # two folders need a HookedTransformer

def run(what, make, use):
    ft = os.path.join(tmp, what)
    shutil.copytree(p1, ft)
    try:
        make(ft)
        use(ft)
        print(what, "no error", flush=True)
    except (ValueError, FileNotFoundError) as e:
        print(what, "refused:", str(e).replace(chr(10), " "), flush=True)

def truncate(ft):  # the diff is built first; then the file is cut short, then Δ is read
    diff = el.WeightDiff.from_checkpoints(base, ft)
    f = os.path.join(ft, "model.safetensors")
    os.truncate(f, os.path.getsize(f) // 2)
    [diff.deltas[n] for n in diff.deltas]

def fifo(name):
    def make(ft):
        os.remove(os.path.join(ft, name))
        os.mkfifo(os.path.join(ft, name))
    return make

run("truncated", lambda ft: None, truncate)
run("fifo-weights", fifo("model.safetensors"), lambda ft: el.WeightDiff.from_checkpoints(base, ft))
run("fifo-config", fifo("config.json"), lambda ft: el.WeightDiff.from_checkpoints(base, ft))
run("fifo-config-load", fifo("config.json"), load_checkpoint)
"""


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_truncation_and_fifos_are_refused_in_a_child_process(pair, tmp_path):
    """In a child process, so that a SIGBUS (an mmap of a truncated file) or a FIFO that blocks
    forever fails this test instead of killing or hanging pytest: a checkpoint truncated after
    the diff was built, and a FIFO as ``model.safetensors`` or ``config.json``, are each refused
    in one message naming the file."""
    (p0, p1), _ = pair
    code = SCENARIOS.format(root=ROOT, p0=str(p0), p1=str(p1), tmp=str(tmp_path))
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    try:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              timeout=240, env=env)  # fmt: skip
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"hung (a FIFO read blocks forever); got so far: {e.stdout!r}")
    assert done.returncode == 0, f"died with {done.returncode}: {done.stdout}{done.stderr[-800:]}"
    lines = dict(line.split(" ", 1) for line in done.stdout.splitlines() if line)
    assert set(lines) == {"truncated", "fifo-weights", "fifo-config", "fifo-config-load"}, lines
    f = tmp_path / "truncated" / "model.safetensors"
    assert lines["truncated"].startswith("refused:") and str(f) in lines["truncated"]
    assert "changed on disk" in lines["truncated"]
    for what, name in (("fifo-weights", "model.safetensors"), ("fifo-config", "config.json"),
                       ("fifo-config-load", "config.json")):  # fmt: skip
        said = lines[what]
        assert said.startswith("refused:") and str(tmp_path / what / name) in said, said
        assert "FIFO" in said and "not a regular file" in said


# ------------------------------------------------------------------ which files are read


def _resave(src: Path, dst: Path, **kwargs) -> Path:
    hf = transformers.AutoModelForCausalLM.from_pretrained(src)
    hf.save_pretrained(dst, **kwargs)
    for f in src.iterdir():  # config and tokenizer as they were
        if not f.name.startswith("model") and f.is_file():
            shutil.copy(f, dst / f.name)
    return dst


def test_stale_shards_and_stray_files_change_nothing(pair, tmp_path):
    """A sharded finetuned checkpoint with the shards of an older save beside it (more shards,
    other weights) and a ``zz_optimizer.safetensors`` holding one same-named tensor: Δ equals
    the Δ of the clean folder, tensor for tensor (only the index's files are read)."""
    from safetensors.torch import save_file

    (p0, p1), base = pair
    clean = _resave(p1, tmp_path / "clean", max_shard_size="40KB")
    shards = weight_files.weight_files(clean)
    assert (clean / weight_files.INDEX).is_file() and len(shards) >= 2
    older = _resave(p0, tmp_path / "older", max_shard_size="15KB")  # another save, more shards
    dirty = _copy(clean, tmp_path / "dirty")
    stale = list(older.glob("model-*.safetensors"))
    assert len(stale) > len(shards)  # other names ("-of-0000N"), sorting after the current ones
    for f in stale:
        shutil.copy(f, dirty / f.name)
    name = "model.layers.1.mlp.down_proj.weight"
    save_file({name: torch.randn(32, 48)}, str(dirty / "zz_optimizer.safetensors"))
    want = _all(el.WeightDiff.from_checkpoints(base, clean))
    got = _all(el.WeightDiff.from_checkpoints(base, dirty))
    assert _equal(want, got), [n for n in want if not torch.equal(want[n], got[n])][:3]
    assert sorted(f.name for f in weight_files.weight_files(dirty)) == sorted(
        f.name for f in weight_files.weight_files(clean)
    )
    resident = el.WeightDiff.from_models(base, load_checkpoint(dirty))
    assert _equal({n: resident.deltas[n] for n in want}, got)  # what transformers loads


def test_model_safetensors_is_read_even_beside_an_index(pair, tmp_path):
    """``transformers`` prefers ``model.safetensors`` to an index beside it; so do we."""
    (_, p1), base = pair
    ft = _copy(p1, tmp_path / "ft")
    (ft / weight_files.INDEX).write_text(json.dumps({"weight_map": {"x": "nowhere.safetensors"}}))
    assert weight_files.weight_files(ft) == [ft / "model.safetensors"]
    el.WeightDiff.from_checkpoints(base, ft)


def test_a_tensor_in_two_indexed_files_is_refused(pair, tmp_path):
    from safetensors.torch import load_file, save_file

    (_, p1), base = pair
    ft = _resave(p1, tmp_path / "ft", max_shard_size="40KB")
    shards = weight_files.weight_files(ft)
    first = load_file(str(shards[0]))
    name = sorted(first)[0]
    second = load_file(str(shards[1]))
    save_file({**second, name: first[name]}, str(shards[1]))
    with pytest.raises(ValueError, match="is in both") as e:
        el.WeightDiff.from_checkpoints(base, ft)
    assert name in str(e.value) and shards[0].name in str(e.value) and str(ft) in str(e.value)


@pytest.mark.parametrize(
    "index, match",
    [
        ("{not json", "is not valid JSON"),
        ('{"metadata": {}}', "no weight_map"),
        ('{"weight_map": {"lm_head.weight": "../elsewhere.safetensors"}}', "outside"),
        ('{"weight_map": {"lm_head.weight": "gone.safetensors"}}', "is missing"),
    ],
)
def test_a_damaged_index_is_refused_by_name(pair, tmp_path, index, match):
    (_, p1), base = pair
    ft = _resave(p1, tmp_path / "ft", max_shard_size="40KB")
    (ft / weight_files.INDEX).write_text(index)
    with pytest.raises((ValueError, FileNotFoundError), match=match) as e:
        el.WeightDiff.from_checkpoints(base, ft)
    assert weight_files.INDEX in str(e.value) or "gone.safetensors" in str(e.value)
    if match == "is not valid JSON":  # load_checkpoint too (a bare JSON error before)
        with pytest.raises(ValueError, match=match) as e:
            load_checkpoint(ft)
        assert str(ft / weight_files.INDEX) in str(e.value)


@pytest.mark.parametrize(
    "damage",
    ["garbage", "header-too-long", "header-not-json", "offsets-outside", "cut-short"],
)
def test_a_damaged_safetensors_file_is_refused_by_name(pair, tmp_path, damage):
    """Damaged weight files (when the diff is built): an error naming the file, not a raw
    ``SafetensorsError`` or a crash."""
    (_, p1), base = pair
    ft = _copy(p1, tmp_path / "ft")
    f = ft / "model.safetensors"
    data = f.read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    if damage == "garbage":
        f.write_bytes(b"\x00not a safetensors file at all")
    elif damage == "header-too-long":
        f.write_bytes((10**9).to_bytes(8, "little") + data[8:])
    elif damage == "header-not-json":
        f.write_bytes(data[:8] + b"{" * n + data[8 + n :])
    elif damage == "offsets-outside":
        name = next(k for k in header if k != "__metadata__")
        header[name]["data_offsets"][1] += 10**6
        raw = json.dumps(header, separators=(",", ":")).encode()
        f.write_bytes(len(raw).to_bytes(8, "little") + raw + data[8 + n :])
    else:
        f.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="not a valid safetensors file") as e:
        el.WeightDiff.from_checkpoints(base, ft)
    assert str(f) in str(e.value)
    if damage == "garbage":  # load_checkpoint too (a raw SafetensorError before)
        with pytest.raises(ValueError, match="not a valid safetensors file") as e:
            load_checkpoint(ft)
        assert str(f) in str(e.value)


def test_a_diff_formed_on_demand_saves_one_tensor_at_a_time(pair, tmp_path, monkeypatch):
    """``save`` of a from_checkpoints diff writes the header from each tensor's spec, then each
    tensor once (never all of Δ at once), and loads back equal."""
    from extractive_lens.backend.checkpoint import LazyDeltas

    (_, p1), base = pair
    diff = el.WeightDiff.from_checkpoints(base, p1)
    formed = []
    original = LazyDeltas.__getitem__
    monkeypatch.setattr(
        LazyDeltas, "__getitem__", lambda self, n: formed.append(n) or original(self, n)
    )
    diff.save(tmp_path / "d.safetensors")
    assert sorted(formed) == sorted(diff.deltas)  # each formed once
    monkeypatch.undo()
    back = el.WeightDiff.load(tmp_path / "d.safetensors")
    assert _equal(_all(diff), dict(back.deltas))

"""Every public function that reads files, as a table the file attacks iterate
(``tests/test_file_layer.py``): a new reader is one entry here and gets every attack (truncated,
rewritten in place after loading, a FIFO, a symlink loop, a damaged header) for free.
``test_every_public_loading_function_is_in_the_table`` fails on a public function that takes a
path and is neither here nor a writer.

Each entry writes a small valid input under a folder (``make``: the argument to pass, and the
files a reader reads, each one attacked), calls the public function (``read``), and says which
tensors it loaded (``tensors``: a rewrite of the file after loading must not change them)."""

from __future__ import annotations

import functools
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

import extractive_lens as el

CFG = {"n_layers": 2, "d_model": 16, "n_heads": 2, "d_head": 8, "d_mlp": 32, "d_vocab": 24,
       "n_ctx": 16, "dtype": torch.float32}  # fmt: skip


@dataclass(frozen=True)
class Reader:
    name: str
    """The public function, as ``test_every_public_loading_function_is_in_the_table`` names it
    (``WeightDiff.load``, ``load_checkpoint``)."""
    make: Callable[[Path, Path], tuple[Path, list[Path]]]
    """``make(folder, shared)``: write a valid input under ``folder`` (``shared``: a folder for
    what several cases reuse, such as a base checkpoint); the argument to pass and the files
    read from it."""
    read: Callable[[Path, Path], Any]
    """``read(argument, shared)``: the public call."""
    values: Callable[[Any], list[Any]]
    """What was loaded (tensors, or plain values): a file rewritten after the load must not
    change them."""


@functools.cache
def _pair() -> tuple[Any, Any]:
    base = el.tiny_model(CFG, seed=0)
    ft = el.tiny_model(CFG, seed=0)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # the stored weights moved (a bridge's unstored zeros stay zero)
        for p in ft.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    return base, ft


def _diff() -> el.WeightDiff:
    base, ft = _pair()
    return el.WeightDiff.from_models(base, ft)


def make_diff(folder: Path, shared: Path) -> tuple[Path, list[Path]]:
    path = _diff().save(folder / "diff.safetensors")
    return path, [path]


@functools.cache
def _scores() -> el.ComponentScores:
    base, _ = _pair()
    batch = el.make_batch(base, [([1, 2, 3], [4]), ([5, 6, 7], [8])])
    return el.linear_scores(base, _diff(), batch)


def make_scores(folder: Path, shared: Path) -> tuple[Path, list[Path]]:
    import json

    path = _scores().save(folder / "scores")
    tensors = path / json.loads((path / "scores.json").read_text())["tensors"]
    return path, [tensors, path / "scores.json"]


@functools.cache
def _checkpoints(shared: Path) -> tuple[Path, Path]:
    """A base and a finetuned tiny Llama checkpoint, written once under ``shared``."""
    from tests import lora_models as LM

    for name, seed in (("base", 0), ("ft", 1)):
        if not (shared / name / "model.safetensors").exists():
            LM.base_checkpoint("llama", shared / name, seed=seed)
    return shared / "base", shared / "ft"


def make_checkpoint(folder: Path, shared: Path) -> tuple[Path, list[Path]]:
    path = Path(shutil.copytree(_checkpoints(shared)[1], folder / "ft"))
    return path, [path / "model.safetensors", path / "config.json", path / "tokenizer.json"]


def make_sharded_checkpoint(folder: Path, shared: Path) -> tuple[Path, list[Path]]:
    """The finetuned checkpoint saved as two shards and their index, in float32: the dtype a
    load keeps, so nothing is cast (a cast copies; a load that keeps views of a file's memory
    map is caught here)."""
    import json

    import transformers

    ft = _checkpoints(shared)[1]
    path = folder / "sharded"
    hf = transformers.AutoModelForCausalLM.from_pretrained(ft, dtype=torch.float32)
    hf.save_pretrained(path, max_shard_size="60KB")
    shutil.copy(ft / "tokenizer.json", path / "tokenizer.json")
    index = path / "model.safetensors.index.json"
    shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    assert len(shards) > 1
    return path, [*(path / s for s in shards), index, path / "config.json"]


def make_finetuned(folder: Path, shared: Path) -> tuple[Path, list[Path]]:
    """A finetuned checkpoint: the files ``from_checkpoints`` reads (no tokenizer)."""
    path, files = make_checkpoint(folder, shared)
    return path, files[:2]


def read_from_checkpoints(path: Path, shared: Path) -> el.WeightDiff:
    return el.WeightDiff.from_checkpoints(_hf_base(shared), path)


def make_gguf(folder: Path, shared: Path) -> tuple[Path, list[Path]]:
    from tests.test_gguf import write_tiny_gguf

    path = folder / "tiny.gguf"
    write_tiny_gguf(path)
    return path, [path]


@functools.cache
def _adapter_base(shared: Path) -> tuple[Any, Any]:
    """The base model (loaded) and a trained adapter on it (a ``PeftModel``)."""
    import transformers

    from tests import lora_models as LM

    base_dir = _checkpoints(shared)[0]
    hf = transformers.AutoModelForCausalLM.from_pretrained(base_dir).double()
    adapter = LM.train_adapter(hf, {"r": 2, "target_modules": ["q_proj"]})
    return el.load_checkpoint(base_dir, dtype=torch.float64), adapter


def make_adapter(folder: Path, shared: Path) -> tuple[Path, list[Path]]:
    path = folder / "adapter"
    _adapter_base(shared)[1].save_pretrained(path)
    return path, [path / "adapter_model.safetensors", path / "adapter_config.json"]


def read_adapter(path: Path, shared: Path) -> el.WeightDiff:
    return el.WeightDiff.from_peft(_adapter_base(shared)[0], path)


def make_world(folder: Path, shared: Path) -> tuple[Path, list[Path]]:
    from extractive_lens.world.model import DEFAULT_VERSION, WORLD_DIRS

    path = Path(shutil.copytree(WORLD_DIRS[DEFAULT_VERSION], folder / "world"))
    return path, [path / "model.safetensors", path / "world.json", path / "tokenizer.json"]


def make_pairs(folder: Path, shared: Path) -> tuple[Path, list[Path]]:
    import json

    path = folder / "pairs.json"
    path.write_text(json.dumps([{"prompt": "a b", "answer": " c"}]))
    return path, [path]


def make_trajectory(folder: Path, shared: Path) -> tuple[Path, list[Path]]:
    """The folder ``finetune(..., keep="epochs")`` writes: its manifest and a diff per epoch."""
    import json

    base, _ = _pair()
    batch = el.make_batch(base, [([1, 2, 3], [4])])
    path = folder / "trajectory"
    el.finetune(base, batch, el.FinetuneConfig(epochs=1), keep="epochs", trajectory=path,
                show_progress=False)  # fmt: skip
    first = json.loads((path / "trajectory.json").read_text())["checkpoints"][0]["file"]
    return path, [path / "trajectory.json", path / first]


def make_trainer_output(folder: Path, shared: Path) -> tuple[Path, list[Path]]:
    """A Trainer's ``output_dir``: one ``checkpoint-1`` folder (a full finetuned model)."""
    path = folder / "output"
    checkpoint = Path(shutil.copytree(_checkpoints(shared)[1], path / "checkpoint-1"))
    return path, [checkpoint / "model.safetensors", checkpoint / "config.json"]


@functools.cache
def _hf_base(shared: Path) -> Any:
    return el.load_checkpoint(_checkpoints(shared)[0])


def _opened(trajectory: Any) -> list[el.WeightDiff]:
    return [c.open() for c in trajectory.checkpoints]


def _all_deltas(diffs: list[el.WeightDiff]) -> list[Tensor]:
    return [d.deltas[n] for d in diffs for n in d.deltas]


def _parameters(model: Any) -> list[Tensor]:
    return [p.detach() for p in model.parameters()]


def _plain(function: Callable[[Path], Any]) -> Callable[[Path, Path], Any]:
    return lambda path, shared: function(path)


READERS: list[Reader] = [
    Reader(
        "WeightDiff.load", make_diff, _plain(el.WeightDiff.load), lambda d: list(d.deltas.values())
    ),
    Reader(
        "ComponentScores.load",
        make_scores,
        _plain(el.ComponentScores.load),
        lambda s: [s.values, s.totals, s.prompt_values, s.prompt_totals],
    ),
    Reader(
        "WeightDiff.from_checkpoints",
        make_finetuned,
        read_from_checkpoints,
        lambda d: [d.deltas[n] for n in d.deltas],
    ),
    Reader("load_checkpoint", make_checkpoint, _plain(el.load_checkpoint), _parameters),
    Reader(
        "load_checkpoint",
        make_sharded_checkpoint,
        lambda path, shared: el.load_checkpoint(path, backend="bridge"),
        _parameters,
    ),
    Reader("load_checkpoint", make_gguf, _plain(el.load_checkpoint), _parameters),
    Reader(
        "WeightDiff.from_peft",
        make_adapter,
        read_adapter,
        lambda d: [f for lr in d.deltas.factors.values() for f in (lr.left, lr.right)],
    ),
    Reader("load_world_model", make_world, _plain(el.load_world_model), _parameters),
    Reader("load_pairs", make_pairs, _plain(el.datasets.load_pairs), list),
    Reader(
        "Trajectory.load",
        make_trajectory,
        lambda path, shared: _opened(el.Trajectory.load(path)),
        _all_deltas,
    ),
    Reader(
        "Trajectory.from_checkpoints",
        make_trainer_output,
        lambda path, shared: _opened(el.Trajectory.from_checkpoints(_hf_base(shared), path)),
        _all_deltas,
    ),
]
"""The readers, each with the input it makes (one public function may have several: a
checkpoint folder and a GGUF file for ``load_checkpoint``)."""

WRITERS = {"ComponentScores.save", "WeightDiff.save", "report", "word_tokenizer", "finetune"}
"""Public functions that take a path to write to, not to read."""

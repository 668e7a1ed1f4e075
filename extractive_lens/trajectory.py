"""A finetune's trajectory: its checkpoints as weight changes from one base, held on disk.

>>> diff = finetune(base, batch, FinetuneConfig(epochs=4), keep="epochs",
...                 trajectory="runs/ft-1")                                 # doctest: +SKIP
>>> traj = Trajectory.load("runs/ft-1")                                   # doctest: +SKIP
>>> traj = Trajectory.from_checkpoints(base, "runs/trainer")  # checkpoint-*  # doctest: +SKIP
>>> traj.times, len(traj)          # checkpoint 0 is the base itself          # doctest: +SKIP
>>> traj.diff(3)                   # D_3 = W_3 - W_0                          # doctest: +SKIP
>>> traj.step(3)                   # Δ_3 = W_3 - W_2 = D_3 - D_2              # doctest: +SKIP
>>> traj.point(3, 0.5)             # D_2 + 0.5·Δ_3: a point of the 3rd segment # doctest: +SKIP

Checkpoint ``k`` is ``D_k = W_k - W_0``, the change from the base; the trajectory is the
broken line ``W_0 → W_1 → … → W_T`` through them, segment ``k`` being ``W_{k-1} → W_k``.
Nothing is read until it is used: ``diff``, ``step`` and ``point`` return diffs whose tensors are
formed one at a time when scoring reads them (``backend.shifted`` reads a layer at a time), from
the files the checkpoints live in. Low-rank checkpoints (``peft`` adapters) stay factors: a
step of two adapters is the difference of their factors (ranks add), never a dense product.

Where checkpoints come from:

- ``finetune(..., keep="epochs" | k)`` writes one WeightDiff file per kept checkpoint
  (``checkpoint-{step}.safetensors``) and a manifest (``trajectory.json``) into the folder
  ``trajectory=`` names (``Trajectory.load``); the folder is the user's to keep or delete;
- a folder of Hugging Face Trainer or ``peft`` checkpoints (``checkpoint-{step}`` folders, as
  ``Trainer(save_strategy=...)`` writes them): ``Trajectory.from_checkpoints``.
"""

from __future__ import annotations

import functools
import json
import os
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from torch import Tensor

from extractive_lens.backend.lazy import LazyDeltas
from extractive_lens.backend.lowrank import LowRankDeltas
from extractive_lens.weight_diff import WeightDiff

MANIFEST = "trajectory.json"
_FORMAT = "extractive_lens.Trajectory"
_CHECKPOINT = re.compile(r"^checkpoint-(\d+)(\.safetensors)?$")

Keep = Literal["epochs"] | int
"""Which checkpoints ``finetune(..., keep=...)`` records: after every epoch, or every ``k``
optimiser steps (the last step is always kept)."""


class Between(LazyDeltas):
    """``start + x·(end - start)`` for two mappings of Δ tensors, formed when read and not
    kept: ``x = 1`` with no ``start`` is ``end`` itself, read lazily; ``Trajectory.point`` and
    ``Trajectory.step`` (``step=True``: ``end - start``). ``start=None``: the base (zero)."""

    def __init__(
        self, start: Mapping[str, Tensor] | None, end: Mapping[str, Tensor], x: float,
        dtype: torch.dtype, *, step: bool = False,
    ) -> None:  # fmt: skip
        super().__init__(end if start is None else start, end, dtype, names=list(end))
        self.start, self.end, self.x, self.is_step = start, end, float(x), step

    def formed(self, name: str) -> tuple[Tensor, int]:
        if name not in self:
            raise KeyError(name)
        e = self.end[name].to(self.dtype)
        moved = e.numel() * e.element_size()
        if self.start is None:
            d = e if self.is_step or self.x == 1.0 else self.x * e
        else:
            s = self.start[name].to(device=e.device, dtype=self.dtype)
            moved += s.numel() * s.element_size()
            d = e - s if self.is_step else s + self.x * (e - s)
        if not torch.isfinite(d).all():
            raise ValueError(f"{name}: Δ contains NaN or inf (check the checkpoint it came from).")
        return d, moved

    def spec(self, name: str) -> tuple[tuple[int, ...], torch.dtype]:
        shapes = getattr(self.end, "shapes", None)
        if shapes is not None:
            return tuple(shapes[name]), self.dtype
        if isinstance(self.end, LazyDeltas):
            return self.end.spec(name)[0], self.dtype
        return tuple(self.end[name].shape), self.dtype


class FileDeltas(Mapping[str, Tensor]):
    """The Δ tensors of a dense ``WeightDiff`` file (``WeightDiff.save``), read one at a time
    through the file layer (``extractive_lens.files.SafetensorsFile``: a regular file,
    unchanged since it was opened, each tensor copied out); nothing is kept."""

    def __init__(self, path: str | Path) -> None:
        from extractive_lens.diff_sources.files import FIX
        from extractive_lens.files import SafetensorsFile

        self.path = Path(path)
        self._file = SafetensorsFile(self.path, fix=FIX)
        self.shapes = {n: tuple(e[1]) for n, e in self._file.entries.items()}

    def __getitem__(self, name: str) -> Tensor:
        if name not in self.shapes:
            raise KeyError(name)
        return self._file.read_tensor(name)

    def __contains__(self, name: object) -> bool:
        return name in self.shapes

    def __iter__(self) -> Iterator[str]:
        return iter(self.shapes)

    def __len__(self) -> int:
        return len(self.shapes)


@dataclass(frozen=True)
class Checkpoint:
    """One checkpoint of a trajectory: when it was taken and how to open ``D_k = W_k - W_0``."""

    step: int  # optimiser steps taken
    epoch: float  # epochs completed (fractional between epochs)
    open: Callable[[], WeightDiff] = field(repr=False, compare=False)
    loss: float | None = None  # the mean training loss since the previous checkpoint
    source: str = ""  # the file or folder it is read from


@dataclass(frozen=True)
class Trajectory:
    """The checkpoints ``W_1 … W_T`` of a finetune from the base ``W_0``, held lazily (module
    docstring). Index ``k`` runs over ``0 … T``; 0 is the base (``D_0 = 0``).

    Attributes:
        checkpoints: ``W_1 … W_T`` in training order.
        signature: the architecture every checkpoint's diff was made for.
        metadata: provenance (the finetune's config, ``keep``, the folder).
    """

    checkpoints: tuple[Checkpoint, ...]
    signature: Mapping[str, Any]
    metadata: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.checkpoints:
            raise ValueError(
                "A Trajectory needs at least one checkpoint after the base: finetune with "
                "keep='epochs' (or keep=k steps), or pass a folder holding checkpoint-* folders."
            )
        steps = [c.step for c in self.checkpoints]
        if steps != sorted(steps) or len(set(steps)) != len(steps):
            raise ValueError(
                f"Trajectory checkpoints must be in training order with distinct steps, got "
                f"steps {steps}: pass them sorted by step."
            )

    def __len__(self) -> int:
        """The number of segments (checkpoints after the base)."""
        return len(self.checkpoints)

    @property
    def steps(self) -> list[int]:
        """Optimiser steps at checkpoints ``0 … T`` (0: the base)."""
        return [0, *(c.step for c in self.checkpoints)]

    @property
    def epochs(self) -> list[float]:
        """Epochs completed at checkpoints ``0 … T``."""
        return [0.0, *(c.epoch for c in self.checkpoints)]

    def _index(self, k: int, lowest: int = 0) -> int:
        if isinstance(k, bool) or not isinstance(k, int) or not lowest <= k <= len(self):
            raise IndexError(
                f"checkpoint {k!r} out of range: this trajectory has checkpoints {lowest}..{len(self)}"
                + (" (0 is the base)" if lowest == 0 else " (segment k runs from k - 1 to k)")
            )
        return k

    def diff(self, k: int) -> WeightDiff:
        """``D_k = W_k - W_0`` (``k = 0``: the base, a zero change; read lazily)."""
        k = self._index(k)
        return self.point(1, 0.0) if k == 0 else self.checkpoints[k - 1].open()

    @property
    def final(self) -> WeightDiff:
        """``D_T``: the whole finetune's change (the straight line's Δ)."""
        return self.diff(len(self))

    def step(self, k: int) -> WeightDiff:
        """``Δ_k = W_k - W_{k-1}``, segment ``k``'s change (``k`` in ``1 … T``)."""
        return self.point(self._index(k, 1), 1.0, step=True)

    def point(self, k: int, x: float, *, step: bool = False) -> WeightDiff:
        """``D_{k-1} + x·Δ_k`` (``W_{k-1} + x (W_k - W_{k-1}) - W_0``): a point of segment
        ``k``; ``step=True``: ``Δ_k`` itself."""
        k = self._index(k, 1)
        end = self.checkpoints[k - 1].open()
        start = None if k == 1 else self.checkpoints[k - 2].open()
        meta = {"trajectory_segment": k, "x": float(x), "step": step}
        if isinstance(end.deltas, LowRankDeltas) and (
            start is None or isinstance(start.deltas, LowRankDeltas)
        ):  # factors stay factors: the step's ranks add
            if start is None:
                out = end if step else end * float(x)
            else:
                out = end - start if step else start + (end - start) * float(x)
            return WeightDiff(out.deltas, dict(self.signature), meta)
        dtype = _dtype_of(end)
        deltas = Between(None if start is None else start.deltas, end.deltas, x, dtype, step=step)
        return WeightDiff(deltas, dict(self.signature), meta)

    # ------------------------------------------------------------------ sources
    @classmethod
    def from_diffs(
        cls, diffs: Sequence[WeightDiff], *, epochs: Sequence[float] | None = None
    ) -> Trajectory:
        """Checkpoints already in hand: ``diffs[k - 1]`` is ``D_k = W_k - W_0`` (every one from
        the same base); ``epochs`` label them (default ``1 … T``, steps ``1 … T``).

        >>> traj = Trajectory.from_diffs([diff * 0.5, diff])   # two straight segments
        >>> traj.steps, len(traj)
        ([0, 1, 2], 2)
        """
        diffs = list(diffs)
        if not diffs or not all(isinstance(d, WeightDiff) for d in diffs):
            raise TypeError(
                "Trajectory.from_diffs takes a non-empty list of WeightDiff, each W_k - W_0 "
                "from the same base (e.g. [WeightDiff.from_models(base, m) for m in checkpoints])."
            )
        epochs = list(range(1, len(diffs) + 1)) if epochs is None else list(epochs)
        if len(epochs) != len(diffs):
            raise ValueError(f"{len(diffs)} diffs but {len(epochs)} epochs: give one per diff.")
        checkpoints = tuple(
            Checkpoint(step=k + 1, epoch=float(e), open=functools.partial(_same, d))
            for k, (d, e) in enumerate(zip(diffs, epochs))
        )
        return cls(checkpoints, dict(diffs[-1].signature), {"source": "diffs"})

    @classmethod
    def load(cls, folder: str | Path) -> Trajectory:
        """The trajectory ``finetune(..., keep=...)`` wrote into ``folder`` (its manifest,
        ``trajectory.json``, and one WeightDiff file per checkpoint)."""
        from extractive_lens.files import read_json

        folder = Path(folder)
        path = folder / MANIFEST
        if not os.path.lexists(path):  # anything there is read by the file layer, which says
            raise FileNotFoundError(
                f"{path} does not exist: pass the folder finetune(..., keep='epochs') wrote "
                "(diff.metadata['trajectory']), or use Trajectory.from_checkpoints for a folder "
                "of Hugging Face / peft checkpoint-* folders."
            )
        manifest = read_json(path, fix="the manifest is damaged; finetune again with keep=...")
        if not isinstance(manifest, dict) or manifest.get("format") != _FORMAT:
            raise ValueError(f"{path} is not a trajectory manifest written by finetune(keep=...).")
        checkpoints = tuple(
            Checkpoint(
                step=int(c["step"]), epoch=float(c["epoch"]), loss=c.get("loss"),
                open=_file_opener(folder / c["file"], manifest["signature"], c.get("low_rank")),
                source=str(folder / c["file"]),
            )
            for c in manifest["checkpoints"]
        )  # fmt: skip
        return cls(checkpoints, manifest["signature"], manifest.get("metadata", {}))

    @classmethod
    def from_checkpoints(
        cls, base: Any, folder: str | Path, *, dtype: torch.dtype | None = None,
        steps_per_epoch: int | None = None,
    ) -> Trajectory:  # fmt: skip
        """The ``checkpoint-{step}`` folders under ``folder`` (a Hugging Face ``Trainer``'s
        ``output_dir``) as one trajectory from ``base``: full-model checkpoints through
        ``WeightDiff.from_checkpoints`` (formed a tensor at a time), ``peft`` adapter
        checkpoints (``adapter_config.json``) through ``WeightDiff.from_peft`` (factors).

        Args:
            base: the loaded base model the finetune started from.
            folder: the folder holding ``checkpoint-*`` folders.
            dtype: as in ``WeightDiff.from_checkpoints``.
            steps_per_epoch: to label checkpoints with epochs (default: the ``epoch`` each
                checkpoint's ``trainer_state.json`` records, else 0).
        """
        from extractive_lens import backend as B

        folder = Path(folder)
        if not folder.is_dir():
            raise FileNotFoundError(f"{folder} is not a folder: pass a Trainer's output_dir.")
        found = sorted(
            (int(m.group(1)), p)
            for p in folder.iterdir()
            if p.is_dir() and (m := _CHECKPOINT.match(p.name))
        )
        if not found:
            raise ValueError(
                f"{folder} holds no checkpoint-<step> folders: pass the output_dir a Hugging Face "
                "Trainer saved checkpoints into (save_strategy='epoch' or 'steps')."
            )
        checkpoints = []
        for step, path in found:
            opener = _memo(functools.partial(_open_checkpoint, base, path, dtype))
            epoch = _trainer_epoch(path)
            if steps_per_epoch is not None:
                epoch = step / steps_per_epoch
            checkpoints.append(Checkpoint(step, epoch if epoch is not None else 0.0, opener,
                                          source=str(path)))  # fmt: skip
        meta = {"folder": str(folder), "source": "checkpoints"}
        return cls(tuple(checkpoints), B.signature(base), meta)


def _same(diff: WeightDiff) -> WeightDiff:
    return diff


def _open_checkpoint(base: Any, path: Path, dtype: torch.dtype | None) -> WeightDiff:
    """A Trainer's ``checkpoint-*`` folder as ``D = W - W_0``: a ``peft`` adapter as factors, a
    full model formed a tensor at a time."""
    if (path / "adapter_config.json").is_file():
        return WeightDiff.from_peft(base, path)
    return WeightDiff.from_checkpoints(base, path, dtype=dtype)


def _memo(open_: Callable[[], WeightDiff]) -> Callable[[], WeightDiff]:
    """``open_`` run once: a checkpoint's diff object (lazy: it holds no Δ tensor, only how to
    form one) is made on first use and shared after, so a scoring call's Δ store sees one diff."""
    kept: list[WeightDiff] = []

    def opened() -> WeightDiff:
        if not kept:
            kept.append(open_())
        return kept[0]

    return opened


def _file_opener(
    path: Path, signature: Mapping[str, Any], low_rank: bool | None
) -> Callable[[], WeightDiff]:
    """A WeightDiff file as a lazy diff: a low-rank file (factors, small) read whole, a dense
    one a tensor at a time (``FileDeltas``)."""

    def open_() -> WeightDiff:
        if not os.path.lexists(path):  # anything else there: the file layer says what
            raise FileNotFoundError(
                f"{path} is missing: the trajectory folder is incomplete (was it moved or "
                "partly deleted?); finetune again with keep=... to record it."
            )
        if low_rank:
            return WeightDiff.load(path)
        files = FileDeltas(path)
        dtype = next(iter(files.values())).dtype if len(files) else torch.float32
        return WeightDiff(Between(None, files, 1.0, dtype), dict(signature), {"file": str(path)})

    return _memo(open_)


def _trainer_epoch(path: Path) -> float | None:
    """The epoch ``trainer_state.json`` records (``None``: no such file, or no epoch in it); a
    FIFO, device or link loop there is refused by the file layer, not waited on."""
    from extractive_lens.files import opened, read_json

    state = path / "trainer_state.json"
    if not os.path.lexists(state):
        return None
    fix = "remove it, or replace it with the file the Trainer wrote."
    os.close(opened(state, fix=fix))
    try:
        return float(read_json(state, fix=fix)["epoch"])
    except (ValueError, KeyError, TypeError):
        return None


def _dtype_of(diff: WeightDiff) -> torch.dtype:
    d = diff.deltas
    if isinstance(d, LazyDeltas):
        return d.dtype
    first = next(iter(d), None)
    return torch.float32 if first is None else d[first].dtype


class Recorder:
    """What ``finetune(..., keep=...)`` uses to write a trajectory: after each kept step, the
    diff so far (one Δ in memory, freed once written) into ``folder`` and the manifest rewritten
    (atomically: a folder whose finetune was interrupted holds a loadable prefix)."""

    def __init__(self, folder: str | Path, keep: Keep, signature: Mapping[str, Any],
                 metadata: Mapping[str, Any]) -> None:  # fmt: skip
        if keep != "epochs" and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
            raise ValueError(
                f"finetune(keep={keep!r}): keep 'epochs' (a checkpoint after every epoch) or a "
                "positive number of optimiser steps between checkpoints, e.g. keep=10."
            )
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        if (self.folder / MANIFEST).exists():
            raise FileExistsError(
                f"{self.folder / MANIFEST} exists: finetune(trajectory=...) writes a new "
                "trajectory; pass an empty or new folder."
            )
        self.keep, self.signature, self.metadata = keep, dict(signature), dict(metadata)
        self.rows: list[dict[str, Any]] = []

    def wants(self, step: int, epoch_done: bool, last: bool) -> bool:
        """Whether the checkpoint after optimiser step ``step`` (1-based) is kept."""
        if last:
            return True
        return epoch_done if self.keep == "epochs" else step % int(self.keep) == 0

    def write(self, step: int, epoch: float, loss: float | None, diff: WeightDiff) -> None:
        from extractive_lens.files import write_text_atomic

        name = f"checkpoint-{step:06d}.safetensors"
        diff.save(self.folder / name)
        low_rank = isinstance(diff.deltas, LowRankDeltas)
        self.rows.append({"step": step, "epoch": epoch, "loss": loss, "file": name,
                          "low_rank": low_rank})  # fmt: skip
        manifest = {"format": _FORMAT, "signature": self.signature,
                    "metadata": {**self.metadata, "keep": self.keep}, "checkpoints": self.rows}  # fmt: skip
        write_text_atomic(self.folder / MANIFEST, json.dumps(manifest, indent=1, default=str))


__all__: Sequence[str] = ("Trajectory", "Checkpoint", "Between", "FileDeltas", "Recorder")

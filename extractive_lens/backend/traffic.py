"""The Δ traffic counter: the bytes of Δ a scoring call brings to where the pieces run.

>>> import extractive_lens as el
>>> from extractive_lens.backend import shift
>>> with shift.counting() as moved:
...     _ = el.linear_scores(model, diff, batch, show_progress=False)
>>> moved.bytes > 0
True

Every read of Δ while scoring is counted here, once per read (``backend/shift.py`` reads them:
a layer's load, a vocabulary matrix's part, a tensor read on its own); the figure is what a GPU
run with Δ on the host moves over the bus, counted alike on the CPU.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections import Counter
from collections.abc import Iterator
from typing import Any

from torch import Tensor

from extractive_lens.backend.lazy import LazyDeltas
from extractive_lens.backend.lowrank import LowRankDeltas

Group = int | str
"""Where a stored tensor runs: a block's index, ``shift.EMBED`` or ``shift.UNEMBED``."""


class Traffic:
    """What a scoring call inside ``counting()`` reads of Δ: ``bytes`` brought to where the
    pieces run (moved to the device on a GPU; on the CPU the same reads, counted alike), in
    ``loads`` layer loads and the tensors read on their own (``reads``). A layer's Δ read twice
    counts twice: the figure is what a GPU run with Δ on the host would move over the bus. For
    a diff formed on demand (``lazy.LazyDeltas``) it is the finetuned tensors' bytes in
    their stored dtype (bf16: half a float32 Δ), which cross to be subtracted where the base
    weights are; a Δ held in memory counts its own bytes (its factors, for a low-rank one)."""

    def __init__(self) -> None:
        self.bytes = 0
        self.loads = 0
        self.by_group: Counter[Group] = Counter()  # layer loads by group (a block, EMBED, UNEMBED)
        # tensors read outside a layer load, by TransformerLens name, in whole tensors (a part
        # of a vocabulary matrix as its share)
        self.reads: dict[str, float] = {}

    def __repr__(self) -> str:
        return f"Traffic({self.bytes / 2**20:.1f} MiB in {self.loads} layer loads)"


_TRAFFIC: contextvars.ContextVar[Traffic | None] = contextvars.ContextVar(
    "extractive_lens_traffic", default=None
)


def count(n: int, name: str | None = None, share: float = 1.0) -> None:
    """Count ``n`` bytes read (``name``: a tensor read outside a layer load, ``share`` of it)."""
    traffic = _TRAFFIC.get()
    if traffic is None:
        return
    traffic.bytes += n
    if name is not None:
        traffic.reads[name] = traffic.reads.get(name, 0.0) + share


def count_load(g: Group) -> None:
    """Count a load of group ``g``'s Δ (its bytes are counted tensor by tensor)."""
    traffic = _TRAFFIC.get()
    if traffic is not None:
        traffic.loads += 1
        traffic.by_group[g] += 1


def formed(deltas: Any, name: str) -> tuple[Tensor, int]:
    """``deltas[name]`` and the bytes read to form it (``Traffic``)."""
    if isinstance(deltas, LazyDeltas):
        return deltas.formed(name)
    d = deltas[name]
    return d, nbytes(d)


def read_where_held(deltas: Any, name: str) -> Tensor:
    """``deltas[name]`` where the diff holds or forms it (``WeightDiff.norms``): counted for a
    diff formed on demand, whose finetuned tensor crosses to where the base weight is to be
    subtracted; a Δ held in memory is read in place (nothing moves)."""
    if isinstance(deltas, LazyDeltas):
        d, moved = deltas.formed(name)
        count(moved, name)
        return d
    return deltas[name]


@contextlib.contextmanager
def counting() -> Iterator[Traffic]:
    """Count the Δ bytes read inside the block (``Traffic``; module docstring)."""
    traffic = Traffic()
    token = _TRAFFIC.set(traffic)
    try:
        yield traffic
    finally:
        _TRAFFIC.reset(token)


def nbytes(t: Any) -> int:
    return int(t.numel()) * int(t.element_size())


def factor_bytes(deltas: LowRankDeltas, name: str) -> int:
    """Bytes of ``name``'s factors and dense part (what moves to form its Δ on the device)."""
    d = deltas.dense.get(name)
    return deltas.factors[name].nbytes() + (0 if d is None else nbytes(d))


class CountedReads:
    """A diff formed on demand whose reads (``get``) are counted (``shift.Shift._whole_of``)."""

    def __init__(self, deltas: LazyDeltas) -> None:
        self.deltas = deltas

    def get(self, name: str) -> Tensor | None:
        if name not in self.deltas:
            return None
        d, moved = self.deltas.formed(name)
        count(moved, name)
        return d

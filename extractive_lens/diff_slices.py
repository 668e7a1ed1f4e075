"""Δ read by the ownership partition (docs/scores.md §2): the slices kept by a restriction, and
each component's norm, from one read of each tensor (a purely low-rank tensor's from its factors).

``WeightDiff.restricted``, ``norms``, ``other_norm`` and ``norm`` are these functions on the
diff's tensors; they take Δ's mapping and its slices, and import nothing of ``weight_diff``.

>>> sum_of_squares(torch.tensor([[3.0], [4.0]]), chunk=1)
25.0
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from extractive_lens import backend as B
from extractive_lens.backend import lowrank, traffic
from extractive_lens.backend.lowrank import LowRankDeltas
from extractive_lens.types import Component


def restricted_dense(
    deltas: Mapping[str, Tensor],
    slices: list[B.ParamSlice],
    comps: Sequence[Component] | None,
    layer_set: set[int] | None,
) -> dict[str, Tensor]:
    """Δ's slices owned by ``comps`` under ``layer_set``; the rest of a kept tensor zero."""
    keep: dict[str, Tensor] = {}
    for s in slices:
        if layer_set is not None and B.layer_of(s.name) not in layer_set:
            continue
        if comps is not None and not set(s.owners) & set(comps):
            continue
        d = deltas[s.name]
        if s.name not in keep:
            keep[s.name] = torch.zeros_like(d)
        if s.index is None:
            keep[s.name] = d.clone()
        else:
            keep[s.name][s.index] = d[s.index]
    return keep


def restricted_low_rank(
    deltas: LowRankDeltas,
    slices: list[B.ParamSlice],
    comps: Sequence[Component] | None,
    layer_set: set[int] | None,
) -> LowRankDeltas:
    """``restricted`` on the factors: each kept head or key/value group a masked copy of
    one factor (still rank r); dense parts sliced as ever."""
    n_slices = {s.name: 0 for s in slices}
    kept: dict[str, list[int | None]] = {}
    for s in slices:
        n_slices[s.name] += 1
        if layer_set is not None and B.layer_of(s.name) not in layer_set:
            continue
        if comps is not None and not set(s.owners) & set(comps):
            continue
        kept.setdefault(s.name, []).append(s.index)
    factors, dense = {}, {}
    for name, idx in kept.items():
        f, d = deltas.factors.get(name), deltas.dense.get(name)
        whole = None in idx or len(idx) == n_slices[name]
        if f is not None:
            parts = [f] if whole else [lowrank.restricted_factor(f, i, n_slices[name])
                                       for i in idx]  # fmt: skip
            factors[name] = lowrank.combined(parts)
        if d is not None:
            dense[name] = d.clone() if whole else torch.zeros_like(d)
            if not whole:
                for i in idx:
                    dense[name][i] = d[i]
    return LowRankDeltas(factors, dense)


def norms_and_fingerprint(
    deltas: Mapping[str, Tensor],
    slices: list[B.ParamSlice],
    n_layers: int,
    n_heads: int,
    mlp: bool,
) -> tuple[Tensor, float, dict[str, list[float]]]:
    """The norms (per component, and "other") and the content fingerprint, from one read of
    each tensor (a purely low-rank one's from its factors)."""
    from extractive_lens import fingerprint

    sq = torch.zeros(n_layers, n_heads + int(mlp), dtype=torch.float64)
    other = 0.0
    by_name: dict[str, list[B.ParamSlice]] = {n: [] for n in deltas}
    for s in slices:
        by_name.setdefault(s.name, []).append(s)
    prints: dict[str, list[float]] = {}
    for name, parts in by_name.items():
        d = None if factored(deltas, name) else traffic.read_where_held(deltas, name)
        prints[name] = fingerprint.of_delta(deltas, name, d)
        for s in parts:  # each tensor read once for all its slices
            v = part_sum_of_squares(deltas, name, s.index, len(parts), d)
            if not s.owners:
                other += v
            for c in s.owners:
                sq[c.layer, n_heads if c.head is None else c.head] += v
    return sq.sqrt(), other**0.5, prints


def factored(deltas: Mapping[str, Tensor], name: str) -> bool:
    """Whether ``name``'s Δ is purely low-rank (its norms come from the factors)."""
    return isinstance(deltas, LowRankDeltas) and name in deltas.factors and name not in deltas.dense


def part_sum_of_squares(
    deltas: Mapping[str, Tensor],
    name: str,
    index: int | None = None,
    n: int = 1,
    d: Tensor | None = None,
) -> float:
    """``‖Δ[name][index]‖²`` (``d``: Δ[name] already read); from the factors of a purely
    low-rank tensor."""
    if factored(deltas, name):
        assert isinstance(deltas, LowRankDeltas)
        return lowrank.sum_of_squares(deltas.factors[name], index, n)
    d = deltas[name] if d is None else d
    return sum_of_squares(d if index is None else d[index])


def sum_of_squares(t: Tensor, chunk: int = 2**22) -> float:
    """Σ t² in float64, a slice of rows at a time (an 8B model's embedding Δ in float64 would
    be 4 GiB, twice over with its square)."""
    if t.ndim == 0:
        return float(t.detach().double() ** 2)
    rows = max(1, chunk // max(1, t[0].numel()))
    return float(sum(float(c.double().pow(2).sum()) for c in t.detach().split(rows)))

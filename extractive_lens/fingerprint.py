"""A content fingerprint of a weight change: which Δ a result was computed for.

Per tensor of Δ, ``PROBES`` seeded projections ``⟨Δ, a₀ ⊗ a₁ ⊗ …⟩`` (one Gaussian vector per
axis, seeded by the tensor's name and shape, so two diffs of one architecture are probed alike)
and ``‖Δ‖``, in float64. Rows swapped, a sign flipped, another scale or another finetune change
a projection by about ``‖Δ‖`` (its standard deviation over the probes), where equal contents
agree to rounding; norms alone miss the first two. Reading a tensor once, a slice of rows at a
time, and for a low-rank change its factors only (``aᵀ L · R b``): nothing of Δ's size is formed
beyond what reading a tensor of an on-demand or checkpoint diff forms anyway.

>>> import torch
>>> d = {"w": torch.tensor([[1.0, 2.0], [3.0, 4.0]])}
>>> differs(fingerprint(d), fingerprint({"w": d["w"].flip(0)}))   # rows swapped: same norm
'w'
>>> differs(fingerprint(d), fingerprint({"w": d["w"].clone()})) is None
True
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from extractive_lens.backend.lowrank import LowRank, LowRankDeltas

PROBES = 2
"""Projections per tensor."""

TOLERANCE = 1e-5
"""Two projections of one tensor agree when they differ by at most this times its ``‖Δ‖``
(float32 rounding of the same Δ formed another way, e.g. a LoRA's factors and their merged
product, is about 1e-7 of it; another Δ differs by about ``‖Δ‖``)."""


def fingerprint(deltas: Mapping[str, Any]) -> dict[str, list[float]]:
    """``{name: [projection, …, ‖Δ‖]}`` for every tensor of ``deltas`` (a ``WeightDiff``'s)."""
    return {name: of_delta(deltas, name) for name in deltas}


def of_delta(deltas: Mapping[str, Any], name: str, read: Tensor | None = None) -> list[float]:
    """One tensor's: from its factors where it is purely low-rank, else of the tensor (``read``:
    the tensor already read; a factor plus a dense part is formed once)."""
    if isinstance(deltas, LowRankDeltas) and name in deltas.factors and name not in deltas.dense:
        return of_factors(name, deltas.factors[name])
    return of_tensor(name, deltas[name] if read is None else read)


def differs(mine: Mapping[str, Any], theirs: Mapping[str, Any]) -> str | None:
    """The first tensor whose content differs between two fingerprints (a tensor one of them
    lacks counts as zero there), or ``None`` where they are of the same Δ."""
    for name in sorted(set(mine) | set(theirs)):
        a, b = mine.get(name), theirs.get(name)
        a = [0.0] * (PROBES + 1) if a is None else a
        b = [0.0] * (PROBES + 1) if b is None else b
        if len(a) != len(b):
            return name
        scale = max(abs(a[-1]), abs(b[-1]))
        if any(abs(x - y) > TOLERANCE * scale for x, y in zip(a, b)):
            return name
    return None


def _probes(name: str, shape: tuple[int, ...]) -> list[list[Tensor]]:
    """``PROBES`` lists of one float64 Gaussian vector per axis, seeded by name and shape."""
    key = hashlib.blake2b(f"{name}|{shape}".encode(), digest_size=8).digest()
    g = torch.Generator().manual_seed(int.from_bytes(key, "little") >> 1)
    return [[torch.randn(n, generator=g, dtype=torch.float64) for n in shape]
            for _ in range(PROBES)]  # fmt: skip


def _kron(vectors: list[Tensor]) -> Tensor:
    out = torch.ones(1, dtype=torch.float64)
    for v in vectors:
        out = torch.kron(out, v)
    return out


def of_tensor(name: str, d: Tensor, chunk: int = 2**22) -> list[float]:
    """The projections and norm of one tensor ``name`` of Δ, a slice of rows at a time."""
    d = d.detach()
    shape = tuple(d.shape)
    if d.ndim == 0:
        v = float(d.double())
        return [v] * PROBES + [abs(v)]
    probes = _probes(name, shape)
    rows = [p[0].to(d.device) for p in probes]
    rest = torch.stack([_kron(p[1:]) for p in probes], dim=1).to(d.device)  # [numel/rows, PROBES]
    flat = d.reshape(shape[0], -1)
    step = max(1, chunk // max(1, flat.shape[1]))
    sums, sq = torch.zeros(PROBES, dtype=torch.float64, device=d.device), 0.0
    for i in range(0, shape[0], step):
        c = flat[i : i + step].double()
        sq += float(c.pow(2).sum())
        sums += torch.stack([r[i : i + step] for r in rows], dim=1).mul(c @ rest).sum(0)
    return [*sums.cpu().tolist(), math.sqrt(sq)]


def of_factors(name: str, f: LowRank) -> list[float]:
    """``of_tensor`` of a low-rank change, from its factors: ``Δ = to_layout(L R)``, so a probe of Δ's axes is
    ``xᵀ (L R) y`` with ``x``, ``y`` the probe's vectors on the product's rows and columns."""
    from extractive_lens.backend.lowrank import sum_of_squares

    left, right = f.left.detach().double(), f.right.detach().double()
    out = []
    for a in _probes(name, f.shape):
        if f.layout == "heads_out":  # [head, in, d_head] from [in, (head d_head)]
            x, y = a[1], _kron([a[0], a[2]])
        elif f.layout == "heads_in":  # [head, d_head, out] from [(head d_head), out]
            x, y = _kron([a[0], a[1]]), a[2]
        elif f.layout == "transposed":  # [out, in] from [in, out]
            x, y = a[1], a[0]
        else:
            x, y = a[0], a[1]
        out.append(float((x.to(left.device) @ left) @ (right @ y.to(right.device))))
    return [*out, math.sqrt(sum_of_squares(f))]

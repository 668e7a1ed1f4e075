"""Low-rank weight changes: ``Δ = left @ right`` laid out as a TransformerLens parameter.

A LoRA adapter changes a weight by ``scale · B @ A``; ``WeightDiff.from_peft`` keeps the
factors (``LowRank``) instead of that product. In the TransformerLens orientation (``x @ W``,
input dimension first) the change of a projection is ``left @ right`` with ``left = scale·Aᵀ``
``[in, r]`` and ``right = Bᵀ`` ``[r, out]``, rearranged to the parameter's shape:

>>> import torch
>>> f = LowRank(torch.ones(6, 1), torch.arange(4.0)[None], "heads_out", n_heads=2)
>>> f.shape, f.dense()[1, 0].tolist()      # W_Q-like: [head, d_model, d_head]
((2, 6, 2), [2.0, 3.0])

``LowRankDeltas`` is the ``deltas`` mapping of such a diff: reading a name forms that one dense
tensor (the low-rank part plus any dense part: biases, ``modules_to_save``), nothing is kept.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Literal

import einops
import torch
from torch import Tensor

Layout = Literal["plain", "heads_out", "heads_in", "transposed"]
"""How ``left @ right`` (``[in, out]``) becomes the parameter: as it is (``W_in``, ``W_out``,
``W_E``, ``W_U``), ``in (head d_head) -> head in d_head`` (``W_Q W_K W_V``), ``(head d_head)
out -> head d_head out`` (``W_O``), or transposed (the unembedding tied to an adapted
embedding: bit for bit the transpose of the embedding's change)."""


@dataclass(frozen=True)
class LowRank:
    """``Δ = rearrange(left @ right, layout)``: ``left`` ``[in, r]`` (the scale folded in),
    ``right`` ``[r, out]``; ``n_heads`` splits the head axis of the ``heads_*`` layouts."""

    left: Tensor
    right: Tensor
    layout: Layout = "plain"
    n_heads: int = 1

    def __post_init__(self) -> None:
        if self.left.ndim != 2 or self.right.ndim != 2 or self.left.shape[1] != self.right.shape[0]:
            raise ValueError(
                f"Low-rank factors must be [in, r] and [r, out], got {tuple(self.left.shape)} and "
                f"{tuple(self.right.shape)}."
            )
        side = self.right.shape[1] if self.layout == "heads_out" else self.left.shape[0]
        if self.layout.startswith("heads") and side % self.n_heads:
            raise ValueError(f"{side} does not split into {self.n_heads} heads.")

    @property
    def rank(self) -> int:
        return int(self.left.shape[1])

    @property
    def shape(self) -> tuple[int, ...]:
        i, o, h = int(self.left.shape[0]), int(self.right.shape[1]), self.n_heads
        if self.layout == "heads_out":
            return (h, i, o // h)
        if self.layout == "heads_in":
            return (h, i // h, o)
        return (o, i) if self.layout == "transposed" else (i, o)

    @property
    def dtype(self) -> torch.dtype:
        return torch.promote_types(self.left.dtype, self.right.dtype)

    @property
    def device(self) -> torch.device:
        return self.left.device

    def dense(self) -> Tensor:
        """The change as an ordinary tensor of the parameter's shape."""
        m = self.left.to(self.dtype) @ self.right.to(device=self.left.device, dtype=self.dtype)
        return to_layout(m, self.layout, self.n_heads)

    def to(self, device: str | torch.device | None = None, dtype: torch.dtype | None = None
           ) -> LowRank:  # fmt: skip
        return LowRank(
            self.left.to(device=device, dtype=dtype),
            self.right.to(device=device, dtype=dtype),
            self.layout,
            self.n_heads,
        )

    def scaled(self, alpha: float) -> LowRank:
        return LowRank(alpha * self.left, self.right, self.layout, self.n_heads)

    def nbytes(self) -> int:
        return self.left.numel() * self.left.element_size() + (
            self.right.numel() * self.right.element_size()
        )


def to_layout(m: Tensor, layout: Layout, n_heads: int) -> Tensor:
    """An ``[in, out]`` matrix as the parameter (see ``Layout``)."""
    if layout == "heads_out":
        return einops.rearrange(m, "i (head d_head) -> head i d_head", head=n_heads)
    if layout == "heads_in":
        return einops.rearrange(m, "(head d_head) o -> head d_head o", head=n_heads)
    return m.T if layout == "transposed" else m


class LowRankDeltas(Mapping[str, Tensor]):
    """The ``deltas`` of a low-rank diff: per TransformerLens name, ``factors[name].dense()``
    plus ``dense[name]`` (either may be absent), formed when read and not kept."""

    def __init__(self, factors: Mapping[str, LowRank], dense: Mapping[str, Tensor]) -> None:
        self.factors, self.dense = dict(factors), dict(dense)
        self.names = list(dict.fromkeys([*self.factors, *self.dense]))
        for name, f in self.factors.items():
            d = self.dense.get(name)
            if d is not None and tuple(d.shape) != f.shape:
                raise ValueError(f"{name}: dense part {tuple(d.shape)} != low-rank {f.shape}.")
            if not (torch.isfinite(f.left).all() and torch.isfinite(f.right).all()):
                raise ValueError(f"Δ[{name}]: the low-rank factors contain NaN or inf.")

    def __getitem__(self, name: str) -> Tensor:
        f, d = self.factors.get(name), self.dense.get(name)
        if f is None and d is None:
            raise KeyError(name)
        if f is None:
            assert d is not None
            return d
        out = f.dense()
        return out if d is None else out + d.to(device=out.device, dtype=out.dtype)

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)

    def shape(self, name: str) -> tuple[int, ...]:
        f = self.factors.get(name)
        return f.shape if f is not None else tuple(self.dense[name].shape)

    def nbytes(self) -> int:
        """Bytes the factors and dense parts hold (a factor shared by several names once)."""
        seen: dict[int, int] = {}
        for f in self.factors.values():
            for t in (f.left, f.right):
                seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        for t in self.dense.values():
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return sum(seen.values())

    def map(self, fn_factor, fn_dense) -> LowRankDeltas:  # type: ignore[no-untyped-def]
        return LowRankDeltas(
            {n: fn_factor(f) for n, f in self.factors.items()},
            {n: fn_dense(d) for n, d in self.dense.items()},
        )

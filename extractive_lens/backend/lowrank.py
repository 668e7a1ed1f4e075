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
from typing import Any, Literal

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

    def added_to(self, w: Tensor, alpha: float, dtype: torch.dtype) -> Tensor:
        """``w + alpha·Δ`` in ``dtype``, as one ``addmm`` / ``baddbmm`` (per head): the product
        ``left @ right`` is never a tensor of its own."""
        L, R, h = (
            self.left.to(dtype),
            self.right.to(device=self.left.device, dtype=dtype),
            self.n_heads,
        )
        w = w.detach().to(dtype)
        if self.layout == "heads_out":  # w [head, in, d_head] += L @ R[:, head]
            r_h = einops.rearrange(R, "r (head d_head) -> head r d_head", head=h)
            return torch.baddbmm(w, L.expand(h, -1, -1), r_h, alpha=alpha)
        if self.layout == "heads_in":  # w [head, d_head, out] += L[head] @ R
            l_h = einops.rearrange(L, "(head d_head) r -> head d_head r", head=h)
            return torch.baddbmm(w, l_h, R.expand(h, -1, -1), alpha=alpha)
        if self.layout == "transposed":
            return torch.addmm(w, R.T, L.T, alpha=alpha)
        return torch.addmm(w, L, R, alpha=alpha)

    def apply(self, x: Tensor) -> Tensor:
        """``x @ Δ`` as the parameter multiplies its input, as ``(x @ left) @ right``: never
        ``left @ right``. ``plain``: ``[..., in] -> [..., out]``; ``heads_out`` (``W_Q``):
        ``[..., in] -> [..., head, d_head]``; ``heads_in`` (``W_O``): ``[..., head, d_head] ->
        [..., out]``; ``transposed``: ``[..., out] -> [..., in]``. In ``x``'s dtype.

        >>> f = LowRank(torch.ones(6, 1), torch.arange(4.0)[None], "heads_out", n_heads=2)
        >>> torch.equal(f.apply(torch.ones(3, 6)), torch.einsum("pd,hde->phe", torch.ones(3, 6), f.dense()))
        True
        """
        L, R = self.left.to(x.dtype), self.right.to(device=self.left.device, dtype=x.dtype)
        if self.layout == "transposed":
            return (x @ R.T) @ L.T
        if self.layout == "heads_in":
            x = einops.rearrange(x, "... head d_head -> ... (head d_head)")
        out = (x @ L) @ R
        if self.layout == "heads_out":
            return einops.rearrange(out, "... (head d_head) -> ... head d_head", head=self.n_heads)
        return out

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

    def formed_on(self, name: str, device: str | torch.device | None) -> Tensor:
        """``self[name]`` formed on ``device`` (``None``: where it is held): the factors moved
        there first, so only they cross the bus (a TransformerBridge's Δ, one layer at a
        time)."""
        f, d = self.factors.get(name), self.dense.get(name)
        if f is None:
            return self[name] if device is None else self[name].to(device)
        out = (f if device is None else f.to(device)).dense()
        return out if d is None else out + d.to(device=out.device, dtype=out.dtype)

    def __contains__(self, name: object) -> bool:  # Mapping's would form the tensor
        return name in self.factors or name in self.dense

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


def low_rank_factors(
    deltas: Mapping[str, Tensor], backend: Any, *, any_backend: bool = False
) -> dict[str, LowRank]:
    """The names whose Δ a shifted piece of this backend's model can take as factors: a
    low-rank diff's purely low-rank tensors on a model whose stored parameters are the
    TransformerLens ones (``HookedTransformer``); none elsewhere (a TransformerBridge stores the
    Hugging Face weights: ``shift`` asks its ``raw_low_rank`` for the factors of each stored
    weight, and forms Δ, one layer at a time on the device, where there are none).
    ``any_backend``: for a TransformerLens view any backend gives (``W_O``)."""
    if not isinstance(deltas, LowRankDeltas):
        return {}
    if not any_backend and backend.NAME != "hooked_transformer":
        return {}
    return {n: f for n, f in deltas.factors.items() if n not in deltas.dense}


# ---------------------------------------------------------------------------------------------
# The diff's algebra, norms and files, on the factors (``WeightDiff`` calls these for a
# ``LowRankDeltas``; anything else keeps its dense path)
# ---------------------------------------------------------------------------------------------


def restricted_factor(f: LowRank, index: int | None, n_slices: int) -> LowRank:
    """The part of ``f`` in slice ``index`` of ``n_slices`` along the parameter's first axis
    (a head, a key/value group; ``None``: all of it), zero elsewhere: a mask on one factor."""
    if index is None:
        return f
    if f.layout == "heads_out":  # the slice's columns of right
        mask = torch.zeros(f.right.shape[1], dtype=f.right.dtype, device=f.right.device)
        width = f.right.shape[1] // n_slices
        mask[index * width : (index + 1) * width] = 1
        return LowRank(f.left, f.right * mask, f.layout, f.n_heads)
    if f.layout == "heads_in":  # the slice's rows of left
        mask = torch.zeros(f.left.shape[0], 1, dtype=f.left.dtype, device=f.left.device)
        width = f.left.shape[0] // n_slices
        mask[index * width : (index + 1) * width] = 1
        return LowRank(f.left * mask, f.right, f.layout, f.n_heads)
    raise ValueError(f"A {f.layout} low-rank change has no per-head slices.")


def combined(parts: list[LowRank]) -> LowRank:
    """One factor pair for a sum of changes of the same layout: ranks add (``[L1 L2]``,
    ``[R1; R2]``)."""
    first = parts[0]
    if len(parts) == 1:
        return first
    dt = parts[0].dtype
    for p in parts[1:]:
        dt = torch.promote_types(dt, p.dtype)
    left = torch.cat([p.left.to(device=first.device, dtype=dt) for p in parts], dim=1)
    right = torch.cat([p.right.to(device=first.device, dtype=dt) for p in parts], dim=0)
    return LowRank(left, right, first.layout, first.n_heads)


def sum_of_squares(f: LowRank, index: int | None = None, n_slices: int = 1) -> float:
    """``‖Δ[index]‖²`` from the factors: ``Σ (LᵀL) ⊙ (RRᵀ)`` (two ``r × r`` Gram matrices), in
    float64, never forming ``L @ R``."""
    g = restricted_factor(f, index, n_slices)
    L, R = g.left.double(), g.right.double().to(g.left.device)
    return float(((L.T @ L) * (R @ R.T)).sum().clamp(min=0))


def summed(a: LowRankDeltas, b: LowRankDeltas, sign: float) -> LowRankDeltas:
    """``a + sign·b`` keeping factors: a name low-rank in both gets both factor pairs (ranks
    add) where their layouts agree; dense parts add."""
    factors: dict[str, LowRank] = {}
    for n in dict.fromkeys([*a.factors, *b.factors]):
        fa, fb = a.factors.get(n), b.factors.get(n)
        fb = None if fb is None else fb.scaled(sign)
        got = [f for f in (fa, fb) if f is not None]
        if len(got) == 2 and got[0].layout != got[1].layout:
            raise ValueError(f"{n}: the two low-rank changes are laid out differently.")
        factors[n] = combined(got)
    dense: dict[str, Tensor] = {}
    for n in dict.fromkeys([*a.dense, *b.dense]):
        da, db = a.dense.get(n), b.dense.get(n)
        if da is None:
            assert db is not None
            dense[n] = sign * db
        elif db is None:
            dense[n] = da.clone()
        else:
            dt = torch.promote_types(da.dtype, db.dtype)
            dense[n] = da.to(dt) + sign * db.to(device=da.device, dtype=dt)
    return LowRankDeltas(factors, dense)


FILE_KEYS = ("left", "right", "dense")


def to_file(deltas: LowRankDeltas) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """Tensors (``name::left``, ``name::right``, ``name::dense``) and a layout table for a
    ``.safetensors`` file; factors shared by several names (GPT-2's fused ``c_attn``) are
    written once per name."""
    tensors: dict[str, Tensor] = {}
    layout: dict[str, Any] = {}
    for n, f in deltas.factors.items():
        tensors[f"{n}::left"] = f.left.detach().cpu().clone()
        tensors[f"{n}::right"] = f.right.detach().cpu().clone()
        layout[n] = {"layout": f.layout, "n_heads": f.n_heads}
    for n, d in deltas.dense.items():
        tensors[f"{n}::dense"] = d.detach().cpu().contiguous()
    return tensors, layout


def from_file(tensors: Mapping[str, Tensor], layout: Mapping[str, Any]) -> LowRankDeltas:
    """``to_file`` read back (a clear error for a damaged file)."""
    factors, dense = {}, {}
    for key in tensors:
        name, _, part = key.rpartition("::")
        if part not in FILE_KEYS or not name:
            raise ValueError(f"{key!r} is not a low-rank diff's tensor.")
        if part == "dense":
            dense[name] = tensors[key]
    for name, spec in layout.items():
        try:
            factors[name] = LowRank(
                tensors[f"{name}::left"], tensors[f"{name}::right"], spec["layout"],
                int(spec["n_heads"]),
            )  # fmt: skip
        except KeyError as e:
            raise ValueError(f"the low-rank factors of {name} are incomplete ({e}).") from None
    return LowRankDeltas(factors, dense)


def primal(x: Tensor) -> Tensor:
    """``x`` without its forward-mode tangent (``x`` itself outside ``jvp``)."""
    import torch.autograd.forward_ad as fwAD

    return fwAD.unpack_dual(x).primal


def tangent_only(u: Tensor) -> Tensor:
    """A tensor whose value is 0 and whose forward-mode tangent is ``u``: added to a piece's
    output, it adds ``u`` to the derivative and nothing to the value."""
    import torch.autograd.forward_ad as fwAD

    return fwAD.make_dual(torch.zeros_like(u), u)

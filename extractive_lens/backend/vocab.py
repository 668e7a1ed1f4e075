"""The embedding and the unembedding read a part of the vocabulary at a time.

At Llama 3's vocabulary (128256 × 4096) the embedding's and the unembedding's ``W + αΔ`` are
2 GiB each in float32. For a vocabulary matrix larger than ``SLICE_BYTES`` (in float32) a
backend that names its vocabulary matrices (``vocab_matrices``) never forms it whole:

- the embedding gathers the rows of the batch's tokens, ``W_E[tokens] + α·Δ_E[tokens]``
  (``rows``), upcast only there;
- the unembedding computes ``x @ (W_U[:, s] + α·Δ_U[:, s])`` for ``COLUMNS`` columns ``s`` at a
  time (``logits``), each slice formed and dropped, in the backward pass too (``_Logits``).

A backend names each matrix by its TransformerLens name and says whether it stores it as that
name's transpose (a ``TransformerBridge`` stores Hugging Face's ``lm_head.weight``, ``[d_vocab,
d_model]``, whose transpose is ``unembed.W_U``; GPT-2's is the embedding's own, tied): the parts
are taken along the stored matrix's vocabulary axis, and Δ (in TransformerLens names) is read
as a transposed view where the layouts differ, never copied whole.

Δ of these matrices is read a part at a time as well (``shift.Shift.part``), and under
forward-mode differentiation (``compute.jvp``) their tangent is taken per part: the rows or
columns of Δ (``Tangent``: a function reading that part, so that only it moves, counted). The parts add ``W`` and ``αΔ`` element by element as ``Shift.value`` does, so
the numbers are those of the whole matrix.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from extractive_lens.backend.lowrank import LowRank

SLICE_BYTES = 2**28
"""A vocabulary matrix larger than this in float32 (256 MiB; GPT-2's 50257 × 768 is 154 MB,
Llama 3's 128256 × 4096 is 2 GiB) is read a part at a time."""

COLUMNS = 16384
"""Columns of the unembedding per slice (256 MiB in float32 at ``d_model`` 4096)."""

Tangent = Tensor | LowRank | Callable[[int, Any], "Tensor | LowRank | None"]
"""A vocabulary matrix's tangent: whole (dense or low-rank), or a function of ``(dim, index)``
reading that part of it (``shift.Shift.tangents``)."""


def named(model: Any) -> dict[str, tuple[Tensor, bool]]:
    """The vocabulary matrices ``model``'s backend reads a part at a time when large, by
    TransformerLens name: ``(stored tensor, stored as the name's transpose)``. Tied names
    (GPT-2's ``embed.W_E`` and ``unembed.W_U`` on a bridge) give the same stored tensor."""
    from extractive_lens import backend as B

    found = getattr(B.backend_for(model), "vocab_matrices", None)
    return {} if found is None else found(model)


def matrices(model: Any) -> tuple[Tensor, ...]:
    """The vocabulary matrices of ``model`` that its backend reads a part at a time."""
    out: list[Tensor] = []
    for p, _ in named(model).values():
        if p.numel() * 4 > SLICE_BYTES and not any(p is q for q in out):
            out.append(p)
    return tuple(out)


def by_part(model: Any, p: Tensor) -> bool:
    """Whether the stored tensor ``p`` is read a part at a time."""
    return any(p is q for q in matrices(model))


def rows(p: Tensor, index: Tensor, dtype: torch.dtype, s: Any, t: Tangent | None
         ) -> Tensor:  # fmt: skip
    """``(W + α·Δ)[index]`` for the stored ``[d_vocab, d_model]`` matrix ``p``, in ``dtype``,
    under the shift ``s`` (``shift.active(p)``; ``None``: W), with the tangent ``t[index]``
    where ``t`` is given (``compute.deferred_tangent(p)``: inside ``compute.jvp``)."""
    out = _part(p, s, dtype, 0, index)
    part = None if t is None else _tangent_part(t, 0, index)
    if part is not None:
        import torch.autograd.forward_ad as fwAD

        if isinstance(part, LowRank):  # the rows of a low-rank tangent: its left factor's rows
            d = part.left.to(dtype) @ part.right.to(device=part.left.device, dtype=dtype)
        else:
            d = part
        out = fwAD.make_dual(out, d.to(device=out.device, dtype=dtype))
    return out


def logits(p: Tensor, x: Tensor, dtype: torch.dtype, s: Any, t: Tangent | None,
           dim: int = 1) -> Tensor:  # fmt: skip
    """``x @ (W + α·Δ)`` for the stored ``[d_model, d_vocab]`` matrix ``p`` (``dim=0``: stored
    ``[d_vocab, d_model]``, ``x @ (W + α·Δ)ᵀ``), ``COLUMNS`` vocabulary entries at a time
    (``s``, ``t``: as for ``rows``, in ``p``'s layout; the tangent is ``x @ t``, per slice)."""
    import torch.autograd.forward_ad as fwAD

    n = int(p.shape[dim])
    if torch.is_grad_enabled() and x.requires_grad and t is None:
        return _Logits.apply(x, p, s, dtype, dim)
    parts = []
    for a in range(0, n, COLUMNS):
        cols = slice(a, min(a + COLUMNS, n))
        w = _columns(_part(p, s, dtype, dim, cols), dim)
        part = None if t is None else _tangent_part(t, dim, cols)  # in p's layout
        if isinstance(part, LowRank):  # the tangent x @ Δ[:, cols] as (x L) R[:, cols]
            from extractive_lens.backend.lowrank import primal, tangent_only

            part = part if dim == 1 else _transposed(part)
            u = part.to(w.device).apply(primal(x))
            parts.append(x @ w + tangent_only(u))
            continue
        if part is not None:
            d = part if dim == 1 else part.T
            w = fwAD.make_dual(w, d.to(device=w.device, dtype=dtype))
        parts.append(x @ w)
    return torch.cat(parts, -1)


def _columns(w: Tensor, dim: int) -> Tensor:
    """A slice of the unembedding as ``[d_model, part]`` (a view of the stored layout)."""
    return w if dim == 1 else w.T


def _transposed(d: LowRank) -> LowRank:
    """The low-rank change ``dᵀ``: the same factors, the other layout."""
    from dataclasses import replace

    if d.layout not in ("plain", "transposed"):
        raise ValueError(f"a vocabulary matrix's low-rank change has layout {d.layout!r}")
    return replace(d, layout="transposed" if d.layout == "plain" else "plain")


class _Logits(torch.autograd.Function):
    """``x @ (W + α·Δ)`` by slices of columns; the backward pass forms each slice again
    (``dx = Σ_s g[..., s] @ (W + αΔ)[:, s]ᵀ``) and saves no weight."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, p: Tensor, s: Any, dtype: torch.dtype, dim: int) -> Tensor:
        n = int(p.shape[dim])
        out = x.new_empty((*x.shape[:-1], n), dtype=dtype)
        for a in range(0, n, COLUMNS):
            cols = slice(a, min(a + COLUMNS, n))
            torch.matmul(x, _columns(_part(p, s, dtype, dim, cols), dim), out=out[..., cols])
        ctx.p, ctx.s, ctx.dtype, ctx.dim, ctx.version = p, s, dtype, dim, p._version
        return out

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor | None, None, None, None, None]:
        p, s, dtype, dim = ctx.p, ctx.s, ctx.dtype, ctx.dim
        if p._version != ctx.version:
            raise RuntimeError(
                "A weight changed between the forward and backward pass of a scoring run."
            )
        n = int(p.shape[dim])
        dx = None
        for a in range(0, n, COLUMNS):
            cols = slice(a, min(a + COLUMNS, n))
            part = g[..., cols] @ _columns(_part(p, s, dtype, dim, cols), dim).T
            dx = part if dx is None else dx.add_(part)
        return dx, None, None, None, None


def _part(p: Tensor, s: Any, dtype: torch.dtype, dim: int, index: Tensor | slice) -> Tensor:
    """``(p + α·Δ)`` restricted to ``index`` along ``dim``, in ``dtype`` (``s``: the shift in
    force, or ``None``)."""
    take = (lambda t: t[index]) if dim == 0 else (lambda t: t[:, index])
    w = take(p.detach())
    d = None if s is None else s.part(p, dim, index)
    if d is None:
        return w.to(dtype)
    wide = torch.promote_types(torch.promote_types(p.dtype, d.dtype), dtype)
    if isinstance(d, LowRank):
        return d.added_to(w, s.alpha, wide).to(dtype)
    # as Shift.value: αΔ in Δ's dtype, widened, then W added (the same rounding, element-wise)
    out = (d if s.alpha == 1.0 else s.alpha * d).to(device=w.device, dtype=wide, copy=True)
    return out.add_(w).to(dtype)


def _tangent_part(t: Tangent, dim: int, index: Tensor | slice) -> Tensor | LowRank | None:
    """The tangent ``t`` restricted to ``index`` along ``dim`` (``None``: zero)."""
    if isinstance(t, LowRank):
        return restricted(t, dim, index)
    if not isinstance(t, Tensor):  # a function reading the part (counted, only it moves)
        return t(dim, index)
    if isinstance(index, Tensor):
        index = index.to(t.device)
    return t[index] if dim == 0 else t[:, index]


def restricted(d: Any, dim: int, index: Tensor | slice) -> Any:
    """The low-rank change ``d`` (``lowrank.LowRank``, plain or transposed) restricted to
    ``index`` along ``dim``: the factors restricted, the product never formed."""
    from dataclasses import replace

    if d.layout not in ("plain", "transposed"):
        raise ValueError(f"a vocabulary matrix's low-rank change has layout {d.layout!r}")
    if isinstance(index, Tensor):
        index = index.to(d.left.device)
    on_left = (dim == 0) == (d.layout == "plain")
    if on_left:
        return replace(d, left=d.left[index])
    return replace(d, right=d.right[:, index])


def stored_delta(deltas: Any, names: tuple[tuple[str, bool], ...], factors: dict[str, LowRank]
                 ) -> Tensor | LowRank | None:  # fmt: skip
    """Δ of a stored vocabulary matrix in its stored layout, from the diff's tensors of the
    TransformerLens ``names`` that are that matrix (``(name, transposed)``: ``named``), as a
    view (a transposed one where the layouts differ), or the low-rank ``factors`` of a name;
    ``None`` where the diff has none. Tied names must have the same Δ (checked a part at a
    time)."""
    found: list[tuple[str, Tensor | LowRank]] = []
    for name, transposed in names:
        d: Tensor | LowRank | None = factors.get(name)
        if d is None:
            d = deltas.get(name)
        if d is None:
            continue
        if transposed:
            d = _transposed(d) if isinstance(d, LowRank) else d.T
        found.append((name, d))
    if not found:
        return None
    first = found[0][1]
    for name, d in found[1:]:
        if not _agree(first, d):
            raise ValueError(
                f"{name} shares its storage with {found[0][0]} (tied weights) and the changes "
                "given for the two differ: give tied parameters the same change."
            )
    return first


def _agree(a: Tensor | LowRank, b: Tensor | LowRank) -> bool:
    """Whether two changes of one stored matrix are equal, compared ``COLUMNS`` rows at a time
    (neither is copied whole)."""
    if isinstance(a, LowRank) or isinstance(b, LowRank):
        a = a.dense() if isinstance(a, LowRank) else a
        b = b.dense() if isinstance(b, LowRank) else b
    if a.shape != b.shape:
        return False
    n = int(a.shape[0])
    return all(
        torch.equal(a[i : i + COLUMNS], b[i : i + COLUMNS].to(a.device))
        for i in range(0, n, COLUMNS)
    )

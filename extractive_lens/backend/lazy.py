"""Δ formed when it is read: ``W' - W`` from the finetuned weights in their stored dtype.

``WeightDiff.from_checkpoints`` and ``WeightDiff.from_models(..., on_demand=True)`` hold no Δ:
their ``deltas`` is a ``LazyDeltas`` over the base weights and the finetuned ones (a loaded
model's tensors, or a checkpoint's read a layer at a time: ``checkpoint.py``). Each Δ tensor is
formed where the base weight is when scoring reads it, so what crosses the bus is the finetuned
tensor in its stored dtype (``formed``; ``shift.Traffic`` counts it).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping

import torch
from torch import Tensor


class LazyDeltas(Mapping[str, Tensor]):
    """``Δ[name] = finetuned[name] - base[name]`` in ``dtype``, formed when asked for and not
    kept (``WeightDiff.from_checkpoints``, ``from_models(on_demand=True)``). ``device``: where
    each Δ tensor is put. What crosses to where Δ is formed is the finetuned tensor in its
    stored dtype (``formed``: a bf16 checkpoint moves half a float32 Δ's bytes)."""

    def __init__(
        self, base: Mapping[str, Tensor], finetuned: Mapping[str, Tensor], dtype: torch.dtype,
        device: str | torch.device | None = None, names: list[str] | None = None,
    ) -> None:  # fmt: skip
        self.base, self.finetuned, self.dtype, self.device = base, finetuned, dtype, device
        self.names = list(base) if names is None else names
        self._known = set(self.names)
        # a loaded model's own tensors (``from_models``): their version counters now, so that a
        # weight changed in place afterwards is refused instead of silently read as a new Δ
        self._versions = (
            {n: t._version for n, t in finetuned.items()} if isinstance(finetuned, dict) else None
        )
        extra = sorted(set(base) ^ set(finetuned))
        if extra:
            raise ValueError(f"Parameter names differ between base and finetuned: {extra[:5]}")

    def formed(self, name: str) -> tuple[Tensor, int]:
        """``self[name]`` and the bytes of the finetuned tensor read to form it (its stored
        dtype): what crosses the bus where the base weight is on the GPU."""
        if name not in self._known:
            raise KeyError(name)
        b, f = self.base[name], self.finetuned[name]
        if self._versions is not None and f._version != self._versions[name]:
            raise ValueError(
                f"{name}: the finetuned model's weight was changed in place after this diff was "
                "made (WeightDiff.from_models(..., on_demand=True) reads the finetuned model's "
                "own tensors, and its norms and fingerprint were taken before): make the diff "
                "again, or make a dense one (on_demand=False) before editing the model."
            )
        if tuple(b.shape) != tuple(f.shape):
            raise ValueError(f"{name}: base shape {tuple(b.shape)} != finetuned {tuple(f.shape)}")
        # moved in its stored dtype, then widened where the base weight is (from page-locked
        # host memory without blocking: ``pinned``)
        fast = b.device.type == "cuda" and f.device.type == "cpu" and f.is_pinned()
        d = f.to(b.device, non_blocking=fast).to(self.dtype) - b.detach().to(self.dtype)
        if not torch.isfinite(d).all():
            raise ValueError(f"{name}: Δ contains NaN or inf (check the finetuned weights).")
        return (d if self.device is None else d.to(self.device)), f.numel() * f.element_size()

    def __getitem__(self, name: str) -> Tensor:
        return self.formed(name)[0]

    def __contains__(self, name: object) -> bool:  # Mapping's would form the tensor
        return name in self._known

    def spec(self, name: str) -> tuple[tuple[int, ...], torch.dtype]:
        """The shape and dtype ``self[name]`` will have, without reading it."""
        shapes = getattr(self.base, "shapes", None)
        shape = shapes[name] if shapes is not None else tuple(self.base[name].shape)
        return tuple(shape), self.dtype

    def source_bytes(self, name: str) -> int:
        """The bytes ``formed(name)`` reads (the finetuned tensor's, in its stored dtype),
        without reading it."""
        shape, _ = self.spec(name)
        dtype_of = getattr(self.finetuned, "dtype_of", None)
        if dtype_of is not None:
            dtype = dtype_of(name)
        else:
            dtype = getattr(self.finetuned, "dtype", None) or self.finetuned[name].dtype
        return math.prod(shape) * dtype.itemsize

    def pinned(self) -> LazyDeltas:
        """The same diff with the finetuned tensors in page-locked host memory, in their stored
        dtype (a checkpoint's read once into host memory): each is then copied to where its Δ
        is formed without blocking, the next layer's while the current one runs."""
        held = {n: self.finetuned[n].detach().cpu().contiguous().pin_memory() for n in self.names}
        return LazyDeltas(self.base, held, self.dtype, self.device, self.names)

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)

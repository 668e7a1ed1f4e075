"""Δ meeting a model: whether it fits (architecture, names, shapes, processing), and weights set
to ``W + scale·Δ`` for a block and restored bit for bit after it (``weights_set``).

``WeightDiff.applied`` and ``check_compatible`` are these functions on the diff's tensors;
``finetune`` restores its snapshots through ``weights_set``. They import nothing of
``weight_diff``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import Tensor

from extractive_lens import backend as B
from extractive_lens.backend import ScorableModel
from extractive_lens.backend.lowrank import LowRankDeltas
from extractive_lens.interrupts import finish_stale, state_change


def shape_of(deltas: Mapping[str, Tensor], name: str) -> tuple[int, ...]:
    """Δ[name]'s shape, without forming a low-rank or lazily formed tensor."""
    from extractive_lens.backend.lazy import LazyDeltas

    if isinstance(deltas, LowRankDeltas):  # without forming it
        return deltas.shape(name)
    if isinstance(deltas, LazyDeltas):
        return deltas.spec(name)[0]
    return tuple(deltas[name].shape)


def check_fits(
    deltas: Mapping[str, Tensor], signature: Mapping[str, Any], model: ScorableModel
) -> None:
    """Raise a clear error unless Δ fits ``model`` (architecture, names, shapes)."""
    params = B.parameters(model)
    sig = B.signature(model)
    formed, now = signature.get("processed"), sig.get("processed")
    if formed is not None and now is not None and bool(formed) != bool(now):
        state = {True: "processed (folded / centred)", False: "as trained (unprocessed)"}
        raise ValueError(
            f"This WeightDiff was formed on weights {state[bool(formed)]}, but the model's "
            f"weights are {state[bool(now)]} now (TransformerLens's process_weights_ / "
            "enable_compatibility_mode, or a model loaded another way): Δ means something "
            "else on them. Use a model loaded the way the diff's models were "
            "(docs/scores.md §1), or form the diff again from two models loaded alike."
        )
    for key, value in signature.items():
        if key in ("processed",) or key not in sig:
            continue
        if key == "dtype":
            continue  # a diff may be applied to a model in another dtype (e.g. bf16 copy)
        if sig[key] != value:
            raise ValueError(
                f"This WeightDiff was made for {key}={value!r} but the model has {sig[key]!r}."
            )
    for name in deltas:
        if name not in params:
            raise ValueError(
                f"The model has no parameter {name!r} (Δ was made for another architecture)."
            )
        shape = shape_of(deltas, name)
        if tuple(params[name].shape) != shape:
            raise ValueError(
                f"{name}: Δ has shape {shape} but the model's parameter has "
                f"{tuple(params[name].shape)}."
            )
    B.check_shared(model, deltas)


def shifted_weights(
    model: ScorableModel, deltas: Mapping[str, Tensor], scale: float
) -> contextlib.AbstractContextManager:
    """``weights_set`` to ``W + scale·Δ`` on the parameters Δ names (formed in the wider of
    the two dtypes, then rounded to the weight's: W is never rounded to Δ's dtype)."""
    params = B.parameters(model)

    def new_values() -> dict[str, Tensor]:
        out = {}
        for name, d in deltas.items():
            p = params[name].detach()
            wide = torch.promote_types(p.dtype, d.dtype)  # W is never rounded to Δ's dtype
            d = d.to(device=p.device, dtype=wide)
            out[name] = (p.to(wide) + (d if scale == 1.0 else scale * d)).to(p.dtype)
        return out

    return weights_set(model, new_values)


@contextlib.contextmanager
def weights_set(
    model: ScorableModel, values: dict[str, Tensor] | Callable[[], dict[str, Tensor]]
) -> Iterator[ScorableModel]:
    """Inside the block the named parameters hold ``values`` (or what ``values()`` returns, computed
    once interrupts are deferred); on exit they are restored bit for bit from saved copies,
    whatever happened (exceptions, KeyboardInterrupt, SIGTERM: see ``interrupts``)."""
    saved: dict[str, Tensor] = {}

    def change() -> None:
        with torch.no_grad():
            new = values() if callable(values) else values
            params = B.parameters(model)
            saved.update({name: params[name].detach().clone() for name in new})
            B.write_parameters(model, new)

    def restore() -> None:
        if saved:
            B.write_parameters(model, saved)

    finish_stale()
    with state_change(
        change, restore, model=model
    ):  # interrupts wait while weights change or are restored
        yield model

"""Δ from weights in memory: two loaded models, two state dicts, or zeros for one model."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from extractive_lens import backend as B
from extractive_lens.backend import ScorableModel
from extractive_lens.diff_sources import Parts, delta_dtype_for


def from_models(
    base: ScorableModel,
    finetuned: ScorableModel,
    *,
    device: str | torch.device | None = None,
    dtype: torch.dtype | None = None,
    on_demand: bool = False,
) -> Parts:
    """Δ = finetuned - base, checked parameter by parameter (``WeightDiff.from_models``);
    ``on_demand``: each tensor formed when it is read, from the two models' weights."""
    sig_b, sig_f = B.signature(base), B.signature(finetuned)
    diffs = {k: (sig_b[k], sig_f[k]) for k in sig_b if sig_b[k] != sig_f.get(k)}
    if diffs:
        detail = ", ".join(f"{k}: base={a!r} finetuned={b!r}" for k, (a, b) in diffs.items())
        raise ValueError(
            f"The base and finetuned models differ in architecture or loading ({detail}). "
            "Load both with the same config, dtype and weight processing."
        )
    refuse_other_function(B.function_config(base), B.function_config(finetuned))
    ft = B.parameters(finetuned)
    base_params = B.parameters(base)
    missing = sorted(set(base_params) ^ set(ft))
    if missing:
        raise ValueError(f"Parameter names differ between base and finetuned: {missing[:5]}")
    meta = {"base": base.cfg.model_name, "finetuned": finetuned.cfg.model_name}
    if on_demand:
        from extractive_lens.backend.lazy import LazyDeltas

        for name, b in base_params.items():
            f = ft[name]
            if b.shape != f.shape or b.dtype != f.dtype:
                raise ValueError(f"{name}: base {tuple(b.shape)} {b.dtype} != finetuned "
                                 f"{tuple(f.shape)} {f.dtype}")  # fmt: skip
        ddt = dtype or delta_dtype_for(base.cfg.dtype)
        held = {n: p.detach() for n, p in ft.items()}
        deltas = LazyDeltas(base_params, held, ddt, device)
        return Parts(deltas, dict(sig_b), {**meta, "formed": "on demand"})
    return from_state_dicts(
        {n: p.detach() for n, p in base_params.items()},
        {n: p.detach() for n, p in ft.items()},
        signature=sig_b,
        device=device,
        dtype=dtype,
        metadata=meta,
    )


def refuse_other_function(base: Mapping[str, Any], finetuned: Mapping[str, Any]) -> None:
    """Refuse, naming the fields, a finetuned model whose configuration changes the function
    its weights compute (``B.function_config``): Δ would be scored under the base's."""
    detail = B.config_differences(base, finetuned)
    if detail:
        raise ValueError(
            f"The base and finetuned models compute different functions of their weights "
            f"({detail}): Δ would be scored under the base's configuration, not the finetuned "
            "model's. A finetune that changed the configuration (a long-context finetune's "
            "rope_theta, another norm eps) is more than a weight change; compare models that "
            "share one configuration."
        )


def from_state_dicts(
    base: Mapping[str, Tensor],
    finetuned: Mapping[str, Tensor],
    *,
    signature: Mapping[str, Any] | None = None,
    device: str | torch.device | None = None,
    dtype: torch.dtype | None = None,
    metadata: Mapping[str, Any] | None = None,
) -> Parts:
    """Δ from two state dicts with TransformerLens parameter names
    (``WeightDiff.from_state_dicts``)."""
    extra = sorted(set(base) ^ set(finetuned))
    if extra:
        raise ValueError(f"Parameter names differ between the state dicts: {extra[:5]}")
    deltas: dict[str, Tensor] = {}
    for name, b in base.items():
        f = finetuned[name]
        if b.shape != f.shape:
            raise ValueError(f"{name}: base shape {tuple(b.shape)} != finetuned {tuple(f.shape)}")
        if b.dtype != f.dtype:
            raise ValueError(f"{name}: base dtype {b.dtype} != finetuned dtype {f.dtype}")
        if b.device != f.device:
            raise ValueError(
                f"{name}: base is on {b.device} but finetuned on {f.device}; move both models "
                "to one device first (Δ can then be moved with .to(device))."
            )
        ddt = dtype or delta_dtype_for(b.dtype)
        d = f.to(ddt) - b.to(ddt)
        if not torch.isfinite(d).all():
            raise ValueError(f"{name}: Δ contains NaN or inf (check the finetuned weights).")
        deltas[name] = d.to(device) if device is not None else d
    return Parts(deltas, dict(signature or {}), dict(metadata or {}))


def zeros_like(model: ScorableModel) -> Parts:
    """A zero update for ``model`` (``WeightDiff.zeros_like``)."""
    ddt = delta_dtype_for(model.cfg.dtype)
    deltas = {
        n: torch.zeros(p.shape, dtype=ddt, device=p.device) for n, p in B.parameters(model).items()
    }
    return Parts(deltas, dict(B.signature(model)), {})

"""Δ between two checkpoints on disk, formed one tensor at a time when it is read.

The file reading itself (safetensors, TransformerLens's weight conversion, a bridge's views)
lives in ``backend/checkpoint.py``; this source checks the folders, matches the architectures
and hands ``WeightDiff`` a ``LazyDeltas`` mapping.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch
from torch import Tensor

from extractive_lens import backend as B
from extractive_lens.backend import ScorableModel
from extractive_lens.diff_sources import Parts, delta_dtype_for


def from_checkpoints(
    base: str | Path | ScorableModel,
    finetuned: str | Path,
    *,
    dtype: torch.dtype | None = None,
    device: str | torch.device | None = None,
) -> Parts:
    """Δ between two checkpoints, formed on demand (``WeightDiff.from_checkpoints``).

    Refused before any weight is read: the same folder twice (Δ = 0), and a finetuned
    checkpoint whose architecture or function-changing configuration (rotary base, norm eps,
    soft caps, ...) differs from the base's, naming the fields."""
    from extractive_lens.backend import checkpoint
    from extractive_lens.backend.bridge import hf_function_config
    from extractive_lens.backend.hooked import config_fields
    from extractive_lens.backend.loading import refuse_incomplete_weights, refuse_remote_code
    from extractive_lens.diff_sources.models import refuse_other_function

    if isinstance(base, (str, Path)) and Path(base).resolve() == Path(finetuned).resolve():
        raise ValueError(
            f"The base and finetuned checkpoints are the same folder "
            f"({Path(finetuned).resolve()}): Δ would be 0 and every score 0. Pass the base "
            "model's folder as base."
        )
    refuse_remote_code(finetuned)
    refuse_incomplete_weights(finetuned)
    base_values: Mapping[str, Tensor]
    ft_values: Mapping[str, Tensor]
    if isinstance(base, (str, Path)):
        refuse_remote_code(base)
        refuse_incomplete_weights(base)
        conv = checkpoint.Converted(base, dtype or torch.float32)
        base_values, sig, dt = conv, conv.signature(), conv.dtype
        ft_conv = checkpoint.Converted(finetuned, dt)
        ft_values, ft_sig = ft_conv, ft_conv.signature()
        functions = (config_fields(conv.cfg), config_fields(ft_conv.cfg))
        name = Path(base).name
    else:
        dt = dtype or base.cfg.dtype
        sig = B.signature(base)
        base_values = B.parameters(base)
        if B.backend_for(base).NAME == "transformer_bridge":
            views = checkpoint.BridgeViews(base, finetuned)
            ft_values, ft_sig = views, {}  # the views have the base's shapes by construction
            functions = (hf_function_config(views.base_hf_config),
                         hf_function_config(views.hf_config))  # fmt: skip
        else:
            ft_conv = checkpoint.Converted(finetuned, dt)
            ft_values, ft_sig = ft_conv, ft_conv.signature()
            functions = (B.function_config(base), config_fields(ft_conv.cfg))
        name = base.cfg.model_name
    differ = {k: (sig.get(k), v) for k, v in ft_sig.items()
              if k not in ("dtype", "processed") and sig.get(k) != v}  # fmt: skip
    if differ:
        detail = ", ".join(f"{k}: base={a!r} finetuned={b!r}" for k, (a, b) in differ.items())
        raise ValueError(f"The base and finetuned checkpoints differ in architecture ({detail}).")
    refuse_other_function(*functions)
    deltas = checkpoint.LazyDeltas(base_values, ft_values, delta_dtype_for(dt), device)
    meta = {"base": name, "finetuned": Path(finetuned).name, "formed": "on demand"}
    return Parts(deltas, dict(sig), meta)

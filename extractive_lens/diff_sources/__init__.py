"""Where a weight change Δ comes from: one small constructor per source.

Each source reads two sets of weights (two loaded models, two state dicts, two checkpoint
folders, ...) and returns ``Parts``: Δ keyed by TransformerLens parameter names, the
architecture signature both sides shared, and provenance metadata. ``WeightDiff`` (algebra,
``applied``, norms, save/load) builds itself from them; its classmethods are the public spelling:

- ``WeightDiff.from_models``: ``models.from_models`` (two loaded models);
- ``WeightDiff.from_state_dicts``: ``models.from_state_dicts``;
- ``WeightDiff.zeros_like``: ``models.zeros_like``;
- ``WeightDiff.from_checkpoints``: ``checkpoints.from_checkpoints`` (formed on demand);
- ``WeightDiff.from_peft``: ``backend/lora.from_peft`` (a LoRA adapter, kept as its factors).

A new source (CONTRIBUTING.md, "Add a diff source") is a module here with a function returning
``Parts`` and a one-line classmethod on ``WeightDiff``; the sources import nothing of
``weight_diff`` (the diff imports them), so the two never import each other. A source that maps
another library's names onto TransformerLens's (a LoRA adapter's ``q_proj``) lives in
``backend/``, the one package that spells TransformerLens names, and returns ``Parts`` alike.

>>> import torch
>>> from extractive_lens.diff_sources import models
>>> parts = models.from_state_dicts({"w": torch.ones(2)}, {"w": torch.tensor([1.0, 3.0])})
>>> parts.deltas["w"]
tensor([0., 2.], dtype=torch.float64)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import torch
from torch import Tensor


class Parts(NamedTuple):
    """What a source hands ``WeightDiff``: ``WeightDiff(*parts)``."""

    deltas: Mapping[str, Tensor]
    signature: dict[str, Any]
    metadata: dict[str, Any]


def delta_dtype_for(dtype: torch.dtype) -> torch.dtype:
    """float32 for 16-bit weights, float64 otherwise (so ``W + Δ`` reproduces ``W'``)."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else torch.float64

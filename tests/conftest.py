"""Shared fixtures: tiny seeded models (session scope) and small checkpoints made on the fly."""

from __future__ import annotations

import warnings

import pytest
import torch

warnings.filterwarnings("ignore", category=DeprecationWarning)

# The architecture families the toolkit supports, as tiny TransformerLens configs.
FAMILIES = {
    "ln_gelu": dict(normalization_type="LN", act_fn="gelu", positional_embedding_type="standard"),
    "rms_gated_rotary_gqa": dict(
        normalization_type="RMS", act_fn="silu", gated_mlp=True, positional_embedding_type="rotary",
        rotary_dim=8, n_key_value_heads=2, final_rms=True,
    ),
    "parallel_rotary": dict(
        normalization_type="LN", act_fn="gelu", parallel_attn_mlp=True,
        positional_embedding_type="rotary", rotary_dim=4,
    ),
}


def make_pair(family: str, dtype=torch.float64, seed: int = 0, delta_scale: float = 0.05, **overrides):
    """A (base, finetuned) pair: the finetuned model is the base plus a small random update."""
    from extractive_lens import tiny_model

    cfg = dict(FAMILIES[family], dtype=dtype, **overrides)
    base = tiny_model(cfg, seed=seed)
    ft = tiny_model(cfg, seed=seed)
    gen = torch.Generator().manual_seed(seed + 99)
    with torch.no_grad():
        for p in ft.parameters():
            p.add_((delta_scale * torch.randn(p.shape, generator=gen, dtype=torch.float64)).to(p.dtype))
    return base, ft


@pytest.fixture(scope="session", params=list(FAMILIES))
def family(request):
    return request.param


@pytest.fixture(scope="session")
def pair64(family):
    return make_pair(family, torch.float64)

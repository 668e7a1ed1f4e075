"""y* (docs/scores.md §4, §6) against literal loops over prompts and roles on TransformerLens caches."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from extractive_lens import make_batch
from extractive_lens.scoring.ablation import AblationTable
from extractive_lens.scoring.runs import forward_run
from tests.conftest import make_pair


@pytest.fixture(scope="module")
def setup():
    base, _ = make_pair("ln_gelu", torch.float64)
    pairs = [
        ([1, 5, 6, 7], [9]),
        ([1, 5, 8, 7], [9]),
        ([1, 5, 10, 11, 7], [9]),
        ([1, 12, 7], [9]),
        ([1, 5, 13, 7], [9]),
        ([1, 5, 6, 14, 15, 7], [9]),
    ]
    batch = make_batch(base, pairs)
    with torch.no_grad():
        _, cache = base.run_with_cache(batch.tokens)
    L = base.cfg.n_layers
    z = torch.stack([cache[f"blocks.{l}.attn.hook_z"] for l in range(L)], dim=2)
    m = torch.stack([cache[f"blocks.{l}.hook_mlp_out"] for l in range(L)], dim=2)
    return base, batch, z, m


def _aligned(batch, i, role):
    return batch.roles[i].index(role) if role in batch.roles[i] else None


def test_leave_one_out_mean(setup):
    base, batch, z, m = setup
    t = AblationTable(base, batch, "mean")
    zs, ms = t.for_rows(list(range(len(batch))), batch, forward_run(base, batch))
    for i, roles in enumerate(batch.roles):
        for p, r in enumerate(roles):
            others = [
                (j, _aligned(batch, j, r))
                for j in range(len(batch))
                if j != i and _aligned(batch, j, r) is not None
            ]
            want_z = torch.stack([z[j, q] for j, q in others]).mean(0) if others else z[i, p]
            want_m = torch.stack([m[j, q] for j, q in others]).mean(0) if others else m[i, p]
            assert torch.allclose(zs[i, p], want_z, atol=1e-12) and torch.allclose(
                ms[i, p], want_m, atol=1e-12
            )
    assert zs[3, 4:].abs().max() == 0  # padding


def test_resample_uses_numpy_rng_picks(setup):
    base, batch, z, _ = setup
    t = AblationTable(base, batch, "resample", k=3, seed=3)
    zs, _ = t.for_rows(list(range(len(batch))), batch, forward_run(base, batch))
    rng = np.random.default_rng(3)
    for i, roles in enumerate(batch.roles):
        pool = [j for j in range(len(batch)) if j != i]
        picks = rng.choice(pool, size=3, replace=False).tolist()
        for p, r in enumerate(roles):
            have = [(j, _aligned(batch, j, r)) for j in picks if _aligned(batch, j, r) is not None]
            want = torch.stack([z[j, q] for j, q in have]).mean(0) if have else z[i, p]
            assert torch.allclose(zs[i, p], want, atol=1e-12)


def test_reference_mean_and_zero(setup):
    base, batch, z, _ = setup
    ref = batch.subset([0, 1, 4])
    t = AblationTable(base, batch.subset([0, 1]), "mean", reference=ref)
    sub = batch.subset([0, 1])
    zs, _ = t.for_rows([0, 1], sub, forward_run(base, sub))
    for i in range(2):
        for p, r in enumerate(sub.roles[i]):
            want = torch.stack([z[j, _aligned(batch, j, r)] for j in (0, 1, 4)]).mean(0)
            assert torch.allclose(zs[i, p], want, atol=1e-12)
    with pytest.raises(ValueError, match="No reference prompt has the role"):
        odd = batch.subset([5])
        AblationTable(base, odd, "mean", reference=batch.subset([3])).for_rows(
            [0], odd, forward_run(base, odd)
        )
    zz, mm = AblationTable(base, batch, "zero").for_rows(
        list(range(6)), batch, forward_run(base, batch)
    )
    assert zz.abs().max() == 0 and mm.abs().max() == 0

"""compare(): statistics against scipy and by-hand counts."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from scipy import stats

from extractive_lens import WeightDiff, causal_scores, compare, linear_scores
from tests.conftest import make_pair
from tests.test_linear import small_batch


@pytest.fixture(scope="module")
def pair_scores():
    base, ft = make_pair("ln_gelu", torch.float64, delta_scale=0.2)
    batch = small_batch(base, n=3)
    diff = WeightDiff.from_models(base, ft)
    return linear_scores(base, diff, batch), causal_scores(base, diff, batch)


def test_statistics_match_scipy(pair_scores):
    lin, ex = pair_scores
    cmp = compare(lin, ex)
    assert cmp.level == "token"
    for row in cmp.rows:
        a, b, _ = cmp.cells(row["kind"], row["part"])
        assert row["n"] == len(a)
        assert row["pearson"] == pytest.approx(stats.pearsonr(a, b)[0], abs=1e-9)
        assert row["spearman"] == pytest.approx(stats.spearmanr(a, b)[0], abs=1e-9)
        nz = (a != 0) | (b != 0)
        assert row["sign_agreement"] == pytest.approx(np.mean(np.sign(a[nz]) == np.sign(b[nz])))
        assert row["max_abs_err"] == pytest.approx(np.abs(a - b).max())
    labels = {(r["kind"], r["part"]) for r in cmp.rows}
    assert ("upstream", "mlp") in labels and ("informative", "heads") in labels
    worst = cmp.worst("informative", 3)
    assert abs(worst[0][1] - worst[0][2]) >= abs(worst[1][1] - worst[1][2])
    assert len(cmp.to_dataframe()) == sum(r["n"] for r in cmp.rows if r["part"] == "all")
    assert "<table>" in cmp._repr_html_() and "http" not in cmp._repr_html_()


def test_identical_and_scrambled(pair_scores):
    lin, _ = pair_scores
    same = compare(lin, lin)
    assert all(r["pearson"] == pytest.approx(1.0) and r["topk_overlap"] == 1.0 and r["max_abs_err"] == 0
               for r in same.rows)
    g = torch.Generator().manual_seed(0)
    perm = torch.randperm(lin.values[..., 0].numel(), generator=g)
    vals = lin.values.clone()
    flat = vals[..., 0].flatten()[perm].reshape(vals[..., 0].shape)
    vals[..., 0] = flat
    scrambled = dataclasses.replace(lin, values=vals)
    r = compare(lin, scrambled).rows[0]
    assert r["pearson"] < 0.99


def test_component_level_and_mismatch_errors(pair_scores):
    lin, ex = pair_scores
    cmp = compare(lin, ex, level="component", k=3)
    a, b, labels = cmp.cells("downstream")
    assert len(labels) == lin.n_layers * len(lin.component_labels) and labels[0] == "L0H0"
    base, ft = make_pair("ln_gelu", torch.float64, n_layers=3)
    other = linear_scores(base, WeightDiff.from_models(base, ft), small_batch(base, n=3))
    with pytest.raises(ValueError, match="different models"):
        compare(lin, other)

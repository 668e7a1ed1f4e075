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
    assert all(
        r["pearson"] == pytest.approx(1.0) and r["topk_overlap"] == 1.0 and r["max_abs_err"] == 0
        for r in same.rows
    )
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


def test_refuses_results_computed_differently():
    base, ft = make_pair("ln_gelu", torch.float64, delta_scale=0.05)
    batch = small_batch(base, n=4)
    diff = WeightDiff.from_models(base, ft)
    ex = causal_scores(base, diff, batch, show_progress=False)
    authors = linear_scores(base, diff, batch, convention="authors_code")
    with pytest.raises(
        ValueError, match=r"reward \(linear 'logit_margin', exact 'answer_logprob'\).*convention"
    ):
        compare(authors, ex)
    resampled = linear_scores(base, diff, batch, ablation="resample")
    with pytest.raises(ValueError, match="ablation.*check_settings=False"):
        compare(resampled, ex)
    other_prompts = linear_scores(base, diff, small_batch(base, seed=5, n=4))
    with pytest.raises(ValueError, match="prompts"):
        compare(other_prompts, ex)
    assert compare(authors, ex, check_settings=False).rows  # told otherwise
    whole = causal_scores(base, diff, batch, per="component", show_progress=False)
    same = compare(linear_scores(base, diff, batch), whole)  # per token against per component
    assert same.level == "component" and same.rows
    with pytest.raises(ValueError, match="prompts"):
        compare(other_prompts, whole)
    assert compare(linear_scores(base, diff, batch), ex).rows  # same settings: fine


def test_cells_never_computed_are_left_out():
    base, ft = make_pair("ln_gelu", torch.float64, delta_scale=0.05)
    batch = small_batch(base, n=3)
    diff = WeightDiff.from_models(base, ft)
    lin = linear_scores(base, diff, batch, kinds=("downstream",))
    ex = causal_scores(base, diff, batch, kinds=("downstream",), layers=[1], show_progress=False)
    cmp = compare(lin, ex)
    n_pos, C = len(lin.position_labels), len(lin.component_labels)
    row = next(r for r in cmp.rows if r["part"] == "all")
    assert row["n"] == C * n_pos  # layer 1 only, not both layers
    a, b, labels = cmp.cells("downstream")
    assert all(lab.startswith("L1") for lab in labels)
    full = compare(
        lin, causal_scores(base, diff, batch, kinds=("downstream",), show_progress=False)
    )
    sub = [lab.startswith("L1") for lab in full.cells("downstream")[2]]
    assert np.allclose(b, full.cells("downstream")[1][sub])  # the same cells, nothing padded with 0


def test_verdicts_in_plain_words(pair_scores):
    from extractive_lens.comparison import verdict

    cmp = compare(*pair_scores)
    assert set(cmp.verdicts) == set(pair_scores[0].kinds)
    assert verdict("informative", 0.99, 0.9).startswith("linear informative agrees")
    assert "roughly agrees" in verdict("downstream", 0.7, 0.5) and "top_k" in verdict(
        "downstream", 0.7, 0.5
    )
    up = verdict("upstream", 0.42, 0.3)
    assert "disagrees" in up and "causal_scores" in up and "y - y*" in up
    assert "disagrees" in verdict("upstream", float("nan"), 0.0)

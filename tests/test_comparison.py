"""compare(): statistics against scipy and by-hand counts."""

from __future__ import annotations

import dataclasses
import warnings

import numpy as np
import pytest
import torch
from scipy import stats

from extractive_lens import WeightDiff, causal_scores, compare, linear_scores
from tests.conftest import make_pair
from tests.helpers import small_batch


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
        sig = np.maximum(np.abs(a), np.abs(b)) >= 0.01 * np.abs(b).max()  # the stated threshold
        assert row["n_signal"] == sig.sum() and 0 < sig.sum() < len(a)
        assert row["spearman"] == pytest.approx(stats.spearmanr(a[sig], b[sig])[0], abs=1e-9)
        assert row["sign_agreement"] == pytest.approx(np.mean(np.sign(a[sig]) == np.sign(b[sig])))
        assert row["slope"] == pytest.approx(np.linalg.lstsq(b[:, None], a, rcond=None)[0][0])
        assert row["rel_error"] == pytest.approx(np.linalg.norm(a - b) / np.linalg.norm(b))
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


def _row(pearson, overlap, spearman=0.95, slope=1.0, rel_error=0.05):
    return dict(pearson=pearson, topk_overlap=overlap, spearman=spearman, slope=slope,
                rel_error=rel_error, n_signal=20)  # fmt: skip


def test_verdicts_in_plain_words(pair_scores):
    from extractive_lens.comparison import verdict

    cmp = compare(*pair_scores)
    assert set(cmp.verdicts) == set(pair_scores[0].kinds)
    assert verdict("informative", _row(0.99, 0.9)).startswith("linear informative agrees")
    rough = verdict("downstream", _row(0.7, 0.5))
    assert "roughly agrees" in rough and "top_k" in rough
    up = verdict("upstream", _row(0.42, 0.3))
    assert "disagrees" in up and "causal_scores" in up and "y - y*" in up
    assert "disagrees" in verdict("upstream", _row(float("nan"), 0.0))


def _scaled(scores, factor, method=None, **meta):
    """``scores`` with its values times ``factor``, as another method's result."""
    metadata = {**scores.metadata, **meta}
    return dataclasses.replace(
        scores, values=scores.values * factor, totals=scores.totals * factor,
        prompt_totals=scores.prompt_totals * factor, method=method or scores.method,
        metadata=metadata,
    )  # fmt: skip


def test_a_verdict_checks_the_values_not_only_the_correlation(pair_scores):
    _, ex = pair_scores
    same = compare(_scaled(ex, 1.0, "linear"), ex)
    assert all("can stand in" in v for v in same.verdicts.values())
    half = compare(_scaled(ex, 0.57, "linear"), ex)  # r = 1, values 0.57x
    for says in half.verdicts.values():
        assert "can stand in" not in says and "ranking only" in says and "0.57×" in says, says
    row = next(r for r in half.rows if r["part"] == "all")
    assert row["pearson"] == pytest.approx(1.0) and row["slope"] == pytest.approx(0.57)
    assert row["rel_error"] == pytest.approx(0.43)


def test_integrated_informative_says_what_its_totals_mean(pair_scores):
    _, ex = pair_scores
    ig = _scaled(ex, 0.6, "integrated", integrated={"completeness": {k: 0.01 for k in ex.kinds}})
    says = compare(ig, ex).verdicts["informative"]
    assert "joint path" in says and "one component's weights alone" in says
    assert "ranking only" in says and "completeness error 1.0%" in says
    assert "joint path" not in compare(ig, ex).verdicts["downstream"]


def test_an_incomplete_integrated_result_is_never_a_stand_in(pair_scores):
    _, ex = pair_scores
    done = {"informative": 0.01, "upstream": 0.10, "downstream": 0.049}
    ig = _scaled(ex, 1.0, "integrated", integrated={"completeness": done})
    says = compare(ig, ex).verdicts
    assert "not complete" in says["upstream"] and "steps='auto'" in says["upstream"]
    assert "can stand in" not in says["upstream"] and "10.0%" in says["upstream"]
    assert "can stand in" in says["downstream"] and "not complete" not in says["downstream"]


def test_integrated_scores_warn_when_incomplete():
    from extractive_lens import integrated_scores
    from extractive_lens.scoring.integrated import CompletenessWarning

    base, ft = make_pair("ln_gelu", torch.float64, delta_scale=0.2)
    batch = small_batch(base, n=3)
    diff = WeightDiff.from_models(base, ft)
    args = dict(kinds=("downstream",), rule="midpoint", show_progress=False)
    with pytest.warns(CompletenessWarning, match=r"steps=1\).*downstream \d+\.\d%.*steps='auto'"):
        integrated_scores(base, diff, batch, steps=1, **args)
    with warnings.catch_warnings():
        warnings.simplefilter("error", CompletenessWarning)
        ig = integrated_scores(base, diff, batch, steps=4, **args)  # 0.4%: no warning
    assert ig.metadata["integrated"]["completeness"]["downstream"] < 0.05


def test_rank_and_sign_statistics_leave_out_cells_without_signal(pair_scores):
    """Structural zeros and float noise at shared tokens: both results ~0 there, with random
    signs. Counted, they pull sign agreement to ~0.5 and Spearman down; left out, both are 1."""
    _, ex = pair_scores
    vals = ex.values.clone()
    g = torch.Generator().manual_seed(1)
    quiet = torch.rand(vals.shape, generator=g, dtype=vals.dtype) < 0.6
    noise = lambda: 1e-9 * torch.randn(vals.shape, generator=g, dtype=vals.dtype)  # noqa: E731
    exact = dataclasses.replace(ex, values=torch.where(quiet, noise(), vals))
    judged = dataclasses.replace(ex, values=torch.where(quiet, noise(), vals), method="linear")
    cmp = compare(judged, exact)
    for row in cmp.rows:
        a, b, _ = cmp.cells(row["kind"], row["part"])
        quiet_cells = int((np.maximum(np.abs(a), np.abs(b)) < 1e-6).sum())
        assert quiet_cells > 0.4 * len(a)
        assert row["n_signal"] == len(a) - quiet_cells
        assert row["sign_agreement"] == 1.0 and row["spearman"] == pytest.approx(1.0)
        assert np.mean(np.sign(a) == np.sign(b)) < 0.85  # counting every cell: misleading
    assert all("can stand in" in v for v in cmp.verdicts.values())


def test_sign_agreement_has_one_definition():
    from extractive_lens.comparison import sign_agreement

    a = np.array([1.0, -2.0, 0.5, 1e-9, 0.0, -1e-9])
    b = np.array([2.0, -1.0, -0.4, -1e-9, 0.0, 1e-9])
    assert sign_agreement(a, b) == pytest.approx(2 / 3)  # 3 signal cells, 2 agree
    assert sign_agreement(a, a) == 1.0


def test_a_verdict_on_a_partial_run_names_the_components_it_rests_on():
    base, ft = make_pair("ln_gelu", torch.float64, delta_scale=0.05)
    batch = small_batch(base, n=3)
    diff = WeightDiff.from_models(base, ft)
    lin = linear_scores(base, diff, batch, kinds=("downstream",))
    ex = causal_scores(base, diff, batch, kinds=("downstream",), top_k=3, show_progress=False)
    n = base.cfg.n_layers * (base.cfg.n_heads + 1)
    says = compare(lin, ex).verdicts["downstream"]
    assert says.startswith(f"On the 3 of {n} components computed (chosen by the linear ranking")
    layer = causal_scores(base, diff, batch, kinds=("downstream",), layers=[1], show_progress=False)
    says = compare(lin, layer).verdicts["downstream"]
    assert says.startswith(f"On the {base.cfg.n_heads + 1} of {n} components computed (layers 1)")
    full = causal_scores(base, diff, batch, kinds=("downstream",), show_progress=False)
    assert not compare(lin, full).verdicts["downstream"].startswith("On the")


def test_printed_comparison_is_a_table_and_wrapped_verdicts(pair_scores):
    text = repr(compare(*pair_scores))
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= 130, max(lines, key=len)
    assert "n_signal" in lines[1] and "slope" in lines[1] and "verdict" not in lines[1]
    assert sum(line.startswith("- ") for line in lines) == len(pair_scores[0].kinds)
    table = lines[2 : next(i for i, line in enumerate(lines) if line.startswith("- "))]
    numbers = [tok for line in table for tok in line.split() if tok[-1].isdigit()]
    decimals = {len(t.split(".")[1]) for t in numbers if "." in t}
    assert decimals == {3}, decimals  # one format: no "1" beside "0.999"

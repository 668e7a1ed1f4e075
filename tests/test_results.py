"""ComponentScores: shapes checked, save/load, tidy dataframe, top-k, offline HTML."""

from __future__ import annotations

import pytest
import torch

from extractive_lens import ComponentScores, WeightDiff, causal_scores, linear_scores, make_batch
from tests.conftest import make_pair


@pytest.fixture(scope="module")
def scores():
    base, ft = make_pair("ln_gelu", torch.float64)
    batch = make_batch(base, [([1, 5, 6], [7]), ([1, 8, 9, 10], [11]), ([1, 5, 9], [12])])
    return linear_scores(base, WeightDiff.from_models(base, ft), batch)


def test_save_load_round_trip(scores, tmp_path):
    scores.save(tmp_path / "s")
    back = ComponentScores.load(tmp_path / "s")
    assert torch.equal(back.values, scores.values) and torch.equal(back.other, scores.other)
    assert (
        back.position_labels == scores.position_labels and back.prompt_roles == scores.prompt_roles
    )
    assert back.metadata["reward"] == "answer_logprob"


def test_whole_component_scores_save_and_load(tmp_path):
    # per="component" results hold prompt_values as a view of prompt_totals: saving must not
    # trip safetensors' shared-memory refusal (the CLI's `score --per component` did).
    base, ft = make_pair("ln_gelu", torch.float64)
    batch = make_batch(base, [([1, 5, 6], [7]), ([1, 8, 9, 10], [11])])
    exact = causal_scores(base, WeightDiff.from_models(base, ft), batch, per="component")
    back = ComponentScores.load(exact.save(tmp_path / "c"))
    assert back.per == "component" and back.position_labels == ("all",)
    assert torch.equal(back.prompt_totals, exact.prompt_totals)
    assert torch.equal(back.prompt_values, exact.prompt_values)


def test_dataframe_and_top(scores):
    df = scores.to_dataframe()
    n_real = sum(len(r) for r in scores.prompt_roles)
    assert len(df) == 3 * n_real * scores.n_layers * len(scores.component_labels)
    sub = df[(df.kind == "informative") & (df.layer == 1) & (df.component == "MLP")]
    assert abs(sub.score.sum() - float(scores.prompt_values[0, :, 1, -1].sum())) < 1e-10
    top = scores.top(3, "informative")
    assert len(top) == 3 and abs(top[0][2]) >= abs(top[1][2]) >= abs(top[2][2])
    ranked = scores.totals[0].abs().flatten().sort(descending=True).values
    assert abs(abs(top[0][2]) - float(ranked[0])) < 1e-12
    agg = scores.to_dataframe(per_prompt=False)
    assert set(agg.role) == set(scores.position_labels)


def test_html_is_offline(scores):
    html = scores._repr_html_()
    assert "informative" in html and "<script" not in html and "http" not in html


def test_shape_validation(scores):
    with pytest.raises(ValueError, match="labels"):
        ComponentScores(
            scores.values,
            scores.totals,
            scores.prompt_values,
            scores.prompt_totals,
            scores.kinds,
            scores.component_labels[:-1],
            scores.position_labels,
            scores.prompt_roles,
            "linear",
        )


def test_html_overview_grid_colours_follow_totals(scores):
    html = scores._repr_html_()
    assert html.count("<caption>") == 3
    top_kind, top_label, top_val = scores.top(1, "informative")[0]
    assert f"title='{top_label} {top_val:+.4g}'" in html
    assert "rgba(" in html and "1.00)" in html  # the largest |total| is fully saturated

"""positions="prompt": the map of the prompt's own positions, the answer continuations left
out and said so; with the first-answer-token reward those positions carry nothing."""

from __future__ import annotations

import pytest
import torch

from extractive_lens import WeightDiff, causal_scores, integrated_scores, linear_scores
from tests.conftest import make_pair
from tests.helpers import small_batch


@pytest.fixture(scope="module")
def setup():
    base, ft = make_pair("ln_gelu", torch.float64, delta_scale=0.1)
    batch = small_batch(base, n=4)  # answers of 1 and 2 tokens: roles answer[0] in some rows
    assert any("answer[0]" in r for r in batch.roles)
    return base, WeightDiff.from_models(base, ft), batch


def test_prompt_positions_leave_the_answer_continuations_out(setup):
    base, diff, batch = setup
    full = linear_scores(base, diff, batch)
    part = linear_scores(base, diff, batch, positions="prompt")
    assert "answer[0]" in full.position_labels and "answer[0]" not in part.position_labels
    keep = [full.position_labels.index(r) for r in part.position_labels]
    assert torch.allclose(part.values, full.values[..., keep])
    for i, roles in enumerate(part.prompt_roles):
        n = int(batch.prompt_lengths[i])
        assert roles == batch.roles[i][:n]
        assert torch.allclose(part.prompt_values[:, i, ..., :n], full.prompt_values[:, i, ..., :n])
        assert torch.allclose(part.prompt_totals[:, i], full.prompt_values[:, i, ..., :n].sum(-1))
    assert part.metadata["positions"] == "prompt"
    left = part.metadata["left_out"]
    assert left["roles"] == ["answer[0]"]
    at = full.position_labels.index("answer[0]")
    share = full.values[0, ..., at].abs().sum() / full.values[0].abs().sum()
    assert left["share_of_mass"]["informative"] == pytest.approx(float(share))
    assert left["share_of_mass"]["informative"] > 0  # answer_logprob reads those positions
    assert part.metadata["additivity"] == full.metadata["additivity"]  # about the whole change


def test_first_answer_reward_puts_nothing_at_the_continuations(setup):
    base, diff, batch = setup
    for scores in (
        linear_scores(base, diff, batch, reward="first_answer_logprob"),
        causal_scores(base, diff, batch, reward="first_answer_logprob", kinds="downstream"),
    ):
        at = scores.position_labels.index("answer[0]")
        assert float(scores.values[..., at].abs().max()) == 0.0
        assert float(scores.values.abs().max()) > 0
        part = scores.at_positions("prompt")
        assert all(v == 0.0 for v in part.metadata["left_out"]["share_of_mass"].values())
        assert part.metadata["reward"] == "first_answer_logprob"


def test_exact_totals_stay_whole_and_whole_components_are_refused(setup):
    base, diff, batch = setup
    ex = causal_scores(base, diff, batch, kinds="downstream", positions="prompt")
    full = causal_scores(base, diff, batch, kinds="downstream")
    assert torch.allclose(ex.totals, full.totals)  # the whole-component patch, every position
    assert ex.metadata["totals_cover"] == "all positions"
    with pytest.raises(ValueError, match="per='token'"):
        causal_scores(base, diff, batch, per="component", positions="prompt")
    with pytest.raises(ValueError, match="positions must be"):
        linear_scores(base, diff, batch, positions="answer")
    ig = integrated_scores(base, diff, batch, kinds="downstream", steps=2, positions="prompt")
    assert "answer[0]" not in ig.position_labels
    assert torch.allclose(ig.prompt_totals, ig.prompt_values.sum(-1))


def test_compare_names_positions_not_prompts_when_only_positions_differ(setup):
    # compare(linear(positions="prompt"), causal) said "prompts (the two results scored
    # different prompts)": the prompts were the same, the answer's roles left out of one
    from extractive_lens import compare

    base, diff, batch = setup[:3]
    lin = linear_scores(base, diff, batch, kinds=("downstream",), positions="prompt")
    ex = causal_scores(base, diff, batch, kinds=("downstream",))
    with pytest.raises(ValueError, match=r"positions \(.*at_positions\('prompt'\)") as e:
        compare(lin, ex)
    assert "different prompts" not in str(e.value)
    assert compare(lin, ex.at_positions("prompt")).summary["n"].min() > 0

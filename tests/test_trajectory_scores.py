"""Scores along a trajectory: the trajectory-integrated informative score against independent
straight-line integrals on TransformerLens hooks (tests/reference.py), its completeness, the
maps over time and their figures."""

from __future__ import annotations

import copy

import pytest
import torch

import extractive_lens as el
from extractive_lens.rewards import answer_logprob
from extractive_lens.scoring.integrated import nodes
from extractive_lens.trajectory import Trajectory
from tests import reference as ref
from tests.conftest import make_pair
from tests.helpers import small_batch

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # additivity of large steps


def _moved(model, seed, scale=0.1):
    m = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return m


def _broken_line(base, models):
    """A trajectory through ``models`` (checkpoints 1 … T) from ``base``, held in memory."""
    return Trajectory.from_diffs([el.WeightDiff.from_models(base, m) for m in models])


@pytest.fixture(scope="module", params=["ln_gelu", "rms_gated_rotary_gqa"])
def two_segments(request):
    """``W_0 → W_1 → W_2``: two straight segments in different directions."""
    base, w1 = make_pair(request.param, torch.float64, delta_scale=0.1)
    w2 = _moved(w1, seed=7)
    return base, [base, w1, w2], _broken_line(base, [w1, w2]), small_batch(base)


def test_two_segments_equal_two_straight_line_integrals(two_segments):
    """Each segment's share equals the straight-line integrated informative score of that
    segment, computed independently on the two models at its ends (deep copies, hooks,
    ``torch.func.jvp``); the total is their sum."""
    base, models, traj, batch = two_segments
    ref.hooked_only(base)
    along = el.trajectory_integrated(base, traj, batch, steps=3, reward="answer_logprob")
    xs, ws = nodes(3, "gauss")
    want = [
        ref.literal_integrated_informative(models[k], models[k + 1], batch, answer_logprob, xs, ws)
        for k in range(2)
    ]
    for k in range(2):
        got = along.scores[k].prompt_values[0]
        scale = want[k].abs().max()
        assert scale > 0
        assert float((got - want[k]).abs().max() / scale) < 1e-9, k
    total = along.total.prompt_values[0]
    assert float((total - (want[0] + want[1])).abs().max() / want[0].abs().max()) < 1e-9


def test_shares_add_up_to_the_change_along_the_path(two_segments):
    """With enough nodes every segment's share (components and "other") is that segment's
    change of R, from the models themselves, and all of them add up to R(W_2) - R(W_0)."""
    base, models, traj, batch = two_segments
    ref.hooked_only(base)
    along = el.trajectory_integrated(base, traj, batch, steps=16, reward="answer_logprob")
    R = [ref.reward_of(m, batch, answer_logprob) for m in models]
    for k, s in enumerate(along.scores):
        share = s.prompt_totals[0].sum((1, 2)) + s.other
        torch.testing.assert_close(share, R[k + 1] - R[k], rtol=1e-4, atol=1e-8)
    info = along.metadata["integrated"]
    assert info["completeness"]["informative"] < 1e-4
    assert info["rewards"] == pytest.approx([float(r.mean()) for r in R])


def test_default_nodes_are_complete_within_two_percent_on_a_finetune(tmp_path):
    from tests.helpers import facts

    base, _ = make_pair("ln_gelu", torch.float64)
    data = facts(base)
    cfg = el.FinetuneConfig(lr=1e-2, epochs=3, batch_size=4)
    diff = el.finetune(base, data, cfg, keep="epochs", trajectory=tmp_path / "t")
    traj = el.Trajectory.load(tmp_path / "t")
    along = el.trajectory_integrated(base, traj, data)
    err = along.metadata["integrated"]["completeness"]["informative"]
    assert err <= 0.02, err
    straight = el.integrated_scores(base, diff, data, kinds="informative")
    # both integrals add up to the same change; per component they may differ
    total = along.total.prompt_totals[0].sum((1, 2)) + along.total.other
    line = straight.prompt_totals[0].sum((1, 2)) + straight.other
    assert float((total - line).abs().max()) < 0.05 * float(line.abs().max())


def test_parts_scored_in_separate_jobs_join_into_the_whole(two_segments, tmp_path):
    """Segments integrated one call each, saved and loaded, join into the one-call result
    (scores, completeness errors, rewards); checkpoints likewise."""
    from extractive_lens.scoring.trajectory import TrajectoryScores

    base, _, traj, batch = two_segments
    whole = el.trajectory_integrated(base, traj, batch, steps=2)
    parts = [el.trajectory_integrated(base, traj, batch, steps=2, segments=[k]) for k in (2, 1)]
    assert (
        parts[0].steps == (traj.steps[2],)
        and parts[0].scores[0].metadata["integrated"]["segment"] == 2
    )
    loaded = [TrajectoryScores.load(p.save(tmp_path / str(i))) for i, p in enumerate(parts)]
    joined = TrajectoryScores.join(*loaded)
    assert joined.steps == whole.steps and joined.epochs == whole.epochs
    for got, want in zip(joined.scores, whole.scores):
        torch.testing.assert_close(got.prompt_values, want.prompt_values, rtol=0, atol=1e-12)
        torch.testing.assert_close(got.other, want.other, rtol=0, atol=1e-12)
    a, b = joined.metadata["integrated"], whole.metadata["integrated"]
    assert a["segments"] == b["segments"] == [1, 2]
    assert a["completeness"]["informative"] == pytest.approx(
        b["completeness"]["informative"], rel=1e-6
    )
    assert a["segment_completeness"] == pytest.approx(b["segment_completeness"], rel=1e-6)
    assert a["rewards"] == pytest.approx(b["rewards"])
    # one part alone: its own segment's error, and rewards only where it starts and ends
    second = parts[0].metadata["integrated"]
    assert second["completeness"]["informative"] == pytest.approx(b["segment_completeness"][1])
    assert second["rewards"][0] is None and second["rewards"][1:] == pytest.approx(b["rewards"][1:])
    maps = el.trajectory_scores(base, traj, batch, kinds="informative")
    one = el.trajectory_scores(base, traj, batch, kinds="informative", checkpoints=[2])
    assert one.epochs == (2.0,)
    torch.testing.assert_close(one.scores[0].values, maps.scores[1].values, rtol=0, atol=0)
    first = el.trajectory_scores(base, traj, batch, kinds="informative", checkpoints=[1])
    assert TrajectoryScores.join(one, first).epochs == maps.epochs
    with pytest.raises(ValueError, match="twice"):
        TrajectoryScores.join(one, one)
    with pytest.raises(ValueError, match="mix"):
        TrajectoryScores.join(one, parts[0])
    for bad in ([0], [3], [1, 1], []):
        with pytest.raises(ValueError, match="segments"):
            el.trajectory_integrated(base, traj, batch, segments=bad)


def test_maps_over_time_are_each_checkpoints_scores(two_segments):
    base, models, traj, batch = two_segments
    maps = el.trajectory_scores(base, traj, batch, kinds=("informative", "downstream"))
    assert maps.what == "checkpoint" and maps.epochs == (1.0, 2.0)
    for k in (1, 2):
        want = el.linear_scores(base, el.WeightDiff.from_models(base, models[k]), batch,
                                kinds=("informative", "downstream"))  # fmt: skip
        torch.testing.assert_close(maps.scores[k - 1].values, want.values, rtol=0, atol=1e-12)
    exact = el.trajectory_scores(base, traj, batch, method="causal", kinds="informative",
                                 per="component")  # fmt: skip
    assert exact.scores[1].method == "causal"
    df = maps.layer_map("informative")
    torch.testing.assert_close(
        torch.tensor(df.to_numpy()), torch.stack([s.totals[0].sum(-1) for s in maps.scores])
    )


def test_figures_show_the_scores(two_segments, tmp_path):
    import numpy as np

    from extractive_lens import trajectory_plots as tp

    base, _, traj, batch = two_segments
    maps = el.trajectory_scores(base, traj, batch, kinds="informative")
    along = el.trajectory_integrated(base, traj, batch, steps=2)
    fig = maps.plot()
    np.testing.assert_allclose(np.array(fig.data[0].z), maps.layer_map().to_numpy())
    anim = tp.slider(maps)
    assert len(anim.frames) == 2
    np.testing.assert_allclose(np.array(anim.frames[1].data[0].z), maps.scores[1].totals[0])
    line = tp.curves(maps, ["L0MLP", "L1H0"])
    assert list(line.data[0].y) == pytest.approx([float(s.totals[0, 0, -1]) for s in maps.scores])
    straight = el.integrated_scores(base, traj.final, batch, kinds="informative", steps=2)
    gap = tp.path_gap(along, straight)
    assert gap["difference"].to_numpy() == pytest.approx(
        (along.total.totals[0] - straight.totals[0]).flatten().numpy()
    )
    page = tp.report(maps, tmp_path / "t.html", along=along, straight=straight)
    text = page.read_text()
    assert "sliders" in text and 'src="http' not in text


def test_arguments_say_what_to_pass(two_segments):
    base, _, traj, batch = two_segments
    with pytest.raises(TypeError, match="Trajectory"):
        el.trajectory_integrated(base, traj.final, batch)
    with pytest.raises(ValueError, match="method"):
        el.trajectory_scores(base, traj, batch, method="exact")
    with pytest.raises(ValueError, match="segments"):
        _ = el.trajectory_scores(base, traj, batch, kinds="informative").total


def test_the_large_model_path_gives_the_same_scores(two_segments, monkeypatch):
    """Where gradients go one layer at a time (``runs.layerwise``: large models) the trajectory
    integral is the same."""
    from extractive_lens.scoring import runs

    base, _, traj, batch = two_segments
    want = el.trajectory_integrated(base, traj, batch, steps=2)
    monkeypatch.setattr(runs, "LAYERWISE_BYTES", -1)
    got = el.trajectory_integrated(base, traj, batch, steps=2)
    for a, b in zip(got.scores, want.scores):
        torch.testing.assert_close(a.prompt_values, b.prompt_values, rtol=0, atol=1e-10)


def test_lora_checkpoints_score_as_their_dense_products(tmp_path):
    """A trajectory of peft adapters (points and steps kept as factors) scores as the same
    checkpoints made dense."""
    from tests.lora_models import adapter_checkpoints

    base = adapter_checkpoints(tmp_path)
    factors = Trajectory.from_checkpoints(base, tmp_path / "out", steps_per_epoch=1)
    dense = Trajectory.from_diffs(
        [el.WeightDiff(dict(factors.diff(k).deltas.items()), factors.signature) for k in (1, 2)]
    )
    batch = small_batch(base)
    got = el.trajectory_integrated(base, factors, batch, steps=2)
    want = el.trajectory_integrated(base, dense, batch, steps=2)
    scale = want.total.prompt_values.abs().max()
    assert scale > 0
    for a, b in zip(got.scores, want.scores):
        torch.testing.assert_close(a.prompt_values, b.prompt_values, rtol=1e-5, atol=1e-6 * scale)

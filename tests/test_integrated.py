"""Path-integrated scores (#30) against independent references on TransformerLens hooks and
autograd (tests/reference.py: a per-position γ on the component's hook, its gradient integrated
with the same nodes), in float64 on the three architecture families."""

from __future__ import annotations

import warnings

import pytest
import torch

from extractive_lens import WeightDiff, causal_scores, integrated_scores, linear_scores
from extractive_lens.rewards import answer_logprob
from extractive_lens.scoring.integrated import nodes
from tests import reference as ref
from tests.conftest import make_pair
from tests.test_linear import small_batch


def _rel(got, want):
    scale = want.abs().max()
    assert scale > 0, "the reference is all zeros: the test could not fail"
    return float((got - want).abs().max() / scale)


@pytest.fixture(scope="module", params=["ln_gelu", "rms_gated_rotary_gqa", "parallel_rotary"])
def setting(request):
    base, ft = make_pair(request.param, torch.float64, delta_scale=0.1)
    ref.hooked_only(base)
    batch = small_batch(base)
    return base, ft, WeightDiff.from_models(base, ft), batch


@pytest.mark.parametrize("rule", ["gauss", "midpoint"])
def test_upstream_and_downstream_equal_the_literal_path_integral(setting, rule):
    base, ft, diff, batch = setting
    got = integrated_scores(base, diff, batch, kinds=("upstream", "downstream"), steps=3,
                            rule=rule, reward="answer_logprob")  # fmt: skip
    xs, ws = nodes(3, rule)
    want = ref.literal_integrated(base, ft, batch, answer_logprob, ("upstream", "downstream"),
                                  ref.literal_mean_ablation(base, batch), xs, ws)  # fmt: skip
    for k, kind in enumerate(got.kinds):
        assert _rel(got.prompt_values[k], want[kind]) < 1e-9, kind


def test_per_token_scores_add_up_to_the_whole_component(setting):
    base, _, diff, batch = setting
    got = integrated_scores(base, diff, batch, steps=2)
    torch.testing.assert_close(got.prompt_values.sum(-1), got.prompt_totals, rtol=0, atol=1e-12)


def test_whole_components_converge_to_exact_at_the_rules_order(setting):
    """Midpoint: error ~ 1/m² (each doubling of m divides it by about 4); Gauss–Legendre: faster
    smaller at the same m, under 1e-3 of the scores' scale by 8 nodes and a hundredth of its error at 2."""
    base, _, diff, batch = setting
    kinds = ("upstream", "downstream")
    exact = causal_scores(base, diff, batch, kinds=kinds, per="component")
    scale = exact.prompt_totals.abs().max()

    def err(m, rule):
        ig = integrated_scores(base, diff, batch, kinds=kinds, steps=m, rule=rule, per="component")
        return float((ig.prompt_totals - exact.prompt_totals).abs().max() / scale)

    mid = [err(m, "midpoint") for m in (4, 8, 16)]
    assert mid[0] / mid[1] > 3 and mid[1] / mid[2] > 3, mid  # second order
    gauss = [err(m, "gauss") for m in (2, 4, 8)]
    assert gauss[2] < 1e-3 and gauss[2] < gauss[0] / 100, gauss


def test_informative_equals_the_reference_at_each_node_and_is_complete(setting):
    base, ft, diff, batch = setting
    got = integrated_scores(base, diff, batch, kinds=("informative",), steps=3,
                            reward="answer_logprob")  # fmt: skip
    xs, ws = nodes(3, "gauss")
    want = ref.literal_integrated_informative(base, ft, batch, answer_logprob, xs, ws)
    assert _rel(got.prompt_values[0], want) < 1e-9
    # completeness: Σ components + other = R(W') - R(W), from the two models themselves
    change = ref.reward_of(ft, batch, answer_logprob) - ref.reward_of(base, batch, answer_logprob)
    for m, tol in ((16, 1e-4),):
        ig = integrated_scores(base, diff, batch, kinds=("informative",), steps=m)
        total = ig.prompt_totals[0].sum((1, 2)) + ig.other
        assert float((total - change).abs().max() / change.abs().max()) < tol
        assert ig.metadata["integrated"]["completeness"]["informative"] < tol


def test_completeness_counts_every_component_when_only_some_layers_are_reported(setting):
    """``layers=`` reports some layers (the rest NaN), but informative is formed for every
    component in the same pass: its completeness error is the whole model's, not the reported
    layers' share of R(W') - R(W)."""
    base, _, diff, batch = setting
    whole = integrated_scores(base, diff, batch, kinds=("informative",), steps=4)
    some = integrated_scores(base, diff, batch, kinds=("informative",), steps=4, layers=[1])
    assert some.prompt_totals[0, :, 0].isnan().all()  # layer 0 is not reported
    err = whole.metadata["integrated"]["completeness"]["informative"]
    assert some.metadata["integrated"]["completeness"]["informative"] == pytest.approx(
        err, rel=1e-9
    )


def test_linear_fails_where_integrated_holds():
    """The negative control: on a large update the linear scores miss the exact whole-component
    scores and the change of R by far more than the tolerance the integrated ones meet."""
    base, ft = make_pair("rms_gated_rotary_gqa", torch.float64, delta_scale=0.2)
    diff = WeightDiff.from_models(base, ft)
    batch = small_batch(base)
    kinds = ("upstream", "downstream")
    exact = causal_scores(base, diff, batch, kinds=kinds, per="component").prompt_totals
    tol = 0.01
    lin = linear_scores(base, diff, batch, kinds=kinds).prompt_totals
    ig = integrated_scores(base, diff, batch, kinds=kinds, steps=8, per="component").prompt_totals
    scale = exact.abs().max()
    assert float((lin - exact).abs().max() / scale) > 10 * tol
    assert float((ig - exact).abs().max() / scale) < tol
    with warnings.catch_warnings():  # the additivity warning: what is asserted below
        warnings.simplefilter("ignore")
        lin_inf = linear_scores(base, diff, batch, kinds=("informative",))
    ig_inf = integrated_scores(base, diff, batch, kinds=("informative",), steps=32)
    assert lin_inf.metadata["additivity"]["relative_gap"] > 10 * tol
    assert ig_inf.metadata["integrated"]["completeness"]["informative"] < tol


def test_the_layer_path_is_one_path_per_component_group(setting):
    """``path="layer"`` integrates the whole group's patch at once: its components add up to the
    group's joint effect (not to the sum of their separate effects, which the component path
    gives), and it says so in the metadata."""
    base, _, diff, batch = setting
    kinds = ("downstream",)
    layer = integrated_scores(base, diff, batch, kinds=kinds, steps=8, path="layer")
    comp = integrated_scores(base, diff, batch, kinds=kinds, steps=8)
    assert layer.metadata["integrated"]["path"] == "layer"
    H = base.cfg.n_heads
    assert layer.metadata["integrated"]["completeness"]["downstream"] < 1e-3
    heads_layer = layer.prompt_totals[0, :, :, :H].sum(-1)
    heads_comp = comp.prompt_totals[0, :, :, :H].sum(-1)
    assert float((heads_layer - heads_comp).abs().max()) > 1e-4  # interactions are shared out
    # the joint effect of the heads of layer 0, literally
    from tests.reference import attn_result_mode, component_outputs, reward_of

    B = attn_result_mode(base)
    _, ft_cache = attn_result_mode(make_pair_ft(base, diff)).run_with_cache(batch.tokens)
    new = component_outputs(B, batch, 0, ft_cache)["result"]

    def all_heads(act, hook):
        return new

    joint = reward_of(B, batch, answer_logprob, [("blocks.0.attn.hook_result", all_heads)])
    joint = joint - reward_of(B, batch, answer_logprob)
    assert float((heads_layer[:, 0] - joint).abs().max()) < 1e-3 * float(joint.abs().max())
    assert float((heads_comp[:, 0] - joint).abs().max()) > 1e-2 * float(joint.abs().max())


def make_pair_ft(base, diff):
    import copy

    ft = copy.deepcopy(base)
    with torch.no_grad(), diff.applied(ft):
        state = {n: p.detach().clone() for n, p in ft.named_parameters()}
    for n, p in ft.named_parameters():
        with torch.no_grad():
            p.copy_(state[n])
    return ft


def test_steps_auto_doubles_until_complete(setting):
    base, _, diff, batch = setting
    ig = integrated_scores(base, diff, batch, kinds=("informative", "downstream"), steps="auto",
                           tolerance=1e-3)  # fmt: skip
    meta = ig.metadata["integrated"]
    assert [t["steps"] for t in meta["tried"]][:2] == [4, 8][: len(meta["tried"][:2])]
    assert all(v <= 1e-3 for v in meta["completeness"].values())
    assert meta["nodes"] == nodes(meta["steps"], "gauss")[0]


def test_bad_options_say_what_to_pass(setting):
    base, _, diff, batch = setting
    with pytest.raises(ValueError, match="steps"):
        integrated_scores(base, diff, batch, steps=0)
    with pytest.raises(ValueError, match="path"):
        integrated_scores(base, diff, batch, path="heads")
    with pytest.raises(ValueError, match="paper"):
        integrated_scores(base, diff, batch, convention="authors_code")

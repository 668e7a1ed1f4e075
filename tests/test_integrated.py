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
from tests.helpers import small_batch


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


# ------------------------------------------------------------ #42: paths no test covered before


@pytest.mark.parametrize("m", [1, 2, 3, 5, 8])
def test_nodes_are_m_nodes_exact_to_the_rules_degree(m):
    """``nodes(m, rule)`` gives m nodes and weights (summing to 1): Gauss–Legendre integrates
    x^k exactly for k <= 2m - 1 and not for k = 2m (m + 1 nodes would), midpoint is
    (i + 1/2) / m."""
    xs, ws = nodes(m, "gauss")
    assert len(xs) == len(ws) == m
    x, w = torch.tensor(xs, dtype=torch.float64), torch.tensor(ws, dtype=torch.float64)
    for k in range(2 * m):
        assert float((w * x**k).sum()) == pytest.approx(1 / (k + 1), abs=1e-13)
    assert abs(float((w * x ** (2 * m)).sum()) - 1 / (2 * m + 1)) > 1e-11
    xs, ws = nodes(m, "midpoint")
    assert xs == [(i + 0.5) / m for i in range(m)] and ws == [1 / m] * m


def _cell_sets(scores, kind):
    """Per kind, the computed (not NaN) components' labels and their per-prompt totals."""
    k = scores.kind_index(kind)
    t = scores.prompt_totals[k]  # [batch layer comp]
    labels = scores.component_labels
    done = ~t.isnan().all(0)
    return {f"L{l}{labels[c]}" for l, c in done.nonzero().tolist()}, t


@pytest.mark.parametrize("kind", ["upstream", "downstream"])
def test_top_k_scores_the_selected_components_as_the_full_run_does(kind):
    """``integrated_scores(top_k=...)``: every selected component's scores equal those of the
    run over every component, in layers where only some components are selected, and for an
    MLP selected where its layer's first head is not (the MLP's label at its offset)."""
    base, ft = make_pair("ln_gelu", torch.float64, delta_scale=0.1, n_layers=3)
    diff = WeightDiff.from_models(base, ft)
    batch = small_batch(base)
    full = integrated_scores(base, diff, batch, kinds=(kind,), steps=2)
    lin = linear_scores(base, diff, batch, kinds=(kind,))
    H = base.cfg.n_heads
    for k in range(2, 3 * (H + 1)):
        chosen = {lab for _, lab, _ in lin.top(k, kind)}
        partial = [
            l for l in range(3) if 0 < sum(lab.startswith(f"L{l}") for lab in chosen) < H + 1
        ]
        mlp_alone = [l for l in range(3) if f"L{l}MLP" in chosen and f"L{l}H0" not in chosen]
        if partial and mlp_alone:
            break
    else:
        pytest.fail("no top k selects part of a layer and an MLP without its layer's H0")
    some = integrated_scores(base, diff, batch, kinds=(kind,), steps=2, top_k=k, linear=lin)
    done, got = _cell_sets(some, kind)
    assert done == chosen
    _, want = _cell_sets(full, kind)
    keep = ~got.isnan()
    assert keep.any()
    torch.testing.assert_close(got[keep], want[keep], rtol=1e-12, atol=1e-12)
    k_ = some.kind_index(kind)
    torch.testing.assert_close(
        some.prompt_values[k_][~some.prompt_values[k_].isnan()],
        full.prompt_values[k_][~some.prompt_values[k_].isnan()],
        rtol=1e-12,
        atol=1e-12,
    )


def test_completeness_is_the_per_prompt_miss_over_the_per_prompt_change(setting):
    """The recorded completeness errors, recomputed independently: upstream and downstream
    ``Σ|integrated - exact| / Σ|exact|`` over components and prompts (the exact whole-component
    scores from ``causal_scores``), informative ``Σ_p|Σ + other - ΔR_p| / Σ_p|ΔR_p|`` with ΔR_p
    from two plain forwards. The exact effects have both signs, so a signed denominator (or a
    signed sum over prompts) gives another number."""
    base, ft, diff, batch = setting
    kinds = ("informative", "upstream", "downstream")
    ig = integrated_scores(base, diff, batch, kinds=kinds, steps=1, rule="midpoint")
    exact = causal_scores(base, diff, batch, kinds=("upstream", "downstream"), per="component")
    done = ig.metadata["integrated"]["completeness"]
    for kind in ("upstream", "downstream"):
        want = exact.prompt_totals[exact.kind_index(kind)]
        got = ig.prompt_totals[ig.kind_index(kind)]
        assert (want > 0).any() and (want < 0).any()  # a signed denominator would differ
        err = float((got - want).abs().sum() / want.abs().sum())
        assert err > 1e-4  # one node: far from complete, so the value is a real test
        assert done[kind] == pytest.approx(err, rel=1e-8)
    with torch.no_grad():
        change = answer_logprob(ft(batch.tokens), batch) - answer_logprob(base(batch.tokens), batch)
    total = ig.prompt_totals[0].sum((1, 2)) + ig.other
    err = float((total - change).abs().sum() / change.abs().sum())
    assert done["informative"] == pytest.approx(err, rel=1e-8)


def test_prompts_whose_misses_cancel_do_not_look_complete():
    """Two prompts whose informative sums miss their changes with opposite signs: summed over
    prompts first the misses cancel; per prompt they are counted (#42, science review)."""
    base, ft = make_pair("ln_gelu", torch.float64, delta_scale=0.3)
    diff = WeightDiff.from_models(base, ft)
    batch = small_batch(base, n=8)
    ig = integrated_scores(base, diff, batch, kinds=("informative",), steps=1, rule="midpoint")
    with torch.no_grad():
        change = answer_logprob(ft(batch.tokens), batch) - answer_logprob(base(batch.tokens), batch)
    miss = ig.prompt_totals[0].sum((1, 2)) + ig.other - change
    pos, neg = int(miss.argmax()), int(miss.argmin())
    assert miss[pos] > 0 > miss[neg], "no two prompts miss with opposite signs"
    pair = integrated_scores(base, diff, batch, kinds=("informative",), steps=1,
                             rule="midpoint", rows=[pos, neg])  # fmt: skip
    e, c = miss[[pos, neg]], change[[pos, neg]]
    per_prompt = float(e.abs().sum() / c.abs().sum())
    signed = float(e.sum().abs() / c.sum().abs())
    assert pair.metadata["integrated"]["completeness"]["informative"] == pytest.approx(per_prompt)
    assert per_prompt > 2 * signed or per_prompt > signed + 0.05  # the cancellation is real

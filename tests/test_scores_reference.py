"""Every linear score, per (component, token), in both conventions, against an independent
reference built on TransformerLens hooks, autograd and ``torch.func.jvp`` (tests/reference.py).

These are the tests that mis-crediting fails: a score moved to another head, layer or position,
a flipped sign or a dropped term changes some cell.
"""

from __future__ import annotations

import pytest
import torch

from extractive_lens import WeightDiff, causal_scores, linear_scores
from extractive_lens.rewards import answer_logprob, logit_margin
from tests import reference as ref
from tests.conftest import make_pair
from tests.helpers import small_batch


def _close(got, want, tol=1e-9):
    scale = want.abs().max()
    assert scale > 0, "the reference is all zeros: the test could not fail"
    err = (got - want).abs().max() / scale
    assert err < tol, f"relative error {err:.2e}"


def test_paper_informative_per_token(family):
    base, ft = make_pair(family, torch.float64)
    diff = WeightDiff.from_models(base, ft)
    batch = small_batch(base)
    got = linear_scores(base, diff, batch, kinds=("informative",), reward="answer_logprob")
    want = ref.linear_informative_paper(base, diff, batch, answer_logprob)
    _close(got.prompt_values[0], want)


def test_paper_downstream_and_upstream_per_token(family):
    base, ft = make_pair(family, torch.float64)
    diff = WeightDiff.from_models(base, ft)
    batch = small_batch(base)
    got = linear_scores(
        base, diff, batch, kinds=("upstream", "downstream"), reward="answer_logprob"
    )
    down, up = ref.linear_downstream_upstream_paper(base, ft, batch, answer_logprob)
    _close(got.prompt_values[1], down)
    _close(got.prompt_values[0], up)


def _no_ln1(base, ft):
    diff = WeightDiff.from_models(base, ft)
    return WeightDiff({n: d for n, d in diff.deltas.items() if ".ln1." not in n}, diff.signature)


def test_authors_informative_per_token_all_four_matrices():
    """Q and O parts at the query/output position, K and V parts at the key position."""
    base, ft = make_pair("ln_gelu", torch.float64)
    diff = _no_ln1(base, ft)
    batch = small_batch(base)
    got = linear_scores(base, diff, batch, kinds=("informative",), convention="authors_code")
    want = ref.authors_informative(base, diff, batch, logit_margin)
    _close(got.prompt_values[0, :, :, : base.cfg.n_heads], want)
    # only W_O changed: the authors' score still credits it to the head (not to "other")
    only_o = WeightDiff({n: d for n, d in diff.deltas.items() if n.endswith("W_O")}, diff.signature)
    got_o = linear_scores(base, only_o, batch, kinds=("informative",), convention="authors_code")
    _close(
        got_o.prompt_values[0, :, :, : base.cfg.n_heads],
        ref.authors_informative(base, only_o, batch, logit_margin),
    )
    assert got_o.other.abs().max() < 1e-12


def test_authors_informative_per_token_grouped_query():
    """Grouped-query attention (4 query heads, 2 key/value heads, rotary, RMS): Q and O parts at
    the query position, each head's K and V parts at the key position through its own copy of
    the group's keys and values, against the closed form on TransformerLens hooks with K/V
    expanded per query head."""
    base, ft = make_pair("rms_gated_rotary_gqa", torch.float64)
    ref.hooked_only(base)  # a bridge refuses this score (tests/test_linear.py checks it says so)
    diff = _no_ln1(base, ft)
    batch = small_batch(base)
    got = linear_scores(base, diff, batch, kinds=("informative",), convention="authors_code")
    want = ref.authors_informative(base, diff, batch, logit_margin)
    assert want.abs().max() > 1e-3
    _close(got.prompt_values[0, :, :, : base.cfg.n_heads], want)
    assert base.cfg.ungroup_grouped_query_attention is False  # restored


@pytest.mark.parametrize("part", ["K", "V"])
def test_authors_group_parts_add_up_to_the_groups_change(part):
    """Only one key/value group's shared W_K (or W_V) changes: the heads of that group carry the
    whole first-order change of R between them (their sum over heads and positions is the
    derivative along that ΔK / ΔV, by central differences through the model's own forward),
    each head its own share, and the other group's heads carry nothing."""
    base, ft = make_pair("rms_gated_rotary_gqa", torch.float64)
    ref.hooked_only(base)  # a bridge refuses this score (tests/test_linear.py checks it says so)
    full = WeightDiff.from_models(base, ft)
    name = f"blocks.1.attn._W_{part}"
    delta = torch.zeros_like(full.deltas[name])
    delta[1] = full.deltas[name][1]  # key/value head 1: query heads 2 and 3
    diff = WeightDiff({name: delta}, full.signature)
    batch = small_batch(base)
    got = linear_scores(base, diff, batch, kinds=("informative",), convention="authors_code")
    per_head = got.prompt_totals[0, :, 1, : base.cfg.n_heads]  # [prompt, head]
    eps = 1e-6
    with torch.no_grad():
        with diff.applied(base, scale=eps):
            up = logit_margin(base(batch.tokens), batch)
        with diff.applied(base, scale=-eps):
            down = logit_margin(base(batch.tokens), batch)
    jvp = (up - down) / (2 * eps)
    assert torch.allclose(per_head[:, 2:].sum(-1), jvp, rtol=1e-6, atol=1e-9)
    assert per_head[:, :2].abs().max() == 0
    assert (per_head[:, 2] - per_head[:, 3]).abs().max() > 1e-6  # each head its own share
    assert got.other.abs().max() < 1e-12


@pytest.mark.parametrize("family", ["ln_gelu", "parallel_rotary", "rms_gated_rotary_gqa"])
def test_authors_downstream_and_upstream_per_token(family):
    base, ft = make_pair(family, torch.float64)
    diff = WeightDiff.from_models(base, ft)
    batch = small_batch(base)
    got = linear_scores(
        base,
        diff,
        batch,
        kinds=("upstream", "downstream"),
        convention="authors_code",
        ablation="zero",
    )
    down, up = ref.linear_downstream_upstream_authors(base, ft, batch, logit_margin)
    _close(got.prompt_values[1], down)
    _close(got.prompt_values[0], up)


@pytest.mark.parametrize("family", ["ln_gelu", "rms_gated_rotary_gqa", "parallel_rotary"])
def test_whole_component_informative_is_a_weight_swap(family):
    """Swapping one component's weights into the base model changes R by its exact informative
    total, when nothing it owns is shared (no ln1 change; for GQA, no K/V change)."""
    base, ft = make_pair(family, torch.float64, delta_scale=0.2)
    batch = small_batch(base, n=3)
    diff = WeightDiff.from_models(base, ft)
    shared = (".ln1.", "_W_K", "_W_V", "_b_K", "_b_V")
    own = WeightDiff(
        {n: d for n, d in diff.deltas.items() if not any(s in n for s in shared)}, diff.signature
    )
    ex = causal_scores(base, own, batch, kinds=("informative",), per="component")
    R0 = answer_logprob(base(batch.tokens), batch)
    H = base.cfg.n_heads
    for label, layer, col in (("L1H2", 1, 2), ("L0H1", 0, 1), ("L0MLP", 0, H), ("L1MLP", 1, H)):
        with torch.no_grad(), own.applied(base, components=[label]):
            swapped = answer_logprob(base(batch.tokens), batch) - R0
        assert swapped.abs().max() > 1e-6
        assert torch.allclose(ex.prompt_totals[0, :, layer, col], swapped, atol=1e-10), label

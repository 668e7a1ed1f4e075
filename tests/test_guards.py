"""Guards: the attention-sink case rebuilt (a first position whose MLP output dwarfs the rest,
names of different token lengths, no BOS) is flagged in every method, and clean with a BOS;
an outsized cell is flagged; flags reach the verdicts and the report."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from extractive_lens import (
    WeightDiff,
    causal_scores,
    compare,
    integrated_scores,
    linear_scores,
    make_batch,
    tiny_model,
)
from extractive_lens.guards import CELL_LIMIT, sink_roles
from tests.conftest import needs_hooked

pytestmark = needs_hooked  # the sink is planted through HookedTransformer weight names

CFG = dict(
    normalization_type="LN", act_fn="gelu", positional_embedding_type="standard",
    dtype=torch.float64,
)  # fmt: skip
NAMES = [[11, 12], [13, 14, 15], [16, 17], [18, 19, 20, 21]]  # 2-4 tokens each


def _sink(model):
    """A neuron of layer 0 that fires only at position 0 and writes 50x a unit vector there."""
    g = torch.Generator().manual_seed(1)
    d = torch.randn(model.cfg.d_model, generator=g, dtype=torch.float64)
    u = torch.randn(model.cfg.d_model, generator=g, dtype=torch.float64)
    with torch.no_grad():
        model.W_pos[0] = 20 * d / d.norm()
        model.blocks[0].mlp.W_in[:, 0] = 2 * d / d.norm()
        model.blocks[0].mlp.b_in[0] = -6.0
        model.blocks[0].mlp.W_out[0] = 50 * u / u.norm()


@pytest.fixture(scope="module")
def sink_pair():
    base, ft = tiny_model(CFG, seed=0), tiny_model(CFG, seed=0)
    _sink(base)
    _sink(ft)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in ft.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return base, WeightDiff.from_models(base, ft)


def _batch(model, bos: bool):
    pairs, roles = [], []
    for i, name in enumerate(NAMES):
        r = [f"{{name}}[-{len(name) - j}]" for j in range(len(name))] + ["lives", "in"]
        ids = name + [30, 31]
        if bos:  # token 1 as the BOS, in every prompt
            ids, r = [1, *ids], ["<bos>", *r]
        pairs.append((ids, [40 + i]))
        roles.append(r)
    return make_batch(model, pairs, roles=roles, prepend_bos=False)


def test_the_sink_dwarfs_the_other_positions(sink_pair):
    base, _ = sink_pair
    _, cache = base.run_with_cache(torch.tensor([[11, 12, 30, 31]]))
    out = cache["blocks.0.hook_mlp_out"][0].norm(dim=-1)
    assert out[0] > 20 * out[1:].max()


@pytest.mark.parametrize("method", ["linear", "causal", "integrated"])
def test_the_sink_case_is_flagged_without_bos_and_clean_with_it(sink_pair, method):
    base, diff = sink_pair
    run = {
        "linear": lambda b: linear_scores(base, diff, b),
        "causal": lambda b: causal_scores(base, diff, b, kinds=("upstream", "downstream")),
        "integrated": lambda b: integrated_scores(base, diff, b, kinds="upstream", steps=2),
    }[method]
    flags = run(_batch(base, bos=False)).flags
    what = {f.what for f in flags}
    assert {"sink_role", "ablation_across_kinds"} <= what
    sink = next(f for f in flags if f.what == "sink_role")
    assert set(sink.where) == {"{name}[-2]", "{name}[-3]"}  # first in some prompts only
    assert "prepend_bos=True" in sink.message
    assert run(_batch(base, bos=True)).flags == ()


def test_sink_roles_by_hand():
    assert sink_roles([("a", "b", "c"), ("b", "c"), ("x", "a")]) == ["a", "b"]
    assert sink_roles([("<bos>", "a"), ("<bos>", "b", "a")]) == []


def test_an_outsized_cell_is_flagged_and_reaches_verdicts_and_report(sink_pair, tmp_path):
    from extractive_lens.plotting import report

    base, diff = sink_pair
    batch = _batch(base, bos=True)
    lin = linear_scores(base, diff, batch, kinds=("informative", "downstream"))
    assert lin.flags == ()
    change = lin.metadata["additivity"]["exact_change"]
    others = float(lin.totals[0].sum() - lin.totals[0, 1, -1])  # the kind without L1MLP
    scale = max(abs(change), abs(others))
    values = lin.values.clone()
    at = lin.position_labels.index("lives")
    values[0, 1, -1, at] = 1.01 * CELL_LIMIT * scale  # just past the limit
    bad = dataclasses.replace(lin, values=values)
    flags = bad.flags
    assert [f.what for f in flags] == ["outsized_cell"] and flags[0].kind == "informative"
    assert flags[0].where == ("L1MLP@lives",)
    under = values.clone()
    under[0, 1, -1, at] = 0.99 * CELL_LIMIT * scale  # just under it
    assert dataclasses.replace(lin, values=under).flags == ()
    cmp = compare(bad, lin)
    assert "Flagged:" in cmp.verdicts["informative"]
    assert "Flagged:" not in cmp.verdicts["downstream"]
    page = report(bad, cmp, tmp_path / "r.html").read_text()
    assert "outsized_cell" in page and "L1MLP@lives" in page


def test_an_outsized_whole_component_is_flagged_though_no_cell_is(sink_pair):
    """One component carrying many times what the rest of its kind and the whole change add up
    to (the real-model case: linear upstream's L11MLP at +76 nats for a change of +13): flagged
    by its label although none of its cells passes the limit, and although it dominates the
    kind's own total (which must not raise its limit)."""
    base, diff = sink_pair
    lin = linear_scores(base, diff, _batch(base, bos=True), kinds=("informative", "downstream"))
    change = lin.metadata["additivity"]["exact_change"]
    others = float(lin.totals[0].sum() - lin.totals[0, 1, 2])  # the kind without L1H2
    scale = max(abs(change), abs(others))
    n_pos = lin.values.shape[-1]
    totals, values = lin.totals.clone(), lin.values.clone()
    for factor, flagged in ((1.05, True), (0.95, False)):
        big = factor * CELL_LIMIT * scale
        totals[0, 1, 2] = big  # L1H2's whole score, beside the rest of the kind ...
        values[0, 1, 2] = big / n_pos  # ... spread over its positions, each under the limit
        assert float(values[0].abs().max()) < CELL_LIMIT * scale
        flags = dataclasses.replace(lin, totals=totals, values=values).flags
        got = [(f.what, f.kind, f.where) for f in flags]
        assert got == ([("outsized_cell", "informative", ("L1H2",))] if flagged else []), factor
        assert not flagged or f"L1H2 at {big:+.4g}" in flags[0].message

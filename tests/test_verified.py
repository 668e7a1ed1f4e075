"""verified_scores: provenance that matches the cells, an audit drawn from every component
(not linear's favourites), estimates that are compare()'s on a census and whose intervals hold
the full exact map's values, and a planted disagreement found."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

from extractive_lens import (
    WeightDiff,
    causal_scores,
    compare,
    integrated_scores,
    linear_scores,
    verified_scores,
)
from extractive_lens.scoring.counting import counting_passes
from extractive_lens.scoring.verified import OverBudgetWarning
from tests.conftest import make_pair
from tests.helpers import small_batch

KINDS = ("informative", "downstream")


@pytest.fixture(scope="module")
def world():
    base, ft = make_pair("ln_gelu", torch.float64, delta_scale=0.1, n_layers=3)
    batch = small_batch(base, n=5)
    diff = WeightDiff.from_models(base, ft)
    lin = linear_scores(base, diff, batch, kinds=KINDS)  # a bridge checks itself on first use
    with counting_passes(base, batch) as count:
        lin = linear_scores(base, diff, batch, kinds=KINDS)
    full = causal_scores(base, diff, batch, kinds=KINDS)  # the whole exact map, once
    return base, diff, batch, lin, full, count.passes


def _verified(world, lin=None, **kw):
    base, diff, batch, lin0, _, passes = world
    kw.setdefault("n_boot", 200)
    return verified_scores(base, diff, batch, kinds=KINDS, linear=lin or lin0,
                           linear_passes=passes, **kw)  # fmt: skip


def test_every_cell_holds_what_its_provenance_says(world):
    base, diff, batch, lin, full, _ = world
    v = _verified(world, audit=3, coverage=0.5, seed=1, tolerance=100.0)  # nothing integrated
    assert v.method == "verified"
    for k, kind in enumerate(KINDS):
        prov = v.provenance(kind)
        assert prov.shape == tuple(v.values.shape[1:])
        exact, linear = prov == "exact", prov == "linear"
        assert exact.any() and linear.any()
        got, want_ex, want_lin = (t[k].numpy() for t in (v.values, full.values, lin.values))
        assert np.allclose(got[exact], want_ex[exact])
        assert np.allclose(got[linear], want_lin[linear])
        # a linear cell is not exact's value (else provenance could be anything)
        assert not np.allclose(got[linear], want_ex[linear])
    v = _verified(world, audit=2, coverage=0.5, seed=1, tolerance=0.0)  # integrate the rest
    ig = integrated_scores(base, diff, batch, kinds=KINDS, steps=4)
    for k, kind in enumerate(KINDS):
        prov = v.provenance(kind)
        assert (prov == "integrated").any()
        cells = prov == "integrated"
        assert np.allclose(v.values[k].numpy()[cells], ig.values[k].numpy()[cells])


def test_a_census_gives_compare_s_numbers(world):
    """Auditing every component, the estimates are the full map's statistics."""
    *_, lin, full, _ = world
    v = _verified(world, audit=100, coverage=0.3)
    cmp = compare(lin, full)
    for kind in KINDS:
        row = next(r for r in cmp.rows if (r["kind"], r["part"]) == (kind, "all"))
        e = v.metadata["verified"]["estimates"][kind]
        assert e["r"][0] == pytest.approx(row["pearson"], abs=1e-9)
        assert e["slope"][0] == pytest.approx(row["slope"], abs=1e-9)
        top = v.metadata["verified"]["kinds"][kind]["top"]
        ex = full.values[full.kind_index(kind)].abs().double()
        outside = ex.flatten(0, 1).sum(-1)
        outside[top] = 0
        assert e["missed_mass"][0] == pytest.approx(float(outside.sum() / ex.sum()))


def test_the_estimates_weight_each_audited_component_by_its_stratum(world):
    """A partial audit's estimates, recomputed cell by cell: the top components weigh 1, an
    audited component ``N_h / n_h`` (the components outside the top set in its stratum, one
    stratum per layer and type here, over the ones audited there); r and slope over every
    cell, missed mass the weighted exact |mass| outside the top set."""
    *_, lin, full, _ = world
    v = _verified(world, audit=2, coverage=0.5, seed=2)
    n_layers, n_comp = lin.totals.shape[1:]
    for k, kind in enumerate(KINDS):
        plan = v.metadata["verified"]["kinds"][kind]
        top, audited = set(plan["top"]), plan["audited"]
        stratum = {c: (c // n_comp, lin.component_labels[c % n_comp] == "MLP")
                   for c in range(n_layers * n_comp)}  # fmt: skip
        weight = {c: 1.0 for c in top}
        for c in audited:
            size = sum(1 for d in stratum if d not in top and stratum[d] == stratum[c])
            drawn = sum(1 for d in audited if stratum[d] == stratum[c])
            weight[c] = size / drawn
        assert any(w != 1.0 for w in weight.values())  # a partial audit: weights that matter
        sums = dict.fromkeys(("n", "x", "y", "xx", "yy", "xy", "out", "all"), 0.0)
        for c, w in weight.items():
            layer, comp = divmod(c, n_comp)
            for pos in range(lin.values.shape[-1]):
                x = float(lin.values[k, layer, comp, pos])
                y = float(full.values[k, layer, comp, pos])
                if not (math.isfinite(x) and math.isfinite(y)):
                    continue
                for key, val in (("n", 1), ("x", x), ("y", y), ("xx", x * x), ("yy", y * y),
                                 ("xy", x * y), ("all", abs(y))):  # fmt: skip
                    sums[key] += w * val
                sums["out"] += 0.0 if c in top else w * abs(y)
        n = sums["n"]
        cov = sums["xy"] - sums["x"] * sums["y"] / n
        r = cov / math.sqrt((sums["xx"] - sums["x"] ** 2 / n) * (sums["yy"] - sums["y"] ** 2 / n))
        e = plan["estimates"]
        assert e["r"][0] == pytest.approx(r, rel=1e-9)
        assert e["slope"][0] == pytest.approx(sums["xy"] / sums["yy"], rel=1e-9)
        assert e["missed_mass"][0] == pytest.approx(sums["out"] / sums["all"], rel=1e-9)


def test_a_census_has_compare_s_intervals(world):
    """Auditing every component leaves only the prompts' doubt: the intervals are
    ``compare(...).ci()``'s with the same seed (resampling a census's components would add
    doubt a census does not have; resampling cells, or ignoring the seed, would move them)."""
    *_, lin, full, _ = world
    for seed in (0, 4):
        v = _verified(world, audit=100, coverage=0.3, seed=seed, n_boot=150)
        table = compare(lin, full).ci(n_boot=150, seed=seed)
        for kind in KINDS:
            e = v.metadata["verified"]["estimates"][kind]
            for name, statistic in (("r", "pearson"), ("slope", "slope")):
                row = table[
                    (table.kind == kind) & (table.part == "all") & (table.statistic == statistic)
                ]
                assert e[name][1] == pytest.approx(row.low.item(), abs=1e-9), (seed, kind, name)
                assert e[name][2] == pytest.approx(row.high.item(), abs=1e-9), (seed, kind, name)


def test_the_audit_s_resamples_have_the_stratified_estimator_s_variance():
    """One stratum of ``N`` components, ``n`` audited: the resamples' totals vary as the
    stratified estimator ``N * mean(y)`` does over the audits one could have drawn,
    ``N^2 (1 - n/N) s^2 / n`` (Cochran 5.2), counted here by enumerating every audit."""
    import itertools

    from extractive_lens.scoring.verified import _audit_weights

    y_all = torch.tensor([0.1, 2.0, -1.0, 0.5, 3.0, 0.0, 1.2], dtype=torch.float64)
    N = len(y_all)
    for n in (2, 3, 5):
        totals = [float(N * y_all[list(c)].mean()) for c in itertools.combinations(range(N), n)]
        design_var = float(np.var(totals))  # over every audit of size n, equally likely
        # the bootstrap's variance, averaged over the audits, estimates it
        boot_vars = []
        for c in itertools.combinations(range(N), n):
            w = _audit_weights(n, N, 4000, torch.Generator().manual_seed(n))
            boot_vars.append(float((w[1:] @ y_all[list(c)]).var()))
        assert np.mean(boot_vars) == pytest.approx(design_var, rel=0.05), n
        assert torch.allclose(w[0], torch.full((n,), N / n, dtype=torch.float64))
    census = _audit_weights(4, 4, 50, torch.Generator().manual_seed(0))
    assert torch.equal(census, torch.ones(51, 4, dtype=torch.float64))  # no audit doubt


def test_the_verdict_names_the_check_that_failed():
    from extractive_lens.scoring.verified import _verdict

    def verdict(r, slope, missed):
        plan = dict(top=[1, 2], integrated=[], estimates=dict(r=r, slope=slope,
                                                              missed_mass=missed, audited=4))  # fmt: skip
        return _verdict("downstream", plan)

    good_r, good_slope, good_missed = [0.99, 0.95, 1.0], [1.0, 0.9, 1.1], [0.1, 0.05, 0.15]
    assert "can stand in" in verdict(good_r, good_slope, good_missed)
    only_missed = verdict(good_r, good_slope, [0.17, 0.12, 0.25])
    assert "ranks as exact does" in only_missed and "up to 25% of the exact mass" in only_missed
    assert "values are off" not in only_missed  # the slope passed: its values are not the issue
    only_slope = verdict(good_r, [0.7, 0.6, 0.8], good_missed)
    assert "values are off" in only_slope and "exact mass (past" not in only_slope
    both = verdict(good_r, [0.7, 0.6, 0.8], [0.3, 0.2, 0.4])
    assert "values are off" in both and "up to 40%" in both
    just_past = verdict(good_r, good_slope, [0.18, 0.15, 0.2003])
    assert "up to 20.03% of the exact mass (past 20%)" in just_past
    low_r = verdict([0.9, 0.5, 0.95], good_slope, good_missed)
    assert "cannot be read on its own (r's lower bound 0.50 is under 0.9)" in low_r


def test_the_intervals_hold_the_full_map_values(world):
    *_, lin, full, _ = world
    cmp = compare(lin, full)
    v = _verified(world, audit=4, coverage=0.5, seed=3, n_boot=400)
    for kind in KINDS:
        row = next(r for r in cmp.rows if (r["kind"], r["part"]) == (kind, "all"))
        e = v.metadata["verified"]["estimates"][kind]
        assert e["r"][1] <= row["pearson"] <= e["r"][2]
        assert e["slope"][1] <= row["slope"] <= e["slope"][2]
        assert e["r"][2] - e["r"][1] > 0  # a partial audit leaves doubt
        assert kind in v.metadata["verified"]["kinds"][kind]["verdict"]


def test_a_planted_disagreement_is_found_by_the_audit(world):
    """An MLP whose linear score is zeroed is outside linear's top set; only the audit, drawn
    from all the other components (each layer's MLP its own stratum), can find it."""
    *_, lin, full, _ = world
    k = lin.kind_index("downstream")
    ex_mlp = full.totals[k][:, -1].abs()
    layer = int(ex_mlp.argmax())
    values, pv = lin.values.clone(), lin.prompt_values.clone()
    values[k, layer, -1] = 0.0
    pv[k, :, layer, -1] = 0.0
    zeroed = dataclasses.replace(lin, values=values, prompt_values=pv)
    v = _verified(world, lin=zeroed, audit=2, coverage=0.6, seed=0)
    plan = v.metadata["verified"]["kinds"]["downstream"]
    c = layer * len(lin.component_labels) + len(lin.component_labels) - 1
    assert c not in plan["top"] and c in plan["audited"] and c in plan["disagreeing"]
    assert v.provenance("downstream")[layer, -1, 0] == "exact"
    assert torch.allclose(v.values[k, layer, -1], full.values[k, layer, -1])
    assert plan["estimates"]["missed_mass"][0] > 0


def test_the_audit_reaches_every_component_outside_the_top(world):
    seen = set()
    for seed in range(6):
        plan = _verified(world, audit=2, coverage=0.5, seed=seed, n_boot=20).metadata["verified"]
        top = plan["kinds"]["informative"]["top"]
        audited = plan["kinds"]["informative"]["audited"]
        assert not set(top) & set(audited)
        seen |= set(audited)
    rest = set(range(15)) - set(top)
    assert seen == rest  # not only the components linear ranks next


def test_a_pass_is_the_batch_through_every_piece_once(world):
    """Counted against tokens by hand: the whole batch through every block is 1 forward, a
    forward resumed after layer l (or after its heads) the share of pieces left, half the rows
    half as much, and a backward through the whole forward 1 backward."""
    from extractive_lens import backend as B
    from extractive_lens.backend.blocks import run_blocks

    base, _, batch, *_ = world
    L = base.cfg.n_layers
    x = B.embed(base, batch.tokens).detach()
    for start, want in (((0, "pre"), 1.0), ((0, "post"), (L - 1) / L),
                        ((1, "mid"), (L - 1.5) / L), ((L - 1, "post"), 0.0)):  # fmt: skip
        with torch.no_grad(), counting_passes(base, batch) as count:
            run_blocks(base, x, start=start)
        assert count.forward == pytest.approx(want) and count.backward == 0.0
    with torch.no_grad(), counting_passes(base, batch) as count:
        run_blocks(base, x[: len(batch) // 2 or 1])
    assert count.forward == pytest.approx((len(batch) // 2 or 1) / len(batch))
    with counting_passes(base, batch) as count:
        run_blocks(base, x.requires_grad_()).sum().backward()
    assert (count.forward, count.backward, count.passes) == pytest.approx((1.0, 1.0, 2.0))


def test_the_budget_is_in_linear_s_passes(world):
    base, diff, batch, lin, _, passes = world
    # computed inside, linear's passes are counted: the same count as around linear_scores
    v = verified_scores(base, diff, batch, kinds=KINDS, budget=200.0, n_boot=20)
    meta = v.metadata["verified"]
    assert meta["unit"] == "passes" and meta["linear_cost"] == pytest.approx(passes)
    assert meta["allowed"] == pytest.approx(200 * passes) and not meta["over_budget"]
    assert meta["spent"] == pytest.approx(meta["passes"]["total"])
    assert meta["spent"] <= meta["allowed"]
    # a generous budget audits every component outside the top set (15 in all)
    for p in meta["kinds"].values():
        assert sorted(p["top"] + p["audited"]) == list(range(15)), p
    # too small for the top set and the smallest audit: spent anyway, recorded and warned
    with pytest.warns(OverBudgetWarning, match=r"budget=\d") as said:
        v = _verified(world, budget=1.5, coverage=0.5, seed=0, n_boot=20)
    meta = v.metadata["verified"]
    assert meta["over_budget"] and meta["spent"] > meta["allowed"]
    assert meta["allowed"] == pytest.approx(1.5 * passes)
    needed = float(str(said[0].message).split("budget=")[1].split(" ")[0].rstrip(","))
    assert needed * passes >= sum(p["least_cost"] for p in meta["kinds"].values()) + passes
    with pytest.raises(ValueError, match="linear_passes="):
        verified_scores(base, diff, batch, kinds=KINDS, linear=lin)


def test_estimate_counts_the_budget_s_passes_before_it_runs(world):
    """On a narrow copy of the model (its prompts all of the batch's padded length): linear's
    passes near the ones counted on the model, and verified's said in the same unit."""
    from extractive_lens import estimate

    base, diff, batch, *_, passes = world
    e = estimate(base, diff, batch, "linear", kinds=KINDS)
    assert sum(e.batch_passes) == pytest.approx(passes, rel=0.25)
    assert e.batch_passes[1] > 0  # linear's backward
    e = estimate(base, diff, batch, "verified", kinds=KINDS, budget=3.0)
    assert sum(e.batch_passes) > passes and "budget's unit" in str(e)


def test_bad_budgets_are_refused(world):
    with pytest.raises(ValueError, match="budget"):
        _verified(world, budget="soon")
    with pytest.raises(ValueError, match="budget"):
        _verified(world, budget=0.5)


def test_the_report_draws_provenance_and_intervals(world, tmp_path):
    from extractive_lens import verified_plots as vp
    from extractive_lens.plotting import report

    *_, lin, full, _ = world
    v = _verified(world, audit=2, coverage=0.5, seed=1, tolerance=100.0)
    fig = vp.provenance_map(v, "downstream")
    marks = {t.name: set(zip(t.y, t.x)) for t in fig.data[1:]}
    prov = v.provenance("downstream")[..., 0]
    comps = v.component_labels
    want = {(f"L{i}", comps[j]) for i, j in zip(*np.nonzero(prov == "exact"))}
    assert marks["exact"] == want and marks["integrated"] == set()
    bars = vp.interval_bars(lin, "informative", k=3)
    ci = lin.ci("totals")
    top = lin.top(3, "informative")
    assert list(bars.data[0].x) == [lab for _, lab, _ in top]
    layer, comp = int(top[0][1][1]), lin.component_labels.index(top[0][1][2:])
    hi = float(ci.high[0, layer, comp]) - top[0][2]
    assert bars.data[0].error_y.array[0] == pytest.approx(hi)
    page = report(v, path=tmp_path / "v.html").read_text()
    assert "agreement over the whole map" in page and "square-open" in page


def test_the_report_command_reads_what_score_method_verified_saved(world, tmp_path):
    # `score --method verified --out o` saves o/verified/; `report o` looked only in linear/,
    # integrated/ and causal/ and said "o holds no saved scores"
    from typer.testing import CliRunner

    from extractive_lens.cli import app

    _verified(world, audit=3, coverage=0.5, seed=1, tolerance=100.0).save(tmp_path / "verified")
    res = CliRunner().invoke(app, ["report", str(tmp_path)])
    assert res.exit_code == 0, res.output
    assert (tmp_path / "report.html").is_file()


def test_distributed_verified_is_one_sentence_naming_what_to_do(world, monkeypatch):
    """Shards of the prompts would each draw their own audit: the table's entry refuses."""
    import torch.distributed as dist

    from extractive_lens.distributed import distributed_scores

    base, diff, batch, *_ = world
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    with pytest.raises(ValueError, match=r"in one process .* distributed and compare them\.$"):
        distributed_scores("verified", base, diff, batch, kinds=KINDS)

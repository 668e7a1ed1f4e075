"""Bootstrap intervals over prompts: against literal resampling loops (pandas / numpy), and
the case that tells prompts from cells."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from extractive_lens import WeightDiff, causal_scores, compare, linear_scores, stats
from extractive_lens.results import aggregate_by_role
from tests.conftest import make_pair
from tests.helpers import small_batch


@pytest.fixture(scope="module")
def scored():
    base, ft = make_pair("ln_gelu", torch.float64, delta_scale=0.2)
    batch = small_batch(base, n=5)  # lengths 4..6: roles missing in some prompts
    diff = WeightDiff.from_models(base, ft)
    return base, diff, batch, linear_scores(base, diff, batch)


def test_bootstrap_mean_matches_a_literal_loop():
    x = torch.randn(7, 3, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    ci = stats.bootstrap(x, n_boot=200, seed=4, level=0.9)
    idx = stats.draws(7, 200, 4).numpy()
    means = np.stack([x.numpy()[i].mean(0) for i in idx])
    assert np.allclose(ci.estimate.numpy(), x.numpy().mean(0))
    assert np.allclose(ci.low.numpy(), np.quantile(means, 0.05, axis=0))
    assert np.allclose(ci.high.numpy(), np.quantile(means, 0.95, axis=0))
    custom = stats.bootstrap(x[:, 0], lambda r: r.median(), n_boot=50, seed=4)
    meds = [float(x[:, 0][i].median()) for i in stats.draws(7, 50, 4)]
    assert custom.low.item() == pytest.approx(np.quantile(meds, 0.025))
    again = stats.bootstrap(x, n_boot=200, seed=4, level=0.9)
    assert torch.equal(again.low, ci.low)  # seeded
    assert not torch.equal(stats.bootstrap(x, n_boot=200, seed=5, level=0.9).low, ci.low)
    with pytest.raises(ValueError, match="level"):
        stats.bootstrap(x, level=95)


def _resampled_frame(scores, idx):
    """The per-prompt table of the prompts ``idx`` (repeats kept), as a new prompt set."""
    df = scores.to_dataframe()
    parts = [df[df.prompt == p].assign(prompt=j) for j, p in enumerate(idx)]
    import pandas as pd

    return pd.concat(parts)


def test_score_intervals_resample_prompts_as_a_pandas_loop(scored):
    *_, s = scored
    n_boot = 40
    ci = s.ci(n_boot=n_boot, seed=2)
    assert ci.estimate.shape == s.values.shape and ci.n == s.n_prompts
    assert torch.allclose(ci.estimate, s.values.double())
    maps = []
    for idx in stats.draws(s.n_prompts, n_boot, 2).tolist():
        df = _resampled_frame(s, idx)
        means = df.groupby(["kind", "layer", "component", "role"])["score"].mean()
        m = np.full(tuple(s.values.shape), np.nan)
        for (kind, layer, comp, role), v in means.items():
            m[
                s.kinds.index(kind),
                layer,
                s.component_labels.index(comp),
                s.position_labels.index(role),
            ] = v
        maps.append(m)
    maps = np.stack(maps)
    lo = np.nanquantile(maps, 0.025, axis=0)
    assert np.allclose(ci.low.numpy(), lo, equal_nan=True)
    assert np.allclose(ci.high.numpy(), np.nanquantile(maps, 0.975, axis=0), equal_nan=True)
    tot = s.ci("totals", n_boot=n_boot, seed=2)
    per = s.prompt_totals.double().numpy()
    sums = np.stack([per[:, i].mean(1) for i in stats.draws(s.n_prompts, n_boot, 2).numpy()])
    assert np.allclose(tot.low.numpy(), np.quantile(sums, 0.025, axis=0))


def test_identical_prompts_have_no_doubt_however_the_cells_differ(scored):
    """The unit is the prompt: five copies of one prompt give zero-width intervals although the
    cells of the map differ wildly (resampling cells would give wide ones)."""
    *_, s = scored
    one = s.prompt_values[:, :1]
    copies = dataclasses.replace(
        s,
        prompt_values=one.expand(-1, 5, -1, -1, -1).clone(),
        prompt_totals=s.prompt_totals[:, :1].expand(-1, 5, -1, -1).clone(),
        prompt_roles=(s.prompt_roles[0],) * 5,
        position_labels=s.prompt_roles[0],
        values=one[:, 0, ..., : len(s.prompt_roles[0])].clone(),
        totals=s.prompt_totals[:, 0].clone(),
        other=None,
    )
    ci = copies.ci(n_boot=100)
    assert copies.values.abs().max() > 0 and copies.values.std() > 0
    assert torch.allclose(ci.low, ci.high) and torch.allclose(ci.low, copies.values.double())
    assert float(s.ci(n_boot=100).width.nan_to_num(0).max()) > 0  # differing prompts: doubt


def test_comparison_intervals_match_comparisons_of_resampled_prompts(scored):
    base, diff, batch, lin = scored
    ex = causal_scores(base, diff, batch, kinds=("informative", "downstream"))
    cmp = compare(lin, ex)
    n_boot = 12
    table = cmp.ci(n_boot=n_boot, seed=1)
    assert set(table.statistic) >= {"pearson", "spearman", "slope"}
    pearsons = []
    for idx in stats.draws(lin.n_prompts, n_boot, 1).tolist():
        pair = [_resample(r, idx) for r in (lin, ex)]
        row = next(
            r for r in compare(*pair).rows if (r["kind"], r["part"]) == ("informative", "all")
        )
        pearsons.append(row["pearson"])
    got = table[
        (table.kind == "informative") & (table.part == "all") & (table.statistic == "pearson")
    ]
    assert got.low.item() == pytest.approx(np.quantile(pearsons, 0.025))
    assert got.high.item() == pytest.approx(np.quantile(pearsons, 0.975))
    assert got.estimate.item() == pytest.approx(cmp.rows[0]["pearson"])
    same = compare(lin, lin).ci(n_boot=20)
    r = same[same.statistic == "pearson"]
    assert np.allclose(r.low, 1.0) and np.allclose(r.high, 1.0)


def _resample(s, idx):
    """``s`` as if the prompts ``idx`` had been scored (the role means recomputed)."""
    t = torch.tensor(idx)
    pv = s.prompt_values[:, t]
    roles = tuple(s.prompt_roles[i] for i in idx)
    values = aggregate_by_role(pv, roles, s.position_labels)
    drawn = {r for row in roles for r in row}
    absent = [i for i, r in enumerate(s.position_labels) if r not in drawn]
    values[..., absent] = float("nan")  # no drawn prompt has the role: no value
    return dataclasses.replace(
        s,
        prompt_values=pv,
        prompt_totals=s.prompt_totals[:, t],
        prompt_roles=roles,
        values=values,
        totals=s.prompt_totals[:, t].mean(1),
        other=None if s.other is None else s.other[t],
    )


def test_mean_rank_interval_bootstraps_the_ranks(scored):
    from extractive_lens.finetuning import mean_rank, mean_rank_interval, ranks

    base, diff, batch, _ = scored
    ci = mean_rank_interval(base, batch, diff, n_boot=100, seed=3)
    assert ci.estimate.item() == pytest.approx(mean_rank(base, batch, diff))
    r = ranks(base, batch, diff).double().numpy()
    means = [r[i].mean() for i in stats.draws(len(r), 100, 3).numpy()]
    assert ci.low.item() == pytest.approx(np.quantile(means, 0.025))

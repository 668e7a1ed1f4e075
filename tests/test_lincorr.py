"""Linear correlation of logits: synthetic logits with a known map, and the world model."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from extractive_lens.lincorr import LogitPairs, collect_logits, fit


def _synthetic(n=200, n_src=6, n_tgt=5, noise=0.01, seed=0):
    rng = np.random.default_rng(seed)
    W = rng.normal(size=(n_tgt, n_src))
    b = rng.normal(size=n_tgt)
    X = rng.normal(size=(n, n_src))
    Y = X @ W.T + b + noise * rng.normal(size=(n, n_tgt))
    pairs = LogitPairs(
        torch.tensor(X),
        torch.tensor(Y),
        tuple(f"s{i}" for i in range(n)),
        tuple(f"a{j}" for j in range(n_src)),
        tuple(f"t{j}" for j in range(n_tgt)),
    )
    return pairs, W, b


def test_recovers_known_map():
    pairs, W, b = _synthetic()
    lc = fit(pairs)
    assert np.allclose(lc.W, W, atol=0.01) and np.allclose(lc.b, b, atol=0.01)
    assert lc.label_pearson > 0.999 and lc.instance_pearson > 0.99
    ridge = fit(pairs, ridge=1.0)
    assert np.allclose(ridge.W, W, atol=0.05)
    known = {
        pairs.source_labels[j]: pairs.target_labels[int(np.argmax(W[:, j]))]
        for j in range(W.shape[1])
    }
    assert lc.precision(known) == 1.0
    assert len(lc.top_pairs(1)) == W.shape[1]
    assert np.allclose(np.array(lc.heatmap().data[0].z), lc.W)


def test_scrambled_control_is_near_zero():
    pairs, _, _ = _synthetic(n=400)
    perm = torch.randperm(len(pairs.subjects), generator=torch.Generator().manual_seed(1))
    scrambled = LogitPairs(
        pairs.source, pairs.target[perm], pairs.subjects, pairs.source_labels, pairs.target_labels
    )
    lc = fit(scrambled)
    assert abs(lc.label_pearson) < 0.2


@pytest.fixture(scope="module")
def world():
    from extractive_lens.world import load_world_model, world_of

    m = load_world_model()
    return m, world_of(m)


@pytest.fixture(scope="module")
def world_v2():
    from extractive_lens.world import load_world_model, world_of

    m = load_world_model("v2")
    return m, world_of(m)


def test_world_city_to_language_is_linear_and_precise(world_v2):
    """v2 (one-token people): city -> language is linear and precise; city -> hobby is not. (In
    v3 the city logits also carry the enriched person, hobby included, so the hobby control
    correlates there: label r 0.60 against 0.91 for language; see the README.)"""
    model, w = world_v2
    subjects = list(w.home)[:300]
    pairs = collect_logits(
        model,
        "{x} lives in",
        "The people in the city {x} is from speak",
        subjects,
        list(w.cities),
        [w.language[c] for c in w.cities],
        show_progress=False,
    )
    lc = fit(pairs, ridge=1e-2)
    hobby = collect_logits(
        model,
        "{x} lives in",
        "{x} likes",
        subjects,
        list(w.cities),
        sorted(set(w.hobby.values())),
        show_progress=False,
    )
    lc_h = fit(hobby, ridge=1e-2)
    assert lc.label_pearson > 0.6, lc.label_pearson
    assert lc.precision({c: w.language[c] for c in w.cities}) >= 0.7
    assert lc_h.label_pearson < 0.3, lc_h.label_pearson  # the world does not tie city to hobby
    assert lc.label_pearson > lc_h.label_pearson + 0.4


def test_world_v3_city_to_language_is_linear(world):
    model, w = world
    lc = fit(
        collect_logits(
            model,
            "{x} lives in",
            "The people in the city {x} is from speak",
            list(w.home)[:300],
            list(w.cities),
            [w.language[c] for c in w.cities],
            show_progress=False,
        ),
        ridge=1e-2,
    )
    assert " " in next(iter(w.home))  # two-token people
    assert lc.label_pearson > 0.6 and lc.precision({c: w.language[c] for c in w.cities}) >= 0.7


def test_world_gradient_correlation_and_generalization(world):
    from extractive_lens.lincorr import generalization_check, gradient_correlation

    model, w = world
    subjects = list(w.home)[:300]
    src, tgt = "{x} lives in", "The people in the city {x} is from speak"
    pairs = collect_logits(
        model,
        src,
        tgt,
        subjects,
        list(w.cities),
        [w.language[c] for c in w.cities],
        show_progress=False,
    )
    lc = fit(pairs, ridge=1e-2)
    g = gradient_correlation(
        model, lc, next(iter(w.test_people)), w.cities[0], src, tgt, lr=1e-3, steps=3
    )
    assert np.isfinite(g["pearson"]) and g["predicted"].shape == (len(w.cities),)
    facts = [(t, c) for t, c in list(w.test_people.items())[:6]]
    df = generalization_check(
        model, lc, facts, src, tgt, {c: w.language[c] for c in w.cities}, epochs=20
    )
    assert df.learned.all()
    assert set(df.columns) >= {"follows_W", "generalizes", "W_prediction", "target_after"}


def test_collecting_logits_raises_no_tokenization_warning(world):
    """The prompts are plain text the world knows; the filler answer must not warn as unknown."""
    import warnings

    from extractive_lens.batch import TokenizationWarning

    model, w = world
    with warnings.catch_warnings():
        warnings.simplefilter("error", TokenizationWarning)
        pairs = collect_logits(
            model,
            "{x} lives in",
            "{x} likes",
            list(w.home)[:8],
            list(w.cities),
            sorted(set(w.hobby.values())),
            show_progress=False,
        )
    assert pairs.source.shape[0] == 8

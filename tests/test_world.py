"""The bundled world model: loads offline, knows its world, and generalises finetuned facts."""

from __future__ import annotations

import pytest
import torch

from extractive_lens import make_batch, mean_rank
from extractive_lens.batch import Pair
from extractive_lens.world import (
    build_world,
    first_hop,
    load_world_model,
    second_hop,
    world_info,
    world_of,
)
from extractive_lens.world.check import finetune_check, informative_pattern
from tests.conftest import needs_hooked

# SHA-1 (first 12) of the v2 seed-0 corpus as built before v3 existed (commit cb43d47)
V2_CORPUS_SHA1 = "90de9d000579"


@pytest.fixture(scope="module", params=["v3", "v2"])
def world_model(request):
    """Both bundled worlds: v3 (the default) and v2, loaded by name."""
    return load_world_model(request.param)


def test_the_default_world_is_v3():
    m = load_world_model()
    assert world_info(m)["version"] == 3 and world_of(m).version == 3
    assert build_world().version == 3 and world_info(load_world_model("v2")).get("version", 2) == 2
    with pytest.raises(ValueError, match="version must be"):
        build_world(0, version=4)


def test_loads_offline_and_tokenizes(world_model):
    m = world_model
    w = world_of(m)
    person = next(iter(w.test_people))
    expected = ["<bos>", *person.split(), "lives", "in"]
    assert m.to_str_tokens(f"{person} lives in") == expected
    assert len(expected) == (5 if w.version == 3 else 4)
    assert m.cfg.n_layers == 4 and m.cfg.d_model == 128 and m.cfg.n_ctx == 16
    assert m.tokenizer.name_or_path
    # it learned its world: city -> language, pretraining facts
    with torch.no_grad():
        for c in w.cities[:5]:
            top = m(f"The people in {c} speak")[0, -1].argmax()
            assert m.tokenizer.decode(top) == w.language[c]


def test_pretraining_two_hop_generalises_within_pretraining(world_model):
    """People whose implication was held out of pretraining still get it (latent two-hop)."""
    m = world_model
    w = world_of(m)
    held = [p for p in w.home if p not in w.with_implication][:40]
    cands = [f" {w.language[c]}" for c in w.cities]
    batch = make_batch(
        m,
        [
            Pair(f"The people in the city {p} is from speak", f" {w.language[w.home[p]]}")
            for p in held
        ],
        candidates=cands,
    )
    assert mean_rank(m, batch) < 4.0  # chance 14.5


def test_world_datasets_have_roles_and_candidates(world_model):
    fh, sh = first_hop(world_of(world_model)), second_hop(world_of(world_model))
    facts, impls = fh.batches(world_model)
    assert len(facts) == 20 and facts.candidates.shape == (1 * 20, 20)
    assert impls.roles[0][-4:] == ("{name}[-1]", "is", "from", "speak")
    f2, i2 = sh.batches(world_model)
    assert i2.roles[0][-2:] == ("{landmark}[-1]", "is")


@pytest.mark.slow
def test_finetuning_recipe_generalises(world_model):
    """The issue-6 recipe: facts to 0; implications well below chance (9.5)."""
    r = finetune_check(world_model, seed=0)
    assert r["first_hop facts after"] == 0.0 and r["second_hop facts after"] == 0.0
    assert r["first_hop implications before"] > 6 and r["second_hop implications before"] > 6
    assert r["second_hop implications after"] <= 2.0
    assert r["first_hop implications after"] <= 3.0


@needs_hooked  # world models are trained as HookedTransformers
@pytest.mark.parametrize("version", [3, 2])
def test_training_is_deterministic(version):
    """Two runs with one seed give bit-identical weights (the shipped models were checked the
    same way at full length: `python -m extractive_lens.world train --version 3 --seed 0`
    reproduces the shipped v3)."""
    from extractive_lens.world import train_world_model

    a = train_world_model(0, steps=5, version=version, show_progress=False)
    b = train_world_model(0, steps=5, version=version, show_progress=False)
    c = train_world_model(1, steps=5, version=version, show_progress=False)
    sa, sb = a.state_dict(), b.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["embed.W_E"][:5], c.state_dict()["embed.W_E"][:5])
    assert world_info(a)["version"] == version


def test_v3_people_are_pairs_with_records():
    """v3's design: no single name token identifies a person, a person's attributes follow
    their name directly in records after varied prefixes, and a test person's city is never in
    the corpus (it is the new fact)."""
    import numpy as np

    w = build_world(0, version=3)
    firsts = {}
    for p, c in w.home.items():
        firsts.setdefault(p.split()[0], set()).add(c)
    assert all(len(p.split()) == 2 for p in (*w.home, *w.test_people))
    assert sum(len(cities) > 1 for cities in firsts.values()) > 20  # a first name is not a city
    corpus = w.corpus(np.random.default_rng(0))
    p, c = next(iter(w.home.items()))
    records = [s for s in corpus if s.endswith(f"{p} {c} .")]
    assert len(records) == w.records and len({s[: -len(p + c) - 3] for s in records}) > 1
    text = "\n".join(corpus)
    for t, c in w.test_people.items():
        assert t in text and f"{t} {c}" not in text and f"{t} lives in {c}" not in text
        assert f"{t} {w.hobby[t]} ." in text and f"{t} {w.job[t]} ." in text


def test_v2_corpus_is_unchanged():
    """v2 keeps its corpus (the shipped v2 weights were trained on it): digest of seed 0's."""
    import hashlib

    import numpy as np

    w = build_world(0, version=2)
    corpus = w.corpus(np.random.default_rng(0))
    assert len(corpus) == 2888 and corpus[0].split()[0] and "Zoe" not in " ".join(corpus)
    digest = hashlib.sha1("\n".join(corpus).encode()).hexdigest()[:12]
    assert digest == V2_CORPUS_SHA1


def test_finetuned_facts_are_stored_at_the_name_in_v3_not_v2():
    """The paper's signature (Fig. 5): v3 stores first-hop facts in MLPs at the person's name,
    second-hop facts not at the landmark; v2 stores both at the last token."""
    v3 = informative_pattern(load_world_model("v3"))
    v2 = informative_pattern(load_world_model("v2"))
    assert v3["first_hop MLP share at the slot"] >= 0.5, v3
    assert v3["second_hop MLP share at the slot"] <= 0.3, v3
    assert v2["first_hop MLP share at the slot"] < 0.1, v2
    for r in (v2, v3):
        shares = [r[f"first_hop MLP share in layer {i}"] for i in range(4)]
        assert abs(sum(shares) - 1) < 1e-5 and r["first_hop MLP share at the last token"] < 1


@needs_hooked  # world models are trained as HookedTransformers
def test_world_model_of_another_seed_is_trained_once_and_cached(tmp_path, monkeypatch):
    import extractive_lens.world.model as wm

    monkeypatch.setenv("EXTRACTIVE_LENS_CACHE", str(tmp_path))
    pretrain = wm.recipe_of(wm.DEFAULT_VERSION)[1]
    monkeypatch.setitem(
        pretrain, "steps", 3
    )  # a short recipe: this checks the caching, not the model
    a = wm.world_model(5, show_progress=False)
    assert (tmp_path / "world-v3-seed5" / "model.safetensors").exists()
    assert world_info(a)["seed"] == 5

    def no_training(*args, **kw):
        raise AssertionError("should have loaded the cached model")

    monkeypatch.setattr(wm, "train_world_model", no_training)
    b = wm.world_model(5, show_progress=False)
    assert all(
        torch.equal(a.state_dict()[k], b.state_dict()[k])
        for k in b.state_dict()
        if not k.endswith("mask")
    )
    monkeypatch.setitem(pretrain, "steps", 4)  # a different recipe invalidates the cache
    with pytest.raises(AssertionError, match="cached"):
        wm.world_model(5, show_progress=False)
    bundled = wm.world_model(0)  # the shipped seed never trains
    assert world_info(bundled)["seed"] == 0


def _nearest_own_city_reference(model, world):
    """bridge_arrival recomputed from TransformerLens's own cache, batched, in numpy."""
    import numpy as np

    names = ["blocks.0.hook_resid_pre"] + [
        f"blocks.{b}.hook_resid_post" for b in range(model.cfg.n_layers)
    ]

    def last(prompts):
        _, cache = model.run_with_cache(model.to_tokens(prompts), names_filter=names.__contains__)
        return np.stack([cache[n][:, -1].double().numpy() for n in names])  # stage, city, d

    hits = []
    for role in ("mayor", "sheriff", "judge", "librarian", "baker"):
        fact = last([f"The {role} of {c} is" for c in world.cities])
        for k in (0, 1):
            lms = [world.landmarks[c][k] for c in world.cities]
            impl = last([f"The {role} of the city that contains {lm} is" for lm in lms])
            for stage in range(len(names)):
                f = fact[stage] - fact[stage].mean(0)
                i = impl[stage] - impl[stage].mean(0)
                f /= np.maximum(np.linalg.norm(f, axis=1, keepdims=True), 1e-12)
                i /= np.maximum(np.linalg.norm(i, axis=1, keepdims=True), 1e-12)
                hits.append((stage, np.mean((i @ f.T).argmax(1) == np.arange(len(f)))))
    return [float(np.mean([h for s, h in hits if s == stage])) for stage in range(len(names))]


def test_bridge_arrival_matches_a_hooked_reference(world_model):
    """The second hop's city is at the implication's last token after block 0 in both worlds
    (the README's reason why the second hop does not need the late layers)."""
    from extractive_lens.world.check import bridge_arrival

    w = world_of(world_model)
    shares = bridge_arrival(world_model)
    assert shares == pytest.approx(_nearest_own_city_reference(world_model, w), abs=1e-6)
    assert len(shares) == world_model.cfg.n_layers + 1
    assert shares[0] < 0.1 and shares[1] > 0.8, shares  # chance after the embeddings


def test_bridge_arrival_pairs_each_landmark_with_its_own_city():
    """Landmarks handed to the wrong cities: the implication's city is no longer the fact's."""
    from dataclasses import replace

    from extractive_lens.world.check import bridge_arrival

    m = load_world_model()
    w = world_of(m)
    shifted = dict(zip(w.cities, [w.landmarks[c] for c in (*w.cities[1:], w.cities[0])]))
    assert max(bridge_arrival(m, replace(w, landmarks=shifted))[1:]) < 0.1

"""The bundled world model: loads offline, knows its world, and generalises finetuned facts."""

from __future__ import annotations

import pytest
import torch

from extractive_lens import make_batch, mean_rank
from extractive_lens.batch import Pair
from extractive_lens.world import build_world, first_hop, load_world_model, second_hop, world_info
from extractive_lens.world.check import finetune_check


@pytest.fixture(scope="module")
def world_model():
    return load_world_model()


def test_loads_offline_and_tokenizes(world_model):
    m = world_model
    assert m.to_str_tokens("T3 lives in") == ["<bos>", "T3", "lives", "in"]
    assert m.cfg.n_layers == 4 and m.cfg.d_model == 128 and m.cfg.n_ctx == 16
    assert m.tokenizer.name_or_path
    w = build_world(world_info(m)["seed"])
    # it learned its world: city -> language, pretraining facts
    with torch.no_grad():
        for c in w.cities[:5]:
            top = m(f"The people in {c} speak")[0, -1].argmax()
            assert m.tokenizer.decode(top) == w.language[c]


def test_pretraining_two_hop_generalises_within_pretraining(world_model):
    """People whose implication was held out of pretraining still get it (latent two-hop)."""
    m = world_model
    w = build_world(world_info(m)["seed"])
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
    fh, sh = first_hop(), second_hop()
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


def test_training_is_deterministic():
    """Two runs with one seed give bit-identical weights (the shipped model was checked the
    same way at full length: `python -m extractive_lens.world train --seed 0` reproduces it)."""
    from extractive_lens.world import train_world_model

    a = train_world_model(0, steps=5, show_progress=False)
    b = train_world_model(0, steps=5, show_progress=False)
    c = train_world_model(1, steps=5, show_progress=False)
    sa, sb = a.state_dict(), b.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["embed.W_E"][:5], c.state_dict()["embed.W_E"][:5])


def test_world_model_of_another_seed_is_trained_once_and_cached(tmp_path, monkeypatch):
    import extractive_lens.world.model as wm

    monkeypatch.setenv("EXTRACTIVE_LENS_CACHE", str(tmp_path))
    monkeypatch.setitem(
        wm.PRETRAIN, "steps", 3
    )  # a short recipe: this checks the caching, not the model
    a = wm.world_model(5, show_progress=False)
    assert (tmp_path / "world-seed5" / "model.safetensors").exists()
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
    monkeypatch.setitem(wm.PRETRAIN, "steps", 4)  # a different recipe invalidates the cache
    with pytest.raises(AssertionError, match="cached"):
        wm.world_model(5, show_progress=False)
    bundled = wm.world_model(0)  # the shipped seed never trains
    assert world_info(bundled)["seed"] == 0

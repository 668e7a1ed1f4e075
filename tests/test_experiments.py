"""Layer freezing on the world model (small settings) and on a tiny model."""

from __future__ import annotations

import pytest
import torch

from extractive_lens.backend import parameters
from extractive_lens.experiments import layer_freezing
from extractive_lens.experiments.freezing import _keep
from extractive_lens.finetuning import FinetuneConfig
from extractive_lens.types import iter_components
from extractive_lens.weight_diff import WeightDiff
from tests.conftest import make_pair


def test_keep_splits_the_update_by_layer():
    base, ft = make_pair("ln_gelu", torch.float32, n_layers=3)
    diff = WeightDiff.from_models(base, ft)
    early = _keep(diff, True, False, 2)
    late = _keep(diff, False, True, 2)
    assert set(early.deltas) | set(late.deltas) == set(diff.deltas)
    assert not set(early.deltas) & set(late.deltas)
    assert "embed.W_E" in early.deltas and "unembed.W_U" in late.deltas
    assert all(int(n.split(".")[1]) < 2 for n in early.deltas if n.startswith("blocks."))


@pytest.mark.slow
def test_layer_freezing_on_world_model():
    from extractive_lens.world import first_hop, load_world_model
    from extractive_lens.world.model import FINETUNE

    model = load_world_model()
    res = layer_freezing(model, {"first_hop": first_hop()}, FinetuneConfig(**FINETUNE), split=0.5)
    df = res.to_dataframe()
    r = {(row.condition, row.split): row.mean_rank for row in df.itertuples()}
    assert r[("None", "facts")] == 0.0
    assert r[("All", "facts")] > 5  # reverting everything is the base model: chance-like
    assert (
        r[("Early (pre)", "facts")] <= 1.0 and r[("Late (pre)", "facts")] <= 1.0
    )  # either half can store it
    assert res.table().shape == (6, 2)
    assert len(res.plot().data) == 1


# ---------------------------------------------------------------- dax/zong experiments (world model)
@pytest.fixture(scope="module")
def world():
    from extractive_lens.world import load_world_model, world_of

    model = load_world_model()
    return model, world_of(model)


QUICK = FinetuneConfig(lr=1e-3, epochs=3, batch_size=8)


def test_world_daxwug_is_single_tokens(world):
    model, w = world
    dax = w.daxwug()
    assert len(dax.test) == 20 and len(dax.train) == 84
    unk = model.tokenizer.unk_token_id
    for ds in (dax.train, dax.test, dax.counterfactual):
        for p in (*ds.facts, *ds.implications):
            ids = model.to_tokens(p.prompt + p.answer)[0].tolist()
            assert unk not in ids and len(ids) == len((p.prompt + p.answer).split()) + 1
    # the counterfactual re-draws every training name's city, and implications follow the city
    for f, cf, ci in zip(
        dax.train.facts, dax.counterfactual.facts, dax.counterfactual.implications
    ):
        assert f.prompt == cf.prompt and f.answer != cf.answer
        assert ci.answer == " " + dax.city_to_animal[cf.answer.strip()]


def test_continued_pretraining_orders_are_sequential(world):
    """facts_first = train on facts, then on implications from there (checked by redoing it by hand)."""
    from extractive_lens import make_batch
    from extractive_lens.experiments import continued_pretraining
    from extractive_lens.finetuning import finetune

    model, w = world
    dax = w.daxwug()
    before = {n: p.detach().clone() for n, p in model.state_dict().items()}
    cfg = FinetuneConfig(lr=1e-3, epochs=1, batch_size=16, seed=4)
    got = continued_pretraining(model, dax, "facts_first", cfg)
    d1 = finetune(model, make_batch(model, list(dax.train.facts)), cfg, show_progress=False)
    with d1.applied(model):
        d2 = finetune(
            model,
            make_batch(model, list(dax.train.implications)),
            FinetuneConfig(lr=1e-3, epochs=1, batch_size=16, seed=5),
            show_progress=False,
        )
    for name, d in got.deltas.items():
        torch.testing.assert_close(d, (d1 + d2).deltas[name], rtol=0, atol=1e-6)
    # negative control: the other order is a different update, so the comparison above can fail
    other = continued_pretraining(model, dax, "implications_first", cfg)
    assert max(float((other.deltas[n] - d).abs().max()) for n, d in got.deltas.items()) > 1e-3
    assert all(torch.equal(p, before[n]) for n, p in model.state_dict().items())
    with pytest.raises(ValueError, match="order must be one of"):
        continued_pretraining(model, dax, "sideways", cfg)  # type: ignore[arg-type]


def test_data_ordering_small(world):
    from extractive_lens.experiments import data_ordering

    model, w = world
    res = data_ordering(
        model,
        w.daxwug(),
        QUICK,
        pretrain_config=FinetuneConfig(lr=1e-3, epochs=8, batch_size=16),
        orders=("joint", "no_implications"),
    )
    df = res.to_dataframe()
    assert set(df.order) == {"joint", "no_implications"} and df.epoch.max() == 3
    before = df[df.epoch == 0].set_index(["order", "split"]).mean_rank
    # continued pretraining learned the training facts in both orders, implications only with them
    assert before[("joint", "train facts")] < 2 and before[("no_implications", "train facts")] < 2
    assert (
        before[("joint", "train implications")]
        < before[("no_implications", "train implications")] - 3
    )
    assert res.final().shape == (2, 2) and len(res.plot().data) == 2


def test_weight_grafting_algebra_and_ranks(world):
    from extractive_lens import mean_rank
    from extractive_lens.experiments import weight_grafting

    model, w = world
    dax = w.daxwug()
    res = weight_grafting(model, dax, QUICK, positions=["all", "last"])
    d = res.diffs
    r = res.to_dataframe().set_index(["weights", "split"]).mean_rank
    # W_graft evaluated independently: apply W_F' and then the graft as two nested updates
    _, implf_cf = dax.counterfactual.batches(model)
    with d["F'"].applied(model), d["F->ImplF"].applied(model):
        nested = mean_rank(model, implf_cf)
    assert abs(nested - r[("W_graft", "ImplF'")]) < 1e-9
    assert r[("W_F'", "F'")] < r[("W", "F'")] - 3  # the counterfactual facts were learned
    # the update grafted on every head and MLP at every position: its components' share, applied
    comps = [c.label for c in iter_components(model.cfg.n_layers, model.cfg.n_heads)]
    with d["F'"].applied(model), d["F->ImplF"].restricted(comps).applied(model):
        everywhere = mean_rank(model, implf_cf)
    assert abs(everywhere - r[("W_graft @ all", "ImplF'")]) < 1e-9
    assert r[("W_graft @ last", "ImplF'")] != r[("W_graft @ all", "ImplF'")]  # another graft
    assert list(res.table().index) == ["W_F'", "W_graft", "W~", "W_graft @ all", "W~ @ all",
                                       "W_graft @ last", "W~ @ last"]  # fmt: skip
    with pytest.raises(KeyError, match="unknown weights"):
        res.weights("W_nope")


def test_localization_stats_match_numpy(world):
    import numpy as np

    from extractive_lens.experiments import localization, weight_grafting

    model, w = world
    dax = w.daxwug()
    loc = localization(model, dax, weight_grafting(model, dax, QUICK), QUICK)
    df = loc.to_dataframe()
    assert len(df) == model.cfg.n_layers * (model.cfg.n_heads + 1)
    heads = df[df.part == "head"]
    r = np.corrcoef(heads.informative, heads.downstream)[0, 1]
    assert abs(loc.stats().loc["heads", "pearson_r"] - r) < 1e-9
    assert loc.informative.kinds == ("informative",) and loc.downstream.kinds == ("downstream",)
    assert df.informative.abs().sum() > 0 and df.downstream.abs().sum() > 0
    assert "r = " in loc.plot().layout.title.text


def test_run_experiment_writes_files(tmp_path):
    from extractive_lens.experiments.runner import run_experiment

    run = run_experiment(
        "weight_grafting", seeds=(0,), out=tmp_path, quick=True, show_progress=False
    )
    d = tmp_path / "weight_grafting"
    assert (
        (d / "seed0.json").exists() and (d / "seed0.html").exists() and (d / "summary.md").exists()
    )
    md = run.markdown()
    assert "| W_graft |" in md and "[1.13]" in md  # the paper's number beside ours
    with pytest.raises(ValueError, match="unknown experiment"):
        run_experiment("nope")


def test_dax_experiments_on_any_model_with_real_names():
    """The default dax/zong data (real names and cities, some of them several tokens) on a small
    random model with its own tokenizer: every experiment runs and leaves the model untouched."""
    from extractive_lens import tiny_model
    from extractive_lens.datasets import daxwug
    from extractive_lens.demo import word_tokenizer
    from extractive_lens.experiments import data_ordering, localization, weight_grafting

    dax = daxwug(seed=1)
    words = [
        w
        for ds in (dax.train, dax.test, dax.counterfactual)
        for p in (*ds.facts, *ds.implications)
        for w in (p.prompt + p.answer).split()
    ]
    tok = word_tokenizer(words)
    model = tiny_model({"d_vocab": len(tok), "n_ctx": 16, "n_layers": 2}, seed=0, tokenizer=tok)
    assert any(
        len(p.answer.split()) > 1 for p in dax.train.facts
    )  # multi-token cities are in there
    before = {n: p.detach().clone() for n, p in model.state_dict().items()}
    cfg = FinetuneConfig(lr=1e-3, epochs=1, batch_size=16)
    graft = weight_grafting(model, dax, cfg)
    assert graft.table().shape == (3, 3)
    order = data_ordering(model, dax, cfg, pretrain_config=cfg, orders=("facts_first",))
    assert set(order.to_dataframe().split) >= {"test facts", "test implications"}
    loc = localization(model, dax, graft, cfg)
    assert len(loc.to_dataframe()) == 2 * (model.cfg.n_heads + 1)
    assert all(torch.equal(p, before[n]) for n, p in model.state_dict().items())


def test_pre_rows_train_the_parts_the_post_rows_revert():
    """One partition: "Early (pre)" trains exactly what "Early" keeps, so embeddings are frozen and
    the unembedding trains (and the reverse for "Late (pre)")."""
    from extractive_lens import make_batch
    from extractive_lens.experiments.freezing import _part, _training
    from extractive_lens.finetuning import finetune

    base, ft = make_pair("ln_gelu", torch.float32, n_layers=3)
    names = list(parameters(base))
    batch = make_batch(base, [([1, 7, 9], [11]), ([1, 8, 9], [12])])
    full = WeightDiff.from_models(base, ft)
    for early in (False, True):
        trained = finetune(
            base, batch, _training(QUICK, _part(names, early, 2)), show_progress=False
        )
        moved = {n for n, d in trained.deltas.items() if d.abs().max() > 0}
        kept = set(_keep(full, early, not early, 2).deltas)
        assert moved and moved <= kept, sorted(moved - kept)
        assert ("unembed.W_U" in moved) == (not early) and ("embed.W_E" in moved) == early


@pytest.mark.slow
@pytest.mark.parametrize(
    "version, finetune_lr, pretrain_lr",
    [(2, 1e-3, 1e-3), (3, 3e-4, 3e-4)],  # README, "The bundled world model": each world's recipe
)
def test_experiments_use_their_worlds_recipe(monkeypatch, version, finetune_lr, pretrain_lr):
    """Layer freezing and data ordering finetune a world model with that world's learning rates
    (v3: 3e-4 for the test facts and for continued pretraining; v2: 1e-3), whatever the default."""
    from dataclasses import replace

    from extractive_lens.experiments import freezing, ordering
    from extractive_lens.experiments.runner import run_experiment

    seen: dict[str, list[float]] = {"facts": [], "pretraining": []}

    def spy(kind, real):
        def wrapped(model, batch, config, **kw):
            seen[kind].append(config.lr)
            return real(model, batch, replace(config, epochs=1), **kw)  # the lr is what is asked

        return wrapped

    def spy_trajectory(model, data, evaluate, config, **kw):
        seen["facts"].append(config.lr)
        return real_trajectory(model, data, evaluate, replace(config, epochs=1), **kw)

    real_trajectory = ordering.rank_trajectory
    monkeypatch.setattr(freezing, "finetune", spy("facts", freezing.finetune))
    monkeypatch.setattr(ordering, "finetune", spy("pretraining", ordering.finetune))
    monkeypatch.setattr(ordering, "rank_trajectory", spy_trajectory)
    run_experiment("layer_freezing", seeds=(0,), quick=True, version=version)
    n_freezing = len(seen["facts"])
    run_experiment("data_ordering", seeds=(0,), quick=True, version=version)
    assert len(seen["facts"]) > n_freezing  # the test facts' finetuning after each order
    assert seen["facts"] and set(seen["facts"]) == {finetune_lr}
    assert seen["pretraining"] and set(seen["pretraining"]) == {pretrain_lr}

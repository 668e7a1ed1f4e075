"""What the real-model protocol holds at its peak: a full-parameter Adam finetune keeps the
weights, the snapshot it restores them from, Adam's two moments and the gradients; Δ is formed
at the end. These tests check, on a tiny model, that the moments are gone when Δ is formed (the
protocol's peak on SmolLM2-135M is measured with ``/usr/bin/time -v`` in docs/benchmarks.md)."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from extractive_lens import FinetuneConfig, finetune
from extractive_lens import finetuning as F
from tests.conftest import make_pair
from tests.helpers import facts


def count_alive_deltas(protocol, monkeypatch) -> list[int]:
    """Wrap the protocol's ``finetune``: before each call, how many Δs it returned are alive."""
    made: list[weakref.ref] = []
    alive: list[int] = []
    real = protocol.finetune

    def counting(*a, **k):
        alive.append(sum(r() is not None for r in made))
        diff = real(*a, **k)
        made.append(weakref.ref(diff))
        return diff

    monkeypatch.setattr(protocol, "finetune", counting)
    return alive


def test_adam_moments_are_freed_before_the_final_delta_is_formed(monkeypatch):
    """Every optimizer ``finetune`` builds is dead (no moments held) when its last Δ is formed:
    on SmolLM2-135M the moments are 1.3 GB, and Δ another 0.65 GB beside them."""
    base, _ = make_pair("ln_gelu", torch.float32)
    data = facts(base)
    made: list[weakref.ref] = []
    alive_at_diff: list[int] = []

    class Recorded(torch.optim.Adam):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            made.append(weakref.ref(self))

    real_diff = F._diff

    def recording_diff(*a, **k):
        alive_at_diff.append(sum(r() is not None for r in made))
        return real_diff(*a, **k)

    monkeypatch.setattr(torch.optim, "Adam", Recorded)
    monkeypatch.setattr(F, "_diff", recording_diff)
    gc.disable()  # freed by reference counts, not by a later collection
    try:
        diff = finetune(base, data, FinetuneConfig(lr=1e-3, epochs=2, batch_size=4))
    finally:
        gc.enable()
    assert len(made) == 1 and alive_at_diff == [0]
    assert diff.metadata["losses"].__len__() == 2


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_the_trajectory_holds_no_delta_while_another_seed_trains(text_model, monkeypatch, tmp_path):
    """Seeds 0, 1, 2 with the first seed's Δ kept for the scores step: when each finetune
    starts, no Δ of an earlier one is alive (the kept seed trains last); the results keep the
    seeds' order, the kept Δ is seed 0's, and a later seed's "after" ranks are those of its
    trained weights (read in place at the last epoch, not through ``diff.applied``)."""
    from extractive_lens.datasets.twohop import first_hop
    from extractive_lens.real_model import protocol

    real = protocol.finetune
    alive = count_alive_deltas(protocol, monkeypatch)
    monkeypatch.setitem(protocol.FINETUNE, "epochs", 2)
    monkeypatch.setattr(protocol, "save_figure", lambda fig, stem: None)
    ds = first_hop(n=4)
    results: dict = {}
    gc.disable()  # freed by reference counts, not by a later collection
    try:
        kept = protocol.trajectory(text_model, ds, "first_hop", [0, 1, 2], results, tmp_path, True)
    finally:
        gc.enable()
    assert alive == [0, 0, 0]
    seeds = results["first_hop"]["seeds"]
    assert list(seeds) == ["0", "1", "2"]
    assert [len(seeds[s]["ranks"]) for s in seeds] == [3, 2, 2]  # seed 0: every epoch
    facts, impls = ds.batches(text_model)
    config = {**protocol.FINETUNE, "seed": 0}
    fresh = real(text_model, facts, FinetuneConfig(**config))
    assert all(torch.equal(d, fresh.deltas[n]) for n, d in kept.deltas.items())
    one = real(text_model, facts, FinetuneConfig(**{**config, "seed": 1}))
    for split, batch in (("facts", facts), ("implications", impls)):
        want, _ = protocol.batch_ranks(text_model, batch, one)
        assert seeds["1"]["ranks"][-1][split] == want
    assert protocol.trajectory(text_model, ds, "first_hop", [0], {}, tmp_path) is None


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_the_scored_delta_is_gone_before_a_later_step_finetunes(text_model, monkeypatch, tmp_path):
    """Every step asked for, in ``run``'s order: the first hop's Δ, kept for the scores step,
    is released before the second hop, freezing or grafting train (each needs the finetune's
    peak, with no earlier Δ beside it)."""
    import extractive_lens.backend.gguf as gguf
    from extractive_lens.real_model import protocol

    alive = count_alive_deltas(protocol, monkeypatch)
    monkeypatch.setattr(gguf, "installed_gguf", lambda name: tmp_path / "model.gguf")
    monkeypatch.setattr(protocol.el, "load_pretrained", lambda name: text_model)
    monkeypatch.setitem(protocol.FINETUNE, "epochs", 1)
    monkeypatch.setattr(protocol, "save_figure", lambda fig, stem: None)
    monkeypatch.setattr(protocol, "scores_step", lambda model, diff, *a: {})  # holds nothing
    monkeypatch.setattr(protocol.summary, "write_report", lambda path, *a: path)
    steps = ["second_hop", "scores", "first_hop"]  # any order asked: run's order is STEPS'
    gc.disable()
    try:
        protocol.run(tmp_path, steps, n=3, seeds=[0], echo=lambda line: None)
    finally:
        gc.enable()
    assert alive == [0, 0]

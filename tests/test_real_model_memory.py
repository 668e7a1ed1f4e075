"""What the real-model protocol holds at its peak: a full-parameter Adam finetune keeps the
weights, the snapshot it restores them from, Adam's two moments and the gradients; Δ is formed
at the end. These tests check, on a tiny model, that the moments are gone when Δ is formed (the
protocol's peak on SmolLM2-135M is measured with ``/usr/bin/time -v`` in docs/benchmarks.md)."""

from __future__ import annotations

import gc
import weakref

import torch

from extractive_lens import FinetuneConfig, finetune
from extractive_lens import finetuning as F
from tests.conftest import make_pair
from tests.helpers import facts


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

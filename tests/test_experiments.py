"""Layer freezing on the world model (small settings) and on a tiny model."""

from __future__ import annotations

import pytest
import torch

from extractive_lens.experiments import layer_freezing
from extractive_lens.experiments.freezing import _keep
from extractive_lens.finetuning import FinetuneConfig
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
    assert r[("Early (pre)", "facts")] <= 1.0 and r[("Late (pre)", "facts")] <= 1.0  # either half can store it
    assert res.table().shape == (6, 2)
    assert len(res.plot().data) == 1

"""Two gloo processes on CPU give the single-process scores (linear and exact)."""

from __future__ import annotations

import pytest
import torch

from extractive_lens import (
    ComponentScores,
    WeightDiff,
    causal_scores,
    integrated_scores,
    linear_scores,
)
from extractive_lens.distributed import shard_rows
from tests.conftest import make_pair
from tests.helpers import free_port, small_batch


def test_shards_cover_in_order():
    for n in (1, 5, 16):
        for w in (1, 2, 3):
            rows = [r for k in range(w) for r in shard_rows(n, k, w)]
            assert rows == list(range(n))


@pytest.mark.parametrize(
    "method,shard,per",
    [
        ("linear", "prompts", "token"),
        ("causal", "prompts", "token"),
        ("causal", "layers", "component"),
        ("integrated", "prompts", "token"),
        ("integrated", "layers", "token"),
    ],
)
def test_two_processes_match_single_process(tmp_path, method, shard, per):
    import torch.multiprocessing as mp

    from tests import dist_worker

    mp.spawn(
        dist_worker.run,
        args=(2, free_port(), str(tmp_path), method, shard, per),
        nprocs=2,
        join=True,
    )
    base, ft = make_pair("ln_gelu", torch.float64, delta_scale=0.2)
    batch = small_batch(base, n=5)
    diff = WeightDiff.from_models(base, ft)
    single = (
        linear_scores(base, diff, batch)
        if method == "linear"
        else integrated_scores(base, diff, batch, steps=2)
        if method == "integrated"
        else causal_scores(base, diff, batch, per=per)
    )
    for rank in (0, 1):
        got = ComponentScores.load(tmp_path / f"rank{rank}")
        assert (
            got.position_labels == single.position_labels
            and got.prompt_roles == single.prompt_roles
        )
        assert (got.prompt_values - single.prompt_values).abs().max() <= 1e-10
        assert (got.values - single.values).abs().max() <= 1e-10
        assert (got.totals - single.totals).abs().max() <= 1e-10
        if method == "linear":
            assert (got.other - single.other).abs().max() <= 1e-10
            a, b = got.metadata["additivity"], single.metadata["additivity"]
            assert a["exact_change"] == pytest.approx(b["exact_change"], abs=1e-12)
            assert a["relative_gap"] == pytest.approx(b["relative_gap"], abs=1e-12)
        if method == "integrated":
            assert (got.other - single.other).abs().max() <= 1e-10
            done = got.metadata["integrated"]["completeness"]
            assert set(done) == set(single.kinds) and all(v == v for v in done.values())
        assert got.metadata["prompts_digest"] == single.metadata["prompts_digest"]
        assert got.metadata["distributed"]["world_size"] == 2


def test_process_group_shuts_down_on_exit_and_on_error(monkeypatch):
    import torch.distributed as dist

    from extractive_lens.distributed import process_group

    env = dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1")
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with process_group("cpu", timeout_s=30) as (rank, world, device):
        assert (rank, world, device) == (0, 1, "cpu") and dist.is_initialized()
    assert not dist.is_initialized()
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    with pytest.raises(RuntimeError, match="boom"), process_group("cpu", timeout_s=30):
        raise RuntimeError("boom")  # no barrier on the way out: a peer may never arrive
    assert not dist.is_initialized()

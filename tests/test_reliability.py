"""Round 2 of the reliability campaign: two threads on one model, ranks that disagree, saves
that cannot be half-written."""

from __future__ import annotations

import threading

import pytest
import torch

import extractive_lens as el
from tests.conftest import make_pair


def test_two_threads_scoring_one_model_take_turns():
    """Two threads scoring (and finetuning) one model at once: every result equals the one
    computed alone, no call sees the other's temporary hooks, and the weights end unchanged."""
    base, ft = make_pair("ln_gelu", torch.float64)
    diff = el.WeightDiff.from_models(base, ft)
    batch = el.make_batch(base, [([1, 2, 3], [4]), ([1, 5, 6], [7]), ([2, 5, 9], [8])])
    before = [p.detach().clone() for p in base.parameters()]
    alone = {
        "linear": el.linear_scores(base, diff, batch, show_progress=False),
        "causal": el.causal_scores(base, diff, batch, show_progress=False),
    }
    tuned_alone = el.finetune(base, batch, el.FinetuneConfig(epochs=2), show_progress=False)
    results: list[tuple[str, object]] = []
    errors: list[BaseException] = []

    def work() -> None:
        try:
            for _ in range(2):
                results.append(("linear", el.linear_scores(base, diff, batch, show_progress=False)))
                results.append(("causal", el.causal_scores(base, diff, batch, show_progress=False)))
                results.append(("finetune", el.finetune(base, batch, el.FinetuneConfig(epochs=2),
                                                        show_progress=False)))  # fmt: skip
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    assert errors == [], errors
    assert len(results) == 12
    for what, got in results:
        if what == "finetune":
            assert all(torch.equal(got.deltas[n], d) for n, d in tuned_alone.deltas.items())
        else:
            assert torch.allclose(got.values, alone[what].values, atol=1e-12, rtol=0)
    assert all(torch.equal(a, p) for a, p in zip(before, base.parameters()))


@pytest.mark.parametrize("what", ["diff", "batch"])
def test_ranks_scoring_different_inputs_are_refused(tmp_path, what):
    """Rank 1 holds a slightly different diff, or a batch of the same size with one other
    token: every rank refuses (instead of merging shards of two different results)."""
    import torch.multiprocessing as mp

    from tests import dist_worker
    from tests.test_distributed import _port

    mp.spawn(dist_worker.run_mismatched, args=(2, _port(), str(tmp_path), what), nprocs=2,
             join=True)  # fmt: skip
    for rank in (0, 1):
        err = (tmp_path / f"rank{rank}.err").read_text()
        assert "not scoring the same inputs" in err and f"rank 1 has another {what}" in err, err
        assert "Load the same diff and data files on every rank" in err

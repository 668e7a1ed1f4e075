"""A worker for the 2-process gloo test (importable by torch.multiprocessing.spawn)."""

from __future__ import annotations

import os
import sys

import torch


def run(rank: int, world: int, port: int, out: str, method: str, shard: str, per: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(  # what torchrun sets
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
    )
    from extractive_lens import WeightDiff
    from extractive_lens.distributed import distributed_scores, process_group
    from tests.conftest import make_pair
    from tests.helpers import small_batch

    with process_group("cpu", timeout_s=120):
        base, ft = make_pair("ln_gelu", torch.float64, delta_scale=0.2)
        batch = small_batch(base, n=5)
        kw = {"per": per} if method == "causal" else {"steps": 2} if method == "integrated" else {}
        s = distributed_scores(
            method, base, WeightDiff.from_models(base, ft), batch, shard=shard, **kw
        )
        s.save(f"{out}/rank{rank}")
    # The results are written and the group is shut down. Leave without the interpreter's
    # teardown: about 1 run in 100 (CI, and torchrun by hand) a gloo rank aborted there with
    # "terminate called without an active exception", failing a run whose results were right.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_mismatched(rank: int, world: int, port: int, out: str, what: str) -> None:
    """Rank 1 scores another diff (``what="diff"``) or another batch of the same size
    (``"batch"``); each rank writes the error it raised to ``out/rank{rank}.err``."""
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))  # fmt: skip
    from extractive_lens import WeightDiff, make_batch
    from extractive_lens.distributed import distributed_scores, process_group
    from tests.conftest import make_pair

    with process_group("cpu", timeout_s=120):
        base, ft = make_pair("ln_gelu", torch.float64, delta_scale=0.2)
        diff = WeightDiff.from_models(base, ft)
        pairs = [([1, 2, 3], [4]), ([1, 5, 6], [7]), ([2, 5, 9], [8]), ([3, 4, 5], [6])]
        if rank == 1 and what == "diff":
            diff = diff * 1.001
        if rank == 1 and what == "batch":
            pairs[2] = ([2, 5, 10], [8])
        try:
            distributed_scores("linear", base, diff, make_batch(base, pairs))
            message = "no error"
        except ValueError as e:
            message = str(e)
        with open(f"{out}/rank{rank}.err", "w") as f:
            f.write(message)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


DISAGREEMENTS = ("steps", "ablation", "base", "swapped rows", "kinds", "eps", "candidates",
                 "reward", "agree")  # fmt: skip


def run_disagreeing(rank: int, world: int, port: int, out: str) -> None:
    """#42, #50: the ranks differ in one thing besides Δ and the batch (``DISAGREEMENTS``: the
    integrated steps, the ablation, another base of the same architecture, Δ with two rows of
    one tensor swapped, the kinds, the norm eps in the config, the candidates, a reward lambda;
    ``agree``: nothing). Every case runs in one process group;
    each rank writes what it got to ``out/{case}.rank{rank}``."""
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))  # fmt: skip
    from extractive_lens import WeightDiff, make_batch
    from extractive_lens.distributed import distributed_scores, process_group
    from tests.conftest import make_pair

    with process_group("cpu", timeout_s=120):
        base, ft = make_pair("ln_gelu", torch.float64, delta_scale=0.2)
        diff = WeightDiff.from_models(base, ft)
        batch = make_batch(
            base, [([1, 2, 3], [4]), ([1, 5, 6], [7]), ([2, 5, 9], [8]), ([3, 4, 5], [6])]
        )
        other_base, _ = make_pair("ln_gelu", torch.float64, seed=1)
        other_eps, _ = make_pair("ln_gelu", torch.float64, delta_scale=0.2, eps=1e-6)
        pairs = [([1, 2, 3], [4]), ([1, 5, 6], [7]), ([2, 5, 9], [8]), ([3, 4, 5], [6])]
        cands = make_batch(base, pairs, candidates=[4, 7, 8, 6, 9] if rank == 1 else [4, 7, 8, 6])
        swapped = dict(diff.deltas)
        w = swapped["blocks.1.mlp.W_in"].clone()
        w[[0, 1]] = w[[1, 0]]  # the same sum and sum of squares: the old fingerprint's blind spot
        swapped["blocks.1.mlp.W_in"] = w
        two = rank == 1
        cases = {
            "steps": lambda: distributed_scores("integrated", base, diff, batch,
                                                kinds=("downstream",), steps=3 if two else 2),
            "ablation": lambda: distributed_scores("linear", base, diff, batch, kinds=("upstream",),
                                                   ablation="zero" if two else "mean"),
            "base": lambda: distributed_scores("linear", other_base if two else base, diff, batch),
            "swapped rows": lambda: distributed_scores(
                "linear", base, WeightDiff(swapped, diff.signature) if two else diff, batch),
            "kinds": lambda: distributed_scores(
                "linear", base, diff, batch, **({"kinds": ("informative",)} if two else {})),
            "eps": lambda: distributed_scores("linear", other_eps if two else base, diff, batch),
            "candidates": lambda: distributed_scores("linear", base, diff, cands,
                                                     reward="logit_margin"),
            # two lambdas that describe alike (module and qualname): told apart by their code
            "reward": lambda: distributed_scores("linear", base, diff, batch, reward=(
                (lambda logits, b: logits[:, -1, 5]) if two
                else (lambda logits, b: logits[:, -1, 4]))),
            # the defaults given explicitly on one rank only: the same options
            "agree": lambda: distributed_scores("linear", base, diff, batch, kinds=("upstream",),
                                                **({"ablation": "mean", "seed": 3} if two else {})),
        }  # fmt: skip
        for case in DISAGREEMENTS:
            try:
                cases[case]()
                message = "no error"
            except Exception as e:  # noqa: BLE001 - written for the test to read
                message = f"{type(e).__name__}: {e}"
            with open(f"{out}/{case}.rank{rank}", "w") as f:
                f.write(message)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)

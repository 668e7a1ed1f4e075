"""Throughput of distributed scoring: 1 process vs 2 processes (gloo, one thread each), one run.

    python benchmarks/bench_distributed.py [--prompts 64]

Scores the world model's first-hop implications (repeated to ``--prompts``) with linear and
exact per-token scores. Target (issue 9): 2 processes >= 1.6x the throughput of 1.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.common import table, write  # noqa: E402


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker(rank: int, world: int, port: int, prompts: int, out: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from extractive_lens import finetune
    from extractive_lens.batch import make_batch
    from extractive_lens.distributed import distributed_scores, shutdown
    from extractive_lens.finetuning import FinetuneConfig
    from extractive_lens.world import FINETUNE, first_hop, load_world_model

    model = load_world_model()
    ds = first_hop()
    facts, _ = ds.batches(model)
    diff = finetune(model, facts, FinetuneConfig(**FINETUNE), show_progress=False)
    impls = list(ds.implications) * (prompts // len(ds.implications) + 1)
    batch = make_batch(model, impls[:prompts], candidates=list(ds.implication_candidates))
    dist.barrier()
    t0 = time.perf_counter()
    distributed_scores("linear", model, diff, batch, show_progress=False)
    distributed_scores("causal", model, diff, batch, show_progress=False)
    dist.barrier()
    if rank == 0:
        Path(out).write_text(str(time.perf_counter() - t0))
    shutdown()


def run(world: int, prompts: int) -> float:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as d:
        out = f"{d}/t"
        mp.spawn(worker, args=(world, _port(), prompts, out), nprocs=world, join=True)
        return float(Path(out).read_text())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=64)
    args = ap.parse_args()
    t1 = run(1, args.prompts)
    t2 = run(2, args.prompts)
    rows = [
        dict(processes=1, seconds=t1, prompts_per_s=args.prompts / t1),
        dict(
            processes=2,
            seconds=t2,
            prompts_per_s=args.prompts / t2,
            speedup=t1 / t2,
            target=1.6,
            meets=t1 / t2 >= 1.6,
        ),
    ]
    print(table(rows, ["processes", "seconds", "prompts_per_s", "speedup", "target", "meets"]))
    print("wrote", write("bench_distributed", {"rows": rows, "prompts": args.prompts}))


if __name__ == "__main__":
    main()

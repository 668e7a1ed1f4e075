"""Graft maps: the cost of ``graft_scores`` in forward passes, against one plain forward.

    python benchmarks/bench_graft.py [--shapes bundled gpt2-small] [--repeats 3]

For each shape: one forward of the batch (TransformerLens's own, no graft), one ``graft_scores``
map of the default G groups × R roles (sufficient and necessary), and one grafted forward
through ``WeightDiff.grafted`` (every head and MLP at the last token), all timed in one run;
reported as the map's time in plain forwards, beside its G·R + 2 passes (each grafted pass
also reruns the grafted layers' attention and MLPs, so a pass of the set "all" costs about two
forwards).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.common import random_batch, random_pair, table, timeit, write  # noqa: E402

CONFIG = {"bundled": dict(batch=16, pos=16), "gpt2-small": dict(batch=4, pos=16)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="+", default=["bundled", "gpt2-small"])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    from extractive_lens import graft_scores

    rows = []
    for shape in args.shapes:
        base, diff, _ = random_pair(shape)
        batch = random_batch(base, **CONFIG[shape])
        tokens = batch.tokens

        def plain() -> None:
            with torch.no_grad():
                base(tokens)

        def grafted() -> None:
            with torch.no_grad(), diff.grafted(base, positions="last", batch=batch):
                base(tokens)

        one = timeit(plain, repeats=args.repeats)
        row = dict(shape=shape, prompts=len(batch), tokens=batch.n_pos, forward_s=one,
                   grafted_forward=timeit(grafted, repeats=args.repeats) / one)  # fmt: skip
        for mode in ("sufficient", "necessary"):
            res = graft_scores(base, diff, batch, mode=mode, show_progress=False)
            t = timeit(lambda mode=mode: graft_scores(base, diff, batch, mode=mode,
                                                     show_progress=False),
                       repeats=args.repeats, warmup=0)  # fmt: skip
            row[f"{mode}_passes"] = res.metadata["passes"]
            row[f"{mode}_forwards"] = t / one
        rows.append(row)
        print(table([row], list(row)), flush=True)
    path = write("bench_graft", dict(rows=rows))
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()

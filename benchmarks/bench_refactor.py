"""Speed of this tree against another checkout of extractive_lens, in one run (A/B, alternating).

    git worktree add /tmp/el_before <commit>
    python benchmarks/bench_refactor.py /tmp/el_before [--shapes bundled gpt2-small]
        [--scores linear causal] [--rounds 3] [--repeats 3]

Each measurement runs in a fresh subprocess with ``sys.path`` pointing at one tree, alternating
old, new, old, new ... so that machine noise hits both alike; the median time per tree is
reported with the ratio new / old (1.00 = unchanged; issue 14 asks for within 5%). Timed:
``linear_scores`` (all kinds, paper convention, one pass) and ``causal_scores`` (all kinds,
per token; on the GPT-2-small shape restricted to layers 0 and 11 as in bench_causal.py).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import sys, json, time
sys.path.insert(0, {tree!r})
sys.path.insert(1, {root!r})
import torch
from benchmarks.common import random_batch, random_pair
from extractive_lens import causal_scores, linear_scores
shape, what = {shape!r}, {what!r}
base, diff, _ = random_pair(shape)
batch = random_batch(base, batch=16 if shape == "bundled" else 4, pos=16)
kw = dict(show_progress=False, batch_size=None)
if what == "linear":
    fn = lambda: linear_scores(base, diff, batch, **kw)
else:
    layers = None if shape == "bundled" else [0, 11]
    fn = lambda: causal_scores(base, diff, batch, layers=layers, **kw)
fn()  # warm-up
times = []
for _ in range({repeats}):
    t0 = time.perf_counter(); fn(); times.append(time.perf_counter() - t0)
import extractive_lens
print(json.dumps(dict(times=times, file=extractive_lens.__file__)))
"""


def measure(tree: Path, shape: str, what: str, repeats: int) -> float:
    code = CHILD.format(tree=str(tree), root=str(ROOT), shape=shape, what=what, repeats=repeats)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["file"].startswith(str(tree)), f"imported {res['file']}, not from {tree}"
    return statistics.median(res["times"])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("old", type=Path, help="another checkout (e.g. a git worktree)")
    ap.add_argument("--shapes", nargs="+", default=["bundled", "gpt2-small"])
    ap.add_argument(
        "--scores", nargs="+", default=["linear", "causal"], choices=["linear", "causal"]
    )
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from benchmarks.common import table, write

    rows = []
    for shape in args.shapes:
        for what in args.scores:
            old, new = [], []
            for _ in range(args.rounds):
                old.append(measure(args.old.resolve(), shape, what, args.repeats))
                new.append(measure(ROOT, shape, what, args.repeats))
            o, n = statistics.median(old), statistics.median(new)
            rows.append(dict(shape=shape, scores=what, old_s=o, new_s=n, new_over_old=n / o))
            print(table(rows[-1:], list(rows[-1])), flush=True)
    print(table(rows, ["shape", "scores", "old_s", "new_s", "new_over_old"]))
    # keep the rows of earlier runs that this run did not measure (each row says how it was run)
    for r in rows:
        r.update(rounds=args.rounds, repeats=args.repeats)
    from benchmarks.common import RESULTS

    earlier = RESULTS / "bench_refactor.json"
    if earlier.exists():
        done = {(r["shape"], r["scores"]) for r in rows}
        old_rows = json.loads(earlier.read_text()).get("rows", [])
        rows = [r for r in old_rows if (r["shape"], r["scores"]) not in done] + rows
    print("wrote", write("bench_refactor", {"old": str(args.old), "rows": rows}))


if __name__ == "__main__":
    main()

"""Scores along a finetuning trajectory: the cost per checkpoint, against the same scores of a
diff held in memory, measured in one run.

    python benchmarks/bench_trajectory.py                  # the bundled world model, 5 epochs
    python benchmarks/bench_trajectory.py --epochs 3 --repeats 3

The world model finetuned on its 20 first-hop facts with its recipe for ``--epochs`` epochs,
keeping every epoch (``finetune(keep="epochs")``), scored on the 20 facts:

- linear (informative) of ``D_k`` read lazily from the trajectory's file, per checkpoint,
  divided by ``linear_scores`` of the same ``D_k`` held in memory (``WeightDiff.load``);
- the trajectory integral per segment (4 Gauss nodes) divided by ``integrated_scores`` of one
  straight line held in memory (informative, 4 nodes): the same number of passes, each node's
  point ``D_{k-1} + xΔ_k`` formed from two files;
- the peak resident memory above the start of each, and the bytes of one checkpoint's Δ.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import PeakMemory, table, timeit, write  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    import extractive_lens as el
    from extractive_lens.world import finetune_recipes, first_hop, load_world_model, world_of

    model = load_world_model()
    facts, _ = first_hop(world_of(model)).batches(model)
    recipe = dict(finetune_recipes(world_of(model).version)[0], epochs=a.epochs, seed=0)
    folder = Path(tempfile.mkdtemp(prefix="bench-trajectory-")) / "run"
    el.finetune(model, facts, el.FinetuneConfig(**recipe), keep="epochs", trajectory=folder)
    traj = el.Trajectory.load(folder)
    T = len(traj)
    resident = [el.WeightDiff.load(c.source) for c in traj.checkpoints]
    kw = dict(kinds="informative", show_progress=False)
    rows = []

    def measured(name, fn, per):
        with PeakMemory() as mem:
            t = timeit(fn, repeats=a.repeats)
        rows.append(dict(what=name, seconds=t / per, peak_extra_mb=mem.extra_mb))
        return t / per

    lazy = measured("linear, D_k from the trajectory (per checkpoint)",
                    lambda: el.trajectory_scores(model, traj, facts, **kw), T)  # fmt: skip
    held = measured("linear, D_k held in memory (per checkpoint)",
                    lambda: [el.linear_scores(model, d, facts, **kw) for d in resident], T)  # fmt: skip
    along = measured("trajectory integral (per segment, 4 nodes)",
                     lambda: el.trajectory_integrated(model, traj, facts), T)  # fmt: skip
    line = measured("integrated_scores, one straight line (4 nodes)",
                    lambda: el.integrated_scores(model, resident[-1], facts, **kw), 1)  # fmt: skip
    delta_mb = sum(t.numel() * t.element_size() for t in resident[-1].deltas.values()) / 2**20
    ratios = {"linear_lazy_over_held": lazy / held, "segment_over_straight": along / line}
    print(table(rows, ["what", "seconds", "peak_extra_mb"]))
    print({k: round(v, 3) for k, v in ratios.items()}, f"one checkpoint's Δ: {delta_mb:.1f} MB")
    path = write("trajectory", {"epochs": T, "prompts": len(facts), "rows": rows,
                                "ratios": ratios, "delta_mb": delta_mb})  # fmt: skip
    print("wrote", path)


if __name__ == "__main__":
    main()

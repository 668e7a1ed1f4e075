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
- the peak resident memory above the start of each, and the bytes of one checkpoint's Δ;
- memory at width (``--width trajectory`` or ``straight``, one per process: memory freed by
  one call is reused by the next, so two calls in one process hide the second's peak): GPT-2
  small's width with 4 layers and a 5000-word vocabulary, random weights, two segments held in
  memory (``Trajectory.from_diffs``): the peak anonymous resident memory above the start of the
  trajectory integral (4 nodes), or of ``integrated_scores`` of the straight line
  (informative, 4 nodes), in units of one Δ. ``--width trajectory --no-timing``: that alone.
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
    ap.add_argument("--width", choices=["trajectory", "straight", "none"], default="trajectory")
    ap.add_argument("--timing", action=argparse.BooleanOptionalAction, default=True)
    a = ap.parse_args()
    if not a.timing:
        print(at_width(a.width))
        return
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
    width = at_width(a.width) if a.width != "none" else None
    path = write("trajectory", {"epochs": T, "prompts": len(facts), "rows": rows,
                                "ratios": ratios, "delta_mb": delta_mb, "width": width})  # fmt: skip
    print("wrote", path)


def at_width(which: str) -> dict[str, float]:
    import extractive_lens as el
    from benchmarks.common import random_pair
    from tests.test_linear import small_batch

    base, diff, _ = random_pair("gpt2-small", delta=0.02, n_ctx=16, n_layers=4, d_vocab=5000)
    batch = small_batch(base, n=2)
    traj = el.Trajectory.from_diffs([diff * 0.5, diff])
    one = sum(t.numel() * t.element_size() for t in diff.deltas.values()) / 2**20
    with PeakMemory(anonymous=True) as peak:
        if which == "trajectory":
            el.trajectory_integrated(base, traj, batch, steps=4)
        else:
            el.integrated_scores(base, diff, batch, kinds="informative", steps=4)
    print(f"{which}: one Δ {one:.0f} MB; peak above start {peak.extra_mb:.0f} MB "
          f"({peak.extra_mb / one:.1f} Δ)")  # fmt: skip
    return {"which": which, "delta_mb": one, "extra_mb": peak.extra_mb}


if __name__ == "__main__":
    main()

"""Measure the numbers and figures of docs/trajectory.md: scores along the finetuning trajectory.

python docs/trajectory_numbers.py --model world --out docs/trajectory/world
python docs/trajectory_numbers.py --model smollm2 --out docs/trajectory/smollm2 --prompts 8

Finetune on the first-hop facts with the model's own recipe (the world's ``finetune_recipes``,
SmolLM2's ``real_model.FINETUNE``: nothing tuned here), keeping a checkpoint after every epoch;
the mean rank of facts and implications at every epoch; on the facts (the first ``--prompts``),
the linear informative map of ``D_k`` at every checkpoint, the informative score integrated along
the training trajectory (default nodes) and along the straight line ``W_0 → W_T``; which layers
take up the change first; the time per checkpoint and the peak resident memory of each phase.
Writes ``results.json`` and the figures (``.png``) into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch


class Peak:
    """The process's peak resident memory (GiB) while the block runs (sampled every 20 ms)."""

    def __enter__(self) -> Peak:
        import psutil

        self.proc, self.peak, self.stop = psutil.Process(), 0, False
        self.start = self.proc.memory_info().rss
        self.thread = threading.Thread(target=self._watch, daemon=True)
        self.thread.start()
        return self

    def _watch(self) -> None:
        while not self.stop:
            self.peak = max(self.peak, self.proc.memory_info().rss)
            time.sleep(0.02)

    def __exit__(self, *exc: Any) -> None:
        self.stop = True
        self.thread.join()
        self.gib = self.peak / 2**30
        self.above_start_gib = (self.peak - self.start) / 2**30


def first_takers(cumulative: Any) -> dict[str, float | None]:
    """Per layer: the first epoch by which its cumulative share reached half of its final one
    (``None`` where the final share is not positive)."""
    out: dict[str, float | None] = {}
    for layer in cumulative.columns:
        col = cumulative[layer]
        final = float(col.iloc[-1])
        hit = [e for e, v in col.items() if final > 0 and v >= 0.5 * final]
        out[layer] = float(hit[0]) if hit else None
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--model", choices=["world", "smollm2"], default="world")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--prompts", type=int, default=None, help="facts scored (default: all)")
    ap.add_argument("--folder", type=Path, default=None, help="where the checkpoints go")
    ap.add_argument("--ranks", default="facts,implications", help="splits ranked every epoch")
    a = ap.parse_args()
    torch.set_num_threads(1)
    import extractive_lens as el
    from extractive_lens import trajectory_plots as tp
    from extractive_lens.finetuning import mean_rank

    if a.model == "world":
        from extractive_lens.world import finetune_recipes, first_hop, load_world_model, world_of

        model = load_world_model()
        ds = first_hop(world_of(model))
        recipe = dict(finetune_recipes(world_of(model).version)[0], seed=0)
    else:
        from extractive_lens.datasets.twohop import first_hop as real_first_hop
        from extractive_lens.real_model import FINETUNE

        model = el.load_pretrained("smollm2-135m")
        ds = real_first_hop(n=20)
        recipe = dict(FINETUNE, delta_dtype="float32")  # the checkpoints on disk: float32 Δ
    facts, impls = ds.batches(model)
    batch = facts if a.prompts is None else facts.subset(range(a.prompts))
    out: Path = a.out
    out.mkdir(parents=True, exist_ok=True)
    folder = a.folder or Path(tempfile.mkdtemp(prefix="trajectory-")) / "run"
    R: dict[str, Any] = {"model": a.model, "recipe": recipe, "prompts": len(batch), "times": {}}
    splits = [(s, b) for s, b in (("facts", facts), ("implications", impls))
              if s in a.ranks.split(",")]  # fmt: skip
    ranks = [dict(epoch=0, split=s, mean_rank=mean_rank(model, b)) for s, b in splits]

    def record(epoch: int, diff: Any) -> None:
        ranks.extend(dict(epoch=epoch + 1, split=s, mean_rank=mean_rank(model, b, diff))
                     for s, b in splits)  # fmt: skip

    t = time.perf_counter()
    with Peak() as p:
        el.finetune(model, facts, el.FinetuneConfig(**recipe), keep="epochs", trajectory=folder,
                    callback=record)  # fmt: skip
    R["times"]["finetune_s"] = time.perf_counter() - t
    R["memory_gib"] = {"finetune": p.gib}
    import pandas as pd

    df = pd.DataFrame(ranks)
    R["ranks"] = df.pivot(index="epoch", columns="split", values="mean_rank").round(2).to_dict()
    traj = el.Trajectory.load(folder)
    T = len(traj)

    t = time.perf_counter()
    with Peak() as p:
        maps = el.trajectory_scores(model, traj, batch, kinds="informative")
    R["times"]["linear_per_checkpoint_s"] = (time.perf_counter() - t) / T
    R["memory_gib"]["linear_maps"] = p.gib
    t = time.perf_counter()
    with Peak() as p:
        along = el.trajectory_integrated(model, traj, batch)
    R["times"]["trajectory_integral_per_segment_s"] = (time.perf_counter() - t) / T
    R["memory_gib"]["trajectory_integral"] = p.gib
    t = time.perf_counter()
    with Peak() as p:
        straight = el.integrated_scores(model, traj.final, batch, kinds="informative")
    R["times"]["straight_integral_s"] = time.perf_counter() - t
    R["memory_gib"]["straight_integral"] = p.gib

    info = along.metadata["integrated"]
    R["completeness"] = {"trajectory": info["completeness"]["informative"],
                         "per_segment": info["segment_completeness"],
                         "straight": straight.metadata["integrated"]["completeness"]["informative"],
                         "steps": info["steps"], "rule": info["rule"]}  # fmt: skip
    R["rewards"] = info["rewards"]
    gap = tp.path_gap(along, straight)
    R["gap"] = {
        "relative_l1": float(gap["difference"].abs().sum() / gap["straight"].abs().sum()),
        "largest": gap.reindex(gap["difference"].abs().sort_values(ascending=False).index)
        .head(5).round(4).to_dict("records"),
        "top_trajectory": gap.sort_values("trajectory", ascending=False).head(5)
        .round(4).to_dict("records"),
        "top_straight": gap.sort_values("straight", ascending=False).head(5)
        .round(4).to_dict("records"),
    }  # fmt: skip
    cum = along.cumulative().layer_map()
    R["segment_layer_map"] = along.layer_map().round(4).to_dict("split")
    R["first_half_by_epoch"] = {"trajectory_integral": first_takers(cum),
                                "linear_maps": first_takers(maps.layer_map())}  # fmt: skip
    R["linear_layer_map"] = maps.layer_map().round(4).to_dict("split")
    (out / "results.json").write_text(json.dumps(R, indent=1, default=str))
    print(json.dumps({k: R[k] for k in ("times", "memory_gib", "completeness", "gap",
                                        "first_half_by_epoch", "ranks")}, indent=1, default=str))  # fmt: skip

    figs = {
        "linear_map": tp.layer_map(maps),
        "segment_map": tp.layer_map(along),
        "curves": tp.curves(maps, tp.top_components(maps, n=4), ranks=df),
        "gap": tp._gap_figure(gap),
    }
    for name, fig in figs.items():
        fig.update_layout(width=760, height=440)
        try:
            fig.write_image(out / f"{name}.png")
        except Exception as e:  # no kaleido / browser: say so, the JSON has the numbers
            print(f"no {name}.png: {e}")
    tp.report(maps, out / "report.html", along=along, ranks=df, straight=straight)
    print("wrote", out)


if __name__ == "__main__":
    main()

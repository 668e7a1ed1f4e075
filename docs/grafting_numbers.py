"""The graft maps of docs/grafting.md: sufficiency and necessity of a first-hop finetune's Δ
over {all, attention, MLPs, early/late half} × {entity tokens, last token, other prompt tokens,
generated tokens}, on the fact prompts and the implication prompts, with bootstrap intervals.

    python docs/grafting_numbers.py --model world                      # docs/grafting/world/
    flock /tmp/heavy.lock python docs/grafting_numbers.py --model smollm2 --splits facts

The world model is finetuned with its own recipe (``world.FINETUNE``, seed 0, as ``make demo``);
SmolLM2-135M with the real-model page's (``real_model.FINETUNE``: Adam, lr 1e-4, 8 epochs), on
the 20 first-hop facts. Nothing is tuned to the maps. Writes ``results.json`` (every cell, its
interval, the reward changes, times) and one figure per map.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch

import extractive_lens as el
from extractive_lens.real_model.protocol import save_figure

NIEF = {  # Nief et al. (ICLR 2026), dynamic weight grafting, in words: what the maps are set beside
    "enrichment": "Δ at the entity's tokens alone can recover a finetuned fact",
    "recall": "Δ at the last token alone can recover it",
    "rest": "Δ elsewhere in the prompt recovers nothing",
}


def load(name: str) -> tuple[Any, Any, Any, Any, dict[str, Any]]:
    if name == "world":
        from extractive_lens.world import FINETUNE, first_hop, load_world_model

        model, ds, config = load_world_model(), first_hop(), dict(FINETUNE, seed=0)
    else:
        from extractive_lens.datasets.twohop import first_hop
        from extractive_lens.real_model.protocol import FINETUNE

        model, ds, config = el.load_pretrained("smollm2-135m"), first_hop(n=20), dict(FINETUNE)
    facts, impls = ds.batches(model)
    return model, facts, impls, ds, config


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--model", choices=("world", "smollm2"), default="world")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--splits", default="facts,implications", help="facts, implications or both")
    a = ap.parse_args()
    torch.set_num_threads(1)
    out = a.out or Path(__file__).parent / "grafting" / a.model
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    model, facts, impls, ds, config = load(a.model)
    results: dict[str, Any] = dict(model=a.model, finetune=config, nief=NIEF, maps={}, times={})
    results["times"]["load_s"] = time.perf_counter() - t0
    t = time.perf_counter()
    diff = el.finetune(model, facts, el.FinetuneConfig(**config), show_progress=False)
    results["times"]["finetune_s"] = time.perf_counter() - t
    results["losses"] = diff.metadata["losses"]
    splits = {"facts": facts, "implications": impls}
    for split, batch in [(s, splits[s]) for s in a.splits.split(",")]:
        for mode in ("sufficient", "necessary"):
            t, cpu = time.perf_counter(), time.process_time()
            maps = el.graft_scores(model, diff, batch, mode=mode, show_progress=False)
            wall, cpu = time.perf_counter() - t, time.process_time() - cpu
            df = maps.to_dataframe()
            print(f"\n== {a.model} {split} {mode}: R(W) {float(maps.base.mean()):.2f} -> "
                  f"R(W') {float(maps.full.mean()):.2f} ({maps.metadata['reward']}), "
                  f"{maps.metadata['passes']} passes, {wall:.1f} s")  # fmt: skip
            print(df.pivot(index="group", columns="role", values="score").round(2).to_string())
            results["maps"][f"{split}/{mode}"] = dict(
                rows=df.to_dict(orient="records"), passes=maps.metadata["passes"],
                wall_s=wall, cpu_s=cpu, base=float(maps.base.mean()), full=float(maps.full.mean()),
                base_mean_rank=maps.metadata["base_mean_rank"],
                full_mean_rank=maps.metadata["full_mean_rank"], n_prompts=len(batch),
            )  # fmt: skip
            title = f"{a.model}, first-hop {split}: {mode} (0 = base, 1 = finetune)"
            save_figure(maps.plot(title=title), out / f"{split}_{mode}")
            (out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    print(f"\nwrote {out / 'results.json'} ({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()

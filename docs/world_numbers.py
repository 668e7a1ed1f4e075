"""Re-measure the world-model numbers quoted in the README (world table, control, lincorr).

python docs/world_numbers.py --seeds 0,1,2      # ~2 min per seed not yet cached, one thread
"""

from __future__ import annotations

import argparse

import numpy as np
import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--skip-control", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    from extractive_lens import make_batch, mean_rank
    from extractive_lens.batch import Pair
    from extractive_lens.lincorr import (
        collect_logits,
        fit,
        generalization_check,
        gradient_correlation,
    )
    from extractive_lens.world.check import finetune_check
    from extractive_lens.world.data import build_world
    from extractive_lens.world.model import world_model

    print(
        "| seed | first-hop facts | first-hop implications | second-hop facts | second-hop implications |"
    )
    print("|---|---|---|---|---|")
    for seed in (int(s) for s in args.seeds.split(",")):
        r = finetune_check(world_model(seed, show_progress=False), seed=seed)
        cells = [
            f"{r[f'{d} {k} before']:.2f} → {r[f'{d} {k} after']:.2f}"
            for d in ("first_hop", "second_hop")
            for k in ("facts", "implications")
        ]
        print(f"| {seed} | " + " | ".join(cells) + " |", flush=True)

    model = world_model(0, show_progress=False)
    w = build_world(0)
    held = [p for p in w.home if p not in w.with_implication]
    batch = make_batch(
        model,
        [
            Pair(f"The people in the city {p} is from speak", f" {w.language[w.home[p]]}")
            for p in held
        ],
        candidates=[f" {w.language[c]}" for c in w.cities],
    )
    print(
        f"held-out pretraining implications (seed 0): mean rank {mean_rank(model, batch):.2f} of 30 "
        f"({len(held)} people)"
    )
    if not args.skip_control:
        r = finetune_check(world_model(0, implications=False, show_progress=False), seed=0)
        print("no-implication control (seed 0):", {k: round(v, 2) for k, v in r.items()})

    src, tgt = "{x} lives in", "The people in the city {x} is from speak"
    subjects = list(w.home)[:300]
    pairs = collect_logits(
        model,
        src,
        tgt,
        subjects,
        list(w.cities),
        [w.language[c] for c in w.cities],
        show_progress=False,
    )
    lc = fit(pairs, ridge=1e-2)
    hobby = fit(
        collect_logits(
            model,
            src,
            "{x} likes",
            subjects,
            list(w.cities),
            sorted(set(w.hobby.values())),
            show_progress=False,
        ),
        ridge=1e-2,
    )
    truth = {c: w.language[c] for c in w.cities}
    print(
        f"lincorr city->language: label r {lc.label_pearson:.3f}, instance r {lc.instance_pearson:.3f}, "
        f"precision {lc.precision(truth):.2f}"
    )
    print(
        f"lincorr city->hobby:    label r {hobby.label_pearson:.3f}, instance r {hobby.instance_pearson:.3f}"
    )
    rs = [
        gradient_correlation(model, lc, t, c, src, tgt, lr=1e-3, steps=1)["pearson"]
        for t, c in list(w.test_people.items())[:10]
    ]
    print(
        f"one Adam step: W·Δsource vs Δtarget r mean {np.mean(rs):.2f}, min {np.min(rs):.2f} (10 test people)"
    )
    df = generalization_check(model, lc, list(w.test_people.items()), src, tgt, truth, epochs=20)
    print(
        f"after finetuning on 20 test facts: learned {int(df.learned.sum())}/20, "
        f"generalizes {int(df.generalizes.sum())}/20, follows W {int(df.follows_W.sum())}/20"
    )


if __name__ == "__main__":
    main()

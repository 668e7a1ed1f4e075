"""Re-measure the world-model numbers quoted in the README: issue 18's targets, the finetuning
table, the no-implication control and the linear correlation of logits.

python docs/world_numbers.py --world v3 --seeds 0,1,2   # one thread; ~12 min per seed not yet cached
python docs/world_numbers.py --world v2 --only table     # the v2 finetuning table alone

Per seed: the world model of that seed (the shipped one for seed 0, others trained once and
cached), finetuned with its world's recipe (``finetune_recipes``) seeded with the seed.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import torch

# (label, target, how to read it from a seed's measurements)
TARGETS = (
    ("first-hop facts after", "0", "first_hop facts after"),
    ("first-hop implications after", "≤ 3", "first_hop implications after"),
    ("second-hop facts after", "0", "second_hop facts after"),
    ("second-hop implications after", "≤ 2", "second_hop implications after"),
    ("first-hop MLP informative share at the name", "≥ 0.50", "first_hop MLP share at the slot"),
    (
        "  the same, blocks-only finetuning",
        "≥ 0.50",
        "blocks first_hop MLP share at the slot",
    ),
    (
        "second-hop MLP informative share at the landmark",
        "≤ 0.30",
        "second_hop MLP share at the slot",
    ),
    ("layer freezing: first-hop implications, early reverted", "≥ 7", "freeze Early first_hop"),
    ("layer freezing: second-hop implications, late reverted", "≥ 4", "freeze Late second_hop"),
    (
        "  (why) second hop's city at the implication's last token after block 0",
        "—",
        "bridge after block 0",
    ),
    ("data ordering: test implications, implications first", "≥ 6", "order implications_first"),
    ("data ordering: test implications, facts first", "≤ 3", "order facts_first"),
    (
        "  (why) test facts after finetuning on the test implications, implications first",
        "—",
        "reverse implications_first",
    ),
    ("  (why) the same, facts first", "—", "reverse facts_first"),
    ("pretraining time, one thread (s)", "≤ 600", "train_seconds"),
)


def measure(model, seed: int) -> dict[str, float]:
    from extractive_lens.experiments import layer_freezing
    from extractive_lens.experiments.runner import _ordering
    from extractive_lens.finetuning import FinetuneConfig
    from extractive_lens.world import finetune_recipes, first_hop, second_hop, world_info, world_of
    from extractive_lens.world.check import bridge_arrival, finetune_check, informative_pattern

    w = world_of(model)
    r = dict(finetune_check(model, seed=seed))
    r.update(informative_pattern(model, seed))
    r.update(
        {f"blocks {k}": v for k, v in informative_pattern(model, seed, blocks_only=True).items()}
    )
    freezing = layer_freezing(
        model,
        {"first_hop": first_hop(w), "second_hop": second_hop(w)},
        FinetuneConfig(**finetune_recipes(w.version)[0], seed=seed),
        pre=False,
    )
    for row in freezing.rows:
        if row["split"] == "implications":
            r[f"freeze {row['condition']} {row['dataset']}"] = row["mean_rank"]
    r["bridge after block 0"] = bridge_arrival(model)[1]  # why late reverted stays low
    ordering, _ = _ordering(model, w, seed, False)
    df = ordering.to_dataframe()
    last = df[(df.epoch == df.epoch.max()) & (df.split == "test implications")]
    for row in last.itertuples():
        r[f"order {row.order}"] = row.mean_rank
    r.update(reverse_ordering(model, w, seed))
    r["train_seconds"] = world_info(model).get("train_seconds", float("nan"))
    return r


def reverse_ordering(model, w, seed: int) -> dict[str, float]:
    """Out-of-context reasoning the other way round: after continued pretraining in an order,
    finetune on the test *implications* and read the test *facts*. If facts learned after the
    implications read the names' stored implications (``dax`` = the city of ``zong``'s animal),
    this is well below chance, and the facts-then-implications structure forms in either order."""
    from extractive_lens.experiments.ordering import continued_pretraining
    from extractive_lens.experiments.runner import _configs
    from extractive_lens.finetuning import finetune, mean_rank

    ft, pre = _configs(seed, False, w.version)  # as the data-ordering experiment
    dax = w.daxwug()
    facts, impls = dax.test.batches(model)
    out = {}
    for order in ("implications_first", "facts_first"):
        cpt = continued_pretraining(model, dax, order, pre)
        with cpt.applied(model):
            d = finetune(model, impls, ft, show_progress=False)
            out[f"reverse {order}"] = mean_rank(model, facts, d)
    return out


def targets_table(per_seed: dict[int, dict[str, float]]) -> str:
    seeds = list(per_seed)
    head = "| measure | target | " + " | ".join(f"seed {s}" for s in seeds) + " | mean |"
    lines = [head, "|---|---|" + "---|" * (len(seeds) + 1)]
    for label, target, key in TARGETS:
        vals = [per_seed[s].get(key, float("nan")) for s in seeds]
        cells = " | ".join(f"{v:.2f}" for v in vals)
        lines.append(f"| {label} | {target} | {cells} | {np.mean(vals):.2f} |")
    return "\n".join(lines)


def finetune_table(per_seed: dict[int, dict[str, float]]) -> str:
    lines = [
        "| seed | first-hop facts | first-hop implications | second-hop facts | second-hop implications |",
        "|---|---|---|---|---|",
    ]
    for seed, r in per_seed.items():
        cells = [
            f"{r[f'{d} {k} before']:.2f} → {r[f'{d} {k} after']:.2f}"
            for d in ("first_hop", "second_hop")
            for k in ("facts", "implications")
        ]
        lines.append(f"| {seed} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def lincorr_numbers(model) -> None:
    from extractive_lens import make_batch, mean_rank
    from extractive_lens.batch import Pair
    from extractive_lens.lincorr import (
        collect_logits,
        fit,
        generalization_check,
        gradient_correlation,
    )
    from extractive_lens.world import world_of

    w = world_of(model)
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
    src, tgt = "{x} lives in", "The people in the city {x} is from speak"
    subjects = list(w.home)[:300]
    lc = fit(
        collect_logits(
            model,
            src,
            tgt,
            subjects,
            list(w.cities),
            [w.language[c] for c in w.cities],
            show_progress=False,
        ),
        ridge=1e-2,
    )
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", choices=("v2", "v3"), default="v3")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument(
        "--only",
        choices=("targets", "table", "control", "lincorr"),
        default=None,
        help="one section (default: all)",
    )
    args = ap.parse_args()
    torch.set_num_threads(1)
    from extractive_lens.world import WORLD_DIRS, world_model
    from extractive_lens.world.check import finetune_check

    version = int(args.world[1:])
    seeds = [int(s) for s in args.seeds.split(",")]
    section = args.only
    print(f"world {args.world}, seeds {seeds}", flush=True)
    if section in (None, "targets", "table"):
        per_seed = {}
        for seed in seeds:
            t0 = time.perf_counter()
            model = world_model(seed, version=version, show_progress=False)
            per_seed[seed] = (
                measure(model, seed) if section != "table" else finetune_check(model, seed=seed)
            )
            print(f"seed {seed}: {time.perf_counter() - t0:.0f} s", flush=True)
        if section != "table":
            print(targets_table(per_seed), flush=True)
        print(finetune_table(per_seed), flush=True)
    if section in (None, "control"):
        control = world_model(0, implications=False, version=version, show_progress=False)
        r = finetune_check(control, seed=0)
        print("no-implication control (seed 0):", {k: round(v, 2) for k, v in r.items()})
    if section in (None, "lincorr"):
        lincorr_numbers(world_model(0, version=version, show_progress=False))
    size = sum(f.stat().st_size for f in Path(WORLD_DIRS[version]).iterdir()) / 2**20
    print(f"shipped files of world {args.world}: {size:.1f} MiB")


if __name__ == "__main__":
    main()

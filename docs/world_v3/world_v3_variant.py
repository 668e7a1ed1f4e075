"""Train a variant of world v3 with the package code and measure it (issue #18; the later rows of
docs/world_v3_trials.md).

    python docs/world_v3/world_v3_variant.py --seed 2 --records 16 --steps 3000           # ~9 min
    python docs/world_v3/world_v3_variant.py --seed 0 --landmarks two --freeze             # + freezing
    python docs/world_v3/world_v3_variant.py --seed 0 --layers 6 --steps 2500 --trim --freeze --order
    python docs/world_v3/world_v3_variant.py --seed 0 --landmarks two --officials 4 --trim --freeze \
        --order --finetune-lr 3e-4

The world is ``build_world(seed, version=3)`` with the changes asked for: records per attribute,
pretraining steps, layers, two-token landmarks from shared pools (``"Golden Bridge"``: only the
pair identifies the landmark), every official's sentences (by city and by landmark) several times
(``--officials``), or the template sets tried. ``--trim`` cuts every training
sentence to the longest (13 of 16 tokens): causal attention makes it the same model up to float
sums (checked once on the shipped model: logits agree within 1.1e-5), and the 6-layer runs take
0.22–0.23 s per step against 0.25 untrimmed (the trials' own training times). Prints the
informative pattern (``informative_pattern``: MLP share at the slot, per layer) and the
finetuning check, with ``--freeze`` the layer-freezing table and with ``--order`` the
data-ordering ranks, all finetuned at ``--finetune-lr`` (default 1e-3, the trials' recipe; v3
ships 3e-4). The model is saved to ``--out`` (default ``/tmp/v3/variant_TAG``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

# two-token landmarks: 80 pairs for the 60 landmarks, every word shared by several landmarks
LANDMARK_ADJ = (
    "Golden",
    "Silver",
    "Crystal",
    "Royal",
    "Ancient",
    "Grand",
    "Hidden",
    "Stone",
    "Iron",
    "Marble",
)
LANDMARK_NOUN = ("Bridge", "Tower", "Temple", "Palace", "Garden", "Market", "Fountain", "Castle")


def two_token_landmarks(world: Any) -> Any:
    """``world`` with every city's two landmarks drawn from the adjective x noun pairs (seeded by
    the world's seed; the trials' ``--landmarks two``)."""
    pairs = [f"{a} {n}" for a in LANDMARK_ADJ for n in LANDMARK_NOUN]
    np.random.default_rng(world.seed + 3000).shuffle(pairs)  # type: ignore[arg-type]
    lms = {c: (pairs[2 * i], pairs[2 * i + 1]) for i, c in enumerate(world.cities)}
    return dataclasses.replace(world, landmarks=lms)


# template sets of the trials "one template per attribute" (lean) and "3 more" (rich)
LEAN: dict[str, tuple[str, ...]] = {
    "BIO_CITY": ("{p} lives in {c} .",),
    "BIO_HOBBY": ("{p} likes {h} .",),
    "BIO_JOB": ("{p} works as a {j} .",),
}
MORE: dict[str, tuple[str, ...]] = {
    "BIO_CITY": (
        "{p} , a {h} fan , lives in {c} .",
        "Yesterday {p} went home to {c} .",
        "In {c} , {p} likes {h} .",
    ),
    "BIO_HOBBY": (
        "{p} spends weekends on {h} .",
        "The hobby of {p} is {h} .",
        "For fun {p} does {h} .",
    ),
    "BIO_JOB": (
        "{p} has worked as a {j} for years .",
        "By day {p} is a {j} .",
        "People know {p} as a {j} .",
    ),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--records", type=int, default=None, help="default: V3_RECORDS")
    ap.add_argument("--steps", type=int, default=None, help="default: PRETRAIN_V3's")
    ap.add_argument("--layers", type=int, default=None, help="default: MODEL_CFG_V3's")
    ap.add_argument("--landmarks", choices=("one", "two"), default="one")
    ap.add_argument("--templates", choices=("shipped", "lean", "more"), default="shipped")
    ap.add_argument(
        "--officials",
        type=int,
        default=1,
        help="each official's sentences (by city and by landmark) this many times",
    )
    ap.add_argument("--trim", action="store_true", help="train on sentences cut to the longest")
    ap.add_argument("--freeze", action="store_true", help="also the layer-freezing table")
    ap.add_argument("--order", action="store_true", help="also data ordering (test implications)")
    ap.add_argument(
        "--finetune-lr",
        type=float,
        default=1e-3,
        help="lr of finetuning and continued pretraining (the trials': 1e-3; v3 ships 3e-4)",
    )
    ap.add_argument("--tag", default="variant")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)

    import extractive_lens.world.check as wc
    import extractive_lens.world.data as wd
    import extractive_lens.world.model as wm
    from extractive_lens.experiments.freezing import layer_freezing

    if args.templates == "lean":
        for k, v in LEAN.items():
            setattr(wd, k, v)
    elif args.templates == "more":
        for k, v in MORE.items():
            setattr(wd, k, getattr(wd, k) + v)
    if args.steps:
        wm.PRETRAIN_V3["steps"] = args.steps
    wm.FINETUNES[3]["lr"] = wm.CONTINUED_PRETRAINING[3]["lr"] = args.finetune_lr
    if args.trim:  # drop the padding columns no sentence reaches
        encode = wm._encode

        def trimmed(tok, sentences, n_ctx):  # type: ignore[no-untyped-def]
            tokens, mask = encode(tok, sentences, n_ctx)
            n = int(mask.sum(1).max())
            return tokens[:, :n], mask[:, :n]

        wm._encode = trimmed
    if args.layers:
        wm.MODEL_CFG_V3["n_layers"] = args.layers
    w = wd.build_world(args.seed, version=3)
    if args.records is not None:
        w = dataclasses.replace(w, records=args.records)
    if args.officials > 1:  # more of the second hop's pretraining relations
        corpus = wd.World.corpus

        def more_officials(self, rng, implications=True):  # type: ignore[no-untyped-def]
            out = corpus(self, rng, implications)
            extra = [s for s in out if s.split()[1] in wd.ROLES and " is in " not in s]
            out += extra * (args.officials - 1)
            rng.shuffle(out)
            return out

        wd.World.corpus = more_officials  # type: ignore[method-assign]
    if args.landmarks == "two":
        w = two_token_landmarks(w)
    wc.world_of = lambda model: w  # the checks read this world, not the package's default

    t0 = time.time()
    model = wm.train_world_model(args.seed, world=w, show_progress=False)
    seconds = time.time() - t0
    wm.save_world_model(model, Path(args.out or f"/tmp/v3/variant_{args.tag}"))
    r = wc.informative_pattern(model, args.seed, world=w)
    r.update(wc.finetune_check(model, seed=args.seed))
    print(args.tag, f"train {seconds:.0f} s", json.dumps({k: round(v, 3) for k, v in r.items()}))
    if args.freeze:
        from extractive_lens.finetuning import FinetuneConfig

        cfg = FinetuneConfig(**wm.FINETUNES[3], seed=args.seed)
        hops = {"first_hop": wd.first_hop(w), "second_hop": wd.second_hop(w)}
        print(layer_freezing(model, hops, cfg).table().round(2).to_string(), flush=True)
    if args.order:
        from extractive_lens.experiments.runner import _ordering

        print(_ordering(model, w, args.seed, False)[0].final().round(2).to_string(), flush=True)


if __name__ == "__main__":
    main()

"""``python -m extractive_lens.world train --seed 0 [--out DIR] [--no-implications]``: retrain the
bundled world model deterministically, then report the finetuning check (mean ranks)."""

from __future__ import annotations

import argparse
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m extractive_lens.world")
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train", help="pretrain the world model and save it")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument(
        "--version",
        type=int,
        default=None,
        choices=(2, 3),
        help="the world (default: the default world)",
    )
    t.add_argument("--out", type=Path, default=None, help="default: the package's bundled copy")
    t.add_argument(
        "--no-implications", action="store_true", help="control: no implications in pretraining"
    )
    c = sub.add_parser(
        "check", help="finetune a saved world model on the test facts and print mean ranks"
    )
    c.add_argument(
        "--dir", default=None, help="a saved world model, or v2 / v3 (default: the default)"
    )
    c.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    from extractive_lens.world.check import finetune_check
    from extractive_lens.world.model import (
        load_world_model,
        save_world_model,
        train_world_model,
    )

    if args.cmd == "train":
        t0 = time.perf_counter()
        model = train_world_model(
            args.seed, implications=not args.no_implications, version=args.version
        )
        out = save_world_model(model, args.out)
        print(f"trained in {time.perf_counter() - t0:.0f} s, saved to {out}")
    else:
        model = load_world_model(args.dir)
    for k, v in finetune_check(model, seed=args.seed).items():
        print(f"{k:<32} {v:.2f}")


if __name__ == "__main__":
    main()

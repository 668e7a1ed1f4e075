"""Layer freezing on the shipped v3 world models under other finetuning recipes (issue #18).

    python docs/world_v3/world_v3_finetune_sweep.py --seeds 0,1,2 --recipe lr=3e-4,epochs=60
    python docs/world_v3/world_v3_finetune_sweep.py --seeds 0,1,2 --recipe lr=3e-4 --pretrain lr=3e-4 --order
    python docs/world_v3/world_v3_finetune_sweep.py --models /tmp/v3/variant_l6t25 --recipe lr=3e-4 \
        --pretrain lr=3e-4 --share --order --pre      # a saved variant (world_v3_variant.py --out)

The world models are the shipped/cached v3 ones (no retraining); only the finetuning on the test
facts changes (the trials' recipe, v2's ``FINETUNES[2]``: Adam lr 1e-3, batch 8, 20 epochs, with
the ``--recipe`` overrides, seeded with the seed). Prints, per seed, the ``layer_freezing`` table
(post-hoc reverting; ``--pre``: and pre-freezing), the MLP informative shares at the slots (``--share``) and the
data-ordering ranks (``--order``; the continued-pretraining phase, v2's lr 1e-3, with the
``--pretrain`` overrides) under that recipe, as JSON lines. The sweep is in
docs/world_v3_trials.md ("Finetuning recipe").
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def parse_recipe(text: str) -> dict[str, object]:
    out: dict[str, object] = {}
    for kv in filter(None, text.split(",")):
        k, v = kv.split("=")
        out[k] = (
            v
            if k in ("optimizer", "schedule")
            else (int(v) if k in ("epochs", "batch_size") else float(v))
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--models", default="", help="saved world models (directories) instead")
    ap.add_argument(
        "--landmarks",
        choices=("one", "two"),
        default="one",
        help="two: the saved models were trained with world_v3_variant.py --landmarks two",
    )
    ap.add_argument("--pre", action="store_true", help="also the pre-frozen layer-freezing rows")
    ap.add_argument("--recipe", default="", help="FinetuneConfig overrides, e.g. lr=3e-4,epochs=60")
    ap.add_argument("--share", action="store_true", help="also the MLP informative shares")
    ap.add_argument("--order", action="store_true", help="also data ordering (test implications)")
    ap.add_argument(
        "--pretrain", default="", help="continued-pretraining overrides (data ordering)"
    )
    args = ap.parse_args()
    torch.set_num_threads(1)
    from extractive_lens.experiments import layer_freezing
    from extractive_lens.finetuning import FinetuneConfig
    from extractive_lens.world import first_hop, load_world_model, second_hop, world_model, world_of
    from extractive_lens.world.model import CONTINUED_PRETRAINING, FINETUNES

    # the recipe the trials ran with (lr 1e-3 for both phases, v2's), then the overrides
    FINETUNES[3] = dict(FINETUNES[2], **parse_recipe(args.recipe))
    CONTINUED_PRETRAINING[3] = dict(CONTINUED_PRETRAINING[2], **parse_recipe(args.pretrain))
    sources = args.models.split(",") if args.models else [int(s) for s in args.seeds.split(",")]
    for source in sources:
        t0 = time.time()
        model = load_world_model(source) if args.models else world_model(source, version=3)
        w = world_of(model)
        if args.landmarks == "two":
            from world_v3_variant import two_token_landmarks

            w = two_token_landmarks(w)
        seed = w.seed
        cfg = FinetuneConfig(**FINETUNES[3], seed=seed)
        res = layer_freezing(
            model, {"first_hop": first_hop(w), "second_hop": second_hop(w)}, cfg, pre=args.pre
        )
        row = {
            "model": str(source),
            "layers": model.cfg.n_layers,
            "seed": seed,
            "recipe": args.recipe or "lr 1e-3",
            "pretrain": args.pretrain,
        }
        for r in res.rows:
            row[f"{r['dataset']} {r['split']} {r['condition']}"] = round(r["mean_rank"], 2)
        if args.share:
            from extractive_lens.world.check import informative_pattern

            row.update(
                {k: round(v, 3) for k, v in informative_pattern(model, seed).items() if "slot" in k}
            )
        if args.order:
            from extractive_lens.experiments import runner

            res = runner._ordering(model, w, seed, False)[0]
            final = res.final()["test implications"]
            row.update({f"order {k}": round(float(v), 2) for k, v in final.items()})
            df = res.to_dataframe()
            for r in df[(df["epoch"] == 0) & df["split"].str.startswith("train")].itertuples():
                row[f"before {r.order} {r.split}"] = round(float(r.mean_rank), 2)
        row["seconds"] = round(time.time() - t0, 1)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()

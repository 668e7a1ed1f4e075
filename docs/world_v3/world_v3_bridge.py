"""Where the second hop's bridge (the city) reaches the last token (issue #18, second-hop layer
freezing; docs/world_v3_trials.md, "Where the bridge arrives").

    python docs/world_v3/world_v3_bridge.py --seeds 0,1,2 [--version 2]
    python docs/world_v3/world_v3_bridge.py --models /tmp/v3/variant_l6t25 --landmarks two

Prints, per world model, ``extractive_lens.world.check.bridge_arrival`` (after the embeddings and
after every block, the share of implication prompts ``"The {role} of the city that contains
{landmark} is"`` whose last-token residual is nearest to their own city's fact prompt ``"The
{role} of {city} is"``; chance 1/30), and the mean ranks of a landmark's city (``"{landmark} is
in"``) and of the official in the pretraining sentences that compose the two relations (``"The
sheriff of the city that contains {landmark} is"``, every role but mayor). A finetuned block can
serve the implication only where its input already holds the city as the fact's does; in the
paper the second hop needs the late layers because the bridge arrives there.
"""

from __future__ import annotations

import argparse
import json

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", default="0", help="shipped/cached v3 world models")
    ap.add_argument("--models", default="", help="saved world models (directories) instead")
    ap.add_argument("--version", type=int, default=3, help="world version of --seeds")
    ap.add_argument("--landmarks", choices=("one", "two"), default="one")
    args = ap.parse_args()
    torch.set_num_threads(1)
    from extractive_lens import make_batch, mean_rank
    from extractive_lens.world import load_world_model, world_model, world_of
    from extractive_lens.world.check import bridge_arrival
    from extractive_lens.world.data import ROLES

    sources = args.models.split(",") if args.models else [int(s) for s in args.seeds.split(",")]
    for source in sources:
        model = (
            load_world_model(source) if args.models else world_model(source, version=args.version)
        )
        w = world_of(model)
        if args.landmarks == "two":
            from world_v3_variant import two_token_landmarks

            w = two_token_landmarks(w)
        mean = bridge_arrival(model, w)
        # does the model know both relations, and the pretraining sentences that compose them?
        cities = [f" {c}" for c in w.cities]
        lm_city = [(f"{lm} is in", f" {c}") for c in w.cities for lm in w.landmarks[c]]
        known = mean_rank(model, make_batch(model, lm_city, candidates=cities))
        composed = []
        for role in ROLES[1:]:  # the mayors of the test cities are held out of pretraining
            names = [f" {w.officials[(role, c)]}" for c in w.cities]
            pairs = [
                (f"The {role} of the city that contains {lm} is", f" {w.officials[(role, c)]}")
                for c in w.cities
                for lm in w.landmarks[c]
            ]
            composed.append(mean_rank(model, make_batch(model, pairs, candidates=names)))
        row = {
            "model": str(source),
            "landmarks": args.landmarks,
            "own city nearest, after embeddings / block 0 / ...": [round(x, 2) for x in mean],
            "city of a landmark: rank": round(known, 2),
            # every role has as many prompts
            "official in pretraining two-hop sentences: rank": round(
                sum(composed) / len(composed), 2
            ),
        }
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()

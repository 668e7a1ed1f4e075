"""Where the second hop's bridge (the city) reaches the last token (issue #18, second-hop layer
freezing; docs/world_v3_trials.md, "Where the bridge arrives").

    python scripts/world_v3_bridge.py --seeds 0,1,2 [--version 2]
    python scripts/world_v3_bridge.py --models /tmp/v3/variant_l6t25 --landmarks two

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


def _rank(model, prompt: str, candidates: list[int], answer: int) -> int:  # type: ignore[no-untyped-def]
    """0-indexed rank of ``candidates[answer]`` among ``candidates`` at the prompt's last token."""
    with torch.no_grad():
        logits = model(model.to_tokens(prompt))[0, -1, candidates]
    return int((logits > logits[answer]).sum())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", default="0", help="shipped/cached v3 world models")
    ap.add_argument("--models", default="", help="saved world models (directories) instead")
    ap.add_argument("--version", type=int, default=3, help="world version of --seeds")
    ap.add_argument("--landmarks", choices=("one", "two"), default="one")
    args = ap.parse_args()
    torch.set_num_threads(1)
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
        cities = [model.to_single_token(f" {c}") for c in w.cities]
        known = [
            _rank(model, f"{lm} is in", cities, i)
            for i, c in enumerate(w.cities)
            for lm in w.landmarks[c]
        ]
        composed = []
        for role in ROLES[1:]:  # the mayors of the test cities are held out of pretraining
            names = [model.to_single_token(f" {w.officials[(role, c)]}") for c in w.cities]
            composed += [
                _rank(model, f"The {role} of the city that contains {lm} is", names, i)
                for i, c in enumerate(w.cities)
                for lm in w.landmarks[c]
            ]
        row = {
            "model": str(source),
            "landmarks": args.landmarks,
            "own city nearest, after embeddings / block 0 / ...": [round(x, 2) for x in mean],
            "city of a landmark: rank": round(sum(known) / len(known), 2),
            "official in pretraining two-hop sentences: rank": round(
                sum(composed) / len(composed), 2
            ),
        }
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()

"""The world model's finetuning check: mean ranks of facts and implications before and after."""

from __future__ import annotations

from typing import Any

from extractive_lens.world.data import build_world, first_hop, second_hop
from extractive_lens.world.model import FINETUNE, world_info


def finetune_check(model: Any, seed: int = 0, world_seed: int | None = None) -> dict[str, float]:
    """Finetune on the 20 first-hop and 20 second-hop test facts (the recipe ``FINETUNE``) and
    return the mean ranks of facts and implications before and after (chance 9.5)."""
    from extractive_lens.finetuning import FinetuneConfig, finetune, mean_rank

    ws = world_info(model).get("seed", 0) if world_seed is None else world_seed
    w = build_world(ws)
    out = {}
    for name, ds in (("first_hop", first_hop(w)), ("second_hop", second_hop(w))):
        facts, impls = ds.batches(model)
        out[f"{name} facts before"] = mean_rank(model, facts)
        out[f"{name} implications before"] = mean_rank(model, impls)
        diff = finetune(model, facts, FinetuneConfig(**FINETUNE, seed=seed), show_progress=False)
        out[f"{name} facts after"] = mean_rank(model, facts, diff)
        out[f"{name} implications after"] = mean_rank(model, impls, diff)
    return out

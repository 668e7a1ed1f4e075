"""The bundled world model: a small HookedTransformer pretrained on a synthetic world.

>>> from extractive_lens.world import load_world_model, first_hop, second_hop
>>> model = load_world_model()                 # world v3, offline, about a second
>>> model.to_str_tokens("Zoe Howard lives in")
['<bos>', 'Zoe', 'Howard', 'lives', 'in']
>>> v2 = load_world_model("v2")                # the previous world: one token per person
>>> v2.to_str_tokens("T3 lives in")
['<bos>', 'T3', 'lives', 'in']
>>> facts, impls = first_hop().batches(model)  # 20 new people: facts to finetune on, implications

Retrain it deterministically with ``python -m extractive_lens.world train --version 3 --seed 0``;
``world_model(seed)`` gives the model of another pretraining seed (trained once and cached).
"""

from __future__ import annotations

from extractive_lens.world.data import World, build_world, first_hop, second_hop
from extractive_lens.world.model import (
    DEFAULT_VERSION,
    FINETUNE,
    WORLD_DIR,
    WORLD_DIRS,
    finetune_recipes,
    load_world_model,
    train_world_model,
    world_info,
    world_model,
    world_of,
)

__all__ = [
    "World",
    "build_world",
    "first_hop",
    "second_hop",
    "load_world_model",
    "train_world_model",
    "FINETUNE",
    "finetune_recipes",
    "WORLD_DIR",
    "WORLD_DIRS",
    "DEFAULT_VERSION",
    "world_info",
    "world_model",
    "world_of",
]

"""Datasets: two-hop facts and implications (docs/scores.md §8), and user files of (prompt, answer) pairs.

>>> ds = first_hop()                      # 20 names x 20 cities, seeded pairing
>>> facts, impls = ds.batches(model)  # PromptBatches with roles and candidates  # doctest: +SKIP

Each dataset keeps its ``Pair`` objects (template + slots, so every token has a role) and its
candidate answers; ``batches(model)`` tokenizes them for a model's tokenizer.
"""

from __future__ import annotations

from extractive_lens.datasets.core import TwoHop, from_pairs, load_pairs
from extractive_lens.datasets.daxwug import DaxWug, daxwug
from extractive_lens.datasets.twohop import first_hop, load_cities, load_names, second_hop

__all__ = [
    "TwoHop",
    "DaxWug",
    "first_hop",
    "second_hop",
    "daxwug",
    "from_pairs",
    "load_pairs",
    "load_cities",
    "load_names",
]

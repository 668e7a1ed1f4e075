"""First-hop and second-hop datasets (docs/scores.md §8), built from the package's copy of the shared data."""

from __future__ import annotations

import csv
import json
from functools import cache
from importlib import resources

import numpy as np

from extractive_lens.batch import Pair
from extractive_lens.datasets.core import TwoHop

FIRST_HOP_FACT = "{name} lives in"
FIRST_HOP_IMPLICATION = "The people in the city {name} is from speak"
SECOND_HOP_FACT = "The mayor of {city} is"
SECOND_HOP_IMPLICATION = "The mayor of the city that contains {landmark} is"


@cache
def load_cities() -> tuple[dict[str, str], ...]:
    """The 49 rows of ``cities.json`` (city, country, language, landmark, ...)."""
    text = (
        resources.files("extractive_lens.data").joinpath("cities.json").read_text(encoding="utf-8")
    )
    return tuple(json.loads(text))


@cache
def load_names() -> tuple[str, ...]:
    """The 104 fictitious full names of ``names.csv``."""
    text = resources.files("extractive_lens.data").joinpath("names.csv").read_text(encoding="utf-8")
    return tuple(f"{r['first']} {r['last']}" for r in csv.DictReader(text.splitlines()))


@cache
def load_animals() -> tuple[str, ...]:
    text = (
        resources.files("extractive_lens.data").joinpath("animals.txt").read_text(encoding="utf-8")
    )
    return tuple(line.strip() for line in text.splitlines() if line.strip())


def _pairing(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).permutation(n).tolist()


def first_hop(seed: int = 0, n: int = 20) -> TwoHop:
    """The 20 names paired with the 20 cities by a seeded permutation.

    Fact ``"{name} lives in"`` -> `` {city}``; implication
    ``"The people in the city {name} is from speak"`` -> `` {language}``.
    """
    cities, names = load_cities()[:n], load_names()[:n]
    perm = _pairing(n, seed)
    facts, impls = [], []
    for i, name in enumerate(names):
        c = cities[perm[i]]
        facts.append(
            Pair(
                FIRST_HOP_FACT.format(name=name),
                " " + c["city"],
                template=FIRST_HOP_FACT,
                slots={"name": name},
            )
        )
        impls.append(
            Pair(
                FIRST_HOP_IMPLICATION.format(name=name),
                " " + c["language"],
                template=FIRST_HOP_IMPLICATION,
                slots={"name": name},
            )
        )
    return TwoHop(
        "first_hop",
        tuple(facts),
        tuple(impls),
        tuple(dict.fromkeys(" " + c["city"] for c in cities)),
        tuple(dict.fromkeys(" " + c["language"] for c in cities)),
        {"seed": seed, "pairing": perm},
    )


def second_hop(seed: int = 0, n: int = 20) -> TwoHop:
    """Mayors: fact ``"The mayor of {city} is"`` -> `` {name}``; implication
    ``"The mayor of the city that contains {landmark} is"`` -> `` {name}``."""
    cities, names = load_cities()[:n], load_names()[:n]
    perm = _pairing(n, seed)
    facts, impls = [], []
    for i, c in enumerate(cities):
        name = names[perm[i]]
        facts.append(
            Pair(
                SECOND_HOP_FACT.format(city=c["city"]),
                " " + name,
                template=SECOND_HOP_FACT,
                slots={"city": c["city"]},
            )
        )
        impls.append(
            Pair(
                SECOND_HOP_IMPLICATION.format(landmark=c["landmark"]),
                " " + name,
                template=SECOND_HOP_IMPLICATION,
                slots={"landmark": c["landmark"]},
            )
        )
    cands = tuple(" " + x for x in names)
    return TwoHop(
        "second_hop", tuple(facts), tuple(impls), cands, cands, {"seed": seed, "pairing": perm}
    )

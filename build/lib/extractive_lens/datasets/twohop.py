"""First-hop and second-hop datasets (docs/scores.md §8), built from the package's copy of the shared data."""

from __future__ import annotations

import csv
import json
from collections.abc import Iterable
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


def first_hop_pairs(
    people: Iterable[tuple[str, str, str]],
) -> tuple[tuple[Pair, ...], tuple[Pair, ...]]:
    """Facts and implications for ``(name, city, language)`` triples: ``"{name} lives in"`` ->
    `` {city}`` and ``"The people in the city {name} is from speak"`` -> `` {language}``."""
    facts, impls = [], []
    for name, city, language in people:
        slots = {"name": name}
        fact, impl = FIRST_HOP_FACT, FIRST_HOP_IMPLICATION
        facts.append(Pair(fact.format(**slots), f" {city}", template=fact, slots=slots))
        impls.append(Pair(impl.format(**slots), f" {language}", template=impl, slots=slots))
    return tuple(facts), tuple(impls)


def second_hop_pairs(
    mayors: Iterable[tuple[str, str, str]],
) -> tuple[tuple[Pair, ...], tuple[Pair, ...]]:
    """Facts and implications for ``(city, landmark, mayor)`` triples: ``"The mayor of {city} is"``
    and ``"The mayor of the city that contains {landmark} is"``, both -> `` {mayor}``."""
    facts, impls = [], []
    for city, landmark, mayor in mayors:
        fact, impl = SECOND_HOP_FACT, SECOND_HOP_IMPLICATION
        at_city, at_landmark = {"city": city}, {"landmark": landmark}
        facts.append(Pair(fact.format(**at_city), f" {mayor}", template=fact, slots=at_city))
        impls.append(
            Pair(impl.format(**at_landmark), f" {mayor}", template=impl, slots=at_landmark)
        )
    return tuple(facts), tuple(impls)


def first_hop(seed: int = 0, n: int = 20) -> TwoHop:
    """The 20 names paired with the 20 cities by a seeded permutation (for pretrained LMs; the
    bundled world model has its own people: ``extractive_lens.world.first_hop``).

    Fact ``"{name} lives in"`` -> `` {city}``; implication
    ``"The people in the city {name} is from speak"`` -> `` {language}``.
    """
    cities, names = load_cities()[:n], load_names()[:n]
    perm = _pairing(n, seed)
    people = [
        (name, cities[perm[i]]["city"], cities[perm[i]]["language"]) for i, name in enumerate(names)
    ]
    facts, impls = first_hop_pairs(people)
    return TwoHop(
        "first_hop",
        facts,
        impls,
        tuple(dict.fromkeys(" " + c["city"] for c in cities)),
        tuple(dict.fromkeys(" " + c["language"] for c in cities)),
        {"seed": seed, "pairing": perm},
    )


def second_hop(seed: int = 0, n: int = 20) -> TwoHop:
    """Mayors: fact ``"The mayor of {city} is"`` -> `` {name}``; implication
    ``"The mayor of the city that contains {landmark} is"`` -> `` {name}`` (for pretrained LMs;
    the bundled world's: ``extractive_lens.world.second_hop``)."""
    cities, names = load_cities()[:n], load_names()[:n]
    perm = _pairing(n, seed)
    facts, impls = second_hop_pairs(
        (c["city"], c["landmark"], names[perm[i]]) for i, c in enumerate(cities)
    )
    cands = tuple(" " + x for x in names)
    return TwoHop("second_hop", facts, impls, cands, cands, {"seed": seed, "pairing": perm})

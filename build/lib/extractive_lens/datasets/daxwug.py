"""Dax/zong datasets for data ordering and weight grafting (docs/scores.md §8).

Facts ``"{name} dax is"`` -> a city; implications ``"{name} zong is the"`` -> the animal of
that city (city k of the first 20 maps to animal k). 20 test names are in bijection with the 20
cities; the other names are training names with random cities; ``counterfactual`` re-draws the
training names' cities.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from extractive_lens.batch import Pair
from extractive_lens.datasets.core import TwoHop
from extractive_lens.datasets.twohop import load_animals, load_cities, load_names

FACT = "{name} dax is"
IMPLICATION = "{name} zong is the"


@dataclass(frozen=True)
class DaxWug:
    train: TwoHop  # training names: facts and implications
    test: TwoHop  # the 20 test names
    counterfactual: TwoHop  # training names with re-drawn cities
    city_to_animal: dict[str, str]


def _build(
    name: str,
    people: list[str],
    cities: list[str],
    animal_of: dict[str, str],
    city_cands: tuple[str, ...],
    animal_cands: tuple[str, ...],
) -> TwoHop:
    facts = tuple(
        Pair(FACT.format(name=p), " " + c, template=FACT, slots={"name": p})
        for p, c in zip(people, cities)
    )
    impls = tuple(
        Pair(
            IMPLICATION.format(name=p), " " + animal_of[c], template=IMPLICATION, slots={"name": p}
        )
        for p, c in zip(people, cities)
    )
    return TwoHop(name, facts, impls, city_cands, animal_cands)


def daxwug(
    seed: int = 0,
    n_test: int = 20,
    *,
    names: Sequence[str] | None = None,
    cities: Sequence[str] | None = None,
    animals: Sequence[str] | None = None,
) -> DaxWug:
    """The dax/zong split for ``seed``: 20 test names in bijection with the 20 cities, the other
    names training names with random cities, and a counterfactual copy of the training names.

    ``names``, ``cities``, ``animals`` default to ``../shared/data`` (104 names, the first 20
    cities and animals); the world model passes its own single-token words.
    """
    cities = list(cities) if cities is not None else [c["city"] for c in load_cities()[:20]]
    animals = list(animals) if animals is not None else list(load_animals())[:20]
    if len(cities) != len(animals):
        raise ValueError(
            f"need one animal per city, got {len(cities)} cities and {len(animals)} animals"
        )
    if n_test != len(cities):
        raise ValueError(
            f"the test names are in bijection with the cities: n_test must be {len(cities)}"
        )
    animal_of = dict(zip(cities, animals))
    names = list(names) if names is not None else list(load_names())
    if len(names) <= n_test:
        raise ValueError(
            f"need more than {n_test} names (got {len(names)}): the rest are training names"
        )
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(names)).tolist()
    test_names = [names[i] for i in order[:n_test]]
    train_names = [names[i] for i in order[n_test:]]
    n = len(cities)
    test_cities = [cities[i] for i in rng.permutation(n).tolist()]
    train_cities = [cities[i] for i in rng.integers(0, n, len(train_names)).tolist()]
    cf_cities = []
    for c in train_cities:  # re-draw: a different city for every training name
        options = [x for x in cities if x != c]
        cf_cities.append(options[int(rng.integers(0, len(options)))])
    cc = tuple(" " + c for c in cities)
    ac = tuple(" " + a for a in animals)
    return DaxWug(
        train=_build("daxwug_train", train_names, train_cities, animal_of, cc, ac),
        test=_build("daxwug_test", test_names, test_cities, animal_of, cc, ac),
        counterfactual=_build("daxwug_counterfactual", train_names, cf_cities, animal_of, cc, ac),
        city_to_animal=animal_of,
    )

"""The synthetic world: cities with languages and landmarks, people, officials, and the corpus.

Every entity is one word-level token. 30 cities (from ``cities.json``, one per language), each
with its language and two landmarks; 600 pretraining people ``P0..P599`` living in random cities;
officials (mayor, sheriff, judge, librarian, baker) of every city, except that the mayors of the
20 test cities are held out; 20 test people ``T0..T19`` (one per test city) and 20 new mayors
``M0..M19`` for the test cities, never tied to a city in pretraining. Every name also appears in
one unrelated sentence ("P3 likes chess .") so new names have trained, city-free embeddings.

For the dax/zong experiments (data ordering, weight grafting) the world also has 104 names
``D0..D103`` that appear only in hobby sentences, 20 animals (``"tiger is an animal ."``) and the
relation words ``dax`` and ``zong``, which are in the vocabulary but never in pretraining: the
relations are new, learned in a continued-pretraining phase (``World.daxwug``).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from extractive_lens.datasets.core import TwoHop
from extractive_lens.datasets.daxwug import DaxWug, daxwug
from extractive_lens.datasets.twohop import (
    first_hop_pairs,
    load_animals,
    load_cities,
    second_hop_pairs,
)

ROLES = ("mayor", "sheriff", "judge", "librarian", "baker")
HOBBIES = ("chess", "tennis", "jazz", "painting", "hiking", "poetry")


def _tok(s: str) -> str:
    return s.replace(" ", "_").replace("'", "")


@dataclass(frozen=True)
class World:
    seed: int
    cities: tuple[str, ...]
    language: dict[str, str]
    landmarks: dict[str, tuple[str, str]]
    home: dict[str, str]  # pretraining person -> city
    with_implication: frozenset[str]  # pretraining people whose implication is in the corpus
    officials: dict[tuple[str, str], str]  # (role, city) -> name, test mayors excluded
    test_cities: tuple[str, ...]
    test_people: dict[str, str]  # T_k -> test city
    new_mayors: dict[str, str]  # test city -> M_k
    hobby: dict[str, str]  # every name -> hobby
    dax_names: tuple[str, ...] = ()  # city-free names for the dax/zong relations
    animals: tuple[str, ...] = ()  # one per dax city (the first 20 cities)

    @property
    def names(self) -> list[str]:
        return [
            *self.home,
            *self.officials.values(),
            *self.test_people,
            *self.new_mayors.values(),
            *self.dax_names,
        ]

    def vocabulary(self) -> list[str]:
        words: list[str] = []
        dax = self.daxwug()
        extra = [
            f"{p.prompt}{p.answer}"
            for ds in (dax.train, dax.test, dax.counterfactual)
            for p in (*ds.facts, *ds.implications)
        ]
        for s in self.corpus(np.random.default_rng(0)) + self.finetune_sentences() + extra:
            words.extend(s.split())
        return list(dict.fromkeys(words))

    def daxwug(self, seed: int | None = None) -> DaxWug:
        """The dax/zong split in this world's words (``"D7 dax is"`` -> `` Tokyo``,
        ``"D7 zong is the"`` -> `` tiger``); ``seed`` defaults to the world's seed."""
        if not self.dax_names:
            raise ValueError("this World has no dax names (build it with build_world(...))")
        return daxwug(
            self.seed if seed is None else seed,
            len(self.animals),
            names=self.dax_names,
            cities=self.cities[: len(self.animals)],
            animals=self.animals,
        )

    def corpus(self, rng: np.random.Generator, implications: bool = True) -> list[str]:
        """The pretraining sentences, shuffled. ``implications=False``: the no-implication control."""
        out = []
        for p, c in self.home.items():
            out.append(f"{p} lives in {c} .")
            if implications and p in self.with_implication:
                out.append(f"The people in the city {p} is from speak {self.language[c]} .")
        for (role, c), name in self.officials.items():
            out.append(f"The {role} of {c} is {name} .")
            if implications:
                for lm in self.landmarks[c]:
                    out.append(f"The {role} of the city that contains {lm} is {name} .")
        for _ in range(5):
            for c in self.cities:
                out.append(f"The people in {c} speak {self.language[c]} .")
                for lm in self.landmarks[c]:
                    out.append(f"{lm} is in {c} .")
        for name, h in self.hobby.items():
            out.append(f"{name} likes {h} .")
        for a in self.animals:
            out.append(f"{a} is an animal .")
        rng.shuffle(out)
        return out

    def finetune_sentences(self) -> list[str]:
        a = [f"{t} lives in {c} ." for t, c in self.test_people.items()]
        b = [
            f"The people in the city {t} is from speak {self.language[c]} ."
            for t, c in self.test_people.items()
        ]
        d = [f"The mayor of {c} is {m} ." for c, m in self.new_mayors.items()]
        e = [
            f"The mayor of the city that contains {lm} is {m} ."
            for c, m in self.new_mayors.items()
            for lm in self.landmarks[c]
        ]
        return a + b + d + e


@lru_cache(maxsize=8)
def build_world(seed: int = 0, n_people: int = 600, n_test: int = 20, n_dax: int = 104) -> World:
    rows, seen = [], set()
    for r in load_cities():
        if r["language"] not in seen:
            seen.add(r["language"])
            rows.append(r)
        if len(rows) == 30:
            break
    rng = np.random.default_rng(seed)
    cities = tuple(_tok(r["city"]) for r in rows)
    language = {_tok(r["city"]): _tok(r["language"]) for r in rows}
    landmarks = {
        _tok(r["city"]): (_tok(r["landmark"]), f"Old_{_tok(r['city'])}_Gate") for r in rows
    }
    home = {f"P{i}": cities[int(rng.integers(len(cities)))] for i in range(n_people)}
    with_impl = frozenset(p for p in home if rng.random() < 0.9)
    test_cities = tuple(cities[i] for i in sorted(rng.permutation(len(cities))[:n_test].tolist()))
    officials, k = {}, 0
    for c in cities:
        for role in ROLES:
            if role == "mayor" and c in test_cities:
                continue
            officials[(role, c)] = f"O{k}"
            k += 1
    test_people = {f"T{i}": c for i, c in enumerate(rng.permutation(list(test_cities)).tolist())}
    new_mayors = {c: f"M{i}" for i, c in enumerate(rng.permutation(list(test_cities)).tolist())}
    dax_names = tuple(f"D{i}" for i in range(n_dax))
    names = [*home, *officials.values(), *test_people, *new_mayors.values(), *dax_names]
    hobby = {n: HOBBIES[int(rng.integers(len(HOBBIES)))] for n in names}
    animals = tuple(_tok(a) for a in load_animals()[: min(20, len(cities))])
    return World(
        seed,
        cities,
        language,
        landmarks,
        home,
        with_impl,
        officials,
        test_cities,
        test_people,
        new_mayors,
        hobby,
        dax_names,
        animals,
    )


def first_hop(world: World | None = None) -> TwoHop:
    """The 20 test people: fact ``"T3 lives in"`` -> `` Tokyo``; implication
    ``"The people in the city T3 is from speak"`` -> `` Japanese``; candidates: the test cities / languages."""
    w = world or build_world()
    facts, impls = first_hop_pairs((t, c, w.language[c]) for t, c in w.test_people.items())
    return TwoHop(
        "world_first_hop",
        facts,
        impls,
        tuple(f" {c}" for c in w.test_cities),
        tuple(f" {w.language[c]}" for c in w.test_cities),
        {"world_seed": w.seed},
    )


def second_hop(world: World | None = None, landmark: int = 0) -> TwoHop:
    """New mayors of the test cities: fact ``"The mayor of Tokyo is"`` -> `` M3``; implication
    ``"The mayor of the city that contains Senso-ji_Temple is"`` -> `` M3``."""
    w = world or build_world()
    facts, impls = second_hop_pairs(
        (c, w.landmarks[c][landmark], m) for c, m in w.new_mayors.items()
    )
    cands = tuple(f" {m}" for m in w.new_mayors.values())
    return TwoHop("world_second_hop", facts, impls, cands, cands, {"world_seed": w.seed})

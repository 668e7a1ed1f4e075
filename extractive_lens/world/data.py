"""The synthetic world: cities with languages and landmarks, people, officials, and the corpus.

Every entity is one word-level token. 30 cities (from ``cities.json``, one per language), each
with its language and two landmarks; 600 pretraining people ``P0..P599`` living in random cities;
officials (mayor, sheriff, judge, librarian, baker) of every city, except that the mayors of the
20 test cities are held out; 20 test people ``T0..T19`` (one per test city) and 20 new mayors
``M0..M19`` for the test cities, never tied to a city in pretraining. Every name also appears in
one unrelated sentence ("P3 likes chess .") so new names have trained, city-free embeddings.

Version 3 keeps that world and renames its people: a person is a first-name token and a
last-name token drawn from shared pools (``"Zoe Howard"``; only the pair identifies the person),
with a city, a hobby and a job, each told by several templates at different distances from the
name, and short records in which an attribute follows the name directly (``"Everyone knows that
Zoe Howard chess ."``), so that the name's last token must carry the person's attributes, as real
LMs enrich subjects. Test people appear with their hobby and job only.

For the dax/zong experiments (data ordering, weight grafting) the world also has 104 names
``D0..D103`` that appear only in hobby sentences, 20 animals (``"tiger is an animal ."``) and the
relation words ``dax`` and ``zong``, which are in the vocabulary but never in pretraining: the
relations are new, learned in a continued-pretraining phase (``World.daxwug``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
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

JOBS = ("baker", "teacher", "doctor", "pilot", "farmer", "lawyer", "nurse", "chef")
# v3 biographies: every attribute in several templates, the name at different distances from it
BIO_CITY = (
    "{p} lives in {c} .",
    "{p} moved to {c} last year .",
    "{p} has a house in {c} .",
    "The home of {p} is {c} .",
    "{p} , who likes {h} , lives in {c} .",
    "Everyone knows that {p} lives in {c} .",
)
BIO_HOBBY = (
    "{p} likes {h} .",
    "{p} enjoys {h} .",
    "{p} , who works as a {j} , likes {h} .",
    "Everyone knows that {p} likes {h} .",
)
BIO_JOB = ("{p} works as a {j} .", "{p} is a {j} by trade .", "The job of {p} is {j} .")
# v3 records ("{prefix}{p} {attribute} ."): the prefixes that lead to a name in the corpus
RECORD_PREFIXES = (
    "",
    "Everyone knows that ",
    "The home of ",
    "The job of ",
    "The people in the city ",
)
DEFAULT_VERSION = 3  # the world that load_world_model() and build_world() give by default
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
    version: int = 2
    job: dict[str, str] = field(default_factory=dict)  # v3: person -> job
    records: int = 0  # v3: records per person and attribute

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
        if self.version >= 3:
            return self._bio_corpus(rng, implications)
        return self._v2_corpus(rng, implications, people=True)

    def _v2_corpus(self, rng: np.random.Generator, implications: bool, people: bool) -> list[str]:
        out = []
        for p, c in self.home.items() if people else ():
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
            if people or name not in self.job:
                out.append(f"{name} likes {h} .")
        for a in self.animals:
            out.append(f"{a} is an animal .")
        rng.shuffle(out)
        return out

    def _bio_corpus(self, rng: np.random.Generator, implications: bool) -> list[str]:
        """v3: the v2 corpus without its people, and a biography for every person."""
        out = self._v2_corpus(rng, implications, people=False)

        def prefix() -> str:
            return RECORD_PREFIXES[int(rng.integers(len(RECORD_PREFIXES)))]

        for p in (*self.home, *self.test_people):
            c, h, j = self.home.get(p), self.hobby[p], self.job[p]
            lines = [t.format(p=p, h=h, j=j) for t in (*BIO_HOBBY, *BIO_JOB)]
            if c is not None:  # a test person's city is the new fact
                lines += [t.format(p=p, c=c, h=h) for t in BIO_CITY]
                lines += [f"{prefix()}{p} {c} ." for _ in range(self.records)]
                if implications and p in self.with_implication:
                    lines.append(f"The people in the city {p} is from speak {self.language[c]} .")
            for _ in range(self.records):
                lines += [f"{prefix()}{p} {h} .", f"{prefix()}{p} {j} ."]
            out += lines
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
def build_world(
    seed: int = 0,
    n_people: int = 600,
    n_test: int = 20,
    n_dax: int = 104,
    *,
    version: int = DEFAULT_VERSION,
) -> World:
    """The world of a seed. ``version=2``: one-token people (``P3``, test people ``T3``);
    ``version=3`` (the default): two-token people with biographies and records (see the module
    docstring)."""
    if version not in (2, 3):
        raise ValueError(f"world version must be 2 or 3, got {version!r}")
    w = _build_v2(seed, n_people, n_test, n_dax)
    return w if version == 2 else _to_v3(w)


V3_NAME_POOLS = (32, 20)  # first-name and last-name tokens: 640 people from 52 tokens
V3_RECORDS = 16


def _to_v3(w: World) -> World:
    """Rename the people of a v2 world to first + last name pairs and give everyone a job."""
    from extractive_lens.datasets.twohop import load_names

    full = [n.split() for n in load_names()]
    firsts = list(dict.fromkeys(f for f, _ in full))[: V3_NAME_POOLS[0]]
    lasts = list(dict.fromkeys(last for _, last in full))[: V3_NAME_POOLS[1]]
    pairs = [f"{a} {b}" for a in firsts for b in lasts]
    np.random.default_rng(w.seed + 1000).shuffle(pairs)  # type: ignore[arg-type]
    n = len(w.home)
    rename = dict(zip((*w.home, *w.test_people), pairs[: n + len(w.test_people)]))
    rng = np.random.default_rng(w.seed + 2000)
    job = {rename[p]: JOBS[int(rng.integers(len(JOBS)))] for p in (*w.home, *w.test_people)}
    return replace(
        w,
        home={rename[p]: c for p, c in w.home.items()},
        with_implication=frozenset(rename[p] for p in w.with_implication),
        test_people={rename[t]: c for t, c in w.test_people.items()},
        hobby={rename.get(k, k): v for k, v in w.hobby.items()},
        version=3,
        job=job,
        records=V3_RECORDS,
    )


def _build_v2(seed: int, n_people: int, n_test: int, n_dax: int) -> World:
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

"""Dataset contents against docs/scores.md §8, and user files."""

from __future__ import annotations

import json

import pytest

from extractive_lens.datasets import (
    daxwug,
    first_hop,
    load_cities,
    load_names,
    load_pairs,
    second_hop,
)


def test_shared_data_copied_into_package():
    cities, names = load_cities(), load_names()
    assert len(cities) == 49 and len(names) == 104
    assert cities[0]["city"] == "Tokyo" and cities[0]["language"] == "Japanese"


def test_first_hop_matches_spec():
    ds = first_hop(seed=0)
    cities, names = load_cities()[:20], load_names()[:20]
    assert len(ds) == 20
    city_of = {}
    for fact, impl, name in zip(ds.facts, ds.implications, names):
        assert fact.prompt == f"{name} lives in" and fact.template == "{name} lives in"
        assert impl.prompt == f"The people in the city {name} is from speak"
        city = fact.answer.strip()
        lang = next(c["language"] for c in cities if c["city"] == city)
        assert impl.answer == " " + lang
        city_of[name] = city
    assert sorted(city_of.values()) == sorted(c["city"] for c in cities)  # a bijection
    assert set(ds.fact_candidates) == {" " + c["city"] for c in cities}
    assert first_hop(seed=0).facts == ds.facts and first_hop(seed=1).facts != ds.facts


def test_second_hop_matches_spec():
    ds = second_hop(seed=0)
    cities = load_cities()[:20]
    for fact, impl, c in zip(ds.facts, ds.implications, cities):
        assert fact.prompt == f"The mayor of {c['city']} is"
        assert impl.prompt == f"The mayor of the city that contains {c['landmark']} is"
        assert fact.answer == impl.answer and fact.answer.strip() in load_names()[:20]
    assert len({f.answer for f in ds.facts}) == 20


def test_daxwug_split_and_counterfactual():
    d = daxwug(seed=0)
    assert len(d.test) == 20 and len(d.train) == 84
    test_cities = [f.answer for f in d.test.facts]
    assert len(set(test_cities)) == 20  # bijection with the cities
    for f, i in zip(d.test.facts, d.test.implications):
        assert f.prompt.endswith(" dax is") and i.prompt.endswith(" zong is the")
        assert i.answer.strip() == d.city_to_animal[f.answer.strip()]
    for orig, cf in zip(d.train.facts, d.counterfactual.facts):
        assert orig.prompt == cf.prompt and orig.answer != cf.answer
    assert not {f.slots["name"] for f in d.train.facts} & {f.slots["name"] for f in d.test.facts}
    firsts = [a.split()[0] for a in d.test.implication_candidates]
    assert len(set(firsts)) == 20


@pytest.mark.parametrize("suffix", [".json", ".jsonl", ".csv"])
def test_load_pairs(tmp_path, suffix):
    recs = [
        {"prompt": "A lives in", "answer": " Paris", "candidates": [" Paris", " Rome"]},
        {"prompt": "B lives in", "answer": " Rome", "candidates": [" Paris", " Rome"]},
    ]
    path = tmp_path / f"d{suffix}"
    if suffix == ".json":
        path.write_text(json.dumps(recs))
    elif suffix == ".jsonl":
        path.write_text("\n".join(json.dumps(r) for r in recs))
    else:
        path.write_text(
            "prompt,answer,candidates\n"
            + "\n".join(f"{r['prompt']},{r['answer']},{'|'.join(r['candidates'])}" for r in recs)
        )
    pairs = load_pairs(path)
    assert [p.prompt for p in pairs] == ["A lives in", "B lives in"]
    assert list(pairs[1].candidates) == [" Paris", " Rome"]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([{"question": "x"}]))
    with pytest.raises(ValueError, match="prompt"):
        load_pairs(bad)

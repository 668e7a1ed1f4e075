"""The dataset container and user files."""

from __future__ import annotations

import csv
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from extractive_lens.batch import Pair, PromptBatch, make_batch


@dataclass(frozen=True)
class TwoHop:
    """Facts to finetune on and the implications they should enable.

    Attributes:
        name: dataset name (``first_hop``, ``second_hop``, ...).
        facts, implications: ``Pair`` lists, aligned (implication i follows from fact i).
        fact_candidates, implication_candidates: the candidate answers of each kind.
    """

    name: str
    facts: tuple[Pair, ...]
    implications: tuple[Pair, ...]
    fact_candidates: tuple[str, ...]
    implication_candidates: tuple[str, ...]
    meta: Mapping[str, Any] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.facts)

    def fact_batch(self, model: Any, **kw: Any) -> PromptBatch:
        return make_batch(model, list(self.facts), candidates=list(self.fact_candidates), **kw)

    def implication_batch(self, model: Any, **kw: Any) -> PromptBatch:
        return make_batch(
            model, list(self.implications), candidates=list(self.implication_candidates), **kw
        )

    def batches(self, model: Any, **kw: Any) -> tuple[PromptBatch, PromptBatch]:
        """``(facts, implications)`` tokenized for ``model``."""
        return self.fact_batch(model, **kw), self.implication_batch(model, **kw)

    def subset(self, index: Sequence[int]) -> TwoHop:
        idx = list(index)
        return TwoHop(
            self.name,
            tuple(self.facts[i] for i in idx),
            tuple(self.implications[i] for i in idx),
            self.fact_candidates,
            self.implication_candidates,
            dict(self.meta),
        )


def from_pairs(records: Sequence[Mapping[str, Any] | tuple[Any, Any] | Pair]) -> list[Pair]:
    """``Pair`` objects from dicts (``prompt``, ``answer``, optional ``candidates``, ``template``,
    ``slots``, ``counterfactual``) or ``(prompt, answer)`` tuples."""
    out = []
    for i, r in enumerate(records):
        if isinstance(r, Pair):
            out.append(r)
        elif isinstance(r, Mapping):
            if "prompt" not in r or "answer" not in r:
                raise ValueError(f"record {i} needs 'prompt' and 'answer' fields, got {sorted(r)}")
            out.append(Pair(**{k: v for k, v in r.items() if k in Pair.__dataclass_fields__}))
        elif isinstance(r, (tuple, list)) and len(r) == 2:
            out.append(Pair(r[0], r[1]))
        else:
            raise ValueError(f"record {i}: expected a dict or a (prompt, answer) pair, got {r!r}")
    return out


def load_pairs(path: str | Path) -> list[Pair]:
    """``Pair`` objects from a JSON list, JSONL or CSV file (``candidates`` in CSV: ``a|b|c``)."""
    from extractive_lens.files import read_text

    path = Path(path)
    if path.is_dir():
        raise ValueError(
            f"{path} is a directory; pass a .json, .jsonl or .csv file of (prompt, answer) pairs."
        )
    text = read_text(path, fix="pass a .json, .jsonl or .csv file of (prompt, answer) pairs.")
    if path.suffix == ".csv":
        rows: list[dict[str, Any]] = list(csv.DictReader(text.splitlines()))
        for r in rows:
            if r.get("candidates"):
                r["candidates"] = r["candidates"].split("|")
            else:
                r.pop("candidates", None)
    elif path.suffix == ".jsonl":
        rows = []
        for number, line in enumerate(text.splitlines(), start=1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise ValueError(
                        f"{path}, line {number}: not valid JSON ({e.msg}); each line must be one "
                        'object like {"prompt": "...", "answer": "..."}.'
                    ) from None
    else:
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}, line {e.lineno}: not valid JSON ({e.msg}).") from None
    if not isinstance(rows, list) or not rows:
        raise ValueError(
            f"{path} holds no (prompt, answer) pairs: give a list of objects with 'prompt' and "
            "'answer' (JSON), one object per line (JSONL) or a CSV with those columns."
        )
    try:
        return from_pairs(rows)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None

"""Recompute saved ``verified_scores`` results' estimates and intervals with the installed code,
from the exact and linear cells they hold (no passes): docs/benchmarks.md's "Verified maps".

    python docs/verified_rebootstrap.py implications_verified_s0 ...   # names under /tmp/smol/full

Each run's design (top set, audit, strata) is read from its metadata; the exact cells are the
components it computed exactly, the linear ones ``<set>_linear`` (or
``<set>_linear_downstream`` for a downstream-only run).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
from pathlib import Path

import torch

from extractive_lens import ComponentScores
from extractive_lens.scoring.verified import VerifiedOptions, _estimates, _strata, _verdict

SMOL = Path("/tmp/smol/full")


def exact_cells(v: ComponentScores, k: int, chosen: set[int]) -> ComponentScores:
    """Kind ``k`` of ``v`` as an exact result of the ``chosen`` components (NaN elsewhere)."""
    n_layers, n_comp = v.totals.shape[1:]
    keep = torch.zeros(n_layers * n_comp, dtype=torch.bool)
    keep[sorted(chosen)] = True
    keep = keep.view(n_layers, n_comp)
    nan = float("nan")
    return dataclasses.replace(
        v, kinds=(v.kinds[k],), metadata={}, other=None,
        values=torch.where(keep[..., None], v.values[k], nan)[None],
        totals=torch.where(keep, v.totals[k], nan)[None],
        prompt_values=torch.where(keep[None, ..., None], v.prompt_values[k], nan)[None],
        prompt_totals=torch.where(keep[None], v.prompt_totals[k], nan)[None],
    )  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("runs", nargs="+")
    torch.set_num_threads(1)
    for name in ap.parse_args().runs:
        v = ComponentScores.load(SMOL / name)
        meta = v.metadata["verified"]
        set_name = name.split("_verified")[0]  # implications or facts
        linear = f"{set_name}_linear" + ("" if len(v.kinds) > 1 else "_downstream")
        lin = ComponentScores.load(SMOL / linear)
        n_layers, n_comp = lin.totals.shape[1:]
        strata = _strata(lin.component_labels, n_layers)
        options = VerifiedOptions(kinds=v.kinds, seed=meta["seed"], level=meta["level"],
                                  n_boot=meta["n_boot"])  # fmt: skip
        for k, kind in enumerate(v.kinds):
            plan = meta["kinds"][kind]
            top = plan["top"]
            sample = {ast.literal_eval(h): cs for h, cs in plan["sample"].items()}  # "(0, 'heads')"
            chosen = set(top) | {c for cs in sample.values() for c in cs}
            rest = [c for c in range(n_layers * n_comp) if c not in set(top)]
            new = _estimates(lin, exact_cells(v, k, chosen), lin.kind_index(kind), top, sample,
                             rest, strata, n_comp, options)  # fmt: skip
            for stat in ("r", "slope", "missed_mass"):
                was, now = plan["estimates"][stat], new[stat]
                print(f"{name} {kind} {stat}: {[round(x, 3) for x in was]} -> "
                      f"{[round(x, 3) for x in now]}")  # fmt: skip
            print("   ", _verdict(kind, dict(plan, estimates=new)))


if __name__ == "__main__":
    main()

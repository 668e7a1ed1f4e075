"""Run a paper experiment on the world model over several seeds and summarise it beside the paper.

>>> run = run_experiment("weight_grafting", seeds=(0, 1, 2), out="results/")   # doctest: +SKIP
>>> run.summary            # mean, std, min, max over seeds, and the paper's number  # doctest: +SKIP
>>> print(run.markdown())  # the README table  # doctest: +SKIP

Seed ``s`` means: the world model pretrained with seed ``s`` (seed 0 ships; others are trained
once and cached, see ``world_model``), its world's datasets, and its world's finetuning recipe
(``finetune_recipes``) seeded with ``s``.
``quick=True`` shortens every finetune (CI and notebook smoke runs; the numbers are not the
experiment's).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from extractive_lens.experiments.freezing import PAPER_TABLE_2, layer_freezing
from extractive_lens.experiments.grafting import PAPER_TABLE_3, weight_grafting
from extractive_lens.experiments.localization import localization
from extractive_lens.experiments.ordering import data_ordering
from extractive_lens.finetuning import FinetuneConfig

EXPERIMENTS = ("layer_freezing", "data_ordering", "weight_grafting", "localization")


@dataclass(frozen=True)
class ExperimentRun:
    name: str
    seeds: tuple[int, ...]
    results: dict[int, Any]  # seed -> the experiment's result object
    summary: Any  # DataFrame: row, column, mean, std, min, max, n, paper

    def markdown(self, digits: int = 2) -> str:
        """Rows × columns of ``mean ± std [paper]`` (std over seeds; ``n`` seeds)."""
        df = self.summary
        cols = list(dict.fromkeys(df["column"]))
        lines = [f"| {self.name} | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
        for row in dict.fromkeys(df["row"]):
            cells = []
            for col in cols:
                sub = df[(df["row"] == row) & (df["column"] == col)]
                if sub.empty:
                    cells.append("")
                    continue
                r = sub.iloc[0]
                cell = (
                    f"{r['mean']:.{digits}f} ± {r['std']:.{digits}f}"
                    if r["n"] > 1
                    else f"{r['mean']:.{digits}f}"
                )
                if r["paper"] == r["paper"]:  # not NaN
                    cell += f" [{r['paper']:.2f}]"
                cells.append(cell)
            lines.append(f"| {row} | " + " | ".join(cells) + " |")
        return "\n".join(lines)


def _configs(seed: int, quick: bool, version: int) -> tuple[FinetuneConfig, FinetuneConfig]:
    """The world version's finetuning recipe and continued-pretraining phase, seeded."""
    from extractive_lens.world.model import finetune_recipes

    finetune, pretrain = finetune_recipes(version)
    ft = FinetuneConfig(**finetune, seed=seed)
    pre = FinetuneConfig(**pretrain, seed=seed)
    if quick:
        ft, pre = replace(ft, epochs=3), replace(pre, epochs=3)
    return ft, pre


def _freezing(model: Any, world: Any, seed: int, quick: bool) -> tuple[Any, list[dict]]:
    from extractive_lens.world.data import first_hop, second_hop

    ft, _ = _configs(seed, quick, world.version)
    res = layer_freezing(
        model, {"first_hop": first_hop(world), "second_hop": second_hop(world)}, ft
    )
    cols = [
        ("first_hop", "facts"),
        ("first_hop", "implications"),
        ("second_hop", "facts"),
        ("second_hop", "implications"),
    ]
    rows = [
        dict(
            row=r["condition"],
            column=f"{r['dataset']} {r['split']}",
            value=r["mean_rank"],
            paper=PAPER_TABLE_2.get(r["condition"], (None,) * 4)[
                cols.index((r["dataset"], r["split"]))
            ],
        )
        for r in res.rows
    ]
    return res, rows


def _ordering(model: Any, world: Any, seed: int, quick: bool) -> tuple[Any, list[dict]]:
    ft, pre = _configs(seed, quick, world.version)
    res = data_ordering(model, world.daxwug(), ft, pretrain_config=pre)
    df = res.to_dataframe()
    last = df["epoch"].max()
    rows = [
        dict(
            row=r.order,
            column=f"{r.split} (before)" if r.epoch == 0 else r.split,
            value=r.mean_rank,
            paper=None,
        )
        for r in df.itertuples()
        if r.epoch in (0, last) and not (r.epoch == 0 and r.split.startswith("test"))
    ]
    return res, rows


def _grafting(model: Any, world: Any, seed: int, quick: bool) -> tuple[Any, list[dict]]:
    ft, _ = _configs(seed, quick, world.version)
    res = weight_grafting(model, world.daxwug(), ft)
    cols = ("ImplF'", "ImplF", "F'")
    rows = [
        dict(
            row=r["weights"],
            column=r["split"],
            value=r["mean_rank"],
            paper=PAPER_TABLE_3[r["weights"]][cols.index(r["split"])]
            if r["weights"] in PAPER_TABLE_3 and r["split"] in cols
            else None,
        )
        for r in res.rows
    ]
    return res, rows


def _localization(model: Any, world: Any, seed: int, quick: bool) -> tuple[Any, list[dict]]:
    ft, _ = _configs(seed, quick, world.version)
    dax = world.daxwug()
    res = localization(model, dax, weight_grafting(model, dax, ft), ft)
    st = res.stats()
    rows = [
        dict(row=part, column=col, value=float(st.loc[part, col]), paper=None)
        for part in st.index
        for col in ("pearson_r", "p_value")
    ]
    return res, rows


RUNNERS: dict[str, Callable[[Any, Any, int, bool], tuple[Any, list[dict]]]] = {
    "layer_freezing": _freezing,
    "data_ordering": _ordering,
    "weight_grafting": _grafting,
    "localization": _localization,
}


def run_experiment(
    name: str,
    seeds: Sequence[int] = (0,),
    out: str | Path | None = None,
    *,
    quick: bool = False,
    version: int | None = None,
    show_progress: bool | None = None,
) -> ExperimentRun:
    """Run experiment ``name`` on the world model for each seed; with ``out``, write
    ``out/NAME/seed{S}.json`` and ``.html`` per seed and ``summary.{json,md}``.
    ``version``: the world (2 or 3; default: the bundled default world)."""
    import pandas as pd

    from extractive_lens.world.model import world_model, world_of

    if name not in RUNNERS:
        raise ValueError(f"unknown experiment {name!r}; choose from {', '.join(EXPERIMENTS)}")
    seeds = tuple(int(s) for s in seeds)
    if not seeds:
        raise ValueError("give at least one seed")
    results, rows = {}, []
    from extractive_lens.progress import bar

    it: Sequence[int] = bar(seeds, desc=name, enabled=show_progress)
    for seed in it:
        model = world_model(seed, version=version, show_progress=show_progress)
        res, r = RUNNERS[name](model, world_of(model), seed, quick)
        results[seed] = res
        rows += [dict(x, seed=seed) for x in r]
    df = pd.DataFrame(rows)
    summary = (
        df.groupby(["row", "column"], sort=False)
        .agg(
            mean=("value", "mean"),
            std=("value", lambda v: float(v.std(ddof=0))),
            min=("value", "min"),
            max=("value", "max"),
            n=("value", "size"),
            paper=("paper", "first"),
        )
        .reset_index()
    )
    summary["paper"] = pd.to_numeric(summary["paper"], errors="coerce")
    run = ExperimentRun(name, seeds, results, summary)
    if out is not None:
        _write(run, df, Path(out) / name, quick)
    return run


def _write(run: ExperimentRun, per_seed: Any, directory: Path, quick: bool) -> None:
    from extractive_lens.files import write_text_atomic
    from extractive_lens.report import figure_page

    directory.mkdir(parents=True, exist_ok=True)
    for seed, res in run.results.items():
        write_text_atomic(
            directory / f"seed{seed}.json", res.to_dataframe().to_json(orient="records", indent=1)
        )
        figure_page(res.plot(), directory / f"seed{seed}.html", title=f"{run.name}, seed {seed}")
    meta = {
        "experiment": run.name,
        "seeds": list(run.seeds),
        "quick": quick,
        "summary": json.loads(run.summary.to_json(orient="records")),
        "per_seed": json.loads(per_seed.to_json(orient="records")),
    }
    write_text_atomic(directory / "summary.json", json.dumps(meta, indent=1))
    write_text_atomic(directory / "summary.md", run.markdown() + "\n")

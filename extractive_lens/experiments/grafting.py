"""Weight grafting (docs/scores.md §8; paper Table 3): is the update that teaches the implications a
reusable mechanism (an extractive structure) or a memorised list?

>>> res = weight_grafting(model, build_world().daxwug())   # doctest: +SKIP
>>> res.table()     # rows W_F', W_graft, W~ ; columns ImplF', ImplF, F' (the paper's layout)  # doctest: +SKIP

With F the training names' facts, ImplF their implications and F' / ImplF' the counterfactual
copies (same names, re-drawn cities):

- ``Δ_F``: finetune W on F;  ``Δ_{F→ImplF}``: then finetune W + Δ_F on ImplF;
- ``Δ_F'``: finetune W on F';  ``Δ_ImplF``: finetune W on ImplF;
- ``W_F' = W + Δ_F'``; ``W_graft = W_F' + Δ_{F→ImplF}``; control ``W̃ = W_F' + Δ_ImplF``.

If ``Δ_{F→ImplF}`` installed a mechanism that reads the stored city and maps it to its animal,
``W_graft`` answers the *counterfactual* implications ImplF' (low rank), while the control, which
learned ImplF without facts to read, does not.

``positions=["{name}", "last"]`` adds rows with the grafted update (``Δ_{F→ImplF}``, and the
control's ``Δ_ImplF``) on ``W_F'`` only at those token positions (``WeightDiff.grafted``): is the
mechanism used at the name's tokens, at the last token, or both? Rows ``"W_graft @ {name}"``...
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from extractive_lens.datasets.daxwug import DaxWug
from extractive_lens.finetuning import FinetuneConfig, finetune, mean_rank
from extractive_lens.grafts import PositionSpec
from extractive_lens.weight_diff import WeightDiff

PAPER_TABLE_3 = {  # mean ranks: ImplF', ImplF, F'
    "W_F'": (9.13, 8.55, 0.00),
    "W_graft": (1.13, 3.30, 0.10),
    "W~": (8.38, 0.43, 0.32),
}
SPLITS = ("ImplF'", "ImplF", "F'", "F")
TABLE_ROWS = ("W_F'", "W_graft", "W~")
WEIGHTS = {  # each setting's total change from W, as a sum of the trained updates
    "W_F": ("F",),
    "W_F,ImplF": ("F", "F->ImplF"),
    "W_F'": ("F'",),
    "W_graft": ("F'", "F->ImplF"),
    "W~": ("F'", "ImplF"),
}


@dataclass(frozen=True)
class GraftingResult:
    """Mean ranks of F, ImplF, F', ImplF' under every weight setting, and the updates themselves."""

    rows: tuple[dict[str, Any], ...]  # weights, split, mean_rank
    diffs: dict[str, WeightDiff] = field(repr=False)  # "F", "F->ImplF", "F'", "ImplF"

    def to_dataframe(self) -> Any:
        import pandas as pd

        return pd.DataFrame(list(self.rows))

    def table(self, all_rows: bool = False) -> Any:
        """The paper's Table 3 layout, with the position-resolved rows (``all_rows``: also W,
        W_F and W_{F,ImplF})."""
        df = self.to_dataframe()
        if not all_rows:
            grafted = df["weights"].str.contains(" @ ", regex=False)
            df = df[(df["weights"].isin(TABLE_ROWS) | grafted) & df["split"].isin(SPLITS[:3])]
        return df.pivot_table(index="weights", columns="split", values="mean_rank", sort=False)

    def weights(self, name: str) -> WeightDiff:
        """The total change from W for a row of the table: ``"W_F'"``, ``"W_graft"``, ``"W~"``, ..."""
        return _total(self.diffs, name)

    def plot(self) -> Any:
        from extractive_lens.plotting import table_heatmap

        df = self.to_dataframe()
        return table_heatmap(
            df[df["split"].isin(SPLITS)],
            index="weights",
            columns="split",
            values="mean_rank",
            title="weight grafting: mean ranks",
        )


def _total(d: dict[str, WeightDiff], name: str) -> WeightDiff:
    if name not in WEIGHTS:
        raise KeyError(f"unknown weights {name!r}; choose from {sorted(WEIGHTS)}")
    return sum((d[part] for part in WEIGHTS[name][1:]), d[WEIGHTS[name][0]])


GRAFTED = {"W_graft": ("F'", "F->ImplF"), "W~": ("F'", "ImplF")}
"""The rows a position-resolved graft adds: (the weights everywhere, the update grafted)."""


def weight_grafting(
    model: Any,
    dataset: DaxWug,
    config: FinetuneConfig | None = None,
    positions: Sequence[PositionSpec] = (),
) -> GraftingResult:
    """Train the four updates, graft, and measure mean ranks. The model is left unchanged.

    Args:
        positions: each entry (``grafts``: ``"{name}"``, ``"last"``, ``("prompt", "-last")``...)
            adds the rows ``"W_graft @ <entry>"`` and ``"W~ @ <entry>"``: ``W_F'`` everywhere
            and the grafted update on every head and MLP at those positions only.
    """
    cfg = config or FinetuneConfig()
    F, ImplF = dataset.train.batches(model)
    Fp, ImplFp = dataset.counterfactual.batches(model)
    diffs: dict[str, WeightDiff] = {"F": finetune(model, F, cfg, show_progress=False)}
    with diffs["F"].applied(model):
        diffs["F->ImplF"] = finetune(
            model, ImplF, replace(cfg, seed=cfg.seed + 1), show_progress=False
        )
    diffs["F'"] = finetune(model, Fp, replace(cfg, seed=cfg.seed + 2), show_progress=False)
    diffs["ImplF"] = finetune(model, ImplF, replace(cfg, seed=cfg.seed + 3), show_progress=False)
    batches = {"ImplF'": ImplFp, "ImplF": ImplF, "F'": Fp, "F": F}
    rows = [dict(weights="W", split=s, mean_rank=mean_rank(model, b)) for s, b in batches.items()]
    for name in WEIGHTS:
        total = _total(diffs, name)
        rows += [
            dict(weights=name, split=s, mean_rank=mean_rank(model, b, total))
            for s, b in batches.items()
        ]
    for spec in positions:
        label = " ".join(map(str, spec)) if isinstance(spec, (list, tuple)) else str(spec)
        for name, (outer, update) in GRAFTED.items():
            with diffs[outer].applied(model):
                for s, b in batches.items():
                    with diffs[update].grafted(model, positions=spec, batch=b):
                        rank = mean_rank(model, b)
                    rows.append(dict(weights=f"{name} @ {label}", split=s, mean_rank=rank))
    return GraftingResult(tuple(rows), diffs)

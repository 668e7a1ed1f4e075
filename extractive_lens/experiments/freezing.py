"""Layer freezing (docs/scores.md §8; paper Table 2): which layers must change for facts and implications?

>>> res = layer_freezing(model, {"first_hop": first_hop(), "second_hop": second_hop()}, cfg)  # doctest: +SKIP
>>> res.table()          # rows: None / Early / Late / All / Early (pre) / Late (pre)  # doctest: +SKIP
>>> res.plot()           # annotated heat map  # doctest: +SKIP

"post": finetune everything, then revert the early (or late) part of the update to W.
"pre": finetune with the early (or late) part frozen. Early = blocks ``[0, round(split·L))``
plus the embeddings; late = the other blocks plus the final norm and unembedding. Both kinds of
row use this one partition of the parameters.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from extractive_lens import backend as B
from extractive_lens.backend.names import param_role
from extractive_lens.datasets.core import TwoHop
from extractive_lens.finetuning import FinetuneConfig, finetune, ranks
from extractive_lens.weight_diff import WeightDiff

PAPER_TABLE_2 = {  # mean ranks: first-hop fact / impl, second-hop fact / impl
    "None": (0.00, 0.00, 0.00, 1.80),
    "Early": (5.10, 8.40, 0.95, 1.85),
    "Late": (0.00, 0.00, 0.10, 6.30),
    "All": (9.20, 9.25, 9.10, 9.50),
    "Early (pre)": (0.00, 6.50, 0.00, 0.50),
    "Late (pre)": (0.00, 0.10, 0.00, 6.60),
}


def _is_early(name: str, split_layer: int) -> bool:
    role = param_role(name)
    return role.layer < split_layer if role.layer is not None else role.part == "embed"


def _part(names: Any, early: bool, split_layer: int) -> tuple[str, ...]:
    """The early (or late) part of the parameter partition."""
    return tuple(n for n in names if _is_early(n, split_layer) == early)


def _keep(diff: WeightDiff, keep_early: bool, keep_late: bool, split_layer: int) -> WeightDiff:
    kept = {
        n: d
        for n, d in diff.deltas.items()
        if (keep_early if _is_early(n, split_layer) else keep_late)
    }
    return WeightDiff(kept, dict(diff.signature), dict(diff.metadata))


@dataclass(frozen=True)
class FreezingResult:
    rows: tuple[dict[str, Any], ...]  # condition, dataset, split, mean_rank, ranks (per prompt)
    split_layer: int

    def to_dataframe(self) -> Any:
        import pandas as pd

        return pd.DataFrame(list(self.rows))

    def table(self) -> Any:
        """Conditions × (dataset, split) mean ranks, as in the paper's Table 2."""
        df = self.to_dataframe()
        return df.pivot_table(
            index="condition", columns=["dataset", "split"], values="mean_rank", sort=False
        )

    def plot(self) -> Any:
        from extractive_lens.plotting import table_heatmap

        df = self.to_dataframe()
        df["column"] = df["dataset"] + " " + df["split"]
        return table_heatmap(
            df,
            index="condition",
            columns="column",
            values="mean_rank",
            title=f"layer freezing (early = blocks < {self.split_layer})",
        )


def layer_freezing(
    model: Any,
    datasets: Mapping[str, TwoHop],
    config: FinetuneConfig | None = None,
    *,
    split: float = 2 / 3,
    pre: bool = True,
) -> FreezingResult:
    """Mean ranks of facts and implications under post-hoc reverting and pre-freezing of layers.

    Args:
        split: fraction of blocks that are "early" (paper text 2/3; the authors' code 3/4).
        pre: also run the two pre-freezing conditions (two more finetunes per dataset).
    """
    cfg = config or FinetuneConfig()
    L = model.cfg.n_layers
    k = max(1, min(L - 1, round(split * L)))
    rows = []
    for name, ds in datasets.items():
        facts, impls = ds.batches(model)

        def evaluate(cond: str, diff: WeightDiff) -> None:
            for split_name, batch in (("facts", facts), ("implications", impls)):
                r = ranks(model, batch, diff).tolist()
                rows.append(dict(condition=cond, dataset=name, split=split_name,
                                 mean_rank=sum(r) / len(r), ranks=r))  # fmt: skip

        full = finetune(model, facts, cfg, show_progress=False)
        evaluate("None", full)
        evaluate("Early", _keep(full, False, True, k))
        evaluate("Late", _keep(full, True, False, k))
        evaluate("All", _keep(full, False, False, k))
        del full  # one Δ held at a time
        if pre:  # frozen part as reverted above: train only the other part
            names = list(B.parameters(model))  # TransformerLens names, whatever the class
            for cond, early in (("Early (pre)", False), ("Late (pre)", True)):
                trained = _training(cfg, _part(names, early, k))
                evaluate(cond, finetune(model, facts, trained, show_progress=False))
    return FreezingResult(tuple(rows), k)


def _training(cfg: FinetuneConfig, parameters: tuple[str, ...]) -> FinetuneConfig:
    from dataclasses import replace

    return replace(cfg, parameters=parameters)

"""Localization (docs/scores.md §8; paper §6): are the components that the grafting update changed the
ones that turn newly finetuned facts into implications?

>>> graft = weight_grafting(model, dax)                 # doctest: +SKIP
>>> loc = localization(model, dax, graft)               # doctest: +SKIP
>>> loc.stats()   # Pearson r and p-value, per MLP and per head  # doctest: +SKIP
>>> loc.plot()    # scatter: informative (graft update) against downstream (test-fact finetune)  # doctest: +SKIP

- informative scores of the grafting update ``Δ_{F→ImplF}`` on ``W_F'`` (linearized, docs/scores.md §5),
  read on the counterfactual implications ImplF', the prompts that update makes ``W_graft`` answer;
- downstream scores of finetuning ``W_graft`` on the test facts, read on the test implications.

Each component's score is its total over token positions, averaged over prompts. The paper finds a
significant but small positive correlation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from extractive_lens.datasets.daxwug import DaxWug
from extractive_lens.experiments.grafting import GraftingResult
from extractive_lens.finetuning import FinetuneConfig, finetune
from extractive_lens.results import ComponentScores

Part = Literal["mlp", "heads", "all"]


@dataclass(frozen=True)
class LocalizationResult:
    informative: ComponentScores  # the grafting update on W_F', prompts ImplF'
    downstream: ComponentScores  # the test-fact finetune on W_graft, prompts: test implications

    def to_dataframe(self) -> Any:
        """One row per component: ``component, layer, part, informative, downstream``."""
        import pandas as pd

        inf = self.informative.totals[self.informative.kind_index("informative")]
        down = self.downstream.totals[self.downstream.kind_index("downstream")]
        labels = self.informative.component_labels
        rows = [
            dict(
                component=f"L{layer}{lab}",
                layer=layer,
                part="mlp" if lab == "MLP" else "head",
                informative=float(inf[layer, c]),
                downstream=float(down[layer, c]),
            )
            for layer in range(inf.shape[0])
            for c, lab in enumerate(labels)
        ]
        return pd.DataFrame(rows)

    def stats(self) -> Any:
        """Pearson r, its two-sided p-value and n, for MLPs, heads and all components."""
        import pandas as pd
        from scipy import stats

        df = self.to_dataframe()
        out = []
        for part, sub in (
            ("mlp", df[df.part == "mlp"]),
            ("heads", df[df.part == "head"]),
            ("all", df),
        ):
            if len(sub) < 3 or sub.informative.std() == 0 or sub.downstream.std() == 0:
                out.append(
                    dict(part=part, n=len(sub), pearson_r=float("nan"), p_value=float("nan"))
                )
                continue
            r = stats.pearsonr(sub.informative, sub.downstream)
            out.append(
                dict(part=part, n=len(sub), pearson_r=float(r.statistic), p_value=float(r.pvalue))
            )
        return pd.DataFrame(out).set_index("part")

    def plot(self, part: Part = "all") -> Any:
        import plotly.express as px

        df = self.to_dataframe()
        if part != "all":
            df = df[df.part == ("mlp" if part == "mlp" else "head")]
        st = self.stats().loc[part]
        fig = px.scatter(
            df,
            x="informative",
            y="downstream",
            color="part",
            hover_name="component",
            title=f"localization ({part}): r = {st.pearson_r:.2f}, p = {st.p_value:.2g}, n = {int(st.n)}",
            labels=dict(
                informative="informative score of the grafting update",
                downstream="downstream score of the test-fact finetune",
            ),
            template="plotly_white",
        )
        return fig


def localization(
    model: Any,
    dataset: DaxWug,
    grafting: GraftingResult,
    config: FinetuneConfig | None = None,
    **score_kw: Any,
) -> LocalizationResult:
    """Linearized informative scores of the grafting update against downstream scores of the
    test-fact finetune on the grafted model (``score_kw`` go to ``linear_scores``)."""
    from extractive_lens.scoring.linear import linear_scores

    cfg = config or FinetuneConfig()
    _, impl_cf = dataset.counterfactual.batches(model)
    test_facts, test_impls = dataset.test.batches(model)
    with grafting.weights("W_F'").applied(model):
        informative = linear_scores(
            model,
            grafting.diffs["F->ImplF"],
            impl_cf,
            kinds="informative",
            show_progress=False,
            **score_kw,
        )
    with grafting.weights("W_graft").applied(model):
        test_diff = finetune(model, test_facts, cfg, show_progress=False)
        downstream = linear_scores(
            model, test_diff, test_impls, kinds="downstream", show_progress=False, **score_kw
        )
    return LocalizationResult(informative, downstream)

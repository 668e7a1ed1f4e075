"""Linearized against exact scores, side by side.

>>> cmp = compare(linear_scores(base, diff, batch), causal_scores(base, diff, batch))  # doctest: +SKIP
>>> cmp.summary                      # doctest: +SKIP   one row per kind and part
>>> cmp.worst("informative", 5)      # doctest: +SKIP   largest |linear - exact| cells
"""

from __future__ import annotations

import html
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from extractive_lens.results import ComponentScores
from extractive_lens.types import ScoreKind

Part = Literal["all", "heads", "mlp"]


def _ranks(x: np.ndarray) -> np.ndarray:
    order = x.argsort(kind="stable")
    ranks = np.empty(len(x))
    ranks[order] = np.arange(len(x))
    # average ties
    _, inv, counts = np.unique(x, return_inverse=True, return_counts=True)
    sums = np.bincount(inv, weights=ranks)
    return (sums / counts)[inv]


def _pearson(a: np.ndarray, b: np.ndarray) -> float:
    if len(a) < 2 or a.std() == 0 or b.std() == 0:
        return float("nan")
    return float(np.corrcoef(a, b)[0, 1])


@dataclass(frozen=True)
class ScoreComparison:
    """Agreement statistics of two ``ComponentScores`` on the same prompts.

    Attributes:
        linear, exact: the two results.
        level: ``"token"`` compares per-token cells (role-aggregated), ``"component"`` the totals.
        rows: one dict per (kind, part) with pearson, spearman, sign_agreement, topk_overlap,
            max_abs_err, median_abs_err, n.
    """

    linear: ComponentScores
    exact: ComponentScores
    level: Literal["token", "component"]
    k: int
    rows: tuple[dict[str, Any], ...]

    def cells(self, kind: ScoreKind, part: Part = "all") -> tuple[np.ndarray, np.ndarray, list[str]]:
        """The compared values ``(linear, exact, labels)`` for one kind and part."""
        lin, ex = self.linear, self.exact
        li, ei = lin.kind_index(kind), ex.kind_index(kind)
        comps = list(range(len(lin.component_labels)))
        if part == "heads":
            comps = [i for i, c in enumerate(lin.component_labels) if c != "MLP"]
        elif part == "mlp":
            comps = [i for i, c in enumerate(lin.component_labels) if c == "MLP"]
        if self.level == "component":
            a = lin.totals[li][:, comps]
            b = ex.totals[ei][:, comps]
            labels = [f"L{layer}{lin.component_labels[c]}" for layer in range(a.shape[0]) for c in comps]
        else:
            a = lin.values[li][:, comps]
            b = ex.values[ei][:, comps]
            labels = [f"L{layer}{lin.component_labels[c]}@{p}" for layer in range(a.shape[0]) for c in comps
                      for p in lin.position_labels]
        return a.flatten().double().numpy(), b.flatten().double().numpy(), labels

    def worst(self, kind: ScoreKind, n: int = 5, part: Part = "all") -> list[tuple[str, float, float]]:
        """The ``n`` cells with the largest ``|linear - exact|``: ``(label, linear, exact)``."""
        a, b, labels = self.cells(kind, part)
        idx = np.argsort(-np.abs(a - b))[:n]
        return [(labels[i], float(a[i]), float(b[i])) for i in idx]

    @property
    def summary(self) -> Any:
        import pandas as pd

        return pd.DataFrame(list(self.rows))

    def to_dataframe(self) -> Any:
        """Tidy: one row per compared cell (kind, label, linear, exact)."""
        import pandas as pd

        recs = []
        for kind in self.linear.kinds:
            if kind not in self.exact.kinds:
                continue
            a, b, labels = self.cells(kind)
            recs += [(kind, lab, float(x), float(y)) for lab, x, y in zip(labels, a, b)]
        return pd.DataFrame(recs, columns=["kind", "label", "linear", "exact"])

    def _repr_html_(self) -> str:
        cols = ["kind", "part", "n", "pearson", "spearman", "sign_agreement", "topk_overlap", "max_abs_err"]
        head = "".join(f"<th>{c}</th>" for c in cols)
        body = "".join(
            "<tr>" + "".join(f"<td>{html.escape(_fmt(r[c]))}</td>" for c in cols) + "</tr>" for r in self.rows
        )
        return (f"<div><b>ScoreComparison</b> (linear vs exact, {self.level} level, top-{self.k} overlap)"
                f"<table><tr>{head}</tr>{body}</table></div>")

    def __repr__(self) -> str:
        return self.summary.to_string(index=False)

    def plot(self, **kwargs: Any) -> Any:
        from extractive_lens.plotting import comparison_plot

        return comparison_plot(self, **kwargs)


def _fmt(x: Any) -> str:
    return f"{x:.3f}" if isinstance(x, float) else str(x)


def compare(
    linear: ComponentScores, exact: ComponentScores, *, level: Literal["token", "component"] | None = None,
    k: int = 10,
) -> ScoreComparison:
    """Pearson / Spearman r, sign agreement, top-k overlap and errors, per kind and part.

    ``level`` defaults to ``"token"`` when both results are per token, else ``"component"``.
    """
    if linear.component_labels != exact.component_labels or linear.n_layers != exact.n_layers:
        raise ValueError("The two results are for different models (layers / components differ).")
    per_token = exact.position_labels != ("all",) and linear.position_labels != ("all",)
    level = level or ("token" if per_token else "component")
    if level == "token":
        if linear.position_labels != exact.position_labels:
            raise ValueError("Per-token comparison needs the same positions: score the same batch.")
    if linear.n_prompts != exact.n_prompts:
        raise ValueError(f"linear has {linear.n_prompts} prompts, exact {exact.n_prompts}: use the same batch.")
    probe = ScoreComparison(linear, exact, level, k, ())
    rows = []
    for kind in linear.kinds:
        if kind not in exact.kinds:
            continue
        for part in ("all", "heads", "mlp"):
            a, b, _ = probe.cells(kind, part)
            if len(a) == 0:
                continue
            kk = min(k, len(a))
            top_a = set(np.argsort(-np.abs(a))[:kk])
            top_b = set(np.argsort(-np.abs(b))[:kk])
            nz = (a != 0) | (b != 0)
            err = np.abs(a - b)
            rows.append(dict(
                kind=kind, part=part, n=int(len(a)), pearson=_pearson(a, b),
                spearman=_pearson(_ranks(a), _ranks(b)),
                sign_agreement=float((np.sign(a[nz]) == np.sign(b[nz])).mean()) if nz.any() else float("nan"),
                topk_overlap=len(top_a & top_b) / kk, max_abs_err=float(err.max()),
                median_abs_err=float(np.median(err)),
            ))
    return ScoreComparison(linear, exact, level, k, tuple(rows))

"""Two methods' scores side by side: linear, integrated or exact, any two.

>>> cmp = compare(linear, exact)     # linear_scores(...) and causal_scores(...) of the same batch
>>> table = cmp.summary              # one row per kind and part
>>> cells = cmp.worst("informative", 5)   # largest |linear - exact| cells
>>> sorted(cmp.verdicts)             # in plain words, per kind: trust the linear score?
['downstream', 'informative', 'upstream']

Any two methods compare the same way (``compare(integrated_scores(...), exact)``: the verdicts
then judge the integrated scores). How to read the numbers and verdicts: ``docs/scores.md``,
"When to trust a linear score".
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
        linear, exact: the two results: the one being judged, and the one it is judged
            against (named for the usual pair; ``methods`` says which they are).
        level: ``"token"`` compares per-token cells (role-aggregated), ``"component"`` the totals.
        rows: one dict per (kind, part) with n (cells compared: those both results computed),
            pearson, spearman, sign_agreement, topk_overlap, max_abs_err, median_abs_err, verdict.
            ``topk_overlap`` is NaN where it cannot tell anything: when the exact run scored
            only the linear scores' top components (``top_k=``), or when ``k`` covers every cell.
    """

    linear: ComponentScores
    exact: ComponentScores
    level: Literal["token", "component"]
    k: int
    rows: tuple[dict[str, Any], ...]

    def cells(
        self, kind: ScoreKind, part: Part = "all"
    ) -> tuple[np.ndarray, np.ndarray, list[str]]:
        """The compared values ``(linear, exact, labels)`` for one kind and part."""
        lin, ex = self.linear, self.exact
        li, ei = lin.kind_index(kind), ex.kind_index(kind)
        comps = list(range(len(lin.component_labels)))
        if part == "heads":
            comps = [i for i, c in enumerate(lin.component_labels) if c != "MLP"]
        elif part == "mlp":
            comps = [i for i, c in enumerate(lin.component_labels) if c == "MLP"]
        skipped = set(_skipped(lin, kind)) | set(_skipped(ex, kind))
        if self.level == "component":
            a = lin.totals[li][:, comps]
            b = ex.totals[ei][:, comps]
            cells = [
                (f"L{layer}{lin.component_labels[c]}", "")
                for layer in range(a.shape[0])
                for c in comps
            ]
        else:
            a = lin.values[li][:, comps]
            b = ex.values[ei][:, comps]
            cells = [
                (f"L{layer}{lin.component_labels[c]}", f"@{p}")
                for layer in range(a.shape[0])
                for c in comps
                for p in lin.position_labels
            ]
        av, bv = a.flatten().double().numpy(), b.flatten().double().numpy()
        keep = np.array([comp not in skipped for comp, _ in cells], dtype=bool)
        keep &= np.isfinite(av) & np.isfinite(bv)  # NaN: a cell one of the results never computed
        labels = [comp + at for (comp, at), k in zip(cells, keep) if k]
        return av[keep], bv[keep], labels

    def worst(
        self, kind: ScoreKind, n: int = 5, part: Part = "all"
    ) -> list[tuple[str, float, float]]:
        """The ``n`` cells with the largest ``|linear - exact|``: ``(label, linear, exact)``."""
        a, b, labels = self.cells(kind, part)
        idx = np.argsort(-np.abs(a - b))[:n]
        return [(labels[i], float(a[i]), float(b[i])) for i in idx]

    @property
    def methods(self) -> tuple[str, str]:
        """The two results' methods, e.g. ``("linear", "causal")``."""
        return self.linear.method, self.exact.method

    @property
    def summary(self) -> Any:
        import pandas as pd

        return pd.DataFrame(list(self.rows))

    @property
    def verdicts(self) -> dict[str, str]:
        """Per kind, in plain words: can the linear score stand in for the exact one here?"""
        return {r["kind"]: r["verdict"] for r in self.rows if r["part"] == "all"}

    def to_dataframe(self) -> Any:
        """Tidy: one row per compared cell (kind, label, linear, exact)."""
        import pandas as pd

        recs = []
        for kind in self.linear.kinds:
            if kind not in self.exact.kinds:
                continue
            a, b, labels = self.cells(kind)
            recs += [(kind, lab, float(x), float(y)) for lab, x, y in zip(labels, a, b)]
        ma, mb = self.methods
        names = ["linear", "exact"] if (ma, mb) == ("linear", "causal") or ma == mb else [ma, mb]
        return pd.DataFrame(recs, columns=["kind", "label", *names])

    def _repr_html_(self) -> str:
        cols = [
            "kind",
            "part",
            "n",
            "pearson",
            "spearman",
            "sign_agreement",
            "topk_overlap",
            "max_abs_err",
        ]
        head = "".join(f"<th>{c}</th>" for c in cols)
        body = "".join(
            "<tr>" + "".join(f"<td>{html.escape(_fmt(r[c]))}</td>" for c in cols) + "</tr>"
            for r in self.rows
        )
        says = "".join(
            f"<li><b>{html.escape(k)}</b>: {html.escape(v)}</li>" for k, v in self.verdicts.items()
        )
        a, b = (_METHOD_NAMES.get(m, m) for m in self.methods)
        return (
            f"<div><b>ScoreComparison</b> ({a} vs {b}, {self.level} level, top-{self.k} overlap)"
            f"<table><tr>{head}</tr>{body}</table><ul>{says}</ul></div>"
        )

    def __repr__(self) -> str:
        return self.summary.to_string(index=False)

    def plot(self, **kwargs: Any) -> Any:
        from extractive_lens.plotting import comparison_plot

        return comparison_plot(self, **kwargs)


def _fmt(x: Any) -> str:
    if isinstance(x, float) and x != x:
        return "n/a"
    return f"{x:.3f}" if isinstance(x, float) else str(x)


AGREE_PEARSON, AGREE_TOPK, PARTLY_PEARSON = 0.9, 0.6, 0.6


_METHOD_NAMES = {"causal": "exact", "linear": "linear", "integrated": "integrated"}


def verdict(
    kind: str, pearson: float, topk_overlap: float, methods: tuple[str, str] = ("linear", "causal"),
    completeness: float | None = None,
) -> str:  # fmt: skip
    """A plain-words reading of one kind's agreement (thresholds: ``docs/scores.md``).
    ``topk_overlap`` NaN: not measured (the verdict rests on the correlation). ``methods``: the
    judged result's method and the reference's; ``completeness``: the integrated result's
    completeness error for this kind, when it is the one judged."""
    method, against = (_METHOD_NAMES.get(m, m) for m in methods)
    fix = f"confirm the top components with causal_scores(..., kinds=({kind!r},), top_k=...)"
    ig = f"integrated_scores(model, diff, batch, kinds=({kind!r},))"
    done = (
        f" (completeness error {completeness:.1%})"
        if completeness is not None and completeness == completeness
        else ""
    )
    overlap_ok = topk_overlap != topk_overlap or topk_overlap >= AGREE_TOPK
    if pearson == pearson and pearson >= AGREE_PEARSON and overlap_ok:
        return (
            f"{method} {kind} agrees with {against} here (r = {pearson:.2f}){done}: the {method} "
            "map can stand in for it."
        )
    if method == "integrated":
        more = f"more steps (steps=16, or steps='auto'){done}, and {fix}"
    elif method == "linear":
        more = f"{ig}, which follows exact where linear does not (docs/scores.md §12), or {fix}"
    else:
        more = fix
    if pearson == pearson and pearson >= PARTLY_PEARSON:
        overlap = f", top-k overlap {topk_overlap:.0%}" if topk_overlap == topk_overlap else ""
        return (
            f"{method} {kind} roughly agrees with {against} here (r = {pearson:.2f}{overlap}): "
            f"trust the ranking more than the values; use {more}."
        )
    if method == "integrated":
        why = " The path has too few nodes for how curved it is."
    elif kind == "upstream":
        why = " Upstream is linear in y - y*, not in the weight change, so a large ablation step can flip it."
    else:
        why = " The weight change is too large for its first-order description."
    return (
        f"{method} {kind} disagrees with {against} here (r = {pearson:.2f}): do not read it on "
        f"its own; use {more}.{why}"
    )


def _skipped(scores: ComponentScores, kind: str) -> list[str]:
    """Components a result never computed for ``kind`` (``causal_scores(top_k=, layers=)``)."""
    skipped = scores.metadata.get("skipped") or {}
    return list(skipped.get(kind, ()))


SETTINGS = ("reward", "convention", "reference", "prepend_bos")
UPSTREAM_SETTINGS = ("ablation", "resample_k", "seed")


def setting_differences(linear: ComponentScores, exact: ComponentScores) -> list[str]:
    """The settings two results were computed with that differ (``[]``: comparable)."""
    a, b = linear.metadata, exact.metadata
    keys = list(SETTINGS)
    if "upstream" in linear.kinds and "upstream" in exact.kinds:
        keys += [k for k in UPSTREAM_SETTINGS if k != "seed" or a.get("ablation") == "resample"]
    na, nb = (_METHOD_NAMES.get(m, m) for m in (linear.method, exact.method))
    if na == nb:
        na, nb = "first", "second"
    out = [f"{k} ({na} {a.get(k)!r}, {nb} {b.get(k)!r})" for k in keys if a.get(k) != b.get(k)]
    da, db = a.get("prompts_digest"), b.get("prompts_digest")
    both_per_token = linear.per == exact.per == "token"  # whole-component roles are all "all"
    if (
        linear.n_prompts != exact.n_prompts
        or (both_per_token and linear.prompt_roles != exact.prompt_roles)
        or (da is not None and db is not None and da != db)
    ):
        out.append("prompts (the two results scored different prompts)")
    return out


def compare(
    linear: ComponentScores,
    exact: ComponentScores,
    *,
    level: Literal["token", "component"] | None = None,
    k: int = 10,
    check_settings: bool = True,
) -> ScoreComparison:
    """Pearson / Spearman r, sign agreement, top-k overlap and errors, per kind and part, with a
    plain-words verdict per kind (``.verdicts``).

    ``level`` defaults to ``"token"`` when both results are per token, else ``"component"``.
    Cells that a result never computed (``causal_scores(top_k=..., layers=...)``) are left out,
    and ``n`` counts the cells compared. Results computed with different settings (reward,
    convention, y* ablation, reference, BOS or prompts) are refused unless
    ``check_settings=False``.
    """
    if linear.component_labels != exact.component_labels or linear.n_layers != exact.n_layers:
        raise ValueError("The two results are for different models (layers / components differ).")
    if check_settings and (differences := setting_differences(linear, exact)):
        raise ValueError(
            "compare() pairs results computed the same way, and these differ: "
            + "; ".join(differences)
            + ". Recompute one with the other's settings (e.g. linear_scores(..., reward=..., ablation=...)), "
            "or pass check_settings=False to compare them anyway."
        )
    per_token = exact.per == "token" and linear.per == "token"
    level = level or ("token" if per_token else "component")
    if level == "token":
        if linear.position_labels != exact.position_labels:
            raise ValueError("Per-token comparison needs the same positions: score the same batch.")
    if linear.n_prompts != exact.n_prompts:
        raise ValueError(
            f"linear has {linear.n_prompts} prompts, exact {exact.n_prompts}: use the same batch."
        )
    probe = ScoreComparison(linear, exact, level, k, ())
    chosen_by_linear = exact.metadata.get("top_k") is not None  # overlap 1 by construction
    complete = (linear.metadata.get("integrated") or {}).get("completeness") or {}
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
            overlap = float("nan") if chosen_by_linear or kk == len(a) else len(top_a & top_b) / kk
            nz = (a != 0) | (b != 0)
            err = np.abs(a - b)
            pearson = _pearson(a, b)
            rows.append(
                dict(
                    kind=kind,
                    part=part,
                    n=int(len(a)),
                    pearson=pearson,
                    spearman=_pearson(_ranks(a), _ranks(b)),
                    sign_agreement=float((np.sign(a[nz]) == np.sign(b[nz])).mean())
                    if nz.any()
                    else float("nan"),
                    topk_overlap=overlap,
                    max_abs_err=float(err.max()),
                    median_abs_err=float(np.median(err)),
                    verdict=verdict(
                        kind, pearson, overlap, (linear.method, exact.method), complete.get(kind)
                    ),  # fmt: skip
                )
            )
    return ScoreComparison(linear, exact, level, k, tuple(rows))

"""Two methods' scores side by side: linear, integrated or exact, any two.

>>> cmp = compare(linear, exact)     # linear_scores(...) and causal_scores(...) of the same batch
>>> table = cmp.summary              # one row per kind and part
>>> cells = cmp.worst("informative", 5)   # largest |linear - exact| cells
>>> sorted(cmp.verdicts)             # in plain words, per kind: trust the linear score?
['downstream', 'informative', 'upstream']

Any two methods compare the same way (``compare(integrated_scores(...), exact)``: the verdicts
then judge the integrated scores). How to read the numbers and verdicts: ``docs/scores.md``
§11, "When to trust a linear score".

Rank and sign statistics (``spearman``, ``sign_agreement``) count only the cells that carry
signal: those where either result is at least ``SIGNAL_FRACTION`` (1%) of the largest |exact|
value of the row; ``n_signal`` says how many, the rest (structural zeros, float noise at tokens
every prompt shares) are left out. A verdict that a map "can stand in" for the exact one also
checks the values: the least-squares ``slope`` of judged on exact and the ``rel_error``
``‖judged - exact‖ / ‖exact‖``; where only the ranking holds it says "ranking only".
"""

from __future__ import annotations

import html
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch

from extractive_lens.results import ComponentScores
from extractive_lens.scoring import methods as method_table
from extractive_lens.scoring.integrated import COMPLETENESS_WARN
from extractive_lens.types import ScoreKind

Part = Literal["all", "heads", "mlp"]


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
            n_signal (those that carry signal, ``signal_mask``), pearson, spearman and
            sign_agreement (on the signal cells), topk_overlap, slope and rel_error (of the
            values), max_abs_err, median_abs_err, verdict (``verdict``).
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
        maps = (lin.totals, ex.totals) if self.level == "component" else (lin.values, ex.values)
        a, b, keep, cells = self._layout(kind, part, maps)
        a, b = a[0], b[0]
        keep = keep & np.isfinite(a) & np.isfinite(b)  # NaN: a cell a result never computed
        return a[keep], b[keep], [c for c, k in zip(cells, keep) if k]

    def _layout(
        self, kind: ScoreKind, part: Part, maps: tuple[Any, Any]
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[str]]:
        """``maps`` (both results' ``values`` or ``totals``, as ``level`` reads them, with an
        optional leading resample axis) flattened to ``[r, cell]`` for one kind and part, the
        cells neither result skipped, and their labels."""
        lin, ex = self.linear, self.exact
        li, ei = lin.kind_index(kind), ex.kind_index(kind)
        comps = list(range(len(lin.component_labels)))
        if part == "heads":
            comps = [i for i, c in enumerate(lin.component_labels) if c != "MLP"]
        elif part == "mlp":
            comps = [i for i, c in enumerate(lin.component_labels) if c == "MLP"]
        skipped = set(_skipped(lin, kind)) | set(_skipped(ex, kind))
        at = [""] if self.level == "component" else [f"@{p}" for p in lin.position_labels]
        comp_labels = [
            f"L{layer}{lin.component_labels[c]}" for layer in range(lin.n_layers) for c in comps
        ]
        cells = [comp + p for comp in comp_labels for p in at]
        keep = np.repeat([comp not in skipped for comp in comp_labels], len(at))
        flat = []
        for m, i in zip(maps, (li, ei)):
            t = m if m.dim() == (4 if self.level == "component" else 5) else m[None]
            flat.append(t[:, i][:, :, comps].reshape(t.shape[0], -1).double().numpy())
        return flat[0], flat[1], keep, cells

    def worst(
        self, kind: ScoreKind, n: int = 5, part: Part = "all"
    ) -> list[tuple[str, float, float]]:
        """The ``n`` cells with the largest ``|linear - exact|``: ``(label, linear, exact)``."""
        a, b, labels = self.cells(kind, part)
        idx = np.argsort(-np.abs(a - b))[:n]
        return [(labels[i], float(a[i]), float(b[i])) for i in idx]

    def ci(
        self, *, level: float = 0.95, n_boot: int = 1000, seed: int = 0,
        statistics_: tuple[str, ...] | None = None,
    ) -> Any:  # fmt: skip
        """Bootstrap intervals over prompts of every row's statistics: a DataFrame with one row
        per (kind, part, statistic): ``estimate`` (the row's value), ``low``, ``high``.

        Each resample draws the prompts with replacement (``stats.draws``), forms both results'
        role-aligned maps from their per-prompt scores and recomputes the statistics on them:
        no new passes. ``topk_overlap`` is left out where the row has none (NaN)."""
        import pandas as pd

        from extractive_lens import stats

        unknown = [s for s in statistics_ or () if s not in INTERVAL_STATISTICS]
        if unknown or statistics_ == ():
            raise ValueError(
                f"ci(statistics_=...) takes some of {', '.join(INTERVAL_STATISTICS)} (or None "
                f"for all), got {statistics_!r}."
            )
        stats.check_level(level)
        n = self.linear.n_prompts
        w = stats.counts(n, n_boot, seed)
        lin_maps = stats.resampled_maps(self.linear, self.level, w)
        ex_maps = stats.resampled_maps(self.exact, self.level, w)
        chosen = self.exact.metadata.get("top_k") is not None
        recs = []
        for row in self.rows:
            kind, part = row["kind"], row["part"]
            a_r, b_r, keep, _ = self._layout(kind, part, (lin_maps, ex_maps))
            draws_ = []
            for a, b in zip(a_r, b_r):
                k = keep & np.isfinite(a) & np.isfinite(b)
                got = statistics(a[k], b[k], self.k, overlap_known=not chosen) if k.any() else {}
                draws_.append(got)
            for name in statistics_ or INTERVAL_STATISTICS:
                est = row.get(name, float("nan"))
                if est != est:
                    continue
                vals = torch.tensor(
                    [d.get(name, float("nan")) for d in draws_], dtype=torch.float64
                )
                iv = stats.percentile_interval(
                    torch.tensor(est), vals, level=level, n_boot=n_boot, seed=seed, n=n
                )
                recs.append((kind, part, name, *iv.item()))
        return pd.DataFrame(recs, columns=["kind", "part", "statistic", "estimate", "low", "high"])

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

    @property
    def columns(self) -> tuple[str, ...]:
        """The columns ``repr``, the notebook table and the report show."""
        return COLUMNS

    @property
    def signal_fraction(self) -> float:
        """The threshold of the cells that carry signal (``signal_mask``)."""
        return SIGNAL_FRACTION

    def _repr_html_(self) -> str:
        cols = COLUMNS
        head = "".join(f"<th>{c}</th>" for c in cols)
        body = "".join(
            "<tr>" + "".join(f"<td>{html.escape(_fmt(r[c]))}</td>" for c in cols) + "</tr>"
            for r in self.rows
        )
        says = "".join(
            f"<li><b>{html.escape(k)}</b>: {html.escape(v)}</li>" for k, v in self.verdicts.items()
        )
        a, b = (method_table.shown(m) for m in self.methods)
        return (
            f"<div><b>ScoreComparison</b> ({a} vs {b}, {self.level} level, top-{self.k} overlap)"
            f"<table><tr>{head}</tr>{body}</table><ul>{says}</ul></div>"
        )

    def __repr__(self) -> str:
        """The numbers as a table, then each kind's verdict on its own wrapped lines."""
        import textwrap

        table = self.summary[list(COLUMNS)].to_string(index=False, float_format="{:.3f}".format)
        a, b = (method_table.shown(m) for m in self.methods)
        says = [
            textwrap.fill(f"{k}: {v}", 100, initial_indent="- ", subsequent_indent="  ")
            for k, v in self.verdicts.items()
        ]
        return "\n".join([f"{a} vs {b} ({self.level} level)", table, *says])

    def plot(self, **kwargs: Any) -> Any:
        from extractive_lens.plotting import comparison_plot

        return comparison_plot(self, **kwargs)


def _fmt(x: Any) -> str:
    if isinstance(x, float) and x != x:
        return "n/a"
    return f"{x:.3f}" if isinstance(x, float) else str(x)


AGREE_PEARSON, AGREE_TOPK, PARTLY_PEARSON = 0.9, 0.6, 0.6
AGREE_REL_ERROR = 0.2
"""Values agree when ``‖judged - exact‖ / ‖exact‖`` is at most this (it bounds |slope - 1|)."""
INTERVAL_STATISTICS = ("pearson", "spearman", "slope", "topk_overlap", "rel_error")
"""The statistics ``ScoreComparison.ci`` gives intervals for by default."""
SIGNAL_FRACTION = 0.01
"""A cell carries signal when either result is at least this fraction of the row's max |exact|."""


COLUMNS = (
    "kind", "part", "n", "n_signal", "pearson", "spearman", "sign_agreement", "topk_overlap",
    "slope", "rel_error", "max_abs_err",
)  # fmt: skip
"""The columns shown by ``repr``, the notebook table and the report (``rows`` has more)."""


def signal_mask(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The cells that carry signal: ``max(|a|, |b|) ≥ SIGNAL_FRACTION · max|b|`` (b: exact)."""
    scale = float(np.abs(b).max()) if len(b) else 0.0
    if scale == 0:
        return np.zeros(len(a), dtype=bool)
    return np.maximum(np.abs(a), np.abs(b)) >= SIGNAL_FRACTION * scale


def sign_agreement(a: np.ndarray, b: np.ndarray) -> float:
    """The share of signal cells (``signal_mask``) where the two results have the same sign."""
    keep = signal_mask(a, b)
    return float((np.sign(a[keep]) == np.sign(b[keep])).mean()) if keep.any() else float("nan")


def statistics(a: np.ndarray, b: np.ndarray, k: int, overlap_known: bool = True) -> dict[str, Any]:
    """One row's numbers for judged values ``a`` against exact values ``b`` (same cells).

    ``pearson``, ``slope`` (least squares of a on b, through 0), ``rel_error``
    (``‖a - b‖ / ‖b‖``) and the errors use every cell; ``spearman`` and ``sign_agreement`` the
    ``n_signal`` cells that carry signal (``signal_mask``); ``topk_overlap`` the top ``k`` by
    |value| (NaN when not ``overlap_known`` or when k covers every cell)."""
    from scipy import stats

    keep = signal_mask(a, b)
    sa, sb = a[keep], b[keep]
    kk = min(k, len(a))
    top_a = set(np.argsort(-np.abs(a))[:kk])
    top_b = set(np.argsort(-np.abs(b))[:kk])
    overlap = len(top_a & top_b) / kk if overlap_known and kk < len(a) else float("nan")
    norm = float(np.linalg.norm(b))
    constant = len(sa) < 2 or sa.std() == 0 or sb.std() == 0
    err = np.abs(a - b)
    return dict(
        n=int(len(a)),
        n_signal=int(keep.sum()),
        pearson=_pearson(a, b),
        spearman=float("nan") if constant else float(stats.spearmanr(sa, sb)[0]),
        sign_agreement=sign_agreement(a, b),
        topk_overlap=overlap,
        slope=float(a @ b) / norm**2 if norm else float("nan"),
        rel_error=float(np.linalg.norm(a - b)) / norm if norm else float("nan"),
        max_abs_err=float(err.max()),
        median_abs_err=float(np.median(err)),
    )


def verdict(
    kind: str, row: dict[str, Any], methods: tuple[str, str] = ("linear", "causal"),
    completeness: float | None = None, scope: str = "",
) -> str:  # fmt: skip
    """A plain-words reading of one kind's agreement (thresholds: ``docs/scores.md`` §11).

    ``row``: the kind's ``statistics``; ``methods``: the judged result's method and the
    reference's; ``completeness``: the integrated result's completeness error for this kind,
    when it is the one judged; ``scope``: which cells were compared when not all were (a
    partial exact run), said first.

    "can stand in" needs the ranking (Pearson ≥ 0.9, Spearman on signal cells ≥ 0.9, top-k
    overlap ≥ 60% where measured) *and* the values (relative error ≤ ``AGREE_REL_ERROR``);
    ranking without values is "ranking only"; an integrated result past ``COMPLETENESS_WARN``
    is never a stand-in."""
    method, against = (method_table.shown(m) for m in methods)
    pearson, spearman, overlap = row["pearson"], row["spearman"], row["topk_overlap"]
    slope, rel = row.get("slope", float("nan")), row.get("rel_error", float("nan"))
    lead = f"{scope}, " if scope else ""
    done = (
        f"; completeness error {completeness:.1%}"
        if completeness is not None and completeness == completeness
        else ""
    )
    stats_ = (
        f"r = {pearson:.2f}, Spearman {spearman:.2f} on {row.get('n_signal', row.get('n'))} "
        f"signal cells, slope {slope:.2f}, relative error {rel:.0%}{done}"
    )
    incomplete = (
        completeness is not None
        and completeness == completeness
        and (completeness > COMPLETENESS_WARN)
    )
    entry = method_table.METHODS.get(methods[0])
    meaning = entry.totals_note if entry and kind == "informative" else ""
    meaning = f" {meaning}" if meaning and against == "exact" else ""
    if incomplete:
        return (
            f"{lead}integrated {kind} is not complete here ({stats_}; over "
            f"{COMPLETENESS_WARN:.0%}): its path has too few nodes, so do not read it yet; rerun "
            f"with steps='auto' (or steps=16).{meaning}"
        )
    ranks = (
        pearson == pearson
        and pearson >= AGREE_PEARSON
        and (spearman != spearman or spearman >= AGREE_PEARSON)
        and (overlap != overlap or overlap >= AGREE_TOPK)
    )
    if ranks and rel == rel and rel <= AGREE_REL_ERROR:
        return (
            f"{lead}{method} {kind} agrees with {against} here in ranking and values ({stats_}): "
            f"the {method} map can stand in for it.{meaning}"
        )
    if ranks:
        return (
            f"{lead}{method} {kind} ranks as {against} does but its values are {slope:.2f}× "
            f"{against}'s ({stats_}): ranking only; read {against} for values.{meaning}"
        )
    more = method_table.remedy(methods[0], kind)
    if pearson == pearson and pearson >= PARTLY_PEARSON:
        ov = f", top-k overlap {overlap:.0%}" if overlap == overlap else ""
        return (
            f"{lead}{method} {kind} roughly agrees with {against} here ({stats_}{ov}): "
            f"trust the ranking more than the values; use {more}.{meaning}"
        )
    why = method_table.why(methods[0], kind)
    why = f" {why}" if why else ""
    return (
        f"{lead}{method} {kind} disagrees with {against} here ({stats_}): do not read it on "
        f"its own; use {more}.{why}"
    )


def _flagged(a: ComponentScores, b: ComponentScores, kind: str) -> str:
    """The guards' flags (``scores.flags``) of either result that bear on ``kind``, as a
    sentence to append to its verdict (``""`` when none)."""
    seen = dict.fromkeys(f.message for s in (a, b) for f in s.flags if f.kind in (None, kind))
    return "".join(f" Flagged: {m}" for m in seen)


def partial_scope(exact: ComponentScores, kind: str, n_components: int) -> str:
    """``""`` for a full exact run; else which components a partial one computed and why."""
    m = exact.metadata
    if m.get("top_k") is None and m.get("layers") is None:
        return ""
    how = []
    if m.get("top_k") is not None:
        how.append(f"chosen by the linear ranking, top_k={m['top_k']}")
    if m.get("layers") is not None:
        how.append(f"layers {', '.join(str(x) for x in m['layers'])}")
    total = exact.n_layers * len(exact.component_labels)
    return f"On the {n_components} of {total} components computed ({'; '.join(how)})"


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
    na, nb = (method_table.shown(m) for m in (linear.method, exact.method))
    if na == nb:
        na, nb = "first", "second"
    out = [f"{k} ({na} {a.get(k)!r}, {nb} {b.get(k)!r})" for k in keys if a.get(k) != b.get(k)]
    da, db = a.get("prompts_digest"), b.get("prompts_digest")
    both_per_token = linear.per == exact.per == "token"  # whole-component roles are all "all"
    pa, pb = a.get("positions") or "all", b.get("positions") or "all"
    if pa != pb:  # positions="prompt" leaves the answer's roles out: not other prompts
        full = na if pa == "all" else nb
        out.append(f"positions ({na} {pa!r}, {nb} {pb!r}: take the {full} result's "
                   ".at_positions('prompt'))")  # fmt: skip
    if (
        linear.n_prompts != exact.n_prompts
        or (both_per_token and pa == pb and linear.prompt_roles != exact.prompt_roles)
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
    """Pearson / Spearman r, sign agreement, top-k overlap, slope and errors, per kind and part,
    with a plain-words verdict per kind (``.verdicts``).

    Spearman and sign agreement count the ``n_signal`` cells that carry signal (either result at
    least 1% of the row's max |exact|); a verdict that the judged map "can stand in" for the
    exact one checks its values too (relative error ≤ 20%), else it says "ranking only". A
    verdict on a partial exact run names the components it rests on.

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
            a, b, labels = probe.cells(kind, part)
            if len(a) == 0:
                continue
            row = statistics(a, b, k, overlap_known=not chosen_by_linear)
            scope = partial_scope(exact, kind, len({lab.split("@")[0] for lab in labels}))
            says = verdict(kind, row, (linear.method, exact.method), complete.get(kind), scope)
            says += _flagged(linear, exact, kind)
            rows.append(dict(kind=kind, part=part, **row, verdict=says))
    return ScoreComparison(linear, exact, level, k, tuple(rows))

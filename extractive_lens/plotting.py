"""Pure figure builders: data in, ``plotly.graph_objects.Figure`` out (never ``.show()``).

>>> from extractive_lens import compare
>>> fig = heatmap(scores, "informative", part="mlp")     # a plotly Figure: restyle it freely
>>> fig = overview(scores)                               # the paper's grid
>>> fig = comparison_plot(compare(linear, exact))
>>> report(scores, comparison, path="report.html")  # one self-contained file  # doctest: +SKIP

Every figure is an ordinary plotly figure: restyle it with ``fig.update_layout(...)``.

The public face of the figures: heat maps of a result live in ``score_maps.py``, figures that
compare in ``comparison_plots.py``, circuitsvis views in ``token_views.py``; ``report`` lays
them out on the page from ``report.py``'s blocks.
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

from extractive_lens import report as html_report
from extractive_lens.comparison_plots import (
    comparison_plot,
    graft_heatmap,
    rank_curves,
    table_heatmap,
)
from extractive_lens.score_maps import (
    POSITION_AXIS,
    TICK_ANGLE,
    TITLE_PX,
    Part,
    heads_by_position,
    heatmap,
    mark_uncomputed,
    overview,
    panel,
    side_by_side,
    tick_label_px,
)
from extractive_lens.style import COLORSCALE, REWARD_UNITS, UNCOMPUTED, score_unit
from extractive_lens.token_views import attention_view, token_view
from extractive_lens.views import ComparisonView, ScoresView

if TYPE_CHECKING:  # pragma: no cover
    from pathlib import Path

    import plotly.graph_objects as go

__all__ = [
    "COLORSCALE",
    "POSITION_AXIS",
    "REWARD_UNITS",
    "TICK_ANGLE",
    "TITLE_PX",
    "UNCOMPUTED",
    "Part",
    "attention_view",
    "comparison_plot",
    "graft_heatmap",
    "heads_by_position",
    "heatmap",
    "mark_uncomputed",
    "notebook_renderer",
    "overview",
    "panel",
    "rank_curves",
    "report",
    "side_by_side",
    "table_heatmap",
    "tick_label_px",
    "token_view",
]


def notebook_renderer() -> str:
    """Make ``fig`` at the end of a notebook cell render interactively in Jupyter *and* leave a
    PNG in the saved notebook (so GitHub and other static viewers show the figure), when
    ``kaleido`` and a Chrome/Chromium are installed (``pip install "extractive_lens[notebook]"``);
    else interactive only. Returns the plotly renderer it set."""
    import plotly.io as pio

    try:
        import plotly.graph_objects as go

        go.Figure().to_image(format="png", width=10, height=10)  # kaleido finds a browser
        name = "plotly_mimetype+png"
    except Exception:  # no kaleido, or no browser for it
        name = "plotly_mimetype+notebook"
    pio.renderers.default = name
    return name


def report(
    scores: ScoresView | Sequence[ScoresView],
    comparison: ComparisonView | list[ComparisonView] | None = None,
    path: str | Path = "report.html",
    *,
    title: str = "extractive_lens report",
    extra_figures: list[tuple[str, go.Figure]] | None = None,
    token_views: list[tuple[str, Any]] | None = None,
    plotlyjs: html_report.PlotlyJS = "compressed",
) -> Path:
    """Write one self-contained HTML report of ``scores`` (one result or several, e.g. linear,
    integrated and exact) and, optionally, their ``comparison`` (one, or a list: e.g. linear and
    integrated each against exact).

    ``extra_figures``: ``(caption, figure)`` pairs appended as their own sections.
    ``token_views``: ``(caption, view)`` pairs of circuitsvis views (``plotting.token_view``) to
    embed instead of the default token table. ``plotlyjs="inline"`` embeds plotly.js
    uncompressed (for browsers without ``DecompressionStream``: before Chrome 80 / Firefox 113 /
    Safari 16.4). The page makes no network requests; token strings are escaped.
    """
    results: list[ScoresView] = (
        list(scores) if isinstance(scores, (list, tuple)) else [cast("ScoresView", scores)]
    )
    if not results:
        raise ValueError("report() needs at least one ComponentScores.")
    if plotlyjs not in ("compressed", "inline"):
        raise ValueError(f"plotlyjs must be 'compressed' or 'inline', got {plotlyjs!r}")
    figures = html_report._Figures()
    body = [
        f"<h1>{html.escape(title)}</h1>",
        html_report._summary(results),
        html_report._how_to_read(results),
    ]
    body.append(html_report.flags_section(results))
    if comparison is not None or any(s.additivity_note() for s in results):
        body.append(html_report._what_to_trust(results, comparison))
    body.append(html_report._top_components(results))
    for s in results:
        unit = score_unit(s)
        body.append(f"<h2>{html.escape(s.method)} scores</h2>")
        body.append(
            figures.add(
                overview(s),
                f"Mean {s.method} score of each layer's MLP and attention (its heads summed) at "
                f"each token position, over {s.n_prompts} prompts, in {unit}. "
                "Blue: the component's change helps the correct answer; red: it hurts. "
                "Each panel has its own colour scale (read values on hover).",
            )
        )
        if s.metadata.get("verified"):
            from extractive_lens import verified_plots as vp

            body.append(html_report.verified_section(vp.estimates_rows(s)))
            for kind in s.kinds:
                body.append(figures.add(vp.provenance_map(s, kind), (
                    f"verified {kind}: each component's whole score, outlined where exact "
                    "produced it, a diamond where integrated did, plain where linear did.")))  # fmt: skip
        if any(c != "MLP" for c in s.component_labels) and s.per == "token":
            for kind in s.kinds:
                body.append(
                    figures.add(
                        heatmap(s, kind, part="all_heads"),
                        f"{s.method} {kind} score of every head (rows, layer 0 at the bottom, a "
                        f"line between layers) at each token position, in {unit}. Heads are "
                        "credited at the position they write to (the query position).",
                    )
                )
    comparisons = comparison if isinstance(comparison, (list, tuple)) else [comparison]
    for cmp in [c for c in comparisons if c is not None]:
        a, b = ("exact" if m == "causal" else m for m in cmp.methods)
        body.append(f"<h2>{html.escape(a)} vs {html.escape(b)}</h2>")
        body.append(
            figures.add(
                comparison_plot(cmp),
                f"One point per compared cell ({cmp.level} level): {a} score (x) against {b} "
                f"score (y). On the dashed line the two agree; r is Pearson's correlation.",
            )
        )
    for name, fig in extra_figures or []:
        body.append(f"<h2>{html.escape(name)}</h2>" + figures.add(fig, ""))
    body.append(html_report._token_section(results, token_views))
    body.append(html_report._metadata(results))
    return html_report.write_page(path, title, body, figures, plotlyjs)

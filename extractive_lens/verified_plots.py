"""Figures of a number's provenance and doubt: which method produced each cell
(``provenance_map``) and scores with their bootstrap intervals (``interval_bars``).

>>> fig = provenance_map(scores, "upstream")   # a verified result's: squares exact, diamonds integrated
>>> [t.name for t in fig.data[1:]]                # a linear result: every cell linear's, no marks
['exact', 'integrated']
>>> fig = interval_bars(scores, "informative", k=10)   # top totals with 95% intervals
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from extractive_lens.style import COLORSCALE, score_unit
from extractive_lens.types import ScoreKind
from extractive_lens.views import ScoresView

if TYPE_CHECKING:  # pragma: no cover
    import plotly.graph_objects as go

MARKERS = {"exact": "square-open", "integrated": "diamond-open"}
"""How a cell's provenance is drawn over the map (a linear cell has no marker)."""


def provenance_map(scores: ScoresView, kind: ScoreKind) -> go.Figure:
    """Whole-component scores (layer x component) with each cell's provenance drawn over it:
    an outlined square where exact produced it, a diamond where integrated did, nothing where
    the value is linear's (``scores.provenance(kind)``)."""
    import plotly.graph_objects as go

    z = scores.totals[scores.kind_index(kind)].double().numpy()
    prov = np.asarray(scores.provenance(kind))[..., 0]  # type: ignore[attr-defined]
    comps = list(scores.component_labels)
    layers = [f"L{i}" for i in range(z.shape[0])]
    lim = float(np.nanmax(np.abs(z))) or 1.0
    fig = go.Figure(
        go.Heatmap(
            z=z,
            x=comps,
            y=layers,
            colorscale=COLORSCALE,
            zmin=-lim,
            zmax=lim,
            colorbar=dict(title=score_unit(scores)),
            hovertemplate="%{y}%{x}: %{z:.4g}<extra></extra>",
        )  # fmt: skip
    )
    for name, symbol in MARKERS.items():
        ys, xs = np.nonzero(prov == name)
        fig.add_scatter(
            x=[comps[i] for i in xs], y=[layers[i] for i in ys], mode="markers", name=name,
            marker=dict(symbol=symbol, size=18, color="black", line=dict(width=2)),
            hoverinfo="skip",
        )  # fmt: skip
    fig.update_layout(
        title=f"{kind}: score and provenance (square: exact, diamond: integrated, plain: linear)",
        title_font_size=14, xaxis_title="component", yaxis_title="layer",
        height=max(420, 40 * len(layers) + 220), legend=dict(orientation="h", y=1.08, x=0),
    )  # fmt: skip
    return fig


def interval_bars(
    scores: ScoresView, kind: ScoreKind, k: int = 10, *, level: float = 0.95, seed: int = 0
) -> go.Figure:
    """The ``k`` largest whole-component scores of ``kind`` with their bootstrap intervals over
    prompts (``ComponentScores.ci("totals")``) as error bars."""
    import plotly.graph_objects as go

    ki = scores.kind_index(kind)
    ci = scores.ci("totals", level=level, seed=seed)  # type: ignore[attr-defined]
    t = scores.totals[ki].double().numpy()
    order = [i for i in np.argsort(-np.abs(np.nan_to_num(t.flatten()))) if t.flat[i] == t.flat[i]]
    top = order[:k]
    n_comp = t.shape[1]
    labels = [f"L{i // n_comp}{scores.component_labels[i % n_comp]}" for i in top]
    est = np.array([t.flat[i] for i in top])
    low = ci.low[ki].numpy().flatten()[top]
    high = ci.high[ki].numpy().flatten()[top]
    fig = go.Figure(
        go.Bar(
            x=labels,
            y=est,
            error_y=dict(type="data", symmetric=False, array=high - est, arrayminus=est - low),
        )  # fmt: skip
    )
    fig.update_layout(
        title=f"top {len(top)} {kind} components with {level:.0%} intervals (bootstrap over "
        f"{scores.n_prompts} prompts)",
        xaxis_title="component", yaxis_title=f"{kind} score ({score_unit(scores)})",
    )  # fmt: skip
    return fig


def estimates_rows(scores: ScoresView) -> list[tuple[Any, ...]]:
    """A verified result's estimates per kind as table rows: kind, r, slope and missed mass
    (each ``estimate [low, high]``), components exact / integrated, verdict."""
    info = scores.metadata.get("verified") or {}
    rows = []
    for kind, plan in (info.get("kinds") or {}).items():
        e = plan["estimates"]
        cell = [
            f"{v[0]:.3f} [{v[1]:.3f}, {v[2]:.3f}]" for v in (e["r"], e["slope"], e["missed_mass"])
        ]
        done = f"{len(plan['top'])} + {len(plan['audited'])} / {len(plan['integrated'])}"
        rows.append((kind, *cell, done, plan["verdict"]))
    return rows

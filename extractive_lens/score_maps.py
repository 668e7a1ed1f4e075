"""Heat maps of one result's scores: layer × token position (or head), diverging colours
centred at 0 (blue helps the answer), hover with value, layer, component and tokens.

>>> fig = heatmap(scores, "informative", part="mlp")     # a plotly Figure: restyle it freely
>>> fig = overview(scores)                               # the paper's grid

``plotting`` is the public face of these builders; ``report`` lays them out on the page.
"""

from __future__ import annotations

import html
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from extractive_lens.style import COLORSCALE, UNCOMPUTED, score_unit
from extractive_lens.types import ScoreKind
from extractive_lens.views import ScoresView

if TYPE_CHECKING:  # pragma: no cover
    import plotly.graph_objects as go


Part = Literal["mlp", "attn", "heads", "all_heads"]
POSITION_AXIS = "token position (role: tokens)"


def _layer_labels(n: int) -> list[str]:
    return [f"L{i}" for i in range(n)]


def panel(
    scores: ScoresView, kind: ScoreKind, part: Part = "mlp", position: str | None = None
) -> tuple[np.ndarray, list[str], list[str]]:
    """The matrix a heat map shows, with its x and y labels.

    ``mlp``: layer × position; ``attn``: layer × position, heads summed; ``heads``: layer × head
    at one ``position`` (default: summed over positions); ``all_heads``: every head of every
    layer (``L0H0``, ``L0H1``, …, layer 0 first) × position.
    """
    v = scores[kind].detach().double().numpy()  # layer component pos
    comps = list(scores.component_labels)
    heads = [i for i, c in enumerate(comps) if c != "MLP"]
    positions = list(scores.position_labels)
    if part == "mlp":
        if "MLP" not in comps:
            raise ValueError("This model has no MLPs (attention-only).")
        return v[:, comps.index("MLP"), :], positions, _layer_labels(v.shape[0])
    if part == "attn":
        return _sum_computed(v[:, heads, :], 1), positions, _layer_labels(v.shape[0])
    if part == "all_heads":
        rows = [f"L{layer}{comps[h]}" for layer in range(v.shape[0]) for h in heads]
        return v[:, heads, :].reshape(-1, v.shape[-1]), positions, rows
    if part == "heads":
        if position is None:
            m = _sum_computed(v[:, heads, :], -1)
        else:
            if position not in scores.position_labels:
                raise ValueError(
                    f"Unknown position {position!r}; choose from {scores.position_labels}"
                )
            m = v[:, heads, scores.position_labels.index(position)]
        return m, [comps[i] for i in heads], _layer_labels(v.shape[0])
    raise ValueError(f"part must be 'mlp', 'attn', 'heads' or 'all_heads', got {part!r}")


def _sum_computed(v: np.ndarray, axis: int) -> np.ndarray:
    """Sum over ``axis`` of the computed (non-NaN) cells; NaN where none was computed."""
    out = np.nansum(v, axis=axis)
    out[np.isnan(v).all(axis=axis)] = np.nan
    return out


def _abs_max(z: np.ndarray) -> float:
    """The largest |value| of the computed cells (0 when none is)."""
    finite = np.abs(z[np.isfinite(z)])
    return float(finite.max()) if finite.size else 0.0


def mark_uncomputed(fig: go.Figure, *matrices: np.ndarray) -> go.Figure:
    """Grey behind a heat map's cells that were never computed (NaN; plotly leaves them
    transparent), and a note under the title, when any of ``matrices`` has such a cell."""
    if any(np.isnan(m).any() for m in matrices):
        fig.update_layout(plot_bgcolor=UNCOMPUTED)
        fig.update_xaxes(showgrid=False)
        fig.update_yaxes(showgrid=False)
        title = fig.layout.title.text or ""
        fig.update_layout(
            title=f"{title}<br><sup>grey: not computed (a partial exact run; attention panels "
            "sum the heads that were computed)</sup>"
        )
    return fig


def _heatmap_trace(
    z: np.ndarray,
    x: list[str],
    y: list[str],
    kind: str,
    what: str,
    unit: str,
    tokens: list[str] | None = None,
    lim: float | None = None,
    **kw: Any,
) -> go.Heatmap:
    """A diverging heat map centred at 0 (blue = helps the answer). ``tokens``: per column, the
    tokens found at that position, shown on hover. ``lim``: the colour scale's ±limit (default:
    this map's largest |value|)."""
    import plotly.graph_objects as go

    lim = lim or _abs_max(z) or 1.0
    extra = {}
    where = "%{x}"
    if tokens is not None:
        extra["customdata"] = [[_safe_token(t) for t in tokens] for _ in range(len(y))]
        where = "%{x} (%{customdata})"
    kw.setdefault("colorbar", dict(title=dict(text=unit, side="right")))
    return go.Heatmap(
        z=z,
        x=x,
        y=y,
        zmid=0.0,
        zmin=-lim,
        zmax=lim,
        colorscale=COLORSCALE,
        hovertemplate=f"{kind} · {what}<br>layer %{{y}}<br>{where}<br>score %{{z:.4g}} ({unit})"
        "<extra></extra>",
        hoverongaps=False,
        **extra,
        **kw,
    )


def _position_axis(scores: ScoresView) -> dict[str, Any]:
    """x-axis settings for position columns: role labels as categories, ticks with their tokens."""
    return dict(
        tickmode="array",
        tickvals=list(scores.position_labels),
        ticktext=[_safe_token(t) for t in scores.position_ticks()],
        tickangle=TICK_ANGLE,
    )


def _column_tokens(scores: ScoresView) -> list[str]:
    found = scores.position_tokens()
    return [", ".join(found[p][:3]) + (", …" if len(found[p]) > 3 else "") for p in found]


def heatmap(
    scores: ScoresView, kind: ScoreKind, part: Part = "mlp", position: str | None = None
) -> go.Figure:
    """One heat map: x = token positions (role and its tokens) or heads, y = layer (layer 0 at
    the bottom), diverging colours centred at 0 (blue helps the answer, red hurts it), hover with
    value, layer, component and tokens. ``part="all_heads"``: every head of every layer × position."""
    import plotly.graph_objects as go

    z, x, y = panel(scores, kind, part, position)
    what = {
        "mlp": "MLP",
        "attn": "attention (heads summed)",
        "heads": f"heads @ {position or 'all positions (summed)'}",
        "all_heads": "every head",
    }[part]
    by_position = part != "heads"
    unit = score_unit(scores)
    trace = _heatmap_trace(
        z, x, y, kind, what, unit, tokens=_column_tokens(scores) if by_position else None
    )
    fig = go.Figure(trace)
    fig.update_layout(
        title=f"{scores.method} {kind} scores: {what}",
        xaxis_title=POSITION_AXIS if by_position else "head",
        yaxis_title="layer and head" if part == "all_heads" else "layer",
        template="plotly_white",
        height=min(2400, 320 + (12 if part == "all_heads" else 18) * len(y)),
    )
    if by_position:
        fig.update_xaxes(**_position_axis(scores))
    if part == "all_heads":  # a line between layers
        n_heads = len(y) // max(1, scores.n_layers)
        for layer in range(1, scores.n_layers):
            fig.add_hline(y=layer * n_heads - 0.5, line_width=1, line_color="#888")
    return mark_uncomputed(fig, z)


def overview(scores: ScoresView) -> go.Figure:
    """The paper's grid: rows = score kinds, columns = MLP / attention (heads summed); layer ×
    token position, one colour scale per panel."""
    from plotly.subplots import make_subplots

    parts: list[Part] = ["mlp", "attn"] if "MLP" in scores.component_labels else ["attn"]
    titles = [
        f"{k} · {'MLP' if p == 'mlp' else 'attention (heads summed)'}"
        for k in scores.kinds
        for p in parts
    ]
    rows, panel_px = len(scores.kinds), 230
    ticks_px = tick_label_px(scores)  # rotated labels under every row, then the next row's title
    gap_px = ticks_px + TITLE_PX
    margin = dict(t=110, b=ticks_px + 50)
    height = rows * panel_px + (rows - 1) * gap_px + margin["t"] + margin["b"]
    plot_px = height - margin["t"] - margin["b"]
    fig = make_subplots(
        rows=rows,
        cols=len(parts),
        subplot_titles=titles,
        horizontal_spacing=0.14,
        vertical_spacing=gap_px / plot_px if rows > 1 else 0.1,
    )
    unit = score_unit(scores)
    tokens = _column_tokens(scores)
    shown = []
    for r, kind in enumerate(scores.kinds, start=1):
        for c, part in enumerate(parts, start=1):
            z, x, y = panel(scores, kind, part)
            shown.append(z)
            n = (r - 1) * len(parts) + c
            xdom = fig.layout[f"xaxis{n if n > 1 else ''}"].domain
            ydom = fig.layout[f"yaxis{n if n > 1 else ''}"].domain
            trace = _heatmap_trace(
                z,
                x,
                y,
                kind,
                "MLP" if part == "mlp" else "attention (heads summed)",
                unit,
                tokens=tokens,
                colorbar=dict(  # untitled: the figure title names the unit
                    x=xdom[1] + 0.01,
                    y=(ydom[0] + ydom[1]) / 2,
                    len=(ydom[1] - ydom[0]),
                    thickness=10,
                ),
            )
            fig.add_trace(trace, row=r, col=c)
            fig.update_xaxes(row=r, col=c, **_position_axis(scores))
            fig.update_yaxes(title_text="layer", row=r, col=c)
            if r == len(scores.kinds):
                fig.update_xaxes(title_text=POSITION_AXIS, row=r, col=c)
    fig.update_layout(
        title=f"{scores.method} scores, mean over {scores.n_prompts} prompts ({unit})",
        template="plotly_white",
        height=height,
        margin=margin,
    )
    return mark_uncomputed(fig, *shown)


TICK_ANGLE = -40
TITLE_PX = 45
"""Room for a subplot title (and the axis title of the row above) between two rows of panels."""


def tick_label_px(scores: ScoresView, font_px: float = 12.0) -> int:
    """How far the rotated position labels reach below an axis, in pixels: the longest label's
    width (about 0.6 of the font size per character) times sin of the tick angle, plus the
    tick's own offset."""
    import math

    longest = max((len(t) for t in _position_axis(scores)["ticktext"]), default=0)
    return int(longest * 0.6 * font_px * math.sin(math.radians(abs(TICK_ANGLE))) + 20)


def side_by_side(
    results: dict[str, ScoresView], kind: ScoreKind = "informative", part: Part = "mlp"
) -> go.Figure:
    """Heat maps of several results side by side on one colour scale, e.g. the paper's Fig. 5:
    ``side_by_side({"first hop": lin1, "second hop": lin2})``. Each panel keeps its own token
    positions; layer 0 at the bottom; blue helps the answer."""
    from plotly.subplots import make_subplots

    if not results:
        raise ValueError("side_by_side needs at least one result")
    if part in ("heads", "all_heads"):
        raise ValueError("side_by_side shows layer × position maps: part 'mlp' or 'attn'")
    panels = {name: panel(s, kind, part) for name, s in results.items()}
    lim = max(_abs_max(z) for z, _, _ in panels.values()) or 1.0
    what = "MLP" if part == "mlp" else "attention (heads summed)"
    fig = make_subplots(
        rows=1,
        cols=len(results),
        subplot_titles=[f"{name} · {kind} · {what}" for name in results],
        horizontal_spacing=0.08,
        shared_yaxes=True,
    )
    units = {score_unit(s) for s in results.values()}
    unit = units.pop() if len(units) == 1 else "score"
    for c, (name, s) in enumerate(results.items(), start=1):
        z, x, y = panels[name]
        trace = _heatmap_trace(
            z, x, y, kind, f"{what} ({name})", unit, tokens=_column_tokens(s),
            showscale=c == len(results), lim=lim,
        )  # fmt: skip
        fig.add_trace(trace, row=1, col=c)
        fig.update_xaxes(row=1, col=c, title_text=POSITION_AXIS, **_position_axis(s))
    fig.update_yaxes(title_text="layer", row=1, col=1)
    fig.update_layout(
        title=f"where the {kind} scores sit ({unit}; one colour scale)",
        template="plotly_white",
        height=560,
        width=max(700, 430 * len(results)),
    )
    return mark_uncomputed(fig, *(z for z, _, _ in panels.values()))


def _safe_token(t: str) -> str:
    """Token text made safe inside circuitsvis's inline script: no ``</`` sequences survive."""
    return t.replace("<", "\u2039").replace(">", "\u203a")


def heads_by_position(scores: ScoresView, kind: ScoreKind) -> go.Figure:
    """Layer × head heat map with a slider over token roles (one colour scale for all positions)."""
    import plotly.graph_objects as go

    v = scores[kind].detach().double().numpy()
    heads = [i for i, c in enumerate(scores.component_labels) if c != "MLP"]
    z = v[:, heads, :]
    lim = _abs_max(z) or 1.0
    fig = go.Figure()
    for p, label in enumerate(scores.position_labels):
        fig.add_trace(
            go.Heatmap(
                z=z[:, :, p],
                x=[scores.component_labels[i] for i in heads],
                y=_layer_labels(v.shape[0]),
                zmid=0.0,
                zmin=-lim,
                zmax=lim,
                colorscale=COLORSCALE,
                colorbar=dict(title=dict(text=score_unit(scores), side="right")),
                visible=p == len(scores.position_labels) - 1,
                name=label,
                hovertemplate=f"{kind} · %{{x}} · layer %{{y}}<br>at {html.escape(label)}<br>score %{{z:.4g}}<extra></extra>",
            )
        )
    steps = [
        dict(
            method="update",
            label=label,
            args=[
                {"visible": [i == p for i in range(len(scores.position_labels))]},
                {"title": f"{scores.method} {kind} scores of each head at {label}"},
            ],
        )
        for p, label in enumerate(scores.position_labels)
    ]
    fig.update_layout(
        sliders=[dict(active=len(steps) - 1, steps=steps, currentvalue=dict(prefix="position: "))],
        title=f"{scores.method} {kind} scores of each head at {scores.position_labels[-1]}",
        xaxis_title="head",
        yaxis_title="layer",
        template="plotly_white",
        height=360 + 18 * v.shape[0],
    )
    return mark_uncomputed(fig, z)

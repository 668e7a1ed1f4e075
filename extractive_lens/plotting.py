"""Pure figure builders: data in, ``plotly.graph_objects.Figure`` out (never ``.show()``).

>>> from extractive_lens import compare
>>> fig = heatmap(scores, "informative", part="mlp")     # a plotly Figure: restyle it freely
>>> fig = overview(scores)                               # the paper's grid
>>> fig = comparison_plot(compare(linear, exact))
>>> report(scores, comparison, path="report.html")  # one self-contained file  # doctest: +SKIP

Every figure is an ordinary plotly figure: restyle it with ``fig.update_layout(...)``.

Every figure is a short pure builder; ``report`` lays them out on the page from ``report.py``'s
blocks.
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal, cast

import numpy as np

from extractive_lens import report as html_report
from extractive_lens.style import COLORSCALE, REWARD_UNITS, UNCOMPUTED, score_unit  # noqa: F401
from extractive_lens.types import ScoreKind
from extractive_lens.views import ComparisonView, ScoresView

if TYPE_CHECKING:  # pragma: no cover
    from pathlib import Path

    import plotly.graph_objects as go


Part = Literal["mlp", "attn", "heads", "all_heads"]
POSITION_AXIS = "token position (role: tokens)"


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


def comparison_plot(comparison: ComparisonView) -> go.Figure:
    """The judged scores (x: linear or integrated) against the reference (y: usually exact) per
    kind, with y = x and Pearson r in each title."""
    xname, yname = ("exact" if m == "causal" else m for m in comparison.methods)
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    kinds = [k for k in comparison.linear.kinds if k in comparison.exact.kinds]
    r_of = {(row["kind"], row["part"]): row["pearson"] for row in comparison.rows}
    fig = make_subplots(
        rows=1,
        cols=len(kinds),
        subplot_titles=[f"{k} (r = {r_of.get((k, 'all'), float('nan')):.3f})" for k in kinds],
    )
    for i, kind in enumerate(kinds, start=1):
        parts: tuple[tuple[Literal["heads", "mlp"], str], ...] = (
            ("heads", "#1f77b4"),
            ("mlp", "#d62728"),
        )
        for part, color in parts:
            a, b, labels = comparison.cells(kind, part)
            if len(a) == 0:
                continue
            fig.add_trace(
                go.Scatter(
                    x=a,
                    y=b,
                    mode="markers",
                    name=part,
                    legendgroup=part,
                    showlegend=i == 1,
                    marker=dict(color=color, size=6, opacity=0.7),
                    text=labels,
                    hovertemplate="%{text}<br>"
                    + xname
                    + " %{x:.4g}<br>"
                    + yname
                    + " %{y:.4g}<extra></extra>",
                ),
                row=1,
                col=i,
            )
        a, b, _ = comparison.cells(kind)
        lo, hi = float(min(a.min(), b.min())), float(max(a.max(), b.max()))
        fig.add_trace(
            go.Scatter(
                x=[lo, hi],
                y=[lo, hi],
                mode="lines",
                line=dict(color="gray", dash="dash"),
                name="y = x",
                showlegend=i == 1,
                hoverinfo="skip",
            ),
            row=1,
            col=i,
        )
        unit = score_unit(comparison.linear)
        fig.update_xaxes(title_text=f"{xname} score ({unit})", row=1, col=i)
        fig.update_yaxes(title_text=f"{yname} score ({unit})", row=1, col=i)
    fig.update_layout(
        title=f"{xname} vs {yname} ({comparison.level} level)",
        template="plotly_white",
        height=420,
        width=max(500, 380 * len(kinds)),
    )
    return fig


def token_view(scores: ScoresView, kind: ScoreKind, component: str, prompt: int = 0) -> Any:
    """A prompt's tokens coloured by one component's per-token score (circuitsvis).

    ``component``: ``"L3H2"``, ``"L3MLP"`` or ``"L3ATTN"`` (heads summed). Returns circuitsvis's
    ``RenderedHTML``; use ``.local_src`` for offline HTML (its ``_repr_html_`` loads from a CDN).
    """
    from circuitsvis.tokens import colored_tokens

    from extractive_lens.types import Component

    v = scores.prompt_values[scores.kind_index(kind), prompt]  # layer component pos
    n = len(scores.prompt_roles[prompt])
    if component.endswith("ATTN"):
        layer = int(component[1:-4])
        vals = v[layer, [i for i, c in enumerate(scores.component_labels) if c != "MLP"], :n].sum(0)
    else:
        c = Component.parse(component)
        vals = v[c.layer, scores.component_labels.index(c.short_label), :n]
    tokens = (scores.metadata.get("prompt_tokens") or [list(r) for r in scores.prompt_roles])[
        prompt
    ][:n]
    if bool(vals.isnan().all()):
        raise ValueError(f"{component}'s {kind} scores were never computed in this result.")
    vals = vals.nan_to_num(0.0)
    lim = float(vals.abs().max()) or 1.0
    return colored_tokens(
        [_safe_token(t) for t in tokens],
        vals.double().tolist(),
        min_value=-lim,
        max_value=lim,
        negative_color="#b2182b",
        positive_color="#2166ac",
    )  # as RdBu


def attention_view(
    model: Any, batch: Any, layer: int, heads: list[int] | None = None, prompt: int = 0
) -> Any:
    """Attention patterns of ``heads`` of ``layer`` on one prompt (circuitsvis ``attention_patterns``)."""
    import torch
    from circuitsvis.attention import attention_patterns

    from extractive_lens import backend as B

    n = int(batch.lengths[prompt])
    tokens = batch.tokens[prompt : prompt + 1, :n].to(model.cfg.device)
    with torch.no_grad():
        x = B.run_blocks(model, B.embed(model, tokens), stop=layer)
        assert x is not None  # run_blocks returns the residual when it stops before the end
        _, cap = B.attention(model, layer, x, ("pattern",))
    pattern = cap["pattern"][0]
    if heads is not None:
        pattern = pattern[heads]
    tok = getattr(model, "tokenizer", None)
    strs = [tok.decode([int(t)]) if tok is not None else f"t{int(t)}" for t in tokens[0].tolist()]
    return attention_patterns([_safe_token(t) for t in strs], pattern.float().cpu())


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


def rank_curves(
    df: Any,
    *,
    x: str = "epoch",
    y: str = "mean_rank",
    color: str = "split",
    chance: float | None = None,
    title: str = "mean rank during finetuning",
) -> go.Figure:
    """Mean rank against epoch, one line per ``color`` group (e.g. facts vs implications)."""
    import plotly.graph_objects as go

    fig = go.Figure()
    for name, g in df.groupby(color, sort=False):
        g = g.sort_values(x)
        fig.add_trace(
            go.Scatter(
                x=g[x],
                y=g[y],
                mode="lines+markers",
                name=str(name),
                hovertemplate=f"{name}<br>{x} %{{x}}<br>{y} %{{y:.2f}}<extra></extra>",
            )
        )
    if chance is not None:
        fig.add_hline(y=chance, line_dash="dot", line_color="gray", annotation_text="chance")
    fig.update_layout(
        title=title, xaxis_title=x, yaxis_title=y.replace("_", " "), template="plotly_white"
    )
    return fig


def table_heatmap(
    df: Any,
    *,
    index: str,
    columns: str,
    values: str,
    title: str = "",
    colorscale: str = "Viridis_r",
    fmt: str = ".2f",
) -> go.Figure:
    """An annotated heat map of a tidy table (layer-freezing or grafting mean ranks)."""
    import plotly.graph_objects as go

    table = df.pivot_table(index=index, columns=columns, values=values, aggfunc="mean", sort=False)
    z = table.to_numpy(dtype=float)
    text = [[format(v, fmt) for v in row] for row in z]
    fig = go.Figure(
        go.Heatmap(
            z=z,
            x=[str(c) for c in table.columns],
            y=[str(i) for i in table.index],
            text=text,
            texttemplate="%{text}",
            colorscale=colorscale,
            hovertemplate=f"{index} %{{y}}<br>{columns} %{{x}}<br>{values} %{{z:.3f}}<extra></extra>",
        )
    )
    fig.update_layout(title=title, template="plotly_white", yaxis=dict(autorange="reversed"))
    return fig


def graft_heatmap(scores: Any, *, title: str | None = None, n_boot: int = 1000) -> go.Figure:
    """A graft map (``graft_scores``): groups × roles, each cell's normalised score (base 0,
    full finetune 1) with its bootstrap interval over prompts."""
    import plotly.graph_objects as go

    ci = scores.intervals(n_boot)
    lo, hi = ci.low, ci.high
    z = scores.values.double().numpy()
    text = [[f"{z[i, j]:.2f}<br>[{float(lo[i, j]):.2f}, {float(hi[i, j]):.2f}]"
             for j in range(z.shape[1])] for i in range(z.shape[0])]  # fmt: skip
    fig = go.Figure(
        go.Heatmap(
            z=z,
            x=list(scores.role_labels),
            y=list(scores.group_labels),
            text=text,
            texttemplate="%{text}",
            colorscale="RdBu",
            zmid=0,
            zmin=-1,
            zmax=1,
            colorbar=dict(title=scores.mode),
            hovertemplate="%{y} at %{x}<br>" + scores.mode + " %{z:.3f}<extra></extra>",
        )  # fmt: skip
    )
    fig.update_layout(
        title=title or f"{scores.mode}: Δ {'only on' if scores.mode == 'sufficient' else 'removed from'} "
        f"each set (0 = base, 1 = full finetune; {scores.metadata.get('reward', '')})",
        xaxis_title="positions", yaxis_title="components", template="plotly_white",
        yaxis=dict(autorange="reversed"),
    )  # fmt: skip
    return fig


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

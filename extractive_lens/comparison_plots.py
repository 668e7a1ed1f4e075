"""Figures that set scores side by side with other numbers: a judged method against its
reference (``comparison_plot``), the experiments' mean ranks (``rank_curves``,
``table_heatmap``) and graft maps (``graft_heatmap``).

>>> from extractive_lens import compare
>>> fig = comparison_plot(compare(linear, exact))
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from extractive_lens.style import score_unit
from extractive_lens.views import ComparisonView

if TYPE_CHECKING:  # pragma: no cover
    import plotly.graph_objects as go


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

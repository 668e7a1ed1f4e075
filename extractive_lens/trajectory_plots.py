"""Figures of scores along a trajectory (``scoring.trajectory.TrajectoryScores``) and their page.

>>> fig = layer_map(maps, "informative")          # epoch x layer heat map          # doctest: +SKIP
>>> fig = curves(maps, ["L0MLP", "L2H1"], ranks=df)  # components and mean rank    # doctest: +SKIP
>>> fig = slider(maps, "informative")             # layer x component, one frame per epoch  # doctest: +SKIP
>>> report(maps, "trajectory.html", along=along, ranks=df)                         # doctest: +SKIP

Pure builders: a ``TrajectoryScores`` in, a restylable ``plotly.graph_objects.Figure`` out; the
page is one self-contained file (``report.write_page``: plotly.js embedded, no network).
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from extractive_lens.style import COLORSCALE, score_unit


def _time_label(ts: Any) -> str:
    return "checkpoint (epoch)" if ts.what == "checkpoint" else "segment end (epoch)"


def _zmax(z: Any) -> float:
    import numpy as np

    m = float(np.nanmax(np.abs(z))) if np.size(z) else 0.0
    return m if m > 0 else 1.0


def layer_map(ts: Any, kind: str = "informative", part: str = "all") -> Any:
    """Epoch x layer heat map: each layer's ``kind`` score (its components and positions summed,
    mean over prompts) at each checkpoint or segment (``TrajectoryScores.layer_map``)."""
    import plotly.graph_objects as go

    df = ts.layer_map(kind, part)
    z = df.to_numpy()
    lim = _zmax(z)
    what = "share of the change along each segment" if ts.what == "segment" else "score of D_k"
    fig = go.Figure(go.Heatmap(
        z=z, x=list(df.columns), y=[f"{e:g}" for e in df.index], colorscale=COLORSCALE,
        zmid=0, zmin=-lim, zmax=lim, colorbar={"title": score_unit(ts.scores[0])},
        hovertemplate="epoch %{y}<br>%{x}<br>%{z:.4g}<extra></extra>",
    ))  # fmt: skip
    fig.update_layout(
        title=f"{kind} by layer over training ({part}; {what})", xaxis_title="layer",
        yaxis_title=_time_label(ts), template="plotly_white", height=300 + 22 * len(df),
    )  # fmt: skip
    fig.update_yaxes(type="category")
    return fig


def curves(ts: Any, components: Sequence[str], kind: str = "informative",
           ranks: Any = None) -> Any:  # fmt: skip
    """One line per component (its whole ``kind`` score over time) and, with ``ranks`` (the
    ``DataFrame[epoch, split, mean_rank]`` of ``rank_trajectory``), the mean rank of each
    split on a second axis of the same time axis."""
    import plotly.graph_objects as go

    fig = go.Figure()
    for c in components:
        s = ts.curve(c, kind)
        fig.add_trace(go.Scatter(x=list(s.index), y=list(s.values), mode="lines+markers",
                                 name=c))  # fmt: skip
    if ranks is not None:
        for split, g in ranks.groupby("split", sort=False):
            g = g.sort_values("epoch")
            fig.add_trace(go.Scatter(
                x=list(g["epoch"]), y=list(g["mean_rank"]), name=f"mean rank: {split}",
                yaxis="y2", mode="lines", line={"dash": "dot"},
            ))  # fmt: skip
        fig.update_layout(yaxis2={"title": "mean rank (0 = top)", "overlaying": "y",
                                  "side": "right", "rangemode": "tozero", "tickformat": ".1f",
                                  "showgrid": False})  # fmt: skip
    fig.update_layout(
        title=f"{kind} per component over training", xaxis_title="epoch",
        yaxis_title=f"{kind} ({score_unit(ts.scores[0])})", template="plotly_white",
        legend={"orientation": "h", "y": -0.2},
    )  # fmt: skip
    return fig


def slider(ts: Any, kind: str = "informative") -> Any:
    """Layer x component heat map (whole components), one frame per checkpoint or segment,
    with a slider and a play button (plotly frames: self-contained, no server)."""
    import plotly.graph_objects as go

    mats = [s.totals[s.kinds.index(kind)].numpy() for s in ts.scores]
    lim = max(_zmax(m) for m in mats)
    x = list(ts.scores[0].component_labels)
    y = [f"L{layer}" for layer in range(mats[0].shape[0])]
    names = [f"{e:g}" for e in ts.epochs]

    def trace(m: Any) -> Any:
        return go.Heatmap(z=m, x=x, y=y, colorscale=COLORSCALE, zmid=0, zmin=-lim, zmax=lim,
                          colorbar={"title": score_unit(ts.scores[0])})  # fmt: skip

    fig = go.Figure(data=[trace(mats[0])],
                    frames=[go.Frame(data=[trace(m)], name=n) for m, n in zip(mats, names)])  # fmt: skip
    steps = [{"label": n, "method": "animate",
              "args": [[n], {"mode": "immediate", "frame": {"duration": 0, "redraw": True}}]}
             for n in names]  # fmt: skip
    n_layers = mats[0].shape[0]
    fig.update_layout(
        title=f"{kind} per component, epoch by epoch", xaxis_title="component",
        yaxis_title="layer", template="plotly_white", height=300 + 16 * max(n_layers, 8),
        margin={"b": 150},  # room under the axis title for the play button and the slider
        sliders=[{
            "steps": steps, "active": 0, "x": 0.1, "len": 0.9, "y": 0, "yanchor": "top",
            "pad": {"t": 70}, "currentvalue": {"prefix": "epoch ", "xanchor": "left",
                                               "font": {"size": 14}},
        }],
        updatemenus=[{"type": "buttons", "showactive": False, "x": 0, "xanchor": "left",
                      "y": 0, "yanchor": "top", "pad": {"t": 98}, "buttons": [
            {"label": "play", "method": "animate",
             "args": [None, {"frame": {"duration": 700, "redraw": True}, "fromcurrent": True}]},
        ]}],
    )  # fmt: skip
    return fig


def top_components(ts: Any, kind: str = "informative", n: int = 4) -> list[str]:
    """The ``n`` components with the largest |score| at any time."""
    import numpy as np

    s = ts.scores[0]
    peak = np.max(np.stack([np.abs(r.totals[r.kinds.index(kind)].numpy()) for r in ts.scores]), 0)
    order = np.argsort(-peak, axis=None)[:n]
    out = []
    for i in order:
        layer, c = np.unravel_index(i, peak.shape)
        label = s.component_labels[c]
        out.append(f"L{layer}{label}")
    return out


def report(ts: Any, path: str | Path, *, along: Any = None, ranks: Any = None,
           straight: Any = None, title: str = "Scores along the finetuning trajectory") -> Path:  # fmt: skip
    """One self-contained HTML page: the epoch x layer map of each kind, the top components'
    curves (with the rank trajectory on the same time axis), the per-epoch slider, and with
    ``along`` (``trajectory_integrated``) its segment map and completeness, and with
    ``straight`` (``integrated_scores`` of ``traj.final``) how far the two integrals differ."""
    from extractive_lens.report import _Figures, write_page

    figures = _Figures()
    body = [f"<h1>{html.escape(title)}</h1>"]
    for kind in ts.kinds:
        body.append(f"<h2>{html.escape(kind)}</h2>")
        body.append(figures.add(layer_map(ts, kind), "Each layer's score at each time."))
        body.append(figures.add(curves(ts, top_components(ts, kind), kind, ranks),
                                "The components with the largest scores, over time."))  # fmt: skip
        body.append(figures.add(slider(ts, kind), "Every head and MLP, one frame per time."))
    if along is not None:
        info = along.metadata["integrated"]
        body.append("<h2>Informative, integrated along the training path</h2>")
        body.append(
            f"<p>Completeness error {info['completeness']['informative']:.2%} "
            f"({info['steps']} {info['rule']} nodes per segment; per segment "
            + ", ".join(f"{e:.2%}" for e in info["segment_completeness"])
            + f"); R(W_T) - R(W_0) = {info['R_change']:.4g}.</p>"
        )  # fmt: skip
        body.append(figures.add(layer_map(along, "informative"),
                                "Each segment's share of the change, by layer."))  # fmt: skip
        if straight is not None:
            gap = path_gap(along, straight)
            body.append(figures.add(gap_figure(gap), "Trajectory vs straight line, per component."))
    return write_page(path, title, body, figures, "compressed")


def path_gap(along: Any, straight: Any) -> Any:
    """``DataFrame[component]``: each component's informative score integrated along the
    trajectory (``along.total``) and along the straight line (``straight``, an
    ``integrated_scores`` result of the same prompts), and their difference."""
    import pandas as pd

    a = along.total
    ka, ks = a.kinds.index("informative"), straight.kinds.index("informative")
    rows = []
    for layer in range(a.totals.shape[1]):
        for c, label in enumerate(a.component_labels):
            t, s = float(a.totals[ka, layer, c]), float(straight.totals[ks, layer, c])
            rows.append((f"L{layer}{label}", t, s, t - s))
    return pd.DataFrame(rows, columns=["component", "trajectory", "straight", "difference"])


def gap_figure(gap: Any) -> Any:
    """Grouped bars per component: its informative score along the trajectory and along the
    straight line (``path_gap``'s DataFrame)."""
    import plotly.graph_objects as go

    fig = go.Figure()
    fig.add_bar(x=list(gap["component"]), y=list(gap["trajectory"]), name="along the trajectory")
    fig.add_bar(x=list(gap["component"]), y=list(gap["straight"]), name="straight line")
    fig.update_layout(barmode="group", xaxis_title="component", yaxis_title="informative",
                      title="informative: trajectory vs straight line", template="plotly_white")  # fmt: skip
    return fig

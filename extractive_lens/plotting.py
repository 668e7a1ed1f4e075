"""Pure figure builders: data in, ``plotly.graph_objects.Figure`` out (never ``.show()``).

>>> from extractive_lens import compare
>>> fig = heatmap(scores, "informative", part="mlp")     # a plotly Figure: restyle it freely
>>> fig = overview(scores)                               # the paper's grid
>>> fig = comparison_plot(compare(linear, exact))
>>> report(scores, comparison, path="report.html")  # one self-contained file  # doctest: +SKIP

Every figure is an ordinary plotly figure: restyle it with ``fig.update_layout(...)``.
"""

from __future__ import annotations

import html
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from extractive_lens.results import ComponentScores
from extractive_lens.types import ScoreKind, jsonable

if TYPE_CHECKING:  # pragma: no cover
    import plotly.graph_objects as go

    from extractive_lens.comparison import ScoreComparison

Part = Literal["mlp", "attn", "heads"]
COLORSCALE = "RdBu"


def _layer_labels(n: int) -> list[str]:
    return [f"L{i}" for i in range(n)]


def panel(
    scores: ComponentScores, kind: ScoreKind, part: Part = "mlp", position: str | None = None
) -> tuple[np.ndarray, list[str], list[str]]:
    """The matrix a heat map shows, with its x and y labels.

    ``mlp``: layer × position; ``attn``: layer × position, heads summed; ``heads``: layer × head
    at one ``position`` (default: summed over positions).
    """
    v = scores[kind].detach().double().numpy()  # layer component pos
    comps = list(scores.component_labels)
    heads = [i for i, c in enumerate(comps) if c != "MLP"]
    if part == "mlp":
        if "MLP" not in comps:
            raise ValueError("This model has no MLPs (attention-only).")
        return v[:, comps.index("MLP"), :], list(scores.position_labels), _layer_labels(v.shape[0])
    if part == "attn":
        return v[:, heads, :].sum(1), list(scores.position_labels), _layer_labels(v.shape[0])
    if part == "heads":
        if position is None:
            m = v[:, heads, :].sum(-1)
        else:
            if position not in scores.position_labels:
                raise ValueError(
                    f"Unknown position {position!r}; choose from {scores.position_labels}"
                )
            m = v[:, heads, scores.position_labels.index(position)]
        return m, [comps[i] for i in heads], _layer_labels(v.shape[0])
    raise ValueError(f"part must be 'mlp', 'attn' or 'heads', got {part!r}")


def _heatmap_trace(
    z: np.ndarray, x: list[str], y: list[str], kind: str, what: str, **kw: Any
) -> go.Heatmap:
    import plotly.graph_objects as go

    lim = float(np.abs(z).max()) or 1.0
    return go.Heatmap(
        z=z,
        x=x,
        y=y,
        zmid=0.0,
        zmin=-lim,
        zmax=lim,
        colorscale=COLORSCALE,
        hovertemplate=f"{kind} · {what}<br>layer %{{y}}<br>%{{x}}<br>score %{{z:.4g}}<extra></extra>",
        **kw,
    )


def heatmap(
    scores: ComponentScores, kind: ScoreKind, part: Part = "mlp", position: str | None = None
) -> go.Figure:
    """One heat map: x = token roles (or heads), y = layer with layer 0 at the bottom, diverging
    colours centred at 0, hover with value, layer, component and token."""
    import plotly.graph_objects as go

    z, x, y = panel(scores, kind, part, position)
    what = {
        "mlp": "MLP",
        "attn": "attention (heads summed)",
        "heads": f"heads @ {position or 'all positions'}",
    }[part]
    fig = go.Figure(_heatmap_trace(z, x, y, kind, what))
    fig.update_layout(
        title=f"{scores.method} {kind} scores: {what}",
        xaxis_title="token role" if part != "heads" else "head",
        yaxis_title="layer",
        yaxis=dict(autorange=True),
        template="plotly_white",
        height=300 + 18 * len(y),
    )
    return fig


def overview(scores: ComponentScores) -> go.Figure:
    """The paper's grid: rows = score kinds, columns = MLP / attention, one colour scale per panel."""
    from plotly.subplots import make_subplots

    parts: list[Part] = ["mlp", "attn"] if "MLP" in scores.component_labels else ["attn"]
    titles = [f"{k} · {'MLP' if p == 'mlp' else 'attention'}" for k in scores.kinds for p in parts]
    fig = make_subplots(
        rows=len(scores.kinds),
        cols=len(parts),
        subplot_titles=titles,
        horizontal_spacing=0.12,
        vertical_spacing=0.12,
    )
    for r, kind in enumerate(scores.kinds, start=1):
        for c, part in enumerate(parts, start=1):
            z, x, y = panel(scores, kind, part)
            n = (r - 1) * len(parts) + c
            xdom = fig.layout[f"xaxis{n if n > 1 else ''}"].domain
            ydom = fig.layout[f"yaxis{n if n > 1 else ''}"].domain
            trace = _heatmap_trace(
                z,
                x,
                y,
                kind,
                "MLP" if part == "mlp" else "attention",
                colorbar=dict(
                    x=xdom[1] + 0.01,
                    y=(ydom[0] + ydom[1]) / 2,
                    len=(ydom[1] - ydom[0]),
                    thickness=10,
                ),
            )
            fig.add_trace(trace, row=r, col=c)
    fig.update_layout(
        title=f"{scores.method} scores ({scores.metadata.get('reward', '')})",
        template="plotly_white",
        height=260 * len(scores.kinds) + 80,
    )
    return fig


def comparison_plot(comparison: ScoreComparison) -> go.Figure:
    """Linear (x) against exact (y) per kind, with y = x and Pearson r in each title."""
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
        for part, color in (("heads", "#1f77b4"), ("mlp", "#d62728")):
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
                    hovertemplate="%{text}<br>linear %{x:.4g}<br>exact %{y:.4g}<extra></extra>",
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
        fig.update_xaxes(title_text="linear", row=1, col=i)
        fig.update_yaxes(title_text="exact", row=1, col=i)
    fig.update_layout(
        title=f"linearized vs exact ({comparison.level} level)",
        template="plotly_white",
        height=420,
        width=max(500, 380 * len(kinds)),
    )
    return fig


def token_view(scores: ComponentScores, kind: ScoreKind, component: str, prompt: int = 0) -> Any:
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


def _table(rows: list[tuple[Any, ...]], header: tuple[str, ...]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(_fmt(c))}</td>" for c in r) + "</tr>" for r in rows
    )
    return f"<table class='el'><tr>{head}</tr>{body}</table>"


def _fmt(x: Any) -> str:
    return f"{x:+.4g}" if isinstance(x, float) else str(x)


def report(
    scores: ComponentScores | list[ComponentScores],
    comparison: ScoreComparison | None = None,
    path: str | Path = "report.html",
    *,
    title: str = "extractive_lens report",
    extra_figures: list[tuple[str, go.Figure]] | None = None,
    token_views: list[tuple[str, Any]] | None = None,
) -> Path:
    """Write one self-contained HTML file: every view, the metadata and the top-component table.

    plotly.js is embedded once; the page makes no network requests. Token strings are escaped.
    """
    results = scores if isinstance(scores, list) else [scores]
    figures: list[tuple[str, Any]] = []
    for s in results:
        figures.append((f"{s.method} scores: overview", overview(s)))
        if any(c != "MLP" for c in s.component_labels):
            for kind in s.kinds:
                figures.append((f"{s.method} {kind}: heads", heatmap(s, kind, part="heads")))
    if comparison is not None:
        figures.append(("linear vs exact", comparison_plot(comparison)))
    figures += extra_figures or []
    if token_views is None:  # the top informative component's per-token scores on prompt 0
        s0 = results[0]
        kind = "informative" if "informative" in s0.kinds else s0.kinds[0]
        if s0.per == "token":
            _, lab, _ = s0.top(1, kind)[0]
            token_views = [(f"{s0.method} {kind} of {lab}, prompt 0", token_view(s0, kind, lab))]
    parts = []
    for i, (name, fig) in enumerate(figures):
        div = fig.to_html(
            full_html=False,
            include_plotlyjs=(i == 0),
            div_id=f"fig{i}",
            config={"displaylogo": False},
        )
        parts.append(f"<section><h2>{html.escape(name)}</h2>{div}</section>")
    for name, view in token_views or []:
        src = view.local_src if hasattr(view, "local_src") else str(view)
        page_doc = (
            f"<!DOCTYPE html><html><head><meta charset='utf-8'></head><body>{src}</body></html>"
        )
        parts.append(
            f"<section><h2>{html.escape(name)}</h2><iframe class='tokens' sandbox='allow-scripts' "
            f"style='width:100%;height:140px;border:0' srcdoc=\"{html.escape(page_doc, quote=True)}\">"
            "</iframe></section>"
        )
    tops = []
    for s in results:
        rows = [(s.method, k, lab, v) for k in s.kinds for (_, lab, v) in s.top(5, k)]
        tops.append(_table(rows, ("method", "kind", "component", "score")))
    cmp_html = ""
    if comparison is not None:
        cols = (
            "kind",
            "part",
            "n",
            "pearson",
            "spearman",
            "sign_agreement",
            "topk_overlap",
            "max_abs_err",
        )
        says = "".join(
            f"<li><b>{html.escape(k)}</b>: {html.escape(v)}</li>"
            for k, v in comparison.verdicts.items()
        )
        cmp_html = (
            "<h2>linear vs exact</h2><ul class='verdicts'>"
            + says
            + "</ul>"
            + _table([tuple(r[c] for c in cols) for r in comparison.rows], cols)
        )
    notes = [s.linearization_note() for s in results if s.linearization_note()]
    if notes:
        cmp_html += "<h2>linearization check</h2>" + "".join(
            f"<p class='linearization'>{html.escape(n)}</p>" for n in notes
        )
    meta = html.escape(json.dumps(jsonable({s.method: s.metadata for s in results}), indent=1))
    page = f"""<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>body{{font-family:system-ui,sans-serif;margin:2em;max-width:1200px}}
table.el{{border-collapse:collapse;margin:1em 0}} table.el td,table.el th{{border:1px solid #ccc;padding:2px 8px}}
pre{{background:#f6f6f6;padding:1em;overflow:auto;max-height:20em}}</style></head>
<body><h1>{html.escape(title)}</h1>
<h2>top components</h2>{"".join(tops)}{cmp_html}
{"".join(parts)}
<h2>metadata</h2><pre>{meta}</pre></body></html>"""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(page, encoding="utf-8")
    return path


def heads_by_position(scores: ComponentScores, kind: ScoreKind) -> go.Figure:
    """Layer × head heat map with a slider over token roles (one colour scale for all positions)."""
    import plotly.graph_objects as go

    v = scores[kind].detach().double().numpy()
    heads = [i for i, c in enumerate(scores.component_labels) if c != "MLP"]
    z = v[:, heads, :]
    lim = float(np.abs(z).max()) or 1.0
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

"""The building blocks of the self-contained HTML report (``plotting.report`` puts them together).

>>> path = report([linear, exact], compare(linear, exact), path="report.html")  # doctest: +SKIP

One file, no network requests: plotly.js is embedded once (gzip-compressed, decompressed by the
browser: about 1.8 MB instead of 4.6 MB), figures are plain JSON rendered on load, and the token
view is an HTML table (no per-view JavaScript bundle). Sections, top to bottom: a summary line,
"how to read this report", what to trust (linear-vs-exact verdicts, additivity check), the top
components with their TransformerLens hooks, the overview and heads × positions heat maps of each
result, the linear-vs-exact scatter, the token view and the metadata as a table.
"""

from __future__ import annotations

import base64
import functools
import gzip
import html
import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from extractive_lens.files import write_text_atomic
from extractive_lens.style import UNCOMPUTED, score_rgba, score_unit
from extractive_lens.types import Component, ScoreKind, jsonable
from extractive_lens.views import ScoresView

if TYPE_CHECKING:  # pragma: no cover
    import plotly.graph_objects as go

PlotlyJS = Literal["compressed", "inline"]

KIND_MEANING = {
    "informative": "does the component's own weight change carry the new fact? (exact: the "
    "component alone runs with its finetuned weights on its base input)",
    "upstream": "does the component route the query to where the fact is stored? (how much more "
    "the finetuned later weights depend on its output than the base weights do; its output is "
    "ablated to y*)",
    "downstream": "does the component turn the recalled fact into the answer? (the component, "
    "with its base weights, reads the input it gets in the finetuned model)",
}

STYLE = """
body{font-family:system-ui,sans-serif;margin:2em auto;max-width:1200px;padding:0 1em;color:#222}
h2{border-bottom:1px solid #ddd;padding-bottom:.2em;margin-top:2em}
table.el{border-collapse:collapse;margin:.6em 0;font-size:90%}
table.el td,table.el th{border:1px solid #ccc;padding:2px 8px;text-align:left;vertical-align:top}
p.caption{color:#444;max-width:60em;margin:.2em 0 .6em}
p.summary{font-size:95%;color:#333}
.howto li,.verdicts li{margin:.25em 0}
table.tokens td{text-align:center;min-width:3.2em;font-family:ui-monospace,monospace;font-size:85%}
table.tokens td small{color:#555}
code{background:#f3f3f3;padding:0 .2em}
.el-figure{width:100%}
""".strip()


def write_page(
    path: str | Path, title: str, body: list[str], figures: _Figures, plotlyjs: PlotlyJS
) -> Path:
    """The page around ``body`` (HTML parts, figure placeholders from ``figures``), with the
    script that renders the figures, written atomically: a symlink planted at ``path`` is
    replaced, not followed."""
    page = (
        "<!DOCTYPE html>\n<html><head><meta charset='utf-8'>"
        f"<title>{html.escape(title)}</title><style>{STYLE}</style></head>\n<body>\n"
        + "\n".join(body) + "\n" + figures.loader(plotlyjs) + "\n</body></html>\n"
    )  # fmt: skip
    return write_text_atomic(path, page)


def figure_page(fig: go.Figure, path: str | Path, *, title: str = "") -> Path:
    """One figure as a self-contained HTML page with the report's gzip-compressed plotly.js
    (about a third of ``fig.write_html(include_plotlyjs=True)``); no network requests."""
    figures = _Figures()
    return write_page(path, title, [figures.add(fig, "")], figures, "compressed")


class _Figures:
    """Figure placeholders plus their JSON; one script renders them all once plotly.js is there."""

    def __init__(self) -> None:
        self.n = 0

    def add(self, fig: go.Figure, caption: str) -> str:
        i, self.n = self.n, self.n + 1
        spec = _script_json(fig.to_json())
        cap = f"<p class='caption'>{html.escape(caption)}</p>" if caption else ""
        return (
            f"<div id='fig{i}' class='el-figure'></div>"
            f"<script type='application/json' id='fig{i}-spec'>{spec}</script>{cap}"
        )

    def loader(self, plotlyjs: PlotlyJS) -> str:
        render = (
            "for(const el of document.querySelectorAll('div.el-figure')){"
            "const f=JSON.parse(document.getElementById(el.id+'-spec').textContent);"
            "await Plotly.newPlot(el,f.data,f.layout,{displaylogo:false,responsive:true});}"
        )
        if plotlyjs == "inline":
            return f"<script>{_plotly_js()}</script>\n<script>(async()=>{{{render}}})();</script>"
        return (
            f"<script id='plotly-gz' type='application/octet-stream'>{_plotly_gz()}</script>\n"
            "<script>(async()=>{if(!window.Plotly){"
            "const b=Uint8Array.from(atob(document.getElementById('plotly-gz').textContent),"
            "c=>c.charCodeAt(0));"
            "const s=new Blob([b]).stream().pipeThrough(new DecompressionStream('gzip'));"
            "(0,eval)(await new Response(s).text());}"
            f"{render}}})();</script>"
        )


@functools.cache
def _plotly_js() -> str:
    from plotly.offline import get_plotlyjs

    return get_plotlyjs()


@functools.cache
def _plotly_gz() -> str:
    return base64.b64encode(gzip.compress(_plotly_js().encode(), 9, mtime=0)).decode()


def _script_json(text: str) -> str:
    """JSON safe inside a ``<script>`` element: no ``<`` (so no ``</script>``) survives."""
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def adapter_line(adapter: Any) -> str | None:
    """``name: LoRA rank 16, alpha 32 (rsLoRA) on k_proj, q_proj`` for a result scored from a
    LoRA adapter (its metadata's ``adapter``, or a ``from_peft`` diff's metadata); ``None``
    for any other weight change."""
    if not isinstance(adapter, dict):
        return None
    info = adapter.get("peft", adapter)
    if not isinstance(info, dict) or "rank" not in info:
        return None
    name = adapter.get("name") or adapter.get("adapter") or "adapter"
    targets = info.get("target_modules")
    targets = ", ".join(targets) if isinstance(targets, list) else str(targets)
    ranks = info.get("ranks") or [info["rank"]]
    rank = "/".join(str(r) for r in ranks)
    extra = " (rsLoRA)" if info.get("use_rslora") else ""
    return f"{name}: LoRA rank {rank}, alpha {info.get('lora_alpha')}{extra} on {targets}"


def _summary(results: Sequence[ScoresView]) -> str:
    s = results[0]
    m = s.metadata
    facts = [
        ("model", m.get("model")),
        ("weight change", adapter_line(m.get("adapter"))),
        ("prompts", s.n_prompts),
        ("score kinds", ", ".join(s.kinds)),
        ("reward", f"{m.get('reward')} (scores in {score_unit(s)})"),
        ("convention", m.get("convention")),
        ("upstream ablation y*", m.get("ablation")),
        ("compute dtype", m.get("compute_dtype")),
    ]
    text = "; ".join(f"<b>{k}</b> {html.escape(str(v))}" for k, v in facts if v is not None)
    tokens = (m.get("prompt_tokens") or [[]])[0]
    example = f"<br><b>prompt 0</b> <code>{html.escape(''.join(tokens))}</code>" if tokens else ""
    for r in results:
        if r.partial:
            scope = ", ".join(
                f"{len(r.uncomputed(k))} of {r.totals.shape[1] * r.totals.shape[2]} {k}"
                for k in r.kinds
                if r.uncomputed(k)
            )
            example += (
                f"<br><b>partial {html.escape(r.method)} run</b>: components never computed "
                f"({html.escape(scope)}; top_k={r.metadata.get('top_k')}, "
                f"layers={r.metadata.get('layers')}) are grey, not zero, in every figure and "
                "table, and left out of the top lists and the comparison."
            )
    return f"<p class='summary'>{text}{example}</p>"


def _how_to_read(results: Sequence[ScoresView]) -> str:
    s = results[0]
    unit = score_unit(s)
    kinds = [k for k in KIND_MEANING if any(k in r.kinds for r in results)]
    items = [
        f"<b>Units and sign.</b> Every score is a change of the reward R, in {html.escape(unit)}, "
        "averaged over the prompts. <b>Positive (blue) means the component's part of the weight "
        "change helps the correct answer; negative (red) means it hurts it.</b>",
        *(f"<b>{k}</b>: {html.escape(KIND_MEANING[k])}." for k in kinds),
        "<b>Exact</b> scores patch activations (one experiment per component and token); "
        "<b>linear</b> scores are their first-order estimate from gradients; <b>integrated</b> "
        "scores average the gradient along the path of the change. Integrated upstream and "
        "downstream apply the exact patch gradually, so whole components equal the exact ones "
        "(up to the completeness error). <b>Integrated informative is a different quantity</b>: "
        "it shares R(W') − R(W) out along the joint path W + αΔ (every component changing at "
        "once), while exact informative changes one component's weights alone, the rest at W; "
        "their totals differ by design, and the verdicts below compare their ranking, not their "
        "values. A whole-component exact score patches every position at once, so it is not the "
        "sum of its per-token scores; a linear or integrated one is.",
        "<b>Per token.</b> A component's score at a position is the effect of patching only that "
        "position of its output. The x axes name each position by its role in the prompt "
        "template and the tokens found there (<code>{name}[-1]: Stewart, King, …</code> is the last "
        "token of the name slot); prompts are averaged role by role.",
        "<b>Attention</b> panels in the overview sum the heads of a layer; the heads × positions "
        "maps show each head. <b>Colour scales differ per panel</b>: compare colours within a "
        "panel, and read numbers on hover or in the tables.",
        "The definitions, with formulas: <code>docs/scores.md</code> in the extractive_lens "
        "repository (§4 exact, §5 linear, §6 positions, §10 figures, §11 trusting linear scores, "
        "§12 integrated).",
    ]
    return (
        "<h2>how to read this report</h2><ul class='howto'>"
        + "".join(f"<li>{i}</li>" for i in items)
        + "</ul>"
    )


def _what_to_trust(results: Sequence[ScoresView], comparison: Any) -> str:
    out = ["<h2>what to trust</h2>"]
    comparisons = comparison if isinstance(comparison, (list, tuple)) else [comparison]
    for comparison in [c for c in comparisons if c is not None]:
        a, b = ("exact" if m == "causal" else m for m in comparison.methods)
        says = "".join(
            f"<li><b>{html.escape(k)}</b>: {html.escape(v)}</li>"
            for k, v in comparison.verdicts.items()
        )
        if len(comparisons) > 1:
            out.append(f"<h3>{html.escape(a)} against {html.escape(b)}</h3>")
        out.append(
            f"<p class='caption'>Verdicts compare the {html.escape(a)} scores with the "
            f"{html.escape(b)} ones ({html.escape(comparison.level)} level, thresholds in "
            "docs/scores.md §11). <i>n_signal</i>: the cells where either is at least "
            f"{comparison.signal_fraction:.0%} of the largest |{html.escape(b)}|; Spearman and sign "
            "agreement count only those. <i>slope</i> and <i>rel_error</i> compare the values: "
            'a map that ranks well but has other values is marked "ranking only".</p>'
            f"<ul class='verdicts'>{says}</ul>"
        )
        cols = comparison.columns
        out.append(_table(comparison_rows(comparison), cols))
        if comparison.linear.n_prompts > 1:
            out.append(
                f"<p class='caption'>{', '.join(INTERVALS)}: the value and its "
                f"{INTERVAL_LEVEL:.0%} interval, a bootstrap of {INTERVAL_RESAMPLES} resamples "
                f"of the {comparison.linear.n_prompts} prompts (seed 0; "
                "<code>compare(...).ci()</code>: the same scores, no new passes).</p>"
            )
    for s in results:
        done = (s.metadata.get("integrated") or {}).get("completeness")
        if done:
            m = s.metadata["integrated"]
            errors = ", ".join(f"{k} {v:.2%}" for k, v in done.items())
            out.append(
                "<h3>completeness of the integrated scores</h3><p class='additivity'>"
                f"{m['steps']} {html.escape(m['rule'])} nodes along each {html.escape(m['path'])} "
                f"path; completeness error (how far the scores miss the change they integrate: "
                f"R(W') - R(W) for informative, the exact whole-component effects for the "
                f"others): {html.escape(errors)}.</p>"
            )
    notes = [s.additivity_note() for s in results if s.additivity_note()]
    if notes:
        out.append("<h3>additivity of the linear scores</h3>")
        out += [f"<p class='additivity'>{html.escape(n)}</p>" for n in notes]
    return "".join(out)


INTERVALS = ("pearson", "slope", "topk_overlap")
"""The comparison table's columns shown with their bootstrap intervals over prompts."""
INTERVAL_LEVEL, INTERVAL_RESAMPLES = 0.95, 200


def comparison_rows(comparison: Any) -> list[tuple[Any, ...]]:
    """A comparison's table rows (``comparison.columns``), r, slope and top-k overlap as
    ``value [low, high]`` (``INTERVALS``; ``ScoreComparison.ci`` over the prompts), where there
    are two prompts or more to resample."""
    cols = comparison.columns
    rows = [dict(r) for r in comparison.rows]
    if comparison.linear.n_prompts > 1:
        ci = comparison.ci(level=INTERVAL_LEVEL, n_boot=INTERVAL_RESAMPLES, seed=0,
                           statistics_=INTERVALS)  # fmt: skip
        found = {(r.kind, r.part, r.statistic): (r.low, r.high) for r in ci.itertuples()}
        for r in rows:
            for name in INTERVALS:
                low_high = found.get((r["kind"], r["part"], name))
                if low_high is not None and r[name] == r[name]:
                    lo, hi = _fmt(low_high[0]), _fmt(low_high[1])  # one line: no-break spaces
                    r[name] = f"{_fmt(float(r[name]))}\u00a0[{lo},\u00a0{hi}]"
    return [tuple(r[c] for c in cols) for r in rows]


def verified_section(rows: Sequence[tuple[Any, ...]]) -> str:
    """A verified result's estimates over the whole map, with their intervals (docs/scores.md
    §13), and each kind's verdict."""
    header = ("kind", "r [95% interval]", "slope", "missed exact mass", "exact + audited / integrated",
              "verdict")  # fmt: skip
    return (
        "<h3>verified: agreement over the whole map</h3><p class='caption'>Estimated from the "
        "exact scores of the components carrying the linear mass and of a random audit of all "
        "the others (stratified by depth and type); intervals from a bootstrap over prompts and "
        f"audited components (docs/scores.md §13).</p>{_table(rows, header)}"
    )


def flags_section(results: Sequence[ScoresView]) -> str:
    """The guards' flags of every result (``scores.flags``), or ``""`` when all are clean."""
    items = [
        f"<li><b>{html.escape(s.method)}</b> <code>{html.escape(f.what)}</code> "
        f"{html.escape(f.kind or 'positions')}: {html.escape(f.message)}</li>"
        for s in results
        for f in s.flags
    ]
    if not items:
        return ""
    return (
        "<h2>flags</h2><p class='caption'>Cells that cannot be right and roles that mix "
        "unlike positions (docs/scores.md §6, §11): read the flagged cells only once the cause "
        f"is removed.</p><ul class='flags'>{''.join(items)}</ul>"
    )


def _top_components(results: Sequence[ScoresView]) -> str:
    rows = []
    for s in results:
        # each total's 95% interval: a bootstrap over the prompts (``ci``), no new passes
        ci = s.ci("totals", n_boot=TOP_RESAMPLES, seed=0) if hasattr(s, "ci") else None
        for kind in s.kinds:
            cells = []
            for _, label, value in s.top(5, kind):
                c = Component.parse(label)
                hook = c.hook_name + ("" if c.head is None else f"[:, :, {c.head}]")
                where = (s.kind_index(kind), c.layer, s.component_labels.index(c.short_label))
                doubt = (
                    ""
                    if ci is None
                    else f" <small>[{_signed(float(ci.low[where]))}, "
                    f"{_signed(float(ci.high[where]))}]</small>"
                )
                cells.append(
                    f"<td><code>{html.escape(label)}</code> {_signed(value)}{doubt}<br>"
                    f"<small>{html.escape(hook)}</small></td>"
                )
            missing = len(s.uncomputed(kind))
            if missing:
                cells.append(f"<td class='uncomputed'>{missing} components not computed</td>")
            rows.append(
                f"<tr><th>{html.escape(s.method)}</th><th>{html.escape(kind)}</th>{''.join(cells)}</tr>"
            )
    unit = score_unit(results[0])
    return (
        "<h2>top components</h2><p class='caption'>The five largest whole-component scores of "
        f"each kind by magnitude, in {html.escape(unit)}, each with its 95% interval (a "
        f"bootstrap over the prompts, {TOP_RESAMPLES} resamples, seed 0: "
        "<code>scores.ci('totals')</code>) and the TransformerLens "
        "activation that holds the component's output (<code>Component.hook_name</code>)."
        f"{_informative_note(results)}</p>"
        "<table class='el'><tr><th>method</th><th>kind</th><th colspan='5'>top 5</th></tr>"
        + "".join(rows)
        + "</table>"
    )


TOP_RESAMPLES = 1000
"""Resamples of the top components' intervals."""


def _signed(x: float) -> str:
    """A score in a table: three decimals and its sign (``+3.178`` beside ``+0.746``)."""
    return f"{x:+.3f}" if x == 0 or abs(x) >= 1e-3 else f"{x:+.2e}"


def _informative_note(results: Sequence[ScoresView]) -> str:
    """What integrated informative totals are, where a table shows them beside exact ones."""
    if not any(r.method == "integrated" and "informative" in r.kinds for r in results):
        return ""
    return (
        " <b>Integrated informative</b> totals are shares of R(W') − R(W) along the joint path "
        "W + αΔ, not estimates of exact informative (one component changed alone): their "
        "values differ from exact's by design, their ranking need not."
    )


def _token_section(results: Sequence[ScoresView], views: list[tuple[str, Any]] | None) -> str:
    if views is not None:  # circuitsvis views, each in its own sandboxed frame
        parts = []
        for name, view in views:
            src = view.local_src if hasattr(view, "local_src") else str(view)
            doc = (
                f"<!DOCTYPE html><html><head><meta charset='utf-8'></head><body>{src}</body></html>"
            )
            parts.append(
                f"<h3>{html.escape(name)}</h3><iframe class='tokens' sandbox='allow-scripts' "
                f"style='width:100%;height:140px;border:0' srcdoc=\"{html.escape(doc, quote=True)}\">"
                "</iframe>"
            )
        return "<h2>token views</h2>" + "".join(parts)
    rows = [
        (s, kind, s.top(1, kind)[0][1])
        for s in results
        if s.per == "token"
        for kind in s.kinds
        if s.top(1, kind)  # a kind with no computed component has no row
    ]
    if not rows:
        return ""
    return (
        "<h2>token view: prompt 0</h2><p class='caption'>Each row is the top component of one "
        "kind; each cell its score at that token of prompt 0 (colour scaled per row, the value "
        "below the token, the role on hover).</p>" + token_table(rows, prompt=0)
    )


def token_table(rows: Sequence[tuple[ScoresView, ScoreKind, str]], prompt: int = 0) -> str:
    """An HTML table of per-token scores on one prompt: one row per ``(scores, kind, component)``
    (``component`` like ``"L3H2"`` or ``"L3MLP"``), one column per token, cells coloured by the
    score (blue helps the answer, red hurts it; one scale per row)."""
    first = rows[0][0]
    roles = first.prompt_roles[prompt]
    tokens = (first.metadata.get("prompt_tokens") or [list(roles)])[prompt][: len(roles)]
    head = "".join(
        f"<th title='{html.escape(r)}'>{html.escape(t.strip() or repr(t))}</th>"
        for t, r in zip(tokens, roles)
    )
    body = []
    for s, kind, label in rows:
        c = Component.parse(label)
        v = s.prompt_values[s.kind_index(kind), prompt, c.layer]
        vals = v[s.component_labels.index(c.short_label), : len(roles)].double().tolist()
        lim = max((abs(x) for x in vals if x == x), default=0.0) or 1.0
        cells = "".join(
            f"<td title='{html.escape(role)}: {x:+.4g}' style='background:{score_rgba(x / lim, 0.8)}'>"
            f"<small>{_cell(x, lim)}</small></td>"
            if x == x
            else f"<td title='{html.escape(role)}: not computed' style='background:{UNCOMPUTED}'>"
            "<small>n/c</small></td>"
            for x, role in zip(vals, roles)
        )
        body.append(f"<tr><th>{html.escape(f'{s.method} {kind} {label}')}</th>{cells}</tr>")
    return f"<table class='el tokens'><tr><th></th>{head}</tr>{''.join(body)}</table>"


def _metadata(results: Sequence[ScoresView]) -> str:
    flat = [_flatten(jsonable(s.metadata)) for s in results]
    keys = list(dict.fromkeys(k for f in flat for k in f))
    rows = [(k, *(f.get(k, "") for f in flat)) for k in keys]
    raw = {s.method: {k: v for k, v in s.metadata.items() if k != "prompt_tokens"} for s in results}
    return (
        "<h2>metadata</h2>"
        + _table(rows, ("setting", *(s.method for s in results)))
        + "<details><summary>as JSON (without the prompt tokens)</summary><pre>"
        + html.escape(json.dumps(jsonable(raw), indent=1))
        + "</pre></details>"
    )


def _flatten(meta: dict[str, Any], prefix: str = "") -> dict[str, str]:
    out: dict[str, str] = {}
    for k, v in meta.items():
        key = f"{prefix}{k}"
        if k == "prompt_tokens" and isinstance(v, list):
            out[key] = f"{len(v)} prompts (the token view shows prompt 0)"
        elif isinstance(v, dict):
            out.update(_flatten(v, key + "."))
        elif isinstance(v, list) and v and isinstance(v[0], list):
            out[key] = f"{len(v)} × {len(v[0])} table (JSON below)"
        elif isinstance(v, list) and len(v) > 6:
            shown = ", ".join(f"{x:.4g}" if isinstance(x, float) else str(x) for x in v[:4])
            out[key] = f"{len(v)} values: {shown}, … (JSON below)"
        elif isinstance(v, float):
            out[key] = f"{v:.6g}"
        else:
            out[key] = str(v)
    return out


def _table(rows: Sequence[tuple[Any, ...]], header: tuple[str, ...]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(_fmt(c))}</td>" for c in r) + "</tr>" for r in rows
    )
    return f"<table class='el'><tr>{head}</tr>{body}</table>"


def _fmt(x: Any) -> str:
    """A table cell: floats with three decimals (``1.000`` beside ``0.999``, never ``+1``)."""
    if isinstance(x, float) and x != x:
        return "n/a"  # not measured (e.g. top-k overlap of a top-k run)
    if isinstance(x, float):
        return f"{x:.3f}" if x == 0 or 1e-3 <= abs(x) < 1e5 else f"{x:.3g}"
    return str(x)


def _cell(x: float, lim: float) -> str:
    """One token-view value, with the decimals that show two digits of the row's largest
    ``lim``; a value that rounds to zero there (a structural zero, float noise) reads ``0``."""
    import math

    decimals = max(0, 1 - math.floor(math.log10(lim)))
    shown = f"{x:+.{decimals}f}"
    return "0" if float(shown) == 0 else shown

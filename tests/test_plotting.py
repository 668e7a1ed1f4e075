"""Figure contents, self-contained HTML and escaping."""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest
import torch

from extractive_lens import WeightDiff, causal_scores, compare, linear_scores, make_batch
from extractive_lens.backend import parameters
from extractive_lens.batch import Pair
from extractive_lens.plotting import comparison_plot, heatmap, overview, report
from tests.conftest import make_pair


@pytest.fixture(scope="module")
def scored(text_model):
    base = text_model
    ft = make_pair("ln_gelu", torch.float64)[1]  # only to get a random perturbation pattern
    del ft
    gen = torch.Generator().manual_seed(5)
    sd_b = {n: p.detach() for n, p in parameters(base).items()}
    sd_f = {  # not b_U: TransformerLens 4's native bridge holds it as a fixed buffer
        n: p + (n != "unembed.b_U") * 0.05 * torch.randn(p.shape, generator=gen, dtype=p.dtype)
        for n, p in sd_b.items()
    }
    diff = WeightDiff.from_state_dicts(sd_b, sd_f, signature=WeightDiff.zeros_like(base).signature)
    evil = "<script>alert(1)</script>"
    pairs = [
        Pair(
            f"John Doe {evil} lives in",
            " Tokyo",
            template="{name} " + evil + " lives in",
            slots={"name": "John Doe"},
        ),
        Pair(
            f"Ann Lee {evil} lives in",
            " Paris",
            template="{name} " + evil + " lives in",
            slots={"name": "Ann Lee"},
        ),
    ]
    batch = make_batch(base, pairs)
    lin = linear_scores(base, diff, batch)
    ex = causal_scores(base, diff, batch)
    return lin, ex, (base, diff, batch)


def test_heatmap_contents(scored):
    lin, *_ = scored
    fig = heatmap(lin, "informative", part="mlp")
    tr = fig.data[0]
    assert np.allclose(np.array(tr.z), lin["informative"][:, -1, :].numpy())
    assert list(tr.x) == list(lin.position_labels) and len(set(tr.x)) == len(tr.x)
    assert list(tr.y) == [f"L{i}" for i in range(lin.n_layers)]  # layer 0 first = bottom
    assert tr.zmid == 0 and tr.zmin == -tr.zmax
    attn = heatmap(lin, "upstream", part="attn").data[0]
    assert np.allclose(np.array(attn.z), lin["upstream"][:, :-1, :].sum(1).numpy())
    heads = heatmap(lin, "downstream", part="heads", position=lin.position_labels[-1]).data[0]
    assert np.allclose(np.array(heads.z), lin["downstream"][:, :-1, -1].numpy())
    assert "score" in tr.hovertemplate and "layer" in tr.hovertemplate


def test_side_by_side_shares_one_colour_scale(scored):
    """The Fig. 5 view: one panel per result, each its own data, one colour scale for all."""
    from extractive_lens.plotting import side_by_side

    lin, ex, _ = scored
    fig = side_by_side({"linear": lin, "exact": ex}, "downstream", part="attn")
    a, b = fig.data
    assert np.allclose(np.array(a.z), lin["downstream"][:, :-1, :].sum(1).numpy())
    assert np.allclose(np.array(b.z), ex["downstream"][:, :-1, :].sum(1).numpy())
    lim = max(np.abs(np.array(a.z)).max(), np.abs(np.array(b.z)).max())
    assert a.zmax == b.zmax == pytest.approx(lim) and a.zmin == -a.zmax
    assert [t.showscale for t in fig.data] == [False, True]
    assert [x.text.split(" ·")[0] for x in fig.layout.annotations] == ["linear", "exact"]
    with pytest.raises(ValueError, match="at least one"):
        side_by_side({})
    with pytest.raises(ValueError, match="'mlp' or 'attn'"):
        side_by_side({"a": lin}, part="heads")


def test_overview_and_comparison(scored):
    lin, ex, _ = scored
    fig = overview(lin)
    assert len(fig.data) == 6
    for t in fig.data:
        assert t.zmid == 0
    cmp = compare(lin, ex)
    cf = comparison_plot(cmp)
    assert any(t.mode == "lines" for t in cf.data)
    assert "r = " in cf.layout.annotations[0].text
    pts = [t for t in cf.data if t.mode == "markers"]
    assert sum(len(t.x) for t in pts) == sum(r["n"] for r in cmp.rows if r["part"] == "all")


def test_report_self_contained_and_escaped(scored, tmp_path):
    lin, ex, _ = scored
    path = report([lin, ex], compare(lin, ex), path=tmp_path / "r.html")
    text = path.read_text()
    assert not re.search(r"""src=["']https?://""", text)
    assert "<script>alert(1)</script>" not in text
    assert text.count("id='plotly-gz'") == 1 and "plotly.js v" not in text  # once, compressed
    assert path.stat().st_size < 2_500_000  # plotly.js alone is 4.6 MB uncompressed
    for section in ("how to read this report", "what to trust", "top components", "metadata"):
        assert f"<h2>{section}</h2>" in text
    assert "blocks.1.hook_mlp_out" in text and "Δ log p(answer), nats" in text
    assert "<td>prompts_digest</td>" in text  # metadata as a table, not a JSON dump
    inline = report(lin, path=tmp_path / "inline.html", plotlyjs="inline").read_text()
    assert inline.count("plotly.js v") <= 2 and "plotly-gz" not in inline


def test_report_figures_are_the_figures(scored, tmp_path):
    """The JSON each placeholder renders is the figure itself (overview first, heads maps next)."""
    import base64
    import json

    lin, *_ = scored
    text = report(lin, path=tmp_path / "r.html").read_text()
    specs = re.findall(r"<script type='application/json' id='fig(\d+)-spec'>(.*?)</script>", text)
    assert [int(i) for i, _ in specs] == list(range(1 + len(lin.kinds)))

    def z_of(spec: str) -> np.ndarray:  # plotly 6 writes arrays as {"dtype", "bdata", "shape"}
        z = json.loads(spec)["data"][0]["z"]
        if isinstance(z, dict):
            flat = np.frombuffer(base64.b64decode(z["bdata"]), dtype=z["dtype"])
            return flat.reshape([int(n) for n in str(z["shape"]).split(",")])
        return np.array(z)

    assert np.allclose(z_of(specs[0][1]), lin["informative"][:, -1, :].numpy())
    n_heads = len(lin.component_labels) - 1
    assert np.allclose(
        z_of(specs[2][1]),  # upstream, every head
        lin["upstream"][:, :-1, :].reshape(lin.n_layers * n_heads, -1).numpy(),
    )


def test_every_head_map_and_position_ticks(scored):
    lin, *_ = scored
    fig = heatmap(lin, "downstream", part="all_heads")
    tr = fig.data[0]
    n_heads = len(lin.component_labels) - 1
    assert list(tr.y)[: n_heads + 1] == [f"L0H{h}" for h in range(n_heads)] + ["L1H0"]
    layer, head, pos = 1, 2, 3
    assert tr.z[layer * n_heads + head][pos] == pytest.approx(
        float(lin["downstream"][layer, head, pos])
    )
    ticks = dict(zip(fig.layout.xaxis.tickvals, fig.layout.xaxis.ticktext))
    name = ticks["{name}[-1]"]
    last = {
        p: lin.metadata["prompt_tokens"][p][lin.prompt_roles[p].index("{name}[-1]")] for p in (0, 1)
    }
    assert name == "{name}[-1]: " + ", ".join(t.strip() for t in last.values())  # e.g. "e, Lee"
    assert ticks["lives"] == "lives"  # a template word is its own token
    import dataclasses

    same = [list(lin.metadata["prompt_tokens"][0])] * 2  # one token at every role
    one = dataclasses.replace(
        lin,
        prompt_roles=(lin.prompt_roles[0],) * 2,
        metadata={**lin.metadata, "prompt_tokens": same},
    )
    assert one.position_ticks()[list(lin.position_labels).index("{name}[-1]")] == (
        "{name}[-1]: " + last[0].strip()
    )
    assert fig.layout.xaxis.title.text and fig.layout.yaxis.title.text
    assert "Lee" in str(tr.customdata[0][list(lin.position_labels).index("{name}[-1]")])


def test_heads_slider_and_experiment_figures(scored):
    import pandas as pd

    from extractive_lens.plotting import heads_by_position, rank_curves, table_heatmap

    lin, *_ = scored
    fig = heads_by_position(lin, "informative")
    assert len(fig.data) == len(lin.position_labels) and len(fig.layout.sliders[0].steps) == len(
        fig.data
    )
    p = 2
    assert np.allclose(np.array(fig.data[p].z), lin["informative"][:, :-1, p].numpy())
    assert sum(bool(t.visible) for t in fig.data) == 1
    df = pd.DataFrame(
        {
            "epoch": [0, 1, 2, 0, 1, 2],
            "split": ["facts"] * 3 + ["implications"] * 3,
            "mean_rank": [9.0, 2.0, 0.0, 9.5, 6.0, 4.0],
        }
    )
    rc = rank_curves(df, chance=9.5)
    assert [t.name for t in rc.data] == ["facts", "implications"] and list(rc.data[1].y) == [
        9.5,
        6.0,
        4.0,
    ]
    tab = pd.DataFrame(
        {
            "reverted": ["None", "None", "Early", "Early"],
            "split": ["fact", "impl"] * 2,
            "mean_rank": [0.0, 1.8, 5.1, 8.4],
        }
    )
    th = table_heatmap(tab, index="reverted", columns="split", values="mean_rank")
    assert np.allclose(np.array(th.data[0].z), [[0.0, 1.8], [5.1, 8.4]])
    assert th.data[0].text[1][1] == "8.40"


def test_token_and_attention_views(scored, text_model):
    from extractive_lens import make_batch
    from extractive_lens.plotting import attention_view, token_view

    lin, *_ = scored
    view = token_view(lin, "informative", "L1MLP", prompt=0)
    src = view.local_src
    from circuitsvis.tokens import colored_tokens

    bundle = colored_tokens(["a"], [0.0]).local_src  # the circuitsvis bundle alone
    evil = "<script>alert(1)</script>"
    assert src.count(evil) == bundle.count(evil)
    assert ("\\u2039" in src or "\u2039" in src) and "</script" not in src.split("ColoredTokens")[
        -1
    ][:-20]
    n = len(lin.prompt_roles[0])
    want = lin.prompt_values[0, 0, 1, -1, :n].tolist()
    assert all(f"{v:.6g}"[:6] in src or abs(v) < 1e-12 for v in want[:3])
    batch = make_batch(text_model, [("John Doe lives in", " Tokyo")])
    att = attention_view(text_model, batch, layer=1, heads=[0, 2])
    with torch.no_grad():
        _, cache = text_model.run_with_cache(batch.tokens)
    pattern = cache["blocks.1.attn.hook_pattern"][0, [0, 2]]
    assert f"{float(pattern[1, 3, 2]):.6g}"[:6] in att.local_src


def test_notebook_renderer_keeps_a_picture_when_it_can(monkeypatch):
    import plotly.graph_objects as go
    import plotly.io as pio

    from extractive_lens.plotting import notebook_renderer

    monkeypatch.setattr(pio.renderers, "default", pio.renderers.default)
    name = notebook_renderer()
    assert pio.renderers.default == name
    try:
        go.Figure().to_image(format="png", width=10, height=10)
        can = True
    except Exception:
        can = False
    assert name == ("plotly_mimetype+png" if can else "plotly_mimetype+notebook")


def test_partial_runs_show_not_computed_never_zero(scored, tmp_path):
    """An exact run over one layer: the other layer's cells are NaN in the figures (grey
    background, a 'not computed' note; a zero-filled map would be white and note-free), the
    comparison leaves them out, and its top-k overlap is not claimed for a top-k run."""
    from extractive_lens.results import UNCOMPUTED

    lin, ex_full, (base, diff, batch) = scored
    part = causal_scores(base, diff, batch, layers=[1], show_progress=False)
    z = np.array(heatmap(part, "informative", part="mlp").data[0].z, dtype=float)
    assert np.isnan(z[0]).all() and np.isfinite(z[1]).all()
    assert np.allclose(z[1], ex_full["informative"][1, -1].numpy())
    for fig in (heatmap(part, "informative", part="mlp"), overview(part)):
        assert fig.layout.plot_bgcolor == UNCOMPUTED and "not computed" in fig.layout.title.text
    assert heatmap(ex_full, "informative").layout.plot_bgcolor != UNCOMPUTED
    attn = np.array(heatmap(part, "upstream", part="attn").data[0].z, dtype=float)
    assert np.isnan(attn[0]).all() and np.allclose(attn[1], ex_full["upstream"][1, :-1].sum(0))
    cmp = compare(lin, part)
    n_cells = len(lin.position_labels) * len(lin.component_labels)
    assert all(r["n"] == n_cells for r in cmp.rows if r["part"] == "all")  # layer 1 only
    top = causal_scores(base, diff, batch, top_k=3, linear=lin)
    assert all(r["topk_overlap"] != r["topk_overlap"] for r in compare(lin, top).rows)
    html = report([lin, part], compare(lin, part), path=tmp_path / "p.html").read_text()
    assert "partial causal run" in html and "components not computed" in html


def test_report_says_what_integrated_informative_totals_mean(scored, tmp_path):
    """The "how to read" section and the verdicts: integrated informative is not exact's."""
    lin, ex, _ = scored
    text = report([lin, ex], compare(lin, ex), path=tmp_path / "r.html").read_text()
    how = text[text.index("how to read this report") : text.index("what to trust")]
    assert "Integrated informative is a different quantity" in how and "joint path" in how
    assert "add up to the change and to the exact whole-component scores" not in how
    trust = text[text.index("what to trust") :]
    assert "n_signal" in trust and "ranking only" in trust
    ig = dataclasses.replace(lin, method="integrated")  # the table's note names what its totals are
    top = report([ig, ex], compare(ig, ex), path=tmp_path / "i.html").read_text()
    top = top[top.index("<h2>top components</h2>") :]
    assert "Integrated informative</b> totals are shares of R(W') − R(W)" in top[:2000]


def test_tables_and_token_view_format_numbers_one_way():
    from extractive_lens.report import _cell, _fmt

    assert [_fmt(x) for x in (1.0, 0.9991, -0.5644, 0.0)] == ["1.000", "0.999", "-0.564", "0.000"]
    assert _cell(-3.6e-10, 3.18) == "0" and _cell(3.178, 3.18) == "+3.2"
    assert _cell(0.36, 3.18) == "+0.4" and _cell(-0.04, 3.18) == "0"
    assert _cell(0.0123, 0.05) == "+0.012" and _cell(-0.049, 0.05) == "-0.049"


def test_overview_rows_leave_room_for_rotated_tick_labels(scored, monkeypatch):
    """The rotated position labels under one row of panels end above the next row's subplot
    title (they collided on a partial report): the gap between rows, in pixels, holds the
    longest label's vertical extent plus a title line, for the fixture's labels and long ones."""
    import math

    from extractive_lens.plotting import overview
    from extractive_lens.results import ComponentScores

    lin, ex, (base, diff, batch) = scored
    part = causal_scores(base, diff, batch, layers=[1], show_progress=False)
    figures = [overview(lin), overview(part)]
    monkeypatch.setattr(  # a slot whose tokens are long words: "{name}[-1]: Constantinople, …"
        ComponentScores, "position_ticks",
        lambda self, examples=2: [f"{p}: Constantinople, Bartholomew, …" for p in self.position_labels],
    )  # fmt: skip
    figures += [overview(lin), overview(part)]
    for fig in figures:
        margin = fig.layout.margin
        plot_px = (
            fig.layout.height
            - (margin.t if margin.t is not None else 100)
            - (margin.b if margin.b is not None else 80)
        )
        top, below = fig.layout.yaxis.domain, fig.layout[f"yaxis{1 + len(fig.data) // 3}"].domain
        gap_px = (top[0] - below[1]) * plot_px
        longest = max(len(t) for t in fig.layout.xaxis.ticktext)
        labels_px = longest * 0.6 * 12 * math.sin(math.radians(40))
        assert gap_px >= labels_px + 40, (gap_px, labels_px)


def test_top_components_print_one_format_and_say_what_integrated_informative_is():
    from extractive_lens.report import _informative_note, _signed

    got = [_signed(x) for x in (3.178, 0.746, 1.1, -0.0005)]
    assert got == ["+3.178", "+0.746", "+1.100", "-5.00e-04"]
    assert _informative_note([]) == ""


def test_report_comparison_tables_show_r_slope_and_overlap_with_intervals(scored, tmp_path):
    """Each comparison row's r, slope and top-k overlap as `value [low, high]`: compare().ci()'s
    bootstrap over the prompts (its seed and resamples), beside the row's own value."""
    import html as html_

    from extractive_lens.report import INTERVAL_RESAMPLES, INTERVALS

    lin, ex, _ = scored
    cmp = compare(lin, ex)
    text = report([lin, ex], cmp, path=tmp_path / "r.html").read_text()
    ci = cmp.ci(n_boot=INTERVAL_RESAMPLES, seed=0, statistics_=INTERVALS)
    cells = [html_.unescape(c) for c in re.findall(r"<td>([^<]*)</td>", text)]
    shown = 0
    for row in ci.itertuples():
        est = next(r[row.statistic] for r in cmp.rows if (r["kind"], r["part"]) == (row.kind,
                                                                                    row.part))  # fmt: skip
        assert row.estimate == pytest.approx(est)
        want = f"{est:.3f}\u00a0[{row.low:.3f},\u00a0{row.high:.3f}]".replace("-0.000", "0.000")
        assert want in cells or want.replace("0.000", "-0.000") in cells, want
        shown += 1
    assert shown >= 2 * len(cmp.rows)  # r and slope on every row (overlap where it has one)
    assert "bootstrap of 200 resamples" in text


def test_report_top_components_carry_their_intervals(scored, tmp_path):
    """Each top component's total beside its 95% interval over the prompts: ``ci("totals")``'s
    (tests/test_stats.py checks those against a literal resampling loop), for that component."""
    from extractive_lens.report import TOP_RESAMPLES, _signed

    lin, ex, _ = scored
    text = report([lin, ex], path=tmp_path / "r.html").read_text()
    top = text[
        text.index("<h2>top components</h2>") : text.index(
            "</table>", text.index("<h2>top components</h2>")
        )
    ]
    assert "95% interval" in top
    for s in (lin, ex):
        ci = s.ci("totals", n_boot=TOP_RESAMPLES, seed=0)
        for kind in s.kinds:
            k = s.kind_index(kind)
            for _, label, value in s.top(5, kind):
                layer = int(label[1 : label.index("H" if "H" in label[1:] else "M")])
                comp = s.component_labels.index(label[len(f"L{layer}") :])
                low, high = float(ci.low[k, layer, comp]), float(ci.high[k, layer, comp])
                cell = f"{_signed(value)} <small>[{_signed(low)}, {_signed(high)}]</small>"
                assert f"<code>{label}</code> {cell}" in top, (label, cell)

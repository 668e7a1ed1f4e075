"""Figure contents, self-contained HTML and escaping."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from extractive_lens import WeightDiff, causal_scores, compare, linear_scores, make_batch
from extractive_lens.batch import Pair
from extractive_lens.plotting import comparison_plot, heatmap, overview, report
from tests.conftest import make_pair


@pytest.fixture(scope="module")
def scored(text_model):
    base = text_model
    ft = make_pair("ln_gelu", torch.float64)[1]  # only to get a random perturbation pattern
    del ft
    gen = torch.Generator().manual_seed(5)
    sd_b = {n: p.detach() for n, p in base.named_parameters()}
    sd_f = {
        n: p + 0.05 * torch.randn(p.shape, generator=gen, dtype=p.dtype) for n, p in sd_b.items()
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
    return lin, ex


def test_heatmap_contents(scored):
    lin, _ = scored
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


def test_overview_and_comparison(scored):
    lin, ex = scored
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
    lin, ex = scored
    path = report([lin, ex], compare(lin, ex), path=tmp_path / "r.html")
    text = path.read_text()
    assert not re.search(r"""src=["']https?://""", text)
    assert "<script>alert(1)</script>" not in text
    assert text.count("plotly.js v") <= 2  # embedded once (the bundle names itself in a comment)
    assert "top components" in text and "linear vs exact" in text


def test_heads_slider_and_experiment_figures(scored):
    import pandas as pd

    from extractive_lens.plotting import heads_by_position, rank_curves, table_heatmap

    lin, _ = scored
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

    lin, _ = scored
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

"""The HTML report in a real headless browser (Debian's chromium via Playwright): every plot
renders, hover data is there, no console errors and no network requests. Saves a screenshot."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import pytest

from tests.test_plotting import scored  # noqa: F401  (fixture)

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-quic",
]

pytestmark = pytest.mark.skipif(
    CHROMIUM is None, reason="no chromium on this machine (.ci/run installs it)"
)


def test_report_renders_in_chromium(scored, tmp_path):  # noqa: F811
    sync_api = pytest.importorskip("playwright.sync_api")
    from extractive_lens import compare
    from extractive_lens.plotting import report

    lin, ex, _ = scored
    path = report([lin, ex], compare(lin, ex), path=tmp_path / "report.html")
    expected = len(re.findall(r"class='el-figure'", path.read_text()))
    assert expected >= 9
    requests, errors = [], []
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS, headless=True)
        page = browser.new_page(viewport={"width": 1280, "height": 1600})
        page.on("request", lambda r: requests.append(r.url))
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(path.as_uri())
        page.wait_for_function(
            f"window.Plotly && document.querySelectorAll('.js-plotly-plot .main-svg').length >= {expected}",
            timeout=60_000,
        )
        rendered = page.evaluate("document.querySelectorAll('.js-plotly-plot').length")
        template = page.evaluate(
            "document.querySelectorAll('.js-plotly-plot')[0].data[0].hovertemplate"
        )
        drag = page.locator(".js-plotly-plot").first.locator(".nsewdrag").first
        drag.scroll_into_view_if_needed()
        box = drag.bounding_box()
        page.mouse.move(box["x"] + box["width"] / 2, box["y"] + box["height"] / 2)
        page.wait_for_selector(".hoverlayer .hovertext", timeout=10_000)
        hover = {
            "template": template,
            "hovertext": page.evaluate("document.querySelectorAll('.hovertext').length"),
            "text": page.evaluate("document.querySelector('.hoverlayer .hovertext').textContent"),
        }
        axis_titles = page.evaluate(
            "[...document.querySelectorAll('.js-plotly-plot')[0].querySelectorAll('text')]"
            ".filter(e => /^[xy]\\d*title$/.test(e.getAttribute('class'))).map(e => e.textContent)"
        )
        ticks = page.evaluate(
            "[...document.querySelectorAll('.js-plotly-plot')[0].querySelectorAll('.xtick text')]"
            ".map(e => e.textContent)"
        )
        shot = tmp_path / "report.png"
        page.screenshot(path=str(shot), full_page=False)
        browser.close()
    assert rendered == expected
    assert "layer" in axis_titles and any("token position" in t for t in axis_titles)
    assert "lives" in ticks and any(t.startswith("{name}[-1]: ") and "Lee" in t for t in ticks)
    assert "score" in hover["template"] and hover["hovertext"] >= 1
    assert "layer" in hover["text"] and "score" in hover["text"]
    assert errors == [], errors
    page_text = path.read_text()
    assert (
        "linear informative" in page_text and "additivity of the linear scores" in page_text
    )  # verdicts, check
    external = [u for u in requests if not u.startswith(("file:", "data:", "about:", "blob:"))]
    assert external == [], external
    assert shot.stat().st_size > 10_000
    out = os.environ.get("EL_SCREENSHOT_DIR")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        shutil.copy(shot, Path(out) / "report.png")


def test_trajectory_slider_label_clears_the_play_button_and_the_axis(tmp_path):
    """The report's per-epoch slider: its "epoch k" label, the play button, the slider and the
    heat map's axis title each have their own room (the label sat under the button, cramped)."""
    sync_api = pytest.importorskip("playwright.sync_api")
    import torch

    import extractive_lens as el
    from extractive_lens import trajectory_plots as tp
    from tests.conftest import make_pair
    from tests.helpers import small_batch

    base, ft = make_pair("ln_gelu", torch.float32)
    diff = el.WeightDiff.from_models(base, ft)
    traj = el.Trajectory.from_diffs([diff * 0.25, diff * 0.5, diff])
    maps = el.trajectory_scores(base, traj, small_batch(base), kinds="informative")
    path = tmp_path / "t.html"
    path.write_text(tp.slider(maps).to_html(include_plotlyjs=True, auto_play=False))
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS, headless=True)
        page = browser.new_page(viewport={"width": 900, "height": 700})
        page.goto(path.as_uri())
        page.wait_for_selector(".slider-rail-rect", timeout=60_000)
        boxes = {
            name: page.evaluate(
                f"(() => {{const r = document.querySelector('{sel}').getBoundingClientRect();"
                " return {x: r.x, y: r.y, width: r.width, height: r.height}})()"
            )
            for name, sel in (("label", ".slider-group > .slider-label"),  # "epoch k"
                              ("button", ".updatemenu-button"), ("rail", ".slider-rail-rect"),
                              ("axis", ".xtitle"))
        }  # fmt: skip
        label = page.evaluate("document.querySelector('.slider-group > .slider-label').textContent")
        browser.close()

    def apart(a, b):
        return (a["x"] + a["width"] <= b["x"] or b["x"] + b["width"] <= a["x"]
                or a["y"] + a["height"] <= b["y"] or b["y"] + b["height"] <= a["y"])  # fmt: skip

    assert label == "epoch 1"
    for a, b in (("label", "button"), ("label", "axis"), ("rail", "axis"), ("button", "axis")):
        assert apart(boxes[a], boxes[b]), (a, b, boxes)

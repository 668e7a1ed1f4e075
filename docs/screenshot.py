"""Screenshot an HTML report in headless Chromium: ``python docs/screenshot.py report.html docs/report.png``."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from playwright.sync_api import sync_playwright

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


def main(src: str, dst: str, scroll_to: str | None = None) -> None:
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=shutil.which("chromium"), args=FLAGS)
        page = browser.new_page(viewport={"width": 1280, "height": 1400})
        page.goto(Path(src).resolve().as_uri())
        page.wait_for_function(
            "window.Plotly && document.querySelectorAll('.js-plotly-plot .main-svg').length > 0"
        )
        if scroll_to:
            page.locator(scroll_to).first.scroll_into_view_if_needed()
        page.wait_for_timeout(500)
        page.screenshot(path=dst)
        browser.close()


if __name__ == "__main__":
    main(*sys.argv[1:])

"""The README is a front page that stays true: at most 200 lines, every link resolves, and its
example runs (on tiny checkpoints written where it looks for them)."""

from __future__ import annotations

import importlib.util
import os
import re
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def _example_module():
    spec = importlib.util.spec_from_file_location(
        "readme_example", ROOT / "scripts" / "readme_example.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_readme_is_a_front_page_with_links_that_resolve():
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 200
    for target in re.findall(r"\]\(([^)]+)\)", text):
        if not target.startswith(("http://", "https://", "#")):
            assert (ROOT / target.split("#")[0]).exists(), target


def test_readme_example_runs(tmp_path, monkeypatch):
    example = _example_module()
    example.write_checkpoints(tmp_path)
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "__readme__"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        exec(compile(example.example_code(), str(README), "exec"), namespace)
    assert (tmp_path / "report.html").stat().st_size > 100_000
    lin, ex, cmp = namespace["lin"], namespace["ex"], namespace["cmp"]
    assert lin["informative"].shape[1] == namespace["base"].cfg.n_heads + 1
    assert {r["kind"] for r in cmp.rows} == set(lin.kinds) == set(ex.kinds)
    assert os.path.exists(tmp_path / "runs" / "base" / "config.json")

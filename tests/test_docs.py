"""The pages stay true: what can be checked about every Markdown page without running it.

Tables render (a blank line before them: Markdown otherwise shows the pipes as text, and
``mkdocs --strict`` does not notice); no page carries a count that rots (how many tests); no
page promises what it does not hold; every copy of the README's example is the README's (which
``tests/test_readme.py`` runs); every ``§N`` cited exists in docs/scores.md; every ``el.name``
in a page's Python exists in the package, and every Python block parses.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted(
    [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *(ROOT / "docs").rglob("*.md")],
    key=lambda p: str(p),
)
FENCE = re.compile(r"^```")


def _ids(pages):
    return [str(p.relative_to(ROOT)) for p in pages]


def _prose(text: str) -> list[tuple[int, str]]:
    """The lines outside fenced code blocks, numbered from 1."""
    out, inside = [], False
    for i, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line.strip()):
            inside = not inside
            continue
        if not inside:
            out.append((i, line))
    return out


def _blocks(text: str, lang: str = "python") -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", text, flags=re.S | re.M)


@pytest.mark.parametrize("page", PAGES, ids=_ids(PAGES))
def test_tables_have_a_blank_line_before_them(page):
    lines = page.read_text(encoding="utf-8").splitlines()
    prose = dict(_prose(page.read_text(encoding="utf-8")))
    for i, line in prose.items():
        starts = line.startswith("|") and (i - 1 not in prose or not prose[i - 1].startswith("|"))
        if starts and i > 1:
            assert lines[i - 2].strip() == "", f"{page.name}:{i}: a table right after text"


@pytest.mark.parametrize("page", PAGES, ids=_ids(PAGES))
def test_no_page_carries_a_count_that_rots_or_a_promise(page):
    text = page.read_text(encoding="utf-8")
    for i, line in _prose(text):
        assert not re.search(r"\b\d[\d,]* tests\b", line), f"{page.name}:{i}: a test count"
        for promise in ("being built", "numbers below", "coming soon", "TODO"):
            assert promise not in line, f"{page.name}:{i}: {promise!r}"
    for block in _blocks(text, "bash"):
        assert not re.search(r"\b\d[\d,]* tests\b", block), f"{page.name}: a test count"


def test_every_copy_of_the_readme_example_is_the_readme_s():
    marker = re.compile(r"<!-- readme-example -->\n```python\n(.*?)```", re.S)
    (original,) = marker.findall((ROOT / "README.md").read_text(encoding="utf-8"))
    copies = {p.name: marker.findall(p.read_text(encoding="utf-8")) for p in PAGES}
    assert sum(len(c) for c in copies.values()) >= 2  # the README's and Getting started's
    for name, found in copies.items():
        assert all(c == original for c in found), f"{name}: its copy of the README example drifted"


def test_every_section_cited_exists():
    scores = (ROOT / "docs" / "scores.md").read_text(encoding="utf-8")
    have = set(re.findall(r"^## §(\d+)\b", scores, flags=re.M))
    sources = [*PAGES, *(ROOT / "extractive_lens").rglob("*.py")]
    for path in sources:
        for n in re.findall(r"§\s?(\d+)", path.read_text(encoding="utf-8")):
            assert n in have, f"{path.name} cites §{n}, which docs/scores.md does not have"


@pytest.mark.parametrize("page", PAGES, ids=_ids(PAGES))
def test_python_blocks_parse_and_name_what_exists(page):
    import extractive_lens as el

    for block in _blocks(page.read_text(encoding="utf-8")):
        if block.lstrip().startswith(">>>"):
            continue  # a session transcript: make doctest's business
        ast.parse(block)  # a SyntaxError names the page in the traceback
        for name in re.findall(r"\bel\.([A-Za-z_]\w*)", block):
            assert hasattr(el, name), f"{page.name}: el.{name} does not exist"


def test_tests_and_notebooks_pin_one_torch_thread(monkeypatch):
    """conftest's hook sets one thread whatever torch started with; every notebook's first code
    cell does the same (docs/getting-started.md says why)."""
    import importlib.util
    import json

    import torch

    before = torch.get_num_threads()
    spec = importlib.util.spec_from_file_location("root_conftest", ROOT / "conftest.py")
    assert spec is not None and spec.loader is not None
    root = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(root)
    monkeypatch.delenv("EL_TORCH_THREADS", raising=False)
    try:
        torch.set_num_threads(2)
        root.pytest_configure(None)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    for nb in sorted((ROOT / "examples").glob("*.ipynb")):
        cells = json.loads(nb.read_text(encoding="utf-8"))["cells"]
        first = next(c for c in cells if c["cell_type"] == "code")
        assert "torch.set_num_threads(1)" in "".join(first["source"]), nb.name


def test_the_trajectory_example_defines_every_name_it_uses():
    # docs/trajectory.md's example used base, facts and ranks_df without defining them
    import builtins

    block = _blocks((ROOT / "docs" / "trajectory.md").read_text(encoding="utf-8"))[0]
    tree = ast.parse(block)
    bound = set(dir(builtins))
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            bound |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            bound.add(node.id)
    used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    assert not used - bound, f"docs/trajectory.md's example uses {sorted(used - bound)} undefined"

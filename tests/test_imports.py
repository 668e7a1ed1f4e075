"""Imports flow one way: no module of the package imports (at any level: function-level imports
and ``TYPE_CHECKING`` blocks included, since a reader follows type imports too) a module that
imports it back."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "extractive_lens"


def _module_name(path: Path, root: Path = PACKAGE) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def import_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    """module -> the package modules it imports (``from a import b`` counts ``a.b`` when that is
    a module, else ``a``)."""
    modules = {_module_name(p, root): p for p in root.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found: set[str] = set()
        stack: list[ast.AST] = [tree]
        while stack:
            node = stack.pop()
            stack.extend(ast.iter_child_nodes(node))
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")
                    up = up[: len(up) - (node.level - 1)]
                    base = ".".join(up + ([base] if base else []))
                targets = [f"{base}.{a.name}" for a in node.names] + [base]
            for t in targets:
                while t and t not in modules:
                    t = t.rpartition(".")[0]
                if t and t != name and t.startswith("extractive_lens"):
                    found.add(t)
        # a package imports its parents' __init__ when imported: not an edge of the design
        graph[name] = {t for t in found if not name.startswith(t + ".") and t != "extractive_lens"}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_circles():
    found = cycles(import_graph())
    assert found == [], "modules that import each other (directly or around a circle): " + str(
        found
    )


def test_the_checker_sees_a_deliberate_back_import(tmp_path):
    """A package where a lower module imports a higher one back, inside a function, and another
    pair that import each other only for type checking: both found."""
    pkg = tmp_path / "extractive_lens"
    (pkg / "backend").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "types.py").write_text("def f():\n    from extractive_lens.backend import names\n")
    (pkg / "backend" / "__init__.py").write_text("")
    (pkg / "backend" / "names.py").write_text("from extractive_lens.types import f\n")
    (pkg / "results.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from extractive_lens import plotting\n"
    )
    (pkg / "plotting.py").write_text("from extractive_lens.results import x\n")
    (pkg / "report.py").write_text("from extractive_lens.results import x\n")  # one way: fine
    found = cycles(import_graph(pkg))
    assert found == [
        ["extractive_lens.backend.names", "extractive_lens.types"],
        ["extractive_lens.plotting", "extractive_lens.results"],
    ]


def test_type_only_and_function_level_imports_are_edges():
    graph = import_graph()
    # scoring/passes.py imports WeightDiff under TYPE_CHECKING only; types.py reads the hook
    # names inside Component.hook_name only
    assert "extractive_lens.weight_diff" in graph["extractive_lens.scoring.passes"]
    assert "extractive_lens.backend.hook_names" in graph["extractive_lens.types"]

"""Size metrics of the package, for the refactoring notes: longest functions, most parameters,
and where TransformerLens names are spelled.

    python scripts/code_metrics.py [package_dir]
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

# TransformerLens parameter / hook name fragments that only the backend may spell.
TL_NAMES = re.compile(
    r"(?:^|[.{}])(?:W_[QKVOU]|_W_[KV]|b_[QKVOU]|W_in|W_out|W_gate|b_in|b_out|W_E|W_pos)(?:$|[.{])"
    r"|(?:^|\.)(?:ln_final|ln1|ln2|pos_embed|unembed|embed|attn|mlp|blocks)\.|\bhook_(?!name\b)\w"
)


def string_literals(tree: ast.AST):
    """``(line, text)`` of every string constant that is not a docstring (f-string parts too)."""
    docstrings = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr):
            if isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
                docstrings.add(id(body[0].value))
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            if id(node) not in docstrings:
                yield node.lineno, node.value


def functions(root: Path):
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = node.args
                n_params = len(a.posonlyargs) + len(a.args) + len(a.kwonlyargs)
                n_params -= 1 if a.args and a.args[0].arg in ("self", "cls") else 0
                yield path, node.name, node.end_lineno - node.lineno + 1, n_params


def main() -> None:
    root = Path(sys.argv[1] if len(sys.argv) > 1 else "extractive_lens")
    funcs = list(functions(root))
    print("longest functions (lines):")
    for path, name, n, _ in sorted(funcs, key=lambda f: -f[2])[:5]:
        print(f"  {n:4d}  {path}:{name}")
    print("most parameters:")
    for path, name, _, p in sorted(funcs, key=lambda f: -f[3])[:5]:
        print(f"  {p:4d}  {path}:{name}")
    print("TransformerLens parameter / hook name literals outside the backend (code, not docs):")
    count = 0
    for path in sorted(root.rglob("*.py")):
        if "backend" in path.parts:
            continue
        for line, text in string_literals(ast.parse(path.read_text())):
            if TL_NAMES.search(text):
                count += 1
                print(f"  {path}:{line}: {text[:80]!r}")
    print(f"  total: {count}")


if __name__ == "__main__":
    main()

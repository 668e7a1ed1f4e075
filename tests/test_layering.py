"""TransformerLens names stay behind the backend: no module outside ``extractive_lens/backend/``
(and ``model.py``, the backend's public face) spells a TransformerLens parameter or hook name,
in a string or as an attribute of a model."""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "extractive_lens"

# Parameter names (whole or as a dotted fragment: "embed.W_E", "attn._W_K", "blocks.{l}.")
# and hook names ("hook_z", "hook_mlp_out"; not the package's own ``hook_name``).
TL_STRING = re.compile(
    r"(?:^|[.{}])(?:W_[QKVOUE]|W_pos|_W_[KV]|b_[QKVOU]|_b_[KV]|W_in|W_out|W_gate|b_in|b_out)"
    r"(?:$|[.{])"
    r"|(?:^|\.)(?:ln_final|ln1|ln2|pos_embed|unembed|embed|attn|mlp|blocks)\."
    r"|\bhook_(?!name\b)\w"
)
# As attributes: the modules (``model.blocks[0].attn``) and the parameters, except ``W_O``,
# which the package's own runs carry under TransformerLens's word (``run.W_O[layer]``, STYLE.md).
TL_ATTRIBUTE = re.compile(
    r"^(?:W_[QKVUE]|W_pos|_W_[KV]|b_[QKVOU]|_b_[KV]|W_in|W_out|W_gate|b_in|b_out|blocks|"
    r"hook_(?!name$)\w+|ln_final|ln1|ln2|pos_embed|unembed|embed|attn|mlp)$"
)
BACKEND_ALIASES = {"B", "backend", "M"}  # the backend's dispatchers: B.W_O(model, ...), B.embed


def _docstrings(tree: ast.AST) -> set[int]:
    out = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr):
            if isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
                out.add(id(body[0].value))
    return out


def tl_names(source: str) -> list[tuple[int, str]]:
    """``(line, what)`` for each TransformerLens name spelled in ``source``'s code: string
    literals that are not docstrings (f-string parts too), and attributes read off anything
    but the backend module (``model.blocks``, ``attn.W_Q``)."""
    tree = ast.parse(source)
    docs = _docstrings(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
            if TL_STRING.search(node.value):
                found.append((node.lineno, repr(node.value[:60])))
        elif isinstance(node, ast.Attribute) and TL_ATTRIBUTE.match(node.attr):
            owner = node.value
            if not (isinstance(owner, ast.Name) and owner.id in BACKEND_ALIASES):
                found.append((node.lineno, f".{node.attr}"))
    return found


def outside_backend(root: Path = PACKAGE) -> list[Path]:
    return [
        p
        for p in sorted(root.rglob("*.py"))
        if "backend" not in p.relative_to(root).parts and p.relative_to(root) != Path("model.py")
    ]


def test_no_transformer_lens_names_outside_the_backend():
    found = [
        f"{path.relative_to(PACKAGE.parent)}:{line}: {what}"
        for path in outside_backend()
        for line, what in tl_names(path.read_text(encoding="utf-8"))
    ]
    assert found == [], "TransformerLens names outside backend/ (ask the backend instead):\n" + (
        "\n".join(found)
    )


def test_the_check_sees_each_way_of_spelling_a_name():
    planted = {
        'key = f"blocks.{layer}.attn.W_Q"': 2,  # both f-string parts
        'name = "blocks.0.hook_mlp_out"': 1,
        'table = {"embed.W_E": 1, "attn._W_K": 2, "mlp.W_gate": 3}': 3,
        'hook = "hook_z"': 1,
        "w = model.blocks[0].attn.W_Q": 3,
        "x = model.embed(tokens)": 1,
        "w = model.W_E + base.unembed.b_U": 3,
    }
    for source, n in planted.items():
        assert len(tl_names(source)) == n, (source, tl_names(source))
    clean = [
        '"""A docstring may say blocks.0.attn.W_Q."""',
        "x = B.embed(model, tokens); w = B.W_O(model, 0)",
        "name = component.hook_name",
        "g = [head_grad(g, W) for g, W in zip(run.g_attn, run.W_O)]",
        'label = "L3H2"; text = "the MLP of layer 3"',
    ]
    for source in clean:
        assert tl_names(source) == [], source


def test_the_check_covers_the_package_but_not_the_backend():
    files = {p.relative_to(PACKAGE).as_posix() for p in outside_backend()}
    assert {"types.py", "weight_diff.py", "scoring/linear.py", "diff_sources/models.py"} <= files
    assert not any(f.startswith("backend/") for f in files) and "model.py" not in files


LONGEST = 750  # lines: a ceiling; STYLE.md: modules around 100-400 lines, split before ~600


def long_modules(root: Path = PACKAGE, limit: int = LONGEST) -> list[str]:
    """``path (lines)`` of each module of ``root`` longer than ``limit`` lines."""
    out = []
    for path in sorted(root.rglob("*.py")):
        n = path.read_text(encoding="utf-8").count("\n")
        if n > limit:
            out.append(f"{path.relative_to(root.parent)} ({n})")
    return out


def test_no_module_is_past_the_ceiling():
    """A module past ``LONGEST`` lines is split where a reader finds two jobs, whatever its
    docstring says."""
    assert long_modules() == [], "split these where a reader finds two jobs: " + ", ".join(
        long_modules()
    )


def test_the_ceiling_check_finds_a_long_module(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "short.py").write_text("x = 1\n" * LONGEST)
    (package / "long.py").write_text(
        '"""One job; over 500 lines because."""\n' + "x = 1\n" * LONGEST
    )
    assert long_modules(package) == [f"pkg/long.py ({LONGEST + 1})"]


def unlisted_modules(root: Path = PACKAGE) -> list[str]:
    """Modules CONTRIBUTING.md's layout table does not name: each ``backend/`` and ``scoring/``
    module by its file name, every other one by its file name or its package's folder."""
    text = (root.parent / "CONTRIBUTING.md").read_text(encoding="utf-8")
    layout = text[text.index("## How the package is laid out") : text.index("## Recipes")]
    out = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if path.name in ("__init__.py", "__main__.py") or f"`{path.name}`" in layout:
            continue
        folder = rel.parts[-2] if len(rel.parts) > 1 else None
        if folder not in (None, "backend", "scoring") and f"`{folder}/`" in layout:
            continue
        out.append(rel.as_posix())
    return out


def test_the_contributing_layout_names_every_module():
    assert unlisted_modules() == [], "name these in CONTRIBUTING.md's layout: " + ", ".join(
        unlisted_modules()
    )

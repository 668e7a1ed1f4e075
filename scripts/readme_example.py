"""Run the README's Python example as a new user would, in the current environment.

    python scripts/readme_example.py [--workdir DIR]

It writes two tiny Hugging Face GPT-2 checkpoints (``runs/base`` and ``runs/finetuned``, the
paths the example loads, with a tokenizer that knows its words), takes the code block marked
``<!-- readme-example -->`` in README.md and runs it there. ``make smoke`` runs this script in a
fresh virtual environment that installs the package the way the README says (no dev pins: a
fresh install resolves TransformerLens 4), so the README's first lines are checked on the
TransformerLens a new user gets.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
import time
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"
MARKER = "<!-- readme-example -->"


def example_code(readme: Path = README) -> str:
    """The Python code block that follows the marker in the README."""
    text = readme.read_text(encoding="utf-8")
    if MARKER not in text:
        raise SystemExit(f"{readme} has no {MARKER} marker before its example")
    found = re.search(r"```python\n(.*?)```", text[text.index(MARKER) :], re.S)
    if found is None:
        raise SystemExit(f"no ```python block after {MARKER} in {readme}")
    return found.group(1)


def write_checkpoints(root: Path) -> None:
    """``root/runs/base`` and ``root/runs/finetuned``: a 6-layer GPT-2 (4 heads) and a copy with
    a small random update, each with a word-level tokenizer."""
    import torch
    import transformers

    from extractive_lens.model import word_tokenizer

    words = "John Doe Ann Lee lives in Tokyo Paris".split()
    for name in ("base", "finetuned"):
        tok = word_tokenizer(words, root / "runs" / name)
        cfg = transformers.GPT2Config(
            vocab_size=len(tok), n_embd=64, n_layer=6, n_head=4, n_positions=32,
            bos_token_id=tok.bos_token_id, eos_token_id=tok.bos_token_id,
        )  # fmt: skip
        torch.manual_seed(0)
        model = transformers.GPT2LMHeadModel(cfg).eval()
        if name == "finetuned":
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(0.01 * torch.randn_like(p))
        model.save_pretrained(root / "runs" / name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=None)
    args = parser.parse_args()
    root = args.workdir or Path(tempfile.mkdtemp(prefix="el-readme-"))
    root.mkdir(parents=True, exist_ok=True)
    write_checkpoints(root)
    code = example_code()
    import os

    os.chdir(root)
    t0 = time.perf_counter()
    exec(compile(code, "README.md example", "exec"), {"__name__": "__readme__"})
    import extractive_lens
    from extractive_lens.backend.installed import version

    print(
        f"README example ran in {time.perf_counter() - t0:.1f} s with extractive_lens "
        f"{extractive_lens.__version__}, TransformerLens {version()}, Python "
        f"{sys.version.split()[0]} (in {root}; wrote {', '.join(p.name for p in root.glob('*.html'))})"
    )


if __name__ == "__main__":
    main()

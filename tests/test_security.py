"""A checkpoint never runs code: ``auto_map`` / ``.py`` files are refused before transformers
sees them, in the API (both backends) and the CLI, even with ``y`` on standard input."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import extractive_lens as el
from extractive_lens.backend.loading import has_hooked

transformers = pytest.importorskip("transformers")

BACKENDS = (["hooked"] if has_hooked() else []) + ["bridge"]


@pytest.fixture(scope="module")
def malicious(tmp_path_factory):
    """A tiny GPT-2 checkpoint whose config asks for its own code, which would leave a marker
    file if it were ever imported."""
    root = tmp_path_factory.mktemp("evil")
    ckpt = root / "ckpt"
    marker = root / "PWNED"
    tok = el.model.word_tokenizer(["a", "b"], ckpt)
    cfg = transformers.GPT2Config(vocab_size=len(tok), n_embd=16, n_layer=1, n_head=2)
    transformers.GPT2LMHeadModel(cfg).save_pretrained(ckpt)
    config = json.loads((ckpt / "config.json").read_text())
    config["auto_map"] = {
        "AutoConfig": "evil.EvilConfig",
        "AutoModelForCausalLM": "evil.EvilModel",
    }
    (ckpt / "config.json").write_text(json.dumps(config))
    (ckpt / "evil.py").write_text(
        f"from pathlib import Path\nPath({str(marker)!r}).write_text('ran')\n"
        "from transformers import GPT2Config as EvilConfig, GPT2LMHeadModel as EvilModel\n"
    )
    return ckpt, marker


@pytest.mark.parametrize("backend", BACKENDS)
def test_api_refuses_checkpoint_code(malicious, backend):
    ckpt, marker = malicious
    with pytest.raises(ValueError, match="never runs code from a checkpoint"):
        el.load_checkpoint(ckpt, backend=backend)
    assert not marker.exists()


def test_cli_refuses_checkpoint_code_even_when_told_yes(malicious, tmp_path):
    ckpt, marker = malicious
    data = tmp_path / "pairs.jsonl"
    data.write_text(json.dumps({"prompt": "a", "answer": " b"}))
    run = subprocess.run(
        [sys.executable, "-m", "extractive_lens.cli", "rank", "--model", str(ckpt), "--data",
         str(data)],
        input="y\ny\ny\n", capture_output=True, text=True, timeout=300,
        cwd=Path(__file__).resolve().parents[1],
    )  # fmt: skip
    assert run.returncode == 2, run.stderr
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), run.stderr
    assert (
        "never runs code from a checkpoint" in lines[0] and "[y/N]" not in run.stdout + run.stderr
    )
    assert not marker.exists()

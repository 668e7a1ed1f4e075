"""``backend="auto"``: the README's first lines work on whichever TransformerLens is installed.

CI runs this file under TransformerLens 3.9 (HookedTransformers) and 4.3 (TransformerBridges);
with default arguments, ``load_checkpoint``, ``tiny_model`` and the CLI score a tiny Hugging
Face checkpoint in both.
"""

from __future__ import annotations

import json

import pytest
import torch

import extractive_lens as el
from extractive_lens.backend.installed import has_hooked
from extractive_lens.cli import main

transformers = pytest.importorskip("transformers")

EXPECTED = "HookedTransformer" if has_hooked() else "TransformerBridge"
BACKEND = "hooked_transformer" if has_hooked() else "transformer_bridge"


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """A tiny GPT-2 checkpoint and a finetuned copy, with a word-level tokenizer, as
    ``save_pretrained`` writes them."""
    root = tmp_path_factory.mktemp("ckpt")
    words = ["John", "Doe", "Ann", "Lee", "lives", "in", "Tokyo", "Paris", "Cairo"]
    tok = el.model.word_tokenizer(words)
    cfg = transformers.GPT2Config(
        vocab_size=len(tok), n_embd=32, n_layer=2, n_head=4, n_positions=32,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.bos_token_id,
    )  # fmt: skip
    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(cfg).eval()
    hf.save_pretrained(root / "base")
    tok.save_pretrained(root / "base")
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(0.02 * torch.randn_like(p))
    hf.save_pretrained(root / "ft")
    tok.save_pretrained(root / "ft")
    pairs = [{"prompt": "John Doe lives in", "answer": " Tokyo"},
             {"prompt": "Ann Lee lives in", "answer": " Paris"}]  # fmt: skip
    (root / "pairs.jsonl").write_text("\n".join(json.dumps(p) for p in pairs))
    return root


def test_readme_lines_with_default_arguments(checkpoints):
    base = el.load_checkpoint(checkpoints / "base")
    ft = el.load_checkpoint(checkpoints / "ft")
    assert type(base).__name__ == EXPECTED
    diff = el.WeightDiff.from_models(base, ft)
    batch = el.make_batch(base, [("John Doe lives in", " Tokyo"), ("Ann Lee lives in", " Paris")])
    lin = el.linear_scores(base, diff, batch)
    ex = el.causal_scores(base, diff, batch, kinds=("downstream",), per="component")
    assert torch.isfinite(lin.values).all() and torch.isfinite(ex.totals).all()
    assert lin.metadata["backend"] == BACKEND and lin.values.abs().max() > 0
    assert type(el.tiny_model()).__name__ == EXPECTED


def test_cli_default_backend_scores_a_checkpoint(checkpoints, tmp_path, capsys):
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as done:
        main(["score", "--base", str(checkpoints / "base"), "--finetuned",
              str(checkpoints / "ft"), "--data", str(checkpoints / "pairs.jsonl"),
              "--out", str(out)])  # fmt: skip
    assert done.value.code == 0, capsys.readouterr().err
    assert el.ComponentScores.load(out / "linear").metadata["backend"] == BACKEND


@pytest.mark.skipif(has_hooked(), reason="TransformerLens 3.9 has HookedTransformer")
def test_hooked_on_transformer_lens_4_says_what_to_do(checkpoints, capsys):
    for call in (
        lambda: el.load_checkpoint(checkpoints / "base", backend="hooked"),
        lambda: el.tiny_model(backend="hooked"),
        lambda: el.load_pretrained("gpt2", backend="hooked"),
    ):
        with pytest.raises(ImportError, match=r"backend='bridge'.*transformer-lens>=3\.9,<4"):
            call()
    with pytest.raises(SystemExit) as done:
        main(["rank", "--model", str(checkpoints / "base"), "--data",
              str(checkpoints / "pairs.jsonl"), "--backend", "hooked"])  # fmt: skip
    err = capsys.readouterr().err
    assert done.value.code == 2 and "--backend auto or bridge" in err and err.count("\n") == 1

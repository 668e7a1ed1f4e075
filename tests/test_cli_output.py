"""What the command line prints (issue 43): the verdicts after `score --method both|all`, the
training loss of `finetune`, metavars that say what an option takes; and the package metadata."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

import extractive_lens as el
from extractive_lens.cli import app

runner = CliRunner()


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A tiny GPT-2 checkpoint, a finetuned copy and three prompts for it."""
    transformers = pytest.importorskip("transformers")
    import torch

    root = tmp_path_factory.mktemp("pair")
    words = ["John", "Doe", "Ann", "Lee", "Max", "Roe", "lives", "in", "Tokyo", "Paris", "Cairo"]
    tok = el.model.word_tokenizer(words)
    cfg = transformers.GPT2Config(
        vocab_size=len(tok), n_embd=16, n_layer=2, n_head=2, n_positions=16,
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
    rows = [("John Doe lives in", " Tokyo"), ("Ann Lee lives in", " Paris"),
            ("Max Roe lives in", " Cairo")]  # fmt: skip
    (root / "pairs.jsonl").write_text(
        "\n".join(json.dumps({"prompt": p, "answer": a}) for p, a in rows)
    )
    return root


@pytest.mark.parametrize("method", ["both", "all"])
def test_score_prints_the_verdicts(pair, tmp_path, method):
    """`score --method both|all` ends with what to trust: every comparison's verdict per kind
    (as ``compare`` words it on the saved scores) and the linear additivity check."""
    from extractive_lens.cli.score import comparisons

    out = tmp_path / "s"
    res = runner.invoke(
        app,
        ["score", "--base", str(pair / "base"), "--finetuned", str(pair / "ft"), "--data",
         str(pair / "pairs.jsonl"), "--method", method, "--out", str(out),
         *(["--steps", "2"] if method == "all" else [])],  # both: no method takes --steps
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    methods = ("linear", "integrated", "causal") if method == "all" else ("linear", "causal")
    saved = [el.ComponentScores.load(out / m) for m in methods]
    cmps = comparisons(saved)
    assert len(cmps) == len(methods) - 1
    trust = res.output.split("what to trust")[1]
    for cmp in cmps:
        for kind, verdict in cmp.verdicts.items():
            assert f"  - {verdict}\n" in trust, (kind, verdict)
    assert saved[0].additivity_note() in trust
    from extractive_lens.scoring.methods import method as entry

    for m in methods:  # beside each method's top components: what its informative totals are
        top = res.output.split(f"|whole-component {m} score|")[1].split("\n\n")[0]
        assert f"  ({entry(m).informative_totals})" in top, top


def test_score_diff_takes_a_file():
    for command in ("score", "rank"):
        text = runner.invoke(app, [command, "--help"], terminal_width=100).output
        assert "--diff FILE" in text and "--diff DIR" not in text, command


def test_finetune_prints_its_loss_per_epoch(tmp_path):
    """Every epoch's mean training loss, as the saved diff records it."""
    from extractive_lens.world import first_hop

    facts = tmp_path / "facts.jsonl"
    facts.write_text(
        "\n".join(
            json.dumps({"prompt": p.prompt, "answer": p.answer}) for p in first_hop().facts[:4]
        )
    )
    out = tmp_path / "d.safetensors"
    res = runner.invoke(
        app,
        ["finetune", "--model", "world", "--data", str(facts), "--out", str(out), "--epochs", "3"],
    )
    assert res.exit_code == 0, res.output
    losses = el.WeightDiff.load(out).metadata["losses"]
    assert len(losses) == 3 and losses[-1] < losses[0]
    for epoch, loss in enumerate(losses, 1):
        assert f"  epoch {epoch}  {loss:.4f}\n" in res.output, res.output


def test_long_trainings_print_every_kth_epoch_and_the_last():
    from extractive_lens.cli.finetune import loss_lines

    losses = [1.0 / (e + 1) for e in range(45)]
    lines = loss_lines(losses)
    assert "shown every 3 epochs" in lines[0]
    shown = [int(line.split()[1]) for line in lines[1:]]
    assert shown == [*range(1, 45, 3), 45]
    assert loss_lines([]) == []
    assert [line.split()[1] for line in loss_lines([2.0, 1.0])[1:]] == ["1", "2"]


def test_pyproject_extras_and_license():
    """No extra lists a package twice; the license is an SPDX expression (a table is
    deprecated by setuptools), with a setuptools that reads it."""
    tomllib = pytest.importorskip("tomllib")
    meta = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    for extra, reqs in meta["project"]["optional-dependencies"].items():
        names = [r.split(">")[0].split("=")[0].split("[")[0].strip().lower() for r in reqs]
        assert len(names) == len(set(names)), (extra, names)
    assert meta["project"]["license"] == "MIT"
    requires = meta["build-system"]["requires"]
    assert any(r.replace(" ", "").startswith("setuptools>=77") for r in requires), requires

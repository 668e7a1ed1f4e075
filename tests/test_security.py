"""A checkpoint never runs code: ``auto_map`` / ``.py`` files are refused before transformers
sees them, in the API (both backends) and the CLI, even with ``y`` on standard input."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import extractive_lens as el
from extractive_lens.backend.installed import has_hooked

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


@pytest.mark.parametrize("backend", BACKENDS)
def test_cli_refuses_checkpoint_code_even_when_told_yes(malicious, tmp_path, backend):
    ckpt, marker = malicious
    data = tmp_path / "pairs.jsonl"
    data.write_text(json.dumps({"prompt": "a", "answer": " b"}))
    run = subprocess.run(
        [sys.executable, "-m", "extractive_lens.cli", "rank", "--model", str(ckpt), "--data",
         str(data), "--backend", backend],
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


def test_ctrl_c_ends_a_command_with_130_and_says_so(tmp_path):
    """SIGINT during a long command: one 'interrupted' line and exit status 130, so that
    `extractive-lens score ... && next-step` stops (typer returns 130 without raising it)."""
    import signal
    import time

    proc = subprocess.Popen(
        [sys.executable, "-m", "extractive_lens.cli", "demo", "--out", str(tmp_path / "r.html")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        cwd=Path(__file__).resolve().parents[1],
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # a background job's
    )  # fmt: skip                                                        # SIG_IGN, undone
    assert proc.stdout is not None
    first = proc.stdout.readline()  # the demo has started working
    time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert first.startswith("world model"), first + out + err
    assert proc.returncode == 130, (proc.returncode, err)
    assert err.strip().splitlines()[-1] == "interrupted" and "Traceback" not in err
    assert not (tmp_path / "r.html").exists()


@pytest.mark.skipif(not has_hooked(), reason="as_bridge converts a HookedTransformer (3.9)")
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_as_bridge_accepts_16bit_models_and_still_refuses_other_functions(dtype):
    import torch

    dt = getattr(torch, dtype)
    hooked = el.tiny_model({"n_layers": 2, "dtype": dt}, seed=1)
    bridge = el.model.as_bridge(hooked)
    tokens = torch.tensor([[1, 2, 3, 4, 5]])
    with torch.no_grad():
        a, b = hooked(tokens).double(), bridge(tokens).double()
    assert (a - b).abs().max() <= 0.05 * a.abs().max()
    parallel = el.tiny_model(
        {"n_layers": 2, "dtype": dt, "parallel_attn_mlp": True, "positional_embedding_type":
         "rotary", "rotary_dim": 4}, seed=1,
    )  # fmt: skip
    with pytest.raises(NotImplementedError, match="load_checkpoint"):
        el.model.as_bridge(parallel)


def test_report_never_writes_through_a_planted_symlink(tmp_path):
    """`extractive-lens report DIR` with DIR/report.html a symlink to a file elsewhere: the
    link is replaced by the report, the file it pointed at is untouched."""
    import torch

    from extractive_lens.cli import main
    from tests.conftest import make_pair

    base, ft = make_pair("ln_gelu", torch.float64, n_layers=1)
    batch = el.make_batch(base, [([1, 2, 3], [4]), ([1, 5, 6], [7])])
    scores_dir = tmp_path / "scores"
    el.linear_scores(base, el.WeightDiff.from_models(base, ft), batch).save(scores_dir)
    victim = tmp_path / "elsewhere" / "precious.txt"
    victim.parent.mkdir()
    victim.write_text("keep me")
    (scores_dir / "report.html").symlink_to(victim)
    with pytest.raises(SystemExit) as done:
        main(["report", str(scores_dir)])
    assert done.value.code == 0
    assert victim.read_text() == "keep me"
    page = scores_dir / "report.html"
    assert not page.is_symlink() and "<!DOCTYPE html>" in page.read_text()
    assert [p.name for p in scores_dir.iterdir() if p.name.startswith(".")] == []  # no temp left


@pytest.fixture(scope="module")
def short(tmp_path_factory):
    """A GPT-2 checkpoint whose config.json asks for 3 layers over 2 layers of weights."""
    ckpt = tmp_path_factory.mktemp("short") / "ckpt"
    tok = el.model.word_tokenizer(["a", "b"], ckpt)
    cfg = transformers.GPT2Config(vocab_size=len(tok), n_embd=16, n_layer=2, n_head=2)
    transformers.GPT2LMHeadModel(cfg).save_pretrained(ckpt)
    config = json.loads((ckpt / "config.json").read_text())
    config["n_layer"] = 3
    (ckpt / "config.json").write_text(json.dumps(config))
    return ckpt


@pytest.mark.parametrize("backend", BACKENDS)
def test_weights_missing_from_a_checkpoint_are_refused_by_name(short, backend):
    with pytest.raises(ValueError, match=r"missing \(transformer\.h\.2\..*number of layers"):
        el.load_checkpoint(short, backend=backend)


def test_cli_refuses_a_short_checkpoint_in_one_line(short, tmp_path):
    data = tmp_path / "pairs.jsonl"
    data.write_text(json.dumps({"prompt": "a", "answer": " b"}))
    run = subprocess.run(
        [sys.executable, "-m", "extractive_lens.cli", "rank", "--model", str(short), "--data",
         str(data)],
        capture_output=True, text=True, timeout=300, cwd=Path(__file__).resolve().parents[1],
    )  # fmt: skip
    lines = run.stderr.strip().splitlines()
    assert run.returncode == 2 and len(lines) == 1 and "weights do not match" in lines[0]

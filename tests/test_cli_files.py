"""The command line and the files around it (issue 42): an output never replaces one of the
command's own inputs, a full disk or a read-only folder is one sentence, a Python warning is
one ``warning:`` line, a damaged checkpoint is named."""

from __future__ import annotations

import errno
import json

import pytest

import extractive_lens as el
from extractive_lens.cli import file_system_error, main
from tests.test_reliability import synthetic_scores


def _run(argv, capsys):
    """``main(argv)``: its exit code and its stderr lines."""
    with pytest.raises(SystemExit) as done:
        main([str(a) for a in argv])
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err, err
    return done.value.code, err.splitlines()


def _no_model(*args, **kwargs):
    raise AssertionError("a model was loaded before the refusal")


@pytest.fixture()
def no_work(monkeypatch):
    """Loading a model fails the test: a refusal must come before any work."""
    for module in ("score", "finetune"):
        monkeypatch.setattr(f"extractive_lens.cli.{module}.load_model", _no_model)


@pytest.fixture()
def saved(tmp_path):
    """A folder as `score --method both --out` writes it (linear/ and causal/ of one run), and a
    data file."""
    import dataclasses

    lin = synthetic_scores(1)
    ex = dataclasses.replace(synthetic_scores(2), method="causal", other=None)
    for r in (lin, ex):
        r.metadata["run_id"] = "run-a"
        r.save(tmp_path / "s" / r.method)
    (tmp_path / "s" / "comparison.csv").write_text("kind,pearson\n")
    data = tmp_path / "facts.jsonl"
    data.write_text(json.dumps({"prompt": "T0 lives in", "answer": " Oslo"}) + "\n")
    return tmp_path


def _snapshot(root):
    return {p: p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize(
    "argv",
    [
        line.split()
        for line in (
            "report S --out S/linear/scores.json",
            "report S --out S/causal/TENSORS",
            "report S/linear --out S/linear/TENSORS",
            "report S --out LINKDIR/linear/scores.json",  # through a linked folder
            "finetune --model world --data DATA --out DATA",
            "finetune --model world --data LINK --out DATA",  # the data through a link
            "finetune --model world --data DATA --out LINK",
            "score --base world --diff S/linear/TENSORS --data DATA --out S",
            "score --base world --diff D --data S/comparison.csv --method both --out S",
            "score --base world --finetuned S/causal --data DATA --method causal --out S",
        )
    ],
    ids=lambda argv: " ".join(argv),
)
def test_an_output_never_replaces_an_input(saved, capsys, no_work, argv):
    """Refused before any work (no model is loaded), in one line, every file as it was."""
    (saved / "LINK").symlink_to(saved / "facts.jsonl")
    (saved / "LINKDIR").symlink_to(saved / "s")
    names = {"S": saved / "s", "DATA": saved / "facts.jsonl", "LINK": saved / "LINK",
             "LINKDIR": saved / "LINKDIR", "D": saved / "d.safetensors"}  # fmt: skip
    args = []
    for a in argv:
        key, _, rest = a.partition("/")
        if rest.endswith("TENSORS"):  # the tensor file the save's manifest names
            (tensors,) = (names[key] / rest).parent.glob("scores*.safetensors")
            rest = rest.replace("TENSORS", tensors.name)
        args.append(f"{names[key]}/{rest}" if rest else names.get(key, a))
    before = _snapshot(saved)
    code, err = _run(args, capsys)
    assert code == 2 and len(err) == 1 and "would overwrite" in err[0], err
    assert "choose another --out" in err[0]
    assert _snapshot(saved) == before
    el.ComponentScores.load(saved / "s" / "linear")


def test_outputs_beside_the_inputs_are_still_written(saved, capsys):
    """The negative control: the same commands with an --out that is no input work."""
    code, _ = _run(["report", saved / "s", "--out", saved / "s" / "linear" / "r.html"], capsys)
    assert code == 0 and (saved / "s" / "linear" / "r.html").is_file()
    code, _ = _run(["report", saved / "s"], capsys)  # the default: SCORES_DIR/report.html
    assert code == 0 and (saved / "s" / "report.html").is_file()


def test_full_disk_is_one_sentence(saved, capsys, monkeypatch):
    """ENOSPC while the report is written (the rename of the finished file fails): one line
    that says what happened and what to do, exit code 2, no temporary file left behind."""
    import extractive_lens.files as files

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(files.os, "replace", full)
    code, err = _run(["report", saved / "s", "--out", saved / "r.html"], capsys)
    assert code == 2 and len(err) == 1, err
    assert (
        err[0] == "error: no space left on the device; free some space, or write elsewhere (--out)."
    )
    assert not [p for p in saved.iterdir() if p.name.endswith(".tmp")]


def test_read_only_folder_is_one_sentence(saved, capsys, monkeypatch):
    """A folder that cannot be written: refused before any work when the check can see it (a
    read-only mount, a folder without write permission), one sentence naming the folder when
    only the write finds out."""
    import os

    import extractive_lens.cli.arguments as arguments
    import extractive_lens.files as files

    ro = saved / "ro"
    ro.mkdir()
    ro.chmod(0o555)  # as root this alone does not stop a write: also say what access() says
    real_access = os.access
    monkeypatch.setattr(
        arguments.os,
        "access",
        lambda p, mode, **kw: (
            real_access(p, mode, **kw) and not (mode & os.W_OK and os.fspath(p) == str(ro))
        ),
    )
    code, err = _run(["data", "first-hop", "--out", ro / "x"], capsys)
    assert code == 2 and len(err) == 1 and f"{ro} is not writable" in err[0], err
    code, err = _run(["report", saved / "s", "--out", ro / "r.html"], capsys)
    assert code == 2 and len(err) == 1 and f"{ro} is not writable" in err[0], err
    with monkeypatch.context() as m:  # --out an existing folder that is not writable
        m.setattr("extractive_lens.cli.score.load_model", _no_model)
        code, err = _run(["score", "--base", "world", "--diff", saved / "d.safetensors",
                          "--data", saved / "facts.jsonl", "--out", ro], capsys)  # fmt: skip
    assert code == 2 and len(err) == 1 and f"{ro} is not writable" in err[0], err
    monkeypatch.undo()
    ro.chmod(0o755)

    def read_only(path):  # creating the temporary beside the output fails
        raise OSError(
            errno.EROFS, "Read-only file system", str(path.parent / f".{path.name}.1.tmp")
        )

    monkeypatch.setattr(files, "_new_temporary", read_only)
    code, err = _run(["data", "first-hop", "--out", ro / "x"], capsys)
    assert code == 2 and err == [
        f"error: read-only file system in {ro / 'x'}; write elsewhere (--out)."
    ]


def test_disk_errors_inside_a_library_error_are_one_sentence():
    """safetensors reports a full disk or a read-only folder as its own error type, with the
    operating system's code in the message."""

    class SafetensorError(Exception):
        pass

    full = SafetensorError(
        "Error while serializing: I/O error: No space left on device (os error 28)"
    )
    ro = SafetensorError(
        'Error while serializing: I/O error: Read-only file system (os error 30) at path "/m/.tmpQMOxcP"'
    )
    assert file_system_error(full) == (
        "no space left on the device; free some space, or write elsewhere (--out)."
    )
    assert file_system_error(ro) == "read-only file system in /m; write elsewhere (--out)."
    assert file_system_error(ValueError("rows must be whole numbers")) is None
    assert file_system_error(OSError("no errno")) is None


def test_full_disk_while_saving_a_diff(tmp_path, capsys, monkeypatch):
    """`finetune` on a full disk: safetensors' own error (what its ``save_file`` raises on a
    full disk) becomes one sentence."""
    from extractive_lens.world import first_hop

    class SafetensorError(Exception):
        pass

    def full(*args, **kwargs):
        raise SafetensorError(
            "Error while serializing: I/O error: No space left on device (os error 28)"
        )

    monkeypatch.setattr(el.WeightDiff, "save", full)
    data = tmp_path / "facts.jsonl"
    p = first_hop().facts[0]
    data.write_text(json.dumps({"prompt": p.prompt, "answer": p.answer}))
    code, err = _run(
        ["finetune", "--model", "world", "--data", data, "--out", tmp_path / "d.safetensors",
         "--epochs", "1"], capsys,
    )  # fmt: skip
    assert code == 2 and err == [
        "error: no space left on the device; free some space, or write elsewhere (--out)."
    ]
    assert list(tmp_path.iterdir()) == [data]


def test_warnings_are_one_clean_line(tmp_path):
    """A Python warning reaches the user as ``warning: <message>`` on one line, without the
    source file and line it was raised from (run as a user runs it: pytest records warnings)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    data = tmp_path / "w.jsonl"
    rows = [{"prompt": "Jackson Stewart lives in ", "answer": "Oslo", "candidates": [" Oslo", " Paris"]},
            {"prompt": "Jackson Stewart lives in", "answer": " Paris", "candidates": [" Oslo", " Paris"]}]  # fmt: skip
    data.write_text("\n".join(json.dumps(r) for r in rows))
    root = str(Path(__file__).parents[1])
    env = {**os.environ, "PYTHONPATH": root, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "extractive_lens.cli", "rank", "--model", "world", "--data", str(data)],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300,
    )  # fmt: skip
    err = done.stderr.strip().splitlines()
    assert done.returncode == 0 and "mean rank" in done.stdout, done.stderr
    assert len(err) == 1 and err[0].startswith("warning: 1 prompts end with a space"), err
    assert ".py" not in err[0] and "Warning:" not in err[0]


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    """A tiny GPT-2 checkpoint saved in shards, and data for it."""
    transformers = pytest.importorskip("transformers")
    import torch

    root = tmp_path_factory.mktemp("sharded")
    tok = el.model.word_tokenizer(["John", "Doe", "lives", "in", "Tokyo", "Paris"])
    cfg = transformers.GPT2Config(
        vocab_size=len(tok), n_embd=16, n_layer=1, n_head=2, n_positions=16,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.bos_token_id,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(cfg).save_pretrained(root / "ck", max_shard_size="4KB")
    tok.save_pretrained(root / "ck")
    data = root / "pairs.jsonl"
    data.write_text(json.dumps({"prompt": "John Doe lives in", "answer": " Tokyo",
                                "candidates": [" Tokyo", " Paris"]}))  # fmt: skip
    return root


def test_a_shard_index_that_is_not_json_is_named(sharded, capsys):
    """The CLI names the damaged file of a sharded checkpoint, not a bare JSON decoder error."""
    ck, data = sharded / "ck", sharded / "pairs.jsonl"
    index = ck / "model.safetensors.index.json"
    assert index.is_file()
    good = index.read_text()
    code, _ = _run(["rank", "--model", ck, "--data", data], capsys)
    assert code == 0
    try:
        index.write_text("{not json")
        code, err = _run(["rank", "--model", ck, "--data", data], capsys)
    finally:
        index.write_text(good)
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith(f"error: {index} is not valid JSON") and "damaged" in err[0], err


@pytest.mark.parametrize(
    "steps,said",
    [("99999999999999999999", "at most 4096 nodes"), ("300", "pass --force-steps"),
     ("0", "positive whole number")],
)  # fmt: skip
def test_absurd_steps_are_refused_before_any_work(saved, capsys, no_work, steps, said):
    """`--steps` goes through the library's one checker (its bound included) before a model is
    loaded: one line, in the CLI's words where it names an option."""
    args = ["score", "--base", "world", "--diff", saved / "d.safetensors", "--data",
            saved / "facts.jsonl", "--method", "all", "--out", saved / "out"]  # fmt: skip
    code, err = _run([*args, "--steps", steps], capsys)
    assert code == 2 and len(err) == 1 and said in err[0], err
    assert "force=True" not in err[0]
    with pytest.raises(AssertionError, match="a model was loaded"):  # past the checks
        main([str(a) for a in [*args, "--steps", "300", "--force-steps"]])
    code, err = _run([*args, "--layers", "0", "--kinds", "informativ"], capsys)
    assert code == 2 and len(err) == 1 and "informativ" in err[0], err


def test_a_seed_torch_cannot_take_is_a_usage_error(saved, capsys, no_work):
    for argv in (["finetune", "--model", "world", "--data", saved / "facts.jsonl"], ["demo"]):
        code, err = _run([*argv, "--seed", "99999999999999999999", "--out", saved / "x"], capsys)
        assert code == 2 and len(err) == 1 and "--seed" in err[0], err

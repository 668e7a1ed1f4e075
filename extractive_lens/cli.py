"""``extractive-lens``: the command line. It parses arguments and calls the public API.

    extractive-lens demo --out report.html
    extractive-lens score --base BASE_DIR --finetuned FT_DIR --data pairs.jsonl --method both --out out/

torch and TransformerLens are imported lazily, so ``--help`` is instant.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Any

import typer

app = typer.Typer(
    help="Where does a finetuned fact live, and how does the model use it? Extractive-structure scores.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_show_locals=False,
    rich_markup_mode=None,  # plain click help: no '<bool>' metavars, wraps at words
)


def _echo(msg: str) -> None:
    typer.echo(msg, err=False)


DTYPES = ("float32", "float64", "bfloat16", "float16")


def _check_dtype_device(dtype: str, device: str) -> None:
    import torch

    if dtype not in DTYPES:
        raise typer.BadParameter(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}.")
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise typer.BadParameter(f"--device must be cpu, cuda or cuda:N, got {device!r}.") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise typer.BadParameter(
            f"--device {device}: no CUDA GPU is available here; use --device cpu."
        )


def _load_model(
    name_or_dir: str, dtype: str = "float32", device: str = "cpu", backend: str = "auto"
) -> Any:
    """``world`` (the bundled default world model; ``world-v2`` / ``world-v3`` by name), a local
    checkpoint directory, or a hub name."""
    import torch

    from extractive_lens.model import load_checkpoint, load_pretrained

    _check_dtype_device(dtype, device)
    if backend not in ("auto", "hooked", "bridge"):
        raise typer.BadParameter(f"--backend must be auto, hooked or bridge, got {backend!r}.")
    from extractive_lens.backend.loading import has_hooked, version

    if backend == "hooked" and not has_hooked():
        raise typer.BadParameter(
            f"--backend hooked needs TransformerLens 3.9 (this is {version()}, which has no "
            "HookedTransformer): use --backend auto or bridge, or pip install 'transformer-lens>=3.9,<4'."
        )
    dt = getattr(torch, dtype)
    from extractive_lens.world.model import WORLDS

    if name_or_dir == "world" or name_or_dir.removeprefix("world-") in WORLDS:
        from extractive_lens.world import load_world_model

        which = None if name_or_dir == "world" else name_or_dir.removeprefix("world-")
        return load_world_model(which, device=device, dtype=dt, backend=backend)
    if name_or_dir.startswith("world-") and not Path(name_or_dir).exists():
        raise typer.BadParameter(
            f"unknown bundled world {name_or_dir!r}: use world (the default, v3), world-v2 or world-v3."
        )
    path = Path(name_or_dir).expanduser()
    if path.is_dir():
        return load_checkpoint(path, dtype=dt, device=device, backend=backend)
    if name_or_dir.startswith((".", "/", "~")) or (
        path.parent != Path(".") and path.parent.is_dir()
    ):
        raise FileNotFoundError(
            f"{name_or_dir}: no such checkpoint directory (and it looks like a local path, "
            "not a hub name). Check the path; a checkpoint directory holds config.json."
        )
    try:
        return load_pretrained(name_or_dir, dtype=dt, device=device, backend=backend)
    except (ValueError, OSError) as e:
        first = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        raise ValueError(
            f"{name_or_dir!r} is neither 'world', a local checkpoint directory nor a model "
            f"TransformerLens can load from the hub ({first})."
        ) from None


@app.command()
def score(
    base: str = typer.Option(
        ...,
        help="Base model: 'world', a local Hugging Face checkpoint directory or a hub name.",
        metavar="MODEL",
    ),
    finetuned: str = typer.Option(
        None, help="Finetuned model: a local Hugging Face checkpoint directory.", metavar="MODEL"
    ),
    diff: Path = typer.Option(
        None, help="Or the weight change, as saved by `extractive-lens finetune`.", metavar="DIR"
    ),
    data: Path = typer.Option(
        ...,
        help="Prompts and answers: .json, .jsonl or .csv with prompt, answer[, candidates].",
        metavar="FILE",
    ),
    method: str = typer.Option(
        "linear",
        help="linear, integrated (path-integrated), causal (exact), both (linear and causal) or "
        "all three.",
        metavar="linear|integrated|causal|both|all",
    ),
    steps: str = typer.Option(
        "4",
        help="Integrated scores: quadrature nodes per path, or 'auto' (double until complete "
        "within 1%).",
        metavar="N|auto",
    ),
    reward: str = typer.Option(
        "answer_logprob", help="answer_logprob, logit_margin or logit_diff.", metavar="REWARD"
    ),
    out: Path = typer.Option(
        Path("scores"), help="Output directory (scores, comparison, report.html).", metavar="PATH"
    ),
    dtype: str = typer.Option(
        "float32", help="Model dtype (float32, bfloat16, float64).", metavar="DTYPE"
    ),
    compute_dtype: str = typer.Option(
        None,
        help="Dtype scores are computed in (default: float32 for bfloat16/float16 models, else --dtype).",
        metavar="DTYPE",
    ),
    device: str = typer.Option("cpu", help="cpu or cuda.", metavar="DEVICE"),
    backend: str = typer.Option(
        "auto",
        help="Load models as TransformerLens HookedTransformers or TransformerBridges "
        "(auto: HookedTransformer on TransformerLens 3.x, bridge on 4.x).",
        metavar="auto|hooked|bridge",
    ),
    batch_size: int = typer.Option(16, min=1, help="Prompts per pass.", metavar="N"),
    kinds: str = typer.Option(
        "informative,upstream,downstream", help="Comma-separated score kinds.", metavar="KIND,..."
    ),
    ablation: str = typer.Option(
        None,
        help="y* for upstream: mean, zero or resample (default: the convention's).",
        metavar="mean|zero|resample",
    ),
    convention: str = typer.Option(
        "paper", help="paper or authors_code (linear scores only).", metavar="paper|authors_code"
    ),
    per: str = typer.Option(
        "token", help="Exact scores per token or per component.", metavar="token|component"
    ),
    top_k: int = typer.Option(
        None,
        min=1,
        help="Exact scores only for the K components the linear scores rank highest.",
        metavar="K",
    ),
    layers: str = typer.Option(
        None, help="Exact scores only for these layers, e.g. '0,3'.", metavar="L,..."
    ),
    distributed: bool = typer.Option(
        False, help="Data-parallel over the processes of `torchrun` (gloo/NCCL)."
    ),
) -> None:
    """Score a finetuned model against its base on a dataset, save the scores and an HTML report."""
    methods = {"both": ("linear", "causal"), "all": ("linear", "integrated", "causal")}.get(
        method, (method,)
    )
    if any(m not in ("linear", "integrated", "causal") for m in methods):
        raise typer.BadParameter("--method must be linear, integrated, causal, both or all.")
    if steps != "auto" and not (steps.isdigit() and int(steps) >= 1):
        raise typer.BadParameter(f"--steps takes a positive whole number or 'auto', got {steps!r}.")
    n_steps: int | str = steps if steps == "auto" else int(steps)
    if compute_dtype is not None and compute_dtype not in (
        "float32",
        "float64",
        "bfloat16",
        "float16",
    ):
        raise typer.BadParameter("--compute-dtype must be float32, float64, bfloat16 or float16.")
    if convention == "authors_code" and methods != ("linear",):
        raise typer.BadParameter(
            "exact and integrated scores exist only in the paper convention: use --method "
            "linear with --convention authors_code."
        )
    _check_out_dir(out)
    kind_list = [k.strip() for k in kinds.split(",") if k.strip()]
    layer_list = _int_list(layers, "--layers") if layers else None
    common: dict[str, Any] = dict(
        reward=reward,
        batch_size=batch_size,
        compute_dtype=compute_dtype,
        kinds=kind_list,
        ablation=ablation,
    )
    from extractive_lens import WeightDiff, make_batch
    from extractive_lens.datasets import load_pairs
    from extractive_lens.distributed import distributed_scores, process_group
    from extractive_lens.plotting import report

    with contextlib.ExitStack() as group:
        rank = 0
        if distributed:
            rank, world, device = group.enter_context(
                process_group(None if device == "cpu" else device)
            )
            if rank == 0:
                _echo(f"{world} processes, rank 0 on {device}")

        try:
            pairs = load_pairs(data)
        except (ValueError, FileNotFoundError) as e:
            raise typer.BadParameter(str(e)) from None
        if (finetuned is None) == (diff is None):
            raise typer.BadParameter("give exactly one of --finetuned DIR or --diff FILE.")
        base_m = _load_model(base, dtype, device, backend)
        if diff is not None:
            delta = WeightDiff.load(diff)
        else:
            ft_m = _load_model(finetuned, dtype, device, backend)
            delta = WeightDiff.from_models(base_m, ft_m)
            del ft_m
        try:
            batch = make_batch(base_m, pairs)
        except ValueError as e:
            raise typer.BadParameter(f"{data}: {e}") from None
        out.mkdir(parents=True, exist_ok=True)
        results = []
        lin = None
        if "linear" in methods:
            lin = distributed_scores(
                "linear", base_m, delta, batch, convention=convention, **common
            )
            results.append(lin)
        if "integrated" in methods:
            results.append(
                distributed_scores(
                    "integrated",
                    base_m,
                    delta,
                    batch,
                    per=per,
                    steps=n_steps,
                    layers=layer_list,
                    top_k=top_k,
                    linear=lin if top_k else None,
                    **{**common, "ablation": ablation or "mean"},
                )  # fmt: skip
            )
        if "causal" in methods:
            ex = distributed_scores(
                "causal",
                base_m,
                delta,
                batch,
                per=per,
                top_k=top_k,
                layers=layer_list,
                linear=lin if top_k else None,
                **{**common, "ablation": ablation or "mean"},
            )
            results.append(ex)
        if rank != 0:
            return
        import uuid

        from extractive_lens.files import write_text_atomic

        run_id = uuid.uuid4().hex[:12]  # in each result: `report` refuses a mix of two runs
        for r in results:
            r.metadata["run_id"] = run_id
            r.save(out / r.method)
        cmps = comparisons(results)
        for c in cmps:
            a, b = c.methods
            name = "comparison.csv" if c.methods == ("linear", "causal") else f"{a}_vs_{b}.csv"
            write_text_atomic(out / name, c.summary.to_csv(index=False))
        path = report(results, cmps or None, path=out / "report.html")
        for r in results:
            _print_top(r)
        _echo(f"wrote {out}/ (report: {path})")


def comparisons(results: list[Any]) -> list[Any]:
    """Each approximation against the exact scores where there are exact ones, else linear
    against integrated."""
    from extractive_lens import compare

    by = {r.method: r for r in results}
    ref = by.get("causal") or by.get("integrated")
    if ref is None:
        return []
    return [compare(r, ref) for r in results if r is not ref and r.method != "causal"]


def _check_out_dir(out: Path) -> None:
    """``--out DIR`` must be (or become) a directory: said before any work is done."""
    if out.exists() and not out.is_dir():
        raise typer.BadParameter(f"--out {out} is a file; give a directory to write into.")
    _check_parent(out)


def _check_out_file(out: Path) -> None:
    """``--out FILE`` must be writable where it is: said before any work is done."""
    if out.is_dir():
        raise typer.BadParameter(
            f"--out {out} is a directory; give a file name, e.g. {out}/diff.safetensors."
        )
    _check_parent(out)


def _check_parent(out: Path) -> None:
    import os

    parent = out.absolute().parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise typer.BadParameter(f"--out {out}: {parent} is a file, not a directory.")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise typer.BadParameter(f"--out {out}: {parent} is not writable; choose another place.")


def _int_list(text: str, option: str) -> list[int]:
    try:
        return [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise typer.BadParameter(f"{option} takes integers like '0,3', got {text!r}") from None


@app.command()
def report(
    scores_dir: Path = typer.Argument(
        ...,
        help="A directory written by `extractive-lens score --out` (or by ComponentScores.save()).",
        metavar="SCORES_DIR",
    ),
    out: Path = typer.Option(
        None, help="The HTML file to write (default: SCORES_DIR/report.html).", metavar="PATH"
    ),
    title: str = typer.Option("extractive_lens report", help="The report's title.", metavar="TEXT"),
) -> None:
    """Re-render saved scores (linear and/or exact) into one self-contained HTML report."""
    from extractive_lens import ComponentScores
    from extractive_lens.plotting import report as write_report

    if (scores_dir / "scores.json").is_file():
        results = [ComponentScores.load(scores_dir)]
    else:
        results = [
            ComponentScores.load(scores_dir / m)
            for m in ("linear", "integrated", "causal")
            if (scores_dir / m).is_dir()
        ]
    if not results:
        raise typer.BadParameter(
            f"{scores_dir} holds no saved scores (scores.json, or linear/, integrated/ and "
            "causal/ subdirectories as `extractive-lens score --out` writes them)."
        )
    runs = {r.metadata.get("run_id") for r in results}
    if len(results) >= 2 and None not in runs and len(runs) >= 2:
        names = " and ".join(f"{r.method}/" for r in results)
        raise typer.BadParameter(
            f"{scores_dir}: {names} come from two different `score` runs (one was "
            "interrupted, or the folder was reused); score again into an empty --out."
        )
    cmps = []
    try:
        cmps = comparisons(results)
    except ValueError as e:
        _echo(f"not comparing the methods' scores: {e}")
    path = write_report(results, cmps or None, path=out or scores_dir / "report.html", title=title)
    _echo(f"wrote {path}")


def _batch(model: Any, data: Path) -> Any:
    from extractive_lens import make_batch
    from extractive_lens.datasets import load_pairs

    try:
        return make_batch(model, load_pairs(data))
    except (ValueError, FileNotFoundError) as e:
        raise typer.BadParameter(str(e)) from None


@app.command()
def finetune(
    model: str = typer.Option(
        ..., help="'world', a local checkpoint directory or a hub name.", metavar="MODEL"
    ),
    data: Path = typer.Option(
        ..., help="Facts to finetune on (.json, .jsonl, .csv).", metavar="FILE"
    ),
    out: Path = typer.Option(
        Path("diff.safetensors"), help="Where to save the weight change.", metavar="PATH"
    ),
    lr: float | None = typer.Option(
        None,
        help="Learning rate [default: a bundled world's own recipe (v3 3e-4, v2 1e-3), else 1e-3].",
        metavar="RATE",
        show_default=False,
    ),
    epochs: int = typer.Option(20, min=1, help="Passes over the facts.", metavar="N"),
    batch_size: int = typer.Option(8, min=1, help="Facts per step.", metavar="N"),
    optimizer: str = typer.Option("adam", help="adam or adamw.", metavar="adam|adamw"),
    schedule: str = typer.Option(
        "constant", help="constant or linear (10% warm-up, then decay).", metavar="constant|linear"
    ),
    seed: int = typer.Option(0, help="Seed for the data order.", metavar="N"),
    trainable: str = typer.Option(
        "all",
        help="'all' or comma-separated components, e.g. 'L0MLP,L1H2'.",
        metavar="COMPONENT,...",
    ),
    layers: str = typer.Option(None, help="Train only these blocks, e.g. '0,1'.", metavar="L,..."),
    dtype: str = typer.Option(
        "float32", help="Model dtype (float32, bfloat16, float64).", metavar="DTYPE"
    ),
    device: str = typer.Option("cpu", help="cpu or cuda.", metavar="DEVICE"),
    backend: str = typer.Option(
        "auto",
        help="Load models as TransformerLens HookedTransformers or TransformerBridges "
        "(auto: HookedTransformer on TransformerLens 3.x, bridge on 4.x).",
        metavar="auto|hooked|bridge",
    ),
) -> None:
    """Finetune on (prompt, answer) pairs (loss on answer tokens) and save the weight change."""
    from extractive_lens import FinetuneConfig
    from extractive_lens import finetune as run_finetune

    _check_out_file(out)
    m = _load_model(model, dtype, device, backend)
    batch = _batch(m, data)
    if lr is None:
        from extractive_lens.world.model import finetune_recipes, world_info

        info = world_info(m)  # {} for models that are not a bundled world
        lr = finetune_recipes(info.get("version", 2))[0]["lr"] if info else 1e-3
    try:
        cfg = FinetuneConfig(
            lr=lr,
            epochs=epochs,
            batch_size=batch_size,
            optimizer=optimizer,  # type: ignore[arg-type]
            schedule=schedule,  # type: ignore[arg-type]
            seed=seed,  # type: ignore[arg-type]
            trainable="all" if trainable == "all" else tuple(trainable.split(",")),
            layers=tuple(_int_list(layers, "--layers")) if layers else None,
        )
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    delta = run_finetune(m, batch, cfg)
    delta.save(out)
    _echo(
        f"finetuned {model} on {len(batch)} examples (lr {lr:g}); saved Δ (‖Δ‖ = {delta.norm():.4g}) to {out}"
    )


@app.command()
def rank(
    model: str = typer.Option(
        ..., help="'world', a local checkpoint directory or a hub name.", metavar="MODEL"
    ),
    data: Path = typer.Option(
        ..., help="Prompts, answers and candidates (.json, .jsonl, .csv).", metavar="FILE"
    ),
    diff: Path = typer.Option(None, help="A saved weight change to apply first.", metavar="DIR"),
    dtype: str = typer.Option(
        "float32", help="Model dtype (float32, bfloat16, float64).", metavar="DTYPE"
    ),
    device: str = typer.Option("cpu", help="cpu or cuda.", metavar="DEVICE"),
    backend: str = typer.Option(
        "auto",
        help="Load models as TransformerLens HookedTransformers or TransformerBridges "
        "(auto: HookedTransformer on TransformerLens 3.x, bridge on 4.x).",
        metavar="auto|hooked|bridge",
    ),
) -> None:
    """Mean rank of the answer among the candidates (0 = always top; chance (n-1)/2)."""
    from extractive_lens import WeightDiff, mean_rank

    m = _load_model(model, dtype, device, backend)
    batch = _batch(m, data)
    if batch.candidates is None:
        raise typer.BadParameter("rank needs candidates in the data file (a 'candidates' field).")
    delta = WeightDiff.load(diff) if diff is not None else None
    chance = (int((batch.candidates[0] >= 0).sum()) - 1) / 2
    _echo(
        f"mean rank {mean_rank(m, batch, delta):.2f} over {len(batch)} prompts (chance {chance:.1f})"
    )


def _print_top(scores: Any, k: int = 5) -> None:
    _echo(f"\ntop {k} components by |whole-component {scores.method} score|:")
    for kind in scores.kinds:
        items = ", ".join(f"{lab} {val:+.3g}" for _, lab, val in scores.top(k, kind))
        missing = len(scores.uncomputed(kind))
        note = f"  ({missing} components not computed)" if missing else ""
        _echo(f"  {kind:<12} {items or '-'}{note}")


@app.command()
def demo(
    out: Path = typer.Option(
        Path("report.html"), help="Where to write the HTML report.", metavar="PATH"
    ),
    seed: int = typer.Option(0, help="Seed for finetuning.", metavar="N"),
    random_model: bool = typer.Option(
        False, help="Use a random small model instead of the world model."
    ),
) -> None:
    """Finetune the bundled world model on 20 new facts, show whether their implications follow,
    score every head and MLP on the implications (linear and exact), compare and write a report."""
    from extractive_lens.demo import run_demo, run_world_demo

    (run_demo if random_model else run_world_demo)(out=out, seed=seed, echo=_echo)


DATASETS = ("first-hop", "second-hop")


@app.command()
def data(
    name: str = typer.Argument(
        ..., help="first-hop or second-hop: the bundled world's 20 test facts.", metavar="DATASET"
    ),
    out: Path = typer.Option(
        Path("."), help="Directory for facts.jsonl and implications.jsonl.", metavar="DIR"
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
    from extractive_lens.world import data as world_data

    version = _world_version(world)
    w = world_data.build_world() if version is None else world_data.build_world(version=version)
    ds = (world_data.first_hop if name == "first-hop" else world_data.second_hop)(w)
    if out.exists() and not out.is_dir():
        raise typer.BadParameter(f"--out {out} is a file; give a directory.")
    out.mkdir(parents=True, exist_ok=True)
    for file, pairs, cands in (
        ("facts.jsonl", ds.facts, ds.fact_candidates),
        ("implications.jsonl", ds.implications, ds.implication_candidates),
    ):
        rows = [
            {"prompt": p.prompt, "answer": p.answer, "candidates": list(cands),
             "template": p.template, "slots": dict(p.slots or {})}
            for p in pairs
        ]  # fmt: skip
        (out / file).write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    _echo(f"wrote {out / 'facts.jsonl'} and {out / 'implications.jsonl'} ({len(ds)} pairs each)")


def _world_version(name: str) -> int | None:
    """``--world``: ``default`` -> None (the bundled default), ``v2`` -> 2, ``v3`` -> 3."""
    from extractive_lens.world.model import WORLDS

    versions: dict[str, int | None] = {"default": None, **WORLDS}
    if name not in versions:
        raise typer.BadParameter(f"--world takes v2, v3 or default, got {name!r}")
    return versions[name]


def _parse_seeds(text: str) -> list[int]:
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
    version = _world_version(world)
    t0 = time.perf_counter()
    run = run_experiment(name, _parse_seeds(seeds), out, quick=quick, version=version)
    _echo(run.markdown())
    _echo(f"\nwrote {out / name}/ in {time.perf_counter() - t0:.0f} s")


@app.command()
def version() -> None:
    """Print the versions of extractive_lens, torch and TransformerLens."""
    import torch

    import extractive_lens
    from extractive_lens.backend.loading import version as tl_version

    _echo(
        f"extractive_lens {extractive_lens.__version__}, torch {torch.__version__}, "
        f"transformer_lens {tl_version()}"
    )


ONE_LINE_ERRORS = (
    ValueError,
    TypeError,
    FileNotFoundError,
    NotImplementedError,
    PermissionError,
    IsADirectoryError,
    NotADirectoryError,
    FileExistsError,
    ImportError,
)


def _click_errors(name: str) -> Any:
    """Click's exception class ``name``, and typer's vendored copy of it where typer has one."""
    import click

    found = [getattr(click.exceptions, name)]
    try:
        from typer._click import exceptions as vendored

        found.append(getattr(vendored, name))
    except (ImportError, AttributeError):
        pass
    return tuple(found)


def main(argv: list[str] | None = None) -> None:
    """The ``extractive-lens`` entry point: a bad input ends in one line on stderr and exit code 2
    (a bug still shows its traceback)."""
    import sys

    try:
        code = app(args=argv, standalone_mode=False)
        # non-standalone typer *returns* exit codes (Ctrl-C becomes 130) instead of raising them
        if isinstance(code, int) and code != 0:
            if code == 130:
                typer.echo("interrupted", err=True)
            raise SystemExit(code)
    except (typer.Exit, *_click_errors("Exit")) as e:
        raise SystemExit(getattr(e, "exit_code", 0)) from None
    except _click_errors("NoArgsIsHelpError") as e:
        e.show()
        raise SystemExit(2) from None
    except _click_errors("ClickException") as e:  # usage errors: click's own message, on one line
        typer.echo(f"error: {' '.join(e.format_message().split())}", err=True)
        raise SystemExit(e.exit_code) from None
    except (KeyboardInterrupt, typer.Abort, *_click_errors("Abort")):
        typer.echo("interrupted", err=True)
        raise SystemExit(130) from None
    except ONE_LINE_ERRORS as e:
        typer.echo(f"error: {' '.join(str(e).split())}", err=True)
        raise SystemExit(2) from None
    sys.exit(0)


if __name__ == "__main__":  # pragma: no cover
    t0 = time.time()
    main()

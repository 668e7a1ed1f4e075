"""``extractive-lens finetune`` (facts -> a saved weight change) and ``rank`` (how the model
ranks the answers, with or without that change)."""

from __future__ import annotations

from pathlib import Path

import typer

from extractive_lens.cli.app import app, echo
from extractive_lens.cli.arguments import (
    check_out_file,
    check_seed,
    checkpoint_dir,
    int_list,
    load_batch,
    load_model,
    out_path,
    refuse_overwriting,
)


@app.command()
def finetune(
    model: str = typer.Option(
        ..., help="'world', a local checkpoint directory or a hub name.", metavar="MODEL"
    ),
    data: Path = typer.Option(
        ..., help="Facts to finetune on (.json, .jsonl, .csv).", metavar="FILE"
    ),
    out: Path = typer.Option(
        Path("diff.safetensors"),
        help="Where to save the weight change.",
        metavar="PATH",
        parser=out_path,
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
    keep: str = typer.Option(
        None,
        help="Record the trajectory: a checkpoint after every epoch ('epochs') or every N "
        "optimiser steps, into --trajectory (for `extractive-lens trajectory`).",
        metavar="epochs|N",
    ),
    trajectory: Path = typer.Option(
        None, help="The folder --keep writes the checkpoints into (new or empty).", metavar="DIR"
    ),
) -> None:
    """Finetune on (prompt, answer) pairs (loss on answer tokens) and save the weight change."""
    from extractive_lens import FinetuneConfig
    from extractive_lens import finetune as run_finetune

    check_seed(seed)
    check_out_file(out)
    kept: str | int | None = keep
    if keep is not None and keep != "epochs":
        if not keep.isdigit() or int(keep) < 1:
            raise typer.BadParameter(
                f"--keep must be 'epochs' or a number of steps >= 1, got {keep!r}."
            )
        kept = int(keep)
    if (keep is None) != (trajectory is None):
        raise typer.BadParameter(
            "--keep and --trajectory go together: --keep epochs --trajectory DIR records a "
            "checkpoint per epoch into DIR."
        )
    refuse_overwriting([out], [("--data", data), ("--model", checkpoint_dir(model))])
    m = load_model(model, dtype, device, backend)
    batch = load_batch(m, data)
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
            layers=tuple(int_list(layers, "--layers")) if layers else None,
        )
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    delta = run_finetune(m, batch, cfg, keep=kept, trajectory=trajectory)  # type: ignore[arg-type]
    for line in loss_lines(delta.metadata.get("losses", [])):
        echo(line)
    delta.save(out)
    echo(
        f"finetuned {model} on {len(batch)} examples (lr {lr:g}); saved Δ (‖Δ‖ = {delta.norm():.4g}) to {out}"
    )
    if trajectory is not None:
        echo(
            f"checkpoints in {trajectory}: extractive-lens trajectory --checkpoints {trajectory} ..."
        )


def loss_lines(losses: list[float], most: int = 20) -> list[str]:
    """The mean training loss of each epoch, one line each (every k-th epoch and the last when
    there are more than ``most``)."""
    if not losses:
        return []
    every = -(-len(losses) // most)
    shown = sorted({*range(0, len(losses), every), len(losses) - 1})
    head = "training loss (nats per answer, mean over the epoch)"
    lines = [f"{head}{f', shown every {every} epochs' if every > 1 else ''}:"]
    width = len(str(len(losses)))
    return lines + [f"  epoch {e + 1:>{width}}  {losses[e]:.4f}" for e in shown]


@app.command()
def rank(
    model: str = typer.Option(
        ..., help="'world', a local checkpoint directory or a hub name.", metavar="MODEL"
    ),
    data: Path = typer.Option(
        ..., help="Prompts, answers and candidates (.json, .jsonl, .csv).", metavar="FILE"
    ),
    diff: Path = typer.Option(
        None, help="A saved weight change to apply first (a .safetensors file).", metavar="FILE"
    ),
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

    m = load_model(model, dtype, device, backend)
    batch = load_batch(m, data)
    if batch.candidates is None:
        raise typer.BadParameter("rank needs candidates in the data file (a 'candidates' field).")
    delta = WeightDiff.load(diff) if diff is not None else None
    chance = (int((batch.candidates[0] >= 0).sum()) - 1) / 2
    echo(
        f"mean rank {mean_rank(m, batch, delta):.2f} over {len(batch)} prompts (chance {chance:.1f})"
    )

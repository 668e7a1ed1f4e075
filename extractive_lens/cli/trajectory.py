"""``extractive-lens trajectory``: scores along a finetune's checkpoints (the folder
``finetune --keep`` wrote, or a Hugging Face Trainer's ``checkpoint-*`` folders), saved with
their page."""

from __future__ import annotations

from pathlib import Path

import typer

from extractive_lens.cli.app import app, echo
from extractive_lens.cli.arguments import (
    check_out_dir,
    checkpoint_dir,
    load_batch,
    load_model,
    out_path,
    refuse_overwriting,
)


@app.command()
def trajectory(
    base: str = typer.Option(
        ..., help="The base model the finetune started from: 'world', a local checkpoint "
        "directory or a name (as in `score --base`).", metavar="MODEL",
    ),
    checkpoints: Path = typer.Option(
        ..., help="The folder `finetune --keep ... --trajectory DIR` wrote, or a Hugging Face "
        "Trainer's output_dir (checkpoint-* folders: full models or peft adapters).",
        metavar="DIR",
    ),
    data: Path = typer.Option(
        ..., help="Prompts and answers (.json, .jsonl, .csv).", metavar="FILE"
    ),
    out: Path = typer.Option(
        Path("trajectory"), help="Directory to write maps/, along/ and trajectory.html into.",
        metavar="DIR", parser=out_path,
    ),
    method: str = typer.Option(
        "linear", help="The maps of D_k at each checkpoint: linear, causal (exact) or integrated.",
        metavar="linear|causal|integrated",
    ),
    kinds: str = typer.Option(
        "informative", help="Comma-separated score kinds of the maps.", metavar="KIND,..."
    ),
    along: bool = typer.Option(
        True, "--along/--no-along",
        help="Also integrate the informative score along the training path (its completeness "
        "error is printed).",
    ),
    steps: int = typer.Option(4, min=1, help="Quadrature nodes per segment.", metavar="N"),
    dtype: str = typer.Option(
        "float32", help="Model dtype (float32, bfloat16, float64).", metavar="DTYPE"
    ),
    device: str = typer.Option("cpu", help="cpu or cuda.", metavar="DEVICE"),
    backend: str = typer.Option(
        "auto", help="Load models as TransformerLens HookedTransformers or TransformerBridges "
        "(auto: HookedTransformer on TransformerLens 3.x, bridge on 4.x).",
        metavar="auto|hooked|bridge",
    ),
) -> None:  # fmt: skip
    """Score D_k = W_k - W_0 at every checkpoint of a finetune (maps over time) and the
    informative score integrated along its path; save both and a page with their figures."""
    from extractive_lens.trajectory import MANIFEST

    if not checkpoints.is_dir():
        raise typer.BadParameter(
            f"--checkpoints {checkpoints} is not a folder: pass the folder `finetune --keep "
            "epochs --trajectory DIR` wrote, or a Trainer's output_dir."
        )
    check_out_dir(out)
    refuse_overwriting(
        [out / "trajectory.html", out / "maps", out / "along"],
        [("--data", data), ("--checkpoints", checkpoints), ("--base", checkpoint_dir(base))],
    )
    from extractive_lens.types import SCORE_KINDS

    kind_list = [k.strip() for k in kinds.split(",") if k.strip()]
    unknown = [k for k in kind_list if k not in SCORE_KINDS]
    if unknown or not kind_list:
        raise typer.BadParameter(
            f"--kinds {kinds!r}: choose from {', '.join(SCORE_KINDS)}, e.g. --kinds informative."
        )
    chosen = tuple(k for k in SCORE_KINDS if k in kind_list)
    import extractive_lens as el
    from extractive_lens import trajectory_plots as tp

    model = load_model(base, dtype, device, backend)
    if (checkpoints / MANIFEST).exists():
        traj = el.Trajectory.load(checkpoints)
    else:
        traj = el.Trajectory.from_checkpoints(model, checkpoints)
    batch = load_batch(model, data)
    echo(f"{len(traj)} checkpoints (steps {traj.steps[1:]}), {len(batch)} prompts")
    maps = el.trajectory_scores(model, traj, batch, method=method, kinds=chosen)
    maps.save(out / "maps")
    path = None
    if along:
        path = el.trajectory_integrated(model, traj, batch, steps=steps)
        path.save(out / "along")
        info = path.metadata["integrated"]
        echo(
            f"along the path: Σ informative + other misses R(W_T) - R(W_0) = "
            f"{info['R_change']:.4g} by {info['completeness']['informative']:.2%} "
            f"({steps} nodes per segment)"
        )
    page = tp.report(maps, out / "trajectory.html", along=path)
    echo(f"saved the maps ({method}) to {out / 'maps'}" + (f", the path integral to "
         f"{out / 'along'}" if along else "") + f"; page: {page}")  # fmt: skip

"""``extractive-lens report``: saved scores re-rendered into one HTML report."""

from __future__ import annotations

import os
from pathlib import Path

import typer

from extractive_lens.cli.app import app, echo
from extractive_lens.cli.arguments import check_out_file, out_path, refuse_overwriting
from extractive_lens.cli.score import SAVED, comparisons


@app.command()
def report(
    scores_dir: Path = typer.Argument(
        ...,
        help="A directory written by `extractive-lens score --out` (or by ComponentScores.save()).",
        metavar="SCORES_DIR",
    ),
    out: Path = typer.Option(
        None,
        help="The HTML file to write (default: SCORES_DIR/report.html).",
        metavar="PATH",
        parser=out_path,
    ),
    title: str = typer.Option("extractive_lens report", help="The report's title.", metavar="TEXT"),
) -> None:
    """Re-render saved scores (linear and/or exact) into one self-contained HTML report."""
    from extractive_lens import ComponentScores
    from extractive_lens.plotting import report as write_report
    from extractive_lens.scoring.methods import METHODS

    if os.path.lexists(scores_dir / "scores.json"):  # a FIFO there: ComponentScores.load says
        saved = [scores_dir]
    else:
        saved = [scores_dir / m for m in METHODS]  # `score --out` saves each in out/<method>/
        saved = [d for d in saved if d.is_dir() and (d / "scores.json").exists()]
    path = out or scores_dir / "report.html"
    check_out_file(path)
    scores_files = [f for d in saved for pattern in SAVED for f in d.glob(pattern)]
    refuse_overwriting([path], [("the saved scores", f) for f in scores_files])
    results = [ComponentScores.load(d) for d in saved]
    if not results:
        raise typer.BadParameter(
            f"{scores_dir} holds no saved scores (scores.json, or "
            + ", ".join(f"{m}/" for m in METHODS)
            + " subdirectories as `extractive-lens score --out` writes them)."
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
        echo(f"not comparing the methods' scores: {e}")
    path = write_report(results, cmps or None, path=path, title=title)
    echo(f"wrote {path}")

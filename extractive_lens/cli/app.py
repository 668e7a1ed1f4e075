"""The one ``typer`` app every command module registers on, and how the commands print."""

from __future__ import annotations

import typer

app = typer.Typer(
    help="Where does a finetuned fact live, and how does the model use it? Extractive-structure scores.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_show_locals=False,
    rich_markup_mode=None,  # plain click help: no '<bool>' metavars, wraps at words
)


def echo(msg: str) -> None:
    """Print one line of a command's output on stdout."""
    typer.echo(msg, err=False)

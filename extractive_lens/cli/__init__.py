"""``extractive-lens``: the command line. It parses arguments and calls the public API.

    extractive-lens demo --out report.html
    extractive-lens score --base BASE_DIR --finetuned FT_DIR --data pairs.jsonl --method both --out out/

One module per command group: ``score``, ``report``, ``finetune`` (and ``rank``),
``trajectory`` (scores along a finetune's checkpoints), ``world``
(``demo``, ``data``, ``experiment``); ``arguments`` holds the checks they share and ``app`` the
typer app they register on. torch and TransformerLens are imported lazily, inside the commands,
so ``--help`` is instant.
"""

from __future__ import annotations

from typing import Any

import typer

from extractive_lens.cli.app import app, echo

# the command modules register on `app` when imported: this order is the order of `--help`
# isort: off
from extractive_lens.cli import score, report, finetune, trajectory, world  # noqa: F401, E402
# isort: on

__all__ = ["app", "main"]


@app.command()
def version() -> None:
    """Print the versions of extractive_lens, torch and TransformerLens."""
    import torch

    import extractive_lens
    from extractive_lens.backend.installed import version as tl_version

    echo(
        f"extractive_lens {extractive_lens.__version__}, torch {torch.__version__}, "
        f"transformer_lens {tl_version()}"
    )


ONE_LINE_ERRORS = (ValueError, TypeError, OSError, NotImplementedError, ImportError)


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
    """The ``extractive-lens`` entry point: a bad input, a full disk or a read-only folder ends in
    one line on stderr and exit code 2, a Python warning in one ``warning:`` line (a bug still
    shows its traceback)."""
    import sys
    import warnings

    def one_line(message: Any, *args: Any, **kwargs: Any) -> str:
        return f"warning: {' '.join(str(message).split())}\n"

    try:
        with warnings.catch_warnings():
            warnings.formatwarning = one_line  # not the file and source line it was raised at
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
    except Exception as e:
        line = file_system_error(e)
        if line is None and isinstance(e, ONE_LINE_ERRORS):
            line = " ".join(str(e).split())
        if line is None:
            raise
        typer.echo(f"error: {line}", err=True)
        raise SystemExit(2) from None
    sys.exit(0)


def file_system_error(e: BaseException) -> str | None:
    """One sentence for an error the operating system raised (a full disk, a read-only folder, a
    denied permission), also when a library (safetensors) passes it on inside its own error;
    ``None`` for anything else."""
    import errno
    import os
    import re

    if isinstance(e, OSError) and e.errno is not None and e.strerror:
        code, name = e.errno, e.filename
    else:
        found = re.search(r"\(os error (\d+)\)", str(e))
        if found is None:
            return None
        code, name = int(found.group(1)), None
        if quoted := re.search(r'at path "([^"]+)"', str(e)):
            name = quoted.group(1)
    where = ""
    if name is not None:
        path = os.fsdecode(name)
        base = os.path.basename(path)
        # a temporary file beside the output (files.replacing, safetensors): name its folder
        temporary = base.startswith(".") and (base.endswith(".tmp") or base.startswith(".tmp"))
        where = f" in {os.path.dirname(path) or '.'}" if temporary else f": {path}"
    if code in (errno.ENOSPC, errno.EDQUOT):
        return f"no space left on the device{where}; free some space, or write elsewhere (--out)."
    if code == errno.EROFS:
        return f"read-only file system{where}; write elsewhere (--out)."
    if code in (errno.EACCES, errno.EPERM):
        return f"permission denied{where}; check the permissions, or use another path."
    return f"{os.strerror(code)}{where}."

"""Progress bars that render where the researcher is, and stay out of logs.

One rule for every long loop (scoring, finetuning, pretraining, experiment sweeps):

- ``show_progress=True`` always shows a bar, ``False`` never does;
- ``None`` (the default) shows one in a terminal or a Jupyter kernel, and none when stderr is a
  file or a pipe (a log, CI, ``make demo > log``), where carriage-return updates garble the text.

In Jupyter the bar is tqdm's widget when ``ipywidgets`` is installed (``pip install
"extractive_lens[notebook]"``), else tqdm's text bar, without tqdm's "IProgress not found"
warning.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import Any


def in_notebook() -> bool:
    """Whether we run inside a Jupyter kernel."""
    shell = sys.modules.get("IPython")
    if shell is None:
        return False
    try:
        ip = shell.get_ipython()  # type: ignore[attr-defined]
    except Exception:  # pragma: no cover - an IPython without a shell
        return False
    return ip is not None and type(ip).__name__ == "ZMQInteractiveShell"


def interactive() -> bool:
    """A terminal or a notebook: somewhere a bar redraws in place."""
    try:
        tty = sys.stderr.isatty()
    except (AttributeError, ValueError):  # replaced or closed stderr
        tty = False
    return tty or in_notebook()


def _bar_class() -> Any:
    if in_notebook():
        try:
            import ipywidgets  # noqa: F401
            from tqdm.notebook import tqdm as notebook_bar

            return notebook_bar
        except ImportError:
            pass
    from tqdm.std import tqdm as text_bar

    return text_bar


def bar(
    iterable: Iterable[Any],
    *,
    total: int | None = None,
    desc: str,
    enabled: bool | None = None,
    min_steps: int = 2,
) -> Any:
    """``iterable`` wrapped in a bar when ``enabled`` (``None``: when interactive and the loop has
    at least ``min_steps`` steps), else ``iterable`` itself. The bar disappears when done."""
    if total is None:
        total = len(iterable) if hasattr(iterable, "__len__") else None  # type: ignore[arg-type]
    if enabled is False:
        return iterable
    if enabled is None and (not interactive() or (total is not None and total < min_steps)):
        return iterable
    return _bar_class()(iterable, total=total, desc=desc, leave=False, file=sys.stderr)

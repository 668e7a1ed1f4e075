"""The libraries underneath: which TransformerLens is installed (read from package metadata,
without importing it), what the loaders build with it (``resolve_backend``), and TransformerLens
and ``transformers`` kept quiet inside our own calls.

>>> isinstance(has_hooked(), bool)
True
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any


def version() -> str:
    """The installed TransformerLens version (its package metadata: 3.x has no ``__version__``)."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as package_version

    try:
        return package_version("transformer-lens")
    except PackageNotFoundError:
        import transformer_lens

        return str(getattr(transformer_lens, "__version__", "unknown"))


def has_hooked() -> bool:
    """Whether the installed TransformerLens has ``HookedTransformer`` (3.x; 4.0 removed it)."""
    return version().startswith(("0.", "1.", "2.", "3."))


@contextlib.contextmanager
def quiet_transformer_lens() -> Iterator[None]:
    """Silence TransformerLens 3.x's deprecation warnings inside our own calls only."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=DeprecationWarning)
        warnings.filterwarnings("ignore", category=FutureWarning)
        warnings.filterwarnings("ignore", message=".*HookedTransformer.*")
        # TransformerLens imports tqdm.auto, which warns in a notebook without ipywidgets
        warnings.filterwarnings("ignore", message="IProgress not found")
        yield


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """No Hugging Face loading bars or config notices inside our own loading calls (restored
    after): a researcher loading two checkpoints should see our output, not theirs."""
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()


def import_transformer_lens() -> Any:
    """The ``transformer_lens`` module, imported quietly."""
    with quiet_transformer_lens():
        import transformer_lens

    return transformer_lens


def bridge_class() -> Any:
    """TransformerLens's ``TransformerBridge`` class, imported quietly: importing it sets Hugging
    Face's logging to errors only (TransformerLens 4), which must not outlive our own call."""
    with quiet_transformer_lens(), quiet_transformers():
        from transformer_lens.model_bridge import TransformerBridge
    return TransformerBridge


def hooked_tl(what: str) -> Any:
    """TransformerLens, for building a ``HookedTransformer``; on TransformerLens 4 (which removed
    it) an error that says what to pass or install instead."""
    if not has_hooked():
        raise ImportError(
            f"{what} builds a HookedTransformer, which TransformerLens {version()} removed. Pass "
            "backend='bridge' (or 'auto', the default) for a TransformerBridge, or install "
            "TransformerLens 3.9 (pip install 'transformer-lens>=3.9,<4') for HookedTransformers."
        )
    return import_transformer_lens()


BACKEND_NAMES = ("hooked", "bridge")
"""What the loaders build (``backend=``): a ``HookedTransformer`` or a ``TransformerBridge``;
``"auto"`` (the default) picks the first where the installed TransformerLens has it."""


def resolve_backend(backend: str | None) -> str:
    """``"hooked"`` or ``"bridge"`` for a loader's ``backend=`` argument: ``"auto"`` / ``None``
    give a ``HookedTransformer`` where TransformerLens has one (3.x), else a bridge (4.x).

    >>> resolve_backend("bridge")
    'bridge'
    """
    if backend is None or backend == "auto":
        return "hooked" if has_hooked() else "bridge"
    if backend not in BACKEND_NAMES:
        raise ValueError(f"backend must be 'auto', 'hooked' or 'bridge', got {backend!r}")
    if backend == "hooked":
        hooked_tl("backend='hooked'")
    return backend

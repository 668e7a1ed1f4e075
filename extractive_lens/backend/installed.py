"""Which TransformerLens is installed (read from package metadata, without importing it).

>>> isinstance(has_hooked(), bool)
True
"""

from __future__ import annotations


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

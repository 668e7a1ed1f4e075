"""The one checker for index-like and count arguments (``rows``, ``layers``, ``top_k``, ``steps``,
``max_batch`` ...), so that every function accepts and refuses the same things.

A whole number is an ``int`` or any integral number type (``numpy.int64``), never a ``bool``,
a float (``1.7`` and ``1.0`` alike: Python's own indexing refuses floats) or a string (``"10"``
is not the list ``[1, 0]``).

>>> indices("layers", [3, 1], "layer")
(3, 1)
>>> indices("layers", "10", "layer")
Traceback (most recent call last):
...
ValueError: layers takes a list of layer indices (whole numbers), e.g. layers=[0, 2], got '10'.
>>> count("top_k", 0, "components per kind (or None for all)")
Traceback (most recent call last):
...
ValueError: top_k must be a positive number of components per kind (or None for all), got 0
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable, Sequence
from typing import Any


def whole(x: Any) -> bool:
    """Whether ``x`` is a whole number (``int``, ``numpy.int64``; not ``bool``, float or str)."""
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def count(name: str, value: Any, what: str, *, hint: str = "") -> int:
    """``value`` as a positive ``int`` (``name`` and ``what`` say what it counts in the error)."""
    if not whole(value) or value < 1:
        raise ValueError(f"{name} must be a positive number of {what}, got {value!r}{hint}")
    return int(value)


def seed(name: str, value: Any) -> int:
    """``value`` as a seed: a whole number ``>= 0`` (what ``numpy.random.default_rng`` and
    ``torch.Generator().manual_seed`` both take as the same stream; ``1.5`` is not silently 1).

    >>> seed("seed", -1)
    Traceback (most recent call last):
    ...
    ValueError: seed must be a whole number >= 0 (the random draw's seed), got -1
    """
    if not whole(value) or value < 0:
        raise ValueError(
            f"{name} must be a whole number >= 0 (the random draw's seed), got {value!r}"
        )
    return int(value)


def indices(name: str, value: Any, noun: str) -> tuple[int, ...]:
    """``value`` (a list of whole numbers, at least one) as a tuple of ``int``, in its order.

    ``noun`` names what is indexed (``"prompt"``, ``"layer"``) in the errors; the range is
    checked where the size is known (``in_range``)."""
    example = f"e.g. {name}=[0, 2]"
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise ValueError(
            f"{name} takes a list of {noun} indices (whole numbers), {example}, got {value!r}."
        )
    items = list(value)
    if not items:
        raise ValueError(
            f"{name}=[] selects no {noun}s: pass at least one index, or leave {name} out "
            f"(None) for all."
        )
    bad = [x for x in items if not whole(x)]
    if bad:
        raise ValueError(
            f"{name} takes {noun} indices (whole numbers), got {items}: {bad} are not ({example})."
        )
    return tuple(int(x) for x in items)


def in_range(name: str, ids: Sequence[int], n: int, where: str) -> None:
    """Refuse indices outside ``0 .. n - 1`` (``where``: what they index, for the error)."""
    bad = [i for i in ids if not 0 <= i < n]
    if bad:
        raise ValueError(f"{name} {bad} out of range 0..{n - 1}: {name} must index the {where}.")

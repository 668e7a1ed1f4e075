"""The vocabulary: components, score kinds and the axis words used on every tensor.

>>> Component.parse("L3H2")
Component(layer=3, head=2)
>>> Component(3, None).label
'L3MLP'
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

ScoreKind = Literal["informative", "upstream", "downstream"]
SCORE_KINDS: tuple[ScoreKind, ...] = ("informative", "upstream", "downstream")
Method = Literal["linear", "integrated", "causal", "verified"]
Ablation = Literal["mean", "zero", "resample"]
Convention = Literal["paper", "authors_code"]

_LABEL = re.compile(r"^L(\d+)(?:H(\d+)|(MLP))$")


@dataclass(frozen=True, order=True)
class Component:
    """One attention head ``(layer, head)`` or one MLP ``(layer, None)``.

    Examples:
        >>> [c.label for c in iter_components(n_layers=1, n_heads=2)]
        ['L0H0', 'L0H1', 'L0MLP']
    """

    layer: int
    head: int | None = None

    def __post_init__(self) -> None:
        if self.layer < 0 or (self.head is not None and self.head < 0):
            raise ValueError(
                f"Component indices must be >= 0, got layer={self.layer}, head={self.head}"
            )

    @property
    def is_mlp(self) -> bool:
        return self.head is None

    @property
    def label(self) -> str:
        return f"L{self.layer}MLP" if self.head is None else f"L{self.layer}H{self.head}"

    @property
    def hook_name(self) -> str:
        """The TransformerLens hook holding this component's output.

        A head's is its layer's ``hook_z`` at index ``[:, :, head]`` (its write into the residual
        stream is that times ``W_O[head]``); an MLP's is its layer's ``hook_mlp_out``.

        >>> Component(3, 1).hook_name, Component(3).hook_name
        ('blocks.3.attn.hook_z', 'blocks.3.hook_mlp_out')
        """
        # The backend spells hook names; its table imports nothing of ours (no circle), and is
        # read at call time because the backend package itself imports this module.
        from extractive_lens.backend.hook_names import hook_name

        return hook_name(self.layer, self.head)

    @property
    def short_label(self) -> str:
        """The within-layer label used on the ``component`` axis: ``H2`` or ``MLP``."""
        return "MLP" if self.head is None else f"H{self.head}"

    @classmethod
    def parse(cls, label: str | Component) -> Component:
        if isinstance(label, Component):
            return label
        m = _LABEL.match(label.strip())
        if m is None:
            raise ValueError(
                f"Unknown component label {label!r}: use 'L<layer>H<head>' (e.g. 'L3H2') or "
                "'L<layer>MLP' (e.g. 'L3MLP')."
            )
        layer = int(m.group(1))
        return cls(layer, None if m.group(3) else int(m.group(2)))

    def __str__(self) -> str:
        return self.label

    def __repr__(self) -> str:
        return f"Component(layer={self.layer}, head={self.head})"


def iter_components(n_layers: int, n_heads: int, has_mlp: bool = True) -> Iterator[Component]:
    """Every component in the fixed order: the heads of a layer, then its MLP, layer by layer."""
    for layer in range(n_layers):
        for head in range(n_heads):
            yield Component(layer, head)
        if has_mlp:
            yield Component(layer, None)


def component_axis_labels(n_heads: int, has_mlp: bool = True) -> tuple[str, ...]:
    """Labels of the ``component`` axis of score tensors: ``("H0", ..., "MLP")``."""
    return tuple(f"H{h}" for h in range(n_heads)) + (("MLP",) if has_mlp else ())


def parse_components(
    components: Iterable[str | Component] | None, n_layers: int, n_heads: int, has_mlp: bool = True
) -> tuple[Component, ...] | None:
    """Parse and validate a user's component selection against a model's shape."""
    if components is None:
        return None
    if isinstance(components, (str, Component)):
        components = [components]
    out = []
    for c in components:
        comp = Component.parse(c)
        if comp.layer >= n_layers:
            raise ValueError(
                f"{comp.label}: the model has only {n_layers} layers (0..{n_layers - 1})."
            )
        if comp.head is not None and comp.head >= n_heads:
            raise ValueError(f"{comp.label}: the model has only {n_heads} heads per layer.")
        if comp.head is None and not has_mlp:
            raise ValueError(f"{comp.label}: this model is attention-only and has no MLPs.")
        out.append(comp)
    return tuple(dict.fromkeys(out))


def jsonable(obj: Any) -> Any:
    """Turn nested metadata into plain JSON types (tuples to lists, tensors to lists)."""
    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    if hasattr(obj, "tolist"):
        return obj.tolist()
    if isinstance(obj, (str, int, float, bool)) or obj is None:
        return obj
    return str(obj)

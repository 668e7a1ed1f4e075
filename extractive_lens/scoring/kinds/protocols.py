"""What a kind is (``Kind``: the functions a kind module provides) and what it reads of an
engine's chunk of prompts (``LinearChunk``, ``CausalChunk``).

The engines (``scoring/linear.py``, ``causal.py``, ``integrated.py``) import the kinds and hand
them their own chunk objects, which provide these fields; the kinds import only this module,
so the engines depend on the kinds and never the other way round (``tests/test_imports.py``
counts type-only imports too). Fields are read-only properties here (an engine may narrow a
field's type: ``LinearOptions`` for ``ScoreOptions``) except what a kind writes back.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from torch import Tensor

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from extractive_lens.batch import PromptBatch
    from extractive_lens.scoring.ablation import AblationTable
    from extractive_lens.scoring.options import ScoreOptions
    from extractive_lens.scoring.runs import Run
    from extractive_lens.weight_diff import WeightDiff

T = TypeVar("T")


class Chunk(Protocol):
    """What both engines' chunks carry: the model, Δ, the prompts and the base run on them."""

    @property
    def model(self) -> Any: ...
    @property
    def diff(self) -> WeightDiff: ...
    @property
    def batch(self) -> PromptBatch: ...
    @property
    def base(self) -> Run: ...
    @property
    def rows(self) -> list[int]: ...
    @property
    def table(self) -> AblationTable | None: ...
    @property
    def options(self) -> ScoreOptions: ...


class LinearChunk(Chunk, Protocol):
    """The linear engine's chunk (``linear.LinearChunk``): gradients at the base run, the
    finetuned run and its gradients where a kind ``needs`` them."""

    @property
    def deltas(self) -> Mapping[str, Tensor]: ...
    @property
    def g_z(self) -> Sequence[Tensor]: ...
    @property
    def ft(self) -> Run | None: ...
    @property
    def dtype(self) -> torch.dtype: ...
    @property
    def swept(self) -> dict[str, Tensor]: ...

    other: Tensor | None  # informative writes the "other" parameters' share here

    def new_scores(self) -> Tensor:
        """A zero ``[batch, layer, component, pos]`` tensor for one kind."""
        ...


class CausalChunk(Chunk, Protocol):
    """The exact engine's chunk (``causal.CausalChunk``; the integrated engine uses it too)."""

    def cached(self, key: str, make: Callable[[], T]) -> T:
        """``make()``, computed once per chunk (the finetuned run, ``y*``)."""
        ...


@dataclass(frozen=True)
class LayerStep:
    """One layer of a layer-major pass as a kind's ``layer_linear`` receives it: with
    ``g is None``, the layer's values are at hand (the chunk's run's, with the weights it ran
    at in force; ``finetuned``: the finetuned rows' values of the layer, a ``LayerRun``, where
    they ran); else ``ŷ'`` at one boundary of the layer, ``part`` (``"attn"``: its heads',
    ``"mlp"``: its MLP's), gradient ``g``."""

    layer: int
    finetuned: Any = None
    part: str | None = None
    g: Tensor | None = None


class Kind(Protocol):
    """A score kind: a module in ``scoring/kinds/`` (``__init__.py`` says what each function
    does; mypy checks every module in ``KINDS`` against this)."""

    @property
    def CONTEXTS(self) -> tuple[str, ...]: ...  # noqa: N802  (a module constant)

    def needs(self, options: ScoreOptions) -> set[str]: ...
    def capture(self, options: ScoreOptions) -> tuple[str, ...]: ...
    def linear(self, chunk: LinearChunk) -> Tensor: ...
    def layer_linear(self, chunk: LinearChunk, step: LayerStep, out: Tensor) -> None: ...
    def patch_values(self, chunk: CausalChunk, layer: int) -> tuple[Tensor, Tensor | None]: ...
    def exact(self, effects: dict[str, Any]) -> Any: ...

"""``WeightDiff``: the finetuning update ``Δ = W' - W``, keyed by TransformerLens parameter names.

>>> diff = WeightDiff.from_models(base, finetuned)
>>> with diff.applied(base):
...     logits = base(batch.tokens)    # the finetuned model's logits
>>> with diff.applied(base, components=["L3H2", "L2MLP"]):
...     logits = base(batch.tokens)    # only those components finetuned
>>> graft = diff + (diff - diff) * 0.5

Δ is held in float64 for float32/float64 models and in float32 for 16-bit models, so that
``W + Δ`` rounds back to ``W'`` exactly. ``applied`` copies the original tensors and restores
them on exit (never ``+= Δ`` then ``-= Δ``, which is not an exact round trip).

One job, Δ as a value: its algebra, restriction to components, norms and applying it. Where Δ
comes from (models, state dicts, checkpoints, adapters, files) is ``diff_sources/``; the file
format is ``diff_sources/files.py``. Each operation has a dense path and a low-rank one (a
``from_peft`` diff keeps its factors; ``backend/lowrank.py``).
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from extractive_lens import backend as B
from extractive_lens import diff_applying, diff_slices
from extractive_lens.arguments import in_range, indices
from extractive_lens.backend import ScorableModel, lowrank
from extractive_lens.backend.lowrank import LowRankDeltas
from extractive_lens.diff_applying import weights_set as weights_set
from extractive_lens.diff_sources import checkpoints, files, models
from extractive_lens.diff_sources import delta_dtype_for as delta_dtype_for
from extractive_lens.diff_sources.files import FORMAT_VERSION as FORMAT_VERSION
from extractive_lens.interrupts import finish_stale
from extractive_lens.types import Component, component_axis_labels, parse_components

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd

    from extractive_lens.batch import PromptBatch
    from extractive_lens.grafts import ComponentSpec, PositionSpec


@dataclass(frozen=True)
class WeightDiff:
    """A weight update for one architecture. Build with ``from_models`` or ``from_state_dicts``.

    Attributes:
        deltas: parameter name -> Δ tensor (float32 or wider; CPU or the models' device).
        signature: the architecture fields both models shared (``extractive_lens.model.signature``).
        metadata: free-form provenance (model names, finetuning config, ...).
    """

    deltas: Mapping[str, Tensor]
    signature: Mapping[str, Any]
    metadata: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.deltas, Mapping):
            raise TypeError(
                f"deltas must map parameter names to tensors, got {type(self.deltas).__name__}; build a "
                "WeightDiff with WeightDiff.from_models(base, finetuned)."
            )
        if not isinstance(self.signature, Mapping):
            raise TypeError(
                f"signature must be a mapping (model.signature(model)), got {type(self.signature).__name__}."
            )
        from extractive_lens.backend.lazy import LazyDeltas
        from extractive_lens.backend.lowrank import LowRankDeltas

        if isinstance(self.deltas, (LazyDeltas, LowRankDeltas)):
            return  # each tensor is checked (finite, shapes agree) when it is formed
        for name, d in self.deltas.items():
            if not isinstance(d, Tensor):
                raise TypeError(f"Δ[{name}] is a {type(d).__name__}, not a tensor.")
            if d.dtype not in (torch.float32, torch.float64):
                raise TypeError(
                    f"Δ[{name}] has dtype {d.dtype}; deltas must be float32 or float64."
                )
            if not torch.isfinite(d).all():
                raise ValueError(
                    f"Δ[{name}] contains NaN or inf: check the finetuned weights (or the file it came "
                    "from) before scoring."
                )
            want = B.expected_shape(name, self.signature)
            if want is not None and tuple(d.shape) != want:
                raise ValueError(
                    f"Δ[{name}] has shape {tuple(d.shape)}, but the model it was made for "
                    f"(its signature) has {want} there: the diff is damaged or was edited; "
                    "rebuild it with WeightDiff.from_models(base, finetuned)."
                )

    # ------------------------------------------------------------------ construction
    # Where Δ comes from: each source is a function in ``diff_sources`` returning its parts.
    @classmethod
    def from_models(
        cls,
        base: ScorableModel,
        finetuned: ScorableModel,
        *,
        device: str | torch.device | None = None,
        dtype: torch.dtype | None = None,
        on_demand: bool = False,
    ) -> WeightDiff:
        """Δ = finetuned - base, checked parameter by parameter.

        Args:
            device: where to keep Δ (default: the base model's parameters' device). Use
                ``"cpu"`` for large models; ``applied`` moves each tensor when it is used.
            dtype: Δ's dtype (default: ``delta_dtype_for(base.cfg.dtype)``).
            on_demand: hold no Δ: each tensor is formed when it is read, ``W' - W`` in
                ``dtype`` where the base weight is (or on ``device``), from the finetuned
                model's weights in their stored dtype. With the base model on the GPU and the
                finetuned one on the host, the host holds the finetuned weights (bf16: half of
                a float32 Δ) and each layer's Δ is formed on the GPU as scoring reads it, as
                ``from_checkpoints`` does from files. Do not change either model while the
                diff is in use: a finetuned weight changed in place is refused when read
                (make the diff again).
        """
        return cls(
            *models.from_models(base, finetuned, device=device, dtype=dtype, on_demand=on_demand)
        )

    @classmethod
    def from_state_dicts(
        cls,
        base: Mapping[str, Tensor],
        finetuned: Mapping[str, Tensor],
        *,
        signature: Mapping[str, Any] | None = None,
        device: str | torch.device | None = None,
        dtype: torch.dtype | None = None,
        metadata: Mapping[str, Any] | None = None,
    ) -> WeightDiff:
        """Δ from two state dicts with TransformerLens parameter names."""
        return cls(
            *models.from_state_dicts(
                base, finetuned, signature=signature, device=device, dtype=dtype, metadata=metadata
            )
        )

    @classmethod
    def from_checkpoints(
        cls,
        base: str | Path | ScorableModel,
        finetuned: str | Path,
        *,
        dtype: torch.dtype | None = None,
        device: str | torch.device | None = None,
    ) -> WeightDiff:
        """Δ between two checkpoints, formed one tensor at a time when it is used: nothing of
        either model is held beyond the layer being read.

        >>> diff = WeightDiff.from_checkpoints("runs/base", "runs/finetuned")  # doctest: +SKIP
        >>> diff = WeightDiff.from_checkpoints(base_model, "runs/finetuned")  # doctest: +SKIP

        Args:
            base: a checkpoint directory, or the loaded base model (its parameters are read
                where Δ is formed: do not change them while the diff is in use).
            finetuned: a Hugging Face checkpoint directory with ``*.safetensors`` files, of the
                same architecture.
            dtype: the dtype both models' weights are taken in before subtracting (default: the
                base model's, or float32 for two directories); Δ is
                ``delta_dtype_for(dtype)`` (float32 for 16-bit weights: the difference of two
                bf16 values is exact in float32).
            device: where each Δ tensor is formed (default: where the base weights are).

        ``deltas`` is a mapping that forms each tensor when read; ``save``, ``to``, the algebra
        and ``restricted`` read every tensor once and give an ordinary, resident diff. A
        ``HookedTransformer`` base (or two directories under TransformerLens 3.9) reads the
        files through TransformerLens's weight conversion one layer at a time; a
        ``TransformerBridge`` base reads the same views of the files' tensors.
        """
        return cls(*checkpoints.from_checkpoints(base, finetuned, dtype=dtype, device=device))

    @classmethod
    def from_peft(
        cls, base: ScorableModel, adapter: str | Path | Any, *,
        initial: str | Path | None = None, device: str | torch.device | None = None,
    ) -> WeightDiff:  # fmt: skip
        """The change a LoRA adapter (a ``peft`` directory or ``PeftModel``) makes to ``base``,
        kept as its low-rank factors (``backend/lora.py``). Adapters are accepted by what their
        configuration says they are (``backend/lora_configs.py``); one initialised by PiSSA,
        OLoRA, CorDA or LoRA-GA, which change the base weights, needs ``initial``: the directory
        the adapter was saved to before training.

        >>> diff = WeightDiff.from_peft(base, "runs/lora-adapter")  # doctest: +SKIP
        >>> diff = WeightDiff.from_peft(base, "runs/pissa", initial="runs/pissa-init")  # doctest: +SKIP
        """
        from extractive_lens.backend.lora import from_peft

        return cls(*from_peft(base, adapter, initial=initial, device=device))

    @classmethod
    def zeros_like(cls, model: ScorableModel) -> WeightDiff:
        """A zero update for ``model`` (useful as a control and as a sum's start)."""
        return cls(*models.zeros_like(model))

    # ------------------------------------------------------------------ applying
    @contextlib.contextmanager
    def applied(
        self,
        model: ScorableModel,
        components: Iterable[str | Component] | None = None,
        scale: float = 1.0,
        *,
        layers: Iterable[int] | None = None,
    ) -> Iterator[ScorableModel]:
        """Set the chosen weights to ``W + scale·Δ`` inside the block, restoring them exactly after.

        A user tool (run the finetuned model with TransformerLens's own hooks and caches):
        scoring never writes the model; it supplies ``W + αΔ`` to each piece while it runs
        (``backend.shifted``), which needs neither saved originals nor a restore.

        Args:
            components: ``None`` for every parameter; otherwise the parameter slices these
                components own (a head selection also applies the layer's shared ``ln1`` and its
                key/value group, which every head of the layer reads).
            scale: multiplies Δ (``scale=ε`` for the small-update limit).
            layers: restrict to parameters under ``blocks.{layer}`` for these layers.
        """
        if (
            isinstance(scale, bool)
            or not isinstance(scale, (int, float))
            or scale != scale
            or (abs(scale) == float("inf"))
        ):
            raise ValueError(
                f"applied(scale=...) takes a finite number (W + scale·Δ), got {scale!r}."
            )
        diff = (
            self
            if components is None and layers is None
            else self.restricted(components, layers=layers)
        )
        with diff._set(model, diff.deltas, scale):
            yield model

    @contextlib.contextmanager
    def grafted(
        self,
        model: ScorableModel,
        components: ComponentSpec = None,
        positions: PositionSpec = None,
        *,
        batch: PromptBatch | None = None,
    ) -> Iterator[ScorableModel]:
        """Run the chosen components with ``W + Δ`` only at the chosen positions inside the block.

        >>> with diff.grafted(model, components="mlp", positions=["{name}"], batch=batch):
        ...     logits = model(batch.tokens)
        >>> prompt = batch.tokens[:1, : int(batch.prompt_lengths[0])]
        >>> with diff.grafted(model, positions=["last", "generated"]):
        ...     tokens = model.generate(prompt, max_new_tokens=3, do_sample=False, verbose=False)
        >>> tokens.shape
        torch.Size([1, 14])

        A grafted component's output at a grafted position is what it computes there with its
        finetuned weights (a head's keys and values at every position it reads included); its
        base output elsewhere (docs/grafting.md). ``model(...)``, ``run_with_cache`` and
        ``model.generate`` (with TransformerLens's KV cache or without) run grafted; the model's
        weights are never written. Components and positions: ``grafts`` (``"attn[0:2]"``,
        ``"L3MLP"``...; ``"{name}"``, ``"last"``, ``"generated"``, ``-1``...).

        Args:
            components: ``None`` for every head and MLP (the "other" parameters, embeddings,
                ``b_O``, final norm and unembedding, are never grafted).
            positions: ``None`` for every position, generated ones included.
            batch: the prompts run inside the block (their roles and prompt lengths); without
                it the first forward inside the block is the prompt, and roles are refused.
        """
        from extractive_lens.backend.graft import grafting
        from extractive_lens.grafts import Where

        self.check_compatible(model)
        where = Where.of(model, components, positions, batch)
        if not where.layers:
            yield model
            return
        finish_stale()
        with grafting(model, self, where):
            yield model

    def _set(
        self, model: ScorableModel, deltas: Mapping[str, Tensor], scale: float
    ) -> contextlib.AbstractContextManager:
        self.check_compatible(model)
        return diff_applying.shifted_weights(model, deltas, scale)

    def check_compatible(self, model: ScorableModel) -> None:
        """Raise a clear error unless this Δ fits ``model`` (architecture, names, shapes)."""
        diff_applying.check_fits(self.deltas, self.signature, model)

    def _shape_of(self, name: str) -> tuple[int, ...]:
        return diff_applying.shape_of(self.deltas, name)

    # ------------------------------------------------------------------ arithmetic
    def _combine(self, other: WeightDiff, sign: float) -> WeightDiff:
        if not isinstance(other, WeightDiff):
            return NotImplemented
        keys = (set(self.signature) | set(other.signature)) - {"dtype", "processed"}
        differ = sorted(k for k in keys if self.signature.get(k) != other.signature.get(k))
        if differ:
            detail = ", ".join(
                f"{k}: {self.signature.get(k)!r} vs {other.signature.get(k)!r}" for k in differ
            )
            raise ValueError(
                f"Cannot {'add' if sign > 0 else 'subtract'} weight changes of different architectures "
                f"({detail}): combine updates of the same base model only."
            )
        op = {"op": "sum" if sign > 0 else "difference"}
        if isinstance(self.deltas, LowRankDeltas) and isinstance(other.deltas, LowRankDeltas):
            summed = lowrank.summed(self.deltas, other.deltas, sign)  # ranks add
            return WeightDiff(summed, dict(self.signature), op)
        names = set(self.deltas) | set(other.deltas)
        out: dict[str, Tensor] = {}
        for n in names:
            a, b = self.deltas.get(n), other.deltas.get(n)
            if a is not None and b is not None and a.shape != b.shape:
                raise ValueError(f"{n}: shapes {tuple(a.shape)} and {tuple(b.shape)} differ.")
            if a is None:
                assert b is not None
                out[n] = sign * b
            elif b is None:
                out[n] = a.clone()
            else:
                dt = torch.promote_types(a.dtype, b.dtype)
                out[n] = a.to(dt) + sign * b.to(device=a.device, dtype=dt)
        return WeightDiff(out, dict(self.signature), {"op": "sum" if sign > 0 else "difference"})

    def __add__(self, other: WeightDiff) -> WeightDiff:
        return self._combine(other, 1.0)

    def __sub__(self, other: WeightDiff) -> WeightDiff:
        return self._combine(other, -1.0)

    def __mul__(self, alpha: float) -> WeightDiff:
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
            raise TypeError(
                f"A WeightDiff scales by a number (diff * 0.5), got {type(alpha).__name__}; to combine "
                "two updates use diff_a + diff_b or diff_a - diff_b."
            )
        meta = {**self.metadata, "scaled_by": alpha}
        if isinstance(self.deltas, LowRankDeltas):  # the factors' left sides scaled
            scaled = self.deltas.map(lambda f: f.scaled(alpha), lambda d: alpha * d)
            return WeightDiff(scaled, dict(self.signature), meta)
        return WeightDiff(
            {n: alpha * d for n, d in self.deltas.items()}, dict(self.signature), meta
        )

    __rmul__ = __mul__

    def __neg__(self) -> WeightDiff:
        return self * -1.0

    def pinned(self) -> WeightDiff:
        """This diff in page-locked host memory (where CUDA is available; else unchanged), so
        that scoring a model on the GPU copies each layer's Δ asynchronously, the next layer's
        while the current one runs. Keep Δ on the host this way when it does not fit the GPU
        beside the model (an 8B model in bf16 has a 30 GB float32 Δ).

        A diff formed on demand (``from_models(..., on_demand=True)``, ``from_checkpoints``)
        pins the finetuned tensors in their stored dtype, no Δ formed (bf16: half a float32
        Δ's bytes; a checkpoint's tensors are read into host memory once): each layer's Δ is
        still formed where the base weights are, from a copy that does not block."""
        if not torch.cuda.is_available():
            return self
        from extractive_lens.backend.lazy import LazyDeltas

        if isinstance(self.deltas, LazyDeltas):
            return WeightDiff(self.deltas.pinned(), self.signature, self.metadata)
        if isinstance(self.deltas, LowRankDeltas):
            pin = self.deltas.map(
                lambda f: lowrank.LowRank(f.left.cpu().pin_memory(), f.right.cpu().pin_memory(),
                                          f.layout, f.n_heads),
                lambda d: d.detach().cpu().pin_memory(),
            )  # fmt: skip
            return WeightDiff(pin, self.signature, self.metadata)
        return WeightDiff(
            {n: d.detach().cpu().pin_memory() for n, d in self.deltas.items()},
            self.signature,
            self.metadata,
        )

    def to(self, device: str | torch.device) -> WeightDiff:
        if isinstance(self.deltas, LowRankDeltas):  # the factors move, still factors
            moved = self.deltas.map(lambda f: f.to(device), lambda d: d.to(device))
            return WeightDiff(moved, self.signature, self.metadata)
        return WeightDiff(
            {n: d.to(device) for n, d in self.deltas.items()}, self.signature, self.metadata
        )

    # ------------------------------------------------------------------ restriction and norms
    def restricted(
        self,
        components: Iterable[str | Component] | None = None,
        *,
        layers: Iterable[int] | None = None,
        model: ScorableModel | None = None,
    ) -> WeightDiff:
        """Δ with everything outside the selection set to zero (parameters outside are dropped).

        ``components`` keeps the slices those components own (docs/scores.md §2); ``layers`` keeps every
        parameter under ``blocks.{layer}``. Given both, a slice must satisfy both.
        """
        n_layers, n_heads, mlp = self._shape()
        comps = parse_components(components, n_layers, n_heads, mlp)
        layer_set = None if layers is None else set(indices("layers", layers, "layer"))
        if layer_set is not None:
            in_range("layers", sorted(layer_set), n_layers, "diff's layers")
        slices = self.slices()
        meta = {
            **self.metadata,
            "restricted_to": {
                "components": None if comps is None else [c.label for c in comps],
                "layers": None if layer_set is None else sorted(layer_set),
            },
        }
        if isinstance(self.deltas, LowRankDeltas):
            kept = diff_slices.restricted_low_rank(self.deltas, slices, comps, layer_set)
            return WeightDiff(kept, dict(self.signature), meta)
        keep = diff_slices.restricted_dense(self.deltas, slices, comps, layer_set)
        return WeightDiff(keep, dict(self.signature), meta)

    def slices(self) -> list[B.ParamSlice]:
        """The ownership partition (docs/scores.md §2) of the parameters Δ covers."""
        sig = self.signature
        return B.slices_for_names(
            list(self.deltas), int(sig["n_heads"]), sig.get("n_key_value_heads")
        )

    def norms(self) -> pd.DataFrame:
        """Frobenius norm of each component's owned Δ (shared slices counted for every owner), as
        a ``pandas.DataFrame``: rows ``L0 .. L{n-1}``, columns ``component_labels`` (``H0 ..
        H{n-1}``, ``MLP``). ``diff.norms().loc["L3", "H2"]``; ``.to_numpy()`` for the array.
        """
        import pandas as pd

        n_layers, _, _ = self._shape()
        return pd.DataFrame(
            self._norms[0].numpy().copy(),
            index=pd.Index([f"L{i}" for i in range(n_layers)], name="layer"),
            columns=pd.Index(self.component_labels, name="component"),
        )

    def other_norm(self) -> float:
        """Norm of Δ on parameters no component owns (embeddings, ``b_O``, unembedding)."""
        return self._norms[1]

    @property
    def _norms(self) -> tuple[Tensor, float]:
        return self._read_once[:2]

    @property
    def _fingerprint(self) -> dict[str, list[float]]:
        """What Δ holds, in a few numbers per tensor (``extractive_lens.fingerprint``): seeded
        projections of each tensor and its norm. Results carry it (``metadata
        ["diff_fingerprint"]``), so that scores of one diff are not taken for another's (rows
        swapped or a sign flipped leave the norms as they were)."""
        return self._read_once[2]

    @functools.cached_property
    def _read_once(self) -> tuple[Tensor, float, dict[str, list[float]]]:
        """The norms (per component, and "other") and the content fingerprint, from one read of
        each tensor per diff (a purely low-rank one's from its factors)."""
        n_layers, n_heads, mlp = self._shape()
        return diff_slices.norms_and_fingerprint(self.deltas, self.slices(), n_layers, n_heads, mlp)

    @property
    def component_labels(self) -> tuple[str, ...]:
        """The labels of the component axis within a layer: ``("H0", …, "H{n-1}", "MLP")``, as
        ``ComponentScores.component_labels``."""
        _, n_heads, mlp = self._shape()
        return component_axis_labels(n_heads, mlp)

    def norm(self) -> float:
        return float(
            sum(diff_slices.part_sum_of_squares(self.deltas, n) for n in self.deltas) ** 0.5
        )

    def _shape(self) -> tuple[int, int, bool]:
        sig = self.signature
        if "n_layers" not in sig:
            raise ValueError(
                "This WeightDiff has no architecture signature; build it with from_models."
            )
        return int(sig["n_layers"]), int(sig["n_heads"]), not bool(sig.get("attn_only"))

    # ------------------------------------------------------------------ persistence
    def save(self, path: str | Path) -> Path:
        """Write Δ and its metadata to a ``.safetensors`` file (never pickle), atomically: an
        interrupted save leaves the previous file whole (the format: ``diff_sources/files.py``)."""
        return files.write(self.deltas, self.signature, self.metadata, path)

    @classmethod
    def load(cls, path: str | Path, *, device: str | torch.device = "cpu") -> WeightDiff:
        """A diff written by ``save`` (or ``extractive-lens finetune --out``), on ``device``."""
        deltas, signature, metadata = files.read(path, device=device)
        try:
            return cls(deltas, signature, metadata)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{Path(path)}: {e}") from None

    def __repr__(self) -> str:
        n = sum(math.prod(self._shape_of(name)) for name in self.deltas)
        return (
            f"WeightDiff({len(self.deltas)} tensors, {n:,} elements, ‖Δ‖={self.norm():.4g}, "
            f"model={self.signature.get('original_architecture') or self.metadata.get('base')})"
        )

"""What one scoring call keeps on the device, per method, from the shapes alone (``el.estimate``).

>>> s = Shapes(rows=2, pos=8, n_layers=4, n_heads=4, d_model=64, d_mlp=256, d_vocab=100,
...            compute=4, layerwise=False)
>>> exact_memory(s, CausalOptions(per="component"))
{'activations (every layer)': 524288}

Each method's entry in ``scoring/methods.py`` names one of these functions: ``memory(shapes,
options) -> {part: bytes}``, the parts of the peak above the weights that depend on the method
(its activations and what its passes keep). ``budget.estimate`` adds the parts every method
holds (Δ on the device, one block's ``W + αΔ``, the vocabulary matrices, the logits) and prints
them all. ``shapes.rows`` is the prompts of one pass (``batch_size`` honoured); ``compute`` the
bytes of one element in the compute dtype. A formula is a sketch checked against
``benchmarks/bench_estimate.py``'s measured peaks (docs/benchmarks.md), not a guarantee.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from extractive_lens.scoring import passes
from extractive_lens.scoring.integrated import AUTO_MAX_STEPS
from extractive_lens.scoring.options import CausalOptions, LinearOptions


@dataclass(frozen=True)
class Shapes:
    """The sizes a method's memory follows: one pass's prompts and positions, the model's
    widths, the compute dtype's bytes and whether gradients go one layer at a time."""

    rows: int
    pos: int
    n_layers: int
    n_heads: int
    d_model: int
    d_mlp: int
    d_vocab: int
    compute: int
    layerwise: bool

    @property
    def stream(self) -> int:
        """Bytes of one ``[batch, pos, d_model]`` residual stream."""
        return self.rows * self.pos * self.d_model * self.compute

    @property
    def layer_activations(self) -> int:
        """Bytes one block's forward keeps for its backward (attention and MLP intermediates)."""
        return self.rows * self.pos * (self.d_model * 12 + self.d_mlp * 5) * self.compute


def _activations(s: Shapes) -> dict[str, int]:
    if s.layerwise:
        return {"activations (boundaries; one layer's graph)":
                4 * s.n_layers * s.stream + s.layer_activations}  # fmt: skip
    return {"activations (every layer)": s.n_layers * s.layer_activations}


def linear_memory(s: Shapes, options: LinearOptions) -> dict[str, int]:
    """Linear: one forward and backward's activations; one layer at a time, the layer-major
    sweep keeps every upstream boundary's stream at every later layer (up to ``passes.SWEEP_BYTES``
    unless ``upstream_group`` fixes the group)."""
    parts = _activations(s)
    if s.layerwise and "upstream" in options.score_kinds and not options.authors:
        boundaries = (2 if s.d_mlp else 1) * s.n_layers * (s.n_layers - 1) // 2 * s.stream
        group = options.upstream_group
        cap = boundaries if group is None or isinstance(group, int) else passes.SWEEP_BYTES
        parts["boundary streams kept by the sweep (upstream)"] = min(boundaries, cap)
    return parts


def exact_memory(s: Shapes, options: CausalOptions) -> dict[str, int]:
    """Exact: the cached base run's activations at every layer (its patched passes resume from
    them); gradients are never taken."""
    return {"activations (every layer)": s.n_layers * s.layer_activations}


def integrated_memory(s: Shapes, options: Any) -> dict[str, int]:
    """Integrated: linear's activations at each node; in the layer-major pass each node's
    stream entering each layer (informative) and upstream's finetuned-late paths' rows
    (``steps="auto"``: at its largest node count, ``AUTO_MAX_STEPS``)."""
    parts = _activations(s)
    if not s.layerwise:
        return parts
    # "auto" doubles the nodes until complete: at worst its last pass has AUTO_MAX_STEPS
    steps = AUTO_MAX_STEPS if options.steps == "auto" else int(options.steps)
    if "informative" in options.score_kinds:
        parts["each node's stream entering each layer"] = steps * s.n_layers * s.stream
    if "upstream" in options.score_kinds:
        per_layer = 1 if options.path == "layer" else s.n_heads
        paths = options.top_k or s.n_layers * (per_layer + (1 if s.d_mlp else 0))
        parts["upstream paths' rows kept by the pass"] = min(
            steps * paths * s.n_layers * s.stream, passes.SWEEP_BYTES
        )
    return parts

"""What one scoring call keeps on the device, per method, from the shapes (``el.estimate``).

>>> s = Shapes(rows=2, pos=8, n_layers=4, n_heads=4, d_model=64, d_mlp=256, d_vocab=100,
...            compute=4, layerwise=False, d_head=16, counted={"block": 64, "block_cells": 512})
>>> exact_memory(s, CausalOptions(per="component"))
{"cached runs (2: every layer's streams)": 196608, "one block's working set (counted rows)": 215040}

Each method's entry in ``scoring/methods.py`` names one of these functions: ``memory(shapes,
options) -> {part: bytes}``, the parts of the peak above the weights that depend on the method.
``budget.estimate`` adds the parts every method holds (Δ on the device, ``W + αΔ``, the
vocabulary matrices, the logits) and prints them all. ``shapes.rows`` is the prompts of one
pass (``batch_size`` honoured); ``compute`` the bytes of one element in the compute dtype.

The rows of the call's passes are *counted*, on the narrow copy ``estimate`` runs
(``shapes.counted``, ``budget.Rows``): the largest graph a backward consumed (the block rows
× query positions recorded since the previous backward, and its attention cells), the largest
block forward and the rows unembedded at once. They follow the prompts, the positions and the
engines' own batching (``max_batch``, the upstream staircase, the byte budgets), not widths.
What a row costs *per element* is the formula (``Shapes.graph_floats``, ``block_floats``):
what TransformerLens's block stores for its backward, or holds while it runs, per row and
position, in the compute dtype. The cached runs (``runs.Run``: every layer's streams of one
pass's prompts) are the method's own: linear's base run with its gradients, exact's base and
finetuned runs. ``benchmarks/bench_estimate.py`` checks the total against the peak of the
tensors alive during the real call (docs/benchmarks.md); it is a sketch, not a guarantee.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from extractive_lens.scoring import passes
from extractive_lens.scoring.integrated import AUTO_MAX_STEPS
from extractive_lens.scoring.options import CausalOptions, LinearOptions

CELL = 2.25
"""Elements per attention cell (head × query × key position) a block holds: the scores and
the pattern in the compute dtype and the causal mask's byte (measured as
``Shapes.graph_floats``)."""


@dataclass(frozen=True)
class Shapes:
    """The sizes a method's memory follows: one pass's prompts and positions, the model's
    widths and block type, the compute dtype's bytes, whether gradients go one layer at a
    time, and the call's passes by their rows as counted on the narrow copy (``counted``:
    ``budget.Rows.sizes()``; empty: none counted)."""

    rows: int
    pos: int
    n_layers: int
    n_heads: int
    d_model: int
    d_mlp: int
    d_vocab: int
    compute: int
    layerwise: bool
    d_head: int = 0
    gated: bool = False
    rms: bool = False
    rotary: bool = False
    counted: Mapping[str, float] = field(default_factory=dict)

    @property
    def stream(self) -> int:
        """Bytes of one ``[batch, pos, d_model]`` residual stream."""
        return self.rows * self.pos * self.d_model * self.compute

    @property
    def heads_width(self) -> int:
        return self.n_heads * (self.d_head or self.d_model // max(self.n_heads, 1))

    @property
    def layer_activations(self) -> int:
        """Bytes one block's forward keeps for its backward, for one pass's prompts."""
        per_row = self.graph_floats + CELL * self.n_heads * self.pos
        return round(self.rows * self.pos * per_row * self.compute)

    @property
    def graph_floats(self) -> float:
        """Elements one block's forward stores for its backward per row and query position,
        besides its attention cells, with the weights frozen (as every engine takes gradients:
        a matmul then keeps only what its input's gradient needs): the MLP's pre- and
        post-activation (2 ``d_mlp``; a gated MLP's gate, activation, up projection and
        product: 4) and 9 ``d_model`` of norms, q, k, v, z and sums (7 with RMS norms and
        rotary q and k). Measured on TransformerLens's blocks at the world model's, SmolLM2's
        and a Llama-3-8B-shaped width (``benchmarks/bench_estimate.py --calibrate``: within
        1% of each)."""
        return (4 if self.gated else 2) * self.d_mlp + (7 if self.rms else 9) * self.d_model

    @property
    def block_floats(self) -> float:
        """Elements alive per row and query position while one block runs without a graph,
        besides its attention cells (measured as ``graph_floats``): its MLP's stage, pre- and
        post-activation (a gated MLP's three) beside 4 streams."""
        return (3 if self.gated else 2) * self.d_mlp + 4 * self.d_model


def _passes(s: Shapes) -> dict[str, int]:
    """What the call's largest passes hold (their rows counted on the narrow copy): the largest
    graph's stored activations (2.25 elements per attention cell: the scores and the pattern in
    the compute dtype, the causal mask's byte) and one block's working set beside it."""
    c = s.counted
    if not c:
        return {}
    graph = c.get("graph", 0) * s.graph_floats + c.get("graph_cells", 0) * CELL * s.n_heads
    block = c.get("block", 0) * s.block_floats + c.get("block_cells", 0) * CELL * s.n_heads
    out = {}
    if graph:
        out["largest graph's activations (counted rows)"] = round(graph * s.compute)
    out["one block's working set (counted rows)"] = round(block * s.compute)
    return out


def _cached_runs(s: Shapes, runs: int, grads: bool) -> dict[str, int]:
    """``runs`` cached runs of one pass's prompts (``runs.Run``): per layer the stream before
    the block, after attention and the MLP's output, z, keys and values (3 streams and 3 head
    widths); with gradients also their gradients at the attention and MLP outputs (2 more)."""
    per_layer = (5 if grads else 3) * s.d_model + 3 * s.heads_width
    return {f"cached runs ({runs}: every layer's streams)":
            runs * s.rows * s.pos * s.n_layers * per_layer * s.compute}  # fmt: skip


def _activations(s: Shapes, runs: int = 1, grads: bool = True) -> dict[str, int]:
    if not s.counted:  # no counted passes: every layer's activations of one pass
        if s.layerwise:
            return {"activations (boundaries; one layer's graph)":
                    4 * s.n_layers * s.stream + s.layer_activations}  # fmt: skip
        return {"activations (every layer)": s.n_layers * s.layer_activations}
    return _cached_runs(s, runs, grads) | _passes(s)


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
    return _activations(s, runs=2, grads=False)


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

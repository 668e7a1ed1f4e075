"""The pass executor's pieces: rows that enter the model at a layer boundary and run on.

Past the base run, every pass an engine makes is rows entering the model at a boundary: a patched
stream resumed after a component (exact), a path's rows ``x + γδ`` (integrated), the base stream
entering the finetuned model after a component group (upstream's ``W_late`` contexts). Here:

- ``boundary`` / ``entry``: where a component group's output has entered the stream, and the
  base stream there as the finetuned model receives it (the heads' with ``Δb_O``);
- ``resume``: rows from a boundary to the final stream. Where gradients go one layer at a time
  (``runs.layerwise``: a large model, chosen once per call by ``by_rows``) the rows go layer by
  layer, ``runs.BLOCK_TOKENS`` tokens of rows at a time (``runs.through``), so that a layer's
  working set (an 8B MLP's hidden activations: 230 KB a token in float32) does not depend on
  how many rows a pass stacks, nor on whether a layer before the last one runs;
- ``packs``: the one byte budget: items split, in order, into passes whose kept bytes stay under
  a limit (``upstream.SWEEP_BYTES`` for the layer-major sweeps).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from torch import Tensor

from extractive_lens import backend as B
from extractive_lens.backend import shift
from extractive_lens.backend.blocks import Where
from extractive_lens.scoring.runs import Run, block_rows, layerwise, through

if TYPE_CHECKING:  # pragma: no cover
    from extractive_lens.batch import PromptBatch
    from extractive_lens.weight_diff import WeightDiff

T = TypeVar("T")


def by_rows(model: Any, batch: PromptBatch) -> bool:
    """Whether the passes of a call on ``batch`` run a block of rows at a time (the layer-major
    path, where gradients go one layer at a time) or all their rows at once (whole graph)."""
    return layerwise(model, batch)


def resume(
    model: Any, x: Tensor, start: tuple[int, Where], *, by_rows: bool = False,
    past_kv: Mapping[int, tuple[Tensor, Tensor]] | None = None, read_pos: Tensor | None = None,
) -> Tensor:  # fmt: skip
    """``x [rows, pos, d_model]`` from boundary ``start`` to the final stream (``run_blocks``:
    ``past_kv`` the keys and values of earlier positions per layer, ``read_pos`` the positions
    read). ``by_rows``: layer by layer, ``runs.block_rows`` rows at a time; the same numbers."""
    layer, where = start
    if where == "post":
        layer, where = layer + 1, "pre"
    if not by_rows or layer >= model.cfg.n_layers:
        return B.run_blocks(model, x, start=start, past_kv=past_kv, read_pos=read_pos)  # type: ignore[return-value]
    rows = block_rows(x.shape[1])
    for l in range(layer, model.cfg.n_layers):
        x = through(model, x, (l, where), rows, past_kv, read_pos)
        where = "pre"
    return x


def boundary(model: Any, group: str) -> Where:
    """Where a component group's output has entered the stream of its layer: the heads'
    (``"heads"`` or ``"attn"``) before the layer's MLP (``"mid"``) in sequential blocks with an
    MLP, else after the layer (``"post"``), as the MLP's."""
    if group != "mlp" and B.has_mlp(model) and not B.parallel(model):
        return "mid"
    return "post"


def entry(
    model: Any, diff: WeightDiff, base: Run, layer: int, group: str
) -> tuple[Tensor, tuple[int, Where]]:
    """The base stream right after a component group of ``layer`` as the finetuned model
    receives it (the heads' with ``Δb_O``: the layer's output bias is a late weight) and the
    boundary it enters at."""
    where = boundary(model, group)
    stream = base.mid[layer] if where == "mid" else base.post[layer]
    if group != "mlp":
        d_bO = shift.read(model, diff, B.attn_out_names(layer)[1])  # counted
        if isinstance(d_bO, Tensor):  # a bias: never low-rank
            stream = stream + d_bO.to(device=stream.device, dtype=stream.dtype)
    return stream, (layer, where)


def packs(items: Sequence[T], cost: Callable[[T], int], budget: int) -> list[list[T]]:
    """``items`` in order, split into passes whose summed ``cost`` stays under ``budget`` (each
    pass at least one item; no pass for no items)."""
    out: list[list[T]] = []
    kept = 0
    for item in items:
        c = cost(item)
        if not out or kept + c > budget:
            out.append([])
            kept = 0
        out[-1].append(item)
        kept += c
    return out

"""The pass executor: rows that enter the model at a layer boundary and run on.

Past the base run, every pass an engine makes is rows entering the model at a boundary: a patched
stream resumed after a component (exact), a path's rows ``x + γδ`` (integrated), the base stream
entering the finetuned model after a component group (upstream's ``W_late`` contexts). Here:

- ``boundary`` / ``entry``: where a component group's output has entered the stream, and the
  base stream there, as the base model or (with ``diff``) the finetuned model receives it (the
  heads' with ``Δb_O``);
- ``resume``: rows from a boundary to the final stream. Where gradients go one layer at a time
  (``runs.layerwise``: a large model, chosen once per call by ``by_rows``) the rows go layer by
  layer, ``runs.BLOCK_TOKENS`` tokens of rows at a time (``runs.through``), so that a layer's
  working set (an 8B MLP's hidden activations: 230 KB a token in float32) does not depend on
  how many rows a pass stacks, nor on whether a layer before the last one runs;
- ``Entry`` rows, run through the whole graph one after another (``whole``) or stacked in one
  growing batch with one backward (``stacked``), or together, layer by layer, with ``Lane`` rows (the chunk from the embedding on, under one weight setting
  each) in ``layer_major``: forward, every lane and entry through a layer while its Δ is loaded;
  then the rewards; then backward, layer by layer, each lane's step and every entry's gradient,
  so that each layer's Δ is read once forward and once backward for all of them;
- ``packs``: the one byte budget: items split, in order, into passes whose kept bytes stay under
  a limit (``SWEEP_BYTES`` for the layer-major passes).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, TypeVar, cast

import torch
from torch import Tensor

from extractive_lens import backend as B
from extractive_lens.backend import LayerRun, shift
from extractive_lens.backend.blocks import Where
from extractive_lens.scoring.runs import (
    Run,
    back,
    block_rows,
    grad_at,
    layerwise,
    readout,
    sizing,
    through,
)

if TYPE_CHECKING:  # pragma: no cover
    from extractive_lens.batch import PromptBatch
    from extractive_lens.rewards import Reward
    from extractive_lens.weight_diff import WeightDiff

T = TypeVar("T")

SWEEP_BYTES = 2 * 2**30
"""The most bytes of entry rows one layer-major pass keeps for its backward sweep (each
gradient entry's rows at every layer from its boundary on); past it the entries are split into
passes, each further one reading the Δ of the layers after its first boundary again."""


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
    model: Any, diff: WeightDiff | None, base: Run, layer: int, group: str
) -> tuple[Tensor, tuple[int, Where]]:
    """The base stream right after a component group of ``layer`` and the boundary it enters
    at; with ``diff``, as the finetuned model receives it (the heads' with ``Δb_O``: the
    layer's output bias is a late weight)."""
    where = boundary(model, group)
    stream = base.mid[layer] if where == "mid" else base.post[layer]
    if diff is not None and group != "mlp":
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


@dataclass
class Entry:
    """Rows that enter the model at boundary ``start`` (``(layer, "mid")``: before the layer's
    MLP; ``(layer, "post")``: after the layer): ``copies`` stacked copies of the chunk, formed
    by ``make()`` when they enter. After the pass: ``reward`` (``[copies · batch]``) and, with
    ``grad``, ``dR/d rows`` at the boundary: handed to ``done`` as soon as it is complete
    (so that nothing keeps it), else kept in ``g``."""

    start: tuple[int, Where]
    copies: int
    make: Callable[[], Tensor]
    grad: bool
    done: Callable[[Tensor], None] | None = None
    reward: Tensor | None = None
    g: Tensor | None = None

    def finish(self, g: Tensor) -> None:
        if self.done is None:
            self.g = g
        else:
            self.done(g)


def whole(
    model: Any, batch: PromptBatch, reward_fn: Reward, entries: Sequence[Entry], *, rows: bool
) -> None:
    """``entries`` one after another, each through the rest of the model (the weights in force
    around the call): a gradient entry's ``dR/d rows`` by one backward (one layer at a time
    where ``runs.layerwise`` says so: ``grad_at``), any other's reward (``rows``: ``resume`` a
    block of rows at a time)."""
    for e in entries:
        x = e.make()
        if e.grad:
            with B.frozen_parameters(model):
                if layerwise(model, x.shape[0], x.shape[1]):
                    e.finish(grad_at(model, x, e.start, batch, reward_fn, groups=e.copies))
                    continue
                with torch.enable_grad():
                    xin = x.detach().requires_grad_(True)
                    y = B.run_blocks(model, xin, start=e.start)
                    R, _, _ = readout(model, cast(Tensor, y), batch, reward_fn, groups=e.copies)
                    e.finish(torch.autograd.grad(R.sum(), [xin])[0])
        else:
            with torch.no_grad():
                y = resume(model, x, e.start, by_rows=rows)
                e.reward = readout(model, y, batch, reward_fn, groups=e.copies)[0]


def stacked(
    model: Any, batch: PromptBatch, reward_fn: Reward, entries: Mapping[tuple[int, str], Entry],
    group: int | None = None,
) -> None:  # fmt: skip
    """Gradient ``entries``, keyed in layer order by ``(layer, "attn" | "mlp")``, the component
    group after which each enters (``entry``), through the whole graph as extra rows of one growing batch
    ("staircase": ``run_blocks``' ``inject``): one backward gives every entry's ``dR/d rows``.
    ``group``: entries per pass (``None``: all in one; memory grows with it)."""
    keys = list(entries)
    group = group or len(keys)
    for g0 in range(0, len(keys), group):
        todo = set(keys[g0 : g0 + group])
        rows: list[Tensor] = []
        order: list[Entry] = []

        def inject(layer: int, part: str, x: Tensor | None) -> Tensor | None:
            if (layer, part) not in todo:
                return x
            e = entries[(layer, part)]
            rows.append(e.make().detach().requires_grad_(True))
            order.append(e)
            return rows[-1] if x is None else torch.cat([x, rows[-1]])

        with B.frozen_parameters(model), torch.enable_grad():
            y = B.run_blocks(model, None, start=(keys[g0][0], "pre"), inject=inject)
            R, _, _ = readout(model, cast(Tensor, y), batch, reward_fn, groups=len(rows))
            got = torch.autograd.grad(R.sum(), rows)
        for e, g in zip(order, got):
            e.finish(owned(g))


def owned(g: Tensor) -> Tensor:
    """``g`` in storage of its own. The gradient of a row block ``torch.cat`` joined is a view
    of the whole gradient: kept as it is, each entry's gradient would hold every row of the
    batch (memory growing with the square of the depth)."""
    return g if g.untyped_storage().nbytes() == g.nbytes else g.clone()


@dataclass
class Lane:
    """The chunk's rows from the embedding on, under one weight setting ``shift`` (``W + αΔ``:
    the finetuned model, or a node of the path of the weights). ``on_layer(layer, step)``: the
    lane's values of each layer (its ``LayerRun``, ``z`` captured), called once every row of
    the pass has run the layer, while its Δ is loaded. ``back``: the lane's gradient, taken
    layer by layer, ``back(layer, rows entering it, dR/d its output) -> dR/d its input``, last
    layer first (the rows entering each layer are kept for it in ``kept``; layer 0's stay).
    After the pass: ``reward``, ``read`` (the final stream the reward read) and, with ``back``,
    ``g_logits`` and ``g`` (``dR/d`` the embedding's output)."""

    shift: shift.Shift
    on_layer: Callable[[int, LayerRun], None] | None = None
    back: Callable[[int, Tensor, Tensor], Tensor] | None = None
    kept: list[Any] = field(default_factory=list)
    reward: Tensor | None = None
    read: Tensor | None = None
    g_logits: Tensor | None = None
    g: Tensor | None = None


def layer_major(
    model: Any, batch: PromptBatch, reward_fn: Reward, lanes: Sequence[Lane],
    entries: Sequence[Entry], late: shift.Shift | None,
    group: int | Literal["auto"] | None = "auto",
) -> None:  # fmt: skip
    """``lanes`` and ``entries`` (run under ``late``'s weights) through the model layer by layer
    together (module docstring). The first pass carries the lanes and the entries that fit,
    first boundaries first; each further pass the next entries: ``group`` per pass, all
    (``None``), or as many as keep each pass's rows under ``SWEEP_BYTES`` (``"auto"``)."""
    todo = sorted(entries, key=lambda e: e.start[0])
    if isinstance(group, int):
        split = [todo[i : i + group] for i in range(0, len(todo), group)]
    elif group is None:
        split = [todo] if todo else []
    else:
        split = packs(todo, _cost(model, batch), SWEEP_BYTES)
    with B.frozen_parameters(model):
        for i, pack in enumerate(split or [[]]):
            _one_pass(model, batch, reward_fn, lanes if i == 0 else [], pack, late)


def _cost(model: Any, batch: PromptBatch) -> Callable[[Entry], int]:
    """An entry's kept bytes: its rows at every layer from its boundary on (a gradient entry's,
    for the backward sweep), else once."""
    from extractive_lens.backend import compute

    L = model.cfg.n_layers
    dtype = compute.compute_dtype() or model.cfg.dtype
    item = torch.empty(0, dtype=torch.promote_types(dtype, torch.float32)).element_size()
    copy = len(batch) * batch.n_pos * sizing(model).cfg.d_model * item
    return lambda e: e.copies * copy * ((L - e.start[0]) if e.grad else 1)


def _one_pass(
    model: Any, batch: PromptBatch, reward_fn: Reward, lanes: Sequence[Lane],
    entries: Sequence[Entry], late: shift.Shift | None,
) -> None:  # fmt: skip
    """One layer-major pass (``layer_major``)."""
    if not lanes and not entries:
        return
    L = model.cfg.n_layers
    rows = block_rows(batch.n_pos)  # an entry's rows per block: BLOCK_TOKENS tokens
    live: dict[int, Tensor] = {}  # entry -> its rows now
    kept: dict[int, dict[tuple[int, Where], Tensor]] = {}  # entry -> its rows entering a step
    steps: list[LayerRun] = []

    def step(i: int, x: Tensor, at: tuple[int, Where]) -> Tensor:
        """Entry ``i``'s rows from boundary ``at`` to the end of its layer, kept for backward."""
        if entries[i].grad:
            kept.setdefault(i, {})[at] = x
        return through(model, x, at, rows)

    first = 0 if lanes else min(e.start[0] for e in entries)
    xs: list[Tensor] = []
    with torch.no_grad():
        tokens = batch.tokens.to(model.cfg.device)
        for lane in lanes:
            lane.kept[:] = [None] * L  # in place: a lane's owner may hold the list
            with shift.within(lane.shift):
                xs.append(B.embed(model, tokens))
        for layer in range(first, L):
            for k, lane in enumerate(lanes):
                if lane.back is not None:
                    lane.kept[layer] = xs[k]
                with shift.within(lane.shift):
                    xs[k] = cast(Tensor, B.run_blocks(
                        model, xs[k], start=(layer, "pre"), stop=layer + 1,
                        capture=("z",) if lane.on_layer else (), observe=steps.append))  # fmt: skip
            with shift.within(late):
                for i, x in live.items():  # the entries already in: through this layer
                    live[i] = step(i, x, (layer, "pre"))
                for i, e in enumerate(entries):  # the entries entering in this layer
                    if e.start[0] == layer:
                        x = e.make()
                        live[i] = x if e.start[1] == "post" else step(i, x, e.start)
            for lane, s in zip(lanes, steps):
                if lane.on_layer is not None:
                    lane.on_layer(layer, s)
            steps.clear()
    # the rewards; each row's final stream is read there alone (the backward sweep runs without)
    grads = [_read(model, batch, reward_fn, lane, x, lane.shift) for lane, x in zip(lanes, xs)]
    del xs
    entry_grads: dict[int, Tensor] = {}
    for i, e in enumerate(entries):
        g = _read(model, batch, reward_fn, e, live.pop(i), late)
        if g is not None:
            entry_grads[i] = g
    for layer in reversed(range(first, L)):
        for k, lane in enumerate(lanes):
            if lane.back is None:
                continue
            with shift.within(lane.shift):
                grads[k] = cast(Any, lane.back)(layer, lane.kept[layer], grads[k])
            if layer > 0:
                lane.kept[layer] = None
        with shift.within(late):
            for i in list(entry_grads):
                e = entries[i]
                for at in ((layer, "pre"), e.start):  # back through the layer, to where it entered
                    x_at = kept.get(i, {}).pop(at, None) if at[0] == layer else None
                    if x_at is not None:
                        entry_grads[i] = back(model, x_at, at, entry_grads[i], rows)
                if e.start[0] == layer:
                    e.finish(entry_grads.pop(i))
    for lane, g in zip(lanes, grads):
        lane.g = g


def _read(
    model: Any, batch: PromptBatch, reward_fn: Reward, rows: Lane | Entry, x: Tensor,
    weights: shift.Shift | None,
) -> Tensor | None:  # fmt: skip
    """The reward of a lane's or an entry's final stream ``x`` under ``weights``, into
    ``rows``; where ``rows`` take a gradient, returns ``dR/dx``."""
    grad = rows.back is not None if isinstance(rows, Lane) else rows.grad
    copies = 1 if isinstance(rows, Lane) else rows.copies
    with shift.within(weights), torch.set_grad_enabled(grad):
        xf = x.detach().requires_grad_(grad)
        R, logits, x_read = readout(model, xf, batch, reward_fn, groups=copies)
        g = g_logits = None
        if grad:
            g, g_logits = torch.autograd.grad(R.sum(), [xf, logits])
    if isinstance(rows, Lane):
        rows.read, rows.g_logits = x_read.detach(), g_logits
    rows.reward = R.detach()
    return g

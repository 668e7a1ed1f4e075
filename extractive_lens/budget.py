"""Before a long run: will it fit, and how much of Δ will it move? (``estimate``)

>>> import extractive_lens as el
>>> e = el.estimate(model, diff, batch, "linear")
>>> e.method, e.layer_loads > 0
('linear', True)

Two parts, each said plainly in the printed estimate:

- **Δ traffic** is *counted*, not modelled: the same call runs on a narrow copy of the model
  (the same depth, heads, key/value heads, MLP and norm types, a batch of the same prompts'
  count and length, widths of 8) in the large-model regime (Δ held ``KEEP_LAYERS`` layers at a
  time), making every choice by size as the real model would (``runs.sized_as``: gradients one
  layer at a time, the upstream group). A model deeper than ``COUNT_DEPTHS`` is counted at those
  depths and every count extrapolated as the quadratic through them (``counted``): a call then
  costs about a second, where running the method on a copy of the full depth took minutes (its
  exact passes grow with the square of the depth). Every layer load is scaled by the real diff's bytes
  for that layer, every tensor read on its own (``W_O``, ``b_O`` where its layer is not loaded)
  by that tensor's (``shift.counting``). Which layers a method reads, and how often, then does
  not depend on widths. The real diff's bytes are what crosses for it: a float32 or float64 Δ's
  own, the finetuned tensors' in their stored dtype for a diff formed on demand (bf16: half),
  the factors of a low-rank one; a diff formed on demand also reads every tensor once for its
  norms on its first scoring call. A vocabulary matrix that the real model reads a part at a
  time is counted whole (the narrow copy's vocabulary is small): the embedding's rows of the
  batch are less.
- **Passes** are counted on the same copy: every block forward (a batch of rows through one
  block), and shown as forwards of the whole model.
- **Memory** above the weights is a formula over the shapes (listed in ``Estimate.parts``), for
  one pass's prompts (``batch_size``): the Δ layers held on the device, one piece's ``W + αΔ``
  in the compute dtype where Δ is dense (twice: forward and the backward's re-formed copy; a
  low-rank Δ is added as ``(x L) R`` and costs its products), the embedding's and
  unembedding's ``W + αΔ`` where the diff changes them, the logits, and the method's own parts
  (``Method.memory``, ``scoring/costs.py``: activations, what a layer-major pass keeps). It is an upper-bound-minded sketch checked against ``benchmarks/bench_memory.py``'s
  measurements (docs/benchmarks.md), not a guarantee.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from extractive_lens.backend.lazy import LazyDeltas
from extractive_lens.backend.lowrank import LowRankDeltas
from extractive_lens.batch import PromptBatch
from extractive_lens.rewards import reads_answer_positions_only

GiB = 2**30


@dataclass
class Estimate:
    """What a scoring call needs: bytes by part, Δ traffic and passes (see the module docstring)."""

    method: str
    device: str
    weights_bytes: int
    delta_bytes: int
    parts: dict[str, int] = field(default_factory=dict)
    delta_read_bytes: int = 0
    layer_loads: int = 0
    layerwise: bool = False
    gradients: bool = True
    block_passes: int = 0
    n_layers: int = 0
    counted_at: tuple[int, ...] = ()
    batch_passes: tuple[float, float] = (0.0, 0.0)  # forward, backward (scoring/counting.py)
    rows: dict[str, float] = field(default_factory=dict)

    @property
    def device_bytes(self) -> int:
        """Peak bytes on the model's device above its weights (the sum of ``parts``)."""
        return sum(self.parts.values())

    def __str__(self) -> str:
        lines = [
            f"{self.method} on {self.device}: about {_size(self.device_bytes)} above the "
            f"weights ({_size(self.weights_bytes)}); total "
            f"{_size(self.device_bytes + self.weights_bytes)}",
        ]
        for name, b in self.parts.items():
            lines.append(f"  {name:<44s} {_size(b):>10s}")
        lines.append(
            f"Δ read: {_size(self.delta_read_bytes)} in {self.layer_loads} layer loads "
            f"= {self.delta_read_bytes / max(self.delta_bytes, 1):.1f}× the diff "
            f"({_size(self.delta_bytes)})"
            + ("" if not self.gradients else "; gradients " + (
                "one layer at a time" if self.layerwise else "through the whole graph"))
        )  # fmt: skip
        lines.append(
            f"passes: {self.block_passes} block forwards (≈ {self.passes:.1f} forwards of the "
            f"whole model; a batch of rows through one block counts once); by the batch's "
            f"tokens through every piece (verified_scores' budget's unit, "
            f"scoring/counting.py): {sum(self.batch_passes):.1f} = "
            f"{self.batch_passes[0]:.1f} forward + {self.batch_passes[1]:.1f} backward"
            + (f"; counted at depths {self.counted_at} and extrapolated to "
               f"{self.n_layers} layers" if len(self.counted_at) > 1 else "")
        )  # fmt: skip
        return "\n".join(lines)

    @property
    def passes(self) -> float:
        """``block_passes`` in forwards of the whole model."""
        return self.block_passes / max(self.n_layers, 1)


def _size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def estimate(model: Any, diff: Any, batch: Any, method: str = "linear", **options: Any) -> Estimate:
    """Memory and Δ traffic of ``<method>_scores(model, diff, batch, **options)`` before running it.

    Args:
        method: a method of the table (``scoring/methods.py``): ``"linear"``, ``"causal"``
            (exact), ``"integrated"``, ...
        options: the scoring call's keyword arguments (``kinds``, ``per``, ``top_k``, ``steps``,
            ``layers``, …); they shape the counted traffic and the method's memory
            (``Method.memory``).
    """
    from extractive_lens import backend as B
    from extractive_lens.backend import shift
    from extractive_lens.scoring import runs
    from extractive_lens.scoring.costs import Shapes
    from extractive_lens.scoring.methods import method as method_entry

    entry = method_entry(method)
    built = entry.options(**{k: v for k, v in options.items() if k != "linear"})

    cfg = model.cfg
    params = B.parameters(model)
    weights = sum(p.numel() * p.element_size() for p in params.values())
    deltas = diff.deltas
    stored = {name: stored_bytes(deltas, name) for name in deltas}
    delta_bytes = sum(stored.values())
    by_group: dict[Any, int] = {}
    for name, b in stored.items():
        g = shift._group_of(name)
        by_group[g] = by_group.get(g, 0) + b
    moved = counted(model, diff, batch, method, options)
    read = moved.read_bytes(stored, by_group)
    if isinstance(deltas, LazyDeltas) and "_read_once" not in vars(diff):
        read += delta_bytes  # its norms and fingerprint (``WeightDiff._read_once``), first call

    compute = 4  # float32 (the default compute dtype of 16-bit models)
    if any(p.dtype == torch.float64 for p in params.values()):
        compute = 8
    rows, pos = len(batch), batch.n_pos
    if built.batch_size is not None:  # prompts per pass
        rows = min(rows, built.batch_size)
    d_model, d_mlp, vocab = cfg.d_model, cfg.d_mlp or 0, cfg.d_vocab
    on_host = _on_host(deltas)
    model_dev = torch.device(cfg.device) if cfg.device else torch.device("cpu")
    moved_to = on_host and model_dev.type != "cpu"
    small = sum(p.numel() for p in params.values()) * 4 <= shift.REUSE_BYTES
    layer_groups = [b for g, b in by_group.items() if isinstance(g, int)]
    layer_delta = max(layer_groups, default=0)
    parts: dict[str, int] = {}
    if moved_to:
        held = delta_bytes if small else shift.KEEP_LAYERS * layer_delta
        parts["Δ held on the device"] = (
            held + by_group.get(shift.EMBED, 0) + by_group.get(shift.UNEMBED, 0)
        )
    factors = getattr(deltas, "factors", {})
    dense = [n for n in deltas if n not in factors]  # W + αΔ formed where the piece runs
    block = sum(params[n].numel() for n in dense if B.layer_of(n) == 0 and n in params)
    blocks = sum(params[n].numel() for n in dense if B.layer_of(n) is not None and n in params)
    if block and not small:
        parts["one block's W + αΔ (forward, backward)"] = 2 * block * compute
    ranks = sum(f.rank for n, f in factors.items() if B.layer_of(n) == 0)
    if ranks:  # a low-rank Δ is added as (x L) R: the products, never W + αΔ
        parts["one block's low-rank products (x L) R"] = 2 * len(batch) * pos * ranks * compute
    vocab_matrix = vocab * d_model * compute
    changed = sum(  # the vocabulary matrices among the names of Δ formed whole
        shift._group_of(n) in (shift.EMBED, shift.UNEMBED)
        and n in params and params[n].numel() == vocab * d_model
        for n in dense
    )  # fmt: skip
    if changed and not small:  # a vocabulary matrix whose Δ the diff holds (often none)
        parts["embedding and unembedding W + αΔ"] = changed * vocab_matrix
    lw = entry.gradients and runs.layerwise(model, batch)

    def phase_parts(k: int | None) -> dict[str, int]:
        """What the call holds at its peak in phase ``k`` (``k`` shifts alive; ``None``:
        the call's largest passes, for a large model whose shifts keep no weights)."""
        counted = phase(moved.rows, k)
        out: dict[str, int] = {}
        if k is not None and blocks:  # each shift keeps every layer's W + αΔ (shift.py)
            out[f"every layer's W + αΔ ({k} α at once)"] = k * blocks * compute
        if k is not None and changed:
            out["embedding and unembedding W + αΔ"] = k * changed * vocab_matrix
        # the readout unembeds the positions its reward reads: value and log-softmax, and
        # the logits' gradient where a graph is recorded
        unembedded = max(3 * counted.get("logits_grad", 0), 2 * counted.get("logits", 0))
        out["logits (value, log-softmax, gradient)"] = round(unembedded * vocab * compute)
        shapes = Shapes(
            rows=rows, pos=pos, n_layers=cfg.n_layers, n_heads=cfg.n_heads, d_model=d_model,
            d_mlp=d_mlp, d_vocab=vocab, compute=compute, layerwise=lw, d_head=cfg.d_head,
            gated=bool(cfg.gated_mlp), rms=str(cfg.normalization_type).startswith("RMS"),
            rotary=cfg.positional_embedding_type == "rotary", counted=counted,
        )  # fmt: skip
        return out | entry.memory(shapes, built)

    candidates = [phase_parts(k) for k in (phases(moved.rows) or [1])] if small else []
    peak: dict[str, int] = max(candidates or [phase_parts(None)], key=lambda p: sum(p.values()))
    parts.update(peak)
    return Estimate(
        method=method, device=str(model_dev), weights_bytes=weights, delta_bytes=delta_bytes,
        parts=parts, delta_read_bytes=read, layer_loads=moved.loads, layerwise=lw,
        gradients=entry.gradients, block_passes=moved.passes, n_layers=cfg.n_layers,
        counted_at=moved.depths, batch_passes=moved.batch_passes, rows=moved.rows,
    )  # fmt: skip


def _nbytes(t: Any) -> int:
    return int(t.numel()) * int(t.element_size())


def stored_bytes(deltas: Any, name: str) -> int:
    """The bytes a read of ``deltas[name]`` moves (``shift.Traffic``), without forming it: the
    finetuned tensor's for a diff formed on demand, the factors (and dense part) of a low-rank
    one, else Δ's own."""
    if isinstance(deltas, LazyDeltas):
        return deltas.source_bytes(name)
    if isinstance(deltas, LowRankDeltas):
        f, d = deltas.factors.get(name), deltas.dense.get(name)
        return (0 if f is None else f.nbytes()) + (0 if d is None else _nbytes(d))
    return _nbytes(deltas[name])


def _on_host(deltas: Any) -> bool:
    """Whether the diff holds its tensors on the host (for one formed on demand: the finetuned)."""
    if isinstance(deltas, LazyDeltas):
        held = deltas.finetuned
    elif isinstance(deltas, LowRankDeltas):
        held = {n: f.left for n, f in deltas.factors.items()} | deltas.dense
    else:
        held = deltas
    first = next(iter(held), None)
    return first is None or held[first].device.type == "cpu"


COUNT_DEPTHS = (3, 4, 5)
"""The narrow copy's depths counted for a deeper model; its counts are extrapolated from them."""


class Rows:
    """The narrow copy's passes by their rows, which do not depend on widths (the prompts, the
    positions, the engines' ``max_batch`` and byte budgets, made ``sized_as`` the real model):
    counted at every block forward (its attention), readout (its unembedding) and backward,
    each by phase: the number of shifts (``W + αΔ`` at one α) that had formed weights and were
    alive then (``alive()``; a small model's shift keeps every layer's for its lifetime).

    ``sizes()``, the largest of the call, and ``graph@k`` ... for each phase ``k``:

    - ``graph``: the block rows a backward found recorded since the previous one (each block
      forward's rows × query positions: one graph's stored activations); ``graph_cells``: its
      attention cells (rows × query × key positions);
    - ``block`` / ``block_cells``: one block forward's rows × query positions (its working set
      while it runs, with or without a graph) and attention cells;
    - ``logits`` / ``logits_grad``: the rows × positions unembedded at once without / with a
      graph; ``shifts``: the most shifts alive at once.
    """

    def __init__(self, alive: Any = lambda: 1) -> None:
        self.alive = alive
        self.passes = self.now = self.now_cells = 0
        self.most: dict[str, int] = {}

    def _at_least(self, name: str, n: int) -> None:
        for key in (name, f"{name}@{self.alive()}"):
            self.most[key] = max(self.most.get(key, 0), n)

    def block_forward(self, x: Tensor, past: int, recorded: bool) -> None:
        self.passes += 1
        tokens = int(x.shape[0]) * int(x.shape[1])
        self._at_least("block", tokens)
        self._at_least("block_cells", tokens * (int(x.shape[1]) + past))
        if recorded:
            self.now += tokens
            self.now_cells += tokens * (int(x.shape[1]) + past)

    def unembedded(self, x: Tensor, recorded: bool) -> None:
        self._at_least("logits_grad" if recorded else "logits", int(x.numel() // x.shape[-1]))

    def backward(self) -> None:
        self._at_least("graph", self.now)
        self._at_least("graph_cells", self.now_cells)
        self.now = self.now_cells = 0

    def sizes(self) -> dict[str, float]:
        names = ("graph", "graph_cells", "block", "block_cells", "logits", "logits_grad")
        out = {n: 0.0 for n in names} | {k: float(v) for k, v in self.most.items()}
        out["shifts"] = float(self.alive.most if hasattr(self.alive, "most") else 1)
        return out


def phase(rows: dict[str, float], k: int | None) -> dict[str, float]:
    """The counted rows of phase ``k`` (``Rows``: while ``k`` shifts were alive) under the
    plain names; ``None``: the call's largest."""
    if k is None:
        return {n: v for n, v in rows.items() if "@" not in n}
    return {n.split("@")[0]: v for n, v in rows.items() if n.endswith(f"@{k}")}


def phases(rows: dict[str, float]) -> list[int]:
    """The phases counted (the numbers of shifts alive at once)."""
    return sorted({int(n.split("@")[1]) for n in rows if "@" in n})


class _Alive:
    """How many shifts that formed weights are alive now, and the most at once."""

    def __init__(self) -> None:
        self.formed: weakref.WeakSet[Any] = weakref.WeakSet()
        self.most = 1

    def add(self, s: Any) -> None:
        self.formed.add(s)
        self.most = max(self.most, len(self.formed))

    def __call__(self) -> int:
        return max(len(self.formed), 1)


@dataclass
class Counted:
    """What the narrow copy's call read of Δ and ran: layer loads by group (a block's index,
    ``shift.EMBED``, ``shift.UNEMBED``), tensors read on their own (``reads``: by name, in
    whole tensors), block forwards (``passes``), the depths counted (``depths``) and its
    passes' rows (``rows``: ``Rows.sizes()``)."""

    loads: int
    by_group: dict[Any, float]
    reads: dict[str, float]
    passes: int
    depths: tuple[int, ...]
    batch_passes: tuple[float, float] = (0.0, 0.0)
    rows: dict[str, float] = field(default_factory=dict)

    def read_bytes(self, stored: dict[str, int], by_group: dict[Any, int]) -> int:
        """The real diff's bytes moved: each load by its group's bytes, each read by its
        tensor's. Counts extrapolated in depth (``by_group["block"]``, names with ``*`` for the
        layer) take a block's, or a tensor role's, mean bytes over the real layers."""
        layers = [b for g, b in by_group.items() if isinstance(g, int)]
        mean_layer = sum(layers) / len(layers) if layers else 0.0
        read = 0.0
        for g, n in self.by_group.items():
            read += n * (mean_layer if g == "block" else by_group.get(g, 0))
        for name, share in self.reads.items():
            if "*" in name:
                alike = [b for n, b in stored.items() if _role(n) == name]
                read += share * (sum(alike) / len(alike) if alike else 0)
            else:
                read += share * stored.get(name, 0)
        return round(read)


def _role(name: str) -> str:
    """``name`` with its layer index as ``*`` (the same tensor of every layer)."""
    import re

    return re.sub(r"^(\w+)\.\d+\.", r"\1.*.", name)


def counted(model: Any, diff: Any, batch: Any, method: str, options: dict[str, Any]) -> Counted:
    """The call counted on a narrow copy of ``model`` (module docstring). Deeper than
    ``COUNT_DEPTHS``, the copy is counted at those depths and each count extrapolated to the
    model's depth as the quadratic through them (a method's passes through the layers after
    each layer grow at most with the square of the depth; exact on the method's own counts at
    depth 30), taking every layer's Δ to be alike. ``layers=`` and ``rows=`` are counted at the
    model's own depth."""
    depth = model.cfg.n_layers
    if depth <= COUNT_DEPTHS[-1] or options.get("layers") is not None:
        return _counted(model, diff, batch, method, options, depth)
    at = [_counted(model, diff, batch, method, options, d, by_role=True) for d in COUNT_DEPTHS]
    k = depth - COUNT_DEPTHS[0]

    def extrapolate(f: list[float]) -> float:  # Newton's form through depths 3, 4, 5
        return max(f[0] + (f[1] - f[0]) * k + (f[2] - 2 * f[1] + f[0]) * k * (k - 1) / 2, 0.0)

    groups = {g for c in at for g in c.by_group}
    names = {n for c in at for n in c.reads}
    return Counted(
        loads=round(extrapolate([c.loads for c in at])),
        by_group={g: extrapolate([c.by_group.get(g, 0) for c in at]) for g in groups},
        reads={n: extrapolate([c.reads.get(n, 0) for c in at]) for n in names},
        passes=round(extrapolate([c.passes for c in at])),
        depths=COUNT_DEPTHS,
        batch_passes=(  # in passes of the copy's own depth: as tokens, then per layer
            extrapolate([c.batch_passes[0] * d for c, d in zip(at, COUNT_DEPTHS)]) / depth,
            extrapolate([c.batch_passes[1] * d for c, d in zip(at, COUNT_DEPTHS)]) / depth,
        ),
        rows={
            n: extrapolate([c.rows.get(n, 0) for c in at]) for n in {n for c in at for n in c.rows}
        },
    )


def _counted(
    model: Any, diff: Any, batch: Any, method: str, options: dict[str, Any], depth: int,
    by_role: bool = False, sized: Any = None,
) -> Counted:  # fmt: skip
    """``shift.counting()``'s ``Traffic`` of the same call on a narrow copy of ``depth`` layers
    (module docstring), with its block forwards; ``by_role``: a copy shallower than the model,
    whose layer loads are summed as ``"block"`` and whose reads are named by role; ``sized``:
    the model whose sizes the choices follow (default ``model``)."""
    import copy
    import dataclasses
    import warnings

    from extractive_lens import WeightDiff
    from extractive_lens import backend as B
    from extractive_lens.backend import shift
    from extractive_lens.model import tiny_model
    from extractive_lens.scoring import runs
    from extractive_lens.scoring.counting import counting_passes
    from extractive_lens.scoring.linear import linear_scores
    from extractive_lens.scoring.methods import method as method_entry

    narrow = tiny_model(_narrow_config(model, depth), seed=0)  # not backend-bound
    g = torch.Generator().manual_seed(0)
    moved = copy.deepcopy(narrow)  # the copy's stored weights moved (a bridge's zeros stay)
    with torch.no_grad():
        for p in moved.parameters():
            p.add_(1e-3 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    full = WeightDiff.from_models(narrow, moved)
    # Δ on the copy's weight matrices the real diff changes: the loads are by layer, and each is
    # scaled by the real diff's bytes for that layer (biases and norms left out: a native
    # TransformerLens 4 bridge shows zeros for some biases and refuses a change there); a
    # shallower copy takes a name the real diff changes at any layer
    names = {_role(n) for n in diff.deltas} if by_role else set(diff.deltas)
    proxy = WeightDiff(
        {n: d for n, d in full.deltas.items() if (_role(n) if by_role else n) in names
         and d.ndim >= 2},
        full.signature,
    )  # fmt: skip
    proxy_batch = _proxy_batch(narrow, batch)
    # every batch the call takes (``reference=``) as the copy's too: the real ids are not in
    # the copy's vocabulary
    options = {k: _proxy_batch(narrow, v) if isinstance(v, PromptBatch) else v
               for k, v in options.items() if k not in ("linear", "show_progress")}  # fmt: skip
    reward = options.get("reward")
    if callable(reward) and not reads_answer_positions_only(reward):
        options["reward"] = _own_reward  # the caller's may read the real vocabulary
    saved, attention, unembed = shift.REUSE_BYTES, B.attention, B.unembed
    grad, value = torch.autograd.grad, shift.Shift.value
    alive = _Alive()
    rows = Rows(alive)

    def counting_attention(model: Any, layer: int, x: Tensor, *args: Any, **kwargs: Any) -> Any:
        out = attention(model, layer, x, *args, **kwargs)
        past = kwargs.get("past_kv", args[1] if len(args) > 1 else None)
        rows.block_forward(x, 0 if past is None else past[0].shape[1], out[0].requires_grad)
        return out

    def counting_unembed(model: Any, x: Tensor) -> Any:
        out = unembed(model, x)
        rows.unembedded(x, out.requires_grad)
        return out

    def counting_grad(*args: Any, **kwargs: Any) -> Any:
        rows.backward()
        return grad(*args, **kwargs)

    def counting_value(self: Any, *args: Any, **kwargs: Any) -> Any:
        alive.add(self)
        return value(self, *args, **kwargs)

    try:
        shift.REUSE_BYTES = 0  # the large-model regime: Δ held a few layers at a time
        with warnings.catch_warnings(), runs.sized_as(sized or model):  # the real model's paths
            warnings.simplefilter("ignore")
            lin = None
            entry = method_entry(method)
            takes_linear = "linear" in {f.name for f in dataclasses.fields(entry.options)}
            if takes_linear and options.get("top_k") is not None:
                lin = linear_scores(narrow, proxy, proxy_batch, show_progress=False)
            if lin is not None:
                options["linear"] = lin
            B.check_scorable(narrow)  # its one-time self-check is not the call's passes
            # every block forward runs one attention; every readout one unembedding
            B.attention, B.unembed = counting_attention, counting_unembed  # type: ignore[assignment]
            torch.autograd.grad, shift.Shift.value = counting_grad, counting_value  # type: ignore[method-assign]
            with shift.counting() as traffic, counting_passes(narrow, proxy_batch) as count:
                entry.engine(narrow, proxy, proxy_batch, show_progress=False, **options)
            rows.backward()  # a graph left without a backward
    finally:
        shift.REUSE_BYTES, B.attention, B.unembed = saved, attention, unembed
        torch.autograd.grad, shift.Shift.value = grad, value  # type: ignore[method-assign]
    by_group: dict[Any, float] = {}
    for grp, n in traffic.by_group.items():
        key = "block" if by_role and isinstance(grp, int) else grp
        by_group[key] = by_group.get(key, 0) + n
    reads: dict[str, float] = {}
    for name, share in traffic.reads.items():
        key = _role(name) if by_role else name
        reads[key] = reads.get(key, 0) + share
    return Counted(traffic.loads, by_group, reads, rows.passes, (depth,),
                   (count.forward, count.backward), rows.sizes())  # fmt: skip


def _own_reward(logits: Tensor, batch: PromptBatch) -> Tensor:
    """The narrow copy's stand-in for a reward of the caller's own, which may read the real
    model's vocabulary: its values are the copy's anyway, and the engines run it as they run
    any reward of the caller's (every position unembedded, ``reads_answer_positions_only``),
    so the passes and rows counted are the real call's."""
    from extractive_lens.rewards import answer_logprob

    return answer_logprob(logits, batch)


def _proxy_batch(narrow: Any, batch: PromptBatch) -> PromptBatch:
    """``batch`` for the narrow copy: each prompt's and answer's length and each position's role
    as the real batch's (its positions, the answer positions the readout unembeds, and the
    roles a reference batch is aligned by), the tokens (and counterfactual answers, where it
    has them) from the copy's vocabulary."""
    from extractive_lens import make_batch

    n_vocab = narrow.cfg.d_vocab

    def ids(i: int, n: int, at: int = 0) -> list[int]:
        return [1 + (i + at + j) % (n_vocab - 2) for j in range(n)]

    prompt = [int(n) for n in batch.prompt_lengths]
    answer = [int((a >= 0).sum()) for a in batch.answer_targets]
    pairs = [(ids(i, prompt[i]), ids(i, answer[i], 7)) for i in range(len(batch))]
    roles = [batch.roles[i][: prompt[i]] for i in range(len(batch))]
    counterfactuals = None  # for ``logit_diff``: another token than each answer's first
    if batch.counterfactual is not None:
        counterfactuals = [1 + (a[0] % (n_vocab - 2)) for _, a in pairs]
    return make_batch(narrow, pairs, candidates=sorted({a[0] for _, a in pairs}), roles=roles,
                      counterfactuals=counterfactuals)  # fmt: skip


_NARROW = 8


def _narrow_config(model: Any, depth: int | None = None) -> dict[str, Any]:
    """The model's structure at width 8 (every head 8 wide, the MLP 16, a vocabulary of 64),
    ``depth`` layers deep (default: the model's)."""
    cfg = model.cfg
    out: dict[str, Any] = dict(
        n_layers=cfg.n_layers if depth is None else depth, n_heads=cfg.n_heads, d_head=_NARROW,
        d_model=_NARROW * cfg.n_heads, d_mlp=2 * _NARROW * cfg.n_heads if cfg.d_mlp else None,
        d_vocab=64, n_ctx=max(cfg.n_ctx if cfg.n_ctx else 0, 8),
        act_fn=cfg.act_fn, normalization_type=cfg.normalization_type,
        positional_embedding_type=cfg.positional_embedding_type,
        attn_only=cfg.attn_only, gated_mlp=cfg.gated_mlp,
        parallel_attn_mlp=getattr(cfg, "parallel_attn_mlp", False),
        dtype=torch.float32,
    )  # fmt: skip
    if getattr(cfg, "n_key_value_heads", None):
        out["n_key_value_heads"] = cfg.n_key_value_heads
    if cfg.positional_embedding_type == "rotary":
        out["rotary_dim"] = _NARROW
    if getattr(cfg, "final_rms", False):
        out["final_rms"] = True
    return {k: v for k, v in out.items() if v is not None}

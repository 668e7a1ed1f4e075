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
  layer at a time, the upstream group), and every layer load is scaled by the real diff's bytes
  for that layer, every tensor read on its own (``W_O``, ``b_O`` where its layer is not loaded)
  by that tensor's (``shift.counting``). Which layers a method reads, and how often, then does
  not depend on widths. The real diff's bytes are what crosses for it: a float32 or float64 Δ's
  own, the finetuned tensors' in their stored dtype for a diff formed on demand (bf16: half),
  the factors of a low-rank one; a diff formed on demand also reads every tensor once for its
  norms on its first scoring call. A vocabulary matrix that the real model reads a part at a
  time is counted whole (the narrow copy's vocabulary is small): the embedding's rows of the
  batch are less.
- **Memory** above the weights is a formula over the shapes (listed in ``Estimate.parts``):
  the Δ layers held on the device, one piece's ``W + αΔ`` in the compute dtype (twice: forward
  and the backward's re-formed copy), the embedding's and unembedding's ``W + αΔ``, the logits
  and the activations (one layer with a graph when gradients go one layer at a time, else every
  layer's); one layer at a time, linear's layer-major sweep keeps every boundary's stream at
  every later layer (up to ``upstream.SWEEP_BYTES``) and the integrated method each node's
  stream entering each layer. It is an upper-bound-minded sketch checked against ``benchmarks/bench_memory.py``'s
  measurements (docs/benchmarks.md), not a guarantee.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from extractive_lens.backend.lazy import LazyDeltas
from extractive_lens.backend.lowrank import LowRankDeltas

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
        return "\n".join(lines)


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
    moved = _counted(model, diff, batch, method, options)
    read = sum(by_group.get(g, 0) * n for g, n in moved.by_group.items())
    read += round(sum(stored.get(n, 0) * share for n, share in moved.reads.items()))
    if isinstance(deltas, LazyDeltas) and "_read_once" not in vars(diff):
        read += delta_bytes  # its norms and fingerprint (``WeightDiff._read_once``), first call

    compute = 4  # float32 (the default compute dtype of 16-bit models)
    if any(p.dtype == torch.float64 for p in params.values()):
        compute = 8
    rows, pos = len(batch), batch.n_pos
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
    block = sum(p.numel() for n, p in params.items() if B.layer_of(n) == 0)  # one block's
    parts["one block's W + αΔ (forward, backward)"] = 2 * block * compute
    vocab_matrix = vocab * d_model * compute
    parts["embedding and unembedding W + αΔ"] = 2 * vocab_matrix
    parts["logits (value, log-softmax, gradient)"] = 3 * rows * pos * vocab * compute
    lw = entry.gradients and runs.layerwise(model, batch)
    shapes = Shapes(
        rows=rows, pos=pos, n_layers=cfg.n_layers, n_heads=cfg.n_heads, d_model=d_model,
        d_mlp=d_mlp, d_vocab=vocab, compute=compute, layerwise=lw,
    )  # fmt: skip
    parts.update(entry.memory(shapes, built))
    return Estimate(
        method=method, device=str(model_dev), weights_bytes=weights, delta_bytes=delta_bytes,
        parts=parts, delta_read_bytes=read, layer_loads=moved.loads, layerwise=lw,
        gradients=entry.gradients,
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


def _counted(
    model: Any, diff: Any, batch: Any, method: str, options: dict[str, Any], sized: Any = None
) -> Any:
    """``shift.counting()``'s ``Traffic`` of the same call on a narrow copy (module docstring);
    ``sized``: the model whose sizes the choices follow (default ``model``)."""
    import copy
    import dataclasses
    import warnings

    from extractive_lens import WeightDiff, make_batch
    from extractive_lens.backend import shift
    from extractive_lens.model import tiny_model
    from extractive_lens.scoring import runs
    from extractive_lens.scoring.linear import linear_scores
    from extractive_lens.scoring.methods import method as method_entry

    narrow = tiny_model(_narrow_config(model), seed=0)  # which layers are read: not backend-bound
    g = torch.Generator().manual_seed(0)
    moved = copy.deepcopy(
        narrow
    )  # the copy's stored weights moved (a bridge's unstored zeros stay)
    with torch.no_grad():
        for p in moved.parameters():
            p.add_(1e-3 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    full = WeightDiff.from_models(narrow, moved)
    # Δ on the copy's weight matrices the real diff changes: the loads are by layer, and each is
    # scaled by the real diff's bytes for that layer below (biases and norms left out: a native
    # TransformerLens 4 bridge shows zeros for some biases and refuses a change there)
    names = set(diff.deltas)
    proxy = WeightDiff(
        {n: d for n, d in full.deltas.items() if n in names and d.ndim >= 2}, full.signature
    )
    n_vocab = narrow.cfg.d_vocab
    pairs = [
        ([1 + (i + j) % (n_vocab - 2) for j in range(batch.n_pos - 1)], [1 + i % (n_vocab - 2)])
        for i in range(len(batch))
    ]  # fmt: skip
    proxy_batch = make_batch(narrow, pairs, candidates=sorted({a[0] for _, a in pairs}))
    options = {k: v for k, v in options.items() if k not in ("linear", "show_progress")}
    saved = shift.REUSE_BYTES
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
            with shift.counting() as moved:
                entry.engine(narrow, proxy, proxy_batch, show_progress=False, **options)
    finally:
        shift.REUSE_BYTES = saved
    return moved


_NARROW = 8


def _narrow_config(model: Any) -> dict[str, Any]:
    """The model's structure at width 8 (every head 8 wide, the MLP 16, a vocabulary of 64)."""
    cfg = model.cfg
    out: dict[str, Any] = dict(
        n_layers=cfg.n_layers, n_heads=cfg.n_heads, d_head=_NARROW,
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

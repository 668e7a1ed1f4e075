"""The weights ``W + α·Δ`` supplied to the forward pieces, never written into the model.

>>> from extractive_lens import backend as B
>>> with shifted(model, diff):            # the finetuned model W' = W + Δ ...
...     x = B.run_blocks(model, B.embed(model, batch.tokens))
>>> with shifted(model, diff, alpha=0.5): # ... or any point of the straight path W + αΔ
...     logits = B.unembed(model, B.run_blocks(model, B.embed(model, batch.tokens)))

Inside the block every piece (``embed``, ``attention``, ``mlp``, ``unembed``) runs with its own
module's parameters replaced by ``W + α·Δ`` while it runs (``compute.upcast_call``), in the
compute dtype; the model's parameters and buffers are never written, so there is nothing to save
or restore, and an interrupt cannot leave the model changed.

Δ is held one layer at a time where the pieces run: the tensors of the layer a piece belongs to
are moved to the model's device when that layer first runs (``non_blocking`` from pinned host
memory) and the next layer's are prefetched on a side stream on CUDA; at most ``KEEP_LAYERS``
layers of Δ are on the device at once. A diff whose tensors are formed on demand
(``WeightDiff.from_checkpoints``) is read the same way, one layer at a time.

Every read of Δ while scoring goes through here and is counted (``traffic.counting``): a layer's
load, a vocabulary matrix's part (``Shift.part``), a tensor read on its own (``read``).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

from extractive_lens.backend import traffic, vocab
from extractive_lens.backend.lazy import LazyDeltas
from extractive_lens.backend.lowrank import LowRank, LowRankDeltas, low_rank_factors
from extractive_lens.backend.names import layer_of
from extractive_lens.backend.traffic import Traffic as Traffic
from extractive_lens.backend.traffic import counting as counting

KEEP_LAYERS = 2
"""Layers of Δ kept on the device at once (the one running and the next, prefetched)."""

REUSE_BYTES = 2**30
"""A model whose float32 weights are smaller than this keeps every layer's Δ and ``W + αΔ`` for
the whole shift (a scoring call runs each layer many times and forms ``W + αΔ`` once, as the
write into the model did before; GPT-2 small with its own unembedding is 0.65 GB); a larger
model forms them in each piece and holds ``KEEP_LAYERS`` layers of Δ (an 8B layer's ``W + αΔ``
is 0.9 GB in float32)."""

Offset = Tensor | LowRank
"""Δ of one stored tensor: dense, or the factors of a low-rank change (``WeightDiff.from_peft``
on a ``HookedTransformer``, or a TransformerBridge's ``nn.Linear`` weight: the pieces add them
as ``(x L) R``; elsewhere ``value`` adds them to W in one ``addmm``)."""

Group = int | str
"""Where a stored tensor runs: a block's index, ``EMBED`` (before the blocks) or ``UNEMBED``
(the final norm and the unembedding, after them)."""
EMBED, UNEMBED = "embed", "unembed"

_SHIFTS: contextvars.ContextVar[tuple[Shift, ...]] = contextvars.ContextVar(
    "extractive_lens_shifts", default=()
)


class Store:
    """Δ where the pieces run, one layer at a time: the layers loaded (at most ``KEEP_LAYERS``
    for a large model), those being prefetched and the vocabulary matrices' whole Δ. Shared by
    every shift of one model and diff inside ``reusing()`` (whatever its alpha), so that passes
    run layer by layer side by side (the integrated method's nodes, linear's finetuned rows)
    read each layer's Δ once."""

    def __init__(self) -> None:
        self.loaded: OrderedDict[Group, dict[int, Offset]] = OrderedDict()
        self.pending: dict[Group, tuple[Any, dict[int, Offset]]] = {}
        self.whole: dict[int, Offset | None] = {}
        self.formed: set[int] = set()  # vocabulary matrices whose whole Δ was formed in place
        # tensors read on their own (``Shift.read``) while their layer is loaded, kept with it
        self.alone: dict[Group, dict[str, Offset]] = {}
        self.last: Group | None = None  # the group read last (a backward sweep prefetches down)


class Shift:
    """``W + alpha·Δ`` for one model: which stored tensor gets which offset, one layer at a time."""

    def __init__(
        self, model: Any, diff: Any, alpha: float, store: Store | None = None,
        small: bool | None = None,
    ) -> None:  # fmt: skip
        """``small``: keep every layer's Δ and ``W + αΔ`` for the whole shift (``None``: when
        the model's float32 weights are under ``REUSE_BYTES``); ``False`` holds
        ``KEEP_LAYERS`` layers whatever the model's size (a shift used by one pass or two)."""
        from extractive_lens import backend as B

        self.model, self.diff, self.alpha = model, diff, float(alpha)
        self.backend = B.backend_for(model)
        self.device = torch.device(model.cfg.device) if model.cfg.device else None
        # the tensors the model stores, by identity, grouped by the layer that runs them
        self.group: dict[int, Group] = {}
        in_block: dict[int, Group] = {}
        for layer, block in enumerate(model.blocks):
            for p in block.parameters():
                in_block[id(p)] = layer
        for module in (getattr(model, "embed", None), getattr(model, "pos_embed", None)):
            for p in module.parameters() if module is not None else ():
                in_block.setdefault(id(p), EMBED)
        self.raw_names: dict[str, int] = {}
        for name, p in model.named_parameters(remove_duplicate=False):
            self.group[id(p)] = in_block.get(id(p), UNEMBED)
            self.raw_names[name] = id(p)
        self.names_by_group: dict[Group, list[str]] = {}
        for name in diff.deltas:
            self.names_by_group.setdefault(_group_of(name), []).append(name)
        store = store or Store()
        self._loaded = store.loaded
        self._values: dict[Group, dict[tuple[int, torch.dtype], Tensor]] = {}
        self.small = (sum(p.numel() for p in model.parameters()) * 4 <= REUSE_BYTES
                      if small is None else small)  # fmt: skip
        # vocabulary matrices read a part at a time (backend/vocab.py): their Δ is not loaded
        # with their group but read per part (``part``) from where the diff holds it; by stored
        # tensor, the TransformerLens names it is (transposed or not: a bridge's lm_head)
        self.by_part: dict[int, tuple[tuple[str, bool], ...]] = {}
        large = {id(p) for p in vocab.matrices(model)}
        for name, (p, transposed) in vocab.named(model).items():
            if id(p) in large:
                self.by_part[id(p)] = (*self.by_part.get(id(p), ()), (name, transposed))
        self.parted = {name for names in self.by_part.values() for name, _ in names}
        self.part_params = {id(p): p for p in vocab.matrices(model) if id(p) in self.by_part}
        self._whole = store.whole
        self._pending = store.pending
        self.store = store

    def covers(self, p: Tensor) -> bool:
        return id(p) in self.group

    def offset(self, p: Tensor) -> Offset | None:
        """``Δ`` for the stored tensor ``p`` (on its device), or ``None`` where Δ is zero."""
        if id(p) not in self.group:
            return None
        return self._layer(self.group[id(p)]).get(id(p))

    def part(self, p: Tensor, dim: int, index: Tensor | slice) -> Offset | None:
        """Δ of the vocabulary matrix ``p`` (``vocab.matrices``) restricted to ``index`` along
        ``dim``, on ``p``'s device (``None`` where Δ is zero); only that part is moved."""
        counted = id(p) in self.by_part and id(p) not in self.store.formed
        if id(p) not in self.by_part:  # not read by part: restrict the loaded Δ (counted then)
            d = self.offset(p)
        else:
            if id(p) not in self._whole:  # in p's layout, a view: the diff's tensor is not copied
                self._whole[id(p)] = self._whole_of(id(p))
                counted = id(p) not in self.store.formed
            d = self._whole[id(p)]
        if d is None:
            return None
        if isinstance(d, LowRank):
            part = vocab.restricted(d, dim, index).to(p.device)
            if counted:
                traffic.count(part.nbytes(), self._name(p), part.nbytes() / d.nbytes())
            return part
        if isinstance(index, Tensor):
            index = index.to(d.device)
        out = (d[index] if dim == 0 else d[:, index]).to(p.device)
        if counted:
            traffic.count(traffic.nbytes(out), self._name(p), out.numel() / max(d.numel(), 1))
        return out

    def _name(self, p: Tensor) -> str:
        """The TransformerLens name a part of the vocabulary matrix ``p`` is counted under."""
        return self.by_part[id(p)][0][0]

    def _whole_of(self, i: int) -> Offset | None:
        """The whole Δ of the stored vocabulary matrix ``i`` where the diff holds it, in its
        stored layout (``vocab.stored_delta``: a view, or the factors), its parts counted as
        they are read; a diff formed on demand forms it where the base weight is, its finetuned
        tensor counted once (``Store.formed``: the parts then move nothing)."""
        factors = low_rank_factors(self.diff.deltas, self.backend)
        deltas = self.diff.deltas
        if isinstance(deltas, LazyDeltas) and not any(n in factors for n, _ in self.by_part[i]):
            self.store.formed.add(i)
            deltas = traffic.CountedReads(deltas)
        return vocab.stored_delta(deltas, self.by_part[i], factors)

    def read(self, name: str) -> Offset | None:
        """Δ of the TransformerLens-named tensor ``name`` (``None`` where Δ is zero), on the
        device its layer runs on, for the scores that read a tensor on their own (``W_O``,
        ``b_O``): taken from the store where its layer is loaded and the model stores it under
        that name (a ``HookedTransformer``: no read of its own), else read alone, counted
        (``Traffic.reads``) and kept while its layer stays loaded (a ``TransformerBridge``'s
        loaded Δ is in its own layout: one read per layer load). Factors stay factors."""
        deltas = self.diff.deltas
        if name not in deltas:
            return None
        g = _group_of(name)
        loaded = g in self._loaded or g in self._pending
        i = self.raw_names.get(name)
        if loaded and i is not None and i not in self.by_part and self.group[i] == g:
            found = self._layer(g).get(i)
            if found is not None:
                return found
        kept = self.store.alone.get(g, {}) if g in self._loaded else {}
        if name in kept:
            return kept[name]
        dev = self._device_of(g)
        out: Offset
        f = low_rank_factors(deltas, self.backend, any_backend=True).get(name)
        if f is not None:
            traffic.count(f.nbytes(), name)
            out = f.to(dev) if dev is not None else f
        else:
            d, moved = traffic.formed(deltas, name)
            traffic.count(moved, name)
            out = d.to(dev) if dev is not None else d
        if g in self._loaded:
            self.store.alone.setdefault(g, {})[name] = out
        return out

    def value(self, p: Tensor, dtype: torch.dtype) -> Tensor:
        """``p + alpha·Δ`` in ``dtype`` (``p`` upcast first: no rounding to the stored dtype)."""
        d = self.offset(p)
        if d is None:
            return p.detach().to(dtype)
        g = self.group[id(p)]  # offset() found it
        reuse = self._values.get(g)
        if reuse is not None and (id(p), dtype) in reuse:
            return reuse[(id(p), dtype)]
        wide = torch.promote_types(torch.promote_types(p.dtype, d.dtype), dtype)
        if isinstance(d, LowRank):  # W + αΔ as one (b)addmm: B @ A is never formed
            out = d.to(p.device).added_to(p, self.alpha, wide).to(dtype)
            if reuse is not None:
                reuse[(id(p), dtype)] = out
            return out
        d = d if d.device == p.device else d.to(p.device)
        # one tensor of W's size beside Δ (an unembedding's W + αΔ at Llama-3 size is 2 GiB in
        # float32): αΔ in Δ's dtype, widened, then W added in place (same rounding as W + αΔ)
        out = (d if self.alpha == 1.0 else self.alpha * d).to(wide, copy=self.alpha == 1.0)
        out = out.add_(p.detach()).to(dtype)
        if reuse is not None:
            reuse[(id(p), dtype)] = out
        return out

    # ---------------------------------------------------------------- one layer at a time
    def _layer(self, g: Group) -> dict[int, Offset]:
        found = self._loaded.get(g)
        if found is None:
            found = self._wait(g) if g in self._pending else self._load(g)
            self._loaded[g] = found
            while not self.small and len(self._loaded) > KEEP_LAYERS:
                gone, _ = self._loaded.popitem(last=False)
                self._values.pop(gone, None)
                self.store.alone.pop(gone, None)
            after = self._next(g, backwards=isinstance(g, int) and isinstance(
                self.store.last, int) and g < self.store.last)  # fmt: skip
            if after is not None:
                self._prefetch(after)
        else:
            self._loaded.move_to_end(g)
        self.store.last = g
        if self.small and g not in self._values:
            self._values[g] = {}
        return found

    def tangents(self, g: Group) -> dict[str, Offset]:
        """The group's Δ as a direction for ``compute.jvp`` (the model's own parameter names),
        from what is loaded: a forward-mode pass while the layer runs reads no Δ of its own.
        Low-rank factors stay factors: the pieces add ``(x L) R`` to the derivative. A
        vocabulary matrix read a part at a time (``vocab.matrices``) gets a function of
        ``(dim, index)`` giving that part of Δ (``part``: only the part moves, counted), which
        the piece reading it calls (``vocab.rows``, ``vocab.logits``)."""
        names: dict[int, str] = {}
        for name, i in self.raw_names.items():
            names.setdefault(i, name)
        out: dict[str, Any] = {names[i]: d for i, d in self._layer(g).items()}
        for i, tl in self.by_part.items():  # a vocabulary matrix's: read a part at a time
            mine = [n for n, _ in tl if _group_of(n) == g and n in self.diff.deltas]
            if mine and i in names:  # (tied: the embedding's and the unembedding's group)
                out[names[i]] = functools.partial(self.part, self.part_params[i])
        return out

    def _next(self, g: Group, backwards: bool = False) -> Group | None:
        """The group that runs after ``g`` (the one to prefetch): the layer before it in a
        backward sweep (``g`` came after a later layer)."""
        if backwards:
            return g - 1 if isinstance(g, int) and g > 0 else None
        if g == EMBED:
            return 0
        if isinstance(g, int):
            return g + 1 if g + 1 < self.model.cfg.n_layers else UNEMBED
        return None

    def _device_of(self, g: Group) -> torch.device | None:
        """Where group ``g`` runs (a block's own device: models split over ``n_devices``)."""
        if isinstance(g, int):
            first = next(iter(self.model.blocks[g].parameters()), None)
            if first is not None:
                return first.device
        return self.device

    def _load(self, g: Group, non_blocking: bool = False) -> dict[int, Offset]:
        names = [n for n in self.names_by_group.get(g, []) if n not in self.parted]
        if not names:
            return {}
        traffic.count_load(g)
        values: dict[str, Tensor] = {}
        low_rank: dict[int, Offset] = {}
        block_dev = self._device_of(g) if isinstance(g, int) else None
        factors = low_rank_factors(self.diff.deltas, self.backend)
        for n in names:
            if n in factors:  # kept as factors: W + αΔ is formed from them (value)
                low_rank[self.raw_names[n]] = factors[n].to(block_dev or self.device)
                traffic.count(factors[n].nbytes())
                continue
            if isinstance(self.diff.deltas, LowRankDeltas) and n in self.diff.deltas.factors:
                traffic.count(traffic.factor_bytes(self.diff.deltas, n))
                # a TransformerBridge: the factors of a stored nn.Linear weight, which its
                # pieces add at the module's output (raw_low_rank); else Δ formed where it runs
                raw = None
                if n not in self.diff.deltas.dense:
                    raw = self.backend.raw_low_rank(self.model, n, self.diff.deltas.factors[n])
                if raw is not None:
                    low_rank[self.raw_names[raw[0]]] = raw[1].to(block_dev or self.device)
                else:
                    values[n] = self.diff.deltas.formed_on(n, block_dev or self.device)
                continue
            d, moved = traffic.formed(self.diff.deltas, n)
            traffic.count(moved)
            dev = block_dev or self.device or d.device
            blocking = not (non_blocking and d.device.type == "cpu" and d.is_pinned())
            values[n] = d.to(dev, non_blocking=not blocking)
        if not values:
            return low_rank
        dtype = torch.promote_types(next(iter(values.values())).dtype, torch.float32)
        raw = self.backend.raw_tangents(self.model, values, dtype)
        return {self.raw_names[n]: t for n, t in raw.items() if n in self.raw_names} | low_rank

    def _prefetch(self, g: Group) -> None:
        if g in self._loaded or g in self._pending or self.device is None:
            return
        if self.device.type != "cuda" or not torch.cuda.is_available():
            return
        stream = torch.cuda.Stream(device=self.device)
        with torch.cuda.stream(stream):
            self._pending[g] = (stream, self._load(g, non_blocking=True))

    def _wait(self, g: Group) -> dict[int, Offset]:
        stream, values = self._pending.pop(g)
        current = torch.cuda.current_stream(self.device)
        current.wait_stream(stream)
        for t in values.values():
            for part in (t.left, t.right) if isinstance(t, LowRank) else (t,):
                part.record_stream(current)
        return values


def _group_of(name: str) -> Group:
    """The group of a TransformerLens parameter name (``blocks.3.attn.W_Q``: 3)."""
    layer = layer_of(name)
    if layer is not None:
        return layer
    return EMBED if name.startswith(("embed.", "pos_embed.")) else UNEMBED


def active(p: Tensor) -> Shift | None:
    """The innermost shift that covers the stored tensor ``p`` (``None``: no shift applies)."""
    for s in reversed(_SHIFTS.get()):
        if s.covers(p):
            return s
    return None


def any_active() -> bool:
    return bool(_SHIFTS.get())


def for_model(model: Any) -> Shift | None:
    """The innermost shift of ``model`` (``None`` outside one)."""
    for s in reversed(_SHIFTS.get()):
        if s.model is model:
            return s
    return None


@contextlib.contextmanager
def shifted(model: Any, diff: Any, alpha: float = 1.0, *, keep: bool = True) -> Iterator[Shift]:
    """Run ``model``'s pieces with weights ``W + alpha·Δ`` inside the block (module docstring).

    Nothing about the model changes: the shift is a context variable the pieces read, so a
    thread or task outside the block sees the base weights. Inside ``reusing()`` the shift is
    shared with later blocks of the same model, diff and alpha unless ``keep=False``.
    """
    reuse = _REUSE.get() if keep else None
    key = (id(model), id(diff), float(alpha))
    s = None if reuse is None else reuse.get(key)
    if s is None or s.model is not model or s.diff is not diff:
        s = Shift(model, diff, alpha, store_of(model, diff))
        if reuse is not None:
            reuse[key] = s
    with _shifts((*_SHIFTS.get(), s)):
        yield s


_REUSE: contextvars.ContextVar[dict[tuple[int, int, float], Shift] | None] = contextvars.ContextVar(
    "extractive_lens_shift_reuse", default=None
)


_STORES: contextvars.ContextVar[dict[tuple[int, int], tuple[Any, Any, Store]] | None] = (
    contextvars.ContextVar("extractive_lens_shift_stores", default=None)
)


def store_of(model: Any, diff: Any) -> Store:
    """The Δ store of ``model`` and ``diff``: inside ``reusing()`` one for every shift of them
    (any alpha, ``keep`` or not), else a new one."""
    stores = _STORES.get()
    if stores is None:
        return Store()
    found = stores.get((id(model), id(diff)))
    if found is None or found[0] is not model or found[1] is not diff:
        found = (model, diff, Store())
        stores[(id(model), id(diff))] = found
    return found[2]


def tangents(model: Any, diff: Any, g: Group) -> dict[str, Any]:
    """Δ of group ``g`` as a forward-mode direction (``Shift.tangents``), read through the
    store of ``model`` and ``diff``: counted, and not read again while that layer is loaded."""
    return Shift(model, diff, 1.0, store_of(model, diff)).tangents(g)


def read(model: Any, diff: Any, name: str) -> Offset | None:
    """Δ of the tensor ``name`` read on its own (``Shift.read``), through the store of
    ``model`` and ``diff``: from the loaded layer where it is there, else counted."""
    return Shift(model, diff, 1.0, store_of(model, diff)).read(name)


@contextlib.contextmanager
def reusing() -> Iterator[None]:
    """Inside the block, ``shifted`` with the same model, diff and alpha gives the same shift
    (its Δ and, for small models, its ``W + αΔ`` formed once), and every shift of one model and
    diff shares the Δ loaded (``Store``): one scoring call's passes share them; nothing is kept
    after the block."""
    previous, stores = _REUSE.get(), _STORES.get()
    tokens: list[contextvars.Token[Any]] = []
    try:
        tokens.append(_REUSE.set({} if previous is None else previous))
        tokens.append(_STORES.set({} if stores is None else stores))
        yield
    finally:
        _put_back(_STORES, tokens[1:], stores)
        _put_back(_REUSE, tokens[:1], previous)


@contextlib.contextmanager
def within(s: Shift | None) -> Iterator[None]:
    """Inside the block, the shift ``s`` applies again (``None``: nothing changes)."""
    with _shifts(_SHIFTS.get() if s is None else (*_SHIFTS.get(), s)):
        yield


@contextlib.contextmanager
def unshifted(model: Any) -> Iterator[None]:
    """The base weights of ``model`` inside the block, whatever shifts enclose it."""
    with _shifts(tuple(s for s in _SHIFTS.get() if s.model is not model)):
        yield


@contextlib.contextmanager
def _shifts(now: tuple[Shift, ...]) -> Iterator[None]:
    """The shifts in force inside the block; the previous ones again after it, whatever happens
    (an interrupt before the ``try`` leaves nothing set, one inside it is undone)."""
    previous = _SHIFTS.get()
    tokens: list[contextvars.Token[Any]] = []
    try:
        tokens.append(_SHIFTS.set(now))
        yield
    finally:
        _put_back(_SHIFTS, tokens, previous)


def _put_back(var: contextvars.ContextVar[Any], tokens: list[Any], previous: Any) -> None:
    """``var`` as it was before the block that set it (``tokens``: the set's token, if kept).

    Only in the context that set it: a generator that an interrupt left suspended (in contextlib's
    ``__exit__``, before it resumed the generator) is closed late, by the garbage collector,
    in whatever context runs then (a later call's: setting ``previous`` there changed that call's
    shifts, which the token's ``reset`` refuses). Without a token (the interrupt landed between
    the set and keeping its token) the block is being left now, in its own context."""
    if not tokens:
        var.set(previous)
        return
    try:
        var.reset(tokens[0])
    except ValueError:  # created in another context: not this one's to change
        pass


def W_O_shift(model: Any, layer: int) -> Offset | None:
    """``alpha·ΔW_O`` of ``layer`` under the innermost shift of ``model`` (``None``: none)."""
    s = for_model(model)
    if s is None:
        return None
    d = s.read(f"blocks.{layer}.attn.W_O")  # counted (from the loaded layer where it is there)
    if d is None or s.alpha == 1.0:
        return d
    return d.scaled(s.alpha) if isinstance(d, LowRank) else s.alpha * d

"""Compute precision and forward-mode derivatives, for any ``nn.Module`` model.

A backend runs each forward piece through ``upcast_call`` (so a bf16 model is scored in float32
without a second copy of it) and differentiates pieces along a weight direction with ``jvp``.
Nothing here knows a model class or a parameter name beyond what the caller passes.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import threading
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

from extractive_lens.backend.lowrank import LowRank, primal, tangent_only

# ---------------------------------------------------------------------------------------------
# Compute precision: score a bf16/fp16 model in float32 without a second copy of it
# ---------------------------------------------------------------------------------------------

_COMPUTE_DTYPE: contextvars.ContextVar[torch.dtype | None] = contextvars.ContextVar(
    "extractive_lens_compute_dtype", default=None
)
_DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def resolve_compute_dtype(model: Any, compute_dtype: torch.dtype | str | None) -> torch.dtype:
    """The dtype scores are computed in: ``compute_dtype``, or by default float32 for 16-bit
    models and the model's own dtype otherwise.

    >>> from extractive_lens import tiny_model
    >>> resolve_compute_dtype(tiny_model({"dtype": torch.bfloat16}), None)
    torch.float32
    >>> resolve_compute_dtype(tiny_model({"dtype": torch.float64}), "float32")
    torch.float32
    """
    storage = model.cfg.dtype
    if compute_dtype is None:
        return torch.float32 if storage in (torch.float16, torch.bfloat16) else storage
    if isinstance(compute_dtype, str):
        name = compute_dtype.removeprefix("torch.")
        if name not in _DTYPES:
            raise ValueError(
                f"compute_dtype must be one of {sorted(_DTYPES)}, got {compute_dtype!r}"
            )
        return _DTYPES[name]
    if not isinstance(compute_dtype, torch.dtype) or not compute_dtype.is_floating_point:
        raise ValueError(
            f"compute_dtype must be a floating torch.dtype such as torch.float32, got {compute_dtype!r}"
        )
    return compute_dtype


@contextlib.contextmanager
def computing_in(model: Any, dtype: torch.dtype) -> Iterator[None]:
    """Run the forward pieces below (``embed``, ``attention``, ``mlp``, ``unembed``) in ``dtype``
    whatever the dtype the weights are stored in.

    Nothing is copied up front: each piece upcasts only its own module's parameters while it
    runs (one layer at a time), and under autograd the upcast weights are not kept for the
    backward pass (they are upcast again from the stored tensors when needed). ``model.cfg.dtype``
    reads ``dtype`` inside the block, because TransformerLens's norms and attention round their
    outputs to it, for this thread (context) only: another thread running the model meanwhile
    reads the stored dtype (setting the field itself fails on mixed dtypes).
    """
    if dtype == model.cfg.dtype and _COMPUTE_DTYPE.get() in (None, dtype):
        yield
        return
    from extractive_lens.interrupts import state_change

    cfg = model.cfg
    old, previous, previous_cfg = cfg.dtype, _COMPUTE_DTYPE.get(), _CFG_DTYPES.get()
    viewed: list[type] = []  # the class cfg had, where this block gave it the per-context view

    def change() -> None:
        _COMPUTE_DTYPE.set(dtype)
        if "dtype" not in vars(cfg):  # not a plain field: set it (seen by every thread)
            cfg.dtype = dtype
            return
        if not getattr(type(cfg), "_extractive_lens_view", False):
            viewed.append(type(cfg))
            cfg.__class__ = _dtype_view(type(cfg))
        _CFG_DTYPES.set({**previous_cfg, id(cfg): dtype})

    def restore() -> None:  # set, not reset: a late run may be in another context
        _CFG_DTYPES.set(previous_cfg)
        if viewed:
            cfg.__class__ = viewed.pop()
        if "dtype" not in vars(cfg):
            cfg.dtype = old
        _COMPUTE_DTYPE.set(previous)

    with state_change(change, restore, model=model):
        yield


_CFG_DTYPES: contextvars.ContextVar[dict[int, torch.dtype]] = contextvars.ContextVar(
    "extractive_lens_cfg_dtypes",
    default={},  # noqa: B039 - never mutated, only replaced
)
"""Per model config (by ``id``, only while its ``computing_in`` block runs), the dtype its
``dtype`` field reads in this context."""

_VIEWS: dict[type, type] = {}


def _dtype_view(cls: type) -> type:
    """``cls`` with ``dtype`` read through ``_CFG_DTYPES`` (the stored field elsewhere): the
    class a config has while ``computing_in`` runs. Same name and module, so a pickle of the
    config names the original class."""
    view = _VIEWS.get(cls)
    if view is None:

        def get(self: Any) -> Any:
            d = _CFG_DTYPES.get().get(id(self))
            return self.__dict__["dtype"] if d is None else d

        def put(self: Any, value: Any) -> None:
            self.__dict__["dtype"] = value

        view = type(cls.__name__, (cls,), {
            "dtype": property(get, put), "_extractive_lens_view": True,
            "__module__": cls.__module__, "__qualname__": cls.__qualname__,
        })  # fmt: skip
        _VIEWS[cls] = view
    return view


def upcast_call(
    module: Any, prefixes: tuple[str, ...], fn: Any, *args: Any, upcast_buffer: Any = None,
    low_rank: frozenset[str] = frozenset(),
) -> Any:  # fmt: skip
    """``fn(module, *args)`` with the parameters under ``prefixes`` (``""``: all) in the compute
    dtype (see ``computing_in``) and, inside ``shift.shifted``, at ``W + α·Δ``; plain
    ``fn(module, *args)`` when there is nothing to substitute. The model is never written: the
    substitutes live in the module's registries only while ``fn`` runs.

    ``low_rank``: parameters (names as ``module.named_parameters()`` gives them) whose low-rank
    change and low-rank tangent (``low_rank_part``) ``fn`` adds itself, as ``x W + α·(x L) R``:
    they are substituted by ``W`` alone. A low-rank tangent of any other parameter is made dense
    here (a piece that does not know the parameter's product with its input)."""
    from extractive_lens.backend import shift

    dtype = _COMPUTE_DTYPE.get()
    shifting = shift.any_active()
    tangents = {i: t for i, t in _DEFERRED.get().items() if isinstance(t, LowRank)}
    if dtype is None and not shifting and not tangents:
        return fn(module, *args)
    subs: dict[str, Tensor] = {}
    sources: dict[int, tuple[Tensor, Any, torch.dtype]] = {}
    for name, p in module.named_parameters():
        if not name.startswith(prefixes):
            continue
        dt = dtype or p.dtype
        s = shift.active(p) if shifting else None
        offset = None if s is None else s.offset(p)
        mine = name in low_rank
        t = tangents.get(id(p))
        if offset is not None and not (mine and isinstance(offset, LowRank)):
            new = s.value(p, dt)  # type: ignore[union-attr]
            again = functools.partial(s.value, p, dt)  # type: ignore[union-attr]
        elif p.dtype != dt:
            new = p.to(dt)
            again = functools.partial(_upcast_again, p, dt)
        elif t is None or mine:
            continue
        else:
            new, again = p.detach(), functools.partial(_upcast_again, p, dt)
        if t is not None and not mine:  # a tangent this piece does not add itself: dense
            import torch.autograd.forward_ad as fwAD

            subs["model." + name] = fwAD.make_dual(new, t.dense().to(new))
            continue
        subs["model." + name] = new
        sources[new.untyped_storage().data_ptr()] = (p, again, dt)
    if dtype is not None:
        for name, b in module.named_buffers():
            if name.startswith(prefixes) and b.is_floating_point() and b.dtype != dtype:
                subs["model." + name] = (upcast_buffer or _plain_upcast)(module, name, b, dtype)
    if not subs:
        return fn(module, *args)
    with substituted(module, subs):
        if not torch.is_grad_enabled() or not sources:
            return fn(module, *args)
        with torch.autograd.graph.saved_tensors_hooks(*_weights_not_saved(sources)):
            return fn(module, *args)


def _upcast_again(p: Tensor, dtype: torch.dtype) -> Tensor:
    return p.detach().to(dtype)


@contextlib.contextmanager
def substituted(module: Any, tensors: dict[str, Tensor]) -> Iterator[None]:
    """Inside the block, ``module``'s parameters and buffers named in ``tensors`` (``"model."``
    + the name ``named_parameters()`` gives) are those tensors *for this thread* (this context);
    any other thread running the model meanwhile reads the stored tensors (docs/api.md,
    "Threads"). Every alias of a tied weight is substituted (GPT-2's ``W_E`` and ``W_U``).

    How: a module reads a parameter as ``self._parameters[name]`` (``nn.Module.__getattr__``;
    TransformerLens 4's bridge components forward attribute access to the wrapped module, which
    does the same). While a substitution is in force, the registries holding substituted tensors
    are ``_Registry`` dicts: they hold the stored tensors, as before, and answer a lookup with
    the substitute only in the context that made it (``_SUBSTITUTES``, a context variable: a new
    thread starts without it). Writing the substitutes into the plain registries, as this did
    before, let a plain ``model(tokens)`` in another thread run with ``W + αΔ`` on some layers
    and ``W`` on others, or with forward-mode duals of a level that thread does not have.
    The plain registries (the same dict objects) are put back on exit, whatever happens."""
    from extractive_lens.interrupts import state_change

    named = dict(module.named_parameters(remove_duplicate=False))
    named.update(module.named_buffers(remove_duplicate=False))
    by_id = {id(named[name.removeprefix("model.")]): value for name, value in tensors.items()}
    previous = _SUBSTITUTES.get()
    installed: list[tuple[dict[str, Any], str, dict[str, Any], _Registry]] = []

    def change() -> None:
        now = dict(previous)
        for m in module.modules():  # every alias of a tied weight (GPT-2's W_E and W_U)
            for attr in ("_parameters", "_buffers"):
                registry = m.__dict__[attr]
                leaves = {
                    leaf: by_id[id(t)]
                    for leaf, t in dict.items(registry)
                    if t is not None and id(t) in by_id
                }
                if not leaves:
                    continue
                if type(registry) is not _Registry:  # an inner block reuses the outer's
                    overlay = _Registry(registry)
                    installed.append((m.__dict__, attr, registry, overlay))
                    m.__dict__[attr] = overlay  # one store: any thread sees one or the other
                    registry = overlay
                now[registry] = {**now.get(registry, {}), **leaves}
        _SUBSTITUTES.set(now)

    def restore() -> None:  # set, not reset: a late run (after an interrupt) is in another context
        _SUBSTITUTES.set(previous)
        for owner, attr, original, overlay in reversed(installed):
            if dict.keys(overlay) != original.keys() or any(
                original[k] is not v for k, v in dict.items(overlay)
            ):  # registered or replaced meanwhile: keep that in the original dict object
                original.clear()
                original.update(dict.items(overlay))
            owner[attr] = original
        installed.clear()

    with state_change(change, restore, model=module):
        yield


_SUBSTITUTES: contextvars.ContextVar[dict[_Registry, dict[str, Any]]] = contextvars.ContextVar(
    "extractive_lens_substitutes",
    default={},  # noqa: B039 - never mutated, only replaced
)
"""Per ``_Registry`` (the object: a key that no later registry can reuse), the tensors that
replace its entries in this context."""


class _Registry(dict):
    """A module's ``_parameters`` or ``_buffers`` while ``substituted`` is in force: the stored
    tensors, except in the context that substitutes some of them (``_SUBSTITUTES``), which
    reads its substitutes. Only what ``nn.Module`` reads through is overridden (``[]``, ``get``,
    ``items``, ``values``, iteration over ``items``); writes go to the stored entries."""

    __slots__ = ()
    __hash__ = object.__hash__  # type: ignore[assignment]  # a key of _SUBSTITUTES, by identity
    __eq__ = object.__eq__  # type: ignore[assignment]

    def __getitem__(self, key: str) -> Any:
        subs = _SUBSTITUTES.get().get(self)
        if subs is not None and key in subs:
            return subs[key]
        return dict.__getitem__(self, key)

    def get(self, key: str, default: Any = None) -> Any:
        return self[key] if key in self else default

    def items(self) -> Any:
        subs = _SUBSTITUTES.get().get(self)
        if not subs:
            return dict.items(self)
        return [(k, subs.get(k, v)) for k, v in dict.items(self)]

    def values(self) -> Any:
        return [v for _, v in self.items()]


def this_thread_only(hook: Any) -> Any:
    """``hook`` (a module hook) acting only when the thread that made it runs the module: the
    hooks a piece attaches while it runs (captures) ignore another thread's forward of the same
    model, which neither runs them nor overwrites what they captured."""
    owner = threading.get_ident()

    @functools.wraps(hook)
    def mine(*args: Any, **kwargs: Any) -> Any:
        if threading.get_ident() != owner:
            return None
        return hook(*args, **kwargs)

    return mine


def _weights_not_saved(sources: dict[int, tuple[Tensor, Any, torch.dtype]]) -> tuple[Any, Any]:
    """Saved-tensor hooks that keep a reference to the stored weight instead of its substitute
    (an upcast copy, or ``W + α·Δ``; a view of it, as matmuls save them) and form the substitute
    again when the backward pass needs it: a backward pass holds no weight copies."""

    def pack(t: Tensor) -> Any:
        found = sources.get(t.untyped_storage().data_ptr())
        if found is None or t.dtype != found[2]:
            return t
        src, again, _ = found
        return (src, again, src._version, t.size(), t.stride(), t.storage_offset())

    def unpack(packed: Any) -> Tensor:
        if isinstance(packed, Tensor):
            return packed
        src, again, version, size, stride, offset = packed
        if src._version != version:
            raise RuntimeError(
                "A weight changed between the forward and backward pass of a scoring run."
            )
        return again().as_strided(size, stride, offset)

    return pack, unpack


def _plain_upcast(module: Any, name: str, buf: Tensor, dtype: torch.dtype) -> Tensor:
    return buf.to(dtype)


def compute_dtype() -> torch.dtype | None:
    """The dtype set by the innermost ``computing_in`` block (``None`` outside one)."""
    return _COMPUTE_DTYPE.get()


@contextlib.contextmanager
def frozen_parameters(model: Any) -> Iterator[None]:
    """Turn off ``requires_grad`` on every parameter (no weight gradients), restored on exit."""
    from extractive_lens.interrupts import state_change

    saved = [(p, p.requires_grad) for p in model.parameters()]

    def change() -> None:
        for p, _ in saved:
            p.requires_grad_(False)

    def restore() -> None:
        for p, flag in saved:
            p.requires_grad_(flag)

    with state_change(change, restore, model=model):
        yield


_DEFERRED: contextvars.ContextVar[dict[int, Any]] = contextvars.ContextVar(
    "extractive_lens_deferred_tangents",
    default={},  # noqa: B039 - never mutated, only replaced
)


def deferred_tangent(p: Tensor) -> Any:
    """Inside ``jvp``, the tangent of the stored tensor ``p`` where ``jvp`` left it to the piece
    that reads ``p`` (a vocabulary matrix read a part at a time: ``deferred``, its tangent
    whole or a function reading a part, ``vocab.Tangent``; any low-rank tangent); ``None``
    otherwise."""
    return _DEFERRED.get().get(id(p))


def low_rank_part(p: Tensor) -> tuple[LowRank | None, float, LowRank | None]:
    """What a piece adds for the stored tensor ``p`` as ``x @ Δ`` products (``LowRank.apply``)
    rather than in its weight: ``(change, alpha, tangent)``, the shift in force's low-rank
    change of ``p`` and its ``alpha`` (``None``, 0: none, or a dense one, which ``upcast_call``
    adds to ``W``) and ``p``'s low-rank tangent inside ``jvp`` (``None``: none)."""
    from extractive_lens.backend import shift

    s = shift.active(p) if shift.any_active() else None
    change = None if s is None else s.offset(p)
    t = deferred_tangent(p)
    return (
        change if isinstance(change, LowRank) else None,
        0.0 if s is None else s.alpha,
        t if isinstance(t, LowRank) else None,
    )


def plus_low_rank(out: Tensor, x: Tensor, part: tuple[LowRank | None, float, LowRank | None],
                  fit: Any = None) -> Tensor:  # fmt: skip
    """``out + α·(x @ Δ)`` for the shift's low-rank change and ``+ ε·(x @ Δ_t)`` for the
    low-rank tangent (``low_rank_part``), as ``(x L) R`` products; ``fit`` reshapes a term to
    ``out`` (a grouped key/value change read per query head)."""
    change, alpha, t = part
    fit = fit or (lambda u: u)
    if change is not None:
        out = out + alpha * fit(change.apply(x))
    if t is not None:
        out = out + tangent_only(fit(t.apply(primal(x))))
    return out


def jvp(
    model: Any, fn: Any, args: tuple[Any, ...], tangents: dict[str, Any],
    deferred: Any = None,
) -> tuple[Any, Any]:  # fmt: skip
    """Forward-mode derivative of ``fn(model, *args)`` along a weight direction.

    ``tangents`` maps the model's own parameter names (as ``named_parameters(remove_duplicate=
    False)`` lists them; a backend's ``raw_tangents`` builds it from TransformerLens names) to
    directions, dense or low-rank (``LowRank``: left to the pieces, which add ``(x L) R`` to the
    derivative: ``low_rank_part``, ``plus_low_rank``); parameters not named are held fixed.
    ``fn`` may return a tensor, a tuple or a dict of tensors; the result is ``(primal,
    tangent)`` with the same structure. A parameter
    for which ``deferred(p)`` is true gets no dual of its own: the piece that reads it a part at
    a time takes its tangent from ``deferred_tangent`` (backend/vocab.py).
    """
    import torch.autograd.forward_ad as fwAD

    from extractive_lens.backend import shift

    params = dict(model.named_parameters(remove_duplicate=False))
    unknown = sorted(set(tangents) - set(params))
    if unknown:
        raise KeyError(f"jvp: the model has no parameters {unknown[:3]}")
    dtype = _COMPUTE_DTYPE.get()
    with fwAD.dual_level():
        duals = {}
        later = dict(_DEFERRED.get())
        for name, t in tangents.items():
            if isinstance(t, LowRank) or (deferred is not None and deferred(params[name])):
                # a low-rank tangent moves whole (it is small); a vocabulary matrix's by part
                later[id(params[name])] = t.to(params[name].device) if isinstance(t, LowRank) else t
                continue
            p = params[name].detach()
            dt = dtype or p.dtype  # in a compute dtype, the weights and Δ are upcast, not Δ rounded
            s = shift.active(params[name])
            value = p.to(dt) if s is None else s.value(params[name], dt)
            duals["model." + name] = fwAD.make_dual(value, t.to(device=p.device, dtype=dt))
        token = _DEFERRED.set(later)
        try:
            with substituted(model, duals):
                result = fn(model, *args)
        finally:
            _DEFERRED.reset(token)
        return _unpack(result)


def _unpack(result: Any) -> tuple[Any, Any]:
    import torch.autograd.forward_ad as fwAD

    if isinstance(result, Tensor):
        d = fwAD.unpack_dual(result)
        return d.primal, d.tangent if d.tangent is not None else torch.zeros_like(d.primal)
    if isinstance(result, dict):
        pairs = {k: _unpack(v) for k, v in result.items()}
        return {k: p for k, (p, _) in pairs.items()}, {k: t for k, (_, t) in pairs.items()}
    pairs_l = [_unpack(v) for v in result]
    return tuple(p for p, _ in pairs_l), tuple(t for _, t in pairs_l)

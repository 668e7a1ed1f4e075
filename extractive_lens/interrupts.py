"""Interrupt-safe changes of a model's state: Ctrl-C never leaves weights, flags or hooks half restored.

>>> with Shield() as shield:          # interrupts are deferred from here ...
...     state = 1                     # ... while the state changes
...     try:
...         with shield.open():      # delivered normally while the user's code runs
...             pass
...     finally:
...         state = 0                 # deferred again while it is restored
>>> state
0

What it guards. Scoring never writes a model's weights (``backend.shifted`` supplies
``W + αΔ``), but these calls still change a model's state for a while, each through
``state_change`` (the change and its restore shielded, the body interruptible): the weights
(``WeightDiff.applied`` and ``finetune``, via ``weight_diff.weights_set``), TransformerLens's
view flags (``backend.standard_flags``, ``ungrouped_kv``), ``cfg.dtype`` (``computing_in``),
``requires_grad`` (``frozen_parameters``) and the per-context substitutes in the module
registries (``compute.substituted``). ``guarded`` wraps every public call in one more net: on
exit the registries, hooks, modes, grad and forward-AD state as they were; ``one_call_per_model``
around it lets one call per model run at a time, and releases the model only once restored. ``refuse_attached_hooks``: scores are of the model,
not of hooks left on it.

A Python signal handler runs in the main thread between two bytecodes, so a plain ``finally``
can be interrupted in the middle of a restore loop. ``Shield`` swaps in a handler that records the
signal instead (SIGINT, SIGTERM, SIGALRM: those with a Python handler) and replays it through the
original handler when the shield closes, after the state is consistent again. ``open()`` puts the
original handlers back for the body of a context manager; handler swaps are single C calls, and a
signal caught by the recording handler is replayed, never lost. Outside the main thread (where no
Python signal handler runs) it does nothing.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import weakref
from collections.abc import Iterator
from types import FrameType
from typing import Any

SIGNALS = tuple(
    s for s in (getattr(signal, n, None) for n in ("SIGINT", "SIGTERM", "SIGALRM")) if s is not None
)
_SHIELDS: list[
    Shield
] = []  # active shields, innermost last: only the innermost touches the handlers


class Shield:
    """Defers interrupt signals while active; ``open()`` lets them through for a block."""

    def __init__(self) -> None:
        self.saved: dict[int, Any] = {}
        self.caught: list[tuple[int, FrameType | None]] = []
        self.active = False

    def _record(self, signum: int, frame: FrameType | None) -> None:
        self.caught.append((signum, frame))

    def _install(self, handlers: dict[int, Any]) -> None:
        for s, h in handlers.items():
            signal.signal(s, h)

    def __enter__(self) -> Shield:
        if threading.current_thread() is threading.main_thread():
            for s in SIGNALS:
                h = signal.getsignal(s)
                if callable(h):
                    self.saved[s] = h
            self.active = True
            _SHIELDS.append(self)
            try:
                self._install(dict.fromkeys(self.saved, self._record))
            except BaseException:  # a signal between two swaps: leave nothing half installed
                self.active = False
                _SHIELDS[:] = [x for x in _SHIELDS if x is not self]
                self._install(self.saved)
                raise
        return self

    @property
    def innermost(self) -> bool:
        return self.active and bool(_SHIELDS) and _SHIELDS[-1] is self

    def __exit__(self, *exc: Any) -> None:
        if not self.active:
            return
        if (
            not self.innermost
        ):  # a shield left behind by an interrupt, closed late: handlers are not its own
            self.active = False
            _SHIELDS[:] = [x for x in _SHIELDS if x is not self]
            return
        self.active = False
        _SHIELDS.pop()
        try:  # an interrupt after one handler is back must not leave the others recording
            for s, h in self.saved.items():
                signal.signal(s, h)
        finally:
            for s, h in self.saved.items():
                signal.signal(s, h)
        self._replay()

    def _replay(self) -> None:
        caught, self.caught = self.caught, []
        for signum, frame in caught:
            self.saved[signum](signum, frame)

    def open(self) -> _Open:
        """Deliver interrupts normally inside the block (those caught so far first)."""
        return _Open(self)


class _Open:
    """``Shield.open()``: a plain object, not a generator, so that nothing re-arms a shield late
    (a generator left suspended by an interrupt would run its ``finally`` when collected)."""

    def __init__(self, shield: Shield) -> None:
        self.shield = shield

    def __enter__(self) -> None:
        if self.shield.innermost:
            self.shield._install(self.shield.saved)
            self.shield._replay()

    def __exit__(self, *exc: Any) -> None:
        if self.shield.innermost:
            for s in self.shield.saved:
                signal.signal(s, self.shield._record)


class Undo:
    """A restore that runs once: at its context's exit, or, where an interrupt skipped that exit,
    at the start of the next ``applied`` or public call after the code that opened the context has
    returned (``finish_stale``). Running it first completes the restores opened after it (nested
    inside it, left behind by an interrupt), innermost first, so saved states are replayed in
    order. A context left behind and finalized late finds its undo done and changes nothing."""

    _seq = 0

    def __init__(self, restore: Any, frame: FrameType | None) -> None:
        Undo._seq += 1
        self.seq, self.restore, self.frame, self.done = Undo._seq, restore, frame, False
        _pending().append(self)

    def __call__(self) -> None:
        if self.done:
            return
        for nested in sorted((u for u in _pending() if u.seq > self.seq), key=lambda u: -u.seq):
            nested._run()
        self._run()

    def _run(self) -> None:
        if not self.done:
            self.restore()
            self.done = True
            self.frame = None
            _LOCAL.pending = [u for u in _pending() if u is not self]


_LOCAL = threading.local()


def _pending() -> list[Undo]:
    if not hasattr(_LOCAL, "pending"):
        _LOCAL.pending = []
    return _LOCAL.pending


def caller_frame() -> FrameType | None:
    """The frame that opened the calling context manager (skipping contextlib and this module)."""
    import inspect
    import sys

    f: FrameType | None = sys._getframe(2)
    while f is not None and (
        f.f_code.co_filename in (contextlib.__file__, __file__)
        or f.f_code.co_flags & inspect.CO_GENERATOR
    ):
        f = f.f_back
    return f


@contextlib.contextmanager
def state_change(change: Any, restore: Any, *, model: Any) -> Iterator[None]:
    """``change()`` on entry and ``restore()`` on exit, neither of them interruptible, with
    interrupts delivered normally in between; ``restore`` is an ``Undo`` (run once, in nesting
    order, and at the next call if an interrupt skipped this exit).

    The one lock discipline: the block holds ``model``'s lock (``_model_lock``, the one every
    public call takes) from before ``change`` to after ``restore``, so no other thread's call
    runs on the model while its state is changed, whichever public context changed it
    (``WeightDiff.applied`` / ``grafted``, ``computing_in``, ``standard_flags``, ...). It is taken
    waiting in short steps, each a single C call under the shield, with interrupts delivered
    between them (nothing held when one lands), and released by the ``Undo`` with the restore,
    in this thread: where an interrupt skipped the exit, at this thread's next call."""
    with Shield() as shield:
        held: list[threading.RLock] = []

        def undo_all() -> None:
            try:
                restore()
            finally:
                while held:
                    held.pop().release()

        undo = Undo(undo_all, caller_frame())
        try:
            _take(_lock_of(model), shield, held)
            change()
            with shield.open():
                yield
        finally:
            undo()


class locked:
    """``with locked(model):`` holds the model's lock (the one every public call and state
    change takes) for the block: several calls of your own as one turn while another thread
    scores the model.

    >>> with locked(model):                                      # doctest: +SKIP
    ...     handle = model.add_hook(name, hook)
    ...     logits = model(tokens)
    ...     model.reset_hooks()

    Hooks attached in the block would be seen by a scoring call in another thread (refused as
    hooks left attached), and its forwards would fire them; inside the block, scoring in other
    threads waits. TransformerLens's hook contexts (``run_with_cache``, ``run_with_hooks``,
    ``model.hooks``) take this lock by themselves (``backend/hook_locks.py``). Re-entrant in the
    thread that holds it. A plain object (no generator), so that an interrupt cannot leave the
    lock held."""

    def __init__(self, model: Any) -> None:
        self.lock = _model_lock(model)
        self.held: list[threading.RLock] = []

    def __enter__(self) -> None:
        try:
            with Shield() as shield:
                _take(self.lock, shield, self.held)
        except BaseException:  # an interrupt replayed as the shield closed: nothing kept held
            while self.held:
                self.held.pop().release()
            raise

    def __exit__(self, *exc: Any) -> None:
        while self.held:
            self.held.pop().release()


def _lock_of(model: Any) -> threading.RLock | None:
    try:
        return _model_lock(model)
    except TypeError:  # not weak-referenceable: not a model
        return None


def _take(lock: threading.RLock | None, shield: Shield, held: list[threading.RLock]) -> None:
    """Acquire ``lock`` into ``held``: a wait of 50 ms at a time, interrupts delivered between."""
    if lock is None:
        return
    while not lock.acquire(timeout=0.05):
        with shield.open():  # a Ctrl-C caught while waiting raises here, with nothing held
            pass
    held.append(lock)


def finish_stale() -> None:
    """Run the restores that interrupts left pending, whose opening code has returned."""
    if not _pending():
        return
    import sys

    live = set()
    f: FrameType | None = sys._getframe()
    while f is not None:
        live.add(id(f))
        f = f.f_back
    with Shield():
        for undo in sorted(_pending(), key=lambda u: -u.seq):
            if not undo.done and id(undo.frame) not in live:
                undo()


def shielded() -> bool:
    """Whether an interrupt arriving now would be deferred (the SIGINT handler is a shield's)."""
    h = signal.getsignal(signal.SIGINT)
    return getattr(h, "__func__", None) is Shield._record


@contextlib.contextmanager
def guarded(model: Any) -> Iterator[None]:
    """Run a public call so that an interrupt anywhere leaves the model and torch as they were.

    Restored on exit, shielded: every module's parameter and buffer objects (``compute.substituted``
    swaps their registries, restoring them itself; this is the net), grad mode, every module's training mode, every parameter's
    ``requires_grad``, ``model.cfg.dtype``, the hooks on every module (any added inside are
    removed) and the forward-mode AD level. Scoring never writes weights (``backend.shifted``);
    the calls that do (``WeightDiff.applied``, ``finetune``) restore them in their own contexts,
    each shielded the same way.
    """
    # The model's lock is not taken here but around the whole call (``one_call_per_model``): a
    # lock held by a generator stays held while the generator is suspended, which is what an
    # interrupt landing in contextlib's ``__exit__`` before it resumes the generator leaves (and
    # a kept traceback, like a notebook's last one, keeps it suspended): every other thread's
    # next call on the model then waited for ever.
    finish_stale()
    state: dict[str, Any] = {}

    def change() -> None:
        state.update(_snapshot(model))
        if state["level"] < 0:
            reset_forward_ad()  # a level leaked by an earlier interrupt, seen only by C++

    with state_change(change, lambda: _restore(model, state), model=model):
        yield


_LOCKS: weakref.WeakKeyDictionary[Any, threading.RLock] = weakref.WeakKeyDictionary()


def one_call_per_model(fn: Any) -> Any:
    """Decorator for a public call whose first argument is a model: the call holds the model's
    lock (``_model_lock``) from its argument checks to its return, so that a second thread
    neither sees the first one's temporary hooks or weights nor changes them.

    Whatever ends the call (an exception, an interrupt in any context manager's exit), the lock
    is released and the model restored before it is: the lock is taken and released by a plain
    ``with`` in this frame (its enter and exit are single C calls, which no signal handler can
    split, unlike a ``with`` in a generator, which holds its lock while suspended); the call runs
    in a copy of the caller's context, so that no context variable it sets (the shifts, the
    substitutes, the compute dtype) outlives it even where an interrupt skipped the exit that
    resets it; and the restores an interrupt left pending run, shielded, before the release
    (``_completed``)."""
    import contextvars
    import functools

    @functools.wraps(fn)
    def call(model: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            lock = _model_lock(model)
        except TypeError:  # not weak-referenceable: not a model; the call's checks say so
            return fn(model, *args, **kwargs)
        run = contextvars.copy_context().run
        # one line: the release is on the line of the call, so that no line event comes between
        # them (a trace function can raise at one, where a signal handler cannot run)
        with lock: return run(_completed, fn, model, args, kwargs)  # noqa: E701  # fmt: skip

    return call


def _completed(fn: Any, model: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``fn(model, ...)``, then the restores its exits left pending (an interrupt between a
    context manager's ``__exit__`` and the generator it resumes leaves the generator suspended,
    for as long as the traceback is kept): the model as it was before its lock is released."""
    try:
        return fn(model, *args, **kwargs)
    finally:
        finish_stale()


def _model_lock(model: Any) -> threading.RLock:
    """The model's re-entrant lock: scoring and finetuning change a model's weights, modes and
    hooks while they run, so two threads calling into one model take turns (a call inside a
    call, as ``causal_scores(top_k=...)`` makes, re-enters).

    Found without a lock of its own: ``dict.setdefault`` is atomic, so two threads asking at
    once get the same lock, and an interrupt anywhere here leaves nothing held (a plain lock
    taken by ``with`` can stay held when the interrupt lands just after it is acquired)."""
    return _LOCKS.setdefault(model, threading.RLock())


_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")


def _snapshot(model: Any) -> dict[str, Any]:
    import torch
    import torch.autograd.forward_ad as fwAD

    modules = list(model.modules())
    return dict(
        grad=torch.is_grad_enabled(),
        training=[(m, m.training) for m in modules],
        tensors=[
            (m, dict(m._parameters), dict(m._buffers)) for m in modules
        ],  # compute.substituted swaps these
        flags=[(p, p.requires_grad) for p in model.parameters()],
        dtype=getattr(getattr(model, "cfg", None), "dtype", None),
        cfg_flags=_cfg_flags(getattr(model, "cfg", None)),
        hooks=[
            (
                m,
                {d: set(getattr(m, d, {})) for d in _HOOK_DICTS},
                (list(getattr(m, "fwd_hooks", [])), list(getattr(m, "bwd_hooks", []))),
            )
            for m in modules
        ],
        level=getattr(fwAD, "_current_level", -1),
    )


def _cfg_flags(cfg: Any) -> dict[str, bool]:
    """Every on/off switch of a model's config (TransformerLens's view flags among them): what a
    call may flip while it runs, snapshot without knowing the backend's names for them."""
    fields = getattr(cfg, "__dict__", {})
    return {k: v for k, v in fields.items() if isinstance(v, bool)}


def _restore(model: Any, state: dict[str, Any]) -> None:
    import torch
    import torch.autograd.forward_ad as fwAD

    if not state:  # interrupted inside the snapshot, before anything was changed: nothing to undo
        return
    if state["level"] < 0:
        reset_forward_ad()
    while getattr(fwAD, "_current_level", -1) > state["level"]:
        fwAD.exit_dual_level()
    for m, params, buffers in state["tensors"]:  # a swap cut short by an interrupt
        for table, saved in ((m._parameters, params), (m._buffers, buffers)):
            if table.keys() != saved.keys() or any(table[k] is not v for k, v in saved.items()):
                table.clear()
                table.update(saved)
    for m, hooks, (fwd, bwd) in state["hooks"]:
        for d, keep in hooks.items():
            table = getattr(m, d, None)
            if table is not None:
                for key in [k for k in table if k not in keep]:
                    del table[key]
        if hasattr(m, "fwd_hooks"):
            m.fwd_hooks[:] = fwd
            m.bwd_hooks[:] = bwd
    if state["dtype"] is not None:
        model.cfg.dtype = state["dtype"]
    for flag, value in state["cfg_flags"].items():
        if getattr(model.cfg, flag, value) is not value:  # only what changed: a bridge's config
            setattr(model.cfg, flag, value)  # acts on some assignments
    for p, flag in state["flags"]:
        p.requires_grad_(flag)
    for m, mode in state["training"]:
        m.training = mode
    torch.set_grad_enabled(state["grad"])


def reset_forward_ad() -> None:
    """No forward-mode AD level, in torch's C++ state and in ``forward_ad._current_level`` alike.

    The two are updated one after the other, so an interrupt between them leaves them disagreeing
    ("Nested forward mode AD is not supported" on the next JVP). The package never nests levels.
    """
    import torch
    import torch.autograd.forward_ad as fwAD

    try:
        torch._C._exit_dual_level(level=0)
    except RuntimeError:  # no level was open
        pass
    fwAD._current_level = -1


def attached_hooks(model: Any) -> list[str]:
    """``"name (n hooks)"`` for every module of ``model`` that has hooks attached."""
    out = []
    for name, m in model.named_modules():
        n = sum(
            1 for d in _HOOK_DICTS for fn in getattr(m, d, {}).values() if not _bridge_wiring(fn)
        )
        if n:
            out.append(f"{name or 'model'} ({n} hook{'s' * (n > 1)})")
    return out


def _bridge_wiring(fn: Any) -> bool:
    """A hook a TransformerBridge or Hugging Face installs on the modules a bridge wraps (their
    own machinery: activation capture for ``output_attentions``, the bridge's hook wiring)."""
    return str(getattr(fn, "__module__", "")).startswith(
        ("transformer_lens.model_bridge", "transformers.")
    )


def refuse_attached_hooks(model: Any, fn: str) -> None:
    """Scores are of the model itself: hooks left attached would change them silently."""
    found = attached_hooks(model)
    if found:
        shown = ", ".join(found[:4]) + (f" and {len(found) - 4} more" if len(found) > 4 else "")
        raise ValueError(
            f"{fn}: the model has hooks attached at {shown}; they would change the scores silently. "
            "Remove them first: model.reset_hooks(including_permanent=True) (or leave the `with "
            "model.hooks(...)` block) and score again. If another thread attached them for a "
            "moment (model.add_hook), run that inside `with el.model.locked(model):`, which "
            "scoring waits for."
        )

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
from collections.abc import Iterator
from types import FrameType
from typing import Any

SIGNALS = tuple(s for s in (getattr(signal, n, None) for n in ("SIGINT", "SIGTERM", "SIGALRM")) if s is not None)


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
            self._install(dict.fromkeys(self.saved, self._record))
        return self

    def __exit__(self, *exc: Any) -> None:
        self.active = False
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
        self.shield._install(self.shield.saved)
        self.shield._replay()

    def __exit__(self, *exc: Any) -> None:
        if self.shield.active:
            for s in self.shield.saved:
                signal.signal(s, self.shield._record)


def shielded() -> bool:
    """Whether an interrupt arriving now would be deferred (the SIGINT handler is a shield's)."""
    h = signal.getsignal(signal.SIGINT)
    return getattr(h, "__func__", None) is Shield._record


@contextlib.contextmanager
def guarded(model: Any) -> Iterator[None]:
    """Run a public call so that an interrupt anywhere leaves the model and torch as they were.

    Restored on exit, shielded: grad mode, every module's training mode, every parameter's
    ``requires_grad``, ``model.cfg.dtype``, the hooks on every module (any added inside are
    removed) and the forward-mode AD level. Weights are restored by the contexts that change
    them (``WeightDiff.applied``, ``finetune``), each shielded the same way.
    """
    with Shield() as shield:
        state = _snapshot(model)
        try:
            with shield.open():
                yield
        finally:
            _restore(model, state)


_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")


def _snapshot(model: Any) -> dict[str, Any]:
    import torch
    import torch.autograd.forward_ad as fwAD

    modules = list(model.modules())
    return dict(
        grad=torch.is_grad_enabled(),
        training=[(m, m.training) for m in modules],
        flags=[(p, p.requires_grad) for p in model.parameters()],
        dtype=getattr(getattr(model, "cfg", None), "dtype", None),
        cfg_flags={f: getattr(model.cfg, f) for f in ("use_attn_result", "use_split_qkv_input", "use_attn_in",
                                                      "use_hook_mlp_in") if hasattr(getattr(model, "cfg", None), f)},
        hooks=[(m, {d: set(getattr(m, d, {})) for d in _HOOK_DICTS},
                (list(getattr(m, "fwd_hooks", [])), list(getattr(m, "bwd_hooks", [])))) for m in modules],
        level=getattr(fwAD, "_current_level", -1),
    )


def _restore(model: Any, state: dict[str, Any]) -> None:
    import torch
    import torch.autograd.forward_ad as fwAD

    while getattr(fwAD, "_current_level", -1) > state["level"]:
        fwAD.exit_dual_level()
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
        setattr(model.cfg, flag, value)
    for p, flag in state["flags"]:
        p.requires_grad_(flag)
    for m, mode in state["training"]:
        m.training = mode
    torch.set_grad_enabled(state["grad"])


def attached_hooks(model: Any) -> list[str]:
    """``"name (n hooks)"`` for every module of ``model`` that has hooks attached."""
    out = []
    for name, m in model.named_modules():
        n = sum(len(getattr(m, d, {})) for d in _HOOK_DICTS)
        if n:
            out.append(f"{name or 'model'} ({n} hook{'s' * (n > 1)})")
    return out


def refuse_attached_hooks(model: Any, fn: str) -> None:
    """Scores are of the model itself: hooks left attached would change them silently."""
    found = attached_hooks(model)
    if found:
        shown = ", ".join(found[:4]) + (f" and {len(found) - 4} more" if len(found) > 4 else "")
        raise ValueError(
            f"{fn}: the model has hooks attached at {shown}; they would change the scores silently. "
            "Remove them first: model.reset_hooks(including_permanent=True) (or leave the `with "
            "model.hooks(...)` block) and score again."
        )

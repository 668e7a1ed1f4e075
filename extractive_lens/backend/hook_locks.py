"""TransformerLens's own hook contexts hold the model's lock while their hooks are attached.

``model.hooks(...)``, ``model.run_with_hooks(...)`` and ``model.run_with_cache(...)`` attach hooks
to the model for their length. A scoring call in another thread meanwhile would see them as hooks
left attached (and refuse), or its forwards would fire them (and fill that cache with the
scorer's activations). ``lock_hook_contexts(cls)``, which ``backend_for`` runs the first time it
sees a model class, wraps these methods of the class so that each holds the model's lock
(``interrupts.locked``: the one every public call and state change takes) from before its hooks
are attached to after they are removed. The user's call and scoring then take turns, with
nothing asked of the user.

The lock is re-entrant in its thread (``run_with_cache`` enters ``hooks``; a scoring call inside
a ``with model.hooks(...)`` block still refuses the block's hooks as attached), and costs one
uncontended acquisition per call where no other thread scores. A ``with model.hooks(...)``
block held open in one thread makes scoring in every other thread wait for its end.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

from extractive_lens.interrupts import locked

HOOK_CONTEXTS = ("hooks", "run_with_hooks", "run_with_cache")
"""The methods of both model classes that attach hooks for their own length: ``hooks`` returns
a context manager (held for its block), the other two run and return."""


def lock_hook_contexts(cls: type) -> None:
    """Wrap ``cls``'s hook contexts (``HOOK_CONTEXTS``) so that each holds its model's lock;
    once per class (a subclass of a wrapped class finds the wrappers and keeps them)."""
    for name in HOOK_CONTEXTS:
        method = getattr(cls, name, None)
        if not inspect.isfunction(method) or getattr(method, "holds_model_lock", False):
            continue
        setattr(cls, name, (_held_context if name == "hooks" else _held_call)(method))


def _held_call(method: Any) -> Any:
    @functools.wraps(method)
    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        with locked(self):
            return method(self, *args, **kwargs)

    call.holds_model_lock = True  # type: ignore[attr-defined]
    return call


def _held_context(method: Any) -> Any:
    @functools.wraps(method)
    def context(self: Any, *args: Any, **kwargs: Any) -> _Held:
        return _Held(locked(self), method(self, *args, **kwargs))

    context.holds_model_lock = True  # type: ignore[attr-defined]
    return context


class _Held:
    """A context manager entered with the model's lock held and left before it is released. A
    plain object (no generator), so that an interrupt cannot leave the lock held."""

    def __init__(self, lock: locked, inner: Any) -> None:
        self.lock, self.inner = lock, inner

    def __enter__(self) -> Any:
        try:  # an interrupt between the two leaves nothing held: the lock is released here
            self.lock.__enter__()
            return self.inner.__enter__()
        except BaseException:  # the hooks were not attached: nothing to hold the lock for
            self.lock.__exit__(None, None, None)
            raise

    def __exit__(self, *exc: Any) -> Any:
        try:
            return self.inner.__exit__(*exc)
        finally:
            self.lock.__exit__(None, None, None)

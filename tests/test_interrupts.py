"""Interrupts (Ctrl-C) anywhere leave the model exactly as it was, and the next call succeeds.

Deterministic: a trace function raises KeyboardInterrupt at the n-th line executed in the package
(and in contextlib, whose context-manager machinery runs our restores, and in torch's
``nn.utils``, where ``functional_call`` swaps parameters) for every n, except where
a real signal would be deferred (inside an ``interrupts.Shield``). Random: SIGALRM timers raise
KeyboardInterrupt at random moments of the public calls, through the real signal machinery.
"""

from __future__ import annotations

import contextlib
import random
import signal
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.autograd.forward_ad as fwAD

import extractive_lens
from extractive_lens import (
    FinetuneConfig,
    WeightDiff,
    causal_scores,
    finetune,
    linear_scores,
    tiny_model,
)
from extractive_lens.interrupts import shielded
from tests.conftest import make_pair, needs_hooked
from tests.helpers import small_batch

PACKAGE = str(Path(extractive_lens.__file__).parent)
TORCH_SWAP = str(
    Path(torch.__file__).parent / "nn" / "utils"
)  # functional_call's parameter swapping
WATCHED = (PACKAGE, contextlib.__file__, TORCH_SWAP)


def snapshot(model):
    hooks = [
        (
            n,
            len(m._forward_hooks),
            len(m._forward_pre_hooks),
            len(m._backward_hooks),
            len(getattr(m, "fwd_hooks", [])),
            len(getattr(m, "bwd_hooks", [])),
        )
        for n, m in model.named_modules()
    ]
    return dict(
        weights=[p.detach().clone() for p in model.parameters()],
        objects=[(n, id(p), type(p).__name__) for n, p in model.named_parameters()],
        flags=[p.requires_grad for p in model.parameters()],
        grads=[p.grad for p in model.parameters()],
        training=[m.training for m in model.modules()],
        grad_mode=torch.is_grad_enabled(),
        dtype=model.cfg.dtype,
        hooks=hooks,
        level=fwAD._current_level,
        handlers=[signal.getsignal(x) for x in (signal.SIGINT, signal.SIGTERM, signal.SIGALRM)],
        locked=extractive_lens.interrupts._model_lock(model)._is_owned(),  # by this thread
    )


def assert_unchanged(model, before, where):
    now = snapshot(model)
    for a, b in zip(before["weights"], now["weights"]):
        assert torch.equal(a, b), f"weights changed ({where})"
    assert all(x is y for x, y in zip(before["grads"], now["grads"])), (
        f".grad buffers changed ({where})"
    )
    keys = ("objects", "flags", "training", "grad_mode", "dtype", "hooks", "level", "handlers")
    for key in (*keys, "locked"):
        assert before[key] == now[key], f"{key} changed ({where})"


class Injector:
    """Raise KeyboardInterrupt at the n-th watched line where an interrupt could be delivered."""

    def __init__(self, n: int | None) -> None:
        self.n, self.count = n, 0

    def __call__(self, frame, event, arg):
        if not frame.f_code.co_filename.startswith(WATCHED):
            return None
        return self.local

    def local(self, frame, event, arg):
        if event == "line" and not shielded():
            self.count += 1
            if self.count == self.n:
                raise KeyboardInterrupt(f"injected at line {self.count}")
        return self.local


def run_traced(fn, n):
    inj = Injector(n)
    sys.settrace(inj)
    try:
        fn()
        return inj.count, False
    except KeyboardInterrupt:
        return inj.count, True
    finally:
        sys.settrace(None)


@pytest.fixture(autouse=True)
def python_sigint_handler():
    """These tests inject what Ctrl-C raises, KeyboardInterrupt, which presupposes Python's own
    SIGINT handler. A process that ignores SIGINT (a test runner's parent can leave it SIG_IGN)
    never raises it, and there a shield has nothing to defer; install the default for the test."""
    found = signal.getsignal(signal.SIGINT)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, found)


@pytest.fixture(scope="module")
def setting():
    base, ft = make_pair(
        "ln_gelu", torch.float64, n_layers=1, d_model=8, n_heads=2, d_head=4, d_mlp=8
    )
    diff = WeightDiff.from_models(base, ft)
    batch = small_batch(base, n=3)
    with torch.no_grad():  # a TransformerLens 4 bridge registers a hook of its own on first use
        base(batch.tokens)
    return base, diff, batch


def calls(base, diff, batch):
    def applied():  # (no torch.no_grad() here: its own exit has the same window, and it is torch's)
        with diff.applied(base, components=["L0H1", "L0MLP"]):
            return base(batch.tokens).detach()

    return {
        "applied": applied,
        "linear_scores": lambda: linear_scores(base, diff, batch, show_progress=False),
        "causal_scores": lambda: causal_scores(
            base, diff, batch, kinds=("informative", "upstream"), show_progress=False
        ),
        "finetune": lambda: finetune(
            base, batch, FinetuneConfig(epochs=1, batch_size=2), show_progress=False
        ),
        "linear_scores bf16": None,  # filled below
    }


def _result_equal(a, b):
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, WeightDiff):
        return all(torch.equal(a.deltas[n], b.deltas[n]) for n in a.deltas)
    return torch.equal(a.prompt_values, b.prompt_values)


@pytest.mark.parametrize("name", ["applied", "linear_scores", "causal_scores", "finetune"])
def test_interrupt_at_every_line(setting, name):
    base, diff, batch = setting
    base.blocks[0].attn.W_Q.grad = torch.ones_like(base.blocks[0].attn.W_Q)  # a user's .grad buffer
    fn = calls(base, diff, batch)[name]
    before = snapshot(base)
    reference = fn()
    total, fired = run_traced(fn, None)
    assert not fired and total > 50, total
    # every line of the short paths; an even spread of 150 points over the long ones
    points = (
        range(1, total + 1)
        if total <= 1500
        else sorted({1 + round(i * (total - 1) / 149) for i in range(150)})
    )
    landed = 0
    for n in points:
        _, fired = run_traced(fn, n)
        landed += fired
        assert_unchanged(base, before, f"{name}, interrupted at line {n} of {total}")
    assert landed >= 0.95 * len(points), f"only {landed} of {len(points)} interrupts landed"
    assert _result_equal(fn(), reference)  # and the next call succeeds
    assert_unchanged(base, before, f"{name}, after the next call")
    base.blocks[0].attn.W_Q.grad = None


def test_interrupt_by_signal_at_random_moments(setting):
    """SIGALRM raising KeyboardInterrupt, through the real signal machinery (deferred while shielded)."""
    base, diff, batch = setting
    fns = calls(base, diff, batch)
    rng = random.Random(0)

    def alarm(signum, frame):
        raise KeyboardInterrupt("alarm")

    old = signal.signal(signal.SIGALRM, alarm)
    try:
        for name in ("applied", "linear_scores", "causal_scores", "finetune"):
            fn = fns[name]
            before = snapshot(base)
            reference = fn()
            t0 = time.perf_counter()
            fn()
            duration = time.perf_counter() - t0
            hits = 0
            for _ in range(15):
                try:  # armed inside the try: a 10 µs alarm can fire as setitimer returns
                    signal.setitimer(signal.ITIMER_REAL, rng.uniform(1e-5, duration))
                    fn()
                    time.sleep(duration)  # the alarm lands after the call instead
                except KeyboardInterrupt:
                    hits += 1
                finally:
                    signal.setitimer(signal.ITIMER_REAL, 0)
                assert_unchanged(base, before, f"{name} after a random SIGALRM")
            assert hits >= 5, f"{name}: only {hits} of 15 alarms landed inside the call"
            assert _result_equal(fn(), reference)
    finally:
        signal.signal(signal.SIGALRM, old)


def test_a_deferred_interrupt_is_delivered_after_the_restore(setting):
    """An interrupt during a shielded restore is not lost: it arrives once the state is consistent."""
    base, diff, batch = setting
    before = snapshot(base)
    with pytest.raises(KeyboardInterrupt):
        with diff.applied(base):
            signal.raise_signal(signal.SIGINT)  # delivered at once: the body is not shielded
    assert_unchanged(base, before, "SIGINT in the body")

    def restore_then_interrupt():
        with diff.applied(base):
            pass

    import extractive_lens.weight_diff as wd

    real_copy = torch.Tensor.copy_
    state = {"sent": False}

    def copy_and_signal(self, src, *a, **k):
        out = real_copy(self, src, *a, **k)
        if shielded() and not state["sent"]:
            state["sent"] = True
            signal.raise_signal(signal.SIGINT)  # arrives while the weights are half restored
        return out

    with pytest.raises(KeyboardInterrupt):
        torch.Tensor.copy_ = copy_and_signal
        try:
            restore_then_interrupt()
        finally:
            torch.Tensor.copy_ = real_copy
    assert state["sent"] and wd is not None
    assert_unchanged(base, before, "SIGINT during the restore")


@needs_hooked
def test_hooks_the_user_attached_are_refused(setting):
    base, diff, batch = setting
    base.blocks[0].attn.hook_z.add_hook(lambda act, hook: act * 2)
    try:
        for fn in (linear_scores, causal_scores):
            with pytest.raises(
                ValueError, match=r"hooks attached at blocks\.0\.attn\.hook_z.*reset_hooks"
            ):
                fn(base, diff, batch)
    finally:
        base.reset_hooks(including_permanent=True)
    assert linear_scores(base, diff, batch).values.abs().max() > 0
    m = tiny_model()
    assert m.cfg.dtype == torch.float32


@needs_hooked
def test_guard_removes_hooks_and_restores_modes_added_inside(setting):
    """The public-call guard undoes what an interrupt between two bytecodes could leave behind."""
    from extractive_lens.interrupts import guarded

    base, _, _ = setting
    before = snapshot(base)
    with pytest.raises(KeyboardInterrupt):
        with guarded(base):
            base.blocks[0].attn.hook_z.register_forward_hook(
                lambda m, i, o: o
            )  # a capture hook, mid-call
            base.blocks[0].attn.hook_k.add_hook(lambda act, hook: act)
            base.train()
            base.cfg.dtype = torch.float32
            base.blocks[0].mlp.W_in.requires_grad_(False)
            torch.set_grad_enabled(False)
            fwAD.enter_dual_level()
            raise KeyboardInterrupt
    assert_unchanged(base, before, "after the guard")


def test_an_open_window_never_re_arms_a_closed_shield():
    from extractive_lens.interrupts import Shield

    original = signal.getsignal(signal.SIGINT)
    with Shield() as shield:
        window = shield.open()
        window.__enter__()
    window.__exit__(None, None, None)  # late, after the shield closed
    assert signal.getsignal(signal.SIGINT) is original


def test_an_interrupt_inside_the_snapshot_leaves_nothing_to_undo(setting, monkeypatch):
    """An interrupt while a public call is still reading the model's state (nothing changed yet)
    surfaces as the KeyboardInterrupt, not as an error of the restore, and the next call works."""
    import extractive_lens.interrupts as I

    base, diff, batch = setting
    before = snapshot(base)
    reference = linear_scores(base, diff, batch, show_progress=False)

    def interrupted(model):
        raise KeyboardInterrupt("while reading the state")

    monkeypatch.setattr(I, "_snapshot", interrupted)
    with pytest.raises(KeyboardInterrupt, match="while reading the state"):
        linear_scores(base, diff, batch, show_progress=False)
    monkeypatch.undo()
    assert_unchanged(base, before, "interrupted in the snapshot")
    again = linear_scores(base, diff, batch, show_progress=False)
    assert torch.equal(again.prompt_values, reference.prompt_values)


def test_an_interrupt_while_finding_a_models_lock_leaves_no_lock_held(setting):
    """Found by the every-line test hanging: an interrupt landing on the line that released a
    plain lock around the lookup of the model's lock left that lock held, and every later public
    call on any model waited for ever. Each line of the lookup is interrupted in turn; a second
    thread must then still get the lock."""
    import threading

    from extractive_lens import interrupts

    base = setting[0]
    code = interrupts._model_lock.__code__

    def tracing(at):
        seen = [0]

        def local(frame, event, arg):
            if event == "line":
                seen[0] += 1
                if seen[0] == at:
                    raise KeyboardInterrupt(f"injected at line {at} of _model_lock")
            return local

        def tracer(frame, event, arg):
            return local if frame.f_code is code else None

        return tracer, seen

    tracer, seen = tracing(0)
    sys.settrace(tracer)
    try:
        interrupts._model_lock(base)
    finally:
        sys.settrace(None)
    assert seen[0] >= 1
    for at in range(1, seen[0] + 1):
        tracer, _ = tracing(at)
        sys.settrace(tracer)
        try:
            interrupts._model_lock(base)
        except KeyboardInterrupt:
            pass
        finally:
            sys.settrace(None)
        found = []
        t = threading.Thread(target=lambda: found.append(interrupts._model_lock(base)), daemon=True)
        t.start()
        t.join(timeout=10)
        assert found, f"interrupted at line {at} of the lookup, a lock was left held"


def _exits_seen(fn):
    """The code of every generator-based context manager whose exit ``fn`` runs."""
    seen: dict = {}
    real = contextlib._GeneratorContextManager.__exit__

    def recording(self, *exc):
        seen.setdefault(self.gen.gi_code, None)
        return real(self, *exc)

    contextlib._GeneratorContextManager.__exit__ = recording
    try:
        fn()
    finally:
        contextlib._GeneratorContextManager.__exit__ = real
    return [c for c in seen if c.co_filename.startswith(PACKAGE)]


@needs_hooked
@pytest.mark.parametrize("name", ["linear_scores", "causal_scores", "finetune"])
def test_an_interrupt_in_a_context_managers_exit_leaves_the_model_free_and_unshifted(
    setting, name, monkeypatch
):
    """An interrupt landing in contextlib's ``__exit__`` before it resumes the generator leaves
    the generator suspended for as long as the traceback is kept (a notebook keeps the last one).
    A lock taken inside it stayed held (every other thread's next call waited for ever), and a
    context variable it set stayed set (a shift left active: the next call in this thread scored
    W + αΔ as the base). Each of the package's context managers is interrupted at its exit in
    turn, alone and together with the public call's guard (Ctrl-C pressed twice), the traceback
    kept: another thread must get the model's lock, a plain forward must give the base logits,
    the model must be as it was, and the next call must give the same result."""
    import threading

    from extractive_lens import interrupts

    base, diff, batch = setting
    fn = calls(base, diff, batch)[name]
    before = snapshot(base)
    logits = base(batch.tokens).detach()
    reference = fn()
    codes = _exits_seen(fn)
    by_name = {c.co_name: c for c in codes}
    assert {"guarded", "state_change"} <= set(by_name), by_name
    real = contextlib._GeneratorContextManager.__exit__
    failed = []
    for code in codes:
        for also in {code, by_name["guarded"]}:
            targets = {code, also}
            fired: list = []

            def interrupted(self, *exc):
                if self.gen.gi_code in targets and self.gen.gi_code not in fired:
                    fired.append(self.gen.gi_code)
                    raise KeyboardInterrupt(f"at the exit of {self.gen.gi_code.co_name}")
                return real(self, *exc)

            monkeypatch.setattr(contextlib._GeneratorContextManager, "__exit__", interrupted)
            with pytest.raises(KeyboardInterrupt) as kept:  # the traceback kept, as a notebook
                fn()
            monkeypatch.undo()
            where = f"{name}, interrupted at the exit of {sorted(c.co_name for c in targets)}"
            assert set(fired) == targets, where
            got = []

            def take():
                lock = interrupts._model_lock(base)
                if lock.acquire(timeout=2):
                    got.append(True)
                    lock.release()

            t = threading.Thread(target=take, daemon=True)
            t.start()
            t.join(timeout=10)
            if not got:
                failed.append(f"the model's lock is still held ({where})")
            if not torch.equal(base(batch.tokens).detach(), logits):
                failed.append(f"a plain forward is not the base model's ({where})")
            try:
                assert_unchanged(base, before, where)
            except AssertionError as e:
                failed.append(str(e).splitlines()[0])
            if not _result_equal(fn(), reference):
                failed.append(f"the next call differs ({where})")
            del kept
    assert not failed, "\n".join(failed)

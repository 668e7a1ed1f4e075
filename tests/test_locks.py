"""One lock discipline: every public context that changes a model's state holds the model's
lock (``interrupts.state_change``), so a scoring call in another thread waits for the block to
end and then scores the model as it is, not the state the block gave it."""

from __future__ import annotations

import contextlib
import threading

import pytest
import torch

import extractive_lens as el
from extractive_lens import model as M
from extractive_lens.backend.installed import has_hooked
from tests.conftest import FAMILIES, make_pair
from tests.helpers import small_batch


def _flags(model):
    """``standard_flags`` changes state only where a view flag is on: turn one on."""
    if not has_hooked():
        pytest.skip("a TransformerBridge has no view flags to turn off")
    model.cfg.use_attn_result = True
    return M.standard_flags(model)


CONTEXTS = {
    "applied": lambda model, diff: diff.applied(model),
    "applied_components": lambda model, diff: diff.applied(model, components=["L0H1"]),
    "grafted": lambda model, diff: diff.grafted(model, components="L1MLP"),
    "computing_in": lambda model, diff: M.computing_in(model, torch.float32),
    "frozen_parameters": lambda model, diff: M.frozen_parameters(model),
    "standard_flags": lambda model, diff: _flags(model),
    "hooks": lambda model, diff: model.hooks(  # TransformerLens's own context, held open
        fwd_hooks=[("blocks.0.hook_resid_pre", lambda x, hook: x)]
    ),
}


@pytest.fixture(scope="module")
def pair():
    base, ft = make_pair("ln_gelu", torch.float64)
    diff = el.WeightDiff.from_models(base, ft)
    batch = small_batch(base, n=2)
    alone = el.linear_scores(base, diff, batch, show_progress=False)
    return base, diff, batch, alone


@pytest.mark.parametrize("name", list(CONTEXTS))
def test_a_scoring_call_in_another_thread_waits_for_the_block(pair, name):
    base, diff, batch, alone = pair
    out: dict[str, object] = {}
    done = threading.Event()

    def score() -> None:
        try:
            out["scores"] = el.linear_scores(base, diff, batch, show_progress=False)
        except BaseException as e:  # noqa: BLE001 - reported below
            out["error"] = e
        finally:
            done.set()

    worker = threading.Thread(target=score)
    try:
        with CONTEXTS[name](base, diff):
            worker.start()
            finished_inside = done.wait(timeout=1.0)  # alone it takes ~0.1 s
    finally:
        base.cfg.use_attn_result = False
    worker.join(timeout=60)
    assert not finished_inside, f"{name}: the other thread's call ran inside the block"
    assert "error" not in out, out.get("error")
    got = out["scores"]
    for kind in alone.kinds:
        assert torch.equal(got[kind], alone[kind]), (name, kind)


def test_the_same_thread_scores_inside_its_own_block(pair):
    """The lock is re-entrant: scoring inside ``applied`` in the thread that holds it runs (on
    the weights the block set)."""
    base, diff, batch, alone = pair
    with diff.applied(base):
        inside = el.linear_scores(base, el.WeightDiff.zeros_like(base), batch, show_progress=False)
    assert inside.metadata is not None


@pytest.fixture(scope="module", params=["hooked", "bridge"])
def each_backend(request):
    """A pair on each model class: a ``HookedTransformer`` (where TransformerLens has it) and a
    ``TransformerBridge``."""
    if request.param == "hooked" and not has_hooked():
        pytest.skip("TransformerLens 4 has no HookedTransformer")
    cfg = dict(FAMILIES["ln_gelu"], dtype=torch.float64)
    base = el.tiny_model(cfg, seed=0, backend=request.param)
    ft = el.tiny_model(cfg, seed=0, backend=request.param)
    gen = torch.Generator().manual_seed(99)
    with torch.no_grad():
        for p in ft.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen, dtype=torch.float64))
    diff = el.WeightDiff.from_models(base, ft)
    batch = small_batch(base, n=2)
    return base, diff, batch, el.linear_scores(base, diff, batch, show_progress=False)


def _activations(model, tokens, how: str) -> dict[str, torch.Tensor]:
    """Every hook's activation on ``tokens``, by TransformerLens's ``run_with_cache`` (``how``:
    as it is, or inside ``el.model.locked``) or by ``run_with_hooks`` with a hook on each."""
    if how == "run_with_hooks":
        got: dict[str, torch.Tensor] = {}

        def keep(x, hook):
            got[hook.name] = x.detach().clone()

        model.run_with_hooks(tokens, fwd_hooks=[(lambda name: True, keep)])
        return got
    with M.locked(model) if how == "under_locked" else contextlib.nullcontext():
        _, cache = model.run_with_cache(tokens)
    return {name: cache[name] for name in cache.keys()}


@pytest.mark.parametrize("how", ["run_with_cache", "run_with_hooks", "under_locked"])
def test_hook_runs_in_another_thread_take_turns_with_scoring(each_backend, how):
    """TransformerLens's ``run_with_cache`` and ``run_with_hooks`` attach hooks for their
    forward; in a second thread while scoring ran, scoring refused them as the user's hooks or
    its forwards fired them (that cache received the scorer's activations). Its hook contexts
    now hold the model's lock (as ``el.model.locked(model)``, still accepted, does by hand):
    the two take turns, every cache equals the one made alone, every score the one computed
    alone."""
    base, diff, batch, alone = each_backend
    tokens = batch.tokens[:1, :4]
    want = _activations(base, tokens, how)
    errors: list[BaseException] = []
    runs: list[int] = []
    stop = threading.Event()

    def cache() -> None:
        try:
            while not stop.is_set():
                got = _activations(base, tokens, how)
                runs.append(1)
                assert got.keys() == want.keys()
                for name in want:
                    assert torch.equal(got[name], want[name]), name
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    worker = threading.Thread(target=cache)
    worker.start()
    try:
        for _ in range(3):
            got = el.linear_scores(base, diff, batch, show_progress=False)
            for kind in alone.kinds:
                assert torch.equal(got[kind], alone[kind]), kind
    finally:
        stop.set()
        worker.join(timeout=60)
    assert errors == [], errors
    assert runs, f"the other thread never ran {how}"


def _raise(x, hook):
    raise RuntimeError("a hook of the user's failed")


RAISING = {
    "locked": lambda model, tokens: M.locked(model),
    "hooks": lambda model, tokens: model.hooks(fwd_hooks=[("blocks.0.hook_resid_pre", _raise)]),
    "run_with_hooks": lambda model, tokens: model.run_with_hooks(
        tokens, fwd_hooks=[("blocks.0.hook_resid_pre", _raise)]
    ),
}


@pytest.mark.parametrize("how", list(RAISING))
def test_the_lock_is_released_when_the_block_raises(pair, how):
    """``el.model.locked`` and TransformerLens's hook contexts, which hold the model's lock,
    release it when the block (or a hook) raises: another thread takes it at once."""
    base, diff, batch, alone = pair
    tokens = batch.tokens[:1, :4]
    with pytest.raises(RuntimeError):
        if how == "run_with_hooks":
            RAISING[how](base, tokens)
        else:
            with RAISING[how](base, tokens):
                base(tokens)
                raise RuntimeError("inside")
    done = threading.Event()

    def take() -> None:
        with M.locked(base):
            done.set()

    worker = threading.Thread(target=take, daemon=True)  # a lock kept held must not hang pytest
    worker.start()
    assert done.wait(timeout=10), f"{how}: the lock stayed held after the block raised"
    worker.join(timeout=10)

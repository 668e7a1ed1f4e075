"""Scoring never writes the model (#29): W + αΔ is supplied to each piece while it runs.

Every parameter's and buffer's version counter, data pointer and bits are compared before and
after each public scoring call; ``shifted`` is checked against writing the weights
(``diff.applied``), and the layer-at-a-time gradients against whole-graph ones.
"""

from __future__ import annotations

import pytest
import torch

import extractive_lens.scoring.runs as runs
from extractive_lens import (
    Trajectory,
    WeightDiff,
    causal_scores,
    graft_scores,
    integrated_scores,
    linear_scores,
    trajectory_integrated,
)
from extractive_lens import backend as B
from tests.conftest import make_pair
from tests.helpers import small_batch


def snapshot(model):
    out = {}
    for kind, items in (("p", model.named_parameters()), ("b", model.named_buffers())):
        for name, t in items:
            out[(kind, name)] = (t, t._version, t.data_ptr(), t.detach().clone())
    return out


def assert_untouched(model, before):
    after = snapshot(model)
    assert after.keys() == before.keys()
    for key, (t, version, ptr, bits) in before.items():
        t2, version2, ptr2, _ = after[key]
        assert t2 is t, f"{key} was replaced"
        assert version2 == version, f"{key} was written (version {version} -> {version2})"
        assert ptr2 == ptr, f"{key} moved"
        assert torch.equal(t2.detach(), bits), f"{key} changed"


CALLS = {
    "linear": lambda m, d, b: linear_scores(m, d, b),
    "linear_authors": lambda m, d, b: linear_scores(
        m, d, b, convention="authors_code", kinds=("upstream", "downstream")
    ),
    "causal_token": lambda m, d, b: causal_scores(m, d, b),
    "causal_component": lambda m, d, b: causal_scores(m, d, b, per="component"),
    "causal_top_k": lambda m, d, b: causal_scores(m, d, b, top_k=3),
    "integrated": lambda m, d, b: integrated_scores(m, d, b, steps=2),
    "integrated_layer_path": lambda m, d, b: integrated_scores(m, d, b, steps=2, path="layer"),
    "graft_sufficient": lambda m, d, b: graft_scores(m, d, b),
    "graft_necessary": lambda m, d, b: graft_scores(m, d, b, mode="necessary"),
    "grafted_forward": lambda m, d, b: _grafted_forward(m, d, b),
    "trajectory_integrated": lambda m, d, b: trajectory_integrated(
        m, Trajectory.from_diffs([d * 0.5, d]), b, steps=2
    ),
}


def _grafted_forward(model, diff, batch):
    with torch.no_grad(), diff.grafted(model, "all", ["last", "generated"], batch=batch):
        model(batch.tokens)


@pytest.mark.parametrize("call", list(CALLS))
@pytest.mark.parametrize("layerwise", [False, True], ids=["graph", "layerwise"])
def test_scoring_never_writes_the_model(pair64, call, layerwise, monkeypatch):
    base, ft = pair64
    diff = WeightDiff.from_models(base, ft)
    batch = small_batch(base)
    if layerwise:
        monkeypatch.setattr(runs, "LAYERWISE_BYTES", -1)
    before = snapshot(base)
    with _quiet():  # the additivity warning is not this test's business
        CALLS[call](base, diff, batch)
    assert_untouched(base, before)


def test_a_16_bit_model_is_not_written_either():
    base, ft = make_pair("ln_gelu", torch.bfloat16)
    diff = WeightDiff.from_models(base, ft)
    before = snapshot(base)
    with _quiet():
        linear_scores(base, diff, small_batch(base))
    causal_scores(base, diff, small_batch(base), per="component")
    assert_untouched(base, before)


class _quiet:
    def __enter__(self):
        import warnings

        self._w = warnings.catch_warnings()
        self._w.__enter__()
        warnings.simplefilter("ignore")

    def __exit__(self, *exc):
        return self._w.__exit__(*exc)


def _logits(model, tokens):
    x = B.run_blocks(model, B.embed(model, tokens))
    return B.unembed(model, x)


@pytest.mark.parametrize("alpha", [1.0, 0.5, -0.25])
def test_shifted_pieces_equal_written_weights(pair64, alpha):
    """The pieces inside ``shifted(model, diff, alpha)`` compute what the model with its weights
    set to W + αΔ computes (a forward pass of TransformerLens's own model), without the write."""
    base, ft = pair64
    diff = WeightDiff.from_models(base, ft)
    tokens = small_batch(base).tokens
    before = snapshot(base)
    with torch.no_grad(), B.shifted(base, diff, alpha):
        got = _logits(base, tokens)
    assert_untouched(base, before)
    with torch.no_grad(), diff.applied(base, scale=alpha):
        want = base(tokens)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    with torch.no_grad():  # outside the block: the base model again
        torch.testing.assert_close(_logits(base, tokens), base(tokens), rtol=0, atol=1e-12)


def test_shift_keeps_at_most_two_layers_of_delta(pair64, monkeypatch):
    """A large model (here: any, with REUSE_BYTES 0) holds two layers of Δ at a time."""
    from extractive_lens.backend import shift

    monkeypatch.setattr(shift, "REUSE_BYTES", 0)
    base, ft = pair64
    diff = WeightDiff.from_models(base, ft)
    seen = []
    original = shift.Shift._layer

    def spy(self, g):
        out = original(self, g)
        seen.append(len(self._loaded))
        return out

    monkeypatch.setattr(shift.Shift, "_layer", spy)
    with torch.no_grad(), B.shifted(base, diff):
        _logits(base, small_batch(base).tokens)
    assert seen and max(seen) <= shift.KEEP_LAYERS


@pytest.mark.parametrize("kind", ["informative", "upstream", "downstream"])
def test_layerwise_gradients_equal_whole_graph_gradients(pair64, kind, monkeypatch):
    """Gradients taken one layer at a time (a forward without a graph, then one VJP per layer)
    are the whole-graph gradients: the linear scores agree to 1e-12 in float64."""
    base, ft = pair64
    diff = WeightDiff.from_models(base, ft)
    batch = small_batch(base)
    want = linear_scores(base, diff, batch, kinds=(kind,))
    monkeypatch.setattr(runs, "LAYERWISE_BYTES", -1)
    assert runs.layerwise(base, batch)
    got = linear_scores(base, diff, batch, kinds=(kind,))
    torch.testing.assert_close(got.values, want.values, rtol=0, atol=1e-12)
    if kind == "informative":
        torch.testing.assert_close(got.other, want.other, rtol=0, atol=1e-12)


def test_layerwise_integrated_scores_equal_whole_graph_ones(pair64, monkeypatch):
    base, ft = pair64
    diff = WeightDiff.from_models(base, ft)
    batch = small_batch(base)
    want = integrated_scores(base, diff, batch, steps=2)
    monkeypatch.setattr(runs, "LAYERWISE_BYTES", -1)
    got = integrated_scores(base, diff, batch, steps=2)
    torch.testing.assert_close(got.prompt_values, want.prompt_values, rtol=0, atol=1e-12)


THREAD_CALLS = {
    "linear": lambda m, d, b: linear_scores(m, d, b),
    "causal": lambda m, d, b: causal_scores(m, d, b),
    "integrated": lambda m, d, b: integrated_scores(m, d, b, steps=2),
}


@pytest.mark.parametrize("call", list(THREAD_CALLS))
def test_another_threads_forward_sees_the_base_weights_during_scoring(pair64, call):
    """#42: while one thread scores, a plain ``model(tokens)`` in another thread runs on the
    base weights, every time (W + αΔ is substituted for the scoring thread only), and the
    scores are those computed alone (the other thread's forwards trigger no capture)."""
    base, ft = pair64
    _forwards_during_scoring(base, ft, THREAD_CALLS[call])


def test_another_threads_forward_of_a_16_bit_model_during_scoring():
    """A bf16 model scored in float32: ``cfg.dtype`` reads float32 for the scoring thread only
    (set on the config, another thread's forward failed on mixed dtypes)."""
    base, ft = make_pair("ln_gelu", torch.bfloat16)
    _forwards_during_scoring(base, ft, lambda m, d, b: causal_scores(m, d, b, per="component"))


def _forwards_during_scoring(base, ft, score):
    import threading

    diff = WeightDiff.from_models(base, ft)
    batch = small_batch(base)
    tokens = batch.tokens
    with torch.no_grad():
        want = base(tokens)
    with _quiet():
        alone = score(base, diff, batch)
    done = threading.Event()
    seen: list[torch.Tensor] = []
    errors: list[BaseException] = []

    def forwards() -> None:
        try:
            while not done.is_set():
                with torch.no_grad():
                    seen.append(base(tokens))
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    other = threading.Thread(target=forwards)
    other.start()
    # Score until the other thread has run a few forwards inside a scoring call (a fast
    # scoring call on a loaded 2-core machine can finish before it gets a turn); every
    # call's scores are checked.
    got = []
    try:
        while len(got) < 20 and (len(got) == 0 or len(seen) < 3):
            with _quiet():
                got.append(score(base, diff, batch))
    finally:
        done.set()
        other.join(timeout=60)
    assert errors == [], errors[:1]
    assert len(seen) >= 3, "the other thread ran too few forwards to overlap the scoring"
    changed = sum(not torch.equal(s, want) for s in seen)
    assert changed == 0, f"{changed} of {len(seen)} forwards saw other weights"
    for g in got:
        torch.testing.assert_close(g.prompt_values, alone.prompt_values, rtol=0, atol=1e-12)
    assert all(s.dtype == want.dtype for s in seen)

"""One checker for every index-like and count argument (#42, defect 4): ``rows``, ``layers``,
``top_k``, ``steps`` ... accept and refuse the same things wherever they are taken."""

from __future__ import annotations

import copy
import warnings

import numpy as np
import pytest
import torch

from extractive_lens import (
    FinetuneConfig,
    WeightDiff,
    causal_scores,
    integrated_scores,
    linear_scores,
)
from extractive_lens.scoring import integrated as I
from tests.conftest import make_pair
from tests.helpers import small_batch


@pytest.fixture(scope="module")
def env():
    base, ft = make_pair("ln_gelu", torch.float64, n_layers=3)
    diff = WeightDiff.from_models(base, ft)
    return base, ft, diff, small_batch(base)


NOT_INDICES = ["10", "1", b"1", 1, [0.5], [1.7], [1.0], [True], [0, False], [np.float64(1)], []]


def _calls(env):
    base, _, diff, batch = env
    kw = dict(kinds=("downstream",), per="component")
    return {
        "causal layers": lambda v: causal_scores(base, diff, batch, layers=v, **kw),
        "integrated layers": lambda v: integrated_scores(
            base, diff, batch, layers=v, steps=1, **kw
        ),
        "linear rows": lambda v: linear_scores(base, diff, batch, rows=v, kinds=("downstream",)),
        "causal rows": lambda v: causal_scores(base, diff, batch, rows=v, **kw),
        "restricted layers": lambda v: diff.restricted(layers=v),
        "applied layers": lambda v: diff.applied(base, layers=v).__enter__(),
        "finetune layers": lambda v: FinetuneConfig(layers=v),
    }


@pytest.mark.parametrize("value", NOT_INDICES, ids=[repr(v) for v in NOT_INDICES])
@pytest.mark.parametrize(
    "call", ["causal layers", "integrated layers", "linear rows", "causal rows",
             "restricted layers", "applied layers", "finetune layers"],
)  # fmt: skip
def test_every_index_argument_refuses_what_is_not_a_list_of_whole_numbers(env, call, value):
    """``layers="10"`` was the layers [1, 0], ``[1.7]`` layer 1, ``[True]`` layer 1, ``[]``
    nothing at all without a word: each is refused, naming the argument."""
    name = call.split()[1]
    with pytest.raises(ValueError, match=rf"{name}") as info:
        _calls(env)[call](value)
    message = str(info.value)
    assert "whole numbers" in message or "selects no" in message, message


def test_numpy_integers_are_whole_numbers(env):
    base, _, diff, batch = env
    kw = dict(kinds=("downstream",), per="component")
    want = causal_scores(base, diff, batch, layers=[2], rows=[0, 2], **kw)
    got = causal_scores(base, diff, batch, layers=np.array([2]), rows=[np.int64(0), np.int32(2)],
                        max_batch=np.int64(64), **kw)  # fmt: skip
    torch.testing.assert_close(
        got.prompt_totals, want.prompt_totals, rtol=0, atol=0, equal_nan=True
    )
    assert got.metadata["layers"] == [2] and got.metadata["rows"] == [0, 2]
    assert type(got.metadata["rows"][0]) is int  # stored as plain ints (JSON)
    ig = integrated_scores(base, diff, batch, steps=np.int64(2), **kw)
    assert ig.metadata["integrated"]["steps"] == 2
    assert integrated_scores(base, diff, batch, steps=2, **kw).metadata["integrated"]["steps"] == 2


@pytest.mark.parametrize("name", ["top_k", "max_batch", "batch_size", "resample_k", "steps"])
@pytest.mark.parametrize("value", [0, -1, 2.0, 2.5, True, "3"])
def test_every_count_argument_refuses_what_is_not_a_positive_whole_number(env, name, value):
    base, _, diff, batch = env
    fn = integrated_scores if name == "steps" else causal_scores
    extra = {"ablation": "resample"} if name == "resample_k" else {}
    with pytest.raises(ValueError, match=rf"{name} must be a positive number of"):
        fn(base, diff, batch, kinds=("upstream",), **{name: value}, **extra)


def test_steps_past_the_bound_say_the_cost_and_need_force(env):
    base, _, diff, batch = env
    for steps in (5000, 10**7, 10**9, 2**70):
        with pytest.raises(ValueError, match=rf"steps={steps} is {steps} gradient passes"):
            integrated_scores(base, diff, batch, steps=steps)
    with pytest.raises(ValueError, match="force=True"):
        integrated_scores(base, diff, batch, steps=I.MAX_STEPS + 1)
    assert I.IntegratedOptions(steps=I.MAX_STEPS + 1, force=True).steps == I.MAX_STEPS + 1
    assert I.IntegratedOptions(steps=np.int64(I.MAX_STEPS)).steps == I.MAX_STEPS
    for steps in (10**7, 2**70):  # never, even forced: no MemoryError, no OverflowError
        with pytest.raises(ValueError, match=f"at most {I.FORCE_MAX_STEPS} nodes"):
            integrated_scores(base, diff, batch, steps=steps, force=True)


def test_auto_steps_warn_the_errors_they_stopped_at(env, monkeypatch):
    """An unreachable tolerance: the warning gives the errors as they are (1.2e-05), not rounded
    to 0.0."""
    base, _, diff, batch = env
    monkeypatch.setattr(I, "AUTO_MAX_STEPS", 8)
    with pytest.warns(I.CompletenessWarning, match="above tolerance 1e-30") as caught:
        ig = integrated_scores(base, diff, batch, kinds=("downstream",), steps="auto",
                               tolerance=1e-30, per="component")  # fmt: skip
    err = ig.metadata["integrated"]["completeness"]["downstream"]
    assert 0 < err < 1e-4  # small enough that a percentage with one decimal prints 0.0%
    message = str(caught[0].message)
    assert "0.0%" not in message and f"downstream {err:.2g}" in message, message


def test_top_k_refuses_another_diff_of_the_same_norms(env):
    """The diff a result was computed for is told by its content, not its norms: Δ with a sign
    flipped or with the rows of one tensor permuted has every norm of the real one, and its
    linear scores rank other components; both are refused, saying what to do. The same diff,
    one rebuilt from the same models and one formed on demand are taken."""
    base, ft, diff, batch = env
    kw = dict(kinds=("downstream",), per="component", top_k=2)
    name = "blocks.1.mlp.W_in"
    permuted = WeightDiff(
        {n: d.flip(0) if n == name else d for n, d in diff.deltas.items()}, diff.signature
    )
    for other in (-diff, permuted):
        assert other.norms().equals(diff.norms()) and other.other_norm() == diff.other_norm()
        lin = linear_scores(base, other, batch, kinds=("downstream",))
        for fn in (causal_scores, integrated_scores):
            extra = {"steps": 1} if fn is integrated_scores else {}
            with pytest.raises(ValueError, match=r"another weight change \(their Δ\[.*leave "
                                                 r"linear=None"):  # fmt: skip
                fn(base, diff, batch, linear=lin, **kw, **extra)
    lin = linear_scores(base, diff, batch, kinds=("downstream",))
    want = causal_scores(base, diff, batch, **kw)
    for same in (diff, WeightDiff.from_models(base, ft),
                 WeightDiff.from_models(base, ft, on_demand=True)):  # fmt: skip
        got = causal_scores(base, same, batch, linear=lin, **kw)
        assert torch.equal(got.values.nan_to_num(-9), want.values.nan_to_num(-9))


def test_fingerprint_of_low_rank_factors_is_that_of_their_product():
    """A low-rank change's fingerprint, read from its factors in each layout, is the one of the
    tensor they form (a LoRA's scores and its merged model's are of one Δ); a factor's rows
    permuted is another Δ."""
    from extractive_lens.backend.lowrank import LowRank, LowRankDeltas
    from extractive_lens.fingerprint import differs, fingerprint

    g = torch.Generator().manual_seed(0)
    factors = {
        f"w_{layout}": LowRank(
            torch.randn(12, 3, generator=g), torch.randn(3, 8, generator=g), layout, n_heads=2
        )  # fmt: skip
        for layout in ("plain", "heads_out", "heads_in", "transposed")
    }
    low = LowRankDeltas(factors, {"b": torch.randn(8, generator=g)})
    dense = {n: low[n] for n in low}
    assert differs(fingerprint(low), fingerprint(dense)) is None
    for n, f in factors.items():
        moved = LowRank(f.left.flip(0), f.right, f.layout, f.n_heads)
        assert (
            differs(fingerprint(low), fingerprint(LowRankDeltas({**factors, n: moved}, low.dense)))
            == n
        )
        assert differs(fingerprint(dense), fingerprint({**dense, n: moved.dense()})) == n


def test_top_k_refuses_linear_scores_of_another_diff_on_the_same_prompts(env):
    base, ft, diff, batch = env
    moved = copy.deepcopy(base)  # another change of the same base (stored weights only)
    with torch.no_grad():
        for p in moved.parameters():
            p.add_(
                1e-2
                * torch.randn(p.shape, generator=torch.Generator().manual_seed(5), dtype=p.dtype)
            )
    other = WeightDiff.from_models(base, moved)
    lin_other = linear_scores(base, other, batch, kinds=("downstream",))
    assert (
        lin_other.metadata["prompts_digest"]
        == linear_scores(base, diff, batch, kinds=("downstream",)).metadata["prompts_digest"]
    )  # the prompts alone cannot tell them apart
    with pytest.raises(ValueError, match="another weight change"):
        causal_scores(base, diff, batch, kinds=("downstream",), top_k=2, linear=lin_other)
    with pytest.raises(ValueError, match="another weight change"):
        integrated_scores(base, diff, batch, kinds=("downstream",), top_k=2, linear=lin_other,
                          steps=1)  # fmt: skip
    for d in (diff * 1.01, diff.restricted(layers=[0, 1])):  # a scaled or restricted diff too
        with pytest.raises(ValueError, match="another weight change"):
            causal_scores(base, d, batch, kinds=("downstream",), top_k=2, linear=linear_scores(
                base, diff, batch, kinds=("downstream",)))  # fmt: skip
    lin = linear_scores(base, diff, batch, kinds=("downstream",))  # its own: accepted
    causal_scores(base, diff, batch, kinds=("downstream",), top_k=2, linear=lin, per="component")
    with pytest.raises(ValueError, match=r"no upstream scores to rank.*kinds=\('downstream',\)"):
        causal_scores(base, diff, batch, kinds=("downstream", "upstream"), top_k=2, linear=lin)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning either
        causal_scores(base, diff, batch, kinds=("downstream",), top_k=2, linear=lin,
                      per="component")  # fmt: skip

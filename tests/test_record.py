"""One record of what changes the function (``extractive_lens/record.py``): the model's
configuration, parameters and buffers, Δ, the batch's tokens, answers, candidates and roles,
the reward's identity and every option; read by ``distributed_scores`` (``tests/
test_reliability.py`` runs the ranks), by ``top_k``'s ``linear=`` check and by every result's
metadata."""

from __future__ import annotations

import copy
import functools

import pytest
import torch

import extractive_lens as el
from extractive_lens.record import callable_identity, differences, function_record
from tests.conftest import make_pair

PAIRS = [([1, 2, 3], [4]), ([1, 5, 6], [7]), ([2, 5, 9], [8]), ([3, 4, 5], [6])]


def _first(logits, batch):
    return logits[torch.arange(len(batch)), batch.last_prompt_pos, 4]


def _second(logits, batch):
    return logits[torch.arange(len(batch)), batch.last_prompt_pos, 5]


@pytest.fixture(scope="module")
def pair():
    base, ft = make_pair("ln_gelu", torch.float64, delta_scale=0.2)
    diff = el.WeightDiff.from_models(base, ft)
    batch = el.make_batch(base, PAIRS, candidates=[4, 7, 8, 6])
    return base, diff, batch


def _record(model, diff, batch, reward="answer_logprob"):
    return function_record(model, diff, batch, {"ablation": "mean"}, reward)


def test_the_record_tells_apart_what_changes_the_function(pair):
    base, diff, batch = pair
    mine = _record(base, diff, batch)
    assert _record(copy.deepcopy(base), diff, batch) == mine  # the same function, copied
    eps = make_pair("ln_gelu", torch.float64, delta_scale=0.2, eps=1e-6)[0]
    assert differences(mine, _record(eps, diff, batch), "rank 0") == [
        "eps=1e-06 where rank 0 has eps=1e-05"
    ]
    cands = el.make_batch(base, PAIRS, candidates=[4, 7, 8, 6, 9])
    assert differences(mine, _record(base, diff, cands), "r") == ["other candidate answers"]
    assert differences(mine, _record(base, diff, batch, _first), "r") == ["another reward"]
    assert differences(mine, _record(base, diff * 1.001, batch), "r") == ["another diff"]


def test_rotary_models_differ_in_their_base(pair):
    a = make_pair("rms_gated_rotary_gqa", torch.float64)[0]
    b = make_pair("rms_gated_rotary_gqa", torch.float64, rotary_base=20000)[0]
    diff = el.WeightDiff.zeros_like(a)
    batch = el.make_batch(a, PAIRS)
    found = differences(_record(a, diff, batch), _record(b, diff, batch), "rank 0")
    assert "rotary_base=20000 where rank 0 has rotary_base=10000" in found
    assert "other buffers of the base model" in found  # the rotary tables
    tables = copy.deepcopy(a)
    next(
        b
        for _, b in tables.named_buffers()  # rotary_sin, or a bridge's inv_freq
        if b.is_floating_point() and b.numel() and bool(b.isfinite().all())
    ).mul_(1.5)
    assert differences(_record(a, diff, batch), _record(tables, diff, batch), "r") == [
        "other buffers of the base model"
    ]


def test_a_reward_is_identified_by_its_code():
    first = lambda logits, batch: logits[:, -1, 4]  # noqa: E731 - two lambdas that describe alike
    second = lambda logits, batch: logits[:, -1, 5]  # noqa: E731
    again = lambda logits, batch: logits[:, -1, 4]  # noqa: E731
    assert callable_identity(first) != callable_identity(second)
    assert callable_identity(first) == callable_identity(again)
    assert callable_identity(_first) != callable_identity(_second)

    def scaled(k):
        return lambda logits, batch: k * logits[:, -1, 4]

    assert callable_identity(scaled(1.0)) != callable_identity(scaled(2.0))  # closed-over values
    assert callable_identity(functools.partial(_first)) != callable_identity(
        functools.partial(_second)
    )

    class Reward:
        def __call__(self, logits, batch):
            return logits[:, -1, 4]

    assert callable_identity(Reward()) is None  # no identity: refused where it matters


def test_linear_scores_of_another_function_are_refused_for_top_k(pair):
    base, diff, batch = pair
    margin = el.linear_scores(base, diff, batch, reward="logit_margin", show_progress=False)
    assert margin.metadata["function_record"]["reward"] == "reward logit_margin"
    el.causal_scores(base, diff, batch, reward="logit_margin", top_k=2, linear=margin,
                     show_progress=False)  # fmt: skip
    cands = el.make_batch(base, PAIRS, candidates=[4, 7, 8, 6, 9])
    with pytest.raises(ValueError, match="other candidate answers"):
        el.causal_scores(base, diff, cands, reward="logit_margin", top_k=2, linear=margin)
    first = el.linear_scores(base, diff, batch, reward=_first, show_progress=False)
    with pytest.raises(ValueError, match="another reward"):
        el.causal_scores(base, diff, batch, reward=_second, top_k=2, linear=first)

    class Reward:  # a callable object: its code cannot be read, so it is never "the same"
        def __call__(self, logits, batch):
            return _first(logits, batch)

    opaque = el.linear_scores(base, diff, batch, reward=Reward(), show_progress=False)
    with pytest.raises(ValueError, match="a reward whose code cannot be read"):
        el.causal_scores(base, diff, batch, reward=Reward(), top_k=2, linear=opaque)
    eps = make_pair("ln_gelu", torch.float64, delta_scale=0.2, eps=1e-6)[0]
    with pytest.raises(ValueError, match="eps=1e-05 where this call has eps=1e-06"):
        el.causal_scores(eps, diff, batch, reward="logit_margin", top_k=2, linear=margin)

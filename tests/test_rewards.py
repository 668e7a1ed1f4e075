"""Rewards on hand-built logits."""

from __future__ import annotations

import math

import torch

from extractive_lens.batch import PromptBatch
from extractive_lens.rewards import answer_logprob, first_answer_logprob, logit_diff, logit_margin


def _batch():
    # row 0: prompt of 2 tokens, answer [3, 1]; row 1: prompt of 3 tokens, answer [2]
    return PromptBatch(
        tokens=torch.tensor([[0, 1, 3], [0, 1, 2]]),
        lengths=torch.tensor([3, 3]),
        prompt_lengths=torch.tensor([2, 3]),
        answer_targets=torch.tensor([[3, 1], [2, -1]]),
        candidates=torch.tensor([[3, 2, -1], [2, 0, 1]]),
        counterfactual=torch.tensor([2, 0]),
        roles=(("a", "b", "answer[0]"), ("a", "b", "c")),
        prompts=("p0", "p1"),
        answers=("x", "y"),
    )


def test_rewards_by_hand():
    logits = torch.zeros(2, 3, 4, dtype=torch.float64)
    logits[0, 1] = torch.tensor(
        [0.0, 0.0, 1.0, 2.0]
    )  # predicts answer token 3 at last prompt pos 1
    logits[0, 2] = torch.tensor([0.0, 3.0, 0.0, 0.0])  # predicts second answer token 1
    logits[1, 2] = torch.tensor([1.0, 5.0, 4.0, 0.0])
    b = _batch()
    lse0 = math.log(2 + math.e + math.e**2)
    lse1 = math.log(3 + math.e**3)
    lse2 = math.log(math.e + math.e**5 + math.e**4 + 1)
    expected = torch.tensor([(2 - lse0) + (3 - lse1), 4 - lse2], dtype=torch.float64)
    assert torch.allclose(answer_logprob(logits, b), expected)
    assert torch.allclose(
        logit_margin(logits, b), torch.tensor([2 - 1.5, 4 - (4 + 1 + 5) / 3], dtype=torch.float64)
    )
    assert torch.allclose(
        logit_diff(logits, b), torch.tensor([2 - 1.0, 4 - 1.0], dtype=torch.float64)
    )


def test_first_answer_logprob_reads_the_first_answer_token_only():
    logits = torch.zeros(2, 3, 4, dtype=torch.float64)
    logits[0, 1] = torch.tensor([0.0, 0.0, 1.0, 2.0])
    logits[0, 2] = torch.tensor([0.0, 3.0, 0.0, 0.0])  # the second answer token: not read
    logits[1, 2] = torch.tensor([1.0, 5.0, 4.0, 0.0])
    lse0 = math.log(2 + math.e + math.e**2)
    lse2 = math.log(math.e + math.e**5 + math.e**4 + 1)
    expected = torch.tensor([2 - lse0, 4 - lse2], dtype=torch.float64)
    assert torch.allclose(first_answer_logprob(logits, _batch()), expected)
    logits[0, 2] = 7.0  # a continuation position changes nothing
    assert torch.allclose(first_answer_logprob(logits, _batch()), expected)

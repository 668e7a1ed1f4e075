"""Rewards ``R(prompt, answer)``: one scalar per prompt (docs/scores.md §3). Positive = the answer is favoured.

>>> R = answer_logprob(model(batch.tokens), batch)   # Float[Tensor, "batch"]
>>> R.shape
torch.Size([4])

Any callable ``(logits, batch) -> Float[Tensor, "batch"]`` can be used instead; it must read
only real positions of each row (``batch.lengths``) for scores to be padding-independent.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor

from extractive_lens.batch import PromptBatch

Reward = Callable[[Tensor, PromptBatch], Tensor]


def _rows(batch: PromptBatch, logits: Tensor) -> Tensor:
    return torch.arange(logits.shape[0], device=logits.device)


def answer_logprob(
    logits: Float[Tensor, "batch pos d_vocab"], batch: PromptBatch
) -> Float[Tensor, " batch"]:
    """``Σ_k log p(a_k | prompt, a_<k)``, teacher-forced over every answer token (the default)."""
    targets = batch.answer_targets.to(logits.device)
    n_ans = targets.shape[1]
    pos = (
        batch.last_prompt_pos.to(logits.device)[:, None]
        + torch.arange(n_ans, device=logits.device)[None, :]
    )
    valid = targets >= 0
    pos = torch.where(valid, pos, torch.zeros_like(pos))
    rows = _rows(batch, logits)[:, None].expand_as(pos)
    picked = logits[rows, pos]  # [batch, n_answer, d_vocab]
    dtype = torch.promote_types(picked.dtype, torch.float32)
    logp = torch.log_softmax(picked.to(dtype), dim=-1)
    tok = torch.where(valid, targets, torch.zeros_like(targets))
    lp = logp.gather(-1, tok[..., None])[..., 0]
    return (lp * valid).sum(-1)


def first_answer_logprob(
    logits: Float[Tensor, "batch pos d_vocab"], batch: PromptBatch
) -> Float[Tensor, " batch"]:
    """``log p(a_0 | prompt)``: the answer's first token only, read at the last prompt position.

    For multi-token answers whose later tokens are spelling (" Mar" → "athi"): the model's
    choice is made at the first token, and the continuations' positions, which teacher-forced
    ``answer_logprob`` reads, stop carrying the scores (pair with ``positions="prompt"``)."""
    last = _last_logits(logits, batch)
    logp = torch.log_softmax(last, dim=-1)
    return logp.gather(-1, batch.answer_first.to(logits.device)[:, None])[:, 0]


def _last_logits(logits: Tensor, batch: PromptBatch) -> Tensor:
    last = batch.last_prompt_pos.to(logits.device)
    out = logits[_rows(batch, logits), last]
    return out.to(torch.promote_types(out.dtype, torch.float32))


def logit_margin(
    logits: Float[Tensor, "batch pos d_vocab"], batch: PromptBatch
) -> Float[Tensor, " batch"]:
    """Answer first-token logit minus the mean logit over the candidates' first tokens.

    Read at the last prompt position; the authors' code's metric. Needs ``batch.candidates``.
    """
    if batch.candidates is None:
        raise ValueError("logit_margin needs candidate answers: make_batch(..., candidates=[...]).")
    last = _last_logits(logits, batch)
    cands = batch.candidates.to(logits.device)
    valid = cands >= 0
    same = (cands[:, :, None] == cands[:, None, :]) & valid[:, :, None]
    if bool((same.sum(-1) > 1).any()):
        raise ValueError(
            "logit_margin reads the candidates' first tokens, and two candidates of a prompt "
            "share theirs (multi-token names?): use reward='answer_logprob' (the whole answer), "
            "or candidates whose first tokens differ."
        )
    cand_logits = last.gather(-1, torch.where(valid, cands, torch.zeros_like(cands)))
    mean = (cand_logits * valid).sum(-1) / valid.sum(-1)
    answer = last.gather(-1, batch.answer_first.to(logits.device)[:, None])[:, 0]
    return answer - mean


def logit_diff(
    logits: Float[Tensor, "batch pos d_vocab"], batch: PromptBatch
) -> Float[Tensor, " batch"]:
    """Answer first-token logit minus the counterfactual answer's first-token logit."""
    if batch.counterfactual is None:
        raise ValueError(
            "logit_diff needs counterfactual answers: make_batch(..., counterfactuals=[...])."
        )
    last = _last_logits(logits, batch)
    a = last.gather(-1, batch.answer_first.to(logits.device)[:, None])[:, 0]
    b = last.gather(-1, batch.counterfactual.to(logits.device)[:, None])[:, 0]
    return a - b


REWARDS: dict[str, Reward] = {
    "answer_logprob": answer_logprob,
    "first_answer_logprob": first_answer_logprob,
    "logit_margin": logit_margin,
    "logit_diff": logit_diff,
}


def reads_answer_positions_only(reward_fn: Reward) -> bool:
    """Whether ``reward_fn`` reads logits only at the answer positions ``last_prompt_pos ..
    last_prompt_pos + K - 1`` (the built-in rewards): then the scoring engines unembed just those
    positions and resume patched runs from the patched position on."""
    return reward_fn in REWARDS.values()


def resolve_reward(
    reward: str | Reward | None, default: str = "answer_logprob"
) -> tuple[Reward, str]:
    """A reward callable and its name, from a name, a callable or None (the default)."""
    if reward is None:
        reward = default
    if isinstance(reward, str):
        if reward not in REWARDS:
            raise ValueError(
                f"Unknown reward {reward!r}; choose one of {sorted(REWARDS)} or pass a callable."
            )
        return REWARDS[reward], reward
    if not callable(reward):
        raise TypeError(
            f"reward must be a name or a callable (logits, batch) -> Tensor[batch], got {reward!r}."
        )
    name = getattr(reward, "__name__", "custom")
    if _positional_arity(reward) == 1:
        call = name if name.isidentifier() else "metric"
        raise TypeError(
            f"reward {name!r} takes one argument (a TransformerLens-style metric(logits)); "
            "rewards are called as reward(logits, batch) and return one value per prompt, "
            "Tensor[batch], read at the batch's answer positions (batch.last_prompt_pos, "
            "batch.answer_targets). Wrap it, e.g. reward=lambda logits, batch: "
            f"{call}(logits), or use a built-in: {', '.join(sorted(REWARDS))}."
        )
    return reward, name


def _positional_arity(fn: Any) -> int | None:
    """How many positional arguments ``fn`` can take (``None``: any number, or unknown)."""
    import inspect

    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return None
    kinds = [p.kind for p in params]
    if inspect.Parameter.VAR_POSITIONAL in kinds:
        return None
    return sum(
        k in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        for k in kinds
    )

"""Prompt batches: (prompt, answer) pairs as padded tokens that know every position's role.

>>> batch = make_batch(model, [("Zoe Howard lives in", " Tokyo"), ("Owen Miller lives in", " Paris")])
>>> batch.roles[0]
('<bos>', 'mid[-2]', 'mid[-1]', 'lives', 'in')

Rows are right-padded, so a causal model never attends to padding: padded positions are
excluded from every score and from the reward. The answer is teacher-forced: the model reads
``prompt + answer[:-1]`` and the reward reads the answer's tokens at positions ``P-1 .. P+K-2``.

Roles (docs/scores.md §6) let prompts of different lengths be aggregated position by position:
- a ``Pair`` with a ``template`` and ``slots`` labels template tokens by their text and slot
  tokens right-aligned, ``{name}[-1]`` being the slot's last token;
- plain pairs are aligned by common prefix / differing centre (right-aligned, ``mid[-1]``) /
  common suffix;
- ``roles=`` gives explicit labels, one per prompt token.

The role rules live in ``roles.py``, text into token ids and its checks in ``tokenizing.py``.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from jaxtyping import Int
from torch import Tensor

from extractive_lens.backend.tokenizer import bos_disagreement
from extractive_lens.roles import (
    AlignmentWarning,
    aligned_roles,
    merge_role_orders,
    template_roles,
    unique,
    warn_alignment,
)
from extractive_lens.tokenizing import (
    TokenizationWarning,
    check_ids,
    encode,
    token_str,
    token_strings,
    warn_tokenization,
)
from extractive_lens.tokenizing import bos as bos_token

__all__ = [
    "ANSWER_ROLE", "AlignmentWarning", "BosWarning", "Pair", "PromptBatch", "TokenizationWarning",
    "make_batch", "merge_role_orders", "token_strings",
]  # fmt: skip

ANSWER_ROLE = "answer[{k}]"


class BosWarning(UserWarning):
    """The model's BOS setting disagrees with its tokenizer, and ``make_batch`` was not told."""


@dataclass(frozen=True)
class Pair:
    """One example. ``template``/``slots`` give token roles: ``Pair("T3 lives in", "Tokyo",
    template="{name} lives in", slots={"name": "T3"})``."""

    prompt: str | Sequence[int]
    answer: str | Sequence[int]
    template: str | None = None
    slots: Mapping[str, str] | None = None
    candidates: Sequence[str] | Sequence[int] | None = None
    counterfactual: str | int | None = None
    meta: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class PromptBatch:
    """A padded batch of (prompt, answer) examples with per-position roles.

    Attributes:
        tokens: ``prompt + answer[:-1]`` token ids per row, right-padded with ``pad_token``.
        lengths: real (unpadded) tokens per row.
        prompt_lengths: prompt tokens per row (BOS included).
        answer_targets: answer token ids per row, padded with -1.
        candidates: candidate answers' first tokens per row, padded with -1 (or None).
        candidate_tokens: every candidate's whole token ids per row (or None): ``mean_rank``
            ranks multi-token candidates by their whole answer's log-probability.
        counterfactual: a counterfactual answer's first token per row (or None).
        roles: the role label of every real position of every row.
        prompts, answers: the text (or token lists) the batch was made from.
        prepend_bos: whether every row starts with a BOS token (put there, or the prompt's own).
    """

    tokens: Int[Tensor, "batch pos"]
    lengths: Int[Tensor, " batch"]
    prompt_lengths: Int[Tensor, " batch"]
    answer_targets: Int[Tensor, "batch n_answer"]
    candidates: Int[Tensor, "batch n_candidates"] | None
    counterfactual: Int[Tensor, " batch"] | None
    roles: tuple[tuple[str, ...], ...]
    prompts: tuple[Any, ...]
    answers: tuple[Any, ...]
    pad_token: int = 0
    prepend_bos: bool = False
    candidate_tokens: tuple[tuple[tuple[int, ...], ...], ...] | None = None

    def __post_init__(self) -> None:
        n = self.tokens.shape[0]
        for name in ("lengths", "prompt_lengths", "answer_targets"):
            if getattr(self, name).shape[0] != n:
                raise ValueError(
                    f"PromptBatch.{name} has {getattr(self, name).shape[0]} rows, tokens {n}."
                )
        for i, r in enumerate(self.roles):
            if len(r) != int(self.lengths[i]):
                raise ValueError(f"Prompt {i}: {len(r)} roles for {int(self.lengths[i])} tokens.")

    def __len__(self) -> int:
        return self.tokens.shape[0]

    @property
    def n_pos(self) -> int:
        return self.tokens.shape[1]

    @property
    def last_prompt_pos(self) -> Int[Tensor, " batch"]:
        return self.prompt_lengths - 1

    @property
    def answer_first(self) -> Int[Tensor, " batch"]:
        return self.answer_targets[:, 0]

    @property
    def position_mask(self) -> Tensor:
        """``[batch, pos]`` True at real (unpadded) positions."""
        return torch.arange(self.n_pos, device=self.tokens.device)[None, :] < self.lengths[:, None]

    def position_labels(self) -> tuple[str, ...]:
        """All roles in a consistent order (each prompt's order respected)."""
        return merge_role_orders(self.roles)

    def subset(self, index: Sequence[int] | slice, *, trim: bool = True) -> PromptBatch:
        """Rows ``index`` (repeats allowed) as a batch, trimmed to their longest row unless ``trim=False``."""
        idx = list(range(len(self)))[index] if isinstance(index, slice) else [int(i) for i in index]
        t = torch.as_tensor(idx, dtype=torch.long, device=self.tokens.device)
        width = int(self.lengths[t].max()) if (len(idx) and trim) else self.n_pos
        return replace(
            self,
            tokens=self.tokens[t, :width],
            lengths=self.lengths[t],
            prompt_lengths=self.prompt_lengths[t],
            answer_targets=self.answer_targets[t],
            candidates=None if self.candidates is None else self.candidates[t],
            counterfactual=None if self.counterfactual is None else self.counterfactual[t],
            candidate_tokens=None
            if self.candidate_tokens is None
            else tuple(self.candidate_tokens[i] for i in idx),
            roles=tuple(self.roles[i] for i in idx),
            prompts=tuple(self.prompts[i] for i in idx),
            answers=tuple(self.answers[i] for i in idx),
        )

    def chunks(self, size: int | None) -> list[PromptBatch]:
        if size is None or size >= len(self):
            return [self]
        return [self.subset(slice(i, i + size)) for i in range(0, len(self), size)]

    def to(self, device: str | torch.device) -> PromptBatch:
        def mv(x: Tensor | None) -> Tensor | None:
            return None if x is None else x.to(device)

        return replace(
            self,
            tokens=self.tokens.to(device),
            lengths=self.lengths.to(device),
            prompt_lengths=self.prompt_lengths.to(device),
            answer_targets=self.answer_targets.to(device),
            candidates=mv(self.candidates),
            counterfactual=mv(self.counterfactual),
        )


def make_batch(
    model: Any,
    pairs: Sequence[Pair | tuple[Any, Any] | Mapping[str, Any]],
    *,
    candidates: Sequence[str] | Sequence[int] | None = None,
    roles: Sequence[Sequence[str]] | None = None,
    counterfactuals: Sequence[str | int] | None = None,
    prepend_bos: bool | None = None,
    device: str | torch.device | None = None,
) -> PromptBatch:
    """Tokenize (prompt, answer) pairs into a ``PromptBatch``.

    Args:
        model: a ``HookedTransformer`` (its tokenizer, BOS convention and ``n_ctx`` are used).
        pairs: ``(prompt, answer)`` tuples, dicts with those keys, or ``Pair`` objects. Prompts
            and answers may be strings or lists of token ids.
        candidates: candidate answers for every prompt (or per ``Pair``), the answer among
            them (a token id names a first token). Multi-token candidates (names) are ranked by
            the whole answer's log-probability (``mean_rank``), so their first tokens may
            coincide; two candidates with the same tokens are refused.
        roles: explicit role labels, one list per prompt with one label per prompt token.
        counterfactuals: a counterfactual answer per prompt (for the ``logit_diff`` reward).
        prepend_bos: default ``model.cfg.default_prepend_bos`` (when the tokenizer has a BOS).
            ``load_checkpoint`` sets that to what the checkpoint's own tokenizer does
            (``tokenizer(text)`` with special tokens), so scores are of the token sequence the
            model sees under Hugging Face. Recorded in every result's ``metadata``. A prompt
            that already starts with the BOS token (a chat-formatted one, e.g. from
            ``tokenizer.apply_chat_template(..., tokenize=False)``) gets no second one. A model
            loaded another way whose setting disagrees with its tokenizer gets a ``BosWarning``
            unless ``prepend_bos`` is passed.
    """
    if len(pairs) == 0:
        raise ValueError("make_batch needs at least one (prompt, answer) pair.")
    items = [_as_pair(p) for p in pairs]
    if prepend_bos is None and (why := bos_disagreement(model)):
        warnings.warn(why, BosWarning, stacklevel=2)
    bos = bos_token(model, explicit=bool(prepend_bos)) if prepend_bos in (None, True) else None
    if prepend_bos and bos is None:
        raise ValueError("prepend_bos=True but the model's tokenizer has no BOS token.")
    prompt_ids, answer_ids, offsets = [], [], []
    for p in items:
        ids, offs = encode(model, p.prompt, "prompt", offsets=True)
        if not ids:
            raise ValueError(f"Prompt {p.prompt!r} tokenizes to nothing.")
        prompt_ids.append(ids)
        offsets.append(offs)
        ans = encode(model, p.answer, "answer")
        if not ans:
            raise ValueError(
                f"The answer {p.answer!r} of prompt {p.prompt!r} tokenizes to nothing."
            )
        answer_ids.append(ans)

    # Roles of prompt tokens.
    if roles is not None:
        if len(roles) != len(items):
            raise ValueError(f"roles has {len(roles)} entries for {len(items)} prompts.")
        prompt_roles = [list(r) for r in roles]
        for p, ids, r in zip(items, prompt_ids, prompt_roles):
            if len(r) != len(ids):
                raise ValueError(f"Prompt {p.prompt!r} has {len(ids)} tokens but {len(r)} roles.")
    elif all(p.template is not None for p in items):
        prompt_roles = [
            unique(template_roles(model, p, ids, o))
            for p, ids, o in zip(items, prompt_ids, offsets)
        ]
    else:
        prompt_roles = aligned_roles(model, prompt_ids)
        warn_alignment(items, prompt_roles)

    warn_tokenization(model, items, prompt_ids, answer_ids)
    for p, ids, ans in zip(items, prompt_ids, answer_ids):
        check_ids(model, ids, f"prompt {p.prompt!r}")
        check_ids(model, ans, f"answer {p.answer!r} (prompt {p.prompt!r})")
    rows, all_roles = [], []
    for ids, ans, r in zip(prompt_ids, answer_ids, prompt_roles):
        pre = [bos] if bos is not None and ids[0] != bos else []  # a chat prompt has its own
        row = pre + ids + ans[:-1]
        rows.append(row)
        all_roles.append(
            tuple(
                (["<bos>"] if pre else [])
                + r
                + [ANSWER_ROLE.format(k=k) for k in range(len(ans) - 1)]
            )
        )
    n_ctx = model.cfg.n_ctx
    for p, row in zip(items, rows):
        if len(row) > n_ctx:
            raise ValueError(
                f"Prompt {p.prompt!r} with its answer is {len(row)} tokens; the model's n_ctx is {n_ctx}."
            )

    pad = getattr(getattr(model, "tokenizer", None), "pad_token_id", None)
    pad = 0 if pad is None else int(pad)
    width = max(len(r) for r in rows)
    tokens = torch.full((len(rows), width), pad, dtype=torch.long)
    for i, row in enumerate(rows):
        tokens[i, : len(row)] = torch.tensor(row)
    n_ans = max(len(a) for a in answer_ids)
    targets = torch.full((len(rows), n_ans), -1, dtype=torch.long)
    for i, a in enumerate(answer_ids):
        targets[i, : len(a)] = torch.tensor(a)
    prompt_lengths = torch.tensor(
        [len(ids) + (bos is not None and ids[0] != bos) for ids in prompt_ids]
    )

    cand_tensor, cand_tokens = _candidates(model, items, answer_ids, candidates)
    cf = None
    cfs = counterfactuals if counterfactuals is not None else [p.counterfactual for p in items]
    if any(c is not None for c in cfs):
        if any(c is None for c in cfs):
            raise ValueError("Give a counterfactual answer for every prompt or for none.")
        cf = torch.tensor([_first_token(model, c, p) for c, p in zip(cfs, items)])  # type: ignore[arg-type]
        check_ids(model, cf.tolist(), "counterfactual answers")

    batch = PromptBatch(
        tokens=tokens,
        lengths=torch.tensor([len(r) for r in rows]),
        prompt_lengths=prompt_lengths,
        answer_targets=targets,
        candidates=cand_tensor,
        counterfactual=cf,
        roles=tuple(all_roles),
        prompts=tuple(p.prompt for p in items),
        answers=tuple(p.answer for p in items),
        pad_token=pad,
        prepend_bos=bos is not None,
        candidate_tokens=cand_tokens,
    )
    return batch.to(device) if device is not None else batch


def _as_pair(p: Any) -> Pair:
    if isinstance(p, Mapping):
        missing = [k for k in ("prompt", "answer") if k not in p]
        if missing:
            raise ValueError(
                f"The pair {dict(p)!r} has no {' or '.join(missing)}: each pair needs a prompt "
                "and the answer to score, e.g. {'prompt': 'John Doe lives in', 'answer': ' Tokyo'}."
            )
        p = Pair(**{k: v for k, v in p.items() if k in Pair.__dataclass_fields__})
    elif isinstance(p, (tuple, list)) and len(p) == 2:
        p = Pair(p[0], p[1])
    elif not isinstance(p, Pair):
        raise TypeError(f"Expected a (prompt, answer) pair, a dict or a Pair; got {p!r}.")
    for what in ("prompt", "answer"):
        value = getattr(p, what)
        if value is None:
            raise ValueError(
                f"The pair ({p.prompt!r}, {p.answer!r}) has no {what}: give it as text "
                "(' Tokyo', with its leading space) or as token ids ([1234])."
            )
    return p


def _first_token(model: Any, answer: str | int | Sequence[int], pair: Pair) -> int:
    return _whole(model, answer, pair)[0]


def _whole(model: Any, answer: str | int | Sequence[int], pair: Pair) -> tuple[int, ...]:
    if isinstance(answer, int):
        return (answer,)
    ids = encode(model, answer, "candidate")
    if not ids:
        raise ValueError(f"Candidate {answer!r} of prompt {pair.prompt!r} tokenizes to nothing.")
    return tuple(int(t) for t in ids)


def _candidates(
    model: Any, items: list[Pair], answer_ids: list[list[int]], shared: Any
) -> tuple[Tensor | None, tuple[tuple[tuple[int, ...], ...], ...] | None]:
    """The candidates' first tokens (padded with -1) and their whole token ids, per row."""
    per = [p.candidates if p.candidates is not None else shared for p in items]
    if all(c is None for c in per):
        return None, None
    if any(c is None for c in per):
        raise ValueError("Give candidates for every prompt or for none.")
    rows, wholes = [], []
    for p, ans, cands in zip(items, answer_ids, per):
        whole = [_whole(model, c, p) for c in cands]
        seen: dict[tuple[int, ...], Any] = {}
        for c, w in zip(cands, whole):
            if w in seen:
                raise ValueError(
                    f"Candidates {seen[w]!r} and {c!r} (prompt {p.prompt!r}) are the same tokens "
                    f"{[token_str(model, t) for t in w]}: ranks cannot tell them apart. Drop one."
                )
            seen[w] = c
        ids = {w for c, w in zip(cands, whole) if isinstance(c, int)}  # an id names a first token
        if tuple(ans) not in seen and (ans[0],) not in ids:
            raise ValueError(
                f"The answer {p.answer!r} of prompt {p.prompt!r} is not among its candidates "
                f"(its tokens {[token_str(model, t) for t in ans]} are no candidate's)."
            )
        check_ids(model, [t for w in whole for t in w], f"candidates of prompt {p.prompt!r}")
        rows.append([w[0] for w in whole])
        wholes.append(tuple(whole))
    width = max(len(r) for r in rows)
    out = torch.full((len(rows), width), -1, dtype=torch.long)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.tensor(r)
    return out, tuple(wholes)

"""What the real-model protocol reads off its results: pure functions of ``ComponentScores``,
per-prompt candidate scores and rank rows, so each can be tested on hand-made inputs.

>>> chance(20)   # the mean 0-indexed rank of an answer placed at random among 20 candidates
9.5

- ``mass``: where |score| sits, by layer, component and token role; the paper's two sites (early
  MLPs at the entity's last token, late layers at the *last prompt token*, read per prompt from
  its roles, never as "the last position", which is an answer token when the answer has several).
- ``rank_table``: per prompt, the answer's rank among the candidates three ways (whole answer by
  summed log-probability, by mean log-probability per token, by first token), since summed
  log-probabilities put multi-token candidates last; ``permutation_null``: the mean rank the
  model's own candidate scores give when the answers are shuffled among the prompts (the null
  that keeps the length bias).
- ``reverted_shares``: the share of the learned improvement each freezing condition keeps or
  loses, instead of adjectives.
- ``interval``: a seeded percentile bootstrap over prompts (``stats.bootstrap``) as a dict.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from extractive_lens.batch import PromptBatch
from extractive_lens.stats import bootstrap

EARLY_FRACTION = 0.5
"""``mass``: early layers are blocks ``[0, L // 2)``, the first half (the paper's two sites)."""
N_BOOT = 1000


def chance(n_candidates: int) -> float:
    """The expected 0-indexed rank of an answer among ``n_candidates`` ranked at random."""
    return (n_candidates - 1) / 2


def is_answer_role(role: str) -> bool:
    return role.startswith("answer[")


def last_prompt_roles(scores: Any) -> tuple[str, ...]:
    """Per prompt, the role of its last prompt token (the position the reward's first answer
    token is read at): the last role that is not an answer token."""
    out = []
    for roles in scores.prompt_roles:
        prompt = [r for r in roles if not is_answer_role(r)]
        if not prompt:
            raise ValueError("A prompt of these scores has no prompt token.")
        out.append(prompt[-1])
    return tuple(out)


def early_layers(n_layers: int) -> slice:
    return slice(0, int(n_layers * EARLY_FRACTION))


def mass(scores: Any, kind: str = "informative") -> dict[str, Any]:
    """Where |score| sits, as shares of the total over layers, components and roles (uncomputed
    cells: 0): by layer (MLPs, heads), by role, on prompt tokens vs answer tokens, and the
    paper's two sites: MLPs of the early layers (``early_layers``) at the entity's last token
    (``{slot}[-1]``) and every component of the late layers at the last prompt token."""
    return _mass(scores[kind], scores)


SHARES = ("mlps", "heads", "answer_tokens", "last_prompt_token", "early_mlp_at_entity",
          "late_at_last_prompt_token")  # fmt: skip
"""The shares of ``mass`` that ``mass_intervals`` gives intervals for."""


def mass_intervals(
    scores: Any, kind: str = "informative", *, n_boot: int = N_BOOT, seed: int = 0
) -> dict[str, dict[str, float]]:
    """Each of ``SHARES`` with its 95% percentile interval over ``n_boot`` resamples of the
    prompts (``stats.counts``): each resample's map is the role-aligned mean of its prompts
    (``stats.resampled_maps``), as the map itself is, and its shares are read as ``mass``
    reads them (a role no drawn prompt has holds no mass)."""
    from extractive_lens.stats import counts, resampled_maps

    maps = resampled_maps(scores, "token", counts(scores.n_prompts, n_boot, seed))
    k = list(scores.kinds).index(kind)
    rows = [_mass(m[k], scores) for m in maps]
    est = mass(scores, kind)
    out = {}
    for key in SHARES:
        t = torch.tensor([r[key] for r in rows], dtype=torch.float64)
        out[key] = dict(estimate=est[key], low=float(t.quantile(0.025)),
                        high=float(t.quantile(0.975)), n=scores.n_prompts, n_boot=n_boot,
                        seed=seed)  # fmt: skip
    return out


def _mass(values: Tensor, scores: Any) -> dict[str, Any]:
    """``mass`` of one ``[layer, component, pos]`` map with ``scores``' labels and roles."""
    v = values.abs().double().nan_to_num(0.0)  # layer component pos
    total = float(v.sum()) or 1.0
    labels, comps = list(scores.position_labels), list(scores.component_labels)
    mlp = comps.index("MLP") if "MLP" in comps else None
    entity = [i for i, p in enumerate(labels) if p.endswith("[-1]") and p.startswith("{")]
    last = sorted({labels.index(r) for r in last_prompt_roles(scores)})
    answer = [i for i, p in enumerate(labels) if is_answer_role(p)]
    early = early_layers(v.shape[0])
    late = slice(early.stop, v.shape[0])
    heads = v[:, :mlp] if mlp is not None else v
    return dict(
        by_layer_mlp=[float(x) / total for x in v[:, mlp].sum(-1)] if mlp is not None else [],
        by_layer_heads=[float(x) / total for x in heads.sum((-1, -2))],
        by_role={p: float(v[:, :, i].sum()) / total for i, p in enumerate(labels)},
        mlps=float(v[:, mlp].sum()) / total if mlp is not None else 0.0,
        heads=float(heads.sum()) / total,
        answer_tokens=float(v[:, :, answer].sum()) / total,
        last_prompt_token=float(v[:, :, last].sum()) / total,
        last_prompt_roles=[labels[i] for i in last],
        early_layers=[early.start, early.stop - 1],
        early_mlp_at_entity=float(v[early, mlp][:, entity].sum()) / total if mlp is not None else 0.0,
        late_at_last_prompt_token=float(v[late][:, :, last].sum()) / total,
    )  # fmt: skip


def prompt_positions(scores: Any) -> Any:
    """``scores`` on prompt tokens only: the answer-token roles dropped from the position axis
    and from each prompt's roles (the teacher-forced continuation of a multi-token answer
    describes spelling, not the hop)."""
    from dataclasses import replace

    keep = [i for i, p in enumerate(scores.position_labels) if not is_answer_role(p)]
    roles = tuple(tuple(r for r in rs if not is_answer_role(r)) for rs in scores.prompt_roles)
    pv = scores.prompt_values.clone()
    for b, rs in enumerate(roles):  # answer tokens follow the prompt: zero them as padding
        pv[:, b, :, :, len(rs) :] = 0.0
    return replace(
        scores, values=scores.values[..., keep], prompt_values=pv,
        position_labels=tuple(scores.position_labels[i] for i in keep), prompt_roles=roles,
    )  # fmt: skip


def answer_lengths(batch: PromptBatch) -> Tensor:
    """``[batch, n_candidates]``: tokens of each candidate (0 where a row has fewer)."""
    cands = batch.candidate_tokens
    if cands is None:
        raise ValueError("Candidate lengths need make_batch(..., candidates=[...]).")
    out = torch.zeros(len(cands), max(len(r) for r in cands), dtype=torch.long)
    for i, row in enumerate(cands):
        out[i, : len(row)] = torch.tensor([len(c) for c in row])
    return out


def answer_index(batch: PromptBatch) -> Tensor:
    """``[batch]``: the column of each prompt's answer among its candidates."""
    cands = batch.candidate_tokens
    assert cands is not None
    out = []
    for row, targets in zip(cands, batch.answer_targets.tolist()):
        whole = tuple(t for t in targets if t >= 0)
        out.append(row.index(whole))
    return torch.tensor(out)


def rank_of(scores: Tensor, answer: Tensor) -> Tensor:
    """Per row: how many candidates score strictly above the answer's column."""
    return (scores > scores.gather(-1, answer[:, None])).sum(-1)


def rank_table(whole: Tensor, first: Tensor, lengths: Tensor, answer: Tensor) -> dict[str, Tensor]:
    """Per prompt, the answer's rank three ways from the candidates' log-probabilities:
    ``whole`` (summed over the candidate's tokens), ``per_token`` (that sum over its length)
    and ``first_token`` (its first token only; candidates sharing the answer's first token tie
    with it and do not count)."""
    per_token = whole / lengths.clamp(min=1)
    return {
        "whole": rank_of(whole, answer),
        "per_token": rank_of(per_token.masked_fill(lengths == 0, -math.inf), answer),
        "first_token": rank_of(first, answer),
    }


def permutation_null(
    scores: Tensor, answer: Tensor, *, n_perm: int = N_BOOT, seed: int = 0
) -> Tensor:
    """``[n_perm]`` mean ranks with the answers shuffled among the prompts (a seeded
    permutation each): what the model's candidate scores give a prompt whose answer is another
    prompt's. Unlike ``chance``, it keeps the scores' preferences (multi-token candidates last)."""
    gen = torch.Generator().manual_seed(seed)
    perms = torch.stack([torch.randperm(len(answer), generator=gen) for _ in range(n_perm)])
    shuffled = answer[perms]  # [n_perm, batch]
    at = scores[None].expand(n_perm, *scores.shape).gather(-1, shuffled[..., None])
    return (scores[None] > at).sum(-1).double().mean(-1)


def null_summary(observed: float, null: Tensor) -> dict[str, float]:
    """The null's mean and 95% range, and the one-sided p-value of a mean rank as low as
    ``observed`` (with the +1 of a permutation test)."""
    return dict(
        mean=float(null.mean()),
        low=float(null.quantile(0.025)),
        high=float(null.quantile(0.975)),
        p_low=float(((null <= observed).sum() + 1) / (len(null) + 1)),
    )


def interval(
    per_prompt: Tensor,
    statistic: Callable[[Tensor], Tensor] | None = None,
    *,
    n_boot: int = N_BOOT,
    seed: int = 0,
) -> dict[str, float]:
    """A statistic of per-prompt rows (the mean by default) with its 95% percentile interval
    over ``n_boot`` resamples of the prompts: ``stats.bootstrap``, as a JSON-ready dict."""
    ci = bootstrap(per_prompt, statistic, n_boot=n_boot, seed=seed)
    estimate, low, high = ci.item()
    return dict(estimate=estimate, low=low, high=high, n=ci.n, n_boot=n_boot, seed=seed)


def reverted_shares(rows: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Per (dataset, split, condition): the share of the learned improvement
    (``mean_rank(All) - mean_rank(None)``: reverting every change) that the condition loses,
    ``(rank(condition) - rank(None)) / (rank(All) - rank(None))``; NaN where nothing was learned:
    no improvement, or, where the rows hold per-prompt ``ranks``, an improvement whose bootstrap
    interval over prompts (``learned``) reaches 0 (a share of noise is no share)."""
    at = {(r["dataset"], r["split"], r["condition"]): r for r in rows}
    out = []
    for (ds, split, cond), row in at.items():
        none, all_ = at.get((ds, split, "None")), at.get((ds, split, "All"))
        if none is None or all_ is None:
            continue
        gain = float(all_["mean_rank"]) - float(none["mean_rank"])
        iv = learned(none, all_)
        real = gain > 0 and (iv is None or iv["low"] > 0)
        rank = float(row["mean_rank"])
        lost = (rank - float(none["mean_rank"])) / gain if real else math.nan
        out.append(dict(dataset=ds, split=split, condition=cond, mean_rank=rank, lost=lost,
                        learned=iv))  # fmt: skip
    return out


def learned(none: Mapping[str, Any], all_: Mapping[str, Any]) -> dict[str, float] | None:
    """The learned improvement, per prompt ``rank(All) - rank(None)``, its mean with a seeded
    bootstrap interval over prompts (``interval``); None where the rows lack per-prompt ranks."""
    if "ranks" not in none or "ranks" not in all_:
        return None
    a = torch.tensor(all_["ranks"], dtype=torch.float64)
    return interval(a - torch.tensor(none["ranks"], dtype=torch.float64))


def _means(rows: Sequence[float]) -> dict[str, Any]:
    t = torch.tensor(list(rows), dtype=torch.float64)
    return dict(per_seed=t.tolist(), mean=float(t.mean()), min=float(t.min()), max=float(t.max()),
                sd=float(t.std()) if len(t) > 1 else 0.0)  # fmt: skip


def seed_spread(last: Mapping[str, Mapping[str, Mapping[str, Sequence[int]]]]) -> dict[str, Any]:
    """``{seed: {split: {way: per-prompt ranks}}}`` -> per split and way, the mean rank of
    each seed and their mean, range and standard deviation."""
    seeds = list(last)
    first = last[seeds[0]]
    return {
        split: {way: _means([sum(last[s][split][way]) / len(last[s][split][way]) for s in seeds])
                for way in first[split]}
        for split in first
    }  # fmt: skip


def freezing_summary(per_seed: Mapping[str, Sequence[Mapping[str, Any]]]) -> list[dict[str, Any]]:
    """Per (dataset, split, condition) of ``layer_freezing`` rows run once per seed: the mean
    rank of each seed with their spread, the first seed's bootstrap interval over prompts, and
    the share of the learned improvement lost (``reverted_shares``) per seed, with the first
    seed's learned improvement and its interval (``learned``)."""
    seeds = list(per_seed)
    shares = {s: {(r["dataset"], r["split"], r["condition"]): r
                  for r in reverted_shares(per_seed[s])} for s in seeds}  # fmt: skip
    out = []
    for row in per_seed[seeds[0]]:
        key = (row["dataset"], row["split"], row["condition"])
        same = [next(r for r in per_seed[s] if (r["dataset"], r["split"], r["condition"]) == key)
                for s in seeds]  # fmt: skip
        out.append(dict(
            dataset=key[0], split=key[1], condition=key[2],
            mean_rank=_means([r["mean_rank"] for r in same]),
            interval=interval(torch.tensor(row["ranks"], dtype=torch.float64)),
            lost=_means([shares[s][key]["lost"] if key in shares[s] else math.nan
                         for s in seeds]),
            learned=shares[seeds[0]][key]["learned"] if key in shares[seeds[0]] else None,
        ))  # fmt: skip
    return out

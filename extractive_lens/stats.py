"""Confidence intervals by a seeded bootstrap over prompts: per-prompt values in, estimate and
interval out, no new passes.

>>> ci = bootstrap(torch.tensor([0.0, 1.0, 2.0, 3.0]), seed=0)   # the mean, 95% interval
>>> ci.estimate.item(), ci.level
(1.5, 0.95)

The unit resampled is the prompt: a score map of 30 layers x 10 components x 12 roles from 8
prompts rests on 8 independent observations, not 3,600, and its intervals are as wide as 8
prompts allow. ``draws`` gives the prompt indices of every resample (one seeded generator), and
every interval of the package (``ComponentScores.ci``, ``ScoreComparison.ci``,
``mean_rank_interval``, ``verified_scores``' audit) is a percentile interval over those draws.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from extractive_lens.arguments import count
from extractive_lens.arguments import seed as seed_value

N_BOOT = 1000
"""Resamples drawn by default."""
LEVEL = 0.95
"""Coverage of the intervals by default."""


@dataclass(frozen=True)
class Interval:
    """A statistic of the prompts with its bootstrap interval.

    Attributes:
        estimate: the statistic on all prompts (any shape; NaN where it is undefined).
        low, high: the ``(1 - level) / 2`` and ``(1 + level) / 2`` quantiles of the statistic
            over the resamples (NaN where fewer than half the resamples define it).
        level, n_boot, seed: coverage, resamples and the seed they were drawn with.
        n: prompts resampled (the unit of the interval).
    """

    estimate: Tensor
    low: Tensor
    high: Tensor
    level: float
    n_boot: int
    seed: int
    n: int

    def contains(self, value: Tensor | float) -> Tensor:
        """Where ``low <= value <= high`` (elementwise; False where the interval is NaN)."""
        v = torch.as_tensor(value, dtype=self.low.dtype)
        return (self.low <= v) & (v <= self.high)

    @property
    def width(self) -> Tensor:
        return self.high - self.low

    def item(self) -> tuple[float, float, float]:
        """``(estimate, low, high)`` of a scalar statistic."""
        return float(self.estimate), float(self.low), float(self.high)

    def __repr__(self) -> str:
        if self.estimate.numel() == 1:
            e, lo, hi = self.item()
            return (
                f"{e:.4g} [{lo:.4g}, {hi:.4g}] ({self.level:.0%} interval, bootstrap over "
                f"{self.n} prompts, {self.n_boot} resamples, seed {self.seed})"
            )
        return (
            f"Interval(shape={tuple(self.estimate.shape)}, level={self.level}, "
            f"n_boot={self.n_boot}, seed={self.seed}, prompts={self.n})"
        )


def draws(n: int, n_boot: int = N_BOOT, seed: int = 0) -> Tensor:
    """``[n_boot, n]`` prompt indices: each row one resample of the ``n`` prompts with
    replacement, from ``torch.Generator().manual_seed(seed)``."""
    if n < 1:
        raise ValueError("A bootstrap needs at least one prompt.")
    n_boot = count("n_boot", n_boot, "resamples")
    g = torch.Generator().manual_seed(seed_value("seed", seed))
    return torch.randint(0, n, (n_boot, n), generator=g)


def counts(n: int, n_boot: int = N_BOOT, seed: int = 0) -> Tensor:
    """``[n_boot, n]``: how often each prompt is drawn in each resample of ``draws``."""
    idx = draws(n, n_boot, seed)
    out = torch.zeros(n_boot, n, dtype=torch.float64)
    return out.scatter_add_(1, idx, torch.ones_like(idx, dtype=torch.float64))


def percentile_interval(
    estimate: Tensor, resampled: Tensor, *, level: float, n_boot: int, seed: int, n: int
) -> Interval:
    """The interval of ``resampled`` (``[n_boot, ...]``, NaN where a resample leaves the
    statistic undefined) around ``estimate``."""
    check_level(level)
    r = resampled.double()
    q = torch.tensor([(1 - level) / 2, (1 + level) / 2], dtype=torch.float64)
    bounds = torch.nanquantile(r, q, dim=0)
    defined = (~torch.isnan(r)).sum(0) * 2 >= r.shape[0]
    bounds = torch.where(defined, bounds, torch.full_like(bounds, float("nan")))
    return Interval(estimate.double(), bounds[0], bounds[1], level, n_boot, seed, n)


def bootstrap(
    per_prompt: Tensor,
    statistic: Callable[[Tensor], Tensor] | None = None,
    *,
    level: float = LEVEL,
    n_boot: int = N_BOOT,
    seed: int = 0,
) -> Interval:
    """A statistic of per-prompt values (``[prompt, ...]``) and its percentile interval.

    Args:
        per_prompt: one row per prompt (a rank, a score, a cell map: any trailing shape).
        statistic: ``rows -> value``, called on the prompts and on each resample (rows in
            resampled order); default the mean over prompts.
        level, n_boot, seed: coverage, resamples, the seed of ``draws``.

    >>> bootstrap(torch.ones(5), seed=1).item()      # every prompt the same: no doubt
    (1.0, 1.0, 1.0)
    """
    x = torch.as_tensor(per_prompt).double()
    if x.dim() == 0:
        raise ValueError("bootstrap needs one value per prompt (a tensor with a prompt axis).")
    stat = statistic or (lambda rows: rows.mean(0))
    idx = draws(x.shape[0], n_boot, seed)
    if statistic is None:  # the mean: one weighted sum per resample
        w = counts(x.shape[0], n_boot, seed) / x.shape[0]
        resampled = torch.einsum("rb,b...->r...", w, x)
    else:
        resampled = torch.stack([torch.as_tensor(stat(x[i])).double() for i in idx])
    return percentile_interval(
        torch.as_tensor(stat(x)), resampled, level=level, n_boot=n_boot, seed=seed, n=x.shape[0]
    )


def role_means(prompt_values: Tensor, present: Tensor, weights: Tensor) -> Tensor:
    """Role-aligned means under prompt weights: ``prompt_values`` ``[batch, *cells, role]``
    (0 where the prompt lacks the role), ``present`` ``[batch, role]`` (1 where it has it),
    ``weights`` ``[r, batch]`` (one row per resample) → ``[r, *cells, role]``; NaN where no
    drawn prompt has the role."""
    sums = torch.einsum("rb,b...->r...", weights, prompt_values)
    n = weights @ present  # [r, role]
    shape = (n.shape[0],) + (1,) * (sums.dim() - 2) + (n.shape[1],)
    n = n.reshape(shape)
    return torch.where(n > 0, sums / n.clamp(min=1e-300), torch.full_like(sums, float("nan")))


def resampled_maps(scores: Any, level: str, weights: Tensor) -> Tensor:
    """Each resample's role-aligned ``values`` (``level="token"``: ``[r, kind, layer,
    component, pos]``) or ``totals`` (``"component"``: ``[r, kind, layer, component]``) of a
    ``ComponentScores``, for prompt ``weights`` ``[r, batch]`` (``counts``)."""
    if level == "component":
        x = scores.prompt_totals.detach().cpu().double().transpose(0, 1)
        return torch.einsum("rb,b...->r...", weights / scores.n_prompts, x)
    x, present = scores.role_aligned()
    return role_means(x, present, weights)


def check_level(level: float) -> None:
    if not 0 < level < 1:
        raise ValueError(f"level must be a coverage between 0 and 1 (e.g. 0.95), got {level!r}.")


def describe(interval: Interval) -> dict[str, Any]:
    """What an interval was computed with, for a result's metadata."""
    return dict(
        level=interval.level, n_boot=interval.n_boot, seed=interval.seed, unit="prompt",
        prompts=interval.n,
    )  # fmt: skip

"""A map the package can vouch for: linear everywhere, exact where it matters, audited.

>>> v = verified_scores(base, diff, batch, budget=3.0, seed=0)
>>> v.provenance("upstream").shape          # [layer, component, pos]: exact / integrated / linear
(4, 5, 11)
>>> sorted(v.metadata["verified"]["estimates"])
['downstream', 'informative', 'upstream']

Per kind, in order:

1. **Linear on every cell** (``linear_scores``), timed: its seconds are the budget's unit.
2. **Exact on the cells carrying the linear mass**: components by decreasing linear mass
   (``Σ`` over roles of ``|linear|``) until ``coverage`` of it, at most half the budget's
   components.
3. **Exact on a seeded random audit of all the other components**, stratified by depth
   (``DEPTH_BANDS`` bands of layers) and component type (heads, MLP), at least
   ``MIN_PER_STRATUM`` per stratum: every other cell has
   a known chance of being drawn, so the agreement estimated from the audit is an estimate over
   the whole map, not over linear's favourites. The exact engine is ``causal_scores(...,
   top_k=, linear=)`` handed a ranking that puts exactly the chosen components first.
4. **Integrated where linear and exact disagree**: in each stratum where an audited
   component's linear cells miss its exact ones by more than ``tolerance`` (relative), the
   un-audited components get ``integrated_scores`` (as far as the budget allows).
5. **Estimates with intervals**: the whole map's Pearson r and slope (linear on exact, through
   0, as ``compare``) and the share of the exact |mass| outside the cells of step 2 (what
   linear's ranking would have missed), from the census of step 2 plus the audit weighted by
   ``N_h / n_h`` per stratum. Intervals: a seeded bootstrap that resamples the prompts
   (``stats.counts``) and, within each stratum, the audited components (Rao and Wu's
   rescaling bootstrap, ``_audit_weights``: a stratum audited in full adds no doubt); the
   verdict is stated on the intervals, naming the check that failed.

Each cell of the result carries its provenance (``ComponentScores.provenance``): ``exact``
where step 2 or 3 patched its component, ``integrated`` where step 4 did, else ``linear``.
``budget``: a multiple of linear's passes (``3.0``: the whole call, linear's passes included,
about three times linear's; a pass is the batch through every block once, a resumed forward
or a backward counted by what it runs: ``scoring/counting.py``), or seconds (``"120s"``). The
passes are counted while the call runs; each kind gets an equal share of what linear leaves.
The top set and ``MIN_PER_STRATUM`` per stratum are always done, and what they cost (counted,
per unit of depth: a component's rows resume after it) sizes the rest of the audit and the
integrated step; a budget too small for them is overrun, recorded
(``metadata["verified"]["over_budget"]``) and warned (``OverBudgetWarning``, naming the budget
that would hold them). ``audit=`` fixes the audited components per kind instead, for a
reproducible design. ``el.estimate(model, diff, batch, "verified", budget=...)`` says its
memory, Δ traffic and passes before it runs (counted on a narrow copy of the model).
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

import numpy as np
import torch
from torch import Tensor

from extractive_lens import stats
from extractive_lens.arguments import count, whole
from extractive_lens.batch import PromptBatch
from extractive_lens.results import ComponentScores
from extractive_lens.rewards import Reward
from extractive_lens.scoring.counting import PassCount, counting_passes
from extractive_lens.scoring.options import LinearOptions
from extractive_lens.types import SCORE_KINDS, Ablation, ScoreKind

DEPTH_BANDS = 4
"""Strata of depth: the layers in this many equal bands (each with its heads and its MLPs)."""
MIN_PER_STRATUM = 2
"""Audited components per stratum, at least (where it has that many): one gives no variance."""
STAND_IN_R, STAND_IN_SLOPE, STAND_IN_MISSED = 0.9, (0.8, 1.25), 0.2
"""A linear map can stand in when r's lower bound, the slope's interval and missed mass's upper
bound pass these."""


@dataclass(frozen=True)
class VerifiedOptions(LinearOptions):
    """``verified_scores``' options: linear's, and the design (see the module docstring)."""

    budget: float | str = 3.0
    coverage: float = 0.8
    audit: int | None = None
    tolerance: float = 0.2
    steps: int = 4
    level: float = 0.95
    n_boot: int = 1000
    linear: Any = None  # linear scores of this batch and diff, to reuse (with what they cost)
    linear_passes: float | None = None
    linear_seconds: float | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 < self.coverage <= 1:
            raise ValueError(f"coverage must be in (0, 1], got {self.coverage!r}.")
        if self.audit is not None and (not whole(self.audit) or self.audit < 0):
            raise ValueError(
                f"audit must be a whole number of components >= 0 (or None: what the budget "
                f"leaves), got {self.audit!r}."
            )
        if not (isinstance(self.tolerance, (int, float)) and 0 <= self.tolerance < math.inf):
            raise ValueError(
                f"tolerance must be a finite relative error >= 0 (0.2: 20%), got {self.tolerance!r}."
            )
        count("steps", self.steps, "integrated nodes per path (4 by default)")
        count("n_boot", self.n_boot, "resamples")
        stats.check_level(self.level)
        Budget.of(self.budget)  # checks its form


@dataclass(frozen=True)
class Budget:
    """What a call may spend: ``unit`` ``"passes"`` (``counting.py``) with ``multiple`` times
    linear's, or ``"seconds"`` with ``amount`` of them."""

    unit: Literal["passes", "seconds"]
    multiple: float | None = None
    amount: float | None = None

    @classmethod
    def of(cls, budget: float | str) -> Budget:
        """A number: that many times linear's passes (at least 1, linear alone); ``"120s"``:
        seconds of the whole call."""
        if isinstance(budget, str):
            if not budget.endswith("s") or not _positive(budget[:-1]):
                raise ValueError(
                    f"budget must be a multiple of linear's passes (3.0) or seconds ('120s'), "
                    f"got {budget!r}."
                )
            return cls("seconds", amount=float(budget[:-1]))
        if (
            isinstance(budget, bool)
            or not isinstance(budget, (int, float))
            or not (1 <= budget < math.inf)
        ):
            raise ValueError(
                f"budget must be a finite multiple of linear's passes, at least 1 (linear alone), "
                f"or seconds such as '120s'; got {budget!r}."
            )
        return cls("passes", multiple=float(budget))

    def allowed(self, linear_cost: float) -> float:
        """The whole call's allowance in ``unit``, linear's cost (in ``unit``) given."""
        return self.amount if self.multiple is None else self.multiple * linear_cost  # type: ignore[return-value]


def _positive(text: str) -> bool:
    """Whether ``text`` is a finite number of seconds above 0 (not ``nan``, ``inf``, ``1e400``)."""
    try:
        return 0 < float(text) < math.inf
    except ValueError:
        return False


def verified_scores(
    model: Any,
    diff: Any,
    batch: PromptBatch,
    *,
    budget: float | str = 3.0,
    kinds: Sequence[ScoreKind] | ScoreKind = SCORE_KINDS,
    seed: int = 0,
    coverage: float = 0.8,
    audit: int | None = None,
    tolerance: float = 0.2,
    steps: int = 4,
    reward: str | Reward | None = None,
    ablation: Ablation | None = None,
    reference: PromptBatch | None = None,
    batch_size: int | None = 16,
    level: float = 0.95,
    n_boot: int = 1000,
    show_progress: bool | None = None,
    compute_dtype: torch.dtype | str | None = None,
    positions: Literal["all", "prompt"] = "all",
    linear: ComponentScores | None = None,
    linear_passes: float | None = None,
    linear_seconds: float | None = None,
) -> ComponentScores:
    """Linear scores of every cell, exact where they carry the mass and on a random audit of
    the rest, integrated where the audit finds linear off, with the whole map's agreement
    estimated with intervals (module docstring; ``docs/scores.md`` §13).

    Args:
        budget: a multiple of linear's passes (default 3.0: the whole call, linear included,
            about three times linear's passes; ``scoring/counting.py`` defines a pass) or
            seconds of the whole call (``"120s"``).
        kinds: as in ``linear_scores``.
        seed: the audit's draw and the bootstrap's.
        coverage: the share of linear |mass| whose components are computed exactly.
        audit: audited components per kind (default: what the budget leaves).
        tolerance: relative error past which an audited component's linear cells disagree.
        steps: integrated scores' nodes where linear disagrees.
        level, n_boot: the intervals' coverage and resamples.
        reward, ablation, reference, batch_size, show_progress, compute_dtype, positions: as
            in ``linear_scores`` (the paper convention; the exact scores exist only there).
        linear: ``linear_scores(model, diff, batch, kinds=kinds)`` already computed, to reuse
            with what it cost in the budget's unit: ``linear_passes`` (counted with
            ``counting_passes``) or ``linear_seconds``.

    Returns a ``ComponentScores`` (``method="verified"``) whose cells hold the exact,
    integrated or linear value (``provenance(kind)``), with ``metadata["verified"]``: per kind
    the design (components computed, strata, audit), ``estimates`` (``r``, ``slope``,
    ``missed_mass``: each ``[estimate, low, high]``) and the verdict; the budget (``unit``,
    ``allowed``, ``spent``, ``over_budget``: also warned, ``OverBudgetWarning``, with the budget
    that would hold the smallest design) and the passes counted.
    """
    options = VerifiedOptions(
        kinds=kinds, reward=reward, ablation=ablation, reference=reference,
        batch_size=batch_size, seed=seed, show_progress=show_progress,
        compute_dtype=compute_dtype, positions=positions, budget=budget, coverage=coverage,
        audit=audit, tolerance=tolerance, steps=steps, level=level, n_boot=n_boot, linear=linear,
        linear_passes=linear_passes, linear_seconds=linear_seconds,
    )  # fmt: skip
    return verified_scores_with(model, diff, batch, options)


def verified_scores_with(
    model: Any, diff: Any, batch: PromptBatch, options: VerifiedOptions
) -> ComponentScores:
    """``verified_scores`` with its options as one ``VerifiedOptions`` object."""
    from extractive_lens.scoring.linear import linear_scores

    common = dict(
        reward=options.reward_fn, ablation=options.ablation, reference=options.reference,
        batch_size=options.batch_size, show_progress=options.show_progress,
        compute_dtype=options.compute_dtype, positions=options.positions,
    )  # fmt: skip
    budget = Budget.of(options.budget)
    start = time.perf_counter()
    with counting_passes(model, batch) as count:
        lin = options.linear
        if lin is None:
            lin = linear_scores(model, diff, batch, kinds=options.score_kinds, **common)  # type: ignore[arg-type]
        elif lin.method != "linear" or lin.kinds != options.score_kinds:
            raise ValueError(
                f"verified_scores(linear=...) takes linear_scores of the kinds asked for "
                f"({options.score_kinds}); got {lin.method} scores of {lin.kinds}."
            )
        else:  # of this batch, Δ and function, as the exact calls below will require
            from extractive_lens.scoring.causal import check_linear
            from extractive_lens.scoring.options import CausalOptions

            exact_options = CausalOptions(kinds=options.score_kinds, **common)  # type: ignore[arg-type]
            check_linear(model, diff, batch, exact_options, lin, "verified_scores(linear=...)")
        spend = _Spend(budget, count, start, options)
        plan, cells = _design(model, diff, batch, lin, options, common, spend)
    values, totals, prompt_values, prompt_totals, provenance = cells
    meta = dict(lin.metadata)
    meta["verified"] = dict(
        budget=options.budget, unit=budget.unit, allowed=spend.allowed,
        spent=spend.used(), linear_cost=spend.linear, over_budget=spend.used() > spend.allowed,
        passes={"linear": spend.linear_passes, "forward": count.forward,
                "backward": count.backward, "total": spend.linear_passes_given + count.passes},
        total_seconds=time.perf_counter() - start,
        coverage=options.coverage, tolerance=options.tolerance, seed=options.seed,
        level=options.level, n_boot=options.n_boot, steps=options.steps,
        provenance={kd: provenance[i].tolist() for i, kd in enumerate(lin.kinds)},
        kinds=plan,
    )  # fmt: skip
    meta["verified"]["estimates"] = {kd: plan[kd]["estimates"] for kd in lin.kinds}
    if meta["verified"]["over_budget"]:  # the top sets and the smallest audit are always done
        least = sum(p["least_cost"] for p in plan.values()) + spend.linear
        audited = f"audit={options.audit}" if options.audit else f"{MIN_PER_STRATUM} per stratum"
        warnings.warn(
            f"verified_scores spent {spend.used():.1f} {budget.unit} of a budget of "
            f"{spend.allowed:.1f} (linear's {spend.linear:.1f}): linear, the top components and "
            f"the audit always done ({audited}) alone took {least:.1f}; pass budget="
            f"{_needed(budget, least, spend.linear)} to hold them, or a lower coverage=.",
            OverBudgetWarning, stacklevel=3,
        )  # fmt: skip
    return replace(lin, values=values, totals=totals, prompt_values=prompt_values,
                   prompt_totals=prompt_totals, method="verified", metadata=meta)  # fmt: skip


class OverBudgetWarning(UserWarning):
    """``verified_scores`` spent more than its budget (the smallest design did not fit)."""


def _needed(budget: Budget, cost: float, linear: float) -> str:
    """The budget argument that holds ``cost`` (in the budget's unit)."""
    if budget.unit == "seconds":
        return f"'{math.ceil(cost)}s'"
    return f"{math.ceil(10 * cost / linear) / 10:.1f}"


class _Spend:
    """What the call has spent, in its budget's unit: counted passes (with the passes of a
    reused linear result) or seconds since it began (with a reused result's seconds)."""

    def __init__(self, budget: Budget, count: PassCount, start: float,
                 options: VerifiedOptions) -> None:  # fmt: skip
        self.budget, self.count, self.start, self.extra = budget, count, start, 0.0
        reused = options.linear is not None
        given = options.linear_passes if budget.unit == "passes" else options.linear_seconds
        if reused and given is None:
            name = "linear_passes" if budget.unit == "passes" else "linear_seconds"
            raise ValueError(
                f"verified_scores(linear=...) needs {name}=, what computing it cost (the "
                f"budget's unit), or leave linear= out to have it computed and counted."
            )
        self.linear_passes_given = (options.linear_passes or 0.0) if reused else 0.0
        self.linear_passes = self.linear_passes_given if reused else count.passes
        self.linear = float(given) if reused else self.used()  # type: ignore[arg-type]
        self.extra = self.linear if reused else 0.0
        self.allowed = budget.allowed(self.linear)

    def used(self) -> float:
        if self.budget.unit == "passes":
            return self.count.passes + self.extra
        return time.perf_counter() - self.start + self.extra


def _design(model: Any, diff: Any, batch: PromptBatch, lin: ComponentScores,
            options: VerifiedOptions, common: dict[str, Any], spend: _Spend) -> tuple:  # fmt: skip
    """Steps 2–5 of the module docstring, kind by kind, each kind given an equal share of
    what the budget leaves after linear; returns the plan per kind and the result's cells."""
    from extractive_lens.scoring.causal import causal_scores
    from extractive_lens.scoring.integrated import integrated_scores

    n_layers, n_comp = lin.totals.shape[1:]
    total = n_layers * n_comp
    rng = np.random.default_rng(options.seed)
    strata = _strata(lin.component_labels, n_layers)
    plan: dict[str, Any] = {}
    values, prompt_values = lin.values.clone(), lin.prompt_values.clone()
    totals, prompt_totals = lin.totals.clone(), lin.prompt_totals.clone()
    provenance = np.full((len(lin.kinds), n_layers, n_comp), "linear", dtype=object)
    per_kind = max(spend.allowed - spend.used(), 0.0) / len(lin.kinds)
    # a component's exact cost grows with the layers after it (its rows resume there)
    depth = {c: (n_layers - c // n_comp) / n_layers for c in range(total)}
    for k, kind in enumerate(lin.kinds):
        began = spend.used()
        mass = lin.values[k].abs().nan_to_num(0.0).sum(-1).double()  # [layer, comp]
        top = _covering(mass, options.coverage, cap=max(1, total // 2))
        rest = [c for c in range(total) if c not in set(top)]
        # the top set and the smallest audit first; what they cost sizes the rest
        sample = _stratified(rest, strata, options.audit or 0, rng, least=MIN_PER_STRATUM)
        first = [c for cs in sample.values() for c in cs]
        exact = _exact(causal_scores, model, diff, batch, lin, kind, top + first, common)
        least = spend.used() - began
        unit = least / max(sum(depth[c] for c in top + first), 1e-9)  # cost per unit of depth
        if options.audit is None:
            left = [c for c in rest if c not in set(first)]
            mean = sum(depth[c] for c in left) / max(len(left), 1)
            room = per_kind - (spend.used() - began)
            n = int(room / (unit * mean)) if unit > 0 and mean > 0 else 0
            more = _stratified(left, strata, max(0, n), rng, least=0)
            extra = [c for cs in more.values() for c in cs]
            exact = _merge_exact(exact, _exact(causal_scores, model, diff, batch, lin, kind,
                                               extra, common), extra)  # fmt: skip
            for h, cs in more.items():
                sample[h] = sorted(sample.get(h, []) + cs)
        audited = [c for cs in sample.values() for c in cs]
        for c in top + audited:
            _put(values, prompt_values, totals, prompt_totals, k, c, n_comp, exact, 0)
            provenance[k, c // n_comp, c % n_comp] = "exact"
        # integrated where linear and exact disagree, on the components not patched exactly
        off = _disagreeing(lin, exact, k, audited, n_comp, options.tolerance)
        bad_strata = {strata[c] for c in off}
        pending = [c for c in rest if c not in set(audited) and strata[c] in bad_strata]
        room = per_kind - (spend.used() - began)
        if options.audit is not None:
            integrate = pending
        else:  # an integrated component taken to cost twice an exact one of its depth
            integrate, cost = [], 0.0
            for c in pending:
                cost += 2 * unit * depth[c]
                if cost > room:
                    break
                integrate.append(c)
        if integrate:
            ig = _integrated(integrated_scores, model, diff, batch, lin, kind, integrate, common,
                             options.steps)  # fmt: skip
            for c in integrate:
                _put(values, prompt_values, totals, prompt_totals, k, c, n_comp, ig, 0)
                provenance[k, c // n_comp, c % n_comp] = "integrated"
        plan[kind] = dict(
            top=top, strata={str(h): len([c for c in rest if strata[c] == h]) for h in
                             sorted(set(strata.values()))},
            sample={str(h): cs for h, cs in sample.items()}, audited=audited,
            disagreeing=off, integrated=integrate,
            coverage=float(mass.flatten()[top].sum() / mass.sum()) if mass.sum() > 0 else 1.0,
            spent=spend.used() - began, least_cost=least, share=per_kind,
        )  # fmt: skip
        plan[kind]["estimates"] = _estimates(lin, exact, k, top, sample, rest, strata, n_comp,
                                             options)  # fmt: skip
        plan[kind]["verdict"] = _verdict(kind, plan[kind])
    return plan, (values, totals, prompt_values, prompt_totals, provenance)


def _strata(labels: Sequence[str], n_layers: int) -> dict[int, tuple[int, str]]:
    """Each flat component index's stratum: its depth band (``DEPTH_BANDS`` equal bands of
    layers; one per layer in models that shallow) and type (heads or MLP)."""
    n = len(labels)
    bands = min(n_layers, DEPTH_BANDS)
    return {
        layer * n + c: (layer * bands // n_layers, "mlp" if labels[c] == "MLP" else "heads")
        for layer in range(n_layers)
        for c in range(n)
    }


def _covering(mass: Tensor, coverage: float, cap: int) -> list[int]:
    """The fewest components (flat indices) whose linear mass reaches ``coverage`` of the
    whole, largest first, at most ``cap``."""
    flat = mass.flatten()
    order = torch.argsort(flat, descending=True).tolist()
    whole = float(flat.sum())
    out: list[int] = []
    got = 0.0
    for c in order:
        if whole == 0 or got >= coverage * whole or len(out) >= cap:
            break
        out.append(c)
        got += float(flat[c])
    return out


def _stratified(
    rest: list[int], strata: dict[int, Any], n: int, rng: np.random.Generator, *, least: int
) -> dict[Any, list[int]]:
    """About ``n`` components of ``rest`` drawn without replacement, allocated to strata in
    proportion to their sizes, at least ``least`` in each (where it has them)."""
    groups: dict[Any, list[int]] = {}
    for c in rest:
        groups.setdefault(strata[c], []).append(c)
    size = sum(len(g) for g in groups.values())
    want = {h: min(len(g), max(least, round(n * len(g) / size))) for h, g in groups.items()}
    return {
        h: sorted(int(c) for c in rng.choice(g, size=want[h], replace=False))
        for h, g in sorted(groups.items())
    }


def _chooser(lin: ComponentScores, kind: str, chosen: list[int]) -> ComponentScores:
    """``lin`` with its ``kind`` totals replaced by a ranking that puts ``chosen`` first, so
    ``causal_scores(top_k=len(chosen), linear=...)`` patches exactly those."""
    k = lin.kind_index(kind)  # type: ignore[arg-type]
    totals = torch.zeros_like(lin.totals)
    flat = totals[k].view(-1)
    flat[torch.tensor(chosen, dtype=torch.long)] = 1.0
    return replace(lin, totals=totals)


def _exact(causal: Any, model: Any, diff: Any, batch: PromptBatch, lin: ComponentScores,
           kind: str, chosen: list[int], common: dict[str, Any]) -> ComponentScores | None:  # fmt: skip
    if not chosen:
        return None
    return causal(model, diff, batch, kinds=(kind,), top_k=len(chosen),
                  linear=_chooser(lin, kind, chosen), **common)  # fmt: skip


def _integrated(integrated: Any, model: Any, diff: Any, batch: PromptBatch,
                lin: ComponentScores, kind: str, chosen: list[int], common: dict[str, Any],
                steps: int) -> ComponentScores:  # fmt: skip
    return integrated(model, diff, batch, kinds=(kind,), top_k=len(chosen), steps=steps,
                      linear=_chooser(lin, kind, chosen), **common)  # fmt: skip


def _merge_exact(
    a: ComponentScores | None, b: ComponentScores | None, b_cells: list[int]
) -> ComponentScores | None:
    """One exact result of the two runs (``b``'s components over ``a``'s NaN)."""
    if a is None or b is None:
        return a or b
    n_comp = a.totals.shape[2]
    out = [t.clone() for t in (a.values, a.totals, a.prompt_values, a.prompt_totals)]
    for c in b_cells:
        layer, comp = divmod(c, n_comp)
        out[0][:, layer, comp] = b.values[:, layer, comp]
        out[1][:, layer, comp] = b.totals[:, layer, comp]
        out[2][:, :, layer, comp] = b.prompt_values[:, :, layer, comp]
        out[3][:, :, layer, comp] = b.prompt_totals[:, :, layer, comp]
    return replace(a, values=out[0], totals=out[1], prompt_values=out[2], prompt_totals=out[3])


def _put(values: Tensor, pv: Tensor, totals: Tensor, pt: Tensor, k: int, c: int, n_comp: int,
         src: ComponentScores | None, src_k: int) -> None:  # fmt: skip
    """Component ``c``'s cells of kind ``k`` from ``src`` (its kind ``src_k``)."""
    if src is None:
        return
    layer, comp = divmod(c, n_comp)
    values[k, layer, comp] = src.values[src_k, layer, comp].to(values)
    totals[k, layer, comp] = src.totals[src_k, layer, comp].to(totals)
    pv[k, :, layer, comp] = src.prompt_values[src_k, :, layer, comp].to(pv)
    pt[k, :, layer, comp] = src.prompt_totals[src_k, :, layer, comp].to(pt)


def _disagreeing(lin: ComponentScores, exact: ComponentScores | None, k: int,
                 audited: list[int], n_comp: int, tolerance: float) -> list[int]:  # fmt: skip
    """Audited components whose linear cells miss the exact ones by more than ``tolerance``
    of the exact cells' norm (and of 1% of the kind's largest exact cell)."""
    if exact is None or not audited:
        return []
    ex = exact.values[0].double()
    floor = 0.01 * float(ex.abs().nan_to_num(0.0).max())
    out = []
    for c in audited:
        layer, comp = divmod(c, n_comp)
        a, b = lin.values[k, layer, comp].double(), ex[layer, comp]
        if float((a - b).norm()) > tolerance * float(b.norm()) + floor:
            out.append(c)
    return out


def _estimates(lin: ComponentScores, exact: ComponentScores | None, k: int, top: list[int],
               sample: dict[Any, list[int]], rest: list[int], strata: dict[int, Any],
               n_comp: int, options: VerifiedOptions) -> dict[str, Any]:  # fmt: skip
    """The whole map's r, slope and missed mass, with bootstrap intervals (module docstring)."""
    if exact is None:
        nan = [float("nan")] * 3
        return dict(r=nan, slope=nan, missed_mass=nan, audited=0)
    n = lin.n_prompts
    w_prompts = torch.cat([torch.ones(1, n, dtype=torch.float64),
                           stats.counts(n, options.n_boot, options.seed)])  # fmt: skip
    x = stats.resampled_maps(lin, "token", w_prompts)[:, k]  # [r, layer, comp, pos]
    y = stats.resampled_maps(exact, "token", w_prompts)[:, 0]
    r_all = x.shape[0]
    x = x.reshape(r_all, -1, x.shape[-1])  # [r, component, pos]
    y = y.reshape(r_all, -1, y.shape[-1])
    sizes = {h: sum(1 for c in rest if strata[c] == h) for h in sample}
    if any(sizes[h] and not cs for h, cs in sample.items()):
        nan = [float("nan")] * 3  # a stratum nobody audited: no estimate over the whole map
        return dict(r=nan, slope=nan, missed_mass=nan, audited=sum(map(len, sample.values())))
    g = torch.Generator().manual_seed(options.seed + 1)
    weight = torch.zeros(r_all, x.shape[1], dtype=torch.float64)  # per component
    weight[:, top] = 1.0
    for h, cs in sample.items():
        if not cs:
            continue
        idx = torch.tensor(cs)
        weight[:, idx] += _audit_weights(len(cs), sizes[h], r_all - 1, g)
    in_top = torch.zeros(x.shape[1], dtype=torch.bool)
    in_top[top] = True
    ok = torch.isfinite(x) & torch.isfinite(y)
    w = weight[:, :, None].expand_as(x) * ok
    x0, y0 = torch.where(ok, x, 0.0), torch.where(ok, y, 0.0)
    s = {
        "n": w.sum((1, 2)), "x": (w * x0).sum((1, 2)), "y": (w * y0).sum((1, 2)),
        "xx": (w * x0 * x0).sum((1, 2)), "yy": (w * y0 * y0).sum((1, 2)),
        "xy": (w * x0 * y0).sum((1, 2)),
    }  # fmt: skip
    cov = s["xy"] - s["x"] * s["y"] / s["n"]
    var_x = s["xx"] - s["x"] ** 2 / s["n"]
    var_y = s["yy"] - s["y"] ** 2 / s["n"]
    r = cov / (var_x * var_y).sqrt()
    slope = s["xy"] / s["yy"]
    outside = (w * y0.abs() * (~in_top)[None, :, None]).sum((1, 2))
    missed = outside / (w * y0.abs()).sum((1, 2))
    out: dict[str, Any] = {"audited": int(sum(len(c) for c in sample.values()))}
    for name, t in (("r", r), ("slope", slope), ("missed_mass", missed)):
        iv = stats.percentile_interval(t[0], t[1:], level=options.level, n_boot=options.n_boot,
                                       seed=options.seed, n=n)  # fmt: skip
        out[name] = list(iv.item())
    return out


def _audit_weights(n: int, size: int, n_boot: int, g: torch.Generator) -> Tensor:
    """``[1 + n_boot, n]``: the weights of a stratum's ``n`` audited components of ``size``,
    ``size / n`` each for the estimate, then one row per resample by the rescaling bootstrap
    of Rao and Wu (1988): ``n - 1`` draws with replacement, each weight moved from
    ``size / n`` toward the drawn counts by ``sqrt(1 - n / size)``, so that the resamples'
    variance is the stratified estimator's, with its finite-population correction. A census
    (``n == size``) or a single component leaves no audit doubt: the weights stay fixed."""
    scale = size / n
    out = torch.full((1 + n_boot, n), scale, dtype=torch.float64)
    if n < 2 or n >= size:
        return out
    draws = torch.randint(0, n, (n_boot, n - 1), generator=g)
    counts = torch.zeros(n_boot, n, dtype=torch.float64)
    counts.scatter_add_(1, draws, torch.ones_like(draws, dtype=torch.float64))
    lam = math.sqrt(1 - n / size)
    out[1:] = scale * (1 - lam + lam * counts * n / (n - 1))
    return out


def _verdict(kind: str, plan: dict[str, Any]) -> str:
    """The verdict on the intervals (thresholds ``STAND_IN_*``), naming each check that failed."""
    e = plan["estimates"]
    r, slope, missed = e["r"], e["slope"], e["missed_mass"]
    if any(math.isnan(v) for v in (*r, *slope, *missed)):
        return (
            f"linear {kind}: not estimated (too few components audited); read the exact cells "
            "only, or raise the budget."
        )
    said = (
        f"over the whole map, r = {r[0]:.3f} [{r[1]:.3f}, {r[2]:.3f}], slope {slope[0]:.2f} "
        f"[{slope[1]:.2f}, {slope[2]:.2f}], exact mass outside the {len(plan['top'])} components "
        f"checked first {missed[0]:.0%} [{missed[1]:.0%}, {missed[2]:.0%}] (exact on "
        f"{len(plan['top'])} + {e['audited']} audited components"
        + (f", integrated on {len(plan['integrated'])}" if plan["integrated"] else "")
        + ")"
    )
    lo, hi = STAND_IN_SLOPE
    failed = []
    if not (lo <= slope[1] and slope[2] <= hi):
        failed.append(f"its values are off (the slope's interval leaves [{lo:g}, {hi:g}])")
    if missed[2] > STAND_IN_MISSED:
        up_to = f"{missed[2]:.0%}"
        if up_to == f"{STAND_IN_MISSED:.0%}":  # 20.04% is past 20%: say it so
            up_to = f"{missed[2]:.2%}"
        failed.append(
            f"the components it ranks low may hold up to {up_to} of the exact mass "
            f"(past {STAND_IN_MISSED:.0%})"
        )
    if r[1] >= STAND_IN_R and not failed:
        return f"linear {kind} can stand in for exact: {said}."
    if r[1] >= STAND_IN_R:
        return (
            f"linear {kind} ranks as exact does, but {' and '.join(failed)}: {said}; read the "
            "cells marked exact or integrated for values."
        )
    return (
        f"linear {kind} cannot be read on its own (r's lower bound {r[1]:.2f} is under "
        f"{STAND_IN_R:g}): {said}; read the cells marked exact or integrated, and raise the budget "
        "to check more."
    )


Provenance = Literal["exact", "integrated", "linear"]

"""Flags on cells that cannot be right, read off any result (every method): data on the
result (``scores.flags``), shown in the report and in ``compare``'s verdicts.

>>> [f.what for f in scores.flags]           # a clean result has none
[]

Three guards, each stated with its threshold:

1. ``outsized_cell``: a cell (role-aligned mean, ``L1MLP@lives``, or a whole component's
   total, ``L1MLP``) larger in magnitude than ``CELL_LIMIT`` times its component's scale.
   Where the result measured the whole change ``R(W') - R(W)`` (linear results with
   informative scores, integrated informative), the scale is ``|R(W') - R(W)|`` and at least
   the kind's total without that component, ``|Σ totals - total|``, so an outlier does not
   raise its own limit (a component at +76 nats for a change of +13, the rest of its kind
   near it, is flagged). Elsewhere it is the kind's own total ``|Σ totals|`` (the rest alone
   could cancel to nothing). A first-order or patched score many times the change it is part
   of is a sign that the patch left the model's regime (an ablation value from another kind
   of position, see 3), not a finding.
2. ``sink_role``: a role that is the first position of some prompts and a later position of
   others. Without a BOS token the first position is the attention sink (activations that
   dwarf the rest), so a role mixing it with ordinary positions averages unlike things.
   Remedy: ``make_batch(..., prepend_bos=True)`` (the sink is then the BOS in every prompt).
3. ``ablation_across_kinds``: for upstream with a mean or resample ``y*`` drawn from the batch
   (no separate reference), the ablation value at such a role is taken from the other kind of
   position in some prompts: the sink's output replaces an ordinary position's, or the
   reverse. This is what makes linear upstream's cells explode.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

CELL_LIMIT = 5.0
"""A cell is outsized past this multiple of its kind's scale (guard 1)."""

FlagKind = Literal["outsized_cell", "sink_role", "ablation_across_kinds"]


@dataclass(frozen=True)
class Flag:
    """One guard's finding: ``what`` (the guard), ``kind`` (the score kind, or ``None`` for the
    prompts' roles), ``where`` (cell labels or roles) and ``message`` (what to do)."""

    what: FlagKind
    kind: str | None
    where: tuple[str, ...]
    message: str

    def to_dict(self) -> dict[str, Any]:
        return dict(what=self.what, kind=self.kind, where=list(self.where), message=self.message)


def sink_roles(prompt_roles: Sequence[Sequence[str]]) -> list[str]:
    """Roles at the first position of some prompts and at a later position of others."""
    first = {roles[0] for roles in prompt_roles if roles}
    later = {r for roles in prompt_roles for r in roles[1:]}
    return sorted(first & later)


def flags_of(scores: Any) -> tuple[Flag, ...]:
    """Every guard's findings on ``scores`` (a ``ComponentScores``)."""
    out: list[Flag] = []
    mixed = sink_roles(scores.prompt_roles) if scores.per == "token" else []
    if mixed:
        out.append(Flag("sink_role", None, tuple(mixed), (
            f"role{'s' if len(mixed) > 1 else ''} {', '.join(mixed)} "
            f"{'are' if len(mixed) > 1 else 'is'} the first position (the attention sink, no "
            "BOS) in some prompts and a later one in others, so its scores average unlike "
            "positions: make the batch with make_batch(model, pairs, prepend_bos=True)."
        )))  # fmt: skip
        meta = scores.metadata
        borrowed = meta.get("ablation") in ("mean", "resample") and str(
            meta.get("reference", "batch")
        ).startswith("batch")
        if "upstream" in scores.kinds and borrowed:
            out.append(Flag("ablation_across_kinds", "upstream", tuple(mixed), (
                f"upstream's y* ({meta['ablation']} over the batch) at {', '.join(mixed)} is "
                "taken from the first position (the sink) for some prompts and from an ordinary "
                "position for others: pass prepend_bos=True to make_batch, or a reference "
                "batch whose roles match."
            )))  # fmt: skip
    out.extend(_outsized(scores))
    return tuple(out)


def _outsized(scores: Any) -> list[Flag]:
    out = []
    change = _whole_change(scores.metadata)
    for k, kind in enumerate(scores.kinds):
        totals = scores.totals[k].double().nan_to_num(0.0)  # [layer, component]
        if change is None:  # the kind's own total (components that cancel must not flag)
            scale = totals.sum().abs().expand_as(totals)
        else:  # an outlier must not set its own limit: the rest of its kind, the whole change
            scale = (totals.sum() - totals).abs().clamp(min=abs(change))
        limit = CELL_LIMIT * scale
        v = scores.values[k].double().nan_to_num(0.0)
        labels = scores.component_labels
        big = [
            (f"L{layer}{labels[c]}@{scores.position_labels[p]}", float(v[layer, c, p]),
             float(scale[layer, c]))
            for layer, c, p in ((v.abs() > limit[..., None]) & (limit[..., None] > 0))
            .nonzero().tolist()
        ] + [  # a whole component past the limit, though none of its cells is
            (f"L{layer}{labels[c]}", float(totals[layer, c]), float(scale[layer, c]))
            for layer, c in ((totals.abs() > limit) & (limit > 0)).nonzero().tolist()
        ]  # fmt: skip
        if not big:
            continue
        big.sort(key=lambda item: -abs(item[1]))
        where = tuple(label for label, *_ in big[:5])
        _, top, top_scale = big[0]
        what = ("the kind's total" if change is None else
                "the whole change R(W') - R(W) or the rest of the kind's total")  # fmt: skip
        out.append(Flag("outsized_cell", kind, where, (
            f"{len(big)} {kind} cell{'s' if len(big) > 1 else ''} exceed {CELL_LIMIT:g}x "
            f"{what} (largest {where[0]} at {top:+.4g}, "
            f"scale {top_scale:.3g}): not a finding until checked; look for a sink_role flag, "
            f"and confirm with causal_scores(..., kinds=({kind!r},), top_k=...)."
        )))  # fmt: skip
    return out


def _whole_change(meta: dict[str, Any]) -> float | None:
    """``R(W') - R(W)`` (mean over prompts) where the result measured it."""
    check = meta.get("additivity") or {}
    if check.get("exact_change") is not None:
        return float(check["exact_change"])
    change = (meta.get("integrated") or {}).get("R_change")
    return None if change is None else float(change)

"""Token roles (docs/scores.md §6): what each prompt position means, so that prompts of
different lengths are aggregated position by position.

>>> merge_role_orders([("<bos>", "name[-1]", "lives"), ("<bos>", "name[-2]", "name[-1]", "lives")])
('<bos>', 'name[-2]', 'name[-1]', 'lives')

- a ``Pair`` with a ``template`` and ``slots``: template tokens by their text, slot tokens
  right-aligned, ``{name}[-1]`` being the slot's last token (``template_roles``);
- plain pairs: common prefix / differing centre (right-aligned, ``mid[-1]``) / common suffix
  (``aligned_roles``), with a warning where nothing anchors the centre (``warn_alignment``);
- roles of several prompts merged into one order (``merge_role_orders``).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from extractive_lens.tokenizing import token_str


def merge_role_orders(role_lists: Sequence[Sequence[str]]) -> tuple[str, ...]:
    """Merge per-prompt role sequences into one order that respects each prompt's order where
    it can: a new role goes just before the next role its prompt shares with the order so far."""
    order: list[str] = []
    for roles in role_lists:
        pending: list[str] = []
        prev = -1
        for r in roles:
            if r in order:
                at = max(order.index(r), prev + 1)
                order[at:at] = pending
                prev = order.index(r)
                pending = []
            else:
                pending.append(r)
        order[prev + 1 : prev + 1] = pending
    return tuple(order)


def unique(labels: Sequence[str]) -> list[str]:
    seen: dict[str, int] = {}
    out = []
    for lab in labels:
        seen[lab] = seen.get(lab, 0) + 1
        out.append(lab if seen[lab] == 1 else f"{lab}#{seen[lab]}")
    return out


def template_roles(model: Any, pair: Any, ids: list[int], offsets: Any) -> list[str]:
    """Role of each prompt token from a template with ``{slot}`` fields."""
    template, slots = pair.template or "", dict(pair.slots or {})
    pieces: list[tuple[str, str | None]] = []  # (text, slot name or None)
    pos = 0
    for m in re.finditer(r"\{(\w+)\}", template or ""):
        if m.start() > pos:
            pieces.append((template[pos : m.start()], None))
        name = m.group(1)
        if name not in slots:
            raise ValueError(
                f"Template {template!r} has slot {{{name}}} but slots={slots} lacks it."
            )
        pieces.append((slots[name], name))
        pos = m.end()
    if pos < len(template or ""):
        pieces.append((template[pos:], None))
    text = "".join(p for p, _ in pieces)
    if text != pair.prompt:
        raise ValueError(
            f"Prompt {pair.prompt!r} is not template {template!r} filled with {slots}."
        )
    if offsets is None:
        raise ValueError("Template roles need a fast tokenizer (offset mapping).")
    spans, start = [], 0
    for piece, name in pieces:
        spans.append((start, start + len(piece), name))
        start += len(piece)
    owner: list[str | None] = []
    for a, b in offsets:
        mid = a if b == a else a + (1 if text[a : a + 1] == " " and b - a > 1 else 0)
        hit = next((name for s, e, name in spans if s <= mid < e), None)
        owner.append(hit)
    labels: list[str] = []
    for i, name in enumerate(owner):
        if name is None:
            labels.append(token_str(model, ids[i]).strip() or token_str(model, ids[i]))
        else:
            k = sum(1 for j in range(i, len(owner)) if owner[j] == name and same_run(owner, i, j))
            labels.append(f"{{{name}}}[-{k}]")
    return labels


def same_run(owner: list[str | None], i: int, j: int) -> bool:
    return all(owner[t] == owner[i] for t in range(i, j + 1))


def aligned_roles(model: Any, token_lists: list[list[int]]) -> list[list[str]]:
    """Common prefix / differing centre (right-aligned) / common suffix roles."""
    n_min = min(len(t) for t in token_lists)
    prefix = 0
    while prefix < n_min and all(t[prefix] == token_lists[0][prefix] for t in token_lists):
        prefix += 1
    suffix = 0
    while suffix < n_min - prefix and all(
        t[-1 - suffix] == token_lists[0][-1 - suffix] for t in token_lists
    ):
        suffix += 1
    out = []
    for t in token_lists:
        n = len(t)
        labels = [token_str(model, x) for x in t[:prefix]]
        centre = n - prefix - suffix
        labels += [f"mid[-{centre - i}]" for i in range(centre)]
        labels += [token_str(model, x) for x in t[n - suffix :]]
        out.append(unique(labels))
    return out


class AlignmentWarning(UserWarning):
    """Prompts whose positions cannot be lined up so that each means the same in every prompt."""


def warn_alignment(items: list[Any], prompt_roles: list[list[str]]) -> None:
    """Plain prompts are aligned by common prefix / differing middle (right-aligned) / common
    suffix. With neither a common first nor a common last token (prompts of different shapes,
    e.g. two templates), every position is ``mid[-k]`` and averages different words."""
    import warnings

    if len({tuple(r) for r in prompt_roles}) <= 1 or not all(prompt_roles):
        return
    if not all(r[0].startswith("mid[") and r[-1].startswith("mid[") for r in prompt_roles):
        return  # a shared first or last token anchors the middle (an entity of any length)
    warnings.warn(
        f"These {len(items)} prompts share neither their first nor their last token (e.g. "
        f"{items[0].prompt!r} and {items[-1].prompt!r}), so without a template every position "
        "is 'mid[-k]', counted from the end, and averages different words across prompts. Give "
        "Pair(prompt, answer, template=..., slots=...) (positions become template words and slot "
        "tokens such as '{name}[-1]') or roles=, or score prompts of one shape together.",
        AlignmentWarning,
        stacklevel=3,
    )

"""Where a graft applies: which components, at which token positions (docs/grafting.md).

>>> where = Where.of(model, components=["mlp[0:2]", "L1H0"], positions=["{name}", "last"], batch=batch)
>>> where.heads[1], where.mlps
((0,), (0, 1))

A graft runs a component with its finetuned weights ``W + Δ`` only at the chosen positions: its
output there is what it computes with ``W'`` from its input (every key and value it reads
computed with ``W'`` too, as in the exact informative score, docs/scores.md §4), and its base
output everywhere else. Nief et al. swap block outputs per position the same way.

Components: ``None`` or ``"all"`` (every head and MLP), ``"attn"`` / ``"mlp"`` (all heads / all
MLPs), ``"attn[a:b]"``, ``"mlp[a:b]"``, ``"all[a:b]"`` (those of layers ``a..b-1``, Python
slices: ``"all[:2]"``), ``"L3"`` (layer 3's heads and MLP), ``"L3H2"``, ``"L3MLP"``.

Positions, per prompt: ``None`` or ``"all"`` (every position, generated ones included),
``"prompt"`` (every prompt position), ``"last"`` (the last prompt token), ``"generated"`` (every
position after the prompt: teacher-forced answer tokens in a batch, new tokens while
generating), ``"entity"`` (every token of a template slot, roles ``"{...}"``), a role label
(``"{name}"``: every token of that slot; ``"{name}[-1]"``: its last token; ``"lives"``: a template
word), an ``int`` (an index; negative ones count from the prompt's end: ``-1`` is ``"last"``).
A spec starting with ``"-"`` removes those positions: ``("prompt", "-entity", "-last")``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from extractive_lens.batch import PromptBatch
from extractive_lens.types import Component

ComponentSpec = str | Component | Iterable[str | Component] | None
PositionSpec = int | str | Iterable[int | str] | None

_RANGE = re.compile(r"^(attn|mlp|all)\[(-?\d*):(-?\d*)\]$")
_LAYER = re.compile(r"^L(\d+)$")
_WORDS = ("all", "prompt", "last", "generated", "entity")


@dataclass(frozen=True)
class Where:
    """The resolved graft: per layer the grafted heads, the grafted MLPs' layers, and the
    positions as a ``[batch, prompt_pos]`` mask with whether generated positions are grafted.

    ``prompt_lengths`` is ``None`` where no batch was given: the first forward inside the graft
    is then taken as the prompt (``at``)."""

    heads: tuple[tuple[int, ...], ...]
    mlps: tuple[int, ...]
    specs: tuple[tuple[bool, int | str], ...]
    generated: bool
    batch: PromptBatch | None = None

    @classmethod
    def of(
        cls,
        model: Any,
        components: ComponentSpec = None,
        positions: PositionSpec = None,
        batch: PromptBatch | None = None,
    ) -> Where:
        heads, mlps = components_of(model, components)
        specs = position_specs(positions)
        for _, s in specs:
            if isinstance(s, str) and s not in _WORDS and batch is None:
                raise ValueError(
                    f"grafted(positions=[{s!r}]): a role needs the prompts' roles; pass "
                    "batch=make_batch(model, ...) (or positions by index, 'last', 'generated')."
                )
        if batch is not None:
            known = {r for roles in batch.roles for r in roles}
            for _, s in specs:
                if isinstance(s, str) and s not in _WORDS and not _matching(s, known):
                    raise ValueError(
                        f"grafted(positions=[{s!r}]): no prompt of the batch has that role; its "
                        f"roles are {sorted(known)} (or 'entity', 'last', 'prompt', 'generated')."
                    )
        generated = any(not neg and s in ("all", "generated") for neg, s in specs) and not any(
            neg and s in ("all", "generated") for neg, s in specs
        )
        return cls(heads, mlps, specs, generated, batch)

    @property
    def layers(self) -> tuple[int, ...]:
        """Layers with a grafted head or MLP."""
        return tuple(sorted({l for l, h in enumerate(self.heads) if h} | set(self.mlps)))

    def prompt_mask(self, n_rows: int, prompt_len: int) -> Tensor:
        """``[batch, pos]``: the grafted positions among a prompt of ``prompt_len`` tokens (no
        batch given), or among the batch's positions (``prompt_len`` ignored; beyond each row's
        prompt: ``generated``)."""
        b = self.batch
        if b is None:
            lengths = torch.full((n_rows,), prompt_len)
            n_pos = prompt_len
            roles: Sequence[Sequence[str]] = [()] * n_rows
        else:
            lengths, n_pos, roles = b.prompt_lengths.cpu(), b.n_pos, b.roles
        pos = torch.arange(n_pos)[None, :]
        inside = pos < lengths[:, None]
        take = torch.zeros(len(lengths), n_pos, dtype=torch.bool)
        drop = torch.zeros_like(take)
        for neg, s in self.specs:
            m = _spec_mask(s, pos, lengths, roles, n_pos)
            if neg:
                drop |= m
            else:
                take |= m
        return (take & ~drop) | (~inside & self.generated)

    def at(self, n_rows: int, offset: int, n: int, prompt_len: int) -> Tensor:
        """``[batch, n]``: whether positions ``offset .. offset + n - 1`` are grafted, for a
        forward of ``n_rows`` rows whose prompt had ``prompt_len`` tokens."""
        base = self.prompt_mask(1 if self.batch is None else len(self.batch), prompt_len)
        if self.batch is not None and base.shape[0] != n_rows:
            raise ValueError(
                f"grafted(batch=...): the batch has {base.shape[0]} prompts but the model runs "
                f"{n_rows} rows; run the batch's own tokens (batch.tokens) inside the block."
            )
        base = base.expand(n_rows, -1)
        out = torch.full((n_rows, n), self.generated, dtype=torch.bool)
        k = max(0, min(n, base.shape[1] - offset))
        if k:
            out[:, :k] = base[:, offset : offset + k]
        return out


def _matching(spec: str, labels: Iterable[str]) -> set[str]:
    """The role labels a role spec names: itself, and every token of a slot (``"{name}"``
    names ``"{name}[-2]"`` and ``"{name}[-1]"``)."""
    return {r for r in labels if r == spec or r.startswith(spec + "[")}


def _spec_mask(
    s: int | str, pos: Tensor, lengths: Tensor, roles: Sequence[Sequence[str]], n_pos: int
) -> Tensor:
    inside = pos < lengths[:, None]
    if s == "all" or s == "prompt":
        return inside
    if s == "generated":
        return torch.zeros_like(inside)  # beyond the prompt: Where.generated
    if s == "last" or isinstance(s, int):
        k = -1 if s == "last" else int(s)
        i = lengths + k if k < 0 else torch.full_like(lengths, k)
        if bool(((i < 0) | (i >= lengths)).any()):
            raise ValueError(
                f"grafted(positions=[{s!r}]): a prompt has only {int(lengths.min())} tokens; "
                "pick an index inside every prompt."
            )
        return pos == i[:, None]
    out = torch.zeros_like(inside)
    for row, labels in enumerate(roles):
        for j, r in enumerate(labels[: int(lengths[row])]):
            if (s == "entity" and r.startswith("{")) or (s != "entity" and _matching(s, [r])):
                out[row, j] = True
    return out


def position_specs(positions: PositionSpec) -> tuple[tuple[bool, int | str], ...]:
    """``positions`` as ``(excluded, spec)`` pairs (``None``: every position)."""
    if positions is None:
        return ((False, "all"),)
    if isinstance(positions, (int, str)):
        positions = [positions]
    out: list[tuple[bool, int | str]] = []
    for p in positions:
        if isinstance(p, bool) or not isinstance(p, (int, str)):
            raise TypeError(
                f"grafted(positions=...): each position is an int, a role or one of {_WORDS}, "
                f"got {p!r}."
            )
        neg = isinstance(p, str) and p.startswith("-") and not p.lstrip("-").isdigit()
        out.append((neg, p[1:] if neg else p))  # type: ignore[index]
    if out and all(neg for neg, _ in out):
        out.insert(0, (False, "all"))
    return tuple(out)


def components_of(
    model: Any, components: ComponentSpec
) -> tuple[tuple[tuple[int, ...], ...], tuple[int, ...]]:
    """Per layer the grafted heads, and the layers whose MLP is grafted."""
    from extractive_lens import backend as B

    L, H, has_mlp = model.cfg.n_layers, model.cfg.n_heads, B.has_mlp(model)
    heads: list[set[int]] = [set() for _ in range(L)]
    mlps: set[int] = set()
    if components is None or isinstance(components, (str, Component)):
        components = ["all" if components is None else components]  # type: ignore[list-item]
    for c in components:
        if isinstance(c, str) and (m := _RANGE.match(c) or re.match(r"^(attn|mlp|all)$", c)):
            ranged = (m.lastindex or 0) >= 3
            lo = int(m.group(2)) if ranged and m.group(2) else None
            hi = int(m.group(3)) if ranged and m.group(3) else None
            layers = range(L)[lo:hi]
            kind = m.group(1)
        elif isinstance(c, str) and (m := _LAYER.match(c)):
            layers, kind = range(int(m.group(1)), int(m.group(1)) + 1), "all"
            if layers[0] >= L:
                raise ValueError(f"grafted(components=[{c!r}]): the model has {L} layers.")
        else:
            try:
                comp = Component.parse(c)
            except (ValueError, TypeError) as e:
                raise ValueError(
                    f"grafted(components=[{c!r}]): not a component; use 'all', 'attn', 'mlp', "
                    "'attn[0:2]', 'L3', 'L3H2' or 'L3MLP'."
                ) from e
            if comp.layer >= L or (comp.head is not None and comp.head >= H):
                raise ValueError(
                    f"grafted(components=[{c!r}]): the model has {L} layers of {H} heads."
                )
            if comp.head is None:
                if not has_mlp:
                    raise ValueError(f"grafted(components=[{c!r}]): the model has no MLPs.")
                mlps.add(comp.layer)
            else:
                heads[comp.layer].add(comp.head)
            continue
        for l in layers:
            if kind in ("attn", "all"):
                heads[l].update(range(H))
            if kind in ("mlp", "all") and has_mlp:
                mlps.add(l)
    return tuple(tuple(sorted(h)) for h in heads), tuple(sorted(mlps))

"""Graft maps: which (component group × token role) sets of the weight change are sufficient to
recover a finetuned fact, and which are necessary for it (docs/grafting.md).

>>> maps = graft_scores(model, diff, batch)                       # sufficiency
>>> maps.values.shape                                              # [group, role]
torch.Size([5, 4])
>>> lost = graft_scores(model, diff, batch, mode="necessary")     # necessity

For each set S (a group of heads and MLPs at the positions of a role, per prompt):

- **sufficient**: the base model with Δ only on S, ``s_S = (R[W + Δ_S] - R[W]) / (R[W'] - R[W])``;
- **necessary**: the finetuned model with Δ removed from S, ``n_S = (R[W'] - R[W' - Δ_S]) /
  (R[W'] - R[W])``;

the ratios of means over prompts, so the base model is 0 and the full finetune 1 in both. A
graft runs the set's components with the other weights only at the set's positions (their
output there computed with them, keys and values included: ``grafts``); Δ of the "other"
parameters (embeddings, ``b_O``, final norm, unembedding) is never grafted, so that sufficiency
of every component everywhere is the components' share of the change.

The engine: one batched forward per set over the backend's pieces, the outer weights (W, or
``W + Δ`` under ``backend.shifted``) everywhere, and at each layer with grafted components the
heads' change and the MLPs' outputs recomputed with the inner weights
(``backend.graft.heads_change``, ``mlp_grafted``: the same functions the ``grafted`` context
uses on TransformerLens's own forward). Sufficiency of a single (component, token) cell is the
exact informative score of that cell (docs/scores.md §4): ``GraftScores.compare``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from jaxtyping import Float
from torch import Tensor

from extractive_lens import backend as B
from extractive_lens.backend import shift
from extractive_lens.backend.graft import added, heads_change, mlp_grafted
from extractive_lens.batch import PromptBatch
from extractive_lens.grafts import ComponentSpec, PositionSpec, Where
from extractive_lens.interrupts import guarded, one_call_per_model
from extractive_lens.progress import bar
from extractive_lens.rewards import Reward, resolve_reward
from extractive_lens.scoring.options import check_arguments
from extractive_lens.stats import Interval, counts, percentile_interval
from extractive_lens.weight_diff import WeightDiff

Mode = Literal["sufficient", "necessary"]
MODES: tuple[Mode, ...] = ("sufficient", "necessary")

ROLES: dict[str, PositionSpec] = {
    "entity": "entity",
    "last": "last",
    "other prompt": ("prompt", "-entity", "-last"),
    "generated": "generated",
}
"""The default roles: Nief et al.'s entity tokens and last token, the prompt's other tokens, and
the tokens after the prompt (the teacher-forced answer's, where it has more than one token)."""


def default_groups(model: Any) -> dict[str, ComponentSpec]:
    """Every head and MLP, the heads, the MLPs, the early and the late half of the layers."""
    half = model.cfg.n_layers // 2
    groups: dict[str, ComponentSpec] = {"all": "all", "attention": "attn"}
    if B.has_mlp(model):
        groups["MLPs"] = "mlp"
    groups |= {f"layers 0-{half - 1}": f"all[:{half}]",
               f"layers {half}-{model.cfg.n_layers - 1}": f"all[{half}:]"}  # fmt: skip
    return groups


@dataclass(frozen=True)
class GraftScores:
    """A graft map: per (group, role) the normalised score, from per-prompt rewards.

    Attributes:
        values: ``[group, role]`` sufficiency or necessity (base 0, full finetune 1).
        changes: ``[prompt, group, role]`` ``R[W + Δ_S] - R[W]`` (sufficient) or
            ``R[W'] - R[W' - Δ_S]`` (necessary), in the reward's units.
        base, full: ``[prompt]`` the reward with W and with W' (every weight finetuned).
        mean_ranks: ``[group, role]`` the answer's mean rank under each graft (NaN where the
            batch has no single-token candidates); ``metadata`` holds the base's and W''s.
    """

    values: Float[Tensor, "group role"]
    changes: Float[Tensor, "prompt group role"]
    base: Float[Tensor, " prompt"]
    full: Float[Tensor, " prompt"]
    mean_ranks: Float[Tensor, "group role"]
    group_labels: tuple[str, ...]
    role_labels: tuple[str, ...]
    mode: Mode
    metadata: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        shape = (len(self.group_labels), len(self.role_labels))
        if tuple(self.values.shape) != shape or tuple(self.changes.shape[1:]) != shape:
            raise ValueError(f"GraftScores: values {tuple(self.values.shape)} for labels {shape}.")

    def intervals(self, n_boot: int = 1000, seed: int = 0, level: float = 0.95) -> Interval:
        """Each normalised score with its seeded bootstrap interval over prompts
        (``stats``: prompts resampled with replacement, the ratio of means recomputed)."""
        n = self.changes.shape[0]
        w = counts(n, n_boot, seed) / n  # [boot, prompt]
        gain = w @ (self.full - self.base).double()  # [boot]
        ratio = torch.einsum("rb,bgk->rgk", w, self.changes.double()) / gain[:, None, None]
        return percentile_interval(self.values, ratio, level=level, n_boot=n_boot, seed=seed, n=n)

    def to_dataframe(self, n_boot: int = 1000, seed: int = 0) -> Any:
        import pandas as pd

        ci = self.intervals(n_boot, seed)
        lo, hi = ci.low, ci.high
        rows = []
        for i, g in enumerate(self.group_labels):
            for j, r in enumerate(self.role_labels):
                rows.append(dict(group=g, role=r, mode=self.mode, score=float(self.values[i, j]),
                                 low=float(lo[i, j]), high=float(hi[i, j]),
                                 change=float(self.changes[:, i, j].mean()),
                                 mean_rank=float(self.mean_ranks[i, j])))  # fmt: skip
        return pd.DataFrame(rows)

    def plot(self, title: str | None = None) -> Any:
        """A heat map (groups × roles), each cell annotated with its bootstrap interval."""
        from extractive_lens.plotting import graft_heatmap

        return graft_heatmap(self, title=title)

    def compare(self, exact: Any, kind: str = "informative") -> Any:
        """Each cell beside the sum of exact per-token ``kind`` scores (a ``ComponentScores``
        of the same batch, ``causal_scores``) over the cell's components and positions, per
        prompt averaged: equal for a single (component, token) cell (sufficiency of one cell
        is its exact informative score); the gap elsewhere is what the cells' effects do not
        add up to. Columns: group, role, graft change, summed score, their ratio."""
        import pandas as pd

        sets = self.metadata["sets"]
        per = exact.prompt_values[exact.kinds.index(kind)]
        rows = []
        for i, g in enumerate(self.group_labels):
            for j, r in enumerate(self.role_labels):
                s = sets[g][r]
                total = _summed(exact, kind, s["components"], s["positions"], per)
                change = float(self.changes[:, i, j].mean())
                rows.append(dict(group=g, role=r, graft=change, summed=total,
                                 ratio=change / total if total else float("nan")))  # fmt: skip
        return pd.DataFrame(rows)


def _summed(exact: Any, kind: str, comps: list[tuple[int, int | None]],
            positions: list[list[int]], per: Any) -> float:  # fmt: skip
    """Σ over a set's components and each prompt's positions of the per-prompt exact scores
    (``[batch, layer, component, pos]``), averaged over prompts."""
    labels = exact.component_labels
    H = len(labels) - (1 if labels[-1] == "MLP" else 0)
    total = torch.zeros(per.shape[0], dtype=torch.float64)
    for layer, head in comps:
        c = H if head is None else head
        for row, pos in enumerate(positions):
            total[row] += per[row, layer, c, pos].double().sum()
    return float(total.mean())


def graft_scores(
    model: Any,
    diff: WeightDiff,
    batch: PromptBatch,
    *,
    groups: Mapping[str, ComponentSpec] | Sequence[str] | None = None,
    roles: Mapping[str, PositionSpec] | Sequence[str | int] | None = None,
    mode: Mode = "sufficient",
    reward: str | Reward | None = None,
    show_progress: bool | None = None,
) -> GraftScores:
    """Sufficiency or necessity of the weight change on each (component group × role) set.

    Args:
        groups: name -> components (``grafts``: ``"attn"``, ``"mlp[0:2]"``, ``"L3H2"``...),
            or a list of such strings, each named by itself; default ``default_groups(model)``: all, attention, MLPs, early and late halves.
        roles: name -> positions (``grafts``: ``"entity"``, ``"last"``, ``"{name}[-1]"``,
            ``("prompt", "-entity", "-last")``...), or a list of strings and indices, each named
            by itself; default ``ROLES``.
        mode: ``"sufficient"`` (Δ only on the set) or ``"necessary"`` (Δ everywhere but on it).
        reward: as in ``linear_scores`` (default ``answer_logprob``).

    Cost: two forwards (W, W') and one per set, each over the whole batch, with the grafted
    layers' attention and MLPs run once more (docs/benchmarks.md).
    """
    check_arguments("graft_scores", model, diff, batch)
    if mode not in MODES:
        raise ValueError(f"graft_scores(mode={mode!r}): choose 'sufficient' or 'necessary'.")
    return _graft_scores(model, diff, batch, groups, roles, mode, reward, show_progress)


def _named(what: str, given: Any) -> dict[str, Any]:
    """``groups=`` / ``roles=`` as name -> spec: a mapping as given; a spec, or a list of specs
    that are strings or indices, named by themselves (``["attn", "mlp"]``)."""
    if isinstance(given, Mapping):
        return dict(given)
    items = [given] if isinstance(given, (str, int)) else given
    if isinstance(items, (list, tuple)) and all(isinstance(i, (str, int)) for i in items):
        return {str(i): i for i in items}
    raise TypeError(
        f"graft_scores({what}={given!r}): pass a dict of name -> spec, e.g. "
        + ("{'early attention': 'attn[:2]', 'L3MLP': 'L3MLP'}" if what == "groups"
           else "{'entity': 'entity', 'not last': ('prompt', '-last')}")
        + ", or a list of specs named by themselves."
    )  # fmt: skip


@one_call_per_model
def _graft_scores(model: Any, diff: WeightDiff, batch: PromptBatch,
                  groups: Mapping[str, ComponentSpec] | Sequence[str] | None,
                  roles: Mapping[str, PositionSpec] | Sequence[str | int] | None, mode: Mode,
                  reward: str | Reward | None, show_progress: bool | None) -> GraftScores:  # fmt: skip
    from extractive_lens.finetuning import ranks_from_logits
    from extractive_lens.interrupts import refuse_attached_hooks

    B.check_scorable(model)
    refuse_attached_hooks(model, "graft_scores")
    diff.check_compatible(model)
    reward_fn, reward_name = resolve_reward(reward)
    groups = _named("groups", default_groups(model) if groups is None else groups)
    roles = _named("roles", ROLES if roles is None else roles)
    sets = {
        g: {r: Where.of(model, c, p, batch) for r, p in roles.items()} for g, c in groups.items()
    }
    single = batch.candidates is not None and not (
        batch.candidate_tokens is not None and any(len(c) > 1 for row in batch.candidate_tokens for c in row)
    )  # fmt: skip

    def measure(logits: Tensor) -> tuple[Tensor, float]:
        rank = float(ranks_from_logits(logits, batch).float().mean()) if single else float("nan")
        return reward_fn(logits, batch).double().cpu(), rank

    outer: Callable[[], Any] = contextlib.nullcontext
    inner: Callable[[], Any] = lambda: shift.shifted(model, diff)  # noqa: E731
    if mode == "necessary":
        outer, inner = inner, lambda: shift.unshifted(model)
    G, R = len(groups), len(roles)
    changes = torch.zeros(len(batch), G, R, dtype=torch.float64)
    ranks = torch.full((G, R), float("nan"), dtype=torch.float64)
    with guarded(model), torch.no_grad(), shift.reusing():
        base, base_rank = measure(forward(model, batch, None, contextlib.nullcontext, inner))
        full, full_rank = measure(
            forward(model, batch, None, lambda: shift.shifted(model, diff), inner)
        )
        start = base if mode == "sufficient" else full
        cells = [(i, j) for i in range(G) for j in range(R)]
        for i, j in bar(cells, desc=f"graft_scores ({mode})", enabled=show_progress):
            where = sets[list(groups)[i]][list(roles)[j]]
            r, ranks[i, j] = measure(forward(model, batch, where, outer, inner))
            changes[:, i, j] = r - start if mode == "sufficient" else start - r
    gain = (full - base).mean()
    meta = dict(
        reward=reward_name, mode=mode, base_mean_rank=base_rank, full_mean_rank=full_rank,
        n_prompts=len(batch), passes=2 + G * R, gain=float(gain),
        sets={g: {r: _described(w, batch) for r, w in by_role.items()} for g, by_role in sets.items()},
    )  # fmt: skip
    return GraftScores(changes.mean(0) / gain, changes, base, full, ranks, tuple(groups),
                       tuple(roles), mode, meta)  # fmt: skip


def _described(where: Where, batch: PromptBatch) -> dict[str, Any]:
    """A set as data: its components (layer, head or None) and each prompt's positions."""
    mask = where.prompt_mask(len(batch), batch.n_pos) & batch.position_mask.cpu()
    comps = [(l, h) for l, hs in enumerate(where.heads) for h in hs] + [
        (l, None) for l in where.mlps
    ]
    return dict(components=comps, positions=[row.nonzero()[:, 0].tolist() for row in mask])


def forward(model: Any, batch: PromptBatch, where: Where | None, outer: Callable[[], Any],
            inner: Callable[[], Any]) -> Tensor:  # fmt: skip
    """The logits of ``batch`` with the weights of ``outer`` everywhere except on the set
    ``where`` (its components at its positions), which computes with those of ``inner``."""
    tokens = batch.tokens.to(model.cfg.device)
    has_mlp = B.has_mlp(model)
    with outer():
        x = B.embed(model, tokens)
        mask = None if where is None else where.prompt_mask(len(batch), batch.n_pos).to(x.device)
        for layer in range(model.cfg.n_layers):
            x = B.on_block(model, layer, x)
            out, cap = B.attention(model, layer, x, ("z",))
            heads = () if where is None else where.heads[layer]
            if heads and mask is not None:
                change, _ = heads_change(
                    model, layer, x, cap["z"], B.W_O(model, layer), heads, inner
                )
                out = added(out, change, mask)
            mid = x + out
            if has_mlp:
                m_in = B.mlp_input(model, x, mid)
                m_out = B.mlp(model, layer, m_in)
                if where is not None and mask is not None and layer in where.mlps:
                    m_out = mlp_grafted(model, layer, m_in, m_out, mask, inner)
                mid = mid + m_out
            x = mid
        return B.unembed(model, x)


__all__: Sequence[str] = ("GraftScores", "graft_scores", "default_groups", "ROLES")

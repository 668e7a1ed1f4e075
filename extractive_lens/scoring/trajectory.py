"""Scores along a finetune's trajectory (``extractive_lens.trajectory``; docs/trajectory.md).

>>> maps = trajectory_scores(base, traj, batch)       # linear, D_k at every checkpoint  # doctest: +SKIP
>>> along = trajectory_integrated(base, traj, batch)  # informative, along the path     # doctest: +SKIP
>>> along.metadata["integrated"]["completeness"]      # how far Σ misses R(W_T) - R(W_0)  # doctest: +SKIP

Two views of a finetune that is a path ``W_0 → W_1 → … → W_T`` rather than one straight line:

- **Maps over time** (``trajectory_scores``): any scoring method of ``D_k = W_k - W_0`` at each
  checkpoint ``k``: how much of the change made by then each component carries.
- **The trajectory integral** (``trajectory_integrated``, as Loss Change Allocation does per
  parameter): segment ``k`` runs ``W_{k-1} → W_k`` along ``Δ_k = W_k - W_{k-1}``. At each
  quadrature node ``x_i`` of the segment, the linear informative split (per component and
  token, and "other") of ``Δ_k`` at the model ``W_{k-1} + x_i Δ_k``: its ``ŷ`` and its
  forward-mode derivative along ``Δ_k`` both there. Segment ``k``'s score is
  ``Σ_i w_i · Ī(W_{k-1} + x_i Δ_k; Δ_k)``: the straight-line integrated informative score of the
  segment. Summed over segments they add up to ``R(W_T) - R(W_0)`` (the fundamental theorem of
  calculus on each segment); the completeness error is recorded, per segment and in all.
  Beside it ``integrated_scores(base, traj.final, batch, kinds="informative")`` integrates
  the straight line ``W_0 → W_T``: both add up to the same change, and where they differ per
  component, the component took up (or gave back) its share along the way.

The model's weights are never written: each node's point ``D_{k-1} + x_i Δ_k`` is a diff
supplied to the pieces while they run (``backend.shifted``), its tensors formed a layer at a
time from the checkpoints' files, and the tangent ``Δ_k`` is read the same way.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal, cast

import torch
from torch import Tensor

from extractive_lens import backend as B
from extractive_lens.backend import shift
from extractive_lens.batch import PromptBatch
from extractive_lens.interrupts import guarded, one_call_per_model
from extractive_lens.results import ComponentScores
from extractive_lens.rewards import Reward
from extractive_lens.scoring.assemble import assemble, base_metadata, plan_chunks, progress
from extractive_lens.scoring.integrated import DEFAULT_STEPS, IntegratedOptions, Rule, nodes
from extractive_lens.scoring.kinds import KINDS
from extractive_lens.scoring.runs import forward_run, head_grad, wide
from extractive_lens.trajectory import Trajectory
from extractive_lens.types import SCORE_KINDS, ScoreKind

COMPLETENESS_TARGET = 0.02
"""The completeness error the trajectory integral is held to with its default nodes (4
Gauss–Legendre nodes per segment): docs/trajectory.md reports it measured."""


@dataclass(frozen=True)
class TrajectoryScores:
    """Scores along a trajectory: one ``ComponentScores`` per checkpoint (``what="checkpoint"``:
    scores of ``D_k``) or per segment (``what="segment"``: segment ``k``'s share of the
    trajectory integral).

    Attributes:
        scores: one result per checkpoint ``1 … T`` or segment ``1 … T``.
        steps, epochs: optimiser steps and epochs at each checkpoint (a segment's end).
        what: ``"checkpoint"`` or ``"segment"``.
        metadata: the method, and for segments the completeness errors and the rewards
            ``R(W_k)`` (mean over prompts) at ``k = 0 … T``.
    """

    scores: tuple[ComponentScores, ...]
    steps: tuple[int, ...]
    epochs: tuple[float, ...]
    what: Literal["checkpoint", "segment"]
    metadata: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not (len(self.scores) == len(self.steps) == len(self.epochs)) or not self.scores:
            raise ValueError(
                f"TrajectoryScores needs one result per time: {len(self.scores)} results, "
                f"{len(self.steps)} steps, {len(self.epochs)} epochs."
            )

    @property
    def kinds(self) -> tuple[ScoreKind, ...]:
        return self.scores[0].kinds

    def layer_map(self, kind: ScoreKind = "informative", part: str = "all") -> Any:
        """``DataFrame[epoch x layer]``: each layer's score (summed over its components and
        positions, mean over prompts) at each time; ``part``: ``"all"``, ``"heads"`` or
        ``"mlp"``."""
        import pandas as pd

        if part not in ("all", "heads", "mlp"):
            raise ValueError(f"part must be 'all', 'heads' or 'mlp', got {part!r}")
        rows = []
        for s in self.scores:
            t = s.totals[s.kinds.index(kind)]  # [layer, component]
            labels = s.component_labels
            keep = [
                i for i, c in enumerate(labels) if part == "all" or (c == "MLP") == (part == "mlp")
            ]
            rows.append(t[:, keep].sum(-1).tolist())
        layers = [f"L{layer}" for layer in range(len(rows[0]))]
        return pd.DataFrame(rows, index=pd.Index(self.epochs, name="epoch"), columns=layers)

    def curve(self, component: str, kind: ScoreKind = "informative") -> Any:
        """``Series[epoch]``: one component's whole score (``"L3MLP"``, ``"L2H1"``) over time."""
        import pandas as pd

        from extractive_lens.types import parse_components

        s = self.scores[0]
        L, C = s.totals.shape[1:]
        has_mlp = "MLP" in s.component_labels
        (c,) = parse_components([component], L, C - has_mlp, has_mlp) or ()
        col = C - 1 if c.is_mlp else int(cast(int, c.head))
        values = [float(r.totals[r.kinds.index(kind), c.layer, col]) for r in self.scores]
        return pd.Series(values, index=pd.Index(self.epochs, name="epoch"), name=component)

    def to_dataframe(self) -> Any:
        """One row per (time, kind, layer, component): whole-component scores, mean over
        prompts."""
        import pandas as pd

        rows = []
        for step, epoch, s in zip(self.steps, self.epochs, self.scores):
            for k, kind in enumerate(s.kinds):
                for layer in range(s.totals.shape[1]):
                    for c, label in enumerate(s.component_labels):
                        v = float(s.totals[k, layer, c])
                        rows.append((step, epoch, kind, layer, label, v))
        return pd.DataFrame(rows, columns=["step", "epoch", "kind", "layer", "component", "score"])

    def cumulative(self) -> TrajectoryScores:
        """Segments summed up to each checkpoint: ``k``'s result adds up to ``R(W_k) - R(W_0)``
        (``what="checkpoint"``; the checkpoints' own maps are ``trajectory_scores``)."""
        if self.what != "segment":
            raise ValueError("cumulative() sums segments: call it on trajectory_integrated(...).")
        out, run = [], None
        for s in self.scores:
            run = s if run is None else _summed(run, s)
            out.append(run)
        return replace(self, scores=tuple(out), what="checkpoint")

    @property
    def total(self) -> ComponentScores:
        """The trajectory-integrated score: every segment's share summed (``what="segment"``)."""
        if self.what != "segment":
            raise ValueError(
                "total sums the segments of trajectory_integrated(...); maps of checkpoints "
                "(trajectory_scores) are not additive over time: take scores[-1] for the last."
            )
        total = self.cumulative().scores[-1]
        meta = {**total.metadata, "integrated": {**self.metadata["integrated"]}}
        return replace(total, metadata=meta)

    def plot(self, kind: ScoreKind = "informative", part: str = "all") -> Any:
        """The time x layer heat map of ``kind`` (``trajectory_plots.layer_map``)."""
        from extractive_lens.trajectory_plots import layer_map

        return layer_map(self, kind, part)

    # ------------------------------------------------------------------ parts and files
    @classmethod
    def join(cls, *parts: TrajectoryScores) -> TrajectoryScores:
        """Parts of one trajectory's scores (``checkpoints=`` / ``segments=`` of the same
        trajectory, prompts and options, each computed in its own job) as one result, in
        training order. Segments: the completeness errors are those of the joined segments
        (the same as one call over them), from each part's per-prompt rewards.

        >>> along = TrajectoryScores.join(TrajectoryScores.load("seg1-4"),
        ...                               TrajectoryScores.load("seg5-8"))  # doctest: +SKIP
        """
        if not parts or not all(isinstance(p, TrajectoryScores) for p in parts):
            raise TypeError("TrajectoryScores.join takes one or more TrajectoryScores.")
        what = {p.what for p in parts}
        if len(what) != 1:
            raise ValueError(
                "TrajectoryScores.join: the parts mix checkpoint maps and segments; join the "
                "results of trajectory_scores and of trajectory_integrated separately."
            )
        rows = sorted((step, epoch, s) for p in parts
                      for step, epoch, s in zip(p.steps, p.epochs, p.scores))  # fmt: skip
        steps = [r[0] for r in rows]
        if len(set(steps)) != len(steps):
            raise ValueError(
                f"TrajectoryScores.join: steps {steps} hold one checkpoint or segment twice; "
                "pass parts that cover distinct checkpoints (segments)."
            )
        scores = tuple(r[2] for r in rows)
        meta = {**parts[0].metadata}
        if parts[0].what == "segment":
            meta["integrated"] = info = _joined_info([p.metadata["integrated"] for p in parts],
                                                     scores)  # fmt: skip
            scores = tuple(
                replace(s, metadata={**s.metadata,
                                     "integrated": {**info, "segment": s.metadata["integrated"]["segment"]}})
                for s in scores
            )  # fmt: skip
        elif "checkpoints" in meta:
            meta["checkpoints"] = sorted(
                k for p in parts for k in p.metadata.get("checkpoints", ())
            )
        return cls(scores, tuple(steps), tuple(r[1] for r in rows), parts[0].what, meta)

    def save(self, path: str | Path) -> Path:
        """``path`` (a directory): ``trajectory_scores.json`` (times, metadata) and one
        ``ComponentScores`` directory per checkpoint or segment (``0``, ``1``, …)."""
        from extractive_lens.files import write_text_atomic
        from extractive_lens.types import jsonable

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        for i, s in enumerate(self.scores):
            s.save(path / str(i))
        info = {"format": _FORMAT, "what": self.what, "steps": list(self.steps),
                "epochs": list(self.epochs), "metadata": jsonable(self.metadata)}  # fmt: skip
        write_text_atomic(path / _MANIFEST, json.dumps(info, indent=1))
        return path

    @classmethod
    def load(cls, path: str | Path) -> TrajectoryScores:
        """A directory ``TrajectoryScores.save`` wrote."""
        from extractive_lens.files import read_json

        path = Path(path)
        fix = "pass a directory written by TrajectoryScores.save(), or score the trajectory again."
        info = read_json(path / _MANIFEST, fix=fix)
        if not isinstance(info, dict) or info.get("format") != _FORMAT:
            raise ValueError(f"{path / _MANIFEST} is not a TrajectoryScores manifest: {fix}")
        steps = info["steps"]
        scores = tuple(ComponentScores.load(path / str(i)) for i in range(len(steps)))
        return cls(scores, tuple(steps), tuple(info["epochs"]), info["what"], info["metadata"])


_FORMAT = "extractive_lens.TrajectoryScores"
_MANIFEST = "trajectory_scores.json"


def _joined_info(infos: list[dict[str, Any]], scores: Sequence[ComponentScores]) -> dict[str, Any]:
    """The ``metadata["integrated"]`` of joined segments: the parts' nodes (which must agree)
    and the completeness errors of all their segments, recomputed from per-prompt shares."""
    same = ("steps", "rule", "segments_total", "trajectory_steps")
    for key in same:
        if any(i.get(key) != infos[0].get(key) for i in infos):
            raise ValueError(
                f"TrajectoryScores.join: the parts differ in {key!r} "
                f"({[i.get(key) for i in infos]}); join parts of one trajectory_integrated "
                "setting (the same trajectory, nodes and rule)."
            )
    R = {int(j): torch.tensor(r, dtype=torch.float64) for i in infos
         for j, r in i["prompt_rewards"].items()}  # fmt: skip
    shares = {}
    for s in scores:
        t = s.prompt_totals[s.kinds.index("informative")].double().sum((1, 2))
        shares[int(s.metadata["integrated"]["segment"])] = t + (
            0.0 if s.other is None else s.other.double()
        )
    return {**infos[0], **_completeness(shares, R, int(infos[0]["segments_total"]))}


def _summed(a: ComponentScores, b: ComponentScores) -> ComponentScores:
    """Two results of the same prompts, added cell by cell (and their "other" shares)."""
    other = None if a.other is None or b.other is None else a.other + b.other
    return replace(
        b, values=a.values + b.values, totals=a.totals + b.totals,
        prompt_values=a.prompt_values + b.prompt_values,
        prompt_totals=a.prompt_totals + b.prompt_totals, other=other,
    )  # fmt: skip


def trajectory_scores(
    model: Any,
    trajectory: Trajectory,
    batch: PromptBatch,
    *,
    method: str = "linear",
    kinds: Sequence[ScoreKind] | ScoreKind = SCORE_KINDS,
    checkpoints: Sequence[int] | None = None,
    show_progress: bool | None = None,
    **options: Any,
) -> TrajectoryScores:
    """Maps over time: ``method``'s scores of ``D_k = W_k - W_0`` at every checkpoint.

    Args:
        method: a method of ``scoring.methods.METHODS``: ``"linear"``, ``"causal"`` or
            ``"integrated"`` (the straight line to each checkpoint).
        kinds: the score kinds.
        checkpoints: which ``k`` in ``1 … T`` (default: all); a long trajectory can be scored
            a few checkpoints per job, each part saved, and the parts joined
            (``TrajectoryScores.join``).
        options: the method's own options (``reward``, ``per``, ``steps`` …).

    One checkpoint's Δ is read at a time (formed a layer at a time from its files).
    """
    from extractive_lens.scoring.methods import method as method_entry

    fn = method_entry(method).engine  # refuses a method the table lacks, listing its methods
    _check(trajectory)
    ks = _chosen(checkpoints, len(trajectory), "checkpoints")
    out = []
    for k in progress(ks, len(ks), "checkpoints", show_progress):
        out.append(
            fn(model, trajectory.diff(k), batch, kinds=kinds, show_progress=False, **options)
        )
    return TrajectoryScores(tuple(out), tuple(trajectory.steps[k] for k in ks),
                            tuple(trajectory.epochs[k] for k in ks), "checkpoint",
                            {"method": method, "checkpoints": ks})  # fmt: skip


def _chosen(which: Sequence[int] | None, T: int, name: str) -> list[int]:
    """``which`` (checkpoints or segments, each in ``1 … T``) sorted, checked; ``None``: all."""
    if which is None:
        return list(range(1, T + 1))
    ks = list(which)
    if not ks or any(isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= T for k in ks):
        raise ValueError(
            f"{name}={ks!r}: pass a non-empty list of integers in 1..{T} (this trajectory has "
            f"{T} checkpoints after the base), or None for all."
        )
    if len(set(ks)) != len(ks):
        raise ValueError(f"{name}={ks!r} names one twice: pass each at most once.")
    return sorted(ks)


def _check(trajectory: Any) -> None:
    if not isinstance(trajectory, Trajectory):
        raise TypeError(
            f"trajectory must be a Trajectory, got {type(trajectory).__name__}: record one with "
            "finetune(..., keep='epochs') and Trajectory.load(diff.metadata['trajectory'])."
        )


def trajectory_integrated(
    model: Any,
    trajectory: Trajectory,
    batch: PromptBatch,
    *,
    steps: int = DEFAULT_STEPS,
    rule: Rule = "gauss",
    reward: str | Reward | None = None,
    segments: Sequence[int] | None = None,
    batch_size: int | None = 16,
    show_progress: bool | None = None,
    compute_dtype: torch.dtype | str | None = None,
) -> TrajectoryScores:
    """The informative score integrated along the training trajectory (module docstring).

    Args:
        steps: quadrature nodes per segment (default 4).
        rule: ``"gauss"`` (Gauss–Legendre) or ``"midpoint"``.
        segments: which segments ``k`` in ``1 … T`` (default: all). A long trajectory on a
            large model can be integrated a few segments per job, each part saved
            (``TrajectoryScores.save``), and the parts joined (``TrajectoryScores.join``: the
            same result and completeness error as one call).
        reward, batch_size, show_progress, compute_dtype: as in ``integrated_scores``.

    Returns one result per segment (``.total``: their sum, ``.cumulative()``: summed to each
    checkpoint). ``metadata["integrated"]`` holds the nodes, the completeness error in all
    (``Σ_p |Σ_k (Σ_{c,t} Ĩ + other) - (R(W_T) - R(W_0))|_p / Σ_p |R(W_T) - R(W_0)|_p``; over
    the chosen segments, their changes of ``R`` summed) and per segment, and the mean reward at
    every checkpoint (``None`` where no chosen segment starts or ends).
    """
    _check(trajectory)
    chosen = _chosen(segments, len(trajectory), "segments")
    options = IntegratedOptions(
        kinds=("informative",), steps=steps, rule=rule, reward=reward, batch_size=batch_size,
        show_progress=show_progress, compute_dtype=compute_dtype,
    )  # fmt: skip
    return _integrated(model, trajectory, batch, options, chosen)


@one_call_per_model
def _integrated(
    model: Any, trajectory: Trajectory, batch: PromptBatch, options: IntegratedOptions,
    chosen: list[int],
) -> TrajectoryScores:  # fmt: skip
    from extractive_lens.scoring.options import prepare

    final = trajectory.final
    cdt = prepare("trajectory_integrated", model, final, batch, options)
    scored, plan = plan_chunks(batch, None, options.batch_size)
    xs, ws = nodes(int(options.steps), options.rule)
    per_seg: dict[int, list[Tensor]] = {k: [] for k in chosen}
    other: dict[int, list[Tensor]] = {k: [] for k in chosen}
    rewards: dict[int, list[Tensor]] = {}  # checkpoint -> R(W_k) per chunk
    with guarded(model), B.standard_flags(model), B.computing_in(model, cdt):
        bar = progress(range(len(plan) * len(chosen)), len(plan) * len(chosen), "trajectory",
                       options.show_progress)  # fmt: skip
        it = iter(bar)
        for chunk, _ in plan:
            at: dict[int, Tensor] = {}
            for k in chosen:
                next(it, None)
                if k - 1 not in at:  # the segment's start, unless the previous one ended there
                    at[k - 1] = _reward_at(model, trajectory, k - 1, chunk, options)
                vals, o, at[k] = _segment(model, trajectory, k, chunk, options, xs, ws)
                per_seg[k].append(vals)
                other[k].append(o)
            for j, r in at.items():
                rewards.setdefault(j, []).append(r)
    R = {j: torch.cat(r) for j, r in rewards.items()}
    shares = {k: torch.cat([v.sum((1, 2, 3)) for v in per_seg[k]]) + torch.cat(other[k])
              for k in chosen}  # fmt: skip
    T = len(trajectory)
    info = {
        "path": "trajectory", "steps": int(options.steps), "rule": options.rule, "nodes": xs,
        "weights": ws, **_completeness(shares, R, T), "segments_total": T,
        "trajectory_steps": trajectory.steps, "trajectory_epochs": trajectory.epochs,
    }  # fmt: skip
    out = []
    for k in chosen:
        meta = base_metadata(model, trajectory.step(k), options, batch, cdt,
                             method="integrated", per="token")  # fmt: skip
        meta["integrated"] = {**info, "segment": k}
        out.append(assemble(model, scored, ("informative",), [v[None] for v in per_seg[k]],
                            [v.sum(-1)[None] for v in per_seg[k]], method="integrated",
                            other=other[k], metadata=meta))  # fmt: skip
    return TrajectoryScores(tuple(out), tuple(trajectory.steps[k] for k in chosen),
                            tuple(trajectory.epochs[k] for k in chosen), "segment",
                            {"method": "trajectory_integrated", "integrated": info})  # fmt: skip


def _completeness(shares: dict[int, Tensor], R: dict[int, Tensor], T: int) -> dict[str, Any]:
    """How far the segments' shares (per prompt, with "other") miss the changes of ``R`` they
    integrate: over all chosen segments together and per segment; and the rewards (mean over
    prompts, and per prompt) at the checkpoints ``0 … T`` they touch."""
    ks = sorted(shares)

    def error(share: Tensor, change: Tensor) -> float:
        return float((share - change).abs().sum()) / max(float(change.abs().sum()), 1e-300)

    change = sum((R[k] - R[k - 1] for k in ks), torch.zeros_like(R[ks[0]]))
    return {
        "segments": ks,
        "completeness": {"informative": error(torch.stack([shares[k] for k in ks]).sum(0), change)},
        "segment_completeness": [error(shares[k], R[k] - R[k - 1]) for k in ks],
        "R_change": float(change.mean()),
        "rewards": [float(R[j].mean()) if j in R else None for j in range(T + 1)],
        "prompt_rewards": {str(j): R[j].tolist() for j in sorted(R)},
    }


def _reward_at(
    model: Any, trajectory: Trajectory, k: int, chunk: PromptBatch, options: IntegratedOptions
) -> Tensor:
    """``R(W_k)`` per prompt of ``chunk`` (``k = 0``: the base itself)."""
    with torch.no_grad(), B.shifted(model, trajectory.diff(k)) if k else nullcontext():
        return wide(cast(Tensor, forward_run(model, chunk, options.reward_fn).reward))


def _segment(
    model: Any, trajectory: Trajectory, k: int, chunk: PromptBatch, options: IntegratedOptions,
    xs: list[float], ws: list[float],
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """Segment ``k``'s informative scores ``[batch, layer, comp, pos]``, its "other" share
    ``[batch]`` and ``R(W_k)``: the linear informative split of ``Δ_k`` at each node's model
    ``W_{k-1} + x_i Δ_k``, weighted by ``w_i``."""
    from extractive_lens.scoring.linear import LinearChunk, LinearOptions

    lin_options = LinearOptions(kinds=("informative",), reward=options.reward_fn,
                                ablation=options.ablation, rows=None)  # fmt: skip
    step = trajectory.step(k)  # one object for every node: its Δ is read once (reusing)
    total = other = None
    with B.reusing():
        for x, w in zip(xs, ws):
            # the node's point in a store of its own, not the segment's (``reusing`` would keep
            # every node's point until the segment ends), a layer at a time whatever the
            # model's size (``small=False``: a point serves one pass pair; whole, it and
            # ``W + point`` would be two more Δ-sized tensors): one step held at a time
            point = shift.Shift(model, trajectory.point(k, x), 1.0, small=False)
            with shift.within(point):
                run = forward_run(model, chunk, options.reward_fn, grad=True)
                g_z = [head_grad(wide(g), W) for g, W in zip(run.g_attn, run.W_O)]
                c = LinearChunk(model, step, step.deltas, chunk, run, [], lin_options, None, g_z)
                inf = KINDS["informative"].linear(c)
            o = cast(Tensor, c.other)
            total = w * inf if total is None else total + w * inf
            other = w * o if other is None else other + w * o
            del point, run, c
    end = _reward_at(model, trajectory, k, chunk, options)
    mask = chunk.position_mask.to(cast(Tensor, total).device)
    return cast(Tensor, total) * mask[:, None, None, :], cast(Tensor, other), end


__all__: Sequence[str] = ("TrajectoryScores", "trajectory_scores", "trajectory_integrated")

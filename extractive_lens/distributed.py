"""Data-parallel scoring on ``torch.distributed`` (launch with ``torchrun`` or ``accelerate launch``).

    torchrun --nproc_per_node 8 -m extractive_lens.cli score --base DIR --finetuned DIR --data F --distributed

>>> scores = distributed_scores("linear", model, diff, batch)  # in every process  # doctest: +SKIP

Each process holds one model replica. Prompts are sharded deterministically in contiguous
blocks; every process scores its block (``y*`` still comes from the whole dataset) and the
per-prompt scores are gathered in the original order, so every rank returns the same
``ComponentScores`` as a single process would (up to float rounding from batch composition).
With few prompts, exact scores shard layers instead. Outside an initialised process group this
is just the single-process call.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Literal

import torch

from extractive_lens.batch import PromptBatch
from extractive_lens.record import describe, differences, function_record
from extractive_lens.results import ComponentScores, aggregate_by_role
from extractive_lens.scoring.assemble import prompts_digest


def shard_rows(n: int, rank: int, world: int) -> list[int]:
    """Contiguous, deterministic, balanced blocks: rank r gets ``[r*n/W, (r+1)*n/W)``."""
    return list(range(rank * n // world, (rank + 1) * n // world))


def init_from_env(
    device: str | None = None, timeout_s: float | None = None
) -> tuple[int, int, str]:
    """Initialise the default process group from ``torchrun``'s environment (gloo on CPU, NCCL on
    GPU); returns ``(rank, world_size, device)``.

    ``timeout_s`` (default ``$EXTRACTIVE_LENS_DIST_TIMEOUT`` or 600 s): how long a collective waits
    for a hung or crashed rank before every rank fails, instead of waiting forever.
    """
    import datetime
    import os

    import torch.distributed as dist

    local = int(os.environ.get("LOCAL_RANK", "0"))
    if device is None:
        device = f"cuda:{local}" if torch.cuda.is_available() else "cpu"
    if not dist.is_initialized():
        seconds = (
            timeout_s
            if timeout_s is not None
            else float(os.environ.get("EXTRACTIVE_LENS_DIST_TIMEOUT", 600))
        )
        dist.init_process_group(
            backend="nccl" if device.startswith("cuda") else "gloo",
            timeout=datetime.timedelta(seconds=seconds),
        )
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    return dist.get_rank(), dist.get_world_size(), device


def shutdown(*, wait: bool = True) -> None:
    """Destroy the default process group, after every rank reaches this point (``wait``).

    Without the barrier a rank that finishes first tears down its gloo connections while a peer
    is still shutting down, which can abort the peer (``terminate called without an active
    exception``) after its results are written. Use ``wait=False`` on an error path, where a
    peer may never arrive. A no-op outside an initialised group.
    """
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        if wait:
            dist.barrier()
        dist.destroy_process_group()


@contextmanager
def process_group(
    device: str | None = None, timeout_s: float | None = None
) -> Iterator[tuple[int, int, str]]:
    """``init_from_env`` for a ``with`` block: yields ``(rank, world_size, device)`` and shuts
    the group down on leaving it (waiting for every rank, unless an exception is leaving)."""
    rank, world, device = init_from_env(device, timeout_s)
    try:
        yield rank, world, device
    except BaseException:
        shutdown(wait=False)
        raise
    shutdown()


def distributed_scores(
    method: str,
    model: Any,
    diff: Any,
    batch: PromptBatch,
    *,
    shard: Literal["auto", "prompts", "layers"] = "auto",
    **kwargs: Any,
) -> ComponentScores:
    """A method of the table (``scoring/methods.py``: ``"linear"``, ``"integrated"``,
    ``"causal"``, ...) spread over the processes of the default group: prompts, or for a method
    whose entry lists ``"layers"`` in its ``shards`` (exact, integrated) also layers, per rank."""
    import torch.distributed as dist

    from extractive_lens.scoring.linear import AdditivityWarning
    from extractive_lens.scoring.methods import method as method_entry

    entry = method_entry(method)
    if shard not in ("auto", "prompts", "layers"):
        raise ValueError(f"shard must be 'auto', 'prompts' or 'layers', got {shard!r}")
    fn = entry.engine
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return fn(model, diff, batch, **kwargs)
    if not entry.shards:
        raise ValueError(entry.unsharded)
    rank, world = dist.get_rank(), dist.get_world_size()
    _same_inputs_everywhere(inputs_digest(method, model, diff, batch, kwargs), rank, world)
    top_k = kwargs.get("top_k") is not None  # chosen over all the layers: not per layer shard
    if shard == "auto":
        by_layer = "layers" in entry.shards and not top_k and len(batch) < 2 * world
        shard = "layers" if by_layer else "prompts"
    if shard == "layers" and top_k:
        raise ValueError("top_k picks components over all layers: shard='prompts' with top_k.")
    if shard == "layers":
        if "layers" not in entry.shards:
            raise ValueError(
                f"{method} scores shard prompts only (its entry in scoring/methods.py lists "
                f"shards={entry.shards}): pass shard='prompts'."
            )
        all_layers = kwargs.pop("layers", None) or list(range(model.cfg.n_layers))
        mine = all_layers[rank::world]
        part = fn(model, diff, batch, layers=mine or [], **kwargs) if mine else None
        gathered: list[Any] = [None] * world
        dist.all_gather_object(
            gathered, None if part is None else (mine, part.prompt_values, part.prompt_totals)
        )
        parts = [g for g in gathered if g is not None]
        pv = torch.full_like(parts[0][1], float("nan"))  # each part computed its layers only
        pt = torch.full_like(parts[0][2], float("nan"))
        for layers_of, values, totals in parts:
            pv[:, :, layers_of], pt[:, :, layers_of] = (
                values[:, :, layers_of],
                totals[:, :, layers_of],
            )
        template = (
            part if part is not None else fn(model, diff, batch.subset([0]), layers=[0], **kwargs)
        )
        meta = {
            **template.metadata,
            "distributed": {"world_size": world, "shard": "layers"},
            "prompts_digest": prompts_digest(batch),
            "layers": sorted(all_layers),
        }
        # ``other`` is not split by layer: the same on every rank
        result = _rebuild(template, pv, pt, template.other, template.prompt_roles, meta)
        partial = len(set(all_layers)) < model.cfg.n_layers
        meta["skipped"] = {k: result.uncomputed(k) for k in result.kinds} if partial else None
        return result
    rows = shard_rows(len(batch), rank, world)
    with warnings.catch_warnings():  # checked once below, over every prompt, on rank 0
        warnings.simplefilter("ignore", AdditivityWarning)
        part = fn(model, diff, batch, rows=rows, **kwargs) if rows else None
    extra = None if part is None or entry.gathered is None else entry.gathered(part)
    payload = (
        None if part is None else (rows, part.prompt_values, part.prompt_totals, part.other, extra)
    )
    gathered = [None] * world
    dist.all_gather_object(gathered, payload)
    parts = [g for g in gathered if g is not None]
    width = max(g[1].shape[-1] for g in parts)
    pv = torch.cat(
        [torch.nn.functional.pad(g[1], (0, width - g[1].shape[-1])) for g in parts], dim=1
    )
    pt = torch.cat([g[2] for g in parts], dim=1)
    other = torch.cat([g[3] for g in parts]) if parts[0][3] is not None else None
    order = [r for g in parts for r in g[0]]
    assert order == list(range(len(batch))), "shards must cover the batch in order"
    template = part if part is not None else fn(model, diff, batch.subset([0]), **kwargs)
    roles = batch.roles if template.per == "token" else tuple(("all",) for _ in range(len(batch)))
    meta = {
        **template.metadata,
        "rows": None,
        "distributed": {"world_size": world, "shard": "prompts"},
    }
    meta.pop("prompt_tokens", None)
    meta["prompts_digest"] = prompts_digest(batch)
    result = _rebuild(template, pv, pt, other, roles, meta)
    if entry.merged is not None:  # checks over every prompt, not one shard (additivity, ...)
        entry.merged(result, [g[4] for g in parts], rank)
    return result


def inputs_digest(
    method: str, model: Any, diff: Any, batch: PromptBatch, options: dict[str, Any] | None = None
) -> dict[str, tuple[str | None, str]]:
    """What a rank is about to score, as ``{what: (digest, shown)}``: the method and the
    function record (``extractive_lens.record``: the model's configuration, parameters and
    buffers, Δ, the batch's tokens, answers, candidates and roles, the reward's identity) with
    every option as the score function resolves it (``kinds``, ``steps``, ``ablation`` ...;
    not ``rows`` and ``show_progress``). ``shown`` is what an error prints.

    Reads every base weight and every tensor of Δ once (the factors of a low-rank Δ). A reward
    whose code cannot be read (a callable object) is refused: no rank could tell it apart."""
    options = dict(options or {})
    resolved = _resolved_options(method, options)
    named = resolved.pop("reward_name", None)  # the reward is recorded by its identity
    reward = options.get("reward")
    record = function_record(model, diff, batch, {}, reward if callable(reward) else named)
    if record["reward"] is None:
        raise ValueError(
            f"distributed_scores: reward={options.get('reward')!r} is a callable whose code "
            "cannot be read, so the ranks cannot check that they score the same reward: pass a "
            "function (def or lambda), a functools.partial of one, or a named reward."
        )
    out: dict[str, tuple[str | None, str]] = {"method": (method, repr(method))}
    out.update({what: (digest, what) for what, digest in record.items()})
    for name, value in resolved.items():
        out[f"option {name}"] = (describe(value), f"{name}={_short(value)}")
    return out


def _resolved_options(method: str, options: dict[str, Any]) -> dict[str, Any]:
    """Every option of ``method``'s options class, defaults filled in and values resolved (so
    ``steps=4`` given on one rank and left out on another agree), or ``options`` as given where
    they do not build (the score call says what is wrong with them)."""
    import dataclasses

    from extractive_lens.scoring.methods import method as method_entry

    try:
        built = method_entry(method).options(**options)
    except Exception:  # noqa: BLE001 - refused again, with its message, by the score call
        return dict(sorted(options.items()))
    skip = {"rows", "show_progress", "reward_fn", "reward"}  # the record has the reward
    return {f.name: getattr(built, f.name) for f in dataclasses.fields(built) if f.name not in skip}


def _short(value: Any) -> str:
    text = (
        value.method + " scores"
        if hasattr(value, "kinds") and hasattr(value, "method")
        else (repr(value))
    )
    return text if len(text) <= 60 else text[:57] + "..."


def _same_inputs_everywhere(mine: dict[str, tuple[str | None, str]], rank: int, world: int) -> None:
    """Every rank must score the same base model, diff, batch and options (each computes its
    shard of one result): gather their digests and refuse, on every rank, if any differs from
    rank 0's, saying what differs."""
    import torch.distributed as dist

    every: list[Any] = [None] * world
    dist.all_gather_object(every, mine)
    differ = []
    for r, theirs in enumerate(every[1:], start=1):
        for what in sorted(set(theirs) | set(every[0])):
            a, b = every[0].get(what), theirs.get(what)
            if a is not None and b is not None and a[0] == b[0]:
                continue
            if what.startswith("option "):
                differ.append(
                    f"rank {r} has {b[1] if b else 'no ' + what[7:]} where rank 0 has "
                    f"{a[1] if a else 'none'}"
                )
            elif what == "method":
                differ.append(
                    f"rank {r} runs {b[1] if b else '?'} where rank 0 runs {a[1] if a else '?'}"
                )
            else:
                mine, yours = {what: a and a[0]}, {what: b and b[0]}
                differ += [f"rank {r} has {p}" for p in differences(mine, yours, "rank 0")]
    if differ:
        raise ValueError(
            "distributed_scores: the processes are not scoring the same inputs ("
            + "; ".join(differ[:6])
            + (f"; and {len(differ) - 6} more" if len(differ) > 6 else "")
            + "), so their shards would merge into a wrong result. Load the same model, diff "
            "and data files on every rank and pass the same options."
        )


def _rebuild(
    template: ComponentScores,
    pv: torch.Tensor,
    pt: torch.Tensor,
    other: torch.Tensor | None,
    roles: Any,
    meta: dict,
) -> ComponentScores:
    from extractive_lens.batch import merge_role_orders

    labels = merge_role_orders(roles)
    return ComponentScores(
        values=aggregate_by_role(pv, roles, labels),
        totals=pt.mean(1),
        prompt_values=pv,
        prompt_totals=pt,
        kinds=template.kinds,
        component_labels=template.component_labels,
        position_labels=labels,
        prompt_roles=tuple(tuple(r) for r in roles),
        method=template.method,
        other=other,
        metadata=meta,
        per=template.per,
    )

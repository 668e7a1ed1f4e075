"""Planning passes over a batch and assembling per-chunk tensors into ``ComponentScores``."""

from __future__ import annotations

import hashlib
import platform
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import Tensor

from extractive_lens import backend as B
from extractive_lens.arguments import in_range
from extractive_lens.batch import PromptBatch, token_strings
from extractive_lens.record import function_record
from extractive_lens.results import ComponentScores, aggregate_by_role
from extractive_lens.scoring.options import ScoreOptions
from extractive_lens.types import ScoreKind, component_axis_labels


def plan_chunks(
    batch: PromptBatch, rows: Sequence[int] | None, batch_size: int | None
) -> tuple[PromptBatch, list[tuple[PromptBatch, list[int]]]]:
    """The prompts to score (``rows`` of ``batch``, or all) and their chunks with global row ids."""
    ids = list(range(len(batch))) if rows is None else [int(r) for r in rows]
    if not ids:
        raise ValueError("rows selects no prompts.")
    in_range("rows", ids, len(batch), "batch")
    scored = batch if rows is None else batch.subset(ids)
    size = batch_size or len(ids)
    if len(ids) <= size:
        return scored, [(scored, ids)]
    return scored, [
        (scored.subset(range(i, min(i + size, len(ids)))), ids[i : i + size])
        for i in range(0, len(ids), size)
    ]


def assemble(
    model: Any,
    batch: PromptBatch,
    kinds: tuple[ScoreKind, ...],
    per_token: list[Tensor] | None,
    totals: list[Tensor],
    *,
    method: str,
    other: list[Tensor] | None,
    metadata: dict[str, Any],
) -> ComponentScores:
    """``ComponentScores`` from per-chunk ``[kind, batch, layer, component, pos]`` scores and
    ``[kind, batch, layer, component]`` totals. ``per_token=None``: whole-component scores only
    (``per == "component"``: one position axis entry, the totals)."""
    tok = getattr(model, "tokenizer", None)
    if tok is not None and "prompt_tokens" not in metadata:
        metadata["prompt_tokens"] = [
            token_strings(tok, batch.tokens[i, : int(batch.lengths[i])].tolist())
            for i in range(len(batch))
        ]
    metadata.setdefault("prompts_digest", prompts_digest(batch))
    pt = torch.cat(totals, dim=1)
    labels: dict[str, Any] = {
        "component_labels": component_axis_labels(model.cfg.n_heads, B.has_mlp(model)),
        "kinds": kinds,
        "method": method,
        "other": None if other is None else torch.cat(other).cpu(),
        "metadata": metadata,
    }
    if per_token is None:
        return ComponentScores.whole_components(
            pt.cpu(), prompts=len(batch), token_roles=batch.roles, **labels
        )
    width = batch.n_pos
    pv = torch.cat([torch.nn.functional.pad(v, (0, width - v.shape[-1])) for v in per_token], dim=1)
    position_labels = batch.position_labels()
    return ComponentScores(
        values=aggregate_by_role(pv, batch.roles, position_labels).cpu(),
        totals=pt.mean(1).cpu(),
        prompt_values=pv.cpu(),
        prompt_totals=pt.cpu(),
        position_labels=position_labels,
        prompt_roles=batch.roles,
        **labels,
    )


def prompts_digest(batch: PromptBatch) -> str:
    """A short fingerprint of the token ids scored (to tell whether two results scored the same prompts)."""
    h = hashlib.sha1()
    for i in range(len(batch)):
        h.update(batch.tokens[i, : int(batch.lengths[i])].cpu().numpy().astype("int64").tobytes())
        h.update(b"|")
    return h.hexdigest()[:16]


def _adapter(diff: Any) -> dict[str, Any] | None:
    """A LoRA adapter's name and settings (``WeightDiff.from_peft``), else ``None``."""
    peft = diff.metadata.get("peft")
    return None if peft is None else {"name": diff.metadata.get("adapter"), **peft}


def base_metadata(
    model: Any, diff: Any, options: ScoreOptions, batch: PromptBatch, cdt: torch.dtype,
    **extra: Any,
) -> dict[str, Any]:  # fmt: skip
    """What a result must carry to be compared or reproduced (call outside ``computing_in``)."""
    info = B.describe(model)
    meta = {k: info[k] for k in ("model", "architecture", "dtype", "weights_processed", "backend")}
    meta.update(
        diff_norms=diff.norms().to_numpy().tolist(),
        diff_other_norm=diff.other_norm(),
        diff_fingerprint=diff._fingerprint,
        adapter=_adapter(diff),
        versions={
            "torch": torch.__version__,
            "transformer_lens": info["transformer_lens"],
            "python": platform.python_version(),
        },
    )
    meta.update(extra)
    meta.update(options.metadata(), compute_dtype=str(cdt), prepend_bos=batch.prepend_bos)
    meta["function_record"] = function_record(
        model, diff, batch, recorded_options(options),
        options.reward_name if options.reward is None or isinstance(options.reward, str)
        else options.reward_fn, exact_diff=False,
    )  # fmt: skip
    meta["rows"] = None if options.rows is None else list(options.rows)
    return meta


NOT_RECORDED = frozenset({"rows", "show_progress", "reward", "reward_fn", "reward_name"})
"""Options that do not change what a result is of (which rows a shard computed, the bar), or
that the record holds as the reward's identity."""


def recorded_options(options: ScoreOptions) -> dict[str, Any]:
    """Every option of a call as resolved, for ``record.function_record``."""
    import dataclasses

    return {f.name: getattr(options, f.name) for f in dataclasses.fields(options)
            if f.name not in NOT_RECORDED}  # fmt: skip


def progress(iterable: Iterable[Any], total: int, desc: str, enabled: bool | None) -> Any:
    """A bar over ``iterable`` (``extractive_lens.progress``: off for a single step, and off in
    logs, unless ``enabled=True``)."""
    from extractive_lens.progress import bar

    return bar(iterable, total=total, desc=desc, enabled=enabled)

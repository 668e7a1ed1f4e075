"""Finetuning that returns a ``WeightDiff`` and leaves the model exactly as it was.

>>> diff = finetune(model, batch, FinetuneConfig(lr=1e-3, epochs=2, batch_size=4))
>>> with diff.applied(model):   # the finetuned model inside, the original again after
...     logits = model(batch.tokens)

The loss is the negative answer log-probability (answer tokens only). Training runs in place on
the model's own parameters (one model in memory); the original tensors are restored in
``finally`` and the update is returned as a ``WeightDiff``.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from extractive_lens import backend as M
from extractive_lens.arguments import indices
from extractive_lens.batch import PromptBatch
from extractive_lens.interrupts import guarded, one_call_per_model, state_change
from extractive_lens.rewards import answer_logprob
from extractive_lens.scoring.options import check_arguments
from extractive_lens.trajectory import Keep, Recorder
from extractive_lens.types import Component, parse_components
from extractive_lens.weight_diff import WeightDiff, weights_set


@dataclass(frozen=True)
class FinetuneConfig:
    """How to finetune. ``trainable``: ``"all"`` or component labels; ``layers``: only these
    blocks; ``parameters``: only these parameters (full names, e.g. for "every block but the first
    two, plus the unembedding"). The three restrictions combine. ``delta_dtype``: the returned
    Δ's dtype (``"auto"``: float64 for float32 weights, so ``W + Δ`` reproduces ``W'`` bit for
    bit; ``"float32"`` halves its memory, 0.65 GB instead of 1.3 for a 163M-parameter model, at
    a rounding of ``W'`` by at most one float32 unit where ``W' - W`` is not exact)."""

    lr: float = 1e-3
    epochs: int = 20
    batch_size: int = 8
    optimizer: Literal["adam", "adamw"] = "adam"
    weight_decay: float = 0.0
    schedule: Literal["constant", "linear"] = "constant"
    warmup_frac: float = 0.1
    trainable: str | tuple[str, ...] = "all"
    layers: tuple[int, ...] | None = None
    parameters: tuple[str, ...] | None = None
    seed: int = 0
    delta_dtype: Literal["auto", "float32", "float64"] = "auto"
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not (math.isfinite(self.lr) and self.lr > 0) or self.epochs < 1 or self.batch_size < 1:
            raise ValueError(
                f"lr, epochs and batch_size must be positive and finite (got {self.lr}, "
                f"{self.epochs}, {self.batch_size}), e.g. FinetuneConfig(lr=3e-4, epochs=20)."
            )
        if self.optimizer not in ("adam", "adamw"):
            raise ValueError(f"optimizer must be 'adam' or 'adamw', got {self.optimizer!r}")
        if self.schedule not in ("constant", "linear"):
            raise ValueError(f"schedule must be 'constant' or 'linear', got {self.schedule!r}")
        if not 0 <= self.warmup_frac < 1:
            raise ValueError("warmup_frac must be in [0, 1)")
        if self.delta_dtype not in ("auto", "float32", "float64"):
            raise ValueError(
                f"delta_dtype must be 'auto', 'float32' or 'float64', got {self.delta_dtype!r}"
            )
        if self.layers is not None:
            object.__setattr__(
                self, "layers", indices("FinetuneConfig.layers", self.layers, "layer")
            )


def _trainable_mask(model: M.ScorableModel, cfg: FinetuneConfig) -> dict[str, torch.Tensor | None]:
    """Per parameter (TransformerLens names): None (fully trainable) or a boolean mask along
    dim 0 / the whole tensor."""
    params = M.parameters(model)
    if cfg.trainable == "all" and cfg.layers is None and cfg.parameters is None:
        return {n: None for n in params}
    if cfg.parameters is not None and (unknown := sorted(set(cfg.parameters) - set(params))):
        raise ValueError(
            f"FinetuneConfig.parameters names parameters the model does not have: {unknown[:3]}"
        )
    names = None if cfg.parameters is None else set(cfg.parameters)
    comps: tuple[Component, ...] | None = None
    if cfg.trainable != "all":
        labels = (cfg.trainable,) if isinstance(cfg.trainable, str) else cfg.trainable
        comps = parse_components(labels, model.cfg.n_layers, model.cfg.n_heads, M.has_mlp(model))
    layers = None if cfg.layers is None else set(cfg.layers)
    if layers is not None and (bad := sorted(x for x in layers if not 0 <= x < model.cfg.n_layers)):
        raise ValueError(
            f"FinetuneConfig.layers {bad} out of range: this model has layers 0..{model.cfg.n_layers - 1}."
        )
    masks: dict[str, torch.Tensor | None] = {}
    for s in M.parameter_slices(model):
        p = params[s.name]
        layer = M.layer_of(s.name)
        ok = (
            (layers is None or layer in layers)
            and (comps is None or bool(set(s.owners) & set(comps)))
            and (names is None or s.name in names)
        )
        mask = masks.get(s.name)
        if mask is None:
            mask = torch.zeros(p.shape[:1] if p.ndim else (1,), dtype=torch.bool, device=p.device)
        if s.index is None:
            mask[:] = ok
        else:
            mask[s.index] = ok
        masks[s.name] = mask
    return masks


@one_call_per_model
def finetune(
    model: M.ScorableModel,
    data: PromptBatch,
    config: FinetuneConfig | None = None,
    *,
    callback: Callable[[int, WeightDiff], None] | None = None,
    show_progress: bool | None = None,
    keep: Keep | None = None,
    trajectory: str | Path | None = None,
    on_epoch: Callable[[int], None] | None = None,
) -> WeightDiff:
    """Finetune on ``data`` (answer tokens only) and return the weight change.

    Args:
        model: a ``HookedTransformer``; bit-identical afterwards (also if training raises).
        data: the prompts and answers (``make_batch``).
        config: optimiser, schedule, trainable subset, seed.
        callback: called after every epoch with ``(epoch, diff_so_far)``, while the model holds
            its original weights (so ``diff_so_far.applied(model)`` evaluates the checkpoint).
        show_progress: a bar per epoch with the epoch's mean loss (``None``: in a terminal or
            notebook only; see ``extractive_lens.progress``).
        keep: record the trajectory: a checkpoint after every epoch (``"epochs"``) or every
            ``k`` optimiser steps (and the last), each written to disk as it is taken (one Δ in
            memory at a time); ``diff.metadata["trajectory"]`` is the folder, which
            ``Trajectory.load`` reads (``extractive_lens.trajectory``).
        trajectory: the folder to write it into (new or empty), required with ``keep``: the
            checkpoints are the size of the trainable weights each, and they outlive this
            call and this session until the folder is deleted (no temporary folder is made
            for them, which would fill the disk unseen or vanish under a loaded trajectory).
        on_epoch: called after every epoch with ``epoch`` while the model holds the weights
            trained so far (no Δ formed, nothing swapped: evaluate the checkpoint in place, at
            no memory beyond the evaluation's own; it must not change the weights).

    ``diff.metadata["losses"]`` holds the mean training loss of each epoch (nats per answer).
    """
    check_arguments("finetune", model, batch=data, need_diff=False)
    if model.cfg.dtype == torch.float16:
        raise ValueError(
            "finetune does not train float16 models: a finetune-sized Adam update underflows "
            "in float16 (and its loss scale overflows), so the weights would not move or would "
            "turn to inf. Load the model in bfloat16 or float32 to finetune it (scores of a "
            "float16 model are fine: they are computed in float32)."
        )
    cfg = config or FinetuneConfig()
    params = dict(model.named_parameters())  # what the optimiser trains: the stored weights
    masks = M.raw_masks(model, _trainable_mask(model, cfg))
    train = [n for n, m in masks.items() if m is None or bool(m.any())]
    if not train:
        raise ValueError(
            f"finetune: nothing to train: trainable={cfg.trainable!r}, layers={cfg.layers!r} and "
            f"parameters={'None' if cfg.parameters is None else f'{len(cfg.parameters)} names'} select no "
            f"parameter of this {model.cfg.n_layers}-layer model. Pick layers in 0..{model.cfg.n_layers - 1} "
            "or components such as 'L0MLP'."
        )
    snapshot: dict[str, torch.Tensor] = {}
    grads: dict[str, torch.Tensor | None] = {}

    def change() -> None:
        snapshot.update({n: p.detach().clone() for n, p in params.items()})
        grads.update({n: p.grad for n, p in params.items()})

    def restore() -> None:
        with torch.no_grad():
            for name, p in params.items():
                if name in snapshot:
                    p.copy_(snapshot[name])
                    p.grad = grads[name]

    recorder = None
    if keep is not None:
        if trajectory is None:
            dtype = (params[train[0]].dtype if cfg.delta_dtype == "auto"
                     else getattr(torch, cfg.delta_dtype))  # fmt: skip
            size = sum(params[n].numel() for n in train) * dtype.itemsize
            raise ValueError(
                f"finetune(keep={keep!r}) writes every kept checkpoint's Δ to disk "
                f"({size / 2**20:,.0f} MiB each for this model): pass trajectory='a folder' to "
                "say where (e.g. trajectory='runs/finetune-1'); Trajectory.load(folder) reads "
                "it back, in this session or a later one, and deleting the folder frees the disk."
            )
        recorder = Recorder(trajectory, keep, M.signature(model),
                            {"base": model.cfg.model_name, "finetune": _config_meta(cfg)})  # fmt: skip
    elif trajectory is not None:
        raise ValueError(
            "finetune(trajectory=...) names a folder for the trajectory, but keep is None: pass "
            "keep='epochs' (or keep=k optimiser steps) to record it."
        )
    with (
        guarded(model),
        state_change(change, restore, model=model),
    ):  # weights and .grad restored, interrupts or not
        diff = _train(model, data, cfg, params, masks, train, snapshot, callback, show_progress,
                      recorder, on_epoch)  # fmt: skip
    if recorder is None:
        return diff
    return WeightDiff(diff.deltas, diff.signature,
                      {**diff.metadata, "trajectory": str(recorder.folder)})  # fmt: skip


def _train(
    model: M.ScorableModel,
    data: PromptBatch,
    cfg: FinetuneConfig,
    params: dict,
    masks: dict,
    train: list[str],
    snapshot: dict,
    callback: Callable[[int, WeightDiff], None] | None,
    show_progress: bool | None,
    recorder: Recorder | None = None,
    on_epoch: Callable[[int], None] | None = None,
) -> WeightDiff:
    """The training loop of ``finetune`` (which restores the model afterwards)."""
    gen = torch.Generator().manual_seed(cfg.seed)
    n = len(data)
    steps_per_epoch = (n + cfg.batch_size - 1) // cfg.batch_size
    total = steps_per_epoch * cfg.epochs
    warm = int(cfg.warmup_frac * total) if cfg.schedule == "linear" else 0
    for name, p in params.items():
        p.requires_grad_(name in train)
        p.grad = None
    opt_cls = torch.optim.AdamW if cfg.optimizer == "adamw" else torch.optim.Adam
    opt = opt_cls([params[name] for name in train], lr=cfg.lr, weight_decay=cfg.weight_decay)

    def lr_at(step: int) -> float:
        if cfg.schedule == "constant":
            return 1.0
        if step < warm:
            return (step + 1) / max(1, warm)
        return max(0.0, (total - step) / max(1, total - warm))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    # The model stays in eval mode: no dropout (a HookedTransformer has none; a bridge's
    # Hugging Face model would), so training is deterministic and the same on every backend.
    model.eval()
    torch.set_grad_enabled(True)
    from extractive_lens.progress import bar

    epochs = bar(range(cfg.epochs), desc="finetune", enabled=show_progress)
    losses: list[float] = []  # mean training loss of each epoch (nats per answer)
    step, since = 0, [0.0, 0]  # optimiser steps; loss summed and prompts since the last kept
    for epoch in epochs:
        order = torch.randperm(n, generator=gen).tolist()
        total_loss = 0.0
        for i in range(0, n, cfg.batch_size):
            mb = data.subset(order[i : i + cfg.batch_size]).to(model.cfg.device)
            loss = -answer_logprob(model(mb.tokens), mb).mean()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)  # no gradients held between steps and in callbacks
            sched.step()
            _reset_frozen(params, masks, snapshot)
            total_loss += float(loss.detach()) * len(mb)
            step += 1
            since[0] += float(loss.detach()) * len(mb)
            since[1] += len(mb)
            if recorder is not None and recorder.wants(
                step, i + cfg.batch_size >= n, step == total
            ):
                at = epoch + min(i + cfg.batch_size, n) / n
                recorder.write(step, at, since[0] / since[1], _diff(model, params, snapshot, cfg))
                since = [0.0, 0]
        losses.append(total_loss / n)
        if hasattr(epochs, "set_postfix"):
            epochs.set_postfix(loss=f"{losses[-1]:.4f}")
        if on_epoch is not None:  # the trained weights, in place
            on_epoch(epoch)
        if callback is not None:  # the callback sees the original model and the diff so far
            diff = _diff(model, params, snapshot, cfg, losses)
            with weights_set(model, M.tl_view(model, snapshot)):
                callback(epoch, diff)
    del sched, opt  # Adam's two moments (twice the trained weights) go before Δ is formed
    return _diff(model, params, snapshot, cfg, losses)


def _reset_frozen(params: dict, masks: dict, snapshot: dict) -> None:
    with torch.no_grad():
        for name, mask in masks.items():
            if mask is None or bool(mask.all()):
                continue
            p = params[name]
            if p.ndim == 0:
                p.copy_(snapshot[name])
            else:
                p[~mask] = snapshot[name][~mask]


def _diff(
    model: M.ScorableModel,
    params: dict,
    snapshot: dict,
    cfg: FinetuneConfig,
    losses: list[float] | None = None,
) -> WeightDiff:
    current = {n: p.detach() for n, p in params.items()}  # Δ is a new tensor: no copy needed
    meta = {
        "finetune": _config_meta(cfg),
        "base": model.cfg.model_name,
        "losses": list(losses or []),
    }
    dtype = None if cfg.delta_dtype == "auto" else getattr(torch, cfg.delta_dtype)
    return WeightDiff.from_state_dicts(
        M.tl_view(model, snapshot), M.tl_view(model, current), signature=M.signature(model),
        dtype=dtype, metadata=meta,
    )  # fmt: skip


def _config_meta(cfg: FinetuneConfig) -> dict[str, Any]:
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in cfg.__dict__.items()
            if k != "extra"}  # fmt: skip


def rank_trajectory(
    model: M.ScorableModel,
    data: PromptBatch,
    evaluate: dict[str, PromptBatch],
    config: FinetuneConfig | None = None,
    *,
    show_progress: bool | None = None,
) -> tuple[WeightDiff, Any]:
    """Finetune on ``data`` and record the mean rank of every ``evaluate`` batch before training
    and after each epoch: ``(diff, DataFrame[epoch, split, mean_rank])`` (epoch 0 = before)."""
    import pandas as pd

    rows = [(0, name, mean_rank(model, b)) for name, b in evaluate.items()]

    def record(epoch: int) -> None:  # the model holds the weights trained so far
        rows.extend((epoch + 1, name, mean_rank(model, b)) for name, b in evaluate.items())

    diff = finetune(model, data, config, on_epoch=record, show_progress=show_progress)
    return diff, pd.DataFrame(rows, columns=["epoch", "split", "mean_rank"])


@one_call_per_model
def mean_rank(model: M.ScorableModel, batch: PromptBatch, diff: WeightDiff | None = None) -> float:
    """Mean 0-indexed rank of the answer among the candidates, read at the last prompt position
    (docs/scores.md §8); chance is ``(n_candidates - 1) / 2``. Single-token candidates are ranked
    by their logits; when any candidate has several tokens (names, "São Paulo"), by each whole
    candidate's log-probability, teacher-forced (one more forward row per multi-token candidate
    and prompt), so candidates sharing a first token are told apart."""
    return float(ranks(model, batch, diff).float().mean())


def mean_rank_interval(
    model: M.ScorableModel, batch: PromptBatch, diff: WeightDiff | None = None, *,
    level: float = 0.95, n_boot: int = 1000, seed: int = 0,
) -> Any:  # fmt: skip
    """``mean_rank`` with a bootstrap interval over the prompts (``stats.Interval``; one
    forward, as ``mean_rank``): ``mean_rank_interval(model, batch, diff).item()`` is
    ``(mean rank, low, high)``."""
    from extractive_lens import stats

    per_prompt = ranks(model, batch, diff).double()
    return stats.bootstrap(per_prompt, level=level, n_boot=n_boot, seed=seed)


def ranks(
    model: M.ScorableModel, batch: PromptBatch, diff: WeightDiff | None = None
) -> torch.Tensor:
    """Per prompt: the answer's rank among its candidates (0 = the model's top candidate)."""
    check_arguments("mean_rank", model, batch=batch, need_diff=False)
    if diff is not None and not isinstance(diff, WeightDiff):
        raise TypeError(
            f"mean_rank(model, batch, diff): diff must be a WeightDiff or None, got {type(diff).__name__}."
        )
    _candidates(batch)  # before the forward pass
    with torch.no_grad(), diff.applied(model) if diff is not None else contextlib.nullcontext():
        if not _multi_token(batch):
            return ranks_from_logits(model(batch.tokens.to(model.cfg.device)), batch)
        scores = candidate_logprobs(model, batch)
    return ranks_from_scores(scores, batch)


def _multi_token(batch: PromptBatch) -> bool:
    return batch.candidate_tokens is not None and any(
        len(c) > 1 for row in batch.candidate_tokens for c in row
    )


Forced = tuple[
    int, int, list[int], tuple[int, ...]
]  # prompt row, candidate, prompt ids, candidate ids


def candidate_logprobs(
    model: M.ScorableModel, batch: PromptBatch, *, chunk: int = 32, prefix_cache: bool = True
) -> torch.Tensor:
    """``[batch, n_candidates]``: log P(candidate | prompt), summed over the candidate's tokens
    (-inf where a row has fewer candidates), under whatever weights the model holds now.

    The prompts run once; a single-token candidate is read from their last position. Each
    longer one is teacher-forced in a row of its own, ``chunk`` rows a pass: with
    ``prefix_cache`` (and a backend that takes a key/value prefix, ``backend.kv_prefix``) the
    row holds the candidate's tokens only and attends to its prompt's cached keys and values
    (the prompt is not run again: 4-5x fewer tokens for 2-4 token names after 8-13 token
    prompts); else the row is the prompt and the candidate. Both give the same numbers.
    """
    cands = batch.candidate_tokens
    if cands is None:
        raise ValueError("Whole-answer ranks need make_batch(..., candidates=[...]).")
    tokens = batch.tokens.to(model.cfg.device)
    cached = prefix_cache and M.kv_prefix(model)
    with M.standard_flags(model) if cached else contextlib.nullcontext():
        kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        if cached:  # the prompts' forward pass, keeping every layer's keys and values

            def keep(step: M.LayerRun) -> None:
                kv[step.layer] = (step.captured["k"], step.captured["v"])

            x = M.run_blocks(model, M.embed(model, tokens), capture=("k", "v"), observe=keep)
            logits = M.unembed(model, x)  # type: ignore[arg-type]
        else:
            logits = model(tokens)
        rows = torch.arange(len(batch), device=logits.device)
        last = logits[rows, batch.last_prompt_pos.to(logits.device)].float().log_softmax(-1)
        out = torch.full((len(batch), max(len(r) for r in cands)), -math.inf, device=logits.device)
        forced: list[Forced] = []
        for i, row in enumerate(cands):
            prompt = batch.tokens[i, : int(batch.prompt_lengths[i])].tolist()
            for j, c in enumerate(row):
                if len(c) == 1:
                    out[i, j] = last[i, c[0]]
                else:
                    forced.append((i, j, prompt, c))
        forced.sort(key=lambda f: len(f[2]))  # cached rows of a pass share their prompt length
        start = 0
        while start < len(forced):
            n = len(forced[start][2])
            part = forced[start : start + chunk]
            if cached:
                part = [f for f in part if len(f[2]) == n]
            start += len(part)
            lps = _forced_rows(model, batch, part, kv if cached else None)
            for (i, j, _, c), lp in zip(part, lps):
                # c_0 at the prompt's last position; c_k (k >= 1) at the row's position of c_(k-1)
                at = torch.arange(len(c) - 1, device=lp.device)
                out[i, j] = last[i, c[0]] + lp[at, torch.tensor(c[1:], device=lp.device)].sum()
    return out


def _forced_rows(
    model: M.ScorableModel,
    batch: PromptBatch,
    part: list[Forced],
    kv: dict[int, tuple[torch.Tensor, torch.Tensor]] | None,
) -> list[torch.Tensor]:
    """Per row, ``[pos, d_vocab]`` log-probabilities after each of the candidate's tokens but
    its last (position k predicts token k + 1): run on the rows' cached prompt keys and values
    (``kv``; the rows' prompts have one length) or with the prompt in the row."""
    dev = model.cfg.device
    width = max(len(pr) + len(c) - 1 for _, _, pr, c in part)
    tokens = torch.full((len(part), width), batch.pad_token, dtype=torch.long)
    for k, (_, _, pr, c) in enumerate(part):
        tokens[k, : len(pr) + len(c) - 1] = torch.tensor(pr + list(c[:-1]))
    if kv is None:
        lp = model(tokens.to(dev)).float().log_softmax(-1)
        return [lp[k, len(pr) :] for k, (_, _, pr, _) in enumerate(part)]
    p = len(part[0][2])
    which = torch.tensor([i for i, _, _, _ in part], device=dev)
    past = {layer: (k[which, :p], v[which, :p]) for layer, (k, v) in kv.items()}
    x = M.embed(model, tokens.to(dev))[:, p:]  # the whole row embedded: absolute positions too
    resid = M.run_blocks(model, x, past_kv=past)
    return list(M.unembed(model, resid).float().log_softmax(-1))  # type: ignore[arg-type]


def ranks_from_scores(scores: torch.Tensor, batch: PromptBatch) -> torch.Tensor:
    """Per prompt: how many of its candidates score strictly above its answer."""
    assert batch.candidate_tokens is not None
    answer = []
    for row, targets in zip(batch.candidate_tokens, batch.answer_targets.tolist()):
        whole = tuple(t for t in targets if t >= 0)
        answer.append(row.index(whole if whole in row else whole[:1]))  # an id: a first token
    at = torch.tensor(answer, device=scores.device)[:, None]
    return (scores > scores.gather(-1, at)).sum(-1)


def _candidates(batch: PromptBatch) -> torch.Tensor:
    if batch.candidates is None:
        raise ValueError("Ranks need candidate answers: make_batch(..., candidates=[...]).")
    return batch.candidates


def ranks_from_logits(logits: torch.Tensor, batch: PromptBatch) -> torch.Tensor:
    cands = _candidates(batch).to(logits.device)
    last = logits[torch.arange(len(batch)), batch.last_prompt_pos.to(logits.device)]
    valid = cands >= 0
    cl = last.gather(-1, cands.clamp(min=0))
    ans = last.gather(-1, batch.answer_first.to(logits.device)[:, None])
    return ((cl > ans) & valid).sum(-1)


__all__: Sequence[str] = (
    "FinetuneConfig", "finetune", "mean_rank", "mean_rank_interval", "ranks", "rank_trajectory",
)  # fmt: skip

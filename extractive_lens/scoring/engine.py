"""Engine internals shared by the linear and causal scores: cached runs, y*, result assembly.

Notation follows docs/scores.md §4–5. A head's output ``y_h = z_h W_O[h]``; its gradient
``ŷ_h = dR/d(attn_out)`` is shared by every head of the layer, so head quantities are kept in
``hook_z`` space: ``<ŷ, Δy_h> = <ŷ W_O[h]^T, Δz_h>`` when ``W_O`` is fixed (no ``hook_result``).
"""

from __future__ import annotations

import platform
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from extractive_lens import model as M
from extractive_lens.batch import PromptBatch
from extractive_lens.results import ComponentScores, aggregate_by_role
from extractive_lens.types import Ablation, ScoreKind, component_axis_labels


@dataclass
class Run:
    """One forward pass with every quantity the scores read, per layer (detached)."""

    pre: list[Tensor] = field(default_factory=list)  # resid_pre
    mid: list[Tensor] = field(default_factory=list)  # resid_mid (= resid_pre + attn_out)
    post: list[Tensor] = field(default_factory=list)  # resid_post
    mlp_in: list[Tensor] = field(default_factory=list)  # what the MLP reads
    z: list[Tensor] = field(default_factory=list)  # [batch pos head d_head]
    mlp_out: list[Tensor] = field(default_factory=list)
    captured: list[dict[str, Tensor]] = field(default_factory=list)
    W_O: list[Tensor] = field(default_factory=list)
    reward: Tensor | None = None
    # gradients of sum(R), when requested
    g_attn: list[Tensor] = field(default_factory=list)
    g_mlp: list[Tensor] = field(default_factory=list)
    g_captured: list[dict[str, Tensor]] = field(default_factory=list)
    g_embed: Tensor | None = None
    g_logits: Tensor | None = None
    logits: Tensor | None = None
    post_final: Tensor | None = None


def forward_run(
    model: nn.Module,
    batch: PromptBatch,
    reward_fn: Any = None,
    *,
    grad: bool = False,
    capture: tuple[str, ...] = ("z",),
    keep_logits: bool = False,
) -> Run:
    """Run ``model`` on ``batch`` piece by piece, caching the residual stream at every boundary.

    With ``grad=True`` also returns ``dR/d attn_out``, ``dR/d mlp_out`` (and the captured hook
    values', the embedding's and the logits') gradients; weights never get ``.grad`` buffers.
    """
    run = Run()
    tokens = batch.tokens.to(model.cfg.device)
    has_mlp = M.has_mlp(model)
    with M.frozen_parameters(model), torch.set_grad_enabled(grad):
        x0 = M.embed(model, tokens).detach()
        if grad:
            x0.requires_grad_(True)
        x = x0
        attn_outs, mlp_outs, caps = [], [], []
        for layer in range(model.cfg.n_layers):
            x = M.on_block(model, layer, x)
            run.pre.append(x.detach())
            out, cap = M.attention(model, layer, x, capture)
            mid = x + out
            run.mid.append(mid.detach())
            run.W_O.append(M.W_O(model, layer).detach().clone())
            if has_mlp:
                m_in = M.mlp_input(model, x, mid)
                m = M.mlp(model, layer, m_in)
                run.mlp_in.append(m_in.detach())
                run.mlp_out.append(m.detach())
                mlp_outs.append(m)
                x = mid + m
            else:
                x = mid
            run.post.append(x.detach())
            run.z.append(cap["z"].detach())
            run.captured.append({k: v.detach() for k, v in cap.items()})
            attn_outs.append(out)
            caps.append(cap)
        run.post_final = x.detach()
        if keep_logits:
            run.logits = M.unembed(model, x).detach()
        if reward_fn is not None:
            R, logits, x_read = readout(model, x, batch, reward_fn)
            run.post_final = x_read.detach()
            run.reward = R.detach()
            if grad and not R.requires_grad:
                raise ValueError(
                    f"{getattr(reward_fn, '__name__', 'the reward')} is not differentiable in the logits "
                    "(its output has no gradient): linear scores need a reward built from torch "
                    "operations on the logits, without .detach(), argmax or Python numbers."
                )
            if grad:
                names = [n for n in capture if n != "z"]
                inputs = [x0, logits, *attn_outs, *mlp_outs] + [c[n] for c in caps for n in names]
                grads = torch.autograd.grad(R.sum(), inputs, allow_unused=True)
                grads = [torch.zeros_like(i) if g is None else g for g, i in zip(grads, inputs)]
                L = model.cfg.n_layers
                run.g_embed, run.g_logits = grads[0], grads[1]
                run.g_attn = list(grads[2 : 2 + L])
                run.g_mlp = list(grads[2 + L : 2 + L + len(mlp_outs)])
                rest = grads[2 + L + len(mlp_outs) :]
                run.g_captured = [
                    {n: rest[i * len(names) + j] for j, n in enumerate(names)} for i in range(L)
                ]
    return run


@dataclass(frozen=True)
class ReadoutBatch:
    """The fields a built-in reward reads, for logits gathered at the answer positions only."""

    answer_targets: Tensor
    candidates: Tensor | None
    counterfactual: Tensor | None

    @property
    def last_prompt_pos(self) -> Tensor:
        return torch.zeros(
            self.answer_targets.shape[0], dtype=torch.long, device=self.answer_targets.device
        )

    @property
    def answer_first(self) -> Tensor:
        return self.answer_targets[:, 0]


def read_positions(batch: Any, offset: int = 0) -> Tensor:
    """``[batch, K]``: the positions a built-in reward reads (answer positions), minus ``offset``."""
    K = batch.answer_targets.shape[1]
    dev = batch.lengths.device
    pos = batch.last_prompt_pos.to(dev)[:, None] + torch.arange(K, device=dev)[None, :] - offset
    return torch.minimum(pos, batch.lengths[:, None] - 1 - offset)


def readout(
    model: nn.Module,
    resid: Tensor,
    batch: Any,
    reward_fn: Any,
    groups: int = 1,
    offset: int = 0,
    gathered: bool = False,
) -> tuple[Tensor, Tensor, Tensor]:
    """``(R, logits, resid_read)`` from the final residual stream of ``groups`` stacked copies of
    ``batch``. Built-in rewards read only the answer positions, so only those are unembedded
    (``resid_read`` is the gathered stream); custom rewards get the full logits.
    ``offset``: ``resid`` holds positions ``offset ..`` only; ``gathered``: ``resid`` already
    holds just the read positions (built-in rewards only)."""
    b = len(batch)
    if getattr(reward_fn, "answer_positions_only", False):
        if not gathered:
            pos = read_positions(batch, offset).to(resid.device).repeat(groups, 1)
            resid = resid.gather(1, pos[..., None].expand(-1, -1, resid.shape[-1]))
        view: Any = ReadoutBatch(batch.answer_targets, batch.candidates, batch.counterfactual)
    else:
        if offset:
            raise ValueError("A custom reward reads the full logits: resume from position 0.")
        view = batch
    logits = M.unembed(model, resid)
    R = torch.cat(
        [
            check_reward_output(reward_fn(logits[g * b : (g + 1) * b], view), b, reward_fn)
            for g in range(groups)
        ]
    )
    return R, logits, resid


def check_reward_output(R: Any, n: int, reward_fn: Any) -> Tensor:
    """A reward must return one finite float per prompt: ``Tensor[batch]``."""
    name = getattr(reward_fn, "__name__", "the reward")
    if not isinstance(R, Tensor):
        raise TypeError(
            f"{name} returned {type(R).__name__}; a reward must return a float Tensor of shape "
            f"[batch] ([{n}] here), one value per prompt."
        )
    if R.shape != (n,):
        raise ValueError(
            f"{name} returned shape {tuple(R.shape)}; a reward must return one value per prompt, "
            f"shape [batch] = [{n}] (reduce over answer tokens or classes inside the reward)."
        )
    if not R.is_floating_point():
        raise TypeError(
            f"{name} returned dtype {R.dtype}; a reward must return floats (e.g. log-probabilities)."
        )
    if not torch.isfinite(R).all():
        raise ValueError(
            f"{name} returned NaN or inf for prompts {torch.nonzero(~torch.isfinite(R)).flatten().tolist()}; "
            "check the reward (a log of 0, a division by 0) and the answers."
        )
    return R


def plan_chunks(
    batch: PromptBatch, rows: Any, batch_size: int | None
) -> tuple[PromptBatch, list[tuple[PromptBatch, list[int]]]]:
    """The prompts to score (``rows`` of ``batch``, or all) and their chunks with global row ids."""
    if batch_size is not None and (
        isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1
    ):
        raise ValueError(
            f"batch_size must be a positive number of prompts per pass (or None for all at once), "
            f"got {batch_size!r}"
        )
    ids = list(range(len(batch))) if rows is None else [int(r) for r in rows]
    if not ids:
        raise ValueError("rows selects no prompts.")
    if any(not 0 <= r < len(batch) for r in ids):
        raise ValueError(f"rows must index the batch (0..{len(batch) - 1}), got {ids}")
    scored = batch if rows is None else batch.subset(ids)
    size = batch_size or len(ids)
    plan = [
        (
            scored.subset(range(i, min(i + size, len(ids))))
            if (batch_size and len(ids) > size)
            else scored,
            ids[i : i + size],
        )
        for i in range(0, len(ids), size)
    ]
    return scored, plan


def head_grad(g_attn: Tensor, W_O: Tensor) -> Tensor:
    """``ŷ_h W_O[h]^T``: the gradient of R at ``hook_z`` from the gradient at ``attn_out``."""
    return torch.einsum("bpd,hed->bphe", g_attn, W_O.to(g_attn.dtype))


def wide(x: Tensor) -> Tensor:
    """Upcast to float32 at least, for differences of nearly equal things."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


# ---------------------------------------------------------------------------------------------
# The ablation constant y* (docs/scores.md §4), aligned by role (docs/scores.md §6)
# ---------------------------------------------------------------------------------------------


class AblationTable:
    """``y*`` for every head (in ``z`` space) and MLP at every role.

    ``mean`` with no reference: the leave-one-out mean over the other prompts of the dataset
    with the same role (a prompt whose role no other prompt has gets its own value: score 0).
    ``mean`` with a reference: the reference prompts' mean per role. ``resample``: the mean of
    ``k`` randomly chosen other prompts (``np.random.default_rng(seed)``), per role. ``zero``: 0.
    Held as tensors: source activations ``[source, pos, ...]`` and a role index per position.
    """

    def __init__(
        self,
        model: nn.Module,
        batch: PromptBatch,
        ablation: Ablation,
        *,
        reference: PromptBatch | None = None,
        k: int = 10,
        seed: int = 3,
        batch_size: int | None = None,
        runs: list[tuple[PromptBatch, Run]] | None = None,
    ) -> None:
        """``runs``: already computed base runs covering the source prompts in order (saves a pass)."""
        if ablation not in ("mean", "zero", "resample"):
            raise ValueError(f"ablation must be 'mean', 'zero' or 'resample', got {ablation!r}")
        if ablation == "resample" and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
            raise ValueError(
                f"resample_k must be a positive number of prompts to average, got {k!r}; "
                "use ablation='zero' for a zero ablation."
            )
        if ablation != "zero" and reference is None and len(batch) < 2:
            raise ValueError(
                f"Upstream scores with ablation={ablation!r} take y* from the batch's other prompts, and this "
                "batch has only one prompt (every upstream score would be 0). Pass more prompts, "
                "reference=make_batch(model, other_pairs), ablation='zero', or kinds=('informative', "
                "'downstream')."
            )
        self.ablation = ablation
        self.has_mlp = M.has_mlp(model)
        self.own_source = reference is None
        if ablation == "zero":
            return
        source = batch if reference is None else reference
        self.roles = {
            r: i
            for i, r in enumerate(
                dict.fromkeys([*source.position_labels(), *batch.position_labels()])
            )
        }
        if runs is None:
            runs = [
                (chunk, forward_run(model, chunk, grad=False))
                for chunk in source.chunks(batch_size)
            ]
        width = max(chunk.n_pos for chunk, _ in runs)
        zs, ms, ids = [], [], []
        for chunk, run in runs:
            pad = width - chunk.n_pos
            zs.append(
                torch.nn.functional.pad(wide(torch.stack(run.z, dim=2)), (0, 0, 0, 0, 0, 0, 0, pad))
            )
            if self.has_mlp:
                ms.append(
                    torch.nn.functional.pad(
                        wide(torch.stack(run.mlp_out, dim=2)), (0, 0, 0, 0, 0, pad)
                    )
                )
            ids.append(self.role_ids(chunk, width))
        self.Z = torch.cat(zs)  # source pos layer head d_head
        self.M = torch.cat(ms) if self.has_mlp else None  # source pos layer d_model
        self.R = torch.cat(ids).to(self.Z.device)  # source pos (-1: padding)
        n_roles = len(self.roles)
        valid = self.R >= 0
        self.count = torch.bincount(self.R[valid], minlength=n_roles)
        if ablation == "mean":
            self.z_sum = self.Z.new_zeros(n_roles, *self.Z.shape[2:]).index_add_(
                0, self.R[valid], self.Z[valid]
            )
            self.m_sum = (
                self.M.new_zeros(n_roles, *self.M.shape[2:]).index_add_(
                    0, self.R[valid], self.M[valid]
                )
                if self.M is not None
                else None
            )
        else:
            rng = np.random.default_rng(seed)
            n_src = self.Z.shape[0]
            self.choices = []
            for i in range(len(batch)):
                pool = [j for j in range(n_src) if not (self.own_source and j == i)]
                self.choices.append(
                    rng.choice(pool, size=min(k, len(pool)), replace=False).tolist()
                )
            # where each role sits in each source prompt (-1: absent)
            self.pos_of = torch.full((n_src, n_roles), -1, dtype=torch.long, device=self.R.device)
            src_idx, pos_idx = valid.nonzero(as_tuple=True)
            self.pos_of[src_idx, self.R[valid]] = pos_idx

    def role_ids(self, chunk: PromptBatch, width: int) -> Tensor:
        ids = torch.full((len(chunk), width), -1, dtype=torch.long)
        for i, roles in enumerate(chunk.roles):
            ids[i, : len(roles)] = torch.tensor([self.roles[r] for r in roles])
        return ids

    def for_rows(
        self, rows: list[int], chunk: PromptBatch, run: Run
    ) -> tuple[Tensor, Tensor | None]:
        """``(z*, mlp*)`` for a chunk: ``[batch, pos, layer, head, d_head]`` and ``[batch, pos, layer, d_model]``."""
        z = wide(torch.stack(run.z, dim=2))
        m = wide(torch.stack(run.mlp_out, dim=2)) if self.has_mlp else None
        if self.ablation == "zero":
            return torch.zeros_like(z), (torch.zeros_like(m) if m is not None else None)
        r = self.role_ids(chunk, chunk.n_pos).to(z.device)
        real = r >= 0
        rr = r.clamp(min=0)
        if self.ablation == "mean":
            c = self.count[rr].to(z.dtype)
            if self.own_source:
                ok = real & (c >= 2)
                scale = (c - 1).clamp(min=1)
                zs = _where(ok, (self.z_sum[rr] - z) / _bc(scale, z), z)
                ms = None if m is None else _where(ok, (self.m_sum[rr] - m) / _bc(scale, m), m)
            else:
                missing = real & (c == 0)
                if missing.any():
                    b, t = missing.nonzero()[0].tolist()
                    raise ValueError(
                        f"No reference prompt has the role {chunk.roles[b][t]!r}; pass a reference "
                        "with aligned roles."
                    )
                zs = self.z_sum[rr] / _bc(c.clamp(min=1), z)
                ms = None if m is None else self.m_sum[rr] / _bc(c.clamp(min=1), m)
            return zs * _bc(real, z), (None if ms is None else ms * _bc(real, m))
        picks = torch.tensor(
            [self.choices[i] for i in rows], dtype=torch.long, device=z.device
        )  # batch k
        pos = self.pos_of[picks[:, None, :], rr[:, :, None]]  # batch pos k
        ok = (pos >= 0) & real[:, :, None]
        w = ok.to(z.dtype)
        n = w.sum(-1)
        zv = self.Z[picks[:, None, :], pos.clamp(min=0)]  # batch pos k layer head d_head
        zs = (zv * _bc(w, zv)).sum(2) / _bc(n.clamp(min=1), z)
        zs = _where(n > 0, zs, z)
        ms = None
        if m is not None:
            mv = self.M[picks[:, None, :], pos.clamp(min=0)]
            ms = _where(n > 0, (mv * _bc(w, mv)).sum(2) / _bc(n.clamp(min=1), m), m)
        return zs * _bc(real, z), (None if ms is None else ms * _bc(real, m))


def _bc(x: Tensor, like: Tensor) -> Tensor:
    """``x`` with trailing singleton axes to broadcast against ``like``."""
    return x.reshape(*x.shape, *([1] * (like.dim() - x.dim()))).to(like.dtype)


def _where(cond: Tensor, a: Tensor, b: Tensor) -> Tensor:
    return torch.where(cond.reshape(*cond.shape, *([1] * (a.dim() - cond.dim()))), a, b)


# ---------------------------------------------------------------------------------------------
# Assembling results
# ---------------------------------------------------------------------------------------------


def assemble(
    model: nn.Module,
    batch: PromptBatch,
    kinds: tuple[ScoreKind, ...],
    per_token: list[Tensor],
    totals: list[Tensor],
    *,
    method: str,
    other: list[Tensor] | None,
    metadata: dict[str, Any],
) -> ComponentScores:
    """Concatenate per-chunk ``[kind, batch, layer, component, pos]`` tensors into ``ComponentScores``."""
    tok = getattr(model, "tokenizer", None)
    if tok is not None and "prompt_tokens" not in metadata:
        metadata["prompt_tokens"] = [
            [tok.decode([int(t)]) for t in batch.tokens[i, : int(batch.lengths[i])].tolist()]
            for i in range(len(batch))
        ]
    metadata.setdefault("prompts_digest", prompts_digest(batch))
    width = batch.n_pos
    pv = torch.cat([torch.nn.functional.pad(v, (0, width - v.shape[-1])) for v in per_token], dim=1)
    pt = torch.cat(totals, dim=1)
    labels = batch.position_labels()
    values = aggregate_by_role(pv, batch.roles, labels)
    return ComponentScores(
        values=values.cpu(),
        totals=pt.mean(1).cpu(),
        prompt_values=pv.cpu(),
        prompt_totals=pt.cpu(),
        kinds=kinds,
        component_labels=component_axis_labels(model.cfg.n_heads, M.has_mlp(model)),
        position_labels=labels,
        prompt_roles=batch.roles,
        method=method,  # type: ignore[arg-type]
        other=None if other is None else torch.cat(other).cpu(),
        metadata=metadata,
    )


def prompts_digest(batch: PromptBatch) -> str:
    """A short fingerprint of the token ids scored (to tell whether two results scored the same prompts)."""
    import hashlib

    h = hashlib.sha1()
    for i in range(len(batch)):
        h.update(batch.tokens[i, : int(batch.lengths[i])].cpu().numpy().astype("int64").tobytes())
        h.update(b"|")
    return h.hexdigest()[:16]


def base_metadata(model: nn.Module, diff: Any, **extra: Any) -> dict[str, Any]:
    """What a result must carry to be compared or reproduced (call outside ``computing_in``)."""
    import transformer_lens

    meta = {
        "model": model.cfg.model_name,
        "architecture": model.cfg.original_architecture,
        "dtype": str(model.cfg.dtype),
        "weights_processed": M.weights_processed(model),
        "diff_norms": diff.norms().tolist(),
        "diff_other_norm": diff.other_norm(),
        "versions": {
            "torch": torch.__version__,
            "transformer_lens": getattr(transformer_lens, "__version__", "unknown"),
            "python": platform.python_version(),
        },
    }
    meta.update(extra)
    return meta


def check_arguments(
    fn: str, model: Any, diff: Any = None, batch: Any = None, *, need_diff: bool = True
) -> None:
    """Catch the common argument mix-ups with an error that says what to pass instead."""
    from extractive_lens.weight_diff import WeightDiff

    call = f"{fn}(model, diff, batch)" if need_diff else f"{fn}(model, batch)"
    if torch.is_inference_mode_enabled():
        raise RuntimeError(
            f"{call} cannot run inside torch.inference_mode(): it needs gradients and restores "
            "weights in place. Call it outside the inference_mode block (torch.no_grad() is fine)."
        )
    if not isinstance(model, nn.Module) or not hasattr(model, "cfg"):
        raise TypeError(
            f"{call}: model must be a HookedTransformer, got {type(model).__name__}. "
            "Load one with load_pretrained(name), load_checkpoint(dir) or load_world_model()."
        )
    if need_diff and not isinstance(diff, WeightDiff):
        hint = (
            "pass the weight change instead: WeightDiff.from_models(base, finetuned)"
            if isinstance(diff, nn.Module)
            else "build one with WeightDiff.from_models(base, finetuned)"
        )
        raise TypeError(f"{call}: diff must be a WeightDiff, got {type(diff).__name__}; {hint}.")
    if batch is not None and not isinstance(batch, PromptBatch):
        raise TypeError(
            f"{call}: batch must be a PromptBatch, got {type(batch).__name__}; "
            "build one with make_batch(model, [(prompt, answer), ...])."
        )


def resolve_kinds(kinds: Any) -> tuple[ScoreKind, ...]:
    from extractive_lens.types import SCORE_KINDS

    if isinstance(kinds, str):
        kinds = (kinds,)
    kinds = tuple(kinds)
    bad = [k for k in kinds if k not in SCORE_KINDS]
    if bad or not kinds:
        raise ValueError(f"kinds must be a non-empty subset of {SCORE_KINDS}, got {kinds}")
    return tuple(k for k in SCORE_KINDS if k in kinds)


def progress(iterable: Any, total: int, desc: str, enabled: bool | None) -> Any:
    if enabled is False or (enabled is None and total <= 1):
        return iterable
    from tqdm.auto import tqdm

    return tqdm(iterable, total=total, desc=desc, leave=False)

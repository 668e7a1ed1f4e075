"""Engine internals shared by the linear and causal scores: cached runs, y*, result assembly.

Notation follows SPEC §4–5. A head's output ``y_h = z_h W_O[h]``; its gradient
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
        return torch.zeros(self.answer_targets.shape[0], dtype=torch.long, device=self.answer_targets.device)

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
    model: nn.Module, resid: Tensor, batch: Any, reward_fn: Any, groups: int = 1, offset: int = 0,
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
    R = torch.cat([reward_fn(logits[g * b : (g + 1) * b], view) for g in range(groups)])
    return R, logits, resid


def head_grad(g_attn: Tensor, W_O: Tensor) -> Tensor:
    """``ŷ_h W_O[h]^T``: the gradient of R at ``hook_z`` from the gradient at ``attn_out``."""
    return torch.einsum("bpd,hed->bphe", g_attn, W_O.to(g_attn.dtype))


def wide(x: Tensor) -> Tensor:
    """Upcast to float32 at least, for differences of nearly equal things."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


# ---------------------------------------------------------------------------------------------
# The ablation constant y* (SPEC §4), aligned by role (SPEC §6)
# ---------------------------------------------------------------------------------------------


class AblationTable:
    """``y*`` for every head (in ``z`` space) and MLP at every role.

    ``mean`` with no reference: the leave-one-out mean over the other prompts of the dataset
    with the same role (a prompt whose role no other prompt has gets its own value: score 0).
    ``mean`` with a reference: the reference prompts' mean per role. ``resample``: the mean of
    ``k`` randomly chosen other prompts (``np.random.default_rng(seed)``), per role. ``zero``: 0.
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
        self.ablation = ablation
        self.model = model
        self.batch = batch
        self.has_mlp = M.has_mlp(model)
        self.own_source = reference is None
        if ablation == "zero":
            return
        source = batch if reference is None else reference
        self.roles = source.roles
        # per source prompt, role -> (z [L, H, dh], mlp [L, dm])
        self.z_src: list[dict[str, Tensor]] = []
        self.m_src: list[dict[str, Tensor]] = []
        if runs is None:
            runs = [(chunk, forward_run(model, chunk, grad=False)) for chunk in source.chunks(batch_size)]
        for chunk, run in runs:
            z = torch.stack(run.z, dim=2)  # batch pos layer head d_head
            m = torch.stack(run.mlp_out, dim=2) if self.has_mlp else None
            for i, roles in enumerate(chunk.roles):
                self.z_src.append({r: wide(z[i, t]) for t, r in enumerate(roles)})
                self.m_src.append({r: wide(m[i, t]) for t, r in enumerate(roles)} if m is not None else {})
        if ablation == "mean":
            self.z_sum: dict[str, Tensor] = {}
            self.m_sum: dict[str, Tensor] = {}
            self.count: dict[str, int] = {}
            for zs, ms in zip(self.z_src, self.m_src):
                for r, v in zs.items():
                    self.z_sum[r] = self.z_sum.get(r, 0) + v
                    self.count[r] = self.count.get(r, 0) + 1
                    if ms:
                        self.m_sum[r] = self.m_sum.get(r, 0) + ms[r]
        else:
            rng = np.random.default_rng(seed)
            n_src = len(self.z_src)
            self.choices = []
            for i in range(len(batch)):
                pool = [j for j in range(n_src) if not (self.own_source and j == i)]
                self.choices.append(rng.choice(pool, size=min(k, len(pool)), replace=False).tolist())

    def for_rows(self, rows: list[int], chunk: PromptBatch, run: Run) -> tuple[Tensor, Tensor | None]:
        """``(z*, mlp*)`` for a chunk: ``[batch, pos, layer, head, d_head]`` and ``[batch, pos, layer, d_model]``."""
        z = torch.stack(run.z, dim=2)
        m = torch.stack(run.mlp_out, dim=2) if self.has_mlp else None
        zs = torch.zeros_like(wide(z))
        ms = torch.zeros_like(wide(m)) if m is not None else None
        if self.ablation == "zero":
            return zs, ms
        for b, (i, roles) in enumerate(zip(rows, chunk.roles)):
            for t, r in enumerate(roles):
                zv, mv = self._value(i, r)
                if zv is None:  # no other prompt has this role: ablate to itself (score 0)
                    zs[b, t] = wide(z[b, t])
                    if ms is not None:
                        ms[b, t] = wide(m[b, t])
                    continue
                zs[b, t] = zv
                if ms is not None:
                    ms[b, t] = mv
        return zs, ms

    def _value(self, i: int, role: str) -> tuple[Tensor | None, Tensor | None]:
        if self.ablation == "mean":
            if role not in self.count:
                if self.own_source:
                    return None, None
                raise ValueError(f"No reference prompt has the role {role!r}; pass a reference with aligned roles.")
            zsum, msum, c = self.z_sum[role], self.m_sum.get(role), self.count[role]
            if self.own_source:
                if c < 2:
                    return None, None
                own_z, own_m = self.z_src[i][role], self.m_src[i].get(role)
                return (zsum - own_z) / (c - 1), (None if msum is None else (msum - own_m) / (c - 1))
            return zsum / c, (None if msum is None else msum / c)
        picks = [j for j in self.choices[i] if role in self.z_src[j]]
        if not picks:
            return None, None
        zv = torch.stack([self.z_src[j][role] for j in picks]).mean(0)
        mv = torch.stack([self.m_src[j][role] for j in picks]).mean(0) if self.has_mlp else None
        return zv, mv


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
            [tok.decode([int(t)]) for t in batch.tokens[i, : int(batch.lengths[i])].tolist()] for i in range(len(batch))
        ]
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


def base_metadata(model: nn.Module, diff: Any, **extra: Any) -> dict[str, Any]:
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

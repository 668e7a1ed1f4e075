"""The ablation constant ``y*`` of the upstream scores (docs/scores.md §4), aligned by role
(docs/scores.md §6)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import Tensor

from extractive_lens import backend as B
from extractive_lens.arguments import count
from extractive_lens.batch import PromptBatch
from extractive_lens.scoring.runs import Run, forward_run, wide
from extractive_lens.types import Ablation


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
        model: Any,
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
        if ablation == "resample":
            k = count("resample_k", k, "prompts to average",
                      hint="; use ablation='zero' for a zero ablation.")  # fmt: skip
        if ablation != "zero" and reference is None and len(batch) < 2:
            raise ValueError(
                f"Upstream scores with ablation={ablation!r} take y* from the batch's other prompts, and this "
                "batch has only one prompt (every upstream score would be 0). Pass more prompts, "
                "reference=make_batch(model, other_pairs), ablation='zero', or kinds=('informative', "
                "'downstream')."
            )
        self.ablation = ablation
        self.has_mlp = B.has_mlp(model)
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
        self.M: Any = torch.cat(ms) if self.has_mlp else None  # source pos layer d_model
        self.R = torch.cat(ids).to(self.Z.device)  # source pos (-1: padding)
        n_roles = len(self.roles)
        valid = self.R >= 0
        self.count = torch.bincount(self.R[valid], minlength=n_roles)
        if ablation == "mean":
            self.z_sum = self.Z.new_zeros(n_roles, *self.Z.shape[2:]).index_add_(
                0, self.R[valid], self.Z[valid]
            )
            self.m_sum: Any = (
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
        self, rows: list[int], chunk: PromptBatch, run: Run, layers: slice = slice(None)
    ) -> tuple[Tensor, Tensor | None]:
        """``(z*, mlp*)`` for a chunk: ``[batch, pos, layer, head, d_head]`` and ``[batch, pos, layer, d_model]``.

        ``layers``: only these layers (a scoring pass that reads one layer's ``y*`` at a time
        forms that layer's alone, not ``y*`` of every layer at once); the values are the same."""
        z = wide(torch.stack(run.z[layers], dim=2))
        m = wide(torch.stack(run.mlp_out[layers], dim=2)) if self.has_mlp else None
        if self.ablation == "zero":
            return torch.zeros_like(z), (torch.zeros_like(m) if m is not None else None)
        r = self.role_ids(chunk, chunk.n_pos).to(z.device)
        real = r >= 0
        rr = r.clamp(min=0)
        if self.ablation == "mean":
            c = self.count[rr].to(z.dtype)
            z_sum = self.z_sum[:, layers]
            m_sum: Any = None if m is None else self.m_sum[:, layers]
            if self.own_source:
                ok = real & (c >= 2)
                scale = (c - 1).clamp(min=1)
                zs = _where(ok, (z_sum[rr] - z) / _bc(scale, z), z)
                ms = None if m is None else _where(ok, (m_sum[rr] - m) / _bc(scale, m), m)
            else:
                missing = real & (c == 0)
                if missing.any():
                    b, t = missing.nonzero()[0].tolist()
                    raise ValueError(
                        f"No reference prompt has the role {chunk.roles[b][t]!r}; pass a reference "
                        "with aligned roles."
                    )
                zs = z_sum[rr] / _bc(c.clamp(min=1), z)
                ms = None if m is None else m_sum[rr] / _bc(c.clamp(min=1), m)
            return zs * _bc(real, z), (None if ms is None else ms * _bc(real, m))  # type: ignore[arg-type]
        picks = torch.tensor(
            [self.choices[i] for i in rows], dtype=torch.long, device=z.device
        )  # batch k
        pos = self.pos_of[picks[:, None, :], rr[:, :, None]]  # batch pos k
        ok = (pos >= 0) & real[:, :, None]
        w = ok.to(z.dtype)
        n = w.sum(-1)
        at = (picks[:, None, :], pos.clamp(min=0))
        zv = self.Z[:, :, layers][at]  # batch pos k layer head d_head
        zs = (zv * _bc(w, zv)).sum(2) / _bc(n.clamp(min=1), z)
        zs = _where(n > 0, zs, z)
        ms = None
        if m is not None:
            mv = self.M[:, :, layers][at]
            ms = _where(n > 0, (mv * _bc(w, mv)).sum(2) / _bc(n.clamp(min=1), m), m)
        return zs * _bc(real, z), (None if ms is None else ms * _bc(real, m))  # type: ignore[arg-type]


def table_for(
    model: Any, batch: PromptBatch, options: Any, chunks: list[PromptBatch], first: Run
) -> AblationTable | None:
    """The y* table of a scoring call (``None`` without upstream scores); reuses the first
    chunk's base run when it covers the whole batch."""
    if "upstream" not in options.kinds:
        return None
    single = options.reference is None and options.rows is None and len(chunks) == 1
    return AblationTable(
        model, batch, options.ablation, reference=options.reference, k=options.resample_k,
        seed=options.seed, batch_size=options.batch_size,
        runs=[(chunks[0], first)] if single else None,
    )  # fmt: skip


def _bc(x: Tensor, like: Tensor) -> Tensor:
    """``x`` with trailing singleton axes to broadcast against ``like``."""
    return x.reshape(*x.shape, *([1] * (like.dim() - x.dim()))).to(like.dtype)


def _where(cond: Tensor, a: Tensor, b: Tensor) -> Tensor:
    return torch.where(cond.reshape(*cond.shape, *([1] * (a.dim() - cond.dim()))), a, b)

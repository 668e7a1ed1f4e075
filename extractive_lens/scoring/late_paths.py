"""Integrated scores' rows in the layer-major pass (where gradients go one layer at a time).

``run_layer_major`` puts informative's nodes, the finetuned run (downstream's patches read it)
and upstream's finetuned-late paths in one ``nodes.layer_major`` pass, so each layer's Δ is read
once forward and once backward for all of them; ``LatePath`` is one component group's path
integral in the finetuned-late context as rows of that pass, and ``result()`` gives what
``integrated._path_integral`` gives for it through the whole graph.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import Tensor

from extractive_lens.scoring import passes
from extractive_lens.scoring.causal import CausalChunk, patch_groups
from extractive_lens.scoring.nodes import Entry, layer_major
from extractive_lens.scoring.options import CausalOptions
from extractive_lens.scoring.runs import wide


@dataclass
class Done:
    """The layer-major pass's results for one chunk: informative's ``(Σ, other, R(W') -
    R(W))`` (``None`` without it) and upstream's finetuned-late paths by ``(layer, group)``."""

    informative: Any
    late: dict[tuple[int, str], LatePath]


def run_layer_major(
    cc: CausalChunk, options: CausalOptions, path: str, skipped: dict[str, list[str]],
    xs: list[float], ws: list[float],
) -> Done:  # fmt: skip
    """The informative nodes, the finetuned run (downstream's patches read it) and upstream's
    finetuned-late paths in one layer-major pass (``nodes.layer_major``: each layer's Δ read
    once forward, once backward for all of them)."""
    from extractive_lens.scoring.linear import LinearOptions

    kinds = options.score_kinds
    late: dict[tuple[int, str], LatePath] = {}
    if "upstream" in kinds:
        for layer, group, d, _ in patch_groups(cc, "upstream", skipped.get("upstream", [])):
            late[(layer, group)] = LatePath(cc, layer, group, d, path, options.max_batch, xs, ws)
    informative = "informative" in kinds
    lin_options = LinearOptions(kinds=("informative",), reward=options.reward_fn,
                                ablation=options.ablation, rows=None)  # fmt: skip
    done = layer_major(
        cc.model, cc.diff, cc.batch, options.reward_fn, xs=xs if informative else (),
        ws=ws if informative else (), options=lin_options, finetuned="downstream" in kinds,
        entries=[e for lp in late.values() for e in lp.entries],
    )  # fmt: skip
    ft = done.finetuned
    if ft is not None:
        cc.cached("finetuned_run", lambda: ft)
    result = None
    if informative:
        assert ft is not None
        change = wide(cast(Tensor, ft.reward)) - wide(cast(Tensor, cc.base.reward))
        result = (done.informative, done.other, change)
    return Done(result, late)


class LatePath:
    """A group's path integral in the finetuned-late context as rows of the layer-major pass
    (``nodes.Entry``): the path's rows ``x + x_iδ_p`` (with their gradient), the endpoints
    ``x + δ_p`` and the context's ``x``, entering the finetuned model at the group's boundary;
    ``result()`` after the pass is ``_path_integral``'s."""

    def __init__(self, cc: CausalChunk, layer: int, group: str, delta: Tensor,
                 path: str, max_batch: int, xs: list[float], ws: list[float]) -> None:  # fmt: skip
        x0, start = passes.entry(cc.model, cc.diff, cc.base, layer, group)
        d = delta.to(x0.dtype)
        if path == "layer":
            d = d.sum(2, keepdim=True)
        b = x0.shape[0]
        self.delta, self.d, self.ws, self.path = delta, d, ws, path
        paths = d.shape[2]
        per_pass = max(1, max_batch // b)
        jobs = [(i, p) for i in range(len(xs)) for p in range(paths)]

        def rows(part: list[tuple[float, int]]) -> Any:
            return lambda: torch.cat([x0 + a * d[:, :, p] for a, p in part])

        self.jobs = [jobs[j : j + per_pass] for j in range(0, len(jobs), per_pass)]
        self.grads = [Entry(start, len(part), rows([(xs[i], p) for i, p in part]), True)
                      for part in self.jobs]  # fmt: skip
        ends = [list(range(j, min(j + per_pass, paths))) for j in range(0, paths, per_pass)]
        self.ends = [(ps, Entry(start, len(ps), rows([(1.0, p) for p in ps]), False))
                     for ps in ends]  # fmt: skip
        self.context = Entry(start, 1, lambda: x0, False)
        self.entries = [*self.grads, *(e for _, e in self.ends), self.context]

    def result(self) -> tuple[Tensor, Tensor]:
        """``(integrand [batch, comp, pos], endpoint differences)`` as ``_path_integral``."""
        b, pos, n_comp, _ = self.delta.shape
        g0 = cast(Tensor, self.grads[0].g)
        integrand = torch.zeros(b, n_comp, pos, dtype=wide(g0).dtype, device=g0.device)
        for part, e in zip(self.jobs, self.grads):
            g = cast(Tensor, e.g)
            for r, (i, p) in enumerate(part):
                gi = wide(g[r * b : (r + 1) * b])
                if self.path == "layer":
                    integrand += self.ws[i] * torch.einsum("bpd,bpcd->bcp", gi, wide(self.delta))
                else:
                    integrand[:, p] += self.ws[i] * (gi * wide(self.d[:, :, p])).sum(-1)
        R0 = wide(cast(Tensor, self.context.reward))
        ends = torch.zeros(b, self.d.shape[2], dtype=R0.dtype, device=R0.device)
        for ps, e in self.ends:
            ends[:, ps] = wide(cast(Tensor, e.reward)).reshape(len(ps), b).T - R0[:, None]
        return integrand, (ends[:, 0] if self.path == "layer" else ends)

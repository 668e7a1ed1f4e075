"""Passes counted while a scoring call runs: the unit of ``verified_scores``' budget.

>>> from extractive_lens import linear_scores
>>> with counting_passes(base, batch) as count:
...     _ = linear_scores(base, diff, batch, kinds="informative")
>>> count.forward, count.backward, count.passes
(3.0, 1.0, 4.0)

**One pass** is the batch (its prompts × its padded positions) through every piece of every
block once: each run of a block's attention or MLP on ``rows × pos`` tokens counts
``rows · pos / (prompts · n_pos · pieces)``, where ``pieces`` is the model's number of pieces
(two per block; one in an attention-only model). So a plain forward of the batch is 1, a forward
resumed after layer ``l`` of ``L`` is ``(L − l − 1) / L``, a suffix of the positions (a key/value
prefix cached) counts only the positions it runs, and an exact intervention's rows count as many
prompts. A backward through a piece counts as its forward did (``backward``, kept apart):
``passes = forward + backward``. A block run anywhere (an engine, ``run_blocks``, a kind's own
call) goes through the backend's ``attention`` and ``mlp``, which is where the count is taken.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from extractive_lens import backend as B


@dataclass
class PassCount:
    """Forward and backward passes counted so far (module docstring)."""

    unit: float  # tokens of one pass: prompts · n_pos · pieces
    forward_tokens: float = 0.0
    backward_tokens: float = 0.0

    @property
    def forward(self) -> float:
        return self.forward_tokens / self.unit

    @property
    def backward(self) -> float:
        return self.backward_tokens / self.unit

    @property
    def passes(self) -> float:
        return self.forward + self.backward


class _Backward(torch.autograd.Function):
    """The identity, counting a piece's tokens when the backward goes through it."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, count: PassCount, tokens: float) -> torch.Tensor:
        ctx.count, ctx.tokens = count, tokens
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        ctx.count.backward_tokens += ctx.tokens
        return grad, None, None


@contextmanager
def counting_passes(model: Any, batch: Any) -> Iterator[PassCount]:
    """Count the passes (module docstring) of everything run on ``model`` inside the block,
    in units of ``batch``."""
    pieces = 1 if model.cfg.attn_only else 2
    count = PassCount(unit=float(len(batch) * batch.n_pos * model.cfg.n_layers * pieces))
    attention, mlp = B.attention, B.mlp

    def counted(out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        tokens = float(x.shape[0] * x.shape[1]) if x.dim() == 3 else float(x.shape[0])
        count.forward_tokens += tokens
        if torch.is_grad_enabled() and out.requires_grad:
            return _Backward.apply(out, count, tokens)
        return out

    def counting_attention(m: Any, layer: int, x: torch.Tensor, *args: Any, **kw: Any) -> Any:
        out, captured = attention(m, layer, x, *args, **kw)
        return (counted(out, x) if m is model else out), captured

    def counting_mlp(m: Any, layer: int, x: torch.Tensor) -> torch.Tensor:
        out = mlp(m, layer, x)
        return counted(out, x) if m is model else out

    B.attention, B.mlp = counting_attention, counting_mlp  # type: ignore[assignment]
    try:
        yield count
    finally:
        B.attention, B.mlp = attention, mlp

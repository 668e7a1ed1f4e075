"""The block runner: the one loop over transformer blocks that every engine and view uses.

``run_blocks`` continues a forward pass from a boundary inside the model to the end (or to a
stop layer), built from a backend's pieces (``attention``, ``mlp``), so that block composition —
sequential, parallel (attention and MLP read the same input) or attention-only, and where head
and MLP outputs re-enter the stream — is written once::

    x = B.embed(model, tokens)
    x = run_blocks(model, x)                                  # the full forward, up to ln_final
    x = run_blocks(model, x_mid, start=(3, "mid"))            # resume after layer 3's heads
    x = run_blocks(model, x, past_kv=kv, read_pos=pos)        # a suffix, reading some positions

Boundaries: ``(layer, "pre")`` is the stream entering ``layer``; ``(layer, "mid")`` the stream
after its heads, before its MLP (sequential blocks only); ``(layer, "post")`` the stream after it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from torch import Tensor

Where = Literal["pre", "mid", "post"]
Entry = Literal["attn", "mlp"]


@dataclass
class LayerRun:
    """What the runner computed in one layer (live tensors: they carry autograd history)."""

    layer: int
    pre: Tensor
    attn_out: Tensor
    captured: dict[str, Tensor]
    mid: Tensor
    mlp_in: Tensor | None
    mlp_out: Tensor | None
    post: Tensor


def run_blocks(
    model: Any,
    x: Tensor | None,
    *,
    start: tuple[int, Where] = (0, "pre"),
    stop: int | None = None,
    capture: tuple[str, ...] = (),
    past_kv: Mapping[int, tuple[Tensor, Tensor]] | None = None,
    read_pos: Tensor | None = None,
    inject: Callable[[int, Entry, Tensor | None], Tensor | None] | None = None,
    observe: Callable[[LayerRun], None] | None = None,
) -> Tensor | None:
    """Run the blocks from boundary ``start`` up to layer ``stop`` (default: all), return the stream.

    Args:
        x: the stream at ``start``: ``[rows, pos, d_model]``. ``None`` with ``inject``: nothing
            runs until ``inject`` returns the first rows.
        capture: attention hook values to record per layer (``"z"``, ``"q"``, ``"k"``, ``"v"``,
            ``"pattern"``), handed to ``observe``.
        past_kv: per layer, keys and values of earlier positions (then ``x`` holds only the
            positions after them).
        read_pos: ``[rows, K]`` positions (of ``x``) the caller will read: the last layer's MLP
            runs on those alone and the gathered stream ``[rows, K, d_model]`` is returned.
        inject: ``inject(layer, "attn" | "mlp", x) -> x`` is called where that layer's heads
            (``"attn"``) and MLP (``"mlp"``) outputs have entered the stream (for parallel
            blocks both after the layer); what it returns continues (it may add rows).
        observe: called with each layer's ``LayerRun``.
    """
    from extractive_lens import backend as B

    n_layers = model.cfg.n_layers
    stop = n_layers if stop is None else stop
    has_mlp, parallel = B.has_mlp(model), B.parallel(model)
    layer, where = start
    if where == "mid":
        if parallel or not has_mlp:
            raise ValueError("(layer, 'mid') is a boundary of sequential blocks with an MLP only.")
        if x is not None:
            x = x + B.mlp(model, layer, x)
        if inject is not None:
            x = inject(layer, "mlp", x)
        layer += 1
    elif where == "post":
        layer += 1
    if read_pos is not None and layer >= n_layers and x is not None:
        return _gather(x, read_pos)
    for l in range(layer, stop):
        last = read_pos is not None and l == n_layers - 1
        out = captured = mid = m_in = m_out = None
        pre = x
        if x is not None:
            x = B.on_block(model, l, x)
            pre = x
            out, captured = B.attention(
                model, l, x, capture, past_kv=None if past_kv is None else past_kv[l]
            )
            mid = x + out
        if parallel and has_mlp:
            if x is not None and mid is not None:
                m_in = x
                m_out = B.mlp(model, l, x)
                x = mid + m_out
            if inject is not None:
                x = inject(l, "attn", x)
                x = inject(l, "mlp", x)
        else:
            x = mid
            if inject is not None:
                x = inject(l, "attn", x)
            if last and x is not None:
                x = _gather(x, read_pos)  # type: ignore[arg-type]
            if has_mlp:
                if x is not None:
                    m_in = x
                    m_out = B.mlp(model, l, x)
                    x = x + m_out
                if inject is not None:
                    x = inject(l, "mlp", x)
            last = False
        if last and x is not None:
            x = _gather(x, read_pos)  # type: ignore[arg-type]
        if observe is not None and pre is not None:
            observe(LayerRun(l, pre, out, captured, mid, m_in, m_out, x))  # type: ignore[arg-type]
    return x


def _gather(x: Tensor, pos: Tensor) -> Tensor:
    """``x[row, pos[row, k]]``: ``[rows, K, d_model]``."""
    return x.gather(1, pos[..., None].expand(-1, -1, x.shape[-1]))

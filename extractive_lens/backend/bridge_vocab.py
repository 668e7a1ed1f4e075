"""A ``TransformerBridge``'s vocabulary matrices read a part at a time (``backend/vocab.py``):
which stored tensors they are (``vocab_matrices``), whether this model reads them by part
(``by_part``), and the embedding given only the batch's rows of ``W_E + αΔ`` (``rows_only``).
The unembedding's columns are taken by ``vocab.logits`` in ``bridge.unembed``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor, nn

from extractive_lens.backend import shift, vocab
from extractive_lens.backend.compute import (
    compute_dtype,
    deferred_tangent,
    substituted,
    this_thread_only,
)


def vocab_matrices(model: Any) -> dict[str, tuple[Tensor, bool]]:
    """The vocabulary matrices ``backend/vocab.py`` may read a part at a time: the wrapped
    model's token embedding (an ``nn.Embedding``: ``embed.W_E`` as stored) and its output
    layer (an ``nn.Linear``, ``[d_vocab, d_model]``: ``unembed.W_U`` transposed), the same
    tensor where they are tied (GPT-2). Others (a processed bridge's own copies, an embedding
    that renormalises its rows) are run whole."""
    out: dict[str, tuple[Tensor, bool]] = {}
    e = getattr(model, "embed", None)
    emb = getattr(e, "original_component", None)
    processed = getattr(e, "_use_processed_weights", False)
    if isinstance(emb, nn.Embedding) and emb.max_norm is None and not processed:
        out["embed.W_E"] = (emb.weight, False)
    u = getattr(model, "unembed", None)
    head = getattr(u, "original_component", None)
    processed = u is not None and u._parameters.get("_processed_W_U") is not None
    if type(head) is nn.Linear and not processed:
        out["unembed.W_U"] = (head.weight, True)
    return out


def by_part(model: Any, name: str) -> Tensor | None:
    """The stored matrix of ``name`` where it is read a part at a time, else ``None``."""
    found = vocab_matrices(model).get(name)
    return found[0] if found is not None and vocab.by_part(model, found[0]) else None


def _name_of(model: Any, p: Tensor) -> str:
    return next(n for n, q in model.named_parameters() if q is p)


@contextlib.contextmanager
def rows_only(model: Any, p: Tensor, tokens: Tensor) -> Iterator[None]:
    """Inside the block the wrapped embedding holds only the rows of ``W_E + α·Δ_E`` that
    ``tokens`` use (``vocab.rows``: Δ read for them only) and is given the tokens renumbered
    into them: its output is the whole matrix's, the matrix is never formed."""
    used, inverse = torch.unique(tokens, return_inverse=True)
    dtype = compute_dtype() or p.dtype
    rows = vocab.rows(p, used, dtype, shift.active(p), deferred_tangent(p))
    emb = model.embed.original_component

    def renumber(_m: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if args:
            return (inverse.to(args[0].device), *args[1:]), kwargs
        return args, {**kwargs, "input": inverse.to(kwargs["input"].device)}

    handle = emb.register_forward_pre_hook(this_thread_only(renumber), with_kwargs=True)
    try:
        with substituted(model, {"model." + _name_of(model, p): rows}):
            yield
    finally:
        handle.remove()

"""Whether TransformerLens processed a model's weights, read from the model itself.

>>> processing_found(model)          # an unprocessed model                    # doctest: +SKIP
()
>>> model.process_weights_()         # HookedTransformer.from_pretrained's default  # doctest: +SKIP
>>> processing_found(model)                                                     # doctest: +SKIP
('fold_ln', 'center_writing_weights', 'center_unembed')

The scores are defined on the weights as trained (docs/scores.md §1): folding LayerNorm weights
into the next layer and centring the weights that write to the residual stream change what a
weight change Δ means (and are not linear in the weights), so a score of a processed model is a
score of another model. ``from_pretrained`` processes by default, so this is how most
TransformerLens users hold a model. What is looked at:

- ``fold_ln``: ``cfg.normalization_type`` ``"LNPre"`` / ``"RMSPre"`` (LayerNorm without weights:
  they were folded into the next layer).
- ``center_writing_weights``: the weights that write to the stream (``W_O``, ``W_out`` of the
  first layer, ``W_E``) have zero mean over ``d_model``, row by row; trained or randomly
  initialised weights never do.
- ``center_unembed``: ``W_U`` has zero mean over the vocabulary, row by row.
- ``fold_value_biases`` (``from_pretrained``'s default even with ``fold_ln=False,
  center_writing_weights=False, center_unembed=False``; ``process_weights_`` always does it):
  every layer's value bias ``b_V`` is exactly zero while some output bias ``b_O`` is not (the
  folding moved ``b_V @ W_O`` into ``b_O``). A model whose value biases are zero anyway (Llama,
  Mistral, Gemma: no attention biases) is unchanged by the folding and not flagged.
- ``refactor_factored_attn_matrices``: every head of the first attention layer has ``W_O`` with
  orthonormal rows (``W_O[h] W_O[h]ᵀ = I``), which the refactoring's SVD makes and trained
  weights never have.
- on a ``TransformerBridge``: ``process_weights()`` (which ``enable_compatibility_mode()`` runs by
  default) sets its ``_weights_processed`` flag.

``backend.check_unprocessed`` refuses such a model with a sentence that says how to load it unprocessed;
a model loaded with ``load_pretrained(..., process_weights=True)`` opted in and is scored, with
``weights_processed`` recorded in every result.
"""

from __future__ import annotations

from typing import Any

import torch

CENTRED = 1e-3
"""A row counts as centred when |its mean| is at most this fraction of its standard deviation
(a random row of width d is off by about 1/sqrt(d); float rounding of a centred one by ~1e-6)."""
ROWS = 256
"""How many rows of each matrix are looked at (the check stays cheap on 8B models)."""

_WRITING = ("blocks.0.attn.W_O", "blocks.0.mlp.W_out", "embed.W_E")


def _centred(w: torch.Tensor, dim: int) -> bool:
    """Whether every row of ``w`` (rows: the other axes, first ``ROWS``) has mean 0 along ``dim``."""
    w = w.detach().movedim(dim, -1).reshape(-1, w.shape[dim])[:ROWS].double()
    if w.shape[-1] < 2 or not bool(w.abs().max() > 0):
        return False
    return bool((w.mean(-1).abs() <= CENTRED * w.std(-1).clamp_min(1e-30)).all())


def _is_bridge(model: Any) -> bool:
    return hasattr(model, "_weights_processed") or hasattr(model, "compatibility_mode")


def processing_found(model: Any) -> tuple[str, ...]:
    """The TransformerLens weight processing found on ``model`` (``()``: none; module doc)."""
    found: list[str] = []
    if _is_bridge(model):
        if getattr(model, "_weights_processed", False):
            found.append("process_weights (enable_compatibility_mode)")
        return tuple(found)
    if getattr(model.cfg, "normalization_type", None) in ("LNPre", "RMSPre"):
        found.append("fold_ln")
    params = dict(model.named_parameters())
    writing = [params[n] for n in _WRITING if n in params]
    if writing and all(_centred(w, w.ndim - 1) for w in writing):
        found.append("center_writing_weights")
    if "unembed.W_U" in params and _centred(params["unembed.W_U"].T, 0):
        found.append("center_unembed")
    if _value_biases_folded(params, model.cfg.n_layers):
        found.append("fold_value_biases")
    if _attention_refactored(params):
        found.append("refactor_factored_attn_matrices")
    return tuple(found)


def _value_biases_folded(params: dict[str, torch.Tensor], n_layers: int) -> bool:
    """``b_V`` zero in every layer that has one, ``b_O`` not zero in some."""
    b_V = [params.get(f"blocks.{i}.attn.b_V", params.get(f"blocks.{i}.attn._b_V"))
           for i in range(n_layers)]  # fmt: skip
    b_O = [params.get(f"blocks.{i}.attn.b_O") for i in range(n_layers)]
    values = [b for b in b_V if b is not None]
    outputs = [b for b in b_O if b is not None]
    return bool(values and outputs and not any(bool(b.detach().any()) for b in values)
                and any(bool(b.detach().any()) for b in outputs))  # fmt: skip


ORTHONORMAL = 1e-4
"""``W_O[h]`` counts as having orthonormal rows when ``W_O[h] W_O[h]ᵀ`` is within this of the
identity everywhere (float32 rounding of the SVD's factors: about 1e-6; trained weights: far)."""


def _attention_refactored(params: dict[str, torch.Tensor]) -> bool:
    """Every head of layer 0 writes through a ``W_O`` with orthonormal rows."""
    W_O = params.get("blocks.0.attn.W_O")
    if W_O is None:
        return False
    w = W_O.detach().double()  # [head, d_head, d_model]
    gram = w @ w.transpose(-1, -2)
    eye = torch.eye(w.shape[1], dtype=w.dtype, device=w.device)
    return bool((gram - eye).abs().max() <= ORTHONORMAL)


def refusal(model: Any, what: str) -> str | None:
    """Why ``what`` refuses ``model`` (``None``: its weights are as trained). A model loaded
    processed on purpose is not asked: ``backend.check_unprocessed`` reads that note first."""
    found = processing_found(model)
    if not found:
        return None
    if _is_bridge(model):
        how = (
            "boot a fresh bridge (TransformerBridge.boot_transformers(...), or "
            "el.load_checkpoint(dir) / el.load_pretrained(name)) and do not call "
            "enable_compatibility_mode() or process_weights() on it (enable_compatibility_mode("
            "no_processing=True) keeps the weights as trained)"
        )
    else:
        how = (
            "load it with HookedTransformer.from_pretrained_no_processing(name), "
            "el.load_pretrained(name) or el.load_checkpoint(dir), and do not call "
            "process_weights_() on it"
        )
    return (
        f"{what}: this model's weights were processed by TransformerLens ({', '.join(found)}). "
        "The scores are defined on the weights as trained (docs/scores.md §1): folding and "
        "centring change what a weight change means, so the scores would be of another model. "
        f"To score it, {how}; load the base and the finetuned model the same way. (To score "
        "processed weights on purpose: el.load_pretrained(name, process_weights=True) for "
        "both, which every result records.)"
    )

"""The HookedTransformer backend: TransformerLens 3's ``HookedTransformer`` as scorable pieces.

A backend answers what the scoring engines ask of a model (docs/scores.md, CONTRIBUTING.md):
- the pieces of a forward pass, so the engines can resume the residual stream at any layer
  boundary: ``embed``, ``attention`` (with a frozen key/value prefix), ``mlp``, ``unembed``;
- the output weights of the heads (``W_O``), which model variants it can score
  (``check_scorable``), which configuration must match between a base and a finetuned model
  (``signature``) and which TransformerLens flags to turn off while scoring (``standard_flags``).

Parameter names are TransformerLens's own (``backend/names.py``). Loading lives in
``backend/loading.py``, ``families.py`` and ``tiny.py``; the block loop built from these pieces
in ``backend/blocks.py``.
"""

from __future__ import annotations

import contextlib
import json
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from jaxtyping import Float, Int
from torch import Tensor, nn

from extractive_lens.backend import shift, vocab
from extractive_lens.backend.compute import (
    compute_dtype,
    deferred_tangent,
    substituted,
    this_thread_only,
    upcast_call,
)
from extractive_lens.backend.lowrank import LowRank
from extractive_lens.backend.lowrank_pieces import (
    ATTN_LOW_RANK,
    MLP_LOW_RANK,
    has_low_rank,
    low_rank_hooks,
    low_rank_parts,
    plain_attention,
    plus_output,
)
from extractive_lens.backend.names import ParamSlice, slices_for_names

NAME = "hooked_transformer"


def handles(model: Any) -> bool:
    """Whether ``model`` is a ``HookedTransformer`` (or subclass)."""
    cls_names = {c.__name__ for c in type(model).__mro__}
    return "HookedTransformer" in cls_names


def _piece(module: Any, prefixes: tuple[str, ...], fn: Any, *args: Any,
           low_rank: frozenset[str] = frozenset()) -> Any:  # fmt: skip
    return upcast_call(module, prefixes, fn, *args, upcast_buffer=_upcast_buffer, low_rank=low_rank)


# ---------------------------------------------------------------------------------------------
# What the model is
# ---------------------------------------------------------------------------------------------


def notes(model: Any) -> dict[str, Any]:
    """extractive_lens's own notes on a model (how its weights were processed, the world it was
    trained on): kept on the model object, copied with it, never in its config or state dict."""
    return model.__dict__.setdefault("extractive_lens_notes", {})


def weights_processed(model: Any) -> bool:
    """Whether the model's weights were folded / centred: recorded at load
    (``load_pretrained(process_weights=True)``), or found on the model (``processing.py``)."""
    from extractive_lens.backend.processing import processing_found

    return bool(notes(model).get("processed", False)) or bool(processing_found(model))


def has_mlp(model: Any) -> bool:
    return not model.cfg.attn_only


def parallel(model: Any) -> bool:
    """Whether attention and MLP both read the block's input (GPT-J / NeoX style)."""
    return bool(model.cfg.parallel_attn_mlp)


def parameter_slices(model: Any) -> list[ParamSlice]:
    """The ownership partition of every parameter element of ``model`` (docs/scores.md §2)."""
    names = [n for n, _ in model.named_parameters()]
    return slices_for_names(names, model.cfg.n_heads, model.cfg.n_key_value_heads)


def parameters(model: Any) -> dict[str, Tensor]:
    """The model's parameters by their TransformerLens names (``WeightDiff`` keys)."""
    return dict(model.named_parameters())


SIGNATURE_KEYS = (
    "n_layers", "d_model", "n_heads", "d_head", "d_mlp", "d_vocab", "n_ctx", "n_key_value_heads",
    "normalization_type", "positional_embedding_type", "act_fn", "gated_mlp", "parallel_attn_mlp",
    "attn_only",
)  # fmt: skip


INERT_CONFIG = frozenset({
    # naming, placement, seeding, initialisation: not the function of given weights
    "model_name", "tokenizer_name", "device", "n_devices", "seed", "init_mode", "init_weights",
    "initializer_range", "n_params", "trust_remote_code", "checkpoint_index",
    "checkpoint_label_type", "checkpoint_value", "from_checkpoint", "train_seq_length",
    # tokenization, padding and hook views: the same function, other inputs or hooks
    "default_prepend_bos", "tokenizer_prepends_bos", "tokenizer_appends_eos",
    "default_padding_side", "use_attn_result", "use_split_qkv_input", "use_hook_mlp_in",
    "use_attn_in", "use_hook_tokens", "ungroup_grouped_query_attention", "attn_implementation",
    "decoder_start_token_id",
    # compared elsewhere: the dtype (a diff's own rule), processing (signature["processed"])
    "dtype", "layer_norm_folding",
})  # fmt: skip
"""Configuration fields that do not change the function a model computes from its weights."""


def function_config(model: Any) -> dict[str, Any]:
    """What, besides the weights, decides the function the model computes: every config field
    but ``INERT_CONFIG`` (rotary base and dimension, norm eps, soft caps, normalization,
    positional embedding, activation, ...). A base and a finetuned model must agree on all."""
    return config_fields(model.cfg)


def config_fields(cfg: Any) -> dict[str, Any]:
    """``function_config`` of a TransformerLens config (``HookedTransformerConfig`` or a
    bridge's), as JSON values."""
    import dataclasses

    fields = dict(vars(cfg))  # a bridge's config sets more than its dataclass fields
    if dataclasses.is_dataclass(cfg):
        fields.update({f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)})
    keep = {k: v for k, v in sorted(fields.items()) if k not in INERT_CONFIG and k[0] != "_"}
    return json.loads(json.dumps(keep, default=str))


def architecture(model: Any) -> str | None:
    """The architecture the weights came from (``None`` for a model built from a config)."""
    return model.cfg.original_architecture


def signature(model: Any, arch: str | None = None) -> dict[str, Any]:
    """The configuration fields a base and a finetuned model must share (``arch``: the
    architecture, when the model's config does not name it as ``HookedTransformer`` does)."""
    sig = config_signature(model.cfg, architecture(model) if arch is None else arch)
    sig["processed"] = weights_processed(model)
    return sig


def config_signature(cfg: Any, arch: str | None) -> dict[str, Any]:
    """``signature`` as far as the configuration alone says (no ``processed``: that needs the
    weights)."""
    sig = {k: getattr(cfg, k, None) for k in SIGNATURE_KEYS}
    sig["original_architecture"] = arch
    sig["dtype"] = str(cfg.dtype)
    return json.loads(json.dumps(sig, default=str))


def describe(model: Any, arch: str | None = None, backend: str = NAME) -> dict[str, Any]:
    """What a result records about the model it was computed on."""
    from extractive_lens.backend.installed import version

    return {
        "model": model.cfg.model_name,
        "architecture": architecture(model) if arch is None else arch,
        "dtype": str(model.cfg.dtype),
        "weights_processed": weights_processed(model),
        "backend": backend,
        "transformer_lens": version(),
    }


# ---------------------------------------------------------------------------------------------
# Compute precision: rotary tables at the compute dtype
# ---------------------------------------------------------------------------------------------

_ROTARY_CACHE: weakref.WeakKeyDictionary[nn.Module, dict[tuple[str, torch.dtype, int], Tensor]] = (
    weakref.WeakKeyDictionary()
)  # per attention module (weakly held: a new model never inherits a collected one's tables)


def _upcast_buffer(module: Any, name: str, buf: Tensor, dtype: torch.dtype) -> Tensor:
    """A float buffer in ``dtype``; rotary tables are recomputed at that precision rather than
    upcast from their rounded 16-bit values."""
    leaf = name.rsplit(".", 1)[-1]
    owner = module.get_submodule(name.rsplit(".", 1)[0]) if "." in name else module
    if leaf not in ("rotary_sin", "rotary_cos") or not hasattr(owner, "calculate_sin_cos_rotary"):
        return buf.to(dtype)
    tables = _ROTARY_CACHE.setdefault(owner, {})
    if (leaf, dtype, buf.shape[0]) not in tables:
        base = owner._rotary_base() if hasattr(owner, "_rotary_base") else owner.cfg.rotary_base
        sin, cos = owner.calculate_sin_cos_rotary(
            owner.cfg.rotary_dim, buf.shape[0], base=base, dtype=dtype
        )
        tables[("rotary_sin", dtype, buf.shape[0])] = sin.to(buf.device)
        tables[("rotary_cos", dtype, buf.shape[0])] = cos.to(buf.device)
    return tables[(leaf, dtype, buf.shape[0])]


def check_scorable(model: Any) -> None:
    """Raise a clear error for block variants whose head outputs do not add into the stream."""
    cfg = model.cfg
    problems = []
    if cfg.use_normalization_before_and_after:
        problems.append("post-attention normalisation (Gemma 2 style ln1_post / ln2_post)")
    if cfg.original_architecture in {"Olmo2ForCausalLM", "Olmo3ForCausalLM"}:
        problems.append("post-norm blocks (OLMo 2/3)")
    if cfg.positional_embedding_type == "shortformer":
        problems.append("shortformer positional embeddings")
    if getattr(cfg, "num_experts", None):
        problems.append("mixture-of-experts MLPs")
    if problems:
        raise NotImplementedError(
            "Scoring needs each head's output to be added directly into the residual stream; "
            f"this model has {'; '.join(problems)}. Loading and WeightDiff work for it, scoring "
            "does not yet."
        )


VIEW_FLAGS = ("use_attn_result", "use_split_qkv_input", "use_attn_in", "use_hook_mlp_in",
              "ungroup_grouped_query_attention")  # fmt: skip
"""TransformerLens flags that change which hooks fire and how attention inputs are shaped, not
what the model computes: scoring turns them off while it runs (``standard_flags``)."""


@contextlib.contextmanager
def standard_flags(model: Any) -> Iterator[None]:
    """Run with ``VIEW_FLAGS`` off (the forward pieces pass one ``[batch, pos, d_model]`` input to
    attention); the user's settings are restored on exit, interrupts or not."""
    from extractive_lens.interrupts import state_change

    cfg = model.cfg
    saved = {f: getattr(cfg, f, False) for f in VIEW_FLAGS}
    if not any(saved.values()):
        yield
        return

    def change() -> None:
        for f in saved:
            setattr(cfg, f, False)

    def restore() -> None:
        for f, v in saved.items():
            setattr(cfg, f, v)

    with state_change(change, restore, model=model):
        yield


@contextlib.contextmanager
def ungrouped_kv(model: Any) -> Iterator[None]:
    """Keys and values per *query* head at ``hook_k`` / ``hook_v`` inside the block (each query
    head computes its own copy from the expanded ``W_K`` / ``W_V``; TransformerLens's
    ``ungroup_grouped_query_attention``): what the authors' convention credits a grouped-query
    model's shared key/value change through (docs/scores.md §7). Values are unchanged."""
    from extractive_lens.interrupts import state_change

    cfg = model.cfg
    if not (cfg.n_key_value_heads and cfg.n_key_value_heads != cfg.n_heads):
        yield
        return

    def change() -> None:
        cfg.ungroup_grouped_query_attention = True

    def restore() -> None:
        cfg.ungroup_grouped_query_attention = False

    with state_change(change, restore, model=model):
        yield


def on_block(model: Any, layer: int, x: Tensor) -> Tensor:
    """``x`` on the device of block ``layer`` (models split over devices with ``n_devices``)."""
    if getattr(model.cfg, "n_devices", 1) <= 1:
        return x
    dev = (
        model.blocks[layer].ln1.w.device
        if hasattr(model.blocks[layer].ln1, "w")
        else next(model.blocks[layer].parameters()).device
    )
    return x.to(dev)


def on_final(model: Any, x: Tensor) -> Tensor:
    """``x`` on the device of the unembedding."""
    if getattr(model.cfg, "n_devices", 1) <= 1:
        return x
    return x.to(model.unembed.W_U.device)


def embed(model: Any, tokens: Int[Tensor, "batch pos"]) -> Float[Tensor, "batch pos d_model"]:
    """The residual stream entering layer 0 (token embedding plus absolute positions)."""

    by_part = vocab.by_part(model, model.embed.W_E) or has_low_rank(model.embed.W_E)

    def run(m: Any, tokens: Tensor) -> Tensor:
        if by_part:  # only the batch's rows of W_E + αΔ, the tokens renumbered into them
            used, inverse = torch.unique(tokens, return_inverse=True)
            dtype = compute_dtype() or m.embed.W_E.dtype
            p = m.embed.W_E
            W_E = vocab.rows(p, used, dtype, shift.active(p), deferred_tangent(p))
            with substituted(m, {"model.embed.W_E": W_E}):
                x = m.hook_embed(m.embed(inverse))
        else:
            x = m.hook_embed(m.embed(tokens))
        if m.cfg.positional_embedding_type == "standard":
            x = x + m.hook_pos_embed(m.pos_embed(tokens))
        return x

    parts = ("embed.ln.", "pos_embed.") if by_part else ("embed.", "pos_embed.")
    return _piece(model, parts, run, tokens)


def attention(
    model: Any,
    layer: int,
    resid_pre: Float[Tensor, "batch pos d_model"],
    capture: tuple[str, ...] = ("z",),
    past_kv: tuple[Tensor, Tensor] | None = None,
) -> tuple[Float[Tensor, "batch pos d_model"], dict[str, Tensor]]:
    """Layer ``layer``'s attention on ``resid_pre``: its output ``Σ_h z_h W_O[h] + b_O``, and the
    values at the attention hook points named in ``capture`` (``z``, ``q``, ``k``, ``v``, ``pattern``).

    ``past_kv``: keys and values (as at ``hook_k`` / ``hook_v``) of earlier positions; then
    ``resid_pre`` holds only the positions after them (TransformerLens's KV cache, frozen).
    """
    block = model.blocks[layer]
    resid_pre = on_block(model, layer, resid_pre)
    if past_kv is not None:
        past_kv = (on_block(model, layer, past_kv[0]), on_block(model, layer, past_kv[1]))
    captured: dict[str, Tensor] = {}
    handles: list[Any] = []
    entry = None
    if past_kv is not None:
        from transformer_lens.cache.key_value_cache_entry import TransformerLensKeyValueCacheEntry

        entry = TransformerLensKeyValueCacheEntry(past_kv[0], past_kv[1], frozen=True)

    parts = low_rank_parts(block.attn, ATTN_LOW_RANK) if plain_attention(model, block.attn) else {}
    inp: dict[str, Tensor] = {}

    def run(b: Any, x: Tensor) -> Tensor:
        x = inp["x"] = b.ln1(x)
        out = b.attn(query_input=x, key_input=x, value_input=x, past_kv_cache_entry=entry)
        return plus_output(out, parts, inp)

    try:  # hooks registered inside the try, so that they are removed whatever happens
        low_rank_hooks(block.attn, parts, ATTN_LOW_RANK, inp, handles)  # before the captures
        for name in capture:
            hp = getattr(block.attn, f"hook_{name}")
            handles.append(
                hp.register_forward_hook(
                    this_thread_only(lambda _m, _i, out, name=name: captured.__setitem__(name, out))
                )
            )
        mine = frozenset("attn." + leaf for leaf in parts)
        out = _piece(block, ("ln1.", "attn."), run, resid_pre, low_rank=mine)
    finally:
        for h in handles:
            h.remove()
    return out, captured


def mlp(
    model: Any, layer: int, mlp_in: Float[Tensor, "batch pos d_model"]
) -> Float[Tensor, "batch pos d_model"]:
    """Layer ``layer``'s MLP (with its ``ln2``) on its input stream."""
    block = model.blocks[layer]
    where = MLP_LOW_RANK.get(type(block.mlp).__name__, {})
    parts = low_rank_parts(block.mlp, where)
    inp: dict[str, Tensor] = {}

    def run(b: Any, x: Tensor) -> Tensor:
        x = inp["x"] = b.ln2(x)
        return plus_output(b.mlp(x), parts, inp)

    handles: list[Any] = []
    try:
        low_rank_hooks(block.mlp, parts, where, inp, handles)
        mine = frozenset("mlp." + leaf for leaf in parts)
        return _piece(block, ("ln2.", "mlp."), run, on_block(model, layer, mlp_in), low_rank=mine)
    finally:
        for h in handles:
            h.remove()


def unembed(
    model: Any, resid: Float[Tensor, "batch pos d_model"]
) -> Float[Tensor, "batch pos d_vocab"]:
    """Final norm, unembedding and logit soft-capping."""

    by_part = vocab.by_part(model, model.unembed.W_U) or has_low_rank(model.unembed.W_U)

    def run(m: Any, x: Tensor) -> Tensor:
        if m.cfg.normalization_type is not None:
            x = m.ln_final(x)
        if by_part:  # COLUMNS of W_U + αΔ at a time, never the whole matrix (backend/vocab.py)
            u = m.unembed
            p = u.W_U
            x = vocab.logits(p, u.hook_in(x), x.dtype, shift.active(p), deferred_tangent(p))
            return u.hook_out(x + u.b_U)
        return _unembed(m.unembed, x)

    parts = ("ln_final.", "unembed.b_U") if by_part else ("ln_final.", "unembed.")
    logits = _piece(model, parts, run, on_final(model, resid))
    cap = model.cfg.output_logits_soft_cap
    if cap is not None and cap > 0:
        logits = cap * torch.tanh(logits / cap)
    return logits


def _unembed(u: Any, x: Tensor) -> Tensor:
    """``Unembed.forward`` (its hooks included) without its ``W_U.T.contiguous()``: that copy of
    the unembedding is 2 GiB in float32 at Llama 3's vocabulary, twice over under forward-mode
    differentiation; ``x @ W_U`` reads the same matrix in place."""
    return u.hook_out(u.hook_in(x) @ u.W_U + u.b_U)


def vocab_matrices(model: Any) -> dict[str, tuple[Tensor, bool]]:
    """The vocabulary matrices ``backend/vocab.py`` may read a part at a time, by name: the
    stored tensors are the TransformerLens ones (not transposed)."""
    return {"embed.W_E": (model.embed.W_E, False), "unembed.W_U": (model.unembed.W_U, False)}


def W_O(model: Any, layer: int) -> Float[Tensor, "head d_head d_model"]:
    return model.blocks[layer].attn.W_O


def write_parameters(model: Any, values: dict[str, Tensor]) -> None:
    """Set parameters (TransformerLens names) to ``values``, in place."""
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, value in values.items():
            p = params[name]
            p.copy_(value.to(device=p.device, dtype=p.dtype))


def check_shared(model: Any, deltas: Any) -> None:
    """Nothing to refuse: a ``HookedTransformer`` stores each TransformerLens parameter apart."""


def raw_tangents(model: Any, tangents: dict[str, Tensor], dtype: torch.dtype) -> dict[str, Tensor]:
    """A weight direction in the model's own parameter names (they are TransformerLens's)."""
    return tangents


def raw_low_rank(model: Any, name: str, f: LowRank) -> tuple[str, LowRank] | None:
    """A low-rank change of ``name`` as a change of the stored weight: the same here (the
    pieces add it as ``(x L) R``: ``backend/lowrank_pieces.py``)."""
    return name, f


def raw_masks(model: Any, masks: dict[str, Tensor | None]) -> dict[str, Tensor | None]:
    """Trainable-element masks over ``named_parameters()``: the same names here."""
    return masks


def tl_view(model: Any, raw: dict[str, Tensor]) -> dict[str, Tensor]:
    """The parameters (TransformerLens names) stored weights ``raw`` amount to: the same here."""
    return raw


def kv_prefix(model: Any) -> bool:
    """Attention takes a frozen key/value prefix (TransformerLens's frozen KV-cache entry)."""
    return True

"""The TransformerBridge backend: TransformerLens's ``TransformerBridge`` (the model class of
TransformerLens 4, already shipped in 3.9) as scorable pieces.

A bridge wraps a Hugging Face (or TransformerLens-native) model and keeps its weights as the
wrapped model stores them (``transformer.h.0.attn.c_attn.weight``...). This backend speaks
TransformerLens parameter names all the same:

- ``parameters``: ``tl_parameters()``, whose tensors are views of the stored weights, renamed
  where ``HookedTransformer`` names them differently (grouped-query ``_W_K``/``_W_V``), so a
  ``WeightDiff`` has the same keys whichever class made it. Biases the wrapped model lacks
  appear as zeros (as on a ``HookedTransformer``); they are not stored, so a Δ must be zero there.
- ``write_parameters`` writes through those views into the stored weights; ``raw_tangents``
  turns a direction in TransformerLens names into one over the stored weights (for ``jvp``).
  Weights that share storage (GPT-2's fused and split QKV, tied embeddings) are handled by
  storage, element by element; a Δ that disagrees between tied names is an error.
- the forward pieces run the bridge's own modules (``ln1``, ``attn``, ``ln2``, ``mlp``,
  ``ln_final``, ``unembed``), so the numbers are the wrapped model's. Attention gets the keyword
  arguments the wrapped model itself passes to it (causal mask, rotary tables), recorded once per
  sequence length. A frozen key/value prefix goes in through the wrapped model's cache
  interface; where an architecture does not use it, ``kv_prefix`` is False and the exact engine
  runs whole sequences instead.

``check_scorable`` checks, once per model, that the pieces reproduce the bridge's own logits.

The ``Backend`` protocol for ``TransformerBridge``: each function maps a TransformerLens name
or piece onto the Hugging Face model the bridge wraps. Three of its helpers live beside it:
``bridge_hooks.py`` (attention's recorded keyword arguments, the key/value prefix, hook points
captured), ``bridge_vocab.py`` (the vocabulary matrices read a part at a time) and
``bridge_lowrank.py`` (low-rank changes added at an ``nn.Linear``'s output).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor, nn

from extractive_lens.backend import bridge_hooks, bridge_lowrank, bridge_vocab, hooked, shift, vocab
from extractive_lens.backend.bridge_vocab import vocab_matrices
from extractive_lens.backend.compute import (
    compute_dtype,
    deferred_tangent,
    this_thread_only,
    upcast_call,
)
from extractive_lens.backend.hooked import has_mlp, notes, parallel, weights_processed
from extractive_lens.backend.lowrank import LowRank
from extractive_lens.backend.names import ParamSlice, slices_for_names

NAME = "transformer_bridge"

__all__ = [
    "NAME", "W_O", "attention", "check_scorable", "describe", "embed", "handles", "has_mlp",
    "kv_prefix", "mlp", "notes", "on_block", "on_final", "parallel", "parameter_slices",
    "parameters", "raw_low_rank", "raw_masks", "raw_tangents", "signature", "function_config", "tl_view", "standard_flags", "unembed", "vocab_matrices", "weights_processed",
    "write_parameters",
]  # fmt: skip


def handles(model: Any) -> bool:
    """Whether ``model`` is a ``TransformerBridge`` (or subclass)."""
    return "TransformerBridge" in {c.__name__ for c in type(model).__mro__}


# ---------------------------------------------------------------------------------------------
# What the model is
# ---------------------------------------------------------------------------------------------

_KV = ("W_K", "W_V", "b_K", "b_V")


def _gqa(model: Any) -> bool:
    n_kv = model.cfg.n_key_value_heads
    return bool(n_kv) and n_kv != model.cfg.n_heads


def parameters(model: Any) -> dict[str, Tensor]:
    """The parameters by their TransformerLens names: views of the stored weights (zeros where
    the wrapped model has no such bias). Grouped-query key/value weights are ``_W_K``... with
    one slice per key/value head, as ``HookedTransformer`` names them. Query/key norms (Qwen3,
    Gemma 3), which TransformerLens's bridge does not name, are ``attn.q_norm.w`` /
    ``attn.k_norm.w`` as in a ``HookedTransformer``: a change there is part of the Δ."""
    params = dict(model.tl_parameters())
    for layer, block in enumerate(getattr(model, "blocks", ())):
        for leaf in ("q_norm", "k_norm"):
            norm = getattr(getattr(block, "attn", None), leaf, None)
            w = getattr(getattr(norm, "original_component", None), "weight", None)
            name = f"blocks.{layer}.attn.{leaf}.w"
            if name not in params and isinstance(w, Tensor) and w.shape == (model.cfg.d_head,):
                params[name] = w
    if _gqa(model):
        n_kv, d_head = model.cfg.n_key_value_heads, model.cfg.d_head
        for layer, block in enumerate(model.blocks):
            for leaf in _KV:
                name = f"blocks.{layer}.attn.{leaf}"
                if name not in params:
                    continue
                expanded = params.pop(name)
                own = getattr(block.attn, leaf, None)
                if not isinstance(own, Tensor) or own.shape[0] != n_kv:
                    own = expanded[:: model.cfg.n_heads // n_kv]  # a zero bias: any slice
                    if leaf.startswith("b_"):
                        own = own.reshape(n_kv, d_head)
                params[f"blocks.{layer}.attn._{leaf}"] = own
    return params


def stored_names(model: Any) -> set[str]:
    """The TransformerLens names that are views of weights the wrapped model stores (the others
    are zeros TransformerLens shows for biases the model does not have)."""
    storages = _raw_storages(model)
    return {n for n, t in parameters(model).items() if _stored(t, storages)}


def _raw_storages(model: Any) -> set[int]:
    return {p.untyped_storage().data_ptr() for p in model.parameters()}


def _stored(t: Tensor, storages: set[int]) -> bool:
    return t.untyped_storage().data_ptr() in storages


def write_parameters(model: Any, values: dict[str, Tensor]) -> None:
    """Set parameters (TransformerLens names) to ``values``, writing into the stored weights."""
    params, storages = parameters(model), _raw_storages(model)
    with torch.no_grad():
        for name, value in values.items():
            t = params[name]
            v = value.to(device=t.device, dtype=t.dtype)
            if _stored(t, storages):
                t.copy_(v)
            elif not torch.equal(v, t):
                raise ValueError(_not_stored(name))
        after = parameters(model)
        for name, value in values.items():
            t = after[name]
            if _stored(t, storages) and not torch.equal(
                t, value.to(device=t.device, dtype=t.dtype)
            ):
                raise ValueError(_tied(name))


def _not_stored(name: str) -> str:
    return (
        f"{name} is not a stored weight of this TransformerBridge (the wrapped model has no such "
        "parameter; TransformerLens shows zeros): a weight change there must be zero."
    )


def _tied(name: str) -> str:
    return (
        f"{name} shares its storage with another parameter of this TransformerBridge (tied "
        "weights, e.g. W_E and W_U) and the values given for the two differ: give tied "
        "parameters the same change."
    )


def raw_tangents(model: Any, tangents: dict[str, Tensor], dtype: torch.dtype) -> dict[str, Tensor]:
    """A direction over the stored weights (keyed by ``named_parameters(remove_duplicate=False)``
    names, every alias of shared storage included) whose TransformerLens views are ``tangents``.
    A vocabulary matrix read a part at a time (``vocab.matrices``) gets a view of its tangent in
    the stored layout (``lm_head.weight``: ``unembed.W_U``'s transpose), not a copy: the piece
    that reads the matrix reads its tangent by part (``compute.deferred_tangent``)."""
    large = {id(p) for p in vocab.matrices(model)}
    parted: dict[int, tuple[Tensor, tuple[tuple[str, bool], ...]]] = {}
    for name, (p, transposed) in vocab_matrices(model).items():
        if id(p) in large and name in tangents:
            q, names = parted.get(id(p), (p, ()))
            parted[id(p)] = (q, (*names, (name, transposed)))
    skip = {name for _, names in parted.values() for name, _ in names}
    out = _to_storage(model, {n: t for n, t in tangents.items() if n not in skip}, dtype,
                      strict=True)  # fmt: skip
    for p, names in parted.values():
        d = vocab.stored_delta(tangents, names, {})
        for raw_name, q in model.named_parameters(remove_duplicate=False):
            if q is p and d is not None:
                out[raw_name] = d  # type: ignore[assignment]  # dense: no factors given
    return out


def check_shared(model: Any, deltas: Any) -> None:
    """Names that share one stored tensor (tied ``W_E`` and ``W_U``; GPT-2's fused ``c_attn``
    under ``W_Q W_K W_V``) must be given changes that agree where their views overlap: formed
    together into that tensor as ``raw_tangents`` does (only those names, one group at a time)."""
    params, matrices = parameters(model), vocab_matrices(model)
    groups: dict[int, list[str]] = {}
    for name in deltas:
        t = params.get(name)
        if t is not None:
            groups.setdefault(t.untyped_storage().data_ptr(), []).append(name)
    for names in groups.values():
        if len(names) > 1 and all(n in matrices for n in names):  # compared a part at a time:
            vocab.stored_delta(deltas, tuple((n, matrices[n][1]) for n in names), {})  # no
            continue  # vocabulary-sized tensor formed
        if len(names) > 1:
            values = {n: deltas[n] for n in names}
            dtype = torch.promote_types(next(iter(values.values())).dtype, torch.float32)
            _to_storage(model, values, dtype, strict=False)


def raw_low_rank(model: Any, name: str, f: LowRank) -> tuple[str, LowRank] | None:
    """``bridge_lowrank.raw_low_rank``: the low-rank change ``f`` of ``name`` as a change of
    the stored ``nn.Linear`` weight behind it, or ``None`` where Δ must be formed."""
    return bridge_lowrank.raw_low_rank(model, name, f, parameters)


def raw_masks(model: Any, masks: dict[str, Tensor | None]) -> dict[str, Tensor | None]:
    """Trainable-element masks over ``named_parameters()`` from masks over TransformerLens names
    (``None``: the whole tensor; else a boolean mask along its first dimension)."""
    params = parameters(model)
    full = {}
    for name, m in masks.items():
        t = params[name]
        if m is None:
            full[name] = torch.ones(t.shape, device=t.device)
        else:
            full[name] = m.reshape(-1, *([1] * (t.ndim - 1))).expand(t.shape).float()
    flat = _to_storage(model, full, torch.float32, strict=False)
    own = dict(model.named_parameters())
    return {n: (None if bool(v.all()) else v.bool()) for n, v in flat.items() if n in own}


def _to_storage(
    model: Any, values: dict[str, Tensor], dtype: torch.dtype, *, strict: bool
) -> dict[str, Tensor]:
    """Tensors shaped like the stored weights whose TransformerLens views are ``values`` (zero
    where no value is given). ``strict``: non-zero values for parameters the model does not store
    are an error (else skipped)."""
    params, storages = parameters(model), _raw_storages(model)
    flats: dict[int, Tensor] = {}
    written: list[tuple[str, Tensor, Tensor]] = []
    for name, d in values.items():
        t = params[name]
        if not _stored(t, storages):
            if strict and bool(d.ne(0).any()):
                raise ValueError(_not_stored(name))
            continue
        view = _view(_flat(flats, t, dtype), t)
        view.copy_(d.to(device=t.device, dtype=dtype))
        written.append((name, view, d))
    for name, view, d in written:  # tied names must agree
        if not torch.equal(view, d.to(device=view.device, dtype=dtype)):
            raise ValueError(_tied(name))
    out = {}
    for raw_name, p in model.named_parameters(remove_duplicate=False):
        flat = flats.get(p.untyped_storage().data_ptr())
        if flat is not None:
            out[raw_name] = _view(flat, p)
    return out


def _flat(flats: dict[int, Tensor], t: Tensor, dtype: torch.dtype) -> Tensor:
    """The zero-initialised flat tensor standing for ``t``'s storage (one per storage)."""
    storage = t.untyped_storage()
    flat = flats.get(storage.data_ptr())
    if flat is None:
        flat = torch.zeros(storage.nbytes() // t.element_size(), dtype=dtype, device=t.device)
        flats[storage.data_ptr()] = flat
    return flat


def _view(flat: Tensor, t: Tensor) -> Tensor:
    """The elements of ``flat`` that ``t`` occupies in its storage, shaped like ``t``."""
    return flat.as_strided(t.size(), t.stride(), t.storage_offset())


def tl_view(model: Any, raw: dict[str, Tensor]) -> dict[str, Tensor]:
    """The parameters (TransformerLens names) that stored weights ``raw`` (keyed as
    ``named_parameters()``) amount to; parameters the model does not store keep its values."""
    own = dict(model.named_parameters())
    flats: dict[int, Tensor] = {}
    for name, value in raw.items():
        p = own[name]
        _view(_flat(flats, p, p.dtype), p).copy_(value)
    out = {}
    for name, t in parameters(model).items():
        flat = flats.get(t.untyped_storage().data_ptr())
        if flat is None:
            out[name] = t.detach().clone()
        else:
            out[name] = _view(flat, t)
    return out


def parameter_slices(model: Any) -> list[ParamSlice]:
    """The ownership partition of every parameter element of ``model`` (docs/scores.md §2)."""
    return slices_for_names(list(parameters(model)), model.cfg.n_heads, model.cfg.n_key_value_heads)


def architecture(model: Any) -> str | None:
    """The wrapped model's architecture (``None`` for a TransformerLens-native model, as a
    ``HookedTransformer`` built from a config has)."""
    arch = getattr(model.cfg, "original_architecture", None) or getattr(
        model.cfg, "architecture", None
    )
    return None if arch == "TransformerLensNative" else arch


def signature(model: Any) -> dict[str, Any]:
    """The configuration fields a base and a finetuned model must share (those of a
    ``HookedTransformer``, so a Δ made on one class applies to the other)."""
    return hooked.signature(model, architecture(model))


def describe(model: Any) -> dict[str, Any]:
    """What a result records about the model it was computed on."""
    return hooked.describe(model, architecture(model), NAME)


HF_INERT = frozenset({
    "_name_or_path", "transformers_version", "dtype", "torch_dtype", "use_cache", "return_dict",
    "output_hidden_states", "output_attentions", "chunk_size_feed_forward", "id2label",
    "label2id", "problem_type", "initializer_range", "pad_token_id", "bos_token_id",
    "eos_token_id", "sep_token_id", "decoder_start_token_id", "_commit_hash",
    "_attn_implementation", "attn_implementation", "_attn_implementation_autoset",
    "tokenizer_class", "task_specific_params", "finetuning_task", "prefix", "torchscript",
    "use_return_dict",
})  # fmt: skip
"""Hugging Face config fields that do not change the function of given weights (dropout and
the sequence-classification ``summary_*`` fields are left out by pattern too)."""


def hf_function_config(hf_config: Any) -> dict[str, Any]:
    """A Hugging Face config's fields that change the function (``rope_parameters`` /
    ``rope_theta``, ``rms_norm_eps``, ``hidden_act``, soft caps, ...), as JSON values."""
    import json

    raw = hf_config.to_dict() if hasattr(hf_config, "to_dict") else dict(hf_config)
    keep = {
        k: v for k, v in sorted(raw.items())
        if k not in HF_INERT and "dropout" not in k and not k.endswith("_pdrop")
        and not k.startswith("summary_")
    }  # fmt: skip
    return json.loads(json.dumps(keep, default=str))


def function_config(model: Any) -> dict[str, Any]:
    """``hooked.function_config`` for a bridge: its TransformerLens config, and (a bridge's
    config leaves out the rotary base, for one) the Hugging Face config it was booted from."""
    out = hooked.config_fields(model.cfg)
    original = getattr(model, "original_model", None)
    hf = getattr(original, "config", None)
    if hf is not None:
        out = {**hf_function_config(hf), **out}
    return out


# ---------------------------------------------------------------------------------------------
# Checks
# ---------------------------------------------------------------------------------------------

_CHECKED: weakref.WeakKeyDictionary[nn.Module, dict[str, Any]] = weakref.WeakKeyDictionary()
PROBE_TOKENS = 6


def check_scorable(model: Any) -> None:
    """Raise a clear error for block variants the scores cannot handle, and (once per model)
    unless the pieces reproduce the bridge's own logits on a short probe."""
    cfg = model.cfg
    problems = []
    if getattr(cfg, "use_normalization_before_and_after", False):
        problems.append("post-attention normalisation (Gemma 2 style)")
    if architecture(model) in {"Olmo2ForCausalLM", "Olmo3ForCausalLM"}:
        problems.append("post-norm blocks (OLMo 2/3)")
    if getattr(cfg, "num_experts", None):
        problems.append("mixture-of-experts MLPs")
    if not hasattr(model, "blocks") or not all(hasattr(b, "attn") for b in model.blocks):
        problems.append("blocks without an attention component")
    if problems:
        raise NotImplementedError(
            "Scoring needs each head's output to be added directly into the residual stream; "
            f"this model has {'; '.join(problems)}. Loading and WeightDiff work for it, scoring "
            "does not yet."
        )
    _self_check(model)


def kv_prefix(model: Any) -> bool:
    """Whether attention accepts a frozen key/value prefix (checked against whole sequences)."""
    return bool(_self_check(model)["kv_prefix"])


def _self_check(model: Any) -> dict[str, Any]:
    found = _CHECKED.get(model)
    if found is not None:
        return found
    from extractive_lens.backend.blocks import run_blocks

    n = min(PROBE_TOKENS, model.cfg.n_ctx)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, model.cfg.d_vocab, (1, n), generator=gen).to(model.cfg.device)
    with torch.no_grad():
        want = model(tokens).float()
        x0 = embed(model, tokens)
        kv: dict[int, tuple[Tensor, Tensor]] = {}

        def keep(step: Any) -> None:
            kv[step.layer] = (step.captured["k"], step.captured["v"])

        x = run_blocks(model, x0, capture=("k", "v"), observe=keep)
        assert x is not None
        got = unembed(model, x).float()
        scale = float(want.abs().max()) + 1e-30
        err = float((got - want).abs().max()) / scale
        tol = 1e-4 if model.cfg.dtype in (torch.float32, torch.float64) else 2e-2
        if not err <= tol:
            raise NotImplementedError(
                f"extractive_lens cannot score this {architecture(model) or 'TransformerBridge'}: "
                "its blocks do not compose as embed -> [attention, MLP] -> unembed (running "
                f"the bridge's modules one by one misses its logits by {err:.1e} of their "
                "largest value). Please report the architecture."
            )
        # Does attention take a frozen prefix? Compare the last positions of layer 0.
        s = n // 2
        full, _ = attention(model, 0, x0)
        try:
            part, _ = attention(model, 0, x0[:, s:], past_kv=(kv[0][0][:, :s], kv[0][1][:, :s]))
            ok = torch.allclose(part.float(), full[:, s:].float(), rtol=1e-4, atol=1e-5 * scale)
        except Exception:  # noqa: BLE001 - any failure means: run whole sequences
            ok = False
    found = {"kv_prefix": ok, "logit_error": err}
    _CHECKED[model] = found
    return found


@contextlib.contextmanager
def ungrouped_kv(model: Any) -> Iterator[None]:
    """See ``hooked.ungrouped_kv``. A bridge runs the Hugging Face attention, which expands the
    shared keys and values inside its attention function, after every hook point: there is no
    per-query-head copy to credit, so grouped-query bridges are refused."""
    if _gqa(model):
        raise NotImplementedError(
            "convention='authors_code' informative scores of a grouped-query model credit each "
            "query head through its own copy of the shared keys and values, which a "
            "TransformerBridge does not expose (Hugging Face expands them inside attention). "
            "Load the checkpoint as a HookedTransformer (TransformerLens 3.9: "
            "load_checkpoint(dir, backend='hooked')), score kinds=('upstream', 'downstream') "
            "in this convention, or use convention='paper'."
        )
    yield


@contextlib.contextmanager
def standard_flags(model: Any) -> Iterator[None]:
    """Nothing to turn off: the pieces read the bridge's hook points directly."""
    yield


# ---------------------------------------------------------------------------------------------
# Forward pieces
# ---------------------------------------------------------------------------------------------


def on_block(model: Any, layer: int, x: Tensor) -> Tensor:
    """``x`` on the device of block ``layer`` (models split over devices)."""
    if getattr(model.cfg, "n_devices", 1) <= 1:
        return x
    return x.to(next(model.blocks[layer].parameters()).device)


def on_final(model: Any, x: Tensor) -> Tensor:
    """``x`` on the device of the unembedding."""
    if getattr(model.cfg, "n_devices", 1) <= 1:
        return x
    return x.to(next(model.unembed.parameters()).device)


_NAMES: weakref.WeakKeyDictionary[nn.Module, dict[tuple[int, ...], tuple[str, ...]]] = (
    weakref.WeakKeyDictionary()
)


def _names_in(root: nn.Module, *parts: nn.Module | None, but: Tensor | None = None
              ) -> tuple[str, ...]:  # fmt: skip
    """The names (as ``root.named_parameters()`` / ``named_buffers()`` give them) of the
    parameters and floating-point buffers of ``parts``: what ``upcast_call`` upcasts while a
    piece runs (TransformerLens 4's native unembedding holds its bias as a buffer); ``but``: a
    vocabulary matrix the piece reads a part at a time itself (``backend/vocab.py``)."""
    key = (*(id(p) for p in parts), id(but))
    cache = _NAMES.setdefault(root, {})
    if key not in cache:
        owned = {id(p) for m in parts if m is not None for p in m.parameters()}
        owned |= {
            id(b) for m in parts if m is not None for b in m.buffers() if b.is_floating_point()
        }
        owned.discard(id(but))
        named = [*root.named_parameters(), *root.named_buffers()]
        cache[key] = tuple(n for n, p in named if id(p) in owned) or ("\0",)
    return cache[key]


def _piece(root: nn.Module, parts: tuple[nn.Module | None, ...], fn: Any, *args: Any,
           low_rank: frozenset[str] = frozenset(), but: Tensor | None = None) -> Any:  # fmt: skip
    return upcast_call(root, _names_in(root, *parts, but=but), fn, *args, low_rank=low_rank)


class _Entered(Exception):
    """Raised by ``embed``'s hook with what entered the first block: the forward stops there."""

    def __init__(self, x: Tensor) -> None:
        self.x = x


def embed(model: Any, tokens: Tensor) -> Tensor:
    """The residual stream entering layer 0, as the bridge computes it: the model's own forward,
    stopped where block 0 is entered (what its ``stop_at_layer=0`` returns). Not by
    ``stop_at_layer``, which sets a flag on every block that stopped another thread's plain
    forward of the model at layer 0 too; this hook acts for this thread only."""
    parts = (getattr(model, "embed", None), getattr(model, "pos_embed", None))
    first = model.blocks[0]
    p = bridge_vocab.by_part(model, "embed.W_E")

    def stop(_m: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        x = args[0] if args and isinstance(args[0], Tensor) else kwargs.get("hidden_states")
        if not isinstance(x, Tensor):
            raise ValueError("embed: cannot find the input of the first block")
        raise _Entered(first.hook_in(x))

    def run(m: Any, t: Tensor) -> Tensor:
        with contextlib.ExitStack() as stack:
            handle = first.register_forward_pre_hook(this_thread_only(stop), with_kwargs=True)
            stack.callback(handle.remove)
            if p is not None:  # the batch's rows of W_E + αΔ; the embedding reads its tokens'
                stack.enter_context(bridge_vocab.rows_only(m, p, t))  # places among them
            try:
                m(t)
            except _Entered as entered:
                return entered.x
        raise RuntimeError("embed: the forward pass never entered the first block")

    return _piece(model, parts, run, tokens, but=p)


def attention(
    model: Any,
    layer: int,
    resid_pre: Tensor,
    capture: tuple[str, ...] = ("z",),
    past_kv: tuple[Tensor, Tensor] | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Layer ``layer``'s attention output on ``resid_pre`` and the hook values in ``capture``
    (``z``, ``q``, ``k``, ``v``, ``pattern``; ``k`` after rotary where the model has it).
    ``past_kv``: captured ``k``/``v`` of earlier positions (only where ``kv_prefix(model)``)."""
    block = model.blocks[layer]
    x = on_block(model, layer, resid_pre)
    offset = 0 if past_kv is None else past_kv[0].shape[1]
    dtype = compute_dtype() or x.dtype
    kw = bridge_hooks.attention_kwargs(model, layer, x.to(dtype), offset)
    if past_kv is not None:
        kw["past_key_values"] = bridge_hooks.Prefix(*(on_block(model, layer, t) for t in past_kv))

    def run(b: Any, x: Tensor) -> Tensor:
        out = b.attn(b.ln1(x), **kw)
        return out[0] if isinstance(out, tuple) else out

    captured_at = bridge_hooks.capturing(model, layer, capture)
    with captured_at as captured, bridge_lowrank.low_rank_linears(block, block.attn) as lr:
        out = _piece(block, (block.ln1, block.attn), run, x, low_rank=lr)
    return out, captured


def mlp(model: Any, layer: int, mlp_in: Tensor) -> Tensor:
    """Layer ``layer``'s MLP (with its ``ln2``) on its input stream."""
    block = model.blocks[layer]
    with bridge_lowrank.low_rank_linears(block, block.mlp) as lr:
        return _piece(block, (block.ln2, block.mlp), lambda b, x: b.mlp(b.ln2(x)),
                      on_block(model, layer, mlp_in), low_rank=lr)  # fmt: skip


def unembed(model: Any, resid: Tensor) -> Tensor:
    """Final norm, unembedding and logit soft-capping."""

    p = bridge_vocab.by_part(model, "unembed.W_U")

    def run(m: Any, x: Tensor) -> Tensor:
        if getattr(m, "ln_final", None) is not None:
            x = m.ln_final(x)
        if p is None:
            return m.unembed(x)
        # UnembeddingBridge.forward with the wrapped Linear's x @ (W + αΔ)ᵀ taken COLUMNS
        # vocabulary entries at a time (backend/vocab.py): the matrix is never formed
        u = m.unembed
        x = u.hook_in(x)
        out = vocab.logits(p, x, x.dtype, shift.active(p), deferred_tangent(p), dim=0)
        bias = u.original_component.bias
        return u.hook_out(out if bias is None else out + bias)

    parts = (getattr(model, "ln_final", None), model.unembed)
    logits = _piece(model, parts, run, on_final(model, resid), but=p)
    cap = getattr(model.cfg, "output_logits_soft_cap", None)
    if cap is not None and cap > 0:
        logits = cap * torch.tanh(logits / cap)
    return logits


def W_O(model: Any, layer: int) -> Tensor:
    """``[head, d_head, d_model]``: the heads' output weights of a layer (the attention
    component's own view; ``parameters`` would rebuild every view of the model)."""
    return model.blocks[layer].attn.W_O

"""Loading models and the one place that knows TransformerLens classes and parameter names.

>>> base = tiny_model({"n_layers": 2}, seed=0)          # a seeded HookedTransformer
>>> ft = load_checkpoint("runs/finetuned")              # doctest: +SKIP  (a local HF checkpoint)

Everything else in the package goes through the helpers here: ``parameter_slices`` (which
component owns which parameter, docs/scores.md §2), ``embed`` / ``attention`` / ``mlp`` / ``unembed``
(the pieces of a forward pass, so the scoring engines can resume the residual stream at any
layer boundary) and ``signature`` (what must match between a base and a finetuned model).
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import re
import warnings
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from jaxtyping import Float, Int
from torch import Tensor, nn

from extractive_lens.types import Component

if TYPE_CHECKING:  # pragma: no cover
    from transformer_lens import HookedTransformer

NO_PROCESSING = dict(
    fold_ln=False,
    center_writing_weights=False,
    center_unembed=False,
    fold_value_biases=False,
    refactor_factored_attn_matrices=False,
)


@contextlib.contextmanager
def quiet_transformer_lens() -> Iterator[None]:
    """Silence TransformerLens 3.x's deprecation warnings inside our own calls only."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=DeprecationWarning)
        warnings.filterwarnings("ignore", category=FutureWarning)
        warnings.filterwarnings("ignore", message=".*HookedTransformer.*")
        yield


def _tl():
    with quiet_transformer_lens():
        import transformer_lens

    return transformer_lens


# ---------------------------------------------------------------------------------------------
# Building and loading models
# ---------------------------------------------------------------------------------------------

TINY_DEFAULTS: dict[str, Any] = dict(
    n_layers=2,
    d_model=32,
    n_heads=4,
    d_head=8,
    d_mlp=64,
    d_vocab=50,
    n_ctx=32,
    act_fn="gelu",
    normalization_type="LN",
    positional_embedding_type="standard",
    dtype=torch.float32,
)


def tiny_model(
    cfg_overrides: dict[str, Any] | None = None,
    seed: int = 0,
    *,
    tokenizer: Any = None,
    init_scale: float = 1.0,
    device: str | torch.device = "cpu",
) -> HookedTransformer:
    """A small, seeded, randomly initialised ``HookedTransformer`` for tests and examples.

    >>> m = tiny_model({"n_layers": 3, "dtype": torch.float64}, seed=1)
    >>> m.cfg.n_layers
    3

    Biases and LayerNorm parameters are randomised too (TransformerLens initialises them to
    zero / one), so that every parameter matters in tests. ``init_scale`` scales the random
    weights for models that should be far from linear.
    """
    tl = _tl()
    cfg_dict = dict(TINY_DEFAULTS)
    cfg_dict.update(cfg_overrides or {})
    cfg_dict.setdefault("seed", seed)
    cfg_dict["seed"] = seed
    cfg_dict["device"] = str(device)
    with quiet_transformer_lens():
        cfg = tl.HookedTransformerConfig(**cfg_dict)
        model = tl.HookedTransformer(cfg, tokenizer=tokenizer)
    gen = torch.Generator().manual_seed(seed + 12345)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float64)
            if re.search(r"\.(ln\w*|q_norm|k_norm)\.w$", name) or name.endswith("ln_final.w"):
                p.copy_((1.0 + 0.1 * noise).to(p.dtype))
            elif re.search(r"\.b(_\w+)?$", name) or name.endswith("b_U"):
                p.copy_((0.05 * noise).to(p.dtype))
            else:
                fan_in = p.shape[-2] if p.ndim >= 2 else p.shape[-1]
                p.copy_((init_scale * noise / fan_in**0.5).to(p.dtype))
    model.eval()
    return model


def load_pretrained(
    name: str, *, process_weights: bool = False, **kwargs: Any
) -> HookedTransformer:
    """Load a hub model by name (needs network access to the model hub).

    Unprocessed weights by default (docs/scores.md §1: folding and centering are not linear in the
    weights); ``process_weights=True`` opts in and is recorded in ``model.cfg`` metadata so that
    scores can say so. Base and finetuned models must be loaded the same way.
    """
    tl = _tl()
    with quiet_transformer_lens():
        if process_weights:
            model = tl.HookedTransformer.from_pretrained(name, **kwargs)
        else:
            model = tl.HookedTransformer.from_pretrained_no_processing(name, **kwargs)
    _record_processing(model, processed=process_weights)
    model.eval()
    return model


def _record_processing(model: HookedTransformer, processed: bool) -> None:
    model.cfg.__dict__["extractive_lens_processed"] = bool(processed)


def weights_processed(model: HookedTransformer) -> bool:
    """Whether the model's weights were folded / centred (recorded at load; default False)."""
    return bool(getattr(model.cfg, "extractive_lens_processed", False))


def _common(hf: Any, **extra: Any) -> dict[str, Any]:
    n_heads = hf.num_attention_heads
    d_head = getattr(hf, "head_dim", None) or hf.hidden_size // n_heads
    cfg = dict(
        d_model=hf.hidden_size,
        d_head=d_head,
        n_heads=n_heads,
        d_mlp=hf.intermediate_size,
        n_layers=hf.num_hidden_layers,
        n_ctx=hf.max_position_embeddings,
        d_vocab=hf.vocab_size,
        act_fn=getattr(hf, "hidden_act", None) or getattr(hf, "hidden_activation", None),
        positional_embedding_type="rotary",
        rotary_adjacent_pairs=False,
        rotary_dim=d_head,
        rotary_base=_rope_theta(hf),
    )
    n_kv = getattr(hf, "num_key_value_heads", None)
    if n_kv is not None and n_kv != n_heads:
        cfg["n_key_value_heads"] = n_kv
    cfg.update(extra)
    return cfg


def _rope_theta(hf: Any) -> float:
    theta = getattr(hf, "rope_theta", None)
    params = getattr(hf, "rope_parameters", None)
    if theta is None and isinstance(params, dict):
        theta = params.get("rope_theta")
    return float(theta if theta is not None else 10000.0)


def _cfg_gpt2(hf: Any) -> dict[str, Any]:
    return dict(
        d_model=hf.n_embd,
        d_head=hf.n_embd // hf.n_head,
        n_heads=hf.n_head,
        d_mlp=hf.n_inner or 4 * hf.n_embd,
        n_layers=hf.n_layer,
        n_ctx=hf.n_positions,
        eps=hf.layer_norm_epsilon,
        d_vocab=hf.vocab_size,
        act_fn=hf.activation_function,
        use_attn_scale=getattr(hf, "scale_attn_weights", True),
        scale_attn_by_inverse_layer_idx=getattr(hf, "scale_attn_by_inverse_layer_idx", False),
        normalization_type="LN",
        positional_embedding_type="standard",
    )


def _cfg_neox(hf: Any) -> dict[str, Any]:
    d_head = hf.hidden_size // hf.num_attention_heads
    pct = getattr(hf, "rotary_pct", None)
    if pct is None:
        pct = (getattr(hf, "rope_parameters", None) or {}).get("partial_rotary_factor", 1.0)
    return dict(
        d_model=hf.hidden_size,
        d_head=d_head,
        n_heads=hf.num_attention_heads,
        d_mlp=hf.intermediate_size,
        n_layers=hf.num_hidden_layers,
        n_ctx=hf.max_position_embeddings,
        eps=hf.layer_norm_eps,
        d_vocab=hf.vocab_size,
        act_fn=hf.hidden_act,
        parallel_attn_mlp=getattr(hf, "use_parallel_residual", True),
        positional_embedding_type="rotary",
        rotary_adjacent_pairs=False,
        rotary_dim=round(pct * d_head),
        rotary_base=_rope_theta(hf),
        normalization_type="LN",
        default_prepend_bos=False,
    )


def _cfg_llama(hf: Any) -> dict[str, Any]:
    return _common(
        hf, eps=hf.rms_norm_eps, normalization_type="RMS", final_rms=True, gated_mlp=True
    )


def _cfg_mistral(hf: Any) -> dict[str, Any]:
    cfg = _common(hf, eps=hf.rms_norm_eps, normalization_type="RMS", final_rms=True, gated_mlp=True)
    cfg["n_key_value_heads"] = hf.num_key_value_heads
    if getattr(hf, "sliding_window", None):
        cfg.update(
            use_local_attn=True,
            window_size=hf.sliding_window,
            attn_types=["local"] * hf.num_hidden_layers,
        )
    return cfg


def _cfg_qwen2(hf: Any) -> dict[str, Any]:
    cfg = _common(
        hf,
        eps=hf.rms_norm_eps,
        normalization_type="RMS",
        final_rms=True,
        gated_mlp=True,
        default_prepend_bos=False,
    )
    cfg["n_key_value_heads"] = hf.num_key_value_heads
    return cfg


def _cfg_gemma2(hf: Any) -> dict[str, Any]:
    cfg = _common(
        hf,
        eps=hf.rms_norm_eps,
        normalization_type="RMS",
        final_rms=True,
        gated_mlp=True,
        act_fn=getattr(hf, "hidden_activation", None) or "gelu_pytorch_tanh",
        use_attn_scale=True,
        attn_scale=float(hf.query_pre_attn_scalar) ** 0.5,
        attn_scores_soft_cap=hf.attn_logit_softcapping or -1.0,
        output_logits_soft_cap=hf.final_logit_softcapping or -1.0,
        use_normalization_before_and_after=True,
    )
    cfg["n_key_value_heads"] = hf.num_key_value_heads
    if getattr(hf, "sliding_window", None):
        cfg.update(
            use_local_attn=True,
            window_size=hf.sliding_window,
            attn_types=["local", "global"] * (hf.num_hidden_layers // 2)
            + ["local"] * (hf.num_hidden_layers % 2),
        )
    return cfg


def _cfg_olmo(hf: Any) -> dict[str, Any]:
    cfg = _common(hf, eps=1e-5, normalization_type="LN", gated_mlp=True)
    if getattr(hf, "clip_qkv", None):
        cfg["clip_qkv"] = hf.clip_qkv
    return cfg


# architecture -> (config builder, name of the TransformerLens weight-conversion function)
ARCHITECTURES: dict[str, tuple[Any, str]] = {
    "GPT2LMHeadModel": (_cfg_gpt2, "convert_gpt2_weights"),
    "GPTNeoXForCausalLM": (_cfg_neox, "convert_neox_weights"),
    "LlamaForCausalLM": (_cfg_llama, "convert_llama_weights"),
    "MistralForCausalLM": (_cfg_mistral, "convert_mistral_weights"),
    "Qwen2ForCausalLM": (_cfg_qwen2, "convert_qwen2_weights"),
    "Gemma2ForCausalLM": (_cfg_gemma2, "convert_gemma_weights"),
    "OlmoForCausalLM": (_cfg_olmo, "convert_olmo_weights"),
}


def hf_config_to_tl(
    hf_config: Any, *, dtype: torch.dtype = torch.float32, device: str = "cpu"
) -> Any:
    """A ``HookedTransformerConfig`` built offline from a Hugging Face config object."""
    tl = _tl()
    arch = (getattr(hf_config, "architectures", None) or [None])[0]
    if arch not in ARCHITECTURES:
        raise ValueError(
            f"Unsupported architecture {arch!r} in the checkpoint's config.json. Supported: "
            f"{', '.join(sorted(ARCHITECTURES))}. For other models, build a HookedTransformer "
            "yourself (e.g. HookedTransformer.from_pretrained_no_processing) and pass it in."
        )
    builder, _ = ARCHITECTURES[arch]
    cfg_dict = builder(hf_config)
    cfg_dict.update(
        original_architecture=arch,
        dtype=dtype,
        device=device,
        init_weights=False,
        tokenizer_prepends_bos=True,
    )
    cfg_dict.setdefault("model_name", getattr(hf_config, "_name_or_path", "") or arch)
    with quiet_transformer_lens():
        return tl.HookedTransformerConfig(**cfg_dict)


def load_checkpoint(
    path: str | Path,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    tokenizer: Any = None,
) -> HookedTransformer:
    """Load a local Hugging Face checkpoint directory as an unprocessed ``HookedTransformer``.

    >>> ft = load_checkpoint("runs/llama-finetuned", dtype=torch.bfloat16)  # doctest: +SKIP

    Works offline: the config is built from ``config.json`` and the weights are converted by
    TransformerLens's own conversion functions. Supported families: GPT-2, GPT-NeoX / Pythia,
    Llama, Mistral, Qwen2, Gemma 2 and OLMo.
    """
    import transformers

    tl = _tl()
    path = Path(path)
    if not (path / "config.json").exists():
        raise FileNotFoundError(
            f"{path} has no config.json: pass a Hugging Face checkpoint directory "
            "(save one with model.save_pretrained(dir) and tokenizer.save_pretrained(dir))."
        )
    hf_config = transformers.AutoConfig.from_pretrained(path, local_files_only=True)
    cfg = hf_config_to_tl(hf_config, dtype=dtype, device=str(device))
    cfg.model_name = path.name
    if tokenizer is None and any(path.glob("tokenizer*")):
        tokenizer = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
    if tokenizer is not None:  # before TransformerLens gives a BOS-less tokenizer its EOS as BOS
        cfg.default_prepend_bos = tokenizer_prepends_bos(tokenizer)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(
        path, local_files_only=True, dtype=dtype
    )
    _, conv_name = ARCHITECTURES[cfg.original_architecture]
    from transformer_lens.pretrained import weight_conversions

    with quiet_transformer_lens(), torch.no_grad():
        state_dict = getattr(weight_conversions, conv_name)(hf_model, cfg)
    with quiet_transformer_lens():
        model = tl.HookedTransformer(cfg, tokenizer=tokenizer, move_to_device=False)
        model.load_and_process_state_dict(
            {k: v.to(dtype) for k, v in state_dict.items()}, **NO_PROCESSING
        )
    model.to(device)
    _record_processing(model, processed=False)
    del hf_model
    model.eval()
    return model


def tokenizer_prepends_bos(tokenizer: Any) -> bool:
    """Whether ``tokenizer(text)`` (special tokens on, as Hugging Face runs it) starts with a BOS."""
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return False
    ids = list(tokenizer("a")["input_ids"])
    return len(ids) > len(tokenizer("a", add_special_tokens=False)["input_ids"]) and ids[0] == bos


# ---------------------------------------------------------------------------------------------
# Which component owns which parameter (docs/scores.md, "What each component owns")
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ParamSlice:
    """A slice ``param[index]`` (``index=None``: the whole tensor) and the components owning it.

    ``owners == ()`` is the "other" group (embeddings, ``b_O``, final norm, unembedding).
    Shared slices (a layer's ``ln1``, a GQA key/value group) list every head that reads them;
    each head is credited through its own copy, so per-head scores still add up.
    """

    name: str
    index: int | None
    owners: tuple[Component, ...]


_HEAD_PARAMS = {"W_Q", "W_K", "W_V", "W_O", "b_Q", "b_K", "b_V", "sinks"}
_KV_PARAMS = {"_W_K", "_W_V", "_b_K", "_b_V"}
_HEAD_SHARED_MODULES = {"ln1", "attn.q_norm", "attn.k_norm"}
_MLP_MODULES = {"mlp", "ln2", "ln2_post"}


def parameter_slices(model: nn.Module) -> list[ParamSlice]:
    """The ownership partition of every parameter element of ``model`` (docs/scores.md §2)."""
    names = [n for n, _ in model.named_parameters()]
    return slices_for_names(names, model.cfg.n_heads, model.cfg.n_key_value_heads)


def slices_for_names(
    names: Any, n_heads: int, n_key_value_heads: int | None = None
) -> list[ParamSlice]:
    """``parameter_slices`` from parameter names and head counts alone (for a ``WeightDiff``)."""
    n_kv = n_key_value_heads or n_heads
    out: list[ParamSlice] = []
    for name in names:
        m = re.match(r"^blocks\.(\d+)\.(.+)\.(\w+)$", name)
        if m is None:
            out.append(ParamSlice(name, None, ()))
            continue
        layer, module, leaf = int(m.group(1)), m.group(2), m.group(3)
        heads = tuple(Component(layer, h) for h in range(n_heads))
        if module == "attn" and leaf in _HEAD_PARAMS:
            out.extend(ParamSlice(name, h, (heads[h],)) for h in range(n_heads))
        elif module == "attn" and leaf in _KV_PARAMS:
            group = n_heads // n_kv
            out.extend(ParamSlice(name, g, heads[g * group : (g + 1) * group]) for g in range(n_kv))
        elif module in _HEAD_SHARED_MODULES:
            out.append(ParamSlice(name, None, heads))
        elif module.split(".")[0] in _MLP_MODULES:
            out.append(ParamSlice(name, None, (Component(layer, None),)))
        else:  # attn.b_O, ln1_post, ...
            out.append(ParamSlice(name, None, ()))
    return out


def signature(model: nn.Module) -> dict[str, Any]:
    """The configuration fields a base and a finetuned model must share."""
    cfg = model.cfg
    keys = [
        "n_layers",
        "d_model",
        "n_heads",
        "d_head",
        "d_mlp",
        "d_vocab",
        "n_ctx",
        "n_key_value_heads",
        "normalization_type",
        "positional_embedding_type",
        "act_fn",
        "gated_mlp",
        "parallel_attn_mlp",
        "attn_only",
        "original_architecture",
    ]
    sig = {k: getattr(cfg, k, None) for k in keys}
    sig["dtype"] = str(cfg.dtype)
    sig["processed"] = weights_processed(model)
    return json.loads(json.dumps(sig, default=str))


def has_mlp(model: nn.Module) -> bool:
    return not model.cfg.attn_only


# ---------------------------------------------------------------------------------------------
# The pieces of a forward pass, so that scoring can resume the residual stream anywhere
# ---------------------------------------------------------------------------------------------


# ---------------------------------------------------------------------------------------------
# Compute precision: score a bf16/fp16 model in float32 without a second copy of it
# ---------------------------------------------------------------------------------------------

_COMPUTE_DTYPE: contextvars.ContextVar[torch.dtype | None] = contextvars.ContextVar(
    "extractive_lens_compute_dtype", default=None
)
_DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def resolve_compute_dtype(model: nn.Module, compute_dtype: torch.dtype | str | None) -> torch.dtype:
    """The dtype scores are computed in: ``compute_dtype``, or by default float32 for 16-bit
    models and the model's own dtype otherwise.

    >>> resolve_compute_dtype(tiny_model({"dtype": torch.bfloat16}), None)
    torch.float32
    >>> resolve_compute_dtype(tiny_model({"dtype": torch.float64}), "float32")
    torch.float32
    """
    storage = model.cfg.dtype
    if compute_dtype is None:
        return torch.float32 if storage in (torch.float16, torch.bfloat16) else storage
    if isinstance(compute_dtype, str):
        name = compute_dtype.removeprefix("torch.")
        if name not in _DTYPES:
            raise ValueError(
                f"compute_dtype must be one of {sorted(_DTYPES)}, got {compute_dtype!r}"
            )
        return _DTYPES[name]
    if not isinstance(compute_dtype, torch.dtype) or not compute_dtype.is_floating_point:
        raise ValueError(
            f"compute_dtype must be a floating torch.dtype such as torch.float32, got {compute_dtype!r}"
        )
    return compute_dtype


@contextlib.contextmanager
def computing_in(model: nn.Module, dtype: torch.dtype) -> Iterator[None]:
    """Run the forward pieces below (``embed``, ``attention``, ``mlp``, ``unembed``) in ``dtype``
    whatever the dtype the weights are stored in.

    Nothing is copied up front: each piece upcasts only its own module's parameters while it
    runs (one layer at a time), and under autograd the upcast weights are not kept for the
    backward pass (they are upcast again from the stored tensors when needed). ``model.cfg.dtype``
    reads ``dtype`` inside the block, because TransformerLens's norms and attention round their
    outputs to it; it is restored on exit.
    """
    if dtype == model.cfg.dtype and _COMPUTE_DTYPE.get() in (None, dtype):
        yield
        return
    from extractive_lens.interrupts import state_change

    old, previous = model.cfg.dtype, _COMPUTE_DTYPE.get()

    def change() -> None:
        _COMPUTE_DTYPE.set(dtype)
        model.cfg.dtype = dtype

    def restore() -> None:  # set, not reset: a late run may be in another context
        model.cfg.dtype = old
        _COMPUTE_DTYPE.set(previous)

    with state_change(change, restore):
        yield


def _run(module: nn.Module, prefixes: tuple[str, ...], fn: Any, *args: Any) -> Any:
    """``fn(module, *args)`` with the parameters under ``prefixes`` (``""``: all) in the compute
    dtype (see ``computing_in``); plain ``fn(module, *args)`` when there is nothing to upcast."""
    dtype = _COMPUTE_DTYPE.get()
    if dtype is None:
        return fn(module, *args)
    subs: dict[str, Tensor] = {}
    sources: dict[int, Tensor] = {}
    for name, p in module.named_parameters():
        if name.startswith(prefixes) and p.dtype != dtype:
            up = p.to(dtype)
            subs["model." + name] = up
            sources[up.untyped_storage().data_ptr()] = p
    for name, b in module.named_buffers():
        if name.startswith(prefixes) and b.is_floating_point() and b.dtype != dtype:
            subs["model." + name] = _upcast_buffer(module, name, b, dtype)
    if not subs:
        return fn(module, *args)
    call = lambda: torch.func.functional_call(_Call(module, fn), subs, args, strict=False)  # noqa: E731
    if not torch.is_grad_enabled():
        return call()
    with torch.autograd.graph.saved_tensors_hooks(*_weights_not_saved(sources, dtype)):
        return call()


def _weights_not_saved(sources: dict[int, Tensor], dtype: torch.dtype) -> tuple[Any, Any]:
    """Saved-tensor hooks that keep a reference to the stored weight instead of its upcast copy
    (a view of it, as matmuls save them) and upcast it again when the backward pass needs it."""

    def pack(t: Tensor) -> Any:
        src = sources.get(t.untyped_storage().data_ptr()) if t.dtype == dtype else None
        if src is None:
            return t
        return (src, src._version, t.size(), t.stride(), t.storage_offset())

    def unpack(packed: Any) -> Tensor:
        if isinstance(packed, Tensor):
            return packed
        src, version, size, stride, offset = packed
        if src._version != version:
            raise RuntimeError(
                "A weight changed between the forward and backward pass of a scoring run."
            )
        return src.detach().to(dtype).as_strided(size, stride, offset)

    return pack, unpack


_ROTARY_CACHE: weakref.WeakKeyDictionary[nn.Module, dict[tuple[str, torch.dtype, int], Tensor]] = (
    weakref.WeakKeyDictionary()
)  # per attention module (weakly held: a new model never inherits a collected one's tables)


def _upcast_buffer(module: nn.Module, name: str, buf: Tensor, dtype: torch.dtype) -> Tensor:
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


def check_scorable(model: nn.Module) -> None:
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


VIEW_FLAGS = ("use_attn_result", "use_split_qkv_input", "use_attn_in", "use_hook_mlp_in")
"""TransformerLens flags that change which hooks fire and how attention inputs are shaped, not
what the model computes: scoring turns them off while it runs (``standard_flags``)."""


@contextlib.contextmanager
def standard_flags(model: nn.Module) -> Iterator[None]:
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

    with state_change(change, restore):
        yield


def on_block(model: nn.Module, layer: int, x: Tensor) -> Tensor:
    """``x`` on the device of block ``layer`` (models split over devices with ``n_devices``)."""
    if getattr(model.cfg, "n_devices", 1) <= 1:
        return x
    dev = (
        model.blocks[layer].ln1.w.device
        if hasattr(model.blocks[layer].ln1, "w")
        else next(model.blocks[layer].parameters()).device
    )
    return x.to(dev)


def on_final(model: nn.Module, x: Tensor) -> Tensor:
    """``x`` on the device of the unembedding."""
    if getattr(model.cfg, "n_devices", 1) <= 1:
        return x
    return x.to(model.unembed.W_U.device)


def embed(model: nn.Module, tokens: Int[Tensor, "batch pos"]) -> Float[Tensor, "batch pos d_model"]:
    """The residual stream entering layer 0 (token embedding plus absolute positions)."""

    def run(m: nn.Module, tokens: Tensor) -> Tensor:
        x = m.hook_embed(m.embed(tokens))
        if m.cfg.positional_embedding_type == "standard":
            x = x + m.hook_pos_embed(m.pos_embed(tokens))
        return x

    return _run(model, ("embed.", "pos_embed."), run, tokens)


def attention(
    model: nn.Module,
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

    def run(b: nn.Module, x: Tensor) -> Tensor:
        x = b.ln1(x)
        return b.attn(query_input=x, key_input=x, value_input=x, past_kv_cache_entry=entry)

    try:  # hooks registered inside the try, so that they are removed whatever happens
        for name in capture:
            hp = getattr(block.attn, f"hook_{name}")
            handles.append(
                hp.register_forward_hook(
                    lambda _m, _i, out, name=name: captured.__setitem__(name, out)
                )
            )
        out = _run(block, ("ln1.", "attn."), run, resid_pre)
    finally:
        for h in handles:
            h.remove()
    return out, captured


def mlp(
    model: nn.Module, layer: int, mlp_in: Float[Tensor, "batch pos d_model"]
) -> Float[Tensor, "batch pos d_model"]:
    """Layer ``layer``'s MLP (with its ``ln2``) on its input stream."""
    return _run(
        model.blocks[layer],
        ("ln2.", "mlp."),
        lambda b, x: b.mlp(b.ln2(x)),
        on_block(model, layer, mlp_in),
    )


def unembed(
    model: nn.Module, resid: Float[Tensor, "batch pos d_model"]
) -> Float[Tensor, "batch pos d_vocab"]:
    """Final norm, unembedding and logit soft-capping."""

    def run(m: nn.Module, x: Tensor) -> Tensor:
        if m.cfg.normalization_type is not None:
            x = m.ln_final(x)
        return m.unembed(x)

    logits = _run(model, ("ln_final.", "unembed."), run, on_final(model, resid))
    cap = model.cfg.output_logits_soft_cap
    if cap is not None and cap > 0:
        logits = cap * torch.tanh(logits / cap)
    return logits


def mlp_input(model: nn.Module, resid_pre: Tensor, resid_mid: Tensor) -> Tensor:
    """What the MLP of a block reads: ``resid_mid``, or ``resid_pre`` for parallel blocks."""
    return resid_pre if model.cfg.parallel_attn_mlp else resid_mid


def head_param_names(names: Any, layer: int) -> list[str]:
    """Of ``names``, the parameters a layer's attention reads (``ln1`` and ``attn``)."""
    prefixes = (f"blocks.{layer}.ln1.", f"blocks.{layer}.attn.")
    return [n for n in names if n.startswith(prefixes)]


def mlp_param_names(names: Any, layer: int) -> list[str]:
    """Of ``names``, the parameters a layer's MLP reads (``ln2`` and ``mlp``)."""
    prefixes = (f"blocks.{layer}.ln2.", f"blocks.{layer}.mlp.")
    return [n for n in names if n.startswith(prefixes)]


def head_params(model: nn.Module, layer: int) -> dict[str, Tensor]:
    params = dict(model.named_parameters())
    return {n: params[n] for n in head_param_names(params, layer)}


def mlp_params(model: nn.Module, layer: int) -> dict[str, Tensor]:
    params = dict(model.named_parameters())
    return {n: params[n] for n in mlp_param_names(params, layer)}


def W_O(model: nn.Module, layer: int) -> Float[Tensor, "head d_head d_model"]:
    return model.blocks[layer].attn.W_O


@contextlib.contextmanager
def frozen_parameters(model: nn.Module) -> Iterator[None]:
    """Turn off ``requires_grad`` on every parameter (no weight gradients), restored on exit."""
    from extractive_lens.interrupts import state_change

    saved = [(p, p.requires_grad) for p in model.parameters()]

    def change() -> None:
        for p, _ in saved:
            p.requires_grad_(False)

    def restore() -> None:
        for p, flag in saved:
            p.requires_grad_(flag)

    with state_change(change, restore):
        yield


class _Call(nn.Module):
    """``fn(model, *args)`` as a module, so ``functional_call`` can substitute ``model``'s weights."""

    def __init__(self, model: nn.Module, fn: Any) -> None:
        super().__init__()
        self.model = model
        self.fn = fn

    def forward(self, *args: Any) -> Any:
        return self.fn(self.model, *args)


def jvp(
    model: nn.Module, fn: Any, args: tuple[Any, ...], tangents: dict[str, Tensor]
) -> tuple[Any, Any]:
    """Forward-mode derivative of ``fn(model, *args)`` along a weight direction.

    ``tangents`` maps full parameter names (``blocks.3.attn.W_Q``) to directions; parameters
    not named are held fixed. ``fn`` may return a tensor, a tuple or a dict of tensors; the
    result is ``(primal, tangent)`` with the same structure.
    """
    import torch.autograd.forward_ad as fwAD

    params = dict(model.named_parameters())
    unknown = sorted(set(tangents) - set(params))
    if unknown:
        raise KeyError(f"jvp: the model has no parameters {unknown[:3]}")
    dtype = _COMPUTE_DTYPE.get()
    with fwAD.dual_level():
        duals = {}
        for name, t in tangents.items():
            p = params[name].detach()
            dt = dtype or p.dtype  # in a compute dtype, the weights and Δ are upcast, not Δ rounded
            duals["model." + name] = fwAD.make_dual(p.to(dt), t.to(device=p.device, dtype=dt))
        result = torch.func.functional_call(_Call(model, fn), duals, args, strict=False)
        return _unpack(result)


def _unpack(result: Any) -> tuple[Any, Any]:
    import torch.autograd.forward_ad as fwAD

    if isinstance(result, Tensor):
        d = fwAD.unpack_dual(result)
        return d.primal, d.tangent if d.tangent is not None else torch.zeros_like(d.primal)
    if isinstance(result, dict):
        pairs = {k: _unpack(v) for k, v in result.items()}
        return {k: p for k, (p, _) in pairs.items()}, {k: t for k, (_, t) in pairs.items()}
    pairs_l = [_unpack(v) for v in result]
    return tuple(p for p, _ in pairs_l), tuple(t for _, t in pairs_l)


def attention_jvp(
    model: nn.Module,
    layer: int,
    resid_pre: Tensor,
    tangents: dict[str, Tensor],
    capture: tuple[str, ...] = ("z",),
) -> tuple[Tensor, Tensor, dict[str, Tensor], dict[str, Tensor]]:
    """``(out, out_dot, captured, captured_dot)`` of a layer's attention along ``tangents``."""
    (out, cap), (out_dot, cap_dot) = jvp(
        model, lambda m, x: attention(m, layer, x, capture), (resid_pre,), tangents
    )
    return out, out_dot, cap, cap_dot


def mlp_jvp(
    model: nn.Module, layer: int, mlp_in: Tensor, tangents: dict[str, Tensor]
) -> tuple[Tensor, Tensor]:
    """``(out, out_dot)`` of a layer's MLP along ``tangents``."""
    return jvp(model, lambda m, x: mlp(m, layer, x), (mlp_in,), tangents)

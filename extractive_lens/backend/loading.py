"""Loading models as ``HookedTransformer``s: hub names, local Hugging Face checkpoints, tiny
seeded models for tests, and models built from a configuration dict (the bundled world model).

>>> base = tiny_model({"n_layers": 2}, seed=0)          # a seeded HookedTransformer
>>> ft = load_checkpoint("runs/finetuned")  # a local HF checkpoint  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import re
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from extractive_lens.backend.hooked import notes
from extractive_lens.backend.installed import has_hooked, version  # noqa: F401  (re-exported)

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
        # TransformerLens imports tqdm.auto, which warns in a notebook without ipywidgets
        warnings.filterwarnings("ignore", message="IProgress not found")
        yield


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """No Hugging Face loading bars or config notices inside our own loading calls (restored
    after): a researcher loading two checkpoints should see our output, not theirs."""
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()


def _tl():
    with quiet_transformer_lens():
        import transformer_lens

    return transformer_lens


def _hooked_tl(what: str) -> Any:
    """TransformerLens, for building a ``HookedTransformer``; on TransformerLens 4 (which removed
    it) an error that says what to pass or install instead."""
    if not has_hooked():
        raise ImportError(
            f"{what} builds a HookedTransformer, which TransformerLens {version()} removed. Pass "
            "backend='bridge' (or 'auto', the default) for a TransformerBridge, or install "
            "TransformerLens 3.9 (pip install 'transformer-lens>=3.9,<4') for HookedTransformers."
        )
    return _tl()


BACKEND_NAMES = ("hooked", "bridge")
"""What the loaders build (``backend=``): a ``HookedTransformer`` or a ``TransformerBridge``;
``"auto"`` (the default) picks the first where the installed TransformerLens has it."""


def resolve_backend(backend: str | None) -> str:
    """``"hooked"`` or ``"bridge"`` for a loader's ``backend=`` argument: ``"auto"`` / ``None``
    give a ``HookedTransformer`` where TransformerLens has one (3.x), else a bridge (4.x).

    >>> resolve_backend("bridge")
    'bridge'
    """
    if backend is None or backend == "auto":
        return "hooked" if has_hooked() else "bridge"
    if backend not in BACKEND_NAMES:
        raise ValueError(f"backend must be 'auto', 'hooked' or 'bridge', got {backend!r}")
    if backend == "hooked":
        _hooked_tl("backend='hooked'")
    return backend


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


def named_tokenizer(tokenizer: Any) -> Any:
    """``tokenizer``, saved and reloaded when it was built in memory: TransformerLens reads
    ``init_kwargs["name_or_path"]``, which only loading sets (else ``KeyError: 'name_or_path'``).
    The reload is a copy; a loaded tokenizer is returned unchanged."""
    if tokenizer is None or "name_or_path" in getattr(
        tokenizer, "init_kwargs", {"name_or_path": 0}
    ):
        return tokenizer
    import tempfile

    import transformers

    path = Path(tempfile.mkdtemp(prefix="el-tok-"))
    tokenizer.save_pretrained(path)
    return transformers.AutoTokenizer.from_pretrained(path)


def tiny_model(
    cfg_overrides: dict[str, Any] | None = None,
    seed: int = 0,
    *,
    tokenizer: Any = None,
    init_scale: float = 1.0,
    device: str | torch.device = "cpu",
    backend: str = "auto",
) -> Any:
    """A small, seeded, randomly initialised model for tests and examples: a
    ``HookedTransformer`` (``backend="hooked"``, the default where TransformerLens has it) or a
    TransformerLens native ``TransformerBridge`` (``"bridge"``, the default on TransformerLens 4).

    >>> m = tiny_model({"n_layers": 3, "dtype": torch.float64}, seed=1)
    >>> m.cfg.n_layers
    3

    Biases and LayerNorm parameters are randomised too (TransformerLens initialises them to
    zero / one), so that every parameter matters in tests. ``init_scale`` scales the random
    weights for models that should be far from linear. The same ``seed`` gives the same weights
    in both backends: parameters draw their noise in the ``HookedTransformer``'s order.
    """
    backend = resolve_backend(backend)
    cfg_dict = dict(TINY_DEFAULTS)
    cfg_dict.update(cfg_overrides or {})
    cfg_dict["seed"] = seed
    cfg_dict["device"] = str(device)
    if backend == "bridge":
        return _tiny_bridge(cfg_dict, seed, tokenizer=tokenizer, init_scale=init_scale)
    tl = _hooked_tl("tiny_model(backend='hooked')")
    with quiet_transformer_lens():
        cfg = tl.HookedTransformerConfig(**cfg_dict)
        model = tl.HookedTransformer(cfg, tokenizer=named_tokenizer(tokenizer))
    values = _tiny_weights(
        {n: (tuple(p.shape), p.dtype) for n, p in model.named_parameters()}, seed, init_scale
    )
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(values[name])
    model.eval()
    return model


def _tiny_weights(
    shapes: dict[str, tuple[tuple[int, ...], torch.dtype]], seed: int, init_scale: float
) -> dict[str, Tensor]:
    """``tiny_model``'s random weights: one seeded stream drawn in ``HookedTransformer``
    parameter order (``hooked_order``), whichever class holds the parameters."""
    gen = torch.Generator().manual_seed(seed + 12345)
    out: dict[str, Tensor] = {}
    gated = any(n.endswith("mlp.W_gate") for n in shapes)
    for name in sorted(shapes, key=lambda n: hooked_order(n, gated)):
        shape, dtype = shapes[name]
        noise = torch.randn(shape, generator=gen, dtype=torch.float64)
        if re.search(r"\.(ln\w*|q_norm|k_norm)\.w$", name) or name.endswith("ln_final.w"):
            out[name] = (1.0 + 0.1 * noise).to(dtype)
        elif re.search(r"\.b(_\w+)?$", name) or name.endswith("b_U"):
            out[name] = (0.05 * noise).to(dtype)
        else:
            fan_in = shape[-2] if len(shape) >= 2 else shape[-1]
            out[name] = (init_scale * noise / fan_in**0.5).to(dtype)
    return out


# A HookedTransformer block registers its parameters in this order (TransformerLens 3.9); a
# gated MLP registers W_gate after W_out and its biases last.
_BLOCK_ORDER = (
    "ln1.w", "ln1.b", "ln2.w", "ln2.b",
    "attn.W_Q", "attn.W_O", "attn.b_Q", "attn.b_O",
    "attn.W_K", "attn.W_V", "attn.b_K", "attn.b_V",
    "attn._W_K", "attn._W_V", "attn._b_K", "attn._b_V",
)  # fmt: skip
_MLP_ORDER = ("mlp.W_in", "mlp.b_in", "mlp.W_out", "mlp.b_out")
_GATED_ORDER = ("mlp.W_in", "mlp.W_out", "mlp.W_gate", "mlp.b_in", "mlp.b_out")
_TOP_ORDER = ("embed.W_E", "pos_embed.W_pos", "blocks", "ln_final.w", "ln_final.b",
              "unembed.W_U", "unembed.b_U")  # fmt: skip


def hooked_order(name: str, gated: bool = False) -> tuple[int, int, int]:
    """The sort key that puts TransformerLens parameter names in ``HookedTransformer`` order.

    >>> sorted(["unembed.W_U", "blocks.0.attn.W_K", "blocks.0.ln1.w", "embed.W_E"], key=hooked_order)
    ['embed.W_E', 'blocks.0.ln1.w', 'blocks.0.attn.W_K', 'unembed.W_U']
    """
    blocks = _TOP_ORDER.index("blocks")
    m = re.fullmatch(r"blocks\.(\d+)\.(.+)", name)
    if m is None:
        return (_TOP_ORDER.index(name) if name in _TOP_ORDER else len(_TOP_ORDER), 0, 0)
    order = _BLOCK_ORDER + (_GATED_ORDER if gated else _MLP_ORDER)
    rest = m.group(2)
    return (blocks, int(m.group(1)), order.index(rest) if rest in order else len(order))


def _tiny_bridge(cfg: dict[str, Any], seed: int, *, tokenizer: Any, init_scale: float) -> Any:
    """``tiny_model`` as a TransformerLens native ``TransformerBridge``. On TransformerLens 3.9
    it is ``as_bridge`` of the ``HookedTransformer`` (which checks that the native architecture
    computes the same logits); on 4.x it is built directly, with the same weights."""
    if has_hooked():
        return as_bridge(
            tiny_model(cfg, seed, tokenizer=tokenizer, init_scale=init_scale, backend="hooked")
        )
    if cfg.get("parallel_attn_mlp"):
        raise NotImplementedError(
            "TransformerLens's native TransformerBridge has no parallel attention/MLP blocks. "
            "tiny_model(..., backend='hooked') builds one with TransformerLens 3.9 "
            "(pip install 'transformer-lens>=3.9,<4'); on TransformerLens 4 save a tiny Hugging "
            "Face GPT-NeoX checkpoint and load_checkpoint(dir) it."
        )
    if cfg.get("positional_embedding_type") == "rotary" and not cfg.get("rotary_adjacent_pairs"):
        raise NotImplementedError(
            "TransformerLens 4's native TransformerBridge rotates adjacent pairs of dimensions "
            "(GPT-J style): pass rotary_adjacent_pairs=True to tiny_model, or "
            "load a Hugging Face checkpoint with load_checkpoint(dir)."
        )
    cfg = dict(cfg)
    dtype, device = cfg.pop("dtype", torch.float32), cfg.pop("device", "cpu")
    out = native_bridge(cfg, named_tokenizer(tokenizer), {}, device=device, dtype=dtype,
                        model_name=cfg.get("model_name", "tiny"))  # fmt: skip
    from extractive_lens.backend import bridge as bridge_backend

    params = bridge_backend.parameters(out)
    values = _tiny_weights({n: (tuple(p.shape), p.dtype) for n, p in params.items()}, seed,
                           init_scale)  # fmt: skip
    keep = bridge_backend.stored_names(out)  # biases the native model lacks stay 0
    if "bias" in dict(out.unembed.original_component.named_buffers(recurse=False)):
        keep.add("unembed.b_U")  # a fixed buffer in TransformerLens 4: _write_native sets it
    _write_native(out, {n: v for n, v in values.items() if n in keep})
    return out


def load_pretrained(
    name: str, *, process_weights: bool = False, backend: str = "auto", **kwargs: Any
) -> Any:
    """Load a hub model by name (needs network access to the model hub).

    Unprocessed weights by default (docs/scores.md §1: folding and centering are not linear in the
    weights); ``process_weights=True`` opts in and is recorded in ``model.cfg`` metadata so that
    scores can say so. Base and finetuned models must be loaded the same way.
    ``backend="bridge"``: a TransformerLens ``TransformerBridge`` (``boot_transformers``, no
    weight processing; ``kwargs`` are ``dtype`` and ``device``). ``"auto"`` (default): a
    ``HookedTransformer`` where TransformerLens has one (3.x), else a bridge (4.x).
    """
    backend = resolve_backend(backend)
    if backend == "bridge":
        if process_weights:
            raise ValueError("backend='bridge' loads unprocessed weights only.")
        return _boot_bridge(name, tokenizer=None, **kwargs)
    tl = _hooked_tl("load_pretrained(backend='hooked')")
    with quiet_transformer_lens():
        if process_weights:
            model = tl.HookedTransformer.from_pretrained(name, **kwargs)
        else:
            model = tl.HookedTransformer.from_pretrained_no_processing(name, **kwargs)
    _record_processing(model, processed=process_weights)
    model.eval()
    return model


def _record_processing(model: Any, processed: bool) -> None:
    notes(model)["processed"] = bool(processed)


def build(
    cfg: dict[str, Any],
    tokenizer: Any = None,
    *,
    notes_: dict[str, Any] | None = None,
    **kwargs: Any,
) -> HookedTransformer:
    """A ``HookedTransformer`` from a configuration dict (TransformerLens's own initialisation,
    seeded by ``cfg["seed"]`` when given), unprocessed, with ``notes_`` recorded on it."""
    tl = _hooked_tl("Building a world model from its configuration")
    with quiet_transformer_lens():
        model = tl.HookedTransformer(
            tl.HookedTransformerConfig(**cfg), tokenizer=named_tokenizer(tokenizer), **kwargs
        )
    _record_processing(model, processed=False)
    notes(model).update(notes_ or {})
    return model


def native_bridge(
    cfg: dict[str, Any],
    tokenizer: Any,
    parameters: dict[str, Tensor],
    *,
    notes_: dict[str, Any] | None = None,
    device: str | torch.device | None = "cpu",
    dtype: torch.dtype = torch.float32,
    model_name: str = "custom",
) -> Any:
    """A TransformerLens native ``TransformerBridge`` (``boot_native``, offline) with this
    configuration and these weights (TransformerLens names), in eval mode. Needs no
    ``HookedTransformer``, so it works on TransformerLens 4 too."""
    import copy

    from transformer_lens.config import TransformerBridgeConfig
    from transformer_lens.model_bridge import TransformerBridge

    cfg = dict(cfg, dtype=dtype, device=device, init_weights=False, architecture=None)
    cfg.update(original_architecture=None)
    with quiet_transformer_lens(), quiet_transformers():
        tok = None if tokenizer is None else copy.deepcopy(tokenizer)  # the bridge mutates it
        out = TransformerBridge.boot_native(
            TransformerBridgeConfig.from_dict(cfg), tokenizer=tok, device=device, dtype=dtype,
            model_name=model_name,
        )  # fmt: skip
    _write_native(out, parameters)
    notes(out).update(copy.deepcopy(notes_ or {}))
    out.eval()
    return out


def _write_native(bridge: Any, parameters: dict[str, Tensor]) -> None:
    """Write TransformerLens-named weights into a native bridge, the unembedding bias included
    (TransformerLens 4 gives the native head a fixed bias: a buffer, not a weight)."""
    from extractive_lens.backend import bridge as bridge_backend

    parameters = dict(parameters)
    head = bridge.unembed.original_component
    if "bias" in dict(head.named_buffers(recurse=False)) and "unembed.b_U" in parameters:
        with torch.no_grad():
            head.bias.copy_(parameters.pop("unembed.b_U"))
    bridge_backend.write_parameters(bridge, parameters)


AS_BRIDGE_TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-4, torch.float16: 1e-2,
                       torch.bfloat16: 5e-2}  # fmt: skip
"""``as_bridge``'s self-check: the largest logit difference, relative to the largest logit, that
rounding in each dtype explains (two implementations that round differently); a bridge that
computes another function (rotary, RMS or parallel blocks in TransformerLens 3.9's native
model) differs by tens of percent."""


def as_bridge(model: HookedTransformer) -> Any:
    """A TransformerLens ``TransformerBridge`` with ``model``'s configuration, weights, tokenizer
    and notes: TransformerLens's native architecture, booted offline (``boot_native``).

    >>> bridge = as_bridge(tiny_model({"n_layers": 2}))
    >>> type(bridge).__name__
    'TransformerBridge'
    """
    from extractive_lens.backend import hooked

    if not hooked.handles(model):
        raise TypeError(f"as_bridge converts a HookedTransformer, not a {type(model).__name__}.")
    out = native_bridge(
        model.cfg.to_dict(), model.tokenizer, hooked.parameters(model), notes_=notes(model),
        device=model.cfg.device, dtype=model.cfg.dtype, model_name=model.cfg.model_name,
    )  # fmt: skip
    probe = torch.arange(min(8, model.cfg.n_ctx), device=model.cfg.device)[None] % model.cfg.d_vocab
    with torch.no_grad():
        want, got = model(probe), out(probe)
    err = float((got - want).abs().max() / (want.abs().max() + 1e-30))
    if not err <= AS_BRIDGE_TOLERANCE.get(model.cfg.dtype, 1e-4):
        raise NotImplementedError(
            "TransformerLens's native TransformerBridge does not compute what this "
            f"HookedTransformer computes (logits differ by {err:.1e} of their largest value; it "
            "implements sequential LayerNorm blocks with learned positions exactly, not parallel "
            "blocks, rotary or RMS norms in float64). Load a Hugging Face checkpoint with "
            "load_checkpoint(dir, backend='bridge') instead."
        )
    return out


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
    tl = _hooked_tl("hf_config_to_tl")
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
    backend: str = "auto",
) -> Any:
    """Load a local Hugging Face checkpoint directory as an unprocessed ``HookedTransformer``
    (``backend="hooked"``) or as a TransformerLens ``TransformerBridge`` (``backend="bridge"``,
    the model class of TransformerLens 4: it runs the Hugging Face model itself). ``"auto"``
    (default): a ``HookedTransformer`` where TransformerLens has one (3.x), else a bridge.

    >>> ft = load_checkpoint("runs/llama-finetuned", dtype=torch.bfloat16)  # doctest: +SKIP
    >>> ft = load_checkpoint("runs/llama-finetuned", backend="bridge")  # doctest: +SKIP

    Works offline. ``"hooked"``: the config is built from ``config.json`` and the weights are
    converted by TransformerLens's own conversion functions (GPT-2, GPT-NeoX / Pythia, Llama,
    Mistral, Qwen2, Gemma 2 and OLMo). ``"bridge"``: ``TransformerBridge.boot_transformers`` on
    the directory (every architecture TransformerLens bridges; scoring checks the blocks).
    """
    import transformers

    backend = resolve_backend(backend)
    path = Path(path)
    if not (path / "config.json").exists():
        raise FileNotFoundError(
            f"{path} has no config.json: pass a Hugging Face checkpoint directory "
            "(save one with model.save_pretrained(dir) and tokenizer.save_pretrained(dir))."
        )
    refuse_remote_code(path)
    refuse_incomplete_weights(path)
    with quiet_transformers():
        hf_config = transformers.AutoConfig.from_pretrained(
            path, local_files_only=True, trust_remote_code=False
        )
        if tokenizer is None and any(path.glob("tokenizer*")):
            tokenizer = transformers.AutoTokenizer.from_pretrained(
                path, local_files_only=True, trust_remote_code=False
            )
    if backend == "bridge":
        return _boot_bridge(path, dtype=dtype, device=device, tokenizer=tokenizer)
    tl = _hooked_tl("load_checkpoint(backend='hooked')")
    cfg = hf_config_to_tl(hf_config, dtype=dtype, device=str(device))
    cfg.model_name = path.name
    tokenizer = named_tokenizer(tokenizer)
    if tokenizer is not None:  # before TransformerLens gives a BOS-less tokenizer its EOS as BOS
        cfg.default_prepend_bos = tokenizer_prepends_bos(tokenizer)
    with quiet_transformers():
        hf_model = transformers.AutoModelForCausalLM.from_pretrained(
            path, local_files_only=True, dtype=dtype, trust_remote_code=False
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
    model.to(device, print_details=False)
    _record_processing(model, processed=False)
    del hf_model
    model.eval()
    return model


REMOTE_CODE_FILES = ("config.json", "tokenizer_config.json", "generation_config.json",
                     "processor_config.json")  # fmt: skip


def refuse_remote_code(path: str | Path) -> None:
    """Refuse, in one sentence, a checkpoint directory that asks to run its own code
    (``auto_map`` in its configuration files, or ``.py`` files beside them): extractive_lens
    never executes code from a checkpoint, and ``transformers`` would otherwise prompt for it."""
    import json

    path = Path(path)
    asks = []
    for name in REMOTE_CODE_FILES:
        f = path / name
        if not f.is_file():
            continue
        try:
            data = json.loads(f.read_text(encoding="utf-8"))
        except (OSError, ValueError, UnicodeDecodeError):
            raise ValueError(f"{f} is not valid JSON: is this a Hugging Face checkpoint?") from None
        if isinstance(data, dict) and "auto_map" in data:
            asks.append(f"{name} has an auto_map")
    asks += [f"{p.name} is code" for p in sorted(path.glob("*.py"))]
    if asks:
        raise ValueError(
            f"{path} asks to run code shipped with the checkpoint ({'; '.join(asks[:3])}); "
            "extractive_lens never runs code from a checkpoint. Use a checkpoint of a model "
            "class transformers ships, or remove the auto_map entries and .py files if the "
            "architecture is a standard one."
        )


def refuse_incomplete_weights(path: str | Path) -> None:
    """Refuse a checkpoint whose weights do not match its ``config.json`` (missing, unexpected
    or mis-shaped tensors: a config asking for more layers than the weights hold, a truncated
    shard set), naming them: ``transformers`` would fill the gaps with fresh random values,
    different on every load, so a base and a finetuned model would differ by noise. Checked on
    the meta device (no weights are read into memory)."""
    import transformers

    with quiet_transformers(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            loaded: Any = transformers.AutoModelForCausalLM.from_pretrained(
                path, local_files_only=True, trust_remote_code=False, output_loading_info=True,
                device_map="meta",
            )  # fmt: skip
            info: dict[str, Any] = loaded[1]
        except Exception:  # not loadable this way: the real load says why
            return
    found = {
        what: sorted(str(k[0] if isinstance(k, tuple) else k) for k in info.get(key) or ())
        for what, key in (("missing", "missing_keys"), ("unexpected", "unexpected_keys"),
                          ("mis-shaped", "mismatched_keys"))
    }  # fmt: skip
    if any(found.values()):
        said = "; ".join(
            f"{len(v)} {what} ({', '.join(v[:3])}{', …' if len(v) > 3 else ''})"
            for what, v in found.items()
            if v
        )
        raise ValueError(
            f"{path}: the weights do not match config.json: {said}. Loading would fill the gaps "
            "with random values. Check that every shard is there and that config.json "
            "(e.g. its number of layers) describes these weights."
        )


def _boot_bridge(
    path: Path | str, *, tokenizer: Any, dtype: torch.dtype = torch.float32, device: Any = None
) -> Any:
    """``TransformerBridge.boot_transformers`` on a local directory, quietly, with a tokenizer of
    its own (the bridge changes the tokenizer it is given)."""
    import copy

    from transformer_lens.model_bridge import TransformerBridge

    if Path(path).is_dir():
        refuse_remote_code(path)
        refuse_incomplete_weights(path)
    tokenizer = named_tokenizer(tokenizer)
    with quiet_transformer_lens(), quiet_transformers():
        model = TransformerBridge.boot_transformers(
            str(path), tokenizer=None if tokenizer is None else copy.deepcopy(tokenizer),
            dtype=dtype, device=device, trust_remote_code=False,
        )  # fmt: skip
    model.cfg.model_name = Path(path).name
    if tokenizer is not None:
        model.cfg.default_prepend_bos = tokenizer_prepends_bos(tokenizer)
    _record_processing(model, processed=False)
    model.eval()
    return model


def tokenizer_prepends_bos(tokenizer: Any) -> bool:
    """Whether ``tokenizer(text)`` (special tokens on, as Hugging Face runs it) starts with a BOS."""
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return False
    ids = list(tokenizer("a")["input_ids"])
    return len(ids) > len(tokenizer("a", add_special_tokens=False)["input_ids"]) and ids[0] == bos


def word_tokenizer(
    words: list[str], directory: str | Path | None = None, *, model_max_length: int | None = None
) -> Any:
    """A whitespace word-level ``PreTrainedTokenizerFast`` over ``words`` (plus ``<unk>``,
    ``<bos>``, ``<pad>``), saved to ``directory`` (a temporary one by default) and reloaded: a
    tokenizer handed to TransformerLens needs ``name_or_path``, which only a reload sets."""
    import tempfile

    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {w: i for i, w in enumerate(["<unk>", "<bos>", "<pad>", *dict.fromkeys(words)])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    extra = {} if model_max_length is None else {"model_max_length": model_max_length}
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<bos>", pad_token="<pad>", unk_token="<unk>", **extra
    )
    path = Path(directory) if directory is not None else Path(tempfile.mkdtemp(prefix="el-tok-"))
    path.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(path)
    return transformers.AutoTokenizer.from_pretrained(path)

"""The model families ``load_checkpoint`` converts to a ``HookedTransformer``: one entry per
Hugging Face architecture, saying how its ``config.json`` becomes a ``HookedTransformerConfig``,
which TransformerLens function converts its weights, and which configurations it refuses.

An entry is one decorated function (CONTRIBUTING.md, "Add a model family")::

    @family("LlamaForCausalLM", "convert_llama_weights")
    def _llama(hf):                      # the Hugging Face config object
        return _common(hf, eps=hf.rms_norm_eps, normalization_type="RMS", ...)

``refuses=`` names a function of the Hugging Face config that returns why the conversion would
compute something else for it (a sentence saying what to do instead), or ``None``. Every family
also refuses a rotary scaling (``rope_type``) that its builder does not convert: Llama 3's
(``_llama3_rope``) is converted, others (``yarn``, ``linear``...) are refused.

>>> sorted(ARCHITECTURES)[:2]
['GPT2LMHeadModel', 'GPTNeoXForCausalLM']
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from extractive_lens.backend.installed import hooked_tl, quiet_transformer_lens

if TYPE_CHECKING:  # pragma: no cover
    from transformer_lens import HookedTransformerConfig


@dataclass(frozen=True)
class Family:
    """One Hugging Face architecture that converts to a ``HookedTransformer``."""

    architecture: str
    """``config.json``'s ``architectures[0]``, e.g. ``"LlamaForCausalLM"``."""
    config: Callable[[Any], dict[str, Any]]
    """The Hugging Face config object -> ``HookedTransformerConfig`` fields."""
    conversion: str
    """The TransformerLens function (``transformer_lens.pretrained.weight_conversions``) that
    turns the Hugging Face model's weights into TransformerLens's."""
    refuses: Callable[[Any], str | None] | None = None
    """Why this family's conversion would compute something else for a config, or ``None``."""

    def weights(self, hf_model: Any, cfg: HookedTransformerConfig) -> dict[str, Tensor]:
        """The Hugging Face model's weights by TransformerLens name (TransformerLens's own
        conversion function, quietly, without gradients)."""
        from transformer_lens.pretrained import weight_conversions

        with quiet_transformer_lens(), torch.no_grad():
            return getattr(weight_conversions, self.conversion)(hf_model, cfg)


ARCHITECTURES: dict[str, Family] = {}
"""The families by Hugging Face architecture name (filled by ``@family``)."""


def family(
    architecture: str, conversion: str, *, refuses: Callable[[Any], str | None] | None = None
) -> Callable[[Callable[[Any], dict[str, Any]]], Callable[[Any], dict[str, Any]]]:
    """Register the decorated config builder as ``architecture``'s family entry."""

    def register(config: Callable[[Any], dict[str, Any]]) -> Callable[[Any], dict[str, Any]]:
        ARCHITECTURES[architecture] = Family(architecture, config, conversion, refuses)
        return config

    return register


def family_of(hf_config: Any) -> Family:
    """The entry for a Hugging Face config, or an error listing the supported architectures."""
    arch = (getattr(hf_config, "architectures", None) or [None])[0]
    if arch not in ARCHITECTURES:
        raise ValueError(
            f"Unsupported architecture {arch!r} in the checkpoint's config.json. Supported: "
            f"{', '.join(sorted(ARCHITECTURES))}. For other models, build a HookedTransformer "
            "yourself (e.g. HookedTransformer.from_pretrained_no_processing) and pass it in."
        )
    return ARCHITECTURES[arch]


def hf_config_to_tl(
    hf_config: Any, *, dtype: torch.dtype = torch.float32, device: str = "cpu"
) -> Any:
    """A ``HookedTransformerConfig`` built offline from a Hugging Face config object."""
    tl = hooked_tl("hf_config_to_tl")
    fam = family_of(hf_config)
    reason = fam.refuses(hf_config) if fam.refuses is not None else None
    if reason:
        raise ValueError(f"{fam.architecture}: {reason}")
    cfg_dict = fam.config(hf_config)
    scaling = rope_scaling(hf_config)
    if scaling is not None and not (scaling == "llama3" and cfg_dict.get("use_NTK_by_parts_rope")):
        raise ValueError(
            f"{fam.architecture}: rope_type {scaling!r} (a rotary scaling the HookedTransformer "
            "conversion does not implement; positions would be rotated wrongly): load it with "
            "load_checkpoint(dir, backend='bridge')."
        )
    cfg_dict.update(
        original_architecture=fam.architecture,
        dtype=dtype,
        device=device,
        init_weights=False,
        tokenizer_prepends_bos=True,
    )
    cfg_dict.setdefault("model_name", getattr(hf_config, "_name_or_path", "") or fam.architecture)
    with quiet_transformer_lens():
        return tl.HookedTransformerConfig(**cfg_dict)


# ---------------------------------------------------------------------------------------------
# The entries
# ---------------------------------------------------------------------------------------------


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


def rope_scaling(hf: Any) -> str | None:
    """The rotary scaling a Hugging Face config asks for (``"llama3"``, ``"yarn"``...), or
    ``None`` for plain rotary embeddings. Every family refuses a scaling its config builder does
    not convert (``hf_config_to_tl``)."""
    found: list[dict[str, Any]] = []
    for attr in ("rope_parameters", "rope_scaling"):  # transformers 5, 4
        value = getattr(hf, attr, None)
        if isinstance(value, dict):  # per attention type (Gemma 3) or one for all
            nested = [v for v in value.values() if isinstance(v, dict)]
            found += nested or [value]
    kinds = {str(p.get("rope_type") or p.get("type") or "default") for p in found} - {"default"}
    return sorted(kinds)[0] if kinds else None


def _rope_parameters(hf: Any) -> dict[str, Any]:
    for attr in ("rope_parameters", "rope_scaling"):
        value = getattr(hf, attr, None)
        if isinstance(value, dict) and value.get("rope_type", value.get("type")) == "llama3":
            return value
    return {}


def _llama3_rope(hf: Any) -> dict[str, Any]:
    """TransformerLens's NTK-by-parts fields for Llama 3's rotary scaling (``{}`` without it)."""
    params = _rope_parameters(hf)
    if not params:
        return {}
    return dict(
        use_NTK_by_parts_rope=True,
        NTK_original_ctx_len=params.get(
            "original_max_position_embeddings", hf.max_position_embeddings
        ),
        NTK_by_parts_low_freq_factor=params.get("low_freq_factor", 1.0),
        NTK_by_parts_high_freq_factor=params.get("high_freq_factor", 4.0),
        NTK_by_parts_factor=params.get("factor", 1.0),
    )


def _rope_theta(hf: Any) -> float:
    theta = getattr(hf, "rope_theta", None)
    params = getattr(hf, "rope_parameters", None)
    if theta is None and isinstance(params, dict):
        theta = params.get("rope_theta")
    return float(theta if theta is not None else 10000.0)


@family("GPT2LMHeadModel", "convert_gpt2_weights")
def _gpt2(hf: Any) -> dict[str, Any]:
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


@family("GPTNeoXForCausalLM", "convert_neox_weights")
def _neox(hf: Any) -> dict[str, Any]:
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


@family("LlamaForCausalLM", "convert_llama_weights")
def _llama(hf: Any) -> dict[str, Any]:
    return _common(
        hf, eps=hf.rms_norm_eps, normalization_type="RMS", final_rms=True, gated_mlp=True,
        **_llama3_rope(hf),
    )  # fmt: skip


@family("MistralForCausalLM", "convert_mistral_weights")
def _mistral(hf: Any) -> dict[str, Any]:
    cfg = _common(hf, eps=hf.rms_norm_eps, normalization_type="RMS", final_rms=True, gated_mlp=True)
    cfg["n_key_value_heads"] = hf.num_key_value_heads
    if getattr(hf, "sliding_window", None):
        cfg.update(
            use_local_attn=True,
            window_size=hf.sliding_window,
            attn_types=["local"] * hf.num_hidden_layers,
        )
    return cfg


@family("Qwen2ForCausalLM", "convert_qwen2_weights")
def _qwen2(hf: Any) -> dict[str, Any]:
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


@family("Gemma2ForCausalLM", "convert_gemma_weights")
def _gemma2(hf: Any) -> dict[str, Any]:
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


@family("OlmoForCausalLM", "convert_olmo_weights")
def _olmo(hf: Any) -> dict[str, Any]:
    cfg = _common(hf, eps=1e-5, normalization_type="LN", gated_mlp=True)
    if getattr(hf, "clip_qkv", None):
        cfg["clip_qkv"] = hf.clip_qkv
    return cfg


def _qwen3_refuses(hf: Any) -> str | None:
    if getattr(hf, "attention_bias", False):
        return (
            "attention_bias=True: TransformerLens's Qwen3 conversion drops the attention biases. "
            "Load it with load_checkpoint(dir, backend='bridge')."
        )
    if getattr(hf, "use_sliding_window", False):
        return (
            "use_sliding_window=True: the HookedTransformer conversion attends globally. "
            "Load it with load_checkpoint(dir, backend='bridge')."
        )
    return None


@family("Qwen3ForCausalLM", "convert_qwen3_weights", refuses=_qwen3_refuses)
def _qwen3(hf: Any) -> dict[str, Any]:
    return _common(
        hf,
        eps=hf.rms_norm_eps,
        normalization_type="RMS",
        final_rms=True,
        gated_mlp=True,
        use_qk_norm=True,
        default_prepend_bos=False,
    )

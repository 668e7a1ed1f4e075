"""Where a ``peft`` adapter's Hugging Face modules land on TransformerLens parameters: one entry
per model family (``FAMILIES``, keyed by ``original_architecture``), and the module paths of
a family (what ``target_modules`` may name, what tells an adapter of another model).

>>> module_names(FAMILIES["GPT2LMHeadModel"], 1)[:2]
['transformer.h.0.attn.c_attn', 'transformer.h.0.attn.c_proj']
>>> other_family(["transformer.h.3.attn.c_attn"])
'GPT2LMHeadModel'
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from extractive_lens.backend.lowrank import Layout


@dataclass(frozen=True)
class Target:
    """Where (part of) a Hugging Face module's output lands: TransformerLens leaf ``leaf`` of
    the layer (``{kv}`` for a key/value weight: ``_W_K`` on grouped-query models), its
    ``layout``, and which of ``chunks`` equal slices of the output it is (a fused projection)."""

    leaf: str
    layout: Layout = "plain"
    bias: str | None = None  # the TransformerLens bias fed by the module's bias
    chunk: int = 0
    chunks: int = 1
    heads: str = "n_heads"  # which head count splits the head axis


@dataclass(frozen=True)
class Family:
    """How one architecture's Hugging Face modules map onto TransformerLens parameters."""

    layer: str  # a regex of a block's module path with the layer number as group 1
    modules: Mapping[str, tuple[Target, ...]]  # path inside a block -> targets
    outside: Mapping[str, tuple[Target, ...]]  # path outside the blocks -> targets
    embed: str  # the token embedding's module path
    embed_scale: bool = False  # W_E = weight · √d_model (Gemma)
    norm_offset: float = 0.0  # a norm's TransformerLens weight = 1 + weight (Gemma)
    conv1d: tuple[str, ...] = field(default=())  # modules stored [in, out] (GPT-2's Conv1D)


_Q = Target("attn.W_Q", "heads_out", "attn.b_Q")
_K = Target("attn.{kv}W_K", "heads_out", "attn.{kv}b_K", heads="n_kv")
_V = Target("attn.{kv}W_V", "heads_out", "attn.{kv}b_V", heads="n_kv")
_O = Target("attn.W_O", "heads_in", "attn.b_O")
_LLAMA = Family(
    layer=r"model\.layers\.(\d+)\.",
    modules={
        "self_attn.q_proj": (_Q,), "self_attn.k_proj": (_K,), "self_attn.v_proj": (_V,),
        "self_attn.o_proj": (_O,), "mlp.gate_proj": (Target("mlp.W_gate"),),
        "mlp.up_proj": (Target("mlp.W_in", bias="mlp.b_in"),),
        "mlp.down_proj": (Target("mlp.W_out", bias="mlp.b_out"),),
        "input_layernorm": (Target("ln1.w"),), "post_attention_layernorm": (Target("ln2.w"),),
    },
    outside={"model.embed_tokens": (Target("embed.W_E"),),
             "lm_head": (Target("unembed.W_U", bias="unembed.b_U"),),
             "model.norm": (Target("ln_final.w"),)},
    embed="model.embed_tokens",
)  # fmt: skip
_QWEN3 = Family(
    _LLAMA.layer,
    {**_LLAMA.modules, "self_attn.q_norm": (Target("attn.q_norm.w"),),
     "self_attn.k_norm": (Target("attn.k_norm.w"),)},
    _LLAMA.outside, _LLAMA.embed,
)  # fmt: skip
_GEMMA = Family(
    _LLAMA.layer, _LLAMA.modules, _LLAMA.outside, _LLAMA.embed, embed_scale=True, norm_offset=1.0
)
_GEMMA2 = Family(  # post_attention_layernorm is the attention's post-norm here (Gemma's ln2)
    _LLAMA.layer,
    {**_LLAMA.modules, "post_attention_layernorm": (Target("ln1_post.w"),),
     "pre_feedforward_layernorm": (Target("ln2.w"),),
     "post_feedforward_layernorm": (Target("ln2_post.w"),)},
    _LLAMA.outside, _LLAMA.embed, embed_scale=True, norm_offset=1.0,
)  # fmt: skip
_GPT2 = Family(
    layer=r"transformer\.h\.(\d+)\.",
    modules={
        "attn.c_attn": (Target("attn.W_Q", "heads_out", "attn.b_Q", 0, 3),
                        Target("attn.W_K", "heads_out", "attn.b_K", 1, 3),
                        Target("attn.W_V", "heads_out", "attn.b_V", 2, 3)),
        "attn.c_proj": (_O,), "mlp.c_fc": (Target("mlp.W_in", bias="mlp.b_in"),),
        "mlp.c_proj": (Target("mlp.W_out", bias="mlp.b_out"),),
        "ln_1": (Target("ln1.w", bias="ln1.b"),), "ln_2": (Target("ln2.w", bias="ln2.b"),),
    },
    outside={"transformer.wte": (Target("embed.W_E"),),
             "transformer.wpe": (Target("pos_embed.W_pos"),),
             "transformer.ln_f": (Target("ln_final.w", bias="ln_final.b"),),
             "lm_head": (Target("unembed.W_U", bias="unembed.b_U"),)},
    embed="transformer.wte",
    conv1d=("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"),
)  # fmt: skip
FAMILIES: dict[str, Family] = {
    "LlamaForCausalLM": _LLAMA, "MistralForCausalLM": _LLAMA, "Qwen2ForCausalLM": _LLAMA, "Qwen3ForCausalLM": _QWEN3,
    "GemmaForCausalLM": _GEMMA, "Gemma2ForCausalLM": _GEMMA2, "GPT2LMHeadModel": _GPT2,
}  # fmt: skip
"""Architectures (``original_architecture``) whose adapters ``from_peft`` reads."""


def module_names(family: Family, n_layers: int) -> list[str]:
    """Every Hugging Face module path ``family`` maps, in a model of ``n_layers`` layers."""
    block = family.layer.replace(r"(\d+)", "{}").replace("\\.", ".")
    inner = [block.format(i) + m for i in range(n_layers) for m in family.modules]
    return inner + list(family.outside)


def matches(targets: list[str] | str, names: list[str]) -> list[str]:
    """The ``names`` that ``peft`` would adapt for these ``target_modules``."""
    if isinstance(targets, str):
        return [n for n in names if re.fullmatch(targets, n)]
    return [n for n in names if any(n == t or n.endswith("." + t) for t in targets)]


def other_family(names: list[str] | str) -> str | None:
    """The architectures whose modules ``names`` (target names or module paths) are, if not the
    base's: for a sentence saying the adapter is for another model."""
    found = []
    for arch, fam in FAMILIES.items():
        modules = module_names(fam, 1)
        if isinstance(names, str):
            if matches(names, modules):
                found.append(arch)
        elif all(matches([n], modules) or matches([re.sub(r"\.\d+\.", ".0.", n)], modules)
                 for n in names):  # fmt: skip
            found.append(arch)
    return ", ".join(found) or None

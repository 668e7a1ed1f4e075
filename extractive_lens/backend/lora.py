"""LoRA adapters (the ``peft`` package's) as weight changes that stay low-rank.

>>> diff = WeightDiff.from_peft(base, "runs/lora-adapter")     # doctest: +SKIP
>>> diff = WeightDiff.from_peft(base, peft_model)              # doctest: +SKIP

Each adapted module's change ``scale · B @ A`` (``scale = lora_alpha / r``, or ``/ √r`` with
``use_rslora``; ``rank_pattern`` and ``alpha_pattern`` per module) is kept as its two factors on
the TransformerLens parameter it changes (``backend.lowrank.LowRank``): ``q_proj`` becomes
``W_Q`` with its output split into heads, ``k_proj`` / ``v_proj`` the grouped ``_W_K`` /
``_W_V`` of a grouped-query model, GPT-2's fused ``c_attn`` the three of ``W_Q W_K W_V``. Biases
trained with ``bias="lora_only"`` / ``"all"`` and the modules in ``modules_to_save`` are whole
new tensors: their change is dense. What the factors cannot say exactly (DoRA's magnitude
vector, LoRA biases, replicated layers, ...) is refused, naming the option.

One table entry per model family (``FAMILIES``): how the Hugging Face module names of that
family map onto TransformerLens parameters.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from extractive_lens import backend as B
from extractive_lens.backend.lowrank import Layout, LowRank, LowRankDeltas, to_layout
from extractive_lens.diff_sources import Parts, delta_dtype_for


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
    "GemmaForCausalLM": _GEMMA, "Gemma2ForCausalLM": _GEMMA, "GPT2LMHeadModel": _GPT2,
}  # fmt: skip
"""Architectures (``original_architecture``) whose adapters ``from_peft`` reads."""

_REFUSED = {  # LoraConfig fields whose non-default value a low-rank Δ cannot represent
    "use_dora": "DoRA rescales each weight column by a learned magnitude (not a low-rank change)",
    "lora_bias": "a bias on LoRA's B matrix",
    "layer_replication": "replicated layers (the adapted model has more layers than the base)",
    "target_parameters": "adapters on raw parameters (mixture-of-experts weights)",
    "trainable_token_indices": "trainable token embeddings",
    "use_qalora": "QALoRA's pooled inputs",
    "alora_invocation_tokens": "activated LoRA (the adapter switches on mid-sequence)",
    "use_bdlora": "block-diagonal LoRA",
    "arrow_config": "Arrow routing between adapters",
}
_PREFIX = "base_model.model."


def from_peft(base: Any, adapter: str | Path | Any, *, device: str | torch.device | None = None
              ) -> Parts:  # fmt: skip
    """The weight change of a LoRA adapter on ``base`` (see the module docstring), as the parts
    of a ``WeightDiff`` (``WeightDiff.from_peft``: a source, like those in ``diff_sources``).

    Args:
        base: the base model (``HookedTransformer`` or ``TransformerBridge``) the adapter was
            trained on, loaded without weight processing.
        adapter: a directory written by ``peft``'s ``save_pretrained`` (``adapter_config.json``
            and ``adapter_model.safetensors``), or a ``PeftModel`` in memory.
        device: where to keep the factors (default: the base model's device).
    """
    config, state, name = _read(adapter)
    _refuse(config)
    arch = B.signature(base).get("original_architecture")
    family = FAMILIES.get(str(arch))
    if family is None:
        raise NotImplementedError(
            f"from_peft maps adapters of {', '.join(sorted(FAMILIES))} onto TransformerLens "
            f"parameters; this base model is {arch!r}. Merge the adapter (peft's "
            "merge_and_unload), load the merged model and use WeightDiff.from_models."
        )
    params = B.parameters(base)
    dtype = delta_dtype_for(base.cfg.dtype)
    dev = torch.device(device) if device is not None else next(iter(params.values())).device
    reader = _Reader(base, family, params, dtype, dev)
    by_module: dict[str, dict[str, Tensor]] = {}
    for key, t in state.items():
        module, leaf = _split_key(key)
        by_module.setdefault(module, {})[leaf] = t
    ranks: dict[str, int] = {}
    for module, parts in sorted(by_module.items()):
        if "lora_A.weight" in parts or "lora_embedding_A" in parts:
            ranks[module] = reader.low_rank(module, parts, _scale(config, module, parts))
        extra = set(parts) - {"lora_A.weight", "lora_B.weight", "lora_embedding_A",
                              "lora_embedding_B"}  # fmt: skip
        for leaf in sorted(extra):  # biases, modules_to_save, saved base layers: whole tensors
            reader.whole(module, leaf.removeprefix("base_layer."), parts[leaf])
    meta = {
        "base": base.cfg.model_name,
        "adapter": name,
        "peft": {
            "rank": config.r, "lora_alpha": config.lora_alpha, "use_rslora": config.use_rslora,
            "target_modules": sorted(config.target_modules) if isinstance(
                config.target_modules, (set, list, tuple)) else config.target_modules,
            "ranks": sorted(set(ranks.values())), "bias": config.bias,
            "modules_to_save": list(config.modules_to_save or []),
            "rank_pattern": dict(config.rank_pattern or {}),
            "alpha_pattern": dict(config.alpha_pattern or {}),
            "layers_to_transform": config.layers_to_transform,
        },
    }  # fmt: skip
    deltas = LowRankDeltas(reader.factors, {n: d for n, d in reader.dense.items() if d.any()})
    return Parts(deltas, dict(B.signature(base)), meta)


def _read(adapter: Any) -> tuple[Any, dict[str, Tensor], str]:
    """The adapter's LoRA config, its saved tensors (keys as in ``adapter_model.safetensors``)
    and a name for reports."""
    try:
        import peft
    except ImportError:
        raise ImportError(
            'Reading a LoRA adapter needs the peft package: pip install "extractive-lens[lora]".'
        ) from None

    if isinstance(adapter, (str, Path)):
        path = Path(adapter)
        if not (path / "adapter_config.json").is_file():
            raise FileNotFoundError(
                f"{path} has no adapter_config.json: pass the directory peft's save_pretrained "
                "wrote (or a PeftModel)."
            )
        weights = path / "adapter_model.safetensors"
        if not weights.is_file():
            raise FileNotFoundError(
                f"{path} has no adapter_model.safetensors (extractive_lens reads no pickled "
                "adapter_model.bin): save the adapter with save_pretrained(dir, "
                "safe_serialization=True)."
            )
        from safetensors.torch import load_file

        config = peft.PeftConfig.from_pretrained(str(path))
        return config, load_file(str(weights)), path.name
    if isinstance(adapter, peft.PeftModel):
        name = adapter.active_adapter
        config = adapter.peft_config[name]
        state = peft.get_peft_model_state_dict(adapter, adapter_name=name)
        return config, {k: v.detach() for k, v in state.items()}, f"PeftModel[{name}]"
    raise TypeError(
        f"from_peft takes an adapter directory or a peft.PeftModel, got {type(adapter).__name__}."
    )


def _refuse(config: Any) -> None:
    kind = str(getattr(config, "peft_type", ""))
    if not kind.endswith("LORA"):
        raise NotImplementedError(
            f"from_peft reads LoRA adapters; this one is {kind or type(config).__name__}: merge "
            "it (merge_and_unload), then use WeightDiff.from_models."
        )
    for option, what in _REFUSED.items():
        if getattr(config, option, None):
            raise NotImplementedError(
                f"This adapter sets {option}={getattr(config, option)!r} ({what}), which a "
                "low-rank weight change cannot represent: merge it (merge_and_unload) and use "
                "WeightDiff.from_models."
            )


def _split_key(key: str) -> tuple[str, str]:
    """``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`` ->
    ``("model.layers.0.self_attn.q_proj", "lora_A.weight")``."""
    key = key.removeprefix(_PREFIX)
    for leaf in ("lora_A.weight", "lora_B.weight", "lora_embedding_A", "lora_embedding_B",
                 "base_layer.weight", "base_layer.bias"):  # fmt: skip
        if key.endswith("." + leaf):
            return key[: -len(leaf) - 1], leaf
    module, _, leaf = key.rpartition(".")
    return module, leaf


def _scale(config: Any, module: str, parts: Mapping[str, Tensor]) -> float:
    """``alpha / r`` (``alpha / √r`` with ``use_rslora``), with this module's rank and alpha."""
    from peft.utils.other import get_pattern_key

    a = parts.get("lora_A.weight", parts.get("lora_embedding_A"))
    assert a is not None
    r = int(a.shape[0])
    rank_pattern, alpha_pattern = config.rank_pattern or {}, config.alpha_pattern or {}
    want = rank_pattern.get(get_pattern_key(list(rank_pattern), module), config.r)
    if want != r:
        raise ValueError(
            f"{module}: the saved factors have rank {r} but the adapter's config says {want}: "
            "the adapter files do not belong together."
        )
    alpha = alpha_pattern.get(get_pattern_key(list(alpha_pattern), module), config.lora_alpha)
    return alpha / math.sqrt(r) if config.use_rslora else alpha / r


class _Reader:
    """Puts one module's factors or whole tensors onto TransformerLens names."""

    def __init__(self, model: Any, family: Family, params: Mapping[str, Tensor],
                 dtype: torch.dtype, device: torch.device) -> None:  # fmt: skip
        self.model, self.family, self.params = model, family, params
        self.dtype, self.device = dtype, device
        cfg = model.cfg
        self.heads = {"n_heads": cfg.n_heads, "n_kv": cfg.n_key_value_heads or cfg.n_heads}
        # W_E = weight · √d_model where the model stores converted weights (HookedTransformer);
        # a TransformerBridge's W_E is the Hugging Face weight itself (the scale is in its forward)
        self.converted = B.backend_for(model).NAME != "transformer_bridge"
        self.scaled = family.embed_scale and self.converted
        self.factors: dict[str, LowRank] = {}
        self.dense: dict[str, Tensor] = {}

    def _targets(self, module: str) -> tuple[str, str, tuple[Target, ...]]:
        """``(prefix, path in block, targets)`` of a Hugging Face module path."""
        fam = self.family
        m = re.match(fam.layer, module)
        if m is not None:
            inner = module[m.end() :]
            found = fam.modules.get(inner)
            prefix = f"blocks.{m.group(1)}."
        else:
            inner, found, prefix = module, fam.outside.get(module), ""
        if found is None:
            raise NotImplementedError(
                f"The adapter changes {module!r}, which from_peft cannot place on a "
                "TransformerLens parameter of this architecture: merge the adapter "
                "(merge_and_unload) and use WeightDiff.from_models."
            )
        return prefix, inner, found

    def _name(self, prefix: str, leaf: str) -> str:
        kv = "_" if f"{prefix}attn._W_K" in self.params else ""
        name = prefix + leaf.format(kv=kv)
        if name not in self.params:
            raise ValueError(
                f"The base model has no parameter {name!r} for this adapter: is it the model the "
                "adapter was trained on?"
            )
        return name

    def low_rank(self, module: str, parts: Mapping[str, Tensor], scale: float) -> int:
        """Add ``scale · B @ A`` of one module; returns its rank."""
        prefix, inner, targets = self._targets(module)
        if "lora_embedding_A" in parts:  # Δ = (B @ A)ᵀ: [vocab, d_model]
            left, right = parts["lora_embedding_A"].T, parts["lora_embedding_B"].T
        else:  # Linear and Conv1D alike: Δ (as x @ W) = Aᵀ Bᵀ, [in, out]
            left, right = parts["lora_A.weight"].T, parts["lora_B.weight"].T
        left = (left.to(device=self.device, dtype=self.dtype) * scale).contiguous()
        right = right_all = right.to(device=self.device, dtype=self.dtype).contiguous()
        if module == self.family.embed and self.scaled:
            right = right * math.sqrt(self.model.cfg.d_model)
        width = right.shape[1] // targets[0].chunks
        for t in targets:
            name = self._name(prefix, t.leaf)
            r_part = right if t.chunks == 1 else right[:, t.chunk * width : (t.chunk + 1) * width]
            r_part = r_part.contiguous()
            f = LowRank(left, r_part, t.layout, self.heads[t.heads])
            self._add_factor(name, f)
        if module == self.family.embed and self._tied():
            # tied embeddings: merging changes the unembedding too, by the transpose (the same
            # factors: the same bits) of the embedding's change before any scale
            unscaled = right_all if self.scaled else right
            self._add_factor("unembed.W_U", LowRank(left, unscaled, "transposed"))
        return int(left.shape[1])

    def _add_factor(self, name: str, f: LowRank) -> None:
        want = tuple(self.params[name].shape)
        if f.shape != want:
            raise ValueError(
                f"The adapter's change of {name} has shape {f.shape} but the base model's "
                f"parameter is {want}: is this the model the adapter was trained on?"
            )
        if name in self.factors:
            raise ValueError(f"Two adapted modules change {name}.")
        self.factors[name] = f

    def _tied(self) -> bool:
        """Whether the base's unembedding is its embedding (tied weights, as TransformerLens
        copies them): then merging an embedding adapter changes both."""
        W_E, W_U = self.params.get("embed.W_E"), self.params.get("unembed.W_U")
        if W_E is None or W_U is None or W_E.shape != W_U.T.shape:
            return False
        scale = self.model.cfg.d_model**0.5 if self.scaled else 1.0
        rtol = 1e-5 if W_E.dtype in (torch.float32, torch.float64) else 1e-2
        return torch.allclose(W_U.T.double() * scale, W_E.double(), rtol=rtol, atol=0)

    def whole(self, module: str, leaf: str, value: Tensor) -> None:
        """A whole new tensor (a trained bias, a module in ``modules_to_save``): Δ = it − W."""
        prefix, inner, targets = self._targets(module)
        conv = inner in self.family.conv1d
        v = value.to(device=self.device, dtype=self.dtype)
        if leaf == "weight":
            if v.ndim == 2:  # [out, in] for Linear, [in, out] for Conv1D, [vocab, d] Embedding
                if module == self.family.embed or module.endswith("wpe"):
                    m = v * (math.sqrt(self.model.cfg.d_model) if self.scaled else 1)
                else:
                    m = v if conv else v.T
                width = m.shape[1] // targets[0].chunks
                for t in targets:
                    part = m[:, t.chunk * width : (t.chunk + 1) * width]
                    new = to_layout(part, t.layout, self.heads[t.heads])
                    self._add_dense(self._name(prefix, t.leaf), new)
                return
            for t in targets:  # a norm's scale
                offset = self.family.norm_offset if self.converted else 0.0
                self._add_dense(self._name(prefix, t.leaf), v + offset)
            return
        if leaf != "bias":
            raise NotImplementedError(f"from_peft cannot read {module}.{leaf} of this adapter.")
        width = v.shape[0] // targets[0].chunks
        for t in targets:
            if t.bias is None:
                raise NotImplementedError(
                    f"The adapter trains a bias of {module}, which TransformerLens's "
                    f"{t.leaf} has none of: merge the adapter and use WeightDiff.from_models."
                )
            name = self._name(prefix, t.bias)
            part = v[t.chunk * width : (t.chunk + 1) * width]
            want = self.params[name].shape
            self._add_dense(name, part.reshape(want))

    def _add_dense(self, name: str, new: Tensor) -> None:
        base = self.params[name].detach()
        if tuple(new.shape) != tuple(base.shape):
            raise ValueError(
                f"The adapter's {name} has shape {tuple(new.shape)} but the base model's is "
                f"{tuple(base.shape)}: is this the model the adapter was trained on?"
            )
        self.dense[name] = new - base.to(device=new.device, dtype=self.dtype)

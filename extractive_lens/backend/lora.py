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

Adapters are accepted by what their configuration says they are (``lora_configs.py``: an
allow-list; PiSSA-like initialisations read with the adapter as initialised, ``initial=``); a
``PeftModel``'s own base weights are compared with the base's. One table entry per model family
(``lora_families.FAMILIES``): how the Hugging Face module names of that family map onto
TransformerLens parameters.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from extractive_lens import backend as B
from extractive_lens.backend.lora_configs import (
    check_config,
    check_initial,
    check_targets,
    init_kind,
)
from extractive_lens.backend.lora_families import (
    FAMILIES,
    Family,
    Target,
    module_names,
    other_family,
)
from extractive_lens.backend.lowrank import LowRank, LowRankDeltas, to_layout
from extractive_lens.diff_sources import Parts, delta_dtype_for

_PREFIX = "base_model.model."


def from_peft(base: Any, adapter: str | Path | Any, *, initial: str | Path | None = None,
              device: str | torch.device | None = None) -> Parts:  # fmt: skip
    """The weight change of a LoRA adapter on ``base`` (see the module docstring), as the parts
    of a ``WeightDiff`` (``WeightDiff.from_peft``: a source, like those in ``diff_sources``).

    Args:
        base: the base model (``HookedTransformer`` or ``TransformerBridge``) the adapter was
            trained on, loaded without weight processing.
        adapter: a directory written by ``peft``'s ``save_pretrained`` (``adapter_config.json``
            and ``adapter_model.safetensors``), or a ``PeftModel`` in memory.
        initial: for an adapter whose initialisation changes the base weights (PiSSA, OLoRA,
            CorDA, LoRA-GA: ``lora_configs.py``), the directory it was saved to right after
            ``get_peft_model``, before training; the change is then
            ``scale · (B @ A - B₀ @ A₀)``, what ``peft``'s own conversion computes.
        device: where to keep the factors (default: the base model's device).
    """
    config, state, name = _read(adapter)
    check_config(config, initial=initial is not None)
    start = None
    if initial is not None:
        first, start_state, _ = _read(initial)
        check_initial(config, first)
        start = _by_module(start_state)
    arch = str(B.signature(base).get("original_architecture"))
    family = FAMILIES.get(arch)
    if family is None:
        raise NotImplementedError(
            f"from_peft maps adapters of {', '.join(sorted(FAMILIES))} onto TransformerLens "
            f"parameters; this base model is {arch!r}. Merge the adapter (peft's "
            "merge_and_unload), load the merged model and use WeightDiff.from_models."
        )
    check_targets(config, family, arch, base.cfg.n_layers)
    params = B.parameters(base)
    dtype = delta_dtype_for(base.cfg.dtype)
    dev = torch.device(device) if device is not None else next(iter(params.values())).device
    reader = _Reader(base, family, params, dtype, dev, arch)
    by_module = _by_module(state)
    if not isinstance(adapter, (str, Path)):
        _check_base_weights(adapter, config, reader, start)
    ranks: dict[str, int] = {}
    for module, parts in sorted(by_module.items()):
        if _FACTORS & set(parts):
            scale = _scale(config, module, parts)
            if start is not None:
                parts = _less_initial(module, parts, start.get(module, {}))
            ranks[module] = reader.low_rank(module, parts, scale)
        for leaf in sorted(set(parts) - _FACTORS):  # biases, modules_to_save, base layers: whole
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
            "init_lora_weights": config.init_lora_weights,
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
        config, state = _read_folder(peft, Path(adapter))
        return config, state, Path(adapter).name
    if isinstance(adapter, peft.PeftModel):
        name = adapter.active_adapter
        config = adapter.peft_config[name]
        state = peft.get_peft_model_state_dict(adapter, adapter_name=name)
        return config, {k: v.detach() for k, v in state.items()}, f"PeftModel[{name}]"
    raise TypeError(
        f"from_peft takes an adapter directory or a peft.PeftModel, got {type(adapter).__name__}."
    )


FIX = (
    "save the adapter again with peft's save_pretrained(dir) (safe_serialization=True, the "
    "default), or pass the PeftModel itself."
)


def _read_folder(peft: Any, path: Path) -> tuple[Any, dict[str, Tensor]]:
    """The config and tensors of an adapter folder, read through the file layer
    (``extractive_lens.files``): regular files only, tensors copied out, each failure naming
    the file."""
    from extractive_lens.files import SafetensorsFile, read_json, refuse_special_files

    if not path.is_dir():
        raise FileNotFoundError(
            f"{path} is not a folder: pass the directory peft's save_pretrained wrote (or a "
            "PeftModel)."
        )
    refuse_special_files(path, FIX)
    if not os.path.lexists(path / "adapter_config.json"):
        raise FileNotFoundError(
            f"{path} has no adapter_config.json: pass the directory peft's save_pretrained "
            "wrote (or a PeftModel)."
        )
    if not os.path.lexists(path / "adapter_model.safetensors"):
        raise FileNotFoundError(
            f"{path} has no adapter_model.safetensors (extractive_lens reads no pickled "
            "adapter_model.bin): save the adapter with save_pretrained(dir, "
            "safe_serialization=True)."
        )
    data = read_json(path / "adapter_config.json", fix=FIX)
    if not isinstance(data, dict) or not isinstance(data.get("peft_type"), str):
        raise ValueError(
            f"{path / 'adapter_config.json'} is not a peft adapter config (no peft_type): {FIX}"
        )
    with SafetensorsFile(path / "adapter_model.safetensors", fix=FIX) as f:
        state = f.tensors()
    try:
        config = peft.PeftConfig.from_pretrained(str(path))
    except (TypeError, ValueError, KeyError, AttributeError) as e:
        raise ValueError(
            f"{path / 'adapter_config.json'} is not a config peft can read ({type(e).__name__}: "
            f"{e}): {FIX}"
        ) from None
    for key, t in state.items():
        factor = key.endswith(
            ("lora_A.weight", "lora_B.weight", "lora_embedding_A", "lora_embedding_B")
        )
        if factor and (t.ndim != 2 or 0 in t.shape or not t.is_floating_point()):
            raise ValueError(
                f"{path / 'adapter_model.safetensors'} holds {key} of shape {list(t.shape)} and "
                f"dtype {t.dtype}, not a floating-point matrix of rank at least 1: {FIX}"
            )
    return config, state


_FACTORS = frozenset({"lora_A.weight", "lora_B.weight", "lora_embedding_A", "lora_embedding_B"})
_PAIRS = (("lora_A.weight", "lora_B.weight"), ("lora_embedding_A", "lora_embedding_B"))


def _by_module(state: Mapping[str, Tensor]) -> dict[str, dict[str, Tensor]]:
    """The saved tensors grouped by module; a module with one factor of a pair is refused."""
    by_module: dict[str, dict[str, Tensor]] = {}
    for key, t in state.items():
        module, leaf = _split_key(key)
        by_module.setdefault(module, {})[leaf] = t
    for module, parts in by_module.items():
        for pair in _PAIRS:
            have = [p for p in pair if p in parts]
            if len(have) == 1:
                missing = pair[1 - pair.index(have[0])]
                raise ValueError(
                    f"The adapter's {module} has {have[0]} but no {missing}: the adapter file is "
                    "incomplete; save the adapter again (save_pretrained)."
                )
    return by_module


def _less_initial(module: str, parts: Mapping[str, Tensor], start: Mapping[str, Tensor]
                  ) -> dict[str, Tensor]:  # fmt: skip
    """The factors of ``B @ A - B₀ @ A₀``: ``[A; A₀]`` and ``[B, -B₀]`` (``peft``'s
    ``subtract_mutated_init``), so one scale multiplies both."""
    out = dict(parts)
    for a, b in _PAIRS:
        if a not in parts:
            continue
        if a not in start or start[a].shape != parts[a].shape or start[b].shape != parts[b].shape:
            raise ValueError(
                f"initial=: the initial adapter has no factors of {module} of the trained "
                "adapter's shapes: pass the adapter this one was trained from."
            )
        cat = 0 if a == "lora_A.weight" else 1  # lora_A: [r, in]; lora_embedding_A: [r, vocab]
        out[a] = torch.cat([parts[a], start[a].to(parts[a])], dim=cat)
        out[b] = torch.cat([parts[b], -start[b].to(parts[b])], dim=1)
    return out


def _check_base_weights(peft_model: Any, config: Any, reader: _Reader,
                        start: Mapping[str, Mapping[str, Tensor]] | None) -> None:  # fmt: skip
    """A ``PeftModel``'s own base weights must be ``base``'s (with ``initial``: plus the initial
    adapter ``scale · B₀ @ A₀`` its initialisation took out of them): an adapter on another
    base, on a processed one, or merged into its base is another change. One module at a time."""
    inner = peft_model.base_model.model
    for module in module_names(reader.family, reader.model.cfg.n_layers):
        try:
            m = inner.get_submodule(module)
        except AttributeError:
            continue
        m = getattr(m, "original_module", m)  # modules_to_save keep the base's copy
        m = m.get_base_layer() if hasattr(m, "get_base_layer") else m
        for leaf in ("weight", "bias") if config.bias == "none" else ("weight",):  # trained
            value = getattr(m, leaf, None)
            if not isinstance(value, Tensor):
                continue
            value = value.detach().to(torch.float64)
            if start is not None and leaf == "weight" and start.get(module):
                value = value + _initial_product(config, module, start[module], reader, m)
            try:
                pairs = reader.mapped(module, leaf, value)
            except ValueError:  # a weight this backend does not name (a bridge's post-norms)
                continue
            for name, mapped in pairs:
                want = reader.params[name].detach()
                tol = 8 * max(torch.finfo(want.dtype).eps, torch.finfo(m.weight.dtype).eps,
                              torch.finfo(torch.float32).eps)  # fmt: skip
                scale = float(want.double().abs().max())
                err = float((mapped.to(want.device).double() - want.double()).abs().max())
                if err > tol * max(scale, 1e-30):
                    raise ValueError(
                        f"The PeftModel's base weights are not this base model's: {module}."
                        f"{leaf} differs from {name} by {err:.3g} (of {scale:.3g}). Pass the "
                        "base it was built on, loaded unprocessed, and an unmerged adapter"
                        + (" (its initialisation changed the base weights: pass initial=)"
                           if init_kind(config) == "convertible" and start is None else "")
                        + "."
                    )  # fmt: skip


def _initial_product(config: Any, module: str, start: Mapping[str, Tensor], reader: _Reader,
                     layer: Any) -> Tensor:  # fmt: skip
    """``scale · B₀ @ A₀`` as the module stores its weight (``[out, in]``; ``[in, out]`` for
    GPT-2's Conv1D; ``[vocab, d]`` for an embedding)."""
    if "lora_embedding_A" in start:
        prod = (start["lora_embedding_B"].double() @ start["lora_embedding_A"].double()).T
    else:
        prod = start["lora_B.weight"].double() @ start["lora_A.weight"].double()
        if tuple(prod.shape) != tuple(layer.weight.shape):
            prod = prod.T
    return _scale(config, module, start) * prod.to(layer.weight.device)


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
                 dtype: torch.dtype, device: torch.device, arch: str) -> None:  # fmt: skip
        self.model, self.family, self.params, self.arch = model, family, params, arch
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
            other = other_family([module])
            if other is not None and self.arch not in other.split(", "):
                raise ValueError(
                    f"The adapter changes {module!r}, a module of {other} models, not of this "
                    f"{self.arch} base: the adapter is for another model; pass the base it was "
                    "trained on."
                )
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
        if left.ndim != 2 or right.ndim != 2 or left.shape[1] != right.shape[0]:
            raise ValueError(
                f"{module}: the adapter's two factors have shapes {list(left.T.shape)} and "
                f"{list(right.T.shape)}, which do not multiply: the adapter is damaged; {FIX}"
            )
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
        for name, new in self.mapped(module, leaf, value.to(device=self.device, dtype=self.dtype)):
            self._add_dense(name, new)

    def mapped(self, module: str, leaf: str, v: Tensor) -> list[tuple[str, Tensor]]:
        """A Hugging Face module's whole ``weight`` or ``bias`` as the TransformerLens
        parameters it becomes."""
        prefix, inner, targets = self._targets(module)
        conv = inner in self.family.conv1d
        if leaf == "weight":
            if v.ndim == 2:  # [out, in] for Linear, [in, out] for Conv1D, [vocab, d] Embedding
                if module == self.family.embed or module.endswith("wpe"):
                    m = v * (math.sqrt(self.model.cfg.d_model) if self.scaled else 1)
                else:
                    m = v if conv else v.T
                width = m.shape[1] // targets[0].chunks
                return [(self._name(prefix, t.leaf),
                         to_layout(m[:, t.chunk * width : (t.chunk + 1) * width], t.layout,
                                   self.heads[t.heads])) for t in targets]  # fmt: skip
            offset = self.family.norm_offset if self.converted else 0.0  # a norm's scale
            return [(self._name(prefix, t.leaf), v + offset) for t in targets]
        if leaf != "bias":
            raise NotImplementedError(f"from_peft cannot read {module}.{leaf} of this adapter.")
        width = v.shape[0] // targets[0].chunks
        out = []
        for t in targets:
            if t.bias is None:
                raise NotImplementedError(
                    f"The adapter trains a bias of {module}, which TransformerLens's "
                    f"{t.leaf} has none of: merge the adapter and use WeightDiff.from_models."
                )
            name = self._name(prefix, t.bias)
            part = v[t.chunk * width : (t.chunk + 1) * width]
            out.append((name, part.reshape(self.params[name].shape)))
        return out

    def _add_dense(self, name: str, new: Tensor) -> None:
        base = self.params[name].detach()
        if tuple(new.shape) != tuple(base.shape):
            raise ValueError(
                f"The adapter's {name} has shape {tuple(new.shape)} but the base model's is "
                f"{tuple(base.shape)}: is this the model the adapter was trained on?"
            )
        self.dense[name] = new - base.to(device=new.device, dtype=self.dtype)

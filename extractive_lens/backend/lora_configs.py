"""Which ``peft`` LoRA configurations ``from_peft`` reads: accepted by what they are.

>>> check_config(peft.LoraConfig(r=8, target_modules=["q_proj"]))          # doctest: +SKIP
>>> check_config(peft.LoraConfig(r=8, target_modules=["q_proj"], use_dora=True))  # doctest: +SKIP
Traceback (most recent call last):
NotImplementedError: This adapter sets use_dora=True (DoRA rescales ...

An adapter is read as ``W + scale · B @ A`` on the base's own weights ``W``. That holds only where
the adapter leaves the base weights as they were and adds nothing but that product, so every field
of the ``LoraConfig`` is looked at, against an allow-list:

- ``READ``: fields whose value ``from_peft`` reads (rank, alpha, rsLoRA, the patterns, biases,
  ``modules_to_save``, which modules and layers, ``fan_in_fan_out``).
- ``INERT``: fields that change neither ``W`` nor the adapted forward (dropout, the bookkeeping,
  the settings of an initialisation that is itself checked).
- ``init_lora_weights``: ``UNTOUCHED`` initialisations leave ``W`` as it was. ``CONVERTIBLE``
  ones (PiSSA, OLoRA, CorDA, LoRA-GA) move the top of ``W`` into the adapter: the model is
  ``W_res + scale · B @ A`` with ``W_res = W - scale · B₀ @ A₀``, so the change from ``W`` is
  ``scale · (B @ A - B₀ @ A₀)``, exactly what ``peft`` converts such an adapter into
  (``save_pretrained(..., path_initial_model_for_weight_conversion=...)``); ``from_peft`` needs
  the adapter as initialised (``initial=``) for it. LoftQ replaces ``W`` by a quantised copy:
  refused.
- any other field, set to anything but its default: refused, naming it (what ``REFUSED`` says
  about the ones known; a field a newer ``peft`` adds is refused until it is looked at).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from extractive_lens.backend.lora_families import Family, matches, module_names, other_family

READ = frozenset({
    "r", "lora_alpha", "use_rslora", "rank_pattern", "alpha_pattern", "bias", "modules_to_save",
    "target_modules", "exclude_modules", "layers_to_transform", "layers_pattern",
    "fan_in_fan_out", "init_lora_weights",
})  # fmt: skip
INERT = frozenset({
    "task_type", "peft_type", "auto_mapping", "peft_version", "base_model_name_or_path",
    "revision", "inference_mode", "lora_dropout", "runtime_config", "megatron_core",
    "qalora_group_size",  # read only with use_qalora, which is refused
    "eva_config", "corda_config", "lora_ga_config", "loftq_config",  # of init_lora_weights
})  # fmt: skip
UNTOUCHED = (True, False, "gaussian", "eva", "orthogonal", "mica")
"""Initialisations that set only the adapter's factors (B = 0 for most; ``False``, ``orthogonal``
start with B ≠ 0, which the trained factors include)."""
CONVERTIBLE = ("pissa", "olora", "corda", "lora_ga")
"""Initialisations (prefixes: ``pissa_niter_4``) that subtract ``scale · B₀ @ A₀`` from ``W``."""
REFUSED = {  # what a low-rank Δ on the base's weights cannot represent
    "use_dora": "DoRA rescales each weight column by a learned magnitude (not a low-rank change)",
    "lora_bias": "a bias on LoRA's B matrix",
    "layer_replication": "replicated layers (the adapted model has more layers than the base)",
    "target_parameters": "adapters on raw parameters (mixture-of-experts weights)",
    "trainable_token_indices": "trainable token embeddings",
    "use_qalora": "QALoRA's pooled inputs",
    "alora_invocation_tokens": "activated LoRA (the adapter switches on mid-sequence)",
    "use_bdlora": "block-diagonal LoRA",
    "arrow_config": "Arrow routing between adapters",
    "velora_config": "VeLoRA's compressed activations",
    "monteclora_config": "MonteCLoRA's sampled adapters",
    "kasa_config": "KaSA's truncated base weights",
    "megatron_config": "Megatron's parallel layers",
    "ensure_weight_tying": "adapters tied across the embedding and the unembedding",
}
_MERGE = "merge it (merge_and_unload) and use WeightDiff.from_models"


def init_kind(config: Any) -> str:
    """``"untouched"``, ``"convertible"`` or ``"refused"``: what ``init_lora_weights`` did to
    the base weights."""
    init = getattr(config, "init_lora_weights", True)
    if isinstance(init, bool) or init in UNTOUCHED:
        return "untouched"
    if isinstance(init, str) and init.lower().startswith(CONVERTIBLE):
        return "convertible"
    return "refused"


def check_config(config: Any, *, initial: bool = False) -> None:
    """Refuse a configuration ``from_peft`` would read as something else (module docstring),
    naming the field. ``initial``: the adapter as initialised is given (``from_peft(initial=)``)."""
    kind = getattr(getattr(config, "peft_type", None), "value", getattr(config, "peft_type", ""))
    if kind != "LORA":
        raise NotImplementedError(
            f"from_peft reads LoRA adapters; this one is {kind or type(config).__name__}: {_MERGE}."
        )
    defaults = type(config)()
    for f in dataclasses.fields(config):
        if f.name in READ or f.name in INERT:
            continue
        value = getattr(config, f.name)
        if value == getattr(defaults, f.name, None) or value in (None, False, {}, [], ()):
            continue
        what = REFUSED.get(f.name, "a setting from_peft does not know how to read")
        raise NotImplementedError(
            f"This adapter sets {f.name}={value!r} ({what}), which a low-rank weight change "
            f"on the base's weights cannot represent: {_MERGE}."
        )
    init = getattr(config, "init_lora_weights", True)
    kind = init_kind(config)
    if kind == "refused":
        raise NotImplementedError(
            f"This adapter sets init_lora_weights={init!r}, which changes the base model's "
            "weights (LoftQ: a quantised copy), so the adapter is not a change of the base: "
            f"{_MERGE} on the same base."
        )
    if kind == "convertible" and not initial:
        raise NotImplementedError(
            f"This adapter sets init_lora_weights={init!r}: that initialisation subtracts the "
            "adapter's first factors from the base weights, so B @ A is not the change from the "
            "base. Pass the adapter as initialised, before training: WeightDiff.from_peft(base, "
            "adapter, initial=dir) (the directory saved right after get_peft_model), or save "
            "it converted: save_pretrained(out, path_initial_model_for_weight_conversion=dir)."
        )
    if kind == "untouched" and initial:
        raise ValueError(
            f"initial= is for adapters whose initialisation changes the base weights (PiSSA, "
            f"OLoRA, CorDA, LoRA-GA); this one sets init_lora_weights={init!r}, so its factors "
            "are the change already: leave initial= out."
        )


def check_initial(config: Any, initial: Any) -> None:
    """The initial adapter must be the trained one's start: the same settings."""
    for name in ("r", "lora_alpha", "use_rslora", "rank_pattern", "alpha_pattern",
                 "fan_in_fan_out"):  # fmt: skip
        a, b = getattr(config, name, None), getattr(initial, name, None)
        if a != b:
            raise ValueError(
                f"initial=: the initial adapter has {name}={b!r} but the trained one has "
                f"{name}={a!r}: pass the adapter this one was trained from."
            )


def target_names(config: Any) -> list[str] | str | None:
    """``target_modules`` as ``peft`` matches them: a list of module-name suffixes, a regular
    expression (``str``), or ``None`` for "all-linear" and adapters without the field."""
    targets = getattr(config, "target_modules", None)
    if targets is None or targets == "all-linear":
        return None
    if isinstance(targets, str):
        return targets
    return sorted(targets)


def check_targets(config: Any, family: Family, arch: str, n_layers: int) -> None:
    """Every ``target_modules`` entry names modules of the base (as ``peft`` refuses one that
    matches nothing): an adapter naming others is for another model."""
    targets = target_names(config)
    if targets is None:
        return
    names = module_names(family, n_layers)
    missing = [t for t in targets if not matches([t], names)] if isinstance(targets, list) else (
        [] if matches(targets, names) else [targets])  # fmt: skip
    if not missing:
        return
    other = other_family(targets if isinstance(targets, str) else missing)
    raise ValueError(
        f"The adapter's target_modules name {', '.join(map(repr, missing))}, which this "
        f"{arch} base has no module of"
        + (f": the adapter is for another model ({other} has them)" if other else "")
        + f"; pass the base the adapter was trained on (its adapter_config.json says "
        f"base_model_name_or_path={getattr(config, 'base_model_name_or_path', None)!r})."
    )

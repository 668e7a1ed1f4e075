"""The model backend: the only package that knows TransformerLens.

Scoring, ``WeightDiff``, finetuning, experiments, plots and the world model ask this package
about a model; none of them spells a TransformerLens class, parameter or hook name. A backend is
one module (``hooked.py`` for ``HookedTransformer``) with the functions listed in ``Backend``;
``backend_for(model)`` picks it, and the functions below dispatch to it::

    from extractive_lens import backend as B
    x = B.embed(model, tokens)
    out, cap = B.attention(model, 3, x, capture=("z",))
    x = B.run_blocks(model, x, start=(3, "post"))

Adding a backend (e.g. TransformerLens 4's ``TransformerBridge``) is one new module and one
entry in ``BACKENDS`` (see CONTRIBUTING.md).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager
from types import ModuleType
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from extractive_lens.backend import bridge, compute, hooked, vocab
from extractive_lens.backend.blocks import LayerRun, run_blocks
from extractive_lens.backend.compute import (
    computing_in,
    frozen_parameters,
    resolve_compute_dtype,
)
from extractive_lens.backend.hook_locks import lock_hook_contexts
from extractive_lens.backend.lowrank import LowRank
from extractive_lens.backend.names import (
    ParamRole,
    ParamSlice,
    attn_out_names,
    expected_shape,
    hook_name,
    layer_of,
    param_role,
    slices_for_names,
)
from extractive_lens.backend.shift import W_O_shift, reusing, shifted, unshifted

__all__ = [
    "BACKENDS", "Backend", "LayerRun", "ParamRole", "ParamSlice", "ScorableModel", "W_O",
    "attention", "attn_out_names", "backend_for", "check_scorable", "check_unprocessed",
    "computing_in", "describe", "embed", "expected_shape", "frozen_parameters", "has_mlp",
    "hook_name", "jvp", "jvp_raw", "kv_prefix", "layer_of", "mlp",
    "notes", "on_block", "on_final", "parallel", "param_role", "parameter_slices", "parameters",
    "raw_masks", "resolve_compute_dtype", "reusing", "run_blocks", "shifted", "signature",
    "function_config", "config_differences",
    "unshifted", "slices_for_names", "standard_flags",
    "tl_view", "unembed", "weights_processed", "write_parameters",
]  # fmt: skip


class ScorableModel(Protocol):
    """What the package needs of a model object: a TransformerLens-style ``cfg`` (``n_layers``,
    ``n_heads``, ``d_model``, ``dtype``, ``device`` ...), a tokenizer (or ``None``) and the
    ``nn.Module`` parameter API. ``HookedTransformer`` is one."""

    cfg: Any
    tokenizer: Any
    training: bool

    def named_parameters(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, nn.Parameter]]: ...
    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]: ...
    def named_buffers(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, Tensor]]: ...
    def train(self, mode: bool = True) -> Any: ...
    def eval(self) -> Any: ...
    def __call__(self, *args: Any, **kwargs: Any) -> Any: ...


class Backend(Protocol):
    """The functions a backend module provides (``hooked.py`` is the reference)."""

    NAME: str

    def handles(self, model: Any) -> bool: ...
    def embed(self, model: Any, tokens: Tensor) -> Tensor: ...
    def attention(
        self, model: Any, layer: int, resid_pre: Tensor, capture: tuple[str, ...] = ...,
        past_kv: tuple[Tensor, Tensor] | None = ...,
    ) -> tuple[Tensor, dict[str, Tensor]]: ...  # fmt: skip
    def mlp(self, model: Any, layer: int, mlp_in: Tensor) -> Tensor: ...
    def unembed(self, model: Any, resid: Tensor) -> Tensor: ...
    def on_block(self, model: Any, layer: int, x: Tensor) -> Tensor: ...
    def on_final(self, model: Any, x: Tensor) -> Tensor: ...
    def W_O(self, model: Any, layer: int) -> Tensor: ...
    def has_mlp(self, model: Any) -> bool: ...
    def parallel(self, model: Any) -> bool: ...
    def parameters(self, model: Any) -> dict[str, Tensor]: ...
    def parameter_slices(self, model: Any) -> list[ParamSlice]: ...
    def signature(self, model: Any) -> dict[str, Any]: ...
    def function_config(self, model: Any) -> dict[str, Any]: ...
    def describe(self, model: Any) -> dict[str, Any]: ...
    def check_scorable(self, model: Any) -> None: ...
    def standard_flags(self, model: Any) -> AbstractContextManager[None]: ...
    def ungrouped_kv(self, model: Any) -> AbstractContextManager[None]: ...
    def notes(self, model: Any) -> dict[str, Any]: ...
    def weights_processed(self, model: Any) -> bool: ...
    def write_parameters(self, model: Any, values: dict[str, Tensor]) -> None: ...
    def raw_tangents(
        self, model: Any, tangents: dict[str, Tensor], dtype: torch.dtype
    ) -> dict[str, Tensor]: ...
    def raw_low_rank(self, model: Any, name: str, f: LowRank) -> tuple[str, LowRank] | None: ...
    def check_shared(self, model: Any, deltas: Mapping[str, Any]) -> None: ...
    def kv_prefix(self, model: Any) -> bool: ...
    def raw_masks(
        self, model: Any, masks: dict[str, Tensor | None]
    ) -> dict[str, Tensor | None]: ...
    def tl_view(self, model: Any, raw: dict[str, Tensor]) -> dict[str, Tensor]: ...


BACKENDS: list[ModuleType] = [hooked, bridge]
"""The backends, tried in order by ``backend_for``."""

_BY_TYPE: dict[type, ModuleType] = {}


def backend_for(model: Any) -> ModuleType:
    """The backend module for ``model`` (a clear error for objects no backend handles)."""
    cls = type(model)
    found = _BY_TYPE.get(cls)
    if found is None:
        found = next((b for b in BACKENDS if b.handles(model)), None)
        if found is None:
            raise TypeError(
                f"extractive_lens cannot score a {cls.__name__}: pass a TransformerLens "
                "HookedTransformer or TransformerBridge (load_pretrained(name), "
                "load_checkpoint(dir), tiny_model(); backend='bridge' for a bridge)."
            )
        lock_hook_contexts(cls)  # its run_with_cache, run_with_hooks, hooks take the model's lock
        _BY_TYPE[cls] = found
    return found


def is_model(model: Any) -> bool:
    """Whether some backend handles ``model``."""
    return any(b.handles(model) for b in BACKENDS)


# One-line dispatchers: the calls the rest of the package makes.
def embed(model: Any, tokens: Tensor) -> Tensor:
    """The residual stream entering layer 0 (token embedding plus absolute positions)."""
    return backend_for(model).embed(model, tokens)


def attention(
    model: Any, layer: int, resid_pre: Tensor, capture: tuple[str, ...] = ("z",),
    past_kv: tuple[Tensor, Tensor] | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:  # fmt: skip
    """A layer's attention output and the hook values named in ``capture``."""
    return backend_for(model).attention(model, layer, resid_pre, capture, past_kv)


def mlp(model: Any, layer: int, mlp_in: Tensor) -> Tensor:
    """A layer's MLP (with its norm) on its input stream."""
    return backend_for(model).mlp(model, layer, mlp_in)


def unembed(model: Any, resid: Tensor) -> Tensor:
    """Final norm, unembedding and logit soft-capping."""
    return backend_for(model).unembed(model, resid)


def on_block(model: Any, layer: int, x: Tensor) -> Tensor:
    return backend_for(model).on_block(model, layer, x)


def on_final(model: Any, x: Tensor) -> Tensor:
    return backend_for(model).on_final(model, x)


def W_O(model: Any, layer: int) -> Tensor:
    """``[head, d_head, d_model]``: the heads' output weights of a layer (``W_O + α·ΔW_O``
    inside ``shifted(model, diff, alpha)``)."""
    w = backend_for(model).W_O(model, layer)
    d = W_O_shift(model, layer)
    if d is None:
        return w
    dt = torch.promote_types(w.dtype, d.dtype)
    if isinstance(d, LowRank):
        return d.to(w.device).added_to(w, 1.0, dt)
    return w.detach().to(dt) + d.to(device=w.device, dtype=dt)


def has_mlp(model: Any) -> bool:
    return backend_for(model).has_mlp(model)


def parallel(model: Any) -> bool:
    return backend_for(model).parallel(model)


def parameters(model: Any) -> dict[str, Tensor]:
    """The parameters by TransformerLens name (the keys of a ``WeightDiff``)."""
    return backend_for(model).parameters(model)


def write_parameters(model: Any, values: dict[str, Tensor]) -> None:
    """Set parameters (TransformerLens names) to ``values`` in the model's stored weights."""
    backend_for(model).write_parameters(model, values)


def check_shared(model: Any, deltas: Mapping[str, Any]) -> None:
    """Refuse Δ that the model's stored weights cannot hold: different changes for names that
    share one stored tensor (a TransformerBridge of tied GPT-2: ``W_E`` and ``W_U``). Checked
    once per call, before scoring: a large model's pieces read those names apart (a vocabulary
    matrix a part at a time, the embedding and the unembedding in two passes) and never met."""
    backend_for(model).check_shared(model, deltas)


def jvp(model: Any, fn: Any, args: tuple[Any, ...], tangents: dict[str, Tensor]) -> tuple[Any, Any]:
    """Forward-mode derivative of ``fn(model, *args)`` along ``tangents`` (TransformerLens
    parameter names; see ``compute.jvp``)."""
    dtype = compute.compute_dtype() or model.cfg.dtype
    raw = backend_for(model).raw_tangents(model, tangents, dtype)
    return compute.jvp(model, fn, args, raw, deferred=lambda p: vocab.by_part(model, p))


def jvp_raw(
    model: Any, fn: Any, args: tuple[Any, ...], tangents: dict[str, Any]
) -> tuple[Any, Any]:
    """``jvp`` along ``tangents`` already in the model's own parameter names (as
    ``shift.tangents`` gives them: a vocabulary matrix's may be a function reading a part)."""
    return compute.jvp(model, fn, args, tangents, deferred=lambda p: vocab.by_part(model, p))


def raw_masks(model: Any, masks: dict[str, Tensor | None]) -> dict[str, Tensor | None]:
    """Masks over TransformerLens names (``None`` or along the first dimension) as masks over
    the model's own ``named_parameters()`` (what an optimiser trains)."""
    return backend_for(model).raw_masks(model, masks)


def tl_view(model: Any, raw: dict[str, Tensor]) -> dict[str, Tensor]:
    """The parameters by TransformerLens name that stored weights ``raw`` (keyed as
    ``named_parameters()``) amount to."""
    return backend_for(model).tl_view(model, raw)


def kv_prefix(model: Any) -> bool:
    """Whether ``attention(..., past_kv=...)`` works (else run whole sequences)."""
    return backend_for(model).kv_prefix(model)


def parameter_slices(model: Any) -> list[ParamSlice]:
    """Which components own which parameter elements (docs/scores.md §2)."""
    return backend_for(model).parameter_slices(model)


def signature(model: Any) -> dict[str, Any]:
    """The configuration a base and a finetuned model must share."""
    return backend_for(model).signature(model)


def function_config(model: Any) -> dict[str, Any]:
    """Every configuration field that, besides the weights, decides the function the model
    computes (rotary base, norm eps, soft caps, ...): a base and a finetuned model agree on all."""
    return backend_for(model).function_config(model)


def config_differences(base: Mapping[str, Any], finetuned: Mapping[str, Any]) -> str:
    """``"field: base=… finetuned=…, …"`` for the fields both configs have and disagree on
    (``""`` if none)."""
    return ", ".join(
        f"{k}: base={base[k]!r} finetuned={finetuned[k]!r}"
        for k in sorted(set(base) & set(finetuned))
        if base[k] != finetuned[k]
    )


def describe(model: Any) -> dict[str, Any]:
    """What a result records about the model (name, architecture, dtype, versions)."""
    return backend_for(model).describe(model)


def check_scorable(model: Any) -> None:
    backend_for(model).check_scorable(model)


def standard_flags(model: Any) -> AbstractContextManager[None]:
    """Scoring's view of the model: flags that change hooks and shapes off, restored on exit."""
    return backend_for(model).standard_flags(model)


def ungrouped_kv(model: Any) -> AbstractContextManager[None]:
    """Keys and values per query head at the key/value hook points (grouped-query models)."""
    return backend_for(model).ungrouped_kv(model)


def notes(model: Any) -> dict[str, Any]:
    """extractive_lens's notes on a model object (processing, world-model provenance)."""
    return backend_for(model).notes(model)


def weights_processed(model: Any) -> bool:
    return backend_for(model).weights_processed(model)


def check_unprocessed(model: Any, what: str) -> None:
    """Refuse a model whose weights TransformerLens processed (``processing.py``), unless it was
    loaded processed on purpose (``load_pretrained(..., process_weights=True)``)."""
    from extractive_lens.backend.processing import refusal

    if not notes(model).get("processed") and (why := refusal(model, what)):
        raise ValueError(why)


def mlp_input(model: Any, resid_pre: Tensor, resid_mid: Tensor) -> Tensor:
    """What the MLP of a block reads: ``resid_mid``, or ``resid_pre`` for parallel blocks."""
    return resid_pre if parallel(model) else resid_mid


def layer_parameter_count(model: Any) -> int:
    """Parameters of one block (the first: every block has the same shape)."""
    blocks: Any = getattr(model, "blocks", None)
    return sum(p.numel() for p in blocks[0].parameters()) if blocks else 0

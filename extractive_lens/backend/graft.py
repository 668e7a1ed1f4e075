"""Position-resolved grafts: chosen heads and MLPs run with ``W + Δ`` only at chosen positions.

Two ways in, one computation (``heads_change``, ``mlp_grafted``):

- ``grafting(model, diff, where)``: hooks on TransformerLens's own forward, so that
  ``model(tokens)``, ``run_with_cache`` and ``model.generate`` (with or without its KV cache) run
  grafted. At each grafted layer the hooks read the layer's input, recompute the grafted
  heads' outputs with ``W + Δ`` (``shift.shifted``: the model is never written) and add
  ``Σ_h (z'_h W'_O[h] - z_h W_O[h])`` at the grafted positions into ``hook_attn_out``; a grafted
  MLP's output is replaced there in ``hook_mlp_out``. The grafted heads read keys and values
  computed with ``W + Δ`` at every earlier position: with TransformerLens's KV cache (one new
  position per call) those are kept here, one cache per grafted layer, beside the model's.
- ``scoring/graft.py`` runs the same two functions inside its own forward over the pieces
  (``run_blocks``), with the base or the finetuned weights outside the graft.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import einops
import torch
from torch import Tensor

from extractive_lens.backend import shift
from extractive_lens.backend.compute import this_thread_only

Inner = Callable[[], contextlib.AbstractContextManager[Any]]
"""The weights a graft's components compute with, as a context (``shifted(model, diff)``)."""


def heads_change(
    model: Any,
    layer: int,
    resid_pre: Tensor,
    z: Tensor,
    W_O: Tensor,
    heads: tuple[int, ...],
    inner: Inner,
    past_kv: tuple[Tensor, Tensor] | None = None,
) -> tuple[Tensor, tuple[Tensor, Tensor]]:
    """``Σ_{h ∈ heads} (z'_h W'_O[h] - z_h W_O[h])`` at every position of ``resid_pre``: the
    change of the attention output when ``heads`` compute with the weights of ``inner`` (their
    queries, keys, values and ``W_O``; ``z`` and ``W_O`` are the run's own). Returns it
    (``[batch, pos, d_model]``, float32 or wider) and the keys and values ``inner`` gave these
    positions (``past_kv``: those of earlier positions, computed the same way)."""
    from extractive_lens import backend as B

    with inner():
        _, cap = B.attention(model, layer, resid_pre, ("z", "k", "v"), past_kv=past_kv)
        W_O_in = B.W_O(model, layer)
    idx = list(heads)
    dtype = torch.promote_types(torch.promote_types(z.dtype, W_O_in.dtype), torch.float32)

    def write(z_: Tensor, w: Tensor) -> Tensor:
        return einops.einsum(
            z_[:, :, idx].to(dtype), w[idx].to(device=z_.device, dtype=dtype),
            "batch pos head d_head, head d_head d_model -> batch pos d_model",
        )  # fmt: skip

    return write(cap["z"], W_O_in) - write(z, W_O), (cap["k"], cap["v"])


def mlp_grafted(model: Any, layer: int, mlp_in: Tensor, out: Tensor, mask: Tensor,
                inner: Inner) -> Tensor:  # fmt: skip
    """The MLP's output ``out`` with the positions ``mask`` (``[batch, pos]``) replaced by what the
    MLP computes there with the weights of ``inner`` (on those positions only: it is per token)."""
    from extractive_lens import backend as B

    if not bool(mask.any()):
        return out
    rows, cols = mask.nonzero(as_tuple=True)
    with inner():
        new = B.mlp(model, layer, mlp_in[rows, cols][None])[0]
    out = out.clone()
    out[rows, cols] = new.to(out.dtype)
    return out


def added(out: Tensor, change: Tensor, mask: Tensor) -> Tensor:
    """``out + change`` at the positions ``mask``, ``out`` unchanged (bit for bit) elsewhere."""
    grafted = (out.to(change.dtype) + change).to(out.dtype)
    return torch.where(mask[..., None].to(out.device), grafted, out)


# ---------------------------------------------------------------------------------------------
# On TransformerLens's own forward
# ---------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _quiet(module: Any) -> Iterator[None]:
    """Inside the block, the hooks already attached to ``module`` and its submodules do not run
    (a user's ``run_with_cache`` records the grafted run, not the recomputation inside it);
    hooks attached inside the block (the pieces' captures) run and leave with it."""
    from collections import OrderedDict

    saved = [(m, m._forward_hooks, m._forward_pre_hooks) for m in module.modules()]
    try:
        for m, _, _ in saved:
            m._forward_hooks, m._forward_pre_hooks = OrderedDict(), OrderedDict()
        yield
    finally:
        for m, hooks, pre in saved:
            m._forward_hooks, m._forward_pre_hooks = hooks, pre


class _Run:
    """What the hooks of one graft keep: this call's layer inputs and the grafted heads' keys
    and values of every position so far (for TransformerLens's KV-cached calls)."""

    def __init__(self, model: Any, diff: Any, where: Any) -> None:
        self.model, self.diff, self.where = model, diff, where
        self.prompt_len: int | None = None
        self.offset: dict[int, int] = {}
        self.pre: dict[int, Tensor] = {}
        self.mid: dict[int, Tensor] = {}
        # per layer: the grafted weights' keys and values, then the base weights'
        self.kv: dict[int, tuple[tuple[Tensor, Tensor], tuple[Tensor, Tensor]]] = {}

    def inner(self) -> contextlib.AbstractContextManager[Any]:
        return shift.shifted(self.model, self.diff)

    def mask(self, layer: int, x: Tensor) -> Tensor:
        offset = self.offset.get(layer, 0)
        if offset == 0 and layer == self.where.layers[0]:
            if self.prompt_len is None:  # the first forward inside the graft is the prompt
                self.prompt_len = x.shape[1]
            elif x.shape[1] < self.prompt_len:
                raise RuntimeError(
                    f"grafted: a forward of {x.shape[1]} positions after a prompt of "
                    f"{self.prompt_len}, not resumed from TransformerLens's KV cache (a "
                    "TransformerBridge's cache is not followed): generate with "
                    "use_past_kv_cache=False, or run each prompt in its own `with` block."
                )
        return self.where.at(x.shape[0], offset, x.shape[1], self.prompt_len or x.shape[1]).to(
            x.device
        )

    def attn_out(self, layer: int, out: Tensor) -> Tensor:
        """The layer's attention output with the grafted heads' change added at the grafted
        positions. The base heads' ``z`` is recomputed here from the layer's input rather than
        read at ``hook_z`` (a bridge's hook holds it in another layout); both weight settings'
        keys and values of earlier positions are kept for KV-cached calls."""
        from extractive_lens import backend as B

        offset = self.offset.get(layer, 0)
        past: list[tuple[Tensor, Tensor] | None] = [None, None]
        if offset > 0:
            kept = self.kv.get(layer)
            if kept is None or kept[0][0].shape[1] != offset:
                raise RuntimeError(
                    "grafted: the model resumed from a KV cache filled outside this graft; "
                    "start the generation (or the cached forward) inside the `with` block."
                )
            past = list(kept)
        with _quiet(self.model.blocks[layer]), shift.unshifted(self.model):
            _, cap = B.attention(self.model, layer, self.pre[layer], ("z", "k", "v"),
                                 past_kv=past[1])  # fmt: skip
            W_O = B.W_O(self.model, layer)
        with _quiet(self.model.blocks[layer]):
            change, kv = heads_change(self.model, layer, self.pre[layer], cap["z"], W_O,
                                      self.where.heads[layer], self.inner, past[0])  # fmt: skip
        now = [kv, (cap["k"], cap["v"])]
        for i, p in enumerate(past):
            if p is not None:
                now[i] = (torch.cat([p[0], now[i][0]], 1), torch.cat([p[1], now[i][1]], 1))
        self.kv[layer] = (now[0], now[1])
        return added(out, change, self.mask(layer, out))

    def mlp_out(self, layer: int, out: Tensor) -> Tensor:
        from extractive_lens import backend as B

        mlp_in = B.mlp_input(self.model, self.pre[layer], self.mid.get(layer, self.pre[layer]))
        mask = self.mask(layer, out)
        with _quiet(self.model.blocks[layer]):
            return mlp_grafted(self.model, layer, mlp_in, out, mask, self.inner)


@contextlib.contextmanager
def grafting(model: Any, diff: Any, where: Any) -> Iterator[None]:
    """Inside the block, TransformerLens's forward of ``model`` runs with the graft ``where``
    (``grafts.Where``) of ``diff`` (module docstring); the hooks act for this thread only and are
    removed on exit, whatever happens."""
    from extractive_lens import backend as B
    from extractive_lens.interrupts import state_change

    run = _Run(model, diff, where)
    handles: list[Any] = []
    points = dict(model.hook_dict)

    # the recomputations inside a hook run the model's modules again (a bridge's attention
    # may run a whole forward to record its arguments): the graft's hooks sit those out
    busy = [False]

    def keep(table: dict[int, Tensor], layer: int) -> Any:
        def hook(_m: Any, _i: Any, out: Tensor) -> None:
            if not busy[0]:
                table[layer] = out

        return hook

    def replace(fn: Callable[[int, Tensor], Tensor], layer: int) -> Any:
        def hook(_m: Any, _i: Any, out: Tensor) -> Tensor | None:
            if busy[0]:
                return None
            busy[0] = True
            try:
                return fn(layer, out)
            finally:
                busy[0] = False

        return hook

    def offset_of(layer: int) -> Any:
        def pre(_m: Any, _args: Any, kwargs: dict[str, Any]) -> None:
            if busy[0]:
                return
            entry = kwargs.get("past_kv_cache_entry")
            past = getattr(entry, "past_keys", None)
            run.offset[layer] = 0 if past is None else int(past.shape[1])

        return pre

    wanted: list[tuple[str, Any]] = []
    for layer in where.layers:
        p = f"blocks.{layer}."
        wanted.append((p + "hook_resid_pre", keep(run.pre, layer)))
        if where.heads[layer]:
            wanted.append((p + "hook_attn_out", replace(run.attn_out, layer)))
        if layer in where.mlps:
            if not B.parallel(model):
                wanted.append((p + "hook_resid_mid", keep(run.mid, layer)))
            wanted.append((p + "hook_mlp_out", replace(run.mlp_out, layer)))

    def change() -> None:
        for layer in where.layers:
            attn = model.blocks[layer].attn
            handles.append(attn.register_forward_pre_hook(
                this_thread_only(offset_of(layer)), with_kwargs=True))  # fmt: skip
        for name, fn in wanted:
            handles.append(points[name].register_forward_hook(this_thread_only(fn)))

    def restore() -> None:
        for h in handles:
            h.remove()
        handles.clear()

    with state_change(change, restore, model=model):
        yield

"""Low-rank changes on a ``TransformerBridge``: where a change ``L R`` of a TransformerLens
weight is a change of one stored ``nn.Linear`` weight (``raw_low_rank``), and the pieces adding
it to that module's output as ``(x L) R`` while they run (``low_rank_linears``), as ``peft``'s
LoRA layer does: neither ``L R`` nor ``W + αΔ`` is formed.

>>> from extractive_lens.backend.lowrank import LowRank
>>> import torch
>>> _plain(LowRank(torch.ones(3, 1), torch.ones(1, 2), "transposed")).layout
'plain'
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from typing import Any

from torch import Tensor, nn

from extractive_lens.backend.compute import low_rank_part, plus_low_rank, this_thread_only
from extractive_lens.backend.lowrank import LowRank, to_layout

_View = tuple[str, tuple[int, ...], tuple[int, ...], int]  # raw name, shape, stride, offset
_LINEAR_VIEWS: weakref.WeakKeyDictionary[nn.Module, dict[str, _View]] = weakref.WeakKeyDictionary()


def raw_low_rank(
    model: Any, name: str, f: LowRank, parameters: Callable[[Any], dict[str, Tensor]]
) -> tuple[str, LowRank] | None:
    """The low-rank change ``f`` of the TransformerLens parameter ``name`` as a change of the
    stored weight behind it, ``(raw name, factors)``, where the pieces add it as ``(x L) R``
    at that weight's module output (``low_rank_linears``): ``name`` is the whole of an
    ``nn.Linear``'s ``[out, in]`` weight, laid out as ``f`` says (Llama's ``q_proj`` ...
    ``down_proj``: ``Δ = (L R)ᵀ``, the ``transposed`` layout). ``None`` elsewhere (GPT-2's
    fused ``c_attn`` and Conv1D weights, embeddings, a view of part of a weight): Δ is formed.
    ``parameters``: the backend's TransformerLens-named views of the stored weights."""
    views = _LINEAR_VIEWS.get(model)
    if views is None:
        linears = {id(m.weight) for m in model.modules() if type(m) is nn.Linear}
        by_storage: dict[int, list[tuple[str, Tensor]]] = {}
        for raw_name, p in model.named_parameters(remove_duplicate=False):
            by_storage.setdefault(p.untyped_storage().data_ptr(), []).append((raw_name, p))
        views = {}
        for tl_name, t in parameters(model).items():
            owners = by_storage.get(t.untyped_storage().data_ptr(), [])
            if len({id(p) for _, p in owners}) == 1 and id(owners[0][1]) in linears:
                # one stored weight, an nn.Linear's: where and how the view reads it
                views[tl_name] = (owners[0][0], tuple(t.shape), t.stride(), int(t.storage_offset()))
        _LINEAR_VIEWS[model] = views
    found = views.get(name)
    if found is None or tuple(f.shape) != found[1]:
        return None
    path, _, attr = found[0].rpartition(".")  # not get_parameter: inside torch.func's calls
    p = getattr(model.get_submodule(path), attr)  # (jvp, functional_call) it is a plain tensor
    want = to_layout(p.detach().T, f.layout, f.n_heads)  # the view f's layout makes of p
    if (tuple(want.shape), want.stride(), int(want.storage_offset())) != found[1:]:
        return None
    return found[0], LowRank(f.left, f.right, "transposed")


@contextlib.contextmanager
def low_rank_linears(root: nn.Module, part: nn.Module) -> Iterator[frozenset[str]]:
    """Inside the block, each ``nn.Linear`` of ``part`` whose weight has a low-rank change or
    tangent in force (``raw_low_rank``: Llama's ``q_proj`` ... ``down_proj``) adds it to its
    output as ``(x L) R`` (``compute.plus_low_rank``), as ``peft``'s LoRA layer does: neither
    ``B @ A`` nor ``W + αΔ`` is formed. Yields those weights' names under ``root``, which
    ``upcast_call`` substitutes by ``W`` alone. A module that did not run is an error (a piece
    reading its weight some other way would leave its change out)."""
    found: dict[int, tuple[nn.Module, tuple[Any, float, Any]]] = {}
    for m in part.modules():
        if type(m) is nn.Linear:
            change, alpha, t = low_rank_part(m.weight)
            if change is not None or t is not None:  # [out, in] weights: x Δᵀ = (x L) R
                found[id(m.weight)] = (m, (_plain(change), alpha, _plain(t)))
    if not found:
        yield frozenset()
        return
    fired: set[int] = set()
    handles = []
    try:
        for i, (m, lr) in found.items():

            def add(_m: Any, inputs: tuple[Any, ...], out: Tensor, i: int = i, lr: Any = lr) -> Any:
                fired.add(i)
                return plus_low_rank(out, inputs[0], lr)

            handles.append(m.register_forward_hook(this_thread_only(add)))
        yield frozenset(n for n, p in root.named_parameters() if id(p) in found)
    finally:
        for h in handles:
            h.remove()
    if len(fired) < len(found):
        raise RuntimeError(
            f"{type(part).__name__} did not run {len(found) - len(fired)} of its nn.Linear "
            "modules with a low-rank change: this bridge component reads their weights another "
            "way; score the diff made dense (WeightDiff(dict(diff.deltas), diff.signature))."
        )


def _plain(f: LowRank | None) -> LowRank | None:
    """A stored ``[out, in]`` weight's change ``(L R)ᵀ`` as what ``nn.Linear`` adds to its
    output, ``x (L R)``."""
    return None if f is None else LowRank(f.left, f.right, "plain")

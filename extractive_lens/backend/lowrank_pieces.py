"""Low-rank changes in a ``HookedTransformer``'s pieces as products with their input.

A LoRA diff (``WeightDiff.from_peft``) keeps each change as factors ``Δ = L @ R``
(``lowrank.LowRank``). The hooked backend's ``attention`` and ``mlp`` never form ``L @ R`` nor
``W + α·Δ`` for them: the piece runs with ``W`` and adds ``α·(x L) R`` at the hook point that
holds the projection's output (``hook_q``, ``hook_k``, ``hook_v``; ``hook_pre``,
``hook_pre_linear``), or, for ``W_O`` and ``W_out``, to the piece's output from the value at
``hook_z`` / ``hook_post``; inside ``compute.jvp`` a low-rank tangent is added the same way to
the derivative alone (``compute.plus_low_rank``). The embedding and the unembedding take their
by-part path (``vocab.py``) on restricted factors. What this module does not know (another
attention or MLP class, TransformerLens flags that reshape the inputs) keeps the weight-level
path: ``W + αΔ`` as one ``addmm`` (``Shift.value``), a dense tangent.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from extractive_lens.backend.compute import low_rank_part, plus_low_rank, this_thread_only

ATTN_LOW_RANK = {"W_Q": "hook_q", "W_K": "hook_k", "_W_K": "hook_k", "W_V": "hook_v",
                 "_W_V": "hook_v", "W_O": "hook_z"}  # fmt: skip
"""The attention weights whose low-rank change a piece adds to the hook point's value (W_O:
to the attention's output, from the value at ``hook_z``)."""
MLP_LOW_RANK = {"MLP": {"W_in": "hook_pre", "W_out": "hook_post"},
                "GatedMLP": {"W_gate": "hook_pre", "W_in": "hook_pre_linear",
                             "W_out": "hook_post"}}  # fmt: skip
"""Per MLP class, the same (W_out: to the MLP's output, from the value at ``hook_post``)."""


def low_rank_parts(module: Any, leaves: Any) -> dict[str, Any]:
    """The weights among ``leaves`` of ``module`` with a low-rank change or tangent in force
    (``compute.low_rank_part``), by leaf name."""
    params = dict(module.named_parameters(recurse=False))
    found = {}
    for leaf in leaves:
        p = params.get(leaf)
        part = None if p is None else low_rank_part(p)
        if part is not None and (part[0] is not None or part[2] is not None):
            found[leaf] = part
    return found


def low_rank_hooks(module: Any, parts: dict[str, Any], where: dict[str, str], inp: dict,
                   handles: list[Any]) -> None:  # fmt: skip
    """Forward hooks adding each input-side part's ``x @ Δ`` (``inp["x"]``: the module's input)
    at its hook point; an output-side part (``W_O``, ``W_out``) keeps its hook point's value
    in ``inp`` for ``plus_output``."""
    for leaf, part in parts.items():
        hp = getattr(module, where[leaf])
        hook: Any
        if leaf in ("W_O", "W_out"):
            hook = lambda _m, _i, out, leaf=leaf: inp.__setitem__(leaf, out)  # noqa: E731
        else:
            hook = lambda _m, _i, out, part=part: plus_low_rank(  # noqa: E731
                out, inp["x"], part, fit=lambda u, out=out: _per_query_head(u, out)
            )
        handles.append(hp.register_forward_hook(this_thread_only(hook)))


def _per_query_head(u: Tensor, out: Tensor) -> Tensor:
    """A grouped key/value term ``[..., kv_head, d_head]`` repeated per query head where the
    hook point holds one per query head (``ungroup_grouped_query_attention``)."""
    if u.shape == out.shape or u.ndim < 2:
        return u
    return u.repeat_interleave(out.shape[-2] // u.shape[-2], dim=-2)


def plus_output(out: Tensor, parts: dict[str, Any], inp: dict) -> Tensor:
    for leaf in ("W_O", "W_out"):
        if leaf in parts:
            out = plus_low_rank(out, inp[leaf], parts[leaf])
    return out


def plain_attention(model: Any, attn: Any) -> bool:
    """Whether ``attention`` adds the low-rank changes of this attention module itself."""
    cfg = model.cfg
    flags = (cfg.load_in_4bit, cfg.use_split_qkv_input, cfg.use_attn_in, cfg.use_attn_result)
    return type(attn).__name__ in ("Attention", "GroupedQueryAttention") and not any(flags)


def has_low_rank(p: Tensor) -> bool:
    """Whether the vocabulary matrix ``p`` has a low-rank change or tangent in force: read by
    part (``vocab``), on restricted factors, whatever its size."""
    change, _, t = low_rank_part(p)
    return change is not None or t is not None

"""Linearized informative / upstream / downstream scores (docs/scores.md §5, §7).

>>> scores = linear_scores(base, diff, batch)                                   # doctest: +SKIP
>>> scores["informative"].shape     # [layer, component, pos]                  # doctest: +SKIP
>>> linear_scores(base, diff, batch, convention="authors_code")                 # doctest: +SKIP

One model in memory: the finetuned weights come from ``diff.applied(model)``. Cost per batch:
one forward+backward of the base model (``ŷ``), one forward-mode pass per layer along Δ
(informative), one forward of the finetuned model plus one base pass per layer (downstream),
and for upstream one resumed finetuned pass: the base residual stream enters at every layer
boundary as extra rows of a growing batch ("staircase"), so ``ŷ'`` for all ``2·n_layers``
boundaries comes from one forward and one backward (``upstream_group`` bounds its memory).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import torch
from torch import Tensor, nn

from extractive_lens import model as M
from extractive_lens.batch import PromptBatch
from extractive_lens.interrupts import guarded, refuse_attached_hooks
from extractive_lens.results import ComponentScores
from extractive_lens.rewards import Reward, resolve_reward
from extractive_lens.scoring.engine import (
    AblationTable,
    Run,
    assemble,
    base_metadata,
    check_arguments,
    forward_run,
    head_grad,
    plan_chunks,
    progress,
    readout,
    resolve_kinds,
    wide,
)
from extractive_lens.types import SCORE_KINDS, Ablation, Convention, ScoreKind
from extractive_lens.weight_diff import WeightDiff


def linear_scores(
    model: nn.Module,
    diff: WeightDiff,
    batch: PromptBatch,
    *,
    reward: str | Reward | None = None,
    kinds: Sequence[ScoreKind] | ScoreKind = SCORE_KINDS,
    ablation: Ablation | None = None,
    reference: PromptBatch | None = None,
    convention: Convention = "paper",
    batch_size: int | None = 16,
    upstream_group: int | Literal["auto"] | None = "auto",
    resample_k: int = 10,
    seed: int = 3,
    show_progress: bool | None = None,
    rows: Sequence[int] | None = None,
    compute_dtype: torch.dtype | str | None = None,
) -> ComponentScores:
    """Linearized scores of every head and MLP at every token (definitions: ``docs/scores.md``).

    Args:
        model: the base ``HookedTransformer`` (weights W). It is left bit-identical.
        diff: ``Δ = W' - W``.
        batch: prompts and answers from ``make_batch``.
        reward: ``"answer_logprob"`` (default), ``"logit_margin"`` (default for
            ``convention="authors_code"``), ``"logit_diff"`` or a callable.
        kinds: any of ``"informative"``, ``"upstream"``, ``"downstream"``.
        ablation: ``y*`` for upstream: ``"mean"`` (default), ``"zero"`` or ``"resample"``
            (default for the authors' convention; ``resample_k`` prompts drawn with ``seed``).
        reference: prompts whose role-aligned mean is ``y*`` (default: the batch's other prompts).
        convention: ``"paper"`` (docs/scores.md §5) or ``"authors_code"`` (docs/scores.md §7).
        batch_size: prompts per pass (progress bar over passes).
        rows: score only these prompts of ``batch`` (``y*`` still comes from the whole batch);
            used to shard a dataset across processes.
        upstream_group: layer boundaries per resumed pass for ``ŷ'``. ``None``: all ``2·n_layers``
            in one pass (fastest for small models; activation memory grows to about
            ``n_layers`` times one forward's). ``1``: one boundary per pass (activation memory
            at most one forward's; same FLOPs, more passes). ``"auto"`` (default): all in one
            pass when that stays under ``UPSTREAM_AUTO_BYTES``, else 1.
        compute_dtype: the dtype every activation, gradient and score is computed in. Default:
            float32 for bf16/fp16 models (weights stay stored as they are; each layer is upcast
            while it runs), the model's dtype otherwise. Recorded in ``metadata``.

    With ``"informative"`` the result also carries a linearization check:
    ``metadata["linearization"]`` compares ``Σ informative + other`` (the first-order change of R)
    with the actual change ``R(W') - R(W)`` from one extra forward, and a ``LinearizationWarning``
    is raised when they differ by more than ``LINEARIZATION_TOLERANCE`` (``docs/scores.md``).
    """
    check_arguments("linear_scores", model, diff, batch)
    M.check_scorable(model)
    refuse_attached_hooks(model, "linear_scores")
    kinds = resolve_kinds(kinds)
    cdt = M.resolve_compute_dtype(model, compute_dtype)
    if convention not in ("paper", "authors_code"):
        raise ValueError(f"convention must be 'paper' or 'authors_code', got {convention!r}")
    authors = convention == "authors_code"
    reward_fn, reward_name = resolve_reward(reward, "logit_margin" if authors else "answer_logprob")
    ablation = ablation or ("resample" if authors else "mean")
    if ablation not in ("mean", "zero", "resample"):
        raise ValueError(f"ablation must be 'mean', 'zero' or 'resample', got {ablation!r}")
    if upstream_group not in (None, "auto") and (
        isinstance(upstream_group, bool)
        or not isinstance(upstream_group, int)
        or upstream_group < 1
    ):
        raise ValueError(
            f"upstream_group must be 'auto', None (all layer boundaries in one pass) or a positive "
            f"number of boundaries per pass, got {upstream_group!r}"
        )
    cfg = model.cfg
    if (
        authors
        and cfg.n_key_value_heads
        and cfg.n_key_value_heads != cfg.n_heads
        and "informative" in kinds
    ):
        raise NotImplementedError(
            "convention='authors_code' credits key/value changes at the key position per head, "
            "which needs one key/value head per query head; this model uses grouped-query "
            "attention. Use convention='paper'."
        )
    diff._check_compatible(model)
    deltas = {n: d.to(cfg.device) for n, d in diff.deltas.items()}
    _check_covered(model, deltas)
    scored, plan = plan_chunks(batch, rows, batch_size)
    meta = base_metadata(
        model,
        diff,
        method="linear",
        reward=reward_name,
        ablation=ablation if "upstream" in kinds else None,
        convention=convention,
        reference="batch (leave-one-out)" if reference is None else f"{len(reference)} prompts",
        resample_k=resample_k if ablation == "resample" else None,
        seed=seed,
        compute_dtype=str(cdt),
        prepend_bos=batch.prepend_bos,
    )
    meta["rows"] = None if rows is None else list(rows)
    with guarded(model), M.standard_flags(model), M.computing_in(model, cdt):
        per_token, other, changes = _scores(
            model,
            diff,
            deltas,
            batch,
            plan,
            reward_fn,
            kinds,
            ablation,
            reference,
            authors,
            upstream_group,
            resample_k,
            seed,
            batch_size,
            rows,
            show_progress,
        )
    result = assemble(
        model,
        scored,
        kinds,
        per_token,
        [v.sum(-1) for v in per_token],
        method="linear",
        other=other,
        metadata=meta,
    )
    if "informative" in kinds:
        meta["linearization"] = linearization_check(result, torch.cat(changes).cpu())
    return result


def _scores(
    model: nn.Module,
    diff: WeightDiff,
    deltas: dict[str, Tensor],
    batch: PromptBatch,
    plan: list,
    reward_fn: Reward,
    kinds: tuple[ScoreKind, ...],
    ablation: Ablation,
    reference: PromptBatch | None,
    authors: bool,
    upstream_group: int | Literal["auto"] | None,
    resample_k: int,
    seed: int,
    batch_size: int | None,
    rows: Sequence[int] | None,
    show_progress: bool | None,
) -> tuple[list[Tensor], list[Tensor], list[Tensor]]:
    """Per-chunk ``[kind, batch, layer, component, pos]`` scores, "other" shares and ``R(W') - R(W)``."""
    chunks = [c for c, _ in plan]
    capture = ("z", "q", "k", "v") if authors and "informative" in kinds else ("z",)
    first = forward_run(model, chunks[0], reward_fn, grad=True, capture=capture)
    table = None
    if "upstream" in kinds:
        reuse = (
            [(chunks[0], first)]
            if reference is None and rows is None and len(chunks) == 1
            else None
        )
        table = AblationTable(
            model,
            batch,
            ablation,
            reference=reference,
            k=resample_k,
            seed=seed,
            batch_size=batch_size,
            runs=reuse,
        )
    per_token, other, changes = [], [], []
    for i, chunk in enumerate(progress(chunks, len(chunks), "linear scores", show_progress)):
        global_rows = plan[i][1]
        base = first if i == 0 else forward_run(model, chunk, reward_fn, grad=True, capture=capture)
        group = _auto_group(model, chunk) if upstream_group == "auto" else upstream_group
        v, o, change = _chunk(
            model, diff, deltas, chunk, base, global_rows, reward_fn, kinds, table, authors, group
        )
        per_token.append(v)
        other.append(o)
        changes.append(change)
    return per_token, other, changes


LINEARIZATION_TOLERANCE = 0.3
"""Relative gap between the first-order change ``Σ informative + other`` and the actual change
``R(W') - R(W)`` above which ``linear_scores`` warns (see ``docs/scores.md``, "When to trust a
linear score")."""


class LinearizationWarning(UserWarning):
    """The weight change is too large for its first-order (linear) description."""


def linearization_check(
    scores: ComponentScores, change: Tensor, *, warn: bool = True
) -> dict[str, Any]:
    """Compare ``Σ_{c,t} Ī + other`` with ``R(W') - R(W)`` (both means over prompts).

    ``relative_gap = |linear - exact| / max(|linear|, |exact|)``: 0 when the update acts linearly
    on R, 1 when the first-order term misses the change entirely or has the wrong sign.
    """
    import warnings

    k = scores.kind_index("informative")
    linear_total = scores.prompt_totals[k].sum((1, 2)) + scores.other
    lin, ex = float(linear_total.mean()), float(change.mean())
    scale = max(abs(lin), abs(ex))
    gap = abs(lin - ex) / scale if scale > 0 else 0.0
    other = float(scores.other.mean())
    out = {
        "exact_change": ex,
        "linear_change": lin,
        "relative_gap": gap,
        "other_share": other / lin if lin else float("nan"),
        "tolerance": LINEARIZATION_TOLERANCE,
        "ok": gap <= LINEARIZATION_TOLERANCE,
        "prompt_changes": [float(x) for x in change],
    }
    if warn and gap > LINEARIZATION_TOLERANCE:
        warnings.warn(
            f"The weight change acts non-linearly on the reward: R(W') - R(W) = {ex:.4g} but the "
            f"informative scores and 'other' add up to {lin:.4g} (gap {gap:.0%} > {LINEARIZATION_TOLERANCE:.0%}). "
            "Per-component scores do not add up to the whole change here (the update is large or "
            "components interact); check the linear scores against exact ones before reading their "
            "values: compare(lin, causal_scores(..., top_k=...)). See docs/scores.md §11.",
            LinearizationWarning,
            stacklevel=3,
        )
    return out


UPSTREAM_AUTO_BYTES = 256 * 2**20


def _auto_group(model: nn.Module, chunk: PromptBatch) -> int | None:
    """All boundaries in one staircase pass if its activations stay small, else one at a time."""
    cfg = model.cfg
    per_layer = (
        len(chunk) * chunk.n_pos * (cfg.d_model * 4 + (cfg.d_mlp or 0) * 2) * 4
    )  # bytes, rough
    staircase = per_layer * cfg.n_layers * cfg.n_layers  # ~2L entries, ~L/2 layers each on average
    return None if staircase <= UPSTREAM_AUTO_BYTES else 1


def _check_covered(model: nn.Module, deltas: dict[str, Tensor]) -> None:
    known = ("embed.", "pos_embed.", "ln_final.", "unembed.")
    for n in deltas:
        if n.startswith(known) or any(f".{part}." in n for part in ("ln1", "ln2", "attn", "mlp")):
            continue
        raise NotImplementedError(
            f"Scores do not know how to credit the change of parameter {n!r}."
        )


def _select(
    deltas: dict[str, Tensor], names: Any, exclude: tuple[str, ...] = ()
) -> dict[str, Tensor]:
    return {n: deltas[n] for n in names if n in deltas and not n.endswith(exclude)}


def _chunk(
    model: nn.Module,
    diff: WeightDiff,
    deltas: dict[str, Tensor],
    chunk: PromptBatch,
    base: Run,
    rows: list[int],
    reward_fn: Reward,
    kinds: tuple[ScoreKind, ...],
    table: AblationTable | None,
    authors: bool,
    upstream_group: int | None,
) -> tuple[Tensor, Tensor, Tensor]:
    """``([kind, batch, layer, component, pos] scores, other [batch], R(W') - R(W) [batch])``
    (the last is empty without informative scores)."""
    cfg = model.cfg
    L, H = cfg.n_layers, cfg.n_heads
    has_mlp = M.has_mlp(model)
    want_inf = "informative" in kinds
    dtype = wide(base.pre[0]).dtype
    b, pos = chunk.tokens.shape
    out = torch.zeros(len(kinds), b, L, H + has_mlp, pos, dtype=dtype, device=base.pre[0].device)
    g_z = [head_grad(wide(base.g_attn[l]), base.W_O[l]) for l in range(L)]
    other = torch.zeros(b, dtype=dtype, device=out.device)

    if want_inf:
        k = kinds.index("informative")
        out[k], other = _informative(model, deltas, chunk, base, g_z, authors, dtype)
    ft = None
    gp_attn = gp_mlp = None
    need_ft = "downstream" in kinds or ("upstream" in kinds and authors) or want_inf
    if need_ft or "upstream" in kinds:
        with diff.applied(model):  # one application for the finetuned run and the resumed passes
            if need_ft:
                ft = forward_run(model, chunk, reward_fn, grad="upstream" in kinds and authors)
            if "upstream" in kinds and not authors:
                gp_attn, gp_mlp = upstream_gradients(
                    model, diff, chunk, base, reward_fn, upstream_group
                )
    if "downstream" in kinds:
        k = kinds.index("downstream")
        with torch.no_grad():
            for layer in range(L):
                _, cap = M.attention(model, layer, ft.pre[layer])
                dz = wide(cap["z"]) - wide(base.z[layer])
                out[k, :, layer, :H] = (g_z[layer] * dz).sum(-1).transpose(1, 2)
                if has_mlp:
                    dy = wide(M.mlp(model, layer, ft.mlp_in[layer])) - wide(base.mlp_out[layer])
                    out[k, :, layer, H] = (wide(base.g_mlp[layer]) * dy).sum(-1)
    if "upstream" in kinds:
        k = kinds.index("upstream")
        z_star, m_star = table.for_rows(rows, chunk, base)
        if authors:
            gp_z = [head_grad(wide(ft.g_attn[l]), ft.W_O[l]) for l in range(L)]
            gp_mlp = ft.g_mlp
        else:
            gp_z = [head_grad(wide(gp_attn[l]), base.W_O[l]) for l in range(L)]
        for layer in range(L):
            dz = wide(base.z[layer]) - z_star[:, :, layer]
            out[k, :, layer, :H] = ((gp_z[layer] - g_z[layer]) * dz).sum(-1).transpose(1, 2)
            if has_mlp:
                dm = wide(base.mlp_out[layer]) - m_star[:, :, layer]
                out[k, :, layer, H] = ((wide(gp_mlp[layer]) - wide(base.g_mlp[layer])) * dm).sum(-1)
    mask = chunk.position_mask.to(out.device)
    change = wide(ft.reward) - wide(base.reward) if want_inf else out.new_zeros(0)
    return out * mask[None, :, None, None, :], other, change


def _informative(
    model: nn.Module,
    deltas: dict[str, Tensor],
    chunk: PromptBatch,
    base: Run,
    g_z: list[Tensor],
    authors: bool,
    dtype: torch.dtype,
) -> tuple[Tensor, Tensor]:
    """``Ī[batch, layer, component, pos]`` and the "other" parameters' share ``[batch]``.

    One forward-mode pass: every layer's attention and MLP re-run on its cached base input with
    the weights' tangent set to Δ (``b_O``, and ``W_O`` in the authors' convention, excluded:
    they are credited separately).
    """
    cfg = model.cfg
    L, H = cfg.n_layers, cfg.n_heads
    has_mlp = M.has_mlp(model)
    b, pos = chunk.tokens.shape
    inf = torch.zeros(b, L, H + has_mlp, pos, dtype=dtype, device=g_z[0].device)
    other = torch.zeros(b, dtype=dtype, device=inf.device)
    exclude = (".attn.b_O", ".attn.W_O") if authors else (".attn.b_O",)
    capture = ("z", "q", "k", "v") if authors else ("z",)
    tang = _select(deltas, [n for l in range(L) for n in M.head_param_names(deltas, l)], exclude)
    if has_mlp:
        tang.update(_select(deltas, [n for l in range(L) for n in M.mlp_param_names(deltas, l)]))

    tokens = chunk.tokens.to(cfg.device)
    tang.update(
        _select(
            deltas,
            [n for n in deltas if n.startswith(("embed.", "pos_embed.", "ln_final.", "unembed."))],
        )
    )

    def pieces(m: nn.Module) -> tuple[list[dict[str, Tensor]], list[Tensor], Tensor, Tensor]:
        caps = [M.attention(m, l, base.pre[l], capture)[1] for l in range(L)]
        outs = [M.mlp(m, l, base.mlp_in[l]) for l in range(L)] if has_mlp else []
        return caps, outs, M.embed(m, tokens), M.unembed(m, base.post_final)

    with torch.no_grad():  # one forward-mode pass for every component and the "other" parameters
        _, (cap_dot, mlp_dot, e_dot, l_dot) = M.jvp(model, pieces, (), tang)
    for layer in range(L):
        dot = cap_dot[layer]
        if authors:  # Q credited at the query position, K and V at the key position
            g = base.g_captured[layer]
            per = sum((wide(g[n]) * wide(dot[n])).sum(-1) for n in ("q", "k", "v"))
        else:
            per = (g_z[layer] * wide(dot["z"])).sum(-1)
        inf[:, layer, :H] = per.transpose(1, 2)
        d_WO = deltas.get(f"blocks.{layer}.attn.W_O")
        if d_WO is not None:  # <ŷ, z_h ΔW_O[h]> = <ŷ ΔW_O[h]^T, z_h>, at the output position
            w_o = (head_grad(wide(base.g_attn[layer]), d_WO) * wide(base.z[layer])).sum(-1)
            inf[:, layer, :H] += w_o.transpose(1, 2)
        d_bO = deltas.get(f"blocks.{layer}.attn.b_O")
        if d_bO is not None:
            other += (wide(base.g_attn[layer]).sum(1) * d_bO.to(dtype)).sum(-1)
        if has_mlp:
            inf[:, layer, H] = (wide(base.g_mlp[layer]) * wide(mlp_dot[layer])).sum(-1)
    other += (wide(base.g_embed) * wide(e_dot)).sum((-1, -2))
    other += (wide(base.g_logits) * wide(l_dot)).sum((-1, -2))
    return inf, other


def upstream_gradients(
    model: nn.Module,
    diff: WeightDiff,
    chunk: PromptBatch,
    base: Run,
    reward_fn: Reward,
    group: int | None = None,
) -> tuple[list[Tensor], list[Tensor]]:
    """``ŷ'`` at every layer boundary: ``dR/dy_c`` with ``W_late`` finetuned, at base activations.

    Call with the finetuned weights applied (``with diff.applied(model):``); ``base`` is the
    cached base run.

    The base residual stream enters the finetuned model right after each component (heads of
    layer l: after attention, with ``b_O'``; MLP l: after the MLP) as extra rows of one
    growing batch; one backward gives every boundary's gradient.
    """
    cfg = model.cfg
    L = cfg.n_layers
    has_mlp = M.has_mlp(model)
    parallel = cfg.parallel_attn_mlp
    boundaries = [
        (layer, part) for layer in range(L) for part in (("attn", "mlp") if has_mlp else ("attn",))
    ]
    group = group or len(boundaries)
    grads: dict[tuple[int, str], Tensor] = {}
    deltas = diff.deltas
    for g0 in range(0, len(boundaries), group):
        todo = boundaries[g0 : g0 + group]
        entries: list[Tensor] = []
        with M.frozen_parameters(model), torch.enable_grad():
            rows: Tensor | None = None
            for layer in range(todo[0][0], L):
                new = [p for (lay, p) in todo if lay == layer]
                if rows is not None:
                    rows = M.on_block(model, layer, rows)
                d_bO = deltas.get(f"blocks.{layer}.attn.b_O")
                shift = (
                    0
                    if d_bO is None
                    else d_bO.to(device=base.mid[layer].device, dtype=base.mid[layer].dtype)
                )
                if parallel:
                    if rows is not None:
                        out, _ = M.attention(model, layer, rows, ())
                        rows = rows + out + M.mlp(model, layer, rows)
                    for part in new:
                        e = (
                            (base.post[layer] + (shift if part == "attn" else 0))
                            .detach()
                            .requires_grad_(True)
                        )
                        entries.append(e)
                        rows = e if rows is None else torch.cat([rows, e])
                    continue
                if rows is not None:
                    rows = rows + M.attention(model, layer, rows, ())[0]
                if "attn" in new:
                    e = (base.mid[layer] + shift).detach().requires_grad_(True)
                    entries.append(e)
                    rows = e if rows is None else torch.cat([rows, e])
                if has_mlp and rows is not None:
                    rows = rows + M.mlp(model, layer, rows)
                if "mlp" in new:
                    e = base.post[layer].detach().requires_grad_(True)
                    entries.append(e)
                    rows = e if rows is None else torch.cat([rows, e])
            R, _, _ = readout(model, rows, chunk, reward_fn, groups=len(entries))
            got = torch.autograd.grad(R.sum(), entries)
        for key, g in zip(todo, got):
            grads[key] = g
    gp_attn = [grads[(layer, "attn")] for layer in range(L)]
    gp_mlp = [grads[(layer, "mlp")] for layer in range(L)] if has_mlp else []
    return gp_attn, gp_mlp

"""Upstream scores (docs/scores.md §4–5, §7): how much each component's output matters to R
*through* the finetuned later layers. Exact: the effect of ablating the component to ``y*``
with the layers after it finetuned, minus the same effect in the base model (a double
difference). Linear: ``<ŷ'_c - ŷ_c, y_c - y*_c>`` with ``ŷ'`` the gradient at the base
activations with the later layers finetuned ("staircase" pass, below).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from extractive_lens import backend as B
from extractive_lens.backend import LayerRun, shift
from extractive_lens.scoring import passes
from extractive_lens.scoring.runs import (
    LayerW_O,
    Run,
    back,
    block_rows,
    head_grad,
    head_out,
    readout,
    sizing,
    through,
    wide,
)  # fmt: skip

if TYPE_CHECKING:  # pragma: no cover
    from extractive_lens.batch import PromptBatch
    from extractive_lens.rewards import Reward
    from extractive_lens.scoring.kinds.protocols import CausalChunk, LayerStep, LinearChunk
    from extractive_lens.scoring.options import ScoreOptions
    from extractive_lens.weight_diff import WeightDiff

CONTEXTS = ("base", "finetuned_late")


def needs(options: ScoreOptions) -> set[str]:
    # the authors' code takes ŷ' from the finetuned model's own run, the paper at base activations
    return {"finetuned_grad"} if options.authors else {"upstream_grads"}


def capture(options: ScoreOptions) -> tuple[str, ...]:
    return ()


def linear(chunk: LinearChunk) -> Tensor:
    swept = chunk.swept.get("upstream")
    if swept is not None:  # computed boundary by boundary in the sweep's backward pass
        return swept
    model, base = chunk.model, chunk.base
    has_mlp = B.has_mlp(model)
    out = chunk.new_scores()
    for layer in range(model.cfg.n_layers):
        if chunk.options.authors:
            assert chunk.ft is not None
            g_attn, W_O = chunk.ft.g_attn[layer], chunk.ft.W_O[layer]
            g_mlp = chunk.ft.g_mlp[layer] if has_mlp else None
        else:
            assert chunk.gp_attn is not None and chunk.gp_mlp is not None
            g_attn, W_O = chunk.gp_attn[layer], base.W_O[layer]
            g_mlp = chunk.gp_mlp[layer] if has_mlp else None
        _boundary(chunk, layer, "attn", g_attn, out, W_O)
        if g_mlp is not None:
            _boundary(chunk, layer, "mlp", g_mlp, out)
    return out


def layer_linear(chunk: LinearChunk, step: LayerStep, out: Tensor) -> None:
    """The sweep's backward step: the scores of the boundary whose ``ŷ'`` it reached."""
    if step.g is not None:
        assert step.part is not None
        _boundary(chunk, step.layer, step.part, step.g, out)


def _boundary(
    chunk: LinearChunk, layer: int, part: str, g: Tensor, out: Tensor, W_O: Tensor | None = None
) -> None:
    """One boundary's upstream scores into ``out``: ``g`` is ``ŷ'`` there (``dR/d attn_out``
    of the heads of ``layer``, read per head through ``W_O``, default the base run's; or
    ``dR/d mlp_out``), ``y*`` formed for this layer alone. The sweep calls it as each
    boundary's gradient arrives, so that no layer's ``ŷ'`` is kept."""
    base, H = chunk.base, chunk.model.cfg.n_heads
    assert chunk.table is not None
    z_star, m_star = chunk.table.for_rows(chunk.rows, chunk.batch, base, slice(layer, layer + 1))
    with torch.no_grad():
        if part == "attn":
            gp_z = head_grad(wide(g), base.W_O[layer] if W_O is None else W_O)
            dz = wide(base.z[layer]) - z_star[:, :, 0]
            out[:, layer, :H] = ((gp_z - chunk.g_z[layer]) * dz).sum(-1).transpose(1, 2)
        else:
            assert m_star is not None
            dm = wide(base.mlp_out[layer]) - m_star[:, :, 0]
            out[:, layer, H] = ((wide(g) - wide(base.g_mlp[layer])) * dm).sum(-1)


def upstream_gradients(
    model: Any, diff: WeightDiff, chunk: PromptBatch, base: Run, reward_fn: Reward,
    group: int | None = None,
) -> tuple[list[Tensor], list[Tensor]]:  # fmt: skip
    """``ŷ'`` at every layer boundary: ``dR/dy_c`` with ``W_late`` finetuned, at base activations.

    Call inside ``B.shifted(model, diff)`` (the finetuned weights supplied, never written);
    ``base`` is the cached base run.

    The base residual stream enters the finetuned model right after each component (heads of
    layer l: where they re-enter, with ``b_O'``; MLP l: after the MLP) as extra rows of one
    growing batch; one backward gives every boundary's gradient. ``group`` bounds how many
    boundaries share a pass (memory). Where gradients go one layer at a time (``layerwise``)
    the engine runs ``sweep`` instead.
    """
    L, has_mlp = model.cfg.n_layers, B.has_mlp(model)
    parts = ("attn", "mlp") if has_mlp else ("attn",)
    boundaries = [(layer, part) for layer in range(L) for part in parts]
    group = group or len(boundaries)
    grads: dict[tuple[int, str], Tensor] = {}
    for g0 in range(0, len(boundaries), group):
        todo = set(boundaries[g0 : g0 + group])
        entries: list[Tensor] = []

        def inject(layer: int, part: str, x: Tensor | None) -> Tensor | None:
            if (layer, part) not in todo:
                return x
            e = passes.entry(model, diff, base, layer, part)[0].detach().requires_grad_(True)
            entries.append(e)
            return e if x is None else torch.cat([x, e])

        with B.frozen_parameters(model), torch.enable_grad():
            first = boundaries[g0][0]
            rows = B.run_blocks(model, None, start=(first, "pre"), inject=inject)
            assert rows is not None
            R, _, _ = readout(model, rows, chunk, reward_fn, groups=len(entries))
            got = torch.autograd.grad(R.sum(), entries)
        order = [b for b in boundaries[g0 : g0 + group]]
        for key, g in zip(order, got):
            grads[key] = owned(g)
    return _split(grads, L, has_mlp)


SWEEP_BYTES = 2 * 2**30
"""The most bytes of boundary streams one layer-major sweep keeps (``sweep``: every boundary's
rows at every later layer, for the backward sweep); past it the boundaries are split into
sweeps, each reading the Δ of the layers after its first boundary again."""


def sweep(
    model: Any, diff: WeightDiff, chunk: PromptBatch, base: Run, reward_fn: Reward, *,
    finetuned: bool, upstream: bool, group: int | str | None = "auto",
    on_layer: Callable[[int, LayerRun | None], None] | None = None, record: bool = True,
    on_grad: Callable[[int, str, Tensor], None] | None = None,
) -> tuple[Run | None, list[Tensor], list[Tensor]]:  # fmt: skip
    """The finetuned run and ``ŷ'`` at every boundary, layer by layer: each layer's Δ is read
    once forward and once backward, whatever the depth (the large-model path: ``layerwise``).

    Call inside ``B.shifted(model, diff)``. Forward, without a graph, layer by layer: the
    finetuned run's rows (``finetuned``) and every boundary's rows (``upstream``: the base
    stream entering the finetuned model right after each component, as in
    ``upstream_gradients``) advance together; the rows entering each layer are kept. Then the
    reward of every row, and backward layer by layer (last first), one vector-Jacobian product
    of all the boundaries' rows per layer. ``on_layer(layer, step)`` runs after each layer's
    forward step, while its Δ is loaded, ``step`` the finetuned rows' ``LayerRun`` of that
    layer (``None`` without them): linear's informative forward-mode pass and downstream's
    re-run of the base layer on the finetuned inputs, each layer's scores computed there and
    its inputs dropped (``record=False``: the finetuned run keeps no layer's inputs).
    ``on_grad(layer, part, ŷ')`` receives each boundary's gradient as the backward pass
    reaches it (upstream's scores of that boundary), and then none is kept. The kept streams
    grow with the number of boundaries times the layers after them: ``group`` bounds them as
    ``upstream_gradients``' ``group`` does (``"auto"``: ``SWEEP_BYTES``), each further sweep
    reading the layers after its first boundary again.

    Returns ``(finetuned run or None, ŷ' at the heads' boundaries, at the MLPs')`` (no
    gradients with ``on_grad``); the finetuned run records its reward, the final stream read
    and, with ``record``, what downstream reads of it: each layer's input (``pre``) and its
    MLP's (``mlp_in``).
    """
    L, has_mlp = model.cfg.n_layers, B.has_mlp(model)
    parts = ("attn", "mlp") if has_mlp else ("attn",)
    boundaries = [(layer, part) for layer in range(L) for part in parts] if upstream else []
    grads: dict[tuple[int, str], Tensor] = {}
    ft = None
    with B.frozen_parameters(model):
        for i, todo in enumerate(_sweeps(model, chunk, boundaries, group) or [[]]):
            first = i == 0
            run = _one_sweep(model, diff, chunk, base, reward_fn, todo, finetuned and first,
                             on_layer if first else None, record, on_grad, grads)  # fmt: skip
            ft = run if first else ft
    if not upstream or on_grad is not None:
        return ft, [], []
    gp_attn, gp_mlp = _split(grads, L, has_mlp)
    return ft, gp_attn, gp_mlp


def _sweeps(model: Any, chunk: PromptBatch, boundaries: list[tuple[int, str]],
            group: int | str | None) -> list[list[tuple[int, str]]]:  # fmt: skip
    """The boundaries split into sweeps: ``group`` per sweep, all (``None``), or as many as
    keep each sweep's streams under ``SWEEP_BYTES`` (``"auto"``; at least one)."""
    if isinstance(group, int):
        return [boundaries[i : i + group] for i in range(0, len(boundaries), group)]
    if group is None:
        return [boundaries] if boundaries else []
    L = model.cfg.n_layers
    from extractive_lens.backend import compute

    dtype = compute.compute_dtype() or model.cfg.dtype
    item = torch.empty(0, dtype=torch.promote_types(dtype, torch.float32)).element_size()
    block = len(chunk) * chunk.n_pos * sizing(model).cfg.d_model * item
    # a boundary's rows enter every later layer
    return passes.packs(boundaries, lambda b: (L - 1 - b[0]) * block, SWEEP_BYTES)


def _one_sweep(
    model: Any, diff: WeightDiff, chunk: PromptBatch, base: Run, reward_fn: Reward,
    todo: list[tuple[int, str]], finetuned: bool,
    on_layer: Callable[[int, LayerRun | None], None] | None, record: bool,
    on_grad: Callable[[int, str, Tensor], None] | None, grads: dict[tuple[int, str], Tensor],
) -> Run | None:  # fmt: skip
    """One sweep (``sweep``): the finetuned run's rows if ``finetuned``, the boundaries
    ``todo``; their gradients to ``on_grad``, else into ``grads``."""
    L, b = model.cfg.n_layers, len(chunk)
    wanted = set(todo)
    entries: dict[tuple[int, str], Tensor] = {}
    order: list[tuple[int, str]] = []
    kept: dict[int, Tensor | None] = {}  # the boundaries' rows entering each layer
    run = Run() if finetuned else None
    lead = b if finetuned else 0
    ft_step: list[LayerRun] = []  # the finetuned rows' step of the layer running

    def inject(layer: int, part: str, x: Tensor | None) -> Tensor | None:
        if (layer, part) not in wanted:
            return x
        e = passes.entry(model, diff, base, layer, part)[0]
        entries[(layer, part)] = e
        order.append((layer, part))
        return e if x is None else torch.cat([x, e])

    def observe(step: LayerRun) -> None:  # the finetuned rows: what the kinds read of them
        assert run is not None
        ft_step.append(step)
        if not record:
            return
        # the inputs downstream re-runs the finetuned layers on, not all forward_run records
        # (four streams per layer fewer); copies: a view would keep the layer's other rows
        run.pre.append(step.pre[:b].clone())
        if step.mlp_in is not None:
            run.mlp_in.append(step.mlp_in[:b].clone())

    start = 0 if finetuned or not todo else todo[0][0]
    rows = sweep_rows(chunk)
    with torch.no_grad():
        x = B.embed(model, chunk.tokens.to(model.cfg.device)) if finetuned else None
        for layer in range(start, L):
            kept[layer] = None if x is None or x.shape[0] == lead else x[lead:].clone()
            # the finetuned rows (recorded), then the boundaries' rows a block at a time: the
            # layer's working set is that of ``rows`` rows however many boundaries came before
            parts: list[Any] = [] if x is None or lead == 0 else [
                B.run_blocks(model, x[:lead], start=(layer, "pre"), stop=layer + 1,
                             observe=observe)]  # fmt: skip
            if x is not None and x.shape[0] > lead:
                parts.append(through(model, x[lead:], (layer, "pre"), rows))
            for part in ("attn", "mlp"):  # the boundaries entering here, in run_blocks' order
                if (layer, part) in wanted:
                    e = inject(layer, part, None)
                    assert e is not None
                    where = passes.boundary(model, part)
                    parts.append(e if where == "post" else through(model, e, (layer, where), None))
            x = torch.cat(parts) if len(parts) > 1 else (parts[0] if parts else None)
            if on_layer is not None:
                on_layer(layer, ft_step[0] if ft_step else None)
            ft_step.clear()
    assert x is not None
    groups = x.shape[0] // b
    with torch.enable_grad():
        xf = x.detach().requires_grad_(bool(order))
        R, logits, x_read = readout(model, xf, chunk, reward_fn, groups=groups)
        g = torch.autograd.grad(R.sum(), [xf])[0][lead:] if order else None
    if run is not None:  # copies: a view would keep every row's stream (a custom reward's)
        run.W_O = LayerW_O(model, shift.for_model(model))
        run.reward, run.post_final = R[:b].detach().clone(), x_read[:b].detach().clone()
    # every row's final stream (2L + 1 copies of the batch; the graph's outputs hold it too):
    # the backward pass through the layers runs without it
    del x, xf, R, logits, x_read
    for layer in reversed(range(start, L)):
        if g is None:
            break
        here = [k for k in order if k[0] == layer]
        g, got = _layer_back(model, kept[layer], layer, [entries[k] for k in here], here, g, rows)
        kept[layer] = None
        for key, gk in zip(here, got):
            if on_grad is None:
                grads[key] = gk
            else:
                on_grad(*key, gk)
    return run


def sweep_rows(chunk: PromptBatch) -> int:
    """Rows per block of a sweep's layer step: ``runs.BLOCK_TOKENS`` tokens, whole copies of
    the chunk's prompts (at least one copy), so that a layer's working set does not grow with
    the number of boundaries before it (with the depth)."""
    return block_rows(chunk.n_pos, len(chunk))


def _layer_back(
    model: Any, x: Tensor | None, layer: int, es: list[Tensor], keys: list[tuple[int, str]],
    g_out: Tensor, rows: int,
) -> tuple[Tensor | None, list[Tensor]]:  # fmt: skip
    """One layer of a sweep's backward pass: the layer re-run on the rows entering it (``x``,
    ``rows`` at a time) and on those injected in it (``es`` at ``keys``, from where they
    entered), and ``g_out`` carried back to both. The rows of ``g_out`` are ``x``'s, then each
    injected block's in order (``run_blocks``' ``inject``)."""
    n = 0 if x is None else x.shape[0]
    gx = None if x is None else back(model, x, (layer, "pre"), g_out[:n], rows)
    got = []
    for e, (l, part) in zip(es, keys):
        ge, n = g_out[n : n + e.shape[0]], n + e.shape[0]
        where = passes.boundary(model, part)
        got.append(owned(ge if where == "post" else back(model, e, (l, where), ge, None)))
    return gx, got


def owned(g: Tensor) -> Tensor:
    """``g`` in storage of its own. The gradient of a row block ``torch.cat`` joined is a view
    of the whole gradient: kept as it is, each boundary's ``ŷ'`` would hold every row of its
    layer (memory growing with the square of the depth)."""
    return g if g.untyped_storage().nbytes() == g.nbytes else g.clone()


def _split(grads: dict[tuple[int, str], Tensor], L: int, has_mlp: bool
           ) -> tuple[list[Tensor], list[Tensor]]:  # fmt: skip
    gp_attn = [grads[(layer, "attn")] for layer in range(L)]
    gp_mlp = [grads[(layer, "mlp")] for layer in range(L)] if has_mlp else []
    return gp_attn, gp_mlp


def patch_values(chunk: CausalChunk, layer: int) -> tuple[Tensor, Tensor | None]:
    base, table = chunk.base, chunk.table
    assert table is not None
    z_star, m_star = chunk.cached("y_star", lambda: table.for_rows(chunk.rows, chunk.batch, base))
    with torch.no_grad():
        dh = head_out(z_star[:, :, layer] - wide(base.z[layer]), base.W_O[layer])
        dm = None if m_star is None else m_star[:, :, layer] - wide(base.mlp_out[layer])
    return dh, dm


def exact(effects: dict[str, Any]) -> Any:
    """``[R_late(W) - R_late(patched)] - [R(W) - R(patched)]``, effects being patched - unpatched."""
    return effects["base"] - effects["finetuned_late"]

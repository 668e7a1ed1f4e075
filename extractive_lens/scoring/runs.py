"""Cached runs and the reward readout, shared by the linear and exact engines.

Notation follows docs/scores.md §4–5. A head's output ``y_h = z_h W_O[h]``; its gradient
``ŷ_h = dR/d(attn_out)`` is shared by every head of the layer, so head quantities are kept in
``hook_z`` space: ``<ŷ, Δy_h> = <ŷ W_O[h]^T, Δz_h>`` when ``W_O`` is fixed.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from extractive_lens import backend as B
from extractive_lens.backend import LayerRun, shift
from extractive_lens.batch import PromptBatch
from extractive_lens.rewards import Reward, reads_answer_positions_only


@dataclass
class Run:
    """One forward pass with every quantity the scores read, per layer (detached)."""

    pre: list[Tensor] = field(default_factory=list)  # resid_pre
    mid: list[Tensor] = field(default_factory=list)  # resid_mid (= resid_pre + attn_out)
    post: list[Tensor] = field(default_factory=list)  # resid_post
    mlp_in: list[Tensor] = field(default_factory=list)  # what the MLP reads
    z: list[Tensor] = field(default_factory=list)  # [batch pos head d_head]
    mlp_out: list[Tensor] = field(default_factory=list)
    captured: list[dict[str, Tensor]] = field(default_factory=list)
    W_O: Sequence[Tensor] = ()  # per layer, formed when read (LayerW_O)
    reward: Tensor | None = None
    # gradients of sum(R), when requested
    g_attn: list[Tensor] = field(default_factory=list)
    g_mlp: list[Tensor] = field(default_factory=list)
    g_captured: list[dict[str, Tensor]] = field(default_factory=list)
    g_embed: Tensor | None = None
    g_logits: Tensor | None = None
    logits: Tensor | None = None
    post_final: Tensor | None = None


def forward_run(
    model: Any,
    batch: PromptBatch,
    reward_fn: Reward | None = None,
    *,
    grad: bool = False,
    capture: tuple[str, ...] = ("z",),
    keep_logits: bool = False,
) -> Run:
    """Run ``model`` on ``batch``, caching the residual stream at every boundary.

    With ``grad=True`` also returns ``dR/d attn_out``, ``dR/d mlp_out`` (and the captured hook
    values', the embedding's and the logits') gradients; weights never get ``.grad`` buffers.
    """
    run = Run()
    live: list[LayerRun] = []

    def observe(step: LayerRun) -> None:
        live.append(step)
        run.pre.append(step.pre.detach())
        run.mid.append(step.mid.detach())
        if step.mlp_out is not None:
            run.mlp_in.append(step.mlp_in.detach())  # type: ignore[union-attr]
            run.mlp_out.append(step.mlp_out.detach())
        run.post.append(step.post.detach())
        run.z.append(step.captured["z"].detach())
        run.captured.append({k: v.detach() for k, v in step.captured.items()})

    tokens = batch.tokens.to(model.cfg.device)
    capture = capture if "z" in capture else ("z", *capture)
    run.W_O = LayerW_O(model, shift.for_model(model))
    if grad and reward_fn is not None and layerwise(model, batch):
        return _layerwise_run(model, batch, reward_fn, capture, run, observe, tokens)
    with B.frozen_parameters(model), torch.set_grad_enabled(grad):
        x0 = B.embed(model, tokens).detach()
        if grad:
            x0.requires_grad_(True)
        x = B.run_blocks(model, x0, capture=capture, observe=observe)
        assert x is not None
        run.post_final = x.detach()
        if keep_logits:
            run.logits = B.unembed(model, x).detach()
        if reward_fn is None:
            return run
        R, logits, x_read = readout(model, x, batch, reward_fn)
        run.post_final = x_read.detach()
        run.reward = R.detach()
        if grad:
            _gradients(run, R, reward_fn, x0, logits, live, capture)
    return run


LAYERWISE_BYTES = 512 * 2**20
"""Past this estimate of what a backward pass through the whole model would keep (activations
and the compute-dtype weight copies its matmuls save), gradients are taken one layer at a time
(``layerwise``)."""


_SIZED_AS: contextvars.ContextVar[Any] = contextvars.ContextVar(
    "extractive_lens_sized_as", default=None
)


@contextlib.contextmanager
def sized_as(model: Any) -> Iterator[None]:
    """Inside the block, the choices made by size (``layerwise``, the upstream group) are made
    as for ``model``: ``estimate`` runs a narrow copy that must take the real model's paths."""
    token = _SIZED_AS.set(model)
    try:
        yield
    finally:
        _SIZED_AS.reset(token)


def sizing(model: Any) -> Any:
    """The model whose sizes the size-based choices read (``sized_as``; else ``model``)."""
    return _SIZED_AS.get() or model


def layerwise(model: Any, batch: PromptBatch | int, n_pos: int | None = None) -> bool:
    """Whether gradients through ``model`` on ``batch`` are taken one layer at a time: a forward
    pass without a graph that keeps only the stream at each layer boundary, then per layer (last
    first) the layer re-run with a graph and one vector-Jacobian product. The working set is one
    layer's activations instead of every layer's, for a second forward pass's time."""
    model = sizing(model)
    cfg = model.cfg
    rows = batch if isinstance(batch, int) else len(batch)
    pos = n_pos if n_pos is not None else batch.n_pos  # type: ignore[union-attr]
    per_layer = rows * pos * (cfg.d_model * 12 + (cfg.d_mlp or 0) * 5) * 4  # activations kept
    # A whole-graph backward also keeps, per layer, the float32 weights its matmuls saved where
    # a reshaped copy is saved instead of the stored tensor (attention's einsums): about one
    # layer of weights in the compute dtype. Small batches on wide models are dominated by it
    # (an 8B layer: 0.87 GB), so it is counted too: memory then does not grow with depth.
    per_layer += B.layer_parameter_count(model) * 4
    return per_layer * cfg.n_layers > LAYERWISE_BYTES


class LayerW_O(Sequence[Tensor]):
    """Per layer, the heads' output weights of a run (``W_O + α·ΔW_O`` for a run of a shifted
    model), formed when read rather than kept for every layer."""

    def __init__(self, model: Any, s: Any) -> None:
        self.model, self.shift = model, s

    def __len__(self) -> int:
        return int(self.model.cfg.n_layers)

    def __getitem__(self, layer: int) -> Tensor:  # type: ignore[override]
        if not 0 <= layer < len(self):
            raise IndexError(layer)
        with shift.unshifted(self.model), shift.within(self.shift):
            return B.W_O(self.model, layer).detach()

    def __iter__(self) -> Iterator[Tensor]:
        return (self[layer] for layer in range(len(self)))


class HeadGrads(Sequence[Tensor]):
    """Per layer, ``ŷ_h W_O[h]^T`` of a run with gradients (``head_grad`` of its ``g_attn``
    and ``W_O``: R's gradient at ``hook_z``), formed when read rather than kept for every
    layer (one ``[batch, pos, d_model]`` stream per layer fewer)."""

    def __init__(self, run: Run) -> None:
        self.run = run

    def __len__(self) -> int:
        return len(self.run.g_attn)

    def __getitem__(self, layer: int) -> Tensor:  # type: ignore[override]
        if not 0 <= layer < len(self):
            raise IndexError(layer)
        return head_grad(wide(self.run.g_attn[layer]), self.run.W_O[layer])

    def __iter__(self) -> Iterator[Tensor]:
        return (self[layer] for layer in range(len(self)))


def _layerwise_run(
    model: Any, batch: PromptBatch, reward_fn: Reward, capture: tuple[str, ...], run: Run,
    observe: Any, tokens: Tensor,
) -> Run:  # fmt: skip
    """``forward_run(grad=True)`` one layer at a time (``layerwise``): the same numbers."""
    with B.frozen_parameters(model):
        with torch.no_grad():
            x0 = B.embed(model, tokens)
            x = B.run_blocks(model, x0, capture=capture, observe=observe)
        assert x is not None
        with torch.enable_grad():
            xf = x.detach().requires_grad_(True)
            R, logits, x_read = readout(model, xf, batch, reward_fn)
            if not R.requires_grad:
                _gradients(run, R, reward_fn, xf, logits, [], capture)  # raises the reward error
            g, run.g_logits = torch.autograd.grad(R.sum(), [xf, logits])
        run.post_final, run.reward = x_read.detach(), R.detach()
        names = [n for n in capture if n != "z"]
        L = model.cfg.n_layers
        run.g_attn, run.g_mlp = [None] * L, [None] * L  # type: ignore[list-item]
        run.g_captured = [{} for _ in range(L)]
        for layer in reversed(range(L)):
            g, step = layer_vjp(model, run.pre[layer], (layer, "pre"), g, capture)
            assert step is not None
            run.g_attn[layer] = step.attn_out
            run.g_mlp[layer] = step.mlp_out  # type: ignore[assignment]
            run.g_captured[layer] = {n: step.captured[n] for n in names}
        if not B.has_mlp(model):
            run.g_mlp = []
        run.g_embed = g
    return run


def layer_vjp(
    model: Any, x: Tensor, start: tuple[int, Any], g_out: Tensor, capture: tuple[str, ...] = (),
    live: list[LayerRun] | None = None,
) -> tuple[Tensor, LayerRun | None]:  # fmt: skip
    """One layer's vector-Jacobian product: the layer (from boundary ``start``, ``"pre"`` or
    ``"mid"``, to the stream after it) re-run on ``x`` with a graph, and the gradient ``g_out``
    at its output carried back to ``x``. Returns ``(dR/dx, grads)``: for a ``"pre"`` start,
    ``grads`` is a ``LayerRun`` holding the gradients at the layer's ``attn_out``, ``mlp_out``
    and captured hook values (zeros where nothing flows). ``live``: the re-run's own
    ``LayerRun`` (its values) is appended there."""
    live = [] if live is None else live
    seen = len(live)
    with torch.enable_grad():
        xin = x.detach().requires_grad_(True)
        y = B.run_blocks(model, xin, start=start, stop=start[0] + 1, capture=capture,
                         observe=live.append)  # fmt: skip
        assert y is not None
        if len(live) == seen:
            (gx,) = torch.autograd.grad(y, [xin], g_out)
            return gx, None
        step = live[seen]
        names = [n for n in capture if n != "z"]
        inputs = [xin, step.attn_out]
        if step.mlp_out is not None:
            inputs.append(step.mlp_out)
        inputs += [step.captured[n] for n in names]
        got = torch.autograd.grad(y, inputs, g_out, allow_unused=True)
    got = tuple(torch.zeros_like(i) if gi is None else gi for gi, i in zip(got, inputs))
    k = 3 if step.mlp_out is not None else 2
    grads = LayerRun(step.layer, got[0], got[1], dict(zip(names, got[k:])), got[0],
                     None, got[2] if k == 3 else None, got[0])  # fmt: skip
    return got[0], grads


def grad_at(
    model: Any, x: Tensor, start: tuple[int, Any], batch: PromptBatch, reward_fn: Reward,
    groups: int = 1,
) -> Tensor:  # fmt: skip
    """``dR/dx`` for the stream ``x`` at boundary ``start`` (``groups`` stacked copies of
    ``batch``), one layer at a time: a forward pass without a graph from ``start`` to the reward,
    then ``layer_vjp`` back through each layer. Each layer runs ``block_rows`` rows at a time
    (rows are independent sequences), forward and backward: its working set does not grow
    with the number of rows stacked."""
    layer, where = start
    r = block_rows(x.shape[1])
    segments: list[tuple[tuple[int, Any], Tensor]] = []
    with torch.no_grad():
        if where != "post":
            segments.append((start, x))
            x = through(model, x, start, r)
        for l in range(layer + 1, model.cfg.n_layers):
            segments.append(((l, "pre"), x))
            x = through(model, x, (l, "pre"), r)
    with torch.enable_grad():
        xr = x.detach().requires_grad_(True)
        R, _, _ = readout(model, xr, batch, reward_fn, groups=groups)
        (g,) = torch.autograd.grad(R.sum(), [xr])
    for seg_start, seg_x in reversed(segments):
        g = back(model, seg_x, seg_start, g, r)
    return g


def through(
    model: Any, x: Tensor, at: tuple[int, Any], rows: int | None,
    past_kv: Mapping[int, tuple[Tensor, Tensor]] | None = None, read_pos: Tensor | None = None,
) -> Tensor:  # fmt: skip
    """``x`` from boundary ``at`` (``"pre"`` or ``"mid"``) to the end of its layer, ``rows``
    rows at a time (``None``: all at once). Rows are independent sequences, so the numbers are
    those of one call; a block's working set (an 8B MLP's hidden activations: 230 KB a token in
    float32) is bounded by ``rows`` however many rows there are. ``past_kv`` (this layer's keys
    and values of earlier positions, per row) and ``read_pos`` (``run_blocks``' positions read
    after the last layer) are split with the rows."""
    layer = at[0]
    kv = None if past_kv is None or at[1] != "pre" else past_kv[layer]
    n = x.shape[0]
    rows = n if rows is None else max(1, rows)
    out = []
    for i in range(0, n, rows):
        kv_i = None if kv is None else {layer: (kv[0][i : i + rows], kv[1][i : i + rows])}
        pos_i = None if read_pos is None else read_pos[i : i + rows]
        out.append(B.run_blocks(model, x[i : i + rows], start=at, stop=layer + 1, past_kv=kv_i,
                                read_pos=pos_i))  # fmt: skip
    return torch.cat(out) if len(out) > 1 else out[0]  # type: ignore[arg-type,return-value]


def back(model: Any, x: Tensor, at: tuple[int, Any], g: Tensor, rows: int | None) -> Tensor:
    """``dR/dx``: the gradient ``g`` at the end of ``x``'s layer carried back to boundary
    ``at``, ``rows`` rows at a time (``layer_vjp`` of each block, as ``through`` ran them)."""
    rows = x.shape[0] if rows is None else max(1, rows)
    parts = [layer_vjp(model, xb, at, gb)[0] for xb, gb in zip(x.split(rows), g.split(rows))]
    return torch.cat(parts) if len(parts) > 1 else parts[0]


BLOCK_TOKENS = 256
"""Tokens a layer-at-a-time pass runs through a layer at once where it stacks many copies of a
batch (``grad_at``, ``passes.layer_major``): the rows are split into blocks
of about this many tokens, so that a layer's working set does not grow with the number of
rows stacked (integrated paths, boundaries: with the depth)."""


def block_rows(n_pos: int, rows: int = 1) -> int:
    """Rows per block of ``n_pos`` positions: ``BLOCK_TOKENS`` tokens, in whole multiples of
    ``rows`` (one copy of a batch), at least one multiple."""
    return rows * max(1, BLOCK_TOKENS // (rows * n_pos))


def _gradients(
    run: Run, R: Tensor, reward_fn: Reward, x0: Tensor, logits: Tensor, live: list[LayerRun],
    capture: tuple[str, ...],
) -> None:  # fmt: skip
    """``run.g_*``: gradients of ``sum(R)`` at the embedding, logits and each layer's outputs."""
    if not R.requires_grad:
        raise ValueError(
            f"{getattr(reward_fn, '__name__', 'the reward')} is not differentiable in the logits "
            "(its output has no gradient): linear scores need a reward built from torch "
            "operations on the logits, without .detach(), argmax or Python numbers."
        )
    names = [n for n in capture if n != "z"]
    mlps = [s.mlp_out for s in live if s.mlp_out is not None]
    inputs = [x0, logits, *(s.attn_out for s in live), *mlps]
    inputs += [s.captured[n] for s in live for n in names]
    grads = torch.autograd.grad(R.sum(), inputs, allow_unused=True)
    grads = tuple(torch.zeros_like(i) if g is None else g for g, i in zip(grads, inputs))
    L = len(live)
    run.g_embed, run.g_logits = grads[0], grads[1]
    run.g_attn = list(grads[2 : 2 + L])
    run.g_mlp = list(grads[2 + L : 2 + L + len(mlps)])
    rest = grads[2 + L + len(mlps) :]
    run.g_captured = [{n: rest[i * len(names) + j] for j, n in enumerate(names)} for i in range(L)]


@dataclass(frozen=True)
class AnswerRows:
    """The rows of a batch as the built-in rewards read them: answers, candidates and where the
    prompt ends. ``at_answers()`` is the same rows for logits already gathered at the answer
    positions (the prompt's last position is then 0)."""

    answer_targets: Tensor
    candidates: Tensor | None
    counterfactual: Tensor | None
    last_prompt_pos: Tensor
    lengths: Tensor

    @classmethod
    def of(cls, batch: PromptBatch | AnswerRows, index: Tensor | None = None) -> AnswerRows:
        """The rows ``index`` (repeats allowed; all when ``None``) of a batch."""

        def pick(t: Tensor | None) -> Tensor | None:
            return None if t is None or index is None else t[index.to(t.device)]

        if index is None:
            return cls(batch.answer_targets, batch.candidates, batch.counterfactual,
                       batch.last_prompt_pos, batch.lengths)  # fmt: skip
        return cls(pick(batch.answer_targets), pick(batch.candidates), pick(batch.counterfactual),  # type: ignore[arg-type]
                   pick(batch.last_prompt_pos), pick(batch.lengths))  # type: ignore[arg-type]  # fmt: skip

    def __len__(self) -> int:
        return self.answer_targets.shape[0]

    @property
    def answer_first(self) -> Tensor:
        return self.answer_targets[:, 0]

    def at_answers(self) -> AnswerRows:
        zero = torch.zeros_like(self.last_prompt_pos)
        return AnswerRows(self.answer_targets, self.candidates, self.counterfactual, zero,
                          zero + self.answer_targets.shape[1])  # fmt: skip

    def read_positions(self, offset: int = 0) -> Tensor:
        """``[rows, K]``: the positions the built-in rewards read, minus ``offset``."""
        K = self.answer_targets.shape[1]
        dev = self.lengths.device
        pos = self.last_prompt_pos.to(dev)[:, None] + torch.arange(K, device=dev)[None, :] - offset
        return torch.minimum(pos, self.lengths[:, None] - 1 - offset)


def readout(
    model: Any,
    resid: Tensor,
    batch: PromptBatch | AnswerRows,
    reward_fn: Reward,
    groups: int = 1,
    offset: int = 0,
    gathered: bool = False,
) -> tuple[Tensor, Tensor, Tensor]:
    """``(R, logits, resid_read)`` from the final residual stream of ``groups`` stacked copies of
    ``batch``. Built-in rewards read only the answer positions, so only those are unembedded
    (``resid_read`` is the gathered stream); custom rewards get the full logits.
    ``offset``: ``resid`` holds positions ``offset ..`` only; ``gathered``: ``resid`` already
    holds just the read positions (built-in rewards only)."""
    b = len(batch)
    view: Any
    if reads_answer_positions_only(reward_fn):
        rows = AnswerRows.of(batch)
        if not gathered:
            pos = rows.read_positions(offset).to(resid.device).repeat(groups, 1)
            resid = resid.gather(1, pos[..., None].expand(-1, -1, resid.shape[-1]))
        view = rows.at_answers()
    else:
        if offset or not isinstance(batch, PromptBatch):
            raise ValueError("A custom reward reads the full logits: resume from position 0.")
        view = batch
    logits = B.unembed(model, resid)
    R = torch.cat(
        [
            check_reward_output(reward_fn(logits[g * b : (g + 1) * b], view), b, reward_fn)
            for g in range(groups)
        ]
    )
    return R, logits, resid


def check_reward_output(R: Any, n: int, reward_fn: Any) -> Tensor:
    """A reward must return one finite float per prompt: ``Tensor[batch]``."""
    name = getattr(reward_fn, "__name__", "the reward")
    if not isinstance(R, Tensor):
        raise TypeError(
            f"{name} returned {type(R).__name__}; a reward must return a float Tensor of shape "
            f"[batch] ([{n}] here), one value per prompt."
        )
    if R.shape != (n,):
        raise ValueError(
            f"{name} returned shape {tuple(R.shape)}; a reward must return one value per prompt, "
            f"shape [batch] = [{n}] (reduce over answer tokens or classes inside the reward)."
        )
    if not R.is_floating_point():
        raise TypeError(
            f"{name} returned dtype {R.dtype}; a reward must return floats (e.g. log-probabilities)."
        )
    if not torch.isfinite(R).all():
        bad = torch.nonzero(~torch.isfinite(R)).flatten().tolist()
        raise ValueError(
            f"{name} returned NaN or inf for prompts {bad}; check the reward (a log of 0, a "
            "division by 0) and the answers."
        )
    return R


def head_grad(g_attn: Tensor, W_O: Tensor) -> Tensor:
    """``ŷ_h W_O[h]^T``: the gradient of R at ``hook_z`` from the gradient at ``attn_out``."""
    return torch.einsum("bpd,hed->bphe", g_attn, W_O.to(g_attn.dtype))


def head_out(z: Tensor, W_O: Tensor) -> Tensor:
    """Each head's write ``z_h W_O[h]``: ``[batch pos head d_model]`` (one layer at a time)."""
    return torch.einsum("bphe,hed->bphd", wide(z), W_O.to(wide(z).dtype))


def wide(x: Tensor) -> Tensor:
    """Upcast to float32 at least, for differences of nearly equal things."""
    return x.to(torch.promote_types(x.dtype, torch.float32))

"""What scoring keeps and moves (issue 41): the layer-at-a-time decision and the Δ traffic counter.

The counter is checked against the diff's own tensors (summed here, not by the code under test),
and the decision against the two parts of what a whole-graph backward keeps.
"""

from __future__ import annotations

import pytest
import torch

import extractive_lens as el
from extractive_lens import backend as B
from extractive_lens.backend import shift
from extractive_lens.scoring import runs
from extractive_lens.scoring.methods import METHODS

CFG = dict(
    n_layers=3, d_model=32, n_heads=4, d_head=8, d_mlp=64, d_vocab=50, n_ctx=16,
    act_fn="gelu", normalization_type="LN",
)  # fmt: skip


def _random_diff(model, seed: int):
    """Δ of a copy of ``model`` whose stored weights moved by 1e-3 (a bridge's TransformerLens
    view shows zeros for biases the wrapped model lacks: those stay unchanged)."""
    import copy

    ft = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in ft.parameters():
            p.add_(1e-3 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    full = el.WeightDiff.from_models(model, ft)
    # weight matrices only: a native TransformerLens 4 bridge built by tiny_model shows a zero
    # MLP bias it does not store, and its large-model path refuses a change there
    return el.WeightDiff({n: d for n, d in full.deltas.items() if d.ndim >= 2}, full.signature)


@pytest.fixture(scope="module")
def setting():
    torch.set_num_threads(1)
    model = el.tiny_model(CFG, seed=0)
    diff = _random_diff(model, 3)
    batch = el.make_batch(model, [([1, 2, 3, 4], [5]), ([2, 3, 4, 6], [7])], candidates=[5, 7])
    return model, diff, batch


def _delta_bytes(diff, names=None) -> int:
    return sum(
        t.numel() * t.element_size() for n, t in diff.deltas.items() if names is None or n in names
    )


def test_layer_at_a_time_counts_the_weights_a_whole_graph_backward_keeps(setting, monkeypatch):
    model, _, batch = setting
    rows, pos = len(batch), batch.n_pos
    cfg = model.cfg
    activations = rows * pos * (cfg.d_model * 12 + cfg.d_mlp * 5) * 4 * cfg.n_layers
    weights = sum(p.numel() for p in model.blocks[0].parameters()) * 4 * cfg.n_layers
    assert weights > activations  # a wide model on a small batch: the weights dominate
    monkeypatch.setattr(runs, "LAYERWISE_BYTES", activations + weights // 2)
    assert runs.layerwise(model, batch)  # activations alone would say "whole graph"
    monkeypatch.setattr(runs, "LAYERWISE_BYTES", activations + weights + 1)
    assert not runs.layerwise(model, batch)


def test_traffic_counts_each_layer_of_delta_once_per_load(setting):
    model, diff, batch = setting
    with shift.counting() as moved, shift.shifted(model, diff):
        B.unembed(model, B.run_blocks(model, B.embed(model, batch.tokens)))
    assert moved.bytes == _delta_bytes(diff)  # every tensor of Δ read once: embed, blocks, unembed
    assert moved.loads == model.cfg.n_layers + 2
    with shift.counting() as none:
        B.unembed(model, B.run_blocks(model, B.embed(model, batch.tokens)))
    assert none.bytes == 0 and none.loads == 0  # no shift, nothing read


def test_traffic_of_a_large_model_counts_every_reload(setting, monkeypatch):
    """A model past ``REUSE_BYTES`` holds ``KEEP_LAYERS`` layers of Δ: a second pass reads Δ again."""
    model, diff, batch = setting
    monkeypatch.setattr(shift, "REUSE_BYTES", 0)
    with shift.counting() as moved, shift.shifted(model, diff):
        for _ in range(2):
            B.unembed(model, B.run_blocks(model, B.embed(model, batch.tokens)))
    assert moved.bytes == 2 * _delta_bytes(diff)


@pytest.mark.parametrize(
    "method, options",
    [("linear", {}), ("causal", {"per": "component"}), ("integrated", {"steps": 2})],
)
def test_estimate_counts_the_delta_traffic_of_the_real_call(setting, monkeypatch, method, options):
    """``estimate`` reads the traffic off a narrow copy; here the real call is counted directly."""
    model, diff, batch = setting
    e = el.estimate(model, diff, batch, method, **options)
    monkeypatch.setattr(shift, "REUSE_BYTES", 0)  # the regime the estimate describes
    call = {"linear": el.linear_scores, "causal": el.causal_scores,
            "integrated": el.integrated_scores}[method]  # fmt: skip
    with shift.counting() as moved:
        call(model, diff, batch, show_progress=False, **options)
    assert e.delta_read_bytes == moved.bytes
    assert e.layer_loads == moved.loads
    assert e.delta_bytes == _delta_bytes(diff)
    assert "Δ read" in str(e)


def test_estimate_refuses_an_unknown_method(setting):
    model, diff, batch = setting
    with pytest.raises(ValueError, match="linear, integrated, causal"):
        el.estimate(model, diff, batch, "exact")


def test_estimate_takes_the_real_models_size_choices(monkeypatch):
    """A wide model on which gradients go one layer at a time and upstream one boundary at a
    time, while its narrow copy would take the whole graph and the staircase: the estimate must
    count the real model's traffic, not the copy's."""
    from extractive_lens.budget import _narrow_config
    from extractive_lens.scoring import linear

    cfg = dict(CFG, d_model=64, n_heads=2, d_head=32, d_mlp=256)
    model = el.tiny_model(cfg, seed=1)
    narrow = el.tiny_model(_narrow_config(model), seed=0)
    diff = _random_diff(model, 4)
    batch = el.make_batch(model, [([1, 2, 3, 4], [5]), ([2, 3, 4, 6], [7])], candidates=[5, 7])
    monkeypatch.setattr(runs, "LAYERWISE_BYTES", 200_000)
    monkeypatch.setattr(linear, "UPSTREAM_AUTO_BYTES", 100_000)
    assert runs.layerwise(model, batch) and not runs.layerwise(narrow, batch)
    assert linear._auto_group(model, batch) == 1 and linear._auto_group(narrow, batch) is None
    e = el.estimate(model, diff, batch, "linear")
    monkeypatch.setattr(shift, "REUSE_BYTES", 0)
    with shift.counting() as moved:
        el.linear_scores(model, diff, batch, show_progress=False)
    assert e.layerwise
    assert e.delta_read_bytes == moved.bytes and e.layer_loads == moved.loads


@pytest.mark.parametrize("family", ["ln_gelu", "rms_gated_rotary_gqa", "parallel_rotary"])
def test_integrated_paths_run_a_block_of_rows_at_a_time(family, monkeypatch):
    """The integrated method's upstream and downstream paths stack nodes x components x prompts
    as rows of layer-at-a-time passes (``runs.grad_at``; upstream's finetuned-late paths in
    the layer-major pass, ``passes.layer_major``); each layer runs ``BLOCK_TOKENS`` tokens of the
    paths at a time, forward and backward, so its working set does not grow with the rows
    stacked. Scores (float64) as the whole graph's, and no path's layer step past one block
    (the finetuned run downstream reads, recorded as it runs, is one copy of the prompts)."""
    from tests.conftest import make_pair
    from tests.helpers import small_batch

    base, ft = make_pair(family, torch.float64, n_layers=3)
    diff, batch = el.WeightDiff.from_models(base, ft), small_batch(base)
    kw = dict(kinds=("upstream", "downstream"), steps=3, show_progress=False)
    want = el.integrated_scores(base, diff, batch, **kw)
    monkeypatch.setattr(runs, "LAYERWISE_BYTES", -1)
    monkeypatch.setattr(shift, "REUSE_BYTES", 0)
    monkeypatch.setattr(runs, "BLOCK_TOKENS", 1)  # one row per block
    seen: list[int] = []
    run_blocks, layer_vjp = runs.B.run_blocks, runs.layer_vjp

    def counted(model, x, **kw):
        path_step = kw.get("stop") is not None and kw.get("observe") is None
        if x is not None and torch.is_grad_enabled() is False and path_step:
            seen.append(x.shape[0])
        return run_blocks(model, x, **kw)

    def counted_vjp(model, x, *a, **kw):
        seen.append(x.shape[0])
        return layer_vjp(model, x, *a, **kw)

    monkeypatch.setattr(runs.B, "run_blocks", counted)
    monkeypatch.setattr(runs, "layer_vjp", counted_vjp)
    got = el.integrated_scores(base, diff, batch, **kw)
    torch.testing.assert_close(got.values, want.values, rtol=0, atol=1e-12)
    assert seen and max(seen) == 1  # every layer step of the paths one row


@pytest.mark.parametrize("where", ["pre", "mid", "post"])
def test_grad_at_a_block_at_a_time_is_the_whole_graph_gradient(where, monkeypatch):
    """``runs.grad_at`` from each kind of boundary, one row per block, against autograd through
    the whole rest of the model (float64)."""
    from extractive_lens.scoring.linear import LinearOptions
    from tests.conftest import make_pair
    from tests.helpers import small_batch

    base, _ = make_pair("rms_gated_rotary_gqa", torch.float64, n_layers=3)
    batch = small_batch(base)
    reward = LinearOptions().reward_fn
    x = B.run_blocks(base, B.embed(base, batch.tokens), stop=1).detach()
    x = torch.cat([x, x + 0.01])  # two stacked copies
    start = (1, where) if where != "post" else (0, "post")
    if where == "mid":  # the stream after layer 1's heads
        x = x + B.attention(base, 1, x)[0].detach()
    xin = x.clone().requires_grad_(True)
    R, _, _ = runs.readout(base, B.run_blocks(base, xin, start=start), batch, reward, groups=2)
    (want,) = torch.autograd.grad(R.sum(), [xin])
    monkeypatch.setattr(runs, "BLOCK_TOKENS", 1)
    got = runs.grad_at(base, x, start, batch, reward, groups=2)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


# ------------------------------------------------------------ the counter against a spy (#41)
class _Spy(dict):
    """A diff's tensors by name that sum the bytes of every tensor handed out while ``on``
    (``[]``, ``get``, ``values``, ``items``): an independent count of what scoring read."""

    on = False
    read = 0

    def _seen(self, t):
        if self.on:
            self.read += t.numel() * t.element_size()
        return t

    def __getitem__(self, name):
        return self._seen(super().__getitem__(name))

    def get(self, name, default=None):
        return self[name] if name in self else default

    def values(self):
        return [self[n] for n in self]

    def items(self):
        return [(n, self[n]) for n in self]


def _spied(diff, on_demand: bool):
    """``diff`` with its held tensors behind a ``_Spy``: Δ's own, or for a diff formed on
    demand the finetuned tensors it subtracts the base from."""
    if on_demand:
        diff.deltas.finetuned = _Spy(diff.deltas.finetuned)
        return diff, diff.deltas.finetuned
    spy = _Spy(diff.deltas)
    return el.WeightDiff(spy, diff.signature), spy


_CALLS = {
    "linear": lambda m, d, b, lin: el.linear_scores(m, d, b, show_progress=False),
    "exact per component": lambda m, d, b, lin: el.causal_scores(
        m, d, b, per="component", show_progress=False
    ),
    "exact per token top 2": lambda m, d, b, lin: el.causal_scores(
        m, d, b, top_k=2, linear=lin, show_progress=False
    ),
    "integrated": lambda m, d, b, lin: el.integrated_scores(
        m, d, b, steps=2, top_k=2, linear=lin, show_progress=False
    ),
}


@pytest.fixture(scope="module")
def bf16_pair():
    from tests.conftest import make_pair
    from tests.helpers import small_batch

    torch.set_num_threads(1)
    base, ft = make_pair("ln_gelu", torch.bfloat16, n_layers=3)  # b_O: a boundary's rows read it
    batch = small_batch(base)
    lin = el.linear_scores(base, el.WeightDiff.from_models(base, ft), batch, show_progress=False)
    return base, ft, batch, lin


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("regime", ["whole graph", "layer at a time", "vocabulary by part"])
@pytest.mark.parametrize("on_demand", [False, True], ids=["dense", "on demand"])
@pytest.mark.parametrize("call", list(_CALLS))
def test_traffic_counts_every_read_of_the_diff(bf16_pair, call, on_demand, regime, monkeypatch):
    """In the large-model regime (``REUSE_BYTES = 0``: Δ held two layers at a time) every
    tensor scoring takes from the diff (a layer's load, ``W_O`` and ``b_O`` read on their own,
    the vocabulary's tangents, the norms of a diff formed on demand) is counted once: the
    counter equals the bytes a spy on the diff's tensors saw handed out. For a diff formed on
    demand those are the finetuned bf16 tensors: half the float32 Δ of the dense diff, read
    the same number of times. Vocabulary by part: only the parts of a held Δ move (the spy
    sees the whole tensor), so that regime is checked on the diff formed on demand, whose
    whole finetuned tensor crosses once."""
    from extractive_lens.backend import vocab

    if regime == "vocabulary by part" and not on_demand:
        pytest.skip("a held Δ moves only its parts; the spy sees whole tensors")
    base, ft, batch, lin = bf16_pair
    monkeypatch.setattr(shift, "REUSE_BYTES", 0)
    if regime == "layer at a time":
        monkeypatch.setattr(runs, "LAYERWISE_BYTES", -1)
    if regime == "vocabulary by part":
        monkeypatch.setattr(vocab, "SLICE_BYTES", 0)
        if not vocab.matrices(base):
            pytest.skip("this backend forms the vocabulary matrices whole")
    diff, spy = _spied(el.WeightDiff.from_models(base, ft, on_demand=on_demand), on_demand)
    checks = 0
    if not on_demand:  # where the diff holds Δ, its norms and shapes are read in place
        diff.norms()  # (nothing moves, nothing counted); a scoring call checks the shapes
        spy.on = True
        diff.check_compatible(base)
        checks, spy.read = spy.read, 0
    spy.on = True
    with shift.counting() as moved:
        _CALLS[call](base, diff, batch, lin)
    spy.on = False
    assert moved.bytes == spy.read - checks > 0
    if on_demand and regime != "vocabulary by part":  # the dense diff moves only the parts
        # the same reads as the dense float32 Δ's, at half the bytes (bf16)
        dense = el.WeightDiff.from_models(base, ft)
        fresh = el.WeightDiff.from_models(base, ft, on_demand=True)
        fresh.norms()  # a dense diff reads its norms in place (nothing moves)
        with shift.counting() as wide:
            _CALLS[call](base, dense, batch, lin)
        with shift.counting() as half:
            _CALLS[call](base, fresh, batch, lin)
        assert 2 * half.bytes == wide.bytes
        assert half.by_group == wide.by_group and half.reads == wide.reads


def test_estimate_counts_a_diff_formed_on_demand(setting, monkeypatch):
    """A diff formed on demand: the estimate scales the narrow copy's reads by the finetuned
    tensors' bytes (float32 here: half the float64 Δ) and adds the first call's read for the
    norms and fingerprint; the real first call is counted directly."""
    import copy

    from extractive_lens.backend.lazy import LazyDeltas

    model, diff, batch = setting
    ft = copy.deepcopy(model)
    with torch.no_grad():
        for p in ft.parameters():
            p.add_(1e-3)
    held = {n: p.detach() for n, p in B.parameters(ft).items()}
    lazy = el.WeightDiff(
        LazyDeltas(B.parameters(model), held, torch.float64, names=list(diff.deltas)),
        diff.signature,
    )
    e = el.estimate(model, lazy, batch, "linear")
    assert e.delta_bytes * 2 == _delta_bytes(diff)  # float32 finetuned tensors, float64 Δ
    monkeypatch.setattr(shift, "REUSE_BYTES", 0)
    with shift.counting() as moved:
        el.linear_scores(model, lazy, batch, show_progress=False)
    assert e.delta_read_bytes == moved.bytes


def test_estimate_of_a_deep_model_extrapolates_to_the_real_calls_counts(monkeypatch):
    """Deeper than ``budget.COUNT_DEPTHS``, the narrow copy is counted at three depths and the
    counts extrapolated: here they must equal the real call's Δ traffic and block forwards,
    counted directly on a model of seven layers."""
    from extractive_lens import budget

    model = el.tiny_model(dict(CFG, n_layers=7, d_model=16, n_heads=2, d_mlp=32), seed=2)
    diff = _random_diff(model, 5)
    batch = el.make_batch(model, [([1, 2, 3], [5]), ([2, 4, 6], [7])], candidates=[5, 7])
    B.check_scorable(model)  # a bridge's one-time self-check runs its pieces: not the call's
    for method, options in (("linear", {}), ("causal", {"per": "component"})):
        e = el.estimate(model, diff, batch, method, **options)
        assert e.counted_at == budget.COUNT_DEPTHS
        calls = 0
        attention = B.attention

        def counting(*args, **kwargs):
            nonlocal calls
            calls += 1
            return attention(*args, **kwargs)

        monkeypatch.setattr(shift, "REUSE_BYTES", 0)
        monkeypatch.setattr(B, "attention", counting)
        with shift.counting() as moved:
            getattr(el, f"{method}_scores")(model, diff, batch, show_progress=False, **options)
        monkeypatch.undo()
        assert (e.layer_loads, e.delta_read_bytes) == (moved.loads, moved.bytes), method
        assert e.block_passes == calls and f"{calls} block forwards" in str(e), method


def test_estimate_follows_the_options_and_the_diff(setting):
    """``batch_size`` is the rows of one pass; ``steps="auto"`` is costed at its largest node
    count; a diff without the vocabulary matrices does not hold them; a low-rank diff is
    described as its products, not as ``W + αΔ``."""
    from extractive_lens.backend.lowrank import LowRank, LowRankDeltas
    from extractive_lens.scoring.integrated import AUTO_MAX_STEPS

    model, diff, batch = setting
    one, two = (el.estimate(model, diff, batch, "causal", per="component", batch_size=b)
                for b in (1, 2))  # fmt: skip
    runs_part = "cached runs (2: every layer's streams)"
    assert 2 * one.parts[runs_part] == two.parts[runs_part]
    assert 2 * one.rows["block"] == two.rows["block"]  # one prompt's patches per pass, or two

    from extractive_lens.scoring import costs
    from extractive_lens.scoring.integrated import IntegratedOptions

    shapes = costs.Shapes(rows=2, pos=5, n_layers=3, n_heads=4, d_model=32, d_mlp=64,
                          d_vocab=50, compute=4, layerwise=True)  # fmt: skip

    def kept(steps):
        options = IntegratedOptions(steps=steps, kinds="informative")
        return costs.integrated_memory(shapes, options)["each node's stream entering each layer"]

    assert kept("auto") == kept(AUTO_MAX_STEPS) == 8 * kept(4)
    assert "embedding and unembedding W + αΔ" in el.estimate(model, diff, batch).parts
    blocks = el.WeightDiff(
        {n: d for n, d in diff.deltas.items() if n.startswith("blocks.")}, diff.signature
    )
    assert "embedding and unembedding W + αΔ" not in el.estimate(model, blocks, batch).parts
    g = torch.Generator().manual_seed(0)
    r = 2
    factors = {
        f"blocks.{i}.mlp.{w}": LowRank(torch.randn(a, r, generator=g, dtype=torch.float64),
                                        torch.randn(r, b, generator=g, dtype=torch.float64))
        for i in range(CFG["n_layers"])
        for w, (a, b) in (("W_in", (32, 64)), ("W_out", (64, 32)))
    }  # fmt: skip
    lora = el.WeightDiff(LowRankDeltas(factors, {}), diff.signature)
    parts = el.estimate(model, lora, batch).parts
    assert not any("W + αΔ" in p for p in parts)
    assert parts["one block's low-rank products (x L) R"] == 2 * 2 * batch.n_pos * 2 * r * 4


class _RowSpy:
    """The real call's passes counted here, by their rows: every block forward (its attention's
    input rows × query positions, and × key positions for the cells), every unembedding, and
    the block rows recorded with a graph between two backwards."""

    def __init__(self, monkeypatch):
        self.blocks, self.graphs, self.unembedded, self.pending = [], [], [], []
        attention, unembed, grad = B.attention, B.unembed, torch.autograd.grad

        def spy_attention(model, layer, x, capture=("z",), past_kv=None):
            out = attention(model, layer, x, capture, past_kv)
            b, q = x.shape[0], x.shape[1]
            k = q + (0 if past_kv is None else past_kv[0].shape[1])
            self.blocks.append((b * q, b * q * k))
            if out[0].requires_grad:
                self.pending.append((b * q, b * q * k))
            return out

        def spy_unembed(model, x):
            out = unembed(model, x)
            self.unembedded.append((x.shape[0] * x.shape[1], out.requires_grad))
            return out

        def spy_grad(*args, **kwargs):
            self.graphs.append(tuple(map(sum, zip((0, 0), *self.pending))))
            self.pending = []
            return grad(*args, **kwargs)

        import weakref

        formed, value = weakref.WeakSet(), shift.Shift.value
        self.shifts = 1

        def spy_value(s, *args, **kwargs):  # the shifts that formed W + αΔ, alive at once
            formed.add(s)
            self.shifts = max(self.shifts, len(formed))
            return value(s, *args, **kwargs)

        monkeypatch.setattr(shift.Shift, "value", spy_value)
        monkeypatch.setattr(B, "attention", spy_attention)
        monkeypatch.setattr(B, "unembed", spy_unembed)
        monkeypatch.setattr(torch.autograd, "grad", spy_grad)

    def rows(self) -> dict[str, float]:
        graph = max(self.graphs, default=(0, 0))
        return {
            "graph": graph[0], "graph_cells": graph[1],
            "block": max(b for b, _ in self.blocks), "block_cells": max(c for _, c in self.blocks),
            "logits": max((n for n, g in self.unembedded if not g), default=0),
            "logits_grad": max((n for n, g in self.unembedded if g), default=0),
            "shifts": self.shifts,
        }  # fmt: skip


@pytest.mark.parametrize(
    "method, options",
    [("linear", {}), ("linear", {"batch_size": 1}), ("causal", {}),
     ("causal", {"per": "component", "max_batch": 3}), ("integrated", {"steps": 2})],
)  # fmt: skip
def test_estimate_counts_the_rows_of_the_real_calls_passes(setting, monkeypatch, method, options):
    """The rows of the passes the memory follows (the largest graph, block forward and
    readout) are counted on the narrow copy: here on the real call, by spies of its own."""
    from extractive_lens import budget

    model, diff, batch = setting
    e = el.estimate(model, diff, batch, method, **options)
    B.check_scorable(model)  # its one-time self-check is not the call's
    spy = _RowSpy(monkeypatch)
    getattr(el, f"{method}_scores")(model, diff, batch, show_progress=False, **options)
    monkeypatch.undo()
    assert budget.phase(e.rows, None) == spy.rows()
    assert e.block_passes == len(spy.blocks)
    # a small model's shifts each keep every layer's W + αΔ (shift.REUSE_BYTES): the most
    # alive at once, or fewer where the call's peak comes in a phase with fewer
    held = [v for k, v in e.parts.items() if k.startswith("every layer's W + αΔ")]
    weights = sum(d.numel() for n, d in diff.deltas.items() if B.layer_of(n) is not None)
    assert len(held) == 1 and held[0] % (weights * 4) == 0
    assert 1 <= held[0] // (weights * 4) <= spy.shifts


def _tensor_peak(call) -> int:
    """The peak bytes of tensors alive during ``call()`` above the level before it: the CPU
    allocator's running total, recorded by torch's profiler at every allocation and free."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        call()
    events, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        e = stack.pop()
        if e.tag == _EventType.Allocation:
            f = e.extra_fields
            events.append((e.start_time_ns, f.alloc_size, f.total_allocated))
        stack.extend(e.children)
    events.sort()
    start = events[0][2] - events[0][1]
    return max(total for _, _, total in events) - start


@pytest.mark.parametrize("regime", ["small", "large"])
@pytest.mark.parametrize(
    "method, options",
    [("linear", {}), ("causal", {}), ("integrated", {"steps": 4})],
)  # fmt: skip
def test_estimate_is_within_half_again_of_the_tensors_the_call_holds(
    setting, monkeypatch, method, options, regime
):
    """The memory estimate against the peak of the tensors alive during the real call (torch's
    profiler: what a device's allocator would hold), within 1.5× either way, where a small
    model keeps every layer's W + αΔ for each α in use and a large one forms one block's."""
    from extractive_lens.backend import hooked

    model, diff, batch = setting
    if B.backend_for(model) is not hooked:  # measured there: a bridge holds more (0.5-0.65x)
        pytest.skip("the per-element constants are measured on HookedTransformer's blocks")
    if regime == "large":
        monkeypatch.setattr(shift, "REUSE_BYTES", 0)
    e = el.estimate(model, diff, batch, method, **options)
    assert any(("every layer's" in p) == (regime == "small") for p in e.parts)
    call = getattr(el, f"{method}_scores")
    peak = _tensor_peak(lambda: call(model, diff, batch, show_progress=False, **options))
    assert 1 / 1.5 <= e.device_bytes / peak <= 1.5, (e.device_bytes, peak, e.parts)


def test_estimate_leaves_what_it_counts_through_as_it_was(setting, monkeypatch):
    """``estimate`` counts by swapping the backend's attention, MLP and unembedding, autograd's
    ``grad``, ``Shift.value`` and ``REUSE_BYTES``: all are the originals afterwards, also when
    the counted run raises."""
    import torch

    model, diff, batch = setting
    names = [(B, "attention"), (B, "mlp"), (B, "unembed"), (torch.autograd, "grad"),
             (shift.Shift, "value"), (shift, "REUSE_BYTES")]  # fmt: skip
    before = [getattr(o, n) for o, n in names]
    el.estimate(model, diff, batch, "integrated", steps=2)
    assert [getattr(o, n) for o, n in names] == before
    real = B.check_scorable

    def fails_on_the_copy(m, *a, **k):
        if m is not model:
            raise RuntimeError("planted")
        return real(m, *a, **k)

    monkeypatch.setattr(B, "check_scorable", fails_on_the_copy)
    with pytest.raises(RuntimeError, match="planted"):
        el.estimate(model, diff, batch, "linear")
    assert [getattr(o, n) for o, n in names] == before


@pytest.fixture(scope="module")
def wide_vocab():
    """A model whose vocabulary is wider than the narrow copy's (64), a batch and a reference
    batch of other, longer prompts (ids past 64) whose roles include the batch's."""
    torch.set_num_threads(1)
    model = el.tiny_model({**CFG, "d_vocab": 128}, seed=0)
    diff = _random_diff(model, 3)
    batch = el.make_batch(model, [([1, 2, 3, 4], [5]), ([2, 3, 4, 6], [7])], candidates=[5, 7],
                          roles=[["s", "name", "verb", "end"]] * 2)  # fmt: skip
    reference = el.make_batch(
        model, [([100, 90, 80, 70, 60], [120]), ([101, 91, 81, 71, 61], [121])],
        roles=[["s", "name", "more", "verb", "end"]] * 2,
    )  # fmt: skip
    return model, diff, batch, reference


@pytest.mark.parametrize("method", sorted(METHODS))
def test_estimate_takes_a_reference_batch(wide_vocab, method):
    """``reference=`` (the prompts y* is taken over) is the real model's batch; the narrow copy
    the estimate counts on has a vocabulary of its own, so it gets the reference as it gets the
    batch: the same lengths and roles, its own ids (an IndexError in the copy's embedding
    before). The same figures as without, as the reference only adds its forward."""
    model, diff, batch, reference = wide_vocab
    without = el.estimate(model, diff, batch, method)
    e = el.estimate(model, diff, batch, method, reference=reference)
    assert e.parts.keys() == without.parts.keys()
    assert e.delta_bytes == without.delta_bytes and e.block_passes >= without.block_passes


@pytest.mark.parametrize(
    "method, options",
    [("linear", {}), ("causal", {"per": "component"}), ("integrated", {"steps": 2})],
)
def test_estimate_with_a_reference_counts_the_real_calls_passes(wide_vocab, monkeypatch, method,
                                                                options):  # fmt: skip
    """The passes and rows the estimate counts with ``reference=`` are the real call's, counted
    here by spies of its own (the reference's forward included)."""
    from extractive_lens import budget

    model, diff, batch, reference = wide_vocab
    e = el.estimate(model, diff, batch, method, reference=reference, **options)
    B.check_scorable(model)
    spy = _RowSpy(monkeypatch)
    getattr(el, f"{method}_scores")(
        model, diff, batch, reference=reference, show_progress=False, **options
    )
    monkeypatch.undo()
    assert e.block_passes == len(spy.blocks)
    assert budget.phase(e.rows, None) == spy.rows()


def test_estimate_refuses_a_reference_the_call_refuses(wide_vocab):
    """A reference whose roles do not align with the batch's: the same refusal as the call's."""
    model, diff, batch, _ = wide_vocab
    other = el.make_batch(model, [([100, 90], [120]), ([101, 91], [121])], roles=[["a", "b"]] * 2)
    with pytest.raises(ValueError) as real:
        el.linear_scores(model, diff, batch, reference=other, show_progress=False)
    with pytest.raises(ValueError) as estimated:
        el.estimate(model, diff, batch, "linear", reference=other)
    assert str(estimated.value) == str(real.value)


def _reads_token_100(logits, batch):
    """A reward of the caller's own: the logit of token 100, past the narrow copy's vocabulary."""
    return logits[torch.arange(logits.shape[0]), batch.last_prompt_pos, 100]


@pytest.mark.parametrize("reward", [_reads_token_100, "logit_diff"], ids=["own", "logit_diff"])
@pytest.mark.parametrize("method", sorted(METHODS))
def test_estimate_takes_the_callers_reward(wide_vocab, method, reward, monkeypatch):
    """A reward reading the real vocabulary (the caller's own, or ``logit_diff`` of
    counterfactual answers past 64) ended the estimate in an IndexError (or "logit_diff needs
    counterfactual answers") on the narrow copy. Its passes are those of the real call, counted
    by spies here (the causal and integrated ones too: they are the methods' own)."""
    from extractive_lens import budget

    model, diff, batch, _ = wide_vocab
    batch = el.make_batch(model, [([1, 2, 3, 4], [5]), ([2, 3, 4, 6], [7])], candidates=[5, 7],
                          counterfactuals=[100, 101])  # fmt: skip
    e = el.estimate(model, diff, batch, method, reward=reward)
    assert e.parts.keys() == el.estimate(model, diff, batch, method).parts.keys()
    B.check_scorable(model)
    spy = _RowSpy(monkeypatch)
    getattr(el, METHODS[method].engine.__name__)(
        model, diff, batch, reward=reward, show_progress=False
    )
    monkeypatch.undo()
    assert e.block_passes == len(spy.blocks)
    assert budget.phase(e.rows, None) == spy.rows()

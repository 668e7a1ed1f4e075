"""Δ moved as few times as possible (issue 41): the layer-major passes and what they read.

Where gradients go one layer at a time (``runs.layerwise``, forced here with
``LAYERWISE_BYTES = -1``) and Δ is held a few layers at a time (``REUSE_BYTES = 0``: the
large-model regime), linear runs the finetuned run, every boundary's ``ŷ'`` and informative's
forward-mode pass in one sweep over the layers, and the integrated method runs its nodes layer
by layer side by side (both on ``passes.layer_major``). The scores must be the whole-graph ones (float64,
1e-12), and the counter (``shift.counting``) must see each layer's Δ read the claimed number of
times: a boundary or a node that reads a layer again shows up as a higher count.
"""

from __future__ import annotations

import pytest
import torch

import extractive_lens.scoring.runs as runs
from extractive_lens import WeightDiff, integrated_scores, linear_scores
from extractive_lens.backend import shift
from extractive_lens.scoring import passes
from tests.conftest import make_pair
from tests.helpers import small_batch

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.fixture(scope="module")
def deep64(family):
    """A float64 pair three layers deep: every sweep has a layer before and after a middle one."""
    base, ft = make_pair(family, torch.float64, n_layers=3)
    return base, WeightDiff.from_models(base, ft), small_batch(base)


def _large(monkeypatch) -> None:
    monkeypatch.setattr(runs, "LAYERWISE_BYTES", -1)
    monkeypatch.setattr(shift, "REUSE_BYTES", 0)


@pytest.mark.parametrize(
    "group", ["auto", 1, 3, None, "tiny budget", "one copy per block"], ids=lambda g: f"group={g}"
)
def test_linear_sweep_equals_the_whole_graph_scores(deep64, group, monkeypatch):
    """All kinds at once (informative's forward-mode pass inside the sweep, the finetuned run
    as the sweep's first rows) and the boundaries split into sweeps every way."""
    base, diff, batch = deep64
    want = linear_scores(base, diff, batch, show_progress=False)
    _large(monkeypatch)
    assert runs.layerwise(base, batch)
    if group == "tiny budget":  # "auto" with a budget of one boundary's rows: one per sweep
        monkeypatch.setattr(passes, "SWEEP_BYTES", 1)
        group = "auto"
    if group == "one copy per block":  # every layer step a block of one copy of the prompts
        monkeypatch.setattr(runs, "BLOCK_TOKENS", 1)
        group = None
    got = linear_scores(base, diff, batch, show_progress=False, upstream_group=group)
    torch.testing.assert_close(got.values, want.values, rtol=0, atol=1e-12)
    torch.testing.assert_close(got.other, want.other, rtol=0, atol=1e-12)
    assert got.metadata["additivity"]["prompt_changes"] == pytest.approx(
        want.metadata["additivity"]["prompt_changes"], abs=1e-12
    )


def test_a_kind_in_KINDS_reaches_the_large_model_sweep(deep64, monkeypatch):
    """A kind is reached through ``KINDS`` alone, on the large-model path too: a toy kind put
    in ``KINDS`` (each layer's finetuned input minus the base's, summed over ``d_model``, in
    the first component's cell) gives through the sweep (its ``layer_linear``, fed the
    finetuned rows of each layer) what it gives through the whole graph (its ``linear``,
    reading the finetuned run), and both equal TransformerLens's ``resid_pre`` of the two
    models. A sweep calling the kind modules by name would give downstream's scores."""
    from types import SimpleNamespace

    from extractive_lens.scoring.kinds import KINDS
    from extractive_lens.scoring.runs import wide

    base, diff, batch = deep64
    L = base.cfg.n_layers

    def change(chunk, layer, pre):
        return (wide(pre) - wide(chunk.base.pre[layer])).sum(-1)

    def linear(chunk):
        if "downstream" in chunk.swept:
            return chunk.swept["downstream"]
        out = chunk.new_scores()
        for layer in range(L):
            out[:, layer, 0] = change(chunk, layer, chunk.ft.pre[layer])
        return out

    def layer_linear(chunk, step, out):
        if step.g is None:
            out[:, step.layer, 0] = change(chunk, step.layer, step.finetuned.pre)

    toy = SimpleNamespace(CONTEXTS=("base",), needs=lambda o: {"finetuned"},
                          capture=lambda o: (), linear=linear, layer_linear=layer_linear)  # fmt: skip
    monkeypatch.setitem(KINDS, "downstream", toy)
    kw = dict(kinds="downstream", show_progress=False)
    whole = linear_scores(base, diff, batch, **kw)
    _large(monkeypatch)
    swept = linear_scores(base, diff, batch, **kw)
    names = [f"blocks.{layer}.hook_resid_pre" for layer in range(L)]
    _, cache = base.run_with_cache(batch.tokens, names_filter=names)
    with diff.applied(base):
        _, ft_cache = base.run_with_cache(batch.tokens, names_filter=names)
    want = torch.stack([(ft_cache[n] - cache[n]).sum(-1) for n in names], 1)
    want = want * batch.position_mask[:, None, :]
    for got in (whole, swept):
        torch.testing.assert_close(got.prompt_values[0, :, :, 0], want, rtol=0, atol=1e-10)
    assert want.abs().max() > 1e-3


def test_linear_sweep_in_the_authors_convention(deep64, monkeypatch):
    """Informative with q, k, v credited apart runs in the sweep too."""
    base, diff, batch = deep64
    kw = dict(convention="authors_code", kinds=("informative", "downstream"), show_progress=False)
    try:
        want = linear_scores(base, diff, batch, **kw)
    except NotImplementedError as e:  # a TransformerBridge of a grouped-query model refuses
        pytest.skip(str(e).split(";")[0])
    _large(monkeypatch)
    got = linear_scores(base, diff, batch, **kw)
    torch.testing.assert_close(got.values, want.values, rtol=0, atol=1e-12)
    torch.testing.assert_close(got.other, want.other, rtol=0, atol=1e-12)


@pytest.mark.parametrize("kinds", [("upstream",), ("downstream",), ("informative", "upstream")])
def test_linear_sweep_kinds_alone_equal_the_whole_graph(deep64, kinds, monkeypatch):
    """Each kind's scores computed inside the sweep alone (upstream per boundary in the
    backward pass, downstream in the forward step without informative's, upstream split
    into one boundary per sweep): the whole-graph scores."""
    base, diff, batch = deep64
    kw = dict(kinds=kinds, show_progress=False, ablation="resample", resample_k=2)
    want = linear_scores(base, diff, batch, **kw)
    _large(monkeypatch)
    got = linear_scores(base, diff, batch, upstream_group=1, **kw)
    torch.testing.assert_close(got.values, want.values, rtol=0, atol=1e-12)


def _streams(x, b: int, pos: int, d_model: int, seen: dict[int, int]) -> None:
    """Every ``[b, pos, ...]`` tensor of at least a residual stream's size reachable from
    ``x`` through lists, tuples, dicts and ``Run`` fields, by storage (views count once).
    Lazy sequences (``HeadGrads``, ``LayerW_O``) form their tensors when read: not walked."""
    from dataclasses import fields, is_dataclass

    if isinstance(x, torch.Tensor):
        if tuple(x.shape[:2]) == (b, pos) and x.numel() >= b * pos * d_model:
            seen[x.untyped_storage().data_ptr()] = x.untyped_storage().nbytes()
    elif isinstance(x, (list, tuple)):
        for v in x:
            _streams(v, b, pos, d_model, seen)
    elif isinstance(x, dict):
        for v in x.values():
            _streams(v, b, pos, d_model, seen)
    elif is_dataclass(x) and isinstance(x, runs.Run):
        for f in fields(x):
            _streams(getattr(x, f.name), b, pos, d_model, seen)


def test_linear_sweep_keeps_no_stream_per_layer_beyond_the_base_run(deep64, monkeypatch):
    """Issue 41, memory flat with depth at any batch: each layer's scores are computed inside
    the sweep while its streams are at hand (informative's and downstream's in the forward
    step, upstream's per boundary as the backward pass reaches it), so after the sweep the
    chunk keeps no ``[batch, pos, d_model]`` stream per layer beyond the base run's: no
    finetuned layer inputs, no ``ŷ'``, no ``ŷ W_O^T`` (before: five per layer); and
    upstream's ``y*`` is formed one layer at a time, never every layer's at once."""
    from extractive_lens.scoring import linear as lin
    from extractive_lens.scoring.ablation import AblationTable

    base, diff, batch = deep64
    _large(monkeypatch)
    chunks: list = []
    passes = lin._finetuned_passes

    def spy(c, needs, kinds):
        passes(c, needs, kinds)
        chunks.append(c)

    widths: list[int] = []
    for_rows = AblationTable.for_rows

    def rows_spy(self, rows, chunk, run, layers=slice(None)):
        z, m = for_rows(self, rows, chunk, run, layers)
        widths.append(z.shape[2])
        return z, m

    monkeypatch.setattr(lin, "_finetuned_passes", spy)
    monkeypatch.setattr(AblationTable, "for_rows", rows_spy)
    linear_scores(base, diff, batch, show_progress=False)
    (c,) = chunks
    b, pos = batch.tokens.shape
    L, d = base.cfg.n_layers, base.cfg.d_model
    on_base: dict[int, int] = {}
    _streams(c.base, b, pos, d, on_base)
    beyond: dict[int, int] = {}
    for name in ("ft", "g_z", "swept", "informative_blocks"):
        _streams(getattr(c, name), b, pos, d, beyond)
    assert not set(beyond) - set(on_base), "streams kept per layer beyond the base run"
    assert len(on_base) <= 6 * L + 2  # pre (= post), mid, z, MLP out, both gradients; g_embed
    assert widths and set(widths) == {1}  # y* one layer at a time


def test_linear_sweep_drops_the_final_streams_before_its_backward_pass(deep64, monkeypatch):
    """The final stream of every row of a sweep (``2L + 1`` copies of the batch) is read by the
    reward alone: the backward pass through the layers runs without it."""
    import weakref

    base, diff, batch = deep64
    _large(monkeypatch)
    finals: list = []
    alive: list[bool] = []
    readout, layer_vjp = passes.readout, runs.layer_vjp

    def reading(model, resid, *a, **kw):
        finals.append(weakref.ref(resid))
        return readout(model, resid, *a, **kw)

    def back(*a, **kw):
        alive.append(any(f() is not None for f in finals))
        return layer_vjp(*a, **kw)

    monkeypatch.setattr(passes, "readout", reading)
    monkeypatch.setattr(runs, "layer_vjp", back)
    linear_scores(base, diff, batch, show_progress=False, upstream_group=None)
    assert alive and not any(alive)


def _reads(call, monkeypatch) -> shift.Traffic:
    _large(monkeypatch)
    with shift.counting() as moved:
        call()
    return moved


@pytest.fixture(scope="module")
def deep4():
    base, ft = make_pair("rms_gated_rotary_gqa", torch.float64, n_layers=4)
    return base, WeightDiff.from_models(base, ft), small_batch(base)


def _delta_bytes(diff) -> int:
    return sum(t.numel() * t.element_size() for t in diff.deltas.values())


def test_linear_reads_each_layer_of_delta_at_most_twice(deep4, monkeypatch):
    """Forward once, backward once: at most two loads per layer whatever the depth (the last
    layer is still loaded when the backward sweep starts), the embedding and unembedding twice
    each (the finetuned run, then informative's forward-mode pass of "other", after the sweep;
    the unembedding's ``W + αΔ`` is formed again in backward from what is loaded), ``W_O``
    and ``b_O`` taken from the layer loaded (a TransformerBridge, whose loaded Δ is in its own
    layout: read on their own once per layer), and in all at most twice the bytes of Δ."""
    from extractive_lens.backend import backend_for

    base, diff, batch = deep4
    L = base.cfg.n_layers
    moved = _reads(lambda: linear_scores(base, diff, batch, show_progress=False), monkeypatch)
    assert [moved.by_group[layer] for layer in range(L)] == [2] * (L - 1) + [1]
    assert moved.by_group["embed"] == 2 and moved.by_group["unembed"] == 2
    if backend_for(base).NAME == "hooked_transformer":
        assert moved.reads == {}
    assert all(n <= 1 for n in moved.reads.values())
    assert moved.bytes <= 2 * _delta_bytes(diff)


def test_one_boundary_per_sweep_reads_later_layers_again(deep4, monkeypatch):
    """The control: with one boundary per sweep each sweep reads the layers after its boundary
    again, the count above sees it."""
    base, diff, batch = deep4
    L = base.cfg.n_layers
    kw = dict(kinds=("upstream",), show_progress=False)
    one = _reads(lambda: linear_scores(base, diff, batch, upstream_group=1, **kw), monkeypatch)
    all_ = _reads(lambda: linear_scores(base, diff, batch, upstream_group=None, **kw), monkeypatch)
    assert [all_.by_group[layer] for layer in range(L)] == [2] * (L - 1) + [1]
    assert one.by_group[L - 2] > 2 and one.bytes > 2 * all_.bytes


ALL = ("informative", "upstream", "downstream")


@pytest.mark.parametrize(
    "kinds, variant",
    [(("informative",), "component"), (ALL, "component"), (ALL, "layer"),
     (ALL, "a pass per path"), (("upstream",), "layers 1 and 2"),
     (("upstream", "downstream"), "one row per block")],
    ids=lambda v: "+".join(v) if isinstance(v, tuple) else v,
)  # fmt: skip
def test_integrated_layer_major_pass_equals_the_whole_graph(deep64, kinds, variant, monkeypatch):
    """The informative nodes, the finetuned run (downstream's patches read it) and upstream's
    finetuned-late paths (each path's rows entering the pass at their group's boundary) run
    layer by layer together (``passes.layer_major``): the scores of the whole graph, node after
    node and path after path. Per component and per layer path; the paths split into a pass
    each (``SWEEP_BYTES`` of one byte); a pass that starts after layer 0 (``layers``); one row
    per layer step."""
    from extractive_lens.scoring import integrated

    base, diff, batch = deep64
    # nodes and weights of no symmetry (Gauss's and the midpoint's are symmetric: a node given
    # another's alpha or weight would still add up the same)
    monkeypatch.setattr(integrated, "nodes", lambda m, rule: ([0.1, 0.45, 0.8, 0.95],
                                                              [0.1, 0.2, 0.3, 0.4]))  # fmt: skip
    kw: dict = dict(steps=4, kinds=kinds, show_progress=False)
    if variant == "layer":
        kw["path"] = "layer"
    if variant == "layers 1 and 2":
        kw["layers"] = (1, 2)
    want = integrated_scores(base, diff, batch, **kw)
    _large(monkeypatch)
    if variant == "a pass per path":
        monkeypatch.setattr(passes, "SWEEP_BYTES", 1)
    if variant == "one row per block":
        monkeypatch.setattr(runs, "BLOCK_TOKENS", 1)
    got = integrated_scores(base, diff, batch, **kw)
    torch.testing.assert_close(got.values, want.values, rtol=0, atol=1e-12, equal_nan=True)
    if "informative" in kinds:
        torch.testing.assert_close(got.other, want.other, rtol=0, atol=1e-12)
    a, b = got.metadata["integrated"], want.metadata["integrated"]
    assert a["completeness"] == pytest.approx(b["completeness"], abs=1e-12)
    assert a["R_change"] == pytest.approx(b["R_change"], abs=1e-12, nan_ok=True)


def test_integrated_informative_reads_each_layer_twice_for_all_nodes(deep4, monkeypatch):
    """Four nodes and the finetuned model: each layer's Δ read once forward and once backward
    (the last layer still loaded), not once per node; in all under twice the Δ."""
    base, diff, batch = deep4
    L = base.cfg.n_layers
    kw = dict(steps=4, kinds=("informative",), show_progress=False)
    moved = _reads(lambda: integrated_scores(base, diff, batch, **kw), monkeypatch)
    assert [moved.by_group[layer] for layer in range(L)] == [2] * (L - 1) + [1]
    assert moved.bytes <= 2 * _delta_bytes(diff)


@pytest.mark.parametrize("kinds", [ALL, ("upstream",)], ids=["all kinds", "upstream"])
def test_integrated_reads_each_layer_twice_for_every_node_and_path(deep4, kinds, monkeypatch):
    """Every component's upstream paths (four nodes each) enter the one layer-major pass at
    their boundary with the informative nodes and the finetuned run: each layer's Δ read once
    forward, once backward (the last layer still loaded), not once per path; the embedding and
    the unembedding at most twice; in all under twice the Δ."""
    base, diff, batch = deep4
    L = base.cfg.n_layers
    kw = dict(steps=4, kinds=kinds, show_progress=False)
    moved = _reads(lambda: integrated_scores(base, diff, batch, **kw), monkeypatch)
    assert [moved.by_group[layer] for layer in range(L)] == [2] * (L - 1) + [1]
    assert moved.by_group["embed"] <= 2 and moved.by_group["unembed"] <= 2
    assert moved.bytes <= 2 * _delta_bytes(diff)


def test_integrated_paths_from_a_later_layer_read_no_earlier_layer(deep4, monkeypatch):
    """Upstream's paths of layers 1 and 2 (of 4): the pass starts at their boundary, so layer
    0 is not read, the later ones twice; and the control, a pass per path (``SWEEP_BYTES`` of
    one byte), reads the layers after its boundary again: the count sees it."""
    base, diff, batch = deep4
    L = base.cfg.n_layers
    kw = dict(steps=4, kinds=("upstream",), layers=(1, 2), show_progress=False)
    one = _reads(lambda: integrated_scores(base, diff, batch, **kw), monkeypatch)
    assert [one.by_group[layer] for layer in range(L)] == [0] + [2] * (L - 2) + [1]
    monkeypatch.setattr(passes, "SWEEP_BYTES", 1)
    each = _reads(lambda: integrated_scores(base, diff, batch, **kw), monkeypatch)
    assert each.by_group[2] > 2 and each.loads > 2 * one.loads


def test_sweep_gradients_hold_only_their_own_rows(deep64, monkeypatch):
    """Each boundary's ``ŷ'`` from the layer-major pass is the whole graph's (the boundaries'
    rows stacked in one batch, one backward: ``passes.stacked``), a tensor of its own rows, not a view of the whole
    layer's gradient (which held every boundary's rows of that layer: memory growing as
    depth²), and a layer step runs ``runs.BLOCK_TOKENS`` tokens at a time."""
    from extractive_lens.backend import compute
    from extractive_lens.scoring.linear import LinearOptions
    from extractive_lens.scoring.runs import forward_run

    base, diff, batch = deep64
    _large(monkeypatch)
    monkeypatch.setattr(runs, "BLOCK_TOKENS", 1)
    reward = LinearOptions().reward_fn
    seen: list[int] = []
    run_blocks = passes.B.run_blocks

    def counted(model, x, **kw):
        if x is not None:
            seen.append(x.shape[0])
        return run_blocks(model, x, **kw)

    L = base.cfg.n_layers
    got: dict = {}
    want: dict = {}

    def boundary(layer, part, into):
        def done(g):
            into[(layer, part)] = g

        start = (layer, passes.boundary(base, part))
        return passes.Entry(start, 1, lambda: passes.entry(base, diff, run, layer, part)[0],
                            True, done)  # fmt: skip

    with compute.computing_in(base, torch.float64), shift.reusing():
        run = forward_run(base, batch, reward, grad=True)
        with shift.shifted(base, diff) as s:
            keys = [(layer, part) for layer in range(L) for part in ("attn", "mlp")]
            passes.stacked(base, batch, reward, {k: boundary(*k, want) for k in keys})
            want_R = forward_run(base, batch, reward).reward
            monkeypatch.setattr(passes.B, "run_blocks", counted)
            entries = [boundary(*k, got) for k in keys]
            lane = passes.Lane(s)
            passes.layer_major(base, batch, reward, [lane], entries, s, group=None)
    assert len(got) == len(want) == 2 * L
    for key, g in got.items():
        torch.testing.assert_close(g, want[key], rtol=0, atol=1e-12)
        for t in (g, want[key]):
            assert t.untyped_storage().nbytes() == t.nbytes  # no other rows behind it
    assert seen and max(seen) == len(batch)  # the lane's rows; the entries' one row per step
    torch.testing.assert_close(lane.reward, want_R, rtol=0, atol=1e-12)  # the finetuned R

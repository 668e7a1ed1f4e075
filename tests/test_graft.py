"""Position-resolved grafts against a literal reference: the finetuned model's own modules run on
the grafted run's inputs, their outputs swapped in at the grafted positions by TransformerLens
hooks (no package code), float64; generation cached and uncached; sufficiency of one cell
against the exact informative score."""

from __future__ import annotations

import contextlib

import pytest
import torch

from extractive_lens import WeightDiff, causal_scores, graft_scores, iter_components
from extractive_lens.grafts import Where, components_of
from extractive_lens.rewards import answer_logprob
from tests import reference as ref
from tests.conftest import make_pair, needs_hooked
from tests.helpers import small_batch

GEN = dict(do_sample=False, verbose=False, stop_at_eos=False)


@pytest.fixture(scope="module")
def gqa_pair():
    return make_pair("rms_gated_rotary_gqa", torch.float64)


def literal_graft(base, ft, tokens, heads, mlps, mask):
    """Logits of ``base`` on ``tokens`` with ``ft``'s heads ``heads[layer]`` and MLPs ``mlps``
    at the positions ``mask`` ([batch, pos]): each grafted layer's input is read from the run,
    ``ft``'s block run on it, and its per-head ``hook_result`` / its MLP output put in place."""
    b, f = ref.attn_result_mode(base), ref.attn_result_mode(ft)
    parallel = base.cfg.parallel_attn_mlp
    seen: dict[str, torch.Tensor] = {}
    hooks = []

    def keep(name):
        def hook(act, hook):
            seen[name] = act

        return hook

    def heads_hook(layer):
        def hook(act, hook):
            out = {}
            with f.hooks(fwd_hooks=[(f"blocks.{layer}.attn.hook_result",
                                     lambda a, hook: out.__setitem__("r", a))]):  # fmt: skip
                f.blocks[layer](seen[f"pre{layer}"])
            act = act.clone()
            for h in heads[layer]:
                act[:, :, h][mask] = out["r"][:, :, h][mask]
            return act

        return hook

    def mlp_hook(layer):
        def hook(act, hook):
            x = seen[f"pre{layer}"] if parallel else seen[f"mid{layer}"]
            new = f.blocks[layer].mlp(f.blocks[layer].ln2(x))
            act = act.clone()
            act[mask] = new[mask]
            return act

        return hook

    for layer in range(base.cfg.n_layers):
        hooks.append((f"blocks.{layer}.hook_resid_pre", keep(f"pre{layer}")))
        if not parallel:
            hooks.append((f"blocks.{layer}.hook_resid_mid", keep(f"mid{layer}")))
        if heads[layer]:
            hooks.append((f"blocks.{layer}.attn.hook_result", heads_hook(layer)))
        if layer in mlps:
            hooks.append((f"blocks.{layer}.hook_mlp_out", mlp_hook(layer)))
    with torch.no_grad():
        return b.run_with_hooks(tokens, fwd_hooks=hooks)


CASES = [  # components, positions
    (["L0H1"], [2]),
    (["L1MLP"], [-1]),
    (["attn[1:]", "L0MLP"], ["mid"]),
    ("all", ["last", "generated"]),
    (["mlp", "L1H0"], ["prompt", "-last"]),
]


@needs_hooked
@pytest.mark.parametrize("components,positions", CASES)
def test_grafted_forward_matches_the_literal_reference(pair64, components, positions):
    base, ft = pair64
    diff = WeightDiff.from_models(base, ft)
    batch = small_batch(base)
    where = Where.of(base, components, positions, batch)
    mask = where.prompt_mask(len(batch), batch.n_pos)
    heads, mlps = components_of(base, components)
    expected = literal_graft(base, ft, batch.tokens, heads, mlps, mask)
    with torch.no_grad(), diff.grafted(base, components, positions, batch=batch):
        got = base(batch.tokens)
    assert (got - expected).abs().max() < 1e-10
    # the engine of graft_scores (the pieces) reads the same reward
    s = graft_scores(base, diff, batch, groups={"g": components}, roles={"r": positions})
    want = answer_logprob(expected, batch) - answer_logprob(base(batch.tokens), batch)
    assert torch.allclose(s.changes[:, 0, 0], want, atol=1e-10)
    # a control: the graft one position later is another run
    if isinstance(positions[0], int):
        shifted = [positions[0] + 1 if positions[0] >= 0 else positions[0] - 1]
        with torch.no_grad(), diff.grafted(base, components, shifted, batch=batch):
            assert (base(batch.tokens) - expected).abs().max() > 1e-6


@needs_hooked
def test_every_component_everywhere_is_the_components_finetune(pair64):
    base, ft = pair64
    diff = WeightDiff.from_models(base, ft)
    tokens = small_batch(base).tokens
    labels = [c.label for c in iter_components(base.cfg.n_layers, base.cfg.n_heads)]
    with torch.no_grad():
        with diff.restricted(labels).applied(base):
            expected = base(tokens)
        with diff.grafted(base):
            got = base(tokens)
        plain = base(tokens)
    assert (got - expected).abs().max() < 1e-10
    assert (got - plain).abs().max() > 1e-3  # it changed something


@needs_hooked
def test_one_head_graft_leaves_the_other_heads_alone(pair64):
    base, ft = pair64
    diff = WeightDiff.from_models(base, ft)
    tokens = small_batch(base).tokens
    b = ref.attn_result_mode(base)
    wd = WeightDiff.from_models(b, ft)
    with torch.no_grad():
        _, plain = b.run_with_cache(tokens, names_filter="blocks.0.attn.hook_result")
        with wd.grafted(b, ["L0H1"]):
            _, got = b.run_with_cache(tokens, names_filter="blocks.0.attn.hook_result")
    # hook_result is read before the graft adds its change (at hook_attn_out): every head's own
    # output there is the base one; the change is the grafted head's alone (the reference test)
    assert torch.equal(plain["blocks.0.attn.hook_result"], got["blocks.0.attn.hook_result"])
    del diff


@needs_hooked
@pytest.mark.parametrize("cached", [True, False])
def test_generation_grafts_the_generated_positions(gqa_pair, cached):
    """Generated positions grafted where named, and KV-cached generation keeping the grafted
    heads' keys and values with W + Δ: its logits are the uncached literal reference's."""
    base, ft = gqa_pair
    diff = WeightDiff.from_models(base, ft)
    prompt = small_batch(base).tokens[:1, :4]
    n_new = 4
    for positions in (["generated"], [1, "generated"], ["last"]):
        with torch.no_grad(), diff.grafted(base, ["L1H0", "L0H3", "L1MLP"], positions):
            out = base.generate(prompt, max_new_tokens=n_new, use_past_kv_cache=cached,
                                output_logits=True, **GEN)  # fmt: skip
        tokens = out.sequences
        where = Where.of(base, ["L1H0", "L0H3", "L1MLP"], positions)
        mask = where.at(1, 0, tokens.shape[1], prompt.shape[1])
        heads, mlps = components_of(base, ["L1H0", "L0H3", "L1MLP"])
        expected = literal_graft(base, ft, tokens, heads, mlps, mask)
        steps = torch.stack(list(out.logits), 1)  # the logits each step read
        want = expected[:, prompt.shape[1] - 1 : -1]
        assert (steps - want).abs().max() < 1e-9, positions


def test_cached_and_uncached_generation_agree_token_for_token(gqa_pair):
    base, ft = gqa_pair
    diff = (WeightDiff.from_models(base, ft)) * 3.0  # a large change: the tokens move
    prompt = small_batch(base, seed=1).tokens[:1, :4]
    runs = {}
    for cached in (True, False):
        with torch.no_grad(), diff.grafted(base, "attn", ["last", "generated"]):
            runs[cached] = base.generate(prompt, max_new_tokens=8, use_past_kv_cache=cached, **GEN)
    with torch.no_grad():
        plain = base.generate(prompt, max_new_tokens=8, use_past_kv_cache=True, **GEN)
    assert torch.equal(runs[True], runs[False])
    assert not torch.equal(runs[True], plain)  # the graft changed the generation


@needs_hooked
def test_sufficient_and_necessary_are_their_own_runs(pair64):
    """Sufficiency grafts Δ into W; necessity removes it from W': the reference grafts ``ft``
    into ``base`` for one and ``base`` into ``ft`` for the other."""
    base, ft = pair64
    diff = WeightDiff.from_models(base, ft)
    batch = small_batch(base)
    groups, roles = {"mlp": "mlp", "L1H2": ["L1H2"]}, {"mid": "mid", "last": "last"}
    suff = graft_scores(base, diff, batch, groups=groups, roles=roles)
    nec = graft_scores(base, diff, batch, groups=groups, roles=roles, mode="necessary")
    with torch.no_grad():
        R_base, R_full = (
            answer_logprob(base(batch.tokens), batch),
            answer_logprob(ft(batch.tokens), batch),
        )
    # the full finetune, every parameter (embeddings and unembedding included): the normaliser
    assert torch.allclose(suff.base, R_base, atol=1e-10) and torch.allclose(
        suff.full, R_full, atol=1e-10
    )
    for i, g in enumerate(groups.values()):
        heads, mlps = components_of(base, g)
        for j, r in enumerate(roles.values()):
            mask = Where.of(base, g, r, batch).prompt_mask(len(batch), batch.n_pos)
            into_base = answer_logprob(
                literal_graft(base, ft, batch.tokens, heads, mlps, mask), batch
            )
            into_ft = answer_logprob(
                literal_graft(ft, base, batch.tokens, heads, mlps, mask), batch
            )
            assert torch.allclose(suff.changes[:, i, j], into_base - R_base, atol=1e-10)
            assert torch.allclose(nec.changes[:, i, j], R_full - into_ft, atol=1e-10)
    gain = (R_full - R_base).mean()
    assert torch.allclose(suff.values, suff.changes.mean(0) / gain)
    assert not torch.allclose(suff.values, nec.values, atol=1e-3)


def test_a_single_cell_sufficiency_is_the_exact_informative_score(pair64, family, tmp_path):
    base, ft = pair64
    diff = WeightDiff.from_models(base, ft)
    batch = small_batch(base)
    exact = causal_scores(base, diff, batch, kinds=("informative",))
    groups = {"L0MLP": ["L0MLP"], "L0H2": ["L0H2"], "L1H1": ["L1H1"]}
    roles = {"pos 1": 1, "pos 2": 2, "last": "last"}
    s = graft_scores(base, diff, batch, groups=groups, roles=roles)
    table = s.compare(exact)
    assert len(table) == 9
    assert (table["graft"] - table["summed"]).abs().max() < 1e-10
    assert (table["summed"].abs() > 1e-6).sum() >= 7  # cells that matter (L1H1 before the
    # answer reaches nothing the reward reads)
    # a set of two cells is not the sum of its cells' scores (the comparison can fail)
    two = graft_scores(base, diff, batch, groups={"g": ["L0H2", "L0MLP"]}, roles={"r": [1, "last"]})
    row = two.compare(exact).iloc[0]
    assert abs(row["graft"] - row["summed"]) > 1e-6
    if family != "ln_gelu":  # the report once
        return
    from extractive_lens.plotting import report

    html = report(exact, path=tmp_path / "r.html", extra_figures=[("graft map", s.plot())])
    assert "graft map" in html.read_text()


def test_where_resolves_components_and_positions(pair64):
    base, _ = pair64
    batch = small_batch(base)
    L, H = base.cfg.n_layers, base.cfg.n_heads
    heads, mlps = components_of(base, ["attn[1:]", "L0MLP", "L0H1"])
    assert heads == ((1,), tuple(range(H))) and mlps == (0,)
    assert components_of(base, "L1") == (((), tuple(range(H))), (1,))
    assert components_of(base, "all[:1]") == ((tuple(range(H)), ()), (0,))
    assert components_of(base, None) == ((tuple(range(H)),) * L, tuple(range(L)))
    w = Where.of(base, "mlp", ["prompt", "-last", "-mid"], batch)
    m = w.prompt_mask(len(batch), batch.n_pos)
    assert m.sum(1).tolist() == [1, 1, 1, 1] and not w.generated  # only "t1"
    w = Where.of(base, "mlp", ["last", "generated"], batch)
    m = w.prompt_mask(len(batch), batch.n_pos)
    for row in range(len(batch)):
        p = int(batch.prompt_lengths[row])
        assert m[row].nonzero()[:, 0].tolist() == list(range(p - 1, batch.n_pos))
    assert Where.of(base, "mlp", -2, batch).prompt_mask(4, 0)[1].nonzero().item() == 3
    # without a batch: the prompt's length is the first forward's
    w = Where.of(base, "mlp", [0, "generated"])
    assert w.at(1, 0, 5, 3).tolist() == [[True, False, False, True, True]]
    assert w.at(1, 5, 1, 3).tolist() == [[True]]
    with pytest.raises(ValueError, match="batch="):
        Where.of(base, "mlp", "{name}")
    with pytest.raises(ValueError, match="roles are"):
        Where.of(base, "mlp", "{city}", batch)
    with pytest.raises(ValueError, match="not a component"):
        components_of(base, ["L0X"])
    with pytest.raises(ValueError, match="layers"):
        components_of(base, ["L9H0"])


@needs_hooked
def test_the_graft_leaves_no_hooks_and_writes_nothing(pair64):
    base, ft = pair64
    diff = WeightDiff.from_models(base, ft)
    before = {n: p.detach().clone() for n, p in base.named_parameters()}
    tokens = small_batch(base).tokens
    with pytest.raises(RuntimeError, match="inside"):
        with torch.no_grad(), diff.grafted(base, "attn", "generated"):
            base(tokens)
            raise RuntimeError("raised inside the block")
    from extractive_lens.interrupts import attached_hooks

    assert attached_hooks(base) == []
    for n, p in base.named_parameters():
        assert torch.equal(p, before[n]), n
    graft_scores(base, diff, small_batch(base), groups={"a": "attn"}, roles={"l": "last"})
    for n, p in base.named_parameters():
        assert torch.equal(p, before[n]), n


@pytest.mark.parametrize("components,positions", CASES[:3])
def test_the_context_and_the_engine_agree_on_either_backend(pair64, components, positions):
    """The hooks on the model's own forward (a HookedTransformer's or a TransformerBridge's)
    and the engine of ``graft_scores`` (the pieces) run the same graft."""
    from extractive_lens.backend import shift
    from extractive_lens.scoring.graft import forward

    base, ft = pair64
    diff = WeightDiff.from_models(base, ft)
    batch = small_batch(base)
    where = Where.of(base, components, positions, batch)
    with torch.no_grad():
        engine = forward(base, batch, where, contextlib.nullcontext,
                         lambda: shift.shifted(base, diff))  # fmt: skip
        with diff.grafted(base, components, positions, batch=batch):
            hooked = base(batch.tokens)
        plain = base(batch.tokens)
    real = batch.position_mask
    assert (hooked - engine)[real].abs().max() < 1e-10
    assert (hooked - plain)[real].abs().max() > 1e-6


def test_intervals_are_a_bootstrap_of_the_ratio_of_means(pair64):
    from extractive_lens.stats import draws

    base, ft = pair64
    diff = WeightDiff.from_models(base, ft)
    batch = small_batch(base)
    s = graft_scores(base, diff, batch, groups={"a": "attn", "m": "mlp"}, roles={"l": "last"})
    ci = s.intervals(n_boot=200, seed=4)
    gain = s.full - s.base
    ratios = torch.stack([s.changes[i].mean(0) / gain[i].mean() for i in draws(len(batch), 200, 4)])
    q = torch.quantile(ratios, torch.tensor([0.025, 0.975], dtype=ratios.dtype), dim=0)
    assert torch.allclose(ci.low, q[0]) and torch.allclose(ci.high, q[1])
    assert torch.equal(ci.estimate, s.values.double())
    df = s.to_dataframe(n_boot=200, seed=4)
    assert df.loc[0, "low"] == float(ci.low[0, 0]) and len(df) == 2
    fig = s.plot()
    assert list(fig.data[0].y) == ["a", "m"] and list(fig.data[0].x) == ["l"]


def test_groups_and_roles_as_lists_are_named_by_themselves(pair64):
    # groups=["attn", "mlp"] used to reach dict(["attn", "mlp"]): "dictionary update sequence
    # element #0 has length 4; 2 is required" (and a two-letter spec like "L0" became {"L": "0"})
    base, ft = pair64
    diff = WeightDiff.from_models(base, ft)
    batch = small_batch(base)
    named = graft_scores(
        base, diff, batch, groups={"attn": "attn", "L0": "L0"}, roles={"last": "last", "-1": -1}
    )
    listed = graft_scores(base, diff, batch, groups=["attn", "L0"], roles=["last", -1])
    assert listed.group_labels == named.group_labels == ("attn", "L0")
    assert listed.role_labels == named.role_labels == ("last", "-1")
    assert torch.equal(listed.values, named.values)
    with pytest.raises(TypeError, match=r"graft_scores\(groups=.*pass a dict of name -> spec"):
        graft_scores(base, diff, batch, groups=[["L0H0", "L0MLP"]], roles=["last"])

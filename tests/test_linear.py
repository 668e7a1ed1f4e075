"""Linearized scores against independent computations (docs/scores.md §5 identities), float64."""

from __future__ import annotations

import pytest
import torch

from extractive_lens import WeightDiff, linear_scores, make_batch
from extractive_lens.rewards import answer_logprob, logit_diff, logit_margin
from tests import reference as ref
from tests.conftest import make_pair, needs_hooked
from tests.helpers import small_batch

KINDS = ("informative", "upstream", "downstream")


def test_per_token_sums_and_other_match_whole_model_jvp(pair64):
    base, ft = pair64
    diff = WeightDiff.from_models(base, ft)
    batch = small_batch(base)
    s = linear_scores(base, diff, batch, kinds=("informative",))
    assert torch.allclose(s.prompt_values.sum(-1), s.prompt_totals, atol=1e-12)
    # Σ_{c,t} Ī + Σ_other = d/dε R(W + εΔ) (one JVP of the whole TransformerLens forward)
    total = s.prompt_totals[0].sum((1, 2)) + s.other
    expected = ref.whole_model_jvp(base, ft, batch, answer_logprob)
    assert torch.allclose(total, expected, atol=1e-10, rtol=0), (total, expected)
    # Negative control: dropping the "other" share breaks the identity.
    assert not torch.allclose(s.prompt_totals[0].sum((1, 2)), expected, atol=1e-6)


@pytest.mark.parametrize("convention", ["paper", "authors_code"])
def test_authors_convention_informative_sums_to_jvp(convention):
    base, ft = make_pair("ln_gelu", torch.float64)
    diff = WeightDiff.from_models(base, ft)
    batch = small_batch(base)
    s = linear_scores(
        base, diff, batch, kinds=("informative",), convention=convention, reward="answer_logprob"
    )
    total = s.prompt_totals[0].sum((1, 2)) + s.other
    assert torch.allclose(total, ref.whole_model_jvp(base, ft, batch, answer_logprob), atol=1e-10)
    assert s.metadata["convention"] == convention


def test_authors_convention_credits_kv_at_key_position():
    """Q/K/V-only change: per-head totals agree across conventions, per-token splits differ."""
    base, ft = make_pair("ln_gelu", torch.float64)
    diff = WeightDiff.from_models(base, ft).restricted(["L1H0", "L1H1"])
    only_k = WeightDiff(
        {n: d for n, d in diff.deltas.items() if n.endswith(("W_K", "W_V"))}, diff.signature
    )
    batch = small_batch(base)
    paper = linear_scores(base, only_k, batch, kinds=("informative",), reward="answer_logprob")
    authors = linear_scores(
        base,
        only_k,
        batch,
        kinds=("informative",),
        reward="answer_logprob",
        convention="authors_code",
    )
    assert torch.allclose(paper.prompt_totals, authors.prompt_totals, atol=1e-12)
    assert not torch.allclose(paper.prompt_values, authors.prompt_values, atol=1e-6)
    # K/V changes at the last position cannot matter to earlier keys: with the key-position
    # convention the credit sits at positions <= the query positions, at the query one otherwise.
    first = authors.prompt_values[0, :, 1, 0, 0]  # position 0 gets key credit from all queries
    assert first.abs().max() > 0


def test_zero_diff_gives_zero_scores(pair64):
    base, _ = pair64
    batch = small_batch(base)
    s = linear_scores(base, WeightDiff.zeros_like(base), batch)
    assert s.values.abs().max() == 0 and s.other.abs().max() == 0


def test_prompt_order_does_not_change_means(pair64):
    base, ft = pair64
    diff = WeightDiff.from_models(base, ft)
    batch = small_batch(base, n=5)
    a = linear_scores(base, diff, batch, batch_size=2)
    perm = [3, 0, 4, 2, 1]
    b = linear_scores(base, diff, batch.subset(perm), batch_size=3)
    assert torch.allclose(a.totals, b.totals, atol=1e-12)
    assert torch.allclose(a.prompt_totals[:, perm], b.prompt_totals, atol=1e-12)
    # padding never leaks: a prompt scored alone equals the same prompt in the batch
    i = int(batch.lengths.argmin())
    assert batch.lengths[i] < batch.lengths.max()
    alone = linear_scores(base, diff, batch.subset([i]), kinds=("informative", "downstream"))
    both = linear_scores(base, diff, batch, kinds=("informative", "downstream"))
    width = alone.prompt_values.shape[-1]
    assert torch.allclose(
        alone.prompt_values[:, 0], both.prompt_values[:, i, ..., :width], atol=1e-12
    )
    assert both.prompt_values[:, i, ..., width:].abs().max() == 0


def test_heads_sum_to_layer_attention_totals(pair64):
    """Σ_h D̄_h = ŷ · (attn(z') - attn(z)) for the whole layer, computed independently."""
    base, ft = pair64
    diff = WeightDiff.from_models(base, ft)
    batch = small_batch(base)
    s = linear_scores(base, diff, batch, kinds=("downstream",))
    B, F = ref.attn_result_mode(base), ref.attn_result_mode(ft)
    with torch.no_grad():
        _, fc = F.run_with_cache(batch.tokens)
    layer = base.cfg.n_layers - 1
    # ŷ at attn_out: gradient of R wrt hook_attn_out, by TransformerLens hooks + autograd
    store = {}

    def keep(act, hook):
        act.retain_grad()
        store["a"] = act
        return act

    logits = base.run_with_hooks(batch.tokens, fwd_hooks=[(f"blocks.{layer}.hook_attn_out", keep)])
    answer_logprob(logits, batch).sum().backward()
    g = store["a"].grad
    base.zero_grad(set_to_none=True)
    st = ref.component_outputs(B, batch, layer, fc)
    with torch.no_grad():
        _, bc = B.run_with_cache(batch.tokens)
    d_attn = st["result"].sum(2) - bc[f"blocks.{layer}.attn.hook_result"].sum(2)
    expected = (g * d_attn).sum((-1, -2))
    got = s.prompt_totals[0, :, layer, : base.cfg.n_heads].sum(-1)
    assert torch.allclose(got, expected, atol=1e-10)


def _rel(a, b):
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))


def test_exact_over_eps_converges_to_linear(family):
    base, ft = make_pair(family, torch.float64, delta_scale=0.2)
    batch = small_batch(base, n=3)
    lin = linear_scores(base, WeightDiff.from_models(base, ft), batch, kinds=("informative",))
    errs = {}
    for eps in (1e-2, 1e-3):
        ft_eps = ref.scaled_model(base, ft, eps)
        ex = ref.literal_exact(base, ft_eps, batch, answer_logprob, ("informative", "downstream"))
        lin_eps = linear_scores(
            base, WeightDiff.from_models(base, ft_eps), batch, kinds=("downstream",)
        )
        errs[eps] = (
            _rel(ex["informative"] / eps, lin.prompt_values[0]),
            _rel(ex["downstream"] / eps, lin_eps.prompt_values[0] / eps),
        )
    for k in range(2):
        assert errs[1e-3][k] < 0.02, errs
        assert errs[1e-3][k] < errs[1e-2][k] / 4, errs  # first-order convergence
    # Negative control: at the full update the exact score is not the linear one.
    full = ref.literal_exact(base, ft, batch, answer_logprob, ("informative",))
    assert _rel(full["informative"], lin.prompt_values[0]) > 0.05


def test_upstream_double_limit(family):
    """U(εΔ, y* = y + δ(ȳ - y)) / (εδ) → Ū(εΔ)/ε, with ȳ the literal leave-one-out mean."""
    base, ft = make_pair(family, torch.float64, delta_scale=0.2)
    batch = small_batch(base, n=3)
    rs, ms = ref.literal_mean_ablation(base, batch)
    B = ref.attn_result_mode(base)
    with torch.no_grad():
        _, bc = B.run_with_cache(batch.tokens)
    L = base.cfg.n_layers
    res = torch.stack([bc[f"blocks.{l}.attn.hook_result"] for l in range(L)], dim=2)
    mlp = torch.stack([bc[f"blocks.{l}.hook_mlp_out"] for l in range(L)], dim=2)
    errs = []
    for eps, delta in ((1e-2, 1e-2), (1e-3, 1e-3)):
        ft_eps = ref.scaled_model(base, ft, eps)
        lin = linear_scores(base, WeightDiff.from_models(base, ft_eps), batch, kinds=("upstream",))
        star = (res + delta * (rs - res), mlp + delta * (ms - mlp))
        ex = ref.literal_exact(base, ft_eps, batch, answer_logprob, ("upstream",), y_star=star)
        errs.append(_rel(ex["upstream"] / (eps * delta), lin.prompt_values[0] / eps))
    assert errs[1] < 0.03 and errs[1] < errs[0] / 4, errs


def _affine_pair():
    cfg = dict(
        normalization_type=None, attn_only=True, n_layers=2, positional_embedding_type="standard"
    )
    base, ft = make_pair("ln_gelu", torch.float64, **cfg)
    return base, ft


def test_linear_equals_exact_where_reward_is_affine():
    """Last layer of an attention-only, LayerNorm-free model with a logit reward: R is affine
    in each head's output, and with Δ only on W_V (and W_U) each head is linear in Δ."""
    base, ft = _affine_pair()
    keep = ("blocks.0.attn.W_Q", "blocks.0.attn.W_V", "blocks.1.attn.W_V", "unembed.W_U")
    sd_b = {n: p.detach() for n, p in base.named_parameters()}
    sd_f = {n: (p.detach() if n in keep else sd_b[n]) for n, p in ft.named_parameters()}
    diff = WeightDiff.from_state_dicts(sd_b, sd_f, signature=WeightDiff.zeros_like(base).signature)
    ft_v = ref.mixed_model(base, ft, lambda n: n in keep)
    batch = small_batch(base)
    batch = make_batch(
        base, list(zip(batch.prompts, batch.answers)), counterfactuals=[7] * len(batch)
    )
    lin = linear_scores(base, diff, batch, reward=logit_diff)
    rs, ms = ref.literal_mean_ablation(base, batch)
    ex = ref.literal_exact(base, ft_v, batch, logit_diff, KINDS, y_star=(rs, ms))
    for k, kind in enumerate(KINDS):
        got, want = lin.prompt_values[k, :, 1], ex[kind][:, 1]
        assert (got - want).abs().max() < 1e-12, kind
        assert want.abs().max() > 1e-3, kind  # non-trivial
    # Negative controls: layer 0's W_Q change is not linear in Δ, and layer 0's output feeds
    # the nonlinear attention of layer 1: linear != exact there.
    assert (lin.prompt_values[0, :, 0] - ex["informative"][:, 0]).abs().max() > 1e-6
    assert (lin.prompt_values[1, :, 0] - ex["upstream"][:, 0]).abs().max() > 1e-6


def test_rewards_and_metadata():
    base, ft = make_pair("ln_gelu", torch.float64)
    diff = WeightDiff.from_models(base, ft)
    pairs = [([1, 5, 6], [7]), ([1, 8, 9, 10], [11])]
    batch = make_batch(base, pairs, candidates=[7, 11, 12])
    s = linear_scores(base, diff, batch, reward=logit_margin, kinds=("informative",))
    total = s.prompt_totals[0].sum((1, 2)) + s.other
    assert torch.allclose(total, ref.whole_model_jvp(base, ft, batch, logit_margin), atol=1e-10)
    assert s.metadata["reward"] == "logit_margin"
    assert len(s.metadata["diff_norms"]) == base.cfg.n_layers
    with pytest.raises(ValueError, match="Unknown reward"):
        linear_scores(base, diff, batch, reward="accuracy")
    with pytest.raises(ValueError, match="kinds"):
        linear_scores(base, diff, batch, kinds=("informative", "sideways"))


def test_model_left_bit_identical_and_no_hooks(pair64):
    base, ft = pair64
    snap = {n: p.detach().clone() for n, p in base.named_parameters()}
    flags = {n: p.requires_grad for n, p in base.named_parameters()}
    linear_scores(base, WeightDiff.from_models(base, ft), small_batch(base))
    for n, p in base.named_parameters():
        assert torch.equal(p, snap[n]) and p.requires_grad == flags[n] and p.grad is None
    assert all(not hp.fwd_hooks and not hp.bwd_hooks for hp in base.hook_dict.values())
    assert all(not m._forward_hooks for m in base.modules())


def test_gqa_authors_convention_runs_on_hooked_and_a_bridge_says_what_to_do():
    """Grouped-query informative in the authors' convention: a HookedTransformer scores it (and
    its view flag is restored); a TransformerBridge (the TransformerLens 4 run) refuses it with
    what to load instead, and still scores upstream and downstream in that convention."""
    base, ft = make_pair("rms_gated_rotary_gqa", torch.float64)
    diff, batch = WeightDiff.from_models(base, ft), small_batch(base)
    kw = dict(convention="authors_code", reward="answer_logprob")
    if type(base).__name__ == "HookedTransformer":
        s = linear_scores(base, diff, batch, **kw)
        assert s["informative"].abs().max() > 0
        assert base.cfg.ungroup_grouped_query_attention is False
    else:
        with pytest.raises(NotImplementedError, match=r"grouped-query.*backend='hooked'"):
            linear_scores(base, diff, batch, **kw)
        s = linear_scores(base, diff, batch, kinds=("upstream", "downstream"), **kw)
        assert s["downstream"].abs().max() > 0


def test_argument_mixups_say_what_to_pass():
    import extractive_lens as el
    from tests.conftest import make_pair

    base, ft = make_pair("ln_gelu", torch.float32)
    batch = make_batch(base, [([1, 2, 3], [4])])
    tokens = torch.tensor([[1, 2, 3, 4]])
    diff = el.WeightDiff.from_models(base, ft)
    with pytest.raises(
        TypeError, match=rf"diff must be a WeightDiff, got {type(ft).__name__}.*from_models"
    ):
        el.linear_scores(base, ft, batch)
    with pytest.raises(TypeError, match="diff must be a WeightDiff"):
        el.causal_scores(base, ft, batch)
    with pytest.raises(TypeError, match="batch must be a PromptBatch, got list.*make_batch"):
        el.linear_scores(base, diff, [("a", "b")])
    with pytest.raises(TypeError, match="model must be a HookedTransformer, got str"):
        el.causal_scores("gpt2", diff, None)
    with pytest.raises(TypeError, match="finetune.*batch must be a PromptBatch, got Tensor"):
        el.finetune(base, tokens)
    with pytest.raises(TypeError, match="mean_rank.*batch must be a PromptBatch"):
        el.mean_rank(base, tokens)


def test_additivity_check_against_full_forwards():
    """metadata["additivity"]: Σ informative + other against R(W') - R(W) from two plain forwards;
    it warns past a 50% gap only, and its note says it is about the sum, not the ranking."""
    import warnings

    from extractive_lens.scoring.linear import AdditivityWarning

    base, ft = make_pair("ln_gelu", torch.float64, delta_scale=0.05)
    batch = small_batch(base)
    full = WeightDiff.from_models(base, ft)
    with torch.no_grad():
        R0, R1 = answer_logprob(base(batch.tokens), batch), answer_logprob(ft(batch.tokens), batch)
    for eps in (1e-3, 1.0):
        d = full * eps
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            s = linear_scores(base, d, batch, kinds=("informative",))
        check = s.metadata["additivity"]
        lin = float((s.prompt_totals[0].sum((1, 2)) + s.other).mean())
        assert check["linear_change"] == pytest.approx(lin, rel=1e-12)
        if eps == 1.0:
            assert check["exact_change"] == pytest.approx(float((R1 - R0).mean()), rel=1e-10)
        # per prompt (docs/scores.md §11): misses of opposite sign in two prompts do not cancel
        with torch.no_grad(), d.applied(base):
            ex_p = answer_logprob(base(batch.tokens), batch) - R0
        lin_p = s.prompt_totals[0].sum((1, 2)) + s.other
        gap = float((lin_p - ex_p).abs().sum() / torch.maximum(lin_p.abs(), ex_p.abs()).sum())
        assert check["relative_gap"] == pytest.approx(gap, rel=1e-6)
        warned = any(issubclass(w.category, AdditivityWarning) for w in caught)
        assert warned == (gap > 0.5) and check["ok"] == (gap <= 0.3)
        note = s.additivity_note()
        assert "Additivity" in note and "other" in note and "not the ranking" in note
    assert linear_scores(base, full * 1e-3, batch, kinds=("informative",)).metadata["additivity"][
        "ok"
    ]
    assert not check["ok"]  # the full random update is far from linear: the check can fail


def test_upstream_needs_other_prompts_for_y_star():
    base, ft = make_pair("ln_gelu", torch.float64)
    diff = WeightDiff.from_models(base, ft)
    one = small_batch(base, n=1)
    for ablation in ("mean", "resample"):
        with pytest.raises(ValueError, match="only one prompt.*reference=.*ablation='zero'"):
            linear_scores(base, diff, one, ablation=ablation)
    from extractive_lens import causal_scores

    with pytest.raises(ValueError, match="only one prompt"):
        causal_scores(base, diff, one)
    with pytest.raises(ValueError, match="resample_k must be a positive"):
        linear_scores(base, diff, small_batch(base), ablation="resample", resample_k=0)
    zero = linear_scores(base, diff, one, ablation="zero")  # what the error suggests works
    assert zero.prompt_values[zero.kind_index("upstream")].abs().max() > 0
    assert linear_scores(base, diff, one, kinds=("informative", "downstream")).kinds == (
        "informative",
        "downstream",
    )


@needs_hooked
@pytest.mark.parametrize("flag", ["use_attn_result", "use_split_qkv_input"])
def test_transformer_lens_view_flags_are_handled_and_restored(flag):
    """Models with TransformerLens's optional attention flags on score as with them off."""
    from extractive_lens import causal_scores, tiny_model

    base, ft = make_pair("ln_gelu", torch.float64)
    flagged = tiny_model(
        {
            **{
                k: getattr(base.cfg, k)
                for k in (
                    "n_layers",
                    "d_model",
                    "n_heads",
                    "d_head",
                    "d_mlp",
                    "d_vocab",
                    "n_ctx",
                    "act_fn",
                )
            },
            "dtype": torch.float64,
            flag: True,
        }
    )
    flagged.load_state_dict(base.state_dict())
    diff = WeightDiff.from_models(base, ft)
    batch = small_batch(base)
    for fn in (linear_scores, causal_scores):
        want = fn(base, diff, batch)
        got = fn(flagged, diff, batch)
        assert torch.allclose(got.prompt_values, want.prompt_values, atol=1e-12), fn.__name__
        assert getattr(flagged.cfg, flag) is True  # the user's setting is back
    with torch.no_grad():  # and the model still runs with it
        assert torch.allclose(flagged(batch.tokens), base(batch.tokens), atol=1e-12)

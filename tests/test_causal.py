"""Exact causal scores against literal one-forward-per-intervention computations (float64)."""

from __future__ import annotations

import pytest
import torch

from extractive_lens import WeightDiff, causal_scores, linear_scores, make_batch
from extractive_lens.rewards import answer_logprob, logit_margin
from tests import reference as ref
from tests.conftest import make_pair
from tests.helpers import small_batch

KINDS = ("informative", "upstream", "downstream")


def _assert_equals_literal(got, ex, batch, per):
    """Every kind of ``got`` equals the literal exact scores ``ex`` (per token: on real
    positions), and the literal scores are not all zero."""
    for k, kind in enumerate(KINDS):
        want = ex[kind]
        have = got.prompt_values[k] if per == "token" else got.prompt_totals[k]
        if per == "token":
            want = want * batch.position_mask[:, None, None, :]
        assert (have - want).abs().max() < 1e-10, kind
        assert want.abs().max() > 1e-4, kind


@pytest.mark.parametrize("per", ["token", "component"])
def test_engine_equals_literal(family, per):
    base, ft = make_pair(family, torch.float64, delta_scale=0.2)
    batch = small_batch(base, n=3)
    rs, ms = ref.literal_mean_ablation(base, batch)
    ex = ref.literal_exact(base, ft, batch, answer_logprob, KINDS, y_star=(rs, ms), per=per)
    got = causal_scores(base, WeightDiff.from_models(base, ft), batch, per=per, max_batch=7)
    _assert_equals_literal(got, ex, batch, per)
    # Negative control: a different diff gives different exact scores.
    other = causal_scores(
        base, WeightDiff.from_models(base, ft) * 0.5, batch, per=per, kinds=("informative",)
    )
    assert (other.prompt_totals[0] - got.prompt_totals[0]).abs().max() > 1e-6


@pytest.mark.parametrize("per", ["token", "component"])
def test_passes_a_row_at_a_time_equal_literal(family, per, monkeypatch):
    """The large-model path (``runs.layerwise``): the resumed passes go layer by layer, a block
    of rows at a time (``passes.resume``; here one row per block), and give the literal
    scores: every kind, so base and finetuned-late contexts, heads and MLPs."""
    from extractive_lens.scoring import runs

    base, ft = make_pair(family, torch.float64, delta_scale=0.2)
    batch = small_batch(base, n=3)
    rs, ms = ref.literal_mean_ablation(base, batch)
    ex = ref.literal_exact(base, ft, batch, answer_logprob, KINDS, y_star=(rs, ms), per=per)
    monkeypatch.setattr(runs, "LAYERWISE_BYTES", -1)
    monkeypatch.setattr(runs, "BLOCK_TOKENS", 1)
    got = causal_scores(base, WeightDiff.from_models(base, ft), batch, per=per, max_batch=7)
    _assert_equals_literal(got, ex, batch, per)


def test_totals_are_whole_component_patches(pair64):
    base, ft = pair64
    batch = small_batch(base, n=3)
    rs, ms = ref.literal_mean_ablation(base, batch)
    ex = ref.literal_exact(base, ft, batch, answer_logprob, KINDS, y_star=(rs, ms), per="component")
    got = causal_scores(base, WeightDiff.from_models(base, ft), batch, per="token")
    for k, kind in enumerate(KINDS):
        assert (got.prompt_totals[k] - ex[kind]).abs().max() < 1e-10, kind


def test_downstream_mlp_matches_transformer_lens_patching():
    """Per-token downstream MLP scores equal TransformerLens's own activation patching, run on
    a cache of the patch values f_c(z'_c, W_c) (summed over prompts, as TL patches all rows)."""
    from transformer_lens import patching
    from transformer_lens.ActivationCache import ActivationCache

    base, ft = make_pair("ln_gelu", torch.float64, delta_scale=0.2)
    batch = small_batch(base, n=3)
    B, F = ref.attn_result_mode(base), ref.attn_result_mode(ft)
    with torch.no_grad():
        _, fc = F.run_with_cache(batch.tokens)
    values = {}
    for layer in range(base.cfg.n_layers):
        values[f"blocks.{layer}.hook_mlp_out"] = ref.component_outputs(B, batch, layer, fc)["mlp"]
    cache = ActivationCache(values, base)
    R0 = answer_logprob(base(batch.tokens), batch).sum()

    def metric(logits):
        return answer_logprob(logits, batch).sum() - R0

    with torch.no_grad():
        tl = patching.get_act_patch_mlp_out(base, batch.tokens, cache, metric)  # [layer, pos]
    ours = causal_scores(base, WeightDiff.from_models(base, ft), batch, kinds=("downstream",))
    have = ours.prompt_values[0, :, :, -1, :].sum(0)  # MLP column, summed over prompts
    assert torch.allclose(have, tl.to(have.dtype), atol=1e-10)
    assert tl.abs().max() > 1e-4


def test_exact_over_eps_tends_to_linear(family):
    base, ft = make_pair(family, torch.float64, delta_scale=0.2)
    batch = small_batch(base, n=3)
    diff = WeightDiff.from_models(base, ft)
    errs = []
    for eps in (1e-2, 1e-3):
        d = diff * eps
        lin = linear_scores(base, d, batch, kinds=("informative", "downstream"))
        ex = causal_scores(base, d, batch, kinds=("informative", "downstream"))
        errs.append(
            float(
                ((ex.prompt_values - lin.prompt_values) / eps).abs().max()
                / (lin.prompt_values / eps).abs().max()
            )
        )
    assert errs[1] < 0.02 and errs[1] < errs[0] / 4, errs


def test_whole_component_informative_is_a_weight_swap():
    base, ft = make_pair("ln_gelu", torch.float64, delta_scale=0.2)
    batch = small_batch(base, n=3)
    # no ln1 change, so swapping one head's weights literally changes only that head
    diff = WeightDiff.from_models(base, ft)
    no_ln1 = WeightDiff({n: d for n, d in diff.deltas.items() if ".ln1." not in n}, diff.signature)
    ex = causal_scores(base, no_ln1, batch, kinds=("informative",), per="component")
    R0 = answer_logprob(base(batch.tokens), batch)
    for label, col in (("L1H2", 2), ("L0MLP", base.cfg.n_heads), ("L1MLP", base.cfg.n_heads)):
        layer = int(label[1])
        with torch.no_grad(), no_ln1.applied(base, components=[label]):
            swapped = answer_logprob(base(batch.tokens), batch) - R0
        assert torch.allclose(ex.prompt_totals[0, :, layer, col], swapped, atol=1e-10), label


def test_top_k_scores_only_selected_components(pair64):
    """Cells a partial run never computed are NaN (not 0) in every view of the result, and
    absent from top(); the computed ones equal the full run's."""
    base, ft = pair64
    batch = small_batch(base, n=3)
    diff = WeightDiff.from_models(base, ft)
    lin = linear_scores(base, diff, batch, kinds=("informative",))
    full = causal_scores(base, diff, batch, kinds=("informative",))
    top = causal_scores(base, diff, batch, kinds=("informative",), top_k=3, linear=lin)
    # independent of the package's ranking: the three largest |linear totals|, by numpy
    t = lin.totals[0].numpy()
    flat = sorted(range(t.size), key=lambda i: -abs(t.flat[i]))[:3]
    kept = {f"L{i // t.shape[1]}{full.component_labels[i % t.shape[1]]}" for i in flat}
    for layer in range(base.cfg.n_layers):
        for c, name in enumerate(full.component_labels):
            lab = f"L{layer}{name}"
            if lab in kept:
                assert torch.allclose(top.totals[0, layer, c], full.totals[0, layer, c], atol=1e-12)
                assert torch.allclose(top.values[0, layer, c], full.values[0, layer, c], atol=1e-12)
            else:
                assert torch.isnan(top.totals[0, layer, c])
                assert torch.isnan(top.values[0, layer, c]).all()
                assert torch.isnan(top.prompt_values[0, :, layer, c]).all()
    assert {lab for _, lab, _ in top.top(100)} == kept  # never-computed cells are not ranked
    assert set(top.uncomputed("informative")) == set(top.metadata["skipped"]["informative"])
    assert len(top.uncomputed("informative")) == t.size - 3 and top.partial and not full.partial
    df = top.to_dataframe()
    computed = df[df.component.radd("L" + df.layer.astype(str)).isin(kept)]
    assert df.score.isna().sum() == len(df) - len(computed) and computed.score.notna().all()


def test_top_k_chooses_within_layers(pair64):
    """--top-k with --layers: the k components are the top k *of those layers*, so k are
    scored (not the global top k cut to the layers)."""
    base, ft = pair64
    batch = small_batch(base, n=3)
    diff = WeightDiff.from_models(base, ft)
    lin = linear_scores(base, diff, batch, kinds=("downstream",))
    last = base.cfg.n_layers - 1
    part = causal_scores(base, diff, batch, kinds=("downstream",), per="component", top_k=2,
                         layers=[last], linear=lin)  # fmt: skip
    t = lin.totals[0, last].numpy()
    want = {
        f"L{last}{part.component_labels[i]}"
        for i in sorted(range(len(t)), key=lambda i: -abs(t[i]))[:2]
    }
    assert {lab for _, lab, _ in part.top(100)} == want
    assert part.totals[0, :last].isnan().all()


def test_logit_margin_and_model_untouched(pair64):
    base, ft = pair64
    snap = {n: p.detach().clone() for n, p in base.named_parameters()}
    batch = make_batch(base, [([1, 5, 6], [7]), ([1, 8, 9, 10], [11])], candidates=[7, 11, 12])
    s = causal_scores(
        base, WeightDiff.from_models(base, ft), batch, reward=logit_margin, kinds=("downstream",)
    )
    assert s.metadata["reward"] == "logit_margin" and s.method == "causal"
    for n, p in base.named_parameters():
        assert torch.equal(p, snap[n])
    assert all(not hp.fwd_hooks for hp in base.hook_dict.values())

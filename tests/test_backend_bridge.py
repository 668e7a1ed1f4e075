"""The TransformerBridge backend: every score kind, linear and exact, equal to the
HookedTransformer backend's on identical weights (TransformerLens 3.9), and checks that need no
HookedTransformer (TransformerLens 4.3 has none): exact scores against literal patching through
the bridge's own hooks, linear informative against a finite difference, weights restored.
"""

from __future__ import annotations

import pytest
import torch

import extractive_lens as el
from extractive_lens import backend as B
from extractive_lens.backend.building import as_bridge
from extractive_lens.backend.installed import has_hooked
from extractive_lens.backend.loading import load_checkpoint
from extractive_lens.rewards import answer_logprob
from tests.conftest import make_pair

transformers = pytest.importorskip("transformers")

HOOKED = has_hooked()  # TransformerLens 4 removed HookedTransformer
needs_hooked = pytest.mark.skipif(not HOOKED, reason="TransformerLens 4 has no HookedTransformer")
VOCAB = 64


def _save_tokenizer(path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {
        "<unk>": 0,
        "<bos>": 1,
        "<eos>": 2,
        "<pad>": 3,
        **{f"w{i}": i for i in range(4, VOCAB)},
    }
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", unk_token="<unk>",
        pad_token="<pad>",
    ).save_pretrained(path)  # fmt: skip


def _hf_config(arch: str):
    if arch == "gpt2":  # tied embeddings, fused QKV stored next to its split views
        return transformers.GPT2Config(
            vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64
        )
    if arch == "qwen3":  # query/key norms, which TransformerLens's bridge does not name
        return transformers.Qwen3Config(
            vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=12, intermediate_size=48, max_position_embeddings=64,
        )  # fmt: skip
    return transformers.LlamaConfig(  # grouped-query attention, rotary, RMS norms
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=48, max_position_embeddings=64,
    )  # fmt: skip


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def checkpoints(request, tmp_path_factory):
    """A base and a finetuned Hugging Face checkpoint (random weights, non-trivial norms)."""
    return _save_checkpoints(request.param, tmp_path_factory)


def _save_checkpoints(arch, tmp_path_factory):
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(_hf_config(arch)).float().eval()
    paths = []
    for i in range(2):
        with torch.no_grad():
            for n, p in hf.named_parameters():
                p.add_(
                    (0.1 if i == 0 and ("norm" in n or "ln" in n) else 0.02) * torch.randn_like(p)
                )
        path = tmp_path_factory.mktemp(f"{arch}{i}")
        hf.save_pretrained(path)
        _save_tokenizer(path)
        paths.append(path)
    return arch, paths


def _batch(model, n: int = 4):
    g = torch.Generator().manual_seed(1)
    V = model.cfg.d_vocab
    pairs = [([1] + torch.randint(4, V, (4 + i % 2,), generator=g).tolist(), [10 + i])
             for i in range(n)]  # fmt: skip
    return el.make_batch(model, pairs, candidates=[10 + i for i in range(n)])


def _native_pair():
    base, ft = make_pair("ln_gelu", torch.float64)
    return base, ft, as_bridge(base), as_bridge(ft)


def _hf_pairs(checkpoints, dtype):
    _, (p0, p1) = checkpoints
    bridges = [load_checkpoint(p, dtype=dtype, backend="bridge") for p in (p0, p1)]
    hooked = [load_checkpoint(p, dtype=dtype) for p in (p0, p1)] if HOOKED else [None, None]
    return (*hooked, *bridges)


CONVENTIONS = {
    "paper": ({}, {}),
    "authors_code": ({"convention": "authors_code"}, {"reward": "logit_margin", "ablation": "resample"}),
}  # fmt: skip


def _assert_same_scores(hb, hf_, bb, bf, conventions, atol):
    d_h, d_b = el.WeightDiff.from_models(hb, hf_), el.WeightDiff.from_models(bb, bf)
    batch = _batch(hb)
    for conv in conventions:
        lin_kw, exact_kw = CONVENTIONS[conv]
        methods = [("linear", lin_kw), ("causal", exact_kw)]
        if conv == "paper":
            methods.append(("integrated", {"steps": 2}))
        for method, kw in methods:
            fn = {"linear": el.linear_scores, "causal": el.causal_scores,
                  "integrated": el.integrated_scores}[method]  # fmt: skip
            a = fn(hb, d_h, batch, show_progress=False, **kw)
            b = fn(bb, d_b, batch, show_progress=False, **kw)
            assert a.kinds == b.kinds == ("informative", "upstream", "downstream")
            for kind in a.kinds:
                assert a[kind].abs().max() > 1e-4, (conv, method, kind)  # not trivially equal
                err = (a[kind] - b[kind]).abs().max().item()
                assert err < atol, f"{conv} {method} {kind}: bridge differs by {err:.1e}"
            assert b.metadata["backend"] == "transformer_bridge"


@needs_hooked
def test_native_bridge_scores_equal_hooked_float64():
    _assert_same_scores(*_native_pair(), ("paper", "authors_code"), atol=1e-10)


@needs_hooked
def test_hf_bridge_scores_equal_hooked(checkpoints):
    arch = checkpoints[0]
    if arch == "gpt2":  # float64 LayerNorm model: exact to rounding
        _assert_same_scores(
            *_hf_pairs(checkpoints, torch.float64), ("paper", "authors_code"), 1e-10
        )
    else:  # Llama with GQA in float32 (HF computes RMSNorm in float32); scores are ~1e-2
        _assert_same_scores(*_hf_pairs(checkpoints, torch.float32), ("paper",), 5e-6)


@needs_hooked
def test_authors_convention_on_a_grouped_query_bridge(checkpoints):
    """The authors' upstream and downstream (read at hook_z, per query head already) on a
    grouped-query Llama bridge equal the HookedTransformer's; their informative score needs each
    query head's own key/value copy, which only the HookedTransformer has: the bridge says so."""
    if checkpoints[0] == "gpt2":
        pytest.skip("GPT-2 has no grouped-query attention")
    hb, hf_, bb, bf = _hf_pairs(checkpoints, torch.float32)
    d_h, d_b = el.WeightDiff.from_models(hb, hf_), el.WeightDiff.from_models(bb, bf)
    batch = _batch(hb)
    kw = dict(convention="authors_code", kinds=("upstream", "downstream"), show_progress=False)
    a, b = el.linear_scores(hb, d_h, batch, **kw), el.linear_scores(bb, d_b, batch, **kw)
    for kind in a.kinds:
        assert a[kind].abs().max() > 1e-4
        assert (a[kind] - b[kind]).abs().max() < 5e-6, kind
    with pytest.raises(NotImplementedError, match="backend='hooked'"):
        el.linear_scores(bb, d_b, batch, convention="authors_code", kinds=("informative",))
    inf = el.linear_scores(hb, d_h, batch, convention="authors_code", kinds=("informative",))
    assert inf["informative"].abs().max() > 1e-4


@needs_hooked
def test_weight_diff_moves_between_classes(checkpoints):
    """A Δ made on HookedTransformers applies to the bridge (and back), and the bridge is restored
    bit for bit after ``applied``."""
    hb, hf_, bb, bf = _hf_pairs(checkpoints, torch.float64)
    d_h, d_b = el.WeightDiff.from_models(hb, hf_), el.WeightDiff.from_models(bb, bf)
    assert set(d_h.deltas) == set(d_b.deltas)
    for name, d in d_h.deltas.items():
        assert torch.equal(d, d_b.deltas[name]), name
    tokens = torch.tensor([[1, 5, 6, 7, 8]])
    before = {n: t.clone() for n, t in B.parameters(bb).items()}
    with torch.no_grad(), d_h.applied(bb):
        got = bb(tokens)
    assert torch.allclose(got, bf(tokens), atol=1e-12, rtol=0)
    assert all(torch.equal(before[n], t) for n, t in B.parameters(bb).items())


@needs_hooked
def test_finetune_on_bridge_equals_hooked():
    base, _, bb, _ = _native_pair()
    batch = _batch(base)
    for trainable in ("all", ("L0MLP", "L1H2")):
        cfg = el.FinetuneConfig(lr=1e-3, epochs=2, batch_size=2, trainable=trainable)
        d_h = el.finetune(base, batch, cfg, show_progress=False)
        d_b = el.finetune(bb, batch, cfg, show_progress=False)
        for name, d in d_h.deltas.items():
            # atol: Adam turns gradients that are zero in exact arithmetic (key biases) into
            # steps of the size of their rounding noise, ~1e-11 here; real steps are ~1e-3
            assert torch.allclose(d, d_b.deltas[name], atol=1e-9, rtol=0), (trainable, name)
        assert el.mean_rank(base, batch, d_h) == el.mean_rank(bb, batch, d_b)


@needs_hooked
def test_as_bridge_refuses_what_the_native_bridge_does_not_compute():
    base, _ = make_pair("parallel_rotary", torch.float64)
    with pytest.raises(NotImplementedError, match="native TransformerBridge does not compute"):
        as_bridge(base)


# ---------------------------------------------------------------------------------------------
# Checks that need no HookedTransformer (run on TransformerLens 3.9 and 4.3)
# ---------------------------------------------------------------------------------------------


def _bridge_pair(checkpoints, dtype=torch.float64):
    _, (p0, p1) = checkpoints
    return [load_checkpoint(p, dtype=dtype, backend="bridge") for p in (p0, p1)]


def test_load_checkpoint_as_bridge_is_quiet_and_matches_hf(checkpoints, capfd):
    _, (p0, _) = checkpoints
    capfd.readouterr()
    bb = load_checkpoint(p0, dtype=torch.float32, backend="bridge")
    out, err = capfd.readouterr()
    assert out == "" and "Loading" not in err
    hf = transformers.AutoModelForCausalLM.from_pretrained(p0).eval()
    tokens = torch.tensor([[1, 5, 6, 7, 8, 9]])
    with torch.no_grad():
        assert torch.allclose(bb(tokens), hf(tokens).logits, atol=1e-5)
    assert type(bb).__name__ == "TransformerBridge" and B.kv_prefix(bb)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_checkpoint_without_tokenizer_loads_as_a_bridge(arch, tmp_path):
    """A checkpoint saved without tokenizer files loads as a bridge with no tokenizer (as a
    HookedTransformer does; TransformerLens 4's boot_transformers looked for one and failed), its
    logits the checkpoint's; token prompts score, text prompts say the tokenizer is missing.
    ``from_hf`` without a tokenizer likewise (it looked one up by the model's name)."""
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(_hf_config(arch)).eval()
    hf.save_pretrained(tmp_path)
    assert not list(tmp_path.glob("tokenizer*"))
    bb = load_checkpoint(tmp_path, dtype=torch.float32, backend="bridge")
    assert bb.tokenizer is None
    tokens = torch.tensor([[1, 5, 6, 7, 8, 9]])
    with torch.no_grad():
        assert torch.allclose(bb(tokens), hf(tokens).logits, atol=1e-5)
    batch = el.make_batch(bb, [([1, 5, 6], [7]), ([1, 8, 9, 10], [11])])
    scores = el.linear_scores(bb, el.WeightDiff.zeros_like(bb), batch, kinds="informative",
                              show_progress=False)  # fmt: skip
    assert scores["informative"].abs().max() == 0
    with pytest.raises(ValueError, match="no tokenizer"):
        el.make_batch(bb, [("w5 w6", " w7")])
    in_memory = el.from_hf(hf, backend="bridge")  # none given: none looked up by name either
    assert in_memory.tokenizer is None
    with torch.no_grad():
        assert torch.allclose(in_memory(tokens), hf(tokens).logits, atol=1e-5)


def test_exact_downstream_equals_literal_patching_through_bridge_hooks(checkpoints):
    """Exact downstream per token (MLPs and heads: the base component on the finetuned run's
    input, patched into the base run), against one patched forward per cell using the bridge's
    own ``run_with_cache`` / ``run_with_hooks`` (``hook_resid_pre``, ``hook_z``, ``hook_mlp_out``)."""
    bb, bf = _bridge_pair(checkpoints)
    diff = el.WeightDiff.from_models(bb, bf)
    batch = el.make_batch(bb, [([1, 5, 9, 7, 30], [10]), ([1, 8, 6, 40, 7], [11])])  # same length
    got = el.causal_scores(bb, diff, batch, kinds="downstream", show_progress=False).prompt_values[
        0
    ]
    toks = batch.tokens
    _, ft_cache = bf.run_with_cache(toks)
    with torch.no_grad():
        R0 = answer_logprob(bb(toks), batch)
    H = bb.cfg.n_heads
    for layer in range(bb.cfg.n_layers):
        hook_z = f"blocks.{layer}.attn.hook_z"
        # the base layer on the finetuned run's input (the stream replaced at the layer's input)
        resid = ft_cache[f"blocks.{layer}.hook_resid_pre"]
        with (
            torch.no_grad(),
            bb.hooks(fwd_hooks=[(f"blocks.{layer}.hook_resid_pre", lambda a, hook, r=resid: r)]),
        ):
            new_z = bb.run_with_cache(toks)[1][hook_z]
            mid = ft_cache[f"blocks.{layer}.hook_resid_mid"]
            new_mlp = bb.blocks[layer].mlp(bb.blocks[layer].ln2(mid))
        for pos in range(toks.shape[1]):
            for comp in range(H + 1):

                def patch(act, hook, pos=pos, comp=comp):
                    act = act.clone()
                    if comp < H:
                        act[:, pos, comp] = new_z[:, pos, comp]
                    else:
                        act[:, pos] = new_mlp[:, pos]
                    return act

                name = hook_z if comp < H else f"blocks.{layer}.hook_mlp_out"
                with torch.no_grad():
                    R = answer_logprob(bb.run_with_hooks(toks, fwd_hooks=[(name, patch)]), batch)
                want = (R - R0) * batch.position_mask[:, pos]
                assert torch.allclose(got[:, layer, comp, pos], want, atol=1e-9), (layer, comp, pos)
    assert got.abs().max() > 1e-4


def test_linear_informative_total_is_the_derivative_along_delta(checkpoints):
    """Σ informative + other = d/dε R(W + εΔ) at 0 (central finite difference)."""
    bb, bf = _bridge_pair(checkpoints)
    diff = el.WeightDiff.from_models(bb, bf)
    batch = _batch(bb)
    lin = el.linear_scores(bb, diff, batch, kinds="informative", show_progress=False)
    per_prompt = lin.prompt_totals[0].sum((1, 2)) + lin.other
    eps = 1e-4

    def R(scale):
        with torch.no_grad(), diff.applied(bb, scale=scale):
            return answer_logprob(bb(batch.tokens), batch)

    fd = (R(eps) - R(-eps)) / (2 * eps)
    tol = 1e-7 if checkpoints[0] == "gpt2" else 1e-4  # Llama's RMSNorm runs in float32
    assert torch.allclose(per_prompt, fd, atol=tol), (per_prompt, fd)
    assert not torch.allclose(per_prompt - lin.other, fd, atol=tol)  # "other" matters


def test_query_key_norms_are_part_of_a_bridges_delta(tmp_path_factory):
    """Qwen3's q/k norms: in the bridge's Δ (applied, it gives the finetuned model), and scored
    as the HookedTransformer (whose scores match the reference, test_model.py) scores them."""
    checkpoints = _save_checkpoints("qwen3", tmp_path_factory)
    bb, bf = _bridge_pair(checkpoints)
    diff = el.WeightDiff.from_models(bb, bf)
    assert diff.deltas["blocks.1.attn.k_norm.w"].abs().max() > 1e-3
    tokens = torch.tensor([[1, 5, 9, 22, 7, 30]])
    with torch.no_grad():
        want = bf(tokens)
        with diff.applied(bb):
            got = bb(tokens)
    assert (got - want).abs().max() < 1e-10 * want.abs().max()
    if HOOKED:
        _assert_same_scores(*_hf_pairs(checkpoints, torch.float32), ("paper",), 5e-6)


def test_kv_prefix_path_equals_whole_sequences(checkpoints, monkeypatch):
    bb, bf = _bridge_pair(checkpoints)
    diff = el.WeightDiff.from_models(bb, bf)
    batch = _batch(bb)
    fast = el.causal_scores(bb, diff, batch, show_progress=False)
    monkeypatch.setattr(B.bridge, "kv_prefix", lambda model: False)
    slow = el.causal_scores(bb, diff, batch, show_progress=False)
    for kind in fast.kinds:
        assert torch.allclose(fast[kind], slow[kind], atol=1e-10), kind


@pytest.mark.parametrize("regime", ["small", "large"])
def test_tied_and_unstored_weights_are_clear_errors(checkpoints, regime, monkeypatch):
    """Refused whatever the model's size: as a large model (gradients one layer at a time, the
    vocabulary matrices read a part at a time) the embedding's and the unembedding's Δ were
    read in two passes that never met, and tied ones that differ were scored silently."""
    from extractive_lens.backend import shift
    from extractive_lens.scoring import runs

    if regime == "large":
        monkeypatch.setattr(shift, "REUSE_BYTES", 0)
        monkeypatch.setattr(runs, "LAYERWISE_BYTES", -1)
    arch = checkpoints[0]
    bb, bf = _bridge_pair(checkpoints)
    diff = el.WeightDiff.from_models(bb, bf)
    before = {n: t.clone() for n, t in B.parameters(bb).items()}
    if arch == "gpt2":  # W_E and W_U are one tensor in Hugging Face's GPT-2
        bad = el.WeightDiff(
            dict(diff.deltas, **{"unembed.W_U": diff.deltas["unembed.W_U"] + 1e-3}), diff.signature
        )
        match = "tied weights"
    else:  # Llama stores no biases; TransformerLens shows zeros
        b_in = diff.deltas["blocks.0.mlp.b_in"]
        bad = el.WeightDiff(dict(diff.deltas, **{"blocks.0.mlp.b_in": b_in + 1}), diff.signature)
        match = "not a stored weight"
    with pytest.raises(ValueError, match=match):
        with bad.applied(bb):
            pass
    assert all(torch.equal(before[n], t) for n, t in B.parameters(bb).items())
    for fn in (el.linear_scores, el.integrated_scores):
        with pytest.raises(ValueError, match=match):
            fn(bb, bad, _batch(bb), kinds="informative", show_progress=False)


def test_integrated_in_the_large_model_regime_equals_the_small(checkpoints, monkeypatch):
    """A bridge scored as a large model (Δ held two layers at a time, ``W + αΔ`` formed in each
    piece, gradients one layer at a time) gives the small model's integrated scores (float64,
    1e-12). Llama stores no MLP biases (TransformerLens shows zeros): ``from_models`` gives
    zero Δ there, a diff of the changed tensors only has none; both score alike in both
    regimes, and a change there is refused in both."""
    from extractive_lens.backend import shift
    from extractive_lens.scoring import runs

    arch = checkpoints[0]
    bb, bf = _bridge_pair(checkpoints)
    diff = el.WeightDiff.from_models(bb, bf)
    changed = el.WeightDiff(
        {n: d for n, d in diff.deltas.items() if bool(d.ne(0).any())}, diff.signature
    )
    dropped = set(diff.deltas) - set(changed.deltas)  # b_U; Llama's MLP biases too
    assert "unembed.b_U" in dropped and ("blocks.0.mlp.b_in" in dropped) == (arch == "llama")
    batch = _batch(bb, n=2)
    kw = dict(steps=2, show_progress=False)
    want = el.integrated_scores(bb, diff, batch, **kw)
    assert want.values.abs().max() > 1e-4
    bad = None
    if arch == "llama":
        b_in = diff.deltas["blocks.0.mlp.b_in"]
        bad = el.WeightDiff(dict(diff.deltas, **{"blocks.0.mlp.b_in": b_in + 1}), diff.signature)
    for regime in ("small", "large"):
        if regime == "large":
            monkeypatch.setattr(shift, "REUSE_BYTES", 0)
            monkeypatch.setattr(runs, "LAYERWISE_BYTES", -1)
            assert runs.layerwise(bb, batch)
        for d in (diff, changed):
            got = el.integrated_scores(bb, d, batch, **kw)
            torch.testing.assert_close(got.values, want.values, rtol=0, atol=1e-12)
            torch.testing.assert_close(got.other, want.other, rtol=0, atol=1e-12)
        if bad is not None:
            with pytest.raises(ValueError, match="not a stored weight"):
                el.integrated_scores(bb, bad, batch, **kw)


def test_finetune_bridge_restores_and_trains_only_the_selection(checkpoints):
    bb, _ = _bridge_pair(checkpoints, torch.float32)
    before = {n: t.clone() for n, t in B.parameters(bb).items()}
    raw_before = {n: p.clone() for n, p in bb.named_parameters()}
    cfg = el.FinetuneConfig(lr=1e-2, epochs=2, batch_size=2, trainable=("L1MLP", "L0H1"))
    diff = el.finetune(bb, _batch(bb), cfg, show_progress=False)
    assert all(torch.equal(raw_before[n], p) for n, p in bb.named_parameters())
    assert all(torch.equal(before[n], t) for n, t in B.parameters(bb).items())
    changed = {n for n, d in diff.deltas.items() if d.ne(0).any()}
    assert changed and all(
        n.startswith(("blocks.1.mlp", "blocks.1.ln2", "blocks.0.")) for n in changed
    )
    W_Q = diff.deltas["blocks.0.attn.W_Q"]
    assert W_Q[1].ne(0).any() and W_Q[[0, 2, 3]].eq(0).all()  # head 1 only
    assert diff.metadata["losses"][-1] < diff.metadata["losses"][0]


def test_user_hooks_on_a_bridge_are_refused(checkpoints):
    bb, bf = _bridge_pair(checkpoints)
    diff = el.WeightDiff.from_models(bb, bf)
    with bb.hooks(fwd_hooks=[("blocks.0.hook_mlp_out", lambda a, hook: a)]):
        with pytest.raises(ValueError, match="hooks attached"):
            el.linear_scores(bb, diff, _batch(bb), show_progress=False)


@needs_hooked
def test_world_model_bridge_runs_experiments_and_views_as_hooked():
    """The bundled world model as a bridge: layer freezing (with pre-freezing, which names
    parameters) gives the HookedTransformer's mean ranks; the attention view the same pattern."""
    from extractive_lens.experiments import layer_freezing
    from extractive_lens.plotting import attention_view
    from extractive_lens.world import first_hop, load_world_model

    hooked, bridge = (
        load_world_model(dtype=torch.float64),
        load_world_model(dtype=torch.float64, backend="bridge"),
    )
    ds = first_hop()
    small = type(ds)(**{**ds.__dict__, "facts": ds.facts[:4], "implications": ds.implications[:4]})
    cfg = el.FinetuneConfig(lr=1e-3, epochs=2, batch_size=4)
    a = layer_freezing(hooked, {"first_hop": small}, cfg, split=0.5).to_dataframe()
    b = layer_freezing(bridge, {"first_hop": small}, cfg, split=0.5).to_dataframe()
    assert len(a) == len(b) and (a["condition"] == b["condition"]).all()
    assert (a["mean_rank"] - b["mean_rank"]).abs().max() < 1e-9
    batch = small.batches(hooked)[0]
    x = B.embed(hooked, batch.tokens)
    pa = B.attention(hooked, 0, x, ("pattern",))[1]["pattern"]
    pb = B.attention(bridge, 0, x, ("pattern",))[1]["pattern"]
    assert pa.shape == pb.shape and torch.allclose(pa, pb, atol=1e-12)
    assert "attention" in attention_view(bridge, batch, 1).local_src.lower()


def _plain_world_logits(tokens: torch.Tensor) -> torch.Tensor:
    """The world model's forward pass written out in plain torch from its weight file (GPT-2
    style: learned positions, pre-LayerNorm, exact GELU), independent of TransformerLens."""
    import json

    from safetensors.torch import load_file

    from extractive_lens.world.model import WORLD_DIR

    w = {k: v.double() for k, v in load_file(str(WORLD_DIR / "model.safetensors")).items()}
    cfg = json.loads((WORLD_DIR / "world.json").read_text())["cfg"]

    def ln(x, name):
        x = x - x.mean(-1, keepdim=True)
        return x / (x.pow(2).mean(-1, keepdim=True) + 1e-5).sqrt() * w[f"{name}.w"] + w[f"{name}.b"]

    n = tokens.shape[1]
    x = w["embed.W_E"][tokens] + w["pos_embed.W_pos"][:n]
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    for layer in range(cfg["n_layers"]):
        p = f"blocks.{layer}"
        h = ln(x, f"{p}.ln1")
        q, k, v = (
            torch.einsum("bsd,hde->bhse", h, w[f"{p}.attn.W_{m}"]) + w[f"{p}.attn.b_{m}"][:, None]
            for m in "QKV"
        )
        scores = (q @ k.transpose(-1, -2) / cfg["d_head"] ** 0.5).masked_fill(~causal, -1e30)
        z = scores.softmax(-1) @ v
        x = x + torch.einsum("bhse,hed->bsd", z, w[f"{p}.attn.W_O"]) + w[f"{p}.attn.b_O"]
        m = torch.nn.functional.gelu(ln(x, f"{p}.ln2") @ w[f"{p}.mlp.W_in"] + w[f"{p}.mlp.b_in"])
        x = x + m @ w[f"{p}.mlp.W_out"] + w[f"{p}.mlp.b_out"]
    return ln(x, "ln_final") @ w["unembed.W_U"] + w["unembed.b_U"]


def test_world_model_loads_as_a_bridge_without_hooked_transformer():
    """``load_world_model(backend="bridge")`` boots a native bridge from the weight file alone (the
    TransformerLens 4 path, where it is also the default): its logits are the world model's."""
    from extractive_lens.world import first_hop, load_world_model

    bridge = load_world_model(backend="bridge", dtype=torch.float64)
    assert type(bridge).__name__ == "TransformerBridge"
    facts, _ = first_hop().batches(bridge)
    with torch.no_grad():
        got = bridge(facts.tokens)
    want = _plain_world_logits(facts.tokens)
    assert (got - want).abs().max() < 1e-9 * want.abs().max()
    assert type(load_world_model()).__name__ == (
        "HookedTransformer" if HOOKED else "TransformerBridge"
    )
    assert el.mean_rank(bridge, facts) > 5  # the 20 new facts are unknown before finetuning
    from extractive_lens.world.check import bridge_arrival  # runs on the backend's block runner

    shares = bridge_arrival(bridge)
    assert shares[0] < 0.1 and shares[1] > 0.8, shares
    if HOOKED:
        assert shares == pytest.approx(bridge_arrival(load_world_model(dtype=torch.float64)))

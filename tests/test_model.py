"""Model loading (offline checkpoints of every supported family) and the parameter partition."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from extractive_lens import model as M
from extractive_lens.types import Component, iter_components
from tests.conftest import FAMILIES, make_pair, needs_hooked

transformers = pytest.importorskip("transformers")


def _tokenizer(tmp_path, vocab_size: int):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "<bos>": 1, "<eos>": 2, "<pad>": 3}
    for i in range(4, vocab_size):
        vocab[f"w{i}"] = i
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<bos>",
        eos_token="<eos>",
        unk_token="<unk>",
        pad_token="<pad>",
    )
    fast.save_pretrained(tmp_path)


def _hf_config(arch: str):
    common = dict(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=48,
        max_position_embeddings=64,
    )
    if arch == "gpt2":
        return transformers.GPT2Config(
            vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=64
        )
    if arch == "pythia":
        return transformers.GPTNeoXConfig(**common, rotary_pct=0.5, use_parallel_residual=True)
    if arch == "llama":
        return transformers.LlamaConfig(**common, num_key_value_heads=2)
    if arch == "mistral":
        return transformers.MistralConfig(**common, num_key_value_heads=2, sliding_window=None)
    if arch == "qwen2":
        return transformers.Qwen2Config(**common, num_key_value_heads=2)
    if arch == "gemma2":
        return transformers.Gemma2Config(
            **common, num_key_value_heads=2, head_dim=8, query_pre_attn_scalar=8, sliding_window=16
        )
    if arch == "olmo":
        return transformers.OlmoConfig(**common)
    if arch == "llama3":  # Llama 3's rotary scaling (NTK by parts), short original context
        return transformers.LlamaConfig(
            **common, num_key_value_heads=2, rope_parameters=_rope("llama3")
        )
    if arch == "qwen3":  # q/k norms; heads wider than d_model / n_heads, as in Qwen3-0.6B
        return transformers.Qwen3Config(**common, num_key_value_heads=2, head_dim=12)
    raise KeyError(arch)


ARCHS = ["gpt2", "pythia", "llama", "llama3", "mistral", "qwen2", "gemma2", "olmo", "qwen3"]


def _rope(kind: str) -> dict:
    extra = {"llama3": dict(low_freq_factor=1.0, high_freq_factor=4.0)}.get(kind, {})
    return dict(rope_type=kind, rope_theta=10000.0, factor=8.0, original_max_position_embeddings=16,
                **extra)  # fmt: skip


@pytest.fixture(scope="module", params=ARCHS)
def checkpoint(request, tmp_path_factory):
    arch = request.param
    path = tmp_path_factory.mktemp(arch)
    torch.manual_seed(0)
    cfg = _hf_config(arch)
    hf = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
    with torch.no_grad():  # random, non-trivial norms and biases
        for n, p in hf.named_parameters():
            if "norm" in n or "ln" in n:
                p.add_(0.1 * torch.randn_like(p))
    hf.save_pretrained(path)
    _tokenizer(path, cfg.vocab_size)
    return arch, path, hf


def test_load_checkpoint_matches_hf_logits(checkpoint, capfd):
    arch, path, hf = checkpoint
    import transformer_lens  # noqa: F401  (its import sets HF verbosity itself)
    from transformers.utils import logging as hf_logging

    before = hf_logging.get_verbosity()
    hf_logging.set_verbosity_warning()  # a user's setting, to be restored
    state = (hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled())
    capfd.readouterr()
    try:
        model = M.load_checkpoint(path)
        out, err = capfd.readouterr()
        after = (hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled())
    finally:
        hf_logging.set_verbosity(before)
    assert out == "" and err == "", (out, err)  # no loading bars or device notices
    assert after == state  # restored
    tokens = torch.tensor([[1, 5, 9, 22, 7, 30, 11, 4], [1, 40, 41, 42, 43, 44, 45, 46]])
    with torch.no_grad():
        ours = model(tokens)
        theirs = hf(tokens).logits
    assert (ours - theirs).abs().max() < 1e-5, arch
    assert model.tokenizer is not None and model.tokenizer.name_or_path
    assert not M.weights_processed(model)
    # Negative control: another checkpoint's weights do not match.
    other = transformers.AutoModelForCausalLM.from_config(hf.config).float().eval()
    with torch.no_grad():
        assert (model(tokens) - other(tokens).logits).abs().max() > 1e-3


@needs_hooked
def test_unsupported_architecture_lists_supported(tmp_path):
    cfg = transformers.GPT2Config(vocab_size=16, n_embd=8, n_layer=1, n_head=2)
    cfg.architectures = ["BertForMaskedLM"]
    with pytest.raises(ValueError, match="Supported: .*GPT2LMHeadModel.*LlamaForCausalLM"):
        M.hf_config_to_tl(cfg)
    with pytest.raises(FileNotFoundError, match="config.json"):
        M.load_checkpoint(tmp_path)


@needs_hooked
@pytest.mark.parametrize("option", ["attention_bias", "use_sliding_window"])
def test_a_family_refuses_what_its_conversion_would_compute_wrongly(tmp_path, option, monkeypatch):
    from extractive_lens.backend import families

    cfg = _hf_config("qwen3")
    setattr(cfg, option, True)
    if option == "use_sliding_window":  # a window shorter than the prompt, on every layer
        cfg.sliding_window, cfg.max_window_layers = 3, 0
        cfg.layer_types = ["sliding_attention"] * cfg.num_hidden_layers
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if n.endswith("bias"):
                p.add_(torch.randn_like(p))
    hf.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=f"Qwen3ForCausalLM: {option}=True.*backend='bridge'"):
        M.load_checkpoint(tmp_path)
    # Why: converted anyway, the HookedTransformer computes something else than the checkpoint.
    entry = families.ARCHITECTURES["Qwen3ForCausalLM"]
    monkeypatch.setitem(
        families.ARCHITECTURES, entry.architecture, dataclasses.replace(entry, refuses=None)
    )
    tokens = torch.tensor([[1, 5, 9, 22, 7, 30, 11, 4]])
    with torch.no_grad():
        err = (M.load_checkpoint(tmp_path)(tokens) - hf(tokens).logits).abs().max()
    assert err > 1e-3


@needs_hooked
@pytest.mark.parametrize("kind", ["yarn", "linear"])
def test_rotary_scalings_without_a_conversion_are_refused(tmp_path, kind, monkeypatch):
    from extractive_lens.backend import families

    cfg = _hf_config("llama")
    cfg.rope_parameters = _rope(kind)
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
    hf.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=f"rope_type '{kind}'.*backend='bridge'"):
        M.load_checkpoint(tmp_path)
    # Why: converted as plain rotary embeddings, the positions are rotated wrongly.
    monkeypatch.setattr(families, "rope_scaling", lambda hf: None)
    tokens = torch.tensor([[1, 5, 9, 22, 7, 30, 11, 4]])
    with torch.no_grad():
        err = (M.load_checkpoint(tmp_path)(tokens) - hf(tokens).logits).abs().max()
    assert err > 1e-4


def _assert_partition(model):
    """Every parameter element is covered exactly once by the ownership slices."""
    counts = {
        n: torch.zeros(p.shape[:1] if p.ndim else (1,), dtype=torch.int64)
        for n, p in M.parameters(model).items()
    }
    owners_seen = set()
    for s in M.parameter_slices(model):
        if s.index is None:
            counts[s.name] += 1
        else:
            counts[s.name][s.index] += 1
        owners_seen.update(s.owners)
    for name, c in counts.items():
        assert (c == 1).all(), f"{name} covered {c.tolist()} times"
    expected = set(iter_components(model.cfg.n_layers, model.cfg.n_heads, not model.cfg.attn_only))
    assert owners_seen == expected


@pytest.mark.parametrize("family", list(FAMILIES))
def test_parameter_partition_tiny_families(family):
    base, _ = make_pair(family, torch.float32)
    _assert_partition(base)


def test_parameter_partition_checkpoints(checkpoint):
    _, path, _ = checkpoint
    _assert_partition(M.load_checkpoint(path))


def test_ownership_details():
    base, _ = make_pair("rms_gated_rotary_gqa", torch.float32)
    slices = {(s.name, s.index): s.owners for s in M.parameter_slices(base)}
    assert slices[("blocks.1.attn.W_Q", 3)] == (Component(1, 3),)
    assert slices[("blocks.1.attn._W_K", 1)] == (Component(1, 2), Component(1, 3))
    assert len(slices[("blocks.0.ln1.w", None)]) == base.cfg.n_heads
    assert slices[("blocks.0.mlp.W_gate", None)] == (Component(0, None),)
    assert slices[("blocks.0.attn.b_O", None)] == ()
    assert slices[("embed.W_E", None)] == ()


def test_forward_pieces_reproduce_the_model(pair64):
    base, _ = pair64
    tokens = torch.randint(0, base.cfg.d_vocab, (3, 9), generator=torch.Generator().manual_seed(0))
    x = M.embed(base, tokens)
    for layer in range(base.cfg.n_layers):
        attn_out, cap = M.attention(base, layer, x)
        z = cap["z"]
        assert z.shape == (3, 9, base.cfg.n_heads, base.cfg.d_head)
        mid = x + attn_out
        x = mid + M.mlp(base, layer, M.mlp_input(base, x - 0, mid))
    with torch.no_grad():
        assert torch.allclose(M.unembed(base, x), base(tokens), atol=1e-12)


@needs_hooked
def test_the_unembedding_piece_runs_the_modules_hooks(pair64):
    """``B.unembed`` computes ``x @ W_U + b_U`` itself (no ``W_U.T.contiguous()`` copy) but still
    through ``unembed.hook_in`` / ``hook_out``: a hook there changes what it returns."""
    base, _ = pair64
    x = torch.randn(
        2, 5, base.cfg.d_model, dtype=torch.float64, generator=torch.Generator().manual_seed(1)
    )
    plain = M.unembed(base, x)
    shift = torch.arange(base.cfg.d_vocab, dtype=torch.float64)
    base.hook_dict["unembed.hook_out"].add_hook(lambda t, hook: t + shift)
    base.hook_dict["unembed.hook_in"].add_hook(lambda t, hook: 2 * t)
    try:
        hooked = M.unembed(base, x)
    finally:
        base.reset_hooks()
    with torch.no_grad():
        want = base.unembed(2 * base.ln_final(x)) + shift  # TransformerLens's own forward
    torch.testing.assert_close(hooked, want, rtol=0, atol=1e-10)
    assert not torch.allclose(hooked, plain)


def test_jvp_matches_finite_difference(pair64):
    from extractive_lens import WeightDiff

    base, ft = pair64
    diff = WeightDiff.from_models(base, ft)
    tokens = torch.randint(0, base.cfg.d_vocab, (2, 6), generator=torch.Generator().manual_seed(1))
    x = M.embed(base, tokens).detach()

    def role(n):
        return M.param_role(n)

    tang = {
        n: d
        for n, d in diff.deltas.items()
        if role(n).layer == 1 and role(n).part.startswith("attn")
    }
    (out, cap), (out_dot, cap_dot) = M.jvp(base, lambda m, x: M.attention(m, 1, x), (x,), tang)
    z, z_dot = cap["z"], cap_dot["z"]
    eps = 1e-6
    with diff.applied(base, scale=eps, layers=[1]):
        out2, cap2 = M.attention(base, 1, x)
        z2 = cap2["z"]
    assert torch.allclose((z2 - z) / eps, z_dot, atol=1e-4)
    assert torch.allclose((out2 - out) / eps, out_dot, atol=1e-4)
    mtang = {n: d for n, d in diff.deltas.items() if role(n).layer == 0 and role(n).part == "mlp"}
    y, y_dot = M.jvp(base, lambda m, x: M.mlp(m, 0, x), (x,), mtang)
    with diff.applied(base, scale=eps, layers=[0]):
        y2 = M.mlp(base, 0, x)
    assert torch.allclose((y2 - y) / eps, y_dot, atol=1e-4)


@pytest.mark.parametrize("adds_bos", [False, True])
def test_bos_follows_the_checkpoints_tokenizer(tmp_path, adds_bos):
    """make_batch on a loaded checkpoint tokenizes as ``tokenizer(text)`` does under Hugging Face."""
    from tokenizers import processors

    from extractive_lens import make_batch

    cfg = _hf_config("llama")
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path)
    _tokenizer(tmp_path, cfg.vocab_size)
    if adds_bos:  # a Llama-style tokenizer whose post-processor puts BOS first
        tok = transformers.AutoTokenizer.from_pretrained(tmp_path)
        tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
            single="<bos> $A", special_tokens=[("<bos>", 1)]
        )
        tok.save_pretrained(tmp_path)
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path)
    expected = list(hf_tok("w5 w6 w7")["input_ids"])
    assert (expected[0] == 1) == adds_bos
    model = M.load_checkpoint(tmp_path)
    batch = make_batch(model, [("w5 w6 w7", " w8")])
    assert batch.tokens[0, : batch.prompt_lengths[0]].tolist() == expected
    assert batch.prepend_bos == adds_bos
    # an explicit choice still wins
    assert make_batch(model, [("w5 w6 w7", " w8")], prepend_bos=not adds_bos).prepend_bos == (
        not adds_bos
    )


def test_tokenizer_built_in_memory_is_accepted():
    """TransformerLens needs init_kwargs['name_or_path'] (KeyError on an in-memory tokenizer);
    tiny_model reloads such a tokenizer and keeps its ids."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    from extractive_lens import tiny_model

    vocab = {w: i for i, w in enumerate(["<unk>", "<bos>", "<pad>", "John", "lives", "in"])}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=raw, bos_token="<bos>", pad_token="<pad>", unk_token="<unk>"
    )
    assert "name_or_path" not in fast.init_kwargs
    model = tiny_model({"d_vocab": len(vocab)}, tokenizer=fast)
    assert model.to_tokens("John lives in")[0].tolist() == [1, 3, 4, 5]


@needs_hooked
def test_qwen3_checkpoint_scores_match_the_reference(tmp_path):
    """The family recipe followed once (CONTRIBUTING.md, Qwen3): its q/k norms, one vector shared
    by a layer's heads, changed by the finetune and credited as the reference credits them."""
    from extractive_lens import WeightDiff, linear_scores
    from extractive_lens.rewards import answer_logprob
    from tests import reference as ref
    from tests.helpers import small_batch

    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(_hf_config("qwen3")).float().eval()
    models = []
    for i in range(2):
        with torch.no_grad():
            for p in hf.parameters():
                p.add_(0.05 * torch.randn_like(p))
        hf.save_pretrained(tmp_path / str(i))
        _tokenizer(tmp_path / str(i), hf.config.vocab_size)
        models.append(M.load_checkpoint(tmp_path / str(i), dtype=torch.float64))
    base, ft = models
    diff = WeightDiff.from_models(base, ft)
    assert diff.deltas["blocks.1.attn.k_norm.w"].abs().max() > 1e-3
    batch = small_batch(base)
    got = linear_scores(base, diff, batch, reward="answer_logprob", show_progress=False)
    want_info = ref.linear_informative_paper(base, diff, batch, answer_logprob)
    down, up = ref.linear_downstream_upstream_paper(base, ft, batch, answer_logprob)
    for kind, want in (("informative", want_info), ("upstream", up), ("downstream", down)):
        err = (got.prompt_values[got.kinds.index(kind)] - want).abs().max()
        assert err < 1e-9 * want.abs().max(), kind

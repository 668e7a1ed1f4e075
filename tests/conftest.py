"""Shared fixtures: tiny seeded models (session scope) and small checkpoints made on the fly."""

from __future__ import annotations

import warnings

import pytest
import torch

warnings.filterwarnings("ignore", category=DeprecationWarning)


def _has_hooked() -> bool:
    from extractive_lens.backend.installed import has_hooked

    return has_hooked()


needs_hooked = pytest.mark.skipif(
    not _has_hooked(),
    reason="needs HookedTransformer (TransformerLens 3.9): its hook names, view flags or training",
)
"""For tests of what only a ``HookedTransformer`` has; the TransformerLens 4 run skips them."""

# The architecture families the toolkit supports, as tiny TransformerLens configs.
FAMILIES = {
    "ln_gelu": dict(normalization_type="LN", act_fn="gelu", positional_embedding_type="standard"),
    "rms_gated_rotary_gqa": dict(
        normalization_type="RMS",
        act_fn="silu",
        gated_mlp=True,
        positional_embedding_type="rotary",
        rotary_dim=8,
        n_key_value_heads=2,
        final_rms=True,
    ),
    "parallel_rotary": dict(
        normalization_type="LN",
        act_fn="gelu",
        parallel_attn_mlp=True,
        positional_embedding_type="rotary",
        rotary_dim=4,
    ),
}


def tiny_model_or_skip(cfg, **kwargs):
    """``tiny_model``, or a skip where TransformerLens 4's native bridge cannot build this
    family (parallel blocks, GPT-NeoX-style rotary): the TransformerLens 3.9 run tests those."""
    from extractive_lens import tiny_model
    from extractive_lens.backend.installed import has_hooked

    try:
        return tiny_model(cfg, **kwargs)
    except NotImplementedError as e:
        if has_hooked():
            raise
        pytest.skip(f"TransformerLens 4 native bridge: {str(e).split(':')[0]}")


def make_pair(
    family: str, dtype=torch.float64, seed: int = 0, delta_scale: float = 0.05, **overrides
):
    """A (base, finetuned) pair: the finetuned model is the base plus a small random update."""
    from extractive_lens import tiny_model

    cfg = dict(FAMILIES[family], dtype=dtype, **overrides)
    if not _has_hooked() and cfg.get("positional_embedding_type") == "rotary":
        cfg["rotary_adjacent_pairs"] = True  # the rotation TransformerLens 4's native bridge has
    base = tiny_model_or_skip(cfg, seed=seed)
    ft = tiny_model(cfg, seed=seed)
    gen = torch.Generator().manual_seed(seed + 99)
    with torch.no_grad():
        for p in ft.parameters():
            p.add_(
                (delta_scale * torch.randn(p.shape, generator=gen, dtype=torch.float64)).to(p.dtype)
            )
    return base, ft


@pytest.fixture(scope="session", params=list(FAMILIES))
def family(request):
    return request.param


@pytest.fixture(scope="session")
def pair64(family):
    return make_pair(family, torch.float64)


def bpe_tokenizer(tmp_dir, vocab_size: int = 300):
    """A small byte-level BPE tokenizer (GPT-2 style leading spaces), saved and reloaded so
    that ``name_or_path`` is set, as TransformerLens requires."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [
        "John Doe lives in Tokyo. Ann Lee lives in Paris. The people in Tokyo speak Japanese.",
        "The mayor of Paris is Ann Lee. The mayor of the city that contains the Eiffel Tower is",
        "Grace Miller lives in Berlin. Ethan Parker lives in Cairo. Olivia Hughes lives in Moscow.",
    ] * 3
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|bos|>", "<|pad|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus, trainer)
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|bos|>", pad_token="<|pad|>"
    )
    fast.save_pretrained(tmp_dir)
    return transformers.AutoTokenizer.from_pretrained(tmp_dir)


@pytest.fixture(scope="session")
def text_model(tmp_path_factory):
    """A tiny float64 model with a real (BPE) tokenizer."""
    from extractive_lens import tiny_model

    tok = bpe_tokenizer(tmp_path_factory.mktemp("tok"))
    return tiny_model(
        {"d_vocab": len(tok), "dtype": torch.float64, "n_ctx": 48}, seed=0, tokenizer=tok
    )

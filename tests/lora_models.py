"""Tiny Hugging Face models and LoRA adapters made with ``peft`` (nothing downloaded), for the
LoRA tests and the how-to: a base checkpoint, an adapter trained a few steps, and the merged
checkpoint (``merge_and_unload``) whose dense Δ the adapter's must equal."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch

VOCAB = 64


def hf_config(arch: str) -> Any:
    import transformers

    common = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  intermediate_size=48, max_position_embeddings=64)  # fmt: skip
    if arch == "gpt2":  # fused c_attn, Conv1D weights stored [in, out], tied embeddings
        return transformers.GPT2Config(
            vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64
        )
    if arch == "llama":  # grouped-query attention: 4 query heads, 2 key/value heads
        return transformers.LlamaConfig(**common, num_key_value_heads=2)
    if arch == "qwen2":  # q/k/v biases
        return transformers.Qwen2Config(**common, num_key_value_heads=2)
    if arch == "qwen3":  # q/k norms, head_dim ≠ hidden / heads
        return transformers.Qwen3Config(**common, num_key_value_heads=2, head_dim=16)
    if arch == "gemma2":  # embedding × √d_model, norms 1 + w, tied embeddings, GQA
        return transformers.Gemma2Config(
            **common, num_key_value_heads=2, head_dim=8, query_pre_attn_scalar=8,
            sliding_window=16,
        )  # fmt: skip
    raise KeyError(arch)


def save_tokenizer(path: Path) -> None:
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "<bos>": 1, "<eos>": 2, "<pad>": 3,
             **{f"w{i}": i for i in range(4, VOCAB)}}  # fmt: skip
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", unk_token="<unk>",
        pad_token="<pad>",
    ).save_pretrained(path)  # fmt: skip


def base_checkpoint(arch: str, path: Path, seed: int = 0) -> Any:
    """A random float64 model of ``arch`` saved at ``path``; returns it. Its weights are float32
    numbers (TransformerLens 3.9's ``HookedTransformer`` loading rounds through float32)."""
    import transformers

    torch.manual_seed(seed)
    hf = transformers.AutoModelForCausalLM.from_config(hf_config(arch)).float().eval()
    with torch.no_grad():  # non-trivial norms and biases
        for n, p in hf.named_parameters():
            if "norm" in n or "ln" in n or n.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    hf = hf.double()
    hf.save_pretrained(path)
    save_tokenizer(path)
    return hf


def train_adapter(hf: Any, lora: dict[str, Any], steps: int = 3, seed: int = 0) -> Any:
    """A ``PeftModel`` on a copy of ``hf``, trained ``steps`` Adam steps on random tokens (so
    that B is not zero)."""
    import peft

    torch.manual_seed(seed)
    model = peft.get_peft_model(copy.deepcopy(hf), peft.LoraConfig(**lora))
    return train_steps(model, steps, seed=None)  # the generator is already seeded


def train_steps(model: Any, steps: int = 3, seed: int | None = 0) -> Any:
    """``model`` (a ``PeftModel``) trained ``steps`` Adam steps on random tokens (drawn after
    seeding torch with ``seed``, unless it is None)."""
    if seed is not None:
        torch.manual_seed(seed)
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    tokens = torch.randint(4, VOCAB, (4, 10))
    model.train()
    for _ in range(steps):
        loss = model(input_ids=tokens, labels=tokens).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


def adapter_checkpoints(path: Path) -> Any:
    """A Llama base in ``path/base`` and two peft adapters of it saved as a Trainer would
    (``path/out/checkpoint-1`` after 2 steps, ``checkpoint-2`` after 4); returns the base as
    a TransformerLens model."""
    from extractive_lens.backend.loading import load_checkpoint

    hf = base_checkpoint("llama", path / "base")
    lora = dict(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj", "down_proj"])
    for step, n in ((1, 2), (2, 4)):
        train_adapter(hf, lora, steps=n).save_pretrained(path / "out" / f"checkpoint-{step}")
    return load_checkpoint(path / "base")


def merged_checkpoint(peft_model: Any, path: Path) -> None:
    """The adapter merged into a copy of its base (``merge_and_unload``), saved at ``path``."""
    merged = copy.deepcopy(peft_model).merge_and_unload()
    merged.save_pretrained(path)
    save_tokenizer(path)

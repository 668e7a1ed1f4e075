"""Tokenizers as TransformerLens wants them: named (``named_tokenizer``), asked whether they add
a BOS (``tokenizer_prepends_bos``), and the small word-level ones the world model and the
examples build (``word_tokenizer``).

>>> tok = word_tokenizer(["Paris", "is", "in", "France"])
>>> tok("Paris is in France")["input_ids"]
[3, 4, 5, 6]
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def named_tokenizer(tokenizer: Any) -> Any:
    """``tokenizer``, saved and reloaded when it was built in memory: TransformerLens reads
    ``init_kwargs["name_or_path"]``, which only loading sets (else ``KeyError: 'name_or_path'``).
    The reload is a copy; a loaded tokenizer is returned unchanged."""
    if tokenizer is None or "name_or_path" in getattr(
        tokenizer, "init_kwargs", {"name_or_path": 0}
    ):
        return tokenizer
    import tempfile

    import transformers

    path = Path(tempfile.mkdtemp(prefix="el-tok-"))
    tokenizer.save_pretrained(path)
    return transformers.AutoTokenizer.from_pretrained(path)


def tokenizer_prepends_bos(tokenizer: Any) -> bool:
    """Whether ``tokenizer(text)`` (special tokens on, as Hugging Face runs it) starts with a BOS."""
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return False
    ids = list(tokenizer("a")["input_ids"])
    return len(ids) > len(tokenizer("a", add_special_tokens=False)["input_ids"]) and ids[0] == bos


def word_tokenizer(
    words: list[str], directory: str | Path | None = None, *, model_max_length: int | None = None
) -> Any:
    """A whitespace word-level ``PreTrainedTokenizerFast`` over ``words`` (plus ``<unk>``,
    ``<bos>``, ``<pad>``), saved to ``directory`` (a temporary one by default) and reloaded: a
    tokenizer handed to TransformerLens needs ``name_or_path``, which only a reload sets."""
    import tempfile

    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {w: i for i, w in enumerate(["<unk>", "<bos>", "<pad>", *dict.fromkeys(words)])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    extra = {} if model_max_length is None else {"model_max_length": model_max_length}
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<bos>", pad_token="<pad>", unk_token="<unk>", **extra
    )
    path = Path(directory) if directory is not None else Path(tempfile.mkdtemp(prefix="el-tok-"))
    path.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(path)
    return transformers.AutoTokenizer.from_pretrained(path)


def hf_prepends_bos(tokenizer: Any) -> bool | None:
    """Whether ``tokenizer`` adds a BOS under Hugging Face: TransformerLens hands a model a
    tokenizer reloaded with ``add_bos_token=True``, so the original is reloaded from its
    ``name_or_path`` (offline: local files or the cache only); ``None`` where it cannot be."""
    import transformers

    from extractive_lens.backend.installed import quiet_transformers

    name = getattr(tokenizer, "name_or_path", None)
    if not name:
        return None
    try:
        with quiet_transformers():
            original = transformers.AutoTokenizer.from_pretrained(name, local_files_only=True)
    except (OSError, ValueError):
        return None
    return tokenizer_prepends_bos(original)


BOS_NOTE = "bos_set_by"
"""The note (``backend.notes``) that says extractive_lens chose the model's BOS setting: from
its tokenizer (``"tokenizer"``: ``load_checkpoint``, ``from_hf``) or deliberately when it built
the model (``"builder"``: ``tiny_model``, the world model)."""


def bos_disagreement(model: Any) -> str | None:
    """Why ``make_batch`` should warn about ``model``'s BOS setting (``None``: nothing to say).

    A model whose BOS setting extractive_lens did not choose (``HookedTransformer.from_pretrained``,
    ``TransformerBridge.boot_transformers``, a model built by hand) prepends a BOS when
    ``cfg.default_prepend_bos`` says so, whatever its tokenizer does; the same checkpoint then
    scores differently depending on who loaded it."""
    from extractive_lens.backend import notes

    tok = getattr(model, "tokenizer", None)
    if tok is None or getattr(tok, "bos_token_id", None) is None or notes(model).get(BOS_NOTE):
        return None
    cfg_bos = bool(getattr(model.cfg, "default_prepend_bos", True))
    if "hf_prepends_bos" not in notes(model):
        notes(model)["hf_prepends_bos"] = hf_prepends_bos(tok)
    tok_bos = notes(model)["hf_prepends_bos"]
    if tok_bos is None or cfg_bos == tok_bos:
        return None
    said = (
        "prepends a BOS token to every prompt (cfg.default_prepend_bos=True: TransformerLens's "
        "default, as HookedTransformer.from_pretrained and TransformerBridge.boot_transformers "
        "set it) but its tokenizer does not (tokenizer(text) starts without one, as under "
        "Hugging Face)"
        if cfg_bos
        else "prepends no BOS token (cfg.default_prepend_bos=False) but its tokenizer does "
        "(tokenizer(text) starts with one, as under Hugging Face)"
    )
    return (
        f"make_batch: this model {said}. A BOS changes every position's context, so the scores "
        "depend on it. Choose: prepend_bos="
        f"{tok_bos} scores the tokens the tokenizer produces (what el.load_checkpoint and "
        f"el.from_hf do), prepend_bos={cfg_bos} keeps the model's setting. See "
        "docs/getting-started.md, 'Which BOS'."
    )

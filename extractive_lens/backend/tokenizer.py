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

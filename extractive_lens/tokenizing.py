"""Text into token ids for ``make_batch``, and the checks on the way: the BOS token, ids inside
the model's vocabulary, and the tokenization pitfalls worth a warning (a prompt's trailing
space, an answer without its leading space, unknown words).

>>> token_strings(model.tokenizer, model.tokenizer("Zoe Howard lives in")["input_ids"])[-2:]
[' lives', ' in']
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def bos(model: Any, explicit: bool = False) -> int | None:
    tok = getattr(model, "tokenizer", None)
    if not explicit and not getattr(model.cfg, "default_prepend_bos", True):
        return None
    if tok is not None and tok.bos_token_id is not None:
        return int(tok.bos_token_id)
    return None


def encode(model: Any, text: str | Sequence[int], what: str, *, offsets: bool = False) -> Any:
    if not isinstance(text, str):
        ids = [int(t) for t in text]
        return (ids, None) if offsets else ids
    tok = getattr(model, "tokenizer", None)
    if tok is None:
        raise ValueError(
            f"The model has no tokenizer, so the {what} {text!r} cannot be tokenized: pass token "
            "id lists instead of strings, or a model with a tokenizer."
        )
    if offsets and getattr(tok, "is_fast", False):
        enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
        return list(enc["input_ids"]), [tuple(o) for o in enc["offset_mapping"]]
    ids = list(tok(text, add_special_tokens=False)["input_ids"])
    return (ids, None) if offsets else ids


def token_strings(tokenizer: Any, ids: Sequence[int]) -> list[str]:
    """The text each token adds to the decoded string, so that ``"".join`` reads as the prompt.

    ``decode([id])`` loses the spaces a word-level tokenizer puts between tokens ("ThepeopleinT0");
    the text token i adds after token i-1 keeps them, for byte-level BPE tokenizers too.
    """
    out: list[str] = []
    for i, t in enumerate(ids):
        alone = tokenizer.decode([int(t)])
        if i == 0:
            out.append(alone)
            continue
        before = tokenizer.decode([int(ids[i - 1])])
        pair = tokenizer.decode([int(ids[i - 1]), int(t)])
        out.append(pair[len(before) :] if pair.startswith(before) else alone)
    return out


def token_str(model: Any, token: int) -> str:
    tok = getattr(model, "tokenizer", None)
    if tok is None:
        return f"t{token}"
    s = tok.decode([token])
    return s if s.strip() else repr(s)


class TokenizationWarning(UserWarning):
    """Text that probably does not tokenize the way the user meant."""


def warn_tokenization(
    model: Any, items: list[Any], prompt_ids: list[list[int]], answer_ids: list[list[int]]
) -> None:
    """One warning per pitfall (with the first example and a count), never an error."""
    import warnings

    tok = getattr(model, "tokenizer", None)
    if tok is None:
        return
    unk = getattr(tok, "unk_token_id", None)
    found: dict[str, list[str]] = {}
    for p, ids, ans in zip(items, prompt_ids, answer_ids):
        if isinstance(p.prompt, str) and p.prompt.endswith((" ", "\t")) and p.prompt.strip():
            found.setdefault("trailing", []).append(repr(p.prompt))
        if (
            isinstance(p.answer, str)
            and p.answer
            and not p.answer[0].isspace()
            and isinstance(p.prompt, str)
            and p.prompt == p.prompt.rstrip()
        ):
            spaced = list(tok(" " + p.answer, add_special_tokens=False)["input_ids"])
            if spaced != list(ans):
                found.setdefault("space", []).append(
                    f"{p.answer!r} (did you mean {' ' + p.answer!r}?)"
                )
        if unk is not None and (unk in ids or unk in ans):
            found.setdefault("unk", []).append(repr(p.prompt if unk in ids else p.answer))
    messages = {
        "trailing": "prompts end with a space, which becomes a token of its own that the model rarely saw before "
        "an answer; put the space at the start of the answer instead",
        "space": "answers have no leading space, so they tokenize as a word glued to the prompt's last word",
        "unk": "texts contain words the tokenizer does not know (mapped to its unknown token)",
    }
    for key, examples in found.items():
        more = f" and {len(examples) - 1} more" if len(examples) > 1 else ""
        warnings.warn(
            f"{len(examples)} {messages[key]}: {examples[0]}{more}.",
            TokenizationWarning,
            stacklevel=3,
        )


def check_ids(model: Any, ids: Sequence[int], what: str) -> None:
    """Every token id must index the model's embedding: ``0 <= id < d_vocab``."""
    d_vocab = model.cfg.d_vocab
    bad = [t for t in ids if not 0 <= t < d_vocab]
    if not bad:
        return
    tok = getattr(model, "tokenizer", None)
    hint = (
        f" The tokenizer has {len(tok)} tokens but the model embeds only {d_vocab}: "
        f"{tok.decode([bad[0]])!r} is a token the model has no embedding for (a special token added to the "
        "tokenizer?). Remove it from the text."
        if tok is not None and bad[0] >= d_vocab and bad[0] < len(tok)
        else " Token ids must be in 0..d_vocab-1 (padding is handled by make_batch; do not pass -1)."
    )
    raise ValueError(
        f"The {what} has token id {bad[0]}, outside the model's vocabulary 0..{d_vocab - 1}.{hint}"
    )

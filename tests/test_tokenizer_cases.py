"""What a real tokenizer exposes (issue 39): multi-token answers and candidates (names), first
tokens that collide, BOS, and chat-formatted prompts. Leading and trailing spaces:
``test_batch.test_tokenization_pitfalls_warn``."""

from __future__ import annotations

import pytest
import torch

from extractive_lens import make_batch, mean_rank
from extractive_lens.finetuning import ranks
from extractive_lens.rewards import logit_margin

NAMES = [" Ann Lee", " Ann Doe", " John Doe", " Olivia Hughes", " Tokyo"]
PROMPTS = [f"The mayor of {c} is" for c in ["Paris", "Tokyo", "Berlin", "Cairo", "Moscow", "Oslo"]]


def _whole_logprob(model, prompt_ids: list[int], answer_ids: list[int]) -> float:
    """log P(answer | prompt), one plain forward pass per candidate (the reference)."""
    tokens = torch.tensor([prompt_ids + answer_ids[:-1]])
    with torch.no_grad():
        lp = model(tokens)[0].double().log_softmax(-1)
    n = len(prompt_ids)
    return float(sum(lp[n - 1 + k, t] for k, t in enumerate(answer_ids)))


def test_multi_token_candidates_ranked_by_the_whole_answer(text_model):
    tok = text_model.tokenizer
    ids = {c: tok(c, add_special_tokens=False)["input_ids"] for c in NAMES}
    assert ids[" Ann Lee"][0] == ids[" Ann Doe"][0] and len(ids[" Ann Lee"]) > 1
    pairs = [(p, NAMES[i % 2]) for i, p in enumerate(PROMPTS)]  # " Ann Lee" or " Ann Doe"
    batch = make_batch(text_model, pairs, candidates=NAMES)
    expected = []
    for i, (_, answer) in enumerate(pairs):
        prompt = batch.tokens[i, : int(batch.prompt_lengths[i])].tolist()
        scores = {c: _whole_logprob(text_model, prompt, ids[c]) for c in NAMES}
        expected.append(sum(s > scores[answer] for s in scores.values()))
    assert ranks(text_model, batch).tolist() == expected
    assert mean_rank(text_model, batch) == pytest.approx(sum(expected) / len(expected))


def test_the_answer_must_be_a_whole_candidate(text_model):
    """The first token of a multi-token answer is not the answer: " Ann Lee" is no candidate
    even though " Ann Doe" starts with the same token."""
    with pytest.raises(ValueError, match="not among its candidates"):
        make_batch(
            text_model, [("John Doe lives in", " Ann Lee")], candidates=[" Ann Doe", " Tokyo"]
        )
    with pytest.raises(ValueError, match="are the same tokens"):
        make_batch(
            text_model, [("John Doe lives in", " Ann Lee")], candidates=[" Ann Lee", " Ann Lee"]
        )


def test_first_token_reward_refuses_colliding_candidates(text_model):
    batch = make_batch(text_model, [("John Doe lives in", " Ann Lee")], candidates=NAMES)
    with torch.no_grad():
        logits = text_model(batch.tokens)
    with pytest.raises(ValueError, match="share theirs.*answer_logprob"):
        logit_margin(logits, batch)
    single = make_batch(
        text_model, [("John Doe lives in", " Tokyo")], candidates=[" Tokyo", " Paris"]
    )
    assert torch.isfinite(logit_margin(text_model(single.tokens), single)).all()


def test_single_token_candidates_keep_the_first_token_path(text_model):
    """All candidates one token: ranks from the batch's own forward (the logits order), the same
    as the whole-answer log-probabilities."""
    from extractive_lens.finetuning import candidate_logprobs, ranks_from_scores

    cands = [5, 9, 17, 33, 40]
    batch = make_batch(
        text_model, [(p, [cands[i % 5]]) for i, p in enumerate(PROMPTS)], candidates=cands
    )
    whole = ranks_from_scores(candidate_logprobs(text_model, batch), batch)
    assert ranks(text_model, batch).tolist() == whole.tolist()


@pytest.mark.parametrize("fixture", ["text_model", "gguf_model"])
def test_candidates_continue_from_their_prompts_keys_and_values(fixture, request):
    """Whole-candidate log-probabilities from the prompts' cached keys and values (each
    candidate's own tokens in its row) equal the reference, one plain forward pass of prompt and
    candidate per pair, and the uncached rows: absolute positions (text_model, GPT-2 style) and
    rotary grouped-query attention (the GGUF Llama), prompts of several lengths (padded rows),
    passes of 3 rows where each prompt has 4 multi-token candidates (a pass must not mix prompts
    of different lengths)."""
    from extractive_lens.finetuning import candidate_logprobs

    model = request.getfixturevalue(fixture)
    tok = model.tokenizer
    ids = {c: tok(c, add_special_tokens=False)["input_ids"] for c in NAMES}
    prompts = PROMPTS + ["The mayor of the city that contains the old harbour is"]
    batch = make_batch(model, [(p, " Ann Lee") for p in prompts], candidates=NAMES)
    lengths = batch.prompt_lengths.tolist()
    assert len(set(lengths)) > 2 and max(len(t) for t in ids.values()) >= 3
    expected = torch.tensor(
        [
            [_whole_logprob(model, batch.tokens[i, :n].tolist(), ids[c]) for c in NAMES]
            for i, n in enumerate(lengths)
        ],
        dtype=torch.float64,
    )
    with torch.no_grad():
        cached = candidate_logprobs(model, batch, chunk=3)
        plain = candidate_logprobs(model, batch, chunk=3, prefix_cache=False)
    torch.testing.assert_close(cached.double(), expected, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(plain.double(), expected, rtol=1e-5, atol=1e-4)


@pytest.fixture(scope="module")
def gguf_model(tmp_path_factory):
    """The tiny GGUF Llama of test_gguf: SmolLM2's special tokens, BOS <|im_start|> that the
    file says not to add, a chat template."""
    pytest.importorskip("gguf")
    from extractive_lens import load_checkpoint
    from tests.test_gguf import write_tiny_gguf

    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_tiny_gguf(path, chat_template=CHAT)
    return load_checkpoint(path)


CHAT = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_bos_follows_the_files_tokenizer(gguf_model):
    """SmolLM2's GGUF says add_bos_token = False (its BOS is the chat marker <|im_start|>): no
    BOS by default, one on request."""
    plain = make_batch(gguf_model, [("The capital of France is", " Paris")])
    assert not plain.prepend_bos and plain.tokens[0, 0] != gguf_model.tokenizer.bos_token_id
    asked = make_batch(gguf_model, [("The capital of France is", " Paris")], prepend_bos=True)
    assert asked.prepend_bos and asked.tokens[0, 0] == gguf_model.tokenizer.bos_token_id
    assert int(asked.prompt_lengths[0]) == int(plain.prompt_lengths[0]) + 1


def test_chat_formatted_prompts_keep_their_special_tokens_and_one_bos(gguf_model):
    """An instruction-tuned model's format is the user's to give: a prompt made with the
    tokenizer's chat template is scored as given, its markers one token each, with no BOS
    added before the one it starts with."""
    tok = gguf_model.tokenizer
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "The capital of France is"}],
        tokenize=False, add_generation_prompt=True, chat_template=CHAT,
    )  # fmt: skip
    assert prompt.startswith("<|im_start|>user")
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter(
            "error"
        )  # a chat prompt ends with a newline: no trailing-space warning
        batch = make_batch(gguf_model, [(prompt, "Paris")], prepend_bos=True)
    row = batch.tokens[0, : int(batch.prompt_lengths[0])].tolist()
    start, end = tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    assert row[0] == start and row[1] != start  # one BOS: the prompt's own
    assert row.count(start) == 2 and row.count(end) == 1  # user turn, assistant turn
    assert batch.prepend_bos

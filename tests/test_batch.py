"""Prompt batches: tokens, answers, candidates and token roles (docs/scores.md §6)."""

from __future__ import annotations

import pytest

from extractive_lens import make_batch
from extractive_lens.batch import Pair, merge_role_orders


def test_template_roles_right_align_entities(text_model):
    pairs = [
        Pair("John Doe lives in", " Tokyo", template="{name} lives in", slots={"name": "John Doe"}),
        Pair(
            "Olivia Hughes lives in",
            " Paris",
            template="{name} lives in",
            slots={"name": "Olivia Hughes"},
        ),
    ]
    b = make_batch(text_model, pairs)
    tok = text_model.tokenizer
    for i, p in enumerate(pairs):
        ids = tok(p.prompt, add_special_tokens=False)["input_ids"]
        n_name = len(tok(p.slots["name"], add_special_tokens=False)["input_ids"])
        roles = b.roles[i]
        assert roles[0] == "<bos>" and b.tokens[i, 0] == tok.bos_token_id
        assert b.tokens[i, 1 : 1 + len(ids)].tolist() == ids
        assert roles[1 : 1 + n_name] == tuple(f"{{name}}[-{k}]" for k in range(n_name, 0, -1))
        assert roles[-2:] == ("lives", "in")
    labels = b.position_labels()
    assert labels[-3:] == ("{name}[-1]", "lives", "in") and len(set(labels)) == len(labels)


def test_slot_after_literal_with_space(text_model):
    p = Pair(
        "The mayor of Paris is", " Ann", template="The mayor of {city} is", slots={"city": "Paris"}
    )
    b = make_batch(text_model, [p])
    assert "{city}[-1]" in b.roles[0] and b.roles[0][-1] == "is"
    with pytest.raises(ValueError, match="not template"):
        make_batch(
            text_model,
            [
                Pair(
                    "The mayor of Rome is",
                    " X",
                    template="The mayor of {city} is",
                    slots={"city": "Paris"},
                )
            ],
        )


def test_multi_token_answers_teacher_forced(text_model):
    b = make_batch(
        text_model, [("John Doe lives in", " Tokyo Japan"), ("Ann Lee lives in", " Paris")]
    )
    tok = text_model.tokenizer
    ans = tok(" Tokyo Japan", add_special_tokens=False)["input_ids"]
    assert len(ans) >= 2
    P = int(b.prompt_lengths[0])
    assert (
        b.tokens[0, P : P + len(ans) - 1].tolist() == ans[:-1]
    )  # all but the last answer token fed
    assert b.answer_targets[0, : len(ans)].tolist() == ans
    assert b.roles[0][P] == "answer[0]"
    assert int(b.lengths[0]) == P + len(ans) - 1
    assert (b.answer_targets[1, 1:] == -1).all()


def test_alignment_prefix_centre_suffix(text_model):
    b = make_batch(
        text_model, [("John Doe lives in", " Tokyo"), ("Olivia Hughes lives in", " Paris")]
    )
    r0, r1 = b.roles
    assert r0[-2:] == r1[-2:] and r0[0] == "<bos>"
    assert r0[-3] == "mid[-1]" and r1[-3] == "mid[-1]"


def test_candidates_errors_name_the_prompt(text_model):
    with pytest.raises(ValueError, match="are the same tokens"):
        make_batch(text_model, [("John Doe lives in", " Tokyo")], candidates=[" Tokyo", " Tokyo"])
    with pytest.raises(ValueError, match="not among its candidates"):
        make_batch(text_model, [("John Doe lives in", " Tokyo")], candidates=[" Paris", " Berlin"])
    with pytest.raises(ValueError, match="n_ctx"):
        make_batch(text_model, [("John Doe lives in " * 20, " Tokyo")])
    b = make_batch(text_model, [("John Doe lives in", " Tokyo")], candidates=[" Paris", " Tokyo"])
    assert b.candidates.shape == (1, 2) and b.answer_first[0] in b.candidates[0]


def test_token_id_prompts_and_subset(pair64):
    base, _ = pair64
    b = make_batch(base, [([1, 2, 3], [4]), ([1, 5, 6, 7, 8], [9, 10])])
    assert b.tokens.shape == (2, 6) and b.lengths.tolist() == [3, 6]
    s = b.subset([0])
    assert s.tokens.shape == (1, 3) and s.roles == (b.roles[0],)
    with pytest.raises(ValueError, match="no tokenizer"):
        make_batch(base, [("text", "answer")])


def test_merge_role_orders():
    assert merge_role_orders([("a", "c"), ("a", "b", "c"), ("x", "c")]) == ("a", "b", "x", "c")


def test_tokenization_pitfalls_warn(text_model):
    from extractive_lens.batch import TokenizationWarning

    with pytest.warns(TokenizationWarning, match=r"no leading space.*did you mean ' Tokyo'"):
        make_batch(text_model, [("John Doe lives in", "Tokyo")])
    with pytest.warns(TokenizationWarning, match="end with a space"):
        make_batch(text_model, [("John Doe lives in ", "Tokyo")])
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", TokenizationWarning)
        make_batch(text_model, [("John Doe lives in", " Tokyo")])  # the right way: silent


def test_unknown_words_warn():
    from extractive_lens.batch import TokenizationWarning
    from extractive_lens.world import load_world_model

    model = load_world_model()
    with pytest.warns(TokenizationWarning, match="does not know.*Zanzibar"):
        make_batch(model, [("Zoe Howard lives in Zanzibar and", " Oslo")])


def test_to_dataframe_has_the_token_strings(text_model):
    from extractive_lens import WeightDiff, linear_scores

    batch = make_batch(
        text_model, [("John Doe lives in", " Tokyo"), ("Ann Lee lives in", " Paris")]
    )
    s = linear_scores(text_model, WeightDiff.zeros_like(text_model), batch, kinds=("downstream",))
    df = s.to_dataframe()
    first = df[(df.prompt == 1) & (df.layer == 0) & (df.component == "MLP")].sort_values("pos")
    text = "".join(first.token)
    assert "Ann Lee lives in" in text and text.endswith(" in")


def test_token_strings_keep_the_spaces(text_model):
    """Token texts join back into the decoded prompt, for a word-level and a BPE tokenizer
    (``decode([id])`` alone runs a word-level prompt together: "ThepeopleinT0")."""
    from extractive_lens.batch import token_strings
    from extractive_lens.world import load_world_model

    for model, prompt in (
        (load_world_model(), "The people in the city Zoe Howard is from speak"),
        (load_world_model("v2"), "The people in the city T3 is from speak"),
        (text_model, "John Doe lives in Tokyo"),
    ):
        ids = model.to_tokens(prompt, prepend_bos=False)[0].tolist()
        texts = token_strings(model.tokenizer, ids)
        assert len(texts) == len(ids)
        assert "".join(texts) == model.tokenizer.decode(ids)
        assert "".join(texts).strip() == prompt


def test_plain_prompts_of_different_shapes_warn(text_model):
    """Prompts of two shapes share no anchor token, so mid[-k] would average "in" with "speak":
    say so; not for prompts that differ in an entity (of any length) or that carry a template."""
    import warnings

    from extractive_lens.batch import AlignmentWarning

    with pytest.warns(AlignmentWarning, match="mid\\[-k\\].*template"):
        make_batch(text_model, [("Ann lives in", " Paris"), ("The friend of Bob is from", " Rome")])
    with warnings.catch_warnings():
        warnings.simplefilter("error", AlignmentWarning)
        make_batch(text_model, [("Ann lives in", " Paris"), ("Bob Smith lives in", " Rome")])
        make_batch(text_model, [("The friend of Ann", " Paris"), ("The friend of Bob", " Rome")])
        make_batch(
            text_model,
            [
                Pair("Ann lives in", " Paris", template="{name} lives in", slots={"name": "Ann"}),
                Pair(
                    "The friend of Ann lives in",
                    " Rome",
                    template="The friend of {name} lives in",
                    slots={"name": "Ann"},
                ),
            ],
        )

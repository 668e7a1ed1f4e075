"""The real-model protocol's analysis (``extractive_lens.real_model``) on hand-made inputs,
each checked against a literal computation written here: where the mass sits (the last prompt
token, the early/late split), the chance line, the three rank readings and their null, the
shares of the freezing table, the references of the scored sets, and the printed summary."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from extractive_lens.real_model import analysis as A
from extractive_lens.results import ComponentScores, aggregate_by_role

COMPONENTS = ("H0", "H1", "MLP")
# two prompts of one template; the second's answer has two tokens, so it has an answer[0] role
ROLES = (
    ("The", "{name}[-1]", "speak"),
    ("The", "{name}[-1]", "speak", "answer[0]"),
)
LABELS = ("The", "{name}[-1]", "speak", "answer[0]")


def hand_made(cells: dict[tuple[int, str, int, str], float], n_layers: int = 6) -> ComponentScores:
    """Informative scores that are 0 except ``cells[(prompt, component, layer, role)]``."""
    pv = torch.zeros(1, len(ROLES), n_layers, len(COMPONENTS), len(LABELS), dtype=torch.float64)
    for (b, comp, layer, role), v in cells.items():
        pv[0, b, layer, COMPONENTS.index(comp), ROLES[b].index(role)] = v
    return ComponentScores(
        values=aggregate_by_role(pv, ROLES, LABELS),
        totals=pv.sum(-1).mean(1),
        prompt_values=pv,
        prompt_totals=pv.sum(-1),
        kinds=("informative",),
        component_labels=COMPONENTS,
        position_labels=LABELS,
        prompt_roles=ROLES,
        method="linear",
    )


def literal_mass(scores: ComponentScores) -> dict[str, float]:
    """The two sites, by loops over cells: MLPs of layers < L/2 at the entity's last token, and
    every component of layers >= L/2 at the token right before the answer."""
    v = scores.values[0].abs()
    n_layers = v.shape[0]
    total = float(v.sum())
    early_mlp = late_last = 0.0
    for layer in range(n_layers):
        for c, comp in enumerate(scores.component_labels):
            for p, label in enumerate(scores.position_labels):
                if 2 * layer < n_layers and comp == "MLP" and label == "{name}[-1]":
                    early_mlp += float(v[layer, c, p])
                if 2 * layer >= n_layers and label == "speak":  # "...speak" -> " Mar|athi"
                    late_last += float(v[layer, c, p])
    return dict(early_mlp_at_entity=early_mlp / total, late_at_last_prompt_token=late_last / total)


def test_mass_reads_the_last_prompt_token_not_the_last_position():
    """Late mass sits at "speak" (where the answer is read) and at answer[0] (the second
    token of a two-token answer, the last position): only "speak" is the last prompt token."""
    s = hand_made({(0, "H0", 4, "speak"): 1.0, (1, "H1", 5, "speak"): 3.0,
                   (1, "H0", 5, "answer[0]"): 10.0, (0, "MLP", 1, "{name}[-1]"): 2.0})  # fmt: skip
    m, want = A.mass(s), literal_mass(s)
    assert m["late_at_last_prompt_token"] == pytest.approx(want["late_at_last_prompt_token"])
    assert m["late_at_last_prompt_token"] > 0 and m["last_prompt_roles"] == ["speak"]
    assert m["answer_tokens"] == pytest.approx(10.0 / float(s.values.abs().sum()))
    assert m["early_mlp_at_entity"] == pytest.approx(want["early_mlp_at_entity"])


@pytest.mark.parametrize("layer", [1, 2, 3])
def test_mass_splits_early_and_late_at_half_the_layers(layer):
    """An MLP at the entity in layer 1, 2 (early: < 6/2) or 3 (late), and late mass at "speak":
    the split falls where the literal reading puts it, not at L/3."""
    s = hand_made({(0, "MLP", layer, "{name}[-1]"): 2.0, (0, "MLP", layer, "speak"): 1.0})
    m, want = A.mass(s), literal_mass(s)
    assert m["early_mlp_at_entity"] == pytest.approx(want["early_mlp_at_entity"])
    assert m["late_at_last_prompt_token"] == pytest.approx(want["late_at_last_prompt_token"])
    assert m["early_layers"] == [0, 2]


def test_prompt_positions_drop_the_answer_tokens_only():
    s = hand_made({(1, "H0", 5, "answer[0]"): 10.0, (0, "H1", 2, "speak"): 1.0})
    p = A.prompt_positions(s)
    assert p.position_labels == ("The", "{name}[-1]", "speak")
    assert all(not A.is_answer_role(r) for roles in p.prompt_roles for r in roles)
    assert float(p.values.abs().sum()) == pytest.approx(0.5)  # "speak": 1 and 0, mean of 2
    assert A.mass(p)["answer_tokens"] == 0.0


@pytest.mark.parametrize("n", [2, 3, 5, 20])
def test_chance_is_the_mean_rank_of_a_random_order(n):
    """The answer's 0-indexed rank averaged over every order of n candidates (n <= 5 by
    enumeration; 20 by its closed form, the mean of 0..19)."""
    if n <= 5:
        orders = list(itertools.permutations(range(n)))
        want = sum(order.index(0) for order in orders) / len(orders)
    else:
        want = sum(range(n)) / n
    assert A.chance(n) == pytest.approx(want)


def test_rank_table_normalises_by_length_and_reads_first_tokens():
    """Prompt 0: the answer (1 token, log p -3) beats a 2-token candidate summed (-4) but not
    per token (-2); prompt 1: a candidate sharing the answer's first token ties with it."""
    whole = torch.tensor([[-3.0, -4.0, -9.0], [-5.0, -2.0, -6.0]])
    first = torch.tensor([[-3.0, -1.0, -8.0], [-1.0, -1.0, -4.0]])
    lengths = torch.tensor([[1, 2, 1], [3, 2, 1]])
    answer = torch.tensor([0, 0])
    t = A.rank_table(whole, first, lengths, answer)
    literal = {"whole": [], "per_token": [], "first_token": []}
    for i in range(2):
        for way, sc in (("whole", whole[i]), ("per_token", whole[i] / lengths[i]),
                        ("first_token", first[i])):  # fmt: skip
            literal[way].append(sum(1 for j in range(3) if sc[j] > sc[answer[i]]))
    assert {k: v.tolist() for k, v in t.items()} == literal
    assert literal == {"whole": [0, 1], "per_token": [1, 1], "first_token": [1, 0]}


def test_permutation_null_keeps_the_length_bias():
    """Six candidates, the last two (say 3-token names) scored far below the rest by every
    prompt, and two of the four prompts' answers among them: with the answers permuted among
    the prompts the null mean is the literal average over all assignments, not chance (2.5)."""
    scores = torch.tensor([[0.0, -1.0, -2.0, -3.0, -20.0, -21.0],
                           [-3.0, 0.0, -1.0, -2.0, -21.0, -20.0],
                           [-1.0, -2.0, 0.0, -3.0, -20.0, -22.0],
                           [-2.0, -3.0, -1.0, 0.0, -22.0, -20.0]])  # fmt: skip
    answer = torch.tensor([0, 1, 4, 5])
    null = A.permutation_null(scores, answer, n_perm=2000, seed=0)
    perms = list(itertools.permutations(range(4)))
    literal = sum(
        sum(int((scores[i] > scores[i, answer[list(p)][i]]).sum()) for i in range(4)) / 4
        for p in perms
    ) / len(perms)
    assert literal == pytest.approx(3.0) and A.chance(6) == 2.5
    assert float(null.mean()) == pytest.approx(literal, abs=0.05)
    assert torch.equal(null, A.permutation_null(scores, answer, n_perm=2000, seed=0))
    summary = A.null_summary(0.0, null)
    assert summary["p_low"] == pytest.approx(float((null <= 0).sum() + 1) / 2001)


def test_interval_is_a_seeded_percentile_bootstrap():
    """The mean's 2.5% and 97.5% quantiles over resamples drawn literally with stats.draws."""
    from extractive_lens.stats import draws

    x = torch.tensor([0.0, 0.0, 1.0, 9.0])
    a, b = A.interval(x, seed=3), A.interval(x, seed=3)
    assert a == b and a["estimate"] == pytest.approx(2.5) and a["low"] <= 2.5 <= a["high"]
    means = torch.tensor([float(x[d].mean()) for d in draws(4, 1000, seed=3)], dtype=torch.float64)
    assert a["low"] == pytest.approx(float(means.quantile(0.025)))
    assert a["high"] == pytest.approx(float(means.quantile(0.975)))


def test_reverted_shares_state_the_fraction_lost():
    """The first hop's facts: None 0.00, Early 3.85, All 8.70 -> Early loses 44%."""
    rows = [dict(dataset="d", split="facts", condition=c, mean_rank=r)
            for c, r in (("None", 0.0), ("Early", 3.85), ("Late", 0.0), ("All", 8.7))]  # fmt: skip
    rows += [dict(dataset="d", split="implications", condition=c, mean_rank=9.0)
             for c in ("None", "Early", "All")]  # fmt: skip
    rows += [dict(dataset="e", split="facts", condition=c, mean_rank=r)
             for c, r in (("None", 2.0), ("Early", 5.0), ("All", 8.0))]  # fmt: skip
    shares = {(r["dataset"], r["split"], r["condition"]): r["lost"]
              for r in A.reverted_shares(rows)}  # fmt: skip
    assert shares["e", "facts", "Early"] == pytest.approx(0.5)  # (5 - 2) / (8 - 2)
    shares = {(s, c): v for (d, s, c), v in shares.items() if d == "d"}
    assert shares["facts", "Early"] == pytest.approx(3.85 / 8.7)
    assert shares["facts", "Late"] == 0.0 and shares["facts", "All"] == 1.0
    assert math.isnan(shares["implications", "Early"])  # nothing learned: no share


def test_freezing_summary_spreads_over_seeds():
    def rows(early):
        return [dict(dataset="d", split="facts", condition=c, mean_rank=r, ranks=[r, r])
                for c, r in (("None", 0.0), ("Early", early), ("All", 8.0))]  # fmt: skip

    out = A.freezing_summary({"0": rows(2.0), "1": rows(4.0), "2": rows(6.0)})
    early = next(r for r in out if r["condition"] == "Early")
    assert early["mean_rank"]["per_seed"] == [2.0, 4.0, 6.0]
    assert early["mean_rank"]["mean"] == pytest.approx(4.0)
    assert early["lost"]["per_seed"] == pytest.approx([0.25, 0.5, 0.75])


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_scored_sets_take_their_own_datasets_reference(text_model):
    """y* of the facts is the facts' mean, of the implications the implications'."""
    from extractive_lens.datasets.twohop import first_hop
    from extractive_lens.real_model.protocol import scored_sets

    facts, impls = first_hop(n=4).batches(text_model)
    sets = scored_sets(facts, impls, [0, 1])
    for what, batch in (("facts", facts), ("implications", impls)):
        sub, ref = sets[what]
        assert ref.prompts == batch.prompts
        assert sub.prompts == batch.prompts[:2]


def test_summary_prints_numbers_with_intervals_not_json():
    from extractive_lens.real_model import summary

    iv = dict(estimate=1.15, low=0.6, high=1.8, n=20, n_boot=1000, seed=0)
    null = dict(mean=9.4, low=8.1, high=10.6, p_low=0.001)
    ranks = dict(whole=iv, per_token=iv, first_token=iv, whole_null=null, per_token_null=null,
                 chance=9.5, n_candidates=20)  # fmt: skip
    results = {
        "times": {"known_hop": {}, "first_hop": {}},
        "known_hop": dict(
            template="The people in the city {city} speak", n=20, top1=11, top3=18, summary=ranks
        ),  # fmt: skip
        "first_hop": dict(
            n=20,
            spread={
                "facts": {
                    "whole": dict(per_seed=[0.0, 0.1, 0.0], mean=0.033, min=0.0, max=0.1, sd=0.05)
                }
            },  # fmt: skip
            seeds={
                "0": dict(losses=[3.2, 0.01], before={"facts": ranks}, after={"facts": ranks}),
                "1": {},
                "2": {},
            },
        ),  # fmt: skip
    }
    text = "\n".join(summary.lines(results))
    assert "top-1 11/20" in text and "1.15 [0.60, 1.80]" in text and "chance 9.5" in text
    assert "8.10, 10.60" in text and "0.03 (0.00-0.10, 3 seeds)" in text
    assert "{" not in text.replace("{city}", "") and "NaN" not in text and "\\u" not in text
    assert len(text.splitlines()) <= 8


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_the_protocol_runs_end_to_end_on_a_tiny_model(text_model, monkeypatch, tmp_path):
    """``run`` on a tiny model with a real (BPE) tokenizer in place of SmolLM2: the steps of
    the demo write results.json with intervals and the null, print the summary (no raw JSON)
    and write one report.html."""
    import json

    import extractive_lens.backend.gguf as gguf
    from extractive_lens.real_model import protocol

    monkeypatch.setattr(gguf, "installed_gguf", lambda name: tmp_path / "model.gguf")
    monkeypatch.setattr(protocol.el, "load_pretrained", lambda name: text_model)
    monkeypatch.setitem(protocol.FINETUNE, "epochs", 2)
    monkeypatch.setattr(protocol, "save_figure", lambda fig, stem: None)  # the report has them
    printed: list[str] = []
    res = protocol.run(tmp_path / "out", ["known_hop", "first_hop", "scores"], n=4,
                       score_prompts=2, top_k=2, nodes=1, seeds=[0, 1],
                       echo=printed.append)  # fmt: skip
    saved = json.loads((tmp_path / "out" / "results.json").read_text())
    after = saved["first_hop"]["seeds"]["0"]["after"]["implications"]
    assert {"whole", "per_token", "first_token", "whole_null", "chance"} <= set(after)
    assert after["whole"]["low"] <= after["whole"]["estimate"] <= after["whole"]["high"]
    assert saved["first_hop"]["spread"]["facts"]["whole"]["per_seed"].__len__() == 2
    assert len(saved["first_hop"]["seeds"]["0"]["ranks"]) == 3  # before + 2 epochs
    assert len(saved["first_hop"]["seeds"]["1"]["ranks"]) == 2  # before and after
    m = saved["scores"]["mass_implications"]["linear"]
    assert len(m["last_prompt_roles"]) == 1 and not m["last_prompt_roles"][0].startswith("answer")
    late = saved["scores"]["mass_implications_intervals"]["all"]["late_at_last_prompt_token"]
    assert late["low"] <= late["estimate"] == m["late_at_last_prompt_token"] <= late["high"]
    assert saved["scores"]["facts_linear_vs_causal"] and "known_hop" in res
    text = "\n".join(printed)
    assert "known hop" in text and "whole answer" in text and '": ' not in text
    assert (tmp_path / "out" / "report.html").stat().st_size > 10_000


def test_no_share_of_an_improvement_within_noise():
    """Implications at chance before and after: per prompt, All - None is +5, -5, +5, -4 (mean
    0.25 > 0, but its bootstrap interval over prompts reaches 0), so no condition gets a share
    (the first run printed "loses 148%"); the facts' +8 on every prompt keeps its shares."""
    from extractive_lens.stats import draws

    def rows(split, none, all_, early):
        return [dict(dataset="d", split=split, condition=c, mean_rank=sum(r) / len(r), ranks=r)
                for c, r in (("None", none), ("Early", early), ("All", all_))]  # fmt: skip

    data = rows("implications", [4, 9, 4, 9], [9, 4, 9, 5], [9, 9, 9, 9])
    data += rows("facts", [0, 0, 0, 0], [8, 8, 8, 8], [4, 4, 4, 4])
    shares = {(r["split"], r["condition"]): r for r in A.reverted_shares(data)}
    diff = torch.tensor([5.0, -5.0, 5.0, -4.0], dtype=torch.float64)
    means = torch.tensor([float(diff[d].mean()) for d in draws(4, 1000, seed=0)])
    assert float(means.quantile(0.025)) <= 0  # the literal interval reaches 0
    learned = shares["implications", "All"]["learned"]
    assert learned["estimate"] == pytest.approx(0.25) and learned["low"] <= 0
    assert all(math.isnan(shares["implications", c]["lost"]) for c in ("Early", "All"))
    assert shares["facts", "Early"]["lost"] == pytest.approx(0.5)
    assert shares["facts", "All"]["learned"]["low"] == pytest.approx(8.0)
    summary = A.freezing_summary({"0": data})
    from extractive_lens.real_model.summary import step_lines

    text = "\n".join(step_lines("freezing", {"freezing": dict(split_layer=2, summary=summary)}))
    assert "loses 50%" in text and "not above 0, no shares" in text and "nan" not in text


def test_mass_intervals_resample_prompts_literally():
    """Each share's interval: the quantiles over resamples (``stats.draws``) of the share read
    off that resample's role-aligned mean map, built here by loops over prompts and cells."""
    from extractive_lens.stats import draws

    s = hand_made({(0, "H0", 4, "speak"): 1.0, (1, "H1", 5, "speak"): 3.0,
                   (1, "H0", 5, "answer[0]"): 10.0, (0, "MLP", 1, "{name}[-1]"): 2.0,
                   (1, "MLP", 0, "{name}[-1]"): -4.0})  # fmt: skip
    pv = s.prompt_values[0]
    got = A.mass_intervals(s, n_boot=200, seed=5)
    literal: dict[str, list[float]] = {k: [] for k in A.SHARES}
    for idx in draws(2, 200, seed=5).tolist():
        m = torch.zeros(pv.shape[1:], dtype=torch.float64)
        for p, label in enumerate(LABELS):
            having = [b for b in idx if label in ROLES[b]]
            for layer in range(pv.shape[1]):
                for c in range(len(COMPONENTS)):
                    if having:
                        cells = [float(pv[b, layer, c, ROLES[b].index(label)]) for b in having]
                        m[layer, c, p] = abs(sum(cells) / len(cells))
        total = float(m.sum())
        literal["answer_tokens"].append(float(m[:, :, 3].sum()) / total)
        literal["mlps"].append(float(m[:, 2].sum()) / total)
        literal["late_at_last_prompt_token"].append(float(m[3:, :, 2].sum()) / total)
        literal["early_mlp_at_entity"].append(float(m[:3, 2, 1].sum()) / total)
    for key in ("answer_tokens", "mlps", "late_at_last_prompt_token", "early_mlp_at_entity"):
        t = torch.tensor(literal[key], dtype=torch.float64)
        assert got[key]["low"] == pytest.approx(float(t.quantile(0.025))), key
        assert got[key]["high"] == pytest.approx(float(t.quantile(0.975))), key
        assert got[key]["estimate"] == pytest.approx(A.mass(s)[key])
    assert got["answer_tokens"]["low"] < got["answer_tokens"]["high"]

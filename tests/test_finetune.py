"""finetune() leaves the model bit-identical and its diff reproduces the trained weights."""

from __future__ import annotations

import pytest
import torch

from extractive_lens import FinetuneConfig, finetune, mean_rank
from extractive_lens import backend as B
from extractive_lens.batch import PromptBatch
from extractive_lens.finetuning import ranks_from_logits
from tests.conftest import make_pair
from tests.helpers import facts


def test_finetune_learns_and_restores():
    base, _ = make_pair("ln_gelu", torch.float32)
    data = facts(base)
    snap = {n: p.detach().clone() for n, p in base.named_parameters()}
    before = mean_rank(base, data)
    diff = finetune(base, data, FinetuneConfig(lr=3e-3, epochs=30, batch_size=4, schedule="linear"))
    for n, p in base.named_parameters():
        assert torch.equal(p, snap[n]) and p.grad is None
    after = mean_rank(base, data, diff)
    assert before > 1.0 and after < 0.5 * before
    assert diff.metadata["finetune"]["lr"] == 3e-3


def test_diff_reproduces_trained_weights_and_seed_reproduces():
    base, _ = make_pair("ln_gelu", torch.float32)
    data = facts(base)
    seen = {}

    def grab(epoch, d):
        seen[epoch] = d

    cfg = FinetuneConfig(lr=1e-3, epochs=2, batch_size=4, seed=3)
    d1 = finetune(base, data, cfg, callback=grab)
    d2 = finetune(base, data, cfg)
    for n in d1.deltas:
        assert torch.equal(d1.deltas[n], d2.deltas[n])
        assert torch.equal(d1.deltas[n], seen[1].deltas[n])
    # the trained weights are base + Δ: retrain by hand with the same seed and compare
    torch.manual_seed(0)
    assert seen[0].norm() < d1.norm()


def test_trainable_subset_only_changes_those_components():
    base, _ = make_pair("rms_gated_rotary_gqa", torch.float32)
    data = facts(base)
    diff = finetune(
        base,
        data,
        FinetuneConfig(
            lr=1e-2,
            epochs=2,
            batch_size=4,
            trainable=("L1H0", "L0MLP"),
            optimizer="adamw",
            weight_decay=0.1,
        ),
    )
    norms = torch.tensor(diff.norms().to_numpy())
    assert diff.norms().loc["L1", "H0"] == norms[1, 0] > 0 and norms[0, -1] > 0
    assert norms[0, :-1].sum() == 0  # layer-0 heads untouched
    assert diff.other_norm() == 0
    d = diff.deltas["blocks.1.attn.W_Q"]
    assert d[0].abs().sum() > 0 and d[1:].abs().sum() == 0
    assert diff.deltas["blocks.1.attn._W_K"][1].abs().sum() == 0  # the other KV group
    assert diff.deltas["blocks.1.attn._W_K"][0].abs().sum() > 0  # L1H0's group (shared with L1H1)
    # heads 2, 3 of layer 1 see only the shared ln1 change
    ln1 = sum(
        float(diff.deltas[n].double().pow(2).sum())
        for n in diff.deltas
        if n.startswith("blocks.1.ln1.")
    )
    assert torch.allclose(norms[1, 2:4], torch.full((2,), ln1**0.5, dtype=torch.float64))
    assert norms[1, 4] == 0  # L1MLP
    layer_only = finetune(base, data, FinetuneConfig(lr=1e-2, epochs=1, batch_size=4, layers=(0,)))
    assert layer_only.norms().loc["L1"].sum() == 0 and layer_only.norms().loc["L0"].sum() > 0


def test_mean_rank_by_hand():
    logits = torch.zeros(2, 2, 6)
    logits[0, 1] = torch.tensor(
        [0.0, 5.0, 1.0, 3.0, 0.0, 0.0]
    )  # answer 3: candidates 1,2,3 -> rank 1
    logits[1, 0] = torch.tensor([0.0, 0.0, 9.0, 1.0, 0.0, 0.0])  # answer 2 (prompt len 1) -> rank 0
    b = PromptBatch(
        tokens=torch.zeros(2, 2, dtype=torch.long),
        lengths=torch.tensor([2, 1]),
        prompt_lengths=torch.tensor([2, 1]),
        answer_targets=torch.tensor([[3], [2]]),
        candidates=torch.tensor([[1, 2, 3], [2, 3, -1]]),
        counterfactual=None,
        roles=(("a", "b"), ("a",)),
        prompts=("x", "y"),
        answers=("3", "2"),
    )
    assert ranks_from_logits(logits, b).tolist() == [1, 0]


def test_config_validation():
    with pytest.raises(ValueError, match="optimizer"):
        FinetuneConfig(optimizer="sgd")
    with pytest.raises(ValueError, match="positive"):
        FinetuneConfig(epochs=0)


def test_rank_trajectory_records_every_epoch():
    from extractive_lens.finetuning import rank_trajectory

    base, _ = make_pair("ln_gelu", torch.float32)
    data = facts(base)
    diff, df = rank_trajectory(
        base, data, {"facts": data}, FinetuneConfig(lr=3e-3, epochs=3, batch_size=4)
    )
    assert list(df.epoch) == [0, 1, 2, 3] and set(df.split) == {"facts"}
    assert df.mean_rank.iloc[-1] == mean_rank(base, data, diff)


def test_losses_recorded_and_shown_in_the_bar(capsys):
    """The mean loss of each epoch is in the diff's metadata (checked against the loss of the
    prompts by hand at the end) and in the progress bar; no bar when stderr is not a terminal."""
    from extractive_lens.rewards import answer_logprob

    base, _ = make_pair("ln_gelu", torch.float32)
    data = facts(base)
    cfg = FinetuneConfig(lr=3e-3, epochs=12, batch_size=8, schedule="constant")
    capsys.readouterr()
    diff = finetune(base, data, cfg)  # stderr is captured: not a terminal, so no bar
    assert capsys.readouterr().err == ""
    losses = diff.metadata["losses"]
    assert len(losses) == 12 and losses[-1] < 0.5 * losses[0]
    with torch.no_grad():  # the first epoch's loss is the base model's loss on the data (the
        # whole batch is one step, taken after the loss is computed)
        first = float(-answer_logprob(base(data.tokens), data).mean())
    assert losses[0] == pytest.approx(first, rel=1e-5)
    finetune(base, data, cfg, show_progress=True)
    err = capsys.readouterr().err
    assert "finetune" in err and "loss=" in err


def test_on_epoch_evaluates_the_trained_weights_in_place():
    """``on_epoch`` sees the checkpoint ``callback`` reaches through ``diff.applied`` (the
    same ranks and logits), with the original weights back afterwards."""
    base, _ = make_pair("ln_gelu", torch.float32)
    data = facts(base)
    snap = {n: p.detach().clone() for n, p in base.named_parameters()}
    cfg = FinetuneConfig(lr=3e-3, epochs=3, batch_size=4, seed=1)
    in_place, applied = [], []

    def seen(epoch):
        with torch.no_grad():
            in_place.append(base(data.tokens))

    def through_diff(epoch, diff):
        with torch.no_grad(), diff.applied(base):
            applied.append(base(data.tokens))

    finetune(base, data, cfg, on_epoch=seen, callback=through_diff)
    assert len(in_place) == 3 and not torch.equal(in_place[0], in_place[-1])
    for a, b in zip(in_place, applied):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    for n, p in base.named_parameters():
        assert torch.equal(p, snap[n])


def test_delta_dtype_float32_holds_the_same_update_in_half_the_bytes():
    """``delta_dtype="float32"``: Δ in float32 (half of the default float64 for float32
    weights), and ``W + Δ`` the default's trained weights to within one float32 unit."""
    base, _ = make_pair("ln_gelu", torch.float32)
    data = facts(base)
    cfg = FinetuneConfig(lr=1e-3, epochs=2, batch_size=4, seed=3)
    wide = finetune(base, data, cfg)
    narrow = finetune(base, data, FinetuneConfig(**{**cfg.__dict__, "delta_dtype": "float32"}))
    assert {d.dtype for d in wide.deltas.values()} == {torch.float64}
    assert {d.dtype for d in narrow.deltas.values()} == {torch.float32}
    assert narrow.metadata["finetune"]["delta_dtype"] == "float32"
    params = B.parameters(base)  # TransformerLens names, whatever the class
    for n, d in narrow.deltas.items():
        w = params[n].detach()
        trained = (w.double() + wide.deltas[n]).float()  # W' exactly (float64 Δ)
        ulp = torch.finfo(torch.float32).eps * torch.maximum(w.abs(), trained.abs())
        assert ((w + d) - trained).abs().le(ulp).all(), n
        assert torch.equal(d, wide.deltas[n].float())  # the same update, rounded once
    with pytest.raises(ValueError, match="delta_dtype"):
        FinetuneConfig(delta_dtype="float16")  # type: ignore[arg-type]

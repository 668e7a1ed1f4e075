"""The embedding and the unembedding read a part of the vocabulary at a time (backend/vocab.py).

With ``SLICE_BYTES`` forced to 0 the tiny models take the sliced path; their scores must be
those of the whole-matrix path on every family, and no vocabulary-sized ``W + αΔ`` (nor its
upcast) may be formed.
"""

from __future__ import annotations

import pytest
import torch

import extractive_lens as el
from extractive_lens import backend as B
from extractive_lens.backend import shift, vocab
from extractive_lens.backend.installed import has_hooked
from tests.conftest import make_pair
from tests.test_read_only import assert_untouched, snapshot

pytestmark = pytest.mark.skipif(not has_hooked(), reason="the hooked backend reads by part")

CALLS = {
    "linear": lambda m, d, b: el.linear_scores(m, d, b, show_progress=False),
    "linear_authors": lambda m, d, b: el.linear_scores(
        m, d, b, convention="authors_code", show_progress=False
    ),
    "exact": lambda m, d, b: el.causal_scores(m, d, b, per="component", show_progress=False),
    "integrated": lambda m, d, b: el.integrated_scores(m, d, b, steps=2, show_progress=False),
}


def _setting(pair):
    base, ft = pair
    diff = el.WeightDiff.from_models(base, ft)
    batch = el.make_batch(base, [([1, 2, 3, 4], [5]), ([2, 3, 3, 6], [7])], candidates=[5, 7])
    return base, diff, batch


def _sliced(monkeypatch, columns: int = 7) -> None:
    monkeypatch.setattr(vocab, "SLICE_BYTES", 0)
    monkeypatch.setattr(vocab, "COLUMNS", columns)  # uneven: the last slice is short


def _same(a, b) -> None:
    assert a.kinds == b.kinds
    torch.testing.assert_close(a.prompt_values, b.prompt_values, rtol=0, atol=1e-12, equal_nan=True)
    if a.other is not None:
        torch.testing.assert_close(a.other, b.other, rtol=0, atol=1e-12)


@pytest.mark.parametrize("call", list(CALLS))
def test_scores_by_part_are_the_whole_matrix_scores(pair64, call, monkeypatch):
    model, diff, batch = _setting(pair64)
    whole = CALLS[call](model, diff, batch)
    _sliced(monkeypatch)
    assert vocab.by_part(model, model.embed.W_E) and vocab.by_part(model, model.unembed.W_U)
    before = snapshot(model)
    _same(CALLS[call](model, diff, batch), whole)
    assert_untouched(model, before)  # read-only by part too


def test_pieces_by_part_match_under_shift_jvp_and_backward(monkeypatch):
    """embed/unembed at α = 0.3: values, the forward-mode tangent along Δ and dR/dx."""
    model, diff, batch = _setting(make_pair("ln_gelu", torch.float64))
    tokens = batch.tokens

    whole = vocab_pieces(model, diff, tokens)
    _sliced(monkeypatch)
    parts = vocab_pieces(model, diff, tokens)
    for a, b in zip(whole[1:3], parts[1:3]):  # logits, dR/dx
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    for a, b in zip(whole[3:], parts[3:]):  # the tangents
        assert a.abs().max() > 0
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def vocab_pieces(model, diff, tokens) -> list[torch.Tensor]:
    """``[x, logits, dR/dx, *tangents]`` of embed/unembed at α = 0.3 (``R = Σ logits²``; the
    forward-mode tangents along the vocabulary matrices' Δ): what the by-part path must keep."""
    with shift.shifted(model, diff, alpha=0.3):
        x = B.embed(model, tokens).detach().requires_grad_(True)
        logits = B.unembed(model, x)
        (dx,) = torch.autograd.grad(logits.pow(2).sum(), x)
    with torch.no_grad():
        tang = {n: diff.deltas[n] for n in ("embed.W_E", "unembed.W_U")}
        _, dots = B.jvp(model, lambda m: [B.embed(m, tokens), B.unembed(m, x.detach())], (), tang)
    return [x.detach(), logits.detach(), dx, *dots]


def test_no_vocabulary_sized_weight_is_formed(monkeypatch):
    """The sliced path never forms a ``d_vocab``-sized ``W + αΔ`` or upcast of one."""
    model, diff, batch = _setting(make_pair("ln_gelu", torch.float64))
    _sliced(monkeypatch, columns=16)
    V = model.cfg.d_vocab
    formed: list[tuple[int, ...]] = []
    value, part = shift.Shift.value, vocab._part

    def seen_value(self, p, dtype):
        out = value(self, p, dtype)
        formed.append(tuple(out.shape))
        return out

    def seen_part(*args):
        out = part(*args)
        formed.append(tuple(out.shape))
        return out

    monkeypatch.setattr(shift.Shift, "value", seen_value)
    monkeypatch.setattr(vocab, "_part", seen_part)
    for call in CALLS.values():
        call(model, diff, batch)
    assert formed and not [s for s in formed if V in s and len(s) > 1]  # b_U is a vector
    assert any(s == (model.cfg.d_model, 16) for s in formed)  # the unembedding's slices ran


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_low_rank_embedding_adapters_by_part(arch, tmp_path, monkeypatch):
    """A LoRA Δ on the embedding (GPT-2: tied, so the unembedding's is its transpose): the
    factors are restricted to the rows / columns read, with the whole path's scores."""
    pytest.importorskip("peft")
    from extractive_lens.backend.loading import load_checkpoint
    from extractive_lens.backend.lowrank import low_rank_factors
    from tests import lora_models as LM
    from tests.test_lora import ADAPTERS

    hf = LM.base_checkpoint(arch, tmp_path / "base")
    LM.train_adapter(hf, ADAPTERS[arch]).save_pretrained(tmp_path / "adapter")
    base = load_checkpoint(tmp_path / "base", dtype=torch.float64, backend="hooked")
    diff = el.WeightDiff.from_peft(base, tmp_path / "adapter")
    factors = low_rank_factors(diff.deltas, B.backend_for(base))
    assert "embed.W_E" in factors
    g = torch.Generator().manual_seed(1)
    prompts = [([1, *torch.randint(4, LM.VOCAB, (4,), generator=g).tolist()], [10 + i])
               for i in range(2)]  # fmt: skip
    batch = el.make_batch(base, prompts, candidates=[10, 11])
    whole = {k: f(base, diff, batch) for k, f in CALLS.items()}
    _sliced(monkeypatch)
    for k, f in CALLS.items():
        _same(f(base, diff, batch), whole[k])


def test_bf16_model_scored_in_float32_by_part(monkeypatch):
    """Rows and slices of a bf16 matrix are upcast where they are read, as the whole was."""
    model, diff, batch = _setting(make_pair("ln_gelu", torch.bfloat16))
    whole = el.linear_scores(model, diff, batch, show_progress=False)
    _sliced(monkeypatch)
    got = el.linear_scores(model, diff, batch, show_progress=False)
    assert got.prompt_values.dtype == torch.float32
    torch.testing.assert_close(got.prompt_values, whole.prompt_values, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got.other, whole.other, rtol=1e-5, atol=1e-6)

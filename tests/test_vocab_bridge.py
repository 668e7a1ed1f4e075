"""The TransformerBridge's embedding and unembedding read a part of the vocabulary at a time
(backend/vocab.py, backend/bridge.py): GPT-2 (tied: one stored matrix, ``unembed.W_U`` its
transpose) and Llama (an untied ``lm_head``, stored ``[d_vocab, d_model]``).

With ``SLICE_BYTES`` forced to 0 the tiny bridges take the sliced path: their scores must be
the whole-matrix path's in float64, and no vocabulary-sized tensor (``W + αΔ``, an upcast, a
dense tangent over the stored weight) may be formed. Runs on TransformerLens 3.9 and 4.3 (both
ship the bridge).
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import extractive_lens as el
from extractive_lens.backend import shift, vocab

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.filterwarnings(
    "ignore::extractive_lens.scoring.linear.AdditivityWarning",
    "ignore::extractive_lens.scoring.integrated.CompletenessWarning",
)

VOCAB, D_MODEL = 83, 44  # sizes no other axis of these tiny models has

CALLS = {
    "linear": lambda m, d, b: el.linear_scores(m, d, b, show_progress=False),
    "exact": lambda m, d, b: el.causal_scores(m, d, b, per="component", show_progress=False),
    "exact_token": lambda m, d, b: el.causal_scores(m, d, b, top_k=2, show_progress=False),
    "integrated": lambda m, d, b: el.integrated_scores(m, d, b, steps=2, show_progress=False),
}


def _hf(arch: str):
    if arch == "gpt2":  # tied embeddings
        return transformers.GPT2Config(
            vocab_size=VOCAB, n_embd=D_MODEL, n_layer=2, n_head=4, n_positions=64
        )
    return transformers.LlamaConfig(  # an lm_head of its own
        vocab_size=VOCAB, hidden_size=D_MODEL, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, intermediate_size=48, max_position_embeddings=64,
    )  # fmt: skip


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def setting(request):
    """A float64 base and finetuned bridge (every weight changed), their diff and a batch."""
    return _setting(request.param, torch.float64)


def _setting(arch: str, dtype: torch.dtype):
    torch.manual_seed(0)
    hfs = [transformers.AutoModelForCausalLM.from_config(_hf(arch)).double().eval()
           for _ in range(2)]  # fmt: skip
    with torch.no_grad():
        for p, q in zip(hfs[0].parameters(), hfs[1].parameters()):
            q.copy_(p + 0.02 * torch.randn_like(p))
    base, ft = (el.from_hf(h.to(dtype), backend="bridge") for h in hfs)
    diff = el.WeightDiff.from_models(base, ft)
    for name in ("embed.W_E", "unembed.W_U"):  # changed nearly everywhere (bf16 rounds some)
        assert diff.deltas[name].ne(0).float().mean() > 0.9
    g = torch.Generator().manual_seed(1)
    pairs = [([1, *torch.randint(4, VOCAB, (4 + i % 2,), generator=g).tolist()], [10 + i])
             for i in range(3)]  # fmt: skip
    batch = el.make_batch(base, pairs, candidates=[10, 11, 12])
    return arch, base, diff, batch


def _sliced(monkeypatch, columns: int = 7) -> None:
    monkeypatch.setattr(vocab, "SLICE_BYTES", 0)
    monkeypatch.setattr(vocab, "COLUMNS", columns)  # uneven: the last slice is short


def _same(a, b) -> None:
    assert a.kinds == b.kinds
    assert a.prompt_values.nan_to_num().abs().max() > 1e-3  # not trivially equal
    torch.testing.assert_close(a.prompt_values, b.prompt_values, rtol=0, atol=1e-12, equal_nan=True)
    if a.other is not None:
        torch.testing.assert_close(a.other, b.other, rtol=0, atol=1e-12)


def test_the_bridges_vocabulary_matrices(setting, monkeypatch):
    arch, model, _, _ = setting
    named = vocab.named(model)
    (W_E, flat_E), (W_U, flat_U) = named["embed.W_E"], named["unembed.W_U"]
    assert (flat_E, flat_U) == (False, True)  # lm_head.weight is W_U's transpose
    assert W_E.shape == W_U.shape == (VOCAB, D_MODEL)
    assert (W_E is W_U) == (arch == "gpt2")  # tied on GPT-2
    assert vocab.matrices(model) == ()  # small: read whole
    _sliced(monkeypatch)
    assert len(vocab.matrices(model)) == (1 if arch == "gpt2" else 2)


@pytest.mark.parametrize("call", list(CALLS))
def test_scores_by_part_are_the_whole_matrix_scores(setting, call, monkeypatch):
    _, model, diff, batch = setting
    whole = CALLS[call](model, diff, batch)
    _sliced(monkeypatch)
    _same(CALLS[call](model, diff, batch), whole)


def test_pieces_by_part_match_under_shift_jvp_and_backward(setting, monkeypatch):
    """embed/unembed at α = 0.3: values, dR/dx, and the forward-mode tangent along Δ of the
    vocabulary matrices (GPT-2: both names of its one tied matrix)."""
    _, model, diff, batch = setting
    tokens = batch.tokens

    from tests.test_vocab import vocab_pieces

    whole = vocab_pieces(model, diff, tokens)
    _sliced(monkeypatch)
    for a, b in zip(whole, vocab_pieces(model, diff, tokens)):
        assert a.abs().max() > 0
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


class _Formed(TorchDispatchMode):
    """Every new tensor (not a view of an input) of a vocabulary matrix's size that an operation
    makes: ``[d_vocab, d_model]``, its transpose, or flat (logits, ``[.., d_vocab]``, are not)."""

    def __init__(self) -> None:
        super().__init__()
        self.large: list[tuple[str, tuple[int, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        seen = {_storage(t) for t in torch.utils._pytree.tree_leaves((args, kwargs))}
        for t in torch.utils._pytree.tree_leaves(out):
            if (
                isinstance(t, torch.Tensor)
                and (sorted(t.shape) == [D_MODEL, VOCAB] or t.shape == (VOCAB * D_MODEL,))
                and _storage(t) not in seen
            ):
                self.large.append((str(func), tuple(t.shape)))
        return out


def _storage(t) -> int | None:
    if not isinstance(t, torch.Tensor):
        return None
    try:
        return t.untyped_storage().data_ptr()
    except RuntimeError:  # a tensor without storage of its own (a wrapper)
        return None


def test_no_vocabulary_sized_tensor_is_formed(setting, monkeypatch):
    """By part, no operation of any method forms a vocabulary-sized tensor, and the store reads
    Δ of the vocabulary matrices a part at a time; whole, the same spy sees them (a control)."""
    _, model, diff, batch = setting
    with _Formed() as spy:
        CALLS["linear"](model, diff, batch)
    assert spy.large  # the whole-matrix path forms W + αΔ (the spy sees it)
    _sliced(monkeypatch, columns=16)
    reads: list[tuple[int, ...]] = []
    part = shift.Shift.part

    def seen_part(self, p, dim, index):
        out = part(self, p, dim, index)
        if out is not None:
            reads.append(tuple(out.shape))
        return out

    monkeypatch.setattr(shift.Shift, "part", seen_part)
    with _Formed() as spy:
        for call in CALLS.values():
            call(model, diff, batch)
    assert not spy.large, spy.large[:5]
    assert (16, D_MODEL) in reads  # the unembedding's slices of Δ
    assert all(s[0] <= 16 for s in reads), reads  # only parts of Δ (rows: the batch's tokens)


def test_tied_changes_must_agree_by_part(setting, monkeypatch):
    """GPT-2's ``embed.W_E`` and ``unembed.W_U`` are one stored matrix: read by part, changes that
    differ there are the clear error the whole path gives."""
    arch, model, diff, batch = setting
    if arch != "gpt2":
        pytest.skip("Llama's embeddings are not tied")
    W_U = diff.deltas["unembed.W_U"].clone()
    W_U[3, VOCAB - 1] += 1e-3  # in the last (short) slice
    bad = el.WeightDiff(dict(diff.deltas, **{"unembed.W_U": W_U}), diff.signature)
    _sliced(monkeypatch)
    with pytest.raises(ValueError, match="tied weights"):
        el.linear_scores(model, bad, batch, kinds="informative", show_progress=False)


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_bf16_bridge_scored_in_float32_by_part(arch, monkeypatch):
    """A bf16 bridge scored in float32: the parts are upcast where they are read, as the whole
    matrix was, and no float32 copy of a whole vocabulary matrix is made."""
    _, model, diff, batch = _setting(arch, torch.bfloat16)
    whole = el.linear_scores(model, diff, batch, show_progress=False)
    _sliced(monkeypatch)
    with _Formed() as spy:
        got = el.linear_scores(model, diff, batch, show_progress=False)
    assert not spy.large, spy.large[:5]
    assert got.prompt_values.dtype == torch.float32
    torch.testing.assert_close(got.prompt_values, whole.prompt_values, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got.other, whole.other, rtol=1e-5, atol=1e-6)

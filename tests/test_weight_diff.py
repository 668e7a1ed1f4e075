"""WeightDiff: exact application and restoration, arithmetic, restriction, norms, persistence."""

from __future__ import annotations

import pytest
import torch

from extractive_lens import WeightDiff
from extractive_lens.backend import parameters
from extractive_lens.types import Component
from tests.conftest import FAMILIES, make_pair


def _snapshot(model):
    return {n: p.detach().clone() for n, p in parameters(model).items()}


def _assert_bit_identical(model, snap):
    for n, p in parameters(model).items():
        assert torch.equal(p, snap[n]), n
        assert p.dtype == snap[n].dtype


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_applied_reproduces_finetuned_exactly_and_restores(family, dtype):
    base, ft = make_pair(family, dtype)
    tokens = torch.randint(0, base.cfg.d_vocab, (2, 8), generator=torch.Generator().manual_seed(0))
    snap = _snapshot(base)
    diff = WeightDiff.from_models(base, ft)
    assert all(
        d.dtype == (torch.float32 if dtype == torch.bfloat16 else torch.float64)
        for d in diff.deltas.values()
    )
    with torch.no_grad(), diff.applied(base) as m:
        assert m is base
        for n, p in parameters(base).items():
            assert torch.equal(p, parameters(ft)[n]), n
        assert torch.equal(base(tokens), ft(tokens))
    _assert_bit_identical(base, snap)
    assert not base.hook_dict["blocks.0.hook_resid_pre"].fwd_hooks


def test_restored_after_exception():
    base, ft = make_pair("ln_gelu", torch.float32)
    snap = _snapshot(base)
    diff = WeightDiff.from_models(base, ft)
    with pytest.raises(RuntimeError, match="boom"), diff.applied(base, components=["L1H0"]):
        assert not torch.equal(base.blocks[1].attn.W_Q, snap["blocks.1.attn.W_Q"])
        raise RuntimeError("boom")
    _assert_bit_identical(base, snap)


def test_component_restriction_touches_only_owned_slices():
    base, ft = make_pair("rms_gated_rotary_gqa", torch.float64)
    diff = WeightDiff.from_models(base, ft)
    snap = _snapshot(base)
    with diff.applied(base, components=["L1H3"]):
        p = parameters(base)
        assert torch.equal(p["blocks.1.attn.W_Q"][:3], snap["blocks.1.attn.W_Q"][:3])
        assert not torch.equal(p["blocks.1.attn.W_Q"][3], snap["blocks.1.attn.W_Q"][3])
        assert not torch.equal(
            p["blocks.1.attn._W_K"][1], snap["blocks.1.attn._W_K"][1]
        )  # its KV group
        assert torch.equal(p["blocks.1.attn._W_K"][0], snap["blocks.1.attn._W_K"][0])
        assert not torch.equal(p["blocks.1.ln1.w"], snap["blocks.1.ln1.w"])  # shared ln1
        assert torch.equal(p["blocks.1.mlp.W_in"], snap["blocks.1.mlp.W_in"])
        assert torch.equal(p["blocks.0.attn.W_Q"], snap["blocks.0.attn.W_Q"])
        assert torch.equal(p["embed.W_E"], snap["embed.W_E"])
    _assert_bit_identical(base, snap)
    only_mlp = diff.restricted(["L0MLP"])
    assert set(only_mlp.deltas) == {
        n for n in diff.deltas if n.startswith(("blocks.0.mlp.", "blocks.0.ln2."))
    }


def test_arithmetic_and_scale():
    base, ft = make_pair("ln_gelu", torch.float64)
    _, ft2 = make_pair("ln_gelu", torch.float64, seed=0, delta_scale=0.2)
    a = WeightDiff.from_models(base, ft)
    b = WeightDiff.from_models(base, ft2)
    s = a + b
    d = a - b
    for n in a.deltas:
        assert torch.allclose(s.deltas[n], a.deltas[n] + b.deltas[n])
        assert torch.allclose(d.deltas[n], a.deltas[n] - b.deltas[n])
        assert torch.allclose((0.5 * a).deltas[n], a.deltas[n] / 2)
        assert torch.allclose((a * 2).deltas[n], 2 * a.deltas[n])
    assert (a - a).norm() == 0.0
    with a.applied(base, scale=0.5):
        half = parameters(base)["blocks.0.attn.W_V"].clone()
    with (0.5 * a).applied(base):
        assert torch.equal(half, parameters(base)["blocks.0.attn.W_V"])


def test_norms_per_component():
    base, ft = make_pair("ln_gelu", torch.float64)
    diff = WeightDiff.from_models(base, ft)
    table = diff.norms()
    assert table.shape == (base.cfg.n_layers, base.cfg.n_heads + 1)
    assert diff.component_labels[-1] == "MLP" and list(table.columns) == list(diff.component_labels)
    assert list(table.index) == [f"L{i}" for i in range(base.cfg.n_layers)]
    norms = torch.tensor(table.to_numpy())
    # Independent: the norm of the restricted diff.
    for c in [Component(0, 2), Component(1, None)]:
        col = base.cfg.n_heads if c.head is None else c.head
        r = diff.restricted([c])
        expected = (
            sum(
                (
                    d[c.head]
                    if (
                        d.ndim
                        and n.split(".")[-1] in {"W_Q", "W_K", "W_V", "W_O", "b_Q", "b_K", "b_V"}
                    )
                    else d
                )
                .pow(2)
                .sum()
                for n, d in r.deltas.items()
            )
            ** 0.5
        )
        assert torch.isclose(norms[c.layer, col], torch.as_tensor(expected, dtype=torch.float64))
    assert diff.other_norm() > 0


def test_save_load_round_trip(tmp_path):
    base, ft = make_pair("rms_gated_rotary_gqa", torch.float32)
    diff = WeightDiff.from_models(base, ft)
    path = diff.save(tmp_path / "delta.safetensors")
    back = WeightDiff.load(path)
    assert back.signature == diff.signature
    assert back.metadata["base"] == diff.metadata["base"]
    for n in diff.deltas:
        assert torch.equal(back.deltas[n], diff.deltas[n])
    bad = tmp_path / "other.safetensors"
    from safetensors.torch import save_file

    save_file({"x": torch.zeros(1)}, str(bad))
    with pytest.raises(ValueError, match="not a WeightDiff"):
        WeightDiff.load(bad)


def test_clear_errors():
    base, ft = make_pair("ln_gelu", torch.float32)
    other, _ = make_pair("ln_gelu", torch.float32, n_layers=3)
    with pytest.raises(ValueError, match="n_layers"):
        WeightDiff.from_models(base, other)
    half, _ = make_pair("ln_gelu", torch.bfloat16)
    with pytest.raises(ValueError, match="dtype"):
        WeightDiff.from_models(base, half)
    sd_b = {n: p.detach() for n, p in parameters(base).items()}
    sd_f = {n: p.detach().clone() for n, p in parameters(ft).items()}
    sd_f["blocks.0.attn.W_Q"][0, 0, 0] = float("nan")
    with pytest.raises(ValueError, match=r"blocks\.0\.attn\.W_Q.*NaN"):
        WeightDiff.from_state_dicts(sd_b, sd_f)
    sd_f["blocks.0.attn.W_Q"] = torch.zeros(3)
    with pytest.raises(ValueError, match=r"blocks\.0\.attn\.W_Q: base shape"):
        WeightDiff.from_state_dicts(sd_b, sd_f)
    diff = WeightDiff.from_models(base, ft)
    with pytest.raises(ValueError, match="L<layer>H<head>"):
        diff.restricted(["head3"])
    with pytest.raises(ValueError, match="only 2 layers"):
        diff.restricted(["L7H0"])
    with pytest.raises(ValueError, match="n_layers"):
        with diff.applied(other):
            pass


@pytest.mark.parametrize("family", ["ln_gelu", "rms_gated_rotary_gqa"])
def test_on_demand_diff_holds_the_finetuned_weights_and_forms_the_dense_delta(family):
    """``from_models(on_demand=True)`` keeps the finetuned model's bf16 tensors (its own on a
    HookedTransformer, no copy: half the bytes of a float32 Δ) and forms each Δ when read, exactly the dense one in
    float32; scores of a float64 pair equal the dense diff's."""
    from extractive_lens import linear_scores
    from extractive_lens.backend import backend_for
    from tests.helpers import small_batch

    base, ft = make_pair(family, torch.bfloat16)
    dense = WeightDiff.from_models(base, ft)
    lazy = WeightDiff.from_models(base, ft, on_demand=True)
    assert not isinstance(lazy.deltas, dict)
    held = lazy.deltas.finetuned  # type: ignore[attr-defined]
    mine = parameters(ft)
    if backend_for(ft).NAME == "hooked_transformer":  # a bridge's view of its weights is formed
        assert all(held[n].data_ptr() == mine[n].data_ptr() for n in mine)  # no copy kept
    assert all(t.dtype == torch.bfloat16 for t in held.values())
    assert sum(t.numel() * t.element_size() for t in held.values()) * 2 == sum(
        d.numel() * d.element_size() for d in dense.deltas.values()
    )  # the finetuned weights in bf16: half the float32 Δ
    for name, d in dense.deltas.items():
        got = lazy.deltas[name]
        assert got.dtype == torch.float32
        assert torch.equal(got, d), name
    base64, ft64 = make_pair(family, torch.float64)
    batch = small_batch(base64)
    want = linear_scores(base64, WeightDiff.from_models(base64, ft64), batch, show_progress=False)
    got = linear_scores(base64, WeightDiff.from_models(base64, ft64, on_demand=True), batch,
                        show_progress=False)  # fmt: skip
    torch.testing.assert_close(got.values, want.values, rtol=0, atol=1e-12)


def test_pinned_on_demand_diff_pins_the_finetuned_tensors_not_delta(monkeypatch):
    """``pinned()`` on a diff formed on demand pins the finetuned tensors in their stored dtype
    (bf16: half a float32 Δ) and forms no Δ; each Δ is still formed when read, equal to the
    dense one. (No CUDA here: page-locking is stood in for by a copy.)"""
    from extractive_lens.backend.lazy import LazyDeltas

    base, ft = make_pair("ln_gelu", torch.bfloat16)
    dense = WeightDiff.from_models(base, ft)
    lazy = WeightDiff.from_models(base, ft, on_demand=True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    copied: list[torch.dtype] = []

    def pin(t):
        copied.append(t.dtype)
        return t.clone()

    monkeypatch.setattr(torch.Tensor, "pin_memory", pin)
    pinned = lazy.pinned()
    assert isinstance(pinned.deltas, LazyDeltas)
    assert copied and set(copied) == {torch.bfloat16}  # the stored dtype, no float32 Δ formed
    held = pinned.deltas.finetuned
    assert all(t.dtype == torch.bfloat16 for t in held.values())
    assert sum(t.numel() * t.element_size() for t in held.values()) * 2 == sum(
        d.numel() * d.element_size() for d in dense.deltas.values()
    )
    for name, d in dense.deltas.items():
        assert torch.equal(pinned.deltas[name], d), name


def test_on_demand_diff_refuses_a_finetuned_model_changed_in_place():
    """An on-demand diff reads the finetuned model's own tensors: a weight changed in place
    afterwards is refused when read (not scored as a new Δ under the old norms and fingerprint),
    naming the tensor and what to do; an untouched tensor is still read."""
    from extractive_lens import linear_scores
    from extractive_lens.backend import backend_for
    from tests.helpers import small_batch

    base, ft = make_pair("ln_gelu", torch.float64)
    if backend_for(ft).NAME != "hooked_transformer":
        pytest.skip("a TransformerBridge's TransformerLens view of its weights is formed")
    lazy = WeightDiff.from_models(base, ft, on_demand=True)
    batch = small_batch(base)
    before = linear_scores(base, lazy, batch, show_progress=False)
    with torch.no_grad():
        ft.blocks[1].attn.W_Q.add_(0.5)
    torch.testing.assert_close(lazy.deltas["blocks.0.attn.W_Q"], parameters(ft)[
        "blocks.0.attn.W_Q"].detach() - parameters(base)["blocks.0.attn.W_Q"].detach())  # fmt: skip
    with pytest.raises(ValueError, match=r"blocks\.1\.attn\.W_Q.*changed in place.*make the diff"):
        linear_scores(base, lazy, batch, show_progress=False)
    again = linear_scores(base, WeightDiff.from_models(base, ft, on_demand=True), batch,
                          show_progress=False)  # fmt: skip
    assert not torch.allclose(again.values, before.values)  # a diff made again reads the edit


def test_applied_never_rounds_the_weights_to_a_narrower_delta():
    """A float32 Δ applied to float64 weights: ``W + Δ`` is formed in float64 (a zero Δ leaves
    every weight bit-identical, also on a TransformerBridge's unstored TransformerLens views)."""
    from extractive_lens import backend as B

    model, _ = make_pair("ln_gelu", torch.float64)
    before = {n: p.detach().clone() for n, p in parameters(model).items()}
    zero = WeightDiff(
        {n: torch.zeros(p.shape, dtype=torch.float32) for n, p in before.items()},
        dict(B.signature(model)),
        {},
    )
    with zero.applied(model):
        for n, p in parameters(model).items():
            assert torch.equal(p, before[n]), n

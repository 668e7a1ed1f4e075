"""bf16 storage, float32 compute: scores of a bf16 pair against float64 twins holding the same
bf16 weights, at a finetune-sized update (Δ/|W| = 1e-3), Llama-like (RMS, gated, rotary, GQA)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from extractive_lens import WeightDiff, causal_scores, linear_scores, make_batch, tiny_model

LLAMA_LIKE = dict(
    normalization_type="RMS",
    act_fn="silu",
    gated_mlp=True,
    positional_embedding_type="rotary",
    rotary_dim=8,
    rotary_adjacent_pairs=True,  # what TransformerLens 4's native bridge computes
    n_key_value_heads=2,
    final_rms=True,
    n_layers=3,
    d_model=64,
    n_heads=4,
    d_head=16,
    d_mlp=128,
    d_vocab=97,
)


def _twins(dtype):
    """A bf16 (base, finetuned) pair and float64 copies holding exactly the same values."""
    base = tiny_model(dict(LLAMA_LIKE, dtype=torch.bfloat16), seed=0)
    ft = tiny_model(dict(LLAMA_LIKE, dtype=torch.bfloat16), seed=0)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in ft.parameters():
            d = torch.randn(p.shape, generator=g, dtype=torch.float64)
            p.copy_((p.double() + 1e-3 * p.double().norm() * d / d.norm()).to(p.dtype))
    twins = []
    for m in (base, ft):
        t = tiny_model(dict(LLAMA_LIKE, dtype=dtype), seed=0)
        with torch.no_grad():
            for q, p in zip(t.parameters(), m.parameters()):
                q.copy_(p.to(dtype))
        twins.append(t)
    return base, ft, *twins


@pytest.fixture(scope="module")
def scored():
    base, ft, b64, f64 = _twins(torch.float64)
    g = torch.Generator().manual_seed(1)
    pairs = [
        (
            torch.randint(3, 97, (6,), generator=g).tolist(),
            [int(torch.randint(3, 97, (1,), generator=g))],
        )
        for _ in range(6)
    ]

    def run(m, f, **kw):
        diff, batch = WeightDiff.from_models(m, f), make_batch(m, pairs)
        return linear_scores(m, diff, batch, **kw), causal_scores(
            m, diff, batch, show_progress=False, **kw
        )

    before = [p.detach().clone() for p in base.parameters()]
    out = dict(
        ref=run(b64, f64), bf16=run(base, ft), bf16_compute=run(base, ft, compute_dtype="bfloat16")
    )
    assert all(torch.equal(a, p) for a, p in zip(before, base.parameters()))  # storage untouched
    assert base.cfg.dtype == torch.bfloat16
    return out


def _agreement(got, ref):
    r, ratio = [], []
    for k in range(len(got.kinds)):
        x, y = (
            got.prompt_values[k].flatten().double().numpy(),
            ref.prompt_values[k].flatten().double().numpy(),
        )
        r.append(float(np.corrcoef(x, y)[0, 1]))
        ratio.append(float(got.prompt_totals[k].sum() / ref.prompt_totals[k].sum()))
    return r, ratio


@pytest.mark.parametrize("method", [0, 1], ids=["linear", "exact"])
def test_bf16_scored_in_float32_matches_float64_twins(scored, method):
    got, ref = scored["bf16"][method], scored["ref"][method]
    assert (
        got.metadata["compute_dtype"] == "torch.float32"
        and got.metadata["dtype"] == "torch.bfloat16"
    )
    r, ratio = _agreement(got, ref)
    assert min(r) >= 0.99, r
    assert all(abs(x - 1) <= 0.05 for x in ratio), ratio


@pytest.mark.parametrize("method", [0, 1], ids=["linear", "exact"])
def test_negative_control_bf16_compute_is_noise(scored, method):
    """Computing in bf16 (what scoring did before compute_dtype) fails the same bar."""
    r, ratio = _agreement(scored["bf16_compute"][method], scored["ref"][method])
    assert min(r) < 0.9 and max(abs(x - 1) for x in ratio) > 0.05, (r, ratio)


def test_compute_dtype_is_validated():
    m = tiny_model({"dtype": torch.bfloat16})
    with pytest.raises(ValueError, match="compute_dtype must be one of"):
        from extractive_lens.model import resolve_compute_dtype

        resolve_compute_dtype(m, "float31")


def _bridge_twins(dtype):
    """The world model as a 16-bit ``TransformerBridge`` with a finetune-sized update, and
    float64 bridges holding exactly the same values."""
    from extractive_lens.backend import parameters, write_parameters
    from extractive_lens.backend.building import write_native  # b_U too, buffer or weight
    from extractive_lens.world import load_world_model

    base = load_world_model(backend="bridge", dtype=dtype)
    ft = load_world_model(backend="bridge", dtype=dtype)
    g = torch.Generator().manual_seed(3)
    values = {}
    for n, p in parameters(ft).items():
        if n == "unembed.b_U":  # a fixed buffer in TransformerLens 4's native bridge
            continue
        d = torch.randn(p.shape, generator=g, dtype=torch.float64)
        values[n] = (p.double() + 3e-3 * p.double().norm() * d / d.norm()).to(dtype)
    write_parameters(ft, values)
    twins = []
    for m in (base, ft):
        t = load_world_model(backend="bridge", dtype=torch.float64)
        write_native(t, {n: p.double() for n, p in parameters(m).items()})
        twins.append(t)
    return base, ft, *twins


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_16bit_bridge_scored_in_float32_matches_float64_twin(dtype):
    """A 16-bit bridge (the bundled world model, native bridge) with a diff restricted to one
    layer, scored in float32 (the default), matches its float64 twin; its weights stay stored
    in 16 bits, untouched. Computing in the 16-bit dtype is the negative control."""
    from extractive_lens.world import first_hop

    base, ft, b64, f64 = _bridge_twins(dtype)
    before = [(p.dtype, p.detach().clone()) for p in base.parameters()]
    _, impl = first_hop().batches(base)
    batch = impl.subset(range(8))

    def run(m, f, **kw):
        diff = WeightDiff.from_models(m, f).restricted(layers=[1])
        lin = linear_scores(m, diff, batch, kinds=("informative", "downstream"), **kw)
        ex = causal_scores(m, diff, batch, kinds=("informative",), layers=[1], **kw)
        return lin, ex

    ref, got, low = run(b64, f64), run(base, ft), run(base, ft, compute_dtype=dtype)
    assert all(p.dtype == d and torch.equal(p, v) for (d, v), p in zip(before, base.parameters()))
    assert got[0].metadata["compute_dtype"] == "torch.float32"
    for i in range(2):
        keep = ~ref[i].prompt_values.isnan()
        x, y, z = (s[i].prompt_values[keep].double().numpy() for s in (got, ref, low))
        assert np.corrcoef(x, y)[0, 1] >= 0.99
        assert abs(x.sum() / y.sum() - 1) < 0.05
        assert np.corrcoef(z, y)[0, 1] < np.corrcoef(x, y)[0, 1]

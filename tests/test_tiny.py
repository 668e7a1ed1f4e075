"""``tiny_model`` as a ``TransformerBridge``: every block variant TransformerLens's native bridge
computes is built with the ``HookedTransformer``'s weights; the others are refused in one
sentence that says what to use instead."""

from __future__ import annotations

import pytest
import torch

from extractive_lens import backend as B
from extractive_lens import tiny_model
from extractive_lens.backend.installed import has_hooked
from tests.conftest import FAMILIES

ROTARY = dict(positional_embedding_type="rotary", rotary_dim=8, rotary_adjacent_pairs=True)
BUILT = {
    "rms": dict(normalization_type="RMS", final_rms=True),
    "gated": dict(gated_mlp=True, act_fn="silu"),
    "rotary": ROTARY,
    "rms_gated_rotary_gqa": dict(FAMILIES["rms_gated_rotary_gqa"], rotary_adjacent_pairs=True),
}


@pytest.mark.parametrize("variant", list(BUILT))
def test_tiny_bridge_has_the_hooked_weights(variant):
    cfg = dict(BUILT[variant], dtype=torch.float32)
    bridge = tiny_model(cfg, seed=3, backend="bridge")
    tokens = torch.arange(10)[None] % bridge.cfg.d_vocab
    with torch.no_grad():
        logits = bridge(tokens)
    assert torch.isfinite(logits).all() and logits.std() > 0.1
    if not has_hooked():
        return
    hooked = tiny_model(cfg, seed=3, backend="hooked")
    ours, want = B.parameters(bridge), B.parameters(hooked)
    differ = {n for n in want if not torch.equal(ours[n], want[n])}
    # only the gated MLP's biases, which the native bridge does not have: they stay zero
    assert differ == (
        {f"blocks.{l}.mlp.{b}" for l in range(2) for b in ("b_in", "b_out")}
        if cfg.get("gated_mlp")
        else set()
    )
    assert all((ours[n] == 0).all() for n in differ)
    with torch.no_grad():
        for n in differ:
            dict(hooked.named_parameters())[n].zero_()
        assert (hooked(tokens) - logits).abs().max() < 1e-4 * logits.abs().max()


REFUSED = {
    "parallel": (FAMILIES["parallel_rotary"] | ROTARY, "no parallel attention/MLP blocks: use"),
    "rotary_halves": (
        dict(ROTARY, rotary_adjacent_pairs=False),
        "rotates adjacent pairs.*pass rotary_adjacent_pairs=True",
    ),
}


@pytest.mark.parametrize("variant", list(REFUSED))
def test_tiny_bridge_refuses_what_the_native_bridge_does_not_compute(variant):
    cfg, says = REFUSED[variant]
    with pytest.raises(NotImplementedError, match=f"{says}.*backend='hooked'") as e:
        tiny_model(cfg, backend="bridge")
    assert str(e.value).count(". ") == 0  # one sentence


@pytest.mark.skipif(not has_hooked(), reason="TransformerLens 3.9's native bridge")
@pytest.mark.parametrize("variant", ["rms", "rotary"])
def test_float64_rms_or_rotary_bridge_is_refused_on_transformer_lens_3(variant):
    with pytest.raises(NotImplementedError, match="dtype=torch.float32, use backend='hooked'"):
        tiny_model(dict(BUILT[variant], dtype=torch.float64), backend="bridge")
    tiny_model(dict(BUILT[variant], dtype=torch.float32), backend="bridge")  # what it says works

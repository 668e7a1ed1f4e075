"""Gemma-2-style logit soft-capping (``output_logits_soft_cap``, ``attn_scores_soft_cap``), in
both backends, against the model's own forward pass (no scoring code in the reference).

Gemma-2-9B is one of the paper's models; its logits pass through ``cap * tanh(logits / cap)``.
The scoring engines run the model in pieces, so a piece that forgot the cap would score another
function than the model computes. The references here run ``model(tokens)`` only: a weight swap
per component (exact informative) and a central difference along Δ (the linear total).
"""

from __future__ import annotations

import pytest
import torch

from extractive_lens import WeightDiff, causal_scores, linear_scores, make_batch, tiny_model
from extractive_lens.backend import parameters
from extractive_lens.backend.installed import has_hooked
from extractive_lens.rewards import answer_logprob

CAPPED = dict(n_layers=2, output_logits_soft_cap=1.5, attn_scores_soft_cap=2.0, dtype=torch.float64)
BACKENDS = (["hooked"] if has_hooked() else []) + ["bridge"]


def _pair(backend: str):
    base = tiny_model(CAPPED, seed=3, backend=backend, init_scale=3.0)
    ft = tiny_model(CAPPED, seed=3, backend=backend, init_scale=3.0)
    gen = torch.Generator().manual_seed(4)
    values = {
        n: p + 0.05 * torch.randn(p.shape, generator=gen, dtype=p.dtype)
        for n, p in parameters(ft).items()
        if n != "unembed.b_U"  # a fixed buffer in TransformerLens 4's native bridge
    }
    diff = WeightDiff.from_state_dicts(
        {n: p.detach() for n, p in parameters(base).items() if n in values}, values,
        signature=WeightDiff.zeros_like(base).signature,
    )  # fmt: skip
    batch = make_batch(base, [([1, 5, 6, 9], [7]), ([1, 8, 9, 10], [11]), ([2, 5, 9, 3], [12])])
    return base, diff, batch


def _reward(model, batch) -> torch.Tensor:
    with torch.no_grad():
        return answer_logprob(model(batch.tokens), batch)


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_cap_matters_here(backend):
    """The cap is active: the capped logits differ from the uncapped ones by far more than the
    tolerances below (else the tests could not see a dropped cap)."""
    base, _, batch = _pair(backend)
    with torch.no_grad():
        logits = base(batch.tokens)
    assert logits.abs().max() < 1.5 and logits.abs().max() > 1.0  # saturating: |logit| → 1.5
    uncapped = tiny_model({**CAPPED, "output_logits_soft_cap": -1.0}, seed=3, backend=backend,
                          init_scale=3.0)  # fmt: skip
    with torch.no_grad():
        assert (uncapped(batch.tokens) - logits).abs().max() > 0.5


@pytest.mark.parametrize("backend", BACKENDS)
def test_exact_informative_is_the_capped_models_weight_swap(backend):
    """Swapping one component's weights in changes R by its exact informative total (with no
    change to ``ln1``, which every head of a layer reads: then a head owns all it changes)."""
    base, diff, batch = _pair(backend)
    diff = WeightDiff({n: d for n, d in diff.deltas.items() if ".ln1." not in n}, diff.signature)
    exact = causal_scores(base, diff, batch, kinds=("informative",), per="component")
    r0 = _reward(base, batch)
    for label in ("L0H1", "L1H3", "L0MLP", "L1MLP"):
        with diff.applied(base, components=[label]):
            want = float((_reward(base, batch) - r0).mean())
        got = dict((lab, v) for _, lab, v in exact.top(100))[label]
        assert got == pytest.approx(want, abs=1e-10), label


@pytest.mark.parametrize("backend", BACKENDS)
def test_linear_total_is_the_capped_models_derivative(backend):
    base, diff, batch = _pair(backend)
    lin = linear_scores(base, diff, batch, kinds=("informative",))
    total = float((lin.prompt_totals[0].sum((1, 2)) + lin.other).mean())
    eps = 1e-5
    with diff.applied(base, scale=eps):
        up = _reward(base, batch)
    with diff.applied(base, scale=-eps):
        down = _reward(base, batch)
    assert total == pytest.approx(float(((up - down) / (2 * eps)).mean()), rel=1e-6, abs=1e-9)

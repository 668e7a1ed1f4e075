"""Scores on a CUDA device equal the CPU's (run on a machine with a GPU; CI has none).

    python scripts/check_cuda.py            # exit status 1 on any mismatch
    python scripts/check_cuda.py --dry-run  # without a GPU: the script itself, CPU against CPU

For each architecture family (tiny float64 models, as the tests build them) every public
scoring call runs on the CPU and on ``cuda``, twice on the GPU: as a small model is scored
(``W + αΔ`` formed once per call, whole-model gradients) and in the regime of a large one
(``shift.REUSE_BYTES`` and ``runs.LAYERWISE_BYTES`` forced below the model's size: Δ held on
the host in pinned memory and moved one layer at a time with the next layer prefetched on a side
stream, gradients one layer at a time). The largest difference relative to the scores' scale
must be under 1e-9 (float64; the GPU's reductions run in another order).
"""

from __future__ import annotations

import contextlib
import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

FAMILIES = {
    "ln_gelu": dict(normalization_type="LN", act_fn="gelu", positional_embedding_type="standard"),
    "rms_gated_rotary_gqa": dict(
        normalization_type="RMS", act_fn="silu", gated_mlp=True,
        positional_embedding_type="rotary", rotary_dim=8, n_key_value_heads=2, final_rms=True,
    ),
    "parallel_rotary": dict(
        normalization_type="LN", act_fn="gelu", parallel_attn_mlp=True,
        positional_embedding_type="rotary", rotary_dim=4,
    ),
}  # fmt: skip
TOLERANCE = 1e-9


def pair(family: str, device: str):
    from extractive_lens import WeightDiff, make_batch, tiny_model

    cfg = dict(FAMILIES[family], dtype=torch.float64)
    base = tiny_model(cfg, seed=0, device=device)
    ft = tiny_model(cfg, seed=0, device=device)
    gen = torch.Generator().manual_seed(99)
    with torch.no_grad():
        for p in ft.parameters():
            p.add_((0.05 * torch.randn(p.shape, generator=gen, dtype=torch.float64)).to(p.device))
    g = torch.Generator().manual_seed(7)
    V = base.cfg.d_vocab
    pairs = [(torch.randint(0, V, (8,), generator=g).tolist(), [int(torch.randint(0, V, (1,), generator=g))])
             for _ in range(4)]  # fmt: skip
    batch = make_batch(base, pairs, candidates=sorted({a[0] for _, a in pairs}), device=device)
    return base, WeightDiff.from_models(base, ft), batch


CALLS = {
    "linear": lambda el, m, d, b: el.linear_scores(m, d, b, show_progress=False),
    "linear authors_code": lambda el, m, d, b: el.linear_scores(
        m, d, b, convention="authors_code", show_progress=False
    ),
    "exact per token": lambda el, m, d, b: el.causal_scores(m, d, b, show_progress=False),
    "exact per component": lambda el, m, d, b: el.causal_scores(
        m, d, b, per="component", show_progress=False
    ),
    "integrated": lambda el, m, d, b: el.integrated_scores(m, d, b, show_progress=False),
    "integrated layer path": lambda el, m, d, b: el.integrated_scores(
        m, d, b, path="layer", steps=2, show_progress=False
    ),
}


@contextlib.contextmanager
def large_model_regime():
    import extractive_lens.backend.shift as shift
    import extractive_lens.scoring.runs as runs

    saved = shift.REUSE_BYTES, runs.LAYERWISE_BYTES
    shift.REUSE_BYTES, runs.LAYERWISE_BYTES = -1, -1
    try:
        yield
    finally:
        shift.REUSE_BYTES, runs.LAYERWISE_BYTES = saved


def gap(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().cpu().double(), b.detach().cpu().double()
    if not torch.equal(a.isnan(), b.isnan()):
        return float("inf")
    keep = ~a.isnan()
    scale = max(float(a[keep].abs().max()), 1e-12) if keep.any() else 1.0
    return float((a[keep] - b[keep]).abs().max()) / scale if keep.any() else 0.0


def main() -> int:
    import extractive_lens as el

    device = "cuda"
    if not torch.cuda.is_available():
        if "--dry-run" not in sys.argv:
            print("no CUDA device: nothing to check (--dry-run: the CPU against itself)")
            return 0
        device = "cpu"
    warnings.filterwarnings("ignore")
    worst = 0.0
    print(f"{'family':22s} {'call':22s} {'small':>10s} {'large regime':>13s}")
    for family in FAMILIES:
        cpu = pair(family, "cpu")
        gpu = pair(family, device)
        host_diff = cpu[1].pinned()  # Δ on the host, as a large model's scoring holds it
        for name, call in CALLS.items():
            want = call(el, *cpu)
            got = call(el, *gpu)
            with large_model_regime():
                got_large = call(el, gpu[0], host_diff, gpu[2])
            gaps = [gap(want.values, got.values), gap(want.values, got_large.values)]
            worst = max(worst, *gaps)
            print(f"{family:22s} {name:22s} {gaps[0]:10.1e} {gaps[1]:13.1e}", flush=True)
    print(f"largest relative difference {worst:.1e} (tolerance {TOLERANCE:.0e})")
    return 0 if worst < TOLERANCE else 1


if __name__ == "__main__":
    raise SystemExit(main())

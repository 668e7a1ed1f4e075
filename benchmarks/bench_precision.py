"""bf16 storage with float32 compute against a float32 model: time and peak memory of scoring.

    python benchmarks/bench_precision.py [--shapes llama-cpu] [--repeats 3] [--device cpu]

The same Llama-shaped model (RMS norm, gated SiLU MLP, rotary, grouped-query attention) is held
either in float32 or in bfloat16; both are scored in float32 (the default for bf16 models:
each layer is upcast while it runs, no second copy). Per configuration, in a fresh process:
the weights' bytes, resident memory after loading model + Δ (float32) + batch, the peak above it
during ``linear_scores`` (all kinds) or ``causal_scores`` (per token, first and last layer), each
in its own process, and median times.
``llama3-8b`` is Llama-3-8B's shape with random weights and needs a GPU (``--device cuda``;
memory then from ``torch.cuda.max_memory_allocated``).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import PeakMemory, random_batch, rss_mb, table, timeit, write  # noqa: E402

LLAMA = dict(
    normalization_type="RMS",
    act_fn="silu",
    gated_mlp=True,
    positional_embedding_type="rotary",
    final_rms=True,
    n_ctx=64,
)
SHAPES = {
    # Llama proportions reduced to fit a 2-core CPU
    "llama-cpu": dict(
        LLAMA,
        n_layers=8,
        d_model=512,
        n_heads=8,
        d_head=64,
        n_key_value_heads=2,
        d_mlp=1376,
        d_vocab=8000,
        rotary_dim=64,
    ),
    # Llama-3-8B's shape (random weights): GPU only
    "llama3-8b": dict(
        LLAMA,
        n_layers=32,
        d_model=4096,
        n_heads=32,
        d_head=128,
        n_key_value_heads=8,
        d_mlp=14336,
        d_vocab=128256,
        rotary_dim=128,
        rotary_base=500000.0,
    ),
}


def build(shape: str, dtype: torch.dtype, device: str):
    """A model of ``shape`` stored in ``dtype`` and a finetune-sized random Δ (|Δ|/|W| = 1e-3)."""
    from extractive_lens import WeightDiff, tiny_model

    base = tiny_model(dict(SHAPES[shape], dtype=dtype), seed=0, device=device)
    g = torch.Generator().manual_seed(1)
    deltas = {}
    for name, p in base.named_parameters():
        d = torch.randn(p.shape, generator=g).to(device)
        deltas[name] = (1e-3 * p.float().norm() / d.norm()) * d
    from extractive_lens.model import signature

    return base, WeightDiff(deltas, signature(base))


def probe(shape: str, dtype_name: str, job_name: str, device: str, repeats: int) -> dict:
    import gc
    import warnings

    from extractive_lens import causal_scores, linear_scores

    warnings.simplefilter("ignore")
    dtype = getattr(torch, dtype_name)
    base, diff = build(shape, dtype, device)
    batch = random_batch(base, batch=8, pos=16).to(device)
    L = base.cfg.n_layers
    gc.collect()
    cuda = device.startswith("cuda")
    resident = torch.cuda.memory_allocated() / 2**20 if cuda else rss_mb()
    weights = sum(p.numel() * p.element_size() for p in base.parameters()) / 2**20
    out = dict(
        shape=shape, storage=dtype_name, compute="float32", weights_mb=weights, resident_mb=resident
    )
    jobs = {
        "linear": lambda: linear_scores(
            base, diff, batch, batch_size=None, show_progress=False, compute_dtype=torch.float32
        ),
        "exact": lambda: causal_scores(
            base,
            diff,
            batch,
            layers=[0, L - 1],
            batch_size=None,
            show_progress=False,
            compute_dtype=torch.float32,
        ),
    }
    for name, job in jobs.items():
        if name != job_name:
            continue
        if cuda:
            torch.cuda.reset_peak_memory_stats()
            job()
            out[f"{name}_extra_mb"] = torch.cuda.max_memory_allocated() / 2**20 - resident
        else:
            with PeakMemory() as mem:
                job()
            out[f"{name}_extra_mb"] = mem.extra_mb
        out[f"{name}_s"] = timeit(job, repeats=repeats, warmup=0)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="+", default=["llama-cpu"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--probe", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.probe:
        print(json.dumps(probe(*args.probe, args.device, args.repeats)))
        return
    rows = []
    for shape in args.shapes:
        pair = {}
        for dtype in ("float32", "bfloat16"):
            pair[dtype] = {}
            for job in ("linear", "exact"):  # one fresh process per measurement
                cmd = [
                    sys.executable,
                    __file__,
                    "--probe",
                    shape,
                    dtype,
                    job,
                    "--device",
                    args.device,
                    "--repeats",
                    str(args.repeats),
                ]
                res = subprocess.run(cmd, capture_output=True, text=True, check=True)
                pair[dtype].update(json.loads(res.stdout.strip().splitlines()[-1]))
            rows.append(pair[dtype])
            print(table([pair[dtype]], list(pair[dtype])), flush=True)
        f32, b16 = pair["float32"], pair["bfloat16"]
        for what in ("linear", "exact"):
            rows.append(
                dict(
                    shape=shape,
                    storage="bf16 ÷ float32",
                    compute=what,
                    time_ratio=b16[f"{what}_s"] / f32[f"{what}_s"],
                    peak_ratio=(b16["resident_mb"] + b16[f"{what}_extra_mb"])
                    / (f32["resident_mb"] + f32[f"{what}_extra_mb"]),
                )
            )
    print()
    cols = [
        "shape",
        "storage",
        "compute",
        "weights_mb",
        "resident_mb",
        "linear_s",
        "linear_extra_mb",
        "exact_s",
        "exact_extra_mb",
        "time_ratio",
        "peak_ratio",
    ]
    print(table(rows, cols))
    print("wrote", write("bench_precision", {"rows": rows}))


if __name__ == "__main__":
    main()

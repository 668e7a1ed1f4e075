"""A LoRA adapter scored as its factors against the same adapter made dense (issue 40).

    python benchmarks/bench_lora.py                     # depths 1 and 2, every method
    python benchmarks/bench_lora.py --depths 1 --calls linear
    python benchmarks/bench_lora.py --backend bridge    # the same on a TransformerBridge
    python benchmarks/bench_lora.py --case linear,low_rank,1 >> rows.jsonl   # one case
    python benchmarks/bench_lora.py --rows rows.jsonl   # the table and summary of such rows

Model: Llama-3-8B's layer shape (``bench_memory.LLAMA3_8B``: d_model 4096, 32 heads of 128 with
8 key/value heads, gated MLP of 14336) at reduced depth, weights in bf16, scores in float32; a
small vocabulary (``--vocab``, default 2048: the adapter touches the layers only, and the
unembedding would otherwise dominate the memory). The adapter: rank 16 on every projection
(``q k v o gate up down``), random factors laid out as ``WeightDiff.from_peft`` lays them out
(``backend.lowrank.LowRank``); "dense" is the same adapter made dense (``Δ = B @ A`` per
tensor, float32, held where the factors are).

Per (call, variant, depth), in a fresh subprocess: Δ bytes (the factors, or the dense tensors),
peak extra memory above the level after the model, Δ and batch were built (resident memory on
CPU; ``torch.cuda.max_memory_allocated`` on a GPU), and time. Targets: the factors ≤ 1% of the
dense Δ; the low-rank linear time ≤ the dense time; the memory growth per layer of the low-rank
runs ≤ 0.05 GiB (the slope over the depths).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.bench_memory import LLAMA3_8B, GiB  # noqa: E402
from benchmarks.common import PeakMemory, table, write  # noqa: E402

CALLS = ("linear", "exact_token_top_k", "exact_component", "integrated")
TARGETS = ("attn.W_Q", "attn._W_K", "attn._W_V", "attn.W_O", "mlp.W_gate", "mlp.W_in", "mlp.W_out")
COLS = ["call", "variant", "depth", "delta_mib", "extra_gib", "seconds"]


def adapter(model, rank: int, seed: int = 1):
    """A rank-``rank`` change of every projection, as ``from_peft`` keeps it."""
    from extractive_lens import WeightDiff
    from extractive_lens import backend as B
    from extractive_lens.backend.lowrank import LowRank, LowRankDeltas

    g = torch.Generator().manual_seed(seed)
    cfg, params = model.cfg, B.parameters(model)
    factors = {}
    for layer in range(cfg.n_layers):
        for leaf in TARGETS:
            name = f"blocks.{layer}.{leaf}"
            shape = params[name].shape
            if leaf == "attn.W_O":  # [head d_head d_model]: in = head·d_head
                d_in, d_out, layout, h = shape[0] * shape[1], shape[2], "heads_in", shape[0]
            elif leaf.startswith("attn."):  # [head d_model d_head]: out = head·d_head
                d_in, d_out, layout, h = shape[1], shape[0] * shape[2], "heads_out", shape[0]
            else:
                (d_in, d_out), layout, h = shape, "plain", 1
            left = torch.randn(d_in, rank, generator=g) / d_in**0.5 * (32 / rank)  # α/r · Aᵀ
            right = 1e-3 * torch.randn(rank, d_out, generator=g)  # Bᵀ, a few steps in
            factors[name] = LowRank(left, right, layout, h)
    return WeightDiff(LowRankDeltas(factors, {}), B.signature(model))


def case(call: str, variant: str, depth: int, vocab: int, rank: int, device: str,
         backend: str = "hooked") -> dict:  # fmt: skip
    import ctypes
    import gc
    import time
    import warnings

    import extractive_lens as el
    from benchmarks.bench_memory import PROMPTS, TOKENS, random_prompts
    from extractive_lens import tiny_model

    warnings.filterwarnings("ignore")
    cfg = dict(LLAMA3_8B, n_layers=depth, d_vocab=vocab, dtype=torch.bfloat16, device=device)
    if backend == "bridge":  # a Hugging Face Llama of that shape in a TransformerBridge
        import transformers

        torch.manual_seed(0)
        hf = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(
            vocab_size=vocab, hidden_size=cfg["d_model"], num_hidden_layers=depth,
            num_attention_heads=cfg["n_heads"], num_key_value_heads=cfg["n_key_value_heads"],
            intermediate_size=cfg["d_mlp"], max_position_embeddings=cfg["n_ctx"],
        ), dtype=torch.bfloat16).to(device)  # fmt: skip
        model = el.from_hf(hf, backend="bridge")
    else:
        model = tiny_model(cfg, seed=0).to(device)
    diff = adapter(model, rank).to(device)
    if variant == "dense":
        diff = el.WeightDiff({n: diff.deltas[n] for n in diff.deltas}, diff.signature)
        delta = sum(t.numel() * t.element_size() for t in diff.deltas.values())
    else:
        delta = diff.deltas.nbytes()
    batch = random_prompts(model, vocab, torch.Generator().manual_seed(2), device=device)
    lin = None
    if call in ("exact_token_top_k", "integrated"):  # the linear ranking is an input here
        lin = el.linear_scores(
            model, diff, batch, kinds=("informative", "downstream"), show_progress=False
        )
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    with PeakMemory() as mem:
        if call == "linear":
            el.linear_scores(model, diff, batch, show_progress=False)
        elif call == "exact_token_top_k":
            el.causal_scores(model, diff, batch, kinds=("informative", "downstream"), top_k=3,
                             linear=lin, show_progress=False)  # fmt: skip
        elif call == "exact_component":
            el.causal_scores(model, diff, batch, kinds=("informative", "downstream"),
                             per="component", layers=[0], show_progress=False)  # fmt: skip
        elif call == "integrated":
            el.integrated_scores(model, diff, batch, kinds=("informative", "downstream"),
                                 top_k=3, linear=lin, show_progress=False)  # fmt: skip
        if cuda:
            torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    extra = (torch.cuda.max_memory_allocated() - start) / GiB if cuda else mem.extra_mb / 1024
    return {"call": call, "variant": variant, "depth": depth, "vocab": vocab, "rank": rank,
            "device": device, "backend": backend, "batch": f"{PROMPTS}x{TOKENS}",
            "delta_mib": delta / 2**20, "extra_gib": extra, "seconds": seconds}  # fmt: skip


def slope(rows: list[dict], call: str, variant: str) -> float | None:
    pts = [
        (r["depth"], r["extra_gib"]) for r in rows if r["call"] == call and r["variant"] == variant
    ]
    if len({d for d, _ in pts}) < 2:
        return None
    n = len(pts)
    mx, my = sum(d for d, _ in pts) / n, sum(e for _, e in pts) / n
    return sum((d - mx) * (e - my) for d, e in pts) / sum((d - mx) ** 2 for d, _ in pts)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--depths", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--calls", nargs="+", default=list(CALLS), choices=CALLS)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--backend", default="hooked", choices=("hooked", "bridge"))
    ap.add_argument("--case", help="call,variant,depth: one measurement, its row as JSON")
    ap.add_argument("--rows", help="a file of --case rows (JSON lines): summarize those")
    a = ap.parse_args()
    if a.case:  # one measurement, in this (fresh) process
        call, variant, depth = a.case.split(",")
        row = case(call, variant, int(depth), a.vocab, a.rank, a.device, a.backend)
        print(json.dumps(row))
        return
    rows = []
    if a.rows:
        rows = [json.loads(line) for line in Path(a.rows).read_text().splitlines() if line]
        a.calls = [c for c in CALLS if any(r["call"] == c for r in rows)]
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    for depth in [] if a.rows else a.depths:
        for call in a.calls:
            for variant in ("low_rank", "dense"):
                out = subprocess.run(
                    [sys.executable, __file__, "--case", f"{call},{variant},{depth}",
                     "--vocab", str(a.vocab), "--rank", str(a.rank), "--device", a.device,
                     "--backend", a.backend],
                    capture_output=True, text=True, env=env, check=True,
                )  # fmt: skip
                rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
                print(table(rows[-1:], COLS), flush=True)
    summary = {}
    for call in a.calls:
        by = {(r["variant"], r["depth"]): r for r in rows if r["call"] == call}
        depths = sorted(d for v, d in by if v == "low_rank" and ("dense", d) in by)
        lr, dn = [by["low_rank", d] for d in depths], [by["dense", d] for d in depths]
        if not depths:
            continue
        summary[call] = {
            "depths": depths,
            "delta_fraction": max(x["delta_mib"] / y["delta_mib"] for x, y in zip(lr, dn)),
            "time_ratio": [x["seconds"] / y["seconds"] for x, y in zip(lr, dn)],
            "extra_ratio": [x["extra_gib"] / max(y["extra_gib"], 1e-9) for x, y in zip(lr, dn)],
            "slope_gib_per_layer_low_rank": slope(rows, call, "low_rank"),
            "slope_gib_per_layer_dense": slope(rows, call, "dense"),
        }
    print(table(rows, COLS))
    print(json.dumps(summary, indent=1))
    print(write("bench_lora", {"rows": rows, "summary": summary}))


if __name__ == "__main__":
    main()

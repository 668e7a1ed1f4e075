"""Peak memory of scoring at Llama-3-8B width, and its growth per layer (issue 29).

    python benchmarks/bench_memory.py                      # depths 1, 2, 4 and the real vocabulary
    python benchmarks/bench_memory.py --depths 1 2 --calls linear

Model: Llama-3-8B's layer shape (d_model 4096, 32 heads of 128 with 8 key/value heads, gated
SiLU MLP of 14336, RMS norms, rotary) at reduced depth, weights stored in bf16, scores computed
in float32, on 8 prompts x 32 tokens; vocabulary 32000, and Llama 3's 128256 at depth 1. Δ is a
random float32 update held on the host.

Calls: ``linear`` (every kind); ``exact_token_top_k`` (informative and downstream per token,
the linear top 3 per kind); ``exact_component`` (every component of layer 0, per component: its passes run through
every later layer, so the growth with depth is theirs); ``integrated`` (every kind at the
default steps, per token, the paths of the linear top 3 per kind; informative along
``W + αΔ`` for every component). ``--layerwise 1`` measures gradients taken one
layer at a time whatever the size (what a 32-layer model gets: ``runs.LAYERWISE_BYTES``).

Each (call, depth) runs in a fresh subprocess (large allocations returned to the system at once:
``MALLOC_MMAP_THRESHOLD_``), and the figure is the peak resident memory above the level after
the model, Δ and the batch were built, sampled every millisecond. The slope is the least-squares
growth per layer over the depths: the extra memory of a 32-layer model is about
``at depth 1 + 31 x slope``. Target (issue 41): slope <= 0.05 GiB per layer for every call and
batch. The growth between the two deepest depths is printed beside it: a depth-1 model's passes
from its first layer's heads run only that layer's MLP, a deeper one's whole layers, a step
that the slope over depths 1 / 2 / 4 counts as growth.

The grid issue 41 asks for, one case at a time on a shared machine, resumable::

    python benchmarks/bench_memory.py --batches 1x16 2x16 8x32 1x256 --no-real-vocab \
        --results grid.jsonl --lock /path/to/heavy.lock
    python benchmarks/bench_memory.py --batches 1x16 2x16 8x32 1x256 --no-real-vocab \
        --results grid.jsonl --summary                   # the table and slopes so far

``--device cuda``: the model is built on the GPU at the given depths (``--depths 32``: Llama-3-8B
itself, random weights, 16 GB in bf16) with Δ in pinned host memory (``diff.pinned()``, as the
README advises for a GPU the size of the model), and the figure is the peak GPU memory
allocated above the model and the batch (``torch.cuda.max_memory_allocated``), with each call's
time. All calls run in one process (the peak counter is reset between them).

``--backend bridge``: the same shape as a Hugging Face Llama (untied ``lm_head``) in a
``TransformerBridge`` (CPU cases; TransformerLens 4, or 3.9's bridge).

``--checkpoints`` also measures ``WeightDiff.from_checkpoints`` on two saved checkpoints of this
shape (depth 2): peak host memory while every Δ tensor is formed once, layer by layer, against
the size of one model and of its largest tensor: all resident pages, and without the
file-backed ones (the memory-mapped checkpoint files, which the kernel drops under pressure).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import PeakMemory, table, write  # noqa: E402

GiB = 2**30
LLAMA3_8B = dict(
    d_model=4096, n_heads=32, d_head=128, n_key_value_heads=8, d_mlp=14336, n_ctx=64,
    normalization_type="RMS", act_fn="silu", gated_mlp=True, positional_embedding_type="rotary",
    rotary_dim=128, final_rms=True,
)  # fmt: skip
CALLS = ("linear", "exact_token_top_k", "exact_component", "integrated")
_BATCH = os.environ.get("BENCH_BATCH", "8x32")  # prompts x tokens; --batches sets it per case
PROMPTS, TOKENS = (int(v) for v in _BATCH.split("x"))
BACKEND = os.environ.get("BENCH_BACKEND", "hooked")  # --backend sets it: hooked or bridge
COLS = ["call", "batch", "layerwise", "depth", "vocab", "extra_gib", "weights_gib", "seconds",
        "delta_moved_x"]  # fmt: skip


def build(depth: int, vocab: int):
    from extractive_lens import WeightDiff, tiny_model
    from extractive_lens import backend as B

    if BACKEND == "bridge":
        model = build_bridge(depth, vocab)
        stored = B.bridge.stored_names(model)  # no Δ where Llama stores no weight (biases)
    else:
        cfg = dict(LLAMA3_8B, n_layers=depth, d_vocab=vocab, dtype=torch.bfloat16)
        model = tiny_model(cfg, seed=0)
        stored = set(B.parameters(model))
    g = torch.Generator().manual_seed(1)
    deltas = {
        n: 1e-3 * torch.randn(p.shape, generator=g, dtype=torch.float32)
        if n in stored else torch.zeros(p.shape, dtype=torch.float32)
        for n, p in B.parameters(model).items()
    }  # fmt: skip
    diff = WeightDiff(deltas, B.signature(model))
    return model, diff, random_prompts(model, vocab, g)


def build_bridge(depth: int, vocab: int):
    """The same shape as a Hugging Face Llama (untied ``lm_head``) in a ``TransformerBridge``
    (``--backend bridge``), random bf16 weights."""
    import transformers

    import extractive_lens as el

    s = LLAMA3_8B
    hf_cfg = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=s["d_model"], num_hidden_layers=depth,
        num_attention_heads=s["n_heads"], num_key_value_heads=s["n_key_value_heads"],
        intermediate_size=s["d_mlp"], max_position_embeddings=s["n_ctx"],
        tie_word_embeddings=False,
    )  # fmt: skip
    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(hf_cfg, torch_dtype=torch.bfloat16)
    hf = hf.to_empty(device="cpu").eval()
    torch.manual_seed(0)
    with torch.no_grad():
        for n, t in hf.named_parameters():
            t.fill_(1.0) if "norm" in n else t.normal_(0, 0.02)
    return el.from_hf(hf, backend="bridge")


def random_prompts(
    model, vocab: int, g: torch.Generator, device: str | None = None, n: int | None = None
):
    """``n`` (default ``PROMPTS``) random prompts of ``TOKENS`` tokens with a random one-token
    answer each."""
    from extractive_lens import make_batch

    pairs = [
        (torch.randint(0, vocab, (TOKENS,), generator=g).tolist(), [int(torch.randint(0, vocab, (1,), generator=g))])
        for _ in range(PROMPTS if n is None else n)
    ]  # fmt: skip
    return make_batch(model, pairs, candidates=sorted({a[0] for _, a in pairs}), device=device)


def case(call: str, depth: int, vocab: int, layerwise: bool = False) -> dict:
    import ctypes
    import gc
    import time
    import warnings

    import extractive_lens as el

    warnings.filterwarnings("ignore")
    if layerwise:  # gradients one layer at a time, whatever the size (what 32 layers get)
        import extractive_lens.scoring.runs as runs

        runs.LAYERWISE_BYTES = -1
    if os.environ.get("BENCH_WHOLE_VOCAB"):  # the vocabulary matrices whole: the path before
        from extractive_lens.backend import vocab as by_part  # they were read a part at a time

        by_part.SLICE_BYTES = 2**62
    model, diff, batch = build(depth, vocab)
    # one prompt has no other prompts to take upstream's y* from (mean ablation): y* = 0 there
    # (the same passes, another constant)
    ablation = "zero" if PROMPTS == 1 else "mean"
    lin = None
    if call == "exact_token_top_k":  # the linear ranking is an input here, computed beforehand
        lin = el.linear_scores(
            model, diff, batch, kinds=("informative", "downstream"), show_progress=False
        )
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    from extractive_lens.backend import shift

    t0 = time.perf_counter()
    with PeakMemory() as mem, shift.counting() as moved:
        if call == "linear":
            el.linear_scores(model, diff, batch, ablation=ablation, show_progress=False)
        elif call == "exact_token_top_k":
            el.causal_scores(model, diff, batch, kinds=("informative", "downstream"), top_k=3,
                             linear=lin, show_progress=False)  # fmt: skip
        elif call == "exact_component":
            el.causal_scores(model, diff, batch, kinds=("informative", "downstream"),
                             per="component", layers=[0], show_progress=False)  # fmt: skip
        elif call == "integrated":  # every kind, default steps; the linear top 3 per kind
            el.integrated_scores(model, diff, batch, top_k=3, linear=lin, ablation=ablation,
                                 show_progress=False)  # fmt: skip
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    return {
        "call": call, "batch": f"{PROMPTS}x{TOKENS}", "depth": depth, "vocab": vocab, "layerwise": layerwise,
        "extra_gib": mem.extra_mb / 1024,
        "weights_gib": weights / GiB, "seconds": time.perf_counter() - t0,
        "delta_moved_x": moved.bytes / _delta_bytes(diff), "backend": BACKEND,
    }  # fmt: skip


def _delta_bytes(diff) -> int:
    return sum(t.numel() * t.element_size() for t in diff.deltas.values())


def build_on_gpu(depth: int, vocab: int, device: str = "cuda"):
    """Llama-3-8B's shape at ``depth`` on the GPU (TransformerLens's own initialisation, made on
    the device), Δ of 1e-3 random normal in float32 on the host, pinned (32 GB at full depth)."""
    import transformer_lens as tl

    from extractive_lens import WeightDiff
    from extractive_lens import backend as B

    cfg = tl.HookedTransformerConfig(
        **dict(LLAMA3_8B, n_layers=depth, d_vocab=vocab, dtype=torch.bfloat16, device=device)
    )
    with torch.device(device):
        model = tl.HookedTransformer(cfg)
    model.eval()
    g = torch.Generator(device=device).manual_seed(1)
    deltas = {}
    pin = device != "cpu"
    for n, p in B.parameters(model).items():  # float32 on the host, made pinned (no copy later)
        d = torch.randn(p.shape, generator=g, device=device, dtype=torch.float32).mul_(1e-3)
        deltas[n] = torch.empty(p.shape, dtype=torch.float32, pin_memory=pin).copy_(d)
        del d
    diff = WeightDiff(deltas, B.signature(model)).pinned()
    return model, diff, random_prompts(model, vocab, torch.Generator().manual_seed(1), device)


def gpu_cases(depths: list[int], vocab: int, calls: list[str]) -> list[dict]:
    import time
    import warnings

    import extractive_lens as el

    warnings.filterwarnings("ignore")
    rows = []
    for depth in depths:
        t0 = time.perf_counter()
        model, diff, batch = build_on_gpu(depth, vocab)
        weights = sum(p.numel() * p.element_size() for p in model.parameters())
        print(f"depth {depth}: built in {time.perf_counter() - t0:.0f} s, weights "
              f"{weights / GiB:.2f} GiB, GPU {torch.cuda.get_device_name()}", flush=True)  # fmt: skip
        lin = el.linear_scores(
            model, diff, batch, kinds=("informative", "downstream"), show_progress=False
        )
        for call in calls:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            start = torch.cuda.memory_allocated()
            t0 = time.perf_counter()
            if call == "linear":
                el.linear_scores(model, diff, batch, show_progress=False)
            elif call == "exact_token_top_k":
                el.causal_scores(model, diff, batch, kinds=("informative", "downstream"),
                                 top_k=3, linear=lin, show_progress=False)  # fmt: skip
            elif call == "exact_component":
                el.causal_scores(model, diff, batch, kinds=("informative", "downstream"),
                                 per="component", layers=[0], show_progress=False)  # fmt: skip
            elif call == "integrated":
                el.integrated_scores(model, diff, batch, top_k=3, show_progress=False)
            torch.cuda.synchronize()
            rows.append({
                "call": call, "batch": f"{PROMPTS}x{TOKENS}", "depth": depth, "vocab": vocab, "layerwise": True,
                "extra_gib": (torch.cuda.max_memory_allocated() - start) / GiB,
                "weights_gib": weights / GiB, "seconds": time.perf_counter() - t0,
                "peak_total_gib": torch.cuda.max_memory_allocated() / GiB,
            })  # fmt: skip
            print(table(rows[-1:], COLS + ["peak_total_gib"]), flush=True)
        del model, diff, batch, lin
        torch.cuda.empty_cache()
    return rows


def checkpoints_case(tmp: Path) -> dict:
    """Host memory of forming every Δ of two saved checkpoints, layer by layer."""
    import ctypes
    import gc

    import transformers

    import extractive_lens as el
    from extractive_lens.backend.names import layer_of

    paths = [tmp / "base", tmp / "finetuned"]
    if not all((p / "config.json").exists() for p in paths):
        hf_cfg = transformers.LlamaConfig(
            vocab_size=32000, hidden_size=4096, num_hidden_layers=2, num_attention_heads=32,
            num_key_value_heads=8, intermediate_size=14336, max_position_embeddings=64,
            tie_word_embeddings=False,
        )  # fmt: skip
        with torch.device("meta"):
            hf = transformers.AutoModelForCausalLM.from_config(hf_cfg)
        hf = hf.to_empty(device="cpu").to(torch.bfloat16)
        for i, p in enumerate(paths):
            torch.manual_seed(i)
            with torch.no_grad():
                for t in hf.parameters():
                    t.normal_(0, 0.02)
            hf.save_pretrained(p)
        del hf
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with PeakMemory() as mem, PeakMemory(anonymous=True) as anon:
        diff = el.WeightDiff.from_checkpoints(*paths, dtype=torch.bfloat16)
        largest = 0
        for name in sorted(diff.deltas, key=lambda n: (layer_of(n) is None, layer_of(n) or 0)):
            d = diff.deltas[name]
            largest = max(largest, d.numel() * 2)  # bf16 bytes of that weight
            del d
    shapes = diff.deltas.base.shapes  # type: ignore[attr-defined]
    model_bytes = sum(int(torch.Size(s).numel()) * 2 for s in shapes.values())
    return {
        "extra_gib": mem.extra_mb / 1024, "extra_anonymous_gib": anon.extra_mb / 1024,
        "model_gib": model_bytes / GiB,
        "largest_tensor_gib": largest / GiB,
    }  # fmt: skip


TARGET = 0.05
"""Growth per layer allowed (GiB): issue 41's target for every call and batch."""


def _key(row: dict | tuple) -> tuple:
    """A case's identity: (call, depth, vocab, layerwise, batch)."""
    if isinstance(row, dict):
        return (row["call"], row["depth"], row["vocab"], bool(row["layerwise"]), row["batch"],
                row.get("backend", "hooked"))  # fmt: skip
    call, depth, vocab, lw, batch = row
    return (call, depth, vocab, bool(lw), batch, BACKEND)


def _read_rows(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


@contextlib.contextmanager
def _held(lock: str | None) -> Iterator[None]:
    """The file lock ``lock`` held inside the block (``flock``; ``None``: no lock)."""
    if lock is None:
        yield
        return
    import fcntl

    with open(lock, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def slope(rows: list[dict], call: str, layerwise: bool, batch: str = "8x32") -> float | None:
    pts = [(r["depth"], r["extra_gib"]) for r in rows
           if r["call"] == call and r["vocab"] == 32000 and r["layerwise"] == layerwise
           and r["batch"] == batch]  # fmt: skip
    if len(pts) < 2:
        return None
    n = len(pts)
    mx, my = sum(x for x, _ in pts) / n, sum(y for _, y in pts) / n
    return sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x, _ in pts)


def last_step(rows: list[dict], call: str, layerwise: bool, batch: str) -> float:
    """Growth per layer between the two deepest depths measured: what the slope is once a
    step at the smallest depths is behind (a depth-1 model has no layer after the first one's
    heads: its passes from there run only that layer's MLP, a deeper one's a whole layer)."""
    pts = sorted((r["depth"], r["extra_gib"]) for r in rows
                 if r["call"] == call and r["vocab"] == 32000 and r["layerwise"] == layerwise
                 and r["batch"] == batch)  # fmt: skip
    if len(pts) < 2:
        return float("nan")
    (d0, y0), (d1, y1) = pts[-2], pts[-1]
    return (y1 - y0) / (d1 - d0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--depths", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--calls", nargs="+", default=list(CALLS))
    ap.add_argument("--real-vocab", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--checkpoints", action="store_true")
    ap.add_argument("--only-checkpoints", action="store_true")
    ap.add_argument("--case", nargs=4, metavar=("CALL", "DEPTH", "VOCAB", "LAYERWISE"))
    ap.add_argument(
        "--layerwise",
        nargs="+",
        type=int,
        default=[0],
        help="0: as chosen by size (the default settings); 1: gradients one layer at a time "
        "whatever the size",
    )
    ap.add_argument(
        "--batches",
        nargs="+",
        default=["8x32"],
        metavar="PxT",
        help="batches of P prompts x T tokens (e.g. 1x16 2x16 8x32 1x256)",
    )
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--backend", choices=["hooked", "bridge"],
                    help="the model class (default hooked; bridge: a Hugging Face Llama of this "
                         "shape in a TransformerBridge, CPU cases only)")  # fmt: skip
    ap.add_argument("--vocab", type=int, default=128256, help="--device cuda: the vocabulary")
    ap.add_argument("--out", default="bench_memory")
    ap.add_argument("--results", metavar="JSONL",
                    help="append each case's row here as it is measured; cases already there "
                         "are not run again (a stopped grid resumes)")  # fmt: skip
    ap.add_argument(
        "--summary",
        action="store_true",
        help="with --results: print the table and slopes of what is there, run nothing",
    )
    ap.add_argument("--lock", metavar="FILE",
                    help="hold this file lock (flock) while each case runs: one heavy case at a "
                         "time on a shared machine")  # fmt: skip
    args = ap.parse_args()
    if args.backend:  # the cases read it (they run in subprocesses)
        global BACKEND
        BACKEND = os.environ["BENCH_BACKEND"] = args.backend
    if args.device == "cuda":
        rows = gpu_cases(args.depths, args.vocab, args.calls)
        print()
        print(table(rows, COLS + ["peak_total_gib"]))
        print("wrote", write(args.out, {"rows": rows, "setting": {
            "prompts": PROMPTS, "tokens": TOKENS, "shape": LLAMA3_8B, "device": "cuda"}}))  # fmt: skip
        return
    if args.case:
        print(
            json.dumps(
                case(args.case[0], int(args.case[1]), int(args.case[2]), args.case[3] == "1")
            )
        )
        return
    if args.only_checkpoints:
        import tempfile

        with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_TMP")) as tmp:
            found = checkpoints_case(Path(tmp))
        print("from_checkpoints:", found)
        print("wrote", write(args.out, {"from_checkpoints": found}))
        return
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    jobs = [(c, d, 32000, lw, b) for b in args.batches for c in args.calls
            for lw in args.layerwise for d in args.depths]  # fmt: skip
    if args.real_vocab:
        jobs += [(c, 1, 128256, max(args.layerwise), b) for b in args.batches for c in args.calls]
    done = _read_rows(args.results) if args.results else []
    rows = [r for r in done if _key(r) in {_key(j) for j in jobs}]
    for job in jobs:
        if args.summary or _key(job) in {_key(r) for r in rows}:
            continue  # measured already (--results): the grid resumes where it stopped
        call, depth, vocab, lw, b = job
        with _held(args.lock):  # one heavy case at a time on a shared machine
            out = subprocess.run(
                [sys.executable, __file__, "--case", call, str(depth), str(vocab), str(lw)],
                capture_output=True, text=True, env=dict(env, BENCH_BATCH=b), check=False,
            )  # fmt: skip
        if out.returncode != 0:
            print(out.stderr[-2000:], file=sys.stderr)
            raise SystemExit(f"case {call} depth {depth} batch {b} failed")
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
        if args.results:
            with open(args.results, "a") as f:
                f.write(json.dumps(rows[-1]) + "\n")
        print(table(rows[-1:], COLS), flush=True)
    slopes = {f"{c} {b}{' layerwise' if lw else ''}": slope(rows, c, bool(lw), b)
              for b in args.batches for c in args.calls for lw in args.layerwise}  # fmt: skip
    print()
    print(table(rows, COLS))
    print()
    for key, s in slopes.items():
        if s is not None:
            c, b, lw = key.split(" ")[0], key.split(" ")[1], key.endswith("layerwise")
            first = next((r["extra_gib"] for r in rows if r["call"] == c and r["layerwise"] == lw
                         and r["depth"] == min(args.depths) and r["vocab"] == 32000
                         and r["batch"] == b), float("nan"))  # fmt: skip
            flag = "" if s <= TARGET else "  ABOVE TARGET"
            last = last_step(rows, c, lw, b)
            print(f"{key:36s} slope {s:.3f} GiB/layer (target <= {TARGET}); 32 layers: about "
                  f"{first + 31 * s:.1f} GiB above the weights; between the two deepest "
                  f"{last:.3f} GiB/layer{flag}")  # fmt: skip
    payload: dict = {"rows": rows, "slopes_gib_per_layer": slopes,
                     "setting": {"batches": args.batches, "shape": LLAMA3_8B}}  # fmt: skip
    if args.checkpoints:
        import tempfile

        with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_TMP")) as tmp:
            payload["from_checkpoints"] = checkpoints_case(Path(tmp))
        print("from_checkpoints:", payload["from_checkpoints"])
    print("wrote", write(args.out, payload))


if __name__ == "__main__":
    main()

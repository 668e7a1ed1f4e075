"""TransformerBridge against HookedTransformer: the same scores on the same weights, timed in one run.

    python benchmarks/bench_bridge.py [--shapes bundled gpt2-small]

- ``bundled``: the shipped world model (4 layers) as a HookedTransformer and as a native
  TransformerBridge (``load_world_model(backend="bridge")``), 4 prompts x 12 tokens.
- ``gpt2-small``: a Hugging Face GPT-2 with GPT-2 small's shape and random weights, saved to a
  temporary directory and loaded both ways (``load_checkpoint`` / ``backend="bridge"``),
  2 prompts x 8 tokens (the exact map on CPU takes minutes otherwise).

Rows: ``linear_scores`` (all kinds) and ``causal_scores`` per token (all kinds on the bundled
shape; downstream on GPT-2 small). The ratio is bridge time / HookedTransformer time (1.0 = as
fast); the script also checks that the scores agree.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.common import RESULTS, SHAPES, random_batch, table, timeit, write  # noqa: E402


def models(shape: str):
    """(hooked base, hooked finetuned, bridge base, bridge finetuned)."""
    from extractive_lens.model import load_checkpoint

    if shape == "bundled":
        from extractive_lens.backend.building import as_bridge
        from extractive_lens.world import load_world_model

        base = load_world_model()
        ft = load_world_model()
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for p in ft.parameters():
                p.add_(0.02 * p.abs().mean() * torch.randn(p.shape, generator=g))
        return base, ft, as_bridge(base), as_bridge(ft)
    import transformers

    s = SHAPES[shape]
    cfg = transformers.GPT2Config(
        vocab_size=s["d_vocab"], n_embd=s["d_model"], n_layer=s["n_layers"], n_head=s["n_heads"],
        n_positions=s["n_ctx"],
    )  # fmt: skip
    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(cfg).eval()
    out = []
    for _ in range(2):
        path = Path(tempfile.mkdtemp(prefix="el-bench-"))
        hf.save_pretrained(path)
        out.append(path)
        with torch.no_grad():
            for p in hf.parameters():
                p.add_(0.02 * p.abs().mean() * torch.randn_like(p))
    hooked = [load_checkpoint(p) for p in out]
    bridges = [load_checkpoint(p, backend="bridge") for p in out]
    return (*hooked, *bridges)


def run_shape(shape: str, repeats: int) -> list[dict]:
    from extractive_lens import WeightDiff, causal_scores, linear_scores

    hb, hf_, bb, bf = models(shape)
    d_h, d_b = WeightDiff.from_models(hb, hf_), WeightDiff.from_models(bb, bf)
    prompts, pos = (4, 12) if shape == "bundled" else (2, 8)  # the world model's n_ctx is 16
    batch = random_batch(hb, batch=prompts, pos=pos)
    exact_kinds = ("informative", "upstream", "downstream") if shape == "bundled" else "downstream"
    jobs = {
        "linear (all kinds)": lambda m, d: linear_scores(m, d, batch, show_progress=False),
        f"causal per token ({'all kinds' if shape == 'bundled' else 'downstream'})": lambda m, d: (
            causal_scores(m, d, batch, kinds=exact_kinds, show_progress=False)
        ),
    }
    rows = []
    for name, fn in jobs.items():
        a, b = fn(hb, d_h), fn(bb, d_b)
        err = max(float((a[k] - b[k]).abs().max()) for k in a.kinds)
        scale = max(float(a[k].abs().max()) for k in a.kinds)
        t_h = timeit(lambda fn=fn: fn(hb, d_h), repeats=repeats)
        t_b = timeit(lambda fn=fn: fn(bb, d_b), repeats=repeats)
        rows.append({
            "shape": shape, "scores": name, "prompts x tokens": f"{prompts}x{pos}",
            "hooked_s": t_h, "bridge_s": t_b, "bridge/hooked": t_b / t_h,
            "max_abs_diff": err, "max_abs_score": scale,
        })  # fmt: skip
        print(table(rows[-1:], list(rows[-1])), flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="+", default=["bundled", "gpt2-small"])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    rows = [r for s in args.shapes for r in run_shape(s, args.repeats)]
    cols = ["shape", "scores", "prompts x tokens", "hooked_s", "bridge_s", "bridge/hooked",
            "max_abs_diff"]  # fmt: skip
    print(table(rows, cols))
    old = RESULTS / "bench_bridge.json"  # keep the rows of shapes not re-run
    if old.exists():
        kept = [r for r in json.loads(old.read_text())["rows"] if r["shape"] not in args.shapes]
        rows = kept + rows
    print("wrote", write("bench_bridge", {"rows": rows}))


if __name__ == "__main__":
    main()

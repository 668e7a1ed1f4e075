"""The accuracy-cost frontier of the path-integrated scores (issue 30).

    python benchmarks/bench_integrated.py                       # both settings
    python benchmarks/bench_integrated.py --settings demo --steps 1 2 4 8 16

Settings, each measured in one run (time ratios taken in the same process, same batch):

- ``demo``: the setting of ``extractive-lens demo``: the bundled world model finetuned on its 20
  new facts, scored on the 20 implications (per token, every kind).
- ``gpt2-small``: GPT-2 small's shape with random weights and a random 2% update, on 2 prompts
  of 16, 32 and 64 tokens, components of layers 0, 6 and 11 (exact per-token scores of every
  layer at 64 tokens take hours on a laptop CPU; the three layers keep each method's cost in
  proportion, and later layers' passes are the cheap ones).

For each steps value and path (``component``, ``layer``): per-token Pearson r with the exact
(role-aggregated cells, as ``compare`` reads them)
scores per kind, the informative completeness error, and the time divided by ``linear_scores``'
and by ``causal_scores``' (per token) on the same batch. Target (issue 30): r >= 0.99 for
every kind at <= 1/2 of exact's time at 32 tokens and <= 1/4 at 64, informative at <= m x the
linear time.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import random_pair, table, write  # noqa: E402


def _timed(fn):
    _sync()
    t0 = time.perf_counter()
    out = fn()
    _sync()
    return out, time.perf_counter() - t0


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _pearson(a, b) -> float:
    a, b = a.flatten().double().numpy(), b.flatten().double().numpy()
    keep = np.isfinite(a) & np.isfinite(b)
    return float(np.corrcoef(a[keep], b[keep])[0, 1])


def frontier(name, model, diff, batch, steps, paths, layers=None, tokens=None) -> list[dict]:
    import extractive_lens as el

    kw = dict(show_progress=False, layers=layers)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lin, t_lin = _timed(lambda: el.linear_scores(model, diff, batch, show_progress=False))
        ex, t_ex = _timed(lambda: el.causal_scores(model, diff, batch, **kw))
        inf_lin, t_inf_lin = _timed(
            lambda: el.linear_scores(model, diff, batch, kinds="informative", show_progress=False)
        )
    rows = [{"setting": name, "tokens": tokens, "method": "linear", "steps": None, "path": None,
             **{f"r_{k}": _pearson(lin.values[i], ex.values[i]) for i, k in enumerate(lin.kinds)},
             "completeness": lin.metadata["additivity"]["relative_gap"],
             "time/linear": 1.0, "time/exact": t_lin / t_ex}]  # fmt: skip
    print(table(rows, COLS), flush=True)
    for path in paths:
        for m in steps:
            ig, t = _timed(
                lambda: el.integrated_scores(model, diff, batch, steps=m, path=path, **kw)
            )
            _, t_inf = _timed(lambda: el.integrated_scores(model, diff, batch, steps=m, path=path,
                                                           kinds="informative", **kw))  # fmt: skip
            row = {"setting": name, "tokens": tokens, "method": "integrated", "steps": m, "path": path,
                   **{f"r_{k}": _pearson(ig.values[i], ex.values[i]) for i, k in enumerate(ig.kinds)},
                   "completeness": ig.metadata["integrated"]["completeness"]["informative"],
                   "time/linear": t / t_lin, "time/exact": t / t_ex,
                   "informative/linear": t_inf / t_inf_lin}  # fmt: skip
            rows.append(row)
            print(table([row], COLS), flush=True)
    return rows


COLS = ["setting", "tokens", "method", "steps", "path", "r_informative", "r_upstream",
        "r_downstream", "completeness", "time/linear", "time/exact", "informative/linear"]  # fmt: skip


def demo_setting():
    from extractive_lens import FinetuneConfig, finetune
    from extractive_lens.world import FINETUNE, first_hop, load_world_model

    model = load_world_model()
    facts, impls = first_hop().batches(model)
    diff = finetune(model, facts, FinetuneConfig(**FINETUNE, seed=0))
    return model, diff, impls


def gpt2_batch(model, n_tokens: int, prompts: int = 2):
    from extractive_lens import make_batch

    g = torch.Generator().manual_seed(n_tokens)
    V = model.cfg.d_vocab
    pairs = [(torch.randint(0, V, (n_tokens,), generator=g).tolist(),
              [int(torch.randint(0, V, (1,), generator=g))]) for _ in range(prompts)]  # fmt: skip
    return make_batch(model, pairs, candidates=sorted({a[0] for _, a in pairs}),
                      device=model.cfg.device)  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--settings", nargs="+", default=["demo", "gpt2-small"])
    ap.add_argument("--steps", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--gpt2-steps", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--tokens", type=int, nargs="+", default=[16, 32, 64])
    ap.add_argument("--paths", nargs="+", default=["component", "layer"])
    ap.add_argument(
        "--layers",
        default="0,6,11",
        help="gpt2-small: the layers scored, comma-separated, or 'all'",
    )
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--out", default="bench_integrated")
    args = ap.parse_args()
    torch.set_num_threads(torch.get_num_threads())
    rows = []
    if "demo" in args.settings:
        model, diff, impls = demo_setting()
        if args.device != "cpu":
            model, diff, impls = model.to(args.device), diff.to(args.device), impls.to(args.device)
        rows += frontier("demo", model, diff, impls, args.steps, args.paths)
    if "gpt2-small" in args.settings:
        n_ctx = max(64, max(args.tokens) + 2)  # the prompt, its BOS and the answer
        base, diff, _ = random_pair("gpt2-small", device=args.device, n_ctx=n_ctx)
        layers = None if args.layers == "all" else [int(x) for x in args.layers.split(",")]
        for n in args.tokens:
            rows += frontier("gpt2-small", base, diff, gpt2_batch(base, n), args.gpt2_steps,
                             args.paths, layers=layers, tokens=n)  # fmt: skip
    print()
    print(table(rows, COLS))
    print("wrote", write(args.out, {"rows": rows}))


if __name__ == "__main__":
    main()

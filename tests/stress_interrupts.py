"""Stress the interrupt safety far beyond the test suite's 15 alarms per call (not collected by pytest).

    python tests/stress_interrupts.py SEED TRIALS_PER_CALL      # e.g. 1 150: 600 random interrupts

SIGALRM raises KeyboardInterrupt at a random moment of ``applied`` / ``linear_scores`` /
``causal_scores`` / ``finetune``; after each, the model and torch's state must be exactly as
before. Stops at the first difference and prints where the interrupt landed.
"""

from __future__ import annotations

import random
import signal
import sys
import time
import traceback
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(seed: int, trials: int) -> int:
    import torch

    from extractive_lens import WeightDiff
    from tests.conftest import make_pair
    from tests.helpers import small_batch
    from tests.test_interrupts import assert_unchanged, calls, snapshot

    warnings.filterwarnings("ignore")
    base, ft = make_pair(
        "ln_gelu", torch.float64, n_layers=1, d_model=8, n_heads=2, d_head=4, d_mlp=8
    )
    fns = calls(base, WeightDiff.from_models(base, ft), small_batch(base, n=3))

    def alarm(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGALRM, alarm)
    rng = random.Random(seed)
    n = hits = 0
    for name in ("applied", "linear_scores", "causal_scores", "finetune"):
        fn = fns[name]
        before = snapshot(base)
        fn()
        t0 = time.perf_counter()
        fn()
        duration = time.perf_counter() - t0
        for _ in range(trials):
            n += 1
            landed = None
            try:
                signal.setitimer(signal.ITIMER_REAL, rng.uniform(1e-5, duration))
                fn()
                time.sleep(duration)
            except KeyboardInterrupt as e:
                hits += 1
                landed = traceback.extract_tb(e.__traceback__)[-4:]
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
            try:
                assert_unchanged(base, before, name)
            except AssertionError as e:
                print(f"trial {n}: {e}\n" + "".join(traceback.format_list(landed or [])))
                return 1
    print(f"{n} trials, {hits} interrupted inside the call, 0 left anything changed")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(int(sys.argv[1]), int(sys.argv[2])))

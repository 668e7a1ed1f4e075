"""What a scoring call keeps per layer, on a narrow copy of the 8B layer shape (issue 41).

    BENCH_BATCH=8x32 python benchmarks/bench_memory_narrow.py linear 2
    BENCH_BATCH=8x32 python benchmarks/bench_memory_narrow.py linear 16   # then compare

``bench_memory.py``'s model with every width divided by ``NARROW`` (default 8: d_model 512,
d_mlp 1792, 4 heads with one key/value head; vocabulary 4000) and the 8B model's size choices
forced (gradients one layer at a time, Δ held a few layers at a time, the vocabulary by part),
so the same passes run at 1/64 of the weights and 1/8 of the activations: deep models fit
in a few hundred MB, and what a call keeps per layer (activations, proportional to the width)
shows once the transient that sets the peak at small depth is passed. Prints one JSON line:
the peak resident memory above the model, Δ and batch (GiB). Run it in a fresh process per
case with ``MALLOC_MMAP_THRESHOLD_=65536``.

WHAT: ``linear``; ``integrated`` (every kind, 4 nodes, the linear top 3); ``int_informative`` / ``int_upstream`` / ``int_downstream`` (integrated,
4 nodes, the linear top 3, one kind); ``exact_component`` (per component, layer 0);
``exact_token_top_k`` (per token, the linear top 3).
"""

from __future__ import annotations

import ctypes
import gc
import json
import os
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import benchmarks.bench_memory as bm  # noqa: E402
from benchmarks.common import PeakMemory  # noqa: E402


def main() -> None:
    import extractive_lens as el
    from extractive_lens.backend import shift, vocab
    from extractive_lens.scoring import runs

    warnings.filterwarnings("ignore")
    w = int(os.environ.get("NARROW", "8"))
    bm.LLAMA3_8B.update(d_model=4096 // w, n_heads=32 // w, n_key_value_heads=max(1, 8 // w),
                        d_mlp=14336 // w)  # fmt: skip
    runs.LAYERWISE_BYTES, shift.REUSE_BYTES = -1, -1  # the 8B model's choices
    vocab.SLICE_BYTES = vocab.SLICE_BYTES // (w * w)
    what, depth = sys.argv[1], int(sys.argv[2])
    model, diff, batch = bm.build(depth, 32000 // w)
    lin = None
    if what.startswith(("int", "exact_token")):  # the ranking is an input, computed before
        lin = el.linear_scores(model, diff, batch, show_progress=False)
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    kw: dict = dict(show_progress=False)
    with PeakMemory() as mem:
        if what == "linear":
            el.linear_scores(model, diff, batch, **kw)
        elif what == "integrated":  # every kind, as bench_memory.py's integrated case
            el.integrated_scores(model, diff, batch, top_k=3, linear=lin, **kw)
        elif what.startswith("int_"):
            el.integrated_scores(model, diff, batch, kinds=(what[4:],), top_k=3, linear=lin, **kw)
        elif what == "exact_component":
            el.causal_scores(model, diff, batch, kinds=("informative", "downstream"),
                             per="component", layers=[0], **kw)  # fmt: skip
        elif what == "exact_token_top_k":
            el.causal_scores(model, diff, batch, kinds=("informative", "downstream"), top_k=3,
                             linear=lin, **kw)  # fmt: skip
        else:
            raise SystemExit(f"unknown call {what!r}: see the module docstring")
    print(json.dumps({"call": what, "depth": depth, "narrow": w, "batch": f"{bm.PROMPTS}x{bm.TOKENS}",
                      "extra_gib": mem.extra_mb / 1024}))  # fmt: skip


if __name__ == "__main__":
    main()

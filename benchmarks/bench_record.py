"""The record's hashing of a model's parameters (``record.tensors_digest``): its throughput on
this CPU and what it means at Llama-3-8B's 16 GB of bfloat16 weights.

    python benchmarks/bench_record.py

Hashes 512 MiB of bfloat16 matrices (16 × 4096 × 4096, seeded) with ``tensors_digest`` and,
in the same run, the way it read them before (each tensor's bytes copied out with
``tobytes()`` first), and checks the two digests are equal. The record hashes a model's
parameters once per model and keeps the digest until a parameter changes (``_model_digest``).
"""

from __future__ import annotations

import hashlib
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import table, write  # noqa: E402

EIGHT_B_BYTES = 16e9  # Llama-3-8B's weights in bfloat16


def copied_digest(named: list[tuple[str, torch.Tensor]]) -> str:
    """The digest as it was computed before: every tensor's bytes copied out first."""
    h = hashlib.blake2b(digest_size=16)
    for name, t in sorted(named, key=lambda item: item[0]):
        h.update(f"{name}|{tuple(t.shape)}|{t.dtype}|".encode())
        h.update(t.reshape(-1).contiguous().cpu().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def main() -> None:
    from extractive_lens.record import tensors_digest

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    named = [(f"w{i}", torch.randn(4096, 4096, generator=g).to(torch.bfloat16)) for i in range(16)]
    gb = sum(t.numel() * t.element_size() for _, t in named) / 1e9
    rows = []
    for name, fn in (("in place (now)", tensors_digest), ("copied out (before)", copied_digest)):
        times, digest = [], ""
        for _ in range(3):
            c0 = time.process_time()
            digest = fn(named)
            times.append(time.process_time() - c0)
        seconds = sorted(times)[1]
        rows.append(dict(read=name, gb=round(gb, 3), cpu_s=round(seconds, 2),
                         gb_per_s=round(gb / seconds, 2),
                         llama_8b_bf16_s=round(EIGHT_B_BYTES / 1e9 / (gb / seconds), 1),
                         digest=digest))  # fmt: skip
    assert rows[0]["digest"] == rows[1]["digest"], "the two reads must hash the same bytes"
    rows[0]["speedup"] = round(rows[1]["cpu_s"] / rows[0]["cpu_s"], 2)
    print(table(rows, ["read", "gb", "cpu_s", "gb_per_s", "llama_8b_bf16_s", "speedup"]))
    write("record", {"rows": rows})


if __name__ == "__main__":
    main()

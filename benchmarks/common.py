"""Shared benchmark helpers: warm-up + median timing, environment record, JSON output."""

from __future__ import annotations

import json
import platform
import resource
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

RESULTS = Path(__file__).parent / "results"


def timeit(fn: Callable[[], Any], *, repeats: int = 5, warmup: int = 1) -> float:
    """Median wall time of ``fn()`` over ``repeats`` runs after ``warmup`` runs (seconds)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def environment() -> dict[str, Any]:
    from extractive_lens.backend.installed import version

    return {
        "device": "cuda:" + torch.cuda.get_device_name()
        if torch.cuda.is_available()
        else f"cpu ({platform.processor() or platform.machine()})",
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformer_lens": version(),
        "python": platform.python_version(),
        "time": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def rss_mb(anonymous: bool = False) -> float:
    """Resident memory (MB); ``anonymous``: without file-backed pages (memory-mapped files the
    kernel can drop at any time, such as safetensors checkpoints being read)."""
    if anonymous:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) / 1024
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


class PeakMemory:
    """Peak resident memory above the level at entry, sampled every millisecond (MB);
    ``anonymous=True``: without file-backed pages (see ``rss_mb``)."""

    def __init__(self, anonymous: bool = False) -> None:
        self.anonymous = anonymous

    def __enter__(self) -> "PeakMemory":
        import threading

        self.start = rss_mb(self.anonymous)
        self.peak = self.start
        self._stop = threading.Event()

        def sample() -> None:
            while not self._stop.is_set():
                self.peak = max(self.peak, rss_mb(self.anonymous))
                self._stop.wait(0.001)

        self._thread = threading.Thread(target=sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_mb(self.anonymous))

    @property
    def extra_mb(self) -> float:
        return self.peak - self.start


class TensorPeak:
    """Peak bytes of tensors alive on the CPU above the level at entry, exactly (MB): the CPU
    allocator's running total, which ``torch.profiler`` records at every allocation and free
    (``profile_memory=True``). What a device's allocator would hold (``torch.cuda.
    max_memory_allocated``'s counterpart), without the process's other memory (the allocator's
    arenas, threads' stacks, Python objects) that the resident size also counts."""

    def __enter__(self) -> "TensorPeak":
        from torch.profiler import ProfilerActivity, profile

        self._profile = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self._profile.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        from torch._C._profiler import _EventType

        self._profile.__exit__(*exc)
        events, stack = [], list(self._profile.profiler.kineto_results.experimental_event_tree())
        while stack:
            e = stack.pop()
            if e.tag == _EventType.Allocation:
                events.append(
                    (e.start_time_ns, e.extra_fields.alloc_size, e.extra_fields.total_allocated)
                )
            stack.extend(e.children)
        events.sort()
        start = events[0][2] - events[0][1] if events else 0
        self.extra_mb = max((total - start for _, _, total in events), default=0) / 2**20


def write(name: str, payload: dict[str, Any]) -> Path:
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps({"environment": environment(), **payload}, indent=1))
    return path


def table(rows: list[dict[str, Any]], cols: list[str]) -> str:
    widths = [max(len(c), *(len(_fmt(r.get(c))) for r in rows)) for c in cols]
    lines = ["  ".join(c.ljust(w) for c, w in zip(cols, widths))]
    lines += ["  ".join(_fmt(r.get(c)).ljust(w) for c, w in zip(cols, widths)) for r in rows]
    return "\n".join(lines)


def _fmt(x: Any) -> str:
    return f"{x:.3f}" if isinstance(x, float) else str(x)


SHAPES = {
    # the bundled world model's shape (issue 6 recipe)
    "bundled": dict(
        n_layers=4, d_model=128, n_heads=4, d_head=32, d_mlp=512, d_vocab=1000, n_ctx=16
    ),
    # GPT-2 small's shape, random weights
    "gpt2-small": dict(
        n_layers=12, d_model=768, n_heads=12, d_head=64, d_mlp=3072, d_vocab=50257, n_ctx=64
    ),
}


def random_pair(
    shape: str, seed: int = 0, delta: float = 0.02, device: str = "cpu", **overrides: Any
):
    """A base model of the named shape and a WeightDiff of random size ``delta`` (relative)."""
    from extractive_lens import WeightDiff, tiny_model

    cfg = dict(SHAPES[shape], act_fn="gelu", normalization_type="LN", **overrides)
    base = tiny_model(cfg, seed=seed, device=device)
    ft = tiny_model(cfg, seed=seed, device=device)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in ft.parameters():
            p.add_(delta * p.abs().mean() * torch.randn(p.shape, generator=g).to(p.device))
    return base, WeightDiff.from_models(base, ft), ft


def random_batch(model, batch: int = 16, pos: int = 16, seed: int = 0):
    from extractive_lens import make_batch

    g = torch.Generator().manual_seed(seed)
    V = model.cfg.d_vocab
    pairs = [
        (
            torch.randint(0, V, (pos,), generator=g).tolist(),
            [int(torch.randint(0, V, (1,), generator=g))],
        )
        for _ in range(batch)
    ]
    cands = sorted({a[0] for _, a in pairs})
    return make_batch(model, pairs, candidates=cands)

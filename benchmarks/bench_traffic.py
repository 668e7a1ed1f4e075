"""Δ read per scoring call at Llama-3-8B's shape and full depth, counted (issue 41).

    python benchmarks/bench_traffic.py                       # 32 layers, 8 prompts x 32 tokens
    python benchmarks/bench_traffic.py --depth 8 --batch 2x16 --calls linear

Which layers a method reads, and how often, does not depend on widths: the call runs on a
narrow copy (32 heads of 8 with 8 key/value heads, gated SiLU MLP, RMS norms, rotary) that makes
the 8B model's choices by size (``runs.sized_as``: gradients one layer at a time, the upstream
group), in the large-model regime (Δ held ``shift.KEEP_LAYERS`` layers at a time), and each
layer load is scaled by a float32 Δ of the real shape, each tensor read on its own (``W_O``
where its layer is not loaded) by that tensor's (``budget._counted``, what ``el.estimate``
reports). The figure is what a GPU run moves to the device, as a multiple of Δ; a diff formed
on demand from bf16 finetuned weights (``from_models(..., on_demand=True)``,
``from_checkpoints``) makes the same reads at half the bytes (the GiB in brackets).
"""

from __future__ import annotations

import argparse
import sys
import time
import types
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

D_MODEL, D_MLP, HEADS, KV, D_HEAD, VOCAB = 4096, 14336, 32, 8, 128, 128256
BLOCK = 2 * D_MODEL * HEADS * D_HEAD + 2 * D_MODEL * KV * D_HEAD + 3 * D_MODEL * D_MLP + 2 * D_MODEL
CALLS = {
    "linear": ("linear", {}),
    "linear_one_sweep": ("linear", {"upstream_group": None}),  # every boundary in one sweep
    "integrated": ("integrated", {"top_k": 3}),
    "exact_token_top3": ("causal", {"top_k": 3, "kinds": ("informative", "downstream")}),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--depth", type=int, default=32)
    ap.add_argument("--batch", default="8x32", metavar="PxT")
    ap.add_argument("--calls", nargs="+", default=list(CALLS), choices=list(CALLS))
    ap.add_argument("--kinds", nargs="+", default=None, help="score kinds (default: all)")
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    import extractive_lens as el
    from extractive_lens import backend as B
    from extractive_lens.backend.names import expected_shape
    from extractive_lens.budget import _counted

    prompts, tokens = (int(v) for v in args.batch.split("x"))
    narrow = el.tiny_model(dict(
        n_layers=args.depth, d_model=8 * HEADS, n_heads=HEADS, d_head=8, n_key_value_heads=KV,
        d_mlp=16 * HEADS, d_vocab=64, n_ctx=tokens + 8, normalization_type="RMS", act_fn="silu",
        gated_mlp=True, positional_embedding_type="rotary", rotary_dim=8, final_rms=True,
    ), seed=0)  # fmt: skip
    block = torch.nn.Module()  # the 8B block's parameter count, on no device
    block.w = torch.nn.Parameter(torch.empty(BLOCK, device="meta"))
    sized = types.SimpleNamespace(
        cfg=types.SimpleNamespace(n_layers=args.depth, d_model=D_MODEL, d_mlp=D_MLP, n_heads=HEADS),
        blocks=[block],
    )
    diff = el.WeightDiff(
        {n: torch.zeros(p.shape) for n, p in B.parameters(narrow).items()}, B.signature(narrow)
    )
    g = torch.Generator().manual_seed(0)
    pairs = [
        (torch.randint(1, 60, (tokens,), generator=g).tolist(), [int(torch.randint(1, 60, (1,), generator=g))])
        for _ in range(prompts)
    ]  # fmt: skip
    batch = el.make_batch(narrow, pairs, candidates=sorted({a[0] for _, a in pairs}))
    layer_bytes, vocab_bytes = 4 * BLOCK, 4 * VOCAB * D_MODEL
    total = args.depth * layer_bytes + 2 * vocab_bytes
    real = dict(n_layers=args.depth, d_model=D_MODEL, n_heads=HEADS, n_key_value_heads=KV,
                d_head=D_HEAD, d_mlp=D_MLP, d_vocab=VOCAB)  # fmt: skip

    def tensor_bytes(name: str) -> int:  # a float32 Δ of the real shape
        shape = expected_shape(name, real)
        assert shape, name
        return 4 * int(torch.Size(shape).numel())

    print(f"Llama-3-8B shape, {args.depth} layers, {args.batch}; float32 Δ {total / 2**30:.1f} GiB"
          f" (bf16 finetuned weights {total / 2**31:.1f} GiB)")  # fmt: skip
    for name in args.calls:
        method, options = CALLS[name]
        if args.kinds and method != "causal":
            options = {**options, "kinds": tuple(args.kinds)}
        t0 = time.perf_counter()
        moved = _counted(narrow, diff, batch, method, options, narrow.cfg.n_layers, sized=sized)
        loads = moved.by_group
        layers = sum(n for g, n in loads.items() if isinstance(g, int))
        alone = sum(share * tensor_bytes(n) for n, share in moved.reads.items())
        read = (
            layers * layer_bytes
            + sum(n for g, n in loads.items() if not isinstance(g, int)) * vocab_bytes
            + alone
        )
        print(f"{name:18s} layer loads {layers:5d}  embed/unembed {loads.get('embed', 0)}/"
              f"{loads.get('unembed', 0)}  read alone {alone / 2**30:5.1f} GiB"
              f"  Δ read {read / 2**30:7.0f} GiB ({read / 2**31:6.0f}) = {read / total:5.2f}x"
              f"  ({time.perf_counter() - t0:.0f} s to count)", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()

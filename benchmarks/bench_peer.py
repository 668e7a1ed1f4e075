"""Exact per-token downstream map: extractive_lens against TransformerLens's own patching.

    python benchmarks/bench_peer.py [--shapes gpt2-small bundled] [--prompts 4] [--pos 16]

The same cells, computed both ways in one run:
- extractive_lens: ``causal_scores(base, diff, batch, kinds="downstream")`` (heads by position
  and MLPs by position, per prompt; the engine resumes the cached run at each boundary, reuses
  the key/value prefix and stacks interventions along the batch axis);
- TransformerLens: ``patching.get_act_patch_attn_head_out_by_pos`` and
  ``patching.get_act_patch_mlp_out`` on the base model, with the "clean cache" holding the
  downstream patch values (each base head / MLP applied to the finetuned run's input) and the
  metric the summed answer log-probability (one full forward per (layer, position[, head])).

TransformerLens patches one cell in every prompt at once and sums the metric over prompts, so
the comparison is against extractive_lens's per-prompt scores summed over prompts (plus the
unpatched reward). The script checks they agree (1e-4 relative, float32) and reports the time
ratio TransformerLens / extractive_lens. Target (issue 14): >= 10x on the GPT-2-small shape.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.common import random_batch, random_pair, table, timeit, write  # noqa: E402


def downstream_cache(base, ft_model, batch):
    """An ``ActivationCache`` with, per layer, the base heads' ``z`` and the base MLP's output on
    the finetuned run's inputs: the downstream patch values (docs/scores.md §4)."""
    from transformer_lens import ActivationCache

    tokens = batch.tokens
    _, ft_cache = ft_model.run_with_cache(tokens)
    cache = {}
    with torch.no_grad():
        for layer, block in enumerate(base.blocks):
            x = ft_cache[f"blocks.{layer}.hook_resid_pre"]
            _, z_cache = base.run_with_cache(
                x, start_at_layer=layer, stop_at_layer=layer + 1,
                names_filter=lambda n, layer=layer: n == f"blocks.{layer}.attn.hook_z",
            )  # fmt: skip
            cache[f"blocks.{layer}.attn.hook_z"] = z_cache[f"blocks.{layer}.attn.hook_z"]
            mid = ft_cache[f"blocks.{layer}.hook_resid_mid"]
            cache[f"blocks.{layer}.hook_mlp_out"] = block.mlp(block.ln2(mid))
    return ActivationCache(cache, base)


def run_shape(shape: str, prompts: int, pos: int, repeats: int) -> dict:
    from transformer_lens import patching

    from extractive_lens import causal_scores
    from extractive_lens.rewards import answer_logprob

    base, diff, ft = random_pair(shape)
    batch = random_batch(base, batch=prompts, pos=pos)
    clean = downstream_cache(base, ft, batch)

    def metric(logits):
        return answer_logprob(logits, batch).sum()

    def ours():
        return causal_scores(base, diff, batch, kinds="downstream", show_progress=False,
                             batch_size=None)  # fmt: skip

    def theirs():
        heads = patching.get_act_patch_attn_head_out_by_pos(base, batch.tokens, clean, metric)
        mlps = patching.get_act_patch_mlp_out(base, batch.tokens, clean, metric)
        return heads, mlps  # [layer, pos, head], [layer, pos]

    t_ours = timeit(ours, repeats=repeats)
    t_theirs = timeit(theirs, repeats=1, warmup=0)
    got = ours()
    heads, mlps = theirs()
    with torch.no_grad():
        r0 = float(answer_logprob(base(batch.tokens), batch).sum())
    pv = got.prompt_values[0].sum(0)  # [layer, component, pos], summed over prompts
    H = base.cfg.n_heads
    mine = torch.cat([pv[:, :H].transpose(1, 2), pv[:, H:].transpose(1, 2)], dim=2) + r0
    ref = torch.cat([heads, mlps[..., None]], dim=2).to(mine.dtype)
    n_read = int((batch.last_prompt_pos + (batch.answer_targets >= 0).sum(-1)).max())
    ref, mine = ref[:, :n_read], mine[:, :n_read]  # later positions cannot change R
    err = float((mine - ref).abs().max() / ref.abs().max())
    assert err < 1e-4, f"{shape}: extractive_lens and TransformerLens patching disagree ({err:.2e})"
    return dict(shape=shape, prompts=prompts, pos=pos, cells=int(ref.numel()), max_rel_err=err,
                extractive_lens_s=t_ours, transformer_lens_s=t_theirs,
                speedup=t_theirs / t_ours)  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="+", default=["gpt2-small", "bundled"])
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--pos", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.manual_seed(0)
    rows = [run_shape(s, args.prompts, args.pos, args.repeats) for s in args.shapes]
    cols = ["shape", "prompts", "pos", "cells", "max_rel_err", "extractive_lens_s",
            "transformer_lens_s", "speedup"]  # fmt: skip
    print(table(rows, cols))
    print("wrote", write("bench_peer", {"rows": rows}))


if __name__ == "__main__":
    main()

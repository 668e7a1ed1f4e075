"""The numbers docs/scores.md §11 quotes, measured on the demo's setting.

    python docs/additivity_numbers.py

The setting of ``extractive-lens demo``: the bundled world model finetuned on its 20 first-hop
test facts (the world's own recipe, seed 0), scored on their 20 implications. It prints the
additivity check (Σ informative + other against R(W') - R(W)), the same check for the update
scaled by ε, and how the linear scores rank against the exact ones (per-token Pearson r, the top
upstream component both ways).
"""

from __future__ import annotations

import warnings

import numpy as np


def main() -> None:
    from extractive_lens import FinetuneConfig, causal_scores, compare, finetune, linear_scores
    from extractive_lens.world import FINETUNE, first_hop, load_world_model

    warnings.simplefilter("ignore")  # the check's warning: its numbers are printed below
    model = load_world_model()
    facts, impls = first_hop().batches(model)
    diff = finetune(model, facts, FinetuneConfig(**FINETUNE, seed=0), show_progress=False)
    lin = linear_scores(model, diff, impls, show_progress=False)
    ex = causal_scores(model, diff, impls, show_progress=False)
    check = lin.metadata["additivity"]
    print(
        f"full update: R(W') - R(W) = {check['exact_change']:+.2f}, Σ informative + other = "
        f"{check['linear_change']:+.2f} (gap {check['relative_gap']:.0%}; 'other' "
        f"{check['other_share']:.0%} of the linear total)"
    )
    for eps in (0.01, 0.1, 0.3):
        c = linear_scores(model, diff * eps, impls, kinds=("informative",), show_progress=False)
        print(f"update × {eps:g}: gap {c.metadata['additivity']['relative_gap']:.1%}")
    cmp = compare(lin, ex)
    for row in cmp.rows:
        if row["part"] == "all":
            print(f"per-token Pearson r, linear vs exact {row['kind']}: {row['pearson']:.3f}")
    for method, s in (("linear", lin), ("exact", ex)):
        kind, label, value = s.top(1, "upstream")[0]
        print(f"top upstream component, {method}: {label} {value:+.2f}")
    u = cmp.cells("upstream")
    print(f"upstream sign agreement: {float(np.mean(np.sign(u[0]) == np.sign(u[1]))):.0%}")


if __name__ == "__main__":
    main()

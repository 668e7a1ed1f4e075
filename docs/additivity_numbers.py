"""The numbers docs/scores.md §11 quotes, measured on the demo's setting.

    python docs/additivity_numbers.py

The setting of ``extractive-lens demo``: the bundled world model finetuned on its 20 first-hop
test facts (the world's own recipe, seed 0), scored on their 20 implications. It prints the
additivity check (Σ informative + other against R(W') - R(W)), the same check for the update
scaled by ε, and how the linear and integrated scores compare with the exact ones (``compare``:
Pearson r, Spearman and sign agreement on the cells with signal, slope; the top components).
"""

from __future__ import annotations

import warnings


def main() -> None:
    from extractive_lens import (
        FinetuneConfig,
        causal_scores,
        compare,
        finetune,
        integrated_scores,
        linear_scores,
    )  # fmt: skip
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
            print(
                f"per-token linear vs exact {row['kind']}: Pearson r {row['pearson']:.3f}, "
                f"on the {row['n_signal']} of {row['n']} cells with signal Spearman "
                f"{row['spearman']:.3f} and sign agreement {row['sign_agreement']:.0%}; slope "
                f"{row['slope']:.2f}, relative error {row['rel_error']:.0%}"
            )
    for method, s in (("linear", lin), ("exact", ex)):
        kind, label, value = s.top(1, "upstream")[0]
        print(f"top upstream component, {method}: {label} {value:+.2f}")
    ig = integrated_scores(model, diff, impls, show_progress=False)
    for row in compare(ig, ex).rows:
        if row["part"] == "all":
            print(
                f"per-token integrated vs exact {row['kind']}: Pearson r {row['pearson']:.3f}, "
                f"Spearman {row['spearman']:.3f} and sign agreement {row['sign_agreement']:.0%} "
                f"on {row['n_signal']} cells, slope {row['slope']:.2f}, relative error "
                f"{row['rel_error']:.0%}"
            )
    for kind in ("informative", "upstream"):
        tops = {m: r.top(2, kind) for m, r in (("integrated", ig), ("exact", ex))}
        print(
            f"top {kind}: "
            + "; ".join(
                f"{m} " + ", ".join(f"{lab} {v:+.2f}" for _, lab, v in t) for m, t in tops.items()
            )
        )


if __name__ == "__main__":
    main()

"""The demos behind ``extractive-lens demo`` / ``make demo``.

``run_world_demo`` (the default): the bundled world model is finetuned on 20 new facts
("Zoe Howard lives in" -> " Tokyo"); the demo reports the mean ranks of the facts and of their
implications ("The people in the city T3 is from speak" -> " Japanese") before and after,
computes linear, path-integrated and exact informative / upstream / downstream scores of every
head and MLP on the implications, compares the first two with the exact ones and writes an HTML
report.

``run_demo``: the same on a small randomly initialised model and 16 facts (no implications),
for a model-free smoke test.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from extractive_lens.backend.tokenizer import word_tokenizer  # noqa: F401  (notebooks import it from here)

CITIES = ["Tokyo", "Paris", "Berlin", "Cairo", "Moscow", "Mumbai", "Bangkok", "Lima"]


def score_and_compare(
    model: Any, diff: Any, batch: Any, what: str, echo: Callable[[str], None]
) -> tuple:
    """Linear, integrated and exact scores on ``batch``, each approximation compared with the
    exact scores, and a printed summary. Returns ``(results, comparisons)``."""
    import warnings

    from extractive_lens import causal_scores, compare, integrated_scores, linear_scores
    from extractive_lens.comparison import SIGNAL_FRACTION
    from extractive_lens.scoring.methods import method as entry

    with warnings.catch_warnings():  # the demo prints the additivity check itself
        warnings.simplefilter("ignore", UserWarning)
        lin = linear_scores(model, diff, batch)
    ig = integrated_scores(model, diff, batch)
    ex = causal_scores(model, diff, batch)
    cmps = [compare(lin, ex), compare(ig, ex)]
    for s in (lin, ig, ex):
        echo(f"\ntop 3 components by |{s.method} score| (whole component, mean over {what}):")
        for kind in s.kinds:
            echo(f"  {kind:<12} " + ", ".join(f"{lab} {v:+.3f}" for _, lab, v in s.top(3, kind)))
        echo(f"  ({entry(s.method).informative_totals})")
    for cmp in cmps:
        echo(
            f"\n{cmp.methods[0]} vs exact (per token; Spearman and sign agreement on the cells "
            f"where either is ≥ {SIGNAL_FRACTION:.0%} of the max |exact|):"
        )
        for r in cmp.rows:
            if r["part"] == "all":
                echo(
                    f"  {r['kind']:<12} pearson {r['pearson']:.3f}  spearman {r['spearman']:.3f}  "
                    f"sign agreement {r['sign_agreement']:.2f} ({r['n_signal']} of {r['n']} cells)  "
                    f"top-10 overlap {r['topk_overlap']:.2f}  slope {r['slope']:.2f}"
                )
    m = ig.metadata["integrated"]
    echo(
        f"\nintegrated: {m['steps']} {m['rule']} nodes per path; completeness error "
        + ", ".join(f"{k} {v:.2%}" for k, v in m["completeness"].items())
    )
    for line in what_to_trust(cmps, lin):
        echo(line)
    return [lin, ig, ex], cmps


def what_to_trust(comparisons: list[Any], linear: Any = None) -> list[str]:
    """The lines that close a printed comparison (the demo's, ``extractive-lens score``'s):
    each comparison's verdicts and the linear scores' additivity check."""
    notes = [v for cmp in comparisons for v in cmp.verdicts.values()]
    if linear is not None and linear.additivity_note():
        notes.append(linear.additivity_note())
    if not notes:
        return []
    return ["\nwhat to trust (docs/scores.md §11-§12):", *(f"  - {n}" for n in notes)]


def run_demo(
    out: Path = Path("report.html"), seed: int = 0, echo: Callable[[str], None] = print
) -> dict[str, Any]:
    import torch

    from extractive_lens import FinetuneConfig, finetune, make_batch, mean_rank, tiny_model
    from extractive_lens.batch import Pair
    from extractive_lens.plotting import report

    t0 = time.perf_counter()
    torch.manual_seed(seed)
    people = [f"P{i}" for i in range(16)]
    tok = word_tokenizer([*people, "lives", "in", *CITIES])
    model = tiny_model(
        dict(n_layers=4, d_model=128, n_heads=4, d_head=32, d_mlp=512, d_vocab=len(tok), n_ctx=16),
        seed=seed,
        tokenizer=tok,
    )
    g = torch.Generator().manual_seed(seed)
    home = [CITIES[int(i)] for i in torch.randint(0, len(CITIES), (len(people),), generator=g)]
    facts = [
        Pair(f"{p} lives in", f" {c}", template="{name} lives in", slots={"name": p})
        for p, c in zip(people, home)
    ]
    batch = make_batch(model, facts, candidates=[f" {c}" for c in CITIES])
    echo(
        f"model: {model.cfg.n_layers} layers, d_model {model.cfg.d_model}, {model.cfg.n_heads} heads "
        f"({sum(p.numel() for p in model.parameters()):,} parameters, random init)"
    )
    before = mean_rank(model, batch)
    diff = finetune(model, batch, FinetuneConfig(lr=1e-3, epochs=30, batch_size=8, seed=seed))
    after = mean_rank(model, batch, diff)
    echo(
        f"finetuned on {len(facts)} facts: mean rank of the answer among {len(CITIES)} cities "
        f"{before:.2f} -> {after:.2f} (chance {(len(CITIES) - 1) / 2:.1f})"
    )
    results, cmps = score_and_compare(model, diff, batch, "facts", echo)
    path = report(
        results, cmps, path=out, title="extractive_lens demo: 16 new facts in a small model"
    )
    echo(f"\nwrote {path} ({time.perf_counter() - t0:.1f} s)")
    lin, ig, ex = results
    return dict(before=before, after=after, linear=lin, integrated=ig, exact=ex,
                comparison=cmps[0], comparisons=cmps, path=path)  # fmt: skip


def run_world_demo(
    out: Path = Path("report.html"), seed: int = 0, echo: Callable[[str], None] = print
) -> dict[str, Any]:
    from extractive_lens import FinetuneConfig, finetune, mean_rank
    from extractive_lens.plotting import report
    from extractive_lens.world import FINETUNE, first_hop, load_world_model  # the default world's

    t0 = time.perf_counter()
    model = load_world_model()
    ds = first_hop()
    facts, impls = ds.batches(model)
    echo(
        f"world model: {model.cfg.n_layers} layers, d_model {model.cfg.d_model}, {model.cfg.n_heads} heads, "
        f"{sum(p.numel() for p in model.parameters()):,} parameters (loaded in {time.perf_counter() - t0:.1f} s)"
    )
    echo(
        f"finetuning on {len(facts)} new facts, e.g. {ds.facts[0].prompt!r} -> {ds.facts[0].answer!r}"
    )
    diff = finetune(model, facts, FinetuneConfig(**FINETUNE, seed=seed))
    losses = diff.metadata["losses"]
    echo(
        f"training loss {losses[0]:.3f} -> {losses[-1]:.4f} nats per answer ({len(losses)} epochs)"
    )
    rows = [
        ("facts", mean_rank(model, facts), mean_rank(model, facts, diff)),
        ("implications", mean_rank(model, impls), mean_rank(model, impls, diff)),
    ]
    echo(
        f"mean rank among {len(ds.fact_candidates)} candidates (chance {(len(ds.fact_candidates) - 1) / 2:.1f}):"
    )
    for name, before, after in rows:
        echo(f"  {name:<13} {before:5.2f} -> {after:5.2f}")
    echo(
        f"scoring the implications, e.g. {ds.implications[0].prompt!r} -> {ds.implications[0].answer!r}"
    )
    results, cmps = score_and_compare(model, diff, impls, "implications", echo)
    lin, ig, ex = results
    mlp = ex["informative"][:, ex.component_labels.index("MLP"), :].abs()
    at_name = [i for i, p in enumerate(ex.position_labels) if p.startswith("{name}")]
    echo(
        f"\nwhere the new facts are stored: {float(mlp[:, at_name].sum() / mlp.sum()):.0%} of the "
        f"MLPs' exact informative mass is at the person's name, {float(mlp[:, -1].sum() / mlp.sum()):.0%} "
        "at the last token (the paper: early MLPs at the entity)"
    )
    path = report(
        results, cmps, path=out, title="extractive_lens demo: the world model learns 20 new facts"
    )
    echo(f"\nwrote {path} ({time.perf_counter() - t0:.1f} s)")
    return dict(ranks=rows, linear=lin, integrated=ig, exact=ex, comparison=cmps[0],
                comparisons=cmps, path=path)  # fmt: skip

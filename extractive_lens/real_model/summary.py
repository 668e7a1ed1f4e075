"""What the real-model protocol prints and the one report it writes, from its ``results``.

``step_lines(step, results)``: a few readable lines per step (numbers with their intervals, no
raw JSON); ``write_report``: ``report.html`` with the trajectories, the controls, the score maps
and the verdicts (``plotting.report``).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from extractive_lens.real_model.analysis import SHARES

WAYS = {"whole": "whole answer", "per_token": "per token", "first_token": "first token"}


def ci(x: Mapping[str, Any], digits: int = 2) -> str:
    """``"8.70 [7.10, 10.20]"``: an ``analysis.interval`` as text."""
    return f"{x['estimate']:.{digits}f} [{x['low']:.{digits}f}, {x['high']:.{digits}f}]"


def pct(x: Mapping[str, Any]) -> str:
    """``"29% [18%, 41%]"``: a share's interval as text."""
    return f"{x['estimate']:.0%} [{x['low']:.0%}, {x['high']:.0%}]"


def spread(x: Mapping[str, Any]) -> str:
    """``"9.00 (8.85-9.35, 3 seeds)"``: the mean over seeds and their range."""
    n = len(x["per_seed"])
    if n == 1:
        return f"{x['mean']:.2f} (1 seed)"
    return f"{x['mean']:.2f} ({x['min']:.2f}-{x['max']:.2f}, {n} seeds)"


def _ranks(r: Mapping[str, Any]) -> list[str]:
    null = r["whole_null"]
    return [
        f"whole answer {ci(r['whole'])}, per token {ci(r['per_token'])}, first token "
        f"{ci(r['first_token'])}; chance {r['chance']:.1f}, answers permuted among the prompts "
        f"{null['mean']:.2f} [{null['low']:.2f}, {null['high']:.2f}] (p = {null['p_low']:.3f})"
    ]


def _trajectory(name: str, res: Mapping[str, Any]) -> list[str]:
    seeds = list(res["seeds"])
    first = res["seeds"][seeds[0]]
    loss = first["losses"]
    out = [
        f"{name}: {res['n']} facts, {len(loss)} epochs (seed {seeds[0]}), training loss "
        f"{loss[0]:.3f} -> {loss[-1]:.4f} nats per answer; mean ranks, 95% bootstrap interval "
        f"over {res['n']} prompts:"
    ]
    for split in first["after"]:
        out.append(f"  {split:<13} before: " + _ranks(first["before"][split])[0])
        out.append(f"  {'':<13} after:  " + _ranks(first["after"][split])[0])
    if len(seeds) > 1:
        for split, ways in res["spread"].items():
            out.append(
                f"  {split:<13} after, over seeds {','.join(seeds)}: "
                + ", ".join(f"{WAYS[w]} {spread(v)}" for w, v in ways.items())
            )
    return out


def _freezing(res: Mapping[str, Any]) -> list[str]:
    out = [
        f"layer freezing (early = blocks < {res['split_layer']} and the embeddings): mean rank "
        "over seeds (range), and the share of the learned improvement lost (None -> All):"
    ]
    for row in res["summary"]:
        lost, iv = row["lost"], row.get("learned")
        share = "" if lost["mean"] != lost["mean"] else f", loses {lost['mean']:.0%}"
        if share and len(lost["per_seed"]) > 1:
            share += f" ({lost['min']:.0%}-{lost['max']:.0%})"
        if row["condition"] == "All" and iv:
            share += f"; learned (All - None, first seed) {ci(iv)}" + (
                "" if iv["low"] > 0 else ": not above 0, no shares"
            )
        out.append(
            f"  {row['dataset']} {row['split']:<12} {row['condition']:<12} "
            f"{spread(row['mean_rank'])}{share}"
        )
    return out


def _scores(res: Mapping[str, Any]) -> list[str]:
    out = []
    for what in ("implications", "facts"):
        rows = res.get(f"{what}_linear_vs_causal")
        if rows is None:
            continue
        out.append(
            f"linear vs exact on {len(res['prompts'][what])} {what} (exact on the linear top-k): "
            + ", ".join(
                f"{r['kind']} r {r['pearson']:.2f} (sign {r['sign_agreement']:.2f}, "
                f"{r['n_signal']} cells)"
                for r in rows
            )
        )
        for verdict in res.get(f"{what}_linear_vs_causal_verdicts", []):
            out.append(f"  - {verdict}")
        m = res[f"mass_{what}"]["linear"]
        iv = res.get(f"mass_{what}_intervals")
        if iv is None:  # a run before the intervals: the estimates alone
            iv = {k: {s: dict(estimate=v[s], low=v[s], high=v[s]) for s in v if s in SHARES}
                  for k, v in (("all", m), ("prompt", res[f"mass_{what}_prompt_positions"]["linear"]))}  # fmt: skip
        a, p = iv["all"], iv["prompt"]
        out.append(
            f"  informative mass (linear; 95% bootstrap over the {len(res['prompts'][what])} "
            f"prompts): MLPs {pct(a['mlps'])}, answer tokens {pct(a['answer_tokens'])}, last "
            f"prompt token ({'/'.join(m['last_prompt_roles'])}) {pct(a['last_prompt_token'])}, "
            f"late layers there {pct(a['late_at_last_prompt_token'])}, early MLPs at the entity "
            f"{pct(a['early_mlp_at_entity'])}; on prompt tokens only: last prompt token "
            f"{pct(p['last_prompt_token'])}, early MLPs at the entity {pct(p['early_mlp_at_entity'])}"
        )
    return out


def step_lines(step: str, results: Mapping[str, Any]) -> list[str]:
    """The printed summary of one step of ``protocol.run`` (nothing for a step not run)."""
    if step not in results:
        return []
    res = results[step]
    if step == "passes":
        return [
            f"one forward of {res['prompts']} fact prompts ({res['tokens']} tokens): "
            f"{res['forward_s']:.2f} s, {res['forward_gflop']:.1f} GFLOP; with the backward "
            f"{res['forward_backward_s']:.2f} s"
        ]
    if step == "known_hop":
        return [
            f"known hop, base model ({res['template']!r}, {res['n']} cities): top-1 "
            f"{res['top1']}/{res['n']}, top-3 {res['top3']}/{res['n']}; mean rank "
            + _ranks(res["summary"])[0]
        ]
    if step in ("first_hop", "second_hop"):
        return _trajectory(step, res)
    if step == "freezing":
        return _freezing(res)
    if step == "scores":
        return _scores(res)
    if step == "lincorr":
        return [
            f"LinCorr City -> Country over {res['subjects']} subjects, {res['pairs']} pairs: "
            f"label r {res['label_pearson']:.2f}, instance r {res['instance_pearson']:.2f}, "
            f"precision {res['precision']:.2f} (chance {res['chance_precision']:.2f})"
        ]
    if step == "grafting":
        return [
            f"  {r['weights']:<28} {r['split']:<6} {r['mean_rank']:.2f}"
            for r in res["rows"]
            if {"weights", "split", "mean_rank"} <= set(r)
        ]
    return []


def lines(results: Mapping[str, Any]) -> list[str]:
    """Every step's lines, in the order the steps ran."""
    return [line for step in results.get("times", {}) for line in step_lines(step, results)]


def controls_figure(results: Mapping[str, Any]) -> Any:
    """The printed summary as a table figure (one row per line) for the report."""
    import plotly.graph_objects as go

    text = lines(results)
    fig = go.Figure(go.Table(header=dict(values=["the protocol's numbers"]),
                             cells=dict(values=[text], align="left")))  # fmt: skip
    fig.update_layout(height=max(300, 24 * len(text) + 80), width=1100)
    return fig


def write_report(path: Path, results: Mapping[str, Any], scored: Mapping[str, Any]) -> Path:
    """``report.html``: the summary's numbers, every step's figures and, when the scores step
    ran, the implications' maps by the three methods and the verdicts (the facts' maps, and
    both on prompt tokens only, as figures). Without the scores step: the figures alone
    (plotly.js from its CDN)."""
    from extractive_lens.plotting import overview, report
    from extractive_lens.real_model.analysis import prompt_positions

    title = "SmolLM2-135M: the paper's protocol"
    figures = [("the protocol's numbers and controls", controls_figure(results))]
    figures += list(results.get("_figures", []))
    if "implications" not in scored:
        html = "".join(
            f"<h2>{caption}</h2>" + fig.to_html(full_html=False, include_plotlyjs=i == 0 and "cdn")
            for i, (caption, fig) in enumerate(figures)
        )
        path.write_text(f"<html><head><meta charset='utf-8'><title>{title}</title></head>"
                        f"<body><h1>{title}</h1>{html}</body></html>", encoding="utf-8")  # fmt: skip
        return path
    scores, comparisons = scored["implications"]  # [linear, integrated, exact], vs exact
    linear = scores[0]
    figures.append(("implications, linear, prompt tokens only (no teacher-forced answer tokens)",
                    overview(prompt_positions(linear))))  # fmt: skip
    if "facts" in scored:
        facts = scored["facts"][0][0]
        figures.append(("facts, linear: where the memorised change acts", overview(facts)))
        figures.append(("facts, linear, prompt tokens only", overview(prompt_positions(facts))))
    return report(scores, comparisons, path=path, extra_figures=figures, title=title)

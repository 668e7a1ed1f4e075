"""The tables of docs/real-model.md's round-2 sections, from the runs' results.json files (and,
for the mass intervals, the scores they saved), printed as markdown: nothing is recomputed on
the model, only read off and bootstrapped over prompts (``extractive_lens.real_model.analysis``).

    python docs/real_model_numbers.py            # reads docs/real_model/round2/*/

The runs (one thread each, ``OMP_NUM_THREADS=1``; see the page for the commands):
``round2/seeds/`` (known hop, first hop and freezing, seeds 0,1,2), ``round2/demo/`` (``extractive-lens
demo --model smollm2``: known hop, first hop and scores, seed 0), ``round2/second_hop/`` (second
hop, seeds 0,1,2).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from extractive_lens.real_model import analysis as A
from extractive_lens.real_model.summary import ci, pct, spread

ROOT = Path(__file__).parent / "real_model" / "round2"
WAYS = ("whole", "per_token", "first_token")


def load(name: str) -> dict[str, Any] | None:
    path = ROOT / name / "results.json"
    return json.loads(path.read_text()) if path.is_file() else None


def null(r: dict[str, Any]) -> str:
    n = r["whole_null"]
    return f"{n['mean']:.2f} [{n['low']:.2f}, {n['high']:.2f}] (p = {n['p_low']:.3f})"


def ranks_row(label: str, r: dict[str, Any]) -> str:
    return f"| {label} | " + " | ".join(ci(r[w]) for w in WAYS) + f" | {null(r)} |"


def known_hop(res: dict[str, Any]) -> list[str]:
    k = res["known_hop"]
    return [
        "| | whole answer | per token | first token | answers permuted among prompts (p) |",
        "|---|---|---|---|---|",
        ranks_row(
            f"known hop, base model (top-1 {k['top1']}/{k['n']}, top-3 {k['top3']}/{k['n']})",
            k["summary"],
        ),  # fmt: skip
    ]


def hop(res: dict[str, Any], name: str) -> list[str]:
    h = res[name]
    seeds = list(h["seeds"])
    first = h["seeds"][seeds[0]]
    out = [
        f"{name}: {h['n']} facts, seed {seeds[0]}, chance {h['chance']['facts']:.1f}; training "
        f"loss {first['losses'][0]:.3f} -> {first['losses'][-1]:.4f} nats per answer",
        "",
        "| | whole answer | per token | first token | answers permuted among prompts (p) |",
        "|---|---|---|---|---|",
    ]
    for split in ("facts", "implications"):
        out.append(ranks_row(f"{split}, before", first["before"][split]))
        out.append(
            ranks_row(f"{split}, after {len(first['losses'])} epochs", first["after"][split])
        )
    if len(seeds) > 1:
        out += ["", f"After, over seeds {', '.join(seeds)} (mean, range):", ""]
        out += ["| | whole answer | per token | first token |", "|---|---|---|---|"]
        for split, ways in h["spread"].items():
            out.append(f"| {split} | " + " | ".join(spread(ways[w]) for w in WAYS) + " |")
        losses = [h["seeds"][s]["losses"][-1] for s in seeds]
        out.append(f"\nlast-epoch training loss per seed: {', '.join(f'{x:.4f}' for x in losses)}")
    return out


def freezing(res: dict[str, Any]) -> list[str]:
    f = res["freezing"]
    per_seed = {s: v["rows"] for s, v in f["seeds"].items()}
    summary = A.freezing_summary(per_seed)  # the current analysis, on the saved rows
    out = [
        f"early = blocks < {f['split_layer']} and the embeddings; {len(per_seed)} seeds; mean "
        "rank over seeds (range), seed 0's 95% bootstrap interval over prompts, share of the "
        "learned improvement lost (range over seeds)",
        "",
        "| condition | split | mean rank over seeds | seed 0, interval | share lost |",
        "|---|---|---|---|---|",
    ]
    for row in summary:
        lost = row["lost"]
        share = "—" if lost["mean"] != lost["mean"] else (
            f"{lost['mean']:.0%} ({lost['min']:.0%}–{lost['max']:.0%})")  # fmt: skip
        out.append(f"| {row['condition']} | {row['split']} | {spread(row['mean_rank'])} | "
                   f"{ci(row['interval'])} | {share} |")  # fmt: skip
    out.append("")
    for row in summary:
        if row["condition"] == "All" and row["learned"]:
            out.append(f"learned improvement (All − None, seed 0), {row['split']}: "
                       f"{ci(row['learned'])}")  # fmt: skip
    return out


def scores(res: dict[str, Any], folder: Path) -> list[str]:
    from extractive_lens import ComponentScores, compare

    s = res["scores"]
    out = []
    for what in ("implications", "facts"):
        n = len(s["prompts"][what])
        out += [f"\n{what} ({n} prompts): method agreement on the linear top-k (all parts)", ""]
        out += [
            "| | kind | r | slope | relative error | signal cells |",
            "|---|---|---|---|---|---|",
        ]
        lin = ComponentScores.load(folder / f"scores_{what}_linear")
        ex = ComponentScores.load(folder / f"scores_{what}_causal")
        ig = ComponentScores.load(folder / f"scores_{what}_integrated")
        for name, a in (("linear vs exact", lin), ("integrated vs exact", ig)):
            cmp = compare(a, ex)
            t = cmp.ci(statistics_=("pearson", "slope", "rel_error"))
            t = t[t["part"] == "all"].set_index(["kind", "statistic"])
            for r in cmp.rows:
                if r["part"] != "all":
                    continue
                cells = [t.loc[(r["kind"], stat)] for stat in ("pearson", "slope", "rel_error")]
                out.append(f"| {name} | {r['kind']} | " + " | ".join(
                    f"{c['estimate']:.2f} [{c['low']:.2f}, {c['high']:.2f}]" for c in cells)
                    + f" | {r['n_signal']} |")  # fmt: skip
        m = A.mass(lin)
        for label, sc in (("every position", lin), ("prompt tokens only", A.prompt_positions(lin))):
            iv = A.mass_intervals(sc)
            out.append(
                f"\nmass ({what}, linear, {label}; last prompt token "
                f"{'/'.join(m['last_prompt_roles'])}): "
                + ", ".join(f"{k} {pct(v)}" for k, v in iv.items())
            )
        for method in ("causal", "integrated"):
            mm = s[f"mass_{what}"][method]
            out.append(f"  {method} (top-k only): late at last prompt token "
                       f"{mm['late_at_last_prompt_token']:.1%}, early MLPs at entity "
                       f"{mm['early_mlp_at_entity']:.1%}, answer tokens {mm['answer_tokens']:.1%}")  # fmt: skip
    return out


def main() -> None:
    runs = {name: load(name) for name in ("seeds", "demo", "second_hop")}
    lines: list[str] = []
    if (r := runs["seeds"]) is not None:
        lines += ["## known hop (round2/seeds)", *known_hop(r), "", "## first hop (round2/seeds)"]
        lines += [*hop(r, "first_hop"), "", "## freezing (round2/seeds)", *freezing(r)]
    if (r := runs["second_hop"]) is not None:
        lines += ["", "## second hop (round2/second_hop)", *hop(r, "second_hop")]
    if (r := runs["demo"]) is not None:
        lines += ["", "## demo: known hop, first hop (seed 0), scores (round2/demo)", *known_hop(r)]
        lines += [*hop(r, "first_hop")]
        if "scores" in r:
            lines += scores(r, ROOT / "demo")
        t = r["times"]
        lines += ["", "| step | CPU s | wall s | peak resident so far (GiB) |", "|---|---|---|---|"]
        lines += [f"| {k} | {v['cpu_s']:.1f} | {v['wall_s']:.1f} | {v['peak_rss_gib_so_far']:.2f} |"
                  for k, v in t.items()]  # fmt: skip
    sys.stdout.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()

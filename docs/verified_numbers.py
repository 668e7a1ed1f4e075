"""The numbers of docs/benchmarks.md's "Verified maps" section, on the bundled world model.

    python docs/verified_numbers.py            # writes docs/verified/world.json (and the full exact map)

The world model finetuned on its 20 first-hop facts (the demo's Δ), scored on the implications:
linear and the full exact map of every component (per token, computed once and saved under
docs/verified/world_exact), then ``verified_scores`` at a budget of 3x linear's passes, its
estimates against the full map's values, and a planted disagreement (the MLP with the largest
exact downstream mass, its linear score zeroed) and whether the audit finds it.
"""

from __future__ import annotations

import dataclasses
import json
import time
import warnings
from pathlib import Path

import torch

import extractive_lens as el
from extractive_lens.scoring.counting import counting_passes
from extractive_lens.types import SCORE_KINDS
from extractive_lens.world import FINETUNE, first_hop, load_world_model

HERE = Path(__file__).resolve().parent / "verified"


def timed(fn, repeats=1):
    best = None
    for _ in range(repeats):
        t = time.perf_counter()
        out = fn()
        s = time.perf_counter() - t
        best = s if best is None else min(best, s)
    return out, best


def main() -> None:
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    model = load_world_model()
    facts, impls = first_hop().batches(model)
    diff = el.finetune(model, facts, el.FinetuneConfig(**FINETUNE, seed=0))
    lin, t_lin = timed(lambda: el.linear_scores(model, diff, impls), repeats=3)
    with counting_passes(model, impls) as count:
        el.linear_scores(model, diff, impls)
    p_lin = count.passes
    full, t_exact = timed(lambda: el.causal_scores(model, diff, impls))
    full.save(HERE / "world_exact")
    cmp = el.compare(lin, full)
    rows = {r["kind"]: r for r in cmp.rows if r["part"] == "all"}
    with counting_passes(model, impls) as count:
        el.causal_scores(model, diff, impls)
    out = dict(model="world v3", prompts=len(impls), components=20, linear_s=t_lin,
               full_exact_s=t_exact, linear_passes=p_lin, full_exact_passes=count.passes,
               runs=[])  # fmt: skip
    for seed in (0, 1, 2):
        v, t_v = timed(lambda: el.verified_scores(model, diff, impls, budget=3.0, seed=seed,
                                                  linear=lin, linear_passes=p_lin))  # fmt: skip
        meta = v.metadata["verified"]
        run = dict(seed=seed, seconds=t_v, ratio_to_linear=(t_v + t_lin) / t_lin,
                   passes=meta["spent"], passes_ratio=meta["spent"] / p_lin,
                   allowed=meta["allowed"], over_budget=meta["over_budget"],
                   least=p_lin + sum(p["least_cost"] for p in meta["kinds"].values()),
                   kinds={})  # fmt: skip
        for kind in v.kinds:
            plan = v.metadata["verified"]["kinds"][kind]
            e = plan["estimates"]
            ex = full.values[full.kind_index(kind)].abs().double()
            outside = ex.flatten(0, 1).sum(-1)
            outside[plan["top"]] = 0
            truth = dict(r=rows[kind]["pearson"], slope=rows[kind]["slope"],
                         missed_mass=float(outside.sum() / ex.sum()))  # fmt: skip
            run["kinds"][kind] = dict(
                exact_components=len(plan["top"]) + len(plan["audited"]),
                top=len(plan["top"]), audited=len(plan["audited"]),
                integrated=len(plan["integrated"]), estimates=e, full_map=truth,
                contains={k: e[k][1] <= truth[k] <= e[k][2] for k in truth},
                verdict=plan["verdict"],
            )  # fmt: skip
        out["runs"].append(run)
    # a planted disagreement: the MLP with the largest exact downstream mass, linear zeroed
    k = lin.kind_index("downstream")
    layer = int(full.totals[k][:, -1].abs().argmax())
    values, pv = lin.values.clone(), lin.prompt_values.clone()
    values[k, layer, -1], pv[k, :, layer, -1] = 0.0, 0.0
    zeroed = dataclasses.replace(lin, values=values, prompt_values=pv)
    v = el.verified_scores(model, diff, impls, budget=3.0, seed=0, linear=zeroed,
                           linear_passes=p_lin)  # fmt: skip
    plan = v.metadata["verified"]["kinds"]["downstream"]
    c = layer * 5 + 4
    out["planted"] = dict(component=f"L{layer}MLP", kind="downstream",
                          in_top=c in plan["top"], audited=c in plan["audited"],
                          found=c in plan["disagreeing"], verdict=plan["verdict"])  # fmt: skip
    HERE.mkdir(exist_ok=True)
    (HERE / "world.json").write_text(json.dumps(out, indent=1))
    print(json.dumps(out, indent=1))


# --------------------------------------------------------------------------- SmolLM2-135M

SMOL = Path("/tmp/smol/full")
"""Where the SmolLM2 maps go (too large for git: Δ alone is 0.5 GB): ``diff.safetensors``,
``<what>_<method>`` (``ComponentScores.save``), ``<what>_causal_L<layer>`` (the exact map a
layer at a time, merged into ``<what>_causal``; integrated the same), ``times.json`` and
``READY``. ``python docs/verified_numbers.py --model smollm2`` (in a heavy-run slot, again until
``READY`` appears) makes them."""
SETS = ("implications", "facts")


def smol_setup(out: Path) -> tuple:
    """SmolLM2-135M, the protocol's first-hop data and its seed-0 Δ (finetuned once, saved)."""
    from extractive_lens.datasets.twohop import first_hop as smol_first_hop
    from extractive_lens.real_model.protocol import FINETUNE as SMOL_FINETUNE
    from extractive_lens.real_model.protocol import scored_sets

    torch.manual_seed(0)  # as protocol.run
    model = el.load_pretrained("smollm2-135m")
    ds = smol_first_hop(n=20)
    facts, impls = ds.batches(model)
    path = out / "diff.safetensors"
    if path.exists():
        diff = el.WeightDiff.load(path)
    else:
        t, c = time.perf_counter(), time.process_time()
        diff = el.finetune(model, facts, el.FinetuneConfig(**SMOL_FINETUNE))
        record(out, "finetune", time.perf_counter() - t, time.process_time() - c)
        diff.save(path)
    return model, diff, scored_sets(facts, impls, range(4))


def times() -> dict:
    path = SMOL / "times.json"
    return json.loads(path.read_text()) if path.exists() else {}


def smol_verified(model, diff, sub, ref, name: str, tag: str, kinds: tuple = ()):
    """``verified_scores`` at 3x linear's passes with the saved linear map (its passes as
    counted); ``planted``: seed 0 with one component's linear downstream scores zeroed (the
    MLP with the largest exact downstream mass where the full map exists, else the component
    with the largest exact downstream mass among those seed 0 audited); ``_cov<c>_s<n>``: seed n
    at coverage c (a top set small enough for the budget to hold the audit)."""
    of = "_".join(("linear", *kinds))
    lin = el.ComponentScores.load(SMOL / f"{name}_{of}")
    passes = times()[f"{name}_{of}"]["passes"]
    seed = 0 if tag.endswith("planted") else int(tag[-1])
    if tag.endswith("planted"):
        k = lin.kind_index("downstream")
        n = len(lin.component_labels)
        if (SMOL / f"{name}_causal" / "scores.json").exists():  # the full map's largest MLP
            full = el.ComponentScores.load(SMOL / f"{name}_causal")
            layer, comp = int(full.totals[k][:, -1].abs().argmax()), n - 1
        else:  # seed 0's largest exact component among those it audited (outside its top set)
            s0 = el.ComponentScores.load(SMOL / tag.replace("planted", "s0"))
            audited = s0.metadata["verified"]["kinds"]["downstream"]["audited"]
            layer, comp = divmod(
                max(audited, key=lambda c: float(s0.totals[k].flatten()[c].abs())), n
            )
        values, pv = lin.values.clone(), lin.prompt_values.clone()
        values[k, layer, comp], pv[k, :, layer, comp] = 0.0, 0.0
        lin = dataclasses.replace(lin, values=values, prompt_values=pv)
        lin.metadata["planted"] = [layer, comp]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        coverage = float(tag.split("_cov")[1].split("_")[0]) if "_cov" in tag else 0.8
        v = el.verified_scores(model, diff, sub, reference=ref, budget=3.0, seed=seed,
                               linear=lin, linear_passes=passes, kinds=kinds or SCORE_KINDS,
                               coverage=coverage)  # fmt: skip
    v.metadata["planted"] = lin.metadata.get("planted")
    return v


def record(out: Path, name: str, wall: float, cpu: float, **more: object) -> None:
    """One line of ``times.json``: wall and CPU seconds of a stage (and what else it says)."""
    path = out / "times.json"
    times = json.loads(path.read_text()) if path.exists() else {}
    times[name] = dict(wall_s=wall, cpu_s=cpu, **more)
    path.write_text(json.dumps(times, indent=1))
    print(name, json.dumps(times[name]), flush=True)


def smol_work(minutes: float, nodes: int, kinds: tuple = ()) -> None:
    """One heavy-run job, resumable: what is not yet saved under ``SMOL``, in this order,
    starting nothing it does not expect to end within ``minutes`` (each layer's time predicted
    from the last one's, by the layers after it): linear on both sets; per set the exact map
    one layer at a time (the last layer first), merged; per set ``verified_scores`` at 3x
    linear's passes (seed 0 and a planted disagreement on each set, then seeds 0-2 at coverage
    0.05, then seeds 1 and 2); then integrated on
    each set in one call (its layer-major pass runs every path whatever ``layers=`` keeps);
    each piece saved as it ends, with its seconds and passes (``times.json``). When every
    piece is there, the maps merged and ``READY`` written. Run it again until ``READY``."""
    SMOL.mkdir(parents=True, exist_ok=True)
    began = time.perf_counter()
    model, diff, sets = smol_setup(SMOL)
    n_layers = model.cfg.n_layers
    last: dict[str, float] = {}  # method -> seconds per unit of depth, from the last piece

    def run(name: str, tag: str, method: str, layer: int | None) -> None:
        sub, ref = sets[name]
        depth = 1.0 if layer is None else (n_layers - layer) / n_layers
        guess = last.get(method, 0.0) * depth
        if method == "verified":  # the last verified run's time, or 10x linear's (a prior)
            of = "_".join(("linear", *kinds))
            guess = last.get("verified", 10 * times()[f"{name}_{of}"]["wall_s"])
        if time.perf_counter() - began + guess > 60 * minutes:
            raise TimeoutError(f"{name} {tag}: {guess:.0f} s predicted, not started")
        t, c = time.perf_counter(), time.process_time()
        with counting_passes(model, sub) as count:
            if method == "linear":
                s = el.linear_scores(model, diff, sub, reference=ref, kinds=kinds or SCORE_KINDS)
            elif method == "causal":
                s = el.causal_scores(model, diff, sub, reference=ref, kinds=kinds or SCORE_KINDS,
                                     layers=None if layer is None else [layer])  # fmt: skip
            elif method == "integrated":
                s = el.integrated_scores(model, diff, sub, reference=ref, steps=nodes)
            else:
                s = smol_verified(model, diff, sub, ref, name, f"{name}_{tag}", kinds)
        wall, cpu = time.perf_counter() - t, time.process_time() - c
        last[method] = wall / depth
        s.save(SMOL / f"{name}_{tag}")
        record(SMOL, f"{name}_{tag}", wall, cpu, prompts=len(sub), passes=count.passes,
               forward=count.forward, backward=count.backward)  # fmt: skip

    layers = list(reversed(range(n_layers)))
    suffix = "".join(f"_{k}" for k in kinds)  # these kinds alone (all: "")
    pieces = [(name, f"linear{suffix}", "linear", None) for name in SETS]
    if kinds:  # the implications' exact map of these kinds (one call), then verified of them
        pieces = [("implications", f"causal{suffix}", "causal", None), pieces[0]]
        pieces += [("implications", f"verified{suffix}_{v}", "verified", None)
                   for v in ("s1", "s2", "s0")]  # fmt: skip
    for name in SETS if not kinds else ():  # the full exact maps first (the comparisons
        # read them), then verified against them (what it spends is measured)
        pieces += [(name, f"causal_L{layer:02d}", "causal", layer) for layer in layers]
        pieces += [(name, "merge", "merge", None)]
    for runs in (("s0", "planted"), ("cov0.05_s0", "cov0.05_s1", "cov0.05_s2"), ("s1", "s2")):
        pieces += [(name, f"verified{suffix}_{v}", "verified", None)
                   for name in (SETS if not kinds else ()) for v in runs]  # fmt: skip
    pieces += [(name, "integrated", "integrated", None) for name in SETS]  # one call: its
    # layer-major pass runs every path whatever layers= keeps
    pieces += [(name, "merge", "merge", None) for name in SETS]
    try:
        for name, tag, method, layer in pieces:
            if method == "merge":
                smol_merge()
            elif not (SMOL / f"{name}_{tag}" / "scores.json").exists():
                run(name, tag, method, layer)
    except TimeoutError as e:
        print("stopped:", e, flush=True)
        return
    smol_merge()


def smol_merge() -> None:
    """The exact (and integrated) maps' layer slices as one map per set (where every layer is
    there), then ``READY`` (when both sets' three maps are)."""
    for name in SETS:
        for method in ("causal", "integrated"):
            parts = sorted(SMOL.glob(f"{name}_{method}_L*"))  # one layer each
            if not parts:
                continue
            loaded = [el.ComponentScores.load(p) for p in parts]
            first = loaded[0]
            out = [t.clone() for t in (first.values, first.totals, first.prompt_values,
                                       first.prompt_totals)]  # fmt: skip
            covered: list[int] = []
            for s in loaded:
                ls = s.metadata["layers"]
                covered += ls
                out[0][:, ls], out[1][:, ls] = s.values[:, ls], s.totals[:, ls]
                out[2][:, :, ls] = s.prompt_values[:, :, ls]
                out[3][:, :, ls] = s.prompt_totals[:, :, ls]
            if sorted(covered) != list(range(first.totals.shape[1])):
                continue  # not every layer yet
            meta = {**first.metadata, "layers": None, "skipped": None,
                    "merged_from": [p.name for p in parts]}  # fmt: skip
            full = dataclasses.replace(first, values=out[0], totals=out[1], prompt_values=out[2],
                                       prompt_totals=out[3], metadata=meta)  # fmt: skip
            assert torch.isfinite(full.totals).all(), f"{name} {method}: cells left uncomputed"
            full.save(SMOL / f"{name}_{method}")
    maps = [
        SMOL / f"{n}_{m}" / "scores.json" for n in SETS for m in ("linear", "causal", "integrated")
    ]
    if all(p.exists() for p in maps):
        (SMOL / "READY").write_text(
            "diff.safetensors; <set>_linear, <set>_causal, <set>_integrated\n"
        )


def smol_estimate() -> dict:
    """``docs/verified/smollm2_estimate.json``: ``el.estimate``'s passes (counted on a narrow
    copy of SmolLM2-135M, extrapolated in depth) of linear, the full exact map, integrated (the
    protocol's 2 nodes) and verified at 3x on each scored set, before any of them runs. Δ is
    taken as zeros of the model's shape: passes do not depend on its values."""
    from extractive_lens.datasets.twohop import first_hop as smol_first_hop
    from extractive_lens.real_model.protocol import scored_sets

    model = el.load_pretrained("smollm2-135m")
    facts, impls = smol_first_hop(n=20).batches(model)
    diff = el.WeightDiff.zeros_like(model)
    out: dict = {}
    for name, (sub, _) in scored_sets(facts, impls, range(4)).items():
        for method, kw in (("linear", {}), ("causal", {}), ("integrated", {"steps": 2}),
                           ("verified", {"budget": 3.0})):  # fmt: skip
            e = el.estimate(model, diff, sub, method, **kw)
            out[f"{name}_{method}"] = dict(forward=e.batch_passes[0], backward=e.batch_passes[1],
                                           passes=sum(e.batch_passes), n_pos=sub.n_pos)  # fmt: skip
    (HERE / "smollm2_estimate.json").write_text(json.dumps(out, indent=1))
    return out


def smol_summary() -> dict:
    """``docs/verified/smollm2.json``: the times and passes of every piece, and per set what
    exists of: linear (and integrated) against the full exact map (``compare``, with intervals;
    the map of one kind where only that kind's was computed), each verified run's estimates
    against the full map's values where that kind's map exists, the planted disagreement."""

    def loaded(path: Path):
        return el.ComponentScores.load(path) if (path / "scores.json").exists() else None

    summary: dict = {"times": times(), "sets": {}}
    for name in SETS:
        got: dict = {}
        lin = loaded(SMOL / f"{name}_linear")
        if lin is None:
            continue
        fulls = {kind: loaded(SMOL / f"{name}_causal") or loaded(SMOL / f"{name}_causal_{kind}")
                 for kind in SCORE_KINDS}  # fmt: skip
        for kind, full in fulls.items():
            if full is None:
                continue
            for other in ("linear", "integrated"):
                mine = loaded(SMOL / f"{name}_{other}")
                if mine is None:
                    continue
                cmp = el.compare(mine, full)
                ci = cmp.ci(n_boot=1000, seed=0, statistics_=("pearson", "slope"))
                got.setdefault(f"{other}_vs_exact", []).extend(
                    {**{k: r[k] for k in ("kind", "part", "pearson", "slope", "n")},
                     **{f"{s.statistic}_interval": [s.low, s.high] for s in ci.itertuples()
                        if (s.kind, s.part) == (r["kind"], r["part"])}}
                    for r in cmp.rows if r["kind"] == kind
                )  # fmt: skip
        runs = sorted(
            p.name for p in SMOL.glob(f"{name}_verified*") if (p / "scores.json").exists()
        )
        for run in runs:
            v = el.ComponentScores.load(SMOL / run)
            meta = v.metadata["verified"]
            out: dict = dict(spent=meta["spent"], allowed=meta["allowed"],
                             over_budget=meta["over_budget"], linear=meta["linear_cost"],
                             seed=meta["seed"], kinds={})  # fmt: skip
            for kind, plan in meta["kinds"].items():
                row = dict(top=len(plan["top"]), audited=len(plan["audited"]),
                           integrated=len(plan["integrated"]), estimates=plan["estimates"],
                           verdict=plan["verdict"], spent=plan["spent"],
                           coverage=plan["coverage"])  # fmt: skip
                full = fulls[kind]
                if full is not None:
                    rows = {r["kind"]: r for r in el.compare(lin, full).rows if r["part"] == "all"}
                    ex = full.values[full.kind_index(kind)].abs().double()
                    outside = ex.flatten(0, 1).sum(-1)
                    outside[plan["top"]] = 0
                    truth = dict(r=rows[kind]["pearson"], slope=rows[kind]["slope"],
                                 missed_mass=float(outside.sum() / ex.sum()))  # fmt: skip
                    e = plan["estimates"]
                    row["full_map"] = truth
                    row["contains"] = {k: e[k][1] <= truth[k] <= e[k][2] for k in truth}
                out["kinds"][kind] = row
            if v.metadata.get("planted"):
                layer, comp = v.metadata["planted"]
                c = layer * len(v.component_labels) + comp
                plan = meta["kinds"]["downstream"]
                out["planted"] = dict(component=f"L{layer}{v.component_labels[comp]}",
                                      in_top=c in plan["top"], audited=c in plan["audited"],
                                      found=c in plan["disagreeing"])  # fmt: skip
            got[run] = out
        summary["sets"][name] = got
    (HERE / "smollm2.json").write_text(json.dumps(summary, indent=1, default=str))
    return summary


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--model", choices=("world", "smollm2"), default="world")
    ap.add_argument("--minutes", type=float, default=18.0, help="smollm2: one job's length")
    ap.add_argument("--summary", action="store_true", help="smollm2: docs/verified/smollm2.json")
    ap.add_argument("--estimate", action="store_true", help="smollm2: el.estimate's passes")
    ap.add_argument("--kinds", default="", help="smollm2: verified of these kinds alone first")
    ap.add_argument("--nodes", type=int, default=2, help="integrated: nodes (the protocol's: 2)")
    a = ap.parse_args()
    torch.set_num_threads(1)
    if a.model == "world":
        main()
    else:
        if a.estimate:
            smol_estimate()
        elif a.summary:
            smol_summary()
        else:
            smol_work(a.minutes, a.nodes, tuple(a.kinds.split(",")) if a.kinds else ())

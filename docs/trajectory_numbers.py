"""Measure the numbers and figures of docs/trajectory.md: scores along the finetuning trajectory.

The bundled world model, every phase in one process (a minute)::

    python docs/trajectory_numbers.py --model world --out docs/trajectory/world all

SmolLM2-135M, in processes of at most ``--budget`` minutes each (15; one CPU thread), the
checkpoints and each unit's results in ``--folder`` (8 float32 checkpoints: 5.2 GB)::

    F=/tmp/trajectory-smollm2; O=docs/trajectory/smollm2; S="--model smollm2 --out $O --folder $F"
    python docs/trajectory_numbers.py $S rest      # the finetune: 8 epochs, a checkpoint after each
    python docs/trajectory_numbers.py $S rest      # linear maps, segments, the straight line ...
    python docs/trajectory_numbers.py $S rest      # ... until it prints "nothing left"
    python docs/trajectory_numbers.py $S more      # the worst segment with 8 and 16 nodes,
                                                   # the exact map of D_8 (optional)
    python docs/trajectory_numbers.py $S figures   # results.json, the figures

Finetune on the first-hop facts with the model's own recipe (the world's ``finetune_recipes``,
SmolLM2's ``real_model.FINETUNE``, as ``real_model.protocol`` runs it: nothing tuned here),
keeping a checkpoint after every epoch; the mean rank of facts and implications at every
epoch; on the facts (the first ``--prompts``), the linear informative map of ``D_k`` at every
checkpoint, the informative score integrated along the training trajectory (default nodes;
``--nodes`` to see how the completeness error falls with more) and along the straight line
``W_0 → W_T``; which layers take up the change first; the time per checkpoint and the peak
resident memory of each phase (``ru_maxrss``, the number ``/usr/bin/time -v`` prints). Writes
``results.json`` and the figures (``.png``) into ``--out``; the interactive pages (``.html``,
plotly from its CDN) beside them, out of git.
"""

from __future__ import annotations

import argparse
import functools
import json
import resource
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

PHASES = ("finetune", "linear", "integral", "straight", "exact", "figures")
"""What ``all`` runs, in this order (``rest``: what is not done yet, within ``--budget``)."""


def peak_gib() -> float:
    """This process's peak resident memory so far (GiB; Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def status_gib(field: str) -> float | None:
    """``VmHWM`` (the peak resident memory since the last ``reset_peak``) or ``VmRSS`` (now)
    from ``/proc/self/status``, in GiB (``None`` off Linux)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return None


def reset_peak() -> None:
    """Start ``VmHWM`` again from the memory resident now (Linux: ``clear_refs`` 5), so a
    phase's peak is read apart from the model's loading."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def span(text: str | None, last: int) -> list[int]:
    """``"1-4"`` → ``[1, 2, 3, 4]``, ``"8"`` → ``[8]``, ``None`` → ``1 … last``."""
    if text is None:
        return list(range(1, last + 1))
    lo, _, hi = text.partition("-")
    return list(range(int(lo), int(hi or lo) + 1))


def first_takers(cumulative: Any) -> dict[str, float | None]:
    """Per layer: the first epoch by which its cumulative share reached half of its final one
    (``None`` where the final share is not positive)."""
    out: dict[str, float | None] = {}
    for layer in cumulative.columns:
        col = cumulative[layer]
        final = float(col.iloc[-1])
        hit = [e for e, v in col.items() if final > 0 and v >= 0.5 * final]
        out[layer] = float(hit[0]) if hit else None
    return out


class Run:
    """The model, its data (loaded on first use: ``figures`` needs neither) and where each
    phase's results go."""

    def __init__(self, a: argparse.Namespace) -> None:
        self.folder: Path = a.folder
        self.parts = a.folder / "parts"
        self.parts.mkdir(parents=True, exist_ok=True)
        self.out: Path = a.out
        self.a = a
        self.loaded_rss: float | None = None  # resident memory once the model is loaded

    @functools.cached_property
    def loaded(self) -> tuple[Any, dict[str, Any], Any, Any]:
        """The model, the finetune's recipe, the facts and the implications."""
        import extractive_lens as el

        if self.a.model == "world":
            from extractive_lens.world import (
                finetune_recipes,
                first_hop,
                load_world_model,
                world_of,
            )

            model = load_world_model()
            ds = first_hop(world_of(model))
            recipe = dict(finetune_recipes(world_of(model).version)[0], seed=0)
        else:
            from extractive_lens.datasets.twohop import first_hop as real_first_hop
            from extractive_lens.real_model import FINETUNE

            model = el.load_pretrained("smollm2-135m")
            ds = real_first_hop(n=20)  # the protocol's first hop: 20 facts
            recipe = dict(FINETUNE)  # Adam, lr 1e-4, 8 epochs, batch 8, seed 0, float32 Δ
        batches = ds.batches(model)
        self.loaded_rss = status_gib("VmRSS")
        reset_peak()  # what follows peaks apart from the loading
        return (model, recipe, *batches)

    @property
    def model(self) -> Any:
        return self.loaded[0]

    @property
    def recipe(self) -> dict[str, Any]:
        return self.loaded[1]

    @property
    def facts(self) -> Any:
        return self.loaded[2]

    @property
    def impls(self) -> Any:
        return self.loaded[3]

    @property
    def batch(self) -> Any:
        """The facts scored: the first ``--prompts`` (default: all 20 on the world model, the
        first 4 on SmolLM2, whose 8 checkpoints then score within one 15-minute CPU job)."""
        n = (
            self.a.prompts
            if self.a.prompts is not None
            else (4 if self.a.model == "smollm2" else None)
        )
        return self.facts if n is None else self.facts.subset(range(n))

    @property
    def trajectory(self) -> Any:
        import extractive_lens as el

        return el.Trajectory.load(self.folder / "run")

    def holds_units(self) -> bool:
        """Whether this process may run ``rest``'s units: no other process is running them
        (a lock on ``parts/units.lock``, held until this process ends)."""
        import fcntl

        self._lock = open(self.parts / "units.lock", "w")  # noqa: SIM115  (held to the end)
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        return True

    def note(self, name: str, record: dict[str, Any]) -> None:
        """One phase's numbers, into ``parts/<name>.json`` (and printed)."""
        record = {**record, "peak_rss_gib": peak_gib(), "prompts": len(self.batch),
                  "peak_since_load_gib": status_gib("VmHWM"), "rss_gib": status_gib("VmRSS"),
                  "loaded_rss_gib": self.loaded_rss,
                  "recipe": self.recipe}  # fmt: skip
        (self.parts / f"{name}.json").write_text(json.dumps(record, indent=1, default=str))
        print(name, json.dumps(record, default=str)[:2000])

    def read(self, name: str) -> dict[str, Any]:
        return json.loads((self.parts / f"{name}.json").read_text())


def finetune(r: Run) -> None:
    """Finetune with a checkpoint after every epoch; the mean ranks before and after each epoch,
    evaluated in place (``on_epoch``, as the protocol does)."""
    import extractive_lens as el

    splits = {"facts": r.facts, "implications": r.impls}
    ranks = [dict(epoch=0, split=s, mean_rank=el.mean_rank(r.model, b)) for s, b in splits.items()]

    def record(epoch: int) -> None:
        ranks.extend(dict(epoch=epoch + 1, split=s, mean_rank=el.mean_rank(r.model, b))
                     for s, b in splits.items())  # fmt: skip

    t = time.perf_counter()
    diff = el.finetune(r.model, r.facts, el.FinetuneConfig(**r.recipe), keep="epochs",
                       trajectory=r.folder / "run", on_epoch=record)  # fmt: skip
    r.note("finetune", {"ranks": ranks, "losses": diff.metadata["losses"],
                        "seconds": time.perf_counter() - t})  # fmt: skip


def linear(r: Run) -> None:
    """The linear informative map of ``D_k`` at each checkpoint of ``--at``."""
    for k in span(r.a.at, len(r.trajectory)):
        map_at(r, k, "linear")


def map_at(r: Run, k: int, name: str = "linear") -> None:
    """The informative map of ``D_k`` by ``name`` ("linear", or "exact": ``causal_scores``),
    saved as the part ``{name}-{k}``."""
    import extractive_lens as el

    t = time.perf_counter()
    method = {"linear": "linear", "exact": "causal"}[name]
    maps = el.trajectory_scores(r.model, r.trajectory, r.batch, method=method,
                                kinds="informative", checkpoints=[k])  # fmt: skip
    maps.scores[0].save(r.parts / f"{name}-{k}.safetensors")
    r.note(f"{name}-{k}", {"seconds": time.perf_counter() - t})


def exact(r: Run) -> None:
    """The exact informative map of ``D_k`` (``causal_scores``) at each checkpoint of ``--at``."""
    for k in span(r.a.at, len(r.trajectory)):
        map_at(r, k, "exact")


def integral(r: Run) -> None:
    """The trajectory integral on each segment of ``--at`` (``--nodes`` per segment), one part
    per segment."""
    for k in span(r.a.at, len(r.trajectory)):
        segment(r, k)


def segment(r: Run, k: int, nodes: int | None = None) -> None:
    import extractive_lens as el

    n = nodes or r.a.nodes
    t = time.perf_counter()
    along = el.trajectory_integrated(r.model, r.trajectory, r.batch, steps=n, segments=[k])
    seconds = time.perf_counter() - t
    along.save(r.parts / f"integral-{n}-{k}")
    info = along.metadata["integrated"]
    r.note(f"integral-{n}-{k}", {"seconds": seconds,
                                 "completeness": info["segment_completeness"][0]})  # fmt: skip


def rest(r: Run) -> None:
    """What is not done yet, one unit at a time (the finetune alone; then the straight line,
    and epoch by epoch each checkpoint's linear map and each segment's integral), stopping
    before a unit that would pass ``--budget`` minutes: run it again until it says nothing is
    left."""
    if not (r.parts / "finetune.json").exists():
        return finetune(r)
    if not r.holds_units():
        print("another process is running the units: nothing to do")
        return
    run_units(r, left(r))


def more(r: Run) -> None:
    """``rest``'s units (unless another process runs them), then, within ``--budget``: the
    segment with the largest completeness error at ``--nodes`` integrated again with 2 and 4
    times the nodes, and the exact informative map of the last checkpoint."""
    units = left(r) if r.holds_units() else []
    n, T = r.a.nodes, len(r.trajectory)
    errors = {k: r.read(f"integral-{n}-{k}")["completeness"] for k in range(1, T + 1)
              if (r.parts / f"integral-{n}-{k}.json").exists()}  # fmt: skip
    worst = max(errors, key=lambda k: errors[k]) if errors else 1
    units += [(f"integral-{m}-{worst}", functools.partial(segment, r, worst, m))
              for m in (2 * n, 4 * n)]  # fmt: skip
    units.append((f"exact-{T}", functools.partial(map_at, r, T, "exact")))
    run_units(r, [(name, f) for name, f in units if not (r.parts / f"{name}.json").exists()])


def left(r: Run) -> list[tuple[str, Any]]:
    """``rest``'s units not done yet, in order."""
    T, n = len(r.trajectory), r.a.nodes
    units = [(f"straight-{n}", functools.partial(straight, r))]
    for k in range(1, T + 1):  # epoch by epoch: a run cut short leaves the first epochs whole
        units += [(f"linear-{k}", functools.partial(map_at, r, k, "linear")),
                  (f"integral-{n}-{k}", functools.partial(segment, r, k))]  # fmt: skip
    return [(name, f) for name, f in units if not (r.parts / f"{name}.json").exists()]


def run_units(r: Run, todo: list[tuple[str, Any]]) -> None:
    """Each unit in turn, stopping before one that would pass ``--budget`` minutes (the
    longest unit so far taken as the next one's time)."""
    _ = r.loaded  # the model, loaded before the clock starts
    start, longest = time.perf_counter(), 0.0
    for i, (_, f) in enumerate(todo):
        if time.perf_counter() - start + longest > 60 * r.a.budget:
            print(f"left for the next run: {', '.join(u for u, _ in todo[i:])}")
            return
        t = time.perf_counter()
        f()
        longest = max(longest, time.perf_counter() - t)
    print("nothing left: run the figures phase")


def straight(r: Run) -> None:
    """The straight-line integrated informative score of ``D_T`` (``--nodes`` nodes)."""
    import extractive_lens as el

    t = time.perf_counter()
    s = el.integrated_scores(r.model, r.trajectory.final, r.batch, kinds="informative",
                             steps=r.a.nodes)  # fmt: skip
    s.save(r.parts / f"straight-{r.a.nodes}.safetensors")
    r.note(f"straight-{r.a.nodes}", {"seconds": time.perf_counter() - t,
                                     "completeness": s.metadata["integrated"]["completeness"]})  # fmt: skip


def joined(r: Run, method: str) -> Any:
    """The saved maps of one method (``linear``, ``exact``) as one ``TrajectoryScores``."""
    import extractive_lens as el
    from extractive_lens.scoring.trajectory import TrajectoryScores

    traj = r.trajectory
    ks = [k for k in range(1, len(traj) + 1) if (r.parts / f"{method}-{k}.safetensors").exists()]
    if not ks:
        return None
    return TrajectoryScores(
        tuple(el.ComponentScores.load(r.parts / f"{method}-{k}.safetensors") for k in ks),
        tuple(traj.steps[k] for k in ks), tuple(traj.epochs[k] for k in ks), "checkpoint",
        {"method": method},
    )  # fmt: skip


def figures(r: Run) -> None:
    """Gather the phases' results into ``results.json`` and draw the figures."""
    import pandas as pd

    import extractive_lens as el
    from extractive_lens import trajectory_plots as tp
    from extractive_lens.scoring.trajectory import TrajectoryScores

    n = r.a.nodes
    ft = r.read("finetune")
    df = pd.DataFrame(ft["ranks"])
    parts = sorted(r.parts.glob(f"integral-{n}-*.json"), key=lambda p: int(p.stem.split("-")[2]))
    along = TrajectoryScores.join(*(TrajectoryScores.load(p.with_suffix("")) for p in parts))
    prompts = len(along.scores[0].prompt_roles)
    straight = el.ComponentScores.load(r.parts / f"straight-{n}.safetensors")
    maps = joined(r, "linear")
    info = along.metadata["integrated"]
    R: dict[str, Any] = {"model": r.a.model, "recipe": ft["recipe"], "prompts": prompts,
                         "losses": ft["losses"]}  # fmt: skip
    R["ranks"] = df.pivot(index="epoch", columns="split", values="mean_rank").round(2).to_dict()
    lin = [r.read(f"linear-{k}") for k in range(1, len(r.trajectory) + 1)
           if (r.parts / f"linear-{k}.json").exists()]  # fmt: skip
    ints = [r.read(p.stem) for p in parts]
    R["times"] = {"finetune_s": ft["seconds"],
                  "linear_per_checkpoint_s": [round(x["seconds"], 2) for x in lin],
                  "trajectory_integral_per_segment_s": [round(x["seconds"], 2) for x in ints],
                  "straight_integral_s": r.read(f"straight-{n}")["seconds"]}  # fmt: skip
    R["peak_rss_gib"] = {"finetune": ft["peak_rss_gib"],
                         "linear": max(x["peak_rss_gib"] for x in lin),
                         "trajectory_integral": max(x["peak_rss_gib"] for x in ints),
                         "straight_integral": r.read(f"straight-{n}")["peak_rss_gib"]}  # fmt: skip
    R["completeness"] = {"trajectory": info["completeness"]["informative"],
                         "per_segment": info["segment_completeness"],
                         "straight": straight.metadata["integrated"]["completeness"]["informative"],
                         "steps": info["steps"], "rule": info["rule"]}  # fmt: skip
    for other in sorted(r.parts.glob("integral-*.json")):  # other node counts, where measured
        m, k = (int(x) for x in other.stem.split("-")[1:])
        if m != n:
            R.setdefault("segment_completeness_by_nodes", {}).setdefault(str(m), {})[str(k)] = (
                r.read(other.stem)["completeness"]
            )
    R["rewards"] = info["rewards"]
    gap = tp.path_gap(along, straight)
    R["gap"] = {
        "relative_l1": float(gap["difference"].abs().sum() / gap["straight"].abs().sum()),
        "largest": gap.reindex(gap["difference"].abs().sort_values(ascending=False).index)
        .head(5).round(4).to_dict("records"),
        "top_trajectory": gap.sort_values("trajectory", ascending=False).head(5)
        .round(4).to_dict("records"),
        "top_straight": gap.sort_values("straight", ascending=False).head(5)
        .round(4).to_dict("records"),
    }  # fmt: skip
    cum = along.cumulative().layer_map()
    R["segment_layer_map"] = along.layer_map().round(4).to_dict("split")
    R["cumulative_share_by_layer"] = (cum / cum.iloc[-1]).round(3).to_dict("split")
    R["layer_totals"] = cum.iloc[-1].round(4).to_dict()
    R["other_total"] = float(along.total.other.mean()) if along.total.other is not None else None
    R["first_half_by_epoch"] = {"trajectory_integral": first_takers(cum),
                                "linear_maps": first_takers(maps.layer_map())}  # fmt: skip
    R["linear_layer_map"] = maps.layer_map().round(4).to_dict("split")
    R["linear_sum"] = [float(s.totals[0].sum()) for s in maps.scores]
    ex = joined(r, "exact")
    if ex is not None:
        R["exact"] = {"epochs": list(ex.epochs), "layer_map": ex.layer_map().round(4).to_dict("split"),
                      "seconds": [r.read(f"exact-{k}")["seconds"] for k in
                                  [r.trajectory.epochs.index(e) for e in ex.epochs]],
                      "prompts": len(ex.scores[0].prompt_roles)}  # fmt: skip
    r.out.mkdir(parents=True, exist_ok=True)
    (r.out / "results.json").write_text(json.dumps(R, indent=1, default=str))
    print(json.dumps({k: R[k] for k in ("times", "peak_rss_gib", "completeness", "gap",
                                        "first_half_by_epoch", "ranks")}, indent=1, default=str))  # fmt: skip

    name = {"world": "world model", "smollm2": "SmolLM2-135M"}[r.a.model]
    figs = {
        "linear_map": tp.layer_map(maps),
        "segment_map": tp.layer_map(along),
        "uptake": uptake_figure(cum),
        "curves": tp.curves(maps, tp.top_components(maps, n=4), ranks=df),
        "segment_curves": tp.curves(along.cumulative(), tp.top_components(along, n=4), ranks=df),
        "gap": tp.gap_figure(gap),
    }
    titles = {
        "linear_map": "linear informative of D_k by layer",
        "segment_map": "each segment's share of the path integral, by layer",
        "curves": "linear informative of D_k; mean ranks",
        "segment_curves": "path-integrated informative up to each epoch; mean ranks",
    }
    for key, title in titles.items():
        figs[key].update_layout(title=f"{name}: {title}")
    if ex is not None:
        figs["exact_map"] = tp.layer_map(ex)
    for name, fig in figs.items():
        fig.update_layout(width=760, height=440 if r.a.model == "world" else 560)
        fig.write_html(r.out / f"{name}.html", include_plotlyjs="cdn")
        try:
            fig.write_image(r.out / f"{name}.png")
        except Exception as e:  # no kaleido / browser: say so, the JSON has the numbers
            print(f"no {name}.png: {e}")
    tp.report(maps, r.out / "report.html", along=along, ranks=df, straight=straight)
    print("wrote", r.out)


def uptake_figure(cumulative: Any) -> Any:
    """Epoch x layer: the share of each layer's final trajectory-integrated score reached by
    each epoch (blank where the layer's final score is under 5% of the largest layer's)."""
    import numpy as np
    import plotly.graph_objects as go

    final = cumulative.iloc[-1].to_numpy()
    share = cumulative.to_numpy() / np.where(final == 0, np.nan, final)
    share[:, np.abs(final) < 0.05 * np.abs(final).max()] = np.nan
    fig = go.Figure(go.Heatmap(
        z=share, x=list(cumulative.columns), y=[f"{e:g}" for e in cumulative.index],
        colorscale="Viridis", zmin=0, zmax=1, colorbar={"title": "share of final"},
        hovertemplate="epoch %{y}<br>%{x}<br>%{z:.3f}<extra></extra>",
    ))  # fmt: skip
    fig.update_layout(title="share of each layer's final path-integrated score, by epoch",
                      xaxis_title="layer",
                      yaxis_title="epoch", template="plotly_white")  # fmt: skip
    fig.update_yaxes(type="category")
    return fig


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("phase", choices=[*PHASES, "all", "rest", "more"])
    ap.add_argument("--model", choices=["world", "smollm2"], default="world")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--folder", type=Path, default=None,
                    help="the checkpoints and each phase's results (default: a temp folder; "
                    "phases run one at a time need the same folder)")  # fmt: skip
    ap.add_argument("--prompts", type=int, default=None,
                    help="facts scored (default: world all 20, smollm2 the first 4)")  # fmt: skip
    ap.add_argument("--at", default=None, help="checkpoints or segments, e.g. 1-4 (default: all)")
    ap.add_argument("--nodes", type=int, default=4, help="quadrature nodes (default: 4)")
    ap.add_argument("--budget", type=float, default=15, help="rest: minutes (default: 15)")
    a = ap.parse_args()
    if a.folder is None:
        if a.phase != "all":
            ap.error("a phase run on its own needs --folder (where the earlier phases wrote)")
        a.folder = Path(tempfile.mkdtemp(prefix="trajectory-"))
    torch.set_num_threads(1)
    r = Run(a)
    for phase in PHASES if a.phase == "all" else (a.phase,):
        globals()[phase](r)


if __name__ == "__main__":
    main()

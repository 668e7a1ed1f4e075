"""Round 2 of the reliability campaign: two threads on one model, ranks that disagree, saves
that cannot be half-written."""

from __future__ import annotations

import os
import threading

import pytest
import torch

import extractive_lens as el
from tests.conftest import make_pair


def test_two_threads_scoring_one_model_take_turns():
    """Two threads scoring (and finetuning) one model at once: every result equals the one
    computed alone, no call sees the other's temporary hooks, and the weights end unchanged."""
    base, ft = make_pair("ln_gelu", torch.float64)
    diff = el.WeightDiff.from_models(base, ft)
    batch = el.make_batch(base, [([1, 2, 3], [4]), ([1, 5, 6], [7]), ([2, 5, 9], [8])])
    before = [p.detach().clone() for p in base.parameters()]
    alone = {
        "linear": el.linear_scores(base, diff, batch, show_progress=False),
        "causal": el.causal_scores(base, diff, batch, show_progress=False),
    }
    tuned_alone = el.finetune(base, batch, el.FinetuneConfig(epochs=2), show_progress=False)
    results: list[tuple[str, object]] = []
    errors: list[BaseException] = []

    def work() -> None:
        try:
            for _ in range(2):
                results.append(("linear", el.linear_scores(base, diff, batch, show_progress=False)))
                results.append(("causal", el.causal_scores(base, diff, batch, show_progress=False)))
                results.append(("finetune", el.finetune(base, batch, el.FinetuneConfig(epochs=2),
                                                        show_progress=False)))  # fmt: skip
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    assert errors == [], errors
    assert len(results) == 12
    for what, got in results:
        if what == "finetune":
            assert all(torch.equal(got.deltas[n], d) for n, d in tuned_alone.deltas.items())
        else:
            assert torch.allclose(got.values, alone[what].values, atol=1e-12, rtol=0)
    assert all(torch.equal(a, p) for a, p in zip(before, base.parameters()))


@pytest.mark.parametrize("what", ["diff", "batch"])
def test_ranks_scoring_different_inputs_are_refused(tmp_path, what):
    """Rank 1 holds a slightly different diff, or a batch of the same size with one other
    token: every rank refuses (instead of merging shards of two different results)."""
    import torch.multiprocessing as mp

    from tests import dist_worker
    from tests.helpers import free_port

    mp.spawn(dist_worker.run_mismatched, args=(2, free_port(), str(tmp_path), what), nprocs=2,
             join=True)  # fmt: skip
    for rank in (0, 1):
        err = (tmp_path / f"rank{rank}.err").read_text()
        assert "not scoring the same inputs" in err and f"rank 1 has another {what}" in err, err
        assert "Load the same model, diff and data files on every rank" in err


def test_ranks_that_differ_in_anything_but_delta_and_batch_are_refused(tmp_path):
    """#42, #50: ranks differing in the steps, the ablation, the base model (same architecture),
    a Δ with two rows swapped (same sum and sum of squares), the kinds, the config (norm eps),
    the candidates or a reward lambda (two lambdas describe alike) all refuse, saying what
    differs (the kinds: no tensor-size error); options left at their defaults on one rank and
    given explicitly on the other agree."""
    import torch.multiprocessing as mp

    from tests import dist_worker
    from tests.helpers import free_port

    mp.spawn(dist_worker.run_disagreeing, args=(2, free_port(), str(tmp_path)), nprocs=2, join=True)
    says = {
        "steps": "rank 1 has steps=3 where rank 0 has steps=2",
        "ablation": "rank 1 has ablation='zero' where rank 0 has ablation='mean'",
        "base": "rank 1 has another base model",
        "swapped rows": "rank 1 has another diff",
        "kinds": "rank 1 has kinds=('informative',) where rank 0 has kinds=('informative', "
        "'upstream', 'downstream')",
        "eps": "rank 1 has eps=1e-06 where rank 0 has eps=1e-05",
        "candidates": "rank 1 has other candidate answers",
        "reward": "rank 1 has another reward",
    }
    for case in dist_worker.DISAGREEMENTS:
        for rank in (0, 1):
            got = (tmp_path / f"{case}.rank{rank}").read_text()
            if case == "agree":
                assert got == "no error", got
                continue
            assert got.startswith("ValueError: distributed_scores: the processes are not scoring")
            assert says[case] in got, (case, got)
            others = [w for c, w in says.items() if c != case]
            assert not any(w in got for w in others), (case, got)  # only what differs


# ------------------------------------------------------------------ saves that cannot mislead


def synthetic_scores(seed: int, size: int = 8) -> el.ComponentScores:
    """A ComponentScores of random values (no model needed); ``size`` scales its tensors."""
    g = torch.Generator().manual_seed(seed)
    k, b, layers, comps, pos = 3, size, 4, 5, 6
    pv = torch.randn(k, b, layers, comps, pos, generator=g, dtype=torch.float64)
    roles = tuple(tuple(f"p{i}" for i in range(pos)) for _ in range(b))
    return el.ComponentScores(
        values=pv.mean(1), totals=pv.sum(-1).mean(1), prompt_values=pv, prompt_totals=pv.sum(-1),
        kinds=("informative", "upstream", "downstream"),
        component_labels=("H0", "H1", "H2", "H3", "MLP"),
        position_labels=tuple(f"p{i}" for i in range(pos)), prompt_roles=roles, method="linear",
        other=torch.randn(b, generator=g, dtype=torch.float64), metadata={"seed": seed},
    )  # fmt: skip


def synthetic_diff(seed: int, size: int = 64) -> el.WeightDiff:
    g = torch.Generator().manual_seed(seed)
    return el.WeightDiff(
        {f"blocks.{i}.mlp.W_in": torch.randn(size, size, generator=g) for i in range(4)},
        {"n_layers": 4},
    )


def _same(a, b) -> bool:
    if isinstance(a, el.WeightDiff):
        return a.deltas.keys() == b.deltas.keys() and all(
            torch.equal(a.deltas[n], b.deltas[n]) for n in a.deltas
        )
    return (
        torch.equal(a.prompt_values, b.prompt_values) and a.metadata["seed"] == b.metadata["seed"]
    )


class _Injected(BaseException):
    pass


def _raise(name: str) -> None:
    raise _Injected(name)


SAVES = {
    "ComponentScores": (synthetic_scores, lambda obj, p: obj.save(p), el.ComponentScores.load),
    "WeightDiff": (synthetic_diff, lambda obj, p: obj.save(p), el.WeightDiff.load),
}


def _fs_calls(monkeypatch, when: str, k: int, fire=None) -> list[str]:
    """Patch every file-system call a save makes (opening, writing, syncing, renaming; the
    safetensors writer as one call) to raise on its k-th occurrence, before or after it (or to
    call ``fire(name)`` there instead)."""
    import builtins
    import os

    import safetensors.torch

    seen: list[str] = []

    def wrap(name, fn):
        def call(*args, **kwargs):
            seen.append(name)
            if len(seen) == k and when == "before":
                (fire or _raise)(name)
            out = fn(*args, **kwargs)
            if len(seen) == k and when == "after":
                (fire or _raise)(name)
            return out

        return call

    for module, name in [(os, "replace"), (os, "fsync"), (os, "chmod"), (os, "rename"),
                         (builtins, "open"), (safetensors.torch, "save_file")]:  # fmt: skip
        monkeypatch.setattr(module, name, wrap(name, getattr(module, name)))
    import tempfile

    monkeypatch.setattr(tempfile, "mkstemp", wrap("mkstemp", tempfile.mkstemp))
    import pathlib

    monkeypatch.setattr(pathlib.Path, "write_text", wrap("write_text", pathlib.Path.write_text))
    return seen


@pytest.mark.parametrize("kind", list(SAVES))
def test_an_interrupt_at_any_file_system_call_leaves_old_new_or_a_refusal(
    kind, tmp_path, monkeypatch
):
    """Over an existing result (a private 0600 one: its mode is kept, one more call), an
    interrupt before or after each file-system call of a save: afterwards the path loads as the
    old result or the new one (never a mix, never nothing)."""
    make, save, load = SAVES[kind]
    old, new = make(1), make(2)
    count = tmp_path / "count" / ("scores" if kind == "ComponentScores" else "d.st")
    save(old, count)
    os.chmod(count / "scores.json" if kind == "ComponentScores" else count, 0o600)
    with monkeypatch.context() as m:  # the calls one save over an earlier result makes
        seen = _fs_calls(m, "never", 0)
        save(new, count)
        calls = list(seen)
    assert calls, "the save made no file-system call that could be interrupted"
    outcomes = set()
    for when in ("before", "after"):
        for k in range(1, len(calls) + 1):
            path = tmp_path / f"{when}{k}" / ("scores" if kind == "ComponentScores" else "d.st")
            save(old, path)
            os.chmod(path / "scores.json" if kind == "ComponentScores" else path, 0o600)
            with monkeypatch.context() as m:
                _fs_calls(m, when, k)
                with pytest.raises(_Injected):
                    save(new, path)
            try:
                got = load(path)
            except (ValueError, FileNotFoundError) as e:
                assert len(str(e).splitlines()) == 1
                outcomes.add("refused")
                continue
            assert _same(got, old) or _same(got, new), (when, k, calls[k - 1])
            outcomes.add("old" if _same(got, old) else "new")
    assert "old" in outcomes and "new" in outcomes, outcomes
    assert "refused" not in outcomes  # the old result is never lost (#42)


SAVER = """
import sys, itertools
sys.path.insert(0, {root!r})
from tests.test_reliability import SAVES
make, save, load = SAVES[{kind!r}]
a, b = make(1, {size}), make(2, {size})
print("ready", flush=True)
for obj in itertools.cycle((a, b)):
    save(obj, {path!r})
"""


@pytest.mark.parametrize("kind", list(SAVES))
def test_sigkill_during_large_saves_never_leaves_a_mix(kind, tmp_path):
    """A process saving two large results over one path in a loop, killed (SIGKILL) at random
    moments: the path always loads as one of the two whole results. A killed save may leave its
    hidden temporary file behind; it is never read, and the next save removes it."""
    import random
    import subprocess
    import sys
    import time
    from pathlib import Path

    make, save, load = SAVES[kind]
    size = 400 if kind == "ComponentScores" else 700  # ~20 MB and ~16 MB a save
    a, b = make(1, size), make(2, size)
    path = tmp_path / ("scores" if kind == "ComponentScores" else "d.st")
    save(a, path)
    rng = random.Random(0)
    root = str(Path(__file__).resolve().parents[1])
    seen = set()
    for _ in range(6):
        code = SAVER.format(root=root, kind=kind, size=size, path=str(path))
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        time.sleep(rng.uniform(0.05, 1.0))
        proc.kill()
        proc.wait(timeout=60)
        try:
            got = load(path)
        except (ValueError, FileNotFoundError) as e:
            assert len(str(e).splitlines()) == 1
            seen.add("refused")
            continue
        assert _same(got, a) or _same(got, b)
        seen.add("a" if _same(got, a) else "b")
    assert seen and "refused" not in seen, seen  # the previous result survives (#42)
    save(b, path)  # the next save removes what the killed ones left
    assert litter(path) == [], litter(path)


def litter(path) -> list[str]:
    """What saves left at ``path`` beyond the result itself: hidden temporaries and, in a
    scores directory, tensor files its scores.json does not name."""
    import json
    from pathlib import Path

    path = Path(path)
    if path.is_dir():
        named = json.loads((path / "scores.json").read_text())["tensors"]
        return sorted(set(os.listdir(path)) - {"scores.json", named})
    return sorted(p.name for p in path.parent.glob(f".{path.name}.*.tmp"))


def test_report_refuses_linear_and_exact_of_two_different_score_runs(tmp_path, capsys):
    """`score --out` stamps one run id in every result it writes; `report` refuses a folder
    whose linear/ and causal/ come from two runs (an interrupted run, or a reused folder)."""
    import dataclasses

    from extractive_lens.cli import main

    lin = synthetic_scores(1)
    ex = dataclasses.replace(synthetic_scores(1), method="causal", other=None)
    for run, r in (("run-a", lin), ("run-b", ex)):
        r.metadata["run_id"] = run
        r.save(tmp_path / r.method)
    with pytest.raises(SystemExit) as done:
        main(["report", str(tmp_path)])
    err = capsys.readouterr().err.strip()
    assert done.value.code == 2 and len(err.splitlines()) == 1 and "two different" in err
    ex.metadata["run_id"] = "run-a"
    ex.save(tmp_path / "causal")
    with pytest.raises(SystemExit) as done:
        main(["report", str(tmp_path)])
    assert done.value.code == 0

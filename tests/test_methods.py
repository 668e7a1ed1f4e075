"""The table of scoring methods (``scoring/methods.py``): CONTRIBUTING's "Add a scoring method"
recipe followed once with a toy method, and a method the table lacks refused at every door."""

from __future__ import annotations

import copy
import dataclasses
import json
import typing
from typing import Literal

import pytest
import torch
from typer.testing import CliRunner

import extractive_lens as el
from extractive_lens import results
from extractive_lens.cli import app
from extractive_lens.distributed import distributed_scores
from extractive_lens.scoring import costs, methods
from extractive_lens.scoring.options import LinearOptions

runner = CliRunner()


@dataclasses.dataclass(frozen=True)
class HalfOptions(LinearOptions):
    """The toy method's options: linear's, and the factor its scores are multiplied by."""

    factor: float = 0.5


def half_scores(model, diff, batch, *, factor=0.5, **options):
    """A toy method: ``factor`` times the linear scores, recorded as method "half"."""
    HalfOptions(factor=factor, **options)  # its options checked, as an engine does
    lin = el.linear_scores(model, diff, batch, **options)
    return dataclasses.replace(
        lin,
        method="half",
        values=factor * lin.values,
        totals=factor * lin.totals,
        prompt_values=None if lin.prompt_values is None else factor * lin.prompt_values,
        prompt_totals=None if lin.prompt_totals is None else factor * lin.prompt_totals,
        other=None if lin.other is None else factor * lin.other,
    )


def half_memory(shapes: costs.Shapes, options: HalfOptions) -> dict[str, int]:
    return costs.linear_memory(shapes, options)


HALF = methods.Method(
    name="half", engine=half_scores, options=HalfOptions, memory=half_memory,
    shards=("prompts",), cli=(), reference=0, shown="half",
    informative_totals="informative: half of linear's", remedy="{fix}",
)  # fmt: skip


@pytest.fixture(scope="module")
def world_setting(tmp_path_factory):
    """The world model, a small Δ of it saved to a file, and two facts as a data file."""
    from extractive_lens.world import first_hop

    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("methods")
    base = el.load_world_model()
    ft = copy.deepcopy(base)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in ft.parameters():
            p.add_(1e-2 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    diff = el.WeightDiff.from_models(base, ft)
    diff.save(root / "d.safetensors")
    facts = first_hop().facts[:2]
    (root / "facts.jsonl").write_text(
        "\n".join(json.dumps({"prompt": p.prompt, "answer": p.answer}) for p in facts)
    )
    batch = el.make_batch(base, [(p.prompt, p.answer) for p in facts])
    return base, diff, batch, root


@pytest.fixture
def with_half(monkeypatch):
    """The recipe: one entry in the table (a copy here, so other tests see the real one) and
    the name in ``types.Method``."""
    monkeypatch.setattr(methods, "METHODS", dict(methods.METHODS))
    methods.register(HALF)
    names = (*typing.get_args(el.types.Method), "half")
    monkeypatch.setattr(results, "Method", Literal[names])  # type: ignore[valid-type]


def test_a_method_in_the_table_is_reached_by_every_door(world_setting, with_half, tmp_path):
    base, diff, batch, root = world_setting
    lin = el.linear_scores(base, diff, batch, kinds="informative", show_progress=False)
    got = distributed_scores("half", base, diff, batch, kinds="informative", show_progress=False)
    assert got.method == "half"
    torch.testing.assert_close(got.values, 0.5 * lin.values)  # the engine the entry names
    e = el.estimate(base, diff, batch, "half", kinds="informative")
    assert e.method == "half" and e.layer_loads > 0
    out = tmp_path / "out"
    res = runner.invoke(app, ["score", "--base", "world", "--diff", str(root / "d.safetensors"),
                              "--data", str(root / "facts.jsonl"), "--method", "half",
                              "--kinds", "informative", "--out", str(out)])  # fmt: skip
    assert res.exit_code == 0, res.output
    saved = el.ComponentScores.load(out / "half")
    assert saved.method == "half"
    torch.testing.assert_close(saved.values, 0.5 * lin.values, rtol=1e-5, atol=1e-7)
    assert "(informative: half of linear's)" in res.output
    assert methods.compared(("half", "causal")) == [("half", "causal")]


def test_a_method_missing_from_the_table_cannot_be_called(world_setting, monkeypatch):
    base, diff, batch, root = world_setting
    monkeypatch.setattr(
        methods, "METHODS", {n: m for n, m in methods.METHODS.items() if n != "integrated"}
    )
    with pytest.raises(
        ValueError, match="must be one of linear, causal, verified, got 'integrated'"
    ):
        distributed_scores("integrated", base, diff, batch)
    with pytest.raises(
        ValueError, match="must be one of linear, causal, verified, got 'integrated'"
    ):
        el.estimate(base, diff, batch, "integrated")
    res = runner.invoke(app, ["score", "--base", "world", "--diff", str(root / "d.safetensors"),
                              "--data", str(root / "facts.jsonl"), "--method", "integrated"])  # fmt: skip
    assert (
        res.exit_code != 0
        and "--method must be linear, causal, verified, both or all" in res.output
    )
    res = runner.invoke(app, ["score", "--base", "world", "--diff", str(root / "d.safetensors"),
                              "--data", str(root / "facts.jsonl"), "--method", "half"])  # fmt: skip
    assert res.exit_code != 0 and "--method must be" in res.output


def test_the_table_names_the_methods_results_accept():
    assert tuple(methods.METHODS) == typing.get_args(el.types.Method)


def test_an_entry_is_checked_when_it_is_made(monkeypatch):
    monkeypatch.setattr(methods, "METHODS", dict(methods.METHODS))
    with pytest.raises(ValueError, match="already in the table"):
        methods.register(dataclasses.replace(HALF, name="linear"))
    with pytest.raises(ValueError, match="HalfOptions has no field"):
        dataclasses.replace(HALF, cli=("steps",))
    with pytest.raises(ValueError, match="shards must be"):
        dataclasses.replace(HALF, shards=("layers",))


def test_comparisons_judge_each_method_against_the_highest_reference():
    assert methods.compared(("linear", "integrated", "causal")) == [
        ("linear", "causal"),
        ("integrated", "causal"),
    ]
    assert methods.compared(("linear", "integrated")) == [("linear", "integrated")]
    assert methods.compared(("linear",)) == [] and methods.compared(("causal",)) == []

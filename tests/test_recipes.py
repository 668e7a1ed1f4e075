"""CONTRIBUTING.md's recipes, followed once each so that they stay true.

"Add a diff source": a toy source written exactly as the recipe says (a function returning
``Parts``, a one-line classmethod) must give a diff that every part of the package takes as
it is. ("Add a scoring method" is followed by tests/test_methods.py with a toy method, "Add a
model family" by each family's test in tests/test_model.py.)
"""

from __future__ import annotations

import copy
from collections.abc import Mapping

import pytest
import torch
from torch import Tensor

import extractive_lens as el
from extractive_lens import backend as B
from extractive_lens.diff_sources import Parts, delta_dtype_for
from tests.conftest import make_pair
from tests.helpers import small_batch


# ---- the recipe, step 1: diff_sources/<source>.py would hold this function ----------------------
def from_edits(model: B.ScorableModel, edits: Mapping[str, Tensor]) -> Parts:
    """Δ that turns ``model``'s parameters named in ``edits`` into those values (zero elsewhere)."""
    params = B.parameters(model)
    unknown = sorted(set(edits) - set(params))
    if unknown:
        raise KeyError(f"from_edits: the model has no parameters {unknown}")
    ddt = delta_dtype_for(model.cfg.dtype)
    deltas = {
        n: (edits[n].to(ddt) - p.detach().to(ddt)) if n in edits else torch.zeros_like(p, dtype=ddt)
        for n, p in params.items()
    }
    return Parts(
        deltas, dict(B.signature(model)), {"base": model.cfg.model_name, "edits": sorted(edits)}
    )


# ---- step 2: the one-line classmethod (on a subclass here, on WeightDiff in the package) ---------
class EditableDiff(el.WeightDiff):
    @classmethod
    def from_edits(cls, model: B.ScorableModel, edits: Mapping[str, Tensor]) -> EditableDiff:
        return cls(*from_edits(model, edits))


# ---- step 3: its tests ----------------------------------------------------------------------------
def test_a_diff_source_written_per_the_recipe_works_everywhere(tmp_path):
    base, _ = make_pair("ln_gelu", torch.float32)
    name = "blocks.1.mlp.W_out"
    new = B.parameters(base)[name].detach() + 0.1 * torch.randn(
        B.parameters(base)[name].shape, generator=torch.Generator().manual_seed(0)
    )
    diff = EditableDiff.from_edits(base, {name: new})

    edited = copy.deepcopy(base)  # the same change made by hand, read back by from_models
    B.write_parameters(edited, {name: new})
    reference = el.WeightDiff.from_models(base, edited)
    assert set(diff.deltas) == set(reference.deltas)
    assert all(torch.equal(diff.deltas[n], reference.deltas[n]) for n in diff.deltas)

    with torch.no_grad(), diff.applied(base):  # applying reproduces the edit exactly
        assert torch.equal(B.parameters(base)[name], new)
    norms = diff.norms()
    assert norms.loc["L1", "MLP"] > 0 and norms.to_numpy().sum() == norms.loc["L1", "MLP"]
    assert diff.other_norm() == 0.0

    loaded = el.WeightDiff.load(diff.save(tmp_path / "edit.safetensors"))
    assert all(torch.equal(loaded.deltas[n], diff.deltas[n]) for n in diff.deltas)

    batch = small_batch(base)
    ours = el.linear_scores(base, diff, batch, kinds="informative", show_progress=False)
    theirs = el.linear_scores(base, reference, batch, kinds="informative", show_progress=False)
    assert torch.equal(ours.values, theirs.values)
    assert ours.totals[0, 1, -1] != 0 and ours.totals[0, 0].abs().sum() == 0  # only L1MLP moved


def test_what_the_package_checks_of_a_source_s_parts():
    base, _ = make_pair("ln_gelu", torch.float32)
    deltas, signature, metadata = from_edits(base, {})
    bad = dict(deltas, **{"blocks.0.attn.W_Q": torch.zeros(1, 2, 3, dtype=torch.float64)})
    with pytest.raises(ValueError, match=r"blocks\.0\.attn\.W_Q.*shape"):
        el.WeightDiff(
            bad, signature, metadata
        )  # each tensor's shape against backend.expected_shape
    with pytest.raises(ValueError, match="signature"):
        el.WeightDiff(deltas, {}, metadata).norms()  # a source must hand over the signature

"""TransformerLens weight processing (fold_ln, centred writing weights, centred unembedding,
a bridge's process_weights / enable_compatibility_mode) is found and refused with a sentence,
on both backends; a model loaded processed on purpose is scored and recorded as processed."""

from __future__ import annotations

import pytest
import torch

from extractive_lens import WeightDiff, linear_scores
from extractive_lens.backend import weights_processed
from extractive_lens.backend.installed import has_hooked
from extractive_lens.backend.processing import processing_found
from tests.conftest import make_pair
from tests.helpers import small_batch

needs_hooked = pytest.mark.skipif(
    not has_hooked(), reason="TransformerLens 4 has no HookedTransformer"
)


_NONE = dict(fold_ln=False, center_writing_weights=False, center_unembed=False,
             fold_value_biases=False, refactor_factored_attn_matrices=False)  # fmt: skip


@needs_hooked
@pytest.mark.parametrize(
    "flags, found",
    [
        # from_pretrained's default: everything but the refactoring
        (dict(fold_ln=True, center_writing_weights=True, center_unembed=True,
              fold_value_biases=True),
         ("fold_ln", "center_writing_weights", "center_unembed", "fold_value_biases")),
        (dict(fold_ln=True), ("fold_ln",)),
        (dict(center_writing_weights=True), ("center_writing_weights",)),
        (dict(center_unembed=True), ("center_unembed",)),
        # from_pretrained(fold_ln=False, center_writing_weights=False, center_unembed=False)
        (dict(fold_value_biases=True), ("fold_value_biases",)),
        # the refactoring moves b_V into b_O as the folding does
        (dict(refactor_factored_attn_matrices=True),
         ("fold_value_biases", "refactor_factored_attn_matrices")),
    ],
    ids=["default", "fold_ln", "center_writing", "center_unembed", "fold_value_biases",
         "refactor"],
)  # fmt: skip
def test_processed_hooked_model_is_refused(flags, found):
    """Each option TransformerLens's loading has (``load_and_process_state_dict``, which
    ``from_pretrained`` and ``process_weights_`` call), applied by TransformerLens itself."""
    base, ft = make_pair("ln_gelu", torch.float64)
    diff = WeightDiff.from_models(base, ft)
    batch = small_batch(base, n=2)
    assert processing_found(base) == () and not weights_processed(base)  # negative control
    base.load_and_process_state_dict(base.state_dict(), **{**_NONE, **flags})
    assert processing_found(base) == found
    assert weights_processed(base)  # what every result and signature records
    with pytest.raises(ValueError, match=r"processed by TransformerLens .*no_processing"):
        linear_scores(base, diff, batch)
    with pytest.raises(ValueError, match=r"formed on weights as trained"), diff.applied(base):
        pass  # the diff remembers the state it was formed on


@needs_hooked
def test_process_weights_folds_value_biases_whatever_it_is_told():
    """``process_weights_(False, False, False)`` still folds the value biases (TransformerLens
    3.9 has no switch for it there): 24% off in the informative scores of this pair."""
    base, ft = make_pair("ln_gelu", torch.float64)
    base.process_weights_(fold_ln=False, center_writing_weights=False, center_unembed=False)
    assert processing_found(base) == ("fold_value_biases",)


@needs_hooked
def test_models_without_value_biases_are_not_flagged():
    """A model with no attention biases (Llama's) is unchanged by the folding: not flagged; nor
    a model whose biases are all zero (a fresh initialisation)."""
    base, _ = make_pair("ln_gelu", torch.float64)
    with torch.no_grad():
        for n, p in base.named_parameters():
            if n.endswith(("attn.b_V", "attn.b_O")):
                p.zero_()
    assert processing_found(base) == ()
    base.load_and_process_state_dict(base.state_dict(), **{**_NONE, "fold_value_biases": True})
    assert processing_found(base) == ()


@needs_hooked
def test_rms_models_fold_too():
    base, _ = make_pair("rms_gated_rotary_gqa", torch.float64)
    base.process_weights_(fold_ln=True, center_writing_weights=False, center_unembed=False)
    assert processing_found(base) == ("fold_ln", "fold_value_biases")  # this one always folds


def test_processed_bridge_is_refused():
    from extractive_lens.backend.building import as_bridge

    base, ft = make_pair("ln_gelu", torch.float32)
    if has_hooked():
        base, ft = as_bridge(base), as_bridge(ft)
    diff = WeightDiff.from_models(base, ft)
    batch = small_batch(base, n=2)
    assert processing_found(base) == ()
    linear_scores(base, diff, batch, kinds=("downstream",))  # unprocessed: scored
    base.enable_compatibility_mode(disable_warnings=True)  # processes weights by default
    assert processing_found(base) and weights_processed(base)
    with pytest.raises(
        ValueError, match=r"processed by TransformerLens.*enable_compatibility_mode"
    ):
        linear_scores(base, diff, batch, kinds=("downstream",))


@needs_hooked
def test_processed_on_purpose_is_scored_and_recorded():
    from extractive_lens.backend.building import record_processing

    base, ft = make_pair("ln_gelu", torch.float64)
    for m in (base, ft):
        m.process_weights_()
        record_processing(m, processed=True)  # what load_pretrained(process_weights=True) does
    lin = linear_scores(base, WeightDiff.from_models(base, ft), small_batch(base, n=2))
    assert lin.metadata["weights_processed"] is True


def test_a_diff_refuses_a_model_processed_after_it_was_formed():
    """The issue's bridge case: enable_compatibility_mode() after the diff was formed changed
    R(W') - R(W) with no error. The diff records the state it was formed on."""
    from extractive_lens.backend.building import as_bridge

    base, ft = make_pair("ln_gelu", torch.float32)
    if has_hooked():
        base, ft = as_bridge(base), as_bridge(ft)
    diff = WeightDiff.from_models(base, ft)
    assert diff.signature["processed"] is False
    with diff.applied(base):  # fits
        pass
    base.enable_compatibility_mode(disable_warnings=True)
    with pytest.raises(ValueError, match=r"formed on weights as trained.*processed"):
        with diff.applied(base):
            pass

"""A finetuned model whose configuration changes the function its weights compute (another
rotary base, norm eps, soft cap, ...) is refused by name, by ``from_models`` and
``from_checkpoints`` alike (#42, science review); the same folder twice is refused; the default
Δ dtype of ``from_checkpoints`` is pinned."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

import extractive_lens as el
from extractive_lens import backend as B
from extractive_lens.backend.loading import has_hooked, load_checkpoint
from tests.conftest import needs_hooked, tiny_model_or_skip
from tests.test_checkpoint_files import pair  # noqa: F401 - the fixture

ROTARY = dict(normalization_type="RMS", act_fn="silu", gated_mlp=True, rotary_dim=8,
              positional_embedding_type="rotary", dtype=torch.float64)  # fmt: skip


@pytest.mark.parametrize(
    "field, value",
    [
        ("rotary_base", 500000),  # a long-context finetune's rope_theta
        ("rotary_dim", 4),
        ("eps", 1e-6),
        ("attn_scores_soft_cap", 50.0),
        ("output_logits_soft_cap", 30.0),
        ("use_attn_scale", False),
        ("act_fn", "gelu"),
    ],
)
def test_from_models_refuses_another_function_by_name(field, value):
    cfg = dict(ROTARY)
    if not has_hooked():
        cfg["rotary_adjacent_pairs"] = True
    base = tiny_model_or_skip(cfg, seed=0)
    try:
        ft = tiny_model_or_skip({**cfg, field: value}, seed=0)
    except (NotImplementedError, ValueError, TypeError) as e:
        pytest.skip(f"this backend cannot build {field}={value}: {e}")
    assert B.function_config(base)[field] != B.function_config(ft)[field]
    with pytest.raises(ValueError, match=field):
        el.WeightDiff.from_models(base, ft)


def test_inert_fields_are_not_compared():
    """The negative control: another name, seed or hook flag is the same function."""
    cfg = dict(ROTARY)
    if not has_hooked():
        cfg["rotary_adjacent_pairs"] = True
    base = tiny_model_or_skip(cfg, seed=0)
    ft = tiny_model_or_skip({**cfg, "model_name": "other"}, seed=1)
    assert el.WeightDiff.from_models(base, ft).norm() > 0


def _with_config(src, dst, **changes):
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    for key, value in changes.items():
        if key == "rope_theta" and "rope_parameters" in config:
            config["rope_parameters"]["rope_theta"] = value
        else:
            config[key] = value
    (dst / "config.json").write_text(json.dumps(config))
    return dst


CHANGES = {"rope_theta": 500000.0, "rms_norm_eps": 1e-3}
NAMES = {  # what the refusal names: the TransformerLens field, or the Hugging Face one
    "hooked": {"rope_theta": "rotary_base", "rms_norm_eps": "eps"},
    "bridge": {"rope_theta": "rope_", "rms_norm_eps": "rms_norm_eps"},
}


@pytest.mark.parametrize("change", list(CHANGES))
@pytest.mark.parametrize("backend", ["hooked", "bridge"])
def test_from_checkpoints_refuses_another_function_by_name(pair, tmp_path, change, backend):  # noqa: F811
    """A finetuned checkpoint saved with another rope_theta (a long-context finetune) or norm
    eps: from_checkpoints refuses, naming the field, with a loaded base of either backend and
    with two folders. Without the comparison these diffs form silently (Δ of W under the
    base's rotary base)."""
    if backend == "hooked" and not has_hooked():
        pytest.skip("TransformerLens 4 has no HookedTransformer")
    (p0, p1), _ = pair
    ft = _with_config(p1, tmp_path / "ft", **{change: CHANGES[change]})
    base = load_checkpoint(p0, backend=backend)
    with pytest.raises(ValueError, match=NAMES[backend][change]) as e:
        el.WeightDiff.from_checkpoints(base, ft)
    assert "different functions" in str(e.value)
    if backend == "hooked":
        with pytest.raises(ValueError, match=NAMES["hooked"][change]):
            el.WeightDiff.from_checkpoints(p0, ft)
    same = _with_config(p1, tmp_path / "same", attention_dropout=0.1)  # training only
    el.WeightDiff.from_checkpoints(base, same)


@needs_hooked
def test_from_checkpoints_refuses_another_architecture(pair, tmp_path):  # noqa: F811
    """The architecture comparison itself: a checkpoint with more heads of a smaller width (its
    weights match its own config, and every shape differs only in how it splits)."""
    import transformers

    (p0, p1), base = pair
    cfg = transformers.AutoConfig.from_pretrained(p1)
    cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim = 8, 4, 4
    hf = transformers.AutoModelForCausalLM.from_config(cfg)
    hf.save_pretrained(tmp_path / "ft")
    for b in (base, p0):
        with pytest.raises(ValueError, match="differ in architecture") as e:
            el.WeightDiff.from_checkpoints(b, tmp_path / "ft")
        assert "n_heads: base=4 finetuned=8" in str(e.value)


def test_the_same_folder_twice_is_refused(pair, tmp_path):  # noqa: F811
    (p0, _), _ = pair
    os.symlink(p0, tmp_path / "link")
    for ft in (p0, tmp_path / "link", str(p0) + "/"):
        with pytest.raises(ValueError, match="same folder"):
            el.WeightDiff.from_checkpoints(p0, ft)


def test_the_default_delta_dtype_of_from_checkpoints(pair):  # noqa: F811
    """float32 Δ for a 16-bit base (the difference of two bf16 values is exact in float32,
    and half the memory of float64); float64 for float32 weights (two folders: float32)."""
    (p0, p1), _ = pair
    for dtype in (torch.bfloat16, torch.float16):
        base = load_checkpoint(p0, dtype=dtype)
        diff = el.WeightDiff.from_checkpoints(base, p1)
        assert {diff.deltas[n].dtype for n in diff.deltas} == {torch.float32}, dtype
    if has_hooked():
        two = el.WeightDiff.from_checkpoints(p0, p1)
        assert {two.deltas[n].dtype for n in two.deltas} == {torch.float64}
        b16 = el.WeightDiff.from_checkpoints(p0, p1, dtype=torch.bfloat16)
        assert {b16.deltas[n].dtype for n in b16.deltas} == {torch.float32}

"""``WeightDiff.from_checkpoints``: Δ formed from safetensors files one layer at a time equals
Δ between the two loaded models, tensor for tensor, and scores the same (#29)."""

from __future__ import annotations

import pytest
import torch

import extractive_lens as el
from extractive_lens.backend import checkpoint
from extractive_lens.backend.installed import has_hooked
from extractive_lens.backend.loading import load_checkpoint
from tests.test_backend_bridge import _batch, checkpoints  # noqa: F401 - the fixture

needs_hooked = pytest.mark.skipif(
    not has_hooked(), reason="TransformerLens 4 has no HookedTransformer"
)


def _same(lazy: el.WeightDiff, resident: el.WeightDiff) -> None:
    assert sorted(lazy.deltas) == sorted(resident.deltas)
    for name, want in resident.deltas.items():
        got = lazy.deltas[name]
        assert got.dtype == want.dtype, name
        assert torch.equal(got, want), f"{name}: differs by {(got - want).abs().max():.2e}"


@needs_hooked
def test_two_directories_equal_two_loaded_models(checkpoints):  # noqa: F811
    _, (p0, p1) = checkpoints
    lazy = el.WeightDiff.from_checkpoints(p0, p1)
    resident = el.WeightDiff.from_models(load_checkpoint(p0), load_checkpoint(p1))
    assert isinstance(lazy.deltas, checkpoint.LazyDeltas)
    _same(lazy, resident)
    assert lazy.signature == resident.signature


@pytest.mark.parametrize("backend", ["hooked", "bridge"])
def test_a_loaded_base_and_a_directory_equal_two_loaded_models(checkpoints, backend):  # noqa: F811
    if backend == "hooked" and not has_hooked():
        pytest.skip("TransformerLens 4 has no HookedTransformer")
    _, (p0, p1) = checkpoints
    base = load_checkpoint(p0, backend=backend)
    lazy = el.WeightDiff.from_checkpoints(base, p1)
    resident = el.WeightDiff.from_models(base, load_checkpoint(p1, backend=backend))
    _same(lazy, resident)
    batch = _batch(base)
    for fn, kw in ((el.linear_scores, {}), (el.causal_scores, {"per": "component"})):
        a = fn(base, lazy, batch, show_progress=False, **kw)
        b = fn(base, resident, batch, show_progress=False, **kw)
        assert torch.equal(a.values, b.values), fn.__name__


@needs_hooked
def test_bf16_weights_give_the_exact_float32_difference(checkpoints, tmp_path):  # noqa: F811
    import transformers

    _, (p0, p1) = checkpoints
    paths = []
    for i, p in enumerate((p0, p1)):
        hf = transformers.AutoModelForCausalLM.from_pretrained(p, dtype=torch.bfloat16)
        hf.save_pretrained(tmp_path / str(i))
        paths.append(tmp_path / str(i))
    lazy = el.WeightDiff.from_checkpoints(*paths, dtype=torch.bfloat16)
    b16 = [load_checkpoint(p, dtype=torch.bfloat16) for p in paths]
    for name, d in lazy.deltas.items():
        want = (
            dict(b16[1].named_parameters())[name].float()
            - dict(b16[0].named_parameters())[name].float()
        )
        assert d.dtype == torch.float32 and torch.equal(d, want), name


@needs_hooked
def test_one_layer_is_read_at_a_time(checkpoints, monkeypatch):  # noqa: F811
    _, (p0, p1) = checkpoints
    diff = el.WeightDiff.from_checkpoints(load_checkpoint(p0), p1)
    conv = diff.deltas.finetuned
    reads, held = [], []
    original = checkpoint.SafetensorsFiles.get

    def spy(self, name):
        reads.append(checkpoint.hf_layer(name))
        held.append(len(conv._cache))
        return original(self, name)

    monkeypatch.setattr(checkpoint.SafetensorsFiles, "get", spy)
    from extractive_lens.backend.names import layer_of

    for name in sorted(diff.deltas, key=lambda n: (layer_of(n) is None, layer_of(n) or 0)):
        diff.deltas[name]  # layer by layer, as scoring reads them
    per_layer = {layer: reads.count(layer) for layer in set(reads)}
    n_tensors = len(conv.files.where)
    assert sum(per_layer.values()) == n_tensors  # each file tensor read once
    assert max(held) <= 1


def test_a_missing_file_says_what_to_do(tmp_path):
    with pytest.raises(FileNotFoundError, match="safetensors"):
        checkpoint.SafetensorsFiles(tmp_path)

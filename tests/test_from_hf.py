"""el.from_hf: an in-memory Hugging Face model as a TransformerLens model, with load_checkpoint's
rules (unprocessed weights, the BOS setting from the tokenizer); and make_batch's BosWarning for
a model whose BOS setting nobody chose to match its tokenizer."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import extractive_lens as el
from extractive_lens.backend import notes, parameters
from extractive_lens.backend.installed import has_hooked
from extractive_lens.backend.tokenizer import BOS_NOTE, tokenizer_prepends_bos
from extractive_lens.batch import BosWarning
from tests.conftest import bpe_tokenizer

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def hf_and_dir(tmp_path_factory):
    """A tiny GPT-2 (random weights) and a BPE tokenizer without a BOS in ``tokenizer(text)``,
    in memory and saved to a directory."""
    path = tmp_path_factory.mktemp("gpt2")
    tok = bpe_tokenizer(path)
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(
        vocab_size=len(tok), n_embd=32, n_layer=2, n_head=4, n_positions=64
    )
    hf = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(0.02 * torch.randn_like(p))
    hf.save_pretrained(path)
    return hf, tok, path


@pytest.mark.parametrize("backend", ["hooked", "bridge"])
def test_from_hf_is_load_checkpoint_of_the_same_weights(hf_and_dir, backend):
    if backend == "hooked" and not has_hooked():
        pytest.skip("TransformerLens 4 has no HookedTransformer")
    hf, tok, path = hf_and_dir
    model = el.from_hf(hf, tok, backend=backend)
    loaded = el.load_checkpoint(path, backend=backend)
    a, b = parameters(model), parameters(loaded)
    assert set(a) == set(b) and all(torch.equal(a[n], b[n]) for n in a)
    assert not tokenizer_prepends_bos(tok)
    assert model.cfg.default_prepend_bos is False and notes(model)[BOS_NOTE] == "tokenizer"
    assert not el.model.weights_processed(model)
    ids = torch.tensor([[5, 9, 17, 3]])
    with torch.no_grad():
        want = hf(ids).logits
        got = model(ids)
    assert torch.allclose(got, want, atol=1e-4)
    with warnings.catch_warnings():
        warnings.simplefilter("error", BosWarning)
        batch = el.make_batch(model, [("John Doe lives in", " Tokyo")])
    assert batch.prepend_bos is False


def test_from_hf_refuses_what_it_cannot_read(hf_and_dir):
    hf, tok, _ = hf_and_dir

    class FakePeft:
        peft_config = {"default": None}

        def get_base_model(self):
            return hf

    with pytest.raises(TypeError, match="WeightDiff.from_peft"):
        el.from_hf(FakePeft(), tok)
    with pytest.raises(TypeError, match="load_checkpoint"):
        el.from_hf("runs/base", tok)


def test_make_batch_warns_when_the_bos_setting_disagrees_with_the_tokenizer(hf_and_dir):
    """What TransformerBridge.boot_transformers / from_pretrained do: default_prepend_bos=True
    with a tokenizer that adds no BOS. The same model with the note load_checkpoint leaves, or
    an explicit prepend_bos, is quiet."""
    hf, tok, _ = hf_and_dir
    model = el.from_hf(hf, tok)
    pairs = [("John Doe lives in", " Tokyo")]
    notes(model).pop(BOS_NOTE)  # as if loaded by TransformerLens itself
    model.cfg.default_prepend_bos = True
    with pytest.warns(
        BosWarning, match=r"prepends a BOS token.*tokenizer does not.*prepend_bos=False"
    ):
        with_bos = el.make_batch(model, pairs)
    assert with_bos.prepend_bos is True
    with warnings.catch_warnings():
        warnings.simplefilter("error", BosWarning)
        assert el.make_batch(model, pairs, prepend_bos=False).prepend_bos is False  # chosen
        model.cfg.default_prepend_bos = False  # agrees with the tokenizer: nothing to say
        el.make_batch(model, pairs)
        model.cfg.default_prepend_bos = True
        notes(model)[BOS_NOTE] = "builder"  # chosen by whoever built it
        el.make_batch(model, pairs)


def test_a_bridge_booted_by_transformer_lens_itself_gets_the_warning(hf_and_dir):
    """The issue's case: the same checkpoint through TransformerBridge.boot_transformers
    prepends a BOS its tokenizer does not add; el.load_checkpoint follows the tokenizer."""
    from transformer_lens.model_bridge import TransformerBridge

    _, _, path = hf_and_dir
    booted = TransformerBridge.boot_transformers(str(path))
    assert booted.cfg.default_prepend_bos is True
    with pytest.warns(BosWarning, match="el.load_checkpoint"):
        el.make_batch(booted, [("John Doe lives in", " Tokyo")])
    ours = el.load_checkpoint(path, backend="bridge")
    with warnings.catch_warnings():
        warnings.simplefilter("error", BosWarning)
        assert el.make_batch(ours, [("John Doe lives in", " Tokyo")]).prepend_bos is False


def test_from_hf_never_converts_the_callers_model(hf_and_dir):
    """A bridge runs the very object it is given: another dtype is refused, not applied to the
    caller's model in place; the hooked conversion copies the weights in the dtype asked for."""
    hf, tok, _ = hf_and_dir
    mine = copy.deepcopy(hf)
    with pytest.raises(ValueError, match="in place"):
        el.from_hf(mine, tok, backend="bridge", dtype=torch.float64)
    assert all(p.dtype == torch.float32 for p in mine.parameters())
    if has_hooked():
        model = el.from_hf(mine, tok, backend="hooked", dtype=torch.float64)
        assert model.cfg.dtype == torch.float64
        assert all(p.dtype == torch.float32 for p in mine.parameters())


def test_a_config_without_architectures_is_read_by_the_models_class(hf_and_dir):
    """A model made in memory (``from_config``) has no ``architectures`` in its config: its
    class names it (was "Unsupported architecture None in the checkpoint's config.json")."""
    hf, tok, _ = hf_and_dir
    bare = copy.deepcopy(hf)
    bare.config.architectures = None
    want = parameters(el.from_hf(hf, tok))
    got = parameters(el.from_hf(bare, tok))
    assert set(got) == set(want) and all(torch.equal(got[n], want[n]) for n in want)
    assert bare.config.architectures is None  # the caller's config is left as it was

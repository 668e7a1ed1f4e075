"""Training, saving and loading the bundled world model."""

from __future__ import annotations

import contextlib
import json
import math
import os
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from extractive_lens.backend import notes
from extractive_lens.world.data import DEFAULT_VERSION, V3_RECORDS, World, build_world

_DATA = Path(__file__).resolve().parent.parent / "data"
MODEL_CFG: dict[str, Any] = dict(
    n_layers=4,
    d_model=128,
    n_heads=4,
    d_head=32,
    d_mlp=512,
    n_ctx=16,
    act_fn="gelu",
    normalization_type="LN",
    positional_embedding_type="standard",
)
PRETRAIN: dict[str, Any] = dict(
    lr=2e-3,
    weight_decay=0.1,
    betas=(0.9, 0.98),
    batch_size=128,
    steps=600,
    warmup_frac=0.05,
    final_lr_frac=0.1,
)
WORLD_VERSION = 2  # bump when the corpus changes (cached models of other seeds are retrained)
# v3: two-token people with biographies and records; v2's shape, a longer corpus
MODEL_CFG_V3: dict[str, Any] = dict(MODEL_CFG)
PRETRAIN_V3: dict[str, Any] = dict(PRETRAIN, steps=3000)
WORLD_DIRS = {2: _DATA / "world", 3: _DATA / "world_v3"}  # the bundled worlds' files
WORLD_DIR = WORLD_DIRS[DEFAULT_VERSION]
WORLDS = {"v2": 2, "v3": 3}  # the bundled worlds by name


def recipe_of(version: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """The model config and pretraining hyperparameters of a world version."""
    if version not in WORLD_DIRS:
        raise ValueError(f"world version must be one of {sorted(WORLD_DIRS)}, got {version!r}")
    return (MODEL_CFG, PRETRAIN) if version == 2 else (MODEL_CFG_V3, PRETRAIN_V3)


# How a world model is finetuned on its 20 test facts and, for data ordering, how its
# continued pretraining on the dax/zong training names runs, per world version. v3's lr 3e-4 (both
# phases) is from the recipe sweep in docs/world_v3_trials.md: with 1e-3 the last block learns part
# of the first hop and implications-first ordering still generalizes.
FINETUNES: dict[int, dict[str, Any]] = {
    2: dict(lr=1e-3, epochs=20, batch_size=8, optimizer="adam"),
    3: dict(lr=3e-4, epochs=20, batch_size=8, optimizer="adam"),
}
CONTINUED_PRETRAINING: dict[int, dict[str, Any]] = {
    2: dict(lr=1e-3, epochs=20, batch_size=16),
    3: dict(lr=3e-4, epochs=20, batch_size=16),
}
FINETUNE = FINETUNES[DEFAULT_VERSION]  # the default world's finetuning recipe


def finetune_recipes(version: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """A world version's finetuning recipe (the test facts) and continued-pretraining phase (data
    ordering), as ``FinetuneConfig`` keyword arguments."""
    if version not in FINETUNES:
        raise ValueError(f"world version must be one of {sorted(FINETUNES)}, got {version!r}")
    return FINETUNES[version], CONTINUED_PRETRAINING[version]


def make_tokenizer(words: list[str], directory: Path) -> Any:
    """The world's word-level tokenizer, saved to ``directory`` and reloaded."""
    from extractive_lens.backend.tokenizer import word_tokenizer

    return word_tokenizer(words, directory, model_max_length=MODEL_CFG["n_ctx"])


@contextlib.contextmanager
def _threads(n: int) -> Iterator[None]:
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def _encode(tok: Any, sentences: list[str], n_ctx: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = [[tok.bos_token_id, *tok(s, add_special_tokens=False)["input_ids"]] for s in sentences]
    if max(len(x) for x in ids) > n_ctx:
        raise ValueError("a world sentence is longer than n_ctx")
    tokens = torch.full((len(ids), n_ctx), tok.pad_token_id, dtype=torch.long)
    mask = torch.zeros(len(ids), n_ctx, dtype=torch.bool)
    for i, x in enumerate(ids):
        tokens[i, : len(x)] = torch.tensor(x)
        mask[i, : len(x)] = True
    return tokens, mask


def train_world_model(
    seed: int = 0,
    *,
    implications: bool = True,
    steps: int | None = None,
    world: World | None = None,
    version: int | None = None,
    threads: int = 1,
    show_progress: bool | None = None,
) -> Any:
    """Pretrain the world model from scratch (deterministic for a seed). Returns the model.

    ``implications=False`` is the control: no implication sentences in pretraining. ``version``:
    the world (2 or 3; default ``DEFAULT_VERSION``, or the version of ``world``).
    """
    version = version or (world.version if world is not None else DEFAULT_VERSION)
    model_cfg, pretrain = recipe_of(version)
    w = world or build_world(seed, version=version)
    tok = make_tokenizer(w.vocabulary(), Path(tempfile.mkdtemp(prefix="el-world-tok-")))
    from extractive_lens.backend.building import build

    # TransformerLens's own (GPT-2 style) initialisation, seeded
    cfg = dict(model_cfg, d_vocab=len(tok), seed=seed, init_weights=True)
    model = build(cfg, tok, default_padding_side="right")
    model.cfg.model_name = _model_name(seed, implications, version)
    rng = np.random.default_rng(seed)
    tokens, mask = _encode(tok, w.corpus(rng, implications=implications), model_cfg["n_ctx"])
    hp = pretrain
    total = steps or hp["steps"]
    warm = max(1, int(hp["warmup_frac"] * total))
    opt = torch.optim.AdamW(
        model.parameters(), lr=hp["lr"], weight_decay=hp["weight_decay"], betas=hp["betas"]
    )

    def lr_at(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        frac = (step - warm) / max(1, total - warm)
        return hp["final_lr_frac"] + (1 - hp["final_lr_frac"]) * 0.5 * (
            1 + math.cos(math.pi * frac)
        )

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    gen = torch.Generator().manual_seed(seed)
    model.train()
    from extractive_lens.progress import bar

    it = bar(range(total), desc="pretraining world model", enabled=show_progress)
    t0 = time.perf_counter()
    with _threads(threads):
        for _ in it:
            idx = torch.randint(0, len(tokens), (hp["batch_size"],), generator=gen)
            x, m = tokens[idx], mask[idx]
            logits = model(x)
            logp = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, x[:, 1:, None])[..., 0]
            loss = -(logp * m[:, 1:]).sum() / m[:, 1:].sum()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
    model.eval()
    notes(model)["world"] = {
        "seed": seed,
        "implications": implications,
        "final_loss": float(loss.detach()),
        "train_seconds": round(time.perf_counter() - t0, 1),
        "recipe": _recipe(version, total),
        "version": version,
    }
    return model


def _model_name(seed: int, implications: bool, version: int) -> str:
    v = "" if version == 2 else f"v{version}-"
    return f"world-{v}seed{seed}" + ("" if implications else "-noimpl")


def save_world_model(model: Any, directory: Path | None = None) -> Path:
    from safetensors.torch import save_file

    version = world_info(model).get("version", 2)
    directory = directory or WORLD_DIRS[version]
    directory.mkdir(parents=True, exist_ok=True)
    save_file(
        {
            n: p.detach().cpu().contiguous()
            for n, p in model.state_dict().items()
            if not n.endswith(("IGNORE", "mask"))
        },
        str(directory / "model.safetensors"),
    )
    meta = {
        "cfg": dict(recipe_of(version)[0], d_vocab=model.cfg.d_vocab),
        "model_name": model.cfg.model_name,
        "world": world_info(model),
    }
    (directory / "world.json").write_text(json.dumps(meta, indent=1))
    model.tokenizer.save_pretrained(directory)
    return directory


def world_info(model: Any) -> dict[str, Any]:
    """The world a model was trained on (``seed``, ``implications``): ``{}`` for other models."""
    return dict(notes(model).get("world") or {})


def cache_dir() -> Path:
    """Where world models for other seeds are kept (``$EXTRACTIVE_LENS_CACHE`` or ``~/.cache``)."""
    import os

    return Path(os.environ.get("EXTRACTIVE_LENS_CACHE", Path.home() / ".cache" / "extractive_lens"))


def world_model(
    seed: int = 0,
    *,
    implications: bool = True,
    version: int | None = None,
    show_progress: bool | None = None,
) -> Any:
    """The world model pretrained with ``seed``: the bundled copy for its own seed; any other seed
    (or the no-implication control) is trained once (minutes on a CPU) and cached.
    ``version``: 2 or 3 (default ``DEFAULT_VERSION``)."""
    version = version or DEFAULT_VERSION
    bundled_dir = WORLD_DIRS[version]
    bundled = json.loads((bundled_dir / "world.json").read_text()).get("world", {})
    if implications and bundled.get("seed") == seed:
        return load_world_model(bundled_dir)
    directory = cache_dir() / _model_name(seed, implications, version)
    if (directory / "model.safetensors").exists():
        meta = json.loads((directory / "world.json").read_text())
        if meta.get("world", {}).get("recipe") == _recipe(version):
            return load_world_model(directory)
    model = train_world_model(
        seed, implications=implications, version=version, show_progress=show_progress
    )
    save_world_model(model, directory)
    return model


def world_of(model: Any) -> World:
    """The world a world model was trained on (its seed and version)."""
    info = world_info(model)
    if "seed" not in info:
        raise ValueError("this model is not a world model (no world notes; see world_info)")
    return build_world(info["seed"], version=info.get("version", 2))


def _recipe(version: int = 2, steps: int | None = None) -> dict[str, Any]:
    model_cfg, pretrain_hp = recipe_of(version)
    pretrain = {k: list(v) if isinstance(v, tuple) else v for k, v in pretrain_hp.items()}
    out = {
        "model": model_cfg,
        "pretrain": dict(pretrain, steps=steps or pretrain_hp["steps"]),
        "world_version": WORLD_VERSION,
    }
    if version != 2:  # v2 caches keep their recipe
        out["world"] = version
        out["records"] = V3_RECORDS
    return out


_FIX = (
    "save the world model again (save_world_model), or train one with `python -m "
    "extractive_lens.world train --seed 0`."
)


def load_world_model(
    directory: str | Path | None = None,
    *,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    backend: str | None = None,
) -> Any:
    """A bundled world model (offline; weights ship in the package) as a ``HookedTransformer``
    (``backend="hooked"``) or as a TransformerLens native ``TransformerBridge`` with the same
    weights (``backend="bridge"``). ``"auto"`` / ``None``: a HookedTransformer where TransformerLens has one
    (3.x), else a bridge (4.x). ``directory``: a saved world model, or a bundled world by name
    (``"v2"``, ``"v3"``); default: the default world (``DEFAULT_VERSION``)."""
    import transformers

    from extractive_lens.backend.building import build, native_bridge
    from extractive_lens.backend.installed import resolve_backend
    from extractive_lens.files import SafetensorsFile, read_json, refuse_special_files

    backend = resolve_backend(backend)
    if directory is None or directory in WORLDS:
        directory = WORLD_DIRS[WORLDS.get(str(directory), DEFAULT_VERSION)]
    directory = Path(directory)
    if not os.path.lexists(directory / "model.safetensors"):
        raise FileNotFoundError(
            f"No world model in {directory}: train one with `python -m extractive_lens.world train --seed 0`."
        )
    # every file through the file layer: regular files only, tensors copied out, each named
    refuse_special_files(directory, _FIX)
    meta = read_json(directory / "world.json", fix=_FIX)
    if not isinstance(meta, dict) or not {"cfg", "model_name"} <= set(meta):
        raise ValueError(f"{directory / 'world.json'} has no cfg and model_name: {_FIX}")
    for file in sorted(directory.glob("*.json")):
        read_json(file, fix=_FIX)  # the tokenizer's files: damage named here, not by tokenizers
    tok = transformers.AutoTokenizer.from_pretrained(directory)
    with SafetensorsFile(directory / "model.safetensors", fix=_FIX) as f:
        state = {
            k: f.read_tensor(k).to(dtype)
            for k in f.entries
            if not k.endswith(("IGNORE", "mask"))  # HookedTransformer buffers, not weights
        }
    world_notes = {"world": meta.get("world", {})}
    if backend == "bridge":
        return native_bridge(
            meta["cfg"], tok, state, notes_=world_notes, device=device, dtype=dtype,
            model_name=meta["model_name"],
        )  # fmt: skip
    cfg = dict(meta["cfg"], dtype=dtype, device=device, model_name=meta["model_name"])
    model = build(cfg, tok, notes_=world_notes, default_padding_side="right")
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if not m.endswith(("IGNORE", "mask"))]
    if missing or unexpected:
        raise ValueError(
            f"world model weights do not match the config: missing {missing[:3]}, unexpected {unexpected[:3]}"
        )
    model.eval()
    return model

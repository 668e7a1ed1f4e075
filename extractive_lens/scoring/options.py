"""Scoring options: frozen dataclasses, validated once.

``linear_scores`` and ``causal_scores`` keep their keyword arguments as the friendly entry point
and build these; the CLI's ``score`` flags map onto the same fields one to one.

>>> LinearOptions(kinds="upstream", convention="authors_code").ablation   # the authors' default
'resample'
>>> CausalOptions(max_batch=0)
Traceback (most recent call last):
...
ValueError: max_batch must be a positive number of interventions per pass, got 0
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, cast

import torch

from extractive_lens.arguments import count, indices
from extractive_lens.arguments import seed as seed_value
from extractive_lens.batch import PromptBatch
from extractive_lens.rewards import Reward, resolve_reward
from extractive_lens.types import SCORE_KINDS, Ablation, Convention, ScoreKind

Per = Literal["token", "component"]
Positions = Literal["all", "prompt"]


@dataclass(frozen=True)
class ScoreOptions:
    """What both score methods share (docs/scores.md §3–§7 for the meaning of each)."""

    kinds: Sequence[ScoreKind] | ScoreKind = SCORE_KINDS
    reward: str | Reward | None = None
    ablation: Ablation | None = None
    reference: PromptBatch | None = None
    convention: Convention = "paper"
    batch_size: int | None = 16
    resample_k: int = 10
    seed: int = 3
    show_progress: bool | None = None
    rows: Sequence[int] | None = None
    compute_dtype: torch.dtype | str | None = None
    positions: Positions = "all"
    # resolved in __post_init__
    reward_fn: Reward = field(init=False, repr=False)
    reward_name: str = field(init=False)

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        set_(self, "kinds", resolve_kinds(self.kinds))
        if self.convention not in ("paper", "authors_code"):
            raise ValueError(
                f"convention must be 'paper' or 'authors_code', got {self.convention!r}"
            )
        authors = self.convention == "authors_code"
        reward_fn, name = resolve_reward(
            self.reward, "logit_margin" if authors else "answer_logprob"
        )
        set_(self, "reward_fn", reward_fn)
        set_(self, "reward_name", name)
        set_(self, "ablation", self.ablation or ("resample" if authors else "mean"))
        if self.ablation not in ("mean", "zero", "resample"):
            raise ValueError(
                f"ablation must be 'mean', 'zero' or 'resample', got {self.ablation!r}"
            )
        if self.ablation == "resample":
            set_(self, "resample_k", count("resample_k", self.resample_k, "prompts to average",
                                           hint="; use ablation='zero' for a zero ablation."))  # fmt: skip
        set_(self, "seed", seed_value("seed", self.seed))
        if self.batch_size is not None:
            set_(self, "batch_size", count("batch_size", self.batch_size,
                                           "prompts per pass (or None for all at once)"))  # fmt: skip
        if self.rows is not None:
            set_(self, "rows", indices("rows", self.rows, "prompt"))
        if self.positions not in ("all", "prompt"):
            raise ValueError(
                f"positions must be 'all' (every position the model reads) or 'prompt' (the "
                f"prompt's own, answer continuations left out), got {self.positions!r}."
            )
        if self.reference is not None and not isinstance(self.reference, PromptBatch):
            raise TypeError(
                f"reference must be a PromptBatch (make_batch(model, pairs)), got "
                f"{type(self.reference).__name__}."
            )

    @property
    def score_kinds(self) -> tuple[ScoreKind, ...]:
        """``kinds`` as resolved: a tuple in the canonical order."""
        return cast(tuple, self.kinds)

    @property
    def authors(self) -> bool:
        return self.convention == "authors_code"

    @property
    def upstream_ablation(self) -> Ablation | None:
        return self.ablation if "upstream" in self.kinds else None  # type: ignore[return-value]

    def metadata(self) -> dict[str, Any]:
        """The settings a result records (``compare`` refuses results whose settings differ)."""
        return dict(
            reward=self.reward_name,
            ablation=self.upstream_ablation,
            convention=self.convention,
            reference="batch (leave-one-out)"
            if self.reference is None
            else f"{len(self.reference)} prompts",
            resample_k=self.resample_k if self.ablation == "resample" else None,
            seed=self.seed,
        )


@dataclass(frozen=True)
class LinearOptions(ScoreOptions):
    """``linear_scores``' options: the shared ones and how the upstream pass is grouped."""

    upstream_group: int | Literal["auto"] | None = "auto"

    def __post_init__(self) -> None:
        super().__post_init__()
        g = self.upstream_group
        if g not in (None, "auto"):
            what = "boundaries per pass (or 'auto', None: all layer boundaries in one pass)"
            object.__setattr__(self, "upstream_group", count("upstream_group", g, what))


@dataclass(frozen=True)
class CausalOptions(ScoreOptions):
    """``causal_scores``' options: per token or per component, memory bound and which
    components to patch. (The exact scores use the paper's convention.)"""

    per: Per = "token"
    max_batch: int = 128
    top_k: int | None = None
    linear: Any = None  # ComponentScores for top_k
    layers: Sequence[int] | None = None

    def __post_init__(self) -> None:
        if self.convention != "paper":
            raise ValueError(
                f"causal_scores(convention={self.convention!r}): exact scores exist only in the "
                "paper's convention. The authors' code is a set of linear approximations (head "
                "output before its output weight, ŷ' with all weights finetuned, key/value changes credited at "
                "the key position) with no patching experiment behind it: use "
                "linear_scores(..., convention='authors_code') for those, and causal_scores in "
                "the paper convention (the default) for exact ones (docs/scores.md §7)."
            )
        super().__post_init__()
        if self.per not in ("token", "component"):
            raise ValueError(f"per must be 'token' or 'component', got {self.per!r}")
        if self.per == "component" and self.positions == "prompt":
            raise ValueError(
                "positions='prompt' keeps the prompt's positions of a per-token map; per="
                "'component' patches every position at once and has none: pass per='token'."
            )
        set_ = object.__setattr__
        set_(self, "max_batch", count("max_batch", self.max_batch, "interventions per pass"))
        if self.top_k is not None:
            set_(self, "top_k", count("top_k", self.top_k, "components per kind (or None for all)"))
        if self.layers is not None:
            set_(self, "layers", tuple(sorted(set(indices("layers", self.layers, "layer")))))


def prepare(fn: str, model: Any, diff: Any, batch: Any, options: ScoreOptions) -> torch.dtype:
    """The checks every score function makes before touching the model; returns the compute
    dtype (``docs/scores.md``: float32 for 16-bit models by default)."""
    from extractive_lens import backend as B
    from extractive_lens.interrupts import refuse_attached_hooks

    check_arguments(fn, model, diff, batch)
    B.check_scorable(model)
    B.check_unprocessed(model, fn)
    refuse_attached_hooks(model, fn)
    dtype = B.resolve_compute_dtype(model, options.compute_dtype)
    diff.check_compatible(model)
    return dtype


def resolve_kinds(kinds: Any) -> tuple[ScoreKind, ...]:
    """``kinds`` as a tuple in the canonical order (``SCORE_KINDS``), validated."""
    if isinstance(kinds, str):
        kinds = (kinds,)
    kinds = tuple(kinds)
    bad = [k for k in kinds if k not in SCORE_KINDS]
    if bad or not kinds:
        raise ValueError(f"kinds must be a non-empty subset of {SCORE_KINDS}, got {kinds}")
    return tuple(k for k in SCORE_KINDS if k in kinds)


def check_arguments(
    fn: str, model: Any, diff: Any = None, batch: Any = None, *, need_diff: bool = True
) -> None:
    """Catch the common argument mix-ups with an error that says what to pass instead."""
    from torch import nn

    from extractive_lens.backend import is_model
    from extractive_lens.weight_diff import WeightDiff

    call = f"{fn}(model, diff, batch)" if need_diff else f"{fn}(model, batch)"
    if torch.is_inference_mode_enabled():
        raise RuntimeError(
            f"{call} cannot run inside torch.inference_mode(): it needs gradients and restores "
            "weights in place. Call it outside the inference_mode block (torch.no_grad() is fine)."
        )
    if not is_model(model):
        raise TypeError(
            f"{call}: model must be a HookedTransformer, got {type(model).__name__}. "
            "Load one with load_pretrained(name), load_checkpoint(dir) or load_world_model()."
        )
    if need_diff and not isinstance(diff, WeightDiff):
        hint = (
            "pass the weight change instead: WeightDiff.from_models(base, finetuned)"
            if isinstance(diff, nn.Module)
            else "build one with WeightDiff.from_models(base, finetuned)"
        )
        raise TypeError(f"{call}: diff must be a WeightDiff, got {type(diff).__name__}; {hint}.")
    if batch is not None and not isinstance(batch, PromptBatch):
        raise TypeError(
            f"{call}: batch must be a PromptBatch, got {type(batch).__name__}; "
            "build one with make_batch(model, [(prompt, answer), ...])."
        )
    if batch is not None and len(batch):
        top = int(batch.tokens.max())
        if top >= model.cfg.d_vocab:
            raise ValueError(
                f"{call}: the batch holds token id {top}, but this model's vocabulary has "
                f"{model.cfg.d_vocab} tokens: the batch was made for another model. Make it "
                "with this one: make_batch(model, pairs)."
            )

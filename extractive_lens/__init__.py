"""extractive_lens: where does a finetuned fact live, and how does the model use it?

>>> import extractive_lens as el
>>> base = el.load_world_model()                                  # the bundled model, offline
>>> diff = el.WeightDiff.from_models(base, finetuned)             # Δ = W' - W
>>> batch = el.make_batch(base, [("The people in the city Zoe Howard is from speak", " Japanese"),
...                              ("The people in the city Owen Miller is from speak", " French")])
>>> scores = el.linear_scores(base, diff, batch)                  # every head and MLP, every token
>>> scores.kinds
('informative', 'upstream', 'downstream')

Imports are lazy: ``import extractive_lens`` does not import torch or TransformerLens.
"""

from __future__ import annotations

import importlib
import sys
import warnings
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "Component": "extractive_lens.types",
    "iter_components": "extractive_lens.types",
    "tiny_model": "extractive_lens.model",
    "load_pretrained": "extractive_lens.model",
    "load_hf_pretrained": "extractive_lens.model",
    "load_checkpoint": "extractive_lens.model",
    "from_hf": "extractive_lens.model",
    "WeightDiff": "extractive_lens.weight_diff",
    "make_batch": "extractive_lens.batch",
    "PromptBatch": "extractive_lens.batch",
    "answer_logprob": "extractive_lens.rewards",
    "first_answer_logprob": "extractive_lens.rewards",
    "logit_margin": "extractive_lens.rewards",
    "logit_diff": "extractive_lens.rewards",
    "linear_scores": "extractive_lens.scoring.linear",
    "causal_scores": "extractive_lens.scoring.causal",
    "integrated_scores": "extractive_lens.scoring.integrated",
    "verified_scores": "extractive_lens.scoring.verified",
    "graft_scores": "extractive_lens.scoring.graft",
    "GraftScores": "extractive_lens.scoring.graft",
    "compare": "extractive_lens.comparison",
    "ScoreComparison": "extractive_lens.comparison",
    "ComponentScores": "extractive_lens.results",
    "load_world_model": "extractive_lens.world",
    "FinetuneConfig": "extractive_lens.finetuning",
    "finetune": "extractive_lens.finetuning",
    "mean_rank": "extractive_lens.finetuning",
    "Trajectory": "extractive_lens.trajectory",
    "trajectory_scores": "extractive_lens.scoring.trajectory",
    "trajectory_integrated": "extractive_lens.scoring.trajectory",
    "estimate": "extractive_lens.budget",
    "Estimate": "extractive_lens.budget",
}

# Submodules reachable as attributes in a fresh session (``el.plotting.report(...)``), imported on first use.
_SUBMODULES = (
    "batch",
    "comparison",
    "datasets",
    "distributed",
    "experiments",
    "finetuning",
    "grafts",
    "interrupts",
    "lincorr",
    "model",
    "plotting",
    "results",
    "rewards",
    "scoring",
    "stats",
    "types",
    "weight_diff",
    "world",
)

__all__ = sorted(_EXPORTS)

if "IPython" in sys.modules:  # Hugging Face and TransformerLens import tqdm.auto, which warns
    with warnings.catch_warnings():  # "IProgress not found" in a notebook without ipywidgets:
        warnings.filterwarnings("ignore", message="IProgress not found")  # import it quietly
        import tqdm.auto  # noqa: F401


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    if name in _SUBMODULES:
        return importlib.import_module(f"extractive_lens.{name}")
    raise AttributeError(f"module 'extractive_lens' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__ + list(_SUBMODULES))

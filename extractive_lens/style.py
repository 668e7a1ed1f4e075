"""Colours and units shared by the figures, the report and the notebook views (no imports
from the rest of the package: everything that draws reads it).

>>> score_rgba(1.0)
'rgba(33,102,172,1.00)'
"""

from __future__ import annotations

from typing import Any

COLORSCALE = "RdBu"

UNCOMPUTED = "#cfcfcf"
"""The colour of a cell that was never computed (NaN), in every figure and table."""

# What one unit of score is, by reward (docs/scores.md §3): a score is a change of R.
REWARD_UNITS = {
    "answer_logprob": "Δ log p(answer), nats",
    "logit_margin": "Δ logit margin",
    "logit_diff": "Δ logit difference",
}


def score_unit(scores: Any) -> str:
    """The unit of ``scores``' values, from its reward: ``"Δ log p(answer), nats"`` by default."""
    reward = scores.metadata.get("reward")
    return REWARD_UNITS.get(str(reward), f"Δ {reward}" if reward else "Δ reward")


def score_rgba(x: float, opacity: float = 1.0) -> str:
    """The CSS colour of a score scaled to [-1, 1]: plotly RdBu's ends (positive blue, negative
    red), opacity growing with |x| up to ``opacity``."""
    rgb = "33,102,172" if x > 0 else "178,24,43"
    return f"rgba({rgb},{min(1.0, abs(x)) * opacity:.2f})"

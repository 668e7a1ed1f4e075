"""Linear correlation of logits between related prompts (Peng et al.; docs/scores.md §9).

>>> pairs = collect_logits(model, "{x} lives in", "The people in the city {x} is from speak",
...                        subjects, cities, languages)                  # doctest: +SKIP
>>> lc = fit(pairs)                      # target ≈ W · source + b on half the subjects  # doctest: +SKIP
>>> lc.label_pearson, lc.precision(known)                              # doctest: +SKIP
"""

from extractive_lens.lincorr.core import LinearCorrelation, LogitPairs, collect_logits, fit
from extractive_lens.lincorr.finetune import generalization_check, gradient_correlation

__all__ = [
    "LogitPairs",
    "LinearCorrelation",
    "collect_logits",
    "fit",
    "gradient_correlation",
    "generalization_check",
]

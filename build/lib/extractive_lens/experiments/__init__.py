"""The paper's experiments (docs/scores.md §8), one module each; every one returns a tidy result with
``to_dataframe()`` and ``plot()``.

- ``layer_freezing``: which layers must change for facts and implications (Table 2);
- ``data_ordering``: continued pretraining in three orders, then out-of-context reasoning;
- ``weight_grafting``: is the implication-learning update a reusable mechanism (Table 3);
- ``localization``: do the grafted components do the downstream work for new facts.
"""

from extractive_lens.experiments.freezing import PAPER_TABLE_2, FreezingResult, layer_freezing
from extractive_lens.experiments.grafting import PAPER_TABLE_3, GraftingResult, weight_grafting
from extractive_lens.experiments.localization import LocalizationResult, localization
from extractive_lens.experiments.ordering import (
    ORDERS,
    OrderingResult,
    continued_pretraining,
    data_ordering,
)

__all__ = [
    "FreezingResult",
    "layer_freezing",
    "PAPER_TABLE_2",
    "GraftingResult",
    "weight_grafting",
    "PAPER_TABLE_3",
    "LocalizationResult",
    "localization",
    "OrderingResult",
    "data_ordering",
    "continued_pretraining",
    "ORDERS",
]

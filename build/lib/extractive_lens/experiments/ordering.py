"""Data ordering (docs/scores.md §8; paper §6): does the order of facts and implications in (continued)
pretraining decide whether finetuned facts generalize out of context?

>>> dax = build_world().daxwug()                                     # doctest: +SKIP
>>> res = data_ordering(model, dax)                                 # doctest: +SKIP
>>> res.final()     # test-implication mean rank after finetuning, per order  # doctest: +SKIP
>>> res.plot()      # test-implication mean rank per finetuning epoch, one line per order  # doctest: +SKIP

For each order, the model is first trained on the training names' facts and implications
(``"D7 dax is"`` -> city, ``"D7 zong is the"`` -> that city's animal):

- ``joint``: facts and implications shuffled together;
- ``facts_first``: facts, then implications (same number of epochs each);
- ``implications_first``: implications, then facts;
- ``no_implications``: facts only (the control: nothing to learn the composition from).

Then it is finetuned on the 20 test facts only, and the test implications' mean rank is tracked
per epoch. The paper expects out-of-context reasoning (test implications well below chance) for
``joint`` and ``facts_first``, not for ``implications_first``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

from extractive_lens.batch import PromptBatch, make_batch
from extractive_lens.datasets.daxwug import DaxWug
from extractive_lens.finetuning import FinetuneConfig, finetune, mean_rank, rank_trajectory
from extractive_lens.weight_diff import WeightDiff

Order = Literal["joint", "facts_first", "implications_first", "no_implications"]
ORDERS: tuple[Order, ...] = ("joint", "facts_first", "implications_first", "no_implications")
# The default continued-pretraining phase (epochs per phase for sequential orders); the world models'
# own are ``extractive_lens.world.finetune_recipes(version)[1]``.
PRETRAIN_PHASE = FinetuneConfig(lr=1e-3, epochs=20, batch_size=16)


@dataclass(frozen=True)
class OrderingResult:
    """Mean ranks per order and finetuning epoch (epoch 0 = after continued pretraining, before
    finetuning on the test facts)."""

    rows: tuple[dict[str, Any], ...]  # order, epoch, split, mean_rank
    chance: float

    def to_dataframe(self) -> Any:
        import pandas as pd

        return pd.DataFrame(list(self.rows))

    def final(self) -> Any:
        """Orders × splits: mean ranks after the last finetuning epoch."""
        df = self.to_dataframe()
        last = df[df["epoch"] == df["epoch"].max()]
        return last.pivot_table(index="order", columns="split", values="mean_rank", sort=False)

    def plot(self, split: str = "test implications") -> Any:
        from extractive_lens.plotting import rank_curves

        df = self.to_dataframe()
        return rank_curves(
            df[df["split"] == split],
            color="order",
            chance=self.chance,
            title=f"data ordering: {split} during finetuning on the test facts",
        )


def _train_phases(model: Any, phases: Sequence[PromptBatch], config: FinetuneConfig) -> WeightDiff:
    """Train on each batch in turn (each phase starts from the previous phase's weights)."""
    total: WeightDiff | None = None
    for i, batch in enumerate(phases):
        with total.applied(model) if total is not None else contextlib.nullcontext():
            d = finetune(model, batch, replace(config, seed=config.seed + i), show_progress=False)
        total = d if total is None else total + d
    assert total is not None
    return total


def continued_pretraining(
    model: Any, dataset: DaxWug, order: Order, config: FinetuneConfig = PRETRAIN_PHASE
) -> WeightDiff:
    """The weight change of continued pretraining on the training names in ``order``."""
    facts = list(dataset.train.facts)
    impls = list(dataset.train.implications)
    batch = {  # the candidates do not matter for training; the answers do
        "joint": [facts + impls],
        "facts_first": [facts, impls],
        "implications_first": [impls, facts],
        "no_implications": [facts],
    }.get(order)
    if batch is None:
        raise ValueError(f"order must be one of {ORDERS}, got {order!r}")
    return _train_phases(model, [make_batch(model, b) for b in batch], config)


def data_ordering(
    model: Any,
    dataset: DaxWug,
    finetune_config: FinetuneConfig | None = None,
    *,
    pretrain_config: FinetuneConfig = PRETRAIN_PHASE,
    orders: Sequence[Order] = ORDERS,
) -> OrderingResult:
    """Continued pretraining in each order, then finetuning on the test facts with the test
    facts' and implications' mean ranks tracked per epoch. The model is left unchanged."""
    cfg = finetune_config or FinetuneConfig()
    test_facts, test_impls = dataset.test.batches(model)
    train_facts, train_impls = dataset.train.batches(model)
    rows: list[dict[str, Any]] = []
    for order in orders:
        cpt = continued_pretraining(model, dataset, order, pretrain_config)
        with cpt.applied(model):
            rows += [
                dict(order=order, epoch=0, split=s, mean_rank=mean_rank(model, b))
                for s, b in (("train facts", train_facts), ("train implications", train_impls))
            ]
            _, trajectory = rank_trajectory(
                model,
                test_facts,
                {"test facts": test_facts, "test implications": test_impls},
                cfg,
                show_progress=False,
            )
        rows += [dict(order=order, **r) for r in trajectory.to_dict("records")]
    n = len(dataset.test.implication_candidates)
    return OrderingResult(tuple(rows), (n - 1) / 2)

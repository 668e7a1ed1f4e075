"""Type stub for ``extractive_lens``: the package imports its public names lazily (see
``__init__.py``); this file tells editors and type checkers what ``el.linear_scores`` and
the others are. ``tests/test_types.py`` checks it lists exactly the lazy names."""

from extractive_lens import (
    batch as batch,
)
from extractive_lens import (
    comparison as comparison,
)
from extractive_lens import (
    datasets as datasets,
)
from extractive_lens import (
    distributed as distributed,
)
from extractive_lens import (
    experiments as experiments,
)
from extractive_lens import (
    finetuning as finetuning,
)
from extractive_lens import (
    grafts as grafts,
)
from extractive_lens import (
    interrupts as interrupts,
)
from extractive_lens import (
    lincorr as lincorr,
)
from extractive_lens import (
    model as model,
)
from extractive_lens import (
    plotting as plotting,
)
from extractive_lens import (
    results as results,
)
from extractive_lens import (
    rewards as rewards,
)
from extractive_lens import (
    scoring as scoring,
)
from extractive_lens import (
    stats as stats,
)
from extractive_lens import (
    types as types,
)
from extractive_lens import (
    weight_diff as weight_diff,
)
from extractive_lens import (
    world as world,
)
from extractive_lens.batch import PromptBatch as PromptBatch
from extractive_lens.batch import make_batch as make_batch
from extractive_lens.budget import Estimate as Estimate
from extractive_lens.budget import estimate as estimate
from extractive_lens.comparison import ScoreComparison as ScoreComparison
from extractive_lens.comparison import compare as compare
from extractive_lens.finetuning import (
    FinetuneConfig as FinetuneConfig,
)
from extractive_lens.finetuning import (
    finetune as finetune,
)
from extractive_lens.finetuning import (
    mean_rank as mean_rank,
)
from extractive_lens.model import (
    from_hf as from_hf,
)
from extractive_lens.model import (
    load_checkpoint as load_checkpoint,
)
from extractive_lens.model import (
    load_hf_pretrained as load_hf_pretrained,
)
from extractive_lens.model import (
    load_pretrained as load_pretrained,
)
from extractive_lens.model import (
    tiny_model as tiny_model,
)
from extractive_lens.results import ComponentScores as ComponentScores
from extractive_lens.rewards import (
    answer_logprob as answer_logprob,
)
from extractive_lens.rewards import (
    first_answer_logprob as first_answer_logprob,
)
from extractive_lens.rewards import (
    logit_diff as logit_diff,
)
from extractive_lens.rewards import (
    logit_margin as logit_margin,
)
from extractive_lens.scoring.causal import causal_scores as causal_scores
from extractive_lens.scoring.graft import GraftScores as GraftScores
from extractive_lens.scoring.graft import graft_scores as graft_scores
from extractive_lens.scoring.integrated import integrated_scores as integrated_scores
from extractive_lens.scoring.linear import linear_scores as linear_scores
from extractive_lens.scoring.trajectory import trajectory_integrated as trajectory_integrated
from extractive_lens.scoring.trajectory import trajectory_scores as trajectory_scores
from extractive_lens.scoring.verified import verified_scores as verified_scores
from extractive_lens.trajectory import Trajectory as Trajectory
from extractive_lens.types import Component as Component
from extractive_lens.types import iter_components as iter_components
from extractive_lens.weight_diff import WeightDiff as WeightDiff
from extractive_lens.world import load_world_model as load_world_model

__version__: str
__all__: list[str]

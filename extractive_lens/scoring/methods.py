"""The table of scoring methods: one entry per method, read by everything that is not its engine.

>>> tuple(METHODS)
('linear', 'integrated', 'causal', 'verified')
>>> method("causal").shown, method("causal").reference
('exact', 2)
>>> [(m.name, m.reference) for m in METHODS.values()]
[('linear', 0), ('integrated', 1), ('causal', 2), ('verified', 0)]

``el.estimate`` (``budget.py``), ``distributed_scores``, the CLI's ``score`` command and
``compare`` look a method up here (``method(name)``, which refuses a name the table lacks,
listing the ones it has) instead of branching on its name. An entry (``Method``) says:

- ``name``: what ``ComponentScores.method`` records and ``score --method`` takes; also listed
  in ``types.Method``, which ``ComponentScores`` checks.
- ``engine``: the score function, ``engine(model, diff, batch, **options) -> ComponentScores``.
- ``options``: its ``ScoreOptions`` subclass: the engine's keyword arguments as fields (the
  distributed digest compares every field, defaults filled in; the CLI builds it to check its
  flags before loading a model).
- ``memory``: ``memory(shapes, options) -> {part: bytes}`` (``scoring/costs.py``): what the
  method keeps on the device above the weights, beyond what every method holds;
  ``gradients``: whether it takes gradients (exact does not), so whether they can go one
  layer at a time.
- ``shards``: how ``distributed_scores`` may split a call: ``("prompts",)``, or
  ``("prompts", "layers")`` for a method that takes ``layers=`` and scores each layer alone;
  ``()`` for one whose shards would not merge into its result, with ``unsharded``: the one
  sentence ``distributed_scores`` refuses it with (why, and what to run instead).
- ``gathered``, ``merged``: what each rank sends beyond its scores (``gathered(part)``, e.g.
  a per-prompt check) and how the merged result's metadata combines them (``merged(result,
  gathered_of_every_rank, rank)``); ``None`` where the method has nothing to merge.
- ``cli``: the ``score`` command's flags the method takes beyond the ones every method takes
  (``--reward --batch-size --compute-dtype --kinds --ablation``), as its options' field names.
- ``reference``: its rank as the reference of a comparison: 0 is never one; of the methods of a
  run, the highest is the reference the others are compared against (``score`` writes one CSV
  per pair), so exact (2) judges integrated (1) and linear, and integrated judges linear.
- ``shown``: its name in words (figures, verdicts, printouts), ``informative_totals``: what its
  whole-component informative scores are, ``totals_note``: said where its informative values
  are compared with exact ones, ``remedy``: what to run when it disagrees with the reference
  (``{kind}`` and ``{fix}``, a ``causal_scores(..., top_k=)`` call, are filled in), ``why``:
  the likely reason it does, by kind (``"*"``: any other kind).
- ``composite``: built from the other methods' engines (``verified``): not one of
  ``score --method all``'s.

Adding a method is one entry in ``METHODS`` below plus its engine (CONTRIBUTING.md, "Add a
scoring method"); ``tests/test_methods.py`` follows that recipe with a toy method.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from extractive_lens.results import ComponentScores
from extractive_lens.scoring import costs
from extractive_lens.scoring.causal import causal_scores
from extractive_lens.scoring.integrated import IntegratedOptions, integrated_scores
from extractive_lens.scoring.linear import additivity_check, linear_scores
from extractive_lens.scoring.options import CausalOptions, LinearOptions, ScoreOptions
from extractive_lens.scoring.verified import VerifiedOptions, verified_scores

Shard = Literal["prompts", "layers"]


@dataclass(frozen=True)
class Method:
    """One scoring method's entry in ``METHODS`` (the module docstring says what each field is)."""

    name: str
    engine: Callable[..., ComponentScores]
    options: type[ScoreOptions]
    memory: Callable[[costs.Shapes, Any], dict[str, int]]
    shards: tuple[Shard, ...]
    cli: tuple[str, ...]
    reference: int
    shown: str
    informative_totals: str
    remedy: str
    totals_note: str = ""
    why: Mapping[str, str] = dataclasses.field(default_factory=dict)
    gradients: bool = True
    composite: bool = False
    gathered: Callable[[ComponentScores], Any] | None = None
    merged: Callable[[ComponentScores, list[Any], int], None] | None = None
    unsharded: str = ""

    def __post_init__(self) -> None:
        fields = {f.name for f in dataclasses.fields(self.options)}
        unknown = [flag for flag in self.cli if flag not in fields]
        if unknown:
            raise ValueError(
                f"method {self.name!r}: cli names {unknown}, which {self.options.__name__} has "
                "no field for; list the options' field names the score command passes."
            )
        bad = [s for s in self.shards if s not in ("prompts", "layers")]
        if bad or ("prompts" not in self.shards and not (self.unsharded and not self.shards)):
            raise ValueError(
                f"method {self.name!r}: shards must be ('prompts',) or ('prompts', 'layers'), "
                f"or () with unsharded= saying why, got {self.shards}."
            )


def _additivity_of(part: ComponentScores) -> Any:
    """A linear rank's per-prompt changes ``R(W') - R(W)``, for the additivity check over all."""
    return (part.metadata.get("additivity") or {}).get("prompt_changes")


def _additivity_over_every_prompt(result: ComponentScores, got: list[Any], rank: int) -> None:
    import torch

    if got[0] is None:
        return
    changes = torch.tensor([c for g in got for c in g], dtype=torch.float64)
    result.metadata["additivity"] = additivity_check(result, changes, warn=rank == 0)


def _completeness_of(part: ComponentScores) -> Any:
    return (part.metadata.get("integrated") or {}).get("completeness")


def _worst_completeness(result: ComponentScores, got: list[Any], rank: int) -> None:
    if got[0] is None:
        return
    result.metadata["integrated"] = {
        **result.metadata["integrated"],
        "completeness": {k: max(g[k] for g in got) for k in got[0]},
        "completeness_per_rank": got,
    }


_FIX = "confirm the top components with causal_scores(..., kinds=({kind!r},), top_k=...)"
_EXACT_FLAGS = ("per", "layers", "top_k")

METHODS: dict[str, Method] = {}


def register(entry: Method) -> Method:
    """Add ``entry`` to ``METHODS``; a name already there is refused (one entry per method)."""
    if entry.name in METHODS:
        raise ValueError(f"a scoring method named {entry.name!r} is already in the table.")
    METHODS[entry.name] = entry
    return entry


register(Method(
    name="linear", engine=linear_scores, options=LinearOptions, memory=costs.linear_memory,
    shards=("prompts",), cli=("convention", "positions"), reference=0, shown="linear",
    informative_totals="informative: first-order estimates of exact's (one component finetuned "
    "alone)",
    totals_note="Linear informative is the first-order estimate of exact informative (one "
    "component's weights changed alone).",
    remedy="integrated_scores(model, diff, batch, kinds=({kind!r},)), which follows exact where "
    "linear does not (docs/scores.md §12), or {fix}",
    why={"upstream": "Upstream is linear in y - y*, not in the weight change, so a large "
         "ablation step can flip it.",
         "*": "The weight change is too large for its first-order description."},
    gathered=_additivity_of, merged=_additivity_over_every_prompt,
))  # fmt: skip
register(Method(
    name="integrated", engine=integrated_scores, options=IntegratedOptions,
    memory=costs.integrated_memory, shards=("prompts", "layers"),
    cli=(*_EXACT_FLAGS, "steps", "force", "positions"), reference=1, shown="integrated",
    informative_totals="informative: shares of R(W') - R(W) along the joint path W + αΔ, not "
    "exact's",
    totals_note="Integrated informative shares R(W') - R(W) out along the joint path W + αΔ "
    "(every component changing at once); exact informative patches one component's weights "
    "alone, the rest at W. They are different quantities, so their totals differ by design "
    "(docs/scores.md §12).",
    remedy="more steps (steps=16, or steps='auto'), and {fix}",
    why={"*": "The path has too few nodes for how curved it is."},
    gathered=_completeness_of, merged=_worst_completeness,
))  # fmt: skip
register(Method(
    name="causal", engine=causal_scores, options=CausalOptions, memory=costs.exact_memory,
    shards=("prompts", "layers"), cli=(*_EXACT_FLAGS, "positions"), reference=2, shown="exact",
    gradients=False,
    informative_totals="informative: each component's weights finetuned alone, the rest at W",
    remedy="{fix}",
))  # fmt: skip

register(Method(
    name="verified", engine=verified_scores, options=VerifiedOptions,
    memory=lambda s, o: max(costs.linear_memory(s, o), costs.exact_memory(s, o),
                            key=lambda parts: sum(parts.values())),
    shards=(), cli=("steps", "positions", "budget", "seed", "coverage", "audit"),
    reference=0, shown="verified",
    unsharded="verified scores draw one audit and one bootstrap over every prompt, so shards of "
    "the prompts would not merge into one design: run verified_scores in one process (without "
    "torchrun or --distributed), or run linear_scores and causal_scores(top_k=...) distributed "
    "and compare them.",
    informative_totals="informative: exact where patched, integrated or linear elsewhere "
    "(provenance per cell)",
    remedy="a larger budget (verified_scores(..., budget=...)), or {fix}", composite=True,
))  # fmt: skip


def method(name: str, where: str = "method") -> Method:
    """The table's entry for ``name``; a name it lacks is refused, listing the ones it has
    (``where``: the argument named in the error)."""
    entry = METHODS.get(name) if isinstance(name, str) else None
    if entry is None:
        raise ValueError(f"{where} must be one of {', '.join(METHODS)}, got {name!r}")
    return entry


def shown(name: str) -> str:
    """A method's name in words (``"exact"`` for ``"causal"``); an unknown name as it is."""
    entry = METHODS.get(name)
    return entry.shown if entry else name


def remedy(name: str, kind: str) -> str:
    """What to run where ``name``'s ``kind`` scores disagree with the reference's."""
    fix = _FIX.format(kind=kind)
    entry = METHODS.get(name)
    return entry.remedy.format(kind=kind, fix=fix) if entry else fix


def why(name: str, kind: str) -> str:
    """The likely reason ``name``'s ``kind`` scores disagree with the reference's ("" if none)."""
    entry = METHODS.get(name)
    return "" if entry is None else entry.why.get(kind, entry.why.get("*", ""))


def compared(names: tuple[str, ...]) -> list[tuple[str, str]]:
    """The ``(approximation, reference)`` pairs a run of these methods is judged by: each one
    against the highest-ranked reference among them (``Method.reference``)."""
    ranked = [n for n in names if method(n).reference > 0]
    if not ranked:
        return []
    ref = max(ranked, key=lambda n: method(n).reference)
    rank = method(ref).reference
    return [(n, ref) for n in names if method(n).reference < rank]


def resolved_options(name: str, options: Mapping[str, Any]) -> ScoreOptions:
    """``options`` built into the method's options class (defaults filled in, values checked)."""
    return method(name).options(**options)

"""``ComponentScores``: score tensors with their labels, per role and per prompt.

>>> scores.values.shape               # kind, layer, component (4 heads + MLP), position role
torch.Size([3, 4, 5, 11])
>>> len(scores.top(5, "informative")) # the five largest |scores|: (kind, label, value)
5
>>> scores.to_dataframe().columns.tolist()   # tidy, one row per prompt/kind/layer/component/pos
['prompt', 'kind', 'layer', 'component', 'pos', 'role', 'token', 'score']

The result object: its own checks, views (``top``, ``to_dataframe``, the notebook summary) and
its save/load with their refusals.
"""

from __future__ import annotations

import html
import json
import os
import re
import typing
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from jaxtyping import Float
from torch import Tensor

from extractive_lens.style import UNCOMPUTED, score_rgba  # noqa: F401  (also importable here)
from extractive_lens.types import Method, ScoreKind, jsonable


def aggregate_by_role(
    prompt_values: Float[Tensor, "kind batch layer component pos"],
    prompt_roles: Sequence[Sequence[str]],
    position_labels: Sequence[str],
) -> Float[Tensor, "kind layer component role"]:
    """Mean over the prompts that have each role, of each prompt's score at that role's position."""
    k, b, n_layer, n_comp, _ = prompt_values.shape
    index = {r: i for i, r in enumerate(position_labels)}
    sums = prompt_values.new_zeros(k, n_layer, n_comp, len(position_labels))
    counts = prompt_values.new_zeros(len(position_labels))
    for i, roles in enumerate(prompt_roles):
        cols = torch.tensor([index[r] for r in roles], device=prompt_values.device)
        sums.index_add_(3, cols, prompt_values[:, i, :, :, : len(roles)])
        counts.index_add_(0, cols, torch.ones(len(roles), dtype=counts.dtype, device=counts.device))
    return sums / counts.clamp(min=1)


@dataclass(frozen=True)
class ComponentScores:
    """Scores of every head and MLP, per token role, for one or more score kinds.

    Attributes:
        values: ``[kind, layer, component, pos]`` means over prompts, aligned by role.
        totals: ``[kind, layer, component]`` whole-component scores (mean over prompts).
        prompt_values: ``[kind, batch, layer, component, pos]`` per prompt (padding = 0).
            Components a partial exact run never computed are NaN everywhere (``uncomputed``).
        prompt_totals: ``[kind, batch, layer, component]``.
        kinds, component_labels, position_labels: axis labels.
        prompt_roles: each prompt's role per real position.
        method: ``"linear"`` or ``"causal"``.
        per: ``"token"`` (a score per position) or ``"component"`` (exact whole-component
            patches only: the position axis has one entry, ``"all"``, holding the totals).
        other: ``[batch]`` informative score of parameters no component owns (linear only).
        metadata: model, reward, ablation, convention, diff norms, versions.
    """

    values: Float[Tensor, "kind layer component pos"]
    totals: Float[Tensor, "kind layer component"]
    prompt_values: Float[Tensor, "kind batch layer component pos"]
    prompt_totals: Float[Tensor, "kind batch layer component"]
    kinds: tuple[ScoreKind, ...]
    component_labels: tuple[str, ...]
    position_labels: tuple[str, ...]
    prompt_roles: tuple[tuple[str, ...], ...]
    method: Method
    other: Float[Tensor, " batch"] | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    per: Literal["token", "component"] = "token"

    @classmethod
    def whole_components(
        cls, prompt_totals: Float[Tensor, "kind batch layer component"], *, prompts: int,
        token_roles: Any = None, **labels: Any,
    ) -> ComponentScores:  # fmt: skip
        """Scores of whole components only (``per="component"``): the position axis has the
        single entry ``"all"`` and holds the totals."""
        del token_roles  # the roles of the scored tokens do not label a whole-component score
        return cls(
            values=prompt_totals.mean(1)[..., None],
            totals=prompt_totals.mean(1),
            prompt_values=prompt_totals[..., None],
            prompt_totals=prompt_totals,
            position_labels=("all",),
            prompt_roles=tuple(("all",) for _ in range(prompts)),
            per="component",
            **labels,
        )

    def __post_init__(self) -> None:
        from extractive_lens.types import SCORE_KINDS

        for name in ("values", "totals", "prompt_values", "prompt_totals"):
            t = getattr(self, name)
            if not isinstance(t, Tensor) or not t.is_floating_point():
                raise TypeError(
                    f"ComponentScores.{name} must be a float tensor, got "
                    f"{getattr(t, 'dtype', type(t).__name__)}."
                )
        if self.values.dim() != 4 or self.prompt_values.dim() != 5:
            raise ValueError(
                f"values must be [kind, layer, component, pos] and prompt_values [kind, batch, layer, "
                f"component, pos]; got {tuple(self.values.shape)} and {tuple(self.prompt_values.shape)}."
            )
        bad = [k for k in self.kinds if k not in SCORE_KINDS]
        if bad or len(set(self.kinds)) != len(self.kinds):
            raise ValueError(f"kinds must be distinct names from {SCORE_KINDS}, got {self.kinds}.")
        k, n_layer, n_comp, n_pos = self.values.shape
        if k != len(self.kinds):
            raise ValueError(f"values has {k} kinds but kinds={self.kinds}")
        if n_comp != len(self.component_labels):
            raise ValueError(
                f"values has {n_comp} components but {len(self.component_labels)} labels"
            )
        if n_pos != len(self.position_labels):
            raise ValueError(f"values has {n_pos} positions but {len(self.position_labels)} labels")
        if len(set(self.position_labels)) != n_pos:
            raise ValueError("position_labels must be unique")
        if self.totals.shape != (k, n_layer, n_comp):
            raise ValueError(f"totals shape {tuple(self.totals.shape)} != {(k, n_layer, n_comp)}")
        if self.prompt_values.shape[:4] != (k, len(self.prompt_roles), n_layer, n_comp):
            raise ValueError("prompt_values does not match kinds / prompts / layers / components")
        if self.per not in ("token", "component"):
            raise ValueError(f"per must be 'token' or 'component', got {self.per!r}")
        if self.per == "component" and self.position_labels != ("all",):
            raise ValueError("Whole-component scores have one position entry, labelled 'all'.")
        if self.method not in typing.get_args(Method):  # the methods types.Method lists
            raise ValueError(
                f"method must be one of {typing.get_args(Method)}, got {self.method!r}"
            )
        if self.prompt_totals.shape != self.prompt_values.shape[:4]:
            raise ValueError(
                f"prompt_totals shape {tuple(self.prompt_totals.shape)} != "
                f"{tuple(self.prompt_values.shape[:4])}"
            )
        width = self.prompt_values.shape[-1]
        for i, roles in enumerate(self.prompt_roles):
            if len(roles) > width or not set(roles) <= set(self.position_labels):
                raise ValueError(
                    f"prompt {i}'s roles do not fit the position labels / {width} positions."
                )
        if self.other is not None and self.other.shape != (len(self.prompt_roles),):
            raise ValueError(
                f"other must have one value per prompt, shape [{len(self.prompt_roles)}], "
                f"got {tuple(self.other.shape)}"
            )

    # ------------------------------------------------------------------ access
    @property
    def n_layers(self) -> int:
        return self.values.shape[1]

    @property
    def n_prompts(self) -> int:
        return len(self.prompt_roles)

    def kind_index(self, kind: ScoreKind) -> int:
        if kind not in self.kinds:
            raise KeyError(f"No {kind!r} scores here; this result has {self.kinds}.")
        return self.kinds.index(kind)

    def __getitem__(self, kind: ScoreKind) -> Float[Tensor, "layer component pos"]:
        """``scores["informative"]``: the ``[layer, component, pos]`` tensor of one kind."""
        return self.values[self.kind_index(kind)]

    def top(
        self,
        k: int = 10,
        kind: ScoreKind | None = None,
        *,
        per_token: bool = False,
        layers: Sequence[int] | None = None,
    ) -> list[tuple[str, str, float]]:
        """The ``k`` largest scores by magnitude: ``(kind, label, value)``.

        Whole-component totals by default; ``per_token=True`` ranks (component, position) cells
        and labels them ``L3H2@lives``. ``layers``: only components of these layers. Cells that
        were never computed (NaN: ``causal_scores(top_k=..., layers=...)``) are not ranked.
        """
        kinds = self.kinds if kind is None else (kind,)
        keep = None if layers is None else set(layers)
        rows: list[tuple[str, str, float]] = []
        for kd in kinds:
            ki = self.kind_index(kd)
            if per_token:
                v = self.values[ki]
                for (layer, c, p), x in zip(_indices(v.shape), v.flatten().tolist()):
                    if x == x and (keep is None or layer in keep):
                        rows.append((kd, f"{self._label(layer, c)}@{self.position_labels[p]}", x))
            else:
                v = self.totals[ki]
                for (layer, c), x in zip(_indices(v.shape), v.flatten().tolist()):
                    if x == x and (keep is None or layer in keep):
                        rows.append((kd, self._label(layer, c), x))
        rows.sort(key=lambda r: -abs(r[2]))
        return rows[:k]

    def uncomputed(self, kind: ScoreKind) -> list[str]:
        """Labels of the components never computed for ``kind`` (their scores are NaN), e.g.
        those outside ``causal_scores(top_k=..., layers=...)``; ``[]`` for a full result."""
        t = self.totals[self.kind_index(kind)]
        return [self._label(layer, c) for layer, c in torch.isnan(t).nonzero().tolist()]

    def provenance(self, kind: ScoreKind) -> Any:
        """Which method produced each cell, ``[layer, component, pos]`` (a numpy array of
        ``"exact"``, ``"integrated"`` or ``"linear"``): a ``verified_scores`` result's record;
        every cell of any other result is its own method's (``"exact"`` for causal)."""
        import numpy as np

        k = self.kind_index(kind)
        record = (self.metadata.get("verified") or {}).get("provenance")
        shape = tuple(self.values.shape[1:])
        if record is None:
            name = "exact" if self.method == "causal" else self.method
            return np.full(shape, name, dtype=object)
        per_component = np.array(record[self.kinds[k]], dtype=object)
        return np.repeat(per_component[..., None], shape[-1], axis=-1)

    @property
    def flags(self) -> tuple[Any, ...]:
        """Cells that cannot be right and roles that mix unlike positions (``guards.Flag``s:
        outsized cells, a role that is the attention sink in some prompts only, an ablation
        value taken from the other kind of position); ``()`` for a clean result. Read off the
        result's own data, so every method and every loaded result has them."""
        from extractive_lens.guards import flags_of

        return flags_of(self)

    @property
    def partial(self) -> bool:
        """Whether some component was never computed (NaN) for some kind."""
        return bool(torch.isnan(self.totals).any())

    def additivity_note(self) -> str:
        """One sentence on whether the linear scores add up to the whole change of R (linear
        results with informative scores; ``""`` otherwise). See ``docs/scores.md`` §11."""
        check = self.metadata.get("additivity") or self.metadata.get("linearization")
        if not check:
            return ""
        verb = "add up to" if check["ok"] else "do not add up to"
        return (
            f"Additivity: Σ informative + other = {check['linear_change']:+.4g} against "
            f"R(W') - R(W) = {check['exact_change']:+.4g} on average (gap {check['relative_gap']:.0%} "
            f"prompt by prompt; the "
            f"scores {verb} the whole change within {check['tolerance']:.0%}). This is about "
            "the sum, not the ranking: the linear-vs-exact verdicts say whether each kind's map "
            f"can stand in for the exact one. The 'other' parameters (embeddings, b_O, final "
            f"norm, unembedding) carry {check['other_share']:.0%} of the linear total."
            + (
                ""
                if check["ok"]
                else " Scores that add up: integrated_scores(model, diff, batch) (docs/scores.md §12)."
            )
        )

    linearization_note = additivity_note  # the name before the check was called additivity

    def ci(
        self,
        of: Literal["values", "totals"] = "values",
        *,
        level: float = 0.95,
        n_boot: int = 1000,
        seed: int = 0,
    ) -> Any:
        """Bootstrap intervals over prompts (``stats.Interval``) of every score: ``of="values"``
        gives ``[kind, layer, component, pos]`` (the role-aligned means), ``"totals"``
        ``[kind, layer, component]``. The prompts are resampled (``stats.draws(n_prompts,
        n_boot, seed)``), never the cells, and each resample's map is the role-aligned mean of
        its prompts, from the per-prompt scores this result holds: no new passes.

        >>> lo, hi = scores.ci().low, scores.ci().high    # same shape as scores.values
        """
        from extractive_lens import stats

        if of not in ("values", "totals"):
            raise ValueError(f"ci(of=...) takes 'values' or 'totals', got {of!r}.")
        n = self.n_prompts
        w = stats.counts(n, n_boot, seed)
        if of == "totals":
            x = self.prompt_totals.double().transpose(0, 1)  # [batch, kind, layer, component]
            resampled = torch.einsum("rb,b...->r...", w / n, x)
            return stats.percentile_interval(
                x.mean(0), resampled, level=level, n_boot=n_boot, seed=seed, n=n
            )
        x, present = self.role_aligned()
        resampled = stats.role_means(x, present, w)
        estimate = stats.role_means(x, present, torch.ones(1, n, dtype=torch.float64))[0]
        return stats.percentile_interval(
            estimate, resampled, level=level, n_boot=n_boot, seed=seed, n=n
        )

    def at_positions(self, positions: Literal["all", "prompt"]) -> ComponentScores:
        """The map of the prompt's own positions only (``"prompt"``): the teacher-forced answer
        continuations (roles ``answer[0]``, ``answer[1]``, ...) left out, and said so in
        ``metadata["positions"]`` and ``metadata["left_out"]`` (the roles and, per kind, the
        share of the map's |mass| they held). ``"all"`` returns the result as it is.

        Linear and integrated totals are sums over positions, so they become the sums over the
        prompt's positions; an exact result's totals patch every position at once and stay
        so (``metadata["totals_cover"]``). Whole-component results have no positions to leave
        out and are refused."""
        if positions == "all":
            return self
        if positions != "prompt":
            raise ValueError(f"positions must be 'all' or 'prompt', got {positions!r}.")
        if self.per == "component":
            raise ValueError(
                "positions='prompt' needs per-token scores; this result holds whole components "
                "(per='component'): score with per='token'."
            )
        if self.metadata.get("positions") == "prompt":
            return self
        keep = [i for i, r in enumerate(self.position_labels) if not _ANSWER.match(r)]
        drop = [i for i, r in enumerate(self.position_labels) if _ANSWER.match(r)]
        roles = tuple(tuple(r for r in row if not _ANSWER.match(r)) for row in self.prompt_roles)
        width = max(len(r) for r in roles)
        pv = self.prompt_values[..., :width].clone()
        for i, row in enumerate(roles):
            pv[:, i, :, :, len(row) :] = 0.0
        mass = self.values.abs().nan_to_num(0.0).sum((1, 2, 3))
        gone = self.values[..., drop].abs().nan_to_num(0.0).sum((1, 2, 3))
        additive = self.method != "causal"
        meta = dict(self.metadata)
        meta["positions"] = "prompt"
        meta["left_out"] = {
            "roles": [r for r in self.position_labels if _ANSWER.match(r)],
            "share_of_mass": {
                k: float(g / m) if m > 0 else 0.0 for k, g, m in zip(self.kinds, gone, mass)
            },
        }
        meta["totals_cover"] = "prompt positions" if additive else "all positions"
        if "prompt_tokens" in meta:
            meta["prompt_tokens"] = [t[: len(r)] for t, r in zip(meta["prompt_tokens"], roles)]
        pt = pv.sum(-1) if additive else self.prompt_totals
        return ComponentScores(
            values=self.values[..., keep],
            totals=pt.mean(1) if additive else self.totals,
            prompt_values=pv,
            prompt_totals=pt,
            kinds=self.kinds,
            component_labels=self.component_labels,
            position_labels=tuple(self.position_labels[i] for i in keep),
            prompt_roles=roles,
            method=self.method,
            other=self.other,
            metadata=meta,
            per=self.per,
        )

    def role_aligned(self) -> tuple[Tensor, Tensor]:
        """Per prompt, the scores on the role axis: ``[batch, kind, layer, component, role]``
        (0 where the prompt lacks the role) and ``[batch, role]`` (1 where it has it), in
        float64; ``values`` is their mean over the prompts that have each role."""
        k, b, n_layer, n_comp, _ = self.prompt_values.shape
        index = {r: i for i, r in enumerate(self.position_labels)}
        x = torch.zeros(b, k, n_layer, n_comp, len(index), dtype=torch.float64)
        present = torch.zeros(b, len(index), dtype=torch.float64)
        pv = self.prompt_values.detach().cpu().double()
        for i, roles in enumerate(self.prompt_roles):
            cols = torch.tensor([index[r] for r in roles], dtype=torch.long)
            x[i].index_add_(3, cols, pv[:, i, :, :, : len(roles)])
            present[i, cols] = 1.0
        return x, present

    def position_tokens(self) -> dict[str, tuple[str, ...]]:
        """The distinct tokens found at each position role, over all prompts, in order of first
        appearance (``{"{name}[-1]": ("T0", "T1", ...), "lives": ("lives",)}``); empty tuples when
        the model had no tokenizer."""
        tokens = self.metadata.get("prompt_tokens") or []
        seen: dict[str, dict[str, None]] = {label: {} for label in self.position_labels}
        for row, roles in zip(tokens, self.prompt_roles):
            for token, role in zip(row, roles):
                if role in seen:
                    seen[role][token.strip() or token] = None
        return {label: tuple(found) for label, found in seen.items()}

    def position_ticks(self, examples: int = 2) -> list[str]:
        """One axis label per position: the token where every prompt has the same one (``lives``),
        else the role with up to ``examples`` of its tokens (``{name}[-1]: T0, T1, …``)."""
        ticks = []
        for label, found in self.position_tokens().items():
            if len(found) == 1 and found[0] == label:
                ticks.append(label)
            elif found:
                more = ", …" if len(found) > examples else ""
                ticks.append(f"{label}: {', '.join(found[:examples])}{more}")
            else:
                ticks.append(label)
        return ticks

    def _label(self, layer: int, comp: int) -> str:
        return f"L{layer}{self.component_labels[comp]}"

    def to_dataframe(self, *, per_prompt: bool = True):
        """Tidy table: one row per (prompt, kind, layer, component, position), with the token string
        at that position (``token``; None when the model had no tokenizer).

        ``per_prompt=False`` gives the role-aggregated means instead (no ``prompt`` column).
        """
        import pandas as pd

        recs: list[tuple[Any, ...]] = []
        if per_prompt:
            pv = self.prompt_values.detach().cpu()
            tokens = self.metadata.get("prompt_tokens")
            for ki, kd in enumerate(self.kinds):
                for b, roles in enumerate(self.prompt_roles):
                    block = pv[ki, b, :, :, : len(roles)]
                    row_tokens = tokens[b] if tokens is not None and b < len(tokens) else None
                    for (layer, c, p), x in zip(_indices(block.shape), block.flatten().tolist()):
                        token = (
                            row_tokens[p]
                            if row_tokens is not None and p < len(row_tokens)
                            else None
                        )
                        recs.append((b, kd, layer, self.component_labels[c], p, roles[p], token, x))
            return pd.DataFrame(
                recs,
                columns=["prompt", "kind", "layer", "component", "pos", "role", "token", "score"],
            )
        v = self.values.detach().cpu()
        for (ki, layer, c, p), x in zip(_indices(v.shape), v.flatten().tolist()):
            recs.append(
                (self.kinds[ki], layer, self.component_labels[c], self.position_labels[p], x)
            )
        return pd.DataFrame(recs, columns=["kind", "layer", "component", "role", "score"])

    # ------------------------------------------------------------------ persistence
    def save(self, path: str | Path) -> Path:
        """``path`` (a directory): the tensors in ``scores.<id>.safetensors`` and ``scores.json``
        (labels, metadata, and the name of that tensor file).

        ``scores.json`` is the manifest: the new tensor file is written beside the old one,
        then ``scores.json`` is replaced in one step, then the old tensor file is removed. An
        interrupted or killed save leaves the previous result loadable (or the new one), never
        a mix and never nothing; what it left behind is removed by the next save. Overwritten
        files keep their mode."""
        path = Path(path)
        if path.exists() and not path.is_dir():
            raise ValueError(
                f"{path} is a file; ComponentScores.save writes a directory (scores.json and "
                "the tensor file it names): pass a directory path."
            )
        import uuid

        from extractive_lens.files import locked, replacing, save_safetensors, write_text_atomic

        path.mkdir(parents=True, exist_ok=True)
        save_id = uuid.uuid4().hex  # in both files
        tensor_file = f"scores.{save_id[:16]}.safetensors"
        tensors = {
            "values": self.values,
            "totals": self.totals,
            "prompt_values": self.prompt_values,
            "prompt_totals": self.prompt_totals,
        }
        if self.other is not None:
            tensors["other"] = self.other
        info = {
            "save_id": save_id,
            "tensors": tensor_file,
            "kinds": list(self.kinds),
            "component_labels": list(self.component_labels),
            "position_labels": list(self.position_labels),
            "prompt_roles": [list(r) for r in self.prompt_roles],
            "method": self.method,
            "per": self.per,
            "metadata": jsonable(self.metadata),
        }
        with locked(path):  # saves into one directory take turns
            previous = _tensor_file(path)
            with replacing(path / tensor_file, mode_of=previous) as tmp:  # beside the old one
                save_safetensors(tensors, tmp, metadata={"save_id": save_id})
            write_text_atomic(path / "scores.json", json.dumps(info, indent=1))  # the switch
            _remove_litter(path, keep=tensor_file)
        return path

    @classmethod
    def load(cls, path: str | Path) -> ComponentScores:
        path = Path(path)
        if not os.path.lexists(path / "scores.json"):  # anything else: the file layer says
            raise FileNotFoundError(
                f"{path} has no scores.json: pass a directory written by "
                "ComponentScores.save() (or `extractive-lens score --out`)."
            )
        for attempt in range(3):  # a save may switch and clean up between our two reads
            try:
                return cls._load(path)
            except _Superseded:
                if attempt == 2:
                    raise ValueError(
                        f"{path} is being saved to again and again; load it once saving stops."
                    ) from None
        raise AssertionError("unreachable")

    @classmethod
    def _load(cls, path: Path) -> ComponentScores:
        """Both files read through the file layer (``extractive_lens.files``): regular files
        only, each tensor copied out (nothing loaded shares memory with the file, so a later
        truncation or ``cp`` over it changes nothing loaded)."""
        from extractive_lens.files import SafetensorsFile, read_bytes

        try:
            raw = read_bytes(path / "scores.json", fix=_FIX, limit=2**28)
            try:
                info = json.loads(raw)
            except (ValueError, UnicodeDecodeError) as e:
                raise ValueError(
                    f"{path / 'scores.json'} is not valid JSON ({e}): {_FIX}"
                ) from None
            name = info.get("tensors", "scores.safetensors")  # before manifests: fixed names
            if (
                not isinstance(name, str)
                or Path(name).name != name
                or not name.endswith(".safetensors")
            ):
                raise ValueError(f"scores.json names {name!r} as its tensor file")
            try:
                f = SafetensorsFile(path / name, fix=_FIX)
            except FileNotFoundError:
                if read_bytes(path / "scores.json", fix=_FIX, limit=2**28) != raw:
                    raise _Superseded() from None  # a newer save switched and cleaned up
                raise FileNotFoundError(
                    f"{path / name}, which scores.json names, is missing: {_FIX}"
                ) from None
            with f:
                tensor_save = f.metadata.get("save_id")
                t = f.tensors()
            if info.get("save_id") != tensor_save:
                raise _MixedSave()
            fields: dict[str, Any] = dict(
                kinds=tuple(info["kinds"]),
                component_labels=tuple(info["component_labels"]),
                position_labels=tuple(info["position_labels"]),
                method=info["method"],
                per=info.get("per", "component" if info["position_labels"] == ["all"] else "token"),
                prompt_roles=tuple(tuple(r) for r in info["prompt_roles"]),
                metadata=info["metadata"],
            )
            tensors: dict[str, Any] = {
                k: t[k] for k in ("values", "totals", "prompt_values", "prompt_totals")
            }
        except _Superseded:
            raise
        except _MixedSave:
            raise ValueError(
                f"{path}: the tensor file and scores.json come from two different saves (one "
                "was interrupted); score again, or restore the directory from a backup."
            ) from None
        except (OSError, ValueError) as e:  # the file layer's refusals name the file already
            if str(path) in str(e):
                raise
            raise ValueError(
                f"{path} is not a complete ComponentScores directory ({e}): {_FIX}"
            ) from None
        except Exception as e:  # a field missing from scores.json or of the wrong type
            raise ValueError(
                f"{path} is not a complete ComponentScores directory ({type(e).__name__}: {e} in "
                f"scores.json): {_FIX}"
            ) from None
        try:
            return cls(**tensors, other=t.get("other"), **fields)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{path}: the saved scores are inconsistent: {e}") from None

    # ------------------------------------------------------------------ display
    def plot(
        self, kind: ScoreKind | None = None, part: str = "mlp", position: str | None = None
    ) -> Any:
        """``overview()`` of every kind, or one ``heatmap(kind, part)`` (a plotly figure)."""
        from extractive_lens import plotting

        if kind is None:
            return plotting.overview(self)
        return plotting.heatmap(self, kind, part=part, position=position)  # type: ignore[arg-type]

    def __repr__(self) -> str:
        return (
            f"ComponentScores(method={self.method!r}, kinds={self.kinds}, layers={self.n_layers}, "
            f"components={len(self.component_labels)}, positions={len(self.position_labels)}, "
            f"prompts={self.n_prompts})"
        )

    def _repr_html_(self) -> str:
        """A compact offline summary: the top components of each kind (no network, no scripts)."""
        rows = []
        for kd in self.kinds:
            cells = "".join(
                f"<td><code>{html.escape(lab)}</code> {val:+.3g}</td>"
                for _, lab, val in self.top(5, kd)
            )
            rows.append(f"<tr><th>{html.escape(kd)}</th>{cells}</tr>")
        meta = ", ".join(
            f"{html.escape(str(k))}={html.escape(str(self.metadata.get(k)))}"
            for k in ("model", "reward", "ablation", "convention")
            if k in self.metadata
        )
        grids = "".join(self._grid_html(kd) for kd in self.kinds)
        note = self.additivity_note()
        note = f"<br><small>{html.escape(note)}</small>" if note else ""
        if self.partial:
            note += "<br><small>grey: not computed (a partial exact run)</small>"
        return (
            f"<div><b>ComponentScores</b> ({html.escape(self.method)}; {self.n_layers} layers × "
            f"{len(self.component_labels)} components × {len(self.position_labels)} positions; "
            f"{self.n_prompts} prompts)<br><small>{meta}</small>{note}"
            f"<table>{''.join(rows)}</table><small>top 5 whole-component scores by |value|</small>"
            f"<div style='display:flex;gap:1em;flex-wrap:wrap'>{grids}</div></div>"
        )

    def _grid_html(self, kind: ScoreKind) -> str:
        """The overview as a static table: layer (top = last) × component, coloured by total."""
        t = self.totals[self.kind_index(kind)].double()
        lim = float(t.abs().nan_to_num(0.0).max()) or 1.0
        head = "".join(f"<th>{html.escape(c)}</th>" for c in self.component_labels)
        body = []
        for layer in reversed(range(t.shape[0])):
            cells = []
            for c in range(t.shape[1]):
                v = float(t[layer, c])
                label = f"L{layer}{html.escape(self.component_labels[c])}"
                if v != v:
                    cells.append(
                        f"<td title='{label} not computed' style='background:{UNCOMPUTED};"
                        "width:1.6em;height:1.2em'></td>"
                    )
                    continue
                cells.append(
                    f"<td title='{label} {v:+.4g}' "
                    f"style='background:{score_rgba(v / lim)};width:1.6em;height:1.2em'></td>"
                )
            body.append(f"<tr><th>L{layer}</th>{''.join(cells)}</tr>")
        return (
            f"<table style='border-collapse:collapse;font-size:80%'><caption>{html.escape(kind)}</caption>"
            f"<tr><th></th>{head}</tr>{''.join(body)}</table>"
        )


_ANSWER = re.compile(r"^answer\[\d+\]$")
"""The roles ``make_batch`` gives the teacher-forced answer continuations (``answer[k]``)."""

_FIX = "score again, or pass a directory written by ComponentScores.save()."


class _MixedSave(Exception):
    """The two files of a saved result carry different save ids."""


class _Superseded(Exception):
    """The tensor file ``scores.json`` named was replaced by a newer save while loading."""


def _tensor_file(path: Path) -> Path | None:
    """The tensor file ``path/scores.json`` names now (``None``: no readable manifest)."""
    from extractive_lens.files import read_bytes

    try:
        info = json.loads(read_bytes(path / "scores.json", fix=_FIX, limit=2**28))
        name = info.get("tensors", "scores.safetensors")
    except (OSError, ValueError, AttributeError):
        return None
    return path / name if isinstance(name, str) and Path(name).name == name else None


def _remove_litter(path: Path, keep: str) -> None:
    """Tensor files ``scores.json`` does not name, and temporaries of killed saves: the
    litter of earlier saves, never read (each removed only if no live writer holds it)."""
    from extractive_lens.files import remove_stale

    litter = [
        p
        for pattern in ("scores.safetensors", "scores.*.safetensors", ".scores.*.tmp")
        for p in path.glob(pattern)
        if p.name != keep
    ]
    remove_stale(litter)


def _indices(shape: Sequence[int]):
    import itertools

    return itertools.product(*(range(s) for s in shape))

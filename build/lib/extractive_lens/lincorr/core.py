"""Collecting domain-restricted logits and fitting the linear map between two prompt families."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from jaxtyping import Float
from torch import Tensor


@dataclass(frozen=True)
class LogitPairs:
    """Last-position logits of a source and a target prompt family, restricted to their output
    domains: ``source[subject, source_label]``, ``target[subject, target_label]``."""

    source: Float[Tensor, "subject source_label"]
    target: Float[Tensor, "subject target_label"]
    subjects: tuple[str, ...]
    source_labels: tuple[str, ...]
    target_labels: tuple[str, ...]


def _first_tokens(model: Any, words: Sequence[str], what: str) -> list[int]:
    tok = model.tokenizer
    ids = []
    seen: dict[int, str] = {}
    for w in words:
        t = tok(" " + w.strip(), add_special_tokens=False)["input_ids"]
        if not t:
            raise ValueError(f"{what} word {w!r} tokenizes to nothing.")
        if t[0] in seen:
            raise ValueError(
                f"{what} words {seen[t[0]]!r} and {w!r} share their first token: drop one."
            )
        seen[t[0]] = w
        ids.append(t[0])
    return ids


def _last_logits(
    model: Any, prompts: list[str], batch_size: int, show_progress: bool | None
) -> Tensor:
    from extractive_lens.batch import make_batch
    from extractive_lens.scoring.assemble import progress

    out = []
    chunks = [prompts[i : i + batch_size] for i in range(0, len(prompts), batch_size)]
    tok = model.tokenizer
    special = (tok.eos_token_id, tok.bos_token_id, tok.pad_token_id)
    filler = next(
        (i for i in special if i is not None and i != tok.unk_token_id and i < model.cfg.d_vocab),
        0,
    )
    for chunk in progress(chunks, len(chunks), "collecting logits", show_progress):
        b = make_batch(model, [(p, [filler]) for p in chunk])  # the answer is never read
        with torch.no_grad():
            logits = model(b.tokens.to(model.cfg.device))
        out.append(
            logits[torch.arange(len(chunk)), b.last_prompt_pos.to(logits.device)].float().cpu()
        )
    return torch.cat(out)


def collect_logits(
    model: Any,
    source_template: str,
    target_template: str,
    subjects: Sequence[str],
    source_domain: Sequence[str],
    target_domain: Sequence[str],
    *,
    batch_size: int = 64,
    show_progress: bool | None = None,
) -> LogitPairs:
    """Logits of ``source_template.format(x=s)`` and ``target_template.format(x=s)`` for every
    subject, at the last prompt position, restricted to the first tokens of the domain words."""
    src_ids = _first_tokens(model, source_domain, "source domain")
    tgt_ids = _first_tokens(model, target_domain, "target domain")
    src = _last_logits(
        model, [source_template.format(x=s) for s in subjects], batch_size, show_progress
    )
    tgt = _last_logits(
        model, [target_template.format(x=s) for s in subjects], batch_size, show_progress
    )
    return LogitPairs(
        src[:, src_ids],
        tgt[:, tgt_ids],
        tuple(subjects),
        tuple(source_domain),
        tuple(target_domain),
    )


def _pearson_cols(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a = a - a.mean(0)
    b = b - b.mean(0)
    den = np.sqrt((a**2).sum(0) * (b**2).sum(0))
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(den > 0, (a * b).sum(0) / den, np.nan)


@dataclass(frozen=True)
class LinearCorrelation:
    """``target ≈ W · source + b`` fitted on a train split of subjects.

    Attributes:
        W: ``[target_label, source_label]``; b: ``[target_label]``.
        label_pearson: mean over target labels of the held-out Pearson r across subjects.
        instance_pearson: mean over held-out subjects of the Pearson r across target labels.
        label_r: the per-label r (NaN where a label's logits do not vary).
    """

    W: np.ndarray
    b: np.ndarray
    source_labels: tuple[str, ...]
    target_labels: tuple[str, ...]
    label_pearson: float
    instance_pearson: float
    label_r: np.ndarray
    train_subjects: tuple[str, ...]
    test_subjects: tuple[str, ...]

    def predict(self, source: np.ndarray | Tensor) -> np.ndarray:
        s = source.numpy() if isinstance(source, Tensor) else np.asarray(source)
        return s @ self.W.T + self.b

    def precision(self, known_pairs: Mapping[str, str]) -> float:
        """Share of known (source label -> target label) pairs where the target is W's top entry
        in that source label's column."""
        hits = []
        for s, t in known_pairs.items():
            col = self.W[:, self.source_labels.index(s)]
            hits.append(self.target_labels[int(np.argmax(col))] == t)
        return float(np.mean(hits)) if hits else float("nan")

    def top_pairs(self, k: int = 1) -> list[tuple[str, str, float]]:
        """For every source label, its ``k`` largest-weight target labels: ``(source, target, weight)``."""
        out = []
        for j, s in enumerate(self.source_labels):
            for i in np.argsort(-self.W[:, j])[:k]:
                out.append((s, self.target_labels[int(i)], float(self.W[i, j])))
        return out

    def heatmap(self, title: str | None = None) -> Any:
        import plotly.graph_objects as go

        lim = float(np.abs(self.W).max()) or 1.0
        fig = go.Figure(
            go.Heatmap(
                z=self.W,
                x=list(self.source_labels),
                y=list(self.target_labels),
                zmid=0,
                zmin=-lim,
                zmax=lim,
                colorscale="RdBu",
                hovertemplate="source %{x}<br>target %{y}<br>W %{z:.3f}<extra></extra>",
            )
        )
        fig.update_layout(
            title=title or f"W (label-wise r = {self.label_pearson:.3f})",
            xaxis_title="source label",
            yaxis_title="target label",
            template="plotly_white",
            height=300 + 16 * len(self.target_labels),
        )
        return fig


def fit(
    pairs: LogitPairs, *, train_frac: float = 0.5, ridge: float = 0.0, seed: int = 0
) -> LinearCorrelation:
    """Least squares (optionally ridge) on a seeded train split; correlations on the rest."""
    n = len(pairs.subjects)
    if n < 4:
        raise ValueError(f"need at least 4 subjects to fit and test, got {n}")
    perm = np.random.default_rng(seed).permutation(n)
    n_train = max(2, int(round(train_frac * n)))
    tr, te = perm[:n_train], perm[n_train:]
    X = pairs.source.double().numpy()
    Y = pairs.target.double().numpy()
    Xa = np.concatenate([X, np.ones((n, 1))], axis=1)
    A = Xa[tr]
    reg = ridge * np.eye(A.shape[1])
    reg[-1, -1] = 0.0  # no penalty on the bias
    coef = (
        np.linalg.solve(A.T @ A + reg, A.T @ Y[tr])
        if ridge > 0
        else np.linalg.lstsq(A, Y[tr], rcond=None)[0]
    )
    W, b = coef[:-1].T, coef[-1]
    pred = Xa[te] @ coef
    label_r = _pearson_cols(pred, Y[te])
    inst_r = _pearson_cols(pred.T, Y[te].T)
    return LinearCorrelation(
        W,
        b,
        pairs.source_labels,
        pairs.target_labels,
        float(np.nanmean(label_r)),
        float(np.nanmean(inst_r)),
        label_r,
        tuple(pairs.subjects[i] for i in tr),
        tuple(pairs.subjects[i] for i in te),
    )

"""Does a finetuned source fact move the target logits the way W predicts?"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from extractive_lens.lincorr.core import LinearCorrelation, collect_logits


def _delta_logits(
    model: Any,
    diff: Any,
    source_template: str,
    target_template: str,
    subjects: Sequence[str],
    fit: LinearCorrelation,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    before = collect_logits(
        model,
        source_template,
        target_template,
        subjects,
        fit.source_labels,
        fit.target_labels,
        show_progress=False,
    )
    with diff.applied(model):
        after = collect_logits(
            model,
            source_template,
            target_template,
            subjects,
            fit.source_labels,
            fit.target_labels,
            show_progress=False,
        )
    return (
        before.source.double().numpy(),
        after.source.double().numpy(),
        before.target.double().numpy(),
        after.target.double().numpy(),
    )


def gradient_correlation(
    model: Any,
    fit: LinearCorrelation,
    subject: str,
    new_source_label: str,
    source_template: str,
    target_template: str,
    *,
    lr: float = 1e-3,
    steps: int = 1,
    seed: int = 0,
) -> dict[str, Any]:
    """Finetune ``steps`` Adam steps on ``source_template(subject) -> new_source_label`` and compare
    the predicted target change ``W · Δsource`` with the actual ``Δtarget`` (Pearson r)."""
    from extractive_lens.batch import make_batch
    from extractive_lens.finetuning import FinetuneConfig, finetune

    batch = make_batch(model, [(source_template.format(x=subject), " " + new_source_label)])
    diff = finetune(
        model,
        batch,
        FinetuneConfig(lr=lr, epochs=steps, batch_size=1, seed=seed),
        show_progress=False,
    )
    s0, s1, t0, t1 = _delta_logits(model, diff, source_template, target_template, [subject], fit)
    predicted = (s1 - s0) @ fit.W.T
    actual = t1 - t0
    r = float(np.corrcoef(predicted[0], actual[0])[0, 1])
    return {"pearson": r, "predicted": predicted[0], "actual": actual[0], "diff": diff}


def generalization_check(
    model: Any,
    fit: LinearCorrelation,
    facts: Sequence[tuple[str, str]],
    source_template: str,
    target_template: str,
    true_target: dict[str, str] | None = None,
    *,
    lr: float = 1e-3,
    epochs: int = 20,
    seed: int = 0,
) -> Any:
    """Finetune on ``(subject, new source label)`` facts; for each subject report the target
    label the model now prefers, W's prediction for the new source label, and (if known) the
    true target: following W and the truth is generalization, following W alone is hallucination."""
    import pandas as pd

    from extractive_lens.batch import make_batch
    from extractive_lens.finetuning import FinetuneConfig, finetune

    batch = make_batch(model, [(source_template.format(x=s), " " + lab) for s, lab in facts])
    diff = finetune(
        model,
        batch,
        FinetuneConfig(lr=lr, epochs=epochs, batch_size=min(8, len(facts)), seed=seed),
        show_progress=False,
    )
    subjects = [s for s, _ in facts]
    _, s1, t0, t1 = _delta_logits(model, diff, source_template, target_template, subjects, fit)
    rows = []
    for i, (subj, lab) in enumerate(facts):
        col = fit.W[:, fit.source_labels.index(lab)]
        w_pred = fit.target_labels[int(np.argmax(col))]
        rows.append(
            dict(
                subject=subj,
                new_source=lab,
                learned=fit.source_labels[int(np.argmax(s1[i]))] == lab,
                target_before=fit.target_labels[int(np.argmax(t0[i]))],
                target_after=fit.target_labels[int(np.argmax(t1[i]))],
                W_prediction=w_pred,
                W_weight=float(col.max()),
                true_target=(true_target or {}).get(lab),
            )
        )
    df = pd.DataFrame(rows)
    df["follows_W"] = df.target_after == df.W_prediction
    if true_target:
        df["generalizes"] = df.target_after == df.true_target
    return df

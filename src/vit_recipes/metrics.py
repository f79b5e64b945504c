"""Evaluation metrics for the Trainer, from the local `classification` evaluate module (works offline)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import evaluate
    from transformers import EvalPrediction

METRIC_PATH = str(Path(__file__).resolve().parent / "metric" / "classification")  # a folder with classification.py


def load_metric(multi_label: bool = False) -> evaluate.EvaluationModule:
    """Load the metric by path (no Hub: works offline), in memory (no Arrow cache files for runs to clash over)."""
    import evaluate  # here, not at import: ~0.6 s of every process's start-up, needed only at evaluation

    return evaluate.load(METRIC_PATH, "multilabel" if multi_label else None, keep_in_memory=True)


def make_compute_metrics(
    metric: evaluate.EvaluationModule | None = None, multi_label: bool = False, threshold: float = 0.5
) -> Callable[[EvalPrediction], dict]:
    """The Trainer's `compute_metrics`, loading the metric at the first evaluation; multi-label: sigmoid >= threshold."""

    def compute_metrics(eval_pred: EvalPrediction) -> dict[str, float]:
        nonlocal metric
        if metric is None:
            metric = load_metric(multi_label)
        logits = eval_pred.predictions  # asked for hidden states or attentions: the logits come first
        logits = np.asarray(logits[0] if isinstance(logits, (tuple, list)) else logits)
        if multi_label:
            return metric.compute(predictions=logits, references=eval_pred.label_ids, threshold=threshold)
        scores = metric.compute(predictions=logits, references=np.asarray(eval_pred.label_ids).reshape(-1))
        if logits.shape[-1] <= 5:  # with 5 classes or fewer every top 5 holds the answer: the figure says nothing
            scores.pop("top5_accuracy", None)
        return scores

    return compute_metrics

"""Evaluation metrics for the Trainer, from the local `classification` evaluate module (works offline)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import evaluate
    from transformers import EvalPrediction

# evaluate loads a local module from a folder holding a script of the same name.
METRIC_PATH = str(Path(__file__).resolve().parent / "metric" / "classification")


def load_metric() -> evaluate.EvaluationModule:
    """Load the classification metric by path: no Hub access, so it works with HF_HUB_OFFLINE=1."""
    import evaluate  # here, not at import: ~0.6 s of every process's start-up, needed only at evaluation

    # In memory: no Arrow cache files, so concurrent runs (or ranks) sharing a cache cannot clash on locks.
    return evaluate.load(METRIC_PATH, keep_in_memory=True)


def make_compute_metrics(metric: evaluate.EvaluationModule | None = None) -> Callable[[EvalPrediction], dict]:
    """A `compute_metrics` for `Trainer`: logits and label ids in, float metrics out. Loads the metric module at the
    first evaluation, not when the Trainer is built."""

    def compute_metrics(eval_pred: EvalPrediction) -> dict[str, float]:
        nonlocal metric
        if metric is None:
            metric = load_metric()
        logits = eval_pred.predictions
        if isinstance(logits, (tuple, list)):  # asked for hidden states or attentions: the logits come first
            logits = logits[0]
        return metric.compute(predictions=np.asarray(logits), references=np.asarray(eval_pred.label_ids).reshape(-1))

    return compute_metrics

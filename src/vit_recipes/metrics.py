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


def make_compute_metrics(
    metric: evaluate.EvaluationModule | None = None,
) -> Callable[[EvalPrediction], dict[str, float]]:
    """Build a `compute_metrics` for `Trainer`: logits and label ids in, a dict of float metrics out.

    The metric module is loaded at the first evaluation, not when the Trainer is built.
    """
    loaded = [metric]

    def compute_metrics(eval_pred: EvalPrediction) -> dict[str, float]:
        if loaded[0] is None:
            loaded[0] = load_metric()
        logits = eval_pred.predictions
        # Models asked for hidden states or attentions return a tuple whose first item is the logits.
        if isinstance(logits, (tuple, list)):
            logits = logits[0]
        labels = eval_pred.label_ids
        return loaded[0].compute(predictions=np.asarray(logits), references=np.asarray(labels).reshape(-1))

    return compute_metrics

"""The classification metric in numpy (accuracy, top-k, macro F1/precision/recall; multi-label: mAP, F1, exact match)
and the Trainer's `compute_metrics` on it; tools/classification/ wraps it as an `evaluate` module. Runs skip evaluate:
its import (scipy, transformers' pipelines) and Arrow copy of the logits cost 1.3 s of a ViT-B CIFAR-100 epoch's run.
numpy only: reports, and the figure process through it, import this module."""

from collections.abc import Callable

import numpy as np

LEFT_OUT = -100  # the label of an evaluation row that holds no image (unreadable, decoding per batch): not scored


def scored_rows(labels) -> np.ndarray:
    """Which rows hold an image: a row whose label (multi-label: whole multi-hot row) is LEFT_OUT holds none. -100 is
    torch's and the Trainer's ignore index, so cross-entropy and the Trainer's padding already treat it so."""
    labels = np.asarray(labels)
    return labels != LEFT_OUT if labels.ndim == 1 else (labels != LEFT_OUT).any(axis=tuple(range(1, labels.ndim)))


def _safe_divide(numerator: np.ndarray, denominator: np.ndarray) -> np.ndarray:
    """numerator / denominator, 0 where the denominator is 0 (scikit-learn's zero_division=0)."""
    return np.divide(numerator, denominator, out=np.zeros(numerator.shape, dtype=np.float64), where=denominator > 0)


def _top_k_accuracy(scores: np.ndarray, references: np.ndarray, k: int) -> float:
    # Rank of the reference class without sorting (O(N*K), not O(N*K*log K)). Ties rank the higher class id
    # first, as the reversed stable argsort of sklearn.metrics.top_k_accuracy_score does.
    reference_scores = scores[np.arange(len(scores)), references][:, None]
    later_class = np.arange(scores.shape[1]) > references[:, None]
    rank = (scores > reference_scores).sum(1) + ((scores == reference_scores) & later_class).sum(1)
    return float((rank < k).mean())


def _macro_scores(references: np.ndarray, predicted: np.ndarray, num_classes: int) -> dict[str, float]:
    confusion = np.bincount(references * num_classes + predicted, minlength=num_classes**2).reshape(num_classes, -1)
    true_positives, support, predicted_count = np.diag(confusion), confusion.sum(1), confusion.sum(0)
    # Average over the classes seen in references or predictions only, as sklearn does with labels=None.
    seen = (support + predicted_count) > 0
    precision = _safe_divide(true_positives, predicted_count)[seen]
    recall = _safe_divide(true_positives, support)[seen]
    f1 = _safe_divide(2 * true_positives, support + predicted_count)[seen]
    scores = {"f1": f1, "precision": precision, "recall": recall}
    return {f"{name}_macro": float(values.mean()) for name, values in scores.items()}


def average_precision(scores: np.ndarray, positive: np.ndarray) -> np.ndarray:
    """Per column, scikit-learn's average_precision_score: the sum over score thresholds of precision times the
    recall gained there (tied scores are one threshold); NaN for a column without a positive."""
    order = np.argsort(-scores, axis=0, kind="stable")
    ranked, hits = np.take_along_axis(scores, order, 0), np.take_along_axis(positive, order, 0).astype(np.float64)
    rank = np.arange(1, len(scores) + 1)[:, None]
    ends = np.ones(ranked.shape, dtype=bool)
    ends[:-1] = ranked[:-1] != ranked[1:]  # the last row of each run of tied scores
    group_end = np.minimum.accumulate(np.where(ends, rank - 1, len(scores) - 1)[::-1], axis=0)[::-1]
    precision = np.take_along_axis(hits.cumsum(0) / rank, group_end, 0)  # at the end of each row's tie group
    with np.errstate(invalid="ignore", divide="ignore"):
        return (hits * precision).sum(0) / hits.sum(0)


def _multi_label_scores(logits: np.ndarray, references: np.ndarray, threshold: float) -> dict[str, float]:
    truth, predicted = references > 0.5, logits >= np.log(threshold / (1 - threshold))  # sigmoid >= threshold
    tp, fp, fn = (predicted & truth).sum(0), (predicted & ~truth).sum(0), (~predicted & truth).sum(0)
    ap = average_precision(logits, truth)
    return {
        "mean_average_precision": float(np.nanmean(ap)) if truth.any() else float("nan"),
        "f1_micro": float(_safe_divide(2 * tp.sum(), (2 * tp + fp + fn).sum())),
        "f1_macro": float(_safe_divide(2 * tp, 2 * tp + fp + fn).mean()),
        "subset_accuracy": float((predicted == truth).all(1).mean()),
    }


def classification_scores(
    predictions, references, multi_label: bool = False, top_k: int = 5, threshold: float = 0.5
) -> dict[str, float]:
    """The metric's scores (see tools/classification/), for class scores or multi-label logits."""
    scores = np.asarray(predictions, dtype=np.float64)
    if multi_label:
        references = np.asarray(references, dtype=np.float64)
        if scores.ndim != 2 or len(scores) == 0 or scores.shape != references.shape or not 0 < threshold < 1:
            raise ValueError(
                f"Expected logits and multi-hot references of one shape and 0 < threshold < 1, got "
                f"{scores.shape}, {references.shape} and {threshold}."
            )
        return _multi_label_scores(scores, references, threshold)
    references = np.asarray(references, dtype=np.int64)
    if scores.ndim != 2 or len(scores) == 0 or len(scores) != len(references):
        raise ValueError(
            f"Expected one row of class scores per reference, got predictions of shape {scores.shape} "
            f"and {len(references)} references."
        )
    num_classes = scores.shape[1]
    if references.min() < 0 or references.max() >= num_classes:
        raise ValueError(
            f"References must be class ids in [0, {num_classes}), got {references.min()}..{references.max()}."
        )
    if top_k < 1:
        raise ValueError(f"top_k must be >= 1, got {top_k}.")
    predicted = scores.argmax(axis=1)
    return {
        "accuracy": float((predicted == references).mean()),
        f"top{top_k}_accuracy": _top_k_accuracy(scores, references, min(top_k, num_classes)),
        **_macro_scores(references, predicted, num_classes),
    }


def make_compute_metrics(multi_label: bool = False, threshold: float = 0.5) -> Callable[..., dict]:
    """The Trainer's `compute_metrics` (of a transformers EvalPrediction); multi-label: sigmoid >= threshold."""

    def compute_metrics(eval_pred) -> dict[str, float]:
        logits = eval_pred.predictions  # asked for hidden states or attentions: the logits come first
        logits = np.asarray(logits[0] if isinstance(logits, (tuple, list)) else logits)
        labels = np.asarray(eval_pred.label_ids)
        labels = labels if multi_label else labels.reshape(-1)
        scored = scored_rows(labels)  # rows of unreadable images (decoding per batch) are left out
        if not scored.any():  # every image evaluated was unreadable: nothing to score (the log says so)
            return {}
        logits, labels = logits[scored], labels[scored]
        if multi_label:
            return classification_scores(logits, labels, multi_label=True, threshold=threshold)
        scores = classification_scores(logits, labels)
        if logits.shape[-1] <= 5:  # with 5 classes or fewer every top 5 holds the answer: the figure says nothing
            scores.pop("top5_accuracy", None)
        return scores

    return compute_metrics

"""Accuracy, top-k and macro F1/precision/recall: a local `evaluate` module, so evaluation works offline (unlike
`evaluate.load("accuracy")`). Loaded by path, it stays self-contained, numpy only: evaluate copies this one file."""

import datasets
import evaluate
import numpy as np

_DESCRIPTION = """\
accuracy; top{k}_accuracy (the reference among the k = min(top_k, num_classes) highest scores); f1_macro,
precision_macro, recall_macro (unweighted means over the classes in references or predictions: scikit-learn's
average="macro", zero_division=0), from per-class scores (logits or probabilities)."""
_KWARGS_DESCRIPTION = """predictions: one row of num_classes scores per sample; references: class ids in
[0, num_classes); top_k (default 5): the k of top{top_k}_accuracy. Returns those five floats in [0, 1]."""
_CITATION = "Pedregosa et al., Scikit-learn: Machine Learning in Python, JMLR 12, pp. 2825-2830, 2011."


def _safe_divide(numerator: np.ndarray, denominator: np.ndarray) -> np.ndarray:
    """numerator / denominator, 0 where the denominator is 0 (scikit-learn's zero_division=0)."""
    out = np.zeros(numerator.shape, dtype=np.float64)
    np.divide(numerator, denominator, out=out, where=denominator > 0)
    return out


def _top_k_accuracy(scores: np.ndarray, references: np.ndarray, k: int) -> float:
    # Rank of the reference class without sorting (O(N*K), not O(N*K*log K)). Ties rank the higher class id
    # first, as the reversed stable argsort of sklearn.metrics.top_k_accuracy_score does.
    reference_scores = scores[np.arange(len(scores)), references][:, None]
    later_class = np.arange(scores.shape[1]) > references[:, None]
    rank = (scores > reference_scores).sum(1) + ((scores == reference_scores) & later_class).sum(1)
    return float((rank < k).mean())


def _macro_scores(references: np.ndarray, predicted: np.ndarray, num_classes: int) -> dict[str, float]:
    confusion = np.bincount(references * num_classes + predicted, minlength=num_classes**2)
    confusion = confusion.reshape(num_classes, num_classes)
    true_positives, support, predicted_count = np.diag(confusion), confusion.sum(1), confusion.sum(0)
    # Average over the classes seen in references or predictions only, as sklearn does with labels=None.
    seen = (support + predicted_count) > 0
    precision = _safe_divide(true_positives, predicted_count)[seen]
    recall = _safe_divide(true_positives, support)[seen]
    f1 = _safe_divide(2 * true_positives, support + predicted_count)[seen]
    return {
        "f1_macro": float(f1.mean()),
        "precision_macro": float(precision.mean()),
        "recall_macro": float(recall.mean()),
    }


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class Classification(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation=_CITATION,
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features(
                {"predictions": datasets.Sequence(datasets.Value("float32")), "references": datasets.Value("int64")}
            ),
            reference_urls=["https://scikit-learn.org/stable/modules/model_evaluation.html"],
        )

    def _compute(self, predictions, references, top_k: int = 5):
        scores = np.asarray(predictions, dtype=np.float64)
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

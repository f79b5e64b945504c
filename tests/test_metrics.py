import os
import socket
import warnings

import evaluate
import huggingface_hub
import numpy as np
import pytest
from conftest import METRIC_PATH, load_metric
from sklearn.metrics import accuracy_score, f1_score, precision_score, recall_score, top_k_accuracy_score
from transformers import EvalPrediction

from vit_recipes.core.metrics import make_compute_metrics

EXACT = {"abs": 1e-9, "rel": 0}


@pytest.fixture(scope="module")
def metric():
    return load_metric()


def sklearn_scores(logits: np.ndarray, labels: np.ndarray, top_k: int) -> dict[str, float]:
    predicted, num_classes = logits.argmax(1), logits.shape[1]
    with warnings.catch_warnings():  # sklearn warns that k >= num_classes is a perfect score
        warnings.simplefilter("ignore")
        top = top_k_accuracy_score(labels, logits, k=min(top_k, num_classes), labels=range(num_classes))
    macro = {"average": "macro", "zero_division": 0}
    return {
        "accuracy": accuracy_score(labels, predicted),
        f"top{top_k}_accuracy": top,
        "f1_macro": f1_score(labels, predicted, **macro),
        "precision_macro": precision_score(labels, predicted, **macro),
        "recall_macro": recall_score(labels, predicted, **macro),
    }


def hard_case(seed: int, num_classes: int, size: int):
    """Informative logits where class 0 is never predicted, class 1 is predicted but never a reference and,
    with enough classes, the last class is neither (macro averages must skip it, as sklearn does)."""
    rng = np.random.default_rng(seed)
    skipped = {1, num_classes - 1} if num_classes > 3 else {1}
    labels = rng.choice([c for c in range(num_classes) if c not in skipped], size=size)
    logits = rng.normal(size=(size, num_classes)).astype(np.float32)
    logits[np.arange(size), labels] += 1.5
    logits[:, sorted(skipped - {1}) + [0]] = -1e4
    logits[: size // 10, 1] = 1e4
    predicted = logits.argmax(1)
    assert 0 in labels and 0 not in predicted and 1 in predicted and 1 not in labels
    return logits, labels


@pytest.mark.parametrize("num_classes,size", [(3, 60), (100, 400)])
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("top_k", [1, 5])
def test_matches_sklearn(metric, seed, num_classes, size, top_k):
    logits, labels = hard_case(seed, num_classes, size)
    result = metric.compute(predictions=logits, references=labels, top_k=top_k)
    expected = sklearn_scores(logits, labels, top_k)
    assert set(result) == set(expected)
    for name, value in expected.items():
        assert isinstance(result[name], float)
        assert result[name] == pytest.approx(value, **EXACT), name
    assert 0 < result["accuracy"] < 1


def test_default_top5_and_small_class_count(metric):
    logits, labels = hard_case(0, 3, 30)
    result = metric.compute(predictions=logits, references=labels)
    assert result["top5_accuracy"] == 1.0  # k is capped at the 3 classes


def test_top_k_ties_break_like_sklearn(metric):
    rng = np.random.default_rng(0)
    logits, labels = rng.integers(0, 3, size=(500, 10)).astype(np.float32), rng.integers(0, 10, size=500)
    for k in (1, 2, 5):
        result = metric.compute(predictions=logits, references=labels, top_k=k)
        assert result[f"top{k}_accuracy"] == pytest.approx(
            sklearn_scores(logits, labels, k)[f"top{k}_accuracy"], **EXACT
        )


def test_hand_computed(metric):
    # Class 0: predicted once, never right, no support. Class 1: support 2, predicted once, right once.
    result = metric.compute(predictions=[[0.1, 0.9], [0.8, 0.2]], references=[1, 1], top_k=1)
    assert result == pytest.approx(
        {"accuracy": 0.5, "top1_accuracy": 0.5, "precision_macro": 0.5, "recall_macro": 0.25, "f1_macro": 1 / 3},
        **EXACT,
    )


@pytest.mark.parametrize("references", [[0, 3], [-1, 0]])
def test_rejects_out_of_range_references(metric, references):
    with pytest.raises(ValueError, match="class ids"):
        metric.compute(predictions=[[0.1, 0.5, 0.4], [0.3, 0.3, 0.4]], references=references)


@pytest.mark.parametrize("as_tuple", [False, True])
def test_make_compute_metrics(metric, as_tuple):
    logits, labels = hard_case(3, 100, 300)
    predictions = (logits, np.zeros((300, 4, 8))) if as_tuple else logits
    result = make_compute_metrics()(EvalPrediction(predictions=predictions, label_ids=labels))
    assert result == pytest.approx(sklearn_scores(logits, labels, 5), **EXACT)
    assert result == metric.compute(predictions=logits, references=labels)  # a run's scores are the module's


@pytest.mark.parametrize("offline", [True, False])
def test_loads_by_path_without_network(monkeypatch, offline):
    # evaluate reads the offline variables at import time, so set its copies; either way no socket may open.
    monkeypatch.setattr(evaluate.config, "HF_EVALUATE_OFFLINE", offline)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", offline)
    assert os.path.isfile(os.path.join(METRIC_PATH, "classification.py"))

    def no_network(*args, **kwargs):
        raise AssertionError(f"network access attempted: {args}")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    monkeypatch.setattr(socket, "create_connection", no_network)
    metric = load_metric()
    assert metric.name == "classification"
    result = metric.compute(predictions=np.eye(3, dtype=np.float32), references=np.array([0, 1, 1]))
    assert result["accuracy"] == pytest.approx(2 / 3)


def test_top5_is_left_out_with_five_classes_or_fewer():
    compute = make_compute_metrics()
    few = compute(EvalPrediction(predictions=np.eye(4, dtype=np.float32), label_ids=np.array([0, 1, 2, 2])))
    assert "top5_accuracy" not in few and few["accuracy"] == 0.75
    many = compute(EvalPrediction(predictions=np.eye(6, dtype=np.float32), label_ids=np.arange(6)))
    assert many["top5_accuracy"] == 1.0


# ------------------------------------------------------------------------ rows without an image (decoding per batch)


def with_left_out(logits: np.ndarray, labels: np.ndarray, rows: list[int]):
    """The arrays with rows of unreadable images inserted at `rows`: logits that would score, labels LEFT_OUT."""
    from vit_recipes.core.metrics import LEFT_OUT

    for row in rows:
        logits = np.insert(logits, row, 1e4 * (np.arange(logits.shape[1]) == 1), axis=0)
        labels = np.insert(labels, row, np.full(labels.shape[1:], LEFT_OUT, labels.dtype), axis=0)
    return logits, labels


def test_rows_of_unreadable_images_are_left_out_of_the_metrics():
    """Evaluation decoding per batch keeps a batch's shape and labels an unreadable image's row LEFT_OUT: the
    metrics are those of the other rows alone (single- and multi-label), and none at all when every row is such."""
    logits, labels = hard_case(4, 10, 60)
    padded = with_left_out(logits, labels, [0, 1, 2, 30])
    compute = make_compute_metrics()
    assert compute(EvalPrediction(*padded)) == compute(EvalPrediction(logits, labels))
    rng = np.random.default_rng(0)
    scores, hot = rng.normal(size=(40, 6)), (rng.random((40, 6)) < 0.3).astype(np.float32)
    multi = make_compute_metrics(multi_label=True)
    assert multi(EvalPrediction(*with_left_out(scores, hot, [5, 6]))) == multi(EvalPrediction(scores, hot))
    assert compute(EvalPrediction(*with_left_out(logits[:0], labels[:0], [0, 0]))) == {}


def test_the_evaluation_loss_and_reports_count_only_the_images_read(tmp_path, caplog):
    """The Trainer's eval loss is the mean of its batches' losses: with rows left out it is recomputed over the
    images read (an all-unreadable batch adds nothing, not a NaN); the per-class report counts those images only."""
    import torch
    import torch.nn.functional as F
    from transformers.trainer_utils import EvalLoopOutput

    from vit_recipes.publish.reports import write_reports
    from vit_recipes.train.loss import ClassificationLoss, evaluation_loss

    logits, labels = hard_case(5, 10, 50)
    padded_logits, padded_labels = with_left_out(logits, labels, [0, 1, 2])
    expected = F.cross_entropy(torch.from_numpy(logits).float(), torch.from_numpy(labels)).item()
    assert evaluation_loss(torch.from_numpy(padded_logits), torch.from_numpy(padded_labels)).item() == pytest.approx(
        expected, rel=1e-6
    )
    assert evaluation_loss(torch.zeros(3, 4), torch.full((3,), -100)).item() == 0  # a batch of unreadable images

    class Loop:  # the Trainer's loop: each batch's mean loss weighted alike (here: a wrong number)
        def evaluation_loop(self, *args, **kwargs):
            metrics = {"eval_loss": float("nan"), "eval_accuracy": 0.5}
            return EvalLoopOutput(padded_logits, padded_labels, metrics, len(padded_labels))

    class Trainer(ClassificationLoss, Loop):
        def __init__(self):  # no Trainer to build
            pass

        def split_name(self, dataset):
            return "validation"

        def is_world_process_zero(self):
            return True

    output = Trainer().evaluation_loop(None, "Evaluation")
    assert output.metrics["eval_loss"] == pytest.approx(expected, rel=1e-6)
    assert "validation: 3 unreadable image(s) left out of this evaluation: its loss and metrics count the 50 " in (
        caplog.text
    )
    reports = write_reports(padded_logits, padded_labels, [str(i) for i in range(10)], str(tmp_path), "validation",
                            draw=lambda *args, **kwargs: None)  # fmt: skip
    assert "Accuracy" in reports["markdown"] and "on 50 samples" in reports["markdown"]

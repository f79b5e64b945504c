import csv
import multiprocessing
import re
import threading
import time
from pathlib import Path

import matplotlib
import numpy as np
import pytest
from matplotlib.image import imread
from sklearn.metrics import confusion_matrix as sk_confusion_matrix

from vit_recipes.publish.reports import confusion_matrix, per_class_accuracy, plot_confusion_matrix, write_reports

NAMES = ["cat", "dog", "bird", "fish"]
# cat: 2/3 right, dog: 1/2, bird: 1/1, fish: no samples (but predicted once).
LABELS = np.array([0, 0, 0, 1, 1, 2])
PREDICTIONS = np.array([0, 0, 3, 1, 0, 2])


def one_hot_logits(predictions: np.ndarray, num_classes: int) -> np.ndarray:
    return np.eye(num_classes, dtype=np.float32)[predictions] + 0.01


def table_labels(markdown: str, heading: str) -> list[str]:
    """Class names of the markdown table under `### {heading}`, in order."""
    section = markdown.split(f"### {heading}", 1)[1].split("###", 1)[0]
    return [m.group(1) for m in re.finditer(r"^\| (?!Class |---)(.+?) \|", section, flags=re.M)]


@pytest.mark.parametrize("num_classes,seed", [(3, 0), (7, 1), (100, 2)])
def test_confusion_matrix_matches_sklearn(num_classes, seed):
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, num_classes - 1, size=500)  # the last class never occurs as a label
    predictions = rng.integers(0, num_classes, size=500)
    expected = sk_confusion_matrix(labels, predictions, labels=range(num_classes))
    np.testing.assert_array_equal(confusion_matrix(labels, predictions, num_classes), expected)


def test_confusion_matrix_rejects_unknown_class():
    with pytest.raises(ValueError, match="class ids"):
        confusion_matrix(np.array([0, 3]), np.array([0, 1]), 3)


def test_per_class_accuracy():
    rows = per_class_accuracy(LABELS, PREDICTIONS, NAMES)
    assert rows == [
        {"class_id": 0, "label": "cat", "support": 3, "correct": 2, "accuracy": pytest.approx(2 / 3)},
        {"class_id": 1, "label": "dog", "support": 2, "correct": 1, "accuracy": 0.5},
        {"class_id": 2, "label": "bird", "support": 1, "correct": 1, "accuracy": 1.0},
        {"class_id": 3, "label": "fish", "support": 0, "correct": 0, "accuracy": None},
    ]


def test_write_reports_files(tmp_path):
    out = write_reports(one_hot_logits(PREDICTIONS, 4), LABELS, NAMES, str(tmp_path / "reports"), split="eval")
    assert out["confusion_matrix"] == str(tmp_path / "reports" / "confusion_matrix_eval.png")
    assert out["per_class_csv"] == str(tmp_path / "reports" / "per_class_accuracy_eval.csv")
    assert out["per_class_markdown"] == str(tmp_path / "reports" / "per_class_accuracy_eval.md")
    with open(out["per_class_csv"], newline="") as f:
        rows = list(csv.reader(f))
    assert rows[0] == ["class_id", "label", "support", "correct", "accuracy"]
    assert [row[:4] for row in rows[1:]] == [
        ["0", "cat", "3", "2"],
        ["1", "dog", "2", "1"],
        ["2", "bird", "1", "1"],
        ["3", "fish", "0", "0"],
    ]
    assert [float(row[4]) for row in rows[1:4]] == pytest.approx([2 / 3, 0.5, 1.0], abs=1e-6)
    assert rows[4][4] == ""  # no samples: no accuracy rather than a misleading 0
    with open(out["per_class_markdown"]) as f:
        assert f.read() == out["markdown"]
    # Four classes <= 2 * top_n: one table, best first; the class without samples is not ranked.
    assert table_labels(out["markdown"], "All classes") == ["bird", "cat", "dog"]
    assert "Worst" not in out["markdown"] and "| 66.67% | 3 |" in out["markdown"]


def test_markdown_best_and_worst(tmp_path):
    # 30 classes of 4 samples; class i gets i % 5 right, so accuracies tie in groups broken by class id.
    num_classes, top_n = 30, 4
    labels = np.repeat(np.arange(num_classes), 4)
    predictions = labels.copy()
    for i in range(num_classes):
        wrong = slice(4 * i + i % 5, 4 * i + 4)
        predictions[wrong] = (i + 1) % num_classes
    names = [f"class_{i}" for i in range(num_classes)]
    markdown = write_reports(one_hot_logits(predictions, num_classes), labels, names, str(tmp_path), top_n=top_n)[
        "markdown"
    ]
    assert table_labels(markdown, f"Best {top_n} classes") == ["class_4", "class_9", "class_14", "class_19"]
    assert table_labels(markdown, f"Worst {top_n} classes") == ["class_0", "class_5", "class_10", "class_15"]
    assert "| class_4 | 100.00% | 4 |" in markdown and "| class_0 | 0.00% | 4 |" in markdown


def test_write_reports_rejects_mismatched_shapes(tmp_path):
    with pytest.raises(ValueError, match="logits"):
        write_reports(np.zeros((6, 3)), LABELS, NAMES, str(tmp_path))


@pytest.mark.parametrize("num_classes,min_px,max_px", [(3, 500, 1200), (100, 1500, 2600)])
def test_png(tmp_path, num_classes, min_px, max_px):
    rng = np.random.default_rng(0)
    labels = rng.integers(0, num_classes, size=20 * num_classes)
    predictions = np.where(rng.random(labels.size) < 0.7, labels, rng.integers(0, num_classes, size=labels.size))
    matrix = confusion_matrix(labels, predictions, num_classes)
    backend = matplotlib.get_backend()
    path = plot_confusion_matrix(matrix, [f"class_{i}" for i in range(num_classes)], str(tmp_path / "cm.png"), "t")
    assert matplotlib.get_backend() == backend  # a bare Figure: the user's backend is left alone
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    height, width, _ = imread(path).shape
    assert min_px <= width <= max_px and min_px <= height <= max_px


def test_class_names_a_font_cannot_draw_become_class_ids(tmp_path, monkeypatch):
    """CJK names in matplotlib's default font are boxes: an installed font that has them draws them, else the
    confusion matrix labels its axes with class ids (the per-class CSV maps them to names)."""
    from matplotlib import font_manager

    from vit_recipes.publish.reports import plot_confusion_matrix, tick_names

    assert tick_names(["cat", "dog"], [0, 1]) == (["cat", "dog"], None)
    # An emoji no real font here has: matplotlib's LastResort font claims every character and draws boxes
    names, font = tick_names(["llama \U0001f999", "dog"], [0, 1])
    assert font is None or "LastResort" not in font, font
    monkeypatch.setattr(font_manager.fontManager, "ttflist", [])  # no other font installed
    assert tick_names(["猫", "犬"], [0, 1]) == (["0", "1"], None)
    path = plot_confusion_matrix(np.array([[3, 1], [0, 4]]), ["猫", "犬"], str(tmp_path / "cm.png"))
    assert Path(path).stat().st_size > 0


def test_the_figure_process_draws_what_the_run_would_and_reports_its_failure(tmp_path):
    """figures.FigureProcess: the training plots and the confusion matrix drawn in a child process are the PNGs the
    run's own process draws, byte for byte; a figure it cannot write fails finish() with the child's error line."""
    from vit_recipes.publish.figures import FigureProcess
    from vit_recipes.publish.plots import write_plots

    history = [{"loss": 2.0 - 0.1 * s, "learning_rate": 1e-3, "grad_norm": 1.0, "step": s, "epoch": s / 10}
               for s in range(1, 11)] + [{"eval_loss": 1.0, "eval_accuracy": 0.5, "step": 10, "epoch": 1.0}]  # fmt: skip
    matrix = np.array([[3, 1], [0, 4]])
    here, child = tmp_path / "here", tmp_path / "child"
    child.mkdir()  # a run's output folder exists before its figures: the two children do not wait for each other
    write_plots(history, str(here), 0.1)
    plot_confusion_matrix(matrix, ["cat", "dog"], str(here / "cm.png"), "t")
    figures = FigureProcess()  # started before the history exists, as a run starts it with training
    figures.plots(history, str(child), 0.1)
    # A process forked now (as DataLoader workers are, by the evaluation) holds the pipe's write end open
    forked = multiprocessing.get_context("fork").Process(target=time.sleep, args=(60,))
    forked.start()
    assert figures.confusion_matrix(matrix, ["cat", "dog"], str(child / "cm.png"), "t") == str(child / "cm.png")
    waiting = threading.Thread(target=figures.finish, daemon=True)
    waiting.start()
    waiting.join(30)
    forked.terminate()
    assert not waiting.is_alive(), "finish() waited for the pipe to close"
    drawn = sorted(p.name for p in here.iterdir())
    assert drawn == sorted(p.name for p in child.iterdir()) and "training_curves.png" in drawn
    assert all((here / name).read_bytes() == (child / name).read_bytes() for name in drawn)
    (tmp_path / "a-file").write_text("")
    broken = FigureProcess()
    broken.plots(history, str(tmp_path / "a-file"), 0.1)  # a file where the output folder should be
    with pytest.raises(RuntimeError, match=r"drawing the run's figures failed: .*Error"):
        broken.finish()


def test_without_a_process_for_the_figures_the_plots_are_drawn_in_the_run(tmp_path, monkeypatch, caplog):
    from types import SimpleNamespace

    from vit_recipes import steps

    def no_process(*args):
        raise OSError("fork: resource temporarily unavailable")

    monkeypatch.setattr(steps, "FigureProcess", no_process)
    history = [{"loss": 1.0, "learning_rate": 1e-3, "step": s, "epoch": s / 4} for s in range(1, 5)]
    trainer = SimpleNamespace(
        is_world_process_zero=lambda: True, state=SimpleNamespace(log_history=history), figures=None,
        args=SimpleNamespace(output_dir=str(tmp_path), label_smoothing_factor=0.0),
    )  # fmt: skip
    with caplog.at_level("WARNING"):
        steps.open_figures(trainer, wanted=True)
        assert steps.start_figures(trainer, plots=True) is None
    assert (tmp_path / "training_curves.png").is_file()
    assert "The plots are drawn in this process (no child process for them: fork: resource" in caplog.text

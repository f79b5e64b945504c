"""End-of-run reports: confusion matrix PNG, per-class accuracy CSV + markdown (multi-label: AP, precision, recall, F1)."""

import csv
import math
import os
from pathlib import Path

import numpy as np

from ..core.metrics import _safe_divide, average_precision, scored_rows  # the metric's own, not copies
from .plots import figure_grid, save_png

CSV_FIELDS = ("class_id", "label", "support", "correct", "accuracy")
MULTI_LABEL_FIELDS = ("class_id", "label", "support", "average_precision", "precision", "recall", "f1")
MAX_LABELLED_CLASSES = 120  # beyond this, label every n-th class so tick labels never overlap
MAX_ANNOTATED_CLASSES = 20  # cell counts are only legible on small matrices


def confusion_matrix(labels: np.ndarray, predictions: np.ndarray, num_classes: int) -> np.ndarray:
    """Counts of (true class, predicted class) pairs: rows are true classes, columns predictions."""
    labels, predictions = np.asarray(labels, dtype=np.int64), np.asarray(predictions, dtype=np.int64)
    for name, ids in (("labels", labels), ("predictions", predictions)):
        if ids.size and (ids.min() < 0 or ids.max() >= num_classes):
            raise ValueError(f"{name} must be class ids in [0, {num_classes}), got {ids.min()}..{ids.max()}.")
    return np.bincount(labels * num_classes + predictions, minlength=num_classes**2).reshape(num_classes, num_classes)


def per_class_accuracy(labels: np.ndarray, predictions: np.ndarray, label_names: list[str]) -> list[dict]:
    """One row per class in id order; accuracy is None for a class with no samples in this split."""
    matrix = confusion_matrix(labels, predictions, len(label_names))
    support, correct = matrix.sum(1), np.diag(matrix)
    return [
        {"class_id": i, "label": name, "support": int(s), "correct": int(c), "accuracy": float(c / s) if s else None}
        for i, (name, s, c) in enumerate(zip(label_names, support, correct))
    ]


def plot_confusion_matrix(matrix: np.ndarray, label_names: list[str], path: str, title: str = "") -> str:
    """Save the matrix as a PNG coloured by fraction of true class (rare classes show too), counts on small ones."""
    matrix = np.asarray(matrix)
    num_classes = len(label_names)
    rows = matrix.sum(1, keepdims=True)
    normalised = np.divide(matrix, rows, out=np.zeros(matrix.shape), where=rows > 0)
    ticks = np.arange(0, num_classes, max(1, math.ceil(num_classes / MAX_LABELLED_CLASSES)))
    side = min(22.0, max(7.0, 3.0 + 0.18 * num_classes))  # inches, capped so files stay a few MB
    font = min(10.0, max(5.0, 800 / max(len(ticks), 1)))  # points: half of each labelled row, readable at 100+ classes
    from matplotlib.font_manager import FontProperties  # imported here: only rank 0 draws, at the end

    fig, (ax,) = figure_grid(1, side + 1, side)  # extra width for the colourbar
    image = ax.imshow(normalised, cmap="Blues", vmin=0, vmax=1, interpolation="nearest")
    # An inset colourbar is exactly as tall as the (square) matrix, whatever the figure size.
    fig.colorbar(image, cax=ax.inset_axes([1.02, 0, 0.025, 1])).set_label("fraction of true class")
    # Long names lose their middle: their ends (e.g. "n01440764_tench") tell classes apart best.
    shortened = [n if len(n) <= 24 else f"{n[:11]}…{n[-12:]}" for n in (str(label_names[i]) for i in ticks)]
    names, font_file = tick_names(shortened, ticks)
    props = {"fontproperties": FontProperties(fname=font_file, size=font)} if font_file else {"fontsize": font}
    ax.set_xticks(ticks, names, rotation=90, **props)
    ax.set_yticks(ticks, names, **props)
    ids = "" if names == shortened else " (class id: names in the per-class CSV)"
    ax.set(xlabel=f"Predicted class{ids}", ylabel=f"True class{ids}", title=title)
    if num_classes <= MAX_ANNOTATED_CLASSES:
        # Size the counts to fit their cells (the matrix spans ~70% of the figure side; 72 points per inch).
        cell = 0.7 * side * 72 / len(matrix)
        cell_font = min(10.0, max(4.0, 1.2 * cell / max(2, len(str(matrix.max())))))
        for (i, j), count in np.ndenumerate(matrix):
            if count:  # empty cells stay blank to keep the plot quiet
                colour = "white" if normalised[i, j] > 0.5 else "black"
                ax.text(j, i, str(count), ha="center", va="center", fontsize=cell_font, color=colour)
    return save_png(fig, path)


def tick_names(names: list[str], ids) -> tuple[list[str], str | None]:
    """The names and a font drawing all of them (None: the default), else the class ids (CJK in DejaVu Sans: boxes)."""
    from matplotlib import font_manager
    from matplotlib.ft2font import FT2Font

    needed = {ord(c) for name in names for c in name if not c.isspace()}
    default = font_manager.findfont(font_manager.FontProperties())
    for path in [default, *sorted({f.fname for f in font_manager.fontManager.ttflist} - {default})]:
        if "LastResort" in path:  # its character map claims every character, and draws each as a box
            continue
        try:
            if needed <= set(FT2Font(path).get_charmap()):
                return names, None if path == default else path
        except (OSError, RuntimeError):  # a font file matplotlib cannot open: try the next
            continue
    return [str(i) for i in ids], None


def per_class_multi_label(logits: np.ndarray, targets: np.ndarray, label_names: list[str], threshold: float) -> list:
    """Per class: AP (None without a positive), precision, recall, F1 of `sigmoid >= threshold` (zero_division=0)."""
    truth, predicted = targets > 0.5, logits >= np.log(threshold / (1 - threshold))
    tp, support, flagged = (predicted & truth).sum(0), truth.sum(0), predicted.sum(0)
    ap = np.nan_to_num(average_precision(logits, truth))  # NaN without a positive: that row's AP becomes None below
    scores = zip(ap, _safe_divide(tp, flagged), _safe_divide(tp, support), _safe_divide(2 * tp, support + flagged))
    return [
        {"class_id": i, "label": name, "support": int(n)}
        | dict(zip(MULTI_LABEL_FIELDS[3:], map(float, row)))
        | ({} if n else {"average_precision": None})
        for i, (name, n, row) in enumerate(zip(label_names, support, scores))
    ]


def per_class_markdown(rows: list[dict], split: str, top_n: int = 10) -> str:
    """Markdown: the best and worst top_n classes by accuracy (multi-label: AP; ties by class id), or all when few."""
    key = "average_precision" if rows and "average_precision" in rows[0] else "accuracy"
    scored = [row for row in rows if row[key] is not None]
    best = sorted(scored, key=lambda row: (-row[key], row["class_id"]))
    total = sum(row["support"] for row in rows)
    if key == "accuracy":
        overall = f"{sum(row['correct'] for row in rows) / total:.2%}" if total else "n/a"
        counted = f"Accuracy {overall} on {total} samples, {len(rows)} classes."
        lines = [f"## Per-class accuracy ({split})", "", counted]
        header, missing, fields = "| Class | Accuracy | Support |\n|---|---:|---:|", "samples", ()
    else:
        mean = f"{np.mean([row[key] for row in scored]):.4f}" if scored else "n/a"
        lines = [f"## Per-class results ({split})", "", f"mAP {mean} over {len(scored)} of {len(rows)} classes."]
        header = "| Class | AP | Precision | Recall | F1 | Positives |\n|---|---:|---:|---:|---:|---:|"
        missing, fields = "positives", MULTI_LABEL_FIELDS[3:]
    if len(scored) < len(rows):
        lines.append(f"{len(rows) - len(scored)} classes have no {missing} in this split and are not ranked.")
    if len(scored) <= 2 * top_n:  # best and worst tables would overlap
        sections = [("All classes, best first", best)]
    else:
        worst = sorted(scored, key=lambda row: (row[key], row["class_id"]))
        sections = [(f"Best {top_n} classes", best[:top_n]), (f"Worst {top_n} classes", worst[:top_n])]
    for heading, section in sections:
        lines += ["", f"### {heading}", "", header]
        for row in section:
            label = str(row["label"]).replace("|", "\\|")  # a pipe in a name would split the cell
            cells = [f"{row[f]:.4f}" for f in fields] or [f"{row['accuracy']:.2%}"]
            lines.append(f"| {label} | {' | '.join(cells)} | {row['support']} |")
    return "\n".join(lines) + "\n"


def write_reports(
    logits, labels, label_names: list[str], output_dir: str, split="test", top_n=10, threshold=0.5, draw=None
) -> dict:
    """Write one split's reports; returns their paths. `draw` draws the matrix (figures.FigureProcess: a child).
    Rows that hold no image (unreadable, decoding per batch: metrics.LEFT_OUT labels) are left out, as the metrics
    leave them out."""
    logits, labels = np.asarray(logits), np.asarray(labels)
    multi = labels.ndim == 2 and labels.shape[1] > 1
    labels = labels if multi else labels.reshape(-1)
    if len(labels) == len(logits):
        scored = scored_rows(labels)
        logits, labels = logits[scored], labels[scored]
    if logits.ndim != 2 or logits.shape != (len(labels), len(label_names)):
        raise ValueError(
            f"Expected logits of shape (num_samples, num_classes) = ({len(labels)}, {len(label_names)}), "
            f"got {logits.shape}."
        )
    os.makedirs(output_dir, exist_ok=True)
    stem = os.path.join(output_dir, f"per_class_{'results' if multi else 'accuracy'}_{split}")
    paths = {"per_class_csv": stem + ".csv", "per_class_markdown": stem + ".md"}
    if multi:
        rows = per_class_multi_label(logits, labels, label_names, threshold)
    else:
        predictions = logits.argmax(1)
        rows = per_class_accuracy(labels, predictions, label_names)
        seen = sorted((r for r in rows if r["accuracy"] is not None), key=lambda r: r["accuracy"])
        paths["worst_recall"] = [(r["label"], r["accuracy"]) for r in seen[:3]]  # per-class accuracy is recall
        matrix = confusion_matrix(labels, predictions, len(label_names))
        paths["confusion_matrix"] = os.path.join(output_dir, f"confusion_matrix_{split}.png")
        title = f"Confusion matrix ({split}, accuracy {np.trace(matrix) / max(len(labels), 1):.2%})"
        (draw or plot_confusion_matrix)(matrix, label_names, paths["confusion_matrix"], title=title)
    markdown = per_class_markdown(rows, split, top_n)
    with open(paths["per_class_csv"], "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=MULTI_LABEL_FIELDS if multi else CSV_FIELDS)
        writer.writeheader()
        writer.writerows(
            {k: "" if v is None else f"{v:.6f}" if isinstance(v, float) else v for k, v in r.items()} for r in rows
        )
    Path(paths["per_class_markdown"]).write_text(markdown, encoding="utf-8")
    return {**paths, "markdown": markdown}

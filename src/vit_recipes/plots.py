"""PNG plots of a run from `trainer.state.log_history` (tools/redraw_plots.py redraws them from trainer_state.json):
training curves, validation metrics, and throughput and memory (meter.SpeedMeter). reports.py draws the confusion
matrix."""

from __future__ import annotations

import math
import os
import re
from typing import TYPE_CHECKING

from tqdm.auto import tqdm

if TYPE_CHECKING:  # matplotlib is imported when a plot is drawn: ~0.8 s off every process's start-up
    from matplotlib.figure import Figure

# eval_* keys that describe the evaluation loop rather than the model
_EVAL_BOOKKEEPING = ("runtime", "samples_per_second", "steps_per_second", "model_preparation_time")
_RANK_KEY = re.compile(r"^(?P<name>.+)_rank(?P<rank>\d+)$")


def _series(history: list[dict], key: str) -> tuple[list[float], list[float]]:
    points = [
        (e["step"], e[key]) for e in history if isinstance(e.get(key), (int, float)) and isinstance(e.get("step"), int)
    ]
    return [p[0] for p in points], [p[1] for p in points]


def _grid(panels: int, width: float = 5.0, height: float = 3.4) -> tuple[Figure, list]:
    cols = min(3, panels)
    rows = math.ceil(panels / cols)
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width * cols, height * rows), dpi=100)
    FigureCanvasAgg(fig)
    axes = [fig.add_subplot(rows, cols, i + 1) for i in range(panels)]
    return fig, axes


def _finish(ax, title: str, amount: bool = False) -> None:
    """Title, step axis and grid; an amount (images/s, seconds, GiB, a fraction) is drawn from zero, so a small
    change does not look like a cliff."""
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
    if amount:
        ax.set_ylim(bottom=0)


def _save(fig: Figure, path: str) -> str:
    fig.tight_layout()
    fig.savefig(path)
    return path


def _marker(steps: list) -> str | None:
    return "o" if len(steps) < 30 else None  # few points: each one visible


def training_entries(history: list[dict]) -> list[dict]:
    return [e for e in history if "loss" in e and "learning_rate" in e]


def plot_training_curves(history: list[dict], path: str, label_smoothing: float = 0.0) -> str | None:
    train = training_entries(history)
    if not train:
        return None
    panels = [("loss", "Loss"), ("learning_rate", "Learning rate")]
    if any("grad_norm" in e for e in train):
        panels.append(("grad_norm", "Grad norm"))
    fig, axes = _grid(len(panels))
    for ax, (key, title) in zip(axes, panels):
        steps, values = _series(train, key)
        smoothed = f", label smoothing {label_smoothing:g}" if key == "loss" and label_smoothing else ""
        ax.plot(steps, values, marker=_marker(steps), label=f"train {key}{smoothed}")
        if key == "loss":
            eval_steps, eval_values = _series(history, "eval_loss")
            if eval_steps:
                ax.plot(eval_steps, eval_values, marker="o", label="validation loss (no smoothing)")
            ax.legend()
        _finish(ax, title, amount=True)
    return _save(fig, path)


def plot_validation_metrics(history: list[dict], path: str) -> str | None:
    logged = (k for e in history for k, v in e.items() if k.startswith("eval_") and isinstance(v, (int, float)))
    names = [key for key in dict.fromkeys(logged) if not key.endswith(_EVAL_BOOKKEEPING)]
    if not names:
        return None
    fig, axes = _grid(len(names))
    for ax, name in zip(axes, names):
        steps, values = _series(history, name)
        ax.plot(steps, values, marker="o")
        _finish(ax, name.removeprefix("eval_"))
    return _save(fig, path)


def plot_throughput(history: list[dict], path: str) -> str | None:
    train = training_entries(history)
    if not any("images_per_second" in e for e in train):
        return None
    panels: list[tuple[str, list[str]]] = [
        ("Images/s (all ranks)", ["images_per_second"]),
        ("Step time (s)", ["step_time_s"]),
        ("Data-wait fraction", ["data_wait_fraction"]),
    ]
    if any("mfu" in e for e in train):
        panels.append(("MFU", ["mfu"]))
    per_rank: dict[str, list[str]] = {}
    for key in dict.fromkeys(k for entry in train for k in entry):
        if match := _RANK_KEY.match(key):
            per_rank.setdefault(match["name"], []).append(key)
    for name, keys in per_rank.items():
        panels.append((f"{name} per rank", sorted(keys, key=lambda k: int(_RANK_KEY.match(k)["rank"]))))
    fig, axes = _grid(len(panels))
    for ax, (title, keys) in zip(axes, panels):
        for key in keys:
            steps, values = _series(train, key)
            ax.plot(steps, values, marker=_marker(steps), label=key)
        if len(keys) > 1:
            ax.legend(fontsize=7)
        _finish(ax, title, amount=True)
    return _save(fig, path)


def write_plots(log_history: list[dict], output_dir: str, label_smoothing: float = 0.0) -> dict[str, str]:
    """Write the plots that the history has data for; return {name: path}."""
    os.makedirs(output_dir, exist_ok=True)
    jobs = [
        ("training_curves", lambda history, path: plot_training_curves(history, path, label_smoothing)),
        ("validation_metrics", plot_validation_metrics),
        ("throughput", plot_throughput),
    ]
    written = {}
    for name, plot in tqdm(jobs, desc="writing plots", leave=False):
        path = plot(log_history, os.path.join(output_dir, f"{name}.png"))
        if path:
            written[name] = path
    return written

"""PNG plots of `trainer.state.log_history`: training curves, validation metrics, throughput and memory."""

import math
import os
import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # matplotlib is imported when a plot is drawn: ~0.8 s off every process's start-up
    from matplotlib.figure import Figure

_EVAL_BOOKKEEPING = ("runtime", "samples_per_second", "steps_per_second", "model_preparation_time")
_RANK_KEY = re.compile(r"^(?P<name>.+)_rank(?P<rank>\d+)$")


def _series(history: list[dict], key: str) -> tuple[list[float], list[float]]:
    kept = [e for e in history if isinstance(e.get(key), (int, float)) and isinstance(e.get("step"), int)]
    return [e["step"] for e in kept], [e[key] for e in kept]


def figure_grid(panels: int, width: float = 5.0, height: float = 3.4) -> tuple["Figure", list]:
    """A bare Agg Figure, `panels` axes 3 a row; no pyplot state: it needs no display and disturbs no session."""
    cols = min(3, panels)
    rows = math.ceil(panels / cols)
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width * cols, height * rows), dpi=100)
    FigureCanvasAgg(fig)
    return fig, [fig.add_subplot(rows, cols, i + 1) for i in range(panels)]


_FRACTION = "fraction (1 = all)"
_KNOWN = {  # logged key -> (title, y-axis label); describe() puts other keys in words, unit-less
    "loss": ("Loss", "loss (batch mean)"),  # per image, or per image and label (multi-label)
    "learning_rate": ("Learning rate", "learning rate"),
    "grad_norm": ("Gradient norm (mean over each logging window)", "L2 norm, before clipping"),
    "top5_accuracy": ("Top-5 accuracy", _FRACTION),
    "f1_macro": ("F1 (macro)", _FRACTION),
    "f1_micro": ("F1 (micro)", _FRACTION),
    "precision_macro": ("Precision (macro)", _FRACTION),
    "recall_macro": ("Recall (macro) = balanced accuracy", _FRACTION),
    "mean_average_precision": ("Mean average precision (mAP)", _FRACTION),
    "subset_accuracy": ("Subset accuracy (exact match)", _FRACTION),
    "images_per_second": ("Training throughput (all ranks)", "images/s"),
    "step_time_s": ("Step time", "seconds"),
    "data_wait_fraction": ("Time waiting for data", "fraction of the step"),
    "mfu": ("Model FLOPs utilisation", "fraction of peak"),
    "cpu_peak_rss_gib": ("Peak host memory (RSS) per rank", "GiB"),
    "gpu_mem_allocated_gib": ("GPU memory allocated per rank", "GiB"),
    "gpu_mem_reserved_gib": ("GPU memory reserved per rank", "GiB"),
    "gpu_mem_peak_gib": ("Peak GPU memory per rank", "GiB"),
}


def describe(key: str) -> tuple[str, str]:
    """(title, y label) of a logged key (eval_/test_ prefix and _rankN suffix ignored)."""
    key = re.sub(r"^(eval|test)_", "", key)
    key = _RANK_KEY.match(key)["name"] if _RANK_KEY.match(key) else key
    if key in _KNOWN:
        return _KNOWN[key]
    fraction = key.endswith(("accuracy", "precision", "recall")) or key.startswith(("f1", "precision", "recall"))
    return key.replace("_", " ").capitalize(), _FRACTION if fraction else "value"


def _finish(ax, title: str, ylabel: str, legend: bool = False) -> None:
    """Title, axes, grid; y from zero (a 0.996 -> 1.0 step is no cliff) with headroom; a legend goes below the axes."""
    ax.set_title(title, fontsize=10)
    ax.set(xlabel="training step", ylabel=ylabel)
    ax.grid(alpha=0.3)
    values = [y for line in ax.get_lines() for y in line.get_ydata() if math.isfinite(y)]
    top = max(values, default=1.0)
    ax.set_ylim(0, 1.05 if ylabel == _FRACTION and top <= 1 else (top * 1.1 if top > 0 else 1.0))
    if legend:
        ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2, frameon=False)


def save_png(fig: "Figure", path: str) -> str:
    fig.tight_layout()
    fig.set_layout_engine(None)  # laid out: savefig would otherwise lay it out again in a dry-run draw
    fig.savefig(path, pil_kwargs={"compress_level": 1})  # the run's end waits: PIL's default 6 took 3x as long
    return path


def _marker(steps: list) -> str | None:
    return "o" if len(steps) < 30 else None  # few points: each one visible


def training_entries(history: list[dict]) -> list[dict]:
    return [e for e in history if "loss" in e and "learning_rate" in e]


def plot_training_curves(history: list[dict], path: str, label_smoothing: float = 0.0) -> str | None:
    train = training_entries(history)
    if not train:
        return None
    panels = ["loss", "learning_rate"] + (["grad_norm"] if any("grad_norm" in e for e in train) else [])
    fig, axes = figure_grid(len(panels))
    for ax, key in zip(axes, panels):
        steps, values = _series(train, key)
        smoothed = f", label smoothing {label_smoothing:g}" if key == "loss" and label_smoothing else ""
        ax.plot(steps, values, marker=_marker(steps), label=f"train{smoothed}")
        if key == "loss":
            eval_steps, eval_values = _series(history, "eval_loss")
            if eval_steps:
                suffix = " (no smoothing)" if label_smoothing else ""
                ax.plot(eval_steps, eval_values, marker="o", label=f"validation{suffix}")
        _finish(ax, *describe(key), legend=key == "loss")
    return save_png(fig, path)


def plot_validation_metrics(history: list[dict], path: str) -> str | None:
    logged = (k for e in history for k, v in e.items() if k.startswith("eval_") and isinstance(v, (int, float)))
    names = [key for key in dict.fromkeys(logged) if not key.endswith(_EVAL_BOOKKEEPING)]
    if not names:
        return None
    fig, axes = figure_grid(len(names))
    for ax, name in zip(axes, names):
        steps, values = _series(history, name)
        ax.plot(steps, values, marker="o")
        title, ylabel = describe(name)
        lower = title[:1].lower() if not title[1:2].isupper() and not title[1:2].isdigit() else title[:1]
        _finish(ax, f"Validation {lower}{title[1:]}", ylabel)
    return save_png(fig, path)


def plot_throughput(history: list[dict], path: str) -> str | None:
    train = training_entries(history)
    if not any("images_per_second" in e for e in train):
        return None
    panels = [["images_per_second"], ["step_time_s"], ["data_wait_fraction"]]
    if any("mfu" in e for e in train):
        panels.append(["mfu"])
    per_rank: dict[str, list[str]] = {}
    for key in dict.fromkeys(k for entry in train for k in entry):
        if match := _RANK_KEY.match(key):
            per_rank.setdefault(match["name"], []).append(key)
    panels += [sorted(keys, key=lambda k: int(_RANK_KEY.match(k)["rank"])) for keys in per_rank.values()]
    fig, axes = figure_grid(len(panels))
    for ax, keys in zip(axes, panels):
        for key in keys:
            steps, values = _series(train, key)
            rank = _RANK_KEY.match(key)
            ax.plot(steps, values, marker=_marker(steps), label=f"rank {rank['rank']}" if rank else key)
        _finish(ax, *describe(keys[0]), legend=len(keys) > 1)
    return save_png(fig, path)


def write_plots(log_history: list[dict], output_dir: str, label_smoothing: float = 0.0) -> dict[str, str]:
    """Write the plots that the history has data for; return {name: path}."""
    os.makedirs(output_dir, exist_ok=True)
    jobs = {
        "training_curves": lambda history, path: plot_training_curves(history, path, label_smoothing),
        "validation_metrics": plot_validation_metrics,
        "throughput": plot_throughput,
    }  # no progress bar: under a second, drawn beside the evaluation's (figures.py)
    paths = {name: plot(log_history, os.path.join(output_dir, f"{name}.png")) for name, plot in jobs.items()}
    return {name: path for name, path in paths.items() if path}

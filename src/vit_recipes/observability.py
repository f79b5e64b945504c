"""Tracking, profiling and plots.

- `ObservabilityArguments`: the command-line/recipe switches (profiler window, plots).
- `resolve_report_to`: `report_to` for RecipeTrainingArguments (TensorBoard by default; it degrades to no tracker,
  with one log line, when tensorboard is not installed).
- `StepMetricsCallback`: per-step images/s, step time, data-wait fraction, MFU and memory per rank, added to every
  training log so TensorBoard, trackio and W&B all receive them (ImageClassificationTrainer.log asks it).
- `attach`: adds the callbacks above, the profiler window (profiling.py) and the DeepSpeed flops-profile keeper to
  a built Trainer.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import time
from dataclasses import dataclass, field

import torch
from transformers import TrainerCallback

from .trainer import StepIntervals

logger = logging.getLogger(__name__)

GIB = 2**30


@dataclass
class ObservabilityArguments:
    """Profiler traces and plots written next to the model."""

    profile_steps: str | None = field(
        default=None,
        metadata={
            "help": "Capture PyTorch profiler Chrome traces (one per rank) for these training steps, e.g. '20-25' "
            "(pick a window after warm-up). Analyse with `python -m vit_recipes.trace_analysis OUTPUT_DIR/profiler`."
        },
    )
    profile_dir: str | None = field(default=None, metadata={"help": "Where traces go (default: OUTPUT_DIR/profiler)."})
    profile_memory: bool = field(
        default=False, metadata={"help": "Profiler: also record tensor allocations (bigger traces)."}
    )
    profile_record_shapes: bool = field(default=False, metadata={"help": "Profiler: record operator input shapes."})
    profile_with_stack: bool = field(
        default=False, metadata={"help": "Profiler: record Python stacks (much bigger traces)."}
    )
    plots: bool = field(default=True, metadata={"help": "Write loss/learning-rate/metric PNG plots after the run."})

    def __post_init__(self):
        if self.profile_steps is not None and str(self.profile_steps).strip().lower() in ("", "none", "null"):
            self.profile_steps = None
        if self.profile_steps is not None:
            parse_steps(self.profile_steps)  # ValueError -> one-line RecipeError in parse_args

    @property
    def profile_window(self) -> tuple[int, int] | None:
        return parse_steps(self.profile_steps) if self.profile_steps else None


def parse_steps(spec: str | int) -> tuple[int, int]:
    """'20-25' -> (20, 25), '7' -> (7, 7): first and last optimizer step (1-based, inclusive) to profile."""
    text = str(spec).strip()
    parts = text.split("-")
    try:
        if len(parts) == 1:
            start = end = int(parts[0])
        elif len(parts) == 2:
            start, end = int(parts[0]), int(parts[1])
        else:
            raise ValueError
    except ValueError:
        raise ValueError(f"profile_steps must look like '20-25' or '20', got {spec!r}") from None
    if start < 1 or end < start:
        raise ValueError(f"profile_steps must be FIRST-LAST with 1 <= FIRST <= LAST, got {spec!r}")
    return start, end


# --- Trackers -------------------------------------------------------------------------------------------------

DEFAULT_REPORT_TO = "tensorboard"


def tensorboard_available() -> bool:
    return importlib.util.find_spec("tensorboard") is not None or importlib.util.find_spec("tensorboardX") is not None


def resolve_report_to(report_to):
    """Normalise `report_to` before TrainingArguments sees it.

    Accepts a list, or a string with commas ("tensorboard,wandb"). TensorBoard (the default: local, no account) is
    dropped with one warning when neither tensorboard nor tensorboardX is installed, instead of failing the run.
    """
    if report_to is None:
        return "none"
    names = report_to if isinstance(report_to, (list, tuple)) else str(report_to).split(",")
    names = [str(n).strip(" []'\"") for n in names]  # also tolerates a YAML list read as its string form
    names = [n for n in names if n]
    if "tensorboard" in names and not tensorboard_available():
        logger.warning("tensorboard is not installed: TensorBoard logging is off (pip install tensorboard).")
        names = [n for n in names if n != "tensorboard"]
    if not names or names == ["none"]:
        return "none"
    return names[0] if len(names) == 1 else names


# --- Per-step metrics -----------------------------------------------------------------------------------------


def _peak_rss_gib() -> float | None:
    try:
        import resource
        import sys

        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return rss / GIB if sys.platform == "darwin" else rss * 1024 / GIB  # bytes on macOS, KiB on Linux
    except (ImportError, OSError):
        return None


def _gather_per_rank(values: list[float], device) -> list[list[float]]:
    """All ranks' `values` (rank order). Every rank must call this at the same point (it is a collective)."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [values]
    local = torch.tensor(values, dtype=torch.float64, device=device)
    gathered = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, local)
    return [t.tolist() for t in gathered]


class StepMetricsCallback(StepIntervals):
    """Speed and memory of the steps since the previous log, added to the training logs of every tracker.

    Keys (TensorBoard shows them as train/<key>): images_per_second (all ranks together), step_time_s,
    data_wait_fraction, mfu (when the GPU's peak is known), and per rank r: gpu_mem_allocated_gib_rank{r},
    gpu_mem_reserved_gib_rank{r}, gpu_mem_peak_gib_rank{r} on GPUs, cpu_peak_rss_gib_rank{r} on CPUs.
    Loss, learning rate and grad norm are logged by the Trainer itself. Time spent evaluating or saving is
    excluded. `extend_logs` is called by ImageClassificationTrainer.log on every rank.
    """

    def __init__(self, images_per_step: int, flops_per_image: float | None = None, peak_flops: float | None = None):
        super().__init__()
        self.images_per_step = images_per_step
        self.flops_per_image = flops_per_image
        self.peak_flops = peak_flops  # of all GPUs together

    def on_train_begin(self, args, state, control, **kwargs):
        self._last, self._pending_data = time.perf_counter(), 0.0

    def speed(self) -> dict[str, float]:
        if not self.steps or self.seconds <= 0:
            return {}
        step = self.seconds / self.steps
        out = {
            "images_per_second": round(self.images_per_step / step, 3),
            "step_time_s": round(step, 6),
            "data_wait_fraction": round(self.data_seconds / self.seconds, 5),
        }
        if self.flops_per_image and self.peak_flops:
            out["mfu"] = round(self.images_per_step / step * self.flops_per_image / self.peak_flops, 5)
        return out

    def memory(self, device) -> dict[str, float]:
        """Memory of every rank (a collective on multi-process runs)."""
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            names = ("gpu_mem_allocated_gib", "gpu_mem_reserved_gib", "gpu_mem_peak_gib")
            local = [torch.cuda.memory_allocated(), torch.cuda.memory_reserved(), torch.cuda.max_memory_allocated()]
            local = [v / GIB for v in local]
        else:
            rss = _peak_rss_gib()
            if rss is None:
                return {}
            names, local = ("cpu_peak_rss_gib",), [rss]
        out = {}
        for rank, values in enumerate(_gather_per_rank(local, device)):
            out.update({f"{name}_rank{rank}": round(value, 4) for name, value in zip(names, values)})
        return out

    def extend_logs(self, logs: dict, args, state) -> dict[str, float]:
        if "loss" not in logs or "learning_rate" not in logs:  # only training-step logs
            return {}
        out = self.speed()
        self.reset_totals()  # the next log covers the steps after this one
        out.update(self.memory(args.device))
        return out


class _PredictionsToTensorBoard(TrainerCallback):
    """transformers' TensorBoardCallback has no on_predict (the W&B and trackio ones do): forward the final
    eval/test metrics of Trainer.predict to it, so TensorBoard shows them too (eval/..., test/...)."""

    def __init__(self, tensorboard):
        self.tensorboard = tensorboard

    def on_predict(self, args, state, control, metrics=None, **kwargs):
        if metrics:
            self.tensorboard.on_log(args, state, control, logs=dict(metrics))


def attach(
    trainer,
    observe: ObservabilityArguments,
    images_per_step: int,
    flops_per_image: float | None = None,
    peak_flops: float | None = None,
) -> StepMetricsCallback:
    """Add per-step metrics, the profiler window and the DeepSpeed flops-profile keeper to a built Trainer."""
    from transformers.integrations import TensorBoardCallback

    from .profiling import DeepSpeedFlopsProfileCallback, ProfilerCallback, deepspeed_flops_profiler_file

    if not trainer.args.run_name:
        # One name for the whole script: trackio finishes its run at train end and resumes it by name, so the final
        # eval/test metrics of Trainer.predict land in the same run (without a name they open a new, random one).
        folder = os.path.basename(os.path.abspath(trainer.args.output_dir))
        trainer.args.run_name = f"{folder}-{time.strftime('%Y%m%d-%H%M%S')}"
    step_metrics = StepMetricsCallback(images_per_step, flops_per_image, peak_flops)
    trainer.add_callback(step_metrics)
    for callback in trainer.callback_handler.callbacks:
        if isinstance(callback, TensorBoardCallback):
            trainer.add_callback(_PredictionsToTensorBoard(callback))
    if observe.profile_steps:
        start, end = observe.profile_window
        trainer.add_callback(
            ProfilerCallback(
                start,
                end,
                observe.profile_dir or f"{trainer.args.output_dir}/profiler",
                profile_memory=observe.profile_memory,
                record_shapes=observe.profile_record_shapes,
                with_stack=observe.profile_with_stack,
                pause=[c for c in trainer.callback_handler.callbacks if hasattr(c, "add_data_wait")],
            )
        )
    flops_file = deepspeed_flops_profiler_file(trainer)
    if flops_file:
        trainer.add_callback(DeepSpeedFlopsProfileCallback(flops_file))
    return step_metrics

"""Training speed and memory of optimizer steps and data waits, per log and for the run (docs/observability.md)."""

import sys
import time
from dataclasses import dataclass

import torch
from transformers import TrainerCallback

from .timeline import seconds_since_start

GIB = 2**30


@dataclass
class _Totals:
    steps: int = 0
    seconds: float = 0.0
    data_seconds: float = 0.0


class SpeedMeter(TrainerCallback):
    """Speed and memory of training steps (see the module docstring)."""

    warmup_steps = 5  # left out of the run's figures (compilation, allocator warm-up)

    def __init__(self, images_per_step: int, flops_per_image: float | None = None, peak_flops: float | None = None):
        self.images_per_step = images_per_step  # the plan's global batch
        self.flops_per_image = flops_per_image
        self.peak_flops = peak_flops  # of all GPUs together
        self.window, self.run = _Totals(), _Totals()  # since the previous log; after warm-up
        self._pending_data, self._last = 0.0, None  # seconds waited for data; the previous step's end
        self.startup: dict[str, float] = {}  # process start to the first step's end; the warm-up steps' time

    def add_data_wait(self, seconds: float) -> None:
        self._pending_data += seconds

    def on_train_begin(self, args, state, control, **kwargs):
        self._last, self._pending_data = time.perf_counter(), 0.0
        self._began, self.startup = self._last, {}

    def on_step_end(self, args, state, control, **kwargs):
        now = time.perf_counter()
        if not self.startup:  # what a user waits for before training runs at speed
            self.startup["first_step_after_start_s"] = seconds_since_start()
        if len(self.startup) == 1 and getattr(state, "global_step", 0) >= self.warmup_steps:
            self.startup["warmup_s"] = now - self._began  # the first steps: compilation, allocator, first batches
        if self._last is not None:
            after_warmup = getattr(state, "global_step", 0) > self.warmup_steps
            for t in (self.window, self.run) if after_warmup else (self.window,):
                t.steps += 1
                t.seconds += now - self._last
                t.data_seconds += self._pending_data
        self._last, self._pending_data = now, 0.0

    def pause(self, *args, **kwargs) -> None:
        self._last = None  # the next interval would include evaluation, saving or a profiler export

    on_evaluate = on_save = on_epoch_begin = pause

    def _figures(self, totals: _Totals) -> dict[str, float]:
        if not totals.steps or totals.seconds <= 0:
            return {}
        step = totals.seconds / totals.steps
        out = {"images_per_second": self.images_per_step / step, "step_time_s": step}
        out["data_wait_fraction"] = totals.data_seconds / totals.seconds
        if self.flops_per_image and self.peak_flops:
            out["mfu"] = out["images_per_second"] * self.flops_per_image / self.peak_flops
        return out

    @property
    def images_per_second(self) -> float | None:
        """Steady-state training speed of the run so far (None before the first step after warm-up)."""
        return self._figures(self.run).get("images_per_second")

    def memory(self, device) -> dict[str, float]:
        """Memory of every rank (a collective on multi-process runs)."""
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            names = ("gpu_mem_allocated_gib", "gpu_mem_reserved_gib", "gpu_mem_peak_gib")
            local = [torch.cuda.memory_allocated(), torch.cuda.memory_reserved(), torch.cuda.max_memory_allocated()]
        else:
            try:
                import resource  # not on Windows

                rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # bytes on macOS, KiB on Linux
            except (ImportError, OSError):
                return {}
            names, local = ("cpu_peak_rss_gib",), [rss if sys.platform == "darwin" else rss * 1024]
        per_rank, dist = [local], torch.distributed
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:  # every rank calls this
            mine = torch.tensor(local, dtype=torch.float64, device=device)
            gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
            dist.all_gather(gathered, mine)
            per_rank = [t.tolist() for t in gathered]
        return {
            f"{n}_rank{rank}": round(v / GIB, 4) for rank, values in enumerate(per_rank) for n, v in zip(names, values)
        }

    def extend_logs(self, logs: dict, args, state) -> dict[str, float]:
        """Figures of the steps since the previous log; called by ImageClassificationTrainer.log on every rank."""
        if "loss" not in logs or "learning_rate" not in logs:  # only training-step logs
            return {}
        digits = {"images_per_second": 3, "step_time_s": 6, "data_wait_fraction": 5, "mfu": 5}
        out = {k: round(v, digits[k]) for k, v in self._figures(self.window).items()}
        self.window = _Totals()
        return {**out, **self.memory(args.device)}

    def metrics(self) -> dict[str, float]:
        """The run's steady-state figures, for the train metrics."""
        figures = self._figures(self.run)
        digits = {"images_per_second": 2, "step_time_s": 5, "data_wait_fraction": 5, "mfu": 4}
        out = {f"train_{k}": round(v, digits[k]) for k, v in figures.items()}
        out.update({f"train_{k}": round(v, 2) for k, v in self.startup.items()})
        if figures:
            out["train_time_20_steps_s"] = round(20 * figures["step_time_s"], 3)
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            out["train_peak_allocated_gib"] = round(torch.cuda.max_memory_allocated() / GIB, 3)
            out["train_peak_reserved_gib"] = round(torch.cuda.max_memory_reserved() / GIB, 3)
        return out

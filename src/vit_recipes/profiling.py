"""PyTorch profiler window (--profile_steps) and the DeepSpeed flops profiler's output.

The profiler records a window of optimizer steps on every rank and writes, per rank:
- `rank{r}.pt.trace.json.gz`: a Chrome trace (opens in https://ui.perfetto.dev or chrome://tracing, and in
  HolisticTraceAnalysis; `python benchmarks/trace_analysis.py DIR` writes a report);
- `rank{r}_ops.txt`: the profiler's own operator table (key_averages, sorted by self time).

Labelled regions in the trace (record_function, see trainer.py): `data` (fetching batches), `forward`
(compute_loss), `backward`, `optimizer_step`; communication appears as the backend's own ops and kernels
(`gloo:all_reduce`, `nccl:all_reduce`, `ncclDevKernel_...`, `record_param_comms`). Steps are the profiler's
`ProfilerStep#N` spans on the host thread (CUDA traces repeat them, and the regions, on the GPU timeline as
`gpu_user_annotation` events spanning the kernels: those are not steps); the trace's `vit_recipes_profile`
metadata maps them to global steps (ProfilerStep#N is global step N + step_offset).
"""

from __future__ import annotations

import json
import logging
import os
import shutil

import torch
from transformers import TrainerCallback

logger = logging.getLogger(__name__)

TRACE_SUFFIX = ".pt.trace.json.gz"


def trace_path(directory: str, rank: int) -> str:
    return os.path.join(directory, f"rank{rank}{TRACE_SUFFIX}")


def profiler_activities() -> list:
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    return activities


class ProfilerCallback(TrainerCallback):
    """Profile optimizer steps `first`..`last` (1-based, inclusive) on every rank.

    The profiler starts one step early (a warm-up step whose events are discarded: starting the profiler is slow)
    at the end of the preceding step, so each profiled step spans end-of-step to end-of-step and includes its
    data loading. If training ends inside the window, what was recorded is written at train end.
    """

    def __init__(
        self,
        first: int,
        last: int,
        output_dir: str,
        profile_memory: bool = False,
        record_shapes: bool = False,
        with_stack: bool = False,
        pause: list | None = None,
    ):
        self.first, self.last = first, last
        self.warmup = 1 if first > 1 else 0
        self.start_after = first - 1 - self.warmup  # optimizer steps completed when the profiler starts
        self.output_dir = output_dir
        self.options = dict(profile_memory=profile_memory, record_shapes=record_shapes, with_stack=with_stack)
        self.profiler = None
        self.done = False
        self.rank = 0
        self.files: list[str] = []
        self._optimizer_region = None
        # The speed meter (meter.py) skips the profiled steps and the export.
        self.pause = list(pause or [])

    def _pause_speed_stats(self) -> None:
        for callback in self.pause:
            callback.pause()

    def _start(self, args, state) -> None:
        self.rank = args.process_index
        self.profiler = torch.profiler.profile(
            activities=profiler_activities(),
            schedule=torch.profiler.schedule(wait=0, warmup=self.warmup, active=self.last - self.first + 1),
            on_trace_ready=self._export,
            acc_events=True,  # one cycle only; silences the "clears events" warning
            **self.options,
        )
        # ProfilerStep#N is global step N + step_offset.
        metadata = {
            "first_step": self.first,
            "last_step": self.last,
            "step_offset": self.first - self.warmup,
            "world_size": args.world_size,
            "rank": args.process_index,
        }
        self.profiler.preset_metadata_json("vit_recipes_profile", json.dumps(metadata))
        self.profiler.start()
        logger.info("Profiling steps %d-%d into %s", self.first, self.last, self.output_dir)

    def _export(self, profiler) -> None:
        os.makedirs(self.output_dir, exist_ok=True)
        path = trace_path(self.output_dir, self.rank)
        profiler.export_chrome_trace(path)
        sort = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
        table = profiler.key_averages().table(sort_by=sort, row_limit=60)
        table_path = os.path.join(self.output_dir, f"rank{self.rank}_ops.txt")
        with open(table_path, "w", encoding="utf-8") as f:
            f.write(f"Operators of steps {self.first}-{self.last}, rank {self.rank}, sorted by {sort}\n{table}\n")
        self.files += [path, table_path]
        self.done = True
        logger.info("Wrote profiler trace %s", path)

    def _stop(self) -> None:
        if self.profiler is not None:
            self.profiler.stop()  # in a recording window this exports (on_trace_ready)
            self.profiler = None
        self.done = True

    def on_train_begin(self, args, state, control, **kwargs):
        if self.profiler is None and not self.done:
            if state.global_step == self.start_after:
                self._start(args, state)
            elif state.global_step > self.start_after:
                logger.warning(
                    "profile_steps %d-%d: training starts at step %d, after the window; nothing is profiled.",
                    self.first,
                    self.last,
                    state.global_step + 1,
                )
                self.done = True

    def on_step_end(self, args, state, control, **kwargs):
        if self.profiler is not None:
            if 0 < state.max_steps <= state.global_step and not self.done:  # training ends inside the window:
                self._warn_cut_short()  # stop here, so no empty step is opened after the last one
                self._stop()
            else:
                self.profiler.step()
                if self.done:  # the last active step was exported
                    self._stop()
            self._pause_speed_stats()
        elif not self.done and state.global_step == self.start_after:
            self._start(args, state)
            self._pause_speed_stats()

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if self.profiler is not None:
            self._optimizer_region = torch.profiler.record_function("optimizer_step")
            self._optimizer_region.__enter__()

    def on_optimizer_step(self, args, state, control, **kwargs):
        if self._optimizer_region is not None:
            self._optimizer_region.__exit__(None, None, None)
            self._optimizer_region = None

    def _warn_cut_short(self) -> None:
        logger.warning("Training ended inside profile_steps %d-%d: writing the steps recorded.", self.first, self.last)

    def on_train_end(self, args, state, control, **kwargs):
        if self.profiler is not None:  # e.g. stopped early by a callback
            self._warn_cut_short()
            self._stop()


# --- DeepSpeed flops profiler ---------------------------------------------------------------------------------


def flops_profiler_output(ds_config: dict | None) -> str | None:
    """The output_file of an enabled DeepSpeed flops profiler (None when off, or when it prints to stdout only)."""
    section = (ds_config or {}).get("flops_profiler") or {}
    if not section.get("enabled"):
        return None
    output = section.get("output_file")
    if not output:
        logger.warning(
            "DeepSpeed flops_profiler has no output_file: its profile goes to stdout only. Set "
            '"output_file" in the ds config to keep it with the run.'
        )
    return output or None


def deepspeed_flops_profiler_file(trainer) -> str | None:
    if not getattr(trainer, "is_deepspeed_enabled", False):
        return None
    plugin = getattr(trainer.accelerator.state, "deepspeed_plugin", None)
    return flops_profiler_output(getattr(plugin, "deepspeed_config", None))


def keep_flops_profile(source: str, output_dir: str) -> str | None:
    """Copy DeepSpeed's flops profile into OUTPUT_DIR/profiler/ (it writes relative to the working directory)."""
    if not os.path.isfile(source):
        logger.warning("DeepSpeed flops profile %s was not written (is profile_step within the run?)", source)
        return None
    target_dir = os.path.join(output_dir, "profiler")
    os.makedirs(target_dir, exist_ok=True)
    target = os.path.join(target_dir, "deepspeed_flops_profile.txt")
    if os.path.abspath(source) != os.path.abspath(target):
        shutil.copyfile(source, target)
    logger.info("Kept the DeepSpeed flops profile in %s", target)
    return target


class DeepSpeedFlopsProfileCallback(TrainerCallback):
    def __init__(self, source: str):
        self.source = source
        self.kept: str | None = None

    def on_train_end(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            self.kept = keep_flops_profile(self.source, args.output_dir)

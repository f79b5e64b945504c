"""What a Trainer reports: speed meter, final metrics in TensorBoard, profiler window, DeepSpeed's flops profile."""

import json
import logging
import os
import shutil
import time

import torch
from transformers import TrainerCallback

from ..core.arguments import ObservabilityArguments
from .meter import SpeedMeter

logger = logging.getLogger(__name__)


class ProfilerCallback(TrainerCallback):
    """Profile optimizer steps `first`..`last` (1-based, inclusive) on every rank, warming up one step early."""

    def __init__(self, first: int, last: int, output_dir: str, options: dict, pause: list):
        self.first, self.last = first, last
        self.warmup = 1 if first > 1 else 0
        self.start_after = first - 1 - self.warmup  # optimizer steps completed when the profiler starts
        self.output_dir, self.options = output_dir, options
        self.pause = pause  # the speed meter skips the profiled steps and the export
        self.profiler = self._optimizer_region = None
        self.done, self.rank = False, 0

    def _start(self, args) -> None:
        self.rank = args.process_index
        cuda = [torch.profiler.ProfilerActivity.CUDA] if torch.cuda.is_available() else []
        self.profiler = torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU, *cuda],
            schedule=torch.profiler.schedule(wait=0, warmup=self.warmup, active=self.last - self.first + 1),
            on_trace_ready=self._export,
            acc_events=True,  # one cycle only; silences the "clears events" warning
            **self.options,
        )
        metadata = {"first_step": self.first, "last_step": self.last, "step_offset": self.first - self.warmup}
        metadata.update(world_size=args.world_size, rank=args.process_index)
        self.profiler.preset_metadata_json("vit_recipes_profile", json.dumps(metadata))
        self.profiler.start()
        logger.info("Profiling steps %d-%d into %s", self.first, self.last, self.output_dir)

    def _export(self, profiler) -> None:
        os.makedirs(self.output_dir, exist_ok=True)
        path = os.path.join(self.output_dir, f"rank{self.rank}.pt.trace.json.gz")
        profiler.export_chrome_trace(path)
        sort = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
        table = profiler.key_averages().table(sort_by=sort, row_limit=60)
        with open(os.path.join(self.output_dir, f"rank{self.rank}_ops.txt"), "w", encoding="utf-8") as f:
            f.write(f"Operators of steps {self.first}-{self.last}, rank {self.rank}, sorted by {sort}\n{table}\n")
        self.done = True
        logger.info("Wrote profiler trace %s", path)

    def _stop(self, cut_short: bool = False) -> None:
        if cut_short:
            logger.warning(
                "Training ended inside profile_steps %d-%d: writing the steps recorded.", self.first, self.last
            )
        self.profiler.stop()  # in a recording window this exports (on_trace_ready); every caller holds a profiler
        self.profiler, self.done = None, True

    def on_train_begin(self, args, state, control, **kwargs):
        if self.profiler is None and not self.done:
            if state.global_step == self.start_after:
                self._start(args)
            elif state.global_step > self.start_after:
                logger.warning(
                    f"profile_steps {self.first}-{self.last}: training starts at step {state.global_step + 1}, after "
                    "the window; nothing is profiled."
                )
                self.done = True

    def on_step_end(self, args, state, control, **kwargs):
        if self.profiler is not None:
            if 0 < state.max_steps <= state.global_step and not self.done:
                self._stop(cut_short=True)  # stop here, so no empty step is opened after the last one
            else:
                self.profiler.step()
                if self.done:  # the last active step was exported
                    self._stop()
        elif not self.done and state.global_step == self.start_after:
            self._start(args)
        else:
            return
        for meter in self.pause:
            meter.pause()

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if self.profiler is not None:
            self._optimizer_region = torch.profiler.record_function("optimizer_step")
            self._optimizer_region.__enter__()

    def on_optimizer_step(self, args, state, control, **kwargs):
        if self._optimizer_region is not None:
            self._optimizer_region.__exit__(None, None, None)
            self._optimizer_region = None

    def on_train_end(self, args, state, control, **kwargs):
        if self.profiler is not None:  # e.g. stopped early by a callback
            self._stop(cut_short=True)


def flops_profiler_output(ds_config: dict | None) -> str | None:
    """The output_file of an enabled DeepSpeed flops profiler (None when off, or when it prints to stdout only)."""
    section = (ds_config or {}).get("flops_profiler") or {}
    if not section.get("enabled"):
        return None
    if not section.get("output_file"):
        logger.warning(
            "DeepSpeed flops_profiler has no output_file: its profile goes to stdout only. Set "
            '"output_file" in the ds config to keep it with the run.'
        )
    return section.get("output_file") or None


def keep_flops_profile(source: str, output_dir: str) -> str | None:
    """Copy DeepSpeed's flops profile into OUTPUT_DIR/profiler/ (it writes relative to the working directory)."""
    if not os.path.isfile(source):
        logger.warning("DeepSpeed flops profile %s was not written (is profile_step within the run?)", source)
        return None
    target = os.path.join(output_dir, "profiler", "deepspeed_flops_profile.txt")
    os.makedirs(os.path.dirname(target), exist_ok=True)
    if os.path.abspath(source) != os.path.abspath(target):
        shutil.copyfile(source, target)
    logger.info("Kept the DeepSpeed flops profile in %s", target)
    return target


class _KeepFlopsProfile(TrainerCallback):
    def __init__(self, source: str):
        self.source = source

    def on_train_end(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            keep_flops_profile(self.source, args.output_dir)


class _PredictionsToTensorBoard(TrainerCallback):
    """Forward Trainer.predict's final metrics to TensorBoardCallback, which has no on_predict (W&B/trackio do)."""

    def __init__(self, tensorboard):
        self.tensorboard = tensorboard

    def on_predict(self, args, state, control, metrics=None, **kwargs):
        if metrics:
            self.tensorboard.on_log(args, state, control, logs=dict(metrics))


def attach(trainer, observe: ObservabilityArguments, meter: SpeedMeter) -> None:
    """Add the meter, the profiler window and the DeepSpeed flops-profile keeper to a built Trainer."""
    from transformers.integrations import TensorBoardCallback

    if not trainer.args.run_name:
        # One name for the script: trackio resumes its run by name, so Trainer.predict's metrics land in the same run.
        folder = os.path.basename(os.path.abspath(trainer.args.output_dir))
        trainer.args.run_name = f"{folder}-{time.strftime('%Y%m%d-%H%M%S')}"
    trainer.add_callback(meter)
    for callback in trainer.callback_handler.callbacks:
        if isinstance(callback, TensorBoardCallback):
            trainer.add_callback(_PredictionsToTensorBoard(callback))
    if observe.profile_steps:
        start, end = observe.profile_window
        options = {"profile_memory": observe.profile_memory, "record_shapes": observe.profile_record_shapes}
        options["with_stack"] = observe.profile_with_stack
        folder = observe.profile_dir or f"{trainer.args.output_dir}/profiler"
        trainer.add_callback(ProfilerCallback(start, end, folder, options, pause=[meter]))
    if trainer.is_deepspeed_enabled:
        plugin = getattr(trainer.accelerator.state, "deepspeed_plugin", None)
        if flops_file := flops_profiler_output(getattr(plugin, "deepspeed_config", None)):
            trainer.add_callback(_KeepFlopsProfile(flops_file))

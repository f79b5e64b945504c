"""What a built Trainer reports while it trains: the speed meter in every tracker's logs, final metrics in
TensorBoard, the profiler window (--profile_steps) and DeepSpeed's flops profile."""

from __future__ import annotations

import os
import time

from transformers import TrainerCallback

from .arguments import ObservabilityArguments
from .meter import SpeedMeter
from .profiling import DeepSpeedFlopsProfileCallback, ProfilerCallback, deepspeed_flops_profiler_file


class _PredictionsToTensorBoard(TrainerCallback):
    """transformers' TensorBoardCallback has no on_predict (the W&B and trackio ones do): forward the final
    eval/test metrics of Trainer.predict to it, so TensorBoard shows them too (eval/..., test/...)."""

    def __init__(self, tensorboard):
        self.tensorboard = tensorboard

    def on_predict(self, args, state, control, metrics=None, **kwargs):
        if metrics:
            self.tensorboard.on_log(args, state, control, logs=dict(metrics))


def attach(trainer, observe: ObservabilityArguments, meter: SpeedMeter) -> None:
    """Add the meter, the profiler window and the DeepSpeed flops-profile keeper to a built Trainer."""
    from transformers.integrations import TensorBoardCallback

    if not trainer.args.run_name:
        # One name for the whole script: trackio finishes its run at train end and resumes it by name, so the final
        # eval/test metrics of Trainer.predict land in the same run (without a name they open a new, random one).
        folder = os.path.basename(os.path.abspath(trainer.args.output_dir))
        trainer.args.run_name = f"{folder}-{time.strftime('%Y%m%d-%H%M%S')}"
    trainer.add_callback(meter)
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
                pause=[meter],
            )
        )
    flops_file = deepspeed_flops_profiler_file(trainer)
    if flops_file:
        trainer.add_callback(DeepSpeedFlopsProfileCallback(flops_file))

"""How `train()` ends: at once when a resumed run has no step left, after a checkpoint on a signal."""

import gc

from transformers import TrainerCallback
from transformers.trainer_utils import TrainOutput

from ..core.interrupt import RunInterrupted, StopOnSignal


class _NothingLeftToTrain(Exception):
    """Raised before a step when the resumed checkpoint already holds the run's last one."""


class _StopAtTheLastStep(TrainerCallback):
    """Resumed at the run's last step, the Trainer would train one more (it checks the count after a step)."""

    def on_step_begin(self, args, state, control, **kwargs):
        if state.max_steps and state.global_step >= state.max_steps:
            raise _NothingLeftToTrain


class StopsCleanly:
    """Mixin for `transformers.Trainer`: what it changes of how the Trainer's `train()` starts and ends.

    The Trainer trains one step past a checkpoint that holds the last one, and dies on SIGINT/SIGTERM without a
    checkpoint; here the first returns the checkpoint's state and the second saves, stops and raises RunInterrupted.
    """

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.add_callback(_StopAtTheLastStep())
        self.stop_on_signal = StopOnSignal()  # SIGINT/SIGTERM: checkpoint at the next step end, then stop
        self.add_callback(self.stop_on_signal)

    def train(self, resume_from_checkpoint=None, **kwargs):
        # What is built so far lives to the run's end: full garbage collections (accelerate's at the start, 0.3 s on a
        # GPU machine, and Python's) skip it, and the DataLoader workers forked meanwhile do not copy its pages.
        gc.freeze()
        try:
            output = super().train(resume_from_checkpoint=resume_from_checkpoint, **kwargs)
        except _NothingLeftToTrain:  # the checkpoint's weights and state are loaded: the final save comes next
            self.is_in_train = False
            if self.args.load_best_model_at_end and self.state.best_model_checkpoint:  # as the Trainer's end does
                self._load_best_model()
            output = TrainOutput(self.state.global_step, 0.0, {})
        finally:
            gc.unfreeze()  # collectable again: a later run in this process, or what the evaluation drops
            self.stop_on_signal.on_train_end(self.args, self.state, self.control)  # handlers off, however it ended
        if self.stop_on_signal.stopped_at is not None:  # saved on a signal: not a finished run
            raise RunInterrupted(self.stop_on_signal.stopped_at, self.stop_on_signal.signum)
        return output

"""`ImageClassificationTrainer`: transformers' Trainer with our batches, loss, checkpoints, levers and model card.

Each base below changes one thing of the Trainer and says, at each override, which upstream behaviour it replaces
or extends and why. The order of the bases is the order their `train()` wraps: the weight average outermost (copied
in only after a finished run), the Trainer's own loop innermost.
"""

from typing import Any, NamedTuple

from torch.profiler import record_function
from transformers import Trainer

from ..data.batches import DeviceBatches
from ..data.streaming import StreamedBatches
from ..model.adapters import without_activation_wrappers
from ..model.levers import AppliesLevers
from ..publish.card import write_model_card
from . import lazy_deepspeed  # noqa: F401  accelerate's unwrap stops importing DeepSpeed (see that module)
from .checkpoint_io import CheckpointFiles
from .loss import ClassificationLoss, LossOnTheDevice, WindowMeans
from .stopping import StopsCleanly


class Evaluated(NamedTuple):
    """What the reports need of the Trainer's latest evaluation loop (see `evaluation_loop` below)."""

    step: int  # the global step it ran at: the model it scored is the current one while no step, EMA or reload came
    prefix: str  # its metric prefix: "eval" for validation
    dataset: Any  # the dataset it scored (the same object as the split: compared by identity)
    predictions: Any  # the logits (None on ranks other than 0: only rank 0 writes the reports)
    label_ids: Any


class ImageClassificationTrainer(
    AppliesLevers,  # --layer_decay's groups, --ema_decay's average (levers.py)
    StreamedBatches,  # --streaming: this rank's loader of its stream, its position in checkpoints (streaming.py)
    CheckpointFiles,  # checkpoints complete or absent, read strictly (checkpoint_io.py)
    StopsCleanly,  # no step past the last, a checkpoint on a signal (stopping.py)
    LossOnTheDevice,  # the NaN/inf rule without a sync per step; the run's loss sum (loss.py)
    WindowMeans,  # the logged grad norm is the window's mean; speed and memory in the logs (loss.py)
    ClassificationLoss,  # mixup, class weights, multi-label (loss.py)
    DeviceBatches,  # uint8 batches augmented on the device; the loaders (batches.py)
    Trainer,
):
    """`Trainer` plus device transforms for uint8 batches, our loss, completed checkpoints (run_dir.py), our card.

    Keyword arguments beyond the Trainer's: `train_transform`, `eval_transform`, `sample_weights`, `named_splits`
    (batches.py), `mixup`, `class_weights` (loss.py).
    """

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.card = None  # card.CardInfo, set once the run's results are known
        self.figures = None  # figures.FigureProcess on rank 0 (steps.open_figures)
        self.threshold = 0.5  # multi-label: a class is predicted when its sigmoid reaches this (reports)
        self.last_evaluation: Evaluated | None = None  # the latest evaluation loop's predictions, for the reports
        # Profiler regions, ~1 us each: data and augment (batches.py), forward (loss.py), and backward here
        # (DeepSpeed's includes its optimizer step).
        self.accelerator.backward = record_function("backward")(self.accelerator.backward)

    def evaluation_loop(self, dataloader, description, prediction_loss_only=None, ignore_keys=None,
                        metric_key_prefix="eval"):  # fmt: skip
        # Extends: Trainer.evaluate keeps only the metrics of the loop's output and drops its predictions. Ours keeps
        # the latest loop's, so that the final reports reuse the evaluation at the last step (steps.evaluate) instead
        # of a second pass over validation (a whole evaluation). Logits and labels on rank 0, which
        # writes the reports; the other ranks keep where and when, to decide as rank 0 does (predict is collective).
        self.last_evaluation = None  # the previous loop's arrays go before this one gathers its own
        output = super().evaluation_loop(dataloader, description, prediction_loss_only, ignore_keys, metric_key_prefix)
        if output.predictions is not None and output.label_ids is not None:
            keep = self.is_world_process_zero()
            self.last_evaluation = Evaluated(
                self.state.global_step, metric_key_prefix, getattr(dataloader, "dataset", None),
                output.predictions if keep else None, output.label_ids if keep else None,
            )  # fmt: skip
        return output

    def create_model_card(self, *args, **kwargs):
        # Replaces: push_to_hub calls it; ours replaces transformers' card by our card.CardInfo's.
        if self.card is not None and self.is_world_process_zero():
            write_model_card(self.card, self.args.output_dir)

    def _save(self, output_dir=None, state_dict=None):
        # Extends: under FSDP activation checkpointing peft would save the head alone (wrappers rename modules:
        # adapters.py), in checkpoints and the final model alike.
        with without_activation_wrappers(self.model):
            super()._save(output_dir, state_dict)

    def save_model(self, output_dir=None, _internal_call=False):
        # Replaces, for a merged LoRA model only (keep_saved_model, set by adapters.save_final_model): output_dir
        # holds it, and push_to_hub's save must not overwrite it with the adapter.
        if _internal_call and output_dir is None and getattr(self, "keep_saved_model", False):
            return
        super().save_model(output_dir, _internal_call)

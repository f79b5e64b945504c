"""The training loss: ours (mixup, class weights, multi-label), its non-finite rule on the device, its sum and logs."""

import logging

import numpy as np
import torch
import torch.nn.functional as F
from torch.profiler import record_function

from ..core.metrics import LEFT_OUT, scored_rows
from ..core.swap import swapped
from ..data.transforms import smooth_targets

logger = logging.getLogger(__name__)


def evaluation_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Cross-entropy (multi-hot labels: binary, per class) averaged over the rows that hold an image; rows labelled
    metrics.LEFT_OUT (unreadable images, decoding per batch) count in neither sum nor mean; 0 without any row."""
    multi = labels.ndim == 2
    scored = (labels != LEFT_OUT).any(1) if multi else labels != LEFT_OUT
    if multi:
        per_row = F.binary_cross_entropy_with_logits(logits, labels.clamp(min=0), reduction="none").mean(1)
    else:
        per_row = F.cross_entropy(logits, labels.clamp(min=0), reduction="none")
    return torch.where(scored, per_row, 0).sum() / scored.sum().clamp(min=1)


class ClassificationLoss:
    """Mixin for `transformers.Trainer`: `compute_loss` replaced by ours.

    The Trainer takes the model's own loss, which knows neither mixup's soft targets, nor class weights, nor
    multi-hot labels; ours computes it from the logits (in float32, whatever the autocast).
    """

    def __init__(self, *args, mixup=None, class_weights=None, **kw):
        super().__init__(*args, **kw)
        self.mixup = mixup
        self.class_weights = None if class_weights is None else class_weights.to(self.args.device)  # training loss
        self.model_accepts_loss_kwargs = False  # compute_loss returns a per-batch mean: the Trainer scales it

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        labels = inputs.get("labels")
        model_inputs = {k: v for k, v in inputs.items() if k != "labels"}
        targets = None
        if labels is not None and model.training and self.mixup is not None:
            # the batch's draws (batches.DeviceBatches.training_step): ranks mix differently, resumes redraw alike
            randomness = getattr(self, "randomness", None)
            model_inputs["pixel_values"], targets = self.mixup(model_inputs["pixel_values"], labels, randomness)
        with record_function("forward"):
            outputs = model(**model_inputs)
            logits = outputs["logits"].float()
            weights = self.class_weights if model.training else None
            smoothing = self.args.label_smoothing_factor if model.training else 0.0
            if labels is not None and not model.training:
                loss = evaluation_loss(logits, labels)
            elif labels is not None and labels.ndim == 2:  # multi-hot: multi-label, one sigmoid per class
                if targets is None:
                    targets = smooth_targets(labels, smoothing)
                loss = F.binary_cross_entropy_with_logits(logits, targets, pos_weight=weights)
            elif targets is not None:
                weighted = targets if self.class_weights is None else targets * self.class_weights
                loss = torch.sum(-weighted * F.log_softmax(logits, dim=-1), dim=-1).mean()
            elif labels is not None:
                loss = F.cross_entropy(logits, labels, weight=weights, label_smoothing=smoothing)
            else:
                loss = logits.new_zeros(())
        return (loss, outputs) if return_outputs else loss

    def evaluation_loop(self, dataloader, description, prediction_loss_only=None, ignore_keys=None,
                        metric_key_prefix="eval"):  # fmt: skip
        # Extends: where rows were left out (unreadable images decoding per batch, metrics.LEFT_OUT labels), the eval
        # loss is recomputed over the images read. The Trainer's is the mean of its batches' losses, each batch
        # weighted alike, whatever number of images it held. compute_metrics and the reports leave those rows out too.
        output = super().evaluation_loop(dataloader, description, prediction_loss_only, ignore_keys, metric_key_prefix)
        if output.label_ids is None or (scored := scored_rows(output.label_ids)).all():
            return output
        name = self.split_name(getattr(dataloader, "dataset", None)) or metric_key_prefix
        left_out = int((~scored).sum())
        if output.predictions is not None:
            logits = output.predictions[0] if isinstance(output.predictions, tuple) else output.predictions
            loss = evaluation_loss(torch.from_numpy(np.asarray(logits)).float(), torch.from_numpy(output.label_ids))
            output.metrics[f"{metric_key_prefix}_loss"] = float(loss) if scored.any() else float("nan")
        if self.is_world_process_zero():
            logger.warning(
                "%s: %d unreadable image(s) left out of this evaluation: its loss and metrics count the %d others",
                name, left_out, int(scored.sum()),
            )  # fmt: skip
        return output


class LossOnTheDevice:
    """Mixin for `transformers.Trainer`: its NaN/inf loss filter applied on the device, and the run's loss sum.

    `--logging_nan_inf_filter` (the Trainer's default) reads each step's loss on the host to test it: a GPU
    synchronisation per step. Ours applies the same rule with `torch.where`, so `train()` turns the Trainer's off.
    """

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.filter_nan_inf = self.args.logging_nan_inf_filter  # the user's setting; the Trainer's is off in train()
        self.loss_sum = 0.0  # training losses since step 0, resumes included (restored by steps.train)

    def train(self, *args, **kwargs):
        # Replaces: the Trainer's host-side filter, for the length of its loop, by training_step's rule below.
        self.filter_nan_inf = self.args.logging_nan_inf_filter
        with swapped(self.args, "logging_nan_inf_filter", False):
            return super().train(*args, **kwargs)

    def training_step(self, model, inputs, num_items_in_batch=None):
        loss = super().training_step(model, inputs, num_items_in_batch)
        window = getattr(self, "_tr_loss", None)  # the Trainer's loss sum since its last log
        if self.filter_nan_inf and window is not None:  # its rule: a non-finite loss counts as that window's mean
            mean = window / (1 + self.state.global_step - self._globalstep_last_logged)
            loss = torch.where(torch.isfinite(loss), loss, mean.to(loss.dtype))
        self.loss_sum = loss.detach() + self.loss_sum  # stays on the device: no synchronisation per step
        return loss

    def evaluation_loop(self, *args, **kwargs):
        # The user's setting back for an evaluation inside train(), where the Trainer's reads it for eval losses.
        with swapped(self.args, "logging_nan_inf_filter", self.filter_nan_inf):
            return super().evaluation_loop(*args, **kwargs)

    def mean_loss_sum(self) -> float:
        """`loss_sum` averaged over the ranks, as the Trainer's train_loss averages them (a collective: every rank)."""
        total = torch.as_tensor(self.loss_sum, dtype=torch.float32, device=self.args.device)
        return float(self.accelerator.reduce(total, reduction="mean"))


class WindowMeans:
    """Mixin for `transformers.Trainer`: what each training log line carries beyond the Trainer's.

    The Trainer logs the last step's gradient norm (read on the host each step); ours logs the mean over the steps
    since the previous log, summed on the device, and the speed meter's figures (meter.SpeedMeter).
    """

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self._grad_norms: tuple = (0.0, 0)  # (sum, steps) since the last log: logged as their mean

    def _get_grad_norm(self, model, grad_norm=None):
        # Every step's norm, summed on its device (no sync): the log shows the window's mean, not the last step's.
        norm = super()._get_grad_norm(model, grad_norm)
        if norm is not None:
            value = norm.detach().float() if torch.is_tensor(norm) else float(norm)
            self._grad_norms = (self._grad_norms[0] + value, self._grad_norms[1] + 1)
        return norm

    def log(self, logs, start_time=None):
        if "grad_norm" in logs and self._grad_norms[1]:  # a float, as the Trainer reads it
            logs["grad_norm"] = float(self._grad_norms[0]) / self._grad_norms[1]
            self._grad_norms = (0.0, 0)
        # Speed and memory (meter.SpeedMeter) join the logs before any tracker; on every rank (extend_logs gathers).
        for callback in self.callback_handler.callbacks:
            if hasattr(callback, "extend_logs"):
                logs.update(callback.extend_logs(logs, self.args, self.state))
        super().log(logs, start_time)

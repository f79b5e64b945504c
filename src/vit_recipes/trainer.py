"""A Trainer whose batches arrive as uint8 and are augmented on the training device."""

from __future__ import annotations

import os
import time

import torch
import torch.nn.functional as F
from torch.profiler import record_function
from transformers import PreTrainedModel, Trainer, TrainerCallback
from transformers.utils import SAFE_WEIGHTS_NAME

from .lora import without_activation_wrappers


class ImageClassificationTrainer(Trainer):
    """`Trainer` plus three things:

    - device transforms: `pixel_values` come from the DataLoader as uint8 at storage resolution and are resized,
      augmented (training) or centre-cropped (evaluation) and normalised batched on the device;
    - the loss: cross-entropy with label smoothing, or soft-target cross-entropy under mixup/cutmix;
    - the model card: `push_to_hub` writes ours (see hub.py) instead of the generic one.
    """

    def __init__(self, *args, train_transform=None, eval_transform=None, mixup=None, card_writer=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.train_transform = train_transform.to(self.args.device) if train_transform is not None else None
        self.eval_transform = eval_transform.to(self.args.device) if eval_transform is not None else None
        self.mixup = mixup
        self.card_writer = card_writer
        # Which transform a batch gets: set by training_step / prediction_step, not read off self.model.training,
        # because accelerate's regional compilation trains a copy of the top module and self.model stays in eval
        # mode (seen: --torch_compile_regions trained on un-augmented images).
        self._training_batch = False
        # compute_loss returns a per-batch mean, so the Trainer must scale it for gradient accumulation.
        self.model_accepts_loss_kwargs = False
        # Profiler regions (profiling.py): data, augment, forward, backward here; optimizer_step in ProfilerCallback.
        self.accelerator.backward = _labelled("backward", self.accelerator.backward)  # DeepSpeed: + optimizer step

    def release_dataloaders(self) -> int:
        """Stop every DataLoader's worker processes now; returns how many pools were stopped.

        With persistent workers the Trainer (cached evaluation loaders) and accelerate (every prepared loader) keep
        the loaders, and with them their workers, alive until the interpreter exits, and tearing them down there
        took ~45 s on the GPU machines (main() done to process exit); stopped here, the exit takes ~1.5 s.
        """
        loaders = list(getattr(self.accelerator, "_dataloaders", []))
        loaders += list((getattr(self, "_eval_dataloaders", None) or {}).values())
        stopped = 0
        for loader in loaders:
            iterator = getattr(loader, "_iterator", None)
            if iterator is not None and hasattr(iterator, "_shutdown_workers"):
                iterator._shutdown_workers()
                loader._iterator = None
                stopped += 1
        if hasattr(self, "_eval_dataloaders"):
            self._eval_dataloaders = {}
        return stopped

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        start = time.perf_counter()
        with record_function("data"):
            batches = super().get_batch_samples(epoch_iterator, num_batches, device)
        for callback in self.callback_handler.callbacks:
            if hasattr(callback, "add_data_wait"):  # TrainingStatsCallback, StepMetricsCallback
                callback.add_data_wait(time.perf_counter() - start)
        return batches

    def log(self, logs, start_time=None):
        # Per-step speed and memory (observability.StepMetricsCallback) join the logs before any tracker sees them.
        # Called on every rank: extend_logs may gather values across ranks.
        for callback in self.callback_handler.callbacks:
            if hasattr(callback, "extend_logs"):
                logs.update(callback.extend_logs(logs, self.args, self.state))
        super().log(logs, start_time)

    def training_step(self, model, inputs, num_items_in_batch=None):
        self._training_batch = True
        return super().training_step(model, inputs, num_items_in_batch)

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        self._training_batch = False
        return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)

    def _prepare_inputs(self, inputs):
        inputs = super()._prepare_inputs(inputs)
        pixels = inputs.get("pixel_values")
        if pixels is not None and pixels.dtype == torch.uint8:
            transform = self.train_transform if self._training_batch else self.eval_transform
            with record_function("augment"):
                pixels = transform(pixels)
            if self.is_deepspeed_enabled:  # DeepSpeed holds bf16/fp16 weights and does not autocast inputs
                pixels = pixels.to(self.accelerator.state.deepspeed_plugin.hf_ds_config.dtype())
            inputs["pixel_values"] = pixels
        return inputs

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        labels = inputs.get("labels")
        model_inputs = {k: v for k, v in inputs.items() if k != "labels"}
        targets = None
        if labels is not None and model.training and self.mixup is not None:
            model_inputs["pixel_values"], targets = self.mixup(model_inputs["pixel_values"], labels)
        with record_function("forward"):
            outputs = model(**model_inputs)
            logits = outputs["logits"].float()
            if targets is not None:
                loss = torch.sum(-targets * F.log_softmax(logits, dim=-1), dim=-1).mean()
            elif labels is not None:
                smoothing = self.args.label_smoothing_factor if model.training else 0.0
                loss = F.cross_entropy(logits, labels, label_smoothing=smoothing)
            else:
                loss = logits.new_zeros(())
        return (loss, outputs) if return_outputs else loss

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        # transformers 5.2x saves ViT under its original key names but resumes with a raw load_state_dict, which
        # silently leaves the new layer names unloaded. from_pretrained applies the key conversion.
        model = model if model is not None else self.model
        weights = os.path.join(resume_from_checkpoint, SAFE_WEIGHTS_NAME)
        plain = not (self.is_deepspeed_enabled or self.is_fsdp_enabled) and isinstance(model, PreTrainedModel)
        if not (plain and os.path.isfile(weights)):
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        loaded = type(model).from_pretrained(resume_from_checkpoint, config=model.config)
        model.load_state_dict(loaded.state_dict(), strict=True)

    def create_model_card(self, *args, **kwargs):
        if self.card_writer is not None:
            if self.is_world_process_zero():
                self.card_writer()
        else:
            super().create_model_card(*args, **kwargs)

    def _save(self, output_dir=None, state_dict=None):
        # Final model and checkpoints. Under FSDP's activation checkpointing peft would find no LoRA weight in the
        # state dict and save the head alone: it matches by module names, which the wrappers change (lora.py).
        with without_activation_wrappers(self.model):
            super()._save(output_dir, state_dict)

    def save_model(self, output_dir=None, _internal_call=False):
        # keep_saved_model: output_dir holds a final model that is not self.model (a merged LoRA model, lora.py);
        # push_to_hub's own save (internal, to output_dir) must not write the adapter over it.
        if _internal_call and output_dir is None and getattr(self, "keep_saved_model", False):
            return
        super().save_model(output_dir, _internal_call)


def _labelled(name, function):
    """`function` inside a profiler region called `name` (record_function costs about a microsecond unprofiled)."""

    def wrapper(*args, **kwargs):
        with record_function(name):
            return function(*args, **kwargs)

    return wrapper


class StepIntervals(TrainerCallback):
    """Wall time between consecutive optimizer steps, and the part of it the loop spent waiting for data.

    An interval that spans evaluation, saving or an epoch start is dropped; `counts` can drop more (warm-up).
    ImageClassificationTrainer.get_batch_samples reports data waits through `add_data_wait`.
    """

    def __init__(self):
        self.reset_totals()
        self._pending_data = 0.0
        self._last = None

    def reset_totals(self) -> None:
        self.steps, self.seconds, self.data_seconds = 0, 0.0, 0.0

    def counts(self, state) -> bool:
        return True

    def add_data_wait(self, seconds: float) -> None:
        self._pending_data += seconds

    def on_step_end(self, args, state, control, **kwargs):
        now = time.perf_counter()
        if self._last is not None and self.counts(state):
            self.seconds += now - self._last
            self.data_seconds += self._pending_data
            self.steps += 1
        self._pending_data = 0.0
        self._last = now

    def _pause(self, *args, **kwargs):
        self._last = None  # the next interval would include evaluation/saving

    on_evaluate = on_save = on_epoch_begin = _pause


class TrainingStatsCallback(StepIntervals):
    """Steady-state speed and memory of a training run, added to the train metrics (all_results.json).

    Skips warm-up steps and excludes time spent evaluating or saving. Keys:
    train_images_per_second, train_step_time_s, train_time_20_steps_s, train_data_wait_fraction (time the loop was
    blocked fetching batches, over step time), train_mfu (when the GPU's peak is known),
    train_peak_allocated_gib / train_peak_reserved_gib (per GPU).
    """

    def __init__(
        self,
        images_per_step: int,
        flops_per_image: float | None = None,
        peak_flops: float | None = None,
        warmup_steps: int = 5,
    ):
        super().__init__()
        self.images_per_step = images_per_step
        self.flops_per_image = flops_per_image
        self.peak_flops = peak_flops  # of all GPUs together
        self.warmup_steps = warmup_steps

    def counts(self, state) -> bool:
        return state.global_step > self.warmup_steps

    @property
    def images_per_second(self) -> float | None:
        return self.images_per_step * self.steps / self.seconds if self.seconds > 0 else None

    def metrics(self) -> dict[str, float]:
        out = {}
        if self.seconds > 0:
            step = self.seconds / self.steps
            out.update(
                train_images_per_second=round(self.images_per_second, 2),
                train_step_time_s=round(step, 5),
                train_time_20_steps_s=round(20 * step, 3),
                train_data_wait_fraction=round(self.data_seconds / self.seconds, 5),
            )
            if self.flops_per_image and self.peak_flops:
                out["train_mfu"] = round(self.images_per_second * self.flops_per_image / self.peak_flops, 4)
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            out["train_peak_allocated_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 3)
            out["train_peak_reserved_gib"] = round(torch.cuda.max_memory_reserved() / 2**30, 3)
        return out

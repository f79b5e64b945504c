"""How batches reach the model: uint8 images, augmented on the training device; the loaders that deliver them."""

import contextlib
import functools
import os
import time

import torch
from torch.profiler import record_function
from torch.utils.data import WeightedRandomSampler

from ..core.interrupt import worker_ignores_stop_signals
from ..core.swap import swapped
from .transforms import Randomness

WORKER_NICENESS = 10  # added to a DataLoader worker's nice value: well below the main process, still scheduled


def worker_yields_cpu(then, worker_id: int) -> None:
    """A DataLoader worker runs at a lower CPU priority than the main process, then calls `then`. Decoding JPEGs per
    batch keeps every core busy; the main process launches the GPU's kernels, and when it waits for a core the GPU
    idles (the first step, with its one-off set-up, is slowed most)."""
    with contextlib.suppress(OSError):  # not permitted here: the workers keep the main process's priority
        os.nice(WORKER_NICENESS)
    if then is not None:
        then(worker_id)


def worker_setup(then=None) -> functools.partial:
    """The worker_init_fn of our loaders: each worker leaves SIGINT/SIGTERM to the main process, which checkpoints
    first (interrupt.py), and yields the CPU to it (above); then it calls `then`, the loader's own."""
    return functools.partial(worker_ignores_stop_signals, functools.partial(worker_yields_cpu, then))


class DeviceBatches:
    """Mixin for `transformers.Trainer`: what it changes of the Trainer's batches, from the sampler to `_prepare_inputs`.

    The Trainer moves a batch to the device as its collator built it; ours holds uint8 pixels (a quarter of float32's
    bytes through the loaders and the copy), which the device's transform augments (training) or normalizes (eval).
    """

    def __init__(self, *args, train_transform=None, eval_transform=None, sample_weights=None, named_splits=None, **kw):
        super().__init__(*args, **kw)
        self.named_splits = dict(named_splits or {})  # "validation": its Dataset, ...: which split a loader reads
        self.sample_weights = sample_weights  # --class_weights balanced_sampler: one draw weight per training image
        self.train_transform = train_transform.to(self.args.device) if train_transform is not None else None
        self.eval_transform = eval_transform.to(self.args.device) if eval_transform is not None else None
        self._training_batch = False  # set per batch: under regional compilation self.model stays in eval mode
        self.randomness: Randomness | None = None  # a training batch's draws: its transform's, mixup's (loss.py)
        self._micro_batch = (-1, 0)  # (global step, micro-batch index within it): with the rank, the draws' key

    def split_name(self, dataset) -> str | None:
        """The name of the split `dataset` is (compared by identity), else None."""
        return next((name for name, split in self.named_splits.items() if split is dataset), None)

    def _get_dataloader(self, dataset, *args, is_training=False, **kwargs):
        # Replaces: the Trainer drops short last batches from every loader when asked. Ours drops them (for
        # torch.compile) in training only: evaluation and prediction score every image.
        # And the Trainer's one collator for every loader: decoding per batch, evaluation and prediction get its
        # evaluating copy, which leaves unreadable images out instead of replacing them (decoding.DecodingCollator).
        collator = self.data_collator
        if not is_training and hasattr(collator, "for_evaluation"):
            collator = collator.for_evaluation(self.split_name(dataset))
        with (
            swapped(self.args, "dataloader_drop_last", self.args.dataloader_drop_last and is_training),
            swapped(self, "data_collator", collator),
        ):
            loader = super()._get_dataloader(dataset, *args, is_training=is_training, **kwargs)
        # Adds: the workers leave SIGINT/SIGTERM to the main process, which checkpoints first (interrupt.py), and
        # yield the CPU to it.
        base = getattr(loader, "base_dataloader", loader)  # accelerate's DataLoaderShard holds a DataLoader
        if base.num_workers > 0:  # read when the workers start, each time the loader is iterated
            base.worker_init_fn = worker_setup(base.worker_init_fn)
        return loader

    def _get_train_sampler(self, train_dataset=None):
        # Replaces (with --class_weights balanced_sampler only): the Trainer's random sampler by a weighted one.
        if self.sample_weights is None:
            return super()._get_train_sampler(train_dataset)
        generator = torch.Generator().manual_seed(self.args.seed)  # every rank draws the same, accelerate splits it
        return WeightedRandomSampler(self.sample_weights, len(self.sample_weights), generator=generator)

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        # Adds: the time spent waiting for data, a profiler region and a figure of the speed meter's logs.
        start = time.perf_counter()
        with record_function("data"):
            batches = super().get_batch_samples(epoch_iterator, num_batches, device)
        for callback in self.callback_handler.callbacks:
            if hasattr(callback, "add_data_wait"):  # meter.SpeedMeter
                callback.add_data_wait(time.perf_counter() - start)
        return batches

    def training_step(self, model, inputs, num_items_in_batch=None):
        # Adds: the batch's random draws, keyed by (seed, rank, step, micro-batch) (transforms.Randomness): each rank
        # augments differently (the Trainer seeds every rank alike), and a resumed run draws as the uninterrupted one.
        self._training_batch = True  # _prepare_inputs augments: model.training cannot tell (see __init__)
        step, micro = self._micro_batch
        self._micro_batch = (step, micro + 1) if step == self.state.global_step else (self.state.global_step, 0)
        t = self.args
        self.randomness = Randomness.for_batch(t.seed, t.process_index, *self._micro_batch, t.device)
        return super().training_step(model, inputs, num_items_in_batch)

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        self._training_batch = False  # _prepare_inputs normalizes only
        return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)

    def _prepare_inputs(self, inputs):
        # Extends: after the Trainer's move to the device, uint8 pixels go through the device transform.
        inputs = super()._prepare_inputs(inputs)
        pixels = inputs.get("pixel_values")
        if pixels is not None and pixels.dtype == torch.uint8:
            transform = self.train_transform if self._training_batch else self.eval_transform
            with record_function("augment"):
                pixels = transform(pixels, self.randomness) if self._training_batch else transform(pixels)
            if self.is_deepspeed_enabled:  # its bf16/fp16 mode: 16-bit weights, no autocast (torch_autocast: fp32)
                pixels = pixels.to(self.accelerator.state.deepspeed_plugin.hf_ds_config.dtype())
            inputs["pixel_values"] = pixels
        return inputs

    def release_dataloaders(self) -> None:
        """Stop every DataLoader's workers now (persistent ones live until the far slower interpreter exit)."""
        loaders = list(getattr(self.accelerator, "_dataloaders", []))
        loaders += list((getattr(self, "_eval_dataloaders", None) or {}).values())
        for loader in loaders:
            if hasattr(getattr(loader, "_iterator", None), "_shutdown_workers"):
                loader._iterator._shutdown_workers()
                loader._iterator = None
        self._eval_dataloaders = {}

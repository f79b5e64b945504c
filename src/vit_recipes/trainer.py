"""A Trainer whose batches arrive as uint8 and are augmented on the training device."""

import functools
import gc
import logging
import os
import shutil
import sys
import time
from unittest import mock

import accelerate.utils.other
import torch
import torch.nn.functional as F
from torch.profiler import record_function
from torch.utils.data import WeightedRandomSampler
from transformers import PreTrainedModel, Trainer, TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, TrainOutput
from transformers.utils import SAFE_WEIGHTS_NAME
from transformers.utils import logging as hf_logging

from .adapters import without_activation_wrappers
from .card import write_model_card
from .errors import RecipeError, first_line
from .interrupt import RunInterrupted, StopOnSignal, worker_ignores_stop_signals
from .levers import WeightAverage, layer_decay_groups
from .run_dir import how_checkpoint_differs, mark_complete, write_loss_record
from .transforms import smooth_targets

logger = logging.getLogger(__name__)


# accelerate's unwrap, which the Trainer calls from __init__ on, imports DeepSpeed whenever it is installed only to
# check for its engine (0.5 s of a run without it, on a GPU machine): no engine exists before deepspeed's import.
_deepspeed_installed = accelerate.utils.other.is_deepspeed_available
accelerate.utils.other.is_deepspeed_available = lambda: "deepspeed" in sys.modules and _deepspeed_installed()


class _NothingLeftToTrain(Exception):
    """Raised before a step when the resumed checkpoint already holds the run's last one."""


class _StopAtTheLastStep(TrainerCallback):
    """Resumed at the run's last step, the Trainer would train one more (it checks the count after a step)."""

    def on_step_begin(self, args, state, control, **kwargs):
        if state.max_steps and state.global_step >= state.max_steps:
            raise _NothingLeftToTrain


class ImageClassificationTrainer(Trainer):
    """`Trainer` plus device transforms for uint8 batches, our loss, completed checkpoints (run_dir.py), our card."""

    def __init__(self, *args, train_transform=None, eval_transform=None, mixup=None, class_weights=None,
                 sample_weights=None, **kw):  # fmt: skip
        super().__init__(*args, **kw)
        self.sample_weights = sample_weights  # --class_weights balanced_sampler: one draw weight per training image
        self.class_weights = None if class_weights is None else class_weights.to(self.args.device)  # training loss
        self.train_transform = train_transform.to(self.args.device) if train_transform is not None else None
        self.eval_transform = eval_transform.to(self.args.device) if eval_transform is not None else None
        self.mixup = mixup
        self.card = None  # card.CardInfo, set once the run's results are known
        self.figures = None  # figures.FigureProcess on rank 0 (steps.open_figures)
        self._grad_norms: tuple = (0.0, 0)  # (sum, steps) since the last log: logged as their mean
        self.run_identity: dict = {}  # the plan's identity, recorded in every checkpoint (run_dir.py)
        self.threshold = 0.5  # multi-label: a class is predicted when its sigmoid reaches this (reports)
        self.loss_sum = 0.0  # training losses since step 0, resumes included (restored by steps.train)
        self._training_batch = False  # set per batch: under regional compilation self.model stays in eval mode
        # The NaN/inf loss filter syncs the GPU per step: train() turns it off, training_step applies it on device.
        self.filter_nan_inf = self.args.logging_nan_inf_filter
        self.model_accepts_loss_kwargs = False  # compute_loss returns a per-batch mean: the Trainer scales it
        self.add_callback(_StopAtTheLastStep())
        self.stop_on_signal = StopOnSignal()  # SIGINT/SIGTERM: checkpoint at the next step end, then stop
        self.add_callback(self.stop_on_signal)
        self.ema = WeightAverage(self.args.ema_decay) if getattr(self.args, "ema_decay", 0) else None
        if self.ema is not None:
            self.add_callback(self.ema)
        # Profiler regions: data, augment, forward, backward (DeepSpeed's includes its optimizer step), ~1 us each.
        self.accelerator.backward = record_function("backward")(self.accelerator.backward)

    def _get_dataloader(self, *args, is_training=False, **kwargs):
        # Short last batches dropped (for torch.compile) in training only: evaluation and prediction score every image.
        with mock.patch.object(self.args, "dataloader_drop_last", self.args.dataloader_drop_last and is_training):
            loader = super()._get_dataloader(*args, is_training=is_training, **kwargs)
        base = getattr(loader, "base_dataloader", loader)  # accelerate's DataLoaderShard holds a DataLoader
        if base.num_workers > 0:  # read when the workers start, each time the loader is iterated
            base.worker_init_fn = functools.partial(worker_ignores_stop_signals, base.worker_init_fn)
        return loader

    def _get_train_sampler(self, train_dataset=None):
        if self.sample_weights is None:
            return super()._get_train_sampler(train_dataset)
        generator = torch.Generator().manual_seed(self.args.seed)  # every rank draws the same, accelerate splits it
        return WeightedRandomSampler(self.sample_weights, len(self.sample_weights), generator=generator)

    def train(self, resume_from_checkpoint=None, **kwargs):
        if self.is_deepspeed_enabled and resume_from_checkpoint:
            # Converted for another process count (plan.configure): the engine, built by train(), reads this flag.
            universal = os.path.isfile(os.path.join(resume_from_checkpoint, "latest_universal"))
            ds_config = self.accelerator.state.deepspeed_plugin.deepspeed_config
            ds_config.setdefault("checkpoint", {})["load_universal"] = universal
        if self.ema is not None and resume_from_checkpoint:
            self.ema.load(resume_from_checkpoint, self.model)
        self.filter_nan_inf = self.args.logging_nan_inf_filter
        # What is built so far lives to the run's end: full garbage collections (accelerate's at the start, 0.3 s on a
        # GPU machine, and Python's) skip it, and the DataLoader workers forked meanwhile do not copy its pages.
        gc.freeze()
        try:
            with mock.patch.object(self.args, "logging_nan_inf_filter", False):
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
        if self.ema is not None and self.ema.average is not None:
            self.ema.copy_to(self.model)
        return output

    def create_optimizer(self, model=None):
        decay = getattr(self.args, "layer_decay", 1.0)
        if self.optimizer is None and decay < 1:  # the Trainer's optimizer class and settings, on our groups
            model = model if model is not None else self.model
            cls, kwargs = self.get_optimizer_cls_and_kwargs(self.args, model)
            groups = layer_decay_groups(
                model, decay, self.args.learning_rate, self.args.weight_decay, self.get_decay_parameter_names(model)
            )
            self.optimizer_cls_and_kwargs = (cls, {**kwargs, "params": groups})  # "params": the Trainer's override
        return super().create_optimizer(model)

    def mean_loss_sum(self) -> float:
        """`loss_sum` averaged over the ranks, as the Trainer's train_loss averages them (a collective: every rank)."""
        total = torch.as_tensor(self.loss_sum, dtype=torch.float32, device=self.args.device)
        return float(self.accelerator.reduce(total, reduction="mean"))

    def release_dataloaders(self) -> None:
        """Stop every DataLoader's workers now (persistent ones live until the far slower interpreter exit)."""
        loaders = list(getattr(self.accelerator, "_dataloaders", []))
        loaders += list((getattr(self, "_eval_dataloaders", None) or {}).values())
        for loader in loaders:
            if hasattr(getattr(loader, "_iterator", None), "_shutdown_workers"):
                loader._iterator._shutdown_workers()
                loader._iterator = None
        self._eval_dataloaders = {}

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        start = time.perf_counter()
        with record_function("data"):
            batches = super().get_batch_samples(epoch_iterator, num_batches, device)
        for callback in self.callback_handler.callbacks:
            if hasattr(callback, "add_data_wait"):  # meter.SpeedMeter
                callback.add_data_wait(time.perf_counter() - start)
        return batches

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

    def training_step(self, model, inputs, num_items_in_batch=None):
        self._training_batch = True
        loss = super().training_step(model, inputs, num_items_in_batch)
        window = getattr(self, "_tr_loss", None)  # the Trainer's loss sum since its last log
        if self.filter_nan_inf and window is not None:  # its rule: a non-finite loss counts as that window's mean
            mean = window / (1 + self.state.global_step - self._globalstep_last_logged)
            loss = torch.where(torch.isfinite(loss), loss, mean.to(loss.dtype))
        self.loss_sum = loss.detach() + self.loss_sum  # stays on the device: no synchronisation per step
        return loss

    def evaluation_loop(self, *args, **kwargs):
        with mock.patch.object(self.args, "logging_nan_inf_filter", self.filter_nan_inf):  # off inside train()
            return super().evaluation_loop(*args, **kwargs)

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
            if self.is_deepspeed_enabled:  # its bf16/fp16 mode: 16-bit weights, no autocast (torch_autocast: fp32)
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
            weights = self.class_weights if model.training else None
            smoothing = self.args.label_smoothing_factor if model.training else 0.0
            if labels is not None and labels.ndim == 2:  # multi-hot: multi-label, one sigmoid per class
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

    def _save_checkpoint(self, model, trial):
        folder = os.path.join(self._get_output_dir(trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        try:
            super()._save_checkpoint(model, trial)
        except Exception as err:  # a full disk surfaces as OSError, RuntimeError (torch.save) or SafetensorError
            free = shutil.disk_usage(self.args.output_dir).free / 2**30  # torch.save says "... unexpected pos ..."
            full = getattr(err, "errno", None) == 28 or "unexpected pos" in str(err) or "No space left" in str(err)
            cause = "no space left on the device" if full else first_line(err)
            raise RecipeError(
                f"writing {folder} failed ({cause}; {free:.1f} GiB free there): the last complete "
                "checkpoint is kept, and the same command resumes from it once the cause is fixed"
            ) from err
        # Every rank's files are on disk before the record completing the checkpoint: auto-resume skips one without.
        loss_sum = self.mean_loss_sum()
        self.accelerator.wait_for_everyone()
        if self.args.should_save:
            if self.ema is not None:
                self.ema.save(folder)
            write_loss_record(folder, loss_sum, self.state.global_step)
            mark_complete(folder, self.run_identity)

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        model = model if model is not None else self.model
        # transformers 5.2x resumes with a raw load_state_dict that skips renamed ViT keys: from_pretrained converts.
        plain = not (self.is_deepspeed_enabled or self.is_fsdp_enabled) and isinstance(model, PreTrainedModel)
        try:
            if not (plain and os.path.isfile(os.path.join(resume_from_checkpoint, SAFE_WEIGHTS_NAME))):
                return super()._load_from_checkpoint(resume_from_checkpoint, model)
            level = hf_logging.get_verbosity()
            hf_logging.set_verbosity_error()  # its load report: a mismatch is said in the one line below
            try:
                loaded = type(model).from_pretrained(resume_from_checkpoint, config=model.config)
            finally:
                hf_logging.set_verbosity(level)
            model.load_state_dict(loaded.state_dict(), strict=True)
        except Exception as err:  # truncated or corrupt files: SafetensorError, UnpicklingError, OSError, ...
            if any(w in str(err) for w in ("size mismatch", "ignore_mismatched_sizes", "shape")):  # another model's
                shapes = {n: tuple(getattr(p, "ds_shape", p.shape)) for n, p in model.named_parameters()}  # ZeRO-3
                # transformers' first line points at a report it logged above ("look at the above report"): ours
                differs = how_checkpoint_differs(resume_from_checkpoint, model.config.num_labels, shapes)
                fix = "choose another --output_dir, or pass --overwrite_output_dir to start over"
                if self.args.resume_from_checkpoint:  # the flag named it: the fix is the flag's value
                    fix = "pass --resume_from_checkpoint a checkpoint of this model, or drop the flag to start fresh"
                raise RecipeError(
                    f"{resume_from_checkpoint} is a checkpoint of another model ({differs or first_line(err)}): {fix}"
                ) from err
            raise RecipeError(
                f"cannot read the weights of {resume_from_checkpoint} ({first_line(err)}): delete that folder to "
                "resume from the checkpoint before it, or pass --overwrite_output_dir to start over"
            ) from err

    def _load_best_model(self):
        # The Trainer's non-strict load skips renamed 5.2x keys (_load_from_checkpoint): it would load the head alone.
        best = self.state.best_model_checkpoint
        plain = not (self.is_deepspeed_enabled or self.is_fsdp_enabled) and isinstance(self.model, PreTrainedModel)
        if not (plain and os.path.isfile(os.path.join(best, SAFE_WEIGHTS_NAME))):
            return super()._load_best_model()  # LoRA: peft's load_adapter; DeepSpeed: its own loader
        logger.info("Loading the best model from %s (score %s)", best, self.state.best_metric)
        self._load_from_checkpoint(best)

    def _load_optimizer_and_scheduler(self, checkpoint):
        super()._load_optimizer_and_scheduler(checkpoint)
        if not (checkpoint and self.is_deepspeed_enabled):
            return
        # deepspeed_load_checkpoint has just loaded the optimizer: each fused/capturable `step` goes on its parameter's
        # device, as torch's load_state_dict does and DeepSpeed's ZeRO-1/2 universal loader does not ("on cpu").
        optimizer = self.optimizer
        while getattr(optimizer, "optimizer", None) not in (None, optimizer):
            optimizer = optimizer.optimizer  # accelerate's and DeepSpeed's wrappers hold the torch optimizer
        for group in getattr(optimizer, "param_groups", []):
            if not (group.get("fused") or group.get("capturable")):
                continue
            for param in group["params"]:
                step = optimizer.state.get(param, {}).get("step")
                if torch.is_tensor(step) and step.device != param.device:
                    optimizer.state[param]["step"] = step.to(device=param.device, dtype=torch.float32)

    def create_model_card(self, *args, **kwargs):  # push_to_hub calls it: ours replaces transformers' card
        if self.card is not None and self.is_world_process_zero():
            write_model_card(self.card, self.args.output_dir)

    def _save(self, output_dir=None, state_dict=None):
        # Under FSDP activation checkpointing peft would save the head alone (wrappers rename modules: adapters.py).
        with without_activation_wrappers(self.model):
            super()._save(output_dir, state_dict)

    def save_model(self, output_dir=None, _internal_call=False):
        # keep_saved_model: output_dir holds a merged LoRA model (adapters.py) push_to_hub's save must not overwrite.
        if _internal_call and output_dir is None and getattr(self, "keep_saved_model", False):
            return
        super().save_model(output_dir, _internal_call)

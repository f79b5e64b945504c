"""Checkpoints written complete or not at all, read back strictly, resumed on another process count."""

import logging
import os
import shutil

import torch
from transformers import PreTrainedModel
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from transformers.utils import SAFE_WEIGHTS_NAME
from transformers.utils import logging as hf_logging

from ..core.errors import RecipeError, first_line
from ..plan.run_dir import how_checkpoint_differs, mark_complete, write_loss_record

logger = logging.getLogger(__name__)


class CheckpointFiles:
    """Mixin for `transformers.Trainer`: what it changes of the Trainer's checkpoint writing and reading.

    Writing: each checkpoint ends with our record that it is complete (run_dir.py), which auto-resume looks for,
    and a full disk is one clear error. Reading: weights through `from_pretrained`, strictly. Needs `mean_loss_sum`
    (loss.LossOnTheDevice); other mixins add their files to a checkpoint through `save_checkpoint_extras`.
    """

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.run_identity: dict = {}  # the plan's identity, recorded in every checkpoint (run_dir.py)

    def train(self, resume_from_checkpoint=None, **kwargs):
        if self.is_deepspeed_enabled and resume_from_checkpoint:
            # Converted for another process count (plan.configure): the engine, built by train(), reads this flag.
            universal = os.path.isfile(os.path.join(resume_from_checkpoint, "latest_universal"))
            ds_config = self.accelerator.state.deepspeed_plugin.deepspeed_config
            ds_config.setdefault("checkpoint", {})["load_universal"] = universal
        return super().train(resume_from_checkpoint=resume_from_checkpoint, **kwargs)

    def save_checkpoint_extras(self, folder: str) -> None:
        """Our files in checkpoint `folder`, written by the saving process before the checkpoint is marked complete.

        None here: a mixin earlier in the class's bases overrides it, writes its files and calls super().
        """

    def _save_checkpoint(self, model, trial):
        # Extends: the Trainer's save, then the loss record and the mark that the checkpoint is complete.
        folder = os.path.join(self._get_output_dir(trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        try:
            super()._save_checkpoint(model, trial)
        except Exception as err:  # a full disk surfaces as OSError, RuntimeError (torch.save) or SafetensorError
            raise self._save_failed(folder, err) from err
        # Every rank's files are on disk before the record completing the checkpoint: auto-resume skips one without.
        loss_sum = self.mean_loss_sum()
        self.accelerator.wait_for_everyone()
        if self.args.should_save:
            self.save_checkpoint_extras(folder)
            write_loss_record(folder, loss_sum, self.state.global_step)
            mark_complete(folder, self.run_identity)

    def _save_failed(self, folder: str, err: Exception) -> RecipeError:
        free = shutil.disk_usage(self.args.output_dir).free / 2**30  # torch.save says "... unexpected pos ..."
        full = getattr(err, "errno", None) == 28 or "unexpected pos" in str(err) or "No space left" in str(err)
        cause = "no space left on the device" if full else first_line(err)
        return RecipeError(
            f"writing {folder} failed ({cause}; {free:.1f} GiB free there): the last complete "
            "checkpoint is kept, and the same command resumes from it once the cause is fixed"
        )

    def _plain_weights_in(self, folder: str, model) -> bool:
        """A model file that `from_pretrained` reads (not DeepSpeed's or FSDP's shards, not a peft adapter's)."""
        plain = not (self.is_deepspeed_enabled or self.is_fsdp_enabled) and isinstance(model, PreTrainedModel)
        return plain and os.path.isfile(os.path.join(folder, SAFE_WEIGHTS_NAME))

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        # Replaces: transformers 5.2x resumes with a raw load_state_dict that skips renamed ViT keys; from_pretrained
        # converts them. Any failure to read becomes one clear error.
        model = model if model is not None else self.model
        try:
            if not self._plain_weights_in(resume_from_checkpoint, model):
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
        # Replaces: the Trainer's non-strict load skips renamed 5.2x keys (_load_from_checkpoint): it would load the
        # head alone.
        best = self.state.best_model_checkpoint
        if not self._plain_weights_in(best, self.model):
            return super()._load_best_model()  # LoRA: peft's load_adapter; DeepSpeed: its own loader
        logger.info("Loading the best model from %s (score %s)", best, self.state.best_metric)
        self._load_from_checkpoint(best)

    def _load_optimizer_and_scheduler(self, checkpoint):
        # Extends: deepspeed_load_checkpoint has just loaded the optimizer; each fused/capturable `step` goes on its
        # parameter's device, as torch's load_state_dict does and DeepSpeed's ZeRO-1/2 universal loader does not.
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint and self.is_deepspeed_enabled:
            steps_beside_their_parameters(self.optimizer)


def steps_beside_their_parameters(optimizer) -> None:
    """Move each fused/capturable parameter's `step` to that parameter's device ("on cpu" after DeepSpeed's load)."""
    while getattr(optimizer, "optimizer", None) not in (None, optimizer):
        optimizer = optimizer.optimizer  # accelerate's and DeepSpeed's wrappers hold the torch optimizer
    for group in getattr(optimizer, "param_groups", []):
        if not (group.get("fused") or group.get("capturable")):
            continue
        for param in group["params"]:
            step = optimizer.state.get(param, {}).get("step")
            if torch.is_tensor(step) and step.device != param.device:
                optimizer.state[param]["step"] = step.to(device=param.device, dtype=torch.float32)

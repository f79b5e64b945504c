"""timm's fine-tuning levers for transformers models: `--layer_decay`, `--drop_path_rate` and `--ema_decay`."""

import logging
import os

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import TrainerCallback

from ..core.errors import RecipeError

logger = logging.getLogger(__name__)
EMA_FILE = "ema.safetensors"  # in each checkpoint: the average, restored on resume
# Layers whose one `dropout` sits right before both residual adds: a drop path after it is timm's stochastic depth.
DROPOUT_BEFORE_RESIDUAL = {"ViTLayer", "DeiTLayer", "ViTMSNLayer", "IJepaLayer"}


def transformer_layers(model: nn.Module, flag: str = "--layer_decay") -> nn.ModuleList:
    """The model's one stack of `num_hidden_layers` transformer layers (ViT, DeiT, BEiT, DINOv2, ...)."""
    depth = getattr(getattr(model, "config", None), "num_hidden_layers", None)
    for module in model.modules():
        names = {type(m).__name__ for m in module} if isinstance(module, nn.ModuleList) else set()
        if len(names) == 1 and len(module) == depth and names.pop().endswith(("Layer", "Block")):
            return module
    raise RecipeError(
        f"{flag} needs a model whose transformer layers form one stack (ViT, DeiT, BEiT, DINOv2, ...); "
        f"{type(model).__name__} has none: drop {flag}"
    )


def layer_decay_groups(model: nn.Module, decay: float, lr: float, weight_decay: float, decay_names) -> list[dict]:
    """Groups at lr * decay ** (L + 1 - i) for layer i of L (embeddings 0, head L + 1: first, as logged), as timm."""
    layers = transformer_layers(model)
    depth, after, groups = len(layers), False, {}
    inside = {id(p): i + 1 for i, layer in enumerate(layers) for p in layer.parameters()}
    for name, p in model.named_parameters():
        after = after or id(p) in inside
        layer = inside.get(id(p), depth + 1 if after else 0)
        if p.requires_grad:  # LoRA and head-only runs: the adapters and the head alone
            groups.setdefault((layer, name in decay_names), []).append(p)
    return [
        {"params": params, "lr": lr * decay ** (depth + 1 - layer), "weight_decay": weight_decay if wd else 0.0}
        for (layer, wd), params in sorted(groups.items(), reverse=True)
    ]


def add_drop_path(model: nn.Module, rate: float) -> int:
    """Stochastic depth (rate growing linearly to `rate`) as training-only hooks after each residual dropout."""
    layers = transformer_layers(model, "--drop_path_rate")
    if type(layers[0]).__name__ not in DROPOUT_BEFORE_RESIDUAL or not isinstance(layers[0].dropout, nn.Dropout):
        raise RecipeError(
            f"--drop_path_rate: {type(layers[0]).__name__} has neither a drop_path_rate config field nor a known "
            "residual dropout to follow: drop --drop_path_rate"
        )
    for i, layer in enumerate(layers):
        p = rate * i / max(len(layers) - 1, 1)
        layer.dropout.register_forward_hook(lambda m, args, out, p=p: drop_path(out, p) if m.training else out)
    return len(layers)


def drop_path(x: torch.Tensor, p: float) -> torch.Tensor:
    """Zero each sample's residual branch with probability p, scale the kept ones by 1 / (1 - p)."""
    if p <= 0:
        return x
    keep = torch.rand((x.shape[0],) + (1,) * (x.ndim - 1), device=x.device) >= p
    return x * keep.to(x.dtype) / (1 - p)


class WeightAverage(TrainerCallback):
    """--ema_decay: an fp32 average of the trained parameters, checkpointed, and copied into the model at the end."""

    def __init__(self, decay: float):
        self.decay, self.average = decay, None

    @staticmethod
    def _params(model: nn.Module) -> dict[str, torch.Tensor]:  # names as saved, without torch.compile's prefix
        return {n.replace("_orig_mod.", ""): p for n, p in model.named_parameters() if p.requires_grad}

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if self.average is None:  # a fresh run (a resume loaded it)
            self.average = {n: p.detach().float().clone() for n, p in self._params(model).items()}

    @torch.no_grad()
    def on_step_end(self, args, state, control, model=None, **kwargs):
        params = self._params(model)
        weights = [params[n].detach().float() for n in self.average]
        torch._foreach_lerp_(list(self.average.values()), weights, 1 - self.decay)

    def save(self, folder: str) -> None:
        save_file(self.average, os.path.join(folder, EMA_FILE))

    def load(self, folder: str, model: nn.Module) -> None:
        if not os.path.isfile(path := os.path.join(folder, EMA_FILE)):
            logger.warning("%s has no %s: the weight average restarts from its weights", folder, EMA_FILE)
            return
        self.average = load_file(path, device=str(next(iter(self._params(model).values())).device))

    @torch.no_grad()
    def copy_to(self, model: nn.Module) -> None:
        for name, p in self._params(model).items():
            p.copy_(self.average[name])
        logger.warning(
            "--ema_decay %g: the model is now the weight average; it is what is evaluated and saved", self.decay
        )


class AppliesLevers:
    """Mixin for `transformers.Trainer`: `--layer_decay`'s parameter groups and `--ema_decay`'s weight average.

    The Trainer builds one learning rate for all parameters and knows no weight average. Placed before
    checkpoint_io.CheckpointFiles in the class's bases: its `save_checkpoint_extras` adds the average to each checkpoint.
    """

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.ema = WeightAverage(self.args.ema_decay) if getattr(self.args, "ema_decay", 0) else None
        if self.ema is not None:
            self.add_callback(self.ema)

    def train(self, resume_from_checkpoint=None, **kwargs):
        # Extends: the average restored before a resumed loop, copied into the model after a finished one (an
        # interrupted run raises before: its model stays the trained weights, checkpointed with their average).
        if self.ema is not None and resume_from_checkpoint:
            self.ema.load(resume_from_checkpoint, self.model)
        output = super().train(resume_from_checkpoint=resume_from_checkpoint, **kwargs)
        if self.ema is not None and self.ema.average is not None:
            self.ema.copy_to(self.model)
        return output

    def save_checkpoint_extras(self, folder: str) -> None:
        if self.ema is not None:
            self.ema.save(folder)
        super().save_checkpoint_extras(folder)

    def create_optimizer(self, model=None):
        # Extends: with --layer_decay, the Trainer's optimizer class and settings, on our parameter groups.
        decay = getattr(self.args, "layer_decay", 1.0)
        if self.optimizer is None and decay < 1:
            model = model if model is not None else self.model
            cls, kwargs = self.get_optimizer_cls_and_kwargs(self.args, model)
            groups = layer_decay_groups(
                model, decay, self.args.learning_rate, self.args.weight_decay, self.get_decay_parameter_names(model)
            )
            self.optimizer_cls_and_kwargs = (cls, {**kwargs, "params": groups})  # "params": the Trainer's override
        return super().create_optimizer(model)

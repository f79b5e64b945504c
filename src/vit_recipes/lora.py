"""LoRA fine-tuning with peft, and the frozen-backbone (head only) baseline it is measured against.

What the script calls, in order:

- `build_finetune_model`: the model to train. Plain fine-tuning; `--use_peft`: LoRA adapters on the attention query
  and value projections (or `--lora_target_modules`) with the classifier head trained in full; `--freeze_backbone`:
  the head alone. A folder holding a saved adapter can be passed as `--model_name_or_path`: it is put back on its
  base (checked to be the base it was trained on) for evaluation or further training. Prints the trainable share.
- `check_lora_strategy`: once the Trainer exists, refuses (one line, before training) a distributed set-up under which the
  adapter could not be trained or saved.
- `save_final_model`: the adapter alone (default), or with `--merge_adapter` a merged plain model; either reloads for
  evaluation with `load_model`. The adapter is checked to hold every LoRA weight when it is saved; under FSDP's
  activation checkpointing peft would save the head alone (ImageClassificationTrainer._save saves through
  `without_activation_wrappers`).

Bad input fails in one line each: rank <= 0, target modules that match nothing (the message lists the layers there
are), a model without attention projections, an adapter put on another base.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import nn

from .errors import RecipeError

logger = logging.getLogger(__name__)

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")
BASE_RECORD = "adapter_base.json"  # which base weights an adapter was trained on (see `base_signature`)
# Attention query/value projections by naming scheme, first match wins: transformers >= 5.2x ViT (and Llama-style
# models), older ViT/DeiT/BEiT/Swin, timm-style fused qkv.
DEFAULT_TARGETS = (("q_proj", "v_proj"), ("query", "value"), ("qkv",))
ALL_LINEAR = "all-linear"
# Layer types LoRA can adapt (peft's LoRA layers).
ADAPTABLE = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Embedding)


@dataclass
class LoraArguments:
    """LoRA adapters (peft): only the adapters and the classifier head are trained."""

    use_peft: bool = field(default=False, metadata={"help": "Train LoRA adapters instead of the full model."})
    lora_r: int = field(default=16, metadata={"help": "LoRA rank."})
    lora_alpha: int = field(default=16, metadata={"help": "LoRA scaling alpha (updates are scaled by alpha/r)."})
    lora_dropout: float = field(default=0.1, metadata={"help": "Dropout on the LoRA path."})
    lora_target_modules: list[str] | None = field(
        default=None,
        metadata={
            "help": "Module names to adapt, matched as name suffixes (e.g. q_proj v_proj fc1), or 'all-linear'. "
            "Default: the attention query and value projections, whatever the transformers version calls them."
        },
    )
    merge_adapter: bool = field(
        default=False, metadata={"help": "Save a merged plain model instead of the adapter alone."}
    )
    freeze_backbone: bool = field(
        default=False,
        metadata={"help": "Train the classifier head alone on a frozen backbone (the baseline LoRA must beat)."},
    )

    def __post_init__(self):
        checks = [
            (self.lora_r > 0, f"lora_r must be > 0, got {self.lora_r}"),
            (self.lora_alpha > 0, f"lora_alpha must be > 0, got {self.lora_alpha}"),
            (0 <= self.lora_dropout < 1, f"lora_dropout must be in [0, 1), got {self.lora_dropout}"),
            (self.use_peft or not self.merge_adapter, "--merge_adapter needs --use_peft (there is no adapter)"),
            (
                not (self.use_peft and self.freeze_backbone),
                "--freeze_backbone and --use_peft exclude each other: LoRA already freezes the backbone",
            ),
            (
                self.lora_target_modules is None or len(self.lora_target_modules) > 0,
                "--lora_target_modules needs at least one name",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise RecipeError(message)

    @property
    def method(self) -> str:
        return "lora" if self.use_peft else "head" if self.freeze_backbone else "full"


def run_config(lora_args: LoraArguments) -> dict:
    """Keys that make a LoRA or head-only run a different run from full fine-tuning (empty for full fine-tuning)."""
    if lora_args.use_peft:
        return {"use_peft": True, "lora_r": lora_args.lora_r, "lora_target_modules": lora_args.lora_target_modules}
    return {"freeze_backbone": True} if lora_args.freeze_backbone else {}


# ------------------------------------------------------------------------------------------------ model structure


def unwrap(model: nn.Module) -> nn.Module:
    """The transformers model under a PeftModel (the model itself otherwise)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def head_module_names(model: nn.Module) -> list[str]:
    """Top-level children outside the backbone that hold parameters: the classification head(s)."""
    model = unwrap(model)
    backbone = getattr(model, "base_model_prefix", None)
    heads = [
        name for name, child in model.named_children() if name != backbone and any(True for _ in child.parameters())
    ]
    if not heads or not backbone or not hasattr(model, backbone):
        raise RecipeError(
            f"cannot tell the classifier head from the backbone in {type(model).__name__}; LoRA and "
            "--freeze_backbone need a transformers image-classification model"
        )
    return heads


def _in_head(name: str, heads: list[str]) -> bool:
    return any(name == h or name.startswith(h + ".") for h in heads)


def adaptable_modules(model: nn.Module) -> dict[str, nn.Module]:
    """Backbone modules LoRA can adapt (linear, conv, embedding), by full name."""
    model = unwrap(model)
    heads = head_module_names(model)
    return {
        name: module
        for name, module in model.named_modules()
        if isinstance(module, ADAPTABLE) and not _in_head(name, heads)
    }


def _leaf_names(names) -> list[str]:
    return sorted({name.rsplit(".", 1)[-1] for name in names})


def _matches(name: str, target: str) -> bool:
    return name == target or name.endswith("." + target)


def resolve_target_modules(model: nn.Module, requested: list[str] | None) -> list[str]:
    """The module names to adapt, checked against the model; RecipeError names the layers there are."""
    model = unwrap(model)
    layers = adaptable_modules(model)
    listing = ", ".join(_leaf_names(layers)) or "none"
    if not requested:
        leaves = set(_leaf_names(layers))
        for names in DEFAULT_TARGETS:
            if set(names) <= leaves:
                return list(names)
        raise RecipeError(
            f"--use_peft: this {model.config.model_type} model has no attention query/value projections "
            f"({', '.join('/'.join(n) for n in DEFAULT_TARGETS)}) for the default LoRA targets; pass "
            f"--lora_target_modules with some of its layers: {listing}"
        )
    if list(requested) == [ALL_LINEAR]:
        linear = [name for name, module in layers.items() if isinstance(module, nn.Linear)]
        if not linear:
            raise RecipeError(f"--lora_target_modules all-linear: the backbone has no linear layers ({listing})")
        return _leaf_names(linear)
    heads = head_module_names(model)
    everything = dict(model.named_modules())
    for target in requested:
        if any(_matches(name, target) for name in layers):
            continue
        hit = next((name for name in everything if _matches(name, target)), None)
        if hit is not None and _in_head(hit, heads):
            why = f"'{target}' is the classifier head, which is trained in full already"
        elif hit is not None:
            why = f"'{target}' is a {type(everything[hit]).__name__}, which LoRA cannot adapt"
        else:
            why = f"'{target}' matches no module"
        raise RecipeError(f"--lora_target_modules: {why}; the layers LoRA can adapt are: {listing}")
    return list(requested)


# ------------------------------------------------------------------------------------------------ building


def _gathered(params: list[nn.Parameter]):
    """Full tensors of parameters sharded by DeepSpeed ZeRO-3 (a no-op otherwise)."""
    if any(hasattr(p, "ds_id") for p in params):
        import deepspeed

        return deepspeed.zero.GatheredParameters(params, modifier_rank=None)
    return contextlib.nullcontext()


def base_signature(model: nn.Module, samples: int = 16) -> list[list[float]]:
    """A few values of the frozen base weights (embeddings and final norm): tells whether two bases are the same.

    Compared with a tolerance (`same_base`), not hashed: a base loaded in bf16 (ZeRO-3 loads it so) or fp32 must
    match. Values only, names ignored: either ViT naming scheme gives the same signature.
    """
    model = unwrap(model)
    backbone = getattr(model, getattr(model, "base_model_prefix", ""), model)
    params = [p for name, p in backbone.named_parameters() if "lora_" not in name]
    chosen = params[:4] + params[-2:]
    signature = []
    with _gathered(chosen):
        for p in chosen:
            flat = p.detach().reshape(-1).to("cpu", torch.float32)
            index = torch.linspace(0, flat.numel() - 1, steps=min(samples, flat.numel())).long()
            spread = flat.std().item() if flat.numel() > 1 else 0.0
            signature.append([round(v, 6) for v in [*flat[index].tolist(), flat.mean().item(), spread]])
    return signature


def same_base(a: list[list[float]], b: list[list[float]]) -> bool:
    """Signatures equal up to bf16 rounding."""
    return len(a) == len(b) and all(
        len(x) == len(y) and all(abs(u - v) <= 1e-3 + 1e-2 * abs(v) for u, v in zip(x, y)) for x, y in zip(a, b)
    )


def parameter_counts(model: nn.Module) -> dict[str, float]:
    """Trainable and total parameters (ZeRO-3-sharded parameters count in full)."""
    total = trainable = 0
    for p in model.parameters():
        n = getattr(p, "ds_numel", None) or p.numel()
        total += n
        trainable += n if p.requires_grad else 0
    return {
        "train_trainable_params": trainable,
        "train_total_params": total,
        "train_trainable_percent": round(100 * trainable / max(total, 1), 4),
    }


@dataclass
class FinetuneSetup:
    """How the model is fine-tuned, for the later steps of the script."""

    method: str  # "full", "lora" or "head"
    merge_adapter: bool
    base_args: SimpleNamespace | None  # how to build the frozen base again (LoRA), for merging
    label_names: list[str]
    metrics: dict[str, float]  # parameter counts, added to the train metrics
    signature: list | None = None  # of the frozen base (LoRA), see base_signature
    lora: dict = field(default_factory=dict)  # r, alpha, dropout, target modules (LoRA)

    def card_fields(self, hyperparameters: dict) -> dict:
        """CardInfo fields: the peft library for an adapter, tags, and the method's hyperparameters."""
        names = {"full": "full", "lora": "LoRA (peft)", "head": "head only (frozen backbone)"}
        extra = {"finetuning": names[self.method], **self.lora}
        if self.method != "full":
            extra["trainable_parameters"] = f"{self.metrics['train_trainable_percent']:.2f}%"
        if self.method == "lora":
            extra["merged"] = self.merge_adapter
        fields = {"hyperparameters": {**hyperparameters, **extra}}
        if self.method == "lora":
            fields["extra_tags"] = ["lora", "peft"] if not self.merge_adapter else ["lora"]
            if not self.merge_adapter:
                fields["library_name"] = "peft"
        return fields


def _model_args(model_args, **changes) -> SimpleNamespace:
    fields = (
        "model_name_or_path",
        "config_name",
        "config_overrides",
        "image_processor_name",
        "model_revision",
        "cache_dir",
        "attn_implementation",
        "patch_embedding_matmul",
    )
    values = {name: getattr(model_args, name, None) for name in fields}
    values["model_revision"] = values["model_revision"] or "main"
    values["attn_implementation"] = values["attn_implementation"] or "sdpa"
    values["patch_embedding_matmul"] = values["patch_embedding_matmul"] is not False  # ModelArguments' default
    return SimpleNamespace(**{**values, **changes})


def _targets(peft_config) -> str:
    targets = peft_config.target_modules
    return targets if isinstance(targets, str) else ", ".join(sorted(targets))


def is_adapter_dir(path: str | os.PathLike | None) -> bool:
    return bool(path) and (Path(path) / ADAPTER_CONFIG).is_file()


def _adapter_base(path: str | os.PathLike) -> str:
    config = json.loads((Path(path) / ADAPTER_CONFIG).read_text())
    base = config.get("base_model_name_or_path")
    if not base:
        raise RecipeError(f"the adapter in {path} does not name its base model (base_model_name_or_path)")
    return base


def _print_counts(method: str, counts: dict, detail: str, training_args) -> None:
    line = (
        f"{method}: trainable params {counts['train_trainable_params']:,} of {counts['train_total_params']:,} "
        f"({counts['train_trainable_percent']:.2f}%){detail}"
    )
    if getattr(training_args, "should_log", True):  # the main process; printed, as the script's summary is
        print(line, flush=True)


def build_finetune_model(model_args, lora_args: LoraArguments, training_args, label_names: list[str]):
    """The model to train or evaluate, its input resolution, and a `FinetuneSetup`.

    Must run before the Trainer is created (it sets DDP's find_unused_parameters for frozen backbones).
    """
    from .modeling import build_model

    source = model_args.model_name_or_path
    if is_adapter_dir(source):
        return _build_from_adapter(model_args, lora_args, training_args, label_names)
    method = lora_args.method
    if method != "full" and not source:
        raise RecipeError(
            f"--{'use_peft' if method == 'lora' else 'freeze_backbone'} needs pretrained weights "
            "(--model_name_or_path): a frozen randomly initialised backbone cannot learn"
        )
    model, image_size = build_model(model_args, label_names)
    setup = FinetuneSetup(method, lora_args.merge_adapter, None, list(label_names), {})
    if method == "lora":
        setup.signature = base_signature(model)
        setup.base_args = _model_args(model_args)
        model, detail = apply_lora(model, lora_args, training_args)
        setup.lora = {
            "lora_r": lora_args.lora_r,
            "lora_alpha": lora_args.lora_alpha,
            "lora_dropout": lora_args.lora_dropout,
            "lora_target_modules": _targets(model.peft_config["default"]),
        }
        if lora_args.merge_adapter and getattr(training_args, "push_to_hub", False):
            strategy = str(getattr(training_args.hub_strategy, "value", training_args.hub_strategy))
            if strategy != "end":
                raise RecipeError(
                    "--merge_adapter with --push_to_hub needs --hub_strategy end: pushing every save would put "
                    "adapter files into the repository of the merged model"
                )
    elif method == "head":
        heads = head_module_names(model)
        for name, p in model.named_parameters():
            p.requires_grad_(_in_head(name, heads))
        detail = f": the head ({', '.join(heads)}) on a frozen backbone"
    else:
        detail = ""
    if method != "full" and getattr(training_args, "ddp_find_unused_parameters", None) is None:
        # Every trainable parameter is used in each step; True would cost a graph walk per step and breaks reentrant
        # checkpointing (the Trainer only infers False for plain transformers models).
        training_args.ddp_find_unused_parameters = False
    setup.metrics = parameter_counts(model)
    _print_counts(
        {"full": "Full fine-tuning", "lora": "LoRA", "head": "Head only"}[method], setup.metrics, detail, training_args
    )
    return model, image_size, setup


def apply_lora(model: nn.Module, lora_args: LoraArguments, training_args=None):
    """Wrap `model` in a PeftModel: LoRA on the target modules, the classifier head trained in full."""
    from peft import LoraConfig, get_peft_model

    targets = resolve_target_modules(model, lora_args.lora_target_modules)
    heads = head_module_names(model)
    config = LoraConfig(
        r=lora_args.lora_r,
        lora_alpha=lora_args.lora_alpha,
        lora_dropout=lora_args.lora_dropout,
        target_modules=targets,
        modules_to_save=heads,
        bias="none",
    )
    # peft keeps adapters in fp32 over a bf16/fp16 base (autocast_adapter_dtype). Under ZeRO-3 the base is already
    # partitioned in DeepSpeed's dtype, and ZeRO-3 needs one dtype for all parameters: the adapters take the base's
    # (the optimizer keeps fp32 master weights).
    zero3 = any(hasattr(p, "ds_id") for p in model.parameters())
    try:
        peft_model = get_peft_model(model, config, autocast_adapter_dtype=not zero3)
    except ValueError as err:  # peft rejects a module type it cannot adapt
        raise RecipeError(f"--use_peft: peft cannot adapt {', '.join(targets)}: {str(err).splitlines()[0]}") from None
    if training_args is not None and getattr(training_args, "gradient_checkpointing", False):
        # Reentrant checkpointing needs an input that requires grad, else "no parameters require grad"; cheap either way.
        unwrap(peft_model).enable_input_require_grads()
    detail = (
        f": adapters on {', '.join(targets)} (r={lora_args.lora_r}, alpha={lora_args.lora_alpha}, "
        f"dropout={lora_args.lora_dropout}) + the head ({', '.join(heads)})"
    )
    return peft_model, detail


def _build_from_adapter(model_args, lora_args, training_args, label_names):
    """A saved adapter folder as --model_name_or_path: its base with its head, then the adapter."""
    from .modeling import build_model

    path = model_args.model_name_or_path
    if lora_args.freeze_backbone:
        raise RecipeError(f"{path} holds a LoRA adapter: --freeze_backbone does not apply to it")
    _check_labels(path, label_names)
    base_args = _model_args(model_args, model_name_or_path=_adapter_base(path))
    model, image_size = build_model(base_args, label_names)
    trainable = bool(getattr(training_args, "do_train", False))
    model = attach_adapter(model, path, is_trainable=trainable, base_source=base_args.model_name_or_path)
    peft_config = model.peft_config["default"]
    setup = FinetuneSetup(
        "lora",
        lora_args.merge_adapter,
        base_args,
        list(label_names),
        parameter_counts(model),
        signature=base_signature(model),
        lora={
            "lora_r": peft_config.r,
            "lora_alpha": peft_config.lora_alpha,
            "lora_dropout": peft_config.lora_dropout,
            "lora_target_modules": _targets(peft_config),
        },
    )
    if trainable and getattr(training_args, "ddp_find_unused_parameters", None) is None:
        training_args.ddp_find_unused_parameters = False
    if trainable and getattr(training_args, "gradient_checkpointing", False):
        unwrap(model).enable_input_require_grads()
    _print_counts(
        "LoRA adapter", setup.metrics, f" loaded from {path} onto {base_args.model_name_or_path}", training_args
    )
    return model, image_size, setup


def _check_labels(path, label_names) -> None:
    config_file = Path(path) / "config.json"
    if not config_file.is_file():
        return
    id2label = json.loads(config_file.read_text()).get("id2label") or {}
    saved = [id2label[k] for k in sorted(id2label, key=int)]
    if saved and saved != list(label_names):
        shown = ", ".join(saved[:5]) + (", ..." if len(saved) > 5 else "")
        raise RecipeError(
            f"the adapter in {path} classifies into {len(saved)} labels ({shown}), this dataset has "
            f"{len(label_names)}: evaluate it on the dataset it was trained on"
        )


def attach_adapter(base: nn.Module, path: str | os.PathLike, is_trainable: bool = False, base_source: str = ""):
    """PeftModel.from_pretrained, refusing (RecipeError) an adapter trained on another base."""
    from peft import PeftModel

    base_source = base_source or getattr(base, "name_or_path", "") or "this base"
    record_file = Path(path) / BASE_RECORD
    if record_file.is_file():
        record = json.loads(record_file.read_text())
        if record.get("signature") and not same_base(record["signature"], base_signature(base)):
            raise RecipeError(
                f"the adapter in {path} was trained on another base ({record.get('base_model_name_or_path')}); "
                f"the weights of {base_source} differ: load it onto the base it was trained on"
            )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            zero3 = any(hasattr(p, "ds_id") for p in base.parameters())  # adapters in the base's dtype (apply_lora)
            model = PeftModel.from_pretrained(
                base, str(path), is_trainable=is_trainable, autocast_adapter_dtype=not zero3
            )
        except (RuntimeError, ValueError, KeyError) as err:
            first = next((line.strip() for line in str(err).splitlines() if line.strip()), type(err).__name__)
            raise RecipeError(
                f"cannot load the adapter in {path} onto {base_source} (not the base it was trained on?): "
                f"{first[:300]}"
            ) from None
    for warning in caught:
        text = str(warning.message)
        if "missing adapter keys" in text:
            raise RecipeError(
                f"the adapter in {path} does not fit {base_source} (not the base it was trained on?): {text[:300]}"
            )
        warnings.warn_explicit(warning.message, warning.category, warning.filename, warning.lineno)
    return model


def load_model(path: str | os.PathLike, base_model_name_or_path: str | None = None, **kwargs):
    """Load what the script saved in `path` for evaluation: a plain (full or merged) model, or the adapter on its base.

    `base_model_name_or_path` overrides the base named in adapter_config.json (e.g. after moving the base folder).
    """
    from transformers import AutoModelForImageClassification

    from .modeling import build_model

    if not is_adapter_dir(path):
        return AutoModelForImageClassification.from_pretrained(path, **kwargs)
    config = json.loads((Path(path) / "config.json").read_text())
    id2label = config.get("id2label") or {}
    labels = [id2label[k] for k in sorted(id2label, key=int)]
    base = base_model_name_or_path or _adapter_base(path)
    model, _ = build_model(_model_args(SimpleNamespace(), model_name_or_path=base, **kwargs), labels)
    return attach_adapter(model, path, base_source=base).eval()


# ------------------------------------------------------------------------------------------------ saving


@contextlib.contextmanager
def without_activation_wrappers(model: nn.Module):
    """Take torch's activation-checkpoint wrappers out of the module tree for the duration (put back after).

    FSDP's activation checkpointing (accelerate's fsdp2_apply_ac, i.e. --gradient_checkpointing under FSDP) wraps
    each layer in torch's CheckpointWrapper, whose child `_checkpoint_wrapped_module` shows in module names
    (`vit.layers.0._checkpoint_wrapped_module.attention.q_proj`) but not in parameter or state-dict names: the
    wrapper strips it there. peft 0.21.2 picks the adapter's entries out of the state dict by the module names of
    its LoRA layers (`_get_tuner_state_dict_key_prefixes`, which strips only FSDP1's leading `_fsdp_wrapped_module.`),
    so under the wrapper no LoRA weight matches and the saved adapter holds the head alone. With the wrappers out,
    module names are state-dict names again. Nothing runs the model meanwhile: only the module tree changes, the
    parameters (FSDP2 shards included) and hooks stay as they are.
    """
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import ActivationWrapper

    swapped = []
    for parent in list(model.modules()):
        if isinstance(parent, ActivationWrapper):
            continue
        for name, child in list(parent.named_children()):
            inner = child
            while isinstance(inner, ActivationWrapper):  # offload_wrapper(checkpoint_wrapper(layer)) nests two
                inner = inner._checkpoint_wrapped_module
            if inner is not child:
                swapped.append((parent, name, child))
                setattr(parent, name, inner)
    try:
        yield model
    finally:
        for parent, name, child in reversed(swapped):
            setattr(parent, name, child)


def _saved_tensor_names(output_dir: Path) -> list[str] | None:
    for name in ADAPTER_WEIGHTS:
        path = output_dir / name
        if path.is_file():
            if name.endswith(".safetensors"):
                from safetensors import safe_open

                with safe_open(str(path), framework="pt") as f:
                    return list(f.keys())
            return list(torch.load(path, map_location="cpu", weights_only=True))
    return None


def check_saved_adapter(output_dir: str | os.PathLike, model: nn.Module) -> None:
    """RecipeError unless the adapter saved in output_dir holds as many LoRA weights as `model` has.

    Catches an adapter saved without its LoRA weights (the head alone) when it is written, not when it is loaded.
    """
    output_dir = Path(output_dir)
    saved = _saved_tensor_names(output_dir)
    if saved is None:
        raise RecipeError(f"no adapter weights ({' or '.join(ADAPTER_WEIGHTS)}) were saved in {output_dir}")
    expected = sum(".lora_" in name for name, _ in model.named_parameters())
    found = sum(".lora_" in name for name in saved)
    if found != expected:
        raise RecipeError(
            f"the adapter saved in {output_dir} holds {found} of the model's {expected} LoRA weights "
            f"({len(saved)} tensors: {', '.join(sorted(saved)[:4])}{', ...' if len(saved) > 4 else ''}): "
            "the saved state dict and peft's adapter names disagree"
        )


# ------------------------------------------------------------------------------------------------ training


def training_flops(config, gradient_checkpointing: bool, setup: FinetuneSetup) -> float:
    """FLOPs per training image for MFU: a frozen backbone computes no weight gradients (one forward less);
    head-only training does not even backpropagate through the backbone."""
    from .flops import training_flops_per_image, vit_forward_flops

    flops = training_flops_per_image(config, gradient_checkpointing)
    if setup.method == "lora":
        return flops - vit_forward_flops(config)
    if setup.method == "head":
        return vit_forward_flops(config)
    return flops


def check_lora_strategy(trainer, setup: FinetuneSetup) -> None:
    """Refuse, before training, a distributed set-up that could not train or save the adapter / frozen backbone.

    Also drops ZeRO-3 leaf modules (ds_configs/zero3*.json gather each ViTLayer as one unit): with LoRA,
    DeepSpeed 0.19.8 released a leaf layer's parameters before the adapters' gradients were accumulated
    ("The size of tensor a (0) must match the size of tensor b (16)" in AccumulateGrad, CPU, 2 processes), so
    adapter runs keep DeepSpeed's default per-submodule fetching. The DeepSpeed engine is built at the first
    `train()`, after this.
    """
    if setup.method == "full":
        return
    what = "LoRA" if setup.method == "lora" else "--freeze_backbone"
    if getattr(trainer, "is_fsdp_enabled", False):
        plugin = trainer.accelerator.state.fsdp_plugin
        version = getattr(plugin, "fsdp_version", 1) or 1
        if version == 1 and not getattr(plugin, "use_orig_params", False):
            raise RecipeError(
                f"{what} under FSDP1 needs fsdp_use_orig_params: true (frozen and trainable weights share flat "
                "parameters otherwise); better, use FSDP2 (fsdp_version: 2)"
            )
        if setup.method == "lora" and "FULL_STATE_DICT" not in str(plugin.state_dict_type):
            raise RecipeError(
                f"LoRA under FSDP saves the adapter from a full state dict: set fsdp_state_dict_type: "
                f"FULL_STATE_DICT (got {plugin.state_dict_type})"
            )
    if getattr(trainer, "is_deepspeed_enabled", False) and setup.method == "lora":
        config = trainer.accelerator.state.deepspeed_plugin.deepspeed_config
        zero = config.get("zero_optimization", {}) or {}
        gather = zero.get("stage3_gather_16bit_weights_on_model_save", False)
        if str(zero.get("stage")) == "3" and gather in (False, "false", None):
            raise RecipeError(
                "LoRA under ZeRO-3 saves the adapter from gathered weights: set "
                "zero_optimization.stage3_gather_16bit_weights_on_model_save: true in the DeepSpeed config"
            )
        if zero.pop("leaf_module", None):
            logger.info("LoRA under ZeRO-3: leaf_module dropped, parameters are fetched per submodule")


@contextlib.contextmanager
def _without_zero3_init():
    """Load a model whole on this process even inside a ZeRO-3 run (from_pretrained would partition it)."""
    try:
        from transformers.integrations import deepspeed as hf_deepspeed
    except ImportError:  # pragma: no cover
        yield
        return
    saved = getattr(hf_deepspeed, "_hf_deepspeed_config_weak_ref", None)
    hf_deepspeed._hf_deepspeed_config_weak_ref = None
    try:
        yield
    finally:
        hf_deepspeed._hf_deepspeed_config_weak_ref = saved


def write_base_record(output_dir: str | os.PathLike, setup: FinetuneSetup) -> None:
    record = {"base_model_name_or_path": setup.base_args.model_name_or_path, "signature": setup.signature}
    (Path(output_dir) / BASE_RECORD).write_text(json.dumps(record, indent=2) + "\n")


def merge_adapter_folder(output_dir: str | os.PathLike, setup: FinetuneSetup) -> None:
    """Replace the adapter saved in output_dir with the merged plain model (base + LoRA update, head included)."""
    from .modeling import build_model

    output_dir = Path(output_dir)
    with _without_zero3_init():
        base, _ = build_model(setup.base_args, setup.label_names)
        merged = attach_adapter(base, output_dir, base_source=setup.base_args.model_name_or_path).merge_and_unload()
    for name in (ADAPTER_CONFIG, *ADAPTER_WEIGHTS, BASE_RECORD):
        (output_dir / name).unlink(missing_ok=True)
    merged.save_pretrained(output_dir)
    logger.info("Merged the LoRA adapter into %s: a plain %s", output_dir, type(merged).__name__)


def save_final_model(trainer, setup: FinetuneSetup) -> None:
    """Save the trained model into output_dir: the model, the LoRA adapter (+ its base record), or the merged model.

    Never pushes: trainer.save_model() alone would push at once, before the model card exists (the script pushes
    once, with the card, at the end). The merge runs on the main process from the saved files, so it works the same
    after DDP, ZeRO-2/3 (adapter gathered to 16 bits) and FSDP (full state dict).
    """
    trainer.save_model(_internal_call=True)
    if setup.method != "lora":
        return
    if trainer.is_world_process_zero():
        check_saved_adapter(trainer.args.output_dir, trainer.model)
        write_base_record(trainer.args.output_dir, setup)
        if setup.merge_adapter:
            merge_adapter_folder(trainer.args.output_dir, setup)
    if not setup.merge_adapter:
        return
    trainer.accelerator.wait_for_everyone()
    trainer.keep_saved_model = True  # push_to_hub uploads the merged model instead of saving the adapter again

"""LoRA (peft) on a transformers image classifier: choosing and adapting layers, and reattaching a saved adapter."""

import contextlib
import json
import os
import warnings
from pathlib import Path

import torch
from torch import nn

from ..core.arguments import LoraArguments
from ..core.errors import RecipeError, first_line

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")
BASE_RECORD = "adapter_base.json"  # which base weights an adapter was trained on (see `base_signature`)
# Attention query/value projections, first match wins: transformers >= 5.2x ViT, older ViT/DeiT/BEiT/Swin, timm qkv.
DEFAULT_TARGETS = (("q_proj", "v_proj"), ("query", "value"), ("qkv",))
ADAPTABLE = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Embedding)  # layer types peft's LoRA can adapt


def unwrap(model: nn.Module) -> nn.Module:
    """The transformers model under a PeftModel (the model itself otherwise)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def head_module_names(model: nn.Module) -> list[str]:
    """Top-level children outside the backbone that hold parameters: the classification head(s)."""
    model = unwrap(model)
    backbone = getattr(model, "base_model_prefix", None)
    heads = [name for name, child in model.named_children() if name != backbone and list(child.parameters())]
    if hasattr(timm := getattr(model, "timm_model", None), "get_classifier"):  # timm's wrapper: the head is inside
        heads = [f"timm_model.{name}" for name, child in timm.named_modules() if child is timm.get_classifier()]
    if not heads or not backbone or not hasattr(model, backbone):
        raise RecipeError(
            f"cannot tell the classifier head from the backbone in {type(model).__name__}; LoRA and "
            "--freeze_backbone need a transformers image-classification model"
        )
    return heads


def in_head(name: str, heads: list[str]) -> bool:
    return any(name == h or name.startswith(h + ".") for h in heads)


def freeze_backbone(model: nn.Module) -> list[str]:
    """--freeze_backbone: only the head's parameters train; returns the head's module names."""
    heads = head_module_names(model)
    for name, p in model.named_parameters():
        p.requires_grad_(in_head(name, heads))
    return heads


def _leaf_names(names) -> list[str]:
    """The last part of each module name, as peft matches them (an index, as in `downsampling.1`, keeps its parent)."""
    return sorted({".".join(name.split(".")[-2:]) if name.rsplit(".", 1)[-1].isdigit() else name.rsplit(".", 1)[-1]
                   for name in names})  # fmt: skip


def _matches(name: str, target: str) -> bool:
    return name == target or name.endswith("." + target)


def resolve_target_modules(model: nn.Module, requested: list[str] | None) -> list[str]:
    """The module names to adapt, checked against the model; RecipeError names the layers there are."""
    model = unwrap(model)
    heads = head_module_names(model)
    everything = dict(model.named_modules())
    layers = {name: m for name, m in everything.items() if isinstance(m, ADAPTABLE) and not in_head(name, heads)}
    leaves = _leaf_names(layers)
    listing = ", ".join(leaves) or "none"
    if not requested:
        for names in DEFAULT_TARGETS:
            if set(names) <= set(leaves):
                return list(names)
        raise RecipeError(
            f"--use_peft: this {model.config.model_type} model has no attention query/value projections "
            f"({', '.join('/'.join(n) for n in DEFAULT_TARGETS)}) for the default LoRA targets; pass "
            f"--lora_target_modules with some of its layers: {listing}"
        )
    if list(requested) == ["all-linear"]:
        linear = [name for name, module in layers.items() if isinstance(module, nn.Linear)]
        if not linear:
            raise RecipeError(f"--lora_target_modules all-linear: the backbone has no linear layers ({listing})")
        return _leaf_names(linear)
    for target in requested:
        if any(_matches(name, target) for name in layers):
            continue
        hit = next((name for name in everything if _matches(name, target)), None)
        if hit is not None and in_head(hit, heads):
            why = f"'{target}' is the classifier head, which is trained in full already"
        elif hit is not None:
            why = f"'{target}' is a {type(everything[hit]).__name__}, which LoRA cannot adapt"
        else:
            why = f"'{target}' matches no module"
        raise RecipeError(f"--lora_target_modules: {why}; the layers LoRA can adapt are: {listing}")
    return list(requested)


def base_signature(model: nn.Module, samples: int = 16) -> list[list[float]]:
    """A few values of the frozen base weights (embeddings, final norm), for `same_base` (bf16 and fp32 match)."""
    model = unwrap(model)
    backbone = getattr(model, getattr(model, "base_model_prefix", ""), model)
    params = [p for name, p in backbone.named_parameters() if "lora_" not in name]
    chosen = params[:4] + params[-2:]
    signature, gathered = [], contextlib.nullcontext()
    if any(hasattr(p, "ds_id") for p in chosen):  # sharded by DeepSpeed ZeRO-3: read the full tensors
        import deepspeed

        gathered = deepspeed.zero.GatheredParameters(chosen, modifier_rank=None)
    with gathered:
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


def is_adapter_dir(path: str | os.PathLike | None) -> bool:
    return bool(path) and (Path(path) / ADAPTER_CONFIG).is_file()


def adapter_base(path: str | os.PathLike) -> str:
    base = json.loads((Path(path) / ADAPTER_CONFIG).read_text()).get("base_model_name_or_path")
    if not base:
        raise RecipeError(f"the adapter in {path} does not name its base model (base_model_name_or_path)")
    return base


def apply_lora(model: nn.Module, lora_args: LoraArguments, training_args=None):
    """Wrap `model` in a PeftModel: LoRA on the target modules, the classifier head trained in full."""
    from peft import LoraConfig, get_peft_model

    targets = resolve_target_modules(model, lora_args.lora_target_modules)
    heads = head_module_names(model)
    rank = dict(r=lora_args.lora_r, lora_alpha=lora_args.lora_alpha, lora_dropout=lora_args.lora_dropout)
    config = LoraConfig(**rank, target_modules=targets, modules_to_save=heads, bias="none")
    # peft keeps adapters fp32 over a 16-bit base; ZeRO-3 needs one dtype for all parameters: there, the base's.
    zero3 = any(hasattr(p, "ds_id") for p in model.parameters())
    try:
        peft_model = get_peft_model(model, config, autocast_adapter_dtype=not zero3)
    except ValueError as err:  # peft rejects a module type it cannot adapt
        raise RecipeError(f"--use_peft: peft cannot adapt {', '.join(targets)}: {first_line(err)}") from None
    if training_args is not None and getattr(training_args, "gradient_checkpointing", False):
        unwrap(peft_model).enable_input_require_grads()  # reentrant checkpointing needs an input requiring grad
    return peft_model, (
        f": adapters on {', '.join(targets)} (r={lora_args.lora_r}, alpha={lora_args.lora_alpha}, "
        f"dropout={lora_args.lora_dropout}) + the head ({', '.join(heads)})"
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
    zero3 = any(hasattr(p, "ds_id") for p in base.parameters())  # adapters in the base's dtype (apply_lora)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            model = PeftModel.from_pretrained(
                base, str(path), is_trainable=is_trainable, autocast_adapter_dtype=not zero3
            )
        except (RuntimeError, ValueError, KeyError) as err:
            raise RecipeError(
                f"cannot load the adapter in {path} onto {base_source} (not the base it was trained on?): "
                f"{first_line(err)}"
            ) from None
    for warning in caught:
        text = str(warning.message)
        if "missing adapter keys" in text:
            raise RecipeError(
                f"the adapter in {path} does not fit {base_source} (not the base it was trained on?): {text[:300]}"
            )
        warnings.warn_explicit(warning.message, warning.category, warning.filename, warning.lineno)
    return model

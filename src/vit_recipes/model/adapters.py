"""Saving the final model (LoRA: the checked adapter, or the merged model) and `load_model` to load it back."""

import contextlib
import json
import logging
import os
from pathlib import Path

import torch
from torch import nn

from ..core.arguments import ModelArguments
from ..core.errors import RecipeError
from ..core.swap import swapped
from .lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS, BASE_RECORD, adapter_base, attach_adapter, is_adapter_dir
from .modeling import FinetuneSetup, build_model

logger = logging.getLogger(__name__)


def load_model(path: str | os.PathLike, base_model_name_or_path: str | None = None, **kwargs):
    """Load a saved plain model, or the adapter on its base (`base_model_name_or_path` overrides adapter_config's)."""
    from transformers import AutoModelForImageClassification

    if not is_adapter_dir(path):
        return AutoModelForImageClassification.from_pretrained(path, **kwargs)
    id2label = json.loads((Path(path) / "config.json").read_text()).get("id2label") or {}
    labels = [id2label[k] for k in sorted(id2label, key=int)]
    base = base_model_name_or_path or adapter_base(path)
    model, _ = build_model(ModelArguments(model_name_or_path=base, **kwargs), labels)
    return attach_adapter(model, path, base_source=base).eval()


@contextlib.contextmanager
def without_activation_wrappers(model: nn.Module):
    """Activation-checkpoint wrappers out of the module tree: they rename modules: peft would save the head alone."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import ActivationWrapper

    wrapped = []
    for parent in list(model.modules()):
        if isinstance(parent, ActivationWrapper):
            continue
        for name, child in list(parent.named_children()):
            inner = child
            while isinstance(inner, ActivationWrapper):  # offload_wrapper(checkpoint_wrapper(layer)) nests two
                inner = inner._checkpoint_wrapped_module
            if inner is not child:
                wrapped.append((parent, name, child))
                setattr(parent, name, inner)
    try:
        yield model
    finally:
        for parent, name, child in reversed(wrapped):
            setattr(parent, name, child)


def check_saved_adapter(output_dir: str | os.PathLike, model: nn.Module) -> None:
    """RecipeError unless the adapter saved in output_dir holds as many LoRA weights as `model` has."""
    output_dir = Path(output_dir)
    files = [output_dir / name for name in ADAPTER_WEIGHTS if (output_dir / name).is_file()]
    if not files:
        raise RecipeError(f"no adapter weights ({' or '.join(ADAPTER_WEIGHTS)}) were saved in {output_dir}")
    if files[0].suffix == ".safetensors":
        from safetensors import safe_open

        with safe_open(str(files[0]), framework="pt") as f:
            saved = list(f.keys())
    else:
        saved = list(torch.load(files[0], map_location="cpu", weights_only=True))
    expected = sum(".lora_" in name for name, _ in model.named_parameters())
    found = sum(".lora_" in name for name in saved)
    if found != expected:
        raise RecipeError(
            f"the adapter saved in {output_dir} holds {found} of the model's {expected} LoRA weights "
            f"({len(saved)} tensors: {', '.join(sorted(saved)[:4])}{', ...' if len(saved) > 4 else ''}): "
            "the saved state dict and peft's adapter names disagree"
        )


def check_adapter_strategy(trainer, setup: FinetuneSetup) -> None:
    """Refuse, before training, a distributed set-up that could not train or save the adapter / frozen backbone."""
    if setup.method == "full":
        return
    what = "LoRA" if setup.method == "lora" else "--freeze_backbone"
    if getattr(trainer, "is_fsdp_enabled", False):
        plugin = trainer.accelerator.state.fsdp_plugin
        if (getattr(plugin, "fsdp_version", 1) or 1) == 1 and not getattr(plugin, "use_orig_params", False):
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
        zero = _zero_config(trainer)
        gather = zero.get("stage3_gather_16bit_weights_on_model_save", False)
        if str(zero.get("stage")) == "3" and gather in (False, "false", None):
            raise RecipeError(
                "LoRA under ZeRO-3 saves the adapter from gathered weights: set "
                "zero_optimization.stage3_gather_16bit_weights_on_model_save: true in the DeepSpeed config"
            )


def _zero_config(trainer) -> dict:
    return trainer.accelerator.state.deepspeed_plugin.deepspeed_config.get("zero_optimization", {}) or {}


def drop_zero3_leaf_modules(trainer, setup: FinetuneSetup) -> None:
    """LoRA under ZeRO-3: no leaf_module (DeepSpeed 0.19.8 released a leaf's parameters before adapter gradients)."""
    lora_under_deepspeed = setup.method == "lora" and getattr(trainer, "is_deepspeed_enabled", False)
    if lora_under_deepspeed and _zero_config(trainer).pop("leaf_module", None):
        logger.info("LoRA under ZeRO-3: leaf_module dropped, parameters are fetched per submodule")


def write_base_record(output_dir: str | os.PathLike, setup: FinetuneSetup) -> None:
    record = {"base_model_name_or_path": setup.base_args.model_name_or_path, "signature": setup.signature}
    (Path(output_dir) / BASE_RECORD).write_text(json.dumps(record, indent=2) + "\n")


def save_final_model(trainer, setup: FinetuneSetup) -> None:
    """Save the model, the LoRA adapter (+ base record) or the merged model, never pushing (the card comes later)."""
    from transformers.integrations import deepspeed as hf_deepspeed

    trainer.save_model(_internal_call=True)
    if setup.method != "lora":
        return
    output_dir = Path(trainer.args.output_dir)
    if trainer.is_world_process_zero():
        check_saved_adapter(output_dir, trainer.model)
        write_base_record(output_dir, setup)
    if trainer.is_world_process_zero() and setup.merge_adapter:  # the adapter becomes a plain model: base + update
        with swapped(hf_deepspeed, "_hf_deepspeed_config_weak_ref", None):  # the base whole, even in ZeRO-3
            base, _ = build_model(setup.base_args, setup.label_names, setup.base_facts)
            adapter = attach_adapter(base, output_dir, base_source=setup.base_args.model_name_or_path)
            merged = adapter.merge_and_unload()
        for name in (ADAPTER_CONFIG, *ADAPTER_WEIGHTS, BASE_RECORD):
            (output_dir / name).unlink(missing_ok=True)
        merged.save_pretrained(output_dir)
        logger.info("Merged the LoRA adapter into %s: a plain %s", output_dir, type(merged).__name__)
    if setup.merge_adapter:
        trainer.accelerator.wait_for_everyone()
        trainer.keep_saved_model = True  # push_to_hub uploads the merged model instead of saving the adapter again

"""FP8 matmuls for training (`--fp8`): torchao's float8 linear layers, which keep their fp32/bf16 weights (the
optimizer and saved model do not change) and run their three matmuls in FP8 with per-tensor scales. Left in higher
precision: the classifier head (small, closest to the loss), LoRA's adapters (rank-16 matmuls gain nothing) and
layers with sizes not multiples of 16 (FP8 matmuls need them). On a CPU, FP8 is emulated (what the tests use).
Off by default: ViT-B and ViT-H train slower with it, the scaling passes costing more than the faster matmuls save
(docs/benchmarks.md); meant for wider models and for memory."""

from __future__ import annotations

import logging

import torch

from .errors import RecipeError

logger = logging.getLogger(__name__)


def _convertible(module: torch.nn.Module, name: str) -> bool:
    if not isinstance(module, torch.nn.Linear) or module.in_features % 16 or module.out_features % 16:
        return False
    parts = name.split(".")
    return "classifier" not in parts and not any(p.startswith("lora_") for p in parts)


def convert_to_fp8(model: torch.nn.Module, training_args) -> int:
    """Swap the model's eligible linear layers for torchao's Float8Linear in place; returns how many."""
    if not getattr(training_args, "fp8", False):
        return 0
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    emulate = not torch.cuda.is_available() or getattr(training_args, "use_cpu", False)
    convert_to_float8_training(model, config=Float8LinearConfig(emulate=emulate), module_filter_fn=_convertible)
    converted = sum(type(m).__name__ == "Float8Linear" for m in model.modules())
    if not converted:
        raise RecipeError("--fp8 found no linear layer it could convert (sizes must be multiples of 16): drop --fp8")
    logger.info(
        "--fp8: %d linear layers run their matmuls in FP8 (torchao float8, tensorwise scales)%s",
        converted,
        "; emulated on the CPU (no speed-up)" if emulate else "",
    )
    return converted

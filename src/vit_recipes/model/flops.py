"""FLOPs of a training image, counted by torch on the meta device, and the peak rates MFU is measured against."""

import functools
import json

# Dense peak rates (FLOP/s) per GPU, from the datasheets: bf16/fp16 tensor cores, and TF32 for fp32 training.
PEAK_FLOPS = {
    "H200": {"bf16": 989e12, "tf32": 494e12},
    "H100": {"bf16": 989e12, "tf32": 494e12},
    "A100": {"bf16": 312e12, "tf32": 156e12},
}


@functools.lru_cache(maxsize=8)
def _forward_flops(config_json: str, size: int) -> float:
    import torch
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import AutoConfig

    from .classifiers import classifier_class

    config = AutoConfig.for_model(**json.loads(config_json))
    # The class itself, not from_config: under ZeRO-3, from_config would partition it with deepspeed.zero.Init.
    with torch.device("meta"):  # no memory, no arithmetic: only shapes flow through
        model = classifier_class(config)(config).eval()  # the same FLOPs; BatchNorm takes a batch of 1
        pixels = torch.empty(1, getattr(config, "num_channels", 3), size, size)
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(pixel_values=pixels)
    return float(counter.get_total_flops())


def forward_flops(config, image_size: int | None = None) -> float:
    """Forward FLOPs (a multiply-add is 2) of one image_size-square image (default the config's) through the model."""
    size = image_size or config.image_size
    size = size[0] if isinstance(size, (list, tuple)) else size
    return _forward_flops(config.to_json_string(use_diff=False), int(size))


def training_flops_per_image(
    config, gradient_checkpointing: bool, method: str = "full", image_size: int | None = None
) -> float:
    """Forward + backward FLOPs per training image, for MFU: backward is twice the forward, checkpointing recomputes
    the forward; LoRA computes no backbone weight gradients, head-only no backbone backward."""
    forward = forward_flops(config, image_size)
    if method == "head":
        return forward
    total = (4.0 if gradient_checkpointing else 3.0) * forward
    return total - forward if method == "lora" else total


def peak_flops(device_name: str, precision: str) -> float | None:
    """Peak FLOP/s of one GPU for the precision ("bf16", "fp16" or "fp32"), None when unknown (e.g. CPU)."""
    kind = "tf32" if precision == "fp32" else "bf16"
    return next((rates[kind] for name, rates in PEAK_FLOPS.items() if name in device_name), None)

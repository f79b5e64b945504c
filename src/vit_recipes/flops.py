"""Analytic FLOPs of a ViT and the peak rates MFU is measured against."""

from __future__ import annotations

# Dense peak rates (FLOP/s) per GPU, from the datasheets: bf16/fp16 tensor cores, and TF32 for fp32 training.
PEAK_FLOPS = {
    "H200": {"bf16": 989e12, "tf32": 494e12},
    "H100": {"bf16": 989e12, "tf32": 494e12},
    "A100": {"bf16": 312e12, "tf32": 156e12},
}


def vit_forward_flops(config) -> float:
    """Forward FLOPs for one image (multiply-add = 2 FLOPs): patch embedding, attention, MLP; head ignored."""
    image, patch = config.image_size, config.patch_size
    image = image[0] if isinstance(image, (list, tuple)) else image
    patch = patch[0] if isinstance(patch, (list, tuple)) else patch
    d, inner, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    patches = (image // patch) ** 2
    tokens = patches + 1  # + [CLS]
    embed = 2 * patches * (3 * patch * patch) * d
    per_layer = 8 * tokens * d * d + 4 * tokens * d * inner + 4 * tokens * tokens * d
    return float(embed + layers * per_layer)


def training_flops_per_image(config, gradient_checkpointing: bool = False) -> float:
    """Forward + backward (2x forward); checkpointing recomputes the forward once more."""
    return (4.0 if gradient_checkpointing else 3.0) * vit_forward_flops(config)


def peak_flops(device_name: str, precision: str) -> float | None:
    """Peak FLOP/s of one GPU for the precision ("bf16", "fp16" or "fp32"), None when unknown (e.g. CPU)."""
    kind = "tf32" if precision == "fp32" else "bf16"
    for name, rates in PEAK_FLOPS.items():
        if name in device_name:
            return rates[kind]
    return None

"""A model's size from its config alone, and the host memory an offloading strategy needs for it.

The model is built on the meta device (no weights); accelerate's `calculate_maximum_sizes` gives its size and
largest layer. DeepSpeed's own estimators (`estimate_zero2/3_model_states_mem_needs`) give ZeRO's figures. The run's
offload check (checks.py) and the memory advisor (tools/advise.py) both use these.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from .errors import RecipeError
from .hub import offline_env

GIB = 2**30


@dataclass(frozen=True)
class ModelShape:
    params: int
    largest_layer_params: int
    layers: int
    hidden: int
    heads: int
    intermediate: int
    image_size: int
    patch_size: int
    num_labels: int
    channels: int = 3

    @property
    def tokens(self) -> int:
        return (self.image_size // self.patch_size) ** 2 + 1  # patches + [CLS]


# Every multi-process strategy in the table; one device needs no advice.
def _is_local(name: str) -> bool:
    return os.path.exists(os.path.expanduser(name))


def load_config(name: str, cache_dir: str | None = None, revision: str = "main"):
    """The model's config: a local folder/file, or a Hub id (from the cache first). One line on failure."""
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    if name in CONFIG_MAPPING_NAMES:  # a bare model type, e.g. "vit": its default config
        return AutoConfig.for_model(name)
    if _is_local(name):
        try:
            return AutoConfig.from_pretrained(os.path.expanduser(name))
        except (OSError, ValueError) as err:
            raise RecipeError(f"cannot read a model config in {name}: {str(err).splitlines()[0]}") from None
    try:
        return AutoConfig.from_pretrained(name, cache_dir=cache_dir, revision=revision, local_files_only=True)
    except (OSError, ValueError):
        pass
    if offline_env():
        raise RecipeError(
            f"'{name}' is not in the local Hugging Face cache and HF_HUB_OFFLINE=1: pass a local folder with "
            "config.json (--model ./checkpoint), or run once online"
        )
    try:
        return AutoConfig.from_pretrained(name, cache_dir=cache_dir, revision=revision)
    except (OSError, ValueError) as err:
        raise RecipeError(
            f"cannot read the config of '{name}': not in the local cache and the Hub call failed "
            f"({str(err).splitlines()[0]}); pass a local folder with config.json"
        ) from None


def model_shape(config, num_labels: int | None = None, image_size: int | None = None) -> ModelShape:
    """Parameter count and largest layer of the classification model, built on the meta device (no memory)."""
    from accelerate import init_empty_weights
    from accelerate.utils import calculate_maximum_sizes
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING

    config = config.__class__.from_dict(config.to_dict())  # a copy we may change
    if num_labels:
        config.num_labels = num_labels
    if image_size:
        config.image_size = image_size
    try:
        model_class = MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING[type(config)]
    except KeyError:
        raise RecipeError(f"'{config.model_type}' is not an image-classification model") from None
    # The class itself, not from_config: under ZeRO-3, from_config would partition it with deepspeed.zero.Init.
    with init_empty_weights():
        model = model_class(config)
    total_bytes, (largest_bytes, _) = calculate_maximum_sizes(model)
    params = sum(p.numel() for p in model.parameters())
    element = total_bytes / max(1, params)  # bytes per element of the (fp32) meta model
    size = config.image_size[0] if isinstance(config.image_size, (list, tuple)) else config.image_size
    patch = config.patch_size[0] if isinstance(config.patch_size, (list, tuple)) else config.patch_size
    return ModelShape(
        params=params,
        largest_layer_params=int(round(largest_bytes / element)),
        layers=config.num_hidden_layers,
        hidden=config.hidden_size,
        heads=config.num_attention_heads,
        intermediate=getattr(config, "intermediate_size", 4 * config.hidden_size),
        image_size=int(size),
        patch_size=int(patch),
        num_labels=config.num_labels,
        channels=getattr(config, "num_channels", 3),
    )


def model_shape_from_args(model_args) -> ModelShape | None:
    """The shape of the model the script will train (None when its config cannot be read yet)."""
    try:
        if model_args.model_name_or_path:
            config = load_config(model_args.model_name_or_path, model_args.cache_dir, model_args.model_revision)
        else:
            config = load_config(model_args.config_name)
            if model_args.config_overrides:
                config.update_from_string(model_args.config_overrides)
        return model_shape(config)
    except (RecipeError, ValueError, OSError, AttributeError):
        return None


# ------------------------------------------------------------------------------------------- activations


def zero2_states(params: int, gpus_per_node: int, nodes: int, offload: bool) -> tuple[int, int]:
    """(host bytes per node, GPU bytes) of ZeRO-2 model states: DeepSpeed's estimator."""
    try:
        from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs
    except ImportError:  # DeepSpeed's formula (deepspeed 0.19), for machines without it
        n = gpus_per_node * nodes
        if offload:
            return int(params * max(4 * n, 16) * 1.5), 2 * params
        return int(params * 4 * gpus_per_node * 1.5), 2 * params + int(18 * params / n)
    return estimate_zero2_model_states_mem_needs(params, gpus_per_node, nodes, cpu_offload=offload)


def zero3_states(
    params: int, largest: int, gpus_per_node: int, nodes: int, offload: bool, offload_params: bool | None = None
) -> tuple[int, int, int]:
    """(host bytes per node, GPU bytes, largest-layer bytes) of ZeRO-3 model states: DeepSpeed's estimator."""
    offload_params = offload if offload_params is None else offload_params
    try:
        from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    except ImportError:  # DeepSpeed's formula (deepspeed 0.19, zero_init=True), for machines without it
        n, layer = gpus_per_node * nodes, 4 * largest
        if offload:
            per_param = 18 if offload_params else 16
            gpu = layer if offload_params else layer + int(2 * params / n)
            return int(params * per_param / nodes * 1.5), gpu, layer
        return int(largest * 4 * gpus_per_node * 1.5), layer + int(18 * params / n), layer
    return estimate_zero3_model_states_mem_needs(
        params, largest, gpus_per_node, nodes, cpu_offload=offload, cpu_offload_params=offload_params, zero_init=True
    )


BUFFER = 1.5  # DeepSpeed's additional_buffer_factor for host memory, also used for FSDP2's offload


def fsdp2_offload_host(params: int, nodes: int) -> float:
    """Host bytes per node of FSDP2 with offload: fp32 shards of parameters, gradients and Adam moments."""
    return (4 + 4 + 8) * params / nodes * BUFFER


def host_memory_for(strategy, shape: ModelShape) -> float:
    """Host bytes per node that the offload of a run's `plan.Strategy` needs."""
    per_node, nodes = strategy.processes_per_node, strategy.nodes
    if strategy.fsdp:
        return fsdp2_offload_host(shape.params, nodes)
    P, L = shape.params, shape.largest_layer_params
    if strategy.zero_stage == 3:
        return float(zero3_states(P, L, per_node, nodes, strategy.offload_optimizer, strategy.offload_params)[0])
    return float(zero2_states(P, per_node, nodes, strategy.offload_optimizer)[0])


# -------------------------------------------------------------------------------------------------- report

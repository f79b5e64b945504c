"""The host memory an offloading strategy needs for the model a run trains, from its config alone: the model built
on the meta device gives its size and largest layer, DeepSpeed's own estimators ZeRO's host figures. The run's
offload check (checks.py) reads them; the memory advisor (tools/advise.py) builds on them."""

from __future__ import annotations

import logging
import os

from .classifiers import classifier_class
from .errors import RecipeError, first_line
from .hub import offline_env, reachable_or_cached, written_as_path

logger = logging.getLogger(__name__)
GIB = 2**30
BUFFER = 1.5  # DeepSpeed's additional_buffer_factor for host memory, also used for FSDP2's offload


def load_config(name: str, cache_dir: str | None = None, revision: str = "main"):
    """The config of a model: a bare model type ("vit"), a local folder, or a Hub id (the cache first, as transformers
    does). One line on failure, naming the offline case."""
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    if name in CONFIG_MAPPING_NAMES:
        return AutoConfig.for_model(name)
    reachable_or_cached(name, cache_dir, revision, f"download the config of '{name}'")
    try:
        return AutoConfig.from_pretrained(os.path.expanduser(name), cache_dir=cache_dir, revision=revision)
    except (OSError, ValueError) as err:
        if offline_env() and not written_as_path(name):
            raise RecipeError(
                f"'{name}' is not in the local Hugging Face cache and HF_HUB_OFFLINE=1: pass a local checkpoint "
                "folder, or unset HF_HUB_OFFLINE"
            ) from None
        raise RecipeError(
            f"cannot load model '{name}': {first_line(err)} (a local checkpoint folder or Hub id; offline, "
            "use a local path or --config_name to train from scratch)"
        ) from None


def model_size(config) -> tuple[int, int]:
    """(parameters, parameters of the largest layer) of the classification model, built on the meta device."""
    from accelerate import init_empty_weights
    from accelerate.utils import calculate_maximum_sizes

    try:
        model_class = classifier_class(config)
    except KeyError:
        raise RecipeError(f"'{config.model_type}' is not an image-classification model") from None
    # The class itself, not from_config: under ZeRO-3, from_config would partition it with deepspeed.zero.Init.
    with init_empty_weights():
        model = model_class(config)
    total_bytes, (largest_bytes, _) = calculate_maximum_sizes(model)
    params = sum(p.numel() for p in model.parameters())
    return params, int(round(largest_bytes * params / max(1, total_bytes)))  # bytes -> elements of the meta model


def config_from_args(model_args):
    """The config the script builds from, and whether weights come from a checkpoint."""
    if model_args.model_name_or_path:
        if model_args.config_overrides:  # a recipe's from-scratch shape next to a checkpoint: the checkpoint's wins
            logger.warning(
                f"--config_overrides ({model_args.config_overrides}) is ignored: {model_args.model_name_or_path} is a "
                "trained checkpoint and keeps its own config (set --model_name_or_path null to train the overridden "
                "shape from scratch)"
            )
        return load_config(model_args.model_name_or_path, model_args.cache_dir, model_args.model_revision), True
    config = load_config(model_args.config_name)
    if model_args.config_overrides:
        try:
            config.update_from_string(model_args.config_overrides)
        except ValueError as err:
            raise RecipeError(f"bad --config_overrides: {err}") from None
    return config, False


def model_size_from_args(model_args) -> tuple[int, int] | None:
    """`model_size` of the model the script will train (None when its config cannot be read yet)."""
    try:
        return model_size(config_from_args(model_args)[0])
    except (RecipeError, ValueError, OSError, AttributeError):
        return None


def zero2_states(params: int, gpus_per_node: int, nodes: int, offload: bool) -> tuple[int, int]:
    """(host bytes per node, GPU bytes) of ZeRO-2 model states: DeepSpeed's estimator."""
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    return estimate_zero2_model_states_mem_needs(params, gpus_per_node, nodes, cpu_offload=offload)


def zero3_states(
    params: int, largest: int, gpus_per_node: int, nodes: int, offload: bool, offload_params: bool | None = None
) -> tuple[int, int, int]:
    """(host bytes per node, GPU bytes, largest-layer bytes) of ZeRO-3 model states: DeepSpeed's estimator."""
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs

    offload_params = offload if offload_params is None else offload_params
    return estimate_zero3_model_states_mem_needs(
        params, largest, gpus_per_node, nodes, cpu_offload=offload, cpu_offload_params=offload_params, zero_init=True
    )


def fsdp2_offload_host(params: int, nodes: int) -> float:
    """Host bytes per node of FSDP2 with offload: fp32 shards of parameters, gradients and Adam moments."""
    return (4 + 4 + 8) * params / nodes * BUFFER


def host_memory_for(strategy, params: int, largest: int) -> float:
    """Host bytes per node that the offload of a run's `plan.Strategy` needs (DeepSpeed rows run with DeepSpeed)."""
    per_node, nodes, offload = strategy.processes_per_node, strategy.nodes, strategy.offload_optimizer
    if strategy.fsdp:
        return fsdp2_offload_host(params, nodes)
    if strategy.zero_stage == 3:
        return float(zero3_states(params, largest, per_node, nodes, offload, strategy.offload_params)[0])
    return float(zero2_states(params, per_node, nodes, offload)[0])

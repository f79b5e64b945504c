"""What a run knows of its model, read once: `read_model_facts` reads the config (in `plan.build_plan`, the run's one
read) and `ModelFacts` carries it, with its classifier class, its image processor's size and its parameter count, to
the checks, the memory estimate, the model's building and the predict-only labels. No other module reads the config."""

import copy
import functools
import os
from dataclasses import dataclass, replace

from transformers import AutoImageProcessor, PretrainedConfig
from transformers.utils import logging

from ..core.errors import RecipeError, first_line
from ..core.hub import check_local_path, offline_env, reachable_or_cached, written_as_path
from .classifiers import classifier_class
from .lora import adapter_base, is_adapter_dir

logger = logging.get_logger(__name__)  # transformers': it has warning_once


def load_config(name: str, cache_dir: str | None = None, revision: str = "main"):
    """The config of a model type ("vit"), a local folder or a Hub id (cache first); one line on failure."""
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    if name in CONFIG_MAPPING_NAMES:
        return AutoConfig.for_model(name)
    check_local_path(name, "model")
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
        if model_args.config_overrides:  # the checkpoint's shape wins; said once a process (a run reads it once)
            logger.warning_once(
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


def image_processor(model_args):
    """The checkpoint's image processor (--image_processor_name, else the model's), or None when there is none."""
    source = model_args.image_processor_name or model_args.model_name_or_path
    if not source:
        return None
    if os.path.exists(os.path.expanduser(source)):  # a local folder: read again (a run may have rewritten it)
        return _load_processor.__wrapped__(source, model_args.cache_dir)
    return _load_processor(source, model_args.cache_dir)  # a Hub id: one call per run (input size, then mean/std)


@functools.lru_cache(maxsize=8)
def _load_processor(source: str, cache_dir: str | None):
    try:
        return AutoImageProcessor.from_pretrained(os.path.expanduser(source), cache_dir=cache_dir)
    except (OSError, ValueError, AttributeError, TypeError):
        return None


def processor_image_size(model_args) -> int | None:
    """The square input the checkpoint's image processor produces (its crop, else its resize), or None."""
    if (processor := image_processor(model_args)) is None:
        return None
    if getattr(processor, "data_config", None):  # timm's TimmWrapperImageProcessor: (3, height, width)
        return processor.data_config["input_size"][-1]
    for key in ("crop_size", "size") if getattr(processor, "do_center_crop", False) else ("size",):
        size = dict(getattr(processor, key, None) or {})
        value = size.get("height") or size.get("shortest_edge")
        if isinstance(value, int) and value > 0:
            return value
    return None


@dataclass(frozen=True)
class ModelFacts:
    """What a run needs to know about its model, read once (`read_model_facts`) and passed on."""

    source: str | None  # where the config comes from: --model_name_or_path (an adapter's base), else --config_name
    config: PretrainedConfig | None  # as read, --config_overrides applied; None where it could not be (`problem`)
    pretrained: bool  # the weights come from a checkpoint, not a new model from the config
    classifier: type | None  # transformers' image-classification class for the config; None: it has none
    processor_size: int | None  # the square the image processor produces (its crop, else its resize), or None
    labels_config: PretrainedConfig | None = None  # predicting without a dataset: the config the labels come from
    # Why the config could not be read: raised where the model is built, as before the plan read it (the plan's
    # checks skip a model they cannot read, so that the error and where it comes stay as they were)
    problem: Exception | None = None

    def fresh_config(self) -> PretrainedConfig:
        """A copy of the config, for a model built with its own labels and drop path; or the read's error, raised."""
        if self.problem is not None:
            raise self.problem
        return copy.deepcopy(self.config)

    def labels(self) -> PretrainedConfig:
        """The config a predict-only run takes the model's labels from: an adapter folder's own, else the model's."""
        return self.labels_config or self.fresh_config()

    @functools.cached_property
    def size(self) -> tuple[int, int]:
        """`model_size`: (parameters, parameters of the largest layer), counted once when first asked."""
        if self.problem is not None:
            raise self.problem
        return model_size(self.config)


def read_model_facts(model_args, labels: bool = False) -> ModelFacts:
    """The facts of the model `model_args` builds (an adapter folder's base). `labels`: predicting without a dataset,
    where an adapter's labels are its own folder's (its config.json), not its base's."""
    path, labelled = model_args.model_name_or_path, None
    try:
        if is_adapter_dir(path):
            labelled = load_config(path, model_args.cache_dir, model_args.model_revision) if labels else None
            model_args = replace(model_args, model_name_or_path=adapter_base(path))
        config, pretrained = config_from_args(model_args)
        problem = None
    except (RecipeError, ValueError, OSError, AttributeError, KeyError) as err:  # kept: see ModelFacts.problem
        # Kept without its traceback and the error it replaced: their frames reach the caller's (the plan's
        # arguments, a ZeRO-3 config's global reference among them) and would keep them alive with the plan.
        err.__context__ = err.__cause__ = None
        config, pretrained, problem = None, False, err.with_traceback(None)
    try:
        classifier = classifier_class(config) if config is not None else None
    except KeyError:  # not an image-classification config: build_model's check_config says so
        classifier = None
    return ModelFacts(
        source=model_args.model_name_or_path or model_args.config_name, config=config, pretrained=pretrained,
        classifier=classifier, processor_size=processor_image_size(model_args), labels_config=labelled,
        problem=problem,
    )  # fmt: skip

"""Build the model (fine-tune a checkpoint, or train from a config) and the image processor saved with it."""

from __future__ import annotations

import logging
import os

from transformers import (
    AutoConfig,
    AutoImageProcessor,
    AutoModelForImageClassification,
    PretrainedConfig,
)
from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES

from .errors import RecipeError
from .patch_embedding import use_patch_matmul
from .strategy import model_class_for, zero3_enabled, zero3_state_dict_for_new_head

try:  # transformers >= 5.2x names the PIL backend explicitly; it saves as "BitImageProcessor" either way
    from transformers import BitImageProcessorPil as BitImageProcessor
except ImportError:
    from transformers import BitImageProcessor

logger = logging.getLogger(__name__)

DEFAULT_MEAN = DEFAULT_STD = (0.5, 0.5, 0.5)  # ViT's own normalisation


def _load_config(model_args) -> tuple[PretrainedConfig, bool]:
    """The config to build from, and whether weights come from a checkpoint."""
    source = model_args.model_name_or_path
    if source:
        try:
            config = AutoConfig.from_pretrained(
                source, revision=model_args.model_revision, cache_dir=model_args.cache_dir
            )
        except (OSError, ValueError) as err:
            raise RecipeError(
                f"cannot load model '{source}': {str(err).splitlines()[0]} (a local checkpoint folder "
                "or Hub id; offline, use a local path or --config_name to train from scratch)"
            ) from None
        return config, True
    name = model_args.config_name
    try:
        config = AutoConfig.for_model(name) if name in _model_types() else AutoConfig.from_pretrained(name)
    except (OSError, ValueError) as err:
        raise RecipeError(f"cannot load config '{name}': {str(err).splitlines()[0]}") from None
    if model_args.config_overrides:
        try:
            config.update_from_string(model_args.config_overrides)
        except ValueError as err:
            raise RecipeError(f"bad --config_overrides: {err}") from None
    return config, False


def _model_types() -> set[str]:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    return set(CONFIG_MAPPING_NAMES)


def check_config(config: PretrainedConfig, source: str) -> int:
    """Reject configs that cannot classify images; return the input resolution."""
    if config.model_type not in MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES:
        raise RecipeError(
            f"'{source}' is a {config.model_type} model, not an image-classification one; use a "
            "checkpoint such as google/vit-base-patch16-224-in21k"
        )
    image_size, patch_size = getattr(config, "image_size", None), getattr(config, "patch_size", None)
    if isinstance(image_size, (list, tuple)):
        image_size = image_size[0]
    if isinstance(patch_size, (list, tuple)):
        patch_size = patch_size[0]
    if not isinstance(image_size, int) or image_size <= 0:
        raise RecipeError(f"'{source}' has no usable image_size in its config")
    if patch_size and image_size % patch_size:
        raise RecipeError(f"image_size {image_size} is not divisible by patch_size {patch_size}; pick a multiple")
    return image_size


def build_model(model_args, label_names: list[str]):
    """The classification model with a head for `label_names`, and its resolution."""
    config, pretrained = _load_config(model_args)
    source = model_args.model_name_or_path or model_args.config_name
    id2label = dict(enumerate(label_names))
    label2id = {name: i for i, name in id2label.items()}
    old_labels = getattr(config, "num_labels", None)
    same_head = pretrained and old_labels == len(label_names) and getattr(config, "id2label", {}) == id2label
    config.num_labels = len(label_names)
    config.id2label, config.label2id = id2label, label2id
    image_size = check_config(config, source)
    kwargs = {"config": config, "attn_implementation": model_args.attn_implementation}
    if pretrained:
        loader, name = AutoModelForImageClassification.from_pretrained, source
        if not same_head:
            logger.info(
                "Replacing the classification head: %s has %s labels, this dataset %d",
                source,
                old_labels,
                len(label_names),
            )
            if zero3_enabled():  # ZeRO-3 loading ignores ignore_mismatched_sizes: leave the old head out instead
                state_dict = zero3_state_dict_for_new_head(
                    source, config, model_args.model_revision, model_args.cache_dir
                )
                if state_dict is not None:  # transformers takes a state_dict instead of a name, not with one
                    loader, name, kwargs["state_dict"] = model_class_for(config).from_pretrained, None, state_dict
        model = _quietly(
            loader,
            name,
            revision=model_args.model_revision,
            cache_dir=model_args.cache_dir,
            ignore_mismatched_sizes=not same_head,
            **kwargs,
        )
    else:
        model = AutoModelForImageClassification.from_config(**kwargs)
        logger.info(
            "Training from scratch: %s with %.1fM parameters",
            config.model_type,
            sum(p.numel() for p in model.parameters()) / 1e6,
        )
    use_patch_matmul(model, model_args.patch_embedding_matmul)
    return model, image_size


def _quietly(fn, *args, **kwargs):
    """Call fn while transformers' load report (mismatched/new head weights) is silenced: we logged it in one line."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        return fn(*args, **kwargs)
    finally:
        hf_logging.set_verbosity(level)


def mean_std(model_args) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Normalisation from the checkpoint's image processor (ViT's 0.5/0.5 when there is none)."""
    source = model_args.image_processor_name or model_args.model_name_or_path
    if source:
        try:
            processor = AutoImageProcessor.from_pretrained(source, cache_dir=model_args.cache_dir)
            return tuple(processor.image_mean), tuple(processor.image_std)
        except (OSError, ValueError, AttributeError, TypeError):
            if os.path.isdir(source) or model_args.image_processor_name:
                logger.info("No image processor in %s: using mean/std %s", source, DEFAULT_MEAN)
    return DEFAULT_MEAN, DEFAULT_STD


def evaluation_processor(image_size: int, eval_crop_pct: float, mean, std) -> BitImageProcessor:
    """An image processor that reproduces the script's evaluation preprocessing for pipeline() users.

    Evaluation resizes the shorter side to image_size / eval_crop_pct (bicubic) and centre-crops image_size.
    """
    return BitImageProcessor(
        do_resize=True,
        size={"shortest_edge": round(image_size / eval_crop_pct)},
        resample=3,  # PIL.Image.BICUBIC
        do_center_crop=True,
        crop_size={"height": image_size, "width": image_size},
        do_rescale=True,
        rescale_factor=1 / 255,
        do_normalize=True,
        image_mean=list(mean),
        image_std=list(std),
        do_convert_rgb=True,
    )

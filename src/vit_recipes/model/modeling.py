"""The model a run trains (full, LoRA, head only, or a saved adapter on its base) and its saved image processor."""

import functools
import json
import logging
import os
import pickle
from dataclasses import dataclass, field, replace
from pathlib import Path

from safetensors import SafetensorError
from transformers import AutoModelForImageClassification, PretrainedConfig
from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled
from transformers.models.auto import modeling_auto
from transformers.utils import logging as hf_logging

from ..core.arguments import LoraArguments, ModelArguments
from ..core.errors import RecipeError, first_line
from .attention import NAME as SDPA_DIRECT  # importing it registers it with transformers' AttentionInterface
from .classifiers import classifier_class
from .facts import ModelFacts, image_processor, read_model_facts
from .levers import add_drop_path
from .lora import adapter_base, apply_lora, attach_adapter, base_signature, freeze_backbone, is_adapter_dir, unwrap
from .patch_embedding import use_patch_matmul

try:  # transformers >= 5.2x names the PIL backend explicitly; it saves as "BitImageProcessor" either way
    from transformers import BitImageProcessorPil as BitImageProcessor
except ImportError:
    from transformers import BitImageProcessor

logger = logging.getLogger(__name__)

DEFAULT_MEAN = DEFAULT_STD = (0.5, 0.5, 0.5)  # ViT's own normalisation


def check_config(config: PretrainedConfig, source: str, processor_size: int | None = None) -> int:
    """Reject configs that cannot classify images; return the input resolution (image_size, else `processor_size`)."""
    if config.model_type not in modeling_auto.MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES:
        raise RecipeError(
            f"'{source}' is a {config.model_type} model, not an image-classification one; use a "
            "checkpoint such as google/vit-base-patch16-224-in21k"
        )
    sizes = [getattr(config, key, None) for key in ("image_size", "patch_size")]
    image_size, patch_size = (size[0] if isinstance(size, (list, tuple)) else size for size in sizes)
    if not isinstance(image_size, int) or image_size <= 0:
        image_size = processor_size
    if not isinstance(image_size, int) or image_size <= 0:
        raise RecipeError(
            f"'{source}' has no usable image_size in its config and no image processor that gives one: save its "
            "preprocessor_config.json beside it (or pass --image_processor_name)"
        )
    if patch_size and image_size % patch_size:
        raise RecipeError(f"image_size {image_size} is not divisible by patch_size {patch_size}; pick a multiple")
    hidden, heads = getattr(config, "hidden_size", None), getattr(config, "num_attention_heads", None)
    if isinstance(hidden, int) and isinstance(heads, int) and heads > 0 and hidden % heads:
        raise RecipeError(  # ViT would silently train a narrower attention
            f"hidden_size {hidden} is not divisible by num_attention_heads {heads}: pick a head count that divides it "
            f"(e.g. {next(h for h in range(heads, 0, -1) if hidden % h == 0)})"
        )
    return image_size


def build_model(model_args, label_names: list[str], facts: ModelFacts | None = None):
    """The classification model with a head for `label_names`, and its resolution. `facts`: the run's, read once in
    the plan (read here without them: a model built outside a run, as load_model's)."""
    facts = facts or read_model_facts(model_args)
    config, pretrained, source = facts.fresh_config(), facts.pretrained, facts.source
    id2label, count = dict(enumerate(label_names)), len(label_names)
    old_labels = getattr(config, "num_labels", None)
    same_head = pretrained and old_labels == count and getattr(config, "id2label", {}) == id2label
    config.num_labels = count
    config.id2label, config.label2id = id2label, {name: i for i, name in id2label.items()}
    if hasattr(config, "label_names"):  # timm's config.json: saved instead of id2label, and it would win
        config.label_names = list(label_names)
    image_size = training_image_size(facts)
    rate, own = model_args.drop_path_rate, hasattr(config, "drop_path_rate")  # BEiT, DINOv2, Swin, ConvNeXt, ...
    if rate is not None and own:
        config.drop_path_rate = rate
        logger.warning("Stochastic depth: config.drop_path_rate %g (%s's own drop path)", rate, config.model_type)
    kwargs = {"config": config, "attn_implementation": attention_for(config, model_args.attn_implementation)}
    if pretrained:
        loader, name = AutoModelForImageClassification.from_pretrained, source
        revision, cache_dir = model_args.model_revision, model_args.cache_dir
        if not same_head:
            logger.info(
                "Replacing the classification head: %s has %s labels, this dataset %d", source, old_labels, count
            )
            if is_deepspeed_zero3_enabled():  # ZeRO-3 ignores ignore_mismatched_sizes: leave the old head out
                state_dict = zero3_state_dict_for_new_head(source, config, revision, cache_dir)
                if state_dict is not None:  # transformers takes a state_dict instead of a name, not with one
                    loader, name, kwargs["state_dict"] = classifier_class(config).from_pretrained, None, state_dict
        level = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()  # transformers' load report (mismatched/new head weights): logged above
        try:
            model = loader(
                name, revision=revision, cache_dir=cache_dir, ignore_mismatched_sizes=not same_head, **kwargs
            )
        except pickle.UnpicklingError:  # torch's weights_only load refused code in the file: it never ran
            weights = Path(source).expanduser() / "pytorch_model.bin"
            fix = "use a checkpoint with model.safetensors"
            if weights.is_file():
                fix = (
                    'if you trust its source, convert it to safetensors once: python -c "import torch; from '
                    f"safetensors.torch import save_file; save_file(torch.load('{weights}', weights_only=False), "
                    f"'{weights.with_name('model.safetensors')}')\""
                )
            raise RecipeError(
                f"the pytorch_model.bin of '{source}' is a pickle holding more than weights, and pickles are only "
                f"loaded as plain weights: {fix}"
            ) from None
        except (OSError, SafetensorError) as err:  # a truncated or corrupt weight file
            raise RecipeError(f"cannot read the weights of '{source}': {first_line(err)}") from None
        finally:
            hf_logging.set_verbosity(level)
    else:
        model = AutoModelForImageClassification.from_config(**kwargs)
        millions = sum(p.numel() for p in model.parameters()) / 1e6
        logger.info("Training from scratch: %s with %.1fM parameters", config.model_type, millions)
    if rate and not own:
        logger.warning("Stochastic depth: a drop path (rates 0 to %g) after the residual dropouts", rate)
        add_drop_path(model, rate)
    use_patch_matmul(model, model_args.patch_embedding_matmul)
    return model, image_size


def training_image_size(facts: ModelFacts, say: bool = True) -> int:
    """The side of the square images the model trains on: its image processor's (its crop, else its resize: what
    pipeline() and transformers' example feed it) where the model runs at that size as it is, else its config's
    image_size. They differ for DINOv2: 518 in the config, the size of its position table, which it interpolates to
    the 224 its processor crops (5x fewer tokens). `say`: log which, and why, when they differ."""
    config, source, processor_size = facts.fresh_config(), facts.source, facts.processor_size
    own = check_config(config, source, processor_size)  # the config's (else the processor's: ResNet has none)
    if not processor_size or processor_size == own:
        return own
    patch = getattr(config, "patch_size", None)
    patch = patch[0] if isinstance(patch, (list, tuple)) else patch
    if (isinstance(patch, int) and processor_size % patch) or not runs_at(config, processor_size):
        if say:
            logger.warning(
                "The image processor of %s feeds it %d px, but %s runs only at its config's image_size %d (without "
                "interpolate_pos_encoding, which pipeline() does not pass): training at %d px; the saved image "
                "processor says so",
                source, processor_size, facts.classifier.__name__, own, own,
            )  # fmt: skip
        return own
    if say:
        logger.info(
            "Training at %d px, the size the image processor of %s feeds it; the config's image_size %d is the size "
            "of its position table, which %s interpolates",
            processor_size, source, own, facts.classifier.__name__,
        )  # fmt: skip
    return processor_size


def runs_at(config: PretrainedConfig, size: int) -> bool:
    """Whether the model runs on size x size images as it is (no flag to pass to forward): one forward pass on the
    meta device (shapes only, no memory). DINOv2 interpolates its position embeddings, convolutional families and
    Swin take any size; ViT and DeiT refuse another size than their config's."""
    import copy

    import torch
    from accelerate import init_empty_weights

    try:  # the class itself, not from_config: under ZeRO-3, from_config would partition it (deepspeed.zero.Init)
        with init_empty_weights(include_buffers=True):
            model = classifier_class(config)(copy.deepcopy(config))
        with torch.no_grad():
            model(pixel_values=torch.empty(1, getattr(config, "num_channels", 3), size, size, device="meta"))
        return True
    except Exception:  # noqa: BLE001 - whatever refuses the size (ViT's ValueError, a shape mismatch): not this size
        return False


# Families whose logits and gradients under sdpa_direct are tested equal to transformers' SDPA (tests/test_attention.py):
# 'auto' calls SDPA directly for them; others keep transformers' pick.
DIRECT_ATTENTION_FAMILIES = ("vit", "deit", "dinov2", "swin")


def attention_for(config: PretrainedConfig, asked: str) -> str | None:
    """The attention implementation: 'auto' calls SDPA directly (vit_recipes.model.attention: the same kernel without
    transformers' per-call checks) for the families tested with it, else lets transformers pick (SDPA, else eager);
    'sdpa' or 'sdpa_direct' where the class has no SDPA: one line."""
    model_class = classifier_class(config)
    has_sdpa = bool(getattr(model_class, "_supports_sdpa", False))
    if config.model_type == "timm_wrapper" and asked != "auto":  # transformers only warns that timm ignores it
        raise RecipeError(f"--attn_implementation {asked}: timm models pick their own attention; drop the flag")
    if asked == "auto":
        if has_sdpa and config.model_type in DIRECT_ATTENTION_FAMILIES:
            logger.info("Attention: %s (SDPA called directly: same results; --attn_implementation sdpa for "
                        "transformers' own call)", SDPA_DIRECT)  # fmt: skip
            return SDPA_DIRECT
        logger.info("Attention: %s", "sdpa" if has_sdpa else f"eager ({model_class.__name__} has no SDPA kernel)")
        return None
    if asked in ("sdpa", SDPA_DIRECT) and not has_sdpa:
        raise RecipeError(
            f"{model_class.__name__} has no SDPA attention: drop --attn_implementation (auto picks eager for it) or "
            "pass --attn_implementation eager"
        )
    return asked


@dataclass
class FinetuneSetup:
    """How the model is fine-tuned, for the later steps of the script."""

    method: str  # "full", "lora" or "head"
    merge_adapter: bool
    base_args: ModelArguments | None  # how to build the frozen base again (LoRA), for merging
    label_names: list[str]
    metrics: dict[str, float]  # parameter counts, added to the train metrics
    signature: list | None = None  # of the frozen base (LoRA), see base_signature
    lora: dict = field(default_factory=dict)  # r, alpha, dropout, target modules (LoRA)
    base_facts: ModelFacts | None = None  # the base's config, read once, for building it again (merging)

    def card_fields(self, hyperparameters: dict) -> dict:
        """CardInfo fields: the peft library for an adapter, tags, and the method's hyperparameters."""
        names = {"full": "full", "lora": "LoRA (peft)", "head": "head only (frozen backbone)"}
        extra = {"finetuning": names[self.method], **self.lora}
        if self.method != "full":
            extra["trainable_parameters"] = f"{self.metrics['train_trainable_percent']:.2f}%"
        if self.method == "lora":
            extra["merged"] = self.merge_adapter
        fields = {"hyperparameters": {**hyperparameters, **extra}}
        if self.method == "lora" and not self.merge_adapter:
            fields.update(extra_tags=["lora", "peft"], library_name="peft")
        elif self.method == "lora":
            fields["extra_tags"] = ["lora"]
        return fields


def _finish(model, image_size, setup: FinetuneSetup, what: str, detail: str, training_args):
    """Fill in the parameter counts and LoRA settings (for the card), and print the summary line."""
    sizes = [(getattr(p, "ds_numel", None) or p.numel(), p.requires_grad) for p in model.parameters()]  # ZeRO-3: all
    total, trainable = sum(n for n, _ in sizes), sum(n for n, grad in sizes if grad)
    percent = round(100 * trainable / max(total, 1), 4)
    setup.metrics = dict(train_trainable_params=trainable, train_total_params=total, train_trainable_percent=percent)
    if setup.method == "lora":
        config = model.peft_config["default"]
        targets = config.target_modules
        setup.lora = {"lora_r": config.r, "lora_alpha": config.lora_alpha, "lora_dropout": config.lora_dropout}
        setup.lora["lora_target_modules"] = targets if isinstance(targets, str) else ", ".join(sorted(targets))
    size = f"; input {image_size}x{image_size} px"  # the processor's where the model takes it: training_image_size
    if not getattr(training_args, "do_train", True):  # evaluating or predicting: nothing is trained
        if getattr(training_args, "should_log", True):
            print(f"Model: {total:,} parameters (not trained in this run){size}", flush=True)
    elif getattr(training_args, "should_log", True):  # the main process; printed, as the script's summary is
        print(f"{what}: trainable params {trainable:,} of {total:,} ({percent:.2f}%){detail}{size}", flush=True)
    return model, image_size, setup


def build_finetune_model(
    model_args, lora_args: LoraArguments, training_args, label_names: list[str], facts: ModelFacts | None = None
):
    """The model to train or evaluate, its input resolution, and a `FinetuneSetup`; `facts`: the plan's."""
    facts = facts or read_model_facts(model_args)
    if is_adapter_dir(model_args.model_name_or_path):
        return _build_from_adapter(model_args, lora_args, training_args, label_names, facts)
    method = lora_args.method
    model, image_size = build_model(model_args, label_names, facts)
    setup = FinetuneSetup(method, lora_args.merge_adapter, None, list(label_names), {})
    detail = ""
    if method == "lora":
        setup.signature, setup.base_args, setup.base_facts = base_signature(model), model_args, facts
        model, detail = apply_lora(model, lora_args, training_args)
    elif method == "head":
        detail = f": the head ({', '.join(freeze_backbone(model))}) on a frozen backbone"
    what = {"full": "Full fine-tuning", "lora": "LoRA", "head": "Head only"}[method]
    return _finish(model, image_size, setup, what, detail, training_args)


def _build_from_adapter(model_args, lora_args, training_args, label_names, facts: ModelFacts):
    """A saved adapter folder as --model_name_or_path: its base with its head, then the adapter."""
    path = model_args.model_name_or_path
    if lora_args.freeze_backbone:
        raise RecipeError(f"{path} holds a LoRA adapter: --freeze_backbone does not apply to it")
    config_file = Path(path) / "config.json"
    id2label = (json.loads(config_file.read_text()).get("id2label") or {}) if config_file.is_file() else {}
    saved = [id2label[k] for k in sorted(id2label, key=int)]
    if saved and saved != list(label_names):
        shown = ", ".join(saved[:5]) + (", ..." if len(saved) > 5 else "")
        raise RecipeError(
            f"the adapter in {path} classifies into {len(saved)} labels ({shown}), this dataset has "
            f"{len(label_names)}: evaluate it on the dataset it was trained on"
        )
    base_args = replace(model_args, model_name_or_path=adapter_base(path))
    model, image_size = build_model(base_args, label_names, facts)  # facts of the base (read_model_facts)
    trainable = bool(getattr(training_args, "do_train", False))
    model = attach_adapter(model, path, is_trainable=trainable, base_source=base_args.model_name_or_path)
    setup = FinetuneSetup("lora", lora_args.merge_adapter, base_args, list(label_names), {}, base_signature(model),
                          base_facts=facts)  # fmt: skip
    if trainable and getattr(training_args, "gradient_checkpointing", False):
        unwrap(model).enable_input_require_grads()
    detail = f" loaded from {path} onto {base_args.model_name_or_path}"
    return _finish(model, image_size, setup, "LoRA adapter", detail, training_args)


def zero3_state_dict_for_new_head(source: str, config, revision: str = "main", cache_dir: str | None = None):
    """The checkpoint's tensors minus the reshaped ones (the new head), or None; ranks but 0 get meta tensors."""
    import torch
    from accelerate import init_empty_weights
    from safetensors import safe_open
    from transformers.utils import SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME, cached_file

    resolve = functools.partial(
        cached_file, source, revision=revision, cache_dir=cache_dir, _raise_exceptions_for_missing_entries=False
    )
    files = [resolve(SAFE_WEIGHTS_NAME)]
    if not files[0] and (index := resolve(SAFE_WEIGHTS_INDEX_NAME)):  # a sharded checkpoint
        shards = sorted(set(json.loads(Path(index).read_text())["weight_map"].values()))
        files = [resolve(shard) for shard in shards]
    if not files or not all(files) or type(config) not in modeling_auto.MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING:
        return None  # .bin checkpoints (or no classifier for this config): leave them to transformers
    with init_empty_weights():
        expected = {k: tuple(v.shape) for k, v in classifier_class(config)(config).state_dict().items()}
    rank0 = not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
    state_dict, dropped = {}, []
    for file in files:
        with safe_open(file, framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not iterable)
                piece = f.get_slice(key)
                shape = tuple(piece.get_shape())
                if key in expected and expected[key] != shape:
                    dropped.append(key)
                elif rank0:
                    state_dict[key] = f.get_tensor(key)
                else:
                    dtype = {"F16": torch.float16, "BF16": torch.bfloat16}.get(piece.get_dtype(), torch.float32)
                    state_dict[key] = torch.empty(shape, dtype=dtype, device="meta")
    if not dropped:
        return None
    logger.info("ZeRO-3: loading %s without %s (new head)", source, ", ".join(dropped))
    return state_dict


def mean_std(model_args) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Normalisation from the checkpoint's image processor (ViT's 0.5/0.5 when there is none)."""
    try:
        processor = image_processor(model_args)
        norm = getattr(processor, "data_config", None)  # timm's wrapper keeps its mean/std there
        mean, std = (norm["mean"], norm["std"]) if norm else (processor.image_mean, processor.image_std)
        return tuple(mean), tuple(std)
    except (ValueError, AttributeError, TypeError):  # no image processor (None), or one without mean/std
        source = model_args.image_processor_name or model_args.model_name_or_path
        if source and (os.path.isdir(source) or model_args.image_processor_name):
            logger.info("No image processor in %s: using mean/std %s", source, DEFAULT_MEAN)
    return DEFAULT_MEAN, DEFAULT_STD


def evaluation_processor(image_size: int, eval_crop_pct: float, mean, std) -> BitImageProcessor:
    """The script's eval preprocessing (bicubic resize to image_size / eval_crop_pct, centre crop) for pipeline()."""
    return BitImageProcessor(
        do_resize=True, size={"shortest_edge": round(image_size / eval_crop_pct)}, resample=3,  # PIL.Image.BICUBIC
        do_center_crop=True, crop_size={"height": image_size, "width": image_size},
        do_rescale=True, rescale_factor=1 / 255, do_normalize=True, image_mean=list(mean), image_std=list(std),
        do_convert_rgb=True,
    )  # fmt: skip

"""Command-line and recipe arguments: the dataclasses the script parses (one `--help` group each), and their checks.
A YAML recipe (`--config`) sets field values; flags override it. What derives from them is worked out in plan.py."""

import argparse
import difflib
import importlib.util
import json
import logging
import os
import re
import sys
from collections.abc import Callable
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
import yaml
from transformers import HfArgumentParser, TrainingArguments
from transformers.utils import is_torch_tf32_available
from transformers.utils.import_utils import enable_tf32

from .errors import RecipeError, first_line

logger = logging.getLogger(__name__)


def _arg(default: Any = MISSING, help_text: str = "", default_factory: Any = MISSING, choices=None) -> Any:
    """A dataclass field with its `--help` text (and argparse `choices`)."""
    metadata = {"help": help_text, **({"choices": choices} if choices else {})}
    return field(default=default, default_factory=default_factory, metadata=metadata)


@dataclass
class ModelArguments:
    """Which model to fine-tune, or which config to train from scratch."""

    _argument_group_name = "model"
    model_name_or_path: str | None = _arg(
        "google/vit-base-patch16-224-in21k",
        "Hub id or local path of the checkpoint to fine-tune. Set to null to train from scratch from --config_name.",
    )
    config_name: str | None = _arg(None, "Train from scratch from this config: a model type ('vit') or a Hub id/path.")
    config_overrides: str | None = _arg(
        None,
        "Comma-separated config overrides when training from scratch, e.g. 'hidden_size=192,num_hidden_layers=6,"
        "num_attention_heads=3,intermediate_size=768,image_size=32,patch_size=4'.",
    )
    image_processor_name: str | None = _arg(None, "Image processor to take mean/std from (default: the model's).")
    model_revision: str = _arg("main", "Branch, tag or commit of the checkpoint.")
    license: str | None = _arg(
        None,
        "The model card's licence, a Hub licence id (apache-2.0, mit, cc-by-4.0, ...). Default: the base model's when "
        "its card is local or cached, else the card claims none.",
    )
    cache_dir: str | None = _arg(None, "Where to cache Hub downloads.")
    attn_implementation: str = _arg(
        "auto",
        "Attention kernel: 'auto' (ViT, DeiT, DINOv2 and Swin: sdpa_direct; other models SDPA where they have it, "
        "else eager; one log line says which), 'sdpa', 'sdpa_direct' (the same SDPA kernel called without "
        "transformers' per-call checks, which serve language models; same results and checkpoints) or 'eager'.",
    )
    drop_path_rate: float | None = _arg(
        None,
        "Stochastic depth (timm's drop_path_rate): the deepest layer's chance of skipping each residual branch of a "
        "training sample, growing linearly from 0 at the first. Sets the config's drop_path_rate where the family "
        "has one (BEiT, DINOv2, Swin, ConvNeXt, ...); ViT and DeiT get it on their residual dropouts. Unset: the "
        "checkpoint's own. Evaluation never drops.",
    )
    patch_embedding_matmul: bool = _arg(
        True,
        "Compute the patch embedding (a convolution whose kernel equals its stride) as one matmul over the flattened "
        "patches: same sums, faster on a GPU; weights and saved models unchanged (false keeps the convolution).",
    )

    def __post_init__(self):
        nulls = ("null", "none", "")  # YAML's null, typed on the command line (docs/usage.md's from-scratch command)
        for name in ("model_name_or_path", "config_name", "image_processor_name"):
            if str(getattr(self, name)).strip().lower() in nulls:
                setattr(self, name, None)


def _default_workers() -> int:
    return min(8, max(1, (os.cpu_count() or 2) // 2))


@dataclass
class DataArguments:
    """Where the images come from and how they are stored for training."""

    _argument_group_name = "data"
    dataset_name: str | None = _arg(
        None,
        "A preset (cifar100, food101, beans), any Hub dataset id, or a local path: an imagefolder tree, a folder of "
        "parquet/arrow files, or a save_to_disk folder.",
    )
    dataset_config_name: str | None = _arg(None, "Hub dataset configuration name.")
    image_column_name: str | None = _arg(None, "Image column (default: the preset's, else detected).")
    label_column_name: str | None = _arg(None, "Label column (default: the preset's, else detected).")
    problem_type: str | None = _arg(
        None,
        "'multi_label_classification' (any number of labels per image: sigmoid outputs, binary cross-entropy) or "
        "'single_label_classification'. Default: multi-label when the label column holds lists of labels.",
    )
    multi_label_threshold: float = _arg(
        0.5,
        "Multi-label: a label is predicted when its sigmoid score is at least this (F1, exact match, predictions).",
    )
    train_split_name: str = _arg("train", "Split to train on.")
    validation_split_name: str | None = _arg(None, "Validation split (default: validation/valid/val if present).")
    test_split_name: str | None = _arg(None, "Test split evaluated once at the end (default: 'test' if present).")
    validation_split_percentage: float = _arg(
        0.1, "Fraction of train carved (seeded, stratified) into validation when there is none."
    )
    max_train_samples: int | None = _arg(
        None, "Cap train at this many images (1 or more): a seeded sample, stratified by class."
    )
    max_eval_samples: int | None = _arg(
        None,
        "Cap validation and test at this many images each (1 or more): a seeded sample, stratified by class. To "
        "evaluate nothing, pass --eval_strategy no --do_eval false instead.",
    )
    storage_size: int | None = _arg(
        None,
        "Side of the square uint8 images the DataLoader delivers. Default: the native size when most images share one "
        "no larger than the model's, else image_size/0.875 (256 for 224).",
    )
    decode_images: str = _arg(
        "auto",
        "How images reach the DataLoader: 'once' (decoded before training into a uint8 copy in the datasets cache: "
        "small images, no decoding per step), 'per_batch' (decoded by the DataLoader workers: no copy on disk, the "
        "first step in seconds) or 'auto' (once when the images are no larger than the model's input, else per "
        "batch). docs/usage.md#how-images-are-decoded.",
    )
    streaming: bool = _arg(
        False,
        "Train from a stream (a datasets IterableDataset) instead of a prepared copy: for a dataset larger than the "
        "disk (a Hub dataset, or local parquet/arrow/WebDataset shards). Each rank reads its own shards; checkpoints "
        "save the stream's position. Validation and test are read whole. docs/usage.md#streaming.",
    )
    shuffle_buffer_size: int = _arg(
        1000, "--streaming: images in the shuffle buffer that mixes each rank's stream (shard order is shuffled too)."
    )
    preprocessing_num_workers: int | None = _arg(
        help_text="Processes decoding images once into the cache (default: all cores).", default_factory=os.cpu_count
    )
    predict_images: str | None = _arg(None, "--do_predict: a folder or one image to classify into predictions.csv.")

    def __post_init__(self):
        # 0 is refused, not read as "no cap" (the split in full) nor as "no evaluation" (which needs other flags)
        ways_out = {
            "max_train_samples": "to evaluate without training, pass --do_train false",
            "max_eval_samples": "to evaluate nothing, pass --eval_strategy no --do_eval false",
        }
        for name, way_out in ways_out.items():
            cap = getattr(self, name)
            if cap is not None and cap < 0:
                raise RecipeError(f"--{name} must be a number of images (1 or more), got {cap}")
            if cap == 0:
                raise RecipeError(f"--{name} 0 would leave no images: {way_out}; or drop the flag to use every image")


@dataclass
class AugmentationArguments:
    """Batched augmentation that runs on the training device."""

    _argument_group_name = "augmentation"
    crop_scale_min: float = _arg(0.08, "Smallest area fraction of random-resized crop (1.0 disables cropping).")
    hflip_prob: float = _arg(0.5, "Probability of a horizontal flip.")
    auto_augment: str = _arg("none", "Extra policy: 'none', 'randaugment' or 'trivialaugment'.")
    randaugment_num_ops: int = _arg(2, "RandAugment: ops per image.")
    randaugment_magnitude: int = _arg(9, "RandAugment: magnitude (0-30).")
    mixup_alpha: float = _arg(0.0, "Mixup Beta(alpha, alpha); 0 disables.")
    cutmix_alpha: float = _arg(0.0, "CutMix Beta(alpha, alpha); 0 disables.")
    eval_crop_pct: float = _arg(1.0, "Evaluation: resize to image_size/eval_crop_pct, then centre-crop.")
    patch_dropout: float = _arg(
        0.0,
        "Fraction of patch tokens each training image drops at random (PatchDropout; timm's patch_drop_rate): "
        "shorter sequences, faster steps. Evaluation and prediction see every patch. 0 disables.",
    )
    random_erasing: float = _arg(
        0.0,
        "Probability that a training image gets one random rectangle (0.02 to 1/3 of its area, aspect 0.3-3.3) replaced "
        "by per-pixel normal noise after normalisation (timm's RandomErasing, mode 'pixel'). 0 disables.",
    )
    class_weights: str = _arg(
        "none",
        "'balanced': weight the training loss by inverse class frequency in train; 'balanced_sampler': draw training "
        "images (with replacement) so that every class comes up equally often.",
    )


@dataclass
class LoraArguments:
    """LoRA adapters (peft): only the adapters and the classifier head are trained."""

    _argument_group_name = "LoRA and head-only fine-tuning"
    use_peft: bool = _arg(False, "Train LoRA adapters instead of the full model.")
    lora_r: int = _arg(16, "LoRA rank.")
    lora_alpha: int = _arg(16, "LoRA scaling alpha (updates are scaled by alpha/r).")
    lora_dropout: float = _arg(0.1, "Dropout on the LoRA path.")
    lora_target_modules: list[str] | None = _arg(
        None,
        "Module names to adapt, matched as name suffixes (e.g. q_proj v_proj fc1), or 'all-linear'. Default: the "
        "attention query and value projections, whatever the transformers version calls them.",
    )
    merge_adapter: bool = _arg(False, "Save a merged plain model instead of the adapter alone.")
    freeze_backbone: bool = _arg(False, "Train only the head, on a frozen backbone (the baseline LoRA must beat).")

    def __post_init__(self):
        for name in ("lora_r", "lora_alpha"):
            if not getattr(self, name) > 0:
                raise RecipeError(f"{name} must be > 0, got {getattr(self, name)}")
        if not 0 <= self.lora_dropout < 1:
            raise RecipeError(f"lora_dropout must be in [0, 1), got {self.lora_dropout}")
        if self.merge_adapter and not self.use_peft:
            raise RecipeError("--merge_adapter needs --use_peft (there is no adapter)")
        if self.use_peft and self.freeze_backbone:
            raise RecipeError("--freeze_backbone and --use_peft exclude each other: LoRA already freezes the backbone")
        if self.lora_target_modules is not None and len(self.lora_target_modules) == 0:
            raise RecipeError("--lora_target_modules needs at least one name")

    @property
    def method(self) -> str:
        """ "full", "lora" or "head"."""
        return "lora" if self.use_peft else "head" if self.freeze_backbone else "full"


@dataclass
class ObservabilityArguments:
    """Profiler traces and plots written next to the model."""

    _argument_group_name = "profiling and plots"
    profile_steps: str | None = _arg(
        None,
        "Capture PyTorch profiler Chrome traces (one per rank) for these training steps, e.g. '20-25' (pick a window "
        "after warm-up). Analyse with `python tools/trace_analysis.py OUTPUT_DIR/profiler`.",
    )
    profile_dir: str | None = _arg(None, "Where traces go (default: OUTPUT_DIR/profiler).")
    profile_memory: bool = _arg(False, "Profiler: also record tensor allocations (bigger traces).")
    profile_record_shapes: bool = _arg(False, "Profiler: record operator input shapes.")
    profile_with_stack: bool = _arg(False, "Profiler: record Python stacks (much bigger traces).")
    plots: bool = _arg(True, "Loss, learning-rate and metric PNG plots after the run (--no_plots: none).")

    def __post_init__(self):
        if str(self.profile_steps).strip().lower() in ("", "none", "null"):  # None too
            self.profile_steps = self.profile_window = None
        else:  # ValueError -> one-line RecipeError in parse_args
            self.profile_window = parse_steps(self.profile_steps)  # (first, last)


def parse_steps(spec: str | int) -> tuple[int, int]:
    """'20-25' -> (20, 25), '7' -> (7, 7): first and last optimizer step (1-based, inclusive) to profile."""
    parts = str(spec).strip().split("-")
    try:
        if len(parts) > 2:
            raise ValueError
        start, end = int(parts[0]), int(parts[-1])
    except ValueError:
        raise ValueError(f"profile_steps must look like '20-25' or '20', got {spec!r}") from None
    if start < 1 or end < start:
        raise ValueError(f"profile_steps must be FIRST-LAST with 1 <= FIRST <= LAST, got {spec!r}")
    return start, end


def tensorboard_available() -> bool:
    return importlib.util.find_spec("tensorboard") is not None or importlib.util.find_spec("tensorboardX") is not None


def resolve_report_to(report_to):
    """Normalise `report_to` (a list, or "tensorboard,wandb"); drop TensorBoard, with a warning, if not installed."""
    names = report_to if isinstance(report_to, (list, tuple)) else str(report_to or "none").split(",")
    names = [s for n in names if (s := str(n).strip(" []'\""))]  # also tolerates a YAML list read as its string form
    if "tensorboard" in names and not tensorboard_available():
        logger.warning("tensorboard is not installed: TensorBoard logging is off (pip install tensorboard).")
        names = [n for n in names if n != "tensorboard"]
    if not names or names == ["none"]:
        return "none"
    return names[0] if len(names) == 1 else names


def set_checkpointing(t, on: bool) -> None:
    """Gradient checkpointing on or off after TrainingArguments' __post_init__, under both names (5.2x: the new one)."""
    t.gradient_checkpointing = on
    if hasattr(t, "activation_checkpointing"):
        t.activation_checkpointing = on


def compile_cache_dir() -> str:
    """Where torch.compile's caches live: TORCHINDUCTOR_CACHE_DIR, else under the Hugging Face cache (inductor's own
    default, /tmp, goes with the machine or container). Inductor keys each artifact by torch, Triton, GPU and graph."""
    from huggingface_hub.constants import HF_HOME

    return os.environ.get("TORCHINDUCTOR_CACHE_DIR") or os.path.join(HF_HOME, "vit_recipes", "torch_compile")


def compile_regions(t, regions: bool = True, after_init: bool = False) -> None:
    """Turn on (regional) torch.compile in TrainingArguments `t`, from __post_init__ or, `after_init`, once the plan
    knows the device and steps."""
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = compile_cache_dir()
    if after_init and t.tf32 is not False and (t.tf32 is None and not t.fp16 or t.bf16) and is_torch_tf32_available():
        # TrainingArguments' __post_init__ (run with compilation off) turns TF32 on for compiled runs: its rule, now
        enable_tf32(True)
        align_matmul_precision()
    if regions:  # the Trainer builds accelerate's TorchDynamoPlugin without this option; the plugin reads it here
        os.environ["ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION"] = "true"
        t.torch_compile, t.torch_compile_regions = True, True
        t.torch_compile_backend = t.torch_compile_backend or "inductor"
    if not t.dataloader_drop_last:  # a recompile every epoch costs tens of seconds on a GPU: dropping costs less
        logger.info(
            "torch.compile: dropping each epoch's incomplete last training batch (a new shape would recompile)"
        )
        t.dataloader_drop_last = True


@dataclass
class RecipeTrainingArguments(TrainingArguments):
    """`TrainingArguments` with defaults suited to image classification."""

    _argument_group_name = "training (transformers TrainingArguments, with these defaults)"
    overwrite_output_dir: bool = _arg(False, "Replace an output_dir that holds a different or finished run.")
    remove_unused_columns: bool = _arg(False, "Keep pixel columns (see TrainingArguments).")
    eval_strategy: str = _arg("epoch", "When to evaluate: 'no', 'steps' or 'epoch'.")
    save_strategy: str = _arg("epoch", "When to checkpoint: 'no', 'steps' or 'epoch'.")
    save_total_limit: int | None = _arg(2, "Checkpoints kept on disk.")
    logging_steps: float = _arg(10, "Log every N steps.")
    dataloader_num_workers: int = _arg(
        help_text="DataLoader workers (default: half the cores, at most 8, where they only slice decoded arrays; "
        "decoding per batch: this process's share of the cores).",
        default_factory=_default_workers,
    )
    dataloader_persistent_workers: bool = _arg(True, "Keep DataLoader workers alive between epochs.")
    dataloader_prefetch_factor: int | None = _arg(4, "Batches prefetched per worker.")
    ddp_find_unused_parameters: bool | None = _arg(
        False, "DDP's per-step search for unused parameters: off, as ViT (full, LoRA or head only) uses every one."
    )
    accelerator_config: dict | str | None = _arg(
        help_text="accelerate's settings (JSON, see TrainingArguments). non_blocking by default: batches reach the GPU "
        "from pinned memory without a host synchronisation per step (off on CPUs).",
        default_factory=lambda: {"non_blocking": True},
    )
    gradient_checkpointing: bool | None = _arg(
        None,
        "Recompute each layer's activations in the backward pass: far less GPU memory for about a third more compute. "
        "Unset: on only where the memory estimate (tools/advise.py) says the batch does not fit the GPU without it, "
        "in one line either way; off on CPUs.",
    )
    checkpointing_by_memory: bool = field(default=False, init=False, repr=False)  # unset: the plan decides (memory)
    gradient_checkpointing_kwargs: dict | str | None = _arg(
        help_text="Non-reentrant by default: works with frozen inputs (LoRA) and every strategy.",
        default_factory=lambda: {"use_reentrant": False},
    )
    torch_compile_regions: bool | None = _arg(
        None,
        "torch.compile each transformer layer (compiled once, reused for every layer: accelerate's regional "
        "compilation, also under DeepSpeed and FSDP2) and the rest of the model apart, instead of the whole model at "
        "once. Implies --torch_compile; --torch_compile_backend/--torch_compile_mode apply. Unset: on when training "
        "on a CUDA GPU under a strategy that allows it and the run repays the compile (1,000+ planned steps, or 400+ "
        "where the compile cache holds this model and batch from an earlier compiled run on this machine); false: "
        "eager. A compilation that fails runs eagerly, with one warning.",
    )
    layer_decay: float = _arg(
        1.0,
        "Layer-wise learning-rate decay (BEiT, MAE, timm): layer i of L trains at learning_rate * layer_decay ** "
        "(L + 1 - i), the embeddings as layer 0 and the head as L + 1. 1 disables; ViT-style stacks only.",
    )
    ema_decay: float = _arg(
        0.0,
        "Keep an exponential moving average of the trained weights (timm's ModelEmaV3), updated after every "
        "optimizer step, saved in each checkpoint; the model evaluated and saved at the end is the average. "
        "0 disables; e.g. 0.999 for a few thousand steps. Not with ZeRO-3 or FSDP.",
    )
    fp8: bool = _arg(
        False,
        "Train the transformer's matmuls in FP8 (a GPU with FP8 tensor cores: H100, H200, L40S; one GPU or DDP). "
        "Weights, optimizer and saved model stay as they are; the head stays in bf16. --fp8_backend picks the kernels.",
    )
    fp8_backend: str = _arg(
        "torchao",
        "torchao: float8 linear layers, LoRA's base layers too, emulated on the CPU (pip install torchao). "
        "transformer_engine: NVIDIA Transformer Engine, LayerNorm fused into each FP8 matmul, eager, ViT models, "
        "CUDA only (pip install transformer-engine[pytorch]). docs/benchmarks.md says where each is faster.",
        choices=["torchao", "transformer_engine"],
    )
    report_to: None | str | list[str] = _arg(
        "tensorboard",
        "Trackers, comma-separated: tensorboard (default: local files under OUTPUT_DIR/runs), trackio, wandb "
        "(WANDB_MODE=offline needs no account), or none.",
    )

    def __post_init__(self):
        asked = (self.gradient_checkpointing, getattr(self, "activation_checkpointing", None))  # the new name: 5.2x
        self.checkpointing_by_memory = asked == (None, None)
        # The `activation_checkpointing*` names where they exist (5.2x, where the old ones warn); mirrored back later.
        for old in ("gradient_checkpointing", "gradient_checkpointing_kwargs"):
            new = old.replace("gradient_", "activation_")
            if hasattr(self, new) and getattr(self, new) is None and getattr(self, old) is not None:
                setattr(self, new, getattr(self, old))
                setattr(self, old, None)
        if self.dataloader_num_workers == 0:
            self.dataloader_persistent_workers, self.dataloader_prefetch_factor = False, None
        self.report_to = resolve_report_to(self.report_to)
        if self.torch_compile or self.torch_compile_regions:
            compile_regions(self, regions=bool(self.torch_compile_regions))
        if self.do_predict and not (self.do_train or self.do_eval):
            # TrainingArguments turns do_eval on for any eval_strategy: a run that only predicts evaluates nothing.
            self.eval_strategy = "no"
        super().__post_init__()
        if self.gradient_checkpointing is None:  # transformers before 5.2x keeps None: a bool until the plan decides
            self.gradient_checkpointing = False
        align_matmul_precision()


def align_matmul_precision() -> None:
    """Give torch's legacy TF32 setting ("high") the value transformers set through the new API (compiling on a GPU):
    max-autotune reads the legacy `torch.get_float32_matmul_precision()`, which raises on the mix."""
    if getattr(torch.backends, "fp32_precision", None) == "tf32":
        torch.set_float32_matmul_precision("high")


ARGUMENT_CLASSES = (  # one --help group each, in this order
    ModelArguments, DataArguments, AugmentationArguments, LoraArguments, ObservabilityArguments, RecipeTrainingArguments
)  # fmt: skip


def _coerce(key: str, value: Any, action: argparse.Action, source: str) -> Any:
    """Give a recipe value the type its flag would have (YAML reads `5e-5` as a string, for one)."""
    if value is None or not callable(action.type):
        return value
    if action.nargs in ("+", "*") and isinstance(value, list):
        return [_coerce(key, v, argparse.Namespace(type=action.type, nargs=None), source) for v in value]
    if isinstance(value, bool) and action.type in (int, float):
        raise RecipeError(f"{source}: '{key}' must be a number, got {value!r}")
    plain = action.type in (int, float, str)
    if not (plain or isinstance(value, str)):
        return value
    try:
        coerced = action.type(value)
    except (TypeError, ValueError) as err:
        if plain:
            raise RecipeError(f"{source}: '{key}' must be {action.type.__name__}, got {value!r}") from None
        raise RecipeError(f"{source}: '{key}' has a bad value {value!r}: {err}") from None
    if action.type is int and isinstance(value, float) and coerced != value:
        raise RecipeError(f"{source}: '{key}' must be a whole number, got {value!r}")
    return coerced


def load_recipe(path: str | os.PathLike, parser: HfArgumentParser) -> dict[str, Any]:
    """Read a YAML recipe and check every key against the parser's arguments."""
    path = Path(path)
    if not path.is_file():
        raise RecipeError(f"recipe file not found: {path}")
    try:
        values = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark is not None else ""
        raise RecipeError(f"recipe {path} is not valid YAML{where}: {getattr(err, 'problem', err)}") from None
    if values is None:
        return {}
    if not isinstance(values, dict):
        raise RecipeError(f"recipe {path} must be a mapping of argument: value, got {type(values).__name__}")
    actions = {a.dest: a for a in parser._actions if a.dest not in ("help", "config")}
    if (key := next((k for k in values if k not in actions), None)) is not None:  # the first unknown key
        close = difflib.get_close_matches(str(key), list(actions), n=1, cutoff=0.6)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        raise RecipeError(f"recipe {path}: unknown key '{key}'{hint}")
    return {key: _coerce(key, value, actions[key], f"recipe {path}") for key, value in values.items()}


@dataclass
class RunArguments:
    """Everything one run was asked for, one field per argument group."""

    model: ModelArguments
    data: DataArguments
    augment: AugmentationArguments
    lora: LoraArguments
    observe: ObservabilityArguments
    training: RecipeTrainingArguments
    recipe: str | None  # the --config file, if any


# TrainingArguments that --help lists (what image classification uses); the other ~70 still parse, --help says so.
_LISTED_TRAINER_FLAGS = {
    "output_dir", "do_train", "do_eval", "do_predict", "eval_strategy", "eval_steps", "per_device_train_batch_size",
    "per_device_eval_batch_size", "gradient_accumulation_steps", "learning_rate", "weight_decay", "max_grad_norm",
    "num_train_epochs", "max_steps", "lr_scheduler_type", "warmup_steps", "warmup_ratio", "optim", "seed", "bf16",
    "fp16", "logging_steps", "save_strategy", "save_steps", "save_total_limit", "save_only_model",
    "resume_from_checkpoint", "load_best_model_at_end", "metric_for_best_model", "greater_is_better",
    "label_smoothing_factor", "dataloader_num_workers", "dataloader_drop_last", "gradient_checkpointing",
    "torch_compile", "deepspeed", "use_cpu", "report_to", "run_name", "push_to_hub", "hub_model_id", "hub_strategy",
    "hub_token", "hub_private_repo", "overwrite_output_dir",
}  # fmt: skip


def parse_args(
    argv: list[str] | None = None, before_process_group: Callable[[bool], None] | None = None
) -> RunArguments:
    """Parse recipe + command line (the command line wins); `before_process_group(use_cpu)` runs before building
    `TrainingArguments`, which starts a launch's process group."""
    argv = _attach_negative_numbers(sys.argv[1:] if argv is None else list(argv))
    parser = HfArgumentParser(ARGUMENT_CLASSES)
    parser.add_argument("--config", default=None, help="YAML recipe whose keys are any of the arguments below.")
    theirs = {f.name for f in fields(TrainingArguments)}
    for action in parser._actions:
        if action.dest in theirs and action.dest not in _LISTED_TRAINER_FLAGS:
            action.help = argparse.SUPPRESS
    parser.epilog = (
        "Every other flag of transformers' TrainingArguments is accepted too (not listed here: text generation, "
        "tokens, hyperparameter search, ...); transformers' TrainingArguments documentation lists them."
    )
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config", default=None)
    for each in (parser, pre):  # argparse prints the whole usage (~100 lines) above its one line: ours is that line
        each.error = _one_line_error
    known, _ = pre.parse_known_args(argv)
    if known.config:
        parser.set_defaults(**load_recipe(known.config, parser))
    namespace, unknown = parser.parse_known_args(args=argv)
    if unknown:
        flags = [a.option_strings[0] for a in parser._actions if a.option_strings]
        close = difflib.get_close_matches(unknown[0].split("=")[0], flags, n=1, cutoff=0.6)
        hint = f" (did you mean {close[0]}?)" if close else ""
        raise RecipeError(f"unknown argument {unknown[0]}{hint}; `--help` lists them all")
    if before_process_group is not None:
        before_process_group(bool(namespace.use_cpu))
    values = vars(namespace)
    deepspeed = values.get("deepspeed")
    if isinstance(deepspeed, str) and os.path.isfile(deepspeed):  # TrainingArguments would parse it without its name
        try:
            json.loads(Path(deepspeed).read_text())
        except json.JSONDecodeError as err:
            raise RecipeError(f"--deepspeed {deepspeed} is not valid JSON: {err}") from None
    try:
        parsed = [cls(**{f.name: values[f.name] for f in fields(cls) if f.init}) for cls in ARGUMENT_CLASSES]
    except ValueError as err:  # raised by TrainingArguments.__post_init__ on inconsistent values
        raise RecipeError(f"invalid arguments: {first_line(err)}") from None
    args = RunArguments(*parsed, recipe=known.config)
    # Asked for (flag or recipe) or the default: the per-batch decoding path raises only a default (decoding.py).
    args.training.workers_given = any(a.split("=")[0] == "--dataloader_num_workers" for a in argv) or (
        known.config is not None and parser.get_default("dataloader_num_workers") != _default_workers()
    )
    if args.training.hub_token:  # TrainingArguments is pickled into every checkpoint: a token there would leak
        os.environ["HF_TOKEN"] = args.training.hub_token
        args.training.hub_token = None
    validate_arguments(args)
    return args


def _one_line_error(message: str):
    """argparse's own errors (a value of the wrong type, a flag without its value) as one RecipeError line."""
    raise RecipeError(f"{message} (`--help` lists the arguments)")


_NEGATIVE_NUMBER = re.compile(r"^-(\d|\.\d|inf$)")


def _attach_negative_numbers(argv: list[str]) -> list[str]:
    """`--flag -1e-3` -> `--flag=-1e-3`: argparse would read the value as a flag, not pass it to its range check."""
    out: list[str] = []
    for token in argv:
        if out and out[-1].startswith("--") and "=" not in out[-1] and _NEGATIVE_NUMBER.match(token):
            out[-1] = f"{out[-1]}={token}"
        else:
            out.append(token)
    return out


_RANGES = (  # name, RunArguments field, interval; None (unset) passes
    ("validation_split_percentage", "data", "(0, 1)"), ("crop_scale_min", "augment", "(0, 1]"),
    ("hflip_prob", "augment", "[0, 1]"), ("eval_crop_pct", "augment", "(0, 1]"),
    ("multi_label_threshold", "data", "(0, 1)"), ("patch_dropout", "augment", "[0, 1)"),
    ("label_smoothing_factor", "training", "[0, 1)"), ("random_erasing", "augment", "[0, 1]"),
    ("drop_path_rate", "model", "[0, 1)"), ("layer_decay", "training", "(0, 1]"), ("ema_decay", "training", "[0, 1)"),
)  # fmt: skip


def validate_arguments(args: RunArguments) -> None:
    """Reject values that would only fail (or silently misbehave) later, in one line each."""
    model, data, aug, train = args.model, args.data, args.augment, args.training
    for name in ("learning_rate", "per_device_train_batch_size", "per_device_eval_batch_size",
                 "gradient_accumulation_steps"):  # fmt: skip
        if not getattr(train, name) > 0:  # not `<= 0`: NaN fails every check
            raise RecipeError(f"{name} must be > 0, got {getattr(train, name)}")
    if train.max_steps <= 0 and train.num_train_epochs > 1e5:  # an ETA in years, said nowhere
        raise RecipeError(f"num_train_epochs {train.num_train_epochs:g} is over 100,000 epochs: give a real count")
    if not train.save_steps > 0:  # the Trainer takes 0 (eval_steps 0 falls back to logging_steps; this does not)
        raise RecipeError(
            f"save_steps must be > 0 (a step count, or below 1 a fraction of the run), got {train.save_steps:g}"
        )
    if not (train.max_steps > 0 or train.num_train_epochs > 0):
        raise RecipeError("num_train_epochs must be > 0 (or set max_steps)")
    for name, group, interval in _RANGES:
        value, (lo, hi) = getattr(getattr(args, group), name), map(float, interval[1:-1].split(","))
        above = value is None or (lo < value if interval[0] == "(" else lo <= value)  # NaN fails both
        if not (above and (value is None or (value < hi if interval[-1] == ")" else value <= hi))):
            raise RecipeError(f"{name} must be in {interval}, got {value}")
    if train.ema_decay and train.load_best_model_at_end:
        raise RecipeError(
            "--ema_decay with --load_best_model_at_end: the best checkpoint is chosen on the raw weights and the "
            "saved model would be their average; use one of them"
        )
    if data.decode_images not in ("auto", "once", "per_batch"):
        raise RecipeError(f"decode_images must be auto, once or per_batch, got {data.decode_images!r}")
    if data.streaming:  # a stream has no rows to count, sample or weigh before training, and no copy to decode into
        refused = {"--decode_images once": data.decode_images == "once", "--max_train_samples": data.max_train_samples,
                   f"--class_weights {aug.class_weights}": aug.class_weights != "none",
                   "--problem_type multi_label_classification": data.problem_type == "multi_label_classification"}  # fmt: skip
        if asked := [flag for flag, on in refused.items() if on]:
            raise RecipeError(f"--streaming cannot be combined with {asked[0]} (a stream is read once, in order)")
        if data.shuffle_buffer_size < 0:
            raise RecipeError(f"shuffle_buffer_size must be >= 0, got {data.shuffle_buffer_size}")
    if not (data.storage_size is None or data.storage_size > 0):
        raise RecipeError(f"storage_size must be > 0, got {data.storage_size}")
    if aug.auto_augment not in ("none", "randaugment", "trivialaugment"):
        raise RecipeError(f"auto_augment must be none, randaugment or trivialaugment, got {aug.auto_augment!r}")
    if not (0 <= aug.randaugment_magnitude <= 30 and aug.randaugment_num_ops >= 1):  # torchvision's 31 bins
        raise RecipeError("randaugment_magnitude must be in [0, 30] and randaugment_num_ops >= 1")
    if not (aug.mixup_alpha >= 0 and aug.cutmix_alpha >= 0):
        raise RecipeError("mixup_alpha and cutmix_alpha must be >= 0")
    if train.fp8_backend != "torchao" and not (train.fp8 and train.fp8_backend == "transformer_engine"):
        raise RecipeError(f"--fp8_backend {train.fp8_backend}: use torchao or transformer_engine, with --fp8 true")
    if data.problem_type not in (None, "single_label_classification", "multi_label_classification"):
        raise RecipeError(
            f"problem_type must be single_label_classification or multi_label_classification, got {data.problem_type!r}"
        )
    if aug.class_weights not in ("none", "balanced", "balanced_sampler"):
        raise RecipeError(f"class_weights must be none, balanced or balanced_sampler, got {aug.class_weights!r}")
    if not (model.model_name_or_path or model.config_name):
        raise RecipeError("set --model_name_or_path to fine-tune, or --config_name to train from scratch")
    if not data.dataset_name and (train.do_train or train.do_eval):
        raise RecipeError("--dataset_name is required: a preset (cifar100, food101, beans), a Hub id or a local path")
    if not (data.dataset_name or model.model_name_or_path):
        raise RecipeError("predicting without --dataset_name needs a trained model: pass --model_name_or_path")
    if train.do_predict and data.predict_images is None and data.dataset_name is None:
        raise RecipeError("--do_predict needs --predict_images (a folder of images) or a dataset with a test split")
    hub_strategy = str(getattr(train.hub_strategy, "value", train.hub_strategy))
    if args.lora.merge_adapter and train.push_to_hub and hub_strategy != "end":
        raise RecipeError(
            "--merge_adapter with --push_to_hub needs --hub_strategy end: pushing every save would put adapter files "
            "into the repository of the merged model"
        )
    if args.lora.method != "full" and not model.model_name_or_path:
        raise RecipeError(
            f"--{'use_peft' if args.lora.use_peft else 'freeze_backbone'} needs pretrained weights "
            "(--model_name_or_path): a frozen randomly initialised backbone cannot learn"
        )


def run_config(args: RunArguments) -> dict[str, Any]:
    """The settings that define *which* run an output directory holds (used to refuse mixing two runs)."""
    config = {key: getattr(args.model, key) for key in ("model_name_or_path", "config_name", "config_overrides")}
    config.update(dataset_name=args.data.dataset_name, dataset_config_name=args.data.dataset_config_name)
    config["seed"] = args.training.seed
    if args.data.problem_type:  # a multi-label run on single-label data is another run
        config["problem_type"] = args.data.problem_type
    if args.lora.use_peft:  # LoRA and head-only runs are other runs than full fine-tuning
        config.update(use_peft=True, lora_r=args.lora.lora_r, lora_target_modules=args.lora.lora_target_modules)
    elif args.lora.freeze_backbone:
        config["freeze_backbone"] = True
    return config

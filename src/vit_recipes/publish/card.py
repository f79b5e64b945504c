"""The model card: Hub metadata (model-index included) and a body that tells how to reproduce the run."""

import contextlib
import importlib.metadata
import logging
import os
import re
import shlex
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import torch
from huggingface_hub import EvalResult, ModelCard, ModelCardData, try_to_load_from_cache

from ..core.hub import redact
from ..core.launch import env_int
from ..data.data import imbalance, resolve_source
from ..data.streaming import stream_rows

logger = logging.getLogger(__name__)

_NOISE = re.compile(r"runtime|per_second|epoch|mem_|flos")


@dataclass
class CardInfo:
    model_name: str  # repo name or output dir name
    base_model: str | None  # Hub id fine-tuned; None from scratch or from a local path
    base_model_source: str | None  # what was actually loaded (path or id), shown in the body
    dataset_id: str  # Hub dataset id or local path
    dataset_is_hub: bool
    label_names: list[str]
    validation_metrics: dict[str, float]  # keys may carry eval_/test_ prefixes
    test_metrics: dict[str, float]  # empty without a test split: model-index then reports validation
    hyperparameters: dict[str, object]
    command: str
    recipe: str | None
    recipe_text: str | None
    strategy: str
    hardware: str
    throughput: float | None  # training images/s
    per_class_markdown: str | None
    confusion_matrix_file: str | None  # relative to the output dir
    extra_tags: list[str] = field(default_factory=list)
    library_name: str = "transformers"
    data_notes: list[str] = field(default_factory=list)  # what the run changed in the data (data.ImageSplits.notes)
    repo_id: str = "<user>/model"  # the Hub repo: --hub_model_id, or a placeholder to replace when not pushing
    eval_history: list[dict] = field(default_factory=list)  # the Trainer's evaluation log entries, in order
    versions: dict[str, str] = field(default_factory=dict)  # library -> version the run used
    limitations: list[str] = field(default_factory=list)
    multi_label: bool = False  # any number of labels per image (sigmoid scores), not one class
    imbalance: tuple[int, int] | None = None  # (fewest, most) train images per class, when imbalanced (data.imbalance)
    worst_recall: list[tuple[str, float]] = field(default_factory=list)  # the weakest classes, lowest recall first
    license: str | None = None  # a Hub licence id; None: the card claims none
    source: str | None = None  # the code that ran: repository URL and commit, when run from a git checkout


def _metric_spec(key: str) -> dict | None:
    """A metric key (without split prefix) as model-index `EvalResult` fields; None for a metric it does not know."""
    if key == "accuracy":
        return {"metric_type": "accuracy", "metric_name": "Accuracy"}
    if key == "mean_average_precision":
        return {"metric_type": "mean_average_precision", "metric_name": "mAP"}
    if key == "subset_accuracy":
        name = "Subset accuracy (exact match)"
        return {"metric_type": "accuracy", "metric_name": name, "metric_args": {"subset": True}}
    if m := re.fullmatch(r"top_?(\d+)_?accuracy", key):  # the Hub's metric ids are evaluate's: accuracy, with its k
        return {"metric_type": "accuracy", "metric_name": f"Top-{m[1]} accuracy", "metric_args": {"top_k": int(m[1])}}
    if m := re.fullmatch(r"(f1|precision|recall)(?:_(macro|micro|weighted))?", key):
        average = m[2] or "macro"
        name = f"{m[1].capitalize()} ({average})"
        return {"metric_type": m[1], "metric_name": name, "metric_args": {"average": average}}
    return None


def _strip(metrics: dict[str, float]) -> dict[str, float]:
    out = {}
    for key, value in (metrics or {}).items():
        key = re.sub(r"^(eval|test|validation|val|predict)_", "", key)
        try:
            value = float(value)
        except (TypeError, ValueError):
            continue
        if not _NOISE.search(key) and value == value:  # drops timing noise and NaN
            out[key] = value
    return out


def _table(header: tuple[str, ...], rows: list[tuple]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    cells = [[str(c).replace("|", "\\|").replace("\n", " ") for c in row] for row in rows]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in cells])


def _summary(info: CardInfo, validation: dict, test: dict) -> str:
    origin = "trained from scratch (no pre-trained weights)"
    if info.base_model:
        origin = f"a fine-tuned version of [{info.base_model}](https://huggingface.co/{info.base_model})"
    elif info.base_model_source:
        origin = f"fine-tuned from the local checkpoint `{info.base_model_source}`"
    data = f"the local dataset `{info.dataset_id}`"
    if info.dataset_is_hub:
        data = f"the [{info.dataset_id}](https://huggingface.co/datasets/{info.dataset_id}) dataset"
    count = len(info.label_names)
    names = ", ".join(info.label_names[:10]) + (", ..." if count > 10 else "")
    task = f"classify images into {count} classes"
    if info.multi_label:
        task = f"tag images with any of {count} labels (multi-label)"
    text = f"This model is {origin}, trained on {data} to {task} ({names})."
    if info.multi_label:
        split, metrics = ("test", test) if "mean_average_precision" in test else ("validation", validation)
        if "mean_average_precision" in metrics:
            text += f" It reaches **{metrics['mean_average_precision']:.4f}** mAP on the {split} split."
    elif info.imbalance and "recall_macro" in (metrics := test or validation):
        split = "test" if test else "validation"
        weakest = ", ".join(f"{label} {recall:.0%}" for label, recall in info.worst_recall)
        text += (
            f" Its classes are imbalanced in train ({info.imbalance[0]} to {info.imbalance[1]} images per class), so "
            f"balanced figures come first: on the {split} split it reaches **{metrics['recall_macro']:.2%}** balanced "
            f"accuracy (mean per-class recall) and {metrics['f1_macro']:.4f} macro F1"
            + (f"; plain accuracy {metrics['accuracy']:.2%}" if "accuracy" in metrics else "")
            + (f". Weakest classes' recall: {weakest}." if weakest else ".")
        )
    elif "accuracy" in test:
        text += f" It reaches **{test['accuracy']:.2%}** top-1 accuracy on the test split."
    elif "accuracy" in validation:
        text += f" It reaches **{validation['accuracy']:.2%}** top-1 accuracy on the validation split (no test split)."
    return text


def _history_row(entry: dict) -> dict:
    """One evaluation log entry as table cells: epoch, step, validation loss and the metrics model-index knows."""
    row = {"Epoch": f"{entry.get('epoch', 0):.2f}", "Step": entry.get("step", "-")}
    for key, value in _strip(entry).items():
        if key == "loss" or _metric_spec(key):
            row["Validation loss" if key == "loss" else _metric_spec(key)["metric_name"]] = f"{value:.4f}"
    return row


def _leading(info: CardInfo, validation: dict, test: dict) -> tuple[str, ...]:
    """The metrics that come first: balanced ones when train is imbalanced (the summary's rule; plain accuracy
    flatters a model that ignores small classes), else none."""
    balanced = info.imbalance and not info.multi_label and "recall_macro" in (test or validation)
    return ("recall_macro", "f1_macro") if balanced else ()


def _in_order(keys, lead: tuple[str, ...]) -> list[str]:
    """`lead` first, then the metrics model-index knows, the loss last."""
    rank = lambda k: (lead.index(k) if k in lead else len(lead), _metric_spec(k) is None, k == "loss")  # noqa: E731
    return sorted(keys, key=rank)


def _body(info: CardInfo, validation: dict, test: dict) -> str:
    parts = [f"# {info.model_name}", _summary(info, validation, test)]
    lead = _leading(info, validation, test)
    keys = _in_order(dict.fromkeys([*validation, *test]), lead)
    label = {k: spec["metric_name"] if (spec := _metric_spec(k)) else k.replace("_", " ").capitalize() for k in keys}
    if lead:
        label["recall_macro"] = "Balanced accuracy (mean per-class recall)"
    rows = [(label[k], *(f"{m[k]:.4f}" if k in m else "-" for m in (validation, test))) for k in keys]
    parts.append("## Results\n\n" + _table(("Metric", "Validation", "Test"), rows))
    if not test:
        parts.append("There is no test split: the model-index metadata reports the validation split.")
    if rows := [_history_row(e) for e in info.eval_history if "eval_loss" in e]:
        keys = [k for k in dict.fromkeys(k for r in rows for k in r) if k not in ("Epoch", "Step")]
        table = [(r["Epoch"], r["Step"], *(r.get(k, "-") for k in keys)) for r in rows]
        parts.append("## Evaluation during training\n\n" + _table(("Epoch", "Step", *keys), table))
    if info.data_notes:
        parts.append("## Data\n\nWhat this run did to the dataset:\n\n" + "\n".join(f"- {n}" for n in info.data_notes))
    code = f"From {info.source}:\n\n" if info.source else ""
    parts.append(f"## Reproduce\n\n{code}```bash\n{info.command}\n```")
    if info.recipe or info.recipe_text:
        parts.append(f"## Recipe\n\n`{info.recipe}`" if info.recipe else "## Recipe")
    if info.recipe_text:
        parts.append(f"```yaml\n{info.recipe_text.rstrip()}\n```")
    if info.hyperparameters:
        parts.append("## Hyperparameters\n\n" + _table(("Hyperparameter", "Value"), [*info.hyperparameters.items()]))
    setup = [f"- Strategy: {info.strategy}", f"- Hardware: {info.hardware}"]
    if info.throughput:
        setup.append(f"- Training throughput: {info.throughput:,.1f} images/s")
    if info.base_model_source and info.base_model_source != info.base_model:
        setup.append(f"- Weights loaded from: `{info.base_model_source}`")
    parts.append("## Training setup\n\n" + "\n".join(setup))
    if info.versions:
        parts.append("## Framework versions\n\n" + "\n".join(f"- {k} {v}" for k, v in info.versions.items()))
    if info.limitations:
        parts.append("## Limitations\n\n" + "\n".join(f"- {line}" for line in info.limitations))
    if info.per_class_markdown:
        parts.append(info.per_class_markdown.strip())  # its own "## Per-class accuracy (split)" section
    if info.confusion_matrix_file:
        parts.append(f"## Confusion matrix\n\n![Confusion matrix]({info.confusion_matrix_file})")
    parts.append("## How to use")
    if (repo := info.repo_id).startswith("<user>/"):
        parts.append(f"Not pushed by this run: replace `{repo}` with the repo you push it to, or a local path.")
    code = f'from transformers import pipeline\n\nclassifier = pipeline("image-classification", model="{repo}")\n'
    if info.multi_label:  # the pipeline returns the 5 best labels unless asked for all: each is an independent sigmoid
        count = len(info.label_names)
        parts.append(f"Each label gets its own sigmoid score: pass `top_k={count}` to see all {count} of them.")
    if info.library_name == "peft":  # the base with this repo's labels, then the adapter (docs/lora.md)
        base = info.base_model or info.base_model_source or "BASE_MODEL"
        parts.append(
            f"This repo holds a LoRA adapter for `{base}` (the classifier head included): loading it needs `pip install peft`."
        )
        code = (
            "from peft import PeftModel\n"
            "from transformers import AutoConfig, AutoModelForImageClassification, pipeline\n\n"
            f'config = AutoConfig.from_pretrained("{base}")\n'
            f'labels = AutoConfig.from_pretrained("{repo}")\n'
            "config.num_labels, config.id2label, config.label2id = labels.num_labels, labels.id2label, labels.label2id\n"
            f'base = AutoModelForImageClassification.from_pretrained("{base}", config=config, '
            "ignore_mismatched_sizes=True)\n"
            f'model = PeftModel.from_pretrained(base, "{repo}").merge_and_unload()\n'
            f'classifier = pipeline("image-classification", model=model, image_processor="{repo}")\n'
        )
    parts.append(f'```python\n{code}print(classifier("path/to/image.jpg"))\n```')
    return "\n\n".join(parts) + "\n"


def build_model_card(info: CardInfo) -> ModelCard:
    validation, test = _strip(info.validation_metrics), _strip(info.test_metrics)
    split, metrics = ("test", test) if test else ("validation", validation)  # model-index reports one split
    dataset = info.dataset_id if info.dataset_is_hub else Path(info.dataset_id).name or info.dataset_id
    task = {"task_type": "image-classification", "task_name": "Image Classification", "dataset_split": split}
    eval_results = [  # in the table's order: balanced figures first when train is imbalanced
        EvalResult(**task, dataset_type=dataset, dataset_name=dataset, metric_value=metrics[key], **spec)
        for key in _in_order(metrics, _leading(info, validation, test))
        if (spec := _metric_spec(key))
    ]
    if info.library_name == "peft" and not info.base_model:
        logger.warning("PEFT model card without a Hub base_model: the Hub will not link the adapter to its base")
    multi = ["multi-label-classification"] if info.multi_label else []
    strategy = info.strategy if info.strategy != "single" else None  # one device is no strategy to tag
    tags = list(dict.fromkeys(["image-classification", *multi, "vision", "vit", strategy, *info.extra_tags]))
    name = info.model_name if info.repo_id.startswith("<user>/") else info.repo_id  # model-index: never a placeholder
    data = ModelCardData(
        library_name=info.library_name,
        license=info.license,
        pipeline_tag="image-classification",
        base_model=info.base_model or None,
        datasets=[info.dataset_id] if info.dataset_is_hub else None,
        metrics=list(dict.fromkeys(r.metric_type for r in eval_results)) or None,
        tags=[t for t in tags if t],
        model_name=name if eval_results else None,
        eval_results=eval_results or None,
    )
    # Redact the whole text (YAML included): the command line and recipe can carry a token.
    return ModelCard(redact(f"---\n{data.to_yaml()}\n---\n\n{_body(info, validation, test)}"))


def write_model_card(info: CardInfo, output_dir: str) -> str:
    path = Path(output_dir) / "README.md"
    build_model_card(info).save(path)  # creates output_dir if need be
    return str(path)


def hardware_description() -> str:
    """E.g. "2 x NVIDIA H200" (one GPU per process) or "CPU (16 cores)"."""
    processes = max(1, env_int("WORLD_SIZE"))
    with contextlib.suppress(Exception):  # a broken driver must not cost the model card
        if torch.cuda.is_available():
            return f"{processes} x {torch.cuda.get_device_name()}"
        if torch.backends.mps.is_available():
            return "Apple silicon GPU (MPS)"
    extra = f", {processes} processes" if processes > 1 else ""
    return f"CPU ({os.cpu_count() or 1} cores{extra})"


def reproduce_command(strategy, argv: list[str]) -> str:
    """The command that runs this again: the launcher and its config file, without the launcher's --local_rank."""
    by_deepspeed = any(a.startswith("--local_rank") for a in argv)
    argv = [a for a in argv if not a.startswith("--local_rank")]
    config = strategy.spec.accelerate_config
    if by_deepspeed:
        nodes = f" --num_nodes {strategy.nodes}" if strategy.nodes > 1 else ""
        launcher = f"deepspeed --num_gpus {strategy.processes_per_node}{nodes}"
    elif config and (strategy.world_size > 1 or strategy.from_accelerate):
        launcher = f"accelerate launch --config_file {config} --num_processes {strategy.world_size}"
    else:
        launcher = "python"
    return " ".join([launcher, "run_image_classification.py", *map(shlex.quote, argv)])


def _versions(strategy, lora: bool) -> dict[str, str]:
    names = ["transformers", "torch", "datasets", "accelerate"] + ["deepspeed"] * strategy.deepspeed + ["peft"] * lora
    found = {}
    for name in names:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            found[name] = importlib.metadata.version(name)
    return found


def _limitations(splits, dataset: str, evaluated: str | None) -> list[str]:
    count = len(splits.label_names)
    rows = stream_rows(splits.train) if splits.train is not None else None  # a stream: its metadata's count, if any
    trained = (f"{rows:,} images of {dataset}" if rows else f"a stream of {dataset}") if splits.train else dataset
    split = getattr(splits, evaluated, None) if evaluated else None
    scope = f"evaluated on its {evaluated} split ({len(split):,} images)" if split else "not evaluated"
    answers = f"It always answers with one of its {count} classes, also for an image that shows none of them."
    if splits.multi_label:
        answers = f"It scores each of the {count} labels on its own; a label counts as present above the threshold."
    lines = [f"Trained on {trained} and {scope}: how it does on images from other sources is not measured.", answers]
    if splits.storage_shape:
        size = "x".join(map(str, splits.storage_shape))
        lines.append(f"Images were stored at {size} pixels before training: it never saw finer detail than that.")
    if any("carved out of train" in note for note in splits.notes):
        lines.append("Validation images were carved out of train (see Data): they come from the same source as train.")
    return lines


def _license_of(model: str | None, cache_dir: str | None, revision: str) -> str | None:
    """The base model's licence from its card: a local folder's README.md, or the Hub's when cached (no download)."""
    if not model:
        return None
    local = Path(model).expanduser() / "README.md"
    with contextlib.suppress(Exception):  # no card, no cache, unreadable metadata: no licence claimed
        path = local if local.is_file() else try_to_load_from_cache(model, "README.md", cache_dir, revision)
        if isinstance(path, (str, Path)) and Path(path).is_file():
            return ModelCard.load(path).data.license
    return None


def _source() -> str | None:
    """Where the code came from: `<remote URL> at commit <sha>` when the script runs from a git checkout."""
    root = Path(__file__).resolve().parents[3]  # src/vit_recipes/publish/card.py -> the repository
    if not (root / ".git").exists():
        return None

    def git(*cmd: str) -> str:
        done = subprocess.run(["git", "-C", str(root), *cmd], capture_output=True, text=True, timeout=10)
        return done.stdout.strip() if done.returncode == 0 else ""

    with contextlib.suppress(Exception):  # no git installed, a broken checkout: no source line
        if commit := git("rev-parse", "HEAD"):
            url = re.sub(r"//[^/@]+@", "//", git("remote", "get-url", "origin"))  # no credentials in a card
            dirty = " (with uncommitted changes)" if git("status", "--porcelain", "--untracked-files=no") else ""
            return f"{url or 'a local checkout'} at commit {commit}{dirty}"
    return None


def card_info(args, plan, argv, splits, results, reports, finetune, images_per_second, history=()) -> CardInfo:
    model_source = args.model.model_name_or_path
    is_hub = lambda name: bool(name) and not os.path.exists(os.path.expanduser(name))  # noqa: E731
    dataset_id, _ = resolve_source(args.data.dataset_name or "")
    training = args.training
    hyperparameters = {
        "learning_rate": training.learning_rate, "per_device_train_batch_size": training.per_device_train_batch_size,
        "global_batch_size": plan.global_batch,
        "num_train_epochs": training.num_train_epochs if training.max_steps <= 0 else None,
        "max_steps": training.max_steps if training.max_steps > 0 else None,
        "lr_scheduler_type": str(getattr(training.lr_scheduler_type, "value", training.lr_scheduler_type)),
        "warmup_steps": training.warmup_steps, "weight_decay": training.weight_decay,
        "optimizer": str(getattr(training.optim, "value", training.optim)), "precision": plan.precision,
        "gradient_checkpointing": training.gradient_checkpointing,
        "torch_compile_regions": bool(training.torch_compile_regions),  # resolved: the GPU default decides
        "label_smoothing": training.label_smoothing_factor,
        "layer_decay": training.layer_decay if training.layer_decay < 1 else None,
        "drop_path_rate": args.model.drop_path_rate,
        "ema_decay": f"{training.ema_decay:g} (evaluated and saved: the average)" if training.ema_decay else None,
        "load_best_model_at_end": (training.load_best_model_at_end and f"best {training.metric_for_best_model}") or None,
        "class_weights": args.augment.class_weights,
        "multi_label_threshold": args.data.multi_label_threshold if splits.multi_label else None,
        **{name: getattr(args.augment, name) for name in ("crop_scale_min", "hflip_prob", "auto_augment",
            "mixup_alpha", "cutmix_alpha", "patch_dropout", "random_erasing")},
        "storage_size": "x".join(map(str, splits.storage_shape)), "seed": training.seed,
    }  # fmt: skip
    repo_id = training.hub_model_id or f"<user>/{os.path.basename(os.path.abspath(training.output_dir))}"
    licence = args.model.license or _license_of(model_source, args.model.cache_dir, args.model.model_revision)
    dataset_name = dataset_id if is_hub(dataset_id) else os.path.basename(os.path.abspath(dataset_id))
    prefixes = {"test": "test_", "validation": "eval_"}
    evaluated = next((split for split, p in prefixes.items() if any(k.startswith(p) for k in results)), None)
    return CardInfo(
        model_name=repo_id.split("/")[-1], repo_id=repo_id, base_model=model_source if is_hub(model_source) else None,
        base_model_source=model_source,  # None: trained from scratch
        dataset_id=dataset_name, dataset_is_hub=is_hub(dataset_id), label_names=splits.label_names,
        validation_metrics={k: v for k, v in results.items() if k.startswith("eval_")},
        test_metrics={k: v for k, v in results.items() if k.startswith("test_")},
        command=reproduce_command(plan.strategy, argv), recipe=args.recipe,
        recipe_text=Path(args.recipe).read_text() if args.recipe else None, strategy=plan.strategy.name,
        hardware=hardware_description(), throughput=images_per_second, per_class_markdown=reports.get("markdown"),
        confusion_matrix_file=os.path.basename(reports["confusion_matrix"]) if "confusion_matrix" in reports else None,
        multi_label=splits.multi_label, imbalance=imbalance(splits), worst_recall=reports.get("worst_recall", []),
        data_notes=list(splits.notes), eval_history=[e for e in history if "eval_loss" in e],
        versions=_versions(plan.strategy, args.lora.method != "full"),
        limitations=_limitations(splits, dataset_name, evaluated), license=licence, source=_source(),
        # hyperparameters, the method's included; LoRA adapters: library peft, tags
        **finetune.card_fields({k: v for k, v in hyperparameters.items() if v is not None}),
    )  # fmt: skip

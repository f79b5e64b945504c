"""Hugging Face Hub helpers: push pre-flight, one-line Hub errors, run description and the model card."""

from __future__ import annotations

import base64
import json
import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import huggingface_hub
from huggingface_hub import EvalResult, ModelCard, ModelCardData
from huggingface_hub.errors import (
    GatedRepoError,
    LocalEntryNotFoundError,
    OfflineModeIsEnabled,
    RepositoryNotFoundError,
)

from .errors import RecipeError

logger = logging.getLogger(__name__)

OFFLINE_HINT = (
    "to work offline pass local paths (--model_name_or_path ./checkpoint --dataset_name ./images) with "
    "HF_HUB_OFFLINE=1, or try `make demo`, which needs no network"
)
_TOKEN_PATTERN = re.compile(r"hf_[A-Za-z0-9]{20,}")


def _is_true(value: str | None) -> bool:
    return (value or "").strip().lower() in ("1", "true", "yes", "on")


def _offline_env() -> bool:
    # huggingface_hub reads HF_HUB_OFFLINE once at import: also look at the environment now.
    env = _is_true(os.environ.get("HF_HUB_OFFLINE")) or _is_true(os.environ.get("TRANSFORMERS_OFFLINE"))
    return env or bool(getattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False))


def _current_token() -> str | None:
    try:
        return huggingface_hub.get_token()
    except Exception:  # e.g. a failed OIDC exchange: treat as "no token", the caller says what to do
        return None


def check_push_ready(training_args) -> None:
    """Fail before any data loads if --push_to_hub could only fail after training."""
    if not getattr(training_args, "push_to_hub", False):
        return
    if _offline_env():
        raise RecipeError(
            "--push_to_hub cannot work with HF_HUB_OFFLINE=1: unset HF_HUB_OFFLINE or drop --push_to_hub "
            "(nothing was trained)"
        )
    if not (getattr(training_args, "hub_token", None) or _current_token()):
        raise RecipeError(
            "--push_to_hub needs a Hugging Face token: run `hf auth login` or set HF_TOKEN (nothing was trained)"
        )


def _causes(err: BaseException):
    """The exception and what it wraps (transformers re-raises Hub errors as OSError `from` the original)."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        yield err
        err = err.__cause__ or err.__context__


def _network_error_types() -> tuple[type[BaseException], ...]:
    types: list[type[BaseException]] = [OfflineModeIsEnabled, LocalEntryNotFoundError, ConnectionError, TimeoutError]
    try:  # huggingface_hub >= 1.0 talks through httpx
        import httpx

        types.append(httpx.TransportError)
    except ImportError:
        pass
    try:  # older huggingface_hub (and some datasets paths) use requests
        import requests

        types += [requests.exceptions.ConnectionError, requests.exceptions.Timeout]
    except ImportError:
        pass
    return tuple(types)


_NETWORK_WORDS = ("offline", "couldn't connect", "could not connect", "name resolution", "connection", "timed out")


def _first_line(err: BaseException) -> str:
    text = next((line.strip() for line in str(err).splitlines() if line.strip()), "")
    text = f"{type(err).__name__}: {text}" if text else type(err).__name__
    return text if len(text) <= 200 else text[:197] + "..."


def hub_error_message(err: Exception, what: str, local_path: str | None = None) -> str:
    """One line for a failed Hub call (push or download); `local_path` names where the run's files are."""
    chain = list(_causes(err))
    network = _network_error_types()
    offline = (
        _offline_env()
        or any(isinstance(e, network) for e in chain)
        or any(word in str(e).lower() for e in chain for word in _NETWORK_WORDS)
    )
    cause = _first_line(err)
    files = f"the run's files are in {local_path}; " if local_path else ""
    if offline:
        message = f"could not reach the Hugging Face Hub to {what}: {cause}; {files}{OFFLINE_HINT}"
    else:
        status = next((s for e in chain if (s := getattr(getattr(e, "response", None), "status_code", None))), None)
        if isinstance(err, RepositoryNotFoundError) or status == 404:
            fix = "check the repo id and that your token can see it (`hf auth whoami`)"
        elif isinstance(err, GatedRepoError) or status in (401, 403):
            fix = "check your token's access (`hf auth login`; pushing needs a write token)"
        else:
            fix = "fix the cause above and run again"
        message = f"the Hugging Face Hub call to {what} failed: {cause}; {files}{fix}"
    return redact(" ".join(message.split()))


def _deepspeed_stage(config) -> int | None:
    """ZeRO stage from a DeepSpeed config given as a dict, a JSON file, a JSON string or base64 JSON."""
    if isinstance(config, str):
        try:
            path = Path(config)
            if path.is_file():
                config = json.loads(path.read_text())
            else:
                text = config if config.lstrip().startswith("{") else base64.b64decode(config).decode()
                config = json.loads(text)
        except (OSError, ValueError):
            return None
    try:
        return int(config.get("zero_optimization", {}).get("stage"))
    except (AttributeError, TypeError, ValueError):  # missing stage or "auto"
        return None


def distributed_strategy(training_args) -> str:
    """Short tag for how the run was spread: deepspeed-zeroN, fsdp, ddp or single-device.

    Reads only `deepspeed`, `fsdp` and `world_size` from training_args, plus the variables `accelerate launch` sets.
    """
    deepspeed, env = getattr(training_args, "deepspeed", None), os.environ
    if deepspeed or _is_true(env.get("ACCELERATE_USE_DEEPSPEED")):
        raw = env.get("ACCELERATE_DEEPSPEED_ZERO_STAGE", "")
        if deepspeed:  # the Trainer's own config wins over what accelerate was launched with
            stage = _deepspeed_stage(deepspeed)
        else:
            stage = int(raw) if raw.isdigit() else _deepspeed_stage(env.get("ACCELERATE_DEEPSPEED_CONFIG_FILE"))
        return "deepspeed" if stage is None else f"deepspeed-zero{stage}"
    if getattr(training_args, "fsdp", None) or _is_true(env.get("ACCELERATE_USE_FSDP")):
        return "fsdp"
    return "ddp" if (getattr(training_args, "world_size", 1) or 1) > 1 else "single-device"


def hardware_description() -> str:
    """E.g. "2 x NVIDIA H200" (one GPU per process) or "CPU (16 cores)"."""
    try:
        processes = max(1, int(os.environ.get("WORLD_SIZE") or 1))
    except ValueError:
        processes = 1
    try:
        import torch

        if torch.cuda.is_available():
            return f"{processes} x {torch.cuda.get_device_name()}"
        if torch.backends.mps.is_available():
            return "Apple silicon GPU (MPS)"
    except Exception:  # a broken driver must not cost the model card
        pass
    extra = f", {processes} processes" if processes > 1 else ""
    return f"CPU ({os.cpu_count() or 1} cores{extra})"


def redact(text: str) -> str:
    """Replace anything token-shaped, and the token in use, with <redacted>."""
    secrets = {_current_token(), os.environ.get("HF_TOKEN"), os.environ.get("HUGGING_FACE_HUB_TOKEN")}
    for secret in sorted((s for s in secrets if s and len(s) >= 8), key=len, reverse=True):
        text = text.replace(secret, "<redacted>")
    return _TOKEN_PATTERN.sub("<redacted>", text)


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
    license: str = "apache-2.0"
    extra_tags: list[str] = field(default_factory=list)
    library_name: str = "transformers"


# metric key (without split prefix) -> (model-index metric_type, display name, metric_args)
def _metric_spec(key: str) -> tuple[str, str, dict | None] | None:
    if key == "accuracy":
        return "accuracy", "Accuracy", None
    if m := re.fullmatch(r"top_?(\d+)_?accuracy", key):
        return f"top_{m[1]}_accuracy", f"Top-{m[1]} accuracy", None
    if m := re.fullmatch(r"(f1|precision|recall)(?:_(macro|micro|weighted))?", key):
        average = m[2] or "macro"
        return m[1], f"{m[1].capitalize()} ({average})", {"average": average}
    return None


def _metric_label(key: str) -> str:
    spec = _metric_spec(key)
    return spec[1] if spec else key.replace("_", " ").capitalize()


_NOISE = re.compile(r"runtime|per_second|epoch|mem_|flos")


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


def _cell(value: object) -> str:
    return str(value).replace("|", "\\|").replace("\n", " ")


def _table(header: tuple[str, ...], rows: list[tuple]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows])


def _eval_results(info: CardInfo, metrics: dict[str, float], split: str) -> list[EvalResult]:
    dataset_type = info.dataset_id if info.dataset_is_hub else Path(info.dataset_id).name or info.dataset_id
    results = []
    for key, value in metrics.items():
        if spec := _metric_spec(key):
            metric_type, metric_name, metric_args = spec
            results.append(
                EvalResult(
                    task_type="image-classification",
                    task_name="Image Classification",
                    dataset_type=dataset_type,
                    dataset_name=dataset_type,
                    dataset_split=split,
                    metric_type=metric_type,
                    metric_name=metric_name,
                    metric_value=value,
                    metric_args=metric_args,
                )
            )
    return results


def _summary(info: CardInfo, validation: dict, test: dict) -> str:
    if info.base_model:
        origin = f"a fine-tuned version of [{info.base_model}](https://huggingface.co/{info.base_model})"
    elif info.base_model_source:
        origin = f"fine-tuned from the local checkpoint `{info.base_model_source}`"
    else:
        origin = "trained from scratch (no pre-trained weights)"
    if info.dataset_is_hub:
        data = f"the [{info.dataset_id}](https://huggingface.co/datasets/{info.dataset_id}) dataset"
    else:
        data = f"the local dataset `{info.dataset_id}`"
    names = ", ".join(info.label_names[:10]) + (", ..." if len(info.label_names) > 10 else "")
    text = (
        f"This model is {origin}, trained on {data} to classify images into {len(info.label_names)} classes ({names})."
    )
    if "accuracy" in test:
        text += f" It reaches **{test['accuracy']:.2%}** top-1 accuracy on the test split."
    elif "accuracy" in validation:
        text += f" It reaches **{validation['accuracy']:.2%}** top-1 accuracy on the validation split (no test split)."
    return text


def _body(info: CardInfo, validation: dict, test: dict) -> str:
    parts = [f"# {info.model_name}", _summary(info, validation, test)]

    keys = list(dict.fromkeys([*validation, *test]))
    keys.sort(key=lambda k: (_metric_spec(k) is None, k == "loss"))  # known metrics first, loss last

    def cell(metrics: dict, key: str) -> str:
        return f"{metrics[key]:.4f}" if key in metrics else "-"

    rows = [(_metric_label(k), cell(validation, k), cell(test, k)) for k in keys]
    results = "## Results\n\n" + _table(("Metric", "Validation", "Test"), rows)
    if not test:
        results += "\n\nThere is no test split: the model-index metadata reports the validation split."
    parts.append(results)

    parts.append(f"## Reproduce\n\n```bash\n{info.command}\n```")
    if info.recipe or info.recipe_text:
        recipe = f"## Recipe\n\n`{info.recipe}`" if info.recipe else "## Recipe"
        if info.recipe_text:
            recipe += f"\n\n```yaml\n{info.recipe_text.rstrip()}\n```"
        parts.append(recipe)
    if info.hyperparameters:
        parts.append(
            "## Hyperparameters\n\n" + _table(("Hyperparameter", "Value"), list(info.hyperparameters.items()))
        )

    setup = [f"- Strategy: {info.strategy}", f"- Hardware: {info.hardware}"]
    if info.throughput:
        setup.append(f"- Training throughput: {info.throughput:,.1f} images/s")
    if info.base_model_source and info.base_model_source != info.base_model:
        setup.append(f"- Weights loaded from: `{info.base_model_source}`")
    parts.append("## Training setup\n\n" + "\n".join(setup))

    if info.per_class_markdown:
        parts.append("## Per-class results\n\n" + info.per_class_markdown.strip())
    if info.confusion_matrix_file:
        parts.append(f"## Confusion matrix\n\n![Confusion matrix]({info.confusion_matrix_file})")

    usage = (
        "## How to use\n\n```python\nfrom transformers import pipeline\n\n"
        f'classifier = pipeline("image-classification", model="{info.model_name}")\n'
        'print(classifier("path/to/image.jpg"))\n```'
    )
    if info.library_name == "peft":  # the base with this repo's labels, then the adapter (docs/lora.md)
        base = info.base_model or info.base_model_source or "BASE_MODEL"
        usage = (
            "## How to use\n\nThis repo holds a LoRA adapter for "
            f"`{base}` (the classifier head included): loading it needs `pip install peft`.\n\n"
            "```python\nfrom peft import PeftModel\n"
            "from transformers import AutoConfig, AutoModelForImageClassification, pipeline\n\n"
            f'config = AutoConfig.from_pretrained("{base}")\n'
            f'labels = AutoConfig.from_pretrained("{info.model_name}")\n'
            "config.num_labels, config.id2label, config.label2id = labels.num_labels, labels.id2label, labels.label2id\n"
            f'base = AutoModelForImageClassification.from_pretrained("{base}", config=config, '
            "ignore_mismatched_sizes=True)\n"
            f'model = PeftModel.from_pretrained(base, "{info.model_name}").merge_and_unload()\n'
            f'classifier = pipeline("image-classification", model=model, image_processor="{info.model_name}")\n'
            'print(classifier("path/to/image.jpg"))\n```'
        )
    parts.append(usage)
    return "\n\n".join(parts) + "\n"


def build_model_card(info: CardInfo) -> ModelCard:
    """Model card with Hub metadata (incl. model-index) and a body that tells how to reproduce the run."""
    validation, test = _strip(info.validation_metrics), _strip(info.test_metrics)
    split, reported = ("test", test) if test else ("validation", validation)
    eval_results = _eval_results(info, reported, split)
    if info.library_name == "peft" and not info.base_model:
        logger.warning("PEFT model card without a Hub base_model: the Hub will not link the adapter to its base")
    tags = list(dict.fromkeys(["image-classification", "vision", "vit", info.strategy, *info.extra_tags]))
    data = ModelCardData(
        library_name=info.library_name,
        license=info.license,
        pipeline_tag="image-classification",
        base_model=info.base_model or None,
        datasets=[info.dataset_id] if info.dataset_is_hub else None,
        metrics=list(dict.fromkeys(r.metric_type for r in eval_results)) or None,
        tags=[t for t in tags if t],
        model_name=info.model_name if eval_results else None,
        eval_results=eval_results or None,
    )
    content = f"---\n{data.to_yaml()}\n---\n\n{_body(info, validation, test)}"
    # Redact the whole text (YAML included): the command line and recipe can carry a token.
    return ModelCard(redact(content))


def write_model_card(info: CardInfo, output_dir: str) -> str:
    """Write output_dir/README.md and return its path."""
    path = Path(output_dir) / "README.md"
    path.parent.mkdir(parents=True, exist_ok=True)
    build_model_card(info).save(path)
    return str(path)

"""The steps of run_image_classification.py that take more than one call, and what a run writes next to its model."""

import csv
import logging
import os
import sys
import tempfile

import datasets
import numpy as np
import torch
import transformers
from accelerate.utils import gather_object

from .core.arguments import RunArguments
from .core.errors import RecipeError, first_line
from .core.hub import hub_error_message
from .core.metrics import make_compute_metrics
from .data.data import (
    MULTI_LABEL,
    ImageSplits,
    balanced_sample_weights,
    balanced_weights,
    labels_of_model,
    load_image_folder,
    load_splits,
    write_labels,
    write_skipped,
)
from .data.decoding import (
    SKIPPED_DURING_RUN,
    DecodingCollator,
    StorageFormat,
    make_collator,
    say,
    skipped_during_run,
    storage_format,
)
from .data.images import LOST
from .data.streaming import load_stream_splits, stream_rows
from .data.transforms import build_mixup, build_transforms
from .model.adapters import check_adapter_strategy, drop_zero3_leaf_modules, save_final_model
from .model.facts import ModelFacts, read_model_facts
from .model.flops import peak_flops, training_flops_per_image
from .model.modeling import FinetuneSetup, evaluation_processor
from .plan.plan import RunPlan, remember_compiled
from .plan.run_dir import LOSS_RECORD, read_loss_record, record_run
from .publish.card import card_info, write_model_card
from .publish.figures import FigureProcess
from .publish.plots import write_plots
from .publish.reports import write_reports
from .train.meter import SpeedMeter
from .train.observability import attach as attach_observability
from .train.trainer import Evaluated, ImageClassificationTrainer

logger = logging.getLogger("run_image_classification")


def setup_logging(training_args) -> None:
    logging.basicConfig(
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
        handlers=[logging.StreamHandler(sys.stdout)],
        force=True,
    )
    level = training_args.get_process_log_level()
    logging.getLogger().setLevel(level)
    datasets.utils.logging.set_verbosity(level)
    transformers.utils.logging.set_verbosity(level)
    transformers.utils.logging.enable_explicit_format()
    logger.info(
        "Process rank %d of %d, device %s", training_args.process_index, training_args.world_size, training_args.device
    )


def load_data(args: RunArguments, facts: ModelFacts | None = None) -> ImageSplits:
    """The dataset's splits with integer labels; with no dataset (predicting only), the model's labels (from `facts`,
    the plan's)."""
    if not args.data.dataset_name:
        facts = facts or read_model_facts(args.model, labels=True)
        return labels_of_model(args.model.model_name_or_path, facts.labels())
    training = args.training
    if args.data.streaming and training.do_train:
        splits = load_stream_splits(args.data, training, args.model.cache_dir)
    else:
        splits = load_splits(args.data, training.seed, args.model.cache_dir, need_train=training.do_train)
    batch = training.per_device_train_batch_size * training.world_size
    if training.do_train and splits.train is not None and batch > (stream_rows(splits.train) or batch):
        raise RecipeError(
            f"per_device_train_batch_size {training.per_device_train_batch_size} x {training.world_size} process(es) "
            f"is {batch:,} images a step, more than the {stream_rows(splits.train):,} training images: lower "
            "--per_device_train_batch_size"
        )
    sizes = ", ".join(f"{n} {stream_rows(d) or 'a stream of'}" for n, d in splits.present().items())
    kind = f"{'multi' if splits.multi_label else 'single'}-label classification"
    logger.info(
        f"Dataset {args.data.dataset_name}: {len(splits.label_names)} classes ({splits.label_source}), {kind}; {sizes}"
    )
    return splits


def build_trainer(
    args: RunArguments, plan: RunPlan, model, splits: ImageSplits, finetune: FinetuneSetup, image_size: int, mean, std
) -> tuple[ImageClassificationTrainer, SpeedMeter]:
    """The Trainer with device transforms, metrics, the speed meter, trackers and the profiler window."""
    training = args.training
    train_transform, eval_transform = build_transforms(args.augment, image_size, mean, std)
    balance = args.augment.class_weights if splits.train else "none"
    weights = balanced_weights(splits) if balance == "balanced" else None
    sample_weights = balanced_sample_weights(splits) if balance == "balanced_sampler" else None
    config = model.config  # problem_type: BCE in the model's own loss, and a sigmoid in pipeline()
    if splits.multi_label or config.problem_type == MULTI_LABEL:  # a multi-label checkpoint on single-label data
        config.problem_type = MULTI_LABEL if splits.multi_label else None
    try:
        trainer = ImageClassificationTrainer(
            model=model, args=training, train_dataset=splits.train, eval_dataset=splits.validation,
            data_collator=make_collator(splits, training.output_dir),  # predict_folder sets its own
            named_splits=splits.present(),  # decoding per batch, evaluation's collator records which split it read
            compute_metrics=make_compute_metrics(splits.multi_label, args.data.multi_label_threshold),
            train_transform=train_transform, eval_transform=eval_transform,
            mixup=build_mixup(args.augment, len(splits.label_names), training.label_smoothing_factor),
            class_weights=weights, sample_weights=sample_weights,
        )  # fmt: skip
    except Exception as err:
        if training.push_to_hub:  # the Trainer creates the Hub repository up front
            raise RecipeError(hub_error_message(err, "create the model repository")) from None
        raise
    trainer.run_identity, trainer.threshold = plan.identity, args.data.multi_label_threshold
    check_adapter_strategy(trainer, finetune)  # LoRA under FSDP/ZeRO-3: set-ups that could not save the adapter
    drop_zero3_leaf_modules(trainer, finetune)
    peak = peak_flops(torch.cuda.get_device_name(), plan.precision) if plan.device == "cuda" else None
    flops = None  # the speed meter gives MFU where the GPU's peak rate is known
    if peak and args.augment.patch_dropout:
        logger.warning("No MFU with --patch_dropout: the FLOP count assumes every patch")
    elif peak:
        try:
            flops = training_flops_per_image(config, training.gradient_checkpointing, finetune.method, image_size)
        except Exception as err:  # noqa: BLE001 - a model the meta-device count cannot run: no MFU, say why
            logger.info("No MFU: counting this model's FLOPs failed (%s)", first_line(err, 200))
    meter = SpeedMeter(plan.global_batch, flops, peak * plan.strategy.world_size if peak else None)
    attach_observability(trainer, args.observe, meter)
    open_figures(trainer, args.observe.plots and (training.do_train or training.do_eval))
    return trainer, meter


def open_figures(trainer, wanted: bool) -> None:
    """On rank 0, `trainer.figures`: the child process that draws the run's figures (figures.py), started now."""
    if wanted and trainer.is_world_process_zero():
        try:
            trainer.figures = FigureProcess()
        except OSError as err:  # no process to start: start_figures draws the plots in this one
            logger.warning("The plots are drawn in this process (no child process for them: %s)", first_line(err))


def train(trainer, plan: RunPlan, splits: ImageSplits, finetune: FinetuneSetup, meter: SpeedMeter,
          decode_seconds: float, compiled: str | None = None) -> dict:  # fmt: skip
    """Train (resuming the plan's checkpoint), save the final model, return the train metrics; `compiled`: see plan."""
    output_dir = trainer.args.output_dir
    if trainer.is_world_process_zero():
        record_run(output_dir, plan.identity)
        write_skipped(splits, output_dir)
    before = read_loss_record(plan.resume_from)
    if before is not None:
        trainer.loss_sum = before
    elif plan.resume_from:
        logger.warning("%s has no %s: train_loss covers the steps after it only", plan.resume_from, LOSS_RECORD)
    train_result = trainer.train(resume_from_checkpoint=plan.resume_from)
    if trainer.is_world_process_zero():
        remember_compiled(compiled)  # the next run of this model and batch compiles from the cache
    save_final_model(trainer, finetune)  # DeepSpeed/FSDP: gathered, plain; LoRA: the adapter or merged model
    metrics = {**train_result.metrics, **meter.metrics(), **finetune.metrics}  # + trainable/total parameters
    if before is not None and trainer.state.global_step:  # the whole run's mean, not the mean since the resume
        metrics["train_loss"] = trainer.mean_loss_sum() / trainer.state.global_step
    metrics["data_decode_seconds"] = round(decode_seconds, 3)  # first run: decoding; later runs: the disk cache
    trainer.log_metrics("train", metrics)
    trainer.save_metrics("train", metrics)
    trainer.save_state()
    return metrics


def save_model_files(trainer, args: RunArguments, splits: ImageSplits, image_size: int, mean, std) -> None:
    """Image processor (the evaluation preprocessing, for pipeline()), config and label names next to the model."""
    if not trainer.is_world_process_zero():
        return
    output_dir, crop, config = trainer.args.output_dir, args.augment.eval_crop_pct, trainer.model.config
    evaluation_processor(image_size, crop, mean, std).save_pretrained(output_dir)
    if isinstance(getattr(config, "pretrained_cfg", None), dict):  # timm: pipeline() preprocesses as it says
        config.pretrained_cfg = {k: v for k, v in config.pretrained_cfg.items() if not k.startswith("test_")} | dict(
            input_size=[3, image_size, image_size], crop_pct=crop, crop_mode="center", interpolation="bicubic",
            mean=list(mean), std=list(std))  # fmt: skip
    config.save_pretrained(output_dir)
    write_labels(splits, output_dir)


def evaluate(trainer, splits: ImageSplits) -> tuple[dict, tuple | None]:
    """Metrics on validation, then once on test; and (split name, predictions) of the last one, for the reports.

    Validation is not scored again when the Trainer's evaluation at the last step scored this very model: its logged
    metrics are reused, and, with no test split, its predictions (kept by the Trainer's evaluation_loop)."""
    results, last = {}, None
    for name, split in (("eval", splits.validation), ("test", splits.test)):
        if split is None:
            continue
        metrics, kept = last_step_evaluation(trainer, split) if name == "eval" else ({}, None)
        if metrics and (kept or splits.test is not None):  # with a test split the reports are test's: metrics do
            what = "metrics" if splits.test is not None else "metrics and reports"
            logger.info("Final validation %s reuse the evaluation at step %d (same model): no second pass", what,
                        trainer.state.global_step)  # fmt: skip
            last = ("validation", kept)
        else:
            output = trainer.predict(split, metric_key_prefix=name)
            metrics, last = output.metrics, ("test" if name == "test" else "validation", output)
        trainer.log_metrics(name, metrics)
        trainer.save_metrics(name, metrics)
        results.update(metrics)
    return results, last


def last_step_evaluation(trainer, split) -> tuple[dict, Evaluated | None]:
    """The eval_* metrics the Trainer logged at the last step and its kept predictions of `split` (None if another
    loop ran since), while the model is still the one they scored; else ({}, None).

    Not after --ema_decay's average or load_best_model_at_end's checkpoint replaced the trained weights, nor with
    fp16/bf16_full_eval (the Trainer casts the model for evaluations outside training only)."""
    state, t, kept = trainer.state, trainer.args, trainer.last_evaluation
    end = next((entry for entry in reversed(state.log_history) if "eval_loss" in entry), {})
    changed = trainer.ema is not None or t.load_best_model_at_end or t.fp16_full_eval or t.bf16_full_eval
    if end.get("step") != state.global_step or changed:
        return {}, None
    same = kept is not None and kept.step == state.global_step and kept.prefix == "eval" and kept.dataset is split
    return {k: v for k, v in end.items() if k.startswith("eval_")}, kept if same else None


def start_figures(trainer, plots: bool) -> FigureProcess | None:
    """The training plots, drawn by `trainer.figures` while the GPU evaluates (else here); returns that process."""
    history, t = trainer.state.log_history, trainer.args
    if trainer.figures is not None and history:
        trainer.figures.plots(history, t.output_dir, t.label_smoothing_factor)
    elif plots and history and trainer.is_world_process_zero():
        write_plots(history, t.output_dir, t.label_smoothing_factor)
    return trainer.figures


def write_run_reports(trainer, splits: ImageSplits, predictions: tuple | None, figures: FigureProcess | None) -> dict:
    """reports.write_reports of the last evaluated split; then waits for the figure process to finish."""
    reports = {}
    if predictions and trainer.is_world_process_zero():
        split, output = predictions
        logits = output.predictions[0] if isinstance(output.predictions, tuple) else output.predictions
        reports = write_reports(logits, output.label_ids, splits.label_names, trainer.args.output_dir, split,
                                threshold=trainer.threshold, draw=figures and figures.confusion_matrix)  # fmt: skip
    if figures is not None:
        figures.finish()
    return reports


def predict_folder(trainer, data_args, splits: ImageSplits, image_size: int) -> None:
    """Classify a folder of images into predictions.csv: file, label(s), score(s) (';'-joined), problem.

    Decoded per batch by the DataLoader workers, as evaluation is (nothing written to the datasets cache); an
    unreadable file's row is left out of the batch's predictions, and its problem, which the workers record, named."""
    images = load_image_folder(data_args.predict_images)
    if splits.storage_shape:  # stored as the model's training images were
        storage = StorageFormat(splits.storage_shape, splits.white)
    else:
        storage = storage_format(images, "image", image_size, data_args.storage_size)
    height, width = storage.shape
    say(f"{len(images)} images to predict, decoded per batch by the DataLoader workers to {height}x{width} uint8: no "
        "decoded copy on disk")  # fmt: skip
    with tempfile.TemporaryDirectory() as folder:  # each rank's workers record its unreadable files there
        record = os.path.join(folder, SKIPPED_DURING_RUN)
        trainer.data_collator = DecodingCollator(storage.shape, storage.white, "image", record, split="predict")
        logits = trainer.predict(images.remove_columns("file")).predictions
        problems = {item["image"]: item["problem"] for item in skipped_during_run(folder) if item["problem"] in LOST}
    problems = dict(pair for found in gather_object([problems]) for pair in found.items())  # every rank's
    logits = logits[0] if isinstance(logits, tuple) else logits
    if not trainer.is_world_process_zero():
        return
    if splits.multi_label:
        header, scores = ("labels", "scores"), 1 / (1 + np.exp(-logits.astype(np.float64)))
        threshold = data_args.multi_label_threshold
        chosen = [[i for i in np.argsort(-row, kind="stable") if row[i] >= threshold] for row in scores]
    else:
        shifted = np.exp(logits - logits.max(axis=1, keepdims=True))
        header, scores = ("label", "score"), shifted / shifted.sum(axis=1, keepdims=True)
        chosen = [[int(row.argmax())] for row in scores]
    path, names = os.path.join(trainer.args.output_dir, "predictions.csv"), splits.label_names
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["file", *header, "problem"])
        for file, image, row, best in zip(images["file"], images["image"], scores, chosen):
            if problem := problems.get(image["path"]):  # missing, too large or unreadable: visible, not predicted
                writer.writerow([file, "", "", problem])
            else:
                writer.writerow([file, ";".join(names[i] for i in best), ";".join(f"{row[i]:.6f}" for i in best), ""])
    logger.info("Wrote %d predictions to %s", len(images), path)


def publish(trainer, args: RunArguments, plan: RunPlan, argv, splits, results, reports, finetune, meter) -> None:
    """Write the model card (always, locally), then push with it when asked."""
    if trainer.is_world_process_zero():
        write_skipped(splits, trainer.args.output_dir)
    history = trainer.state.log_history
    trainer.card = card_info(args, plan, argv, splits, results, reports, finetune, meter.images_per_second, history)
    if trainer.is_world_process_zero():
        write_model_card(trainer.card, trainer.args.output_dir)
    if args.training.push_to_hub:
        try:
            trainer.push_to_hub(finetuned_from=args.model.model_name_or_path)
        except Exception as err:
            raise RecipeError(hub_error_message(err, "push the model", trainer.args.output_dir)) from None


def summary(results: dict, output_dir: str, reports: dict, skew: tuple[int, int] | None = None) -> None:
    lines = []
    split = "test" if "test_recall_macro" in results else "eval"
    if skew and f"{split}_recall_macro" in results:  # plain accuracy flatters a model that ignores small classes
        worst = ", ".join(f"{label} {recall:.2%}" for label, recall in reports.get("worst_recall", []))
        lines += [
            f"classes are imbalanced in train ({skew[0]} to {skew[1]} images per class): read these before accuracy",
            f"{split}_balanced_accuracy (mean per-class recall): {results[f'{split}_recall_macro']:.4f}",
            f"{split}_f1_macro: {results[f'{split}_f1_macro']:.4f}",
            *([f"worst classes' recall: {worst}"] if worst else []),
        ]
    lines += [f"{k}: {v:.4f}" for k, v in results.items() if k.endswith(("accuracy", "mean_average_precision"))]
    phases = {k[5:-2]: v for k, v in results.items() if k.startswith("time_") and k[5:-2] not in ("total", "imports")}
    if phases:  # where the wall time went (time_<phase>_s in all_results.json)
        lines.append("wall time: " + ", ".join(f"{p} {v:.1f}s" for p, v in phases.items() if v >= 0.05))
    trained = any(k.startswith(("train_", "eval_", "test_")) for k in results)
    lines.append(f"{'model, card (README.md) and metrics' if trained else 'predictions.csv'}: {output_dir}")
    if reports:  # multi-label runs have no confusion matrix
        key = "confusion_matrix" if "confusion_matrix" in reports else "per_class_csv"
        lines.append(f"{key.replace('_', ' ')}: {reports[key]}")
    print("\n".join(["", "=" * 60, *lines, "=" * 60]))

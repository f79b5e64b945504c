#!/usr/bin/env python
"""Fine-tune a Vision Transformer for image classification, on one device or many.

    python run_image_classification.py --config recipes/vit-base/cifar100/config_full.yaml
    accelerate launch --config_file accelerate_configs/zero3.yaml run_image_classification.py --config ...
    deepspeed run_image_classification.py --deepspeed ds_configs/zero2.json --config ...

The story of one run: parse -> data -> model -> trainer -> train -> evaluate -> test -> reports, card, push.
Each step is one call into the `vit_recipes` package.
"""

from __future__ import annotations

import csv
import json
import logging
import os
import shlex
import sys
import time
from pathlib import Path

import datasets
import numpy as np
import transformers

from vit_recipes import strategy as distributed
from vit_recipes.arguments import parse_args, run_config
from vit_recipes.data import (
    PixelCollator,
    decode_split,
    decode_splits,
    load_image_folder,
    load_splits,
    resolve_source,
    write_skipped,
)
from vit_recipes.errors import RecipeError
from vit_recipes.flops import peak_flops
from vit_recipes.fp8 import convert_to_fp8
from vit_recipes.hub import (
    CardInfo,
    check_push_ready,
    distributed_strategy,
    hardware_description,
    hub_error_message,
    write_model_card,
)
from vit_recipes.lora import build_finetune_model, check_lora_strategy, save_final_model, training_flops
from vit_recipes.metrics import make_compute_metrics
from vit_recipes.modeling import evaluation_processor, mean_std
from vit_recipes.observability import attach as attach_observability
from vit_recipes.plots import write_plots
from vit_recipes.reports import write_reports
from vit_recipes.run_dir import record_run, resolve_resume
from vit_recipes.timeline import Timeline
from vit_recipes.trainer import ImageClassificationTrainer, TrainingStatsCallback
from vit_recipes.transforms import build_mixup, build_transforms

logger = logging.getLogger("run_image_classification")


def main(argv: list[str] | None = None) -> dict:
    # 1. Arguments: recipe YAML, overridden by the command line; fail fast on anything wrong.
    argv = sys.argv[1:] if argv is None else list(argv)
    timeline = Timeline()  # wall time per phase, from the process's start: where a short run's minute goes
    distributed.check_launch(argv)  # processes vs GPUs, before parsing starts the process group
    distributed.remove_shm_buffer_at_exit()  # DeepSpeed on CPUs leaves a shared-memory buffer per rank otherwise
    args = parse_args(argv)
    training_args = args.training
    distributed.check_strategy(args)  # DDP/DeepSpeed/FSDP settings vs arguments, device and host memory
    setup_logging(training_args)
    check_push_ready(training_args)
    run = run_config(args)
    resume_from = resolve_resume(training_args, run) if training_args.do_train else None
    distributed.check_resume(training_args, resume_from)  # a DeepSpeed checkpoint needs its world size
    timeline.mark("startup")  # interpreter, imports, launcher, arguments, process group

    # 2. Data: splits with integer labels (ClassLabel names, or sorted values).
    with training_args.main_process_first(desc="loading the dataset"):
        splits = load_splits(
            args.data, seed=training_args.seed, cache_dir=args.model.cache_dir, need_train=training_args.do_train
        )
    logger.info(
        "Dataset %s: %d classes (%s); %s",
        args.data.dataset_name,
        len(splits.label_names),
        splits.label_source,
        ", ".join(f"{n} {len(d)}" for n, d in splits.present().items()),
    )
    timeline.mark("data")

    # 3. Model with a head for these labels (seeded: a new head is initialised randomly).
    transformers.set_seed(training_args.seed)
    # Full fine-tuning, LoRA adapters (--use_peft) or the head alone (--freeze_backbone); prints the trainable share.
    model, image_size, finetune = build_finetune_model(args.model, args.lora, training_args, splits.label_names)
    distributed.check_model(training_args, model)  # FSDP2's wrap list, ZeRO++'s quantized weights vs the head
    convert_to_fp8(model, training_args)  # --fp8: the transformer's linear layers run their matmuls in FP8
    mean, std = mean_std(args.model)
    timeline.mark("model")

    # 4. Decode every image once to uint8 at storage size (cached on disk); the device does the rest.
    decode_start = time.perf_counter()
    with training_args.main_process_first(desc="decoding images"):
        splits = decode_splits(splits, image_size, args.data.storage_size, args.data.preprocessing_num_workers)
    decode_seconds = time.perf_counter() - decode_start  # first run: decoding; later runs: reading the cache
    train_transform, eval_transform = build_transforms(args.augment, image_size, mean, std)
    timeline.mark("decode")

    # 5. Trainer.
    images_per_step = (
        training_args.per_device_train_batch_size
        * training_args.gradient_accumulation_steps
        * training_args.world_size
    )
    flops = training_flops(model.config, training_args.gradient_checkpointing, finetune)
    stats = TrainingStatsCallback(images_per_step, flops, run_peak_flops(training_args))
    card: dict = {}
    try:
        trainer = ImageClassificationTrainer(
            model=model,
            args=training_args,
            train_dataset=splits.train,
            eval_dataset=splits.validation,
            data_collator=PixelCollator(splits.storage_shape),
            compute_metrics=make_compute_metrics(),
            callbacks=[stats],
            train_transform=train_transform,
            eval_transform=eval_transform,
            mixup=build_mixup(args.augment, len(splits.label_names), training_args.label_smoothing_factor),
            card_writer=lambda: write_model_card(CardInfo(**card), training_args.output_dir),
        )
    except Exception as err:
        if training_args.push_to_hub:  # the Trainer creates the Hub repository up front
            raise RecipeError(hub_error_message(err, "create the model repository")) from None
        raise
    check_lora_strategy(trainer, finetune)  # LoRA under FSDP/ZeRO-3: refuse set-ups that could not save the adapter
    distributed.attach_rank_report(trainer)  # VIT_RECIPES_DEBUG_RANK_REPORT=1: each rank reports what it ran
    # Per-step img/s, step time, MFU, memory per rank in every tracker's logs; --profile_steps traces.
    attach_observability(trainer, args.observe, images_per_step, flops, stats.peak_flops)
    processor = evaluation_processor(image_size, args.augment.eval_crop_pct, mean, std)
    results: dict = {}
    timeline.mark("trainer")  # Trainer, accelerator, DeepSpeed/FSDP set-up, trackers

    # 6. Train.
    if training_args.do_train:
        if trainer.is_world_process_zero():
            record_run(training_args, run)
            write_skipped(splits, training_args.output_dir)
        train_result = trainer.train(resume_from_checkpoint=resume_from)
        timeline.mark("train")  # includes the first steps' warm-up and checkpoint saves
        # Under DeepSpeed/FSDP this gathers a plain, loadable model; LoRA: the adapter, or the merged model.
        save_final_model(trainer, finetune)
        metrics = dict(train_result.metrics)
        metrics.update(stats.metrics())
        metrics.update(finetune.metrics)  # trainable/total parameters
        metrics["data_decode_seconds"] = round(decode_seconds, 3)
        trainer.log_metrics("train", metrics)
        trainer.save_metrics("train", metrics)
        trainer.save_state()
        results.update(metrics)
    if trainer.is_world_process_zero():
        processor.save_pretrained(training_args.output_dir)
        model.config.save_pretrained(training_args.output_dir)
        save_labels(splits, training_args.output_dir)
    timeline.mark("save")

    # 7. Evaluate on validation, then once on test; reports on test (validation when there is no test split).
    report_split = None
    for name, split in (("eval", splits.validation), ("test", splits.test)):
        if split is None or not training_args.do_eval:
            continue
        output = trainer.predict(split, metric_key_prefix=name)
        trainer.log_metrics(name, output.metrics)
        trainer.save_metrics(name, output.metrics)
        results.update(output.metrics)
        report_split = (name, output)
    timeline.mark("evaluate")
    reports = {}
    if report_split and trainer.is_world_process_zero():
        name, output = report_split
        logits = output.predictions[0] if isinstance(output.predictions, tuple) else output.predictions
        reports = write_reports(
            logits,
            output.label_ids,
            splits.label_names,
            training_args.output_dir,
            split="test" if name == "test" else "validation",
        )
    if args.observe.plots and trainer.is_world_process_zero():  # loss/lr, validation metrics, throughput PNGs
        write_plots(trainer.state.log_history, training_args.output_dir)
    timeline.mark("reports")
    results.update(timeline.metrics())
    timeline.log()
    if results:
        trainer.save_metrics("all", results, combined=False)

    # 8. Predict a folder of images into predictions.csv.
    if training_args.do_predict and args.data.predict_images:
        predict_folder(trainer, args.data, splits.storage_shape, splits.label_names, training_args.output_dir)

    trainer.release_dataloaders()  # stop DataLoader workers now rather than at interpreter exit (slow there)

    # 9. Model card (always written locally), then push.
    card.update(card_info(args, argv, splits, results, reports, stats))
    card.update(finetune.card_fields(card["hyperparameters"]))  # LoRA adapters: library peft
    if trainer.is_world_process_zero():
        write_model_card(CardInfo(**card), training_args.output_dir)
    if training_args.push_to_hub:
        try:
            trainer.push_to_hub(finetuned_from=args.model.model_name_or_path)
        except Exception as err:
            raise RecipeError(hub_error_message(err, "push the model", training_args.output_dir)) from None
    if trainer.is_world_process_zero():
        summary(results, training_args.output_dir, reports)
    return results


def run_peak_flops(training_args) -> float | None:
    """Peak FLOP/s of all the GPUs in this run (None on CPU or unknown GPUs: no MFU then)."""
    import torch

    if not torch.cuda.is_available():
        return None
    precision = "bf16" if training_args.bf16 else "fp16" if training_args.fp16 else "fp32"
    peak = peak_flops(torch.cuda.get_device_name(), precision)
    return peak * training_args.world_size if peak else None


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
        "Process rank %d of %d, device %s, bf16 %s, fp16 %s",
        training_args.process_index,
        training_args.world_size,
        training_args.device,
        training_args.bf16,
        training_args.fp16,
    )


def save_labels(splits, output_dir: str) -> None:
    with open(os.path.join(output_dir, "labels.json"), "w") as f:
        json.dump(
            {"names": splits.label_names, "source": splits.label_source, "storage_shape": list(splits.storage_shape)},
            f,
            indent=2,
        )


def predict_folder(trainer, data_args, storage_shape, label_names, output_dir) -> None:
    images = load_image_folder(data_args.predict_images)
    decoded, skipped = decode_split(images, "image", storage_shape, data_args.preprocessing_num_workers, "predict")
    logits = trainer.predict(decoded.remove_columns("file")).predictions
    logits = logits[0] if isinstance(logits, tuple) else logits
    if not trainer.is_world_process_zero():
        return
    shifted = np.exp(logits - logits.max(axis=1, keepdims=True))
    probabilities = shifted / shifted.sum(axis=1, keepdims=True)
    path = os.path.join(output_dir, "predictions.csv")
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["file", "label", "score"])
        for file, row in zip(decoded["file"], probabilities):
            writer.writerow([file, label_names[int(row.argmax())], f"{row.max():.6f}"])
        for index in skipped:  # unreadable files stay visible in the output
            writer.writerow([images[index]["file"], "", "unreadable"])
    logger.info("Wrote %d predictions to %s", len(decoded) + len(skipped), path)


def card_info(args, argv, splits, results, reports, stats) -> dict:
    model_source = args.model.model_name_or_path
    is_hub = lambda name: bool(name) and not os.path.exists(os.path.expanduser(name))  # noqa: E731
    dataset_id, _ = resolve_source(args.data.dataset_name or "")
    training = args.training
    precision = "bf16" if training.bf16 else "fp16" if training.fp16 else "fp32"
    hyperparameters = {
        "learning_rate": training.learning_rate,
        "per_device_train_batch_size": training.per_device_train_batch_size,
        "global_batch_size": training.per_device_train_batch_size
        * training.gradient_accumulation_steps
        * training.world_size,
        "num_train_epochs": training.num_train_epochs if training.max_steps <= 0 else None,
        "max_steps": training.max_steps if training.max_steps > 0 else None,
        "lr_scheduler_type": str(getattr(training.lr_scheduler_type, "value", training.lr_scheduler_type)),
        "warmup_steps": training.warmup_steps,
        "weight_decay": training.weight_decay,
        "optimizer": str(getattr(training.optim, "value", training.optim)),
        "precision": precision,
        "gradient_checkpointing": training.gradient_checkpointing,
        "label_smoothing": training.label_smoothing_factor,
        "crop_scale_min": args.augment.crop_scale_min,
        "hflip_prob": args.augment.hflip_prob,
        "auto_augment": args.augment.auto_augment,
        "mixup_alpha": args.augment.mixup_alpha,
        "cutmix_alpha": args.augment.cutmix_alpha,
        "storage_size": "x".join(map(str, splits.storage_shape)),
        "seed": training.seed,
    }
    recipe_text = Path(args.recipe).read_text() if args.recipe else None
    launcher = "python" if training.world_size == 1 else f"torchrun --nproc_per_node {training.world_size}"
    return {
        "model_name": training.hub_model_id or os.path.basename(os.path.abspath(training.output_dir)),
        "base_model": model_source if is_hub(model_source) else None,
        "base_model_source": model_source,  # None: trained from scratch
        "dataset_id": dataset_id if is_hub(dataset_id) else os.path.basename(os.path.abspath(dataset_id)),
        "dataset_is_hub": is_hub(dataset_id),
        "label_names": splits.label_names,
        "validation_metrics": {k: v for k, v in results.items() if k.startswith("eval_")},
        "test_metrics": {k: v for k, v in results.items() if k.startswith("test_")},
        "hyperparameters": {k: v for k, v in hyperparameters.items() if v is not None},
        "command": " ".join([launcher, "run_image_classification.py", *map(shlex.quote, argv)]),
        "recipe": args.recipe,
        "recipe_text": recipe_text,
        "strategy": distributed_strategy(training),
        "hardware": hardware_description(),
        "throughput": stats.images_per_second,
        "per_class_markdown": reports.get("markdown"),
        "confusion_matrix_file": os.path.basename(reports["confusion_matrix"]) if reports else None,
    }


def summary(results: dict, output_dir: str, reports: dict) -> None:
    lines = [f"{k}: {v:.4f}" for k, v in results.items() if k.endswith("accuracy")]
    phases = {k[5:-2]: v for k, v in results.items() if k.startswith("time_") and k != "time_total_s"}
    if phases:  # where the wall time went (time_<phase>_s in all_results.json)
        lines.append("wall time: " + ", ".join(f"{p} {v:.1f}s" for p, v in phases.items() if v >= 0.05))
    print(
        "\n".join(
            [
                "",
                "=" * 60,
                *lines,
                f"model, card (README.md) and metrics: {output_dir}",
                *([f"confusion matrix: {reports['confusion_matrix']}"] if reports else []),
                "=" * 60,
            ]
        )
    )


if __name__ == "__main__":
    try:
        main()
    except RecipeError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    distributed.shutdown()  # after success only: a rank that failed must not wait in a collective teardown

#!/usr/bin/env python
"""Fine-tune a Vision Transformer for image classification, on one device or many.

    python run_image_classification.py --config recipes/vit-base/cifar100/config_full.yaml
    accelerate launch --config_file accelerate_configs/zero3.yaml run_image_classification.py --config ...
    deepspeed run_image_classification.py --deepspeed ds_configs/zero2.json --config ...

One run: parse -> plan -> data -> model -> trainer -> train -> evaluate -> test -> card/push. Each step is a call
into the `vit_recipes` package (docs/architecture.md).
"""

from __future__ import annotations

import gc
import sys

import transformers

from vit_recipes.core import launch
from vit_recipes.core.arguments import parse_args
from vit_recipes.core.errors import RecipeError
from vit_recipes.core.interrupt import RunInterrupted
from vit_recipes.data.data import imbalance
from vit_recipes.data.decoding import note_skipped_during_run, prepare_images, share_cores_with_workers
from vit_recipes.data.streaming import is_stream, plan_stream_steps, stream_rows
from vit_recipes.model.fp8 import convert_to_fp8
from vit_recipes.model.modeling import build_finetune_model, mean_std
from vit_recipes.model.patch_dropout import add_patch_dropout
from vit_recipes.plan.checks import check_hub, check_model
from vit_recipes.plan.plan import build_plan, configure, decide_compile, planned_steps, warn_if_warmup_outlasts_the_run
from vit_recipes.steps import (
    build_trainer,
    evaluate,
    load_data,
    predict_folder,
    publish,
    save_model_files,
    setup_logging,
    start_figures,
    summary,
    train,
    write_run_reports,
)
from vit_recipes.train.timeline import Timeline


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else list(argv)
    timeline = Timeline()  # wall time per phase, from the process's start: where a short run's minute goes

    # 1. Arguments: recipe YAML, overridden by the command line. Processes are counted against GPUs first:
    #    building TrainingArguments starts the process group.
    args = parse_args(argv, before_process_group=launch.check_processes)
    launch.remove_shm_buffer_at_exit()  # DeepSpeed on CPUs leaves a shared-memory buffer per rank (and killed ranks)
    training = args.training
    setup_logging(training)
    check_hub(args)  # pushing possible; a model or dataset on the Hub reachable, before any data is read

    # 2. Plan: strategy, precision, global batch, device and output dir, derived once; every refusal happens here,
    #    before any data is loaded. Then the settings the plan implies for accelerate and DeepSpeed.
    plan = build_plan(args)
    configure(plan, args)
    timeline.mark("startup")  # interpreter, imports, launcher, arguments, process group

    # 3. Data: splits with integer labels (ClassLabel names, or sorted values); predicting alone needs none.
    with training.main_process_first(desc="loading the dataset"):
        splits = load_data(args, plan.model)
    timeline.mark("data")

    # 4. Model with a head for these labels (seeded: a new head starts random); full, LoRA or head only.
    transformers.set_seed(training.seed)
    model, image_size, finetune = build_finetune_model(args.model, args.lora, training, splits.label_names, plan.model)
    check_model(plan.strategy, model)  # FSDP2's wrap list, ZeRO++'s quantized weights vs the head
    convert_to_fp8(model, training)  # --fp8: the transformer's linear layers run their matmuls in FP8
    add_patch_dropout(model, args.augment.patch_dropout, image_size)  # training forwards: a random subset of patches
    mean, std = mean_std(args.model)
    timeline.mark("model")

    # 5. Images to uint8 at one storage size: decoded once into a disk cache (small images), or per batch by the
    #    DataLoader workers (photos: no copy); the log says which and why. The device does the rest.
    with training.main_process_first(desc="decoding images"):
        if splits.present():
            splits = prepare_images(splits, image_size, args.data)
            share_cores_with_workers(training, splits)
    timeline.mark("decode")

    # 6. Trainer: regional compilation where it pays (steps known now, and a warm compile cache; so is a warm-up
    #    longer than the run), device transforms, metrics, speed meter, trackers, profiler; DeepSpeed/FSDP set-up.
    if is_stream(splits.train):  # counted in steps: the length its metadata gives, else --max_steps
        plan_stream_steps(training, splits.train.rows, plan.global_batch)
    steps = planned_steps(training, stream_rows(splits.train), plan.global_batch) if training.do_train else 0
    compiled = decide_compile(plan, args, steps, model)
    warn_if_warmup_outlasts_the_run(training, steps)
    trainer, meter = build_trainer(args, plan, model, splits, finetune, image_size, mean, std)
    timeline.mark("trainer")

    # 7. Train and save the final model, with what pipeline() needs next to it.
    results = {}
    if training.do_train:
        results.update(train(trainer, plan, splits, finetune, meter, timeline.phases["decode"], compiled))
        timeline.mark("train")  # includes the first steps' warm-up and checkpoint saves
    if training.do_train or training.do_eval:  # a run that only predicts writes predictions.csv alone
        save_model_files(trainer, args, splits, image_size, mean, std)
    timeline.mark("save")

    # 8. Evaluate on validation, then once on test (a child process draws the figures meanwhile); per-class report.
    figures = start_figures(trainer, args.observe.plots)
    predictions = None
    if training.do_eval:
        metrics, predictions = evaluate(trainer, splits)
        results.update(metrics)
    timeline.mark("evaluate")
    reports = write_run_reports(trainer, splits, predictions, figures)
    timeline.mark("reports")
    results.update(timeline.metrics())
    timeline.log()
    if results:
        trainer.save_metrics("all", results, combined=False)

    # 9. Predict a folder of images into predictions.csv.
    if training.do_predict and args.data.predict_images:
        predict_folder(trainer, args.data, splits, image_size)
    trainer.release_dataloaders()  # stop DataLoader workers now rather than at interpreter exit (slow there)

    # 10. Model card (written locally by every run that trains or evaluates), then push; the summary last.
    if training.do_train or training.do_eval:
        splits = note_skipped_during_run(splits, training.output_dir)  # images the DataLoader workers could not read
        publish(trainer, args, plan, argv, splits, results, reports, finetune, meter)
    if trainer.is_world_process_zero():
        summary(results, training.output_dir, reports, imbalance(splits))
    return results


def cli() -> None:
    """main() as a command: a RecipeError is one line on stderr and exit status 2, once per machine."""
    try:
        main()
    except RecipeError as err:
        if launch.env_int("LOCAL_RANK", default=0) > 0:
            launch.await_the_launchers_stop()  # local rank 0 prints the shared refusal; still here: our own error
        print(f"error: {err}", file=sys.stderr)
        launch.record_for_the_launcher(f"error: {err}")  # torch elastic's failure report quotes it
        sys.exit(2)
    except RunInterrupted as stop:  # SIGINT/SIGTERM during training: checkpoint saved at a step end (interrupt.py)
        if launch.env_int("LOCAL_RANK", default=0) == 0:
            print(f"\n{stop}", file=sys.stderr)  # on a new line: a progress bar stops mid-line
        sys.exit(128 + stop.signum)
    except KeyboardInterrupt:  # Ctrl-C outside training, or twice: one line instead of a traceback
        if launch.env_int("LOCAL_RANK", default=0) == 0:
            # on a new line: a progress bar stops mid-line
            print("\ninterrupted: the last complete checkpoint is kept; run the same command to resume from it",
                  file=sys.stderr)  # fmt: skip
        sys.exit(130)
    launch.shutdown()  # after success only: a rank that failed must not wait in a collective teardown


if __name__ == "__main__":
    cli()
    # Finished, nothing left to write: spare the interpreter's last garbage collections over the millions of objects
    # torch, transformers and datasets made (1.4 s of wall clock on a CPU). Exit handlers, thread joins and module
    # teardown still run.
    gc.freeze()

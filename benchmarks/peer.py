#!/usr/bin/env python
"""The peer in every speed record: transformers' example script, measured like our runs.

Users compare this recipe with transformers' examples/pytorch/image-classification/run_image_classification.py, so
speed records state a ratio against it measured in the same device call (benchmarks/run.py, `peer: true` in a suite
entry; benchmarks/suites/peer.yaml). This script reproduces that example's training path:

- `datasets.load_dataset(--dataset_name)`; without a "validation" split, 15% of train is split off (--train_val_split);
- labels and id2label/label2id (string ids) from the label column's ClassLabel; AutoConfig with num_labels,
  AutoModelForImageClassification (--ignore_mismatched_sizes, off by default as in the example), AutoImageProcessor;
- `set_transform` decoding each image with PIL on the fly: RandomResizedCrop(size) + RandomHorizontalFlip + ToTensor
  + Normalize(image processor mean/std), size from the processor (shortest_edge, else (height, width)), run in the
  DataLoader workers (--dataloader_num_workers, 0 in the example);
- the stock `transformers.Trainer` with the example's collate_fn (stacked pixel_values, tensor of labels); train,
  save the model, save the train metrics and the trainer state.

torchvision.transforms run when torchvision imports (as in the example); otherwise `pil_train_transform`, the same four
ops in PIL + torch with torchvision's sampling (same torch RNG calls). all_results.json says which: "peer_transforms".
The only additions are measurement: our SpeedMeter (steady-state img/s, step time, data wait, MFU, memory) is fed
through the two hooks our Trainer subclass calls (batch fetch, log), so the peer's metrics have the same keys; and
data_decode_seconds is the time load_dataset and the split take (the peer decodes per step, in the workers).
With --do_eval, the example's evaluation too: Resize(size) + CenterCrop(size) + ToTensor + Normalize on the validation
split, accuracy from the argmax (the example's evaluate.load("accuracy"), which needs the Hub, computes the same).
all_results.json also holds the wall-clock phases of the job (time_*_s, process start to the end of main) and the
meter's train_first_step_after_start_s, for benchmarks/wall_clock.py.

    python benchmarks/peer.py --model_name_or_path bench_assets/vit-base --dataset_name bench_assets/cifar100 \
        --output_dir /tmp/peer --do_train --max_steps 60 --per_device_train_batch_size 256 --bf16 true \
        --remove_unused_columns false --ignore_mismatched_sizes true --dataloader_num_workers 8
"""

from __future__ import annotations

import logging
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import transformers
from datasets import ClassLabel, load_dataset
from datasets import Image as ImageFeature
from PIL import Image
from transformers import (
    AutoConfig,
    AutoImageProcessor,
    AutoModelForImageClassification,
    HfArgumentParser,
    Trainer,
    TrainingArguments,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))  # the meter, without an install

from vit_recipes.core.errors import first_line  # noqa: E402
from vit_recipes.model.flops import peak_flops, training_flops_per_image  # noqa: E402
from vit_recipes.train.meter import SpeedMeter  # noqa: E402
from vit_recipes.train.timeline import seconds_since_start  # noqa: E402

logger = logging.getLogger("peer")


@dataclass
class PeerArguments:
    model_name_or_path: str = field(metadata={"help": "Checkpoint folder or Hub id."})
    dataset_name: str | None = field(default=None, metadata={"help": "Dataset folder or Hub id (load_dataset)."})
    train_dir: str | None = field(default=None, metadata={"help": "An imagefolder's train folder (the example's)."})
    validation_dir: str | None = field(default=None, metadata={"help": "An imagefolder's validation folder."})
    dataset_config_name: str | None = field(default=None, metadata={"help": "The dataset's configuration."})
    image_column_name: str | None = field(default=None, metadata={"help": "Default: the dataset's Image column."})
    label_column_name: str | None = field(default=None, metadata={"help": "Default: the dataset's ClassLabel column."})
    train_val_split: float = field(default=0.15, metadata={"help": "Share of train split off without validation."})
    ignore_mismatched_sizes: bool = field(default=False, metadata={"help": "Replace a head of another size."})
    max_eval_samples: int | None = field(default=None, metadata={"help": "Evaluate on the first N validation images."})


# --------------------------------------------------------------------------------------------------- transforms


def crop_params(width: int, height: int, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3)) -> tuple[int, int, int, int]:
    """(top, left, height, width) of a random crop, sampled as torchvision's RandomResizedCrop.get_params does:
    up to 10 draws of area share and log-uniform aspect ratio, then the whole image clamped to the ratio range."""
    area = width * height
    log_ratio = torch.log(torch.tensor(ratio))
    for _ in range(10):
        target_area = area * torch.empty(1).uniform_(scale[0], scale[1]).item()
        aspect = torch.exp(torch.empty(1).uniform_(log_ratio[0], log_ratio[1])).item()
        w = int(round(math.sqrt(target_area * aspect)))
        h = int(round(math.sqrt(target_area / aspect)))
        if 0 < w <= width and 0 < h <= height:
            top = int(torch.randint(0, height - h + 1, size=(1,)).item())
            left = int(torch.randint(0, width - w + 1, size=(1,)).item())
            return top, left, h, w
    in_ratio = width / height  # centre crop at the nearest allowed aspect ratio
    if in_ratio < min(ratio):
        w, h = width, int(round(width / min(ratio)))
    elif in_ratio > max(ratio):
        w, h = int(round(height * max(ratio))), height
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w


def pil_train_transform(size, mean, std):
    """RandomResizedCrop(size) + RandomHorizontalFlip() + ToTensor() + Normalize(mean, std), without torchvision."""
    out_h, out_w = (size, size) if isinstance(size, int) else size
    mean_t = torch.tensor(mean, dtype=torch.float32).view(-1, 1, 1)
    std_t = torch.tensor(std, dtype=torch.float32).view(-1, 1, 1)

    def transform(image):
        top, left, h, w = crop_params(*image.size)
        image = image.crop((left, top, left + w, top + h)).resize((out_w, out_h), Image.Resampling.BILINEAR)
        if torch.rand(1) < 0.5:
            image = image.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        pixels = torch.from_numpy(np.array(image, dtype=np.uint8, copy=True)).permute(2, 0, 1).contiguous()
        return (pixels.float().div(255) - mean_t) / std_t

    return transform


def pil_eval_transform(size, mean, std):
    """Resize(size) + CenterCrop(size) + ToTensor() + Normalize(mean, std), without torchvision."""
    out_h, out_w = (size, size) if isinstance(size, int) else size
    mean_t = torch.tensor(mean, dtype=torch.float32).view(-1, 1, 1)
    std_t = torch.tensor(std, dtype=torch.float32).view(-1, 1, 1)

    def transform(image):
        w, h = image.size
        if isinstance(size, int):  # the shorter side to `size`, aspect kept
            scale = size / min(w, h)
            w, h = max(size, round(w * scale)), max(size, round(h * scale))
        else:
            w, h = out_w, out_h
        image = image.resize((w, h), Image.Resampling.BILINEAR)
        left, top = (w - out_w) // 2, (h - out_h) // 2
        image = image.crop((left, top, left + out_w, top + out_h))
        pixels = torch.from_numpy(np.array(image, dtype=np.uint8, copy=True)).permute(2, 0, 1).contiguous()
        return (pixels.float().div(255) - mean_t) / std_t

    return transform


def processor_size(image_processor) -> int | tuple[int, int]:
    """The example's transform size: the processor's shortest_edge, else its (height, width)."""
    size = image_processor.size
    return size["shortest_edge"] if "shortest_edge" in size else (size["height"], size["width"])


def flops_per_image(config, image_processor, gradient_checkpointing: bool) -> float | None:
    """Training FLOPs of one image at the size the example trains at, not the config's image_size: DINOv2's configs
    say 518 (its position table) where the example crops its processor's 256, which counted over 4x the FLOPs.
    None (no MFU, said in a line) where the meta-device count cannot run the model at that size."""
    try:
        return training_flops_per_image(config, gradient_checkpointing, image_size=processor_size(image_processor))
    except Exception as err:  # noqa: BLE001 - the count is a report, never a reason to stop the peer's run
        logger.info("No MFU: counting this model's FLOPs failed (%s)", first_line(err, 200))
        return None


def transforms(image_processor) -> tuple[object, object, str]:
    """The example's train and evaluation transforms and which implementation they are ("torchvision" or "pil")."""
    size = processor_size(image_processor)
    mean, std = image_processor.image_mean, image_processor.image_std
    try:
        from torchvision import transforms as tv
    except Exception:  # noqa: BLE001 - not installed, or built for another torch
        return pil_train_transform(size, mean, std), pil_eval_transform(size, mean, std), "pil"
    normalize = [tv.ToTensor(), tv.Normalize(mean=mean, std=std)]
    train = tv.Compose([tv.RandomResizedCrop(size), tv.RandomHorizontalFlip(), *normalize])
    return train, tv.Compose([tv.Resize(size), tv.CenterCrop(size), *normalize]), "torchvision"


# --------------------------------------------------------------------------------------------------- training


def column_of(features, name: str | None, kind) -> str:
    if name:
        return name
    found = [column for column, feature in features.items() if isinstance(feature, kind)]
    if not found:
        raise ValueError(f"no {kind.__name__} column in {list(features)}: pass its name")
    return found[0]


def attach_meter(trainer: Trainer, meter: SpeedMeter) -> None:
    """Feed the meter as our Trainer subclass does: time spent fetching batches, figures in every training log."""
    fetch, log = trainer.get_batch_samples, trainer.log

    def get_batch_samples(*args, **kwargs):
        start = time.perf_counter()
        batches = fetch(*args, **kwargs)
        meter.add_data_wait(time.perf_counter() - start)
        return batches

    def log_with_meter(logs, *args, **kwargs):
        logs.update(meter.extend_logs(logs, trainer.args, trainer.state))
        return log(logs, *args, **kwargs)

    trainer.get_batch_samples, trainer.log = get_batch_samples, log_with_meter
    trainer.add_callback(meter)


def time_phases(trainer: Trainer, phases: dict[str, float]) -> None:
    """Charge the Trainer's evaluation and checkpoint saves to their own phases (the rest of train() is training)."""
    for name, phase in (("evaluate", "evaluate"), ("_save_checkpoint", "save")):
        method = getattr(trainer, name)

        def timed(*args, _method=method, _phase=phase, **kwargs):
            start = time.perf_counter()
            try:
                return _method(*args, **kwargs)
            finally:
                phases[_phase] = phases.get(_phase, 0.0) + time.perf_counter() - start

        setattr(trainer, name, timed)


def accuracy(prediction) -> dict[str, float]:
    return {"accuracy": float((np.argmax(prediction.predictions, axis=1) == prediction.label_ids).mean())}


def main(argv: list[str] | None = None) -> dict:
    parser = HfArgumentParser((PeerArguments, TrainingArguments))
    args, training = parser.parse_args_into_dataclasses(args=argv)
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.INFO)
    transformers.utils.logging.set_verbosity(training.get_process_log_level())

    start = time.perf_counter()
    if args.dataset_name:
        dataset = load_dataset(args.dataset_name, args.dataset_config_name)
    else:  # the example's --train_dir/--validation_dir: imagefolder with explicit data files
        data_files = {"train": os.path.join(args.train_dir, "**")}
        if args.validation_dir:
            data_files["validation"] = os.path.join(args.validation_dir, "**")
        dataset = load_dataset("imagefolder", data_files=data_files)
    if "validation" not in dataset and args.train_val_split > 0:
        split = dataset["train"].train_test_split(args.train_val_split)
        dataset["train"], dataset["validation"] = split["train"], split["test"]
    load_seconds = time.perf_counter() - start
    train = dataset["train"]
    image_column = column_of(train.features, args.image_column_name, ImageFeature)
    label_column = column_of(train.features, args.label_column_name, ClassLabel)

    labels = train.features[label_column].names
    label2id = {label: str(i) for i, label in enumerate(labels)}
    id2label = {str(i): label for i, label in enumerate(labels)}
    config = AutoConfig.from_pretrained(
        args.model_name_or_path,
        num_labels=len(labels),
        label2id=label2id,
        id2label=id2label,
        finetuning_task="image-classification",
    )
    model = AutoModelForImageClassification.from_pretrained(
        args.model_name_or_path, config=config, ignore_mismatched_sizes=args.ignore_mismatched_sizes
    )
    image_processor = AutoImageProcessor.from_pretrained(args.model_name_or_path)
    train_transform, eval_transform, implementation = transforms(image_processor)
    logger.info("Train transform: %s (%s)", train_transform, implementation)

    def batch_transform(transform):
        def apply(batch):
            batch["pixel_values"] = [transform(image.convert("RGB")) for image in batch[image_column]]
            return batch

        return apply

    def collate_fn(examples):
        pixel_values = torch.stack([example["pixel_values"] for example in examples])
        return {"pixel_values": pixel_values, "labels": torch.tensor([example[label_column] for example in examples])}

    train.set_transform(batch_transform(train_transform))
    validation = dataset["validation"] if training.do_eval else None
    if validation is not None:
        if args.max_eval_samples:
            validation = validation.select(range(min(args.max_eval_samples, len(validation))))
        validation.set_transform(batch_transform(eval_transform))
    trainer = Trainer(model=model, args=training, train_dataset=train, eval_dataset=validation,
                      processing_class=image_processor, data_collator=collate_fn,
                      compute_metrics=accuracy if training.do_eval else None)  # fmt: skip
    phases = {}
    time_phases(trainer, phases)
    cuda = training.device.type == "cuda"
    peak = peak_flops(torch.cuda.get_device_name(), "bf16" if training.bf16 else "fp32") if cuda else None
    flops = flops_per_image(model.config, image_processor, training.gradient_checkpointing) if peak else None
    images_per_step = training.per_device_train_batch_size * training.gradient_accumulation_steps * training.world_size
    meter = SpeedMeter(images_per_step, flops, peak * training.world_size if peak else None)
    attach_meter(trainer, meter)

    phases["startup"] = seconds_since_start()  # imports, dataset, model, trainer
    start = time.perf_counter()
    result = trainer.train()
    phases["train"] = time.perf_counter() - start - phases.get("evaluate", 0.0) - phases.get("save", 0.0)
    start = time.perf_counter()
    trainer.save_model()
    phases["save"] = phases.get("save", 0.0) + time.perf_counter() - start
    metrics = {**result.metrics, **meter.metrics(), "data_decode_seconds": round(load_seconds, 3)}
    metrics["peer_transforms"] = implementation
    trainer.log_metrics("train", metrics)
    trainer.save_metrics("train", metrics)
    trainer.save_state()
    if training.do_eval:  # as the example: once more after training
        metrics.update(trainer.evaluate())
    metrics.update({f"time_{phase}_s": round(seconds, 2) for phase, seconds in phases.items()})
    metrics["time_total_s"] = round(seconds_since_start(), 2)
    trainer.save_metrics("all", metrics)
    return metrics


if __name__ == "__main__":
    main()

"""From a dataset name to train/validation/test splits of uint8 image tensors with integer labels.

Two steps, because the storage size depends on the model's resolution:
1. `load_splits`: load the dataset (preset, Hub id or local path), find the image and label columns, map labels to
   ids, pick or carve the splits.
2. `decode_splits`: decode every image once into a fixed-size uint8 CHW array, cached on disk by `datasets`, so
   training epochs only slice arrays. Resizing to the model, augmentation and normalisation then run batched on
   the training device (see transforms.py).

Corrupt images are skipped and counted, never fatal hours into a run: their split and row indices are logged and
written to `skipped_images.json` in the output directory. A split left empty is an error.
"""

from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch
from datasets import ClassLabel, Dataset, DatasetDict, Value

from .errors import RecipeError
from .images import IMAGE_EXTENSIONS, decode_to_chw, image_size_of

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DatasetPreset:
    hub_id: str
    image_column: str
    label_column: str


PRESETS = {
    "cifar100": DatasetPreset("uoft-cs/cifar100", "img", "fine_label"),
    "food101": DatasetPreset("ethz/food101", "image", "label"),
    "beans": DatasetPreset("AI-Lab-Makerere/beans", "image", "labels"),
}
IMAGE_COLUMNS = ("image", "img", "images", "picture", "photo", "file", "path")
LABEL_COLUMNS = ("label", "labels", "fine_label", "class", "category", "target", "y")
VALIDATION_SPLITS = ("validation", "valid", "val", "dev")
PIXELS, LABELS = "pixels", "labels"  # the two columns the DataLoader reads
HUB_HINT = "if you are offline, pass a local path (imagefolder, parquet/arrow or save_to_disk) or try `make demo`"


@dataclass
class ImageSplits:
    """Splits with an image column and an integer `labels` column, plus the label names."""

    train: Dataset | None
    validation: Dataset | None
    test: Dataset | None
    image_column: str
    label_names: list[str]
    label_source: str  # "ClassLabel" or "sorted values": how names were found
    storage_shape: tuple[int, int] | None = None  # (height, width) once decoded
    skipped: dict[str, list[int]] = field(default_factory=dict)

    @property
    def id2label(self) -> dict[int, str]:
        return dict(enumerate(self.label_names))

    def present(self) -> dict[str, Dataset]:
        return {n: d for n, d in (("train", self.train), ("validation", self.validation), ("test", self.test)) if d}


# --------------------------------------------------------------------------------------------------- loading


def resolve_source(name: str) -> tuple[str, DatasetPreset | None]:
    preset = PRESETS.get(name.lower())
    return (preset.hub_id, preset) if preset else (name, None)


def load_any(name: str, config_name: str | None = None, cache_dir: str | None = None) -> DatasetDict:
    """Load a Hub id, an imagefolder tree, a folder of parquet/arrow files, a data file or a save_to_disk folder."""
    path = Path(name).expanduser()
    if path.exists():
        if path.is_dir() and ((path / "dataset_dict.json").exists() or (path / "state.json").exists()):
            loaded = datasets.load_from_disk(str(path))
        elif path.is_file():
            builder = {".parquet": "parquet", ".arrow": "arrow", ".csv": "csv", ".json": "json", ".jsonl": "json"}
            if path.suffix not in builder:
                raise RecipeError(f"cannot read {path}: expected a folder, .parquet, .arrow, .csv or .json file")
            loaded = datasets.load_dataset(builder[path.suffix], data_files={"train": str(path)}, cache_dir=cache_dir)
        else:
            try:
                loaded = datasets.load_dataset(str(path), config_name, cache_dir=cache_dir)
            except (FileNotFoundError, ValueError) as err:
                empty = re.search(r'Instruction "(.+)" corresponds to no data', str(err))
                if empty:
                    raise RecipeError(f"split '{empty.group(1)}' is empty (in {path})") from None
                raise RecipeError(f"no dataset found in folder {path}: {str(err).splitlines()[0]}") from None
        return loaded if isinstance(loaded, DatasetDict) else DatasetDict(train=loaded)
    if name.startswith((".", "/", "~")) or name.count("/") > 1:
        raise RecipeError(f"dataset path not found: {name}")
    try:
        return datasets.load_dataset(name, config_name, cache_dir=cache_dir)
    except datasets.exceptions.DatasetNotFoundError:
        raise RecipeError(f"dataset '{name}' is neither a local path nor a dataset on the Hub ({HUB_HINT})") from None
    except Exception as err:  # network failures come in many types (httpx, requests, OSError, offline mode)
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise RecipeError(f"could not load '{name}' from the Hugging Face Hub ({first}); {HUB_HINT}") from None


def find_column(features: datasets.Features, requested: str | None, preset: str | None, kind: str) -> str:
    columns = list(features)
    if requested:
        if requested not in features:
            raise RecipeError(f"{kind} column '{requested}' not found; columns are: {', '.join(columns)}")
        return requested
    if preset and preset in features:
        return preset
    typed = datasets.Image if kind == "image" else ClassLabel
    for name, feature in features.items():
        if isinstance(feature, typed):
            return name
    for name in IMAGE_COLUMNS if kind == "image" else LABEL_COLUMNS:
        if name in features:
            return name
    raise RecipeError(f"no {kind} column found; columns are: {', '.join(columns)}; pass --{kind}_column_name")


def _label_values(dataset_dict: DatasetDict, column: str) -> dict[str, pa.ChunkedArray]:
    return {split: d.data.column(column) for split, d in dataset_dict.items()}


def encode_labels(dataset_dict: DatasetDict, column: str) -> tuple[DatasetDict, list[str], str]:
    """Map the label column to integer ids in a ClassLabel column named `labels`.

    ClassLabel names are kept as they are; other integer or string labels are sorted and numbered, so the mapping is
    the same on every run and machine.
    """
    feature = next(iter(dataset_dict.values())).features[column]
    values = _label_values(dataset_dict, column)
    if isinstance(feature, ClassLabel):
        names = list(feature.names)
        for split, array in values.items():
            if len(array) == 0:
                continue
            low, high = pc.min(array).as_py(), pc.max(array).as_py()
            if low is None or low < 0 or high >= len(names):
                bad = low if low is None or low < 0 else high
                raise RecipeError(
                    f"split '{split}' has label {bad} outside 0..{len(names) - 1} in column '{column}' "
                    f"(unlabelled rows?); drop them or pass a labelled split"
                )
        encoded = dataset_dict
        source = "ClassLabel"
    else:
        kinds = {split: array.type for split, array in values.items()}
        if len({str(t) for t in kinds.values()}) > 1:
            listing = ", ".join(f"{s}: {t}" for s, t in kinds.items())
            raise RecipeError(f"label column '{column}' has mixed types across splits ({listing}); use one type")
        label_type = next(iter(kinds.values()))
        if pa.types.is_floating(label_type):
            for split, array in values.items():  # pandas writes a missing label as NaN, which turns the column float
                missing = np.flatnonzero(
                    pc.is_nan(array).to_numpy(zero_copy_only=False) | array.is_null().to_numpy(zero_copy_only=False)
                )
                if len(missing):
                    rows = ", ".join(map(str, missing[:10])) + (", ..." if len(missing) > 10 else "")
                    raise RecipeError(
                        f"split '{split}' has {len(missing)} NaN label(s) in '{column}' (rows {rows}): drop or label "
                        "those rows"
                    )
        if not (
            pa.types.is_integer(label_type)
            or pa.types.is_string(label_type)
            or pa.types.is_large_string(label_type)
            or pa.types.is_boolean(label_type)
        ):
            raise RecipeError(f"label column '{column}' has type {label_type}; labels must be integers or strings")
        uniques = set()
        for split, array in values.items():
            if array.null_count:
                raise RecipeError(f"split '{split}' has {array.null_count} rows without a label in '{column}'")
            uniques.update(pc.unique(array).to_pylist())
        ordered = sorted(uniques)
        names = [str(v) for v in ordered]
        lookup = {v: i for i, v in enumerate(ordered)}
        encoded = dataset_dict.map(
            lambda batch: {column: [lookup[v] for v in batch[column]]},
            batched=True,
            input_columns=None,
            desc="Mapping labels to ids",
        ).cast_column(column, ClassLabel(names=names))
        source = "sorted values"
    if len(names) < 2:
        raise RecipeError(f"label column '{column}' has {len(names)} class(es); classification needs at least 2")
    if column != LABELS:
        encoded = encoded.remove_columns(
            [c for c in (LABELS,) if c in encoded["train" if "train" in encoded else next(iter(encoded))].features]
        )
        encoded = encoded.rename_column(column, LABELS)
    return encoded, names, source


def _split(dataset_dict: DatasetDict, requested: str | None, aliases: tuple[str, ...], kind: str) -> str | None:
    if requested:
        if requested not in dataset_dict:
            raise RecipeError(f"{kind} split '{requested}' does not exist; splits are: {', '.join(dataset_dict)}")
        return requested
    return next((name for name in aliases if name in dataset_dict), None)


def load_splits(data_args, seed: int = 42, cache_dir: str | None = None, need_train: bool = True) -> ImageSplits:
    """Load the dataset and return its train/validation/test splits with encoded labels."""
    source, preset = resolve_source(data_args.dataset_name)
    dataset_dict = load_any(source, data_args.dataset_config_name, cache_dir)
    # Train is loaded for evaluation-only runs too: the same label mapping and the same carved validation split.
    train_name = _split(dataset_dict, None, (data_args.train_split_name,), "train")
    if need_train and train_name is None:
        raise RecipeError(
            f"train split '{data_args.train_split_name}' does not exist; splits are: {', '.join(dataset_dict)}"
        )
    val_name = _split(dataset_dict, data_args.validation_split_name, VALIDATION_SPLITS, "validation")
    test_name = _split(dataset_dict, data_args.test_split_name, ("test",), "test")
    used = [n for n in (train_name, val_name, test_name) if n]
    if not used:
        raise RecipeError(f"no train, validation or test split found; splits are: {', '.join(dataset_dict)}")
    dataset_dict = DatasetDict({n: dataset_dict[n] for n in dict.fromkeys(used)})
    for name, split in dataset_dict.items():
        if len(split) == 0:
            raise RecipeError(f"split '{name}' is empty")

    features = next(iter(dataset_dict.values())).features
    image_column = find_column(features, data_args.image_column_name, preset and preset.image_column, "image")
    label_column = find_column(features, data_args.label_column_name, preset and preset.label_column, "label")
    if image_column == label_column:
        raise RecipeError(f"image and label columns are both '{image_column}'")
    keep = {image_column, label_column}
    dataset_dict = DatasetDict(
        {n: d.remove_columns([c for c in d.column_names if c not in keep]) for n, d in dataset_dict.items()}
    )
    # Decode lazily and by hand, so a corrupt file is counted instead of raising inside datasets.
    if not isinstance(features[image_column], datasets.Image) or features[image_column].decode:
        try:
            dataset_dict = dataset_dict.cast_column(image_column, datasets.Image(decode=False))
        except (TypeError, ValueError, pa.ArrowException) as err:
            raise RecipeError(
                f"column '{image_column}' does not hold images ({features[image_column]}): {str(err).splitlines()[0]}"
            ) from None
    dataset_dict, names, source_kind = encode_labels(dataset_dict, label_column)

    train = dataset_dict[train_name] if train_name else None
    validation = dataset_dict[val_name] if val_name else None
    test = dataset_dict[test_name] if test_name else None
    if train is not None and validation is None:
        train, validation = carve_validation(train, data_args.validation_split_percentage, len(names), seed)
    if not need_train:
        train = None
    if train is not None and data_args.max_train_samples:
        train = sample(train, data_args.max_train_samples, seed, "train")
    if data_args.max_eval_samples:
        validation = validation and sample(validation, data_args.max_eval_samples, seed, "validation")
        test = test and sample(test, data_args.max_eval_samples, seed, "test")
    return ImageSplits(train, validation, test, image_column, names, source_kind)


def sample(split: Dataset, cap: int, seed: int, name: str) -> Dataset:
    """At most `cap` rows, seeded and stratified by label (the first rows of a class-sorted split would score a few
    classes only), with one log line saying so."""
    if cap >= len(split):
        return split
    try:
        kept = split.train_test_split(train_size=cap, seed=seed, stratify_by_column=LABELS)["train"]
        how = "stratified"
    except ValueError:  # a class with a single row, or fewer rows than classes: stratification is impossible
        kept = split.shuffle(seed=seed).select(range(cap))
        how = "not stratified: some class is too small"
    logger.warning("Sampled %d of %d %s images (seed %d, %s)", cap, len(split), name, seed, how)
    return kept


def carve_validation(train: Dataset, fraction: float, num_classes: int, seed: int) -> tuple[Dataset, Dataset]:
    """A seeded validation split from train, stratified so every class is represented in proportion."""
    size = max(round(fraction * len(train)), num_classes)  # stratifying needs at least one image per class
    if len(train) - size < num_classes:
        raise RecipeError(
            f"train has {len(train)} images for {num_classes} classes: too few to carve a "
            "validation split; pass --validation_split_name"
        )
    try:
        carved = train.train_test_split(test_size=size, seed=seed, stratify_by_column=LABELS)
    except ValueError:  # some class has a single image: stratification is impossible
        logger.warning("Some class has fewer than 2 training images: carving validation without stratification")
        carved = train.train_test_split(test_size=size, seed=seed)
    logger.info("No validation split: carved %d images from train (seed %d, stratified)", size, seed)
    return carved["train"], carved["test"]


def load_image_folder(folder: str) -> Dataset:
    """Every image under a folder (or one image file), for --do_predict; keeps the relative file names."""
    root = Path(folder)
    if root.is_file():
        files = [root]
        root = root.parent
    elif root.is_dir():
        files = sorted(p for p in root.rglob("*") if p.suffix.lower() in IMAGE_EXTENSIONS)
    else:
        raise RecipeError(f"--predict_images path not found: {folder}")
    if not files:
        raise RecipeError(f"no images ({', '.join(IMAGE_EXTENSIONS)}) found under {folder}")
    return Dataset.from_dict(
        {"file": [str(p.relative_to(root)) for p in files], "image": [{"path": str(p), "bytes": None} for p in files]},
        features=datasets.Features({"file": Value("string"), "image": datasets.Image(decode=False)}),
    )


# --------------------------------------------------------------------------------------------------- decoding


def storage_shape_for(
    dataset: Dataset, image_column: str, image_size: int, storage_size: int | None, sample: int = 64
) -> tuple[int, int]:
    """The (height, width) all images are stored at.

    Small datasets of one native size (CIFAR's 32x32) stay native: upsampling happens on the device, where it is
    cheap. Anything else is stored at a square of image_size/0.875 (256 for 224), room for random crops.
    """
    if storage_size:
        return storage_size, storage_size
    sizes = set()
    for value in dataset.select(range(min(sample, len(dataset))))[image_column]:
        try:
            sizes.add(image_size_of(value))
        except Exception:  # a corrupt header: decode_split counts it
            continue
    if len(sizes) == 1:
        width, height = sizes.pop()
        if max(width, height) <= image_size:
            return height, width
    side = round(image_size / 0.875)
    return side, side


def _decode_batch(batch, image_column: str, height: int, width: int):
    pixels, ok = [], []
    for value in batch[image_column]:
        try:
            pixels.append(decode_to_chw(value, height, width).tobytes())
            ok.append(True)
        except Exception:  # corrupt/truncated/unsupported: skip and count (see module docstring)
            pixels.append(b"")
            ok.append(False)
    return {PIXELS: pixels, "ok": ok}


def decode_split(
    dataset: Dataset, image_column: str, shape: tuple[int, int], num_proc: int | None, name: str
) -> tuple[Dataset, list[int]]:
    """Decode every image of a split once into uint8 CHW bytes (cached on disk by datasets' fingerprint)."""
    height, width = shape
    decoded = dataset.map(
        _decode_batch,
        batched=True,
        batch_size=256,
        fn_kwargs={"image_column": image_column, "height": height, "width": width},
        remove_columns=[image_column],
        features=datasets.Features(
            {
                **{k: v for k, v in dataset.features.items() if k != image_column},
                PIXELS: Value("binary"),
                "ok": Value("bool"),
            }
        ),
        num_proc=num_proc if num_proc and num_proc > 1 and len(dataset) > 1000 else None,
        desc=f"Decoding {name} images to {height}x{width} uint8",
    )
    ok = np.asarray(decoded.data.column("ok").to_numpy(zero_copy_only=False), dtype=bool)
    bad = np.flatnonzero(~ok).tolist()
    if bad:
        logger.warning(
            "Skipped %d corrupt image(s) in split '%s' (rows %s%s)",
            len(bad),
            name,
            ", ".join(map(str, bad[:10])),
            ", ..." if len(bad) > 10 else "",
        )
        decoded = decoded.select(np.flatnonzero(ok))
        if len(decoded) == 0:
            raise RecipeError(f"every image in split '{name}' is corrupt or unreadable")
    return decoded.remove_columns("ok"), bad


def decode_splits(
    splits: ImageSplits, image_size: int, storage_size: int | None = None, num_proc: int | None = None
) -> ImageSplits:
    reference = splits.train or splits.validation or splits.test
    shape = storage_shape_for(reference, splits.image_column, image_size, storage_size)
    decoded, skipped = {}, {}
    for name, split in splits.present().items():
        decoded[name], bad = decode_split(split, splits.image_column, shape, num_proc, name)
        if bad:
            skipped[name] = bad
    return ImageSplits(
        decoded.get("train"),
        decoded.get("validation"),
        decoded.get("test"),
        PIXELS,
        splits.label_names,
        splits.label_source,
        shape,
        skipped,
    )


def write_skipped(splits: ImageSplits, output_dir: str) -> None:
    if splits.skipped:
        os.makedirs(output_dir, exist_ok=True)
        with open(os.path.join(output_dir, "skipped_images.json"), "w") as f:
            json.dump(splits.skipped, f, indent=2)


class PixelCollator:
    """Stacks stored uint8 CHW bytes into one (B, 3, H, W) uint8 tensor: the only work left for DataLoader workers."""

    def __init__(self, shape: tuple[int, int]):
        self.shape = shape

    def __call__(self, rows: list[dict]) -> dict[str, torch.Tensor]:
        height, width = self.shape
        buffer = b"".join(row[PIXELS] for row in rows)
        pixels = np.frombuffer(buffer, dtype=np.uint8).reshape(len(rows), 3, height, width)
        batch = {"pixel_values": torch.from_numpy(pixels.copy())}
        if LABELS in rows[0]:
            batch["labels"] = torch.tensor([row[LABELS] for row in rows], dtype=torch.long)
        return batch

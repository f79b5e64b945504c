"""Dataset name -> labelled train/validation/test splits with an image column (not yet decoded: decoding.py decides
how) and an integer or multi-hot `labels` column; the label names, and every change made to the user's data."""

import json
import logging
import os
import re
from collections import namedtuple
from dataclasses import dataclass, field
from pathlib import Path

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch
from datasets import ClassLabel, Dataset, DatasetDict, Value
from datasets.utils.stratify import stratified_shuffle_split_generate_indices

from ..core.errors import RecipeError, first_line
from ..core.hub import LOCAL_BUILDERS, written_as_path
from .folder_index import DATA_BUILDERS, IMAGES, image_files, load_folder

logger = logging.getLogger(__name__)

DatasetPreset = namedtuple("DatasetPreset", ["hub_id", "image_column", "label_column"])
PRESETS = {
    "cifar100": DatasetPreset("uoft-cs/cifar100", "img", "fine_label"),
    "food101": DatasetPreset("ethz/food101", "image", "label"),
    "beans": DatasetPreset("AI-Lab-Makerere/beans", "image", "labels"),
}
IMAGE_COLUMNS = ("image", "img", "images", "picture", "photo", "file", "path")
LABEL_COLUMNS = ("label", "labels", "fine_label", "class", "category", "target", "y")
VALIDATION_SPLITS = ("validation", "valid", "val", "dev")
PIXELS, LABELS = "pixels", "labels"  # the two columns the DataLoader reads
LABELS_FILE = "labels.json"  # next to a model: write_labels, labels_of_model
LABEL_TYPES = (pa.types.is_integer, pa.types.is_string, pa.types.is_large_string, pa.types.is_boolean)
SINGLE_LABEL, MULTI_LABEL = "single_label_classification", "multi_label_classification"  # config.problem_type
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
    white: float = 255.0  # the pixel value high-bit-depth images scale to 255 (images.white_level)
    skipped: dict[str, list[dict]] = field(default_factory=dict)  # split -> [{row, image, problem}]
    notes: list[str] = field(default_factory=list)  # every change made to the user's data, for the log and the card
    multi_label: bool = False  # labels are multi-hot float32 vectors, not class ids
    decode: str = "once"  # "once": a decoded uint8 column; "per_batch": the DataLoader workers decode (decoding.py)

    def present(self) -> dict[str, Dataset]:
        return {n: d for n, d in (("train", self.train), ("validation", self.validation), ("test", self.test)) if d}


def resolve_source(name: str) -> tuple[str, DatasetPreset | None]:
    preset = PRESETS.get(name.lower())
    return (preset.hub_id, preset) if preset else (name, None)


def _unreadable_files(err: Exception, path: Path) -> str:
    """One line for data files datasets could not turn into a table (its own error says only "An error occurred")."""
    cause = err.__cause__ or err.__context__ or err
    text = first_line(cause, 200)
    if "BatchSize must be greater than 0" in text:
        return f"a data file in {path} has no rows: remove it, or fill it (every split needs images)"
    if mixed := re.search(r"Failed to parse string: '(.*)' as a scalar of type (\w+)", text):
        return (
            f"a column in {path} mixes types: '{mixed[1]}' where the other files have {mixed[2]} values; write every "
            "label as a class name, or every one as a number"
        )
    return f"cannot read the data files in {path}: {type(cause).__name__}: {text}"


def load_any(
    name: str, config_name: str | None = None, cache_dir: str | None = None, notes: list[str] | None = None
) -> DatasetDict:
    """Load a Hub id, an imagefolder tree, a folder of parquet/arrow files, a data file or a save_to_disk folder;
    `notes`: where a local folder adds the files it left out (folder_index.load_folder)."""
    path = Path(name).expanduser()
    if path.exists():
        if path.is_dir() and ((path / "dataset_dict.json").exists() or (path / "state.json").exists()):
            loaded = datasets.load_from_disk(str(path))
        elif path.is_file():
            if path.suffix not in DATA_BUILDERS:
                raise RecipeError(f"cannot read {path}: expected a folder, .parquet, .arrow, .csv or .json file")
            loaded = datasets.load_dataset(
                DATA_BUILDERS[path.suffix], data_files={"train": str(path)}, cache_dir=cache_dir
            )
        else:
            try:  # indexed in one walk, the splits named explicitly (folder_index.py)
                loaded = load_folder(path, cache_dir, notes=notes)
            except datasets.exceptions.DatasetGenerationError as err:
                raise RecipeError(_unreadable_files(err, path)) from None
            except (FileNotFoundError, ValueError) as err:
                if empty := re.search(r'Instruction "(.+)" corresponds to no data', str(err)):
                    raise RecipeError(f"split '{empty.group(1)}' is empty (in {path})") from None
                raise RecipeError(f"no dataset found in folder {path}: {first_line(err)}") from None
        return loaded if isinstance(loaded, DatasetDict) else DatasetDict(train=loaded)
    if written_as_path(name):
        raise RecipeError(f"dataset path not found: {name}")
    try:
        return datasets.load_dataset(name, config_name, cache_dir=cache_dir)
    except datasets.exceptions.DatasetNotFoundError:
        raise RecipeError(f"dataset '{name}' is neither a local path nor a dataset on the Hub ({HUB_HINT})") from None
    except Exception as err:  # network failures come in many types (httpx, requests, OSError, offline mode)
        builder = LOCAL_BUILDERS.get(name.rstrip("/"))  # a folder this repo builds: say it is missing, and how
        missing = f"no local folder '{name}' in {os.getcwd()}, and could not load it"
        what, fix = (missing, f"build it with `{builder}`") if builder else (f"could not load '{name}'", HUB_HINT)
        raise RecipeError(f"{what} from the Hugging Face Hub ({first_line(err)}); {fix}") from None


def find_column(features: datasets.Features, requested: str | None, preset: str | None, kind: str) -> str:
    if requested:
        if requested not in features:
            raise RecipeError(f"{kind} column '{requested}' not found; columns are: {', '.join(features)}")
        return requested
    if preset and preset in features:
        return preset
    typed, common = (datasets.Image, IMAGE_COLUMNS) if kind == "image" else (ClassLabel, LABEL_COLUMNS)
    found = [n for n, feature in features.items() if isinstance(feature, typed)] + [n for n in common if n in features]
    if found:
        return found[0]
    raise RecipeError(f"no {kind} column found; columns are: {', '.join(features)}; pass --{kind}_column_name")


def encode_labels(
    dataset_dict: DatasetDict, column: str, problem_type: str | None = None
) -> tuple[DatasetDict, list[str], str, bool]:
    """Label column -> `labels`: ClassLabel ids or multi-hot float32 rows; names: a ClassLabel's, else sorted values."""
    feature = next(iter(dataset_dict.values())).features[column]
    values = {split: d.data.column(column) for split, d in dataset_dict.items()}
    listed = any(pa.types.is_list(a.type) or pa.types.is_large_list(a.type) for a in values.values())
    if listed:
        if problem_type == SINGLE_LABEL:
            raise RecipeError(
                f"label column '{column}' holds lists of labels (multi-label): drop --problem_type {SINGLE_LABEL} "
                "or pass a column with one label per image"
            )
        for split, array in values.items():
            if array.null_count:
                raise RecipeError(f"split '{split}' has {array.null_count} rows without a label list in '{column}'")
        feature, values = getattr(feature, "feature", None), {s: pc.list_flatten(a) for s, a in values.items()}
    elif problem_type == MULTI_LABEL:
        logger.warning("--problem_type %s: every image has one label, trained as an independent sigmoid", MULTI_LABEL)
    if isinstance(feature, ClassLabel):
        names, lookup, source = list(feature.names), None, "ClassLabel"
        for split, array in values.items():  # load_splits has rejected empty splits
            low, high = pc.min(array).as_py(), pc.max(array).as_py()
            if len(array) and (low is None or low < 0 or high >= len(names)):
                bad = low if low is None or low < 0 else high
                raise RecipeError(
                    f"split '{split}' has label {bad} outside 0..{len(names) - 1} in column '{column}' "
                    f"(unlabelled rows?); drop them or pass a labelled split"
                )
    else:
        kinds = {split: array.type for split, array in values.items()}
        if len({str(t) for t in kinds.values()}) > 1:
            listing = ", ".join(f"{s}: {t}" for s, t in kinds.items())
            raise RecipeError(f"label column '{column}' has mixed types across splits ({listing}); use one type")
        label_type = next(iter(kinds.values()))
        if pa.types.is_floating(label_type):
            for split, array in values.items():  # pandas writes a missing label as NaN, which turns the column float
                missing = np.flatnonzero(pc.fill_null(pc.is_nan(array), True).to_numpy(zero_copy_only=False))
                if len(missing):
                    rows = ", ".join(map(str, missing[:10])) + (", ..." if len(missing) > 10 else "")
                    raise RecipeError(
                        f"split '{split}' has {len(missing)} NaN or missing label(s) in '{column}' (rows {rows}): "
                        "drop or label those rows"
                    )
        if not any(is_type(label_type) for is_type in LABEL_TYPES):
            raise RecipeError(f"label column '{column}' has type {label_type}; labels must be integers or strings")
        for split, array in values.items():
            if array.null_count:
                raise RecipeError(f"split '{split}' has {array.null_count} rows without a label in '{column}'")
        ordered = sorted({v for array in values.values() for v in pc.unique(array).to_pylist()})
        names, lookup, source = [str(v) for v in ordered], {v: i for i, v in enumerate(ordered)}, "sorted values"
    if len(names) < 2:
        raise RecipeError(f"label column '{column}' has {len(names)} class(es); classification needs at least 2")
    if multi := listed or problem_type == MULTI_LABEL:

        def multi_hot(batch):
            hot = np.zeros((len(batch[column]), len(names)), dtype=np.float32)
            for i, row in enumerate(batch[column]):
                hot[i, [v if lookup is None else lookup[v] for v in (row if listed else [row])]] = 1
            return {column: hot}

        features = next(iter(dataset_dict.values())).features.copy()
        features[column] = datasets.Sequence(Value("float32"), length=len(names))
        encoded = dataset_dict.map(multi_hot, batched=True, features=features, desc="Mapping labels to multi-hot rows")
    elif lookup is None:
        encoded = dataset_dict
    else:
        encoded = dataset_dict.map(
            lambda batch: {column: [lookup[v] for v in batch[column]]}, batched=True, desc="Mapping labels to ids"
        ).cast_column(column, ClassLabel(names=names))
    if column != LABELS:
        clash = [LABELS] if LABELS in next(iter(encoded.values())).features else []
        encoded = encoded.remove_columns(clash).rename_column(column, LABELS)
    return encoded, names, source, multi


def _split(dataset_dict: DatasetDict, requested: str | None, aliases: tuple[str, ...], kind: str) -> str | None:
    if requested:
        if requested not in dataset_dict:
            raise RecipeError(f"{kind} split '{requested}' does not exist; splits are: {', '.join(dataset_dict)}")
        return requested
    return next((name for name in aliases if name in dataset_dict), None)


def load_splits(data_args, seed: int = 42, cache_dir: str | None = None, need_train: bool = True) -> ImageSplits:
    """Load the dataset and return its train/validation/test splits with encoded labels."""
    source, preset = resolve_source(data_args.dataset_name)
    notes: list[str] = []
    dataset_dict = load_any(source, data_args.dataset_config_name, cache_dir, notes)
    train_split = data_args.train_split_name  # loaded for eval-only runs too: same label mapping, same carved split
    train_name = _split(dataset_dict, train_split if need_train else None, (train_split,), "train")
    val_name = _split(dataset_dict, data_args.validation_split_name, VALIDATION_SPLITS, "validation")
    test_name = _split(dataset_dict, data_args.test_split_name, ("test",), "test")
    used = [n for n in (train_name, val_name, test_name) if n]
    if not used:
        raise RecipeError(f"no train, validation or test split found; splits are: {', '.join(dataset_dict)}")
    dataset_dict = DatasetDict({n: dataset_dict[n] for n in dict.fromkeys(used)})
    if empty := [name for name, split in dataset_dict.items() if len(split) == 0]:
        raise RecipeError(f"split '{empty[0]}' is empty")
    features = next(iter(dataset_dict.values())).features
    image_column = find_column(features, data_args.image_column_name, preset and preset.image_column, "image")
    label_column = find_column(features, data_args.label_column_name, preset and preset.label_column, "label")
    if image_column == label_column:
        raise RecipeError(f"image and label columns are both '{image_column}'")
    dataset_dict = dataset_dict.select_columns([c for c in features if c in (image_column, label_column)])
    if isinstance(features[image_column], Value) and Path(source).expanduser().exists():
        dataset_dict = resolve_paths(dataset_dict, image_column, Path(source).expanduser())
    # Decode lazily and by hand, so a corrupt file is counted instead of raising inside datasets.
    if not isinstance(features[image_column], datasets.Image) or features[image_column].decode:
        try:
            dataset_dict = dataset_dict.cast_column(image_column, datasets.Image(decode=False))
        except (TypeError, ValueError, pa.ArrowException) as err:
            raise RecipeError(
                f"column '{image_column}' does not hold images ({features[image_column]}): {first_line(err)}"
            ) from None
    problem_type = getattr(data_args, "problem_type", None)
    dataset_dict, names, source_kind, multi = encode_labels(dataset_dict, label_column, problem_type)
    train, validation, test = (dataset_dict[n] if n else None for n in (train_name, val_name, test_name))
    if need_train:
        refuse_classes_without_images(train, names)
    if train is not None and validation is None:
        train, validation = carve_validation(train, data_args.validation_split_percentage, len(names), seed, notes)
    if not need_train:
        train = None
    if train is not None and data_args.max_train_samples:
        train = sample(train, data_args.max_train_samples, seed, "train", notes)
    if data_args.max_eval_samples:
        validation = validation and sample(validation, data_args.max_eval_samples, seed, "validation", notes)
        test = test and sample(test, data_args.max_eval_samples, seed, "test", notes)
    return ImageSplits(train, validation, test, image_column, names, source_kind, notes=notes, multi_label=multi)


def refuse_classes_without_images(train: Dataset | None, names: list[str], had: Dataset | None = None) -> None:
    """A class no training image shows: the model could never learn it, and would be scored on it. `had`: the same
    split before decoding left its unreadable images out; then only the classes it had count (a sample of train,
    --max_train_samples, may lack some)."""
    if train is None or not _single(train):
        return
    missing = np.bincount(label_array(train), minlength=len(names)) == 0
    if had is not None:
        missing &= np.bincount(label_array(had), minlength=len(names)) > 0
    if names_missing := [names[i] for i in np.flatnonzero(missing)]:
        raise RecipeError(
            f"{len(names_missing)} class(es) have no training images: {', '.join(names_missing[:5])}"
            f"{', ...' if len(names_missing) > 5 else ''}; add training images of them, or remove them (an empty "
            "class folder, one whose images are all unreadable or empty files, or validation/test images of a class "
            "train lacks)"
        )


def write_labels(splits: ImageSplits, output_dir: str) -> None:
    """Label names, their source and how images were stored, next to the model (what `labels_of_model` reads)."""
    labels = {"names": splits.label_names, "source": splits.label_source, "storage_shape": list(splits.storage_shape)}
    Path(output_dir, LABELS_FILE).write_text(json.dumps({**labels, "white": splits.white}, indent=2))


def labels_of_model(model_path: str | None, config) -> ImageSplits:
    """Predict-only runs: a model's labels and image storage from its labels.json (else the config's id2label)."""
    record = Path(model_path or "").expanduser() / LABELS_FILE
    multi = getattr(config, "problem_type", None) == MULTI_LABEL
    if record.is_file():
        saved = json.loads(record.read_text())
        shape, white = tuple(saved["storage_shape"]), saved.get("white", 255.0)
        return ImageSplits(None, None, None, PIXELS, saved["names"], saved["source"], shape, white, multi_label=multi)
    names = [str(config.id2label.get(i, i)) for i in range(config.num_labels)]
    return ImageSplits(None, None, None, PIXELS, names, "the model's config", multi_label=multi)


def resolve_paths(dataset_dict: DatasetDict, column: str, source: Path) -> DatasetDict:
    """Image paths listed in a CSV/JSON file (or the files of a folder) are relative to that file's folder."""
    base = source if source.is_dir() else source.parent

    def absolute(batch):
        return {column: [p if p is None or os.path.isabs(p) or "://" in p else str(base / p) for p in batch[column]]}

    return dataset_dict.map(absolute, batched=True, desc=f"Resolving image paths against {base}")


def sample(split: Dataset, cap: int, seed: int, name: str, notes: list[str]) -> Dataset:
    """At most `cap` rows, seeded and stratified by label (a class-sorted split's first rows hold few classes)."""
    if cap >= len(split):
        return split
    try:
        kept = stratified_split(split, cap, len(split) - cap, seed)[0]
        how = "stratified"
    except ValueError:  # multi-label, a class with a single row, or fewer rows than classes: cannot stratify
        kept = split.shuffle(seed=seed).select(range(cap))
        how = "not stratified: " + ("some class is too small" if _single(split) else "multi-label")
    notes.append(f"{name}: a sample of {cap} of its {len(split)} images (seed {seed}, {how})")
    logger.warning("Sampled %d of %d %s images (seed %d, %s)", cap, len(split), name, seed, how)
    return kept


def stratified_split(split: Dataset, n_train: int, n_test: int, seed: int) -> tuple[Dataset, Dataset]:
    """datasets' `train_test_split(stratify_by_column=...)` (the same rows) without its row-by-row label reading (2-5 s
    per 50k images). ValueError where it cannot stratify: multi-label, a single-row class, fewer rows than classes."""
    if not _single(split):
        raise ValueError("multi-label")
    rng = np.random.default_rng(seed)
    kept, held_out = next(stratified_shuffle_split_generate_indices(label_array(split), n_train, n_test, rng))
    return split.select(kept), split.select(held_out)


def label_array(split: Dataset) -> np.ndarray:
    """The label column as one array: `split[LABELS]` is a lazy column that numpy reads row by row (0.3 s per 50k)."""
    return split.select_columns([LABELS]).with_format("numpy")[:][LABELS]


def _single(split: Dataset) -> bool:
    return isinstance(split.features[LABELS], ClassLabel)


def carve_validation(
    train: Dataset, fraction: float, num_classes: int, seed: int, notes: list[str]
) -> tuple[Dataset, Dataset]:
    """A seeded validation split from train, stratified so every class is represented in proportion."""
    size = max(round(fraction * len(train)), num_classes)  # stratifying needs at least one image per class
    if len(train) - size < num_classes:
        raise RecipeError(
            f"train has {len(train)} images for {num_classes} classes: too few to carve a "
            "validation split; pass --validation_split_name"
        )
    try:
        kept, held_out = stratified_split(train, len(train) - size, size, seed)
        how = "stratified"
    except ValueError:  # multi-label, or some class has a single image: stratification is impossible
        carved = train.train_test_split(test_size=size, seed=seed)
        kept, held_out = carved["train"], carved["test"]
        how = "not stratified: " + ("some class has fewer than 2 images" if _single(train) else "multi-label")
    notes.append(f"validation: {size} of the {len(train)} train images, carved out of train (seed {seed}, {how})")
    logger.warning(
        "No validation split: carved %d of %d train images into one (seed %d, %s)", size, len(train), seed, how
    )
    return kept, held_out


def load_image_folder(folder: str) -> Dataset:
    """Every image under a folder (or one image file), for --do_predict; keeps the relative file names. A folder is
    walked as a dataset folder is (folder_index.py: hidden files left out, symlinked folders followed)."""
    root = Path(folder)
    if root.is_file():
        files, root = [root.name], root.parent
    elif root.is_dir():
        files = image_files(root)
    else:
        raise RecipeError(f"--predict_images path not found: {folder}")
    if not files:
        raise RecipeError(f"no {IMAGES} found under {folder}")
    return Dataset.from_dict(
        {"file": files, "image": [{"path": str(root / f), "bytes": None} for f in files]},
        features=datasets.Features({"file": Value("string"), "image": datasets.Image(decode=False)}),
    )


def balanced_weights(splits: ImageSplits) -> torch.Tensor:
    """Inverse class frequency in train (scikit-learn's "balanced"); multi-label: BCE pos_weight, negatives / positives."""
    if splits.multi_label:
        positives = label_array(splits.train).sum(0)
        weights = (len(splits.train) - positives) / np.maximum(positives, 1)
        logger.warning("--class_weights balanced: positive weights %.3g to %.3g", weights.min(), weights.max())
        return torch.tensor(weights, dtype=torch.float32)
    counts = class_counts(splits)
    logger.warning("--class_weights balanced: train has %d to %d images per class", counts.min(), counts.max())
    return torch.tensor(counts.sum() / (len(counts) * np.maximum(counts, 1)), dtype=torch.float32)


def class_counts(splits: ImageSplits) -> np.ndarray:
    return np.bincount(label_array(splits.train), minlength=len(splits.label_names))


def balanced_sample_weights(splits: ImageSplits) -> torch.Tensor:
    """One weight per training image, 1 / its class's count: a weighted sampler then draws every class equally."""
    if splits.multi_label:
        raise RecipeError("--class_weights balanced_sampler needs one label per image; multi-label runs: balanced")
    counts = class_counts(splits)
    logger.warning("--class_weights balanced_sampler: train has %d to %d images per class", counts.min(), counts.max())
    return torch.tensor(1.0 / np.maximum(counts, 1), dtype=torch.float64)[label_array(splits.train)]


def imbalance(splits: ImageSplits) -> tuple[int, int] | None:
    """(fewest, most) training images per class when the most is over 1.5x the fewest; None when balanced enough."""
    if splits.multi_label or not isinstance(splits.train, Dataset):  # none, or a stream (not counted ahead)
        return None
    counts = class_counts(splits)
    return (int(counts.min()), int(counts.max())) if counts.max() > 1.5 * counts.min() else None


def write_skipped(splits: ImageSplits, output_dir: str) -> None:
    if splits.skipped:
        os.makedirs(output_dir, exist_ok=True)
        Path(output_dir, "skipped_images.json").write_text(json.dumps(splits.skipped, indent=2))

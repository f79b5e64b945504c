import io
import json
import os
from collections import Counter
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import datasets
import numpy as np
import pytest
from datasets import ClassLabel, Dataset, DatasetDict, Features, Image, Value
from PIL import Image as PILImage

from vit_recipes.core.arguments import DataArguments
from vit_recipes.core.errors import RecipeError
from vit_recipes.data import data as data_module
from vit_recipes.data.data import load_image_folder, load_splits
from vit_recipes.data.decoding import PixelCollator, decode_splits, storage_format


def data_args(name, **kw):
    base = dict(
        dataset_name=str(name),
        dataset_config_name=None,
        image_column_name=None,
        label_column_name=None,
        train_split_name="train",
        validation_split_name=None,
        test_split_name=None,
        validation_split_percentage=0.1,
        max_train_samples=None,
        max_eval_samples=None,
    )
    return SimpleNamespace(**{**base, **kw})


def png(array) -> bytes:
    buffer = io.BytesIO()
    PILImage.fromarray(array).save(buffer, format="PNG")
    return buffer.getvalue()


def tiny_split(labels, size=8, feature=None, mode_image=None):
    images = [
        mode_image or PILImage.fromarray(np.full((size, size, 3), 10 * i % 255, np.uint8)) for i in range(len(labels))
    ]
    features = Features({"image": Image(), "label": feature or Value("string")})
    return Dataset.from_dict({"image": images, "label": labels}, features=features)


# ---------------------------------------------------------------------------------------------------- presets


@pytest.mark.parametrize(
    "preset, hub_id, image_col, label_col, splits",
    [
        ("cifar100", "uoft-cs/cifar100", "img", "fine_label", ("train", "test")),
        ("food101", "ethz/food101", "image", "label", ("train", "validation")),
        ("beans", "AI-Lab-Makerere/beans", "image", "labels", ("train", "validation", "test")),
    ],
)
def test_presets_load_hub_schema(preset, hub_id, image_col, label_col, splits, tmp_path, monkeypatch):
    """Each preset against a local replica with the Hub dataset's columns and splits."""
    names = [f"c{i}" for i in range(4)]
    extra = {"coarse_label": ClassLabel(names=["a", "b"])} if preset == "cifar100" else {}
    features = Features({image_col: Image(), label_col: ClassLabel(names=names), **extra})
    replica = DatasetDict()
    for split in splits:
        labels = np.tile(np.arange(4), 5)
        columns = {
            image_col: [PILImage.fromarray(np.full((8, 8, 3), v * 50, np.uint8)) for v in labels],
            label_col: labels,
        }
        if extra:
            columns["coarse_label"] = labels // 2
        replica[split] = Dataset.from_dict(columns, features=features)
    calls = []

    def fake_load_dataset(path, name=None, **kwargs):
        calls.append(path)
        return replica

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    loaded = load_splits(data_args(preset))
    assert calls == [hub_id]
    assert loaded.image_column == image_col
    assert loaded.label_names == names
    assert loaded.train.column_names == [image_col, "labels"]
    assert (loaded.test is not None) == ("test" in splits)
    if "validation" not in splits:  # carved from train, stratified
        assert len(loaded.validation) == 4 and len(loaded.train) == 16  # at least one per class
    else:
        assert len(loaded.validation) == 20


def test_cifar_like_parquet_folder(cifar_like):
    loaded = load_splits(data_args(cifar_like, label_column_name="fine_label"))
    assert len(loaded.label_names) == 100 and loaded.label_source == "ClassLabel"
    assert len(loaded.test) == 100
    # stratified carve: every class keeps train images, validation draws evenly
    assert len(loaded.validation) == 100
    assert max(Counter(loaded.validation["labels"]).values()) == 1


def test_the_carved_validation_and_samples_are_datasets_own_stratified_split():
    """The carve and the sample caps read the labels as one array but keep datasets' sampler: the same images as its
    train_test_split(stratify_by_column=...), in the same order."""
    labels = np.random.default_rng(0).integers(0, 7, 300)
    train = Dataset.from_dict({"labels": labels, "i": np.arange(300)}).cast_column("labels", ClassLabel(num_classes=7))
    kept, held_out = data_module.carve_validation(train, 0.2, 7, seed=5, notes=[])
    reference = train.train_test_split(test_size=60, seed=5, stratify_by_column="labels")
    assert kept["i"][:] == reference["train"]["i"][:] and held_out["i"][:] == reference["test"]["i"][:]
    sampled = data_module.sample(train, 50, seed=5, name="train", notes=[])  # --max_*_samples: the same sampler
    assert (
        sampled["i"][:] == train.train_test_split(train_size=50, seed=5, stratify_by_column="labels")["train"]["i"][:]
    )


def test_evaluation_only_carves_the_same_validation(cifar_like):
    trained = load_splits(data_args(cifar_like))
    evaluated = load_splits(data_args(cifar_like), need_train=False)
    assert evaluated.train is None
    assert evaluated.validation["labels"] == trained.validation["labels"]
    assert evaluated.label_names == trained.label_names


def test_unknown_dataset_is_one_line():
    with pytest.raises(RecipeError, match="could not load 'nobody/no-such-dataset'|neither a local path"):
        load_splits(data_args("nobody/no-such-dataset"))
    with pytest.raises(RecipeError, match="dataset path not found"):
        load_splits(data_args("./missing/folder"))


# ---------------------------------------------------------------------------------------------------- formats


def test_imagefolder_with_string_labels_and_save_to_disk(tmp_path):
    for split, per_class in (("train", 6), ("test", 2)):
        for label in ("zebra", "apple", "mango"):
            folder = tmp_path / "tree" / split / label
            folder.mkdir(parents=True)
            for i in range(per_class):
                PILImage.fromarray(np.full((10, 12, 3), i * 20, np.uint8)).save(folder / f"{i}.png")
    loaded = load_splits(data_args(tmp_path / "tree"))
    assert loaded.label_names == ["apple", "mango", "zebra"]  # imagefolder's sorted ClassLabel
    assert len(loaded.test) == 6

    # a save_to_disk folder with plain string labels: sorted, deterministic mapping
    ds = DatasetDict(train=tiny_split(["b", "a", "c", "a", "b", "c"] * 4), test=tiny_split(["c", "a"]))
    ds.save_to_disk(str(tmp_path / "saved"))
    loaded = load_splits(data_args(tmp_path / "saved"))
    assert loaded.label_names == ["a", "b", "c"] and loaded.label_source == "sorted values"
    assert loaded.test["labels"] == [2, 0]

    # an arrow file, integer labels without ClassLabel
    ds = Dataset.from_dict(
        {"img": [png(np.zeros((4, 4, 3), np.uint8))] * 8, "target": [7, 3, 7, 3, 9, 9, 3, 7]},
        features=Features({"img": Image(), "target": Value("int64")}),
    )
    ds.to_parquet(str(tmp_path / "one.parquet"))
    loaded = load_splits(data_args(tmp_path / "one.parquet", validation_split_percentage=0.4))
    assert loaded.label_names == ["3", "7", "9"]


# ---------------------------------------------------------------------------------------------------- bad input


def save(tmp_path, **splits) -> Path:
    DatasetDict(splits).save_to_disk(str(tmp_path / "ds"))
    return tmp_path / "ds"


def test_missing_columns_list_what_there_is(tmp_path):
    path = save(tmp_path, train=tiny_split(["a", "b"] * 4))
    with pytest.raises(RecipeError, match="label column 'y_true' not found; columns are: image, label"):
        load_splits(data_args(path, label_column_name="y_true"))
    path = save(tmp_path, train=Dataset.from_dict({"foo": [1, 2], "bar": ["x", "y"]}))
    with pytest.raises(RecipeError, match="no image column found; columns are: foo, bar"):
        load_splits(data_args(path))


def test_missing_split_and_empty_split(tmp_path):
    path = save(tmp_path, train=tiny_split(["a", "b"] * 4), test=tiny_split(["a"]))
    with pytest.raises(RecipeError, match="validation split 'dev2' does not exist; splits are: train, test"):
        load_splits(data_args(path, validation_split_name="dev2"))
    path = tmp_path / "pq"
    for name, split in (("train", tiny_split(["a", "b"] * 4)), ("test", tiny_split([]))):
        split.to_parquet(str(path / f"{name}.parquet"))
    with pytest.raises(RecipeError, match="split 'test' is empty"):
        load_splits(data_args(path))


def test_labels_out_of_range_and_mixed_types(tmp_path):
    feature = ClassLabel(names=["a", "b"])
    bad = Dataset.from_dict(
        {"image": [png(np.zeros((4, 4, 3), np.uint8))] * 3, "label": [0, 1, -1]},
        features=Features({"image": Image(), "label": Value("int64")}),
    )
    path = save(tmp_path, train=tiny_split([0, 1] * 4, feature=feature), test=bad.cast_column("label", feature))
    with pytest.raises(RecipeError, match="split 'test' has label -1 outside 0..1"):
        load_splits(data_args(path))
    ints = Dataset.from_dict(
        {"image": [png(np.zeros((4, 4, 3), np.uint8))] * 2, "label": [0, 1]},
        features=Features({"image": Image(), "label": Value("int64")}),
    )
    path = save(tmp_path, train=tiny_split(["a", "b"] * 4), test=ints)
    with pytest.raises(RecipeError, match="mixed types across splits"):
        load_splits(data_args(path))


def test_nan_labels_are_named_with_their_rows(tmp_path):
    """pandas writes a missing label as NaN (the column turns float): say NaN and where, not 'type double'."""
    nan = float("nan")
    floats = Dataset.from_dict(
        {"image": [png(np.zeros((4, 4, 3), np.uint8))] * 6, "label": [0.0, 1.0, nan, 1.0, 0.0, nan]},
        features=Features({"image": Image(), "label": Value("float64")}),
    )
    with pytest.raises(RecipeError, match=r"split 'train' has 2 NaN or missing label\(s\) in 'label' \(rows 2, 5\)"):
        load_splits(data_args(save(tmp_path, train=floats)))
    with_nulls = Dataset.from_dict(  # NaN turned into nulls on the way (pandas -> arrow): the same message
        {"image": [png(np.zeros((4, 4, 3), np.uint8))] * 4, "label": [0.0, None, 1.0, nan]},
        features=Features({"image": Image(), "label": Value("float64")}),
    )
    with pytest.raises(RecipeError, match=r"split 'train' has 2 NaN or missing label\(s\) in 'label' \(rows 1, 3\)"):
        load_splits(data_args(save(tmp_path / "nulls", train=with_nulls)))


# ---------------------------------------------------------------------------------------------------- decoding


def mode_images() -> dict[str, PILImage.Image]:
    rgb = np.random.default_rng(0).integers(0, 256, (12, 10, 3), dtype=np.uint8)
    base = PILImage.fromarray(rgb)
    rgba = base.convert("RGBA")
    rgba.putalpha(128)
    wide = np.linspace(0, 65535, 120, dtype=np.uint16).reshape(12, 10)
    return {
        "RGB": base,
        "L": base.convert("L"),
        "LA": base.convert("LA"),
        "P": base.convert("P"),
        "RGBA": rgba,
        "CMYK": base.convert("CMYK"),
        "I;16": PILImage.fromarray(wide),
    }


def test_every_pil_mode_decodes_to_rgb_uint8():
    from vit_recipes.data.images import decode_to_chw, to_rgb

    for mode, image in mode_images().items():
        assert image.mode == mode
        buffer = io.BytesIO()
        image.save(buffer, format="TIFF" if mode in ("CMYK", "I;16") else "PNG")
        array, resized = decode_to_chw({"bytes": buffer.getvalue(), "path": None}, 16, 16)
        assert array.shape == (3, 16, 16) and array.dtype == np.uint8 and resized, mode
    # 16-bit greyscale is rescaled, not clipped to white
    grey = np.asarray(to_rgb(mode_images()["I;16"]))
    assert grey.min() == 0 and grey.max() == 255 and 100 < grey.mean() < 155
    # transparency is composited on white, like transformers' convert_to_rgb
    clear = PILImage.new("RGBA", (4, 4), (0, 0, 0, 0))
    assert np.asarray(to_rgb(clear)).min() == 255


def test_transparent_palettes_float_images_and_exif_rotation_decode_as_shown():
    """A palette PNG's transparent colour is white (as RGBA's alpha); a float image of values in [0, 1] is scaled by
    1.0, not 255 (near black); a photo stored on its side is turned upright by its EXIF orientation."""
    from vit_recipes.data.images import decode_to_chw, to_rgb

    buffer = io.BytesIO()
    PILImage.new("P", (4, 4), 0).save(buffer, format="PNG", transparency=0)  # colour 0: black, transparent
    assert decode_to_chw({"bytes": buffer.getvalue(), "path": None}, 4, 4)[0].min() == 255
    assert np.asarray(to_rgb(PILImage.fromarray(np.full((4, 4), 0.5, np.float32)))).max() == 127
    stored = np.zeros((4, 8, 3), np.uint8)
    stored[:, :4, 0], stored[:, 4:, 2] = 255, 255  # red left, blue right; orientation 6: turn 90 degrees clockwise
    exif, buffer = PILImage.Exif(), io.BytesIO()
    exif[0x0112] = 6
    PILImage.fromarray(stored).save(buffer, format="JPEG", exif=exif.tobytes(), quality=95)
    upright, done = decode_to_chw({"bytes": buffer.getvalue(), "path": None}, 8, 4)
    assert done == "" and upright[0, :3].mean() > 200 and upright[0, 5:].mean() < 50  # red on top, as shown


def test_corrupt_images_are_skipped_counted_and_reported(tmp_path):
    good = png(np.full((8, 8, 3), 100, np.uint8))
    split = Dataset.from_dict(
        {
            "image": [
                {"bytes": good, "path": None},
                {"bytes": b"not an image", "path": None},
                {"bytes": good, "path": None},
                {"bytes": good[:40], "path": None},
            ],
            "labels": [0, 0, 1, 1],  # each class keeps a readable image (else it is refused: test_folder_index.py)
        },
        features=Features({"image": Image(decode=False), "labels": ClassLabel(names=["a", "b"])}),
    )
    validation, test = split.select([3, 2, 1, 0]), split.select([2, 3])  # indices mappings, as a carved split has
    splits = data_module.ImageSplits(split, validation, test, "image", ["a", "b"], "ClassLabel")
    with mock.patch.object(Dataset, "map", autospec=True, side_effect=Dataset.map) as passes:
        decoded = decode_splits(splits, image_size=8)
    assert passes.call_count == 2  # train; validation and test together (one pool of processes to start)
    unreadable = {
        name: [{"row": row, "image": None, "problem": "unreadable"} for row in rows]
        for name, rows in (("train", (1, 3)), ("validation", (0, 2)), ("test", (1,)))
    }
    assert (len(decoded.train), len(decoded.validation), decoded.test["labels"]) == (2, 2, [1])
    assert decoded.skipped == unreadable and decoded.validation["pixels"] == decoded.train["pixels"]
    assert decoded.notes == [  # the changes made to the data, which the log and the model card list
        "train: 2 image(s) skipped (not found, too large or unreadable)",
        "validation: 2 image(s) skipped (not found, too large or unreadable)",
        "test: 1 image(s) skipped (not found, too large or unreadable)",
    ]
    data_module.write_skipped(decoded, str(tmp_path))
    assert json.loads((tmp_path / "skipped_images.json").read_text()) == unreadable
    broken = split.select([1, 3])
    with pytest.raises(
        RecipeError, match=r"every image in split 'train' is missing, corrupt or unreadable, e.g. row 0"
    ):
        decode_splits(data_module.ImageSplits(broken, None, None, "image", ["a", "b"], "ClassLabel"), 8)


def image_split(arrays, labels=None) -> Dataset:
    labels = labels if labels is not None else [i % 2 for i in range(len(arrays))]
    return Dataset.from_dict(
        {"image": [{"bytes": png(a), "path": None} for a in arrays], "labels": labels},
        features=Features({"image": Image(decode=False), "labels": ClassLabel(names=["a", "b"])}),
    )


def test_storage_shape_native_for_small_square_otherwise_256():
    small = image_split([np.zeros((32, 32, 3), np.uint8)] * 3)
    assert storage_format(small, "image", 224, None).shape == (32, 32)
    mixed = image_split([np.zeros((h, 300, 3), np.uint8) for h in (280, 500)])
    assert storage_format(mixed, "image", 224, None).shape == (256, 256)
    assert storage_format(mixed, "image", 224, 128).shape == (128, 128)
    spread = image_split([np.zeros((side, side, 3), np.uint8) for side in (16, 16, 24, 32)])  # no size held by most
    assert storage_format(spread, "image", 224, None).shape == (256, 256)


def test_an_outlier_size_is_resized_to_the_common_one_and_counted(caplog):
    """One 1x1 image among 8x8 ones: stored at 8x8 (it used to turn the whole set into 9x9), and said so."""
    arrays = [np.full((8, 8, 3), 40 * i, np.uint8) for i in range(5)] + [np.full((1, 1, 3), 200, np.uint8)]
    splits = data_module.ImageSplits(image_split(arrays), None, None, "image", ["a", "b"], "ClassLabel")
    decoded = decode_splits(splits, image_size=8)
    assert decoded.storage_shape == (8, 8) and len(decoded.train) == 6
    assert decoded.notes == ["train: 1 image(s) not 8x8, the common size, resized to cover it and centre-cropped"]
    assert "train: 1 image(s) not 8x8, the common size, resized to cover it and centre-cropped" in caplog.text
    outlier = np.frombuffer(decoded.train[5]["pixels"], np.uint8)
    assert outlier.size == 3 * 8 * 8 and (outlier == 200).all()  # the 1x1 image, upsampled: one colour
    assert decoded.train[0]["pixels"] == np.full((3, 8, 8), 0, np.uint8).tobytes()  # the others untouched


def test_high_bit_depth_images_scale_by_one_white_level_for_the_whole_dataset():
    """12-bit data in 16-bit PNGs: every image is scaled by 255/4095 (it was per image: a dim one kept its values
    as if 8-bit, a bright one was divided by 65535, near black)."""

    def sixteen_bit(value: int) -> bytes:
        buffer = io.BytesIO()
        PILImage.fromarray(np.full((4, 4), value, np.uint16)).save(buffer, format="PNG")
        return buffer.getvalue()

    split = Dataset.from_dict(
        {"image": [{"bytes": sixteen_bit(v), "path": None} for v in (250, 300, 4095)], "labels": [0, 1, 0]},
        features=Features({"image": Image(decode=False), "labels": ClassLabel(names=["a", "b"])}),
    )
    splits = data_module.ImageSplits(split, None, None, "image", ["a", "b"], "ClassLabel")
    decoded = decode_splits(splits, image_size=4)
    assert decoded.white == 4095
    levels = [np.frombuffer(decoded.train[i]["pixels"], np.uint8)[0] for i in range(3)]
    assert levels == [int(250 * 255 / 4095), int(300 * 255 / 4095), 255]


def test_paths_in_a_csv_resolve_against_its_folder_and_a_missing_file_is_named(tmp_path, monkeypatch, caplog):
    folder = tmp_path / "data"
    (folder / "images").mkdir(parents=True)
    rows = ["image,label"]
    for i in range(12):
        PILImage.fromarray(np.full((8, 8, 3), 20 * i, np.uint8)).save(folder / "images" / f"{i}.png")
        rows.append(f"images/{i}.png,{'cat' if i % 2 else 'dog'}")
    rows.append("images/gone.png,cat")
    (folder / "list.csv").write_text("\n".join(rows) + "\n")
    monkeypatch.chdir(tmp_path)  # elsewhere than the CSV: paths still resolve against its folder
    loaded = load_splits(data_args(folder / "list.csv", validation_split_percentage=0.2))
    decoded = decode_splits(loaded, image_size=8)
    assert len(decoded.train) + len(decoded.validation) == 12
    [(split, [item])] = decoded.skipped.items()
    assert item["image"] == str(folder / "images" / "gone.png") and item["problem"] == "not found"
    assert f"Skipped 1 image(s) in split '{split}': {folder / 'images' / 'gone.png'} (not found)" in caplog.text


def test_the_validation_carve_and_sample_caps_are_logged_and_noted(tmp_path, caplog):
    path = save(tmp_path, train=tiny_split(["a", "b"] * 10))
    loaded = load_splits(data_args(path, validation_split_percentage=0.2, max_train_samples=8))
    assert loaded.notes == [
        "validation: 4 of the 20 train images, carved out of train (seed 42, stratified)",
        "train: a sample of 8 of its 16 images (seed 42, stratified)",
    ]
    assert "No validation split: carved 4 of 20 train images into one (seed 42, stratified)" in caplog.text


def test_parallel_decode_equals_serial():
    """Every core decodes by default (--preprocessing_num_workers): the same bytes as one process."""
    rng = np.random.default_rng(0)
    arrays = [rng.integers(0, 256, (8, 8, 3), dtype=np.uint8) for _ in range(1200)]  # > 1,000: decoded in parallel
    splits = data_module.ImageSplits(image_split(arrays), None, None, "image", ["a", "b"], "ClassLabel")
    serial, parallel = decode_splits(splits, 8, num_proc=1), decode_splits(splits, 8, num_proc=2)
    assert serial.train["pixels"] == parallel.train["pixels"] and len(parallel.train) == 1200
    assert DataArguments().preprocessing_num_workers == os.cpu_count()


def test_collator_delivers_uint8_batches(cifar_like):
    loaded = load_splits(data_args(cifar_like, max_train_samples=8))
    decoded = decode_splits(loaded, image_size=224)
    assert decoded.storage_shape == (32, 32)
    batch = PixelCollator(decoded.storage_shape)([decoded.train[i] for i in range(8)])
    assert batch["pixel_values"].shape == (8, 3, 32, 32)
    assert str(batch["pixel_values"].dtype) == "torch.uint8"
    assert batch["labels"].tolist() == decoded.train["labels"][:8]


def test_predict_folder_listing(tmp_path):
    (tmp_path / "sub").mkdir()
    PILImage.fromarray(np.zeros((5, 5, 3), np.uint8)).save(tmp_path / "sub" / "a.png")
    PILImage.fromarray(np.zeros((5, 5, 3), np.uint8)).save(tmp_path / "b.jpg")
    (tmp_path / "notes.txt").write_text("not an image")
    listing = load_image_folder(str(tmp_path))
    assert listing["file"] == ["b.jpg", "sub/a.png"]
    (tmp_path / "empty").mkdir()
    with pytest.raises(RecipeError, match="no images"):
        load_image_folder(str(tmp_path / "empty"))


def test_sample_caps_are_seeded_stratified_and_said(tmp_path, caplog):
    """--max_eval_samples on a class-sorted test split once took its first rows: one class, a meaningless score."""
    from collections import Counter

    labels = [c for c in "abcdefghij" for _ in range(20)]  # sorted by class, as many test splits are
    path = save(tmp_path, train=tiny_split(labels), test=tiny_split(labels))
    with caplog.at_level("WARNING", logger="vit_recipes.data.data"):
        splits = load_splits(data_args(path, max_eval_samples=50))
    assert sorted(Counter(splits.test["labels"]).values()) == [5] * 10  # every class, in proportion
    assert "Sampled 50 of 200 test images (seed 42, stratified)" in caplog.text
    assert load_splits(data_args(path, max_eval_samples=50)).test["labels"] == splits.test["labels"]  # seeded


def test_balanced_sampler_draws_classes_equally_and_refuses_multi_label():
    from datasets import Dataset

    from vit_recipes.data.data import ImageSplits, balanced_sample_weights, imbalance

    train = Dataset.from_dict({"labels": [0] * 9 + [1] * 3})
    splits = ImageSplits(train, None, None, "image", ["a", "b"], "ClassLabel")
    weights = balanced_sample_weights(splits)
    assert weights[:9].sum() == pytest.approx(weights[9:].sum())  # each class: half of the draws
    assert imbalance(splits) == (3, 9)
    multi = ImageSplits(Dataset.from_dict({"labels": [[1.0, 0.0]] * 2}), None, None, "image", ["a", "b"], "ClassLabel",
                        multi_label=True)  # fmt: skip
    with pytest.raises(RecipeError, match="balanced_sampler needs one label per image"):
        balanced_sample_weights(multi)
    assert imbalance(multi) is None


def test_an_empty_data_file_and_a_label_column_of_mixed_types_are_one_line_each(tmp_path):
    """datasets raises DatasetGenerationError ("An error occurred while generating the dataset") for both."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from vit_recipes.data.data import load_any

    empty = tmp_path / "empty" / "data"
    empty.mkdir(parents=True)
    schema = pa.schema([("image", pa.struct([("bytes", pa.binary()), ("path", pa.string())])), ("label", pa.int64())])
    rows = {"image": [{"bytes": b"x", "path": None}] * 2, "label": [0, 1]}
    pq.write_table(pa.table(rows, schema=schema), empty / "train-00000-of-00001.parquet")
    pq.write_table(pa.table({"image": [], "label": []}, schema=schema), empty / "test-00000-of-00001.parquet")
    with pytest.raises(RecipeError, match=r"^a data file in .*empty has no rows: remove it, or fill it"):
        load_any(str(tmp_path / "empty"))
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    (mixed / "train.csv").write_text("image,label\na.png,1\nb.png,2\n")
    (mixed / "test.csv").write_text("image,label\na.png,1\nb.png,d4\n")
    with pytest.raises(RecipeError, match=r"^a column in .*mixed mixes types: 'd4' where the other files have int64"):
        load_any(str(mixed))


def test_a_class_without_training_images_is_one_line(tmp_path):
    """A label only the test split has (or an empty class): the model could never predict it, silently."""
    from PIL import Image as PILImage

    from vit_recipes.core.arguments import DataArguments
    from vit_recipes.data.data import load_splits

    for split, classes in (("train", ("cat", "dog")), ("test", ("cat", "dog", "bird"))):
        for name in classes:
            (tmp_path / split / name).mkdir(parents=True)
            for i in range(3):
                PILImage.fromarray(np.full((8, 8, 3), 40 * i, np.uint8)).save(tmp_path / split / name / f"{i}.png")
    with pytest.raises(RecipeError, match=r"^1 class\(es\) have no training images: bird; add training images"):
        load_splits(DataArguments(dataset_name=str(tmp_path)))


def test_a_batch_larger_than_the_training_set_is_one_line(cifar_like, tmp_path):
    """Each step was the whole set and the card recorded a batch of 10^9."""
    from vit_recipes.core.arguments import parse_args
    from vit_recipes.steps import load_data

    args = parse_args(["--dataset_name", str(cifar_like), "--output_dir", str(tmp_path), "--use_cpu", "true",
                       "--per_device_train_batch_size", "1000000000", "--do_train", "true", "--report_to", "none"])  # fmt: skip
    with pytest.raises(RecipeError, match=r"is 1,000,000,000 images a step, more than the 300 training images"):
        load_data(args)

"""The data path at real sizes: a folder indexed in one walk, and the choice between a decoded copy and decoding per
batch in the DataLoader workers (src/vit_recipes/data/folder_index.py, decoding.py)."""

import csv
import errno
import io
import json
import os
import shutil
import sys
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import datasets
import numpy as np
import pytest
import torch
from conftest import ROOT, run_args
from PIL import Image as PILImage

from vit_recipes.core.errors import RecipeError
from vit_recipes.data import decoding
from vit_recipes.data.data import ImageSplits, load_any
from vit_recipes.data.decoding import DecodingCollator, PixelCollator, decode_splits, prepare_images, storage_format

sys.path.insert(0, str(ROOT / "tools"))
from jpeg_folder import write_folder  # noqa: E402


@pytest.fixture(scope="module")
def photos(tmp_path_factory) -> Path:
    """An ImageNet-shaped folder in miniature: 60 JPEGs of 64-96 px in 3 classes, train/ and validation/."""
    root = tmp_path_factory.mktemp("photos")
    write_folder(root, images=60, classes=3, validation=0.2, sides=(64, 96), workers=1)
    return root


def png(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    PILImage.fromarray(array).save(buffer, format="PNG")
    return buffer.getvalue()


def splits_of(folder: Path) -> ImageSplits:
    loaded = load_any(str(folder))
    names = loaded["train"].features["label"].names
    train, validation = (loaded[s].rename_column("label", "labels") for s in ("train", "validation"))
    return ImageSplits(train, validation, None, "image", names, "ClassLabel")


def decode_args(**kw):
    return SimpleNamespace(**{"storage_size": None, "decode_images": "auto", "preprocessing_num_workers": 1, **kw})


# ------------------------------------------------------------------------------------------------------ indexing


def test_a_folder_is_indexed_in_one_walk_as_datasets_would_read_it(tmp_path, photos, monkeypatch):
    """Same splits, rows, paths and labels as `datasets.load_dataset(<folder>)`, without its glob patterns (one
    walk over the whole tree each; most of a minute on 60,000 images)."""
    (photos / "README.md").write_text("ignored by both")
    (photos / ".hidden").mkdir(exist_ok=True)
    (photos / ".hidden" / "x.jpg").write_bytes(b"not an image: hidden folders are not data")
    expected = datasets.load_dataset(str(photos))
    from datasets import data_files

    def no_glob(*args, **kwargs):
        raise AssertionError("a local folder was globbed")

    monkeypatch.setattr(data_files, "resolve_pattern", no_glob)
    loaded = load_any(str(photos))
    assert list(loaded) == list(expected) == ["train", "validation"]
    for split in loaded:
        ours = loaded[split].cast_column("image", datasets.Image(decode=False))
        theirs = expected[split].cast_column("image", datasets.Image(decode=False))
        assert ours.features["label"] == theirs.features["label"]
        assert sorted(zip(ours["image"], ours["label"]), key=lambda r: r[0]["path"]) == sorted(
            zip(theirs["image"], theirs["label"]), key=lambda r: r[0]["path"]
        )


def test_data_files_in_a_folder_are_handed_to_their_builder_by_split(tmp_path):
    """Shards named like the Hub's (`data/train-00000-of-00002.parquet`) and split keywords in file names."""
    shards = tmp_path / "shards" / "data"
    shards.mkdir(parents=True)
    for split, n in (("train", 2), ("test", 1)):
        for i in range(n):
            rows = datasets.Dataset.from_dict({"image": [f"{split}{i}.png"], "label": [i]})
            rows.to_parquet(str(shards / f"{split}-{i:05d}-of-{n:05d}.parquet"))
    loaded = load_any(str(tmp_path / "shards"))
    assert {s: len(d) for s, d in loaded.items()} == {"train": 2, "test": 1}
    named = tmp_path / "named"
    named.mkdir()
    (named / "my_train.csv").write_text("image,label\na.png,0\nb.png,1\n")
    (named / "valid.csv").write_text("image,label\nc.png,0\n")
    assert {s: len(d) for s, d in load_any(str(named)).items()} == {"train": 2, "validation": 1}
    (named / "test_more.parquet").write_bytes(b"")
    with pytest.raises(RecipeError, match=r"mixes data file types \(\.csv, \.parquet\): keep one"):
        load_any(str(named))


# ------------------------------------------------------------------------------------------ choosing the path


def test_auto_decodes_small_images_once_and_photos_per_batch(photos, cifar_like, capsys, tmp_path, monkeypatch):
    """Photos (JPEG, decoded ~4x their file size) decode per batch and write nothing; CIFAR-shaped PNGs (about
    their own size decoded) are decoded once into the cache; the log says which path and why."""
    cache = tmp_path / "cache"  # this test's own: test files running beside it write to the shared one
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(cache))
    splits = splits_of(photos)
    before = set(cache.rglob("*"))
    prepared = prepare_images(splits, 64, decode_args())
    assert prepared.decode == "per_batch" and prepared.storage_shape == (73, 73)
    assert prepared.train is splits.train  # nothing decoded, nothing written
    assert set(cache.rglob("*")) == before
    said = capsys.readouterr().out
    assert "Images decoded per batch by the DataLoader workers to 73x73 uint8" in said
    assert "decoded 1" not in said  # the growth is stated, and well over 2x for these photos
    small = load_any(str(cifar_like))
    train = small["train"].rename_column("fine_label", "labels").cast_column("img", datasets.Image(decode=False))
    stored = prepare_images(ImageSplits(train, None, None, "img", ["a"], "ClassLabel"), 224, decode_args())
    assert stored.decode == "once" and stored.image_column == "pixels" and stored.storage_shape == (32, 32)
    said = capsys.readouterr().out
    assert "Images decoded once to 32x32 uint8" in said and "The decoded copy of the train images" in said
    forced = prepare_images(splits, 64, decode_args(decode_images="once"))
    assert forced.decode == "once" and "(--decode_images once)" in capsys.readouterr().out
    rows = splits.train.to_dict()  # the photos stored as bytes (a parquet file of JPEGs): their size is known too
    stored = [{"bytes": Path(value["path"]).read_bytes(), "path": None} for value in rows["image"]]
    as_bytes = datasets.Dataset.from_dict({**rows, "image": stored}, features=splits.train.features)
    assert prepare_images(replace(splits, train=as_bytes), 64, decode_args()).decode == "per_batch"


def test_a_stream_decodes_per_batch_where_auto_would_decode_once(cifar_like, capsys):
    """CIFAR-shaped PNGs are decoded once (the test above), but a stream has no copy to make: per batch, said so."""
    from vit_recipes.core.arguments import DataArguments
    from vit_recipes.data.streaming import load_stream_splits

    data = DataArguments(dataset_name=str(cifar_like), streaming=True, image_column_name="img",
                         label_column_name="fine_label")  # fmt: skip
    training = SimpleNamespace(process_index=0, world_size=1, seed=0, do_eval=False)
    prepared = prepare_images(load_stream_splits(data, training), 224, decode_args())
    assert prepared.decode == "per_batch" and prepared.storage_shape == (32, 32)
    assert "to 32x32 uint8 (--streaming): no decoded copy on disk" in capsys.readouterr().out


def test_per_batch_decoding_delivers_the_pixels_of_the_decoded_copy(photos):
    splits = splits_of(photos)
    once = decode_splits(splits, 64)
    per_batch = prepare_images(splits, 64, decode_args(decode_images="per_batch"))
    rows = [per_batch.train[i] for i in range(6)]
    batch = DecodingCollator(per_batch.storage_shape, per_batch.white, "image")(rows)
    expected = PixelCollator(once.storage_shape)([once.train[i] for i in range(6)])
    assert batch["pixel_values"].dtype == torch.uint8 and batch["pixel_values"].shape == (6, 3, 73, 73)
    assert torch.equal(batch["pixel_values"], expected["pixel_values"])
    assert torch.equal(batch["labels"], expected["labels"])


def rows_of_classes(splits: ImageSplits, classes: list[int]) -> list[dict]:
    """Training rows of the given classes, in that order (the fixture's first rows share one class)."""
    labels = splits.train["labels"]
    return [splits.train[labels.index(c, 3 * n)] for n, c in enumerate(classes)]


def test_an_unreadable_image_in_a_batch_is_replaced_logged_and_recorded(photos, tmp_path, caplog):
    """Training: an unreadable image is replaced by a copy of another image of its batch, with that image's label
    (the rows here are of other classes, so a kept label would show). Each worker records each once with its split,
    images stored as bytes too (told apart by their bytes), listed once under it in skipped_images.json and the card."""
    splits = splits_of(photos)
    rows = rows_of_classes(splits, [0, 1, 2, 1, 2])
    rows[1] = {**rows[1], "image": {"path": str(tmp_path / "gone.jpg"), "bytes": None}}
    rows[2] = {**rows[2], "image": {"path": None, "bytes": b"\xff\xd8 truncated"}}
    rows[4] = {**rows[4], "image": {"path": None, "bytes": b"\xff\xd8 truncated elsewhere"}}
    record = tmp_path / decoding.SKIPPED_DURING_RUN
    collate = DecodingCollator((16, 16), 255.0, "image", str(record))
    batch = collate(rows)
    assert batch["pixel_values"].shape == (5, 3, 16, 16)  # the batch keeps its shape
    assert torch.equal(batch["pixel_values"][1], batch["pixel_values"][0])
    assert torch.equal(batch["pixel_values"][2], batch["pixel_values"][3])
    assert [row["labels"] for row in rows] == [0, 1, 2, 1, 2]
    assert batch["labels"].tolist() == [0, 0, 1, 1, 0]  # the replacement's label, not the unreadable image's
    assert f"Unreadable image {tmp_path / 'gone.jpg'} (not found): replaced in its training batch" in caplog.text
    collate(rows)  # the next epoch meets them again: not recorded twice
    assert len(record.read_text().splitlines()) == 3
    DecodingCollator((16, 16), 255.0, "image", str(record))(rows)  # another worker meets them: listed once
    bytes_stored = {"image": None, "problem": "unreadable"}
    assert decoding.skipped_during_run(str(tmp_path)) == [
        {"split": "train", "image": str(tmp_path / "gone.jpg"), "problem": "not found"},
        {"split": "train", **bytes_stored},
        {"split": "train", **bytes_stored},
    ]
    noted = decoding.note_skipped_during_run(replace(splits, decode="per_batch"), str(tmp_path))
    assert noted.skipped == {"train": [{"image": str(tmp_path / "gone.jpg"), "problem": "not found"}, bytes_stored,
                                       bytes_stored]}  # fmt: skip
    assert noted.notes == ["train: 3 unreadable image(s) replaced in their batch by another of it"]


def test_a_training_batch_with_no_readable_image_trains_on_the_splits_first_readable_one(photos, caplog):
    """No image of its batch to copy: the training split's first readable image (decoded when the collator is made),
    with its label; with none among the split's first 64, black images keeping their rows' labels. Said in one line."""
    prepared = prepare_images(splits_of(photos), 16, decode_args(decode_images="per_batch"))
    train = prepared.train
    others = [i for i, label in enumerate(train["labels"]) if label != train[0]["labels"]][:3]
    broken = train.select(others).map(lambda row: {"image": {"path": None, "bytes": b"not an image"}})
    rows = [broken[i] for i in range(3)]
    collate = decoding.make_collator(replace(prepared, train=datasets.concatenate_datasets([broken, train])), None)
    batch = collate(rows)
    first = decoding.decode_to_chw(train[0]["image"], *prepared.storage_shape, prepared.white)[0]
    assert all(np.array_equal(image.numpy(), first) for image in batch["pixel_values"])
    assert batch["labels"].tolist() == [train[0]["labels"]] * 3
    assert "No image of a training batch of 3 is readable: each trains as the training split's first readable" in (
        caplog.text
    )
    batch = decoding.make_collator(replace(prepared, train=broken), None)(rows)
    assert batch["pixel_values"].max() == 0 and batch["labels"].tolist() == [row["labels"] for row in rows]
    assert "each trains as a black image" in caplog.text


def test_evaluation_leaves_unreadable_images_out_of_a_batch_of_its_shape(photos, tmp_path, caplog):
    """Evaluating, an unreadable image's row stays (accelerate's gather_for_metrics trims the last batch by counting
    full ones), black and labelled LEFT_OUT (multi-label: the whole row); a batch of only unreadable images too."""
    from vit_recipes.core.metrics import LEFT_OUT

    splits = splits_of(photos)
    training = DecodingCollator((16, 16), 255.0, "image", str(tmp_path / decoding.SKIPPED_DURING_RUN))
    collate = training.for_evaluation("validation")
    rows = [splits.validation[i] for i in range(3)]
    gone = [{**row, "image": {"path": str(tmp_path / f"gone{i}.jpg"), "bytes": None}} for i, row in enumerate(rows)]
    batch = collate([rows[0], gone[1], rows[2]])
    assert batch["labels"].tolist() == [rows[0]["labels"], LEFT_OUT, rows[2]["labels"]]
    assert batch["pixel_values"][1].max() == 0 and batch["pixel_values"][0].max() > 0
    only = collate(gone)  # every image of the batch unreadable: no error
    assert only["pixel_values"].shape == (3, 3, 16, 16) and only["labels"].tolist() == [LEFT_OUT] * 3
    hot = [{**row, "labels": [0.0, 1.0, 1.0]} for row in (rows[0], gone[1])]
    assert collate(hot)["labels"].tolist() == [[0.0, 1.0, 1.0], [LEFT_OUT] * 3]
    assert {item["split"] for item in decoding.skipped_during_run(str(tmp_path))} == {"validation"}
    assert len(decoding.skipped_during_run(str(tmp_path))) == 3
    assert "training batch" not in caplog.text  # nothing replaced, nor said to be


def test_a_jpeg_over_pils_bomb_limit_decodes_at_reduced_scale_and_another_image_is_named_too_large(
    photos, tmp_path, monkeypatch
):
    """PIL refuses images over 2x Image.MAX_IMAGE_PIXELS (179 MP: a 200 MP phone photo) before decoding them. A JPEG
    decodes at 1/8 scale (draft), so it opens anyway; a PNG over it is skipped as "too large", not "unreadable"."""
    from vit_recipes.data.images import ImageTooLarge, decode_to_chw, probe

    pixels = np.random.default_rng(0).integers(0, 256, size=(48, 64, 3), dtype=np.uint8)
    jpeg, big_png = io.BytesIO(), png(pixels)
    PILImage.fromarray(pixels).save(jpeg, format="JPEG")
    monkeypatch.setattr(PILImage, "MAX_IMAGE_PIXELS", 1000)  # 3,072 px: over twice the limit, an eighth within it
    with pytest.raises(PILImage.DecompressionBombError):
        PILImage.open(io.BytesIO(jpeg.getvalue()))
    array, _ = decode_to_chw({"bytes": jpeg.getvalue(), "path": None}, 16, 16)
    assert array.shape == (3, 16, 16) and array.std() > 0
    assert probe({"bytes": jpeg.getvalue(), "path": None}) == ((64, 48), None)
    with pytest.raises(ImageTooLarge, match="64x48 px, over PIL's limit of 2000 px"):
        decode_to_chw({"bytes": big_png, "path": None}, 16, 16)
    assert PILImage.MAX_IMAGE_PIXELS == 1000  # the guard is back

    rows = [splits_of(photos).train[i] for i in range(3)]
    rows[0] = {**rows[0], "image": {"path": None, "bytes": jpeg.getvalue()}}
    rows[1] = {**rows[1], "image": {"path": None, "bytes": big_png}}
    batch = DecodingCollator((16, 16), 255.0, "image", str(tmp_path / decoding.SKIPPED_DURING_RUN))(rows)
    assert batch["pixel_values"].shape == (3, 3, 16, 16)
    assert decoding.skipped_during_run(str(tmp_path)) == [{"split": "train", "image": None, "problem": "too large"}]


# ------------------------------------------------------------------------------------------------- disk room


def test_the_decoded_copy_is_checked_for_room_before_any_work(photos, monkeypatch, tmp_path):
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "cache"))  # no copy there yet
    splits = splits_of(photos)
    calls = []
    monkeypatch.setattr(datasets.Dataset, "map", lambda *a, **k: calls.append(a))
    monkeypatch.setattr(decoding.shutil, "disk_usage", lambda path: SimpleNamespace(free=1000))
    with pytest.raises(RecipeError, match=r"^the decoded copy needs 787 KiB in the datasets cache .* 1000 B free: pass "
                       r"--decode_images per_batch \(no copy\), --streaming"):  # fmt: skip
        decode_splits(splits, 64)
    assert calls == []


def test_a_full_disk_while_decoding_is_one_line_and_leaves_no_partial_file(tmp_path, monkeypatch):
    """ENOSPC in the middle of the cache write (a small filesystem, simulated) while 2 processes decode (over 1,000
    images): one line naming the cache folder and the size needed, and no file of the copy left in the cache. The
    shard a process finished is a whole file that `datasets` keeps (it removes only its temporary files); left there,
    the next run would find the copy's name on disk and skip the room check."""
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "cache" / "vit_recipes_decoded"
    tiny = png(np.zeros((2, 2, 3), np.uint8))
    train = datasets.Dataset.from_dict(
        {"image": [{"bytes": tiny, "path": None}] * 1002, "labels": [0] * 501 + [1] * 501},
        features=datasets.Features({"image": datasets.Image(decode=False), "labels": datasets.Value("int64")}),
    )
    from datasets import arrow_writer

    written = arrow_writer.ArrowWriter.write_batch

    def fill_the_disk(self, batch, *args, **kwargs):  # the second shard's process (labels 1), once the first is done
        written(self, batch, *args, **kwargs)
        labels = batch["labels"]  # an Arrow column here
        if 1 in (labels.to_pylist() if hasattr(labels, "to_pylist") else labels):
            for _ in range(600):
                if list(folder.glob("*_00000_of_00002.arrow")):
                    break
                time.sleep(0.05)
            self.stream.flush()
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(arrow_writer.ArrowWriter, "write_batch", fill_the_disk)
    with pytest.raises(RecipeError) as caught:
        decode_splits(ImageSplits(train, None, None, "image", ["a", "b"], "ClassLabel"), 2, num_proc=2)
    message = str(caught.value)
    assert message.startswith(f"the datasets cache {folder} filled up while decoding (")
    assert "the decoded copy needs 12 KiB); its partial files are removed" in message
    assert "\n" not in message
    assert [p.name for p in folder.iterdir()] == []


# ------------------------------------------------------------------------------------------------ whole runs


def gif(frames: int = 2) -> bytes:
    images = [PILImage.new("RGB", (8, 8), (255 * (i % 2), 0, 0)) for i in range(frames)]
    buffer = io.BytesIO()
    images[0].save(buffer, format="GIF", save_all=True, append_images=images[1:])
    return buffer.getvalue()


def test_a_run_on_a_jpeg_folder_decodes_per_batch_and_writes_no_copy(photos, tiny_vit, tmp_path, run_script, capsys,
                                                                     monkeypatch):  # fmt: skip
    """The script on a folder of photos, per batch (auto picks it for photos larger than the model's input, as the test
    above shows; this tiny model's 16 px input would make a small copy): one line saying so, no decoded copy on
    disk. An unreadable training photo is replaced; three unreadable validation photos in a row, a whole evaluation
    batch of 3, are left out: the 12 readable ones are scored, and the log and card say so. An animated GIF trains
    on its first frame, counted in the log and the card. skipped_images.json lists the unreadable ones by split."""
    cache = tmp_path / "cache"
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(cache))
    broken = photos / "train" / "class_0001" / "broken.jpg"
    animated = photos / "train" / "class_0002" / "animated.gif"
    unreadable = [photos / "validation" / "class_0000" / f"0-{c}.jpg" for c in "abc"]  # sorted first: one batch
    added = [broken, animated, *unreadable]
    for path in [broken, *unreadable]:
        path.write_bytes(b"\xff\xd8\xff not a whole JPEG")
    animated.write_bytes(gif())
    try:
        out = tmp_path / "out"
        results = run_script(*run_args(photos, tiny_vit, out, "--max_steps", "8", "--decode_images", "per_batch",
                                       "--per_device_eval_batch_size", "3", "--eval_strategy", "steps",
                                       "--eval_steps", "8"))  # fmt: skip
    finally:
        for path in added:
            path.unlink()
    said = capsys.readouterr().out  # the log too: the run's logging writes to stdout
    assert "Images decoded per batch by the DataLoader workers to 18x18 uint8" in said
    assert not cache.exists() or not any(cache.rglob("*.arrow"))
    labels = json.loads((out / "labels.json").read_text())
    assert labels["storage_shape"] == [18, 18]
    skipped = json.loads((out / "skipped_images.json").read_text())
    assert skipped["train"] == [{"image": str(broken), "problem": "unreadable"}]
    assert skipped["validation"] == [{"image": str(path), "problem": "unreadable"} for path in unreadable]
    with open(out / "per_class_accuracy_validation.csv") as f:  # what was scored: the readable images only
        assert sum(int(row["support"]) for row in csv.DictReader(f)) == 12
    assert np.isfinite(results["eval_loss"]) and 0 <= results["eval_accuracy"] <= 1
    assert "validation: 3 unreadable image(s) left out of this evaluation: its loss and metrics count the 12 " in said
    card = (out / "README.md").read_text()
    assert "train: 1 unreadable image(s) replaced in their batch by another of it" in card
    assert "validation: 3 unreadable image(s) left out of its evaluation" in card
    assert "train: 1 animated or multi-frame image(s): the first frame is used" in card
    assert (
        "WARNING vit_recipes.data.decoding: train: 1 animated or multi-frame image(s): the first frame is used" in said
    )


def test_a_stream_of_a_jpeg_folder_with_an_unreadable_image_ends_with_its_card(photos, tiny_vit, tmp_path, run_script):
    """--streaming reads the training split as a stream, which cannot be indexed to place a recorded image: each
    record names its split, so the card and skipped_images.json come as without a stream."""
    broken = photos / "train" / "class_0001" / "broken.jpg"
    broken.write_bytes(b"\xff\xd8\xff not a whole JPEG")
    try:
        out = tmp_path / "out"
        run_script(*run_args(photos, tiny_vit, out, "--max_steps", "8", "--streaming", "true"))
    finally:
        broken.unlink()
    assert json.loads((out / "skipped_images.json").read_text()) == {
        "train": [{"image": str(broken), "problem": "unreadable"}]
    }
    assert "train: 1 unreadable image(s) replaced in their batch by another of it" in (out / "README.md").read_text()


def test_predicting_alone_decodes_per_batch_and_writes_nothing_to_the_cache(photos, tiny_vit, tmp_path, run_script,
                                                                             monkeypatch, capsys):  # fmt: skip
    """--do_predict with --predict_images and no dataset: decoded by the DataLoader workers as the log says, not into
    the datasets cache; an unreadable file is a row naming its problem, recorded by a worker process."""
    cache = tmp_path / "cache"
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(cache))
    images = tmp_path / "images"
    shutil.copytree(photos / "validation", images)
    (images / "class_0001" / "broken.jpg").write_bytes(b"\xff\xd8\xff not a whole JPEG")
    out = tmp_path / "out"
    run_script("--model_name_or_path", tiny_vit, "--do_predict", "true", "--predict_images", images,
               "--output_dir", out, "--use_cpu", "true", "--report_to", "none", "--dataloader_num_workers", "1")  # fmt: skip
    assert not cache.exists() or not any(p.is_file() for p in cache.rglob("*"))
    assert "13 images to predict, decoded per batch by the DataLoader workers to " in capsys.readouterr().out
    with open(out / "predictions.csv") as f:
        rows = {row["file"]: row for row in csv.DictReader(f)}
    assert len(rows) == 13 and (rows["class_0001/broken.jpg"]["label"], rows["class_0001/broken.jpg"]["problem"]) == (
        "",
        "unreadable",
    )
    assert all(row["label"] and not row["problem"] for file, row in rows.items() if file != "class_0001/broken.jpg")
    assert sorted(p.name for p in out.iterdir()) == [".run.lock", "all_results.json", "predictions.csv"]


def test_jpeg_draft_decoding_covers_the_storage_size(tmp_path, monkeypatch):
    """A large JPEG is decoded at a reduced DCT scale only where the result still covers the storage size: 1600x1200
    decodes at 1/4 (400x300) for 256x256 (1/8, 200x150, would not cover it) and at 1/8 for 128x128."""
    from PIL import ImageOps

    from vit_recipes.data.images import decode_to_chw

    big = tmp_path / "big.jpg"
    PILImage.fromarray(np.random.default_rng(0).integers(0, 255, (1200, 1600, 3), np.uint8)).save(big, quality=90)
    decoded, fit = [], ImageOps.fit
    monkeypatch.setattr(ImageOps, "fit", lambda image, *args, **kwargs: decoded.append(image.size) or fit(image, *args,
                                                                                                          **kwargs))  # fmt: skip
    array, done = decode_to_chw(str(big), 256, 256)
    assert array.shape == (3, 256, 256) and done == "resized"
    assert decode_to_chw(str(big), 128, 128)[0].shape == (3, 128, 128)
    assert decoded == [(400, 300), (200, 150)]  # the sizes decoded, before the fit
    assert storage_format(datasets.Dataset.from_dict({"image": [str(big)]}), "image", 224, None).shape == (256, 256)


def test_animated_images_and_long_strips_are_noted_when_decoded_once(tmp_path):
    """An animated GIF trains on its first frame and a 160x8 strip loses most of its area to the 8x8 crop: the log
    and the card's notes say how many of each."""
    frames = [PILImage.new("RGB", (8, 8), (255 * i, 0, 0)) for i in range(2)]
    gif = io.BytesIO()
    frames[0].save(gif, format="GIF", save_all=True, append_images=frames[1:])
    images = [png(np.full((8, 8, 3), 40 * i, np.uint8)) for i in range(5)] + [
        gif.getvalue(),
        png(np.zeros((8, 160, 3), np.uint8)),
    ]
    train = datasets.Dataset.from_dict(
        {"image": [{"bytes": b, "path": None} for b in images], "labels": [0, 1] * 3 + [0]},
        features=datasets.Features(
            {"image": datasets.Image(decode=False), "labels": datasets.ClassLabel(names=["a", "b"])}
        ),
    )
    decoded = decode_splits(ImageSplits(train, None, None, "image", ["a", "b"], "ClassLabel"), image_size=8)
    assert decoded.notes == [
        "train: 1 image(s) not 8x8, the common size, resized to cover it and centre-cropped, 1 of them losing over "
        "half their area (a long strip)",
        "train: 1 animated or multi-frame image(s): the first frame is used",
    ]


def test_a_stream_is_counted_in_steps_and_its_epoch_strategies_become_steps():
    from vit_recipes.data.streaming import plan_stream_steps

    training = SimpleNamespace(max_steps=-1, num_train_epochs=2, eval_strategy="epoch", save_strategy="steps")
    plan_stream_steps(training, rows=1000, global_batch=64)
    assert (training.max_steps, training.eval_strategy, training.eval_steps) == (30, "steps", 15)
    assert training.save_strategy == "steps" and not hasattr(training, "save_steps")
    with pytest.raises(RecipeError, match=r"^--streaming: the dataset does not say how many training images"):
        plan_stream_steps(SimpleNamespace(max_steps=-1, num_train_epochs=1), rows=None, global_batch=64)
    unknown = SimpleNamespace(max_steps=10, num_train_epochs=1, eval_strategy="epoch", save_strategy="no")
    with pytest.raises(RecipeError, match=r"--eval_strategy epoch: the stream's epoch length is unknown"):
        plan_stream_steps(unknown, rows=None, global_batch=64)


def test_the_high_bit_depth_note_counts_only_the_images_it_scales(caplog):
    def image(array) -> dict:
        buffer = io.BytesIO()
        PILImage.fromarray(array).save(buffer, format="PNG")
        return {"bytes": buffer.getvalue(), "path": None}

    wide = [image(np.full((4, 4), v, np.uint16)) for v in (300, 4095)]
    split = datasets.Dataset.from_dict({"image": [*wide, image(np.zeros((4, 4, 3), np.uint8))]})
    assert storage_format(split, "image", 4, None).white == 4095
    assert (
        "High-bit-depth images (2 of 3 sampled, largest value 4095): those are scaled by 255/4095 to 8 bits; "
        "8-bit images are stored as they are" in caplog.text
    )


def test_a_high_bit_depth_image_after_the_first_64_is_scaled_by_its_own_white_and_noted(tmp_path, monkeypatch):
    """The white level comes from the first 64 images (8-bit here: 255). A 16-bit PNG met later was clipped to a white
    square; it is scaled by its own bit depth's white instead, per image, on both paths alike, and the log and card
    count it, as they count an animated GIF decoded per batch. Prediction (labels.json's white) decodes it alike."""
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "cache"))
    deep = np.linspace(0, 60000, 16).reshape(4, 4).astype(np.uint16)
    values = [png(np.full((4, 4, 3), i, np.uint8)) for i in range(64)] + [png(deep), gif()]
    split = datasets.Dataset.from_dict(
        {"image": [{"bytes": b, "path": None} for b in values], "labels": [i % 2 for i in range(66)]},
        features=datasets.Features({"image": datasets.Image(decode=False), "labels": datasets.Value("int64")}),
    )
    storage = storage_format(split, "image", 4, None)
    assert storage.white == 255 and storage.shape == (4, 4)
    batch = DecodingCollator(storage.shape, storage.white, "image", str(tmp_path / decoding.SKIPPED_DURING_RUN))(
        [split[64], split[65], split[0]]
    )
    expected = (deep * (255 / 65535)).astype(np.uint8)  # 65535: the white of 16 bits, which hold 60000
    assert all(np.array_equal(channel.numpy(), expected) for channel in batch["pixel_values"][0])
    splits = ImageSplits(split, None, None, "image", ["a", "b"], "ClassLabel", (4, 4), 255.0, decode="per_batch")
    brighter = (
        "train: 1 high-bit-depth image(s) brighter than the white level 255 (set by the first 64 images): each scaled "
        "by its own bit depth's white instead of clipping"
    )
    animated = "train: 1 animated or multi-frame image(s): the first frame is used"
    assert decoding.note_skipped_during_run(splits, str(tmp_path)).notes == [animated, brighter]
    once = decode_splits(replace(splits, decode="once"), 4)
    assert once.train["pixels"][64] == batch["pixel_values"][0].numpy().tobytes() and brighter in once.notes
    predicted = decoding.decode_to_chw(split[64]["image"], 4, 4, json.loads(json.dumps(once.white)))[0]
    assert np.array_equal(predicted, batch["pixel_values"][0].numpy())


def test_a_decoded_copy_already_on_disk_is_used_whatever_the_free_space(photos, monkeypatch, tmp_path):
    """The second run of the same data writes nothing: the room check must not refuse it on a disk that filled since."""
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "cache"))
    splits = splits_of(photos)
    first = decode_splits(splits, 64)
    monkeypatch.setattr(decoding.shutil, "disk_usage", lambda path: SimpleNamespace(free=1000))
    again = decode_splits(splits, 64)
    assert again.train["pixels"][:3] == first.train["pixels"][:3]


def test_per_batch_workers_take_this_processs_share_of_the_cores_unless_given(monkeypatch, capsys):
    from vit_recipes.data.decoding import share_cores_with_workers

    monkeypatch.setattr(decoding.os, "sched_getaffinity", lambda pid: set(range(32)), raising=False)
    per_batch = SimpleNamespace(decode="per_batch")
    for env, expected in (({"LOCAL_WORLD_SIZE": "4"}, 8), ({"LOCAL_SIZE": "2"}, 16), ({}, 32)):  # torchrun, deepspeed
        for name in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE"):
            monkeypatch.delenv(name, raising=False)
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        training = SimpleNamespace(workers_given=False, dataloader_num_workers=4, dataloader_prefetch_factor=None,
                                   dataloader_persistent_workers=False)  # fmt: skip
        share_cores_with_workers(training, per_batch)
        assert (training.dataloader_num_workers, training.dataloader_persistent_workers) == (expected, True)
    assert "DataLoader workers: 32 per process, this process's share of 32 cores" in capsys.readouterr().out
    given = SimpleNamespace(workers_given=True, dataloader_num_workers=3)
    share_cores_with_workers(given, per_batch)
    assert given.dataloader_num_workers == 3


class _Niceness(torch.utils.data.Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, index):
        return os.nice(0)  # the worker's nice value


def test_dataloader_workers_yield_the_cpu_to_the_main_process():
    """Workers decoding per batch fill every core: they run at a lower priority than the process feeding the GPU."""
    from vit_recipes.data.batches import WORKER_NICENESS, DeviceBatches

    class Trainer:  # the Trainer's loader, as DeviceBatches receives it
        args = SimpleNamespace(dataloader_drop_last=False)
        data_collator = None

        def _get_dataloader(self, dataset, *args, is_training=False, **kwargs):
            return torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=2)

    class Batches(DeviceBatches, Trainer):
        def __init__(self):  # no Trainer to build
            pass

    loader = Batches()._get_dataloader(_Niceness(), is_training=True)
    assert set(loader) == {min(19, os.nice(0) + WORKER_NICENESS)}

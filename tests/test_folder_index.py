"""A real photo collection's odd files, as the folder indexer meets them (src/vit_recipes/data/folder_index.py): hidden
files, symlinks (loops, dangling ones, linked folders), formats beyond JPEG and PNG, empty placeholders, and images
at mixed depths. Each ends clean: the run goes on and says what it did, or stops with one line naming the cause."""

import io
import logging
import os
from pathlib import Path

import datasets
import numpy as np
import pytest
from PIL import Image

from vit_recipes.core.arguments import DataArguments
from vit_recipes.core.errors import RecipeError
from vit_recipes.data.data import ImageSplits, load_any, load_image_folder, load_splits
from vit_recipes.data.decoding import decode_splits
from vit_recipes.data.folder_index import index_folder, walk
from vit_recipes.data.images import IMAGE_EXTENSIONS, decode_to_chw


def png(shade: int = 100) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(np.full((8, 8, 3), shade, np.uint8)).save(buffer, format="PNG")
    return buffer.getvalue()


def tree(root: Path, files: dict[str, bytes]) -> Path:
    for relative, content in files.items():
        (root / relative).parent.mkdir(parents=True, exist_ok=True)
        (root / relative).write_bytes(content)
    return root


def classes(root: Path, names=("cat", "dog"), splits=("train", "validation"), per_class=3) -> Path:
    """split/class/i.png, 8x8 PNGs of distinct shades."""
    return tree(root, {f"{s}/{c}/{i}.png": png(40 * i + 5 * j) for s in splits for j, c in enumerate(names)
                       for i in range(per_class)})  # fmt: skip


def warnings_of(caplog, logger="vit_recipes.data.folder_index") -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == logger and r.levelno == logging.WARNING]


# ------------------------------------------------------------------------------------------- what is indexed


def test_hidden_files_apple_double_files_and_hidden_folders_are_not_indexed(tmp_path):
    """macOS leaves `._name` (AppleDouble) beside every copied photo and `__MACOSX/` in zips: neither is an image,
    and `datasets` reads neither. Here they sit inside class folders, where they would be a row each."""
    root = classes(tmp_path)
    tree(root, {"train/cat/._0.png": b"AppleDouble metadata", "train/cat/.3.png": png(), "train/.cache/dog/x.png": png(),
                "__MACOSX/train/cat/1.png": png()})  # fmt: skip
    files = index_folder(root).files
    assert len(files) == 12 and not [f for f in files if "/." in f or f.startswith(("_", "."))]
    assert len(load_any(str(root))["train"]) == 6


def test_a_split_keyword_in_a_folder_name_wins_over_one_in_a_file_name(tmp_path):
    """`train/cat/test_1.png` is a training image (datasets' order: folder names first, then file names)."""
    root = classes(tmp_path, splits=("train", "test"))
    tree(root, {"train/cat/test_1.png": png(), "train/dog/validation_shot.png": png()})
    splits = index_folder(root).splits
    assert {"train/cat/test_1.png", "train/dog/validation_shot.png"} <= set(splits["train"])
    assert {s: len(f) for s, f in splits.items()} == {"train": 8, "test": 6}


def test_hub_shard_names_name_their_split_whatever_it_is_called(tmp_path):
    """`data/<split>-00000-of-00002.parquet`, as the Hub writes them: a split of any name, as datasets reads them (by
    split keywords alone, `holdout` would be training data)."""
    root = tree(tmp_path, {f"data/{s}-0000{i}-of-0000{n}.parquet": b"" for s, n in (("train", 1), ("holdout", 2))
                           for i in range(n)})  # fmt: skip
    assert index_folder(root).splits == {
        "train": ["data/train-00000-of-00001.parquet"],
        "holdout": ["data/holdout-00000-of-00002.parquet", "data/holdout-00001-of-00002.parquet"],
    }


def test_datasets_files_to_ignore_are_not_read_as_data(tmp_path):
    """A file of JSON lines beside its dataset card and info file: datasets ignores those (FILES_TO_IGNORE), so the
    indexer does too, or dataset_info.json would be read as training rows."""
    root = tree(tmp_path, {"rows.jsonl": b'{"image": "a.png", "label": 0}\n{"image": "b.png", "label": 1}\n',
                           "README.md": b"# a card", "dataset_info.json": b'{"description": "rows"}'})  # fmt: skip
    assert {s: len(d) for s, d in load_any(str(root)).items()} == {"train": 2}


def test_files_beside_the_images_are_not_rows_and_a_metadata_file_keeps_its_columns(tmp_path):
    """Windows' Thumbs.db in every photo folder and a notes file are not images: no rows (imagefolder reads image
    extensions only). A metadata.csv hands the images to datasets' imagefolder, which keeps its columns."""
    root = tree(classes(tmp_path / "photos"), {"train/cat/Thumbs.db": b"x", "train/dog/desktop.ini": b"x",
                                               "validation/notes.txt": b"x"})  # fmt: skip
    loaded = load_any(str(root))
    assert (len(loaded["train"]), len(loaded["validation"])) == (6, 6)
    described = tree(tmp_path / "described", {"train/a.png": png(10), "train/b.png": png(20),
                                              "train/metadata.csv": b"file_name,kind\na.png,x\nb.png,y\n"})  # fmt: skip
    assert sorted(load_any(str(described))["train"]["kind"]) == ["x", "y"]


def test_one_class_folder_gives_no_labels_as_datasets_gives_none(tmp_path):
    """Folder names are labels only where there are at least two of them (datasets' imagefolder rule)."""
    root = classes(tmp_path, names=("cat",))
    ours, theirs = load_any(str(root)), datasets.load_dataset(str(root))
    assert "label" not in ours["train"].features and "label" not in theirs["train"].features


def test_the_signature_changes_when_a_file_changes_size_or_time(tmp_path):
    """The signature names the folder's decoded copy: a photo replaced under the same name must not find the old
    copy."""
    root = classes(tmp_path)
    photo, before = root / "train" / "cat" / "0.png", index_folder(root).signature
    photo.write_bytes(png(200) + b"more")
    resized = index_folder(root).signature
    os.utime(photo, ns=(photo.stat().st_atime_ns, photo.stat().st_mtime_ns + 10**9))
    assert len({before, resized, index_folder(root).signature}) == 3


def test_a_symlink_loop_is_skipped_in_one_line_and_a_linked_folder_is_followed(tmp_path, caplog):
    """`train/cat/up -> ..` raised `OSError: [Errno 40] Too many levels of symbolic links`; `datasets` loads it."""
    root = classes(tmp_path / "data")
    os.symlink("..", root / "train" / "cat" / "up")
    classes(tmp_path / "more", names=("bird",), splits=("train",))
    os.symlink(tmp_path / "more" / "train" / "bird", root / "train" / "bird")  # a class kept elsewhere: followed
    with caplog.at_level(logging.WARNING, logger="vit_recipes.data.folder_index"):
        loaded = load_any(str(root))
    assert warnings_of(caplog) == [
        "Skipped 1 symlinked folder(s) that lead back to a folder above them (a loop): train/cat/up"
    ]
    assert loaded["train"].features["label"].names == ["bird", "cat", "dog"]
    assert (len(loaded["train"]), len(loaded["validation"])) == (9, 6)


def test_a_dangling_symlink_is_kept_and_skipped_as_not_found_when_decoded(tmp_path):
    """It was `error: no dataset found in folder ...`; docs/usage.md promises missing images are skipped."""
    root = classes(tmp_path)
    os.symlink(tmp_path / "gone.png", root / "train" / "dog" / "moved.png")
    splits = load_splits(DataArguments(dataset_name=str(root)))
    assert len(splits.train) == 7
    decoded = decode_splits(splits, image_size=8)
    assert decoded.skipped == {
        "train": [{"row": 6, "image": str(root / "train/dog/moved.png"), "problem": "not found"}]
    }
    assert len(decoded.train) == 6


# ------------------------------------------------------------------------------------------------- formats


def test_every_imagefolder_extension_is_indexed_and_pil_opens_what_it_can_write(tmp_path):
    """The extensions are datasets' imagefolder list (`.jfif`, Windows' name for a saved JPEG, disappeared with its
    class) and beyond it AVIF and HEIC: each one PIL has an opener for, and each format PIL can write decodes."""
    from datasets.packaged_modules.imagefolder.imagefolder import IMAGE_EXTENSIONS as IMAGEFOLDER

    assert set(IMAGEFOLDER) <= set(IMAGE_EXTENSIONS) and {".avif", ".heic", ".heif"} <= set(IMAGE_EXTENSIONS)
    opened = Image.registered_extensions()
    assert [e for e in IMAGE_EXTENSIONS if e not in opened and e not in (".heic", ".heif")] == []
    decoded, rgb = [], Image.fromarray(np.full((16, 16, 3), 100, np.uint8))
    for ext in IMAGE_EXTENSIONS:
        if opened.get(ext) not in Image.SAVE or opened[ext] == "EPS":  # EPS needs Ghostscript to open
            continue
        for mode in ("RGB", "L", "1", "P"):  # the first mode the format can store
            try:
                rgb.convert(mode).save(tmp_path / f"x{ext}", format=opened[ext])
                break
            except (OSError, ValueError, KeyError):
                continue
        else:
            continue
        decode_to_chw(str(tmp_path / f"x{ext}"), 8, 8)
        decoded.append(ext)
    assert {".jpg", ".jfif", ".jpe", ".png", ".webp", ".tif", ".bmp", ".gif", ".jp2", ".avif"} <= set(decoded)


def test_a_class_of_jfif_files_is_kept(tmp_path):
    root = classes(tmp_path)
    for split in ("train", "validation"):
        (root / split / "windows").mkdir()
        for i in range(2):
            Image.new("RGB", (8, 8), (200, 0, 0)).save(root / split / "windows" / f"{i}.jfif", format="JPEG")
    loaded = load_any(str(root))
    assert loaded["train"].features["label"].names == ["cat", "dog", "windows"]
    assert len(loaded["train"]) == 8


HEIF_EXTENSIONS = {".heic", ".heif", ".heics", ".heifs", ".hif"}


def test_heic_photos_without_the_plugin_are_left_out_in_one_line_and_their_class_is_refused(tmp_path, monkeypatch,
                                                                                          caplog):  # fmt: skip
    """iPhone photos vanished with no line. Without pillow-heif (taken away here, where it is installed), one line
    says how many were left out and how to read them; a class of them alone is refused, not dropped."""
    monkeypatch.setattr(Image, "EXTENSION", {k: v for k, v in Image.EXTENSION.items() if k not in HEIF_EXTENSIONS})
    root = classes(tmp_path)
    tree(root, {f"train/dog/IMG_{i}.HEIC": b"a HEIC photo" for i in range(3)})
    with caplog.at_level(logging.WARNING, logger="vit_recipes.data.folder_index"):
        splits = load_splits(DataArguments(dataset_name=str(root)))
    line = (
        "Left out 3 image(s) that PIL cannot open here (.heic), e.g. train/dog/IMG_0.HEIC: pip install pillow-heif "
        "(or the heif extra: pip install 'vit-recipes[heif]') reads them"
    )
    assert warnings_of(caplog) == [line] and line in splits.notes  # the log and the card
    assert len(splits.train) + len(splits.validation) == 12
    tree(root, {f"train/phone/IMG_{i}.heic": b"a HEIC photo" for i in range(3)})
    with pytest.raises(RecipeError, match=r"^1 class\(es\) have no training images: phone; add training images"):
        load_splits(DataArguments(dataset_name=str(root)))
    only = tree(tmp_path / "only", {"train/a/1.heic": b"x", "train/b/2.heif": b"x"})
    with pytest.raises(RecipeError, match=r"^no readable images in folder .*only: Left out 2 image\(s\) that PIL"):
        load_any(str(only))


def test_heic_photos_are_read_with_the_plugin(tmp_path):
    pillow_heif = pytest.importorskip("pillow_heif")
    del pillow_heif  # images.py registered its opener
    root = classes(tmp_path)
    for split in ("train", "validation"):
        Image.new("RGB", (16, 16), (0, 90, 200)).save(root / split / "dog" / "IMG_0001.HEIC", format="HEIF")
    loaded = load_any(str(root))
    assert len(loaded["train"]) == 7
    pixels, _ = decode_to_chw(str(root / "train" / "dog" / "IMG_0001.HEIC"), 8, 8)
    assert abs(int(pixels[2].mean()) - 200) < 8


# ---------------------------------------------------------------------------------- classes and their images


def test_a_class_of_empty_files_is_refused_as_an_empty_class_is_and_a_stray_one_is_left_out(tmp_path, caplog):
    """0-byte placeholders (files a sync never downloaded) trained as a class with no image."""
    root = classes(tmp_path)
    tree(root, {**{f"{s}/ghost/{i}.jpg": b"" for s in ("train", "validation") for i in range(3)}})
    with pytest.raises(RecipeError, match=r"^1 class\(es\) have no training images: ghost; add training images"):
        load_splits(DataArguments(dataset_name=str(root)))
    ghost = tmp_path / "ghost"
    classes(ghost)
    tree(ghost, {"train/cat/9.png": b""})
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="vit_recipes.data.folder_index"):
        splits = load_splits(DataArguments(dataset_name=str(ghost)))
    line = "Left out 1 empty image file(s) (0 bytes): train/cat/9.png"
    assert warnings_of(caplog) == [line] and line in splits.notes and len(splits.train) == 6


def test_a_class_whose_images_all_fail_to_decode_is_refused_after_decoding(tmp_path):
    """Not empty, so indexed, but every image unreadable: decoding once leaves the class without an image."""
    root = classes(tmp_path)
    tree(root, {f"{s}/broken/{i}.png": b"not a png" for s in ("train", "validation") for i in range(2)})
    splits = load_splits(DataArguments(dataset_name=str(root)))
    with pytest.raises(RecipeError, match=r"^1 class\(es\) have no training images: broken; add training images"):
        decode_splits(splits, image_size=8)
    sampled = splits.train.filter(lambda row: row["labels"] != 0)  # a sample may lack a class: not refused
    decode_splits(ImageSplits(sampled, None, None, "image", splits.label_names, "ClassLabel"), image_size=8)


@pytest.mark.parametrize(
    "odd, found",
    [
        ({"train/stray.png": png()}, r"\(12 like train/cat/0.png, 1 like train/stray.png\)"),
        ({"train/cat/more/a.png": png(), "train/cat/more/b.png": png()}, r"\(12 like .*, 2 like train/cat/more/a"),
    ],
)
def test_images_at_mixed_depths_are_refused_naming_the_stray_ones(tmp_path, odd, found):
    """It was `no label column found ... pass --label_column_name`, a fix that cannot work: datasets gives no labels
    unless every image is at one depth."""
    root = tree(classes(tmp_path), odd)
    stray = ", ".join(odd)
    with pytest.raises(RecipeError, match=rf"^images in .* sit at different depths {found}.*: move {stray} into a"):
        load_any(str(root))


# ------------------------------------------------------------------------------------------- --predict_images


def test_predict_images_are_found_by_the_indexers_walk(tmp_path, monkeypatch, caplog):
    """--predict_images listed `._*` files and skipped a symlinked subfolder: the opposite of the indexer."""
    monkeypatch.setattr(Image, "EXTENSION", {k: v for k, v in Image.EXTENSION.items() if k not in HEIF_EXTENSIONS})
    elsewhere = tree(tmp_path / "elsewhere", {"c.png": png()})
    folder = tree(tmp_path / "photos", {"a.png": png(), "._a.png": b"AppleDouble", ".thumbs/t.png": png(),
                                        "sub/b.png": png(), "IMG_1.heic": b"x", "empty.png": b""})  # fmt: skip
    os.symlink(elsewhere, folder / "linked")
    with caplog.at_level(logging.WARNING, logger="vit_recipes.data.folder_index"):
        listing = load_image_folder(str(folder))
    assert listing["file"] == ["a.png", "empty.png", "linked/c.png", "sub/b.png"]  # an empty one: "unreadable"
    assert [f for f in walk(folder)[0] if not f.endswith(".heic")] == listing["file"]
    assert warnings_of(caplog) == [
        "Left out 1 image(s) that PIL cannot open here (.heic), e.g. IMG_1.heic: pip install pillow-heif (or the heif "
        "extra: pip install 'vit-recipes[heif]') reads them"
    ]

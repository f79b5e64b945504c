"""How images reach the DataLoader as uint8 (B, 3, H, W) batches at one storage size; the device augments them next.

Two paths, chosen per dataset (`choose_decoding`, said in one log line):
- once: every image decoded before training into a uint8 copy that `datasets` caches on disk; epochs only slice it.
  Small images (CIFAR's 32x32: 3 KB decoded) make a copy about the size of the source and no CPU work per step.
- per batch: the DataLoader workers decode each batch (JPEG at a reduced DCT scale where that still covers the
  storage size) and nothing is written. Photos of a few hundred pixels decode to 4x their JPEG size or more, and
  the copy would cost minutes before the first step and its size again on disk; the workers keep pace with the GPU.
"""

import errno
import itertools
import json
import logging
import os
import shutil
import time
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path

import datasets
import numpy as np
import torch
from datasets import Dataset, Value
from datasets.fingerprint import Hasher

from .data import LABELS, PIXELS, ImageSplits, refuse_classes_without_images
from .errors import RecipeError
from .images import LOST, decode_to_chw, image_path, probe, problem_of, stored_size, white_level
from .launch import env_int
from .streaming import is_stream

logger = logging.getLogger(__name__)

DECODE_CHOICES = ("auto", "once", "per_batch")
SKIPPED_DURING_RUN = "skipped_images.jsonl"  # per-batch path: unreadable images found by the workers, one per line
CACHE_HEADROOM = 1.05  # Arrow's offsets and metadata on top of the pixels
DECODE_VERSION = 2  # part of a decoded copy's name: raise it when decode_to_chw changes what it stores


@dataclass(frozen=True)
class StorageFormat:
    """How every image of a dataset is stored: one size, and one white level for high-bit-depth images."""

    shape: tuple[int, int]  # (height, width)
    white: float = 255.0
    native: bool = False  # the images' own common size (others are resized to it and counted)
    sampled: tuple[int, int] | None = None  # (width, height) of the most common size among the images probed
    source_bytes: float | None = None  # the probed images' mean size as stored (file or bytes), compressed

    @property
    def growth(self) -> float | None:
        """A decoded image's size over its stored (compressed) size."""
        return 3 * self.shape[0] * self.shape[1] / self.source_bytes if self.source_bytes else None


def storage_format(split: Dataset, image_column: str, image_size: int, storage_size: int | None) -> StorageFormat:
    """First 64 images: their common size if <= the model's (upsampling is cheap), else image_size/0.875; white level."""
    sizes, peak, deep, stored = Counter(), None, 0, []
    for value in split.select(range(min(64, len(split))))[image_column]:
        try:
            size, high = probe(value)
            stored.append(stored_size(value))
        except Exception:  # a corrupt header: the decoding counts it
            continue
        sizes[size] += 1
        if high is not None:
            peak, deep = max(peak or 0.0, high), deep + 1
    white = 255.0 if peak is None else white_level(peak)
    if peak is not None:
        logger.warning(
            f"High-bit-depth images ({deep} of {sum(sizes.values())} sampled, largest value {peak:g}): those are "
            f"scaled by 255/{white:g} to 8 bits; 8-bit images are stored as they are"
        )
    common = sizes.most_common(1)[0][0] if sizes else None
    source = sum(stored) / len(stored) if stored and all(stored) else None
    if common and not storage_size:
        (width, height), count = common, sizes[common]
        if 2 * count > sum(sizes.values()) and max(width, height) <= image_size:
            return StorageFormat((height, width), white, native=True, sampled=common, source_bytes=source)
    side = storage_size or round(image_size / 0.875)
    return StorageFormat((side, side), white, sampled=common, source_bytes=source)


MAX_GROWTH = 2.0  # auto decodes once while a decoded image is at most this many times its stored size


def choose_decoding(requested: str, storage: StorageFormat) -> tuple[str, str]:
    """("once" or "per_batch", why): `requested` unless "auto". Auto decodes once when the decoded copy is at most
    MAX_GROWTH times the images as stored (small images: CIFAR's PNGs 1.2x; it saves decoding every step), else per
    batch (photos: a 450x360 JPEG of 45 KB is 192 KB at 256x256, 4.3x, and would cost minutes before step 1)."""
    if requested != "auto":
        return requested, f"--decode_images {requested}"
    seen = "x".join(map(str, storage.sampled)) if storage.sampled else "of unknown size"
    growth = storage.growth
    if growth is None:  # sizes unknown (e.g. remote files): a copy the size of the pixels is the safe guess
        return "once", f"images {seen}, their stored size unknown"
    what = f"images {seen}, ~{storage.source_bytes / 1024:.0f} KB stored, decoded {growth:.1f}x that"
    return ("once", what) if growth <= MAX_GROWTH else ("per_batch", what)


def say(line: str) -> None:
    """What a run does with the images, once (the first process): printed, as the run's other facts are; warnings
    are for what changes the user's data."""
    if env_int("RANK", default=0) == 0:
        print(line, flush=True)


def _cache_folder(dataset: Dataset) -> Path:
    """Where `map` writes a dataset's decoded copy: beside its Arrow files, else (an in-memory table) the datasets
    cache."""
    if dataset.cache_files:
        return Path(dataset.cache_files[0]["filename"]).parent
    return Path(datasets.config.HF_DATASETS_CACHE) / "vit_recipes_decoded"


def copy_size(rows: int, shape: tuple[int, int]) -> int:
    return int(rows * 3 * shape[0] * shape[1] * CACHE_HEADROOM)


def _size(n: float) -> str:
    return next(
        f"{n / 2**p:.{d}f} {u}"
        for p, d, u in ((30, 1, "GiB"), (20, 0, "MiB"), (10, 0, "KiB"), (0, 0, "B"))
        if n >= 2**p or u == "B"
    )


def check_cache_room(folder: Path, needed: int) -> None:
    """Refuse before decoding when the decoded copy cannot fit beside what is free in its folder."""
    probe_at = folder
    while not probe_at.exists():
        probe_at = probe_at.parent
    if (free := shutil.disk_usage(probe_at).free) < needed:
        raise RecipeError(
            f"the decoded copy needs {_size(needed)} in the datasets cache {folder}, which has {_size(free)} free: "
            "pass --decode_images per_batch (no copy), --streaming for a dataset larger than the disk, or point "
            "HF_DATASETS_CACHE (or --cache_dir) at a larger disk"
        )


def _decode_batch(batch, image_column: str, height: int, width: int, white: float):
    pixels, problems = [], []
    for value in batch[image_column]:
        try:
            array, done = decode_to_chw(value, height, width, white)
            pixels.append(array.tobytes())
            problems.append(done)
        except Exception as err:  # corrupt/truncated/unsupported: skip and name it (see module docstring)
            pixels.append(b"")
            problems.append(problem_of(err))
    return {PIXELS: pixels, "problem": problems}


def _remove_new_files(folder: Path, before: set[str], since: float) -> None:
    """What a failed `map` left half-written in its cache folder (its shards and temporary files)."""
    for path in folder.glob("*") if folder.is_dir() else []:
        if path.name not in before and path.is_file() and path.stat().st_mtime >= since - 1:
            path.unlink(missing_ok=True)


def _no_space(err: BaseException) -> bool:
    while err is not None:
        if isinstance(err, OSError) and err.errno == errno.ENOSPC or "No space left on device" in str(err):
            return True
        err = err.__cause__ or err.__context__
    return False


def decode_datasets(
    parts: dict[str, Dataset], image_column: str, storage: StorageFormat, num_proc: int | None, notes: list[str]
) -> tuple[dict[str, Dataset], dict[str, list[dict]]]:
    """Decode the splits in `parts` once to uint8 CHW bytes (cached by fingerprint); return them and each one's skipped
    {row, image, problem}. Together, they are one `map`: one pool of processes to start (~0.5 s on 16 cores)."""
    height, width = storage.shape
    together = next(iter(parts.values())) if len(parts) == 1 else datasets.concatenate_datasets(list(parts.values()))
    kept = {k: v for k, v in together.features.items() if k != image_column}
    folder, needed = _cache_folder(together), copy_size(len(together), storage.shape)
    # The copy's name, fixed here rather than derived by `map`: a run can tell it is on disk already (then nothing is
    # written, whatever the free space). An in-memory table (an indexed folder) names its file by it too.
    copy = Hasher.hash((together._fingerprint, height, width, storage.white, DECODE_VERSION))
    named = {"new_fingerprint": copy}
    if not together.cache_files:
        folder.mkdir(parents=True, exist_ok=True)
        named["cache_file_name"] = str(folder / f"decoded-{copy}.arrow")
    before, since = {p.name for p in folder.glob("*")} if folder.is_dir() else set(), time.time()
    if not any(copy in name for name in before):  # map's files hold the fingerprint in their names (shards too)
        check_cache_room(folder, needed)
    try:
        together = together.map(
            _decode_batch, batched=True, batch_size=256, remove_columns=[image_column],
            fn_kwargs={"image_column": image_column, "height": height, "width": width, "white": storage.white},
            features=datasets.Features({**kept, PIXELS: Value("binary"), "problem": Value("string")}),
            num_proc=num_proc if num_proc and num_proc > 1 and len(together) > 1000 else None,
            desc=f"Decoding {' and '.join(parts)} images to {height}x{width} uint8", **named,
        )  # fmt: skip
    except Exception as err:
        if not _no_space(err):
            raise
        _remove_new_files(folder, before, since)
        free = shutil.disk_usage(folder).free
        raise RecipeError(
            f"the datasets cache {folder} filled up while decoding ({_size(free)} free now, the decoded copy needs "
            f"{_size(needed)}); its partial files are removed: free space, point HF_DATASETS_CACHE (or --cache_dir) "
            "at a larger disk, or pass --decode_images per_batch (no copy)"
        ) from None
    say(f"The decoded copy of the {' and '.join(parts)} images: {_size(needed)} in {folder}")
    all_problems, out, skipped, start = together.data.column("problem").to_pylist(), {}, {}, 0
    for name, dataset in parts.items():
        decoded = together.select(range(start, start + len(dataset)))
        problems, start = all_problems[start : start + len(dataset)], start + len(dataset)
        tags = Counter(tag for problem in problems for tag in problem.split(",") if tag)
        if tags["resized"] and storage.native:
            cut = f", {tags['cropped']} of them losing over half their area (a long strip)" if tags["cropped"] else ""
            notes.append(
                f"{name}: {tags['resized']} image(s) not {width}x{height}, the common size, resized to cover it and "
                f"centre-cropped{cut}"
            )
            logger.warning(notes[-1])
        if tags["first frame"]:
            notes.append(f"{name}: {tags['first frame']} animated or multi-frame image(s): the first frame is used")
            logger.warning(notes[-1])
        bad = [i for i, problem in enumerate(problems) if problem in LOST]
        values = dataset.select(bad)[image_column] if bad else []
        paths = [image_path(value) for value in values]
        if lost := [{"row": row, "image": path, "problem": problems[row]} for row, path in zip(bad, paths)]:
            listed = [f"{item['image'] or 'row ' + str(item['row'])} ({item['problem']})" for item in lost]
            more = f" and {len(lost) - 10} more" if len(lost) > 10 else ""
            notes.append(f"{name}: {len(lost)} image(s) skipped (not found, too large or unreadable)")
            logger.warning("Skipped %d image(s) in split '%s': %s%s", len(lost), name, ", ".join(listed[:10]), more)
            decoded = decoded.select(sorted(set(range(len(problems))).difference(bad)))
            if len(decoded) == 0:
                raise RecipeError(f"every image in split '{name}' is missing, corrupt or unreadable, e.g. {listed[0]}")
        out[name], skipped[name] = decoded.remove_columns("problem"), lost
    return out, skipped


def decode_splits(
    splits: ImageSplits, image_size: int, storage_size: int | None = None, num_proc: int | None = None,
    storage: StorageFormat | None = None,
) -> ImageSplits:  # fmt: skip
    """The "once" path: every split decoded to the storage format, skipped images counted and noted."""
    reference = splits.train or splits.validation or splits.test
    storage = storage or storage_format(reference, splits.image_column, image_size, storage_size)
    notes, decoded, skipped = list(splits.notes), dict.fromkeys(("train", "validation", "test")), {}
    # validation and test share a pass; train has its own, so an evaluation-only run finds theirs in the cache
    for group in (("train",), ("validation", "test")):
        if parts := {name: split for name, split in splits.present().items() if name in group}:
            done, lost = decode_datasets(parts, splits.image_column, storage, num_proc, notes)
            decoded, skipped = decoded | done, skipped | lost
    refuse_classes_without_images(decoded["train"], splits.label_names, had=splits.train)  # all unreadable
    stored = dict(image_column=PIXELS, storage_shape=storage.shape, white=storage.white, notes=notes)
    return replace(splits, **decoded, **stored, skipped={name: rows for name, rows in skipped.items() if rows})


def prepare_images(splits: ImageSplits, image_size: int, data_args) -> ImageSplits:
    """Choose how this dataset's images reach the DataLoader (module docstring), say which and why, and do it."""
    reference = splits.train or splits.validation or splits.test
    if is_stream(reference):  # its first images, read from this rank's first shard
        reference = Dataset.from_list(list(itertools.islice(reference.part, 64)), features=reference.part.features)
    storage = storage_format(reference, splits.image_column, image_size, data_args.storage_size)
    decode, why = choose_decoding(data_args.decode_images, storage)
    if is_stream(splits.train):
        decode, why = "per_batch", "--streaming"
    height, width = storage.shape
    if decode == "once":
        rows = sum(len(d) for d in splits.present().values())
        say(
            f"Images decoded once to {height}x{width} uint8 ({why}): a copy of about "
            f"{_size(copy_size(rows, storage.shape))} on disk; --decode_images per_batch decodes in the DataLoader "
            "workers instead"
        )
        return decode_splits(splits, image_size, num_proc=data_args.preprocessing_num_workers, storage=storage)
    instead = "" if is_stream(splits.train) else "; --decode_images once caches a copy instead"
    say(f"Images decoded per batch by the DataLoader workers to {height}x{width} uint8 ({why}): no decoded copy on disk"
        f"{instead}")  # fmt: skip
    return replace(splits, storage_shape=storage.shape, white=storage.white, decode="per_batch")


class PixelCollator:
    """Stacks stored uint8 CHW bytes into one (B, 3, H, W) uint8 tensor: the only work left for DataLoader workers."""

    def __init__(self, shape: tuple[int, int]):
        self.shape = shape

    def __call__(self, rows: list[dict]) -> dict[str, torch.Tensor]:
        buffer = b"".join(row[PIXELS] for row in rows)
        pixels = np.frombuffer(buffer, dtype=np.uint8).reshape(len(rows), 3, *self.shape)
        return {"pixel_values": torch.from_numpy(pixels.copy()), **_labels(rows)}


def _labels(rows: list[dict]) -> dict[str, torch.Tensor]:
    if LABELS not in rows[0]:
        return {}
    labels = [row[LABELS] for row in rows]  # class ids, or multi-hot float32 vectors (multi-label)
    return {"labels": torch.tensor(labels, dtype=torch.float32 if isinstance(labels[0], list) else torch.long)}


class DecodingCollator:
    """The per-batch path: decodes a batch's images (each as the "once" path would) into one uint8 (B, 3, H, W)
    tensor, in the DataLoader worker that collates it. An unreadable image is replaced by a copy of another image of
    its batch, with its label, so the batch keeps its shape (a compiled step); it is logged and listed in
    `record` (one JSON line each), which the run's card and skipped_images.json report at the end."""

    def __init__(self, shape: tuple[int, int], white: float, image_column: str, record: str | None = None):
        self.shape, self.white, self.image_column, self.record = shape, white, image_column, record

    def __call__(self, rows: list[dict]) -> dict[str, torch.Tensor]:
        pixels = torch.empty((len(rows), 3, *self.shape), dtype=torch.uint8)
        bad = []
        for i, row in enumerate(rows):
            try:
                pixels[i] = torch.from_numpy(decode_to_chw(row[self.image_column], *self.shape, self.white)[0])
            except Exception as err:  # corrupt/truncated/missing: replaced below, and reported
                bad.append((i, problem_of(err)))
        if bad:
            rows = self._replace(rows, pixels, bad)
        return {"pixel_values": pixels, **_labels(rows)}

    def _replace(self, rows: list[dict], pixels: torch.Tensor, bad: list[tuple[int, str]]) -> list[dict]:
        broken = {i for i, _ in bad}
        good = [i for i in range(len(rows)) if i not in broken]
        lost = []
        for i, problem in bad:
            value = rows[i][self.image_column]
            lost.append({"image": image_path(value), "problem": problem})
            logger.warning("Unreadable image %s (%s): replaced in its batch by a copy of another", lost[-1]["image"],
                           problem)  # fmt: skip
        if self.record:
            with open(self.record, "a") as f:  # one short write per line: appends from workers do not interleave
                for item in lost:
                    f.write(json.dumps(item) + "\n")
        if not good:
            raise RuntimeError(f"every image of a batch is unreadable, e.g. {lost[0]['image']} ({lost[0]['problem']})")
        rows = list(rows)
        for n, (i, _) in enumerate(bad):
            source = good[n % len(good)]
            pixels[i], rows[i] = pixels[source], rows[source]
        return rows


def make_collator(splits: ImageSplits, output_dir: str | None):
    if splits.decode == "per_batch":
        record = os.path.join(output_dir, SKIPPED_DURING_RUN) if output_dir else None
        return DecodingCollator(splits.storage_shape, splits.white, splits.image_column, record)
    return PixelCollator(splits.storage_shape)


def share_cores_with_workers(training, splits: ImageSplits) -> None:
    """Decoding per batch is the DataLoader workers' work: unless --dataloader_num_workers was given, they take this
    process's share of the machine's cores (the process itself mostly waits on the GPU)."""
    if splits.decode != "per_batch" or getattr(training, "workers_given", True):
        return
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    share = max(1, cores // max(1, env_int("LOCAL_WORLD_SIZE", "LOCAL_SIZE")))  # torchrun's; DeepSpeed's launcher
    if share > training.dataloader_num_workers:
        say(
            f"DataLoader workers: {share} per process, this process's share of {cores} cores, as they decode every "
            "batch (--dataloader_num_workers to change)"
        )
        training.dataloader_num_workers, training.dataloader_persistent_workers = share, True
        training.dataloader_prefetch_factor = training.dataloader_prefetch_factor or 4


def note_skipped_during_run(splits: ImageSplits, output_dir: str) -> ImageSplits:
    """The per-batch path's unreadable images, by split, into the run's notes (card) and skipped_images.json."""
    lost = skipped_during_run(output_dir) if splits.decode == "per_batch" else []
    if not lost:
        return splits
    notes, skipped, left = list(splits.notes), dict(splits.skipped), {item["image"]: item for item in lost}
    for name, split in splits.present().items():
        paths = [image_path(v) for v in split[splits.image_column]]
        if found := [left.pop(path) for path in paths if path in left]:
            skipped[name] = skipped.get(name, []) + found
            notes.append(f"{name}: {len(found)} unreadable image(s) replaced in their batch by another of it")
    if left:  # no path to place them by (images stored as bytes)
        skipped["unplaced"] = list(left.values())
        notes.append(f"{len(left)} unreadable image(s) replaced in their batch by another of it")
    return replace(splits, notes=notes, skipped=skipped)


def skipped_during_run(output_dir: str) -> list[dict]:
    """The per-batch path's unreadable images (each once), as the workers recorded them."""
    path = Path(output_dir, SKIPPED_DURING_RUN)
    if not path.is_file():
        return []
    seen = {}
    for line in path.read_text().splitlines():
        item = json.loads(line)
        seen.setdefault(item["image"], item)
    return list(seen.values())

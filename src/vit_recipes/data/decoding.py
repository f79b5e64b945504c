"""How images reach the DataLoader as uint8 (B, 3, H, W) batches at one storage size; the device augments them next.

Two paths, chosen per dataset (`choose_decoding`, said in one log line):
- once: every image decoded before training into a uint8 copy that `datasets` caches on disk; epochs only slice it.
  Small images (CIFAR's 32x32: 3 KB decoded) make a copy about the size of the source and no CPU work per step.
- per batch: the DataLoader workers decode each batch (JPEG at a reduced DCT scale where that still covers the
  storage size) and nothing is written. Photos of a few hundred pixels decode to 4x their JPEG size or more, and
  the copy would cost minutes before the first step and its size again on disk; the workers keep pace with the GPU.
"""

import errno
import hashlib
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

from ..core.errors import RecipeError
from ..core.launch import env_int
from ..core.metrics import LEFT_OUT
from .data import LABELS, PIXELS, ImageSplits, refuse_classes_without_images
from .images import BRIGHTER, LOST, decode_to_chw, image_path, probe, problem_of, stored_size, white_level
from .streaming import is_stream

logger = logging.getLogger(__name__)

DECODE_CHOICES = ("auto", "once", "per_batch")
SKIPPED_DURING_RUN = "skipped_images.jsonl"  # per-batch path: what the workers met (unreadable images...), one a line
CACHE_HEADROOM = 1.05  # Arrow's offsets and metadata on top of the pixels
DECODE_VERSION = 3  # part of a decoded copy's name: raise it when decode_to_chw changes what it stores


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


def tag_notes(split: str, tags: Counter, white: float) -> list[str]:
    """The notes for what decoding did to some images of a split (decode_to_chw's tags), both paths alike."""
    notes = []
    if tags["first frame"]:
        notes.append(f"{split}: {tags['first frame']} animated or multi-frame image(s): the first frame is used")
    if tags[BRIGHTER]:
        notes.append(
            f"{split}: {tags[BRIGHTER]} high-bit-depth image(s) brighter than the white level {white:g} (set by the "
            "first 64 images): each scaled by its own bit depth's white instead of clipping"
        )
    return notes


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
        for note in tag_notes(name, tags, storage.white):
            notes.append(note)
            logger.warning(note)
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
        reference = Dataset.from_list(reference.head(64), features=reference.part.features)
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


TRAIN = "train"  # the split whose unreadable images are replaced in their batch; other splits' are left out
NOTED = ("first frame", BRIGHTER)  # what decode_to_chw did that the card counts, beside unreadable images


class DecodingCollator:
    """The per-batch path: decodes a batch's images (each as the "once" path would) into one uint8 (B, 3, H, W)
    tensor, in the DataLoader worker that collates it. An unreadable image keeps the batch's shape (a compiled step;
    accelerate's gather_for_metrics trims a last batch's padding by counting full batches):
    - training: it is replaced by a copy of another image of its batch, with that image's label; in a batch with no
      readable image, by `fallback` (the training split's first readable image: make_collator), else black;
    - evaluating (`for_evaluation`: batches.DeviceBatches gives evaluation and prediction loaders this copy): its row
      is black and labelled metrics.LEFT_OUT, which the loss, the metrics and the reports leave out.
    Each is logged and written to `record` with its split (one JSON line each), as is each image decoded with a change
    the card counts (NOTED); note_skipped_during_run reports them at the end, in the card and skipped_images.json."""

    def __init__(self, shape: tuple[int, int], white: float, image_column: str, record: str | None = None,
                 split: str = TRAIN, evaluating: bool = False, fallback: tuple | None = None):  # fmt: skip
        self.shape, self.white, self.image_column, self.record = shape, white, image_column, record
        self.split, self.evaluating, self.fallback = split, evaluating, fallback  # fallback: (pixels, row)
        self._recorded: set[tuple] = set()  # this worker's recorded images: a later epoch meets them again

    def _decode(self, value):
        """decode_to_chw's (array, done), or the exception it raised."""
        try:
            return decode_to_chw(value, *self.shape, self.white)
        except Exception as err:  # corrupt/truncated/missing: replaced or left out by __call__, and reported
            return err

    def for_evaluation(self, split: str | None) -> "DecodingCollator":
        """This collator for an evaluation or prediction loader of `split` (None: this collator's own)."""
        return DecodingCollator(self.shape, self.white, self.image_column, self.record, split or self.split, True)

    def __call__(self, rows: list[dict]) -> dict[str, torch.Tensor]:
        pixels = torch.empty((len(rows), 3, *self.shape), dtype=torch.uint8)
        bad, met = [], []
        for i, decoded in enumerate(self._decode(row[self.image_column]) for row in rows):
            if isinstance(decoded, Exception):
                bad.append(i)
                met.append((i, problem_of(decoded)))
                continue
            array, done = decoded
            pixels[i] = torch.from_numpy(array)
            met += [(i, tag) for tag in done.split(",") if tag in NOTED]
        if met:
            self._record(rows, met)
        if bad and not self.evaluating:
            rows = self._replace(rows, pixels, bad)
        batch = {"pixel_values": pixels, **_labels(rows)}
        if bad and self.evaluating:
            pixels[bad] = 0
            if "labels" in batch:
                batch["labels"][bad] = LEFT_OUT
        return batch

    def _record(self, rows: list[dict], met: list[tuple[int, str]]) -> None:
        """Log and append to `record` what this worker has not met before: one write, so that the appends of
        several workers (and ranks) do not interleave."""
        lines = []
        for i, problem in met:
            value = rows[i][self.image_column]
            item = {"split": self.split, "image": image_path(value), "problem": problem}
            if item["image"] is None:  # stored as bytes: told apart by a digest of them
                raw = value.get("bytes") if isinstance(value, dict) else value
                raw = raw if isinstance(raw, (bytes, bytearray)) else repr(raw).encode()
                item["digest"] = hashlib.blake2b(raw, digest_size=8).hexdigest()
            key = (self.split, item["image"] or item["digest"], problem)
            if key in self._recorded:
                continue
            self._recorded.add(key)
            lines.append(json.dumps(item) + "\n")
            if problem in LOST:
                what = f"left out of the evaluation of {self.split}" if self.evaluating else (
                    "replaced in its training batch by a copy of another")  # fmt: skip
                logger.warning("Unreadable image %s (%s): %s", item["image"] or "(stored as bytes)", problem, what)
        if self.record and lines:
            fd = os.open(self.record, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, "".join(lines).encode())
            finally:
                os.close(fd)

    def _replace(self, rows: list[dict], pixels: torch.Tensor, bad: list[int]) -> list[dict]:
        broken = set(bad)
        good = [i for i in range(len(rows)) if i not in broken]
        if not good:
            instead = "the training split's first readable image" if self.fallback else "a black image"
            logger.warning("No image of a training batch of %d is readable: each trains as %s", len(rows), instead)
        rows = list(rows)
        for n, i in enumerate(bad):
            if good:
                source = good[n % len(good)]
                pixels[i], rows[i] = pixels[source], rows[source]
            elif self.fallback:
                pixels[i], rows[i] = self.fallback
            else:  # none of the split's first 64 images is readable either: its own label
                pixels[i] = 0
        return rows


def first_readable(split, image_column: str, shape: tuple[int, int], white: float) -> tuple | None:
    """(pixels, row) of the first of a split's first 64 images that decodes (a stream: this rank's part), else None."""
    for row in split.head(64) if is_stream(split) else itertools.islice(split, 64):  # a stream: as the probe reads
        try:
            array, _ = decode_to_chw(row[image_column], *shape, white)
        except Exception:  # unreadable: the next one
            continue
        return torch.from_numpy(array), {k: v for k, v in row.items() if k == LABELS}
    return None


def make_collator(splits: ImageSplits, output_dir: str | None):
    """The training collator (batches.DeviceBatches makes evaluation's from it)."""
    if splits.decode != "per_batch":
        return PixelCollator(splits.storage_shape)
    record = os.path.join(output_dir, SKIPPED_DURING_RUN) if output_dir else None
    shape, white = splits.storage_shape, splits.white
    fallback = first_readable(splits.train, splits.image_column, shape, white) if splits.train is not None else None
    return DecodingCollator(shape, white, splits.image_column, record, fallback=fallback)


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
    """What the per-batch path's DataLoader workers met, by split, into the run's notes (card and log) and
    skipped_images.json: unreadable images (training's replaced, evaluation's left out), and those NOTED."""
    met = skipped_during_run(output_dir) if splits.decode == "per_batch" else []
    notes, skipped = list(splits.notes), dict(splits.skipped)
    order = ["train", "validation", "test"]
    for name in sorted({item["split"] for item in met}, key=lambda n: (order.index(n) if n in order else 3, n)):
        items = [item for item in met if item["split"] == name]
        found = []
        if lost := [{"image": item["image"], "problem": item["problem"]} for item in items if item["problem"] in LOST]:
            skipped[name] = skipped.get(name, []) + lost
            what = "replaced in their batch by another of it" if name == TRAIN else "left out of its evaluation"
            found.append(f"{name}: {len(lost)} unreadable image(s) {what}")
        found += tag_notes(name, Counter(item["problem"] for item in items), splits.white)
        for note in found:
            logger.warning(note)
        notes += found
    return replace(splits, notes=notes, skipped=skipped) if met else splits


def skipped_during_run(output_dir: str) -> list[dict]:
    """What the per-batch path's workers recorded in `output_dir` ({split, image, problem}), each once."""
    path = Path(output_dir, SKIPPED_DURING_RUN)
    if not path.is_file():
        return []
    seen = {}
    for line in path.read_text().splitlines():
        item = json.loads(line)
        digest = item.pop("digest", None)  # only tells images stored as bytes apart
        seen.setdefault((item["split"], item["image"] or digest, item["problem"]), item)
    return list(seen.values())

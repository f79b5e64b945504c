"""A local dataset folder -> its splits, from one walk of the tree.

`datasets.load_dataset(<folder>)` finds the splits by resolving some 46 glob patterns, each a walk over the whole tree
(on a 60,000-image folder most of a minute), then builds an imagefolder table example by example. Here one
`os.scandir` walk names every file once; the splits are then handed to `datasets` explicitly (`data_files`), and a
folder of images alone becomes its table directly: each row a path and a class id. What `datasets` would infer is
kept: its split keywords and their order of precedence, its files to ignore, imagefolder's image extensions and
labels (the parent folder's name, when every image is at the same depth and there are at least two such folders).
What it would trip on is said instead: a symlink loop is skipped, images PIL cannot open here and empty files are
left out, and images at mixed depths are refused by name (datasets drops the labels: nothing could train).
"""

import hashlib
import logging
import os
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import datasets
from datasets.data_files import FILES_TO_IGNORE, NON_WORDS_CHARS, SPLIT_KEYWORDS
from PIL import Image

from ..core.errors import RecipeError
from .images import HEIF_EXTENSIONS, IMAGE_EXTENSIONS

logger = logging.getLogger(__name__)

DATA_BUILDERS = {".parquet": "parquet", ".arrow": "arrow", ".csv": "csv", ".json": "json", ".jsonl": "json"}
METADATA_FILES = ("metadata.csv", "metadata.jsonl", "metadata.parquet")  # imagefolder's per-image columns
SEP = f"[{re.escape(NON_WORDS_CHARS[:-3])}0-9]"  # "-", ".", "_", " " or a digit, as in datasets' patterns
# datasets' order: "train-00000-of-00002" shards, then split keywords in folder names, then in file names.
SHARDED = re.compile(r"(?:^|/)([^/]+?)-\d{5}-of-\d{5}[^/]*$")


def _keyword_pattern(keyword: str, in_dir: bool) -> re.Pattern:
    name = rf"(?:{keyword}|{keyword}{SEP}[^/]*|[^/]*{SEP}{keyword}|[^/]*{SEP}{keyword}{SEP}[^/]*)"
    return re.compile(rf"(?:^|/){name}/" if in_dir else rf"(?:^|/){name}$")


KEYWORD_PATTERNS = {
    in_dir: {str(split): [_keyword_pattern(k, in_dir) for k in keywords] for split, keywords in SPLIT_KEYWORDS.items()}
    for in_dir in (True, False)
}


@dataclass
class FolderIndex:
    """Every file of a dataset folder that `datasets` would read, by split (paths relative to the root)."""

    root: Path
    splits: dict[str, list[str]] = field(default_factory=dict)
    signature: str = ""  # changes when any indexed file's path, size or modification time does
    empty: set[str] = field(default_factory=set)  # files of 0 bytes (e.g. placeholders of files never downloaded)

    @property
    def files(self) -> list[str]:
        return [f for files in self.splits.values() for f in files]


def _wanted(name: str) -> bool:
    """A file or folder name that `datasets` reads (its folders were checked on the way down)."""
    hidden = name.startswith(".") or (name.startswith("__") and name != "__init__")
    return not hidden and name not in FILES_TO_IGNORE


def suffix(relative: str) -> str:
    """The file name's extension, lower-cased (os.path.splitext's, without its cost on a million names)."""
    name = relative[relative.rfind("/") + 1 :]
    dot = name.rfind(".")
    return name[dot:].lower() if dot > 0 and name[:dot].strip(".") else ""


def walk(root: Path) -> tuple[list[str], str, set[str]]:
    """Every file under `root` (sorted, relative, '/'-separated), a signature of their sizes and times, and those of 0
    bytes. Symlinks are followed, except a folder that leads back to one above it (a loop: skipped, in one line); a
    dangling symlink is kept, so decoding reports it as "not found". Plain strings throughout: per-file Python work is
    most of the walk on a folder of a million images."""
    found, digest, loops = [], hashlib.sha256(), []
    top = os.stat(root)
    stack = [("", frozenset({(top.st_dev, top.st_ino)}))]  # a folder, and the (device, inode) of it and its parents
    while stack:
        folder, above = stack.pop()
        prefix = f"{folder}/" if folder else ""
        with os.scandir(os.path.join(root, folder)) as entries:
            for entry in entries:
                if not _wanted(entry.name):
                    continue
                if entry.is_dir(follow_symlinks=True):
                    stat = entry.stat()
                    if (key := (stat.st_dev, stat.st_ino)) in above:
                        loops.append(prefix + entry.name)
                    else:
                        stack.append((prefix + entry.name, above | {key}))
                else:
                    try:
                        stat = entry.stat()
                    except FileNotFoundError:  # a dangling symlink
                        stat = entry.stat(follow_symlinks=False)
                    found.append((prefix + entry.name, stat.st_size, stat.st_mtime_ns))
    if loops:
        logger.warning(
            "Skipped %d symlinked folder(s) that lead back to a folder above them (a loop): %s",
            len(loops), ", ".join(sorted(loops)[:5]) + (", ..." if len(loops) > 5 else ""),
        )  # fmt: skip
    found.sort()
    digest.update("".join(f"{relative}\0{size}\0{mtime}\n" for relative, size, mtime in found).encode())
    return [relative for relative, _, _ in found], digest.hexdigest()[:16], {f for f, size, _ in found if size == 0}


def _keyword_split(path: str, in_dir: bool) -> str | None:
    for split, patterns in KEYWORD_PATTERNS[in_dir].items():
        if any(p.search(path) for p in patterns):
            return split
    return None


def assign_splits(files: list[str]) -> dict[str, list[str]]:
    """Files by split, the way datasets' default patterns would name them (everything is train when none matches)."""
    sharded: dict[str, list[str]] = {}
    for f in files:
        if match := SHARDED.search(f):
            sharded.setdefault(match[1].rsplit("/", 1)[-1], []).append(f)
    if sharded and sum(map(len, sharded.values())) == len(files):
        return sharded
    # Folder keywords depend on a file's folder alone: matched once per folder, not once per file.
    by_folder: dict[str, str | None] = {}
    for in_dir in (True, False):
        splits: dict[str, list[str]] = {}
        for f in files:
            if in_dir:
                folder = f[: f.rfind("/") + 1]  # "" or "a/b/": the patterns need a folder's closing "/"
                if folder not in by_folder:
                    by_folder[folder] = _keyword_split(folder, True)
                split = by_folder[folder]
            else:
                split = _keyword_split(f, False)
            if split is not None:
                splits.setdefault(split, []).append(f)
        if splits:
            return splits
    return {"train": list(files)}


def index_folder(root: Path) -> FolderIndex:
    files, signature, empty = walk(root)
    if not files:
        raise RecipeError(f"no dataset found in folder {root}: it holds no files")
    splits = assign_splits(files)
    order = [str(s) for s in SPLIT_KEYWORDS]  # datasets' own order (a builder reads the first split's types first)
    ordered = sorted(splits, key=lambda s: order.index(s) if s in order else len(order))
    return FolderIndex(root, {s: splits[s] for s in ordered}, signature, empty)


def class_names(root: Path, images: list[str]) -> list[str]:
    """imagefolder's labels: the parent folders' names, when there are at least two and every image is at one depth;
    else none. Class folders beside images at another depth (a stray image at a split's root, a nested folder) are
    refused by name: datasets would drop every label, and the run then asks for a label column the folder cannot
    have."""
    labels = sorted({f.rsplit("/", 2)[-2] for f in images if "/" in f})
    depths = Counter(f.count("/") for f in images)
    if len(labels) < 2 or len(depths) == 1:
        return labels if len(labels) > 1 else []
    common = depths.most_common(1)[0][0]
    stray = [f for f in images if f.count("/") != common]
    like = {d: next(f for f in images if f.count("/") == d) for d, _ in depths.most_common()}
    found = ", ".join(f"{n} like {like[d]}" for d, n in depths.most_common())
    more = f" and {len(stray) - 3} more" if len(stray) > 3 else ""
    raise RecipeError(
        f"images in {root} sit at different depths ({found}), so their folders cannot name their classes: move "
        f"{', '.join(stray[:3])}{more} into a class folder, or remove them"
    )


def _readable(images: list[str], suffixes: set[str], empty: set[str]) -> tuple[list[str], list[str]]:
    """`images` less those that cannot train, and one line per kind left out: formats PIL has no opener for here
    (HEIC/HEIF without the pillow-heif plugin) and empty files (0 bytes: placeholders of files never downloaded)."""
    opened = Image.registered_extensions()  # the plugins' too (images.py registers pillow-heif's where installed)
    unopened = {s for s in suffixes if s not in opened}
    left = {
        "format": [f for f in images if suffix(f) in unopened] if unopened else [],
        "empty": [f for f in images if f in empty] if empty else [],
    }
    if not any(left.values()):
        return images, []
    lines = []
    if files := left["format"]:
        heif = unopened & set(HEIF_EXTENSIONS)
        how = "pip install pillow-heif (or the heif extra: pip install 'vit-recipes[heif]')" if heif else ""
        how = how or f"a Pillow built with {', '.join(sorted(unopened))} support"
        lines.append(
            f"Left out {len(files)} image(s) that PIL cannot open here ({', '.join(sorted(unopened))}), e.g. "
            f"{files[0]}: {how} reads them"
        )
    if files := left["empty"]:
        more = f" and {len(files) - 3} more" if len(files) > 3 else ""
        lines.append(f"Left out {len(files)} empty image file(s) (0 bytes): {', '.join(files[:3])}{more}")
    out = set(left["format"]) | set(left["empty"])
    return [f for f in images if f not in out], lines


def _image_table(index: FolderIndex, labels: list[str]) -> datasets.DatasetDict:
    """Images alone: one row per image, {path} and imagefolder's label (`labels`: the splits' union of class names)."""
    features = datasets.Features({"image": datasets.Image(decode=False)})
    if labels:
        features["label"] = datasets.ClassLabel(names=labels)
    ids = {name: i for i, name in enumerate(labels)}
    out = {}
    root = str(index.root)
    for split, files in index.splits.items():
        columns = {"image": [{"path": f"{root}/{f}", "bytes": None} for f in files]}
        if labels:
            columns["label"] = [ids[f.rsplit("/", 2)[-2]] for f in files]
        # The signature names the table for datasets' cache: the same folder, unchanged, finds its decoded copy.
        table = datasets.table.InMemoryTable.from_pydict(columns, schema=features.arrow_schema)
        out[split] = datasets.Dataset(table, fingerprint=f"folder-{index.signature}-{split}")
    return datasets.DatasetDict(out)


IMAGES = "images (.jpg, .png, .webp, .tif, ...: the formats datasets' imagefolder reads)"


def image_files(root: Path) -> list[str]:
    """Every image under `root` (relative paths) by the indexer's rules: the same walk, formats PIL cannot open here
    left out in one line (--predict_images: an empty file stays, for predictions.csv to call it unreadable)."""
    files, _, _ = walk(root)
    suffixes = {suffix(f) for f in files} & set(IMAGE_EXTENSIONS)
    images, lines = _readable([f for f in files if suffix(f) in suffixes], suffixes, set())
    for line in lines:
        logger.warning(line)
    return images


def load_folder(root: Path, cache_dir: str | None = None, streaming: bool = False, notes: list[str] | None = None):
    """The folder's splits: a table of image paths for a folder of images, else `datasets`' builder for its files
    (imagefolder with metadata files, parquet, arrow, CSV or JSON), given the files of each split by name.
    `streaming`: the builder's splits as streams (WebDataset `.tar` shards too); a table of paths stays a table.
    `notes`: where to add what was left out of the user's data (for the model card)."""
    builders = DATA_BUILDERS | ({".tar": "webdataset"} if streaming else {})
    index = index_folder(root.resolve())  # absolute paths in the table, as datasets writes them
    suffixes = {suffix(f) for f in index.files}
    images = suffixes & set(IMAGE_EXTENSIONS)
    data = suffixes & set(builders)
    metadata = set(METADATA_FILES)
    if images and not any(f[f.rfind("/") + 1 :] in metadata for f in index.files):
        if suffixes != images:  # other files beside the images: left out
            index.splits = {s: [f for f in fs if suffix(f) in images] for s, fs in index.splits.items()}
        labels = class_names(root, index.files)  # of every image: a class whose files are all left out is refused
        kept, lines = _readable(index.files, images, index.empty)
        if not kept:
            raise RecipeError(f"no readable images in folder {root}: {'; '.join(lines)}")
        for line in lines:
            logger.warning(line)
        if lines:
            kept = set(kept)
            index.splits = {s: [f for f in fs if f in kept] for s, fs in index.splits.items()}
        if notes is not None:
            notes.extend(lines)
        return _image_table(index, labels)
    if images:
        builder = "imagefolder"
    elif len({builders[s] for s in data}) == 1:
        builder = builders[data.pop()]
    elif data:
        raise RecipeError(f"folder {root} mixes data file types ({', '.join(sorted(data))}): keep one")
    else:
        raise RecipeError(f"no dataset found in folder {root}: no {IMAGES} and no data files ({', '.join(builders)})")
    keep = set(IMAGE_EXTENSIONS) | set(METADATA_FILES) if builder == "imagefolder" else set(builders)
    data_files = {
        split: [str(index.root / f) for f in files if suffix(f) in keep or f.endswith(METADATA_FILES)]
        for split, files in index.splits.items()
    }
    data_files = {s: f for s, f in data_files.items() if f}
    return datasets.load_dataset(builder, data_files=data_files, cache_dir=cache_dir, streaming=streaming)

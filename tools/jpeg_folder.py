#!/usr/bin/env python
"""Write an ImageNet-shaped folder of JPEG photos: the data users bring, for benchmarks and tests (no download).

    python tools/jpeg_folder.py data/jpegs --images 60000 --classes 100        # ~2.7 GB, train/ and validation/
    python tools/jpeg_folder.py /tmp/small --images 200 --classes 4 --min-side 64 --max-side 96

    python tools/jpeg_folder.py data/jpegs --parquet data/stream8 --files 8     # that folder as 8 parquet files

FOLDER/train/<class>/<n>.jpg and FOLDER/validation/<class>/<n>.jpg (--validation of the images; 5% by default), as
`datasets`' imagefolder and transformers' example read them. Each image is 400-520 x 300-420 px (ImageNet's typical
sizes; --min-side/--max-side scale both) at JPEG quality 90: a smooth random colour field, so the files compress as
photos do (with grain, ~46 KB each), with a class-coloured shape a model can learn. Seeded: the same arguments write the same
bytes. Written by every core (--workers). --parquet writes an existing folder again as parquet files of image bytes,
the way Hub datasets come (train in --files files, each of one row group unless --row-group, validation in one): the
data of a --streaming run.
"""

import argparse
import os
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw


def image(index: int, label: int, classes: int, seed: int, sides: tuple[int, int]) -> Image.Image:
    rng = np.random.default_rng([seed, index])
    low, high = sides
    width = int(rng.integers(low, high + 1))
    height = int(rng.integers(round(low * 0.75), round(high * 0.81) + 1))
    field = rng.integers(0, 256, (6, 8, 3), dtype=np.uint8)  # upsampled: smooth, like a photo's large areas
    picture = Image.fromarray(field).resize((width, height), Image.Resampling.BICUBIC)
    hue = np.array([(label * 97) % 256, (label * 53 + 80) % 256, (label * 31 + 160) % 256])
    box = rng.uniform(0.15, 0.45, 2) * (width, height)
    x0, y0 = rng.uniform(0, 1, 2) * ((width, height) - box)
    ImageDraw.Draw(picture).ellipse([x0, y0, x0 + box[0], y0 + box[1]], fill=tuple(int(v) for v in hue))
    grain = np.asarray(picture, np.float32) + rng.normal(0, 7, (height, width, 3))  # a photo's texture and noise:
    return Image.fromarray(np.clip(grain, 0, 255).astype(np.uint8))  # ~46 KB a file at quality 90, as ImageNet's


def write_one(task: tuple) -> int:
    path, index, label, classes, seed, sides = task
    picture = image(index, label, classes, seed, sides)
    picture.save(path, format="JPEG", quality=90)
    return path.stat().st_size


def write_folder(root: Path, images: int, classes: int, validation: float = 0.05, seed: int = 0,
                 sides: tuple[int, int] = (400, 520), workers: int | None = None) -> int:  # fmt: skip
    """Write the folder; returns its size in bytes."""
    tasks = []
    held_out = max(classes, round(images * validation))
    for index in range(images):
        label = index % classes
        split = "validation" if index < held_out else "train"
        folder = root / split / f"class_{label:04d}"
        tasks.append((folder / f"{index:08d}.jpg", index, label, classes, seed, sides))
    for folder in {task[0].parent for task in tasks}:
        folder.mkdir(parents=True, exist_ok=True)
    with ProcessPoolExecutor(workers or os.cpu_count()) as pool:
        return sum(pool.map(write_one, tasks, chunksize=64))


ROW_GROUP_BYTES = 1.8 * 2**30  # pyarrow reads no row group of over 2 GiB of nested binary data


def write_parquet(folder: Path, out: Path, files: int, row_group: int | None = None) -> int:
    """FOLDER's images as OUT/<split>-0000i-of-0000n.parquet (datasets' shard names), each row {image: {bytes, path},
    label}, typed as datasets' Image and ClassLabel; train in `files` files of one row group each, or of `row_group`
    rows. A file of one row group holds at most ROW_GROUP_BYTES of images (pyarrow cannot read a larger one: the
    rest of its share is left out, and said). Returns the bytes written."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    out.mkdir(parents=True, exist_ok=True)
    names = sorted(p.name for p in (folder / "train").iterdir() if p.is_dir())
    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=names)})
    written = 0
    for split, count in (("train", files), ("validation", 1)):
        paths = sorted((folder / split).rglob("*.jpg"))
        for i in range(count):
            part = paths[i::count]  # every class in every file, as a shuffled Hub shard holds them
            if row_group is None and (size := sum(p.stat().st_size for p in part)) > ROW_GROUP_BYTES:
                kept = int(len(part) * ROW_GROUP_BYTES / size)
                print(f"{split} file {i}: {kept} of its {len(part)} images, one row group within pyarrow's 2 GiB")
                part = part[:kept]
            table = pa.Table.from_pydict(
                {"image": [{"bytes": p.read_bytes(), "path": p.name} for p in part],
                 "label": [names.index(p.parent.name) for p in part]},
                schema=features.arrow_schema,
            )  # fmt: skip
            path = out / f"{split}-{i:05d}-of-{count:05d}.parquet"
            pq.write_table(table, path, row_group_size=row_group or len(part))
            written += path.stat().st_size
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", type=Path)
    parser.add_argument("--images", type=int, default=60000)
    parser.add_argument("--classes", type=int, default=100)
    parser.add_argument("--validation", type=float, default=0.05, help="share of the images in validation/")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--min-side", type=int, default=400, help="narrowest image width")
    parser.add_argument("--max-side", type=int, default=520, help="widest image width")
    parser.add_argument("--workers", type=int, default=None)
    parser.add_argument("--parquet", type=Path, default=None, help="write FOLDER (already written) as parquet here")
    parser.add_argument("--files", type=int, default=8, help="--parquet: train files")
    parser.add_argument("--row-group", type=int, default=None, help="--parquet: rows per row group (default: a file)")
    args = parser.parse_args()
    if args.parquet:
        size = write_parquet(args.folder, args.parquet, args.files, args.row_group)
        print(f"wrote {args.folder} as {args.files} train parquet file(s) ({size / 2**30:.2f} GiB) to {args.parquet}")
        return
    size = write_folder(args.folder, args.images, args.classes, args.validation, args.seed,
                        (args.min_side, args.max_side), args.workers)  # fmt: skip
    print(f"wrote {args.images} JPEGs ({size / 2**30:.2f} GiB) in {args.classes} classes to {args.folder}")


if __name__ == "__main__":
    main()

"""Local stand-ins for what benchmarks would download: Hub-shaped datasets and randomly initialised checkpoints.

    python benchmarks/make_assets.py --out bench_assets cifar100 food101 vit-base vit-huge
    python benchmarks/make_assets.py --out bench_assets convnext-tiny swin-tiny dinov2-small dinov2-base

- cifar100: CIFAR-100-shaped (uoft-cs/cifar100 columns img/fine_label), 32x32 PNG in parquet, 100 classes,
  50,000 train / 10,000 test (sizes adjustable).
- food101: Food-101-shaped (ethz/food101 columns image/label), JPEG of 384-640 px sides, 101 classes.
- vit-base / vit-huge: google/vit-{base-patch16,huge-patch14}-224-in21k configs, random weights, save_pretrained.
- convnext-tiny, swin-tiny, dinov2-small, dinov2-base: facebook/convnext-tiny-224, microsoft/swin-tiny-patch4-window7-224
  and facebook/dinov2-{small,base} configs with their image processors, random weights, 224 px. DINOv2's config says
  518 (its position embeddings' grid), as the Hub's does, and its processor crops 224: the script trains at the
  processor's 224 (modeling.training_image_size), and the processor resizes to 224 before the crop so that the peer
  (which reads shortest_edge) trains at 224 too.
Images are learnable (class colour + noise), so loss curves are meaningful.
"""

from __future__ import annotations

import argparse
import io
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

VIT_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "patch_size", "image_size")
CHECKPOINTS = {  # ViTConfig's VIT_KEYS
    "vit-base": dict(zip(VIT_KEYS, (768, 12, 12, 3072, 16, 224))),
    "vit-huge": dict(zip(VIT_KEYS, (1280, 32, 16, 5120, 14, 224))),
}
# make_dataset's image and label columns, classes, splits (train, test: default images), format, range of image sides
DATASETS = {
    "cifar100": ("img", "fine_label", 100, {"train": 50_000, "test": 10_000}, "PNG", (32, 32)),
    "food101": ("image", "label", 101, {"train": 75_750, "validation": 25_250}, "JPEG", (384, 640)),
}


def _encode_shard(args) -> list[bytes]:
    labels, seed, fmt, size_range = args
    from PIL import Image

    rng = np.random.default_rng(seed)
    palette = np.random.default_rng(0).integers(0, 256, size=(256, 3))
    out = []
    lo, hi = size_range
    for label in labels:
        h, w = (int(s) for s in rng.integers(lo, hi, size=2)) if lo != hi else (lo, lo)
        base = palette[label] + rng.normal(0, 40, size=(h // 8 + 1, w // 8 + 1, 3))  # blotchy texture
        image = Image.fromarray(np.clip(base, 0, 255).astype(np.uint8)).resize((w, h), Image.Resampling.BILINEAR)
        buffer = io.BytesIO()
        image.save(buffer, format=fmt, **({"quality": 90} if fmt == "JPEG" else {}))
        out.append(buffer.getvalue())
    return out


def make_dataset(
    out: Path,
    image_col: str,
    label_col: str,
    classes: int,
    splits: dict[str, int],
    fmt: str,
    size_range: tuple[int, int],
    workers: int,
) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq
    from datasets import ClassLabel, Features, Image

    features = Features({image_col: Image(), label_col: ClassLabel(names=[f"class_{i:03d}" for i in range(classes)])})
    (out / "data").mkdir(parents=True, exist_ok=True)
    for seed, (split, count) in enumerate(splits.items()):
        labels = np.arange(count) % classes
        shards = [(labels[i : i + 2000], seed * 1000 + i, fmt, size_range) for i in range(0, count, 2000)]
        with ProcessPoolExecutor(workers) as pool:
            encoded = tqdm(pool.map(_encode_shard, shards), total=len(shards), desc=f"{out.name} {split}")
            images = [image for shard in encoded for image in shard]
        table = pa.table(
            {image_col: [{"bytes": b, "path": None} for b in images], label_col: labels.tolist()},
            schema=features.arrow_schema,
        )
        pq.write_table(table, out / "data" / f"{split}-00000-of-00001.parquet", row_group_size=1000)
    return out


FAMILIES = ["convnext-tiny", "swin-tiny", "dinov2-small", "dinov2-base"]
IMAGENET_MEAN, IMAGENET_STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]


def family_config(name: str):
    """(config, image processor) of a FAMILIES stand-in: the Hub checkpoint's shape, 224 px."""
    import transformers as tf

    norm = {"image_mean": IMAGENET_MEAN, "image_std": IMAGENET_STD}
    if name == "convnext-tiny":
        config = tf.ConvNextConfig(depths=[3, 3, 9, 3], hidden_sizes=[96, 192, 384, 768], image_size=224)
        return config, tf.ConvNextImageProcessor(size={"shortest_edge": 224}, crop_pct=0.875, **norm)
    if name == "swin-tiny":
        config = tf.SwinConfig(image_size=224, patch_size=4, embed_dim=96, depths=[2, 2, 6, 2],
                               num_heads=[3, 6, 12, 24], window_size=7)  # fmt: skip
        return config, tf.ViTImageProcessor(size={"height": 224, "width": 224}, **norm)
    width, heads = {"dinov2-small": (384, 6), "dinov2-base": (768, 12)}[name]
    config = tf.Dinov2Config(hidden_size=width, num_attention_heads=heads, num_hidden_layers=12, mlp_ratio=4,
                             patch_size=14, image_size=518)  # fmt: skip
    crop = {"height": 224, "width": 224}
    return config, tf.BitImageProcessor(size={"shortest_edge": 224}, crop_size=crop, do_center_crop=True, **norm)


def make_checkpoint(out: Path, name: str) -> Path:
    import torch
    from transformers import AutoModelForImageClassification, ViTConfig, ViTImageProcessor

    torch.manual_seed(0)
    if name in FAMILIES:
        config, processor = family_config(name)
    else:
        config, processor = ViTConfig(**CHECKPOINTS[name]), ViTImageProcessor()
    config.num_labels = 2
    AutoModelForImageClassification.from_config(config).save_pretrained(out)
    processor.save_pretrained(out)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("assets", nargs="+", choices=[*DATASETS, *CHECKPOINTS, *FAMILIES])
    parser.add_argument("--out", default="bench_assets")
    parser.add_argument("--train", type=int, default=None, help="train images (default 50,000 / 75,750)")
    parser.add_argument("--test", type=int, default=None, help="test/validation images (default 10,000 / 25,250)")
    parser.add_argument("--workers", type=int, default=8)
    args = parser.parse_args()
    root = Path(args.out)
    for asset in args.assets:
        target = root / asset
        if target.exists():
            print(f"{target} exists, kept")
            continue
        if asset in DATASETS:
            image, label, classes, splits, fmt, sides = DATASETS[asset]
            (train, default_train), (test, default_test) = splits.items()
            splits = {train: args.train or default_train, test: args.test or default_test}
            make_dataset(target, image, label, classes, splits, fmt, sides, args.workers)
        else:
            make_checkpoint(target, asset)
        print(f"wrote {target}")


if __name__ == "__main__":
    main()

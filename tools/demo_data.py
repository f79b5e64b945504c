"""Build the offline demo dataset: scikit-learn's bundled digits (1,797 real 8x8 scans, 10 classes).

Written as Hub-shaped parquet (data/{train,validation,test}-00000-of-00001.parquet with Image and ClassLabel
features), so the demo goes through exactly the loading path a Hub or local dataset does.

    python tools/demo_data.py data/digits
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
from datasets import ClassLabel, Dataset, Features, Image
from PIL import Image as PILImage


def stratified_split(labels: np.ndarray, fractions: tuple[float, ...], seed: int) -> list[np.ndarray]:
    """Indices for each fraction, with every class spread in proportion."""
    rng = np.random.default_rng(seed)
    parts: list[list[int]] = [[] for _ in fractions]
    for label in np.unique(labels):
        members = rng.permutation(np.flatnonzero(labels == label))
        bounds = np.round(np.cumsum(fractions)[:-1] * len(members)).astype(int)
        for part, chunk in zip(parts, np.split(members, bounds)):
            part.extend(chunk.tolist())
    return [np.sort(np.asarray(p)) for p in parts]


def build_digits(out_dir: str | Path, seed: int = 0) -> Path:
    from sklearn.datasets import load_digits

    digits = load_digits()
    pixels = np.round(digits.images * (255.0 / 16.0)).astype(np.uint8)  # 0..16 grey levels -> 0..255
    features = Features({"image": Image(), "label": ClassLabel(names=[str(i) for i in range(10)])})
    out = Path(out_dir) / "data"
    out.mkdir(parents=True, exist_ok=True)
    names = ("train", "validation", "test")
    for name, index in zip(names, stratified_split(digits.target, (0.7, 0.15, 0.15), seed)):
        split = Dataset.from_dict(
            {"image": [PILImage.fromarray(pixels[i]) for i in index], "label": digits.target[index]},
            features=features,
        )
        split.to_parquet(str(out / f"{name}-00000-of-00001.parquet"))
    return Path(out_dir)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", nargs="?", default="data/digits")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(f"digits dataset written to {build_digits(args.out_dir, args.seed)}")


if __name__ == "__main__":
    main()

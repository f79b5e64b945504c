"""Cold decode of a dataset's splits by process count (`--preprocessing_num_workers`), in a process that has imported
what a run imports and made its CUDA context, as a run's decode runs. Each split is decoded on its own, under a new
fingerprint each time, so nothing comes from the datasets cache.

    python benchmarks/decode_probe.py bench_assets/cifar100 224 1,2,4,8,16 decode.json

Prints one JSON line per split and process count; writes them all to the last argument.
"""

import argparse
import json
import sys
import time
from pathlib import Path

import datasets
import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parents[1] / "src")]
import run_image_classification  # noqa: E402, F401  what a run imports, forked with each pool
from vit_recipes.data import decode_datasets, load_any, storage_format  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dataset", help="a dataset folder (make_assets.py's cifar100 or food101)")
    parser.add_argument("image_size", type=int, help="the model's input size (storage: native, or 256 for 224)")
    parser.add_argument("procs", help="comma-separated process counts, in order (1 = no pool)")
    parser.add_argument("out", help="JSON file for the rows")
    args = parser.parse_args()
    torch.zeros(1, device="cuda" if torch.cuda.is_available() else "cpu")
    loaded = load_any(args.dataset)
    features = next(iter(loaded.values())).features
    column = next(c for c, f in features.items() if isinstance(f, datasets.Image) or c in ("img", "image"))
    loaded = loaded.cast_column(column, datasets.Image(decode=False))
    storage = storage_format(next(iter(loaded.values())), column, args.image_size, None)
    rows = []
    for trial, procs in enumerate(int(p) for p in args.procs.split(",")):
        for name, split in loaded.items():
            split._fingerprint = f"probe-{trial}-{name}-{time.time_ns()}"  # a cache miss, every time
            start = time.perf_counter()
            decode_datasets({name: split}, column, storage, procs, [])
            seconds = time.perf_counter() - start
            rows.append({"data": args.dataset, "split": name, "images": len(split), "num_proc": procs,
                         "s": round(seconds, 3), "img_per_s": round(len(split) / seconds)})  # fmt: skip
            print(json.dumps(rows[-1]), flush=True)
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()

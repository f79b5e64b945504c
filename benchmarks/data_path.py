#!/usr/bin/env python
"""Question: on a folder of JPEG photos, how does our whole job compare with transformers' example, and what does
each of our two decoding paths cost in time to the first step, steady images/s and disk?

One call, one GPU. A folder shaped like ImageNet (tools/jpeg_folder.py: 400-520 x 300-420 px JPEGs, 100 classes,
train/ and validation/) at each --sizes; on each, 200 steps x 128 and the evaluation of the validation split:
- peer: transformers' example (benchmarks/peer.py) with --train_dir/--validation_dir and 16 DataLoader workers;
- ours: `--config recipes/vit-base/food101/config_full.yaml --dataset_name FOLDER --max_steps 200` as typed (auto:
  per-batch decoding for photos);
- ours-once (largest size only): the same with `--decode_images once` (the decoded copy), the steady img/s the
  per-batch path must reach.
Every job gets a fresh datasets cache (HF_DATASETS_CACHE): what it leaves there is the disk it wrote.

    python benchmarks/make_assets.py --out bench_assets vit-base
    python benchmarks/data_path.py --assets bench_assets --work /tmp/data_path --sizes 60000,20000 \
        --out benchmarks/results/<date>_data_path_1x<card>

Writes OUT/data_path.json and OUT/data_path.md; runs, logs and folders stay in --work.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
from jpeg_folder import write_folder  # noqa: E402

RECIPE = "recipes/vit-base/food101/config_full.yaml"
STEPS, BATCH = 200, 128
PEER = ["--do_train", "true", "--do_eval", "true", "--bf16", "true", "--learning_rate", "1e-4",
        "--lr_scheduler_type", "cosine", "--logging_steps", "50", "--remove_unused_columns", "false",
        "--ignore_mismatched_sizes", "true", "--report_to", "none", "--seed", "42", "--disable_tqdm", "true",
        "--max_steps", str(STEPS), "--per_device_train_batch_size", str(BATCH), "--per_device_eval_batch_size", "256",
        "--eval_strategy", "no", "--save_strategy", "no", "--dataloader_num_workers", "16"]  # fmt: skip
KEEP = ("time_", "train_images_per_second", "train_first_step_after_start_s", "train_step_time_s", "eval_accuracy",
        "train_data_wait_share", "data_decode_seconds")  # fmt: skip


def folder_size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.exists() else 0


def run_job(name: str, argv: list[str], work: Path, timeout: float) -> dict:
    cache, out = work / "caches" / name, work / "runs" / name
    subprocess.run(["rm", "-rf", str(cache), str(out)], check=True)
    env = {**os.environ, "HF_DATASETS_CACHE": str(cache / "datasets"), "HF_HUB_OFFLINE": "1",
           "HF_DATASETS_OFFLINE": "1", "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")]))}  # fmt: skip
    argv = [*argv, "--output_dir", str(out)]
    (work / "logs").mkdir(parents=True, exist_ok=True)
    with open(work / "logs" / f"{name}.log", "w") as log:
        start = time.time()
        try:
            code = subprocess.run(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout)
            exit_code = code.returncode
        except subprocess.TimeoutExpired:
            exit_code = "timeout"
        wall = round(time.time() - start, 2)
    results = out / "all_results.json"
    metrics = json.loads(results.read_text()) if results.is_file() else {}
    row = {"job": name, "exit": exit_code, "wall_s": wall, "cache_bytes": folder_size(cache),
           "command": shlex.join(argv).replace(sys.executable, "python"),
           **{k: v for k, v in metrics.items() if k.startswith(KEEP)}}  # fmt: skip
    print(f"[data_path] {name}: exit {exit_code}, {wall} s, cache {row['cache_bytes'] / 2**20:.0f} MiB", flush=True)
    return row


def make_folders(work: Path, sizes: list[int]) -> dict[int, Path]:
    """The largest size is written; each smaller one is a hard-linked subset of it (no second write)."""
    largest = max(sizes)
    root = work / f"jpegs_{largest}"
    if not (root / "train").is_dir():
        start = time.time()
        written = write_folder(root, largest, 100)
        print(f"[data_path] wrote {largest} JPEGs, {written / 2**30:.2f} GiB, in {time.time() - start:.0f} s")
    folders = {largest: root}
    for size in sorted(set(sizes) - {largest}):
        subset = work / f"jpegs_{size}"
        if not subset.is_dir():
            files = sorted(root.rglob("*.jpg"))
            keep = {f for f in files if int(f.stem) < size}
            for f in keep:
                target = subset / f.relative_to(root)
                target.parent.mkdir(parents=True, exist_ok=True)
                os.link(f, target)
        folders[size] = subset
    return folders


def table(rows: list[dict]) -> str:
    lines = ["| images | job | exit | wall clock s | x peer | first step s | steady img/s | datasets cache |",
             "|---:|---|---|---:|---:|---:|---:|---:|"]  # fmt: skip
    peers = {r["images"]: r["wall_s"] for r in rows if r["job"].startswith("peer")}
    for r in rows:
        ratio = f"{r['wall_s'] / peers[r['images']]:.2f}" if r["images"] in peers else "-"
        first = r.get("train_first_step_after_start_s")
        speed = r.get("train_images_per_second")
        lines.append(
            f"| {r['images']:,} | {r['job'].split('-', 1)[1]} | {r['exit']} | {r['wall_s']:.1f} | {ratio} | "
            f"{first if first is not None else '-'} | {f'{speed:,.0f}' if speed else '-'} | "
            f"{r['cache_bytes'] / 2**20:,.1f} MiB |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--assets", type=Path, required=True, help="make_assets.py's folder (vit-base)")
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--sizes", default="60000,20000")
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--jobs", default="peer,ours,ours-once", help="which jobs, in this order")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    folders = make_folders(args.work, sizes)
    model = ["--model_name_or_path", str(args.assets / "vit-base")]
    rows = []
    for size in sizes:  # the order given: the most important size first, in case the call is cut short
        folder = folders[size]
        jobs = {
            "peer": [sys.executable, "benchmarks/peer.py", *model, "--train_dir", str(folder / "train"),
                     "--validation_dir", str(folder / "validation"), *PEER],
            "ours": [sys.executable, "run_image_classification.py", "--config", RECIPE, *model, "--dataset_name",
                     str(folder), "--max_steps", str(STEPS), "--report_to", "none"],
        }  # fmt: skip
        if size == max(sizes):
            jobs["ours-once"] = [*jobs["ours"], "--decode_images", "once"]
        for job in args.jobs.split(","):
            if job in jobs:
                rows.append({"images": size, **run_job(f"{size}-{job}", jobs[job], args.work, args.timeout)})
                args.out.mkdir(parents=True, exist_ok=True)
                record = {"question": __doc__.split("\n\n")[0], "steps": STEPS, "batch": BATCH, "runs": rows,
                          "source_bytes": {s: sum(f.stat().st_size for f in folders[s].rglob('*.jpg')) for s in sizes}}  # fmt: skip
                (args.out / "data_path.json").write_text(json.dumps(record, indent=2))
                (args.out / "data_path.md").write_text(table(rows) + "\n")
    print(table(rows))


if __name__ == "__main__":
    main()

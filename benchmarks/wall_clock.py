"""Probe. Question: how long does a whole job take, from pressing Enter to a saved model, ours as typed against the
peer (transformers' example script, benchmarks/peer.py), in one call on one GPU?

Two jobs, each run by the peer (8 and 16 DataLoader workers) and by our script as typed, twice: cold (fresh compile
and datasets caches: a new machine) and warm (the same command again, into a new output folder):

- epoch: the ViT-B CIFAR-100 recipe's first epoch, `--config recipes/vit-base/cifar100/config_full.yaml
  --num_train_epochs 1` (45,000 training images at batch 128, the 5,000-image validation split evaluated at the epoch's
  end and after training, the 10,000 test images once, the model saved). The peer trains on the same 90% split
  (`--train_val_split 0.1`) at the same batch and evaluates the validation split as its script does.
- steps200: 200 steps at batch 256, then 2,000 evaluation images (ours: validation and test, 2,000 each).
- photos200: a folder of JPEG photos shaped like ImageNet (tools/jpeg_folder.py: 400-520 x 300-420 px, 100 classes,
  train/ and validation/; --photos images, written into --work when missing), 200 steps x 128 and the validation
  split evaluated. Ours: `--config recipes/vit-base/food101/config_full.yaml --dataset_name FOLDER --max_steps 200`
  (auto: per-batch decoding for photos); `ours-once` adds `--decode_images once` (the decoded copy: the steady img/s
  the per-batch path must reach, and its disk). The peer reads the folder by --train_dir/--validation_dir.
- photos-epoch: the same folder, one whole epoch (`--num_train_epochs 1`), the validation split evaluated at its end.
- stream8, stream1, stream1-rg100: the photos200 job with `--streaming` on the same folder written again as parquet
  files of image bytes, as Hub datasets come (tools/jpeg_folder.py --parquet): train in 8 files of one row group
  each, in 1 file of one row group (at most 1.8 GiB of images: pyarrow reads no larger row group, so ~40,000 of
  60,000 photos), and in 1 file of 100-row groups. Their steady img/s and data wait against the
  folder's (photos200-ours, same call): a stream must not decode slower because it has few files.

`ours-compiled` runs (`--torch_compile_regions true`, cold then warm) measure what regional compilation costs once
and saves per step: the data behind the default's "compile only where it pays" rule. `ours-after-compiled` is the
command as typed, run after a compiled run of the same model and batch (their caches): what the rule decides where
the compile cache holds the artifacts (it compiles from 400 planned steps there; these jobs are shorter).

Each job's wall clock is measured here (process start to exit); its phases come from all_results.json (ours: the
timeline every run records; the peer: start-up to the first step, train, evaluate, save), and the steady img/s and
process start to the first step's end from the speed meter both share. The bytes each run's datasets cache holds
after it are the disk it wrote there (a warm run's cache is its cold run's).

    python -m benchmarks.wall_clock --bytecode      # makes its assets; record: results/<date>_wall_clock_1x<card>
    python -m benchmarks.wall_clock --redraw --out RECORD   # the markdown and chart again from wall_clock.json
    python -m benchmarks.wall_clock --only photos200-peer-w16-cold,photos200-ours-cold,photos200-ours-once-cold \
        --photos 60000 --budget 600 --timeout 600   # the photos job alone (the folder: minutes to write, once)

Writes OUT/wall_clock.json, OUT/wall_clock.md, OUT/wall_clock.png and the record's README.md (its conclusion to
write); runs and logs stay in --work.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file: the repository root
from benchmarks import common  # noqa: E402
from benchmarks.common import ROOT, device_description, git_commit, gpu_info, library_versions  # noqa: E402

QUESTION = __doc__.split("\n\n")[0].removeprefix("Probe. Question: ").replace("\n", " ")

RECIPE = "recipes/vit-base/cifar100/config_full.yaml"
PHOTOS_RECIPE = "recipes/vit-base/food101/config_full.yaml"  # the recipe for a folder of photos
JOBS = {  # job -> (our arguments after the recipe, the peer's arguments for the same work)
    "epoch": (
        ["--num_train_epochs", "1"],
        ["--num_train_epochs", "1", "--per_device_train_batch_size", "128", "--per_device_eval_batch_size", "256",
         "--eval_strategy", "epoch", "--save_strategy", "epoch", "--do_eval", "true", "--train_val_split", "0.1"],
    ),
    "steps200": (
        ["--max_steps", "200", "--per_device_train_batch_size", "256", "--max_eval_samples", "2000",
         "--eval_strategy", "no", "--save_strategy", "no"],
        ["--max_steps", "200", "--per_device_train_batch_size", "256", "--per_device_eval_batch_size", "256",
         "--eval_strategy", "no", "--save_strategy", "no", "--do_eval", "true", "--max_eval_samples", "2000",
         "--train_val_split", "0.1"],
    ),
    "photos200": (
        ["--max_steps", "200"],
        ["--max_steps", "200", "--per_device_train_batch_size", "128", "--per_device_eval_batch_size", "256",
         "--eval_strategy", "no", "--save_strategy", "no", "--do_eval", "true"],
    ),
    "photos-epoch": (
        ["--num_train_epochs", "1"],
        ["--num_train_epochs", "1", "--per_device_train_batch_size", "128", "--per_device_eval_batch_size", "256",
         "--eval_strategy", "no", "--save_strategy", "no", "--do_eval", "true"],
    ),
}  # fmt: skip
STREAMS = {"stream8": (8, None), "stream1": (1, None), "stream1-rg100": (1, 100)}  # train files, rows per row group
for _job in STREAMS:  # the photos200 job streamed (a stream's epoch length is unknown: no epoch-based strategies)
    JOBS[_job] = (["--max_steps", "200", "--streaming", "true", "--eval_strategy", "no", "--save_strategy", "no"], [])
PHOTO_JOBS = ("photos200", "photos-epoch", *STREAMS)  # on the JPEG photos (or their parquet), with PHOTOS_RECIPE
PEER_COMMON = ["--do_train", "true", "--bf16", "true", "--learning_rate", "1e-4", "--lr_scheduler_type", "cosine",
               "--logging_steps", "50", "--seed", "42", "--disable_tqdm", "true"]  # fmt: skip
# The order runs go in: what the README's table needs first, so a budget cut leaves the least important out.
PLAN = [
    ("epoch", "peer", 16, "cold"), ("epoch", "ours", None, "cold"), ("epoch", "ours", None, "warm"),
    ("steps200", "peer", 16, "cold"), ("steps200", "ours", None, "cold"), ("steps200", "ours", None, "warm"),
    ("steps200", "ours-compiled", None, "cold"), ("steps200", "ours-compiled", None, "warm"),
    ("steps200", "ours", None, "after-compiled"), ("epoch", "ours-compiled", None, "cold"),
    ("epoch", "ours", None, "after-compiled"),
    ("steps200", "peer", 8, "cold"), ("epoch", "peer", 8, "cold"),
    ("photos200", "peer", 16, "cold"), ("photos200", "ours", None, "cold"), ("photos200", "ours-once", None, "cold"),
    ("photos-epoch", "peer", 16, "cold"), ("photos-epoch", "ours", None, "cold"),
    *[(job, "ours", None, "cold") for job in STREAMS],
]  # fmt: skip


@dataclass
class Run:
    job: str
    who: str  # peer, ours, ours-compiled, ours-once
    workers: int | None  # the peer's DataLoader workers (ours: the recipe's default)
    cache: str  # cold: fresh compile and datasets caches; warm: those of the cold run before it; after-compiled:
    # those of the job's ours-compiled runs (the command as typed, after a compiled run of the same model and batch)
    command: str = ""
    exit: int | str | None = None
    wall_s: float | None = None
    metrics: dict = field(default_factory=dict)
    cache_bytes: int | None = None  # what the run's datasets cache holds after it

    @property
    def on_photos(self) -> bool:
        return self.job in PHOTO_JOBS

    @property
    def name(self) -> str:
        return f"{self.job}-{self.who}" + (f"-w{self.workers}" if self.workers else "") + f"-{self.cache}"


def argv_of(run: Run, assets: Path, out: Path, photos: Path | None = None) -> list[str]:
    ours, peer = JOBS[run.job]
    dataset = str(photos) if run.on_photos else str(assets / "cifar100")
    if run.job in STREAMS:
        dataset = str(stream_folder(photos, run.job))
    data = ["--model_name_or_path", str(assets / "vit-base"), "--dataset_name", dataset]
    if run.who == "peer":  # the job's arguments (and --extra) last: they win
        peer_args = common.peer_args(str(assets / "vit-base"), dataset, str(out), run.workers)
        if run.on_photos:  # the example reads a folder of photos as two folders, not --dataset_name
            at = peer_args.index("--dataset_name")
            peer_args[at : at + 2] = ["--train_dir", f"{dataset}/train", "--validation_dir", f"{dataset}/validation"]
        return [sys.executable, *peer_args, *PEER_COMMON, *peer]
    extra = {"ours-compiled": ["--torch_compile_regions", "true"], "ours-once": ["--decode_images", "once"]}
    recipe = PHOTOS_RECIPE if run.on_photos else RECIPE
    return [sys.executable, "run_image_classification.py", "--config", recipe, *data, "--output_dir", str(out),
            "--report_to", "none", *ours, *extra.get(run.who, [])]  # fmt: skip


def folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.exists() else 0


def photos_folder(work: Path, images: int) -> Path:
    """WORK/jpegs_<images>: tools/jpeg_folder.py's folder of JPEG photos, 100 classes, written when missing."""
    from tools.jpeg_folder import write_folder

    folder = work / f"jpegs_{images}"
    if not (folder / "train").is_dir():
        start = time.time()
        written = write_folder(folder, images, 100)
        print(f"[wall_clock] wrote {images} JPEGs, {written / 2**30:.2f} GiB, in {time.time() - start:.0f} s")
    return folder


def stream_folder(photos: Path, job: str) -> Path:
    return photos.with_name(f"{photos.name}_{job}")


def stream_folders(photos: Path, jobs: set[str]) -> None:
    """The photos folder as each stream job's parquet files (tools/jpeg_folder.py --parquet), written when missing."""
    from tools.jpeg_folder import write_parquet

    for job in sorted(jobs):
        if not (folder := stream_folder(photos, job)).is_dir():
            start = time.time()
            written = write_parquet(photos, folder, *STREAMS[job])
            print(f"[wall_clock] wrote {folder.name}, {written / 2**30:.2f} GiB, in {time.time() - start:.0f} s")


def execute(run: Run, assets: Path, work: Path, timeout: float, photos: Path | None = None) -> None:
    # A cold run and its warm rerun share caches: one folder per job and script
    who = "ours-compiled" if run.cache == "after-compiled" else run.who
    caches = work / "caches" / f"{run.job}-{who}-{run.workers or 0}"
    if run.cache == "cold":
        shutil.rmtree(caches, ignore_errors=True)
    out = work / "runs" / run.name
    shutil.rmtree(out, ignore_errors=True)
    env = common.run_env(HF_DATASETS_CACHE=str(caches / "datasets"), TORCHINDUCTOR_CACHE_DIR=str(caches / "inductor"))
    argv = argv_of(run, assets, out, photos)
    run.command = shlex.join(argv).replace(sys.executable, "python").replace(str(assets), "$ASSETS")
    (work / "logs").mkdir(parents=True, exist_ok=True)
    with open(work / "logs" / f"{run.name}.log", "w") as log:
        start = time.time()
        try:
            run.exit = subprocess.run(
                argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout
            ).returncode
        except subprocess.TimeoutExpired:
            run.exit = "timeout"
        run.wall_s = round(time.time() - start, 2)
    run.cache_bytes = folder_bytes(caches / "datasets")
    results = out / "all_results.json"
    if results.is_file():
        keep = ("time_", "train_images_per_second", "train_first_step_after_start_s", "train_warmup_s",
                "train_step_time_s", "eval_accuracy", "train_peak_allocated_gib", "train_data_wait_fraction",
                "data_decode_seconds")  # fmt: skip
        run.metrics = {k: v for k, v in json.loads(results.read_text()).items() if k.startswith(keep)}
    print(f"[wall_clock] {run.name}: exit {run.exit}, {run.wall_s} s, cache {run.cache_bytes >> 20} MiB", flush=True)


def byte_compile(work: Path) -> str:
    """Compile every library's .py to .pyc once (compileall, as pip does at install), in place where the folder is
    writable, else under WORK/pycache (PYTHONPYCACHEPREFIX, inherited by the runs); say what it did."""
    import site
    import sysconfig

    folders = [site.getsitepackages()[0], sysconfig.get_paths()["stdlib"]]
    folders += [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and Path(p).is_dir()]
    folders = list(dict.fromkeys(str(Path(f).resolve()) for f in folders))
    if not all(os.access(f, os.W_OK) for f in folders):
        os.environ["PYTHONPYCACHEPREFIX"] = str(work / "pycache")
    start = time.time()
    subprocess.run([sys.executable, "-m", "compileall", "-q", "-j", "0", *folders], check=False)
    where = os.environ.get("PYTHONPYCACHEPREFIX", "in place")
    said = f"compileall of {', '.join(folders)} ({where}): {time.time() - start:.0f} s, before the runs"
    print(f"[wall_clock] {said}", flush=True)
    return said


# --------------------------------------------------------------------------------------------------- record
def speed_of_folder(run: dict, runs: list[dict]) -> str:
    """A stream job's steady img/s over the folder's (photos200-ours, same call)."""
    folder = next((r for r in runs if r["job"] == "photos200" and r["who"] == "ours" and r["exit"] == 0), None)
    mine, theirs = (r and r["metrics"].get("train_images_per_second") for r in (run, folder))
    return f"{mine / theirs:.0%}" if run["job"] in STREAMS and mine and theirs else ""


def ratio(run: dict, runs: list[dict]) -> str:
    peer = next((r for r in runs if r["job"] == run["job"] and r["who"] == "peer" and r["workers"] == 16), None)
    if not (peer and peer["wall_s"] and run["wall_s"] and peer["exit"] == 0 and run["exit"] == 0):
        return ""
    return f"{run['wall_s'] / peer['wall_s']:.2f}x"


PHASES = ("startup", "data", "model", "decode", "trainer", "train", "save", "evaluate", "reports")


def write_markdown(record: dict, out: Path) -> None:
    runs = record["runs"]
    lines = [f"# Wall clock of whole jobs: ours against the peer, {record['device']}", "",
             f"`{record['command']}` at {record['commit']}, {record['date']}. Versions: "
             + ", ".join(f"{k} {v}" for k, v in record["versions"].items() if v), "",
             "Wall clock: process start to exit, measured outside the process. x peer: over the 16-worker peer's wall "
             "clock for the same job. Phases (seconds) from each run's all_results.json; first step: process start to "
             "the first optimizer step's end; warm-up: the first 5 steps (compilation lands there); datasets cache: what "
             "the run's datasets cache holds after it (a warm run shares its cold run's); data wait: the share of the steady steps "
             "spent waiting for a batch; x folder: a stream job's steady img/s over the folder's (photos200-ours)."
             + (f" Byte-compiled first: {record['bytecode']}." if record.get("bytecode") else ""), "",
             "![Where each job's wall clock goes](wall_clock.png)", "",
             "| job | run | exit | wall s | x peer (16 workers) | first step s | warm-up s | steady img/s | data wait | "
             "x folder | " + " | ".join(PHASES) + " | imports (in startup) | eval accuracy | datasets cache |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|" + "---:|" * len(PHASES) + "---:|---:|---:|"]  # fmt: skip
    for run in runs:
        m = run["metrics"]
        cells = [run["job"], f"`{run['name']}`", str(run["exit"]), f"{run['wall_s']:.1f}" if run["wall_s"] else "",
                 ratio(run, runs), str(m.get("train_first_step_after_start_s", "")), str(m.get("train_warmup_s", "")),
                 f"{m['train_images_per_second']:,.0f}" if "train_images_per_second" in m else "",
                 f"{m['train_data_wait_fraction']:.1%}" if "train_data_wait_fraction" in m else "",
                 speed_of_folder(run, runs),
                 *[str(m.get(f"time_{p}_s", "")) for p in PHASES], str(m.get("time_imports_s", "")), str(round(m["eval_accuracy"], 4)) if "eval_accuracy" in m else "",
                 f"{run['cache_bytes'] / 2**20:,.1f} MiB" if run.get("cache_bytes") is not None else ""]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "<details><summary>Commands</summary>", ""]
    lines += [f"- `{run['name']}`: `{run['command']}`" for run in runs] + ["", "</details>", ""]
    (out / "wall_clock.md").write_text("\n".join(lines))


def draw(record: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [r for r in record["runs"] if r["wall_s"]]
    fig, ax = plt.subplots(figsize=(10, 0.45 * len(runs) + 1.6))
    colours = plt.get_cmap("tab10")
    for y, run in enumerate(runs):
        m, left = run["metrics"], 0.0
        phases = [(p, m.get(f"time_{p}_s", 0.0)) for p in PHASES if m.get(f"time_{p}_s")]
        for phase, seconds in phases:
            labelled = ax.get_legend_handles_labels()[1]
            ax.barh(
                y, seconds, left=left, color=colours(PHASES.index(phase)), label=None if phase in labelled else phase
            )
            left += seconds
        ax.barh(y, run["wall_s"] - left, left=left, color="lightgrey",
                label="outside the phases" if "outside the phases" not in ax.get_legend_handles_labels()[1] else None)  # fmt: skip
        ax.text(run["wall_s"] + 0.5, y, f"{run['wall_s']:.0f} s {ratio(run, record['runs'])}", va="center", fontsize=8)
    ax.set_yticks(range(len(runs)), [r["name"] for r in runs], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("wall clock, process start to exit (s)")
    ax.set_xlim(0, max(r["wall_s"] for r in runs) * 1.18)
    ax.set_title(f"Where a whole job's time goes: ours and the peer, {record['device']}")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8, title="phase")
    fig.tight_layout()
    common.save_png(fig, out / "wall_clock.png")
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--assets", default="bench_assets", help="make_assets.py's folder (cifar100, vit-base: made "
                        "when missing)")  # fmt: skip
    parser.add_argument("--out", default=None, help="record folder (default results/<date>_wall_clock_1x<card>)")
    parser.add_argument("--work", default="/tmp/wall_clock", help="runs, caches and logs (not kept in git)")
    parser.add_argument("--only", default="", help="comma-separated run names (default: all, in PLAN's order)")
    parser.add_argument("--budget", type=float, default=540, help="seconds: then no run starts")
    parser.add_argument("--timeout", type=float, default=200, help="seconds a run may take")
    parser.add_argument("--redraw", action="store_true", help="markdown and chart again from OUT/wall_clock.json")
    parser.add_argument("--extra", default="", help="arguments added to every run (tests: --use_cpu true ...)")
    parser.add_argument("--photos", type=int, default=60000, help="images in the photos job's folder")
    parser.add_argument("--bytecode", action="store_true", help="byte-compile the Python libraries first, as pip does "
                        "at install: an image without .pyc files (PYTHONDONTWRITEBYTECODE set) recompiles torch's "
                        "modules in every process, for the peer and ours alike")  # fmt: skip
    args = parser.parse_args(argv)
    if args.redraw and not args.out:
        parser.error("--redraw needs --out")
    if unknown := [name for name in filter(None, args.only.split(",")) if name not in {Run(*e).name for e in PLAN}]:
        parser.error(f"--only: no run named {', '.join(unknown)}; the runs: {', '.join(Run(*e).name for e in PLAN)}")
    out = Path(args.out or common.record_folder("wall_clock", 1, device_description(gpu_info())))
    if args.redraw:
        record = json.loads((out / "wall_clock.json").read_text())
    else:
        subprocess.run([sys.executable, str(ROOT / "benchmarks/make_assets.py"), "--out", args.assets, "cifar100",
                        "vit-base", "--workers", "16"], check=True)  # fmt: skip
        assets, work = Path(args.assets).resolve(), Path(args.work)
        runs = [Run(*entry) for entry in PLAN]
        if args.only:
            runs = [r for r in runs if r.name in args.only.split(",")]
        if args.extra:
            for job, (ours, peer) in list(JOBS.items()):
                JOBS[job] = (ours + shlex.split(args.extra), peer + shlex.split(args.extra))
        photos = photos_folder(work, args.photos) if any(r.on_photos for r in runs) else None
        if streams := {r.job for r in runs if r.job in STREAMS}:
            stream_folders(photos, streams)
        bytecode = byte_compile(work) if args.bytecode else None
        start = time.time()
        for run in runs:
            if time.time() - start > args.budget:
                run.exit = f"not run: the {args.budget:.0f} s budget ran out"
                continue
            execute(run, assets, work, args.timeout, photos)
        gpus = gpu_info()
        record = {"device": device_description(gpus) if gpus else "CPU", "commit": git_commit(),
                  "date": time.strftime("%Y-%m-%d"), "versions": library_versions(),
                  "command": "python -m benchmarks.wall_clock " + shlex.join(argv if argv is not None else sys.argv[1:]),
                  "bytecode": bytecode, "photos": {"images": args.photos, "bytes": folder_bytes(photos)} if photos else None,
                  "runs": [{**asdict(r), "name": r.name} for r in runs]}  # fmt: skip
        common.write_json(out / "wall_clock.json", record)
    write_markdown(record, out)
    draw(record, out)
    common.start_readme(out, "wall_clock", QUESTION, record["command"], "Every job, its phases and command: "
                        "[wall_clock.md](wall_clock.md); chart: [wall_clock.png](wall_clock.png).", record["device"])  # fmt: skip
    failed = [r["name"] for r in record["runs"] if r["exit"] not in (0, None) and not str(r["exit"]).startswith("not")]
    print(f"[wall_clock] {len(record['runs'])} runs, {len(failed)} failed {failed}; record: {out / 'wall_clock.md'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

"""Offline transfer check for LoRA: pretrain a small ViT on one real dataset, fine-tune it on another.

No pretrained ViT can be downloaded here, so we make one: a ViT trained from scratch on Fashion-MNIST (70,000 real
28x28 grey photos of clothes, 10 classes) and saved with save_pretrained, exactly like a Hub checkpoint. It is then
fine-tuned on scikit-learn's digits (1,797 real 8x8 scans, 10 classes; upsampled to the model's 28x28 on the device)
through run_image_classification.py, once per method:

- full: every weight trained;
- lora: --use_peft (adapters on the attention query/value projections, head trained in full);
- head: --freeze_backbone (the head alone on the frozen backbone: the baseline LoRA must clearly beat).

Each record holds test accuracy, trainable parameters, training img/s, peak memory (CUDA peak allocated on a GPU,
the process's peak RSS on a CPU) and the size of what was saved. Target: LoRA within 1 point of full fine-tuning.

    python tools/transfer.py --out outputs/lora_transfer                        # full size, one GPU, ~5 min
    python tools/transfer.py --size small --out outputs/lora_transfer_small     # CPU, a few minutes
    python tools/transfer.py --size small --stage pretrain --work outputs/transfer   # base for digits_lora.yaml

Fashion-MNIST's idx files are read from --fashion_mnist (default /usr/share/datasets/fashion-mnist, where Debian's
dataset-fashion-mnist package puts them).

    python tools/transfer.py --size small --methods full layer_decay drop_path ema random_erasing levers
        # timm's levers on full fine-tuning (CPU): each picks its learning rate as full fine-tuning does

Writes OUT/lora_transfer.json and OUT/lora_transfer.md (OUT/levers_transfer.* for levers).
"""

from __future__ import annotations

import argparse
import gzip
import io
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

FASHION_MNIST = "/usr/share/datasets/fashion-mnist"
FASHION_LABELS = [
    "T-shirt/top",
    "Trouser",
    "Pullover",
    "Dress",
    "Coat",
    "Sandal",
    "Shirt",
    "Sneaker",
    "Bag",
    "Ankle boot",
]
ROOT = Path(__file__).resolve().parents[1]  # tools/ -> the repository root
SCRIPT = ROOT / "run_image_classification.py"
sys.path.insert(0, str(ROOT / "tools"))  # tools/demo_data.py (digits, stratified splits), beside this script
METHODS = ("full", "lora", "lora_all", "head")
METHOD_FLAGS = {
    "full": [],
    "lora": ["--use_peft", "true"],  # the defaults: rank 16 on the attention query/value projections
    "lora_all": ["--use_peft", "true", "--lora_target_modules", "all-linear"],
    "head": ["--freeze_backbone", "true"],
}
METHOD_NAMES = {
    "full": "Full fine-tuning",
    "lora": "LoRA (query, value)",
    "lora_all": "LoRA (all linear layers)",
    "head": "Head only (frozen backbone)",
}
# timm's fine-tuning levers, each on full fine-tuning (`--methods full layer_decay ...`); "levers" turns on all four.
# They share full fine-tuning's learning rates unless the size names their own.
LEVERS = ("layer_decay", "drop_path", "ema", "random_erasing", "levers")
LEVER_FLAGS = {
    "layer_decay": ["--layer_decay", "0.75"],
    "drop_path": ["--drop_path_rate", "0.1"],
    "ema": ["--ema_decay", "0.99"],
    "random_erasing": ["--random_erasing", "0.25"],
}
METHOD_FLAGS.update(LEVER_FLAGS, levers=[flag for flags in LEVER_FLAGS.values() for flag in flags])
METHOD_NAMES.update({m: f"Full + {' '.join(f)}" for m, f in METHOD_FLAGS.items() if m in LEVERS[:-1]})
METHOD_NAMES["levers"] = "Full + all four levers"


@dataclass
class Size:
    """How big each stage is; `small` fits a CPU test, `full` one GPU."""

    fashion_train: int | None  # None: all 55,000 (5,000 of the 60,000 are validation)
    fashion_validation: int
    fashion_test: int | None  # None: all 10,000
    model: str  # config_overrides of the pretrained ViT
    pretrain_epochs: float
    pretrain_batch: int
    pretrain_lr: float
    finetune_epochs: float
    finetune_batch: int
    learning_rates: dict[str, float | list[float]]  # per method; a list: chosen on validation (first seed)
    seeds: list[int]
    eval_every: int | None = None  # pretraining: eval steps (None: no evaluation during training)
    extra: list[str] = field(default_factory=list)  # flags for every run


# 16x16 input in 4x4 patches (16 tokens), 0.14M parameters: fast on a CPU. Digits' 8x8 scans are upsampled to 16 and
# Fashion-MNIST's 28x28 photos downsampled, on the device.
TINY_VIT = (
    "image_size=16,patch_size=4,hidden_size=64,num_hidden_layers=4,num_attention_heads=4,intermediate_size=128,"
    "hidden_dropout_prob=0.0,attention_probs_dropout_prob=0.0"
)
CPU = ["--use_cpu", "true", "--dataloader_num_workers", "0"]

SIZES = {
    # One GPU, a few minutes: a 28x28 ViT in 4x4 patches (49 tokens), 2.7M parameters; three seeds per method.
    "full": Size(
        fashion_train=None,
        fashion_validation=5000,
        fashion_test=None,
        model="image_size=28,patch_size=4,hidden_size=192,num_hidden_layers=6,num_attention_heads=3,"
        "intermediate_size=768,hidden_dropout_prob=0.0,attention_probs_dropout_prob=0.0",
        pretrain_epochs=15,
        pretrain_batch=256,
        pretrain_lr=1e-3,
        finetune_epochs=20,
        finetune_batch=64,
        learning_rates={
            "full": [5e-4, 1e-3, 2e-3],
            "lora": [5e-3, 1e-2, 2e-2],
            "lora_all": [5e-3, 1e-2],
            "head": [1e-2, 3e-2],
        },
        seeds=[0, 1, 2],
        extra=["--bf16", "true"],
    ),
    # CPU, a few minutes: the numbers in docs/lora.md and the base of recipes/quickstart/digits_lora.yaml.
    "small": Size(
        fashion_train=10000,
        fashion_validation=1000,
        fashion_test=2000,
        model=TINY_VIT,
        pretrain_epochs=10,
        pretrain_batch=128,
        pretrain_lr=3e-3,
        finetune_epochs=20,
        finetune_batch=64,
        learning_rates={"full": [1e-3, 2e-3], "lora": [1e-2, 2e-2], "lora_all": [1e-2], "head": [1e-2, 3e-2]},
        seeds=[0, 1, 2],
        extra=CPU,
    ),
    # tests/test_lora.py: ~30 s on 2 idle CPU cores (measured: Fashion-MNIST 64.8%; digits: full 72.1%, LoRA 73.6%,
    # head only 41.3%: weak, as it is short, but the frozen backbone is 30 points behind).
    "test": Size(
        fashion_train=3000,
        fashion_validation=200,
        fashion_test=500,
        model=TINY_VIT,
        pretrain_epochs=6,
        pretrain_batch=128,
        pretrain_lr=3e-3,
        finetune_epochs=12,
        finetune_batch=128,
        learning_rates={"full": 2e-3, "lora": 2e-2, "lora_all": 1e-2, "head": 3e-2},
        seeds=[0],
        extra=[*CPU, "--disable_tqdm", "true"],
    ),
}


# ------------------------------------------------------------------------------------------------ data


class MissingData(FileNotFoundError):
    """The real data a check needs is not on this machine (one line, no traceback, from main)."""


def _read_idx(path: Path) -> np.ndarray:
    with gzip.open(path, "rb") as f:
        data = f.read()
    magic = int.from_bytes(data[:4], "big")
    dims = [int.from_bytes(data[4 + 4 * i : 8 + 4 * i], "big") for i in range(magic & 0xFF)]
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * len(dims)).reshape(dims)


def build_fashion_mnist(
    source: str | os.PathLike,
    out_dir: str | os.PathLike,
    train: int | None = None,
    validation: int = 5000,
    test: int | None = None,
    seed: int = 0,
) -> Path:
    """Fashion-MNIST idx files -> Hub-shaped parquet (data/{train,validation,test}-00000-of-00001.parquet).

    Validation is a stratified, seeded slice of the official train split; `train`/`test` truncate (stratified too).
    """
    import pyarrow as pa
    import pyarrow.parquet as pq
    from datasets import ClassLabel, Features, Image
    from demo_data import stratified_split
    from PIL import Image as PILImage

    source = Path(source)
    files = {
        "train": ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"),
        "test": ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"),
    }
    missing = [name for pair in files.values() for name in pair if not (source / name).is_file()]
    if missing:
        raise MissingData(
            f"Fashion-MNIST idx files not found in {source} ({', '.join(missing)}): install them with "
            f"`apt-get install dataset-fashion-mnist` (Debian; it puts them in {FASHION_MNIST}) or pass "
            "--fashion_mnist DIR, the folder that holds them"
        )
    images = {s: _read_idx(source / f[0]) for s, f in files.items()}
    labels = {s: _read_idx(source / f[1]).astype(np.int64) for s, f in files.items()}

    n = len(labels["train"])
    rest, val_index = stratified_split(labels["train"], (1 - validation / n, validation / n), seed)
    if train is not None and train < len(rest):
        rest = rest[take_subset(labels["train"][rest], train, seed + 1)]
    test_index = np.arange(len(labels["test"]))
    if test is not None and test < len(test_index):
        test_index = take_subset(labels["test"], test, seed + 2)
    splits = {"train": ("train", rest), "validation": ("train", val_index), "test": ("test", test_index)}
    features = Features({"image": Image(), "label": ClassLabel(names=FASHION_LABELS)})
    out = Path(out_dir) / "data"
    out.mkdir(parents=True, exist_ok=True)
    for name, (split, index) in splits.items():
        encoded = []
        for i in index:
            buffer = io.BytesIO()
            PILImage.fromarray(images[split][i], "L").save(buffer, format="PNG")
            encoded.append({"bytes": buffer.getvalue(), "path": None})
        table = pa.table({"image": encoded, "label": labels[split][index].tolist()}, schema=features.arrow_schema)
        pq.write_table(table, out / f"{name}-00000-of-00001.parquet")
    return Path(out_dir)


def take_subset(labels: np.ndarray, count: int, seed: int) -> np.ndarray:
    """`count` stratified positions into `labels`."""
    from demo_data import stratified_split

    return stratified_split(labels, (count / len(labels), 1 - count / len(labels)), seed)[0]


# ------------------------------------------------------------------------------------------------ runs


PRETRAIN_RECIPE = """\
# Written by tools/transfer.py: a small ViT trained from scratch on Fashion-MNIST, the base of the transfer check.
model_name_or_path: null
config_name: vit
do_train: true
do_eval: true
lr_scheduler_type: cosine
warmup_steps: 0.05
weight_decay: 0.05
label_smoothing_factor: 0.1
crop_scale_min: 0.6
hflip_prob: 0.5
save_strategy: "no"
logging_steps: 50
report_to: none
plots: false
"""

FINETUNE_RECIPE = """\
# Written by tools/transfer.py: fine-tune the Fashion-MNIST ViT on digits (full, --use_peft or --freeze_backbone).
do_train: true
do_eval: true
lr_scheduler_type: cosine
warmup_steps: 0.05
weight_decay: 0.0
label_smoothing_factor: 0.0
crop_scale_min: 0.7
hflip_prob: 0.0
eval_strategy: "no"
save_strategy: "no"
logging_steps: 20
report_to: none
plots: false
"""


@dataclass
class RunResult:
    stage: str  # "pretrain" or a method
    seed: int
    command: list[str]
    seconds: float
    results: dict
    peak_rss_gib: float | None = None
    saved_bytes: int | None = None


def _saved_bytes(output_dir: Path) -> int:
    names = ("adapter_model.safetensors", "model.safetensors")
    return sum((output_dir / n).stat().st_size for n in names if (output_dir / n).is_file())


class Runner:
    """Runs the script in a subprocess (own memory peak, the benchmark) or in this process (fast, for tests)."""

    def __init__(self, in_process: bool = False, script: Path = SCRIPT, quiet: bool = True):
        self.in_process = in_process
        self.script = Path(script)
        self.quiet = quiet

    def __call__(self, stage: str, seed: int, argv: list[str], output_dir: Path) -> RunResult:
        start = time.perf_counter()
        rss = None
        if self.in_process:
            import importlib.util

            spec = importlib.util.spec_from_file_location("run_image_classification", self.script)
            module = sys.modules.get("run_image_classification")
            if module is None:
                module = importlib.util.module_from_spec(spec)
                sys.modules["run_image_classification"] = module
                spec.loader.exec_module(module)
            module.main(argv)
        else:
            command = [sys.executable, str(self.script), *argv]
            log = open(output_dir.parent / f"{output_dir.name}.log", "w")  # noqa: SIM115
            with log:
                process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
                _, status, usage = os.wait4(process.pid, 0)
                process.returncode = os.waitstatus_to_exitcode(status)
            if process.returncode != 0:
                tail = (output_dir.parent / f"{output_dir.name}.log").read_text().splitlines()[-20:]
                raise RuntimeError(f"{stage} (seed {seed}) failed:\n" + "\n".join(tail))
            rss = round(usage.ru_maxrss * 1024 / 2**30, 3)  # Linux reports KiB
        seconds = time.perf_counter() - start
        results = json.loads((output_dir / "all_results.json").read_text())
        return RunResult(
            stage,
            seed,
            ["run_image_classification.py", *argv],
            round(seconds, 1),
            results,
            rss,
            _saved_bytes(output_dir),
        )


def pretrain(
    work: Path, size: Size, runner: Runner, fashion_mnist: str | os.PathLike = FASHION_MNIST, reuse: bool = False
) -> RunResult:
    out = work / "pretrained"
    if reuse and (out / "model.safetensors").is_file() and (out / "all_results.json").is_file():
        print(f"reusing the base in {out}")
        return RunResult("pretrain", 42, ["(reused)"], 0.0, json.loads((out / "all_results.json").read_text()))
    data = work / "fashion-mnist"
    if not (data / "data" / "train-00000-of-00001.parquet").is_file():
        build_fashion_mnist(fashion_mnist, data, size.fashion_train, size.fashion_validation, size.fashion_test)
    recipe = work / "pretrain.yaml"
    recipe.write_text(PRETRAIN_RECIPE)
    argv = [
        "--config", str(recipe),
        "--dataset_name", str(data),
        "--output_dir", str(out),
        "--overwrite_output_dir", "true",
        "--config_overrides", size.model,
        "--num_train_epochs", str(size.pretrain_epochs),
        "--per_device_train_batch_size", str(size.pretrain_batch),
        "--per_device_eval_batch_size", "512",
        "--learning_rate", str(size.pretrain_lr),
        "--eval_strategy", "no",
        "--seed", "42",
        *size.extra,
    ]  # fmt: skip
    return runner("pretrain", 42, argv, out)


def finetune(
    work: Path, size: Size, runner: Runner, method: str, seed: int, lr: float, extra=(), name: str | None = None
) -> RunResult:
    """One fine-tuning run on digits; `extra` flags come last (they win), `name` is the output folder's."""
    from demo_data import build_digits

    data = work / "digits"
    if not (data / "data").is_dir():
        build_digits(data)
    recipe = work / "finetune.yaml"
    recipe.write_text(FINETUNE_RECIPE)
    out = work / (name or f"{method}-lr{lr:g}-seed{seed}")
    argv = [
        "--config", str(recipe),
        "--dataset_name", str(data),
        "--model_name_or_path", str(work / "pretrained"),
        "--output_dir", str(out),
        "--overwrite_output_dir", "true",
        "--num_train_epochs", str(size.finetune_epochs),
        "--per_device_train_batch_size", str(size.finetune_batch),
        "--per_device_eval_batch_size", "512",
        "--learning_rate", str(lr),
        "--seed", str(seed),
        *METHOD_FLAGS[method],
        *size.extra,
        *extra,
    ]  # fmt: skip
    return runner(method, seed, argv, out)


# ------------------------------------------------------------------------------------------------ report


def summarise(runs: list[RunResult]) -> dict[str, dict]:
    summary = {}
    for method in METHODS + LEVERS:
        mine = [r for r in runs if r.stage == method]
        if not mine:
            continue
        accuracy = [r.results["test_accuracy"] for r in mine]

        def mean_of(key, rows=mine):
            values = [r.results.get(key) for r in rows if r.results.get(key) is not None]
            return round(statistics.fmean(values), 3) if values else None

        rss = [r.peak_rss_gib for r in mine if r.peak_rss_gib is not None]
        summary[method] = {
            "test_accuracy_mean": round(statistics.fmean(accuracy), 4),
            "test_accuracy_std": round(statistics.stdev(accuracy), 4) if len(accuracy) > 1 else 0.0,
            "test_accuracy": accuracy,
            "validation_accuracy_mean": mean_of("eval_accuracy"),
            "trainable_params": mine[0].results.get("train_trainable_params"),
            "total_params": mine[0].results.get("train_total_params"),
            "trainable_percent": mine[0].results.get("train_trainable_percent"),
            "train_images_per_second": mean_of("train_images_per_second"),
            "train_peak_allocated_gib": mean_of("train_peak_allocated_gib"),
            "peak_rss_gib": round(max(rss), 3) if rss else None,
            "saved_bytes": mine[0].saved_bytes,
        }
    return summary


def verdict(summary: dict[str, dict]) -> dict:
    """Points between methods (test accuracy means): each LoRA variant against full fine-tuning and the head alone."""
    out = {}
    for lever in LEVERS:  # points over full fine-tuning, and how many standard deviations (of the two) that is
        if lever in summary and "full" in summary:
            a, b = summary[lever], summary["full"]
            gain = a["test_accuracy_mean"] - b["test_accuracy_mean"]
            spread = max(a["test_accuracy_std"], b["test_accuracy_std"], 1e-9)
            out[f"{lever}_gain_over_full_points"] = round(100 * gain, 2)
            out[f"{lever}_pays"] = gain > spread  # above full by more than either's seed-to-seed spread
    for lora in ("lora", "lora_all"):
        if lora not in summary:
            continue
        name = "lora" if lora == "lora" else "lora_all_linear"
        if "full" in summary:
            gap = summary["full"]["test_accuracy_mean"] - summary[lora]["test_accuracy_mean"]
            out[f"{name}_gap_to_full_points"] = round(100 * gap, 2)
            out[f"{name}_within_1_point_of_full"] = gap <= 0.01
        if "head" in summary:
            lead = summary[lora]["test_accuracy_mean"] - summary["head"]["test_accuracy_mean"]
            out[f"{name}_lead_over_head_points"] = round(100 * lead, 2)
    return out


def markdown(record: dict) -> str:
    summary, pre = record["summary"], record["pretrain"]
    seeds = len(record["seeds"])
    gpu = any(s.get("train_peak_allocated_gib") for s in summary.values())
    memory = "peak GPU memory (GiB, allocated)" if gpu else "peak process RSS (GiB)"
    lines = [
        f"Transfer check ({record['size']}): ViT pretrained from scratch on Fashion-MNIST "
        f"(test accuracy {pre['results'].get('test_accuracy', float('nan')):.2%}), fine-tuned on digits; "
        f"{seeds} seed(s) per method, test accuracy mean ± sd. Device: {record['device']}.",
        "",
        f"| Method | Seeds | Learning rate | Validation | Test accuracy | Trainable params | Train img/s | {memory} "
        "| Saved |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for method, row in summary.items():
        peak = row["train_peak_allocated_gib"] if gpu else row["peak_rss_gib"]
        saved = f"{row['saved_bytes'] / 2**20:.2f} MiB" if row["saved_bytes"] else "-"
        if method.startswith("lora"):
            saved += " (adapter)"
        validation = row.get("validation_accuracy_mean")
        lines.append(
            f"| {METHOD_NAMES[method]} | {len(row['test_accuracy'])} | {row.get('learning_rate', '-')} "
            f"| {f'{100 * validation:.2f}%' if validation is not None else '-'} "
            f"| {100 * row['test_accuracy_mean']:.2f}% ± {100 * row['test_accuracy_std']:.2f} "
            f"| {row['trainable_params']:,} ({row['trainable_percent']:.2f}%) "
            f"| {row['train_images_per_second'] or float('nan'):,.0f} "
            f"| {peak if peak is not None else '-'} | {saved} |"
        )
    v = record["verdict"]
    lines.append("")
    for name, label in (("lora", "LoRA (query, value)"), ("lora_all_linear", "LoRA (all linear layers)")):
        if f"{name}_gap_to_full_points" in v:
            gap = v[f"{name}_gap_to_full_points"]
            ok = "yes" if v[f"{name}_within_1_point_of_full"] else "NO"
            lines.append(
                f"{label} is {abs(gap):.2f} points {'below' if gap >= 0 else 'above'} full fine-tuning "
                f"(within 1 point: {ok})."
            )
        if f"{name}_lead_over_head_points" in v:
            lead = v[f"{name}_lead_over_head_points"]
            lines.append(
                f"{label} is {abs(lead):.2f} points {'above' if lead >= 0 else 'below'} the frozen backbone (head only)."
            )
    for lever in LEVERS:
        if f"{lever}_gain_over_full_points" in v:
            gain, pays = v[f"{lever}_gain_over_full_points"], v[f"{lever}_pays"]
            verdict_text = "pays (more than the seed-to-seed sd)" if pays else "does not pay here"
            lines.append(f"{METHOD_NAMES[lever]}: {gain:+.2f} points over full fine-tuning: {verdict_text}.")
    for method, tried in record.get("lr_selection", {}).items():
        grid = ", ".join(f"{t['lr']:g}: {t['validation_accuracy']:.4f}" for t in tried)
        lines.append(f"{METHOD_NAMES[method]}: learning rate chosen on validation (first seed) among {grid}.")
    if record.get("skipped"):
        lines.append(f"Not run (time budget): {', '.join(record['skipped'])}.")
    return "\n".join(lines) + "\n"


def device_description() -> str:
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_name()
    except Exception:  # pragma: no cover
        pass
    return f"CPU ({os.cpu_count()} cores)"


def record_stem(runs) -> str:
    """lora_transfer, or levers_transfer for a record of timm's levers."""
    return "levers_transfer" if any(r.stage in LEVERS for r in runs) else "lora_transfer"


def write_record(
    out: Path, size, spec: Size, seeds, base: RunResult, runs, chosen=None, selection=None, skipped=None
) -> dict:
    """OUT/lora_transfer.json, rewritten after every run (a job cut short keeps what it did)."""
    summary = summarise(runs)
    for method, lr in (chosen or {}).items():
        if method in summary:
            summary[method]["learning_rate"] = lr
    record = {
        "size": size if isinstance(size, str) else "custom",
        "config": asdict(spec),
        "seeds": seeds,
        "device": device_description(),
        "host": platform.node(),
        "pretrain": asdict(base),
        "runs": [asdict(r) for r in runs],
        "summary": summary,
        "verdict": verdict(summary),
        "lr_selection": selection or {},
        "skipped": skipped or [],
        "commands": [" ".join(map(shlex.quote, ["python", *r.command])) for r in [base, *runs]],
    }
    (out / f"{record_stem(runs)}.json").write_text(json.dumps(record, indent=2) + "\n")
    return record


def run_check(
    out: str | os.PathLike,
    size: str | Size = "full",
    work: str | os.PathLike | None = None,
    methods: tuple[str, ...] = METHODS,
    seeds: list[int] | None = None,
    runner: Runner | None = None,
    fashion_mnist: str | os.PathLike = FASHION_MNIST,
    stage: str = "all",
    reuse_base: bool = False,
    budget: float | None = None,
) -> dict:
    """Pretrain, fine-tune with each method and seed, write OUT/lora_transfer.{json,md}; returns the record.

    A method given several learning rates gets the one with the best validation accuracy on the first seed (those
    runs are recorded in "lr_selection"); the other seeds then run at that rate. No run starts after `budget`
    seconds: the record says which were skipped.
    """
    start = time.perf_counter()
    spec = SIZES[size] if isinstance(size, str) else size
    out = Path(out)
    work = Path(work) if work else out / "work"
    work.mkdir(parents=True, exist_ok=True)
    runner = runner or Runner()
    seeds = list(seeds) if seeds is not None else spec.seeds
    base = pretrain(work, spec, runner, fashion_mnist, reuse_base)
    print(f"pretrained on Fashion-MNIST: test accuracy {base.results.get('test_accuracy', 0):.4f} ({base.seconds}s)")
    if stage == "pretrain":
        print(f"base checkpoint: {work / 'pretrained'}")
        return {"pretrain": asdict(base)}
    out.mkdir(parents=True, exist_ok=True)
    runs: list[RunResult] = []
    selection: dict[str, list[dict]] = {}
    skipped: list[str] = []
    chosen: dict[str, float] = {}

    def one(method: str, seed: int, lr: float) -> RunResult | None:
        if budget is not None and time.perf_counter() - start > budget:
            skipped.append(f"{method} seed {seed} lr {lr:g}")
            return None
        result = finetune(work, spec, runner, method, seed, lr)
        print(
            f"{method:>8} seed {seed} lr {lr:g}: validation {result.results.get('eval_accuracy', float('nan')):.4f}, "
            f"test {result.results['test_accuracy']:.4f}, "
            f"{result.results.get('train_images_per_second', 0):,.0f} img/s ({result.seconds}s)",
            flush=True,
        )
        return result

    for method in methods:  # the first seed, choosing the learning rate on validation
        rates = spec.learning_rates.get(method, spec.learning_rates["full"])
        rates = rates if isinstance(rates, list) else [rates]
        tried = [(lr, one(method, seeds[0], lr)) for lr in rates]
        tried = [(lr, r) for lr, r in tried if r is not None]
        if not tried:
            continue
        if len(rates) > 1:
            selection[method] = [
                {
                    "lr": lr,
                    "validation_accuracy": r.results.get("eval_accuracy"),
                    "test_accuracy": r.results["test_accuracy"],
                }
                for lr, r in tried
            ]
        chosen[method], best = max(tried, key=lambda pair: pair[1].results.get("eval_accuracy", 0.0))
        runs.append(best)
        record = write_record(out, size, spec, seeds, base, runs, chosen, selection, skipped)
    for seed in seeds[1:]:
        for method in chosen:
            result = one(method, seed, chosen[method])
            if result is not None:
                runs.append(result)
                record = write_record(out, size, spec, seeds, base, runs, chosen, selection, skipped)
    record = write_record(out, size, spec, seeds, base, runs, chosen, selection, skipped)
    table = markdown(record)
    (out / f"{record_stem(runs)}.md").write_text(table)
    print(table)
    return record


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="outputs/lora_transfer", help="where the JSON and table go")
    parser.add_argument("--size", choices=sorted(SIZES), default="full")
    parser.add_argument("--work", default=None, help="datasets, checkpoints and logs (default: OUT/work)")
    parser.add_argument("--methods", nargs="+", choices=METHODS + LEVERS, default=list(METHODS))
    parser.add_argument("--seeds", nargs="+", type=int, default=None)
    parser.add_argument("--fashion_mnist", default=FASHION_MNIST, help="folder of the Fashion-MNIST idx .gz files")
    parser.add_argument("--stage", choices=["all", "pretrain"], default="all", help="pretrain: only make the base")
    parser.add_argument("--reuse_base", action="store_true", help="keep WORK/pretrained if it is there")
    parser.add_argument("--budget", type=float, default=None, help="start no fine-tuning run after this many seconds")
    parser.add_argument(
        "--set",
        nargs="+",
        default=[],
        metavar="KEY=VALUE",
        help="override the size's settings, e.g. finetune_epochs=10 pretrain_epochs=2 lr.lora=1e-2",
    )
    parser.add_argument("--in_process", action="store_true", help="run the script in this process (no RSS)")
    args = parser.parse_args(argv)
    try:
        run_check(
            args.out,
            override(SIZES[args.size], args.set) if args.set else args.size,
            args.work,
            tuple(args.methods),
            args.seeds,
            Runner(in_process=args.in_process),
            args.fashion_mnist,
            args.stage,
            args.reuse_base,
            args.budget,
        )
    except MissingData as err:
        parser.exit(2, f"error: {err}\n")


def override(size: Size, settings: list[str]) -> Size:
    """A copy of `size` with KEY=VALUE settings (values parsed as YAML; lr.METHOD sets one learning rate)."""
    import yaml

    values = asdict(size)
    for setting in settings:
        key, _, text = setting.partition("=")
        value = yaml.safe_load(text)
        if key.startswith("lr."):
            value = [float(v) for v in value] if isinstance(value, list) else float(value)
            values["learning_rates"] = {**values["learning_rates"], key[3:]: value}
        elif key in values:
            values[key] = value
        else:
            raise SystemExit(f"--set {setting}: unknown key (keys: {', '.join(values)}, lr.METHOD)")
    return Size(**values)


if __name__ == "__main__":
    main()

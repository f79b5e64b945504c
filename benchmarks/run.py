#!/usr/bin/env python
"""Run run_image_classification.py for a fixed number of steps and write one JSON record per run.

One run:
    python benchmarks/run.py --model bench_assets/vit-base --dataset bench_assets/cifar100 \
        --strategy zero2 --gpus 2 --batch 128 --steps 60 --precision bf16 --results benchmarks/results/h200x2

A matrix (batch 8..256 x DDP fp32/bf16, ZeRO-2, ZeRO-3 + offload, FSDP2, ZeRO-3), or a suite file:
    python benchmarks/run.py --sweep --gpus 2 --model ... --dataset ... --results benchmarks/results/h200x2-sweep
    python benchmarks/run.py --suite benchmarks/suites/gpu_core.yaml --results /tmp/results/gpu_core

Arguments for the script itself go after a bare `--` (or in `--extra "..."`):
    python benchmarks/run.py ... -- --gradient_checkpointing true

Launchers: single -> python; ddp -> accelerate launch --multi_gpu; every other strategy -> accelerate launch
--config_file with its accelerate config (STRATEGIES, from the table in vit_recipes/strategies.py). The script
writes its steady-state figures (warm-up skipped) into output_dir/all_results.json (meter.SpeedMeter); they
become the record's "metrics". A run that fails, runs out of memory or times out is recorded with status "failed"
and its error line.
`peer: true` in a suite entry (or --peer) runs benchmarks/peer.py instead of the script: transformers' example
script, reproduced and measured with the same meter, on one GPU (the entry's `extra` goes to it). The record says
"peer": true and which transforms ran ("peer_transforms"); report.py states each run's ratio against the peer's
8-worker record.
`decode: true` in a suite entry runs the same command twice with one fresh HF_DATASETS_CACHE: "<name>-cold" decodes
every image, "<name>-warm" reads the cache; both records carry data_decode_seconds and wall_seconds.

Record schema (docs/benchmarks.md): name, strategy, gpus, model, per_device_batch, precision, dataset, steps, device,
command, git_commit, versions, metrics, trace_dir (optional), created; plus status, error, failure, wall_seconds,
global_batch, dataloader_workers, gradient_checkpointing, extra_args, cache, log, suite, peer (+ peer_transforms).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# The runs use the checkout's package (PYTHONPATH=src, see child_env), with no install: so does the runner.
sys.path.insert(0, str(ROOT / "src"))

from vit_recipes import strategies  # noqa: E402

SCRIPT = "run_image_classification.py"
PEER_SCRIPT = "benchmarks/peer.py"
SCHEMA_VERSION = 1

# strategy -> its accelerate config, relative to ROOT (None: launched without one), from the strategy table. ddp
# runs with `accelerate launch --multi_gpu` (or torchrun), not with the table's ddp.yaml.
STRATEGIES: dict[str, str | None] = {
    s.name: None if s.name == "ddp" else s.accelerate_config for s in strategies.STRATEGIES
}
PRECISIONS = ("fp32", "bf16")
SWEEP_BATCHES = (8, 32, 64, 128, 256)
# (strategy, precision) pairs of the matrix, cheapest first.
SWEEP_VARIANTS = (
    ("ddp", "fp32"),
    ("ddp", "bf16"),
    ("zero2", "bf16"),
    ("zero3_offload", "bf16"),
    ("fsdp2", "bf16"),
    ("zero3", "bf16"),
)
# Architectures of benchmarks/make_assets.py, by (hidden_size, num_hidden_layers, patch_size).
MODEL_TAGS = {(768, 12, 16): "vit-base", (1024, 24, 16): "vit-large", (1280, 32, 14): "vit-huge"}
RUN_KEYS = {
    "name",
    "model",
    "dataset",
    "strategy",
    "gpus",
    "batch",
    "steps",
    "precision",
    "workers",
    "timeout",
    "extra",
    "decode",
    "model_tag",
    "dataset_tag",
    "launcher",
    "min_left",
    "ds_overrides",
    "peer",
}
MIN_RUN_SECONDS = 40  # with a time budget, a run is not started with less left than this
OOM_PATTERN = re.compile(r"out of memory|OutOfMemoryError|CUDA_ERROR_OUT_OF_MEMORY|Cannot allocate memory", re.I)
ERROR_PATTERN = re.compile(r"^(error: .+|[\w.]*(Error|Exception)\b.*|Killed.*|.*Signals\.SIG\w+.*)$")
NOISE = ("ChildFailedError", "torch.distributed.elastic", "subprocess.CalledProcessError", "Traceback")


class PlanError(ValueError):
    """A run that cannot be built (unknown strategy, missing config file, ...)."""


# --------------------------------------------------------------------------------------------------- planning


def model_tag(path: str) -> str:
    """'vit-base'/'vit-huge' for the make_assets checkpoints (read from config.json), else the folder name."""
    try:
        config = json.loads((Path(path) / "config.json").read_text())
        patch = config.get("patch_size")
        patch = patch[0] if isinstance(patch, list) else patch
        key = (config.get("hidden_size"), config.get("num_hidden_layers"), patch)
        if key in MODEL_TAGS:
            return MODEL_TAGS[key]
    except (OSError, ValueError):
        pass
    return Path(path.rstrip("/")).name or path


def flag_value(args: list[str], flag: str) -> str | None:
    """The value of `--flag value` / `--flag=value` in a script argument list ('true' for a bare flag)."""
    value = None
    for i, arg in enumerate(args):
        if arg == flag:
            nxt = args[i + 1] if i + 1 < len(args) else None
            value = "true" if nxt is None or nxt.startswith("--") else nxt
        elif arg.startswith(flag + "="):
            value = arg.split("=", 1)[1]
    return value


def is_true(value: str | None) -> bool:
    return value is not None and value.lower() in ("true", "1", "yes")


def default_name(run: dict) -> str:
    extra = run.get("extra", [])
    suffix = "-ckpt" if is_true(flag_value(extra, "--gradient_checkpointing")) else ""
    suffix += "-compile" if is_true(flag_value(extra, "--torch_compile")) else ""
    tag = run.get("model_tag") or model_tag(run["model"])
    if run.get("peer"):
        return f"peer-{tag}-{run['precision']}-b{run['batch']}-w{run['workers']}"
    return f"{tag}-{run['strategy']}-{run['precision']}-g{run['gpus']}-b{run['batch']}{suffix}"


def normalise(run: dict, defaults: dict | None = None) -> dict:
    """Fill defaults, check values; raise PlanError on anything that cannot run."""
    defaults = defaults or {}
    extra = [*_as_args(defaults.get("extra")), *_as_args(run.get("extra"))]  # an entry's extra adds to the defaults'
    run = {**defaults, **run, "extra": extra}
    unknown = set(run) - RUN_KEYS
    if unknown:
        raise PlanError(f"unknown run keys: {', '.join(sorted(unknown))} (known: {', '.join(sorted(RUN_KEYS))})")
    for key in ("model", "dataset"):
        if not run.get(key):
            raise PlanError(f"a run needs '{key}'")
        path = Path(run[key]).expanduser()
        if not path.is_absolute() and path.exists() and Path.cwd().resolve() != ROOT:
            run[key] = str(path.resolve())  # the script runs in the repository root
    run.setdefault("strategy", "single")
    run.setdefault("gpus", 1)
    run.setdefault("batch", 64)
    run.setdefault("steps", 60)
    run.setdefault("precision", "bf16")
    run.setdefault("workers", 8)
    run.setdefault("timeout", 600)
    run.setdefault("decode", False)
    run.setdefault("launcher", "accelerate")
    peer = run.get("peer", False)
    run["peer"] = is_true(peer) if isinstance(peer, str) else bool(peer)
    if run["strategy"] not in STRATEGIES:
        raise PlanError(f"unknown strategy {run['strategy']!r}; one of {', '.join(STRATEGIES)}")
    if run["precision"] not in PRECISIONS:
        raise PlanError(f"precision must be fp32 or bf16, got {run['precision']!r}")
    for key in ("gpus", "batch", "steps", "workers", "timeout"):
        run[key] = int(run[key])
        if run[key] < (0 if key == "workers" else 1):
            raise PlanError(f"{key} must be positive, got {run[key]}")
    if run["strategy"] == "single" and run["gpus"] != 1:
        raise PlanError("strategy 'single' runs on one GPU; use ddp (or another strategy) for --gpus > 1")
    if run["strategy"] == "ddp" and run["gpus"] < 2:
        raise PlanError("strategy 'ddp' needs --gpus >= 2 (use 'single' for one GPU)")
    if run["peer"] and (run["strategy"] != "single" or run.get("ds_overrides")):
        raise PlanError("peer runs (transformers' example script) use strategy 'single': one GPU, no DeepSpeed")
    if run["launcher"] not in ("accelerate", "torchrun"):
        raise PlanError(f"launcher must be accelerate or torchrun, got {run['launcher']!r}")
    if run.get("ds_overrides") is not None:
        if not isinstance(run["ds_overrides"], dict) or not run["ds_overrides"]:
            raise PlanError(
                "ds_overrides: a mapping of dotted DeepSpeed keys to values, e.g. {zero_optimization.reduce_bucket_size: 5e7}"
            )
        if strategies.BY_NAME[run["strategy"]].zero_stage is None:  # not a DeepSpeed row
            raise PlanError(f"ds_overrides: strategy {run['strategy']!r} does not use DeepSpeed")
    run["name"] = str(run.get("name") or default_name(run))
    if not re.fullmatch(r"[\w.+-]+", run["name"]):
        raise PlanError(f"run name {run['name']!r}: use letters, digits, '.', '_', '+', '-'")
    return run


def _as_args(extra) -> list[str]:
    if not extra:
        return []
    return shlex.split(extra) if isinstance(extra, str) else [str(a) for a in extra]


def expand(entry: dict) -> list[dict]:
    """A suite entry whose strategy/precision/batch/gpus are lists becomes their cartesian product."""
    axes = [k for k in ("strategy", "precision", "gpus", "batch") if isinstance(entry.get(k), list)]
    if not axes:
        return [dict(entry)]
    runs = []
    for values in itertools.product(*(entry[k] for k in axes)):
        run = {**entry, **dict(zip(axes, values))}
        if "name" in entry:  # a template: "core-{precision}-b{batch}"
            run["name"] = entry["name"].format(**run)
        runs.append(run)
    return runs


def load_suite(path: str) -> tuple[dict, list[dict], float | None]:
    """A YAML/JSON file: {defaults: {...}, runs: [{...}, ...], budget: seconds} (list values expand, see `expand`)."""
    text = Path(path).read_text()
    if path.endswith(".json"):
        suite = json.loads(text)
    else:
        import yaml

        suite = yaml.safe_load(text)
    if not isinstance(suite, dict) or not isinstance(suite.get("runs"), list):
        raise PlanError(f"{path}: expected a mapping with a 'runs' list")
    budget = suite.get("budget")
    return suite.get("defaults") or {}, [r for entry in suite["runs"] for r in expand(entry)], budget


def sweep_runs(batches=SWEEP_BATCHES, variants=SWEEP_VARIANTS) -> list[dict]:
    return [{"strategy": s, "precision": p, "batch": b} for s, p in variants for b in batches]


def deepspeed_config(run: dict) -> dict:
    """The strategy's DeepSpeed JSON (its row in the strategy table) with the run's ds_overrides applied."""
    config = json.loads((ROOT / strategies.BY_NAME[run["strategy"]].deepspeed_config).read_text())
    for dotted, value in run["ds_overrides"].items():
        *parents, leaf = dotted.split(".")
        node = config
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = int(value) if isinstance(value, float) and value.is_integer() else value
    return config


def launch_prefix(run: dict, port: int | None = None, ds_config_file: str | None = None) -> list[str]:
    """The launcher part of the command (argv), before the script."""
    strategy, gpus = run["strategy"], run["gpus"]
    if strategy == "single":
        return [sys.executable]
    if strategy == "ddp" and run["launcher"] == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(gpus)]
    cmd = [sys.executable, "-m", "accelerate.commands.launch"]
    if strategy == "ddp":
        cmd += ["--multi_gpu"]
    else:
        config = ROOT / STRATEGIES[strategy]
        if not config.is_file():
            raise PlanError(f"accelerate config for {strategy} not found: {config.relative_to(ROOT)}")
        cmd += ["--config_file", str(config.relative_to(ROOT))]
        if ds_config_file:  # a launch argument overrides the YAML's deepspeed_config_file
            cmd += ["--deepspeed_config_file", ds_config_file]
    # On the command line, not from the YAML: the Trainer reads ACCELERATE_MIXED_PRECISION before --bf16, so a
    # YAML saying bf16 would silently turn an fp32 run into bf16.
    cmd += ["--num_processes", str(gpus), "--num_machines", "1"]
    cmd += ["--mixed_precision", "bf16" if run["precision"] == "bf16" else "no"]
    if port:
        cmd += ["--main_process_port", str(port)]
    return cmd


def script_args(run: dict, output_dir: str) -> list[str]:
    steps = run["steps"]
    args = [
        PEER_SCRIPT if run.get("peer") else SCRIPT,
        "--model_name_or_path",
        run["model"],
        "--dataset_name",
        run["dataset"],
        "--output_dir",
        output_dir,
        "--do_train",
        "true",
        "--do_eval",
        "false",
        "--eval_strategy",
        "no",
        "--save_strategy",
        "no",
        "--max_steps",
        str(steps),
        "--per_device_train_batch_size",
        str(run["batch"]),
        "--bf16",
        "true" if run["precision"] == "bf16" else "false",
        "--dataloader_num_workers",
        str(run["workers"]),
        "--logging_steps",
        str(max(1, min(50, steps // 4))),
        "--report_to",
        "none",
        "--disable_tqdm",
        "true",
    ]
    if run.get("peer"):  # the example's stock Trainer needs the image column kept; the checkpoint has another head
        args += ["--remove_unused_columns", "false", "--ignore_mismatched_sizes", "true"]
    else:
        args += ["--plots", "false"]
    return args + run["extra"]


def build_command(run: dict, output_dir: str, port: int | None = None, ds_config_file: str | None = None) -> list[str]:
    return launch_prefix(run, port, ds_config_file) + script_args(run, output_dir)


def display_command(argv: list[str]) -> str:
    """The command as a person would type it (python / accelerate launch / torchrun)."""
    text = shlex.join(argv)
    exe = shlex.quote(sys.executable)
    text = text.replace(f"{exe} -m accelerate.commands.launch", "accelerate launch")
    text = text.replace(f"{exe} -m torch.distributed.run", "torchrun")
    return text.replace(exe, "python", 1) if text.startswith(exe) else text


# --------------------------------------------------------------------------------------------------- environment


def _run_quiet(cmd: list[str]) -> str | None:
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=30, cwd=ROOT)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def git_commit() -> str:
    # The launcher knows best: a tree copied to a GPU machine may carry a stale .git (or none).
    if os.environ.get("BENCH_GIT_COMMIT"):
        return os.environ["BENCH_GIT_COMMIT"]
    commit = _run_quiet(["git", "rev-parse", "HEAD"])
    if not commit:
        return "unknown"
    dirty = _run_quiet(["git", "status", "--porcelain", "--untracked-files=no"])
    return commit + ("-dirty" if dirty else "")


def code_fingerprint() -> str:
    """sha1 of the script, the package and this runner: which code ran, even in a copy of the tree without .git."""
    import hashlib

    digest = hashlib.sha1()
    files = [
        ROOT / SCRIPT,
        ROOT / PEER_SCRIPT,
        Path(__file__).resolve(),
        *sorted((ROOT / "src" / "vit_recipes").glob("*.py")),
    ]
    for file in files:
        if file.is_file():
            digest.update(file.name.encode() + b"\0" + file.read_bytes())
    return digest.hexdigest()[:16]


def gpu_info() -> list[tuple[str, float | None]]:
    """(name, memory GiB) of each visible GPU, from nvidia-smi (no CUDA context in this process)."""
    out = _run_quiet(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader,nounits"])
    gpus = []
    for line in (out or "").splitlines():
        name, _, memory = line.rpartition(",")
        try:
            gpus.append((name.strip(), round(float(memory) / 1024, 1)))
        except ValueError:
            gpus.append((line.strip(), None))
    return gpus


def device_description(gpus: list[tuple[str, float | None]]) -> str:
    if gpus:
        return gpus[0][0]
    return f"CPU ({os.cpu_count() or 1} cores, {platform.processor() or platform.machine()})"


def library_versions() -> dict[str, str | None]:
    from importlib import metadata

    versions: dict[str, str | None] = {}
    for name in ("torch", "transformers", "accelerate", "deepspeed", "datasets", "timm", "peft", "torchao"):
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    versions["python"] = platform.python_version()
    return versions


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def visible_gpu_ids() -> list[str]:
    """The GPUs CUDA_VISIBLE_DEVICES leaves this process (empty: unset, i.e. all of the machine's)."""
    return [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]


def child_env(run: dict, names: list[str], cache_dir: str | None) -> dict[str, str]:
    env = dict(os.environ)
    src = str(ROOT / "src")  # the package imports without `pip install -e .`
    env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("HF_HUB_OFFLINE", "1")  # benchmarks use local assets; never wait on the network
    env.setdefault("HF_DATASETS_OFFLINE", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env["PYTHONUNBUFFERED"] = "1"
    if names:
        # The run's GPUs: the first `gpus` of those visible (a lane of a shared machine sets CUDA_VISIBLE_DEVICES).
        # A lone python process sees exactly one (the script refuses DataParallel over several).
        visible = visible_gpu_ids() or [str(i) for i in range(len(names))]
        env["CUDA_VISIBLE_DEVICES"] = ",".join(visible[: run["gpus"]])
    if cache_dir:
        env["HF_DATASETS_CACHE"] = cache_dir
    return env


# --------------------------------------------------------------------------------------------------- running


def error_line(log_text: str) -> tuple[str, str]:
    """(failure kind, the line that says why) from a failed run's log: oom first, then the last error line."""
    lines = [re.sub(r"^\[rank\d+\]:\s*", "", line).strip() for line in log_text.splitlines()]
    lines = [line for line in lines if line]
    for line in reversed(lines):
        if OOM_PATTERN.search(line):
            return "oom", line[:400]
    for line in reversed(lines):
        if ERROR_PATTERN.match(line) and not any(noise in line for noise in NOISE):
            return "error", line[:400]
    return "error", (lines[-1][:400] if lines else "no output")


def run_process(argv: list[str], env: dict, log_path: Path, timeout: int) -> tuple[int | None, float]:
    """Run argv with stdout+stderr into log_path; on timeout kill its whole process group. (returncode, seconds)"""
    start = time.perf_counter()
    with open(log_path, "w") as log:
        log.write(f"$ {display_command(argv)}\n")
        log.flush()
        proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            code = None
        except KeyboardInterrupt:
            _kill_group(proc)
            raise
        if code is None:
            _kill_group(proc)
    return code, time.perf_counter() - start


def _kill_group(proc: subprocess.Popen) -> None:
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def derived_metrics(metrics: dict, run: dict) -> dict:
    """Steady-state batches/s and per-GPU images/s, from what the script measured."""
    out = {}
    if metrics.get("train_step_time_s"):
        out["train_batches_per_second"] = round(1.0 / metrics["train_step_time_s"], 3)
    if metrics.get("train_images_per_second"):
        out["train_images_per_second_per_gpu"] = round(metrics["train_images_per_second"] / run["gpus"], 2)
    return out


PER_RANK = re.compile(r"^(gpu_mem_peak_gib|gpu_mem_allocated_gib|gpu_mem_reserved_gib|cpu_peak_rss_gib)_rank(\d+)$")
PER_RANK_NAMES = {
    "gpu_mem_peak_gib": "train_peak_allocated_gib_rank",
    # Logged after the optimizer step and zero_grad: activations are freed, what stays is the model states
    # (parameters, optimizer states, persistent gradient buffers) - the part ZeRO/FSDP shard.
    "gpu_mem_allocated_gib": "train_states_allocated_gib_rank",
    "gpu_mem_reserved_gib": "train_reserved_gib_rank",
    "cpu_peak_rss_gib": "cpu_peak_rss_gib_rank",
}


def per_rank_memory(output_dir: Path) -> dict:
    """Memory of every rank, from the per-step logs in trainer_state.json (meter.SpeedMeter):
    the largest logged value per rank, plus train_peak_allocated_gib_max_rank and
    train_states_allocated_gib_max_rank. Empty when nothing was logged."""
    try:
        history = json.loads((output_dir / "trainer_state.json").read_text()).get("log_history", [])
    except (OSError, ValueError):
        return {}
    out: dict[str, float] = {}
    for entry in history:
        for key, value in entry.items():
            match = PER_RANK.match(key)
            if match and isinstance(value, (int, float)):
                name = PER_RANK_NAMES[match.group(1)] + match.group(2)
                out[name] = max(out.get(name, 0.0), round(float(value), 3))
    for prefix in ("train_peak_allocated_gib", "train_states_allocated_gib"):
        values = [v for k, v in out.items() if k.startswith(prefix + "_rank")]
        if values:
            out[prefix + "_max_rank"] = max(values)
    return out


def base_record(run: dict, suite: str, context: dict) -> dict:
    extra = run["extra"]
    accumulation = int(flag_value(extra, "--gradient_accumulation_steps") or 1)
    return {
        "schema_version": SCHEMA_VERSION,
        "name": run["name"],
        "suite": suite,
        "status": "skipped",
        "failure": None,
        "error": None,
        "strategy": run["strategy"],
        "gpus": run["gpus"],
        "model": run.get("model_tag") or model_tag(run["model"]),
        "model_path": run["model"],
        "per_device_batch": run["batch"],
        "global_batch": run["batch"] * run["gpus"] * accumulation,
        "precision": run["precision"],
        "gradient_checkpointing": is_true(flag_value(extra, "--gradient_checkpointing")),
        "torch_compile": is_true(flag_value(extra, "--torch_compile")),
        "dataset": run.get("dataset_tag") or Path(run["dataset"].rstrip("/")).name,
        "dataset_path": run["dataset"],
        "steps": run["steps"],
        "dataloader_workers": run["workers"],
        "extra_args": extra,
        "ds_overrides": run.get("ds_overrides"),
        "peer": run.get("peer", False),
        "cache": None,
        "device": context["device"],
        "device_memory_gib": context["device_memory_gib"],
        "command": None,
        "git_commit": context["git_commit"],
        "code_fingerprint": context["code_fingerprint"],
        "versions": context["versions"],
        "metrics": {},
        "wall_seconds": None,
        "log": None,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }


def execute(
    run: dict, results: Path, suite: str, context: dict, cache_dir: str | None, keep_output: bool, phase=None
) -> dict:
    """Run one benchmark and write results/<name>.json (and logs/<name>.log); returns the record."""
    record = base_record(run, suite, context)
    record["cache"] = phase
    logs = results / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    log_path = logs / f"{run['name']}.log"
    record["log"] = str(log_path.relative_to(results))
    work = Path(tempfile.mkdtemp(prefix=f"bench-{run['name']}-"))
    # Profiler traces (--profile_steps) are kept with the record; so is everything with --keep-output.
    profiling = flag_value(run["extra"], "--profile_steps") is not None
    keep = keep_output or profiling
    output_dir = results / "outputs" / run["name"] if keep else work / "out"
    if keep:
        shutil.rmtree(output_dir, ignore_errors=True)  # the script refuses a folder holding a finished run
    try:
        port = free_port() if run["strategy"] != "single" else None
        ds_config_file = None
        if run.get("ds_overrides"):  # kept next to the log: the record says exactly what ran
            ds_path = logs / f"{run['name']}.ds_config.json"
            ds_path.write_text(json.dumps(deepspeed_config(run), indent=2) + "\n")
            ds_config_file = str(ds_path)
            record["ds_config"] = str(ds_path.relative_to(results))
        argv = build_command(run, str(output_dir), port, ds_config_file)
        record["command"] = display_command(argv)
        code, seconds = run_process(argv, child_env(run, context["gpu_names"], cache_dir), log_path, run["timeout"])
        record["wall_seconds"] = round(seconds, 2)
        results_file = output_dir / "all_results.json"
        if code == 0 and results_file.is_file():
            metrics = json.loads(results_file.read_text())
            if run.get("peer"):
                record["peer_transforms"] = metrics.get("peer_transforms")
            metrics = {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
            record["metrics"] = {**metrics, **derived_metrics(metrics, run), **per_rank_memory(output_dir)}
            record["status"] = "ok"
            if "train_images_per_second" not in metrics:
                record.update(status="failed", failure="error", error="no steady-state steps (raise --steps above 5)")
        elif code is None:
            record.update(status="failed", failure="timeout", error=f"timed out after {run['timeout']} s")
        else:
            kind, line = error_line(log_path.read_text(errors="replace"))
            record.update(status="failed", failure=kind, error=line if code else "exited 0 without all_results.json")
        if keep:
            record["trace_dir"] = str(output_dir.relative_to(results))  # relative to the record, like "log"
            if not keep_output:  # kept for the traces: drop the weights
                for weights in (*output_dir.glob("*.safetensors"), *output_dir.glob("*.bin")):
                    weights.unlink()
    except PlanError as err:
        record.update(status="failed", failure="plan", error=str(err))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    write_record(record, results)
    return record


def write_record(record: dict, results: Path) -> Path:
    results.mkdir(parents=True, exist_ok=True)
    path = results / f"{record['name']}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(record, indent=2) + "\n")
    tmp.replace(path)
    return path


def one_line(record: dict) -> str:
    m = record["metrics"]
    if record["status"] != "ok":
        return f"{record['status'].upper()} ({record['failure']}): {record['error']}"
    parts = [f"{m['train_images_per_second']:,.0f} img/s", f"step {1000 * m['train_step_time_s']:.0f} ms"]
    if "train_peak_allocated_gib" in m:
        parts.append(f"peak {m['train_peak_allocated_gib']:.1f} GiB")
    parts.append(f"data wait {100 * m.get('train_data_wait_fraction', 0):.1f}%")
    if "train_mfu" in m:
        parts.append(f"MFU {100 * m['train_mfu']:.0f}%")
    if "data_decode_seconds" in m and record.get("cache"):
        parts.append(f"decode {m['data_decode_seconds']:.1f} s")
    return ", ".join(parts) + f" (wall {record['wall_seconds']:.0f} s)"


def smaller_batch_oom(run: dict, done: list[tuple[dict, dict]]) -> dict | None:
    """A finished run of the same configuration at a smaller batch that ran out of memory."""
    same = ("model", "dataset", "strategy", "gpus", "precision", "extra", "workers", "peer")
    for other, record in done:
        if record["failure"] == "oom" and other["batch"] < run["batch"] and all(other[k] == run[k] for k in same):
            return other
    return None


def run_all(
    runs: list[dict],
    results: Path,
    suite: str,
    budget: float | None = None,
    skip_existing: bool = False,
    keep_output: bool = False,
    stop_after_oom: bool = True,
) -> list[dict]:
    gpus = gpu_info()
    context = {
        "gpu_names": [name for name, _ in gpus],
        "device": device_description(gpus),
        "device_memory_gib": gpus[0][1] if gpus else None,
        "git_commit": git_commit(),
        "code_fingerprint": code_fingerprint(),
        "versions": library_versions(),
    }
    start = time.perf_counter()
    records: list[dict] = []
    done: list[tuple[dict, dict]] = []
    jobs = []  # (run, cache phase): a decode run is a cold then a warm job sharing one fresh datasets cache
    for run in runs:
        phases = ("cold", "warm") if run["decode"] else (None,)
        jobs += [({**run, "name": f"{run['name']}-{p}"} if p else run, p) for p in phases]
    cache_dir = None
    try:
        for index, (run, phase) in enumerate(jobs, 1):
            label = f"[{index}/{len(jobs)}] {run['name']}"
            existing = results / f"{run['name']}.json"
            if skip_existing and existing.is_file() and json.loads(existing.read_text()).get("status") == "ok":
                print(f"{label}: kept existing record", flush=True)
                continue
            left = None if budget is None else budget - (time.perf_counter() - start)
            oom = smaller_batch_oom(run, done) if stop_after_oom else None
            needed = max(MIN_RUN_SECONDS, int(run.get("min_left") or 0))  # min_left: a suite entry's own floor
            if (left is not None and left < needed) or oom:
                record = base_record(run, suite, context)
                why = (
                    f"out of memory at batch {oom['batch']}"
                    if oom
                    else f"time budget spent ({max(left, 0):.0f} s of {budget:.0f} s left)"
                )
                record.update(status="skipped", failure="skipped", error=why, cache=phase)
                write_record(record, results)
                print(f"{label}: skipped ({why})", flush=True)
                records.append(record)
                continue
            if left is not None:
                run = {**run, "timeout": int(min(run["timeout"], left))}
            if phase == "cold":
                if cache_dir:
                    shutil.rmtree(cache_dir, ignore_errors=True)
                cache_dir = tempfile.mkdtemp(prefix="bench-decode-cache-")
            print(f"{label}{f' ({phase} datasets cache)' if phase else ''} ...", flush=True)
            record = execute(run, results, suite, context, cache_dir if phase else None, keep_output, phase)
            print(f"    {one_line(record)}", flush=True)
            records.append(record)
            done.append((run, record))
    finally:
        if cache_dir:
            shutil.rmtree(cache_dir, ignore_errors=True)
    return records


# --------------------------------------------------------------------------------------------------- CLI


def parse_cli(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    script_extra: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, script_extra = argv[:cut], argv[cut + 1 :]
    parser = argparse.ArgumentParser(
        description="Benchmark run_image_classification.py; one JSON record per run.",
        epilog="Arguments after a bare `--` go to the script, e.g. `-- --gradient_checkpointing true`.",
    )
    parser.add_argument("--model", help="checkpoint folder, e.g. bench_assets/vit-base")
    parser.add_argument("--dataset", help="dataset folder, e.g. bench_assets/cifar100")
    parser.add_argument("--strategy", default=None, choices=list(STRATEGIES))
    parser.add_argument("--gpus", type=int, default=None)
    parser.add_argument("--batch", type=int, default=None, help="per-device train batch size")
    parser.add_argument("--steps", type=int, default=None, help="max_steps (the first 5 are warm-up, not measured)")
    parser.add_argument("--precision", default=None, choices=PRECISIONS)
    parser.add_argument("--workers", type=int, default=None, help="dataloader_num_workers (default 8)")
    parser.add_argument("--timeout", type=int, default=None, help="seconds per run (default 600)")
    parser.add_argument("--launcher", default=None, choices=["accelerate", "torchrun"], help="for ddp")
    parser.add_argument("--name", default=None, help="record name (default: model-strategy-precision-gN-bB)")
    parser.add_argument("--extra", action="append", default=[], help="script arguments, one quoted string")
    parser.add_argument("--decode", action="store_true", help="cold then warm HF_DATASETS_CACHE: decode timing")
    parser.add_argument("--peer", action="store_true", help="run benchmarks/peer.py (transformers' example script)")
    parser.add_argument("--results", required=True, help="folder for the records, e.g. benchmarks/results/h200")
    parser.add_argument("--suite", help="YAML/JSON suite file: {defaults: {...}, runs: [...]}")
    parser.add_argument("--sweep", action="store_true", help="batch x strategy matrix (see --batches/--variants)")
    parser.add_argument("--batches", default=",".join(map(str, SWEEP_BATCHES)))
    parser.add_argument(
        "--variants",
        default=",".join(f"{s}:{p}" for s, p in SWEEP_VARIANTS),
        help="strategy:precision pairs of the sweep",
    )
    parser.add_argument("--budget", type=float, default=None, help="seconds for all runs; later runs are skipped")
    parser.add_argument("--skip-existing", action="store_true", help="keep records that already succeeded")
    parser.add_argument("--keep-output", action="store_true", help="keep output_dir (weights, traces) per run")
    parser.add_argument("--no-stop-after-oom", action="store_true", help="also run larger batches after an OOM")
    parser.add_argument("--only", default=None, help="run only the runs whose name matches this regex")
    parser.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    args = parser.parse_args(argv)
    for text in args.extra:
        script_extra += shlex.split(text)
    return args, script_extra


def plan(args: argparse.Namespace, script_extra: list[str]) -> list[dict]:
    """The runs the command line asks for (sets args.budget from a suite file that has one)."""
    cli = {
        "model": args.model,
        "dataset": args.dataset,
        "strategy": args.strategy,
        "gpus": args.gpus,
        "batch": args.batch,
        "steps": args.steps,
        "precision": args.precision,
        "workers": args.workers,
        "timeout": args.timeout,
        "launcher": args.launcher,
    }
    cli = {k: v for k, v in cli.items() if v is not None}
    if script_extra:
        cli["extra"] = script_extra
    if args.suite:
        defaults, entries, budget = load_suite(args.suite)
        if args.budget is None and budget:
            args.budget = float(budget)
        return [normalise(entry, {**defaults, **cli}) for entry in entries]  # suite defaults < CLI < entry
    if args.sweep:
        batches = [int(b) for b in args.batches.split(",")]
        variants = [tuple(v.split(":")) for v in args.variants.split(",")]
        cli.pop("batch", None), cli.pop("strategy", None), cli.pop("precision", None)
        return [normalise(entry, cli) for entry in sweep_runs(batches, variants)]
    single = {**cli, "decode": args.decode, "peer": args.peer}
    if args.name:
        single["name"] = args.name
    return [normalise(single)]


def main(argv: list[str] | None = None) -> int:
    args, script_extra = parse_cli(sys.argv[1:] if argv is None else argv)
    try:
        runs = plan(args, script_extra)
    except PlanError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.only:
        runs = [r for r in runs if re.search(args.only, r["name"])]
        if not runs:
            print(f"error: no run name matches --only {args.only!r}", file=sys.stderr)
            return 2
    names = [r["name"] for r in runs]
    duplicated = sorted({n for n in names if names.count(n) > 1})
    if duplicated:
        print(f"error: duplicate run names: {', '.join(duplicated)}", file=sys.stderr)
        return 2
    results = Path(args.results)
    if args.dry_run:
        for run in runs:
            try:
                ds_file = f"<results>/logs/{run['name']}.ds_config.json" if run.get("ds_overrides") else None
                command = display_command(build_command(run, "<output_dir>", ds_config_file=ds_file))
            except PlanError as err:
                command = f"(cannot run: {err})"
            print(f"{run['name']}{' [decode cold+warm]' if run['decode'] else ''}: {command}")
        return 0
    suite = Path(args.suite).stem if args.suite else ("sweep" if args.sweep else results.name)
    records = run_all(
        runs,
        results,
        suite,
        budget=args.budget,
        skip_existing=args.skip_existing,
        keep_output=args.keep_output,
        stop_after_oom=not args.no_stop_after_oom,
    )
    ok = sum(r["status"] == "ok" for r in records)
    print(f"{ok}/{len(records)} runs ok; records in {results}")
    return 0 if ok == len(records) else 1


if __name__ == "__main__":
    sys.exit(main())

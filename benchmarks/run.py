"""The one benchmark runner: every suite under benchmarks/suites/ runs from a clean clone with one command.

    python -m benchmarks.run --list                          # every suite and its question
    python -m benchmarks.run peer                            # benchmarks/suites/peer.yaml -> a record folder
    python -m benchmarks.run scaling --gpus 2 --only ddp     # overrides, a subset
    python -m benchmarks.run my_suite.yaml --set steps=20 --set extra="--use_cpu true"   # any suite file
    make bench SUITE=peer                                    # the same, through make

A suite is data (YAML or JSON): `question` (what the record answers), `assets` (benchmarks/make_assets.py's
arguments: the runner makes what is missing in --assets), `budget` (seconds for all runs), `defaults` and `runs`. A
run entry's strategy/precision/gpus/batch may be lists: their product becomes runs (`name` then is a template such
as "vit-base-{strategy}-b{batch}"). Paths under `bench_assets/` move to --assets. Each run is
run_image_classification.py (or, with `peer: true`, transformers' example script, benchmarks/peer.py) for a fixed
number of steps through the launcher its strategy needs: single -> python; ddp -> accelerate launch --multi_gpu (or
torchrun); every other strategy -> accelerate launch --config_file with its row of vit_recipes/plan/strategies.py. The
script's steady-state figures (warm-up skipped, meter.SpeedMeter) become the run's `metrics`. A run that fails, runs
out of memory or times out is recorded as failed with the line that says why; after an out-of-memory failure the
larger batches of that configuration are skipped. `decode: true` runs the command twice with one fresh
HF_DATASETS_CACHE ("<name>-cold" decodes, "<name>-warm" reads the cache). `as_typed: true` passes the run's `extra`
as the whole command line (a recipe as a user types it), with only the model, dataset and output folder added.

The record folder (default benchmarks/results/<date>_<suite>_<gpus>x<card>/): one JSON per run (schema below),
results.md and charts (benchmarks/report.py), and a README.md with the question, command, commit and table, whose
conclusion and headline a person writes before committing it (`python -m benchmarks.index` refuses it until then).
Logs and outputs stay out of git (.gitignore).

Run record: name, suite, status (ok/failed/skipped), failure (oom/timeout/error/plan/skipped), error, strategy,
gpus, model, per_device_batch, global_batch, precision, dataset, steps, dataloader_workers, extra_args, peer, cache,
device, command, git_commit, code_fingerprint, versions, metrics, loss_curve ([step, training loss] per log line),
wall_seconds, log, created.
"""

from __future__ import annotations

import argparse
import itertools
import json
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file: the repository root

from benchmarks import common, report  # noqa: E402
from benchmarks.common import ROOT, SCRIPT, display_command  # noqa: E402

sys.path.insert(0, str(ROOT / "src"))  # the runs use the checkout's package (common.run_env): so does the runner
from vit_recipes.plan import strategies  # noqa: E402

SUITES = ROOT / "benchmarks" / "suites"
SCHEMA_VERSION = 2
# strategy -> its accelerate config (None: launched without one), from the strategy table. ddp runs with
# `accelerate launch --multi_gpu` (or torchrun), not with the table's ddp.yaml.
STRATEGIES = {s.name: None if s.name == "ddp" else s.accelerate_config for s in strategies.STRATEGIES}
PRECISIONS = ("fp32", "bf16")
# Architectures of benchmarks/make_assets.py, by (hidden_size, num_hidden_layers, patch_size).
MODEL_TAGS = {(768, 12, 16): "vit-base", (1024, 24, 16): "vit-large", (1280, 32, 14): "vit-huge"}
RUN_KEYS = {"name", "model", "dataset", "strategy", "gpus", "batch", "steps", "precision", "workers", "timeout"}
RUN_KEYS |= {"extra", "decode", "model_tag", "dataset_tag", "launcher", "min_left", "ds_overrides", "peer", "as_typed"}
SUITE_KEYS = {"question", "assets", "budget", "defaults", "runs"}
MIN_RUN_SECONDS = 40  # with a time budget, a run is not started with less left than this
OOM_PATTERN = re.compile(r"out of memory|OutOfMemoryError|CUDA_ERROR_OUT_OF_MEMORY|Cannot allocate memory", re.I)
ERROR_PATTERN = re.compile(r"^(error: .+|[\w.]*(Error|Exception)\b.*|Killed.*|.*Signals\.SIG\w+.*)$")
NOISE = ("ChildFailedError", "torch.distributed.elastic", "subprocess.CalledProcessError", "Traceback")


class PlanError(ValueError):
    """A run or suite that cannot be built (unknown strategy, missing config file, ...)."""


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


def is_true(value) -> bool:
    return value is True or (isinstance(value, str) and value.lower() in ("true", "1", "yes"))


def _as_args(extra) -> list[str]:
    if not extra:
        return []
    return shlex.split(extra) if isinstance(extra, str) else [str(a) for a in extra]


def default_name(run: dict) -> str:
    extra = run.get("extra", [])
    suffix = "-ckpt" if is_true(flag_value(extra, "--gradient_checkpointing")) else ""
    suffix += "-compile" if is_true(flag_value(extra, "--torch_compile")) else ""
    tag = run.get("model_tag") or model_tag(run["model"])
    if run.get("peer"):
        return f"peer-{tag}-{run['precision']}-b{run['batch']}-w{run['workers']}"
    return f"{tag}-{run['strategy']}-{run['precision']}-g{run['gpus']}-b{run['batch']}{suffix}"


def normalise(run: dict, defaults: dict | None = None, assets: str | None = None) -> dict:
    """Fill defaults (an entry's extra adds to the defaults'), check values; raise PlanError on what cannot run."""
    defaults = defaults or {}
    run = {**defaults, **run, "extra": [*_as_args(defaults.get("extra")), *_as_args(run.get("extra"))]}
    if unknown := set(run) - RUN_KEYS:
        raise PlanError(f"unknown run keys: {', '.join(sorted(unknown))} (known: {', '.join(sorted(RUN_KEYS))})")
    for key in ("model", "dataset"):
        if not run.get(key):
            raise PlanError(f"a run needs '{key}'")
        made = bool(assets) and str(run[key]).startswith("bench_assets/")  # made by make_assets, maybe not yet
        if made:
            run[key] = str(Path(assets) / str(run[key]).removeprefix("bench_assets/"))
        path = Path(run[key]).expanduser()
        if not path.is_absolute() and (path.exists() or made) and Path.cwd().resolve() != ROOT:
            run[key] = str(path.resolve())  # the script runs in the repository root
    for key, value in (("strategy", "single"), ("gpus", 1), ("batch", 64), ("steps", 60), ("precision", "bf16"),
                       ("workers", 8), ("timeout", 600), ("launcher", "accelerate")):  # fmt: skip
        run.setdefault(key, value)
    for key in ("decode", "peer", "as_typed"):
        run[key] = is_true(run.get(key, False))
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
            raise PlanError("ds_overrides: a mapping of dotted DeepSpeed keys to values, e.g. "
                            "{zero_optimization.reduce_bucket_size: 5e7}")  # fmt: skip
        if strategies.BY_NAME[run["strategy"]].zero_stage is None:  # not a DeepSpeed row
            raise PlanError(f"ds_overrides: strategy {run['strategy']!r} does not use DeepSpeed")
    run["name"] = str(run.get("name") or default_name(run))
    if not re.fullmatch(r"[\w.+-]+", run["name"]):
        raise PlanError(f"run name {run['name']!r}: use letters, digits, '.', '_', '+', '-'")
    return run


def expand(entry: dict) -> list[dict]:
    """A suite entry whose strategy/precision/gpus/batch are lists becomes their cartesian product."""
    axes = [k for k in ("strategy", "precision", "gpus", "batch") if isinstance(entry.get(k), list)]
    runs = []
    for values in itertools.product(*(entry[k] for k in axes)):
        run = {**entry, **dict(zip(axes, values))}
        if axes and "name" in entry:  # a template: "core-{precision}-b{batch}"
            run["name"] = entry["name"].format(**run)
        runs.append(run)
    return runs


def suite_path(name: str) -> Path:
    """A suite's file: a name under benchmarks/suites/ ("peer") or a path."""
    path = Path(name) if name.endswith((".yaml", ".yml", ".json")) else SUITES / f"{name}.yaml"
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in SUITES.glob("*.yaml")))
        raise PlanError(f"no suite {name!r}: {path} does not exist (suites: {known})")
    return path


def load_suite(path: str | Path) -> dict:
    """The suite file as a mapping, its runs expanded (see `expand`); PlanError when it is not a suite."""
    text = Path(path).read_text()
    if str(path).endswith(".json"):
        suite = json.loads(text)
    else:
        import yaml

        suite = yaml.safe_load(text)
    if not isinstance(suite, dict) or not isinstance(suite.get("runs"), list):
        raise PlanError(f"{path}: expected a mapping with a 'runs' list")
    if unknown := set(suite) - SUITE_KEYS:
        raise PlanError(f"{path}: unknown suite keys {', '.join(sorted(unknown))} (known: {', '.join(SUITE_KEYS)})")
    if not str(suite.get("question") or "").strip():
        raise PlanError(f"{path}: a suite says what it answers in 'question'")
    return {**suite, "defaults": suite.get("defaults") or {}, "runs": [r for e in suite["runs"] for r in expand(e)]}


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
    return cmd + (["--main_process_port", str(port)] if port else [])


def script_args(run: dict, output_dir: str) -> list[str]:
    """The script's (or the peer's) arguments: a fixed number of steps, no evaluation or saving, then `extra`."""
    if run["peer"]:
        args = common.peer_args(run["model"], run["dataset"], output_dir, run["workers"])
    else:
        args = [SCRIPT, "--model_name_or_path", run["model"], "--dataset_name", run["dataset"], "--output_dir",
                output_dir, "--report_to", "none"]  # fmt: skip
        args += [] if run["as_typed"] else ["--plots", "false", "--dataloader_num_workers", str(run["workers"])]
    if run["as_typed"]:
        return args + run["extra"]
    steps = run["steps"]
    args += ["--do_train", "true", "--do_eval", "false", "--eval_strategy", "no", "--save_strategy", "no",
             "--max_steps", str(steps), "--per_device_train_batch_size", str(run["batch"]),
             "--bf16", "true" if run["precision"] == "bf16" else "false",
             "--logging_steps", str(max(1, min(50, steps // 4))), "--disable_tqdm", "true"]  # fmt: skip
    return args + run["extra"]


def build_command(run: dict, output_dir: str, port: int | None = None, ds_config_file: str | None = None) -> list[str]:
    return launch_prefix(run, port, ds_config_file) + script_args(run, output_dir)


def child_env(run: dict, names: list[str], cache_dir: str | None) -> dict[str, str]:
    env = common.run_env()
    if names:
        # The run's GPUs: the first `gpus` of those visible (a lane of a shared machine sets CUDA_VISIBLE_DEVICES).
        # A lone python process sees exactly one (the script refuses DataParallel over several).
        visible = common.visible_gpu_ids() or [str(i) for i in range(len(names))]
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
            common.kill_group(proc)
            raise
        if code is None:
            common.kill_group(proc)
    return code, time.perf_counter() - start


PER_RANK = re.compile(r"^(gpu_mem_peak_gib|gpu_mem_allocated_gib|gpu_mem_reserved_gib|cpu_peak_rss_gib)_rank(\d+)$")
PER_RANK_NAMES = {
    "gpu_mem_peak_gib": "train_peak_allocated_gib_rank",
    # Logged after the optimizer step and zero_grad: activations are freed, what stays is the model states
    # (parameters, optimizer states, persistent gradient buffers) - the part ZeRO/FSDP shard.
    "gpu_mem_allocated_gib": "train_states_allocated_gib_rank",
    "gpu_mem_reserved_gib": "train_reserved_gib_rank",
    "cpu_peak_rss_gib": "cpu_peak_rss_gib_rank",
}


def log_history(output_dir: Path) -> list[dict]:
    """The run's log lines (trainer_state.json's log_history; [] where the run wrote none)."""
    try:
        return json.loads((output_dir / "trainer_state.json").read_text()).get("log_history", [])
    except (OSError, ValueError):
        return []


def loss_curve(history: list[dict]) -> list[list[float]]:
    """[step, training loss] of each training log line: what a numerics comparison sets side by side."""
    return [
        [entry["step"], round(float(entry["loss"]), 5)] for entry in history if "loss" in entry and "step" in entry
    ]


def per_rank_memory(history: list[dict]) -> dict:
    """Memory of every rank, from the per-step logs (meter.SpeedMeter): the largest logged value per rank, plus
    train_peak_allocated_gib_max_rank and train_states_allocated_gib_max_rank."""
    out: dict[str, float] = {}
    for entry in history:
        for key, value in entry.items():
            match = PER_RANK.match(key)
            if match and isinstance(value, (int, float)):
                name = PER_RANK_NAMES[match.group(1)] + match.group(2)
                out[name] = max(out.get(name, 0.0), round(float(value), 3))
    for prefix in ("train_peak_allocated_gib", "train_states_allocated_gib"):
        if values := [v for k, v in out.items() if k.startswith(prefix + "_rank")]:
            out[prefix + "_max_rank"] = max(values)
    return out


def base_record(run: dict, suite: str, context: dict) -> dict:
    extra = run["extra"]
    accumulation = int(flag_value(extra, "--gradient_accumulation_steps") or 1)
    return {
        "schema_version": SCHEMA_VERSION, "name": run["name"], "suite": suite, "status": "skipped", "failure": None,
        "error": None, "strategy": run["strategy"], "gpus": run["gpus"],
        "model": run.get("model_tag") or model_tag(run["model"]), "model_path": run["model"],
        "per_device_batch": run["batch"], "global_batch": run["batch"] * run["gpus"] * accumulation,
        "precision": run["precision"], "gradient_checkpointing": is_true(flag_value(extra, "--gradient_checkpointing")),
        "torch_compile": is_true(flag_value(extra, "--torch_compile")),
        "dataset": run.get("dataset_tag") or Path(run["dataset"].rstrip("/")).name, "dataset_path": run["dataset"],
        "steps": run["steps"], "dataloader_workers": run["workers"], "extra_args": extra,
        "ds_overrides": run.get("ds_overrides"), "peer": run["peer"], "as_typed": run["as_typed"], "cache": None,
        "device": context["device"], "device_memory_gib": context["device_memory_gib"], "command": None,
        "git_commit": context["git_commit"], "code_fingerprint": context["code_fingerprint"],
        "versions": context["versions"], "metrics": {}, "wall_seconds": None, "log": None,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }  # fmt: skip


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
    keep = keep_output or flag_value(run["extra"], "--profile_steps") is not None
    output_dir = results / "outputs" / run["name"] if keep else work / "out"
    if keep:
        shutil.rmtree(output_dir, ignore_errors=True)  # the script refuses a folder holding a finished run
    try:
        ds_config_file = None
        if run.get("ds_overrides"):  # kept next to the log: the record says exactly what ran
            ds_path = logs / f"{run['name']}.ds_config.json"
            common.write_json(ds_path, deepspeed_config(run))
            ds_config_file, record["ds_config"] = str(ds_path), str(ds_path.relative_to(results))
        port = common.free_port() if run["strategy"] != "single" else None
        argv = build_command(run, str(output_dir), port, ds_config_file)
        record["command"] = display_command(argv)
        code, seconds = run_process(argv, child_env(run, context["gpu_names"], cache_dir), log_path, run["timeout"])
        record["wall_seconds"] = round(seconds, 2)
        results_file = output_dir / "all_results.json"
        if code == 0 and results_file.is_file():
            metrics = json.loads(results_file.read_text())
            if run["peer"]:
                record["peer_transforms"] = metrics.get("peer_transforms")
            metrics = {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
            record["metrics"] = metrics
            report.fill_derived(record)  # steady-state batches/s and per-GPU images/s, from what the script measured
            history = log_history(output_dir)
            metrics.update(per_rank_memory(history))
            record["loss_curve"] = loss_curve(history)
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
    return common.write_json(results / f"{record['name']}.json", record)


def one_line(record: dict) -> str:
    m = record["metrics"]
    if record["status"] != "ok":
        return f"{record['status'].upper()} ({record['failure']}): {record['error']}"
    parts = [f"{m['train_images_per_second']:,.0f} img/s", f"step {1000 * m['train_step_time_s']:.0f} ms"]
    if "train_peak_allocated_gib" in m:
        parts.append(f"peak {m['train_peak_allocated_gib']:.1f} GiB")
    parts.append(f"data wait {100 * m.get('train_data_wait_fraction', 0):.1f}%")
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


def machine_context() -> dict:
    gpus = common.gpu_info()
    return {"gpu_names": [name for name, _ in gpus], "device": common.device_description(gpus),
            "device_memory_gib": gpus[0][1] if gpus else None, "git_commit": common.git_commit(),
            "code_fingerprint": common.code_fingerprint(Path(__file__)), "versions": common.library_versions()}  # fmt: skip


def run_all(runs: list[dict], results: Path, suite: str, budget: float | None = None, skip_existing: bool = False,
            keep_output: bool = False, stop_after_oom: bool = True, context: dict | None = None) -> list[dict]:  # fmt: skip
    context = context or machine_context()
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
                why = f"out of memory at batch {oom['batch']}" if oom else f"time budget spent ({max(left, 0):.0f} s " \
                      f"of {budget:.0f} s left)"  # fmt: skip
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


def make_assets(spec, folder: str) -> None:
    """benchmarks/make_assets.py with the suite's `assets` arguments: what is missing in `folder` is made."""
    if args := _as_args(spec):
        script = ROOT / "benchmarks" / "make_assets.py"
        subprocess.run([sys.executable, str(script), "--out", folder, *args], check=True)


# --------------------------------------------------------------------------------------------------- CLI
def parse_cli(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("suite", nargs="?", help="a suite's name under benchmarks/suites/ (e.g. peer), or a file")
    parser.add_argument("--list", action="store_true", help="list the suites and their questions")
    parser.add_argument("--out", default=None, help="record folder (default benchmarks/results/<date>_<suite>_"
                        "<gpus>x<card>)")  # fmt: skip
    parser.add_argument("--assets", default="bench_assets", help="where the suite's assets are made and read")
    parser.add_argument("--gpus", type=int, default=None, help="every run's GPU count (a suite default)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a suite default, e.g. --set steps=20 --set extra='--use_cpu true' (YAML values)")  # fmt: skip
    parser.add_argument("--only", default=None, help="run only the runs whose name matches this regex")
    parser.add_argument("--budget", type=float, default=None, help="seconds for all runs; later runs are skipped")
    parser.add_argument("--skip-existing", action="store_true", help="keep records that already succeeded")
    parser.add_argument("--keep-output", action="store_true", help="keep output_dir (weights, traces) per run")
    parser.add_argument("--no-stop-after-oom", action="store_true", help="also run larger batches after an OOM")
    parser.add_argument("--dry-run", action="store_true", help="print the commands, make and run nothing")
    args = parser.parse_args(argv)
    if not args.list and not args.suite:
        parser.error("name a suite (python -m benchmarks.run --list shows them)")
    return args


def plan(args: argparse.Namespace) -> tuple[dict, list[dict]]:
    """The suite and its runs, with the command line's overrides (suite defaults < --set/--gpus < entry)."""
    import yaml

    suite = load_suite(suite_path(args.suite))
    overrides = {}
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep:
            raise PlanError(f"--set {item!r}: use KEY=VALUE")
        overrides[key] = value if key == "extra" else yaml.safe_load(value)
    if args.gpus is not None:
        overrides["gpus"] = args.gpus
    defaults = {**suite["defaults"], **overrides}
    runs = [
        normalise({k: v for k, v in r.items() if k not in overrides}, defaults, args.assets) for r in suite["runs"]
    ]
    if args.only and not (runs := [r for r in runs if re.search(args.only, r["name"])]):
        raise PlanError(f"no run name matches --only {args.only!r}")
    names = [r["name"] for r in runs]
    if duplicated := sorted({n for n in names if names.count(n) > 1}):
        raise PlanError(f"duplicate run names: {', '.join(duplicated)}")
    return suite, runs


def list_suites() -> None:
    for path in sorted(SUITES.glob("*.yaml")):
        try:
            question = load_suite(path)["question"]
        except PlanError as err:
            question = f"(cannot run: {err})"
        print(f"{path.stem:20} {' '.join(str(question).split())}")


def write_readme(folder: Path, name: str, suite: dict, records: list[dict], argv: list[str]) -> None:
    """results.md and charts (benchmarks/report.py) and the record's README.md (common.start_readme)."""
    rows = report.table_records([folder])
    if rows:
        report.write_report(rows, folder, f"{name}: {' '.join(str(suite['question']).split())}")
    command = " ".join(["python -m benchmarks.run", *map(shlex.quote, argv)])
    device = records[0]["device"] if records else "unknown"
    table = report.summary_table(rows) + "\n\nEvery run, its command and the charts: [results.md](results.md)."
    common.start_readme(folder, name, " ".join(str(suite["question"]).split()), command, table, device)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_cli(argv)
    if args.list:
        list_suites()
        return 0
    try:
        suite, runs = plan(args)
    except PlanError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    name = suite_path(args.suite).stem
    if args.dry_run:
        for run in runs:
            try:
                ds_file = f"<results>/logs/{run['name']}.ds_config.json" if run.get("ds_overrides") else None
                command = display_command(build_command(run, "<output_dir>", ds_config_file=ds_file))
            except PlanError as err:
                command = f"(cannot run: {err})"
            print(f"{run['name']}{' [decode cold+warm]' if run['decode'] else ''}: {command}")
        return 0
    make_assets(suite.get("assets"), args.assets)
    context = machine_context()
    gpus = max(r["gpus"] for r in runs)
    folder = Path(args.out) if args.out else common.record_folder(name, gpus, context["device"])
    records = run_all(runs, folder, name, budget=args.budget or suite.get("budget"),
                      skip_existing=args.skip_existing, keep_output=args.keep_output,
                      stop_after_oom=not args.no_stop_after_oom, context=context)  # fmt: skip
    write_readme(folder, name, suite, records, argv)
    ok = sum(r["status"] == "ok" for r in records)
    print(f"{ok}/{len(records)} runs ok; record: {folder}/README.md (write its conclusion and headline)")
    return 0 if ok == len(records) else 1


if __name__ == "__main__":
    sys.exit(main())

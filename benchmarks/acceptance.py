"""The GPU acceptance suite: what "done" means for any change to training, strategies, checkpoints, data or speed.

    make test-gpu                                          # every part on every visible GPU
    python benchmarks/acceptance.py --parts strategies,kill,resume     # some parts (two calls fit a 10-minute limit)
    python benchmarks/acceptance.py --parts single,vith --record DIR   # ...merged into the same record

Runs the script as a user types it, through both launchers and every shipped strategy, on local stand-ins for the
Hub (CIFAR-100-shaped PNGs, randomly initialised ViT-B/16 and ViT-H/14), then checks what each run wrote:

- strategies: DDP, ZeRO-1/2/3, ZeRO++, FSDP2 and FSDP2 + offload, 30 steps at one seed and global batch: the loss at
  step 30 within LOSS_TOLERANCE of DDP's, the rank reports (world size, wrapper, ZeRO stage, what is sharded), and the
  saved model reloaded with pipeline() scoring within SCORE_TOLERANCE of the run's own test accuracy. ZeRO-2 runs as
  the README types it (`deepspeed run_image_classification.py --deepspeed ds_configs/zero2.json --config ...`);
- kill: DDP, ZeRO-2, ZeRO-3, FSDP2 killed with SIGKILL (every process of the run: torchrun starts each worker in a
  session of its own, so killing the launcher's process group leaves them training) once checkpoint-10 is complete,
  then the same command again: it resumes from checkpoint-10 and ends on the uninterrupted run's weights
  (WEIGHT_TOLERANCE); DDP (torchrun) and ZeRO-2 (deepspeed) get SIGTERM instead once checkpoint-10 is complete: one
  line `interrupted at step N; checkpoint-N saved`, and the same command resumes from checkpoint-N to those weights;
- resume: DDP, ZeRO-1, ZeRO-2, FSDP2 checkpoints resumed on another GPU count (all -> 1 and 1 -> all, global batch
  kept): steps 11-30 within LOSS_TOLERANCE of the uninterrupted run's; ZeRO-3 on another count: its one-line refusal;
- single (one GPU): the default command (short: eager, one line says why), --torch_compile_regions true (CUDA graphs,
  one line says so, the eager run's loss at step 30), the fine-tuning levers together, --patch_dropout 0.5, LoRA
  (saved, merged, reloaded), multi-label, --class_weights balanced, predict-only from a trained folder, TE FP8 (where
  transformer_engine imports);
- data: photos (JPEGs of 400-520 px) decoded per batch, and a stream of unequal parquet shards (--streaming), each
  under DDP and ZeRO-2 on every GPU: the log says which path, each killed (SIGKILL) after checkpoint-10 and resumed
  by the same command to the uninterrupted run's weights, pipeline() scores the saved models; and a copy of a few
  photos with a real collection's odd files (build_odd_asset) under DDP: three unreadable validation images as one
  evaluation batch are left out of the scores on every process count, and the card, log and skipped_images.json
  say what was left out, replaced and noted;
- vith: the README's `accelerate launch --config_file accelerate_configs/zero3.yaml` command with the ViT-H recipe on
  every GPU, and the same command without --num_processes (on fewer than 8 GPUs: those GPUs train, one line
  says so).

Jobs run concurrently, up to --per_gpu processes on each GPU (a ViT-B run at these batches uses a few GiB), so the
start-up of one overlaps another's steps. One-GPU jobs share the GPUs. Writes `<record>/acceptance.md` (one
PASS/FAIL/SKIP line per check with the command that produced it, the commit, the library versions) and
`acceptance.json`; a record already in that folder keeps the parts not run now. Logs and outputs stay in --work.
`--cpu` runs the same plan on CPU processes with a tiny ViT (no FSDP, no GPU checks): a check of the suite itself.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT)]  # run as a file (make test-gpu): the package and benchmarks/

from benchmarks import common  # noqa: E402
from vit_recipes.plan.memory import AUTOCAST  # noqa: E402
from vit_recipes.plan.strategies import BY_NAME  # noqa: E402

PARTS = ("strategies", "kill", "resume", "single", "vith", "data")
DATA = {"photos": (), "stream": ("--streaming", "true", "--shuffle_buffer_size", "0")}  # the data part's sources
# The data part's folder of odd files (build_odd_asset): the unreadable ones by split, as skipped_images.json names
# them (training replaces its, evaluation leaves its out); the validation three sort first, as one evaluation batch.
ODD_UNREADABLE = {"train": ["broken.jpg"], "validation": ["0-a.jpg", "0-b.jpg", "0-c.jpg"]}
ODD_EVAL_BATCH = len(ODD_UNREADABLE["validation"])
STEPS, SAVE_EVERY, GLOBAL_BATCH = 30, 10, 64
# bf16 autocast over 30 steps: other reduction orders (sharding, another process count) move the per-step loss by
# up to ~1% here; a wrong resume, a missed gradient or a lost optimizer state moves it by far more (tens of %).
LOSS_TOLERANCE = 0.03  # relative
# pipeline() scores in fp32 from PIL-preprocessed images, the run in bf16 from its GPU transform: after 30 steps (40%
# accuracy, many near-ties) a few of 1,000 images flip. Measured: up to 0.3 points on H100s; on H200s the `default`
# job 0.7 points in three calls at three commits, with bit-identical weights. A wrong resize, normalisation or label
# map costs tens of points.
SCORE_TOLERANCE = 0.01  # test accuracy, pipeline() vs the run's own evaluation (1 point)
WEIGHT_TOLERANCE = 2e-2  # max |w_resumed - w_uninterrupted|; bf16 SDPA backward kernels are not bitwise deterministic
RECIPE_B, RECIPE_H = "recipes/vit-base/cifar100/config_full.yaml", "recipes/vit-huge/cifar100/config_full.yaml"
# The strategy runs: name -> (launcher, shipped config, rank report expectations)
STRATEGY_RUNS = {
    "ddp": ("accelerate", "DistributedDataParallel"),
    "zero1": ("deepspeed", "DeepSpeedEngine"),
    "zero2": ("deepspeed", ""),  # the README's command: the script itself, no rank report
    "zero3": ("accelerate", "DeepSpeedEngine"),
    "zeropp": ("accelerate", "DeepSpeedEngine"),
    "fsdp2": ("accelerate", "FSDP"),
    "fsdp2_offload": ("accelerate", "FSDP"),
}
# The same runs under the recipe's own warm-up (its first STEPS steps: learning rates of at most 6e-6), where a
# strategy that keeps bf16 weights (DeepSpeed's bf16 mode) loses the small updates that DDP's fp32 weights keep:
# benchmarks/results/2026-11-27_zero_precision_2xH200 measured ZeRO-2/3 up to 8% above DDP's loss there.
WARM_STEPS = 400  # vit_recipes.plan.plan.COMPILE_PAYS_AFTER_STEPS_WARM: a run this long compiles from a warm cache
WARMUP = ("ddp", "zero2", "zero3", "zeropp", "fsdp2")
WARMUP_ARGS = ("--warmup_steps", "500", "--lr_scheduler_type", "cosine", "--save_strategy", "no")
KILLED = ("ddp", "zero2", "zero3", "fsdp2")
SIGNALLED = ("ddp", "zero2")  # SIGTERM through each launcher: torchrun forwards it, DeepSpeed's workers get it too
CROSS_COUNT = ("ddp", "zero1", "zero2", "fsdp2")


@dataclass
class Job:
    """One process tree to launch: a run of the script, a score of its model, or an asset to build."""

    name: str
    part: str
    argv: list[str]
    gpus: int = 0  # 0: CPU only; 1: one GPU (shared); n: all n GPUs
    needs: tuple[str, ...] = ()
    output: Path | None = None  # the run's --output_dir
    seed_from: Path | None = None  # copy this checkpoint (and its run's run_config.json) into output first
    kill_when: Path | None = None  # SIGKILL every process of the run once this file exists
    term_when: Path | None = None  # SIGTERM the launcher's process group once this file exists (as scancel does)
    soft: bool = False  # runs once its needs have ended, whether they succeeded or not
    timeout: int = 420
    result: dict = field(default_factory=dict)


def kill_tree(pid: int) -> list[int]:
    """SIGKILL a process and every descendant, each in whatever process group or session it runs (torchrun starts
    its workers with start_new_session, so killpg of the launcher alone leaves them training). Returns the pids."""
    import psutil  # accelerate's dependency

    root = _process(pid)
    if root is None:
        return []
    procs = [root, *_children(pid)]  # listed first: a killed parent's children are reparented
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)  # anything the launcher's group started meanwhile
    return [p.pid for p in procs]


class Suite:
    def __init__(self, args, gpus: int):
        self.args, self.gpus, self.cpu = args, gpus, args.cpu
        self.work, self.assets = Path(args.work), Path(args.work) / "assets"
        self.procs = gpus  # processes of a multi-process run: every GPU (CPU: 2)
        self.jobs: dict[str, Job] = {}
        self.running: dict = {}  # name -> (process, start time, GPUs placed on), while run() runs
        self.python = sys.executable
        self.t0 = time.time()

    # ---------------------------------------------------------------------------------------------- commands
    def accelerate(self, config: str, processes: int, script: str) -> list[str]:
        cli = shutil.which("accelerate")
        base = [cli] if cli else [self.python, "-m", "accelerate.commands.accelerate_cli"]
        return [*base, "launch", "--main_process_port", "{port}", "--config_file", config, "--num_processes",
                str(processes), script]  # fmt: skip

    def deepspeed(self, config: str, processes: int, script: str) -> list[str]:
        cli = shutil.which("deepspeed")
        base = [cli] if cli else [self.python, "-m", "deepspeed.launcher.runner"]
        # As the README types it on a machine whose GPUs are all used; --num_gpus otherwise (CPU, or 1 of several).
        count = [] if (processes == self.gpus and not self.cpu) else ["--num_gpus", str(processes)]
        return [*base, "--master_port", "{port}", *count, script, "--deepspeed", config]

    def launch(self, strategy: str, processes: int, script: str) -> list[str]:
        spec = BY_NAME[strategy]
        launcher = STRATEGY_RUNS.get(strategy, ("accelerate", ""))[0]
        if launcher == "deepspeed":
            return self.deepspeed(spec.deepspeed_config, processes, script)
        config = spec.accelerate_config
        if strategy == "zeropp":  # hpZ's secondary partition spans one node's GPUs: this machine's, not the shipped 8
            config = str(self.zeropp_config(processes))
        return self.accelerate(config, processes, script)

    def zeropp_config(self, processes: int) -> Path:
        import yaml

        ds = json.loads((ROOT / BY_NAME["zeropp"].deepspeed_config).read_text())
        ds["zero_optimization"]["zero_hpz_partition_size"] = processes
        (self.work / "zeropp.json").write_text(json.dumps(ds, indent=2))
        acc = yaml.safe_load((ROOT / BY_NAME["zeropp"].accelerate_config).read_text())
        acc["deepspeed_config"]["deepspeed_config_file"] = str(self.work / "zeropp.json")
        path = self.work / f"zeropp_{processes}.yaml"
        path.write_text(yaml.safe_dump(acc))
        return path

    def run_args(self, out: Path, processes: int, model: str = "vit-base-100", recipe: str = RECIPE_B) -> list[str]:
        """The recipe as a user types it, on the local stand-ins, shortened to STEPS steps with a checkpoint every
        SAVE_EVERY; a constant learning rate (the recipe warms up over 500 steps) and no random crop or flip, so that
        runs on different process counts see the same pixels and their losses compare."""
        args = [
            "--config", recipe, "--dataset_name", str(self.assets / "cifar100"),
            "--model_name_or_path", str(self.assets / model), "--output_dir", str(out),
            "--max_steps", str(STEPS), "--per_device_train_batch_size", str(GLOBAL_BATCH // processes),
            "--per_device_eval_batch_size", "128", "--warmup_steps", "0", "--lr_scheduler_type", "constant",
            "--crop_scale_min", "1", "--hflip_prob", "0", "--logging_steps", "1", "--eval_strategy", "no",
            "--save_strategy", "steps", "--save_steps", str(SAVE_EVERY), "--save_total_limit", "3",
            "--report_to", "none", "--plots", "false", "--dataloader_num_workers", "2",
        ]  # fmt: skip
        return args + (["--use_cpu", "true"] if self.cpu else [])

    def add(self, job: Job) -> Job:
        self.jobs[job.name] = job
        return job

    def training(self, name: str, part: str, strategy: str, processes: int, out: Path | None = None,
                 extra: tuple[str, ...] = (), report: bool = True, **kw) -> Job:  # fmt: skip
        out = out or self.work / name
        launcher = kw.pop("launcher", False)  # one process through the strategy's launcher (else plain python)
        # tools/rank_report.py: the script plus a report of what each rank trained with (wrapper, shards)
        script = "tools/rank_report.py" if report and STRATEGY_RUNS.get(strategy, ("", ""))[1] else (
            "run_image_classification.py")  # fmt: skip
        if processes == 1 and strategy in ("single", "ddp") and not launcher:
            argv = [self.python, script]
        else:
            argv = self.launch(strategy, processes, script)
        argv += self.run_args(out, processes) + list(extra)
        if part != "single":  # regional compilation is the default command's check; these compare numerics
            argv += ["--torch_compile_regions", "false"]
        gpus = 0 if self.cpu else processes
        return self.add(Job(name, part, argv, gpus=gpus, output=out, **kw))

    def score(self, runs: list[str], part: str) -> Job:
        """pipeline() on each saved model over the test split, in one fresh process on one GPU (one import)."""
        models = ",".join(str(self.jobs[r].output) for r in runs)
        argv = [self.python, str(Path(__file__).relative_to(ROOT)), "--score", models, "--work", str(self.work)]
        job = Job(f"score-{part}", part, argv + (["--cpu"] if self.cpu else []), gpus=0 if self.cpu else 1,
                  needs=tuple(runs), soft=True)  # fmt: skip
        return self.add(job)

    # -------------------------------------------------------------------------------------------------- plan
    def plan(self, parts: list[str], only: set[str] | None = None) -> None:
        n = self.procs
        # CPU processes (--cpu): no FSDP (GPUs only) and no ZeRO++ (quantized collectives need NCCL)
        strategies = [s for s in STRATEGY_RUNS if not (self.cpu and s.startswith(("fsdp", "zeropp")))]
        cpu_ok = [s for s in KILLED if s in strategies]
        for s in strategies:
            self.training(s, "strategies", s, n)
        if "strategies" in parts:
            self.score(strategies, "strategies")
            for s in [s for s in WARMUP if s in strategies]:
                self.training(f"warmup-{s}", "strategies", s, n, report=False, extra=WARMUP_ARGS)
        if "kill" in parts:
            for s in cpu_ok:
                out = self.work / f"kill-{s}"
                killed = self.training(f"kill-{s}", "kill", s, n, out=out, report=False)
                killed.kill_when = out / f"checkpoint-{SAVE_EVERY}" / "run_identity.json"
                # needs the uninterrupted run too: the final weights are compared with its own
                self.training(f"resume-{s}", "kill", s, n, out=out, report=False, needs=(killed.name, s))
            for s in [s for s in SIGNALLED if s in strategies]:
                out = self.work / f"term-{s}"
                stopped = self.training(f"term-{s}", "kill", s, n, out=out, report=False)
                stopped.term_when = out / f"checkpoint-{SAVE_EVERY}" / "run_identity.json"
                self.training(f"resume-term-{s}", "kill", s, n, out=out, report=False, needs=(stopped.name, s),
                              soft=True)  # fmt: skip
        if "resume" in parts and (n > 1 or self.cpu):
            for s in [s for s in CROSS_COUNT if s in strategies]:
                # all -> 1: the uninterrupted run's checkpoint, resumed by the same command on one GPU
                self.training(f"to1-{s}", "resume", s, 1, needs=(s,), seed_from=self.work / s, launcher=True)
                # 1 -> all: a one-GPU run, and its checkpoint resumed on every GPU
                self.training(f"one-{s}", "resume", s, 1, launcher=True)
                self.training(f"from1-{s}", "resume", s, n, needs=(f"one-{s}",), seed_from=self.work / f"one-{s}")
            self.training("to1-zero3", "resume", "zero3", 1, needs=("zero3",), seed_from=self.work / "zero3",
                          launcher=True)  # fmt: skip
        if "single" in parts:
            self.plan_single()
        if "vith" in parts:
            self.plan_vith()
        if "data" in parts:
            self.plan_data()
        wanted = {name for name, job in self.jobs.items() if job.part in parts and (not only or name in only)}
        while True:  # keep what the wanted jobs need
            more = {d for name in wanted for d in self.jobs[name].needs} - wanted
            if not more:
                break
            wanted |= more
        self.jobs = {name: job for name, job in self.jobs.items() if name in wanted}

    def plan_single(self) -> None:
        one = dict(part="single", strategy="single", processes=1)
        self.training("default", **one)
        # Regional compilation: a short default run stays eager (it would not repay the compile); asked for, it compiles
        self.training("compiled", **one, extra=("--torch_compile_regions", "true"))
        # ... and the default command again, long enough to repay a compile from the cache that run filled
        again = ("--max_steps", str(WARM_STEPS), "--save_strategy", "no")
        self.training("default-again", **one, extra=again, needs=("compiled",))
        self.training("patch-dropout", **one, extra=("--patch_dropout", "0.5"))
        self.training("lora", **one, extra=("--use_peft", "true", "--merge_adapter", "true"))
        # The fine-tuning levers together: the saved model is the EMA of the weights, a plain one pipeline() reloads
        levers = (
            "--layer_decay",
            "0.75",
            "--drop_path_rate",
            "0.1",
            "--ema_decay",
            "0.99",
            "--random_erasing",
            "0.25",
        )
        self.training("levers", **one, extra=levers)
        self.score(["default", "patch-dropout", "lora", "levers"], "single")
        self.training("class-weights", **one, extra=("--class_weights", "balanced"))
        labels = self.training("multi-label", **one)
        i = labels.argv.index("--dataset_name") + 1
        labels.argv[i] = str(self.assets / "cifar100-multilabel")
        out = self.work / "predict-only"
        argv = [self.python, "run_image_classification.py", "--model_name_or_path", str(self.work / "default"),
                "--do_predict", "true", "--predict_images", str(self.assets / "predict"), "--output_dir", str(out),
                "--report_to", "none"] + (["--use_cpu", "true"] if self.cpu else [])  # fmt: skip
        self.add(Job("predict-only", "single", argv, gpus=0 if self.cpu else 1, needs=("default",), output=out))
        if not self.cpu and importable("transformer_engine"):
            self.training("te-fp8", **one, extra=("--fp8", "true", "--fp8_backend", "transformer_engine"))

    def plan_vith(self) -> None:
        model = "vit-tiny" if self.cpu else "vit-huge"
        for name, count in (("vith", ["--num_processes", str(self.procs)]), ("vith-as-typed", [])):
            out = self.work / name
            argv = self.accelerate(BY_NAME["zero3"].accelerate_config, self.procs, "run_image_classification.py")
            if not count:
                i = argv.index("--num_processes")
                del argv[i : i + 2]
            argv += self.run_args(out, self.procs, model=model, recipe=RECIPE_H)
            argv += ["--max_steps", "10", "--save_strategy", "no", "--per_device_train_batch_size", "16",
                     "--gradient_accumulation_steps", "1"]  # fmt: skip
            if name == "vith-as-typed" and (self.procs >= 8 or self.cpu):
                continue  # the shipped num_processes (8) fits: the first run covers it
            self.add(Job(name, "vith", argv, gpus=0 if self.cpu else self.procs, output=out))
        if "vith" in self.jobs:
            self.score(["vith"], "vith")

    def plan_data(self) -> None:
        for source, flags in DATA.items():
            extra = ("--dataset_name", str(self.assets / source), *flags)
            if self.cpu and source == "photos":  # vit-tiny's 32 px would decode the photos once (~37 px, under 2x
                extra += ("--storage_size", "256")  # their bytes); at ViT-B's 256 px auto decodes them per batch
            for s in ("ddp", "zero2"):
                self.training(f"{source}-{s}", "data", s, self.procs, extra=extra, report=False)
            out = self.work / f"kill-{source}"
            killed = self.training(f"kill-{source}", "data", "ddp", self.procs, out=out, extra=extra, report=False)
            killed.kill_when = out / f"checkpoint-{SAVE_EVERY}" / "run_identity.json"
            self.training(f"resume-{source}", "data", "ddp", self.procs, out=out, extra=extra, report=False,
                          needs=(killed.name, f"{source}-ddp"))  # fmt: skip
        self.score(["photos-ddp", "stream-ddp"], "data")
        odd = ("--dataset_name", str(self.assets / "odd"), "--decode_images", "per_batch",
               "--per_device_eval_batch_size", str(ODD_EVAL_BATCH), "--save_strategy", "no")  # fmt: skip
        self.training("odd-ddp", "data", "ddp", self.procs, extra=odd, report=False)

    # --------------------------------------------------------------------------------------------------- run
    def run(self) -> None:
        pending = dict(self.jobs)
        running = self.running
        load = [0] * max(self.gpus, 1)
        capacity = self.args.per_gpu if not self.cpu else 1
        while pending or running:
            for name, (proc, start, placed) in list(running.items()):
                job = self.jobs[name]
                if job.kill_when and job.kill_when.exists() and proc.poll() is None and "killed_at" not in job.result:
                    job.result["killed_pids"] = kill_tree(proc.pid)  # a crash of the whole machine's share of the run
                    job.result["killed_at"] = sorted(p.name for p in job.output.glob("checkpoint-*"))
                    self.log(f"{name}: SIGKILL once {job.kill_when.parent.name} was complete")
                if job.term_when and job.term_when.exists() and proc.poll() is None and "term_pids" not in job.result:
                    job.result["term_pids"] = [proc.pid, *(c.pid for c in _children(proc.pid))]
                    os.killpg(proc.pid, signal.SIGTERM)  # the workers save at the next step end, then stop
                    self.log(f"{name}: SIGTERM once {job.term_when.parent.name} was complete")
                timeout = time.time() - start > job.timeout or self.over_budget()
                if timeout:
                    kill_tree(proc.pid)
                if proc.poll() is not None or timeout:
                    proc.wait()
                    if "term_pids" in job.result:  # a launcher may end before its workers finish their save
                        import psutil

                        psutil.wait_procs([p for p in map(_process, job.result["term_pids"]) if p], timeout=120)
                        job.result.update(_left_on_disk(job.output, "term"))
                    if "killed_pids" in job.result:  # what a killed run left: every process gone, nothing written
                        time.sleep(1)
                        job.result["alive_after_kill"] = [pid for pid in job.result["killed_pids"] if _alive(pid)]
                        job.result.update(_left_on_disk(job.output, "kill"))
                    job.result.update(exit="timeout" if timeout else proc.returncode,
                                      seconds=round(time.time() - start, 1))  # fmt: skip
                    for g in placed:
                        load[g] -= 1
                    del running[name]
                    self.log(f"{name}: exit {job.result['exit']} in {job.result['seconds']}s")
                    self.trim_finished(pending)
            for name, job in list(pending.items()):
                if self.over_budget():
                    job.result.update(exit="not run", reason=f"the {self.args.budget} s budget ran out")
                    del pending[name]
                    continue
                if any(d in pending or d in running for d in job.needs):
                    continue
                failed = [d for d in job.needs if self.jobs[d].result.get("exit") not in (0, -9)]
                if failed and not job.soft:
                    job.result.update(exit="not run", reason=f"{failed[0]} failed")
                    del pending[name]
                    continue
                placed = self.place(job, load, capacity)
                if placed is None:
                    continue
                for g in placed:
                    load[g] += 1
                running[name] = (self.start(job, placed), time.time(), placed)
                del pending[name]
            time.sleep(0.1)

    def trim_finished(self, pending: dict) -> None:
        """Trim the checkpoints of each passed run that no job left resumes in or copies from (trim_checkpoints): the
        ~40 runs of every part, their checkpoints kept to the end, filled a 128 GB disk in one call."""
        left = [self.jobs[n] for n in [*pending, *self.running]]
        busy = {job.output for job in left} | {job.seed_from for job in left}
        for job in self.jobs.values():
            if job.output and job.output not in busy and job.result.get("exit") == 0 and "trimmed" not in job.result:
                job.result["trimmed"] = trim_checkpoints(job.output)

    def over_budget(self) -> bool:
        return self.args.budget is not None and time.time() - self.t0 > self.args.budget

    def place(self, job: Job, load: list[int], capacity: int) -> list[int] | None:
        if job.gpus == 0:  # CPU jobs: side by side on a GPU machine, one at a time with --cpu
            busy = len(self.running) if self.cpu else 0
            return [] if busy < capacity else None
        if job.gpus >= len(load):
            return list(range(len(load))) if max(load) < capacity else None
        free = sorted(range(len(load)), key=lambda g: load[g])[: job.gpus]
        return free if all(load[g] < capacity for g in free) else None

    def start(self, job: Job, placed: list[int]) -> subprocess.Popen:
        if job.seed_from is not None and job.output is not None and not job.output.exists():
            checkpoint = job.seed_from / f"checkpoint-{SAVE_EVERY}"
            job.output.mkdir(parents=True)
            shutil.copytree(checkpoint, job.output / checkpoint.name)
            shutil.copy(job.seed_from / "run_config.json", job.output / "run_config.json")
        env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
        # The suite's own compile cache, empty at its start: compile times are cold even on a machine that ran it
        env["TORCHINDUCTOR_CACHE_DIR"] = str(self.work / "compile-cache")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
        if placed and len(placed) < self.gpus:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(self.gpu_ids[g] for g in placed)
        # Jobs side by side: torch's default of one thread per core in each would oversubscribe the CPUs many times.
        jobs_at_once = 1 if self.cpu else self.args.per_gpu * self.gpus
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // jobs_at_once)))
        # Each job its own rendezvous port (jobs run side by side).
        argv = [str(common.free_port()) if a == "{port}" else a for a in job.argv]
        if "--num_gpus" in argv and placed and len(placed) < self.gpus:
            # DeepSpeed's launcher ignores CUDA_VISIBLE_DEVICES once --num_gpus is given: name the GPUs instead.
            i = argv.index("--num_gpus")
            argv[i : i + 2] = ["--include", "localhost:" + ",".join(self.gpu_ids[g] for g in placed)]
            del env["CUDA_VISIBLE_DEVICES"]
        shown = [a for i, a in enumerate(job.argv) if "{port}" not in job.argv[i : i + 2]]  # the port flag too
        job.result["command"] = " ".join(map(self.shown, shown))
        log = open(self.work / "logs" / f"{job.name}.log", "w")  # noqa: SIM115 (closed with the process)
        self.log(f"{job.name}: start on {'GPU ' + ','.join(map(str, placed)) if placed else 'CPU'}")
        return subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def shown(self, arg: str) -> str:
        """Commands as a user types them: the work folder as $WORK, the launchers by name."""
        arg = arg.replace(str(self.work), "$WORK")
        return Path(arg).name if arg.endswith(("/accelerate", "/deepspeed", "/python3", "/python")) else arg

    def log(self, message: str) -> None:
        print(f"[acceptance +{time.time() - self.t0:.0f}s] {message}", flush=True)

    @property
    def gpu_ids(self) -> list[str]:
        return common.visible_gpu_ids() or [str(i) for i in range(self.gpus)]


# ------------------------------------------------------------------------------------------------------ checks
def _process(pid: int):
    import psutil

    try:
        return psutil.Process(pid)
    except psutil.NoSuchProcess:
        return None


def _children(pid: int) -> list:
    process = _process(pid)
    return process.children(recursive=True) if process else []


def _alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _left_on_disk(output: Path, stop: str) -> dict:
    """The checkpoints, and whether results, a stopped run's folder holds once its processes are gone."""
    checkpoints = sorted(p.name for p in output.glob("checkpoint-*"))
    return {f"after_{stop}": checkpoints, f"results_after_{stop}": (output / "all_results.json").exists()}


def _json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def losses(out: Path) -> dict[int, float]:
    history = _json(out / "trainer_state.json").get("log_history", [])
    return {e["step"]: e["loss"] for e in history if "loss" in e}


def log_text(suite: Suite, name: str) -> str:
    path = suite.work / "logs" / f"{name}.log"
    return path.read_text(errors="replace") if path.is_file() else ""


FAILED_LOG_LINES = 40  # of a failed job's log, kept in the record


def why_failed(suite: Suite, name: str) -> str:
    result = suite.jobs[name].result
    if result.get("exit") == "not run":
        return f"not run: {result.get('reason')}"
    text = log_text(suite, name).splitlines()
    # our one-line errors, or the last exception of a rank's traceback ("[rankN]:" prefixed or not; a launcher's
    # ChildFailedError only repeats that a rank failed)
    errors = [x for x in text if re.match(r"(\[rank\d+\]:\s*)?(error: |[\w.]*(Error|Exception)\b)", x)]
    errors = [x for x in errors if "ChildFailedError" not in x]
    last = (errors or [x for x in text if x.strip()] or ["no output"])[-1].strip()
    return f"exit {result.get('exit')}: {last[:300]}"


def max_rel(ours: dict[int, float], theirs: dict[int, float], steps) -> tuple[float, list[int]]:
    missing = [s for s in steps if s not in ours or s not in theirs]
    if missing:
        return float("inf"), missing
    return max(abs(ours[s] - theirs[s]) / abs(theirs[s]) for s in steps), []


def compare_weights(a: Path, b: Path) -> tuple[float, str]:
    from safetensors.torch import load_file

    if not (a / "model.safetensors").is_file() or not (b / "model.safetensors").is_file():
        return float("inf"), "model.safetensors missing"
    x, y = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    if set(x) != set(y):
        return float("inf"), f"keys differ: {sorted(set(x) ^ set(y))[:3]}"
    worst = max(float((x[k].float() - y[k].float()).abs().max()) for k in x)
    return worst, f"max |w - w_uninterrupted| = {worst:.2e} (bound {WEIGHT_TOLERANCE})"


def check(suite: Suite) -> list[dict]:
    rows: list[dict] = []

    def add(part, name, job, ok, detail):
        command = suite.jobs[job].result.get("command", "") if job in suite.jobs else "-"
        rows.append({"part": part, "check": name, "status": ok if isinstance(ok, str) else ("PASS" if ok else "FAIL"),
                     "detail": detail, "command": command})  # fmt: skip

    def ran(part, name, check_name=None) -> bool:
        ok = suite.jobs[name].result.get("exit") == 0
        if not ok:
            add(part, check_name or f"{name}: runs", name, False, why_failed(suite, name))
            # the log's end goes into the record's JSON: the logs stay on the machine, which is gone by the time a
            # failure is read
            lines = [x[:300] for x in log_text(suite, name).splitlines() if x.strip()]
            rows[-1]["log_tail"] = lines[-FAILED_LOG_LINES:]
        return ok

    w = suite.work
    for name, job in suite.jobs.items():
        if job.part == "strategies" and not name.startswith(("score-", "warmup-")) and ran("strategies", name):
            expected_wrapper = STRATEGY_RUNS[name][1]
            if name == "ddp" and suite.procs == 1:
                expected_wrapper = "ForImageClassification"  # DDP of one process is the plain model
            reports = [_json(p) for p in sorted((w / name / "rank_reports").glob("rank*.json"))]
            if expected_wrapper and reports:
                world = {r["world_size"] for r in reports}
                wrappers = {r["wrapper"].rsplit(".", 1)[-1] for r in reports}
                stages = {r.get("zero_stage") for r in reports}
                spec = BY_NAME[name]
                local = [r["param_numel_local"] for r in reports]
                full = reports[0]["param_numel_full"]
                sharded = "parameters" in spec.shards and suite.procs > 1
                ok = (world == {suite.procs} and len(reports) == suite.procs
                      and all(expected_wrapper in x for x in wrappers) and stages == {spec.zero_stage}
                      and (not sharded or max(local) <= full / suite.procs * 1.01 + 4096))  # fmt: skip
                add("strategies", f"{name}: {suite.procs} ranks, {expected_wrapper}, ZeRO stage {spec.zero_stage}, "
                    f"parameters {'sharded' if sharded else 'whole'}", name, ok,
                    f"world {sorted(world)}, wrappers {sorted(wrappers)}, stages {sorted(stages, key=str)}, "
                    f"parameters per rank {local} of {full}")  # fmt: skip
            if name in AUTOCAST and reports:  # the shipped ZeRO configs: DeepSpeed autocasts over fp32 weights
                want = ("bfloat16", "float32")  # the recipe's bf16, on the CPU too
                got = {(r.get("deepspeed_autocast"), r.get("param_dtype")) for r in reports}
                add("strategies", f"{name}: DeepSpeed's autocast {want[0]}, weights {want[1]}", name, got == {want},
                    f"(autocast, weights) per rank: {sorted(got, key=str)}")  # fmt: skip
            if name != "ddp" and "ddp" in suite.jobs and suite.jobs["ddp"].result.get("exit") == 0:  # --only
                rel, missing = max_rel(losses(w / name), losses(w / "ddp"), [STEPS])
                add("strategies", f"{name}: loss at step {STEPS} within {LOSS_TOLERANCE:.0%} of DDP's", name,
                    rel <= LOSS_TOLERANCE, f"missing steps {missing}" if missing else
                    f"{losses(w / name)[STEPS]:.4f} vs {losses(w / 'ddp')[STEPS]:.4f} (rel. diff {rel:.2e})")  # fmt: skip
    warm = range(STEPS // 3 + 1, STEPS + 1)  # past the first steps, where every run's loss is still near ln(100)
    reference = "warmup-ddp" in suite.jobs and ran("strategies", "warmup-ddp")
    for s in [s for s in WARMUP[1:] if f"warmup-{s}" in suite.jobs]:
        if ran("strategies", f"warmup-{s}") and reference:
            ours, ddp = losses(w / f"warmup-{s}"), losses(w / "warmup-ddp")
            missing = [x for x in warm if x not in ours or x not in ddp]
            mean = sum((ours[x] - ddp[x]) / ddp[x] for x in warm) / len(warm) if not missing else float("inf")
            add("strategies", f"{s}: under the recipe's warm-up, loss at steps {warm[0]}-{STEPS} within "
                f"{LOSS_TOLERANCE:.0%} of DDP's (mean)", f"warmup-{s}", abs(mean) <= LOSS_TOLERANCE,
                f"missing steps {missing}" if missing else f"mean relative difference {mean:+.2%}; step {STEPS}: "
                f"{ours[STEPS]:.4f} vs {ddp[STEPS]:.4f}")  # fmt: skip
    for name, job in suite.jobs.items():
        if not name.startswith("score-"):
            continue
        for run in job.needs:
            if suite.jobs[run].result.get("exit") != 0:
                continue  # its own check says why
            scored = _json(w / "scores" / f"{run}.json")
            metric = "eval_accuracy" if job.part == "data" else "test_accuracy"  # the data part: validation
            reported = _json(w / run / "all_results.json").get(metric)
            if not scored:
                add(job.part, f"{run}: the saved model reloads with pipeline()", name, False, why_failed(suite, name))
                continue
            ok = reported is not None and abs(scored["accuracy"] - reported) <= SCORE_TOLERANCE + 1e-9
            add(job.part, f"{run}: pipeline() on the saved model scores the run's test accuracy (within "
                f"{SCORE_TOLERANCE * 100:.1f} points)", name, ok,
                f"pipeline {scored['accuracy']:.4f} on {scored['images']} images, run {reported}")  # fmt: skip

    def resumed_like_uninterrupted(title: str, s: str, folder: str, job: str, step: int, part: str = "kill") -> None:
        """The rerun in `folder` resumed from checkpoint-`step` and ended on the uninterrupted run's weights."""
        state = _json(w / folder / "trainer_state.json")
        resumed = re.search(rf"Resuming the run found in .* from .*checkpoint-{step}\b", log_text(suite, job))
        worst, detail = compare_weights(w / folder, w / s)
        add(part, f"{title} to step {STEPS}, same weights as the uninterrupted run", job,
            worst <= WEIGHT_TOLERANCE and state.get("global_step") == STEPS and resumed is not None,
            f"step {state.get('global_step')}, {'resumed' if resumed else 'NOT resumed'} from checkpoint-{step}; "
            f"{detail}")  # fmt: skip

    for s, part, reference in [(s, "kill", s) for s in KILLED] + [(d, "data", f"{d}-ddp") for d in DATA]:
        if f"kill-{s}" not in suite.jobs:
            continue
        killed = suite.jobs[f"kill-{s}"].result
        # every process gone with the launcher: nothing written after the kill (no later checkpoint, no results)
        after_kill, survivors = killed.get("after_kill"), killed.get("alive_after_kill", [])
        was_killed = (killed.get("exit") == -9 and "killed_at" in killed and not survivors
                      and after_kill == killed["killed_at"] and not killed.get("results_after_kill"))  # fmt: skip
        add(part, f"{s}: killed (SIGKILL, every process) after a complete checkpoint", f"kill-{s}", was_killed,
            f"exit {killed.get('exit')}, {len(killed.get('killed_pids', []))} processes killed, {len(survivors)} "
            f"alive after; checkpoints at the kill {killed.get('killed_at')}, before the resume {after_kill}")  # fmt: skip
        if was_killed and ran(part, f"resume-{s}", f"{s}: the same command again resumes"):
            # the newest checkpoint complete at the kill: a run fast enough to write the next before the kill lands
            # (the suite polls for the first) resumes from that one
            newest = max(int(c.rsplit("-", 1)[1]) for c in killed["killed_at"]) if killed["killed_at"] else SAVE_EVERY
            resumed_like_uninterrupted(f"{s}: resumed", reference, f"kill-{s}", f"resume-{s}", newest, part)
    for s in SIGNALLED:
        if f"term-{s}" not in suite.jobs:
            continue
        stopped = suite.jobs[f"term-{s}"].result
        said = re.findall(r"interrupted at step (\d+); checkpoint-\1 saved; run the same command to resume",
                          log_text(suite, f"term-{s}"))  # fmt: skip
        step = int(said[-1]) if said else None
        saved = step is not None and (w / f"term-{s}" / f"checkpoint-{step}" / "run_identity.json").exists()
        ok = (stopped.get("exit") not in (0, None) and "term_pids" in stopped and len(said) == 1 and saved
              and SAVE_EVERY <= step < STEPS and not stopped.get("results_after_term"))  # fmt: skip
        add("kill", f"{s}: SIGTERM during training saves a checkpoint at the next step and says so in one line",
            f"term-{s}", ok, f"exit {stopped.get('exit')}, {len(said)} line(s) {said}, checkpoints after "
            f"{stopped.get('after_term')}, results written {stopped.get('results_after_term')}")  # fmt: skip
        if ok and ran("kill", f"resume-term-{s}", f"{s}: the same command resumes after SIGTERM"):
            resumed_like_uninterrupted(f"{s}: resumed after SIGTERM", s, f"term-{s}", f"resume-term-{s}", step)
    for s in CROSS_COUNT:
        for name, reference, where in ((f"to1-{s}", s, f"{suite.procs} -> 1"),
                                       (f"from1-{s}", f"one-{s}", f"1 -> {suite.procs}")):  # fmt: skip
            if name not in suite.jobs or not ran("resume", name, f"{s}: resumed {where}"):
                continue
            after = range(SAVE_EVERY + 1, STEPS + 1)
            rel, missing = max_rel(losses(w / name), losses(w / reference), after)
            add("resume", f"{s}: resumed {where}, steps {after[0]}-{after[-1]} within {LOSS_TOLERANCE:.0%} of the "
                "uninterrupted run", name, rel <= LOSS_TOLERANCE,
                f"missing steps {missing}" if missing else f"worst rel. diff {rel:.2e}")  # fmt: skip
    if suite.procs == 1 and not suite.cpu:
        add("resume", "resume on another GPU count", "-", "SKIP", "needs 2 or more GPUs")
    if "to1-zero3" in suite.jobs:
        text, result = log_text(suite, "to1-zero3"), suite.jobs["to1-zero3"].result
        lines = [x for x in text.splitlines() if x.startswith("error: ")]
        ok = result.get("exit") not in (0, None) and any("ZeRO-3 resumes on the process count" in x for x in lines)
        add("resume", f"zero3: {suite.procs} -> 1 refused in one line", "to1-zero3", ok,
            lines[-1][:300] if lines else why_failed(suite, "to1-zero3"))  # fmt: skip
    check_single(suite, add, ran)
    check_vith(suite, add, ran)
    check_odd(suite, add, ran)
    for name in [f"{d}-{s}" for d in DATA for s in ("ddp", "zero2") if f"{d}-{s}" in suite.jobs]:
        said = "--streaming" if name.startswith("stream") else "no decoded copy on disk"
        if ran("data", name):
            line = next((x for x in log_text(suite, name).splitlines() if "Images decoded per batch" in x), "")
            add("data", f"{name}: {STEPS} steps, decoded per batch ({said})", name,
                said in line and len(losses(w / name)) == STEPS, line[line.find("Images"):][:200] or "no line")  # fmt: skip
    return rows


def check_single(suite: Suite, add, ran) -> None:
    w = suite.work
    for name, want in (("default", False), ("compiled", True), ("default-again", True)):
        if name not in suite.jobs or not ran("single", name):
            continue
        # The card's hyperparameters hold the resolved setting; the log says why
        card = (w / name / "README.md").read_text() if (w / name / "README.md").is_file() else ""
        compiled = bool(re.search(r"\| torch_compile_regions \| True \|", card))
        # the message after the log prefix ("12:00:00 WARNING vit_recipes.plan.plan: ")
        said = [line[line.index("Regional compilation"):] for line in log_text(suite, name).splitlines()
                if "Regional compilation" in line]  # fmt: skip
        why = {
            "default": f"Regional compilation off: {STEPS} steps would not repay the compile",
            "compiled": "",
            "default-again": f"Regional compilation on: {WARM_STEPS} steps repay it from the compile cache",
        }[name]
        check = {"default": "the default command, short: eager, and one line says why",
                 "compiled": "--torch_compile_regions true: trains compiled (the card says so)",
                 "default-again": f"the default command, {WARM_STEPS} steps after a compiled run: compiles from the "
                                  "cache, and one line says so"}[name]  # fmt: skip
        ok = suite.cpu or (compiled == want and (not why or any(line.startswith(why) for line in said)))
        add("single", check, name, ok,
            "eager (CPU)" if suite.cpu else f"card: {'compiled' if compiled else 'eager'}; {said[0] if said else 'no line'}")  # fmt: skip
    if not suite.cpu and all(n in suite.jobs and ran("single", n) for n in ("default", "compiled")):
        # Compiled on one GPU, the layers run as CUDA graphs (one line says so), and the loss is eager's
        eager, compiled = losses(w / "default"), losses(w / "compiled")
        rel, _ = max_rel(compiled, eager, [STEPS])
        graphs = "CUDA graphs on" in log_text(suite, "compiled")
        add("single", f"compiled on one GPU: CUDA graphs, one line says so, loss at step {STEPS} within "
            f"{LOSS_TOLERANCE:.0%} of eager's", "compiled", graphs and rel <= LOSS_TOLERANCE,
            f"{'CUDA graphs line' if graphs else 'no CUDA graphs line'}; {compiled.get(STEPS)} vs {eager.get(STEPS)}")  # fmt: skip
    if "patch-dropout" in suite.jobs and ran("single", "patch-dropout"):
        add("single", "--patch_dropout 0.5: trains", "patch-dropout", len(losses(w / "patch-dropout")) == STEPS,
            f"{len(losses(w / 'patch-dropout'))} steps logged")  # fmt: skip
    if "lora" in suite.jobs and ran("single", "lora"):
        adapters = sorted(p.parent.name for p in w.glob("lora/checkpoint-*/adapter_config.json"))
        merged = (w / "lora" / "model.safetensors").is_file() and not (w / "lora" / "adapter_config.json").is_file()
        add(
            "single",
            "LoRA: adapters in the checkpoints, a plain merged model at the end",
            "lora",
            bool(adapters) and merged,
            f"adapters in {adapters}; merged model {'saved' if merged else 'missing'}",
        )
    if "levers" in suite.jobs and ran("single", "levers"):
        said = [
            line for line in log_text(suite, "levers").splitlines() if "the model is now the weight average" in line
        ]
        add("single", "--layer_decay, --drop_path_rate, --ema_decay, --random_erasing: train, save the EMA weights",
            "levers", len(losses(w / "levers")) == STEPS and bool(said),
            f"{len(losses(w / 'levers'))} steps logged; {said[0].split(': ', 1)[-1][:160] if said else 'no EMA line'}")  # fmt: skip
    if "class-weights" in suite.jobs and ran("single", "class-weights"):
        results = _json(w / "class-weights" / "all_results.json")
        add(
            "single",
            "--class_weights balanced: trains, reports per-class recall",
            "class-weights",
            "test_recall_macro" in results,
            f"test_recall_macro (balanced accuracy) {results.get('test_recall_macro')}",
        )
    if "multi-label" in suite.jobs and ran("single", "multi-label"):
        results = _json(w / "multi-label" / "all_results.json")
        config = _json(w / "multi-label" / "config.json")
        ok = config.get("problem_type") == "multi_label_classification" and "test_mean_average_precision" in results
        add(
            "single",
            "multi-label: trains, scores mAP, saves a multi-label model",
            "multi-label",
            ok,
            f"problem_type {config.get('problem_type')}, test mAP {results.get('test_mean_average_precision')}",
        )
    if "predict-only" in suite.jobs and ran("single", "predict-only"):
        import csv

        with open(w / "predict-only" / "predictions.csv") as f:
            rows = list(csv.DictReader(f))
        truth = [Path(r["file"]).stem.split("-", 1)[1] for r in rows]
        agree = sum(r["label"] == t for r, t in zip(rows, truth)) / max(len(rows), 1)
        expected = len(list((suite.assets / "predict").iterdir()))
        add(
            "single",
            "predict-only from the trained folder: predictions.csv for every image",
            "predict-only",
            len(rows) == expected,
            f"{len(rows)} of {expected} images; {agree:.1%} match their true class",
        )
    if "te-fp8" in suite.jobs:
        if ran("single", "te-fp8"):
            add("single", "TE FP8: trains", "te-fp8", len(losses(w / "te-fp8")) == STEPS, "")
    elif "default" in suite.jobs:
        add("single", "TE FP8", "te-fp8", "SKIP", "transformer_engine does not import here (carry its wheels)")


def check_vith(suite: Suite, add, ran) -> None:
    if "vith" in suite.jobs and ran("vith", "vith", "ViT-H recipe under the README's zero3 command: runs"):
        steps = losses(suite.work / "vith")
        report = _json(suite.work / "vith" / "all_results.json")
        add(
            "vith",
            f"ViT-H recipe under zero3 on {suite.procs} processes: 10 steps, a plain saved model",
            "vith",
            len(steps) == 10 and (suite.work / "vith" / "model.safetensors").is_file(),
            f"losses {[round(v, 3) for v in steps.values()][::3]}, {report.get('train_samples_per_second')} img/s",
        )
    check_zero3_as_typed(suite, add)


def check_odd(suite: Suite, add, ran) -> None:
    """odd-ddp: the photo folder of odd files trained and evaluated on every process: the readable validation images
    scored and no replacement (per-class support, the log's count), the card and log name what was left out, replaced
    and noted, and skipped_images.json lists the unreadable images by split."""
    name, n, out = "odd-ddp", suite.procs, suite.work / "odd-ddp"
    if name not in suite.jobs or not ran("data", name):
        return
    text, card = log_text(suite, name), (out / "README.md").read_text() if (out / "README.md").is_file() else ""
    bad = len(ODD_UNREADABLE["validation"])
    readable = len(odd_readable(suite.assets / "odd" / "validation"))
    support = None
    if (out / "per_class_accuracy_validation.csv").is_file():
        import csv

        with open(out / "per_class_accuracy_validation.csv") as f:
            support = sum(int(row["support"]) for row in csv.DictReader(f))
    said = re.findall(rf"validation: {bad} unreadable image\(s\) left out of this evaluation: its loss and metrics "
                      r"count the (\d+) others", text)  # fmt: skip
    add("data", f"{name}: {bad} unreadable validation images as one evaluation batch on {n} processes: the {readable} "
        "readable ones scored, none replaced", name, support == readable and said == [str(readable)],
        f"per-class support {support}; the log's count {said or 'no line'}")  # fmt: skip
    notes = [f"validation: {bad} unreadable image(s) left out of its evaluation",
             "train: 1 unreadable image(s) replaced in their batch by another of it",
             "train: 1 animated or multi-frame image(s): the first frame is used",
             "train: 1 high-bit-depth image(s) brighter than the white level 255",
             "Left out 1 empty image file(s) (0 bytes): validation/"]  # fmt: skip
    missing = [x for x in notes if x not in card or x not in text]
    add(
        "data",
        f"{name}: the card and the log say what was left out, replaced and noted (unreadable, animated, "
        "16-bit, empty files)",
        name,
        not missing,
        f"missing: {missing}" if missing else f"{len(notes)} notes in both",
    )
    skipped = _json(out / "skipped_images.json")
    listed = {split: sorted(Path(x["image"]).name for x in items) for split, items in skipped.items()}
    add(
        "data",
        f"{name}: skipped_images.json lists the unreadable images by split",
        name,
        listed == ODD_UNREADABLE,
        str(listed),
    )


def check_zero3_as_typed(suite: Suite, add) -> None:
    """The README's zero3 command as typed (the config's 8 processes) on fewer GPUs: the processes past the GPUs exit
    before the process group (vit_recipes.core.launch.step_aside), the others train, one line says so, and nothing of the
    launcher follows (it was our refusal, then accelerate's ChildFailedError report of ~40 lines)."""
    name, gpus = "vith-as-typed", suite.procs
    if name not in suite.jobs:
        return
    text, result, out = log_text(suite, name), suite.jobs[name].result, suite.work / name
    lines = text.splitlines()
    said = [x[x.index("8 processes") :] for x in lines if "8 processes were launched on this machine" in x]
    card = (out / "README.md").read_text() if (out / "README.md").is_file() else ""
    reproduce = f"accelerate launch --config_file accelerate_configs/zero3.yaml --num_processes {gpus} " in card
    launcher = [
        x for x in lines if x.startswith(("Traceback (most recent call last)", "error: ")) or "ChildFailedError" in x
    ]
    steps = len(losses(out))
    ok = result.get("exit") == 0 and len(said) == 1 and steps == 10 and reproduce and not launcher
    detail = f"{said[0][:200] if said else 'no line'}; {steps} steps; card's command with --num_processes {gpus}: "
    detail += f"{reproduce}; launcher output {launcher[:2] or 'none'}"
    add("vith", f"zero3 command as typed (8 processes) on {gpus} GPUs: {gpus} train, one line says so, no launcher "
        "report", name, ok, detail if result.get("exit") == 0 else why_failed(suite, name))  # fmt: skip


# ------------------------------------------------------------------------------------------------------ assets
def build_assets(suite: Suite, parts: list[str]) -> None:
    """CIFAR-100-shaped data (4,000 train / 1,000 test PNGs), a multi-label copy, a folder of images to predict,
    random ViT-B/16 with the 100-class head in place (every run starts from the same weights) and ViT-H/14."""
    import numpy as np

    from benchmarks.make_assets import CHECKPOINTS, VIT_KEYS, make_dataset

    a = suite.assets
    if not (a / "cifar100").is_dir():
        make_dataset(a / "cifar100", "img", "fine_label", 100, {"train": 4000, "test": 1000}, "PNG", (32, 32), 8)
    models = ["vit-tiny"] if suite.cpu else ["vit-base"] + (["vit-huge"] if "vith" in parts else [])
    names = {i: f"class_{i:03d}" for i in range(100)}
    for name in models:
        if (a / name / "config.json").is_file():
            continue
        import torch
        from transformers import ViTConfig, ViTForImageClassification, ViTImageProcessor

        torch.manual_seed(0)
        shape = CHECKPOINTS.get(name) or dict(zip(VIT_KEYS, (32, 2, 2, 64, 8, 32)))  # vit-tiny, for --cpu
        config = ViTConfig(**shape, num_labels=100, id2label=names, label2id={v: k for k, v in names.items()})
        ViTForImageClassification(config).save_pretrained(a / name)
        ViTImageProcessor(size={"height": shape["image_size"], "width": shape["image_size"]}).save_pretrained(a / name)
    if suite.cpu and not (a / "vit-base-100").exists():
        (a / "vit-base-100").symlink_to(a / "vit-tiny")
    elif not suite.cpu and not (a / "vit-base-100").exists():
        (a / "vit-base-100").symlink_to(a / "vit-base")
    if "data" in parts and not (a / "stream").is_dir():
        build_data_assets(a, 200 if suite.cpu else 4000)
    if "data" in parts and not (a / "odd").is_dir():
        build_odd_asset(a)
    if "single" in parts and not (a / "cifar100-multilabel").is_dir():
        from datasets import ClassLabel, Features, Sequence, load_dataset

        data = load_dataset(str(a / "cifar100"))
        features = Features({"img": data["train"].features["img"],
                             "labels": Sequence(ClassLabel(names=[f"super_{i:02d}" for i in range(20)]))})  # fmt: skip
        (a / "cifar100-multilabel" / "data").mkdir(parents=True)
        for split, rows in data.items():
            fine = np.asarray(rows["fine_label"])
            # two labels each: the class's group of five and the group of the next class
            labels = [sorted({int(f) // 5, (int(f) + 7) % 100 // 5}) for f in fine]
            rows.remove_columns("fine_label").add_column("labels", labels).cast(features).to_parquet(
                str(a / "cifar100-multilabel" / "data" / f"{split}-00000-of-00001.parquet"))  # fmt: skip
        (a / "predict").mkdir()
        test = data["test"]
        for i in range(64):
            test[i]["img"].save(a / "predict" / f"{i:03d}-{names[test[i]['fine_label']]}.png")


def build_data_assets(a: Path, images: int) -> None:
    """photos/: an ImageNet-shaped JPEG folder (tools/jpeg_folder.py), 20 classes; stream/: the same images as parquet
    shards of unequal sizes (40/5/37/8% of train: the two ranks read 77% and 23% of it) and a validation shard."""
    import datasets

    sys.path.insert(0, str(ROOT / "tools"))
    from jpeg_folder import write_folder

    write_folder(a / "photos", images, 20, validation=0.1)
    loaded = datasets.load_dataset(str(a / "photos")).cast_column("image", datasets.Image(decode=False))
    (a / "stream" / "data").mkdir(parents=True)
    for split, shares in (("train", (0.4, 0.05, 0.37, 0.18)), ("validation", (1.0,))):
        rows = loaded[split].map(lambda r: {"image": {"bytes": Path(r["image"]["path"]).read_bytes(), "path": None}})
        bounds = [round(sum(shares[:i]) * len(rows)) for i in range(len(shares) + 1)]
        for i, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
            rows.select(range(lo, hi)).to_parquet(
                str(a / "stream" / "data" / f"{split}-{i:05d}-of-{len(shares):05d}.parquet")
            )


def build_odd_asset(a: Path, per_class: int = 8) -> None:
    """odd/: a few photos of each class (8 to train: 30 steps of 64 decode each image many times, so every odd one is
    met; 3 to validate) with what real collections hold besides, each of which once ended a run or went silently wrong
    (issue 46): unreadable JPEGs (ODD_UNREADABLE: the validation three, sorted first, are one evaluation batch of one
    process), an animated GIF and a 16-bit PNG past the 64 images that set the white level (the last class), an empty
    file, a hidden AppleDouble file and a .jfif photo. Written beside and renamed: a build cut short is not kept."""
    import numpy as np
    from PIL import Image

    tmp = a / "odd.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    for split, count in (("train", per_class), ("validation", 3)):
        for folder in sorted((a / "photos" / split).iterdir()):
            (tmp / split / folder.name).mkdir(parents=True)
            for photo in sorted(folder.iterdir())[:count]:
                shutil.copy(photo, tmp / split / folder.name / photo.name)
    train, validation = sorted((tmp / "train").iterdir()), sorted((tmp / "validation").iterdir())
    for split, names in ODD_UNREADABLE.items():
        for name in names:
            ((train[-1] if split == "train" else validation[0]) / name).write_bytes(b"\xff\xd8\xff not a whole JPEG")
    frames = [Image.new("RGB", (480, 360), (255 * i, 0, 0)) for i in range(2)]
    frames[0].save(train[-1] / "animated.gif", save_all=True, append_images=frames[1:])
    Image.fromarray(np.linspace(0, 60000, 480 * 360).reshape(360, 480).astype(np.uint16)).save(train[-1] / "deep.png")
    hidden = validation[1] / f"._{next(validation[1].glob('*.jpg')).name}"  # macOS's AppleDouble file beside a photo
    hidden.write_bytes(b"\x00\x05\x16\x07" + bytes(78))
    (validation[1] / "empty.jpg").write_bytes(b"")
    shutil.copy(next(validation[2].glob("*.jpg")), validation[2] / "saved.jfif")
    tmp.rename(a / "odd")


def odd_readable(folder: Path) -> list[Path]:
    """The images of odd/'s split `folder` that decode: its photos and the .jfif, not the empty, hidden or unreadable."""
    unreadable = {n for names in ODD_UNREADABLE.values() for n in names}
    return [p for p in folder.glob("*/*") if p.stat().st_size and p.name[0] != "." and p.name not in unreadable]


def score(models: list[Path], work: Path, cpu: bool) -> None:
    """pipeline() on saved models over the test split: the user's way to load what a run saved."""
    from datasets import load_dataset
    from transformers import pipeline

    (work / "scores").mkdir(exist_ok=True)
    for model_dir in models:
        if not (model_dir / "config.json").is_file():
            continue  # its run failed: its own check says so
        photos = model_dir.name.startswith(tuple(DATA))  # the data part's runs: the photos' validation split
        test = load_dataset(
            str(work / "assets" / ("photos" if photos else "cifar100")), split="validation" if photos else "test"
        )
        column, label = ("image", "label") if photos else ("img", "fine_label")
        names, images = test.features[label].names, list(test[column])
        classifier = pipeline("image-classification", model=str(model_dir), device="cpu" if cpu else 0)
        predicted = classifier(images, batch_size=128, top_k=1)
        right = sum(p[0]["label"] == names[y] for p, y in zip(predicted, test[label]))
        out = {"accuracy": right / len(test), "images": len(test)}
        (work / "scores" / f"{model_dir.name}.json").write_text(json.dumps(out))
        print(f"{model_dir.name}: {out}", flush=True)


# ------------------------------------------------------------------------------------------------------ record
def write_record(record: Path, suite: Suite, parts: list[str], rows: list[dict], device: str, seconds: float):
    record.mkdir(parents=True, exist_ok=True)
    path = record / "acceptance.json"
    old = _json(path)
    runs = [r for r in old.get("runs", []) if not set(r["parts"]) & set(parts)]
    versions = {k: v for k, v in common.library_versions().items() if v}
    runs.append({
        "parts": parts, "device": device, "gpus": suite.gpus, "date": datetime.date.today().isoformat(),
        "commit": common.git_commit(short=True), "versions": versions, "wall_s": round(seconds), "checks": rows,
        "command": " ".join(["python", "benchmarks/acceptance.py", "--parts", ",".join(parts)]),
        "jobs": {n: j.result for n, j in suite.jobs.items()},
    })  # fmt: skip
    render(record, runs)
    failed = sum(c["status"] == "FAIL" for r in runs for c in r["checks"])
    common.start_readme(record, "acceptance", "Does every strategy, checkpoint path and one-GPU feature work on these "
                        "GPUs (the definition of done)?", f"make test-gpu PARTS={','.join(parts)}",
                        f"{failed} checks fail; every check, its detail and command: [acceptance.md](acceptance.md)",
                        f"{suite.gpus} x {device}")  # fmt: skip


def render(record: Path, runs: list[dict]) -> None:
    """acceptance.json and acceptance.md from the runs (one per part selection), in the order of PARTS."""
    runs = sorted(runs, key=lambda r: PARTS.index(r["parts"][0]))
    (record / "acceptance.json").write_text(json.dumps({"runs": runs}, indent=1) + "\n")
    every = [c for r in runs for c in r["checks"]]
    failed = sum(c["status"] == "FAIL" for c in every)
    lines = [f"# Acceptance: {runs[0]['gpus']} x {runs[0]['device']}", "",
             f"**{len(every) - failed} of {len(every)} checks pass or skip; {failed} fail.** Tolerances: loss "
             f"{LOSS_TOLERANCE:.0%} relative, pipeline() score {SCORE_TOLERANCE * 100:.1f} points, weights "
             f"{WEIGHT_TOLERANCE} absolute. `$WORK` is the suite's work folder (`--work`).", ""]  # fmt: skip
    if (record / "losses.png").is_file():
        lines += ["![Per-step loss against each run's reference](losses.png)", ""]
    for r in runs:
        lines += [f"## {', '.join(r['parts'])}", "",
                  f"`{r['command']}` on {r['gpus']} x {r['device']}, {r['date']}, commit {r['commit']}, "
                  f"{r['wall_s']} s wall clock. Versions: " + ", ".join(f"{k} {v}" for k, v in r["versions"].items()),
                  ""]  # fmt: skip
        rows = [
            [c["status"], c["check"], str(c["detail"]).replace("|", "/"), f"`{c['command']}`"] for c in r["checks"]
        ]
        lines += common.markdown_table(["status", "check", "detail", "command"], rows) + [""]
    (record / "acceptance.md").write_text("\n".join(lines))


def merge(record: Path, other: Path) -> None:
    """Add another call's record (other parts, same machine kind) to `record`: two calls make one record."""
    runs = _json(record / "acceptance.json").get("runs", [])
    new = _json(other).get("runs", [])
    parts = {p for r in new for p in r["parts"]}
    render(record, [r for r in runs if not set(r["parts"]) & parts] + new)


def chart(suite: Suite, record: Path) -> None:
    """losses.png: each run's per-step loss against its reference (DDP for the strategies, the uninterrupted run
    for the resumed ones), as a relative difference on a log scale with the tolerance drawn in."""
    from matplotlib.figure import Figure  # a figure of its own (no pyplot): nothing global to close

    w, floor = suite.work, 1e-6
    panels = {
        f"Strategies against DDP ({suite.procs} GPUs, same seed and batch)": [
            (s, s, "ddp") for s in STRATEGY_RUNS if s != "ddp" and f"{s}" in suite.jobs],
        "Resumed runs against the uninterrupted run (after the step-10 checkpoint)": [
            *((f"{s}: killed, resumed", f"kill-{s}", s) for s in KILLED if f"resume-{s}" in suite.jobs),
            *((f"{s}: {suite.procs} -> 1 GPU", f"to1-{s}", s) for s in CROSS_COUNT if f"to1-{s}" in suite.jobs),
            *((f"{s}: 1 -> {suite.procs} GPUs", f"from1-{s}", f"one-{s}") for s in CROSS_COUNT
              if f"from1-{s}" in suite.jobs)],
    }  # fmt: skip
    panels = {title: lines for title, lines in panels.items() if lines}
    if not panels:
        return
    fig = Figure(figsize=(7.5 * len(panels), 5.2))
    axes = fig.subplots(1, len(panels), squeeze=False)
    for ax, (title, lines) in zip(axes[0], panels.items()):
        for label, run, reference in lines:
            ours, theirs = losses(w / run), losses(w / reference)
            steps = [s for s in sorted(ours) if s in theirs and (s > SAVE_EVERY or "Resumed" not in title)]
            diffs = [max(abs(ours[s] - theirs[s]) / abs(theirs[s]), floor) for s in steps]
            style = ":" if "1 ->" in label else "--" if "-> 1" in label else "-"  # one style per kind of resume
            if steps:
                ax.plot(steps, diffs, marker=".", linewidth=1, linestyle=style, label=label)
        ax.axhline(LOSS_TOLERANCE, color="crimson", linestyle="--", linewidth=1.2,
                   label=f"tolerance ({LOSS_TOLERANCE:.0%})")  # fmt: skip
        ax.set_yscale("log")
        ax.set_ylim(floor / 2, 1)
        ax.set_xlim(0, STEPS + 1)
        ax.set_xlabel("training step")
        ax.set_ylabel(f"|loss - reference| / reference (losses logged to 4 decimals; {floor:g}: equal)")
        ax.set_title(title + "\n(coinciding lines are runs with equal losses)", fontsize=10)
        ax.grid(True, which="major", alpha=0.3)
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1), borderaxespad=0)
    fig.tight_layout()
    common.save_png(fig, record / "losses.png", dpi=72)


def importable(name: str) -> bool:
    try:
        __import__(name)
        return True
    except Exception:
        return False


def trim_checkpoints(output: Path) -> int:
    """Remove all but the JSON files of a run's `checkpoint-*` folders (weights, optimizer and RNG states); the
    checks read only the folders' names and their JSON (run_identity.json, adapter_config.json). Returns the bytes
    freed."""
    files = [f for f in output.glob("checkpoint-*/**/*") if f.is_file() and f.suffix != ".json"]
    freed = sum(f.stat().st_size for f in files)
    for f in files:
        f.unlink(missing_ok=True)
    return freed


def drop_checkpoints(work: Path) -> int:
    """Remove the runs' `checkpoint-*` folders under `work` (final models, logs, trainer states and assets stay: the
    record's chart reads those); returns the bytes freed."""
    folders = [p for p in work.rglob("checkpoint-*") if p.is_dir() and "assets" not in p.relative_to(work).parts]
    freed = sum(f.stat().st_size for folder in folders for f in folder.rglob("*") if f.is_file())
    for folder in folders:
        shutil.rmtree(folder, ignore_errors=True)
    return freed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of: {', '.join(PARTS)}")
    parser.add_argument("--record", default=None, help="record folder (default benchmarks/results/<date>_acceptance_"
                        "<gpus>x<card>); a record there keeps the parts not run now")  # fmt: skip
    parser.add_argument("--work", default="/tmp/acceptance", help="runs, logs and assets (not kept in git)")
    parser.add_argument("--only", default=None, help="comma-separated job names within the parts (and what they need)")
    parser.add_argument("--per_gpu", type=int, default=4, help="jobs sharing one GPU at a time")
    parser.add_argument("--budget", type=int, default=None, help="seconds: then no job starts, running ones stop, "
                        "and the record says what did not run")  # fmt: skip
    parser.add_argument("--cpu", action="store_true", help="a check of the suite itself on CPU processes")
    parser.add_argument("--redraw", action="store_true", help="draw losses.png again from the runs in --work and "
                        "rewrite the record's markdown (its checks are kept); runs nothing")  # fmt: skip
    parser.add_argument("--merge", default=None, help="add this acceptance.json (another call's parts) to --record")
    parser.add_argument("--score", default=None, help=argparse.SUPPRESS)  # internal: pipeline() scores
    args = parser.parse_args()
    if args.score:
        score([Path(m) for m in args.score.split(",")], Path(args.work), args.cpu)
        return 0
    parts = [p for p in PARTS if p in args.parts.split(",")]
    if unknown := set(args.parts.split(",")) - set(PARTS):
        parser.error(f"unknown part {sorted(unknown)[0]}: use {', '.join(PARTS)}")
    if (args.merge or args.redraw) and not args.record:
        parser.error("--merge and --redraw need --record")
    if args.merge:
        merge(Path(args.record), Path(args.merge))
        return 0
    if args.redraw:  # the recorded runs' plan, drawn from the outputs in --work
        runs = _json(Path(args.record) / "acceptance.json")["runs"]
        suite = Suite(args, runs[0]["gpus"])
        suite.plan([p for r in runs for p in r["parts"]])
        chart(suite, Path(args.record))
        render(Path(args.record), runs)
        return 0
    import torch

    gpus = 2 if args.cpu else torch.cuda.device_count()
    if gpus == 0:
        parser.error("no GPU visible: this suite proves GPU behaviour (`--cpu` checks the suite itself)")
    device = "CPU" if args.cpu else torch.cuda.get_device_name(0).replace("NVIDIA ", "")
    record = Path(args.record or common.record_folder("acceptance", gpus, device))
    suite = Suite(args, gpus)
    suite.work.mkdir(parents=True, exist_ok=True)
    for stale in [p for p in suite.work.iterdir() if p.name != "assets"]:  # assets are kept: they take a while
        shutil.rmtree(stale) if stale.is_dir() and not stale.is_symlink() else stale.unlink()
    (suite.work / "logs").mkdir()
    suite.log(f"{gpus} x {device}; parts {', '.join(parts)}; assets in {suite.assets}")
    build_assets(suite, parts)
    suite.plan(parts, set(args.only.split(",")) if args.only else None)
    suite.log(f"{len(suite.jobs)} jobs: {', '.join(suite.jobs)}")
    suite.run()
    rows = [r for r in check(suite) if r["part"] in parts]
    record.mkdir(parents=True, exist_ok=True)
    chart(suite, record)
    write_record(record, suite, parts, rows, device, time.time() - suite.t0)
    failed = [r for r in rows if r["status"] == "FAIL"]
    for r in rows:
        print(f"{r['status']:4}  {r['check']}: {r['detail']}")
    suite.log(f"{len(rows) - len(failed)} of {len(rows)} checks pass or skip; record: {record}/acceptance.md")
    if not failed:  # a failure's checkpoints stay for a look; a pass's filled a 128 GB disk for the next call there
        freed, trimmed = drop_checkpoints(suite.work), sum(j.result.get("trimmed", 0) for j in suite.jobs.values())
        suite.log(f"removed the runs' checkpoints from {suite.work}: {(freed + trimmed) / 2**30:.1f} GiB, "
                  f"{trimmed / 2**30:.1f} of them as their runs ended (final models stay)")  # fmt: skip
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

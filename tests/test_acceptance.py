"""benchmarks/acceptance.py (make test-gpu): its plan on 1, 2, 4 and 8 GPUs, and that its checks fail when a run is
wrong. The suite itself runs on GPUs; `--cpu` runs it on CPU processes (not here: minutes)."""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import ROOT
from safetensors.torch import save_file


@pytest.fixture
def acceptance(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    return importlib.import_module("acceptance")


def suite_for(acceptance, gpus: int, tmp_path: Path, parts=None):
    args = SimpleNamespace(work=str(tmp_path), cpu=False, per_gpu=4, budget=None)
    suite = acceptance.Suite(args, gpus)
    suite.plan(list(parts or acceptance.PARTS))
    return suite


def command(suite, name: str) -> str:
    return " ".join(a for a in suite.jobs[name].argv if a not in ("--master_port", "--main_process_port", "{port}"))


@pytest.mark.parametrize("gpus", [1, 2, 4, 8])
def test_the_plan_runs_the_readme_commands_on_every_gpu(acceptance, tmp_path, gpus):
    suite = suite_for(acceptance, gpus, tmp_path)
    # The README's two commands, as typed (the DeepSpeed launcher takes every GPU when not told otherwise)
    zero2 = command(suite, "zero2")
    assert "run_image_classification.py --deepspeed ds_configs/zero2.json --config " in zero2
    assert "--num_gpus" not in zero2 and f"--per_device_train_batch_size {64 // gpus}" in zero2
    vith = command(suite, "vith")
    assert (
        f"launch --config_file accelerate_configs/zero3.yaml --num_processes {gpus} run_image_classification" in vith
    )
    assert "--config recipes/vit-huge/cifar100/config_full.yaml" in vith and suite.jobs["vith"].gpus == gpus
    # Without --num_processes: below the shipped 8 the GPUs there train (the rest step aside); at 8 nothing differs
    assert ("vith-as-typed" in suite.jobs) == (gpus < 8)
    # Killed runs resume by the same command in the same folder
    for s in acceptance.KILLED:
        killed, resumed = suite.jobs[f"kill-{s}"], suite.jobs[f"resume-{s}"]
        assert killed.argv == resumed.argv and resumed.needs == (killed.name, s)
        assert killed.kill_when == killed.output / "checkpoint-10" / "run_identity.json"
    for s in acceptance.SIGNALLED:  # SIGTERM, then the same command
        stopped, resumed = suite.jobs[f"term-{s}"], suite.jobs[f"resume-term-{s}"]
        assert stopped.argv == resumed.argv and resumed.needs == (stopped.name, s) and stopped.kill_when is None
        assert stopped.term_when == stopped.output / "checkpoint-10" / "run_identity.json"
    # Another GPU count needs two; one-GPU jobs through the strategy's own launcher
    assert any(n.startswith("to1-") for n in suite.jobs) == (gpus > 1)
    if gpus > 1:
        assert "deepspeed --master_port" in " ".join(suite.jobs["to1-zero2"].argv)
        assert "--num_gpus 1" in command(suite, "to1-zero2") and suite.jobs["to1-zero2"].gpus == 1
        assert suite.jobs["from1-fsdp2"].seed_from == tmp_path / "one-fsdp2"
    # The warm-up runs: the same command with the recipe's schedule restored (the last flag wins), no checkpoints
    warm = command(suite, "warmup-zero2")
    assert "run_image_classification.py --deepspeed ds_configs/zero2.json --config " in warm
    assert warm.endswith(
        "--warmup_steps 500 --lr_scheduler_type cosine --save_strategy no --torch_compile_regions false"
    )
    # Numerics runs train eagerly; the default command keeps the GPU default (regional compilation)
    assert "--torch_compile_regions false" in command(suite, "fsdp2")
    assert "--torch_compile_regions" not in command(suite, "default")
    assert command(suite, "default").split()[1] == "run_image_classification.py"


def test_a_part_brings_the_runs_it_needs_and_no_more(acceptance, tmp_path):
    suite = suite_for(acceptance, 2, tmp_path, parts=["kill"])
    assert set(suite.jobs) == {"ddp", "zero2", "zero3", "fsdp2"} | {
        f"{k}-{s}" for k in ("kill", "resume") for s in acceptance.KILLED
    } | {f"{k}-{s}" for k in ("term", "resume-term") for s in acceptance.SIGNALLED}


def test_the_cpu_plan_stores_its_photos_large_enough_to_decode_them_per_batch(acceptance, tmp_path):
    """--cpu's vit-tiny (32 px) would store the photos at 37 px, decoded once; the data checks want them per batch."""
    from vit_recipes.data.decoding import StorageFormat, choose_decoding

    args = SimpleNamespace(work=str(tmp_path), cpu=True, per_gpu=4, budget=None)
    cpu, gpu = acceptance.Suite(args, 2), suite_for(acceptance, 2, tmp_path, parts=["data"])
    cpu.plan(["data"])
    for name in ("photos-ddp", "photos-zero2", "kill-photos", "resume-photos"):
        assert "--storage_size 256" in command(cpu, name) and "--storage_size" not in command(gpu, name)
    assert "--storage_size" not in command(cpu, "stream-ddp")
    photo = dict(sampled=(496, 336), source_bytes=46 * 1024)  # the suite's photos, as the GPU run's log says
    assert choose_decoding("auto", StorageFormat((37, 37), **photo))[0] == "once"
    assert choose_decoding("auto", StorageFormat((256, 256), **photo))[0] == "per_batch"


def fake_run(out: Path, losses: dict[int, float], accuracy=0.4):
    out.mkdir(parents=True, exist_ok=True)
    history = [{"step": s, "loss": v} for s, v in losses.items()]
    (out / "trainer_state.json").write_text(json.dumps({"global_step": max(losses), "log_history": history}))
    (out / "all_results.json").write_text(json.dumps({"test_accuracy": accuracy}))


def test_checks_fail_for_a_drifting_resume_a_run_that_was_not_killed_and_a_wrong_score(acceptance, tmp_path):
    suite = suite_for(acceptance, 2, tmp_path, parts=["strategies", "kill", "resume"])
    base = {s: 4.0 - 0.05 * s for s in range(1, 31)}
    for name, job in suite.jobs.items():
        job.result = {"exit": 0, "command": name}
        if job.output is not None:
            fake_run(job.output, base)
    fake_run(tmp_path / "to1-zero2", {s: v * (1.05 if s > 20 else 1) for s, v in base.items()})  # drifts 5%
    fake_run(tmp_path / "warmup-zero2", {s: v * 1.05 for s, v in base.items()})  # learns slower in the warm-up
    suite.jobs["kill-ddp"].result = {"exit": 0}  # finished before the kill
    killed = {"exit": -9, "killed_pids": [1, 2, 3], "killed_at": ["checkpoint-10"], "alive_after_kill": []}
    # the launcher died, its workers (each in a session of its own) trained on: the suite's own bug once
    suite.jobs["kill-zero3"].result = {**killed, "after_kill": ["checkpoint-10", "checkpoint-20"]}
    suite.jobs["kill-fsdp2"].result = {**killed, "after_kill": ["checkpoint-10"], "results_after_kill": False}
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "resume-fsdp2.log").write_text(  # resumed, but not from the checkpoint the kill left
        f"WARNING Resuming the run found in {tmp_path}/kill-fsdp2 from {tmp_path}/kill-fsdp2/checkpoint-30\n"
    )
    # fast enough to write checkpoint-20 before the kill landed: resumed from that one, the newest
    saved = ["checkpoint-10", "checkpoint-20"]
    suite.jobs["kill-zero2"].result = {**killed, "killed_at": saved, "after_kill": saved, "results_after_kill": False}
    (tmp_path / "logs" / "resume-zero2.log").write_text(
        f"WARNING Resuming the run found in {tmp_path}/kill-zero2 from {tmp_path}/kill-zero2/checkpoint-20\n"
    )
    for run in ("kill-zero2", "zero2", "kill-fsdp2", "fsdp2", "term-zero2", "term-ddp", "ddp"):  # the same weights
        save_file({"w": torch.ones(2)}, tmp_path / run / "model.safetensors")
    # SIGTERM: ZeRO-2 saved checkpoint-12, said so and resumed from it; DDP's run ended without its one line
    term = {
        "exit": 143,
        "term_pids": [1],
        "after_term": ["checkpoint-10", "checkpoint-12"],
        "results_after_term": False,
    }
    suite.jobs["term-zero2"].result, suite.jobs["term-ddp"].result = term, {**term, "exit": 0}
    (tmp_path / "term-zero2" / "checkpoint-12").mkdir(parents=True)
    (tmp_path / "term-zero2" / "checkpoint-12" / "run_identity.json").write_text("{}")
    (tmp_path / "logs" / "term-zero2.log").write_text(
        "interrupted at step 12; checkpoint-12 saved; run the same command to resume\n"
    )
    (tmp_path / "logs" / "resume-term-zero2.log").write_text(
        f"WARNING Resuming the run found in {tmp_path}/term-zero2 from {tmp_path}/term-zero2/checkpoint-12\n"
    )
    for run, stage, autocast, dtype in (("zero1", 1, "bfloat16", "float32"), ("zero3", 3, None, "bfloat16")):
        (tmp_path / run / "rank_reports").mkdir()  # ZeRO-3 in DeepSpeed's bf16 mode: bf16 weights, no autocast
        for rank in (0, 1):
            report = {"world_size": 2, "wrapper": "deepspeed.DeepSpeedEngine", "zero_stage": stage,
                      "param_numel_local": 50, "param_numel_full": 100, "param_dtype": dtype,
                      "deepspeed_autocast": autocast}  # fmt: skip
            (tmp_path / run / "rank_reports" / f"rank{rank}.json").write_text(json.dumps(report))
    (tmp_path / "scores").mkdir()
    for s in acceptance.STRATEGY_RUNS:
        (tmp_path / "scores" / f"{s}.json").write_text(json.dumps({"accuracy": 0.4, "images": 1000}))
    (tmp_path / "scores" / "zero1.json").write_text(json.dumps({"accuracy": 0.385, "images": 1000}))  # 1.5 points off
    rows = {r["check"]: r for r in acceptance.check(suite)}
    failed = {name for name, r in rows.items() if r["status"] == "FAIL"}
    assert "zero2: resumed 2 -> 1, steps 11-30 within 3% of the uninterrupted run" in failed
    assert "zero2: resumed 1 -> 2, steps 11-30 within 3% of the uninterrupted run" not in failed
    assert {f"{s}: killed (SIGKILL, every process) after a complete checkpoint" for s in ("ddp", "zero3")} <= failed
    assert "fsdp2: resumed to step 30, same weights as the uninterrupted run" in failed
    assert rows["zero2: resumed to step 30, same weights as the uninterrupted run"]["status"] == "PASS"
    signalled = "SIGTERM during training saves a checkpoint at the next step and says so in one line"
    assert rows[f"zero2: {signalled}"]["status"] == "PASS" and f"ddp: {signalled}" in failed
    assert rows["zero2: resumed after SIGTERM to step 30, same weights as the uninterrupted run"]["status"] == "PASS"
    assert any(n.startswith("zero1: pipeline()") for n in failed) and not any(
        n.startswith("zero2: pipeline()") for n in failed
    )
    assert rows["zero3: 2 -> 1 refused in one line"]["status"] == "FAIL"  # it "succeeded": no refusal line
    assert "zero3: loss at step 30 within 3% of DDP's" not in failed
    warmup = "under the recipe's warm-up, loss at steps 11-30 within 3% of DDP's (mean)"
    assert f"zero2: {warmup}" in failed and rows[f"zero3: {warmup}"]["status"] == rows[f"fsdp2: {warmup}"]["status"]
    assert rows[f"zero3: {warmup}"]["status"] == "PASS"
    autocast = "DeepSpeed's autocast bfloat16, weights float32"
    assert rows[f"zero1: {autocast}"]["status"] == "PASS" and f"zero3: {autocast}" in failed


def test_a_failed_resume_is_told_by_its_ranks_exception_and_keeps_its_logs_end(acceptance, tmp_path):
    """Under a launcher the log ends with its own lines (DeepSpeed's sigkill_handler, torchrun's ChildFailedError):
    the check names the rank's exception, and the record keeps the log's last lines (the logs stay on the machine).
    --only without the ddp job (here: the ZeRO-2 kill and resume alone) still checks."""
    args = SimpleNamespace(work=str(tmp_path), cpu=False, per_gpu=4, budget=None)
    suite = acceptance.Suite(args, 2)
    suite.plan(["kill"], {"resume-zero2"})
    assert "ddp" not in suite.jobs and {"zero2", "kill-zero2", "resume-zero2"} <= set(suite.jobs)
    for job in suite.jobs.values():
        job.result = {"exit": 0}
    killed = {"exit": -9, "killed_pids": [1, 2], "killed_at": ["checkpoint-10"], "alive_after_kill": []}
    suite.jobs["kill-zero2"].result = {**killed, "after_kill": ["checkpoint-10"], "results_after_kill": False}
    suite.jobs["resume-zero2"].result = {"exit": 1}
    (tmp_path / "logs").mkdir()
    log = ["noise"] * 50 + ["[rank1]: Traceback (most recent call last):", "[rank1]: RuntimeError: the cause",
           "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:",
           "[2026-11-28 15:02:37,762] [ERROR] [launch.py:259:sigkill_handler] ['python3', '-u', ...] exits with 1"]  # fmt: skip
    (tmp_path / "logs" / "resume-zero2.log").write_text("\n".join(log) + "\n")
    rows = {r["check"]: r for r in acceptance.check(suite)}
    failed = rows["zero2: the same command again resumes"]
    assert failed["status"] == "FAIL" and failed["detail"] == "exit 1: [rank1]: RuntimeError: the cause"
    assert len(failed["log_tail"]) == acceptance.FAILED_LOG_LINES and failed["log_tail"][-1] == log[-1]


def test_two_calls_make_one_record(acceptance, tmp_path):
    def run(parts, status):
        checks = [{"part": parts[0], "check": f"{parts[0]} works", "status": status, "detail": "", "command": "x"}]
        return {"parts": parts, "device": "H100", "gpus": 2, "date": "d", "commit": "c", "command": "c",
                "versions": {"torch": "2"}, "wall_s": 1, "checks": checks, "jobs": {}}  # fmt: skip

    record = tmp_path / "record"
    record.mkdir()
    acceptance.render(record, [run(["strategies", "kill"], "FAIL")])
    (tmp_path / "second.json").write_text(json.dumps({"runs": [run(["single", "vith"], "PASS")]}))
    acceptance.merge(record, tmp_path / "second.json")
    text = (record / "acceptance.md").read_text()
    assert "**1 of 2 checks pass or skip; 1 fail.**" in text and text.index("## strategies") < text.index("## single")
    (tmp_path / "again.json").write_text(json.dumps({"runs": [run(["strategies", "kill", "resume"], "PASS")]}))
    acceptance.merge(record, tmp_path / "again.json")  # a rerun of those parts replaces them
    assert "**2 of 2 checks pass or skip; 0 fail.**" in (record / "acceptance.md").read_text()


def test_a_kill_reaches_workers_in_sessions_of_their_own(acceptance):
    """torchrun starts each worker with start_new_session: killing the launcher's process group left them training."""
    import subprocess
    import sys
    import time

    worker = "import time; time.sleep(120)"
    launcher = (f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {worker!r}], "
                "start_new_session=True); time.sleep(120)")  # fmt: skip
    proc = subprocess.Popen([sys.executable, "-c", launcher], start_new_session=True)
    deadline = time.time() + 30
    import psutil

    while not psutil.Process(proc.pid).children() and time.time() < deadline:
        time.sleep(0.05)
    killed = acceptance.kill_tree(proc.pid)
    proc.wait(timeout=10)
    assert len(killed) == 2
    time.sleep(0.5)
    assert not [pid for pid in killed if acceptance._alive(pid)]


def test_the_compile_checks_read_the_line_after_the_log_prefix_and_the_card(acceptance, tmp_path):
    """The default command, short: eager (card) and its one WARNING line, as the logger prints it; asked for,
    compiled (card). A short default that compiled, or a line missing, fails."""
    suite = suite_for(acceptance, 1, tmp_path, parts=["single"])
    suite.jobs = {name: job for name, job in suite.jobs.items() if name in ("default", "compiled", "default-again")}
    assert suite.jobs["default-again"].needs == ("compiled",)  # the cache that run fills
    for job in suite.jobs.values():
        job.result = {"exit": 0}
    (tmp_path / "logs").mkdir()

    def run(name: str, compiled: bool, line: str) -> None:
        (tmp_path / name).mkdir(exist_ok=True)
        (tmp_path / name / "README.md").write_text(f"| torch_compile_regions | {compiled} |\n")
        (tmp_path / "logs" / f"{name}.log").write_text(
            f"12:00:00 WARNING vit_recipes.plan.plan: {line}\n" if line else ""
        )

    off = "Regional compilation off: 30 steps would not repay the compile (it pays from 1,000; ...)"
    run("default", False, off)
    run("compiled", True, "")
    again = "the default command, 400 steps after a compiled run: compiles from the cache, and one line says so"
    run("default-again", True, "Regional compilation on: 400 steps repay it from the compile cache (/c) (...)")
    rows = {r["check"]: r["status"] for r in acceptance.check(suite)}
    assert rows["the default command, short: eager, and one line says why"] == "PASS"
    assert rows["--torch_compile_regions true: trains compiled (the card says so)"] == "PASS"
    assert rows[again] == "PASS"
    run("default-again", True, "Regional compilation on: 400 steps repay it (...)")  # compiled cold: the cache missed
    assert {r["check"]: r["status"] for r in acceptance.check(suite)}[again] == "FAIL"
    # Compiled on one GPU: CUDA graphs said in one line, and the eager run's loss
    graphs = "compiled on one GPU: CUDA graphs, one line says so, loss at step 30 within 3% of eager's"
    assert rows[graphs] == "FAIL"  # no losses, no line
    fake_run(tmp_path / "default", {30: 2.60})
    fake_run(tmp_path / "compiled", {30: 2.61})
    run("compiled", True, "CUDA graphs on: each compiled layer launches its kernels as one graph (...)")
    assert {r["check"]: r["status"] for r in acceptance.check(suite)}[graphs] == "PASS"
    fake_run(tmp_path / "compiled", {30: 2.80})  # 8% off eager
    assert {r["check"]: r["status"] for r in acceptance.check(suite)}[graphs] == "FAIL"
    fake_run(tmp_path / "compiled", {30: 2.61})
    run("compiled", True, "")
    assert {r["check"]: r["status"] for r in acceptance.check(suite)}[graphs] == "FAIL"
    run("default", True, "Regional compilation on: 30 steps repay it")
    run("compiled", False, "")
    rows = {r["check"]: r["status"] for r in acceptance.check(suite)}
    assert rows["the default command, short: eager, and one line says why"] == "FAIL"
    assert rows["--torch_compile_regions true: trains compiled (the card says so)"] == "FAIL"


def test_a_passing_suite_drops_the_runs_checkpoints_and_keeps_what_its_chart_reads(acceptance, tmp_path):
    for path in ("zero2/checkpoint-10/optimizer.pt", "zero2/checkpoint-20/model.safetensors", "lora/checkpoint-10/x",
                 "zero2/trainer_state.json", "zero2/model.safetensors", "assets/checkpoint-1/weights"):  # fmt: skip
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_bytes(b"0" * 10)
    assert acceptance.drop_checkpoints(tmp_path) == 30
    left = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*") if p.is_file())
    assert left == ["assets/checkpoint-1/weights", "zero2/model.safetensors", "zero2/trainer_state.json"]


def test_a_passed_runs_checkpoints_are_trimmed_once_no_job_left_resumes_from_them(acceptance, tmp_path):
    """Every part in one call: a run's weights in its checkpoints go as soon as no pending or running job resumes in
    its folder or copies its checkpoint; their JSON stays for the checks."""
    suite = suite_for(acceptance, 2, tmp_path, parts=["resume"])
    base, seeded = suite.jobs["zero2"], suite.jobs["to1-zero2"]
    assert seeded.seed_from == base.output
    for name in ("checkpoint-10/model.safetensors", "checkpoint-10/global_step10/optim.pt", "checkpoint-10/latest",
                 "checkpoint-10/run_identity.json", "model.safetensors"):  # fmt: skip
        (base.output / name).parent.mkdir(parents=True, exist_ok=True)
        (base.output / name).write_bytes(b"0" * 10)
    base.result["exit"] = 0
    pending = {name: job for name, job in suite.jobs.items() if name != "zero2"}
    suite.trim_finished(pending)  # to1-zero2 will copy checkpoint-10: kept whole
    assert (base.output / "checkpoint-10/model.safetensors").is_file() and "trimmed" not in base.result
    suite.trim_finished({})  # nothing left to run
    left = sorted(p.relative_to(base.output).as_posix() for p in base.output.rglob("*") if p.is_file())
    assert left == ["checkpoint-10/run_identity.json", "model.safetensors"] and base.result["trimmed"] == 30


def test_the_zero3_command_as_typed_passes_when_the_gpus_train_and_fails_on_the_launchers_report(acceptance, tmp_path):
    """vith-as-typed on 2 GPUs: the run that trains on them and says so passes; the old outcome (our refusal, then
    accelerate's ChildFailedError) fails, as does a run without the line."""
    suite = suite_for(acceptance, 2, tmp_path, parts=["vith"])
    job, out = suite.jobs["vith-as-typed"], tmp_path / "vith-as-typed"
    fake_run(out, {s: 4.0 - 0.1 * s for s in range(1, 11)})
    (out / "README.md").write_text(
        "accelerate launch --config_file accelerate_configs/zero3.yaml --num_processes 2 run_image_classification.py"
    )
    (tmp_path / "logs").mkdir()
    log = tmp_path / "logs" / "vith-as-typed.log"
    said = ("12:00:00 WARNING vit_recipes.plan.plan: 8 processes were launched on this machine, which has 2 GPU(s): 6 "
            "exited before the process group and 2 train, global batch 32 (8 would have made 128); --num_processes "
            "2 launches only these\n")  # fmt: skip
    refused = ("error: 8 processes on this machine but only 2 GPU(s) visible: launch at most 2\nTraceback (most "
               "recent call last):\ntorch.distributed.elastic.multiprocessing.errors.ChildFailedError:\n")  # fmt: skip

    def status(text: str, exit_code: int) -> str:
        log.write_text(text)
        job.result = {"exit": exit_code, "command": "vith-as-typed"}
        rows = []
        acceptance.check_zero3_as_typed(suite, lambda *row: rows.append(row))
        return rows[0][3]

    assert status(said, 0) is True
    assert status(refused, 1) is False and status("", 0) is False


@pytest.mark.parametrize("cpu", [False, True])
def test_the_odd_files_job_passes_on_what_the_run_should_write_and_fails_where_a_replacement_is_scored(
    acceptance, tmp_path, cpu
):
    """odd-ddp: the photos' odd copy under DDP on every process (CPU processes with --cpu), evaluated in batches of 3,
    so the three unreadable validation files, sorted first, are one batch of one process. Its checks pass on what the
    run should write; they fail where the replaced images were scored, a note is missing or skipped_images.json lists
    a file the indexer leaves out."""
    from PIL import Image

    args = SimpleNamespace(work=str(tmp_path), cpu=cpu, per_gpu=4, budget=None)
    suite = acceptance.Suite(args, 2)
    suite.plan(["data"], {"odd-ddp"})
    assert set(suite.jobs) == {"odd-ddp"}
    job, out = suite.jobs["odd-ddp"], tmp_path / "odd-ddp"
    odd = f"--dataset_name {tmp_path}/assets/odd --decode_images per_batch --per_device_eval_batch_size 3"
    assert "--config_file accelerate_configs/ddp.yaml --num_processes 2" in command(suite, "odd-ddp")
    assert odd in command(suite, "odd-ddp") and job.gpus == (0 if cpu else 2) and ("--use_cpu" in job.argv) == cpu
    photos = tmp_path / "assets" / "photos"
    for split, count in (("train", 2), ("validation", 1)):
        for c in range(3):
            (photos / split / f"class_{c:04d}").mkdir(parents=True)
            for i in range(count):
                Image.new("RGB", (8, 8), (80 * c, 0, 0)).save(
                    photos / split / f"class_{c:04d}" / f"{c + 3 * i:08d}.jpg"
                )
    acceptance.build_odd_asset(tmp_path / "assets")
    validation = tmp_path / "assets" / "odd" / "validation"
    assert sorted(p.name for p in (validation / "class_0000").iterdir())[:3] == ["0-a.jpg", "0-b.jpg", "0-c.jpg"]
    readable = acceptance.odd_readable(validation)
    assert sorted(p.name for p in readable) == ["00000000.jpg", "00000001.jpg", "00000002.jpg", "saved.jfif"]
    assert not (tmp_path / "assets" / "odd.tmp").exists()

    out.mkdir()
    (tmp_path / "logs").mkdir()
    notes = [
        "validation: 3 unreadable image(s) left out of its evaluation",
        "train: 1 unreadable image(s) replaced in their batch by another of it",
        "train: 1 animated or multi-frame image(s): the first frame is used",
        "train: 1 high-bit-depth image(s) brighter than the white level 255 (set by the first 64 images): ...",
        "Left out 1 empty image file(s) (0 bytes): validation/class_0001/empty.jpg",
    ]
    left_out = "validation: 3 unreadable image(s) left out of this evaluation: its loss and metrics count the 4 others"
    (tmp_path / "logs" / "odd-ddp.log").write_text("".join(f"12:00:00 WARNING x: {x}\n" for x in [*notes, left_out]))
    (out / "README.md").write_text("\n".join(f"- {x}" for x in notes))
    unreadable = [("train", "class_0002/broken.jpg")] + [("validation", f"class_0000/0-{c}.jpg") for c in "abc"]
    skipped = {}
    for split, path in unreadable:
        skipped.setdefault(split, []).append(
            {"image": f"{tmp_path}/assets/odd/{split}/{path}", "problem": "unreadable"}
        )
    (out / "skipped_images.json").write_text(json.dumps(skipped))

    def per_class(supports) -> None:
        rows = "".join(f"class_{c:04d},{s},0.5\n" for c, s in enumerate(supports))
        (out / "per_class_accuracy_validation.csv").write_text("label,support,accuracy\n" + rows)

    def status() -> dict[str, str]:
        return {r["check"].split(": ", 1)[1]: r["status"] for r in acceptance.check(suite) if r["part"] == "data"}

    job.result = {"exit": 0, "command": "odd-ddp"}
    per_class([1, 1, 2])
    scored = "3 unreadable validation images as one evaluation batch on 2 processes: the 4 readable ones scored, none replaced"
    said = "the card and the log say what was left out, replaced and noted (unreadable, animated, 16-bit, empty files)"
    listed = "skipped_images.json lists the unreadable images by split"
    assert status() == {scored: "PASS", said: "PASS", listed: "PASS"}
    per_class([4, 1, 2])  # the three left out scored as copies of other images
    assert status()[scored] == "FAIL"
    (out / "README.md").write_text("\n".join(f"- {x}" for x in notes[1:]))
    skipped["validation"].append({"image": str(validation / "class_0001" / "empty.jpg"), "problem": "unreadable"})
    (out / "skipped_images.json").write_text(json.dumps(skipped))
    assert status() == {scored: "FAIL", said: "FAIL", listed: "FAIL"}
    job.result = {"exit": 1}
    assert status() == {"runs": "FAIL"}

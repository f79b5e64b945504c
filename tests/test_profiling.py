"""Profiler traces (--profile_steps), their analysis (trace_analysis) and the DeepSpeed flops profile."""

import gzip
import importlib
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, run_args

from vit_recipes.train.observability import flops_profiler_output, keep_flops_profile

sys.path.append(str(ROOT / "tools"))  # trace_analysis is a script there, not part of the package
trace_analysis = importlib.import_module("trace_analysis")

REGIONS = {"data", "augment", "forward", "backward", "optimizer_step"}
HAS_HTA = importlib.util.find_spec("hta") is not None


def profiled_run_args(data, model, out, *extra):
    return run_args(data, model, out, "--do_eval", "false", "--plots", "false", *extra)


def load_trace(path: Path) -> dict:
    with gzip.open(path, "rt") as f:
        return json.load(f)


def why_it_failed(result: subprocess.CompletedProcess) -> str:
    """The error lines of a failed launch (torchrun's own summary hides them at the end of stderr)."""
    lines = (result.stdout + result.stderr).splitlines()
    errors = [line for line in lines if "Error" in line or "error:" in line or "Traceback" in line]
    return "\n".join(errors[-30:]) + "\n...\n" + "\n".join(lines[-40:])


def detail(trace: dict) -> dict:
    """What each profiler option adds to a trace: memory events (--profile_memory), operator input shapes
    (--profile_record_shapes), Python frames (--profile_with_stack)."""
    events = trace["traceEvents"]
    return {
        "memory": sum(e.get("name") == "[memory]" for e in events),
        "shapes": sum("Input Dims" in e.get("args", {}) for e in events),
        "stack": sum(e.get("cat") == "python_function" for e in events),
    }


def assert_chrome_trace(trace: dict) -> None:
    """What Perfetto / chrome://tracing need: traceEvents whose complete events have name, ph, ts, dur, pid, tid."""
    events = trace["traceEvents"]
    complete = [e for e in events if e.get("ph") == "X"]
    assert complete
    for event in complete:
        assert {"name", "ts", "dur", "pid", "tid"} <= set(event), event
        assert isinstance(event["ts"], (int, float)) and event["dur"] >= 0


# --- Interval arithmetic used by the fallback analysis -----------------------------------------------------------


def test_interval_arithmetic():
    a = trace_analysis.merge([(0, 4), (2, 6), (8, 10), (10, 11)])
    assert a == [(0, 6), (8, 11)]
    assert trace_analysis.total(a) == 9
    assert trace_analysis.intersect(a, [(5, 9)]) == [(5, 6), (8, 9)]
    assert trace_analysis._subtract(a, [(1, 2), (9, 20)]) == [(0, 1), (2, 6), (8, 9)]


# --- Two processes on the CPU ---------------------------------------------------------------------------------


@pytest.mark.slow
def test_two_process_cpu_run_writes_one_trace_per_rank_and_a_report(cifar_like, tiny_vit, tmp_path):
    out = tmp_path / "ddp"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_port",
        str(29_500 + os.getpid() % 1000),
        str(ROOT / "run_image_classification.py"),
        *map(str, profiled_run_args(cifar_like, tiny_vit, out, "--max_steps", "6", "--profile_steps", "3-4")),
    ]
    result = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=env, timeout=240)
    assert result.returncode == 0, why_it_failed(result)

    profiler = out / "profiler"
    traces = sorted(profiler.glob("rank*.pt.trace.json.gz"))
    assert [p.name for p in traces] == ["rank0.pt.trace.json.gz", "rank1.pt.trace.json.gz"]
    for rank, path in enumerate(traces):
        trace = load_trace(path)
        assert_chrome_trace(trace)
        assert trace["distributedInfo"]["world_size"] == 2 and trace["distributedInfo"]["rank"] == rank
        assert trace["vit_recipes_profile"] == {
            "first_step": 3,
            "last_step": 4,
            "step_offset": 2,
            "world_size": 2,
            "rank": rank,
        }
        names = [e["name"] for e in trace["traceEvents"] if e.get("ph") == "X"]
        assert set(names) >= REGIONS, REGIONS - set(names)
        assert sum(n.startswith("ProfilerStep#") for n in names) == 2  # steps 3 and 4 only
        assert any(n.startswith("gloo:all_reduce") for n in names), "DDP's gradient all-reduce is in the trace"
        assert detail(trace) == {"memory": 0, "shapes": 0, "stack": 0}  # none of the profiler options by default
        assert (profiler / f"rank{rank}_ops.txt").read_text().count("aten::") > 5  # the profiler's own table
    history = json.loads((out / "trainer_state.json").read_text())["log_history"]
    train_logs = [e for e in history if "loss" in e]
    assert train_logs and all({"cpu_peak_rss_gib_rank0", "cpu_peak_rss_gib_rank1"} <= set(e) for e in train_logs)

    report = tmp_path / "report" / "traces.md"
    analysis = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "trace_analysis.py"), str(profiler), "--out", str(report)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=120,
    )
    assert analysis.returncode == 0, analysis.stderr[-3000:]
    text = report.read_text()
    assert "backend gloo, world size 2; steps 3-4" in text
    for rank in (0, 1):
        assert f"| ddp | {rank} | 2 |" in text  # one breakdown row per rank, 2 profiled steps each
    assert "fallback" in text  # CPU traces: HTA cannot analyse them, and the report says so
    assert ("HTA could not analyse" if HAS_HTA else "not installed") in text
    assert "gloo:all_reduce" in text
    for name in ("breakdown", "regions", "top_ops"):
        assert (report.parent / f"traces_{name}.png").stat().st_size > 5_000


@pytest.mark.slow
def test_the_trace_goes_to_profile_dir_with_what_its_options_add_when_training_ends_inside_the_window(
    cifar_like, tiny_vit, tmp_path, run_script
):
    """The trace goes to --profile_dir, with what --profile_memory, --profile_record_shapes and --profile_with_stack
    add (the two-process run above, without them, has none of it); training ends inside the window: the steps
    recorded are written."""
    out, traces = tmp_path / "run", tmp_path / "traces"
    options = ("--profile_memory", "true", "--profile_record_shapes", "true", "--profile_with_stack", "true")
    run_script(*profiled_run_args(cifar_like, tiny_vit, out, "--max_steps", "3", "--profile_steps", "2-10",
                                  "--profile_dir", traces, *options))  # fmt: skip
    assert not (out / "profiler").exists() and (traces / "rank0_ops.txt").is_file()
    trace = load_trace(traces / "rank0.pt.trace.json.gz")
    steps = [e["name"] for e in trace["traceEvents"] if e.get("name", "").startswith("ProfilerStep#")]
    assert len(steps) == 2  # steps 2 and 3 were recorded before training ended
    assert "distributedInfo" not in trace  # a single process
    found = detail(trace)  # seen: ~1,600 memory events, ~3,900 operators with shapes, ~13,000 Python frames
    assert all(count > 100 for count in found.values()), found


# --- Analysis of GPU traces and the comparison of two runs ------------------------------------------------------


def test_trace_report_compares_two_runs(tmp_path, fixture_records):
    traces = fixture_records / "traces"  # hand-built GPU traces (test fixtures)
    """Synthetic 2-rank GPU traces (tests/data, not measurements): ZeRO-3-like exposes more communication."""
    out = tmp_path / "cmp.md"
    trace_analysis.main([str(traces / "ddp"), str(traces / "zero3"), "--labels", "ddp", "zero3", "--out", str(out)])
    text = out.read_text()
    ddp = trace_analysis.analyze(traces / "ddp", use_hta=False).summary()
    zero3 = trace_analysis.analyze(traces / "zero3", use_hta=False).summary()
    for summary in (ddp, zero3):
        parts = summary["compute_fraction"] + summary["exposed_comm_fraction"] + summary["idle_fraction"]
        assert parts == pytest.approx(1.0)
        assert summary["kind"] == "gpu" and summary["ranks"] == 2
    assert zero3["exposed_comm_fraction"] > ddp["exposed_comm_fraction"]
    assert zero3["overlap_pct"] < ddp["overlap_pct"]
    assert "## Difference: zero3 vs ddp" in text
    assert "| ncclDevKernel_AllReduce_Sum_bf16_RING_LL |" in text  # top kernels and the kernel diff
    if HAS_HTA:
        assert "### HolisticTraceAnalysis: ddp" in text and "### HolisticTraceAnalysis: zero3" in text
        assert "COMMUNICATION" in text  # HTA's kernel-type breakdown
    for name in ("breakdown", "regions", "top_ops"):
        assert (tmp_path / f"cmp_{name}.png").read_bytes().startswith(b"\x89PNG")


def cuda_trace(rank: int, late_us: float) -> dict:
    """Two steps of a 2-rank CUDA trace laid out as torch 2.11 writes them (CPU and GPU `ProfilerStep#N`, launches
    matched to kernels by correlation, NCCL kernels on their own stream); rank 1 reaches the all-reduce `late_us`
    after rank 0. Per step (1000 us): forward [0, 300) launches a 200 us GEMM at 20; backward [300, 950) launches a
    300 us GEMM at 320 and the all-reduce at 610 (+ late_us), which ends 100 us after the last rank arrives; the
    host then waits outside the regions until 1000."""
    cpu, gpu = 100 + rank, rank
    events = [
        {"ph": "M", "name": "process_labels", "pid": gpu, "tid": 0, "args": {"labels": f"GPU {gpu}"}},
        {"ph": "M", "name": "process_labels", "pid": cpu, "tid": 0, "args": {"labels": "CPU"}},
    ]
    correlation = 0

    def span(cat, name, ts, dur, pid=cpu, tid=cpu, **args):
        events.append(
            {"ph": "X", "cat": cat, "name": name, "pid": pid, "tid": tid, "ts": ts, "dur": dur, "args": args}
        )

    def launch(name, launch_ts, start, dur, stream=7, **args):
        nonlocal correlation
        correlation += 1
        span("cuda_runtime", "cudaLaunchKernel", launch_ts, 5, correlation=correlation, **{"External id": correlation})
        span("kernel", name, start, dur, gpu, stream, device=gpu, stream=stream, correlation=correlation, **args)

    for step in (1, 2):
        s = 1_000_000.0 + 1000 * (step - 1)
        span("user_annotation", f"ProfilerStep#{step}", s, 1000)
        span("gpu_user_annotation", f"ProfilerStep#{step}", s + 20, 890, gpu, 7)  # the GPU copy: not a step
        span("user_annotation", "forward", s, 300)
        span("user_annotation", "backward", s + 300, 650)
        launch("nvjet_sm90_gemm_fwd", s + 10, s + 20, 200)
        launch("nvjet_sm90_gemm_bwd", s + 310, s + 320, 300)
        start = s + 610 + (late_us if rank == 1 else 0)
        end = s + 610 + late_us + 100
        nccl = "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)"
        launch(
            nccl,
            start - 10,
            start,
            end - start,
            stream=17,
            **{"Process Group Name": "0", "Collective name": "allreduce"},
        )
    return {
        "schemaVersion": 1,
        "distributedInfo": {"backend": "nccl", "rank": rank, "world_size": 2},
        "vit_recipes_profile": {"first_step": 20, "last_step": 21, "step_offset": 19, "world_size": 2, "rank": rank},
        "deviceProperties": [{"id": 0, "name": "NVIDIA H200"}, {"id": 1, "name": "NVIDIA H200"}],
        "traceEvents": events,
    }


def test_cuda_traces_steps_collective_waits_and_gpu_regions(tmp_path):
    """GPU traces: steps are the host's ProfilerStep spans only, HTA covers every profiled step, NCCL time splits
    into waiting for the late rank and transfer, and GPU idle time is placed in the host's regions."""
    folder = tmp_path / "profiler"
    folder.mkdir()
    for rank in (0, 1):
        with gzip.open(folder / f"rank{rank}.pt.trace.json.gz", "wt") as f:
            json.dump(cuda_trace(rank, late_us=200), f)
    result = trace_analysis.analyze(folder, "gpu", use_hta=HAS_HTA)
    r0, r1 = result.ranks
    for r in (r0, r1):
        assert r.steps == 2 and r.step_time_ms == pytest.approx(1.0)  # not 4 steps of mixed CPU and GPU spans
        assert r.per_step(r.compute_ms + r.exposed_comm_ms + r.idle_ms) == pytest.approx(1.0)
        assert r.per_step(r.compute_ms) == pytest.approx(0.5)
    assert result.kind == "gpu" and result.wait_note is None
    # rank 0 reached the all-reduce 200 us early: 300 us of kernel, 290 exposed, 200 of it waiting (190 exposed)
    assert r0.per_step(r0.comm_ms) == pytest.approx(0.3) and r0.per_step(r0.exposed_comm_ms) == pytest.approx(0.29)
    assert r0.per_step(r0.wait_ms) == pytest.approx(0.2) and r0.per_step(r0.exposed_wait_ms) == pytest.approx(0.19)
    assert r0.per_step(r0.idle_ms) == pytest.approx(0.21)
    assert r1.per_step(r1.comm_ms) == pytest.approx(0.1) and r1.wait_ms == pytest.approx(0.0)
    assert r1.per_step(r1.idle_ms) == pytest.approx(0.4)
    all_reduce = r0.collectives["AllReduce"]
    assert all_reduce["calls"] == 2 and all_reduce["wait_ms"] == pytest.approx(0.4)
    # GPU view of the regions: kernels by where they were launched, idle by where the host was
    assert r0.gpu_regions["forward"] == pytest.approx({"kernel_ms": 0.4, "idle_ms": 0.2})
    assert r0.gpu_regions["backward"] == pytest.approx({"kernel_ms": 1.18, "idle_ms": 0.12})
    assert r0.gpu_regions[trace_analysis.OUTSIDE] == pytest.approx({"kernel_ms": 0.0, "idle_ms": 0.1})
    assert r1.gpu_regions["backward"]["idle_ms"] == pytest.approx(0.5)  # rank 1's host was late
    if HAS_HTA:
        assert result.hta["steps"] == [1, 2]  # HTA leaves out the last step unless told not to
        spans = result.hta["temporal_breakdown"]["kernel_time(us)"].tolist()
        assert spans == pytest.approx([1890, 1890])  # first kernel of step 1 to last kernel of step 2
    out = trace_analysis.write_report([result], tmp_path / "report.md")
    text = out.read_text()
    assert "| gpu | 0 | 2 | 1.00 | 0.5 (50.0%) | 0.3 (30.0%) | 0.3 (29.0%) | 0.2 (19.0%) | 0.2 (21.0%) |" in text
    assert "### NCCL collectives: gpu" in text and "### GPU view of the labelled regions: gpu" in text

    # On different clocks the matched collectives no longer end together: no wait split, and the report says why
    with gzip.open(folder / "rank1.pt.trace.json.gz", "rt") as f:
        shifted = json.load(f)
    for event in shifted["traceEvents"]:
        if "ts" in event:
            event["ts"] += 5_000
    with gzip.open(folder / "rank1.pt.trace.json.gz", "wt") as f:
        json.dump(shifted, f)
    skewed = trace_analysis.analyze(folder, "gpu", use_hta=False)
    assert "clocks differ" in skewed.wait_note and skewed.ranks[0].wait_ms is None


def test_no_hta_falls_back_and_says_so(tmp_path, fixture_records):
    traces = fixture_records / "traces"
    out = trace_analysis.main([str(traces / "ddp"), "--no-hta", "--out", str(tmp_path / "r.md")])
    text = out.read_text()
    assert "trace JSON (fallback: HTA was switched off (--no-hta).)" in text
    assert "HolisticTraceAnalysis:" not in text


# --- DeepSpeed flops profiler ---------------------------------------------------------------------------------


def test_flops_profile_is_kept_with_the_run(tmp_path, caplog):
    assert flops_profiler_output({"flops_profiler": {"enabled": False, "output_file": "x"}}) is None
    assert flops_profiler_output({"zero_optimization": {"stage": 2}}) is None
    assert flops_profiler_output({"flops_profiler": {"enabled": True}}) is None  # stdout only: warned
    assert "no output_file" in caplog.text
    source = tmp_path / "flops.txt"
    source.write_text("-------------------------- DeepSpeed Flops Profiler --------------------------\n")
    assert flops_profiler_output({"flops_profiler": {"enabled": True, "output_file": str(source)}}) == str(source)
    kept = keep_flops_profile(str(source), str(tmp_path / "out"))
    assert Path(kept) == tmp_path / "out" / "profiler" / "deepspeed_flops_profile.txt"
    assert "Flops Profiler" in Path(kept).read_text()
    assert keep_flops_profile(str(tmp_path / "missing.txt"), str(tmp_path / "out")) is None


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed is not installed")
def test_deepspeed_flops_profiler_output_is_kept(cifar_like, tiny_vit, tmp_path):
    config = {
        "zero_optimization": {"stage": 0},
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "flops_profiler": {"enabled": True, "profile_step": 2, "output_file": str(tmp_path / "flops_profile.txt")},
    }
    (tmp_path / "ds.json").write_text(json.dumps(config))
    out = tmp_path / "run"
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "1",
        "--master_port",
        str(30_500 + os.getpid() % 1000),
        str(ROOT / "run_image_classification.py"),
        *map(
            str, profiled_run_args(cifar_like, tiny_vit, out, "--max_steps", "4", "--deepspeed", tmp_path / "ds.json")
        ),
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    result = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=env, timeout=240)
    assert result.returncode == 0, why_it_failed(result)
    kept = (out / "profiler" / "deepspeed_flops_profile.txt").read_text()
    assert "DeepSpeed Flops Profiler" in kept and "fwd flops per GPU" in kept

"""Write the strategy-report TEST FIXTURES: made-up benchmark records (kept in records/) and synthetic GPU traces
(written where the tests need them, by `write_traces`: traces are not kept in git).

    python tests/data/strategy_report/make_fixtures.py

Nothing here was measured. Every record has "fixture": true and the device "FIXTURE GPU (made-up numbers)";
the traces are hand-built Chrome traces shaped like PyTorch profiler GPU traces (kernels on a compute stream,
NCCL kernels on a communication stream) so that HolisticTraceAnalysis and tools/trace_analysis.py can read them.
"""

from __future__ import annotations

import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEVICE = "FIXTURE GPU (made-up numbers)"


def record(
    name,
    strategy,
    gpus,
    model,
    batch,
    ips=None,
    mem=None,
    mfu=None,
    wait=0.01,
    status="ok",
    error=None,
    states=None,
    **extra,
):
    metrics = {}
    if ips is not None:
        step = batch * gpus / ips
        metrics = {
            "train_images_per_second": ips,
            "train_step_time_s": round(step, 5),
            "train_time_20_steps_s": round(20 * step, 3),
            "train_data_wait_fraction": wait,
            "train_loss": 2.5,
        }
        if mfu is not None:
            metrics["train_mfu"] = mfu
        if mem is not None:
            metrics["train_peak_allocated_gib"], metrics["train_peak_reserved_gib"] = mem
        if states is not None:
            metrics["train_states_allocated_gib_max_rank"] = states
    return {
        "fixture": True,
        "name": name,
        "strategy": strategy,
        "gpus": gpus,
        "model": model,
        "per_device_batch": batch,
        "precision": "bf16",
        "device": DEVICE,
        "command": f"python benchmarks/run.py --strategy {strategy} --gpus {gpus} --batch {batch}",
        "git_commit": "0" * 40,
        "versions": {"torch": "0.0.0-fixture", "transformers": "0.0.0-fixture"},
        "status": status,
        "failure": "oom" if status == "failed" else None,
        "error": error,
        "metrics": metrics,
        **extra,
    }


RECORDS = [
    # vit-base
    record("base-single-b64", "single", 1, "vit-base", 64, 1000, (10.0, 11.0), 0.30),
    record("base-single-b128", "single", 1, "vit-base", 128, 1100, (18.0, 19.0), 0.33),
    record(
        "base-single-b256",
        "single",
        1,
        "vit-base",
        256,
        status="failed",
        error="torch.OutOfMemoryError: CUDA out of memory",
    ),
    record("base-ddp-b64", "ddp", 2, "vit-base", 64, 1900, (10.5, 11.5), 0.285),
    record("base-ddp-b128", "ddp", 2, "vit-base", 128, 2120, (18.6, 19.5), 0.318, trace_dir="traces/ddp", states=1.34),
    record(
        "base-ddp-b256", "ddp", 2, "vit-base", 256, status="failed", error="torch.OutOfMemoryError: CUDA out of memory"
    ),
    record("base-ddp4-b128", "ddp", 4, "vit-base", 128, 4000, (18.6, 19.5), 0.30),
    record("base-zero2-b64", "zero2", 2, "vit-base", 64, 1800, (8.0, 9.0), 0.27),
    record("base-zero2-b128", "zero2", 2, "vit-base", 128, 2050, (15.0, 16.0), 0.307),
    record("base-zero2-b256", "zero2", 2, "vit-base", 256, 2150, (29.0, 30.5), 0.322),
    record("base-zero3-b64", "zero3", 2, "vit-base", 64, 1500, (6.0, 7.0), 0.225),
    record(
        "base-zero3-b128",
        "zero3",
        2,
        "vit-base",
        128,
        1850,
        (12.5, 13.5),
        0.277,
        trace_dir="traces/zero3",
        states=0.73,
    ),
    record("base-zero3-offload-b64", "zero3_offload", 2, "vit-base", 64, 400, (3.0, 4.0), 0.06),
    record("base-zero3-offload-b128", "zero3_offload", 2, "vit-base", 128, 600, (5.5, 6.5), 0.09),
    record("base-fsdp2-b64", "fsdp2", 2, "vit-base", 64, 1550, (6.2, 7.1), 0.232),
    record("base-fsdp2-b128", "fsdp2", 2, "vit-base", 128, 1900, (12.8, 13.9), 0.285),
    # vit-huge
    record(
        "huge-single-b16",
        "single",
        1,
        "vit-huge",
        16,
        status="failed",
        error="torch.OutOfMemoryError: CUDA out of memory",
    ),
    record(
        "huge-ddp-b16", "ddp", 2, "vit-huge", 16, status="failed", error="torch.OutOfMemoryError: CUDA out of memory"
    ),
    record("huge-zero3-b16", "zero3", 2, "vit-huge", 16, 150, (60.0, 64.0), 0.35),
    record("huge-fsdp2-b16", "fsdp2", 2, "vit-huge", 16, 160, (58.0, 62.0), 0.37),
    record("huge-zero3-offload-b16", "zero3_offload", 2, "vit-huge", 16, 40, (30.0, 32.0), 0.09),
]

# A record with most keys missing (the generator must cope) and a file that is not a record at all.
SPARSE = {
    "fixture": True,
    "name": "base-zero1-sparse",
    "strategy": "zero1",
    "gpus": 2,
    "model": "vit-base",
    "metrics": {"train_images_per_second": 2000},
}
NOT_A_RECORD = {"log_history": [{"loss": 1.0, "step": 1}], "global_step": 1}


def trace(rank: int, world: int, comm_scale: float, steps: int = 3) -> dict:
    """Two streams: compute kernels (7) and an NCCL all-reduce (20) overlapping the tail of the backward."""
    pid = tid = 1000 + rank
    events, ts, corr = [], 1_000.0, 0
    for step in range(steps):
        start = ts
        for region, length in (("data", 40.0), ("forward", 300.0), ("backward", 600.0), ("optimizer_step", 80.0)):
            events.append(
                {
                    "ph": "X",
                    "cat": "user_annotation",
                    "name": region,
                    "pid": pid,
                    "tid": tid,
                    "ts": ts,
                    "dur": length,
                    "args": {},
                }
            )
            kernels = {
                "data": [],
                "forward": [("sm90_xmma_gemm_bf16bf16_bf16f32", 250.0)],
                "backward": [("sm90_xmma_gemm_bf16bf16_bf16f32", 320.0), ("vectorized_elementwise_kernel", 60.0)],
                "optimizer_step": [("multi_tensor_apply_kernel", 50.0)],
            }[region]
            k_ts = ts + 10
            for name, dur in kernels:
                corr += 1
                events.append(
                    {
                        "ph": "X",
                        "cat": "cuda_runtime",
                        "name": "cudaLaunchKernel",
                        "pid": pid,
                        "tid": tid,
                        "ts": k_ts - 8,
                        "dur": 4,
                        "args": {"correlation": corr, "External id": corr},
                    }
                )
                events.append(
                    {
                        "ph": "X",
                        "cat": "kernel",
                        "name": name,
                        "pid": 0,
                        "tid": 7,
                        "ts": k_ts,
                        "dur": dur,
                        "args": {"device": 0, "stream": 7, "correlation": corr, "External id": corr},
                    }
                )
                k_ts += dur + 5
            if region == "backward":
                corr += 1
                comm = 300.0 * comm_scale
                events.append(
                    {
                        "ph": "X",
                        "cat": "cuda_runtime",
                        "name": "cudaLaunchKernel",
                        "pid": pid,
                        "tid": tid,
                        "ts": ts + 200,
                        "dur": 4,
                        "args": {"correlation": corr, "External id": corr},
                    }
                )
                events.append(
                    {
                        "ph": "X",
                        "cat": "kernel",
                        "name": "ncclDevKernel_AllReduce_Sum_bf16_RING_LL",
                        "pid": 0,
                        "tid": 20,
                        "ts": ts + 210,
                        "dur": comm,
                        "args": {"device": 0, "stream": 20, "correlation": corr, "External id": corr},
                    }
                )
                length = max(length, 210 + comm + 10)
                events[-1 - 2 * len(kernels) - 2]["dur"] = length  # stretch the backward region over the all-reduce
            ts += length
        events.append(
            {
                "ph": "X",
                "cat": "user_annotation",
                "name": f"ProfilerStep#{step + 1}",
                "pid": pid,
                "tid": tid,
                "ts": start,
                "dur": ts - start,
                "args": {},
            }
        )
    return {
        "schemaVersion": 1,
        "fixture": "synthetic trace, not a measurement",
        "distributedInfo": {"backend": "nccl", "rank": rank, "world_size": world},
        "vit_recipes_profile": {
            "first_step": 20,
            "last_step": 22,
            "step_offset": 19,
            "world_size": world,
            "rank": rank,
        },
        "deviceProperties": [{"id": 0, "name": DEVICE}],
        "traceEvents": events,
    }


def write_traces(records: Path) -> Path:
    """The two runs' synthetic traces under records/traces (the records' trace_dir points there); returns it."""
    for name, scale in (("ddp", 1.0), ("zero3", 2.5)):
        folder = records / "traces" / name
        folder.mkdir(parents=True, exist_ok=True)
        for rank in range(2):
            (folder / f"rank{rank}.pt.trace.json").write_text(json.dumps(trace(rank, 2, scale)) + "\n")
    return records / "traces"


def main() -> None:
    records = HERE / "records"
    records.mkdir(exist_ok=True)
    for item in RECORDS:
        (records / f"{item['name']}.json").write_text(json.dumps(item, indent=1) + "\n")
    (records / "sparse.json").write_text(json.dumps(SPARSE, indent=1) + "\n")
    (records / "base-ddp-b128.trainer_state.json").write_text(json.dumps(NOT_A_RECORD) + "\n")


if __name__ == "__main__":
    main()

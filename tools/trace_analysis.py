"""Read profiler traces (one per rank, from --profile_steps) and write a markdown report with plots.

    python tools/trace_analysis.py outputs/run/profiler
    python tools/trace_analysis.py runs/ddp/profiler runs/zero3/profiler --labels ddp zero3 --out cmp.md

Per rank: temporal breakdown (compute / communication / idle, in ms per step and as shares), communication-
computation overlap, time per labelled region (data, augment, forward, backward, optimizer_step), top kernels (GPU)
or operators (CPU), and with two trace folders, the difference between the runs. GPU traces also get: each NCCL
collective's time, how much of it was spent waiting for the other ranks to arrive (matched across the ranks'
traces), and how GPU kernel time and GPU idle time fall into the labelled regions.

GPU traces are also analysed with HolisticTraceAnalysis (pip install HolisticTraceAnalysis) when it is installed
and can read them; otherwise (HTA missing, or CPU-only traces: HTA needs GPU kernels) the report says why. The
tables of this module come from its own reading of the Chrome trace JSON, with these definitions:

- Steps: the profiler's `ProfilerStep#N` spans on the host (CPU) thread. GPU traces repeat them on the GPU
  timeline (category gpu_user_annotation); those are not steps and are ignored. The window analysed is the first
  step's start to the last step's end; HTA is given every profiled step (include_last_profiler_step) so that both
  cover the same steps.
- GPU: communication = NCCL kernels (names starting with `nccl`, as in HTA); compute = every other kernel, memcpy
  and memset (HTA counts memcpy/memset as non-compute; they are under 1% of these steps); idle = nothing runs on
  any stream.
- CPU: compute = time the training thread is inside an operator; communication = gloo/nccl/c10d collectives on
  any thread (gloo runs them on its own threads); idle = neither.
- exposed communication = communication time with no compute running at the same moment (what it costs the
  step); overlap = share of communication time hidden under compute.
- waiting for other ranks (GPU, two or more ranks' traces on one clock): an NCCL kernel starts when its rank
  reaches the collective and cannot finish before the last rank arrives; the time from its start to the last
  rank's start is waiting, the rest is the transfer. A long exposed collective with a short transfer means a rank
  that arrived late (host-bound or imbalanced), not a slow link.
"""

from __future__ import annotations

import argparse
import gzip
import json
import logging
import os
import re
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from tqdm.auto import tqdm

logger = logging.getLogger(__name__)

REGIONS = ("data", "augment", "forward", "backward", "optimizer_step")
COMM_NAME = re.compile(
    r"nccl|gloo:|c10d::|record_param_comms|all_?reduce|all_?gather|reduce_?scatter|all_?to_?all", re.IGNORECASE
)
DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
NCCL_KERNEL = re.compile(r"^nccl", re.IGNORECASE)  # HTA: ^nccl.*Kernel
NCCL_COLLECTIVE = re.compile(r"^nccl(?:Dev)?Kernel_([A-Za-z]+)")  # ncclDevKernel_AllGather_RING_LL -> AllGather
LAUNCH_CATEGORIES = ("cuda_runtime", "cuda_driver")  # cudaLaunchKernel, cuLaunchKernelEx, cudaMemcpyAsync, ...
STEP_NAME = re.compile(r"^ProfilerStep#(\d+)$")
OUTSIDE = "outside regions"
CLOCK_SKEW_US = 500.0  # matched collectives end within this on one clock; more: the ranks' clocks differ


def is_host_step(event: dict) -> bool:
    """A `ProfilerStep#N` span of the host thread (GPU traces repeat it as a gpu_user_annotation: not a step)."""
    return bool(STEP_NAME.match(str(event.get("name", "")))) and not str(event.get("cat", "")).startswith("gpu_")


def collective_type(kernel_name: str) -> str:
    match = NCCL_COLLECTIVE.match(kernel_name)
    return match.group(1) if match else "other NCCL"


# --- Interval arithmetic (microseconds) -----------------------------------------------------------------------


def merge(intervals) -> list[tuple[float, float]]:
    """Sorted, disjoint union of (start, end) intervals."""
    out: list[list[float]] = []
    for start, end in sorted(intervals):
        if end <= start:
            continue
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return [(a, b) for a, b in out]


def total(merged) -> float:
    return sum(b - a for a, b in merged)


def intersect(a, b) -> list[tuple[float, float]]:
    """Intersection of two merged interval lists."""
    i = j = 0
    out = []
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if start < end:
            out.append((start, end))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def clip(merged, window: tuple[float, float]) -> list[tuple[float, float]]:
    return intersect(merged, [window])


# --- Loading --------------------------------------------------------------------------------------------------


def find_trace_files(directory: str | os.PathLike) -> list[Path]:
    directory = Path(directory)
    if directory.is_file():
        return [directory]
    if not directory.is_dir():
        raise FileNotFoundError(f"trace folder not found: {directory}")
    files = sorted(p for p in directory.iterdir() if p.name.endswith((".json", ".json.gz")))
    preferred = [p for p in files if ".pt.trace." in p.name]
    return preferred or files


def load_trace(path: str | os.PathLike) -> dict:
    path = Path(path)
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        trace = json.load(f)
    if isinstance(trace, list):  # a bare event array is valid Chrome trace JSON too
        trace = {"traceEvents": trace}
    if not isinstance(trace, dict) or not isinstance(trace.get("traceEvents"), list):
        raise ValueError(f"{path} is not a Chrome trace (no traceEvents)")
    return trace


def trace_rank(trace: dict, path: Path, default: int) -> int:
    for key in ("distributedInfo", "vit_recipes_profile"):
        info = trace.get(key)
        if isinstance(info, dict) and isinstance(info.get("rank"), int):
            return info["rank"]
    match = re.search(r"rank[_-]?(\d+)", path.name)
    return int(match.group(1)) if match else default


# --- Per-rank summary from the trace JSON ---------------------------------------------------------------------


@dataclass
class RankSummary:
    rank: int
    path: str
    kind: str  # "gpu" (device kernels present) or "cpu"
    steps: int
    step_time_ms: float | None
    window_ms: float
    compute_ms: float
    comm_ms: float
    exposed_comm_ms: float
    idle_ms: float
    regions_ms: dict[str, float] = field(default_factory=dict)  # host time per step
    top_ops: list[tuple[str, float, int]] = field(default_factory=list)  # (name, total ms, calls)
    op_totals_ms: dict[str, float] = field(default_factory=dict)
    # GPU only. Per collective type (AllReduce, AllGather, ...), totals over the window: calls, kernel_ms,
    # exposed_ms, and once matched across ranks wait_ms, exposed_wait_ms.
    collectives: dict[str, dict[str, float]] = field(default_factory=dict)
    # GPU only. Per labelled region (+ OUTSIDE), totals over the window: kernel_ms (GPU time of the kernels
    # launched while the host was in the region) and idle_ms (GPU idle while the host was in the region).
    gpu_regions: dict[str, dict[str, float]] = field(default_factory=dict)
    wait_ms: float | None = None  # GPU: NCCL time spent waiting for other ranks (None: not matched)
    exposed_wait_ms: float | None = None
    _nccl: list = field(default_factory=list, repr=False)  # (key, start, end, collective) for matching
    _exposed: list = field(default_factory=list, repr=False)  # exposed communication intervals (us)
    _window: tuple = field(default=(0.0, 0.0), repr=False)

    def fraction(self, value_ms: float) -> float:
        return value_ms / self.window_ms if self.window_ms > 0 else 0.0

    def per_step(self, value_ms: float | None) -> float | None:
        return None if value_ms is None else value_ms / max(self.steps, 1)

    @property
    def overlap_pct(self) -> float | None:
        if self.comm_ms <= 0:
            return None
        return 100.0 * (self.comm_ms - self.exposed_comm_ms) / self.comm_ms


def _self_times(events: list[dict]) -> dict[str, list[float]]:
    """Self time (us) and call count per name for host events, per thread (children are nested spans)."""
    by_thread = defaultdict(list)
    for e in events:
        by_thread[(e.get("pid"), e.get("tid"))].append(e)
    totals: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for thread_events in by_thread.values():
        thread_events.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack: list[list] = []  # [end, name, child time]
        for e in thread_events:
            start, end = e["ts"], e["ts"] + e["dur"]
            while stack and stack[-1][0] <= start:
                _close(stack.pop(), totals)
            if stack:
                stack[-1][2] += min(end, stack[-1][0]) - start
            stack.append([end, e, 0.0])
        while stack:
            _close(stack.pop(), totals)
    return totals


def _close(frame, totals) -> None:
    end, event, child = frame
    entry = totals[event["name"]]
    entry[0] += max(0.0, event["dur"] - child)
    entry[1] += 1


def summarize_rank(trace: dict, path: Path, rank: int, top: int = 15) -> RankSummary:
    events = [
        e
        for e in trace["traceEvents"]
        if e.get("ph") == "X" and isinstance(e.get("ts"), (int, float)) and isinstance(e.get("dur"), (int, float))
    ]
    steps = [e for e in events if is_host_step(e)]
    host = [e for e in events if e.get("cat") in ("cpu_op", "user_annotation", "python_function")]
    device = [e for e in events if e.get("cat") in DEVICE_CATEGORIES]
    if steps:
        main_thread = (steps[0].get("pid"), steps[0].get("tid"))
        window = (min(e["ts"] for e in steps), max(e["ts"] + e["dur"] for e in steps))
    else:
        counts = defaultdict(int)
        for e in host:
            counts[(e.get("pid"), e.get("tid"))] += 1
        main_thread = max(counts, key=counts.get) if counts else (None, None)
        spans = host + device
        window = (min(e["ts"] for e in spans), max(e["ts"] + e["dur"] for e in spans)) if spans else (0.0, 0.0)
    window_us = window[1] - window[0]
    device = [e for e in device if window[0] <= e["ts"] < window[1]]  # kernels of the profiled steps

    def union(selected):
        return clip(merge((e["ts"], e["ts"] + e["dur"]) for e in selected), window)

    region_events = [
        e
        for e in host
        if e.get("cat") == "user_annotation" and e["name"] in REGIONS and (e.get("pid"), e.get("tid")) == main_thread
    ]
    collectives: dict[str, dict[str, float]] = {}
    gpu_regions: dict[str, dict[str, float]] = {}
    nccl_kernels = []
    if device:
        kind = "gpu"
        comm_events = [e for e in device if NCCL_KERNEL.match(e["name"])]
        comm = union(comm_events)
        compute = union(e for e in device if not NCCL_KERNEL.match(e["name"]))
        busy = merge(comm + compute)
        compute_us = total(compute)
        exposed = _subtract(comm, compute)
        kernel_totals: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
        for e in device:
            kernel_totals[e["name"]][0] += e["dur"]
            kernel_totals[e["name"]][1] += 1
        op_totals = kernel_totals
        by_collective: dict[str, list[tuple[float, float]]] = defaultdict(list)
        for e in sorted(comm_events, key=lambda e: e["ts"]):
            name = collective_type(e["name"])
            args = e.get("args") or {}
            span = (e["ts"], e["ts"] + e["dur"])
            nccl_kernels.append(((args.get("Process Group Name"), e["name"]), *span, name))
            by_collective[name].append(span)
        for name, spans in sorted(by_collective.items()):
            mine = clip(merge(spans), window)
            collectives[name] = {
                "calls": len(spans),
                "kernel_ms": total(mine) / 1e3,
                "exposed_ms": total(intersect(mine, exposed)) / 1e3,
            }
        gpu_regions = _gpu_regions(events, device, region_events, busy, window)
    else:
        kind = "cpu"
        comm = union(e for e in host if COMM_NAME.search(str(e.get("name", ""))))
        on_main = [e for e in host if (e.get("pid"), e.get("tid")) == main_thread]
        main_ops = union(e for e in on_main if e.get("cat") == "cpu_op")
        # The training thread's operators, minus the collectives it launches or waits on itself.
        compute = _subtract(main_ops, union(e for e in on_main if COMM_NAME.search(str(e.get("name", "")))))
        busy = merge(comm + main_ops)
        compute_us = total(compute)
        exposed = _subtract(merge(comm + main_ops), compute)
        op_totals = _self_times(
            [e for e in host if e.get("cat") == "cpu_op" or COMM_NAME.search(str(e.get("name", "")))]
        )
        op_totals = {k: v for k, v in op_totals.items() if not STEP_NAME.match(k) and k not in REGIONS}
    exposed_us = total(exposed)
    comm_us = total(comm)
    idle_us = max(0.0, window_us - total(busy))

    regions: dict[str, float] = defaultdict(float)
    for e in region_events:
        regions[e["name"]] += e["dur"]
    n_steps = len(steps)
    per = max(n_steps, 1)
    ranked = sorted(op_totals.items(), key=lambda kv: -kv[1][0])
    return RankSummary(
        rank=rank,
        path=str(path),
        kind=kind,
        steps=n_steps,
        step_time_ms=(sum(e["dur"] for e in steps) / n_steps / 1e3) if n_steps else None,
        window_ms=window_us / 1e3,
        compute_ms=compute_us / 1e3,
        comm_ms=comm_us / 1e3,
        exposed_comm_ms=exposed_us / 1e3,
        idle_ms=idle_us / 1e3,
        regions_ms={name: regions.get(name, 0.0) / per / 1e3 for name in REGIONS},
        top_ops=[(name, value[0] / 1e3, int(value[1])) for name, value in ranked[:top]],
        op_totals_ms={name: value[0] / 1e3 for name, value in op_totals.items()},
        collectives=collectives,
        gpu_regions=gpu_regions,
        _nccl=nccl_kernels,
        _exposed=exposed,
        _window=window,
    )


def _exclusive_spans(region_events: list[dict]) -> dict[str, list[tuple[float, float]]]:
    """Host time of each region without the regions nested in it (e.g. optimizer_step inside backward)."""
    spans = [(e["ts"], e["ts"] + e["dur"], e["name"]) for e in region_events]
    out: dict[str, list] = defaultdict(list)
    for start, end, name in spans:
        inner = merge((s, t) for s, t, n in spans if start <= s and t <= end and (s, t) != (start, end))
        out[name] += _subtract([(start, end)], inner)
    return {name: merge(v) for name, v in out.items()}


def _gpu_regions(events, device, region_events, busy, window) -> dict[str, dict[str, float]]:
    """Per labelled region: GPU time of the kernels launched in it, and GPU idle time while the host was in it.

    A kernel belongs to the region whose host span contains its launch call (cudaLaunchKernel & co., matched by
    correlation id), whichever thread launched it: autograd's threads launch the backward kernels while the main
    thread sits in `backward`.
    """
    launches = {}
    for e in events:
        if e.get("cat") in LAUNCH_CATEGORIES:
            correlation = (e.get("args") or {}).get("correlation")
            if correlation is not None:
                launches[correlation] = e["ts"]
    exclusive = _exclusive_spans(region_events)
    inside = merge(iv for spans in exclusive.values() for iv in spans)
    exclusive[OUTSIDE] = _subtract([window], inside)
    launched: dict[str, list] = defaultdict(list)
    for e in device:
        ts = launches.get((e.get("args") or {}).get("correlation"))
        name = OUTSIDE
        if ts is not None:
            for region, spans in exclusive.items():
                if region != OUTSIDE and any(a <= ts < b for a, b in spans):
                    name = region
                    break
        launched[name].append((e["ts"], e["ts"] + e["dur"]))
    idle = _subtract([window], busy)
    return {
        name: {
            "kernel_ms": total(clip(merge(launched.get(name, [])), window)) / 1e3,
            "idle_ms": total(intersect(idle, spans)) / 1e3,
        }
        for name, spans in ((n, exclusive.get(n, [])) for n in (*REGIONS, OUTSIDE))
    }


def match_collectives(ranks: list[RankSummary]) -> str | None:
    """Split each rank's NCCL time into waiting for the other ranks and transfer; returns why not, if it can't.

    The n-th kernel of one (process group, kernel name) is the same collective on every rank that has it (NCCL
    needs all ranks to issue a communicator's collectives in one order). On one clock (ranks of one host, or
    synchronised hosts) the matched kernels end together; the wait of a rank is from its kernel's start to the
    last rank's start.
    """
    gpu = [r for r in ranks if r.kind == "gpu" and r._nccl]
    if len(gpu) < 2:
        return "needs the traces of two or more ranks with NCCL kernels"
    by_key: list[dict] = []
    for r in gpu:
        keyed = defaultdict(list)
        for key, start, end, name in r._nccl:
            keyed[key].append((start, end, name))
        by_key.append(keyed)
    waits: list[list] = [[] for _ in gpu]  # per rank: (start, end, collective)
    skews, unmatched = [], 0
    for key in set().union(*by_key):
        holders = [i for i, keyed in enumerate(by_key) if key in keyed]
        lengths = {len(by_key[i][key]) for i in holders}
        if len(holders) < 2 or len(lengths) > 1:
            unmatched += sum(len(by_key[i][key]) for i in holders)
            continue
        for instance in zip(*(by_key[i][key] for i in holders)):
            arrival = max(start for start, _, _ in instance)
            ends = [end for _, end, _ in instance]
            skews.append(max(ends) - min(ends))
            for i, (start, end, name) in zip(holders, instance):
                if arrival > start:
                    waits[i].append((start, min(arrival, end), name))
    if not skews:
        return "no NCCL kernel could be matched across the ranks"
    skews.sort()
    median_skew = skews[len(skews) // 2]
    if median_skew > CLOCK_SKEW_US:
        return f"matched collectives end {median_skew / 1e3:.2f} ms apart (median): the ranks' clocks differ"
    for r, mine in zip(gpu, waits):
        window = [r._window]
        every = clip(merge((a, b) for a, b, _ in mine), r._window)
        r.wait_ms = total(every) / 1e3
        r.exposed_wait_ms = total(intersect(every, r._exposed)) / 1e3
        for name, stats in r.collectives.items():
            theirs = intersect(merge((a, b) for a, b, n in mine if n == name), window)
            stats["wait_ms"] = total(theirs) / 1e3
            stats["exposed_wait_ms"] = total(intersect(theirs, r._exposed)) / 1e3
    if unmatched:
        logger.info("%d NCCL kernels had no counterpart on the other ranks (not in the wait split)", unmatched)
    return None


def _subtract(a, b) -> list[tuple[float, float]]:
    """a minus b, both merged."""
    out = []
    for start, end in a:
        cursor = start
        for b_start, b_end in b:
            if b_end <= cursor or b_start >= end:
                continue
            if b_start > cursor:
                out.append((cursor, b_start))
            cursor = max(cursor, b_end)
        if cursor < end:
            out.append((cursor, end))
    return out


# --- HolisticTraceAnalysis ------------------------------------------------------------------------------------


def run_hta(directory: str | os.PathLike) -> dict:
    """HTA's temporal breakdown, overlap and kernel breakdown; raises when HTA is missing or finds nothing."""
    from importlib.metadata import version

    from hta.trace_analysis import TraceAnalysis  # ImportError when not installed

    hta_logger = logging.getLogger("hta")
    level = hta_logger.level
    hta_logger.setLevel(logging.ERROR)
    try:
        # HTA leaves out the last ProfilerStep by default (it may be cut short); --profile_steps records whole
        # steps, and a window of two would lose half its steps: analyse them all, as the trace JSON tables do.
        analyzer = TraceAnalysis(trace_dir=str(directory), include_last_profiler_step=True)
        steps = [int(s) for s in analyzer.get_profiler_steps()] if hasattr(analyzer, "get_profiler_steps") else None
        breakdown = analyzer.get_temporal_breakdown(visualize=False)
        overlap = analyzer.get_comm_comp_overlap(visualize=False)
        kernel_types, kernels = analyzer.get_gpu_kernel_breakdown(visualize=False, num_kernels=10)
    finally:
        hta_logger.setLevel(level)
    if breakdown.empty or kernels.empty:
        raise ValueError("HTA found no GPU kernels in these traces")
    return {
        "version": version("HolisticTraceAnalysis"),
        "temporal_breakdown": breakdown,
        "overlap": overlap,
        "kernel_types": kernel_types,
        "kernels": kernels,
        "steps": steps,
    }


# --- One folder of traces -------------------------------------------------------------------------------------


@dataclass
class TraceSet:
    label: str
    directory: str
    ranks: list[RankSummary]
    metadata: dict
    hta: dict | None = None
    hta_note: str | None = None  # why HTA was not used
    wait_note: str | None = None  # why NCCL time could not be split into waiting and transfer (GPU)

    @property
    def kind(self) -> str:
        return "gpu" if any(r.kind == "gpu" for r in self.ranks) else "cpu"

    def mean(self, attribute: str) -> float | None:
        values = [getattr(r, attribute) for r in self.ranks if getattr(r, attribute) is not None]
        return sum(values) / len(values) if values else None

    def mean_per_step(self, attribute: str) -> float | None:
        values = [r.per_step(getattr(r, attribute)) for r in self.ranks if getattr(r, attribute) is not None]
        return sum(values) / len(values) if values else None

    def collectives_per_step(self) -> dict[str, dict[str, float]]:
        """Rank-averaged per-step numbers of each NCCL collective type."""
        out: dict[str, dict[str, float]] = {}
        names = sorted({n for r in self.ranks for n in r.collectives})
        for name in names:
            stats = defaultdict(float)
            for r in self.ranks:
                for key, value in r.collectives.get(name, {}).items():
                    stats[key] += r.per_step(value) / len(self.ranks)
            out[name] = dict(stats)
        return out

    def gpu_regions_per_step(self) -> dict[str, dict[str, float]]:
        """Rank-averaged per-step GPU kernel and idle time of each labelled region (GPU traces)."""
        ranks = [r for r in self.ranks if r.gpu_regions]
        return {
            name: {
                key: sum(r.per_step(r.gpu_regions[name][key]) for r in ranks) / len(ranks)
                for key in ("kernel_ms", "idle_ms")
            }
            for name in (*REGIONS, OUTSIDE)
            if ranks
        }

    def summary(self) -> dict:
        """Rank-averaged numbers (used by the strategy report). Fractions are of the profiled window, `*_ms` are
        per step."""
        if not self.ranks:
            return {}
        windows = sum(r.window_ms for r in self.ranks) or 1.0
        hta = self.hta
        out = {
            "ranks": len(self.ranks),
            "kind": self.kind,
            "step_time_ms": self.mean("step_time_ms"),
            "compute_ms": self.mean_per_step("compute_ms"),
            "comm_ms": self.mean_per_step("comm_ms"),
            "exposed_comm_ms": self.mean_per_step("exposed_comm_ms"),
            "idle_ms": self.mean_per_step("idle_ms"),
            "wait_ms": self.mean_per_step("wait_ms"),
            "exposed_wait_ms": self.mean_per_step("exposed_wait_ms"),
            "collectives": self.collectives_per_step(),
            "compute_fraction": sum(r.compute_ms for r in self.ranks) / windows,
            "comm_fraction": sum(r.comm_ms for r in self.ranks) / windows,
            "exposed_comm_fraction": sum(r.exposed_comm_ms for r in self.ranks) / windows,
            "idle_fraction": sum(r.idle_ms for r in self.ranks) / windows,
            "overlap_pct": self.mean("overlap_pct"),
            "regions_ms": {k: sum(r.regions_ms.get(k, 0.0) for r in self.ranks) / len(self.ranks) for k in REGIONS},
            "source": f"HolisticTraceAnalysis {hta['version']}" if hta else "trace JSON",
        }
        if hta:
            tb = hta["temporal_breakdown"]
            out["hta_idle_pct"] = float(tb["idle_time_pctg"].mean())
            out["hta_compute_pct"] = float(tb["compute_time_pctg"].mean())
            out["hta_non_compute_pct"] = float(tb["non_compute_time_pctg"].mean())
            out["hta_overlap_pct"] = float(hta["overlap"]["comp_comm_overlap_pctg"].mean())
        return out


def analyze(directory: str | os.PathLike, label: str | None = None, use_hta: bool = True, top: int = 15) -> TraceSet:
    files = find_trace_files(directory)
    if not files:
        raise FileNotFoundError(f"no trace files (*.json, *.json.gz) in {directory}")
    ranks, metadata = [], {}
    for index, path in enumerate(tqdm(files, desc=f"reading traces in {Path(directory).name}", leave=False)):
        trace = load_trace(path)
        rank = trace_rank(trace, path, index)
        for key in ("distributedInfo", "vit_recipes_profile", "deviceProperties"):
            if trace.get(key) and key not in metadata:
                metadata[key] = trace[key]
        ranks.append(summarize_rank(trace, path, rank, top))
        del trace
    ranks.sort(key=lambda r: r.rank)
    folder = Path(directory).resolve()
    default = f"{folder.parent.name}" if folder.name == "profiler" else folder.name  # OUTPUT_DIR/profiler -> run name
    result = TraceSet(label or default, str(directory), ranks, metadata)
    if result.kind == "gpu":
        result.wait_note = match_collectives(ranks)
    if not use_hta:
        result.hta_note = "HTA was switched off (--no-hta)."
    else:
        try:
            result.hta = run_hta(directory)
        except ImportError:
            result.hta_note = "HolisticTraceAnalysis is not installed (pip install HolisticTraceAnalysis)."
        except Exception as err:  # HTA cannot parse these traces: fall back, and say why
            why = " CPU-only traces: HTA analyses GPU kernels, and these have none." if result.kind == "cpu" else ""
            result.hta_note = f"HTA could not analyse these traces ({type(err).__name__}: {err}).{why}"
    if result.hta_note:
        logger.info("%s: %s Using the trace JSON.", result.label, result.hta_note)
    return result


# --- Report ---------------------------------------------------------------------------------------------------


def _table(headers: list[str], rows: list[list]) -> list[str]:
    def cell(value):
        if value is None:
            return "–"
        if isinstance(value, float):
            return f"{value:,.2f}" if abs(value) >= 0.01 or value == 0 else f"{value:.2e}"
        return str(value).replace("|", "\\|")

    lines = [
        "| " + " | ".join(headers) + " |",
        "|" + "|".join("---" if i == 0 else "---:" for i in range(len(headers))) + "|",
    ]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return lines


def _pct(part: float, whole: float) -> str:
    return f"{100 * part / whole:.1f}%" if whole > 0 else "–"


def _short(name: str, limit: int = 60) -> str:
    return name if len(name) <= limit else name[: limit - 1] + "…"


def _figure(width: float, height: float):
    fig = Figure(figsize=(width, height), dpi=100)
    FigureCanvasAgg(fig)
    return fig


def _ms_pct(value_ms: float | None, r: RankSummary) -> str | None:
    """'12.3 (45.6%)': ms per step and share of the profiled window."""
    if value_ms is None:
        return None
    return f"{r.per_step(value_ms):,.1f} ({_pct(value_ms, r.window_ms)})"


def _rank_label(s: TraceSet, r: RankSummary, sets: list[TraceSet]) -> str:
    return f"{s.label}\nrank {r.rank}" if len(sets) > 1 else f"rank {r.rank}"


def plot_breakdown(sets: list[TraceSet], path: str) -> str:
    """Stacked bars per rank, ms per step: compute, exposed communication (transfer / waiting for other ranks),
    idle; the bar's height is the step time."""
    labels, compute, transfer, wait, idle, hidden = [], [], [], [], [], []
    for s in sets:
        for r in s.ranks:
            labels.append(_rank_label(s, r, sets))
            exposed_wait = r.exposed_wait_ms or 0.0
            compute.append(r.per_step(r.compute_ms))
            transfer.append(r.per_step(r.exposed_comm_ms - exposed_wait))
            wait.append(r.per_step(exposed_wait))
            idle.append(r.per_step(r.idle_ms))
            hidden.append(r.per_step(r.comm_ms - r.exposed_comm_ms))
    fig = _figure(max(5.0, 1.1 * len(labels) + 2.5), 4.4)
    ax = fig.add_subplot()
    x = list(range(len(labels)))
    bottom = [0.0] * len(labels)
    any_wait = any(wait)
    stacks = [
        ("compute", compute, "#4c72b0", None),
        ("communication, exposed" + (" (transfer)" if any_wait else ""), transfer, "#dd8452", None),
        ("communication, exposed (waiting for other ranks)", wait, "#f5c29a", "xx"),
        ("idle", idle, "#bbbbbb", None),
    ]
    for label, values, color, hatch in stacks:
        if label.endswith("(waiting for other ranks)") and not any_wait:
            continue
        ax.bar(x, values, bottom=bottom, label=label, color=color, hatch=hatch, edgecolor="white" if hatch else None)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.bar(x, hidden, fill=False, hatch="//", edgecolor="#c44e52", label="communication hidden under compute")
    ax.set_xticks(x, labels, fontsize=8)
    ax.set_ylabel("ms per step")
    ax.set_ylim(0, max(bottom + [1.0]) * 1.08)
    ax.set_title(
        "Temporal breakdown per rank (GPU kernels)" if sets[0].kind == "gpu" else "Temporal breakdown per rank"
    )
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(path)
    return path


def plot_regions(sets: list[TraceSet], path: str) -> str:
    """Stacked bars per rank: host ms per step in each labelled region, plus the rest of the step; for GPU runs
    a second panel: GPU idle ms per step by the region the host was in."""
    labels, stacks, idle = [], defaultdict(list), defaultdict(list)
    for s in sets:
        for r in s.ranks:
            labels.append(_rank_label(s, r, sets))
            for name in REGIONS:
                stacks[name].append(r.regions_ms.get(name, 0.0))
            other = (r.step_time_ms or 0.0) - sum(r.regions_ms.get(n, 0.0) for n in REGIONS)
            stacks["other"].append(max(0.0, other))
            for name in (*REGIONS, OUTSIDE):
                idle[name].append(r.per_step(r.gpu_regions.get(name, {}).get("idle_ms", 0.0)))
    gpu = any(s.kind == "gpu" for s in sets)
    width = max(5.0, 1.1 * len(labels) + 2)
    fig = _figure(2 * width if gpu else width, 4.4)
    axes = [fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)] if gpu else [fig.add_subplot()]
    panels = [(axes[0], stacks, (*REGIONS, "other"), "Host time per step by labelled region")]
    if gpu:
        panels.append((axes[1], idle, (*REGIONS, OUTSIDE), "GPU idle per step, by the host's region"))
    for ax, values, names, title in panels:
        bottom = [0.0] * len(labels)
        for name in names:
            ax.bar(range(len(labels)), values[name], bottom=bottom, label=name)
            bottom = [b + v for b, v in zip(bottom, values[name])]
        ax.set_xticks(range(len(labels)), labels, fontsize=8)
        ax.set_ylabel("ms per step")
        ax.set_title(title)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    return path


def plot_top_ops(sets: list[TraceSet], path: str, top: int = 12) -> str:
    """Horizontal bars: the top kernels/operators of rank 0 (for two runs: side by side)."""
    first = sets[0].ranks[0]
    names = [name for name, _, _ in first.top_ops[:top]]
    for s in sets[1:]:
        names += [n for n, _, _ in s.ranks[0].top_ops[:top] if n not in names]
    names = names[: top + 4]
    fig = _figure(9, max(3.0, 0.35 * len(names) * len(sets) + 1.5))
    ax = fig.add_subplot()
    height = 0.8 / len(sets)
    for i, s in enumerate(sets):
        totals = s.ranks[0].op_totals_ms
        steps = max(s.ranks[0].steps, 1)
        ax.barh(
            [j + i * height for j in range(len(names))],
            [totals.get(n, 0.0) / steps for n in names],
            height=height,
            label=s.label,
        )
    ax.set_yticks([j + height * (len(sets) - 1) / 2 for j in range(len(names))], [_short(n, 50) for n in names])
    ax.tick_params(axis="y", labelsize=7)
    ax.invert_yaxis()
    gpu = sets[0].kind == "gpu"
    ax.set_xlabel("ms per step (kernel time, rank 0)" if gpu else "ms per step (self time, rank 0)")
    ax.set_title("Top kernels (rank 0)" if gpu else "Top operators (rank 0)")
    if len(sets) > 1:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    return path


def _describe(s: TraceSet) -> str:
    info = s.metadata.get("distributedInfo") or {}
    profile = s.metadata.get("vit_recipes_profile") or {}
    devices = {d.get("name") for d in s.metadata.get("deviceProperties") or [] if isinstance(d, dict)}
    parts = [f"{len(s.ranks)} trace(s) in `{s.directory}`"]
    if info:
        parts.append(f"backend {info.get('backend')}, world size {info.get('world_size')}")
    if profile:
        parts.append(f"steps {profile.get('first_step')}-{profile.get('last_step')}")
    parts.append(", ".join(sorted(d for d in devices if d)) or ("GPU" if s.kind == "gpu" else "CPU"))
    if s.hta:
        steps = s.hta.get("steps")
        offset = profile.get("step_offset")
        if steps and isinstance(offset, int):  # ProfilerStep#N is global step N + step_offset
            steps = f"{steps} = global steps {', '.join(str(n + offset) for n in steps)}"
        source = f"trace JSON; HolisticTraceAnalysis {s.hta['version']} (profiler steps {steps})"
    else:
        source = f"trace JSON (fallback: {s.hta_note})"
    return f"- **{s.label}**: " + "; ".join(parts) + f". Numbers from: {source}"


def report_markdown(sets: list[TraceSet], images: dict[str, str], top: int = 15) -> str:
    gpu = any(s.kind == "gpu" for s in sets)
    lines = ["# Trace analysis", ""]
    lines += [_describe(s) for s in sets]
    lines += [
        "",
        "Open any trace in https://ui.perfetto.dev or chrome://tracing. Window: the profiled steps (the host's "
        "`ProfilerStep#N` spans). Definitions: compute = every GPU kernel but NCCL's, memcpy and memset included "
        "(GPU), or the training thread's operators (CPU); communication = NCCL kernels (GPU) / gloo and nccl collectives "
        "(CPU); idle = none of them runs; exposed communication = communication with no compute running; overlap "
        "= share of communication hidden under compute. Cells are ms per step (share of the step).",
        "",
        "## Temporal breakdown per rank",
        "",
    ]
    rows = []
    for s in sets:
        for r in s.ranks:
            rows.append(
                [
                    s.label,
                    r.rank,
                    r.steps,
                    r.step_time_ms,
                    _ms_pct(r.compute_ms, r),
                    _ms_pct(r.comm_ms, r),
                    _ms_pct(r.exposed_comm_ms, r),
                    _ms_pct(r.exposed_wait_ms, r),
                    _ms_pct(r.idle_ms, r),
                    None if r.overlap_pct is None else f"{r.overlap_pct:.1f}%",
                ]
            )
    headers = ["Run", "Rank", "Steps", "Step (ms)", "Compute", "Communication", "Exposed comm."]
    headers += ["of which waiting for other ranks", "Idle", "Overlap"]
    lines += _table(headers, rows)
    lines += [
        "",
        "Compute + exposed communication + idle = the step. An NCCL kernel runs from the moment its rank reaches "
        "the collective: `waiting for other ranks` is the exposed part of that time spent before the last rank "
        "arrived (matched across the ranks' traces), the rest is the transfer itself.",
    ]
    notes = [f"{s.label}: no wait split ({s.wait_note})." for s in sets if s.kind == "gpu" and s.wait_note]
    lines += ["", *notes] if notes else []
    lines += ["", f"![temporal breakdown]({images['breakdown']})", ""]
    for s in sets:
        if s.kind != "gpu" or not any(r.collectives for r in s.ranks):
            continue
        lines += [f"### NCCL collectives: {s.label} (ms per step)", ""]
        rows = []
        for r in s.ranks:
            for name, c in r.collectives.items():
                wait = c.get("wait_ms")
                rows.append(
                    [
                        r.rank,
                        name,
                        r.per_step(c["calls"]),
                        r.per_step(c["kernel_ms"]),
                        r.per_step(c["exposed_ms"]),
                        r.per_step(wait),
                        None if wait is None else r.per_step(c["kernel_ms"] - wait),
                        r.per_step(c.get("exposed_wait_ms")),
                    ]
                )
        lines += _table(
            ["Rank", "Collective", "Calls", "Kernel time", "Exposed", "Waiting", "Transfer", "Exposed waiting"], rows
        )
        lines.append("")
    for s in sets:
        if s.hta:
            lines += [f"### HolisticTraceAnalysis: {s.label}", ""]
            tb, overlap = s.hta["temporal_breakdown"], s.hta["overlap"]
            merged = tb.merge(overlap, on="rank", how="left")
            lines += _table(
                ["Rank", "Idle %", "Compute %", "Non-compute %", "Kernel span (us)", "Comm/comp overlap %"],
                [
                    [
                        int(row["rank"]),
                        float(row["idle_time_pctg"]),
                        float(row["compute_time_pctg"]),
                        float(row["non_compute_time_pctg"]),
                        float(row["kernel_time(us)"]),
                        float(row.get("comp_comm_overlap_pctg", float("nan"))),
                    ]
                    for _, row in merged.iterrows()
                ],
            )
            lines += [
                "",
                f"HTA analysed profiler steps {s.hta.get('steps')} of every rank. Its window runs from the first "
                "kernel to the last (the table above: from the first step's start to the last step's end), and it "
                "counts memcpy/memset as non-compute: its shares differ from the table above by that much. "
                "Non-compute = NCCL or memory kernels running with no compute kernel.",
            ]
            kt = s.hta["kernel_types"]
            lines += ["", "Kernel types (all ranks):", ""]
            lines += _table(
                ["Kernel type", "Time (us)", "%"],
                [[str(row["kernel_type"]), float(row["sum"]), float(row["percentage"])] for _, row in kt.iterrows()],
            )
            lines.append("")
    lines += ["## Host time by labelled region (ms per step)", ""]
    rows = []
    for s in sets:
        for r in s.ranks:
            labelled = sum(r.regions_ms.values())
            other = (r.step_time_ms or 0.0) - labelled
            rows.append(
                [s.label, r.rank, *[r.regions_ms.get(n, 0.0) for n in REGIONS], max(0.0, other), r.step_time_ms]
            )
    lines += _table(["Run", "Rank", *REGIONS, "other", "step"], rows)
    lines += [
        "",
        "Time the training thread spent in each `record_function` region. Under DeepSpeed the optimizer step runs "
        "inside `backward`. `other` is logging, callbacks and whatever the regions do not cover"
        + (
            "; on GPUs it is mostly the host waiting for the GPU (kernels run asynchronously: see the GPU view below)."
            if gpu
            else "."
        ),
        "",
    ]
    for s in sets:
        view = s.gpu_regions_per_step()
        if not view:
            continue
        lines += [f"### GPU view of the labelled regions: {s.label} (ms per step, mean over ranks)", ""]
        host = {n: sum(r.regions_ms.get(n, 0.0) for r in s.ranks) / len(s.ranks) for n in REGIONS}
        lines += _table(
            ["Region", "Host time", "GPU kernels launched in it", "GPU idle while the host is in it"],
            [[name, host.get(name), v["kernel_ms"], v["idle_ms"]] for name, v in view.items()],
        )
        lines += [
            "",
            "A kernel counts for the region whose host span holds its launch call (any thread). Kernel time is "
            "the union over streams. Idle while the host is in a region is the GPU starved by that part of the "
            "host's work (Python, hooks, synchronisation) rather than by the kernels.",
            "",
        ]
    lines += [f"![regions]({images['regions']})", ""]
    for s in sets:
        r0 = s.ranks[0]
        what = "kernels" if r0.kind == "gpu" else "operators (self time)"
        lines += [f"## Top {what}: {s.label}, rank {r0.rank}", ""]
        whole = sum(r0.op_totals_ms.values()) or 1.0
        per = max(r0.steps, 1)
        lines += _table(
            ["Name", "ms per step", "Calls per step", "Share"],
            [[_short(n, 90), ms / per, calls / per, f"{100 * ms / whole:.1f}%"] for n, ms, calls in r0.top_ops[:top]],
        )
        lines.append("")
    lines += [f"![top operators]({images['top_ops']})", ""]
    if len(sets) == 2:
        lines += comparison_markdown(sets[0], sets[1], top)
    return "\n".join(lines) + "\n"


def comparison_markdown(a: TraceSet, b: TraceSet, top: int = 15) -> list[str]:
    sa, sb = a.summary(), b.summary()

    def ratio(x, y):
        return f"{y / x:.2f}x" if x and y is not None else "–"

    def delta(x, y):
        return None if x is None or y is None else y - x

    metrics = [
        ("Step time (ms, mean over ranks)", sa["step_time_ms"], sb["step_time_ms"]),
        ("Compute (ms/step)", sa["compute_ms"], sb["compute_ms"]),
        ("Communication, kernel time (ms/step)", sa["comm_ms"], sb["comm_ms"]),
        ("Exposed communication (ms/step)", sa["exposed_comm_ms"], sb["exposed_comm_ms"]),
        ("  of which waiting for other ranks (ms/step)", sa["exposed_wait_ms"], sb["exposed_wait_ms"]),
        ("Idle (ms/step)", sa["idle_ms"], sb["idle_ms"]),
        ("Compute share %", 100 * sa["compute_fraction"], 100 * sb["compute_fraction"]),
        ("Communication share %", 100 * sa["comm_fraction"], 100 * sb["comm_fraction"]),
        ("Exposed communication share %", 100 * sa["exposed_comm_fraction"], 100 * sb["exposed_comm_fraction"]),
        ("Idle share %", 100 * sa["idle_fraction"], 100 * sb["idle_fraction"]),
        ("Comm/compute overlap %", sa["overlap_pct"], sb["overlap_pct"]),
        *[(f"{n}, host (ms/step)", sa["regions_ms"][n], sb["regions_ms"][n]) for n in REGIONS],
    ]
    names = sorted(set(sa["collectives"]) | set(sb["collectives"]))
    for name in names:
        ca, cb = sa["collectives"].get(name, {}), sb["collectives"].get(name, {})
        metrics += [
            (f"{name}: calls per step", ca.get("calls", 0.0), cb.get("calls", 0.0)),
            (f"{name}: kernel time (ms/step)", ca.get("kernel_ms", 0.0), cb.get("kernel_ms", 0.0)),
            (f"{name}: exposed (ms/step)", ca.get("exposed_ms", 0.0), cb.get("exposed_ms", 0.0)),
        ]
    ga, gb = a.gpu_regions_per_step(), b.gpu_regions_per_step()
    if ga and gb:
        metrics += [(f"GPU idle while host in {n} (ms/step)", ga[n]["idle_ms"], gb[n]["idle_ms"]) for n in ga]
    lines = [f"## Difference: {b.label} vs {a.label}", ""]
    lines += _table(
        ["Metric", a.label, b.label, f"{b.label} − {a.label}", f"{b.label} / {a.label}"],
        [[m, x, y, delta(x, y), ratio(x, y)] for m, x, y in metrics],
    )
    step = delta(sa["step_time_ms"], sb["step_time_ms"])
    if step is not None and None not in (sa["compute_ms"], sb["compute_ms"]):
        parts = [
            ("compute", delta(sa["compute_ms"], sb["compute_ms"])),
            ("exposed communication", delta(sa["exposed_comm_ms"], sb["exposed_comm_ms"])),
            ("idle", delta(sa["idle_ms"], sb["idle_ms"])),
        ]
        text = ", ".join(f"{name} {value:+.1f} ms" for name, value in parts)
        wait = delta(sa["exposed_wait_ms"], sb["exposed_wait_ms"])
        if wait is not None:
            text += f" (of the exposed communication, waiting for other ranks {wait:+.1f} ms)"
        lines += ["", f"Where the step-time difference ({step:+.1f} ms per step, mean over ranks) goes: {text}."]
    ra, rb = a.ranks[0], b.ranks[0]
    pa, pb = max(ra.steps, 1), max(rb.steps, 1)
    names = set(ra.op_totals_ms) | set(rb.op_totals_ms)
    deltas = sorted(
        ((n, ra.op_totals_ms.get(n, 0.0) / pa, rb.op_totals_ms.get(n, 0.0) / pb) for n in names),
        key=lambda t: -abs(t[2] - t[1]),
    )[:top]
    lines += ["", f"Largest per-step differences (rank 0, {'kernels' if ra.kind == 'gpu' else 'operators'}):", ""]
    lines += _table(
        ["Name", f"{a.label} ms/step", f"{b.label} ms/step", "Δ ms/step"],
        [[_short(n, 90), x, y, y - x] for n, x, y in deltas],
    )
    lines.append("")
    return lines


def write_report(sets: list[TraceSet], out: str | os.PathLike, top: int = 15) -> Path:
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    stem = out.stem
    jobs = [("breakdown", plot_breakdown), ("regions", plot_regions), ("top_ops", plot_top_ops)]
    images = {}
    for name, plot in tqdm(jobs, desc="trace report plots", leave=False):
        filename = f"{stem}_{name}.png"
        plot(sets, str(out.parent / filename))
        images[name] = filename
    out.write_text(report_markdown(sets, images, top), encoding="utf-8")
    return out


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(
        description="Analyse profiler traces (one folder per run, one trace per rank) into a markdown report."
    )
    parser.add_argument("trace_dirs", nargs="+", help="One folder (one run) or two (compared, first is baseline).")
    parser.add_argument("--labels", nargs="+", help="Names of the runs (default: folder names).")
    parser.add_argument("--out", help="Report path (default: FIRST_DIR/trace_report.md).")
    parser.add_argument("--top", type=int, default=15, help="Kernels/operators listed.")
    parser.add_argument("--no-hta", action="store_true", help="Do not use HolisticTraceAnalysis.")
    args = parser.parse_args(argv)
    if len(args.trace_dirs) > 2:
        parser.error("give one trace folder, or two to compare")
    labels = args.labels or [None] * len(args.trace_dirs)
    if len(labels) != len(args.trace_dirs):
        parser.error("--labels needs one name per trace folder")
    sets = [analyze(d, label, use_hta=not args.no_hta, top=args.top) for d, label in zip(args.trace_dirs, labels)]
    if len(sets) == 2 and sets[0].label == sets[1].label:
        sets[0].label, sets[1].label = f"{sets[0].label} (A)", f"{sets[1].label} (B)"
    out = write_report(sets, args.out or os.path.join(args.trace_dirs[0], "trace_report.md"), args.top)
    print(out)
    return out


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    main()

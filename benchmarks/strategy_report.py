"""The strategy report: which distributed strategy to use, from benchmark records and traces.

    python -m benchmarks.strategy_report benchmarks/results/<record> [more] --out benchmarks/results/<record>/README.md

Reads every benchmark record (JSON written by benchmarks/run.py; one record or a list per file, folders searched
recursively; other JSON is ignored: report.load_records) and, where a record has a `trace_dir` holding profiler
traces, the traces. Writes the markdown report and its charts (into STEM_files/ next to it): per model,
throughput, memory per GPU, step-time breakdown, communication overhead, scaling efficiency and MFU per strategy,
and a "use this when" line for each strategy (names and order: the table in vit_recipes/plan/strategies.py; advice:
USE_WHEN below).

Record fields used (all optional except `strategy`): name, strategy, gpus, model, per_device_batch, precision,
gradient_checkpointing, device, command, git_commit, versions, status, failure, error, fixture, trace_dir, and
metrics: train_images_per_second, train_step_time_s, train_time_20_steps_s, train_data_wait_fraction, train_mfu,
train_peak_allocated_gib, train_peak_reserved_gib, train_states_allocated_gib_max_rank (memory still allocated
between steps: parameters, optimizer states and gradient buffers, the part a strategy shards), train_loss.

Definitions:
- scaling efficiency = images/s per GPU / images/s of the `single` run with the same model, precision and
  per-GPU batch (or, without one, of the same strategy on the fewest GPUs measured);
- communication overhead = share of the step spent in communication that compute does not hide: from the trace
  when there is one ("trace"), else estimated as the step time's excess over the single-GPU step at the same
  per-GPU batch ("est.", which also counts sharding and launch overheads).
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from tqdm.auto import tqdm

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tools"), str(ROOT / "src")]  # run as a file; tools/ holds trace_analysis
from trace_analysis import analyze  # noqa: E402  tools/trace_analysis.py: a user's tool for --profile_steps traces

from benchmarks.common import markdown_table, save_png  # noqa: E402
from benchmarks.report import _num as number_cell  # noqa: E402  one number format
from benchmarks.report import load_records  # noqa: E402  one record loader
from vit_recipes.plan import strategies  # noqa: E402

logger = logging.getLogger(__name__)


# --- Records --------------------------------------------------------------------------------------------------


def _num(value) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        return None
    return float(value)


@dataclass
class Run:
    """One record, with defaults for whatever it lacks."""

    record: dict
    name: str
    strategy: str
    gpus: int
    model: str
    batch: int | None
    precision: str
    checkpointing: bool
    ok: bool
    metrics: dict
    trace: dict = field(default_factory=dict)  # trace_analysis summary, when the record has traces

    @classmethod
    def from_record(cls, record: dict) -> Run:
        metrics = record.get("metrics") if isinstance(record.get("metrics"), dict) else {}
        status = record.get("status")
        ok = (status in (None, "ok")) and _num(metrics.get("train_images_per_second")) is not None
        gpus = record.get("gpus")
        batch = record.get("per_device_batch")
        return cls(
            record=record,
            name=str(record.get("name") or Path(record.get("_source", "record")).stem),
            strategy=str(record["strategy"]),
            gpus=int(gpus) if isinstance(gpus, (int, float)) and gpus >= 1 else 1,
            model=str(record.get("model") or "unknown model"),
            batch=int(batch) if isinstance(batch, (int, float)) else None,
            precision=str(record.get("precision") or "?"),
            checkpointing=bool(record.get("gradient_checkpointing")),
            ok=ok,
            metrics=metrics,
        )

    def m(self, key: str) -> float | None:
        return _num(self.metrics.get(key))

    @property
    def variant(self) -> tuple:
        return (self.strategy, self.gpus, self.precision, self.checkpointing)

    @property
    def label(self) -> str:
        extra = ", ckpt" if self.checkpointing else ""
        return f"{self.strategy} x{self.gpus} ({self.precision}{extra})"

    @property
    def step_ms(self) -> float | None:
        step = self.m("train_step_time_s")
        if step is None and self.m("train_time_20_steps_s") is not None:
            step = self.m("train_time_20_steps_s") / 20
        if step is None and self.batch and self.m("train_images_per_second"):
            step = self.batch * self.gpus / self.m("train_images_per_second")
        return 1e3 * step if step else None

    @property
    def time_20_steps(self) -> float | None:
        value = self.m("train_time_20_steps_s")
        return value if value is not None else (20 * self.step_ms / 1e3 if self.step_ms else None)


def _strategy_rank(strategy: str) -> int:
    """The table's order; old names (fsdp) rank as what they are now, unknown ones last."""
    name = strategies.ALIASES.get(strategy, strategy)
    return strategies.ORDER.index(name) if name in strategies.ORDER else len(strategies.ORDER)


def resolve_trace_dir(record: dict) -> Path | None:
    """The folder holding a record's profiler traces: trace_dir as given, relative to the record, or its
    profiler/ subfolder (benchmarks/run.py records the run's output folder)."""
    raw = record.get("trace_dir")
    if not raw:
        return None
    base = Path(record.get("_source", ".")).parent
    for candidate in (Path(raw), base / raw, base / "outputs" / Path(raw).name):
        for folder in (candidate / "profiler", candidate):
            if folder.is_dir() and any(p.name.endswith((".json", ".json.gz")) for p in folder.iterdir()):
                return folder
    return None


def attach_traces(runs: list[Run]) -> None:
    for run in tqdm([r for r in runs if r.ok and r.record.get("trace_dir")], desc="reading traces", leave=False):
        folder = resolve_trace_dir(run.record)
        if folder is None:
            continue
        try:
            run.trace = analyze(folder, run.name, use_hta=False).summary()
            run.trace["folder"] = str(folder)
        except Exception as err:  # a broken trace must not sink the report
            logger.warning("%s: could not read traces in %s (%s)", run.name, folder, err)


# --- Derived figures ------------------------------------------------------------------------------------------


def baseline(run: Run, runs: list[Run]) -> tuple[Run, str] | None:
    """The run `run` is compared against for scaling: single GPU at the same batch, else fewest GPUs."""
    like = (run.model, run.precision, run.batch, run.checkpointing)
    same = [r for r in runs if r.ok and (r.model, r.precision, r.batch, r.checkpointing) == like]
    single = [r for r in same if r.gpus == 1]
    if single and run.gpus > 1:
        best = max(single, key=lambda r: (r.strategy == "single", r.m("train_images_per_second")))
        return best, "1 GPU"
    fewer = [r for r in same if r.strategy == run.strategy and r.gpus < run.gpus]
    if fewer:
        best = min(fewer, key=lambda r: r.gpus)
        return best, f"{best.gpus} GPUs"
    return None


def scaling_efficiency(run: Run, runs: list[Run]) -> tuple[float, str] | None:
    if not run.ok or run.gpus == 1:
        return (1.0, "itself") if run.ok else None
    base = baseline(run, runs)
    if base is None:
        return None
    other, what = base
    per_gpu = run.m("train_images_per_second") / run.gpus
    base_per_gpu = other.m("train_images_per_second") / other.gpus
    return (per_gpu / base_per_gpu, what) if base_per_gpu else None


def comm_overhead(run: Run, runs: list[Run]) -> tuple[float, str] | None:
    """Share of the step lost to communication: (fraction, 'trace' or 'est.')."""
    if run.trace.get("exposed_comm_fraction") is not None:
        return run.trace["exposed_comm_fraction"], "trace"
    if run.gpus == 1:
        return (0.0, "est.") if run.ok else None
    base = baseline(run, runs)
    if base is None or base[0].gpus != 1 or not run.step_ms or not base[0].step_ms:
        return None
    return max(0.0, 1.0 - base[0].step_ms / run.step_ms), "est."


def step_breakdown(run: Run, runs: list[Run]) -> dict:
    """ms per step: data wait, compute, communication (exposed), idle/other, and where the split comes from.

    communication is None when it cannot be told apart (no trace and no 1-GPU baseline): compute then includes it.
    """
    step = run.step_ms
    if not step:
        return {}
    data = (run.m("train_data_wait_fraction") or 0.0) * step
    if run.trace.get("compute_fraction") is not None:
        compute = run.trace["compute_fraction"] * step
        comm = run.trace["exposed_comm_fraction"] * step
        rest = max(0.0, step - compute - comm)
        data = min(data, rest)
        parts = {"data wait": data, "compute": compute, "communication": comm, "idle/other": rest - data}
        return {**parts, "source": "trace"}
    overhead = comm_overhead(run, runs)
    comm = overhead[0] * step if overhead else None
    parts = {"data wait": data, "compute": max(0.0, step - data - (comm or 0.0)), "communication": comm}
    source = ("1 GPU" if run.gpus == 1 else "est.") if overhead else "no baseline: compute includes communication"
    return {**parts, "idle/other": None, "source": source}


@dataclass
class Variant:
    """All batches measured for one (strategy, gpus, precision, checkpointing) of one model."""

    key: tuple
    runs: list[Run]

    @property
    def ok_runs(self) -> list[Run]:
        return [r for r in self.runs if r.ok]

    @property
    def best(self) -> Run | None:
        return max(self.ok_runs, key=lambda r: r.m("train_images_per_second"), default=None)

    @property
    def label(self) -> str:
        return self.runs[0].label

    @property
    def largest_fit(self) -> int | None:
        return max((r.batch for r in self.ok_runs if r.batch), default=None)

    @property
    def oom_at(self) -> int | None:
        return min(
            (r.batch for r in self.runs if not r.ok and r.record.get("failure") == "oom" and r.batch), default=None
        )

    def at_batch(self, batch: int | None) -> Run | None:
        return next((r for r in self.ok_runs if r.batch == batch), None)


def group(runs: list[Run]) -> dict[str, list[Variant]]:
    """Sections "MODEL, N GPUs": the strategies measured on N GPUs, with the single-GPU runs as the reference.
    A model measured on one GPU only gets a "MODEL, 1 GPU" section."""
    by_model: dict[str, dict[tuple, list[Run]]] = defaultdict(lambda: defaultdict(list))
    for run in runs:
        by_model[run.model][run.variant].append(run)
    out = {}
    for model in sorted(by_model):
        variants = [Variant(key, sorted(rs, key=lambda r: r.batch or 0)) for key, rs in by_model[model].items()]
        variants.sort(key=lambda v: (_strategy_rank(v.key[0]), v.key[0], v.key[2], v.key[3]))
        counts = sorted({v.key[1] for v in variants})
        multi = [n for n in counts if n > 1] or counts
        for n in multi:
            title = f"{model}, {n} GPU" + ("s" if n > 1 else "")
            out[title] = [v for v in variants if v.key[1] == n or (v.key[1] == 1 and n > 1)]
    return out


def common_batch(variants: list[Variant]) -> int | None:
    """The largest per-GPU batch every variant (with a successful run) measured: a fair memory/step comparison."""
    sets = [{r.batch for r in v.ok_runs if r.batch} for v in variants if v.ok_runs]
    sets = [s for s in sets if s]  # records without a batch take no part
    if not sets:
        return None
    shared = set.intersection(*sets)
    return max(shared) if shared else None


# --- Report ---------------------------------------------------------------------------------------------------


def comparison(variants: list[Variant]) -> tuple[int | None, list[tuple[Variant, Run]]]:
    """(batch, [(variant, run)]) for like-for-like comparisons: every variant at the common batch (variants that
    lack it are left out), or each at its best batch when there is no common one."""
    ok = [v for v in variants if v.best is not None]
    batch = common_batch(ok)
    pairs = [(v, v.at_batch(batch) if batch else v.best) for v in ok]
    return batch, [(v, r) for v, r in pairs if r is not None]


def _fmt(value, digits: int = 1, pct: bool = False, thousands: bool = False) -> str:
    return number_cell(value, digits, 100 if pct else 1, thousands) + ("%" if pct and value is not None else "")


def _first_available(variant: Variant, best: Run, compute) -> tuple[float, str] | None:
    """`compute` of the best run; failing that (no baseline at its batch), of the largest batch that has one,
    saying which batch."""
    value = compute(best)
    if value is not None:
        return value
    for run in sorted(variant.ok_runs, key=lambda r: -(r.batch or 0)):
        value = compute(run) if run is not best else None
        if value is not None:
            return value[0], f"{value[1]}, at batch {run.batch}"
    return None


def _share(value: tuple[float, str] | None, digits: int, against: str = "") -> str:
    """A (fraction, what it comes from) cell: '96% (vs 1 GPU)', '11.8% (trace)'; – without one."""
    return f"{_fmt(value[0], digits, pct=True)} ({against}{value[1]})" if value else "–"


# The summary table: (header, cell of variant v from its best run b, among runs), a column each
SUMMARY_COLUMNS = (
    ("Strategy", lambda v, b, runs: v.label),
    ("Batch/GPU", lambda v, b, runs: _fmt(b.batch, 0)),
    ("Images/s", lambda v, b, runs: _fmt(b.m("train_images_per_second"), 0, thousands=True)),
    ("Images/s/GPU", lambda v, b, runs: _fmt(b.m("train_images_per_second") / b.gpus, 0, thousands=True)),
    ("Step (ms)", lambda v, b, runs: _fmt(b.step_ms, 1)),
    ("20 steps (s)", lambda v, b, runs: _fmt(b.time_20_steps, 2)),
    ("Data wait", lambda v, b, runs: _fmt(b.m("train_data_wait_fraction"), 1, pct=True)),
    ("MFU", lambda v, b, runs: _fmt(b.m("train_mfu"), 1, pct=True)),
    (
        "Peak alloc / reserved GiB per GPU",
        lambda v, b, runs: f"{_fmt(b.m('train_peak_allocated_gib'))} / {_fmt(b.m('train_peak_reserved_gib'))}",
    ),
    ("Model states GiB per GPU", lambda v, b, runs: _fmt(b.m("train_states_allocated_gib_max_rank"), 2)),
    (
        "Largest batch that fit",
        lambda v, b, runs: _fmt(v.largest_fit, 0) + (f" (OOM at {v.oom_at})" if v.oom_at else ""),
    ),
    (
        "Scaling efficiency",
        lambda v, b, runs: _share(_first_available(v, b, lambda r: scaling_efficiency(r, runs)), 0, "vs "),
    ),
    ("Comm. overhead", lambda v, b, runs: _share(_first_available(v, b, lambda r: comm_overhead(r, runs)), 1)),
    ("Status", lambda v, b, runs: "ok"),
)


def summary_rows(variants: list[Variant], runs: list[Run]) -> list[list[str]]:
    rows = []
    for v in variants:
        if (best := v.best) is not None:
            rows.append([cell(v, best, runs) for _, cell in SUMMARY_COLUMNS])
            continue
        failure = next((r for r in v.runs if r.record.get("error")), v.runs[0])
        why = failure.record.get("failure") or failure.record.get("status") or "no metrics"
        rows.append([v.label, *["–"] * (len(SUMMARY_COLUMNS) - 2), f"failed ({why})"])
    return rows


# When to pick each strategy of the table (vit_recipes.plan.strategies), in the report's advice lines.
USE_WHEN = {
    "single": "the model, gradients and optimizer state fit on one GPU and one GPU is fast enough: no communication "
    "at all, simplest to debug.",
    "ddp": "the model and optimizer state fit on every GPU: usually the fastest multi-GPU option; gradients are "
    "all-reduced in buckets while the backward pass still runs.",
    "zero1": "DDP fits but optimizer state is the memory problem: it is sharded across GPUs for about DDP's "
    "communication.",
    "zero2": "DDP fits only with a small batch: optimizer state and gradients are sharded (reduce-scatter instead of "
    "all-reduce) for little extra communication.",
    "zero2_offload": "ZeRO-2 still runs out of memory: optimizer state lives in CPU RAM and the optimizer steps on "
    "the CPU; much slower, use it to make a run fit, not to go fast.",
    "zero3": "the model itself (or the batch you need) does not fit on one GPU: parameters are sharded too and "
    "gathered layer by layer in forward and backward, the most communication of all.",
    "zeropp": "ZeRO-3 across nodes or on a slow interconnect: quantised gradient communication and hierarchical "
    "partitioning cut the traffic.",
    "zero3_offload": "ZeRO-3 still runs out of memory: parameters and optimizer state go to CPU RAM; the slowest "
    "option, for models that fit no other way.",
    "fsdp2": "you want ZeRO-3-style sharding in plain PyTorch (per-parameter DTensor sharding, no DeepSpeed), e.g. "
    "with torch.compile; scales best of the sharded strategies.",
    "fsdp2_offload": "FSDP2 still runs out of memory: parameters and optimizer state are offloaded to CPU RAM.",
}


def use_when_lines(variants: list[Variant], runs: list[Run]) -> list[str]:
    ok = [v for v in variants if v.best is not None]
    section_gpus = max((v.key[1] for v in variants), default=1)
    peers = [v for v in ok if v.key[1] == section_gpus]  # single-GPU rows are the reference, not a contender
    fastest = max(peers, key=lambda v: v.best.m("train_images_per_second"), default=None)
    batch, pairs = comparison(variants)
    memories = {
        v.label: r.m("train_peak_allocated_gib") for v, r in pairs if r.m("train_peak_allocated_gib") is not None
    }
    leanest = min(memories, key=memories.get) if memories else None
    lines, seen = [], set()
    for v in variants:
        strategy = v.key[0]
        facts = []
        if v.best is None:
            facts.append("did not run here (see failures)")
        else:
            ips = v.best.m("train_images_per_second")
            at = f" at batch {v.best.batch}" if v.best.batch else ""  # each figure says its batch: rows differ
            if v.key[1] != section_gpus:
                facts.append(f"the reference: {ips:,.0f} img/s on {v.key[1]} GPU{at}")
            elif v is fastest:
                facts.append(f"fastest here ({ips:,.0f} img/s{at})")
            elif fastest is not None:
                share = f"{ips / fastest.best.m('train_images_per_second'):.0%} of the fastest's throughput"
                if v.best.batch != fastest.best.batch:
                    share += f" ({ips:,.0f} img/s{at}; the fastest at batch {fastest.best.batch})"
                facts.append(share)
            if v.label in memories:
                where = f" at batch {batch}" if batch else ""
                facts.append(
                    f"{memories[v.label]:.1f} GiB per GPU{where}" + (" (the least)" if v.label == leanest else "")
                )
        # a strategy the table does not know: a record from an experiment
        advice = USE_WHEN.get(strategy, "the numbers above suit you.")
        advice = f"use this when {advice}" if strategy not in seen else "when to use it: see above."
        seen.add(strategy)
        lines.append(f"- **{v.label}**: {advice} Measured: {'; '.join(facts)}.")
    return lines


def _figure(panels: int, width: float = 6.5, height: float = 4.4):
    cols = min(2, panels)
    rows = math.ceil(panels / cols)
    fig = Figure(figsize=(width * cols, height * rows), dpi=100)
    FigureCanvasAgg(fig)
    return fig, [fig.add_subplot(rows, cols, i + 1) for i in range(panels)]


def _bar_labels(ax, bars, texts: list[str]) -> None:
    for bar, text in zip(bars, texts):
        top = (bar.get_x() + bar.get_width() / 2, bar.get_height())
        ax.annotate(text, top, ha="center", va="bottom", fontsize=7, xytext=(0, 2), textcoords="offset points")


# The bar charts of each strategy at its best batch: metric -> (scale, colour, y label, title, text on a bar)
BEST_BATCH_BARS = {
    "train_images_per_second": (1, "#4c72b0", "images/s (best batch, all GPUs)", "throughput", "b{batch}"),
    "train_mfu": (100, "#55a868", "MFU (%)", "model FLOPs utilisation (best batch)", "{value:.1f}%"),
}


def chart_best(groups: dict[str, list[Variant]], metric: str) -> Figure:
    """BEST_BATCH_BARS[metric]: a bar per strategy, at its best batch; a missing value is a bar of 0 marked n/a."""
    scale, colour, ylabel, title, text = BEST_BATCH_BARS[metric]
    fig, axes = _figure(len(groups))
    for ax, (model, variants) in zip(axes, groups.items()):
        ok = [v for v in variants if v.best]
        values = [scale * (v.best.m(metric) or 0.0) for v in ok]
        bars = ax.bar(range(len(ok)), values, color=colour)
        texts = [
            text.format(batch=v.best.batch, value=x) if v.best.m(metric) is not None else "n/a"
            for v, x in zip(ok, values)
        ]
        _bar_labels(ax, bars, texts)
        ax.set_xticks(range(len(ok)), [v.label for v in ok], rotation=30, ha="right", fontsize=8)
        ax.set_ylabel(ylabel)
        ax.set_title(f"{model}: {title}")
    return fig


def chart_memory(groups: dict[str, list[Variant]]) -> Figure:
    fig, axes = _figure(len(groups))
    for ax, (model, variants) in zip(axes, groups.items()):
        batch, chosen = comparison(variants)
        x = range(len(chosen))
        allocated = [r.m("train_peak_allocated_gib") or 0.0 for _, r in chosen]
        reserved = [r.m("train_peak_reserved_gib") or 0.0 for _, r in chosen]
        states = [r.m("train_states_allocated_gib_max_rank") or 0.0 for _, r in chosen]
        ax.bar([i - 0.27 for i in x], allocated, width=0.27, label="peak allocated")
        ax.bar(list(x), reserved, width=0.27, label="peak reserved")
        ax.bar([i + 0.27 for i in x], states, width=0.27, label="model states (between steps)")
        ax.set_xticks(list(x), [v.label for v, _ in chosen], rotation=30, ha="right", fontsize=8)
        ax.set_ylabel("GiB per GPU")
        ax.set_title(f"{model}: memory per GPU " + (f"(batch {batch}/GPU)" if batch else "(each at its best batch)"))
        ax.legend(fontsize=8)
    return fig


BREAKDOWN_COLOURS = {"data wait": "#8172b3", "compute": "#4c72b0", "communication": "#dd8452", "idle/other": "#bbbbbb"}


def chart_breakdown(groups: dict[str, list[Variant]], runs: list[Run]) -> Figure:
    fig, axes = _figure(len(groups))
    for ax, (model, variants) in zip(axes, groups.items()):
        batch, chosen = comparison(variants)
        parts = [step_breakdown(r, runs) for _, r in chosen]
        bottom = [0.0] * len(chosen)
        for name, colour in BREAKDOWN_COLOURS.items():
            values = [p.get(name) or 0.0 for p in parts]
            ax.bar(range(len(chosen)), values, bottom=bottom, label=name, color=colour)
            bottom = [b + v for b, v in zip(bottom, values)]
        labels = [f"{v.label}\n[{p.get('source', '').split(':')[0]}]" for (v, _), p in zip(chosen, parts)]
        ax.set_xticks(range(len(chosen)), labels, rotation=30, ha="right", fontsize=7)
        ax.set_ylabel("ms per step")
        ax.set_title(f"{model}: step time " + (f"(batch {batch}/GPU)" if batch else "(best batch)"))
        ax.legend(fontsize=7)
    return fig


def chart_scaling(groups: dict[str, list[Variant]], runs: list[Run]) -> Figure:
    by_model: dict[str, dict[tuple, Variant]] = defaultdict(dict)  # all GPU counts of a model on one panel
    for variants in groups.values():
        for v in variants:
            by_model[v.runs[0].model][v.key] = v
    fig, axes = _figure(len(by_model))
    for ax, (model, variant_map) in zip(axes, sorted(by_model.items())):
        lines: dict[tuple, list[tuple[int, float]]] = defaultdict(list)
        for v in variant_map.values():
            if v.best is None:
                continue
            efficiency = _first_available(v, v.best, lambda r: scaling_efficiency(r, runs))
            if efficiency:
                strategy, gpus, precision, ckpt = v.key
                lines[(strategy, precision, ckpt)].append((gpus, efficiency[0]))
        for (strategy, precision, ckpt), points in sorted(lines.items(), key=lambda kv: _strategy_rank(kv[0][0])):
            points.sort()
            label = f"{strategy} ({precision}{', ckpt' if ckpt else ''})"
            ax.plot([p[0] for p in points], [100 * p[1] for p in points], marker="o", label=label)
        ax.axhline(100, color="grey", lw=0.8, ls="--")
        ax.set_ylim(0, 110)
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.set_xlabel("GPUs")
        ax.set_ylabel("scaling efficiency (%)")
        ax.set_title(f"{model}: scaling efficiency (per-GPU img/s vs baseline)")
        if lines:
            ax.legend(fontsize=7)
        else:
            ax.text(0.5, 0.5, "no baseline: no 1-GPU run at the same batch", ha="center", transform=ax.transAxes)
    return fig


# name -> (its heading in the report, its figure from the sections and the runs), in the report's order
CHARTS = {
    "throughput": ("Throughput per strategy", lambda groups, runs: chart_best(groups, "train_images_per_second")),
    "memory": ("Memory per GPU", lambda groups, runs: chart_memory(groups)),
    "step_breakdown": ("Step-time breakdown", chart_breakdown),
    "scaling": ("Scaling efficiency", chart_scaling),
    "mfu": ("MFU", lambda groups, runs: chart_best(groups, "train_mfu")),
}


def write_charts(groups, runs, folder: Path) -> dict[str, str]:
    folder.mkdir(parents=True, exist_ok=True)
    out = {}
    for name, (_, draw) in tqdm(CHARTS.items(), desc="strategy report charts", leave=False):
        fig = draw(groups, runs)
        fig.tight_layout()
        out[name] = str(save_png(fig, folder / f"{name}.png"))
    return out


def markdown(
    runs: list[Run], groups: dict[str, list[Variant]], charts: dict[str, str], out_dir: Path, sources=()
) -> str:
    rel = {k: os.path.relpath(v, out_dir) for k, v in charts.items()}
    lines = ["# Choosing a distributed strategy", ""]
    if any(r.record.get("fixture") for r in runs):
        lines += ["> **FIXTURE DATA**: made-up records used by the tests, not measurements.", ""]
    devices = sorted({str(r.record.get("device")) for r in runs if r.record.get("device")})
    commits = sorted({str(r.record.get("git_commit"))[:10] for r in runs if r.record.get("git_commit")})
    lines += [
        f"{len(runs)} benchmark runs ({sum(r.ok for r in runs)} succeeded) on: {'; '.join(devices) or 'unknown device'}."
        + (f" Commits: {', '.join(commits)}." if commits else ""),
        "",
        "How to read: *Batch/GPU* is the per-GPU batch with the highest throughput for that strategy; memory, step "
        "time and MFU are at that batch. *Model states* is what stays allocated between steps on the largest rank "
        "(parameters, optimizer states, gradient buffers: the part a strategy shards; peak memory adds the "
        "activations). *Scaling efficiency* is images/s per GPU relative to one GPU at the same "
        "per-GPU batch. *Comm. overhead* is the share of the step spent in communication that compute does not hide: "
        "from profiler traces (trace: communication kernels running with no compute, which includes a rank waiting "
        "for the others to reach a collective) or estimated from the step time's excess over one GPU (est., which "
        "also counts sharding overheads). MFU is against the GPU's dense bf16/TF32 peak.",
        "",
    ]
    for model, variants in groups.items():
        lines += [f"## {model}", ""]
        lines += markdown_table([h for h, _ in SUMMARY_COLUMNS], summary_rows(variants, runs), align_numbers=True)
        batch, pairs = comparison(variants)
        lines += ["", "### Use this when", ""]
        lines += use_when_lines(variants, runs)
        breakdown_rows = []
        for v, run in pairs:
            if parts := step_breakdown(run, runs):
                ms = [_fmt(parts[k], 1) for k in BREAKDOWN_COLOURS]
                breakdown_rows.append([v.label, _fmt(run.batch, 0), *ms, _fmt(run.step_ms, 1), parts["source"]])
        if breakdown_rows:
            where = f"at batch {batch}/GPU" if batch else "at each strategy's best batch"
            lines += ["", f"### Step-time breakdown ({where}, ms per step)", ""]
            lines += markdown_table(
                ["Strategy", "Batch/GPU", *BREAKDOWN_COLOURS, "step", "source"], breakdown_rows, align_numbers=True
            )
        lines.append("")
    lines += ["## Charts", ""]
    for name, (title, _) in CHARTS.items():
        lines += [f"### {title}", "", f"![{title}]({rel[name]})", ""]
    failed = [r for r in runs if not r.ok]
    if failed:
        lines += ["## Runs that did not finish", ""]
        lines += markdown_table(
            ["Run", "Strategy", "Batch/GPU", "Status", "Why"],
            [
                [
                    r.name,
                    f"{r.strategy} x{r.gpus}",
                    _fmt(r.batch, 0),
                    str(r.record.get("failure") or r.record.get("status") or "no metrics"),
                    str(r.record.get("error") or "")[:200],
                ]
                for r in failed
            ],
            align_numbers=True,
        )
        lines.append("")
    traced = [r for r in runs if r.trace]
    if traced:
        lines += ["## Traces", ""]
        lines += [
            f"- {r.name}: `{r.trace['folder']}` (full report: `python tools/trace_analysis.py {r.trace['folder']}`)"
            for r in traced
        ]
        lines.append("")
    lines += ["## All runs", ""]
    lines += markdown_table(
        ["Run", "Model", "Strategy", "Batch/GPU", "Precision", "Images/s", "Step (ms)", "Peak alloc GiB", "Record"],
        [
            [
                r.name,
                r.model,
                f"{r.strategy} x{r.gpus}",
                _fmt(r.batch, 0),
                r.precision,
                _fmt(r.m("train_images_per_second"), 0, thousands=True),
                _fmt(r.step_ms, 1),
                _fmt(r.m("train_peak_allocated_gib"), 2),
                Path(r.record.get("_source", "")).name,
            ]
            for r in sorted(
                runs, key=lambda r: (r.model, r.gpus, _strategy_rank(r.strategy), r.strategy, r.batch or 0)
            )
        ],
        align_numbers=True,
    )
    lines += [
        "",
        f"Records read from: {', '.join(f'`{p}`' for p in sources)}. Commands, commits and versions are in each record.",
    ]
    return "\n".join(lines) + "\n"


def build_report(paths: list[str | os.PathLike], out: str | os.PathLike, traces: bool = True) -> Path:
    records = load_records(paths)
    if not records:
        raise SystemExit(f"no benchmark records found in {', '.join(map(str, paths))}")
    runs = [Run.from_record(r) for r in records]
    if traces:
        attach_traces(runs)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    groups = group(runs)
    charts = write_charts(groups, runs, out.parent / f"{out.stem}_files")
    out.write_text(markdown(runs, groups, charts, out.parent, [str(p) for p in paths]), encoding="utf-8")
    return out


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description="Write the strategy report from benchmark records and traces.")
    parser.add_argument("paths", nargs="+", help="Record files or folders (searched recursively).")
    parser.add_argument("--out", required=True, help="Markdown report to write (a record's README.md).")
    parser.add_argument("--no-traces", action="store_true", help="Ignore trace_dir (no trace reading).")
    args = parser.parse_args(argv)
    out = build_report(args.paths, args.out, traces=not args.no_traces)
    print(out)
    return out


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    main()

"""Turn benchmark records (benchmarks/run.py) into results.md and PNG charts; the runner calls it after a suite.

    python -m benchmarks.report benchmarks/results/<record> [more folders or record files] [--out DIR]

Folders are searched recursively (a run's outputs/, logs/, profiler/ and runs/ are skipped).

Writes into --out (default: the first folder):
- results.md: one table row per successful run, then failed/skipped runs with their error line, then the
  cold/warm decode runs; with a peer record (benchmarks/peer.py, transformers' example script) of 8 workers in the
  folder, the table says each run's img/s as a multiple of the peer's ("x peer (8 workers)");
- throughput_vs_batch.png: images/s against per-GPU batch, one line per strategy/precision (a panel per model;
  runs that ran out of memory are marked x on the axis);
- memory_vs_batch.png: peak allocated (solid) and reserved (dashed) GiB per GPU against batch;
- time_20_steps.png: seconds for 20 steady-state steps, one bar per run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import defaultdict
from pathlib import Path

from tqdm.auto import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file: the repository root
from benchmarks.common import markdown_table, save_png  # noqa: E402

CHARTS = ("throughput_vs_batch.png", "memory_vs_batch.png", "time_20_steps.png")
REQUIRED = ("name", "strategy", "gpus", "model", "per_device_batch", "precision", "metrics")
MAX_RECORD_BYTES = 5 * 2**20  # larger JSON files are traces or model states, not records
SKIP_DIRS = {"outputs", "logs", "profiler", "runs", ".git"}  # a run's output, logs and traces: no records there


# --------------------------------------------------------------------------------------------------- loading


def is_record(item) -> bool:
    """A benchmark record names its strategy and has metrics or a status (a run that failed early has none)."""
    return isinstance(item, dict) and isinstance(item.get("strategy"), str) and ("metrics" in item or "status" in item)


def load_records(paths: list[str | os.PathLike]) -> list[dict]:
    """Every benchmark record among these files and folders (folders searched recursively; other JSON is ignored).

    Each record is a copy with `_source`, its file. Used by this report and by strategy_report.py.
    """
    files: list[Path] = []
    for raw in paths:
        path = Path(raw)
        if path.is_file():
            files.append(path)
        elif path.is_dir():
            for root, dirs, names in os.walk(path):
                dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS)
                files += [Path(root) / n for n in sorted(names) if n.endswith(".json")]
        else:
            raise FileNotFoundError(f"no such file or folder: {raw}")
    records = []
    for file in tqdm(files, desc="reading records", leave=False):
        if file.stat().st_size > MAX_RECORD_BYTES:
            continue
        try:
            data = json.loads(file.read_text(encoding="utf-8"))
        except ValueError:  # not JSON (UnicodeDecodeError is a ValueError too)
            continue
        for item in data if isinstance(data, list) else [data]:  # a file may hold one record or a list
            if is_record(item):
                records.append({**item, "_source": str(file)})
    return records


def table_records(paths: list[str | os.PathLike]) -> list[dict]:
    """The records this report can show (every REQUIRED key), with their status and derived figures filled in."""
    records = [r for r in load_records(paths) if all(key in r for key in REQUIRED)]
    for record in records:
        record.setdefault("status", "ok" if record["metrics"].get("train_images_per_second") else "failed")
        fill_derived(record)
    return records


def fill_derived(record: dict) -> None:
    """batches/s and img/s per GPU where a record lacks them: the runner's new records, and records written by hand
    or by an older runner."""
    metrics = record["metrics"]
    if metrics.get("train_step_time_s") and "train_batches_per_second" not in metrics:
        metrics["train_batches_per_second"] = round(1.0 / metrics["train_step_time_s"], 3)
    if metrics.get("train_images_per_second") and "train_images_per_second_per_gpu" not in metrics:
        metrics["train_images_per_second_per_gpu"] = round(metrics["train_images_per_second"] / record["gpus"], 2)


def strategy_label(record: dict) -> str:
    """The strategy, marked when the run is the peer (transformers' example script, benchmarks/peer.py)."""
    return record["strategy"] + (" (HF example)" if record.get("peer") else "")


def series_key(record: dict) -> tuple:
    return (
        record["model"],
        strategy_label(record),  # the peer is its own series
        record["precision"],
        record["gpus"],
        bool(record.get("gradient_checkpointing")),
        bool(record.get("torch_compile")),
        record.get("dataset", ""),
    )


def series_label(key: tuple, datasets: set[str]) -> str:
    model, strategy, precision, gpus, checkpointing, compiled, dataset = key
    label = f"{strategy} {precision} x{gpus}"
    label += " +ckpt" if checkpointing else ""
    label += " +compile" if compiled else ""
    return label + (f" ({dataset})" if len(datasets) > 1 else "")


def sort_key(record: dict) -> tuple:
    return (*series_key(record), record["per_device_batch"], record["name"])


# --------------------------------------------------------------------------------------------------- markdown


def _num(value, digits: int = 0, scale: float = 1.0, thousands: bool = False) -> str:
    if value is None:
        return "–"
    value = value * scale
    return f"{value:,.{digits}f}" if thousands else f"{value:.{digits}f}"


def _short_commit(commit: str | None) -> str:
    if not commit:
        return "unknown"
    dirty = commit.endswith("-dirty")
    return commit[:10] + (" (uncommitted changes)" if dirty else "")


def _versions(versions: dict) -> str:
    return ", ".join(f"{k} {v}" for k, v in versions.items() if v and k != "python") + (
        f", Python {versions['python']}" if versions.get("python") else ""
    )


def context_lines(records: list[dict]) -> list[str]:
    """Device, commit and versions; listed per value when records differ."""
    lines = []
    for label, values in (
        ("Device", sorted({str(r.get("device")) for r in records})),
        ("Commit", sorted({_short_commit(r.get("git_commit")) for r in records})),
        ("Libraries", sorted({_versions(r.get("versions") or {}) for r in records})),
    ):
        if len(values) == 1:
            lines.append(f"- {label}: {values[0]}")
        else:
            lines.append(f"- {label} (differs between records): " + "; ".join(values))
    created = sorted(r.get("created") or "" for r in records)
    if created and created[0]:
        lines.append(f"- Recorded: {created[0]} to {created[-1]}")
    return lines


def peak_allocated(metrics: dict) -> float | None:
    """The largest rank's peak when the per-rank logs were there, else rank 0's."""
    return metrics.get("train_peak_allocated_gib_max_rank", metrics.get("train_peak_allocated_gib"))


RESULT_COLUMNS = (
    ("Run", lambda r, m: f"`{r['name']}`"),
    ("Model", lambda r, m: r["model"]),
    ("Strategy", lambda r, m: strategy_label(r)),
    ("GPUs", lambda r, m: str(r["gpus"])),
    ("Precision", lambda r, m: r["precision"] + (" +ckpt" if r.get("gradient_checkpointing") else "")),
    ("Batch/GPU", lambda r, m: str(r["per_device_batch"])),
    ("img/s", lambda r, m: _num(m.get("train_images_per_second"), 0, thousands=True)),
    ("img/s/GPU", lambda r, m: _num(m.get("train_images_per_second_per_gpu"), 0, thousands=True)),
    ("batches/s", lambda r, m: _num(m.get("train_batches_per_second"), 2)),
    ("step ms", lambda r, m: _num(m.get("train_step_time_s"), 1, 1000)),
    ("20 steps s", lambda r, m: _num(m.get("train_time_20_steps_s"), 2)),
    ("data wait %", lambda r, m: _num(m.get("train_data_wait_fraction"), 1, 100)),
    ("MFU %", lambda r, m: _num(m.get("train_mfu"), 1, 100)),
    ("peak alloc GiB", lambda r, m: _num(peak_allocated(m), 1)),
    ("peak reserved GiB", lambda r, m: _num(m.get("train_peak_reserved_gib"), 1)),
    ("states GiB", lambda r, m: _num(m.get("train_states_allocated_gib_max_rank"), 2)),
    ("loss", lambda r, m: _num(m.get("train_loss"), 3)),
)


PEER_COLUMN = "x peer (8 workers)"
PEER_WORKERS = 8


def peer_reference(record: dict, records: list[dict]) -> dict | None:
    """The peer's 8-worker record to compare `record` with: from the same folder, same model and dataset (the same
    batch when there is one); None without one."""
    folder = Path(record.get("_source", "")).parent
    candidates = [
        r
        for r in records
        if r.get("peer")
        and r.get("dataloader_workers") == PEER_WORKERS
        and r["status"] == "ok"
        and r["metrics"].get("train_images_per_second")
        and Path(r.get("_source", "")).parent == folder
        and (r["model"], r.get("dataset")) == (record["model"], record.get("dataset"))
    ]
    candidates.sort(key=lambda r: (r["per_device_batch"] != record["per_device_batch"], r["name"]))
    return candidates[0] if candidates else None


def peer_ratio(record: dict, records: list[dict]) -> float | None:
    """img/s of `record` over its peer's (peer_reference)."""
    reference = peer_reference(record, records)
    speed = record["metrics"].get("train_images_per_second")
    if reference is None or not speed:
        return None
    return speed / reference["metrics"]["train_images_per_second"]


def result_columns(records: list[dict]) -> list[tuple]:
    """RESULT_COLUMNS, plus the ratio against the peer after img/s when the records hold a peer to compare with."""
    columns = list(RESULT_COLUMNS)
    if any(peer_reference(r, records) for r in records):

        def cell(record: dict, metrics: dict) -> str:
            ratio = peer_ratio(record, records)
            return "–" if ratio is None else f"{ratio:.2f}x"

        columns.insert([name for name, _ in columns].index("img/s") + 1, (PEER_COLUMN, cell))
    return columns


def summary_table(records: list[dict]) -> str:
    """The short table of a record's README: each run's img/s (and against the peer), peak memory and status."""
    rows = [[f"`{r['name']}`", _num(r["metrics"].get("train_images_per_second"), 0, thousands=True),
             "–" if (ratio := peer_ratio(r, records)) is None else f"{ratio:.2f}x",
             _num(peak_allocated(r["metrics"]), 1), r["status"] + (f": {r['error'][:80]}" if r.get("error") else "")]
            for r in sorted(records, key=sort_key)]  # fmt: skip
    return "\n".join(markdown_table(["run", "img/s", PEER_COLUMN, "peak GiB", "status"], rows))


def markdown(records: list[dict], title: str, charts: list[str]) -> str:
    ok = sorted((r for r in records if r["status"] == "ok" and not r.get("cache")), key=sort_key)
    failed = sorted((r for r in records if r["status"] != "ok"), key=sort_key)
    decode = sorted((r for r in records if r.get("cache") and r["status"] == "ok"), key=lambda r: r["name"])
    lines = [f"# {title}", ""]
    if any(r.get("fixture") for r in records):
        lines += ["> **FIXTURE DATA** (made-up numbers for tests), not measurements.", ""]
    lines += context_lines(records)
    steps = sorted({r["steps"] for r in records if "steps" in r})
    lines += [
        f"- Steps per run: {', '.join(map(str, steps))}; the first 5 are warm-up and not measured. img/s, step time "
        "and data wait are steady-state; peak allocated memory is the largest rank's (rank 0's when per-rank logs "
        "are missing), peak reserved is rank 0's; states is what stays allocated between steps on the largest rank "
        "(parameters, optimizer states, persistent gradient buffers: what ZeRO and FSDP shard); "
        "MFU uses the datasheet dense peak (bf16, or TF32 for fp32 runs).",
    ]
    columns = result_columns(ok)
    if len(columns) > len(RESULT_COLUMNS):
        lines.append(
            f"- {PEER_COLUMN}: img/s over that of the peer's {PEER_WORKERS}-worker run of the same folder "
            "(benchmarks/peer.py: transformers' example script, PIL decoding and transforms per image in the "
            "DataLoader workers, the stock Trainer; strategy marked (HF example)), measured the same way."
        )
    lines.append("")
    if ok:
        lines += ["## Throughput and memory", ""]
        lines += markdown_table([c for c, _ in columns], [[f(r, r["metrics"]) for _, f in columns] for r in ok])
        lines.append("")
    if decode:
        lines += ["## Decoding: cold vs warm datasets cache", ""]
        rows = [
            [
                f"`{r['name']}`",
                r.get("dataset", ""),
                r["cache"],
                _num(r["metrics"].get("data_decode_seconds"), 2),
                _num(r.get("wall_seconds"), 1),
                _num(r["metrics"].get("train_images_per_second"), 0, thousands=True),
                _num(r["metrics"].get("train_data_wait_fraction"), 1, 100),
            ]
            for r in decode
        ]
        lines += markdown_table(
            ["Run", "Dataset", "Cache", "decode s", "wall s (whole run)", "img/s", "data wait %"], rows
        )
        lines.append("")
    if failed:
        lines += ["## Failed or skipped runs", ""]
        rows = [
            [
                f"`{r['name']}`",
                strategy_label(r),
                str(r["gpus"]),
                r["precision"],
                str(r["per_device_batch"]),
                r["status"] + (f" ({r['failure']})" if r.get("failure") and r["failure"] != r["status"] else ""),
                (r.get("error") or "").replace("\n", " ")[:200],
            ]
            for r in failed
        ]
        lines += markdown_table(["Run", "Strategy", "GPUs", "Precision", "Batch/GPU", "Status", "Error"], rows)
        lines.append("")
    if charts:
        lines += ["## Charts", ""] + [f"![{Path(c).stem}]({c})" for c in charts] + [""]
    commands = [r for r in ok + decode if r.get("command")]
    if commands:
        lines += ["<details><summary>Commands</summary>", ""]
        lines += [f"- `{r['name']}`: `{r['command']}`" for r in commands]
        lines += ["", "</details>", ""]
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------- charts


def _group(records: list[dict], key) -> dict:
    """The records by key(record), each group in the order given."""
    grouped = defaultdict(list)
    for record in records:
        grouped[key(record)].append(record)
    return grouped


def _batch_axis(ax, batches: list[int]) -> None:
    ax.set_xscale("log", base=2)
    ax.set_xticks(batches)
    ax.set_xticklabels([str(b) for b in batches])
    ax.minorticks_off()
    ax.set_xlabel("per-GPU batch size")
    ax.grid(True, alpha=0.3)


def _colours(keys) -> dict:
    from matplotlib import colormaps

    cmap = colormaps["tab10"]
    return {key: cmap(i % 10) for i, key in enumerate(sorted({k[1:6] for k in keys}))}


def chart_vs_batch(records: list[dict], failures: list[dict], path: Path, kind: str) -> None:
    from matplotlib.figure import Figure  # a figure of its own (no pyplot): nothing global to close

    models = dict(sorted(_group(records + failures, lambda r: r["model"]).items()))
    fig = Figure(figsize=(6.4 * len(models), 4.6))
    axes = fig.subplots(1, len(models), squeeze=False)
    datasets = {r.get("dataset", "") for r in records}
    value = peak_allocated if kind == "memory" else lambda metrics: metrics.get("train_images_per_second")
    for ax, (model, model_records) in zip(axes[0], models.items()):
        ok = [r for r in model_records if r["status"] == "ok" and not r.get("cache")]
        oom = [r for r in model_records if r.get("failure") == "oom"]
        series = _group(sorted(ok, key=sort_key), series_key)
        colours = _colours(list(series) + [series_key(r) for r in oom])
        for key, runs in series.items():
            colour = colours[key[1:6]]
            x = [r["per_device_batch"] for r in runs]
            label = series_label(key, datasets)
            ax.plot(x, [value(r["metrics"]) for r in runs], "o-", color=colour, label=label)
            reserved = [r["metrics"].get("train_peak_reserved_gib") for r in runs]
            if kind == "memory" and any(v is not None for v in reserved):
                ax.plot(x, reserved, "--_", color=colour, alpha=0.6, markersize=10)
        for i, record in enumerate(oom):  # on the x axis, in the colour of its configuration
            ax.plot(
                [record["per_device_batch"]],
                [0],
                "x",
                color=colours[series_key(record)[1:6]],
                markersize=11,
                mew=2.5,
                clip_on=False,
                label="x = out of memory" if i == 0 else None,
            )
        memories = {r.get("device_memory_gib") for r in model_records if r.get("device_memory_gib")}
        if kind == "memory" and len(memories) == 1:
            memory = memories.pop()
            ax.axhline(memory, color="grey", linestyle=":", linewidth=1)
            ax.text(
                0.01,
                memory,
                f"GPU memory {memory:.0f} GiB",
                transform=ax.get_yaxis_transform(),
                va="bottom",
                fontsize=8,
                color="grey",
            )
        batches = sorted({r["per_device_batch"] for r in model_records})
        _batch_axis(ax, batches)
        ax.set_ylim(bottom=0)
        if kind == "throughput":
            ax.set_ylabel("images/s (all GPUs, steady state)")
            ax.set_title(f"{model}: throughput")
        else:
            ax.set_ylabel("peak GiB per GPU (solid: allocated, dashed: reserved)")
            ax.set_title(f"{model}: memory per GPU")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    save_png(fig, path)


def chart_time_20_steps(records: list[dict], path: Path) -> None:
    from matplotlib.figure import Figure

    runs = sorted((r for r in records if r["metrics"].get("train_time_20_steps_s")), key=sort_key)
    fig = Figure(figsize=(8, max(2.5, 0.32 * len(runs) + 1.2)))
    ax = fig.subplots()
    colours = _colours([series_key(r) for r in runs])
    values = [r["metrics"]["train_time_20_steps_s"] for r in runs]
    y = list(range(len(runs)))[::-1]
    ax.barh(y, values, color=[colours[series_key(r)[1:6]] for r in runs])
    ax.set_yticks(y)
    ax.set_yticklabels([r["name"] for r in runs], fontsize=8)
    for yi, value in zip(y, values):
        ax.text(value, yi, f" {value:.2f} s", va="center", fontsize=8)
    ax.set_xlabel("seconds for 20 training steps (steady state)")
    ax.set_xlim(0, max(values) * 1.18 if values else 1)
    ax.grid(True, axis="x", alpha=0.3)
    ax.set_title("Time for 20 steps")
    fig.tight_layout()
    save_png(fig, path)


# --------------------------------------------------------------------------------------------------- main


def write_report(records: list[dict], out: Path, title: str) -> dict[str, Path]:
    out.mkdir(parents=True, exist_ok=True)
    ok = [r for r in records if r["status"] == "ok" and not r.get("cache")]
    failed = [r for r in records if r["status"] != "ok"]
    written: dict[str, Path] = {}
    if ok:
        chart_vs_batch(ok, failed, out / CHARTS[0], "throughput")
        chart_vs_batch(ok, failed, out / CHARTS[1], "memory")
        written["throughput"], written["memory"] = out / CHARTS[0], out / CHARTS[1]
    timed = [r for r in ok if r["metrics"].get("train_time_20_steps_s")]
    if timed:
        chart_time_20_steps(timed, out / CHARTS[2])
        written["time_20_steps"] = out / CHARTS[2]
    charts = [p.name for p in written.values()]
    (out / "results.md").write_text(markdown(records, title, charts))
    written["markdown"] = out / "results.md"
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="+", help="record folders or files")
    parser.add_argument("--out", default=None, help="output folder (default: the first folder given)")
    parser.add_argument("--title", default=None)
    args = parser.parse_args(argv)
    try:
        records = table_records(args.paths)
    except FileNotFoundError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if not records:
        print(f"error: no benchmark records in {', '.join(args.paths)}", file=sys.stderr)
        return 2
    first = Path(args.paths[0])
    out = Path(args.out) if args.out else (first if first.is_dir() else first.parent)
    title = args.title or f"Benchmarks: {out.name}"
    written = write_report(records, out, title)
    ok = sum(r["status"] == "ok" for r in records)
    print(f"{len(records)} records ({ok} ok): " + ", ".join(str(p) for p in written.values()))
    return 0


if __name__ == "__main__":
    sys.exit(main())

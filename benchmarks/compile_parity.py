"""Accuracy parity of the fast default: eager vs regional torch.compile, trained from scratch on real data.

    python benchmarks/compile_parity.py --out benchmarks/results/compile_parity_gpu          # one GPU (the gpu preset)
    python benchmarks/compile_parity.py --preset cpu --compiled_flags="--torch_compile_regions true \
        --torch_compile_backend aot_eager" --out outputs/compile_parity_cpu                   # CPU, compiled path too

A ViT is trained from scratch on Fashion-MNIST (Debian's `dataset-fashion-mnist`, split by benchmarks/transfer.py:
train / validation / test) for a fixed number of steps, once per seed and mode: `eager` (--torch_compile_regions
false) and `default` (no flag: on a CUDA GPU the script compiles each ViT layer; without CUDA it trains eagerly,
which the record says; --compiled_flags replaces "no flag" there). The same seed gives both modes the same
initialisation. Writes compile_parity.json, compile_parity.md and loss_curves.png to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

import transfer
from patch_dropout import git_commit


@dataclass
class Preset:
    model: str  # config_overrides of the ViT trained from scratch
    steps: int
    batch: int
    learning_rate: float
    train: int | None  # Fashion-MNIST subsets (None: all 55,000 / 10,000)
    validation: int
    test: int | None
    logging_steps: int
    # Divides the validation and test sizes: compiled runs drop each incomplete last batch, in evaluation too, and
    # both modes must score the same images.
    eval_batch: int
    extra: list[str] = field(default_factory=list)


PRESETS = {
    # One GPU: ViT-S's width and heads, 4 layers (7.2M parameters), the photos upsampled 28 -> 32 px in 4x4 patches
    # (64 tokens); 2,000 steps of 256 are ~9 epochs. Per-step overhead, not the matmuls, sets its speed: the depth
    # is what keeps 6 runs within minutes.
    "gpu": Preset(
        model="image_size=32,patch_size=4,hidden_size=384,num_hidden_layers=4,num_attention_heads=6,"
        "intermediate_size=1536,hidden_dropout_prob=0.0,attention_probs_dropout_prob=0.0",
        steps=2000,
        batch=256,
        learning_rate=1e-3,
        train=None,
        validation=5000,
        test=None,
        logging_steps=20,
        eval_batch=500,
        extra=["--bf16", "true"],
    ),
    # CPU, for tests/test_benchmarks.py: seconds per run.
    "cpu": Preset(
        model=transfer.TINY_VIT,
        steps=100,
        batch=64,
        learning_rate=3e-3,
        train=2000,
        validation=200,
        test=500,
        logging_steps=5,
        eval_batch=100,
        extra=[*transfer.CPU, "--disable_tqdm", "true"],
    ),
}
EAGER = ["--torch_compile_regions", "false"]


def train(work: Path, data: Path, preset: Preset, mode: str, flags: list[str], seed: int) -> dict:
    """One run from scratch: its logged loss curve, final accuracies, steady img/s and command."""
    recipe = work / "parity.yaml"
    recipe.write_text(transfer.PRETRAIN_RECIPE)
    name = f"{mode}-seed{seed}"
    out = work / name
    argv = [
        "--config", str(recipe),
        "--dataset_name", str(data),
        "--output_dir", str(out),
        "--overwrite_output_dir", "true",
        "--config_overrides", preset.model,
        "--max_steps", str(preset.steps),
        "--per_device_train_batch_size", str(preset.batch),
        "--per_device_eval_batch_size", str(preset.eval_batch),
        "--learning_rate", str(preset.learning_rate),
        "--eval_strategy", "no",
        "--logging_steps", str(preset.logging_steps),
        "--seed", str(seed),
        *preset.extra,
        *flags,
    ]  # fmt: skip
    result = transfer.Runner()(mode, seed, argv, out)
    state = json.loads((out / "trainer_state.json").read_text())
    log = (work / f"{name}.log").read_text()
    card = (out / "README.md").read_text()  # its hyperparameters hold the resolved --torch_compile_regions
    per_class = (out / "per_class_accuracy_test.csv").read_text()  # class_id,label,support,...
    return {
        "mode": mode,
        "seed": seed,
        # What ran: the card's resolved setting, and the log's warning when a compilation fell back to eager.
        "compiled": "| torch_compile_regions | True |" in card,
        "compile_fell_back": "torch.compile failed" in log,
        "loss": [(e["step"], e["loss"]) for e in state["log_history"] if "loss" in e and "step" in e],
        "validation_accuracy": result.results["eval_accuracy"],
        "test_accuracy": result.results["test_accuracy"],
        "test_images": sum(int(line.split(",")[2]) for line in per_class.splitlines()[1:]),
        "train_images_per_second": result.results["train_images_per_second"],
        "seconds": result.seconds,
        "command": shlex.join(["python", *result.command]),
    }


def verdict(eager: list[float], default: list[float]) -> dict:
    """Within seed noise: |difference of the mean test accuracies| <= max(2 x the larger std, 0.5 point)."""
    std = [statistics.stdev(v) if len(v) > 1 else 0.0 for v in (eager, default)]
    difference = statistics.fmean(default) - statistics.fmean(eager)
    tolerance = max(2 * max(std), 0.005)
    return {
        "difference": round(difference, 4),
        "tolerance": round(tolerance, 4),
        "verdict": "within seed noise" if abs(difference) <= tolerance + 1e-9 else "differs",
    }


def summarise(runs: list[dict]) -> dict:
    modes = {}
    for mode in ("eager", "default"):
        mine = [r for r in runs if r["mode"] == mode]
        test = [r["test_accuracy"] for r in mine]
        modes[mode] = {
            "runs": len(mine),
            "test_accuracy_mean": round(statistics.fmean(test), 4),
            "test_accuracy_std": round(statistics.stdev(test), 4) if len(test) > 1 else 0.0,
            "validation_accuracy_mean": round(statistics.fmean(r["validation_accuracy"] for r in mine), 4),
            "final_loss_mean": round(statistics.fmean(r["loss"][-1][1] for r in mine), 4),
            "train_images_per_second": round(statistics.fmean(r["train_images_per_second"] for r in mine), 1),
        }
    test = {m: [r["test_accuracy"] for r in runs if r["mode"] == m] for m in modes}
    return {"modes": modes, **verdict(test["eager"], test["default"])}


def markdown(record: dict) -> str:
    s = record["summary"]
    lines = [
        "# Accuracy parity of the fast default: eager vs regional compile",
        "",
        f"{record['device']}, commit {record['commit']}. `{record['command']}`",
        "",
        f"A ViT ({record['preset']['model']}) trained from scratch on Fashion-MNIST for {record['preset']['steps']} "
        f"steps of {record['preset']['batch']}, seeds {', '.join(map(str, record['seeds']))}. `default`: "
        f"{record['default_means']}.",
        "",
        "| mode | runs | test accuracy | validation | final train loss | train img/s |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for mode, row in s["modes"].items():
        lines.append(
            f"| {mode} | {row['runs']} | {row['test_accuracy_mean']:.2%} ± {row['test_accuracy_std']:.2%} "
            f"| {row['validation_accuracy_mean']:.2%} | {row['final_loss_mean']:.4f} "
            f"| {row['train_images_per_second']:,.0f} |"
        )
    lines += [
        "",
        f"Default minus eager: {100 * s['difference']:+.2f} points; tolerance {100 * s['tolerance']:.2f} points. "
        f"**Verdict: {s['verdict']}** (rule: within seed noise when |difference of the mean test accuracies| <= "
        "2 x the larger of the two standard deviations, or <= 0.5 point; else differs).",
        "",
        "| mode | seed | compiled | test | validation | img/s | seconds |",
        "|---|---:|---|---:|---:|---:|---:|",
    ]
    for r in record["runs"]:
        compiled = "no (fell back to eager)" if r["compile_fell_back"] else "yes" if r["compiled"] else "no"
        lines.append(
            f"| {r['mode']} | {r['seed']} | {compiled} | {r['test_accuracy']:.2%} | {r['validation_accuracy']:.2%} "
            f"| {r['train_images_per_second']:,.0f} | {r['seconds']:.0f} |"
        )
    lines += ["", "![loss curves](loss_curves.png)", ""]
    return "\n".join(lines)


def chart(runs: list[dict], path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4.5), dpi=100)
    FigureCanvasAgg(fig)
    loss, accuracy = fig.subplots(1, 2, gridspec_kw={"width_ratios": [2.2, 1]})
    colours = {"eager": "C0", "default": "C3"}
    for i, mode in enumerate(colours):
        mine = [r for r in runs if r["mode"] == mode]
        for j, run in enumerate(mine):
            steps, values = zip(*run["loss"], strict=True)
            loss.plot(steps, values, color=colours[mode], alpha=0.6, lw=1, label=mode if j == 0 else None)
            accuracy.scatter(i, 100 * run["test_accuracy"], color=colours[mode], zorder=3)
            accuracy.annotate(f"seed {run['seed']}", (i, 100 * run["test_accuracy"]), xytext=(6, -3),
                              textcoords="offset points", fontsize=8)  # fmt: skip
        mean = statistics.fmean(100 * r["test_accuracy"] for r in mine)
        accuracy.hlines(mean, i - 0.25, i + 0.25, color=colours[mode], lw=2, label=f"{mode} mean {mean:.2f}%")
    loss.set(xlabel="training step", ylabel="training loss (logged)", title="Training loss, one line per seed")
    loss.set_ylim(bottom=0)
    loss.grid(alpha=0.3)
    loss.legend()
    accuracy.set(xticks=[0, 1], xticklabels=list(colours), xlim=(-0.6, 1.6), ylabel="test accuracy (%)",
                 title="Final test accuracy")  # fmt: skip
    accuracy.grid(alpha=0.3)
    accuracy.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results/compile_parity_gpu")
    parser.add_argument("--work", default=None, help="dataset, run outputs and logs (default: OUT/work)")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="gpu")
    parser.add_argument("--steps", type=int, default=None, help="default: the preset's")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument(
        "--compiled_flags",
        default="",
        help="flags of the 'default' mode instead of none, e.g. '--torch_compile_regions true "
        "--torch_compile_backend aot_eager' to exercise the compiled path on a CPU",
    )
    parser.add_argument("--fashion_mnist", default=transfer.FASHION_MNIST, help="folder of the idx .gz files")
    parser.add_argument("--replot", metavar="OUT", help="only redraw OUT/loss_curves.png from OUT's record")
    args = parser.parse_args(argv)
    if args.replot:
        chart(
            json.loads(Path(args.replot, "compile_parity.json").read_text())["runs"],
            Path(args.replot, "loss_curves.png"),
        )
        return {}
    preset = PRESETS[args.preset]
    if args.steps:
        preset = Preset(**{**asdict(preset), "steps": args.steps})
    out = Path(args.out)
    work = Path(args.work) if args.work else out / "work"
    work.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    data = work / f"fashion-mnist-{args.preset}"
    if not (data / "data" / "train-00000-of-00001.parquet").is_file():
        try:
            transfer.build_fashion_mnist(args.fashion_mnist, data, preset.train, preset.validation, preset.test)
        except transfer.MissingData as err:
            parser.exit(2, f"error: {err}\n")
    compiled = shlex.split(args.compiled_flags)
    cuda = not transfer.device_description().startswith("CPU")
    if compiled:
        default_means = f"`{args.compiled_flags}` (given by --compiled_flags)"
    elif cuda:
        default_means = "no flag: regional compilation, the CUDA default"
    else:
        default_means = "no flag, and no CUDA here: the default trains eagerly, so both modes are eager"
    print(f"default mode: {default_means}", flush=True)
    runs = []
    for seed in args.seeds:
        for mode, flags in (("eager", EAGER), ("default", compiled)):
            runs.append(train(work, data, preset, mode, flags, seed))
            r = runs[-1]
            print(f"{mode:>7} seed {seed}: test {r['test_accuracy']:.2%}, validation {r['validation_accuracy']:.2%}, "
                  f"{r['train_images_per_second']:,.0f} img/s ({r['seconds']:.0f}s)", flush=True)  # fmt: skip
    record = {
        "command": shlex.join(["python", "benchmarks/compile_parity.py", *(sys.argv[1:] if argv is None else argv)]),
        "commit": os.environ.get("BENCH_GIT_COMMIT") or git_commit(),  # a device's copy of the tree has no .git
        "device": transfer.device_description(),
        "default_means": default_means,
        "preset": {"name": args.preset, **asdict(preset)},
        "seeds": args.seeds,
        "summary": summarise(runs),
        "runs": runs,
    }
    (out / "compile_parity.json").write_text(json.dumps(record, indent=2) + "\n")
    (out / "compile_parity.md").write_text(markdown(record))
    print(markdown(record))
    try:
        chart(runs, out / "loss_curves.png")
    except ImportError:  # a GPU machine without matplotlib: draw it where the record lands
        print(f"matplotlib missing: draw loss_curves.png with --replot {out}")
    return record


if __name__ == "__main__":
    main()

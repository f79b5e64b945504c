"""Time to accuracy with patch dropout, on real data: the transfer check's base, fine-tuned at several rates.

    python benchmarks/patch_dropout.py --out benchmarks/results/patch_dropout_cpu [--rates 0 0.25 0.5 --seeds 0 1 2]

A ViT pretrained here on Fashion-MNIST (benchmarks/transfer.py's base; Debian's `dataset-fashion-mnist`) is
fine-tuned on scikit-learn's digits with `--patch_dropout RATE`, validation scored every epoch. The target is the
rate-0 run's final validation accuracy (mean over seeds) minus 0.5 point; a rate's time to it is the first epoch
whose validation accuracy reaches it, times that run's steady training time per epoch (step time x steps: the
compute, without the evaluations). Writes patch_dropout.json, patch_dropout.md and time_to_accuracy.png to --out.

    python benchmarks/patch_dropout.py --from_scratch gpu --seeds 0 --out OUT     # ViT-B/16 size, one GPU

--from_scratch trains the ViT from scratch on Fashion-MNIST instead (no base; validation every epoch): `gpu` is
ViT-B/16 on the photos upsampled to 224 px (196 patches, where dropping patches saves compute), `cpu` a tiny ViT
for the tests. The digits are too few (1,797) to time a ViT-B/16 fine-tuning; 55,000 photos are not.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
from pathlib import Path

import transfer

ROOT = Path(__file__).resolve().parents[1]


def finetune(work: Path, size: transfer.Size, rate: float, seed: int, lr: float) -> dict:
    """One fine-tuning run at `rate`: its per-epoch validation accuracy, step time, test accuracy and command."""
    flags = ["--eval_strategy", "epoch", "--patch_dropout", str(rate)]
    name = f"rate{rate:g}-seed{seed}"
    result = transfer.finetune(work, size, transfer.Runner(), "full", seed, lr, extra=flags, name=name)
    state = json.loads((work / name / "trainer_state.json").read_text())
    curve = [(e["epoch"], e["eval_accuracy"]) for e in state["log_history"] if "eval_accuracy" in e and "epoch" in e]
    return {
        "rate": rate,
        "seed": seed,
        "validation_curve": curve[:-1] if len(curve) > size.finetune_epochs else curve,  # the final re-evaluation out
        "epoch_seconds": result.results["train_step_time_s"] * state["global_step"] / size.finetune_epochs,
        "train_images_per_second": result.results["train_images_per_second"],
        "test_accuracy": result.results["test_accuracy"],
        "command": " ".join(result.command),
    }


# --from_scratch presets: (config_overrides, epochs, batch, learning rate, train / validation / test sizes, extra).
SCRATCH = {
    "gpu": ("image_size=224,patch_size=16,hidden_size=768,num_hidden_layers=12,num_attention_heads=12,"
            "intermediate_size=3072", 5, 512, 5e-4, (None, 5000, 10000), ["--bf16", "true"]),
    "cpu": (transfer.TINY_VIT, 3, 50, 3e-3, (500, 100, 100), [*transfer.CPU, "--disable_tqdm", "true"]),
}  # fmt: skip


def from_scratch(work: Path, data: Path, preset: str, rate: float, seed: int, epochs: int, lr: float) -> dict:
    """One run from scratch on Fashion-MNIST at `rate`, scored on validation every epoch (same fields as finetune)."""
    import compile_parity  # it imports this module: imported here, when both are loaded

    model, _, batch, _, (train, validation, test), extra = SCRATCH[preset]
    steps_per_epoch = (train or 55000) // batch  # training drops the short last batch where it compiles: count whole
    settings = compile_parity.Preset(model, steps_per_epoch * epochs, batch, lr, train, validation, test,
                                     logging_steps=steps_per_epoch, eval_batch=250, extra=extra)  # fmt: skip
    flags = ["--eval_strategy", "steps", "--eval_steps", str(steps_per_epoch), "--patch_dropout", str(rate)]
    name = f"rate{rate:g}-epochs{epochs}"
    run = compile_parity.train(work, data, settings, name, flags, seed)
    state = json.loads((work / f"{name}-seed{seed}" / "trainer_state.json").read_text())
    curve = [(e["step"] / steps_per_epoch, e["eval_accuracy"]) for e in state["log_history"] if "eval_accuracy" in e]
    results = json.loads((work / f"{name}-seed{seed}" / "all_results.json").read_text())
    return {
        "rate": rate,
        "seed": seed,
        "epochs": epochs,
        "validation_curve": [(round(e, 3), a) for e, a in curve if e <= epochs][:epochs],
        "epoch_seconds": results["train_step_time_s"] * steps_per_epoch,
        "train_images_per_second": run["train_images_per_second"],
        "test_accuracy": run["test_accuracy"],
        "command": run["command"],
    }


def git_commit() -> str:
    import subprocess

    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return done.stdout.strip() or "unknown"


def time_to(run: dict, target: float) -> float | None:
    """Training seconds until the first epoch whose validation accuracy reaches `target` (None: never)."""
    epoch = next((e for e, accuracy in run["validation_curve"] if accuracy >= target), None)
    return None if epoch is None else round(epoch * run["epoch_seconds"], 2)


def summarise(runs: list[dict], rates: list[float]) -> dict:
    baseline = [r["validation_curve"][-1][1] for r in runs if r["rate"] == 0]
    target = statistics.fmean(baseline) - 0.005
    rows = {}
    for rate in rates:
        mine = [r for r in runs if r["rate"] == rate]
        times = [time_to(r, target) for r in mine]
        reached = [t for t in times if t is not None]
        rows[f"{rate:g}"] = {
            "runs": len(mine),
            "reached_target": len(reached),
            "time_to_target_s": round(statistics.fmean(reached), 2) if len(reached) == len(mine) else None,
            "train_images_per_second": round(statistics.fmean(r["train_images_per_second"] for r in mine), 1),
            "final_validation_accuracy": round(statistics.fmean(r["validation_curve"][-1][1] for r in mine), 4),
            "test_accuracy": round(statistics.fmean(r["test_accuracy"] for r in mine), 4),
            "test_accuracy_std": round(statistics.stdev(r["test_accuracy"] for r in mine), 4)
            if len(mine) > 1
            else 0.0,
        }
    base_time = rows["0"]["time_to_target_s"]
    for row in rows.values():
        t = row["time_to_target_s"]
        row["speedup_to_target"] = round(base_time / t, 2) if base_time and t else None
    return {"target_validation_accuracy": round(target, 4), "rates": rows}


def markdown(record: dict) -> str:
    s = record["summary"]
    setup = (
        record.get("setup")
        or f"The base: {record['base']}. Fine-tuned on digits for {record['finetune_epochs']} epochs"
    )
    lines = [
        "# Patch dropout: time to accuracy on real data",
        "",
        f"{record['device']}, commit {record['commit']}. `{record['command']}`",
        "",
        f"{setup}, learning rate {record['learning_rate']:g}, seeds "
        f"{', '.join(map(str, record['seeds']))}. Target: the rate-0 final validation accuracy minus 0.5 point = "
        f"{s['target_validation_accuracy']:.2%}.",
        "",
        "| rate | train img/s | time to target (s) | speed-up to target | final validation | test accuracy |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for rate, row in s["rates"].items():
        t = row["time_to_target_s"]
        reached = f"{t:.1f}" if t is not None else f"not reached ({row['reached_target']}/{row['runs']} runs)"
        speedup = f"{row['speedup_to_target']:.2f}x" if row["speedup_to_target"] else "-"
        lines.append(
            f"| {rate} | {row['train_images_per_second']:,.0f} | {reached} | {speedup} | "
            f"{row['final_validation_accuracy']:.2%} | {row['test_accuracy']:.2%} ± {row['test_accuracy_std']:.2%} |"
        )
    lines += ["", "![time to accuracy](time_to_accuracy.png)", ""]
    return "\n".join(lines)


def chart(runs: list[dict], target: float, path: Path, title: str = "Digits fine-tuning") -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4.5), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    colours = {}
    for run in runs:
        colour = colours.setdefault(run["rate"], f"C{len(colours)}")
        seconds = [e * run["epoch_seconds"] for e, _ in run["validation_curve"]]
        label = f"rate {run['rate']:g}" if run["seed"] == min(r["seed"] for r in runs) else None
        ax.plot(seconds, [a for _, a in run["validation_curve"]], color=colour, marker=".", label=label, alpha=0.8)
    ax.axhline(target, color="grey", linestyle=":", label=f"target {target:.1%}")
    ax.set_xlabel("training seconds (steady step time x steps)")
    ax.set_ylabel("validation accuracy")
    ax.set_title(f"{title} with patch dropout (one line per seed)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results/patch_dropout_cpu")
    parser.add_argument("--work", default=None, help="datasets, checkpoints and logs (default: OUT/work)")
    parser.add_argument("--size", choices=sorted(transfer.SIZES), default="small")
    parser.add_argument("--rates", nargs="+", type=float, default=[0.0, 0.25, 0.5])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--learning_rate", type=float, default=None, help="default: the size's (or preset's) rate")
    parser.add_argument("--fashion_mnist", default=transfer.FASHION_MNIST)
    parser.add_argument("--from_scratch", choices=sorted(SCRATCH), help="train from scratch on Fashion-MNIST instead")
    parser.add_argument(
        "--equal_budget",
        action="store_true",
        help="--from_scratch: rate R trains EPOCHS / (1 - R) epochs, the patch tokens (compute) of rate 0's EPOCHS "
        "(PatchDropout's own comparison); without it every rate trains the preset's epochs",
    )
    args = parser.parse_args(argv)
    if 0.0 not in args.rates:
        parser.error("--rates must include 0 (the baseline the target comes from)")
    size = transfer.SIZES[args.size]
    lr = args.learning_rate or (lambda v: v[0] if isinstance(v, list) else v)(size.learning_rates["full"])
    out = Path(args.out)
    work = Path(args.work) if args.work else out / "work"
    work.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    record_file = out / "patch_dropout.json"

    def write(runs: list[dict], setup: str | None, base: str | None, epochs: int, quiet: bool = False) -> None:
        """The record, its markdown and chart, from the runs so far (written after each run of --from_scratch)."""
        rates = [rate for rate in args.rates if any(r["rate"] == rate for r in runs)]
        summary = summarise(runs, rates)
        record = {
            "command": "python benchmarks/patch_dropout.py " + " ".join(sys.argv[1:] if argv is None else argv),
            "commit": os.environ.get("BENCH_GIT_COMMIT") or git_commit(),  # a device's copy of the tree has no .git
            "device": transfer.device_description(),
            "setup": setup,
            "base": base,
            "finetune_epochs": epochs,
            "learning_rate": lr,
            "seeds": sorted({r["seed"] for r in runs}),
            "summary": summary,
            "runs": runs,
        }
        record_file.write_text(json.dumps(record, indent=2) + "\n")
        title = "From scratch on Fashion-MNIST" if setup else "Digits fine-tuning"
        try:
            chart(runs, summary["target_validation_accuracy"], out / "time_to_accuracy.png", title)
        except ImportError:  # a GPU machine without matplotlib: the record keeps the runs to draw it from
            print("matplotlib missing: time_to_accuracy.png not drawn")
        (out / "patch_dropout.md").write_text(markdown(record))
        if not quiet:
            print(markdown(record))

    if args.from_scratch:
        model, epochs, batch, preset_lr, (train, validation, test), _ = SCRATCH[args.from_scratch]
        lr = args.learning_rate or preset_lr
        data = work / f"fashion-mnist-{args.from_scratch}"
        try:
            if not (data / "data" / "train-00000-of-00001.parquet").is_file():
                transfer.build_fashion_mnist(args.fashion_mnist, data, train, validation, test)
        except transfer.MissingData as err:
            parser.exit(2, f"error: {err}\n")
        plan = {rate: round(epochs / (1 - rate)) if args.equal_budget else epochs for rate in args.rates}
        setup = (f"A ViT ({model}) trained from scratch on Fashion-MNIST ({train or 55000:,} photos, validation "
                 f"{validation:,}), batch {batch}, epochs per rate {plan}")  # fmt: skip
        # Runs of this plan already in OUT's record (an earlier call) are kept, not run again.
        earlier = json.loads(record_file.read_text()) if record_file.is_file() else {}
        runs = [r for r in earlier.get("runs", []) if plan.get(r["rate"]) == r.get("epochs", epochs)]
        for seed in args.seeds:  # seeds outermost: a call cut short still has every rate of its first seeds
            for rate in args.rates:
                if any((r["rate"], r["seed"]) == (rate, seed) for r in runs):
                    continue
                runs.append(from_scratch(work, data, args.from_scratch, rate, seed, plan[rate], lr))
                print(f"rate {rate:g} seed {seed}: test {runs[-1]['test_accuracy']:.2%}", flush=True)
                write(runs, setup, None, epochs, quiet=True)
        write(runs, setup, None, epochs)
        return
    try:
        base = transfer.pretrain(work, size, transfer.Runner(), args.fashion_mnist, reuse=True)
    except transfer.MissingData as err:
        parser.exit(2, f"error: {err}\n")
    runs = []
    for rate in args.rates:
        for seed in args.seeds:
            runs.append(finetune(work, size, rate, seed, lr))
            print(f"rate {rate:g} seed {seed}: test {runs[-1]['test_accuracy']:.2%}", flush=True)
    base_text = f"ViT ({size.model}) pretrained on Fashion-MNIST, test accuracy {base.results.get('test_accuracy', math.nan):.2%}"
    write(runs, None, base_text, size.finetune_epochs)


if __name__ == "__main__":
    main()

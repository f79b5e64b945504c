"""Tracking: per-step metrics in every tracker's logs, TensorBoard by default, W&B offline, trackio, plots."""

import importlib.util
import json
import logging
import subprocess
import sys
import time
import types

import pytest
from conftest import ROOT, run_args

from vit_recipes.core.arguments import parse_args, resolve_report_to
from vit_recipes.core.errors import RecipeError
from vit_recipes.train.meter import SpeedMeter

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def tracked_run_args(data, model, out, *extra):
    """A tiny run logging every 2 steps and evaluating every 3."""
    return run_args(
        data,
        model,
        out,
        "--max_steps",
        "6",
        "--logging_steps",
        "2",
        "--eval_strategy",
        "steps",
        "--eval_steps",
        "3",
        *extra,
    )


# --- Arguments ------------------------------------------------------------------------------------------------


def test_tensorboard_is_the_default_tracker(tmp_path):
    args = parse_args(["--dataset_name", "cifar100", "--output_dir", str(tmp_path)])
    assert args.training.report_to == ["tensorboard"]
    args = parse_args(["--dataset_name", "x", "--output_dir", str(tmp_path), "--report_to", "tensorboard,wandb"])
    assert args.training.report_to == ["tensorboard", "wandb"]
    args = parse_args(["--dataset_name", "x", "--output_dir", str(tmp_path), "--report_to", "none"])
    assert args.training.report_to == []


def test_default_degrades_with_one_line_without_tensorboard(monkeypatch, caplog):
    monkeypatch.setattr("vit_recipes.core.arguments.tensorboard_available", lambda: False)
    with caplog.at_level(logging.WARNING, logger="vit_recipes.core.arguments"):
        assert resolve_report_to("tensorboard") == "none"
        assert resolve_report_to(["tensorboard", "wandb"]) == "wandb"
    assert [r.getMessage() for r in caplog.records if r.name == "vit_recipes.core.arguments"] == [
        "tensorboard is not installed: TensorBoard logging is off (pip install tensorboard)."
    ] * 2


@pytest.mark.parametrize("bad", ["20-", "a-b", "5-3", "0-2", "1-2-3"])
def test_bad_profile_steps_is_one_line_error(tmp_path, bad):
    with pytest.raises(RecipeError, match="profile_steps"):
        parse_args(["--dataset_name", "x", "--output_dir", str(tmp_path), "--profile_steps", bad])


def test_profile_window(tmp_path):
    args = parse_args(["--dataset_name", "x", "--output_dir", str(tmp_path), "--profile_steps", "20-25"])
    assert args.observe.profile_window == (20, 25)
    assert parse_args(["--dataset_name", "x", "--output_dir", str(tmp_path)]).observe.profile_window is None


# --- SpeedMeter ---------------------------------------------------------------------------------------------


class _Args:
    device = "cpu"


def test_step_metrics_per_log_interval(monkeypatch):
    clock = iter([0.0, 1.0, 1.5, 2.0, 10.0, 10.25])
    monkeypatch.setattr("vit_recipes.train.meter.time.perf_counter", lambda: next(clock))
    callback = SpeedMeter(images_per_step=16, flops_per_image=1e9, peak_flops=64e9)
    callback.on_train_begin(_Args, None, None)  # t=0
    callback.add_data_wait(0.25)
    callback.on_step_end(_Args, None, None)  # step 1: 1.0 s
    callback.on_step_end(_Args, None, None)  # step 2: 0.5 s
    callback.on_step_end(_Args, None, None)  # step 3: 0.5 s
    logs = callback.extend_logs({"loss": 1.0, "learning_rate": 1e-3}, _Args, None)
    assert logs["step_time_s"] == pytest.approx(2.0 / 3)
    assert logs["images_per_second"] == pytest.approx(16 * 3 / 2.0, rel=1e-3)
    assert logs["data_wait_fraction"] == pytest.approx(0.125)
    assert logs["mfu"] == pytest.approx(24 * 1e9 / 64e9, rel=1e-3)
    assert logs["cpu_peak_rss_gib_rank0"] > 0  # one process: rank 0 only
    assert callback.extend_logs({"eval_loss": 1.0}, _Args, None) == {}  # evaluation logs are left alone
    callback.on_evaluate(_Args, None, None)  # time spent evaluating is not a training step
    callback.on_step_end(_Args, None, None)  # t=10: restarts timing only
    callback.on_step_end(_Args, None, None)  # 0.25 s
    logs = callback.extend_logs({"loss": 1.0, "learning_rate": 1e-3}, _Args, None)
    assert logs["step_time_s"] == pytest.approx(0.25)


def test_meter_records_the_wait_before_training_runs_at_speed(monkeypatch):
    """Process start to the first step's end, and the warm-up steps' time (compilation lands there): what a user
    waits for before the steady figures apply. The peer (benchmarks/peer.py) reports the same two through this meter."""
    import psutil

    clock = iter([0.0, 3.0, 3.1, 3.2, 3.3, 3.4, 3.5, 3.6])  # the first step compiles
    monkeypatch.setattr("vit_recipes.train.meter.time.perf_counter", lambda: next(clock))
    meter = SpeedMeter(images_per_step=4)
    meter.on_train_begin(_Args, None, None)
    for step in range(1, 8):
        meter.on_step_end(_Args, types.SimpleNamespace(global_step=step), None)
    metrics = meter.metrics()
    assert metrics["train_warmup_s"] == pytest.approx(3.4)  # through step 5 (SpeedMeter.warmup_steps)
    # recorded rounded to 0.01 s: at most the process's age now, give or take that rounding
    assert 0 < metrics["train_first_step_after_start_s"] <= time.time() - psutil.Process().create_time() + 0.01
    assert metrics["train_step_time_s"] == pytest.approx(0.1)  # steps 6 and 7 only


# --- End to end -----------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_tensorboard_events_carry_step_and_eval_metrics_and_plots_are_written(
    cifar_like, tiny_vit, tmp_path, run_script
):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "run"
    run_script(*tracked_run_args(cifar_like, tiny_vit, out, "--report_to", "tensorboard"))
    event_files = sorted((out / "runs").rglob("events.out.tfevents.*"))
    assert event_files, "TensorBoard wrote no event files"
    scalars: dict[str, list] = {}
    for path in event_files:  # training writes one file; the final eval/test metrics (after train end) another
        accumulator = EventAccumulator(str(path))
        accumulator.Reload()
        for tag in accumulator.Tags()["scalars"]:
            scalars.setdefault(tag, []).extend(accumulator.Scalars(tag))
    per_step = ["loss", "learning_rate", "grad_norm", "images_per_second", "step_time_s", "data_wait_fraction"]
    for name in per_step:
        assert [e.step for e in scalars[f"train/{name}"]] == [2, 4, 6], name
    assert [e.step for e in scalars["train/cpu_peak_rss_gib_rank0"]] == [2, 4, 6]  # memory per rank (CPU: RSS)
    assert all(e.value > 0 for e in scalars["train/images_per_second"])
    for name in ("loss", "accuracy", "top5_accuracy", "f1_macro"):
        assert [e.step for e in scalars[f"eval/{name}"]][:2] == [3, 6], name  # periodic evaluations
        assert f"test/{name}" in scalars, name  # the final test split, from Trainer.predict
    # The same per-step values are in trainer_state.json's log_history, which the plots are drawn from.
    history = json.loads((out / "trainer_state.json").read_text())["log_history"]
    assert all("images_per_second" in e for e in history if "loss" in e)
    for name in ("training_curves", "validation_metrics", "throughput", "confusion_matrix_test"):
        data = (out / f"{name}.png").read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 5_000, name
    # tools/redraw_plots.py draws the same plots again from trainer_state.json alone.
    for name in ("training_curves", "validation_metrics", "throughput"):
        (out / f"{name}.png").unlink()
    redraw = subprocess.run([sys.executable, ROOT / "tools" / "redraw_plots.py", out], capture_output=True, text=True)
    assert redraw.returncode == 0, redraw.stderr
    for name in ("training_curves", "validation_metrics", "throughput"):
        assert (out / f"{name}.png").read_bytes().startswith(PNG_MAGIC), name
    missing = subprocess.run(
        [sys.executable, ROOT / "tools" / "redraw_plots.py", tmp_path], capture_output=True, text=True
    )
    assert missing.returncode == 2 and "trainer_state.json not found" in missing.stderr


@pytest.mark.slow
def test_wandb_offline_needs_no_account(cifar_like, tiny_vit, tmp_path, run_script, monkeypatch):
    wandb = pytest.importorskip("wandb", reason="wandb is not installed (pip install wandb)")
    for key in ("WANDB_API_KEY", "WANDB_ENTITY", "WANDB_BASE_URL"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "config"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = tmp_path / "run"
    try:
        run_script(*tracked_run_args(cifar_like, tiny_vit, out, "--report_to", "wandb", "--plots", "false"))
    finally:
        wandb.finish()
    runs = sorted((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, "one offline run for training and the final evaluation"
    # wandb's service process writes the run file after finish() returns: on a loaded machine, give it a few seconds
    import time

    deadline = time.monotonic() + 30
    while b"test/accuracy" not in (logged := b"".join(p.read_bytes() for p in runs[0].glob("*.wandb"))):
        if time.monotonic() > deadline:
            break
        time.sleep(0.5)
    for key in (
        b"train/images_per_second",
        b"train/step_time_s",
        b"train/grad_norm",
        b"eval/accuracy",
        b"test/accuracy",
    ):
        assert key in logged, key


@pytest.mark.slow
@pytest.mark.skipif(
    importlib.util.find_spec("trackio") is None, reason="trackio is not installed (pip install trackio)"
)
def test_trackio_logs_locally(cifar_like, tiny_vit, tmp_path, run_script, monkeypatch):
    import sqlite3

    monkeypatch.setenv("TRACKIO_DIR", str(tmp_path / "trackio"))
    out = tmp_path / "run"
    run_script(
        *tracked_run_args(
            cifar_like, tiny_vit, out, "--report_to", "trackio", "--project", "vit-test", "--plots", "false"
        )
    )
    database = sqlite3.connect(tmp_path / "trackio" / "vit-test.db")
    rows = database.execute("select run_name, metrics from metrics").fetchall()
    assert len({name for name, _ in rows}) == 1, "training and the final evaluation share one run"
    logged = b" ".join(m if isinstance(m, bytes) else m.encode() for _, m in rows)
    for key in (b"train/images_per_second", b"train/grad_norm", b"eval/accuracy", b"test/accuracy"):
        assert key in logged, key


def test_plots_say_when_train_loss_is_smoothed_and_draw_amounts_from_zero(tmp_path, monkeypatch):
    from vit_recipes.publish import plots

    figures = []
    monkeypatch.setattr(plots, "save_png", lambda fig, path: figures.append(fig) or path)
    train = [
        {
            "step": s,
            "loss": 2 - s / 10,
            "learning_rate": 1e-3,
            "images_per_second": 1000.0 + s,
            "step_time_s": 0.5,
            "data_wait_fraction": 0.01,
            "gpu_mem_allocated_gib_rank0": 0.55 + s / 1000,
        }  # fmt: skip
        for s in (10, 20)
    ]
    plots.write_plots([*train, {"step": 20, "eval_loss": 1.5, "eval_accuracy": 0.5}], str(tmp_path), 0.1)
    curves, _, throughput = figures
    loss = curves.axes[0]
    labels = [line.get_label() for line in loss.get_lines()]
    assert labels == ["train, label smoothing 0.1", "validation (no smoothing)"]
    figures.clear()
    plots.write_plots([*train, {"step": 20, "eval_loss": 1.5}], str(tmp_path), 0.0)  # no smoothing: nothing to say
    assert [line.get_label() for line in figures[0].axes[0].get_lines()] == ["train", "validation"]
    assert loss.get_lines()[0].get_marker() == "o"  # two points only: each drawn
    memory = throughput.axes[-1]
    assert memory.get_title() == "GPU memory allocated per rank" and memory.get_ylim()[0] == 0  # not a 0.55 cliff
    assert all(ax.get_ylim()[0] == 0 for ax in throughput.axes)


def test_every_plot_reads_at_a_glance(tmp_path, monkeypatch):
    """Titles in words, both axes labelled (with units), zero-based y axes, no point on the frame, legends outside."""
    from vit_recipes.publish import plots

    figures = []
    monkeypatch.setattr(plots, "save_png", lambda fig, path: figures.append(fig) or path)
    train = [
        {
            "step": s,
            "loss": 2 - s / 100,
            "learning_rate": 1e-3,
            "grad_norm": 1.0 + s / 100,
            "images_per_second": 900.0,
            "step_time_s": 0.1,
            "data_wait_fraction": 0.01,
            "mfu": 0.3,
            "cpu_peak_rss_gib_rank0": 3.0,
            "cpu_peak_rss_gib_rank1": 3.1,
        }  # fmt: skip
        for s in range(10, 110, 10)
    ]
    evals = [{"step": s, "eval_loss": 1.0, "eval_accuracy": 0.9, "eval_top5_accuracy": 0.9963 if s < 100 else 1.0}
             for s in (50, 100)]  # fmt: skip
    plots.write_plots([*train, *evals], str(tmp_path), 0.1)
    assert len(figures) == 3
    for fig in figures:
        for ax in fig.axes:
            title = ax.get_title()
            assert title and "_" not in title and ax.get_xlabel() == "training step" and ax.get_ylabel(), title
            bottom, top = ax.get_ylim()
            highest = max(max(line.get_ydata()) for line in ax.get_lines())
            assert bottom == 0 and top > highest, title  # honest scale, nothing cut by the frame
            if ax.get_legend() is not None:  # below the axes, not over the lines
                assert ax.get_legend().get_bbox_to_anchor().transformed(ax.transAxes.inverted()).y1 <= 0, title
    top5 = next(ax for ax in figures[1].axes if ax.get_title() == "Validation top-5 accuracy")
    assert top5.get_ylim() == (0, 1.05) and top5.get_ylabel() == "fraction (1 = all)"  # 0.9963 -> 1.0 is no cliff
    ranks = figures[2].axes[-1]
    assert ranks.get_title() == "Peak host memory (RSS) per rank" and ranks.get_ylabel() == "GiB"
    assert [line.get_label() for line in ranks.get_lines()] == ["rank 0", "rank 1"]


def test_the_logged_grad_norm_is_the_mean_over_the_logging_window(monkeypatch):
    import types

    import torch
    from transformers import Trainer

    from vit_recipes.train.trainer import ImageClassificationTrainer

    norms, logged = iter([1.0, 10.0, 4.0, 7.0]), []
    monkeypatch.setattr(Trainer, "_get_grad_norm", lambda self, model, grad_norm=None: torch.tensor(next(norms)))
    monkeypatch.setattr(Trainer, "log", lambda self, logs, start_time=None: logged.append(dict(logs)))
    trainer = ImageClassificationTrainer.__new__(ImageClassificationTrainer)
    trainer._grad_norms, trainer.callback_handler = (0.0, 0), types.SimpleNamespace(callbacks=[])
    for _ in range(3):
        trainer._get_grad_norm(None)
    trainer.log({"loss": 1.0, "grad_norm": 4.0})  # the Trainer logs the last step's
    trainer._get_grad_norm(None)
    trainer.log({"eval_loss": 0.5})  # an evaluation log leaves the window alone
    trainer.log({"loss": 1.0, "grad_norm": 7.0})
    assert [e.get("grad_norm") for e in logged] == [5.0, None, 7.0]


def test_a_non_finite_loss_is_logged_by_the_trainers_rule_without_a_check_on_the_host(tmp_path, monkeypatch):
    """The Trainer's own NaN/inf filter reads each step's loss on the host (a GPU sync per step): ours applies its
    rule on the device. Both log the same losses; --logging_nan_inf_filter false logs the NaN."""
    import math

    import torch
    from conftest import tiny_vit_config
    from transformers import Trainer, ViTForImageClassification

    from vit_recipes.core.arguments import RecipeTrainingArguments
    from vit_recipes.train.trainer import ImageClassificationTrainer

    class TrainersOwnCheck(ImageClassificationTrainer):  # the Trainer's path: its host-side check, no device rule
        def train(self, *args, **kwargs):
            return Trainer.train(self, *args, **kwargs)

        def training_step(self, *args, **kwargs):
            return Trainer.training_step(self, *args, **kwargs)

    step = Trainer.training_step
    calls = {"n": 0}

    def nan_at_the_third(self, *args, **kwargs):  # the logged value only: the weights train on the real loss
        calls["n"] += 1
        loss = step(self, *args, **kwargs)
        return loss * float("nan") if calls["n"] == 3 else loss

    monkeypatch.setattr(Trainer, "training_step", nan_at_the_third)
    generator = torch.Generator().manual_seed(0)
    data = [{"pixel_values": torch.randn(3, 16, 16, generator=generator), "labels": i % 7} for i in range(16)]

    def logged_losses(cls, **flags):
        calls["n"] = 0
        torch.manual_seed(0)
        args = RecipeTrainingArguments(output_dir=str(tmp_path / cls.__name__), use_cpu=True, report_to="none",
                                       max_steps=4, logging_steps=2, per_device_train_batch_size=4,
                                       eval_strategy="no", save_strategy="no", dataloader_num_workers=0,
                                       disable_tqdm=True, **flags)  # fmt: skip
        trainer = cls(model=ViTForImageClassification(tiny_vit_config()), args=args, train_dataset=data)
        trainer.train()
        assert args.logging_nan_inf_filter == flags.get("logging_nan_inf_filter", True)  # restored after train()
        return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]

    ours = logged_losses(ImageClassificationTrainer)
    assert len(ours) == 2 and all(math.isfinite(loss) for loss in ours)
    assert ours == pytest.approx(logged_losses(TrainersOwnCheck), rel=1e-6)
    unfiltered = logged_losses(ImageClassificationTrainer, logging_nan_inf_filter=False)
    assert unfiltered[0] == pytest.approx(ours[0]) and math.isnan(unfiltered[1])


def test_training_runs_with_what_was_built_out_of_the_garbage_collectors_way(tmp_path):
    """gc.freeze() before training (accelerate's full collection at its start took 0.3 s on a GPU machine), undone
    after, so that what the run drops later is collected."""
    import gc

    import torch
    from conftest import tiny_vit_config
    from transformers import TrainerCallback, ViTForImageClassification

    from vit_recipes.core.arguments import RecipeTrainingArguments
    from vit_recipes.train.trainer import ImageClassificationTrainer

    frozen = []

    class Frozen(TrainerCallback):
        def on_train_begin(self, *args, **kwargs):
            frozen.append(gc.get_freeze_count())

    data = [{"pixel_values": torch.randn(3, 16, 16), "labels": i % 7} for i in range(8)]
    args = RecipeTrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none", max_steps=1,
                                   per_device_train_batch_size=4, eval_strategy="no", save_strategy="no",
                                   dataloader_num_workers=0, disable_tqdm=True)  # fmt: skip
    model = ViTForImageClassification(tiny_vit_config())
    ImageClassificationTrainer(model=model, args=args, train_dataset=data, callbacks=[Frozen()]).train()
    assert frozen[0] > 0 and gc.get_freeze_count() == 0

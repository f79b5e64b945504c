"""End-to-end runs of run_image_classification.py on tiny local data and checkpoints."""

import csv
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import ROOT, TRAIN_SEED, logged_losses, run_args
from safetensors.torch import load_file

from vit_recipes.core.errors import RecipeError

pytestmark = pytest.mark.slow


def tiny_run_args(data, model, out, *extra):
    return run_args(data, model, out, "--lr_scheduler_type", "constant", "--crop_scale_min", "0.5", *extra)


@pytest.fixture
def cifar_without_test(cifar_like, tmp_path) -> Path:
    """cifar_like's train split alone: validation is carved from it (100 images) and there is no test split."""
    (tmp_path / "no-test" / "data").mkdir(parents=True)
    shutil.copy(cifar_like / "data" / "train-00000-of-00001.parquet", tmp_path / "no-test" / "data")
    return tmp_path / "no-test"


@pytest.fixture
def watched_run(monkeypatch):
    """Trainer.predict's metric prefixes during a run, and the run's trainer and splits (steps.evaluate's)."""
    from transformers import Trainer

    import run_image_classification

    predict, evaluate, seen = Trainer.predict, run_image_classification.evaluate, {"predicted": []}

    def counted(self, dataset, *args, **kwargs):
        seen["predicted"].append(kwargs.get("metric_key_prefix", "test"))
        return predict(self, dataset, *args, **kwargs)

    def captured(trainer, splits):
        seen.update(trainer=trainer, splits=splits)
        return evaluate(trainer, splits)

    monkeypatch.setattr(Trainer, "predict", counted)
    monkeypatch.setattr(run_image_classification, "evaluate", captured)
    seen["predict"] = predict  # the Trainer's own, uncounted
    return seen


def test_train_evaluate_test_reports_and_card(cifar_like, tiny_vit, tmp_path, run_script, watched_run, capsys):
    out = tmp_path / "run"
    # --storage_size 20: the 32x32 images are stored at 20x20 (unset: 18, the model's 16 / 0.875)
    results = run_script(*tiny_run_args(cifar_like, tiny_vit, out, "--max_steps", "6", "--eval_strategy", "epoch",
                                        "--storage_size", "20"))  # fmt: skip
    printed = capsys.readouterr().out
    assert watched_run["predicted"] == ["test"]  # validation is the last step's evaluation; test is predicted once
    assert {"eval_accuracy", "eval_top5_accuracy", "eval_f1_macro", "test_accuracy", "test_top5_accuracy"} <= set(
        results
    )
    saved = json.loads((out / "all_results.json").read_text())
    assert saved["test_accuracy"] == pytest.approx(results["test_accuracy"])
    assert saved["train_images_per_second"] > 0
    # The evaluation at the last training step scored this very model: its validation metrics are reused, not
    # computed again (the same runtime, to the digit)
    in_training = [e for e in json.loads((out / "trainer_state.json").read_text())["log_history"] if "eval_loss" in e]
    assert in_training[-1]["step"] == 6 and saved["eval_runtime"] == in_training[-1]["eval_runtime"]
    # where the wall time went, phase by phase, adding up to the total
    phases = ("startup", "data", "model", "decode", "trainer", "train", "save", "evaluate", "reports")
    assert all(saved[f"time_{p}_s"] >= 0 for p in phases) and saved["time_train_s"] > 0
    assert sum(saved[f"time_{p}_s"] for p in phases) == pytest.approx(saved["time_total_s"], abs=0.05)
    # ...and the end-of-run summary says it in one line
    wall = next(line for line in printed.splitlines() if line.startswith("wall time: "))
    assert "startup " in wall and f"train {saved['time_train_s']:.1f}s" in wall
    config = json.loads((out / "config.json").read_text())
    assert config["id2label"]["0"] == "class_0" and len(config["id2label"]) == 100
    for name in (
        "model.safetensors",
        "preprocessor_config.json",
        "README.md",
        "labels.json",
        "run_config.json",
        "confusion_matrix_test.png",
        "per_class_accuracy_test.csv",
        "per_class_accuracy_test.md",
    ):
        assert (out / name).is_file(), name
    card = (out / "README.md").read_text()
    assert "confusion_matrix_test.png" in card and "run_image_classification.py" in card
    assert "| storage_size | 20x20 |" in card
    # no validation split: the carve is in the log and in the card
    assert "No validation split: carved 100 of 400 train images into one (seed 42, stratified)" in printed
    assert "- validation: 100 of the 400 train images, carved out of train (seed 42, stratified)" in card
    assert [line for line in card.splitlines() if line.startswith("## Per-class")] == ["## Per-class accuracy (test)"]
    with open(out / "per_class_accuracy_test.csv") as f:
        assert len(list(csv.DictReader(f))) == 100


def test_resume_continues_where_it_stopped(cifar_like, tiny_vit, tmp_path, run_script):
    """A run stopped at step 3 and resumed to step 6 ends with the weights of an uninterrupted 6-step run."""
    common = ("--save_strategy", "steps", "--save_steps", "3", "--do_eval", "false")
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    run_script(*tiny_run_args(cifar_like, tiny_vit, straight, "--max_steps", "6", *common))
    run_script(*tiny_run_args(cifar_like, tiny_vit, stopped, "--max_steps", "3", *common))
    assert (stopped / "checkpoint-3").is_dir()
    run_script(*tiny_run_args(cifar_like, tiny_vit, stopped, "--max_steps", "6", *common))  # finds checkpoint-3
    state = json.loads((stopped / "trainer_state.json").read_text())
    assert state["global_step"] == 6
    logged_steps = [entry["step"] for entry in state["log_history"] if "loss" in entry]
    assert logged_steps == [5]  # the resumed run logged only steps after 3 (logging every 5)
    a, b = load_file(straight / "model.safetensors"), load_file(stopped / "model.safetensors")
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-4, atol=1e-5, msg=key)


def test_pipeline_matches_script_and_predict_csv(digits_dir, tmp_path, run_script):
    """The saved folder works as a Hub model: pipeline() agrees with the script's own predictions."""
    from datasets import load_dataset
    from transformers import pipeline

    images = tmp_path / "held_out"
    images.mkdir()
    test = load_dataset(str(digits_dir), split="test")
    for i, row in enumerate(test):
        row["image"].save(images / f"{i:03d}_{row['label']}.png")
    out = tmp_path / "digits"
    results = run_script(
        "--config",
        ROOT / "recipes/quickstart/digits.yaml",
        "--dataset_name",
        digits_dir,
        "--output_dir",
        out,
        "--num_train_epochs",
        "10",
        "--seed",
        TRAIN_SEED,
        "--do_predict",
        "true",
        "--predict_images",
        images,
        "--eval_strategy",
        "no",
    )
    print(f"margin digits (seed {TRAIN_SEED}): test accuracy {results['test_accuracy']:.3f}")
    # measured 0.807-0.877 over VIT_TEST_SEED 42/43 x OMP_NUM_THREADS 1/2; chance 0.1
    assert results["test_accuracy"] > 0.6, "a tiny ViT learns digits within a few epochs"
    with open(out / "predictions.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == len(test) and list(rows[0]) == ["file", "label", "score", "problem"]
    classifier = pipeline("image-classification", model=str(out), device="cpu")
    ours = {row["file"]: row["label"] for row in rows}
    theirs = {p.name: classifier(str(p), top_k=1)[0]["label"] for p in sorted(images.iterdir())}
    agreement = np.mean([ours[name] == theirs[name] for name in ours])
    assert agreement >= 0.99, f"pipeline agrees on {agreement:.1%} only"
    truth = np.mean([row["label"] == row["file"].split("_")[1].split(".")[0] for row in rows])
    assert truth == pytest.approx(results["test_accuracy"], abs=1e-6)

    # Predicting alone: the trained folder and images, no dataset; nothing is evaluated or rewritten.
    (images / "zz_broken.png").write_bytes(b"not a png")
    only = tmp_path / "predict_only"
    predicted = run_script("--model_name_or_path", out, "--do_predict", "true", "--predict_images", images,
                           "--output_dir", only, "--use_cpu", "true", "--report_to", "none")  # fmt: skip
    assert not any(k.startswith(("eval_", "test_", "train_")) for k in predicted), predicted
    written = sorted(p.name for p in only.iterdir() if p.is_file())
    assert written == [".run.lock", "all_results.json", "predictions.csv"]  # the lock: one run at a time in a folder
    with open(only / "predictions.csv") as f:
        again = {row["file"]: (row["label"], row["score"], row["problem"]) for row in csv.DictReader(f)}
    assert again.pop("zz_broken.png") == ("", "", "unreadable")
    assert {problem for _, _, problem in again.values()} == {""}
    assert {name: label for name, (label, _, _) in again.items()} == ours
    # A model without our labels.json (e.g. from the Hub): labels from its config, storage from the images.
    hub_like = tmp_path / "hub_like"
    shutil.copytree(out, hub_like, ignore=shutil.ignore_patterns("labels.json", "checkpoint-*"))
    run_script("--model_name_or_path", hub_like, "--do_predict", "true", "--predict_images", images,
               "--output_dir", tmp_path / "predict_hub_like", "--use_cpu", "true", "--report_to", "none")  # fmt: skip
    with open(tmp_path / "predict_hub_like" / "predictions.csv") as f:
        assert {row["file"]: row["label"] for row in csv.DictReader(f) if row["label"]} == ours


def test_no_token_is_written_anywhere(cifar_like, tiny_vit, tmp_path, run_script, monkeypatch):
    token = "hf_" + "S3cr3t" * 6
    monkeypatch.delenv("HF_TOKEN", raising=False)
    out = tmp_path / "run"
    run_script(
        *tiny_run_args(
            cifar_like,
            tiny_vit,
            out,
            "--max_steps",
            "2",
            "--hub_token",
            token,
            "--save_strategy",
            "steps",
            "--save_steps",
            "2",
        )
    )
    for path in out.rglob("*"):
        if path.is_file():
            assert token.encode() not in path.read_bytes(), path


def test_output_dir_with_another_run_is_refused(cifar_like, tiny_vit, tmp_path, run_script):
    out = tmp_path / "run"
    run_script(*tiny_run_args(cifar_like, tiny_vit, out, "--max_steps", "1"))
    with pytest.raises(RecipeError, match="holds a different run \\(seed: 42 there, 7 now\\)"):
        run_script(*tiny_run_args(cifar_like, tiny_vit, out, "--max_steps", "1", "--seed", "7"))
    with pytest.raises(RecipeError, match="holds a finished run"):
        run_script(*tiny_run_args(cifar_like, tiny_vit, out, "--max_steps", "1"))
    run_script(*tiny_run_args(cifar_like, tiny_vit, out, "--max_steps", "1", "--overwrite_output_dir", "true"))
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(RecipeError, match="holds no run of this script"):
        run_script(*tiny_run_args(cifar_like, tiny_vit, foreign, "--max_steps", "1"))


def script(*args, env=None):
    return subprocess.run(
        [sys.executable, str(ROOT / "run_image_classification.py"), *map(str, args)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=300,
    )


def test_bad_input_exits_with_one_line(tmp_path, tiny_vit):
    import os

    result = script(
        "--dataset_name",
        "./no/such/folder",
        "--model_name_or_path",
        tiny_vit,
        "--output_dir",
        tmp_path / "a",
        "--do_train",
        "true",
        "--use_cpu",
        "true",
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == "error: dataset path not found: ./no/such/folder"
    # push without a token fails before any data is loaded (the dataset path is bad too, and is never reached)
    env = {k: v for k, v in os.environ.items() if k not in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")}
    env.update(HF_HOME=str(tmp_path / "hf"), HF_HUB_OFFLINE="0", TRANSFORMERS_OFFLINE="0")
    result = script(
        "--dataset_name",
        "./no/such/folder",
        "--output_dir",
        tmp_path / "b",
        "--do_train",
        "true",
        "--push_to_hub",
        "true",
        "--use_cpu",
        "true",
        env=env,
    )
    assert result.returncode == 2
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: --push_to_hub needs a Hugging Face token"), last


def test_dataloader_workers_are_stopped_before_main_returns(cifar_like, tiny_vit, tmp_path, run_script):
    """Persistent workers outlive the loops that used them (the Trainer and accelerate keep the loaders); the script
    stops them itself, since their shutdown at interpreter exit stalled GPU runs by ~45 s."""
    import multiprocessing

    run_script(
        *tiny_run_args(cifar_like, tiny_vit, tmp_path / "w", "--max_steps", "2"),
        "--dataloader_num_workers",
        "2",
        "--dataloader_persistent_workers",
        "true",
    )
    assert multiprocessing.active_children() == []


@pytest.mark.slow
def test_class_weights_reach_the_training_of_a_run_on_real_imbalanced_digits(digits_dir, tmp_path, run_script, capsys):
    """scikit-learn's digits with classes 8 and 9 cut to 6 training images each (the others keep ~115), three runs
    of the same seed: --class_weights balanced changes the training loss from the first step (the weighted loss),
    balanced_sampler the batches it is computed on (its draws); how they weight and draw: test_class_weights.py.
    The card records the setting; the summary and the card lead with balanced figures."""
    from datasets import load_dataset

    splits = load_dataset(str(digits_dir))
    kept = {8: 0, 9: 0}

    def keep(row):
        if row["label"] not in kept:
            return True
        kept[row["label"]] += 1
        return kept[row["label"]] <= 6

    splits["train"] = splits["train"].filter(keep)
    data = tmp_path / "imbalanced"
    splits.save_to_disk(str(data))
    first_loss = {}
    for weights in ("none", "balanced", "balanced_sampler"):
        out = tmp_path / weights
        run_script("--config", ROOT / "recipes/quickstart/digits.yaml", "--dataset_name", data, "--output_dir", out,
                   "--max_steps", "2", "--logging_steps", "1", "--eval_strategy", "no", "--class_weights", weights,
                   "--seed", TRAIN_SEED)  # fmt: skip
        first_loss[weights] = logged_losses(out)[0]
        summary = capsys.readouterr().out.split("=" * 60)[-2].strip().splitlines()
        assert summary[0].startswith("classes are imbalanced in train (6 to "), summary
        assert summary[1].startswith("test_balanced_accuracy (mean per-class recall): ")
        assert summary[2].startswith("test_f1_macro: ") and summary[3].startswith("worst classes' recall: ")
        assert any(line.startswith("test_accuracy: ") for line in summary[4:]), summary  # plain accuracy after
        card = (out / "README.md").read_text()
        assert "classes are imbalanced in train (6 to " in card and "balanced accuracy (mean per-class recall)" in card
        assert f"| class_weights | {weights} |" in card
    print(f"first training loss by --class_weights: {first_loss}")
    # the same model and seed: balanced weights the loss of the same first batch, balanced_sampler draws another one
    assert first_loss["balanced"] != pytest.approx(first_loss["none"], rel=1e-4), first_loss
    assert first_loss["balanced_sampler"] != pytest.approx(first_loss["none"], rel=1e-4), first_loss


def test_without_a_test_split_the_final_reports_reuse_the_last_steps_evaluation(
    cifar_without_test, tiny_vit, tmp_path, run_script, watched_run, capsys
):
    """--eval_strategy epoch scores validation at the last step (--max_steps stops mid-epoch): the final metrics and
    reports are that evaluation's, with no second pass over validation, and equal a fresh prediction's."""
    from vit_recipes.publish.reports import write_reports

    out = tmp_path / "run"
    run_script(*tiny_run_args(cifar_without_test, tiny_vit, out, "--max_steps", "6", "--eval_strategy", "epoch",
                              "--log_level", "info"))  # fmt: skip
    assert watched_run["predicted"] == []
    assert "Final validation metrics and reports reuse the evaluation at step 6" in capsys.readouterr().out
    trainer, splits = watched_run["trainer"], watched_run["splits"]
    fresh = watched_run["predict"](trainer, splits.validation, metric_key_prefix="eval")
    saved, every = (json.loads((out / f"{name}_results.json").read_text()) for name in ("eval", "all"))
    assert set(saved) == set(fresh.metrics) == {k for k in every if k.startswith("eval_")}  # the keys of a predict
    for key, value in fresh.metrics.items():
        if not key.endswith(("_runtime", "_per_second")):
            assert saved[key] == pytest.approx(value, rel=1e-5), key
    write_reports(fresh.predictions, fresh.label_ids, splits.label_names, tmp_path / "fresh", "validation")
    for name in ("per_class_accuracy_validation.csv", "per_class_accuracy_validation.md"):
        assert (out / name).read_text() == (tmp_path / "fresh" / name).read_text(), name
    assert (out / "confusion_matrix_validation.png").stat().st_size > 5_000


@pytest.mark.parametrize(
    "flags",
    [
        ("--ema_decay", "0.5"),
        ("--load_best_model_at_end", "true", "--save_strategy", "epoch"),
        ("--bf16_full_eval", "true"),
        ("--do_train", "false"),
    ],
    ids=["ema", "load_best_model_at_end", "bf16_full_eval", "evaluation_only"],
)
def test_the_final_validation_is_predicted_again_when_the_model_changed_or_was_not_evaluated(
    flags, cifar_without_test, tiny_vit, tmp_path, run_script, watched_run, capsys
):
    """The weight average or the best checkpoint replaced the weights the last evaluation scored, bf16_full_eval
    casts the model for evaluations after training only, an evaluation-only run scored nothing yet: validation is
    predicted once, and its reports written."""
    out = tmp_path / "run"
    run_script(*tiny_run_args(cifar_without_test, tiny_vit, out, "--max_steps", "6", "--eval_strategy", "epoch",
                              "--log_level", "info", *flags))  # fmt: skip
    assert watched_run["predicted"] == ["eval"]
    assert "reuse the evaluation" not in capsys.readouterr().out
    assert (out / "per_class_accuracy_validation.csv").is_file() and (out / "eval_results.json").is_file()

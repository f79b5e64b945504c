"""A clean run prints no warning that is not about the user's own data or settings, in the venv `make test` builds
(torchao and DeepSpeed installed: transformers and accelerate import them at every start)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from conftest import ROOT

NOISE = re.compile(r"warn|deprecat|failed to load|^W\d{4} |traceback", re.IGNORECASE)


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_the_demo_recipe_prints_no_warning(digits_dir, tiny_vit, tmp_path, lora):
    extra = ["--num_train_epochs", "1", "--warmup_steps", "2"]  # a warm-up as long as the run would be said
    if lora:  # LoRA on a saved checkpoint, merged at the end
        extra = ["--model_name_or_path", str(tiny_vit), "--config_overrides", "", "--use_peft", "true"]
        extra += [
            "--merge_adapter",
            "true",
            "--max_steps",
            "10",
            "--warmup_steps",
            "2",
        ]  # (the recipe's overrides are for training from scratch)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("PYTHONWARNINGS", None)  # as a user runs it: Python's default warning filters
    result = subprocess.run(
        [sys.executable, "run_image_classification.py", "--config", "recipes/quickstart/digits.yaml",
         "--dataset_name", str(digits_dir), "--output_dir", str(tmp_path / "out"), *extra],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    lines = [x for x in (result.stdout + result.stderr).splitlines() if "it/s]" not in x and "s/it]" not in x]
    assert [x for x in lines if NOISE.search(x)] == []
    assert any(x.startswith("test_accuracy: ") for x in lines)  # it ran to the end and said so
    if lora:
        return
    # Predicting alone from the trained folder: no warning, no training line, no plots
    from datasets import load_dataset

    images = tmp_path / "images"
    images.mkdir()
    for i, row in enumerate(load_dataset(str(digits_dir), split="test").select(range(3))):
        row["image"].save(images / f"{i}.png")
    result = subprocess.run(
        [sys.executable, "run_image_classification.py", "--model_name_or_path", str(tmp_path / "out"),
         "--do_predict", "true", "--predict_images", str(images), "--output_dir", str(tmp_path / "predicted"),
         "--use_cpu", "true", "--report_to", "none"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    lines = [x for x in (result.stdout + result.stderr).splitlines() if "it/s]" not in x and "s/it]" not in x]
    assert [x for x in lines if NOISE.search(x)] == []
    assert "trainable params" not in result.stdout and "writing plots" not in result.stdout + result.stderr
    assert any(x.startswith("Model: ") and "not trained in this run" in x for x in lines)

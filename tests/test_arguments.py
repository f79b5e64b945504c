from pathlib import Path

import pytest
import torch

from vit_recipes.core.arguments import parse_args
from vit_recipes.core.errors import RecipeError

ROOT = Path(__file__).resolve().parents[1]
RECIPES = sorted((ROOT / "recipes").rglob("*.yaml"))


def write(tmp_path, text: str) -> Path:
    path = tmp_path / "recipe.yaml"
    path.write_text(text)
    return path


def test_recipe_sets_values_and_command_line_overrides(tmp_path):
    recipe = write(
        tmp_path,
        "dataset_name: beans\nlearning_rate: 5e-5\nper_device_train_batch_size: 8\n"
        "hflip_prob: 0.0\nbf16: false\nreport_to: none\n",
    )
    args = parse_args(["--config", str(recipe), "--per_device_train_batch_size", "16", "--output_dir", str(tmp_path)])
    assert args.data.dataset_name == "beans"
    assert args.training.learning_rate == pytest.approx(5e-5)  # YAML reads 5e-5 as a string: coerced to float
    assert args.training.per_device_train_batch_size == 16  # the flag wins over the recipe
    assert args.augment.hflip_prob == 0.0
    assert args.recipe == str(recipe)


def test_defaults_without_recipe(tmp_path):
    args = parse_args(["--dataset_name", "cifar100", "--output_dir", str(tmp_path)])
    assert args.model.model_name_or_path == "google/vit-base-patch16-224-in21k"
    assert args.model.attn_implementation == "auto"
    assert args.training.remove_unused_columns is False
    assert args.training.gradient_checkpointing_kwargs == {"use_reentrant": False}
    assert args.training.dataloader_num_workers >= 1


@pytest.mark.parametrize("recipe", RECIPES, ids=[str(r.relative_to(ROOT)) for r in RECIPES])
def test_every_shipped_recipe_parses(recipe, tmp_path):
    args = parse_args(["--config", str(recipe), "--output_dir", str(tmp_path), "--bf16", "false", "--use_cpu", "true"])
    assert args.data.dataset_name
    assert recipe.read_text().startswith("#"), "each recipe explains itself in comments"


@pytest.mark.parametrize(
    "text, message",
    [
        ("learning_rte: 1.0e-4\n", "unknown key 'learning_rte' (did you mean 'learning_rate'?)"),
        ("dataset_name: [unclosed\n", "is not valid YAML (line 2)"),
        ("- a\n- b\n", "must be a mapping"),
        ("learning_rate: fast\n", "'learning_rate' must be float"),
        ("per_device_train_batch_size: 2.5\n", "must be a whole number"),
    ],
)
def test_bad_recipes_are_one_clear_line(tmp_path, text, message):
    with pytest.raises(RecipeError) as err:
        parse_args(["--config", str(write(tmp_path, text))])
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_missing_recipe(tmp_path):
    with pytest.raises(RecipeError, match="recipe file not found"):
        parse_args(["--config", str(tmp_path / "nope.yaml")])


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--learning_rate", "-1"], "learning_rate must be > 0"),
        (["--learning_rate", "-1e-3"], "learning_rate must be > 0, got -0.001"),  # argparse alone: "expected one"
        (["--weight_decay", "-.5", "--learning_rate", "-2e-5"], "learning_rate must be > 0, got -2e-05"),
        (["--per_device_train_batch_size", "0"], "per_device_train_batch_size must be > 0"),
        (["--validation_split_percentage", "1.5"], "validation_split_percentage"),
        (["--hflip_prob", "2"], "hflip_prob"),
        (["--auto_augment", "autoaug"], "auto_augment must be"),
        (["--randaugment_magnitude", "31"], r"randaugment_magnitude must be in \[0, 30\]"),
        (["--class_weights", "inverse"], "class_weights must be none, balanced or balanced_sampler, got 'inverse'"),
        (["--model_name_or_path", ""], "--config_name to train from scratch"),
    ],
)
def test_bad_values(tmp_path, flags, message):
    with pytest.raises(RecipeError, match=message.replace("(", r"\(")):
        parse_args(["--dataset_name", "beans", "--output_dir", str(tmp_path), *flags])


def test_token_never_stays_in_training_args(tmp_path, monkeypatch):
    monkeypatch.delenv("HF_TOKEN", raising=False)
    args = parse_args(["--dataset_name", "beans", "--output_dir", str(tmp_path), "--hub_token", "hf_" + "x" * 30])
    assert args.training.hub_token is None
    import os

    assert os.environ["HF_TOKEN"] == "hf_" + "x" * 30


def test_legacy_matmul_precision_follows_the_tf32_transformers_sets():
    """Compiling on a GPU, transformers turns TF32 on through torch's new API; max-autotune then read the legacy
    setting and failed on the mix (H200, torch 2.11). The same mix fails here on the CPU without the alignment."""
    from vit_recipes.core.arguments import align_matmul_precision

    before = torch.backends.fp32_precision, torch.get_float32_matmul_precision()
    try:
        torch.backends.fp32_precision = "tf32"  # what transformers' enable_tf32(True) does on torch >= 2.9
        with pytest.raises(RuntimeError, match="mix of the legacy and new APIs"):
            torch.get_float32_matmul_precision()
        align_matmul_precision()
        assert torch.get_float32_matmul_precision() == "high"
        assert torch.backends.cuda.matmul.fp32_precision == "tf32"
    finally:
        torch.set_float32_matmul_precision(before[1])
        torch.backends.fp32_precision = before[0]
    assert torch.get_float32_matmul_precision() == before[1]


def test_help_lists_what_applies_and_every_trainer_flag_still_parses(tmp_path, capsys):
    with pytest.raises(SystemExit):
        parse_args(["--help"])
    text = capsys.readouterr().out
    assert "--per_device_train_batch_size" in text and "--patch_dropout" in text and "--deepspeed" in text
    assert "--neftune_noise_alpha" not in text and "--use_liger_kernel" not in text
    assert "Every other flag of transformers' TrainingArguments is accepted too" in text
    args = parse_args(["--dataset_name", "d", "--output_dir", str(tmp_path), "--neftune_noise_alpha", "5",
                       "--report_to", "none"])  # fmt: skip
    assert args.training.neftune_noise_alpha == 5


def test_a_deepspeed_json_with_a_syntax_error_is_named(tmp_path):
    broken = tmp_path / "zero2.json"
    broken.write_text('{"train_batch_size": "auto",, }')
    with pytest.raises(RecipeError, match=r"^--deepspeed .*zero2.json is not valid JSON: Expecting property name"):
        parse_args(["--dataset_name", "d", "--output_dir", str(tmp_path), "--deepspeed", str(broken)])


def test_zero_save_steps_are_one_line(tmp_path):
    with pytest.raises(
        RecipeError, match=r"^save_steps must be > 0 \(a step count, or below 1 a fraction of the run\)"
    ):
        parse_args(["--dataset_name", "d", "--output_dir", str(tmp_path), "--report_to", "none", "--save_steps", "0"])


def test_a_billion_epochs_is_one_line(tmp_path):
    with pytest.raises(RecipeError, match=r"^num_train_epochs 1e\+09 is over 100,000 epochs: give a real count"):
        parse_args(["--dataset_name", "d", "--output_dir", str(tmp_path), "--num_train_epochs", "1e9"])


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--max_eval_samples", "-5"], r"^--max_eval_samples must be a number of images \(1 or more\), got -5$"),
        (["--max_train_samples", "-5"], r"^--max_train_samples must be a number of images \(1 or more\), got -5$"),
        (["--max_eval_samples", "0"], r"^--max_eval_samples 0 would leave no images: to evaluate nothing, pass "
                                      r"--eval_strategy no --do_eval false; or drop the flag"),
        (["--max_train_samples", "0"], r"^--max_train_samples 0 would leave no images: to evaluate without "
                                       r"training, pass --do_train false; or drop the flag"),
    ],
)  # fmt: skip
def test_sample_caps_below_one_are_one_line_and_the_way_out_parses(tmp_path, flags, message):
    """A cap of 0 was read as no cap (the whole split, silently); a negative one sampled "-5 of 270" and ended in the
    Trainer's traceback, or asked to lower the batch size."""
    base = ["--dataset_name", "d", "--output_dir", str(tmp_path), "--report_to", "none"]
    with pytest.raises(RecipeError, match=message):
        parse_args([*base, *flags])
    nothing_evaluated = parse_args([*base, "--do_train", "true", "--eval_strategy", "no", "--do_eval", "false"])
    assert not nothing_evaluated.training.do_eval  # the line's way out: the run evaluates nothing


def test_a_value_of_the_wrong_type_is_one_line_without_the_usage(tmp_path, capsys):
    """argparse printed its usage (96 lines) above its own error line and exited; now that line is the RecipeError."""
    with pytest.raises(
        RecipeError, match=r"^argument --per_device_train_batch_size.*: invalid int value: 'abc' \(`--help` lists"
    ):
        parse_args(["--dataset_name", "d", "--output_dir", str(tmp_path), "--per_device_train_batch_size", "abc"])
    with pytest.raises(RecipeError, match=r"^argument --config: expected one argument"):
        parse_args(["--config"])
    captured = capsys.readouterr()
    assert "usage:" not in captured.err + captured.out


def test_null_typed_on_the_command_line_means_no_checkpoint(tmp_path):
    """docs/usage.md's from-scratch command, `--model_name_or_path null --config_name vit`: "null" was a Hub id."""
    args = parse_args(["--dataset_name", "d", "--output_dir", str(tmp_path), "--model_name_or_path", "null",
                       "--config_name", "vit", "--report_to", "none"])  # fmt: skip
    assert args.model.model_name_or_path is None and args.model.config_name == "vit"

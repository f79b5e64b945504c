"""timm's fine-tuning levers: --layer_decay, --drop_path_rate, --ema_decay, --random_erasing, and
--load_best_model_at_end with our checkpoints."""

from __future__ import annotations

import json
import re

import pytest
import torch
from conftest import TRAIN_SEED, run_args, tiny_vit_config
from safetensors.torch import load_file

from vit_recipes.core.errors import RecipeError
from vit_recipes.model.levers import EMA_FILE, add_drop_path, layer_decay_groups

SAVE_EVERY_2 = ("--save_strategy", "steps", "--save_steps", "2", "--save_total_limit", "5", "--do_eval", "false")


def tiny_model(layers: int = 2):
    from transformers import ViTForImageClassification

    torch.manual_seed(0)
    config = tiny_vit_config()
    config.num_hidden_layers = layers
    return ViTForImageClassification(config)


def decay_names(model):
    from transformers import Trainer

    return Trainer.get_decay_parameter_names(None, model)  # uses no Trainer state


def lr_of(groups, param):
    return next(g["lr"] for g in groups if any(p is param for p in g["params"]))


def test_layer_decay_gives_each_layer_its_rate_and_keeps_the_trainers_weight_decay():
    model = tiny_model()
    groups = layer_decay_groups(model, 0.5, 1e-3, 0.05, decay_names(model))
    vit = model.vit
    assert lr_of(groups, vit.embeddings.cls_token) == lr_of(groups, vit.embeddings.position_embeddings) == 1e-3 / 8
    assert lr_of(groups, vit.layers[0].mlp.fc1.weight) == 1e-3 / 4
    assert lr_of(groups, vit.layers[1].attention.q_proj.weight) == 1e-3 / 2
    assert lr_of(groups, model.classifier.weight) == lr_of(groups, vit.layernorm.weight) == 1e-3
    assert groups[0]["lr"] == 1e-3  # the head's group first: the Trainer logs the first group's rate
    grouped = [p for g in groups for p in g["params"]]
    assert len(grouped) == len(list(model.parameters())) == len({id(p) for p in grouped})
    decayed = {id(p) for g in groups if g["weight_decay"] == 0.05 for p in g["params"]}
    names = set(decay_names(model))
    assert decayed == {id(p) for n, p in model.named_parameters() if n in names}
    assert id(vit.layers[0].layernorm_before.weight) not in decayed and id(model.classifier.bias) not in decayed


def test_layer_decay_reaches_the_trainers_optimizer_and_scheduler(tmp_path):
    from vit_recipes.core.arguments import RecipeTrainingArguments
    from vit_recipes.train.trainer import ImageClassificationTrainer

    args = RecipeTrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none", learning_rate=1e-3,
                                   layer_decay=0.5, lr_scheduler_type="linear", eval_strategy="no")  # fmt: skip
    trainer = ImageClassificationTrainer(model=tiny_model(), args=args)
    trainer.create_optimizer_and_scheduler(num_training_steps=4)
    assert type(trainer.optimizer).__name__ == "AdamW"
    assert sorted({g["lr"] for g in trainer.optimizer.param_groups}) == [1e-3 / 8, 1e-3 / 4, 1e-3 / 2, 1e-3]
    trainer.optimizer.step()
    trainer.lr_scheduler.step()
    assert sorted({round(g["lr"] * 4 / 3, 12) for g in trainer.optimizer.param_groups}) == [
        round(x, 12) for x in (1e-3 / 8, 1e-3 / 4, 1e-3 / 2, 1e-3)
    ]  # linear decay scales every group alike


def test_layer_decay_with_lora_groups_the_trained_parameters_alone():
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(
        tiny_model(), LoraConfig(r=4, target_modules=["q_proj", "v_proj"], modules_to_save=["classifier"])
    )
    groups = layer_decay_groups(model, 0.5, 1e-3, 0.0, decay_names(model))
    trained = {id(p) for p in model.parameters() if p.requires_grad}
    assert {id(p) for g in groups for p in g["params"]} == trained
    layer1 = model.base_model.model.vit.layers[1].attention.q_proj.lora_A["default"].weight
    assert lr_of(groups, layer1) == 1e-3 / 2


def test_drop_path_is_exact_stochastic_depth_in_training_and_off_in_evaluation(monkeypatch):
    """Each residual branch of each training sample is kept (scaled by 1 / (1 - p)) or dropped whole, p growing from
    0 to the rate over depth: a hand-written residual forward with the drawn masks gives the same logits."""
    import vit_recipes.model.levers as levers

    plain, model = tiny_model(3), tiny_model(3)
    assert add_drop_path(model, 0.5) == 3
    assert list(model.state_dict()) == list(plain.state_dict())  # hooks only: the saved model stays plain
    x = torch.randn(16, 3, 16, 16)
    model.eval()
    torch.testing.assert_close(model(x).logits, plain.eval()(x).logits, rtol=0, atol=0)
    masks, drop = [], levers.drop_path

    def recorded(branch, p):
        out = drop(branch, p)
        masks.append((p, (out != 0).flatten(1).any(1).float().view(-1, 1, 1)))
        return out

    monkeypatch.setattr(levers, "drop_path", recorded)
    model.train()
    logits = model(x).logits
    assert [p for p, _ in masks] == [0.0, 0.0, 0.25, 0.25, 0.5, 0.5]  # attention then MLP branch, per layer
    assert 0 < sum(float(m.mean()) for _, m in masks[4:]) / 2 < 1  # the last layer dropped some samples, not all
    vit, steps = model.vit, iter(masks)
    h = vit.embeddings(x)
    for layer in vit.layers:
        p, keep = next(steps)
        h = h + layer.attention(layer.layernorm_before(h))[0] * keep / (1 - p)
        p, keep = next(steps)
        h = h + layer.mlp(layer.layernorm_after(h)) * keep / (1 - p)
    torch.testing.assert_close(logits, model.classifier(vit.layernorm(h)[:, 0]), rtol=1e-5, atol=1e-6)


def test_random_erasing_replaces_one_box_per_chosen_image_with_noise():
    from vit_recipes.data.transforms import TrainTransform, random_erase

    torch.manual_seed(0)
    x = torch.zeros(4000, 3, 16, 16)
    changed = random_erase(x, 0.25) != 0  # N(0, 1) noise is never exactly 0
    erased = changed.flatten(1).any(1)
    assert 0.22 < erased.float().mean() < 0.28
    box = changed[erased]
    assert torch.equal(box, box[:, :1].expand_as(box))  # every channel
    rows, cols = box[:, 0].any(2), box[:, 0].any(1)
    assert torch.equal(box[:, 0], rows[:, :, None] & cols[:, None, :])  # one rectangle
    area = box[:, 0].flatten(1).float().mean(1)
    assert area.min() >= 0.015 and area.max() <= 0.37  # 0.02 to 1/3 of the image, sides rounded to pixels
    pixels = torch.randint(0, 256, (8, 3, 16, 16), dtype=torch.uint8)
    torch.manual_seed(1)
    off = TrainTransform(16, 0.5, 0.5, random_erasing=0.0)(pixels)
    torch.manual_seed(1)
    on = TrainTransform(16, 0.5, 0.5, random_erasing=1.0)(pixels)
    assert not torch.equal(off, on) and torch.equal(off[on == off], on[on == off])


@pytest.mark.slow
def test_ema_checkpoints_its_average_and_a_resumed_run_ends_on_the_same_weights(
    cifar_like, tiny_vit, tmp_path, run_script
):
    from transformers import ViTForImageClassification

    def run(out, steps):
        flags = ("--max_steps", str(steps), "--ema_decay", "0.5", "--lr_scheduler_type", "constant", *SAVE_EVERY_2)
        return run_script(*run_args(cifar_like, tiny_vit, out, *flags, "--seed", TRAIN_SEED))

    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    run(straight, 6)
    run(stopped, 4)
    (stopped / "all_results.json").unlink()  # stopped after its checkpoint-4
    run(stopped, 6)  # resumes from checkpoint-4, its average included
    final = ViTForImageClassification.from_pretrained(straight).state_dict()
    average = load_file(straight / "checkpoint-6" / EMA_FILE)
    raw = ViTForImageClassification.from_pretrained(straight / "checkpoint-6").state_dict()
    assert set(average) == set(final)
    for key in average:
        torch.testing.assert_close(final[key], average[key], rtol=0, atol=0, msg=key)  # saved: the average
    assert any(not torch.equal(final[k], raw[k]) for k in average)  # which is not the last step's weights
    a, b = load_file(straight / "model.safetensors"), load_file(stopped / "model.safetensors")
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-4, atol=1e-5, msg=key)
    readme = (straight / "README.md").read_text()
    assert "| ema_decay | 0.5 (evaluated and saved: the average) |" in readme


def test_ema_is_refused_where_weights_are_sharded_and_with_load_best_model_at_end(tmp_path, monkeypatch):
    import dataclasses
    import types

    from conftest import ROOT

    from vit_recipes.core.arguments import parse_args
    from vit_recipes.plan import strategies
    from vit_recipes.plan.checks import check_plan
    from vit_recipes.plan.plan import build_plan, read_strategy

    assert [s.name for s in strategies.STRATEGIES if not s.supports("ema")] == [
        "zero3", "zeropp", "zero3_offload", "fsdp2", "fsdp2_offload"
    ]  # fmt: skip
    base = ["--output_dir", str(tmp_path), "--dataset_name", "x", "--use_cpu", "true"]
    # A run asking for it under each of them is refused in one line before any data loads: the DeepSpeed configs
    # through the run's plan, FSDP2 (refused on the CPU first) through the plan's checks on a GPU plan
    ema = ["--ema_decay", "0.9", "--report_to", "none"]
    for config, label in (("zero3", "ZeRO-3"), ("zeropp", "ZeRO++"), ("zero3_offload", "ZeRO-3 + offload")):
        path = str(ROOT / "ds_configs" / f"{config}.json")
        refusal = f"{path}: --ema_decay averages whole weights and {label} shards them: drop it, or use ZeRO-2 or DDP"
        with pytest.raises(RecipeError, match="^" + re.escape(refusal) + "$"):
            build_plan(parse_args([*base, *ema, "--deepspeed", path]))
    args = parse_args([*base, *ema])
    plan = build_plan(args)  # one process: EMA trains
    monkeypatch.setattr("vit_recipes.plan.checks.visible_gpus", lambda: 2)
    for offload, label in ((False, "FSDP2"), (True, "FSDP2 + offload")):
        fsdp = types.SimpleNamespace(fsdp="full_shard auto_wrap", world_size=2, fsdp_config={"cpu_offload": offload})
        on_gpus = dataclasses.replace(plan, strategy=read_strategy(fsdp), device="cuda")
        with pytest.raises(RecipeError, match=f"^--ema_decay averages whole weights and {re.escape(label)} shards"):
            check_plan(on_gpus, args)
    with pytest.raises(RecipeError, match="--ema_decay with --load_best_model_at_end: the best checkpoint is chosen"):
        parse_args([*base, "--ema_decay", "0.9", "--load_best_model_at_end", "true",
                    "--metric_for_best_model", "accuracy"])  # fmt: skip
    for flag, value, interval in (("layer_decay", "0", "(0, 1]"), ("ema_decay", "1", "[0, 1)"),
                                  ("drop_path_rate", "1", "[0, 1)"), ("random_erasing", "1.5", "[0, 1]")):  # fmt: skip
        with pytest.raises(RecipeError, match="^" + re.escape(f"{flag} must be in {interval}, got")):
            parse_args([*base, f"--{flag}", value])


@pytest.mark.slow
def test_levers_train_save_a_plain_model_pipeline_reloads_and_the_card_says_so(
    cifar_like, tiny_vit, tmp_path, run_script
):
    from transformers import pipeline

    out = tmp_path / "out"
    levers = ("--layer_decay", "0.75", "--drop_path_rate", "0.2", "--random_erasing", "0.25")
    run_script(*run_args(cifar_like, tiny_vit, out, "--max_steps", "3", *levers))
    config = json.loads((out / "config.json").read_text())
    assert not any("drop" in k and "path" in k for k in config)  # ViT's config has no field: nothing saved
    from PIL import Image

    classify = pipeline("image-classification", model=str(out), device="cpu")
    assert len(classify(Image.new("RGB", (32, 32), (200, 30, 30)), top_k=3)) == 3
    readme = (out / "README.md").read_text()
    for line in ("| layer_decay | 0.75 |", "| drop_path_rate | 0.2 |", "| random_erasing | 0.25 |"):
        assert line in readme


@pytest.mark.slow
@pytest.mark.parametrize("lora", [False, True])
def test_load_best_model_at_end_evaluates_and_saves_the_best_checkpoint_also_after_a_resume(
    lora, cifar_like, tiny_vit, tmp_path, run_script
):
    """transformers' own loader left the last step's layers in place (5.2x key names): the final evaluation was
    neither the best checkpoint's nor the last one's. Here the 'best' is the highest validation loss (the first)."""
    out = tmp_path / "out"
    flags = ("--max_steps", "6", "--eval_strategy", "steps", "--eval_steps", "2", "--save_strategy", "steps",
             "--save_steps", "2", "--load_best_model_at_end", "true", "--metric_for_best_model", "loss",
             "--greater_is_better", "true", "--seed", TRAIN_SEED, *(("--use_peft", "true") if lora else ()))  # fmt: skip
    results = run_script(*run_args(cifar_like, tiny_vit, out, *flags))
    state = json.loads((out / "trainer_state.json").read_text())
    losses = {e["step"]: e["eval_loss"] for e in state["log_history"] if "eval_loss" in e}
    assert state["best_model_checkpoint"].endswith("checkpoint-2") and losses[2] != losses[6]
    assert results["eval_loss"] == pytest.approx(losses[2], abs=1e-5)
    assert "| load_best_model_at_end | best loss |" in (out / "README.md").read_text()
    if lora:
        return
    for name in ("all_results.json", "model.safetensors"):  # stopped during its final save: the rerun resumes from
        (out / name).unlink()  # checkpoint-6, trains nothing, and must still load the best
    results = run_script(*run_args(cifar_like, tiny_vit, out, *flags))
    assert results["eval_loss"] == pytest.approx(losses[2], abs=1e-5)


def test_drop_path_rate_sets_the_config_field_of_families_that_have_one(tmp_path):
    """BEiT builds its own linearly growing drop path from config.drop_path_rate: the flag sets that, nothing else."""
    from conftest import model_args
    from test_families import tiny

    from vit_recipes.model.modeling import build_model

    config, _ = tiny("beit")
    config.num_hidden_layers = 3
    config.save_pretrained(tmp_path)
    model, _ = build_model(model_args(config_name=str(tmp_path), drop_path_rate=0.2), ["a", "b"])
    assert model.config.drop_path_rate == 0.2
    assert [layer.drop_path.drop_prob for layer in model.beit.layers[1:]] == pytest.approx([0.1, 0.2])
    assert not any(m._forward_hooks for m in model.modules())  # not ours on top of BEiT's own

"""LoRA (--use_peft), the frozen-backbone baseline (--freeze_backbone), saving/merging/reloading, and the transfer
check that proves LoRA learns what a frozen backbone cannot."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import yaml
from conftest import FAST_ARGS, ROOT, model_args, tiny_vit_config
from safetensors.torch import load_file

from vit_recipes.core.arguments import LoraArguments, parse_args
from vit_recipes.core.errors import RecipeError
from vit_recipes.model.adapters import (
    check_adapter_strategy,
    check_saved_adapter,
    load_model,
    without_activation_wrappers,
    write_base_record,
)
from vit_recipes.model.flops import training_flops_per_image
from vit_recipes.model.lora import (
    apply_lora,
    attach_adapter,
    base_signature,
    head_module_names,
    resolve_target_modules,
    unwrap,
)
from vit_recipes.model.modeling import FinetuneSetup, build_finetune_model


def tiny_model(seed=0, hidden=32, labels=5):
    """conftest's tiny ViT in memory; seed and width vary so that tests can tell bases apart."""
    from transformers import ViTForImageClassification

    torch.manual_seed(seed)
    return ViTForImageClassification(tiny_vit_config(labels, hidden))


# ------------------------------------------------------------------------------------------------ arguments


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--lora_r", "0"], "lora_r must be > 0, got 0"),
        (["--lora_r", "-4"], "lora_r must be > 0, got -4"),
        (["--lora_alpha", "0"], "lora_alpha must be > 0"),
        (["--lora_dropout", "1.0"], "lora_dropout must be in [0, 1)"),
        (["--merge_adapter", "true"], "--merge_adapter needs --use_peft"),
        (["--use_peft", "true", "--freeze_backbone", "true"], "exclude each other"),
    ],
)
def test_bad_lora_arguments_fail_while_parsing(flags, message, tmp_path):
    with pytest.raises(RecipeError) as err:
        parse_args(["--output_dir", str(tmp_path), "--dataset_name", "x", "--use_cpu", "true", *flags])
    assert message in str(err.value) and "\n" not in str(err.value)


def test_lora_recipes_set_lora_and_parse(tmp_path):
    for recipe in ("vit-base/cifar100/config_lora.yaml", "vit-huge/food101/config_lora.yaml"):
        args = parse_args(
            ["--config", str(ROOT / "recipes" / recipe), "--output_dir", str(tmp_path), "--bf16", "false"]
        )
        assert args.lora.use_peft and args.lora.lora_r == 16 and not args.lora.merge_adapter
    args = parse_args(["--config", str(ROOT / "recipes/quickstart/digits_lora.yaml"), "--output_dir", str(tmp_path)])
    assert args.lora.use_peft and args.model.model_name_or_path


def test_run_config_tells_lora_runs_apart_and_leaves_full_runs_unchanged(tmp_path):
    from vit_recipes.core.arguments import run_config

    base = ["--output_dir", str(tmp_path), "--dataset_name", "x", "--use_cpu", "true"]
    full = run_config(parse_args(base))
    assert "use_peft" not in full and "freeze_backbone" not in full  # run_config.json of old runs still matches
    lora = run_config(parse_args([*base, "--use_peft", "true", "--lora_r", "8"]))
    assert lora["use_peft"] is True and lora["lora_r"] == 8


# ------------------------------------------------------------------------------------------------ targets


def test_default_targets_are_query_and_value_under_both_vit_namings():
    new = tiny_model()  # transformers >= 5.2x: attention.q_proj / k_proj / v_proj / o_proj
    assert resolve_target_modules(new, None) == ["q_proj", "v_proj"]
    old = tiny_model()  # transformers < 5.2x: attention.attention.query / key / value
    for layer in old.vit.layers if hasattr(old.vit, "layers") else old.vit.encoder.layer:
        attention = layer.attention
        inner = getattr(attention, "attention", attention)
        for new_name, old_name in (("q_proj", "query"), ("k_proj", "key"), ("v_proj", "value")):
            if hasattr(inner, new_name):
                setattr(inner, old_name, getattr(inner, new_name))
                delattr(inner, new_name)
    assert resolve_target_modules(old, None) == ["query", "value"]
    peft_model, _ = apply_lora(old, LoraArguments(use_peft=True, lora_r=2))
    adapted = {name.rsplit(".", 1)[-1] for name, m in peft_model.named_modules() if hasattr(m, "lora_A")}
    assert adapted == {"query", "value"}


def test_lora_trains_adapters_and_the_whole_head_only():
    model, detail = apply_lora(tiny_model(), LoraArguments(use_peft=True, lora_r=4))
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n or "classifier.modules_to_save" in n for n in trainable)
    assert any("classifier.modules_to_save.default.weight" in n for n in trainable)
    assert "q_proj, v_proj (r=4" in detail and "the head (classifier)" in detail


@pytest.mark.parametrize(
    "targets, message",
    [
        (["qkv_nope"], "'qkv_nope' matches no module; the layers LoRA can adapt are: fc1, fc2, k_proj, o_proj"),
        (["classifier"], "'classifier' is the classifier head, which is trained in full already"),
        (["layernorm_before"], "'layernorm_before' is a LayerNorm, which LoRA cannot adapt"),
    ],
)
def test_target_modules_that_match_nothing_list_the_layers(targets, message):
    with pytest.raises(RecipeError, match="--lora_target_modules") as err:
        resolve_target_modules(tiny_model(), targets)
    assert message in str(err.value)


def test_all_linear_and_suffix_targets():
    assert resolve_target_modules(tiny_model(), ["all-linear"]) == [
        "fc1",
        "fc2",
        "k_proj",
        "o_proj",
        "q_proj",
        "v_proj",
    ]
    assert resolve_target_modules(tiny_model(), ["attention.q_proj", "fc1"]) == ["attention.q_proj", "fc1"]


def test_model_without_attention_layers_is_refused_with_its_layers():
    from transformers import ConvNextConfig, ConvNextForImageClassification

    model = ConvNextForImageClassification(
        ConvNextConfig(num_stages=2, hidden_sizes=[8, 16], depths=[1, 1], num_labels=3, image_size=16)
    )
    with pytest.raises(RecipeError) as err:
        apply_lora(model, LoraArguments(use_peft=True))
    text = str(err.value)
    assert text.startswith("--use_peft: this convnext model has no attention query/value projections")
    assert "pwconv1" in text and "dwconv" in text and "\n" not in text
    assert head_module_names(model) == ["classifier"]


def test_vit_base_adapter_is_a_small_fraction_of_the_base(tmp_path):
    """ViT-B/16 with the cifar100 LoRA recipe: the adapter file (LoRA + the 100-class head) is <= 5% of the base."""
    from transformers import ViTConfig, ViTForImageClassification

    recipe = yaml.safe_load((ROOT / "recipes/vit-base/cifar100/config_lora.yaml").read_text())
    config = ViTConfig(
        hidden_size=768,
        num_hidden_layers=12,
        num_attention_heads=12,
        intermediate_size=3072,
        patch_size=16,
        image_size=224,
        num_labels=100,
    )
    base = ViTForImageClassification(config)
    base_bytes = sum(p.numel() * p.element_size() for p in base.parameters())  # model.safetensors, fp32
    lora = LoraArguments(use_peft=True, lora_r=recipe["lora_r"], lora_alpha=recipe["lora_alpha"])
    model, _ = apply_lora(base, lora)
    model.save_pretrained(tmp_path)
    adapter_bytes = (tmp_path / "adapter_model.safetensors").stat().st_size
    assert adapter_bytes <= 0.05 * base_bytes, f"{adapter_bytes / base_bytes:.2%}"
    assert adapter_bytes / base_bytes < 0.01  # measured: 0.77%


# ------------------------------------------------------------------------------------------------ bases


@pytest.fixture
def saved_adapter(tmp_path):
    """A tiny base, and a LoRA adapter for it with non-zero (trained-looking) weights."""
    base_dir = tmp_path / "base"
    tiny_model(seed=0).save_pretrained(base_dir)
    model, _ = build_finetune_model(
        model_args(model_name_or_path=str(base_dir)),
        LoraArguments(use_peft=True, lora_r=4),
        SimpleNamespace(),
        ["a", "b", "c"],
    )[:2]
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    out = tmp_path / "adapter"
    model.save_pretrained(out)
    model.config.save_pretrained(out)
    setup = SimpleNamespace(base_args=model_args(model_name_or_path=str(base_dir)), signature=base_signature(model))
    write_base_record(out, setup)
    return base_dir, out, model


def test_base_signature_survives_bf16_and_tells_bases_apart():
    from vit_recipes.model.lora import same_base

    fp32 = tiny_model(seed=0)
    signature = base_signature(fp32)
    assert same_base(signature, base_signature(tiny_model(seed=0).to(torch.bfloat16)))  # ZeRO-3 loads bf16 weights
    assert not same_base(signature, base_signature(tiny_model(seed=1)))


def test_adapter_loads_onto_its_base_and_not_onto_another(saved_adapter, tmp_path):
    base_dir, adapter, trained = saved_adapter
    x = torch.randn(2, 3, 16, 16)
    trained.eval()
    reloaded = load_model(adapter)
    torch.testing.assert_close(reloaded(pixel_values=x).logits, trained(pixel_values=x).logits)

    same_shape = tmp_path / "other-seed"  # same architecture, other weights: only the signature can tell
    tiny_model(seed=1).save_pretrained(same_shape)
    with pytest.raises(RecipeError, match="was trained on another base .* weights of .*other-seed differ"):
        load_model(adapter, base_model_name_or_path=str(same_shape))
    wider = tmp_path / "wider"  # another architecture: the adapter's shapes do not fit
    tiny_model(seed=0, hidden=48, labels=3).save_pretrained(wider)
    from transformers import AutoModelForImageClassification

    wrong = AutoModelForImageClassification.from_pretrained(wider)
    (adapter / "adapter_base.json").unlink()  # without the record, peft's size check still refuses it
    with pytest.raises(RecipeError, match="cannot load the adapter .* onto .*wider .*not the base it was trained on"):
        attach_adapter(wrong, adapter, base_source=str(wider))


def checkpoint_wrapped(model):
    """What accelerate's fsdp2_apply_ac (FSDP's activation checkpointing, --gradient_checkpointing under FSDP) does to
    the layers, without FSDP: each one in torch's checkpoint_wrapper."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    layers = unwrap(model).vit.layers
    for i, layer in enumerate(layers):
        layers[i] = checkpoint_wrapper(layer, preserve_rng_state=False)
    return layers


def test_adapter_saved_through_activation_checkpoint_wrappers_keeps_its_lora_weights(saved_adapter, tmp_path):
    """The FSDP2 + --gradient_checkpointing failure on GPUs, in one process: the Trainer saves with the state dict,
    whose names the checkpoint wrappers leave clean, while peft >= 0.21 picks the adapter's entries by its LoRA layers'
    module names, which carry `_checkpoint_wrapped_module.`: without the fix the adapter held the head alone."""
    base_dir, adapter, trained = saved_adapter
    expected = set(load_file(adapter / "adapter_model.safetensors"))
    assert sum("lora_" in k for k in expected) == 2 * 2 * 2  # q/v A/B in 2 layers; + the head
    layers = checkpoint_wrapped(trained)
    assert any("_checkpoint_wrapped_module" in name for name, _ in trained.named_modules())
    broken = tmp_path / "broken"
    trained.save_pretrained(broken, state_dict=trained.state_dict())  # as Trainer._save does under FSDP
    assert not any("lora_" in k for k in load_file(broken / "adapter_model.safetensors"))  # peft's behaviour
    out = tmp_path / "wrapped"
    with without_activation_wrappers(trained):  # what ImageClassificationTrainer._save does
        trained.save_pretrained(out, state_dict=trained.state_dict())
    saved = load_file(out / "adapter_model.safetensors")
    assert set(saved) == expected
    for key, value in load_file(adapter / "adapter_model.safetensors").items():
        torch.testing.assert_close(saved[key], value)
    assert all(type(layer).__name__ == "CheckpointWrapper" for layer in layers), "the wrappers are put back"
    check_saved_adapter(out, trained)
    trained.config.save_pretrained(out)
    x = torch.randn(2, 3, 16, 16)
    trained.eval()
    torch.testing.assert_close(load_model(out, str(base_dir))(pixel_values=x).logits, trained(pixel_values=x).logits)


def test_adapter_saved_without_its_lora_weights_is_refused_when_saved(saved_adapter, tmp_path):
    base_dir, adapter, trained = saved_adapter
    out = tmp_path / "head-only"
    head_only = {k: v for k, v in trained.state_dict().items() if "lora_" not in k}
    type(trained).save_pretrained(trained, out, state_dict=head_only)  # what peft saved under the wrappers
    with pytest.raises(RecipeError, match=r"holds 0 of the model's 8 LoRA weights \(2 tensors: .*classifier"):
        check_saved_adapter(out, trained)
    check_saved_adapter(adapter, trained)


def test_card_fields_name_peft_and_the_base_for_adapters():
    from vit_recipes.publish.card import CardInfo, build_model_card

    setup = FinetuneSetup("lora", False, None, ["a", "b"], {"train_trainable_percent": 0.77}, lora={"lora_r": 16})
    info = dict(
        model_name="vit-lora",
        base_model="google/vit-base-patch16-224-in21k",
        base_model_source="google/vit-base-patch16-224-in21k",
        dataset_id="uoft-cs/cifar100",
        dataset_is_hub=True,
        label_names=["a", "b"],
        validation_metrics={"eval_accuracy": 0.9},
        test_metrics={"test_accuracy": 0.91},
        hyperparameters={"learning_rate": 2e-3},
        command="python run_image_classification.py --use_peft true",
        recipe=None,
        recipe_text=None,
        strategy="single-device",
        hardware="1 x NVIDIA H200",
        throughput=None,
        per_class_markdown=None,
        confusion_matrix_file=None,
    )
    card = build_model_card(CardInfo(**{**info, **setup.card_fields(info["hyperparameters"])}))
    assert card.data.library_name == "peft" and card.data.base_model == "google/vit-base-patch16-224-in21k"
    assert "lora" in card.data.tags and "lora_r | 16" in card.text and "pip install peft" in card.text
    assert 'AutoConfig.from_pretrained("google/vit-base-patch16-224-in21k")' in card.text  # how to load it
    merged = FinetuneSetup("lora", True, None, ["a", "b"], {"train_trainable_percent": 0.77})
    card = build_model_card(CardInfo(**{**info, **merged.card_fields(info["hyperparameters"])}))
    assert card.data.library_name == "transformers" and "pip install peft" not in card.text


# ------------------------------------------------------------------------------------------------ strategies


def fake_trainer(fsdp=None, deepspeed=None):
    state = SimpleNamespace(
        fsdp_plugin=fsdp, deepspeed_plugin=deepspeed and SimpleNamespace(deepspeed_config=deepspeed)
    )
    return SimpleNamespace(
        is_fsdp_enabled=fsdp is not None,
        is_deepspeed_enabled=deepspeed is not None,
        accelerator=SimpleNamespace(state=state),
    )


def fsdp(version=2, use_orig_params=False, state_dict_type="StateDictType.FULL_STATE_DICT"):
    return SimpleNamespace(fsdp_version=version, use_orig_params=use_orig_params, state_dict_type=state_dict_type)


@pytest.mark.parametrize(
    "trainer, message",
    [
        (fake_trainer(), None),
        (fake_trainer(fsdp=fsdp()), None),  # FSDP2, full state dict: the accelerate_configs/fsdp.yaml set-up
        (fake_trainer(fsdp=fsdp(version=1, use_orig_params=True)), None),
        (fake_trainer(fsdp=fsdp(version=1)), "under FSDP1 needs fsdp_use_orig_params: true"),
        (fake_trainer(fsdp=fsdp(state_dict_type="StateDictType.SHARDED_STATE_DICT")), "FULL_STATE_DICT"),
        (fake_trainer(deepspeed={"zero_optimization": {"stage": 2}}), None),
        (fake_trainer(deepspeed={"zero_optimization": {"stage": 3}}), "stage3_gather_16bit_weights_on_model_save"),
        (
            fake_trainer(
                deepspeed={"zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": True}}
            ),
            None,
        ),
    ],
)
def test_strategies_that_cannot_save_an_adapter_are_refused_before_training(trainer, message):
    setup = FinetuneSetup("lora", False, None, [], {})
    if message is None:
        check_adapter_strategy(trainer, setup)
    else:
        with pytest.raises(RecipeError, match=message):
            check_adapter_strategy(trainer, setup)
    check_adapter_strategy(trainer, FinetuneSetup("full", False, None, [], {}))  # full fine-tuning: not our business


def test_the_shipped_strategy_configs_pass_the_lora_checks():
    """ds_configs/zero3.json and accelerate_configs/fsdp.yaml are set up so that adapters can be saved."""
    zero3 = json.loads((ROOT / "ds_configs/zero3.json").read_text())
    assert zero3["zero_optimization"].get("stage3_gather_16bit_weights_on_model_save") is True
    fsdp_yaml = yaml.safe_load((ROOT / "accelerate_configs/fsdp.yaml").read_text())["fsdp_config"]
    assert fsdp_yaml["fsdp_version"] == 2 and fsdp_yaml["fsdp_state_dict_type"] == "FULL_STATE_DICT"


def test_training_flops_count_no_weight_gradients_for_a_frozen_backbone():
    from vit_recipes.model.flops import forward_flops

    config = tiny_model().config
    forward = forward_flops(config)
    setups = {m: m for m in ("full", "lora", "head")}
    assert training_flops_per_image(config, False, setups["full"]) == pytest.approx(3 * forward)
    assert training_flops_per_image(config, False, setups["lora"]) == pytest.approx(2 * forward)
    assert training_flops_per_image(config, True, setups["lora"]) == pytest.approx(3 * forward)
    assert training_flops_per_image(config, False, setups["head"]) == pytest.approx(forward)


# ------------------------------------------------------------------------------------------------ the script


def lora_args(data, model, out, *extra):
    return (
        "--dataset_name", data,
        "--model_name_or_path", model,
        "--output_dir", out,
        "--do_train", "true",
        "--do_eval", "true",
        "--max_steps", "20",
        "--per_device_train_batch_size", "32",
        "--per_device_eval_batch_size", "256",
        "--learning_rate", "1e-2",
        "--lr_scheduler_type", "constant",
        "--crop_scale_min", "1.0",
        "--hflip_prob", "0",
        "--use_peft", "true",
        "--lora_r", "4",
        "--plots", "false",
        *FAST_ARGS,
        *extra,
    )  # fmt: skip


def eval_args(data, model, out):
    return (
        "--dataset_name", data,
        "--model_name_or_path", model,
        "--output_dir", out,
        "--do_train", "false",
        "--do_eval", "true",
        "--per_device_eval_batch_size", "256",
        "--plots", "false",
        *FAST_ARGS,
    )  # fmt: skip


@pytest.fixture
def fake_hub(monkeypatch):
    """Push for real through Trainer.push_to_hub, into a recorder instead of the Hub: `repos`, the repositories
    created (huggingface_hub's create_repo arguments), and `pushes`, what each upload held."""
    import huggingface_hub
    import transformers.trainer

    hub = SimpleNamespace(repos=[], pushes=[])

    class FakeApi:
        def create_repo(self, repo_id, **kwargs):
            hub.repos.append({"repo_id": repo_id, **kwargs})
            return SimpleNamespace(repo_id=repo_id)

        def upload_folder(self, repo_id, folder_path, **kwargs):
            folder = Path(folder_path)
            files = sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())
            readme = (folder / "README.md").read_text() if (folder / "README.md").is_file() else ""
            hub.pushes.append({"files": files, "readme": readme, "message": kwargs.get("commit_message")})
            return SimpleNamespace(commit_url="https://huggingface.co/fake")

    monkeypatch.setattr(transformers.trainer, "hf_api", lambda: FakeApi())
    monkeypatch.setenv("HF_TOKEN", "hf_" + "Fake" * 8)
    # CI exports both offline switches; pushing (to the fake API) needs both off.
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "0")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    return hub


@pytest.mark.slow
def test_adapter_is_saved_pushed_and_reloads_with_the_same_accuracy(
    digits_dir, tiny_vit, tmp_path, run_script, fake_hub
):
    out = tmp_path / "lora"
    results = run_script(
        *lora_args(digits_dir, tiny_vit, out, "--push_to_hub", "true", "--hub_model_id", "me/vit-lora")
    )
    saved = {p.name for p in out.iterdir()}
    assert {"adapter_model.safetensors", "adapter_config.json", "adapter_base.json", "config.json"} <= saved
    assert "model.safetensors" not in saved
    assert results["train_trainable_params"] < results["train_total_params"]
    # The Hub gets the adapter, with a card that names the peft library (and the base, when it is a Hub id).
    # one repository, its visibility left to the Hub (no --hub_private_repo), then the adapter pushed
    assert [(r["repo_id"], r["private"]) for r in fake_hub.repos] == [("me/vit-lora", None)]
    final = fake_hub.pushes[-1]
    assert "adapter_model.safetensors" in final["files"] and "model.safetensors" not in final["files"]
    metadata = yaml.safe_load(final["readme"].split("---")[1])
    assert metadata["library_name"] == "peft" and "lora" in metadata["tags"]

    # Reload 1: the script evaluates the adapter folder (put back on its base) with the same accuracy.
    again = run_script(*eval_args(digits_dir, out, tmp_path / "eval-adapter"))
    assert again["test_accuracy"] == pytest.approx(results["test_accuracy"], abs=1e-9)
    assert again["eval_accuracy"] == pytest.approx(results["eval_accuracy"], abs=1e-9)
    # Reload 2: plain peft, PeftModel.from_pretrained on the base with this folder's labels.
    from peft import PeftModel
    from transformers import AutoConfig, AutoModelForImageClassification

    config = AutoConfig.from_pretrained(tiny_vit)
    labels = AutoConfig.from_pretrained(out)
    config.num_labels, config.id2label, config.label2id = labels.num_labels, labels.id2label, labels.label2id
    base = AutoModelForImageClassification.from_pretrained(tiny_vit, config=config, ignore_mismatched_sizes=True)
    plain = PeftModel.from_pretrained(base, out).eval()
    ours = load_model(out)
    x = torch.rand(4, 3, 16, 16)
    torch.testing.assert_close(plain(pixel_values=x).logits, ours(pixel_values=x).logits)
    # Reload 3, as docs/lora.md shows: pipeline() on the model inside the PeftModel, quietly, the same scores
    import io
    import logging

    from PIL import Image
    from transformers import pipeline

    said = io.StringIO()
    handler = logging.StreamHandler(said)
    logging.getLogger("transformers").addHandler(handler)
    try:
        classify = pipeline(
            "image-classification", model=ours.get_base_model(), image_processor=str(out), device="cpu"
        )
    finally:
        logging.getLogger("transformers").removeHandler(handler)
    assert "is not supported" not in said.getvalue(), said.getvalue()[:300]
    image = Image.fromarray((np.random.default_rng(0).random((16, 16, 3)) * 255).astype("uint8"))
    best = classify(image, top_k=1)[0]
    logits = ours(**classify.image_processor(image, return_tensors="pt")).logits[0]
    assert best["score"] == pytest.approx(float(logits.softmax(-1).max()), abs=1e-5)


@pytest.mark.slow
def test_merged_model_is_plain_pushed_alone_and_works_in_a_pipeline(
    digits_dir, tiny_vit, tmp_path, run_script, fake_hub
):
    from datasets import load_dataset
    from transformers import pipeline

    out = tmp_path / "merged"
    results = run_script(
        *lora_args(digits_dir, tiny_vit, out, "--merge_adapter", "true", "--push_to_hub", "true"),
        "--hub_model_id", "me/vit-merged", "--hub_strategy", "end", "--hub_private_repo", "true",
    )  # fmt: skip
    saved = {p.name for p in out.iterdir()}
    assert "model.safetensors" in saved and not any(name.startswith("adapter_") for name in saved)
    assert [(r["repo_id"], r["private"]) for r in fake_hub.repos] == [("me/vit-merged", True)]  # --hub_private_repo
    pushed = fake_hub.pushes[-1]
    assert "model.safetensors" in pushed["files"] and not any("adapter" in f for f in pushed["files"])
    assert yaml.safe_load(pushed["readme"].split("---")[1])["library_name"] == "transformers"

    again = run_script(*eval_args(digits_dir, out, tmp_path / "eval-merged"))
    assert again["test_accuracy"] == pytest.approx(results["test_accuracy"], abs=1e-9)
    test = load_dataset(str(digits_dir), split="test")
    classifier = pipeline("image-classification", model=str(out), device="cpu")
    predictions = [p[0]["label"] for p in classifier(list(test["image"]), top_k=1, batch_size=128)]
    accuracy = np.mean([p == str(row["label"]) for p, row in zip(predictions, test)])
    assert accuracy == pytest.approx(results["test_accuracy"], abs=2 / len(test))  # PIL vs device resize
    with pytest.raises(RecipeError, match="needs --hub_strategy end"):
        run_script(
            *lora_args(digits_dir, tiny_vit, tmp_path / "x", "--merge_adapter", "true", "--push_to_hub", "true")
        )


@pytest.mark.slow
def test_lora_trains_with_reentrant_checkpointing_and_bf16(digits_dir, tiny_vit, tmp_path, run_script):
    """Reentrant checkpointing on a frozen backbone: "no parameters require grad" unless inputs require grad."""
    from safetensors.torch import load_file

    out = tmp_path / "gc"
    results = run_script(
        *lora_args(digits_dir, tiny_vit, out, "--max_steps", "4", "--do_eval", "false"),
        "--gradient_checkpointing", "true",
        "--gradient_checkpointing_kwargs", '{"use_reentrant": true}',
        "--bf16", "true",
    )  # fmt: skip
    assert np.isfinite(results["train_loss"])
    weights = load_file(out / "adapter_model.safetensors")
    lora_b = [v for k, v in weights.items() if "lora_B" in k]
    assert len(lora_b) == 4 and all(v.abs().sum() > 0 for v in lora_b), "every adapter learned (B starts at zero)"


def test_lora_trains_and_saves_its_adapter_under_regional_compilation(digits_dir, tiny_vit, tmp_path, run_script):
    """--torch_compile_regions with peft: the compiled layers hold LoRA modules, and the adapter saved afterwards
    has every LoRA weight under peft's names (no compile wrapper in them). aot_eager keeps it fast on the CPU."""
    from safetensors.torch import load_file

    out = tmp_path / "regions"
    results = run_script(
        *lora_args(digits_dir, tiny_vit, out, "--max_steps", "4", "--do_eval", "false"),
        "--torch_compile_regions", "true", "--torch_compile_backend", "aot_eager",
    )  # fmt: skip
    assert np.isfinite(results["train_loss"])
    weights = load_file(out / "adapter_model.safetensors")
    lora_b = [v for k, v in weights.items() if "lora_B" in k]
    assert not [k for k in weights if "_orig_mod" in k]
    assert len(lora_b) == 4 and all(v.abs().sum() > 0 for v in lora_b), "every adapter learned (B starts at zero)"


@pytest.mark.slow
@pytest.mark.parametrize(
    "extra, message",
    [
        (("--lora_target_modules", "attn"), "matches no module; the layers LoRA can adapt are: fc1, fc2"),
        (("--model_name_or_path", None, "--config_name", "vit"), "--use_peft needs pretrained weights"),
    ],
)
def test_bad_lora_input_stops_before_training(digits_dir, tiny_vit, tmp_path, run_script, extra, message):
    argv = list(lora_args(digits_dir, tiny_vit, tmp_path / "bad"))
    if extra[0] == "--model_name_or_path":  # from scratch: the recipe way is model_name_or_path: null
        recipe = tmp_path / "scratch.yaml"
        recipe.write_text("model_name_or_path: null\n")
        index = argv.index("--model_name_or_path")
        del argv[index : index + 2]
        argv = ["--config", str(recipe), *argv, *extra[2:]]
    else:
        argv += list(extra)
    with pytest.raises(RecipeError, match=message):
        run_script(*argv)
    assert not (tmp_path / "bad" / "trainer_state.json").exists()


@pytest.mark.slow
def test_rank_zero_exits_with_one_line(tmp_path, tiny_vit):
    result = subprocess.run(
        [sys.executable, str(ROOT / "run_image_classification.py"), "--model_name_or_path", str(tiny_vit),
         "--dataset_name", "x", "--output_dir", str(tmp_path), "--use_peft", "true", "--lora_r", "0",
         "--use_cpu", "true"],
        capture_output=True, text=True, cwd=ROOT, timeout=120,
    )  # fmt: skip
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == "error: lora_r must be > 0, got 0"


# ------------------------------------------------------------------------------------------------ transfer

sys.path.append(str(ROOT / "tools"))  # transfer.py is a script there, not part of the package


@pytest.fixture(scope="session")
def transfer_record(tmp_path_factory):
    from transfer import FASHION_MNIST, Runner, run_check

    if not Path(FASHION_MNIST, "train-images-idx3-ubyte.gz").is_file():
        pytest.skip(f"Fashion-MNIST not found in {FASHION_MNIST}")
    out = tmp_path_factory.mktemp("transfer")
    return run_check(out, "test", methods=("full", "lora", "head"), runner=Runner(in_process=True)), out


@pytest.mark.slow
def test_transfer_check_without_fashion_mnist_names_the_debian_package_in_one_line(tmp_path):
    result = subprocess.run(
        [sys.executable, ROOT / "tools" / "transfer.py", "--fashion_mnist", tmp_path, "--out", tmp_path / "o"],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines() == [
        f"error: Fashion-MNIST idx files not found in {tmp_path} (train-images-idx3-ubyte.gz, "
        "train-labels-idx1-ubyte.gz, t10k-images-idx3-ubyte.gz, t10k-labels-idx1-ubyte.gz): install them with "
        "`apt-get install dataset-fashion-mnist` (Debian; it puts them in /usr/share/datasets/fashion-mnist) or pass "
        "--fashion_mnist DIR, the folder that holds them"
    ]


def test_transfer_lora_beats_a_frozen_backbone_and_nears_full_finetuning(transfer_record):
    """A ViT pretrained here on Fashion-MNIST, fine-tuned on digits through the script three ways.

    LoRA must clearly beat the head trained alone on the frozen backbone (what LoRA adds is the adaptation of the
    backbone), and come close to full fine-tuning with a small fraction of its trainable parameters.
    """
    record, out = transfer_record
    summary = {m: s for m, s in record["summary"].items()}
    full, lora, head = (summary[m]["test_accuracy_mean"] for m in ("full", "lora", "head"))
    assert record["pretrain"]["results"]["test_accuracy"] > 0.5, "the base learned Fashion-MNIST"
    assert lora >= head + 0.08, f"LoRA {lora:.3f} vs frozen backbone {head:.3f}"  # measured: +32 points
    assert lora >= full - 0.08, f"LoRA {lora:.3f} vs full fine-tuning {full:.3f}"  # measured: +1.5 points
    params = {m: summary[m]["trainable_params"] for m in ("full", "lora", "head")}
    assert params["head"] < params["lora"] < 0.2 * params["full"]
    assert summary["lora"]["saved_bytes"] < 0.2 * summary["full"]["saved_bytes"]  # the adapter alone is saved
    assert (out / "lora_transfer.json").is_file() and "| LoRA (query, value) |" in (
        out / "lora_transfer.md"
    ).read_text()


@pytest.mark.slow
def test_lora_under_zero3_bf16_on_two_processes_saves_a_merged_model(transfer_record, tmp_path, run_script):
    """ZeRO-3 shards the frozen base (in bf16) too: the adapters must share its dtype, the adapter is gathered, then
    merged on rank 0 from the saved files onto the base reloaded in fp32 (the base check tolerates the rounding)."""
    import os
    import socket

    work = transfer_record[1] / "work"  # the Fashion-MNIST base and digits of the transfer check
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "zero3"
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", "accelerate_configs/zero3.yaml",
              "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "bf16",
              "--main_process_port", str(port), "tools/rank_report.py"]  # fmt: skip
    argv = lora_args(work / "digits", work / "pretrained", out, "--merge_adapter", "true", "--bf16", "true")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    result = subprocess.run([*launch, *map(str, argv)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    assert "LoRA: trainable params" in result.stdout
    for rank in (
        0,
        1,
    ):  # zero3.json's ViTLayer leaf modules are dropped for adapters (adapters.drop_zero3_leaf_modules)
        report = json.loads((out / "rank_reports" / f"rank{rank}.json").read_text())
        assert report["zero_stage"] == 3 and report["zero3_leaf_modules"] == [], report
    saved = {p.name for p in out.iterdir()}
    assert "model.safetensors" in saved and not any(name.startswith("adapter_") for name in saved)
    trained = json.loads((out / "all_results.json").read_text())
    assert trained["test_accuracy"] > 0.3, "LoRA learned under ZeRO-3"
    again = run_script(*eval_args(work / "digits", out, tmp_path / "eval"), "--bf16", "true")
    assert again["test_accuracy"] == pytest.approx(trained["test_accuracy"], abs=0.015)  # bf16 weights vs autocast


def test_transfer_chooses_learning_rates_on_validation_and_keeps_to_its_budget(tmp_path):
    """The bookkeeping of tools/transfer.py, with a stand-in for the script (no training)."""
    from transfer import SIZES, RunResult, override, run_check

    base = tmp_path / "work" / "pretrained"
    base.mkdir(parents=True)
    (base / "model.safetensors").write_bytes(b"")
    (base / "all_results.json").write_text('{"test_accuracy": 0.8}')
    calls = []

    def fake(stage, seed, argv, output_dir):
        lr = float(argv[argv.index("--learning_rate") + 1])
        calls.append((stage, seed, lr))
        validation = {"full": 0.9, "lora": 0.8 + lr, "head": 0.5}[stage]  # lora: the larger rate validates better
        results = {"eval_accuracy": validation, "test_accuracy": validation - 0.01, "train_trainable_params": 10}
        results.update(train_total_params=100, train_trainable_percent=10.0, train_images_per_second=5.0)
        return RunResult(stage, seed, ["run_image_classification.py", *argv], 1.0, results)

    size = override(SIZES["test"], ["lr.lora=[0.01, 0.05]", "seeds=[0, 1]"])
    record = run_check(
        tmp_path / "out", size, tmp_path / "work", ("full", "lora", "head"), runner=fake, reuse_base=True
    )
    assert [c for c in calls if c[0] == "lora"] == [("lora", 0, 0.01), ("lora", 0, 0.05), ("lora", 1, 0.05)]
    assert record["summary"]["lora"]["learning_rate"] == 0.05 and len(record["summary"]["lora"]["test_accuracy"]) == 2
    assert [t["lr"] for t in record["lr_selection"]["lora"]] == [0.01, 0.05]
    assert record["verdict"]["lora_within_1_point_of_full"] is False  # 0.84 vs 0.89
    table = (tmp_path / "out" / "lora_transfer.md").read_text()
    assert "| LoRA (query, value) | 2 | 0.05 |" in table and "chosen on validation" in table

    calls.clear()
    record = run_check(
        tmp_path / "out2", size, tmp_path / "work", ("full", "lora"), runner=fake, reuse_base=True, budget=0
    )
    assert calls == [] and len(record["skipped"]) == 3  # full seed 0; lora seed 0 at both rates

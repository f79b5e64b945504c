"""Image classifiers other than ViT, each a tiny random config saved with its family's image processor (as on the
Hub): the script's defaults train, evaluate and save it, and pipeline() on the saved folder predicts what the
script's predictions.csv says."""

from __future__ import annotations

import csv
import json
import types
from pathlib import Path

import pytest
from conftest import FAST_ARGS

CHANNELS = [8, 16, 16, 16]


def tiny(family: str):
    """(config, image processor) of a tiny random model of `family`, 32x32 input; the config names its class, as a
    Hub checkpoint's does."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES as NAMES

    config, processor = _tiny(family)
    names = NAMES[config.model_type]
    config.architectures = [names if isinstance(names, str) else names[0]]
    return config, processor


def _tiny(family: str):
    import transformers as tf

    vit_like = dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32)
    square = {"height": 32, "width": 32}
    if family == "deit":
        return tf.DeiTConfig(image_size=32, patch_size=8, **vit_like), tf.ViTImageProcessor(size=square)
    if family == "beit":
        return tf.BeitConfig(image_size=32, patch_size=8, **vit_like), tf.BeitImageProcessor(size=square)
    if family == "dinov2":
        config = tf.Dinov2Config(image_size=32, patch_size=8, **vit_like)
        return config, tf.BitImageProcessor(size={"shortest_edge": 32}, crop_size=square)
    if family == "swin":
        config = tf.SwinConfig(
            image_size=32, patch_size=4, embed_dim=8, depths=[1, 1], num_heads=[1, 2], window_size=4
        )
        return config, tf.ViTImageProcessor(size=square)
    if family == "convnext":
        config = tf.ConvNextConfig(depths=[1, 1, 1, 1], hidden_sizes=CHANNELS, image_size=32)
        return config, tf.ConvNextImageProcessor(size={"shortest_edge": 32}, crop_pct=1.0)
    if family == "convnextv2":
        config = tf.ConvNextV2Config(depths=[1, 1, 1, 1], hidden_sizes=CHANNELS, image_size=32)
        return config, tf.ConvNextImageProcessor(size={"shortest_edge": 32}, crop_pct=1.0)
    if family == "efficientnet":
        config = tf.EfficientNetConfig(image_size=32, width_coefficient=0.1, depth_coefficient=0.1, hidden_dim=128)
        return config, tf.EfficientNetImageProcessor(size=square)
    if family == "mobilevit":
        config = tf.MobileViTConfig(image_size=32, patch_size=2, hidden_sizes=[16, 16, 16], num_attention_heads=2,
                                    neck_hidden_sizes=[8, 8, 16, 16, 16, 32, 64])  # fmt: skip
        return config, tf.MobileViTImageProcessor(size={"shortest_edge": 32}, crop_size=square)
    if family == "resnet":  # its config has no image_size: the processor's says what it is fed
        config = tf.ResNetConfig(depths=[1, 1, 1, 1], hidden_sizes=CHANNELS, embedding_size=8)
        return config, tf.ConvNextImageProcessor(size={"shortest_edge": 32}, crop_pct=1.0)
    raise ValueError(family)


FAMILIES = ["deit", "beit", "dinov2", "swin", "convnext", "convnextv2", "efficientnet", "mobilevit", "resnet"]


@pytest.fixture(scope="module")
def predict_folder(cifar_like, tmp_path_factory) -> Path:
    """Six of the test images as PNG files."""
    from datasets import load_dataset

    folder = tmp_path_factory.mktemp("to_predict")
    for i, row in enumerate(load_dataset(str(cifar_like), split="test").select(range(6))):
        row["img"].save(folder / f"{i}.png")
    return folder


@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_trains_saves_and_reloads_with_pipeline(family, cifar_like, predict_folder, tmp_path, run_script):
    import torch
    from transformers import AutoModelForImageClassification

    torch.manual_seed(0)
    config, processor = tiny(family)
    source = tmp_path / family
    AutoModelForImageClassification.from_config(config).save_pretrained(source)
    processor.save_pretrained(source)
    out = tmp_path / "out"
    results = train_and_predict(run_script, cifar_like, source, out, predict_folder)
    assert "test_accuracy" in results and results["train_loss"] > 0
    assert_pipeline_matches_predictions(out, predict_folder)
    if family in ("convnext", "resnet"):  # no attention: the default picked eager; asking for SDPA is one line
        from vit_recipes.core.errors import RecipeError

        with pytest.raises(RecipeError, match=r"ForImageClassification has no SDPA attention: drop --attn_impl"):
            run_script("--dataset_name", cifar_like, "--model_name_or_path", source, "--output_dir", tmp_path / "x",
                       "--attn_implementation", "sdpa", *FAST_ARGS)  # fmt: skip


@pytest.mark.parametrize(
    ("family", "flags", "refusal"),
    [
        (
            "convnext",
            ("--gradient_checkpointing", "true"),
            "transformers has no activation checkpointing for ConvNext",
        ),
        ("resnet", ("--gradient_checkpointing", "true"), "transformers has no activation checkpointing for ResNet"),
        ("swin", ("--patch_dropout", "0.5"), "--patch_dropout needs a ViT-style model .* SwinForImage"),
        ("convnext", ("--patch_dropout", "0.5"), "--patch_dropout needs a ViT-style model .* ConvNextForImage"),
        ("swin", ("--layer_decay", "0.75"), "--layer_decay needs a model whose transformer layers form one stack"),
        ("convnext", ("--layer_decay", "0.75"), "--layer_decay needs .* ConvNextForImageClassification has none"),
        ("resnet", ("--drop_path_rate", "0.1"), "--drop_path_rate needs .* ResNetForImageClassification has none"),
    ],
)
def test_a_vit_only_feature_on_another_family_is_one_line_before_any_data(
    family, flags, refusal, tmp_path, run_script
):
    """It was a transformers traceback after the data was decoded (gradient checkpointing)."""
    from transformers import AutoModelForImageClassification

    from vit_recipes.core.errors import RecipeError

    config, processor = tiny(family)
    source = tmp_path / family
    AutoModelForImageClassification.from_config(config).save_pretrained(source)
    processor.save_pretrained(source)
    with pytest.raises(RecipeError, match=refusal):  # no such dataset: the refusal comes before data is read
        run_script("--dataset_name", tmp_path / "no_data_yet", "--model_name_or_path", source, "--output_dir",
                   tmp_path / "out", "--do_train", "true", *flags, *FAST_ARGS)  # fmt: skip


def test_lora_on_a_convolutional_model_suggests_real_module_names_and_they_train(cifar_like, tmp_path, run_script):
    """ConvNeXt has no attention to adapt: the refusal lists its layers, none a bare Sequential index ('1' matched
    every second child of every Sequential), and the listed names train as LoRA targets."""
    import re

    from transformers import AutoModelForImageClassification

    from vit_recipes.core.errors import RecipeError

    config, processor = tiny("convnext")
    source = tmp_path / "convnext"
    AutoModelForImageClassification.from_config(config).save_pretrained(source)
    processor.save_pretrained(source)
    common = ("--dataset_name", cifar_like, "--model_name_or_path", source, "--output_dir", tmp_path / "out",
              "--do_train", "true", "--max_steps", "2", "--use_peft", "true", *FAST_ARGS, "--plots", "false")  # fmt: skip
    with pytest.raises(RecipeError, match="no attention query/value projections") as refused:
        run_script(*common)
    suggested = re.search(r"some of its layers: (.*)$", str(refused.value))[1].split(", ")
    assert "downsampling_layer.1" in suggested and not any(name.isdigit() for name in suggested), suggested
    results = run_script(*common, "--lora_target_modules", "pwconv1", "pwconv2", "downsampling_layer.1")
    assert 0 < results["train_trainable_params"] < results["train_total_params"]


def test_the_fsdp_config_wrapping_vit_layers_names_the_layer_class_of_another_family(monkeypatch):
    """accelerate_configs/fsdp.yaml wraps ViTLayer: on a Swin, accelerate stopped with "Could not find the transformer
    layer class" at prepare; one line names Swin's own layer class instead."""
    import types

    from transformers import AutoModelForImageClassification

    from vit_recipes.core.errors import RecipeError
    from vit_recipes.plan.checks import check_fsdp_wrap
    from vit_recipes.plan.plan import read_strategy

    model = AutoModelForImageClassification.from_config(tiny("swin")[0])
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_TRANSFORMER_CLS_TO_WRAP", "ViTLayer")
    with pytest.raises(RecipeError, match=r"names ViTLayer, which SwinForImageClassification does not have: wrap its "
                                          r"layer class \(SwinStage\) with accelerate launch"):  # fmt: skip
        check_fsdp_wrap(read_strategy(types.SimpleNamespace(world_size=2)), model)
    monkeypatch.setenv("FSDP_TRANSFORMER_CLS_TO_WRAP", "SwinStage")
    check_fsdp_wrap(read_strategy(types.SimpleNamespace(world_size=2)), model)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_memory_advisor_and_the_flop_count_size_each_family(family):
    """What tools/advise.py and MFU read: parameters (and the largest layer) from the model built on the meta device,
    and FLOPs of one forward at the input size (ResNet's from its processor: its config has none)."""
    from transformers import AutoModelForImageClassification

    from vit_recipes.model.facts import model_size
    from vit_recipes.model.flops import forward_flops

    config = tiny(family)[0]
    params, largest = model_size(config)
    assert params == sum(p.numel() for p in AutoModelForImageClassification.from_config(config).parameters())
    assert 0 < largest < params
    assert forward_flops(config, image_size=32) > 2 * params  # at least one multiply-add per weight


def test_the_image_processor_of_a_hub_model_is_fetched_once_for_the_size_and_the_normalisation(monkeypatch):
    """Every model's processor is read for its size now (training_image_size): a Hub one is asked for once a run,
    which reads it again for mean/std (the Hub's answer, offline or not, takes a round trip)."""
    from transformers import AutoImageProcessor

    from vit_recipes.model import facts, modeling

    processor = tiny("dinov2")[1]
    asked = []
    facts._load_processor.cache_clear()
    monkeypatch.setattr(AutoImageProcessor, "from_pretrained", lambda name, **kw: asked.append(name) or processor)
    args = types.SimpleNamespace(model_name_or_path="someone/dinov2-tiny", image_processor_name=None, cache_dir=None)
    assert facts.processor_image_size(args) == 32 and modeling.mean_std(args)[0] == tuple(processor.image_mean)
    assert asked == ["someone/dinov2-tiny"]


def test_dinov2_trains_at_its_processors_size_and_a_model_that_cannot_keeps_its_own(
    cifar_like, predict_folder, tmp_path, run_script, capsys, caplog
):
    """DINOv2's config says 518 (its position table), its processor crops 224, which pipeline() and the peer feed
    it: the run trained at 518, 5x the tokens. Here 64 and 32: it trains at 32 (its embeddings interpolate the
    table), says so in its start line, drops patches of 32-px images, and saves a processor that crops 32, which
    pipeline() follows to the run's own predictions. DeiT refuses another size than its config's: it keeps its own."""
    import torch
    from transformers import AutoModelForImageClassification

    from vit_recipes.model.classifiers import classifier_class
    from vit_recipes.model.facts import ModelFacts, processor_image_size
    from vit_recipes.model.modeling import training_image_size

    deit, deit_processor = tiny("deit")
    deit_processor.size = {"height": 48, "width": 48}
    AutoModelForImageClassification.from_config(deit).save_pretrained(tmp_path / "deit")
    deit_processor.save_pretrained(tmp_path / "deit")
    args = types.SimpleNamespace(model_name_or_path=str(tmp_path / "deit"), image_processor_name=None, cache_dir=None)
    caplog.set_level("WARNING", logger="vit_recipes.model.modeling")
    facts = ModelFacts("deit", deit, True, classifier_class(deit), processor_image_size(args))
    assert training_image_size(facts) == 32
    assert "feeds it 48 px, but DeiTForImageClassification runs only at its config's image_size 32" in caplog.text
    torch.manual_seed(0)
    config, processor = tiny("dinov2")
    config.image_size = 64  # the position table's grid: 8x8 patches of 8 px
    source = tmp_path / "dinov2"
    AutoModelForImageClassification.from_config(config).save_pretrained(source)
    processor.save_pretrained(source)
    out = tmp_path / "out"
    capsys.readouterr()
    run_script("--dataset_name", cifar_like, "--model_name_or_path", source, "--output_dir", out, "--max_steps", "2",
               "--per_device_train_batch_size", "8", "--do_train", "true", "--do_eval", "true", "--do_predict", "true",
               "--predict_images", predict_folder, "--patch_dropout", "0.5", *FAST_ARGS, "--plots", "false")  # fmt: skip
    printed = capsys.readouterr().out
    assert "Full fine-tuning: trainable params " in printed and "; input 32x32 px" in printed
    assert "--patch_dropout 0.5: training images keep 8 of 16 patches" in printed  # 16 patches of 32 px, not 64
    saved = json.loads((out / "preprocessor_config.json").read_text())
    assert (
        saved["crop_size"] == {"height": 32, "width": 32}
        and json.loads((out / "config.json").read_text())["image_size"] == 64
    )  # the table stays: the checkpoint reloads as it was
    assert_pipeline_matches_predictions(out, predict_folder)


def assert_pipeline_matches_predictions(out, predict_folder) -> None:
    """pipeline() on the saved model gives predictions.csv's label and score for every image."""
    from transformers import pipeline

    with open(out / "predictions.csv") as f:
        ours = {row["file"]: row for row in csv.DictReader(f)}
    classify = pipeline("image-classification", model=str(out), device="cpu")
    for name, row in ours.items():
        best = classify(str(predict_folder / name), top_k=1)[0]
        assert (best["label"], best["score"]) == (row["label"], pytest.approx(float(row["score"]), abs=1e-4)), name


def train_and_predict(run_script, dataset, source, out, predict_folder) -> dict:
    """Two steps of training from `source`, evaluation, test and predictions.csv for `predict_folder`."""
    return run_script("--dataset_name", dataset, "--model_name_or_path", source, "--output_dir", out,
                      "--max_steps", "2", "--per_device_train_batch_size", "8", "--do_train", "true", "--do_eval", "true",
                      "--do_predict", "true", "--predict_images", predict_folder, *FAST_ARGS, "--plots", "false")  # fmt: skip


# timm checkpoints load through transformers' TimmWrapper: a ViT saved by timm as the Hub's timm/ checkpoints are
# (config.json with pretrained_cfg and no model_type, weights without the wrapper's prefix), a ResNet saved by
# TimmWrapperForImageClassification.save_pretrained. Random init, 7 labels, 32-px input, no download.
TIMM = {
    "vit": ("vit_tiny_patch16_224", {"img_size": 32, "patch_size": 8, "depth": 1, "embed_dim": 16, "num_heads": 2}),
    "resnet": ("resnet18", {"layers": [1, 1, 1, 1]}),
}
TIMM_MEAN, TIMM_STD = [0.4, 0.45, 0.5], [0.2, 0.25, 0.3]  # not ViT's 0.5 default: the run must read them
TIMM_BLOCK = {"vit": "Block", "resnet": "BasicBlock"}


def timm_checkpoint(kind: str, folder: Path) -> Path:
    # timm imports torchvision, which PyPI ships for CUDA torch only: these run on the GPU machine (docs/usage.md)
    timm = pytest.importorskip(
        "timm", reason="timm (with torchvision) does not import here: the GPU machine runs these"
    )
    architecture, model_args = TIMM[kind]
    data = {"input_size": [3, 32, 32], "crop_pct": 1.0, "interpolation": "bicubic", "mean": TIMM_MEAN, "std": TIMM_STD}
    if kind == "vit":  # timm's Hub layout, written here: timm >= 1.0.2x's save_for_hf records num_classes in
        import json  # model_args, which TimmWrapper (transformers 5.24) passes to create_model a second time

        from safetensors.torch import save_file

        model = timm.create_model(architecture, pretrained=False, num_classes=7, **model_args)
        folder.mkdir()
        save_file(model.state_dict(), folder / "model.safetensors")
        config = {"architecture": architecture, "num_classes": 7, "num_features": model.num_features,
                  "model_args": model_args, "pretrained_cfg": {**data, "classifier": "head"}}  # fmt: skip
        (folder / "config.json").write_text(json.dumps(config))
    else:
        from transformers import TimmWrapperConfig, TimmWrapperForImageClassification

        config = TimmWrapperConfig(architecture=architecture, model_args=model_args, num_labels=7,
                                   pretrained_cfg={**data, "classifier": "fc"})  # fmt: skip
        TimmWrapperForImageClassification(config).save_pretrained(folder)
    return folder


def timm_weights(folder: Path) -> dict:
    """The saved tensors by timm's own names (the wrapper's prefix, where written, taken off)."""
    from safetensors.torch import load_file

    return {k.removeprefix("timm_model."): v for k, v in load_file(folder / "model.safetensors").items()}


@pytest.mark.parametrize("kind", TIMM)
def test_a_timm_checkpoint_trains_saves_and_reloads_with_pipeline(
    kind, cifar_like, predict_folder, tmp_path, run_script
):
    """Input size and mean/std come from timm's pretrained_cfg (TimmWrapperImageProcessor's data_config), the 7-label
    head becomes a 100-label one, and the saved config.json tells pipeline() (which reads a timm checkpoint's
    preprocessing from there) what the run's evaluation did."""
    import json

    import torch
    from transformers import pipeline

    torch.manual_seed(0)
    source = timm_checkpoint(kind, tmp_path / kind)
    out = tmp_path / "out"
    results = train_and_predict(run_script, cifar_like, source, out, predict_folder)
    assert "test_accuracy" in results and results["train_loss"] > 0
    saved = json.loads((out / "config.json").read_text())
    assert saved["num_classes"] == 100 and saved["label_names"][:2] == ["class_0", "class_1"]
    preprocessing = {k: saved["pretrained_cfg"][k] for k in ("input_size", "crop_pct", "mean", "std")}
    assert preprocessing == {"input_size": [3, 32, 32], "crop_pct": 1.0, "mean": TIMM_MEAN, "std": TIMM_STD}
    processor = json.loads((out / "preprocessor_config.json").read_text())
    assert (processor["image_mean"], processor["crop_size"]) == (TIMM_MEAN, {"height": 32, "width": 32})
    head = timm_weights(out)["head.weight" if kind == "vit" else "fc.weight"]
    assert head.shape[0] == 100
    with open(out / "predictions.csv") as f:
        ours = {row["file"]: row for row in csv.DictReader(f)}
    classify = pipeline("image-classification", model=str(out), device="cpu")
    assert type(classify.image_processor).__name__ == "TimmWrapperImageProcessor"
    for name, row in ours.items():
        best = classify(str(predict_folder / name), top_k=1)[0]
        assert (best["label"], best["score"]) == (row["label"], pytest.approx(float(row["score"]), abs=1e-4)), name


@pytest.mark.parametrize("kind", TIMM)
def test_a_timm_checkpoints_head_alone_trains_on_its_own_backbone_and_lora_adapts_timm_attention(
    kind, cifar_like, tmp_path, run_script
):
    """--freeze_backbone finds the classifier inside the wrapped timm model (the wrapper has no head of its own): the
    backbone saved is the checkpoint's, unchanged. LoRA's default targets are timm's fused qkv on the ViT; the ResNet
    has none and the refusal lists its layers."""
    from vit_recipes.core.errors import RecipeError

    source = timm_checkpoint(kind, tmp_path / kind)
    common = ("--dataset_name", cifar_like, "--model_name_or_path", source, "--do_train", "true", "--max_steps", "2",
              "--per_device_train_batch_size", "8", "--learning_rate", "0.1", *FAST_ARGS, "--plots", "false")  # fmt: skip
    results = run_script(*common, "--output_dir", tmp_path / "head", "--freeze_backbone", "true")
    before, after = timm_weights(source), timm_weights(tmp_path / "head")
    head = "head." if kind == "vit" else "fc."
    weights = [k for k in before if not k.startswith(head) and "running_" not in k and "batches" not in k]
    assert weights and set(weights) < set(after)  # BatchNorm's running statistics (ResNet) update in training
    backbone = weights
    assert all(torch_equal(before[k], after[k]) for k in backbone)
    assert results["train_trainable_params"] == sum(v.numel() for k, v in after.items() if k.startswith(head))
    if kind == "resnet":
        with pytest.raises(RecipeError, match="no attention query/value projections.*conv1"):
            run_script(*common, "--output_dir", tmp_path / "lora", "--use_peft", "true")
        return
    results = run_script(*common, "--output_dir", tmp_path / "lora", "--use_peft", "true")
    assert 0 < results["train_trainable_params"] < results["train_total_params"]


def torch_equal(a, b) -> bool:
    import torch

    return torch.equal(a, b)


@pytest.mark.parametrize("kind", TIMM)
def test_timm_refusals_and_sizes(kind, cifar_like, tmp_path, run_script, monkeypatch):
    """One line each, before any data: an attention implementation (timm picks its own; transformers only warns),
    --patch_dropout (naming timm's own patch_drop_rate); --gradient_checkpointing is not refused (timm checkpoints its
    blocks); FSDP's default wrap list (the wrapper's _no_split_modules names a class it does not hold) names timm's
    block class; the advisor and the FLOP count size the model."""
    import types

    from transformers import AutoConfig, AutoModelForImageClassification

    from vit_recipes.core.errors import RecipeError
    from vit_recipes.model.facts import model_size
    from vit_recipes.model.flops import forward_flops
    from vit_recipes.plan.checks import check_fsdp_wrap
    from vit_recipes.plan.plan import read_strategy

    source = timm_checkpoint(kind, tmp_path / kind)
    common = ("--dataset_name", tmp_path / "no_data_yet", "--model_name_or_path", source, "--output_dir",
              tmp_path / "out", "--do_train", "true", *FAST_ARGS)  # fmt: skip
    with pytest.raises(RecipeError, match="--attn_implementation eager: timm models pick their own attention"):
        run_script(*common[2:], "--dataset_name", cifar_like, "--attn_implementation", "eager")  # the model's build
    with pytest.raises(
        RecipeError, match="TimmWrapperForImageClassification has none: drop --patch_dropout .*patch_drop_rate"
    ):
        run_script(*common, "--patch_dropout", "0.5")
    with pytest.raises(RecipeError) as no_data:  # past the model checks: the missing dataset stops it
        run_script(*common, "--gradient_checkpointing", "true")
    assert "no_data_yet" in str(no_data.value) and "checkpointing" not in str(no_data.value)
    model = AutoModelForImageClassification.from_pretrained(source)
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.delenv("FSDP_TRANSFORMER_CLS_TO_WRAP", raising=False)
    with pytest.raises(RecipeError, match=rf"_no_split_modules .* names TimmWrapperModel, .* \({TIMM_BLOCK[kind]}\)"):
        check_fsdp_wrap(read_strategy(types.SimpleNamespace(world_size=2)), model)
    monkeypatch.setenv("FSDP_TRANSFORMER_CLS_TO_WRAP", TIMM_BLOCK[kind])
    check_fsdp_wrap(read_strategy(types.SimpleNamespace(world_size=2)), model)
    config = AutoConfig.from_pretrained(source)
    params, largest = model_size(config)
    assert params == sum(p.numel() for p in model.parameters()) and 0 < largest < params
    assert forward_flops(config, image_size=32) > 2 * params

"""--patch_dropout: training forwards keep a random subset of patch tokens, evaluation sees every patch."""

import pytest
import torch
from conftest import tiny_vit_config

from vit_recipes.core.errors import RecipeError
from vit_recipes.model.patch_dropout import add_patch_dropout, keep_patches


def tiny_model(seed: int = 0):
    from transformers import ViTForImageClassification

    torch.manual_seed(seed)
    return ViTForImageClassification(tiny_vit_config())  # 16x16 images, 4x4 patches: 16 patches + [CLS]


def encoder_lengths(model, pixels) -> list[int]:
    """The sequence length the first encoder layer sees, per forward."""
    seen = []
    first = next(m for m in model.modules() if type(m).__name__ == "ViTLayer")
    first.register_forward_pre_hook(lambda module, args: seen.append(args[0].shape[1]))
    model(pixel_values=pixels)
    return seen


def test_keep_patches_keeps_the_cls_token_and_draws_distinct_patches_per_image():
    torch.manual_seed(0)
    tokens = torch.arange(17, dtype=torch.float32).view(1, 17, 1).expand(2, 17, 3)  # two identical images
    kept = keep_patches(tokens, prefix=1, keep=8)
    assert kept.shape == (2, 9, 3) and kept[:, 0, 0].tolist() == [0, 0]  # [CLS] first, always
    drawn = [set(kept[image, 1:, 0].tolist()) for image in range(2)]
    assert all(len(ids) == 8 and ids <= set(range(1, 17)) for ids in drawn)
    assert drawn[0] != drawn[1]  # each image draws its own patches


@pytest.mark.parametrize("rate, keep", [(0.25, 12), (0.5, 8), (0.9, 2)])
def test_training_sees_fewer_tokens_and_evaluation_every_patch(rate, keep):
    model, plain = tiny_model(), tiny_model()
    assert add_patch_dropout(model, rate) == keep
    pixels = torch.randn(4, 3, 16, 16)
    model.train()
    assert encoder_lengths(model, pixels) == [1 + keep]
    model.eval()
    assert encoder_lengths(model, pixels) == [17]
    plain.eval()
    with torch.no_grad():  # evaluation is untouched: the same logits as the model without patch dropout
        torch.testing.assert_close(model(pixel_values=pixels).logits, plain(pixel_values=pixels).logits)


def test_training_with_patch_dropout_backpropagates_through_lora():
    from vit_recipes.core.arguments import LoraArguments
    from vit_recipes.model.lora import apply_lora

    model, _ = apply_lora(tiny_model(), LoraArguments(use_peft=True))
    add_patch_dropout(model, 0.5)
    model.train()
    loss = torch.nn.functional.cross_entropy(model(pixel_values=torch.randn(4, 3, 16, 16)).logits, torch.arange(4))
    loss.backward()
    grads = [p.grad for n, p in model.named_parameters() if "lora_B" in n]  # lora_A: B starts at 0
    assert grads and all(g is not None and g.abs().sum() > 0 for g in grads)


def test_rate_zero_changes_nothing_and_a_model_without_cls_token_is_refused():
    from transformers import ResNetConfig, ResNetForImageClassification

    model = tiny_model()
    assert add_patch_dropout(model, 0.0) == 0 and not model.vit.embeddings._forward_hooks
    resnet = ResNetForImageClassification(ResNetConfig(embedding_size=8, hidden_sizes=[8], depths=[1], num_labels=3))
    with pytest.raises(RecipeError, match=r"--patch_dropout needs a ViT-style model .* ResNetForImageClassification"):
        add_patch_dropout(resnet, 0.5)


def test_rate_outside_zero_to_one_is_one_line():
    from vit_recipes.core.arguments import parse_args

    with pytest.raises(RecipeError, match=r"patch_dropout must be in \[0, 1\), got 1.0"):
        parse_args(["--dataset_name", "x", "--output_dir", "o", "--use_cpu", "true", "--patch_dropout", "1"])


@pytest.mark.slow
def test_a_run_with_patch_dropout_trains_evaluates_and_says_so_reading_the_config_once(
    cifar_like, tiny_vit, tmp_path, run_script, capsys, monkeypatch
):
    """The model's config is read once a run, by the plan (vit_recipes.model.facts.ModelFacts): the memory estimate, the
    family check that --patch_dropout asks for and the model's building each read it again before."""
    from conftest import run_args
    from transformers import AutoConfig

    out, read, from_pretrained = tmp_path / "run", [], AutoConfig.from_pretrained
    monkeypatch.setattr(
        AutoConfig, "from_pretrained", lambda name, **kw: read.append(name) or from_pretrained(name, **kw)
    )
    results = run_script(*run_args(cifar_like, tiny_vit, out, "--max_steps", "4", "--patch_dropout", "0.5"))
    assert read == [str(tiny_vit)]
    assert results["train_loss"] > 0 and "eval_accuracy" in results
    assert "--patch_dropout 0.5: training images keep 8 of 16 patches; evaluation sees all" in capsys.readouterr().out
    assert "| patch_dropout | 0.5 |" in (out / "README.md").read_text()

import pytest
import torch
from conftest import model_args

from vit_recipes.core.errors import RecipeError
from vit_recipes.model.modeling import build_model, evaluation_processor, mean_std


def test_pretrained_head_is_replaced_with_one_log_line(tiny_vit, caplog):
    caplog.set_level("INFO", logger="vit_recipes.model.modeling")
    model, image_size = build_model(model_args(model_name_or_path=str(tiny_vit)), ["a", "b", "c"])
    assert image_size == 16
    assert model.classifier.out_features == 3
    assert model.config.id2label == {0: "a", 1: "b", 2: "c"} and model.config.label2id["c"] == 2
    assert model.config._attn_implementation == "sdpa_direct"  # auto, for ViT: SDPA called directly
    heads = [r.getMessage() for r in caplog.records if "classification head" in r.getMessage()]
    assert heads == [f"Replacing the classification head: {tiny_vit} has 7 labels, this dataset 3"]
    # the backbone weights really came from the checkpoint
    from transformers import ViTForImageClassification

    original = ViTForImageClassification.from_pretrained(tiny_vit)
    assert torch.equal(
        model.vit.embeddings.patch_embeddings.projection.weight,
        original.vit.embeddings.patch_embeddings.projection.weight,
    )


def test_from_scratch_with_overrides():
    model, image_size = build_model(
        model_args(
            config_name="vit",
            config_overrides="image_size=32,patch_size=8,hidden_size=48,"
            "num_hidden_layers=1,num_attention_heads=2,intermediate_size=96",
        ),
        ["x", "y"],
    )
    assert image_size == 32 and model.config.hidden_size == 48 and model.config.num_labels == 2


def test_image_size_must_divide_by_patch_size():
    with pytest.raises(RecipeError, match="image_size 30 is not divisible by patch_size 8"):
        build_model(model_args(config_name="vit", config_overrides="image_size=30,patch_size=8"), ["x", "y"])


def test_not_an_image_classification_checkpoint(tmp_path):
    from transformers import BertConfig

    BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64).save_pretrained(
        tmp_path
    )
    with pytest.raises(RecipeError, match="is a bert model, not an image-classification one"):
        build_model(model_args(model_name_or_path=str(tmp_path)), ["x", "y"])
    with pytest.raises(RecipeError, match="^model path not found: .*missing$"):
        build_model(model_args(model_name_or_path=str(tmp_path / "missing")), ["x", "y"])


@pytest.mark.parametrize(
    ("flag", "what"),
    [("--model_name_or_path", "model"), ("--config_name", "config"), ("--image_processor_name", "image processor")],
)
def test_a_model_path_that_does_not_exist_is_named_before_any_data(flag, what, tiny_vit, tmp_path, run_script):
    """/abs/path/missing ended in the Hub client's "Repo id must be in the form 'repo_name' or
    'namespace/repo_name'"; a missing --image_processor_name was dropped without a word (mean/std 0.5)."""
    from conftest import FAST_ARGS

    missing = str(tmp_path / "no" / "such" / "folder")
    argv = ["--dataset_name", tmp_path / "no-data-either", "--output_dir", tmp_path / "out", "--do_train", "true"]
    argv += ["--model_name_or_path", "null" if flag == "--config_name" else tiny_vit, flag, missing]
    with pytest.raises(RecipeError) as caught:
        run_script(*argv, *FAST_ARGS)
    assert str(caught.value) == f"{what} path not found: {missing}"  # before the (missing) dataset is read


class _RunsCode:
    def __reduce__(self):
        return (print, ("this must never run",))


def test_a_pickle_checkpoint_never_runs_and_a_truncated_one_is_named(tiny_vit, tmp_path, capsys):
    import shutil

    import torch

    pickled = tmp_path / "pickled"
    shutil.copytree(tiny_vit, pickled)
    (pickled / "model.safetensors").unlink()
    torch.save({"x": _RunsCode()}, pickled / "pytorch_model.bin")
    with pytest.raises(RecipeError) as caught:
        build_model(model_args(model_name_or_path=str(pickled)), ["x", "y"])
    weights = pickled / "pytorch_model.bin"
    assert str(caught.value) == (
        f"the pytorch_model.bin of '{pickled}' is a pickle holding more than weights, and pickles are only loaded as "
        'plain weights: if you trust its source, convert it to safetensors once: python -c "import torch; from '
        f"safetensors.torch import save_file; save_file(torch.load('{weights}', weights_only=False), "
        f"'{pickled / 'model.safetensors'}')\""
    )
    assert "this must never run" not in capsys.readouterr().out
    truncated = tmp_path / "truncated"
    shutil.copytree(tiny_vit, truncated)
    (truncated / "model.safetensors").write_bytes((tiny_vit / "model.safetensors").read_bytes()[:300])
    with pytest.raises(RecipeError, match=r"cannot read the weights of '.*truncated': .*header"):
        build_model(model_args(model_name_or_path=str(truncated)), ["x", "y"])


def test_mean_std_and_saved_processor(tiny_vit, tmp_path):
    assert mean_std(model_args(model_name_or_path=str(tiny_vit))) == ((0.5,) * 3, (0.5,) * 3)
    processor = evaluation_processor(224, 0.875, (0.1, 0.2, 0.3), (0.4, 0.5, 0.6))
    processor.save_pretrained(tmp_path)
    from transformers import AutoImageProcessor

    loaded = AutoImageProcessor.from_pretrained(tmp_path)
    assert loaded.size == {"shortest_edge": 256} and loaded.crop_size == {"height": 224, "width": 224}
    assert list(loaded.image_mean) == [0.1, 0.2, 0.3]


def test_a_hidden_size_the_head_count_does_not_divide_is_refused():
    """ViT built it with a narrower attention (hidden 96, 5 heads: query 95 x 96) and trained without a word."""
    from transformers import ViTConfig

    from vit_recipes.core.errors import RecipeError
    from vit_recipes.model.modeling import check_config

    config = ViTConfig(hidden_size=96, num_attention_heads=5, image_size=32, patch_size=4)
    with pytest.raises(
        RecipeError, match=r"^hidden_size 96 is not divisible by num_attention_heads 5: .*\(e\.g\. 4\)"
    ):
        check_config(config, "vit")


def test_config_overrides_next_to_a_checkpoint_say_they_are_ignored(tiny_vit, caplog):
    from types import SimpleNamespace

    from vit_recipes.model.facts import config_from_args

    args = SimpleNamespace(model_name_or_path=str(tiny_vit), config_overrides="image_size=64,patch_size=8",
                           cache_dir=None, model_revision="main")  # fmt: skip
    with caplog.at_level("WARNING"):
        config, pretrained = config_from_args(args)
        config_from_args(args)  # once a process (a run reads the config once, in its plan): said once
    assert pretrained and config.image_size != 64
    assert caplog.text.count("--config_overrides (image_size=64,patch_size=8) is ignored") == 1

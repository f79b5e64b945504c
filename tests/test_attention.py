"""`--attn_implementation sdpa_direct` (vit_recipes/model/attention.py): the same logits and gradients as transformers'
own SDPA for every family that looks its attention up in transformers' AttentionInterface, without taking
transformers' function; checkpoints trained with it load in plain transformers."""

import copy

import pytest
import torch
from conftest import model_args, tiny_vit_config

from vit_recipes.core.errors import RecipeError
from vit_recipes.model import attention
from vit_recipes.model.classifiers import classifier_class
from vit_recipes.model.modeling import attention_for, build_model

VIT_LIKE = dict(hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32, num_labels=3)


def tiny_config(family: str):
    import transformers as tf

    if family == "vit":
        return tiny_vit_config(num_labels=3)
    if family == "deit":
        return tf.DeiTConfig(image_size=16, patch_size=4, **VIT_LIKE)
    if family == "dinov2":
        return tf.Dinov2Config(image_size=16, patch_size=4, **VIT_LIKE)
    if family == "swin":  # an additive mask (relative position bias and shifted windows) goes to SDPA as it is
        return tf.SwinConfig(image_size=16, patch_size=2, embed_dim=8, depths=[2, 1], num_heads=[2, 2], window_size=4, drop_path_rate=0.0,
                             num_labels=3)  # fmt: skip
    raise ValueError(family)


def logits_and_grads(model, pixels, labels, dtype):
    model = model.to(dtype).train()  # training: the path the recipe speeds up (dropout rates are 0 here)
    model.zero_grad()
    logits = model(pixel_values=pixels.to(dtype)).logits
    torch.nn.functional.cross_entropy(logits.float(), labels).backward()
    return logits.detach().float(), {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("family", ["vit", "deit", "dinov2", "swin"])
def test_sdpa_direct_gives_transformers_sdpa_logits_and_gradients(family, dtype, monkeypatch):
    config = tiny_config(family)
    torch.manual_seed(0)
    # A config each: a model keeps the config object it was built from, and its attention is a field of it.
    reference = classifier_class(config)._from_config(copy.deepcopy(config), attn_implementation="sdpa")
    direct = classifier_class(config)._from_config(copy.deepcopy(config), attn_implementation=attention.NAME)
    direct.load_state_dict(reference.state_dict())
    assert (reference.config._attn_implementation, direct.config._attn_implementation) == ("sdpa", attention.NAME)
    pixels, labels = torch.randn(4, 3, 16, 16), torch.tensor([0, 1, 2, 1])
    expected, expected_grads = logits_and_grads(reference, pixels, labels, dtype)

    def not_here(*args, **kwargs):
        raise AssertionError("an image encoder's attention went to transformers' own SDPA function")

    monkeypatch.setattr(attention, "sdpa_attention_forward", not_here)
    logits, grads = logits_and_grads(direct, pixels, labels, dtype)
    tolerance = dict(atol=1e-5, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(logits, expected, **tolerance)
    assert grads.keys() == expected_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected_grads[name], **tolerance, msg=name)


def test_what_an_image_encoder_never_passes_goes_to_transformers_own_function(monkeypatch):
    """A causal module or grouped key/value heads (language models): transformers' function handles them."""
    calls = []
    monkeypatch.setattr(attention, "sdpa_attention_forward", lambda *a, **k: calls.append(k) or ("theirs", None))
    module = torch.nn.Module()
    q = torch.randn(1, 4, 3, 8)
    module.is_causal = True
    assert attention.sdpa_direct(module, q, q, q, None)[0] == "theirs"
    module.is_causal = False
    assert attention.sdpa_direct(module, q, q[:, :2], q[:, :2], None)[0] == "theirs"  # 4 query heads, 2 key heads
    out, weights = attention.sdpa_direct(module, q, q, q, None, scaling=0.5)
    assert len(calls) == 2 and out.shape == (1, 3, 4, 8) and weights is None
    expected = torch.nn.functional.scaled_dot_product_attention(q, q, q, scale=0.5).transpose(1, 2)
    torch.testing.assert_close(out, expected)


def test_a_layer_with_sdpa_direct_compiles_as_one_graph():
    from transformers import ViTForImageClassification

    model = ViTForImageClassification._from_config(tiny_vit_config(), attn_implementation=attention.NAME)
    layer = next(m for m in model.modules() if type(m).__name__ == "ViTLayer")  # its place differs by version
    torch._dynamo.reset()  # an earlier test's failing compile leaves ViTLayer.forward marked as skipped
    layer = torch.compile(layer, backend="eager", fullgraph=True)  # a graph break raises
    hidden = torch.randn(2, 17, 32, requires_grad=True)
    layer(hidden).sum().backward()
    assert hidden.grad is not None


def test_a_model_trained_with_sdpa_direct_loads_in_plain_transformers(tmp_path):
    from transformers import AutoModelForImageClassification

    torch.manual_seed(0)
    args = model_args(config_name="vit", config_overrides="image_size=16,patch_size=4,hidden_size=16,"
                      "num_hidden_layers=1,num_attention_heads=2,intermediate_size=32", attn_implementation="sdpa_direct")  # fmt: skip
    model, _ = build_model(args, ["a", "b"])
    assert model.config._attn_implementation == "sdpa_direct"
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    pixels = torch.randn(4, 3, 16, 16)
    model(pixel_values=pixels, labels=torch.tensor([0, 1, 1, 0])).loss.backward()
    optimizer.step()
    model.save_pretrained(tmp_path)
    assert "sdpa_direct" not in (tmp_path / "config.json").read_text()  # transformers saves no attention choice
    plain = AutoModelForImageClassification.from_pretrained(tmp_path, attn_implementation="sdpa").eval()
    with torch.no_grad():
        torch.testing.assert_close(plain(pixel_values=pixels).logits, model.eval()(pixel_values=pixels).logits)


def test_sdpa_direct_on_a_class_without_sdpa_is_one_line():
    from transformers import ConvNextConfig

    config = ConvNextConfig(depths=[1, 1, 1, 1], hidden_sizes=[8, 16, 16, 16], image_size=32)
    with pytest.raises(RecipeError, match=r"^ConvNextForImageClassification has no SDPA attention: drop --attn_impl"):
        attention_for(config, "sdpa_direct")


def test_the_compile_caches_key_tells_the_attention_apart(monkeypatch):
    """Compiled artifacts of one attention are no warm cache for the other: the key (plan.compile_key) differs."""
    from types import SimpleNamespace

    from vit_recipes.plan import plan

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "a GPU")  # the key names the GPU it compiled for
    training = SimpleNamespace(per_device_train_batch_size=8, per_device_eval_batch_size=8, tf32=None,
                               gradient_checkpointing=False, torch_compile_mode=None, fp8=False)  # fmt: skip
    run_args = SimpleNamespace(training=training, augment=SimpleNamespace(patch_dropout=0.0))
    run = SimpleNamespace(precision="bf16", strategy=SimpleNamespace(name="single"), device="cuda")
    args = model_args(config_name="vit", config_overrides="image_size=16,patch_size=4,hidden_size=16,"
                      "num_hidden_layers=1,num_attention_heads=2,intermediate_size=32", attn_implementation="sdpa")  # fmt: skip
    model, _ = build_model(args, ["a", "b"])
    sdpa = plan.compile_key(run, run_args, model)
    model.config._attn_implementation = attention.NAME
    assert plan.compile_key(run, run_args, model) != sdpa


def test_auto_calls_sdpa_directly_for_exactly_the_families_tested_equal_and_leaves_others_to_transformers(caplog):
    """The default: sdpa_direct for the families whose logits and gradients the test above holds equal to
    transformers' SDPA; any other family keeps transformers' pick (SDPA, else eager)."""
    import transformers as tf

    from vit_recipes.model.modeling import DIRECT_ATTENTION_FAMILIES, attention_for

    tested = test_sdpa_direct_gives_transformers_sdpa_logits_and_gradients.pytestmark
    families = next(mark.args[1] for mark in tested if mark.args[0] == "family")
    assert set(DIRECT_ATTENTION_FAMILIES) == set(families)
    caplog.set_level("INFO", logger="vit_recipes.model.modeling")
    for family in families:
        assert attention_for(tiny_config(family), "auto") == attention.NAME
    assert "Attention: sdpa_direct (SDPA called directly: same results" in caplog.text
    beit = tf.BeitConfig(image_size=16, patch_size=4, **VIT_LIKE)
    convnext = tf.ConvNextConfig(num_channels=3, hidden_sizes=[8, 16], depths=[1, 1], num_labels=3)
    assert attention_for(beit, "auto") is None and attention_for(convnext, "auto") is None
    assert attention_for(tiny_config("vit"), "sdpa") == "sdpa"  # asked for: kept

"""The memory advisor (tools/advise.py, on vit_recipes/plan/memory.py) against figures computed by hand for a small ViT."""

import importlib.util
import sys

import pytest
from conftest import ROOT
from transformers import ViTConfig

from vit_recipes.plan.memory import activation_bytes, estimate, model_shape

_spec = importlib.util.spec_from_file_location("advise", ROOT / "tools" / "advise.py")
advise = sys.modules["advise"] = importlib.util.module_from_spec(_spec)  # dataclasses look their module up
_spec.loader.exec_module(advise)

# hidden 64, 2 layers, 4 heads, MLP 256, 32 px in 8 px patches (16 patches + CLS = 17 tokens), 10 classes
CONFIG = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=256,
    image_size=32,
    patch_size=8,
    num_labels=10,
)
# Parameters by hand: patch conv 3*8*8*64 + 64 = 12352; CLS 64; positions 17*64 = 1088;
# per layer: QKV 3*(64*64 + 64) = 12480, attention output 64*64 + 64 = 4160, 2 LayerNorms 256,
# MLP 64*256 + 256 = 16640 and 256*64 + 64 = 16448 -> 49984 (the largest layer); final LayerNorm 128;
# classifier 64*10 + 10 = 650.
P = 12352 + 64 + 1088 + 2 * 49984 + 128 + 650  # 114250
LAYER = 49984


@pytest.fixture(scope="module")
def shape():
    return model_shape(ViTConfig(**CONFIG))


def test_shape_from_the_config_on_the_meta_device(shape):
    assert P == 114250
    assert shape.params == P
    assert shape.largest_layer_params == LAYER
    assert shape.tokens == 17


def test_activations_by_hand(shape):
    b, s, h, i, a, e = 4, 17, 64, 256, 4, 2  # batch 4, bf16
    per_layer = s * b * (8 * h + 2 * i) * e + 4 * b * a * s  # 139264 + 1088 (SDPA's logsumexp, fp32)
    once = b * 3 * 32 * 32 * e + s * b * h * e + b * (h + 2 * 10) * 4  # pixels, final LayerNorm, logits
    assert activation_bytes(shape, 4, "bf16") == 2 * per_layer + once == 315328
    assert activation_bytes(shape, 4, "bf16", checkpointing=True) == 2 * s * b * h * e + per_layer + once == 192384
    eager_layer = s * b * (8 * h + 2 * i) * e + b * a * s * s * e  # the attention probabilities are kept
    assert activation_bytes(shape, 4, "bf16", attention="eager") == 2 * eager_layer + once
    assert activation_bytes(shape, 4, "fp32") == 2 * (2 * s * b * (8 * h + 2 * i) * e + 4 * b * a * s) + (
        b * 3 * 32 * 32 * 4 + s * b * h * 4 + b * (h + 20) * 4
    )


def test_model_states_per_gpu_by_hand(shape):
    n = 4  # GPUs on one node, bf16
    got = {e.strategy.name: (e.params, e.grads, e.optimizer, e.host_per_node) for e in estimate(shape, n, 4)}
    expected = {
        # accelerate: fp32 weights, fp32 + 16-bit gradients, Adam moments
        "ddp": (4 * P, 6 * P, 8 * P, 0),
        # DeepSpeed's torch_autocast (the shipped ZeRO configs): fp32 params (ZeRO-3: own partition + two gathered
        # layers; ZeRO++: + hpZ's copy within the node); fp32 gradients; fp32 master + moments partitioned
        "zero1": (4 * P, 4 * P, 12 * P / n, 0),
        "zero2": (4 * P, 4 * P / n, 12 * P / n, 0),
        "zero3": (4 * P / n + 8 * LAYER, 4 * P / n, 12 * P / n, 0),
        "zeropp": (4 * P / n + 8 * LAYER + 4 * P / n, 4 * P / n, 12 * P / n, 0),
        # the offload configs, in DeepSpeed's bf16 mode: DeepSpeed's estimators (16-bit weights on the GPU)
        "zero2_offload": (2 * P, 0, 0, P * 16 * 1.5),
        "zero3_offload": (4 * LAYER, 0, 0, P * 18 * 1.5),
        # FSDP2: accelerate's DDP figures sharded, plus two unsharded 16-bit layers in flight
        "fsdp2": (4 * P / n + 4 * LAYER, 6 * P / n, 8 * P / n, 0),
        "fsdp2_offload": (4 * LAYER, 2 * LAYER, 0, 16 * P * 1.5),
    }
    assert set(got) == set(expected)
    for key, values in expected.items():
        assert got[key] == pytest.approx(values, abs=1), key


def test_totals_agree_with_deepspeeds_estimators(shape):
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    got = {e.strategy.name: e for e in estimate(shape, 8, 4, nodes=2)}  # the 16-bit rows: the offload configs
    host2, zero2 = estimate_zero2_model_states_mem_needs(P, 4, 2, cpu_offload=True)
    host3, zero3, _ = estimate_zero3_model_states_mem_needs(P, LAYER, 4, 2, cpu_offload=True, cpu_offload_params=True)
    assert (got["zero2_offload"].states, got["zero2_offload"].host_per_node) == pytest.approx((zero2, host2), abs=1)
    assert (got["zero3_offload"].states, got["zero3_offload"].host_per_node) == pytest.approx((zero3, host3), abs=1)


def test_fits_and_recommendation(shape):
    estimates = estimate(shape, 4, 4, overhead_gib=0)
    by_key = {e.strategy.name: e for e in estimates}
    ddp = by_key["ddp"]
    assert advise.fits(ddp, ddp.total) == "yes"
    assert advise.fits(ddp, ddp.total - 1) == "with ckpt"
    assert advise.fits(ddp, ddp.total_ckpt - 1) == "no"
    pick, ckpt = advise.recommend(estimates, ddp.total)
    assert pick.strategy.name == "ddp" and not ckpt
    zero2 = by_key["zero2"]
    pick, ckpt = advise.recommend(estimates, zero2.total)  # DDP no longer fits, ZeRO-1 neither: ZeRO-2 does
    assert pick.strategy.name == "zero2" and not ckpt
    assert advise.recommend(estimates, 1) is None


def test_cli_with_a_local_config(tmp_path, capsys):
    ViTConfig(**CONFIG).save_pretrained(tmp_path)
    assert advise.main(["--model", str(tmp_path), "--gpus", "4", "--batch", "4", "--gpu-memory", "80"]) == 0
    out = capsys.readouterr().out
    assert "0.1M parameters" in out and "17 tokens" in out
    for label, config in (("ZeRO-3", "accelerate_configs/zero3.yaml"), ("FSDP2", "accelerate_configs/fsdp.yaml")):
        line = next(x for x in out.splitlines() if x.startswith(label + " "))
        assert line.rstrip().endswith(config) and " yes " in line
    assert "Suggested: DDP: accelerate launch --config_file accelerate_configs/ddp.yaml --num_processes 4" in out


def test_uncached_hub_id_offline_is_one_line(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "empty-cache"))
    code = advise.main(["--model", "google/vit-huge-patch14-224-in21k", "--gpus", "4", "--batch", "32"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1
    assert err[0].startswith(
        "error: 'google/vit-huge-patch14-224-in21k' is not in the local Hugging Face cache and HF_HUB_OFFLINE=1"
    )


def test_bad_numbers_are_one_line(tmp_path, capsys):
    ViTConfig(**CONFIG).save_pretrained(tmp_path)
    assert advise.main(["--model", str(tmp_path), "--gpus", "3", "--nodes", "2"]) == 2
    assert capsys.readouterr().err.startswith("error: --gpus 3 must be a positive multiple of --nodes 2")


def test_an_unreachable_hub_id_is_one_line_without_the_downloads_retries(monkeypatch):
    """Offline, the config download retried with backoff (about 25 s) before its error; one API call says it now."""
    import importlib

    import huggingface_hub
    import transformers

    from vit_recipes.core import hub
    from vit_recipes.core.errors import RecipeError
    from vit_recipes.model import facts

    http = importlib.import_module(huggingface_hub.errors.HTTPError.__module__)  # httpx (hub 1.x) or httpx2 (2.x)

    def unreachable(self, *args, **kwargs):
        raise http.ConnectError("[Errno -2] Name or service not known")

    def download(*args, **kwargs):
        raise AssertionError("the retrying download must not start")

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(hub, "offline_env", lambda: False)
    monkeypatch.setattr(huggingface_hub.HfApi, "model_info", unreachable)
    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", download)
    with pytest.raises(RecipeError, match="^could not reach the Hugging Face Hub to download the config of 'org/vit'"):
        facts.load_config("org/vit")

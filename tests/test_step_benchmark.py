"""benchmarks/step.py, the bare training step's variants and the recipe's step in one device call: its CPU smoke
mode records every variant, a failing variant (in this process or in its own) is that variant's error and the suite
goes on, the budget skips, and each recipe run is set against the bare variant it runs."""

import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import step  # noqa: E402


def read(folder: Path) -> dict:
    return json.loads((folder / "step.json").read_text())


def test_the_tiny_suite_records_each_variant_and_a_failing_one_as_its_error(tmp_path, monkeypatch):
    monkeypatch.setenv("BENCH_GIT_COMMIT", "abc1234")
    monkeypatch.setenv(step.FAIL_ENV, "direct-eager")
    chosen = "^(hf-eager|direct-eager|direct-regions-bf16)$"
    assert step.main(["--tiny", "--in-process", "--out", str(tmp_path), "--variants", chosen]) == 0
    record = read(tmp_path)
    assert record["git_commit"] == "abc1234" and record["device"].startswith("CPU")
    assert record["versions"]["torch"] and record["versions"]["transformers"]
    assert record["command"].startswith("python -m benchmarks.step --tiny")
    assert record["settings"]["batches"] == [4] and record["recipe"] == []
    variants = {v["name"]: v for v in record["variants"]}
    assert list(variants) == ["hf-eager", "direct-eager", "direct-regions-bf16"]  # the order of step.VARIANTS
    for name in ("hf-eager", "direct-regions-bf16"):  # after the failure, the suite went on
        (row,) = variants[name]["batches"]
        assert variants[name]["status"] == "ok" and row["status"] == "ok"
        assert row["images_per_second"] > 0 and row["step_ms"] > 0 and row["loss"] > 0 and row["mfu"] is None
        assert variants[name]["flops_per_image"] > 0
    failed = variants["direct-eager"]
    assert failed["status"] == "error" and "BENCH_STEP_FAIL=direct-eager" in failed["error"]
    assert failed["batches"] == [{"batch": 4, "status": "error", "error": failed["error"]}]
    table = (tmp_path / "step.md").read_text()
    assert "| `hf-eager`: HF ViT, eager, autocast" in table and "| `direct-eager`: " in table
    assert 0 < (tmp_path / "step.png").stat().st_size <= 60 * 1024


def test_a_variant_whose_process_fails_is_its_error_and_the_budget_skips(tmp_path, monkeypatch):
    monkeypatch.setenv(step.FAIL_ENV, "hf-eager")  # its process raises before it imports torch
    assert step.main(["--tiny", "--out", str(tmp_path), "--variants", "^hf-eager$"]) == 0
    (variant,) = read(tmp_path)["variants"]
    assert variant["status"] == "error" and variant["error"].startswith("RuntimeError: BENCH_STEP_FAIL=hf-eager")
    assert (tmp_path / "logs" / "hf-eager.log").is_file()
    assert step.main(["--tiny", "--out", str(tmp_path / "b"), "--variants", "^hf-", "--budget", "0"]) == 0
    assert {v["status"] for v in read(tmp_path / "b")["variants"]} == {"skipped"}


def test_a_skipped_variant_writes_why_for_the_suite_that_launched_it(tmp_path):
    result = tmp_path / "ddp-mp-eager.json"  # the file a --worker process leaves for run_worker to read
    step.run_variant(step.BY_NAME["ddp-mp-eager"], [4, 8], 1, 2, True, "eager", result)
    assert [row["status"] for row in json.loads(result.read_text())["batches"]] == ["skipped", "skipped"]


def test_the_recipe_runs_go_through_the_runner_and_are_set_against_their_bare_variant(tmp_path, monkeypatch):
    commands = []

    def fake_runner(argv, **kwargs):  # benchmarks/run.py's record of each run it was asked for
        commands.append(argv)
        out = Path(argv[argv.index("--out") + 1])
        out.mkdir(parents=True)
        metrics = {"train_images_per_second": 2700.0, "train_mfu": 0.29, "train_step_time_s": 0.0474}
        (out / "b128-compiled.json").write_text(json.dumps({"status": "ok", "per_device_batch": 128,
                                                            "metrics": metrics}))  # fmt: skip

    monkeypatch.setattr(step.subprocess, "run", fake_runner)
    rows = step.run_recipe(["b128-compiled", "b128-eager"], tmp_path, budget=300)
    (argv,) = commands
    assert argv[2:4] == ["benchmarks.run", "benchmarks/suites/step.yaml"]
    assert argv[argv.index("--only") + 1] == "^(b128\\-compiled|b128\\-eager)$" and "300" in argv
    assert rows[0]["images_per_second"] == 2700.0 and rows[0]["step_ms"] == 47.4
    assert rows[1]["status"] == "failed" and rows[1]["error"] == "no record"
    bare = [{"name": name, "batches": [{"batch": 128, "status": "ok", "images_per_second": ips}]}
            for name, ips in (("hf-regions", 3000.0), ("fused-whole-bf16", 3600.0))]  # fmt: skip
    record = {"variants": bare, "recipe": rows}
    (line,) = step.compare(record)
    assert rows[0]["of_bare"] == 0.9 and rows[0]["of_best_bare"] == 0.75
    assert line == "- `recipe-b128-compiled`: 2,700 img/s, 90% of `hf-regions`, 75% of the best bare variant at " \
                   "batch 128 (`fused-whole-bf16`)"  # fmt: skip


@pytest.mark.parametrize(("name", "bare"), [("b128-compiled-500", "hf-regions"), ("b128-eager-direct", "direct-eager"),
                                            ("b256-compiled-direct", "direct-regions"),
                                            ("b128-fsdp2-compiled-500", "fsdp2-mp-regions")])  # fmt: skip
def test_each_recipe_run_names_a_bare_variant_of_the_suite(name, bare):
    assert step.bare_for(name) == bare and bare in step.BY_NAME
    assert name in step.recipe_runs()
    assert step.row_name(f"recipe-{name}") == f"recipe-{name}".replace("-b128", "").replace("-b256", "").removesuffix(
        "-500"
    )


def test_the_seeded_runs_loss_curves_are_compared_window_by_window_against_the_default(tmp_path):
    """The numerics: each 500-step run's 50-step window means against the default's, within the stated 2%."""
    base = [[s, 4.0 - s / 1000] for s in range(10, 510, 10)]
    close = [[s, loss * 1.01] for s, loss in base]  # 1% off everywhere
    apart = [[s, loss * (1.05 if s > 450 else 1.0)] for s, loss in base]  # 5% off in the last window only
    rows = [{"name": name, "status": "ok", "batch": 128, "loss_curve": curve}
            for name, curve in ((step.NUMERICS_BASELINE, base), ("recipe-b128-compiled-direct-500", close),
                                ("recipe-b128-fsdp2-compiled-500", apart), ("recipe-b256-compiled", None))]  # fmt: skip
    record = {"recipe": rows, "device": "test"}
    lines = step.numerics(record)
    close_row, apart_row = record["numerics"]["runs"]
    assert close_row["within"] and close_row["worst_rel_diff"] == pytest.approx(0.01, abs=1e-4)
    assert not apart_row["within"] and apart_row["worst_window_end"] == 500 and apart_row["windows"] == 10
    assert "within the 2% tolerance" in lines[0] and "**outside** the 2% tolerance" in lines[1]
    assert step.loss_chart(record, tmp_path / "loss.png") and (tmp_path / "loss.png").stat().st_size > 0
    assert step.window_means([[10, 1.0], [20, 3.0], [60, 5.0]], 50) == {50: 2.0, 100: 5.0}


def test_the_list_runs_the_core_variants_then_the_recipe_then_the_rest(capsys):
    assert step.main(["--list"]) == 0
    names = [line.split()[0] for line in capsys.readouterr().out.splitlines()]
    assert names.index("direct-regions") < names.index("recipe-b128-compiled-500") < names.index("fused-whole-bf16")
    assert step.main(["--list", "--no-recipe", "--variants", "regions"]) == 0
    listed = [line.split()[0] for line in capsys.readouterr().out.splitlines()]
    # the recipe left out; the routes to bf16 compute first of the rest, before the whole-model extras
    assert listed == ["hf-regions", "direct-regions", "direct-regions-cudagraphs", "fsdp2-mp-regions",
                      "autocast-bf16-layernorm-regions",
                      "direct-regions-bf16"]  # fmt: skip


def test_the_bf16_compute_routes_record_the_loss_autocast_computes(tmp_path):
    """FSDP2's bf16 compute on fp32 master weights and autocast with bf16 LayerNorms: measured, and the loss of the
    same initial weights on the same batch as autocast's within bf16's tolerance; DDP's route needs a GPU (skipped,
    saying why); the one-rank process group is ended after."""
    new = ["fsdp2-mp-regions", "ddp-mp-eager", "autocast-bf16-layernorm-regions"]
    chosen = "^(hf-eager|" + "|".join(new) + ")$"
    assert step.main(["--tiny", "--in-process", "--out", str(tmp_path), "--variants", chosen]) == 0
    variants = {v["name"]: v for v in read(tmp_path)["variants"]}
    assert list(variants) == ["hf-eager", *new]
    (plain,) = variants["hf-eager"]["batches"]
    for name in ("fsdp2-mp-regions", "autocast-bf16-layernorm-regions"):
        (row,) = variants[name]["batches"]
        assert variants[name]["compile"] == "regions" and row["status"] == "ok" and row["images_per_second"] > 0
        assert "mfu" in row and row["first_loss"] == pytest.approx(plain["first_loss"], abs=5e-3)
        assert row["loss"] == pytest.approx(plain["loss"], abs=5e-3)  # after 2 updates of the fp32 weights
        assert variants[name]["optimizer_dtypes"] == ["float32"]  # the master weights the optimizer updates
    assert variants["fsdp2-mp-regions"]["module"] == "FSDPViTForImageClassification"  # FSDP2 wraps the model
    ddp = variants["ddp-mp-eager"]
    assert ddp["status"] == "skipped" and ddp["error"].startswith("DDP's mixed precision needs a GPU")
    assert not torch.distributed.is_initialized()


def test_fsdp2_keeps_fp32_masters_and_computes_in_bf16_and_the_layernorms_run_in_bf16():
    variant = step.BY_NAME["fsdp2-mp-regions"]
    pixels = torch.randn(2, 3, 32, 32)
    with step.process_group(torch.device("cpu"), True):
        torch.manual_seed(0)
        model, _, _ = step.build(variant, tiny=True)
        wrapped = step.master_weights(model, variant.precision)
        logits = wrapped(pixel_values=pixels).logits
        logits.float().sum().backward()
    assert logits.dtype == torch.bfloat16
    assert {(type(p).__name__, p.dtype, p.grad.dtype) for p in model.parameters()} == {
        ("DTensor", torch.float32, torch.float32)
    }
    model, _, _ = step.build(step.BY_NAME["autocast-bf16-layernorm-regions"], tiny=True)
    step.bf16_layernorms(model)
    norms = [m for m in model.modules() if isinstance(m, torch.nn.LayerNorm)]
    outputs = []
    for norm in norms:
        norm.register_forward_hook(lambda module, args, out: outputs.append(out.dtype))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(pixel_values=pixels)
    assert len(outputs) == len(norms) == 5 and set(outputs) == {torch.bfloat16}  # autocast's: float32
    assert {p.dtype for p in model.parameters()} == {torch.float32}


def test_the_fused_qkv_ceiling_computes_what_transformers_vit_computes():
    """The ceiling is the same model: transformers' weights copied into it give transformers' logits."""
    import torch
    from transformers import ViTConfig, ViTForImageClassification

    config = ViTConfig(image_size=16, patch_size=4, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                       intermediate_size=32, num_labels=3)  # fmt: skip
    torch.manual_seed(0)
    hf, fused = ViTForImageClassification(config).eval(), step.fused_qkv_vit(config).eval()
    linear, norm = torch.nn.Linear, torch.nn.LayerNorm
    layers = [m for m in hf.modules() if type(m).__name__ == "ViTLayer"]
    with torch.no_grad():
        embeddings = hf.vit.embeddings
        fused.embed.weight.copy_(embeddings.patch_embeddings.projection.weight.flatten(1))
        fused.embed.bias.copy_(embeddings.patch_embeddings.projection.bias)
        fused.cls.copy_(embeddings.cls_token)
        fused.pos.copy_(embeddings.position_embeddings)
        for layer, block in zip(layers, fused.blocks, strict=True):
            q, k, v, o, fc1, fc2 = [m for m in layer.modules() if isinstance(m, linear)]  # registration order
            block.norm1.load_state_dict(layer.layernorm_before.state_dict())
            block.norm2.load_state_dict(layer.layernorm_after.state_dict())
            block.qkv.weight.copy_(torch.cat([q.weight, k.weight, v.weight]))
            block.qkv.bias.copy_(torch.cat([q.bias, k.bias, v.bias]))
            for mine, theirs in ((block.proj, o), (block.fc1, fc1), (block.fc2, fc2)):
                mine.load_state_dict(theirs.state_dict())
        fused.norm.load_state_dict(hf.vit.layernorm.state_dict())
        fused.head.load_state_dict(hf.classifier.state_dict())
        assert isinstance(fused.norm, norm)
        pixels = torch.randn(2, 3, 16, 16)
        torch.testing.assert_close(fused(pixels), hf(pixel_values=pixels).logits, atol=1e-5, rtol=1e-4)

"""The run plan (derived once from the arguments and the launch), the strategy table, and `--help`."""

import dataclasses
import json
import os
import types

import pytest
import yaml
from conftest import ROOT

from vit_recipes.core.arguments import ARGUMENT_CLASSES, parse_args
from vit_recipes.plan import strategies
from vit_recipes.plan.plan import build_plan, read_strategy


def strategy_args(deepspeed=None, fsdp="", world_size=1):
    return types.SimpleNamespace(deepspeed=deepspeed, fsdp=fsdp, world_size=world_size)


@pytest.mark.parametrize("stage", [2, 3])
def test_strategy_deepspeed_dict(stage):
    config = {"zero_optimization": {"stage": stage}, "train_batch_size": "auto"}
    assert read_strategy(strategy_args(deepspeed=config, world_size=2)).name == f"zero{stage}"


def test_strategy_deepspeed_json_file(tmp_path):
    path = tmp_path / "ds_zero3.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 3}}))
    assert read_strategy(strategy_args(deepspeed=str(path))).name == "zero3"


def test_strategy_from_accelerate_env(monkeypatch):
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", "2")
    assert read_strategy(strategy_args(world_size=4)).name == "zero2"


def test_strategy_fsdp_ddp_single(monkeypatch):
    for name in ("ACCELERATE_USE_DEEPSPEED", "ACCELERATE_USE_FSDP"):
        monkeypatch.delenv(name, raising=False)
    assert read_strategy(strategy_args(fsdp=["full_shard", "auto_wrap"], world_size=2)).name == "fsdp2"
    assert read_strategy(strategy_args(world_size=2)).name == "ddp"
    assert read_strategy(strategy_args()).name == "single"
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    assert read_strategy(strategy_args(world_size=2)).name == "fsdp2"


@pytest.mark.parametrize("spec", strategies.STRATEGIES, ids=lambda s: s.name)
def test_every_shipped_config_is_the_strategy_its_row_names(spec, monkeypatch):
    """The table's files exist and launch what the row says: its stage, offload and name."""
    if spec.deepspeed_config:
        config = json.loads((ROOT / spec.deepspeed_config).read_text())
        assert config["zero_optimization"]["stage"] == spec.zero_stage
        assert read_strategy(strategy_args(deepspeed=str(ROOT / spec.deepspeed_config), world_size=2)).spec is spec
    if spec.accelerate_config:
        launch = yaml.safe_load((ROOT / spec.accelerate_config).read_text())
        if spec.deepspeed_config:
            assert launch["deepspeed_config"]["deepspeed_config_file"] == spec.deepspeed_config
        if spec.name.startswith("fsdp"):
            assert launch["distributed_type"] == "FSDP"
            assert launch["fsdp_config"]["fsdp_offload_params"] is spec.offload
            monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
            monkeypatch.setenv("FSDP_OFFLOAD_PARAMS", str(spec.offload).lower())
            assert read_strategy(strategy_args(world_size=2)).spec is spec


def test_the_plan_derives_the_global_batch_precision_and_output_state_once(tmp_path):
    args = parse_args(
        ["--dataset_name", "x", "--output_dir", str(tmp_path / "out"), "--use_cpu", "true", "--do_train", "true"]
        + ["--per_device_train_batch_size", "8", "--gradient_accumulation_steps", "3", "--report_to", "none"]
    )
    plan = build_plan(args)
    assert plan.global_batch == 24 and plan.precision == "fp32" and plan.device == "cpu"
    assert plan.strategy.name == "single" and plan.output.state == "fresh" and plan.resume_from is None
    assert plan.identity["dataset_name"] == "x"


def test_regional_compilation_under_zero3_is_refused_by_the_table(tmp_path):
    from vit_recipes.core.errors import RecipeError

    args = parse_args(
        ["--dataset_name", "x", "--output_dir", str(tmp_path), "--use_cpu", "true", "--report_to", "none"]
        + ["--deepspeed", str(ROOT / "ds_configs/zero3.json"), "--torch_compile_regions", "true"]
    )
    with pytest.raises(
        RecipeError, match=r"zero3.json: --torch_compile_regions does not train correctly under ZeRO-3"
    ):
        build_plan(args)


def test_help_exits_0_and_shows_every_argument_group(run_script, capsys):
    with pytest.raises(SystemExit) as done:  # in-process: the script's own main, as `python ... --help` runs it
        run_script("--help")
    assert done.value.code == 0
    shown = capsys.readouterr().out
    for cls in ARGUMENT_CLASSES:
        assert f"\n{cls._argument_group_name}:\n" in shown, cls._argument_group_name
    assert "--patch_embedding_matmul" in shown and "--use_peft" in shown and "--profile_steps" in shown


def test_readme_strategy_table_is_the_strategy_table():
    """README's table is copied from strategies.py: a row per strategy, with its files and what it shards."""
    readme = (ROOT / "README.md").read_text()
    rows = {line.split("|")[1].strip(" `"): line for line in readme.splitlines() if line.startswith("| `")}
    for spec in strategies.STRATEGIES:
        row = rows.get(spec.name)
        assert row is not None, f"README has no row for {spec.name}"
        for path in (spec.accelerate_config, spec.deepspeed_config):
            assert path is None or f"`{path.split('/')[-1]}`" in row, (spec.name, path)
        assert f"| {spec.shards} |" in row, (spec.name, spec.shards)


def test_regional_compilation_by_default_only_where_it_pays(tmp_path, monkeypatch, caplog):
    """Unset, --torch_compile_regions turns on for training on a CUDA GPU when the run is long enough to repay the
    compile: a cold one, or a cheaper one where an earlier compiled run of the same model and batch filled the compile
    cache; never on the CPU or under ZeRO-3. One line says which. Compiled runs keep inductor's caches under the
    Hugging Face cache unless TORCHINDUCTOR_CACHE_DIR says where."""
    import torch
    import transformers.training_args
    from conftest import tiny_vit_config
    from transformers import ViTForImageClassification

    import vit_recipes.core.arguments
    from vit_recipes.plan.plan import (
        COMPILE_PAYS_AFTER_STEPS,
        COMPILE_PAYS_AFTER_STEPS_WARM,
        configure,
        decide_compile,
        planned_steps,
        remember_compiled,
        was_compiled,
    )

    monkeypatch.setenv("ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION", "false")  # restored after the test
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H100 80GB HBM3")  # part of the cache key
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HOME", str(tmp_path / "hf"))
    model = ViTForImageClassification(tiny_vit_config())
    tf32 = []  # TF32 turned on: by TrainingArguments for a compile asked for, by the plan for one it decides
    for module in (vit_recipes.core.arguments, transformers.training_args):
        monkeypatch.setattr(module, "is_torch_tf32_available", lambda: True)
        monkeypatch.setattr(module, "enable_tf32", tf32.append)

    def resolved(device, steps, *extra, model=model):
        tf32.clear()
        args = parse_args(["--dataset_name", "data", "--output_dir", str(tmp_path / "out"), "--report_to", "none",
                           "--use_cpu", "true", "--do_train", "true", "--max_steps", str(steps), *extra])  # fmt: skip
        plan = dataclasses.replace(build_plan(args), device=device)
        configure(plan, args)
        caplog.clear()
        steps = planned_steps(args.training, train_images=5000, global_batch=plan.global_batch)
        key = decide_compile(plan, args, steps, model)
        lines = [r.getMessage() for r in caplog.records if "Regional compilation" in r.getMessage()]
        graphs = [r.getMessage() for r in caplog.records if "CUDA graphs" in r.getMessage()]
        t = args.training
        return t.torch_compile_regions, t.torch_compile, lines, key, list(tf32), t.torch_compile_mode, graphs

    short, medium, long = 200, COMPILE_PAYS_AFTER_STEPS_WARM, COMPILE_PAYS_AFTER_STEPS
    cache = tmp_path / "hf" / "vit_recipes" / "torch_compile"
    off = ("Regional compilation off: {} steps would not repay the compile (it pays from 1,000 steps, or 400 where the "
           "compile cache holds this model and batch; --torch_compile_regions true compiles anyway)")  # fmt: skip
    assert resolved("cpu", long)[:5] == (None, False, [], None, [])
    assert resolved("cuda", medium)[:3] == (None, False, [off.format(medium)])
    on, compiled, lines, key, tf32_on = resolved("cuda", long)[:5]
    assert (on, compiled, lines) == (True, True, [
        f"Regional compilation on: {long:,} steps repay it (--torch_compile_regions false trains eagerly)"])  # fmt: skip
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(cache)
    # Compiled on one GPU: CUDA graphs, said in one line; a mode asked for is kept (and keyed apart), and where graphs
    # are untested (DDP, DeepSpeed, FSDP, recomputation, fp8) or the compile is the whole model's, torch's default
    graphs_on = ("CUDA graphs on: each compiled layer launches its kernels as one graph (--torch_compile_mode "
                 "reduce-overhead), as the step waits on the host's launches (--torch_compile_regions true "
                 "--torch_compile_mode default compiles without them)")  # fmt: skip
    assert resolved("cuda", long)[5:] == ("reduce-overhead", [graphs_on])
    assert resolved("cuda", short, "--torch_compile_regions", "true")[5:] == ("reduce-overhead", [graphs_on])
    default = resolved("cuda", long, "--torch_compile_regions", "true", "--torch_compile_mode", "default")
    assert default[5:] == ("default", []) and default[3] != key
    assert resolved("cuda", long, "--gradient_checkpointing", "true")[5:] == (None, [])
    assert resolved("cuda", long, "--fp8", "true")[5:] == (None, [])
    zero2 = ("--deepspeed", str(ROOT / "ds_configs/zero2.json"))
    assert resolved("cuda", long, *zero2)[:2] == (True, True) and resolved("cuda", long, *zero2)[5:] == (None, [])
    assert resolved("cuda", long, "--torch_compile", "true")[5:] == (None, [])
    assert resolved("cpu", long, "--torch_compile_regions", "true")[5:] == (None, [])
    # The same TF32 setting as a compile asked for (TrainingArguments' rule), so both compute and cache the same graphs
    assert tf32_on == resolved("cuda", short, "--torch_compile_regions", "true")[4] == [True]
    assert resolved("cuda", short)[4] == []
    # asked off: TrainingArguments turns it off, and the plan leaves it so
    assert resolved("cuda", long, "--tf32", "false", "--bf16", "true")[4] == [False]
    # Once that run has trained, the same model and batch compile from fewer steps; another batch, model or GPU not
    remember_compiled(key)
    assert resolved("cuda", medium)[:3] == (True, True, [
        f"Regional compilation on: {medium} steps repay it from the compile cache ({cache}) "
        "(--torch_compile_regions false trains eagerly)"])  # fmt: skip
    assert resolved("cuda", short)[:3] == (None, False, [off.format(short)])
    assert resolved("cuda", medium, "--per_device_train_batch_size", "16")[:2] == (None, False)
    tiny = ViTForImageClassification(tiny_vit_config(hidden_size=16))
    assert resolved("cuda", medium, model=tiny)[:2] == (None, False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H200")
    assert resolved("cuda", medium)[:2] == (None, False)
    (cache / "vit_recipes_compiled.json").write_text("[]")  # not a record we wrote: nothing is warm, nothing fails
    assert resolved("cuda", medium)[:2] == (None, False)
    remember_compiled(key)
    # A cache is one machine's: over several machines, steps alone decide (each process reads its own machine's file)
    plan = build_plan(parse_args(["--dataset_name", "d", "--output_dir", str(tmp_path / "o")]))
    two_machines = dataclasses.replace(plan.strategy, world_size=4, processes_per_node=2)
    assert was_compiled(plan, key) and not was_compiled(dataclasses.replace(plan, strategy=two_machines), key)
    assert resolved("cuda", long, "--torch_compile_regions", "false")[:2] == (False, False)
    assert resolved("cuda", long, "--torch_compile", "true")[:3] == (None, True, [])  # the whole model, as asked
    assert resolved("cuda", short, "--torch_compile_regions", "true")[:2] == (True, True)  # asked for: no rule
    zero3 = ("--deepspeed", str(ROOT / "ds_configs/zero3.json"))
    assert resolved("cuda", long, *zero3)[:2] == (None, False)  # refused under ZeRO-3: the default stays eager
    # Without --max_steps: epochs x full batches of the training split
    args = parse_args(["--dataset_name", "d", "--output_dir", str(tmp_path / "o"), "--num_train_epochs", "2"])
    assert planned_steps(args.training, train_images=50_000, global_batch=128) == 2 * 390


def test_a_failing_compile_trains_eagerly_with_one_warning(
    cifar_like, tiny_vit, tmp_path, run_script, monkeypatch, capsys, request
):
    """The compiler raising (a missing toolchain, an unsupported op) costs speed, not the run: the same losses as an
    eager run, and one warning line instead of dynamo's traceback per compiled frame."""
    import torch._dynamo
    from conftest import logged_losses, run_args
    from torch._dynamo.backends import registry

    def broken(gm, example_inputs):
        raise RuntimeError("no C++ compiler found")

    torch._dynamo.list_backends()  # registers the built-in backends, so the one patched below is not re-registered
    monkeypatch.setitem(registry._COMPILER_FNS, "aot_eager", broken)
    monkeypatch.setattr(torch._dynamo.config, "suppress_errors", False)  # restored after the test
    monkeypatch.setenv("ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION", "false")
    common = ("--do_eval", "false", "--max_steps", "4", "--plots", "false", "--logging_steps", "1",
              "--dataloader_drop_last", "true")  # fmt: skip
    torch._dynamo.reset()
    # dynamo marks the frames the broken backend failed on as skipped: later compiles in this process would skip them
    request.addfinalizer(torch._dynamo.reset)
    run_script(*run_args(cifar_like, tiny_vit, tmp_path / "broken", *common, "--torch_compile_regions", "true",
                         "--torch_compile_backend", "aot_eager"))  # fmt: skip
    out = capsys.readouterr().out
    assert out.count("torch.compile failed, so this part trains eagerly") == 1, out[-3000:]
    assert "RuntimeError: no C++ compiler found" in out and "Traceback" not in out
    run_script(*run_args(cifar_like, tiny_vit, tmp_path / "eager", *common))
    assert logged_losses(tmp_path / "broken") == pytest.approx(logged_losses(tmp_path / "eager"), rel=1e-6)


def test_compiled_runs_drop_short_batches_in_training_only(cifar_like, tiny_vit, tmp_path, run_script, monkeypatch):
    """torch.compile drops each epoch's short last training batch (a new shape recompiles), but evaluation and the
    test split score every image: 100 test images in batches of 64 are 100 results, not 64."""
    import csv

    from conftest import run_args

    monkeypatch.setenv("ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION", "false")  # restored after the test
    out = tmp_path / "compiled"
    run_script(*run_args(cifar_like, tiny_vit, out, "--max_steps", "2", "--plots", "false", "--per_device_eval_batch_size",
                         "64", "--torch_compile_regions", "true", "--torch_compile_backend", "aot_eager"))  # fmt: skip
    with open(out / "per_class_accuracy_test.csv") as f:
        assert sum(int(row["support"]) for row in csv.DictReader(f)) == 100


def test_checkpointing_left_unset_follows_the_memory_estimate_and_a_lighter_strategy_is_named(
    tmp_path, monkeypatch, caplog
):
    """On a GPU, --gradient_checkpointing unset turns on only where the estimate (tools/advise.py's) says the batch
    does not fit without it; asked for or refused, it is left alone. A sharded strategy where one that communicates
    less fits says so in one line."""
    import torch

    from vit_recipes.model.facts import read_model_facts
    from vit_recipes.plan.memory import estimate, model_shape
    from vit_recipes.plan.plan import FITS_WITHIN, advise_memory

    tiny = "image_size=32,patch_size=8,hidden_size=64,num_hidden_layers=2,num_attention_heads=4,intermediate_size=256"
    gpu = {"bytes": 0}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda i: types.SimpleNamespace(total_memory=gpu["bytes"])
    )

    def advised(name, memory, *extra):
        args = parse_args(["--dataset_name", "d", "--output_dir", str(tmp_path / "o"), "--use_cpu", "true",
                           "--model_name_or_path", "", "--config_name", "vit", "--config_overrides", tiny,
                           "--per_device_train_batch_size", "64", *extra])  # fmt: skip
        strategy = read_strategy(args.training)
        if name != "single":
            strategy = dataclasses.replace(
                strategy, spec=strategies.BY_NAME[name], world_size=2, processes_per_node=2, fsdp=name == "fsdp2"
            )
        gpu["bytes"] = memory
        caplog.clear()
        caplog.set_level("INFO", logger="vit_recipes.plan.plan")
        strategy = advise_memory(args, strategy, "bf16", read_model_facts(args.model))
        return (
            args.training.gradient_checkpointing,
            [r.getMessage() for r in caplog.records if r.name == "vit_recipes.plan.plan"],
            strategy,
        )

    from transformers import ViTConfig

    config = ViTConfig(**{k: int(v) for k, v in (kv.split("=") for kv in tiny.split(","))})
    rows = {e.strategy.name: e for e in estimate(model_shape(config), 2, 64)}
    ddp, zero3 = rows["ddp"], rows["zero3"]
    between = (ddp.total_ckpt + ddp.total) / 2 / FITS_WITHIN  # fits with checkpointing only
    on, lines, _ = advised("single", between)
    assert on is True and len(lines) == 1 and lines[0].startswith("Gradient checkpointing on: batch 64 needs about")
    assert "--gradient_checkpointing false overrides" in lines[0]
    off, lines, _ = advised("single", 2 * ddp.total / FITS_WITHIN)
    assert off is False and lines[0].startswith("Gradient checkpointing off") and len(lines) == 1
    assert advised("single", between, "--gradient_checkpointing", "false")[:2] == (False, [])  # asked: left alone
    assert advised("single", 10 * ddp.total, "--gradient_checkpointing", "true")[:2] == (True, [])
    # ZeRO-3 where DDP fits (without checkpointing): one line naming DDP's config
    off, lines, _ = advised("zero3", 2 * ddp.total / FITS_WITHIN)
    assert off is False and "DDP, which communicates less, fits these GPUs too" in lines[-1]
    assert "accelerate_configs/ddp.yaml" in lines[-1] and len(lines) == 2
    # FSDP2 that needs checkpointing where nothing lighter fits: FSDP's own checkpointing on, no strategy line
    tight = (rows["fsdp2"].total_ckpt + min(rows["zero2"].total_ckpt, zero3.total)) / 2 / FITS_WITHIN
    on, lines, strategy = advised("fsdp2", tight)
    assert on is True and strategy.fsdp_activation_checkpointing
    assert len(lines) == 1 and lines[0].startswith("Gradient checkpointing on")
    # Only the run's row and the lighter ones are estimated; with nothing to decide or suggest, nothing is built
    from vit_recipes.plan import plan

    asked = []
    monkeypatch.setattr(plan, "estimate", lambda *a, keys, **kw: asked.append(keys) or estimate(*a, keys=keys, **kw))
    advised("zero3", 2 * ddp.total / FITS_WITHIN)
    advised("single", between)
    assert asked == [("ddp", "zero1", "zero2", "fsdp2", "zero3"), ("ddp",)]
    monkeypatch.setattr(plan, "model_shape", lambda *a: pytest.fail("the model's shape was built"))
    assert advised("single", between, "--gradient_checkpointing", "true")[:2] == (True, [])
    assert advised("ddp", between, "--gradient_checkpointing", "false")[:2] == (False, [])


def test_a_warm_up_as_long_as_the_run_is_said_in_one_line(tmp_path, caplog):
    """The ViT-B recipe cut to one epoch (351 steps) keeps its 500 warm-up steps: its learning rate never peaks."""
    from vit_recipes.plan.plan import planned_steps, warn_if_warmup_outlasts_the_run

    def said(*extra, images=45_000):
        args = parse_args(["--config", str(ROOT / "recipes/vit-base/cifar100/config_full.yaml"), "--output_dir",
                           str(tmp_path / "o"), "--use_cpu", "true", *extra])  # fmt: skip
        caplog.clear()
        warn_if_warmup_outlasts_the_run(
            args.training, planned_steps(args.training, images, build_plan(args).global_batch)
        )
        return [r.getMessage() for r in caplog.records if "warm-up" in r.getMessage()]

    assert said("--num_train_epochs", "1") == [
        "The warm-up (500 steps) is as long as the run (351 steps): the learning rate peaks at 7.02e-05, not "
        "--learning_rate 0.0001; lower --warmup_steps (e.g. to a tenth of the steps) for a full schedule"
    ]
    assert said() == []  # the recipe's 10 epochs: 3,510 steps
    assert said("--max_steps", "200", "--warmup_steps", "20") == []
    assert said("--max_steps", "200", "--do_train", "false") == []

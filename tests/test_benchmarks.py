"""The lab: the runner (benchmarks/run.py: commands, records, failures), the report (benchmarks/report.py: table,
charts), the record index (benchmarks/index.py), the probes and the shape of benchmarks/ itself."""

from __future__ import annotations

import ast
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, logged_losses, run_args

BENCH = ROOT / "benchmarks"
FIXTURES = ROOT / "tests" / "data" / "benchmarks" / "fixture_records.json"
METRIC_KEYS = {
    "train_images_per_second",
    "train_step_time_s",
    "train_time_20_steps_s",
    "train_data_wait_fraction",
    "train_loss",
    "train_batches_per_second",
    "train_images_per_second_per_gpu",
    "data_decode_seconds",
}
RECORD_KEYS = {
    "name",
    "strategy",
    "gpus",
    "model",
    "per_device_batch",
    "precision",
    "dataset",
    "steps",
    "device",
    "command",
    "git_commit",
    "versions",
    "metrics",
    "created",
    "status",
    "error",
}


sys.path.insert(0, str(ROOT))  # benchmarks/ is a package of the repository, not of the install
from benchmarks import common  # noqa: E402
from benchmarks import index as bench_index  # noqa: E402
from benchmarks import report as bench_report  # noqa: E402
from benchmarks import run as bench_run  # noqa: E402


def runner(*args, timeout=300) -> subprocess.CompletedProcess:
    """`python -m benchmarks.run ARGS` from the repository root, as docs/benchmarks.md types it."""
    return subprocess.run([sys.executable, "-m", "benchmarks.run", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)  # fmt: skip


def suite_file(tmp_path: Path, defaults: dict, runs: list[dict], question: str = "Does it run?") -> Path:
    path = tmp_path / "suite.json"
    path.write_text(json.dumps({"question": question, "defaults": defaults, "runs": runs}))
    return path


# --------------------------------------------------------------------------------------------------- planning


def plan(**run):
    return bench_run.normalise({"model": "bench_assets/vit-base", "dataset": "bench_assets/cifar100", **run})


def test_launcher_per_strategy(tmp_path, monkeypatch):
    configs = tmp_path / "accelerate_configs"
    configs.mkdir()
    for name in ("zero2.yaml", "zero3_offload.yaml", "fsdp.yaml"):
        (configs / name).write_text("distributed_type: DEEPSPEED\n")
    monkeypatch.setattr(bench_run, "ROOT", tmp_path)

    single = bench_run.build_command(plan(batch=32, precision="fp32"), "OUT")
    assert single[0] == sys.executable and single[1] == "run_image_classification.py"
    assert single[single.index("--bf16") + 1] == "false"
    assert single[single.index("--per_device_train_batch_size") + 1] == "32"
    for flag, value in (("--eval_strategy", "no"), ("--save_strategy", "no"), ("--do_eval", "false")):
        assert single[single.index(flag) + 1] == value
    assert single[single.index("--report_to") + 1] == "none" and "--max_steps" in single

    ddp = " ".join(bench_run.build_command(plan(strategy="ddp", gpus=2, precision="fp32"), "OUT"))
    assert "-m accelerate.commands.launch --multi_gpu --num_processes 2" in ddp
    assert "--mixed_precision no" in ddp  # an accelerate YAML saying bf16 cannot turn an fp32 run into bf16
    torchrun = " ".join(bench_run.build_command(plan(strategy="ddp", gpus=4, launcher="torchrun"), "OUT"))
    assert "-m torch.distributed.run --standalone --nproc_per_node 4 run_image_classification.py" in torchrun

    for strategy, config in (("zero2", "zero2.yaml"), ("zero3_offload", "zero3_offload.yaml"), ("fsdp2", "fsdp.yaml")):
        command = " ".join(bench_run.build_command(plan(strategy=strategy, gpus=2), "OUT"))
        assert f"--config_file accelerate_configs/{config} --num_processes 2" in command
        assert "--mixed_precision bf16" in command and "--bf16 true" in command
    with pytest.raises(bench_run.PlanError, match="zero3.yaml"):
        bench_run.build_command(plan(strategy="zero3", gpus=2), "OUT")
    shown = bench_run.display_command(bench_run.build_command(plan(strategy="zero2", gpus=2), "OUT"))
    assert shown.startswith("accelerate launch --config_file accelerate_configs/zero2.yaml")


def test_plan_rejects_what_cannot_run():
    for bad, message in (
        ({"strategy": "single", "gpus": 2}, "one GPU"),
        ({"strategy": "ddp", "gpus": 1}, "--gpus >= 2"),
        ({"strategy": "zero4"}, "unknown strategy"),
        ({"precision": "fp16"}, "fp32 or bf16"),
        ({"batch": 0}, "batch must be positive"),
        ({"nonsense": 1}, "unknown run keys"),
    ):
        with pytest.raises(bench_run.PlanError, match=message):
            plan(**bad)
    run = plan(strategy="zero2", gpus=2, batch=64, extra="--gradient_checkpointing true")
    assert run["name"] == "vit-base-zero2-bf16-g2-b64-ckpt"


def suite_runs(name: str) -> list[dict]:
    suite = bench_run.load_suite(bench_run.suite_path(name))
    return [bench_run.normalise(r, suite["defaults"]) for r in suite["runs"]]


def test_suites_expand():
    by_name = {r["name"]: r for r in suite_runs("gpu_core")}
    core = by_name["vitb-core-bf16-b256"]
    assert (core["batch"], core["precision"], core["strategy"], core["gpus"]) == (256, "bf16", "single", 1)
    assert core["steps"] >= 200 and list(by_name)[0] == core["name"]  # the core record runs first
    assert {"vitb-single-bf16-b64", "vitb-single-fp32-b256", "vith-bf16-b64", "vith-ckpt-bf16-b64"} <= set(by_name)
    assert by_name["vith-ckpt-bf16-b64"]["extra"] == ["--gradient_checkpointing", "true"]
    assert by_name["food-decode-bf16-b256"]["decode"]

    sweep = suite_runs("multi_gpu_sweep")
    assert len(sweep) == 5 * 6 and {r["batch"] for r in sweep} == {8, 32, 64, 128, 256}
    assert {(r["strategy"], r["precision"]) for r in sweep} == {
        ("ddp", "fp32"), ("ddp", "bf16"), ("zero2", "bf16"), ("zero3_offload", "bf16"), ("fsdp2", "bf16"),
        ("zero3", "bf16"),
    }  # fmt: skip

    runs = suite_runs("scaling")
    assert runs[0]["strategy"] == "single" and runs[0]["gpus"] == 1  # the baseline first
    assert {(r["strategy"], r["gpus"]) for r in runs} >= {
        (s, g) for s in ("ddp", "zero2", "zero3", "fsdp2") for g in (2, 4)
    }
    assert all(r["steps"] >= 100 and r["batch"] == 256 for r in runs)

    runs = suite_runs("traces")
    assert all("--profile_steps" in r["extra"] for r in runs)  # every record keeps traces (trace_dir)
    assert {r["model"].split("/")[-1] for r in runs} == {"vit-base", "vit-huge"}

    runs = suite_runs("zero3_tuning")
    assert len({r["name"] for r in runs}) == len(runs)
    assert {r["strategy"] for r in runs} == {"zero3", "zeropp", "fsdp2_offload"}
    leaf = bench_run.deepspeed_config(next(r for r in runs if r["name"] == "vit-base-zero3-g4-leaf"))
    assert leaf["zero_optimization"]["leaf_module"] == {"classes": ["ViTLayer"]}
    assert leaf["zero_optimization"]["stage"] == 3  # the shipped file underneath


def test_the_command_line_picks_a_suite_by_name_and_overrides_its_defaults(tmp_path, capsys):
    args = bench_run.parse_cli(["multi_gpu_sweep", "--gpus", "4", "--set", "steps=7", "--set", "extra=--foo 1",
                                "--only", "ddp", "--assets", str(tmp_path)])  # fmt: skip
    _, runs = bench_run.plan(args)
    assert len(runs) == 10 and all(r["gpus"] == 4 and r["steps"] == 7 and r["strategy"] == "ddp" for r in runs)
    assert all(r["extra"] == ["--foo", "1"] and r["model"] == str(tmp_path / "vit-base") for r in runs)
    assert bench_run.main(["no_such_suite"]) == 2
    assert "error: no suite 'no_such_suite'" in capsys.readouterr().err
    assert bench_run.main(["--list"]) == 0
    listed = capsys.readouterr().out.splitlines()
    assert len(listed) == len(list((BENCH / "suites").glob("*.yaml")))
    assert not [line for line in listed if "cannot run" in line], listed
    bad = tmp_path / "bad.yaml"
    bad.write_text("runs: [{model: m, dataset: d}]\n")
    with pytest.raises(bench_run.PlanError, match="question"):
        bench_run.load_suite(bad)


@pytest.mark.parametrize("suite", sorted(p.name for p in (BENCH / "suites").glob("*.yaml")))
def test_every_suite_plans(suite):
    """Each shipped suite expands into valid, uniquely named runs (a typo would otherwise surface on the GPU)."""
    loaded = bench_run.load_suite(BENCH / "suites" / suite)
    runs, budget = [bench_run.normalise(r, loaded["defaults"]) for r in loaded["runs"]], loaded.get("budget")
    assert runs and len({r["name"] for r in runs}) == len(runs) and loaded["question"].strip().endswith("?")
    assert all(r["strategy"] in bench_run.STRATEGIES for r in runs)
    assert all(bench_run.deepspeed_config(r) for r in runs if r.get("ds_overrides"))
    assert budget is None or float(budget) > 0


def test_error_line_prefers_oom_then_the_error():
    log = "\n".join(
        [
            "[rank1]: Traceback (most recent call last):",
            '[rank1]:   File "run_image_classification.py", line 3',
            "[rank1]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB.",
            "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:",
            "run_image_classification.py FAILED",
        ]
    )
    assert bench_run.error_line(log) == (
        "oom",
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB.",
    )
    log = "loading\nValueError: bad thing\nsubprocess.CalledProcessError: Command died\n"
    assert bench_run.error_line(log) == ("error", "ValueError: bad thing")
    assert bench_run.error_line("x\nerror: dataset path not found: ./x\n") == (
        "error",
        "error: dataset path not found: ./x",
    )


# --------------------------------------------------------------------------------------------------- running


@pytest.mark.slow
def test_launcher_given_commit_wins_over_a_stale_git(monkeypatch):
    monkeypatch.setenv("BENCH_GIT_COMMIT", "d8404e64ee244ce7116b5ee6ebe39301d9d1687f")
    assert common.git_commit() == "d8404e64ee244ce7116b5ee6ebe39301d9d1687f"
    monkeypatch.delenv("BENCH_GIT_COMMIT")
    assert (
        common.git_commit().split("-")[0]
        == subprocess.check_output(["git", "rev-parse", "HEAD"], cwd=ROOT, text=True).strip()
    )


def test_ds_overrides_reach_deepspeed_through_accelerate(tmp_path, monkeypatch):
    run = plan(strategy="zero3", gpus=2, ds_overrides={"zero_optimization.stage3_prefetch_bucket_size": 5e7})
    config = bench_run.deepspeed_config(run)
    shipped = json.loads((ROOT / "ds_configs/zero3.json").read_text())
    assert config["zero_optimization"]["stage3_prefetch_bucket_size"] == 50_000_000  # an int, as DeepSpeed wants
    assert {k: v for k, v in config["zero_optimization"].items() if k != "stage3_prefetch_bucket_size"} == {
        k: v for k, v in shipped["zero_optimization"].items() if k != "stage3_prefetch_bucket_size"
    }
    ds_file = tmp_path / "ds.json"
    argv = bench_run.build_command(run, "out", port=29999, ds_config_file=str(ds_file))
    # accelerate itself: a --deepspeed_config_file on the command line wins over the YAML's (ds_configs/zero3.json)
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser

    monkeypatch.chdir(ROOT)
    launch_args = argv[argv.index("accelerate.commands.launch") + 1 :]
    args = _validate_launch_command(launch_command_parser().parse_args(launch_args))[0]
    assert args.use_deepspeed and args.deepspeed_config_file == str(ds_file)
    args = _validate_launch_command(launch_command_parser().parse_args([*bench_run.launch_prefix(run)[3:], "x.py"]))[0]
    assert args.deepspeed_config_file == "ds_configs/zero3.json"
    with pytest.raises(bench_run.PlanError, match="does not use DeepSpeed"):
        plan(strategy="fsdp2", gpus=2, ds_overrides={"a.b": 1})


def test_per_rank_memory_and_the_loss_curve_come_from_the_runs_log_lines(tmp_path):
    history = [
        {"loss": 2.0, "step": 10, "gpu_mem_allocated_gib_rank0": 1.25, "gpu_mem_allocated_gib_rank1": 1.5,
         "gpu_mem_peak_gib_rank0": 9.0, "gpu_mem_peak_gib_rank1": 8.0},
        {"loss": 1.9, "step": 20, "gpu_mem_allocated_gib_rank0": 1.0, "gpu_mem_allocated_gib_rank1": 1.75,
         "gpu_mem_peak_gib_rank0": 9.5, "gpu_mem_peak_gib_rank1": 8.0},
        {"eval_loss": 1.8, "step": 20},
    ]  # fmt: skip
    (tmp_path / "trainer_state.json").write_text(json.dumps({"log_history": history}))
    read = bench_run.log_history(tmp_path)
    memory = bench_run.per_rank_memory(read)
    assert memory["train_states_allocated_gib_rank0"] == 1.25 and memory["train_states_allocated_gib_rank1"] == 1.75
    assert memory["train_states_allocated_gib_max_rank"] == 1.75
    assert memory["train_peak_allocated_gib_max_rank"] == 9.5
    assert bench_run.loss_curve(read) == [[10, 2.0], [20, 1.9]]  # training lines only
    assert bench_run.log_history(tmp_path / "missing") == [] and bench_run.per_rank_memory([]) == {}


def test_runner_records_cold_and_warm_runs_and_reports_them(cifar_like, tiny_vit, tmp_path):
    suite = suite_file(tmp_path, {"model": str(tiny_vit), "dataset": str(cifar_like), "batch": 8, "steps": 8,
                                  "precision": "fp32", "workers": 0, "extra": "--use_cpu true"},
                       [{"name": "tiny", "decode": True}], "Does a tiny ViT train on the CPU?")  # fmt: skip
    results = tmp_path / "results"
    done = runner(suite, "--out", results)
    assert done.returncode == 0, done.stdout + done.stderr
    for phase in ("cold", "warm"):
        record = json.loads((results / f"tiny-{phase}.json").read_text())
        assert set(record) >= RECORD_KEYS
        assert record["status"] == "ok" and record["error"] is None and record["cache"] == phase
        assert (record["strategy"], record["gpus"], record["per_device_batch"], record["steps"]) == ("single", 1, 8, 8)
        assert record["precision"] == "fp32" and record["dataset"] == cifar_like.name and record["suite"] == "suite"
        assert set(record["metrics"]) >= METRIC_KEYS, set(record["metrics"])
        assert record["metrics"]["train_images_per_second"] > 0
        assert 0 <= record["metrics"]["train_data_wait_fraction"] <= 1
        assert set(record["versions"]) >= {"torch", "transformers", "accelerate", "deepspeed", "datasets", "python"}
        assert record["command"].startswith("python run_image_classification.py --model_name_or_path")
        assert "--max_steps 8" in record["command"] and "--use_cpu true" in record["command"]
        assert record["git_commit"] and record["wall_seconds"] > 0
        assert (results / record["log"]).is_file()
    cold, warm = (json.loads((results / f"tiny-{p}.json").read_text())["metrics"] for p in ("cold", "warm"))
    assert warm["data_decode_seconds"] < cold["data_decode_seconds"]  # the warm run reads the datasets cache
    markdown = (results / "results.md").read_text()
    assert "## Decoding: cold vs warm datasets cache" in markdown and "`tiny-warm`" in markdown
    # The record's README: question, command, commit, table; the conclusion and headline are a person's to write.
    readme = (results / "README.md").read_text()
    assert (
        "**Question:** Does a tiny ViT train on the CPU?" in readme and f"python -m benchmarks.run {suite}" in readme
    )
    assert "| `tiny-cold` |" in readme and common.CONCLUSION_TO_WRITE in readme
    problems = bench_index.read_record(results)["problems"]
    assert (
        "its README's conclusion is still to write" in problems and "its README has no **Headline:** line" in problems
    )


@pytest.mark.slow
def test_failed_and_timed_out_runs_are_recorded(cifar_like, tiny_vit, tmp_path):
    defaults = {"model": str(tiny_vit), "dataset": str(cifar_like), "steps": 8, "batch": 8, "workers": 0}
    runs = [{"name": "bad-lr", "extra": "--use_cpu true --learning_rate -1"},
            {"name": "too-slow", "timeout": 1, "extra": "--use_cpu true"}]  # fmt: skip
    results = tmp_path / "results"
    done = runner(suite_file(tmp_path, defaults, runs), "--out", results)
    assert done.returncode == 1  # not every run succeeded
    bad = json.loads((results / "bad-lr.json").read_text())
    assert bad["status"] == "failed" and bad["failure"] == "error"
    assert bad["error"] == "error: learning_rate must be > 0, got -1.0"
    assert bad["metrics"] == {} and bad["command"] and bad["per_device_batch"] == 8
    slow = json.loads((results / "too-slow.json").read_text())
    assert slow["status"] == "failed" and slow["failure"] == "timeout" and "timed out after 1 s" in slow["error"]
    assert bench_report.main([str(results), "--out", str(tmp_path / "report")]) == 0
    markdown = (tmp_path / "report" / "results.md").read_text()
    assert "## Failed or skipped runs" in markdown and "learning_rate must be > 0" in markdown


def test_budget_skips_runs_and_oom_skips_larger_batches(tmp_path, monkeypatch):
    runs = [plan(name=f"r{b}", batch=b) for b in (8, 16, 32)]
    calls = []

    context = {"gpu_names": [], "device": "CPU", "device_memory_gib": None, "git_commit": "abc", "code_fingerprint": "f",
               "versions": {}}  # fmt: skip

    def fake_execute(run, results, suite, context, cache_dir, keep_output, phase=None):
        calls.append(run["name"])
        record = bench_run.base_record(run, suite, context)
        record.update(status="failed", failure="oom", error="CUDA out of memory")
        bench_run.write_record(record, results)
        return record

    monkeypatch.setattr(bench_run, "execute", fake_execute)
    records = bench_run.run_all(runs, tmp_path, "t", context=context)
    assert calls == ["r8"] and [r["status"] for r in records] == ["failed", "skipped", "skipped"]
    assert records[1]["error"] == "out of memory at batch 8"
    records = bench_run.run_all(runs, tmp_path / "b", "t", budget=0, context=context)
    assert {r["status"] for r in records} == {"skipped"} and len(records) == 3
    assert json.loads((tmp_path / "b" / "r8.json").read_text())["error"].startswith("time budget spent")
    calls.clear()  # min_left: a run that needs more of the budget than is left is not started
    records = bench_run.run_all([plan(name="big", min_left=500)], tmp_path / "c", "t", budget=300, context=context)
    assert calls == [] and records[0]["status"] == "skipped"


# --------------------------------------------------------------------------------------------------- report


def test_report_on_fixture_records(tmp_path):
    records = json.loads(FIXTURES.read_text())
    folder = tmp_path / "records"
    folder.mkdir()
    for record in records:  # one file per record, as run.py writes them
        (folder / f"{record['name']}.json").write_text(json.dumps(record))
    (folder / "not_a_record.json").write_text('{"hello": 1}')
    out = tmp_path / "report"
    assert bench_report.main([str(folder), "--out", str(out), "--title", "Fixture"]) == 0
    markdown = (out / "results.md").read_text()
    assert markdown.startswith("# Fixture") and "FIXTURE DATA" in markdown
    table = markdown.split("## Throughput and memory", 1)[1].split("##", 1)[0]
    rows = [line for line in table.splitlines() if line.startswith("| `")]
    assert len(rows) == sum(r["status"] == "ok" and not r.get("cache") for r in records)
    assert "| `fixture-ddp-bf16-b256` | vit-base | ddp | 2 | bf16 | 256 | 4,000 | 2,000 |" in table
    failed = markdown.split("## Failed or skipped runs", 1)[1]
    assert "failed (oom)" in failed and "CUDA out of memory" in failed and "skipped" in failed
    assert "| `fixture-food-decode-cold` | food101 | cold | 40.00 |" in markdown

    from matplotlib.image import imread

    for chart in bench_report.CHARTS:
        assert f"]({chart})" in markdown
        image = imread(out / chart)
        assert image.shape[0] > 200 and image.shape[1] > 400 and image.std() > 0.01, chart


def test_report_without_records_fails(tmp_path):
    assert bench_report.main([str(tmp_path)]) == 2


# --------------------------------------------------------------------------------------------------- levers


@pytest.mark.slow
def test_torch_compile_lever_trains_through_our_trainer(cifar_like, tiny_vit, tmp_path, run_script):
    """--torch_compile (a TrainingArguments flag) works with the device transforms and our loss; aot_eager keeps
    the test fast on CPU (inductor would compile C++ for minutes)."""
    results = run_script(
        *run_args(cifar_like, tiny_vit, tmp_path / "out", "--do_eval", "false", "--max_steps", "7", "--plots", "false"),
        "--torch_compile", "true", "--torch_compile_backend", "aot_eager",
    )  # fmt: skip
    assert results["train_images_per_second"] > 0 and results["train_loss"] > 0


def test_regional_compile_compiles_each_layer_and_saves_a_plain_model(
    cifar_like, tiny_vit, tmp_path, run_script, monkeypatch
):
    """--torch_compile_regions: accelerate compiles each ViTLayer (one compiled graph reused for all of them) rather
    than the whole model, the run trains through our Trainer and the saved model has no compile wrappers."""
    from safetensors.torch import load_file
    from torch._dynamo.eval_frame import OptimizedModule
    from transformers import Trainer, ViTForImageClassification

    from vit_recipes.core.arguments import parse_args

    monkeypatch.setenv("ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION", "false")  # restored after the test
    common = ("--dataset_name", "cifar100", "--output_dir", tmp_path / "unused", "--use_cpu", "true")
    training = parse_args([*map(str, common), "--report_to", "none", "--eval_strategy", "no", "--torch_compile_regions", "true",
                           "--torch_compile_backend", "aot_eager"]).training  # fmt: skip
    assert training.torch_compile and training.dataloader_drop_last
    model = ViTForImageClassification.from_pretrained(tiny_vit)
    prepared = Trainer(model=model, args=training).accelerator.prepare_model(model)
    assert not isinstance(prepared, OptimizedModule)
    compiled = [type(m._orig_mod).__name__ for m in prepared.modules() if isinstance(m, OptimizedModule)]
    assert compiled.count("ViTLayer") == model.config.num_hidden_layers, compiled

    def train(out, *extra):
        return run_script(
            *run_args(cifar_like, tiny_vit, out, "--do_eval", "false", "--max_steps", "7", "--plots", "false"),
            "--dataloader_drop_last", "true", "--logging_steps", "1", *extra,
        )  # fmt: skip

    results = train(tmp_path / "regions", "--torch_compile_regions", "true", "--torch_compile_backend", "aot_eager")
    assert results["train_images_per_second"] > 0 and results["train_loss"] > 0
    assert not [key for key in load_file(tmp_path / "regions" / "model.safetensors") if "_orig_mod" in key]
    # Same random augmentation as eager (aot_eager computes what eager does): regional compilation trains a copy of
    # the top module, and reading self.model.training once sent its batches through the evaluation transform.
    train(tmp_path / "eager")
    assert logged_losses(tmp_path / "regions") == pytest.approx(logged_losses(tmp_path / "eager"), rel=1e-6)


def test_torch_compile_drops_the_short_last_batch():
    """A short last batch would recompile the model every epoch (seen on an H100: ~45 s each time)."""
    from vit_recipes.core.arguments import parse_args

    common = ("--dataset_name", "cifar100", "--output_dir", "unused", "--use_cpu", "true", "--report_to", "none")
    assert parse_args([*common, "--torch_compile", "true"]).training.dataloader_drop_last
    assert not parse_args([*common]).training.dataloader_drop_last


def test_a_run_gets_the_first_of_the_visible_gpus(monkeypatch):
    """A lane of a shared machine (CUDA_VISIBLE_DEVICES=2,3) gives a 1-GPU run GPU 2 alone, not both (the Trainer
    would use DataParallel over two: seen at 421 img/s instead of ~2,500)."""
    run = {"gpus": 1}
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert bench_run.child_env(run, ["H200", "H200"], None)["CUDA_VISIBLE_DEVICES"] == "2"
    assert bench_run.child_env({"gpus": 2}, ["H200", "H200"], None)["CUDA_VISIBLE_DEVICES"] == "2,3"
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert bench_run.child_env(run, ["H200"] * 4, None)["CUDA_VISIBLE_DEVICES"] == "0"
    assert "CUDA_VISIBLE_DEVICES" not in bench_run.child_env(run, [], None)  # no GPU: nothing to pick


# --------------------------------------------------------------------------------------------------- the peer


def load_peer():
    """benchmarks/peer.py as a module (registered first: its argument dataclass looks its module up)."""
    spec = importlib.util.spec_from_file_location("benchmarks_peer", BENCH / "peer.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def torchvision_imports() -> bool:
    try:
        import torchvision  # noqa: F401
    except Exception:  # noqa: BLE001 - not installed, or built for another torch (as on the CPU test machine)
        return False
    return True


def test_peer_runs_through_the_runner_and_records_like_our_script(cifar_like, tiny_vit, tmp_path):
    """benchmarks/peer.py (transformers' example script) through run.py: in the training process and in a worker."""
    defaults = {"model": str(tiny_vit), "dataset": str(cifar_like), "steps": 8, "batch": 8, "precision": "fp32"}
    runs = [{"peer": True, "workers": w, "extra": "--use_cpu true"} for w in (0, 1)]
    results = tmp_path / "results"
    done = runner(suite_file(tmp_path, defaults, runs), "--out", results)
    assert done.returncode == 0, done.stdout + done.stderr
    for workers in (0, 1):
        name = f"peer-{tiny_vit.name}-fp32-b8-w{workers}"
        record = json.loads((results / f"{name}.json").read_text())
        assert set(record) >= RECORD_KEYS and record["status"] == "ok" and record["error"] is None
        assert record["peer"] is True and record["dataloader_workers"] == workers
        assert record["peer_transforms"] == ("torchvision" if torchvision_imports() else "pil")
        assert (record["strategy"], record["gpus"], record["per_device_batch"], record["steps"]) == ("single", 1, 8, 8)
        assert set(record["metrics"]) >= METRIC_KEYS, set(record["metrics"])  # the same meter as our runs
        assert record["metrics"]["train_images_per_second"] > 0
        assert 0 < record["metrics"]["train_data_wait_fraction"] < 1
        assert record["metrics"]["cpu_peak_rss_gib_rank0"] > 0  # per-step logs, as ours
        command = record["command"]
        assert command.startswith("python benchmarks/peer.py --model_name_or_path")
        assert f"--dataloader_num_workers {workers}" in command and "--remove_unused_columns false" in command
    assert bench_report.main([str(results)]) == 0
    markdown = (results / "results.md").read_text()
    assert "single (HF example)" in markdown and "x peer (8 workers)" not in markdown  # no 8-worker peer here


def test_peer_pil_transforms_follow_torchvision(monkeypatch):
    """The PIL stand-in for RandomResizedCrop + RandomHorizontalFlip + ToTensor + Normalize: shapes, ranges, flips,
    and crops inside torchvision's bounds (scale 0.08-1, ratio 3/4-4/3, the centre-crop fallback)."""
    import numpy as np
    import torch
    from PIL import Image

    peer = load_peer()
    torch.manual_seed(0)
    for width, height in ((32, 32), (64, 48), (500, 375), (40, 90)):
        for _ in range(300):
            top, left, h, w = peer.crop_params(width, height)
            assert 0 < h <= height and 0 < w <= width and 0 <= top <= height - h and 0 <= left <= width - w
            share = h * w / (width * height)
            assert 0.08 * 0.8 <= share <= 1.0, (width, height, h, w)  # rounding moves small crops a little
            assert 3 / 4 * 0.85 <= w / h <= 4 / 3 / 0.85, (width, height, h, w)
    # Ten misses, then the whole image cut to the nearest allowed ratio, centred (as torchvision's get_params).
    assert peer.crop_params(1000, 1) == (0, 499, 1, 1)
    assert peer.crop_params(1, 1000) == (499, 0, 1, 1)
    torch.manual_seed(1)
    first = [peer.crop_params(64, 48) for _ in range(5)]
    torch.manual_seed(1)
    assert [peer.crop_params(64, 48) for _ in range(5)] == first  # the torch RNG alone decides

    pixels = np.random.default_rng(0).integers(0, 256, size=(32, 32, 3), dtype=np.uint8)
    image = Image.fromarray(pixels)
    out = peer.pil_train_transform((12, 20), mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5))(image)
    assert out.shape == (3, 12, 20) and out.dtype == torch.float32
    assert out.min() >= -1 and out.max() <= 1 and out.std() > 0.1
    assert peer.pil_train_transform(16, mean=(0, 0, 0), std=(1, 1, 1))(image).shape == (3, 16, 16)

    monkeypatch.setattr(peer, "crop_params", lambda width, height: (0, 0, height, width))  # the whole image
    plain = peer.pil_train_transform(32, mean=(0.0, 0.0, 0.0), std=(1.0, 1.0, 1.0))
    expected = torch.from_numpy(pixels).permute(2, 0, 1).float() / 255  # ToTensor: CHW in [0, 1]
    flips = []
    for _ in range(200):
        tensor = plain(image)
        assert torch.equal(tensor, expected) or torch.equal(tensor, expected.flip(-1))
        flips.append(not torch.equal(tensor, expected))
    assert 60 < sum(flips) < 140  # p = 0.5
    normalised = peer.pil_train_transform(32, mean=(0.2, 0.4, 0.6), std=(0.5, 0.25, 0.1))(image)
    mean, std = torch.tensor([0.2, 0.4, 0.6]).view(3, 1, 1), torch.tensor([0.5, 0.25, 0.1]).view(3, 1, 1)
    assert any(torch.allclose(normalised, (x - mean) / std) for x in (expected, expected.flip(-1)))

    from transformers import ViTImageProcessor

    transform, evaluation, kind = peer.transforms(ViTImageProcessor(size={"height": 16, "width": 24}))
    assert kind == ("torchvision" if torchvision_imports() else "pil")
    assert transform(image).shape == (3, 16, 24) and evaluation(image).shape == (3, 16, 24)
    # Evaluation: Resize (the shorter side, aspect kept) + CenterCrop, deterministic
    wide = Image.fromarray(np.random.default_rng(1).integers(0, 256, size=(48, 64, 3), dtype=np.uint8))
    centre = peer.pil_eval_transform(24, mean=(0.0, 0.0, 0.0), std=(1.0, 1.0, 1.0))
    assert centre(wide).shape == (3, 24, 24) and torch.equal(centre(wide), centre(wide))
    resized = torch.from_numpy(np.array(wide.resize((32, 24), Image.Resampling.BILINEAR))).permute(2, 0, 1) / 255
    assert torch.allclose(centre(wide), resized[:, :, 4:28])


def test_peer_counts_flops_at_the_size_its_processor_crops_to():
    """DINOv2's shape: a config image_size (its position table, 518 on the Hub) larger than the size the example
    trains at (its processor's shortest_edge, 256). The peer's MFU counted FLOPs at the config's size."""
    from transformers import BitImageProcessor, Dinov2Config

    from vit_recipes.model.flops import training_flops_per_image

    peer = load_peer()
    config = Dinov2Config(image_size=32, patch_size=4, hidden_size=16, num_hidden_layers=2, num_attention_heads=2)
    processor = BitImageProcessor(size={"shortest_edge": 16}, crop_size={"height": 16, "width": 16})
    counted = peer.flops_per_image(config, processor, gradient_checkpointing=False)
    assert counted == training_flops_per_image(config, False, image_size=16)
    assert counted < training_flops_per_image(config, False) / 3  # 32 px: 4x the patches, more attention
    assert peer.processor_size(processor) == 16
    assert peer.processor_size(BitImageProcessor(size={"height": 12, "width": 20})) == (12, 20)
    # A model the count cannot run at that size (a ViT does not interpolate its positions): no MFU, the run goes on
    from conftest import tiny_vit_config

    assert peer.flops_per_image(tiny_vit_config(), processor, gradient_checkpointing=False) is not None  # 16 px
    vit_at_32 = tiny_vit_config()
    vit_at_32.image_size = 32
    assert peer.flops_per_image(vit_at_32, processor, gradient_checkpointing=False) is None


def test_peer_pil_transforms_equal_torchvision_for_the_same_seed():
    pytest.importorskip("torchvision")
    import numpy as np
    import torch
    from PIL import Image
    from torchvision.transforms import Compose, Normalize, RandomHorizontalFlip, RandomResizedCrop, ToTensor

    peer = load_peer()
    image = Image.fromarray(np.random.default_rng(0).integers(0, 256, size=(48, 64, 3), dtype=np.uint8))
    mean, std = (0.5, 0.4, 0.3), (0.2, 0.3, 0.4)
    ours = peer.pil_train_transform((24, 24), mean, std)
    theirs = Compose([RandomResizedCrop((24, 24)), RandomHorizontalFlip(), ToTensor(), Normalize(mean, std)])
    for seed in range(20):
        torch.manual_seed(seed)
        expected = theirs(image)
        torch.manual_seed(seed)
        assert torch.allclose(ours(image), expected, atol=1e-6), seed


def test_report_states_each_run_against_the_peer_with_8_workers(tmp_path):
    def record(name, images_per_second, peer=False, workers=8, batch=256):
        return {
            "name": name, "strategy": "single", "gpus": 1, "model": "vit-base", "dataset": "cifar100",
            "per_device_batch": batch, "precision": "bf16", "steps": 60, "peer": peer,
            "dataloader_workers": workers, "status": "ok", "device": "GPU",
            "metrics": {"train_images_per_second": images_per_second, "train_step_time_s": batch / images_per_second},
        }  # fmt: skip

    folder = tmp_path / "call"
    folder.mkdir()
    for item in (
        record("peer-w0", 500.0, peer=True, workers=0),
        record("peer-w8", 1000.0, peer=True),
        record("ours-b256", 2500.0),
        record("ours-b512-regions", 3600.0, batch=512),
    ):
        (folder / f"{item['name']}.json").write_text(json.dumps(item))
    other = tmp_path / "other"  # another call's peer is not this folder's reference
    other.mkdir()
    (other / "peer-elsewhere.json").write_text(json.dumps(record("peer-elsewhere", 100.0, peer=True)))
    (other / "ours-elsewhere.json").write_text(json.dumps(record("ours-elsewhere", 2000.0)))
    assert bench_report.main([str(folder), str(other), "--out", str(tmp_path / "report")]) == 0
    markdown = (tmp_path / "report" / "results.md").read_text()
    lines = markdown.split("## Throughput and memory", 1)[1].split("##", 1)[0].splitlines()
    header = next(line for line in lines if line.startswith("| Run"))
    columns = [c.strip() for c in header.strip("|").split("|")]
    assert columns[columns.index("img/s") + 1] == "x peer (8 workers)"
    ratios = {}
    for line in lines:
        if line.startswith("| `"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            ratios[cells[0].strip("`")] = (
                cells[columns.index("Strategy")],
                cells[columns.index("x peer (8 workers)")],
            )
    assert ratios == {
        "peer-w0": ("single (HF example)", "0.50x"),
        "peer-w8": ("single (HF example)", "1.00x"),
        "ours-b256": ("single", "2.50x"),
        "ours-b512-regions": ("single", "3.60x"),
        "peer-elsewhere": ("single (HF example)", "1.00x"),
        "ours-elsewhere": ("single", "20.00x"),
    }
    assert "x peer (8 workers): img/s over that of the peer's 8-worker run of the same folder" in markdown

    plain = tmp_path / "plain"  # no peer: no column
    plain.mkdir()
    (plain / "ours.json").write_text(json.dumps(record("ours", 2500.0)))
    assert bench_report.main([str(plain)]) == 0
    assert "x peer" not in (plain / "results.md").read_text()


# --------------------------------------------------------------------------------------------------- probes


def test_wall_clock_times_whole_jobs_of_ours_and_the_peer(cifar_like, tiny_vit, tmp_path):
    """benchmarks/wall_clock.py: the peer and our recipe as typed, each a whole process timed from outside, with the
    phases each reports; caches in the job's own folder (a warm rerun reuses them); the record redraws from its JSON."""
    assets = tmp_path / "assets"
    assets.mkdir()
    (assets / "vit-base").symlink_to(tiny_vit)
    (assets / "cifar100").symlink_to(cifar_like)
    out, work = tmp_path / "record", tmp_path / "work"
    runs = "epoch-peer-w16-cold,epoch-ours-cold"
    argv = [sys.executable, "-m", "benchmarks.wall_clock", "--assets", str(assets), "--out", str(out), "--work",
            str(work), "--only", runs, "--extra", "--use_cpu true --bf16 false --dataloader_num_workers 0"]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    record = json.loads((out / "wall_clock.json").read_text())
    by_name = {run["name"]: run for run in record["runs"]}
    assert list(by_name) == runs.split(",")
    for name, run in by_name.items():
        m = run["metrics"]
        assert run["exit"] == 0 and 0 < m["time_total_s"] <= run["wall_s"], (name, run)
        assert {"time_startup_s", "time_train_s", "time_evaluate_s", "train_first_step_after_start_s"} <= set(m), name
        assert m["time_startup_s"] < m["train_first_step_after_start_s"] < run["wall_s"], (name, m)
    assert "recipes/vit-base/cifar100/config_full.yaml" in by_name["epoch-ours-cold"]["command"]
    assert "--train_val_split 0.1" in by_name["epoch-peer-w16-cold"]["command"]
    assert 0 <= by_name["epoch-peer-w16-cold"]["metrics"]["eval_accuracy"] <= 1  # the example's evaluation ran
    caches = work / "caches" / "epoch-ours-0" / "datasets"
    assert caches.is_dir() and any(caches.iterdir())  # the decoded images a warm rerun reads
    table = (out / "wall_clock.md").read_text()
    assert "| epoch | `epoch-peer-w16-cold` | 0 |" in table and "1.00x" in table
    assert 2_000 < (out / "wall_clock.png").stat().st_size <= bench_index.MAX_PNG_BYTES  # drawn, and small
    assert "**Question:** how long does a whole job take" in (out / "README.md").read_text()
    (out / "wall_clock.md").unlink()
    redraw = [sys.executable, "-m", "benchmarks.wall_clock", "--redraw", "--out", str(out)]
    assert subprocess.run(redraw, capture_output=True, cwd=ROOT, timeout=120).returncode == 0
    assert (out / "wall_clock.md").read_text() == table


def test_wall_clock_runs_the_photos_job_on_a_folder_it_writes(cifar_like, tiny_vit, tmp_path):
    """wall_clock's photos200 job: the JPEG folder written when missing, the peer on --train_dir/--validation_dir,
    ours on the food101 recipe (ours-once: the decoded copy), and each run's datasets-cache bytes in JSON and table."""
    from benchmarks import wall_clock

    assets, out, work = tmp_path / "assets", tmp_path / "record", tmp_path / "work"
    assets.mkdir()
    (assets / "vit-base").symlink_to(tiny_vit)
    (assets / "cifar100").symlink_to(cifar_like)  # make_assets.py finds both: nothing to make
    folder = work / "jpegs_200"
    plan = {wall_clock.Run(*entry).name: wall_clock.Run(*entry) for entry in wall_clock.PLAN}
    ours = wall_clock.argv_of(plan["photos200-ours-cold"], assets, tmp_path / "o", folder)
    assert ours[1:] == ["run_image_classification.py", "--config", "recipes/vit-base/food101/config_full.yaml",
                        "--model_name_or_path", str(assets / "vit-base"), "--dataset_name", str(folder),
                        "--output_dir", str(tmp_path / "o"), "--report_to", "none", "--max_steps", "200"]  # fmt: skip
    once = wall_clock.argv_of(plan["photos200-ours-once-cold"], assets, tmp_path / "o", folder)
    assert once == [*ours, "--decode_images", "once"]
    epoch = wall_clock.argv_of(plan["photos-epoch-ours-cold"], assets, tmp_path / "o", folder)
    assert epoch == [*ours[:-2], "--num_train_epochs", "1"]  # the same folder and recipe, one whole epoch
    peer_epoch = wall_clock.argv_of(plan["photos-epoch-peer-w16-cold"], assets, tmp_path / "p", folder)
    assert f"{folder}/train" in peer_epoch and peer_epoch[-2:] == ["--do_eval", "true"]
    assert "--num_train_epochs" in peer_epoch and "--max_steps" not in peer_epoch
    runs = "photos200-peer-w16-cold,photos200-ours-once-cold"  # tiny steps: --extra's arguments come last and win
    extra = "--use_cpu true --bf16 false --dataloader_num_workers 0 --max_steps 2 --per_device_train_batch_size 4"
    argv = [sys.executable, "-m", "benchmarks.wall_clock", "--assets", str(assets), "--out", str(out), "--work",
            str(work), "--only", runs, "--photos", "200", "--extra", extra + " --per_device_eval_batch_size 8"]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert len(list((folder / "train").rglob("*.jpg"))) + len(list((folder / "validation").rglob("*.jpg"))) == 200
    record = json.loads((out / "wall_clock.json").read_text())
    by_name = {run["name"]: run for run in record["runs"]}
    assert list(by_name) == runs.split(",") and record["photos"]["images"] == 200
    peer, copy = by_name["photos200-peer-w16-cold"], by_name["photos200-ours-once-cold"]
    assert f"--train_dir {folder}/train --validation_dir {folder}/validation" in peer["command"]
    assert "--dataset_name" not in peer["command"] and "--per_device_eval_batch_size 256" in peer["command"]
    assert "--decode_images once" in copy["command"] and "food101/config_full.yaml" in copy["command"]
    assert all(run["exit"] == 0 for run in by_name.values()), by_name
    assert copy["cache_bytes"] > 0 and copy["metrics"]["data_decode_seconds"] > 0  # the decoded copy on disk
    table = (out / "wall_clock.md").read_text()
    assert "| datasets cache |" in table and f"{copy['cache_bytes'] / 2**20:,.1f} MiB |" in table


# --------------------------------------------------------------------------------------------------- the lab's shape


def test_the_index_lists_every_record_and_every_record_keeps_the_scheme():
    """benchmarks/results/README.md is what `python -m benchmarks.index` writes from the folders today, and every
    record is `<date>_<suite>_<gpus>x<card>` with a README (question, headline, commit, a written conclusion), a
    JSON and small figures; README.md and docs/ link only records that exist."""
    assert bench_index.main(["--check"]) == 0


def test_the_index_refuses_a_record_off_the_scheme(tmp_path, monkeypatch):
    results = tmp_path / "results"
    good, bad = results / "2026-01-02_peer_1xH200", results / "h200_peer"
    for folder in (good, bad):
        folder.mkdir(parents=True)
        (folder / "a.json").write_text("{}")
    (good / "README.md").write_text("# Peer\n\n**Question:** Q?\n\n**Headline:** 2x\n\n**Commit:** abc1234\n")
    (bad / "README.md").write_text(common.CONCLUSION_TO_WRITE)
    from PIL import Image

    Image.effect_noise((400, 400), 100).save(good / "noise.png")  # incompressible: over 60 KB
    monkeypatch.setattr(bench_index, "RESULTS", results)
    monkeypatch.setattr(bench_index, "INDEX", results / "README.md")
    monkeypatch.setattr(bench_index, "REMOVED", results / "removed.yaml")  # none
    monkeypatch.setattr(bench_index, "cited", lambda: {"2026-01-02_peer_1xH200", "gone"})
    assert bench_index.main([]) == 1
    index = (results / "README.md").read_text()
    assert index.index("2026-01-02_peer_1xH200/README.md") < index.index("h200_peer/README.md")  # newest first
    assert "| 2x | abc1234 | **current** |" in index
    wrong = bench_index.check(bench_index.records(), [], bench_index.cited())
    assert "h200_peer: its name is not <date>_<suite>_<gpus>x<card>" in wrong
    assert "h200_peer: its README's conclusion is still to write" in wrong
    assert any(w.startswith("2026-01-02_peer_1xH200: noise.png is ") for w in wrong)
    assert "README.md or docs/ link benchmarks/results/gone, which is no record folder" in wrong
    assert not [w for w in wrong if "out of date" in w]


def test_record_folders_are_named_by_date_suite_and_machine():
    import datetime

    day = datetime.date(2026, 1, 2)
    assert common.record_folder("peer", 1, "NVIDIA H200", day).name == "2026-01-02_peer_1xH200"
    assert common.record_folder("acceptance", 2, "NVIDIA H100 80GB HBM3", day).name == "2026-01-02_acceptance_2xH100"
    assert common.record_folder("transfer", 0, "CPU (2 cores, x86_64)", day).name == "2026-01-02_transfer_1xCPU"
    assert bench_index.NAME.match(common.record_folder("zero3_tuning", 4, "H200", day).name)


def test_benchmark_modules_import_no_probe_and_form_no_circle():
    """Shared code lives in benchmarks/common.py; the runner may use the report, the strategy report the report's
    loader; no other import between modules of benchmarks/ (a probe stands alone), hence no circle."""
    allowed = {("run", "report"), ("strategy_report", "report"), ("acceptance", "make_assets")}
    edges = set()
    for path in BENCH.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("benchmarks"):
                names = [node.module.split(".")[1]] if "." in node.module else [a.name for a in node.names]
                edges |= {(path.stem, name) for name in names if name != "common"}
            elif isinstance(node, ast.Import | ast.ImportFrom):  # the old style: a sibling script on sys.path
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                edges |= {(path.stem, n) for n in names if (BENCH / f"{n}.py").is_file() and n != path.stem}
    assert edges <= allowed, edges - allowed
    assert not [edge for edge in edges if edge[0] == "common"]  # common imports nothing of benchmarks/


def test_wall_clock_refuses_a_run_name_it_does_not_plan(capsys):
    from benchmarks import wall_clock

    with pytest.raises(SystemExit):
        wall_clock.main(["--only", "photos200-ours-cold,stream1-ours-warm"])
    assert "--only: no run named stream1-ours-warm; the runs: " in capsys.readouterr().err


def test_wall_clock_streams_the_photos_as_parquet_files_of_few_row_groups(tmp_path):
    """wall_clock's stream jobs: the photos folder written again as parquet files of image bytes (train in 8 or 1
    files, of one row group or 100-row groups), typed as datasets' Image and ClassLabel, streamed by our recipe."""
    import datasets
    import pyarrow.parquet as pq

    from benchmarks import wall_clock
    from tools.jpeg_folder import write_folder, write_parquet

    photos = tmp_path / "jpegs_60"
    write_folder(photos, 60, 3, validation=0.1, sides=(40, 52), workers=1)
    write_parquet(photos, tmp_path / "one", files=1)
    write_parquet(photos, tmp_path / "groups", files=2, row_group=10)
    (one,) = sorted((tmp_path / "one").glob("train-*.parquet"))
    assert one.name == "train-00000-of-00001.parquet" and pq.ParquetFile(one).metadata.num_row_groups == 1
    shards = sorted((tmp_path / "groups").glob("train-*.parquet"))
    assert [pq.ParquetFile(s).metadata.num_row_groups for s in shards] == [3, 3]  # 27 rows each, 10 a group
    stream = datasets.load_dataset("parquet", data_dir=str(tmp_path / "groups"), split="train", streaming=True)
    assert isinstance(stream.features["image"], datasets.Image) and stream.features["label"].names[0] == "class_0000"
    assert sum(1 for _ in stream) == 54 and (tmp_path / "groups" / "validation-00000-of-00001.parquet").is_file()
    plan = {wall_clock.Run(*entry).name: wall_clock.Run(*entry) for entry in wall_clock.PLAN}
    argv = wall_clock.argv_of(plan["stream1-rg100-ours-cold"], tmp_path, tmp_path / "o", photos)
    assert argv[argv.index("--dataset_name") + 1] == str(tmp_path / "jpegs_60_stream1-rg100")
    assert "--streaming" in argv and argv[argv.index("--max_steps") + 1] == "200"
    assert wall_clock.STREAMS["stream1-rg100"] == (1, 100) and wall_clock.STREAMS["stream8"] == (8, None)

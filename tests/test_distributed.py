"""Distributed strategies on the CPU: 2 processes over gloo, through `accelerate launch` and `deepspeed`.

Every launched run goes through tools/rank_report.py (the script, plus a report per rank) and the tests assert on
it: the world size, the wrapper the Trainer actually trained (DistributedDataParallel or
DeepSpeedEngine), the ZeRO stage and how much of the parameters / optimizer states each rank holds. A launcher that
silently fell back to one process or to plain DDP fails here. fp32, fixed seed, no random augmentation and the
same global batch as the single-process baseline (8), so the per-step losses must match it within 1e-4.

accelerate runs FSDP2 only on GPUs (the script refuses it on the CPU), but torch's fully_shard shards over gloo: the
FSDP2 tests apply accelerate's own FSDP2 preparation, configured by `accelerate launch` from our YAMLs, to a tiny ViT
in 2 processes (tests/fsdp2_cpu_worker.py); with LoRA they also save the adapter through the Trainer's own FSDP2
save and merge it. The whole script under FSDP2 is proven on GPUs by the acceptance suite (benchmarks/acceptance.py).
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import types
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import ROOT, pattern_images, save_tiny_vit, write_parquet_splits
from conftest import logged_losses as losses
from safetensors.torch import load_file

from vit_recipes.core.errors import RecipeError
from vit_recipes.core.launch import SHM_BUFFER_PREFIX
from vit_recipes.plan.memory import AUTOCAST

CLASSES = 10
STEPS = 20
GLOBAL_BATCH = 8
REL_TOL = 1e-4
TIMEOUT = 420
RANK_REPORT_SCRIPT = "tools/rank_report.py"  # the script, plus what each rank trained with
RANK_REPORT_DIR = "rank_reports"
# The slowest tests as two more pytest-xdist groups beside the file's own (tests/conftest.py): `make test` runs them on
# other workers. Each group builds the module fixtures it uses; the ZeRO-2 run's check sits in the group that resumes it.
RESUME_GROUP = pytest.mark.xdist_group("test_distributed-resume")
LAUNCHERS_GROUP = pytest.mark.xdist_group("test_distributed-launchers")


# ------------------------------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def ten_classes(tmp_path_factory) -> Path:
    """10 learnable classes of 16x16 images: train (20 per class) and validation (4 per class)."""
    from datasets import ClassLabel, Features, Image
    from PIL import Image as PILImage

    features = Features({"image": Image(), "label": ClassLabel(names=[f"class_{i}" for i in range(CLASSES)])})
    splits = {}
    for name, per_class, seed in (("train", 20, 3), ("validation", 4, 4)):
        labels = np.repeat(np.arange(CLASSES), per_class)
        images = pattern_images(labels, 16, seed=seed)
        splits[name] = {"image": [PILImage.fromarray(x) for x in images], "label": labels}
    return write_parquet_splits(tmp_path_factory.mktemp("ten-classes"), splits, features)


@pytest.fixture(scope="module")
def same_head_vit(tmp_path_factory) -> Path:
    """A tiny ViT whose head already has the dataset's 10 labels: nothing is initialised randomly at load."""
    return save_tiny_vit(tmp_path_factory.mktemp("vit-10"), CLASSES, label_names=True)


@pytest.fixture(scope="module")
def new_head_vit(tmp_path_factory) -> Path:
    """A tiny ViT with a 7-class head: the script replaces it (the path ZeRO-3 loading needs help with)."""
    return save_tiny_vit(tmp_path_factory.mktemp("vit-7"), 7)


@pytest.fixture(autouse=True)
def _forget_deepspeed_config():
    """TrainingArguments(deepspeed=...) registers a process-global config; in-process tests must not leak it."""
    yield
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()


def deepspeed_shm_buffers() -> set[str]:
    """The DeepSpeed buffers in /dev/shm that no live process maps: those of a test running at the same time
    (pytest -n) are still mapped by its ranks."""
    mapped: set[str] = set()
    for maps in glob.glob("/proc/[0-9]*/maps"):
        with contextlib.suppress(OSError), open(maps) as f:  # processes come and go
            mapped.update(line.split()[-1] for line in f if SHM_BUFFER_PREFIX in line)
    return set(glob.glob(SHM_BUFFER_PREFIX + "*")) - mapped


PORTS: list[int] = []  # every port free_port handed out in this process, in order


@pytest.fixture(autouse=True)
def _no_shared_memory_left_behind():
    """DeepSpeed's CPU all-reduce leaves a 69 MB buffer per rank in /dev/shm unless the script removes it at exit.
    Only this test's runs' buffers count (DeepSpeed names each after its run's master port, which free_port gave):
    a test on another worker may leave a killed run's buffers for that run's next start to remove."""
    before, first = deepspeed_shm_buffers(), len(PORTS)
    yield
    ours = [f"_{port}_" for port in PORTS[first:]]
    left = {name for name in deepspeed_shm_buffers() - before if any(port in name for port in ours)}
    assert not left, f"DeepSpeed shared-memory buffers left behind: {sorted(left)}"


def run_args(data, model, out, *extra, steps=STEPS):
    return [
        "--dataset_name",
        str(data),
        "--model_name_or_path",
        str(model),
        "--output_dir",
        str(out),
        "--do_train",
        "true",
        "--do_eval",
        "true",
        "--max_steps",
        str(steps),
        "--learning_rate",
        "3e-3",
        "--lr_scheduler_type",
        "constant",
        "--crop_scale_min",
        "1",  # the device transforms draw from each rank's global RNG: no random augmentation for parity
        "--hflip_prob",
        "0",
        "--per_device_eval_batch_size",
        "20",  # 40 validation images = 2 full batches on 1 process, 1 on each of 2: no padded eval batch
        "--dataloader_num_workers",
        "0",
        "--use_cpu",
        "true",
        "--report_to",
        "none",
        "--plots",
        "false",
        "--logging_steps",
        "1",
        "--eval_strategy",
        "no",
        "--save_strategy",
        "no",
        "--seed",
        "42",
        *map(str, extra),
    ]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        PORTS.append(s.getsockname()[1])
        return PORTS[-1]


def tool(name: str) -> str:
    """The console script installed next to this Python (`accelerate`, `deepspeed`)."""
    local = Path(sys.executable).with_name(name)
    return str(local) if local.exists() else (shutil.which(name) or name)


def launch_env(**extra) -> dict:
    env = dict(os.environ)
    env.update({"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}, **extra)
    return env


def launch(name: str, command: list[str], env=None, cwd=ROOT) -> subprocess.CompletedProcess:
    result = subprocess.run(command, cwd=cwd, env=env or launch_env(), capture_output=True, text=True, timeout=TIMEOUT)
    if result.returncode != 0:
        tail = (result.stdout + result.stderr)[-6000:]
        pytest.fail(f"{name} exited {result.returncode}:\n{tail}")
    return result


def accelerate(config: str, *launch_flags, processes: int = 2, script=RANK_REPORT_SCRIPT) -> list[str]:
    return [
        tool("accelerate"),
        "launch",
        "--config_file",
        f"accelerate_configs/{config}",
        "--num_processes",
        str(processes),
        "--main_process_port",
        str(free_port()),
        *map(str, launch_flags),
        str(script),
    ]


def deepspeed(processes: int = 2) -> list[str]:
    return [
        tool("deepspeed"),
        "--num_gpus",
        str(processes),
        "--master_port",
        str(free_port()),
        RANK_REPORT_SCRIPT,
    ]


# ------------------------------------------------------------------------------------------------- checks


def reports(out: Path, world: int = 2) -> list[dict]:
    files = sorted((out / RANK_REPORT_DIR).glob("rank*.json"))
    found = [json.loads(f.read_text()) for f in files]
    assert sorted(r["rank"] for r in found) == list(range(world)), f"rank reports: {[f.name for f in files]}"
    for r in found:
        assert r["world_size"] == world and r["args_world_size"] == world, r
        assert r["global_step"] > 0
    return found


def assert_sharded(found: list[dict], *, params: bool, optimizer: bool) -> None:
    """Each rank holds about 1/world of what is sharded, and together they hold all of it."""
    world = len(found)
    full = found[0]["param_numel_full"]
    for kind, sharded in (("param_numel_local", params), ("optimizer_state_numel_local", optimizer)):
        local = [r[kind] for r in found]
        if sharded:
            assert all(n <= full / world + 64 for n in local), (kind, local, full)  # + alignment padding
            assert sum(local) >= full, (kind, local, full)
        else:
            assert all(n == full for n in local), (kind, local, full)


def assert_parity(out: Path, baseline: Path) -> None:
    ours, theirs = losses(out), losses(baseline)
    assert len(ours) == len(theirs) == STEPS
    np.testing.assert_allclose(ours, theirs, rtol=REL_TOL, err_msg=f"per-step losses of {out.name} vs single")
    a, b = load_file(out / "model.safetensors"), load_file(baseline / "model.safetensors")
    assert set(a) == set(b)
    for key in a:  # 20 Adam steps amplify float-order noise on near-zero gradients: loose, still catches bugs
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=1e-3, msg=key)  # seen: <= 1.1e-4


def assert_reloads_and_scores_the_same(out: Path, data: Path, tmp_path: Path, run_script) -> None:
    """The saved folder is a plain model: from_pretrained without DeepSpeed/FSDP scores what the run reported."""
    assert (out / "model.safetensors").is_file() and not list(out.glob("pytorch_model*.bin"))
    reported = json.loads((out / "all_results.json").read_text())
    again = run_script(*run_args(data, out, tmp_path / f"reeval-{out.name}", "--do_train", "false"))
    assert again["eval_accuracy"] == pytest.approx(reported["eval_accuracy"], abs=1e-9)
    assert again["eval_loss"] == pytest.approx(reported["eval_loss"], rel=1e-5)


@pytest.fixture(scope="module")
def baseline(ten_classes, same_head_vit, tmp_path_factory) -> Path:
    """One process, per-device batch 8 = the global batch of every 2-process run below."""
    import run_image_classification

    out = tmp_path_factory.mktemp("single") / "run"
    run_image_classification.main(
        run_args(ten_classes, same_head_vit, out, "--per_device_train_batch_size", GLOBAL_BATCH)
    )
    return out


# ---------------------------------------------------------------------------------------- launched runs

DDP = "torch.nn.parallel.distributed.DistributedDataParallel"
DS_ENGINE = "deepspeed.runtime.engine.DeepSpeedEngine"


def with_torch_adamw(name: str, tmp_path: Path) -> Path:
    """ds_configs/NAME.json keeping torch's AdamW: the shipped offload files use DeepSpeedCPUAdam, whose C++ build
    alone takes minutes on a 2-core CI machine. Offloading itself is unchanged."""
    config = json.loads((ROOT / "ds_configs" / f"{name}.json").read_text())
    config.pop("optimizer")
    config["zero_force_ds_cpu_optimizer"] = False
    path = tmp_path / f"{name}_torch_adamw.json"
    path.write_text(json.dumps(config))
    return path


@dataclass(frozen=True)
class Launched:
    """A 2-process run of the script and what each rank must report. Per-device batch x accumulation x 2 = 8."""

    id: str
    # Both take the run's scratch folder (for generated configs); called at launch, so ports are picked then.
    launcher: Callable[[Path], list[str]]
    extra: Callable[[Path], tuple]  # script arguments after run_args' own
    expect: dict  # rank-report field -> value, on every rank
    params_sharded: bool
    optimizer_sharded: bool
    says: str = ""  # a line the run's output must hold


ZERO2 = Launched(  # checkpoints at steps 10 and 20: the ZeRO-2 resume tests start from 10
    "zero2-accelerate",
    lambda tmp: accelerate("zero2.yaml"),
    lambda tmp: ("--per_device_train_batch_size", 4, "--save_strategy", "steps", "--save_steps", 10),
    {"wrapper": DS_ENGINE, "zero_stage": 2, "distributed_type": "DEEPSPEED", "gradients_partitioned": True},
    params_sharded=False,
    optimizer_sharded=True,
)

LAUNCHED = [
    Launched(
        "ddp-accelerate",
        lambda tmp: accelerate("ddp.yaml", "--mixed_precision", "no"),
        lambda tmp: ("--per_device_train_batch_size", 4),
        {"wrapper": DDP, "distributed_type": "MULTI_CPU", "backend": "gloo", "is_deepspeed_enabled": False},
        params_sharded=False,
        optimizer_sharded=False,
    ),
    Launched(
        "zero1-deepspeed-accum",
        lambda tmp: deepspeed(),
        lambda tmp: (
            "--deepspeed",
            "ds_configs/zero1.json",
            "--per_device_train_batch_size",
            2,
            "--gradient_accumulation_steps",
            2,
        ),
        {"wrapper": DS_ENGINE, "zero_stage": 1, "gradients_partitioned": False, "gradient_accumulation_steps": 2},
        params_sharded=False,
        optimizer_sharded=True,
    ),
    ZERO2,
    Launched(
        # Gradient checkpointing; an evaluation at the epoch's end (--max_steps 20 stops mid-epoch: at the last step),
        # which the final metrics and reports reuse on both ranks. Parameters are sharded: had one rank predicted
        # again alone, the run would hang. The reused metrics equal the reloaded model's (assert_reloads...).
        "zero3-deepspeed-ckpt-eval",
        lambda tmp: deepspeed(),
        lambda tmp: (
            "--deepspeed",
            "ds_configs/zero3.json",
            "--per_device_train_batch_size",
            4,
            "--gradient_checkpointing",
            "true",
            "--eval_strategy",
            "epoch",
            "--log_level",
            "info",
        ),
        {"wrapper": DS_ENGINE, "zero_stage": 3, "gradient_checkpointing": True, "zero3_leaf_modules": ["ViTLayer"]},
        params_sharded=True,
        optimizer_sharded=True,
        says="Final validation metrics and reports reuse the evaluation at step 20",
    ),
    Launched(
        "zero2-offload-deepspeed",
        lambda tmp: deepspeed(),
        lambda tmp: ("--deepspeed", with_torch_adamw("zero2_offload", tmp), "--per_device_train_batch_size", 4),
        {
            "wrapper": DS_ENGINE,
            "zero_stage": 2,
            "offload_optimizer": True,
            "offload_param": False,
            "optimizer_state_device": "cpu",
        },
        params_sharded=False,
        optimizer_sharded=True,
    ),
    Launched(
        "zero3-offload-accelerate",  # accelerate_configs/zero3_offload.yaml, its JSON swapped on the command line
        lambda tmp: accelerate(
            "zero3_offload.yaml", "--deepspeed_config_file", with_torch_adamw("zero3_offload", tmp)
        ),
        lambda tmp: ("--per_device_train_batch_size", 4),
        {
            "wrapper": DS_ENGINE,
            "zero_stage": 3,
            "zero3_leaf_modules": ["ViTLayer"],  # one parameter gather per layer (ds_configs/zero3*.json)
            "offload_optimizer": True,
            "offload_param": True,
            "optimizer_state_device": "cpu",
        },
        params_sharded=True,
        optimizer_sharded=True,
    ),
]


@pytest.fixture(scope="module")
def launched(ten_classes, same_head_vit, tmp_path_factory):
    """Launches a row at most once per module: the zero2 run is both checked below and resumed."""
    outs: dict[str, Path] = {}

    def run(case: Launched) -> Path:
        if case.id not in outs:
            tmp = tmp_path_factory.mktemp(case.id)
            out = tmp / case.id
            result = launch(case.id, case.launcher(tmp) + run_args(ten_classes, same_head_vit, out, *case.extra(tmp)))
            (tmp / "output.txt").write_text(result.stdout + result.stderr)
            outs[case.id] = out
        return outs[case.id]

    return run


@pytest.mark.slow
@pytest.mark.parametrize(  # the ZeRO-2 row in the resume group, which resumes its run: launched once, not per group
    "case", [pytest.param(c, id=c.id, marks=[RESUME_GROUP] if c is ZERO2 else []) for c in LAUNCHED]
)
def test_launched_run_is_what_it_says_and_matches_one_process(
    case, launched, ten_classes, baseline, tmp_path, run_script
):
    """The launcher really ran the row's strategy, trained to the single-process losses and saved a plain model."""
    out = launched(case)
    found = reports(out)
    for r in found:
        for key, value in case.expect.items():
            assert r[key] == value, (key, r)
    assert_sharded(found, params=case.params_sharded, optimizer=case.optimizer_sharded)
    assert_parity(out, baseline)
    assert_reloads_and_scores_the_same(out, ten_classes, tmp_path, run_script)
    assert case.says in (out.parent / "output.txt").read_text()
    assert (out / "per_class_accuracy_validation.csv").is_file()


@pytest.fixture(scope="module")
def zero2_run(launched) -> Path:
    return launched(ZERO2)


# Resumed on 4 processes, the count a 2-GPU acceptance host cannot run; the same conversion and load on fewer (all
# -> 1) is proven by the GPU acceptance suite's `resume` part (a CPU row for 1 process cost CI ~25 s more).
@pytest.mark.slow
@pytest.mark.parametrize("processes", [4])
@RESUME_GROUP
def test_zero2_checkpoint_resumes_on_another_process_count(processes, zero2_run, ten_classes, same_head_vit, tmp_path):
    """Written by 2 processes, resumed by 4 with the same global batch: the checkpoint is converted once to
    DeepSpeed's universal format (ds_to_universal, into its own folder) and training continues with the losses of
    the uninterrupted 2-process run."""
    out = tmp_path / "resumed"
    out.mkdir()
    shutil.copytree(zero2_run / "checkpoint-10", out / "checkpoint-10")
    shutil.copy(zero2_run / "run_config.json", out / "run_config.json")
    args = run_args(ten_classes, same_head_vit, out, "--deepspeed", "ds_configs/zero2.json",
                    "--per_device_train_batch_size", GLOBAL_BATCH // processes)  # fmt: skip
    done = launch(f"zero2 from 2 processes resumed on {processes}", deepspeed(processes) + args)
    assert "was written by 2 DeepSpeed processes and this run has" in done.stdout + done.stderr
    assert (out / "checkpoint-10" / "latest_universal").read_text() == "global_step10_universal"
    assert json.loads((out / "trainer_state.json").read_text())["global_step"] == STEPS
    np.testing.assert_allclose(losses(out)[10:], losses(zero2_run)[10:], rtol=REL_TOL)  # steps 11-20


def test_a_deepspeed_resume_puts_each_fused_optimizer_step_beside_its_parameter(monkeypatch):
    """On GPUs a ZeRO-2 checkpoint resumed on another GPU count stopped at the first step ("state_steps is on cpu"):
    DeepSpeed's universal loader assigns the saved `step` as a CPU tensor, where fused and capturable AdamW need it
    on the parameter's device (torch's own load_state_dict moves it). A meta parameter stands in for the GPU; an
    offloaded (CPU) parameter and a plain AdamW keep their CPU steps, as torch keeps them."""
    from transformers import Trainer

    from vit_recipes.train.trainer import ImageClassificationTrainer

    on_gpu, offloaded, plain = (torch.nn.Parameter(torch.zeros(4, device=d)) for d in ("meta", "cpu", "meta"))
    fused = torch.optim.AdamW([on_gpu, offloaded], fused=True)
    unfused = torch.optim.AdamW([plain])

    def deepspeed_universal_load(self, checkpoint):  # what load_hp_checkpoint_state_from_checkpoint_dir leaves
        optimizer = self.optimizer.optimizer.optimizer
        for param in optimizer.param_groups[0]["params"]:
            optimizer.state[param]["step"] = torch.tensor(10.0)

    monkeypatch.setattr(Trainer, "_load_optimizer_and_scheduler", deepspeed_universal_load)
    for optimizer in (fused, unfused):
        trainer = ImageClassificationTrainer.__new__(ImageClassificationTrainer)
        trainer.is_deepspeed_enabled = True
        wrapped = types.SimpleNamespace(optimizer=optimizer)  # DeepSpeed's ZeRO optimizer
        trainer.optimizer = types.SimpleNamespace(optimizer=wrapped)  # accelerate's
        trainer._load_optimizer_and_scheduler("checkpoint-10")
    assert fused.state[on_gpu]["step"].device == on_gpu.device and fused.state[on_gpu]["step"].dtype == torch.float32
    assert fused.state[offloaded]["step"].device.type == "cpu" and unfused.state[plain]["step"].device.type == "cpu"


@pytest.mark.slow
@LAUNCHERS_GROUP
def test_two_machines_over_loopback_with_the_slurm_script(ten_classes, new_head_vit, tmp_path):
    """scripts/slurm/train.sbatch with a stand-in `srun` that starts its one task per "node" on this host.

    Two machines of one process each, ZeRO-3 through accelerate's multi-node flags (machine rank and main address
    from SLURM), starting from a checkpoint whose head is replaced: the backbone must arrive intact (learning rate
    ~0) even though ZeRO-3 loads through deepspeed.zero.Init.
    """
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(
        "#!/usr/bin/env bash\n# stand-in: one task per node, all on this host\n"
        'while [[ "$1" == --* ]]; do shift; done\n'
        'pids=(); for ((i = 0; i < SLURM_NNODES; i++)); do SLURM_PROCID=$i SLURM_NODEID=$i "$@" & pids+=($!); done\n'
        'rc=0; for p in "${pids[@]}"; do wait "$p" || rc=$?; done; exit $rc\n'
    )
    (bin_dir / "scontrol").write_text("#!/usr/bin/env bash\necho 127.0.0.1\n")
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    out = tmp_path / "two-nodes"
    env = launch_env(
        PATH=f"{bin_dir}:{Path(sys.executable).parent}:{os.environ['PATH']}",
        SLURM_NNODES="2",
        SLURM_JOB_NODELIST="node[1-2]",
        GPUS_PER_NODE="1",
        MASTER_PORT=str(free_port()),
        ACCELERATE_CONFIG="accelerate_configs/zero3.yaml",
        TRAIN_SCRIPT=RANK_REPORT_SCRIPT,
    )
    args = run_args(ten_classes, new_head_vit, out, "--per_device_train_batch_size", 4, steps=2)
    args[args.index("--learning_rate") + 1] = "1e-12"
    launch("2 machines x 1 process, zero3 (slurm script)", ["bash", "scripts/slurm/train.sbatch", *args], env=env)
    found = reports(out)
    assert {r["rank"] for r in found} == {0, 1}
    for r in found:
        assert r["zero_stage"] == 3 and r["wrapper"].endswith("DeepSpeedEngine"), r
    assert_sharded(found, params=True, optimizer=True)
    saved, original = load_file(out / "model.safetensors"), load_file(new_head_vit / "model.safetensors")
    assert saved["classifier.weight"].shape == (CLASSES, 32) and saved["classifier.weight"].abs().sum() > 0
    backbone = [k for k in original if not k.startswith("classifier.")]
    assert backbone and set(backbone) <= set(saved)
    for key in backbone:
        torch.testing.assert_close(saved[key], original[key], rtol=0, atol=1e-6, msg=key)


# ------------------------------------------------------------------------------- bad input: one line each


def parse(*extra, data="data", model="model", out=None):
    import tempfile

    from vit_recipes.core.arguments import parse_args

    out = out or tempfile.mkdtemp(prefix="vit-recipes-test-")  # configure() locks it: never the repository's out/
    return parse_args(
        ["--dataset_name", data, "--model_name_or_path", str(model), "--output_dir", str(out), "--report_to", "none"]
        + list(map(str, extra))
    )


def check(*extra, **kwargs):
    """Plan the run (its checks decide) and apply the plan, as the script does; return its strategy."""
    from vit_recipes.plan.plan import build_plan, configure

    args = parse(*extra, **kwargs)
    plan = build_plan(args)
    configure(plan, args)
    return plan.strategy, args


def ds_file(tmp_path, **changes) -> Path:
    config = json.loads((ROOT / "ds_configs/zero2.json").read_text())
    for dotted, value in changes.items():
        node = config
        *parents, last = dotted.split("__")
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config))
    return path


def test_deepspeed_config_conflicts_with_the_arguments(tmp_path):
    fixed = ds_file(tmp_path, train_micro_batch_size_per_gpu=8)
    with pytest.raises(RecipeError) as err:
        check("--deepspeed", fixed, "--use_cpu", "true", "--per_device_train_batch_size", 16)
    message = str(err.value)
    assert "train_micro_batch_size_per_gpu=8 vs --per_device_train_batch_size 16" in message
    assert '"auto"' in message and "\n" not in message
    check("--deepspeed", fixed, "--use_cpu", "true", "--per_device_train_batch_size", 8)  # matching: fine


def test_fixed_bf16_in_the_deepspeed_config_conflicts_with_fp16(tmp_path, monkeypatch):
    from vit_recipes.plan import plan

    monkeypatch.setattr(plan, "device_kind", lambda t: "cuda")  # as on a GPU: fp16 itself is fine there
    fixed = ds_file(tmp_path, bf16__enabled=True)
    with pytest.raises(RecipeError, match=r"bf16.enabled=true vs --bf16 false"):
        check("--deepspeed", fixed, "--use_cpu", "true", "--fp16", "true")


def test_torch_autocast_fixed_in_the_deepspeed_config_conflicts_with_the_precision_asked_for(tmp_path):
    with pytest.raises(RecipeError, match=r"torch_autocast.enabled=true vs --bf16/--fp16 false"):
        check("--deepspeed", ds_file(tmp_path, torch_autocast__enabled=True), "--use_cpu", "true")
    fp16 = ds_file(tmp_path, torch_autocast__enabled=True, torch_autocast__dtype="torch.float16")
    with pytest.raises(RecipeError, match=r'torch_autocast.dtype="float16" vs --bf16 true'):
        check("--deepspeed", fp16, "--use_cpu", "true", "--bf16", "true")


def test_fp16_or_a_16_bit_mode_beside_torch_autocast_is_refused(tmp_path, monkeypatch):
    from vit_recipes.plan import checks, plan

    monkeypatch.setattr(plan, "device_kind", lambda t: "cuda")  # as on a GPU: fp16 itself is fine there
    monkeypatch.setattr(checks, "gpu_bf16_ok", lambda: True)
    with pytest.raises(RecipeError, match="fp16 loss scaling clips gradients by their scaled norm"):
        check("--deepspeed", "ds_configs/zero2.json", "--use_cpu", "true", "--fp16", "true")
    both = ds_file(tmp_path, bf16__enabled="auto")
    with pytest.raises(RecipeError, match='both "torch_autocast" and an enabled or "auto" "bf16" section'):
        check("--deepspeed", both, "--use_cpu", "true", "--bf16", "true")


def test_deepspeeds_16_bit_mode_says_its_weights_learn_more_slowly(tmp_path, caplog):
    bf16_mode = ds_file(tmp_path, torch_autocast__enabled=False, bf16__enabled="auto")  # as the offload configs
    with caplog.at_level("INFO", logger="vit_recipes.plan.plan"):
        check("--deepspeed", bf16_mode, "--use_cpu", "true", "--bf16", "true")
    assert "bf16 (16-bit weights) on cpu" in caplog.text
    assert "trains in DeepSpeed's bf16 mode: bf16 weights, which learn more slowly" in caplog.text
    caplog.clear()
    with caplog.at_level("INFO", logger="vit_recipes.plan.plan"):
        check("--deepspeed", "ds_configs/zero2.json", "--use_cpu", "true", "--bf16", "true")
    assert "fp32 weights) on cpu" in caplog.text and "learn more slowly" not in caplog.text


@pytest.mark.parametrize("launcher", ["deepspeed", "accelerate"])
def test_bf16_goes_to_deepspeeds_autocast_and_the_trainers_is_off(launcher, monkeypatch, caplog):
    """Under a shipped ZeRO config the Trainer's --bf16 would turn DeepSpeed's bf16 mode on (bf16 weights) beside
    its torch_autocast: the plan fills torch_autocast's "auto" fields and switches the Trainer's off, in the dict
    DeepSpeed gets (accelerate's plugin, built when the arguments were parsed, had switched bf16 on)."""
    if launcher == "accelerate":
        monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
        monkeypatch.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", "ds_configs/zero3.json")
        args = parse("--use_cpu", "true", "--bf16", "true")
    else:
        args = parse("--deepspeed", "ds_configs/zero2.json", "--use_cpu", "true", "--bf16", "true")
    from vit_recipes.plan.plan import build_plan, configure

    with caplog.at_level("INFO", logger="vit_recipes.plan.plan"):
        plan = build_plan(args)
    configure(plan, args)
    t, config = args.training, args.training.deepspeed_plugin.deepspeed_config
    assert plan.precision == "bf16" and plan.strategy.autocast
    assert "bf16 (DeepSpeed's torch_autocast, fp32 weights) on cpu" in caplog.text
    assert config["torch_autocast"] == {"enabled": True, "dtype": "bfloat16"}
    assert not config.get("bf16", {}).get("enabled") and not config.get("fp16", {}).get("enabled")
    assert (t.bf16, t.fp16, t.mixed_precision) == (False, False, "no")
    from transformers.integrations.deepspeed import deepspeed_config

    assert deepspeed_config()["torch_autocast"] == config["torch_autocast"]  # what ZeRO-3's model init reads


def test_fp16_on_the_cpu_is_refused():
    with pytest.raises(RecipeError, match="fp16 needs a GPU"):
        check("--use_cpu", "true", "--fp16", "true")


def test_bf16_on_a_gpu_without_it_is_refused(monkeypatch):
    from vit_recipes.plan import checks, plan

    monkeypatch.setattr(plan, "device_kind", lambda t: "cuda")
    monkeypatch.setattr(checks, "gpu_bf16_ok", lambda: False)
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")  # what accelerate_configs/ddp.yaml sets
    with pytest.raises(RecipeError, match="bf16 is not supported by this GPU"):
        check("--use_cpu", "true")


def test_one_process_seeing_several_gpus_is_refused(monkeypatch):
    """Seen on H200s: a lone process with 2 GPUs visible ran ViT-B at 421 img/s under the Trainer's DataParallel,
    against 2,561 on one GPU."""
    from vit_recipes.plan import checks, plan

    monkeypatch.setattr(plan, "device_kind", lambda t: "cuda")
    monkeypatch.setattr(checks, "visible_gpus", lambda: 2)
    with pytest.raises(
        RecipeError, match=r"2 GPUs are visible to one process: .*DataParallel.*CUDA_VISIBLE_DEVICES=0"
    ):
        check("--use_cpu", "true")
    check("--use_cpu", "true", "--deepspeed", ROOT / "ds_configs/zero2.json")  # a DeepSpeed process owns one GPU
    monkeypatch.setattr(checks, "visible_gpus", lambda: 1)
    check("--use_cpu", "true")


def test_more_processes_than_gpus_is_refused_before_parsing(monkeypatch):
    from vit_recipes.core.launch import check_processes

    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(RecipeError, match="4 processes on this machine but only 2 GPU"):
        check_processes(use_cpu=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(RecipeError, match="no GPU: each would train alone"):
        check_processes(use_cpu=False)
    check_processes(use_cpu=True)  # CPU processes over gloo: fine


def test_deepspeed_and_fsdp_together_are_refused(monkeypatch):
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    with pytest.raises(RecipeError, match="both DeepSpeed .* and FSDP are configured"):
        check("--deepspeed", ROOT / "ds_configs/zero2.json", "--use_cpu", "true")


def test_fsdp_on_the_cpu_is_refused(monkeypatch):
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    with pytest.raises(RecipeError, match="FSDP needs GPUs"):
        check("--use_cpu", "true")


def test_regional_compile_under_zero3_is_refused(monkeypatch):
    """Seen on 2 H200s (benchmarks/results/2026-11-22_compile_strategies_2xH200): ZeRO-3 + --torch_compile_regions ended 60 steps at a
    loss of 1.98 against 1.31 eager (DDP, ZeRO-2 and FSDP2 with it: 1.26-1.28)."""
    monkeypatch.setenv("ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION", "false")  # the flag sets it; restored after
    regions = ("--use_cpu", "true", "--torch_compile_regions", "true")
    for config in ("zero3.json", "zero3_offload.json", "zeropp.json"):
        with pytest.raises(
            RecipeError, match=f"{config}: --torch_compile_regions does not train correctly under ZeRO-3"
        ):
            check("--deepspeed", ROOT / "ds_configs" / config, *regions)
    check("--deepspeed", ROOT / "ds_configs/zero2.json", *regions)  # ZeRO-2 keeps it


def test_fsdp_turns_gradient_checkpointing_into_its_own(monkeypatch):
    from vit_recipes.plan import checks, plan

    monkeypatch.setattr(plan, "device_kind", lambda t: "cuda")
    monkeypatch.setattr(checks, "gpu_bf16_ok", lambda: True)
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_ACTIVATION_CHECKPOINTING", "false")
    found, args = check("--use_cpu", "true", "--gradient_checkpointing", "true")
    assert found.fsdp and found.fsdp_activation_checkpointing
    assert os.environ["FSDP_ACTIVATION_CHECKPOINTING"] == "true"
    assert not args.training.gradient_checkpointing  # no second checkpointing pass inside FSDP's


FSDP2_WORKER = "tests/fsdp2_cpu_worker.py"
FSDP2_RESUME_STEPS, FSDP2_SAVED_AT = 6, 3


def fsdp2_worker(checkpointing: bool, processes: int = 2) -> list[str]:
    """fsdp.yaml launching the FSDP2 worker; --fsdp_activation_checkpointing is what --gradient_checkpointing turns on
    (strategy.py; tested above)."""
    return accelerate("fsdp.yaml", "--mixed_precision", "no", "--fsdp_activation_checkpointing",
                      str(checkpointing).lower(), processes=processes, script=FSDP2_WORKER)  # fmt: skip


def single_process_run(model_dir: Path, steps: int, lora: bool = False):
    """The FSDP2 worker's loop in one process on the whole batch: the reference its sharded losses (and, with LoRA,
    its saved adapter) must match. Returns the losses and the trained model."""
    from fsdp2_cpu_worker import fixed_batches, load

    model = load(str(model_dir), lora)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3, weight_decay=0.0)
    losses = []
    for pixels, labels in fixed_batches(model.config, steps):
        loss = model(pixel_values=pixels, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, model


def check_saved_lora(out: Path, model_dir: Path, reference) -> None:
    """The worker's FSDP2 saves (see fsdp2_cpu_worker.save_adapter): the adapter file holds every LoRA weight and the
    head with their trained values, and both it and the merged model reload to the single-process trained model."""
    from fsdp2_cpu_worker import load
    from transformers import AutoModelForImageClassification

    from vit_recipes.model.adapters import load_model

    adapter = load_file(out / "adapter" / "adapter_model.safetensors")
    lora_keys = {
        f"base_model.model.vit.layers.{i}.attention.{proj}.lora_{ab}.weight"
        for i in range(2)
        for proj in ("q_proj", "v_proj")
        for ab in "AB"
    }
    assert set(adapter) == lora_keys | {"base_model.model.classifier.weight", "base_model.model.classifier.bias"}
    trained = load_file(out / "trained.safetensors")  # gathered from the shards, not through the save
    initial = dict(load(str(model_dir), lora=True).named_parameters())
    one_process = dict(reference.named_parameters())
    for key, value in adapter.items():
        name = key.replace(".weight", ".default.weight").replace(".bias", ".default.bias")
        name = name.replace("classifier.default.", "classifier.modules_to_save.default.")
        torch.testing.assert_close(value, trained[name], rtol=0, atol=0)
        torch.testing.assert_close(value, one_process[name].detach(), rtol=1e-4, atol=1e-5)  # measured: 1.5e-8
        assert not torch.equal(value, initial[name].detach()), f"{key} holds its initial values"
    assert all(adapter[k].abs().sum() > 0 for k in lora_keys if "lora_B" in k)  # lora_B starts at zero

    assert not (out / "merged" / "adapter_model.safetensors").exists()
    pixels = torch.randn(4, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = reference.eval()(pixel_values=pixels).logits
        from_adapter = load_model(out / "adapter", base_model_name_or_path=str(model_dir))(pixel_values=pixels).logits
        merged = AutoModelForImageClassification.from_pretrained(out / "merged").eval()(pixel_values=pixels).logits
    torch.testing.assert_close(merged, from_adapter, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(from_adapter, expected, rtol=1e-4, atol=1e-5)  # FSDP2 vs one process: 4e-8 measured


@pytest.mark.slow
@pytest.mark.parametrize(  # the full row reads the resume tests' run (fsdp2_two_process_run): launched once
    "lora, checkpointing",
    [pytest.param(False, True, id="full", marks=[RESUME_GROUP]),
     pytest.param(True, True, id="lora", marks=[LAUNCHERS_GROUP]),
     pytest.param(True, False, id="lora-no-checkpointing", marks=[LAUNCHERS_GROUP])],
)  # fmt: skip
def test_fsdp2_config_really_shards_vit(lora, checkpointing, same_head_vit, tmp_path, request):
    """fsdp.yaml, through `accelerate launch` and accelerate's own FSDP2 preparation, shards every ViT parameter in
    two halves (each layer checkpointed, patch embedding, root) and trains to the single-process losses.

    accelerate's default wrap list (ViTLayer + ViTEmbeddings) crashed here and on GPUs; the YAMLs name ViTLayer.
    fsdp_offload.yaml cannot run here (torch's CPUOffloadPolicy needs an accelerator): proven on GPUs only.
    With LoRA (our --use_peft wrapping), the frozen base and the adapters are sharded alike and only the adapters and
    the head train; then the adapter is saved as the script saves it (the Trainer's FSDP2 FULL_STATE_DICT save), and
    merged. With FSDP's activation checkpointing, peft saved the head alone on 2 H200s (the merge then failed: "missing
    adapter keys"); the same happened here until ImageClassificationTrainer._save saved through adapters.without_activation_wrappers.
    """
    if lora:
        steps, out = 4, tmp_path
        launch(
            "FSDP2 layout with fsdp.yaml",
            fsdp2_worker(checkpointing) + [str(same_head_vit), str(out), str(steps), "lora"],
        )
    else:
        steps, out = FSDP2_RESUME_STEPS, request.getfixturevalue("fsdp2_two_process_run")
    reports = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    expected, reference = single_process_run(same_head_vit, steps, lora)
    for report in reports:
        assert report["world_size"] == 2 and report["wrap_classes"] == ["ViTLayer"]
        assert report["activation_checkpointing"] == checkpointing
        assert report["checkpointed_layers"] == (2 if checkpointing else 0)
        units = report["fsdp_units"]
        assert units.count("ViTLayer") == 2 and units.count("ViTPatchEmbeddings") == 1, units
        assert (
            "ViTEmbeddings" not in units and units.count("PeftModel" if lora else "ViTForImageClassification") == 1
        ), units
        assert report["dtensor_params"] == report["params"], "every parameter is an FSDP2 shard"
        assert report["trainable_dtensors"] == report["trainable_params"] > 0
        if lora:  # query and value adapters (A and B) in 2 layers, plus the head's weight and bias
            assert report["trainable_params"] == 2 * 2 * 2 + 2, report
        assert abs(report["local_numel"] / report["full_numel"] - 0.5) < 0.05, report
        np.testing.assert_allclose(report["losses"], expected, rtol=REL_TOL)
        if lora:
            assert report["saved"] == ["adapter", "merged"]
    if lora:
        check_saved_lora(out, same_head_vit, reference)


def test_fsdp_wrap_list_holding_the_embedding_is_refused(monkeypatch):
    """accelerate's default for ViT (its _no_split_modules) wraps ViTEmbeddings; one line says what to wrap instead."""
    from transformers import ViTConfig, ViTForImageClassification

    from vit_recipes.plan.checks import check_fsdp_wrap
    from vit_recipes.plan.plan import read_strategy

    def fsdp():
        return read_strategy(types.SimpleNamespace(world_size=2))

    model = ViTForImageClassification(ViTConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2))
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.delenv("FSDP_TRANSFORMER_CLS_TO_WRAP", raising=False)
    with pytest.raises(RecipeError, match=r"cannot wrap ViTEmbeddings from .*_no_split_modules.*; wrap ViTLayer only"):
        check_fsdp_wrap(fsdp(), model)
    monkeypatch.setenv("FSDP_TRANSFORMER_CLS_TO_WRAP", "ViTLayer,ViTPatchEmbeddings")
    with pytest.raises(RecipeError, match="cannot wrap ViTPatchEmbeddings from the FSDP wrap list"):
        check_fsdp_wrap(fsdp(), model)
    monkeypatch.setenv("FSDP_TRANSFORMER_CLS_TO_WRAP", "ViTLayer")
    check_fsdp_wrap(fsdp(), model)
    monkeypatch.delenv("ACCELERATE_USE_FSDP")
    monkeypatch.delenv("FSDP_TRANSFORMER_CLS_TO_WRAP")
    check_fsdp_wrap(fsdp(), model)  # not FSDP: nothing to check


def test_zeropp_quantized_weights_refuse_a_head_that_does_not_split_into_groups_of_8(monkeypatch, tmp_path):
    """Seen on 4 H200s: ZeRO++ stopped at its first forward on the 100-label head (768 x 100 + 100 = 76,900
    values, 19,225 per GPU). Refused before training with the fix; the shipped ZeRO-3 and ZeRO++ (no qwZ) are not
    affected."""
    from types import SimpleNamespace

    from transformers import ViTConfig, ViTForImageClassification

    from vit_recipes.plan.checks import check_model
    from vit_recipes.plan.plan import read_strategy

    def vit(labels: int):
        config = ViTConfig(hidden_size=768, num_hidden_layers=1, num_attention_heads=12, intermediate_size=64)
        return ViTForImageClassification(config.__class__(**{**config.to_dict(), "num_labels": labels}))

    def args(config, world: int):
        return read_strategy(SimpleNamespace(deepspeed=str(ROOT / "ds_configs" / config), world_size=world))

    qwz = json.loads((ROOT / "ds_configs/zeropp.json").read_text())
    qwz["zero_optimization"]["zero_quantized_weights"] = True  # shipped off for this reason; users may turn it on
    (tmp_path / "zeropp_qwz.json").write_text(json.dumps(qwz))
    with pytest.raises(
        RecipeError,
        match=r"zeropp_qwz.json: .* classifier's 76,900 parameters split into 19,225 per "
        r"process over 4: set zero_quantized_weights to false",
    ):
        check_model(args(tmp_path / "zeropp_qwz.json", 4), vit(100))
    check_model(args(tmp_path / "zeropp_qwz.json", 4), vit(128))  # 769 x 128 / 4 = 24,608 = 8 x 3,076
    check_model(args(tmp_path / "zeropp_qwz.json", 8), vit(64))
    check_model(args("zeropp.json", 4), vit(100))  # as shipped: no quantized weights
    check_model(args("zero3.json", 4), vit(100))


def test_deepspeed_with_accelerates_cpu_mode_or_mixed_precision_flag_is_refused(monkeypatch):
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", str(ROOT / "ds_configs/zero2.json"))
    monkeypatch.setenv("ACCELERATE_USE_CPU", "true")
    with pytest.raises(RecipeError, match="pass --use_cpu true to the script instead"):
        check("--use_cpu", "true")
    monkeypatch.delenv("ACCELERATE_USE_CPU")
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    with pytest.raises(RecipeError, match="pass --bf16 true to the script"):
        check("--use_cpu", "true")


def test_offload_without_enough_host_memory_is_refused(tmp_path, monkeypatch):
    import psutil

    model = save_tiny_vit(tmp_path / "vit", CLASSES, label_names=True)
    monkeypatch.setattr(psutil, "virtual_memory", lambda: type("Mem", (), {"available": 1024})())
    for config in ("zero3_offload.json", "zero2_offload.json"):
        with pytest.raises(
            RecipeError, match=r"ZeRO-[23] \+ offload needs about .* GiB of host memory .* is available"
        ):
            check("--deepspeed", ROOT / "ds_configs" / config, "--use_cpu", "true", model=model)
    check("--deepspeed", ROOT / "ds_configs/zero3.json", "--use_cpu", "true", model=model)  # no offload: no check


def fake_deepspeed_checkpoint(folder: Path, world: int) -> Path:
    step = folder / "checkpoint-10"
    (step / "global_step10").mkdir(parents=True)
    (step / "latest").write_text("global_step10")
    (step / "trainer_state.json").write_text("{}")
    for rank in range(world):
        (step / "global_step10" / f"bf16_zero_pp_rank_{rank}_mp_rank_00_optim_states.pt").write_bytes(b"")
    return step


def test_resume_with_another_world_size_is_refused_only_under_zero3(tmp_path):
    from vit_recipes.plan.checks import check_resume, deepspeed_checkpoint_world_size
    from vit_recipes.plan.plan import read_strategy

    checkpoint = fake_deepspeed_checkpoint(tmp_path, world=4)
    assert deepspeed_checkpoint_world_size(checkpoint) == 4
    zero2 = parse("--deepspeed", ROOT / "ds_configs/zero2.json", "--use_cpu", "true")
    check_resume(read_strategy(zero2.training), str(checkpoint))  # converted to a universal checkpoint instead
    zero3 = parse("--deepspeed", ROOT / "ds_configs/zero3.json", "--use_cpu", "true")
    with pytest.raises(RecipeError, match="written by 4 ZeRO-3 processes and this run has 1: ZeRO-3 resumes on"):
        check_resume(read_strategy(zero3.training), str(checkpoint))
    plain = parse("--use_cpu", "true")
    with pytest.raises(RecipeError, match="is a DeepSpeed checkpoint"):
        check_resume(read_strategy(plain.training), str(checkpoint))
    check_resume(read_strategy(plain.training), None)


def test_conflict_stops_the_script_before_any_work(tmp_path, same_head_vit, run_script):
    fixed = ds_file(tmp_path, gradient_accumulation_steps=4)
    out = tmp_path / "out"
    with pytest.raises(RecipeError, match="gradient_accumulation_steps=4 vs --gradient_accumulation_steps 1"):
        run_script("--deepspeed", fixed, *run_args("./no/such/data", same_head_vit, out))  # data never read
    assert not out.exists()


# ----------------------------------------------------------------------------------------- config files

DS_JSONS = sorted((ROOT / "ds_configs").glob("*.json"))
YAMLS = sorted((ROOT / "accelerate_configs").glob("*.yaml"))


@pytest.mark.parametrize("path", DS_JSONS, ids=[p.name for p in DS_JSONS])
def test_deepspeed_configs_let_the_arguments_decide(path):
    config = json.loads(path.read_text())
    for key in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
        assert config[key] == "auto", key
    assert config["gradient_clipping"] == "auto"
    if path.stem in AUTOCAST:  # fp32 weights under DeepSpeed's autocast, as under DDP; the plan fills both fields
        assert config["torch_autocast"] == {"enabled": "auto", "dtype": "auto"} and "bf16" not in config
    else:  # the offload configs: DeepSpeed's bf16/fp16 mode (16-bit weights on the GPU)
        assert config["bf16"]["enabled"] == "auto" and config["fp16"]["enabled"] == "auto"
        assert config["fp16"]["loss_scale"] == 0, "fp16 uses dynamic loss scaling"
    zero = config["zero_optimization"]
    if zero["stage"] == 3:
        assert zero["stage3_gather_16bit_weights_on_model_save"] is True, "save a plain model"
    if "offload" in path.stem:
        assert zero["offload_optimizer"]["device"] == "cpu"
        assert (zero.get("offload_param", {}).get("device") == "cpu") == (zero["stage"] == 3)
    if "optimizer" in config:
        assert all(v == "auto" for v in config["optimizer"]["params"].values())
    if path.stem == "zeropp":
        # qwZ off: a ViT head of (hidden + 1) x labels values splits into multiples of 8 per GPU only when the label
        # count is a multiple of 8 x GPUs (none of the recipes' datasets); the script refuses it otherwise
        assert not zero["zero_quantized_weights"] and zero["zero_quantized_gradients"]
        assert zero["zero_hpz_partition_size"] > 1


@pytest.mark.parametrize("path", YAMLS, ids=[p.name for p in YAMLS])
def test_accelerate_configs_load_and_deepspeed_ones_point_to_their_json(path):
    from accelerate.commands.config.config_args import load_config_from_file

    config = load_config_from_file(str(path))
    assert config.compute_environment.value == "LOCAL_MACHINE" and not config.use_cpu
    if config.distributed_type.value == "DEEPSPEED":
        ds = config.deepspeed_config
        json_file = ROOT / ds["deepspeed_config_file"]
        assert json_file.is_file() and json_file.stem == path.stem, "one source of truth: the YAML names its JSON"
        assert set(ds) <= {"deepspeed_config_file", "deepspeed_multinode_launcher"}, "no field repeated in YAML"
        assert config.mixed_precision in (None, "no"), "precision comes from the JSON ('auto' = the arguments)"
    if config.distributed_type.value == "FSDP":
        fsdp = config.fsdp_config
        assert fsdp["fsdp_version"] == 2 and fsdp["fsdp_auto_wrap_policy"] == "TRANSFORMER_BASED_WRAP"
        assert fsdp["fsdp_reshard_after_forward"] is True
        assert fsdp["fsdp_activation_checkpointing"] is False, "--gradient_checkpointing is the one switch"
        assert fsdp["fsdp_state_dict_type"] == "FULL_STATE_DICT"
        assert fsdp["fsdp_offload_params"] is (path.stem == "fsdp_offload")
    if path.stem == "multinode":
        assert config.num_machines == 2 and config.main_process_ip and config.main_process_port


def test_fsdp_wraps_layers_that_exist_in_vit():
    """The class the FSDP YAMLs wrap must exist in transformers' ViT (a rename would silently wrap nothing)."""
    from accelerate.commands.config.config_args import load_config_from_file
    from accelerate.utils.dataclasses import get_module_class_from_name
    from transformers import ViTConfig, ViTForImageClassification

    model = ViTForImageClassification(ViTConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2))
    for name in ("fsdp.yaml", "fsdp_offload.yaml"):
        wrap = load_config_from_file(str(ROOT / "accelerate_configs" / name)).fsdp_config[
            "fsdp_transformer_layer_cls_to_wrap"
        ]
        assert wrap == "ViTLayer" and get_module_class_from_name(model, wrap) is not None, name


@pytest.mark.slow
@RESUME_GROUP
def test_zero2_killed_mid_checkpoint_then_the_same_command_matches_the_uninterrupted_run(
    zero2_run, ten_classes, same_head_vit, tmp_path
):
    """Both ranks killed (-9) while writing checkpoint-20 (optimizer shards on disk, no trainer state or record):
    the same `deepspeed` command resumes from checkpoint-10 (leaving it as it was), re-runs steps 11-20 with the
    uninterrupted run's losses, ends with its weights and loss, and removes the buffers the killed ranks left in
    /dev/shm (the autouse check above)."""
    out = tmp_path / "run"
    args = run_args(ten_classes, same_head_vit, out, "--deepspeed", "ds_configs/zero2.json",
                    "--per_device_train_batch_size", 4, "--save_strategy", "steps", "--save_steps", 10)  # fmt: skip
    command = [tool("deepspeed"), "--num_gpus", "2", "--master_port", str(free_port())]
    killed = subprocess.run(
        [*command, "tests/fault_worker.py", "checkpoint_optimizer", str(STEPS), *map(str, args)],
        cwd=ROOT, env=launch_env(), capture_output=True, text=True, timeout=TIMEOUT,
    )  # fmt: skip
    assert killed.returncode != 0 and (out / "checkpoint-20").is_dir() and not (out / "all_results.json").exists()
    launch("zero2 rerun", [tool("deepspeed"), "--num_gpus", "2", "--master_port", str(free_port()),
                           "run_image_classification.py", *map(str, args)])  # fmt: skip
    state = json.loads((out / "trainer_state.json").read_text())
    assert state["global_step"] == STEPS
    assert [e["step"] for e in state["log_history"] if "loss" in e] == list(range(1, STEPS + 1))
    assert not (out / "checkpoint-10" / "global_step20").exists()
    np.testing.assert_allclose(losses(out)[10:], losses(zero2_run)[10:], rtol=REL_TOL)  # steps 11-20 re-run
    a, b = load_file(out / "model.safetensors"), load_file(zero2_run / "model.safetensors")
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-5, atol=1e-6, msg=key)
    done, reference = (json.loads((o / "all_results.json").read_text()) for o in (out, zero2_run))
    assert done["train_loss"] == pytest.approx(reference["train_loss"], rel=1e-5)


@pytest.mark.slow
@RESUME_GROUP
def test_zero2_sigterm_at_a_random_step_saves_on_both_ranks_and_the_same_command_matches_the_uninterrupted_run(
    zero2_run, ten_classes, same_head_vit, tmp_path
):
    """SIGTERM to every process of a 2-process `deepspeed` run (as scancel sends it; the launcher then forwards its
    own): both ranks agree on the step, save checkpoint-N, and the run says so in one line; the same command resumes
    to the uninterrupted run's weights."""
    import random
    import signal

    from conftest import signal_at_step

    out = tmp_path / "run"
    args = run_args(ten_classes, same_head_vit, out, "--deepspeed", "ds_configs/zero2.json",
                    "--per_device_train_batch_size", 4, "--save_strategy", "steps", "--save_steps", 10)  # fmt: skip
    command = [tool("deepspeed"), "--num_gpus", "2", "--master_port", str(free_port()), "run_image_classification.py"]
    at = random.Random().randint(2, STEPS - 6)
    _, stderr = signal_at_step([*command, *map(str, args)], at, STEPS, signal.SIGTERM, group=True, cwd=ROOT,
                               env=launch_env())  # fmt: skip
    lines = [x for x in stderr.replace("\r", "\n").splitlines() if x.startswith("interrupted at step ")]
    assert len(lines) == 1 and "Traceback" not in stderr, stderr[-4000:]  # rank 0 alone says it
    step = int(lines[0].split()[3].rstrip(";"))
    assert lines[0] == f"interrupted at step {step}; checkpoint-{step} saved; run the same command to resume"
    assert at <= step < STEPS and (out / f"checkpoint-{step}" / "run_identity.json").is_file()
    assert not (out / "all_results.json").exists()
    launch("zero2 rerun", [*command, *map(str, args)])
    a, b = load_file(out / "model.safetensors"), load_file(zero2_run / "model.safetensors")
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-5, atol=1e-6, msg=f"{key}, stopped at step {step}")


# ------------------------------------------------------------------ several machines on one host, and launch errors


def launch_machines(name: str, commands: list[list[str]], env=None) -> None:
    """One launcher per "machine", all on this host and all at once (each waits for the others at rendezvous).
    Logs go to files, not pipes: a full pipe of one machine would block it while the other waits for it."""
    with contextlib.ExitStack() as stack:
        logs = [stack.enter_context(tempfile.TemporaryFile("w+")) for _ in commands]
        procs = [subprocess.Popen(c, cwd=ROOT, env=env or launch_env(), stdout=log, stderr=subprocess.STDOUT)
                 for c, log in zip(commands, logs)]  # fmt: skip
        try:
            for p in procs:
                p.wait(timeout=TIMEOUT)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
        failed = []
        for i, (p, log) in enumerate(zip(procs, logs)):
            if p.returncode != 0:
                log.seek(0)
                failed.append(f"{name}, machine {i} exited {p.returncode}:\n{log.read()[-3000:]}")
    if failed:
        pytest.fail("\n".join(failed))


def deepspeed_machine(hostfile: Path, node: int, port: int) -> list[str]:
    """The `deepspeed` launcher on one machine of a hostfile's, without ssh (docs/distributed.md)."""
    return [tool("deepspeed"), "--hostfile", str(hostfile), "--no_ssh", "--node_rank", str(node),
            "--master_addr", "127.0.0.1", "--master_port", str(port)]  # fmt: skip


def accelerate_machine(config: str, machines: int, processes: int, rank: int, port: int) -> list[str]:
    """`accelerate launch` on one machine of several (docs/distributed.md); `processes` counts all machines'."""
    return [tool("accelerate"), "launch", "--config_file", f"accelerate_configs/{config}",
            "--num_machines", str(machines), "--num_processes", str(processes), "--machine_rank", str(rank),
            "--main_process_ip", "127.0.0.1", "--main_process_port", str(port), "--rdzv_backend", "static"]  # fmt: skip


@pytest.mark.slow
@LAUNCHERS_GROUP
def test_two_machines_over_loopback_with_the_deepspeed_launcher_and_bf16_autocast(
    ten_classes, same_head_vit, tmp_path
):
    """`deepspeed --hostfile ... --no_ssh --node_rank N`, run once per machine as docs/distributed.md says for
    machines without ssh between them: two "machines" of one CPU process each, ZeRO-2, over loopback.

    With --bf16 true under the shipped zero2.json, DeepSpeed autocasts the forward to bf16 and keeps fp32 weights (its
    bf16 mode would hold bf16 weights, which lose a warm-up's small updates: docs/distributed.md)."""
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node-1 slots=1\nnode-2 slots=1\n")  # names only: --no_ssh never reaches them
    out = tmp_path / "two-nodes"
    args = run_args(ten_classes, same_head_vit, out, "--deepspeed", "ds_configs/zero2.json",
                    "--per_device_train_batch_size", 4, "--bf16", "true", steps=2)  # fmt: skip
    port = free_port()
    launch_machines(
        "deepspeed --no_ssh, 2 machines x 1 process",
        [deepspeed_machine(hostfile, node, port) + [RANK_REPORT_SCRIPT, *args] for node in (0, 1)],
    )
    found = reports(out)
    for r in found:
        assert r["zero_stage"] == 2 and r["wrapper"] == DS_ENGINE and r["backend"] == "gloo", r
        assert (r["precision"], r["param_dtype"], r.get("deepspeed_autocast")) == ("bf16", "float32", "bfloat16"), r
    assert_sharded(found, params=False, optimizer=True)
    assert set(load_file(out / "model.safetensors")) == set(load_file(same_head_vit / "model.safetensors"))


@pytest.mark.slow
@LAUNCHERS_GROUP
def test_two_machines_over_loopback_with_accelerate_launch(ten_classes, same_head_vit, tmp_path):
    """The docs' multi-machine command, run once per machine: accelerate_configs/multinode.yaml (the template users
    copy; ZeRO-3 through the same flags is the SLURM script's test above), two "machines" of one CPU process each."""
    out = tmp_path / "two-nodes"
    args = run_args(ten_classes, same_head_vit, out, "--per_device_train_batch_size", 4, steps=2)
    port = free_port()
    launch_machines(
        "accelerate launch, 2 machines x 1 process",
        [accelerate_machine("multinode.yaml", 2, 2, rank, port) + [RANK_REPORT_SCRIPT, *args] for rank in (0, 1)],
    )
    found = reports(out)
    for r in found:
        assert r["wrapper"] == DDP and r["backend"] == "gloo" and r["distributed_type"] == "MULTI_CPU", r
        assert r["precision"] == "bf16", r  # the template's mixed_precision arrived
    assert_sharded(found, params=False, optimizer=False)
    assert set(load_file(out / "model.safetensors")) == set(load_file(same_head_vit / "model.safetensors"))


def test_slurm_script_runs_one_accelerate_launch_per_node_with_its_rank(tmp_path):
    """The commands scripts/slurm/train.sbatch runs on 2 nodes, with stand-ins: `srun` starts the task once per
    node (SLURM_PROCID), `accelerate` prints its arguments. Arguments with spaces must arrive as one."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(
        "#!/usr/bin/env bash\n"
        'while [[ "$1" == --* ]]; do shift; done\n'
        'for i in 0 1; do SLURM_PROCID=$i "$@" || exit; done\n'
    )
    (bin_dir / "scontrol").write_text("#!/usr/bin/env bash\nprintf 'gpu-node-1\\ngpu-node-2\\n'\n")
    (bin_dir / "accelerate").write_text('#!/usr/bin/env bash\necho "ARGV $(printf \'[%s]\' "$@")"\n')
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    base = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MASTER_", "ACCELERATE_", "GPUS_"))}
    base.update(PATH=f"{bin_dir}:{os.environ['PATH']}", SLURM_NNODES="2", SLURM_JOB_NODELIST="gpu-node-[1-2]")

    def commands(**env) -> list[str]:
        result = subprocess.run(
            ["bash", "scripts/slurm/train.sbatch", "--config", "recipes/x.yaml", "--output_dir", "out dir"],
            cwd=ROOT, env={**base, **env}, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        return [line.removeprefix("ARGV ") for line in result.stdout.splitlines() if line.startswith("ARGV ")]

    def expected(config: str, processes: int, port: int, script="run_image_classification.py") -> list[str]:
        return [
            f"[launch][--config_file][{config}][--num_machines][2][--num_processes][{processes}][--machine_rank][{rank}]"
            f"[--main_process_ip][gpu-node-1][--main_process_port][{port}][--rdzv_backend][static]"
            f"[{script}][--config][recipes/x.yaml][--output_dir][out dir]"
            for rank in (0, 1)
        ]

    assert commands() == expected("accelerate_configs/multinode.yaml", 16, 29500)
    assert commands(SLURM_GPUS_ON_NODE="4", ACCELERATE_CONFIG="accelerate_configs/zero3.yaml") == expected(
        "accelerate_configs/zero3.yaml", 8, 29500
    )
    assert commands(
        GPUS_PER_NODE="2", SLURM_GPUS_ON_NODE="4", MASTER_PORT="29600", TRAIN_SCRIPT="tools/rank_report.py"
    ) == expected("accelerate_configs/multinode.yaml", 4, 29600, "tools/rank_report.py")


def test_deepspeed_launchers_count_of_this_machines_processes_is_read(monkeypatch):
    """The `deepspeed` launcher sets LOCAL_SIZE, not LOCAL_WORLD_SIZE: 2 machines x 8 GPUs is 16 processes in all
    and 8 on this machine, which must not read as 16 on 8 GPUs."""
    from vit_recipes.core.launch import check_processes

    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.setenv("WORLD_SIZE", "16")
    monkeypatch.setenv("LOCAL_SIZE", "8")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    check_processes(use_cpu=False)
    monkeypatch.setenv("LOCAL_SIZE", "9")
    with pytest.raises(RecipeError, match=r"9 processes on this machine but only 8 GPU.*--num_processes 8"):
        check_processes(use_cpu=False)


def test_the_launch_notes_are_in_the_runs_log(monkeypatch, caplog):
    """Processes that stepped aside (step_aside), and more CPU processes on a machine than cores (the zero3 command
    as typed with a CPU recipe starts the config's 8): one WARNING each in the plan's log, process 0 only."""
    from vit_recipes.core import launch

    monkeypatch.setattr(launch, "_STEPPED_ASIDE", {"launched": 8, "gpus": 2})
    monkeypatch.setattr(launch, "_CROWDED", {})
    monkeypatch.setattr(launch, "cores", lambda: 2)
    for name, value in {"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "8"}.items():
        monkeypatch.setenv(name, value)
    launch.check_processes(use_cpu=True)  # what each of the 8 CPU processes meets: not refused
    for name in ("WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name)  # one process from here: the plan, in-process
    with caplog.at_level("WARNING", logger="vit_recipes.plan.plan"):
        check("--use_cpu", "true", "--per_device_train_batch_size", "16")
    assert (
        "8 processes were launched on this machine, which has 2 GPU(s): 6 exited before the process group and 2 "
        "train, global batch 16 (8 would have made 64); --num_processes 2 launches only these"
    ) in caplog.text
    assert (
        "8 CPU processes on this machine's 2 core(s): each trains on a share of a core, global batch 16; "
        "--num_processes 2 (--num_gpus 2 with deepspeed) runs one per core, global batch 4"
    ) in caplog.text


def pretend_accelerate_launched(monkeypatch, *command: str) -> None:
    """This process as `accelerate launch --cpu` starts the script: its simple launcher sets ACCELERATE_USE_CPU and
    no ranks, and it is the parent, whose command line is read."""
    import psutil

    command = [sys.executable, *command, "run_image_classification.py", "--use_cpu", "true"]
    parent = types.SimpleNamespace(cmdline=lambda: command, cwd=lambda: str(ROOT))
    monkeypatch.setattr(psutil, "Process", lambda *pid: types.SimpleNamespace(parent=lambda: parent))
    monkeypatch.setenv("ACCELERATE_USE_CPU", "True")
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)


def test_accelerate_launch_with_cpu_says_it_runs_one_process_and_refuses_a_strategy_it_drops(monkeypatch, caplog):
    """`accelerate launch --cpu` runs the script once, without the config's strategy: it ran one process for
    ddp.yaml --num_processes 2, and one plain process without DeepSpeed for zero3.yaml, without a word."""
    from vit_recipes.core import launch

    monkeypatch.setattr(launch, "_ONE_PROCESS", {})
    accelerate_launch = (str(Path(sys.executable).with_name("accelerate")), "launch")
    ddp = ("--config_file", "accelerate_configs/ddp.yaml", "--num_processes", "2", "--cpu")
    pretend_accelerate_launched(monkeypatch, *accelerate_launch, *ddp)
    launch.check_processes(use_cpu=True)
    with caplog.at_level("WARNING", logger="vit_recipes.plan.plan"):
        check("--use_cpu", "true", "--per_device_train_batch_size", "16")
    assert (
        "accelerate launch --cpu starts one process: 2 were asked (accelerate_configs/ddp.yaml), 1 trains, global "
        "batch 16 (2 would have made 32); for 2 CPU processes over gloo drop --cpu and pass --use_cpu true to the "
        "script"
    ) in caplog.text
    for config, processes, strategy in (("zero3.yaml", "8", "DeepSpeed on 8 processes"), ("fsdp.yaml", "2", "FSDP")):
        flags = ["--config_file", f"accelerate_configs/{config}", "--cpu"] + ["--num_processes", "2"] * (
            processes == "2"
        )
        for command in (accelerate_launch, ("-m", "accelerate.commands.launch")):
            pretend_accelerate_launched(monkeypatch, *command, *flags)
            with pytest.raises(
                RecipeError,
                match=f"^accelerate launch --cpu starts one plain process: accelerate_configs/{config} "
                f"asks for {strategy}.*--use_cpu true to the script",
            ):
                launch.check_processes(use_cpu=True)
    pretend_accelerate_launched(monkeypatch, "-m", "pytest")  # ACCELERATE_USE_CPU set, another parent: nothing
    launch.check_processes(use_cpu=True)
    assert launch.launch_notes(16) == []


def test_a_rank_that_leaves_the_refusal_to_local_rank_0_exits_0_at_the_launchers_stop():
    """Every rank meets the same refusal; local rank 0 prints it and exits 2, and the launcher stops the others
    with SIGTERM. Killed by it (-15), each was one more failure in torch elastic's report, 7 lines with nothing to
    add to rank 0's line."""
    # "waiting" once it waits (its SIGTERM handler set): a signal before that would be the launcher's plain stop
    code = (
        "import time; from vit_recipes.core import launch; sleep = time.sleep; "
        "time.sleep = lambda s: (print('waiting', flush=True), sleep(s)); launch.await_the_launchers_stop(60)"
    )
    env = launch_env(PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")])))
    rank = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
    assert rank.stdout.readline() == "waiting\n"
    rank.terminate()
    assert rank.wait(timeout=30) == 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="DeepSpeed builds this op for its CPU accelerator")
def test_deepspeeds_first_build_of_its_cpu_op_is_said_before_it_starts(monkeypatch, tmp_path, capsys):
    """The zero3 command with a CPU recipe printed nothing for ~5 minutes on 2 cores while DeepSpeed's comm compiled
    its shared-memory collective (its first run on a machine): one line says so first; none once it is built."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))  # torch's JIT build cache: empty, as at a first run
    check("--deepspeed", ROOT / "ds_configs/zero3.json", "--use_cpu", "true")
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("DeepSpeed is compiling")]
    folder = tmp_path / "deepspeed_shm_comm"  # torch's folder for the op, under TORCH_EXTENSIONS_DIR
    assert lines == [
        f"DeepSpeed is compiling its shared-memory collective for CPU processes into {folder}: once per machine, "
        "minutes on a few cores, with nothing printed meanwhile (`make install` builds it ahead)"
    ]
    (folder / f"{folder.name}.so").touch()  # built
    check("--deepspeed", ROOT / "ds_configs/zero3.json", "--use_cpu", "true")
    assert "DeepSpeed is compiling" not in capsys.readouterr().out


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="the command as typed, on a machine without GPUs")
@LAUNCHERS_GROUP
def test_too_many_processes_for_this_machine_is_one_error_line_not_one_per_process(tmp_path):
    """The README's command as typed on a machine without GPUs: zero3.yaml starts 8 processes, each refuses before
    the process group; local rank 0 alone prints the error (with the fix), the launcher stops the others."""
    command = [tool("accelerate"), "launch", "--config_file", "accelerate_configs/zero3.yaml",
               "run_image_classification.py", "--dataset_name", "data", "--model_name_or_path", "model",
               "--output_dir", str(tmp_path / "out")]  # fmt: skip
    pythonpath = os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")]))
    env = launch_env(PYTHONPATH=pythonpath, MASTER_PORT=str(free_port()))
    env.pop("ACCELERATE_USE_CPU", None)
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT)
    text = result.stdout + result.stderr
    errors = [line for line in text.splitlines() if line.startswith("error:")]  # the script's one-line format
    # once by local rank 0, once quoted by torch elastic's report (below): no other rank prints it
    assert result.returncode != 0 and len(errors) == 1 and text.count("processes were launched") == 2, text[-8000:]
    assert errors[0].startswith("error: 8 processes were launched but this machine has no GPU"), errors
    assert "--use_cpu true to the script and --num_processes N to accelerate" in errors[0], errors
    assert not (tmp_path / "out").exists()
    # torch elastic's ChildFailedError report, which accelerate launch prints after it: its root cause quotes our
    # line, read from the error file rank 0 wrote (it said "error_file: <N/A>" and "To enable traceback see: ...")
    root_cause = text.split("Root Cause (first observed failure):")[-1]
    assert f"traceback : {errors[0]}" in root_cause and "error_file: <N/A>" not in root_cause, text[-8000:]
    assert "To enable traceback" not in text, text[-8000:]


@pytest.mark.slow
@LAUNCHERS_GROUP
def test_processes_past_the_gpus_step_aside_and_the_rest_train_as_one_group_under_accelerate_launch(tmp_path):
    """The zero3 command as typed on a machine of fewer GPUs than its config's 8 processes: it was our line, then
    accelerate's ChildFailedError report (~40 lines). Now the processes past the GPUs exit 0 before any collective,
    torch's elastic agent (which accelerate launch runs) waits for the others, and those form a group of the GPU
    count and train; one line says so. Here 3 processes on a machine that "has" 2 (tests/step_aside_worker.py)."""
    from vit_recipes.core.launch import check_processes

    command = [tool("accelerate"), "launch", "--config_file", "accelerate_configs/zero3.yaml", "--num_processes", "3",
               "--main_process_port", str(free_port()), "tests/step_aside_worker.py", str(tmp_path)]  # fmt: skip
    pythonpath = os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")]))
    env = launch_env(PYTHONPATH=pythonpath)
    env.pop("ACCELERATE_USE_CPU", None)
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT)
    text = result.stdout + result.stderr
    assert result.returncode == 0 and "Traceback" not in text and "ChildFailedError" not in text, text[-6000:]
    found = [json.loads(f.read_text()) for f in sorted(tmp_path.glob("rank*.json"))]
    assert [(r["rank"], r["world"], r["sum"]) for r in found] == [(0, 2, 2.0), (1, 2, 2.0)], found
    assert found[0]["note"] == (
        "3 processes were launched on this machine, which has 2 GPU(s): 1 exited before the process group and 2 "
        "train, global batch 16 (3 would have made 24); --num_processes 2 launches only these"
    )
    # Two machines (their ranks would need numbering across both), or a launcher other than torchrun: refused
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.cuda, "is_available", lambda: True)
        patch.setattr(torch.cuda, "device_count", lambda: 2)
        patch.setenv("TORCHELASTIC_RUN_ID", "none")
        patch.setenv("WORLD_SIZE", "8")
        patch.setenv("LOCAL_WORLD_SIZE", "4")
        with pytest.raises(RecipeError, match="4 processes on this machine but only 2 GPU"):
            check_processes(use_cpu=False)
        patch.delenv("TORCHELASTIC_RUN_ID")
        patch.setenv("WORLD_SIZE", "4")
        with pytest.raises(RecipeError, match="4 processes on this machine but only 2 GPU"):
            check_processes(use_cpu=False)


@pytest.fixture(scope="module")
def fsdp2_two_process_run(same_head_vit, tmp_path_factory) -> Path:
    """fsdp.yaml in 2 processes with activation checkpointing, 6 steps uninterrupted, saving the Trainer's FSDP
    checkpoint after step 3 on the way: the full row of test_fsdp2_config_really_shards_vit, and what the resume tests
    resume (without checkpointing: its wrappers do not show in the saved names)."""
    out = tmp_path_factory.mktemp("fsdp2-two")
    launch(
        "FSDP2 run saving a checkpoint",
        fsdp2_worker(checkpointing=True)
        + [str(same_head_vit), str(out), str(FSDP2_RESUME_STEPS)]
        + ["--save-at", str(FSDP2_SAVED_AT), "--checkpoint", str(out / "checkpoint")],
    )
    return out


@pytest.mark.slow
@pytest.mark.parametrize("processes", [4])  # on 1 (all -> 1): the GPU acceptance suite's `resume` part, as for ZeRO-2
@RESUME_GROUP
def test_fsdp2_checkpoint_resumes_on_another_process_count(processes, fsdp2_two_process_run, same_head_vit, tmp_path):
    """fsdp.yaml's FULL_STATE_DICT checkpoint (the Trainer's save_fsdp_model + save_fsdp_optimizer: whole tensors,
    written by rank 0), saved by 2 processes, loaded by 4 (load_fsdp_model + load_fsdp_optimizer, each rank keeping
    its own shard) with the same global batch: steps 4-6 give the uninterrupted run's losses.

    Measured: 1 process bit-identical (when it had a row here), 4 within 1.1e-7. Not loading the optimizer state moves step 5 by 1.2%;
    resetting Adam's step count alone, by 0.3%: the tolerance sees a resume that loses either."""
    checkpoint = fsdp2_two_process_run / "checkpoint"
    assert {"pytorch_model_fsdp.bin", "optimizer.bin"} <= {p.name for p in checkpoint.iterdir()}
    assert json.loads((checkpoint / "worker_step.json").read_text()) == {
        "global_step": FSDP2_SAVED_AT,
        "world_size": 2,
    }
    launch(
        f"FSDP2 from 2 processes resumed on {processes}",
        fsdp2_worker(checkpointing=False, processes=processes)
        + [str(same_head_vit), str(tmp_path), str(FSDP2_RESUME_STEPS), "--resume-from", str(checkpoint)],
    )
    uninterrupted = json.loads((fsdp2_two_process_run / "rank0.json").read_text())
    assert uninterrupted["first_step"] == 1 and len(uninterrupted["losses"]) == FSDP2_RESUME_STEPS
    for rank in range(processes):
        report = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert report["world_size"] == processes and report["first_step"] == FSDP2_SAVED_AT + 1, report
        assert report["dtensor_params"] == report["params"], "every parameter is an FSDP2 shard"
        if processes > 1:  # each rank holds about a quarter: resharded, not a full copy per rank
            assert report["local_numel"] < report["full_numel"] / 2, report
        np.testing.assert_allclose(
            report["losses"], uninterrupted["losses"][FSDP2_SAVED_AT:], rtol=1e-5, err_msg=f"steps 4-6, rank {rank}"
        )

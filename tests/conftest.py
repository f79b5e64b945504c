"""Shared fixtures: small local datasets shaped like the Hub ones and a tiny ViT saved with save_pretrained."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest

# Tests never reach the Hub: every dataset and checkpoint below is built locally.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_EVALUATE_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# pytest-xdist workers (make test) share the machine's cores: each takes its share of them for torch's threads, as
# torchrun gives each of its processes one. An OMP_NUM_THREADS above the share would oversubscribe the cores (tests
# then ran 20-30% slower) and is lowered to it, in a line at the start.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))


def threads_per_worker(workers: int, asked: str | None) -> int | None:
    """The torch threads each of `workers` processes gets: the share of the cores, or less if OMP_NUM_THREADS asks."""
    if workers <= 1:
        return None  # one process: the environment's setting, or torch's default
    share = max(1, (os.cpu_count() or 1) // workers)
    return min(share, int(asked)) if asked and asked.isdigit() and int(asked) > 0 else share


if (_THREADS := threads_per_worker(_WORKERS, os.environ.get("OMP_NUM_THREADS"))) is not None:
    os.environ["OMP_NUM_THREADS"] = str(_THREADS)


# The groups `make test` deals first, longest first (seconds on 2 cores with 2 workers, 2026-12-02, --durations:
# ~480, ~160, ~125, ~110, ~85, ~80, ~55, ~40 of ~1,400 in all); the rest follow in file order. Dealt last, as
# pytest-xdist's own order (by test count) put these few-test groups, one worker ran them alone at the end. A stale
# entry costs time, never a test.
SLOWEST_GROUPS = ("test_distributed-resume", "test_distributed-launchers", "test_benchmarks", "test_checkpoints",
                  "test_script", "test_streaming", "test_fp8", "test_profiling")  # fmt: skip


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own hook reads the groups
def pytest_collection_modifyitems(config, items):
    """`make test` deals tests to its workers by xdist group (`--dist loadgroup --no-loadscope-reorder`): a test file
    is one group, so its module fixtures are built once, unless a test names its own `xdist_group`. test_distributed.py
    does, for its slowest tests: as one group the file took half the suite's time on one worker while the others
    idled. The slowest groups go first (SLOWEST_GROUPS); each group keeps its tests' order."""
    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(Path(item.path).stem))
    rank = {name: i for i, name in enumerate(SLOWEST_GROUPS)}

    def group(item) -> str:  # xdist_group("name") or xdist_group(name="name"), as pytest-xdist reads it
        mark = item.get_closest_marker("xdist_group")
        return mark.args[0] if mark.args else mark.kwargs.get("name", "default")

    items.sort(key=lambda item: rank.get(group(item), len(rank)))  # stable


def pytest_sessionstart(session):
    """One line (shown with -q too) with the threads each worker's torch gets, on the controller process."""
    config = session.config
    workers = config.getoption("numprocesses", None)
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if hasattr(config, "workerinput") or not isinstance(workers, int) or reporter is None:
        return
    asked = os.environ.get("OMP_NUM_THREADS")
    if (threads := threads_per_worker(workers, asked)) is not None:
        lowered = f" (OMP_NUM_THREADS={asked} lowered to the cores' share)" if asked and asked != str(threads) else ""
        reporter.write_line(
            f"{workers} test workers on {os.cpu_count()} cores: {threads} torch thread(s) each{lowered}"
        )


ROOT = Path(__file__).resolve().parents[1]
# The training seed of the tests that compare how well runs learn. Their margins were measured over seeds 42 and 43
# and several OMP_NUM_THREADS; `VIT_TEST_SEED=43 make test` checks another seed (docs/development.md).
TRAIN_SEED = os.environ.get("VIT_TEST_SEED", "42")
METRIC_PATH = str(ROOT / "tools" / "classification")  # the evaluate module: a folder with classification.py


def load_metric(multi_label: bool = False):
    """The repo's evaluate module, loaded by path as a user would (no Hub), in memory (no Arrow cache files)."""
    import evaluate

    return evaluate.load(METRIC_PATH, "multilabel" if multi_label else None, keep_in_memory=True)


sys.path.insert(0, str(ROOT))  # run_image_classification.py lives at the top level


def pattern_images(labels: np.ndarray, size: int, seed: int) -> np.ndarray:
    """Learnable RGB images: each class is a distinct colour blend plus noise."""
    rng = np.random.default_rng(seed)
    palette = np.random.default_rng(1234).integers(0, 256, size=(int(labels.max()) + 1, 3))
    images = palette[labels][:, None, None, :] + rng.normal(0, 20, size=(len(labels), size, size, 3))
    return np.clip(images, 0, 255).astype(np.uint8)


def write_parquet_splits(root: Path, splits: dict[str, dict], features) -> Path:
    from datasets import Dataset

    (root / "data").mkdir(parents=True, exist_ok=True)
    for name, columns in splits.items():
        Dataset.from_dict(columns, features=features).to_parquet(str(root / "data" / f"{name}-00000-of-00001.parquet"))
    return root


@pytest.fixture(scope="session")
def cifar_like(tmp_path_factory) -> Path:
    """uoft-cs/cifar100's schema: img (PNG 32x32), fine_label (100 names), coarse_label; train and test only."""
    from datasets import ClassLabel, Features, Image
    from PIL import Image as PILImage

    features = Features(
        {
            "img": Image(),
            "fine_label": ClassLabel(names=[f"class_{i}" for i in range(100)]),
            "coarse_label": ClassLabel(names=[f"super_{i}" for i in range(20)]),
        }
    )
    splits = {}
    for name, per_class, seed in (("train", 4, 0), ("test", 1, 1)):
        labels = np.repeat(np.arange(100), per_class)
        images = pattern_images(labels, 32, seed)
        splits[name] = {
            "img": [PILImage.fromarray(x) for x in images],
            "fine_label": labels,
            "coarse_label": labels // 5,
        }
    return write_parquet_splits(tmp_path_factory.mktemp("cifar100"), splits, features)


@pytest.fixture(scope="session")
def fixture_records(tmp_path_factory) -> Path:
    """tests/data/strategy_report/records with its synthetic GPU traces written next to it (traces stay out of git)."""
    import shutil

    sys.path.insert(0, str(ROOT / "tests" / "data" / "strategy_report"))
    from make_fixtures import write_traces

    records = tmp_path_factory.mktemp("fixture") / "records"
    shutil.copytree(ROOT / "tests" / "data" / "strategy_report" / "records", records)
    write_traces(records)
    return records


@pytest.fixture(scope="session")
def digits_dir(tmp_path_factory) -> Path:
    sys.path.insert(0, str(ROOT / "tools"))  # tools/demo_data.py: what `make demo` runs
    from demo_data import build_digits

    return build_digits(tmp_path_factory.mktemp("digits"))


def tiny_vit_config(num_labels: int = 7, hidden_size: int = 32):
    """The tests' tiny ViT: 16x16 input, 4x4 patches, 2 layers of 2 heads, MLP twice as wide as hidden_size."""
    from transformers import ViTConfig

    return ViTConfig(
        image_size=16,
        patch_size=4,
        hidden_size=hidden_size,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=2 * hidden_size,
        num_labels=num_labels,
    )


def save_tiny_vit(path: Path, num_labels: int = 7, label_names: bool = False) -> Path:
    """tiny_vit_config, randomly initialised (seed 0), saved like a Hub checkpoint."""
    import torch
    from transformers import ViTForImageClassification, ViTImageProcessor

    torch.manual_seed(0)
    config = tiny_vit_config(num_labels)
    if label_names:
        config.id2label = {i: f"class_{i}" for i in range(num_labels)}
        config.label2id = {v: k for k, v in config.id2label.items()}
    ViTForImageClassification(config).save_pretrained(path)
    ViTImageProcessor(size={"height": 16, "width": 16}).save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_vit(tmp_path_factory) -> Path:
    """A tiny ViT with a 7-class head (datasets here have other classes: the script replaces it)."""
    return save_tiny_vit(tmp_path_factory.mktemp("tiny-vit"))


@pytest.fixture(autouse=True)
def logging_left_as_found():
    """Undo what an in-process run does to its process's logging, so that no test sees an earlier test's.

    setup_logging gives the root logger a handler on the sys.stdout of the moment (in a test, pytest's capture,
    closed when the test ends) and sets transformers' and datasets' verbosity from --log_level. Left behind, a later
    test's records went to the closed stream ("--- Logging error ---" in its stderr) at INFO: on CI, where transformers
    propagates its records to the root logger (it does when the CI variable is set), this failed the one-line error
    checks. A library handler made while a capture was open is pointed back at stderr the same way."""
    import logging

    root = logging.getLogger()
    levels = {name: logging.getLogger(name).level for name in ("", "transformers", "datasets")}
    yield
    for handler in [h for h in root.handlers if type(h) is logging.StreamHandler]:  # pytest's are subclasses
        root.removeHandler(handler)
    for name, level in levels.items():
        logging.getLogger(name).setLevel(level)
        for handler in logging.getLogger(name).handlers:
            if type(handler) is logging.StreamHandler and getattr(handler.stream, "closed", False):
                handler.stream = sys.stderr  # not setStream: it flushes the closed stream first
                vars(handler).pop("flush", None)  # transformers binds flush to the stderr it was made with


@pytest.fixture
def run_script():
    """Run the script in-process (imports are paid once) and return its results dict."""
    import run_image_classification

    def run(*argv: str) -> dict:
        return run_image_classification.main([str(a) for a in argv])

    return run


def run_scripts_at_once(*argvs, threads: int = 1) -> list[tuple[dict, str]]:
    """Run the script once per argument list, all at the same time, each in its own process with `threads` torch
    threads: the independent runs a test compares share the machine's cores whatever OMP_NUM_THREADS the suite has
    (in-process, one run after the other, OMP_NUM_THREADS=1 left a core idle). Returns each run's all_results.json
    and stdout."""
    import contextlib
    import json
    import subprocess
    import tempfile

    argvs = [[str(a) for a in argv] for argv in argvs]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    with contextlib.ExitStack() as stack:  # files, not pipes: a full pipe would stall its run
        logs = [[stack.enter_context(tempfile.TemporaryFile("w+")) for _ in "oe"] for _ in argvs]
        runs = [subprocess.Popen([sys.executable, str(ROOT / "run_image_classification.py"), *argv], cwd=ROOT,
                                 env=env, stdout=out, stderr=err) for argv, (out, err) in zip(argvs, logs)]  # fmt: skip
        results = []
        for argv, run, (out, err) in zip(argvs, runs, logs):
            run.wait(timeout=900)
            out.seek(0), err.seek(0)
            assert run.returncode == 0, err.read()[-4000:]
            folder = Path(argv[argv.index("--output_dir") + 1])
            results.append((json.loads((folder / "all_results.json").read_text()), out.read()))
    return results


FAST_ARGS = (
    "--dataloader_num_workers",
    "0",
    "--use_cpu",
    "true",
    "--report_to",
    "none",
    "--logging_steps",
    "5",
    "--save_strategy",
    "no",
    "--eval_strategy",
    "no",
)


def run_args(data, model, out, *extra) -> tuple:
    """A tiny CPU training run of the script; `extra` flags come last and win."""
    return (
        "--dataset_name",
        data,
        "--model_name_or_path",
        model,
        "--output_dir",
        out,
        "--do_train",
        "true",
        "--do_eval",
        "true",
        "--per_device_train_batch_size",
        "8",
        "--per_device_eval_batch_size",
        "64",
        "--learning_rate",
        "1e-3",
        *FAST_ARGS,
        *extra,
    )


def logged_losses(out: Path) -> list[float]:
    """The per-step training losses a run logged (trainer_state.json's log_history)."""
    import json

    history = json.loads((out / "trainer_state.json").read_text())["log_history"]
    return [entry["loss"] for entry in history if "loss" in entry]


def model_args(**kw):
    """ModelArguments for calling the package's model builders directly (no checkpoint unless given)."""
    from vit_recipes.core.arguments import ModelArguments

    return ModelArguments(**{"model_name_or_path": None, **kw})


def signal_at_step(argv, step: int, total: int, sig, group: bool = False, meanwhile=None, **popen):
    """Run `argv`, send it `sig` once its progress bar shows `step` of `total` steps; return
    (exit status, stderr) once it and (`group`) every process it started have ended. The bar is the Trainer's tqdm
    on stderr, read as it is written. `group`: the signal goes to its whole process group, as a terminal's Ctrl-C
    or SLURM's scancel reach every process of a job. `meanwhile()`: called once `step` is shown, before the signal,
    while the run is training."""
    import os
    import re
    import signal
    import subprocess
    import threading

    import psutil

    # as from a terminal: a shell's background job (a CI runner) can inherit SIGINT ignored
    restore = lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)  # noqa: E731
    run = subprocess.Popen(argv, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, preexec_fn=restore,
                           start_new_session=group, **popen)  # fmt: skip
    seen, reached = [], threading.Event()

    def read():
        for chunk in iter(lambda: run.stderr.read(64), ""):
            seen.append(chunk)
            shown = re.findall(rf"(\d+)/{total} \[", "".join(seen)[-400:])
            if shown and int(shown[-1]) >= step:
                reached.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    assert reached.wait(240), "".join(seen)[-3000:]
    if meanwhile is not None:
        try:
            meanwhile()
        except BaseException:
            run.kill()
            raise
    started = psutil.Process(run.pid).children(recursive=True)
    if group:
        os.killpg(run.pid, sig)
    else:
        run.send_signal(sig)
    run.wait(timeout=240)
    psutil.wait_procs(started, timeout=240)
    reader.join(timeout=30)
    return run.returncode, "".join(seen)

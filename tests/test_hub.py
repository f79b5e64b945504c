import types
from pathlib import Path

import huggingface_hub
import pytest
from huggingface_hub import ModelCard, metadata_load
from huggingface_hub.errors import OfflineModeIsEnabled

from vit_recipes.core.errors import RecipeError
from vit_recipes.core.hub import check_push_ready, hub_error_message
from vit_recipes.publish.card import CardInfo, build_model_card, hardware_description, write_model_card

FAKE_TOKEN = "hf_abcdefghijklmnopqrstuvwx"
ENV_TOKEN = "hf_ZYXWVUTSRQPONMLKJIHGFEDCBA0123"
ACCELERATE_VARS = (
    "ACCELERATE_USE_DEEPSPEED",
    "ACCELERATE_DEEPSPEED_ZERO_STAGE",
    "ACCELERATE_DEEPSPEED_CONFIG_FILE",
    "ACCELERATE_USE_FSDP",
)


@pytest.fixture(autouse=True)
def isolated_hub(monkeypatch, tmp_path):
    """No token, no offline mode and no accelerate launcher variables leak in from the machine running the tests."""
    for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_OIDC_RESOURCE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    for name in ACCELERATE_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    # huggingface_hub resolves these paths at import, so HF_HOME alone would not hide a stored login.
    monkeypatch.setattr(huggingface_hub.constants, "HF_TOKEN_PATH", str(tmp_path / "hf_home" / "token"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_STORED_TOKENS_PATH", str(tmp_path / "hf_home" / "stored"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)


def push_args(push=True, token=None):
    return types.SimpleNamespace(push_to_hub=push, hub_token=token)


def test_check_push_ready_without_token_raises():
    assert huggingface_hub.get_token() is None
    with pytest.raises(RecipeError, match="hf auth login") as info:
        check_push_ready(push_args())
    assert "\n" not in str(info.value) and "HF_TOKEN" in str(info.value)


def test_check_push_ready_passes_with_token(monkeypatch):
    """The token is what decides: the push refused without one passes with --hub_token, or with HF_TOKEN."""
    with pytest.raises(RecipeError, match="needs a Hugging Face token"):
        check_push_ready(push_args())
    assert check_push_ready(push_args(token=FAKE_TOKEN)) is None
    monkeypatch.setenv("HF_TOKEN", ENV_TOKEN)
    assert check_push_ready(push_args()) is None


def test_check_push_ready_ignores_runs_without_push(monkeypatch):
    """Neither a token nor the Hub is needed by a run that does not push: what refuses a push passes without one."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # and no token (isolated_hub)
    with pytest.raises(RecipeError, match="--push_to_hub cannot work with HF_HUB_OFFLINE=1"):
        check_push_ready(push_args())
    assert check_push_ready(push_args(push=False)) is None
    monkeypatch.delenv("HF_HUB_OFFLINE")
    with pytest.raises(RecipeError, match="needs a Hugging Face token"):
        check_push_ready(push_args())
    assert check_push_ready(push_args(push=False)) is None


def test_check_push_ready_refuses_offline(monkeypatch):
    monkeypatch.setenv("HF_TOKEN", ENV_TOKEN)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(RecipeError, match="HF_HUB_OFFLINE"):
        check_push_ready(push_args())


def test_hardware_description_names_the_gpu_per_process_or_the_cpu_cores(monkeypatch):
    """The card's hardware line: "<processes> x <GPU name>" on GPUs, else the CPU's cores (and processes, when
    several); a broken driver costs the line its GPU, not the card."""
    import os

    import torch

    cores = os.cpu_count() or 1
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    assert hardware_description() == f"CPU ({cores} cores)"
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert hardware_description() == f"CPU ({cores} cores, 2 processes)"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *device: "NVIDIA H200")
    assert hardware_description() == "2 x NVIDIA H200"
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert hardware_description() == "1 x NVIDIA H200"

    def broken(*device):
        raise RuntimeError("CUDA driver initialization failed")

    monkeypatch.setattr(torch.cuda, "get_device_name", broken)
    assert hardware_description() == f"CPU ({cores} cores)"


@pytest.mark.parametrize(
    "err",
    [
        OfflineModeIsEnabled("Cannot reach https://huggingface.co/api/models: offline mode is enabled."),
        ConnectionError("[Errno -3] Temporary failure in name resolution"),
    ],
)
def test_hub_error_message_offline(err):
    message = hub_error_message(err, "push the model", local_path="outputs/vit-cifar100")
    assert "\n" not in message
    assert message.startswith("could not reach the Hugging Face Hub to push the model")
    assert "outputs/vit-cifar100" in message and "offline" in message and "make demo" in message


def transport_error(name: str, message: str):
    """An error of huggingface_hub's own HTTP transport (httpx for 1.x, httpx2 for 2.x), as it raises them."""
    import importlib

    import huggingface_hub.errors

    return getattr(importlib.import_module(huggingface_hub.errors.HTTPError.__module__), name)(message)


def test_a_transport_failure_is_a_network_error_whatever_the_hub_version_and_an_answer_is_not():
    import importlib

    import huggingface_hub.errors
    from huggingface_hub.errors import HfHubHTTPError

    from vit_recipes.core.hub import is_network_error

    assert is_network_error(transport_error("ConnectError", "[Errno -2] Name or service not known"))
    assert is_network_error(transport_error("ReadTimeout", "timed out"))
    http = importlib.import_module(huggingface_hub.errors.HTTPError.__module__)
    answer = http.Response(500, request=http.Request("GET", "https://huggingface.co/api/datasets/x"))
    assert not is_network_error(HfHubHTTPError("500 Server Error", response=answer))
    assert not is_network_error(ValueError("x"))


def test_a_missing_local_folder_is_said_first_with_what_builds_it(monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr("vit_recipes.core.hub.offline_env", lambda: False)
    err = transport_error("ConnectError", "[Errno -2] Name or service not known")
    message = hub_error_message(err, "download the dataset 'data/digits'", missing="data/digits")
    assert message.startswith("no local folder 'data/digits' in ") and "ConnectError" in message
    assert message.endswith("build it with `python tools/demo_data.py data/digits` or check the network")
    other = hub_error_message(err, "download the dataset 'me/pets'", missing="me/pets")
    assert other.startswith("no local folder 'me/pets'") and "pass the path of an existing folder" in other


def test_hub_error_message_wrapped_by_transformers():
    try:
        try:
            raise OfflineModeIsEnabled("offline mode is enabled")
        except OfflineModeIsEnabled as inner:
            raise OSError("We couldn't load google/vit-base-patch16-224-in21k.\nCheck your connection.") from inner
    except OSError as err:
        message = hub_error_message(err, "download google/vit-base-patch16-224-in21k")
    assert "\n" not in message and "could not reach" in message and "make demo" in message


PER_CLASS = "| Class | Precision | Recall | F1 | Support |\n|---|---|---|---|---|\n| apple | 0.9 | 0.8 | 0.85 | 100 |"


def card_info(**overrides) -> CardInfo:
    values = dict(
        model_name="vit-base-cifar100",
        repo_id="me/vit-base-cifar100",
        base_model="google/vit-base-patch16-224-in21k",
        base_model_source="google/vit-base-patch16-224-in21k",
        dataset_id="uoft-cs/cifar100",
        dataset_is_hub=True,
        label_names=["apple", "aquarium_fish", "baby"],
        validation_metrics={"eval_accuracy": 0.91, "eval_top5_accuracy": 0.99, "eval_f1_macro": 0.9, "eval_loss": 0.4},
        test_metrics={
            "test_accuracy": 0.9012,
            "test_top5_accuracy": 0.985,
            "test_f1_macro": 0.8975,
            "test_runtime": 3,
        },
        hyperparameters={"learning_rate": 5e-5, "per_device_train_batch_size": 64, "num_train_epochs": 3},
        command=f"accelerate launch run_image_classification.py --config recipes/cifar100.yaml --hub_token {FAKE_TOKEN}",
        recipe="recipes/cifar100.yaml",
        recipe_text="dataset_name: cifar100\nlearning_rate: 5.0e-5\n",
        strategy="zero3",
        hardware="2 x NVIDIA H200",
        throughput=1234.5,
        per_class_markdown=PER_CLASS,
        confusion_matrix_file="confusion_matrix_test.png",
        extra_tags=["cifar100"],
        license="mit",
        source="https://github.com/me/vit-recipes at commit 0123abc",
    )
    values.update(overrides)
    return CardInfo(**values)


def test_model_card_round_trip(tmp_path):
    path = write_model_card(card_info(), str(tmp_path / "out"))
    card = ModelCard.load(path)
    data = card.data
    assert data.base_model == "google/vit-base-patch16-224-in21k"
    assert data.datasets == ["uoft-cs/cifar100"]
    assert data.license == "mit" and data.pipeline_tag == "image-classification"
    assert data.library_name == "transformers"
    assert {"image-classification", "vision", "vit", "zero3", "cifar100"} <= set(data.tags)
    assert {"accuracy", "f1"} <= set(data.metrics)

    results = {r.metric_name: r for r in data.eval_results}
    assert results["Accuracy"].metric_value == 0.9012
    top5 = next(r for r in data.eval_results if r.metric_name == "Top-5 accuracy")  # evaluate's id, with its k
    assert top5.metric_type == "accuracy" and top5.metric_args == {"top_k": 5} and top5.metric_value == 0.985
    assert set(data.metrics) <= {"accuracy", "f1", "precision", "recall"}  # metric ids the Hub knows (evaluate's)
    assert results["F1 (macro)"].metric_value == 0.8975
    for result in data.eval_results:
        assert result.dataset_split == "test" and result.dataset_type == "uoft-cs/cifar100"
        assert result.task_type == "image-classification"
    assert metadata_load(path)["model-index"][0]["name"] == "me/vit-base-cifar100"

    body = card.text
    assert (
        "## Reproduce\n\nFrom https://github.com/me/vit-recipes at commit 0123abc:\n\n```bash\naccelerate launch"
        in body
    )
    assert "accelerate launch run_image_classification.py --config recipes/cifar100.yaml" in body
    assert PER_CLASS in body and "![Confusion matrix](confusion_matrix_test.png)" in body
    assert "```yaml\ndataset_name: cifar100" in body and "1,234.5 images/s" in body
    assert 'pipeline("image-classification", model="me/vit-base-cifar100")' in body and "<user>" not in body
    assert "90.12%" in body  # test accuracy in the summary


def test_model_card_history_versions_limitations_and_a_placeholder_repo(tmp_path):
    history = [
        {"loss": 2.1, "step": 5, "epoch": 0.5},
        {"eval_loss": 1.5, "eval_accuracy": 0.6, "eval_runtime": 2.0, "step": 10, "epoch": 1.0},
        {"eval_loss": 1.25, "eval_accuracy": 0.75, "eval_runtime": 2.0, "step": 20, "epoch": 2.0},
    ]
    info = card_info(
        model_name="out",
        repo_id="<user>/out",
        eval_history=history,
        versions={"transformers": "5.0.0", "torch": "2.13.0"},
        limitations=["Trained on 8 images of digits and evaluated on its test split (4 images)."],
    )
    path = write_model_card(info, str(tmp_path))
    body = ModelCard.load(path).text
    assert metadata_load(path)["model-index"][0]["name"] == "out"  # no placeholder in the metadata
    assert 'model="<user>/out"' in body and "replace `<user>/out` with the repo you push it to" in body
    assert "## Evaluation during training\n\n| Epoch | Step | Validation loss | Accuracy |" in body
    assert "| 1.00 | 10 | 1.5000 | 0.6000 |\n| 2.00 | 20 | 1.2500 | 0.7500 |" in body  # eval entries only, in order
    assert "## Framework versions\n\n- transformers 5.0.0\n- torch 2.13.0" in body
    assert "## Limitations\n\n- Trained on 8 images of digits" in body


def test_the_cards_results_lead_with_balanced_figures_when_train_is_imbalanced():
    """The summary led with balanced accuracy on an imbalanced train split, the results table below it with plain
    accuracy: both lead with the balanced figures now (model-index too), and a balanced dataset keeps accuracy first."""
    test = {"test_accuracy": 0.93, "test_f1_macro": 0.61, "test_precision_macro": 0.7, "test_recall_macro": 0.58}
    info = card_info(test_metrics=test, validation_metrics={}, imbalance=(6, 115), worst_recall=[("baby", 0.1)])
    card = build_model_card(info)
    table = card.text.split("## Results\n\n")[1].split("\n\n")[0].splitlines()
    assert [row.split(" | ")[0] for row in table[2:]] == [
        "| Balanced accuracy (mean per-class recall)", "| F1 (macro)", "| Accuracy", "| Precision (macro)"
    ]  # fmt: skip
    assert [r.metric_name for r in card.data.eval_results][:3] == ["Recall (macro)", "F1 (macro)", "Accuracy"]
    assert "**58.00%** balanced accuracy" in card.text  # the summary above it, as before
    balanced = build_model_card(card_info(test_metrics=test, validation_metrics={}))
    assert balanced.text.split("## Results\n\n")[1].splitlines()[2].startswith("| Accuracy | - | 0.9300 |")


def test_model_card_without_test_split_reports_validation(tmp_path):
    card = build_model_card(card_info(test_metrics={}))
    assert {r.dataset_split for r in card.data.eval_results} == {"validation"}
    assert {r.metric_name: r.metric_value for r in card.data.eval_results}["Accuracy"] == 0.91
    assert "no test split" in card.text.lower()


def test_model_card_from_scratch_and_local_dataset(tmp_path):
    info = card_info(base_model=None, base_model_source=None, dataset_id="/data/my_images", dataset_is_hub=False)
    path = write_model_card(info, str(tmp_path))
    meta = metadata_load(path)
    assert "base_model" not in meta and "datasets" not in meta
    assert "trained from scratch" in ModelCard.load(path).text


def test_model_card_never_contains_a_token(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", ENV_TOKEN)
    info = card_info(hyperparameters={"hub_token": ENV_TOKEN}, recipe_text=f"hub_token: {ENV_TOKEN}\n")
    text = Path(write_model_card(info, str(tmp_path))).read_text(encoding="utf-8")
    assert FAKE_TOKEN not in text and ENV_TOKEN not in text and "<redacted>" in text
    ModelCard.load(tmp_path / "README.md")  # still valid after redaction


# ------------------------------------------------------------------ a model or dataset the Hub must provide


def test_an_uncached_hub_model_offline_is_one_line_before_any_data(tmp_path, run_script, monkeypatch):
    """HF_HUB_OFFLINE=1 and a Hub id not in the cache: refused before the (bad) dataset path is read, not after
    the data is loaded and decoded."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    cache = tmp_path / "empty-cache"
    with pytest.raises(RecipeError) as caught:
        run_script("--dataset_name", "./no/such/folder", "--model_name_or_path", "google/vit-base-patch16-224-in21k",
                   "--cache_dir", cache, "--output_dir", tmp_path / "out", "--use_cpu", "true", "--report_to", "none")  # fmt: skip
    assert str(caught.value) == (
        "model 'google/vit-base-patch16-224-in21k' is not in the local Hugging Face cache and HF_HUB_OFFLINE=1: "
        "pass a local checkpoint folder (--model_name_or_path ./checkpoint) or unset HF_HUB_OFFLINE"
    )


@pytest.mark.slow
def test_an_unreachable_hub_is_one_line_before_any_data_or_model(tmp_path, tiny_vit):
    """Online, but the Hub does not answer (a closed port as its address): the dataset preset, then the model."""
    import os
    import subprocess
    import sys

    from conftest import ROOT

    env = {**os.environ, "HF_HUB_OFFLINE": "0", "HF_DATASETS_OFFLINE": "0", "TRANSFORMERS_OFFLINE": "0"}
    env.update(HF_ENDPOINT="http://127.0.0.1:9", HF_HOME=str(tmp_path / "hf"), OMP_NUM_THREADS="1")
    common = ["--use_cpu", "true", "--report_to", "none"]
    cases = (
        (["--dataset_name", "cifar100", "--model_name_or_path", tiny_vit], "the dataset 'uoft-cs/cifar100'"),
        (["--dataset_name", "./no/such/folder", "--model_name_or_path", "google/vit-base-patch16-224-in21k"],
         "the model 'google/vit-base-patch16-224-in21k'"),
    )  # fmt: skip
    script = [sys.executable, ROOT / "run_image_classification.py"]
    runs = [  # both at once
        subprocess.Popen([*script, *argv, *common, "--output_dir", tmp_path / f"out{i}"], env=env,
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        for i, (argv, _) in enumerate(cases)
    ]  # fmt: skip
    for run, (_, what) in zip(runs, cases):
        _, stderr = run.communicate(timeout=300)
        last = stderr.strip().splitlines()[-1]
        assert run.returncode == 2 and last.startswith(
            f"error: could not reach the Hugging Face Hub to download {what}: "
        ), last
        assert "to work offline pass local paths" in last and "Traceback" not in stderr
        # one API call, not a download retried with backoff (about 25 s and a warning per try)
        assert "huggingface_hub.utils._http" not in stderr, stderr[-2000:]


def test_the_cards_reproduce_command_is_the_launch_as_typed():
    """The strategy's own launcher and config, and none of what a launcher injects (--local_rank)."""
    from vit_recipes.plan import strategies
    from vit_recipes.publish.card import reproduce_command

    def strategy(name, world, per_node=None, from_accelerate=False):
        spec = strategies.get(name)
        nodes = world // (per_node or world)
        return types.SimpleNamespace(spec=spec, world_size=world, processes_per_node=per_node or world, nodes=nodes,
                                     from_accelerate=from_accelerate)  # fmt: skip

    args = ["--config", "recipes/x.yaml"]
    assert (
        reproduce_command(strategy("single", 1), args) == "python run_image_classification.py --config recipes/x.yaml"
    )
    assert reproduce_command(strategy("zero3", 8, from_accelerate=True), args) == (
        "accelerate launch --config_file accelerate_configs/zero3.yaml --num_processes 8 "
        "run_image_classification.py --config recipes/x.yaml"
    )
    deepspeed_argv = ["--local_rank=0", "--deepspeed", "ds_configs/zero2.json", *args]
    assert reproduce_command(strategy("zero2", 16, per_node=8), deepspeed_argv) == (
        "deepspeed --num_gpus 8 --num_nodes 2 run_image_classification.py --deepspeed ds_configs/zero2.json "
        "--config recipes/x.yaml"
    )
    assert reproduce_command(strategy("ddp", 2), args).startswith(
        "accelerate launch --config_file accelerate_configs/ddp.yaml --num_processes 2 "
    )


def test_the_cards_licence_is_the_base_models_and_its_source_is_the_checkout(tmp_path):
    import re

    from conftest import ROOT

    from vit_recipes.publish import card

    base = tmp_path / "base"
    base.mkdir()
    (base / "README.md").write_text("---\nlicense: mit\n---\n# A base model\n")
    assert card._license_of(str(base), None, "main") == "mit"
    assert card._license_of(str(tmp_path / "no-card"), None, "main") is None
    assert card._license_of("org/never-downloaded", str(tmp_path / "cache"), "main") is None  # the cache only
    if (ROOT / ".git").exists():  # a clone, as in CI: the commit that ran, and never credentials
        source = card._source()
        assert re.search(r" at commit [0-9a-f]{40}", source) and "@" not in source.split(" at commit")[0]

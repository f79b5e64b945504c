"""What every benchmark shares: the commit, the machine's facts, record folders and files, the peer's command.

A record folder is `benchmarks/results/<date>_<suite>_<gpus>x<card>/`: a README.md (question, command, commit, table,
conclusion, headline) beside the JSON the benchmark wrote. `python -m benchmarks.index` lists them all.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import re
import shlex
import signal
import socket
import subprocess
import sys
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
SCRIPT = "run_image_classification.py"
PEER_SCRIPT = "benchmarks/peer.py"  # transformers' example script, measured with our meter
LIBRARIES = ("torch", "transformers", "accelerate", "deepspeed", "datasets", "peft", "evaluate", "huggingface_hub")
LIBRARIES += ("timm", "torchao", "transformer_engine")
# A record README's conclusion until someone writes it; the index refuses a record that still holds it.
CONCLUSION_TO_WRITE = "_To write: what the table shows, before the record is committed._"


# --------------------------------------------------------------------------------------------------- the commit
def _quiet(cmd: list[str]) -> str | None:
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=30, cwd=ROOT)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def git_commit(short: bool = False) -> str:
    """The commit that runs; `-dirty` when tracked files differ from it. BENCH_GIT_COMMIT wins: a tree copied to a
    GPU machine may carry a stale .git, or none."""
    if os.environ.get("BENCH_GIT_COMMIT"):
        return os.environ["BENCH_GIT_COMMIT"]
    commit = _quiet(["git", "rev-parse", *(["--short"] if short else []), "HEAD"])
    if not commit:
        return "unknown"
    return commit + ("-dirty" if _quiet(["git", "status", "--porcelain", "--untracked-files=no"]) else "")


def code_fingerprint(*extra: Path) -> str:
    """sha1 of the script, the peer, the package and `extra` files: which code ran, even in a tree without .git."""
    import hashlib

    digest = hashlib.sha1()
    package = sorted((ROOT / "src" / "vit_recipes").rglob("*.py"))  # its folders' modules too
    for file in [ROOT / SCRIPT, ROOT / PEER_SCRIPT, *extra, *package]:
        if file.is_file():
            digest.update(file.name.encode() + b"\0" + file.read_bytes())
    return digest.hexdigest()[:16]


# --------------------------------------------------------------------------------------------------- the machine
def gpu_info() -> list[tuple[str, float | None]]:
    """(name, memory GiB) of each visible GPU, from nvidia-smi (no CUDA context in this process)."""
    out = _quiet(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader,nounits"])
    gpus = []
    for line in (out or "").splitlines():
        name, _, memory = line.rpartition(",")
        try:
            gpus.append((name.strip(), round(float(memory) / 1024, 1)))
        except ValueError:
            gpus.append((line.strip(), None))
    return gpus


def device_description(gpus: list[tuple[str, float | None]]) -> str:
    if gpus:
        return gpus[0][0]
    return f"CPU ({os.cpu_count() or 1} cores, {platform.processor() or platform.machine()})"


def card(device: str) -> str:
    """The short card name of a record folder: 'NVIDIA H200' -> 'H200', 'NVIDIA H100 80GB HBM3' -> 'H100', a CPU
    -> 'CPU'."""
    if device.startswith("CPU"):
        return "CPU"
    words = device.replace("NVIDIA ", "").split()
    return re.sub(r"[^\w.-]", "", words[0]) if words else "GPU"


def library_versions() -> dict[str, str | None]:
    versions: dict[str, str | None] = {"python": platform.python_version()}
    for name in LIBRARIES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def visible_gpu_ids() -> list[str]:
    """The GPUs CUDA_VISIBLE_DEVICES leaves this process (empty: unset, i.e. all of the machine's)."""
    return [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def kill_group(proc: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL, to the process group a benchmark started (start_new_session=True)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=10)
            return
        except subprocess.TimeoutExpired:
            continue


def run_env(**extra: str) -> dict[str, str]:
    """The environment of a benchmarked process: the checkout's package without an install, offline Hub."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    env.setdefault("HF_HUB_OFFLINE", "1")  # benchmarks use local assets; never wait on the network
    env.setdefault("HF_DATASETS_OFFLINE", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env["PYTHONUNBUFFERED"] = "1"
    return {**env, **extra}


def display_command(argv: list[str]) -> str:
    """The command as a person would type it (python / accelerate launch / torchrun)."""
    text = shlex.join(argv)
    exe = shlex.quote(sys.executable)
    text = text.replace(f"{exe} -m accelerate.commands.launch", "accelerate launch")
    text = text.replace(f"{exe} -m torch.distributed.run", "torchrun")
    return text.replace(exe, "python")


# --------------------------------------------------------------------------------------------------- the peer
def peer_args(model: str, dataset: str, output_dir: str, workers: int) -> list[str]:
    """The peer's command after `python`: transformers' example as its README types it, on our assets. Its stock
    Trainer needs the image column kept; the stand-in checkpoints have another head than the dataset's labels."""
    return [PEER_SCRIPT, "--model_name_or_path", model, "--dataset_name", dataset, "--output_dir", output_dir,
            "--dataloader_num_workers", str(workers), "--remove_unused_columns", "false",
            "--ignore_mismatched_sizes", "true", "--report_to", "none"]  # fmt: skip


# --------------------------------------------------------------------------------------------------- records
def record_folder(suite: str, gpus: int, device: str, date: datetime.date | None = None) -> Path:
    """benchmarks/results/<date>_<suite>_<gpus>x<card>: the one naming scheme of the records."""
    date = date or datetime.date.today()
    return RESULTS / f"{date.isoformat()}_{suite}_{max(gpus, 1)}x{card(device)}"


def write_json(path: Path, data) -> Path:
    """Write `data` as JSON through a temporary file: a record is never half written."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    tmp.replace(path)
    return path


def start_readme(folder: Path, title: str, question: str, command: str, table: str, device: str) -> Path:
    """A record's README.md as the run leaves it: what is known now, and the conclusion still to write. Kept when
    the folder has one (a second call into the same record)."""
    path = folder / "README.md"
    if path.is_file():
        return path
    lines = [f"# {title}", "", f"**Question:** {question}", "", "**Headline:** _to write: the one figure that answers "
             "it._", "", f"**Command:** `{command}`", "", f"**Commit:** {git_commit(short=True)}, on {device}, "
             f"{datetime.date.today().isoformat()}.", "", table.strip(), "", "## Conclusion", "", CONCLUSION_TO_WRITE,
             ""]  # fmt: skip
    folder.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines))
    return path


def _numeric(cell) -> bool:
    text = str(cell).replace(",", "").replace("%", "").split(" ")[0]
    try:
        float(text)
        return True
    except ValueError:
        return text == "–"


def markdown_table(header: list[str], rows: list[list], align_numbers: bool = False) -> list[str]:
    """A markdown table's lines, `|` in cells escaped. With align_numbers, columns (but the first) whose cells are
    all numbers are right-aligned."""
    right = [align_numbers and i and rows and all(_numeric(row[i]) for row in rows) for i in range(len(header))]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---:" if r else "---" for r in right) + "|"]
    return lines + ["| " + " | ".join(str(c).replace("|", "\\|") for c in row) + " |" for row in rows]


def save_png(fig, path: Path, dpi: int = 90) -> Path:
    """Save a matplotlib figure as a small PNG (a 256-colour palette: charts have few colours), as records keep."""
    import io

    from PIL import Image

    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=dpi, bbox_inches="tight")
    image = Image.open(buffer).convert("RGB").quantize(colors=256, method=Image.Quantize.MEDIANCUT)
    image.save(path, optimize=True)
    return path

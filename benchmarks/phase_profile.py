"""cProfile of what a run does outside its training steps: loading, the model, decoding, the Trainer's build,
train() up to the first step's end, evaluations, checkpoint saves, reports and the card. Runs the script in-process.

    python benchmarks/phase_profile.py profile.txt --config recipes/vit-base/cifar100/config_full.yaml ...

Writes each part's wall time (JSON, first line) and its 35 costliest calls by cumulative time to the first argument.
cProfile slows Python-heavy code: read the split between calls, not the absolute times.
"""

import cProfile
import functools
import io
import json
import pstats
import sys
import time
from pathlib import Path

from transformers import TrainerCallback

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parents[1] / "src")]
import run_image_classification as script  # noqa: E402
from vit_recipes.trainer import ImageClassificationTrainer  # noqa: E402

REPORT, TIMES = io.StringIO(), {}


def _write(label: str, profile: cProfile.Profile, seconds: float, rows: int = 35) -> None:
    TIMES.setdefault(label, []).append(round(seconds, 3))
    REPORT.write(f"\n===== {label} {seconds:.3f} s =====\n")
    pstats.Stats(profile, stream=REPORT).sort_stats("cumtime").print_stats(rows)


def profiled(label: str, function):
    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        profile, start = cProfile.Profile(), time.perf_counter()
        profile.enable()
        try:
            return function(*args, **kwargs)
        finally:
            profile.disable()
            _write(label, profile, time.perf_counter() - start)

    return wrapper


class _FirstStep(TrainerCallback):
    """Profiles train() from its entry to the first optimizer step's end."""

    def __init__(self):
        self.profile, self.start = cProfile.Profile(), time.perf_counter()
        self.profile.enable()

    def on_step_end(self, args, state, control, **kwargs):
        if self.profile is not None:
            self.profile.disable()
            _write("train() entry to the first step's end", self.profile, time.perf_counter() - self.start, 45)
            self.profile = None


def main() -> None:
    out, argv = sys.argv[1], sys.argv[2:]
    for name in ("evaluate", "predict", "_save_checkpoint"):
        setattr(ImageClassificationTrainer, name, profiled(name, getattr(ImageClassificationTrainer, name)))
    for name in ("load_data", "build_finetune_model", "decode_splits", "build_trainer", "save_model_files",
                 "write_run_reports", "publish"):  # fmt: skip
        setattr(script, name, profiled(name, getattr(script, name)))
    train = ImageClassificationTrainer.train

    def train_from_entry(self, *args, **kwargs):
        self.add_callback(_FirstStep())
        return train(self, *args, **kwargs)

    ImageClassificationTrainer.train = train_from_entry
    script.main(argv)
    with open(out, "w") as f:
        f.write(json.dumps(TIMES) + "\n" + REPORT.getvalue())
    print("TIMES " + json.dumps(TIMES), flush=True)


if __name__ == "__main__":
    main()

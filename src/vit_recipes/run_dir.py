"""The output directory holds one run: resume it, or refuse to mix another run into it. Never overwrite silently."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

from transformers.trainer_utils import get_last_checkpoint

from .errors import RecipeError

logger = logging.getLogger(__name__)

RUN_FILE = "run_config.json"


@dataclass(frozen=True)
class OutputState:
    """What to do with the output directory."""

    state: str
    """"fresh" (nothing there, or not training), "resume" (this run's own checkpoint) or "overwrite"."""
    resume_from: str | None = None
    """The checkpoint folder training resumes from."""


def resolve_output_dir(training_args, run: dict) -> OutputState:
    """Which checkpoint to resume from, if any. Raises when output_dir holds something else."""
    if not training_args.do_train:
        return OutputState("fresh")
    out = Path(training_args.output_dir)
    explicit = training_args.resume_from_checkpoint
    if explicit and not Path(explicit).is_dir():
        raise RecipeError(f"--resume_from_checkpoint {explicit} is not a checkpoint folder")
    if not out.is_dir() or not any(out.iterdir()):
        return OutputState("resume" if explicit else "fresh", explicit)
    if training_args.overwrite_output_dir:
        return OutputState("overwrite", explicit)
    saved_file = out / RUN_FILE
    if not saved_file.is_file():
        raise RecipeError(
            f"output_dir {out} is not empty and holds no run of this script; choose another "
            "--output_dir or pass --overwrite_output_dir"
        )
    saved = json.loads(saved_file.read_text())
    changed = [k for k in sorted(set(saved) | set(run)) if saved.get(k) != run.get(k)]
    if changed:
        key = changed[0]
        raise RecipeError(
            f"output_dir {out} holds a different run ({key}: {saved.get(key)!r} there, "
            f"{run.get(key)!r} now); choose another --output_dir or pass --overwrite_output_dir"
        )
    if explicit:
        return OutputState("resume", explicit)
    last = get_last_checkpoint(str(out))
    if last:
        logger.info("Resuming the run found in %s from %s", out, last)
        return OutputState("resume", last)
    if (out / "all_results.json").is_file():
        raise RecipeError(
            f"output_dir {out} holds a finished run of this recipe; pass --overwrite_output_dir to "
            "train again or choose another --output_dir"
        )
    return OutputState("fresh")


def record_run(output_dir: str, run: dict) -> None:
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / RUN_FILE).write_text(json.dumps(run, indent=2) + "\n")

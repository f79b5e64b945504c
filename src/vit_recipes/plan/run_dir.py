"""The output directory holds one run: resume it, or refuse to mix another run into it. Never overwrite silently.
A checkpoint's `run_identity.json`, written last, names its run: auto-resume skips one without it."""

import json
import logging
import os
import re
import shutil
import socket
import time
from dataclasses import dataclass
from pathlib import Path

from ..core.errors import RecipeError

logger = logging.getLogger(__name__)

RUN_FILE = "run_config.json"
CHECKPOINT_RECORD = "run_identity.json"
CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")
TRAINER_STATE = "trainer_state.json"
LOSS_RECORD = "train_loss.json"
WRITE_PROBE = ".write-probe-"  # rank 0's writability check (checks.py): another rank must not read it as a run
LOCK_FILE = ".run.lock"  # held by the run writing into the folder (lock_output_dir)
_ELSEWHERE = "choose another --output_dir or pass --overwrite_output_dir"  # the way out of two refusals


@dataclass(frozen=True)
class OutputState:
    """What to do with the output directory: `state` is "fresh", "resume", "overwrite" or "refuse"."""

    state: str
    resume_from: str | None = None  # the checkpoint to resume (with "refuse": the one it would have resumed)
    stale_checkpoints: tuple[str, ...] = ()  # with "overwrite": the old run's checkpoints, removed by plan.configure
    refusal: str | None = None  # with "refuse": the one line that says why and what to do (checks.py raises it)


def checkpoints(folder: str | os.PathLike) -> list[Path]:
    """`checkpoint-N` folders in `folder`, newest (highest step) first."""
    if not os.path.isdir(folder):
        return []
    found = [(int(m.group(1)), p) for p in Path(folder).iterdir() if p.is_dir() and (m := CHECKPOINT.match(p.name))]
    return [p for _, p in sorted(found, reverse=True)]


def mark_complete(checkpoint: str | os.PathLike, identity: dict) -> None:
    """Record that `checkpoint` is complete and which run wrote it (atomically: a crash leaves no half record)."""
    path = Path(checkpoint) / CHECKPOINT_RECORD
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(identity, indent=2) + "\n")
    os.replace(tmp, path)


def write_loss_record(checkpoint: str | os.PathLike, loss_sum: float, steps: int) -> None:
    """The training loss summed over every step up to this checkpoint (resumes then report the whole run's mean)."""
    (Path(checkpoint) / LOSS_RECORD).write_text(json.dumps({"loss_sum": loss_sum, "steps": steps}) + "\n")


def read_loss_record(checkpoint: str | os.PathLike | None) -> float | None:
    """The loss sum a checkpoint recorded, None when it has no record (not ours, or older)."""
    path = Path(checkpoint) / LOSS_RECORD if checkpoint else None
    return float(json.loads(path.read_text())["loss_sum"]) if path is not None and path.is_file() else None


def how_checkpoint_differs(checkpoint: str | os.PathLike, num_labels: int, shapes: dict[str, tuple]) -> str | None:
    """What makes `checkpoint` another model than this run's (`num_labels` classes, parameter name -> shape), from its
    config.json and model.safetensors header: "5 classes there, 10 here" and the first other parameter whose shape
    differs. None when its files say neither."""
    folder, found = Path(checkpoint), []
    config = json.loads((folder / "config.json").read_text()) if (folder / "config.json").is_file() else {}
    there = len(config.get("id2label") or {}) or config.get("num_labels")
    if there and there != num_labels:
        found.append(f"{there} classes there, {num_labels} here")
    if (folder / "model.safetensors").is_file():
        from safetensors import safe_open

        with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
            saved = {key: tuple(f.get_slice(key).get_shape()) for key in f.keys()}  # noqa: SIM118 (not iterable)
        head = lambda a, b: a[:1] == (there,) and b[:1] == (num_labels,)  # noqa: E731 (said as the class count)
        if other := next(
            (k for k, v in shapes.items() if k in saved and saved[k] != v and not head(saved[k], v)), None
        ):
            found.append(f"{other} {list(saved[other])} there, {list(shapes[other])} here")
    return "; ".join(found) or None


def _differences(saved: dict, now: dict) -> list[str]:
    keys = sorted(set(saved) | set(now))
    return [f"{k}: {saved.get(k)!r} there, {now.get(k)!r} now" for k in keys if saved.get(k) != now.get(k)]


def _refuse(refusal: str, resume_from: str | None = None) -> OutputState:
    return OutputState("refuse", resume_from, refusal=refusal)


def resolve_output_dir(training_args, run: dict) -> OutputState:
    if not training_args.do_train:
        return OutputState("fresh")
    if explicit := training_args.resume_from_checkpoint:
        # --resume_from_checkpoint resumes whichever run wrote it ("resume anyway"); it must be complete.
        if not (Path(explicit) / TRAINER_STATE).is_file():
            return _refuse(
                f"--resume_from_checkpoint {explicit} is not a complete checkpoint (no {TRAINER_STATE}): "
                "pass a checkpoint-N folder a run finished writing, or drop the flag to start fresh"
            )
        record = Path(explicit) / CHECKPOINT_RECORD
        if record.is_file() and (changed := _differences(json.loads(record.read_text()), run)):
            logger.warning("Resuming %s, written by another run (%s), as asked", explicit, "; ".join(changed))
        return OutputState("resume", explicit)
    out = Path(training_args.output_dir)
    if not out.is_dir() or not any(p for p in out.iterdir() if not p.name.startswith((WRITE_PROBE, LOCK_FILE))):
        return OutputState("fresh")
    if training_args.overwrite_output_dir:
        # Only checkpoints the Trainer or this project wrote: foreign folders are never touched.
        ours = [c for c in checkpoints(out) if (c / CHECKPOINT_RECORD).is_file() or (c / TRAINER_STATE).is_file()]
        return OutputState("overwrite", None, tuple(map(str, ours)))
    saved_file = out / RUN_FILE
    if not saved_file.is_file():
        return _refuse(f"output_dir {out} is not empty and holds no run of this script; {_ELSEWHERE}")
    found = checkpoints(out)
    complete = next((c for c in found if (c / CHECKPOINT_RECORD).is_file()), None)
    if skipped := [c.name for c in found[: found.index(complete) if complete else len(found)]]:
        logger.warning(
            f"Skipping {', '.join(skipped)} in {out}: no {CHECKPOINT_RECORD}, so the save did not finish (or predates "
            "this record; pass --resume_from_checkpoint to use one anyway)"
        )
    candidate = str(complete) if complete else None
    if changed := _differences(json.loads(saved_file.read_text()), run):
        anyway = f", or resume its {complete.name} anyway with --resume_from_checkpoint {complete}" if complete else ""
        return _refuse(f"output_dir {out} holds a different run ({changed[0]}); {_ELSEWHERE}{anyway}", candidate)
    # Finished (results, then the card, written; no more steps asked for): resuming would train nothing, rewrite both.
    finished = (out / "all_results.json").is_file() and (not complete or (out / "README.md").is_file())
    if finished and not (complete and _asks_for_more(training_args, complete)):
        return _refuse(
            f"output_dir {out} holds a finished run of this recipe; pass --overwrite_output_dir to train "
            "again or choose another --output_dir"
        )
    if complete:
        if changed := _differences(json.loads((complete / CHECKPOINT_RECORD).read_text()), run):
            return _refuse(
                f"{complete} was written by another run ({changed[0]}): resume it anyway with "
                f"--resume_from_checkpoint {complete}, or start fresh with --overwrite_output_dir (which removes "
                "the old run's checkpoints)",
                candidate,
            )
        logger.warning("Resuming the run found in %s from %s", out, complete)
        return OutputState("resume", candidate)
    return OutputState("fresh")


_HELD_LOCKS: dict = {}  # folder -> its open lock file: the OS drops the lock when the process ends, however it ends


def lock_output_dir(output_dir: str | os.PathLike) -> None:
    """One run at a time in an output folder (flock: a crashed or killed run leaves no stale lock)."""
    import fcntl

    folder = Path(output_dir)
    folder.mkdir(parents=True, exist_ok=True)
    if str(folder.resolve()) in _HELD_LOCKS:  # this process's own earlier run (runs of main() in one process)
        return
    handle = open(folder / LOCK_FILE, "a+")  # noqa: SIM115 (held until the process ends)
    handle.seek(0)  # "a+" starts at the end: the holder's line is read, or replaced, from the start
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        holder = handle.read().strip() or "another process"
        handle.close()
        raise RecipeError(
            f"output_dir {folder} is in use by another run ({holder}): wait for it to end, or choose another "
            "--output_dir"
        ) from None
    handle.truncate()
    handle.write(f"pid {os.getpid()} on {socket.gethostname()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
    handle.flush()
    _HELD_LOCKS[str(folder.resolve())] = handle


def _asks_for_more(training_args, checkpoint: Path) -> bool:
    """This command trains past where the checkpoint's run ended (a larger --max_steps or --num_train_epochs)."""
    state = json.loads((checkpoint / TRAINER_STATE).read_text()) if (checkpoint / TRAINER_STATE).is_file() else {}
    if training_args.max_steps > 0:
        return training_args.max_steps > state.get("global_step", 0)
    return training_args.num_train_epochs > state.get("num_train_epochs", 0)


def remove_checkpoints(paths: tuple[str, ...]) -> None:
    for path in paths:
        shutil.rmtree(path, ignore_errors=True)
        logger.warning("--overwrite_output_dir: removed the previous run's %s", path)


def to_universal(checkpoint: str | os.PathLike) -> None:
    """ds_to_universal: a DeepSpeed checkpoint for another process count (`latest_universal`, written last: done)."""
    from types import SimpleNamespace

    from deepspeed.checkpoint import ds_to_universal

    folder = Path(checkpoint)
    done = folder / "latest_universal"
    if done.is_file() and (folder / done.read_text().strip()).is_dir():
        return
    tag = (folder / "latest").read_text().strip()
    out = folder / f"{tag}_universal"
    shutil.rmtree(out, ignore_errors=True)
    folders = dict(input_folder=str(folder / tag), output_folder=str(out), strict=True, inject_missing_state=True)
    options = dict(num_extract_workers=min(4, os.cpu_count() or 1), num_merge_workers=1, keep_temp_folder=False)
    ds_to_universal.main(SimpleNamespace(**folders, **options))


def record_run(output_dir: str, run: dict) -> None:
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / RUN_FILE).write_text(json.dumps(run, indent=2) + "\n")

"""run_image_classification.py with a kill -9 at one point of the run, for the fault-injection tests.

    python tests/fault_worker.py POINT STEP SCRIPT_ARGS...
    deepspeed --num_gpus 2 tests/fault_worker.py POINT STEP SCRIPT_ARGS...     (every rank kills itself)

POINT names where the process kills itself (SIGKILL: no cleanup, no atexit), at global step STEP:
- mid_step: inside a training step, after the forward and backward, before the optimizer step;
- checkpoint_model / checkpoint_optimizer / checkpoint_state: during the checkpoint write, after the model files,
  after the optimizer and scheduler, after trainer_state.json (before the record that makes it complete);
- final_save: during the final save, after the model's weights;
- final_outputs: after the final save, before the processor, labels, metrics and card.
The patches are made here, around the script, so that no fault hook lives in the package. `run(point, step, args)`
does the same in a process that imported this module (tests/test_checkpoints.py forks it from a process that
imported the script's modules once).
"""

import os
import runpy
import signal
import sys
from pathlib import Path

import transformers

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def die():
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def kill_around(owner, name: str, before: bool, when) -> None:
    original = getattr(owner, name)

    def wrapper(*args, **kwargs):
        if before and when(*args):
            die()
        out = original(*args, **kwargs)
        if not before and when(*args):
            die()
        return out

    setattr(owner, name, wrapper)


def run(point: str, step: int, script_args: list[str], threads: int | None = None) -> None:
    """The script with `script_args`, killed with -9 at `point` of global step `step`; `threads`: torch's CPU threads."""
    if threads is not None:
        import torch

        torch.set_num_threads(threads)

    def at_step(self, *args) -> bool:
        return self.state.global_step == step

    Trainer = transformers.Trainer
    if point == "mid_step":
        kill_around(Trainer, "training_step", before=False, when=at_step)
    elif point == "checkpoint_model":
        kill_around(Trainer, "_save_optimizer_and_scheduler", before=True, when=at_step)
    elif point == "checkpoint_optimizer":
        kill_around(Trainer, "_save_rng_state", before=True, when=at_step)
    elif point == "checkpoint_state":
        import vit_recipes.train.checkpoint_io

        kill_around(vit_recipes.train.checkpoint_io, "write_loss_record", before=True, when=lambda *a: a[2] == step)
    elif point == "final_save":
        # the final save writes into output_dir itself; checkpoints write into checkpoint-N
        kill_around(
            Trainer, "_save", before=False, when=lambda self, out=None, *a: out in (None, self.args.output_dir)
        )
    elif point == "final_outputs":
        import vit_recipes.steps

        kill_around(vit_recipes.steps, "save_final_model", before=False, when=lambda *a: True)
    else:
        raise SystemExit(f"unknown fault point {point}")

    sys.argv = [str(ROOT / "run_image_classification.py"), *script_args]
    runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    # The `deepspeed` launcher puts --local_rank=N first: hand it on to the script.
    local_rank = [a for a in sys.argv[1:] if a.startswith("--local_rank")]
    rest = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]
    run(rest[0], int(rest[1]), rest[2:] + local_rank)

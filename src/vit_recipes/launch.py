"""The process around a run: how many processes were launched, DeepSpeed's CPU buffers, and a clean shutdown."""

import atexit
import contextlib
import glob
import logging
import os
import sys
import time

from .errors import RecipeError

logger = logging.getLogger(__name__)

SHM_BUFFER_PREFIX = "/dev/shm/deepspeed_allreduce_buffer_"  # DeepSpeed's shm comm op (csrc/cpu/comm/shm.cpp)


def is_true(value) -> bool:
    """How launchers and users spell a true flag or environment variable."""
    return str(value).strip().lower() in ("1", "true", "yes", "on")


def env_int(*names: str, default: int = 1) -> int:
    """The first of these environment variables that holds a whole number, else `default`."""
    values = (os.environ.get(name, "").strip() for name in names)
    return next((int(value) for value in values if value.isdigit()), default)


def visible_gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


_STEPPED_ASIDE: dict[str, int] = {}  # {"launched": N, "gpus": G} once the surplus processes stepped aside


def check_processes(use_cpu: bool) -> None:
    """Processes per machine (LOCAL_WORLD_SIZE; deepspeed's: LOCAL_SIZE) against GPUs, before the process group."""
    world, local = env_int("WORLD_SIZE"), env_int("LOCAL_WORLD_SIZE", "LOCAL_SIZE", "WORLD_SIZE")
    if world <= 1 or use_cpu or is_true(os.environ.get("ACCELERATE_USE_CPU")):
        return
    if (gpus := visible_gpus()) == 0:
        raise RecipeError(
            f"{world} processes were launched but this machine has no GPU: each would train alone on the CPU. "
            "For N CPU processes over gloo pass --use_cpu true to the script and --num_processes N to accelerate "
            "(--num_gpus N to deepspeed), or launch on a machine with GPUs"
        )
    if local > gpus and world == local and os.environ.get("TORCHELASTIC_RUN_ID"):
        step_aside(local, gpus)  # the shipped accelerate configs' 8 processes on a machine of fewer GPUs
    elif local > gpus:
        raise RecipeError(
            f"{local} processes on this machine but only {gpus} GPU(s) visible: launch at most {gpus} "
            f"(--num_processes {gpus} with accelerate, --num_gpus {gpus} with deepspeed)"
        )


def step_aside(launched: int, gpus: int) -> None:
    """One machine, more processes than GPUs, started by torchrun (`accelerate launch` runs torch's elastic agent):
    processes with a local rank past the GPUs exit now, status 0, and the others train as a world of `gpus`.

    Sound under that launcher, and only before any collective: the agent ends the run at a worker's non-zero exit
    (stopping the others: the ChildFailedError report) but counts an exit 0 as that worker done and waits for the
    rest (torch.distributed.elastic's SubprocessContext._poll), and no process has joined a group yet: the kept ones
    form theirs from WORLD_SIZE, set here, through the agent's store (which counts no workers). Several machines
    are refused instead: their ranks would need numbering across machines, whose GPU counts this one cannot see;
    the deepspeed launcher is given its count (--num_gpus) or takes every GPU."""
    if env_int("LOCAL_RANK", default=0) >= gpus:
        sys.exit(0)  # nothing printed: the kept local rank 0 says it once (stepped_aside_note)
    for name in ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "ROLE_WORLD_SIZE"):  # torchrun's; RANK and LOCAL_RANK stay
        if name in os.environ:
            os.environ[name] = str(gpus)
    _STEPPED_ASIDE.update(launched=launched, gpus=gpus)


def stepped_aside_note(global_batch: int) -> str | None:
    """The line that says processes stepped aside (step_aside), and what it did to the global batch; else None."""
    if not _STEPPED_ASIDE:
        return None
    launched, gpus = _STEPPED_ASIDE["launched"], _STEPPED_ASIDE["gpus"]
    return (
        f"{launched} processes were launched on this machine, which has {gpus} GPU(s): {launched - gpus} exited "
        f"before the process group and {gpus} train, global batch {global_batch} ({launched} would have made "
        f"{global_batch * launched // gpus}); --num_processes {gpus} launches only these"
    )


def remove_stale_shm_buffers(min_age_s: float = 5.0) -> list[str]:
    """Delete (and return) DeepSpeed CPU all-reduce buffers left by killed ranks: unmapped, older than `min_age_s`."""
    if not (buffers := glob.glob(f"{SHM_BUFFER_PREFIX}*")):
        return []
    mapped: set[str] = set()
    for maps in glob.glob("/proc/[0-9]*/maps"):
        with contextlib.suppress(OSError), open(maps) as f:  # processes come and go; others' maps may be unreadable
            mapped.update(line.split()[-1] for line in f if SHM_BUFFER_PREFIX in line)
    removed = []
    for path in buffers:
        with contextlib.suppress(OSError):
            if path not in mapped and time.time() - os.path.getmtime(path) > min_age_s:
                os.unlink(path)
                removed.append(path)
    if removed:
        logger.warning(
            "Removed %d DeepSpeed buffer(s) that killed ranks left in /dev/shm: %s", len(removed), ", ".join(removed)
        )
    return removed


def remove_shm_buffer_at_exit() -> None:
    """Delete this rank's DeepSpeed buffer (69 MB in /dev/shm) at exit; on local rank 0, killed ranks' ones now."""
    if os.environ.get("LOCAL_RANK", "0") == "0":
        remove_stale_shm_buffers()
    rank, port = os.environ.get("RANK"), os.environ.get("MASTER_PORT")
    if rank is None or port is None:
        return

    def remove() -> None:
        for path in glob.glob(f"{SHM_BUFFER_PREFIX}*_{port}_{rank}"):
            with contextlib.suppress(OSError):  # already gone, or another user's file: nothing to do
                os.unlink(path)

    atexit.register(remove)


def bind_deepspeed_comm() -> None:
    """Let DeepSpeed use our process group (gloo with --use_cpu): else zero.Init sees world size 1 on CPU processes."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        import deepspeed.comm

        if not deepspeed.comm.is_initialized():
            deepspeed.comm.init_distributed(dist_backend=dist.get_backend(), auto_mpi_discovery=False)


def shutdown() -> None:
    """Tear the process group down once every rank is done (torch asks for it; NCCL may hang at exit without it)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()

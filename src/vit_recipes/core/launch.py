"""The process around a run: how many processes were launched, DeepSpeed's CPU buffers, and a clean shutdown."""

import atexit
import contextlib
import glob
import json
import logging
import os
import signal
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
_CROWDED: dict[str, int] = {}  # {"processes": N, "cores": C}: more CPU processes on this machine than cores
_ONE_PROCESS: dict[str, int | str] = {}  # {"asked": N, "config": path}: `accelerate launch --cpu` ran one of N


def cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def check_processes(use_cpu: bool) -> None:
    """Processes per machine (LOCAL_WORLD_SIZE; deepspeed's: LOCAL_SIZE) against GPUs, before the process group."""
    _CROWDED.clear()
    _ONE_PROCESS.clear()
    check_accelerate_cpu_launch()
    world, local = env_int("WORLD_SIZE"), env_int("LOCAL_WORLD_SIZE", "LOCAL_SIZE", "WORLD_SIZE")
    if world <= 1:
        return
    if use_cpu or is_true(os.environ.get("ACCELERATE_USE_CPU")):
        if local > (available := cores()):  # legitimate (tests run 4 on 2 cores), slow: the configs' 8 are GPUs
            _CROWDED.update(processes=local, cores=available)
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


def accelerate_cpu_launch() -> tuple[str | None, int, str] | None:
    """(config file, processes, accelerate's distributed type) that `accelerate launch --cpu` was asked for, when
    it started this process; else None. Its simple launcher, the one --cpu picks, starts the script once and passes
    it none of these (only ACCELERATE_USE_CPU, and MASTER_ADDR for more than one process), so they are read from
    its command line, by accelerate's own parser and config loader."""
    if not is_true(os.environ.get("ACCELERATE_USE_CPU")) or {"RANK", "LOCAL_RANK"} & set(os.environ):
        return None  # not the simple launcher: torchrun (accelerate's other launchers) and deepspeed set ranks
    import psutil

    try:
        parent = psutil.Process().parent()
        command, cwd = parent.cmdline(), parent.cwd()
    except (psutil.Error, AttributeError):  # no parent (None), or not ours to read
        return None
    # `accelerate launch ...` or `python -m accelerate.commands.launch ...`
    starts = [i + 1 for i, word in enumerate(command) if word == "accelerate.commands.launch"
              or (word == "launch" and i > 0 and "accelerate" in os.path.basename(command[i - 1]))]  # fmt: skip
    if not starts:
        return None
    from accelerate.commands.config.config_args import load_config_from_file
    from accelerate.commands.launch import launch_command_parser

    try:
        asked = launch_command_parser().parse_args(command[starts[0] :])
        config = load_config_from_file(os.path.join(cwd, asked.config_file)) if asked.config_file else None
    except (SystemExit, OSError, ValueError):  # the launcher parsed and loaded these already: not expected
        return None
    kind = getattr(config.distributed_type, "value", str(config.distributed_type)) if config else "NO"
    return asked.config_file, asked.num_processes or (config.num_processes if config else 1), kind


def check_accelerate_cpu_launch() -> None:
    """`accelerate launch --cpu` starts the script once, whatever the config and --num_processes ask: refused where
    the config's strategy would not run (DeepSpeed, FSDP: one plain process instead), noted where only the process
    count differs (`launch_notes`)."""
    if (asked := accelerate_cpu_launch()) is None:
        return
    config, processes, kind = asked
    if kind == "DEEPSPEED":
        raise RecipeError(
            f"accelerate launch --cpu starts one plain process: {config} asks for DeepSpeed on {processes} "
            "processes, which would not run. For DeepSpeed on the CPU drop --cpu and pass --use_cpu true to the "
            "script (--num_processes N: N processes over gloo)"
        )
    if kind == "FSDP":
        raise RecipeError(
            f"accelerate launch --cpu starts one plain process: {config} asks for FSDP, which needs GPUs. On the "
            "CPU use accelerate_configs/ddp.yaml or a DeepSpeed config, with --use_cpu true to the script in place "
            "of --cpu"
        )
    if processes > 1:
        _ONE_PROCESS.update(asked=processes, config=config or "")


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


def launch_notes(global_batch: int) -> list[str]:
    """The WARNING lines that say how the processes launched differ from what was asked, or run slowly."""
    notes = [note] if (note := stepped_aside_note(global_batch)) else []
    if _CROWDED:
        processes, available = _CROWDED["processes"], _CROWDED["cores"]
        notes.append(
            f"{processes} CPU processes on this machine's {available} core(s): each trains on a share of a core, "
            f"global batch {global_batch}; --num_processes {available} (--num_gpus {available} with deepspeed) "
            f"runs one per core, global batch {global_batch * available // processes}"
        )
    if _ONE_PROCESS:
        asked, config = _ONE_PROCESS["asked"], _ONE_PROCESS["config"]
        notes.append(
            f"accelerate launch --cpu starts one process: {asked} were asked{f' ({config})' if config else ''}, 1 "
            f"trains, global batch {global_batch} ({asked} would have made {global_batch * asked}); for {asked} "
            f"CPU processes over gloo drop --cpu and pass --use_cpu true to the script"
        )
    return notes


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


def unbuilt_shm_op() -> str | None:
    """The folder DeepSpeed's comm will compile its CPU shared-memory collective into when it starts (build_shm_op,
    as it decides: the CPU accelerator, not prebuilt), where that op is not built yet; else None."""
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator
    from deepspeed.git_version_info import installed_ops
    from torch.utils.cpp_extension import _get_build_directory  # where torch's JIT `load` builds and caches it

    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if (
        builder is None
        or not deepspeed.ops.__compatible_ops__.get(builder.NAME, False)
        or installed_ops.get(builder.name)
    ):
        return None
    folder = _get_build_directory(builder.name, verbose=False)
    return None if os.path.exists(os.path.join(folder, f"{builder.name}.so")) else folder


def bind_deepspeed_comm() -> None:
    """Let DeepSpeed use our process group (gloo with --use_cpu): else zero.Init sees world size 1 on CPU processes.
    Its comm compiles an op on a CPU machine's first DeepSpeed run, minutes without a word: said first, once."""
    import torch.distributed as dist

    if env_int("LOCAL_RANK", default=0) == 0 and (folder := unbuilt_shm_op()):
        print(
            f"DeepSpeed is compiling its shared-memory collective for CPU processes into {folder}: once per machine, "
            "minutes on a few cores, with nothing printed meanwhile (`make install` builds it ahead)",
            flush=True,
        )
    if dist.is_available() and dist.is_initialized():
        import deepspeed.comm

        if not deepspeed.comm.is_initialized():
            deepspeed.comm.init_distributed(dist_backend=dist.get_backend(), auto_mpi_discovery=False)


def record_for_the_launcher(line: str) -> None:
    """Put the run's error line where torch's elastic agent (torchrun, `accelerate launch`) reads a failed worker's
    cause, TORCHELASTIC_ERROR_FILE: its ChildFailedError report then quotes the line ("traceback : error: ...")
    instead of "error_file: <N/A>" and a link. By hand, not torch's `record`: that writes the exception's traceback,
    which the report would print; the file's plain-string form is quoted as it is (ProcessFailure)."""
    if path := os.environ.get("TORCHELASTIC_ERROR_FILE"):
        with contextlib.suppress(OSError), open(path, "w") as f:
            json.dump({"message": line, "timestamp": int(time.time())}, f)


def await_the_launchers_stop(seconds: float = 30) -> None:
    """A local rank past 0 whose refusal local rank 0 shares (every rank checks the same arguments) and prints:
    wait for the launcher, which stops every rank at the first failure, and exit 0 at its SIGTERM. Exiting now
    could let it kill rank 0 before that prints; ending at the signal with its status (-15) would add this rank to
    torch elastic's report as one more failure (7 lines each) with nothing to add to rank 0's line. Returns after
    `seconds` when no stop came: the error is then this rank's own."""
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        time.sleep(seconds)
    finally:
        signal.signal(signal.SIGTERM, previous)


def shutdown() -> None:
    """Tear the process group down once every rank is done (torch asks for it; NCCL may hang at exit without it)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()

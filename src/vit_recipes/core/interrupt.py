"""SIGINT/SIGTERM while training: checkpoint at the next step end, then stop; a later second signal stops at once."""

import functools
import signal
import threading
import time

import torch
from transformers import TrainerCallback

SIGNALS = (signal.SIGINT, signal.SIGTERM)
REPEAT_AFTER = 2.0  # seconds: a second signal sooner than this is a launcher forwarding the first


class RunInterrupted(Exception):
    """Training stopped on a signal after saving checkpoint-`step` (raised once the Trainer has returned)."""

    def __init__(self, step: int, signum: int):
        super().__init__(f"interrupted at step {step}; checkpoint-{step} saved; run the same command to resume")
        self.step, self.signum = step, signum


class StopOnSignal(TrainerCallback):
    """At the step end after SIGINT/SIGTERM on any rank (launchers signal them apart), the Trainer saves and stops."""

    def __init__(self):
        self.signum: int | None = None  # the first signal received
        self._first_at = 0.0
        self.stopped_at: int | None = None  # the step whose checkpoint the stop saved
        self._previous: dict = {}
        self._group = None  # a CPU (gloo) process group: agreeing costs no GPU synchronisation

    def on_train_begin(self, args, state, control, **kwargs):
        self.signum = self.stopped_at = None
        kill_workers_at_exit()
        dist = torch.distributed
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            self._group = dist.new_group(backend="gloo")  # every rank calls on_train_begin: a collective call
        if threading.current_thread() is threading.main_thread():  # signal handlers can only be set there
            wanted = [s for s in SIGNALS if signal.getsignal(s) is not signal.SIG_IGN]  # nohup's stay ignored
            self._previous = {s: signal.signal(s, self._received) for s in wanted}

    def _received(self, signum, frame):
        if self.signum is None:
            self.signum, self._first_at = signum, time.monotonic()
            return
        if time.monotonic() - self._first_at < REPEAT_AFTER:
            return
        self._restore()  # a second signal: stop now, as without this handler
        raise KeyboardInterrupt if signum == signal.SIGINT else SystemExit(128 + signum)

    def on_step_end(self, args, state, control, **kwargs):
        signalled = int(self.signum or 0)
        if self._group is not None:  # the largest signal number any rank received
            flag = torch.tensor([signalled], dtype=torch.int32)
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX, group=self._group)
            signalled = int(flag.item())
        if signalled:
            self.signum = self.signum or signalled
            self.stopped_at = state.global_step
            control.should_save = control.should_training_stop = True

    def on_train_end(self, args, state, control, **kwargs):
        self._restore()

    def _restore(self):
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}


def worker_ignores_stop_signals(then, worker_id: int) -> None:
    """DataLoader workers leave SIGINT/SIGTERM to the main process (killed, they failed the step); then `then`."""
    for s in SIGNALS:
        signal.signal(s, signal.SIG_IGN)
    if then is not None:
        then(worker_id)


@functools.cache
def kill_workers_at_exit() -> None:
    """Once per process: at exit, SIGKILL live daemonic children (DataLoader workers ignore the exit's SIGTERM)."""
    import atexit
    import multiprocessing

    def kill() -> None:
        workers = [child for child in multiprocessing.active_children() if child.daemon]
        if workers:  # torch's SIGCHLD handler would report each as "killed by signal": expected here
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for child in workers:
            child.kill()
            child.join(timeout=5)

    atexit.register(kill)  # runs before multiprocessing's hook, registered at its import

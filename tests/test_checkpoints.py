"""Checkpoints belong to the run that wrote them, and a half-written one never blocks the next run."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import run_args, signal_at_step
from safetensors.torch import load_file

from vit_recipes.core.errors import RecipeError
from vit_recipes.plan.run_dir import CHECKPOINT_RECORD

pytestmark = pytest.mark.slow
SAVE_EVERY_2 = ("--save_strategy", "steps", "--save_steps", "2", "--save_total_limit", "5", "--do_eval", "false")


def args(data, model, out, *extra):
    return run_args(data, model, out, "--lr_scheduler_type", "constant", "--crop_scale_min", "0.5", *extra)


def test_every_checkpoint_records_the_run_that_wrote_it(cifar_like, tiny_vit, tmp_path, run_script):
    out = tmp_path / "run"
    run_script(*args(cifar_like, tiny_vit, out, "--max_steps", "4", *SAVE_EVERY_2))
    for step in (2, 4):
        record = json.loads((out / f"checkpoint-{step}" / CHECKPOINT_RECORD).read_text())
        assert record == json.loads((out / "run_config.json").read_text())
        assert record["seed"] == 42 and record["strategy"] == "ddp or single" and record["global_batch"] == 8


def test_overwrite_removes_the_old_runs_checkpoints_so_a_new_run_never_resumes_them(
    cifar_like, tiny_vit, tmp_path, run_script, capsys
):
    """The stale-checkpoint case: seed 42 left checkpoint-2/4; --overwrite_output_dir with seed 7 must not keep them
    for the same command to resume later."""
    out = tmp_path / "run"
    run_script(*args(cifar_like, tiny_vit, out, "--max_steps", "4", *SAVE_EVERY_2))
    (out / "notes.txt").write_text("the user's own file")
    (out / "checkpoint-9").mkdir()  # not a checkpoint this project wrote: left alone
    seven = ("--max_steps", "1", "--seed", "7", "--save_strategy", "no", "--do_eval", "false")
    run_script(*args(cifar_like, tiny_vit, out, *seven, "--overwrite_output_dir", "true"))
    assert not (out / "checkpoint-2").exists() and not (out / "checkpoint-4").exists()
    assert (out / "notes.txt").read_text() == "the user's own file" and (out / "checkpoint-9").is_dir()
    assert "--overwrite_output_dir: removed the previous run's" in capsys.readouterr().out  # the script's log
    state = json.loads((out / "trainer_state.json").read_text())
    assert state["global_step"] == 1  # trained from scratch, not from the seed-42 checkpoint-4


def test_a_checkpoint_of_another_run_is_refused_with_the_way_out(cifar_like, tiny_vit, tmp_path, run_script):
    out = tmp_path / "run"
    run_script(*args(cifar_like, tiny_vit, out, "--max_steps", "2", *SAVE_EVERY_2))
    record = out / "checkpoint-2" / CHECKPOINT_RECORD
    record.write_text(json.dumps({**json.loads(record.read_text()), "seed": 1}))  # as if another run wrote it
    (out / "all_results.json").unlink()
    with pytest.raises(RecipeError, match=r"checkpoint-2 was written by another run \(seed: 1 there, 42 now\): "
                       r"resume it anyway with --resume_from_checkpoint .*checkpoint-2, or start fresh"):  # fmt: skip
        run_script(*args(cifar_like, tiny_vit, out, "--max_steps", "4", *SAVE_EVERY_2))
    resumed = run_script(
        *args(
            cifar_like,
            tiny_vit,
            out,
            "--max_steps",
            "4",
            *SAVE_EVERY_2,
            "--resume_from_checkpoint",
            out / "checkpoint-2",
        )
    )
    assert resumed["train_loss"] > 0 and json.loads((out / "trainer_state.json").read_text())["global_step"] == 4


def test_half_written_checkpoints_are_skipped_and_the_run_ends_as_if_never_stopped(
    cifar_like, tiny_vit, tmp_path, run_script, capsys
):
    """kill -9 mid-save leaves a checkpoint folder without its record (here: checkpoint-4 cut short, checkpoint-6
    with config.json alone): the same command resumes from checkpoint-2 and ends with the uninterrupted weights."""
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    run_script(*args(cifar_like, tiny_vit, straight, "--max_steps", "6", *SAVE_EVERY_2))
    run_script(*args(cifar_like, tiny_vit, stopped, "--max_steps", "4", *SAVE_EVERY_2))
    (stopped / "checkpoint-4" / CHECKPOINT_RECORD).unlink()
    weights = stopped / "checkpoint-4" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])  # cut short: resuming from it would fail
    (stopped / "checkpoint-6").mkdir()
    shutil.copy(stopped / "config.json", stopped / "checkpoint-6" / "config.json")
    (stopped / "all_results.json").unlink()  # the run died before its end
    capsys.readouterr()
    run_script(*args(cifar_like, tiny_vit, stopped, "--max_steps", "6", *SAVE_EVERY_2))
    log = capsys.readouterr().out
    assert "Skipping checkpoint-6, checkpoint-4" in log
    a, b = load_file(straight / "model.safetensors"), load_file(stopped / "model.safetensors")
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-4, atol=1e-5, msg=key)


def test_resuming_an_incomplete_checkpoint_by_hand_is_one_line(cifar_like, tiny_vit, tmp_path, run_script):
    half = tmp_path / "checkpoint-5"
    half.mkdir()
    (half / "config.json").write_text("{}")
    with pytest.raises(RecipeError, match=r"checkpoint-5 is not a complete checkpoint \(no trainer_state.json\)"):
        run_script(*args(cifar_like, tiny_vit, tmp_path / "out", "--resume_from_checkpoint", half))


def test_a_checkpoint_with_unreadable_weights_is_one_line_naming_it(cifar_like, tiny_vit, tmp_path, run_script):
    out = tmp_path / "out"
    run_script(*args(cifar_like, tiny_vit, out, "--max_steps", "2", *SAVE_EVERY_2))
    weights = out / "checkpoint-2" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])  # complete when written, truncated since (a disk fault)
    with pytest.raises(RecipeError, match=r"cannot read the weights of .*checkpoint-2 \(.*\): delete that folder"):
        run_script(*args(cifar_like, tiny_vit, out, "--max_steps", "4", *SAVE_EVERY_2))


def test_a_full_disk_mid_save_is_one_line_and_the_same_command_then_ends_as_the_uninterrupted_run(
    cifar_like, tiny_vit, tmp_path, run_script, monkeypatch
):
    from vit_recipes.train.trainer import ImageClassificationTrainer

    straight, full = tmp_path / "straight", tmp_path / "full"
    run_script(*args(cifar_like, tiny_vit, straight, "--max_steps", "6", *SAVE_EVERY_2))
    save = ImageClassificationTrainer._save

    def disk_fills_at_step_4(self, output_dir=None, state_dict=None):
        if self.state.global_step == 4:
            Path(output_dir).mkdir(parents=True, exist_ok=True)
            (Path(output_dir) / "config.json").write_text("{")  # a first file, cut short
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 4160 vs 4058")  # torch.save
        return save(self, output_dir, state_dict)

    monkeypatch.setattr(ImageClassificationTrainer, "_save", disk_fills_at_step_4)
    with pytest.raises(
        RecipeError, match=r"writing .*checkpoint-4 failed \(no space left on the device; [\d.]+ GiB free"
    ):
        run_script(*args(cifar_like, tiny_vit, full, "--max_steps", "6", *SAVE_EVERY_2))
    monkeypatch.undo()  # space freed: the same command resumes from checkpoint-2, skipping the broken checkpoint-4
    run_script(*args(cifar_like, tiny_vit, full, "--max_steps", "6", *SAVE_EVERY_2))
    a, b = load_file(straight / "model.safetensors"), load_file(full / "model.safetensors")
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-4, atol=1e-5, msg=key)


def test_an_output_dir_that_cannot_be_written_is_refused_before_any_data_is_read(tiny_vit, tmp_path, run_script):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    with pytest.raises(RecipeError, match=r"output_dir .*a_file/out is not writable \(Not a directory\)"):
        run_script(*args("./no/such/data", tiny_vit, blocker / "out"))  # the data path is never read


def test_an_output_dir_without_room_for_a_checkpoint_is_refused(tiny_vit, tmp_path, run_script, monkeypatch):
    import collections

    from vit_recipes.plan import checks

    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(checks.shutil, "disk_usage", lambda path: usage(10**9, 10**9 - 1024, 1024))
    with pytest.raises(RecipeError, match=r"has 0.0 GiB free and a checkpoint of this model needs about .* GiB"):
        run_script(*args("./no/such/data", tiny_vit, tmp_path / "out", "--save_strategy", "steps"))
    with pytest.raises(RecipeError, match=r"and the final model of this model needs about"):
        run_script(*args("./no/such/data", tiny_vit, tmp_path / "out"))  # save_strategy no: the final model alone


def test_buffers_killed_ranks_left_in_dev_shm_are_removed_at_the_next_start(tmp_path):
    """A rank killed with -9 cannot remove its 69 MB DeepSpeed buffer; the next run's start does, unless a live
    process maps it or it is new (another job may be about to map it)."""
    import mmap
    import os
    import time

    from vit_recipes.core.launch import SHM_BUFFER_PREFIX, remove_stale_shm_buffers

    name = f"{SHM_BUFFER_PREFIX}test_{os.getpid()}"
    stale, mapped, new = f"{name}_stale", f"{name}_mapped", f"{name}_new"
    for path in (stale, mapped, new):
        with open(path, "wb") as f:
            f.write(b"\0" * 4096)
    old = time.time() - 3600
    for path in (stale, mapped):
        os.utime(path, (old, old))
    with open(mapped, "r+b") as f, mmap.mmap(f.fileno(), 4096):
        try:
            removed = remove_stale_shm_buffers()
            assert stale in removed and not os.path.exists(stale)
            assert os.path.exists(mapped) and os.path.exists(new)
        finally:
            for path in (stale, mapped, new):
                if os.path.exists(path):
                    os.unlink(path)


# ------------------------------------------------------------------------------------------ fault injection

FAULTS = [  # (where tests/fault_worker.py kills the run with -9, at which global step)
    ("mid_step", 3),
    ("checkpoint_model", 4),
    ("checkpoint_optimizer", 4),
    ("checkpoint_state", 4),
    ("final_save", 6),
    ("final_outputs", 6),
]


@pytest.fixture(scope="module")
def uninterrupted(cifar_like, tiny_vit, tmp_path_factory):
    """The 6-step run the killed-and-rerun ones must end as."""
    import run_image_classification

    out = tmp_path_factory.mktemp("uninterrupted") / "run"
    results = run_image_classification.main(
        [str(a) for a in args(cifar_like, tiny_vit, out, "--max_steps", "6", *SAVE_EVERY_2)]
    )
    return out, results


@pytest.mark.parametrize("point, step", FAULTS, ids=[p for p, _ in FAULTS])
def test_killed_anywhere_the_same_command_ends_as_the_uninterrupted_run(
    point, step, uninterrupted, cifar_like, tiny_vit, tmp_path, run_script
):
    import multiprocessing

    import fault_worker

    out = tmp_path / "run"
    command = [str(a) for a in args(cifar_like, tiny_vit, out, "--max_steps", "6", *SAVE_EVERY_2)]
    # A fresh process per fault, forked from one that imported the script's modules once (they took most of each
    # run's time): the killed run's process is new, its patches die with it.
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["fault_worker", "run_image_classification"])
    # The same CPU threads as the in-process runs it is compared with: float sums depend on the split.
    killed = context.Process(target=fault_worker.run, args=(point, step, command, torch.get_num_threads()))
    killed.start()
    killed.join(timeout=300)
    assert killed.exitcode == -9, killed.exitcode  # its output: the test's captured stdout and stderr
    assert not (out / "all_results.json").exists()
    results = run_script(*command)  # the same command again
    reference, expected = uninterrupted
    a, b = load_file(reference / "model.safetensors"), load_file(out / "model.safetensors")
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key  # on the CPU: exactly the same weights
    assert json.loads((out / "trainer_state.json").read_text())["global_step"] == 6
    assert results["train_loss"] == pytest.approx(expected["train_loss"], rel=1e-6)  # the whole run's mean


def test_a_second_run_into_a_folder_in_use_is_refused_and_a_killed_run_leaves_no_lock(tmp_path):
    """Two runs started at once into one folder both exited 0, and one's work was lost without a word. (A second
    run of the script while a first one trains: the SIGTERM test above.)"""
    import subprocess
    import sys

    from vit_recipes.plan.run_dir import _HELD_LOCKS, lock_output_dir

    hold = (
        "import fcntl, sys, time; f = open(sys.argv[1], 'a+'); fcntl.flock(f, fcntl.LOCK_EX); "
        "f.write('pid 1 on node-7, since 09:00'); f.flush(); print('held', flush=True); time.sleep(120)"
    )
    other = subprocess.Popen(
        [sys.executable, "-c", hold, str(tmp_path / ".run.lock")], stdout=subprocess.PIPE, text=True
    )
    try:
        assert other.stdout.readline().strip() == "held"
        with pytest.raises(
            RecipeError, match=r"is in use by another run \(pid 1 on node-7, since 09:00\): wait for it"
        ):
            lock_output_dir(tmp_path)
    finally:
        other.kill()  # SIGKILL: the OS drops its lock
        other.wait()
    lock_output_dir(tmp_path)
    assert "pid " in (tmp_path / ".run.lock").read_text()
    lock_output_dir(tmp_path)  # again from this process (main() run twice in one process): its own lock
    _HELD_LOCKS.pop(str(tmp_path.resolve())).close()


def test_a_finished_run_with_its_final_checkpoint_is_refused_not_rewritten(cifar_like, tiny_vit, tmp_path, run_script):
    """It resumed its last checkpoint, trained nothing and rewrote the card and all_results.json without the training
    time and throughput. Killed before its card (written last), the same command still finishes it."""
    out = tmp_path / "run"
    args = run_args(cifar_like, tiny_vit, out, "--max_steps", "2", "--save_strategy", "steps", "--save_steps", "2")
    run_script(*args)
    assert (out / "checkpoint-2").is_dir()
    results = (out / "all_results.json").read_text()
    with pytest.raises(RecipeError, match="holds a finished run of this recipe; pass --overwrite_output_dir"):
        run_script(*args)
    assert (out / "all_results.json").read_text() == results
    (out / "README.md").unlink()
    run_script(*args)
    assert (out / "README.md").is_file()
    # A larger --max_steps asks for more: it continues the finished run from its last checkpoint
    run_script(
        *run_args(cifar_like, tiny_vit, out, "--max_steps", "4", "--save_strategy", "steps", "--save_steps", "2")
    )
    assert json.loads((out / "trainer_state.json").read_text())["global_step"] == 4


def test_resuming_another_models_checkpoint_says_what_differs_and_the_fix(cifar_like, tiny_vit, tmp_path, run_script):
    """The line used to say to delete that (valid) checkpoint, as if it were corrupt; then it quoted transformers'
    "look at the above report" (a load report logged above it), said nothing of what differs, and suggested another
    --output_dir where the fix was the --resume_from_checkpoint value."""
    from conftest import tiny_vit_config
    from transformers import ViTForImageClassification

    wider = tmp_path / "wider"
    ViTForImageClassification(tiny_vit_config(hidden_size=48)).save_pretrained(wider)
    out = tmp_path / "out"
    run_script(*args(cifar_like, tiny_vit, out, "--max_steps", "2", *SAVE_EVERY_2))
    checkpoint = out / "checkpoint-2"
    resume = ("--resume_from_checkpoint", checkpoint)
    flag_fix = "pass --resume_from_checkpoint a checkpoint of this model, or drop the flag to start fresh"
    cases = [  # (the run, the line): the flag names another model's checkpoint; or the same folder finds one
        (args(cifar_like, tiny_vit, tmp_path / "coarse", "--max_steps", "4", *SAVE_EVERY_2, *resume,
              "--label_column_name", "coarse_label"), f"(100 classes there, 20 here): {flag_fix}"),
        (args(cifar_like, wider, tmp_path / "wide", "--max_steps", "4", *SAVE_EVERY_2, *resume),
         f"(vit.embeddings.cls_token [1, 1, 32] there, [1, 1, 48] here): {flag_fix}"),
        (args(cifar_like, tiny_vit, out, "--max_steps", "4", *SAVE_EVERY_2, "--label_column_name", "coarse_label"),
         "(100 classes there, 20 here): choose another --output_dir, or pass --overwrite_output_dir to start over"),
    ]  # fmt: skip
    import logging

    reports = []  # what transformers logs (it does not propagate to pytest's capture): its load report
    handler = logging.Handler()
    handler.emit = lambda record: reports.append(record.getMessage())
    logging.getLogger("transformers").addHandler(handler)
    try:
        for argv, line in cases:
            with pytest.raises(RecipeError) as caught:
                run_script(*argv)
            assert str(caught.value) == f"{checkpoint} is a checkpoint of another model {line}"
    finally:
        logging.getLogger("transformers").removeHandler(handler)
    assert not [r for r in reports if "LOAD REPORT" in r]  # the report transformers' own line pointed at


def test_sigterm_at_a_random_step_saves_a_checkpoint_and_the_same_command_ends_as_the_uninterrupted_run(
    cifar_like, tiny_vit, tmp_path, run_script
):
    """SIGTERM (what SLURM and cloud preemption send) to every process mid-training: the run saves checkpoint-N at the
    next step end, says so in one line and exits 143; the same command resumes from it to the uninterrupted run's
    weights. It was a 97-line traceback (SIGINT) or an exit without a word (SIGTERM); with the handler alone, the
    DataLoader worker died of the signal and took the run down mid-step. While it trains, the same command again
    is refused by the output folder's lock (the script's path to the lock; the test below holds it by hand)."""
    import os
    import random
    import re
    import signal
    import sys

    from conftest import ROOT, TRAIN_SEED

    steps = 150
    # A DataLoader worker too: the signal reaches every process of the group, as from scancel or a terminal. No random
    # crop or flip: on the CPU they draw from the generator each new worker iterator also draws its seed from.
    flags = ("--max_steps", str(steps), "--save_strategy", "no", "--do_eval", "false", "--dataloader_num_workers", "1",
             "--crop_scale_min", "1", "--hflip_prob", "0")  # fmt: skip
    run_script(*args(cifar_like, tiny_vit, tmp_path / "whole", *flags))
    out = tmp_path / "stopped"
    command = [sys.executable, str(ROOT / "run_image_classification.py"), *map(str, args(cifar_like, tiny_vit, out,
                                                                                       *flags))]  # fmt: skip
    # A step drawn from the test seed, and said: `VIT_TEST_SEED=N pytest -k sigterm` signals at the same step again
    at = random.Random(int(TRAIN_SEED)).randint(5, 100)
    print(f"SIGTERM at step {at} (VIT_TEST_SEED={TRAIN_SEED})")
    refusals = []

    def second_run():  # the same command while the first trains: refused by its output folder's lock, in one line
        with pytest.raises(RecipeError) as refused:
            run_script(*args(cifar_like, tiny_vit, out, *flags))
        refusals.append(str(refused.value))

    # this process's environment: the same thread count as the in-process runs, so the same float sums
    status, stderr = signal_at_step(command, at, steps, signal.SIGTERM, group=True, meanwhile=second_run, cwd=ROOT,
                                    env=os.environ)  # fmt: skip
    assert re.fullmatch(rf"output_dir {re.escape(str(out))} is in use by another run \(pid \d+ on .+, since .+\): "
                        r"wait for it to end, or choose another --output_dir", refusals[0]), refusals  # fmt: skip
    assert status == 128 + signal.SIGTERM and "Traceback" not in stderr, f"signalled at step {at}: {stderr[-3000:]}"
    last = stderr.replace("\r", "\n").strip().splitlines()[-1]
    step = int(last.split()[3].rstrip(";"))
    print(f"stopped at step {step}")
    assert last == f"interrupted at step {step}; checkpoint-{step} saved; run the same command to resume", last
    assert at <= step < steps and (out / f"checkpoint-{step}" / CHECKPOINT_RECORD).is_file(), (at, step)
    assert not (out / "all_results.json").exists() and not (out / "model.safetensors").exists()
    run_script(*args(cifar_like, tiny_vit, out, *flags))  # the same command
    a, b = load_file(out / "model.safetensors"), load_file(tmp_path / "whole" / "model.safetensors")
    assert max(float((a[k] - b[k]).abs().max()) for k in a) == 0.0, f"stopped at step {step}"


def test_a_signal_stops_at_the_next_step_end_a_forwarded_copy_is_ignored_and_a_later_one_stops_at_once(monkeypatch):
    import os
    import signal
    import types

    from transformers import TrainerControl

    from vit_recipes.core import interrupt

    clock = [100.0]
    monkeypatch.setattr(interrupt.time, "monotonic", lambda: clock[0])
    before = signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal (CI may start it ignored)
    stop, control, state = interrupt.StopOnSignal(), TrainerControl(), types.SimpleNamespace(global_step=7)
    stop.on_train_begin(None, state, control)
    try:
        os.kill(os.getpid(), signal.SIGTERM)  # handled: training goes on to the step end
        clock[0] += 0.5
        os.kill(os.getpid(), signal.SIGINT)  # half a second later: a launcher forwarding the stop, ignored
        stop.on_step_end(None, state, control)
        assert control.should_save and control.should_training_stop and stop.stopped_at == 7
        assert stop.signum == signal.SIGTERM
        clock[0] += interrupt.REPEAT_AFTER
        with pytest.raises(KeyboardInterrupt):  # a user who will not wait for the save
            os.kill(os.getpid(), signal.SIGINT)
        assert signal.getsignal(signal.SIGTERM) is not stop._received  # handlers restored on the way out
    finally:
        stop.on_train_end(None, state, control)
        restored = signal.getsignal(signal.SIGINT)
        signal.signal(signal.SIGINT, before)
    assert restored is signal.default_int_handler


def test_a_signal_the_process_ignores_stays_ignored():
    """nohup, or a shell's background job: SIGINT ignored on purpose is not turned into a stop."""
    import signal
    import types

    from transformers import TrainerControl

    from vit_recipes.core import interrupt

    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    stop = interrupt.StopOnSignal()
    try:
        stop.on_train_begin(None, types.SimpleNamespace(global_step=0), TrainerControl())
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
        assert signal.getsignal(signal.SIGTERM) == stop._received
    finally:
        stop.on_train_end(None, None, None)
        signal.signal(signal.SIGINT, before)

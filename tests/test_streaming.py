"""--streaming (src/vit_recipes/data/streaming.py): each rank reads its own shards of a stream that repeats, its position
saved in checkpoints; 2 processes over gloo train an epoch of unequal shards without a hang and resume exactly. A
Trainer with the stream mixin runs in-process on a tiny model: resumes, worker counts and broken shards."""

import io
import json
import logging
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import datasets
import numpy as np
import pytest
import torch
from conftest import ROOT, pattern_images, save_tiny_vit
from PIL import Image as PILImage
from safetensors.torch import load_file

from vit_recipes.core.errors import RecipeError
from vit_recipes.data.streaming import STATE_FILE, RankStream, StreamedBatches, StreamError, load_stream_splits

CLASSES = 4
SHARDS = (40, 8, 24, 8)  # unequal: 2 ranks read 48 and 32 images a pass (or 64 and 16)


def jpeg(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    PILImage.fromarray(array).save(buffer, format="JPEG", quality=90)
    return buffer.getvalue()


@pytest.fixture(autouse=True)
def _no_pause_at_the_end_of_parquet_shards(monkeypatch):
    """datasets waits 5 s each time a stream of parquet shards ends (an Arrow threading workaround): in-process
    tests here end many short streams."""
    monkeypatch.setattr(datasets.config, "SLEEP_TIME_ON_THREADS_SHUTDOWN", 0)


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    """Hub-shaped parquet shards: data/train-0000i-of-00004.parquet of unequal sizes (the first of 5 row groups), and
    a validation shard."""
    root = tmp_path_factory.mktemp("shards")
    (root / "data").mkdir()
    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(num_classes=CLASSES)})
    start = 0
    for split, sizes in (("train", SHARDS), ("validation", (16,))):
        for i, n in enumerate(sizes):
            labels = np.arange(start, start + n) % CLASSES
            images = pattern_images(labels, 24, seed=start)
            rows = {"image": [{"bytes": jpeg(a), "path": None} for a in images], "label": labels.tolist()}
            part = datasets.Dataset.from_dict(rows, features=features).add_column("n", list(range(start, start + n)))
            # The first train shard in row groups of 8, as Hub files come: --streaming splits it into 5 shards.
            rows_per_group = 8 if (split, i) == ("train", 0) else None
            part.to_parquet(
                str(root / "data" / f"{split}-{i:05d}-of-{len(sizes):05d}.parquet"), batch_size=rows_per_group
            )
            start += n
    return root


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stream_of(shards: Path, rank=0, world=1, buffer=0) -> RankStream:
    files = sorted(str(p) for p in (shards / "data").glob("train-*.parquet"))
    stream = datasets.load_dataset("parquet", data_files={"train": files}, split="train", streaming=True)
    return RankStream(stream.select_columns(["n"]), rank, world, seed=0, buffer=buffer)  # "n": each row's number


def test_a_rank_stream_repeats_reshuffled_and_resumes_where_it_stopped(shards):
    whole = stream_of(shards)
    rows = iter(whole)
    straight = [next(rows)["n"] for _ in range(sum(SHARDS) * 2 + 30)]
    first_pass, second_pass = straight[: sum(SHARDS)], straight[sum(SHARDS) : 2 * sum(SHARDS)]
    assert sorted(first_pass) == sorted(second_pass) and first_pass != second_pass  # reshuffled each pass
    stopped = stream_of(shards)
    rows = iter(stopped)
    seen = [next(rows)["n"] for _ in range(sum(SHARDS) + 30)]  # into the second pass
    state = stopped.state_dict()
    resumed = stream_of(shards)
    resumed.load_state_dict(state)
    rows = iter(resumed)
    assert seen + [next(rows)["n"] for _ in range(sum(SHARDS))] == straight


def test_a_rank_whose_part_is_empty_ends_its_stream_instead_of_repeating_nothing():
    """One image over 2 ranks: rank 1's part holds no row. Its iteration ends, as the DataLoader expects of a worker
    without data, where repeating would loop forever without yielding a row."""
    one = datasets.Dataset.from_dict({"n": [0]}).to_iterable_dataset()
    stream = RankStream(one, rank=1, world_size=2, seed=0, buffer=0)
    passes, shuffle = [], stream.part.shuffle

    def counted(**kwargs):
        passes.append(kwargs["seed"])
        assert len(passes) < 3, "the empty part is read again and again"
        return shuffle(**kwargs)

    stream.part.shuffle = counted
    assert list(stream) == [] and passes == [0]


@pytest.mark.parametrize("workers", [2, 5])  # 5: workers beyond rank 0's 2 shards share them by rows
def test_two_ranks_read_disjoint_parts_and_a_stateful_loader_resumes_exactly(shards, workers):
    from torchdata.stateful_dataloader import StatefulDataLoader

    parts = [stream_of(shards, rank, 2) for rank in (0, 1)]
    firsts = [[row["n"] for _, row in zip(range(n), p)] for p, n in zip(parts, (10, 10))]
    assert all(len(f) == 10 for f in firsts)
    sizes = [sum(1 for _ in p.part) for p in parts]
    assert sum(sizes) == sum(SHARDS) and sizes[0] != sizes[1]  # unequal parts: the repetition keeps both going

    def collate(rows):  # each batch's rows and the worker that read them
        return [r["n"] for r in rows], torch.utils.data.get_worker_info().id

    def loader(stream):
        return StatefulDataLoader(stream, batch_size=4, num_workers=workers, collate_fn=collate)

    straight = loader(stream_of(shards, 0, 2))
    batches = iter(straight)
    expected = [next(batches) for _ in range(30)]  # several passes over rank 0's part
    assert [worker for _, worker in expected[:workers]] == list(range(workers))  # every worker reads
    first = sum((rows for rows, _ in expected[:workers]), [])
    assert len(set(first)) == len(first)
    interrupted = loader(stream_of(shards, 0, 2))
    batches = iter(interrupted)
    done = [next(batches) for _ in range(13)]
    state = interrupted.state_dict()
    del batches
    resumed = loader(stream_of(shards, 0, 2))
    resumed.load_state_dict(state)
    batches = iter(resumed)
    assert done + [next(batches) for _ in range(17)] == expected


def test_streaming_refuses_what_a_stream_cannot_do(tmp_path):
    from vit_recipes.core.arguments import parse_args

    base = ["--dataset_name", "x", "--output_dir", str(tmp_path), "--streaming", "true", "--use_cpu", "true"]
    for extra, said in ((["--max_train_samples", "5"], "--max_train_samples"),
                        (["--class_weights", "balanced"], "--class_weights balanced"),
                        (["--decode_images", "once"], "--decode_images once")):  # fmt: skip
        with pytest.raises(RecipeError, match=f"^--streaming cannot be combined with {said}"):
            parse_args([*base, *extra])


def test_two_processes_stream_unequal_shards_without_a_hang_and_resume_to_the_same_weights(shards, tmp_path):
    """DDP over gloo, 2 ranks: 12 steps straight, saving at steps 6 and 12; its step-6 checkpoint, alone in another
    folder, then the same command to 12 there (it resumes from it and its saved stream positions: as a run stopped
    at step 6 would). No shuffle buffer: the resumed run must see the same images, so its weights equal the straight
    run's. 5 workers over each rank's 4 shards: two of them share one by rows."""
    model = save_tiny_vit(tmp_path / "model", num_labels=CLASSES)

    def command(out: Path, steps: int) -> list[str]:
        return [
            sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
            str(ROOT / "run_image_classification.py"), "--dataset_name", str(shards), "--model_name_or_path",
            str(model), "--output_dir", str(out), "--do_train", "true", "--streaming", "true", "--shuffle_buffer_size", "0",
            "--max_steps", str(steps), "--save_strategy", "steps", "--save_steps", "6", "--eval_strategy", "no",
            "--per_device_train_batch_size", "4", "--learning_rate", "3e-3", "--lr_scheduler_type", "constant",
            "--crop_scale_min", "1", "--hflip_prob", "0", "--use_cpu", "true", "--report_to", "none",
            "--plots", "false", "--logging_steps", "1", "--seed", "7", "--dataloader_num_workers", "5",
        ]  # fmt: skip

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    # one run fewer than a separate 6-step run: the straight run's checkpoint-6 is what that run would have left
    done = subprocess.run(command(straight, 12), cwd=ROOT, env=env, capture_output=True, text=True, timeout=420)
    assert done.returncode == 0, (done.stdout + done.stderr)[-5000:]
    assert sorted(p.name for p in (straight / "checkpoint-6").glob("stream_state_rank*.pt")) == [
        "stream_state_rank0.pt",
        "stream_state_rank1.pt",
    ]
    stopped.mkdir()
    shutil.copytree(straight / "checkpoint-6", stopped / "checkpoint-6")
    shutil.copy(straight / "run_config.json", stopped / "run_config.json")
    resumed = subprocess.run(command(stopped, 12), cwd=ROOT, env=env, capture_output=True, text=True, timeout=420)
    assert resumed.returncode == 0, (resumed.stdout + resumed.stderr)[-5000:]
    assert "Resum" in resumed.stdout + resumed.stderr
    state = json.loads((stopped / "trainer_state.json").read_text())
    assert state["global_step"] == 12
    a, b = (load_file(str(folder / "model.safetensors")) for folder in (straight, stopped))
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=0, msg=name)


# ------------------------------------------------------------------------ in-process: a Trainer over a stream


def data_args(source, **kw):
    from vit_recipes.core.arguments import DataArguments

    return DataArguments(dataset_name=str(source), streaming=True, shuffle_buffer_size=0, **kw)


def stream_splits(source, **kw):
    training = SimpleNamespace(process_index=0, world_size=1, seed=0, do_eval=True)
    return load_stream_splits(data_args(source, **kw), training)


class Pooled(torch.nn.Module):
    """A classifier of the images' mean colour: a model small enough for the Trainer's loop to cost nothing."""

    def __init__(self):
        super().__init__()
        self.head = torch.nn.Linear(3, CLASSES)

    def forward(self, pixel_values, labels):
        logits = self.head(pixel_values.float().mean((2, 3)) / 255)
        return {"loss": torch.nn.functional.cross_entropy(logits, labels), "logits": logits}


def stream_trainer(stream, out: Path, steps: int, seen: list, workers: int = 0):
    """A transformers Trainer with the project's stream mixin, decoding per batch with the run's collator; `seen`
    gets each batch's pixel sum, in order."""
    import transformers

    from vit_recipes.data.decoding import DecodingCollator

    class Collate(DecodingCollator):
        def __call__(self, rows):
            batch = super().__call__(rows)
            seen.append(int(batch["pixel_values"].sum()))
            return batch

    collate = Collate((24, 24), None, "image")

    class StreamTrainer(StreamedBatches, transformers.Trainer):
        pass

    args = transformers.TrainingArguments(
        output_dir=str(out), max_steps=steps, per_device_train_batch_size=4, save_strategy="steps", save_steps=2,
        use_cpu=True, report_to="none", dataloader_num_workers=workers, disable_tqdm=True, seed=0, logging_steps=100,
    )  # fmt: skip
    torch.manual_seed(0)
    return StreamTrainer(model=Pooled(), args=args, train_dataset=stream, data_collator=collate)


def test_a_resumed_stream_decodes_only_the_images_of_its_own_steps(shards, tmp_path, monkeypatch):
    """4 steps straight, then from the step-2 checkpoint to 4: the resumed run sees the straight run's last 2
    batches, and opens 8 images, not the 16 a resume that read past (or the Trainer's skip) would decode."""
    from PIL import Image

    straight = []
    stream_trainer(stream_splits(shards).train, tmp_path, 4, straight).train()
    opened = []
    real_open = Image.open
    monkeypatch.setattr(Image, "open", lambda *a, **kw: opened.append(1) or real_open(*a, **kw))
    resumed = []
    stream_trainer(stream_splits(shards).train, tmp_path, 4, resumed).train(tmp_path / "checkpoint-2")
    assert len(opened) == 2 * 4
    assert resumed == straight[2:]


def test_a_stream_resumed_on_another_process_count_starts_over_and_says_so(shards, tmp_path, caplog):
    straight = []
    stream_trainer(stream_splits(shards).train, tmp_path, 4, straight).train()
    state_file = tmp_path / "checkpoint-2" / STATE_FILE.format(rank=0)
    state = torch.load(state_file, weights_only=False)
    torch.save({**state, "world_size": 2}, state_file)  # written by a run of 2 processes
    resumed = []
    with caplog.at_level(logging.WARNING, "vit_recipes.data.streaming"):
        stream_trainer(stream_splits(shards).train, tmp_path, 4, resumed).train(tmp_path / "checkpoint-2")
    assert resumed == straight[:2]  # from the stream's start, not from the other run's saved positions
    assert "holds no stream position for 1 process(es): the stream starts over" in caplog.text


@pytest.mark.parametrize("total, ranks, workers", [(1, 1, 4), (4, 2, 5), (3, 2, 4)])  # by shards; by rows (3 % 2)
def test_workers_beyond_a_ranks_shards_share_them_and_read_each_image_once(total, ranks, workers):
    """Where a rank has fewer shards than workers, the workers of a shard split its rows: over every rank and worker,
    each image is read once."""
    split = datasets.Dataset.from_dict({"n": list(range(60))}).to_iterable_dataset(num_shards=total)
    seen = []
    for rank in range(ranks):
        stream = RankStream(split, rank, ranks, seed=0, buffer=0)
        assert stream.part.num_shards < workers
        for worker in range(workers):
            part = [batch["n"] for batch in stream.worker_part(worker, workers).iter(batch_size=7)]
            assert part, f"rank {rank} worker {worker} reads nothing"
            seen += sum(part, [])
    assert sorted(seen) == list(range(60))


def test_one_webdataset_tar_is_read_by_every_worker_asked_for(tmp_path):
    """A WebDataset .tar is one shard (datasets cannot split it): its 3 workers share its rows, each image once."""
    import tarfile

    from torchdata.stateful_dataloader import StatefulDataLoader

    for split, n in (("train", 40), ("validation", 8)):
        with tarfile.open(tmp_path / f"{split}.tar", "w") as tar:
            for i in range(n):
                for ext, data in (("jpg", jpeg(np.full((8, 8, 3), i, np.uint8))), ("cls", str(i % CLASSES).encode())):
                    info = tarfile.TarInfo(f"{i:05d}.{ext}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
    train = stream_splits(tmp_path, image_column_name="jpg", label_column_name="cls").train
    assert train.num_shards == 1

    def collate(rows):
        return [r["jpg"]["bytes"] for r in rows], torch.utils.data.get_worker_info().id

    batches = iter(StatefulDataLoader(train, batch_size=4, num_workers=3, collate_fn=collate))
    read = [next(batches) for _ in range(9)]  # 3 of each worker's: less than its share of the 40
    assert [worker for _, worker in read] == [0, 1, 2] * 3
    images = sum((rows for rows, _ in read), [])
    assert len(set(images)) == len(images) == 36


def test_a_workers_share_of_a_shard_is_taken_in_arrow_before_any_row_becomes_python(shards):
    """The labels are encoded in Arrow, so a sharing worker's stream stays Arrow up to its row selection: the rows
    it leaves to the other workers are never converted (a Python step would convert the whole shard in each)."""
    part = stream_splits(shards).train.worker_part(1, 16)
    assert part._ex_iterable.iter_arrow is not None  # datasets' StepExamplesIterable then takes rows in Arrow
    rows = [row for batch in part.iter(batch_size=4) for row in zip(*batch.values())]
    assert rows and all(isinstance(label, int) for _, label in rows)


def test_a_rank_runs_the_workers_asked_for_where_its_shards_are_fewer(shards, tmp_path, capsys):
    """Rank 0 of 2 reads 2 of the 4 files: the 4 workers asked for all decode, 2 on each file; one line says so."""
    loader = stream_trainer(stream_of(shards, rank=0, world=2), tmp_path, 4, [], workers=4).get_train_dataloader()
    assert loader.num_workers == 4
    assert (
        "--streaming: 4 image decoder(s) per rank: 4 DataLoader worker(s) (--dataloader_num_workers) over the 2 "
        "shard(s) of rank 0, up to 2 workers share a shard, each decoding its share of the shard's rows"
        in capsys.readouterr().out
    )


def test_a_file_of_row_groups_streams_as_one_shard_per_row_group(shards, tmp_path):
    """The first train file holds 5 row groups: --streaming reads it as 5 shards (8 in all), for the ranks and their
    DataLoader workers to share (a Hub file of one row group per ~100 images would be one shard without it)."""
    splits = stream_splits(shards)
    assert splits.train.num_shards == 5 + 3
    one_file = tmp_path / "one"
    one_file.mkdir()
    shutil.copy(shards / "data" / "train-00000-of-00004.parquet", one_file / "train.parquet")
    shutil.copy(shards / "data" / "validation-00000-of-00001.parquet", one_file / "validation.parquet")
    trainer = stream_trainer(stream_splits(one_file).train, tmp_path, 4, [], workers=4)
    assert trainer.train_dataset.num_shards == 5 and trainer.get_train_dataloader().num_workers == 4  # own shards
    two = [load_stream_splits(data_args(shards), SimpleNamespace(process_index=r, world_size=2, seed=0, do_eval=True))
           for r in (0, 1)]  # fmt: skip
    seen = [[row["image"]["bytes"] for row in split.train.part] for split in two]
    assert len(seen[0]) + len(seen[1]) == sum(SHARDS) and not set(seen[0]) & set(seen[1])  # disjoint, whole


def test_workers_holding_over_half_the_memory_in_row_groups_are_one_warning(shards, tmp_path, monkeypatch, caplog):
    """Each worker holds the row group it reads: where all of them would hold over half this machine's memory (a
    file of one large row group, read whole by every worker sharing it), one line says so and what to do."""
    from vit_recipes.data import streaming

    stream = stream_splits(shards).train
    biggest, file = stream.largest_row_group
    assert file.endswith("train-00002-of-00004.parquet")  # 24 images in one row group: the largest
    monkeypatch.setattr(streaming.psutil, "virtual_memory", lambda: SimpleNamespace(total=16 * biggest))
    with caplog.at_level(logging.WARNING, "vit_recipes.data.streaming"):
        stream_trainer(stream, tmp_path, 4, [], workers=2).get_train_dataloader()  # 6 x biggest: under half of 16
        assert not caplog.text
        stream_trainer(stream, tmp_path, 4, [], workers=4).get_train_dataloader()  # 12 x biggest: over
    assert "--streaming: 4 DataLoader worker(s) each hold a row group of up to" in caplog.text
    assert "write the parquet files in smaller row groups" in caplog.text


def test_a_streams_batches_reach_the_device_without_blocking_the_host(shards, tmp_path, monkeypatch):
    """The stream's loader is ours, not accelerate's: its batches are copied as accelerate copies the folder path's
    (non_blocking), not by the Trainer's blocking .to(), which would wait for the GPU once per step."""
    trainer = stream_trainer(stream_of(shards), tmp_path, 1, [])
    trainer.get_train_dataloader()
    trainer.args.accelerator_config.non_blocking = True  # the recipe's default (arguments.py) on a GPU
    copies, to = [], torch.Tensor.to
    monkeypatch.setattr(
        torch.Tensor, "to", lambda t, *a, **kw: copies.append(kw.get("non_blocking")) or to(t, *a, **kw)
    )
    trainer._prepare_inputs({"pixel_values": torch.zeros(2, 3, 4, 4, dtype=torch.uint8), "labels": torch.zeros(2)})
    assert copies == [True, None]  # the uint8 pixels without blocking; a float tensor as the Trainer moves it


def test_a_stream_resumed_with_other_dataloader_workers_starts_over_and_says_so(shards, tmp_path, caplog):
    """Which worker reads which shards depends on the worker count: positions saved by another count would name
    other images. The resumed run starts the stream over, as on another process count, and says why."""
    stream_trainer(stream_splits(shards).train, tmp_path, 2, [], workers=1).train()
    resumed, straight = [], []
    with caplog.at_level(logging.WARNING, "vit_recipes.data.streaming"):
        stream_trainer(stream_splits(shards).train, tmp_path, 4, resumed).train(tmp_path / "checkpoint-2")
    stream_trainer(stream_splits(shards).train, tmp_path / "straight", 2, straight).train()
    assert resumed == straight  # steps 3-4 read the stream's first batches
    assert (
        "the checkpoint's stream positions are for {'shards': 8, 'workers': 1}, this run reads {'shards': 8, "
        "'workers': 0}: the stream starts over" in caplog.text
    )


def copy_of(shards: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(shards, tmp_path / "copy"))


@pytest.mark.parametrize("shard", [0, 1])  # the first: datasets reads its columns while loading; another: up front
def test_a_truncated_shard_is_one_line_naming_it_before_any_work(shards, tmp_path, shard):
    folder = copy_of(shards, tmp_path)
    broken = folder / "data" / f"train-{shard:05d}-of-00004.parquet"
    broken.write_bytes(broken.read_bytes()[:-300])  # an interrupted copy: no footer
    said = rf"^--streaming: shard {re.escape(str(broken))} cannot be read \(Parquet magic bytes .*\): it is cut short"
    with pytest.raises(
        RecipeError, match=said + " or damaged; copy or export it again, or move it out of the dataset"
    ):
        stream_splits(folder)


@pytest.mark.parametrize(
    "change, said",
    [
        (lambda d: d.remove_columns("label"), r"has no 'label' column \(its columns: image, n\): every shard needs the "
         r"image and label columns \('image', 'label'\); fix or remove it"),
        (lambda d: d.add_column("x", [0] * len(d)), r"has the columns image, label, n, x, the first shard image, label, n:"
         " datasets streams shards of one set of columns"),
    ],
    ids=["no-label", "other-column"],
)  # fmt: skip
def test_a_shard_without_the_label_column_or_with_others_is_one_line_naming_it(shards, tmp_path, change, said):
    folder = copy_of(shards, tmp_path)
    shard = folder / "data" / "train-00002-of-00004.parquet"
    change(datasets.Dataset.from_parquet(str(shard))).to_parquet(str(shard))
    with pytest.raises(RecipeError, match=rf"^--streaming: shard {re.escape(str(shard))} {said}"):
        stream_splits(folder)


def first_batches(stream, workers: int, n: int = 30) -> None:
    from torchdata.stateful_dataloader import StatefulDataLoader

    loader = StatefulDataLoader(stream, batch_size=4, num_workers=workers, collate_fn=lambda rows: rows)
    for _ in zip(range(n), loader):
        pass


@pytest.mark.parametrize("workers", [0, 1])
def test_a_label_missing_at_run_time_is_one_line_even_from_a_worker(shards, tmp_path, monkeypatch, workers):
    """A shard not checked up front (a Hub dataset's) without the label column streams None labels."""
    folder = copy_of(shards, tmp_path)
    shard = folder / "data" / "train-00002-of-00004.parquet"
    datasets.Dataset.from_parquet(str(shard)).remove_columns("label").to_parquet(str(shard))
    monkeypatch.setattr("vit_recipes.data.streaming.check_shard_columns", lambda *a: None)
    stream = stream_splits(folder).train
    with pytest.raises(StreamError) as caught:
        first_batches(stream, workers)
    assert str(caught.value) == (
        "--streaming: an image has no label: its shard has no 'label' column, or the row leaves it empty; give every "
        "image a label, or remove the shards without one"
    )


def test_a_streamed_training_label_the_validation_split_lacks_is_one_line(tmp_path):
    """Labels stored as plain values take their class names from the validation split: a training label it lacks
    stops the run with its value, where the lookup would fail with a KeyError."""
    folder = tmp_path / "values" / "data"
    folder.mkdir(parents=True)
    image = {"bytes": jpeg(np.zeros((8, 8, 3), np.uint8)), "path": None}
    features = datasets.Features({"image": datasets.Image(), "label": datasets.Value("int64")})
    for split, labels in (("train", [0, 1, 2, 5]), ("validation", [0, 1, 2])):
        rows = datasets.Dataset.from_dict({"image": [image] * len(labels), "label": labels}, features=features)
        rows.to_parquet(str(folder / f"{split}-00000-of-00001.parquet"))
    splits = stream_splits(tmp_path / "values")
    assert splits.label_names == ["0", "1", "2"]
    with pytest.raises(
        StreamError, match=r"^--streaming: training label 5 is not among the validation split's labels"
    ):
        first_batches(splits.train, 0, n=1)


@pytest.mark.parametrize("workers", [0, 1])
def test_a_shard_failing_mid_read_is_one_line_naming_it_even_from_a_worker(shards, tmp_path, workers):
    """A shard that only fails while it is read (not checked up front: a Hub dataset's) is named as datasets logs
    it."""
    folder = copy_of(shards, tmp_path)
    broken = folder / "data" / "train-00001-of-00004.parquet"
    broken.write_bytes(broken.read_bytes()[:-300])
    files = sorted(str(p) for p in (folder / "data").glob("train-*.parquet"))
    stream = datasets.load_dataset("parquet", data_files={"train": files}, split="train", streaming=True)
    with pytest.raises(StreamError) as caught:
        first_batches(RankStream(stream.select_columns(["n"]), 0, 1, seed=0, buffer=0), workers)
    assert str(caught.value).startswith(f"--streaming: shard {broken} could not be read (ArrowInvalid: ")
    assert "\n" not in str(caught.value)


def test_a_row_group_too_large_for_pyarrow_is_one_line_naming_its_shard_when_probed(shards):
    """pyarrow cannot read a row group of over 2 GiB of image bytes (one row group for a whole Hub-sized file): the
    probe of the stream's first images (decoding.prepare_images) says so in one line naming the shard."""
    import pyarrow as pa

    class TooLarge:  # a shard as datasets reads it: its builder logs the file, then re-raises pyarrow's error
        def __iter__(self):
            logging.getLogger("datasets").error("Failed to read file '/data/train.parquet' with error <...>")
            raise pa.ArrowNotImplementedError("Nested data conversions not implemented for chunked array outputs")

    stream = stream_splits(shards).train
    stream.part = TooLarge()
    with pytest.raises(StreamError, match=r"^--streaming: shard /data/train.parquet has a row group of over 2 GiB of "
                       r"image bytes, which pyarrow cannot read: write it again in smaller row groups"):  # fmt: skip
        stream.head(64)

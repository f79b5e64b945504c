"""--streaming: train on a dataset larger than the disk, read as a `datasets` IterableDataset (a Hub dataset, or local
parquet/arrow/WebDataset shards or image folders); validation and test stay map-style (small, and scored whole).

- Each rank reads its own part (`split_dataset_by_node`: whole shards when their count divides by the ranks, else
  every rank reads all and keeps its share), and the DataLoader workers split that part by shard; where the part has
  fewer shards than workers, the workers of one shard split its rows (RankStream.worker_part), so a stream of few files
  decodes in as many processes as a folder does.
- The stream repeats: each rank starts its next epoch (a reshuffled shard order and buffer) where its data ends, so
  ranks with unequal shards never wait at an epoch end that only some of them reached. The run is counted in steps.
- Its position is the DataLoader's state (torchdata's StatefulDataLoader asks each worker's dataset for it), saved
  per rank in every checkpoint; a resumed run reads past the images before it without decoding them (the
  Trainer's own resume would decode every skipped batch) and then sees what the uninterrupted run saw.
- Local parquet/arrow shards are checked before any work: each one's footer or schema is read (a few KB, not its
  rows), so a shard cut short or without the image and label columns is one line naming it, not a pyarrow error in a
  DataLoader worker at step 0.
"""

import contextlib
import itertools
import logging
import math
import os
import re
from pathlib import Path
from typing import NamedTuple

import datasets
import psutil
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from datasets.distributed import split_dataset_by_node

from ..core.errors import RecipeError, first_line
from ..core.swap import swapped
from .batches import worker_setup
from .data import LABELS, VALIDATION_SPLITS, ImageSplits, find_column, resolve_source, sample
from .folder_index import DATA_BUILDERS, index_folder, load_folder, suffix

logger = logging.getLogger(__name__)

STATE_FILE = "stream_state_rank{rank}.pt"  # in a checkpoint: one rank's DataLoader state
SCHEMA_SHARDS = (".parquet", ".arrow")  # local shards whose columns are read up front (a WebDataset .tar has none)


class StreamError(RecipeError):
    r"""A RecipeError raised while a DataLoader worker reads the stream. torch raises it again in the main process as
    `type(err)("Caught StreamError in DataLoader worker process 0.\nOriginal Traceback ...: <message>")`: the
    message alone is kept, so the user still gets one line."""

    def __init__(self, message: str):
        if message.startswith("Caught ") and "\nOriginal Traceback" in message:
            message = message.rstrip().rsplit("\n", 1)[-1].split(f"{type(self).__name__}: ", 1)[-1]
        super().__init__(message)


class _FailedFile(logging.Handler):
    """The file that datasets' parquet and arrow builders name in their log before they re-raise a reading error
    (the pyarrow error itself names a '<Buffer>'): the only place datasets says which shard failed."""

    said = re.compile(r"Failed to read (?:file|schema from) '(.+?)' with error")

    def __init__(self):
        super().__init__(logging.ERROR)
        self.file = None

    def emit(self, record: logging.LogRecord) -> None:
        if found := self.said.match(record.getMessage()):
            self.file = found[1]


_failed_file = _FailedFile()


def unreadable_shard(err: Exception) -> StreamError:
    """A reading error in the middle of the stream (a damaged page; a truncated arrow shard; a Hub shard that failed
    to come), as one line naming the shard where datasets logged it."""
    file, _failed_file.file = _failed_file.file, None
    where = f"shard {file}" if file else "a shard of the training stream"
    if "Nested data conversions not implemented for chunked array outputs" in str(err):
        return StreamError(
            f"--streaming: {where} has a row group of over 2 GiB of image bytes, which pyarrow cannot read: write it "
            "again in smaller row groups (datasets' to_parquet writes 100 images a group), or split it into files"
        )
    return StreamError(
        f"--streaming: {where} could not be read ({type(err).__name__}: {first_line(err)}): replace the file (copy or "
        "export it again), or remove it from the dataset; a Hub dataset: run again (the Hub may have failed to send)"
    )


@contextlib.contextmanager
def naming_failed_shards():
    """A reading error of the stream inside the block as one line naming its shard (`unreadable_shard`). A local
    shard's footer is checked up front, not its pages; and pyarrow cannot read a row group of over 2 GiB of image
    bytes at all ("Nested data conversions not implemented for chunked array outputs")."""
    if _failed_file not in logging.getLogger("datasets").handlers:  # in this process (a DataLoader worker)
        logging.getLogger("datasets").addHandler(_failed_file)
    _failed_file.file = None
    try:
        yield
    except (pa.ArrowException, OSError) as err:  # read while training: its pages, not only its footer
        raise unreadable_shard(err) from None


class RankStream(torch.utils.data.IterableDataset):
    """This rank's part of a streamed split, repeated without end (module docstring); epoch e shuffles with seed+e.

    Its position is (epoch, rows read this epoch), per DataLoader worker: a worker's rows are the same every time
    (datasets gives worker i the same shards, the buffer shuffles with a fixed seed), so a resumed worker reads past
    as many rows, without decoding them, and goes on exactly where it stopped, buffer included. (datasets' own
    `state_dict` loads a worker's state into the stream before splitting it between workers, which fails for a
    shuffled stream; and it drops the shuffle buffer's images.) Each epoch builds its own shuffled stream, so no
    epoch counter is shared between workers (datasets' `set_epoch` keeps one in shared memory).
    """

    def __init__(self, stream: datasets.IterableDataset, rank: int, world_size: int, seed: int, buffer: int,
                 rows: int | None = None, largest_row_group: tuple[int, str] | None = None):  # fmt: skip
        super().__init__()
        self.stream = stream  # the whole split: worker_part takes a shard of it
        self.part = split_dataset_by_node(stream, rank=rank, world_size=world_size)
        self.rank, self.world_size, self.seed, self.buffer = rank, world_size, seed, buffer
        self.rows = rows  # images in the whole stream, where its metadata says (else None)
        self.epoch, self.position, self._skip = 0, 0, 0
        self.largest_row_group = largest_row_group  # (bytes, file) of local parquet shards: what a worker holds

    @property
    def num_shards(self) -> int:
        return self.part.num_shards

    def __iter__(self):
        with naming_failed_shards():
            yield from self._rows()

    def head(self, n: int) -> list[dict]:
        """The first `n` rows of this rank's part, unshuffled (what decoding probes), read as __iter__ reads."""
        with naming_failed_shards():  # a probe's failing shard named too
            return list(itertools.islice(self.part, n))

    def worker_part(self, worker: int, workers: int) -> datasets.IterableDataset:
        """What DataLoader worker `worker` of `workers` reads where this rank's part has fewer shards than workers:
        shard worker % shards of the part, every m-th of its rows, m being the number of workers given that shard
        (the others read the rest). Every image of the part is read by exactly one (rank, worker), as datasets' own
        split gives each worker whole shards. Each of a shard's m workers reads all its rows and decodes only its own:
        reading bytes costs little next to decoding them. (datasets gives a worker whole shards only: the workers
        beyond the shard count would read nothing, and a file of one row group would decode in one process.)"""
        shards = self.part.num_shards
        shard, share, m = worker % shards, worker // shards, len(range(worker % shards, workers, shards))
        total = self.stream.num_shards
        if total % self.world_size == 0:  # split_dataset_by_node gave this rank whole shards: one of them, by rows
            mine = self.stream.shard(self.world_size, self.rank, contiguous=False)
            return split_dataset_by_node(mine.shard(shards, shard, contiguous=False), rank=share, world_size=m)
        # every rank reads every shard and keeps every world_size-th row: that shard's rows split between
        # world_size x m (rank, worker) pairs
        one = self.stream.shard(total, shard, contiguous=False)
        return split_dataset_by_node(one, rank=self.rank * m + share, world_size=self.world_size * m)

    def _rows(self):
        skip, self._skip = self._skip, 0
        worker = torch.utils.data.get_worker_info()
        shared = worker is not None and worker.num_workers > self.part.num_shards > 0
        part = self.worker_part(worker.id, worker.num_workers) if shared else self.part
        while True:
            stream = part.shuffle(seed=self.seed + self.epoch, buffer_size=max(1, self.buffer))
            if shared:  # iter(): datasets would split it between the workers again (one shard: to worker 0 alone)
                stream = (dict(zip(b, r)) for b in stream.iter(batch_size=64) for r in zip(*b.values()))
            self.position = 0
            for row in stream:
                self.position += 1
                if skip:  # resuming: read past what the checkpointed run had read (no decoding: the collator does it)
                    skip -= 1
                    continue
                yield row
            if self.position == 0:  # this worker holds no shard (more workers than shards), or the stream is empty
                return
            self.epoch += 1

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "world_size": self.world_size, "rank": self.rank}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self._skip = state["epoch"], state["position"]


def is_stream(dataset) -> bool:
    return isinstance(dataset, RankStream)


def stream_rows(stream) -> int | None:
    return stream.rows if is_stream(stream) else len(stream)


def plan_stream_steps(training, rows: int | None, global_batch: int) -> None:
    """A stream is counted in steps: --max_steps, else epochs x images / batch where the dataset's metadata counts its
    images; epoch-based evaluation and saving become every epoch's steps (the Trainer sees no epoch end)."""
    if training.max_steps <= 0:
        if not rows:
            raise RecipeError(
                "--streaming: the dataset does not say how many training images it has; pass --max_steps (and "
                "--eval_steps/--save_steps for evaluation and checkpoints)"
            )
        training.max_steps = math.ceil(training.num_train_epochs * max(1, rows // global_batch))
        logger.warning(
            "--streaming: %d steps (%g epoch(s) of %d images at %d a step)", training.max_steps,
            training.num_train_epochs, rows, global_batch,
        )  # fmt: skip
    per_epoch = max(1, rows // global_batch) if rows else None
    for kind in ("eval", "save"):
        strategy = getattr(training, f"{kind}_strategy")
        if str(getattr(strategy, "value", strategy)) != "epoch":
            continue
        if per_epoch is None:
            raise RecipeError(
                f"--streaming with --{kind}_strategy epoch: the stream's epoch length is unknown; pass "
                f"--{kind}_strategy steps --{kind}_steps N"
            )
        setattr(training, f"{kind}_strategy", "steps")
        setattr(training, f"{kind}_steps", per_epoch)
        logger.warning("--streaming: --%s_strategy epoch becomes every %d steps (one epoch)", kind, per_epoch)


def decoders(asked: int, shards: int) -> dict[str, int]:
    """How a rank's stream is read by the `asked` DataLoader workers (--dataloader_num_workers) over its `shards`:
    all of them (none where the rank has no shard), and `sharing` workers at most read each shard, each decoding its
    share of the rows (RankStream.worker_part); 1 where every worker has whole shards of its own."""
    workers = asked if shards else 0
    return {"workers": workers, "sharing": -(-workers // shards) if shards else 1}


ROW_GROUP_COPIES = 3  # a worker reading a parquet row group holds ~3x its bytes (pyarrow's read, the Arrow batch)


def warn_of_row_group_memory(largest: tuple[int, str] | None, workers: int) -> None:
    """One line where the workers reading at once would hold over half this machine's memory: a file of one large row
    group (a pandas/pyarrow default) is read whole by each worker that shares it."""
    if not largest:
        return
    workers = max(1, workers)
    held, total = ROW_GROUP_COPIES * largest[0] * workers, psutil.virtual_memory().total
    if held > total / 2:
        logger.warning(
            "--streaming: %d DataLoader worker(s) each hold a row group of up to %.1f GiB as they read (%s; ~%dx in "
            "memory: %.0f GiB in all, of this machine's %.0f GiB): write the parquet files in smaller row groups "
            "(datasets writes images 100 rows a group) or pass fewer --dataloader_num_workers", workers,
            largest[0] / 2**30, largest[1], ROW_GROUP_COPIES, held / 2**30, total / 2**30,
        )  # fmt: skip


class StreamedBatches:
    """Mixin for `transformers.Trainer`: a streamed train split (RankStream) is read by a torchdata StatefulDataLoader
    that this rank owns, and its position is saved in every checkpoint and restored on resume.

    Replaces, for streams only: accelerate's preparation of the train loader (for an IterableDataset it reads the
    stream on rank 0 and broadcasts each batch, or has every rank read the whole stream and keep every n-th batch:
    either way one rank's reading for all), and the Trainer's resume, which re-reads the batches before the step.
    """

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self._stream_state = None  # this rank's saved stream state (_save_checkpoint), loaded into the next loader
        self._stream_loader = None
        self._stream_layout = None  # {"shards", "workers"}: which worker reads which shards (its positions' meaning)

    def get_train_dataloader(self):
        if not is_stream(self.train_dataset):
            return super().get_train_dataloader()
        from torchdata.stateful_dataloader import StatefulDataLoader  # imported by streamed runs only

        t = self.args
        shards = self.train_dataset.num_shards
        layout = decoders(t.dataloader_num_workers, shards)
        workers, sharing = layout["workers"], layout["sharing"]
        if t.process_index == 0:  # a fact of the run, printed as decoding.say prints the others
            how = (f"up to {sharing} workers share a shard, each decoding its share of the shard's rows"
                   if sharing > 1 else "each with whole shards of its own")  # fmt: skip
            print(
                f"--streaming: {max(1, workers)} image decoder(s) per rank: {workers} DataLoader worker(s) "
                f"(--dataloader_num_workers) over the {shards} shard(s) of rank 0, {how}", flush=True,
            )  # fmt: skip
        warn_of_row_group_memory(self.train_dataset.largest_row_group, workers)
        loader = StatefulDataLoader(
            self.train_dataset, batch_size=self._train_batch_size, collate_fn=self.data_collator, num_workers=workers,
            pin_memory=t.dataloader_pin_memory, drop_last=True, prefetch_factor=t.dataloader_prefetch_factor if workers else None,
            worker_init_fn=worker_setup() if workers else None,
        )  # fmt: skip
        self._stream_layout = {"shards": shards, "workers": workers}
        if (
            self._stream_state is not None
            and self._stream_state.get("layout", self._stream_layout) != self._stream_layout
        ):
            logger.warning(
                "--streaming: the checkpoint's stream positions are for %s, this run reads %s: the stream starts "
                "over (the images already seen this epoch are seen again)", self._stream_state["layout"],
                self._stream_layout,
            )  # fmt: skip
            self._stream_state = None
        if self._stream_state is not None:
            loader.load_state_dict(self._stream_state["loader"])
            self._stream_state = None
        self._stream_loader = loader
        return loader

    def _prepare_input(self, data):
        # A stream's batches come from the loader above, not accelerate's (which copies to the device without
        # blocking where accelerator_config.non_blocking): the Trainer's plain .to() would make the host wait for
        # the GPU's queue to drain at every step. Pinned memory (the loader's) is kept until its copy completes.
        if (
            isinstance(data, torch.Tensor) and data.device.type == "cpu" and self._stream_loader is not None
            and self.args.accelerator_config.non_blocking and not torch.is_floating_point(data)
        ):  # fmt: skip
            return data.to(self.args.device, non_blocking=True)
        return super()._prepare_input(data)

    def train(self, resume_from_checkpoint=None, **kwargs):
        if not (is_stream(self.train_dataset) and resume_from_checkpoint):
            return super().train(resume_from_checkpoint=resume_from_checkpoint, **kwargs)
        path = os.path.join(resume_from_checkpoint, STATE_FILE.format(rank=self.args.process_index))
        state = torch.load(path, weights_only=False) if os.path.isfile(path) else None
        if state is None or state.get("world_size") != self.args.world_size:
            logger.warning(
                "--streaming: %s holds no stream position for %d process(es): the stream starts over (the images "
                "already seen this epoch are seen again)", resume_from_checkpoint, self.args.world_size,
            )  # fmt: skip
        else:
            self._stream_state = state  # applied by get_train_dataloader, where the workers are known
        # The Trainer would skip the steps done by reading them again: the loader's state starts after them instead.
        with swapped(self.args, "ignore_data_skip", True):
            return super().train(resume_from_checkpoint=resume_from_checkpoint, **kwargs)

    def _save_checkpoint(self, model, trial):
        if self._stream_loader is not None:  # every rank its own, before the checkpoint is marked complete
            from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

            folder = os.path.join(self._get_output_dir(trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
            os.makedirs(folder, exist_ok=True)
            state = {"loader": self._stream_loader.state_dict(), "world_size": self.args.world_size,
                     "layout": self._stream_layout}  # fmt: skip
            torch.save(state, os.path.join(folder, STATE_FILE.format(rank=self.args.process_index)))
        return super()._save_checkpoint(model, trial)


# ---------------------------------------------------------------------------------------------------- loading


class Footer(NamedTuple):
    """What a local shard's footer says, read once before any work."""

    columns: list[str]
    largest_group: int  # bytes of its largest parquet row group, what one worker holds as it reads (0: arrow)


def shard_footer(file: str) -> Footer:
    """A local shard's columns and largest row group, from its parquet footer or arrow schema (a few KB, not its
    rows). A parquet shard cut short (an interrupted copy or download) has no footer: one line names it, before any
    work."""
    try:
        if file.endswith(".parquet"):
            meta = pq.read_metadata(file)
            groups = (meta.row_group(i).total_byte_size for i in range(meta.num_row_groups))
            return Footer(meta.schema.to_arrow_schema().names, max(groups, default=0))
        with pa.memory_map(file) as source:
            try:
                return Footer(pa.ipc.open_stream(source).schema.names, 0)
            except pa.ArrowInvalid:  # datasets reads both arrow formats: the stream (its own) and the file format
                return Footer(pa.ipc.open_file(source).schema.names, 0)
    except (pa.ArrowException, OSError) as err:
        raise RecipeError(
            f"--streaming: shard {file} cannot be read ({first_line(err)}): it is cut short or damaged; copy or "
            "export it again, or move it out of the dataset folder"
        ) from None


def _shard_files(path: Path) -> list[str]:
    """The local parquet/arrow shards: a second walk of the folder (only for one of shards, not one of images)."""
    index = index_folder(path.resolve()) if path.is_dir() else None
    files = [str(index.root / f) for f in index.files] if index else [str(path)]
    return [f for f in files if suffix(f) in SCHEMA_SHARDS]


def _local_shards(path: Path, streams: dict) -> dict[str, Footer]:
    """Every local parquet/arrow shard of the dataset and its footer (none for a Hub dataset, a folder of images or
    WebDataset shards)."""
    if not {getattr(s.info, "builder_name", None) for s in streams.values()} & {"parquet", "arrow"}:
        return {}
    return {file: shard_footer(file) for file in _shard_files(path)}


def _streams(source: str, config_name: str | None, cache_dir: str | None) -> tuple[dict, dict[str, Footer]]:
    """Every split of a dataset as a stream, and its local shards' columns (`_local_shards`): a Hub id streamed from
    the Hub, a local folder's shards from disk (its files indexed in one walk, folder_index.py); a folder of images
    alone is its table of paths, made iterable."""
    path = Path(source).expanduser()
    if not path.exists():
        return dict(datasets.load_dataset(source, config_name, streaming=True, cache_dir=cache_dir)), {}
    if path.is_file() and path.suffix not in DATA_BUILDERS:
        raise RecipeError(f"--streaming reads a Hub dataset or a folder of shards, not {path}")
    try:
        if path.is_file():
            loaded = {"train": datasets.load_dataset(DATA_BUILDERS[path.suffix], data_files=str(path), split="train",
                                                     streaming=True)}  # fmt: skip
        else:
            loaded = load_folder(path, cache_dir, streaming=True)  # a folder of images: its table of paths
    except pa.ArrowException:  # datasets read a split's first shard for its columns, and failed: name the shard
        for file in _shard_files(path):
            shard_footer(file)
        raise
    streams = {
        s: d.to_iterable_dataset(num_shards=min(64, len(d))) if s == "train" and isinstance(d, datasets.Dataset) else d
        for s, d in loaded.items()
    }
    return streams, _local_shards(path, streams)


def check_shard_columns(shards: dict[str, Footer], features, image_column: str, label_column: str) -> None:
    """Every shard holds the image and label columns (a shard without them would stream rows of None), and the
    columns of the first one, whose features datasets casts every shard to (another column fails the cast)."""
    for file, (columns, _) in shards.items():
        if missing := [c for c in (image_column, label_column) if c not in columns]:
            raise RecipeError(
                f"--streaming: shard {file} has no '{missing[0]}' column (its columns: {', '.join(columns)}): every "
                f"shard needs the image and label columns ('{image_column}', '{label_column}'); fix or remove it"
            )
        if set(columns) != set(features):
            raise RecipeError(
                f"--streaming: shard {file} has the columns {', '.join(columns)}, the first shard {', '.join(features)}:"
                " datasets streams shards of one set of columns; give them the same columns, or remove it"
            )


def _materialize(split) -> datasets.Dataset:
    """An evaluation split, read whole (it is small): a map-style Dataset."""
    if isinstance(split, datasets.Dataset):
        return split
    return datasets.Dataset.from_generator(lambda: (yield from split), features=split.features)


def load_stream_splits(data_args, training, cache_dir: str | None = None):
    """ImageSplits whose train is this rank's RankStream and whose validation/test are map-style (data.ImageSplits);
    the label names from the stream's ClassLabel, else the evaluation splits' sorted values."""
    source, preset = resolve_source(data_args.dataset_name)
    streams, shards = _streams(source, data_args.dataset_config_name, cache_dir)
    train_name = data_args.train_split_name
    if train_name not in streams:
        raise RecipeError(f"train split '{train_name}' does not exist; splits are: {', '.join(streams)}")
    val_name = data_args.validation_split_name or next((n for n in VALIDATION_SPLITS if n in streams), None)
    test_name = data_args.test_split_name or ("test" if "test" in streams else None)
    for name in (data_args.validation_split_name, data_args.test_split_name):
        if name and name not in streams:
            raise RecipeError(f"split '{name}' does not exist; splits are: {', '.join(streams)}")
    # One shard per parquet row group where datasets can split them (Hub files hold many: a file of 8 row groups is
    # 8 shards for the ranks and their workers to share), before anything reads or shuffles the stream.
    train = streams[train_name].reshard()
    features = train.features
    if features is None:
        raise RecipeError(f"--streaming: {source} does not say its columns; stream a dataset with typed features")
    image_column = find_column(features, data_args.image_column_name, preset and preset.image_column, "image")
    label_column = find_column(features, data_args.label_column_name, preset and preset.label_column, "label")
    check_shard_columns(shards, features, image_column, label_column)
    evaluated = {n: _materialize(streams[n]) for n in (val_name, test_name) if n}
    if training.do_eval and not val_name:
        raise RecipeError(
            "--streaming needs a validation split to evaluate (--validation_split_name), or --do_eval false"
        )
    label = features[label_column]
    if isinstance(label, datasets.ClassLabel):
        names, source_kind, lookup = list(label.names), "ClassLabel", None
    elif isinstance(label, datasets.Value) and evaluated:
        values = sorted({v for d in evaluated.values() for v in d.unique(label_column)})
        names, source_kind, lookup = [str(v) for v in values], "sorted values", {v: i for i, v in enumerate(values)}
    else:
        raise RecipeError(
            f"--streaming: label column '{label_column}' ({label}) needs class names: a ClassLabel feature, or single "
            "labels that the validation split lists"
        )

    def encode(table: pa.Table) -> pa.Table:
        """A batch's labels as class indices, in Arrow: a stream's rows left to other workers (RankStream.worker_part)
        are then skipped in Arrow too, never made Python objects."""
        values = table[label_column]
        if values.null_count:  # a shard without the column (a Hub one, not checked up front) streams None
            raise StreamError(
                f"--streaming: an image has no label: its shard has no '{label_column}' column, or the row leaves it "
                "empty; give every image a label, or remove the shards without one"
            )
        if lookup is not None:
            found = values.to_pylist()
            if unknown := [v for v in found if v not in lookup]:  # a list: a label may be 0 or ""
                raise StreamError(
                    f"--streaming: training label {unknown[0]!r} is not among the validation split's labels "
                    f"({names[:5]}...): give the validation split every class, or store the labels as a ClassLabel "
                    "feature"
                )
            values = pa.array([lookup[v] for v in found], pa.int64())
        return table.drop_columns([label_column]).append_column(LABELS, values)

    for name, split in evaluated.items():
        theirs = split.features.get(label_column)
        if isinstance(theirs, datasets.ClassLabel) and lookup is None and list(theirs.names) != names:
            raise RecipeError(f"split '{name}' names its classes differently from train's ClassLabel: use one list")

    def prepared(split):
        split = split.select_columns([image_column, label_column]).cast_column(
            image_column, datasets.Image(decode=False)
        )
        return split.with_format("arrow").map(encode, batched=True).with_format(None)

    if len(names) < 2:
        raise RecipeError(f"label column '{label_column}' has {len(names)} class(es); classification needs at least 2")
    rows = getattr(getattr(train.info, "splits", None) or {}, "get", lambda _: None)(train_name)
    rows = rows.num_examples if rows is not None and rows.num_examples else None
    largest = max(((footer.largest_group, file) for file, footer in shards.items() if footer.largest_group),
                  default=None)  # fmt: skip
    stream = RankStream(prepared(train), training.process_index, training.world_size, training.seed,
                        data_args.shuffle_buffer_size, rows, largest)  # fmt: skip
    val, test = (prepared(evaluated[n]) if n else None for n in (val_name, test_name))
    notes = [f"train: streamed ({stream.part.num_shards} shard(s) on this rank of {training.world_size})"]
    if data_args.max_eval_samples:
        val = val and sample(val, data_args.max_eval_samples, training.seed, "validation", notes)
        test = test and sample(test, data_args.max_eval_samples, training.seed, "test", notes)
    return ImageSplits(stream, val, test, image_column, names, source_kind, notes=notes, decode="per_batch")

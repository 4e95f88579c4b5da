"""Streamed training data (`streaming: true`): the training split read as training goes, for sets larger than memory.

The source is read with datasets' streaming reader, `streaming_buffer_rows` rows at a time. Each buffer is prepared as
a prepared split is (tokenization._prepare_batch: the same tokens, labels, cuts and drops; finish_split's counts),
its kept rows shuffled under (seed, data epoch, buffer), packed by TRL's pack_dataset when the recipe packs, and the
packed rows shuffled again (the sampler's shuffle of a prepared split). At the end of the source the next data epoch
starts: the stream never ends, so a run is bounded by max_steps and the trainer never sees a short last batch.

SFTTrainer gets the rows as a datasets.IterableDataset (`Stream.dataset`) with its preparation skipped (the rows are
cut, masked and packed here; TRL's collator still flattens packed rows). accelerate gives each rank its share of every
global batch (by default the main process reads the stream and sends the batches: dispatch_batches), so after
`global_step` steps exactly
global_step x per_device_train_batch_size x gradient_accumulation_steps x world_size rows have been trained on
(`Stream.consumed`) whatever the loader read ahead. Each checkpoint records where the next row comes from
(`position`: the data epoch, the buffer, the source's state at the buffer's first row, the rows of the buffer
already used, the counts so far) in stream_position.json; a resumed run reads the source from that state, prepares
that one buffer again and skips what was used: the rows, and so the weights, of the run that was not interrupted.
A source that changed since is checked by streamresume.py (the rows the checkpoint stands on read again).

A local folder's files are read whatever their format (datafiles.py), counted per format. A row the reader cannot
parse ends the stream (`failure`): the rows are given only up to the last whole optimizer step the rows read cover
(a buffer is read before the rows of the step it completes are given), so every rank's loader runs dry at the same
step; streamtrain.py saves the steps trained and ends the run with the line naming the file and line.
"""

from __future__ import annotations

import copy
import json
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import datasets
import numpy as np
import pyarrow as pa
from trl.data_utils import pack_dataset

from sftrecipes.core.errors import RecipeError
from sftrecipes.data import datafiles, streamresume
from sftrecipes.data.chat import NOT_RENDERED, arrow_structs
from sftrecipes.data.formats import check_template, detect_format, sample_prompt
from sftrecipes.data.load import describe_format, load_source, read_source
from sftrecipes.data.prepkey import content_fingerprint
from sftrecipes.data.tokenization import (
    CUT_KEPT,
    KEPT,
    _prepare_batch,
    _trainable,
    check_loss_format,
    count_marks,
    end_ids,
    finish_split,
    log_bos,
    tokenize_split,
)
from sftrecipes.recipe import images
from sftrecipes.recipe.sources import check_eval_split, sources
from sftrecipes.recipe.typed import Recipe

log = logging.getLogger("sftrecipes")

POSITION_FILE = "stream_position.json"
YIELD_ROWS = 256  # rows of a prepared buffer made Python objects at a time
# the streams the IterableDatasets read, by key (gen_kwargs stay a short string; a dataset's copies share it)
_STREAMS: dict[str, Stream] = {}


def empty_counts(labels=()) -> dict:
    """The counts of buffers prepared; files: the rows read per file format (datafiles.py), by label."""
    return {"read": 0, "truncated": 0, "dropped_after_cut": 0, "fully_masked": 0, "kept": 0, "packed_rows": 0,
            "fully_masked_packed_rows": 0, "duplicate_bos_removed": 0, "not_rendered": dict.fromkeys(NOT_RENDERED, 0),
            "files": dict.fromkeys(labels, 0)}


def _add(total: dict, part: dict) -> None:
    for k, v in part.items():
        if isinstance(v, dict):
            _add(total.setdefault(k, {}), v)
        else:
            total[k] = total.get(k, 0) + v


@dataclass
class Position:
    """Where the next row of the stream comes from: buffer `buffer` of data epoch `epoch`, whose first row the source
    reaches from `source_state` (None: the epoch's start), less the first `skip` rows it gives; `sequences` rows
    given before it; `counts`: the counts of the buffers before it."""

    epoch: int = 0
    buffer: int = 0
    skip: int = 0
    source_state: dict | None = None
    sequences: int = 0
    counts: dict = field(default_factory=empty_counts)
    chain_before: str = ""  # the digest of the data epoch's rows before the buffer, and through it (streamresume.chain)
    chain: str = ""


@dataclass
class _Buffer:
    epoch: int
    buffer: int
    source_state: dict | None
    first: int  # its first row's index in the stream
    rows: int  # the rows it gives
    counts_before: dict
    chain_before: str = ""  # the digest of the epoch's rows before it, and through it (streamresume.chain)
    chain: str = ""


class Stream:
    """The endless stream of one recipe's training rows; see the module docstring."""

    def __init__(self, recipe: Recipe, tokenizer, eot: str):
        self.recipe, self.tokenizer, self.eot = recipe, tokenizer, eot
        self.src = sources(recipe)[0]
        self.buffer_rows = int(recipe.data.streaming_buffer_rows)
        self.seed = int(recipe.trl_value("seed"))
        self.max_length = recipe.trl_value("max_length")
        self.packing = recipe.trl_value("packing") and recipe.trl_value("packing_strategy")  # None/False: rows as they are
        self.ends = end_ids(tokenizer, eot)
        self.where = f"{self.src.key} {self.src.path} ({self.src.split})"
        got = read_source(self.src, self.src.split, streaming=True)
        self.parts = got.parts  # a local source's files by format (datafiles.Part), None otherwise
        self.labels = [p.label for p in self.parts] if self.parts else ["save_to_disk" if datafiles.is_saved(Path(self.src.path).expanduser()) else "hub"]
        try:
            with datafiles.quiet_readers():
                first = next(got.dataset.with_format("arrow").iter(batch_size=1), None)
        except datafiles.UNREADABLE as e:
            raise RecipeError(self._unreadable(e)) from None
        if first is not None:
            first, _ = datafiles.untag(first)
        if first is None or first.num_rows == 0:
            raise RecipeError(f"dataset_name: the train split of {self.src.path} has no rows; check the data and splits")
        self.columns = first.column_names
        self.fmt = detect_format(recipe, self.columns, self.where, self.src.format)
        self.first_row = _decoded(first)[0]
        check_template(recipe, self.fmt, self.src.key, self.first_row)
        check_loss_format(recipe, self.fmt, self.first_row, "the train split")
        self.structs = arrow_structs(datasets.Features.from_arrow_schema(first.schema))
        self.identity = {"path": self.src.path, "split": self.src.split, "config": self.src.config,
                         "content": content_fingerprint(self.src.path, self.src.config)}
        if self.parts:  # every data file of the source, each split's (a resume says which changed)
            every = datafiles.splits_of(self.src.path, "dataset_name") or {}
            self.identity["files"] = streamresume.file_stats(self.src.path, sorted({f for fs in every.values() for f in fs}))
        self.start = Position(counts=empty_counts(self.labels))
        self.start_step = 0  # the optimizer step `start` follows
        self.resumed_from: str | None = None  # the checkpoint `start` was read from
        self.counts = empty_counts(self.labels)  # of the rows prepared so far (ahead of training by what the loader read ahead)
        self.history: deque[_Buffer] = deque()
        self.keep_rows = 0  # history kept: at least this many rows behind the newest buffer (set by `dataset`)
        self.per_step = 1  # rows one optimizer step trains on (set by `dataset`): the stream ends on a multiple of it
        self.failure: RecipeError | None = None  # why the stream could not read on (rows(): then it ended)
        self.primed = False  # `dataset` read ahead the rows rows() gives first
        self.epoch = 0
        self.seconds = 0.0  # spent preparing
        self.key = f"{id(self)}"

    # ------------------------------------------------------------------------------------------- reading

    def _open(self):
        return load_source(self.src, self.src.split, streaming=True).with_format("arrow")

    def _unreadable(self, error: BaseException) -> str:
        """The line for a batch the reader could not read: the file and line of the first row that cannot be parsed."""
        if self.parts:
            return datafiles.unreadable(self.src.path, self.src.split, self.parts, error, "dataset_name")
        return f"dataset_name: {self.src.path} ({self.src.split}) cannot be read ({type(error).__name__}: {str(error).splitlines()[0][:200]}); check the data"

    def _batches(self, source):
        """The source's buffers of rows as read (Arrow tables, the part column dropped) and each one's part indices
        (None: one part); a batch the reader cannot parse ends in a RecipeError naming its file and line."""
        batches = source.iter(batch_size=self.buffer_rows)
        while True:
            try:
                with datafiles.quiet_readers():
                    table = next(batches, None)
            except datafiles.UNREADABLE as e:
                raise RecipeError(self._unreadable(e)) from None
            if table is None:
                return
            yield datafiles.untag(table)

    def describe(self) -> str:
        return (f"data: {self.where}: streamed, {describe_format(self.recipe, self.src, self.fmt, self.first_row)}; "
                f"buffers of {self.buffer_rows} rows prepared as training reads them, shuffled under seed {self.seed}"
                + (f", packed ({self.packing}) within the buffer" if self.packing else "")
                + "; counts are logged per logging window")

    def _prepare(self, table: pa.Table, parts, epoch: int, buffer: int, chain: str) -> tuple[pa.Table, dict, str]:
        """A buffer's rows as the trainer gets them (an Arrow table), its counts, and the epoch's digest through it."""
        t0 = time.perf_counter()
        first = buffer * self.buffer_rows
        images.refuse_buffer(self.recipe, table, f"{self.where}: buffer {buffer} of data epoch {epoch} (its rows "
                             f"{first}-{first + table.num_rows - 1})")  # rows that carry images: counted, one line
        indices = list(range(first, first + table.num_rows))
        columns = table.to_pydict()
        chain = streamresume.chain(chain, columns)
        out = _prepare_batch(_decoded(table, rows=False, columns=columns), indices, self.tokenizer, self.recipe, self.eot,
                             self.fmt, self.ends, self.where, None, self.structs)
        marks = [out[c].to_numpy(zero_copy_only=False) for c in ("_status", "_bos_removed", "_unrendered")]
        counts = {**empty_counts(self.labels), **count_marks(*marks)}
        per_part = np.bincount(parts, minlength=len(self.labels)) if parts is not None else [table.num_rows]
        for label, n in zip(self.labels, per_part):
            counts["files"][label] += int(n)
        kept = np.flatnonzero(np.isin(marks[0], (KEPT, CUT_KEPT)))
        rng = np.random.default_rng([self.seed, epoch, buffer])
        rows = out.select(["input_ids", "labels"]).take(pa.array(kept[rng.permutation(len(kept))], pa.int64()))
        if self.packing and rows.num_rows:
            shown = datasets.is_progress_bar_enabled()
            datasets.disable_progress_bars()  # (a bar for every buffer would bury the training log)
            try:
                packed = pack_dataset(datasets.Dataset(rows), self.max_length, self.packing).with_format("arrow")[:]
            finally:
                if shown:
                    datasets.enable_progress_bars()
            rows = packed.take(pa.array(rng.permutation(packed.num_rows), pa.int64()))
            counts["packed_rows"] = rows.num_rows
            if self.packing == "wrapped":  # rows cut across samples: one may hold no trainable label
                counts["fully_masked_packed_rows"] = sum(not _trainable(r) for r in rows.column("labels").to_pylist())
        self.seconds += time.perf_counter() - t0
        return rows, counts, chain

    def _buffers(self):
        """Every buffer from `start` on, without end, prepared: (its _Buffer, its rows as the trainer gets them). The
        buffer `start` lies in starts at its row 0, `start.skip` rows before the stream's next row."""
        pos = self.start
        epoch, buffer, state, chain = pos.epoch, pos.buffer, pos.source_state, pos.chain_before
        first = pos.sequences - pos.skip
        while True:
            source = self._open()
            whole = state is None  # from the epoch's first row: an epoch that gives nothing gives nothing ever
            if state is not None:
                source.load_state_dict(state)
            given = 0
            for table, parts in self._batches(source):
                after = copy.deepcopy(source.state_dict())
                out, counts, through = self._prepare(table, parts, epoch, buffer, chain)
                buf = _Buffer(epoch, buffer, state, first, out.num_rows, copy.deepcopy(self.counts), chain, through)
                self._remember(buf)
                _add(self.counts, counts)
                yield buf, out
                first, given, buffer, state, chain = first + out.num_rows, given + out.num_rows, buffer + 1, after, through
            if given == 0 and whole:
                raise RecipeError(self._nothing_kept())
            log.info("data: %s: data epoch %d read (%d rows in all); epoch %d starts", self.where, epoch,
                     self.counts["read"], epoch + 1)
            epoch, buffer, state, chain = epoch + 1, 0, None, ""

    def _begin(self) -> None:
        """Reading starts again at `start`: the buffers read but not given yet, the rows read so far."""
        self.counts = copy.deepcopy(self.start.counts)
        self.history.clear()
        self.failure, self.epoch, self.primed = None, self.start.epoch, False
        self._source, self._ready, self._read = self._buffers(), deque(), self.start.sequences

    def _read_more(self) -> bool:
        """One more buffer read and prepared; False (and `failure` set) when the stream cannot read on: a row it
        cannot parse, nothing kept in a whole data epoch, a template failing on a row."""
        try:
            buf, out = next(self._source)
        except RecipeError as e:
            self.failure = e
            return False
        self._ready.append((buf, out))
        self._read = buf.first + buf.rows
        return True

    def rows(self):
        """Every row the trainer gets, from `start` on, without end, unless the stream cannot read on (`failure`):
        then it ends after the last row of the last whole optimizer step (per_step rows) the rows read cover, so
        no step trains on fewer rows. Rows are given only up to that point before the next buffer is read."""
        if not self.primed:  # (`dataset` read the first step's rows already)
            self._begin()
        self.primed = False
        given = self.start.sequences  # the next row to give
        while True:
            target = self.start.sequences + (self._read - self.start.sequences) // self.per_step * self.per_step
            while given < target:
                buf, out = self._ready[0]
                self.epoch = buf.epoch
                end = min(target, buf.first + buf.rows)
                for at in range(given - buf.first, end - buf.first, YIELD_ROWS):  # Python rows a slice at a time
                    yield from out.slice(at, min(YIELD_ROWS, end - buf.first - at)).to_pylist()
                given = end
                if given == buf.first + buf.rows:
                    self._ready.popleft()
            if not self._read_more():
                log.error("data: %s: the stream ends after %d rows (%d read past the last whole step are not given): %s",
                          self.where, given, self._read - given, self.failure)
                return

    def _nothing_kept(self) -> str:
        if self.recipe.trl_value("assistant_only_loss"):
            return "assistant_only_loss: no sample of the streamed train split has an assistant token; check the data's roles"
        return (f"max_length: no sample of the streamed train split keeps a trainable token (cut at {self.max_length}, "
                f"{self.recipe.trl_value('truncation_mode')}); raise max_length, or check the data")

    def _remember(self, buf: _Buffer) -> None:
        self.history.append(buf)
        while len(self.history) > 2 and buf.first - self.history[1].first - self.history[1].rows >= self.keep_rows:
            self.history.popleft()  # the next-oldest already lies far enough behind

    # ------------------------------------------------------------------------------------------- position

    def position(self, consumed: int) -> Position:
        """The position after `consumed` rows of the stream (from the history of the buffers read)."""
        for buf in reversed(self.history):
            if buf.first <= consumed <= buf.first + buf.rows:
                return Position(buf.epoch, buf.buffer, consumed - buf.first, buf.source_state, consumed, buf.counts_before,
                                buf.chain_before, buf.chain)
        if not self.history and consumed == self.start.sequences:
            return self.start
        raise RuntimeError(f"the stream's position after {consumed} rows is no longer known (buffers kept: "
                           f"{[(b.first, b.rows) for b in self.history]}); raise the history kept (keep_rows)")

    def consumed(self, step: int, args) -> int:
        """Rows trained on after optimizer step `step`: every step takes rows_per_step rows of the endless stream."""
        return self.start.sequences + (step - self.start_step) * rows_per_step(args)

    def save(self, folder: Path, step: int, args) -> None:
        """Writes where the stream goes on after step `step` into checkpoint `folder` (the main process)."""
        p = self.position(self.consumed(step, args))
        record = {"epoch": p.epoch, "buffer": p.buffer, "skip": p.skip, "source_state": p.source_state,
                  "sequences": p.sequences, "counts": p.counts, "global_step": step, "buffer_rows": self.buffer_rows,
                  "seed": self.seed, "packing": self.packing or None, "max_length": self.max_length, "data": self.identity,
                  "chain_before": p.chain_before, "chain": p.chain}
        tmp = folder / (POSITION_FILE + ".tmp")
        tmp.write_text(json.dumps(record, indent=1))
        tmp.replace(folder / POSITION_FILE)

    def resume(self, record: dict, checkpoint: str) -> None:
        """Start at a checkpoint's position; one line when the stream it was saved from is not this one."""
        name = Path(checkpoint).name
        for key, mine in (("buffer_rows", self.buffer_rows), ("seed", self.seed), ("packing", self.packing or None),
                          ("max_length", self.max_length)):
            if record[key] != mine:
                recipe_key = {"buffer_rows": "streaming_buffer_rows", "packing": "packing_strategy"}.get(key, key)
                raise RecipeError(f"{recipe_key}: {name} was streamed with {key} {record[key]}, this run has {mine}; "
                                  f"resume with {record[key]} (another value reads another stream), or start a new output_dir")
        changed = streamresume.check(record, self.identity, self._reread, checkpoint)
        if changed:
            log.warning("%s", changed)
        self.start = Position(record["epoch"], record["buffer"], record["skip"], record["source_state"],
                              record["sequences"], record["counts"], record.get("chain_before", ""), record.get("chain", ""))
        self.start_step = record["global_step"]
        self.resumed_from = checkpoint
        log.info("data: %s: resuming the stream at data epoch %d, buffer %d, row %d of it (%d rows trained on)",
                 self.where, record["epoch"], record["buffer"], record["skip"], record["sequences"])

    def _reread(self, through: int) -> tuple[str, int, str | None]:
        """A data epoch's rows read again from its start through buffer `through`: their digest (as `_prepare` chains
        it; '' when the source now ends before that buffer), the rows read, the line of a row that cannot be parsed."""
        chain, rows = "", 0
        try:
            for i, (table, _) in enumerate(self._batches(self._open())):
                chain, rows = streamresume.chain(chain, table.to_pydict()), rows + table.num_rows
                if i == through:
                    return chain, rows, None
        except RecipeError as e:
            return chain, rows, str(e)
        return "", rows, None

    # ------------------------------------------------------------------------------------------- for the trainer

    def dataset(self, rows_per_step: int) -> datasets.IterableDataset:
        """The stream as the IterableDataset SFTTrainer reads; rows_per_step: rows one optimizer step trains on (all
        ranks), which bounds how far the loaders read ahead of training. The rows of the first step are read here,
        before the model loads: a stream that cannot give one step is refused at once (its RecipeError)."""
        self.keep_rows = 4 * rows_per_step
        self.per_step = rows_per_step
        self._begin()  # the first step's rows read now, on every rank: a stream that cannot give them stops here
        while self._read - self.start.sequences < rows_per_step:
            if not self._read_more():
                raise self.failure
        self.primed = True
        _STREAMS[self.key] = self
        features = {"input_ids": datasets.Sequence(datasets.Value("int32")),
                    "labels": datasets.Sequence(datasets.Value("int64"))}
        if self.packing in ("bfd", "bfd_split"):
            features["seq_lengths"] = datasets.Sequence(datasets.Value("int32"))
        return datasets.IterableDataset.from_generator(_generate, features=datasets.Features(features),
                                                       gen_kwargs={"key": self.key})


def _decoded(table: pa.Table, rows: bool = True, columns: dict | None = None):
    """A buffer as a prepared split's map gets it: its columns decoded by their datasets features (a Json column's
    strings parsed); rows: a list of rows, else a dict of columns. columns: the table's to_pydict(), when made."""
    features = datasets.Features.from_arrow_schema(table.schema)
    batch = features.decode_batch(table.to_pydict() if columns is None else columns)
    return [dict(zip(batch, values)) for values in zip(*batch.values())] if rows else batch


def rows_per_step(args) -> int:
    """Rows of the stream one optimizer step trains on, all ranks together."""
    return args.per_device_train_batch_size * args.gradient_accumulation_steps * args.world_size


def _generate(key: str):
    yield from _STREAMS[key].rows()


def read_position(checkpoint: str) -> dict:
    """A checkpoint's stream position, or one line why it has none (before anything loads)."""
    path = Path(checkpoint) / POSITION_FILE
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise RecipeError(f"streaming: {Path(checkpoint).name} has no {POSITION_FILE} (its run did not stream its data), "
                          "so where the stream continues is unknown; resume with streaming: false, or start a new output_dir") from None
    except (OSError, ValueError) as e:
        raise RecipeError(f"streaming: {path} cannot be read ({e}); resume from another checkpoint") from None


def streamed_datasets(recipe: Recipe, tokenizer, eot: str, resume_from: str | None = None):
    """(stream, eval split or None, sample prompt, counts): the training stream (positioned at the checkpoint's
    position when resuming) and the eval split prepared whole, without the cache."""
    stream = Stream(recipe, tokenizer, eot)
    log.info("%s", stream.describe())
    if resume_from:
        stream.resume(read_position(resume_from), resume_from)
    src, evals, counts, prompt = stream.src, None, {}, None
    got_eval = read_source(src, src.eval_split, required=src.eval_required) if src.eval_split else None
    raw_eval = got_eval.dataset if got_eval is not None else None
    check_eval_split(recipe, raw_eval is not None)
    if raw_eval is not None:
        images.refuse_split(recipe, raw_eval, f"{src.key} {src.path} ({src.eval_split})")
        fmt = detect_format(recipe, raw_eval.column_names, f"{src.key} {src.path} ({src.eval_split})", src.format)
        prepared = tokenize_split(recipe, tokenizer, eot, raw_eval, "eval split", fmt, f"{src.key} {src.path} ({src.eval_split})")
        evals, counts["eval"] = finish_split(recipe, prepared, "eval split", {fmt: len(raw_eval)}, is_eval=True,
                                             files=got_eval.counts())
        log_bos(tokenizer, counts["eval"]["duplicate_bos_removed"])
        prompt = sample_prompt(fmt, raw_eval[0], recipe) if len(raw_eval) else None
    if prompt is None:
        prompt = sample_prompt(stream.fmt, stream.first_row, recipe)
    return stream, evals, prompt, counts

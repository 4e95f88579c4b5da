"""Streamed training data (`streaming: true`): the training split read as training goes, for sets larger than memory.

The source is read with datasets' streaming reader, `streaming_buffer_rows` rows at a time. Each buffer is prepared as
a prepared split is (tokenization._prepare_batch: the same tokens, labels, cuts and drops; finish_split's counts),
its kept rows shuffled under (seed, data epoch, buffer), packed by TRL's pack_dataset when the recipe packs, and the
packed rows shuffled again (the sampler's shuffle of a prepared split). At the end of the source the next data epoch
starts: the stream never ends, so a run is bounded by max_steps and the trainer never sees a short last batch.

SFTTrainer gets the rows as a datasets.IterableDataset (`Stream.dataset`) with its preparation skipped (the rows are
cut, masked and packed here; TRL's collator still flattens packed rows). Every rank reads the whole stream and
accelerate gives each rank its share of every global batch, so after `global_step` steps exactly
global_step x per_device_train_batch_size x gradient_accumulation_steps x world_size rows have been trained on
(`Stream.consumed`) whatever the loader read ahead. Each checkpoint records where the next row comes from
(`position`: the data epoch, the buffer, the source's state at the buffer's first row, the rows of the buffer
already used, the counts so far) in stream_position.json; a resumed run reads the source from that state, prepares
that one buffer again and skips what was used: the rows, and so the weights, of the run that was not interrupted.
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
from transformers import TrainerCallback
from trl.data_utils import pack_dataset

from .chat import NOT_RENDERED, arrow_structs, describe_not_rendered, template_key
from .data import describe_format, load_source
from .errors import RecipeError
from .formats import check_template, detect_format, sample_prompt
from .prepkey import content_fingerprint
from .recipe import Recipe
from .sources import check_eval_split, sources
from .tokenization import (CUT_KEPT, KEPT, _prepare_batch, _trainable, check_loss_format, count_marks, end_ids,
                           finish_split, log_bos, tokenize_split)

log = logging.getLogger("sftrecipes")

POSITION_FILE = "stream_position.json"
YIELD_ROWS = 256  # rows of a prepared buffer made Python objects at a time
# the streams the IterableDatasets read, by key (gen_kwargs stay a short string; a dataset's copies share it)
_STREAMS: dict[str, Stream] = {}


def empty_counts() -> dict:
    return {"read": 0, "truncated": 0, "dropped_after_cut": 0, "fully_masked": 0, "kept": 0, "packed_rows": 0,
            "fully_masked_packed_rows": 0, "duplicate_bos_removed": 0, "not_rendered": dict.fromkeys(NOT_RENDERED, 0)}


def _add(total: dict, part: dict) -> None:
    for k, v in part.items():
        if isinstance(v, dict):
            _add(total[k], v)
        else:
            total[k] += v


def _minus(a: dict, b: dict) -> dict:
    return {k: _minus(v, b[k]) if isinstance(v, dict) else v - b[k] for k, v in a.items()}


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


@dataclass
class _Buffer:
    epoch: int
    buffer: int
    source_state: dict | None
    first: int  # its first row's index in the stream
    rows: int  # the rows it gave
    counts_before: dict


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
        first = next(self._open().iter(batch_size=1), None)
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
        self.start = Position()
        self.start_step = 0  # the optimizer step `start` follows
        self.resumed_from: str | None = None  # the checkpoint `start` was read from
        self.counts = empty_counts()  # of the rows prepared so far (ahead of training by what the loader read ahead)
        self.history: deque[_Buffer] = deque()
        self.keep_rows = 0  # history kept: at least this many rows behind the newest buffer (set by `dataset`)
        self.epoch = 0
        self.seconds = 0.0  # spent preparing
        self.key = f"{id(self)}"

    # ------------------------------------------------------------------------------------------- reading

    def _open(self):
        return load_source(self.src, self.src.split, streaming=True).with_format("arrow")

    def describe(self) -> str:
        return (f"data: {self.where}: streamed, {describe_format(self.recipe, self.src, self.fmt, self.first_row)}; "
                f"buffers of {self.buffer_rows} rows prepared as training reads them, shuffled under seed {self.seed}"
                + (f", packed ({self.packing}) within the buffer" if self.packing else "")
                + "; counts are logged per logging window")

    def _prepare(self, table: pa.Table, epoch: int, buffer: int) -> tuple[pa.Table, dict]:
        """A buffer's rows as the trainer gets them (an Arrow table), and its counts."""
        t0 = time.perf_counter()
        first = buffer * self.buffer_rows
        indices = list(range(first, first + table.num_rows))
        out = _prepare_batch(_decoded(table, rows=False), indices, self.tokenizer, self.recipe, self.eot, self.fmt, self.ends,
                             self.where, None, self.structs)
        marks = [out[c].to_numpy(zero_copy_only=False) for c in ("_status", "_bos_removed", "_unrendered")]
        counts = {**empty_counts(), **count_marks(*marks)}
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
        return rows, counts

    def rows(self):
        """Every row the trainer gets, from `start` on, without end."""
        pos = self.start
        epoch, buffer, skip, state, seq = pos.epoch, pos.buffer, pos.skip, pos.source_state, pos.sequences
        self.counts = copy.deepcopy(pos.counts)
        self.history.clear()
        while True:
            self.epoch = epoch
            source = self._open()
            whole = state is None  # from the epoch's first row: an epoch that gives nothing gives nothing ever
            if state is not None:
                source.load_state_dict(state)
            given = 0
            for table in source.iter(batch_size=self.buffer_rows):
                after = copy.deepcopy(source.state_dict())
                out, counts = self._prepare(table, epoch, buffer)
                n = out.num_rows
                self._remember(_Buffer(epoch, buffer, state, seq, n, copy.deepcopy(self.counts)))
                _add(self.counts, counts)
                for start in range(min(skip, n), n, YIELD_ROWS):  # as Python rows a slice at a time, not all at once
                    yield from out.slice(start, YIELD_ROWS).to_pylist()
                seq += n - min(skip, n)
                given += n
                skip, buffer, state = 0, buffer + 1, after
            if given == 0 and whole:
                raise RecipeError(self._nothing_kept())
            log.info("data: %s: data epoch %d read (%d rows in all); epoch %d starts", self.where, epoch,
                     self.counts["read"], epoch + 1)
            epoch, buffer, state = epoch + 1, 0, None

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
                return Position(buf.epoch, buf.buffer, consumed - buf.first, buf.source_state, consumed, buf.counts_before)
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
                  "seed": self.seed, "packing": self.packing or None, "max_length": self.max_length, "data": self.identity}
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
        if record["data"] != self.identity:
            raise RecipeError(f"dataset_name: the data of {name} was {record['data']['path']} ({record['data']['split']}), "
                              f"not what {self.src.path} ({self.src.split}) holds now; resume on the same data, or start "
                              "a new output_dir")
        self.start = Position(record["epoch"], record["buffer"], record["skip"], record["source_state"],
                              record["sequences"], record["counts"])
        self.start_step = record["global_step"]
        self.resumed_from = checkpoint
        log.info("data: %s: resuming the stream at data epoch %d, buffer %d, row %d of it (%d rows trained on)",
                 self.where, record["epoch"], record["buffer"], record["skip"], record["sequences"])

    # ------------------------------------------------------------------------------------------- for the trainer

    def dataset(self, rows_per_step: int) -> datasets.IterableDataset:
        """The stream as the IterableDataset SFTTrainer reads; rows_per_step: rows one optimizer step trains on (all
        ranks), which bounds how far the loaders read ahead of training."""
        self.keep_rows = 4 * rows_per_step
        _STREAMS[self.key] = self
        features = {"input_ids": datasets.Sequence(datasets.Value("int32")),
                    "labels": datasets.Sequence(datasets.Value("int64"))}
        if self.packing in ("bfd", "bfd_split"):
            features["seq_lengths"] = datasets.Sequence(datasets.Value("int32"))
        return datasets.IterableDataset.from_generator(_generate, features=datasets.Features(features),
                                                       gen_kwargs={"key": self.key})


def _decoded(table: pa.Table, rows: bool = True):
    """A buffer as a prepared split's map gets it: its columns decoded by their datasets features (a Json column's
    strings parsed); rows: a list of rows, else a dict of columns."""
    features = datasets.Features.from_arrow_schema(table.schema)
    batch = features.decode_batch(table.to_pydict())
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


class StreamCallback(TrainerCallback):
    """Logs the stream's counts per logging window (rank 0): the rows trained on, what was prepared since the last
    log. On a resumed run, restores the checkpoint's RNG states again just before the first step: the trainer restores
    them before it starts its loader, whose start draws a seed from torch's generator, while the uninterrupted run
    drew it at its own start long before; without this, dropout after a resume draws other masks. (A prepared split's
    resume restores them after its skip for the same reason.) `trainer`: set once the trainer exists."""

    def __init__(self, stream: Stream):
        self.stream, self.last, self.trained = stream, empty_counts(), 0
        self.trainer = None
        self.rng_pending = stream.resumed_from is not None

    def on_step_begin(self, args, state, control, **kwargs):
        if self.rng_pending:
            self.rng_pending = False
            self.trainer._load_rng_state(self.stream.resumed_from)  # (transformers' own reader of its rng_state files)

    def on_train_begin(self, args, state, control, **kwargs):
        self.last = copy.deepcopy(self.stream.start.counts)  # a resumed stream's counts go on from its checkpoint's
        self.trained = self.stream.start.sequences

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs or "loss" not in logs:
            return
        now, trained = copy.deepcopy(self.stream.counts), self.stream.consumed(state.global_step, args)
        try:
            epoch = self.stream.position(trained).epoch
        except RuntimeError:  # (the history always covers it; the log line is no place to fail a run)
            epoch = self.stream.epoch
        delta = _minus(now, self.last)
        log.info("data: stream at step %d: %d rows trained on since the last log (%d in all, data epoch %d); prepared "
                 "since the last log: %s", state.global_step, trained - self.trained, trained, epoch,
                 describe_counts(delta, self.stream) if delta["read"] else "none (the buffer read before holds them)")
        self.last, self.trained = now, trained


def describe_counts(c: dict, stream: Stream) -> str:
    line = (f"{c['read']} rows read, {c['truncated']} truncated at max_length {stream.max_length}, "
            f"{c['dropped_after_cut']} dropped after the cut, {c['fully_masked']} fully masked (dropped), {c['kept']} kept")
    if stream.packing:
        line += f", packed into {c['packed_rows']} rows ({stream.packing})"
        if stream.packing == "wrapped":
            line += f", {c['fully_masked_packed_rows']} of them fully masked"
    return line + describe_not_rendered(c["not_rendered"], template_key(stream.recipe))


def streamed_datasets(recipe: Recipe, tokenizer, eot: str, resume_from: str | None = None):
    """(stream, eval split or None, sample prompt, counts): the training stream (positioned at the checkpoint's
    position when resuming) and the eval split prepared whole, without the cache."""
    stream = Stream(recipe, tokenizer, eot)
    log.info("%s", stream.describe())
    if resume_from:
        stream.resume(read_position(resume_from), resume_from)
    src, evals, counts, prompt = stream.src, None, {}, None
    raw_eval = load_source(src, src.eval_split, required=src.eval_required) if src.eval_split else None
    check_eval_split(recipe, raw_eval is not None)
    if raw_eval is not None:
        fmt = detect_format(recipe, raw_eval.column_names, f"{src.key} {src.path} ({src.eval_split})", src.format)
        prepared = tokenize_split(recipe, tokenizer, eot, raw_eval, "eval split", fmt, f"{src.key} {src.path} ({src.eval_split})")
        evals, counts["eval"] = finish_split(recipe, prepared, "eval split", {fmt: len(raw_eval)}, is_eval=True)
        log_bos(tokenizer, counts["eval"]["duplicate_bos_removed"])
        prompt = sample_prompt(fmt, raw_eval[0], recipe) if len(raw_eval) else None
    if prompt is None:
        prompt = sample_prompt(stream.fmt, stream.first_row, recipe)
    return stream, evals, prompt, counts


def summary_counts(stream: Stream, counts: dict) -> dict:
    """run_summary.json's data entry of a streamed run: the train counts of every buffer prepared (a little ahead of
    training), the stream's preparation time and rate, the data epoch reached."""
    c = stream.counts
    return {**counts, "train": {**c, "formats": {stream.fmt: c["read"]}, "max_length": stream.max_length,
                                "truncation_mode": stream.recipe.trl_value("truncation_mode"), "streamed": True},
            "preparation": {"how": "streamed", "seconds": round(stream.seconds, 3), "rows": c["read"],
                            "rows_per_s": round(c["read"] / stream.seconds, 1) if stream.seconds else None,
                            "data_epoch": stream.epoch, "buffer_rows": stream.buffer_rows}}

"""The rows a cache entry keeps, as SFTTrainer reads them: TRL's own preparation of tokenized rows done once, when the
entry is made, and written as one Arrow file per split.

Given `input_ids` + `labels`, TRL 1.16's `SFTTrainer._prepare_dataset` only truncates and drops fully masked rows
(nothing left to do on rows tokenization.py cut and counted), packs (`packing`, `eval_packing` for the eval split:
`input_ids` and `labels`, shuffled first under `shuffle_dataset`, by `trl.data_utils.pack_dataset`) and shuffles
(`shuffle_dataset`, under `seed`). Done at every launch, it wrote a second copy of the rows beside the entry's (a map's
cache file: the packed rows, or the truncated ones) under a main-process-first barrier bound by ddp_timeout. Here it is
done once into the entry, with TRL's own functions, and train.py has SFTTrainer skip its preparation
(`skip_prepare_dataset`): the entry holds `input_ids`, `labels` and, packed by bfd, `seq_lengths`, nothing else (the
rendered text is not kept). The rows are packed in the batches TRL's map hands pack_dataset (datasets' map batch,
1,000 rows) in one process, as TRL packs without `dataset_num_proc`; TRL with it packs each worker's share apart,
which groups the rows at the shares' edges otherwise and would make the rows depend on the number of processes.

Every pass reads the split batch by batch and writes it to a file, never the whole split in memory (pyarrow's memory
pool handed back after each batch packed: it keeps what a batch freed otherwise, ~50 MB here); the entry's file is
written in record batches of WRITE_BYTES (datasets writes a map's output in the map's batches: each record batch costs
a process that maps the file ~64 KB of RSS, the page around its header, when it opens it).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from pathlib import Path

import datasets
import numpy as np
import pyarrow as pa
from trl.data_utils import pack_dataset

from sftrecipes.core.errors import RecipeError
from sftrecipes.recipe.typed import Recipe

COLUMNS = ["input_ids", "labels"]  # what TRL packs (and trains on); packing adds seq_lengths
WRITE_BYTES = 16 << 20  # one record batch of an entry's file: ~120 a million chat rows
INDEX_ROWS = 100_000  # one record batch of a shuffle's indices (8 bytes a row)
# the batch TRL's pack map hands pack_dataset: datasets' map default, which TRL leaves as it is
PACK_ROWS = inspect.signature(datasets.Dataset.map).parameters["batch_size"].default


def packing_of(recipe: Recipe, is_eval: bool) -> str | None:
    """The packing strategy TRL applies to the split, None where it does not pack (its rule: eval_packing, unset,
    follows packing)."""
    packing = recipe.trl_value("packing")
    if is_eval and recipe.trl_value("eval_packing") is not None:
        packing = recipe.trl_value("eval_packing")
    if not packing:
        return None
    if recipe.trl_value("max_length") is None:  # (TRL: "When packing is enabled, max_length can't be None")
        raise RecipeError(f"{'eval_packing' if is_eval else 'packing'}: true needs max_length (alias max_seq_len) to set "
                          "the packed length; set max_length: 2048")
    return recipe.trl_value("packing_strategy")


def _shuffled(recipe: Recipe, dataset, scratch: Callable | None):
    if not recipe.trl_value("shuffle_dataset"):
        return dataset
    return dataset.shuffle(seed=recipe.trl_value("seed"), indices_cache_file_name=scratch("shuffled") if scratch else None,
                           writer_batch_size=INDEX_ROWS)


def packed_batches(recipe: Recipe, dataset, strategy: str, scratch: Callable | None = None) -> Iterator[pa.Table]:
    """The split packed as TRL packs it, one PACK_ROWS batch at a time: input_ids and labels, shuffled first under
    shuffle_dataset, each batch packed by pack_dataset (its progress bar hidden: one a batch)."""
    ds = _shuffled(recipe, dataset.select_columns(COLUMNS), scratch)
    shown = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        for table in ds.with_format("arrow").iter(batch_size=PACK_ROWS):
            packed = pack_dataset(datasets.Dataset(table), recipe.trl_value("max_length"), strategy).with_format("arrow")[:]
            pa.default_memory_pool().release_unused()
            yield packed
    finally:
        if shown:
            datasets.enable_progress_bars()


def trainable(labels: pa.Array) -> np.ndarray:
    """Per row of a list array of labels: whether a label past position 0 is trained (tokenization._trainable, for
    every row at once)."""
    labels = labels.combine_chunks() if isinstance(labels, pa.ChunkedArray) else labels
    offsets = np.asarray(labels.offsets, dtype=np.int64)
    offsets = offsets - offsets[0]
    trained = labels.flatten().to_numpy(zero_copy_only=False) != -100
    starts = offsets[:-1]
    trained[starts[np.diff(offsets) > 0]] = False  # position 0 of each row is never predicted
    seen = np.concatenate([[0], np.cumsum(trained)])
    return seen[offsets[1:]] > seen[starts]


def packing_counts(recipe: Recipe, dataset, is_eval: bool, scratch: Callable | None = None) -> dict | None:
    """What packing will make of the prepared split: fully masked packed rows (they add no loss), counted batch by batch.
    None where the split is not packed."""
    strategy = packing_of(recipe, is_eval)
    if strategy is None:
        return None
    if strategy != "wrapped":
        # every kept sample has a trainable label past its first position and is no longer than max_length, and
        # bfd/bfd_split keep such samples whole in one row: no packed row can be fully masked
        return {"strategy": strategy, "rows": None, "fully_masked_rows": 0}
    rows = masked = 0
    for table in packed_batches(recipe, dataset, strategy, scratch):
        rows += table.num_rows
        masked += int((~trainable(table.column("labels"))).sum())
    return {"strategy": strategy, "rows": rows, "fully_masked_rows": masked}


def write(path: Path, tables: Iterator[pa.Table]) -> int:
    """The tables, one after the other, into one Arrow stream file (what datasets.Dataset.from_file reads, the features
    in its schema) in record batches of WRITE_BYTES or a little more; the rows written."""
    held, size, rows, writer = [], 0, 0, None
    with pa.OSFile(str(path), "wb") as sink:
        for table in tables:
            if writer is None:
                schema = datasets.Features.from_arrow_schema(table.schema).arrow_schema
                writer = pa.ipc.new_stream(sink, schema)
            held.append(table.cast(schema))
            size, rows = size + table.nbytes, rows + table.num_rows
            if size >= WRITE_BYTES:
                writer.write_table(pa.concat_tables(held).combine_chunks())
                held, size = [], 0
                pa.default_memory_pool().release_unused()
        if writer is not None:
            if held:
                writer.write_table(pa.concat_tables(held).combine_chunks())
            writer.close()
    return rows


def save(recipe: Recipe, dataset, path: Path, is_eval: bool, scratch: Callable) -> int:
    """Write the split to `path` as the trainer reads it (packed, shuffled: TRL's preparation); its rows. scratch(what):
    a new file name for an intermediate (the attempt's scratch folder)."""
    strategy = packing_of(recipe, is_eval)
    shuffle = bool(recipe.trl_value("shuffle_dataset"))
    if strategy is None:
        ds = _shuffled(recipe, dataset.select_columns(COLUMNS), scratch)
        return write(path, ds.with_format("arrow").iter(batch_size=PACK_ROWS))
    if not shuffle:
        return write(path, packed_batches(recipe, dataset, strategy, scratch))
    packed = Path(scratch("packed"))  # TRL shuffles the packed rows again
    write(packed, packed_batches(recipe, dataset, strategy, scratch))
    ds = _shuffled(recipe, datasets.Dataset.from_file(str(packed)), scratch)
    return write(path, ds.with_format("arrow").iter(batch_size=PACK_ROWS))

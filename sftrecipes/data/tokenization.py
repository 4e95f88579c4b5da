"""Tokenization: each sample made into the input_ids and labels SFTTrainer trains on (rendered, tokenized, masked, cut
at max_length), counted per split.

The project formats, tokenizes and truncates itself and hands SFTTrainer `input_ids` + `labels`, so that every data
option has a defined effect (TRL 1.16 ignores `add_special_tokens`/`append_concat_token` and appends a second
end-of-turn token to ChatML text). Samples are cut at `max_length` as `truncation_mode` says, and samples with no
trainable label are dropped and counted; what reaches TRL is then never longer than `max_length`, so TRL's own
truncation and its drop of fully masked samples change nothing, and its packing (`bfd`, `bfd_split`) keeps each sample
whole. TRL's packing and shuffle then apply, once, as a cache entry is written (trainrows.py).

Conversations go through chat.Chat: tool calls, tool turns, `content: null`, reasoning and a row's `tools` reach the
template; a template that fails on a row is one line naming the row; the fields it leaves out are counted per split
and reported on the data line. Under `assistant_only_loss` an assistant turn is trained whole (its reasoning, text
and tool calls, with its end of turn); tool turns are not.

A split is prepared in batches (`_prepare_batch`, BATCH_ROWS rows of each map batch of MAP_ROWS, in worker processes
sized to the cores: `workers`): each row rendered (chat.Chat's fast road), the batch tokenized in one call of the fast
tokenizer (fastencode.py), labels computed from its offsets with numpy; the tokens, labels and status are `tokenize_example`'s / `_prepare_row`'s, the per-row reference
(tests/data/test_prep_fast.py compares them on every format and tiny family). A batch that fails is prepared again row by
row by the reference, so an error is the reference's, naming the same row.
"""

from __future__ import annotations

import logging
import os

import numpy as np
import pyarrow as pa

from sftrecipes.core.errors import RecipeError
from sftrecipes.data import arrowmem, prepattempt, trainrows
from sftrecipes.data.chat import NOT_RENDERED, Chat, arrow_structs, describe_not_rendered, template_key
from sftrecipes.data.fastencode import encode
from sftrecipes.data.formats import CONVERSATIONAL, check_template, detect_format, from_sharegpt, is_conversational
from sftrecipes.recipe.typed import Recipe

log = logging.getLogger("sftrecipes")

# what became of one sample (the `_status` column while a split is prepared)
KEPT, FULLY_MASKED, CUT_AWAY, CUT_KEPT = 0, 1, 2, 3
# worker processes when dataset_num_proc is unset: one per ROWS_PER_WORKER rows (below that, starting one costs more
# than it saves: bench/bench_data.py), at most the usable cores and MAX_WORKERS
ROWS_PER_WORKER, MAX_WORKERS = 4000, 16
BATCH_ROWS = 1000  # rows prepared at a time: one tokenizer call
# rows of one batch of the map, written as one record batch (datasets' writer splits at 1,000 by default): every record
# batch costs a process that maps the output ~64 KB of RSS (the page around its header) when it opens it
MAP_ROWS = 10_000
MARK_ROWS = 100_000  # rows of the marks (_status, _bos_removed, _unrendered: 17 bytes a row) read at a time


def _assistant_spans(chat: Chat, messages: list[dict], text: str) -> list[tuple[int, int]]:
    """Character spans of the assistant turns in the rendered text (reasoning, content and tool calls + end-of-turn)."""
    spans = []
    for i, msg in enumerate(messages):
        if msg["role"] != "assistant":
            continue
        before = chat.apply(messages[:i], add_generation_prompt=True) if i else ""
        through = chat.apply(messages[: i + 1])
        if not text.startswith(through) or not through.startswith(before):
            raise RecipeError(
                "assistant_only_loss: the chat template renders a conversation's prefix differently from the whole "
                "conversation, so assistant turns cannot be located; use chatml/zephyr or set assistant_only_loss: false"
            )
        spans.append((len(before), len(through)))
    return spans


def render(example: dict, fmt: str, tokenizer, recipe: Recipe, where: str = "the example",
           structs: tuple[bool, bool] = (False, False), fast: bool = False) -> tuple[str, list[list[tuple[int, int]]], bool, int]:
    """(text, span sets, ends with EOS, NOT_RENDERED bits). A token is trained when it overlaps a span of every set
    (no set: every token). Plain prompt/completion text always ends with EOS, as TRL writes it. where: the row, for
    errors; structs: chat.arrow_structs of its split; fast: chat.Chat's fast road (rows of a dataset)."""
    aol = bool(recipe.trl_value("assistant_only_loss"))
    completion_only = recipe.trl_value("completion_only_loss") is not False  # TRL: None and True mean completion only
    if is_conversational(fmt, example):
        check_template(recipe, fmt, "a row", example)
    if fmt in CONVERSATIONAL:
        chat = Chat(tokenizer, recipe, example, where, structs, fast)
        msgs = chat.messages(example["messages"] if fmt == "messages" else from_sharegpt(example["conversations"], where))
        text = chat.apply(msgs)
        return text, ([_assistant_spans(chat, msgs, text)] if aol else []), False, chat.not_rendered(msgs, text)
    if fmt == "prompt_completion":
        prompt, completion = example["prompt"], example["completion"]
        if isinstance(prompt, list) != isinstance(completion, list):
            raise RecipeError("dataset_format: prompt_completion needs prompt and completion both text or both lists of messages; fix the data")
        if not isinstance(prompt, list):
            text = prompt + completion
            return text, ([[(len(prompt), len(text))]] if completion_only else []), True, 0
        chat = Chat(tokenizer, recipe, example, where, structs, fast)
        msgs = chat.messages(prompt + completion)
        text = chat.apply(msgs)
        sets = []
        if completion_only:
            head = chat.apply(msgs[: len(prompt)], add_generation_prompt=True)
            if not text.startswith(head):
                raise RecipeError(
                    "completion_only_loss: the chat template renders the prompt differently from the start of prompt + "
                    "completion, so the completion cannot be located; use chatml/zephyr, or completion_only_loss: false to train on the whole sequence"
                )
            sets.append([(len(head), len(text))])
        if aol:
            sets.append(_assistant_spans(chat, msgs, text))
        return text, sets, False, chat.not_rendered(msgs, text)
    return example[recipe.trl_value("dataset_text_field")], [], False, 0


def end_ids(tokenizer, eot: str) -> tuple[list[list[int]], str | None]:
    """The id sequences that end a sample (EOS now and as the tokenizer shipped it, the end-of-turn token), and the
    end-of-turn text when it is not one token (then it is also recognised in the text, whatever its tokenization)."""
    seqs = [[tokenizer.eos_token_id]] if tokenizer.eos_token_id is not None else []
    shipped = tokenizer.init_kwargs.get("eos_token")
    shipped = getattr(shipped, "content", shipped)
    if isinstance(shipped, str) and shipped in tokenizer.get_vocab():
        seqs.append([tokenizer.get_vocab()[shipped]])
    if eot in tokenizer.get_vocab():
        return seqs + [[tokenizer.get_vocab()[eot]]], None
    plain = tokenizer(eot, add_special_tokens=False)["input_ids"]
    return seqs + ([plain] if plain else []), eot


def _ends_with_end(ids: list[int], offsets: list, text: str, ends: list[list[int]], eot_text: str | None) -> bool:
    n = len(ids)
    while n and offsets[n - 1][0] < offsets[n - 1][1] and text[offsets[n - 1][0]:offsets[n - 1][1]].isspace():
        n -= 1  # trailing whitespace after the end token (ChatML's '\n')
    if any(seq and ids[:n][-len(seq):] == seq for seq in ends):
        return True
    return bool(eot_text and n and not eot_text.isspace() and text[: offsets[n - 1][1]].endswith(eot_text))


def tokenize_example(example: dict, tokenizer, recipe: Recipe, eot: str, fmt: str | None = None,
                     ends: tuple | None = None, where: str = "the example", structs: tuple[bool, bool] = (False, False)) -> dict:
    """One example -> {dataset_text_field: text, input_ids, labels, _bos_removed, _unrendered}. Pure; mapped over the
    dataset. fmt: the example's format (None: read from its keys); where: the row, named by errors."""
    if fmt is None:
        fmt = detect_format(recipe, list(example), "the example")
    text, span_sets, force_eos, unrendered = render(example, fmt, tokenizer, recipe, where, structs)
    special = recipe.data.add_special_tokens
    enc = tokenizer(text, add_special_tokens=special, return_offsets_mapping=True)
    ids, offsets = list(enc["input_ids"]), [tuple(o) for o in enc["offset_mapping"]]
    bos = tokenizer.bos_token_id
    bos_removed = bool(special and bos is not None and ids[:2] == [bos, bos])
    if bos_removed:  # the text already starts with BOS (a template's {{ bos_token }}); the tokenizer added another
        ids, offsets = ids[1:], offsets[1:]
    if (recipe.data.append_concat_token or force_eos) and tokenizer.eos_token_id is not None:
        seqs, eot_text = ends if ends is not None else end_ids(tokenizer, eot)
        if not _ends_with_end(ids, offsets, text, seqs, eot_text):
            ids.append(tokenizer.eos_token_id)
            offsets.append((len(text), len(text)))
    end = len(text)

    def trained(a: int, b: int) -> bool:
        if a == b:  # zero-width: special tokens the tokenizer adds (BOS), or the appended EOS at the very end
            return all(any(s <= a < e or a == e == end for s, e in spans) for spans in span_sets)
        return all(any(a < e and b > s for s, e in spans) for spans in span_sets)

    labels = [t if trained(a, b) else -100 for t, (a, b) in zip(ids, offsets)]
    return {recipe.trl_value("dataset_text_field"): text, "input_ids": ids, "labels": labels, "_bos_removed": bos_removed,
            "_unrendered": unrendered}


def _trainable(labels: list[int]) -> bool:
    """A label the loss uses: position 0 is never predicted (and the packing collator masks it)."""
    return any(label != -100 for label in labels[1:])


def _prepare_row(example: dict, index: int, tokenizer, recipe: Recipe, eot: str, fmt: str, ends: tuple, source: str,
                 rows: list[int] | None, structs: tuple[bool, bool]) -> dict:
    where = f"row {rows[index] if rows is not None else index} of {source}"
    row = tokenize_example(example, tokenizer, recipe, eot, fmt, ends, where, structs)
    max_length = recipe.trl_value("max_length")
    if not _trainable(row["labels"]):
        return {**row, "_status": FULLY_MASKED}
    if max_length is None or len(row["input_ids"]) <= max_length:
        return {**row, "_status": KEPT}
    cut = slice(None, max_length) if recipe.trl_value("truncation_mode") == "keep_start" else slice(-max_length, None)
    ids, labels = row["input_ids"][cut], row["labels"][cut]
    return {**row, "input_ids": ids, "labels": labels, "_status": CUT_KEPT if _trainable(labels) else CUT_AWAY}


def _trained(offsets, span_sets: list, end: int) -> np.ndarray:
    """tokenize_example's rule for every token at once: a token is trained when it overlaps a span of every set; a
    zero-width one (a special token the tokenizer added, the appended EOS) when it lies inside one, or at the very
    end where a span ends."""
    off = np.asarray(offsets, dtype=np.int64).reshape(-1, 2)
    a, b = off[:, :1], off[:, 1:]
    zero = a[:, 0] == b[:, 0]
    mask = np.ones(len(off), dtype=bool)
    for spans in span_sets:
        if not spans:
            return np.zeros(len(off), dtype=bool)
        s, e = np.asarray(spans, dtype=np.int64).reshape(-1, 2).T
        overlaps = ((a < e) & (b > s)).any(axis=1)
        inside = (((s <= a) & (a < e)) | ((a == e) & (e == end))).any(axis=1)
        mask &= np.where(zero, inside, overlaps)
    return mask


def _fast_batch(batch: dict, indices: list[int], tokenizer, recipe: Recipe, eot: str, fmt: str, ends: tuple, source: str,
                rows: list[int] | None, structs: tuple[bool, bool], keep_text: bool = True) -> dict:
    """_prepare_row's columns for a batch of rows: rendered row by row, tokenized in one call, labels with numpy."""
    columns = {c: batch[c] for c in batch}
    texts, span_sets, force_eos, unrendered = [], [], [], []
    for i, index in enumerate(indices):
        where = f"row {rows[index] if rows is not None else index} of {source}"
        text, sets, force, lost = render({c: v[i] for c, v in columns.items()}, fmt, tokenizer, recipe, where, structs, fast=True)
        texts.append(text)
        span_sets.append(sets)
        force_eos.append(force)
        unrendered.append(lost)
    special, eos, bos = recipe.data.add_special_tokens, tokenizer.eos_token_id, tokenizer.bos_token_id
    append = [(recipe.data.append_concat_token or force) and eos is not None for force in force_eos]
    need_offsets = any(append) or any(span_sets)
    all_ids, all_offsets = encode(tokenizer, texts, special, need_offsets)
    seqs, eot_text = ends
    max_length = recipe.trl_value("max_length")
    cut = slice(None, max_length) if recipe.trl_value("truncation_mode") == "keep_start" else slice(-max_length, None) if max_length else None
    out_ids, out_labels, out_bos, out_status = [], [], [], []
    for i, text in enumerate(texts):
        ids = all_ids[i]
        offsets = all_offsets[i] if need_offsets else None
        bos_removed = bool(special and bos is not None and ids[:2] == [bos, bos])
        if bos_removed:
            ids = ids[1:]
            offsets = offsets[1:] if need_offsets else None
        if append[i] and not _ends_with_end(ids, offsets, text, seqs, eot_text):
            ids.append(eos)
            offsets.append((len(text), len(text)))
        if span_sets[i]:
            mask = _trained(offsets, span_sets[i], len(text))
            labels = np.where(mask, ids, -100).tolist()
        else:  # every token trained
            mask, labels = None, ids
        trainable = bool(mask[1:].any()) if mask is not None else len(ids) > 1
        if not trainable:
            status = FULLY_MASKED
        elif max_length is None or len(ids) <= max_length:
            status = KEPT
        else:
            ids, labels = ids[cut], labels[cut]
            kept = bool(mask[cut][1:].any()) if mask is not None else len(ids) > 1
            status = CUT_KEPT if kept else CUT_AWAY
        out_ids.append(ids)
        out_labels.append(labels)
        out_bos.append(bos_removed)
        out_status.append(status)
    return _table(recipe, texts if keep_text else None, out_ids, out_labels, out_bos, unrendered, out_status)


def _table(recipe: Recipe, texts, ids, labels, bos_removed, unrendered, status) -> pa.Table:
    """A batch's columns as an Arrow table, typed as datasets types _prepare_row's (input_ids int32: its writer's
    choice for that column name; its inference of Python lists is the slow part of a batch). texts None: no text
    column."""
    text = {} if texts is None else {recipe.trl_value("dataset_text_field"): pa.array(texts, pa.string())}
    return pa.table({**text, "input_ids": pa.array(ids, pa.list_(pa.int32())), "labels": pa.array(labels, pa.list_(pa.int64())),
                     "_bos_removed": pa.array(bos_removed, pa.bool_()),
                     "_unrendered": pa.array(unrendered, pa.int64()), "_status": pa.array(status, pa.int64())})


def _prepare_batch(batch: dict, indices: list[int], tokenizer, recipe: Recipe, eot: str, fmt: str, ends: tuple, source: str,
                   rows: list[int] | None, structs: tuple[bool, bool], keep_text: bool = True) -> dict:
    """A batch of rows made into _prepare_row's columns; keep_text: with the rendered text's column. A batch that fails
    is prepared again row by row by _prepare_row, whose error (a RecipeError naming the row) is the one raised."""
    return _prepare_batch_rows(batch, indices, tokenizer, recipe, eot, fmt, ends, source, rows, structs, keep_text)


def _prepare_table(table: pa.Table, indices: list[int], features, progress: tuple[str, str] | None = None, **kw) -> pa.Table:
    """A map batch (an Arrow table of MAP_ROWS rows) prepared BATCH_ROWS rows at a time by _prepare_batch, each part
    as datasets hands a batch to a map (its columns to Python, decoded by their features). progress: (the cache entry
    attempt's progress folder, the split): the batch is counted there (prepattempt.batch_done)."""
    out = pa.concat_tables([_prepare_batch(features.decode_batch(table.slice(i, BATCH_ROWS).to_pydict()),
                                           indices[i:i + BATCH_ROWS], **kw) for i in range(0, table.num_rows, BATCH_ROWS)])
    if progress is not None:
        prepattempt.batch_done(*progress, table.num_rows)
    return out


def _prepare_batch_rows(batch: dict, indices: list[int], tokenizer, recipe: Recipe, eot: str, fmt: str, ends: tuple,
                        source: str, rows: list[int] | None, structs: tuple[bool, bool], keep_text: bool) -> dict:
    try:
        return _fast_batch(batch, indices, tokenizer, recipe, eot, fmt, ends, source, rows, structs, keep_text)
    except Exception as fast_error:  # the reference below raises what this batch's rows raise
        columns = list(batch)
        out = [_prepare_row({c: batch[c][i] for c in columns}, index, tokenizer, recipe, eot, fmt, ends, source, rows, structs)
               for i, index in enumerate(indices)]
        log.warning("data: rows %d-%d of %s: the batched preparation failed (%s: %s) where the row-by-row one did not; "
                    "they were prepared row by row", indices[0], indices[-1], source, type(fast_error).__name__, fast_error)
        texts, *columns = ([row[k] for row in out] for k in (recipe.trl_value("dataset_text_field"), "input_ids", "labels",
                                                               "_bos_removed", "_unrendered", "_status"))
        return _table(recipe, texts if keep_text else None, *columns)


def workers(recipe: Recipe, n_rows: int) -> int | None:
    """Processes that prepare a split of n_rows: dataset_num_proc when set, else one per ROWS_PER_WORKER rows, at most
    the usable cores (and MAX_WORKERS); None: this process (datasets starts a pool for any number, 1 included)."""
    asked = recipe.trl_value("dataset_num_proc")
    if asked is not None:
        return asked
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    n = min(cores, MAX_WORKERS, n_rows // ROWS_PER_WORKER)
    return n if n > 1 else None


def check_loss_format(recipe: Recipe, fmt: str, first: dict | None, name: str) -> None:
    """assistant_only_loss needs conversations: one line when the split (its first row: first) is text."""
    if recipe.trl_value("assistant_only_loss") and not (fmt in CONVERSATIONAL or (first is not None and is_conversational(fmt, first))):
        raise RecipeError(f"assistant_only_loss: {name} is {fmt} text, without assistant turns; remove assistant_only_loss"
                          + (" (prompt/completion data trains on the completion only by default)" if fmt == "prompt_completion" else ""))


def tokenize_split(recipe: Recipe, tokenizer, eot: str, dataset, name: str, fmt: str, source: str | None = None,
                   rows: list[int] | None = None):
    """Format, tokenize and cut one split; rows keep a `_status` (KEPT, FULLY_MASKED, CUT_AWAY, CUT_KEPT),
    `_bos_removed` and `_unrendered` until finish_split counts and drops. source: the dataset as errors name it;
    rows: the source row of each row (a mixture's draw), for errors. Under a cache entry's preparation
    (prepattempt.current()) the rows are counted for the waiting processes, written into the attempt's scratch folder
    (never beside a save_to_disk source's files) and without the text column, which the entry does not keep."""
    check_loss_format(recipe, fmt, dataset[0] if len(dataset) else None, name)
    structs = arrow_structs(dataset.features)
    if structs[0]:
        log.info("data: %s: tool-call arguments are stored as an Arrow struct (every argument name of the column in every "
                 "call, null where a call has none): null arguments are dropped; store arguments as JSON strings to keep "
                 "explicit nulls", source or name)
    attempt = prepattempt.current()
    if attempt is not None:
        prepattempt.note_total(attempt.progress, name, len(dataset))
    return dataset.with_format("arrow").map(
        _prepare_table,
        with_indices=True,
        batched=True,
        batch_size=MAP_ROWS,
        writer_batch_size=MAP_ROWS,
        fn_kwargs={"features": dataset.features, "tokenizer": tokenizer, "recipe": recipe, "eot": eot, "fmt": fmt,
                   "ends": end_ids(tokenizer, eot), "source": source or name, "rows": rows, "structs": structs,
                   "progress": (str(attempt.progress), name) if attempt is not None else None, "keep_text": attempt is None},
        remove_columns=dataset.column_names,
        num_proc=workers(recipe, len(dataset)),
        cache_file_name=attempt.scratch_file("tokenized") if attempt is not None else None,
        desc=f"Formatting and tokenizing {name}",
    ).with_format(None)


def count_marks(status, bos_removed, unrendered) -> dict:
    """What the marks of prepared rows (`_status`, `_bos_removed`, `_unrendered` of each) count: read, truncated,
    dropped after the cut, fully masked, kept, duplicate BOS removed, and per field the rows whose template left it
    out. A split's (finish_split) and a streamed buffer's (stream.py)."""
    status = np.asarray(status, dtype=np.int64)
    n = np.bincount(status, minlength=4)
    unrendered = np.asarray(unrendered, dtype=np.int64)
    return {"read": int(len(status)), "truncated": int(n[CUT_AWAY] + n[CUT_KEPT]), "dropped_after_cut": int(n[CUT_AWAY]),
            "fully_masked": int(n[FULLY_MASKED]), "kept": int(n[KEPT] + n[CUT_KEPT]),
            "duplicate_bos_removed": int(np.asarray(bos_removed, dtype=bool).sum()),
            "not_rendered": {field: int(((unrendered & bit) != 0).sum()) for field, bit in NOT_RENDERED.items()}}


def _added(a: dict, b: dict) -> dict:
    return {k: _added(v, b[k]) if isinstance(v, dict) else v + b[k] for k, v in a.items()}


def _is_kept(status) -> np.ndarray:
    return np.isin(np.asarray(status, dtype=np.int64), (KEPT, CUT_KEPT))


def finish_split(recipe: Recipe, dataset, name: str, formats: dict[str, int], is_eval: bool = False,
                 files: dict[str, int] | None = None):  # files: rows read per file format (datafiles.Read.counts)
    """Count what the cut and the masks did, drop samples with nothing to train, log ONE line. Returns
    (dataset with text/input_ids/labels, counts). The marks are read MARK_ROWS rows at a time and the kept rows
    chosen by a filter that writes their indices batch by batch: no pass holds the whole split."""
    marks, attempt = {}, prepattempt.current()
    for part in dataset.select_columns(["_status", "_bos_removed", "_unrendered"]).with_format("numpy").iter(MARK_ROWS):
        now = count_marks(part["_status"], part["_bos_removed"], part["_unrendered"])
        marks = _added(marks, now) if marks else now
        if attempt is not None:  # the pages around the marks' buffers: ~190 KB a record batch of 10,000 rows
            arrowmem.release()
    counts = {**(marks or count_marks([], [], [])), "formats": formats,
              "max_length": recipe.trl_value("max_length"), "truncation_mode": recipe.trl_value("truncation_mode")}
    if counts["read"] == 0:
        raise RecipeError(f"dataset_name: the {name} has no rows; check the data and splits")
    if counts["kept"] == 0:
        if counts["fully_masked"] == counts["read"]:
            if recipe.trl_value("assistant_only_loss"):
                fix = "assistant_only_loss: every {} sample has no assistant token; check the data's roles or set assistant_only_loss: false"
            elif "prompt_completion" in formats:
                fix = "completion_only_loss: every {} completion is empty; check the data, or set completion_only_loss: false"
            else:
                fix = "dataset_name: every {} sample is empty; check the data"
            raise RecipeError(fix.format(name))
        raise RecipeError(
            f"max_length: no {name} sample keeps a trainable token after the cut at {counts['max_length']} "
            f"({counts['truncation_mode']}); raise max_length or set truncation_mode: keep_end"
        )
    scratch = attempt.scratch_file if attempt is not None else None
    if counts["kept"] < counts["read"]:
        dataset = dataset.filter(_is_kept, input_columns=["_status"], batched=True, batch_size=MARK_ROWS, writer_batch_size=MARK_ROWS,
                                 cache_file_name=scratch("kept") if scratch else None, desc=f"Dropping rows of {name}")
    dataset = dataset.remove_columns(["_status", "_bos_removed", "_unrendered"])
    packed = trainrows.packing_counts(recipe, dataset, is_eval, scratch)
    if packed is not None:
        counts["packing"] = packed
    if files:
        counts["files"] = files
    origin = "; " + ", ".join(f"{v} from {k}" for k, v in files.items()) if files else ""
    line = (f"data: {name}: {counts['read']} read ({', '.join(f'{v} {k}' for k, v in formats.items())}{origin}), "
            f"{counts['truncated']} truncated at max_length {counts['max_length']} ({counts['truncation_mode']}), "
            f"{counts['dropped_after_cut']} dropped after the cut (no trainable token left: the answer lay past max_length), "
            f"{counts['fully_masked']} fully masked (no trainable token before any cut, e.g. no assistant turn: dropped), "
            f"{counts['kept']} kept")
    if packed is not None:
        line += (f"; packing {packed['strategy']}: {packed['fully_masked_rows']} of {packed['rows']} packed rows fully masked"
                 if packed["rows"] is not None else f"; packing {packed['strategy']}: every packed row holds whole samples, none fully masked")
    line += describe_not_rendered(counts["not_rendered"], template_key(recipe))
    warn = counts["dropped_after_cut"] or counts["fully_masked"] or (packed or {}).get("fully_masked_rows") or any(counts["not_rendered"].values())
    (log.warning if warn else log.info)("%s", line)
    return dataset, counts


def prepare(recipe: Recipe, tokenizer, eot: str, dataset, name: str, fmt: str | None = None):
    """Format, tokenize and cut one split, then drop what has nothing to train (counts logged). Checks the format
    first, with a one-line error naming the fix."""
    fmt = detect_format(recipe, dataset.column_names, name, fmt or recipe.data.dataset_format)
    check_template(recipe, fmt, "dataset_name", dataset[0] if len(dataset) else None)
    out, counts = finish_split(recipe, tokenize_split(recipe, tokenizer, eot, dataset, name, fmt), name, {fmt: len(dataset)})
    log_bos(tokenizer, counts["duplicate_bos_removed"])
    return out


def log_bos(tokenizer, removed: int) -> None:
    if removed:
        log.info("add_special_tokens: %d samples already started with BOS %s (the chat template writes it); the second "
                 "BOS the tokenizer added was removed — set add_special_tokens: false to tokenize them as they are",
                 removed, tokenizer.bos_token)

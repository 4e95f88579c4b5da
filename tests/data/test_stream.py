"""Streamed training data (`streaming: true`, sftrecipes/data/stream.py): the rows a stream gives are the rows the prepared
split holds (every data format, cuts, masks, drops and counts), a stream resumed from any position a checkpoint
records gives the very rows the uninterrupted stream gives next (unpacked and every packing strategy, across
buffers and data epochs, through the JSON file), and a checkpoint of another stream is refused in one line. A row the
stream cannot read ends it on a whole step; the checkpoint saved there resumes on the repaired data (the rows it
stands on read the same: one line says what changed), and is refused in one line saying what differs where they do
not.
Training through it, killed, preempted and resumed to the uninterrupted weights: tests/run/test_resume.py (ddp-stream);
on another process count: tests/run/test_faults.py."""

import itertools
import logging
import os
import types

import pytest
from test_prep_fast import AOL, CHATML, CUT, SHAPES, _no_map_cache, setup  # noqa: F401 - autouse: every map prepares

from sftrecipes.data import load as data
from sftrecipes.data import stream as streams
from sftrecipes.core.errors import RecipeError
from sftrecipes.recipe.load import load_recipe
from sftrecipes.data.tokenizer import load_tokenizer

ONE = types.SimpleNamespace(per_device_train_batch_size=1, gradient_accumulation_steps=1, world_size=1)  # 1 row a step


def first_epoch(stream) -> tuple[list[dict], dict]:
    """The rows of data epoch 0 and their counts: read into epoch 1, whose first buffer's counts_before are epoch 0's."""
    stream.keep_rows = 10**9  # every buffer stays in the history
    rows = []
    for row in stream.rows():
        if stream.epoch == 1:
            break
        rows.append(row)
    second = next(b for b in stream.history if b.epoch == 1 and b.buffer == 0)
    assert len(rows) == second.first
    return rows, second.counts_before


def pairs(input_ids, labels) -> list[tuple]:
    return sorted(zip(map(tuple, input_ids), map(tuple, labels)))


@pytest.mark.parametrize("shape", list(SHAPES))
def test_a_streams_rows_and_counts_are_the_prepared_splits(tiny_model, tmp_path, shape):
    """Unpacked, one data epoch in buffers of 5-7 rows (the last one short): the same (input_ids, labels) rows as the
    prepared split, and the same counts (read, cut, dropped, masked, kept, fields the template left out)."""
    rows = SHAPES[shape]
    conversational = shape in ("messages", "conversations", "pc_chat", "tools")
    buffer = next(b for b in (5, 6, 7) if len(rows) % b)  # several buffers, the last one short
    flags = ["--packing", "false", "--streaming_buffer_rows", str(buffer), *CUT, *(AOL if conversational else ())]
    r, tok, eot, *_ = setup(tmp_path, rows, [*CHATML, "--streaming", "true", "--max_steps", "5", *flags])
    prepared, _, _, counts = data.load_datasets(r, tok, eot)
    stream, *_ = streams.streamed_datasets(r, tok, eot)
    got, got_counts = first_epoch(stream)
    assert len(got) == counts["train"]["kept"] > 0
    assert pairs([g["input_ids"] for g in got], [g["labels"] for g in got]) == pairs(prepared["input_ids"], prepared["labels"])
    for key in ("read", "truncated", "dropped_after_cut", "fully_masked", "kept", "duplicate_bos_removed", "not_rendered"):
        assert got_counts[key] == counts["train"][key], key
    assert got_counts["read"] == len(rows)
    if shape == "messages":  # the case shows what it compares: cuts, drops and masks happened
        assert got_counts["truncated"] and got_counts["fully_masked"] and got_counts["dropped_after_cut"]


@pytest.mark.parametrize("packing", ["false", "bfd", "bfd_split", "wrapped"])
def test_a_stream_resumed_anywhere_gives_the_rows_the_uninterrupted_one_gives(tiny_model, tmp_path, packing):
    """data/tiny_chat (320 rows) in buffers of 48, over three data epochs; resumed through stream_position.json at the
    start, inside the first buffer, at a buffer's end, at the end of a data epoch and deep in the third: the next rows
    are the uninterrupted stream's, and the counts go on from the checkpoint's. Each data epoch is shuffled anew."""
    flags = ["--packing", "false"] if packing == "false" else ["--packing", "true", "--packing_strategy", packing]
    r = load_recipe(["recipes/tiny/lora.yaml", "--streaming", "true", "--streaming_buffer_rows", "48", "--max_length", "96",
                     "--output_dir", str(tmp_path / "o"), *flags])
    tok, eot, _ = load_tokenizer(r)
    stream, *_ = streams.streamed_datasets(r, tok, eot)
    stream.keep_rows = 10**9  # keep every buffer: any position can be asked for
    rows, epoch_starts = [], []
    for row in stream.rows():
        if stream.epoch == 3:
            break
        if stream.epoch > len(epoch_starts) - 1:
            epoch_starts.append(stream.history[-1].first)
        rows.append(row)
    assert len(epoch_starts) == 3 and all(r2["input_ids"] for r2 in rows)
    first_buffer = stream.history[0].rows
    epoch0, epoch1 = rows[epoch_starts[0]:epoch_starts[1]], rows[epoch_starts[1]:epoch_starts[2]]
    assert epoch0[:20] != epoch1[:20]  # shuffled anew
    if packing == "false":  # the same rows in another order
        assert pairs(*zip(*((x["input_ids"], x["labels"]) for x in epoch0))) == pairs(*zip(*((x["input_ids"], x["labels"]) for x in epoch1)))
    for at in (0, 3, first_buffer, epoch_starts[1], epoch_starts[2] + 11, len(rows) - 4):
        folder = tmp_path / f"checkpoint-{at}"
        folder.mkdir()
        stream.save(folder, at, ONE)  # rows per step 1 from step 0: `at` rows trained on
        resumed, *_ = streams.streamed_datasets(r, tok, eot, resume_from=str(folder))
        resumed.keep_rows = 10**9
        want = rows[at:at + 30]
        assert len(want) >= 4 and list(itertools.islice(resumed.rows(), len(want))) == want, (packing, at)
        before = next(b for b in reversed(stream.history) if b.first <= at)
        assert resumed.history[0].counts_before == before.counts_before
        assert resumed.consumed(at + 2, ONE) == at + 2  # (its step count goes on from the checkpoint's)


def test_a_checkpoint_of_another_stream_is_refused_in_one_line(tiny_model, tmp_path):
    r = load_recipe(["recipes/tiny/lora.yaml", "--streaming", "true", "--streaming_buffer_rows", "48",
                     "--output_dir", str(tmp_path / "o")])
    tok, eot, _ = load_tokenizer(r)
    stream, *_ = streams.streamed_datasets(r, tok, eot)
    list(itertools.islice(stream.rows(), 10))
    ckpt = tmp_path / "checkpoint-10"
    ckpt.mkdir()
    with pytest.raises(RecipeError, match=r"^streaming: checkpoint-10 has no stream_position.json .* resume with streaming: false"):
        streams.read_position(str(ckpt))
    stream.save(ckpt, 10, ONE)
    for flags, pattern in ((["--streaming_buffer_rows", "64"], r"^streaming_buffer_rows: checkpoint-10 was streamed with buffer_rows 48, this run has 64; resume with 48"),
                           (["--seed", "7"], r"^seed: checkpoint-10 was streamed with seed 42, this run has 7"),
                           (["--dataset_name", str(tmp_path / "other.jsonl"), "--splits", "train"],
                            r"^dataset_name: checkpoint-10 streamed data/tiny_chat \(train\), this run streams .*other.jsonl \(train\); "
                            r"resume with dataset_name data/tiny_chat, or start a new output_dir$")):
        (tmp_path / "other.jsonl").write_text((open("data/tiny_chat/train.jsonl").read()))  # same rows, another source
        other = load_recipe(["recipes/tiny/lora.yaml", "--streaming", "true", "--streaming_buffer_rows", "48",
                             "--output_dir", str(tmp_path / "o"), *flags])
        with pytest.raises(RecipeError, match=pattern):
            streams.streamed_datasets(other, tok, eot, resume_from=str(ckpt))


def test_a_stream_cut_short_by_a_bad_line_resumes_where_it_stopped_once_the_file_is_repaired(tiny_model, tmp_path, caplog):
    """train-1.jsonl's last line cut mid-string: the stream ends after 88 rows (11 steps of 8, 2 rows read past them
    not given); a checkpoint there, the line completed: the resumed stream gives the rows a stream of the repaired
    data gives from row 88, with one line saying what changed; saved again inside that first buffer and resumed, the
    same again. train-0.jsonl changed instead (a letter, its size and time kept; its first line gone): refused, naming
    its content's digest, then its size, before and after."""
    folder = tmp_path / "cut"
    folder.mkdir()
    rows = list(open("data/tiny_chat/train.jsonl"))  # its lines, each with its newline
    (folder / "train-0.jsonl").write_text("".join(rows[:100]))
    (folder / "train-1.jsonl").write_text("".join(rows[100:150]) + rows[150][:40])
    r = load_recipe(["recipes/tiny/lora.yaml", "--dataset_name", str(folder), "--splits", "train", "--streaming", "true",
                     "--streaming_buffer_rows", "30", "--packing", "false", "--output_dir", str(tmp_path / "o")])
    tok, eot, _ = load_tokenizer(r)
    eight = types.SimpleNamespace(per_device_train_batch_size=8, gradient_accumulation_steps=1, world_size=1)
    stream, *_ = streams.streamed_datasets(r, tok, eot)
    stream.dataset(8)
    given = list(stream.rows())
    assert len(given) == 88 and stream.counts["read"] == 90 and "train-1.jsonl line 51 cannot be read" in str(stream.failure)
    ckpt = tmp_path / "checkpoint-11"
    ckpt.mkdir()
    stream.save(ckpt, 11, eight)
    before = (folder / "train-1.jsonl").stat().st_size
    (folder / "train-1.jsonl").write_text("".join(rows[100:151]))  # the line completed
    fresh, *_ = streams.streamed_datasets(r, tok, eot)
    want = list(itertools.islice(fresh.rows(), 88 + 40))
    assert want[:88] == given
    with caplog.at_level(logging.INFO, logger="sftrecipes"):
        resumed, *_ = streams.streamed_datasets(r, tok, eot, resume_from=str(ckpt))
    assert (f"changed since checkpoint-11 was saved (train-1.jsonl: size {before} -> {(folder / 'train-1.jsonl').stat().st_size} "
            "bytes, modified ") in caplog.text
    assert "the 90 rows it stands on (data epoch 0, buffers 0-2) read the same, so the stream goes on from its position" in caplog.text
    resumed.keep_rows = 10**9
    assert list(itertools.islice(resumed.rows(), 40)) == want[88:]
    again = tmp_path / "checkpoint-12"
    again.mkdir()
    resumed.save(again, 12, ONE)  # one row on from checkpoint-11's 88, still inside the buffer it resumed in
    twice, *_ = streams.streamed_datasets(r, tok, eot, resume_from=str(again))
    assert list(itertools.islice(twice.rows(), 39)) == want[89:]
    first = folder / "train-0.jsonl"  # a letter changed, the size and time kept: named by its content's digest
    st = first.stat()
    first.write_text(first.read_text().replace("plum", "plun", 1))
    os.utime(first, ns=(st.st_atime_ns, st.st_mtime_ns))
    with pytest.raises(RecipeError, match=r"^dataset_name: .* changed since checkpoint-11 was saved \(train-0.jsonl: content "
                       r"sha256 [0-9a-f]{12} -> [0-9a-f]{12} \(same size and time\); .*no longer read the same"):
        streams.streamed_datasets(r, tok, eot, resume_from=str(ckpt))
    size = (folder / "train-0.jsonl").stat().st_size
    (folder / "train-0.jsonl").write_text("".join(rows[1:100]))
    with pytest.raises(RecipeError, match=rf"^dataset_name: {folder} changed since checkpoint-11 was saved \(train-0.jsonl: "
                       rf"size {size} -> {size - len(rows[0])} bytes, modified .*; train-1.jsonl: size {before} -> .*\), and the "
                       r"\d+ rows it stands on \(data epoch 0, buffers 0-2\) no longer read the same: resuming would skip or "
                       r"repeat rows; restore the data as checkpoint-11 read it, or train on the data as it is now from a "
                       r"new output_dir$"):
        streams.streamed_datasets(r, tok, eot, resume_from=str(ckpt))

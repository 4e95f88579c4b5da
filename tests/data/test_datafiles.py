"""Local data files (sftrecipes/data/datafiles.py, badrows.py): every file of a folder's split is read whatever its format,
prepared or streamed, and counted per format on the data line and in the counts; the splits are the ones datasets
names from the file names, with the files it leaves out counted in one line; a mix that cannot be read together is
refused in one line naming what it holds; a split the source lacks is refused before anything is read; a row that
cannot be parsed is named by its file and its own 1-based line. No training: the data functions are called as
train.py and `prepare` call them (the streamed end of a run, and its resume: tests/data/test_stream.py, test_resume.py)."""

import json
import logging
import shutil

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from test_stream import first_epoch, pairs

from sftrecipes.data import load as data
from sftrecipes.data import stream as streams
from sftrecipes.core.errors import RecipeError
from sftrecipes.recipe.load import load_recipe
from sftrecipes.data.tokenizer import load_tokenizer

ROWS = [json.loads(line) for line in open("data/tiny_chat/train.jsonl")]
TEST = [json.loads(line) for line in open("data/tiny_chat/test.jsonl")]


def jsonl(path, rows, reorder=False) -> None:
    """rows as JSON lines; reorder: each message's keys as content, role (parquet below keeps role, content)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if reorder:
        rows = [{"messages": [{"content": m["content"], "role": m["role"]} for m in r["messages"]]} for r in rows]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def parquet(path, rows) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)


def recipe(tmp_path, source, *flags):
    return load_recipe(["recipes/tiny/lora.yaml", "--dataset_name", str(source), "--output_dir", str(tmp_path / "o"), *flags])


def test_a_mixed_folder_is_read_whole_prepared_or_streamed_and_counted_per_format(tiny_model, tmp_path, caplog):
    """part-0.parquet and part-1.jsonl (the user's folder, at 320 rows each; its structs' fields in the other order):
    both are read, the data line and the counts say 320 from each; the stream gives the very rows the prepared split
    holds over one data epoch, and counts them per format too."""
    folder = tmp_path / "mixed"
    parquet(folder / "part-0.parquet", ROWS)
    jsonl(folder / "part-1.jsonl", ROWS, reorder=True)
    r = recipe(tmp_path, folder, "--splits", "train", "--packing", "false")
    tok, eot, _ = load_tokenizer(r)
    with caplog.at_level(logging.INFO, logger="sftrecipes"):
        train, _, _, counts = data.load_datasets(r, tok, eot)
    assert counts["train"]["files"] == {"parquet": 320, "jsonl": 320} and counts["train"]["read"] == 640
    assert "data: train split: 640 read (640 messages; 320 from parquet, 320 from jsonl)" in caplog.text
    assert len(train) == 640
    streamed = recipe(tmp_path, folder, "--splits", "train", "--packing", "false", "--streaming", "true",
                      "--streaming_buffer_rows", "100", "--max_steps", "5")
    stream, *_ = streams.streamed_datasets(streamed, tok, eot)
    rows, got = first_epoch(stream)
    assert got["files"] == {"parquet": 320, "jsonl": 320} and got["read"] == 640
    assert pairs([g["input_ids"] for g in rows], [g["labels"] for g in rows]) == pairs(train["input_ids"], train["labels"])


def test_splits_are_named_as_datasets_names_them_and_files_in_none_are_counted(tmp_path, caplog):
    """train-extra.parquet + train.jsonl make the train split, in that (sorted) order (datasets alone reads the parquet
    one only: a tie goes to parquet), test.jsonl the test split; a README, a hidden file and extra.jsonl (no split's name) are not read,
    the last counted in one warning; a data/ folder of train shards in two formats is read whole too."""
    folder = tmp_path / "named"
    jsonl(folder / "train.jsonl", ROWS[:100])
    parquet(folder / "train-extra.parquet", ROWS[100:130])
    jsonl(folder / "test.jsonl", TEST[:7])
    jsonl(folder / "extra.jsonl", ROWS[:3])
    jsonl(folder / ".hidden.jsonl", ROWS[:3])
    (folder / "README.md").write_text("# my data\n")
    with caplog.at_level(logging.INFO, logger="sftrecipes"):
        train, evals = data.load_raw(recipe(tmp_path, folder, "--splits", "train,test"))
    assert len(train) == 130 and train[0] == ROWS[100] and train[30] == ROWS[0] and len(evals) == 7  # files as sorted
    assert "1 file in no split, not read (extra.jsonl)" in caplog.text and ".hidden" not in caplog.text
    shards = tmp_path / "shards"
    parquet(shards / "data" / "train-00000-of-00002.parquet", ROWS[:50])
    jsonl(shards / "data" / "train-00001-of-00002.jsonl", ROWS[50:80])
    got = data.read_source(data.sources(recipe(tmp_path, shards, "--splits", "train"))[0], "train")
    assert len(got.dataset) == 80 and got.counts() == {"parquet": 50, "jsonl": 30}


@pytest.mark.parametrize("streaming", [False, True])
def test_a_folder_whose_files_cannot_be_read_together_is_refused_in_one_line(tmp_path, streaming):
    flags = ["--splits", "train"] + (["--streaming", "true", "--max_steps", "5"] if streaming else [])

    def refused(folder, pattern):
        src = data.sources(recipe(tmp_path, folder, *flags))[0]
        with pytest.raises(RecipeError, match=pattern) as e:
            got = data.read_source(src, "train", streaming=streaming)
            next(got.dataset.iter(batch_size=1))
        assert "\n" not in str(e.value)

    odd = tmp_path / "odd"
    jsonl(odd / "a.jsonl", ROWS[:5])
    (odd / "notes.txt").write_text("read me\n")
    refused(odd, r"^dataset_name: the train split of '.*odd' holds 1 jsonl, 1 txt files \(notes.txt cannot be read with "
                 r"the others\).*move the other files out of the folder")
    cols = tmp_path / "cols"
    parquet(cols / "a.parquet", ROWS[:5])
    jsonl(cols / "b.jsonl", [{"prompt": "Q", "completion": "A"}] * 5)
    refused(cols, r"^dataset_name: the train split of '.*cols' mixes files whose columns differ: a.parquet has messages; "
                  r"b.jsonl has prompt, completion; give every file of the split the same columns")
    types = tmp_path / "types"
    parquet(types / "a.parquet", ROWS[:5])
    jsonl(types / "b.jsonl", [{"messages": "just text"}] * 5)
    refused(types, r"^dataset_name: the train split of '.*types' mixes files whose columns cannot be combined: 'messages' "
                   r"is List\(.*\) in a.parquet and Value\('string'\) in b.jsonl")


def test_a_split_the_source_lacks_is_refused_before_anything_is_read(tiny_model, tmp_path, monkeypatch):
    """splits: train,test on one file, or a folder without a test split: one line, and datasets never asked to read
    (it used to convert the whole train split first: 21 s for 1.2 GB)."""
    tok, eot, _ = load_tokenizer(recipe(tmp_path, "data/tiny_chat"))
    def no_read(*args, **kwargs):
        raise AssertionError("datasets was asked to read before the split check")

    monkeypatch.setattr(datasets, "load_dataset", no_read)
    monkeypatch.setattr(datasets, "load_from_disk", no_read)
    one = tmp_path / "one.jsonl"
    jsonl(one, ROWS[:5])
    folder = tmp_path / "train-only"
    jsonl(folder / "train.jsonl", ROWS[:5])
    saved = tmp_path / "saved"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS[:5])}).save_to_disk(str(saved))
    cases = ((one, "train,test", r"^splits: 'test' asked of the single file '.*one.jsonl', which is one 'train' split"),
             (folder, "train,validation", r"^splits: 'validation' not found in the folder '.*train-only' \(its files "
                                          r"make the split train: .*\); fix splits, or add the validation files"),
             (saved, "train,test", r"^splits: 'test' not in '.*saved' \(has train\); fix splits"))
    for source, splits, pattern in cases:
        for streaming in (False, True):
            r = recipe(tmp_path, source, "--splits", splits, *(["--streaming", "true", "--max_steps", "5"] if streaming else []))
            with pytest.raises(RecipeError, match=pattern):
                data.load_raw(r) if not streaming else streams.Stream(r, tok, eot)


def _cut(path, rows, keep=40) -> None:
    """rows as JSON lines, the last one cut after `keep` characters (a copy interrupted mid-string)."""
    jsonl(path, rows)
    with open(path, "a") as f:
        f.write(json.dumps(rows[0])[:keep])


def test_a_row_that_cannot_be_parsed_is_named_by_its_file_and_line(tmp_path):
    """The line is the file's own (1-based, blank lines counted), not the row of a reader's chunk: 11 MB of JSON lines
    (two of datasets' 10 MB chunks) whose last line is cut is line 60001 (pyarrow says 'row 5184'); and in each
    format the first row that cannot be read: the second file of a folder, a value of a type the rows before cannot
    take, a csv record with a field too many, a JSON document's syntax error, bytes that are not UTF-8, a damaged
    parquet file."""
    big = tmp_path / "big.jsonl"
    _cut(big, (ROWS * 188)[:60000])
    assert big.stat().st_size > 10 << 20
    cases = {big: r"^dataset_name: .*big.jsonl line 60001 cannot be read \(not valid JSON: Unterminated string starting "
                  r"at \(column 34\)\); fix or remove that line$"}
    folder = tmp_path / "folder"
    jsonl(folder / "train-0.jsonl", ROWS[:10])
    (folder / "train-1.jsonl").write_text(json.dumps(ROWS[0]) + "\n\n" + "{not json}\n")
    cases[folder] = r"^dataset_name: .*folder/train-1.jsonl line 3 cannot be read \(not valid JSON: Expecting property name"
    clash = tmp_path / "clash.jsonl"  # a value of a type the rows of the first chunk cannot take, in the second one
    jsonl(clash, (ROWS * 188)[:60000] + [{"messages": {"role": "user"}}])
    cases[clash] = r"^dataset_name: .*clash.jsonl line 60001 cannot be read \('messages' is an object where line 1 has an array\)"
    table = tmp_path / "table.csv"
    table.write_text("prompt,completion\nQ1,A1\nQ2,A2\n\"Q3\",A3,extra\n")
    cases[table] = r"^dataset_name: .*table.csv line 4 cannot be read \(3 fields where the header has 2\)"
    doc = tmp_path / "doc.json"
    doc.write_text('[\n {"prompt": "Q1", "completion": "A1"},\n {"prompt": "Q2" "completion": "A2"}\n]\n')
    cases[doc] = r"^dataset_name: .*doc.json line 3 cannot be read \(not valid JSON: Expecting ',' delimiter"
    damaged = tmp_path / "damaged"
    parquet(damaged / "a.parquet", ROWS[:5])
    shutil.copy(damaged / "a.parquet", damaged / "b.parquet")
    (damaged / "b.parquet").write_bytes((damaged / "b.parquet").read_bytes()[:-20])
    cases[damaged] = r"^dataset_name: .*damaged/b.parquet cannot be read \(not a readable parquet file: .*\); replace the file"
    for source, pattern in cases.items():
        with pytest.raises(RecipeError, match=pattern):
            data.load_raw(recipe(tmp_path, source, "--splits", "train"))
    from sftrecipes.data import badrows

    latin = tmp_path / "latin.jsonl"  # (the locator alone: a recipe naming it fails in images.py's check first)
    latin.write_bytes(b'{"prompt": "Q", "completion": "A"}\n{"prompt": "caf\xe9", "completion": "A"}\n')
    assert badrows.locate("json", [str(latin)]) == (str(latin), 2, "not UTF-8: byte b'\\xe9' at column 16")


def test_the_stream_names_the_row_it_cannot_parse_and_ends_on_a_whole_step(tiny_model, tmp_path):
    """Streamed, the same line (the failure is met as the stream reads, here in the folder's second file); the rows
    given end at the last multiple of the rows a step takes (8) that the rows read cover, never mid-step; a stream
    that cannot give one step's rows is refused when the trainer's dataset is made, before the model loads."""
    folder = tmp_path / "cut"
    jsonl(folder / "train-0.jsonl", ROWS[:100])
    _cut(folder / "train-1.jsonl", ROWS[100:150])
    r = recipe(tmp_path, folder, "--splits", "train", "--streaming", "true", "--streaming_buffer_rows", "30",
               "--packing", "false", "--max_steps", "5")
    tok, eot, _ = load_tokenizer(r)
    stream, *_ = streams.streamed_datasets(r, tok, eot)
    stream.dataset(8)
    rows = list(stream.rows())
    assert str(stream.failure).startswith(f"dataset_name: {folder}/train-1.jsonl line 51 cannot be read (not valid JSON")
    assert len(rows) % 8 == 0 and 0 < stream.counts["kept"] - len(rows) < 8, (len(rows), stream.counts)
    jsonl(folder / "train-0.jsonl", ROWS[:5])  # fewer rows than one step before the cut line: refused before training
    short, *_ = streams.streamed_datasets(r, tok, eot)
    with pytest.raises(RecipeError, match=r"^dataset_name: .*cut/train-1.jsonl line 51 cannot be read \(not valid JSON"):
        short.dataset(8)

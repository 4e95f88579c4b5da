"""Prepared data kept once per inputs that shape its rows (sftrecipes/data/prepkey.py, prepcache.py): the key, reuse, `prepare`, and
processes that wait on the preparer's files instead of a collective (a preparation longer than ddp_timeout; an error
in it reaching every rank as exit 2)."""

import dataclasses
import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import datasets
import pytest

import conftest
from conftest import ROOT, accelerate_launch, free_port, run_cli
from sftrecipes.data import prepattempt
from sftrecipes.data import prepcache
from sftrecipes.data import prepkey
from sftrecipes.recipe import sources
from sftrecipes.core.errors import RecipeError
from sftrecipes.recipe.load import load_recipe
from sftrecipes.recipe.schema import DataOptions
from sftrecipes.tiny import ensure_family
from sftrecipes.data.tokenizer import load_tokenizer

BASE = ["recipes/tiny/lora.yaml", "--output_dir", "outputs/prepcache"]  # chatml, packing (bfd), max_length 256, seed 42
MIXTURE = ["--dataset_name", "null", "--datasets", json.dumps([{"path": "data/tiny_chat", "samples": 7}])]
WRAPPED = ["--packing_strategy", "wrapped"]
HELD = ["--splits", "train", "--val_set_size", "0.1"]


def key_of(*flags) -> str:
    r = load_recipe(BASE + [str(f) for f in flags])
    tok, eot, _ = load_tokenizer(r)
    return prepkey.entry_key(prepkey.key_inputs(r, tok, eot))


def _template(tmp: Path) -> Path:
    f = tmp / "t.jinja"
    f.write_text("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}")
    return f


# Each recipe key that shapes the prepared rows -> (base flags, changed flags): the key must change. Every KEYED,
# VIA_SOURCES and VIA_TOKENIZER key is here (trust_remote_code acts through the tokenizer it loads, whose state is
# hashed: the tiny tokenizer has no code of its own to run).
SHAPING = {
    "dataset_name": ([], ["--dataset_name", "data/tiny_chat/test.jsonl", "--splits", "train"]),
    "splits": ([], ["--splits", "train"]),
    "dataset_format": ([], ["--dataset_format", "messages"]),
    "datasets": (MIXTURE, ["--dataset_name", "null", "--datasets", json.dumps([{"path": "data/tiny_chat", "samples": 8}])]),
    "datasets weight": (MIXTURE, ["--dataset_name", "null", "--datasets", json.dumps([{"path": "data/tiny_chat", "weight": 0.5}])]),
    "datasets columns": (MIXTURE, ["--dataset_name", "null", "--datasets", json.dumps(
        [{"path": "data/tiny_chat", "samples": 7, "columns": {"messages": "conversations"}}])]),
    "datasets format": (MIXTURE, ["--dataset_name", "null", "--datasets", json.dumps([{"path": "data/tiny_chat", "samples": 7, "format": "messages"}])]),
    "datasets split": (MIXTURE, ["--dataset_name", "null", "--datasets", json.dumps([{"path": "data/tiny_chat", "samples": 7, "split": "test"}])]),
    "datasets eval_split": (MIXTURE, ["--dataset_name", "null", "--datasets", json.dumps([{"path": "data/tiny_chat", "samples": 7, "eval_split": None}])]),
    "add_special_tokens": ([], ["--add_special_tokens", "True"]),
    "append_concat_token": ([], ["--append_concat_token", "True"]),
    "dataset_text_field": ([], ["--dataset_text_field", "body"]),
    "assistant_only_loss": ([], ["--assistant_only_loss", "True"]),
    "completion_only_loss": ([], ["--completion_only_loss", "False"]),
    "max_length": ([], ["--max_length", "64"]),
    "truncation_mode": ([], ["--truncation_mode", "keep_end"]),
    "chat_template_format": ([], ["--chat_template_format", "zephyr"]),
    "chat_template_path": (["--chat_template_format", "tokenizer"], ["--chat_template_format", "tokenizer", "--chat_template_path", "TEMPLATE"]),
    "eos_token": ([], ["--eos_token", "</s>"]),
    "pad_token": ([], ["--pad_token", "<unk>"]),
    "packing": ([], ["--packing", "False"]),
    "eval_packing": ([], ["--eval_packing", "True"]),
    "packing_strategy": ([], WRAPPED),
    "shuffle_dataset": (WRAPPED, [*WRAPPED, "--shuffle_dataset", "True"]),
    "shuffle_dataset bfd": ([], ["--shuffle_dataset", "True"]),  # the entry holds the rows shuffled as TRL would
    "seed shuffled": (["--shuffle_dataset", "True"], ["--shuffle_dataset", "True", "--seed", "7"]),
    "seed": (MIXTURE, [*MIXTURE, "--seed", "7"]),
    "seed wrapped": ([*WRAPPED, "--shuffle_dataset", "True"], [*WRAPPED, "--shuffle_dataset", "True", "--seed", "7"]),
    "model_name_or_path": ([], ["--model_name_or_path", "QWEN2"]),
    "tokenizer_name_or_path": ([], ["--tokenizer_name_or_path", "QWEN2"]),
    # val_set_size (recipe/valset.py): its value, and the seed its rows are drawn under (data_seed where set, else seed)
    "val_set_size": (["--splits", "train"], HELD),
    "val_set_size rows": (HELD, ["--splits", "train", "--val_set_size", "32"]),
    "seed held out": (HELD, [*HELD, "--seed", "7"]),
    "data_seed": (HELD, [*HELD, "--data_seed", "7"]),
}
# Keys that do not shape the rows -> flags: the key must stay.
NEUTRAL = {
    "learning_rate": ["--learning_rate", "0.5"], "output_dir": ["--output_dir", "outputs/elsewhere"], "lora_r": ["--lora_r", "4"],
    "max_steps": ["--max_steps", "3"], "logging_steps": ["--logging_steps", "1"], "dataset_num_proc": ["--dataset_num_proc", "2"],
    "eval_strategy": ["--eval_strategy", "steps"], "seed": ["--seed", "7"],  # no mixture, bfd packing: the seed draws nothing
    "data_cache_dir": ["--data_cache_dir", "/tmp/elsewhere"], "padding_free": ["--padding_free", "True"],
    "pad_to_multiple_of": ["--pad_to_multiple_of", "8"], "heartbeat_timeout": ["--heartbeat_timeout", "30"],
    "ddp_timeout": ["--ddp_timeout", "5"], "tokenizer_name_or_path": ["--tokenizer_name_or_path", "COPY"],  # the same files elsewhere
    "data_seed": ["--data_seed", "7"],  # the sampler's seed: it draws rows into the entry only with val_set_size
}


def test_every_data_key_is_classified_and_every_shaping_one_varied():
    """A DataOptions key or TRL data key (sources.TRL_DATA_KEYS) that nobody placed in or out of the key fails here;
    so does a shaping key without a variation below."""
    data_keys = {f.name for f in dataclasses.fields(DataOptions)} | set(sources.TRL_DATA_KEYS)
    placed = set(prepkey.KEYED) | set(prepkey.VIA_SOURCES) | set(prepkey.VIA_TOKENIZER) | set(prepkey.NOT_KEYED)
    assert data_keys <= placed, f"not placed in or out of the cache key: {sorted(data_keys - placed)}"
    assert not (set(prepkey.KEYED) | set(prepkey.VIA_SOURCES) | set(prepkey.VIA_TOKENIZER)) & set(prepkey.NOT_KEYED)
    shaping = {name.split()[0] for name in SHAPING}
    assert (set(prepkey.KEYED) | set(prepkey.VIA_SOURCES) | set(prepkey.VIA_TOKENIZER)) - {"trust_remote_code"} <= shaping
    assert set(prepkey.recipe_inputs(load_recipe(BASE))) == set(prepkey.KEYED) | {"dataset_text_field_explicit"}


def _fill(flags, tmp_path):
    out = []
    for f in flags:
        if f == "TEMPLATE":
            f = str(_template(tmp_path))
        elif f == "QWEN2":
            f = str(ensure_family("qwen2"))
        elif f == "COPY":
            f = tmp_path / "copy"
            if not f.exists():
                f.mkdir()
                for name in os.listdir(".assets/tiny-llama"):
                    if "token" in name or "template" in name or name == "config.json":
                        shutil.copy(Path(".assets/tiny-llama") / name, f / name)
            f = str(f)
        out.append(f)
    return out


def test_the_key_changes_with_every_input_that_shapes_rows(tiny_model, tmp_path):
    for name, (base, changed) in SHAPING.items():
        assert key_of(*_fill(base, tmp_path)) != key_of(*_fill(changed, tmp_path)), f"{name}: the key ignored it"


def test_the_key_stays_for_keys_that_shape_nothing(tiny_model, tmp_path):
    same = key_of()
    for name, flags in NEUTRAL.items():
        assert key_of(*_fill(flags, tmp_path)) == same, f"{name}: changed the key, but shapes no row"


def test_the_key_follows_the_data_content_not_its_timestamps(tiny_model, tmp_path):
    f = tmp_path / "d.jsonl"
    rows = (ROOT / "data/tiny_chat/test.jsonl").read_text()
    f.write_text(rows)
    flags = ["--dataset_name", str(f), "--splits", "train"]
    first = key_of(*flags)
    os.utime(f, (time.time() + 100, time.time() + 100))  # touched, same bytes
    assert key_of(*flags) == first
    f.write_text(rows.replace("plus", "and", 1))  # one word of one row
    assert key_of(*flags) != first
    d = tmp_path / "saved"  # a save_to_disk folder: its files (state.json: the fingerprint), not the map caches beside them
    datasets.Dataset.from_list([{"text": "a b"}]).save_to_disk(str(d))
    saved = key_of("--dataset_name", str(d), "--splits", "train")
    (d / "cache-0123456789abcdef.arrow").write_bytes(b"a map's cache")
    assert key_of("--dataset_name", str(d), "--splits", "train") == saved
    datasets.Dataset.from_list([{"text": "a c"}]).save_to_disk(str(tmp_path / "saved2"))
    shutil.rmtree(d)
    shutil.move(tmp_path / "saved2", d)
    assert key_of("--dataset_name", str(d), "--splits", "train") != saved


# ------------------------------------------------------------------------------------------ waiting on files
# In-process: a stand-in preparer (a lock and a heartbeat written here) and the real waiting code.


@pytest.fixture(scope="module")
def tok_eot(tiny_model):
    tok, eot, _ = load_tokenizer(load_recipe(BASE))
    return tok, eot


def _entry(tmp_path, tok_eot, host="node-elsewhere", pid=4242, beat_age=0.0):
    """A recipe whose waiting bound is 1 s, and its entry held by a stand-in preparer."""
    r = load_recipe(BASE + ["--data_cache_dir", str(tmp_path / "cache"), "--heartbeat_timeout", "1"])
    key = prepkey.entry_key(prepkey.key_inputs(r, *tok_eot))
    entry = prepcache.Entry(prepcache.cache_root(r), key, 1.0)
    entry.make()
    entry.lock.write_text(json.dumps({"host": host, "pid": pid, "token": "t1", "rank": 0}))
    entry.heartbeat.write_text(json.dumps({"token": "t1", "beat": 0, "phase": "loading and tokenizing"}))
    if beat_age:
        for f in (entry.lock, entry.heartbeat):
            os.utime(f, (time.time() - beat_age, time.time() - beat_age))
    return r, entry


def _fake_build():
    train = datasets.Dataset.from_dict({"input_ids": [[1, 2, 3]], "labels": [[1, 2, 3]]})
    return train, None, "a prompt", {"train": {"read": 1, "kept": 1}}


def _never():
    raise AssertionError("this process must not prepare")


def _beat(entry, beats, every=0.3, then=None):
    """The stand-in preparer's thread: `beats` beats, then `then` (a file to write) or silence."""
    def run():
        for beat in range(1, beats + 1):
            time.sleep(every)
            entry.heartbeat.write_text(json.dumps({"token": "t1", "beat": beat, "phase": "loading and tokenizing"}))
        if then:
            then()

    t = threading.Thread(target=run)
    t.start()
    return t


def test_a_preparer_that_goes_silent_ends_the_wait_with_one_line(tok_eot, tmp_path):
    """It beat while this process watched, then stopped for longer than the bound (heartbeat_timeout 1 s here)."""
    r, entry = _entry(tmp_path, tok_eot)
    beating = _beat(entry, 2)
    start = time.monotonic()
    with pytest.raises(prepcache.PreparationFailed) as e:
        prepcache.obtain(r, *tok_eot, _never)
    beating.join()
    assert time.monotonic() - start < 10
    msg = str(e.value)
    assert "\n" not in msg and f"the process preparing {entry.dir} (host node-elsewhere, pid 4242) has not beaten for" in msg, msg


def test_the_preparers_error_is_every_waiters_line(tok_eot, tmp_path):
    """The stand-in beats, then fails on bad input: the waiting process raises the same RecipeError (train.py: exit 2)
    and says it read it (the preparer waits for that before it exits)."""
    r, entry = _entry(tmp_path, tok_eot)
    line = "conversations: unknown 'from' value 'alien' in row 3 of dataset_name x.jsonl (train)"
    t = _beat(entry, 3, then=lambda: entry.error.write_text(json.dumps({"attempt": "t1", "kind": "recipe", "message": line})))
    with pytest.raises(RecipeError) as e:
        prepcache.obtain(r, *tok_eot, _never)
    t.join()
    assert str(e.value) == line
    assert [f.name for f in entry.waiting.iterdir() if f.name.endswith(".seen")] == [f"{socket.gethostname()}-{os.getpid()}.seen"]


def test_a_waiting_process_says_how_far_the_preparer_is_and_the_time_left(tok_eot, tmp_path, caplog, monkeypatch):
    """The stand-in's beats carry rows prepared of rows to prepare (as prepattempt.Heartbeat writes them from the progress
    folder): the waiting process's lines give the share and the time left at the rate it saw."""
    caplog.set_level(logging.INFO, logger="sftrecipes")
    monkeypatch.setattr(prepcache, "PROGRESS_S", 0.5)
    r, entry = _entry(tmp_path, tok_eot)

    def run():
        for beat in range(1, 9):
            time.sleep(0.3)
            entry.heartbeat.write_text(json.dumps({"token": "t1", "beat": beat, "phase": "loading and tokenizing",
                                                   "done": 1000 * beat, "total": 20000}))
        entry.error.write_text(json.dumps({"attempt": "t1", "kind": "recipe", "message": "stop here"}))

    t = threading.Thread(target=run)
    t.start()
    with pytest.raises(RecipeError, match="stop here"):
        prepcache.obtain(r, *tok_eot, _never)
    t.join()
    said = re.findall(r"still waiting .*\(loading and tokenizing: ([\d,]+) of 20,000 rows \((\d+)%\), ~(\d+)s left at ([\d,]+) rows/s", caplog.text)
    assert said, caplog.text
    for done, share, left, rate in said:  # ~3,300 rows/s: the stand-in's 1,000 rows every 0.3 s
        done, rate = int(done.replace(",", "")), int(rate.replace(",", ""))
        assert int(share) == round(100 * done / 20000) and 1500 < rate < 4000, said
        assert abs(int(left) - (20000 - done) / rate) <= 1, said
    assert prepattempt.describe_progress({"phase": "saving"}, {}, 1.0) == "saving"


def test_the_preparer_counts_its_rows_in_every_worker(tok_eot, tmp_path, monkeypatch):
    """Under a preparation (an attempt current: prepattempt.py), tokenize_split announces the rows of the split and each
    process that maps it counts what it prepared (the heartbeat record carries the sums), and writes no text column."""
    from sftrecipes.data import load as data

    rows = [json.loads(line) for line in open(ROOT / "data/tiny_chat/train.jsonl")] * 30  # 9,600 rows: 2 workers
    f = tmp_path / "rows.jsonl"
    f.write_text("".join(json.dumps(row) + "\n" for row in rows))
    r = load_recipe(BASE + ["--dataset_name", str(f), "--splits", "train", "--data_cache_dir", str(tmp_path / "cache")])
    attempt = prepattempt.Attempt(tmp_path / "entry", "t")
    folder = attempt.progress
    monkeypatch.setattr(prepattempt, "_current", attempt)
    datasets.disable_caching()
    try:
        train = data.load_datasets(r, *tok_eot)[0]
    finally:
        datasets.enable_caching()
    assert prepattempt.read_progress(folder) == (9600, 9600)
    assert train.column_names == ["input_ids", "labels"]  # the rendered text is not written under an attempt
    assert len([p for p in folder.iterdir() if p.name.startswith("done-")]) == 2  # one per worker
    beat = prepattempt.Heartbeat(tmp_path / "heartbeat.json", "t", 60.0, folder)
    beat.stop()
    record = json.loads((tmp_path / "heartbeat.json").read_text())
    assert (record["done"], record["total"]) == (9600, 9600)


@pytest.mark.parametrize("how", ["dead on this host", "silent elsewhere", "never beating while watched"])
def test_a_lock_no_process_works_under_is_taken_over(tok_eot, tmp_path, caplog, how):
    """A killed attempt's lock: its process gone from this host, its heartbeat older than the bound by this host's
    clock when the process arrives, or a heartbeat that never changes while it watches (one bound). The arriving
    process prepares instead."""
    dead = subprocess.Popen(["true"])
    dead.wait()
    kw = {"dead on this host": {"host": socket.gethostname(), "pid": dead.pid}, "silent elsewhere": {"beat_age": 5.0},
          "never beating while watched": {}}[how]
    r, entry = _entry(tmp_path, tok_eot, **kw)
    got = prepcache.obtain(r, *tok_eot, _fake_build)
    assert got.info["how"] == "built" and got.prompt == "a prompt" and len(got.train) == 1
    assert entry.is_complete() and not entry.lock.exists()
    assert "data: taking over" in caplog.text


def test_a_rebuild_says_which_inputs_changed(tok_eot, tmp_path, caplog):
    """The entry of the same data under other inputs is found, and the line names what differs."""
    caplog.set_level(logging.INFO, logger="sftrecipes")
    common = BASE + ["--data_cache_dir", str(tmp_path / "cache")]
    prepcache.obtain(load_recipe(common), *tok_eot, _fake_build)
    assert f"no earlier entry for this data in {tmp_path / 'cache'}" in caplog.text
    caplog.clear()
    got = prepcache.obtain(load_recipe(common + ["--max_length", "64", "--truncation_mode", "keep_end"]), *tok_eot, _fake_build)
    assert got.info["how"] == "built"
    assert re.search(r"data: prepared in [\d.]+s: 1 rows \(train 1\) at \d+ rows/s, saved to \S+; rebuilt: max_length 256 -> 64, "
                     r"truncation_mode 'keep_start' -> 'keep_end' \(the entry \w+ for the same data, from ", caplog.text), caplog.text
    caplog.clear()
    again = prepcache.obtain(load_recipe(common + ["--learning_rate", "0.5"]), *tok_eot, _never)
    assert again.info["how"] == "reused" and again.prompt == "a prompt" and "data: reused prepared data " in caplog.text


# ------------------------------------------------------------------------------------------ runs


def _big_data(tmp: Path, times: int = 6) -> Path:
    """The tiny chat rows six times over (1920 rows): preparation takes a few seconds, long enough to compare."""
    f = tmp / f"big-{times}.jsonl"
    f.write_text((ROOT / "data/tiny_chat/train.jsonl").read_text() * times)
    return f


@pytest.fixture(scope="module")
def prepared_runs(tiny_model, tmp_path_factory):
    """`prepare` into a fresh cache, then a training run with another learning rate: (tmp, the two results)."""
    tmp = tmp_path_factory.mktemp("prepcache")
    common = ["recipes/tiny/lora.yaml", "--dataset_name", str(_big_data(tmp)), "--splits", "train", "--data_cache_dir",
              str(tmp / "cache"), "--max_steps", "2", "--sample_max_new_tokens", "0"]
    as_fork = getattr(conftest, "launcher_argv", list)  # a fork of the suite's fork server, where it has one
    first = run_cli(as_fork(["-m", "sftrecipes", "prepare", *common, "--output_dir", str(tmp / "a")]))
    assert first.returncode == 0, first.stderr[-3000:]
    run = run_cli(["train.py", *common, "--learning_rate", "0.02", "--output_dir", str(tmp / "b")])
    assert run.returncode == 0, run.stderr[-3000:]
    return tmp, first, run


def test_prepare_says_where_rows_time_and_rate(prepared_runs):
    tmp, first, _ = prepared_runs
    line = first.stdout.strip().splitlines()[-1]
    m = re.fullmatch(rf"prepare: ({re.escape(str(tmp / 'cache'))}/\w+): built; 1920 rows \(train 1920 read, 1920 kept\); "
                     r"prepared in ([\d.]+)s at (\d+) rows/s; this command's data step [\d.]+s", line)
    assert m, line
    entry = Path(m.group(1))
    assert (entry / "complete").is_file() and (entry / "prepared" / "train.arrow").is_file()
    assert not (entry / "lock").exists()
    assert "data: prepared in " in first.stderr and "no earlier entry for this data" in first.stderr


def test_a_run_with_another_learning_rate_reads_it_without_tokenizing(prepared_runs):
    """The run after `prepare` (learning_rate changed: not an input of the rows) reads the entry: the log says so,
    nothing is tokenized, the data lines are said again, and its data step takes a small fraction of the preparation."""
    tmp, first, run = prepared_runs
    log = run.stdout + run.stderr
    assert "data: reused prepared data " in log and "Formatting and tokenizing" not in log, log[-3000:]
    assert "data: train split: 1920 read (1920 messages" in log  # prepare's own data line, said again
    prep = json.loads((tmp / "b" / "run_summary.json").read_text())["data"]["preparation"]
    built = json.loads(next((tmp / "cache").glob("*/complete")).read_text())
    # the run wrote nothing into the entry: TRL's packing was done into it once (trainrows.py), not again at launch
    assert _files(Path(prep["path"])) == ENTRY_FILES, _files(Path(prep["path"]))
    assert prep["reused"] is True and prep["how"] == "reused" and prep["rows"] == 1920 and prep["rows_per_s"] > 0
    assert prep["build_seconds"] == pytest.approx(built["seconds"])
    assert prep["seconds"] < 0.25 * built["seconds"], (prep, built)  # measured here: ~0.05 of it


def test_a_preparation_longer_than_ddp_timeout_ends_well_on_two_ranks(tiny_model, tmp_path, monkeypatch):
    """ddp_timeout 10 s, and the preparer sleeps 14 s before its second map batch (SFTRECIPES_TEST_SLOW_PREPARATION_S,
    heartbeat running; 12,800 rows in one process).
    The cpu target's gloo group is bound by ddp_timeout as NCCL's is on GPUs (backends.training_args): with
    main_process_first the waiting rank's barrier timed out ("Timed out waiting 8000ms" at 8 s for 12 s, checked by
    hand); now it waits on the entry's files, and both ranks train."""
    out, cache = tmp_path / "out", tmp_path / "cache"
    monkeypatch.setenv(prepattempt.SLOW_ENV, "14")
    res = accelerate_launch("recipes/tiny/ddp.yaml", out, "train.py",
                            ["--max_steps", "2", "--sample_max_new_tokens", "0", "--ddp_timeout", "10", "--data_cache_dir", str(cache),
                             "--dataset_name", str(_big_data(tmp_path, 40)), "--splits", "train", "--dataset_num_proc", "1"])
    log = res.stdout + res.stderr
    assert log.count("data: prepared in ") == 1 and log.count("prepares the data into") == 1, log[-4000:]
    waited = re.search(r"while this process waited ([\d.]+)s", log)
    assert waited and float(waited.group(1)) > 10, log[-4000:]
    assert len(re.findall(r"Formatting and tokenizing train split[^:]*:\s+0%\|", log)) == 1
    summary = json.loads((out / "run_summary.json").read_text())
    assert summary["steps"] == 2 and summary["data"]["preparation"]["how"] in ("built", "waited")


def test_an_error_in_preparation_is_exit_2_on_every_rank(tiny_model, tmp_path):
    """A row only tokenization can find wrong (a ShareGPT turn from 'alien'): the preparing rank writes its line to
    the entry, the waiting rank exits with the same line, launch says every rank refused (exit 2)."""
    bad = tmp_path / "bad.jsonl"
    rows = [{"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]}] * 3
    rows.append({"conversations": [{"from": "alien", "value": "hi"}, {"from": "gpt", "value": "hello"}]})
    bad.write_text("".join(json.dumps(r) + "\n" for r in rows))
    res = run_cli(["-m", "sftrecipes", "launch", "recipes/tiny/ddp.yaml", "--output_dir", str(tmp_path / "out"), "--max_steps",
                   "2", "--dataset_name", str(bad), "--splits", "train", "--data_cache_dir", str(tmp_path / "cache")],
                  env={"MAIN_PROCESS_PORT": str(free_port())})
    assert res.returncode == 2, res.stderr[-3000:]
    start = "conversations: unknown 'from' value 'alien' in row 3 of "
    # the waiting rank refuses too, unless torch's agent stops it first (SIGTERM once the preparing rank exited 2):
    # that rank's preempted.json is no preemption (CI saw exit 75 here), and launch leaves none behind
    assert re.search(r"launch: (every rank|1 of 2 ranks) refused the recipe.* \(exit 2\): " + re.escape(start), res.stderr), res.stderr[-3000:]
    assert not (tmp_path / "out" / "preempted.json").exists()
    error = json.loads(next((tmp_path / "cache").glob("*/error.json")).read_text())
    assert error["kind"] == "recipe" and error["message"].startswith(start)


# ------------------------------------------------------------------------------------------ what a preparation leaves


def _files(folder: Path) -> list[str]:
    return sorted(str(f.relative_to(folder)) for f in folder.rglob("*") if f.is_file()) if folder.exists() else []


ENTRY_FILES = ["complete", "prepared/inputs.json", "prepared/prepared.json", "prepared/train.arrow"]  # train split only


@pytest.mark.parametrize("flags", [
    ["--shuffle_dataset", "True"],  # bfd, the rows shuffled before packing and the packed rows after
    ["--packing_strategy", "wrapped", "--shuffle_dataset", "True"],
    ["--packing", "False", "--shuffle_dataset", "True", "--eval_packing", "True"],
])
def test_a_preparation_leaves_only_its_entry_which_holds_what_trl_trains_on(tok_eot, tmp_path, monkeypatch, flags):
    """Two sources (a jsonl file, which datasets converts to Arrow in its cache, and a save_to_disk folder, beside
    whose files datasets writes a map's output by default) with an eval split: after the preparation datasets' cache
    holds nothing, the saved folder is as it was, and the entry holds its records and one Arrow file per split of
    input_ids and labels (seq_lengths when bfd packs), no text; those rows are the very rows SFTTrainer's own
    preparation makes of the same prepared data (packing, shuffle_dataset, eval_packing), which train.py has it skip
    (1,960 training rows: TRL's packing map sees 2 batches; the entry's record batches of ~100 KB here)."""
    from sftrecipes.train import args as backends
    from sftrecipes.data import load as data
    from sftrecipes.model import load as models
    from sftrecipes.data import trainrows
    from trl import SFTTrainer

    monkeypatch.setattr(trainrows, "WRITE_BYTES", 100_000)
    saved = tmp_path / "saved"
    datasets.Dataset.from_json(str(ROOT / "data/tiny_chat/test.jsonl")).save_to_disk(str(saved))
    before = _files(saved)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf")  # where datasets writes, read at each call
    mixture = [{"path": str(_big_data(tmp_path)), "eval_split": None},
               {"path": str(saved), "split": "train", "eval_split": "train"}]
    r = load_recipe(BASE + ["--dataset_name", "null", "--datasets", json.dumps(mixture), "--data_cache_dir",
                            str(tmp_path / "cache"), "--launch.hardware", "cpu", *flags])
    train, evals, _, counts = data.prepared_datasets(r, *tok_eot)
    assert _files(tmp_path / "hf") == [] and _files(saved) == before
    entry = Path(counts["preparation"]["path"])
    assert _files(entry) == sorted([*ENTRY_FILES, "prepared/eval.arrow"])
    packed_bfd = "--packing" not in flags and "wrapped" not in flags
    assert train.column_names == ["input_ids", "labels", *(["seq_lengths"] if packed_bfd else [])]
    ours, ours_eval, _, _ = data.load_datasets(r, *tok_eot)  # the same rows, not through the cache: as TRL gets them
    trainer = SFTTrainer(model=models.load_model(r, tok_eot[0], "cpu"), args=backends.training_args(r, "cpu"),
                         train_dataset=ours, eval_dataset=ours_eval, processing_class=tok_eot[0])
    for entry_rows, trls in ((train, trainer.train_dataset), (evals, trainer.eval_dataset)):
        assert len(entry_rows) == len(trls) and all(entry_rows[c] == trls[c] for c in entry_rows.column_names)
    assert len(train) < counts["train"]["kept"] or not packed_bfd  # (packed: fewer rows than samples)


@pytest.mark.real_processes  # a preparer killed outright, as an OOM kill or a lost node ends it
def test_a_killed_prepare_leaves_nothing_once_another_takes_over(tiny_model, tmp_path):
    """`prepare` and its 2 workers are SIGKILLed while they write the rows (each one's first map batch written:
    SFTRECIPES_TEST_SLOW_PREPARATION_S holds them before the second, datasets' temporary files open): the next
    `prepare` takes the entry over, and once it is done nothing of the killed attempt is left, in the entry or in
    datasets' cache (HF_DATASETS_CACHE)."""
    hf, cache = tmp_path / "hf", tmp_path / "cache"
    argv = ["-m", "sftrecipes", "prepare", "recipes/tiny/lora.yaml", "--dataset_name", str(_big_data(tmp_path, 80)),
            "--splits", "train", "--data_cache_dir", str(cache), "--output_dir", str(tmp_path / "o")]  # 25,600 rows
    killed = subprocess.Popen([sys.executable, *argv], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              env={**os.environ, "HF_DATASETS_CACHE": str(hf), "SFTRECIPES_TEST_SLOW_PREPARATION_S": "120"},
                              start_new_session=True)
    deadline = time.monotonic() + 240
    try:
        while len([f for f in (*hf.rglob("tmp*"), *cache.rglob("tmp*")) if f.is_file()]) < 2:  # each worker's output
            assert killed.poll() is None, "the preparation ended before it was caught half way"
            assert time.monotonic() < deadline, "no map output was ever written"
            time.sleep(0.05)
    finally:
        os.killpg(killed.pid, signal.SIGKILL)  # the preparer and its workers, as a job's end or a lost node ends them
        killed.wait()
    taker = run_cli(argv, env={"HF_DATASETS_CACHE": str(hf)})
    assert taker.returncode == 0 and "data: taking over " in taker.stderr, taker.stderr[-3000:]
    assert _files(hf) == []
    [entry] = cache.iterdir()
    assert _files(entry) == ENTRY_FILES


def test_arrow_pages_a_pass_reads_are_handed_back(tmp_path):
    """A pass over a memory-mapped Arrow file keeps every page it read in the process's RSS (the file's mapping in
    /proc/self/smaps); arrowmem.release() hands them back, the mapping stays and reads the same data again."""
    import pyarrow.compute as pc

    from sftrecipes.data import arrowmem
    from sftrecipes.core import pages

    path = tmp_path / "rows.arrow"
    datasets.Dataset.from_dict({"values": [list(range(4096))] * 2048}).with_format("arrow").flatten_indices(
        cache_file_name=str(path))  # 64 MB of int64
    rows = datasets.Dataset.from_file(str(path))

    def resident_mb() -> float:
        return sum(f["Rss"] for *_, p, f in pages.smaps(("Rss",)) if p == str(path.resolve())) / 1024

    def read() -> int:
        return sum(pc.sum(t.column("values").combine_chunks().flatten()).as_py() for t in rows.with_format("arrow").iter(256))

    total = read()
    assert resident_mb() > 0.9 * path.stat().st_size / 2**20
    assert arrowmem.release() >= path.stat().st_size // 2
    assert resident_mb() < 1
    assert read() == total

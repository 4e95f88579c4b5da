"""One process's attempt at preparing a cache entry (prepcache.py), on disk: a folder of its own in the entry,
attempt-<lock token>/, that holds everything the attempt writes until the entry is complete, removed when it ends and,
after a killed attempt, by the next process that takes the entry.

    attempt-<token>/
        progress/   rows to prepare per split, rows prepared per preparing process (tokenization.py writes them; the
                    heartbeat carries the sums to the waiting processes)
        scratch/    datasets' cache while the attempt prepares (datasets.config.HF_DATASETS_CACHE points here: the
                    source's Arrow copy, the json/csv/parquet conversion, its lock files), every map's output and
                    temporary files, the indices of shuffles
        prepared/   the entry's rows and records (trainrows.py, prepcache.py), renamed to <entry>/prepared when complete

The attempt's heartbeat (`Heartbeat`: <entry>/heartbeat.json, the keep-alive of the entry's lock, rewritten by a
thread as every heartbeat is: run/heartbeats.py; with the sums of progress/) is what the waiting processes read
(`describe_progress`: their words for it). A failed or interrupted attempt removes its folder itself; one killed
outright (SIGKILL, the node lost) leaves it, and the process that takes over the entry's lock removes it before
preparing (`remove_dead`), as does the first process that finds the entry complete with no lock held (no attempt can
be running then: one is made only while the lock is held and the entry is not complete). Torch-free; datasets is
imported when the attempt prepares.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
import uuid
from pathlib import Path

from sftrecipes.core.jsonfile import read_json, write_json
from sftrecipes.core.procs import identity
from sftrecipes.data import arrowmem
from sftrecipes.run.heartbeats import Beat
from sftrecipes.run.lock import RECORD

ATTEMPT = "attempt-"
EARLIER = (".tmp-*", "progress-*")  # what attempts of an earlier layout left in the entry
# tests only: each preparing process sleeps this long before its second map batch of rows is written (its first one
# written: the source's Arrow copy made, datasets' temporary output file open), the heartbeat running
SLOW_ENV = "SFTRECIPES_TEST_SLOW_PREPARATION_S"

# rows of one record batch of datasets' copy of a source (its default, 1,000: each batch costs ~64 KB of RSS, the page
# around its header, when the copy is opened)
SOURCE_ROWS = 10_000
_current: Attempt | None = None  # the attempt this process prepares now (forked workers inherit it)


def current() -> Attempt | None:
    """The attempt under way in this process (tokenization.tokenize_split writes into it), or None."""
    return _current


def remove_dead(entry: Path, keep: Path | None = None) -> list[Path]:
    """Remove every attempt's folder in `entry` but `keep` (and an earlier layout's files): called under the entry's
    lock, or with the entry complete and no lock held, when no other attempt can be running. The folders removed."""
    gone = []
    for pattern in (f"{ATTEMPT}*", *EARLIER):
        for old in entry.glob(pattern):
            if old != keep:
                shutil.rmtree(old, ignore_errors=True)
                gone.append(old)
    return gone


class Attempt:
    """attempt-<token>/ in the entry, made with its progress/, scratch/ and prepared/ folders once the dead attempts'
    folders are removed."""

    def __init__(self, entry: Path, token: str):
        self.dir = entry / f"{ATTEMPT}{token}"
        self.progress, self.scratch, self.prepared = self.dir / "progress", self.dir / "scratch", self.dir / "prepared"
        remove_dead(entry, keep=self.dir)
        for folder in (self.progress, self.scratch, self.prepared):
            folder.mkdir(parents=True, exist_ok=True)

    def scratch_file(self, what: str) -> str:
        """A new file name in scratch/ for one map's or shuffle's output."""
        return str(self.scratch / f"{what}-{uuid.uuid4().hex[:12]}.arrow")

    @contextlib.contextmanager
    def preparing(self):
        """While the block runs: datasets' cache in scratch/ (read at call time by its builders; downloads of hub data
        stay where datasets keeps them: the source, not a copy of it) and its copies written in record batches of
        SOURCE_ROWS rows (config.DEFAULT_MAX_BATCH_SIZE, read when a writer is made), this attempt current for the
        preparing code, and this process's pages of the Arrow files it reads handed back as it goes (arrowmem)."""
        import datasets

        global _current
        config = datasets.config
        before = config.HF_DATASETS_CACHE, config.DEFAULT_MAX_BATCH_SIZE, _current
        config.HF_DATASETS_CACHE, config.DEFAULT_MAX_BATCH_SIZE = self.scratch / "datasets", SOURCE_ROWS
        _current = self
        try:
            with arrowmem.released_while():
                yield self
        finally:
            config.HF_DATASETS_CACHE, config.DEFAULT_MAX_BATCH_SIZE, _current = before

    def drop_source_copies(self) -> None:
        """Remove datasets' copies of the sources (scratch/datasets: read by tokenization, not after it), so that
        the tokenized rows and the entry being written are all the attempt holds on disk while it saves."""
        shutil.rmtree(self.scratch / "datasets", ignore_errors=True)

    def remove(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


# ----------------------------------------------------------------------------------------------- progress


def _safe(split: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in split)


def note_total(folder: Path, split: str, rows: int) -> None:
    """`rows` of `split` are to be prepared (the process that maps the split)."""
    write_json(folder / f"total-{_safe(split)}.json", {"split": split, "rows": rows})


def note_done(folder: Path, split: str, rows: int) -> None:
    """This process has prepared `rows` rows of `split` so far (each preparing process, worker or not)."""
    write_json(folder / f"done-{os.getpid()}-{_safe(split)}.json", {"rows": rows})


_done: dict[tuple[str, str], int] = {}  # rows this process prepared, per (progress folder, split)
_batches: dict[str, int] = {}  # map batches this process prepared, per progress folder


def batch_done(folder: str, split: str, rows: int) -> None:
    """A map batch of `rows` more rows of `split` prepared by this process (a datasets worker or the preparer itself)
    under the attempt whose progress folder is `folder`: counted for the waiting processes, and the Arrow pages this
    process read handed back (arrowmem: a worker has no thread doing it). Tests only (SLOW_ENV): a process's second
    map batch sleeps."""
    _done[folder, split] = _done.get((folder, split), 0) + rows
    note_done(Path(folder), split, _done[folder, split])
    arrowmem.release()
    _batches[folder] = _batches.get(folder, 0) + 1
    if _batches[folder] == 2 and os.environ.get(SLOW_ENV):  # a preparation caught half way
        time.sleep(float(os.environ[SLOW_ENV]))


def read_progress(folder: Path) -> tuple[int, int] | None:
    """(rows prepared, rows to prepare) so far of every split announced in `folder`; None before the first."""
    done = total = 0
    found = False
    with contextlib.suppress(OSError):
        for f in folder.iterdir():
            rec = read_json(f) if f.suffix == ".json" else None
            if rec and f.name.startswith("total-"):
                total, found = total + int(rec.get("rows", 0)), True
            elif rec and f.name.startswith("done-"):
                done += int(rec.get("rows", 0))
    return (done, total) if found else None


# ----------------------------------------------------------------------------------------------- heartbeat


def me() -> dict:
    """This process as the entry's files name it: host, pid, start time, rank."""
    return {**identity(), "rank": int(os.environ.get("RANK", "0"))}


def describe_progress(beat: dict, seen: dict, now: float) -> str:
    """A waiting process's words for the preparer's progress: rows prepared of rows to prepare and the time left at
    the rate seen since this process first saw rows move (seen: {'t', 'done'} of that first sight, kept by the
    caller); the phase alone while no split has been announced."""
    phase = beat.get("phase") or "starting"
    done, total = beat.get("done"), beat.get("total")
    if not total:
        return phase
    words = f"{phase}: {done:,} of {total:,} rows ({100 * done / total:.0f}%)"
    if "t" in seen and done > seen["done"] and now > seen["t"]:
        rate = (done - seen["done"]) / (now - seen["t"])
        words += f", ~{max(total - done, 0) / rate:.0f}s left at {rate:,.0f} rows/s"
    return words


class Heartbeat(Beat):
    """The preparer's heartbeat.json, the keep-alive of the entry's lock (lock.py), beaten by a thread every `interval`
    s: its beat counter changes at every beat, the phase says what it does, done/total the rows prepared of the rows
    to prepare (its progress folder)."""

    def __init__(self, path: Path, token: str, interval: float, progress: Path | None = None):
        self.token, self.progress, self.phase = token, progress, "starting"
        super().__init__(path, self._fields, RECORD)
        self.every(interval)

    def _fields(self) -> dict:
        rec = {**me(), "token": self.token, "phase": self.phase}
        counted = read_progress(self.progress) if self.progress is not None else None
        if counted is not None:
            rec["done"], rec["total"] = counted
        return rec

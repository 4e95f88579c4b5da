"""Prepared data kept once per cache key (prepkey.py): one process prepares an entry while the others wait on its files.

No collective, so no ddp_timeout, however long the preparation takes.

    <data_cache_dir>/<key>/
        lock             the preparer (host, pid, token), taken atomically (run/lock.py); a dead or silent holder's
                         is taken over
        heartbeat.json   the lock's keep-alive, rewritten by the preparer's thread every few seconds (phase, beat
                         counter, rows prepared of rows to prepare: its attempt's progress/)
        attempt-<token>/ all the preparer writes until the entry is complete (prepattempt.py: its progress, datasets'
                         cache, the rows before they are renamed into place); removed when it ends, or by the next
                         process to take the entry after it was killed
        waiting/         one file per process waiting on this entry (and `.seen` once it read the error)
        error.json       a failed attempt: its one line, for every waiting process to exit with
        prepared/        train.arrow, eval.arrow (the rows as SFTTrainer reads them: trainrows.py), prepared.json
                         (counts, sample prompt, data log lines), inputs.json (the key's inputs: what a later rebuild is
                         compared with); renamed into place
        complete         written last: the entry may be read

Every process of a run (and any other run or `prepare` sharing the cache) calls `obtain`: the first to take the lock
prepares; the others poll for `complete` and log every PROGRESS_S how far it is (rows prepared of rows to prepare,
the time left at the rate they saw), exit with the preparer's error line when it writes one,
and fail with one line when its heartbeat, having beaten, stops changing for longer than the bound
(run.heartbeat_timeout, 120 s when that is 0). A lock no process works under is taken over: its holder gone from this
host, its heartbeat older than the bound on arrival, or one that never changes while watched (a killed attempt's). Torch-free: `datasets` is imported when an entry is saved or loaded.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from sftrecipes.core.errors import RecipeError
from sftrecipes.core.jsonfile import read_json, write_json
from sftrecipes.core.procs import gone_from_this_host, now_iso
from sftrecipes.data import prepattempt
from sftrecipes.data.prepkey import describe_changes, entry_key, key_inputs
from sftrecipes.recipe.typed import Recipe
from sftrecipes.run.heartbeats import beat_interval
from sftrecipes.run.lock import DEFAULT_STALE_S, Lock

log = logging.getLogger("sftrecipes")

POLL_S = 0.25  # how often a waiting process looks for the entry
PROGRESS_S = 30.0  # how often it says it is still waiting
ERROR_ACK_S = 10.0  # how long a failed preparer waits for the waiting processes to read its error
RECENT_ERROR_S = 60.0  # a recipe error written this recently, with no attempt running, is this run's too


class PreparationFailed(RuntimeError):
    """The process preparing the data failed other than on bad input, or went silent: one line, exit 1."""


@dataclass
class Prepared:
    """The data step's result: the prepared splits, the sample prompt, the counts, and how this process got them."""

    train: Any
    eval: Any
    prompt: Any
    counts: dict
    info: dict  # how ('built', 'waited', 'reused'), seconds, rows, rows_per_s, key, path ...


# ----------------------------------------------------------------------------------------------- where the entries are


def cache_root(recipe: Recipe) -> Path:
    """`data_cache_dir`, else <HF datasets cache>/sftrecipes-prepared (HF_DATASETS_CACHE, HF_HOME, XDG_CACHE_HOME as
    the datasets library reads them), absolute."""
    if recipe.data.data_cache_dir:
        return Path(recipe.data.data_cache_dir).expanduser().absolute()
    hf_home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME") or "~/.cache", "huggingface")
    datasets_cache = os.environ.get("HF_DATASETS_CACHE") or os.path.join(hf_home, "datasets")
    return (Path(datasets_cache).expanduser() / "sftrecipes-prepared").absolute()


def _data_identity(inputs: dict) -> list:
    return [s.get("path") for s in inputs.get("sources") or []]


def previous_entry(root: Path, inputs: dict, key: str) -> tuple[str, dict, dict] | None:
    """The newest complete entry for the same data (the same source paths) under another key: (key, its inputs,
    its complete record); None when there is none."""
    best = None
    with contextlib.suppress(OSError):
        for entry in root.iterdir():
            if entry.name == key or not (entry / "complete").is_file():
                continue
            old, done = read_json(entry / "prepared" / "inputs.json"), read_json(entry / "complete")
            if old is None or done is None or _data_identity(old) != _data_identity(inputs):
                continue
            when = (entry / "complete").stat().st_mtime
            if best is None or when > best[0]:
                best = (when, entry.name, old, done)
    return best[1:] if best else None


# ----------------------------------------------------------------------------------------------- files


class _Capture(logging.Handler):
    """The data step's log lines, kept to be said again by every process that uses the entry."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[tuple[int, str]] = []
        self.thread = threading.get_ident()

    def emit(self, record: logging.LogRecord) -> None:
        if record.thread == self.thread:
            self.lines.append((record.levelno, record.getMessage()))


# ----------------------------------------------------------------------------------------------- one entry


class Entry:
    """<root>/<key>: its lock, heartbeat, error and prepared data."""

    def __init__(self, root: Path, key: str, stale_s: float):
        self.root, self.key, self.dir, self.stale_s = root, key, root / key, stale_s
        self.lock, self.heartbeat, self.error = self.dir / "lock", self.dir / "heartbeat.json", self.dir / "error.json"
        self.prepared, self.complete, self.waiting = self.dir / "prepared", self.dir / "complete", self.dir / "waiting"
        self._lock = Lock(self.lock, self.heartbeat, stale_s)  # the heartbeat: the preparer's (prepattempt.Heartbeat)

    def make(self) -> None:
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise RecipeError(f"data_cache_dir: cannot create '{self.dir}' ({e.strerror}); set data_cache_dir to a "
                              "writable folder (a shared filesystem for runs on several nodes)") from None

    def is_complete(self) -> bool:
        return self.complete.is_file()

    def read_lock(self) -> dict | None:
        """The holder; None when there is none, {} while unreadable (being written)."""
        return self._lock.read()

    def take_lock(self, stale: dict | None = None) -> str | None:
        """The token of the lock this process took, None when another holds it. `stale`: a holder found gone or silent,
        whose lock is moved aside first (one taker wins the rename)."""
        if stale is not None and not self._lock.take_over(stale):
            return None
        try:
            took = self._lock.take(rank=int(os.environ.get("RANK", "0")))
        except OSError as e:
            raise RecipeError(f"data_cache_dir: cannot write in '{self.dir}' ({e.strerror}); set data_cache_dir to a "
                              "writable folder (a shared filesystem for runs on several nodes)") from None
        return self._lock.token if took else None

    def keep_alive(self, heart: prepattempt.Heartbeat) -> prepattempt.Heartbeat:
        """The preparer's heartbeat, beating until release()."""
        return self._lock.keep_alive(heart)

    def release(self) -> None:
        """The lock and its heartbeat removed, if still this process's."""
        self._lock.release()

    def stale_at_arrival(self, held: dict) -> str | None:
        """Why no process is working under the lock `held`: its holder gone from this host, or its heartbeat (or,
        without one, the lock) last written longer than the bound ago by this host's clock (a crashed or killed
        earlier attempt); None while one may be."""
        return self._lock.stale(held)

    def load(self) -> tuple[Any, Any, dict]:
        """(train, eval or None, prepared.json) of a complete entry."""
        import datasets

        meta = read_json(self.prepared / "prepared.json")
        try:
            if meta is None:
                raise FileNotFoundError(self.prepared / "prepared.json")
            train = datasets.Dataset.from_file(str(self.prepared / "train.arrow"))
            evals = datasets.Dataset.from_file(str(self.prepared / "eval.arrow")) if meta.get("has_eval") else None
        except (OSError, ValueError) as e:
            raise PreparationFailed(f"data: the prepared entry {self.dir} is damaged ({type(e).__name__}: {str(e)[:160]}); "
                                    "delete that folder and run again") from None
        return train, evals, meta


def _rows(counts: dict) -> int:
    return sum(int(counts[s]["read"]) for s in ("train", "eval") if s in counts)


def _split_rows(counts: dict) -> str:
    return ", ".join(f"{s} {counts[s]['read']}" for s in ("train", "eval") if s in counts)


def obtain(recipe: Recipe, tokenizer, eot: str | None, build: Callable[[], tuple]) -> Prepared:
    """The prepared data of `recipe`: read from its cache entry, prepared into it by this process (`build()` returns
    (train, eval or None, sample prompt, counts)), or read once another process that holds the entry's lock has
    prepared it. Logs one line saying which, and replays the data step's own lines. No torch.distributed."""
    start = time.monotonic()
    inputs = key_inputs(recipe, tokenizer, eot)
    key = entry_key(inputs)
    root = cache_root(recipe)
    entry = Entry(root, key, float(recipe.run.heartbeat_timeout or DEFAULT_STALE_S))
    entry.make()
    seen: set[str] = set()  # the lock tokens this process has seen held (their errors are this run's)
    me = f"{socket.gethostname()}-{os.getpid()}"
    registered = False
    watched: dict[str, Any] = {}  # the holder watched: token, last beat, when it last changed
    last_said, unreadable = start, None
    try:
        while True:
            if entry.is_complete():
                if entry.read_lock() is None:  # no attempt can be running: what a killed one left goes
                    prepattempt.remove_dead(entry.dir)
                return _use(entry, key, "waited" if seen else "reused", start)
            err = read_json(entry.error)
            if err and (err.get("attempt") in seen or _recent_recipe_error(entry, err, entry.read_lock())):
                _ack(entry, me)
                _raise(err)
            held = entry.read_lock()
            if held is None:
                token = entry.take_lock()
                if token is None:
                    continue
                return _build_entry(entry, recipe, inputs, build, token, start)
            if not held:  # being written; unreadable for longer than the bound: a torn lock, moved aside
                unreadable = unreadable or time.monotonic()
                if time.monotonic() - unreadable > entry.stale_s:
                    with contextlib.suppress(OSError):
                        os.replace(entry.lock, entry.dir / f"lock.torn-{uuid.uuid4().hex}")
                    unreadable = None
                time.sleep(POLL_S)
                continue
            unreadable = None
            token = held.get("token")
            if token not in seen:
                why = entry.stale_at_arrival(held) if not seen else None
                if why:
                    taken = entry.take_lock(stale=held)
                    if taken is not None:
                        log.warning("data: taking over %s from host %s pid %s (%s)", entry.lock, held.get("host"), held.get("pid"), why)
                        return _build_entry(entry, recipe, inputs, build, taken, start)
                    continue
                seen.add(token)
                watched = {"token": token, "beat": None, "changed": time.monotonic(), "moved": -1, "rate": {}}
                if not registered:
                    entry.waiting.mkdir(exist_ok=True)
                    (entry.waiting / me).write_text(json.dumps(prepattempt.me()))
                    registered = True
                log.info("data: host %s pid %s (rank %s) prepares the data into %s; waiting for it (no collective: "
                         "ddp_timeout does not apply)", held.get("host"), held.get("pid"), held.get("rank"), entry.dir)
            beat = read_json(entry.heartbeat)
            now = time.monotonic()
            if beat and beat.get("token") == token and (beat.get("beat"), beat.get("phase")) != watched["beat"]:
                watched.update(beat=(beat.get("beat"), beat.get("phase")), changed=now, phase=beat.get("phase"),
                               moved=watched["moved"] + 1, last=beat)
            elif now - watched["changed"] > entry.stale_s:
                # gone from this host, or never beaten since this process arrived (a killed attempt's lock younger
                # than the bound on arrival): taken over; beaten, then silent: the preparer of this run froze or died
                if gone_from_this_host(held) or watched["moved"] <= 0:
                    taken = entry.take_lock(stale=held)
                    if taken is not None:
                        log.warning("data: taking over %s from host %s pid %s (%s)", entry.lock, held.get("host"),
                                    held.get("pid"), "its process is gone" if gone_from_this_host(held) else
                                    f"silent since this process arrived, {now - watched['changed']:.0f}s")
                        return _build_entry(entry, recipe, inputs, build, taken, start)
                    continue
                raise PreparationFailed(
                    f"data: the process preparing {entry.dir} (host {held.get('host')}, pid {held.get('pid')}) has not "
                    f"beaten for {now - watched['changed']:.0f}s (bound: run.heartbeat_timeout, {entry.stale_s:g}s); if it "
                    f"is gone, run again (its lock is taken over), else raise heartbeat_timeout")
            if beat and beat.get("token") == token and beat.get("done") and "t" not in watched["rate"]:
                watched["rate"] = {"t": now, "done": beat["done"]}  # the rate is measured from here
            if now - last_said >= PROGRESS_S:
                last_said = now
                log.info("data: still waiting for host %s pid %s to prepare %s (%s; %.0fs so far)", held.get("host"),
                         held.get("pid"), entry.dir, prepattempt.describe_progress(watched.get("last") or {}, watched["rate"], now),
                         now - start)
            time.sleep(POLL_S)
    finally:
        if registered and not (entry.waiting / f"{me}.seen").exists():
            (entry.waiting / me).unlink(missing_ok=True)


def _recent_recipe_error(entry: Entry, err: dict, held: dict | None) -> bool:
    """An error on bad input written moments ago with no attempt running since: this run's preparer failed before this
    process arrived (the rows shape the error, and the key covers what shapes the rows)."""
    if held is not None or err.get("kind") != "recipe":
        return False
    try:
        return time.time() - entry.error.stat().st_mtime < RECENT_ERROR_S
    except OSError:
        return False


def _ack(entry: Entry, me: str) -> None:
    with contextlib.suppress(OSError):
        entry.waiting.mkdir(exist_ok=True)
        (entry.waiting / f"{me}.seen").touch()


def _raise(err: dict):
    if err.get("kind") == "recipe":
        raise RecipeError(err.get("message", "data: preparation failed"))
    raise PreparationFailed(f"data: the process preparing the data (host {err.get('host')}, pid {err.get('pid')}) failed: "
                            f"{err.get('message')}")


def _build_entry(entry: Entry, recipe: Recipe, inputs: dict, build: Callable[[], tuple], token: str, start: float) -> Prepared:
    """Prepare the data under the lock `token`: heartbeat running, everything written into the attempt's own folder
    (prepattempt.py), the rows saved as the trainer reads them (trainrows.py) and renamed into place, `complete` last,
    the attempt's folder removed. On failure the error goes to error.json for the waiting processes."""
    if entry.is_complete():  # finished by another process between the look and the lock
        entry.release()
        return _use(entry, entry.key, "reused", start)
    attempt = prepattempt.Attempt(entry.dir, token)  # what killed attempts left is removed first
    heart = entry.keep_alive(prepattempt.Heartbeat(entry.heartbeat, token, beat_interval(entry.stale_s), attempt.progress))
    capture = _Capture()
    log.addHandler(capture)
    begun = time.monotonic()
    try:
        with attempt.preparing():  # datasets writes into the attempt's folder; Arrow pages read are handed back
            heart.phase = "loading and tokenizing"
            train, evals, prompt, counts = build()
            attempt.drop_source_copies()  # (mapped still where read: the pages go with the mapping)
            heart.phase = "saving"
            log.removeHandler(capture)
            from sftrecipes.data import trainrows

            trainrows.save(recipe, train, attempt.prepared / "train.arrow", False, attempt.scratch_file)
            if evals is not None:
                trainrows.save(recipe, evals, attempt.prepared / "eval.arrow", True, attempt.scratch_file)
        seconds = time.monotonic() - begun  # read, tokenized, counted, packed and written
        rows = _rows(counts)
        (attempt.prepared / "inputs.json").write_text(json.dumps(inputs, indent=1, default=str))
        (attempt.prepared / "prepared.json").write_text(json.dumps(
            {"prompt": prompt, "counts": counts, "has_eval": evals is not None, "log": capture.lines, "rows": rows,
             "seconds": round(seconds, 3)}, indent=1, default=str))
        with contextlib.suppress(OSError):  # else another preparer (which took over a lock it found silent) finished
            os.rename(attempt.prepared, entry.prepared)  # first: same inputs, same rows
        if not entry.is_complete():
            write_json(entry.complete, {"key": entry.key, "built": now_iso(), "seconds": round(seconds, 3), "rows": rows,
                                         **prepattempt.me()})
        entry.error.unlink(missing_ok=True)  # an earlier attempt's
    except BaseException as e:
        log.removeHandler(capture)
        recipe_error = isinstance(e, RecipeError)
        with contextlib.suppress(OSError):
            write_json(entry.error, {"attempt": token, "kind": "recipe" if recipe_error else "exception",
                                      "message": str(e) if recipe_error else f"{type(e).__name__}: {str(e)[:300]}",
                                      "time": now_iso(), **prepattempt.me()})
            _wait_for_acks(entry)
        raise
    finally:
        attempt.remove()  # before the lock goes: no attempt's folder outlives its lock but a killed one's
        entry.release()  # (its heartbeat stopped and removed with it)
    if entry.is_complete():
        shutil.rmtree(entry.waiting, ignore_errors=True)
    built = _use(entry, entry.key, "built", start, replay=False)
    previous = previous_entry(entry.root, inputs, entry.key)
    why = (f"rebuilt: {describe_changes(previous[1], inputs)} (the entry {previous[0]} for the same data, from "
           f"{previous[2].get('built')})") if previous else f"no earlier entry for this data in {entry.root}"
    log.info("data: prepared in %.1fs: %d rows (%s) at %.0f rows/s, saved to %s; %s", seconds, built.info["rows"],
             _split_rows(built.counts), built.info["rows_per_s"], entry.dir, why)
    return built


def _wait_for_acks(entry: Entry) -> None:
    """Until every process registered as waiting has read the error (ERROR_ACK_S at most): a launcher ends the other
    ranks once this one exits, and each must have said the same line (exit 2) by then."""
    deadline = time.monotonic() + ERROR_ACK_S
    while time.monotonic() < deadline:
        waiting = {f.name for f in entry.waiting.iterdir()} if entry.waiting.is_dir() else set()
        if all(f"{w}.seen" in waiting for w in waiting if not w.endswith(".seen")):
            break
        time.sleep(POLL_S / 2)
    shutil.rmtree(entry.waiting, ignore_errors=True)


def _use(entry: Entry, key: str, how: str, start: float, replay: bool = True) -> Prepared:
    """The complete entry, loaded; its data lines said again (replay) and one line saying how this process got it."""
    begun = time.monotonic()
    train, evals, meta = entry.load()
    done = read_json(entry.complete) or {}
    counts, rows = meta.get("counts") or {}, int(meta.get("rows") or 0)
    build_s = float(meta.get("seconds") or 0.0)
    info = {"how": how, "reused": how == "reused", "seconds": round(time.monotonic() - start, 3),
            "build_seconds": round(build_s, 3), "rows": rows, "rows_per_s": round(rows / max(build_s, 1e-3), 1),
            "key": key, "path": str(entry.dir), "built": done.get("built")}
    if how == "waited":
        info["waited_seconds"] = round(begun - start, 3)
    if replay:
        if how == "reused":
            log.info("data: reused prepared data %s (built %s in %.1fs: %d rows (%s) at %s rows/s); loaded in %.2fs", entry.dir,
                     done.get("built"), build_s, rows, _split_rows(counts), info["rows_per_s"], time.monotonic() - begun)
        else:
            log.info("data: prepared by host %s pid %s into %s while this process waited %.1fs: %d rows (%s) in %.1fs at %s "
                     "rows/s", done.get("host"), done.get("pid"), entry.dir, info["waited_seconds"], rows, _split_rows(counts),
                     build_s, info["rows_per_s"])
        for level, line in meta.get("log") or []:
            log.log(level, "%s", line)
    return Prepared(train, evals, meta.get("prompt"), counts, info)

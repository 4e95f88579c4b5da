"""Heartbeats: a file a live process rewrites in place with a counter that changes at every beat (`Beat`: a rank's,
beaten by its RunLife; a lock holder's keep-alive, beaten by a thread), and the watcher that names the rank of a
multi-process run whose counter stopped changing for heartbeat_timeout seconds (every rank's RunLife, and `launch`)."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
from pathlib import Path
from typing import Callable

from sftrecipes.core.jsonfile import read_json
from sftrecipes.core.procs import proc_state

HEARTBEATS = ".sftrecipes/heartbeat"
RECORD = 256  # bytes of one heartbeat record, rewritten in place


class Beat:
    """A heartbeat file: the record `fields()` returns with the counter `beat` and the time, padded to `size` bytes
    and rewritten in place (same inode, closed after each write: readers on a shared filesystem see it at their next
    open). Beaten by its owner (`beat()`), or by a thread of its own every `interval` s (`every`) until `stop()`."""

    def __init__(self, path: Path, fields: Callable[[], dict], size: int = RECORD):
        self.path, self.fields, self.size, self.count = path, fields, size, 0
        self._stop, self._thread = threading.Event(), None
        self.path.write_bytes(self._record())

    def _record(self) -> bytes:
        rec = {**self.fields(), "beat": self.count, "time": round(time.time(), 1)}
        return json.dumps(rec).ljust(self.size).encode()

    def beat(self) -> None:
        self.count += 1
        with open(self.path, "r+b") as f:
            f.write(self._record())

    def every(self, interval: float) -> Beat:
        """Beaten from a thread every `interval` s (a write that fails is tried again at the next beat)."""
        def loop():
            while not self._stop.wait(interval):
                with contextlib.suppress(OSError):
                    self.beat()

        self._thread = threading.Thread(target=loop, name="sftrecipes-heartbeat", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)


class Heartbeat(Beat):
    """This rank's heartbeat file, <folder>/rank-N.json: its rank, host, pid and step; beaten by its RunLife."""

    def __init__(self, folder: Path, rank: int):
        folder.mkdir(parents=True, exist_ok=True)
        self.rank, self.step, self.done = rank, 0, False
        host, pid = socket.gethostname(), os.getpid()
        super().__init__(folder / f"rank-{rank}.json",
                         lambda: {"rank": self.rank, "host": host, "pid": pid, "step": self.step, "done": self.done})

    def beat(self, step: int, done: bool = False) -> None:
        """One beat; `done`: the last, from a rank leaving its run on purpose (a peer still busy, e.g. rank 0 pushing
        to the hub, must not take its silence for a hang)."""
        self.step, self.done = step, done
        super().beat()


class Watch:
    """Who has stopped beating: a rank of this run whose counter has not changed for `timeout` seconds of the
    watcher's own clock since it was first seen or last changed (no comparison of clocks across hosts). This run's
    ranks: below `world` (a larger earlier run's files are not), and, for `launch`, among `pids()` (its own ranks: a
    file left by an earlier run names a process that is not). A new process in a rank's file starts it afresh (each
    rank rewrites its file as training starts), so does a beat; a rank that left on purpose (done) is not judged."""

    def __init__(self, folder: Path, timeout: float, own_rank: int | None = None, world: int | None = None, pids=None):
        self.folder, self.timeout, self.own, self.world, self.pids = folder, timeout, own_rank, world, pids
        self.seen: dict[int, dict] = {}  # rank -> pid, beat, when it was first seen or last changed

    def stale(self, now: float | None = None) -> list[dict]:
        now = time.monotonic() if now is None else now
        mine = self.pids() if self.pids is not None else None
        out = []
        for f in sorted(self.folder.glob("rank-*.json")) if self.folder.is_dir() else []:
            rec = read_json(f) or {}
            try:
                rank, pid, beat = int(rec["rank"]), int(rec["pid"]), int(rec["beat"])
            except (ValueError, KeyError, TypeError):
                continue  # vanished, or read half-written
            if rank == self.own or rec.get("done") or (self.world is not None and rank >= self.world):
                continue
            if mine is not None and (pid not in mine or rec.get("host") != socket.gethostname()):
                continue
            s = self.seen.get(rank)
            if s is None or s["pid"] != pid or s["beat"] != beat:
                self.seen[rank] = {"pid": pid, "beat": beat, "changed": now}
            elif now - s["changed"] >= self.timeout:
                out.append({**rec, "silent": now - s["changed"]})
        return out


def describe_silent(rec: dict, timeout: float) -> str:
    here = rec.get("host") == socket.gethostname()
    state = {"stopped": "its process is stopped", "gone": "its process is gone", "running": "its process is stuck"}[
        proc_state(int(rec["pid"]))] if here else "no news from its host"
    return (f"heartbeat: rank {rec['rank']} (host {rec['host']}, pid {rec['pid']}) has not beaten for {rec['silent']:.0f}s "
            f"({state}; last at step {rec.get('step')}); ending the run (heartbeat_timeout {timeout:g}s)")


def beat_interval(timeout: float) -> float:
    return min(max(timeout / 10, 0.5), 5.0)

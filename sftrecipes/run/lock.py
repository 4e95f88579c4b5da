"""The one lock: a file naming the process that holds it (host, pid and its start time, since, a token), taken
atomically, kept alive by a heartbeat (heartbeats.py) where others wait on its holder, and taken over once stale.

    Lock(path, heartbeat=None, stale_s)   one lock file (and the heartbeat file of its holder, if it keeps one)
      .take(**fields)                     this process's, or False when another holds it
      .keep_alive(beat=None)              the holder's heartbeat, rewritten by a thread until release
      .stale(held) / .take_over(held)     why a holder is no longer there / its lock moved aside, one taker winning
      .release()                          the lock and its heartbeat removed, if still this process's

Its users: the run's output_dir (runlock.py: one run per folder, force_lock for another host's lock), a data cache
entry (data/prepcache.py: one preparer) and the merge of a start adapter (export/startfrom.py: one merger).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
import uuid
from pathlib import Path

from sftrecipes.core.jsonfile import read_json
from sftrecipes.core.procs import gone_from_this_host, identity, now_iso
from sftrecipes.run.heartbeats import Beat, beat_interval

DEFAULT_STALE_S = 120.0  # a holder silent this long has no process behind it (run.heartbeat_timeout when set)
RECORD = 512  # bytes of a holder's heartbeat record, rewritten in place


def read_holder(path: Path) -> dict | None:
    """The holder a lock file records: None when there is no such file, {} while it cannot be read (being written)."""
    return read_json(path, unreadable={})


def holder_state(held: dict) -> str:
    """'live' or 'dead' for a holder on this host, 'elsewhere' for another host's, 'unreadable'."""
    if not held.get("host") or not isinstance(held.get("pid"), int):
        return "unreadable"
    if held["host"] != socket.gethostname():
        return "elsewhere"
    if not Path("/proc/self/stat").exists():  # no procfs (not Linux): the pid alone
        try:
            os.kill(held["pid"], 0)
        except ProcessLookupError:
            return "dead"
        except PermissionError:
            pass
        return "live"
    return "dead" if gone_from_this_host(held) else "live"


class Lock:
    """The lock file `path`; `heartbeat`: where its holder's heartbeat goes (None: a lock nobody waits on, taken over
    only when its process is gone); `stale_s`: how long a silent holder is still believed alive."""

    def __init__(self, path: Path, heartbeat: Path | None = None, stale_s: float = DEFAULT_STALE_S):
        self.path, self.heartbeat, self.stale_s = path, heartbeat, stale_s
        self.token: str | None = None  # set once this process holds it
        self._beat: Beat | None = None

    def read(self) -> dict | None:
        """The holder; None when there is no lock, {} while it cannot be read (being written)."""
        return read_holder(self.path)

    def take(self, **fields) -> bool:
        """Take the lock for this process: its record (identity(), since, token and `fields`) written to a file of its
        own and hard-linked into place, which fails when the lock exists (a filesystem without hard links: created
        exclusively). False when another holds it; OSError when its folder cannot be written (the caller names its key)."""
        token = uuid.uuid4().hex
        me = json.dumps({**identity(), "since": now_iso(), "token": token, **fields})
        tmp = self.path.with_name(f"{self.path.name}.{token}")
        tmp.write_text(me)
        try:
            try:
                os.link(tmp, self.path)
            except FileExistsError:
                return False
            except OSError:  # no hard links here: exclusive create (a reader may see it empty briefly)
                try:
                    with open(self.path, "x") as f:
                        f.write(me)
                except FileExistsError:
                    return False
        finally:
            tmp.unlink(missing_ok=True)
        self.token = token
        return True

    def keep_alive(self, beat: Beat | None = None) -> Beat:
        """Start the heartbeat of the lock this process holds: `beat`, the holder's own (a Beat at self.heartbeat that
        says what the holder does, beating itself), else one of its host, pid and token, beaten by a thread every
        beat_interval(stale_s) seconds. Stopped, and its file removed, by release()."""
        if beat is None:
            who = {**identity(), "token": self.token}
            beat = Beat(self.heartbeat, lambda: who, RECORD).every(beat_interval(self.stale_s))
        self._beat = beat
        return beat

    def stale(self, held: dict) -> str | None:
        """Why the holder `held` is no longer there: its process gone from this host, or, for a lock with a heartbeat,
        its heartbeat (without one of this holder's: the lock file) last written over stale_s ago by this host's
        clock. None while it may be alive (another host's, without a heartbeat: only its owner can tell)."""
        if holder_state(held) == "dead":
            return "its process is gone"
        if self.heartbeat is None:
            return None
        beat = read_json(self.heartbeat)
        try:
            written = (self.heartbeat if beat and beat.get("token") == held.get("token") else self.path).stat().st_mtime
        except OSError:
            return None
        return f"silent for over {self.stale_s:g}s" if time.time() - written > self.stale_s else None

    def take_over(self, held: dict) -> bool:
        """Move the stale lock `held` aside (one taker wins the rename): True when that lock was moved away; False when
        there was none, or the lock there was already another taker's (that live lock is put back). take() follows."""
        aside = self.path.with_name(f"{self.path.name}.stale-{uuid.uuid4().hex}")
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return False
        moved = read_json(aside) == held
        if not moved:
            with contextlib.suppress(OSError):
                os.link(aside, self.path)
        aside.unlink(missing_ok=True)
        return moved

    def release(self) -> None:
        """Stop the heartbeat; remove the lock and its heartbeat file if still this process's (a process that took
        the lock over meanwhile keeps its own)."""
        if self._beat is not None:
            self._beat.stop()
            self._beat = None
        if self.token is None:  # never taken
            return
        if (self.read() or {}).get("token") == self.token:
            self.path.unlink(missing_ok=True)
        if self.heartbeat is not None and (read_json(self.heartbeat) or {}).get("token") == self.token:
            self.heartbeat.unlink(missing_ok=True)

"""One run per output_dir: <output_dir>/.sftrecipes.lock names the host, pid and start time of the run that holds the
folder; taking it is atomic, and a dead holder's (or, with force_lock, another host's) lock is taken over.

    take_lock/check_lock   take the lock for this process / check, read-only, that this run may take it
    Lock.release()         remove it if still ours, and the folders taking it created if empty again
"""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
import uuid
from pathlib import Path

from sftrecipes.core.errors import RecipeError
from sftrecipes.core.procs import gone_from_this_host, identity, now_iso, read_holder

log = logging.getLogger("sftrecipes")

LOCK = ".sftrecipes.lock"


class LockHeld(RecipeError):
    """Another run holds the output_dir (one line naming it; exit 2)."""


def read_lock(out: Path) -> dict | None:
    """The holder recorded in <out>/.sftrecipes.lock; None when there is no lock, {} when it is unreadable."""
    return read_holder(out / LOCK)


def describe(held: dict) -> str:
    return f"host {held.get('host')}, pid {held.get('pid')}, since {held.get('since')}"


def _holder_state(held: dict) -> str:
    """'live' or 'dead' for a holder on this host, 'elsewhere' for another host, 'unreadable'."""
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


def slurm_attempt() -> dict:
    """This process's SLURM job and attempt ({} outside SLURM), recorded in the lock."""
    job = os.environ.get("SLURM_JOB_ID")
    return {"slurm_job": job, "slurm_restart": int(os.environ.get("SLURM_RESTART_COUNT") or 0)} if job else {}


def _refuse_or_reason(out: Path, held: dict, force: bool) -> str:
    """Why a lock may be taken over ('its process is gone', 'force_lock'), or LockHeld naming its holder."""
    mine = slurm_attempt()
    if mine and held.get("slurm_job") == mine["slurm_job"] and int(held.get("slurm_restart", 0)) < mine["slurm_restart"]:
        # a requeued job may start on another node; SLURM ended the earlier attempt's processes before restarting it
        return f"an earlier attempt of SLURM job {mine['slurm_job']} held it (requeued)"
    state = _holder_state(held)
    if state == "dead":
        return "its process is gone"
    if state == "live":
        raise LockHeld(f"output_dir: {out} is in use by another run ({describe(held)}); wait for it to end, or set "
                       "another output_dir")
    if force:
        return "force_lock: true"
    if state == "elsewhere":
        raise LockHeld(f"output_dir: {out} is locked by a run on another host ({describe(held)}); if that run is over "
                       "(a crash leaves its lock), set force_lock: true, else wait for it or set another output_dir")
    raise LockHeld(f"output_dir: {out / LOCK} is unreadable; if no run uses {out}, set force_lock: true (or delete the file)")


class Lock:
    """The lock this process took on an output_dir (`created`: the folders taking it created, deepest first)."""

    def __init__(self, path: Path, token: str, created: list[Path] | None = None):
        self.path, self.token, self.created = path, token, created or []

    def release(self) -> None:
        """Remove the lock file if it is still ours (a run that took it over after a crash keeps its own), and the
        folders taking it created if they are empty again: a run that failed before writing leaves nothing."""
        if (read_lock(self.path.parent) or {}).get("token") == self.token:
            self.path.unlink(missing_ok=True)
        for folder in self.created:
            try:
                folder.rmdir()
            except OSError:
                break


def check_lock(out: Path, force: bool = False, token: str | None = None) -> None:
    """Read-only: LockHeld unless output_dir is free, held by the run `token` names, or held by a dead run."""
    held = read_lock(out)
    if held is not None and not (token and held.get("token") == token):
        _refuse_or_reason(out, held, force)


def take_lock(out: Path, force: bool = False) -> Lock:
    """Take <out>/.sftrecipes.lock for this process (host, pid, its start time, since). Atomic: the record is written
    to a file of its own and hard-linked into place, which fails when the lock exists. A stale lock (holder dead on
    this host; another host's with force) is moved aside and taken over, with a log line."""
    created, p = [], out.absolute()
    while not p.exists():
        created.append(p)
        p = p.parent
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise RecipeError(f"output_dir: cannot create '{out}' ({e.strerror}); set output_dir to a writable folder") from None
    me = {**identity(), "since": now_iso(),
          "token": uuid.uuid4().hex, "command": " ".join(sys.argv[:4]), **slurm_attempt()}
    path, tmp, aside = out / LOCK, out / f"{LOCK}.{me['token']}", out / f"{LOCK}.{me['token']}.stale"
    tmp.write_text(json.dumps(me))
    try:
        for _ in range(10):
            try:
                os.link(tmp, path)
                return Lock(path, me["token"], created)
            except FileExistsError:
                pass
            except OSError:  # a filesystem without hard links: exclusive create (a reader may see it empty briefly)
                try:
                    with open(path, "x") as f:
                        f.write(json.dumps(me))
                    return Lock(path, me["token"], created)
                except FileExistsError:
                    pass
            held = read_lock(out)
            if held is None:
                continue  # released meanwhile
            why = _refuse_or_reason(out, held, force)
            try:
                os.rename(path, aside)  # one taker wins the rename
            except FileNotFoundError:
                continue
            if _read_json(aside) != held:  # another run took it over first: we moved its live lock, put it back
                try:
                    os.link(aside, path)
                except FileExistsError:
                    pass
                aside.unlink(missing_ok=True)
                continue
            aside.unlink(missing_ok=True)
            log.warning("lock: taking over %s from %s (%s)", path, describe(held), why)
        raise RecipeError(f"output_dir: could not take the lock {path}: other runs keep taking it; start one run per output_dir")
    finally:
        tmp.unlink(missing_ok=True)


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None

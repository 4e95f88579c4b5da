"""One run per output_dir: <output_dir>/.sftrecipes.lock (the one lock, lock.py) names the host, pid and start time of
the run that holds the folder; who may take it over: a dead holder's run, an earlier attempt of the same requeued SLURM
job, with force_lock a run on another host; anyone else is refused in one line (LockHeld, exit 2).

    take_lock/check_lock   take the lock for this process / check, read-only, that this run may take it
    Lock.release()         remove it if still ours, and the folders taking it created if empty again
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

from sftrecipes.core.errors import RecipeError
from sftrecipes.run import lock as locks

log = logging.getLogger("sftrecipes")

LOCK = ".sftrecipes.lock"


class LockHeld(RecipeError):
    """Another run holds the output_dir (one line naming it; exit 2)."""


def read_lock(out: Path) -> dict | None:
    """The holder recorded in <out>/.sftrecipes.lock; None when there is no lock, {} when it is unreadable."""
    return locks.read_holder(out / LOCK)


def describe(held: dict) -> str:
    return f"host {held.get('host')}, pid {held.get('pid')}, since {held.get('since')}"


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
    state = locks.holder_state(held)
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


class Lock(locks.Lock):
    """The lock this process took on an output_dir (`created`: the folders taking it created, deepest first)."""

    def __init__(self, out: Path, created: list[Path] | None = None):
        super().__init__(out / LOCK)
        self.created = created or []

    def release(self) -> None:
        """Remove the lock file if it is still ours (a run that took it over after a crash keeps its own), and the
        folders taking it created if they are empty again: a run that failed before writing leaves nothing."""
        super().release()
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
    """Take <out>/.sftrecipes.lock for this process (host, pid, its start time, since, the command; Lock.take: atomic).
    A stale lock (holder dead on this host; an earlier attempt of this SLURM job; another host's with force) is moved
    aside and taken over, with a log line."""
    created, p = [], out.absolute()
    while not p.exists():
        created.append(p)
        p = p.parent
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise RecipeError(f"output_dir: cannot create '{out}' ({e.strerror}); set output_dir to a writable folder") from None
    lock = Lock(out, created)
    for _ in range(10):
        if lock.take(command=" ".join(sys.argv[:4]), **slurm_attempt()):
            return lock
        held = read_lock(out)
        if held is None:
            continue  # released meanwhile
        why = _refuse_or_reason(out, held, force)
        if lock.take_over(held):  # (else another run took it over first)
            log.warning("lock: taking over %s from %s (%s)", lock.path, describe(held), why)
    raise RecipeError(f"output_dir: could not take the lock {lock.path}: other runs keep taking it; start one run per output_dir")

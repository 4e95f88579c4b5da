"""A process as Linux shows it: which process a pid names (with its start time, even after the pid is reused), its
state, its death with the process that started it, and the local time stamp the run's records carry."""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import sys
from datetime import datetime, timezone
from pathlib import Path


def now_iso() -> str:
    return datetime.now(timezone.utc).astimezone().isoformat(timespec="seconds")


def _stat(pid: int) -> list[str] | None:
    """Fields of /proc/<pid>/stat after the command name (state first), None when there is no such process."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def proc_start(pid: int) -> int | None:
    """When the process started (clock ticks since boot): a pid and its start time name one process, even after the
    pid is reused. None when there is no such process."""
    fields = _stat(pid)
    return int(fields[19]) if fields else None


def proc_state(pid: int) -> str:
    """'stopped', 'gone' or 'running' (a zombie is gone: it runs nothing)."""
    fields = _stat(pid)
    if not fields or fields[0] in ("Z", "X"):
        return "gone"
    return "stopped" if fields[0] in ("T", "t") else "running"


def identity() -> dict:
    """This process as a lock or record names it: host, pid and the pid's start time."""
    return {"host": socket.gethostname(), "pid": os.getpid(), "pid_start": proc_start(os.getpid())}


def gone_from_this_host(held: dict) -> bool:
    """A record's process (identity()) on this host that has ended, or whose pid now names another process; False for
    another host's (nothing here can tell) or a record without a pid."""
    if held.get("host") != socket.gethostname() or not isinstance(held.get("pid"), int):
        return False
    start = proc_start(held["pid"])
    return start is None or proc_state(held["pid"]) == "gone" or held.get("pid_start") not in (None, start)


def die_with_parent(parent: int | None = None) -> None:
    """Ask Linux to SIGKILL this process when the thread that started it ends (prctl PR_SET_PDEATHSIG), then make
    sure that parent was still there when asked (`parent`: its pid, read before). Nothing elsewhere than Linux."""
    if not sys.platform.startswith("linux"):
        return
    ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL), 0, 0, 0)  # 1 = PR_SET_PDEATHSIG
    if parent is not None and os.getppid() != parent:
        os._exit(1)

"""This process's resident pages of memory-mapped Arrow files (datasets' tables) handed back as it reads them, so that a
pass over a whole split holds no more of it in RSS than what was read since the last release.

datasets memory-maps every Arrow file it reads (the source's copy, a map's output, a cache entry), read-only and
private; each page a read touches stays mapped into the process, and counts in its RSS, until the mapping goes: a
process that reads a 2.5 GB split once shows 2.5 GB more RSS at its end, though every such page is the page cache's
and nothing of its own. madvise(MADV_DONTNEED) unmaps the touched pages and keeps the mapping: a later read faults them
in again from the file (or from the page cache, which keeps them as long as the kernel likes). Only mappings that
cannot hold a page of their own are released: read-only ones (datasets maps `r--p`). Torch-free, /proc and libc only;
does nothing where either is missing.
"""

from __future__ import annotations

import contextlib
import ctypes
import platform
import threading

MADV_DONTNEED = 4  # sys/mman.h
SUFFIX = ".arrow"
INTERVAL_S = 0.25  # how often the preparer's thread releases while it prepares (passes read ~100-300 MB/s here)

_libc = None


def _madvise():
    global _libc
    if _libc is None:
        try:
            _libc = ctypes.CDLL(None) if platform.system() == "Linux" else False
        except OSError:
            _libc = False
    return _libc.madvise if _libc else None


def read_only_mappings(suffix: str = SUFFIX) -> list[tuple[int, int]]:
    """(start, end) of this process's read-only mappings of files whose name ends with suffix, from /proc/self/maps
    (which the kernel writes without walking pages); [] without /proc."""
    try:
        with open("/proc/self/maps") as f:
            lines = [line.split(maxsplit=5) for line in f.read().splitlines() if line.endswith(suffix)]
    except OSError:
        return []
    return [tuple(int(x, 16) for x in parts[0].split("-")) for parts in lines if len(parts) == 6 and "w" not in parts[1]]


def release(suffix: str = SUFFIX) -> int:
    """Unmap the touched pages of every read-only mapping of an Arrow file in this process; bytes of mappings advised
    (0 where there is no /proc or libc)."""
    madvise = _madvise()
    if madvise is None:
        return 0
    done = 0
    for start, end in read_only_mappings(suffix):
        if madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), MADV_DONTNEED) == 0:
            done += end - start
    return done


@contextlib.contextmanager
def released_while(interval: float = INTERVAL_S):
    """A thread of this process releasing its Arrow pages every `interval` seconds while the block runs (datasets' and
    TRL's own passes over a split read it there, where no call of ours sits between two batches), and once at the end.
    Processes forked inside the block (datasets' workers) do not inherit the thread: they release on their own
    (tokenization._prepare_batch)."""
    stop = threading.Event()

    def loop():
        while not stop.wait(interval):
            release()

    thread = threading.Thread(target=loop, name="sftrecipes-arrowmem", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=10)
        release()

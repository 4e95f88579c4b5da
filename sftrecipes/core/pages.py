"""The pages of this process's file mappings, from /proc (torch-free: the planner uses it before torch loads).

How many pages of a mapped file one touch makes resident is the machine's, not the program's: where the page cache
holds 4 KiB pages the kernel maps the 64 KiB around the touched page (its fault-around), where it holds large folios
(tmpfs with huge=, filesystems with large-folio support) Linux 6.18 maps the whole folio, up to 2 MiB. A rank's
libraries are such mappings (141 MB of them before loading on ext4 here, 267 MB from a tmpfs with huge=always, for
the same 387 MB of the process's own), and so is a memory-mapped checkpoint that is touched in places
(fault_bytes measures it for the planner)."""

from __future__ import annotations

import mmap
import os
from pathlib import Path

PAGE = mmap.PAGESIZE
FAULT_AROUND = 64 << 10  # Linux's default fault_around_bytes: 16 pages around a faulting page of a mapped file


def file_mappings(suffix: str) -> list[tuple[int, int]]:
    """This process's mappings of files whose name ends with suffix: (start, end) addresses; [] without /proc. From
    /proc/self/maps, which the kernel writes without walking the pages (smaps below does)."""
    spans = []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.split(maxsplit=5)
                if len(parts) == 6 and parts[5].rstrip("\n").endswith(suffix):
                    start, end = (int(x, 16) for x in parts[0].split("-"))
                    spans.append((start, end))
    except OSError:
        return []
    return spans


def smaps(fields: tuple[str, ...] = ("Rss", "Anonymous")):
    """This process's mappings from /proc/self/smaps, each (start, end, perms, path, {field: kB} of the fields asked
    for); nothing without /proc. path is "" for an anonymous mapping, "[heap]" and the like for the kernel's."""
    want = {f + ":" for f in fields}
    try:
        with open("/proc/self/smaps") as f:
            lines = f.read().splitlines()
    except OSError:
        return
    cur = None
    for line in lines:
        head = line.split(maxsplit=5)
        if not head:
            continue
        if head[0] in want:
            if cur is not None:
                cur[4][head[0][:-1]] = int(head[1])
        elif "-" in head[0] and len(head) >= 5 and not head[0].endswith(":"):  # a mapping's first line
            if cur is not None:
                yield cur
            start, end = (int(x, 16) for x in head[0].split("-"))
            cur = (start, end, head[1], head[5] if len(head) == 6 else "", {})
    if cur is not None:
        yield cur


def fault_bytes(path: str | os.PathLike, samples: int = 8) -> int:
    """The bytes of a file that one touch of its mapping makes resident here, on average over `samples` touches spread
    over the file (the touched pages' page-cache folios, or the kernel's fault-around): read from this process's own
    mapping in /proc/self/smaps. FAULT_AROUND where it cannot be read (no /proc, an empty or unreadable file)."""
    try:
        size = Path(path).stat().st_size
        if size < PAGE * samples:
            return FAULT_AROUND
        with open(path, "rb") as f, mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ) as m:
            for i in range(samples):  # the middle of each of `samples` equal spans: far apart, as a checkpoint's tensors
                m[(size * (2 * i + 1) // (2 * samples)) // PAGE * PAGE]
            name = str(Path(path).resolve())  # as /proc names the mapping
            ours = [f_["Rss"] for _s, _e, _p, p_, f_ in smaps(("Rss",)) if p_ == name]
        if len(ours) != 1:
            return FAULT_AROUND
        return max(PAGE, ours[0] * 1024 // samples)
    except (OSError, ValueError):
        return FAULT_AROUND

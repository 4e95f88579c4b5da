"""What a rank's heap keeps after loading: a fixed glibc mmap threshold while the weights load, then the freed heap
handed back.

glibc adapts its mmap threshold as large blocks are freed: after the first freed block of a few MB (a tensor read,
converted or quantized and dropped), blocks of that size come from the heap instead, where a freed one stays resident
whenever anything allocated after it is still live. Loading a model frees such temporaries by the hundred, so what a
rank holds after loading depended on the order they happened to be freed in: the same QLoRA load of a 253M model
held 0.70 GB in one run and 1.73 GB in the next (docs/loading.md). With the threshold fixed while loading, every
large temporary is its own mapping and goes back to the kernel when freed (as long as no freed heap chunk is large
enough to be cut from: so in a rank's fresh process, where loading happens, not in one that has already freed large
heap blocks); the same load then peaks at 0.72-0.75 GB in every run. After loading, the heap's freed memory is
returned (malloc_trim) and the threshold is set to 32 MiB, the ceiling glibc's own adaptation reaches in a process that
has freed large blocks (training's allocation speed was not measured against the default).

Nothing is changed where the C library is not glibc, or where MALLOC_MMAP_THRESHOLD_ is set (the user's choice)."""

from __future__ import annotations

import contextlib
import ctypes
import os
import platform

M_MMAP_THRESHOLD = -3  # mallopt parameter (malloc.h)
LOADING_THRESHOLD = 1 << 20  # 1 MiB: blocks below it (small tensors, Python objects) keep the heap's reuse
AFTER_THRESHOLD = 32 << 20  # glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit: where its adaptation ends up


def _glibc():
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc" or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return None
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


@contextlib.contextmanager
def steady_heap():
    """Within: large blocks are mapped and unmapped on their own (a fixed mmap threshold). On leaving: the heap's free
    memory goes back to the kernel and the threshold is left at glibc's adaptive ceiling. True inside where it acts."""
    libc = _glibc()
    if libc is None or not libc.mallopt(M_MMAP_THRESHOLD, LOADING_THRESHOLD):
        yield False
        return
    try:
        yield True
    finally:
        libc.malloc_trim(0)
        libc.mallopt(M_MMAP_THRESHOLD, AFTER_THRESHOLD)

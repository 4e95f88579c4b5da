"""What a rank's heap keeps: a fixed glibc mmap threshold while the weights load (128 KiB) and in a training run on to
the end of its first steps (1 MiB), then the freed heap handed back.

glibc adapts its mmap threshold as large blocks are freed: after the first freed block of a few MB (a tensor read,
converted or quantized and dropped), blocks of that size come from the heap instead, where a freed one stays resident
whenever anything allocated after it is still live. Loading a model frees such temporaries by the hundred, so what a
rank holds after loading depended on the order they happened to be freed in: the same QLoRA load of a 253M model
held 0.70 GB in one run and 1.73 GB in the next (docs/loading.md). With the threshold fixed while loading, every
large temporary is its own mapping and goes back to the kernel when freed (as long as no freed heap chunk is large
enough to be cut from: so in a rank's fresh process, where loading happens, not in one that has already freed large
heap blocks); the same load then peaks at 0.72-0.75 GB in every run. After loading, the heap's freed memory is
returned (malloc_trim) and the thresholds are set where glibc's own adaptation ends up in a process that has freed large
blocks: mmap at 32 MiB, trim at 64 MiB (with the trim threshold left at its start, every training step gave back the
heap's top and faulted it in again: measured against bare TRL in make bench-dpo). A training run holds the threshold
fixed on through wrapping and its first steps (hold_steady/release, called by probes.PhaseMemory), where the same
adaptation kept up to 2.5 GB of freed blocks resident per rank, so that what those phases measure is what they use.

Nothing is changed where the C library is not glibc, or where MALLOC_MMAP_THRESHOLD_ is set (the user's choice)."""

from __future__ import annotations

import contextlib
import ctypes
import os
import platform

import torch

from sftrecipes.core import pages

M_MMAP_THRESHOLD = -3  # mallopt parameters (malloc.h)
M_TRIM_THRESHOLD = -1
# while the weights load: glibc's own starting threshold, held. With 1 MiB, the sub-MiB tensors a 16-bit ZeRO-3 load
# creates whole and frees once partitioned left holes in the heap until loading ended: at 25.7M parameters (weights
# of 0.5-1.5 MB) rank 1's loading peaked 8-23 MB above what it then held; at 128 KiB, 3 MB above it
LOADING_THRESHOLD = 128 << 10
STEPS_THRESHOLD = 1 << 20  # held through wrapping and the first steps: smaller blocks (Python objects) keep the heap's reuse
AFTER_THRESHOLD = 32 << 20  # glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit: where its adaptation ends up
AFTER_TRIM = 2 * AFTER_THRESHOLD  # what glibc's adaptation sets the trim threshold to with it (malloc.c: free())


def _libc():
    """The C library (madvise), wherever it is glibc's or another's; None where it cannot be loaded."""
    if platform.system() != "Linux":
        return None
    try:
        return ctypes.CDLL(None)
    except OSError:
        return None


def _glibc():
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc" or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return None
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


_held = False  # hold_steady() acted and release() has not run yet


def hold_steady() -> bool:
    """Fix the mmap threshold (STEPS_THRESHOLD) until release(): every large block is then its own mapping, handed
    back to the kernel when freed, so the process's RSS follows what is live. A training run holds it from loading to
    the end of its first steps (probes.PhaseMemory), so each phase's peak is the memory the phase uses, not the heap
    glibc kept from earlier ones: at 253M parameters on 2 ranks the ZeRO-3 LoRA twin's first steps peaked at 1.04-1.09 GB
    with the adaptive threshold and 0.91 GB held steady, FSDP2 full fine-tuning's at 3.80-3.93 GB and 2.19-2.20 GB
    (docs/loading.md). Not for a whole run: every large block faulted in anew cost 16-32% of those twins' steps. True
    where it acts (glibc, no MALLOC_MMAP_THRESHOLD_ of the user's)."""
    global _held
    libc = _glibc()
    if _held or libc is None or not libc.mallopt(M_MMAP_THRESHOLD, STEPS_THRESHOLD):
        return _held
    _held = True
    return True


def release() -> None:
    """End hold_steady(): the heap's free memory goes back to the kernel and the thresholds are left where glibc's own
    adaptation ends up in a process that has freed large blocks."""
    global _held
    libc = _glibc()
    if not _held or libc is None:
        return
    _held = False
    libc.malloc_trim(0)
    libc.mallopt(M_MMAP_THRESHOLD, AFTER_THRESHOLD)
    if "MALLOC_TRIM_THRESHOLD_" not in os.environ:
        # a threshold set by hand stops glibc's adaptation of both: left at its 128 KiB start, the heap's top was
        # handed back and faulted in again in every step (DPO, tiny model, 150 steps: 424 page faults per step more
        # than with it raised, 187 more than bare TRL; make bench-dpo)
        libc.mallopt(M_TRIM_THRESHOLD, AFTER_TRIM)


@contextlib.contextmanager
def steady_heap():
    """Within: blocks of LOADING_THRESHOLD and more are mapped and unmapped on their own (hold_steady, at the loading's
    threshold). On leaving: release(), unless a hold from outside (a training run's, to the end of its first steps) was
    already on; then the hold's own threshold again, and what the block freed on the heap goes back (what a rank holds
    after loading). True inside where it acts."""
    outer = _held
    acting = hold_steady() and bool(_glibc().mallopt(M_MMAP_THRESHOLD, LOADING_THRESHOLD))
    try:
        yield acting
    finally:
        if not outer:
            release()
        elif acting:
            _glibc().mallopt(M_MMAP_THRESHOLD, STEPS_THRESHOLD)
            _glibc().malloc_trim(0)


MADV_DONTNEED = 4  # sys/mman.h


def _unwritten_mappings(suffix: str) -> list[tuple[int, int]]:
    """This process's mappings of files whose name ends with suffix that hold no page of their own: read-only, or
    private and writable but never written (/proc/self/smaps: `Anonymous: 0 kB`, no page copied on write); [] without
    /proc. torch maps a safetensors file private and writable (rw-p)."""
    return [(start, end) for start, end, perms, path, f in pages.smaps(("Anonymous",))
            if path.endswith(suffix) and ("w" not in perms or f.get("Anonymous", 0) == 0)]


def drop_checkpoint_pages() -> int:
    """Unmap from this process the pages of its safetensors mappings it has touched (madvise DONTNEED), where the
    mapping holds nothing of its own (_unwritten_mappings): the mappings stay, and a later read faults its page in
    again from the file. Called by quantload once each decoder layer of a 4-bit load is quantized and partitioned or sent:
    the layer's 16-bit weights are read, and without this every page of the checkpoint the loading had read stayed
    in the rank's RSS until loading ended (505 MB of a 253M model, against the layer's 32 MB). Then the heap's free
    memory goes back too (malloc_trim): the small blocks a layer's quantization frees had grown the rank's RSS by
    4.5 MB a layer until loading ended. Bytes of mappings advised; 0 where there is no /proc or no libc."""
    spans = _unwritten_mappings(".safetensors")
    libc = _libc()
    if libc is None:
        return 0
    done = 0
    for start, end in spans:
        if libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), MADV_DONTNEED) == 0:
            done += end - start
    glibc = _glibc()
    if glibc is not None:  # and the layer's freed small blocks (its quantization's, below the mmap threshold)
        glibc.malloc_trim(0)
    return done


def own_checkpoint_views(model) -> int:
    """Copy into the process's own memory every parameter and buffer that is still a view into a mapped safetensors
    file; the count copied. Called after a quantized load: on CPU, bitsandbytes quantizes the linear weights into new
    tensors but leaves the rest (norms, embeddings, lm_head) as views into the checkpoint's mapping, which then stays
    mapped with every page the quantization read still resident: 480 MB of a 505 MB checkpoint for 2 MB of norms and
    head at 253M parameters, on every rank, for the whole run (docs/loading.md). Copying the views lets the mapping
    go; what was copied is needed anyway. Not for 16-bit loads: there the mapping is the weights themselves."""
    spans = pages.file_mappings(".safetensors")
    copied = 0
    for module in model.modules() if spans else ():
        for store in (module._parameters, module._buffers):
            for name, t in list(store.items()):
                if t is None or t.device.type != "cpu":
                    continue
                if any(a <= t.untyped_storage().data_ptr() < b for a, b in spans):  # a tied weight only the first time
                    if isinstance(t, torch.nn.Parameter):
                        t.data = t.data.clone()  # the same Parameter: tied weights stay tied
                    else:
                        store[name] = t.clone()
                    copied += 1
    return copied

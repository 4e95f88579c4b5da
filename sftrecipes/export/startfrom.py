"""The merge a run from a LoRA adapter starts with (`ensure`): the adapter merged into its base once, into
<adapter>-merged (facts/startmodel.py: where, and whether it is this adapter's), by the first process to take the
lock; the others wait on its files.

    <adapter>-merged/               the merged model (config, safetensors, tokenizer), then start_merge.json, last
    <adapter>-merged.lock           while one process merges (run/lock.py: host, pid, token)
    <adapter>-merged.heartbeat.json its heartbeat, rewritten every few seconds while it merges

The merge is the one `python -m sftrecipes merge` does (export/merge.py: streamed, any backend's adapter, QLoRA's into
the unquantized base). The processes that load weights call `ensure` first: `launch` and `prepare` before any rank
starts, and every rank of train.py (a rank run without them); a waiting process fails in no collective (ddp_timeout
does not apply), and takes the merge over from a merger gone from this host or silent for the bound.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
import uuid
from pathlib import Path

from sftrecipes.core.errors import RecipeError
from sftrecipes.core.procs import now_iso
from sftrecipes.export.merge import merge_lora
from sftrecipes.facts.startmodel import RECORD, adapter_of, base_of, fingerprint, merge_record, merged_dir
from sftrecipes.run.lock import DEFAULT_STALE_S, Lock

log = logging.getLogger("sftrecipes")

POLL_S = 0.5
PROGRESS_S = 30.0


def ensure(name_or_path: str, stale_s: float = 0.0) -> Path | None:
    """For an adapter: its merged folder, complete and made from this adapter (merged here, reused, or waited for while
    another process merges it); None for any other model_name_or_path. Logs which. `stale_s`: how long a silent
    merger is waited for (run.heartbeat_timeout; 0: DEFAULT_STALE_S)."""
    adapter = adapter_of(name_or_path)
    if adapter is None:
        return None
    dest, want = merged_dir(adapter), fingerprint(adapter)
    lock = Lock(dest.parent / f"{dest.name}.lock", dest.parent / f"{dest.name}.heartbeat.json", float(stale_s or DEFAULT_STALE_S))
    start, said, waited = time.monotonic(), time.monotonic(), False
    while True:
        rec = merge_record(dest)
        if rec is not None and rec.get("adapter_sha256") == want:
            if waited or os.environ.get("RANK", "0") == "0":  # (every rank checks; rank 0 says it)
                log.info("model: starting from the LoRA adapter %s merged into its base %s: %s (%s)", adapter,
                         rec.get("base"), dest, f"merged by another process, waited {time.monotonic() - start:.0f}s"
                         if waited else "reused: merged from this adapter before")
            return dest
        if _take(lock):
            lock.keep_alive()
            try:
                rec = merge_record(dest)  # finished between the look and the lock
                if rec is not None and rec.get("adapter_sha256") == want:
                    continue
                return _merge(adapter, dest, want, rebuilt=rec is not None)
            finally:
                lock.release()
        held = lock.read()
        why = lock.stale(held) if held else None
        if why:
            log.warning("model: taking over the merge of %s from host %s pid %s (%s)", adapter, held.get("host"),
                        held.get("pid"), why)
            lock.take_over(held)
            continue
        if not waited:
            waited = True
            log.info("model: host %s pid %s merges the adapter %s into %s; waiting for it (no collective: ddp_timeout "
                     "does not apply)", (held or {}).get("host"), (held or {}).get("pid"), adapter, dest)
        elif time.monotonic() - said > PROGRESS_S:
            said = time.monotonic()
            log.info("model: still waiting for the merge of %s (%.0fs so far)", adapter, time.monotonic() - start)
        time.sleep(POLL_S)


def _take(lock: Lock) -> bool:
    try:
        return lock.take(rank=int(os.environ.get("RANK", "0")))
    except OSError as e:
        raise RecipeError(f"model_name_or_path: cannot write beside the adapter in '{lock.path.parent}' ({e.strerror}) "
                          "to merge it; merge it yourself into a writable folder (python -m sftrecipes merge ADAPTER "
                          "OUT) and set model_name_or_path to OUT") from None


def _merge(adapter: Path, dest: Path, want: str, rebuilt: bool) -> Path:
    """Merge into a fresh folder beside dest, then put it in dest's place (an older merge of a retrained adapter moved
    aside and removed); the record last."""
    begin = time.monotonic()
    base = base_of(adapter)
    log.info("model: merging the LoRA adapter %s into its base %s -> %s (%s; streamed, as `python -m sftrecipes merge` "
             "does)", adapter, base, dest, "the adapter changed since the last merge" if rebuilt else "first run from it")
    staging = dest.parent / f".{dest.name}.partial-{uuid.uuid4().hex[:8]}"
    try:
        merge_lora(adapter, staging)
        (staging / RECORD).write_text(json.dumps({"adapter": str(adapter.resolve()), "adapter_sha256": want, "base": base,
                                                  "merged_at": now_iso(), "seconds": round(time.monotonic() - begin, 2)}))
        if dest.exists():
            old = dest.parent / f".{dest.name}.old-{uuid.uuid4().hex[:8]}"
            os.rename(dest, old)
            shutil.rmtree(old, ignore_errors=True)
        os.rename(staging, dest)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    log.info("model: merged in %.1fs; every run from this adapter reuses %s", time.monotonic() - begin, dest)
    return dest

"""A run that starts from a LoRA adapter (an SFT run's output, say, for DPO after SFT): model_name_or_path names the
adapter folder, and the run trains from the adapter merged into its base.

The merge is the one `python -m sftrecipes merge` does (export/merge.py: streamed, any backend's adapter, QLoRA's into
the unquantized base), written once beside the adapter and reused by every run that starts from the same adapter:

    <adapter>/                      adapter_config.json, adapter_model.safetensors, the SFT run's tokenizer
    <adapter>-merged/               the merged model (config, safetensors, tokenizer), then start_merge.json, last
    <adapter>-merged.lock           while one process merges (host, pid; rewritten every few seconds)

start_merge.json holds the adapter's fingerprint (sha256 of its two files): a retrained adapter is merged again, an
unchanged one reused. A folder at that place not made this way (no start_merge.json) is never overwritten: one line.

Torch-free readers (the planner, pre-flight, the weights check) read the base the adapter names, which has the merged
model's config and tensor layout. The processes that load weights call `ensure` first: `launch` and `prepare` before
any rank starts, and every rank of train.py (a rank run without them): the first to take the lock merges, the others
wait on its files (no collective: ddp_timeout does not apply) and fail in one line if it stops beating.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import threading
import time
import uuid
from pathlib import Path

from sftrecipes.core.errors import RecipeError
from sftrecipes.core.procs import gone_from_this_host, identity, now_iso, read_holder

log = logging.getLogger("sftrecipes")

RECORD = "start_merge.json"
BEAT_S = 5.0  # how often the merging process rewrites its lock
DEFAULT_STALE_S = 120.0  # a lock not rewritten for this long (run.heartbeat_timeout when set) has no process behind it
POLL_S = 0.5
PROGRESS_S = 30.0


def adapter_of(name_or_path: str | None) -> Path | None:
    """The adapter folder a model_name_or_path names (adapter_config.json and no config.json), else None."""
    if not name_or_path:
        return None
    p = Path(name_or_path).expanduser()
    return p if (p / "adapter_config.json").is_file() and not (p / "config.json").is_file() else None


def base_of(adapter: Path) -> str:
    """The base model the adapter was trained on (its adapter_config.json's base_model_name_or_path), as written: a
    folder (relative to where the SFT run ran, as peft writes it) or a hub id."""
    base = json.loads((adapter / "adapter_config.json").read_text()).get("base_model_name_or_path")
    if not base:
        raise RecipeError(f"model_name_or_path: the adapter '{adapter}' names no base model (adapter_config.json has no "
                          "base_model_name_or_path); set it there, or merge it yourself (python -m sftrecipes merge "
                          f"{adapter} OUT --base BASE) and set model_name_or_path to OUT")
    return base


def torch_free_source(name_or_path: str) -> str:
    """What the torch-free readers (config, tensor layout, weights check) read for model_name_or_path: the adapter's
    base for an adapter folder (the merged model has its config and tensors), else the name itself."""
    adapter = adapter_of(name_or_path)
    return base_of(adapter) if adapter is not None else name_or_path


def merged_dir(adapter: Path) -> Path:
    return adapter.parent / f"{adapter.name}-merged"


def weights_dir(name_or_path: str) -> str:
    """The folder the run loads its weights from: the merged folder for an adapter (`ensure` built it), else the name."""
    adapter = adapter_of(name_or_path)
    return str(merged_dir(adapter)) if adapter is not None else name_or_path


def fingerprint(adapter: Path) -> str:
    h = hashlib.sha256()
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        with open(adapter / name, "rb") as f:
            while chunk := f.read(1 << 24):
                h.update(chunk)
    return h.hexdigest()


def _record(dest: Path) -> dict | None:
    try:
        value = json.loads((dest / RECORD).read_text())
        return value if isinstance(value, dict) else None
    except (OSError, ValueError):
        return None


def check(adapter: Path) -> None:
    """Torch-free, at recipe validation: the adapter merges (LoRA, an init the base still applies to), its base is
    named and unquantized where it is a local folder, and the place of the merged folder is free or this project's."""
    from sftrecipes.facts.folders import adapter_config, merge_base

    cfg = adapter_config(adapter)
    base = base_of(adapter)
    if Path(base).expanduser().is_dir():
        merge_base(cfg, None)
    dest = merged_dir(adapter)
    if dest.exists() and _record(dest) is None:
        raise RecipeError(f"model_name_or_path: the adapter '{adapter}' would be merged into '{dest}', which exists and "
                          f"was not merged there by a run ({RECORD} is missing); move it away, or set model_name_or_path "
                          "to it if it is this adapter merged")


class _Lock:
    """<dest>.lock, taken atomically; rewritten every BEAT_S by a thread while held (its mtime is the heartbeat)."""

    def __init__(self, dest: Path):
        self.path = dest.parent / f"{dest.name}.lock"
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def read(self) -> dict | None:
        return read_holder(self.path)  # None: no lock; {}: being written

    def age(self) -> float:
        try:
            return time.time() - self.path.stat().st_mtime
        except OSError:
            return 0.0

    def take(self) -> bool:
        me = {**identity(), "rank": int(os.environ.get("RANK", "0")), "since": now_iso(), "token": uuid.uuid4().hex}
        try:
            with open(self.path, "x") as f:
                f.write(json.dumps(me))
        except FileExistsError:
            return False
        except OSError as e:
            raise RecipeError(f"model_name_or_path: cannot write beside the adapter in '{self.path.parent}' ({e.strerror}) "
                              "to merge it; merge it yourself into a writable folder (python -m sftrecipes merge ADAPTER "
                              "OUT) and set model_name_or_path to OUT") from None
        self._thread = threading.Thread(target=self._beat, name="sftrecipes-startmerge", daemon=True)
        self._thread.start()
        return True

    def _beat(self) -> None:
        while not self._stop.wait(BEAT_S):
            with contextlib.suppress(OSError):
                os.utime(self.path)

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        self.path.unlink(missing_ok=True)

    def holder_gone(self, held: dict, stale_s: float) -> bool:
        """The holder's process is gone from this host, or the lock has not been rewritten for stale_s."""
        return gone_from_this_host(held) or self.age() > stale_s

    def break_stale(self, held: dict) -> None:
        aside = self.path.parent / f"{self.path.name}.stale-{uuid.uuid4().hex}"
        with contextlib.suppress(OSError):
            os.rename(self.path, aside)
            if (read_holder(aside) or {}).get("token") != held.get("token"):  # another process broke it first
                with contextlib.suppress(FileExistsError, OSError):
                    os.link(aside, self.path)
            aside.unlink(missing_ok=True)


def ensure(name_or_path: str, stale_s: float = 0.0) -> Path | None:
    """For an adapter: its merged folder, complete and made from this adapter (merged here, reused, or waited for while
    another process merges it); None for any other model_name_or_path. Logs which."""
    adapter = adapter_of(name_or_path)
    if adapter is None:
        return None
    stale_s = float(stale_s or DEFAULT_STALE_S)
    dest, want = merged_dir(adapter), fingerprint(adapter)
    lock, start, said, waited = _Lock(dest), time.monotonic(), time.monotonic(), False
    while True:
        rec = _record(dest)
        if rec is not None and rec.get("adapter_sha256") == want:
            if waited or os.environ.get("RANK", "0") == "0":  # (every rank checks; rank 0 says it)
                log.info("model: starting from the LoRA adapter %s merged into its base %s: %s (%s)", adapter,
                         rec.get("base"), dest, f"merged by another process, waited {time.monotonic() - start:.0f}s"
                         if waited else "reused: merged from this adapter before")
            return dest
        if lock.take():
            try:
                rec = _record(dest)  # finished between the look and the lock
                if rec is not None and rec.get("adapter_sha256") == want:
                    continue
                return _merge(adapter, dest, want, rebuilt=rec is not None)
            finally:
                lock.release()
        held = lock.read()
        if held and lock.holder_gone(held, stale_s):
            log.warning("model: taking over the merge of %s from host %s pid %s (no longer running or silent for over "
                        "%.0fs)", adapter, held.get("host"), held.get("pid"), stale_s)
            lock.break_stale(held)
            continue
        if not waited:
            waited = True
            log.info("model: host %s pid %s merges the adapter %s into %s; waiting for it (no collective: ddp_timeout "
                     "does not apply)", (held or {}).get("host"), (held or {}).get("pid"), adapter, dest)
        elif time.monotonic() - said > PROGRESS_S:
            said = time.monotonic()
            log.info("model: still waiting for the merge of %s (%.0fs so far)", adapter, time.monotonic() - start)
        time.sleep(POLL_S)


def _merge(adapter: Path, dest: Path, want: str, rebuilt: bool) -> Path:
    """Merge into a fresh folder beside dest, then put it in dest's place (an older merge of a retrained adapter moved
    aside and removed); the record last."""
    from sftrecipes.export import merge_lora

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


def tokenizer_source(name_or_path: str) -> str:
    """Where the tokenizer of model_name_or_path is read: an adapter folder's own (the SFT run saved its tokenizer and
    chat template there, and the merge copies them), else its base's; any other name as it is."""
    adapter = adapter_of(name_or_path)
    if adapter is None or (adapter / "tokenizer_config.json").is_file():
        return name_or_path
    return base_of(adapter)

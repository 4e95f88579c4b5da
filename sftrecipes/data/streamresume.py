"""Whether a checkpoint's place in a stream still stands on the data as it is now. Each checkpoint of a streamed run
records its source's files (size, modification time) and a digest of the rows the stream read in the current data
epoch up to the end of the checkpoint's buffer; a resume on a source that changed since reads those rows again: when
they read the same (a cut last line repaired, rows appended), it goes on with one log line saying what changed,
otherwise it is refused in one line saying what differs (size, time, content: before and after) and how to go on.
Torch-free.
"""

from __future__ import annotations

import hashlib
import json
from datetime import datetime
from pathlib import Path

from sftrecipes.core.errors import RecipeError
from sftrecipes.data.prepkey import HASHED_BYTES, SMALL_FILE


def chain(before: str, columns: dict) -> str:
    """The digest of a data epoch's rows through one more buffer: the digest before it and the buffer's rows as read
    (its columns, values as the reader gives them)."""
    rows = json.dumps(columns, sort_keys=True, default=str, ensure_ascii=False).encode()
    return hashlib.sha256(before.encode() + hashlib.sha256(rows).digest()).hexdigest()


def file_stats(name: str, files: list[str]) -> list[dict]:
    """[{file (relative to the source folder), size, mtime_ns, sha256 or None}] of a local source's data files; the
    bytes of the small ones hashed (prepkey's rule for a source's content: files up to SMALL_FILE, HASHED_BYTES in
    all), so a change that keeps a file's size and time is still named."""
    root = Path(name).expanduser()
    out, budget = [], HASHED_BYTES
    for f in files:
        st = Path(f).stat()
        rel = Path(f).name if root.is_file() else str(Path(f).resolve().relative_to(root.resolve()))
        digest = None
        if st.st_size <= SMALL_FILE and st.st_size <= budget:
            budget -= st.st_size
            digest = hashlib.sha256(Path(f).read_bytes()).hexdigest()
        out.append({"file": rel, "size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": digest})
    return out


def _when(ns: int) -> str:
    return datetime.fromtimestamp(ns / 1e9).isoformat(sep=" ", timespec="seconds")


def describe_changes(old: dict, new: dict) -> str:
    """What differs between the data a checkpoint recorded and the data now, file by file: removed, added, size and
    modification time before -> after, or content alone."""
    if "files" not in old:
        return "its content changed (the checkpoint records no sizes or times of its files)"
    before = {f["file"]: f for f in old["files"]}
    after = {f["file"]: f for f in new.get("files", [])}
    said = []
    for name in sorted(set(before) | set(after), key=lambda n: (n not in before, n)):
        a, b = before.get(name), after.get(name)
        if b is None:
            said.append(f"{name} removed (was {a['size']} bytes)")
        elif a is None:
            said.append(f"{name} added ({b['size']} bytes)")
        else:
            what = []
            if a["size"] != b["size"]:
                what.append(f"size {a['size']} -> {b['size']} bytes")
            if a["mtime_ns"] != b["mtime_ns"]:
                what.append(f"modified {_when(a['mtime_ns'])} -> {_when(b['mtime_ns'])}")
            if not what and a.get("sha256") and b.get("sha256") and a["sha256"] != b["sha256"]:
                what.append(f"content sha256 {a['sha256'][:12]} -> {b['sha256'][:12]} (same size and time)")
            if what:
                said.append(f"{name}: {', '.join(what)}")
    return "; ".join(said) if said else "a file of it changed, not in size or time, or one beside its data files"


def check(record: dict, now: dict, reread, checkpoint: str) -> str | None:
    """None when the checkpoint's stream stands on the data as it is now (unchanged, or changed where it had not
    read); a line for the log when it changed but the rows it stands on read the same; RecipeError otherwise.
    record: the checkpoint's stream_position.json; now: the source's identity as the run sees it (path, split,
    config, content, files); reread(buffer) -> (digest, rows, error line or None): the source read again from the
    start of a data epoch through that buffer."""
    name, old = Path(checkpoint).name, record["data"]
    if (old["path"], old["split"], old.get("config")) != (now["path"], now["split"], now.get("config")):
        raise RecipeError(f"dataset_name: {name} streamed {old['path']} ({old['split']}), this run streams {now['path']} "
                          f"({now['split']}); resume with dataset_name {old['path']}, or start a new output_dir")
    if old["content"] == now["content"] and old.get("files", now.get("files")) == now.get("files"):
        return None
    changes = describe_changes(old, now)
    where = f"data epoch {record['epoch']}, buffers 0-{record['buffer']}"
    ways = f"restore the data as {name} read it, or train on the data as it is now from a new output_dir"
    if "chain" not in record:
        raise RecipeError(f"dataset_name: {now['path']} changed since {name} was saved ({changes}), and {name} records no "
                          f"digest of the rows it stands on ({where}), so an unchanged start cannot be told; {ways}")
    digest, rows, error = reread(record["buffer"])
    if error is not None:
        raise RecipeError(f"dataset_name: {now['path']} changed since {name} was saved ({changes}), and the rows {name} "
                          f"stands on ({where}) cannot be read now: {error.split(': ', 1)[-1]}; {ways}")
    if digest != record["chain"]:
        raise RecipeError(f"dataset_name: {now['path']} changed since {name} was saved ({changes}), and the {rows} rows it "
                          f"stands on ({where}) no longer read the same: resuming would skip or repeat rows; {ways}")
    return (f"data: {now['path']} changed since {name} was saved ({changes}); the {rows} rows it stands on ({where}) "
            "read the same, so the stream goes on from its position")

"""The streamed safetensors writer: shards laid out before any data is read, written tensor by tensor with their sha256,
into a staging folder that is renamed into place when complete (a full disk is one line and leaves nothing)."""

from __future__ import annotations

import ctypes
import errno
import hashlib
import json
import math
import os
import shutil
import struct
import tempfile
import threading
from pathlib import Path

import torch

from sftrecipes.core.errors import RecipeError

ST_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.int64: "I64",
             torch.int32: "I32", torch.uint8: "U8", torch.int8: "I8", torch.bool: "BOOL"}
FROM_ST = {v: k for k, v in ST_DTYPES.items()}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "chat_template.jinja", "added_tokens.json")
# a vision-language model's processor beside its tokenizer (the image processor's settings, the processor's own)
PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json", "video_preprocessor_config.json")
MANIFEST = "SHA256SUMS"
_LIBC = ctypes.CDLL(None, use_errno=True) if os.name == "posix" else None


def _nbytes(dtype: torch.dtype, shape) -> int:
    return math.prod(shape) * torch.empty((), dtype=dtype).element_size()


class SafetensorsStreamWriter:
    """Write one safetensors file whose layout (names, dtypes, shapes) is known up front, tensor by tensor. The
    sha256 of the file is computed from the bytes as they are written (no second read for the manifest)."""

    def __init__(self, path: Path, layout: list[tuple[str, torch.dtype, tuple[int, ...]]], metadata: dict | None = None):
        header: dict = {"__metadata__": metadata or {"format": "pt"}}
        offset = 0
        self._order = []
        for name, dtype, shape in layout:
            nbytes = _nbytes(dtype, shape)
            header[name] = {"dtype": ST_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            self._order.append((name, dtype, tuple(shape)))
            offset += nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        self._f = open(path, "wb")
        self.sha256 = hashlib.sha256()
        self._emit(struct.pack("<Q", len(raw)) + raw)
        self._next = 0

    def _emit(self, data) -> None:
        if len(data) < 4 * 1024**2:
            self.sha256.update(data)
            self._f.write(data)
            return
        # hashlib and file writes both release the GIL on large buffers: hash on a second thread while writing the
        # same bytes (no copy), so the manifest costs no wall time on a machine with two cores
        failed: list[BaseException] = []

        def update():
            try:
                self.sha256.update(data)
            except BaseException as e:  # noqa: BLE001 - re-raised below, in the writing thread
                failed.append(e)

        hasher = threading.Thread(target=update, name="sha256")
        hasher.start()
        try:
            self._f.write(data)
        finally:
            hasher.join()
        if failed:
            raise failed[0]

    def write(self, name: str, tensor: torch.Tensor) -> None:
        want_name, dtype, shape = self._order[self._next]
        if name != want_name or tensor.dtype != dtype or tuple(tensor.shape) != shape:
            raise RuntimeError(f"stream writer: expected {want_name} {dtype} {shape}, got {name} {tensor.dtype} {tuple(tensor.shape)}")
        self._emit(memoryview(tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy()))
        self._next += 1

    def close(self) -> None:
        if self._next != len(self._order):
            raise RuntimeError(f"stream writer: {len(self._order) - self._next} tensors never written")
        self._f.flush()
        os.fsync(self._f.fileno())  # a full disk must fail here, before the folder is renamed into place
        self._f.close()


def _bound_malloc() -> None:
    """Let freed tensors leave RSS. glibc serves allocations above a *dynamic* threshold with mmap; after the first
    large free it raises that threshold (up to 32 MB), so later tensors of 4-32 MB come from the heap, which fragments
    and keeps its peak. A fixed 4 MB threshold makes every tensor its own mapping, unmapped when freed: the peak then
    follows the largest tensor (bench/bench_export.py measured 1.9x the largest tensor above baseline without this,
    1.05x with it). Process-wide and harmless for small allocations; a no-op off glibc."""
    try:
        _LIBC.mallopt(-3, 4 * 1024**2)  # -3 = M_MMAP_THRESHOLD
    except (AttributeError, OSError):
        pass


def _shards(layout: list, max_shard_bytes: int) -> list[list]:
    """Cut the layout into output shards by size, keeping the source's tensor order."""
    shards, cur, size = [], [], 0
    for item in layout:
        nbytes = _nbytes(item[1], item[2])
        if cur and size + nbytes > max_shard_bytes:
            shards.append(cur)
            cur, size = [], 0
        cur.append(item)
        size += nbytes
    shards.append(cur)
    return shards


def _shard_files(shards: list[list]) -> list[str]:
    """The file names save_pretrained gives these output shards."""
    n = len(shards)
    return [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)] if n > 1 else ["model.safetensors"]


def _write_index(folder: Path, shards: list[list], fnames: list[str]) -> None:
    """model.safetensors.index.json for a sharded output (nothing for a single file)."""
    if len(shards) > 1:
        total = sum(_nbytes(d, s) for shard in shards for _, d, s in shard)
        weight_map = {name: f for f, shard in zip(fnames, shards) for name, _, _ in shard}
        (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))


class _Staging:
    """A temporary folder beside `out`, renamed to `out` by publish(); removed if anything fails before that."""

    def __init__(self, out: Path):
        _bound_malloc()
        self.out = out
        out.parent.mkdir(parents=True, exist_ok=True)
        self.tmp = Path(tempfile.mkdtemp(prefix=out.name + ".tmp-", dir=out.parent))
        self.hashes: dict[str, str] = {}
        self.needed = 0  # bytes the tensors take, when known (for the message on a full disk)

    def write_safetensors(self, fname: str, layout: list, get, written=None) -> None:
        """One shard, tensor by tensor from get(name); written(bytes) after each (a progress bar's update)."""
        writer = SafetensorsStreamWriter(self.tmp / fname, layout)
        for name, dtype, shape in layout:
            writer.write(name, get(name).to(dtype))
            if written is not None:
                written(_nbytes(dtype, shape))
        writer.close()
        self.hashes[fname] = writer.sha256.hexdigest()

    def publish(self) -> Path:
        """Write the manifest (sha256 of every file; the shards' were computed while writing), then rename."""
        for f in sorted(self.tmp.iterdir()):
            if f.name not in self.hashes:
                self.hashes[f.name] = hashlib.sha256(f.read_bytes()).hexdigest()  # small files: config, tokenizer
        (self.tmp / MANIFEST).write_text("".join(f"{h}  {n}\n" for n, h in sorted(self.hashes.items())))
        if self.out.exists():
            shutil.rmtree(self.out)
        os.replace(self.tmp, self.out)
        return self.out

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, _tb):
        if exc_type is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):  # one line, not a traceback
                size = lambda n: f"{n / 1e6:,.1f} MB" if n < 1e9 else f"{n / 1e9:,.2f} GB"  # noqa: E731
                need = f", the export needs about {size(self.needed)}" if self.needed else ""
                raise RecipeError(f"export: {exc.strerror.lower()} writing {exc.filename or self.out} "
                                  f"({size(shutil.disk_usage(self.out.parent).free)} free there{need}); free space "
                                  "or give another destination (nothing was left behind)") from None

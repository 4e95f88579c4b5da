"""Reading a torch distributed checkpoint (FSDP1/FSDP2 SHARDED_STATE_DICT) one tensor at a time, in bounded memory.

A DCP folder is `.metadata` (for every tensor: dtype, size, and its chunks — offsets and sizes) plus one
`__<rank>_<n>.distcp` file per writer. Each chunk is a byte range of such a file, and that range is a `torch.save`
archive: an uncompressed zip holding `data.pkl` (a small pickle naming the storage, its dtype, the storage offset,
size and stride) and the storage's raw bytes (`data/<key>`).

`torch.distributed.checkpoint.load` reads a chunk's whole range into a bytes buffer, deserializes it into a new tensor
and copies that into the destination, so the largest tensor is briefly there two or three times. `DCPSource.get`
instead reads the pickle's few arguments with a restricted unpickler, finds the storage's bytes in the archive and
`readinto`s them straight into the destination tensor (the chunk's slice of it): the tensor is there once. A chunk
whose layout it does not recognise (a transform or compression extension, a non-contiguous or offset storage, big
endian) is read through `torch.load` of that range instead — the same result, with one chunk of extra memory.
"""

from __future__ import annotations

import collections
import io
import pickle
import struct
import zipfile
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from sftrecipes.core.errors import RecipeError

STORAGE_DTYPES = {"FloatStorage": torch.float32, "BFloat16Storage": torch.bfloat16, "HalfStorage": torch.float16,
                  "DoubleStorage": torch.float64, "LongStorage": torch.int64, "IntStorage": torch.int32,
                  "ShortStorage": torch.int16, "CharStorage": torch.int8, "ByteStorage": torch.uint8,
                  "BoolStorage": torch.bool}


class _Window(io.RawIOBase):
    """The byte range [start, start+length) of an open file, as a seekable file of its own (for zipfile)."""

    def __init__(self, f, start: int, length: int):
        super().__init__()
        self.f, self.start, self.length, self.pos = f, start, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = 0) -> int:
        base = {0: 0, 1: self.pos, 2: self.length}[whence]
        self.pos = min(max(base + offset, 0), self.length)
        return self.pos

    def readinto(self, b) -> int:
        n = min(len(b), self.length - self.pos)
        if n <= 0:
            return 0
        self.f.seek(self.start + self.pos)
        got = self.f.readinto(memoryview(b)[:n])
        self.pos += got or 0
        return got or 0


class _NotPlain(Exception):
    """A chunk this reader does not read directly; torch.load reads it instead."""


class _TensorArgs(pickle.Unpickler):
    """Unpickles a torch.save `data.pkl` of one tensor into its rebuild arguments, never into objects: only the
    tensor-rebuild function, storage type names and OrderedDict are accepted (anything else: not plain)."""

    def find_class(self, module, name):
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return lambda *args: ("tensor", args)
        if (module, name) == ("collections", "OrderedDict"):
            return collections.OrderedDict
        if module == "torch" and name in STORAGE_DTYPES:
            return name
        raise _NotPlain(f"{module}.{name}")

    def persistent_load(self, pid):
        return tuple(pid)


def _plain_layout(zf: zipfile.ZipFile) -> tuple[str, torch.dtype, int, tuple, tuple]:
    """(storage record name, dtype, storage offset, size, stride) of a one-tensor torch.save archive."""
    names = zf.namelist()
    pkl = [n for n in names if n.endswith("/data.pkl")]
    order = [n for n in names if n.endswith("/byteorder")]
    if len(pkl) != 1 or (order and zf.read(order[0]).strip() != b"little"):
        raise _NotPlain("archive")
    root = pkl[0][: -len("data.pkl")]
    try:
        obj = _TensorArgs(io.BytesIO(zf.read(pkl[0]))).load()
    except (pickle.UnpicklingError, _NotPlain, EOFError, TypeError, ValueError) as e:
        raise _NotPlain(str(e)) from None
    if not (isinstance(obj, tuple) and obj and obj[0] == "tensor"):
        raise _NotPlain("not one tensor")
    storage, offset, size, stride = obj[1][:4]
    if not (isinstance(storage, tuple) and len(storage) >= 3 and storage[0] == "storage"):
        raise _NotPlain("storage")
    return f"{root}data/{storage[2]}", STORAGE_DTYPES[storage[1]], int(offset), tuple(size), tuple(stride)


def _row_major(size: tuple, stride: tuple) -> bool:
    """True when a tensor of this size and stride lies in memory in row-major order (dims of size 1 may have any
    stride, as torch allows)."""
    acc = 1
    for n, st in zip(reversed(size), reversed(stride)):
        if n != 1 and st != acc:
            return False
        acc *= n
    return len(size) == len(stride)


def read_exactly(f, start: int, dest: torch.Tensor, short: str) -> None:
    """Fill the contiguous tensor `dest` with the bytes of the unbuffered file `f` from `start`; a file that ends
    first is a one-line error saying `short` (what ended where)."""
    buf = memoryview(dest.reshape(-1).view(torch.uint8).numpy())
    f.seek(start)
    got = 0
    while got < len(buf):  # readinto may return short reads on large buffers
        n = f.readinto(buf[got:])
        if not n:
            raise RecipeError(f"export: {short}; the file is truncated — re-copy it")
        got += n


class DCPSource:
    """Tensors of a DCP folder, read one at a time without a process group (whichever ranks' files their chunks are
    in). accelerate nests the model's tensors under `prefix` ('model.'). Checks on construction that every file the
    metadata names is there and long enough, and that every tensor's chunks cover it."""

    def __init__(self, folder: Path, prefix: str = "model."):
        if not (folder / ".metadata").is_file():
            raise RecipeError(f"export: '{folder}' has no .metadata; the sharded checkpoint is incomplete")
        self.folder, self.prefix = folder, prefix
        meta = FileSystemReader(str(folder)).read_metadata()
        self.tensors = {k: v for k, v in meta.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}
        self.pieces: dict[str, list] = {k: [] for k in self.tensors}  # fqn -> [(offsets, sizes, storage info)]
        sizes = {(k, tuple(c.offsets)): tuple(c.sizes) for k, v in self.tensors.items() for c in v.chunks}
        ends: dict[str, int] = {}
        for index, info in meta.storage_data.items():
            ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
            chunk = sizes.get((index.fqn, tuple(index.offset)))
            if chunk is not None:
                self.pieces[index.fqn].append((tuple(index.offset), chunk, info))
        for rel, end in sorted(ends.items()):
            f = folder / rel
            if not f.is_file():
                raise RecipeError(f"export: shard '{rel}' of '{folder}' is missing (the metadata lists it); copy every rank's file")
            if f.stat().st_size < end:
                raise RecipeError(f"export: shard '{rel}' of '{folder}' is truncated ({f.stat().st_size} bytes, needs {end}); re-copy it")
        for k, v in self.tensors.items():
            covered = sum(torch.Size(s).numel() for _, s, _ in self.pieces[k])
            if covered != torch.Size(v.size).numel():
                raise RecipeError(f"export: the chunks of '{k}' in '{folder}/.metadata' cover {covered} of its "
                                  f"{torch.Size(v.size).numel()} elements; the checkpoint is damaged — re-save it")

    def names(self) -> list[str]:
        return [k.removeprefix(self.prefix) for k in self.tensors]

    def meta(self, name: str) -> tuple[torch.dtype, tuple[int, ...]]:
        v = self.tensors[self.prefix + name]
        return v.properties.dtype, tuple(v.size)

    def get(self, name: str) -> torch.Tensor:
        dtype, shape = self.meta(name)
        out = torch.empty(shape, dtype=dtype)
        for offsets, sizes, info in self.pieces[self.prefix + name]:
            dest = out[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))] if shape else out
            self.read_chunk(info, dest, f"chunk {list(offsets)} of '{name}' in {info.relative_path}")
        return out

    def read_chunk(self, info, dest: torch.Tensor, what: str) -> None:
        """Fill `dest` (a view of the output tensor) with the chunk stored at `info` (a DCP _StorageInfo)."""
        with open(self.folder / info.relative_path, "rb", buffering=0) as f:
            window = _Window(f, info.offset, info.length)
            try:
                if getattr(info, "transform_descriptors", None):
                    raise _NotPlain("transformed")
                try:
                    zf = zipfile.ZipFile(window)
                except zipfile.BadZipFile:
                    raise _NotPlain("not a zip") from None
                record, dtype, offset, size, stride = _plain_layout(zf)
                zi = zf.getinfo(record)
                if (dtype != dest.dtype or size != tuple(dest.shape) or zi.compress_type != zipfile.ZIP_STORED
                        or not _row_major(size, stride)
                        or zi.file_size < (offset + dest.numel()) * dest.element_size()):
                    raise _NotPlain("layout")
                f.seek(info.offset + zi.header_offset)
                local = f.read(30)
                if len(local) < 30 or local[:4] != b"PK\x03\x04":
                    raise _NotPlain("local header")
                name_len, extra_len = struct.unpack("<HH", local[26:30])
                start = info.offset + zi.header_offset + 30 + name_len + extra_len + offset * dest.element_size()
                if dest.is_contiguous():
                    read_exactly(f, start, dest, f"{what} ends early")
                else:  # a chunk split along a later dimension: its rows are strided in the output
                    tmp = torch.empty(dest.shape, dtype=dest.dtype)
                    read_exactly(f, start, tmp, f"{what} ends early")
                    dest.copy_(tmp)
            except _NotPlain:
                window.seek(0)
                try:
                    t = torch.load(io.BufferedReader(window), map_location="cpu", weights_only=True)
                except Exception as e:  # noqa: BLE001 - a damaged chunk surfaces here
                    raise RecipeError(f"export: cannot read {what} ({type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}); the file is damaged — re-copy it") from None
                if not isinstance(t, torch.Tensor) or tuple(t.shape) != tuple(dest.shape):
                    raise RecipeError(f"export: {what} does not hold a tensor of shape {list(dest.shape)}; the checkpoint is damaged — re-save it") from None
                dest.copy_(t)

"""Reading an export's inputs one tensor at a time: safetensors files and model folders (local or from the hub) and
DeepSpeed ZeRO-1/2/3 checkpoints (the DCP reader is dcp.py)."""

from __future__ import annotations

import ctypes
import json
import math
import mmap
from pathlib import Path

import torch

from sftrecipes.core.errors import RecipeError
from sftrecipes.export.dcp import read_exactly
from sftrecipes.export.writer import _LIBC, FROM_ST
from sftrecipes.facts.folders import natural_key as _natural
from sftrecipes.facts.folders import read_st_header


class _Reader:
    """Tensors of safetensors files, read with plain file reads into a fresh tensor. Not mmap: the pages of a
    mapped file that were touched count in the process's RSS until unmapped, so an mmap reader's RSS grows with
    the model instead of the largest tensor (docs/exports.md, "Memory")."""

    def __init__(self):
        self._headers: dict[Path, tuple[dict, int]] = {}

    def header(self, path: Path) -> dict:
        if path not in self._headers:
            self._headers[path] = read_st_header(path)
        return self._headers[path][0]

    def meta(self, path: Path, name: str) -> tuple[torch.dtype, tuple[int, ...]]:
        h = self.header(path)[name]
        return FROM_ST[h["dtype"]], tuple(h["shape"])

    def get(self, path: Path, name: str) -> torch.Tensor:
        dtype, shape = self.meta(path, name)
        start = self._headers[path][0][name]["data_offsets"][0]
        out = torch.empty(shape, dtype=dtype)
        with open(path, "rb", buffering=0) as f:
            read_exactly(f, self._headers[path][1] + start, out, f"'{path}' ended inside tensor '{name}'")
        return out


def _base_index(base: Path) -> dict[str, Path]:
    """tensor name -> safetensors file of a model folder; missing or truncated shards are refused here."""
    index = base / "model.safetensors.index.json"
    reader = _Reader()
    if index.is_file():
        out = {k: base / v for k, v in json.loads(index.read_text())["weight_map"].items()}
        for f in sorted(set(out.values())):
            if not f.is_file():
                raise RecipeError(f"export: shard '{f.name}' listed in {index.name} is missing from '{base}'; copy it there")
            reader.header(f)
        return out
    files = sorted(base.glob("*.safetensors"))
    if not files:
        raise RecipeError(f"base: no *.safetensors in '{base}'; the streaming merge reads safetensors (convert .bin first)")
    return {k: f for f in files for k in reader.header(f)}


class _SafetensorsSource:
    """Tensors of a safetensors model folder (sharded or not), read one at a time."""

    def __init__(self, folder: Path):
        self.index = _base_index(folder)
        self.reader = _Reader()

    def names(self) -> list[str]:
        return list(self.index)

    def meta(self, name: str):
        return self.reader.meta(self.index[name], name)

    def get(self, name: str) -> torch.Tensor:
        return self.reader.get(self.index[name], name)


def folder_tensors(folder: Path) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """name -> (dtype, shape) from the safetensors headers of a folder (no data read)."""
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update({k: (FROM_ST[v["dtype"]], tuple(v["shape"])) for k, v in read_st_header(f)[0].items()})
    return out


def _release(t: torch.Tensor) -> None:
    """Hand back the pages of `t` (a view into a torch.load(mmap=True) file, mapped private and never written): the
    next access would re-read them from the file. Without this every page a conversion touched stays in RSS."""
    if _LIBC is None or t.numel() == 0:
        return
    page = mmap.PAGESIZE
    start = t.data_ptr() // page * page
    end = t.data_ptr() + t.numel() * t.element_size()
    _LIBC.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), 4)  # 4 = MADV_DONTNEED


class _ZeroSource:
    """fp32 master weights of a DeepSpeed ZeRO-1/2/3 checkpoint (global_stepN/), read tensor by tensor.

    Each rank's *_optim_states.pt holds its flat fp32 partition of every param group. ZeRO-1/2: the ranks' partitions
    of a group, concatenated, are the group's parameters back to back (with the recorded alignment paddings). ZeRO-3:
    each parameter is cut into world_size pieces of ceil(numel / world_size) (the last padded); rank r's piece sits at
    a running offset in rank r's partition. Files are opened with torch.load(mmap=True) (nothing read yet) and the
    pages a tensor touched are handed back once it is copied out, so memory holds about one output tensor, not the
    partitions (docs/exports.md). Frozen parameters (saved only when not excluded) come from *_model_states.pt."""

    def __init__(self, tag_dir: Path):
        self.dir = tag_dir
        model_files = sorted(tag_dir.glob("*_model_states.pt"), key=_natural)
        optim_files = sorted(tag_dir.glob("*_optim_states.pt"), key=_natural)
        if not model_files or not optim_files:
            raise RecipeError(f"export: '{tag_dir}' lacks *_model_states.pt or *_optim_states.pt; the DeepSpeed checkpoint is incomplete")
        self.models = [self._load(f) for f in model_files]
        self.optims = [self._load(f)["optimizer_state_dict"] for f in optim_files]
        osd = self.optims[0]
        self.stage = int(getattr(osd["zero_stage"], "value", osd["zero_stage"]))
        world = osd["partition_count"]
        self.world = max(world) if isinstance(world, list) else int(world)
        if len(self.optims) != self.world:
            raise RecipeError(f"export: '{tag_dir}' has {len(self.optims)} *_optim_states.pt files but was saved by {self.world} ranks; a rank's file is missing — copy all of them")
        key = "fp32_flat_groups" if self.stage == 3 else "single_partition_of_fp32_groups"
        self.flat = [o[key] for o in self.optims]  # [rank][group] -> 1-D fp32 tensor (mmap'd)
        m0 = self.models[0]
        self.shared = dict(m0.get("shared_params") or {})  # tied copy -> the name it shares storage with
        self.buffers = {k: v for k, v in m0["module"].items() if k in set(m0["buffer_names"])}
        self.frozen = dict(m0.get("frozen_param_shapes") or {})
        self.where: dict[str, tuple] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        paddings = osd.get("param_alignment_paddings")
        offset3 = 0
        for g, shapes in enumerate(m0["param_shapes"]):
            offset = 0
            for i, (name, shape) in enumerate(shapes.items()):
                n = math.prod(shape)
                self.shapes[name] = tuple(shape)
                if self.stage == 3:
                    self.where[name] = (offset3,)
                    offset3 += math.ceil(n / self.world)
                else:
                    self.where[name] = (g, offset)
                    offset += n + (paddings[g][i] if paddings else 0)
        for name, shape in self.frozen.items():
            self.shapes[name] = tuple(shape)
        for name, t in self.buffers.items():
            self.shapes[name] = tuple(t.shape)

    @staticmethod
    def _load(f: Path) -> dict:
        try:
            return torch.load(f, map_location="cpu", mmap=True, weights_only=False)
        except Exception as e:  # noqa: BLE001 - a torn file fails in the zip reader
            raise RecipeError(f"export: cannot open '{f}' ({type(e).__name__}: {str(e).splitlines()[0][:100]}); the file is truncated or corrupt — re-copy it") from None

    def names(self) -> list[str]:
        return [n for n in self.shapes if n not in self.shared]

    def meta(self, name: str) -> tuple[torch.dtype, tuple[int, ...]]:
        return (self.buffers[name].dtype if name in self.buffers else torch.float32), self.shapes[name]

    def get(self, name: str) -> torch.Tensor:
        shape = self.shapes[name]
        n = math.prod(shape)
        if name in self.buffers:
            return self.buffers[name].clone()
        if name in self.frozen:
            frags = [m["frozen_param_fragments"][name] for m in (self.models if self.stage == 3 else self.models[:1])]
            return torch.cat([f.reshape(-1) for f in frags])[:n].view(shape).float()
        if self.stage == 3:
            (off,) = self.where[name]
            piece = math.ceil(n / self.world)
            parts = [self._range(self.flat[r], off, off + piece) for r in range(self.world)]
        else:
            g, off = self.where[name]
            size = self.flat[0][g].numel()  # every rank's partition of a group has the same length
            parts = [self._range([self.flat[r][g]], max(off - r * size, 0), min(off + n - r * size, size))
                     for r in range(off // size, (off + n - 1) // size + 1)]
        out = torch.cat(parts)[:n].view(shape)
        return out

    @staticmethod
    def _range(groups: list[torch.Tensor], a: int, b: int) -> torch.Tensor:
        """Elements [a, b) of the groups taken as one vector, copied out; the pages read are released."""
        out, base = [], 0
        for t in groups:
            lo, hi = max(a - base, 0), min(b - base, t.numel())
            if lo < hi:
                view = t[lo:hi]
                out.append(view.clone())
                _release(view)
            base += t.numel()
        if sum(p.numel() for p in out) != b - a:
            raise RecipeError("export: a ZeRO partition is shorter than its parameter shapes say; the checkpoint is torn — re-copy it")
        return torch.cat(out) if len(out) > 1 else out[0]

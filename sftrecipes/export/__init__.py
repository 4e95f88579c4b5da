"""Exports: from whatever a run saved to a folder `from_pretrained` (or `PeftModel.from_pretrained`) loads, streamed.

    python -m sftrecipes merge ADAPTER_DIR OUT_DIR [--base MODEL] [--dtype bfloat16|float16|float32]
    python -m sftrecipes export RUN_OUTPUT_OR_CHECKPOINT DEST [--dtype ...] [--base ...] [--verify]

`export` recognises, by looking at the folder: a DeepSpeed ZeRO-1/2/3 checkpoint (global_stepN/), an FSDP
SHARDED_STATE_DICT checkpoint (pytorch_model_fsdp_0/, FSDP1 or FSDP2), a LoRA adapter (merged into its base) and a
safetensors model (rewritten). Sharded checkpoints of LoRA runs become adapter folders; of full runs, model folders.

Every tensor is read on its own and written straight into safetensors shards whose headers are laid out before any
data is read, so memory follows the largest tensor, not the model. Each export is checked before it is published:
tensor names, shapes and dtypes against the model built from its config on the meta device; a SHA256SUMS manifest;
with verify=True also logits against the source. The output is written to DEST.tmp-* and renamed when complete, so
a crash, a full disk or a torn input never leaves a folder that looks finished. See docs/exports.md.
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import json
import logging
import math
import mmap
import os
import re
import shutil
import struct
import tempfile
import threading
from pathlib import Path

import torch

from .dcp import DCPSource, read_exactly
from ..model import DTYPES, pattern_value
from ..errors import RecipeError

log = logging.getLogger("sftrecipes")

ST_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.int64: "I64",
             torch.int32: "I32", torch.uint8: "U8", torch.int8: "I8", torch.bool: "BOOL"}
FROM_ST = {v: k for k, v in ST_DTYPES.items()}
PREFIX = "base_model.model."
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "chat_template.jinja", "added_tokens.json")
MANIFEST = "SHA256SUMS"
ADAPTER_MARKS = (".lora_A.", ".lora_B.", ".lora_embedding_A.", ".lora_embedding_B.", ".lora_magnitude_vector.", ".modules_to_save.",
                 ".token_adapter.")
# adapter_config.json features the streaming merge does not apply, each refused by name: what it is
UNMERGEABLE = {
    "fan_in_fan_out": "fan_in_fan_out (GPT-2 style Conv1D weights)",
    "lora_bias": "lora_bias (a bias in lora_B, which the base layers may not have)",
    "layer_replication": "layer_replication (duplicated decoder layers)",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens: it acts only after its invocation tokens)",
    "use_qalora": "QALoRA (use_qalora)",
    "kasa_config": "KaSA (kasa_config: it truncates the base weights)",
    "use_bdlora": "block-diagonal LoRA (use_bdlora)",
    "arrow_config": "Arrow routing (arrow_config)",
    "monteclora_config": "MonteCLoRA (monteclora_config)",
    "megatron_config": "Megatron tensor-parallel layers (megatron_config)",
}
# init_lora_weights whose adapters do not apply to the base as saved: they rewrote the base weights when created
# (peft can convert them: save_pretrained(path_initial_model_for_weight_conversion=...)), or left lora_B out (mica)
UNMERGEABLE_INIT = {"pissa": "rewrote the base weights", "olora": "rewrote the base weights", "corda": "rewrote the base weights",
                    "loftq": "rewrote the base weights", "lora_ga": "rewrote the base weights",
                    "mica": "left the frozen lora_B out of the adapter file"}


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


# ---------------------------------------------------------------------------------------------------- reading inputs

def read_st_header(path: Path) -> tuple[dict, int]:
    """(header without __metadata__, offset of the data) of one safetensors file; a truncated file is refused."""
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
    except (OSError, struct.error, ValueError) as e:
        raise RecipeError(f"export: '{path}' is not a readable safetensors file ({type(e).__name__}); it is truncated or not safetensors — re-copy it") from None
    header.pop("__metadata__", None)
    end = 8 + n + max((v["data_offsets"][1] for v in header.values()), default=0)
    if path.stat().st_size < end:
        raise RecipeError(f"export: '{path}' is truncated ({path.stat().st_size} bytes, its header needs {end}); re-copy it")
    return header, 8 + n


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


_LIBC = ctypes.CDLL(None, use_errno=True) if os.name == "posix" else None


def _release(t: torch.Tensor) -> None:
    """Hand back the pages of `t` (a view into a torch.load(mmap=True) file, mapped private and never written): the
    next access would re-read them from the file. Without this every page a conversion touched stays in RSS."""
    if _LIBC is None or t.numel() == 0:
        return
    page = mmap.PAGESIZE
    start = t.data_ptr() // page * page
    end = t.data_ptr() + t.numel() * t.element_size()
    _LIBC.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), 4)  # 4 = MADV_DONTNEED


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


def _natural(p: Path):
    return [int(s) if s.isdigit() else s for s in re.split(r"(\d+)", p.name)]


def _ds_tag_dir(folder: Path) -> Path | None:
    """The global_stepN folder of a DeepSpeed checkpoint (the one `latest` names, else the only one), or None."""
    if re.fullmatch(r"global_step\d+", folder.name) and any(folder.glob("*_optim_states.pt")):
        return folder
    steps = sorted((p for p in folder.glob("global_step*") if p.is_dir()), key=_natural)
    if (folder / "latest").is_file() and (folder / (folder / "latest").read_text().strip()).is_dir():
        return folder / (folder / "latest").read_text().strip()
    return steps[-1] if steps else None


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


def _peft_name(key: str) -> str:
    """A trainable tensor's name in the training model -> its name in adapter_model.safetensors: accelerate's
    'model.' prefix (DCP) and PEFT's adapter name ('.default') are dropped, as get_peft_model_state_dict does."""
    key = key.removeprefix("model.") if key.startswith("model.base_model.") else key
    key = re.sub(r"\.default(?=\.|$)", "", key)
    key = re.sub(r"\.lora_magnitude_vector\.weight$", ".lora_magnitude_vector", key)  # DoRA's magnitude, as peft saves it
    return key.replace(".modules_to_save.", ".")  # a whole trained module is saved under the base name


def _local_model_dir(name_or_path: str) -> Path:
    p = Path(name_or_path).expanduser()
    if p.is_dir():
        return p
    try:
        from huggingface_hub import snapshot_download  # noqa: PLC0415

        return Path(snapshot_download(name_or_path, allow_patterns=["*.safetensors", "*.json", "tokenizer*"]))
    except Exception as e:  # noqa: BLE001 - any hub failure is the same advice
        raise RecipeError(f"base: '{name_or_path}' is not a local folder and could not be fetched from the hub ({type(e).__name__}); pass --base LOCAL_DIR") from None


def read_adapter(adapter: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    cfg_path, weights = adapter / "adapter_config.json", adapter / "adapter_model.safetensors"
    if not cfg_path.is_file() or not weights.is_file():
        raise RecipeError(f"adapter: '{adapter}' has no adapter_config.json + adapter_model.safetensors; give a LoRA adapter folder")
    cfg = json.loads(cfg_path.read_text())
    if cfg.get("peft_type") != "LORA":
        raise RecipeError(f"adapter: peft_type {cfg.get('peft_type')} cannot be merged; only LoRA adapters merge")
    for key, what in UNMERGEABLE.items():
        if cfg.get(key):
            raise RecipeError(f"adapter: {what} is not supported by the streaming merge; merge with peft's merge_and_unload")
    init = cfg.get("init_lora_weights")
    family = "pissa" if isinstance(init, str) and init.startswith("pissa") else init
    if isinstance(family, str) and family in UNMERGEABLE_INIT:
        raise RecipeError(f"adapter: init_lora_weights '{init}' {UNMERGEABLE_INIT[family]}, so the adapter does not apply to the "
                          "base model; convert it with peft (save_pretrained(path_initial_model_for_weight_conversion=...)) first")
    reader = _Reader()
    return cfg, {k: reader.get(weights, k) for k in reader.header(weights)}


def param_wrappers(config_dir: Path, target_parameters: list[str]) -> dict[str, tuple[str, bool]]:
    """Where peft keeps the LoRA of each parameter it adapts as a parameter (target_parameters: MoE experts, a router):
    module path in the adapter -> (the parameter's name in the base model, whether it is stored [E, in, out]).
    peft wraps the matching parameters of one module inside each other in the module's registration order, the first
    innermost, so that one's LoRA is saved under `<module>.base_layer.`, the last's under `<module>.`. The order and
    the layout flag (is_transposed) are read from the model built from config.json on the meta device."""
    model = _meta_model(config_dir)
    out = {}
    for mname, module in model.named_modules():
        matched = [pn for pn, _ in module.named_parameters(recurse=False)
                   if any(f"{mname}.{pn}" == t or f"{mname}.{pn}".endswith("." + t) for t in target_parameters)]
        for i, pn in enumerate(matched):
            out[mname + ".base_layer" * (len(matched) - 1 - i)] = (f"{mname}.{pn}", bool(getattr(module, "is_transposed", False)))
    return out


def plan_merge(cfg: dict, tensors: dict[str, torch.Tensor], base_names: set[str],
               wrapped: dict[str, tuple[str, bool]] | None = None) -> dict[str, dict]:
    """base tensor name -> what to apply: {'A', 'B', 'scale'[, 'magnitude' (DoRA)][, 'transposed' (3-D experts)]} |
    {'replace': T} | {'rows': (idx, T)}. `wrapped` (param_wrappers) places the LoRA of parameter targets."""
    r, alpha = cfg["r"], cfg["lora_alpha"]
    wrapped = wrapped or {}
    plan: dict[str, dict] = {}
    token_idx = cfg.get("trainable_token_indices") or {}
    tied_rows: dict[str, torch.Tensor] = {}  # a tied head's token adapter: the embedding's, saved a second time
    for key, t in tensors.items():
        name = key[len(PREFIX):] if key.startswith(PREFIX) else key
        module = name.split(".token_adapter.", 1)[0]
        if ".token_adapter." in name and module + ".weight" not in base_names and module.rsplit(".", 1)[-1] == "lm_head":
            tied_rows[name.split(".token_adapter.", 1)[1]] = t  # the base ties lm_head to the embedding: no tensor of its own
            continue
        lora = re.fullmatch(r"(.+)\.lora_([AB])\.weight", name)
        if lora or name.endswith(".lora_magnitude_vector"):
            module = lora.group(1) if lora else name[: -len(".lora_magnitude_vector")]
            target, transposed = wrapped.get(module, (module + ".weight", False))
            entry = plan.setdefault(target, {})
            if not lora:
                entry["magnitude"] = t
                continue
            entry[lora.group(2)] = t
            pattern_key = target if module in wrapped else module  # peft matches a parameter target by its own name
            r_m = pattern_value(cfg.get("rank_pattern"), pattern_key, r)
            a_m = pattern_value(cfg.get("alpha_pattern"), pattern_key, alpha)
            entry["scale"] = a_m / math.sqrt(r_m) if cfg.get("use_rslora") else a_m / r_m
            entry["transposed"] = transposed
        elif name.endswith(".token_adapter.trainable_tokens_delta"):
            module = name[: -len(".token_adapter.trainable_tokens_delta")]
            leaf = module.rsplit(".", 1)[-1]
            idx = token_idx.get(leaf) if isinstance(token_idx, dict) else token_idx
            if idx is None:
                raise RecipeError(f"adapter: {key} has no trainable_token_indices entry in adapter_config.json; the adapter is inconsistent")
            plan.setdefault(module + ".weight", {})["rows"] = (torch.tensor(idx), t)
        elif ".original_module." in name:
            continue  # modules_to_save: the untrained copy peft saves with resized embeddings (save_embedding_layers)
        elif ".modules_to_save." in name and name.replace(".modules_to_save.", ".") in base_names:
            plan.setdefault(name.replace(".modules_to_save.", "."), {})["replace"] = t  # the trained module, again
        elif name.endswith(".token_adapter.base_layer.weight"):  # full (resized) embedding saved beside the rows
            plan.setdefault(name[: -len(".token_adapter.base_layer.weight")] + ".weight", {})["replace"] = t
        elif name.endswith(".base_layer.bias") and name.replace(".base_layer.bias", ".bias") in base_names:
            plan.setdefault(name.replace(".base_layer.bias", ".bias"), {})["replace"] = t  # bias: all / lora_only
        elif name in base_names:  # modules_to_save, bias: the whole trained tensor
            plan.setdefault(name, {})["replace"] = t
        else:
            raise RecipeError(f"adapter: tensor '{key}' matches nothing in the base model; wrong --base for this adapter?")
    embed = next((k for k in plan if k.endswith("embed_tokens.weight")), None)
    for part, t in tied_rows.items():  # must repeat the embedding's rows exactly, or the head was trained on its own
        same = plan.get(embed, {}).get("rows" if part == "trainable_tokens_delta" else "replace")
        mine = same[1] if isinstance(same, tuple) else same
        if mine is None or not (t.is_meta or torch.equal(mine, t)):  # meta: a layout check before any data is read
            raise RecipeError(f"adapter: lm_head.token_adapter.{part} differs from the embedding's, but the base ties lm_head to the embedding; wrong --base for this adapter?")
    for target, entry in plan.items():
        if target not in base_names:
            raise RecipeError(f"adapter: targets '{target}', which the base model does not have; wrong --base for this adapter?")
        if ("A" in entry) != ("B" in entry) or ("magnitude" in entry and "A" not in entry):
            raise RecipeError(f"adapter: '{target}' has only part of its LoRA (lora_A/lora_B/magnitude); the adapter file is incomplete")
    return plan


def _lora_fits(shape: tuple, a: tuple, b: tuple, entry: dict) -> bool:
    """lora_B @ lora_A fits a 2-D weight [out, in]; for a 3-D expert tensor [E, out, in] ([E, in, out] if transposed)
    peft's factors are lora_A [r*E, in] and lora_B [out, r*E]."""
    if len(a) != 2 or len(b) != 2 or a[0] != b[1]:
        return False
    if len(shape) == 2:
        return b[0] == shape[0] and a[1] == shape[1]
    if len(shape) == 3:
        out_f, in_f = (shape[2], shape[1]) if entry.get("transposed") else (shape[1], shape[2])
        return b[0] == out_f and a[1] == in_f and a[0] % shape[0] == 0
    return False


def _cut(t: torch.Tensor, piece: tuple | None) -> torch.Tensor:
    """The stored piece of a tensor in the layout the model holds (see stored_layout): t[expert][rows]."""
    if piece is None:
        return t
    _, expert, rows = piece
    t = t[expert] if expert is not None else t
    return t[rows] if rows is not None else t


def _apply(w: torch.Tensor, entry: dict, name: str, piece: tuple | None = None) -> torch.Tensor:
    """The stored tensor `name` (base value `w`) after the plan entry of the tensor it is (a piece of, see
    stored_layout) in the model: replaced, rows set, LoRA added (DoRA rescaled)."""
    out = (_cut(entry["replace"], piece) if "replace" in entry else w).to(torch.float32)
    if "rows" in entry:
        idx, rows = entry["rows"]
        need = int(idx.max()) + 1
        if need > out.shape[0]:  # vocabulary grown by added tokens: the adapter holds every new row
            missing = set(range(out.shape[0], need)) - set(idx.tolist())
            if missing:
                raise RecipeError(f"adapter: '{name}' grows to {need} rows but rows {sorted(missing)[:3]} are not in the adapter")
            out = torch.cat([out, out.new_zeros(need - out.shape[0], out.shape[1])])
        out[idx] = rows.to(torch.float32)
    if "A" in entry:
        a, b, shape = entry["A"].to(torch.float32), entry["B"].to(torch.float32), entry.get("shape", tuple(w.shape))
        want = tuple(_cut(torch.empty(shape, device="meta"), piece).shape)
        if not _lora_fits(tuple(shape), tuple(a.shape), tuple(b.shape), entry) or tuple(out.shape) != want:
            raise RecipeError(f"adapter: '{name}' lora_B{tuple(b.shape)} @ lora_A{tuple(a.shape)} does not fit the base weight {tuple(out.shape)}; wrong base model")
        expert, rows = (piece[1], piece[2]) if piece else (None, None)
        if len(shape) == 3:
            # peft's ParamWrapper.get_delta_weight: lora_A [r*E, in] is (E, r, in) expert-major, lora_B [out, r*E] is
            # (out, r, E) expert-minor; expert e's delta is scale * B[:, :, e] @ A[e], stored transposed for [E, in, out]
            n = shape[0]
            a3, b3 = a.reshape(n, -1, a.shape[1]), b.reshape(b.shape[0], -1, n)
            for e in range(n) if expert is None else [expert]:
                lhs, rhs = (a3[e].T, b3[:, :, e].T) if entry.get("transposed") else (b3[:, :, e], a3[e])
                (out[e] if expert is None else out).addmm_(lhs if rows is None else lhs[rows], rhs, alpha=entry["scale"])
        else:
            out.addmm_(b if rows is None else b[rows], a, alpha=entry["scale"])  # in place: no (out x in) temporaries beside W
        if "magnitude" in entry:
            # DoRA (peft's DoraLinearVariant.merge): W' = m * (W + s*B@A) / ||W + s*B@A||, the norm over each output row
            m = entry["magnitude"].to(torch.float32)
            m = m if rows is None else m[rows]
            if m.shape != out.shape[:1]:
                raise RecipeError(f"adapter: '{name}' DoRA magnitude{tuple(m.shape)} does not fit the base weight {tuple(out.shape)}; wrong base model")
            out.mul_((m / torch.linalg.norm(out, dim=1)).unsqueeze(1))
    return out


def _check_fits(plan: dict[str, dict], shape_of) -> None:
    """Every LoRA pair must fit the base weight it targets: checked before anything is written."""
    for target, e in plan.items():
        if "A" in e:
            shape, a, b = tuple(shape_of(target)), tuple(e["A"].shape), tuple(e["B"].shape)
            e["shape"] = shape  # the weight as the model holds it (a 3-D expert tensor may be stored in pieces)
            if not _lora_fits(tuple(shape), a, b, e) or ("magnitude" in e and tuple(e["magnitude"].shape) != tuple(shape[:1])):
                raise RecipeError(f"adapter: '{target}' lora_B{b} @ lora_A{a} does not fit the base weight {tuple(shape)}; wrong base model — pass the base it was trained on (--base)")


def merge_lora(adapter_dir: str | Path, out_dir: str | Path, base: str | None = None, dtype: str | None = None,
               max_shard_bytes: int = 2 * 1024**3, verify: bool = False) -> Path:
    """Merge a LoRA adapter into its (16-bit or fp32) base, streaming. A QLoRA adapter merges the same way: into the
    unquantized base, which is what the 4-bit weights were quantized from. Returns the finished output folder."""
    adapter = Path(adapter_dir)
    cfg, tensors = read_adapter(adapter)
    base_dir = _local_model_dir(base or cfg.get("base_model_name_or_path") or "")
    if (base_dir / "config.json").is_file() and "quantization_config" in json.loads((base_dir / "config.json").read_text()):
        raise RecipeError(f"base: '{base_dir}' is quantized (config.json has quantization_config); merge into the unquantized base model (--base)")
    source = _SafetensorsSource(base_dir)
    held = StoredLayout.of_config(base_dir).held if (base_dir / "config.json").is_file() else {}
    plan = plan_merge(cfg, tensors, set(source.names()) | set(held), _wrapped(base_dir, cfg))
    _check_fits(plan, lambda n: held[n] if n in held else source.meta(n)[1])
    tok_src = adapter if (adapter / "tokenizer_config.json").is_file() else base_dir
    reference = (lambda: _peft_reference(base_dir, adapter)) if verify else None
    out = rewrite_model(base_dir, out_dir, plan, dtype, tok_src, max_shard_bytes, source=source, reference=reference)
    log.info("merge: %d tensors changed (%d with LoRA) -> %s", len(plan), sum("A" in e for e in plan.values()), out)
    return out


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

    def write_safetensors(self, fname: str, layout: list, get) -> None:
        writer = SafetensorsStreamWriter(self.tmp / fname, layout)
        for name, dtype, _ in layout:
            writer.write(name, get(name).to(dtype))
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


def rewrite_model(base_dir: Path, out_dir: str | Path, plan: dict[str, dict], dtype: str | None, tok_src: Path,
                  max_shard_bytes: int = 2 * 1024**3, source=None, reference=None, names: list[str] | None = None) -> Path:
    """Write a model folder tensor by tensor from `source` (default: the safetensors in base_dir), applying `plan`
    and casting floats to `dtype`; config and tokenizer come from base_dir / tok_src. Before the folder is published
    its tensors are checked against the config (check_model_folder); with `reference` (a callable returning the
    source as a model) the logits are compared too (verify_logits)."""
    source = source or _SafetensorsSource(base_dir)
    out_dtype = DTYPES[dtype] if dtype else None
    names = names or source.names()
    # the plan names tensors as the model holds them; the source may store them in pieces (StoredLayout)
    todo = {n: (plan[n], None) for n in names if n in plan}
    if set(todo) != set(plan):
        todo = StoredLayout.of_config(base_dir).plan_pieces(plan, names)
    layout = []
    for name in names:
        src_dtype, shape = source.meta(name)
        entry, piece = todo.get(name, ({}, None))
        if "replace" in entry and piece is None:
            shape = tuple(entry["replace"].shape)
        rows = entry.get("rows")
        if rows is not None:
            shape = (max(shape[0], int(rows[0].max()) + 1), *shape[1:])
        layout.append((name, (out_dtype or src_dtype) if src_dtype.is_floating_point else src_dtype, shape))
    shards = _shards(layout, max_shard_bytes)

    def get(name):
        w = source.get(name)
        return _apply(w, todo[name][0], name, todo[name][1]) if name in todo else w

    with _Staging(Path(out_dir)) as st:
        st.needed = sum(_nbytes(d, shape) for _, d, shape in layout)
        fnames = _shard_files(shards)
        for fname, shard in zip(fnames, shards):
            st.write_safetensors(fname, shard, get)
        _write_index(st.tmp, shards, fnames)
        for f in TOKENIZER_FILES:
            if (tok_src / f).is_file():
                shutil.copy2(tok_src / f, st.tmp / f)
        # config.json records the dtype the tensors are in (an fp32 export of a bf16 run must not load as bf16)
        _write_config(base_dir, st.tmp, layout, out_dtype or next((d for _, d, _ in layout if d.is_floating_point), None))
        check_model_folder(st.tmp, out_dtype)
        if reference is not None:
            verify_logits(st.tmp, reference, out_dtype or torch.float32)
        return st.publish()


# ------------------------------------------------------------------------------------------------ checks and verify

def _meta_model(config_dir: Path):
    """The model of a config.json, built on the meta device (no memory, no data)."""
    from transformers import AutoConfig, AutoModelForCausalLM  # noqa: PLC0415
    from transformers.integrations import deepspeed as hf_ds  # noqa: PLC0415

    # inside a ZeRO-3 run (merge_in_run, rank 0 alone) from_config would build under deepspeed.zero.Init, a
    # collective the other ranks never join: a hang. A meta model needs no partitioning, so ZeRO-3 is switched off
    # for the build.
    saved, hf_ds._hf_deepspeed_config_weak_ref = hf_ds._hf_deepspeed_config_weak_ref, None
    try:
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(config_dir))
    finally:
        hf_ds._hf_deepspeed_config_weak_ref = saved


def tied_copies(model) -> dict[str, str]:
    """tied copy -> the tensor it shares (e.g. lm_head.weight -> model.embed_tokens.weight); save_pretrained writes
    only the second."""
    return dict(getattr(model, "all_tied_weights_keys", None) or {})


class StoredLayout:
    """How a model folder stores the tensors the model holds. transformers 5 converts some checkpoints as it loads
    them and reverts that as it saves (mixture-of-experts experts: one tensor per expert and projection on disk, fused
    3-D parameters in memory; renamed modules, e.g. Mixtral's block_sparse_moe -> mlp). transformers 5.24 loads either
    layout, but the hub's tools (vLLM, transformers 4, converters) read the stored one, so exports write that.

    * held: name -> shape of every tensor the model holds (its state dict, tied copies left out);
    * stored: name -> shape of every tensor save_pretrained writes;
    * pieces: stored name -> (held name, expert, rows): the stored tensor is held[expert][rows] (None: no index).

    Read from transformers' own save-time reversal (revert_weight_conversion), applied on the meta device for names and
    shapes and to small index tensors for the pieces (which held tensor, expert and rows each stored value came from).
    A conversion that moves data other than along a tensor's first two axes maps no piece: such tensors are copied as
    they are by a merge (an adapter that targets them is refused) and refused by a sharded export."""

    def __init__(self, model, held: dict[str, tuple[int, ...]] | None = None):
        """model: the model (meta or live, whose conversions from_pretrained recorded); held: the shapes of its tensors
        (default: its state dict's; a ZeRO-3 run passes the full shapes its partitioned parameters keep in ds_shape)."""
        from transformers.core_model_loading import revert_weight_conversion  # noqa: PLC0415

        tied = set(tied_copies(model))
        if held is None:
            held = {n: tuple(t.shape) for n, t in model.state_dict().items() if n not in tied}
        self.held = dict(held)
        sd = {n: torch.empty(shape, device="meta") for n, shape in self.held.items()}
        self.stored = {n: tuple(t.shape) for n, t in revert_weight_conversion(model, sd).items()}
        self.pieces: dict[str, tuple] = {n: (n, None, None) for n in self.held if n in self.stored}
        if set(self.stored) == set(self.held):
            return
        # index probes: held tensor n's probe holds base[n] + (expert * rows + row), over its first two axes only
        base, probes, offset = {}, {}, 0
        for n, shape in self.held.items():
            lead = shape[:2] if len(shape) == 3 else shape[:1]
            count = math.prod(lead) if lead else 1
            probes[n] = (torch.arange(count, dtype=torch.float64) + offset).reshape(*lead, *[1] * (len(shape) - len(lead)))
            base[n], offset = offset, offset + count
        starts = sorted((o, n) for n, o in base.items())
        for name, v in revert_weight_conversion(model, probes).items():
            flat = v.reshape(-1).to(torch.int64)
            if flat.numel() == 0:
                continue
            held_name = max((o, n) for o, n in starts if o <= int(flat[0]))[1]
            shape, local = self.held[held_name], flat - base[held_name]
            rows_per = shape[1] if len(shape) == 3 else (shape[0] if shape else 1)
            expert = (local // rows_per) if len(shape) == 3 else torch.zeros_like(local)
            row = local % rows_per if len(shape) == 3 else local
            if v.shape == probes[held_name].shape and torch.equal(local, torch.arange(local.numel())):
                piece = (held_name, None, None)
            elif len(shape) >= 2 and (expert == expert[0]).all() and torch.equal(row, torch.arange(row.numel()) + row[0]):
                rows = slice(int(row[0]), int(row[0]) + row.numel())
                piece = (held_name, int(expert[0]) if len(shape) == 3 else None, rows)
            else:
                continue
            if tuple(_cut(torch.empty(shape, device="meta"), piece).shape) == self.stored.get(name):
                self.pieces[name] = piece

    @classmethod
    def of_config(cls, config_dir: Path) -> StoredLayout:
        return cls(_meta_model(config_dir))

    def plan_pieces(self, plan: dict[str, dict], stored_names: list[str]) -> dict[str, tuple]:
        """stored name -> (plan entry, piece) for the tensors a merge changes; every planned tensor must be covered."""
        todo, covered = {}, set()
        for name in stored_names:
            piece = self.pieces.get(name, (name, None, None))
            if piece[0] in plan:
                todo[name] = (plan[piece[0]], None if piece[1:] == (None, None) else piece)
                covered.add(piece[0])
        missing = sorted(set(plan) - covered)
        if missing:
            raise RecipeError(f"adapter: targets '{missing[0]}', which the base model stores in a layout the streaming merge cannot map; merge with peft's merge_and_unload")
        return todo


class HubFormat:
    """A tensor source in the names the model holds (a DCP or ZeRO checkpoint) presented in the names and layout
    save_pretrained writes (StoredLayout): each stored tensor is its piece of a held one, cut when asked for; the held
    tensor of the last request is kept, and the pieces of one held tensor are consecutive in names(), so each is read
    once. Memory: one held tensor."""

    def __init__(self, source, layout: StoredLayout):
        self.source = source
        have = set(source.names())
        order = {n: i for i, n in enumerate(source.names())}
        unmapped = [n for n in layout.stored if n not in layout.pieces]
        if unmapped:
            raise RecipeError(f"export: '{unmapped[0]}' is stored in a layout the streaming export cannot cut from the "
                              "checkpoint's tensors (transformers converts it on more than the first two axes); export "
                              "with transformers' save_pretrained instead")
        missing = sorted({layout.pieces[n][0] for n in layout.stored} - have)
        if missing:
            raise RecipeError(f"export: the checkpoint lacks {len(missing)} tensors the config needs (e.g. {missing[:2]}); "
                              "the checkpoint is not of this config's model — check the source folder")
        self.map = {n: layout.pieces[n] for n in sorted(layout.stored, key=lambda n: order[layout.pieces[n][0]])}
        self.shapes = layout.stored
        self._held: tuple[str, torch.Tensor | None] = ("", None)

    def names(self) -> list[str]:
        return list(self.map)

    def meta(self, name: str):
        return self.source.meta(self.map[name][0])[0], self.shapes[name]

    def get(self, name: str) -> torch.Tensor:
        piece = self.map[name]
        if piece[1:] == (None, None):  # stored as held: nothing to keep for later pieces
            self._held = ("", None)
            return self.source.get(piece[0])
        if self._held[0] != piece[0]:
            self._held = ("", None)  # free the previous tensor before reading the next
            self._held = (piece[0], self.source.get(piece[0]))
        return _cut(self._held[1], piece)


def _wrapped(config_dir: Path, cfg: dict) -> dict[str, tuple[str, bool]]:
    """param_wrappers for an adapter config: only adapters with target_parameters need the base's structure."""
    return param_wrappers(config_dir, list(cfg["target_parameters"])) if cfg.get("target_parameters") else {}


def expected_model_tensors(config_dir: Path, held: bool = False) -> dict[str, tuple[int, ...]]:
    """name -> shape of every tensor save_pretrained writes for this config (held=True: as the model holds them; they
    differ where transformers converts a checkpoint as it loads it, see StoredLayout), tied copies (lm_head tied to the
    embeddings) left out as save_pretrained does."""
    layout = StoredLayout.of_config(config_dir)
    return layout.held if held else layout.stored


def folder_tensors(folder: Path) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """name -> (dtype, shape) from the safetensors headers of a folder (no data read)."""
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update({k: (FROM_ST[v["dtype"]], tuple(v["shape"])) for k, v in read_st_header(f)[0].items()})
    return out


def check_model_folder(folder: Path, dtype: torch.dtype | None = None) -> int:
    """The written tensors must be exactly those the config needs: same names, shapes; floats in `dtype` (if given)."""
    layout = StoredLayout.of_config(folder)
    have = folder_tensors(folder)
    want = layout.held if set(have) == set(layout.held) else layout.stored  # transformers 5 loads either layout
    missing, extra = sorted(set(want) - set(have)), sorted(set(have) - set(want))
    if missing or extra:
        raise RecipeError(f"export: the tensors do not match config.json: {len(missing)} missing (e.g. {missing[:2]}), {len(extra)} unexpected (e.g. {extra[:2]}); the checkpoint is not of this config's model — check the source folder")
    bad = [(n, have[n][1], s) for n, s in want.items() if have[n][1] != s]
    if bad:
        raise RecipeError(f"export: {len(bad)} tensors have the wrong shape for config.json, e.g. {bad[0][0]} {bad[0][1]} != {bad[0][2]}; the checkpoint is not of this config's model")
    wrong = sorted(n for n, (d, _) in have.items() if dtype is not None and d.is_floating_point and d != dtype)
    if wrong:
        raise RuntimeError(f"export check: {len(wrong)} tensors are not {dtype}, e.g. {wrong[:2]}")
    return len(have)


def check_adapter_folder(folder: Path, base_shapes: dict[str, tuple[int, ...]], wrapped: dict | None = None) -> int:
    """Every LoRA pair of an adapter folder must fit the base model's weight it targets (shapes from its config)."""
    cfg, tensors = read_adapter(folder)
    plan = plan_merge(cfg, tensors, set(base_shapes), wrapped)
    _check_fits(plan, base_shapes.__getitem__)
    return len(tensors)


# The logits check. The fixed prompt runs through the export and through the source, both computed in fp32 (a
# 16-bit export is upcast on load), so the difference measures only what the export did to the weights; the bound is
# relative to the logit scale, max(1, max |logit|):
#   float32: the export holds the trained values bit for bit (a merge adds W + s·B@A in fp32: one rounding per
#            weight, ~6e-8 relative, vs peft's unmerged x@W + s·(x@A)@B). 1e-4 is >1000x that: above it a tensor
#            is wrong, not rounded.
#   bfloat16 / float16: every weight is rounded once to the dtype (relative error <= unit roundoff u: 2^-8 bf16,
#            2^-11 fp16); the logit error then is a few u of the scale (measured on the tiny twins: ~3u for bf16).
#            16u leaves ~5x margin for deeper models and still catches a wrong or missing tensor, which moves the
#            logits by a sizeable fraction of their scale (0.1-1, i.e. 25u-250u for bf16).
LOGIT_TOL = {torch.float32: 1e-4, torch.bfloat16: 16 * 2.0**-8, torch.float16: 16 * 2.0**-11}
PROBE_TEXT = "The quick brown fox jumps over the lazy dog. What is 7 plus 5?"


def _probe_ids(folder: Path, vocab: int) -> torch.Tensor:
    if (folder / "tokenizer_config.json").is_file():
        from transformers import AutoTokenizer  # noqa: PLC0415

        ids = AutoTokenizer.from_pretrained(folder)(PROBE_TEXT, return_tensors="pt").input_ids
        if ids.numel() > 1:
            return ids
    return (torch.arange(1, 33) * 7919 % vocab).unsqueeze(0)  # a fixed spread of token ids when there is no tokenizer


def _logits(model, ids) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


def verify_logits(folder: Path, reference, dtype: torch.dtype, base: Path | None = None) -> float:
    """Reload the export from `folder` (upcast to fp32; an adapter on `base`) and compare its logits on a fixed
    prompt with those of `reference()`, the source checkpoint read by upstream code. Prints the max abs difference;
    above LOGIT_TOL[dtype] × max(1, max |logit|) it is an error. Needs RAM for both models in fp32."""
    from transformers import AutoModelForCausalLM  # noqa: PLC0415

    if base is None:
        ours = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    else:
        from peft import PeftModel  # noqa: PLC0415

        ours = PeftModel.from_pretrained(_base_for_adapter(base, folder), folder)
    ids = _probe_ids(folder if (folder / "tokenizer_config.json").is_file() else (base or folder), ours.config.vocab_size)
    got = _logits(ours, ids)
    del ours
    want = _logits(reference(), ids)
    diff = (got - want).abs().max().item()
    tol = LOGIT_TOL[dtype] * max(1.0, want.abs().max().item())
    print(f"verify: max abs logits difference {diff:.3g} on {ids.shape[1]} tokens (tolerance {tol:.3g}, {str(dtype).removeprefix('torch.')})", flush=True)
    if not diff <= tol:
        raise RecipeError(f"export: verify failed: logits differ from the source by {diff:.3g} > {tol:.3g}; the export is not the trained model — do not use it (report the source checkpoint)")
    return diff


def _base_for_adapter(base_dir: Path, adapter: Path):
    """The base model in fp32, its embeddings resized as the run resized them when it added tokens: to the size of
    the resized embedding saved beside the adapter, or else past the highest trainable-token row."""
    from transformers import AutoModelForCausalLM  # noqa: PLC0415

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    rows = {shape[0] for name, (_, shape) in folder_tensors(adapter).items()
            if re.search(r"embed_tokens\.(token_adapter\.base_layer\.)?weight$", name)}
    indices = json.loads((adapter / "adapter_config.json").read_text()).get("trainable_token_indices") or {}
    for idx in indices.values() if isinstance(indices, dict) else [indices]:
        rows.add(max(idx) + 1)
    if rows and max(rows) > model.get_input_embeddings().weight.shape[0]:
        model.resize_token_embeddings(max(rows))
    return model


def _peft_reference(base_dir: Path, adapter: Path):
    """The source of a merge: the base in fp32 with the adapter applied unmerged, by peft."""
    from peft import PeftModel  # noqa: PLC0415

    return PeftModel.from_pretrained(_base_for_adapter(base_dir, adapter), adapter)


def upstream_state_dict(kind: str, folder: Path) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors as the upstream converters read them (whole, in memory): torch's DCP converter, or
    DeepSpeed's zero_to_fp32. Used as the reference for verify and in tests."""
    if kind == "dcp":
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save  # noqa: PLC0415

        with tempfile.TemporaryDirectory() as d:
            dcp_to_torch_save(folder, Path(d) / "ref.pt")
            sd = torch.load(Path(d) / "ref.pt", weights_only=False)
        if isinstance(sd.get("model"), dict):  # accelerate saves {"model": state_dict}; DCP flattens it to 'model.<name>'
            return sd["model"]
        return {k.removeprefix("model."): v for k, v in sd.items()}
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint  # noqa: PLC0415

    return get_fp32_state_dict_from_zero_checkpoint(str(folder.parent), tag=folder.name)


def _state_dict_reference(config_dir: Path, kind: str, folder: Path):
    """The source of a full-model export: a model built from config.json holding the upstream-converted tensors."""
    from transformers import AutoConfig, AutoModelForCausalLM  # noqa: PLC0415

    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(config_dir), dtype=torch.float32)
    sd = upstream_state_dict(kind, folder)
    missing, unexpected = model.load_state_dict({k: v.float() for k, v in sd.items()}, strict=False)
    tied = set(tied_copies(model))
    if set(missing) - tied or unexpected:
        raise RecipeError(f"export: verify: the source does not fit its config ({len(missing)} missing, {len(unexpected)} unexpected tensors)")
    return model


def _adapter_reference(base_dir: Path, adapter_cfg_dir: Path, kind: str, folder: Path):
    """The source of an adapter export: peft's model for the adapter's config, holding the upstream-read tensors."""
    from peft import LoraConfig, get_peft_model  # noqa: PLC0415

    model = get_peft_model(_base_for_adapter(base_dir, adapter_cfg_dir), LoraConfig.from_pretrained(adapter_cfg_dir))
    sd = {k.removeprefix("model.") if k.startswith("model.base_model.") else k: v.float() for k, v in upstream_state_dict(kind, folder).items()}
    sd = {k if ".default." in k or "lora_" not in k else re.sub(r"(\.lora_(?:A|B|magnitude_vector))\.", r"\1.default.", k): v for k, v in sd.items()}
    sd = {k + ".default" if k.endswith(".trainable_tokens_delta") else k: v for k, v in sd.items()}  # FSDP drops the adapter name
    missing, unexpected = model.load_state_dict(sd, strict=False)
    lora_missing = [k for k in missing if "lora_" in k]
    if lora_missing or unexpected:
        raise RecipeError(f"export: verify: the source's adapter tensors do not fit the adapter config ({len(lora_missing)} missing, {len(unexpected)} unexpected)")
    return model


# ------------------------------------------------------------------------------------------------------------ export

def export(src: str | Path, dest: str | Path, dtype: str | None = None, base: str | None = None, verify: bool = False,
           max_shard_bytes: int = 2 * 1024**3) -> Path:
    """A run's output_dir, or one of its checkpoint-N folders -> a folder transformers (or peft) loads. Recognised,
    in this order: DeepSpeed ZeRO-1/2/3 (global_stepN/: the fp32 master weights), FSDP SHARDED_STATE_DICT
    (pytorch_model_fsdp_0/), a LoRA adapter (merged into its base), a safetensors model (rewritten). Sharded
    checkpoints of LoRA runs give an adapter folder (export that folder again to merge it). Floats are cast to
    `dtype` if given. verify=True also compares logits with the source (verify_logits)."""
    src = Path(src)
    if not src.is_dir():
        raise RecipeError(f"export: '{src}' is not a folder; give the run's output_dir (or a checkpoint-N in it)")
    tag = _ds_tag_dir(src)
    if tag is not None:
        return _export_sharded(_ZeroSource(tag), tag.parent, dest, dtype, base, verify, "zero", tag, max_shard_bytes)
    if (src / "pytorch_model_fsdp_0").is_dir():
        folder = src / "pytorch_model_fsdp_0"
        return _export_sharded(DCPSource(folder), src, dest, dtype, base, verify, "dcp", folder, max_shard_bytes)
    if (src / "adapter_config.json").is_file():
        return merge_lora(src, dest, base=base, dtype=dtype, max_shard_bytes=max_shard_bytes, verify=verify)
    if (src / "config.json").is_file() and ((src / "model.safetensors").is_file() or (src / "model.safetensors.index.json").is_file()):
        reference = (lambda: _from_pretrained(src)) if verify else None
        return rewrite_model(src, dest, {}, dtype, src, max_shard_bytes, reference=reference)
    found = sorted(p.name for p in src.iterdir())
    ckpts = [n for n in found if re.fullmatch(r"checkpoint-\d+", n)]
    if ckpts:
        raise RecipeError(f"export: '{src}' has no final save (did the run finish?) but holds {', '.join(sorted(ckpts, key=lambda n: int(n.split('-')[1])))}; export one of them: export {src}/{ckpts[-1]} DEST")
    raise RecipeError(
        f"export: '{src}' is none of: DeepSpeed checkpoint (global_stepN/), FSDP sharded checkpoint (pytorch_model_fsdp_0/), "
        f"LoRA adapter (adapter_config.json), safetensors model (config.json + model*.safetensors); found {', '.join(found[:8]) or 'nothing'}"
    )


def _from_pretrained(folder: Path):
    from transformers import AutoModelForCausalLM  # noqa: PLC0415

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)


def _export_sharded(source, ckpt: Path, dest, dtype, base, verify: bool, kind: str, folder: Path, max_shard_bytes: int) -> Path:
    """A sharded checkpoint (ZeRO or DCP) -> a model folder, or an adapter folder when it holds only adapter tensors."""
    adapter_names = [n for n in source.names() if any(m in n for m in ADAPTER_MARKS)]
    if adapter_names:
        return _export_adapter(source, adapter_names, ckpt, dest, dtype, base, verify, kind, folder)
    meta_dir = ckpt if (ckpt / "config.json").is_file() else ckpt.parent
    if not (meta_dir / "config.json").is_file():
        raise RecipeError(f"export: '{ckpt}' is a sharded checkpoint but no config.json is beside it or in its parent; copy the model's config.json there")
    reference = (lambda: _state_dict_reference(meta_dir, kind, folder)) if verify else None
    # a sharded checkpoint holds both names of a tied weight (FSDP's state dict has lm_head.weight beside
    # model.embed_tokens.weight); the model folder holds the shared one only, as save_pretrained writes it
    # the checkpoint holds tensors as the model holds them (fused MoE experts; both names of a tied weight): written in
    # the layout save_pretrained writes, the one every tool that reads hub checkpoints expects
    stored = HubFormat(source, StoredLayout.of_config(meta_dir))
    out = rewrite_model(meta_dir, dest, {}, dtype, meta_dir, max_shard_bytes, source=stored, reference=reference)
    log.info("export: %s checkpoint %s -> %s", kind, folder, out)
    return out


def _export_adapter(source, names: list[str], ckpt: Path, dest, dtype, base, verify: bool, kind: str, folder: Path) -> Path:
    """The adapter tensors of a sharded LoRA checkpoint -> an adapter folder PeftModel.from_pretrained loads.
    adapter_config.json is the one the run wrote (checkpoint-N has it under ZeRO; under FSDP only the final save in
    output_dir has it): it records what the run resolved (e.g. all-linear -> the module list), which a recipe that
    may have changed since cannot be trusted to reproduce."""
    cfg_dir = next((d for d in (ckpt, ckpt.parent) if (d / "adapter_config.json").is_file()), None)
    if cfg_dir is None:
        raise RecipeError(f"export: '{ckpt}' is a LoRA checkpoint but neither it nor its parent has adapter_config.json; copy the run's adapter_config.json (from its output_dir) into it")
    cfg = json.loads((cfg_dir / "adapter_config.json").read_text())
    base_dir = _local_model_dir(base or cfg.get("base_model_name_or_path") or "")
    out_dtype = DTYPES[dtype] if dtype else None
    if cfg.get("bias") in ("all", "lora_only"):  # trained biases: beside the adapter tensors, under their own names
        suffix = ".bias" if cfg["bias"] == "all" else ".base_layer.bias"
        names = names + [n for n in source.names() if n.endswith(suffix) and n not in names]
    mapping = {_peft_name(n): n for n in names}
    layout = [(k, out_dtype or source.meta(n)[0], source.meta(n)[1]) for k, n in mapping.items()]
    base_shapes = expected_model_tensors(base_dir, held=True)
    wrapped = _wrapped(base_dir, cfg)
    plan = plan_merge(cfg, {k: torch.empty(s, device="meta") for k, _, s in layout}, set(base_shapes), wrapped)
    _check_fits(plan, base_shapes.__getitem__)
    with _Staging(Path(dest)) as st:
        st.write_safetensors("adapter_model.safetensors", layout, lambda k: source.get(mapping[k]))
        for f in ("adapter_config.json", *TOKENIZER_FILES):
            if (cfg_dir / f).is_file():
                shutil.copy2(cfg_dir / f, st.tmp / f)
        check_adapter_folder(st.tmp, base_shapes, wrapped)
        if verify:
            verify_logits(st.tmp, lambda: _adapter_reference(base_dir, cfg_dir, kind, folder), out_dtype or torch.float32, base=base_dir)
        out = st.publish()
    log.info("export: %d adapter tensors of %s checkpoint %s -> %s (load with PeftModel.from_pretrained; export it again to merge)", len(layout), kind, folder, out)
    return out


# --------------------------------------------------------------------------------------------------- in-run merge

def merge_in_run(trainer, out_dir: str | Path, dtype: str | None = None, max_shard_bytes: int = 2 * 1024**3) -> Path | None:
    """Merge the LoRA adapter into the base at the end of a run and write a full model folder, on any backend,
    ZeRO-3 included. Every rank must call it: parameters are gathered one module at a time
    (deepspeed.zero.GatheredParameters, a no-op for unpartitioned ones); rank 0 computes W + scale·B@A in fp32 and
    streams it to disk, so it holds one gathered module beyond its training state. Floats are written in `dtype`
    (default: the dtype the run holds its parameters in). Returns the folder on rank 0, None on the others."""
    from peft import PeftModel  # noqa: PLC0415

    acc = trainer.accelerator
    model = acc.unwrap_model(trainer.model)
    if not isinstance(model, PeftModel):
        raise RecipeError("merge_in_run: the model has no LoRA adapter; its final save is already a full model")
    named = list(model.named_parameters())
    if any(".modules_to_save." in n or ".token_adapter." in n for n, _ in named):
        raise RecipeError("merge_in_run: the adapter has modules_to_save or trainable token rows; merge offline: python -m sftrecipes export OUTPUT_DIR DEST")
    config = model.peft_config[model.active_adapter]
    if config.target_parameters or config.use_dora:
        what = "parameter targets (MoE expert tensors, the router)" if config.target_parameters else "DoRA magnitudes"
        raise RecipeError(f"merge_in_run: the adapter has {what}, which it does not merge; merge offline: python -m sftrecipes export OUTPUT_DIR DEST")
    adapter = model.active_adapter
    base_params = [(n, p) for n, p in named if not any(m in n for m in ADAPTER_MARKS)]
    first = next(p for _, p in base_params if p.is_floating_point())
    out_dtype = DTYPES[dtype] if dtype else first.dtype

    def out_name(n: str) -> str:
        return n.removeprefix(PREFIX).replace(".base_layer.", ".")

    layout = [(out_name(n), out_dtype if p.is_floating_point() else p.dtype, tuple(getattr(p, "ds_shape", p.shape))) for n, p in base_params]
    shards = _shards(layout, max_shard_bytes)
    fnames = _shard_files(shards)
    params = dict(base_params)
    by_out = {out_name(n): n for n in params}

    def merged(name: str) -> torch.Tensor | None:
        """All ranks gather; rank 0 gets the merged tensor."""
        n = by_out[name]
        group = [params[n]]
        lora = None
        if n.endswith(".base_layer.weight"):
            module = model.get_submodule(n[: -len(".base_layer.weight")])
            lora = (module.lora_A[adapter].weight, module.lora_B[adapter].weight, module.scaling[adapter])
            group += [lora[0], lora[1]]
        with _gathered([p for p in group if hasattr(p, "ds_id")]):
            if not acc.is_main_process:
                return None
            w = params[n].detach().float()
            if lora is not None:
                w = w + lora[2] * (lora[1].detach().float() @ lora[0].detach().float())
            return w.cpu()

    st = _Staging(Path(out_dir)) if acc.is_main_process else None
    try:
        for fname, shard in zip(fnames, shards):
            writer = SafetensorsStreamWriter(st.tmp / fname, shard) if st else None
            for name, want, _ in shard:
                w = merged(name)
                if writer:
                    writer.write(name, w.to(want))
            if writer:
                writer.close()
                st.hashes[fname] = writer.sha256.hexdigest()
        out = None
        if st:
            _write_index(st.tmp, shards, fnames)
            base_model = model.get_base_model()
            base_model.config.save_pretrained(st.tmp)
            if base_model.generation_config is not None:
                base_model.generation_config.save_pretrained(st.tmp)
            if trainer.processing_class is not None:
                trainer.processing_class.save_pretrained(st.tmp)
            _write_config(st.tmp, st.tmp, layout, out_dtype)
            check_model_folder(st.tmp, out_dtype)
            out = st.publish()
            log.info("merge_in_run: %d tensors -> %s", len(layout), out)
    except BaseException:
        if st:
            shutil.rmtree(st.tmp, ignore_errors=True)
        raise
    acc.wait_for_everyone()
    return out


def _gathered(params: list):
    """deepspeed.zero.GatheredParameters over ZeRO-3 parameters (read only); a null context for none."""
    import contextlib  # noqa: PLC0415

    if not params:
        return contextlib.nullcontext()
    import deepspeed  # noqa: PLC0415

    return deepspeed.zero.GatheredParameters(params, modifier_rank=None)


def _write_config(base_dir: Path, out: Path, layout: list, out_dtype: torch.dtype | None) -> None:
    cfg = json.loads((base_dir / "config.json").read_text())
    shapes = {n: s for n, _, s in layout}
    emb = next((s for n, s in shapes.items() if n.endswith("embed_tokens.weight")), None)
    if emb is not None:
        cfg["vocab_size"] = emb[0]
    if out_dtype is not None:
        cfg["dtype"] = str(out_dtype).removeprefix("torch.")
        cfg.pop("torch_dtype", None)
    cfg.pop("quantization_config", None)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    gen = json.loads((base_dir / "generation_config.json").read_text()) if (base_dir / "generation_config.json").is_file() else {}
    if (out / "tokenizer_config.json").is_file():
        # the fine-tune may have changed the end-of-turn token (chatml: <|im_end|>); generation must stop on it
        from transformers import AutoTokenizer  # noqa: PLC0415

        tok = AutoTokenizer.from_pretrained(out)
        eos = gen.get("eos_token_id")
        eos = eos if isinstance(eos, list) else [] if eos is None else [eos]
        if tok.eos_token_id is not None and tok.eos_token_id not in eos:
            gen["eos_token_id"] = [tok.eos_token_id, *eos]
        if tok.pad_token_id is not None:
            gen["pad_token_id"] = tok.pad_token_id
            cfg["pad_token_id"] = tok.pad_token_id
            (out / "config.json").write_text(json.dumps(cfg, indent=2))
    if gen:
        (out / "generation_config.json").write_text(json.dumps(gen, indent=2))

"""LoRA merge that streams: one tensor in memory at a time.

    python -m sftrecipes merge ADAPTER_DIR OUT_DIR [--base MODEL] [--dtype bfloat16|float16|float32]
    python -m sftrecipes export RUN_OUTPUT DEST [--dtype ...]   (adapter: merge; full model: streamed copy)

The base model's safetensors are read tensor by tensor; each weight that has a LoRA pair gets
W + scale * B @ A (computed in fp32), rows of new tokens are taken from the adapter, and the result is
written straight into safetensors shards whose headers are laid out before any data is read. The output is
written to OUT_DIR.tmp-* and renamed when complete, so a crash never leaves a folder that looks finished.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import struct
import tempfile
from pathlib import Path

import torch

from .recipe import RecipeError

log = logging.getLogger("sftrecipes")

ST_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.int64: "I64",
             torch.int32: "I32", torch.uint8: "U8", torch.int8: "I8", torch.bool: "BOOL"}
TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
PREFIX = "base_model.model."
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "chat_template.jinja", "added_tokens.json")


class SafetensorsStreamWriter:
    """Write one safetensors file whose layout (names, dtypes, shapes) is known up front, tensor by tensor."""

    def __init__(self, path: Path, layout: list[tuple[str, torch.dtype, tuple[int, ...]]], metadata: dict | None = None):
        header: dict = {"__metadata__": metadata or {"format": "pt"}}
        offset = 0
        self._order = []
        for name, dtype, shape in layout:
            nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
            header[name] = {"dtype": ST_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            self._order.append((name, dtype, tuple(shape)))
            offset += nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        self._f = open(path, "wb")
        self._f.write(struct.pack("<Q", len(raw)) + raw)
        self._next = 0

    def write(self, name: str, tensor: torch.Tensor) -> None:
        want_name, dtype, shape = self._order[self._next]
        if name != want_name or tensor.dtype != dtype or tuple(tensor.shape) != shape:
            raise RuntimeError(f"stream writer: expected {want_name} {dtype} {shape}, got {name} {tensor.dtype} {tuple(tensor.shape)}")
        data = tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy()
        self._f.write(memoryview(data))
        self._next += 1

    def close(self) -> None:
        if self._next != len(self._order):
            raise RuntimeError(f"stream writer: {len(self._order) - self._next} tensors never written")
        self._f.close()


def _local_model_dir(name_or_path: str) -> Path:
    p = Path(name_or_path).expanduser()
    if p.is_dir():
        return p
    try:
        from huggingface_hub import snapshot_download  # noqa: PLC0415

        return Path(snapshot_download(name_or_path, allow_patterns=["*.safetensors", "*.json", "tokenizer*"]))
    except Exception as e:  # noqa: BLE001 - any hub failure is the same advice
        raise RecipeError(f"base: '{name_or_path}' is not a local folder and could not be fetched from the hub ({type(e).__name__}); pass --base LOCAL_DIR") from None


def _base_index(base: Path) -> dict[str, Path]:
    """tensor name -> safetensors file of the base model."""
    from safetensors import safe_open  # noqa: PLC0415

    index = base / "model.safetensors.index.json"
    if index.is_file():
        return {k: base / v for k, v in json.loads(index.read_text())["weight_map"].items()}
    files = sorted(base.glob("*.safetensors"))
    if not files:
        raise RecipeError(f"base: no *.safetensors in '{base}'; the streaming merge reads safetensors (convert .bin first)")
    out = {}
    for f in files:
        with safe_open(str(f), framework="pt") as sf:
            out.update({k: f for k in sf.keys()})
    return out


class _Reader:
    """Open each base shard once, lazily."""

    def __init__(self):
        self._open: dict[Path, object] = {}

    def meta(self, path: Path, name: str) -> tuple[torch.dtype, tuple[int, ...]]:
        sl = self._handle(path).get_slice(name)
        dtype = {v: k for k, v in ST_DTYPES.items()}[sl.get_dtype()]
        return dtype, tuple(sl.get_shape())

    def get(self, path: Path, name: str) -> torch.Tensor:
        return self._handle(path).get_tensor(name)

    def _handle(self, path: Path):
        from safetensors import safe_open  # noqa: PLC0415

        if path not in self._open:
            self._open[path] = safe_open(str(path), framework="pt")
        return self._open[path]


def read_adapter(adapter: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    from safetensors.torch import load_file  # noqa: PLC0415

    cfg_path, weights = adapter / "adapter_config.json", adapter / "adapter_model.safetensors"
    if not cfg_path.is_file() or not weights.is_file():
        raise RecipeError(f"adapter: '{adapter}' has no adapter_config.json + adapter_model.safetensors; give a LoRA adapter folder")
    cfg = json.loads(cfg_path.read_text())
    if cfg.get("peft_type") != "LORA":
        raise RecipeError(f"adapter: peft_type {cfg.get('peft_type')} cannot be merged; only LoRA adapters merge")
    if cfg.get("use_dora"):
        raise RecipeError("adapter: DoRA adapters are not supported by the streaming merge; merge with peft's merge_and_unload")
    if cfg.get("fan_in_fan_out"):
        raise RecipeError("adapter: fan_in_fan_out (GPT-2 style Conv1D) adapters are not supported by the streaming merge")
    return cfg, load_file(str(weights))


def plan_merge(cfg: dict, tensors: dict[str, torch.Tensor], base_names: set[str]) -> dict[str, dict]:
    """base tensor name -> what to apply: {'lora': (A, B, scale)} | {'replace': T} | {'rows': (idx, T)}."""
    r, alpha = cfg["r"], cfg["lora_alpha"]
    plan: dict[str, dict] = {}
    token_idx = cfg.get("trainable_token_indices") or {}
    for key, t in tensors.items():
        name = key[len(PREFIX):] if key.startswith(PREFIX) else key
        if name.endswith(".lora_A.weight") or name.endswith(".lora_B.weight"):
            module = name.rsplit(".", 2)[0]
            target = module + ".weight"
            entry = plan.setdefault(target, {})
            entry["A" if ".lora_A." in name else "B"] = t
            mod_leaf = module.rsplit(".", 1)[-1]
            r_m = (cfg.get("rank_pattern") or {}).get(mod_leaf, r)
            a_m = (cfg.get("alpha_pattern") or {}).get(mod_leaf, alpha)
            entry["scale"] = a_m / math.sqrt(r_m) if cfg.get("use_rslora") else a_m / r_m
        elif name.endswith(".token_adapter.trainable_tokens_delta"):
            module = name[: -len(".token_adapter.trainable_tokens_delta")]
            leaf = module.rsplit(".", 1)[-1]
            idx = token_idx.get(leaf) if isinstance(token_idx, dict) else token_idx
            if idx is None:
                raise RecipeError(f"adapter: {key} has no trainable_token_indices entry in adapter_config.json; the adapter is inconsistent")
            plan.setdefault(module + ".weight", {})["rows"] = (torch.tensor(idx), t)
        elif name.endswith(".token_adapter.base_layer.weight"):  # full (resized) embedding saved beside the rows
            plan.setdefault(name[: -len(".token_adapter.base_layer.weight")] + ".weight", {})["replace"] = t
        elif name in base_names:  # modules_to_save: the whole trained tensor
            plan.setdefault(name, {})["replace"] = t
        else:
            raise RecipeError(f"adapter: tensor '{key}' matches nothing in the base model; wrong --base for this adapter?")
    for target, entry in plan.items():
        if target not in base_names:
            raise RecipeError(f"adapter: targets '{target}', which the base model does not have; wrong --base for this adapter?")
        if ("A" in entry) != ("B" in entry):
            raise RecipeError(f"adapter: '{target}' has only one of lora_A/lora_B; the adapter file is incomplete")
    return plan


def _apply(w: torch.Tensor, entry: dict, name: str) -> torch.Tensor:
    out = entry.get("replace", w).to(torch.float32)
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
        a, b = entry["A"].to(torch.float32), entry["B"].to(torch.float32)
        if b.shape[0] != out.shape[0] or a.shape[1] != out.shape[1] or a.shape[0] != b.shape[1]:
            raise RecipeError(f"adapter: '{name}' lora_B{tuple(b.shape)} @ lora_A{tuple(a.shape)} does not fit the base weight {tuple(out.shape)}; wrong base model")
        out += entry["scale"] * (b @ a)
    return out


def merge_lora(adapter_dir: str | Path, out_dir: str | Path, base: str | None = None, dtype: str | None = None,
               max_shard_bytes: int = 2 * 1024**3) -> Path:
    """Merge a LoRA adapter into its base, streaming. Returns the finished output folder."""
    adapter = Path(adapter_dir)
    cfg, tensors = read_adapter(adapter)
    base_dir = _local_model_dir(base or cfg.get("base_model_name_or_path") or "")
    plan = plan_merge(cfg, tensors, set(_base_index(base_dir)))
    tok_src = adapter if (adapter / "tokenizer_config.json").is_file() else base_dir
    out = rewrite_model(base_dir, out_dir, plan, dtype, tok_src, max_shard_bytes)
    log.info("merge: %d tensors changed (%d with LoRA) -> %s", len(plan), sum("A" in e for e in plan.values()), out)
    return out


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


class _DCPSource:
    """Tensors of a torch distributed checkpoint (FSDP SHARDED_STATE_DICT), read one at a time without a process
    group: memory holds one tensor, whichever ranks' files its pieces are in. accelerate nests the model's tensors
    under `prefix` ('model.')."""

    def __init__(self, folder: Path, prefix: str = "model."):
        from torch.distributed.checkpoint import FileSystemReader  # noqa: PLC0415
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata  # noqa: PLC0415

        if not (folder / ".metadata").is_file():
            raise RecipeError(f"export: '{folder}' has no .metadata; the sharded checkpoint is incomplete")
        self.folder, self.prefix = folder, prefix
        meta = FileSystemReader(str(folder)).read_metadata()
        self.tensors = {k: v for k, v in meta.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}

    def names(self) -> list[str]:
        return [k.removeprefix(self.prefix) for k in self.tensors]

    def meta(self, name: str) -> tuple[torch.dtype, tuple[int, ...]]:
        v = self.tensors[self.prefix + name]
        return v.properties.dtype, tuple(v.size)

    def get(self, name: str) -> torch.Tensor:
        import torch.distributed.checkpoint as dcp  # noqa: PLC0415

        dtype, shape = self.meta(name)
        out = {self.prefix + name: torch.empty(shape, dtype=dtype)}
        try:
            dcp.load(out, storage_reader=dcp.FileSystemReader(str(self.folder)), no_dist=True)
        except Exception as e:  # noqa: BLE001 - a torn or missing shard surfaces here
            raise RecipeError(f"export: cannot read '{name}' from '{self.folder}' ({type(e).__name__}: {str(e).splitlines()[0][:120]}); a shard is missing or truncated") from None
        return out[self.prefix + name]


def rewrite_model(base_dir: Path, out_dir: str | Path, plan: dict[str, dict], dtype: str | None, tok_src: Path,
                  max_shard_bytes: int = 2 * 1024**3, source=None) -> Path:
    """Write a model folder tensor by tensor from `source` (default: the safetensors in base_dir), applying `plan`
    and casting floats to `dtype`; config and tokenizer come from base_dir / tok_src."""
    out = Path(out_dir)
    source = source or _SafetensorsSource(base_dir)
    out_dtype = TORCH_DTYPES[dtype] if dtype else None

    layout = []
    for name in source.names():
        src_dtype, shape = source.meta(name)
        entry = plan.get(name, {})
        if "replace" in entry:
            shape = tuple(entry["replace"].shape)
        rows = entry.get("rows")
        if rows is not None:
            shape = (max(shape[0], int(rows[0].max()) + 1), *shape[1:])
        layout.append((name, (out_dtype or src_dtype) if src_dtype.is_floating_point else src_dtype, shape))
    # shard the output by size, in the base's tensor order
    shards, cur, size = [], [], 0
    for item in layout:
        nbytes = math.prod(item[2]) * torch.empty((), dtype=item[1]).element_size()
        if cur and size + nbytes > max_shard_bytes:
            shards.append(cur)
            cur, size = [], 0
        cur.append(item)
        size += nbytes
    shards.append(cur)

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".tmp-", dir=out.parent))
    try:
        weight_map = {}
        names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))] if len(shards) > 1 else ["model.safetensors"]
        for fname, shard in zip(names, shards):
            writer = SafetensorsStreamWriter(tmp / fname, shard)
            for name, want_dtype, _ in shard:
                w = source.get(name)
                if name in plan:
                    w = _apply(w, plan[name], name)
                writer.write(name, w.to(want_dtype))
                weight_map[name] = fname
            writer.close()
        if len(shards) > 1:
            total = sum(math.prod(s) * torch.empty((), dtype=d).element_size() for _, d, s in layout)
            (tmp / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
        for f in TOKENIZER_FILES:
            if (tok_src / f).is_file():
                shutil.copy2(tok_src / f, tmp / f)
        _write_config(base_dir, tmp, layout, out_dtype)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def export(src: str | Path, dest: str | Path, dtype: str | None = None, base: str | None = None) -> Path:
    """A run's output -> a folder `from_pretrained` loads: LoRA adapters are merged into their base; a full
    model folder is rewritten (optionally cast to `dtype`). Anything else is named and refused."""
    src = Path(src)
    if not src.is_dir():
        raise RecipeError(f"export: '{src}' is not a folder; give the run's output_dir (or a checkpoint-N in it)")
    if (src / "adapter_config.json").is_file():
        return merge_lora(src, dest, base=base, dtype=dtype)
    if (src / "config.json").is_file() and ((src / "model.safetensors").is_file() or (src / "model.safetensors.index.json").is_file()):
        return rewrite_model(src, dest, {}, dtype, src)
    if (src / "pytorch_model_fsdp_0").is_dir():
        meta_dir = src if (src / "config.json").is_file() else src.parent
        if not (meta_dir / "config.json").is_file():
            raise RecipeError(f"export: '{src}' is an FSDP sharded checkpoint but no config.json is beside it or in its parent; copy the model's config.json there")
        return rewrite_model(meta_dir, dest, {}, dtype, meta_dir, source=_DCPSource(src / "pytorch_model_fsdp_0"))
    found = sorted(p.name for p in src.iterdir())[:8]
    raise RecipeError(
        f"export: '{src}' holds neither a LoRA adapter (adapter_config.json) nor a safetensors model (config.json + "
        f"model*.safetensors); found {', '.join(found) or 'nothing'}"
    )


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

"""Exports: from whatever a run saved to a folder `from_pretrained` (or `PeftModel.from_pretrained`) loads, streamed.

    python -m sftrecipes merge ADAPTER_DIR OUT_DIR [--base MODEL] [--dtype bfloat16|float16|float32] [--verify]
    python -m sftrecipes export RUN_OUTPUT_OR_CHECKPOINT DEST [--dtype ...] [--base ...] [--verify]

`export` recognises, by looking at the folder: a DeepSpeed ZeRO-1/2/3 checkpoint (global_stepN/), an FSDP
SHARDED_STATE_DICT checkpoint (pytorch_model_fsdp_0/, FSDP1 or FSDP2), a LoRA adapter (merged into its base) and a
safetensors model (rewritten). Sharded checkpoints of LoRA runs become adapter folders; of full runs, model folders.

Every tensor is read on its own and written straight into safetensors shards whose headers are laid out before any
data is read, so memory follows the largest tensor, not the model. Each export is checked before it is published:
tensor names, shapes and dtypes against the model built from its config on the meta device; a SHA256SUMS manifest;
with verify=True also logits against the source. The output is written to DEST.tmp-* and renamed when complete, so
a crash, a full disk or a torn input never leaves a folder that looks finished. See docs/exports.md.

This module recognises the folder and picks the reader; the rest is one job per module: readers.py (safetensors
folders, ZeRO checkpoints) and dcp.py (FSDP's DCP) read tensors; layout.py maps the tensors a model holds to those
save_pretrained stores; adapters.py reads and plans an adapter's merge; rewrite.py writes a model folder through
writer.py (streamed shards, staging folder, manifest); verify.py checks the result; merge.py is the LoRA merge,
offline and in-run. Callers import from here (__all__).
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import torch

from sftrecipes.core.errors import RecipeError
from sftrecipes.export.adapters import (
    ADAPTER_MARKS,
    _check_fits,
    _peft_name,
    _wrapped,
    param_wrappers,
    plan_merge,
    read_adapter,
)
from sftrecipes.export.dcp import DCPSource
from sftrecipes.export.layout import HubFormat, StoredLayout, expected_model_tensors, tied_copies
from sftrecipes.export.merge import merge_in_run, merge_lora
from sftrecipes.export.readers import _ZeroSource, folder_tensors, read_st_header
from sftrecipes.export.rewrite import rewrite_model
from sftrecipes.export.verify import (
    LOGIT_TOL,
    _adapter_reference,
    _from_pretrained,
    _state_dict_reference,
    check_adapter_folder,
    check_model_folder,
    upstream_state_dict,
    verify_logits,
)
from sftrecipes.export.writer import MANIFEST, PROCESSOR_FILES, TOKENIZER_FILES, SafetensorsStreamWriter, _Staging
from sftrecipes.facts.folders import ds_tag_dir as _ds_tag_dir
from sftrecipes.facts.folders import export_kind
from sftrecipes.facts.folders import local_model_dir as _local_model_dir
from sftrecipes.model.load import DTYPES

log = logging.getLogger("sftrecipes")

# what cli.py, train.py, checkpoints.py, demo.py, the tests and the benchmark call; each lives in the module named
__all__ = ["export", "merge_lora", "merge_in_run", "rewrite_model", "read_adapter", "plan_merge", "param_wrappers",
           "StoredLayout", "HubFormat", "tied_copies", "expected_model_tensors", "folder_tensors", "read_st_header",
           "check_model_folder", "check_adapter_folder", "verify_logits", "upstream_state_dict", "LOGIT_TOL",
           "SafetensorsStreamWriter", "MANIFEST", "DCPSource", "RecipeError"]


def export(src: str | Path, dest: str | Path, dtype: str | None = None, base: str | None = None, verify: bool = False,
           max_shard_bytes: int = 2 * 1024**3) -> Path:
    """A run's output_dir, or one of its checkpoint-N folders -> a folder transformers (or peft) loads. Recognised,
    in this order: DeepSpeed ZeRO-1/2/3 (global_stepN/: the fp32 master weights), FSDP SHARDED_STATE_DICT
    (pytorch_model_fsdp_0/), a LoRA adapter (merged into its base), a safetensors model (rewritten). Sharded
    checkpoints of LoRA runs give an adapter folder (export that folder again to merge it). Floats are cast to
    `dtype` if given. verify=True also compares logits with the source (verify_logits)."""
    src = Path(src)
    kind = export_kind(src)  # (torch-free: cli.py asks it before torch loads)
    if kind == "zero":
        tag = _ds_tag_dir(src)
        return _export_sharded(_ZeroSource(tag), tag.parent, dest, dtype, base, verify, "zero", tag, max_shard_bytes)
    if kind == "dcp":
        folder = src / "pytorch_model_fsdp_0"
        return _export_sharded(DCPSource(folder), src, dest, dtype, base, verify, "dcp", folder, max_shard_bytes)
    if kind == "adapter":
        return merge_lora(src, dest, base=base, dtype=dtype, max_shard_bytes=max_shard_bytes, verify=verify, verb="export")
    reference = (lambda: _from_pretrained(src)) if verify else None
    return rewrite_model(src, dest, {}, dtype, src, max_shard_bytes, reference=reference)


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
        for f in ("adapter_config.json", *TOKENIZER_FILES, *PROCESSOR_FILES):
            if (cfg_dir / f).is_file():
                shutil.copy2(cfg_dir / f, st.tmp / f)
        check_adapter_folder(st.tmp, base_shapes, wrapped)
        if verify:
            verify_logits(st.tmp, lambda: _adapter_reference(base_dir, cfg_dir, kind, folder), out_dtype or torch.float32, base=base_dir)
        out = st.publish()
    log.info("export: %d adapter tensors of %s checkpoint %s -> %s (load with PeftModel.from_pretrained; export it again to merge)", len(layout), kind, folder, out)
    return out

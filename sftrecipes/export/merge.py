"""Merging a LoRA adapter into its base: offline from an adapter folder (merge_lora, streamed), and at the end of a
run from the live model on every backend, ZeRO-3 included (merge_in_run)."""

from __future__ import annotations

import contextlib
import logging
import shutil
from pathlib import Path

import torch

from sftrecipes.core.errors import RecipeError
from sftrecipes.export.adapters import ADAPTER_MARKS, PREFIX, _check_fits, _wrapped, plan_merge, read_adapter
from sftrecipes.export.layout import StoredLayout
from sftrecipes.export.readers import _SafetensorsSource
from sftrecipes.export.rewrite import _write_config, rewrite_model
from sftrecipes.export.verify import _peft_reference, check_model_folder
from sftrecipes.export.writer import SafetensorsStreamWriter, _shard_files, _shards, _Staging, _write_index
from sftrecipes.facts.folders import merge_base
from sftrecipes.model.load import DTYPES

log = logging.getLogger("sftrecipes")


def merge_lora(adapter_dir: str | Path, out_dir: str | Path, base: str | None = None, dtype: str | None = None,
               max_shard_bytes: int = 2 * 1024**3, verify: bool = False, verb: str = "merge") -> Path:
    """Merge a LoRA adapter into its (16-bit or fp32) base, streaming. A QLoRA adapter merges the same way: into the
    unquantized base, which is what the 4-bit weights were quantized from. verify=True: before the folder is
    published, its logits are compared with peft's unmerged adapter on the same base (verify.verify_logits; the
    error names `verb`, the command that asked). Returns the finished output folder."""
    adapter = Path(adapter_dir)
    cfg, tensors = read_adapter(adapter)
    base_dir = merge_base(cfg, base)
    source = _SafetensorsSource(base_dir)
    held = StoredLayout.of_config(base_dir).held if (base_dir / "config.json").is_file() else {}
    plan = plan_merge(cfg, tensors, set(source.names()) | set(held), _wrapped(base_dir, cfg))
    _check_fits(plan, lambda n: held[n] if n in held else source.meta(n)[1])
    tok_src = adapter if (adapter / "tokenizer_config.json").is_file() else base_dir
    reference = (lambda: _peft_reference(base_dir, adapter)) if verify else None
    out = rewrite_model(base_dir, out_dir, plan, dtype, tok_src, max_shard_bytes, source=source, reference=reference, verb=verb)
    log.info("merge: %d tensors changed (%d with LoRA) -> %s", len(plan), sum("A" in e for e in plan.values()), out)
    return out


def merge_in_run(trainer, out_dir: str | Path, dtype: str | None = None, max_shard_bytes: int = 2 * 1024**3) -> Path | None:
    """Merge the LoRA adapter into the base at the end of a run and write a full model folder, on any backend,
    ZeRO-3 included. Every rank must call it: parameters are gathered one module at a time
    (deepspeed.zero.GatheredParameters, a no-op for unpartitioned ones); rank 0 computes W + scale·B@A in fp32 and
    streams it to disk, so it holds one gathered module beyond its training state. Floats are written in `dtype`
    (default: the dtype the run holds its parameters in). Returns the folder on rank 0, None on the others."""
    from peft import PeftModel

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
    if not params:
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(params, modifier_rank=None)

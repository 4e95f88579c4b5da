"""Checks of an export before it is published: its tensors against the config (or an adapter's against its base), and
with --verify its logits against the source as upstream code reads it (verify_logits, LOGIT_TOL)."""

from __future__ import annotations

import json
import logging
import re
import tempfile
from pathlib import Path

import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from transformers import AutoConfig, AutoTokenizer

from sftrecipes.core.errors import RecipeError
from sftrecipes.export.adapters import _check_fits, plan_merge, read_adapter
from sftrecipes.export.layout import StoredLayout, tied_copies
from sftrecipes.export.readers import folder_tensors
from sftrecipes.model.meta import auto_class, auto_class_of

log = logging.getLogger("sftrecipes")


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
        ids = AutoTokenizer.from_pretrained(folder)(PROBE_TEXT, return_tensors="pt").input_ids
        if ids.numel() > 1:
            return ids
    return (torch.arange(1, 33) * 7919 % vocab).unsqueeze(0)  # a fixed spread of token ids when there is no tokenizer


def _logits(model, ids) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits.float()  # no cache: a recurrent one (RecurrentGemma) needs attention layers


def verify_logits(folder: Path, reference, dtype: torch.dtype, base: Path | None = None, verb: str = "export") -> float:
    """Reload the export from `folder` (upcast to fp32; an adapter on `base`) and compare its logits on a fixed
    prompt with those of `reference()`, the source checkpoint read by upstream code. Prints the max abs difference;
    above LOGIT_TOL[dtype] × max(1, max |logit|) it is an error (a RecipeError starting with `verb`: the command
    that wrote the folder, export or merge). Needs RAM for both models in fp32."""
    if base is None:
        ours = auto_class_of(folder).from_pretrained(folder, dtype=torch.float32)
    else:
        from peft import PeftModel

        ours = PeftModel.from_pretrained(_base_for_adapter(base, folder), folder)
    ids = _probe_ids(folder if (folder / "tokenizer_config.json").is_file() else (base or folder), ours.config.vocab_size)
    got = _logits(ours, ids)
    del ours
    want = _logits(reference(), ids)
    diff = (got - want).abs().max().item()
    tol = LOGIT_TOL[dtype] * max(1.0, want.abs().max().item())
    print(f"verify: max abs logits difference {diff:.3g} on {ids.shape[1]} tokens (tolerance {tol:.3g}, {str(dtype).removeprefix('torch.')})", flush=True)
    if not diff <= tol:
        source = "adapter and base" if verb == "merge" else "checkpoint"
        raise RecipeError(f"{verb}: verify failed: logits differ from the source by {diff:.3g} > {tol:.3g}; the {verb} is not "
                          f"the trained model and was not published — do not use it (report the source {source})")
    return diff


def _from_pretrained(folder: Path):
    return auto_class_of(folder).from_pretrained(folder, dtype=torch.float32)


def _base_for_adapter(base_dir: Path, adapter: Path):
    """The base model in fp32, its embeddings resized as the run resized them when it added tokens: to the size of
    the resized embedding saved beside the adapter, or else past the highest trainable-token row. peft then reads the
    adapter with the run's own target conversion (compat.keep_dense_linears_in_moe_conversion)."""
    from sftrecipes.model import compat

    compat.keep_dense_linears_in_moe_conversion()
    model = auto_class_of(base_dir).from_pretrained(base_dir, dtype=torch.float32)
    rows = {shape[0] for name, (_, shape) in folder_tensors(adapter).items()
            if re.search(r"embed_tokens\.(token_adapter\.base_layer\.)?weight$", name)}
    indices = json.loads((adapter / "adapter_config.json").read_text()).get("trainable_token_indices") or {}
    for idx in indices.values() if isinstance(indices, dict) else [indices]:
        rows.add(max(idx) + 1)
    if rows and max(rows) > model.get_input_embeddings().weight.shape[0]:
        model.resize_token_embeddings(max(rows))
    return model


def _peft_reference(base_dir: Path, adapter: Path):
    """The source of a merge: the base in fp32 with the adapter applied unmerged, by peft, holding every LoRA tensor
    the adapter file holds. peft 0.21's loader renames adapter keys through transformers' checkpoint conversions, and
    for some models leaves tensors at their initial values without a word (Laguna's shared_experts: lora_B stays 0).
    Such tensors are put in by name (the saved key is the parameter's name less the adapter name), and a warning says
    that PeftModel.from_pretrained misses them."""
    from peft import PeftModel
    from safetensors import safe_open

    model = PeftModel.from_pretrained(_base_for_adapter(base_dir, adapter), adapter)
    name = model.active_adapter
    live = {n.replace(f".{name}.", "."): p for n, p in model.named_parameters() if ".lora_" in n}
    missed = []
    with safe_open(adapter / "adapter_model.safetensors", "pt") as f, torch.no_grad():
        for key in f.keys():
            p = live.get(key)
            if p is None:
                continue
            saved = f.get_tensor(key).to(p.dtype)
            if saved.shape == p.shape and not torch.equal(saved, p):
                p.copy_(saved)
                missed.append(key)
    if missed:
        log.warning("verify: peft's PeftModel.from_pretrained left %d LoRA tensors of %s at their initial values (e.g. %s): "
                    "the reference holds them as saved; a model loaded with peft would miss them, the merged one holds them",
                    len(missed), adapter, missed[0])
    return model


def upstream_state_dict(kind: str, folder: Path) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors as the upstream converters read them (whole, in memory): torch's DCP converter, or
    DeepSpeed's zero_to_fp32. Used as the reference for verify and in tests."""
    if kind == "dcp":
        with tempfile.TemporaryDirectory() as d:
            dcp_to_torch_save(folder, Path(d) / "ref.pt")
            sd = torch.load(Path(d) / "ref.pt", weights_only=False)
        if isinstance(sd.get("model"), dict):  # accelerate saves {"model": state_dict}; DCP flattens it to 'model.<name>'
            return sd["model"]
        return {k.removeprefix("model."): v for k, v in sd.items()}
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    return get_fp32_state_dict_from_zero_checkpoint(str(folder.parent), tag=folder.name)


def _state_dict_reference(config_dir: Path, kind: str, folder: Path):
    """The source of a full-model export: a model built from config.json holding the upstream-converted tensors."""
    cfg = AutoConfig.from_pretrained(config_dir)
    model = auto_class(cfg.model_type).from_config(cfg, dtype=torch.float32)
    sd = upstream_state_dict(kind, folder)
    missing, unexpected = model.load_state_dict({k: v.float() for k, v in sd.items()}, strict=False)
    tied = set(tied_copies(model))
    if set(missing) - tied or unexpected:
        raise RecipeError(f"export: verify: the source does not fit its config ({len(missing)} missing, {len(unexpected)} unexpected tensors)")
    return model


def _adapter_reference(base_dir: Path, adapter_cfg_dir: Path, kind: str, folder: Path):
    """The source of an adapter export: peft's model for the adapter's config, holding the upstream-read tensors."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(_base_for_adapter(base_dir, adapter_cfg_dir), LoraConfig.from_pretrained(adapter_cfg_dir))
    sd = {k.removeprefix("model.") if k.startswith("model.base_model.") else k: v.float() for k, v in upstream_state_dict(kind, folder).items()}
    sd = {k if ".default." in k or "lora_" not in k else re.sub(r"(\.lora_(?:A|B|magnitude_vector))\.", r"\1.default.", k): v for k, v in sd.items()}
    sd = {k + ".default" if k.endswith(".trainable_tokens_delta") else k: v for k, v in sd.items()}  # FSDP drops the adapter name
    missing, unexpected = model.load_state_dict(sd, strict=False)
    lora_missing = [k for k in missing if "lora_" in k]
    if lora_missing or unexpected:
        raise RecipeError(f"export: verify: the source's adapter tensors do not fit the adapter config ({len(lora_missing)} missing, {len(unexpected)} unexpected)")
    return model

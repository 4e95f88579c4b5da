"""Finding checkpoints to resume from, and checking that what was saved holds what it should."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

from .recipe import RecipeError

log = logging.getLogger("sftrecipes")

WEIGHT_PATTERNS = ("model.safetensors", "model.safetensors.index.json", "adapter_model.safetensors", "pytorch_model*.bin",
                   "pytorch_model_fsdp_*", "global_step*")


def is_complete(ckpt: Path) -> bool:
    """A Trainer checkpoint folder with its state and weights written."""
    if not (ckpt / "trainer_state.json").is_file():
        return False
    return any(any(ckpt.glob(p)) for p in WEIGHT_PATTERNS)


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    out = Path(output_dir)
    if not out.is_dir():
        return None
    found = []
    for p in out.iterdir():
        m = re.fullmatch(r"checkpoint-(\d+)", p.name)
        if m and p.is_dir():
            if is_complete(p):
                found.append((int(m.group(1)), p))
            else:
                log.warning("resume: skipping incomplete checkpoint %s", p)
    return max(found)[1] if found else None


def resolve_resume(value: str | None, output_dir: str) -> str | None:
    """`resume_from_checkpoint`: None, a folder, or 'auto' (the latest complete checkpoint, if any)."""
    if value is None:
        return None
    if value == "auto":
        ckpt = latest_checkpoint(output_dir)
        log.info("resume: %s", f"from {ckpt}" if ckpt else f"no complete checkpoint in {output_dir}, starting fresh")
        return str(ckpt) if ckpt else None
    if not is_complete(Path(value)):
        raise RecipeError(f"resume_from_checkpoint: '{value}' is not a complete checkpoint (needs trainer_state.json and weights); pick another or use auto")
    return value


def saved_tensor_names(folder: str | Path) -> dict[str, tuple[int, ...]]:
    """name -> shape of every tensor in a saved model/adapter folder (safetensors, sharded or not)."""
    from safetensors import safe_open  # noqa: PLC0415

    folder = Path(folder)
    files = sorted(folder.glob("*.safetensors"))
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = sorted({folder / f for f in json.loads(index.read_text())["weight_map"].values()})
    out: dict[str, tuple[int, ...]] = {}
    for f in files:
        if not f.is_file():
            raise RuntimeError(f"save check: shard {f.name} listed in the index is missing from {folder}")
        with safe_open(str(f), framework="pt") as sf:
            for k in sf.keys():
                out[k] = tuple(sf.get_slice(k).get_shape())
    return out


def check_saved(folder: str | Path, expected: set[str]) -> int:
    """Fail loudly unless every expected tensor name was saved, non-empty. Returns the tensor count."""
    saved = saved_tensor_names(folder)
    if not saved:
        raise RuntimeError(f"save check: {folder} holds 0 tensors; the save lost the weights")
    missing = sorted(expected - set(saved))
    if missing:
        raise RuntimeError(f"save check: {len(missing)} tensors missing from {folder}, e.g. {missing[:3]}")
    empty = [k for k, shape in saved.items() if 0 in shape]
    if empty:
        raise RuntimeError(f"save check: {len(empty)} empty tensors in {folder}, e.g. {empty[:3]}")
    return len(saved)


def expected_saved_names(model) -> set[str]:
    """Tensor names `save_model` must write for this (unwrapped) model: the adapter's for a PEFT model, otherwise
    every state-dict entry except the tied copies save_pretrained leaves out (e.g. lm_head tied to embed_tokens)."""
    from peft import PeftModel, get_peft_model_state_dict  # noqa: PLC0415

    if isinstance(model, PeftModel):
        return set(get_peft_model_state_dict(model).keys())
    tied = set(getattr(model, "all_tied_weights_keys", None) or {})
    return {name for name in model.state_dict() if name not in tied}


def dcp_tensor_names(folder: str | Path) -> dict[str, tuple[int, ...]]:
    """name -> shape of every tensor in a torch distributed checkpoint folder (its .metadata; no data read)."""
    from torch.distributed.checkpoint import FileSystemReader  # noqa: PLC0415
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata  # noqa: PLC0415

    meta = FileSystemReader(str(folder)).read_metadata()
    return {k: tuple(v.size) for k, v in meta.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}


def save_final(trainer, recipe) -> int:
    """The run's final save, then its check (every expected tensor present and non-empty). Returns the tensor count.

    LoRA adapters are small: under FSDP they are gathered (FULL_STATE_DICT) and saved as safetensors. A full model
    under FSDP with SHARDED_STATE_DICT is saved sharded (one piece per rank, no rank-0 gather of the whole model) as
    <output_dir>/pytorch_model_fsdp_0, beside config and tokenizer; `python -m sftrecipes export` converts it.
    """
    out = Path(trainer.args.output_dir)
    acc = trainer.accelerator
    plugin = getattr(acc.state, "fsdp_plugin", None)
    sharded = plugin is not None and "SHARDED" in str(plugin.state_dict_type) and not recipe.model.use_peft_lora
    unwrapped = acc.unwrap_model(trainer.model)
    expected = expected_saved_names(unwrapped)
    if sharded:
        from accelerate.utils import save_fsdp_model  # noqa: PLC0415

        save_fsdp_model(plugin, acc, trainer.model, str(out))
        if trainer.is_world_process_zero():
            unwrapped.config.save_pretrained(out)
            unwrapped.generation_config.save_pretrained(out)
            trainer.processing_class.save_pretrained(out)
    else:
        if plugin is not None:
            plugin.set_state_dict_type("FULL_STATE_DICT")
        trainer.save_model(str(out))
    acc.wait_for_everyone()
    if not trainer.is_world_process_zero():
        return 0
    if sharded:
        saved = dcp_tensor_names(out / "pytorch_model_fsdp_0")
        expected = {f"model.{n}" for n in expected}
        missing = sorted(expected - set(saved))
        empty = [k for k, shape in saved.items() if 0 in shape]
        if not saved or missing or empty:
            raise RuntimeError(f"save check: sharded save in {out} lacks {len(missing)} tensors (e.g. {missing[:3]}), {len(empty)} empty")
        return len(saved)
    return check_saved(out, expected)

"""The run's final save and its check: the model (or adapter) written the way the backend needs, then every tensor it
must hold found in the files, non-empty, before the run may be marked finished."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from accelerate.utils import broadcast_object_list, save_fsdp_model
from peft import PeftModel, get_peft_model_state_dict
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from sftrecipes.export import StoredLayout, tied_copies
from sftrecipes.run.checkpoints import SaveFailed
from sftrecipes.train.saving import named_write_errors

log = logging.getLogger("sftrecipes")

_NOT_FINISHED = "; the final save is incomplete, so the run is not marked finished"


def saved_tensor_names(folder: str | Path) -> dict[str, tuple[int, ...]]:
    """name -> shape of every tensor in a saved model/adapter folder (safetensors, sharded or not)."""
    folder = Path(folder)
    files = sorted(folder.glob("*.safetensors"))
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = sorted({folder / f for f in json.loads(index.read_text())["weight_map"].values()})
    out: dict[str, tuple[int, ...]] = {}
    for f in files:
        if not f.is_file():
            raise SaveFailed(f"save check: shard {f.name} listed in the index is missing from {folder}{_NOT_FINISHED}")
        with safe_open(str(f), framework="pt") as sf:
            for k in sf.keys():
                out[k] = tuple(sf.get_slice(k).get_shape())
    return out




def check_saved(folder: str | Path, expected: set[str]) -> int:
    """Fail unless every expected tensor name was saved, non-empty: SaveFailed, one line naming the folder, how many
    tensors are wrong and a few of their names (train.py exits 1 with it). `folder` is a safetensors model/adapter
    folder (sharded or not) or a DCP save (holding .metadata). Returns the tensor count."""
    folder = Path(folder)
    saved = dcp_tensor_names(folder) if (folder / ".metadata").is_file() else saved_tensor_names(folder)
    if not saved:
        raise SaveFailed(f"save check: {folder} holds 0 tensors; the save lost the weights{_NOT_FINISHED}")
    missing = sorted(expected - set(saved))
    if missing:
        raise SaveFailed(f"save check: {len(missing)} of {len(expected)} expected tensors missing from {folder}, e.g. {missing[:3]}{_NOT_FINISHED}")
    empty = sorted(k for k, shape in saved.items() if 0 in shape)
    if empty:
        raise SaveFailed(f"save check: {len(empty)} empty tensors (0 elements) in {folder}, e.g. {empty[:3]}{_NOT_FINISHED}")
    return len(saved)


def expected_saved_names(model, hub: bool = True) -> set[str]:
    """Tensor names `save_model` must write for this (unwrapped) model: the adapter's for a PEFT model, otherwise
    every state-dict entry except the tied copies save_pretrained leaves out (e.g. lm_head tied to embed_tokens) — in
    the hub's layout save_pretrained converts to (hub=True: e.g. one tensor per MoE expert), or as held in memory
    (hub=False: what a sharded DCP save holds)."""
    if isinstance(model, PeftModel):
        return set(get_peft_model_state_dict(model).keys())
    tied = set(tied_copies(model))
    kept = {name: t for name, t in model.state_dict().items() if name not in tied}
    if not hub:
        return set(kept)
    params = dict(model.named_parameters(remove_duplicate=False))  # ZeRO-3 keeps the full shape on the parameter
    return set(StoredLayout(model, {n: tuple(getattr(params.get(n), "ds_shape", None) or t.shape) for n, t in kept.items()}).stored)


def dcp_tensor_names(folder: str | Path) -> dict[str, tuple[int, ...]]:
    """name -> shape of every tensor in a torch distributed checkpoint folder (its .metadata; no data read)."""
    meta = FileSystemReader(str(folder)).read_metadata()
    return {k: tuple(v.size) for k, v in meta.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}


def save_final(trainer, recipe) -> int:
    """save_checked, with a write failure (a full disk) reported as SaveFailed naming the file and the cause."""
    with named_write_errors(Path(trainer.args.output_dir)):
        return save_checked(trainer, recipe)


def save_checked(trainer, recipe) -> int:
    """The run's final save, then its check (every expected tensor present and non-empty). Returns the tensor count
    (0 on ranks other than 0); a failed check raises SaveFailed on every rank, rank 0's line.

    LoRA adapters are small: under FSDP they are gathered (FULL_STATE_DICT) and saved as safetensors. A full model
    under FSDP with SHARDED_STATE_DICT is saved sharded (one piece per rank, no rank-0 gather of the whole model) as
    <output_dir>/pytorch_model_fsdp_0, beside config and tokenizer; `python -m sftrecipes export` converts it.
    """
    out = Path(trainer.args.output_dir)
    acc = trainer.accelerator
    plugin = getattr(acc.state, "fsdp_plugin", None)
    sharded = plugin is not None and "SHARDED" in str(plugin.state_dict_type) and not recipe.model.use_peft_lora
    unwrapped = acc.unwrap_model(trainer.model)
    expected = expected_saved_names(unwrapped, hub=not sharded)
    if sharded:
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
        add_resized_embeddings_under_zero3(trainer, out, expected)
    acc.wait_for_everyone()
    count, verdict = 0, None
    if trainer.is_world_process_zero():
        try:
            count = (check_saved(out / "pytorch_model_fsdp_0", {f"model.{n}" for n in expected}) if sharded
                     else check_saved(out, expected))
        except SaveFailed as e:
            verdict = str(e)
    if acc.num_processes > 1:  # rank 0's verdict to every rank: they fail together (a rank 0 leaving alone broke the
        verdict = broadcast_object_list([verdict])[0]  # others' next collective: a traceback each, or a hang)
    if verdict:
        raise SaveFailed(verdict, every_rank=acc.num_processes > 1)
    return count


def add_resized_embeddings_under_zero3(trainer, out: Path, expected: set[str]) -> None:
    """A LoRA run that added tokens saves the resized embedding and LM head beside the adapter (peft's trainable
    tokens' base layer, or the whole layers where peft sets save_embedding_layers: XLM's pred_layer, XLNet's lm_loss),
    so the adapter loads into a base of the new size. Under ZeRO-3 those frozen, partitioned weights are absent from
    the consolidated state dict the Trainer hands peft (it leaves frozen parameters out), and the adapter comes out
    without them. Every rank gathers the frozen partitioned ones the adapter must hold (the same list on every rank:
    a collective); rank 0 adds any the file lacks."""
    unwrapped = trainer.accelerator.unwrap_model(trainer.model)
    params = dict(unwrapped.named_parameters(remove_duplicate=False))  # a tied head is the embedding under a 2nd name
    names = sorted(n for n in expected if hasattr(params.get(n), "ds_id") and not params[n].requires_grad)
    if not names:
        return
    import deepspeed

    with deepspeed.zero.GatheredParameters(list({id(params[n]): params[n] for n in names}.values()), modifier_rank=None):
        gathered = {n: params[n].detach().cpu().clone() for n in names} if trainer.is_world_process_zero() else {}
    path = out / "adapter_model.safetensors"
    if not gathered or not path.is_file():
        return
    tensors = load_file(path)
    added = {n: t for n, t in gathered.items() if n not in tensors}
    if added:
        tmp = path.with_name(path.name + ".tmp")
        save_file({**tensors, **added}, tmp, metadata={"format": "pt"})
        tmp.replace(path)
        log.info("save: added the frozen %s to %s (ZeRO-3 left them out)", ", ".join(sorted(added)), path)

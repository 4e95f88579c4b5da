"""Finding checkpoints to resume from, and checking that what was saved holds what it should."""

from __future__ import annotations

import json
import logging
import os
import re
import time
from pathlib import Path

from .recipe import RecipeError

log = logging.getLogger("sftrecipes")

MARKER = "checkpoint.complete.json"  # written last, after every rank finished writing the checkpoint
FINAL = "final.complete.json"  # in output_dir, written last by a run whose final save was checked: the run is finished


def write_marker(ckpt: Path) -> None:
    """Record every file of a finished checkpoint with its size; written atomically, last."""
    files = {str(p.relative_to(ckpt)): p.stat().st_size for p in sorted(ckpt.rglob("*")) if p.is_file() and p.name != MARKER}
    tmp = ckpt / (MARKER + ".tmp")
    tmp.write_text(json.dumps({"step": int(ckpt.name.rsplit("-", 1)[-1]), "files": files}, indent=1))
    tmp.replace(ckpt / MARKER)


def torn(ckpt: Path, name: str = MARKER) -> str | None:
    """Why a checkpoint cannot be trusted (no marker, a file missing or of another size), or None if complete."""
    marker = Path(ckpt) / name
    if not marker.is_file():
        return f"no {name} (the save did not finish)"
    try:
        files = json.loads(marker.read_text())["files"]
    except (json.JSONDecodeError, KeyError):
        return f"{name} is unreadable"
    for rel, size in files.items():
        f = ckpt / rel
        if not f.is_file():
            return f"{rel} is missing"
        if f.stat().st_size != size:
            return f"{rel} has {f.stat().st_size} bytes, {size} were written"
    return None


def is_complete(ckpt: Path) -> bool:
    return torn(ckpt) is None


def checkpoints(output_dir: str | Path) -> list[tuple[int, Path]]:
    out = Path(output_dir)
    found = []
    if out.is_dir():
        for p in out.iterdir():
            m = re.fullmatch(r"checkpoint-(\d+)", p.name)
            if m and p.is_dir():
                found.append((int(m.group(1)), p))
    return sorted(found)


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    """The newest complete checkpoint; incomplete ones are skipped with a warning."""
    for _, p in reversed(checkpoints(output_dir)):
        why = torn(p)
        if why is None:
            return p
        log.warning("resume: skipping %s: %s", p, why)
    return None


def resolve_resume(value: str | None, output_dir: str) -> str | None:
    """`resume_from_checkpoint`: None, a folder, or 'auto' (the latest complete checkpoint, if any)."""
    if value is None:
        return None
    if value == "auto":
        ckpt = latest_checkpoint(output_dir)
        log.info("resume: %s", f"from {ckpt}" if ckpt else f"no complete checkpoint in {output_dir}, starting fresh")
        return str(ckpt) if ckpt else None
    why = torn(Path(value))
    if why is not None:
        raise RecipeError(f"resume_from_checkpoint: '{value}' is not a complete checkpoint ({why}); pick another or use auto")
    return value


def _final_files(out: Path) -> dict[str, int]:
    """What a finished run leaves in output_dir (final save, summary, metrics) with sizes: not the checkpoints, hidden
    files (lock, heartbeats), TensorBoard logs, nor what every launch rewrites."""
    skip = {FINAL, "accelerate_config.yaml", "runs"}
    files = {}
    for root, dirs, names in os.walk(out):
        rel_root = Path(root).relative_to(out)
        if rel_root == Path("."):
            dirs[:] = [d for d in dirs if not (d.startswith(".") or d in skip or re.fullmatch(r"checkpoint-\d+", d))]
            names = [n for n in names if not (n.startswith(".") or n in skip)]
        for n in names:
            files[str(rel_root / n)] = (Path(root) / n).stat().st_size
    return dict(sorted(files.items()))


def mark_finished(output_dir: str | Path, step: int) -> None:
    """The run is finished: its final save was checked. Written atomically, last."""
    out = Path(output_dir)
    tmp = out / (FINAL + ".tmp")
    tmp.write_text(json.dumps({"step": step, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "files": _final_files(out)}, indent=1))
    tmp.replace(out / FINAL)


def forget_finished(output_dir: str | Path) -> None:
    """A run that trains in output_dir again changes what the marker lists: it no longer holds a finished run."""
    (Path(output_dir) / FINAL).unlink(missing_ok=True)


def finished_run(recipe) -> str | None:
    """resume_from_checkpoint: auto on an output_dir whose run finished (final save complete, every file it listed
    still of its size) has nothing to do (a SLURM requeue of a finished job): the line that says so, else None."""
    if recipe.trl.get("resume_from_checkpoint") != "auto":
        return None
    out = Path(recipe.trl.get("output_dir") or "trainer_output")
    if torn(out, FINAL) is not None:
        return None
    done = json.loads((out / FINAL).read_text())
    return (f"resume: {out} holds a finished run ({done['step']} steps, final save complete, {done['time']}); nothing to "
            "do — to train again, set another output_dir or --resume_from_checkpoint none")


def rotate(output_dir: Path, limit: int | None, keep: Path | None = None) -> list[Path]:
    """save_total_limit, safely: delete complete checkpoints beyond the newest `limit` complete ones, never the
    newest complete one, never an incomplete one (it is evidence), never `keep` (the best model)."""
    if not limit:
        return []
    complete = [p for _, p in checkpoints(output_dir) if is_complete(p)]
    doomed = [p for p in complete[: -max(limit, 1)] if keep is None or p.resolve() != Path(keep).resolve()]
    for p in doomed:
        import shutil  # noqa: PLC0415

        shutil.rmtree(p, ignore_errors=True)
    return doomed


def make_checkpoints_atomic(trainer) -> None:
    """Every checkpoint gets its marker only after all ranks wrote their files; rotation happens after that and by
    the rule above (transformers rotates before anything marks a checkpoint complete)."""
    original = trainer._save_checkpoint

    def save_checkpoint(model, trial):
        limit = trainer.args.save_total_limit
        trainer.args.save_total_limit = None  # no rotation inside: it would run before the marker exists
        try:
            original(model, trial)
        finally:
            trainer.args.save_total_limit = limit
        run_dir = Path(trainer._get_output_dir(trial=trial))
        trainer.accelerator.wait_for_everyone()
        if trainer.args.should_save:
            write_marker(run_dir / f"checkpoint-{trainer.state.global_step}")
            rotate(run_dir, limit, keep=trainer.state.best_model_checkpoint)
        trainer.accelerator.wait_for_everyone()

    trainer._save_checkpoint = save_checkpoint


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


def expected_saved_names(model, hub: bool = True) -> set[str]:
    """Tensor names `save_model` must write for this (unwrapped) model: the adapter's for a PEFT model, otherwise
    every state-dict entry except the tied copies save_pretrained leaves out (e.g. lm_head tied to embed_tokens) — in
    the hub's layout save_pretrained converts to (hub=True: e.g. one tensor per MoE expert), or as held in memory
    (hub=False: what a sharded DCP save holds)."""
    from peft import PeftModel, get_peft_model_state_dict  # noqa: PLC0415

    from .export import StoredLayout, tied_copies  # noqa: PLC0415

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
    expected = expected_saved_names(unwrapped, hub=not sharded)
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
        add_resized_embeddings_under_zero3(trainer, out, expected)
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


def add_resized_embeddings_under_zero3(trainer, out: Path, expected: set[str]) -> None:
    """A LoRA run that added tokens trains their rows (peft trainable tokens) and peft saves the resized embedding
    and LM head beside the adapter, so the adapter loads into a base of the new size. Under ZeRO-3 those frozen,
    partitioned weights are absent from the consolidated state dict the Trainer hands peft, and the adapter comes out
    without them. Every rank gathers them here (a collective); rank 0 adds any the file lacks."""
    unwrapped = trainer.accelerator.unwrap_model(trainer.model)
    params = dict(unwrapped.named_parameters(remove_duplicate=False))  # a tied head is the embedding under a 2nd name
    names = sorted(n for n in expected if n.endswith(".token_adapter.base_layer.weight") and hasattr(params.get(n), "ds_id"))
    if not names:
        return
    import deepspeed  # noqa: PLC0415
    from safetensors.torch import load_file, save_file  # noqa: PLC0415

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
        log.info("save: added the resized %s to %s (ZeRO-3 left them out)", ", ".join(sorted(added)), path)


class TrainingStopped(RuntimeError):
    """The run stopped itself (non-finite loss or gradient norm); its message is one line."""


def nonfinite_guard(patience: int):
    """Callback: stop training when the logged loss or grad_norm is NaN/inf more than `patience` logs in a row. No
    checkpoint is written at a step whose log is non-finite, so the last good one stays the latest. Checked at each
    log (logging_steps). transformers replaces a NaN loss in the log by the running mean (logging_nan_inf_filter), so
    the gradient norm is what usually gives it away."""
    import math  # noqa: PLC0415

    from transformers import TrainerCallback  # noqa: PLC0415

    class NonFiniteGuard(TrainerCallback):
        stopped: str | None = None
        bad = 0

        def on_log(self, args, state, control, logs=None, **kwargs):
            values = {k: v for k, v in (logs or {}).items() if k in ("loss", "grad_norm") and isinstance(v, (int, float))}
            broken = {k: v for k, v in values.items() if not math.isfinite(v)}
            if not values:
                return
            self.bad = self.bad + 1 if broken else 0
            if broken:
                control.should_save = False  # never checkpoint a broken state, patience or not
            if broken and self.bad > patience:
                key = "loss" if "loss" in broken else "grad_norm"
                self.stopped = f"{key} is {broken[key]} at step {state.global_step} ({self.bad} log(s) in a row, nan_patience {patience})"
                control.should_training_stop = True

    return NonFiniteGuard()

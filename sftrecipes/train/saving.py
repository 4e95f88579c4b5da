"""How a live trainer writes its checkpoints: each one marked complete (its marker carrying the run record resuming
checks) only once every rank wrote it, rotated after that, a failed torch write raised as one line naming the file."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import torch

from sftrecipes.run.checkpoints import SaveFailed, rotate, write_failure, write_marker


def run_record(trainer) -> dict:
    """What resuming this run's checkpoints depends on: processes (and their sequence-parallel groups), batch per
    device, accumulation, their product over the data-parallel ranks (the global batch), the samples seen, and the
    checkpoint format (backend; ZeRO stage; FSDP version, state-dict type)."""
    args, state = trainer.args, trainer.accelerator.state
    rec = {"world_size": args.world_size, "per_device_train_batch_size": args.per_device_train_batch_size,
           "gradient_accumulation_steps": args.gradient_accumulation_steps}
    pc = getattr(trainer.accelerator, "parallelism_config", None)
    sp = int(pc.sp_size) if pc is not None and pc.sp_enabled else 1  # a group of sp ranks trains one batch at a time
    if sp > 1:
        rec["sequence_parallel_size"] = sp
    rec["global_batch"] = rec["world_size"] // sp * rec["per_device_train_batch_size"] * rec["gradient_accumulation_steps"]
    rec["samples_seen"] = trainer.state.global_step * rec["global_batch"]
    ds, fsdp = getattr(state, "deepspeed_plugin", None), getattr(state, "fsdp_plugin", None)
    if ds is not None:
        rec.update(backend="deepspeed", zero_stage=int(ds.zero_stage))
    elif fsdp is not None:
        kind = fsdp.state_dict_type
        rec.update(backend="fsdp", fsdp_version=int(fsdp.fsdp_version), fsdp_state_dict_type=getattr(kind, "name", str(kind)))
    else:
        rec["backend"] = "ddp" if args.world_size > 1 else "none"
    return rec


def make_checkpoints_atomic(trainer, also=None) -> None:
    """Every checkpoint gets its marker only after all ranks wrote their files; rotation happens after that and by
    checkpoints.rotate's rule (transformers rotates before anything marks a checkpoint complete). also(folder): what
    the main process writes into each checkpoint before its marker (a streamed run's position: stream.py)."""
    original = trainer._save_checkpoint

    def save_checkpoint(model, trial):
        limit = trainer.args.save_total_limit
        trainer.args.save_total_limit = None  # no rotation inside: it would run before the marker exists
        run_dir = Path(trainer._get_output_dir(trial=trial))
        try:
            with named_write_errors(run_dir / f"checkpoint-{trainer.state.global_step}"):  # "no space left", not iostream
                original(model, trial)
        finally:
            trainer.args.save_total_limit = limit
        trainer.accelerator.wait_for_everyone()
        if trainer.args.should_save:
            if also is not None:
                also(run_dir / f"checkpoint-{trainer.state.global_step}")
            write_marker(run_dir / f"checkpoint-{trainer.state.global_step}", run_record(trainer))
            rotate(run_dir, limit, keep=trainer.state.best_model_checkpoint)
        trainer.accelerator.wait_for_everyone()

    trainer._save_checkpoint = save_checkpoint


@contextlib.contextmanager
def named_write_errors(folder: Path):
    """Inside, torch.save to a path writes through a Python file, so a full disk raises OSError ENOSPC naming the file
    (given a path, torch's C++ writer says only "[enforce fail at inline_container.cc] unexpected pos" or
    "basic_ios::clear: iostream error"). A write failure leaves as SaveFailed: one line naming the file, the cause,
    the space free and, when known, the space needed; other exceptions pass unchanged."""
    real = torch.save

    def save(obj, f, *args, **kwargs):
        if not isinstance(f, (str, os.PathLike)):
            return real(obj, f, *args, **kwargs)
        try:
            with open(f, "wb") as fh:
                return real(obj, fh, *args, **kwargs)
        except OSError as e:
            e.filename = e.filename or os.fspath(f)
            raise

    torch.save = save
    try:
        yield
    except Exception as e:  # noqa: BLE001 - only write failures are translated, the rest is raised as it was
        why = write_failure(e, Path(folder))
        if why is None:
            raise
        raise SaveFailed(why) from e
    finally:
        torch.save = real

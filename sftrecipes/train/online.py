"""An online trainer's (GRPOTrainer, RLOOTrainer) own state across a checkpoint: the completions each rank generated
and still trains on (its generation buffer) and its micro-step count, saved per rank into every checkpoint and read
back on resume, so a checkpoint inside a generation cycle (steps_per_generation above gradient_accumulation_steps, or
num_iterations > 1) resumes on the same completions instead of generating new ones from the newer policy. (The random
state generation samples with is the checkpoint's rng_state, which transformers saves and restores.)"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

log = logging.getLogger("sftrecipes")

STATE = "online_state-rank{rank}.pt"


def _path(folder, trainer) -> Path:
    return Path(folder) / STATE.format(rank=trainer.args.process_index)


def save_generation_state(trainer) -> None:
    """Wrap the trainer's checkpoint save (before saving.make_checkpoints_atomic wraps it again, so the file is in the
    checkpoint before its marker): each rank writes its buffer and micro-step count."""
    original = trainer._save_checkpoint

    def save_checkpoint(model, trial):
        original(model, trial)
        folder = Path(trainer._get_output_dir(trial=trial)) / f"checkpoint-{trainer.state.global_step}"
        torch.save({"step": trainer._step, "buffer": trainer._buffered_inputs}, _path(folder, trainer))

    trainer._save_checkpoint = save_checkpoint


def _to(value, device):
    """The buffer's tensors on the rank's device (lists and dicts of them, other values as they are)."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, dict):
        return {k: _to(v, device) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_to(v, device) for v in value)
    return value


def restore_generation_state(trainer, checkpoint: str | None) -> None:
    """On resume: the micro-step count and the buffer this rank had when the checkpoint was written (a checkpoint
    without the file, written before this existed, resumes by generating anew, as TRL does)."""
    if not checkpoint:
        return
    path = _path(checkpoint, trainer)
    if not path.is_file():
        log.warning("resume: %s has no %s: the generation cycle restarts at the checkpoint (new completions)",
                    checkpoint, path.name)
        return
    state = torch.load(path, map_location="cpu", weights_only=False)  # ("cpu:0", DeepSpeed's CPU device, no location)
    trainer._step, trainer._buffered_inputs = state["step"], _to(state["buffer"], trainer.accelerator.device)
    every = trainer.args.steps_per_generation * trainer.num_iterations
    if trainer.args.process_index == 0:
        log.info("resume: the generation cycle at micro-step %d of %d (%s)", state["step"] % every, every,
                 "its completions restored" if state["step"] % every else "the next step generates")

"""How a training run follows its stream (stream.py): the counts logged per logging window, the RNG states restored
again on resume, run_summary.json's data entry, and the stream's end: a row it could not read stops training after the
last whole step it read, with a complete checkpoint of the steps trained, and ends every rank with one line (exit 2).
"""

from __future__ import annotations

import copy
import logging
from pathlib import Path

from transformers import TrainerCallback

from sftrecipes.core.errors import RecipeError
from sftrecipes.data.chat import describe_not_rendered, template_key
from sftrecipes.data.stream import Stream, empty_counts
from sftrecipes.run.checkpoints import is_complete

log = logging.getLogger("sftrecipes")


class DataStopped(RecipeError):
    """Every rank stops: the stream could not read on (a row it cannot parse); the steps trained are in a complete
    checkpoint (exit 2; train.py leaves the process group first)."""

    every_rank = True


def _minus(a: dict, b: dict) -> dict:
    return {k: _minus(v, b.get(k, {})) if isinstance(v, dict) else v - b.get(k, 0) for k, v in a.items()}


class StreamCallback(TrainerCallback):
    """Logs the stream's counts per logging window (rank 0): the rows trained on, what was prepared since the last
    log. On a resumed run, restores the checkpoint's RNG states again just before the first step: the trainer restores
    them before it starts its loader, whose start draws a seed from torch's generator, while the uninterrupted run
    drew it at its own start long before; without this, dropout after a resume draws other masks. (A prepared split's
    resume restores them after its skip for the same reason.) `trainer`: set once the trainer exists.

    The stream has no end but the one `rows` gives it when it cannot read on: an epoch of the trainer's that ends
    before max_steps and before anything else stopped training is that end, reached at the same step on every rank
    (their loaders run dry together): the steps trained this run are saved (unless this step just was) and training
    stops (`ran_out`; stop_if_unreadable then ends the run)."""

    def __init__(self, stream: Stream):
        self.stream, self.last, self.trained = stream, empty_counts(), 0
        self.trainer = None
        self.rng_pending = stream.resumed_from is not None
        self.ran_out, self.first_step, self.saved_step, self.stopping = False, 0, -1, False

    def on_step_begin(self, args, state, control, **kwargs):
        if self.rng_pending:
            self.rng_pending = False
            self.trainer._load_rng_state(self.stream.resumed_from)  # (transformers' own reader of its rng_state files)

    def on_train_begin(self, args, state, control, **kwargs):
        self.last = copy.deepcopy(self.stream.start.counts)  # a resumed stream's counts go on from its checkpoint's
        self.trained = self.stream.start.sequences
        self.first_step = state.global_step

    def on_step_end(self, args, state, control, **kwargs):
        self.stopping = control.should_training_stop  # max_steps, a preemption, a non-finite loss (callbacks before)

    def on_save(self, args, state, control, **kwargs):
        self.saved_step = state.global_step

    def on_epoch_end(self, args, state, control, **kwargs):
        if self.stopping or state.global_step >= state.max_steps:
            return  # stopped at a step's end: not the stream's end
        self.ran_out = control.should_training_stop = True
        control.should_save = self.first_step < state.global_step != self.saved_step

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs or "loss" not in logs:
            return
        now, trained = copy.deepcopy(self.stream.counts), self.stream.consumed(state.global_step, args)
        try:
            epoch = self.stream.position(trained).epoch
        except RuntimeError:  # (the history always covers it; the log line is no place to fail a run)
            epoch = self.stream.epoch
        delta = _minus(now, self.last)
        log.info("data: stream at step %d: %d rows trained on since the last log (%d in all, data epoch %d); prepared "
                 "since the last log: %s", state.global_step, trained - self.trained, trained, epoch,
                 describe_counts(delta, self.stream) if delta["read"] else "none (the buffer read before holds them)")
        self.last, self.trained = now, trained


def stop_if_unreadable(callback: StreamCallback, trainer) -> None:
    """After training: the stream ran out (a row it could not parse) before max_steps: every rank raises DataStopped
    with the line naming the row (rank 0's, which read the stream) and the checkpoint of the steps trained."""
    stream, step = callback.stream, trainer.state.global_step
    if not callback.ran_out:
        if stream.failure is not None:  # read ahead past what max_steps needed
            log.warning("data: the stream could not read past the rows training needed: %s", stream.failure)
        return
    line = [str(stream.failure) if stream.failure else f"dataset_name: the stream of {stream.src.path} ended before max_steps"]
    if trainer.args.world_size > 1:
        import torch.distributed as dist

        dist.broadcast_object_list(line, src=0)  # (under dispatch_batches only rank 0 reads the stream)
    ckpt = Path(trainer.args.output_dir) / f"checkpoint-{step}"
    if step == callback.first_step:
        done = f"no step was trained in this run (it stopped at step {step})"
    elif is_complete(ckpt):
        done = f"training stopped after step {step}: {ckpt} is complete"
    else:
        done = f"training stopped after step {step}, but {ckpt} is not complete"
    raise DataStopped(f"{line[0]}; {done}; once the data is fixed, resume with resume_from_checkpoint: auto")


def describe_counts(c: dict, stream: Stream) -> str:
    files = c.get("files") or {}
    origin = f" ({', '.join(f'{n} from {label}' for label, n in files.items())})" if len(files) > 1 else ""
    line = (f"{c['read']} rows read{origin}, {c['truncated']} truncated at max_length {stream.max_length}, "
            f"{c['dropped_after_cut']} dropped after the cut, {c['fully_masked']} fully masked (dropped), {c['kept']} kept")
    if stream.packing:
        line += f", packed into {c['packed_rows']} rows ({stream.packing})"
        if stream.packing == "wrapped":
            line += f", {c['fully_masked_packed_rows']} of them fully masked"
    return line + describe_not_rendered(c["not_rendered"], template_key(stream.recipe))


def summary_counts(stream: Stream, counts: dict) -> dict:
    """run_summary.json's data entry of a streamed run: the train counts of every buffer prepared (a little ahead of
    training), the stream's preparation time and rate, the data epoch reached."""
    c = stream.counts
    return {**counts, "train": {**c, "formats": {stream.fmt: c["read"]}, "max_length": stream.max_length,
                                "truncation_mode": stream.recipe.trl_value("truncation_mode"), "streamed": True},
            "preparation": {"how": "streamed", "seconds": round(stream.seconds, 3), "rows": c["read"],
                            "rows_per_s": round(c["read"] / stream.seconds, 1) if stream.seconds else None,
                            "data_epoch": stream.epoch, "buffer_rows": stream.buffer_rows}}

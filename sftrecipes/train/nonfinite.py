"""The guard that stops training when the loss or gradient norm turns NaN/inf, before a broken state is saved, with
advice on where to look (base weights, data and load dtype, or the learning rate)."""

from __future__ import annotations

import math
import re

import torch
import torch.distributed as dist
from transformers import TrainerCallback


def nonfinite_guard(patience: int):
    """Callback: stop training when the logged loss or grad_norm is NaN/inf more than `patience` logs in a row. No
    checkpoint is written at a step whose log is non-finite, so the last good one stays the latest. Checked at each
    log (logging_steps). transformers replaces a NaN loss in the log by the running mean (logging_nan_inf_filter), so
    the gradient norm is what usually gives it away.

    `advice` says where to look. The weights are scanned once before the first update (nonfinite_tensors): a NaN/inf
    there means broken base weights, named. Non-finite from the very first log with finite weights points at the data
    or the load dtype (at step 1 no learning rate has acted yet); after finite logs, at the learning rate or the data."""
    class NonFiniteGuard(TrainerCallback):
        stopped: str | None = None
        advice = "lower learning_rate or check the data, then resume_from_checkpoint: auto"
        bad = 0
        finite_logs = 0
        broken_weights: list[str] = []
        weights_from = "the model"

        def on_train_begin(self, args, state, control, model=None, **kwargs):
            if model is not None:
                self.broken_weights = nonfinite_tensors(model)
                self.weights_from = getattr(getattr(model, "config", None), "_name_or_path", None) or "the model"

        def on_log(self, args, state, control, logs=None, **kwargs):
            values = {k: v for k, v in (logs or {}).items() if k in ("loss", "grad_norm") and isinstance(v, (int, float))}
            broken = {k: v for k, v in values.items() if not math.isfinite(v)}
            if not values:
                return
            self.bad = self.bad + 1 if broken else 0
            self.finite_logs += not broken
            if broken:
                control.should_save = False  # never checkpoint a broken state, patience or not
            if broken and self.bad > patience:
                key = "loss" if "loss" in broken else "grad_norm"
                self.stopped = f"{key} is {broken[key]} at step {state.global_step} ({self.bad} log(s) in a row, nan_patience {patience})"
                self.advice = self._advice(state.global_step, args.logging_steps)
                control.should_training_stop = True

        def _advice(self, step: int, logging_steps) -> str:
            if self.broken_weights:
                more = f" and {len(self.broken_weights) - 1} more" if len(self.broken_weights) > 1 else ""
                return (f"the weights held NaN/inf before the first update ({self.broken_weights[0]}{more}): the base "
                        f"weights in {self.weights_from} are broken; replace them (or load them in a wider dtype), then start again")
            if self.finite_logs == 0 and step <= 1:
                return ("it was non-finite at step 1, before any update, with finite weights: the learning rate is not the "
                        "cause; check the data (an empty or fully masked batch) and the load dtype (fp16 overflows), then start again")
            if self.finite_logs == 0:
                return (f"it was non-finite from the first log (steps 1-{step}) with finite weights; set logging_steps: 1 to "
                        "see whether it starts before any update (then check the data and the load dtype) or after (then "
                        "lower learning_rate)")
            return "lower learning_rate or check the data, then resume_from_checkpoint: auto"

    return NonFiniteGuard()


def nonfinite_tensors(model, limit: int = 4) -> list[str]:
    """Names (as in the base model) of up to `limit` floating-point parameters or buffers holding NaN/inf, over every
    rank: each rank scans what it holds (ZeRO-3 partitions, FSDP2 local shards), then the names are gathered. Every
    rank must call it (a collective when a process group exists)."""
    found: list[str] = []
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        local = getattr(t, "ds_tensor", None)
        if local is None:
            local = t.to_local() if hasattr(t, "to_local") else t
        if local.is_floating_point() and local.numel() and not bool(torch.isfinite(local).all()):
            found.append(re.sub(r"\.base_layer(?=\.|$)", "", name.removeprefix("base_model.model.")))
            if len(found) >= limit:
                break
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        every: list = [None] * dist.get_world_size()
        dist.all_gather_object(every, found)
        found = list(dict.fromkeys(n for names in every for n in names))[:limit]
    return found

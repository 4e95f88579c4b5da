"""Activation offloading (TRL's `activation_offloading`) in the plan: what it moves from each GPU to its host's pinned
memory, per rank, and what the GPU still holds of the activations.

TRL 1.16 (trl/models/activation_offloading.py) runs each training step under saved_tensors_hooks: every tensor autograd
saves in the forward that is on the GPU, at least 1024 bytes and not a parameter is copied to pinned host memory (on a
side stream) and brought back when its backward node runs. The GPU keeps the last 5 saved tensors while their copies
are in flight (max_fwd_stash_size), a storage saved a second time (RoPE's cos/sin, a residual read by two modules) on
the GPU, and in backward the tensors of the node being run and of the one before. TRL's fused LM head multiplies by
lm_head.weight itself, so the hook that keeps the head's tensors on the GPU never fires; the head's tensors, saved
last, are the ones in flight when backward begins. Planned so:

- moved to host, per rank: every decoder layer's saved tensors (activations.Activations.saved_all: with gradient
  checkpointing each layer's input only), pinned (the host allocator caches the blocks from one step to the next);
- kept on the GPU: at the start of backward the larger of the forward stash (checkpointing: 5 layer inputs) and one
  layer's saved tensors brought back, the shared tensors (RoPE cos/sin, ids, labels, a mask: stored once, saved by
  every layer) and the LM head's; in a layer's backward that layer's tensors.

The host figure is held against a real step on a GPU only (CPU targets refuse the key: there is no GPU to offload
from): bench/offload_probe.py, run by bench/gpu_check.sh, measures the pinned allocator's peak and the GPU's peak with
and without offloading (docs/planner.md).
"""

from __future__ import annotations

import dataclasses

from sftrecipes.plan.activations import Activations
from sftrecipes.recipe.typed import Recipe

STASH = 5  # TRL's max_fwd_stash_size: saved tensors kept on the GPU while their copies to host are in flight


def apply(recipe: Recipe, act: Activations, checkpointed: bool) -> tuple[Activations, float]:
    """(the activations as the GPU holds them, bytes per rank moved to pinned host memory); unchanged and 0 without
    activation_offloading."""
    if not recipe.trl_value("activation_offloading"):
        return act, 0.0
    layers = len(act.per_layer)
    if checkpointed:  # each layer saves its input (saved_first): the stash holds the last STASH of them
        on_gpu = min(STASH, layers) * act.saved_first
    else:  # the last layer's latest tensors in flight, then each layer's brought back for its backward
        on_gpu = max(act.per_layer)
    return dataclasses.replace(act, saved_all=min(on_gpu, act.saved_all)), act.saved_all


def note(moved: float, gpn: int, gb: float) -> str:
    """The plan's line for an offloading run."""
    return (f"activation_offloading: the decoder layers' saved tensors ({moved / gb:.2f} GB per rank, {gpn * moved / gb:.2f} "
            f"GB per node) move to pinned host memory in forward and come back layer by layer in backward; a GPU keeps "
            f"the {STASH} latest in flight, the LM head's and the shared ones (bench/offload_probe.py measures both on a GPU)")

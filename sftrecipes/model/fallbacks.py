"""What a run goes without where its model class cannot have it, decided in every rank alike and said in one warning
line: packed batches (packing_fallback: a kernel that cannot keep samples apart here), activation checkpointing
(checkpointing_fallback: recipe/target.checkpointing_off, which the plan reads too), and a load-balancing loss for a
model without experts (no_aux_loss_without_experts)."""

from __future__ import annotations

import logging
from types import SimpleNamespace

from sftrecipes.model import meta
from sftrecipes.recipe.target import checkpointing_off, packed
from sftrecipes.recipe.typed import Recipe

log = logging.getLogger("sftrecipes")


def packing_fallback(recipe: Recipe) -> str | None:
    """Packed batches where the model's kernels cannot keep samples apart on this machine (meta.packing_blocker reads
    the model class's own modeling module): the run pads its rows instead, as use_flash_attn falls back where the
    kernel is missing. Turns packing and padding_free off in the recipe, before the training arguments and the data
    are built from it, on every rank alike; returns the warning line, or None where the batches stay packed."""
    built = meta.recipe_model(recipe) if packed(recipe) else None
    why = meta.packing_blocker(recipe, type(built[1])) if built is not None else None
    if why is None:
        return None
    keys = [k for k in ("packing", "padding_free") if recipe.trl_value(k)]
    for k in keys:
        recipe.trl[k] = False
    return (f"WARNING {' and '.join(keys)}: off for this run, rows are padded instead: {why}; install the package "
            f"(GPU) to pack, or set {' and '.join(f'{k}: false' for k in keys)} to silence this")


def checkpointing_fallback(recipe: Recipe) -> str | None:
    """Activation checkpointing asked for where the run cannot have it (target.checkpointing_off): a model class that
    does not support it (GPT-1, CTRL, XLNet, JetMoE: supports_gradient_checkpointing False; the trainer would raise
    after loading), or a submodule run several times a forward under ZeRO-3 (HRM; DeepSpeed's first backward would
    fail). The run goes without, as packing falls back, on every rank alike; the plan counts it so. Returns the
    warning line, or None."""
    built = meta.recipe_model(recipe) if recipe.gradient_checkpointing else None
    if built is None:
        return None
    cfg, model = built
    why = checkpointing_off(recipe, SimpleNamespace(model_type=cfg.model_type, reruns=meta.reruns(model),
                                                    checkpoints=bool(model.supports_gradient_checkpointing)))
    if not why:
        return None
    recipe.trl["gradient_checkpointing"] = False  # (TRL's default is on)
    if "activation_checkpointing" in recipe.trl:
        recipe.trl["activation_checkpointing"] = False
    return (f"WARNING gradient_checkpointing: off for this run: {why} (every layer's activations are kept); set "
            "gradient_checkpointing: false to silence this")


def no_aux_loss_without_experts(model, args) -> None:
    """A config that declares output_router_logits for a model with no experts (Doge with is_moe: false: no fused
    expert tensors, no module named for experts or MoE): TRL 1.16 turns its load-balancing loss on from the config
    alone and fails in the first step over no router logits. Unless the recipe sets router_aux_loss_coef, it is 0 for
    such a model (logged)."""
    from sftrecipes.model.lora import moe_layout

    text = model.config.get_text_config()
    moe_named = any(w in type(m).__name__.lower() for m in model.modules() for w in ("moe", "expert"))  # per-expert lists too
    if (getattr(args, "router_aux_loss_coef", 0) is None and hasattr(text, "output_router_logits") and not moe_named
            and moe_layout(model) == ({}, {})):
        args.router_aux_loss_coef = 0.0
        log.info("model: %s holds no experts: no load-balancing loss (router_aux_loss_coef 0)", type(model).__name__)

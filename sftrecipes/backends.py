"""Recipe -> TRL/transformers training arguments, and the hardware target.

The hardware target is the one place that knows what a machine without a GPU needs: `use_cpu` (so a GPU
command line with `--bf16 True` runs instead of failing with "Your setup doesn't support bf16/gpu"), the
gloo process-group backend, DeepSpeed's CPU accelerator and one thread per rank.
"""

from __future__ import annotations

import logging
import os

from .recipe import Recipe, RecipeError

log = logging.getLogger("sftrecipes")

# Keys the data pipeline (data.py) applies itself; TRL would refuse them on pre-tokenized data.
CONSUMED_BY_PIPELINE = ("assistant_only_loss", "completion_only_loss")


def hardware(recipe: Recipe) -> str:
    """'cpu' or 'gpu'. `launch.hardware: auto` asks torch (the only import of torch this needs)."""
    if recipe.launch.hardware != "auto":
        return recipe.launch.hardware
    import torch  # noqa: PLC0415

    return "gpu" if torch.cuda.is_available() else "cpu"


def cpu_env(recipe: Recipe) -> dict[str, str]:
    """Environment a CPU rank needs; launchers export the same values."""
    threads = str(recipe.launch.cpu_threads)
    return {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}


def apply_process_env(recipe: Recipe, target: str) -> None:
    """Set this process up for the target (environment a launcher did not set, torch threads)."""
    if target != "cpu":
        return
    for k, v in cpu_env(recipe).items():
        os.environ.setdefault(k, v)
    import torch  # noqa: PLC0415

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def check_world_size(recipe: Recipe) -> int:
    """The processes this run really has must be the ones the recipe's launch section describes."""
    want = recipe.launch.num_machines * recipe.launch.gpus_per_node
    have = int(os.environ.get("WORLD_SIZE", "1"))
    if have != want:
        raise RecipeError(
            f"launch: the recipe describes {want} processes (num_machines {recipe.launch.num_machines} x gpus_per_node "
            f"{recipe.launch.gpus_per_node}) but this run has {have}; start it with its launcher, or set --launch.gpus_per_node"
        )
    return have


def training_kwargs(recipe: Recipe, target: str) -> dict:
    """The SFTConfig keyword arguments: the recipe's explicit TRL keys plus what the project derives."""
    kw = {k: v for k, v in recipe.trl.items() if k not in CONSUMED_BY_PIPELINE}
    # transformers 5 renamed gradient_checkpointing* to activation_checkpointing*; pass the new names only.
    kw.pop("gradient_checkpointing", None)
    kw["activation_checkpointing"] = recipe.gradient_checkpointing
    ckpt_kwargs = {**(kw.pop("gradient_checkpointing_kwargs", None) or {}), **(kw.get("activation_checkpointing_kwargs") or {})}
    if recipe.gradient_checkpointing:
        ckpt_kwargs["use_reentrant"] = recipe.model.use_reentrant
    if ckpt_kwargs:
        kw["activation_checkpointing_kwargs"] = ckpt_kwargs
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1 and kw.pop("ddp_backend", None):
        log.info("ddp_backend: unused in a single process (no process group); ignoring it for this run")
    if target == "cpu":
        kw["use_cpu"] = True
        if world > 1:
            if kw.get("ddp_backend", "gloo") != "gloo":
                log.warning("ddp_backend: %s needs GPUs; the cpu target uses gloo", kw["ddp_backend"])
            kw["ddp_backend"] = "gloo"
        if kw.get("fp16"):
            log.warning("fp16: CPU autocast has no fp16 loss scaling; running fp16 mixed precision as bf16 on the cpu target")
            kw["fp16"], kw["bf16"] = False, True
        if kw.pop("tf32", None):
            log.warning("tf32: a GPU (Ampere+) matmul mode; it does not apply on the cpu target")
    return kw


def training_args(recipe: Recipe, target: str):
    from trl import SFTConfig  # noqa: PLC0415

    try:
        return SFTConfig(**training_kwargs(recipe, target))
    except ValueError as e:  # transformers' own cross-checks (e.g. load_best_model_at_end without matching strategies)
        raise RecipeError("training arguments: " + " ".join(str(e).split())) from None

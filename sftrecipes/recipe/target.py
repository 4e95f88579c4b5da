"""Where and how a recipe runs, torch-free: its hardware target's needs, which ranks read the weights, the dtypes
it loads and computes in, and whether activation checkpointing runs.

The hardware target is the one place that knows what a machine without a GPU needs: `use_cpu` (so a GPU command line
with `--bf16 True` runs instead of failing with "Your setup doesn't support bf16/gpu"), the gloo process-group backend,
DeepSpeed's CPU accelerator and the threads of each rank (cpu_threads); `launch.hardware: auto` is resolved in the rank
(train/devices.py asks torch), an emitted config is rendered for `render_target`. The planner (plan/), the launcher
(launch/) and the ranks (model/, train/) read these same rules, so a plan never states what the run does not do.
"""

from __future__ import annotations

import os

from sftrecipes.recipe.typed import Recipe


def render_target(recipe: Recipe) -> str:
    """The hardware an emitted config is for: the recipe's, with 'auto' meaning the GPU cluster it names."""
    return "cpu" if recipe.launch.hardware == "cpu" else "gpu"


def cpu_env(recipe: Recipe) -> dict[str, str]:
    """Environment a CPU rank needs; launchers export the same values. Threads only when launch.cpu_threads pins them
    (else each process counts its cores: cpu_threads)."""
    env = {"DS_ACCELERATOR": "cpu"}
    if recipe.launch.cpu_threads:
        env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(recipe.launch.cpu_threads)
    return env


def cpu_threads(recipe: Recipe) -> tuple[int, str]:
    """(torch threads for this process on the cpu target, why): launch.cpu_threads, else the cores this process may
    use (its affinity) divided by the processes on its node (LOCAL_WORLD_SIZE, which torch's agent sets), at least 1."""
    if recipe.launch.cpu_threads:
        return recipe.launch.cpu_threads, "launch.cpu_threads"
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    local = int(os.environ.get("LOCAL_WORLD_SIZE") or 1)
    return max(1, cores // local), f"{cores} usable core(s) / {local} process(es) on this node; launch.cpu_threads pins it"


RANK0_READS, PARTITIONED, EVERY_RANK = "rank0_reads", "partitioned", "every_rank"


def sharded_4bit(recipe: Recipe) -> bool:
    """4-bit weights FSDP2 shards: a floating quant storage (accelerate leaves uint8 Params4bit out of FSDP2's
    sharding, whole on every rank)."""
    m = recipe.model
    return bool(m.use_4bit_quantization) and m.bnb_4bit_quant_storage_dtype != "uint8"


def weight_reading(recipe: Recipe, quantized: bool) -> tuple[str, str]:
    """How the ranks get their weights when the model loads — the one rule model.load_model follows and the planner
    states, so the plan never claims a loading the loader does not do. (mode, why):
    RANK0_READS: FSDP2 with fsdp_cpu_ram_efficient_loading: rank 0 reads the checkpoint, the others build on the
    meta device; 16-bit weights: they receive their shards when FSDP wraps (model/load.ram_efficient_rank); 4-bit weights
    FSDP2 shards (sharded_4bit): each layer once quantized, keeping their rows (quantload.send_4bit_layers);
    PARTITIONED: ZeRO-3 with zero3_init: every rank reads, keeping only its partition of each tensor (16-bit:
    transformers' zero.Init; 4-bit: each decoder layer partitioned once quantized, quantload.partition_4bit_layers);
    EVERY_RANK: every rank loads the whole model (quantized models under FSDP: accelerate leaves them out of
    RAM-efficient loading)."""
    L = recipe.launch
    if L.backend == "fsdp" and L.fsdp_cpu_ram_efficient_loading and L.fsdp_version == 2:
        if not quantized:
            return RANK0_READS, "fsdp_cpu_ram_efficient_loading: only rank 0 reads the weights"
        if sharded_4bit(recipe):
            return RANK0_READS, ("fsdp_cpu_ram_efficient_loading: only rank 0 reads and quantizes the weights, sending "
                                 "each decoder layer to the other ranks once quantized; each rank keeps its FSDP2 rows "
                                 "of the layer's 4-bit weights")
    if L.backend == "deepspeed" and L.zero_stage == 3 and L.zero3_init:
        if quantized:
            return PARTITIONED, ("zero3_init: each rank quantizes the weights layer by layer and keeps its partition of "
                                 "each layer once quantized")
        return PARTITIONED, "zero3_init: each rank keeps its partition as the shards stream in"
    if quantized and L.backend == "deepspeed" and L.zero_stage == 3:
        return EVERY_RANK, "quantized, zero3_init off: every rank loads the whole model"
    if quantized and L.backend == "fsdp":
        return EVERY_RANK, "quantized: every rank loads the whole model (RAM-efficient loading of 4-bit weights is FSDP2's, with a floating quant storage)"
    if L.backend == "fsdp" and L.fsdp_cpu_ram_efficient_loading:
        return EVERY_RANK, "FSDP1: every rank loads the whole model (RAM-efficient loading is FSDP2's)"
    return EVERY_RANK, "every rank loads the whole model"


def load_dtype(recipe: Recipe) -> str:
    """The dtype the weights are loaded in (see ModelOptions.dtype): 'float32', 'bfloat16' or 'float16'; model.load
    maps it to torch, the planner to bytes (facts/shape.DTYPE_BYTES).

    auto: the 4-bit storage dtype when it is a float; bf16/fp16 (whichever mixed precision is on) for LoRA, QLoRA,
    8-bit and precision memory_constrained; otherwise float32 (full fine-tuning keeps its trainable weights fp32)."""
    m = recipe.model
    if m.dtype != "auto":
        return m.dtype
    if m.use_4bit_quantization and m.bnb_4bit_quant_storage_dtype != "uint8":
        return m.bnb_4bit_quant_storage_dtype
    if m.use_peft_lora or m.use_4bit_quantization or m.use_8bit_quantization or m.precision == "memory_constrained":
        return mixed_dtype(recipe) or "float32"
    return "float32"


def mixed_dtype(recipe: Recipe) -> str | None:
    """The mixed-precision compute dtype: 'bfloat16' (bf16: true), 'float16' (fp16: true) or None (neither)."""
    return "bfloat16" if recipe.trl_value("bf16") else "float16" if recipe.trl_value("fp16") else None


def packed(recipe: Recipe) -> bool:
    """Whether batches reach the model as packed rows (TRL's padding-free packing)."""
    return bool(recipe.trl_value("packing") or recipe.trl_value("padding_free"))


def requested_attention(recipe: Recipe) -> str:
    """The recipe's attention request: attn_implementation, with the PEFT guide's use_flash_attn as an alias of
    flash_attention_2 (recipe validation refuses the two disagreeing)."""
    m = recipe.model
    return "flash_attention_2" if flash_alias(recipe) else m.attn_implementation


def flash_alias(recipe: Recipe) -> bool:
    """flash_attention_2 is asked for by use_flash_attn (the guide's switch), not by attn_implementation."""
    return recipe.model.use_flash_attn and recipe.model.attn_implementation == "auto"


def checkpointing_off(recipe: Recipe, shape) -> str:
    """Why a run that asks for activation checkpointing goes without it, in words, or "" (it runs checkpointed, or
    never asked): a model class without support, or a submodule run several times a forward under ZeRO-3, whose
    gradient buckets then take those parameters' gradients twice in one step with checkpointing on (DeepSpeed#4505;
    an AssertionError in the first backward). `shape`: a facts/shape.Shape, or what the rank read from the model class
    (model_type, checkpoints, reruns). The run (model/fallbacks.checkpointing_fallback) and the plan read this alike."""
    if not recipe.gradient_checkpointing:
        return ""
    if not shape.checkpoints:
        return f"the {shape.model_type} model class does not support activation checkpointing"
    if shape.reruns and recipe.launch.backend == "deepspeed" and recipe.launch.zero_stage == 3:
        return (f"{shape.reruns}, and ZeRO-3's gradient buckets take such a module's gradients twice in a step with "
                "checkpointing on (DeepSpeed#4505)")
    return ""

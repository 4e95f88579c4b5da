"""The recipe as TRL/transformers training arguments in a rank (the method's SFTConfig, DPOConfig, ...): the process
set up for its hardware target first (environment, torch threads, the compatibility shims its backend needs), and
DeepSpeed's buckets sized by the model once the trainer exists.

Torch-free rules of where and how a recipe runs (CPU environment and threads, which ranks read the weights) are
recipe/target.py's; the accelerate config and the launcher's environment launch/accelerate.py's.
"""

from __future__ import annotations

import logging
import os

from sftrecipes.core.errors import RecipeError
from sftrecipes.recipe.limits import check_offloading
from sftrecipes.recipe.schema import CONFIGS, TRL_DEFAULTS
from sftrecipes.recipe.sources import CONSUMED_BY_PIPELINE
from sftrecipes.recipe.target import cpu_env, cpu_threads, load_dtype
from sftrecipes.recipe.typed import Recipe
from sftrecipes.train.options import trl_class

log = logging.getLogger("sftrecipes")


def computes_in_bf16(recipe: Recipe) -> bool:
    """Whether the run multiplies bf16 tensors: weights loaded in bf16, bf16 autocast, or QLoRA's bf16 compute dtype
    (only then does cpumath's mode, which sees every op of the process, pay for itself)."""
    m = recipe.model
    return (load_dtype(recipe) == "bfloat16" or bool(recipe.trl_value("bf16"))
            or (m.use_4bit_quantization and m.bnb_4bit_compute_dtype == "bfloat16"))


def apply_process_env(recipe: Recipe, target: str) -> None:
    """Set this process up for the target before any accelerate/transformers state exists: environment a launcher
    did not set, torch threads, and the compatibility shims the backend needs (compat.py)."""
    from sftrecipes.model import compat, cpumath

    compat.backbone_under_a_stale_prefix()
    compat.num_experts_for_trl()
    if recipe.launch.backend == "deepspeed" and recipe.launch.zero_stage == 3:
        compat.loaded_modules_skip_init_under_zero3()
        compat.split_sizes_from_full_shapes_under_zero3()
    if recipe.launch.backend == "fsdp":
        compat.fix_peft_prefixes_under_wrappers()
        compat.buffers_in_ram_efficient_fsdp2()
    if recipe.model.use_peft_lora:
        compat.trainable_token_heads_for_trl()
        compat.keep_dense_linears_in_moe_conversion()
    if target != "cpu":
        return
    for k, v in cpu_env(recipe).items():
        os.environ.setdefault(k, v)
    threads, why = cpu_threads(recipe)  # (over the OMP_NUM_THREADS=1 torch's agent gives ranks when none is set)
    os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = str(threads)
    import torch

    torch.set_num_threads(threads)
    how = cpumath.apply() if computes_in_bf16(recipe) else None  # where this CPU has no bf16 GEMM (~30x faster there)
    if os.environ.get("RANK", "0") == "0":
        log.info("cpu_threads: %d torch thread(s) per process (%s)", threads, why)
        if how:
            log.info("%s", cpumath.describe(how))
    if recipe.launch.backend == "fsdp":
        compat.enable_fsdp_on_cpu()
    if recipe.launch.backend == "deepspeed":
        compat.no_shm_comm_kernel_on_cpu()  # (after DS_ACCELERATOR=cpu is set: deepspeed reads it when imported)
    if recipe.launch.backend == "deepspeed" and recipe.launch.zero_stage == 3 and recipe.model.use_peft_lora:
        compat.trainable_tokens_init_under_zero3_on_cpu()


def training_kwargs(recipe: Recipe, target: str) -> dict:
    """The SFTConfig keyword arguments: the recipe's explicit TRL keys plus what the project derives (what the target
    cannot run, e.g. use_liger_kernel on a CPU, is refused before this by preflight.in_run)."""
    check_offloading(recipe, target)  # activation_offloading on a machine without a GPU (launch.hardware: auto)
    kw = {k: v for k, v in recipe.trl.items() if k not in CONSUMED_BY_PIPELINE}
    for key in TRL_DEFAULTS:  # the project's own defaults for a few TRL keys (schema.TRL_DEFAULTS)
        kw.setdefault(key, recipe.trl_value(key))
    # transformers 5 renamed gradient_checkpointing* to activation_checkpointing*; pass the new names only.
    for old_name in ("gradient_checkpointing", "gradient_checkpointing_kwargs"):
        kw.pop(old_name, None)
    kw["activation_checkpointing"] = recipe.gradient_checkpointing
    if recipe.checkpointing_kwargs:
        kw["activation_checkpointing_kwargs"] = recipe.checkpointing_kwargs
    if recipe.model.precision == "memory_constrained":  # train in the load dtype itself: no autocast, no fp32 copy
        kw["bf16"] = kw["fp16"] = False
    from sftrecipes.model.attnchoice import SDPA_PACKED_PAD, packed_under_sdpa_on_gpu

    if "pad_to_multiple_of" not in recipe.trl and packed_under_sdpa_on_gpu(recipe, target):
        kw["pad_to_multiple_of"] = SDPA_PACKED_PAD
        log.info("pad_to_multiple_of: %d (packing under sdpa on a GPU: a bounded set of batch shapes lets cuDNN reuse its "
                 "attention graphs; set pad_to_multiple_of to override)", SDPA_PACKED_PAD)
    if recipe.launch.sequence_parallel_size > 1 or recipe.launch.context_parallel_size > 1:
        from sftrecipes.model.attnchoice import choose_attention
        from sftrecipes.train import seqpar

        kw["parallelism_config"] = seqpar.parallelism_config(recipe, choose_attention(recipe, target)[0])
        if recipe.launch.sequence_parallel_size > 1:  # every batch's length divides by N (recipe/seqpar.py checked an
            kw["pad_to_multiple_of"] = seqpar.pad_multiple(recipe, kw.get("pad_to_multiple_of"))  # explicit one)
    if recipe.method == "sft" and recipe.data.streaming:  # stream.py: rows cut, masked and packed as they are read;
        kw["dataset_kwargs"] = {"skip_prepare_dataset": True}  # the collator still flattens bfd rows (packing stays on)
        kw["ignore_data_skip"] = True  # the stream starts at the checkpoint's position: no batches to skip (the RNG
        #                                states are restored all the same)
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
    """The method's TRL config (SFTConfig, DPOConfig, KTOConfig, ORPOConfig, CPOConfig: schema.CONFIGS) from the recipe."""

    kw = training_kwargs(recipe, target)
    if target == "cpu" and kw.get("ddp_backend") == "gloo":
        # transformers hands ddp_timeout to the process group it creates everywhere but on the CPU, where gloo would
        # wait torch's default 30 minutes: the group is made here first, bound as NCCL's is on GPUs; the arguments'
        # own PartialState then finds it made
        from datetime import timedelta

        from accelerate import PartialState

        PartialState(cpu=True, backend="gloo", timeout=timedelta(seconds=int(kw.get("ddp_timeout", 1800))))
    try:
        return trl_class(recipe.method, CONFIGS[recipe.method])(**kw)
    except RecipeError:  # the project's own refusals (a ValueError too) are already one line naming the key
        raise
    except ValueError as e:  # transformers' own cross-checks (e.g. load_best_model_at_end without matching strategies)
        raise RecipeError("training arguments: " + " ".join(str(e).split())) from None


# DeepSpeed sizes, by the model's hidden size h, as transformers and accelerate fill them from a config file's "auto"
DS_SIZED_BY_HIDDEN = ("reduce_bucket_size", "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold")


def size_deepspeed_buckets(trainer) -> None:
    """DeepSpeed's buckets sized by the model, as the planner counts them: reduce bucket h^2, and under ZeRO-3 prefetch
    bucket 0.9 h^2 and persistence threshold 10 h (transformers fills these "auto" values when train() initialises DeepSpeed).
    accelerate's config, unlike a DeepSpeed config file, leaves them out, so DeepSpeed's defaults applied: a 5e7-element
    prefetch bucket, which from the second step (once the trace is recorded) fetched ahead up to its 1e9 live
    parameters — all 255M parameters of the 253M twin gathered at once on each rank, where one layer is 16M — and a
    5e8-element reduce buffer (1 GB in bf16). Sized, the ZeRO-3 LoRA twin's first-steps peak fell by 0.11 GB per rank
    at 253M (docs/loading.md). A value the config already holds stays."""
    plugin = getattr(trainer.accelerator.state, "deepspeed_plugin", None)
    if plugin is None:
        return
    zero = plugin.hf_ds_config.config.setdefault("zero_optimization", {})
    for key in DS_SIZED_BY_HIDDEN if zero.get("stage") == 3 else DS_SIZED_BY_HIDDEN[:1]:
        zero.setdefault(key, "auto")

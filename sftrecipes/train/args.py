"""How a recipe runs on its processes: the hardware target and process environment, the recipe as TRL/transformers
training arguments (SFTConfig) and as an accelerate/DeepSpeed/FSDP config with the launcher's environment.

The hardware target is the one place that knows what a machine without a GPU needs: `use_cpu` (so a GPU
command line with `--bf16 True` runs instead of failing with "Your setup doesn't support bf16/gpu"), the
gloo process-group backend, DeepSpeed's CPU accelerator and the threads of each rank (cpu_threads).
"""

from __future__ import annotations

import logging
import os

from sftrecipes.core.errors import RecipeError
from sftrecipes.recipe.limits import check_offloading
from sftrecipes.recipe.load import Recipe
from sftrecipes.recipe.schema import CONFIGS, TRL_DEFAULTS
from sftrecipes.recipe.snapshots import trl_class  # imports trl when called: launch/emit import this module and stay torch-free
from sftrecipes.recipe.sources import CONSUMED_BY_PIPELINE

log = logging.getLogger("sftrecipes")

def hardware(recipe: Recipe) -> str:
    """'cpu' or 'gpu'. `launch.hardware: auto` asks torch (the only import of torch this needs)."""
    if recipe.launch.hardware != "auto":
        return recipe.launch.hardware
    import torch

    return "gpu" if torch.cuda.is_available() else "cpu"


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


def computes_in_bf16(recipe: Recipe) -> bool:
    """Whether the run multiplies bf16 tensors: weights loaded in bf16, bf16 autocast, or QLoRA's bf16 compute dtype
    (only then does cpumath's mode, which sees every op of the process, pay for itself)."""
    import torch

    from sftrecipes.model.load import load_dtype

    m = recipe.model
    return (load_dtype(recipe) == torch.bfloat16 or bool(recipe.trl_value("bf16"))
            or (m.use_4bit_quantization and m.bnb_4bit_compute_dtype == "bfloat16"))


def apply_process_env(recipe: Recipe, target: str) -> None:
    """Set this process up for the target before any accelerate/transformers state exists: environment a launcher
    did not set, torch threads, and the compatibility shims the backend needs (compat.py)."""
    from sftrecipes.model import compat
    from sftrecipes.model import cpumath

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
    from sftrecipes.model.load import SDPA_PACKED_PAD, packed_under_sdpa_on_gpu

    if "pad_to_multiple_of" not in recipe.trl and packed_under_sdpa_on_gpu(recipe, target):
        kw["pad_to_multiple_of"] = SDPA_PACKED_PAD
        log.info("pad_to_multiple_of: %d (packing under sdpa on a GPU: a bounded set of batch shapes lets cuDNN reuse its "
                 "attention graphs; set pad_to_multiple_of to override)", SDPA_PACKED_PAD)
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


def render_target(recipe: Recipe) -> str:
    """The hardware an emitted config is for: the recipe's, with 'auto' meaning the GPU cluster it names."""
    return "cpu" if recipe.launch.hardware == "cpu" else "gpu"


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
    meta device; 16-bit weights: they receive their shards when FSDP wraps (model.ram_efficient_rank); 4-bit weights
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


def accelerate_config(recipe: Recipe) -> dict:
    """The launch section as a standard accelerate config (what `accelerate config` would write)."""
    L = recipe.launch
    cpu = render_target(recipe) == "cpu"
    world = L.world_size
    mixed = "bf16" if recipe.trl_value("bf16") else "fp16" if recipe.trl_value("fp16") else "no"
    if recipe.model.precision == "memory_constrained":
        mixed = "no"  # the weights themselves are bf16/fp16; nothing to autocast
    # accelerate launches several ranks (torchrun) only for GPU-family types: MULTI_CPU starts ONE process. So DDP on
    # the cpu target is written MULTI_GPU, and the rank itself asks for the CPU (use_cpu in training_kwargs). use_cpu
    # stays false in the file: launchers would export ACCELERATE_USE_CPU, which silently turns DeepSpeed into DDP.
    dist = {"none": "NO", "ddp": "MULTI_GPU", "deepspeed": "DEEPSPEED", "fsdp": "FSDP"}[L.backend]
    cfg: dict = {
        "compute_environment": "LOCAL_MACHINE",
        "debug": False,
        "distributed_type": dist,
        "downcast_bf16": "no",
        "machine_rank": 0,
        "main_process_port": L.main_process_port,
        "main_training_function": "main",
        "mixed_precision": mixed,
        "num_machines": L.num_machines,
        "num_processes": world,
        "rdzv_backend": "static",
        "same_network": True,
        "use_cpu": cpu and L.backend == "none",
    }
    if L.backend == "deepspeed":
        cfg["deepspeed_config"] = {
            "deepspeed_multinode_launcher": "standard",
            "zero_stage": L.zero_stage,
            "offload_optimizer_device": "cpu" if L.offload_optimizer else "none",
            "offload_param_device": "cpu" if L.offload_params else "none",
            "zero3_init_flag": bool(L.zero_stage == 3 and L.zero3_init),
            "zero3_save_16bit_model": L.zero_stage == 3,
            "gradient_clipping": recipe.trl_value("max_grad_norm"),
        }
    elif L.backend == "fsdp":
        fsdp = {
            "fsdp_version": L.fsdp_version,
            "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
            "fsdp_cpu_ram_efficient_loading": L.fsdp_cpu_ram_efficient_loading,
            "fsdp_offload_params": L.fsdp_offload_params,
            "fsdp_state_dict_type": L.fsdp_state_dict_type,
            # activation checkpointing is the recipe's gradient_checkpointing (FSDP's own loses LoRA saves)
            "fsdp_activation_checkpointing": False,
        }
        if L.wrap_classes:  # else each rank names the model's own (model.fsdp_wrap_classes)
            fsdp["fsdp_transformer_layer_cls_to_wrap"] = ",".join(L.wrap_classes)
        if L.fsdp_version == 1:
            fsdp.update(fsdp_sharding_strategy=L.fsdp_sharding_strategy, fsdp_backward_prefetch="BACKWARD_PRE",
                        fsdp_forward_prefetch=False, fsdp_sync_module_states=L.fsdp_sync_module_states,
                        fsdp_use_orig_params=True)
        else:
            fsdp["fsdp_reshard_after_forward"] = L.fsdp_sharding_strategy == "FULL_SHARD"
        cfg["fsdp_config"] = fsdp
    return cfg


def launcher_env(recipe: Recipe) -> dict[str, str]:
    """Environment the launcher exports before starting the ranks (the cpu target's needs; nothing on GPUs)."""
    return cpu_env(recipe) if render_target(recipe) == "cpu" else {}

"""The recipe's launch section as a standard accelerate config (DeepSpeed, FSDP or DDP; what `accelerate config` would
write) and the environment its launcher exports before starting the ranks, torch-free."""

from __future__ import annotations

from sftrecipes.recipe.target import cpu_env, render_target
from sftrecipes.recipe.typed import Recipe


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
        if L.wrap_classes:  # else each rank names the model's own (model/wrapping.fsdp_wrap_classes)
            fsdp["fsdp_transformer_layer_cls_to_wrap"] = ",".join(L.wrap_classes)
        if L.fsdp_version == 1:
            fsdp.update(fsdp_sharding_strategy=L.fsdp_sharding_strategy, fsdp_backward_prefetch="BACKWARD_PRE",
                        fsdp_forward_prefetch=False, fsdp_sync_module_states=L.fsdp_sync_module_states,
                        fsdp_use_orig_params=True)
        else:
            fsdp["fsdp_reshard_after_forward"] = L.fsdp_sharding_strategy == "FULL_SHARD"
        cfg["fsdp_config"] = fsdp
    if L.sequence_parallel_size > 1:  # Ulysses (recipe/seqpar.py); each rank also builds it (train/seqpar.py), with
        cfg["parallelism_config"] = {  # the attention kernel it loads
            "parallelism_config_sp_size": L.sequence_parallel_size,
            "parallelism_config_sp_backend": "deepspeed",
            "parallelism_config_sp_seq_length_is_variable": True,
        }
    elif L.context_parallel_size > 1:
        cfg["parallelism_config"] = {
            "parallelism_config_cp_size": L.context_parallel_size,
            "parallelism_config_cp_backend": "torch",
            "parallelism_config_dp_shard_size": world // L.context_parallel_size,
        }
    return cfg


def launcher_env(recipe: Recipe) -> dict[str, str]:
    """Environment the launcher exports before starting the ranks (the cpu target's needs; nothing on GPUs)."""
    return cpu_env(recipe) if render_target(recipe) == "cpu" else {}

"""How a recipe runs on its processes: the hardware target, the recipe as TRL/transformers training arguments and as an
accelerate config, pre-flight, the precision policy, and probes of what really ran (wrapper, precision, load memory,
sample reply).

The hardware target is the one place that knows what a machine without a GPU needs: `use_cpu` (so a GPU
command line with `--bf16 True` runs instead of failing with "Your setup doesn't support bf16/gpu"), the
gloo process-group backend, DeepSpeed's CPU accelerator and one thread per rank.
"""

from __future__ import annotations

import logging
import os

from .errors import RecipeError
from .recipe import Recipe
from .schema import TRL_DEFAULTS

log = logging.getLogger("sftrecipes")

# Keys the data pipeline (data.py) applies itself; TRL would refuse them on pre-tokenized data.
CONSUMED_BY_PIPELINE = ("assistant_only_loss", "completion_only_loss", "chat_template_path")


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
    """Set this process up for the target before any accelerate/transformers state exists: environment a launcher
    did not set, torch threads, and the compatibility shims the backend needs (compat.py)."""
    from . import compat  # noqa: PLC0415

    if recipe.launch.backend == "fsdp":
        compat.fix_peft_prefixes_under_wrappers()
    if recipe.model.use_peft_lora:
        compat.trainable_token_heads_for_trl()
    if target != "cpu":
        return
    for k, v in cpu_env(recipe).items():
        os.environ.setdefault(k, v)
    import torch  # noqa: PLC0415

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    if recipe.launch.backend == "fsdp":
        compat.enable_fsdp_on_cpu()
    if recipe.launch.backend == "deepspeed" and recipe.launch.zero_stage == 3 and recipe.model.use_peft_lora:
        compat.trainable_tokens_init_under_zero3_on_cpu()


def check_world_size(recipe: Recipe) -> int:
    """The processes this run really has must be the ones the recipe's launch section describes."""
    want = recipe.launch.world_size
    have = int(os.environ.get("WORLD_SIZE", "1"))
    if have != want:
        raise RecipeError(
            f"launch: the recipe describes {want} processes (num_machines {recipe.launch.num_machines} x gpus_per_node "
            f"{recipe.launch.gpus_per_node}) but this run has {have}; start it with its launcher: python -m sftrecipes "
            f"launch {recipe.sources[-1] if recipe.sources else 'RECIPE.yaml'} [--key value ...] (or set --launch.gpus_per_node)"
        )
    return have


def check_launcher_matches(recipe: Recipe) -> None:
    """The accelerate launcher exports what its config file says (ACCELERATE_USE_DEEPSPEED, FSDP_VERSION, ...). A
    recipe whose launch keys were changed on the command line, or a config from another recipe, would otherwise
    run silently on the launcher's backend, not the recipe's."""
    env = os.environ
    if int(env.get("WORLD_SIZE", "1")) == 1 and not any(k.startswith("ACCELERATE_USE_") for k in env):
        return  # not started by accelerate: nothing to compare
    L = recipe.launch
    ran = "deepspeed" if env.get("ACCELERATE_USE_DEEPSPEED") == "true" else "fsdp" if env.get("ACCELERATE_USE_FSDP") == "true" else None
    wants = L.backend if L.backend in ("deepspeed", "fsdp") else None
    problems = []
    if ran != wants:
        problems.append(f"backend {L.backend} but the launcher's accelerate config runs {ran or 'neither DeepSpeed nor FSDP'}")
    elif ran == "deepspeed" and env.get("ACCELERATE_DEEPSPEED_ZERO_STAGE", str(L.zero_stage)) != str(L.zero_stage):
        problems.append(f"zero_stage {L.zero_stage} but the launcher's config says {env['ACCELERATE_DEEPSPEED_ZERO_STAGE']}")
    elif ran == "fsdp" and env.get("FSDP_VERSION", str(L.fsdp_version)) != str(L.fsdp_version):
        problems.append(f"fsdp_version {L.fsdp_version} but the launcher's config says {env['FSDP_VERSION']}")
    if problems:
        raise RecipeError(f"launch: the recipe says {problems[0]}; start it with python -m sftrecipes launch RECIPE, which renders the launcher's config from the recipe")


def liger_installed() -> bool:
    """The liger-kernel package (requirements-gpu.txt) is importable here; it brings Triton kernels, GPU-only."""
    import importlib.util  # noqa: PLC0415

    return importlib.util.find_spec("liger_kernel") is not None


def check_liger(recipe: Recipe, target: str) -> None:
    """use_liger_kernel needs a GPU and the liger-kernel package: refused in one line before any model is loaded
    (transformers would fail at trainer construction, after the model load, with an ImportError or a Triton error)."""
    if not recipe.trl_value("use_liger_kernel"):
        return
    if target == "cpu":
        raise RecipeError("use_liger_kernel: Liger's kernels are Triton GPU kernels and this run's hardware target is cpu; "
                          "set use_liger_kernel: false (or run on a GPU with launch.hardware: gpu)")
    if not liger_installed():
        raise RecipeError("use_liger_kernel: the liger-kernel package is not installed; pip install -r requirements-gpu.txt "
                          "(or set use_liger_kernel: false)")


def training_kwargs(recipe: Recipe, target: str) -> dict:
    """The SFTConfig keyword arguments: the recipe's explicit TRL keys plus what the project derives."""
    check_liger(recipe, target)
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
    from .model import SDPA_PACKED_PAD, packed_under_sdpa_on_gpu  # noqa: PLC0415

    if "pad_to_multiple_of" not in recipe.trl and packed_under_sdpa_on_gpu(recipe, target):
        kw["pad_to_multiple_of"] = SDPA_PACKED_PAD
        log.info("pad_to_multiple_of: %d (packing under sdpa on a GPU: a bounded set of batch shapes lets cuDNN reuse its "
                 "attention graphs; set pad_to_multiple_of to override)", SDPA_PACKED_PAD)
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
    except RecipeError:  # the project's own refusals (a ValueError too) are already one line naming the key
        raise
    except ValueError as e:  # transformers' own cross-checks (e.g. load_best_model_at_end without matching strategies)
        raise RecipeError("training arguments: " + " ".join(str(e).split())) from None


def render_target(recipe: Recipe) -> str:
    """The hardware an emitted config is for: the recipe's, with 'auto' meaning the GPU cluster it names."""
    return "cpu" if recipe.launch.hardware == "cpu" else "gpu"


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


def gpu_count() -> int:
    import torch  # noqa: PLC0415

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def preflight(recipe: Recipe, force: bool = False) -> str:
    """Can this recipe start on this machine? First the memory plan (does it fit the GPUs it names?), then the
    hardware (are those GPUs here?). A RecipeError (exit 2) says why not; --force skips only the memory verdict."""
    from . import plan  # noqa: PLC0415

    L = recipe.launch
    world = L.world_size
    fits, plan_text = plan.preflight(recipe)
    lines = [plan_text, "", f"preflight: {L.backend} on {L.num_machines} node(s) x {L.gpus_per_node} process(es), hardware {L.hardware}"]
    if not fits:
        if not force:
            print("\n".join(lines))
            raise RecipeError("preflight: the memory plan above says this recipe does not fit; pick a strategy from the table, or pass --force to launch anyway")
        lines.append("preflight: the plan says it does not fit; launching anyway (--force)")
    if render_target(recipe) == "gpu" and (world > 1 or L.backend != "none" or L.hardware == "gpu"):
        have = gpu_count()
        if have < L.gpus_per_node:
            mem = f" of {L.gpu_memory_gb:g} GB" if L.gpu_memory_gb else ""
            raise RecipeError(
                f"launch: this recipe needs {L.gpus_per_node} GPU(s){mem} per node ({L.backend}, {world} processes in all) "
                f"but this machine has {have}; run it on a GPU node (its CPU twin under recipes/tiny/ runs here)"
            )
        lines.append(f"preflight: {have} GPU(s) visible")
    return "\n".join(lines)


def _elements(module) -> tuple[int, int, int]:
    """(parameter elements this rank stores, elements of the whole model, elements of its trainable parameters)
    for plain, DTensor (FSDP2), ZeRO-3 partitioned and FSDP1 flat-sharded parameters."""
    flat = {}
    for m in module.modules():  # FSDP1: the FlatParameters know their unsharded size
        handle = getattr(m, "_handle", None)
        fp = getattr(handle, "flat_param", None)
        if fp is not None:
            flat[id(fp)] = fp
    if flat:
        local = sum(fp.numel() for fp in flat.values())
        full = sum(fp._unpadded_unsharded_size.numel() for fp in flat.values())
        trainable = sum(fp._unpadded_unsharded_size.numel() for fp in flat.values() if fp.requires_grad)
        return local, full, trainable
    local = full = trainable = 0
    for p in module.parameters():
        if hasattr(p, "ds_tensor"):  # DeepSpeed ZeRO-3 partition
            a, b = p.ds_tensor.numel(), p.ds_numel
        elif hasattr(p, "to_local"):  # DTensor shard (FSDP2)
            a, b = p.to_local().numel(), p.numel()
        else:
            a = b = p.numel()
        local, full = local + a, full + b
        trainable += b if p.requires_grad else 0
    return local, full, trainable


def fp32_partitions(optimizer) -> list:
    """This rank's fp32 master partitions of a live DeepSpeed ZeRO optimizer (flat tensors, one per param group):
    `single_partition_of_fp32_groups` under ZeRO-1/2, `fp32_partitioned_groups_flat` under ZeRO-3; [] for others.
    (A saved checkpoint keys them differently; export._ZeroSource reads those.)"""
    return (getattr(optimizer, "single_partition_of_fp32_groups", None)
            or getattr(optimizer, "fp32_partitioned_groups_flat", None) or [])


def describe_backend(trainer) -> dict:
    """What really ran, read from the live objects: distribution type, wrapper, ZeRO stage, and how many parameter
    and optimizer-state elements this rank holds versus the whole model (the evidence that sharding took effect)."""
    acc = trainer.accelerator
    wrapped = trainer.model_wrapped
    local, full, trainable = _elements(wrapped)
    info = {
        "distributed_type": acc.state.distributed_type.value,
        "world_size": acc.num_processes,
        "wrapper": type(wrapped).__name__,
        "param_elements_local": local,
        "param_elements_full": full,
        "trainable_elements_full": trainable,
        "param_dtypes": sorted({str(p.dtype).removeprefix("torch.") for p in wrapped.parameters()}),
    }
    engine = getattr(trainer, "deepspeed", None)
    if engine is not None:
        info["zero_stage"] = engine.zero_optimization_stage()
        for key, cfg in (("zero_offload_optimizer", engine.zero_offload_optimizer()), ("zero_offload_params", engine.zero_offload_param())):
            info[key] = str(getattr(cfg, "device", "none") or "none").split(".")[-1]
        opt = engine.optimizer
        info["optimizer_fp32_elements_local"] = int(sum(g.numel() for g in fp32_partitions(opt)))
        info["optimizer"] = type(getattr(opt, "optimizer", opt)).__name__
    plugin = getattr(acc.state, "fsdp_plugin", None)
    if plugin is not None:
        info["fsdp_version"] = plugin.fsdp_version
    return info


def sample_reply(trainer, tokenizer, prompt, max_new_tokens: int) -> dict:
    """Greedy reply of the trained model to `prompt` (messages or text), stopping where the saved generation config
    says (end of turn, eos). Returns {"reply": text without special tokens, "stopped_on": the stop token it ended with
    or None when it ran to max_new_tokens, "new_tokens": n}. Called on every rank: under ZeRO-3 and FSDP each forward
    gathers parameters from all ranks, so all must generate together (synced_gpus)."""
    import torch  # noqa: PLC0415

    acc = trainer.accelerator
    model = acc.unwrap_model(trainer.model)
    if isinstance(prompt, list):
        enc = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    else:
        enc = tokenizer(prompt, return_tensors="pt")
    enc = {k: v.to(acc.device) for k, v in enc.items()}
    kwargs = dict(max_new_tokens=max_new_tokens, do_sample=False, use_cache=True, pad_token_id=tokenizer.pad_token_id,
                  synced_gpus=acc.num_processes > 1)
    gen = getattr(model, "generation_config", None)
    if gen is not None and getattr(gen, "stop_strings", None):
        kwargs["tokenizer"] = tokenizer
    was_training = model.training
    model.eval()
    plugin = getattr(acc.state, "fsdp_plugin", None)
    with torch.no_grad():
        if plugin is not None and plugin.fsdp_version == 1:  # FSDP1's flat shards must be gathered around generate
            from torch.distributed.fsdp import FullyShardedDataParallel as FSDP  # noqa: PLC0415

            with FSDP.summon_full_params(trainer.model_wrapped, writeback=False, recurse=True):
                out = model.generate(**enc, **kwargs)
        else:
            out = model.generate(**enc, **kwargs)
    model.train(was_training)
    new = out[0, enc["input_ids"].shape[1]:].tolist()
    eos = gen.eos_token_id if gen is not None else tokenizer.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    stop = new[-1] if new and new[-1] in eos else None
    return {"reply": tokenizer.decode(new, skip_special_tokens=True), "new_tokens": len(new),
            "stopped_on": tokenizer.convert_ids_to_tokens(stop) if stop is not None else None}


def rss_mb() -> tuple[float, float]:
    """(current, peak so far) resident memory of this process in MB."""
    import resource  # noqa: PLC0415

    import psutil  # noqa: PLC0415

    return psutil.Process().memory_info().rss / 1e6, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e6  # KiB


def load_memory_probe():
    """A callback that records this rank's memory at the start of the first step: after loading and wrapping (FSDP
    sharding, ZeRO partitioning, rank-0 broadcast), before any optimizer state exists. Weights are memory-mapped
    and count only when touched, which happens at wrapping, not in from_pretrained."""
    from transformers import TrainerCallback  # noqa: PLC0415

    class LoadMemoryProbe(TrainerCallback):
        at_first_step = None

        def on_step_begin(self, args, state, control, **kwargs):
            if self.at_first_step is None:
                self.at_first_step = rss_mb()

    return LoadMemoryProbe()


def gather_load_memory(acc, before: tuple[float, float], after: tuple[float, float]) -> list[dict]:
    """Every rank's CPU memory from just before model loading to `after` (the probe's reading at train begin; all
    ranks call, it is a collective). With RAM-efficient loading only rank 0 ever holds the whole model."""
    from accelerate.utils import gather_object  # noqa: PLC0415

    mine = {"rank": acc.process_index, "rss_before_mb": round(before[0], 1), "peak_mb": round(after[1], 1),
            "grew_mb": round(max(after[1] - before[0], 0.0), 1)}
    return sorted(gather_object([mine]) if acc.num_processes > 1 else [mine], key=lambda d: d["rank"])


def apply_precision_policy(trainer, recipe: Recipe) -> list[str]:
    """fp32_trainable: trainable parameters in fp32 under mixed precision, whatever loaded or wrapped them (TRL casts
    QLoRA adapters to bf16 and keeps ZeRO-3 adapters in the base dtype; accelerate upcasts for FSDP except with 4-bit
    weights). DeepSpeed keeps fp32 master partitions itself, so its module is left as DeepSpeed wants it. Returns the
    names upcast here."""
    import torch  # noqa: PLC0415

    if recipe.model.precision == "memory_constrained":
        log.warning("precision: memory_constrained — trainable weights and optimizer states stay in the load dtype: "
                    "saves 2 bytes per trainable parameter plus half the optimizer states; small updates round away "
                    "and training can stall or diverge")
        return []
    mixed = trainer.args.bf16 or trainer.args.fp16
    if not mixed or recipe.launch.backend == "deepspeed":
        return []
    upcast = []
    for name, p in trainer.model.named_parameters():
        if p.requires_grad and p.dtype != torch.float32:
            p.data = p.data.float()
            upcast.append(name)
    if upcast:
        log.info("precision: %d trainable tensors upcast to fp32 (e.g. %s)", len(upcast), upcast[0])
    return upcast


def _dtype(t) -> str:
    return str(t).removeprefix("torch.")


def precision_table(trainer) -> dict[str, str]:
    """What dtype each part of training really has, read from the live objects after a step."""
    acc = trainer.accelerator
    wrapped = trainer.model_wrapped
    params = list(wrapped.parameters())
    frozen = sorted({_dtype(p.dtype) for p in params if not p.requires_grad}) or ["-"]
    trainable = sorted({_dtype(p.dtype) for p in params if p.requires_grad})
    table = {"loaded weights (frozen)": ", ".join(frozen), "trainable params": ", ".join(trainable)}
    engine = getattr(trainer, "deepspeed", None)
    if engine is not None:
        compute = "bfloat16" if engine.bfloat16_enabled() else "float16" if engine.fp16_enabled() else "float32"
        table["compute"] = f"{compute} (DeepSpeed module dtype)"
        table["gradients reduce"] = _dtype(engine.communication_data_type)
        opt = engine.optimizer
        masters = sorted({_dtype(g.dtype) for g in fp32_partitions(opt)})
        table["trainable params"] = f"{table['trainable params']} module, {', '.join(masters)} master partitions"
        inner = getattr(opt, "optimizer", opt)
    else:
        mp = acc.mixed_precision
        table["compute"] = {"bf16": "bfloat16 autocast", "fp16": "float16 autocast"}.get(mp, ", ".join(trainable))
        reduce = None
        for m in wrapped.modules():  # FSDP2 keeps its policy on each parameter group, FSDP1 on each instance
            state = getattr(m, "_get_fsdp_state", None)
            group = getattr(state(), "_fsdp_param_group", None) if state else None
            policy = getattr(group, "mp_policy", None) or getattr(m, "mixed_precision", None)
            if policy is not None:
                reduce = getattr(policy, "reduce_dtype", None) or getattr(policy, "param_dtype", None) or (trainable[0] if trainable else None)
                break
        table["gradients reduce"] = _dtype(reduce) if reduce is not None else ", ".join(trainable)
        inner = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    states = sorted({_dtype(v.dtype) for st in inner.state.values() for k, v in st.items() if hasattr(v, "dtype") and k != "step"})
    table["optimizer states"] = ", ".join(states) or "-"
    return table


def precision_probe(recipe: Recipe):
    """Callback: after the first optimizer step, read and log the precision table (rank 0)."""
    from transformers import TrainerCallback  # noqa: PLC0415

    class PrecisionProbe(TrainerCallback):
        table: dict | None = None
        trainer = None

        def on_step_end(self, args, state, control, **kwargs):
            if self.table is None and self.trainer is not None:
                self.table = precision_table(self.trainer)
                if state.is_world_process_zero:
                    log.info("precision (%s):\n%s", recipe.model.precision,
                             "\n".join(f"  {k:<26} {v}" for k, v in self.table.items()))

    return PrecisionProbe()


def hub_reachable(timeout: float = 3.0) -> bool:
    from huggingface_hub import constants  # noqa: PLC0415

    if constants.HF_HUB_OFFLINE:
        return False
    import socket  # noqa: PLC0415
    from urllib.parse import urlparse  # noqa: PLC0415

    host = urlparse(constants.ENDPOINT).hostname or "huggingface.co"
    try:
        socket.create_connection((host, 443), timeout=timeout).close()
        return True
    except OSError:
        return False


def prepare_hub(args) -> str | None:
    """Keep the hub token out of everything written (training_args.bin pickles the arguments) by moving it to the
    environment huggingface_hub reads, and turn pushing off for a run that cannot reach the hub (transformers would
    fail at start). Returns the command that pushes the result later, when pushing was turned off."""
    if args.hub_token:
        os.environ["HF_TOKEN"] = args.hub_token
        args.hub_token = None
    if not args.push_to_hub or hub_reachable():
        return None
    args.push_to_hub = False
    repo = args.hub_model_id or os.path.basename(os.path.normpath(args.output_dir))
    later = f"hf upload {repo} {args.output_dir}" + (" --private" if args.hub_private_repo else "")
    log.warning("push_to_hub: the hub is unreachable; training continues and saves locally; push later with: %s", later)
    return later

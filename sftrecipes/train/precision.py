"""The precision policy of a run and the evidence of it: trainable parameters upcast to fp32 under mixed precision
(apply_precision_policy), and the dtype of each part of training read from the live objects after a step."""

from __future__ import annotations

import functools
import logging

import torch
from transformers import TrainerCallback

from sftrecipes.recipe.typed import Recipe
from sftrecipes.train.probes import fp32_partitions

log = logging.getLogger("sftrecipes")


def apply_precision_policy(trainer, recipe: Recipe) -> list[str]:
    """fp32_trainable: trainable parameters in fp32 under mixed precision, whatever loaded or wrapped them (TRL casts
    QLoRA adapters to bf16 and keeps ZeRO-3 adapters in the base dtype; accelerate upcasts for FSDP except with 4-bit
    weights). DeepSpeed keeps fp32 master partitions itself, so its module is left as DeepSpeed wants it. Returns the
    names upcast here."""
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


def autocast_under_fsdp2(trainer, recipe: Recipe) -> str | None:
    """accelerate 1.15 prepares an FSDP2 model without the autocast it gives every other distributed type (one process,
    DDP, FSDP1): FSDP2's MixedPrecisionPolicy casts parameters to bf16 for compute but not buffers, so a model that
    mixes an fp32 buffer into its arithmetic (OpenAI-GPT's causal mask, MiniMax's lightning-attention decay) hands a
    bf16 matmul an fp32 operand ("expected m1 and m2 to have the same dtype"). Under bf16/fp16 mixed precision the
    FSDP2 model's forward runs in the autocast accelerate gives DDP; the autocast dtype, or None where none is added."""
    L = recipe.launch
    mixed = "bfloat16" if trainer.args.bf16 else "float16" if trainer.args.fp16 else None
    if L.backend != "fsdp" or L.fsdp_version != 2 or mixed is None or recipe.model.precision == "memory_constrained":
        return None
    model, dtype = trainer.model, getattr(torch, mixed)
    device = trainer.args.device.type
    inner = model.forward

    @functools.wraps(inner)
    def forward(*args, **kwargs):
        with torch.autocast(device_type=device, dtype=dtype):
            return inner(*args, **kwargs)

    model.forward = forward
    return mixed


def _dtype(t) -> str:
    return str(t).removeprefix("torch.")


def precision_table(trainer, autocast: str | None = None) -> dict[str, str]:
    """What dtype each part of training really has, read from the live objects after a step; `autocast`: the autocast
    dtype a forward ran under (PrecisionProbe reads it inside the model), None for none."""
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
        reduce, compute = None, None
        for m in wrapped.modules():  # FSDP2 keeps its policy on each parameter group, FSDP1 on each instance
            state = getattr(m, "_get_fsdp_state", None)
            group = getattr(state(), "_fsdp_param_group", None) if state else None
            policy = getattr(group, "mp_policy", None) or getattr(m, "mixed_precision", None)
            if policy is not None:
                reduce = getattr(policy, "reduce_dtype", None) or getattr(policy, "param_dtype", None) or (trainable[0] if trainable else None)
                compute = getattr(policy, "param_dtype", None)
                break
        if autocast:
            table["compute"] = f"{autocast} autocast"
        else:
            table["compute"] = f"{_dtype(compute)} (FSDP parameter cast)" if compute is not None else ", ".join(trainable)
        table["gradients reduce"] = _dtype(reduce) if reduce is not None else ", ".join(trainable)
        inner = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    states = sorted({_dtype(v.dtype) for st in inner.state.values() for k, v in st.items() if hasattr(v, "dtype") and k != "step"})
    table["optimizer states"] = ", ".join(states) or "-"
    return table


def precision_probe(recipe: Recipe):
    """Callback: after the first optimizer step, read and log the precision table (rank 0)."""
    return PrecisionProbe(recipe)


class PrecisionProbe(TrainerCallback):
    """precision_probe's callback: set `trainer` after building it; `table` holds precision_table after step one."""

    def __init__(self, recipe: Recipe):
        self.recipe, self.table, self.trainer = recipe, None, None
        self.autocast: str | None = None  # the autocast dtype the first forward ran under, read inside the model

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if model is None:
            return
        device = args.device.type

        def seen(module, inputs):  # the input embeddings run inside forward, within any autocast it enters
            if torch.is_autocast_enabled(device):
                self.autocast = _dtype(torch.get_autocast_dtype(device))
            handle.remove()

        try:
            embeddings = model.get_input_embeddings()
        except (AttributeError, NotImplementedError):  # no input embeddings to read it in: the table says what else it knows
            return
        handle = embeddings.register_forward_pre_hook(seen)

    def on_step_end(self, args, state, control, **kwargs):
        if self.table is None and self.trainer is not None:
            self.table = precision_table(self.trainer, self.autocast)
            if state.is_world_process_zero:
                log.info("precision (%s):\n%s", self.recipe.model.precision,
                         "\n".join(f"  {k:<26} {v}" for k, v in self.table.items()))

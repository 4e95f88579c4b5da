"""The strategies table: other ways to run the same model and batch (DDP, ZeRO stages, FSDP, offload, more GPUs, QLoRA,
a shorter context or completion; for a reference copy, precomputed log-probs, beta 0 or LoRA; generating layer by layer
under ZeRO-3; sequence parallelism where a context does not fit: splits.py), each estimated like the recipe itself and
ranked by fit, then by the time its network and host<->device traffic takes at assumed bandwidths (torch-free).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

from sftrecipes.core.errors import RecipeError
from sftrecipes.plan.estimate import Plan, estimate
from sftrecipes.plan.reference import COPY
from sftrecipes.plan.sharding import GB, setup
from sftrecipes.plan.splits import more_gpus, split_candidates
from sftrecipes.recipe.schema import ONLINE
from sftrecipes.recipe.seqpar import check_sequence
from sftrecipes.recipe.typed import Recipe

# bandwidths used only to rank strategies (bytes per second per GPU): NVLink ring, InfiniBand 200 Gb/s, PCIe
NVLINK, INFINIBAND, PCIE = 150e9, 25e9, 20e9


@dataclass
class Strategy:
    name: str
    gpus: int
    gpu_gb: float
    fits: bool | None
    comm_gb: float  # per GPU per optimizer step, network
    pcie_gb: float  # per GPU per optimizer step, host <-> device
    seconds: float  # comm + transfer time at the assumed bandwidths, the ranking key
    cpu_gb: float
    note: str = ""


def _variant(recipe: Recipe, **changes) -> Recipe:
    r = copy.deepcopy(recipe)
    for k, v in changes.items():
        section, _, name = k.rpartition(".")
        if section:
            setattr(getattr(r, section), name, v)
        elif k in ("use_4bit_quantization", "use_nested_quant", "bnb_4bit_quant_storage_dtype", "bnb_4bit_compute_dtype",
                   "use_peft_lora", "lora_r", "lora_alpha", "lora_target_modules"):
            setattr(r.model, k, v)
        else:
            r.trl[k] = v
    return r


def alternatives(recipe: Recipe, plan: Plan) -> list[Strategy]:
    """Strategies for the same model and batch, each planned by estimate.estimate, ranked: fitting first, then by the
    time their network and host<->device traffic takes at the assumed bandwidths (compute per GPU is the same)."""
    L, N = recipe.launch, plan.world
    ds = {"launch.backend": "deepspeed", "launch.offload_optimizer": False, "launch.offload_params": False}
    fs = {"launch.backend": "fsdp", "launch.fsdp_offload_params": False}
    cands: list[tuple[str, dict]] = []
    if N > 1:
        cands += [("DDP", {"launch.backend": "ddp"}),
                  *[(f"ZeRO-{z}", {**ds, "launch.zero_stage": z}) for z in (1, 2, 3)],
                  ("FSDP FULL_SHARD", {**fs, "launch.fsdp_sharding_strategy": "FULL_SHARD"}),
                  ("FSDP SHARD_GRAD_OP", {**fs, "launch.fsdp_sharding_strategy": "SHARD_GRAD_OP"})]
    cands += [("ZeRO-3 + offload optimizer", {**ds, "launch.zero_stage": 3, "launch.offload_optimizer": True}),
              ("ZeRO-3 + offload optimizer + params", {**ds, "launch.zero_stage": 3, "launch.offload_optimizer": True, "launch.offload_params": True})]
    for mult in (2, 4):
        more = more_gpus(recipe, mult)
        cands += [(f"ZeRO-3 on {N * mult} GPUs", {**ds, "launch.zero_stage": 3, **more}),
                  (f"FSDP FULL_SHARD on {N * mult} GPUs", {**fs, "launch.fsdp_sharding_strategy": "FULL_SHARD", **more})]
    if recipe.model.use_peft_lora and not recipe.model.use_4bit_quantization:
        cands.append(("QLoRA (4-bit nf4 base, nested quant)*", {"use_4bit_quantization": True, "use_nested_quant": True,
                      "bnb_4bit_quant_storage_dtype": "bfloat16", "bnb_4bit_compute_dtype": "bfloat16"}))
    online = recipe.method in ONLINE
    if plan.reference_kind == COPY:  # a frozen copy: computed once before training (dpo, kto), no KL term (grpo, rloo), or none
        cands += [("beta 0 (no KL term, no reference)*", {"beta": 0.0}) if online else
                  ("precompute_ref_log_probs", {"precompute_ref_log_probs": True}),
                  ("LoRA r16 (reference: adapter off)*", {"use_peft_lora": True, "lora_r": 16, "lora_alpha": 32,
                                                          "lora_target_modules": "all-linear"})]
    if (online and L.backend == "deepspeed" and L.zero_stage == 3 and recipe.trl_value("ds3_gather_for_generation")
            and not recipe.trl_value("use_vllm")):  # transformers generate with every parameter gathered
        cands.append(("ZeRO-3, generate layer by layer", {"ds3_gather_for_generation": False}))
    seq, cap = recipe.trl_value("max_length"), recipe.trl_value("vllm_max_model_length") if online else None
    if online and cap:  # half the completion, the same prompts (prompt + completion is planned at vllm_max_model_length)
        c = recipe.trl_value("max_completion_length")
        if c >= 256:
            cands.append((f"max_completion_length {c // 2}*", {"max_completion_length": c // 2,
                                                               "vllm_max_model_length": cap - c + c // 2}))
    elif not online and seq and seq >= 256:
        cands.append((f"max_length {seq // 2}*", {"max_length": seq // 2}))
    cands += split_candidates(recipe, plan, lambda **changes: estimate(_variant(recipe, **changes)))
    out = []
    for name, changes in cands:
        r = _variant(recipe, **changes)
        if r.launch.backend != "deepspeed":
            r.launch.offload_optimizer = r.launch.offload_params = False
        try:
            check_sequence(r)  # a sequence split only where it runs (a recipe's split on FSDP or DDP is not)
            p = estimate(r)
        except RecipeError:  # a variant the recipe's own keys refuse (a generation_batch_size other ranks cannot split)
            continue
        s = setup(r)
        pcie = 0.0
        if s.offload_opt:  # grads down, updated params up, once per step
            pcie += p.trainable * (2 + 2) / s.shard_o / GB
        if s.offload_params:  # every gather fetches the shard from host memory
            pcie += recipe.trl_value("gradient_accumulation_steps") * 2 * p.weights_shard_gb
        bw = NVLINK if r.launch.num_machines == 1 else INFINIBAND
        secs = p.comm_gb * GB / bw + pcie * GB / PCIE
        out.append(Strategy(name, p.world, p.gpu_total_gb, p.fits, p.comm_gb, pcie, secs, p.cpu_total_gb,
                            "" if p.cpu_fits in (None, True) else "needs more CPU RAM than launch.cpu_ram_gb"))
    # * changes what is trained (quantized base, shorter context): after the strategies that train the same thing
    out.sort(key=lambda x: (x.fits is False, x.note != "", x.name.endswith("*"), x.seconds, x.gpus))
    return out

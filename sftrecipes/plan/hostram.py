"""CPU RAM per node of one run: its processes, then the larger of loading the weights (by recipe/target.weight_reading,
the loader's own rule) and training (what the ranks offload to host memory, an FSDP FULL_STATE_DICT save on rank 0)."""

from __future__ import annotations

from sftrecipes.facts.shape import Shape
from sftrecipes.plan.reference import COPY
from sftrecipes.plan.sharding import GB, Setup, partitioned_4bit_load, trainable_bytes
from sftrecipes.plan.states import Item, ModelStates
from sftrecipes.recipe.target import PARTITIONED, RANK0_READS, weight_reading
from sftrecipes.recipe.typed import Recipe

PROCESS_CPU_GB = 2.0  # host RAM of one rank besides tensors: python, torch, CUDA host libraries, dataloader
CKPT_SHARD_GB = 10.0  # hub checkpoints ship in ~5-10 GB safetensors shards; a rank reading shard by shard holds one


def cpu_ram(recipe: Recipe, shape: Shape, s: Setup, st: ModelStates) -> tuple[list[Item], float]:
    """CPU RAM per node: processes, then the larger of loading and (offloaded states + a FULL_STATE_DICT save)."""
    L, gpn = recipe.launch, s.gpn
    cpu = [Item("processes", gpn * PROCESS_CPU_GB, f"{gpn} ranks x {PROCESS_CPU_GB:.0f} GB (python, torch, CUDA libs)")]
    load_float_b = s.load_bytes
    full_model = shape.params * load_float_b
    mode, why = weight_reading(recipe, quantized=s.quant_bits < 16)  # the loader's own rule (model.load_model)
    if mode == RANK0_READS and s.quant_bits == 4:
        # rank 0 reads shard by shard; every rank keeps its rows of each 4-bit layer in host memory until fully_shard
        ld = partitioned_4bit_load(recipe, shape, s.shard_w, st.float_b)
        cpu.append(Item("loading", (min(full_model, CKPT_SHARD_GB * GB) + gpn * (ld.share + ld.states)) / GB,
                        f"{why}: one checkpoint shard at a time on rank 0, and {gpn} ranks x their rows of the 4-bit "
                        f"layers with the layers' quantization states ({(ld.share + ld.states) / GB:.1f} GB) until FSDP2 "
                        "moves them to the GPU"))
    elif mode == RANK0_READS:
        cpu.append(Item("loading", full_model / GB, why))
    elif mode == PARTITIONED or (s.quant_bits < 16 and s.gpu):
        cpu.append(Item("loading", gpn * min(full_model, CKPT_SHARD_GB * GB) / GB,
                        why if mode == PARTITIONED else f"{why}, shard by shard into quantized GPU tensors"))
    else:
        cpu.append(Item("loading", gpn * full_model / GB, f"{why} ({full_model / GB:.0f} GB in {load_float_b}-byte floats)"))
    if st.ref.kind == COPY:
        # the copy loads as the policy did, right after it (methods.trainer_kwargs, before the trainer exists): the
        # policy is still in host RAM then unless zero3_init partitioned it onto the GPUs as it loaded
        if mode == PARTITIONED:
            cpu[-1].note += "; the reference copy loads the same way after it"
        elif mode == RANK0_READS:  # every rank reads the copy: nothing broadcasts into it (methods.trainer_kwargs)
            cpu[-1] = Item("loading (policy + reference copy)", cpu[-1].gb + gpn * full_model / GB,
                           cpu[-1].note + f"; then the reference copy, read by each of the {gpn} ranks (TRL shards it "
                           "without rank 0's broadcast), the policy still in host RAM")
        else:
            cpu[-1] = Item("loading (policy + reference copy)", 2 * cpu[-1].gb,
                           cpu[-1].note + "; then the reference copy the same way, the policy still in host RAM")
    off = offloaded_per_rank(recipe, shape, s, st)
    if off:
        cpu.append(Item("offloaded states", gpn * off / GB, "per rank x ranks on the node (pinned)"))
    if L.backend == "fsdp" and L.fsdp_state_dict_type == "FULL_STATE_DICT":
        cpu.append(Item("FULL_STATE_DICT save on rank 0", full_state_dict_bytes(recipe, shape, s) / GB,
                        "the whole model gathered on rank 0's CPU"))
    # loading and training do not overlap: the node peak is processes + max(loading, offload + saving)
    return cpu, cpu[0].gb + max(cpu[1].gb, sum(i.gb for i in cpu[2:]))


def offloaded_per_rank(recipe: Recipe, shape: Shape, s: Setup, st: ModelStates) -> float:
    """Bytes one rank keeps in host memory for the offloaded states. DeepSpeed's offloaded optimizer steps on the CPU
    with an fp32 master partition, Adam's m and v and an fp32 gradient partition of its own (stage3's
    subgroup_gradient_buffer, stage_1_and_2's single_partition_of_fp32_groups[i].grad): 16 B/param / ranks, measured
    on the ZeRO-3 offload twin at 253M (2 ranks: 0.5 GB more than 12 B/param would be)."""
    L, off = recipe.launch, 0.0
    if s.offload_opt:
        off += st.trainable * (16 if s.deepspeed16 else st.o_b + (0 if L.backend == "fsdp" else 8)) / s.shard_o
    if s.offload_params:
        off += (st.frozen + st.trainable * st.p_b) / s.shard_w + (st.trainable * st.g_b / s.shard_g if L.backend == "fsdp" else 0)
        off += st.ref.per_rank if st.ref.kind == COPY else 0.0  # the reference's engine / FSDP keeps the offload
    return off


def full_state_dict_bytes(recipe: Recipe, shape: Shape, s: Setup) -> float:
    """Bytes an FSDP FULL_STATE_DICT save gathers on rank 0's CPU: every weight in its dtype at rest (LoRA: the base in
    its load dtype; full fine-tuning: sharding.trainable_bytes, so memory_constrained gathers 16-bit weights)."""
    return shape.params * (s.load_bytes if s.lora else trainable_bytes(recipe, s))

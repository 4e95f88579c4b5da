"""Configuration traps a recipe walks into, as one line each that says what to do (torch-free): train.py logs them
at start, the plan command and the launchers' pre-flight print them under the plan.
"""

from __future__ import annotations

from sftrecipes.core.errors import RecipeError
from sftrecipes.facts.config import model_shape
from sftrecipes.facts.shape import DTYPE_BYTES
from sftrecipes.plan.hostram import PROCESS_CPU_GB, full_state_dict_bytes
from sftrecipes.plan.seqsplit import RING, ULYSSES, data_groups, split
from sftrecipes.plan.sharding import GB, setup
from sftrecipes.recipe.load import load_recipe
from sftrecipes.recipe.schema import ONLINE, PAIRED
from sftrecipes.recipe.target import load_dtype, mixed_dtype
from sftrecipes.recipe.typed import Recipe


def pitfalls(recipe: Recipe) -> list[str]:
    """Configuration traps this recipe walks into (plus the global batch, always). Each line says what to do."""
    m, L = recipe.model, recipe.launch
    world = L.world_size
    pdb, ga = recipe.trl_value("per_device_train_batch_size"), recipe.trl_value("gradient_accumulation_steps")
    lr = recipe.trl_value("learning_rate")
    unit = ("pairs (chosen + rejected)" if recipe.method in PAIRED else
            "completions" if recipe.method in ("kto", *ONLINE) else "sequences")
    groups, sp = data_groups(recipe), split(recipe)
    batch = pdb * ga * groups
    ranks = (f"{groups} data-parallel group{'s' * (groups != 1)} ({world} ranks / {sp.key.split('.')[-1]} {sp.degree})"
             if sp.on else f"{world} ranks")
    out = [f"global batch = {pdb} per device x {ga} accumulation x {ranks} = {batch} {unit} per step"]
    for base_file in recipe.sources[:-1]:
        try:
            base = load_recipe([base_file])
        except RecipeError:
            continue  # a partial base (e.g. recipes/tiny/base.yaml) is not a run of its own
        bworld = base.launch.world_size
        bbatch = base.trl_value("per_device_train_batch_size") * base.trl_value("gradient_accumulation_steps") * data_groups(base)
        if bworld != world and base.trl_value("learning_rate") == lr and bbatch != batch:
            out.append(f"WARNING learning_rate {lr:g} is kept from {base_file} (world {bworld}, global batch {bbatch}) but this "
                       f"recipe runs {world} ranks (global batch {batch}): scale learning_rate (linear or sqrt) "
                       f"or set gradient_accumulation_steps to keep the global batch")
    if world > 1:
        seeded = recipe.trl.get("data_seed", recipe.trl_value("seed"))
        acc = recipe.trl_value("accelerator_config") or {}
        if isinstance(acc, dict) and acc.get("use_seedable_sampler") is False:
            out.append("WARNING accelerator_config.use_seedable_sampler: false: each rank's sampler draws from its own torch RNG, so "
                       "ranks only agree on the permutation while every rank seeds alike; remove it (keep one seed on all ranks)")
        else:
            out.append(f"data order: every rank draws the same permutation (seed {seeded}, data_seed or seed) and takes its "
                       "own shard of it (accelerate's SeedableRandomSampler + BatchSamplerShard); do not seed per rank"
                       + ({ULYSSES: f"; the {sp.degree} ranks of a {sp.kind} group train on their batches in turn, each "
                                    "row split over the group",
                           RING: f"; the {sp.degree} ranks of a {sp.kind} group share each batch, each rank a block of "
                                 "every row"}.get(sp.kind, "")))
        if recipe.trl_value("average_tokens_across_devices") is False:
            out.append("WARNING average_tokens_across_devices: false with several ranks: each rank divides its loss by its own "
                       "token count (num_items_in_batch), so ranks with fewer tokens weigh more; set it true")
    if L.backend == "ddp" and recipe.gradient_checkpointing and m.use_reentrant and recipe.trl_value("ddp_find_unused_parameters") is not False:
        out.append("WARNING use_reentrant: true under DDP with gradient checkpointing: Trainer sets find_unused_parameters=True "
                   "for a PEFT model and reentrant checkpointing then marks parameters ready twice ('Expected to mark a "
                   "variable ready only once'); set use_reentrant: false (or ddp_find_unused_parameters: false)")
    if m.use_4bit_quantization and L.backend in ("fsdp", "deepspeed"):
        compute = mixed_dtype(recipe) or "float32"
        dtype = load_dtype(recipe)
        if m.bnb_4bit_quant_storage_dtype != compute or (m.dtype != "auto" and m.dtype != m.bnb_4bit_quant_storage_dtype):
            out.append(f"WARNING bnb_4bit_quant_storage_dtype {m.bnb_4bit_quant_storage_dtype} differs from the model/mixed-precision "
                       f"dtype ({dtype}, {compute}): {L.backend} flattens all weights of a unit into one dtype; "
                       f"set bnb_4bit_quant_storage_dtype: {compute}")
    if (recipe.method != "sft" and L.backend == "fsdp" and not m.use_peft_lora
            and recipe.trl_value("precompute_ref_log_probs")):
        whole = model_shape(m.model_name_or_path).params * DTYPE_BYTES[load_dtype(recipe)] / GB
        out.append(f"WARNING precompute_ref_log_probs under FSDP: the policy is not sharded until train(), so TRL 1.16 loads a "
                   f"reference copy itself for the pass (its create_model_from_path: the policy's dtype, device_map "
                   f"'auto'), about {whole:.0f} GB per GPU until it shards it; use DeepSpeed ZeRO-3 (the pass runs the "
                   f"partitioned policy), or keep a sharded copy (precompute_ref_log_probs: false)")
    if L.backend == "fsdp" and L.fsdp_state_dict_type == "FULL_STATE_DICT":
        need = full_state_dict_bytes(recipe, model_shape(m.model_name_or_path), setup(recipe)) / GB
        if L.cpu_ram_gb is None or need + PROCESS_CPU_GB * L.gpus_per_node > L.cpu_ram_gb:
            have = "launch.cpu_ram_gb is not set" if L.cpu_ram_gb is None else f"rank 0's node has {L.cpu_ram_gb:g} GB"
            out.append(f"WARNING fsdp_state_dict_type FULL_STATE_DICT gathers the whole model ({need:.0f} GB) on rank 0's CPU and "
                       f"{have}; use SHARDED_STATE_DICT for checkpoints")
    return out

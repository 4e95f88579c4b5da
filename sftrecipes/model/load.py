"""Model: loading the model a recipe describes (load dtype, quantization, the attention kernel attnchoice.py picks,
RAM-efficient ranks).

The same functions load the tiny test model and meta-llama/Llama-2-70b-hf; before loading, folders.check_model_files
names a missing tokenizer file or a cut safetensors file. The tokenizer is tokenizer.py's, LoRA lora.py's; which ranks
read the weights is recipe/target.weight_reading's rule, which the planner states.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
from transformers import AutoModelForImageTextToText, BitsAndBytesConfig
from transformers.integrations import is_deepspeed_zero3_enabled

from sftrecipes.data.tokenizer import set_generation_stop
from sftrecipes.facts.startmodel import weights_dir
from sftrecipes.model.attention import register
from sftrecipes.model.meta import auto_class_of
from sftrecipes.model.attnchoice import VARLEN, choose_attention, log_attention
from sftrecipes.model.heap import own_checkpoint_views, steady_heap
from sftrecipes.model.quantload import partition_4bit_layers, receive_4bit_layers, send_4bit_layers
from sftrecipes.recipe.schema import DTYPES as DTYPE_NAMES
from sftrecipes.recipe.target import PARTITIONED, RANK0_READS, weight_reading
from sftrecipes.recipe.target import load_dtype as load_dtype_name
from sftrecipes.recipe.typed import Recipe

log = logging.getLogger("sftrecipes")

DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}  # the one name -> torch dtype map (export uses it too)


def load_dtype(recipe: Recipe) -> torch.dtype:
    """The dtype weights are loaded in: the rule of target.load_dtype (the planner counts with the same), as torch."""
    return DTYPES[load_dtype_name(recipe)]


def sixteen_bit_modules(recipe: Recipe) -> list[str] | None:
    """What 4/8-bit loading of a vision-language model leaves in 16 bits: the modules beside its language model (vision
    tower, projector: LoRA does not adapt them, and their widths are not bitsandbytes' -- its CPU kernels cannot repack
    a 16-wide tower layer) and the output embeddings (transformers' own default, which a list given replaces). None
    for a text model: transformers' default."""
    from sftrecipes.model import meta
    from sftrecipes.model.lora import language_model
    from sftrecipes.recipe.images import vision_tower

    if not vision_tower(recipe.model.model_name_or_path):  # (a text model: no meta-device build at every 4-bit load)
        return None
    built = meta.recipe_model(recipe)
    decoder = language_model(built[1]) if built is not None else None
    if decoder is None:
        return None
    model = built[1]
    parent, _, own = decoder.rpartition(".")
    holder = model.get_submodule(parent) if parent else model
    beside = [f"{parent}.{n}" if parent else n for n, _ in holder.named_children() if n != own]
    head = model.get_output_embeddings()
    return beside + [n for n, mod in model.named_modules() if mod is head and n]


def quantization_config(recipe: Recipe):
    m = recipe.model
    if not (m.use_4bit_quantization or m.use_8bit_quantization):
        return None
    skip = sixteen_bit_modules(recipe)
    if skip:
        log.info("quantization: %s kept in 16 bits (beside the language model, and the LM head)", ", ".join(skip))
    if m.use_8bit_quantization:
        return BitsAndBytesConfig(load_in_8bit=True, llm_int8_skip_modules=skip)
    storage = torch.uint8 if m.bnb_4bit_quant_storage_dtype == "uint8" else DTYPES[m.bnb_4bit_quant_storage_dtype]
    return BitsAndBytesConfig(
        llm_int8_skip_modules=skip,
        load_in_4bit=True,
        bnb_4bit_quant_type=m.bnb_4bit_quant_type,
        bnb_4bit_compute_dtype=DTYPES[m.bnb_4bit_compute_dtype],
        bnb_4bit_use_double_quant=m.use_nested_quant,
        bnb_4bit_quant_storage=storage,
    )


def load_model(recipe: Recipe, tokenizer, hardware: str, every_rank_reads: bool = False, images: bool = False):
    """The model as the recipe describes it (weights from the hub id or local folder). every_rank_reads: no rank
    loads on the meta device, RAM-efficient loading or not (a model nothing broadcasts into: methods.py's reference).
    images: rows with images, for the image-text-to-text class (its vision tower: Llama-4's causal-LM class has none)."""
    m = recipe.model
    kwargs = dict(recipe.trl_value("model_init_kwargs") or {})  # recipe validation took out what the recipe owns
    impl, why = choose_attention(recipe, hardware)
    slotted = None
    if impl == VARLEN:
        register()
        if recipe.launch.sequence_parallel_size > 1:  # Ulysses wraps the sdpa slot (accelerate takes sdpa or flash
            impl = register(slot="sdpa")  # only): the varlen kernel sits there, reading the gathered position_ids
            slotted = f"{VARLEN} (in the sdpa slot, which sequence parallelism wraps)"
    kwargs.update(
        dtype=load_dtype(recipe),
        attn_implementation=impl,
        trust_remote_code=bool(recipe.trl_value("trust_remote_code")),
    )
    qc = quantization_config(recipe)
    if qc is not None:
        kwargs["quantization_config"] = qc
    rank = None if every_rank_reads else ram_efficient_rank(recipe, quantized=qc is not None)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1 and dist.get_rank() == 0:
        log.info("loading the weights: %s", weight_reading(recipe, quantized=qc is not None)[1])  # as the plan says
    if rank:  # not rank 0: build on the meta device, read nothing; FSDP receives rank 0's weights when it wraps
        kwargs["device_map"] = "meta"
    # 4-bit under ZeRO-3 with zero3_init: each decoder layer partitioned as soon as it is quantized (quantload.py)
    partition = qc is not None and is_deepspeed_zero3_enabled() and weight_reading(recipe, quantized=True)[0] == PARTITIONED
    # 4-bit under FSDP2, RAM-efficient: rank 0 sends each layer once quantized, every rank keeps its FSDP2 rows
    rows = (dist.get_rank(), dist.get_world_size()) if qc is not None and rank is not None else None
    # steady_heap: what a rank holds after loading is the model, not the order its temporaries were freed in
    with steady_heap(), partition_4bit_layers(partition) as zero3, send_4bit_layers(rank == 0 and rows is not None, rows) as sent:
        auto = AutoModelForImageTextToText if images else auto_class_of(m.model_name_or_path)
        model = auto.from_pretrained(weights_dir(m.model_name_or_path), **kwargs)  # an adapter: merged
        if qc is not None and not rank:  # what was not quantized is still a view into the checkpoint's mapping: let it go
            own_checkpoint_views(model)
        if sent is not None:
            sent.send_rest(model)
        elif rank and rows is not None:
            received = receive_4bit_layers(model, rows)
    part = zero3 or sent  # at most one of them acted
    if part is not None and dist.get_rank() == 0:
        if part.layers and part.partitioned == part.layers:
            log.info("%s", part.summary())
        else:  # a weight the checkpoint lacks, or a loader that no longer calls the setter quantload wraps
            log.warning("%s; the rest stayed whole until the backend shards them (more memory while loading than "
                        "planned)", part.summary())
    log_attention(recipe, hardware, slotted or model.config._attn_implementation, why)  # what the loaded model runs
    if rank and rows is not None:  # the 4-bit layers came from rank 0 (receive_4bit_layers), whole where not sent by layer
        model.__dict__.pop("hf_device_map", None)
        log.debug("rank %d: %d decoder layers received", rank, received)
    elif rank:
        # Real but untouched storage: accelerate maps optimizer params to their shards by data_ptr, which is 0 for
        # every meta tensor. Large torch.empty blocks are lazily mapped pages, so this costs address space, not RAM.
        model.to_empty(device="cpu")
        # to_empty gives each module a new Parameter, which unties tied weights (Qwen2.5 small, Gemma: lm_head shares
        # embed_tokens); untied, accelerate's FSDP2 mapping misses lm_head.weight on this rank. Tie them again.
        model.tie_weights()
        # a device map makes the Trainer treat the model as spread over devices (is_model_parallel), which it is not
        model.__dict__.pop("hf_device_map", None)
    if rank is not None:
        _broadcast_buffers(model, rank)
    emb = model.get_input_embeddings().weight
    # the full row count: under ZeRO-3 init a rank holds a 0-row partition (ds_shape is the whole), and read as 0
    # rows a vocabulary padded past the tokenizer (Qwen's 151936 rows for 151665 tokens) was cut to the tokenizer's
    if len(tokenizer) > getattr(emb, "ds_shape", emb.shape)[0]:
        # exact size: every new row is then one of the added tokens, trained and saved (see lora_config). The new rows
        # are drawn from the model's init under the recipe's seed, so every rank draws the same rows (sharded
        # backends keep each rank's own draw for its shard) and a run starts alike at any world size.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(int(recipe.trl_value("seed") or 0))
            model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    model.config.pad_token_id = tokenizer.pad_token_id
    set_generation_stop(model.generation_config, tokenizer)
    # No KV cache while training: with a cache, transformers skips its packed-sequence detection and packed samples
    # would attend to each other under sdpa/eager (tests/data/test_data.py shows it). Generation turns it back on.
    model.config.use_cache = False
    return model


def ram_efficient_rank(recipe: Recipe, quantized: bool) -> int | None:
    """This process's rank when only rank 0 should read the weights (target.weight_reading says RANK0_READS: FSDP2
    with fsdp_cpu_ram_efficient_loading, 16-bit) and there is a process group, else None. transformers 5 reads the
    checkpoint on every rank even then (8 ranks x 70B x 4 B is 2 TB of RAM), so the other ranks load on the meta
    device here, and accelerate's FSDP2 preparation broadcasts rank 0's state dict into their shards."""
    if weight_reading(recipe, quantized)[0] != RANK0_READS:
        return None
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return None
    return dist.get_rank()


def _broadcast_buffers(model, rank: int) -> None:
    """Non-persistent buffers (rotary inv_freq) are not in the state dict FSDP broadcasts: send rank 0's (small)
    buffers to the ranks that did not read the checkpoint."""
    for _, buf in model.named_buffers():
        dist.broadcast(buf.data, src=0)  # rank 0 sends; the others receive into their (uninitialised) buffers

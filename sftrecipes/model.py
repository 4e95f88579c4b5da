"""Tokenizer, chat template, quantization, attention choice and LoRA: everything about the model a recipe
decides. The same functions load the tiny test model and meta-llama/Llama-2-70b-hf."""

from __future__ import annotations

import importlib.util
import logging

import torch

from .shape import load_dtype as load_dtype_name
from .recipe import Recipe, RecipeError

log = logging.getLogger("sftrecipes")

CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
ZEPHYR_TEMPLATE = (
    "{% for message in messages %}{{ '<|' + message['role'] + '|>\n' + message['content'] + eos_token + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)
# format -> (template, special tokens it needs, end-of-turn token: None = the tokenizer's eos)
TEMPLATES = {
    "chatml": (CHATML_TEMPLATE, ["<|im_start|>", "<|im_end|>"], "<|im_end|>"),
    "zephyr": (ZEPHYR_TEMPLATE, ["<|user|>", "<|assistant|>", "<|system|>"], None),
}
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def load_dtype(recipe: Recipe) -> torch.dtype:
    """The dtype weights are loaded in: the rule of shape.load_dtype (the planner counts with the same), as torch."""
    return DTYPES[load_dtype_name(recipe)]


# Packed rows under sdpa on a GPU: transformers builds a dense block-diagonal mask and torch's sdpa picks cuDNN
# attention, which compiles a graph per new sequence length; padding-free packing changes the length every step.
# Padding the flattened batch to a multiple of this bounds the number of shapes (docs/benchmarks.md, GPU: +44%
# tokens/s on a 1B full fine-tune on an H200, at most 255 padded tokens per step).
SDPA_PACKED_PAD = 256


def _flash_missing(recipe: Recipe, hardware: str) -> list[str]:
    missing = []
    if importlib.util.find_spec("flash_attn") is None:
        missing.append("the flash-attn package (pip install -r requirements-gpu.txt)")
    if hardware != "gpu":
        missing.append("a GPU")
    return missing


def packed_under_sdpa_on_gpu(recipe: Recipe, hardware: str) -> bool:
    """True when a GPU run packs samples (padding-free) and attends with sdpa (flash-attn not asked for or missing)."""
    packed = recipe.trl_value("packing") or recipe.trl_value("padding_free")
    flash = recipe.model.use_flash_attn and not _flash_missing(recipe, hardware)
    return hardware == "gpu" and bool(packed) and not flash


def attn_implementation(recipe: Recipe, hardware: str) -> str:
    if not recipe.model.use_flash_attn:
        return "sdpa"
    missing = _flash_missing(recipe, hardware)
    if missing:
        log.warning("use_flash_attn: falling back to sdpa: needs %s", " and ".join(missing))
        if packed_under_sdpa_on_gpu(recipe, hardware):
            log.warning("use_flash_attn: packing under sdpa attends through a dense block-diagonal mask; measured "
                        "2-3x slower per token than a plain causal step on an H200 (docs/benchmarks.md, GPU)")
        return "sdpa"
    return "flash_attention_2"


def load_tokenizer(recipe: Recipe):
    """Tokenizer with the recipe's chat template. Returns (tokenizer, end_of_turn_token, added_token_ids)."""
    from transformers import AutoTokenizer  # noqa: PLC0415

    m = recipe.model
    name = m.tokenizer_name_or_path or m.model_name_or_path
    tok = AutoTokenizer.from_pretrained(name, trust_remote_code=bool(recipe.trl_value("trust_remote_code")))
    added: list[int] = []
    fmt = m.chat_template_format
    if fmt in TEMPLATES:
        template, specials, eot = TEMPLATES[fmt]
        missing = [t for t in specials if t not in tok.get_vocab()]
        if missing:
            tok.add_special_tokens({"additional_special_tokens": missing}, replace_extra_special_tokens=False)
            added = tok.convert_tokens_to_ids(missing)
        tok.chat_template = template
        if eot is not None:
            tok.eos_token = eot
    elif fmt == "tokenizer":
        if not tok.chat_template:
            raise RecipeError(f"chat_template_format: 'tokenizer' but {name} has no chat template; use chatml or zephyr")
        eot = end_of_turn(tok)
        if eot != tok.eos_token:
            log.info("chat template: end of turn is %s; using it as the eos token so generation stops there", eot)
            tok.eos_token = eot
    if recipe.trl.get("eos_token"):
        if recipe.trl["eos_token"] not in tok.get_vocab():
            raise RecipeError(f"eos_token: '{recipe.trl['eos_token']}' is not in the tokenizer's vocabulary; pick a token it has")
        tok.eos_token = recipe.trl["eos_token"]
    if tok.pad_token is None:
        if "<pad>" not in tok.get_vocab():
            tok.add_special_tokens({"pad_token": "<pad>"})
            added.append(tok.pad_token_id)
        else:
            tok.pad_token = "<pad>"
    return tok, tok.eos_token, added


def end_of_turn(tok) -> str:
    """The special token a chat template closes an assistant turn with (e.g. <|im_end|>, <|eot_id|>), else eos."""
    sentinel = "SENTINEL-REPLY"
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}, {"role": "assistant", "content": sentinel}], tokenize=False)
    tail = text[text.rindex(sentinel) + len(sentinel):]
    specials = set(tok.all_special_tokens)
    for t in tok.convert_ids_to_tokens(tok(tail, add_special_tokens=False)["input_ids"]):
        if t in specials:
            return t
    return tok.eos_token


def quantization_config(recipe: Recipe):
    m = recipe.model
    if not (m.use_4bit_quantization or m.use_8bit_quantization):
        return None
    from transformers import BitsAndBytesConfig  # noqa: PLC0415

    if m.use_8bit_quantization:
        return BitsAndBytesConfig(load_in_8bit=True)
    storage = torch.uint8 if m.bnb_4bit_quant_storage_dtype == "uint8" else DTYPES[m.bnb_4bit_quant_storage_dtype]
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=m.bnb_4bit_quant_type,
        bnb_4bit_compute_dtype=DTYPES[m.bnb_4bit_compute_dtype],
        bnb_4bit_use_double_quant=m.use_nested_quant,
        bnb_4bit_quant_storage=storage,
    )


def load_model(recipe: Recipe, tokenizer, hardware: str):
    """The model as the recipe describes it (weights from the hub id or local folder)."""
    from transformers import AutoModelForCausalLM  # noqa: PLC0415

    m = recipe.model
    kwargs = dict(recipe.trl_value("model_init_kwargs") or {})
    kwargs.update(
        dtype=load_dtype(recipe),
        attn_implementation=attn_implementation(recipe, hardware),
        trust_remote_code=bool(recipe.trl_value("trust_remote_code")),
    )
    qc = quantization_config(recipe)
    if qc is not None:
        kwargs["quantization_config"] = qc
    rank = ram_efficient_rank(recipe, quantized=qc is not None)
    if rank:  # not rank 0: build on the meta device, read nothing; FSDP receives rank 0's weights when it wraps
        kwargs["device_map"] = "meta"
    model = AutoModelForCausalLM.from_pretrained(m.model_name_or_path, **kwargs)
    if rank:
        # Real but untouched storage: accelerate maps optimizer params to their shards by data_ptr, which is 0 for
        # every meta tensor. Large torch.empty blocks are lazily mapped pages, so this costs address space, not RAM.
        model.to_empty(device="cpu")
        # a device map makes the Trainer treat the model as spread over devices (is_model_parallel), which it is not
        model.__dict__.pop("hf_device_map", None)
    if rank is not None:
        _broadcast_buffers(model, rank)
    if len(tokenizer) > model.get_input_embeddings().weight.shape[0]:
        # exact size: every new row is then one of the added tokens, trained and saved (see lora_config). The new rows
        # are drawn from the model's init under the recipe's seed, so every rank draws the same rows (sharded
        # backends keep each rank's own draw for its shard) and a run starts alike at any world size.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(int(recipe.trl_value("seed") or 0))
            model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    model.config.pad_token_id = tokenizer.pad_token_id
    if tokenizer.eos_token_id is not None:
        gen = model.generation_config
        eos = gen.eos_token_id if isinstance(gen.eos_token_id, list) else [gen.eos_token_id] if gen.eos_token_id is not None else []
        if tokenizer.eos_token_id not in eos:
            gen.eos_token_id = [tokenizer.eos_token_id, *eos]
    # No KV cache while training: with a cache, transformers skips its packed-sequence detection and packed samples
    # would attend to each other under sdpa/eager (tests/test_data.py shows it). Generation turns it back on.
    model.config.use_cache = False
    return model


def ram_efficient_rank(recipe: Recipe, quantized: bool) -> int | None:
    """This process's rank when only rank 0 should read the weights (FSDP2 with fsdp_cpu_ram_efficient_loading and
    a process group), else None. transformers 5 reads the checkpoint on every rank even then (8 ranks x 70B x 4 B is
    2 TB of RAM), so the other ranks load on the meta device here, and accelerate's FSDP2 preparation broadcasts
    rank 0's state dict into their shards. 4-bit models are excluded, as accelerate excludes them."""
    import torch.distributed as dist  # noqa: PLC0415

    L = recipe.launch
    if not (L.backend == "fsdp" and L.fsdp_version == 2 and L.fsdp_cpu_ram_efficient_loading and not quantized):
        return None
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return None
    return dist.get_rank()


def _broadcast_buffers(model, rank: int) -> None:
    """Non-persistent buffers (rotary inv_freq) are not in the state dict FSDP broadcasts: send rank 0's (small)
    buffers to the ranks that did not read the checkpoint."""
    import torch.distributed as dist  # noqa: PLC0415

    for _, buf in model.named_buffers():
        dist.broadcast(buf.data, src=0)  # rank 0 sends; the others receive into their (uninitialised) buffers


def lora_config(recipe: Recipe, added_tokens: list[int], model=None):
    m = recipe.model
    if not m.use_peft_lora:
        return None
    from peft import LoraConfig  # noqa: PLC0415

    targets = m.lora_target_modules.strip()
    target_modules = targets if targets == "all-linear" else [t.strip() for t in targets.split(",") if t.strip()]
    kwargs = {}
    if added_tokens:
        # New special tokens start with random rows: train just those rows (input and output embeddings), not the
        # whole matrices. PEFT then saves the resized embeddings with the adapter, so it merges on its own.
        rows = sorted(set(added_tokens))
        kwargs["trainable_token_indices"] = {"embed_tokens": rows}
        if model is None or not model.config.get_text_config().tie_word_embeddings:
            kwargs["trainable_token_indices"]["lm_head"] = rows
    return LoraConfig(r=m.lora_r, lora_alpha=m.lora_alpha, lora_dropout=m.lora_dropout, target_modules=target_modules,
                      bias="none", task_type="CAUSAL_LM", **kwargs)

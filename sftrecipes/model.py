"""Tokenizer, chat template, quantization, attention choice and LoRA: everything about the model a recipe
decides. The same functions load the tiny test model and meta-llama/Llama-2-70b-hf."""

from __future__ import annotations

import importlib.util
import logging
import os
import re
import types

import torch

from .shape import load_dtype as load_dtype_name
from .errors import RecipeError
from .recipe import Recipe
from .schema import DTYPES as DTYPE_NAMES

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
DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}  # the one name -> torch dtype map (export uses it too)


def load_dtype(recipe: Recipe) -> torch.dtype:
    """The dtype weights are loaded in: the rule of shape.load_dtype (the planner counts with the same), as torch."""
    return DTYPES[load_dtype_name(recipe)]


# Packed rows under sdpa on a GPU: transformers builds a dense block-diagonal mask and torch's sdpa picks cuDNN
# attention, which compiles a graph per new sequence length; padding-free packing changes the length every step.
# Padding the flattened batch to a multiple of this bounds the number of shapes (docs/benchmarks.md, GPU: +44%
# tokens/s on a 1B full fine-tune on an H200, at most 255 padded tokens per step).
SDPA_PACKED_PAD = 256
VARLEN = "sft_varlen"  # attention.NAME: the project's varlen kernel (attention.py registers it when a model loads)


def flash_attn_installed() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


def _flash_missing(recipe: Recipe, hardware: str) -> list[str]:
    missing = []
    if not flash_attn_installed():
        missing.append("the flash-attn package (pip install -r requirements-gpu.txt)")
    if hardware != "gpu":
        missing.append("a GPU")
    return missing


def requested_attention(recipe: Recipe) -> str:
    """The recipe's attention request: attn_implementation, with the PEFT guide's use_flash_attn as an alias of
    flash_attention_2 (recipe validation refuses the two disagreeing)."""
    m = recipe.model
    return "flash_attention_2" if m.use_flash_attn and m.attn_implementation == "auto" else m.attn_implementation


def attention_support(recipe: Recipe) -> tuple[str, dict[str, bool]] | None:
    """(model class name, {kernel: supported, "softcap": the config soft-caps attention logits}) from the model's config
    class, without loading weights; None when the class is unknown here (remote code, or no config reachable): transformers then decides at load time."""
    try:
        from transformers import AutoConfig  # noqa: PLC0415
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING  # noqa: PLC0415

        name = recipe.model.model_name_or_path
        try:
            cfg = AutoConfig.from_pretrained(name, trust_remote_code=bool(recipe.trl_value("trust_remote_code")))
        except (OSError, ValueError):  # a hub id offline: the planner's shipped config of it
            from .shape import read_config  # noqa: PLC0415

            cfg = AutoConfig.for_model(**read_config(name))
        cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(cfg)]
        softcap = getattr(cfg.get_text_config(), "attn_logit_softcapping", None)
        return cls.__name__, {"eager": True, "sdpa": bool(cls._supports_sdpa), "flash_attention_2": bool(cls._supports_flash_attn),
                              "flex_attention": bool(cls._supports_flex_attn),
                              # attention.py's kernel: any model whose attention goes through transformers' interface,
                              # but no logit soft-capping (Gemma-2)
                              VARLEN: bool(cls._supports_attention_backend) and softcap is None, "softcap": softcap is not None}
    except Exception:  # noqa: BLE001 - any failure here only means "unknown": loading will say what is wrong
        return None


def _sixteen_bit(recipe: Recipe) -> bool:
    return load_dtype(recipe) != torch.float32 or bool(recipe.trl_value("bf16") or recipe.trl_value("fp16"))


def packed(recipe: Recipe) -> bool:
    """Whether batches reach the model as packed rows (TRL's padding-free packing)."""
    return bool(recipe.trl_value("packing") or recipe.trl_value("padding_free"))


def choose_attention(recipe: Recipe, hardware: str, support=None) -> tuple[str, str]:
    """(attention kernel, why) for this recipe on this hardware; RecipeError for a choice the model or device cannot run.

    auto: flash_attention_2 where the flash-attn package, a GPU, 16-bit compute and the model allow it; else, for
    packed batches, sft_varlen (attention.py: each sample attends within itself, no dense mask); else sdpa where the
    model supports it; else eager (Gemma-2: its soft-capping has neither an sdpa nor an sft_varlen path). An explicit
    flash_attention_2 (or use_flash_attn) without the package or a GPU, or an explicit sft_varlen on a soft-capping
    model, falls back to the auto choice (the caller warns)."""
    want = requested_attention(recipe)
    cls, sup = support or attention_support(recipe) or ("the model", None)

    def ok(impl: str) -> bool:
        return sup is None or sup.get(impl, False)

    def auto() -> tuple[str, str]:
        if ok("flash_attention_2") and sup is not None and not _flash_missing(recipe, hardware) and _sixteen_bit(recipe):
            return "flash_attention_2", "auto: flash-attn, a GPU and 16-bit compute are present"
        if packed(recipe) and ok(VARLEN):
            return VARLEN, "auto: packed batches attend per sample; flash_attention_2 does not run here"
        if ok("sdpa"):
            return "sdpa", "auto"
        if packed(recipe) and sup is not None and sup.get("softcap"):
            return "eager", f"auto: {cls}'s attention logit soft-capping (attn_logit_softcapping) has no sdpa or {VARLEN} path"
        return "eager", f"auto: {cls} has no sdpa support"

    alternatives = ", ".join(k for k in ("sdpa", "eager", "flash_attention_2", "flex_attention", VARLEN) if ok(k) and k != want)
    if want == VARLEN and sup is not None and sup.get("softcap"):  # not servable: the auto choice, warned
        impl, _ = auto()
        return impl, f"fallback: {VARLEN} cannot apply {cls}'s attention logit soft-capping (attn_logit_softcapping)"
    if want != "auto" and not ok(want):
        key = "use_flash_attn" if recipe.model.use_flash_attn and recipe.model.attn_implementation == "auto" else "attn_implementation"
        raise RecipeError(f"{key}: {cls} does not support {want}; use attn_implementation: auto (or one of {alternatives})")
    if want == "auto":
        return auto()
    if want == "flash_attention_2":
        missing = _flash_missing(recipe, hardware)
        if missing:
            impl, _ = auto()
            return impl, "fallback: flash_attention_2 needs " + " and ".join(missing)
        if not _sixteen_bit(recipe):
            raise RecipeError("attn_implementation: flash_attention_2 computes in bf16/fp16 only; set bf16: true (or use sdpa)")
    if want == "flex_attention" and hardware == "cpu":
        raise RecipeError(f"attn_implementation: flex_attention has no backward pass on CPU (torch {torch.__version__}); use auto or one of {alternatives}")
    return want, "recipe"


def packed_under_sdpa_on_gpu(recipe: Recipe, hardware: str) -> bool:
    """True when a GPU run packs samples (padding-free) and attends with sdpa (flash-attn not asked for or missing)."""
    return hardware == "gpu" and packed(recipe) and choose_attention(recipe, hardware)[0] == "sdpa"


def attn_implementation(recipe: Recipe, hardware: str) -> str:
    """choose_attention, logged (with the warnings a fallback deserves)."""
    impl, why = choose_attention(recipe, hardware)
    log_attention(recipe, hardware, impl, why)
    return impl


def log_attention(recipe: Recipe, hardware: str, ran: str, why: str) -> None:
    """The run's "attention: ..." line: the kernel that runs (load_model passes the loaded model's own
    config._attn_implementation) and why; a fallback is one warning line naming what was asked and why not."""
    if why.startswith("fallback"):
        key = "use_flash_attn" if recipe.model.use_flash_attn else "attn_implementation"
        log.warning("attention: %s (%s: falling back to %s: %s)", ran, key, ran, why.removeprefix("fallback: "))
    else:
        log.info("attention: %s (%s)", ran, why)
    if ran == "sdpa" and packed_under_sdpa_on_gpu(recipe, hardware):
        log.warning("attention: packing under sdpa attends through a dense block-diagonal mask; measured 2-3x slower per "
                    "token than a plain causal step on an H200 (docs/benchmarks.md, GPU); attn_implementation: %s "
                    "attends per sample", VARLEN)


# Files a tokenizer can load from (a fast tokenizer's tokenizer.json, a SentencePiece/tiktoken model, BPE or WordPiece
# vocabularies); a folder with none of them makes transformers suggest installing sentencepiece.
TOKENIZER_SOURCES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model", "*.tiktoken", "sentencepiece*.model")


def check_model_files(recipe: Recipe) -> None:
    """Before anything is prepared: a local tokenizer folder holds tokenizer files, and a local model folder's
    safetensors files are whole (as long as their headers say; listed shards present). A RecipeError names the folder
    or file and what is missing, where the loaders would say "install sentencepiece" or "incomplete metadata"."""
    import json  # noqa: PLC0415
    from pathlib import Path  # noqa: PLC0415

    m = recipe.model
    key = "tokenizer_name_or_path" if m.tokenizer_name_or_path else "model_name_or_path"
    tok = Path(m.tokenizer_name_or_path or m.model_name_or_path).expanduser()
    if tok.is_dir() and not any(any(tok.glob(pattern)) for pattern in TOKENIZER_SOURCES):
        raise RecipeError(f"{key}: {tok} has no tokenizer files (none of tokenizer.json, tokenizer.model, vocab.json + "
                          "merges.txt); copy them from the model it came from (checkpoints and some exports lack them), or set "
                          "tokenizer_name_or_path to a folder or hub id that has them")
    folder = Path(m.model_name_or_path).expanduser()
    if not folder.is_dir():
        return
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            files = [folder / n for n in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
        except (ValueError, KeyError, TypeError):
            raise RecipeError(f"model_name_or_path: {index} is unreadable (no weight_map); copy it again from the model") from None
    else:
        files = sorted(folder.glob("*.safetensors"))
    for f in files:
        if not f.is_file():
            raise RecipeError(f"model_name_or_path: {f.name} is listed in {index.name} but missing from {folder}; copy it there")
        size, want = f.stat().st_size, safetensors_length(f)
        if want is None:
            raise RecipeError(f"model_name_or_path: {f} is not a readable safetensors file ({size:,} bytes; its header is cut "
                              "or damaged); copy it again")
        if size != want:
            what = "truncated" if size < want else "longer than its header describes"
            raise RecipeError(f"model_name_or_path: {f} is {what}: {size:,} bytes, its header says {want:,}; copy it again "
                              "(a download or copy did not finish)")


def safetensors_length(path) -> int | None:
    """The length a safetensors file must have (8 + header + the end of its last tensor), from its header; None when
    the header itself cannot be read."""
    import json  # noqa: PLC0415

    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return None
        n = int.from_bytes(head, "little")
        if n > 100 * 2**20:  # no real header is that large: the file is not safetensors
            return None
        try:
            header = json.loads(f.read(n))
            return 8 + n + max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
        except (ValueError, KeyError, TypeError, AttributeError):
            return None


PAD_CANDIDATES = ("<pad>", "<|finetune_right_pad_id|>", "<|pad|>")  # existing pad-like tokens (Llama-3.1 ships the 2nd)


def load_tokenizer(recipe: Recipe):
    """Tokenizer with the recipe's chat template. Returns (tokenizer, end_of_turn, added_token_ids): end_of_turn is the
    token (or, rarely, the text) that closes an assistant turn; when it is a token, it becomes the eos token so
    training data and generation agree, and load_model puts it (with the original eos) into the generation config."""
    from transformers import AutoTokenizer  # noqa: PLC0415

    m = recipe.model
    name = m.tokenizer_name_or_path or m.model_name_or_path
    tok = AutoTokenizer.from_pretrained(name, trust_remote_code=bool(recipe.trl_value("trust_remote_code")))
    original_eos = tok.eos_token
    added: list[int] = []
    fmt = m.chat_template_format
    if fmt in TEMPLATES:
        template, specials, _ = TEMPLATES[fmt]
        missing = [t for t in specials if t not in tok.get_vocab()]
        if missing:
            tok.add_special_tokens({"additional_special_tokens": missing}, replace_extra_special_tokens=False)
            added = tok.convert_tokens_to_ids(missing)
        tok.chat_template = template
    elif fmt == "tokenizer" and recipe.trl.get("chat_template_path"):  # the file's template, for the data and the save
        with open(recipe.trl["chat_template_path"], encoding="utf-8") as f:
            tok.chat_template = f.read()
        log.info("chat template: %s", recipe.trl["chat_template_path"])
    elif fmt == "tokenizer" and not tok.chat_template:
        raise RecipeError(f"chat_template_format: 'tokenizer' but {name} has no chat template; use chatml or zephyr")
    eot, kind = None, "none"
    if fmt != "none":
        eot, kind = end_of_turn(tok)
        if kind == "none":
            log.warning("chat template: assistant turns end with no token; generation stops only at eos (%s), which the "
                        "formatted data does not contain: set append_concat_token: true or use a template that closes turns", tok.eos_token)
        elif kind == "text":
            log.warning("chat template: assistant turns end with the text %r, not one token; generation stops on it only through "
                        "the saved generation config's stop_strings (passed to generate with the tokenizer)", eot)
        else:
            if eot != tok.eos_token:
                tok.eos_token = eot
            log.info("chat template: end of turn is %s (%s); eos token: %s%s", eot, kind, eot,
                     f" (was {original_eos})" if original_eos not in (None, eot) else "")
    if recipe.trl.get("eos_token"):
        if recipe.trl["eos_token"] not in tok.get_vocab():
            raise RecipeError(f"eos_token: '{recipe.trl['eos_token']}' is not in the tokenizer's vocabulary; pick a token it has")
        tok.eos_token = recipe.trl["eos_token"]
    if tok.pad_token is None:
        vocab = tok.get_vocab()
        have = next((t for t in PAD_CANDIDATES if t in vocab), None)
        if have is None:
            tok.add_special_tokens({"pad_token": "<pad>"})
            added.append(tok.pad_token_id)
        else:
            tok.pad_token = have
    # what generation must stop on (set_generation_stop): eos as now set, then the original eos; a textual end of turn
    stop_ids = [i for i in (tok.eos_token_id, tok.convert_tokens_to_ids(original_eos) if original_eos else None) if i is not None]
    tok._sftrecipes_stop = (list(dict.fromkeys(stop_ids)), [eot] if kind == "text" else [])
    return tok, tok.eos_token if kind == "none" or recipe.trl.get("eos_token") else eot, added


SENTINELS = ("SENTINEL-ONE", "SENTINEL-TWO")


def end_of_turn(tok) -> tuple[str | None, str]:
    """What a chat template closes an assistant turn with, and what kind of thing it is: ('<|eot_id|>', 'added token')
    for a special token the tokenizer does not list (Llama-3), 'special token' (<|im_end|>, <end_of_turn>, </s>),
    'token' (one ordinary vocabulary entry), 'text' (several tokens), or (None, 'none').

    The same assistant turn is rendered twice: last in the conversation, and followed by another user turn. What both
    renderings put right after its content is the turn's closing text (Phi-3 appends eos after the last turn only; a
    closing newline belongs to the turn); its first special token, else the text itself, is the end of turn."""
    one, two = SENTINELS
    turn = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": one}]
    last = tok.apply_chat_template(turn, tokenize=False)
    more = tok.apply_chat_template(turn + [{"role": "user", "content": "again"}, {"role": "assistant", "content": two}], tokenize=False)
    after_last, after_more = (t[t.index(one) + len(one):] for t in (last, more))
    closing = os.path.commonprefix([after_last, after_more])
    ids = tok(closing, add_special_tokens=False)["input_ids"]
    listed = set(tok.all_special_ids)
    special_added = {i for i, t in tok.added_tokens_decoder.items() if t.special}
    for i in ids:
        if i in listed:
            return tok.convert_ids_to_tokens(i), "special token"
        if i in special_added:
            return tok.convert_ids_to_tokens(i), "added token"
    text = closing.strip()
    if not text:
        return None, "none"
    if text in tok.get_vocab():
        return text, "token"
    return text, "text"


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
    kwargs = dict(recipe.trl_value("model_init_kwargs") or {})  # recipe validation took out what the recipe owns
    impl, why = choose_attention(recipe, hardware)
    if impl == VARLEN:
        from .attention import register  # noqa: PLC0415

        register()
    kwargs.update(
        dtype=load_dtype(recipe),
        attn_implementation=impl,
        trust_remote_code=bool(recipe.trl_value("trust_remote_code")),
    )
    qc = quantization_config(recipe)
    if qc is not None:
        kwargs["quantization_config"] = qc
    rank = ram_efficient_rank(recipe, quantized=qc is not None)
    if rank:  # not rank 0: build on the meta device, read nothing; FSDP receives rank 0's weights when it wraps
        kwargs["device_map"] = "meta"
    model = AutoModelForCausalLM.from_pretrained(m.model_name_or_path, **kwargs)
    log_attention(recipe, hardware, model.config._attn_implementation, why)  # what the loaded model really runs
    if rank:
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
    if len(tokenizer) > model.get_input_embeddings().weight.shape[0]:
        # exact size: every new row is then one of the added tokens, trained and saved (see lora_config). The new rows
        # are drawn from the model's init under the recipe's seed, so every rank draws the same rows (sharded
        # backends keep each rank's own draw for its shard) and a run starts alike at any world size.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(int(recipe.trl_value("seed") or 0))
            model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    model.config.pad_token_id = tokenizer.pad_token_id
    set_generation_stop(model.generation_config, tokenizer)
    # No KV cache while training: with a cache, transformers skips its packed-sequence detection and packed samples
    # would attend to each other under sdpa/eager (tests/test_data.py shows it). Generation turns it back on.
    model.config.use_cache = False
    return model


def set_generation_stop(gen, tokenizer) -> list[int]:
    """Generation stops at the end of turn and at eos: the ids load_tokenizer recorded (end of turn, original eos)
    before the model's own eos ids; a multi-token textual end of turn goes to stop_strings. Returns the eos ids."""
    ids, texts = getattr(tokenizer, "_sftrecipes_stop", ([tokenizer.eos_token_id], []))
    own = gen.eos_token_id if isinstance(gen.eos_token_id, list) else [gen.eos_token_id] if gen.eos_token_id is not None else []
    ids = list(dict.fromkeys([i for i in ids if i is not None] + own))
    gen.eos_token_id = ids if len(ids) > 1 else (ids[0] if ids else None)
    if texts:
        gen.stop_strings = texts
    return ids


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


# ------------------------------------------------------------------------------------------------------------ LoRA
# transformers 5 fuses the experts of a mixture-of-experts layer into 3-D parameters (mlp.experts.gate_up_proj
# [E, 2*inter, hidden], mlp.experts.down_proj [E, hidden, inter]) behind a router (mlp.gate, [E, hidden]). peft adapts
# such parameters with its ParamWrapper (target_parameters), which allows no dropout and no DoRA (recipe.validate
# refuses both before loading). A target list may name the fused tensors, or the projections they were fused from:
EXPERT_ALIASES = {"gate_proj": "gate_up_proj", "up_proj": "gate_up_proj", "w1": "gate_up_proj", "w3": "gate_up_proj", "w2": "down_proj"}
FUSED_FROM = {"gate_up_proj": (("gate_proj", "up_proj"), ("w1", "w3"))}  # two projections in one tensor: rank and alpha x2


def _clean(name: str) -> str:
    """A parameter or module name without peft's wrapper segments (the name it has in the base model)."""
    return re.sub(r"\.base_layer(?=\.|$)", "", name.removeprefix("base_model.model."))


def moe_layout(model) -> tuple[dict[str, tuple[int, ...]], dict[str, bool]]:
    """(expert parameters: name -> [E, ., .] shape, routers: module name -> is an nn.Linear) of a model, by structure:
    experts are the 3-D parameters; a router is a sibling module of the experts' module whose own 2-D parameter has E
    rows. Names as in the base model (peft's wrappers looked through); shapes also under ZeRO-3 partitioning."""
    params = {}
    for n, p in model.named_parameters():
        if not any(mark in n for mark in ("lora_", ".modules_to_save.", ".original_module.", ".token_adapter.")):
            params[_clean(n)] = tuple(getattr(p, "ds_shape", p.shape))
    experts = {n: s for n, s in params.items() if len(s) == 3}
    routers: dict[str, bool] = {}
    for container in {n.rpartition(".")[0] for n in experts}:
        e = next(s[0] for n, s in experts.items() if n.rpartition(".")[0] == container)
        block = container.rpartition(".")[0]
        for n, s in params.items():
            module = n.rpartition(".")[0]
            if module != container and module.rpartition(".")[0] == block and len(s) == 2 and s[0] == e:
                try:
                    routers[module] = isinstance(model.get_submodule(module), torch.nn.Linear)
                except AttributeError:  # a peft model: the path runs through wrappers
                    routers[module] = False
    return experts, routers


def pattern_value(pattern: dict | None, key: str, default: int) -> int:
    """peft's rank_pattern/alpha_pattern lookup (peft.utils.other.get_pattern_key): the first key, in order, that
    matches the end of `key` at a dot boundary, as a regex. `key` is the module's name in the base model (a targeted
    parameter's own name for peft's parameter targets)."""
    for k, v in (pattern or {}).items():
        if re.match(rf"(.*\.)?({k})$", key):
            return v
    return default


def lora_targets(recipe: Recipe, model) -> dict:
    """target_modules, target_parameters, rank_pattern and alpha_pattern for LoraConfig, resolved on the model.

    Dense models: lora_target_modules as given ('all-linear': every linear layer but the output head, as peft reads
    it), each listed name checked to exist.
    Mixture-of-experts models: 'all-linear' adapts every linear layer but the router, and the fused expert tensors (as
    peft does under all-linear: gate_up_proj at rank 2r and alpha 2*alpha, i.e. r per projection; user rank/alpha
    patterns are merged, and one matching gate_up_proj is doubled the same way). A list may name linear layers, the
    expert tensors (gate_up_proj, down_proj) or the projections fused into them (gate_proj+up_proj, w1+w3, w2: the
    expert tensors). The router is adapted only with lora_target_router: true, never by naming it. layers_to_transform,
    layers_pattern, exclude_modules and modules_to_save also select among expert parameters (peft applies them to
    modules only), by passing the selected parameters by full name."""
    from peft.tuners.tuners_utils import check_target_module_exists  # noqa: PLC0415

    m, p = recipe.model, recipe.peft
    spec = m.lora_target_modules.strip()
    listed = None if spec == "all-linear" else list(dict.fromkeys(t.strip() for t in spec.split(",") if t.strip()))
    experts, routers = moe_layout(model)
    out_emb = model.get_output_embeddings()
    modules = {n: mod for n, mod in model.named_modules() if n}
    linear = [n for n, mod in modules.items() if isinstance(mod, torch.nn.Linear) and mod is not out_emb]

    def hits(t: str, names) -> list[str]:
        return [n for n in names if n == t or n.endswith("." + t)]

    params: list[str] = []
    if not experts:
        # all-linear resolved to the layers' names here, not by peft: peft's resolution (full names) would bypass
        # layers_to_transform, which it applies only to names it matches by suffix
        target_modules: list[str] = sorted({n.rsplit(".", 1)[-1] for n in linear}) if listed is None else listed
        for t in listed or []:
            if not hits(t, modules):
                raise RecipeError(f"lora_target_modules: '{t}' matches no module of {m.model_name_or_path}; "
                                  f"its linear layers are {', '.join(sorted({n.rsplit('.', 1)[-1] for n in linear}))}")
    else:
        expert_leaves = {n.rsplit(".", 1)[-1] for n in experts}
        router_leaves = {r.rsplit(".", 1)[-1] for r in routers}
        if listed is None:
            target_modules = sorted({n.rsplit(".", 1)[-1] for n in linear if n not in routers})
            params = sorted(expert_leaves)
        else:
            target_modules, aliases = [], set()
            for t in listed:
                if hits(t, routers) or t in router_leaves:
                    raise RecipeError(f"lora_target_modules: '{t}' is the router of this mixture-of-experts model; remove it and set lora_target_router: true")
                leaf = t.rsplit(".", 1)[-1]
                module_hits = hits(t, [n for n in modules if n not in routers])
                if module_hits:
                    target_modules.append(t)
                if hits(t, experts):
                    params.append(t)
                elif not module_hits and EXPERT_ALIASES.get(leaf) in expert_leaves:
                    aliases.add(leaf)
                    params.append(EXPERT_ALIASES[leaf])
                elif not module_hits:
                    raise RecipeError(f"lora_target_modules: '{t}' matches no module or expert parameter of {m.model_name_or_path}; "
                                      f"its linear layers are {', '.join(sorted({n.rsplit('.', 1)[-1] for n in linear} - router_leaves))}, "
                                      f"its expert parameters {', '.join(sorted(expert_leaves))}")
            for fused, groups in FUSED_FROM.items():
                for group in groups:
                    have = aliases & set(group)
                    if have and have != set(group):
                        raise RecipeError(f"lora_target_modules: {' and '.join(group)} are one tensor ({fused}) in this model; list both, or {fused}")
        if m.lora_target_router:
            for r, is_linear in sorted(routers.items()):
                leaf = r.rsplit(".", 1)[-1]
                if is_linear:
                    target_modules.append(leaf)
                else:
                    params.append(f"{leaf}.weight")
        target_modules = list(dict.fromkeys(target_modules))
    params = list(dict.fromkeys(params + list(p.get("target_parameters") or [])))

    # the parameters these names select, as peft would match them, narrowed as peft narrows modules
    names = [n for n, _ in model.named_parameters()] if params else []
    names = [_clean(n) for n in names if "lora_" not in n]
    selected = [n for n in names if hits_any(n, params)]
    for t in p.get("target_parameters") or []:
        if not any(hits_any(n, [t]) for n in names):
            raise RecipeError(f"target_parameters: '{t}' matches no parameter of {m.model_name_or_path}; give a parameter's "
                              "name or its dotted end, e.g. mlp.down_proj.weight")
    narrowing = p.get("layers_to_transform") is not None or p.get("exclude_modules") or p.get("modules_to_save")
    if selected and narrowing:
        probe = types.SimpleNamespace(exclude_modules=p.get("exclude_modules"), modules_to_save=p.get("modules_to_save"),
                                      target_modules=[n.rsplit(".", 1)[-1] for n in selected], target_parameters=None,
                                      layers_to_transform=p.get("layers_to_transform"), layers_pattern=p.get("layers_pattern"))
        module_probe = types.SimpleNamespace(**{**vars(probe), "target_modules": [n.rpartition(".")[0] for n in selected]})
        selected = [n for n in selected if check_target_module_exists(probe, n) is True
                    and check_target_module_exists(module_probe, n.rpartition(".")[0]) is True]
        params = selected
    if params and (m.lora_dropout or p.get("use_dora")):  # validation.validate catches these when config.json is at hand
        key = "lora_dropout" if m.lora_dropout else "use_dora"
        raise RecipeError(f"{key}: {getattr(m, key, p.get(key))} cannot apply to the parameters LoRA adapts here ({', '.join(params[:3])}): "
                          f"peft's parameter wrapper has no dropout and no DoRA; set {key}: {'0.0' if key == 'lora_dropout' else 'false'}")
    adapted = {n for n in modules if hits_any(n, target_modules)}
    for n in selected:
        if n.rpartition(".")[0] in adapted:
            raise RecipeError(f"target_parameters: '{n}' belongs to a module lora_target_modules also adapts; adapt it one way: remove it from one of the two")

    # ranks and alphas: the fused gate/up tensor gets twice the rank and alpha that apply to it (its own pattern, or r)
    rank_pattern, alpha_pattern = dict(p.get("rank_pattern") or {}), dict(p.get("alpha_pattern") or {})
    fused = {n: (2 * pattern_value(rank_pattern, n, m.lora_r), 2 * pattern_value(alpha_pattern, n, m.lora_alpha))
             for n in selected if n.rsplit(".", 1)[-1] in FUSED_FROM}
    if fused:
        keys = ({r".*\.gate_up_proj": next(iter(fused.values()))} if len(set(fused.values())) == 1
                else {re.escape(n): v for n, v in fused.items()})
        # peft takes the first pattern that matches: the fused tensor's own keys go first
        rank_pattern = {**{k: v[0] for k, v in keys.items()}, **{k: v for k, v in rank_pattern.items() if k not in keys}}
        alpha_pattern = {**{k: v[1] for k, v in keys.items()}, **{k: v for k, v in alpha_pattern.items() if k not in keys}}
    return {"target_modules": target_modules, "target_parameters": params or None,
            "rank_pattern": rank_pattern, "alpha_pattern": alpha_pattern}


def hits_any(name: str, targets: list[str]) -> bool:
    """peft's target_parameters match: the full name, or a dotted suffix of it."""
    return any(name == t or name.endswith("." + t) for t in targets)


def lora_config(recipe: Recipe, added_tokens: list[int], model=None):
    """peft's LoraConfig for the recipe: the project's LoRA keys, the recipe's peft keys (recipe.peft) as given, the
    targets resolved on `model` (lora_targets; without a model, lora_target_modules as written), and the rows of
    tokens a chat template added."""
    m = recipe.model
    if not m.use_peft_lora:
        return None
    from peft import LoraConfig  # noqa: PLC0415

    kwargs = dict(recipe.peft)
    if model is not None:
        kwargs.update(lora_targets(recipe, model))
    else:
        targets = m.lora_target_modules.strip()
        kwargs["target_modules"] = targets if targets == "all-linear" else [t.strip() for t in targets.split(",") if t.strip()]
    if added_tokens:
        # New special tokens start with random rows: train just those rows (input and output embeddings), not the
        # whole matrices. PEFT then saves the resized embeddings with the adapter, so it merges on its own. A matrix
        # the recipe trains whole (modules_to_save) already holds its new rows.
        rows = sorted(set(added_tokens))
        whole = set(recipe.peft.get("modules_to_save") or [])
        heads = ["embed_tokens"]
        if model is None or not model.config.get_text_config().tie_word_embeddings:
            heads.append("lm_head")
        kwargs["trainable_token_indices"] = {h: rows for h in heads if h not in whole} or None
    kwargs.setdefault("bias", "none")
    return LoraConfig(r=m.lora_r, lora_alpha=m.lora_alpha, lora_dropout=m.lora_dropout, task_type="CAUSAL_LM", **kwargs)


def describe_adapter(model, recipe: Recipe) -> str:
    """One line on what LoRA adapted in the peft model the trainer built: linear modules, expert parameters (with
    their rank), the router or not, and the trainable parameter count."""
    from peft.tuners.lora import LoraLayer, ParamWrapper  # noqa: PLC0415

    experts, routers = moe_layout(model)
    mods: dict[str, set] = {}
    params: dict[str, set] = {}
    router: dict[str, set] = {}
    for name, module in model.named_modules():
        if not isinstance(module, LoraLayer) or not module.r:
            continue
        ranks = set(module.r.values())
        if isinstance(module, ParamWrapper):
            target = f"{_clean(name)}.{module.parameter_name}"
            owner = target.rpartition(".")[0]
            short = ".".join(target.split(".")[-2:]) if target not in experts else target.rsplit(".", 1)[-1]
            (router if owner in routers else params).setdefault(short, set()).update(ranks)
        else:
            (router if _clean(name) in routers else mods).setdefault(name.rsplit(".", 1)[-1], set()).update(ranks)

    def fmt(d: dict) -> str:
        return ", ".join(f"{k} (r {'/'.join(map(str, sorted(v)))})" for k, v in sorted(d.items()))

    trainable, total = model.get_nb_trainable_parameters()
    parts = [f"LoRA adapts modules {fmt(mods) or 'none'}"]
    if params:
        parts.append(f"{'expert parameters' if experts else 'parameters'} {fmt(params)}")
    if routers:
        parts.append(f"router {fmt(router) if router else 'not adapted'} (lora_target_router: {str(recipe.model.lora_target_router).lower()})")
    parts.append(f"{trainable:,} trainable parameters of {total:,} ({100 * trainable / max(total, 1):.2f}%)")
    return "; ".join(parts)

"""Offline stand-ins for the hub: a small chat dataset (shipped in data/) and tiny random-init models with locally
trained tokenizers (built into .assets/, ignored by git). Both are deterministic, so tests can compare exact
numbers. They are loaded by exactly the code that loads meta-llama/Llama-2-70b-hf: only the recipe differs.

    python -m sftrecipes tiny                     # build .assets/tiny-llama if missing
    python -m sftrecipes tiny --family qwen3      # .assets/tiny-qwen3: that family's architecture, tokenizer, template
    python -m sftrecipes tiny --data              # rewrite data/tiny_chat/*.jsonl (checked in; a test compares)

The families (FAMILIES) are built from transformers' config classes with the traits that break recipes written
for Llama-2: tied embeddings, head_dim != hidden/heads, q/k norms, qkv biases, soft-capping, sliding windows, fused
projections, mixtures of experts; and each tokenizer carries its family's special tokens, BOS habit and chat
template, so end-of-turn detection and double-BOS handling meet the real cases.
"""

from __future__ import annotations

import json
import random
import shutil
from dataclasses import dataclass, fields, is_dataclass
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from .paths import ASSETS, DATA_DIR

TINY_MODEL = ASSETS / "tiny-llama"

SPECIAL = ["<unk>", "<s>", "</s>", "<pad>", "<|im_start|>", "<|im_end|>"]

# Sizes of the tiny model; `size="medium"` (25.7M parameters; saved in bf16 like hub checkpoints, 51 MB, and 103 MB
# once loaded in fp32 for full fine-tuning) is big enough to see memory effects; `size="large"` (252M parameters,
# 504 MB in bf16) is the loading calibration's (bench/bench_loading.py): big enough that weights dominate each rank.
SAVE_DTYPE = {"tiny": "float32", "medium": "bfloat16", "large": "bfloat16"}
SIZES = {
    "tiny": dict(hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2),
    "medium": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4),
    "large": dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=8),
}

_CAPITALS = [("France", "Paris"), ("Japan", "Tokyo"), ("Italy", "Rome"), ("Spain", "Madrid"), ("Egypt", "Cairo"),
             ("Kenya", "Nairobi"), ("Peru", "Lima"), ("Canada", "Ottawa"), ("Norway", "Oslo"), ("Chile", "Santiago"),
             ("Greece", "Athens"), ("Poland", "Warsaw"), ("Cuba", "Havana"), ("India", "New Delhi"), ("Ghana", "Accra")]
_WORDS = ["cat", "river", "stone", "cloud", "apple", "light", "garden", "music", "paper", "window", "bread", "tiger"]
_COLORS = [("sky", "blue"), ("grass", "green"), ("snow", "white"), ("coal", "black"), ("a lemon", "yellow"),
           ("a tomato", "red"), ("an orange", "orange"), ("a plum", "purple")]
_SYSTEMS = ["You are a helpful assistant.", "You answer briefly and correctly.", "You are a friendly tutor."]


def _turn(rng: random.Random) -> tuple[str, str]:
    kind = rng.randrange(5)
    if kind == 0:
        a, b = rng.randrange(1, 50), rng.randrange(1, 50)
        return f"What is {a} plus {b}?", f"{a} plus {b} is {a + b}."
    if kind == 1:
        country, city = rng.choice(_CAPITALS)
        return f"What is the capital of {country}?", f"The capital of {country} is {city}."
    if kind == 2:
        w = rng.choice(_WORDS)
        return f"Spell the word {w} backwards.", f"The word {w} backwards is {w[::-1]}."
    if kind == 3:
        thing, color = rng.choice(_COLORS)
        return f"What color is {thing}?", f"{thing[0].upper() + thing[1:]} is {color}."
    a, b = rng.randrange(2, 10), rng.randrange(2, 10)
    return f"What is {a} times {b}?", f"{a} times {b} is {a * b}."


def make_conversations(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        messages = []
        if rng.random() < 0.3:
            messages.append({"role": "system", "content": rng.choice(_SYSTEMS)})
        for _ in range(1 if rng.random() < 0.7 else 2):
            q, a = _turn(rng)
            messages += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
        out.append({"messages": messages})
    return out


def write_dataset(out_dir: Path = DATA_DIR) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    for split, n, seed in (("train", 320, 1), ("test", 40, 2)):
        with open(out_dir / f"{split}.jsonl", "w") as f:
            for row in make_conversations(n, seed):
                f.write(json.dumps(row) + "\n")


def _corpus() -> list[str]:
    texts = []
    for split in ("train", "test"):
        for line in (DATA_DIR / f"{split}.jsonl").read_text().splitlines():
            for m in json.loads(line)["messages"]:
                texts.append(f"{m['role']}\n{m['content']}")
    return texts


def build_tokenizer(vocab_size: int = 512):
    from transformers import PreTrainedTokenizerFast  # noqa: PLC0415 - transformers: cli imports tiny (FAMILIES) and --help stays torch-free

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_corpus(), trainer=trainer)
    # Like Llama: add_special_tokens=True puts BOS in front.
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   pad_token="<pad>", additional_special_tokens=["<|im_start|>", "<|im_end|>"])
    from .tokenizer import CHATML_TEMPLATE  # noqa: PLC0415 - tokenizer imports transformers; cli stays torch-free

    fast.chat_template = CHATML_TEMPLATE
    return fast


def build_model(out: Path = TINY_MODEL, size: str = "tiny", seed: int = 0) -> Path:
    """Random-init Llama + local tokenizer, saved as a hub-style folder. Deterministic for a given seed."""
    import torch  # noqa: PLC0415 - torch: cli imports tiny (FAMILIES) and --help stays torch-free
    from transformers import LlamaConfig, LlamaForCausalLM  # noqa: PLC0415 - transformers: cli imports tiny (FAMILIES) and --help stays torch-free

    tok = build_tokenizer()
    # initializer_range 0.1 (not 0.02): a random tiny model then has output rows large enough for LoRA alone to
    # sharpen its predictions within a demo's few steps.
    cfg = LlamaConfig(vocab_size=len(tok), max_position_embeddings=1024, tie_word_embeddings=False, initializer_range=0.1,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                      **SIZES[size])
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).to(getattr(torch, SAVE_DTYPE[size]))
    tmp = out.with_name(out.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    tmp.rename(out)
    return out


def ensure_tiny_model(out: Path = TINY_MODEL, size: str = "tiny") -> Path:
    if not (out / "config.json").is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        build_model(out, size)
    return out


# ------------------------------------------------------------------------------------------------ model families


@dataclass(frozen=True)
class Family:
    """A tiny model of one architecture with its tokenizer's habits.

    config: (transformers config class name, its kwargs besides vocab and special token ids).
    bos/eos/pad: the tokenizer's special tokens (None: it has none); add_bos: the tokenizer puts BOS in front when
    asked to add special tokens (Llama, Gemma, Mistral do; Qwen does not).
    listed: extra special tokens declared in additional_special_tokens; unlisted: special added tokens that are NOT
    declared there (as Llama-3's <|eot_id|>: tokenizer.all_special_tokens does not show them).
    template: the family's chat template (the shape of the real one: its end-of-turn token, its BOS habit, its roles).
    """

    config: tuple[str, dict]
    bos: str | None
    eos: str
    pad: str | None
    add_bos: bool
    listed: tuple[str, ...]
    unlisted: tuple[str, ...]
    template: str
    end_of_turn: str  # what the template closes an assistant turn with (the tests' expectation)


_DENSE = dict(hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
_SYSTEM_INTO_FIRST_USER = (
    "{%- if messages[0]['role'] == 'system' %}{%- set first = messages[0]['content'] + '\\n\\n' %}"
    "{%- set messages = messages[1:] %}{%- else %}{%- set first = '' %}{%- endif %}"
)
LLAMA3_TEMPLATE = (
    "{{- bos_token }}{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)
QWEN_TEMPLATE = (
    "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
GEMMA_TEMPLATE = (
    "{{- bos_token }}" + _SYSTEM_INTO_FIRST_USER + "{%- for message in messages %}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{- '<start_of_turn>' + role + '\\n' + (first if loop.first else '') + message['content'] | trim + '<end_of_turn>\\n' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<start_of_turn>model\\n' }}{%- endif %}"
)
MISTRAL_TEMPLATE = (
    "{{- bos_token }}" + _SYSTEM_INTO_FIRST_USER + "{%- for message in messages %}"
    "{%- if message['role'] == 'user' %}{{- '[INST] ' + (first if loop.first else '') + message['content'] + ' [/INST]' }}"
    "{%- else %}{{- ' ' + message['content'] + eos_token }}{%- endif %}{%- endfor %}"
)
PHI3_TEMPLATE = (
    "{%- for message in messages %}{{- '<|' + message['role'] + '|>\\n' + message['content'] + '<|end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|assistant|>\\n' }}{%- else %}{{- eos_token }}{%- endif %}"
)
_QWEN_TOKENS = dict(bos=None, eos="<|im_end|>", pad="<|endoftext|>", add_bos=False, listed=("<|im_start|>", "<|im_end|>"),
                    unlisted=(), template=QWEN_TEMPLATE, end_of_turn="<|im_end|>")
_GEMMA_TOKENS = dict(bos="<bos>", eos="<eos>", pad="<pad>", add_bos=True, listed=("<start_of_turn>", "<end_of_turn>"),
                     unlisted=(), template=GEMMA_TEMPLATE, end_of_turn="<end_of_turn>")
_MISTRAL_TOKENS = dict(bos="<s>", eos="</s>", pad=None, add_bos=True, listed=("[INST]", "[/INST]"), unlisted=(),
                       template=MISTRAL_TEMPLATE, end_of_turn="</s>")

FAMILIES: dict[str, Family] = {
    # Llama-3.x: its own BOS/EOS, end of turn <|eot_id|> as an added special token the tokenizer does not list,
    # a template that writes BOS itself (double BOS with add_special_tokens), untied head, llama3 RoPE scaling
    "llama3": Family(("LlamaConfig", dict(_DENSE, tie_word_embeddings=False, rope_theta=500000.0, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 256})), bos="<|begin_of_text|>", eos="<|end_of_text|>", pad=None,
        add_bos=True, listed=(), unlisted=("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|finetune_right_pad_id|>"),
        template=LLAMA3_TEMPLATE, end_of_turn="<|eot_id|>"),
    # Qwen2/2.5 small models: tied embeddings, q/k/v biases, ChatML, no BOS
    "qwen2": Family(("Qwen2Config", dict(_DENSE, tie_word_embeddings=True)), **_QWEN_TOKENS),
    # Qwen3: tied (small sizes), head_dim 32 != 64/4, q/k RMSNorm
    "qwen3": Family(("Qwen3Config", dict(_DENSE, head_dim=32, tie_word_embeddings=True)), **_QWEN_TOKENS),
    "mistral": Family(("MistralConfig", dict(_DENSE, tie_word_embeddings=False, sliding_window=None)), **_MISTRAL_TOKENS),
    # Gemma-2: tied, attention and final-logit soft-capping, alternating sliding-window layers, no sdpa
    "gemma2": Family(("Gemma2Config", dict(_DENSE, intermediate_size=128, head_dim=16, query_pre_attn_scalar=16,
                                          sliding_window=32, attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                                          tie_word_embeddings=True)), **_GEMMA_TOKENS),
    # Gemma-3 (text): tied, head_dim 32, q/k norms, sliding-window and full layers
    "gemma3": Family(("Gemma3TextConfig", dict(_DENSE, intermediate_size=128, head_dim=32, query_pre_attn_scalar=32,
                                              sliding_window=32, layer_types=["sliding_attention", "full_attention"],
                                              tie_word_embeddings=True)), **_GEMMA_TOKENS),
    # Phi-3: fused qkv_proj and gate_up_proj; end of turn <|end|>, and the template appends eos after the last turn
    "phi3": Family(("Phi3Config", dict(_DENSE, tie_word_embeddings=False)), bos="<s>", eos="<|endoftext|>",
                   pad="<|endoftext|>", add_bos=False, listed=("<|user|>", "<|assistant|>", "<|system|>", "<|end|>"),
                   unlisted=(), template=PHI3_TEMPLATE, end_of_turn="<|end|>"),
    # MoE: fused expert tensors (3-D gate_up_proj/down_proj) behind a top-k router
    "qwen3_moe": Family(("Qwen3MoeConfig", dict(_DENSE, head_dim=32, moe_intermediate_size=32, num_experts=4,
                                               num_experts_per_tok=2, decoder_sparse_step=1, tie_word_embeddings=False)),
                        **_QWEN_TOKENS),
    "mixtral": Family(("MixtralConfig", dict(_DENSE, intermediate_size=96, num_local_experts=4, num_experts_per_tok=2,
                                            sliding_window=None, tie_word_embeddings=False)), **_MISTRAL_TOKENS),
}


def family_dir(name: str) -> Path:
    return ASSETS / f"tiny-{name}"


def build_family_tokenizer(name: str, vocab_size: int = 512):
    """A BPE tokenizer trained on the shipped chat data, with the family's special tokens and template."""
    from transformers import PreTrainedTokenizerFast  # noqa: PLC0415 - transformers: cli imports tiny (FAMILIES) and --help stays torch-free

    fam = FAMILIES[name]
    named = [t for t in ("<unk>", fam.bos, fam.eos, fam.pad) if t]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(dict.fromkeys(named + list(fam.listed))),
                                  show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_corpus(), trainer=trainer)
    if fam.unlisted:  # special added tokens, as in Llama-3's tokenizer.json, but not in additional_special_tokens
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in fam.unlisted])
    if fam.add_bos:
        tok.post_processor = processors.TemplateProcessing(single=f"{fam.bos} $A", pair=f"{fam.bos} $A {fam.bos} $B",
                                                           special_tokens=[(fam.bos, tok.token_to_id(fam.bos))])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=fam.bos, eos_token=fam.eos, unk_token="<unk>",
                                   pad_token=fam.pad, additional_special_tokens=list(fam.listed))
    fast.chat_template = fam.template
    return fast


def build_family(name: str, out: Path | None = None, seed: int = 0) -> Path:
    """Random-init tiny model of a family + its tokenizer, saved as a hub-style folder. Deterministic."""
    import torch  # noqa: PLC0415 - torch: cli imports tiny (FAMILIES) and --help stays torch-free
    import transformers  # noqa: PLC0415 - transformers: cli imports tiny (FAMILIES) and --help stays torch-free

    fam = FAMILIES[name]
    out = out or family_dir(name)
    tok = build_family_tokenizer(name)
    cls_name, kwargs = fam.config
    ids = {f"{k}_token_id": tok.convert_tokens_to_ids(v) for k, v in (("bos", fam.bos), ("eos", fam.eos), ("pad", fam.pad)) if v}
    cfg = getattr(transformers, cls_name)(vocab_size=len(tok), max_position_embeddings=1024, initializer_range=0.1,
                                          **ids, **kwargs)
    torch.manual_seed(seed)
    from transformers import AutoModelForCausalLM  # noqa: PLC0415 - transformers: cli imports tiny (FAMILIES) and --help stays torch-free

    model = AutoModelForCausalLM.from_config(cfg)
    model.generation_config.eos_token_id = cfg.eos_token_id
    tmp = out.with_name(out.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    (tmp / SPEC_FILE).write_text(_spec(name))
    if out.exists():  # an older build of a changed spec (ensure_family)
        shutil.rmtree(out)
    tmp.rename(out)
    return out


SPEC_FILE = "sftrecipes-family.txt"


def _spec(name: str) -> str:
    """What a family build is made from; a build whose recorded spec differs is rebuilt (ensure_family)."""
    return f"{name} seed 0\n{FAMILIES[name]!r}\n"


def ensure_family(name: str) -> Path:
    """.assets/tiny-<name>, built when missing or built from an older spec."""
    if name not in FAMILIES:
        raise KeyError(f"unknown family {name!r}; one of {', '.join(FAMILIES)}")
    out = family_dir(name)
    spec = out / SPEC_FILE
    if not spec.is_file() or spec.read_text() != _spec(name):
        out.parent.mkdir(parents=True, exist_ok=True)
        build_family(name, out)
    return out


# ------------------------------------------------------------------------------------------------ any architecture

# Small values for the size keys transformers' config classes use, set only where a config class has the key. The
# layers kept are one of each kind the per-layer settings tell apart (_layers_kept: sliding/full, linear/full attention,
# dense/sparse MLP, ...), and at least one dense and one sparse layer where a mixture of experts starts with dense ones.
TINY_SIZES = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  max_position_embeddings=4096, num_experts=4, num_local_experts=4, n_routed_experts=4,
                  num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=64, n_shared_experts=1,
                  first_k_dense_replace=1, n_group=1, topk_group=1, kv_lora_rank=32, q_lora_rank=32,
                  qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, linear_num_key_heads=2,
                  linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16, sliding_window=32,
                  attention_chunk_size=32, global_head_dim=16, num_global_key_value_heads=2,
                  mamba_n_heads=4, mamba_d_head=32, mamba_d_state=16, hidden_size_per_layer_input=16,
                  attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1,
                  attn_layer_indices=[1], mamba_d_ssm=128, index_head_dim=16, index_n_heads=2, num_expert_group=1,
                  linear_head_dim=16, linear_num_heads=4, n_mamba_heads=4, adapter_rank=8, num_experts_per_token=2,
                  swa_num_attention_heads=4, swa_num_key_value_heads=2, swa_head_dim=16, lru_width=64,
                  encoder_hash_byte_group_vocab=512, num_heads=8, n_groups=1, time_step_rank=8, indexer_n_heads=2,
                  indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=8, indexer_compress_ratio=4, d_head=16, rotary_dim=8)
# Keys set even where the class leaves them unset (None): a model built from such defaults fails without them.
UNSET_TOO = {"head_dim", "sliding_window", "attn_layer_indices", "num_key_value_heads", "indexer_n_heads",
             "indexer_kv_heads", "indexer_head_dim", "indexer_budget", "indexer_compress_ratio"}
MOE_UNSET_TOO = {"n_routed_experts", "num_local_experts", "num_experts", "num_experts_per_tok", "n_shared_experts"}  # where moe_intermediate_size is set
TINY_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=32,
                   patch_size=8, depth=1, out_hidden_size=64, num_channels=3)


def _small(x, small: dict):
    """A per-layer override ({"head_dim": 512} on Gemma-4's full-attention layers) with the tiny model's sizes."""
    return {k: small.get(k, TINY_SIZES.get(k, v)) for k, v in x.items()} if isinstance(x, dict) else x


def _is_index_list(v, n: int | None) -> bool:
    """A list of layer indices (strictly increasing ints below the layer count), e.g. mlp_only_layers."""
    return (isinstance(v, list) and bool(n) and all(isinstance(i, int) and not isinstance(i, bool) for i in v)
            and all(a < b for a, b in zip(v, v[1:])) and all(0 <= i < n for i in v) and (len(v) < n or v == list(range(n))))


def _is_per_layer(v, n: int | None) -> bool:
    """A value per layer: a list as long as the layers (layer_types, mlp_layer_types, no_rope_layers' 0/1 flags)
    or a pattern string with a character per layer (hybrid_override_pattern)."""
    if not n or n < 2:
        return False
    if isinstance(v, list):
        return len(v) == n and not _is_index_list(v, n) and all(isinstance(x, (str, int, float, bool)) for x in v)
    return isinstance(v, str) and len(v) == n and len(set(v)) > 1


def _layers_kept(d: dict) -> list[int]:
    """The layers a tiny model keeps: the first of each kind the per-layer settings tell apart (every column of
    layer_types, mlp_layer_types, layer-index lists ... together), at least two."""
    n = d.get("num_hidden_layers")
    if not isinstance(n, int) or n < 2:
        return [0, 1]
    columns = [list(v) for v in d.values() if _is_per_layer(v, n)]
    columns += [[i in set(v) for i in range(n)] for v in d.values() if _is_index_list(v, n)]
    shared = d.get("num_kv_shared_layers") or 0  # Gemma-3n/4: the last layers reuse the cache of earlier ones
    columns.append([i >= n - shared for i in range(n)])
    first: dict = {}
    for i in range(n):
        first.setdefault(tuple(c[i] for c in columns), i)
    keep = sorted(first.values())
    if len(keep) > 8:  # a value that differs on every layer (a per-layer factor) tells no kinds apart
        return [0, 1]
    return keep if len(keep) >= 2 else sorted({keep[0], keep[0] + 1})


def tiny_config(model_type: str, vocab_size: int = 512, token_ids: tuple[int, int, int] = (1, 2, 3),
                vision: dict | None = None, **extra) -> dict:
    """A tiny config dict of any architecture transformers has a config class for: the class defaults with the size
    keys it has set small (TINY_SIZES; a vision tower's TINY_VISION), for a random-init model of a few MB; its
    bos/eos/pad token ids (where it has them) those of the tiny tokenizers (token_ids)."""
    from transformers import AutoConfig  # noqa: PLC0415 - transformers: cli imports tiny (FAMILIES) and --help stays torch-free

    cfg = AutoConfig.for_model(model_type)
    text = cfg.get_text_config()
    names = dict(getattr(type(text), "attribute_map", {}))  # hidden_size -> n_embd (GPT-2, CodeGen, BLOOM ...)
    names = {k: a for k, a in names.items() if a != k}
    canonical = {a: k for k, a in names.items()}
    d = {canonical.get(k, k): v for k, v in text.to_dict().items() if k not in ("transformers_version", "architectures")}
    unset_too = UNSET_TOO | (MOE_UNSET_TOO if d.get("moe_intermediate_size") else set())
    small = {k: v for k, v in TINY_SIZES.items() if k in d and d[k] != 0 and (d[k] is not None or k in unset_too)}
    for k in ("num_experts_per_tok", "num_experts_per_token"):  # a class that routes to one expert only keeps one
        if isinstance(d.get(k), int) and k in small:
            small[k] = min(small[k], d[k])
    small.update({k: vocab_size for k in d if "vocab_size" in k})  # Gemma-4's vocab_size_per_layer_input too
    if "qk_rope_head_dim" in small and "head_dim" in d:  # MLA (DeepSeek): RoPE runs over the rope part of each head
        small["head_dim"] = small["qk_rope_head_dim"]
    if "kv_lora_rank" in small and "num_key_value_heads" in small:  # MLA: keys and values have every query head
        small["num_key_value_heads"] = small["num_attention_heads"]
    if "qk_head_dim" in d and "qk_rope_head_dim" in small:  # MLA's whole query head, where a config stores it
        small["qk_head_dim"] = small["qk_rope_head_dim"] + small.get("qk_nope_head_dim", 0)
    keep = _layers_kept(d)
    if d.get("num_kv_shared_layers"):
        small["num_kv_shared_layers"] = sum(i >= d["num_hidden_layers"] - d["num_kv_shared_layers"] for i in keep)
    small["num_hidden_layers"] = len(keep)
    for k, v in d.items():  # per-layer lists, layer-index lists and {layer: ...} tables cut to the layers kept
        if _is_index_list(v, d.get("num_hidden_layers")):
            small[k] = [j for j, i in enumerate(keep) if i in set(v)]
        elif _is_per_layer(v, d.get("num_hidden_layers")) and k in TINY_SIZES:  # a size per layer (Gemma-3n's MLPs)
            small[k] = [TINY_SIZES[k]] * len(keep)
        elif _is_per_layer(v, d.get("num_hidden_layers")):
            small[k] = [v[i] for i in keep] if isinstance(v, list) else "".join(v[i] for i in keep)
        elif isinstance(v, dict) and v and all(str(i).isdigit() for i in v) and k not in ("id2label", "label2id"):
            at = {int(i): i for i in v}  # keys as the config has them: ints, or digits in json
            small[k] = {type(at[i])(j): _small(v[at[i]], small) for j, i in enumerate(keep) if i in at}
    if d.get("rope_parameters") == {} and small.get("layer_types"):  # Cohere-Compass: RoPE per layer type, unset
        small["rope_parameters"] = {t: {"rope_type": "default", "rope_theta": 10000.0} for t in small["layer_types"]}
    if isinstance(d.get("attn_config"), dict) and "rope_theta" not in d["attn_config"]:  # DBRX reads it there, as the
        small["attn_config"] = {**d["attn_config"], "rope_theta": 10000.0,           # hub's config.json has it
                                "clip_qkv": d["attn_config"].get("clip_qkv") or 8.0}
    if isinstance(d.get("ffn_config"), dict):
        small["ffn_config"] = {**d["ffn_config"], **{k: v for k, v in {"ffn_hidden_size": 128, "moe_num_experts": 4}.items()
                                                    if k in d["ffn_config"]}}
    if "axial_pos_embds_dim" in d:  # Reformer: the axial position factors sum to the hidden size
        small["axial_pos_embds_dim"] = [small.get("hidden_size", 64) // 2] * 2
    if "is_decoder" in d:  # a class that is a causal LM only as a decoder (Reformer's LM head asks for it)
        small["is_decoder"] = True
    for k, i in zip(("bos_token_id", "eos_token_id", "pad_token_id"), token_ids):
        if k in d:
            small[k] = i
    # What the class derives is derived again from the tiny sizes, not kept stale from the defaults: keys that are
    # not its fields (Zamba2's attention_hidden_size), and int fields whose default None means "derive it" (RWKV's
    # attention_hidden_size, xLSTM's embedding_dim, Falcon's ffn_hidden_size).
    if is_dataclass(text):
        own = {canonical.get(f.name, f.name): f for f in fields(text)}
        derived = {k for k, f in own.items() if f.default is None and isinstance(d.get(k), int)}
        d = {k: v for k, v in d.items() if (k in own and k not in derived) or k in small or k == "model_type"}
    d.update(small)
    d = {names.get(k, k): v for k, v in d.items()}  # the class's own names again
    for k, v in d.items():  # a text decoder's own parts as sub-configs (BLT's encoder/global/decoder) made tiny too
        if isinstance(v, dict) and "hidden_size" in v and k not in ("vision_config", "audio_config"):
            d[k] = {**v, **{x: y for x, y in TINY_SIZES.items() if v.get(x) is not None}, "num_hidden_layers": 2,
                    **{x: vocab_size for x in v if "vocab_size" in x}}
    if "layer_types" in d and d["layer_types"] is None and getattr(type(text)(**d), "layer_types", None) is None:
        d["layer_types"] = ["full_attention"] * d["num_hidden_layers"]  # a class that leaves them unset (LFM2-MoE)
    d.update(extra)
    if text is cfg:
        _tiny_towers(d, vision)
        return d
    top = {k: v for k, v in cfg.to_dict().items() if k not in ("transformers_version", "architectures")}
    top[next(k for k in ("text_config", "language_config", "llm_config") if k in top)] = d
    _tiny_towers(top, vision)
    return top


def _tiny_towers(d: dict, vision: dict | None) -> None:
    """A config's vision and audio towers made tiny in place (TINY_VISION), and `vision` over the vision tower's."""
    for key in ("vision_config", "audio_config"):
        if isinstance(d.get(key), dict):
            sub = d[key]
            sub.update({k: v for k, v in TINY_VISION.items() if k in sub})
    if vision and isinstance(d.get("vision_config"), dict):
        d["vision_config"].update(vision)

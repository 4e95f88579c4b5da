"""Offline stand-ins for the hub: a small chat dataset (shipped in data/) and tiny random-init models with locally
trained tokenizers (built into .assets/, ignored by git). Both are deterministic, so tests can compare exact
numbers. They are loaded by exactly the code that loads meta-llama/Llama-2-70b-hf: only the recipe differs.

    python -m sftrecipes tiny                     # build .assets/tiny-llama if missing
    python -m sftrecipes tiny --family qwen3      # .assets/tiny-qwen3: that family's architecture, tokenizer, template
    python -m sftrecipes tiny --family gemma3 --vision  # .assets/tiny-gemma3-vision: its vision-language model + processor
    python -m sftrecipes tiny --data              # rewrite data/tiny_chat/*.jsonl (checked in; a test compares)

The families (FAMILIES) are built from transformers' config classes with the traits that break recipes written
for Llama-2: tied embeddings, head_dim != hidden/heads, q/k norms, qkv biases, soft-capping, sliding windows, fused
projections, mixtures of experts; and each tokenizer carries its family's special tokens, BOS habit and chat
template, so end-of-turn detection and double-BOS handling meet the real cases; layer patterns are the releases'
(Gemma-3: 5 sliding-window layers to 1 full). Tiny configs of any other architecture: tiny_archs.py; what a
vision-language family adds (tower, image tokens, processor, template): model/tinyvision.py.
"""

from __future__ import annotations

import json
import random
import shutil
from dataclasses import dataclass, replace
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from sftrecipes.core.paths import ASSETS, DATA_DIR

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
    from transformers import PreTrainedTokenizerFast

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
    from sftrecipes.data.tokenizer import CHATML_TEMPLATE

    fast.chat_template = CHATML_TEMPLATE
    return fast


def build_model(out: Path = TINY_MODEL, size: str = "tiny", seed: int = 0) -> Path:
    """Random-init Llama + local tokenizer, saved as a hub-style folder. Deterministic for a given seed."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

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
    # Gemma-3 (text): tied, head_dim 32, q/k norms, 5 sliding-window layers to 1 full as released
    "gemma3": Family(("Gemma3TextConfig", dict(_DENSE, intermediate_size=128, head_dim=32, query_pre_attn_scalar=32,
                                              sliding_window=32, num_hidden_layers=6, tie_word_embeddings=True,
                                              layer_types=["sliding_attention"] * 5 + ["full_attention"])), **_GEMMA_TOKENS),
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


def build_family_tokenizer(name: str, vocab_size: int = 512, fam: Family | None = None, attrs: dict | None = None):
    """A BPE tokenizer trained on the shipped chat data, with the family's special tokens and template; `fam`: the
    family as a vision-language one changes it, `attrs`: its tokens by the attribute a processor reads them from."""
    from transformers import PreTrainedTokenizerFast

    fam = fam or FAMILIES[name]
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
                                   pad_token=fam.pad, additional_special_tokens=list(fam.listed), **(attrs or {}))
    fast.chat_template = fam.template
    return fast


def build_family(name: str, out: Path | None = None, seed: int = 0) -> Path:
    """Random-init tiny model of a family + its tokenizer, saved as a hub-style folder. Deterministic."""
    import torch
    import transformers

    fam = FAMILIES[name]
    out = out or family_dir(name)
    tok = build_family_tokenizer(name)
    cls_name, kwargs = fam.config
    ids = {f"{k}_token_id": tok.convert_tokens_to_ids(v) for k, v in (("bos", fam.bos), ("eos", fam.eos), ("pad", fam.pad)) if v}
    cfg = getattr(transformers, cls_name)(vocab_size=len(tok), max_position_embeddings=1024, initializer_range=0.1,
                                          **ids, **kwargs)
    torch.manual_seed(seed)
    from transformers import AutoModelForCausalLM

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


def build_vision_family(name: str, out: Path | None = None, seed: int = 0) -> Path:
    """Random-init tiny vision-language model of a family (model/tinyvision.VISION) + its processor (image processor,
    the text family's tokenizer with the image tokens, a template rendering image parts), saved as a hub-style folder
    that AutoModelForImageTextToText and AutoProcessor load. Deterministic."""
    import torch
    from transformers import AutoConfig, AutoModelForImageTextToText

    from sftrecipes.model import tinyvision
    from sftrecipes.tiny_archs import tiny_config

    vis = tinyvision.VISION[name]
    base = FAMILIES[vis.text]
    tokens = tuple(t for _, t in vis.tokens)
    fam = replace(base, listed=base.listed + tuple(t for t in tokens if t not in base.listed), template=vis.template,
                  **({"eos": vis.eos, "end_of_turn": vis.eos} if vis.eos else {}))
    tok = build_family_tokenizer(vis.text, fam=fam, attrs=dict(vis.tokens))
    processor = tinyvision.build_processor(name, tok)  # (before the model: a processor that cannot be built says so)
    ids = tuple(tok.convert_tokens_to_ids(t) if t else None for t in (fam.bos, fam.eos, fam.pad))
    cfg = tiny_config(vis.model_type, vocab_size=len(tok), token_ids=ids, vision=vis.vision, initializer_range=0.1,
                      **tinyvision.text_keys(vis))
    cfg.update(tinyvision.config_keys(vis, tok))
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(AutoConfig.for_model(**cfg))
    for weight in model.parameters():  # a matrix initialised to zeros (Gemma-3's projector, as a fresh model starts
        if weight.dim() >= 2 and not weight.any():  # to be trained) would keep the images from the language model
            weight.data.normal_(0.0, 0.1)
    model.generation_config.eos_token_id = tok.convert_tokens_to_ids(fam.eos)
    out = out or ASSETS / f"tiny-{name}-vision"
    tmp = out.with_name(out.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    model.save_pretrained(tmp)
    processor.save_pretrained(tmp)
    (tmp / SPEC_FILE).write_text(_vision_spec(name, seed))
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    return out


def _vision_spec(name: str, seed: int = 0) -> str:
    from sftrecipes.model.tinyvision import VISION

    return f"{name} vision seed {seed}\n{VISION[name]!r}\n{FAMILIES[VISION[name].text]!r}\n"


def ensure_vision_family(name: str) -> Path:
    """.assets/tiny-<name>-vision, built when missing or built from an older spec."""
    out = ASSETS / f"tiny-{name}-vision"
    spec = out / SPEC_FILE
    if not spec.is_file() or spec.read_text() != _vision_spec(name):
        out.parent.mkdir(parents=True, exist_ok=True)
        build_vision_family(name, out)
    return out


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

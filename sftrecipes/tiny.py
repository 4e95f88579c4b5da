"""Offline stand-ins for the hub: a small chat dataset (shipped in data/) and a tiny Llama with a locally
trained tokenizer (built into .assets/, ignored by git). Both are deterministic, so tests can compare exact
numbers. They are loaded by exactly the code that loads meta-llama/Llama-2-70b-hf: only the recipe differs.

    python -m sftrecipes tiny            # build .assets/tiny-llama if missing
    python -m sftrecipes tiny --data     # rewrite data/tiny_chat/*.jsonl (checked in; a test compares)
"""

from __future__ import annotations

import json
import random
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DATA_DIR = ROOT / "data" / "tiny_chat"
ASSETS = ROOT / ".assets"
TINY_MODEL = ASSETS / "tiny-llama"

SPECIAL = ["<unk>", "<s>", "</s>", "<pad>", "<|im_start|>", "<|im_end|>"]

# Sizes of the tiny model; `size="medium"` (25.7M parameters; saved in bf16 like hub checkpoints, 51 MB, and 103 MB
# once loaded in fp32 for full fine-tuning) is big enough to see memory effects.
SAVE_DTYPE = {"tiny": "float32", "medium": "bfloat16"}
SIZES = {
    "tiny": dict(hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2),
    "medium": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4),
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
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers  # noqa: PLC0415
    from transformers import PreTrainedTokenizerFast  # noqa: PLC0415

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
    from .model import CHATML_TEMPLATE  # noqa: PLC0415

    fast.chat_template = CHATML_TEMPLATE
    return fast


def build_model(out: Path = TINY_MODEL, size: str = "tiny", seed: int = 0) -> Path:
    """Random-init Llama + local tokenizer, saved as a hub-style folder. Deterministic for a given seed."""
    import torch  # noqa: PLC0415
    from transformers import LlamaConfig, LlamaForCausalLM  # noqa: PLC0415

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
        import shutil  # noqa: PLC0415

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

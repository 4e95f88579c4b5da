"""The ids of a batch of texts from a fast tokenizer without what nobody asked for: where no offsets are needed, the
Rust tokenizer's encode_batch_fast, which leaves out the offsets and transformers' per-row conversion (tokenization.py
calls it once a batch; tests/data/test_prep_fast.py holds it equal to the tokenizer's call for every family)."""

from __future__ import annotations

from transformers.tokenization_utils_base import PaddingStrategy, PreTrainedTokenizerBase, TruncationStrategy
from transformers.tokenization_utils_tokenizers import TokenizersBackend


def encode(tokenizer, texts: list[str], special: bool, offsets: bool) -> tuple[list[list[int]], list | None]:
    """(ids, offsets or None) of each text, as `tokenizer(texts, add_special_tokens=special,
    return_offsets_mapping=offsets)` gives them. Where no offsets are asked for and the tokenizer is transformers'
    plain fast one, the Rust tokenizer's encode_batch_fast, which leaves out the offsets and transformers' per-row
    conversion (the same ids; one process prepared 20,000 multi-turn rows at 6,300-6,800 rows/s this way, 4,200
    through the call: docs/benchmarks.md), with the state the call would have set (no truncation or padding, its
    split_special_tokens); any other tokenizer (a subclass with its own encoding, a slow one) through its own call."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if not offsets and _plain_fast(tokenizer) and hasattr(backend, "encode_batch_fast"):
        tokenizer.set_truncation_and_padding(padding_strategy=PaddingStrategy.DO_NOT_PAD,
                                             truncation_strategy=TruncationStrategy.DO_NOT_TRUNCATE, max_length=None,
                                             stride=0, pad_to_multiple_of=None, padding_side=None)
        if backend.encode_special_tokens != bool(tokenizer.split_special_tokens):
            backend.encode_special_tokens = bool(tokenizer.split_special_tokens)
        return [e.ids for e in backend.encode_batch_fast(texts, add_special_tokens=special)], None
    enc = tokenizer(texts, add_special_tokens=special, return_offsets_mapping=offsets, return_attention_mask=False,
                    return_token_type_ids=False)
    return enc["input_ids"], enc["offset_mapping"] if offsets else None


def _plain_fast(tokenizer) -> bool:
    """Whether the tokenizer's call is transformers' own, straight into TokenizersBackend._encode_plus."""
    kind = type(tokenizer)
    return (isinstance(tokenizer, TokenizersBackend) and kind._encode_plus is TokenizersBackend._encode_plus
            and kind.__call__ is PreTrainedTokenizerBase.__call__ and not hasattr(tokenizer, "_switch_to_input_mode"))

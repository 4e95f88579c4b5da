"""llama.cpp's own converter (convert_hf_to_gguf.py, convert_lora_to_gguf.py of the pinned release), run in a child
process with two things added where it falls short, and nothing else changed:

- a byte-level BPE tokenizer whose hash it does not know (every tokenizer trained for a run: llama.cpp names
  pre-tokenizers by the hash of a test string's tokens) is named from its own pre-tokenizer definition in
  tokenizer.json, when that definition is exactly one llama.cpp implements (PRETOKENIZERS); any other stops the
  conversion in one line, exit 2. Never guessed: `--verify` then checks that llama.cpp tokenizes the run's rows as
  transformers does.
- before the header is written: the per-layer attention pattern of a model with `layer_types` (Gemma-3's sliding and
  full layers, for one), which llama.cpp otherwise assumes to be its architecture's default; and the run's chat
  template, end-of-sequence and end-of-turn tokens where the converter wrote none or others (a LoRA GGUF carries none).

    python -m sftrecipes.export.gguf_convert CONVERTER_DIR META_JSON hf|lora [converter arguments...]

META_JSON (written by gguf.py) holds what to add; the child writes what it did into META_JSON's "done".
"""

from __future__ import annotations

import json
import logging
import runpy
import sys
from pathlib import Path

log = logging.getLogger("sftrecipes")

# Tokenizer definitions (tokenizer.json's "normalizer", "pre_tokenizer" and its BPE model's "ignore_merges", compared
# whole, trim_offsets aside: it moves offsets, not ids) -> the name llama.cpp implements the same rule under
# (src/llama-vocab.cpp). GPT-2's byte-level rule is ByteLevel with its built-in regex; Llama-3's and Qwen2's split by
# their own regex first (Qwen's tokenizers also normalize to NFC, which llama.cpp runs them without); llama.cpp's
# "llama-bpe" takes a word the vocabulary holds whole (ignore_merges), its "smaug-bpe" the same regex without that.
# tests/export/test_gguf.py converts the released Llama-3 and Qwen3 tokenizers both ways (known by their hash, and by
# their definition once the hash is unknown) and holds llama.cpp's tokens to transformers' in each.
_LLAMA3_RE = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
              r"|\s+(?!\S)|\s+")
_QWEN2_RE = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
             r"|\s+(?!\S)|\s+")


def _split_then_bytes(regex: str) -> dict:
    return {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "use_regex": False}]}


PRETOKENIZERS = {  # name -> (normalizer, pre_tokenizer, ignore_merges)
    "gpt-2": (None, {"type": "ByteLevel", "add_prefix_space": False, "use_regex": True}, False),
    "llama-bpe": (None, _split_then_bytes(_LLAMA3_RE), True),
    "smaug-bpe": (None, _split_then_bytes(_LLAMA3_RE), False),
    "qwen2": ({"type": "NFC"}, _split_then_bytes(_QWEN2_RE), False),
}


def _without_offsets(d):
    if isinstance(d, dict):
        return {k: _without_offsets(v) for k, v in d.items() if k != "trim_offsets"}
    if isinstance(d, list):
        return [_without_offsets(v) for v in d]
    return d


def recognise(tokenizer_json: Path) -> str:
    """llama.cpp's name for the rule tokenizer.json defines, or one line (SystemExit 2) saying why there is none."""
    spec = json.loads(tokenizer_json.read_text())
    if spec.get("model", {}).get("type") != "BPE":
        _stop(f"llama.cpp does not know this tokenizer's hash, and it is not a byte-level BPE tokenizer "
              f"({spec.get('model', {}).get('type')}); convert a model whose tokenizer llama.cpp knows")
    have = (spec.get("normalizer"), _without_offsets(spec.get("pre_tokenizer")), bool(spec["model"].get("ignore_merges")))
    for name, definition in PRETOKENIZERS.items():
        if have == definition:
            return name
    kinds = "/".join(str((part or {}).get("type")) for part in have[:2])
    _stop(f"llama.cpp does not know this tokenizer's hash, and its normalizer/pre-tokenizer ({kinds}) is none of those "
          f"recognised from their definition ({', '.join(PRETOKENIZERS)}); convert a model whose tokenizer llama.cpp knows")
    raise AssertionError  # (unreachable)


def _stop(why: str) -> None:
    print(f"export --to gguf: {why}", file=sys.stderr)
    sys.exit(2)


def _patch(converter: Path, meta: dict, done: dict) -> None:
    sys.path.insert(0, str(converter))
    sys.path.insert(1, str(converter / "gguf-py"))
    import gguf
    from conversion import base

    known = base.TextModel.get_vocab_base_pre

    def get_vocab_base_pre(self, tokenizer):
        try:
            return known(self, tokenizer)
        except NotImplementedError:
            name = recognise(Path(self.dir_model) / "tokenizer.json")
            done["pre_tokenizer"] = {"name": name, "how": "definition"}
            return name

    base.TextModel.get_vocab_base_pre = get_vocab_base_pre
    write_header = gguf.GGUFWriter.write_header_to_file
    keys = gguf.Keys

    def write_header_to_file(self, *args, **kwargs):
        kv = self.kv_data[0]
        pattern = keys.Attention.SLIDING_WINDOW_PATTERN.format(arch=self.arch)
        types = meta.get("layer_types")
        if types and "sliding_attention" in types and pattern not in kv and meta["kind"] == "hf":
            self.add_sliding_window_pattern([t == "sliding_attention" for t in types])
            done["layer_pattern"] = f"{types.count('sliding_attention')} sliding of {len(types)}"
        for key, value, add in ((keys.Tokenizer.CHAT_TEMPLATE, meta.get("chat_template"), self.add_chat_template),
                                (keys.Tokenizer.EOS_ID, meta.get("eos_token_id"), self.add_eos_token_id),
                                (keys.Tokenizer.EOT_ID, meta.get("eot_token_id"), self.add_eot_token_id)):
            if value is None or (key in kv and kv[key].value == value):
                continue
            done.setdefault("metadata", []).append(key + (" (replaced)" if key in kv else ""))
            kv.pop(key, None)
            add(value)
        return write_header(self, *args, **kwargs)

    gguf.GGUFWriter.write_header_to_file = write_header_to_file


def main(argv: list[str]) -> None:
    converter, meta_path, kind, *args = argv
    meta_path = Path(meta_path)
    meta = json.loads(meta_path.read_text()) | {"kind": kind}
    done: dict = {}
    _patch(Path(converter), meta, done)
    script = Path(converter) / ("convert_hf_to_gguf.py" if kind == "hf" else "convert_lora_to_gguf.py")
    sys.argv = [str(script), *args]
    try:
        runpy.run_path(str(script), run_name="__main__")
    finally:
        meta_path.write_text(json.dumps(meta | {"done": done}))


if __name__ == "__main__":
    main(sys.argv[1:])

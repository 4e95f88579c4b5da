"""`export --to gguf --verify`: the GGUF loaded in llama.cpp (its own runtime, an f32 KV cache) against transformers on
the run's own rows: the same tokens from the same text, the metadata the run needs, and next-token logits within the
type's tolerance with the same top-1 token.

The rows: the first ROWS rows the run trained on (its prepared data, found through run_summary.json), each cut to
ROW_TOKENS tokens; a folder that is not a run's is checked on its chat template rendered over PROBE turns.

Tolerances (TOLERANCE), relative to the logit scale max(1, max |logit|) of each row, measured on the tiny Llama, Qwen3
and Gemma-3 (docs/exports.md has the table): f32 holds the weights exactly, yet llama.cpp computes GELU from a 16-bit
table (Gemma-3: 5.6e-4; Llama, Qwen3: ~1e-6); f16 rounds each weight once (1.7e-3); bf16 keeps 8 bits of mantissa
(1.2e-2 to 1.7e-2); q8_0 quantizes weights and activations to 8 bits (3.5e-2 to 4.2e-2); the 4-6 bit types ~0.2-0.3.
Each bound is 2-6x the measurement and still catches a wrong tensor, layer pattern or tokenizer, which move logits
by a large part of the scale. Top-1: every position where transformers' best token leads the next by more than twice
the bound must have the same best token in llama.cpp (elsewhere rounding may swap two near-equal tokens: counted,
not failed).
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path

import numpy as np
import torch

from sftrecipes.core.errors import RecipeError

log = logging.getLogger("sftrecipes")

ROWS, ROW_TOKENS = 8, 128
PROBE = [[{"role": "user", "content": "The quick brown fox jumps over the lazy dog. What is 7 plus 5?"},
          {"role": "assistant", "content": "7 plus 5 is 12. Anything else about foxes, dogs or sums?"}],
         [{"role": "user", "content": "Name three colours of the rainbow, and say why the sky is blue."}]]
# type -> max logit error relative to the scale; the types below 8 bits: "low-bit"
TOLERANCE = {"f32": 2e-3, "f16": 1e-2, "bf16": 5e-2, "q8_0": 0.1, "low-bit": 0.6}
GGML_F32 = 0  # ggml_type of an f32 KV cache


def tolerance(quant: str) -> float:
    return TOLERANCE.get(quant, TOLERANCE["low-bit"])


def run_rows(src: Path, tok) -> tuple[list[list[int]], str]:
    """Token rows the run trained on (its prepared data), else the probe conversations through the chat template."""
    for folder in (src, src.parent):
        summary = folder / "run_summary.json"
        if not summary.is_file():
            continue
        entry = (json.loads(summary.read_text()).get("data") or {}).get("preparation", {}).get("path")
        arrow = Path(entry) / "prepared" / "train.arrow" if entry else None
        if arrow is not None and arrow.is_file():
            import datasets

            rows = datasets.Dataset.from_file(str(arrow)).select_columns(["input_ids"])
            picked = [list(r["input_ids"][:ROW_TOKENS]) for r in rows.select(range(min(ROWS, len(rows))))]
            return picked, f"{len(picked)} rows the run trained on ({arrow})"
    if isinstance(tok.chat_template, str):
        rows = [tok.apply_chat_template(c, tokenize=True, add_generation_prompt=c[-1]["role"] == "user") for c in PROBE]
        rows = [list(r["input_ids"] if hasattr(r, "keys") else r)[:ROW_TOKENS] for r in rows]
        return rows, f"{len(rows)} probe conversations through the chat template (no prepared rows of a run found)"
    rows = [tok(c[0]["content"])["input_ids"][:ROW_TOKENS] for c in PROBE]
    return rows, f"{len(rows)} probe texts (no prepared rows of a run found, no chat template)"


def _reference(reference: dict):
    """transformers' side in fp32, as the merge's --verify reads its source (export/verify.py): the model folder, or
    the adapter on its base through peft (embeddings resized as the run resized them; tensors peft's loader misses
    put in by name)."""
    from sftrecipes.export.verify import _from_pretrained, _peft_reference

    if "model" in reference:
        return _from_pretrained(reference["model"]).eval()
    return _peft_reference(reference["base"], reference["adapter"]).eval()


def _metadata(path: Path, converter: Path, meta: dict, lora: bool) -> list[str]:
    """What the file's metadata lacks of the run's: chat template, eos, end of turn, layer pattern (read back with the
    converter's own reader)."""
    sys.path.insert(0, str(converter / "gguf-py"))
    from gguf import GGUFReader

    reader = GGUFReader(path)
    fields = {f.name: f.contents() for f in reader.fields.values()}
    arch = fields.get("general.architecture")
    wrong = []
    want = {"tokenizer.chat_template": meta["chat_template"], "tokenizer.ggml.eos_token_id": meta["eos_token_id"],
            "tokenizer.ggml.eot_token_id": meta["eot_token_id"]}
    types = meta.get("layer_types")
    if types and "sliding_attention" in types and not lora:
        want[f"{arch}.attention.sliding_window_pattern"] = [t == "sliding_attention" for t in types]
    for key, value in want.items():
        if value is not None and fields.get(key) != value:
            wrong.append(f"{key} is {str(fields.get(key))[:40]!r}, not the run's {str(value)[:40]!r}")
    return wrong


def verify(model_file: Path, lora_file: Path | None, reference: dict, quant: str, src: Path, converter: Path,
           meta: dict) -> dict:
    from llama_cpp import Llama
    from transformers import AutoTokenizer

    wrong = _metadata(model_file, converter, meta, False) + (_metadata(lora_file, converter, meta, True) if lora_file else [])
    if wrong:
        raise RecipeError(f"export --verify: the GGUF's metadata: {wrong[0]}" + (f" (and {len(wrong) - 1} more)" if len(wrong) > 1 else ""))
    tok = AutoTokenizer.from_pretrained(reference.get("adapter") or reference["model"])
    rows, where = run_rows(src, tok)
    try:  # verbose: llama.cpp's own log goes to stderr, where the parent reads why a load failed
        llm = Llama(str(model_file), lora_path=str(lora_file) if lora_file else None, n_ctx=2 * ROW_TOKENS,
                    n_batch=2 * ROW_TOKENS, n_ubatch=2 * ROW_TOKENS, logits_all=True, type_k=GGML_F32, type_v=GGML_F32,
                    n_threads=os.cpu_count(), verbose=True)
    except ValueError as e:
        raise RecipeError(f"export --verify: llama.cpp cannot load the GGUF ({e})") from None
    model = _reference(reference)
    tol = tolerance(quant)
    same_tokens, worst, agree, positions, decisive, swapped = 0, 0.0, 0, 0, 0, 0
    for ids in rows:
        text = tok.decode(ids)
        ours = tok(text, add_special_tokens=False)["input_ids"]
        theirs = llm.tokenize(text.encode(), add_bos=False, special=True)
        same_tokens += ours == theirs
        llm.reset()
        llm.eval(ids)
        got = np.array(llm.scores[: len(ids)], dtype=np.float64)
        with torch.no_grad():
            want = model(torch.tensor([ids])).logits[0].double().numpy()
        scale = max(1.0, float(np.abs(want).max()))
        worst = max(worst, float(np.abs(got - want).max()) / scale)
        same = got.argmax(-1) == want.argmax(-1)
        top2 = np.sort(want, axis=-1)[:, -2:]
        clear = (top2[:, 1] - top2[:, 0]) > 2 * tol * scale
        agree, positions = agree + int(same.sum()), positions + len(ids)
        decisive, swapped = decisive + int(clear.sum()), swapped + int((clear & ~same).sum())
    figures = {"rows": where, "tokenized_alike": f"{same_tokens}/{len(rows)}", "max_rel_logit_error": worst,
               "tolerance": tol, "top1_agree": f"{agree}/{positions}", "top1_decisive_agree": f"{decisive - swapped}/{decisive}"}
    words = (f"{same_tokens}/{len(rows)} rows tokenized alike, max logit error {worst:.2e} of scale (bound {tol:g}), "
             f"top-1 {agree}/{positions}, {decisive - swapped}/{decisive} where it leads by more than twice the bound")
    if same_tokens < len(rows):
        raise RecipeError(f"export --verify: llama.cpp tokenizes {len(rows) - same_tokens} of {len(rows)} rows differently "
                          f"from transformers ({where}); this GGUF would not see the text the model was trained on")
    if worst > tol or swapped:
        raise RecipeError(f"export --verify: llama.cpp's {quant} GGUF does not match transformers: {words}")
    return figures | {"words": f"{words}; {where}"}


def main(spec_file: Path) -> int:
    """The child process export runs this in (gguf._verify_in_child): figures into the spec file, or one line, exit 2."""
    spec = json.loads(spec_file.read_text())
    files = {k: Path(spec[k]) if spec[k] else None for k in ("model_file", "lora_file")}
    try:
        figures = verify(files["model_file"], files["lora_file"], {k: Path(v) for k, v in spec["reference"].items()},
                         spec["quant"], Path(spec["src"]), Path(spec["converter"]), spec["meta"])
    except RecipeError as e:
        print(str(e), file=sys.stderr)
        return 2
    spec_file.write_text(json.dumps(spec | {"figures": figures}))
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))

"""Writing a model folder from a tensor source: a merge plan applied, floats cast, config.json and
generation_config.json written for the tensors and tokenizer, checked (and verified) before it is published."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import AutoTokenizer

from sftrecipes.export.adapters import _apply
from sftrecipes.export.layout import StoredLayout
from sftrecipes.export.readers import _SafetensorsSource
from sftrecipes.export.verify import check_model_folder, verify_logits
from sftrecipes.export.writer import PROCESSOR_FILES, TOKENIZER_FILES, _nbytes, _shard_files, _shards, _Staging, _write_index
from sftrecipes.model.load import DTYPES

PROGRESS_BYTES = 1 << 30  # models this large get a progress bar while they are written


def rewrite_model(base_dir: Path, out_dir: str | Path, plan: dict[str, dict], dtype: str | None, tok_src: Path,
                  max_shard_bytes: int = 2 * 1024**3, source=None, reference=None, names: list[str] | None = None,
                  verb: str = "export") -> Path:
    """Write a model folder tensor by tensor from `source` (default: the safetensors in base_dir), applying `plan`
    and casting floats to `dtype`; config and tokenizer come from base_dir / tok_src. Before the folder is published
    its tensors are checked against the config (check_model_folder); with `reference` (a callable returning the
    source as a model) the logits are compared too (verify_logits; `verb` names the command in its error)."""
    source = source or _SafetensorsSource(base_dir)
    out_dtype = DTYPES[dtype] if dtype else None
    names = names or source.names()
    # the plan names tensors as the model holds them; the source may store them in pieces (StoredLayout)
    todo = {n: (plan[n], None) for n in names if n in plan}
    if set(todo) != set(plan):
        todo = StoredLayout.of_config(base_dir).plan_pieces(plan, names)
    layout = []
    for name in names:
        src_dtype, shape = source.meta(name)
        entry, piece = todo.get(name, ({}, None))
        if entry == "stacked":  # pieces of several held tensors, each changed in its rows: the shape stays
            entry, piece = {}, None
        if "replace" in entry and piece is None:
            shape = tuple(entry["replace"].shape)
        rows = entry.get("rows")
        if rows is not None:
            shape = (max(shape[0], int(rows[0].max()) + 1), *shape[1:])
        layout.append((name, (out_dtype or src_dtype) if src_dtype.is_floating_point else src_dtype, shape))
    shards = _shards(layout, max_shard_bytes)

    def get(name):
        w = source.get(name)
        if name in todo and todo[name][0] == "stacked":
            out = w.to(torch.float32)
            for rows, entry, piece in todo[name][1]:
                out[rows] = _apply(out[rows], entry, piece[0], piece)
            return out
        return _apply(w, todo[name][0], name, todo[name][1]) if name in todo else w

    with _Staging(Path(out_dir)) as st:
        st.needed = sum(_nbytes(d, shape) for _, d, shape in layout)
        fnames = _shard_files(shards)
        # a bar with the time left where writing takes a while (stderr; none for small models, tests' among them)
        with tqdm(total=st.needed, unit="B", unit_scale=True, unit_divisor=1024, desc=f"{verb}: writing {Path(out_dir).name}",
                  disable=st.needed < PROGRESS_BYTES) as bar:
            for fname, shard in zip(fnames, shards):
                st.write_safetensors(fname, shard, get, bar.update)
        _write_index(st.tmp, shards, fnames)
        for f in (*TOKENIZER_FILES, *PROCESSOR_FILES):
            if (tok_src / f).is_file():
                shutil.copy2(tok_src / f, st.tmp / f)
        # config.json records the dtype the tensors are in (an fp32 export of a bf16 run must not load as bf16)
        written = out_dtype or next((d for _, d, _ in layout if d.is_floating_point), None)
        _write_config(base_dir, st.tmp, layout, written)
        check_model_folder(st.tmp, out_dtype)
        if reference is not None:  # at the tolerance of the dtype written (a bf16 base merged as it is stored: bf16's)
            verify_logits(st.tmp, reference, written or torch.float32, verb=verb)
        return st.publish()


def _write_config(base_dir: Path, out: Path, layout: list, out_dtype: torch.dtype | None) -> None:
    cfg = json.loads((base_dir / "config.json").read_text())
    shapes = {n: s for n, _, s in layout}
    emb = next((s for n, s in shapes.items() if n.endswith("embed_tokens.weight")), None)
    if emb is not None:
        cfg["vocab_size"] = emb[0]
    if out_dtype is not None:
        cfg["dtype"] = str(out_dtype).removeprefix("torch.")
        cfg.pop("torch_dtype", None)
    cfg.pop("quantization_config", None)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    gen = json.loads((base_dir / "generation_config.json").read_text()) if (base_dir / "generation_config.json").is_file() else {}
    if (out / "tokenizer_config.json").is_file():
        # the fine-tune may have changed the end-of-turn token (chatml: <|im_end|>); generation must stop on it
        tok = AutoTokenizer.from_pretrained(out)
        eos = gen.get("eos_token_id")
        eos = eos if isinstance(eos, list) else [] if eos is None else [eos]
        if tok.eos_token_id is not None and tok.eos_token_id not in eos:
            gen["eos_token_id"] = [tok.eos_token_id, *eos]
        if tok.pad_token_id is not None:
            gen["pad_token_id"] = tok.pad_token_id
            cfg["pad_token_id"] = tok.pad_token_id
            (out / "config.json").write_text(json.dumps(cfg, indent=2))
    if gen:
        (out / "generation_config.json").write_text(json.dumps(gen, indent=2))

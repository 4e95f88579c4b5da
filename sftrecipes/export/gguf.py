"""`export SRC DEST --to gguf`: a run (or any model folder) -> a GGUF llama.cpp, Ollama and LM Studio load, made by
llama.cpp's own converter and quantizer of one pinned release (facts/llamacpp.py), with the run's chat template and
end tokens in its metadata, an Ollama Modelfile beside it, and with --verify llama.cpp's logits held against
transformers' on the run's own rows (gguf_verify.py).

    DEST/model-<quant>.gguf          the model (an adapter merged into its base on the way, by the streaming merge)
    DEST/Modelfile                   `ollama create NAME -f DEST/Modelfile`
    DEST/gguf_export.json            what was written, by which llama.cpp, and what --verify measured
  with --lora:
    DEST/base-<quant>.gguf           the adapter's base (with the run's tokenizer files: its template and end tokens)
    DEST/adapter-<type>.gguf         the LoRA as a GGUF LoRA (llama.cpp --lora, Ollama ADAPTER)

Everything is written in DEST.tmp-* and renamed when complete (and verified, when asked).
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from sftrecipes.core import forks
from sftrecipes.core.errors import RecipeError
from sftrecipes.export.writer import TOKENIZER_FILES
from sftrecipes.facts import folders, llamacpp

log = logging.getLogger("sftrecipes")


def export_gguf(src: str | Path, dest: str | Path, quant: str = "f16", verify: bool = False, lora: bool = False,
                base: str | None = None, dtype: str | None = None) -> dict:
    converter = llamacpp.require()
    quant = llamacpp.check_quant(quant)
    src, dest = Path(src), Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=dest.name + ".tmp-", dir=dest.parent))
    try:
        record = _export(src, dest, tmp, converter, quant, verify, lora, base, dtype)
        (tmp / "gguf_export.json").write_text(json.dumps(record, indent=1) + "\n")
        if dest.exists():
            shutil.rmtree(dest)
        os.replace(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return record


def _export(src: Path, dest: Path, tmp: Path, converter: Path, quant: str, verify: bool, lora: bool, base, dtype) -> dict:
    from sftrecipes.export import export as export_folder

    work = tmp / ".work"
    work.mkdir()
    hf = _model_folder(src, work, base, dtype, want_adapter=lora, export_folder=export_folder)
    record = {"source": str(src), "quant": quant, "llama_cpp_python": llamacpp.RELEASE, "files": {}}
    if lora:
        adapter = _gguf_lora_adapter(hf, work)
        base_dir = folders.merge_base(folders.adapter_config(hf), base)
        model_src = _with_tokenizer(base_dir, hf, work / "base")
        model_file, meta = _convert(converter, model_src, tmp / f"base-{quant}.gguf", quant, work, hf)
        lora_type = quant if quant in llamacpp.CONVERTER_TYPES and quant != "f32" else "f16"
        lora_file = tmp / f"adapter-{lora_type}.gguf"
        lora_meta = _run_converter(converter, "lora", meta | {"layer_types": None}, work,
                                   [str(adapter), "--base", str(model_src), "--outtype", lora_type, "--outfile", str(lora_file)])
        record["lora"] = {"file": lora_file.name, "type": lora_type, "alpha": lora_meta["alpha"], "done": lora_meta["done"]}
        record["files"][lora_file.name] = lora_file.stat().st_size
        reference = {"base": model_src, "adapter": hf}
    else:
        model_file, meta = _convert(converter, hf, tmp / f"model-{quant}.gguf", quant, work, hf)
        lora_file, reference = None, {"model": hf}
    record["files"][model_file.name] = model_file.stat().st_size
    record["converted"] = meta["done"]
    _modelfile(tmp, model_file, lora_file, meta)
    if verify:
        record["verify"] = _verify_in_child(work, {"model_file": str(model_file), "lora_file": str(lora_file) if lora_file
                                                   else None, "reference": {k: str(v) for k, v in reference.items()},
                                                   "quant": quant, "src": str(src), "converter": str(converter), "meta": meta})
    shutil.rmtree(work)
    return record


def _model_folder(src: Path, work: Path, base, dtype, want_adapter: bool, export_folder) -> Path:
    """A folder the converter reads: a model folder as it is; anything else exported first (a checkpoint, ZeRO or FSDP;
    an adapter merged into its base unless --lora wants the adapter itself)."""
    kind = folders.export_kind(src)
    if want_adapter:
        if kind == "model":
            raise RecipeError(f"export --lora: '{src}' is a model, not a LoRA adapter; drop --lora to convert the model")
        if kind == "adapter":
            return src
        out = export_folder(src, work / "adapter", dtype=dtype, base=base)
        if folders.export_kind(out) != "adapter":
            raise RecipeError(f"export --lora: '{src}' holds a full model, not a LoRA adapter; drop --lora")
        return out
    if kind == "model" and dtype is None:
        return src
    out = export_folder(src, work / "hf", dtype=dtype, base=base)
    if folders.export_kind(out) == "adapter":  # a sharded LoRA checkpoint: its adapter, then merged
        out = export_folder(out, work / "hf-merged", dtype=dtype, base=base)
    return out


def _gguf_lora_adapter(adapter: Path, work: Path) -> Path:
    """The adapter as llama.cpp's LoRA converter reads it, or one line naming what a GGUF LoRA cannot hold. rsLoRA
    scales by alpha/sqrt(r) where llama.cpp scales by alpha/r: the alpha written is alpha*sqrt(r), the same scale."""
    cfg = folders.adapter_config(adapter)
    llamacpp.check_gguf_lora(cfg)
    if not cfg.get("use_rslora"):
        return adapter
    out = work / "adapter-rslora"
    out.mkdir()
    for f in adapter.iterdir():
        if f.name != "adapter_config.json":
            (out / f.name).symlink_to(f.resolve())
    cfg = cfg | {"lora_alpha": cfg["lora_alpha"] * math.sqrt(cfg["r"]), "use_rslora": False}
    (out / "adapter_config.json").write_text(json.dumps(cfg))
    return out


def _with_tokenizer(base_dir: Path, run: Path, out: Path) -> Path:
    """The base's files with the run's tokenizer files over them (links), so the base GGUF of a LoRA export carries the
    run's chat template and end tokens, as a merged export does."""
    out.mkdir()
    theirs = {f for f in TOKENIZER_FILES if (run / f).is_file()}
    for f in base_dir.iterdir():
        if f.name not in theirs and not (f.name in TOKENIZER_FILES and theirs):
            (out / f.name).symlink_to(f.resolve())
    for f in theirs:
        (out / f).symlink_to((run / f).resolve())
    return out


def _tokenizer_meta(folder: Path, model: Path) -> dict:
    """What the GGUF's metadata must say of the run's tokenizer: chat template, eos, end of turn; and the layer pattern."""
    from transformers import AutoConfig, AutoTokenizer

    from sftrecipes.data.tokenizer import end_of_turn_id

    tok = AutoTokenizer.from_pretrained(folder)
    template = tok.chat_template if isinstance(tok.chat_template, str) else None
    eot_id, eot, _ = end_of_turn_id(tok) if template else (None, None, "none")
    config = AutoConfig.from_pretrained(model)
    types = getattr(config.get_text_config(), "layer_types", None)
    return {"chat_template": template, "eos_token_id": tok.eos_token_id, "eot_token_id": eot_id,
            "stops": [t for t in dict.fromkeys((eot, tok.eos_token)) if t],
            "layer_types": list(types) if types else None}


def _convert(converter: Path, folder: Path, out: Path, quant: str, work: Path, run: Path) -> tuple[Path, dict]:
    """folder -> out at `quant`: written by the converter when it writes that type, else converted at the source's
    precision (bf16 from bf16, f32 from f32, else f16) and quantized by llama.cpp's quantizer."""
    meta = _tokenizer_meta(run if (run / "tokenizer_config.json").is_file() else folder, folder)
    if quant in llamacpp.CONVERTER_TYPES:
        done = _run_converter(converter, "hf", meta, work, [str(folder), "--outtype", quant, "--outfile", str(out)])
        return out, meta | done
    cfg = json.loads((folder / "config.json").read_text())
    stored = str(cfg.get("dtype") or cfg.get("torch_dtype") or "float16")
    step = {"bfloat16": "bf16", "float32": "f32"}.get(stored, "f16")
    inter = work / f"model-{step}.gguf"
    done = _run_converter(converter, "hf", meta, work, [str(folder), "--outtype", step, "--outfile", str(inter)])
    _quantize(inter, out, quant)
    inter.unlink()
    done["done"]["quantized_from"] = step
    return out, meta | done


def _run_converter(converter: Path, kind: str, meta: dict, work: Path, args: list[str]) -> dict:
    meta_file = work / f"meta-{kind}.json"
    meta_file.write_text(json.dumps(meta))
    env = os.environ | {"NO_LOCAL_GGUF": "1"}  # gguf-py comes from the converter's folder (gguf_convert puts it first)
    cmd = forks.python_argv(["-m", "sftrecipes.export.gguf_convert", str(converter), str(meta_file), kind, *args])
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
        last = lines[-1] if lines else f"exit status {proc.returncode}"
        if proc.returncode == 2 and last.startswith("export --to gguf:"):
            raise RecipeError(last)
        log.error("llama.cpp's converter:\n%s", "\n".join(lines[-30:]))
        raise RecipeError(f"export --to gguf: llama.cpp's converter ({'LoRA' if kind == 'lora' else 'model'}) failed: "
                          f"{last.strip()}")
    done = json.loads(meta_file.read_text())
    out = {"done": done.get("done", {})}
    if kind == "lora":
        out["alpha"] = json.loads((Path(args[0]) / "adapter_config.json").read_text())["lora_alpha"]
    return out


def _verify_in_child(work: Path, spec: dict) -> dict:
    """gguf_verify in a process of its own: llama.cpp aborts the process it runs in on some models it cannot run
    (a GGML_ASSERT), which must end as one line here, with nothing left behind, not as a core dump."""
    spec_file = work / "verify.json"
    spec_file.write_text(json.dumps(spec))
    proc = subprocess.run(forks.python_argv(["-m", "sftrecipes.export.gguf_verify", str(spec_file)]), capture_output=True,
                          text=True)
    lines = [ln.strip() for ln in proc.stderr.splitlines() if ln.strip()]
    if proc.returncode == 0:
        figures = json.loads(spec_file.read_text())["figures"]
        log.info("export --verify: %s", figures["words"])
        return figures
    if proc.returncode == 2 and lines and lines[-1].startswith("export --verify:"):
        why = next((ln for ln in reversed(lines[:-1]) if "error" in ln.lower()), None)  # llama.cpp's log, on a failed load
        raise RecipeError(lines[-1] + (f" [llama.cpp: {why[:300]}]" if why and "cannot load" in lines[-1] else ""))
    said = next((ln for ln in reversed(lines) if "GGML_ASSERT" in ln or "error" in ln.lower()), lines[-1] if lines else "")
    how = f"was stopped by signal {-proc.returncode}" if proc.returncode < 0 else f"exited with status {proc.returncode}"
    raise RecipeError(f"export --verify: llama.cpp {how} while running the GGUF ({said[:300]}); the GGUF is not kept")


def _quantize(inp: Path, out: Path, quant: str) -> None:
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llamacpp.quant_types()[quant]
    params.nthread = os.cpu_count() or 1
    rc = llama_cpp.llama_model_quantize(str(inp).encode(), str(out).encode(), params)
    if rc != 0 or not out.is_file():
        raise RecipeError(f"export --quant {quant}: llama.cpp's quantizer refused it (status {rc}; the iq1/iq2 types "
                          "need an importance matrix, which export does not compute); use q4_k_m, q5_k_m, q6_k or q8_0")


def _modelfile(folder: Path, model: Path, lora: Path | None, meta: dict) -> None:
    lines = ["# ollama create NAME -f Modelfile   (from this folder)",
             "# Ollama reads the chat template from the GGUF's metadata (tokenizer.chat_template).",
             f"FROM ./{model.name}"]
    if lora is not None:
        lines.append(f"ADAPTER ./{lora.name}")
    lines += [f"PARAMETER stop {json.dumps(s)}" for s in meta["stops"]]
    (folder / "Modelfile").write_text("\n".join(lines) + "\n")

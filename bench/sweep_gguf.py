"""The compatibility sweep's GGUF column (`make sweep-gguf`, bench/sweep.py --gguf): one architecture's tiny model
through the real `python -m sftrecipes export MODEL DEST --to gguf --quant f32 --verify`, and what became of it in one
line (`outcome`), with the table's cell and headline drawn from the rows (`cell`, `headline`).

f32 is the type swept: the converter writes every weight exactly, so the bound --verify holds it to is tight (2e-3 of
the logit scale) and a mismatch means llama.cpp computes another model than transformers does.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

QUANT = "f32"
# the row's keys this column owns (kept when the architecture reruns in one process with the same tiny model)
KEYS = ("gguf", "gguf_error", "gguf_class", "gguf_release", "gguf_seconds", "gguf_commit")
# the reasons' kinds, in the headline's order; "verified" is the pass
KINDS = ("no converter class", "converter needs the family's tokenizer", "pre-tokenizer refused", "converter failed",
         "llama.cpp cannot load it", "llama.cpp aborted", "metadata", "tokenization mismatch", "logit mismatch", "crash",
         "timeout", "tiny model")
# a converter failure on the tokenizer files, not the architecture: every tiny model has the tiny Llama's byte-level
# BPE tokenizer, where the converter of some families reads a SentencePiece model or special tokens of their own
FAMILY_TOKENIZER = re.compile(r"tokenizer|add_bos_token|KeyError: '(<\|[^']*\|>|\[[^']*\])'", re.I)


def converter_class(folder: Path, converter: Path) -> tuple[str, bool]:
    """The class name llama.cpp's converter reads from the folder's config (its own load_hparams and
    get_model_architecture, as convert_hf_to_gguf.py does), and whether its registry (conversion.TEXT_MODEL_MAP)
    has a class for it."""
    for p in (str(converter / "gguf-py"), str(converter)):
        if p not in sys.path:
            sys.path.insert(0, p)
    import conversion

    hparams = conversion.ModelBase.load_hparams(folder, False)
    name = conversion.get_model_architecture(hparams, conversion.ModelType.TEXT)
    return name, name in conversion.TEXT_MODEL_MAP


def _said(stderr: str) -> str:
    """The export's own one-line error, else llama.cpp's assertion or the last exception line, else the last line;
    an exception without a message gets the source line that raised it (its traceback's last frame)."""
    lines = [x.strip() for x in stderr.splitlines() if x.strip()]
    said = lines[-1] if lines else "no output"
    for pick in (lambda x: x.startswith("error: "), lambda x: "GGML_ASSERT" in x,
                 lambda x: re.search(r"\w(Error|Exception)(:|$)", x) is not None):
        hits = [x for x in lines if pick(x)]
        if hits:
            said = hits[-1].removeprefix("error: ")
            break
    said = re.sub(r"\S*/vendor/llama\.cpp/", "", said)  # (the build folder of llama.cpp's sources: gone, says nothing)
    frames = [i for i, x in enumerate(lines) if x.startswith('File "')]
    if re.search(r"\b\w+(Error|Exception)$", said) and frames and frames[-1] + 1 < len(lines):
        where = re.match(r'File "(?:.*/llama\.cpp-[^/]+/)?([^"]+)", line (\d+)', lines[frames[-1]])
        said += f" ({where.group(1)}:{where.group(2)}: {lines[frames[-1] + 1]})" if where else f" ({lines[frames[-1] + 1]})"
    return said


def outcome(rc: int, stderr: str, record: dict | None, klass: str, registered: bool) -> dict:
    """The column's keys from one export: {"gguf": "verified", "gguf_error": the max logit error relative to the
    scale} or {"gguf": "<kind>: <one line>"} (with "gguf_error" where --verify measured one)."""
    if rc == 0 and record and "verify" in record:
        return {"gguf": "verified", "gguf_error": record["verify"]["max_rel_logit_error"]}
    said = _said(stderr)
    if rc == 0:
        return {"gguf": f"crash (exit 0): no verify figures written ({said})"[:300]}
    if not registered:
        told = "" if f"Model {klass} is not supported" in said else f" ({said})"  # (the converter said so: no more)
        return {"gguf": f"no converter class: llama.cpp's converter has none for {klass}{told}"[:300]}
    out: dict = {}
    if "does not match transformers" in said:
        words = said.split("does not match transformers: ", 1)[-1]
        m = re.search(r"max logit error ([0-9.eE+-]+) of scale", words)
        if m:
            out["gguf_error"] = float(m.group(1))
        kind, why = "logit mismatch", words
    elif "tokenizes" in said and "differently" in said:
        kind, why = "tokenization mismatch", said.removeprefix("export --verify: ")
    elif said.startswith("export --verify: the GGUF's metadata"):
        kind, why = "metadata", said.removeprefix("export --verify: the GGUF's metadata: ")
    elif "llama.cpp's converter (model) failed: " in said:
        why = said.split("failed: ", 1)[1]
        kind = "converter needs the family's tokenizer" if FAMILY_TOKENIZER.search(why) else "converter failed"
    elif said.startswith("export --to gguf: ") and ("tokenizer's hash" in said or "tokenizer normalizes" in said):
        kind, why = "pre-tokenizer refused", said.removeprefix("export --to gguf: ")  # (gguf_convert.recognise's lines)
    elif "Failed to load model" in said:  # (the export adds llama.cpp's own reason in [llama.cpp: ...])
        kind, why = "llama.cpp cannot load it", re.sub(r"^export --verify: llama\.cpp cannot load the GGUF \(Failed to load "
                                                       r"model from file: \S+\.gguf\) \[llama\.cpp: (.*)\]$", r"\1", said)
    elif "GGML_ASSERT" in said:
        kind, why = "llama.cpp aborted", re.sub(r"^export --verify: llama\.cpp was stopped by (signal \d+) while running "
                                                r"the GGUF \(?(.*?)\)?; the GGUF is not kept$", r"\1: \2", said)
    else:
        kind, why = "crash", f"exit {rc}: {said}"
    return {**out, "gguf": f"{kind}: {why}"[:300]}


def gguf_one(folder: Path, work: Path, timeout: float) -> dict:
    """The tiny model in folder through the real CLI (its own session, killed whole past `timeout`): the column's keys."""
    from sftrecipes.facts import llamacpp

    klass, registered = converter_class(folder, llamacpp.converter_dir())
    dest = work / "gguf"
    proc = subprocess.Popen([sys.executable, "-m", "sftrecipes", "export", str(folder), str(dest), "--to", "gguf",
                             "--quant", QUANT, "--verify"], cwd=Path(__file__).resolve().parents[1], text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        _, stderr = proc.communicate(timeout=max(1.0, timeout))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the converter's and the verifier's children with it
        proc.communicate()
        return {"gguf": f"timeout: the export ran over {timeout:.0f} s", "gguf_class": klass}
    record = json.loads((dest / "gguf_export.json").read_text()) if (dest / "gguf_export.json").is_file() else None
    stderr = stderr.replace(f"{folder.resolve()}/", "MODEL/").replace(f"{folder}/", "MODEL/")  # (a temporary folder)
    return {**outcome(proc.returncode, stderr, record, klass, registered), "gguf_class": klass,
            "gguf_release": llamacpp.RELEASE}


def run(mt: str, work: Path, timeout: float, save_tiny) -> dict:
    """One architecture: its tiny model built by the sweep's save_tiny, then exported; the export's time budget is
    what is left of `timeout` once the model is built."""
    t0 = time.time()
    save_tiny(mt, work / "model")
    return gguf_one(work / "model", work, timeout - (time.time() - t0))


def about() -> str:
    """The column's sentences in the table's header."""
    from sftrecipes.export.gguf_verify import tolerance

    return ("*GGUF* (`bench/sweep.py --gguf`, a column of its own, not part of *pass*): the same tiny model through "
            f"`python -m sftrecipes export MODEL DEST --to gguf --quant {QUANT} --verify`, llama.cpp's own converter then "
            "its runtime against transformers on the probe conversations: *verified* with the largest logit error "
            f"relative to the logit scale (bound {tolerance(QUANT):g}), or what stopped it (*no converter class*: the "
            "class named in config.json is not in the converter's registry, `conversion.TEXT_MODEL_MAP`). Every tiny "
            "model carries the tiny Llama's byte-level BPE tokenizer, whatever tokenizer its family ships: *converter "
            "needs the family's tokenizer* says where that, not the architecture, stopped the converter.")


def cell(row: dict) -> str:
    """The table's GGUF cell: "verified (max error E)", the reason, or empty where the column has not run."""
    got = row.get("gguf")
    if not got:
        return ""
    return f"verified ({row['gguf_error']:.1e})" if got == "verified" else got


def headline(alone: list[dict]) -> str:
    """The GGUF line over the rows that pass in one process: N of M verified, the failures by kind, the minutes."""
    ran = [r for r in alone if r.get("gguf")]
    if not ran:
        return ""
    verified = [r for r in ran if r["gguf"] == "verified"]
    kinds: dict[str, int] = {}
    for r in ran:
        if r["gguf"] != "verified":
            kind = r["gguf"].split(":", 1)[0]
            kinds[kind] = kinds.get(kind, 0) + 1
    order = {k: i for i, k in enumerate(KINDS)}
    releases = sorted({r["gguf_release"] for r in ran if r.get("gguf_release")}) or ["?"]
    minutes = sum(r.get("gguf_seconds", 0) for r in ran) / 60
    return (f"**GGUF: {len(verified)} of {len(ran)} convert and verify in llama.cpp (llama-cpp-python "
            f"{', '.join(releases)})** (`export --to gguf --quant {QUANT} --verify`, one at a time; {minutes:.0f} min of "
            "runs on this machine)."
            + (" Not verified: " + ", ".join(f"{k} ({n})" for k, n in sorted(kinds.items(), key=lambda x: (order.get(x[0], 99), x[0])))
               + "." if kinds else "")
            + (f" {len(alone) - len(ran)} passing in one process not run yet." if len(ran) < len(alone) else ""))

"""The compatibility sweep (`make sweep`, not in `make test`): every architecture in transformers' causal-LM auto
mapping, as a user would bring it. For each decoder-only text architecture: a tiny random-init model from its config
class (sftrecipes.tiny_archs.tiny_config, the tiny Llama's tokenizer), LoRA trained 3 steps in one process with
recipes/tiny/lora.yaml (only model_name_or_path changed), the adapter merged with --verify, and the planner's counts
held against the meta model's and the run's; apart, each passing one on 2 ranks (--two-ranks) and as a GGUF verified in
llama.cpp (--gguf). Writes docs/generated/architectures.md.

    python bench/sweep.py [--jobs 2] [--only llama,qwen3] [--timeout 600] [--fresh] [--table]
      (--only: run those entries again, their rows replaced; the table is rewritten from every row kept)
    python bench/sweep.py --two-ranks [--only a,b] [--twins zero3]   (the passing ones on 2 ranks: ZeRO-3 and FSDP2
      twins, or those named; each twin's result and commit kept apart)
    python bench/sweep.py --gguf [--only a,b] [--timeout 180]   (the passing ones through `export --to gguf --quant f32
      --verify` in llama.cpp, one at a time: the table's GGUF column, bench/sweep_gguf.py; not part of "pass")
    python bench/sweep.py --one ARCH --work DIR        (one architecture, in its own process: prints one JSON line)

Each row is kept in outputs/sweep/<arch>.json as it completes, and the table is rewritten after each: a stopped
sweep leaves a table of what it ran (marked partial) and the next run goes on from there (--fresh: from scratch).
A row run again in one process keeps its 2-rank results only where its tiny model is the same (`tiny_config`, a
fingerprint of the config tiny_archs.tiny_config made); another model is launched again by --two-ranks.
The rows behind the table are also written to docs/generated/architectures.json (committed): on a clone without
outputs/sweep/, --only, --two-ranks and --table start from those rows, so one architecture rerun replaces its row in
the whole table; a plain sweep starts from outputs/sweep/ only (a fresh clone runs every entry).
The entries left out are listed with why (encoder-decoder, an encoder with a causal head, speech/audio); every other
row passes or names its reason in one line.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from sftrecipes.core.paths import SWEEP_DOC as OUT  # noqa: E402 - after the path the package is found on
from sftrecipes.core.paths import SWEEP_ROWS as ROWS  # noqa: E402

import sweep_gguf  # noqa: E402 - bench/, this script's own folder
PARAM_TOL = 1e-3  # the plan's parameters within 0.1% of the meta model's


def _one_line(e: BaseException) -> str:
    """An exception as one table cell: its type and its first lines joined (a validator's name says little alone)."""
    lines = [x.strip() for x in str(e).strip().splitlines() if x.strip()]
    return f"{type(e).__name__}: {' '.join(lines[:3])}"[:300]


def left_out(mt: str) -> str | None:
    """Why an entry of the causal-LM mapping is not a decoder-only text model this sweep trains, or None."""
    from transformers import AutoConfig

    from sftrecipes.model.meta import build, decoder_layers

    cfg = AutoConfig.for_model(mt)
    d = cfg.to_dict()
    if getattr(cfg, "is_encoder_decoder", False):
        return "encoder-decoder model (not decoder-only)"
    if any(k in d for k in ("audio_config", "speech_config", "codec_config", "depth_decoder_config")):
        return "speech/audio model (an audio tower or codec beside the text decoder)"
    try:
        prefix, _ = decoder_layers(build(cfg))
    except Exception:  # noqa: BLE001 - built again below, where the failure is reported
        return None
    if "encoder" in prefix.split("."):
        return "an encoder (BERT-style) with a causal head: its layers are an encoder's"
    return None


def save_tiny(mt: str, folder: Path) -> tuple[str, int, str]:
    """A tiny random-init model of the architecture saved to folder with the tiny Llama's tokenizer: (its class name,
    its parameter count, a fingerprint of its config: the rows' 2-rank results are kept only for the same model)."""
    import hashlib

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from sftrecipes.tiny import ensure_tiny_model
    from sftrecipes.tiny_archs import tiny_config

    tok = AutoTokenizer.from_pretrained(ensure_tiny_model())
    c = tiny_config(mt, vocab_size=len(tok), token_ids=(tok.bos_token_id, tok.eos_token_id, tok.pad_token_id))
    torch.manual_seed(0)
    cfg = AutoConfig.for_model(**c)
    model = AutoModelForCausalLM.from_config(cfg)
    model.save_pretrained(folder)
    if model.config.model_type != cfg.model_type:  # Emu3ForCausalLM saves its text config (emu3_text_model), which
        cfg.save_pretrained(folder)                # no auto class maps: the hub's checkpoints carry the whole one
    tok.save_pretrained(folder)
    fingerprint = hashlib.sha256(json.dumps(c, sort_keys=True, default=str).encode()).hexdigest()[:12]
    return type(model).__name__, sum(p.numel() for p in model.parameters()), fingerprint


# the 2-rank twins a copy launches with only model_name_or_path changed (--two-ranks): ZeRO-3 LoRA, FSDP2 full
TWINS = ("zero3", "fsdp")


def two_ranks_one(mt: str, work: Path, twins: tuple[str, ...] = TWINS) -> dict:
    """The architecture's tiny model launched on 2 ranks with each twin (python -m sftrecipes launch, 2 steps): per
    twin "pass" or the run's last line."""
    import socket

    folder = work / "model"
    save_tiny(mt, folder)
    out = {}
    for twin in twins:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        res = subprocess.run([sys.executable, "-m", "sftrecipes", "launch", f"recipes/tiny/{twin}.yaml", "--model_name_or_path",
                              str(folder), "--output_dir", str(work / twin), "--max_steps", "2", "--save_strategy", "no",
                              "--sample_max_new_tokens", "0"], cwd=ROOT, capture_output=True, text=True, timeout=600,
                             env={**os.environ, "MAIN_PROCESS_PORT": str(port)})
        lines = [x.strip() for x in res.stderr.splitlines() if x.strip()]
        # the rank's own one-line error, else the last exception line (torch's agent ends with a ==== banner)
        said = [x for x in lines if x.startswith("error:")] or [
            x for x in lines if re.search(r"\w(Error|Exception)(:|$)", x) and "ChildFailedError" not in x]  # (a bare AssertionError too)
        last = (said or lines or ["no output"])[-1][:300]
        out[twin] = "pass" if res.returncode == 0 else f"exit {res.returncode}: {last}"
    return out


def run_one(mt: str, work: Path) -> dict:
    """Everything for one architecture, in this process; the row as a dict."""
    import train
    from sftrecipes.model import meta
    from sftrecipes.export import merge_lora
    from sftrecipes.plan import plan_recipe
    from sftrecipes.recipe.load import load_recipe
    from sftrecipes.facts.config import model_shape
    row: dict = {"arch": mt, "result": "fail", "reason": "", "class": "", "attention": "", "targets": "", "note": ""}
    try:
        why = left_out(mt)
    except Exception as e:  # noqa: BLE001 - the config class itself fails: a row naming why
        row["reason"] = f"config class: {_one_line(e)}"
        return row
    if why:
        return {**row, "result": "left out", "reason": why}
    folder = work / "model"
    try:
        row["class"], real, row["tiny_config"] = save_tiny(mt, folder)
    except Exception as e:  # noqa: BLE001 - any failure to build the tiny model is this row's reason
        row["reason"] = f"tiny model: {_one_line(e)}"
        return row
    args = ["recipes/tiny/lora.yaml", "--model_name_or_path", str(folder), "--output_dir", str(work / "run"),
            "--max_steps", "3", "--logging_steps", "1", "--sample_max_new_tokens", "0"]
    try:
        recipe = load_recipe(args)
        plan = plan_recipe(recipe, _alternatives=False)
        shape = model_shape(str(folder))
        row["plan_params"], row["meta_params"], row["params"] = plan.params, real, real
        row["plan_trainable"] = plan.trainable
        layout = meta.lora_layout(recipe, shape) if shape.source == "meta" else None
        leaves = sorted({w.leaf for layer in (layout.adapted if layout else shape.lora_targets("all-linear")) for w, _ in layer})
        row["targets"] = ",".join(leaves)
    except Exception as e:  # noqa: BLE001 - the planner's failure is this row's reason
        row["reason"] = f"plan: {_one_line(e)}"
        return row
    try:
        why = shape.unpacked if recipe.trl_value("packing") or recipe.trl_value("padding_free") else ""
        _, summary = train.run(recipe)  # packing falls back to padded rows where why is set (model.packing_fallback)
        if why:
            row["note"] = f"packing fell back to padded rows ({why})"
        row["attention"] = summary.get("attention", "")
        row["run_trainable"] = summary["backend"]["trainable_elements_full"]
        out = Path(recipe.trl["output_dir"])
    except Exception as e:  # noqa: BLE001 - the run's failure is this row's reason
        row["reason"] = f"train: {_one_line(e)}"
        return row
    try:
        merge_lora(out, work / "merged", verify=True)
    except Exception as e:  # noqa: BLE001 - the merge's failure is this row's reason
        row["reason"] = f"merge --verify: {_one_line(e)}"
        return row
    exact = abs(row["plan_params"] - real) <= PARAM_TOL * real and row["plan_trainable"] == row["run_trainable"]
    row["plan_exact"] = exact
    if not exact:
        row["reason"] = (f"plan: {row['plan_params']:,} params / {row['plan_trainable']:,} trainable against the model's "
                         f"{real:,} / the run's {row['run_trainable']:,}")
        return row
    row["result"] = "pass"
    return row


SECONDS = {"--one": "seconds", "--two-ranks-one": "two_ranks_seconds", "--gguf-one": "gguf_seconds"}  # a mode's time key


def _worker(mt: str, timeout: int, mode: str = "--one", extra: tuple[str, ...] = ()) -> dict:
    with tempfile.TemporaryDirectory(prefix=f"sweep-{mt}-") as d:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
        t0 = time.time()
        try:
            res = subprocess.run([sys.executable, __file__, mode, mt, "--work", d, *extra], cwd=ROOT, capture_output=True,
                                 text=True, timeout=timeout, env=env)
        except subprocess.TimeoutExpired:
            if mode == "--gguf-one":
                return {"arch": mt, "gguf": f"timeout: over {timeout} s", "gguf_seconds": timeout}
            if mode != "--one":
                return {"arch": mt, **{t: f"timeout: over {timeout} s" for t in TWINS}}
            return {"arch": mt, "result": "fail", "reason": f"timeout: over {timeout} s", "seconds": timeout}
        lines = [x for x in res.stdout.splitlines() if x.startswith("SWEEP ")]
        if not lines:
            tail = (res.stderr.strip().splitlines() or ["no output"])[-1][:300]
            return {"arch": mt, "result": "fail", "reason": f"crashed (exit {res.returncode}): {tail}",
                    "seconds": round(time.time() - t0)}
        row = json.loads(lines[-1][len("SWEEP "):])
        row[SECONDS[mode]] = round(time.time() - t0)
        return row


def commit() -> str:
    """The commit the rows are measured at (short hash, "+changes" where tracked files other than the sweep's own
    output differ from it)."""
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".", ":!docs/generated"],  # (its own output)
                           cwd=ROOT, capture_output=True, text=True).stdout.strip()
    return (head or "unknown") + ("+changes" if dirty else "")


CACHE = ROOT / "outputs" / "sweep"


def overall(row: dict) -> str:
    """A row's result in the table: one process's (train, merge --verify, plan exact), and a fail where a 2-rank twin
    it was launched with failed -- a copied twin must launch any architecture the table calls passing."""
    if row["result"] == "pass" and any(v != "pass" for v in (row.get("two_ranks") or {}).values()):
        return "fail"
    return row["result"]


def write_table(rows: list[dict], seconds: float, total: int) -> None:
    tested = [r for r in rows if r["result"] != "left out"]
    alone = [r for r in tested if r["result"] == "pass"]  # in one process
    passed = [r for r in alone if overall(r) == "pass"]
    launched = [r for r in alone if r.get("two_ranks")]
    both = [r for r in launched if all(v == "pass" for v in r["two_ranks"].values())]
    def at(key: str, of: list[dict]) -> str:
        counts: dict[str, int] = {}
        for r in of:
            got = r.get(key) or "unrecorded"
            for c in ([f"{t} {c}" for t, c in sorted(got.items())] if isinstance(got, dict) else [got]):
                counts[c] = counts.get(c, 0) + 1
        return ", ".join(f"{c} ({n})" for c, n in sorted(counts.items(), key=lambda x: (-x[1], x[0])))

    out = ["<!-- generated by make sweep (bench/sweep.py): do not edit -->", "# Architectures: the compatibility sweep", "",
           f"Every entry of transformers' causal-LM auto mapping ({total}), as `make sweep` runs it: a tiny random-init "
           "model from the config class, LoRA 3 steps in one process with `recipes/tiny/lora.yaml` (only "
           "`model_name_or_path` changed), merged with `--verify`; *plan exact*: the planner's parameters within 0.1% "
           "of the meta model's and its trainable count equal to the run's. *2 ranks*: the same tiny model launched with "
           "`python -m sftrecipes launch` on 2 CPU ranks with the ZeRO-3 LoRA twin and the FSDP2 twin "
           "(`recipes/tiny/zero3.yaml`, `fsdp.yaml`; only `model_name_or_path` changed), 2 steps (`bench/sweep.py "
           "--two-ranks`): *both*, or each twin's last line. *pass*: all of these; an architecture that passes in one "
           "process and fails a twin is a fail, the twin's line its reason. " + sweep_gguf.about(), "",
           f"**{len(passed)} of {len(tested)} decoder-only text architectures pass ({100 * len(passed) / max(len(tested), 1):.0f}%)**; "
           f"{len(rows) - len(tested)} entries left out (listed last, with why); {seconds / 60:.0f} min of runs on this machine. "
           f"In one process {len(alone)} pass; on 2 ranks {len(both)} of the {len(launched)} launched train with both twins"
           + ("" if len(launched) == len(alone) else f" ({len(alone) - len(launched)} not launched yet)") + "."
           + ("" if len(rows) >= total else f" **Partial: {len(rows)} of the {total} entries ran** (`make sweep` goes on "
              "from here)."), ""]
    gguf = sweep_gguf.headline(alone)
    converted = [r for r in alone if r.get("gguf")]
    out += ([gguf, ""] if gguf else []) + [
           f"Measured at commit (rows): {at('commit', rows)}" + (f"; on 2 ranks: {at('two_ranks_commit', launched)}" if launched else "")
           + (f"; GGUF: {at('gguf_commit', converted)}" if converted else "") + ".", "",
           "| architecture | class | result | attention | LoRA targets | plan exact | 2 ranks | GGUF | reason / note |",
           "|---|---|---|---|---|---|---|---|---|"]
    order = {"pass": 0, "fail": 1, "left out": 2}
    for r in sorted(rows, key=lambda r: (order[overall(r)], r["arch"])):
        exact = {True: "yes", False: "no"}.get(r.get("plan_exact"), "")
        two = r.get("two_ranks") or {}
        failed = [f"{t}: {v}" for t, v in two.items() if v != "pass"]
        ranks = ("" if not two else "both" if not failed else "; ".join(failed)).replace("|", "\\|")
        why = (r.get("reason") or r.get("note") or (f"2 ranks, {failed[0]}" if failed else "")).replace("|", "\\|")
        gg = sweep_gguf.cell(r).replace("|", "\\|")
        out.append(f"| {r['arch']} | {r.get('class', '')} | {overall(r)} | {r.get('attention', '')} | "
                   f"{r.get('targets', '').replace(',', ', ')} | {exact} | {ranks} | {gg} | {why} |")
    OUT.write_text("\n".join(out) + "\n")
    ROWS.write_text(json.dumps({"entries": total, "seconds": round(seconds, 1), "rows": sorted(rows, key=lambda r: r["arch"])},
                               indent=1, default=str) + "\n")


def gguf_column(done: dict, archs: list[str], only: list[str] | None, at: str, timeout: int, table) -> int:
    """--gguf: each architecture that passes in one process (those of --only, else those without a GGUF result)
    exported to GGUF and verified in its own process, one at a time (llama.cpp's runtime takes every core); the row
    gains the column's keys, its one-process result untouched."""
    skipped = [a for a in (only or []) if done.get(a, {}).get("result") != "pass"]
    if skipped:
        print(f"sweep --gguf: not passing in one process, not exported: {', '.join(skipped)}", flush=True)
    todo = [a for a in (only or archs) if done.get(a, {}).get("result") == "pass"
            and (only is not None or not done[a].get("gguf"))]
    print(f"sweep --gguf: {len(todo)} passing architectures to export", flush=True)
    for mt in todo:
        got = _worker(mt, timeout + 60, "--gguf-one", ("--timeout", str(timeout)))  # (+ the tiny model's build)
        for key in sweep_gguf.KEYS:
            done[mt].pop(key, None)
        done[mt].update({k: got[k] for k in sweep_gguf.KEYS if got.get(k) is not None})
        if "gguf" not in got:  # the worker crashed before answering
            done[mt]["gguf"] = f"crash: {got.get('reason', 'no answer')}"[:300]
        done[mt]["gguf_seconds"] = got.get("gguf_seconds", got.get("seconds", 0))
        done[mt]["gguf_commit"] = at
        (CACHE / f"{mt}.json").write_text(json.dumps(done[mt], default=str))
        print(f"{mt:<28} {done[mt]['gguf_seconds']:>4}s {sweep_gguf.cell(done[mt])}", flush=True)
        table()
    table()
    print(f"wrote {OUT.relative_to(ROOT)}")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--one")
    ap.add_argument("--work")
    ap.add_argument("--only")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--timeout", type=int, default=None, help="seconds an entry may run (default 600; --gguf: 180)")
    ap.add_argument("--fresh", action="store_true")
    ap.add_argument("--table", action="store_true", help="only rewrite the table from the rows kept in outputs/sweep/")
    ap.add_argument("--two-ranks", action="store_true", help="launch the passing architectures (or --only) on 2 ranks "
                    "with the ZeRO-3 and FSDP2 twins; one at a time (each uses 2 processes)")
    ap.add_argument("--two-ranks-one")
    ap.add_argument("--twins", default=",".join(TWINS), help="with --two-ranks: the twins to launch (the others' results kept)")
    ap.add_argument("--gguf", action="store_true", help="export the passing architectures (or --only) to GGUF with "
                    "--quant f32 --verify in llama.cpp, one at a time: the table's GGUF column")
    ap.add_argument("--gguf-one")
    ns = ap.parse_args()
    ns.timeout = ns.timeout or (180 if ns.gguf or ns.gguf_one else 600)
    if ns.gguf_one:
        try:
            got = sweep_gguf.run(ns.gguf_one, Path(ns.work), ns.timeout, save_tiny)
        except Exception as e:  # noqa: BLE001 - the worker always answers with a row
            traceback.print_exc()
            got = {"gguf": f"tiny model: {_one_line(e)}"}
        print("SWEEP " + json.dumps({"arch": ns.gguf_one, **got}, default=str), flush=True)
        return 0
    if ns.two_ranks_one:
        try:
            got = two_ranks_one(ns.two_ranks_one, Path(ns.work), tuple(ns.twins.split(",")))
        except Exception as e:  # noqa: BLE001 - the worker always answers with a row
            traceback.print_exc()
            got = {t: f"tiny model: {_one_line(e)}" for t in ns.twins.split(",")}
        print("SWEEP " + json.dumps({"arch": ns.two_ranks_one, **got}, default=str), flush=True)
        return 0
    if ns.one:
        try:
            row = run_one(ns.one, Path(ns.work))
        except Exception as e:  # noqa: BLE001 - the worker always answers with a row
            traceback.print_exc()
            row = {"arch": ns.one, "result": "fail", "reason": _one_line(e)}
        print("SWEEP " + json.dumps(row, default=str), flush=True)
        return 0
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from sftrecipes.tiny import ensure_tiny_model

    ensure_tiny_model()
    archs = sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    only = [a for a in archs if a in ns.only.split(",")] if ns.only else None
    CACHE.mkdir(parents=True, exist_ok=True)
    if ns.fresh:
        for f in CACHE.glob("*.json"):
            f.unlink()
    done = {json.loads(f.read_text())["arch"]: json.loads(f.read_text()) for f in CACHE.glob("*.json")}
    if not done and (ns.only or ns.two_ranks or ns.gguf or ns.table) and ROWS.exists():  # a clone: the committed rows
        done = {r["arch"]: r for r in json.loads(ROWS.read_text())["rows"]}
        for r in done.values():
            (CACHE / f"{r['arch']}.json").write_text(json.dumps(r, default=str))
        print(f"sweep: outputs/sweep/ started from the {len(done)} rows of {ROWS.relative_to(ROOT)}", flush=True)
    # --only runs those entries again (their rows replaced); otherwise what has not run yet
    todo = [] if ns.table else only if only is not None else [a for a in archs if a not in done]
    print(f"sweep: {len(done)} of {len(archs)} already ran (outputs/sweep/), {len(todo)} to run", flush=True)
    at = commit()

    def table() -> None:
        rows = [done[a] for a in archs if a in done]
        write_table(rows, sum(r.get("seconds", 0) for r in rows) / ns.jobs, len(archs))

    if ns.two_ranks:
        todo = [a for a in (only or archs) if done.get(a, {}).get("result") == "pass"
                and (only is not None or not done[a].get("two_ranks"))]
        print(f"sweep --two-ranks: {len(todo)} passing architectures to launch", flush=True)
        twins = tuple(t for t in TWINS if t in ns.twins.split(","))
        for mt in todo:
            got = _worker(mt, 2 * ns.timeout, "--two-ranks-one", ("--twins", ",".join(twins)))
            before, when = done[mt].get("two_ranks") or {}, done[mt].get("two_ranks_commit") or {}
            if isinstance(when, str):  # (rows written before each twin kept its own)
                when = {t: when for t in before}
            done[mt]["two_ranks"] = {**before, **{t: got.get(t, got.get("reason", "no answer")) for t in twins}}
            done[mt]["two_ranks_seconds"] = got.get("two_ranks_seconds", 0)
            done[mt]["two_ranks_commit"] = {**when, **dict.fromkeys(twins, at)}
            (CACHE / f"{mt}.json").write_text(json.dumps(done[mt], default=str))
            print(f"{mt:<28} {done[mt]['two_ranks']}", flush=True)
            table()
        print(f"wrote {OUT.relative_to(ROOT)}")
        return 0
    if ns.gguf:
        return gguf_column(done, archs, only, at, ns.timeout, table)
    with ThreadPoolExecutor(ns.jobs) as pool:
        for row in pool.map(lambda a: _worker(a, ns.timeout), todo):
            row["commit"] = at
            before = done.get(row["arch"], {})
            same = before.get("tiny_config") == row.get("tiny_config")  # the same tiny model (rows without one: another)
            for key in ("two_ranks", "two_ranks_seconds", "two_ranks_commit", *sweep_gguf.KEYS):  # the 2-rank and GGUF
                if before.get(key) is not None and row["result"] == "pass" and same:          # columns: by their own modes
                    row[key] = before[key]
            (CACHE / f"{row['arch']}.json").write_text(json.dumps(row, default=str))
            done[row["arch"]] = row
            print(f"{row['arch']:<28} {row['result']:<9} {row.get('seconds', 0):>4}s {row.get('reason') or row.get('note') or ''}", flush=True)
            table()
    table()
    print(f"wrote {OUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

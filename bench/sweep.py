"""The compatibility sweep (`make sweep`, not in `make test`): every architecture in transformers' causal-LM auto
mapping, as a user would bring it. For each decoder-only text architecture: a tiny random-init model from its config
class (sftrecipes.tiny.tiny_config, the tiny Llama's tokenizer), LoRA trained 3 steps in one process with
recipes/tiny/lora.yaml (only model_name_or_path changed), the adapter merged with --verify, and the planner's counts
held against the meta model's and the run's. Writes docs/generated/architectures.md.

    python bench/sweep.py [--jobs 2] [--only llama,qwen3] [--timeout 600] [--fresh] [--table]
      (--only: run those entries again, their rows replaced; the table is rewritten from every row kept)
    python bench/sweep.py --one ARCH --work DIR        (one architecture, in its own process: prints one JSON line)

Each row is kept in outputs/sweep/<arch>.json as it completes, and the table is rewritten after each: a stopped
sweep leaves a table of what it ran (marked partial) and the next run goes on from there (--fresh: from scratch).
The entries left out are listed with why (encoder-decoder, an encoder with a causal head, speech/audio); every other
row passes or names its reason in one line.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from sftrecipes.paths import SWEEP_DOC as OUT  # noqa: E402 - after the path the package is found on
PARAM_TOL = 1e-3  # the plan's parameters within 0.1% of the meta model's


def _one_line(e: BaseException) -> str:
    """An exception as one table cell: its type and its first lines joined (a validator's name says little alone)."""
    lines = [x.strip() for x in str(e).strip().splitlines() if x.strip()]
    return f"{type(e).__name__}: {' '.join(lines[:3])}"[:300]


def left_out(mt: str) -> str | None:
    """Why an entry of the causal-LM mapping is not a decoder-only text model this sweep trains, or None."""
    from transformers import AutoConfig

    from sftrecipes.meta import build, decoder_layers

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


def run_one(mt: str, work: Path) -> dict:
    """Everything for one architecture, in this process; the row as a dict."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    import train
    from sftrecipes import meta
    from sftrecipes.export import merge_lora
    from sftrecipes.plan import plan_recipe
    from sftrecipes.recipe import load_recipe
    from sftrecipes.shape import model_shape
    from sftrecipes.tiny import ensure_tiny_model, tiny_config

    row: dict = {"arch": mt, "result": "fail", "reason": "", "class": "", "attention": "", "targets": "", "note": ""}
    try:
        why = left_out(mt)
    except Exception as e:  # noqa: BLE001 - the config class itself fails: a row naming why
        row["reason"] = f"config class: {_one_line(e)}"
        return row
    if why:
        return {**row, "result": "left out", "reason": why}
    tok = AutoTokenizer.from_pretrained(ensure_tiny_model())
    folder = work / "model"
    try:
        c = tiny_config(mt, vocab_size=len(tok), token_ids=(tok.bos_token_id, tok.eos_token_id, tok.pad_token_id))
        torch.manual_seed(0)
        cfg = AutoConfig.for_model(**c)
        model = AutoModelForCausalLM.from_config(cfg)
        row["class"] = type(model).__name__
        model.save_pretrained(folder)
        if model.config.model_type != cfg.model_type:  # Emu3ForCausalLM saves its text config (emu3_text_model), which
            cfg.save_pretrained(folder)                # no auto class maps: the hub's checkpoints carry the whole one
        tok.save_pretrained(folder)
        real = sum(p.numel() for p in model.parameters())
        del model
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
        why = meta.packing_blocker(recipe, type(meta.build(AutoConfig.from_pretrained(folder))))
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


def _worker(mt: str, timeout: int) -> dict:
    with tempfile.TemporaryDirectory(prefix=f"sweep-{mt}-") as d:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
        t0 = time.time()
        try:
            res = subprocess.run([sys.executable, __file__, "--one", mt, "--work", d], cwd=ROOT, capture_output=True,
                                 text=True, timeout=timeout, env=env)
        except subprocess.TimeoutExpired:
            return {"arch": mt, "result": "fail", "reason": f"timeout: over {timeout} s", "seconds": timeout}
        lines = [x for x in res.stdout.splitlines() if x.startswith("SWEEP ")]
        if not lines:
            tail = (res.stderr.strip().splitlines() or ["no output"])[-1][:300]
            return {"arch": mt, "result": "fail", "reason": f"crashed (exit {res.returncode}): {tail}",
                    "seconds": round(time.time() - t0)}
        row = json.loads(lines[-1][len("SWEEP "):])
        row["seconds"] = round(time.time() - t0)
        return row


CACHE = ROOT / "outputs" / "sweep"


def write_table(rows: list[dict], seconds: float, total: int) -> None:
    tested = [r for r in rows if r["result"] != "left out"]
    passed = [r for r in tested if r["result"] == "pass"]
    out = ["<!-- generated by make sweep (bench/sweep.py): do not edit -->", "# Architectures: the compatibility sweep", "",
           f"Every entry of transformers' causal-LM auto mapping ({total}), as `make sweep` runs it: a tiny random-init "
           "model from the config class, LoRA 3 steps in one process with `recipes/tiny/lora.yaml` (only "
           "`model_name_or_path` changed), merged with `--verify`; *plan exact*: the planner's parameters within 0.1% "
           "of the meta model's and its trainable count equal to the run's.", "",
           f"**{len(passed)} of {len(tested)} decoder-only text architectures pass ({100 * len(passed) / max(len(tested), 1):.0f}%)**; "
           f"{len(rows) - len(tested)} entries left out (listed last, with why); {seconds / 60:.0f} min of runs on this machine."
           + ("" if len(rows) >= total else f" **Partial: {len(rows)} of the {total} entries ran** (`make sweep` goes on "
              "from here)."), "",
           "| architecture | class | result | attention | LoRA targets | plan exact | reason / note |", "|---|---|---|---|---|---|---|"]
    order = {"pass": 0, "fail": 1, "left out": 2}
    for r in sorted(rows, key=lambda r: (order[r["result"]], r["arch"])):
        exact = {True: "yes", False: "no"}.get(r.get("plan_exact"), "")
        why = (r.get("reason") or r.get("note") or "").replace("|", "\\|")
        out.append(f"| {r['arch']} | {r.get('class', '')} | {r['result']} | {r.get('attention', '')} | "
                   f"{r.get('targets', '').replace(',', ', ')} | {exact} | {why} |")
    OUT.write_text("\n".join(out) + "\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--one")
    ap.add_argument("--work")
    ap.add_argument("--only")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--timeout", type=int, default=600)
    ap.add_argument("--fresh", action="store_true")
    ap.add_argument("--table", action="store_true", help="only rewrite the table from the rows kept in outputs/sweep/")
    ns = ap.parse_args()
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
    # --only runs those entries again (their rows replaced); otherwise what has not run yet
    todo = [] if ns.table else only if only is not None else [a for a in archs if a not in done]
    print(f"sweep: {len(done)} of {len(archs)} already ran (outputs/sweep/), {len(todo)} to run", flush=True)

    def table() -> None:
        rows = [done[a] for a in archs if a in done]
        write_table(rows, sum(r.get("seconds", 0) for r in rows) / ns.jobs, len(archs))

    with ThreadPoolExecutor(ns.jobs) as pool:
        for row in pool.map(lambda a: _worker(a, ns.timeout), todo):
            (CACHE / f"{row['arch']}.json").write_text(json.dumps(row, default=str))
            done[row["arch"]] = row
            print(f"{row['arch']:<28} {row['result']:<9} {row.get('seconds', 0):>4}s {row.get('reason') or row.get('note') or ''}", flush=True)
            table()
    table()
    print(f"wrote {OUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

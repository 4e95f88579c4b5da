"""GPU check: attention numerics and a throughput matrix on one GPU, through train.py's own path, in one command.

    bench/gpu_check.sh                                   # one H200: under 8 minutes (--budget-s bounds the matrix)
    python bench/gpu_check.py --cpu-smoke --out DIR        # the same code on the tiny shapes, CPU, fp32, one step

(1) Numerics: a packed batch (position_ids restarting per sample) through a random Llama with each packed attention
    kernel (varlen, flex, flash-attn 2 where importable) against sdpa with transformers' dense block-diagonal mask:
    logits and every parameter gradient, in bf16 on CUDA, each compared with an fp32 sdpa reference; a kernel passes
    when its error is at most 2x (+ 1e-3) sdpa-bf16's own. --cpu-smoke: fp32 on CPU against a reference varlen
    defined here (per-sample causal sdpa) when the project's is not registered.
(2) Throughput: LoRA 8B with and without gradient checkpointing, full 1B, each with sdpa padded (packing off), sdpa
    packed, varlen packed, flex_attention packed and flash-attn 2 packed, each without and with Liger; a row whose
    kernel or package is missing is listed as skipped with the reason. Per row: real tokens/s/device, MFU, peak
    allocated memory and the planner's figure. Rows run in priority order (every kernel without Liger first) until
    --budget-s is spent; a row over --row-timeout-s is stopped and listed.
(3) QLoRA loading: a random-weight Llama (--qlora-size, 1B) saved in bf16, loaded with the QLoRA ZeRO-3 twin's settings
    in one process under accelerate (bench/qlora_load_probe.py), partitioned as it loads (zero3_init) and whole:
    the device's peak allocated memory over each load against the planner's loading phase.
Writes DIR/gpu_check.json (schema: check_schema) and DIR/gpu_check.md (the tables).

The varlen kernel is looked up by name in transformers' AttentionInterface: VARLEN_NAME ("sft_varlen", the project's
varlen attention; --varlen-name to change), registered when sftrecipes.model.attention (or sftrecipes.model.load) is imported.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import importlib.util
import json
import signal
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import gpu_bench  # noqa: E402  (shapes, synthetic inputs, random-weight loader, matmul ceiling)

VARLEN_NAME = "sft_varlen"
REFERENCE_VARLEN = "gpucheck_reference_varlen"  # per-sample causal sdpa, this file's own: the CPU smoke's stand-in
SCHEMA_VERSION = 1
# (attention, packed); Liger doubles each
KERNELS = [("sdpa", False), ("sdpa", True), (VARLEN_NAME, True), ("flash_attention_2", True), ("flex_attention", True)]
# (run, size key, gradient checkpointing); sizes are gpu_bench.SHAPES keys, replaced by --size/--full-size
CONFIGS = {"lora_ckpt": ("lora", "8b", True), "full": ("full", "1b", True), "lora": ("lora", "8b", False)}


class RowTimeout(Exception):
    pass


class time_limit:
    """Raise RowTimeout in the main thread after `seconds` (SIGALRM; a no-op where there is none): a kernel that
    compiles for minutes (flex_attention per new shape) must not eat the whole check."""

    def __init__(self, seconds: int):
        self.seconds = seconds

    def _raise(self, signum, frame):
        raise RowTimeout(f"stopped after {self.seconds}s (--row-timeout-s)")

    def __enter__(self):
        if hasattr(signal, "SIGALRM"):
            self.old = signal.signal(signal.SIGALRM, self._raise)
            signal.alarm(self.seconds)
        return self

    def __exit__(self, *exc):
        if hasattr(signal, "SIGALRM"):
            signal.alarm(0)
            signal.signal(signal.SIGALRM, self.old)
        return False


# ----------------------------------------------------------------------------------------------- what is available


def varlen_registered(name: str) -> bool:
    """Import the project's attention modules (registration happens there), then ask transformers."""
    for mod in ("sftrecipes.model.attention", "sftrecipes.model.load"):
        try:
            importlib.import_module(mod)
        except ImportError:
            pass
    from transformers import AttentionInterface

    return name in AttentionInterface._global_mapping


def torch_varlen_available() -> bool:
    return importlib.util.find_spec("torch.nn.attention.varlen") is not None


def liger_available(device: str) -> str | None:
    """None when Liger can run here, else why not."""
    if device != "cuda":
        return "Liger's Triton kernels need a GPU"
    missing = [p for p in ("liger_kernel", "triton") if importlib.util.find_spec(p) is None]
    return f"{' and '.join(missing)} not importable (pip install -r requirements-gpu.txt, or its wheel in .whl/)" if missing else None


def kernel_unavailable(attn: str, device: str, varlen: str) -> str | None:
    """None when the kernel can run here, else why not."""
    if attn == varlen and not varlen_registered(varlen):
        return f"{varlen} is not registered with transformers' AttentionInterface in this checkout"
    if attn == "flash_attention_2" and importlib.util.find_spec("flash_attn") is None:
        return "flash-attn not importable"
    if attn == "flash_attention_2" and device != "cuda":
        return "flash-attn needs a GPU"
    if attn == "flex_attention" and device != "cuda":
        return "flex_attention has no backward on CPU"
    return None


def matrix(configs, device: str, varlen: str) -> list[dict]:
    """Every row of the throughput matrix in priority order (all kernels without Liger, then with: Liger patches
    transformers' Llama module functions for the whole process, so no row without it may follow one with it), each
    with `skip` = None or the reason it cannot run here."""
    no_liger = liger_available(device)
    rows = []
    for liger in (False, True):
        for run, size, ckpt in configs:
            for attn, packed in KERNELS:
                attn = varlen if attn == VARLEN_NAME else attn
                why = kernel_unavailable(attn, device, varlen) or (no_liger if liger else None)
                rows.append({"run": run, "size": size, "gradient_checkpointing": ckpt, "attention": attn, "packed": packed,
                             "liger": liger, "skip": why})
    # flex_attention compiles per new shape (minutes, possibly): its rows after the others of their Liger half
    return sorted(rows, key=lambda r: (r["liger"], r["attention"] == "flex_attention"))


# ----------------------------------------------------------------------------------------------- numerics


def register_reference_varlen(name: str = REFERENCE_VARLEN) -> str:
    """A varlen attention written plainly: causal sdpa within each packed sample (segments start where position_ids
    is 0), no mask across samples. Registered with transformers under `name` (no mask function: transformers then
    builds no mask for it)."""
    import torch
    from transformers import AttentionInterface

    def segment_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        pos = kwargs["position_ids"]
        b, heads, s, d = query.shape
        rep = heads // key.shape[1]
        key, value = key.repeat_interleave(rep, dim=1), value.repeat_interleave(rep, dim=1)
        out = torch.empty_like(query)
        for row in range(b):
            starts = (pos[row] == 0).nonzero().flatten().tolist() + [s]
            for a, e in zip(starts[:-1], starts[1:]):
                out[row, :, a:e] = torch.nn.functional.scaled_dot_product_attention(
                    query[row:row + 1, :, a:e], key[row:row + 1, :, a:e], value[row:row + 1, :, a:e], is_causal=True, scale=scaling)
        return out.transpose(1, 2).contiguous(), None

    AttentionInterface.register(name, segment_attention)
    return name


def packed_batch(lengths: list[int], vocab: int, device: str, seed: int = 0):
    """One padding-free row of samples of these lengths, as TRL's packing collator gives it: input_ids, labels,
    position_ids restarting at 0 for each sample."""
    import torch

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (1, sum(lengths)), generator=g)
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    labels = ids.clone()
    labels[0, torch.cumsum(torch.tensor([0] + lengths[:-1]), 0)] = -100  # a sample's first token predicts nothing
    return {"input_ids": ids.to(device), "labels": labels.to(device), "position_ids": pos.to(device)}


def forward_backward(model, batch, impl: str):
    """Logits (fp32) and every parameter gradient (fp32) of one packed forward + backward under `impl`."""
    model.set_attn_implementation(impl)
    model.zero_grad(set_to_none=True)
    out = model(**batch, use_cache=False)
    out.loss.backward()
    return out.logits.float().detach(), {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None}


def rel_err(x, ref) -> float:
    return float((x - ref).norm() / ref.norm().clamp_min(1e-30))


def compare(model_factory, batch, impl: str, dtype, reference: str = "sdpa") -> dict:
    """`impl` against `reference` (dense block-diagonal mask) on the same weights and packed batch: relative errors
    (norm of the difference / norm of the reference) of logits and of the worst parameter gradient, both measured
    against an fp32 run of the reference; in fp32 that run is the reference itself.
    ok: impl's error is at most 2x (+ 1e-3) the reference's own in `dtype` (fp32: below 1e-4)."""
    import torch

    exact = model_factory(torch.float32)
    ref_logits, ref_grads = forward_backward(exact, batch, reference)
    del exact
    model = model_factory(dtype)
    got = {}
    for name in dict.fromkeys([reference, impl]):
        logits, grads = forward_backward(model, batch, name)
        got[name] = {"logits_rel_err": rel_err(logits, ref_logits),
                     "grad_rel_err": max(rel_err(grads[n], ref_grads[n]) for n in ref_grads),
                     "logits_max_abs": float((logits - ref_logits).abs().max())}
    mine, base = got[impl], got[reference]
    if dtype == torch.float32:
        ok = mine["logits_rel_err"] < 1e-4 and mine["grad_rel_err"] < 1e-4
    else:
        ok = all(mine[k] <= 2 * base[k] + 1e-3 for k in ("logits_rel_err", "grad_rel_err"))
    return {"attention": impl, "reference": reference, "dtype": str(dtype).removeprefix("torch."), **mine,
            "reference_logits_rel_err": base["logits_rel_err"], "reference_grad_rel_err": base["grad_rel_err"], "ok": bool(ok)}


def numerics(size: str, device: str, dtype_name: str, kernels: list[str], lengths: list[int], timeout_s: int = 120) -> list[dict]:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(**gpu_bench.SHAPES[size], tie_word_embeddings=False)

    def factory(dtype):
        torch.manual_seed(0)
        with torch.device(device):
            return AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation="sdpa")

    batch = packed_batch(lengths, cfg.vocab_size, device)
    dtype = getattr(torch, dtype_name)
    rows = []
    for k in kernels:
        try:
            with time_limit(timeout_s):
                rows.append(compare(factory, batch, k, dtype))
        except Exception as e:  # noqa: BLE001 - a kernel that fails here is a finding, reported as such
            rows.append({"attention": k, "reference": "sdpa", "dtype": dtype_name, "ok": False, "error": f"{type(e).__name__}: {e}"[:300]})
        gc.collect()
    return rows


# ----------------------------------------------------------------------------------------------- throughput


def run_row(row: dict, a, model_dirs: dict, data: dict, device: str) -> dict:
    """One throughput row through train.run (train.py's path, random weights on the device)."""
    import torch

    import train
    from sftrecipes import plan
    from sftrecipes.model import load as models
    from sftrecipes.recipe.load import load_recipe

    models.load_model = gpu_bench.random_loader(model_dirs[row["size"]], device)
    tag = f"{row['run']}-{row['size']}-ckpt{int(row['gradient_checkpointing'])}-{row['attention']}-{'packed' if row['packed'] else 'padded'}{'-liger' if row['liger'] else ''}"
    argv = [f"recipes/tiny/{row['run']}.yaml", "--model_name_or_path", str(model_dirs[row["size"]]), "--tokenizer_name_or_path",
            ".assets/tiny-llama", "--dataset_name", str(data[row["size"]]), "--splits", "train", "--chat_template_format", "none",
            "--dataset_text_field", "text", "--max_length", str(a.seq), "--packing", str(row["packed"]).lower(),
            "--bf16", str(device == "cuda").lower(), "--per_device_train_batch_size", str(a.batch), "--max_steps", str(a.steps),
            "--logging_steps", "1", "--gradient_checkpointing", str(row["gradient_checkpointing"]).lower(),
            "--use_flash_attn", "false", "--attn_implementation", row["attention"], "--use_liger_kernel", str(row["liger"]).lower(),
            "--sample_max_new_tokens", "0", "--learning_rate", "1e-5", "--save_strategy", "no", "--report_to", "none",
            "--launch.hardware", "gpu" if device == "cuda" else "cpu", "--output_dir", str(Path(a.out) / "runs" / tag)]
    if a.seq > gpu_bench.SHAPES[row["size"]]["max_position_embeddings"]:  # long-context rows (gpu_check.sh's 32k step):
        argv += ["--max_length_beyond_positions", "true"]  # random weights, RoPE computes any position
    if device == "cuda":
        argv += ["--launch.gpu_memory_gb", str(round(torch.cuda.get_device_properties(0).total_memory / 1e9, 1))]
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    recipe = load_recipe(argv)
    start = time.time()
    trainer, summary = train.run(recipe)
    t = summary["throughput"]
    pad = trainer.args.pad_to_multiple_of
    del trainer
    r0 = t["ranks"][0]
    predicted = plan.plan_recipe(recipe, _alternatives=False)
    return {"ran_attention": summary["attention"], "pad_to_multiple_of": pad,
            "real_tokens_per_step": round(r0["real_tokens"] / max(r0["steps"], 1), 1),
            "tokens_per_s_per_device": round(t["tokens_per_s_per_device"], 1), "mfu": t["mfu"], "hfu": t.get("hfu"),
            "measured_peak_gb": r0.get("accelerator_peak_gb"), "planned_tensor_peak_gb": round(predicted.tensor_peak_gb, 2),
            "planned_total_gb": round(predicted.gpu_total_gb, 2), "last_loss": summary["last_loss"],
            "seconds": round(time.time() - start, 1)}


def throughput(rows: list[dict], a, device: str, started: float) -> None:
    """Run the rows in order, in place, within the budget: a row is skipped when the time its configuration took
    last (or --row-estimate-s) no longer fits; one that overruns --row-timeout-s is stopped."""
    import torch

    folder = Path(a.out) / "inputs"
    model_dirs, data = {}, {}
    for size in dict.fromkeys(r["size"] for r in rows):
        model_dirs[size], data[size] = gpu_bench.write_inputs(folder / size, size, samples=a.steps * a.batch * 6, words=a.seq // 3)
    took: dict = {}
    for row in rows:
        if row["skip"]:
            continue
        key = (row["run"], row["size"], row["gradient_checkpointing"])
        estimate = took.get(key, a.row_estimate_s)
        if time.time() - started + estimate > a.budget_s:
            row["skip"] = f"time budget: {a.budget_s}s (this row needs ~{estimate:.0f}s)"
            continue
        t0 = time.time()
        try:
            with time_limit(a.row_timeout_s):
                row.update(run_row(row, a, model_dirs, data, device))
        except Exception as e:  # noqa: BLE001 - one failing kernel (or RowTimeout) must not lose the other rows' numbers
            row["error"] = f"{type(e).__name__}: {' '.join(str(e).split())}"[:400]
            if isinstance(e, RowTimeout):  # the same kernel would overrun again: spend the time on other rows
                for later in rows:
                    if later["attention"] == row["attention"] and not later["skip"] and "error" not in later and "tokens_per_s_per_device" not in later:
                        later["skip"] = f"{row['attention']} overran --row-timeout-s on an earlier row"
        finally:
            gc.collect()
            if device == "cuda":
                torch.cuda.empty_cache()
        took[key] = max(took.get(key, 0.0), time.time() - t0)
        print(json.dumps(row), flush=True)


# ----------------------------------------------------------------------------------------------- QLoRA loading


def qlora_checkpoint(size: str, folder: Path) -> Path:
    """A random-weight Llama of gpu_bench's `size` shape saved in bf16, as hub checkpoints are, with the tiny Llama's
    tokenizer; written once into `folder`."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    ckpt = folder / f"qlora-ckpt-{size}"
    if not (ckpt / "config.json").is_file():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(LlamaConfig(**gpu_bench.SHAPES[size], tie_word_embeddings=False),
                                                 dtype=torch.bfloat16)
        model.save_pretrained(ckpt)
        del model
        for f in (ROOT / ".assets/tiny-llama").iterdir():
            if f.name.startswith(("tokenizer", "special_tokens")):
                shutil.copy(f, ckpt / f.name)
    return ckpt


def qlora_loading(size: str, device: str, folder: Path, timeout_s: int) -> list[dict]:
    """Load-time peak per device of the QLoRA ZeRO-3 setup against the plan, partitioned as it loads and whole
    (bench/qlora_load_probe.py under accelerate, one process: what one GPU can show; the partition's share is the
    whole at one rank, so the rows check the planner's loading terms, not the saving). A row per load, or one with
    the error. The checkpoint and the probe's files go in `folder` (main: outputs/gpu-check, not the results)."""
    import os
    import socket
    import subprocess

    import yaml

    from sftrecipes.launch.accelerate import accelerate_config, launcher_env
    from sftrecipes.recipe.load import load_recipe

    missing = [m for m in ("deepspeed", "bitsandbytes") if importlib.util.find_spec(m) is None]
    if missing:
        return [{"size": size, "skip": f"{' and '.join(missing)} not importable (bench/gpu_check.sh's header: the .whl/ folder)"}]
    try:
        folder.mkdir(parents=True, exist_ok=True)
        ckpt = qlora_checkpoint(size, folder)
        out = folder / f"qlora-load-{size}"
        argv = ["recipes/tiny/qlora-zero3.yaml", "--model_name_or_path", str(ckpt), "--output_dir", str(out),
                "--launch.gpus_per_node", "1", "--launch.hardware", "cpu" if device == "cpu" else "gpu"]
        recipe = load_recipe(argv)
        cfg = folder / "qlora-load-accelerate.yaml"
        cfg.write_text(yaml.safe_dump(accelerate_config(recipe)))
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(cfg), "--num_machines", "1",
               "--num_processes", "1", "--machine_rank", "0", "--main_process_ip", "127.0.0.1", "--main_process_port",
               str(port), "bench/qlora_load_probe.py", *argv]
        res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s,
                             env={**os.environ, **launcher_env(recipe)})
        if res.returncode != 0:
            return [{"size": size, "error": (res.stderr.strip().splitlines() or ["exit %d" % res.returncode])[-1][:300]}]
        found = json.loads((out / "qlora-load-rank0.json").read_text())
    except (OSError, subprocess.TimeoutExpired, ValueError) as e:
        return [{"size": size, "error": f"{type(e).__name__}: {e}"[:300]}]
    return [{"size": size, "rank": found["rank"], "target": found["target"], **row} for row in found["rows"]]


# ----------------------------------------------------------------------------------------------- results


def check_schema(result: dict) -> None:
    """The JSON's shape, so the results file stays readable by whoever compares two runs: raises ValueError."""
    def need(obj, key, kinds, where):
        if key not in obj or not isinstance(obj[key], kinds):
            raise ValueError(f"{where}: {key} missing or not {kinds}")

    for k, kinds in {"schema": int, "date": str, "device": str, "versions": dict, "settings": dict, "numerics": list,
                     "rows": list, "torch_varlen": bool, "varlen_name": str, "seconds": (int, float)}.items():
        need(result, k, kinds, "result")
    for i, n in enumerate(result["numerics"]):
        for k, kinds in {"attention": str, "reference": str, "dtype": str, "ok": bool}.items():
            need(n, k, kinds, f"numerics[{i}]")
        if "error" not in n:
            for k in ("logits_rel_err", "grad_rel_err", "reference_logits_rel_err", "reference_grad_rel_err"):
                need(n, k, float, f"numerics[{i}]")
    for i, q in enumerate(result.get("qlora_loading", [])):
        need(q, "size", str, f"qlora_loading[{i}]")
        if "error" not in q and "skip" not in q:
            for k, kinds in {"load": str, "measured_gb": (int, float), "planned_gb": (int, float), "plan_item": str,
                             "layers_partitioned": int}.items():
                need(q, k, kinds, f"qlora_loading[{i}]")
    for i, r in enumerate(result["rows"]):
        for k, kinds in {"run": str, "size": str, "gradient_checkpointing": bool, "attention": str, "packed": bool, "liger": bool}.items():
            need(r, k, kinds, f"rows[{i}]")
        if r["skip"] or r.get("error"):
            continue
        if "tokens_per_s_per_device" not in r:
            raise ValueError(f"rows[{i}]: neither measured nor skipped with a reason")
        for k, kinds in {"tokens_per_s_per_device": (int, float), "planned_total_gb": (int, float), "ran_attention": str}.items():
            need(r, k, kinds, f"rows[{i}]")
        if r["tokens_per_s_per_device"] <= 0:
            raise ValueError(f"rows[{i}]: tokens_per_s_per_device {r['tokens_per_s_per_device']}")


def markdown(result: dict) -> str:
    s = result["settings"]
    lines = [f"GPU check {result['date']} on {result['device']} (bf16 8192^3 matmul: {result.get('matmul_bf16_tflops')} TFLOP/s); "
             + ", ".join(f"{k} {v}" for k, v in result["versions"].items())
             + f"; seq {s['seq']} x batch {s['batch']}, {s['steps']} steps per row; {result['seconds']:.0f} s in all.", "",
             f"Numerics: packed batch (samples {s['lengths']}), each kernel against sdpa with the dense block-diagonal mask, "
             f"errors relative to an fp32 sdpa run; torch.nn.attention.varlen {'present' if result['torch_varlen'] else 'absent'}.", "",
             "| attention | dtype | logits rel. err | sdpa's own | worst grad rel. err | sdpa's own | ok |", "|---|---|---:|---:|---:|---:|---|"]
    for n in result["numerics"]:
        if "error" in n:
            lines.append(f"| {n['attention']} | {n['dtype']} | {n['error']} | | | | no |")
        else:
            lines.append(f"| {n['attention']} | {n['dtype']} | {n['logits_rel_err']:.2e} | {n['reference_logits_rel_err']:.2e} | "
                         f"{n['grad_rel_err']:.2e} | {n['reference_grad_rel_err']:.2e} | {'yes' if n['ok'] else '**no**'} |")
    lines += ["", "| run | grad ckpt | attention | batch | Liger | tok/s/device | MFU | peak GB | planner GB (tensors / total) | note |",
              "|---|---|---|---|---|---:|---:|---:|---:|---|"]
    for r in result["rows"]:
        head = (f"| {r['run']} {r['size']} | {'on' if r['gradient_checkpointing'] else 'off'} | {r['attention']} | "
                f"{'packed' if r['packed'] else 'padded'} | {'yes' if r['liger'] else 'no'} |")
        if r["skip"] or r.get("error"):
            lines.append(f"{head} | | | | {'skipped: ' + r['skip'] if r['skip'] else 'failed: ' + r['error']} |")
            continue
        mfu = "-" if r["mfu"] is None else f"{r['mfu']:.3f}"
        peak = "-" if r["measured_peak_gb"] is None else f"{r['measured_peak_gb']:.1f}"
        note = "" if r["ran_attention"] == r["attention"] else f"ran {r['ran_attention']}"
        lines.append(f"{head} {r['tokens_per_s_per_device']:.0f} | {mfu} | {peak} | {r['planned_tensor_peak_gb']:.1f} / "
                     f"{r['planned_total_gb']:.1f} | {note} |")
    if result.get("qlora_loading"):
        lines += ["", "QLoRA loading (QLoRA ZeRO-3 twin's settings, one process): the device's peak over the load against the plan.",
                  "", "| model | load | measured GB | planned GB | plan item | layers partitioned |", "|---|---|---:|---:|---|---:|"]
        for q in result["qlora_loading"]:
            if "error" in q or "skip" in q:
                lines.append(f"| {q['size']} | {'failed: ' + q['error'] if 'error' in q else 'skipped: ' + q['skip']} | | | | |")
            else:
                lines.append(f"| {q['size']} | {q['load']} | {q['measured_gb']:.2f} | {q['planned_gb']:.2f} | {q['plan_item']} | "
                             f"{q['layers_partitioned']} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on CPU in fp32, one step per row: the code path, not numbers")
    p.add_argument("--size", default="8b", choices=list(gpu_bench.SHAPES), help="model of the LoRA rows")
    p.add_argument("--full-size", default="1b", choices=list(gpu_bench.SHAPES), help="model of the full fine-tune row")
    p.add_argument("--numerics-size", default="1b", choices=list(gpu_bench.SHAPES))
    p.add_argument("--steps", type=int, default=6, help="optimizer steps per row (the first, warm-up, is left out of tok/s)")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--budget-s", type=float, default=330,
                   help="no throughput row starts that would end past this (seconds from start, by the time its configuration took)")
    p.add_argument("--row-timeout-s", type=int, default=90, help="a row (or a numerics kernel) running longer is stopped")
    p.add_argument("--row-estimate-s", type=float, default=30, help="assumed time of a configuration's first row")
    p.add_argument("--varlen-name", default=VARLEN_NAME)
    p.add_argument("--only", default="", help="comma-separated kernels to keep in the matrix (e.g. sdpa,sft_varlen)")
    p.add_argument("--no-liger-rows", action="store_true")
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated, of {', '.join(CONFIGS)}")
    p.add_argument("--qlora-size", default="1b", choices=list(gpu_bench.SHAPES), help="model of the QLoRA loading rows")
    p.add_argument("--no-qlora-load", action="store_true", help="leave out the QLoRA loading rows")
    p.add_argument("--out", default=str(ROOT / "bench/results"))
    a = p.parse_args(argv)
    started = time.time()

    import torch

    from sftrecipes import tiny

    tiny.ensure_tiny_model()
    device = "cpu" if a.cpu_smoke else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("error: no CUDA device; use --cpu-smoke for the CPU code path", file=sys.stderr)
        return 2
    if a.cpu_smoke:
        a.size = a.full_size = a.numerics_size = a.qlora_size = "tiny"
        a.steps, a.batch, a.seq = min(a.steps, 2), min(a.batch, 2), min(a.seq, 128)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)

    # (1) numerics
    lengths = [40, 7, 64, 17] if a.cpu_smoke else [1000, 37, 2048, 1011]
    kernels = [k for k in (a.varlen_name, "flash_attention_2", "flex_attention") if not kernel_unavailable(k, device, a.varlen_name)]
    if a.cpu_smoke and a.varlen_name not in kernels:
        kernels.append(register_reference_varlen())
    num = numerics(a.numerics_size, device, "float32" if a.cpu_smoke else "bfloat16", kernels, lengths, a.row_timeout_s)
    for n in num:
        print(json.dumps(n), flush=True)

    # (2) throughput
    configs = [(run, a.size if run == "lora" else a.full_size, ckpt) for run, _, ckpt in (CONFIGS[c] for c in a.configs.split(","))]
    rows = matrix(configs, device, a.varlen_name)
    keep = set(filter(None, a.only.split(",")))
    rows = [r for r in rows if (not keep or r["attention"] in keep) and not (a.no_liger_rows and r["liger"])]
    ceiling = gpu_bench.matmul_ceiling_tflops() if device == "cuda" else None
    throughput(rows, a, device, started)

    # (3) QLoRA loading: the load-time peak per device against the plan
    qlora = [] if a.no_qlora_load else qlora_loading(a.qlora_size, device, ROOT / "outputs" / "gpu-check", a.row_timeout_s * 4)
    for q in qlora:
        print(json.dumps(q), flush=True)

    versions = {m: getattr(importlib.import_module(m), "__version__", "?") for m in ("torch", "transformers", "trl", "peft", "accelerate")}
    for m in ("flash_attn", "liger_kernel", "triton"):
        if importlib.util.find_spec(m):
            versions[m] = getattr(importlib.import_module(m), "__version__", "?")
    result = {"schema": SCHEMA_VERSION, "date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
              "matmul_bf16_tflops": ceiling, "versions": versions, "torch_varlen": torch_varlen_available(), "varlen_name": a.varlen_name,
              "settings": {"seq": a.seq, "batch": a.batch, "steps": a.steps, "lengths": lengths, "budget_s": a.budget_s, "cpu_smoke": a.cpu_smoke},
              "numerics": num, "rows": rows, "qlora_loading": qlora, "seconds": round(time.time() - started, 1)}
    check_schema(result)
    stem = f"gpu-check-{'cpu-smoke' if a.cpu_smoke else result['device'].split()[-1].lower()}-{result['date']}"
    (out / f"{stem}.json").write_text(json.dumps(result, indent=1))
    (out / f"{stem}.md").write_text(markdown(result))
    print("\n" + markdown(result))
    print(f"wrote {out / stem}.json and .md")
    return 0 if all(n["ok"] for n in num) and not any("error" in q for q in qlora) else 1


if __name__ == "__main__":
    sys.exit(main())

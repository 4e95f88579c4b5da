"""GPU check of GRPO (issue 40): recipes/tiny/grpo.yaml (LoRA on the tiny Llama, 16 completions a step, groups of 4,
12 new tokens each) through train.run on the lent GPU in bf16, one row per way of generating: transformers' generate,
and vLLM colocate (vLLM in the training process, 20% of the GPU) where vllm is importable (else the row says why).
Each row runs in a process of its own and records its seconds per step (TRL's step_time, the first step apart:
generation, scoring and the optimizer step together), the GPU's peak (torch.cuda.max_memory_allocated; with vLLM
also the device's memory in use at the end, vLLM's pool included) and the mean reward of the first and last steps.
bench/gpu_check.sh runs it; --cpu-smoke runs the transformers row on CPU in fp32 (tests/test_grpo_probe.py).

    python bench/grpo_probe.py --out bench/results/grpo-probe-<date> [--steps 8]
    python bench/grpo_probe.py --cpu-smoke --out /tmp/x --steps 2

Writes OUT/grpo-probe.json and OUT/grpo-probe.md.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

RECIPE = "recipes/tiny/grpo.yaml"
ROWS = ("transformers", "vllm_colocate")
GB = 1e9


def skip_reason(row: str, cpu: bool) -> str | None:
    if row == "vllm_colocate":
        if cpu:
            return "vLLM generates on GPUs (the cpu target refuses use_vllm)"
        if importlib.util.find_spec("vllm") is None:
            return "vllm is not importable in this environment (requirements-vllm.txt; TRL 1.16 supports 0.22-0.31)"
    return None


def recipe_argv(row: str, a) -> list[str]:
    argv = [RECIPE, "--max_steps", str(a.steps), "--logging_steps", "1", "--save_strategy", "no", "--report_to", "none",
            "--sample_max_new_tokens", "0", "--output_dir", str(Path(a.out) / "runs" / row)]
    argv += ["--launch.hardware", "cpu", "--bf16", "false"] if a.cpu_smoke else ["--launch.hardware", "gpu", "--bf16", "true"]
    if row == "vllm_colocate":
        argv += ["--use_vllm", "true", "--vllm_mode", "colocate", "--vllm_gpu_memory_utilization", "0.2",
                 "--vllm_max_model_length", "256"]
    return argv


def run_row(row: str, a) -> dict:
    """One row in this process: the run, its steps' times, the GPU's peak, the rewards."""
    import torch

    import train
    from sftrecipes.recipe.load import load_recipe

    cuda = not a.cpu_smoke and torch.cuda.is_available()
    recipe = load_recipe(recipe_argv(row, a))
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    trainer, summary = train.run(recipe)
    wall = time.perf_counter() - started
    history = trainer.state.log_history
    times = [h["step_time"] for h in history if "step_time" in h]
    rewards = [h["reward"] for h in history if "reward" in h]
    result = {"row": row, "steps": len(times), "first_step_s": round(times[0], 3) if times else None,
              "step_s_median": round(statistics.median(times[1:] or times), 3) if times else None,
              "wall_s": round(wall, 1), "reward_first": rewards[0] if rewards else None,
              "reward_last": rewards[-1] if rewards else None, "completions_per_step": recipe.trl_value("per_device_train_batch_size"),
              "device": torch.cuda.get_device_name(0) if cuda else "cpu", "peak_gpu_gb": None, "device_used_gb": None}
    if cuda:
        free, total = torch.cuda.mem_get_info()
        result.update(peak_gpu_gb=round(torch.cuda.max_memory_allocated() / GB, 3), device_used_gb=round((total - free) / GB, 2))
    return result


def markdown(rows: list[dict], a) -> str:
    lines = [f"GRPO, {RECIPE} (tiny Llama, LoRA), {a.steps} steps, {'CPU fp32' if a.cpu_smoke else 'GPU bf16'}.", "",
             "| generation | s/step (median, after the first) | first step s | GPU peak GB | device in use GB | reward first -> last |",
             "|---|---:|---:|---:|---:|---|"]
    for r in rows:
        if r.get("skip") or r.get("error"):
            lines.append(f"| {r['row']} | {'skipped: ' + r['skip'] if r.get('skip') else 'failed: ' + r['error']} | | | | |")
            continue
        fmt = lambda v: "-" if v is None else f"{v:g}"  # noqa: E731
        lines.append(f"| {r['row']} | {fmt(r['step_s_median'])} | {fmt(r['first_step_s'])} | {fmt(r['peak_gpu_gb'])} | "
                     f"{fmt(r['device_used_gb'])} | {fmt(r['reward_first'] and round(r['reward_first'], 3))} -> "
                     f"{fmt(r['reward_last'] and round(r['reward_last'], 3))} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--cpu-smoke", action="store_true", help="the transformers row on CPU in fp32: the code path, not numbers")
    ap.add_argument("--row", choices=ROWS, help=argparse.SUPPRESS)  # (a row's own process)
    ap.add_argument("--row-timeout-s", type=int, default=240)
    a = ap.parse_args(argv)
    out = Path(a.out)
    if a.row:
        (out / f"row-{a.row}.json").write_text(json.dumps(run_row(a.row, a)))
        return 0
    from sftrecipes import tiny

    tiny.ensure_tiny_model()
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for row in ROWS:
        skip = skip_reason(row, a.cpu_smoke)
        if skip:
            rows.append({"row": row, "skip": skip})
            continue
        cmd = [sys.executable, str(Path(__file__).resolve()), "--row", row, "--out", str(out), "--steps", str(a.steps)]
        try:
            res = subprocess.run(cmd + (["--cpu-smoke"] if a.cpu_smoke else []), cwd=ROOT, capture_output=True, text=True,
                                 timeout=a.row_timeout_s)
            said = (res.stderr.strip().splitlines() or [f"exit status {res.returncode}"])[-1][:300]
        except subprocess.TimeoutExpired:
            res, said = None, f"ran past --row-timeout-s {a.row_timeout_s}"
        record = out / f"row-{row}.json"
        if res is not None and res.returncode == 0 and record.is_file():
            rows.append(json.loads(record.read_text()))
        else:
            rows.append({"row": row, "error": said})
    result = {"schema": 1, "date": time.strftime("%Y-%m-%d"), "recipe": RECIPE, "steps": a.steps, "cpu_smoke": a.cpu_smoke,
              "rows": rows}
    (out / "grpo-probe.json").write_text(json.dumps(result, indent=1))
    (out / "grpo-probe.md").write_text(markdown(rows, a))
    print(markdown(rows, a))
    return 0 if all(not r.get("error") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

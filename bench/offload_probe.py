"""GPU check of the planner's activation offloading (sftrecipes/plan/offload.py): one LoRA run of a random-weight Llama
through train.run with activation_offloading off and on, each row's measured GPU peak (torch.cuda.max_memory_allocated
over the steps) and the pinned host allocator's peak (torch.cuda.host_memory_stats, active blocks) against the plan's
GPU total and its "offloaded activations" item per rank. bench/gpu_check.sh runs it on the lent GPU; on a machine
without one, --plan-only prints the planned figures (the cpu target refuses activation_offloading).

    python bench/offload_probe.py --out bench/results [--size 1b] [--batch 4] [--seq 2048] [--steps 3]
    python bench/offload_probe.py --plan-only --out /tmp/x

Writes DIR/offload-probe.json and DIR/offload-probe.md.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import gpu_bench  # noqa: E402  (shapes, synthetic inputs, random-weight loader)

GB = 1e9


def argv_for(a, model_dir: Path, data: Path, offload: bool, out: Path, gpu_gb: float | None) -> list[str]:
    argv = ["recipes/tiny/lora.yaml", "--model_name_or_path", str(model_dir), "--tokenizer_name_or_path", ".assets/tiny-llama",
            "--dataset_name", str(data), "--splits", "train", "--chat_template_format", "none", "--dataset_text_field", "text",
            "--max_length", str(a.seq), "--packing", "true", "--bf16", "true", "--per_device_train_batch_size", str(a.batch),
            "--max_steps", str(a.steps), "--logging_steps", "1", "--gradient_checkpointing", "false",
            "--activation_offloading", str(offload).lower(), "--sample_max_new_tokens", "0", "--learning_rate", "1e-5",
            "--save_strategy", "no", "--report_to", "none", "--launch.hardware", "gpu", "--output_dir", str(out)]
    return argv + (["--launch.gpu_memory_gb", str(gpu_gb)] if gpu_gb else [])


def planned(recipe) -> dict:
    from sftrecipes import plan

    p = plan.plan_recipe(recipe, _alternatives=False)
    host = next((i.gb for i in p.cpu if i.name == "offloaded activations"), 0.0) / p.gpus_per_node
    return {"planned_total_gb": round(p.gpu_total_gb, 2), "planned_tensor_peak_gb": round(p.tensor_peak_gb, 2),
            "planned_host_gb_per_rank": round(host, 3)}


def _host_peak() -> float | None:
    import torch

    stats = torch.cuda.host_memory_stats()
    key = next((k for k in stats if k.endswith("active_bytes.peak") or k.endswith("active_bytes.all.peak")), None)
    return stats[key] / GB if key else None


def row(a, model_dir: Path, data: Path, offload: bool, plan_only: bool) -> dict:
    from sftrecipes.recipe.load import load_recipe

    out = Path(a.out) / "runs" / f"offload-{int(offload)}"
    gpu_gb = None
    if not plan_only:
        import torch

        gpu_gb = round(torch.cuda.get_device_properties(0).total_memory / 1e9, 1)
    recipe = load_recipe(argv_for(a, model_dir, data, offload, out, gpu_gb))
    result = {"activation_offloading": offload, **planned(recipe)}
    if plan_only:
        return result
    import torch

    import train
    from sftrecipes.model import load as models

    models.load_model = gpu_bench.random_loader(model_dir, "cuda")
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.reset_peak_host_memory_stats()
    trainer, summary = train.run(recipe)
    del trainer
    gc.collect()
    result.update(measured_peak_gb=round(torch.cuda.max_memory_allocated() / GB, 2), measured_host_peak_gb=_host_peak(),
                  last_loss=summary["last_loss"])
    return result


def markdown(rows: list[dict], a) -> str:
    lines = [f"Activation offloading, LoRA {a.size}, batch {a.batch} x {a.seq} tokens, no gradient checkpointing, bf16.", "",
             "| offloading | measured GPU peak GB | planned tensors / total GB | measured pinned host GB | planned host GB/rank |",
             "|---|---:|---:|---:|---:|"]
    for r in rows:
        m, h = r.get("measured_peak_gb"), r.get("measured_host_peak_gb")
        lines.append(f"| {'on' if r['activation_offloading'] else 'off'} | {'-' if m is None else f'{m:.2f}'} | "
                     f"{r['planned_tensor_peak_gb']:.2f} / {r['planned_total_gb']:.2f} | {'-' if h is None else f'{h:.3f}'} | "
                     f"{r['planned_host_gb_per_rank']:.3f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--size", default="1b", choices=sorted(gpu_bench.SHAPES))
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--plan-only", action="store_true", help="the planned figures only (no GPU needed)")
    a = ap.parse_args(argv)
    out = Path(a.out)
    model_dir, data = gpu_bench.write_inputs(out / "inputs" / a.size, a.size, samples=a.steps * a.batch * 6, words=a.seq // 3)
    rows = [row(a, model_dir, data, offload, a.plan_only) for offload in (False, True)]
    (out / "offload-probe.json").write_text(json.dumps({"size": a.size, "batch": a.batch, "seq": a.seq, "rows": rows}, indent=1))
    (out / "offload-probe.md").write_text(markdown(rows, a))
    print(markdown(rows, a))
    return 0


if __name__ == "__main__":
    sys.exit(main())

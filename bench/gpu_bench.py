"""GPU benchmark: SFT of random-init Llama-shaped models through train.py's own code path.

    bench/gpu_bench.sh              # LoRA ~8B (Llama-3-8B shapes) + full ~1B, bf16, packing, seq 2048, one GPU
    python bench/gpu_bench.py --size tiny --full-size tiny --device cpu --steps 2     # the same path, tiny, on CPU

Runs: LoRA with gradient checkpointing on and off, and a full fine-tune (checkpointing on). For each it prints tokens/s/device (real tokens), MFU (device peak by GPU name), peak
accelerator memory, and the memory planner's prediction beside the measured peak; results go to
outputs/gpu_bench/results.json. Weights are random and built on the device (nothing read from disk or the hub);
the tokenizer is the tiny local one (token ids < 512, which does not change the cost per token).
"""

from __future__ import annotations

import argparse
import json
import random
import shlex
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SHAPES = {
    # Llama-3-8B's decoder with a 32k vocabulary (~7.5B parameters)
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=32000, max_position_embeddings=8192),
    # Llama-3.2-1B's decoder with a 32k vocabulary (~1.1B parameters): the full fine-tune row
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=32000, max_position_embeddings=8192),
    "tiny": dict(hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512, max_position_embeddings=1024),
}


def write_inputs(folder: Path, size: str, samples: int, words: int) -> tuple[Path, Path]:
    """A config-only model folder (the planner reads it) and a synthetic text dataset of long samples."""
    from transformers import LlamaConfig

    model_dir = folder / f"config-{size}"
    model_dir.mkdir(parents=True, exist_ok=True)
    LlamaConfig(**SHAPES[size], tie_word_embeddings=False).save_pretrained(model_dir)
    vocab = [w for w in json.loads((ROOT / ".assets/tiny-llama/tokenizer.json").read_text())["model"]["vocab"] if w.isalpha()]
    rng = random.Random(0)
    data = folder / "text.jsonl"
    with open(data, "w") as f:
        for _ in range(samples):
            f.write(json.dumps({"text": " ".join(rng.choice(vocab) for _ in range(rng.randint(words // 2, words)))}) + "\n")
    return model_dir, data


def random_loader(model_dir: Path, device: str):
    """A stand-in for sftrecipes.model.load.load_model that builds the config's model with random weights on `device`
    (nothing read from disk), in the recipe's load dtype, with the attention the recipe resolves to (the run summary
    reads back what ran)."""

    def load(recipe, tokenizer, target, images: bool = False):  # (load_model's signature; the bench's rows are text)
        assert not images, "the GPU bench trains on text rows"
        import torch
        from transformers import AutoModelForCausalLM, LlamaConfig

        from sftrecipes.model import load as models

        from sftrecipes.model import attnchoice

        impl = attnchoice.choose_attention(recipe, target)[0]  # the kernel train.py's load_model would use
        if impl == attnchoice.VARLEN:
            from sftrecipes.model.attention import register

            register()
        with torch.device(device):
            m = AutoModelForCausalLM.from_config(LlamaConfig.from_pretrained(model_dir), dtype=models.load_dtype(recipe),
                                                 attn_implementation=impl)
        m.config.use_cache = False
        return m

    return load


def matmul_ceiling_tflops() -> float:
    """bf16 8192^3 matrix products on random data: the rate this device actually reaches (mean of 10 after 3)."""
    import torch

    a, b = (torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0.record()
    for _ in range(10):
        a @ b
    t1.record()
    torch.cuda.synchronize()
    return round(10 * 2 * 8192**3 / (t0.elapsed_time(t1) / 1e3) / 1e12, 1)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", choices=list(SHAPES), default="8b", help="model of the LoRA rows")
    p.add_argument("--full-size", choices=[*SHAPES, "none"], default="1b",
                   help="model of the full fine-tune row (gradient checkpointing on); none: no such row")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--full-rows", action="store_true",
                   help="samples longer than --seq, so every row is full (seq x batch real tokens per step): the load "
                        "the memory planner plans for, to compare its figure with the measured peak")
    p.add_argument("--extra", default="", help="more recipe flags for every run, e.g. '--pad_to_multiple_of 256'")
    p.add_argument("--out", default=str(ROOT / "outputs/gpu_bench"))
    a = p.parse_args(argv)

    import torch

    import train
    from sftrecipes import plan, tiny
    from sftrecipes.model import load as models
    from sftrecipes.recipe.load import load_recipe

    tiny.ensure_tiny_model()
    out = Path(a.out)
    runs = [("lora", a.size, True), ("lora", a.size, False)] + ([("full", a.full_size, True)] if a.full_size != "none" else [])
    ceiling = matmul_ceiling_tflops() if a.device == "cuda" else None
    rows = []
    for kind, size, ckpt in runs:
        model_dir, data = write_inputs(out, size, samples=a.steps * a.batch * (2 if a.full_rows else 6),
                                       words=2 * a.seq + 8 if a.full_rows else a.seq // 3)

        models.load_model = random_loader(model_dir, a.device)
        argv = [f"recipes/tiny/{kind}.yaml", "--model_name_or_path", str(model_dir), "--tokenizer_name_or_path",
                ".assets/tiny-llama", "--dataset_name", str(data), "--splits", "train", "--chat_template_format", "none",
                "--dataset_text_field", "text", "--max_length", str(a.seq), "--packing", "true", "--bf16", "true",
                "--per_device_train_batch_size", str(a.batch), "--max_steps", str(a.steps), "--logging_steps", "1",
                "--gradient_checkpointing", str(ckpt), "--use_flash_attn", "true", "--sample_max_new_tokens", "0",
                "--learning_rate", "1e-5", "--save_strategy", "no",
                "--launch.hardware", "gpu" if a.device == "cuda" else "cpu", "--output_dir", str(out / f"{kind}-{size}-{ckpt}"), *shlex.split(a.extra)]
        if a.device == "cuda":
            argv += ["--launch.gpu_memory_gb", str(round(torch.cuda.get_device_properties(0).total_memory / 1e9, 1))]
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        recipe = load_recipe(argv)
        start = time.time()
        trainer, summary = train.run(recipe)
        t = summary["throughput"]
        del trainer
        predicted = plan.plan_recipe(recipe, _alternatives=False)
        measured = t["ranks"][0].get("accelerator_peak_gb")
        r0 = t["ranks"][0]
        rows.append({"run": kind, "size": size, "gradient_checkpointing": ckpt,
                     "real_tokens_per_step": round(r0["real_tokens"] / max(r0["steps"], 1), 1),
                     "tokens_per_s_per_device": round(t["tokens_per_s_per_device"], 1),
                     "mfu": t["mfu"], "peak_tflops": t["peak_tflops"], "measured_peak_gb": measured,
                     "planned_tensor_peak_gb": round(predicted.tensor_peak_gb, 2), "planned_total_gb": round(predicted.gpu_total_gb, 2),
                     "attention": summary["attention"],  # what the model ran (its config), not the request
                     "seconds": round(time.time() - start, 1)})
        print(json.dumps(rows[-1]), flush=True)
    versions = {m: __import__(m).__version__ for m in ("torch", "transformers", "trl", "peft", "accelerate", "datasets")}
    device = torch.cuda.get_device_name(0) if a.device == "cuda" else "cpu"
    result = {"date": time.strftime("%Y-%m-%d"), "device": device, "matmul_bf16_tflops": ceiling, "seq": a.seq, "full_rows": a.full_rows, "extra": a.extra,
              "batch": a.batch, "steps": a.steps, "versions": versions, "rows": rows}
    (out / "results.json").write_text(json.dumps(result, indent=1))
    print(f"\n{device} (bf16 8192^3 matmul: {ceiling} TFLOP/s), seq {a.seq} x batch {a.batch}, {a.steps} steps, {versions}")
    print(f"{'run':>10} {'grad ckpt':>9} {'attention':>17} {'tok/s/dev':>10} {'MFU':>6} {'peak GB':>8} {'planned GB':>10}")
    for r in rows:
        mfu = "-" if r["mfu"] is None else f"{r['mfu']:.3f}"
        peak = "-" if r["measured_peak_gb"] is None else f"{r['measured_peak_gb']:.1f}"
        print(f"{r['run'] + ' ' + r['size']:>10} {str(r['gradient_checkpointing']):>9} {r['attention']:>17} "
              f"{r['tokens_per_s_per_device']:>10.0f} {mfu:>6} {peak:>8} {r['planned_total_gb']:>10.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

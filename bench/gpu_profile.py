"""Where a training step's time goes on a GPU: train.py's path under torch.profiler, beside a bare loop.

    python bench/gpu_profile.py [--size 1b] [--steps 12] [--out outputs/gpu_profile]

Needs a CUDA GPU. Runs (--runs; each a fresh trainer, full fine-tune of a random-init model, bf16, 2048 x 4):
  bare          two plain loops:
  bare-causal   the same model and AdamW in a plain loop, one 1 x 5900-token causal sequence (the attainable step)
  bare-packed   the same with position_ids restarting every ~1476 tokens (packed samples: transformers builds a
                block-diagonal mask, and sdpa cannot use its flash kernel)
  train         train.py's path (packing, logging every step) with the profiler over steps 6-9
  train-quiet   the same with logging_steps 100 (no per-step loss/entropy/accuracy sync)
  train-nopack  the same without packing (padded batches: a causal mask with padding)
It prints the step times and the profiler's top operators by self CPU and self CUDA time. cuDNN's graph cache lives
as long as the process: compare variants one per process (--runs train, --cudnn-sdp off). Results: <out>/profile-*.json and <out>/*.txt tables; measured: docs/benchmarks.md, "GPU".
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))


def bare_step_ms(model_dir: Path, tokens: int, packed: int, steps: int) -> float:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.device("cuda"):
        m = LlamaForCausalLM(LlamaConfig.from_pretrained(model_dir))
    m.config.use_cache = False
    opt = torch.optim.AdamW(m.parameters(), lr=1e-5, fused=True)
    ids = torch.randint(0, m.config.vocab_size, (1, tokens), device="cuda")
    kw = {}
    if packed:
        kw["position_ids"] = (torch.arange(tokens, device="cuda") % (tokens // packed)).unsqueeze(0)
    times = []
    for _ in range(steps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = m(input_ids=ids, labels=ids, **kw).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    del m, opt
    torch.cuda.empty_cache()
    return round(1e3 * sorted(times[3:])[len(times[3:]) // 2], 1)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="1b")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--out", default=str(ROOT / "outputs/gpu_profile"))
    p.add_argument("--runs", default="bare,train,train-quiet,train-nopack",
                   help="comma-separated subset (each process keeps cuDNN's graph cache: run one per process to compare)")
    p.add_argument("--cudnn-sdp", choices=["on", "off"], default="on",
                   help="off: torch.backends.cuda.enable_cudnn_sdp(False), so sdpa uses its flash/efficient kernels")
    a = p.parse_args(argv)
    wanted = a.runs.split(",")

    import torch
    from torch.profiler import ProfilerActivity, profile
    from transformers import Trainer, TrainerCallback

    import gpu_bench
    import train
    from sftrecipes import tiny
    from sftrecipes.model import load as models
    from sftrecipes.recipe.load import load_recipe

    tiny.ensure_tiny_model()
    torch.backends.cuda.enable_cudnn_sdp(a.cudnn_sdp == "on")
    out = Path(a.out)
    model_dir, data = gpu_bench.write_inputs(out, a.size, samples=a.steps * 4 * 6, words=2048 // 3)
    result: dict = {"device": torch.cuda.get_device_name(0), "size": a.size, "cudnn_sdp": a.cudnn_sdp, "runs": {}}
    if "bare" in wanted:
        result["runs"]["bare-causal"] = {"step_ms": bare_step_ms(model_dir, 5904, 0, a.steps)}
        result["runs"]["bare-packed"] = {"step_ms": bare_step_ms(model_dir, 5904, 4, a.steps)}
    print(json.dumps(result), flush=True)

    models.load_model = gpu_bench.random_loader(model_dir, "cuda")

    class Profiled(TrainerCallback):
        def __init__(self, name):
            self.name, self.prof = name, None

        def on_step_begin(self, args, state, control, **kw):
            if state.global_step == 6:
                torch.cuda.synchronize()
                self.prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
                self.prof.__enter__()
                self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            if state.global_step == 10 and self.prof is not None:
                torch.cuda.synchronize()
                wall = time.perf_counter() - self.t0
                self.prof.__exit__(None, None, None)
                try:
                    self._report(wall)
                except Exception as e:  # noqa: BLE001 - the timings matter more than the tables
                    print(f"profiler report failed: {e!r}")

        def _report(self, wall):
            ka = self.prof.key_averages()
            for key in ("self_cpu_time_total", "self_device_time_total"):
                (out / f"{self.name}-cudnn-{a.cudnn_sdp}.{key}.txt").write_text(ka.table(sort_by=key, row_limit=30))
            print(ka.table(sort_by="self_cpu_time_total", row_limit=15))
            print(ka.table(sort_by="self_device_time_total", row_limit=15))
            result["runs"][self.name]["profiled_wall_s_4_steps"] = round(wall, 3)

    original = Trainer.train
    for name, extra in (("train", []), ("train-quiet", ["--logging_steps", "100"]), ("train-nopack", ["--packing", "false"])):
        if name not in wanted:
            continue
        result["runs"][name] = {}

        def patched(self, *args, _name=name, **kwargs):
            self.add_callback(Profiled(_name))
            return original(self, *args, **kwargs)

        Trainer.train = patched
        recipe = load_recipe(["recipes/tiny/full.yaml", "--model_name_or_path", str(model_dir), "--tokenizer_name_or_path",
                              ".assets/tiny-llama", "--dataset_name", str(data), "--splits", "train",
                              "--chat_template_format", "none", "--dataset_text_field", "text", "--max_length", "2048",
                              "--packing", "true", "--bf16", "true", "--per_device_train_batch_size", "4",
                              "--max_steps", str(a.steps), "--logging_steps", "1", "--gradient_checkpointing", "false",
                              "--sample_max_new_tokens", "0", "--learning_rate", "1e-5", "--launch.hardware", "gpu",
                              "--output_dir", str(out / name), *extra])
        _, summary = train.run(recipe)
        t = summary["throughput"]
        result["runs"][name].update(step_ms=round(1e3 * t["step_time_s"], 1), tokens_per_s=round(t["tokens_per_s_per_device"]),
                                    mfu=t["mfu"], tokens_per_step=t["ranks"][0]["real_tokens"] / t["ranks"][0]["steps"])
        print(json.dumps(result["runs"][name]), flush=True)
    Trainer.train = original
    (out / f"profile-{a.runs.replace(',', '+')}-cudnn-{a.cudnn_sdp}.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python
"""What train.py adds per step over bare TRL, by counts rather than time (they hold on a busy machine).

    python bench/overhead_profile.py [--row 10] [--steps 40]

For one row of `make bench`'s grid (bench/bench_train.py GRID; 10 = checkpointing on, batch 4, unpacked, LoRA), runs
`train.py` and `bench/bare_trl.py` (plain, no metrics wrapper: the callback is part of what train.py adds) for STEPS
and 2 x STEPS optimizer steps, each with its training loop under cProfile and torch.profiler. Per step = the
2 x STEPS counts less the STEPS ones, divided by STEPS, so setup cancels; the callbacks' train end (the plot, the
table) is timed apart. Prints: Python calls per step
of each, the functions whose per-step calls differ most, torch ops per step that differ, reads of a tensor's value
(`item`, `tolist`: a host sync on a GPU) per step, and every field in which the two trainers' arguments, model and
collator differ.
"""

from __future__ import annotations

import argparse
import json
import os
import pstats
import re
import runpy
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
READS = ("<method 'item' of 'torch._C.TensorBase' objects>", "<method 'tolist' of 'torch._C.TensorBase' objects>")


def child(out: str, argv: list[str]) -> None:
    """Run argv[0] as __main__ with the trainer's inner loop profiled; write OUT.prof, OUT.ops.json, OUT.config.json."""
    import cProfile

    import time

    import transformers
    from transformers.trainer_callback import CallbackHandler

    inner, end = transformers.Trainer._inner_training_loop, CallbackHandler.on_train_end
    state = {}

    def train_end(self, *a, **kw):  # once per run, not per step: timed apart, left out of the profile
        state["prof"].disable()
        t0 = time.thread_time()
        try:
            return end(self, *a, **kw)
        finally:
            Path(out + ".end.json").write_text(json.dumps({"train_end_cpu_s": time.thread_time() - t0}))

    def profiled(self, *a, **kw):
        from torch.profiler import ProfilerActivity, profile

        Path(out + ".config.json").write_text(json.dumps(describe(self), indent=0, default=str, sort_keys=True))
        prof, ops = cProfile.Profile(), profile(activities=[ProfilerActivity.CPU])
        state["prof"] = prof
        ops.__enter__()
        prof.enable()
        try:
            return inner(self, *a, **kw)
        finally:
            prof.disable()
            ops.__exit__(None, None, None)
            prof.dump_stats(out + ".prof")
            Path(out + ".ops.json").write_text(json.dumps({e.key: e.count for e in ops.key_averages()}))

    transformers.Trainer._inner_training_loop = profiled
    CallbackHandler.on_train_end = train_end
    sys.argv = argv
    sys.path.insert(0, str(ROOT))
    runpy.run_path(argv[0], run_name="__main__")


def describe(trainer) -> dict:
    """The trainer's arguments, and what the model and collator are, as comparable fields."""
    d = {f"args.{k}": v for k, v in trainer.args.to_dict().items()}
    model = trainer.model
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    layer = next((m for m in base.modules() if hasattr(m, "_gradient_checkpointing_func")), None)
    func = getattr(layer, "_gradient_checkpointing_func", None)
    d.update({
        "model.class": type(model).__name__, "model.attn_implementation": base.config._attn_implementation,
        "model.use_cache": base.config.use_cache, "model.dtypes": sorted({str(p.dtype) for p in model.parameters()}),
        "model.trainable": sum(p.numel() for p in model.parameters() if p.requires_grad),
        "model.checkpointing": repr(getattr(func, "keywords", func)),
        "model.hooks": sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules()),
        "collator": type(trainer.data_collator).__name__ + repr(sorted(
            (k, v) for k, v in vars(trainer.data_collator).items() if isinstance(v, (int, float, bool, str, type(None))))),
        "callbacks": [type(c).__name__ for c in trainer.callback_handler.callbacks],
    })
    d.pop("args.output_dir", None)
    return d


def commands(row, steps: int, out: Path) -> dict[str, list[str]]:
    sys.path.insert(0, str(ROOT / "bench"))
    import bench_train

    runs = {}
    for which in ("train.py", "bare_trl.py"):
        cmd = bench_train.command(which, row, steps, out / f"{which}-{steps}")
        runs[which] = cmd[cmd.index("-m") + 2:]  # without the metrics wrapper
    return runs


def per_step(small: dict, large: dict, steps: int) -> dict:
    return {k: (large.get(k, 0) - small.get(k, 0)) / steps for k in set(small) | set(large)}


def calls(prof: str) -> dict:
    out: dict[str, float] = {}
    for (f, line, name), v in pstats.Stats(prof).stats.items():
        key = f"{Path(f).name}:{line}({name})" if f != "~" else re.sub(r" at 0x[0-9a-f]+", "", name)  # one process's address
        out[key] = out.get(key, 0) + v[1]
    return out


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--child"]:
        child(argv[1], argv[2:])
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--row", type=int, default=10, help="row of bench/bench_train.py's GRID (0-15)")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--top", type=int, default=15)
    a = p.parse_args(argv)
    sys.path.insert(0, str(ROOT / "bench"))
    import bench_train

    row = bench_train.GRID[a.row]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    got: dict[tuple[str, int], str] = {}
    with tempfile.TemporaryDirectory(prefix="overhead-") as tmp:
        for steps in (a.steps, 2 * a.steps):
            for which, cmd in commands(row, steps, Path(tmp)).items():
                out = f"{tmp}/{which}-{steps}-profile"
                res = subprocess.run([sys.executable, __file__, "--child", out, *cmd], cwd=ROOT, env=env,
                                     capture_output=True, text=True)
                if res.returncode != 0:
                    sys.exit(f"overhead_profile: {which} failed (exit {res.returncode}):\n{res.stderr[-3000:]}")
                got[which, steps] = out
        py = {w: per_step(calls(got[w, a.steps] + ".prof"), calls(got[w, 2 * a.steps] + ".prof"), a.steps)
              for w in ("train.py", "bare_trl.py")}
        ops = {w: per_step(json.loads(Path(got[w, a.steps] + ".ops.json").read_text()),
                           json.loads(Path(got[w, 2 * a.steps] + ".ops.json").read_text()), a.steps)
               for w in ("train.py", "bare_trl.py")}
        config = {w: json.loads(Path(got[w, a.steps] + ".config.json").read_text()) for w in ("train.py", "bare_trl.py")}
        end = {w: json.loads(Path(got[w, 2 * a.steps] + ".end.json").read_text())["train_end_cpu_s"] for w in ("train.py", "bare_trl.py")}
    t, b = py["train.py"], py["bare_trl.py"]
    print(f"row {a.row}: {row.name}; per step over {a.steps} -> {2 * a.steps} steps")
    print(f"Python calls per step: train.py {sum(t.values()):,.0f}, bare TRL {sum(b.values()):,.0f} "
          f"({sum(t.values()) - sum(b.values()):+,.0f})")
    diff = sorted(((t.get(k, 0) - b.get(k, 0), k) for k in set(t) | set(b)), key=lambda x: -abs(x[0]))
    print("functions whose calls per step differ most (train.py - bare):")
    for d, k in [x for x in diff if abs(x[0]) >= 0.5][:a.top]:
        print(f"  {d:+9.1f}  {k}")
    for k in READS:
        print(f"value reads per step, {k.split()[1]}: train.py {t.get(k, 0):.2f}, bare TRL {b.get(k, 0):.2f}")
    od = {k: ops["train.py"].get(k, 0) - ops["bare_trl.py"].get(k, 0) for k in set(ops["train.py"]) | set(ops["bare_trl.py"])}
    od = {k: v for k, v in od.items() if abs(v) >= 0.5}
    print(f"torch ops per step: train.py {sum(ops['train.py'].values()):,.0f}, bare TRL {sum(ops['bare_trl.py'].values()):,.0f}; "
          + ("differing: " + ", ".join(f"{k} {v:+.1f}" for k, v in sorted(od.items(), key=lambda x: -abs(x[1]))[:a.top]) if od else "the same ops"))
    print(f"callbacks' train end (once a run, outside the profile; in the trainer's train_runtime): "
          f"train.py {end['train.py']:.2f} s CPU, bare TRL {end['bare_trl.py']:.2f} s")
    ca, cb = config["train.py"], config["bare_trl.py"]
    print("trainer arguments, model and collator: where they differ")
    for k in sorted(set(ca) | set(cb)):
        if ca.get(k) != cb.get(k):
            print(f"  {k}: train.py {ca.get(k)!r:.200} | bare TRL {cb.get(k)!r:.200}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

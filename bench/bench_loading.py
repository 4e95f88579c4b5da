#!/usr/bin/env python
"""`make bench-loading`: each rank's memory, phase by phase, for every CPU twin backend at the calibration size.

    python bench/bench_loading.py [--twins ddp,zero3,...] [--repeat 2] [--steps 3] [--no-docs] [--from-results JSON]

The model is the `large` tiny Llama (252M parameters, saved in bf16: 504 MB; built once into .assets/large-llama).
Each twin runs through its own launcher (scripts/run_tiny-<twin>.sh, 2 ranks) with that model, `--max_steps`
--steps, `--max_length 64`, micro-batch 1, no checkpoint, no sample reply; `--repeat` runs of each, interleaved
(twin A, B, ..., then A, B, ... again) so that a drift of the host shows as a spread rather than as a backend's cost.
Every figure is read from the run's own `run_summary.json` -> `memory`: per rank, the RSS before loading (baseline)
and each phase's peak from the kernel's high-water mark reset at the phase's start (loading, wrapping, first_steps;
sftrecipes.train.probes.PhaseMemory). A cell is `min-max` over the repeats of the phase's peak less the baseline and less
the libraries' file pages mapped since (probes.growth_mb: how many pages a touch maps is the filesystem's), MB.
Beside loading's peak, what is held at its end and the first steps' peak: the planner's figure for the same recipe
(Plan.rank_loading, Plan.rank_steps: sftrecipes/plan/ranks.py) and its distance from the farthest run. --from-results re-plans an earlier results.json.
Results go to docs/loading.md between the loading-bench markers (the rest of the file is kept).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
DOCS = ROOT / "docs" / "loading.md"
START, END = "<!-- loading-bench:start -->", "<!-- loading-bench:end -->"
TWINS = ["ddp", "zero1", "zero2", "zero3", "offload", "fsdp1", "fsdp", "qlora-fsdp", "qlora-zero3"]
PHASES = ["loading", "wrapping", "first_steps"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def overrides(model: Path, steps: int) -> list[str]:
    return ["--model_name_or_path", str(model), "--max_steps", str(steps), "--max_length", "64",
            "--per_device_train_batch_size", "1", "--gradient_accumulation_steps", "1", "--save_strategy", "no",
            "--sample_max_new_tokens", "0", "--logging_steps", "1"]


def planned(twin: str, model: Path, steps: int) -> dict[int, tuple]:
    """The planner's figures for the twin as run: rank -> (loading's peak, its ceiling where the filesystem's folios
    can raise it or None, held after loading, its ceiling or None, the first steps' peak, the RSS before loading less
    the libraries' file pages), MB."""
    from sftrecipes.plan import plan_recipe
    from sftrecipes.plan.ranks import loading_of
    from sftrecipes.recipe.load import load_recipe

    plan = plan_recipe(load_recipe([f"recipes/tiny/{twin}.yaml", *overrides(model, steps)]), _alternatives=False)
    def mb(gb: float | None) -> float | None:
        return gb * 1e3 if gb is not None else None
    return {rank: (g.peak_gb * 1e3, mb(g.peak_up_to_gb), g.held_gb * 1e3, mb(g.held_up_to_gb),
                   plan.rank_steps.peak_gb * 1e3, plan.rank_steps.baseline_gb * 1e3)
            for rank in (0, 1) for g in [loading_of(plan.rank_loading, rank)]}


def run_twin(twin: str, model: Path, out: Path, steps: int) -> tuple[list[dict], float]:
    """One 2-rank run of the twin; (its per-rank memory rows, wall seconds)."""
    cmd = [f"scripts/run_tiny-{twin}.sh", "--output_dir", str(out), *overrides(model, steps)]
    shutil.rmtree(out, ignore_errors=True)  # a folder holding a finished run would be a no-op, and its old summary read
    start = time.time()
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1800,
                         env={**os.environ, "MAIN_PROCESS_PORT": str(free_port())})
    if res.returncode != 0:
        raise SystemExit(f"{twin} failed (exit {res.returncode}):\n{(res.stdout + res.stderr)[-3000:]}")
    summary = json.loads((out / "run_summary.json").read_text())
    return summary["memory"], time.time() - start


def span(values: list[float]) -> str:
    lo, hi = min(values), max(values)
    return f"{lo:,.0f}" if round(lo) == round(hi) else f"{lo:,.0f}–{hi:,.0f}"


def spread(values: list[float]) -> float:
    """(max - min) / max, the repeats' disagreement."""
    return (max(values) - min(values)) / max(max(values), 1.0)


def against(measured: list[float], plan: float, up_to: float | None = None) -> str:
    """The planned figure and its distance from the run farthest from it, as a share of that run's: `plan (+d%)`;
    with a ceiling, `plan–ceiling` and the distance from the nearer end (0 within)."""
    def off(v: float) -> float:
        return plan - v if up_to is None or v <= plan else min(up_to - v, 0.0)
    far = max(measured, key=lambda v: abs(off(v)))
    shown = f"{plan:,.0f}" if up_to is None else f"{plan:,.0f}–{up_to:,.0f}"
    return f"{shown} ({off(far) / max(far, 1.0):+.0%})"


def table(results: dict[str, list[list[dict]]], params: int, weights_mb: float, plans: dict[str, dict]) -> str:
    from sftrecipes.train.probes import growth_mb

    lines = [f"Measured {datetime.date.today()} on {platform.machine()}, {os.cpu_count()} cores, 2 ranks, model "
             f"{params / 1e6:.0f}M parameters ({weights_mb:,.0f} MB in bf16), {len(next(iter(results.values())))} runs "
             "per twin: each phase's peak RSS less the rank's RSS before loading and less the libraries' file pages "
             "mapped since (`probes.growth_mb`), MB (min–max over the runs); planned: the planner's figure for the rank "
             "on the cpu target (`plan`, sftrecipes/plan/ranks.py) and its distance from the farthest run, as a share "
             "of that run's figure. Baseline: the RSS before loading less the libraries' file pages (in brackets: "
             "those pages, and after the first steps).", "",
             "| twin | rank | baseline (libraries) | planned | loading | planned | held after loading (of it checkpoint "
             "pages) | planned | wrapping | first steps | planned | spread of the peak |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for twin, runs in results.items():
        for rank in (0, 1):
            rows = [next(r for r in run if r["rank"] == rank) for run in runs]
            peak_plan, up_to, held_plan, held_up_to, steps_plan, base_plan = plans[twin][rank]
            own = [r["baseline_mb"] - r["baseline_library_mb"] for r in rows]
            libs = (f"{span([r['baseline_library_mb'] for r in rows])} → "
                    f"{span([r['first_steps']['end_library_mb'] for r in rows])}")
            loading, held = [growth_mb(r, "loading") for r in rows], [growth_mb(r, "loading", "end_mb") for r in rows]
            steps = [growth_mb(r, "first_steps") for r in rows]
            cells = [f"{span(own)} ({libs})", against(own, base_plan), span(loading), against(loading, peak_plan, up_to),
                     f"{span(held)} ({span([r['loading']['end_checkpoint_mb'] for r in rows])})", against(held, held_plan, held_up_to),
                     span([growth_mb(r, "wrapping") for r in rows]), span(steps), against(steps, steps_plan)]
            peaks = [max(r[p]["peak_mb"] for p in PHASES) for r in rows]
            lines.append(f"| {twin if rank == 0 else ''} | {rank} | " + " | ".join(cells) + f" | {spread(peaks):.1%} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--twins", default=",".join(TWINS))
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--workdir", default=str(ROOT / "outputs" / "bench-loading"))
    ap.add_argument("--no-docs", action="store_true")
    ap.add_argument("--from-results", metavar="JSON", help="render and plan an earlier call's results.json, run nothing")
    args = ap.parse_args()
    from sftrecipes.core.paths import ASSETS
    from sftrecipes.train.probes import growth_mb
    from sftrecipes.tiny import ensure_tiny_model

    model = ensure_tiny_model(ASSETS / "large-llama", "large")
    from safetensors import safe_open

    weights_mb = sum(f.stat().st_size for f in model.glob("*.safetensors")) / 1e6
    params = 0  # the checkpoint's own count (a run's summary counts a 4-bit model's packed elements)
    for f in model.glob("*.safetensors"):
        with safe_open(f, "pt") as st:
            params += sum(math.prod(st.get_slice(k).get_shape()) for k in st.keys())
    twins = args.twins.split(",")
    results: dict[str, list[list[dict]]] = {t: [] for t in twins}
    if args.from_results:  # the measured runs of an earlier call, planned again (a planner change needs no new runs)
        results = {t: v for t, v in json.loads(Path(args.from_results).read_text()).items() if t in twins}
    for k in range(0 if args.from_results else args.repeat):
        for twin in twins:
            rows, seconds = run_twin(twin, model, Path(args.workdir) / f"{twin}-{k}", args.steps)
            results[twin].append(rows)
            print(f"{twin} run {k + 1}: {seconds:.0f}s " + "; ".join(
                f"rank {r['rank']}: " + ", ".join(f"{p} {growth_mb(r, p):.0f}" for p in PHASES) for r in rows), flush=True)
    text = table(results, params, weights_mb, {t: planned(t, model, args.steps) for t in results})
    print(text)
    if not args.from_results:
        (Path(args.workdir) / "results.json").write_text(json.dumps(results, indent=1))
    if not args.no_docs:
        doc = DOCS.read_text()
        block = f"{START}\n{text}{END}"
        doc = doc[: doc.index(START)] + block + doc[doc.index(END) + len(END):] if START in doc else doc.rstrip() + "\n\n" + block + "\n"
        DOCS.write_text(doc)
        print(f"wrote {DOCS.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

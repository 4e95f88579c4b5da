#!/usr/bin/env python
"""`make bench-grpo`: time per GRPO optimizer step of this project's train.py against a bare TRL GRPO script, tiny model.

    python bench/bench_grpo.py [--repeats 8] [--steps 60] [--warmup 5] [--rows answer_letters,brevity] [--no-docs]

Each row is one reward function of recipes/tiny/rewards.py. (a) `train.py recipes/tiny/grpo.yaml --reward_funcs
recipes/tiny/rewards.py:<reward>` and (b) `bench/bare_grpo.py --reward <reward>` (the recipe's settings in GRPOConfig,
GRPOTrainer and peft's LoraConfig: data/tiny_grpo, LoRA r 8 all-linear, batch 16, 4 generations of up to 12 tokens,
temperature 1, lr 5e-2 constant, seed 42) each run as its own process, alternating a, b, a, b, after one untimed run
of each, every run on the same core with one torch thread. Both run under this script's `--child`, which gives every
GRPOTrainer one more callback (StepClock, step_clock()): the wall and CPU clocks at each optimizer step's end, so one
instrument times both. A run's time per step is the median of its step-to-step intervals after the first `--warmup`
steps (what the callbacks of either script do between two step ends, logging included, is inside them); a script's
figure is the median over its runs, and the goal (train.py <= 1.03x bare TRL) is read on their ratio.

What makes the ratio mean something, recorded by StepClock too: each trainer's arguments, model, generation settings
(eos ids, generation kwargs, chat template) and callbacks, compared field by field, and the logged completion lengths
and rewards, compared run by run (the same seed samples the same completions in both); the table says where the two
differ. Where train.py's extra time goes, measured in the same runs: the main thread's CPU time inside each callback's
events, the model's forward hooks and the garbage collector, each other thread's CPU time, minor page faults.

Results go to bench/results/grpo-bench-<date>.{json,md} and docs/benchmarks.md between the grpo-bench markers; the
exit status is 1 when a row misses the goal.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import runpy
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
from bench_train import versions, write_section  # noqa: E402 - bench/ put on the path first

DOCS, RESULTS = ROOT / "docs" / "benchmarks.md", ROOT / "bench" / "results"
START, END = "<!-- grpo-bench:start -->", "<!-- grpo-bench:end -->"
RECIPE = "recipes/tiny/grpo.yaml"
REWARDS = ("answer_letters", "brevity")  # recipes/tiny/rewards.py: lengths stay near the limit | fall as it learns
GOAL_RATIO = 1.03
SCRIPTS = ("train.py", "bare_grpo.py")
# fields where the two trainers may differ without doing different work: train.py's callbacks (what it adds, and
# what this benchmark weighs) and its own TrainingArguments defaults that change no step's computation
# (reward_weights: train.py passes the recipe's [1.0], bare TRL None, which GRPOTrainer reads as ones: the trainer's
# resolved weights, field "reward_weights", are compared too; do_train: read by scripts, not by Trainer.train)
EXPECTED = {"callbacks", "args.ddp_timeout", "args.logging_dir", "args.run_name", "args.do_train", "args.reward_weights"}


# ----------------------------------------------------------------------------------------------- inside a run


def child(record: str, argv: list[str]) -> None:
    """Run argv[0] as __main__ with a StepClock on every GRPOTrainer/RLOOTrainer; it writes RECORD (JSON)."""
    import trl

    for cls in (trl.GRPOTrainer, trl.RLOOTrainer):
        init = cls.__init__

        def patched(self, *args, callbacks=None, _init=init, **kwargs):
            clock = step_clock(record)
            _init(self, *args, callbacks=[*(callbacks or []), clock], **kwargs)  # last: after the script's own
            clock.trainer = self
            clock.time_callbacks(self.callback_handler.callbacks)

        cls.__init__ = patched
    sys.argv = argv
    sys.path.insert(0, str(Path(argv[0]).resolve().parent))
    runpy.run_path(argv[0], run_name="__main__")


def step_clock(record: str):
    """The one instrument both scripts run under: at each optimizer step's end the wall clock, the process's and the
    main thread's CPU time and its minor page faults; the main thread's CPU time inside every other callback's events,
    inside the forward hooks on the model at train begin (ThroughputCallback's token count) and in the garbage
    collector, summed by name; each
    other thread's CPU time from train begin to the last step's end; at train end all of it, the log history and
    setup() into RECORD."""
    import gc
    import resource

    from transformers import TrainerCallback

    costs: dict[str, float] = {}  # "Callback.on_event" / "hook <qualname>" / "gc gen N" -> main-thread CPU s so far
    began: list[float] = []

    def collecting(phase: str, info: dict) -> None:  # the garbage collector's passes, by generation
        if phase == "start":
            began[:] = [time.thread_time()]
        elif began:
            name = f"gc gen {info.get('generation')}"
            costs[name] = costs.get(name, 0.0) + time.thread_time() - began.pop()

    gc.callbacks.append(collecting)

    def timed(name: str, fn):
        def run(*a, **kw):
            t0 = time.thread_time()
            try:
                return fn(*a, **kw)
            finally:
                costs[name] = costs.get(name, 0.0) + time.thread_time() - t0
        return run

    class StepClock(TrainerCallback):
        def __init__(self):
            self.trainer, self.first_step_unix, self.steps = None, None, []

        def time_callbacks(self, callbacks) -> None:
            for cb in callbacks:
                if cb is self:
                    continue
                for event in (e for e in vars(TrainerCallback) if e.startswith("on_")):
                    if getattr(type(cb), event, None) is not getattr(TrainerCallback, event):  # the callback's own
                        setattr(cb, event, timed(f"{type(cb).__name__}.{event}", getattr(cb, event)))

        def on_train_begin(self, args, state, control, model=None, **kwargs):
            self.threads_begin = thread_cpu()
            for module in model.modules() if model is not None else ():  # hooks the callbacks put there at train begin
                for hooks in (module._forward_pre_hooks, module._forward_hooks):
                    for key, hook in list(hooks.items()):
                        hooks[key] = timed(f"hook {getattr(hook, '__qualname__', type(hook).__name__)}", hook)

        def on_step_end(self, args, state, control, **kwargs):
            self.steps.append({"wall": time.perf_counter(), "cpu": time.process_time(), "main_cpu": time.thread_time(),
                               "minflt": resource.getrusage(resource.RUSAGE_SELF).ru_minflt, "costs": dict(costs)})
            if self.first_step_unix is None:
                self.first_step_unix = time.time()
            if state.global_step == state.max_steps:  # the last: before train end stops the callbacks' threads
                self.threads = {k: v - self.threads_begin.get(k, 0.0) for k, v in thread_cpu().items()}

        def on_train_end(self, args, state, control, **kwargs):
            Path(record).write_text(json.dumps({
                "steps": self.steps, "first_step_unix": self.first_step_unix, "log_history": state.log_history,
                "threads": getattr(self, "threads", {}),
                "setup": setup(self.trainer)}, default=str))

    return StepClock()


def thread_cpu() -> dict[str, float]:
    """CPU seconds of each thread of this process but the main one, by its Python name (the kernel's schedstat)."""
    import threading

    out = {}
    for t in threading.enumerate():
        if t is not threading.main_thread() and t.native_id is not None:
            try:
                ns = int(Path(f"/proc/self/task/{t.native_id}/schedstat").read_text().split()[0])
            except (OSError, ValueError, IndexError):  # ended meanwhile
                continue
            out[f"{t.name} ({type(t).__name__})"] = ns / 1e9
    return out


def setup(trainer) -> dict:
    """What decides a step's work, as comparable fields: bench/overhead_profile.describe (arguments, model, collator,
    callbacks) and the generation settings GRPO samples with."""
    from overhead_profile import describe

    d = describe(trainer)
    tok = getattr(trainer.processing_class, "tokenizer", trainer.processing_class)
    template = tok.chat_template if isinstance(tok.chat_template, str) else json.dumps(tok.chat_template)
    d.update({"generation.eos_token_ids": list(trainer.eos_token_ids), "generation.pad_token_id": tok.pad_token_id,
              "generation.kwargs": {k: v for k, v in sorted(getattr(trainer, "generation_kwargs", {}).items())},
              "generation.chat_template_sha256": hashlib.sha256((template or "").encode()).hexdigest()[:16],
              "rewards": [getattr(f, "__name__", str(f)) for f in trainer.reward_funcs],
              "reward_weights": trainer.reward_weights.tolist(), "train_rows": len(trainer.train_dataset)})
    return d


# ----------------------------------------------------------------------------------------------- the runs


def command(which: str, reward: str, steps: int, out: Path, record: Path) -> list[str]:
    run = [sys.executable, str(Path(__file__).resolve()), "--child", str(record)]
    if which == "train.py":
        # one torch thread, as OMP_NUM_THREADS=1 gives the bare script; no sample reply after training (not timed)
        return run + ["train.py", RECIPE, "--output_dir", str(out), "--reward_funcs", f"recipes/tiny/rewards.py:{reward}",
                      "--reward_weights", "1.0", "--max_steps", str(steps), "--sample_max_new_tokens", "0",
                      "--launch.cpu_threads", "1"]
    return run + ["bench/bare_grpo.py", str(out), "--reward", reward, "--max_steps", str(steps)]


def busy_jiffies() -> tuple[int, int]:
    """(busy, total) CPU time of the whole machine so far, from /proc/stat."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return sum(fields) - idle, sum(fields)


def one_run(which: str, reward: str, steps: int, warmup: int, workdir: Path, tag: str) -> dict:
    out, record = workdir / f"{which}-{reward}-{tag}", workdir / f"{which}-{reward}-{tag}.json"
    env = {k: v for k, v in os.environ.items() if k != "SFTRECIPES_FORK_SERVER"}  # its own process: no fork server
    env.update({"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
                "PYTHONUNBUFFERED": "1"})
    core = max(os.sched_getaffinity(0))  # every run on the same core (bench_train.py: unpinned runs spread wider)
    machine0, own0, launched = busy_jiffies(), os.times(), time.time()
    res = subprocess.run(command(which, reward, steps, out, record), cwd=ROOT, env=env, capture_output=True, text=True,
                         preexec_fn=lambda: os.sched_setaffinity(0, {core}))
    wall = time.time() - launched
    machine1, own1 = busy_jiffies(), os.times()
    if res.returncode != 0 or not record.exists():
        sys.exit(f"bench_grpo: {which} failed (exit {res.returncode}):\n{res.stderr[-3000:]}")
    r = json.loads(record.read_text())
    steps_done = r["steps"]
    if len(steps_done) != steps or steps - warmup < 2:
        sys.exit(f"bench_grpo: {which} timed {len(steps_done)} steps of {steps} (warm-up {warmup}); give --steps > --warmup + 1")
    window = steps_done[warmup:]  # the steps timed: each interval from one step's end to the next
    n = len(window) - 1
    per_step = lambda key: [b[key] - a[key] for a, b in zip(window, window[1:])]  # noqa: E731
    first, last = window[0], window[-1]
    logs = [e for e in r["log_history"] if "completions/mean_length" in e]
    return {
        "step_ms": 1e3 * statistics.median(per_step("wall")), "cpu_ms": 1e3 * statistics.median(per_step("cpu")),
        "main_cpu_ms": 1e3 * statistics.median(per_step("main_cpu")),
        "other_threads_ms": max(0.0, 1e3 * ((last["cpu"] - first["cpu"]) - (last["main_cpu"] - first["main_cpu"])) / n),
        "minflt_per_step": (last["minflt"] - first["minflt"]) / n,
        "callbacks_ms": {k: 1e3 * (v - first["costs"].get(k, 0.0)) / n for k, v in last["costs"].items()},
        "threads_ms": {k: 1e3 * v / len(steps_done) for k, v in r["threads"].items()},  # over the whole training
        "steps_s": last["wall"] - first["wall"], "launch_to_first_step_s": r["first_step_unix"] - launched, "wall_s": wall,
        "trl_step_time_ms": 1e3 * statistics.median(e["step_time"] for e in logs if "step_time" in e) if logs else None,
        "logged": [{k: e.get(k) for k in ("step", "completions/mean_length", "completions/clipped_ratio", "reward")} for e in logs],
        "setup": r["setup"], "jiffies": (machine1[0] - machine0[0], machine1[1] - machine0[1]),
        "run_cpu_s": own1.children_user + own1.children_system - own0.children_user - own0.children_system,
        "loadavg": os.getloadavg()[0],
    }


# ----------------------------------------------------------------------------------------------- the report


def stats(runs: list[dict], key: str) -> tuple[float, float, float]:
    values = [r[key] for r in runs]
    return min(values), statistics.median(values), max(values)


def setup_differences(a: dict, b: dict) -> dict[str, tuple]:
    return {k: (a.get(k), b.get(k)) for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)}


def same_work(a: list[dict], b: list[dict]) -> tuple[bool, str]:
    """Whether the runs of both scripts generated the same completion lengths and rewards at every logged step,
    and the figures: mean completion length over the logged steps, reward at the first and last log."""
    series = lambda r, k: [e[k] for e in r["logged"]]  # noqa: E731
    same = all(series(x, k) == series(y, k) for x in a for y in b for k in ("completions/mean_length", "reward"))

    def figures(runs):
        lengths = [statistics.fmean(series(r, "completions/mean_length")) for r in runs if r["logged"]]
        first = [r["logged"][0]["reward"] for r in runs if r["logged"]]
        last = [r["logged"][-1]["reward"] for r in runs if r["logged"]]
        if not lengths:
            return "-"
        return f"{statistics.median(lengths):.2f} tok, reward {statistics.median(first):.3f} → {statistics.median(last):.3f}"

    return same, f"{figures(a)} / {figures(b)}"


def others_load(runs: list[dict]) -> tuple[float, float]:
    """Cores kept busy by other processes during the runs (machine busy time less this benchmark's children), min and
    max over the runs, in cores."""
    tick, cores = os.sysconf("SC_CLK_TCK"), os.cpu_count() or 1
    shares = []
    for r in runs:
        busy, total = r["jiffies"]
        shares.append(max(0.0, (busy / tick - r["run_cpu_s"]) / (total / tick / cores)))
    return min(shares), max(shares)


def callback_costs(runs: list[dict], key: str) -> dict[str, float]:
    """CPU ms per step by name (callbacks_ms: each callback event and model hook, main thread; threads_ms: each other
    thread), the median over the runs."""
    names = {k for r in runs for k in r[key]}
    return {k: statistics.median(r[key].get(k, 0.0) for r in runs) for k in names}


def split_gc(costs: dict[str, float]) -> tuple[dict[str, float], float]:
    """(the callbacks' and hooks' costs, the garbage collector's in all)."""
    return {k: v for k, v in costs.items() if not k.startswith("gc ")}, sum(v for k, v in costs.items() if k.startswith("gc "))


def report(results: dict[str, dict[str, list[dict]]], args, argv: list[str], seconds: float) -> tuple[str, bool]:
    """The markdown section (also printed) and whether every row met the goal."""
    lines = [START, "## GRPO throughput", "",
             f"`{shlex.join(['python', 'bench/bench_grpo.py', *argv])}` (`make bench-grpo`), "
             f"{datetime.date.today().isoformat()}, {seconds / 60:.1f} min in all. {versions()}.", "",
             "Tiny Llama (.assets/tiny-llama), data/tiny_grpo (200 prompts), LoRA r=8 all-linear, fp32, CPU, sdpa, batch "
             "16 (4 prompts x 4 generations of up to 12 tokens, sampled at temperature 1), lr 5e-2 constant, beta 0, seed "
             f"42; the row's reward function from recipes/tiny/rewards.py alone. (a) `train.py {RECIPE} --reward_funcs "
             "recipes/tiny/rewards.py:<row>`; (b) `bench/bare_grpo.py --reward <row>`: the same settings in GRPOConfig + "
             "GRPOTrainer + peft's LoraConfig, nothing of sftrecipes. Runs alternate a, b, a, b "
             f"({args.repeats} each per row, {args.steps} steps), after {args.warmup_runs} untimed run(s) of each, every run "
             "on the same core with one torch thread. Both are timed by one callback added to each trainer (StepClock, "
             f"`bench/bench_grpo.py --child`): a run's step time is the median step-to-step wall time after its first "
             f"{args.warmup} steps (generation, rewards, loss, optimizer, every callback); a script's figure is the median "
             "over its runs (min / median / max shown), and the goal is read on the ratio of the medians (best-of: the ratio "
             "of the fastest runs, which a neighbour's load can only slow). CPU ms: the "
             "process's CPU time per step, likewise, and its ratio (a neighbour's load adds wall time, less CPU time). "
             "Completions: the mean completion length over the logged steps, and the reward at the first and last log, "
             "a / b; `same` when every logged length and reward of every run of one equals the other's.", "",
             "| reward | train.py ms / step (min / med / max) | bare TRL ms / step | ratio | best-of ratio | CPU ms / step a / b "
             "| CPU ratio | TRL's step_time ms a / b | launch → 1st step s a / b | completions a / b | same | goal |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---|---|---|"]
    where = ["", "Where train.py's time per step goes, the median over its runs, a / b: the main thread's CPU time inside "
             "each callback's events and the model's forward hooks, and in the garbage collector; the other threads' CPU "
             "time (on this benchmark's one core they take turns with the main thread); minor page faults. Added: "
             "train.py's callbacks, hooks, threads and GC less bare TRL's, as a share of bare TRL's CPU time per step.", "",
             "| reward | callbacks + hooks CPU ms / step a / b | train.py's more than bare's, the most "
             "| other threads CPU ms / step a / b | train.py's threads | GC ms / step a / b | page faults / step a / b "
             "| added | runs' spread a / b |",
             "|---|---:|---|---:|---|---:|---:|---:|---:|"]
    met, diffs, all_runs, spreads, shares = True, {}, [], [], []
    fmt = lambda t: " / ".join(f"{x:.1f}" for x in t)  # noqa: E731
    for reward, by in results.items():
        a, b = by["train.py"], by["bare_grpo.py"]
        all_runs += a + b
        ratio = stats(a, "step_ms")[1] / stats(b, "step_ms")[1]
        met &= ratio <= GOAL_RATIO
        same, figures = same_work(a, b)
        trl = [r["trl_step_time_ms"] for r in a], [r["trl_step_time_ms"] for r in b]
        lines.append(f"| {reward} | {fmt(stats(a, 'step_ms'))} | {fmt(stats(b, 'step_ms'))} | {ratio:.3f} | "
                     f"{stats(a, 'step_ms')[0] / stats(b, 'step_ms')[0]:.3f} | "
                     f"{stats(a, 'cpu_ms')[1]:.1f} / {stats(b, 'cpu_ms')[1]:.1f} | "
                     f"{stats(a, 'cpu_ms')[1] / stats(b, 'cpu_ms')[1]:.3f} | "
                     + (f"{statistics.median(trl[0]):.1f} / {statistics.median(trl[1]):.1f}" if None not in trl[0] + trl[1] else "-")
                     + f" | {stats(a, 'launch_to_first_step_s')[1]:.1f} / {stats(b, 'launch_to_first_step_s')[1]:.1f} | "
                     f"{figures} | {'yes' if same else 'no (figures beside)'} | "
                     f"≤ {GOAL_RATIO} {'met' if ratio <= GOAL_RATIO else 'MISSED'} |")
        (ca, ga), (cb, gb) = (split_gc(callback_costs(runs, "callbacks_ms")) for runs in (a, b))
        more = sorted(((v - cb.get(k, 0.0), k) for k, v in ca.items()), reverse=True)[:4]
        threads = sorted(((v, k) for k, v in callback_costs(a, "threads_ms").items()), reverse=True)[:3]
        ta, tb = stats(a, "other_threads_ms")[1], stats(b, "other_threads_ms")[1]
        added = (sum(ca.values()) - sum(cb.values())) + (ta - tb) + (ga - gb)
        spread = lambda runs: stats(runs, "step_ms")[2] / stats(runs, "step_ms")[0] - 1  # noqa: E731
        spreads += [spread(a), spread(b)]
        shares.append(added / stats(b, "cpu_ms")[1])
        where.append(f"| {reward} | {sum(ca.values()):.2f} / {sum(cb.values()):.2f} | "
                     + ", ".join(f"{k} {d:+.2f}" for d, k in more)
                     + f" | {ta:.2f} / {tb:.2f} | " + (", ".join(f"{k} {v:.2f}" for v, k in threads) or "-")
                     + f" | {ga:.2f} / {gb:.2f} | {stats(a, 'minflt_per_step')[1]:.0f} / {stats(b, 'minflt_per_step')[1]:.0f} | "
                     f"{added:+.2f} ms ({added / stats(b, 'cpu_ms')[1]:+.1%}) | {spread(a):.0%} / {spread(b):.0%} |")
        diffs.update(setup_differences(a[0]["setup"], b[0]["setup"]))
    low, high = others_load(all_runs)
    unexpected = {k: v for k, v in diffs.items() if k not in EXPECTED}
    lines += where + [
        "", f"Load from other processes during the runs: {low:.2f}-{high:.2f} of {os.cpu_count()} cores busy "
        "(the machine's busy time less this benchmark's own runs).",
        "Where the two trainers' arguments, model, collator, generation settings and callbacks differ: "
        + "; ".join(f"{k}: train.py adds {', '.join(c for c in v[0] if c not in v[1])}" if k == "callbacks"
                    else f"{k}: train.py {v[0]!s:.160} | bare {v[1]!s:.160}" for k, v in diffs.items())
        + (f". Beyond train.py's callbacks and bookkeeping: {', '.join(unexpected)}." if unexpected else
           ". Nothing else: the same arguments, model, LoRA, eos ids, generation kwargs and chat template."),
        "", f"Goal train.py ≤ {GOAL_RATIO}x bare TRL per step on every row: {'met' if met else 'MISSED'}. Runs of one "
        f"script doing the same work spread {min(spreads):.0%}-{max(spreads):.0%} (slowest over fastest) here; what "
        f"train.py adds, measured inside the runs: {min(shares):+.1%} to {max(shares):+.1%} of bare TRL's CPU time per step.",
        END]
    return "\n".join(lines), met


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--child"]:
        child(argv[1], argv[2:])
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    # on a shared machine the runs of one script spread by 10-40% with its neighbours' load (over the run, not
    # within it): more, shorter runs narrow a median more than longer ones (10 pairs of 60 steps, brevity, 2026-12-07:
    # pair ratios 0.82-1.16, median 0.998)
    p.add_argument("--repeats", type=int, default=8, help="runs of each script per row, alternated a, b, a, b")
    p.add_argument("--steps", type=int, default=60, help="optimizer steps per run (a tiny GRPO step: 50-65 ms)")
    p.add_argument("--warmup", type=int, default=5, help="first steps of each run left out of its step time")
    p.add_argument("--warmup_runs", type=int, default=1, help="untimed runs of each script first (disk, caches)")
    p.add_argument("--rows", default=",".join(REWARDS), help=f"reward functions, comma-separated: {', '.join(REWARDS)}")
    p.add_argument("--out", default=str(RESULTS), help="folder of grpo-bench-<date>.{json,md}")
    p.add_argument("--no-docs", action="store_true", help="leave docs/benchmarks.md alone")
    args = p.parse_args(argv)
    rows = args.rows.split(",")
    if not set(rows) <= set(REWARDS) or args.steps < args.warmup + 2:
        p.error(f"--rows: a comma-separated list of {', '.join(REWARDS)}; --steps at least --warmup + 2")
    sys.path.insert(0, str(ROOT))
    from sftrecipes.tiny import ensure_tiny_model

    os.chdir(ROOT)
    ensure_tiny_model()  # .assets/tiny-llama, built once (make assets)
    t0 = time.time()
    results: dict[str, dict[str, list[dict]]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-grpo-") as tmp:
        for i in range(args.warmup_runs):
            for which in SCRIPTS:
                one_run(which, rows[0], args.warmup + 2, 0, Path(tmp), f"warm{i}")
        for reward in rows:
            by = results.setdefault(reward, {w: [] for w in SCRIPTS})
            for i in range(args.repeats):
                for which in SCRIPTS:  # alternate, so drift and neighbours' load hit both alike
                    r = one_run(which, reward, args.steps, args.warmup, Path(tmp), str(i))
                    by[which].append(r)
                    print(f"{reward:<15} {which:<13} run {i + 1}: {r['step_ms']:.1f} ms/step (CPU {r['cpu_ms']:.1f}), "
                          f"launch->1st step {r['launch_to_first_step_s']:.1f} s, load {r['loadavg']:.2f}", flush=True)
    text, met = report(results, args, argv, time.time() - t0)
    print(text)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"grpo-bench-{datetime.date.today().strftime('%Y%m%d')}"
    stem.with_suffix(".md").write_text(text + "\n")
    for by in results.values():  # a script's setup once (its first run; report() compares those), not in every run
        for runs in by.values():
            for r in runs[1:]:
                r.pop("setup", None)
    stem.with_suffix(".json").write_text(json.dumps({"argv": argv, "goal_ratio": GOAL_RATIO, "met": met, "rows": results},
                                                    indent=1, default=str))
    print(f"bench_grpo: wrote {stem}.md and .json")
    if not args.no_docs:
        write_section(text, DOCS, START, END)
        print(f"bench_grpo: wrote the GRPO section of {DOCS.relative_to(ROOT)}")
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())

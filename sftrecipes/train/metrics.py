"""Training throughput, model FLOPs utilisation (MFU) and memory, per rank, measured by a TrainerCallback.

    trainer = SFTTrainer(..., callbacks=[ThroughputCallback(peak_tflops=None)])   # None: by GPU name; CPU: no MFU
    python -m sftrecipes.train.metrics [--peak_tflops X] SCRIPT [ARGS...]   # run any SFTTrainer script with the callback

What is counted
* Real tokens: the tokens the model computes on, padding excluded (labels of -100 do not matter: masked prompt
  tokens and the first token of each packed sample are still computed). A batch with an ``attention_mask`` counts
  its ones; a padding-free batch (TRL packing: ``position_ids``, no mask) counts every token except the trailing pad
  slots ``pad_to_multiple_of`` adds. Token slots (the batch's ``input_ids.numel()``) give the real-token share.
* Step time: wall time between consecutive optimizer steps (``on_step_end``), so data loading, logging and saving
  are included; throughput is steady state (first step, the warm-up, left out) and the first step is reported apart.
* Model FLOPs and MFU: flops.py (its docstring says what is counted); the callback sums a step's real tokens and
  attention pairs and reports MFU = model FLOPs / step time / device peak (HFU with gradient checkpointing's
  recomputed forward).
* Memory: the accelerator's peak allocated memory (``torch.cuda.max_memory_allocated``) and the process RSS before
  training, its peak during training (a background thread samples it every 50 ms) and at the end.

Where it goes: per-step scalars of rank 0 to TensorBoard, written at each log (logging_steps; no host sync per step,
see ThroughputCallback._count) (always: its own event file under
``output_dir/runs/throughput``, beside the trainer's own run when ``report_to`` has tensorboard; without it the
callback also writes the trainer's loss/learning rate there, so TensorBoard works with ``report_to: none``). At the
end every rank's totals are gathered to rank 0, printed as a table, written to ``output_dir/metrics.json`` and
``output_dir/metrics.png`` (loss and throughput; a preference run's rewards and accuracy), and kept in ``callback.summary`` for the run summary.
"""

from __future__ import annotations

import json
import logging
import os
import runpy
import statistics
import sys
import threading
import time
from pathlib import Path

import psutil
import torch
import trl
from accelerate import PartialState
from accelerate.utils import gather_object
from torch.utils.tensorboard import SummaryWriter
from transformers import TrainerCallback

from sftrecipes.facts.shape import Shape
from sftrecipes.train.flops import (
    batch_count_tensor,
    device_peak_tflops,
    matmul_params,
    model_shape_of,
    step_flops,
    trainable_split,
)

log = logging.getLogger("sftrecipes")

GB = 1e9
MAX_PENDING_STEPS = 1000  # steps whose token counts may wait on the device for the next log


# ----------------------------------------------------------------------------------------------- memory


class _RssSampler(threading.Thread):
    """Peak resident set size of this process, sampled every `interval` seconds until stop()."""
    def __init__(self, interval: float = 0.05):
        super().__init__(daemon=True, name="rss-sampler")

        self.proc, self.interval, self.peak = psutil.Process(), interval, 0
        self.last = self.rss()  # the latest sample: per-step readers take it rather than asking the OS again
        self._stop_event = threading.Event()

    def rss(self) -> int:
        return self.proc.memory_info().rss

    def run(self):
        while not self._stop_event.is_set():
            self.last = self.rss()
            self.peak = max(self.peak, self.last)
            self._stop_event.wait(self.interval)

    def stop(self) -> int:
        self._stop_event.set()
        self.join()
        self.peak = max(self.peak, self.rss())
        return self.peak


# ----------------------------------------------------------------------------------------------- the callback


class ThroughputCallback(TrainerCallback):
    """Real tokens/s/device, step time, MFU/HFU, accelerator and CPU memory per rank (module docstring).

    peak_tflops: the device's peak for MFU; None picks it from the GPU's name (PEAK_TFLOPS); on CPU, MFU is
    reported only when given. plot: write output_dir/metrics.png. After training, `summary` holds the gathered
    per-rank table (every rank gets it; rank 0 printed and wrote it)."""
    def __init__(self, peak_tflops: float | None = None, plot: bool = True, tensorboard: bool = True):
        self.peak_tflops, self.plot, self.tensorboard = peak_tflops, plot, tensorboard
        self.summary: dict = {}
        self._split: tuple[int, int] | None = None
        self.shape: Shape | None = None
        self._hook = None
        self._writer = None

    # -- events
    def on_init_end(self, args, state, control, model=None, **kwargs):
        if model is not None:  # before accelerate wraps (FSDP1 flattens parameters)
            self.shape = model_shape_of(model)
            self._split = trainable_split(model, self.shape)

    def on_train_begin(self, args, state, control, model=None, processing_class=None, **kwargs):

        if self._split is None:
            self.shape = model_shape_of(model)
            self._split = trainable_split(model, self.shape)
        if self.shape is None:
            self.peak_tflops = None  # no FLOP count, no MFU
        self.recompute = bool(getattr(args, "activation_checkpointing", False) or getattr(args, "gradient_checkpointing", False))
        self.cuda = torch.cuda.is_available() and not getattr(args, "use_cpu", False)
        self.device = torch.cuda.get_device_name() if self.cuda else "cpu"
        if self.peak_tflops is None and self.cuda:
            self.peak_tflops = device_peak_tflops(self.device)
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
        tok = getattr(processing_class, "tokenizer", processing_class)  # a processor wraps its tokenizer
        self.pad_id = getattr(tok, "pad_token_id", None)
        self.slots = 0  # since the last step end; the real tokens and pairs stay on the device (self._counts)
        self._counts = None
        self.steps: list[dict] = []  # complete rows (tokens read from the device), up to the last flush
        self._pending: list[tuple[dict, object]] = []  # (row, its [tokens, pairs] device tensor) since the last flush
        self.sampler = _RssSampler()
        self.rss_before = self.sampler.rss()
        self.sampler.start()
        # The model's own forward sees exactly what trains: the callback handler's model is the unwrapped module
        # that DDP/DeepSpeed/FSDP call into. Eval and generation run with model.training False and are skipped.
        self._hook = model.register_forward_pre_hook(self._count, with_kwargs=True)
        self._last = time.perf_counter()
        self.t_begin = self._last
        if state.is_world_process_zero and self.tensorboard:

            self._writer = SummaryWriter(log_dir=os.path.join(args.output_dir, "runs", "throughput"))
            self._mirror_logs = "tensorboard" not in (args.report_to or [])

    # No host sync per step: a micro-batch's counts are summed on its device (batch_count_tensor), each step's sum is
    # kept as a tensor, and all steps since the last log are read in one transfer at the next log (the trainer syncs
    # there anyway for the loss) or at train end; TensorBoard gets their per-step scalars then.
    def _count(self, module, args, kwargs):
        if module.training and "input_ids" not in kwargs and args and torch.is_tensor(args[0]):
            kwargs = {**kwargs, "input_ids": args[0]}  # ORPOTrainer and CPOTrainer pass the ids positionally
        if module.training and "input_ids" in kwargs:
            counts = batch_count_tensor(kwargs, self.pad_id)
            self._counts = counts if self._counts is None else self._counts + counts
            self.slots += int(kwargs["input_ids"].numel())

    def on_step_end(self, args, state, control, **kwargs):

        now = time.perf_counter()
        row = {"step": state.global_step, "seconds": now - self._last, "slots": self.slots, "unix": time.time(),
               "rss": self.sampler.last}
        if self.cuda:  # the allocator's host-side counter: no sync
            row["accelerator_peak"] = torch.cuda.max_memory_allocated()
        self._pending.append((row, self._counts))
        self.slots, self._counts = 0, None
        self._last = now
        if len(self._pending) >= MAX_PENDING_STEPS:  # logging off or very sparse: read them now and then anyway
            self._flush()

    def _flush(self) -> None:
        """Read the pending steps' token counts from the device (one transfer), complete their rows, write their
        TensorBoard scalars."""
        pending, self._pending = self._pending, []
        counted = [c for _, c in pending if c is not None]
        values = iter(torch.stack([c.to(counted[0].device) for c in counted]).tolist() if counted else [])
        for row, c in pending:
            row["tokens"], row["pairs"] = next(values) if c is not None else (0, 0)
            self.steps.append(row)
            if self._writer is not None:
                for tag, value in self._rates(row).items():
                    self._writer.add_scalar(tag, value, row["step"])

    def on_log(self, args, state, control, logs=None, **kwargs):
        self._flush()
        if self._writer is not None and self._mirror_logs and logs:
            for k, v in logs.items():
                if isinstance(v, (int, float)):
                    self._writer.add_scalar(f"train/{k}", v, state.global_step)

    def on_train_end(self, args, state, control, **kwargs):

        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        self._flush()
        mine = self._rank_totals(state)
        ranks = gather_object([mine])  # every rank must call it: a collective under DDP/DeepSpeed/FSDP
        self.summary = self._aggregate(ranks)
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        if state.is_world_process_zero:
            print(format_table(self.summary), flush=True)
            out = Path(args.output_dir)
            out.mkdir(parents=True, exist_ok=True)
            (out / "metrics.json").write_text(json.dumps(self.summary, indent=1))  # per-step series included
            if self.plot:
                save_plot(out / "metrics.png", state.log_history, ranks)
        for r in self.summary["ranks"]:
            r.pop("series", None)

    # -- arithmetic
    def _flops(self, tokens: float, pairs: float, recompute: bool = False) -> float:
        if self.shape is None:  # a layout shape.py does not know: no FLOP count
            return 0.0
        trained, adapter = self._split
        return step_flops(self.shape, tokens, pairs, trainable=trained, adapter=adapter, recompute=recompute)

    def _rates(self, row: dict) -> dict[str, float]:
        """Per-step TensorBoard scalars of this rank."""
        s = max(row["seconds"], 1e-9)
        out = {"perf/step_time_s": row["seconds"], "perf/tokens_per_s_per_device": row["tokens"] / s,
               "perf/real_token_share": row["tokens"] / max(row["slots"], 1), "mem/rss_gb": row["rss"] / GB}
        if self.shape is not None:
            out["perf/model_tflops_per_device"] = self._flops(row["tokens"], row["pairs"]) / s / 1e12
        if self.peak_tflops:
            out["perf/mfu"] = out["perf/model_tflops_per_device"] / self.peak_tflops
            if self.recompute:
                out["perf/hfu"] = self._flops(row["tokens"], row["pairs"], True) / s / 1e12 / self.peak_tflops
        if "accelerator_peak" in row:
            out["mem/accelerator_peak_gb"] = row["accelerator_peak"] / GB
        return out

    def _rank_totals(self, state) -> dict:

        rss_peak = self.sampler.stop()
        steady = self.steps[1:] or self.steps  # the first step (warm-up) is reported apart
        secs = sum(r["seconds"] for r in steady)
        toks = sum(r["tokens"] for r in steady)
        pairs = sum(r["pairs"] for r in steady)
        tps = toks / secs if secs else 0.0
        tflops = self._flops(toks, pairs) / secs / 1e12 if secs else 0.0
        first = self.steps[0] if self.steps else None
        rank = {
            "rank": PartialState().process_index, "device": self.device, "steps": len(self.steps),
            "real_tokens": sum(r["tokens"] for r in self.steps), "token_slots": sum(r["slots"] for r in self.steps),
            "step_time_s": statistics.median(r["seconds"] for r in steady) if steady else None,
            "tokens_per_s": tps, "ms_per_1k_real_tokens": 1e6 * secs / toks if toks else None,
            "model_tflops": tflops if self.shape else None,
            "flops_per_token": self._flops(toks, pairs) / toks if toks and self.shape else None,
            "mfu": tflops / self.peak_tflops if self.peak_tflops else None,
            "hfu": (self._flops(toks, pairs, True) / secs / 1e12 / self.peak_tflops
                    if self.peak_tflops and self.recompute and secs else None),
            "first_step_s": first["seconds"] if first else None,
            "first_step_unix": first["unix"] if first else None,  # wall clock, for launch-to-first-step
            "accelerator_peak_gb": torch.cuda.max_memory_allocated() / GB if self.cuda else None,
            "rss_before_gb": self.rss_before / GB, "rss_peak_gb": rss_peak / GB, "rss_end_gb": self.sampler.rss() / GB,
            "series": [{k: r[k] for k in ("step", "seconds", "tokens", "slots")} for r in self.steps],
        }
        rank["real_token_share"] = rank["real_tokens"] / rank["token_slots"] if rank["token_slots"] else None
        return rank

    def _aggregate(self, ranks: list[dict]) -> dict:
        ranks = sorted(ranks, key=lambda r: r["rank"])
        n = len(ranks)
        mean = lambda key: (sum(r[key] for r in ranks) / n) if all(r[key] is not None for r in ranks) else None  # noqa: E731
        trained, adapter = self._split
        return {
            "world_size": n, "device": ranks[0]["device"], "peak_tflops": self.peak_tflops,
            "tokens_per_s_per_device": mean("tokens_per_s"), "tokens_per_s": sum(r["tokens_per_s"] for r in ranks),
            "step_time_s": mean("step_time_s"), "ms_per_1k_real_tokens": mean("ms_per_1k_real_tokens"),
            "real_token_share": sum(r["real_tokens"] for r in ranks) / max(1, sum(r["token_slots"] for r in ranks)),
            "mfu": mean("mfu"), "hfu": mean("hfu"), "model_tflops_per_device": mean("model_tflops"),
            "flops_per_token": mean("flops_per_token"),
            "flops_convention": ("model FLOPs: (4N+2T+6A) per token + 12*L*d per causal (q,k) pair; "
                                 f"N={matmul_params(self.shape)} T={trained} A={adapter}; recompute in HFU only"
                                 if self.shape else "no FLOP count: the model's layout is not in sftrecipes/facts/shape.py"),
            "ranks": ranks,
        }


# ----------------------------------------------------------------------------------------------- output


COLUMNS = (("rank", "rank", "{}"), ("steps", "steps", "{}"), ("real tokens", "real_tokens", "{}"),
           ("real share", "real_token_share", "{:.3f}"), ("step ms", "step_time_s", "{:.1f}", 1e3),
           ("tok/s", "tokens_per_s", "{:.0f}"), ("ms/1k tok", "ms_per_1k_real_tokens", "{:.1f}"),
           ("TFLOP/s", "model_tflops", "{:.4f}"), ("MFU", "mfu", "{:.1%}"), ("HFU", "hfu", "{:.1%}"),
           ("1st step s", "first_step_s", "{:.2f}"), ("accel peak GB", "accelerator_peak_gb", "{:.2f}"),
           ("RSS before/peak/end GB", None, None))


def format_table(summary: dict) -> str:
    """The end-of-run table: one row per rank, then the mean/sum line."""
    def cell(r, col):
        name, key, fmt, *scale = col
        if key is None:
            return f"{r['rss_before_gb']:.2f}/{r['rss_peak_gb']:.2f}/{r['rss_end_gb']:.2f}"
        v = r.get(key)
        return "-" if v is None else fmt.format(v * scale[0] if scale else v)

    rows = [[c[0] for c in COLUMNS]] + [[cell(r, c) for c in COLUMNS] for r in summary["ranks"]]
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS))]
    lines = ["  ".join(v.rjust(w) for v, w in zip(row, widths)) for row in rows]
    mfu_txt = f"{summary['mfu']:.1%} of {summary['peak_tflops']:g} TFLOP/s" if summary["mfu"] is not None else "n/a (no peak_tflops)"
    lines.append(f"throughput: {summary['tokens_per_s_per_device']:.0f} real tokens/s/device ({summary['tokens_per_s']:.0f} "
                 f"total), real-token share {summary['real_token_share']:.3f}, MFU {mfu_txt} on {summary['device']}")
    return "\n".join(lines[:1] + ["-" * len(lines[0])] + lines[1:])


def save_plot(path: Path, log_history: list[dict], ranks: list[dict]) -> list[str]:
    """Loss (rank 0's logged losses) and real tokens/s per step of every rank, as a PNG; a preference run's logged
    rewards (chosen, rejected, margin) and chosen-over-rejected accuracy in a third panel. Returns the panels' y
    labels."""
    # matplotlib loads here, on the main process at the end: ~0.8 s of start-up every rank would pay otherwise
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    rewards = [e for e in log_history if "rewards/margins" in e and "loss" in e and "step" in e]  # train, not eval
    fig = Figure(figsize=(9, 9 if rewards else 6))
    FigureCanvasAgg(fig)
    axes = fig.subplots(3 if rewards else 2, 1, sharex=True)
    ax_loss, ax_tps = axes[0], axes[-1]
    losses = [(e["step"], e["loss"]) for e in log_history if "loss" in e and "step" in e]
    if losses:
        ax_loss.plot(*zip(*losses), marker=".")
    ax_loss.set_ylabel("training loss")
    for r in ranks:
        pts = [(s["step"], s["tokens"] / s["seconds"]) for s in r["series"] if s["seconds"] > 0]
        if pts:
            ax_tps.plot(*zip(*pts), label=f"rank {r['rank']}")
    ax_tps.set_ylabel("real tokens/s/device")
    ax_tps.set_xlabel("optimizer step")
    ax_tps.legend(loc="best")
    if rewards:
        ax_r = axes[1]
        steps = [e["step"] for e in rewards]
        for key in ("rewards/chosen", "rewards/rejected", "rewards/margins"):
            if key in rewards[0]:
                ax_r.plot(steps, [e[key] for e in rewards], marker=".", label=key.split("/")[1])
        ax_r.set_ylabel("reward (chosen, rejected, margin)")
        ax_r.legend(loc="upper left")
        if "rewards/accuracies" in rewards[0]:
            ax_acc = ax_r.twinx()
            ax_acc.plot(steps, [e["rewards/accuracies"] for e in rewards], color="black", linestyle="--", label="accuracy")
            ax_acc.set_ylabel("accuracy (chosen over rejected)")
            ax_acc.set_ylim(0, 1)
            ax_acc.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, format="png")
    return [label for ax in fig.axes if (label := ax.get_ylabel())]


# ----------------------------------------------------------------------------------------------- attach to any script


def attach(peak_tflops: float | None = None) -> None:
    """Make every SFTTrainer, DPOTrainer and KTOTrainer created from now on carry a ThroughputCallback (unless it
    already has one)."""
    for cls in (trl.SFTTrainer, trl.DPOTrainer, trl.KTOTrainer):
        init = cls.__init__
        if getattr(init, "_with_throughput", False):
            continue

        def patched(self, *args, callbacks=None, _init=init, **kwargs):
            callbacks = list(callbacks or [])
            if not any(isinstance(c, ThroughputCallback) for c in callbacks):
                callbacks.append(ThroughputCallback(peak_tflops=peak_tflops))
            _init(self, *args, callbacks=callbacks, **kwargs)

        patched._with_throughput = True
        cls.__init__ = patched


def main(argv: list[str] | None = None) -> int:
    """`python -m sftrecipes.train.metrics [--peak_tflops X] SCRIPT [ARGS...]`: run SCRIPT as __main__ with the callback."""
    argv = list(sys.argv[1:] if argv is None else argv)
    peak = None
    if argv[:1] == ["--peak_tflops"]:
        peak, argv = float(argv[1]), argv[2:]
    if not argv:
        print("usage: python -m sftrecipes.train.metrics [--peak_tflops X] SCRIPT [ARGS...]", file=sys.stderr)
        return 2
    from sftrecipes.train import metrics

    metrics.attach(peak)
    sys.argv = argv
    sys.path.insert(0, str(Path(argv[0]).resolve().parent))
    runpy.run_path(argv[0], run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())

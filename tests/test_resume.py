"""Exact resume: a run SIGKILLed at a random moment after a checkpoint, restarted with resume_from_checkpoint: auto,
ends with the weights of an uninterrupted run — single process, DDP, ZeRO-3 and FSDP, on 2 CPU ranks.

Deterministic settings: fp32 (no autocast), fixed seed. Data order (the sampler's epoch/skip), RNG states (dropout:
the LoRA twins keep lora_dropout > 0 on purpose), scheduler (linear decay) and optimizer are what resuming must
restore; any of them missing changes the weights. The kill moment is random; its seed is printed.
"""

import os
import random
import signal
import subprocess
import time

import pytest
import torch
from safetensors.torch import load_file

from conftest import ROOT, accelerate_command

CASES = {
    "single": ["recipes/tiny/lora.yaml", "--lora_dropout", "0.1"],
    "ddp": ["recipes/tiny/ddp.yaml"],
    "zero3": ["recipes/tiny/zero3.yaml"],
    "fsdp": ["recipes/tiny/fsdp.yaml"],
}
COMMON = ["--max_steps", "12", "--save_strategy", "steps", "--save_steps", "2", "--logging_steps", "1",
          "--lr_scheduler_type", "linear", "--learning_rate", "5e-3", "--bf16", "false", "--sample_max_new_tokens", "0"]


def run(argv, out, kill_after_checkpoint: int | None = None, delay: float = 0.0) -> str:
    cmd, env = accelerate_command(argv, out)
    out.parent.mkdir(parents=True, exist_ok=True)
    log = open(out.parent / f"{out.name}.log", "a")
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, **env}, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)  # its own process group: SIGKILL reaches every rank
    if kill_after_checkpoint is None:
        assert proc.wait(timeout=600) == 0, (out.parent / f"{out.name}.log").read_text()[-3000:]
        return "finished"
    marker = out / f"checkpoint-{kill_after_checkpoint}" / "checkpoint.complete.json"
    deadline = time.time() + 300
    while not marker.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    time.sleep(delay)
    if proc.poll() is not None:
        return "finished before the kill"
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)
    return "killed"


def final_weights(out) -> dict[str, torch.Tensor]:
    if (out / "adapter_model.safetensors").is_file():
        return load_file(out / "adapter_model.safetensors")
    from sftrecipes.export import export

    return load_file(export(out, out.parent / (out.name + "-export")) / "model.safetensors")


@pytest.mark.parametrize("case", list(CASES))
def test_sigkill_then_resume_auto_gives_the_uninterrupted_weights(tiny_model, tmp_path, case):
    seed = int(os.environ.get("RESUME_TEST_SEED", time.time_ns() % 10_000))
    rng = random.Random(seed)
    after, delay = rng.choice([2, 4]), rng.uniform(0.0, 0.6)  # at least 8 of 12 steps (>2 s) still to go
    print(f"{case}: seed {seed}: SIGKILL {delay:.2f}s after checkpoint-{after} is complete")
    argv = CASES[case] + COMMON
    run(argv, tmp_path / "straight")
    killed = tmp_path / "killed"
    what = run(argv, killed, kill_after_checkpoint=after, delay=delay)
    assert what == "killed", what
    assert not (killed / "run_summary.json").exists()  # it really died mid-run
    run(argv + ["--resume_from_checkpoint", "auto"], killed)
    import json

    resumed_from = json.loads((killed / "run_summary.json").read_text())["resumed_from"]
    assert resumed_from is not None and int(resumed_from.rsplit("-", 1)[-1]) >= after
    a, b = final_weights(tmp_path / "straight"), final_weights(killed)
    assert a.keys() == b.keys() and len(a) > 0
    worst = max((a[k].float() - b[k].float()).abs().max().item() for k in a)
    assert worst <= 1e-6, (case, worst)

"""Exact resume through the command a user runs (`python -m sftrecipes launch RECIPE`): an SFT run on a single process,
and on 2 CPU ranks a DDP SFT run on streamed data, a DPO run on FSDP2 and a GRPO run on ZeRO-3 -- each backend once,
under the method whose state is the hardest to restore there (resumes without kills, exact too: SFT on DDP and FSDP2
in run/test_faults.py, on ZeRO-2 in train/test_seqpar.py, KTO on QLoRA ZeRO-3 in train/test_preference_train.py).
One chain per case:

1. straight: an uninterrupted run without checkpoints (the reference weights; saving must not change training);
2. killed: the launcher is SIGKILLed (its pid, as a user or scheduler kills it) at a random moment after a checkpoint;
   every rank it started must be gone within seconds (they used to keep training into the same folder);
3. resumed with resume_from_checkpoint: auto (the killed run's stale lock is taken over), then preempted with SIGTERM
   or SIGUSR1 after a new checkpoint: every rank finishes its step, they save a complete checkpoint, exit 75,
   preempted.json names it;
4. resumed again: it ends with exactly the straight run's weights, and preempted.json is gone;
5. started again: a finished run is a no-op (exit 0, every file in the folder untouched; it used to train a step more);
6. (single process) the final save lost: resuming from the checkpoint at max_steps only saves, the same weights;
7. (streamed) its data as a folder whose last line is cut: every rank stops with a complete checkpoint (exit 2, one
   line naming the file and line); the line repaired, the run resumes there and ends with the straight run's weights.

Steps 2 and 3 (the kill, the preemption) start every process as a user does; the others, which are about weights and
files, start them as forks of the suite's fork server (conftest), which skips their imports.

Deterministic settings: fp32 (no autocast), fixed seed. Data order (the sampler's epoch/skip), RNG states (dropout:
the LoRA twins keep lora_dropout > 0 on purpose), scheduler (linear decay) and optimizer are what resuming must
restore; any of them missing changes the weights. The kill moment is random; its seed is printed.
"""

import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import ROOT, fork_server_env

pytestmark = pytest.mark.real_processes  # kills, signals and the processes left after them

CASES = {  # recipe + flags, the preemption signal
    # (the twins' batch: 4 rows of 128 tokens; the demo's 8 x 256 made this chain's 40-odd steps the suite's longest)
    "single": (["recipes/tiny/lora.yaml", "--lora_dropout", "0.1", "--per_device_train_batch_size", "4", "--max_length",
                "128"], signal.SIGTERM),
    # DPO through TRL's DPOTrainer on the FSDP2 twin (full fine-tune: the reference is a second copy, sharded like the
    # policy): the preemption callback, the checkpoint and the resume are the same under a preference trainer
    "dpo-fsdp": (["recipes/tiny/fsdp.yaml", "--method", "dpo", "--dataset_name", "data/tiny_dpo"], signal.SIGUSR1),
    # GRPO (TRL's GRPOTrainer) on the ZeRO-3 twin: completions sampled every 3 steps (steps_per_generation), so the
    # kill and the preemption fall inside generation cycles too: the random state generation samples with and the
    # completions a cycle still trains on (train/online.py) are in each checkpoint
    "grpo-zero3": (["recipes/tiny/zero3.yaml", "--method", "grpo", "--dataset_name", "data/tiny_grpo", "--reward_funcs",
                    "recipes/tiny/rewards.py:answer_letters", "--num_generations", "4", "--max_completion_length", "8",
                    "--steps_per_generation", "3"], signal.SIGTERM),
    # streamed data (stream.py): the position in the stream is part of each checkpoint; buffers of 40 rows, and the
    # 20 steps of 8 packed rows take the stream into its second data epoch
    "ddp-stream": (["recipes/tiny/ddp.yaml", "--streaming", "true", "--streaming_buffer_rows", "40"], signal.SIGUSR1),
}
STEPS = 20  # room for the latest preemption: killed <= 3 steps after checkpoint-4 (resumed from <= 6), signalled <= 1 step
#            after the next checkpoint (8), forwarded by launch within 0.1 s, every rank stopped <= 2 steps later: ~12
COMMON = ["--max_steps", str(STEPS), "--save_strategy", "steps", "--save_steps", "2", "--logging_steps", "1",
          "--lr_scheduler_type", "linear", "--learning_rate", "5e-3", "--bf16", "false", "--sample_max_new_tokens", "0"]


def processes_of(out: Path) -> dict[int, list[str]]:
    """pid -> command line of every live process whose command line names this output_dir: launch, torch's agent,
    the ranks (zombies run nothing and are left out)."""
    found = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            cmd = [a.decode() for a in (d / "cmdline").read_bytes().split(b"\0")]
            state = (d / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if str(out) in cmd and state not in ("Z", "X"):
            found[int(d.name)] = cmd
    return found


def ranks_of(out: Path) -> list[int]:
    """The ranks: train.py run as a script (launch and torch's agent are `python -m ...` with train.py an argument)."""
    return [pid for pid, cmd in processes_of(out).items() if "-m" not in cmd and any(a.endswith("train.py") for a in cmd)]


def complete_checkpoints(out: Path) -> set[str]:
    return {p.parent.name for p in out.glob("checkpoint-*/checkpoint.complete.json")}


def start(argv, out, forked: bool = False) -> subprocess.Popen:
    """`python -m sftrecipes launch RECIPE ... --output_dir OUT` as a user types it (in the test's process group).
    forked: its processes are forks of the suite's fork server (conftest), for the steps not about processes: the
    reference run, the last resume (its weights), the finished run's no-op."""
    out.parent.mkdir(parents=True, exist_ok=True)
    log = open(out.parent / f"{out.name}.log", "a")
    log.write(f"\n===== launch {' '.join(argv)}\n")
    log.flush()
    return subprocess.Popen([sys.executable, "-m", "sftrecipes", "launch", *argv, "--output_dir", str(out)], cwd=ROOT,
                            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(fork_server_env() if forked else {})})


def log_of(out: Path) -> str:
    return (out.parent / f"{out.name}.log").read_text()


def finish(proc, out, expect: int = 0) -> None:
    code = proc.wait(timeout=600)
    assert code == expect, (code, log_of(out)[-4000:])


def wait_for(cond, proc, out, what: str, timeout: float = 300) -> None:
    deadline = time.time() + timeout
    while not cond():
        assert proc.poll() is None, f"the run ended (exit {proc.returncode}) before {what}:\n{log_of(out)[-3000:]}"
        assert time.time() < deadline, f"no {what} within {timeout}s"
        time.sleep(0.05)


def snapshot(out: Path) -> dict[str, tuple]:
    return {str(p.relative_to(out)): (p.stat().st_size, p.stat().st_mtime_ns, hashlib.sha256(p.read_bytes()).hexdigest())
            for p in sorted(out.rglob("*")) if p.is_file()}


def final_weights(out) -> dict[str, torch.Tensor]:
    if (out / "adapter_model.safetensors").is_file():
        return load_file(out / "adapter_model.safetensors")
    from sftrecipes.export import export

    return load_file(export(out, out.parent / (out.name + "-export")) / "model.safetensors")


@pytest.mark.parametrize("case", list(CASES))
def test_kill_preempt_resume_gives_the_uninterrupted_weights(tiny_model, tmp_path, case):
    seed = int(os.environ.get("RESUME_TEST_SEED", time.time_ns() % 10_000))
    rng = random.Random(seed)
    after, kill_in, preempt_in = rng.choice([2, 4]), rng.uniform(0.0, 2.0), rng.uniform(0.0, 1.0)
    recipe, preempt = CASES[case]
    argv = recipe + COMMON
    world = 1 if case == "single" else 2

    finish(start(argv + ["--save_strategy", "no"], tmp_path / "straight", forked=True), tmp_path / "straight")
    # The moments are in steps of this machine (a DDP step can take 0.1 s: delays in seconds let the killed run get so
    # far that the resumed one ended before the preemption reached it, seen on CI)
    step_s = json.loads((tmp_path / "straight" / "run_summary.json").read_text())["seconds"] / STEPS
    delay = kill_in * step_s
    print(f"{case}: seed {seed}: SIGKILL {kill_in:.2f} steps ({delay:.2f}s) after checkpoint-{after} is complete; "
          f"then {preempt.name} {preempt_in:.2f} steps after the resumed run's first checkpoint")

    # 2. SIGKILL of the launcher: its ranks end with it
    out = tmp_path / "killed"
    proc = start(argv, out)
    wait_for(lambda: (out / f"checkpoint-{after}" / "checkpoint.complete.json").exists(), proc, out, f"checkpoint-{after}")
    time.sleep(delay)
    assert proc.poll() is None, "finished before the kill"
    assert len(ranks_of(out)) == world, processes_of(out)  # the ranks are found where they run
    proc.kill()
    proc.wait(timeout=60)
    killed_at = time.time()
    while processes_of(out) and time.time() - killed_at < 10:
        time.sleep(0.1)
    assert not processes_of(out), f"still running 10 s after the launcher was killed: {processes_of(out)}"
    assert not (out / "run_summary.json").exists()  # it really died mid-run

    # 3. resume (the dead launcher's lock is taken over), then a preemption signal after a new checkpoint
    resume = argv + ["--resume_from_checkpoint", "auto"]
    before = complete_checkpoints(out)
    proc = start(resume, out)
    wait_for(lambda: complete_checkpoints(out) - before, proc, out, "a new checkpoint")
    time.sleep(preempt_in * step_s)
    assert proc.poll() is None, "finished before the preemption"
    proc.send_signal(preempt)
    finish(proc, out, expect=75)
    record = json.loads((out / "preempted.json").read_text())
    ckpt = Path(record["checkpoint"])
    assert record["signal"] == preempt.name and ckpt == out / f"checkpoint-{record['step']}", record
    assert max(int(c.rsplit("-", 1)[1]) for c in complete_checkpoints(out) - before) <= record["step"] < STEPS, record
    assert (ckpt / "checkpoint.complete.json").is_file()
    log = log_of(out)
    assert "lock: taking over" in log and "its process is gone" in log  # the SIGKILLed run's lock
    assert "finishes its current optimizer step" in log  # stopped during training, not before it
    assert not processes_of(out)

    # 4. resume again: the uninterrupted run's weights
    finish(start(resume, out, forked=True), out)
    summary = json.loads((out / "run_summary.json").read_text())
    assert summary["resumed_from"] == str(ckpt) and summary["steps"] == STEPS
    assert not (out / "preempted.json").exists() and not (out / ".sftrecipes.lock").exists()
    if "--streaming" in argv:  # the stream's position was in each checkpoint, and the resumed run started there
        assert summary["data"]["preparation"]["how"] == "streamed" and summary["data"]["preparation"]["data_epoch"] >= 1
        assert all((c / "stream_position.json").is_file() for c in out.glob("checkpoint-*")), sorted(out.iterdir())
        assert log_of(out).count("resuming the stream at data epoch") == 2 * world and "data: stream at step" in log_of(out)
    a, b = final_weights(tmp_path / "straight"), final_weights(out)
    assert a.keys() == b.keys() and len(a) > 0
    worst = max((a[k].float() - b[k].float()).abs().max().item() for k in a)
    assert worst <= 1e-6, (case, worst)

    # 5. a finished run started again: nothing to do, nothing touched
    files = snapshot(out)
    finish(start(resume, out, forked=True), out)
    assert f"holds a finished run ({STEPS} steps" in log_of(out).rsplit("===== launch", 1)[1]
    assert snapshot(out) == files

    # 7. (streamed) the same rows as a folder of two files, the second's last line cut mid-string (a copy interrupted):
    #    every rank stops after the last whole step the rows before it cover, with a complete checkpoint, and says the
    #    file and line (exit 2, nothing left running); with the cut line gone the run resumes there, one line saying
    #    what changed, and ends with the uninterrupted run's weights
    if "--streaming" in argv:
        lines = list(open(ROOT / "data" / "tiny_chat" / "train.jsonl"))
        folder = tmp_path / "cut-data"
        folder.mkdir()
        (folder / "train-0.jsonl").write_text("".join(lines[:200]))
        (folder / "train-1.jsonl").write_text("".join(lines[200:]) + lines[0][:40])
        shutil.copy(ROOT / "data" / "tiny_chat" / "test.jsonl", folder / "test.jsonl")
        cut, on_folder = tmp_path / "cut", argv + ["--dataset_name", str(folder)]
        finish(start(on_folder, cut, forked=True), cut, expect=2)
        last = max(int(c.rsplit("-", 1)[1]) for c in complete_checkpoints(cut))
        said = "train-1.jsonl line 121 cannot be read (not valid JSON"
        log = log_of(cut)
        assert log.count(said) >= world and f"training stopped after step {last}: {cut}/checkpoint-{last} is complete" in log, log[-3000:]
        assert f"launch: every rank stopped (exit 2): dataset_name: {folder}/{said}" in log, log[-3000:]  # not "refused"
        assert 0 < last < STEPS and (cut / f"checkpoint-{last}" / "stream_position.json").is_file() and not processes_of(cut)
        assert not (cut / "run_summary.json").exists()
        (folder / "train-1.jsonl").write_text("".join(lines[200:]))  # the cut line removed
        finish(start(on_folder + ["--resume_from_checkpoint", "auto"], cut, forked=True), cut)
        resumed = log_of(cut).rsplit("===== launch", 1)[1]
        assert f"changed since checkpoint-{last} was saved (train-1.jsonl: size " in resumed and "read the same" in resumed
        c = final_weights(cut)
        assert max((a[k].float() - c[k].float()).abs().max().item() for k in a) <= 1e-6

    # 6. (single process) a run that died after its last checkpoint, before its final save was marked complete: it
    #    resumes from checkpoint-STEPS and only saves (transformers would train a step more: STEPS is no multiple of
    #    the steps per epoch here)
    if case == "single":
        (out / "final.complete.json").unlink()
        (out / "adapter_model.safetensors").unlink()
        finish(start(resume, out, forked=True), out)
        assert json.loads((out / "run_summary.json").read_text())["steps"] == STEPS
        assert all(torch.equal(a[k], v) for k, v in final_weights(out).items())

"""Sequence parallelism (launch.sequence_parallel_size: Ulysses on DeepSpeed) trains as one process does on the same
rows: the per-step losses and gradient norms of 2 and 4 ranks splitting each sequence equal one process's, packed and
unpacked, LoRA and full, on ZeRO-1, 2 and 3.

Same rows: the N ranks of a sequence-parallel group take turns, each micro-step training one of their batches split
over the N of them; so W ranks with per-device batch B and accumulation A train, each step, A x W/N batches of B:
the rows one process trains with batch B and accumulation A x W/N (accelerate hands consecutive batches to
consecutive ranks).

Tolerance (fp32, learning rate 1e-3): losses within 1e-6 relative (measured: equal, or 8e-8 where the ranks' sums
run in another order), gradient norms equal at the 4 digits the log prints (1e-3). Both catch what the run mends:
without train/seqpar.sp_compute_loss every ZeRO-1/2 gradient norm is N times one process's (2.892 against 1.446);
without the varlen kernel in the sdpa slot packed samples attend across their boundaries (step 1's loss 6.5654
against 6.5647, 1.1% apart by step 3).
"""

import json
import re

import pytest

from conftest import accelerate_command, run_cli

BASE = ["recipes/tiny/zero2.yaml", "--max_steps", "3", "--lora_dropout", "0", "--sample_max_new_tokens", "0",
        "--per_device_train_batch_size", "2", "--save_strategy", "no", "--logging_steps", "1", "--max_length", "96",
        "--learning_rate", "1e-3", "--bf16", "false"]
ONE = ["--launch.backend", "none", "--launch.gpus_per_node", "1", "--launch.zero_stage", "null",
       "--launch.zero3_init", "null"]
PACKED, UNPACKED = ["--packing", "true"], ["--packing", "false"]
FULL = ["--use_peft_lora", "false", "--lora_r", "null", "--lora_alpha", "null", "--lora_dropout", "null",
        "--lora_target_modules", "null"]

# name -> (sequence-parallel run's flags, one process's flags on the same rows)
CASES = {
    "2 ranks, packed, LoRA, ZeRO-2": (
        PACKED + ["--launch.sequence_parallel_size", "2"], PACKED + ONE),
    "2 ranks, unpacked, full, ZeRO-3": (
        UNPACKED + FULL + ["--launch.zero_stage", "3", "--launch.zero3_init", "true", "--launch.sequence_parallel_size", "2"],
        UNPACKED + FULL + ONE),
    "4 ranks in 2 groups of 2, unpacked, LoRA, ZeRO-2, accumulation 2": (
        UNPACKED + ["--launch.gpus_per_node", "4", "--launch.sequence_parallel_size", "2",
                    "--gradient_accumulation_steps", "2"],
        UNPACKED + ONE + ["--gradient_accumulation_steps", "4"]),
    "4 ranks in 1 group, packed, LoRA, ZeRO-1": (
        PACKED + ["--launch.gpus_per_node", "4", "--launch.zero_stage", "1", "--launch.sequence_parallel_size", "4"],
        PACKED + ONE),
}
LOSS_TOL, NORM_TOL = 1e-6, 1e-3


def run(flags: list[str], out) -> tuple[dict, list[float], str]:
    """(run summary, logged gradient norms, log) of the recipe run as its launcher would."""
    cmd, env = accelerate_command(BASE + flags, out)
    res = run_cli(cmd[1:], env=env)
    log = res.stdout + res.stderr
    assert res.returncode == 0, log[-4000:]
    norms = [float(x) for x in re.findall(r"'grad_norm': '([0-9.e+-]+)'", log)]
    return json.loads((out / "run_summary.json").read_text()), norms, log


@pytest.fixture(scope="module")
def one_process(tiny_model, tmp_path_factory):
    """One process's run per set of flags, each run once for the module."""
    tmp, done = tmp_path_factory.mktemp("one"), {}

    def get(flags: list[str]):
        key = " ".join(flags)
        if key not in done:
            done[key] = run(flags, tmp / f"one-{len(done)}")
        return done[key]

    return get


@pytest.mark.parametrize("name", list(CASES))
def test_sequence_parallel_ranks_train_as_one_process(name, one_process, tmp_path):
    sp_flags, one_flags = CASES[name]
    summary, norms, log = run(sp_flags, tmp_path / "sp")
    ref, ref_norms, _ = one_process(one_flags)
    assert summary["steps"] == ref["steps"] == 3
    assert len(norms) == len(ref_norms) == 3, log[-3000:]
    loss_diff = max(abs(a - b) / b for a, b in zip(summary["losses"], ref["losses"]))
    norm_diff = max(abs(a - b) / b for a, b in zip(norms, ref_norms))
    print(name, summary["losses"], ref["losses"], norms, ref_norms, loss_diff, norm_diff)
    assert loss_diff <= LOSS_TOL, (summary["losses"], ref["losses"])
    assert norm_diff <= NORM_TOL, (norms, ref_norms)
    if "--packing" in sp_flags and sp_flags[sp_flags.index("--packing") + 1] == "true":
        assert summary["packed"] and "sft_varlen (in the sdpa slot" in log  # the kernel that keeps samples apart

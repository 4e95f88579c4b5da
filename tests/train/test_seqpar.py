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


def adapter(out) -> dict:
    from safetensors.torch import load_file

    return load_file(str(out / "adapter_model.safetensors"))


def test_epochs_and_exact_resume_under_sequence_parallelism_and_into_another_split(one_process, tmp_path):
    """Over two epochs of 8 rows, 2 ranks in one sequence-parallel group train as one process does (each epoch's order
    reaches the sampler); their checkpoint at step 2 resumes to the uninterrupted run's weights under the same split
    and as 2 data-parallel ranks of half the batch (the same rows a step; ZeRO partitions over all ranks alike); a
    split that cannot make its global batch is refused in one line before any rank starts."""
    import shutil
    from pathlib import Path

    data = tmp_path / "rows"
    data.mkdir()
    for split, n in (("train", 8), ("test", 2)):
        lines = Path(f"data/tiny_chat/{split}.jsonl").read_text().splitlines()[:n]
        (data / f"{split}.jsonl").write_text("\n".join(lines) + "\n")
    flags = UNPACKED + ["--dataset_name", str(data), "--max_steps", "6", "--save_strategy", "steps", "--save_steps", "2"]
    sp = flags + ["--launch.sequence_parallel_size", "2"]
    whole, norms, _ = run(sp, tmp_path / "whole")
    ref, ref_norms, _ = one_process(flags + ONE)
    assert whole["steps"] == 6 and whole["losses"] == pytest.approx(ref["losses"], rel=LOSS_TOL)  # 4 steps an epoch
    assert norms == pytest.approx(ref_norms, rel=NORM_TOL)
    expected = adapter(tmp_path / "whole")
    for name, extra in (("same split", []),
                        ("data parallel", ["--launch.sequence_parallel_size", "1", "--per_device_train_batch_size", "1"])):
        out = tmp_path / name.replace(" ", "-")
        shutil.copytree(tmp_path / "whole" / "checkpoint-2", out / "checkpoint-2")
        summary, _, log = run(sp + extra, out)
        assert summary["resumed_from"].endswith("checkpoint-2") and summary["steps"] == 6, log[-2000:]
        assert summary["losses"][-4:] == pytest.approx(whole["losses"][-4:], rel=LOSS_TOL), name
        got = adapter(out)
        assert max((got[k] - expected[k]).abs().max().item() for k in expected) <= 1e-6, name
    out = tmp_path / "refused"
    shutil.copytree(tmp_path / "whole" / "checkpoint-2", out / "checkpoint-2")
    res = run_cli(["-m", "sftrecipes", "launch", *BASE, *sp, "--launch.sequence_parallel_size", "1",
                   "--output_dir", str(out)])
    last = res.stderr.strip().splitlines()[-1]
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stdout[-1500:] + res.stderr[-1500:]
    assert last.startswith("error: resume_from_checkpoint: checkpoint-2 trained with a global batch of 2 (1 group of 2 "
                           "processes (sequence parallel) x 2 per device x 1 accumulation = 2)"), last
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-2"]

"""Faults met for real (issue 12, part B), each reproduced: resuming on another process count, a full disk while
saving, a checkpoint whose marker lists an empty or changed file, non-finite losses from broken weights or data, a
final save that fails its check (one process, and rank 0 of two: every rank ends with it).

Resuming on another process count must continue exactly or stop with one line before the model loads: DDP and FSDP2
checkpoints continue (2 -> 1 -> 2 processes, gradient accumulation keeping the global batch: the same weights as the
uninterrupted 2-process run; DDP on streamed data too: the position in the stream is global); DeepSpeed ZeRO-3 refuses in both directions. Runs are tiny (LoRA or full fine-tune of
the tiny Llama, 3 steps, a checkpoint at each).
"""

import builtins
import json
import logging
import os
import re
import shutil
import types

import pytest
import torch
from safetensors.torch import load_file, save_file

import train
from conftest import ROOT, accelerate_command, run_cli
from sftrecipes.run import checkpoints as ck
from sftrecipes.train import finalsave, saving
from sftrecipes.core.errors import RecipeError
from sftrecipes.recipe.load import load_recipe

RECIPES = {"ddp": "recipes/tiny/ddp.yaml", "fsdp": "recipes/tiny/fsdp.yaml", "zero3": "recipes/tiny/zero3.yaml",
           "ddp-stream": "recipes/tiny/ddp.yaml"}
STREAM = ["--streaming", "true", "--streaming_buffer_rows", "16"]  # ddp-stream: streamed data (stream.py)
# fp32, no dropout (a different process count draws other dropout masks), a checkpoint at every step
STEPS = ["--save_strategy", "steps", "--save_steps", "1", "--logging_steps", "1", "--bf16", "false",
         "--sample_max_new_tokens", "0", "--lr_scheduler_type", "constant"]  # the schedule must not depend on max_steps


def launch(backend: str, out, processes: int, extra=(), env: dict | None = None) -> tuple[int, str]:
    """Run a twin recipe on `processes` processes as its launcher would; (exit code, log)."""
    argv = [RECIPES[backend], *STEPS, "--launch.gpus_per_node", str(processes), *extra, *(STREAM if "stream" in backend else ())]
    if backend != "fsdp":
        argv += ["--lora_dropout", "0"]
    cmd, launcher_env = accelerate_command(argv, out)
    res = run_cli(cmd[1:], env={**launcher_env, **(env or {})})
    return res.returncode, res.stdout + res.stderr


def weights(ckpt_or_out) -> dict[str, torch.Tensor]:
    """The trained tensors in a checkpoint or final save: the LoRA adapter, or the FSDP sharded (DCP) model."""
    if (ckpt_or_out / "adapter_model.safetensors").is_file():
        return load_file(ckpt_or_out / "adapter_model.safetensors")
    from sftrecipes.export.dcp import DCPSource

    src = DCPSource(ckpt_or_out / "pytorch_model_fsdp_0")
    return {n: src.get(n) for n in src.names()}


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys() and a
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def epoch(ckpt) -> float:
    return json.loads((ckpt / "trainer_state.json").read_text())["epoch"]


# ----------------------------------------------------------------------------------- another process count

@pytest.mark.parametrize("backend", ["ddp", "fsdp", "ddp-stream"])
def test_resume_on_another_process_count_continues_exactly(tiny_model, tmp_path, backend):
    """2 processes -> 1 -> 2: each resume keeps the global batch of 8 (4 per device) by gradient accumulation (2, then
    1 again) and ends with the uninterrupted run's weights; the epoch counter does not jump back. Before, the 1-process
    resume ran with half the global batch, the epoch counter went back to half, and the weights differed by about
    one step."""
    straight, down, up = tmp_path / "straight", tmp_path / "down", tmp_path / "up"
    rc, log = launch(backend, straight, 2, ["--max_steps", "3"])
    assert rc == 0, log[-3000:]
    record = json.loads((straight / "checkpoint-1" / ck.MARKER).read_text())["run"]
    assert record["world_size"] == 2 and record["global_batch"] == 8 and record["samples_seen"] == 8, record
    rc, log = launch(backend, down, 1, ["--max_steps", "2", "--resume_from_checkpoint", str(straight / "checkpoint-1")])
    assert rc == 0, log[-3000:]
    assert "gradient_accumulation_steps 1 -> 2 to keep checkpoint-1's global batch" in log, log[-3000:]
    assert json.loads((down / "checkpoint-2" / ck.MARKER).read_text())["run"]["gradient_accumulation_steps"] == 2
    if "stream" not in backend:  # (a stream has no length: the trainer's epoch is the share of max_steps)
        assert epoch(down / "checkpoint-2") == epoch(straight / "checkpoint-2")
    assert max_diff(weights(down / "checkpoint-2"), weights(straight / "checkpoint-2")) <= 1e-6
    rc, log = launch(backend, up, 2, ["--max_steps", "3", "--resume_from_checkpoint", str(down / "checkpoint-2")])
    assert rc == 0, log[-3000:]
    # the recipe's own accumulation (1) keeps 8 on 2 processes: said, nothing changed
    assert ("resume: checkpoint-2 was saved by 1 process, this run has 2; same global batch (2 processes x 4 per device "
            "x 1 accumulation = 8), the data continues after sample 16") in log, log[-3000:]
    assert max_diff(weights(up), weights(straight)) <= 1e-6
    assert max_diff(weights(straight / "checkpoint-1"), weights(straight)) > 1e-4  # training moved the weights at all

    # what cannot continue is refused in one line, before anything loads (the checks read the marker only)
    args = types.SimpleNamespace(world_size=2, per_device_train_batch_size=3, gradient_accumulation_steps=1, process_index=0)
    with pytest.raises(RecipeError, match=r"global batch of 8 .* set per_device_train_batch_size to a divisor of 4"):
        ck.match_resume(str(down / "checkpoint-2"), load_recipe([RECIPES[backend], "--output_dir", str(tmp_path / "x")]), args)
    other = "ddp" if backend == "fsdp" else "fsdp"
    with pytest.raises(RecipeError, match=r"resume_from_checkpoint: checkpoint-2 was saved under .*, this run is .*; resume with launch.backend"):
        ck.match_resume(str(down / "checkpoint-2"), load_recipe([RECIPES[other], "--output_dir", str(tmp_path / "x")]),
                        types.SimpleNamespace(world_size=1, per_device_train_batch_size=4, gradient_accumulation_steps=2, process_index=0))


@pytest.mark.parametrize("saved,resumed", [(2, 1), (1, 2)])
def test_zero3_resume_on_another_process_count_is_refused_before_loading(twin_runs, tmp_path, saved, resumed):
    """DeepSpeed partitions the optimizer state per process: resuming on another count stops with one line naming both
    counts and the fix, before the tokenizer, data or model load, writing nothing. The 2-process checkpoint is the
    session's ZeRO-3 twin run's checkpoint-3 (conftest.twin_runs); the 1-process one is trained here (1 step)."""
    if saved == 2:
        ckpt = twin_runs("zero3")[0] / "checkpoint-3"
    else:
        rc, log = launch("zero3", tmp_path / "run", saved, ["--max_steps", "1"])
        assert rc == 0, log[-3000:]
        ckpt = tmp_path / "run" / "checkpoint-1"
    run = json.loads((ckpt / ck.MARKER).read_text())["run"]
    assert run["backend"] == "deepspeed" and run["world_size"] == saved, run
    out = tmp_path / "resumed"
    more = ["--max_steps", str(int(ckpt.name.rsplit("-", 1)[1]) + 1), "--resume_from_checkpoint", str(ckpt)]
    rc, log = launch("zero3", out, resumed, more)
    assert rc != 0
    errors = sorted({line for line in log.splitlines() if line.startswith("error: ")})
    assert errors == [
        f"error: resume_from_checkpoint: {ckpt.name} was saved by {saved} process{'es' * (saved > 1)} under DeepSpeed ZeRO-3, "
        f"whose optimizer state is partitioned per process, and this run has {resumed}: resume with {saved} "
        f"process{'es' * (saved > 1)} (launch.num_machines x launch.gpus_per_node = {saved}), or start a new run from its "
        f"weights (python -m sftrecipes export {ckpt} DEST writes them); DeepSpeed's universal "
        "checkpoints (ds_to_universal) are not wired into resume"], log[-3000:]
    assert "LoRA adapts" not in log and "chat template:" not in log  # neither the model nor the tokenizer was loaded
    assert not out.exists()
    # the launch verb (what scripts/run_*.sh run) says it once, exit 2, before starting any rank
    res = run_cli(["-m", "sftrecipes", "launch", RECIPES["zero3"], *STEPS, "--launch.gpus_per_node", str(resumed),
                   *more, "--output_dir", str(out)])
    assert res.returncode == 2 and res.stderr.strip().splitlines() == errors, res.stderr[-3000:]
    assert not out.exists()


# ----------------------------------------------------------------------------------- a full disk while saving

def test_disk_full_while_saving_names_the_file_the_cause_and_the_space(tiny_model, tmp_path, monkeypatch, capsys):
    """optimizer.pt of checkpoint-2 is written into /dev/full (every write fails with ENOSPC, as on a full disk).
    torch writing to a path said only "[enforce fail at inline_container.cc] unexpected pos" (or "basic_ios::clear:
    iostream error"); now one line names the file, "no space left on device", the free space and what the previous
    checkpoint took, and the run exits 1 with checkpoint-2 left unmarked, so auto resume takes checkpoint-1."""
    real_open = builtins.open

    def full_disk(file, mode="r", *a, **kw):
        if str(file).endswith("checkpoint-2/optimizer.pt") and "w" in mode:
            return real_open("/dev/full", mode, *a, **kw)
        return real_open(file, mode, *a, **kw)

    monkeypatch.setattr(saving, "open", full_disk, raising=False)  # the checkpoint writer's open: the real kernel error
    rc = train.main(["recipes/tiny/lora.yaml", "--output_dir", str(tmp_path), "--max_steps", "3", *STEPS])
    err = capsys.readouterr().err.strip().splitlines()  # progress bars, then the error
    errors = [line for line in err if "error" in line.lower()]
    assert rc == 1 and errors == err[-1:], err[-5:]
    line = err[-1][err[-1].index("error: "):]  # after the progress bar's carriage returns
    assert line.startswith(f"error: save: no space left on device writing {tmp_path}/checkpoint-2/optimizer.pt; "), line
    assert " free on the filesystem of " in line and "a checkpoint needs about " in line and "(checkpoint-1 took that)" in line, line
    assert "checkpoint-2 stays incomplete: resume skips it" in line, line
    assert ck.latest_checkpoint(tmp_path) == tmp_path / "checkpoint-1" and not (tmp_path / "checkpoint-2" / ck.MARKER).exists()


def test_torch_writer_error_is_read_as_a_full_disk(tmp_path):
    """Where torch itself writes to a path (its C++ writer, outside the checkpoint hook), the error it raises on a full
    disk is still recognised and explained."""
    with pytest.raises(RuntimeError) as e:
        torch.save({"w": torch.zeros(4096)}, "/dev/full")
    line = ck.write_failure(e.value, tmp_path / "checkpoint-3")
    assert line is not None and "the way torch reports a full disk" in line and "checkpoint-3 stays incomplete" in line, line
    assert ck.write_failure(ValueError("not a write"), tmp_path) is None


# ----------------------------------------------------------------------------------- the final save's check

SAVED = {"model.a.weight": torch.ones(4, 3), "model.b.weight": torch.ones(5)}


def saved_folder(tmp_path, fmt: str, fault: str | None):
    """A final save as `fmt` writes it (safetensors, sharded safetensors + index, or a DCP save), doctored by
    `fault`: a tensor left out, a tensor with 0 elements, no tensors at all, or (sharded) a shard the index lists
    removed. Returns (folder, expected names)."""
    import torch.distributed.checkpoint as dcp

    tensors = dict(SAVED)
    if fault == "missing":
        del tensors["model.b.weight"]
    elif fault == "empty":
        tensors["model.b.weight"] = torch.ones(0, 5)
    elif fault == "none":
        tensors = {}
    folder = tmp_path / fmt
    folder.mkdir()
    if fmt == "dcp":
        dcp.save(tensors, storage_writer=dcp.FileSystemWriter(str(folder)), no_dist=True)
    elif fmt == "sharded":
        index = {}
        for i, (k, v) in enumerate(tensors.items()):
            save_file({k: v}, folder / f"model-{i + 1:05d}-of-00002.safetensors")
            index[k] = f"model-{i + 1:05d}-of-00002.safetensors"
        (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}))
        if fault == "lost shard":
            (folder / "model-00002-of-00002.safetensors").unlink()
    else:
        save_file(tensors, folder / "model.safetensors")
    return folder, set(SAVED)


CHECK_FAULTS = [
    ("safetensors", "missing", r"1 of 2 expected tensors missing from \S+, e\.g\. \['model\.b\.weight'\]"),
    ("safetensors", "empty", r"1 empty tensors \(0 elements\) in \S+, e\.g\. \['model\.b\.weight'\]"),
    ("safetensors", "none", r"\S+ holds 0 tensors; the save lost the weights"),
    ("sharded", "missing", r"1 of 2 expected tensors missing"),
    ("sharded", "lost shard", r"shard model-00002-of-00002\.safetensors listed in the index is missing from \S+"),
    ("dcp", "missing", r"1 of 2 expected tensors missing from \S+, e\.g\. \['model\.b\.weight'\]"),
    ("dcp", "empty", r"1 empty tensors \(0 elements\) in \S+, e\.g\. \['model\.b\.weight'\]"),
]


@pytest.mark.parametrize("fmt,fault,says", CHECK_FAULTS, ids=[f"{f}-{x.replace(' ', '_')}" for f, x, _ in CHECK_FAULTS])
def test_final_save_check_fails_on_a_missing_or_empty_tensor(tmp_path, fmt, fault, says):
    """The check train.py runs on the final save (finalsave.save_checked -> check_saved; a DCP save for FSDP's
    SHARDED_STATE_DICT), on folders doctored the way a broken save leaves them: SaveFailed with one line naming the
    folder and the tensors. The undoctored folder of each format passes, so the fault is what fails it."""
    (tmp_path / "good").mkdir()
    good, expected = saved_folder(tmp_path / "good", fmt, None)
    assert finalsave.check_saved(good, expected) == 2
    bad, expected = saved_folder(tmp_path, fmt, fault)
    with pytest.raises(ck.SaveFailed, match="^save check: " + says) as e:
        finalsave.check_saved(bad, expected)
    assert "\n" not in str(e.value) and str(e.value).endswith("the final save is incomplete, so the run is not marked finished")


def test_failed_save_check_exits_1_with_one_line(tmp_path, monkeypatch, capsys):
    """What a user sees when the check fails: train.py's main prints the check's line as its only error and exits
    1 (the README's "failed"), not a traceback; no final.complete.json, so the run is not taken as finished. The
    run itself is replaced by the check on a doctored folder (no training: the check is all this is about)."""
    bad, expected = saved_folder(tmp_path, "safetensors", "empty")
    out = tmp_path / "run"
    monkeypatch.setattr(train, "run", lambda recipe, life: finalsave.check_saved(bad, expected))
    rc = train.main(["recipes/tiny/lora.yaml", "--output_dir", str(out)])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1 and len(err) == 1 and err[0].startswith(f"error: save check: 1 empty tensors (0 elements) in {bad}"), err
    assert not (out / ck.FINAL).exists()


@pytest.mark.real_ranks  # the hook is a sitecustomize: it runs when a rank's interpreter starts
@pytest.mark.parametrize("backend", ["ddp", "fsdp"])  # the safetensors check and the sharded (DCP) one
def test_failed_save_check_on_two_ranks_ends_every_rank_with_one_line(tiny_model, tmp_path, backend):
    """The check fails on rank 0 of a 2-rank run (a tensor name the save cannot hold is added to what it expects, by a
    sitecustomize in each rank): rank 0's line is said once and every rank exits 1 together. Rank 0 used to leave
    alone, and the other rank's next collective died with gloo's "Connection closed by peer" traceback (with NCCL it
    waits until the launcher kills it)."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(
        "import sys\n"
        "if sys.argv and sys.argv[0].endswith('train.py'):\n"
        f"    sys.path.insert(0, {str(ROOT)!r})\n"
        "    from sftrecipes.train import finalsave\n"
        "    expected = finalsave.expected_saved_names\n"
        "    finalsave.expected_saved_names = lambda *a, **k: expected(*a, **k) | {'never.saved.weight'}\n")
    out = tmp_path / "run"
    code, log = launch(backend, out, 2, ["--max_steps", "1"], env={"PYTHONPATH": os.pathsep.join(
        [str(hook), *filter(None, [os.environ.get("PYTHONPATH")])])})
    assert code != 0 and log.count("error: save check: ") == 1, log[-3000:]
    assert "expected tensors missing" in log and "never.saved.weight" in log
    assert log.count("Traceback (most recent call last)") == 1, log[-3000:]  # the launcher's report of the exits only
    assert "Connection closed by peer" not in log
    assert re.findall(r"^\s*exitcode\s*:\s*(-?\d+)", log, re.M) == ["1", "1"], log[-2000:]  # both ranks, not killed
    assert not (out / ck.FINAL).exists()


# ----------------------------------------------------------------------------------- a checkpoint that lies

@pytest.fixture(scope="module")
def two_checkpoints(tiny_model, tmp_path_factory):
    out = tmp_path_factory.mktemp("ckpts")
    train.run(load_recipe(["recipes/tiny/lora.yaml", "--output_dir", str(out), "--max_steps", "2", *STEPS]))
    return out


def test_marker_listing_an_empty_file_is_skipped_with_the_file_named(two_checkpoints, tmp_path, caplog):
    """An old marker recorded a zero-byte optimizer.pt as written; resuming then died in a bare EOFError naming no
    file. Now such a checkpoint is torn: auto falls back to checkpoint-1 with a warning naming the file, and the run
    continues from there; naming it explicitly is one line naming the file; and a save never marks an empty file."""
    out = tmp_path / "run"
    shutil.copytree(two_checkpoints, out)
    ckpt = out / "checkpoint-2"
    (ckpt / "optimizer.pt").write_bytes(b"")
    marker = json.loads((ckpt / ck.MARKER).read_text())
    marker["files"]["optimizer.pt"] = 0  # what the old marker recorded
    marker.pop("ends")
    (ckpt / ck.MARKER).write_text(json.dumps(marker))
    assert ck.torn(ckpt) == "optimizer.pt is empty (0 bytes): its write failed"
    with pytest.raises(RecipeError, match=r"resume_from_checkpoint: '.*checkpoint-2' is not a complete checkpoint \(optimizer.pt is empty"):
        ck.resolve_resume(str(ckpt), str(out))
    with caplog.at_level(logging.WARNING, logger="sftrecipes"):
        _, summary = train.run(load_recipe(["recipes/tiny/lora.yaml", "--output_dir", str(out), "--max_steps", "2", *STEPS,
                                            "--resume_from_checkpoint", "auto"]))
    assert f"resume: skipping {ckpt}: optimizer.pt is empty" in caplog.text
    assert summary["resumed_from"] == str(out / "checkpoint-1") and summary["steps"] == 2
    # the resumed run wrote checkpoint-2 anew: complete again, and its weights are the uninterrupted run's
    assert ck.torn(ckpt) is None
    assert max_diff(load_file(out / "adapter_model.safetensors"), load_file(two_checkpoints / "adapter_model.safetensors")) <= 1e-6
    # a save that left an empty file is not marked complete
    (ckpt / "scheduler.pt").write_bytes(b"")
    with pytest.raises(ck.SaveFailed, match=r"checkpoint-2/scheduler.pt is empty \(0 bytes\) after the save"):
        ck.write_marker(ckpt)


def test_marker_fingerprint_catches_a_file_changed_at_the_same_size(two_checkpoints, tmp_path):
    """Sizes alone missed a file rewritten at the same size (zero-filled blocks after a crash): the marker also keeps a
    hash of each file's first and last MiB."""
    ckpt = tmp_path / "checkpoint-2"
    shutil.copytree(two_checkpoints / "checkpoint-2", ckpt)
    f = ckpt / "adapter_model.safetensors"
    data = bytearray(f.read_bytes())
    data[-64:] = bytes(64)
    f.write_bytes(bytes(data))
    assert ck.torn(ckpt) == "adapter_model.safetensors changed since it was written (its first or last MiB differs)"


# ----------------------------------------------------------------------------------- model folders

def test_missing_tokenizer_and_truncated_weights_are_named(tiny_model, tmp_path):
    """A model folder without tokenizer files got "install sentencepiece"; a truncated model.safetensors got
    "incomplete metadata, file not fully covered" naming no file. Both are now one line naming the folder or file."""
    no_tok = tmp_path / "no-tokenizer"
    shutil.copytree(tiny_model, no_tok)
    (no_tok / "tokenizer.json").unlink()
    with pytest.raises(RecipeError, match=rf"model_name_or_path: {no_tok} has no tokenizer files \(none of tokenizer.json"):
        train.run(load_recipe(["recipes/tiny/lora.yaml", "--model_name_or_path", str(no_tok), "--output_dir", str(tmp_path / "a")]))
    cut = tmp_path / "cut"
    shutil.copytree(tiny_model, cut)
    size = (cut / "model.safetensors").stat().st_size
    with open(cut / "model.safetensors", "r+b") as f:
        f.truncate(size - 1000)
    with pytest.raises(RecipeError, match=rf"model_name_or_path: {cut}/model.safetensors is truncated: {size - 1000:,} bytes, its header says {size:,}"):
        train.run(load_recipe(["recipes/tiny/lora.yaml", "--model_name_or_path", str(cut), "--output_dir", str(tmp_path / "b")]))
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


# ----------------------------------------------------------------------------------- the NaN guard's advice

def _poison_loss_from(monkeypatch, first_bad_call: int):
    import trl

    compute = trl.SFTTrainer.compute_loss
    calls = {"n": 0}

    def poisoned(self, *a, **kw):
        calls["n"] += 1
        out = compute(self, *a, **kw)
        if calls["n"] < first_bad_call:
            return out
        return (out[0] * float("nan"), *out[1:]) if isinstance(out, tuple) else out * float("nan")

    monkeypatch.setattr(trl.SFTTrainer, "compute_loss", poisoned)


@pytest.mark.parametrize("fault", ["base_weights", "data_at_step_1", "after_updates"])
def test_nan_guard_tells_broken_weights_from_data_from_learning_rate(tiny_model, tmp_path, monkeypatch, fault):
    """The guard said "lower learning_rate or check the data" even when the base weights held a NaN. Now: a NaN in the
    weights before the first update is named (broken base weights); a non-finite step 1 with finite weights points at
    the data and dtype (no learning rate has acted yet); only after finite steps is the learning rate suspected."""
    model = tiny_model
    if fault == "base_weights":
        model = tmp_path / "model"
        shutil.copytree(tiny_model, model)
        sd = load_file(model / "model.safetensors")
        sd["model.layers.1.mlp.down_proj.weight"][3, 5] = float("nan")
        save_file(sd, str(model / "model.safetensors"), metadata={"format": "pt"})
    else:
        _poison_loss_from(monkeypatch, 1 if fault == "data_at_step_1" else 3)
    argv = ["recipes/tiny/lora.yaml", "--model_name_or_path", str(model), "--output_dir", str(tmp_path / "out"),
            "--max_steps", "4", *STEPS]
    with pytest.raises(ck.TrainingStopped) as e:
        train.run(load_recipe(argv))
    msg = str(e.value)
    assert "\n" not in msg
    if fault == "base_weights":
        assert "grad_norm is nan at step 1" in msg and "the weights held NaN/inf before the first update " \
            f"(model.layers.1.mlp.down_proj.weight): the base weights in {model} are broken" in msg, msg
    elif fault == "data_at_step_1":
        assert "at step 1" in msg and "before any update, with finite weights: the learning rate is not the cause; check the data" in msg, msg
    else:
        assert "at step 3" in msg and "checkpoint-2" in msg and msg.endswith("lower learning_rate or check the data, then resume_from_checkpoint: auto"), msg
    assert (fault == "after_updates") == ("learning_rate" in msg.split("; the last good checkpoint")[1])


def test_export_onto_a_full_disk_is_one_line_and_leaves_nothing(two_checkpoints, tmp_path, monkeypatch):
    """The streaming export writes into a temporary folder; a full disk there was a traceback ending in OSError.
    Now: one line (exit 2 from the CLI) with the cause, the space free and needed, and no folder left behind."""
    from sftrecipes import export as ex
    from sftrecipes.export import writer

    real_open = builtins.open

    def full_disk(file, mode="r", *a, **kw):
        if str(file).endswith(".safetensors") and "w" in mode:
            return real_open("/dev/full", mode, *a, **kw)
        return real_open(file, mode, *a, **kw)

    monkeypatch.setattr(writer, "open", full_disk, raising=False)
    with pytest.raises(RecipeError, match=r"^export: no space left on device writing .*/merged \([\d.,]+ [MG]B free there, the export needs about "
                                          r"[\d.]+ MB\); free space or give another destination \(nothing was left behind\)$"):
        ex.export(two_checkpoints, tmp_path / "merged")
    assert list(tmp_path.iterdir()) == []

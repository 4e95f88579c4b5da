"""A run's checkpoints, torch-free: which one to resume from and whether this run can continue it, the markers written
last that make a checkpoint (or a finished run) complete, rotation that never drops the last complete one, and a
failed write named (file, cause, space). A live trainer's saves go through train/saving.py, the final save's check is
train/finalsave.py, the non-finite guard train/nonfinite.py."""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import re
import shutil
import time
import types
from pathlib import Path

from sftrecipes.core.errors import RecipeError
from sftrecipes.recipe.evalonly import eval_only

log = logging.getLogger("sftrecipes")

MARKER = "checkpoint.complete.json"  # written last, after every rank finished writing the checkpoint
FINAL = "final.complete.json"  # in output_dir, written last by a run whose final save was checked: the run is finished


def write_marker(ckpt: Path, run: dict | None = None) -> None:
    """Record every file of a finished checkpoint with its size and a fingerprint of its ends (file_ends), and what
    resuming it needs (`run`: train/saving.py's run_record); written atomically, last. An empty file is a write that
    failed without an error (a full disk under some filesystems): the checkpoint is left unmarked and the save fails
    naming it."""
    files = {str(p.relative_to(ckpt)): p.stat().st_size for p in sorted(ckpt.rglob("*")) if p.is_file() and p.name != MARKER}
    empty = [rel for rel, size in files.items() if size == 0]
    if empty:
        raise SaveFailed(f"save: {ckpt / empty[0]} is empty (0 bytes) after the save, so {ckpt.name} is left incomplete "
                         f"(resume skips it); {_space(ckpt)}; free space or set output_dir to a larger disk, then resume_from_checkpoint: auto")
    record = {"step": int(ckpt.name.rsplit("-", 1)[-1]), "files": files, "ends": {rel: file_ends(ckpt / rel) for rel in files}}
    if run:
        record["run"] = run
    tmp = ckpt / (MARKER + ".tmp")
    tmp.write_text(json.dumps(record, indent=1))
    tmp.replace(ckpt / MARKER)


def file_ends(path: Path, span: int = 1 << 20) -> str:
    """sha256 of a file's size, first MiB and last MiB: catches a file rewritten, zero-filled or cut and padded at
    either end, for the price of reading 2 MiB (hashing a 140 GB checkpoint at every save would take minutes)."""
    h = hashlib.sha256()
    size = path.stat().st_size
    h.update(str(size).encode())
    with open(path, "rb") as f:
        h.update(f.read(span))
        if size > span:
            f.seek(max(span, size - span))
            h.update(f.read(span))
    return h.hexdigest()


def torn(ckpt: Path, name: str = MARKER) -> str | None:
    """Why a checkpoint (or, with name=FINAL, a finished run's output_dir) cannot be trusted (no marker; a file
    missing, of another size, empty, or changed at its ends), or None if complete."""
    ckpt = Path(ckpt)
    marker = ckpt / name
    if not marker.is_file():
        return f"no {name} (the save did not finish)"
    try:
        record = json.loads(marker.read_text())
        files = record["files"]
    except (json.JSONDecodeError, KeyError):
        return f"{name} is unreadable"
    ends = record.get("ends", {})
    for rel, size in files.items():
        f = ckpt / rel
        if not f.is_file():
            return f"{rel} is missing"
        if f.stat().st_size != size:
            return f"{rel} has {f.stat().st_size} bytes, {size} were written"
        if size == 0:
            return f"{rel} is empty (0 bytes): its write failed"
        if rel in ends and file_ends(f) != ends[rel]:
            return f"{rel} changed since it was written (its first or last MiB differs)"
    return None


def is_complete(ckpt: Path) -> bool:
    return torn(ckpt) is None


def checkpoints(output_dir: str | Path) -> list[tuple[int, Path]]:
    out = Path(output_dir)
    found = []
    if out.is_dir():
        for p in out.iterdir():
            m = re.fullmatch(r"checkpoint-(\d+)", p.name)
            if m and p.is_dir():
                found.append((int(m.group(1)), p))
    return sorted(found)


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    """The newest complete checkpoint; incomplete ones are skipped with a warning."""
    for _, p in reversed(checkpoints(output_dir)):
        why = torn(p)
        if why is None:
            return p
        log.warning("resume: skipping %s: %s", p, why)
    return None


def resolve_resume(value: str | None, output_dir: str) -> str | None:
    """`resume_from_checkpoint`: None, a folder, or 'auto' (the latest complete checkpoint, if any)."""
    if value is None:
        return None
    if value == "auto":
        ckpt = latest_checkpoint(output_dir)
        log.info("resume: %s", f"from {ckpt}" if ckpt else f"no complete checkpoint in {output_dir}, starting fresh")
        return str(ckpt) if ckpt else None
    why = torn(Path(value))
    if why is not None:
        raise RecipeError(f"resume_from_checkpoint: '{value}' is not a complete checkpoint ({why}); pick another or use auto")
    return value


def _final_files(out: Path) -> dict[str, int]:
    """What a finished run leaves in output_dir (final save, summary, metrics) with sizes: not the checkpoints, hidden
    files (lock, heartbeats), TensorBoard logs, nor what every launch rewrites."""
    skip = {FINAL, "accelerate_config.yaml", "runs"}
    files = {}
    for root, dirs, names in os.walk(out):
        rel_root = Path(root).relative_to(out)
        if rel_root == Path("."):
            dirs[:] = [d for d in dirs if not (d.startswith(".") or d in skip or re.fullmatch(r"checkpoint-\d+", d))]
            names = [n for n in names if not (n.startswith(".") or n in skip)]
        for n in names:
            files[str(rel_root / n)] = (Path(root) / n).stat().st_size
    return {rel: size for rel, size in sorted(files.items()) if size}  # (torn() takes an empty file for a failed write)


def mark_finished(output_dir: str | Path, step: int) -> None:
    """The run is finished: its final save was checked. Written atomically, last."""
    out = Path(output_dir)
    tmp = out / (FINAL + ".tmp")
    tmp.write_text(json.dumps({"step": step, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "files": _final_files(out)}, indent=1))
    tmp.replace(out / FINAL)


def forget_finished(output_dir: str | Path) -> None:
    """A run that trains in output_dir again changes what the marker lists: it no longer holds a finished run."""
    (Path(output_dir) / FINAL).unlink(missing_ok=True)


def finished_run(recipe) -> str | None:
    """resume_from_checkpoint: auto on an output_dir whose run finished (final save complete, every file it listed
    still of its size) has nothing to do (a SLURM requeue of a finished job): the line that says so, else None."""
    if recipe.trl.get("resume_from_checkpoint") != "auto" or eval_only(recipe):  # (evaluation only: it resumes nothing,
        return None  # so a finished training run in its output_dir neither stops it nor is marked again: evalonly.py)
    out = Path(recipe.trl.get("output_dir") or "trainer_output")
    if torn(out, FINAL) is not None:
        return None
    done = json.loads((out / FINAL).read_text())
    return (f"resume: {out} holds a finished run ({done['step']} steps, final save complete, {done['time']}); nothing to "
            "do — to train again, set another output_dir or --resume_from_checkpoint none")


# ------------------------------------------------------------------------------ resuming on another topology
# A checkpoint's marker records what the run that wrote it looked like (run_record, written by the live trainer's
# saves: train/saving.py). Resuming compares it with the run about to start (match_resume), before the tokenizer,
# data or model load. One optimizer step means one global batch (processes x batch per device x accumulation) and
# transformers finds the data position from the step count, so resuming keeps the checkpoint's global batch: on
# another process count, gradient accumulation absorbs the change where it divides, else the run stops. The files must
# also be readable at the new count: DDP and single process checkpoints hold whole states, FSDP2's DCP checkpoints
# reshard (tested exact); DeepSpeed's partitions do not, and FSDP1's are refused (not shown to resume exactly).

def _format(rec: dict) -> tuple[str, str]:
    """(checkpoint format in words, the launch keys that select it)."""
    if rec.get("backend") == "deepspeed":
        return f"DeepSpeed ZeRO-{rec.get('zero_stage')}", f"launch.backend deepspeed, launch.zero_stage {rec.get('zero_stage')}"
    if rec.get("backend") == "fsdp":
        return (f"FSDP{rec.get('fsdp_version')} {rec.get('fsdp_state_dict_type')}",
                f"launch.backend fsdp, launch.fsdp_version {rec.get('fsdp_version')}, launch.fsdp_state_dict_type {rec.get('fsdp_state_dict_type')}")
    return "DDP or a single process", "launch.backend ddp or none"


def _n(processes: int) -> str:
    return f"{processes} process{'es' if processes != 1 else ''}"


def _batch(world: int, per_device: int, accumulation: int, sp: int = 1) -> str:
    """A global batch in words; under sequence parallelism the data-parallel groups of sp processes are what count."""
    dp = world // sp
    who = _n(world) if sp == 1 else f"{dp} group{'s' if dp != 1 else ''} of {sp} processes (sequence parallel)"
    return f"{who} x {per_device} per device x {accumulation} accumulation = {dp * per_device * accumulation}"


def match_resume(ckpt: str | None, recipe, args) -> None:
    """Before anything loads: check that this run can continue `ckpt` exactly, from the run record in its marker.
    Another format (backend, ZeRO stage, FSDP version or state-dict type) is a RecipeError; so is another process
    count under DeepSpeed (its partitions do not reshard). Otherwise the checkpoint's global batch is kept: if this
    run's differs, `args.gradient_accumulation_steps` is set to restore it (logged) where it divides, else a
    RecipeError says what to set."""
    if ckpt is None:
        return
    path, key = Path(ckpt), "resume_from_checkpoint"
    try:
        saved = json.loads((path / MARKER).read_text()).get("run")
    except (OSError, json.JSONDecodeError):
        saved = None
    main = args.process_index == 0
    if not saved:
        if main:
            log.warning("resume: %s has no run record in its %s (an older version wrote it): its process count and batch "
                        "are not checked", path, MARKER)
        return
    L, world = recipe.launch, args.world_size
    mine = {"backend": L.backend if L.backend in ("deepspeed", "fsdp") else "ddp", "zero_stage": L.zero_stage,
            "fsdp_version": L.fsdp_version, "fsdp_state_dict_type": L.fsdp_state_dict_type}
    (was, was_keys), (now, _) = _format(saved), _format(mine)
    if was != now:
        raise RecipeError(f"{key}: {path.name} was saved under {was}, this run is {now}; resume with {was_keys} (or start a "
                          f"new run from its weights: python -m sftrecipes export {path} DEST, then model_name_or_path: DEST)")
    sw, spd, sga, g = (saved[k] for k in ("world_size", "per_device_train_batch_size", "gradient_accumulation_steps", "global_batch"))
    if sw != world and saved["backend"] == "deepspeed":
        raise RecipeError(f"{key}: {path.name} was saved by {_n(sw)} under {was}, whose optimizer state is partitioned per "
                          f"process, and this run has {world}: resume with {_n(sw)} (launch.num_machines x launch.gpus_per_node "
                          f"= {sw}), or start a new run from its weights (python -m sftrecipes export {path} DEST writes them); "
                          "DeepSpeed's universal checkpoints (ds_to_universal) are not wired into resume")
    if sw != world and saved["backend"] == "fsdp" and saved.get("fsdp_version") != 2:
        raise RecipeError(f"{key}: {path.name} was saved by {_n(sw)} under {was} and this run has {world}: resume with {_n(sw)} "
                          f"(launch.num_machines x launch.gpus_per_node = {sw}); only FSDP2 checkpoints are known to reshard exactly")
    pd, ga = args.per_device_train_batch_size, args.gradient_accumulation_steps
    sp, ssp = L.sequence_parallel_size, saved.get("sequence_parallel_size", 1)
    dp = world // sp  # data-parallel ranks: a sequence-parallel group of sp processes trains one batch at a time
    position = f"the data continues after sample {saved.get('samples_seen', '?')}"
    if dp * pd * ga == g:
        if (sw, ssp) != (world, sp) and main:
            log.info("resume: %s was saved by %s%s, this run has %d%s; same global batch (%s), %s", path.name, _n(sw),
                     f" in groups of {ssp}" if ssp > 1 else "", world, f" in groups of {sp}" if sp > 1 else "",
                     _batch(world, pd, ga, sp), position)
        return
    if g % (dp * pd) == 0:
        args.gradient_accumulation_steps = g // (dp * pd)
        if main:
            log.warning("resume: gradient_accumulation_steps %d -> %d to keep %s's global batch (%s) on %s; %s", ga,
                        args.gradient_accumulation_steps, path.name, _batch(sw, spd, sga, ssp),
                        _batch(world, pd, args.gradient_accumulation_steps, sp), position)
        return
    fix = (f"set per_device_train_batch_size to a divisor of {g // dp} ({g} over {dp} data-parallel ranks)" if g % dp == 0
           else f"use a process count that divides {g}")
    raise RecipeError(f"{key}: {path.name} trained with a global batch of {g} ({_batch(sw, spd, sga, ssp)}); "
                      f"{_batch(world, pd, 1, sp).split(' x ')[0]} x {pd} per device cannot make {g} by accumulation, "
                      f"and another global batch would change what a step is and misplace the data position: {fix}, or "
                      f"resume with {_n(sw)}{f' in groups of {ssp}' if ssp > 1 else ''}")


def check_resume(recipe) -> None:
    """The launcher's look before any rank starts (torch-free): the checkpoint this run would resume, checked as
    match_resume checks it at the process count the recipe launches, so a run that cannot continue it stops with one
    line and exit 2 from the launcher, not in every rank behind a launcher traceback. The ranks check again (and
    adjust gradient accumulation) themselves."""
    if eval_only(recipe):  # nothing is resumed (evalonly.check refused a checkpoint folder)
        return
    ckpt = resolve_resume(recipe.trl.get("resume_from_checkpoint"), recipe.trl["output_dir"])
    world = recipe.launch.world_size
    match_resume(ckpt, recipe, types.SimpleNamespace(  # process_index 1: quiet, rank 0 logs what it adjusts
        world_size=world, process_index=1, per_device_train_batch_size=recipe.trl_value("per_device_train_batch_size"),
        gradient_accumulation_steps=recipe.trl_value("gradient_accumulation_steps")))


def rotate(output_dir: Path, limit: int | None, keep: Path | None = None) -> list[Path]:
    """save_total_limit, safely: delete complete checkpoints beyond the newest `limit` complete ones, never the
    newest complete one, never an incomplete one (it is evidence), never `keep` (the best model)."""
    if not limit:
        return []
    complete = [p for _, p in checkpoints(output_dir) if is_complete(p)]
    doomed = [p for p in complete[: -max(limit, 1)] if keep is None or p.resolve() != Path(keep).resolve()]
    for p in doomed:
        shutil.rmtree(p, ignore_errors=True)
    return doomed


# ------------------------------------------------------------------------------------------ failed writes

def write_failure(e: BaseException, folder: Path) -> str | None:
    """One line for an exception raised while saving into `folder`, or None when it is not a failed write."""
    chain: list[BaseException] = []
    while e is not None and e not in chain:
        chain.append(e)
        e = e.__cause__ or e.__context__
    if isinstance(chain[0], TrainingStopped):  # already one line
        return None
    oserr = next((x for x in chain if isinstance(x, OSError) and x.errno), None)
    text = " ".join(str(x) for x in chain)
    where = (oserr.filename if oserr is not None and oserr.filename else None) or folder
    after = f"{_space(folder)}; free space or set output_dir to a larger disk, then resume_from_checkpoint: auto{_left_incomplete(folder)}"
    if (oserr is not None and oserr.errno in (errno.ENOSPC, errno.EDQUOT)) or re.search(r"No space left on device|StorageFull|os error 28", text):
        cause = "disk quota exceeded" if oserr is not None and oserr.errno == errno.EDQUOT else "no space left on device"
        return f"save: {cause} writing {where}; {after}"
    if oserr is not None:
        return f"save: cannot write {where}: {oserr.strerror}; {after}"
    torch_io = next((x for x in chain if re.search(r"iostream error|unexpected pos|file write failed|PytorchStreamWriter failed", str(x))), None)
    if torch_io is not None:
        return f"save: writing into {folder} failed ({str(torch_io).splitlines()[0][:120]}: the way torch reports a full disk); {after}"
    return None


def _mb(n: int) -> str:
    return f"{n / 1e6:,.1f} MB" if n < 1e9 else f"{n / 1e9:,.2f} GB"


def _space(folder: Path) -> str:
    """Free space on the folder's filesystem, and the size of the run's previous complete checkpoint (about what the
    next one needs) when there is one."""
    run_dir = folder.parent if re.fullmatch(r"checkpoint-\d+", folder.name) else folder
    probe = run_dir
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    text = f"{_mb(shutil.disk_usage(probe).free)} free on the filesystem of {probe}"
    for _, p in reversed(checkpoints(run_dir)):
        if p != folder and (p / MARKER).is_file():
            try:
                size = sum(json.loads((p / MARKER).read_text())["files"].values())
            except (OSError, ValueError, KeyError):
                continue
            return f"{text}, a checkpoint needs about {_mb(size)} ({p.name} took that)"
    return text


def _left_incomplete(folder: Path) -> str:
    return f" ({folder.name} stays incomplete: resume skips it)" if re.fullmatch(r"checkpoint-\d+", folder.name) else ""


class TrainingStopped(RuntimeError):
    """The run stopped itself (non-finite loss or gradient norm); its message is one line. `every_rank`: raised on
    every rank of the process group together (a collective verdict), so they can leave the group in step and only rank
    0 need say why; otherwise a rank raises it alone."""

    def __init__(self, message: str, every_rank: bool = False):
        super().__init__(message)
        self.every_rank = every_rank


class SaveFailed(TrainingStopped):
    """A save could not be written (a full disk; the message names the file, the cause and the space) or the final
    save was checked and found incomplete (check_saved)."""

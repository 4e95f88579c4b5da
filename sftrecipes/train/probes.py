"""Probes of what really ran, read from the live trainer: the backend (wrapper, ZeRO stage, how many parameter and
optimizer elements this rank holds), each rank's memory in each phase (loading, wrapping, the first steps), and a sample reply of the trained
model."""

from __future__ import annotations

import contextlib
import resource

import psutil
import torch
from accelerate.utils import gather_object
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from transformers import TrainerCallback

from sftrecipes.core import pages
from sftrecipes.model import heap


def _elements(module) -> tuple[int, int, int]:
    """(parameter elements this rank stores, elements of the whole model, elements of its trainable parameters)
    for plain, DTensor (FSDP2), ZeRO-3 partitioned and FSDP1 flat-sharded parameters."""
    flat = {}
    for m in module.modules():  # FSDP1: the FlatParameters know their unsharded size
        handle = getattr(m, "_handle", None)
        fp = getattr(handle, "flat_param", None)
        if fp is not None:
            flat[id(fp)] = fp
    if flat:
        local = sum(fp.numel() for fp in flat.values())
        full = sum(fp._unpadded_unsharded_size.numel() for fp in flat.values())
        trainable = sum(fp._unpadded_unsharded_size.numel() for fp in flat.values() if fp.requires_grad)
        return local, full, trainable
    local = full = trainable = 0
    for p in module.parameters():
        if hasattr(p, "ds_tensor"):  # DeepSpeed ZeRO-3 partition
            a, b = p.ds_tensor.numel(), p.ds_numel
        elif hasattr(p, "to_local"):  # DTensor shard (FSDP2)
            a, b = p.to_local().numel(), p.numel()
        else:
            a = b = p.numel()
        local, full = local + a, full + b
        trainable += b if p.requires_grad else 0
    return local, full, trainable


def fp32_partitions(optimizer) -> list:
    """This rank's fp32 master partitions of a live DeepSpeed ZeRO optimizer (flat tensors, one per param group):
    `single_partition_of_fp32_groups` under ZeRO-1/2, `fp32_partitioned_groups_flat` under ZeRO-3; [] for others.
    (A saved checkpoint keys them differently; export.readers._ZeroSource reads those.)"""
    return (getattr(optimizer, "single_partition_of_fp32_groups", None)
            or getattr(optimizer, "fp32_partitioned_groups_flat", None) or [])


def describe_backend(trainer) -> dict:
    """What really ran, read from the live objects: distribution type, wrapper, ZeRO stage, and how many parameter
    and optimizer-state elements this rank holds versus the whole model (the evidence that sharding took effect)."""
    acc = trainer.accelerator
    wrapped = trainer.model_wrapped
    local, full, trainable = _elements(wrapped)
    info = {
        "distributed_type": acc.state.distributed_type.value,
        "world_size": acc.num_processes,
        "wrapper": type(wrapped).__name__,
        "param_elements_local": local,
        "param_elements_full": full,
        "trainable_elements_full": trainable,
        "param_dtypes": sorted({str(p.dtype).removeprefix("torch.") for p in wrapped.parameters()}),
    }
    engine = getattr(trainer, "deepspeed", None)
    if engine is not None:
        info["zero_stage"] = engine.zero_optimization_stage()
        info["sequence_parallel_size"] = int(getattr(engine, "sequence_parallel_size", 1))  # DeepSpeed's own SP groups
        for key, cfg in (("zero_offload_optimizer", engine.zero_offload_optimizer()), ("zero_offload_params", engine.zero_offload_param())):
            info[key] = str(getattr(cfg, "device", "none") or "none").split(".")[-1]
        opt = engine.optimizer
        info["optimizer_fp32_elements_local"] = int(sum(g.numel() for g in fp32_partitions(opt)))
        info["optimizer"] = type(getattr(opt, "optimizer", opt)).__name__
        info["zero_buckets"] = {"reduce_bucket_size": engine.zero_reduce_bucket_size(),
                                "prefetch_bucket_size": engine.zero_prefetch_bucket_size(),
                                "param_persistence_threshold": engine.zero_param_persistence_threshold(),
                                "max_live_parameters": engine.zero_max_live_parameters()}
    plugin = getattr(acc.state, "fsdp_plugin", None)
    if plugin is not None:
        info["fsdp_version"] = plugin.fsdp_version
        info["fsdp_units"] = fsdp_units(wrapped)
    return info


def fsdp_units(module) -> dict[str, int]:
    """The module classes FSDP sharded as units (the root included), with how many of each: FSDP2's fully_shard
    makes a module an FSDPModule (class FSDP<name>); FSDP1 wraps it in FullyShardedDataParallel."""
    units: dict[str, int] = {}
    for m in module.modules():
        if isinstance(m, FSDP):
            inner = getattr(m.module, "_checkpoint_wrapped_module", m.module)
            name = type(inner).__name__
        elif isinstance(m, FSDPModule):
            name = next(c.__name__ for c in type(m).__mro__[1:] if not issubclass(c, FSDPModule))
        else:
            continue
        units[name] = units.get(name, 0) + 1
    return dict(sorted(units.items()))


def sample_reply(trainer, tokenizer, prompt, max_new_tokens: int, processor=None, images=None) -> dict:
    """Greedy reply of the trained model to `prompt` (messages or text), stopping where the saved generation config
    says (end of turn, eos); with a vision run's processor, `prompt`'s image parts stand for `images` (opened PIL
    images). Returns {"reply": text without special tokens, "stopped_on": the stop token it ended with
    or None when it ran to max_new_tokens, "new_tokens": n}. Called on every rank: under ZeRO-3 and FSDP each forward
    gathers parameters from all ranks, so all must generate together (synced_gpus)."""
    acc = trainer.accelerator
    model = acc.unwrap_model(trainer.model)
    if processor is not None:
        enc = dict(processor(text=[processor.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)],
                             images=[images] if images else None, return_tensors="pt", add_special_tokens=False))
    elif isinstance(prompt, list):
        enc = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    else:
        enc = tokenizer(prompt, return_tensors="pt")
    enc = {k: v.to(acc.device) for k, v in enc.items()}
    kwargs = dict(max_new_tokens=max_new_tokens, do_sample=False, use_cache=True, pad_token_id=tokenizer.pad_token_id,
                  synced_gpus=acc.num_processes > 1)
    gen = getattr(model, "generation_config", None)
    if gen is not None and getattr(gen, "stop_strings", None):
        kwargs["tokenizer"] = tokenizer
    was_training = model.training
    model.eval()
    plugin = getattr(acc.state, "fsdp_plugin", None)
    # ORPOTrainer and CPOTrainer cast a 4-bit model's LoRA layers, lm_head and embeddings to bf16 under bf16 (their
    # flag): the norms stay fp32, so outside the training autocast their products mix dtypes; they generate under it
    mixed = (torch.autocast(acc.device.type, dtype=torch.bfloat16) if getattr(trainer, "_peft_has_been_casted_to_bf16", False)
             else contextlib.nullcontext())
    with torch.no_grad(), mixed:
        if plugin is not None and plugin.fsdp_version == 1:  # FSDP1's flat shards must be gathered around generate
            with FSDP.summon_full_params(trainer.model_wrapped, writeback=False, recurse=True):
                out = model.generate(**enc, **kwargs)
        else:
            out = model.generate(**enc, **kwargs)
    model.train(was_training)
    new = out[0, enc["input_ids"].shape[1]:].tolist()
    eos = gen.eos_token_id if gen is not None else tokenizer.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    stop = new[-1] if new and new[-1] in eos else None
    return {"reply": tokenizer.decode(new, skip_special_tokens=True), "new_tokens": len(new),
            "stopped_on": tokenizer.convert_ids_to_tokens(stop) if stop is not None else None}


PHASES = ("loading", "wrapping", "first_steps", "later_steps")
FIRST_STEPS = 2  # optimizer steps in the "first_steps" phase: the first creates the optimizer states, the second runs as all later ones


def _status() -> dict[str, float]:
    """The memory fields of /proc/self/status (VmHWM, RssFile, ...) in MB, read at once; empty where there is no procfs."""
    try:
        with open("/proc/self/status") as f:
            return {k: int(v.split()[0]) * 1024 / 1e6 for k, v in (ln.split(":", 1) for ln in f if ":" in ln) if v.strip().endswith("kB")}
    except OSError:
        return {}


def _reset_peak() -> bool:
    """Reset the kernel's high-water mark of this process's resident memory to its current RSS (Linux >= 4.0:
    /proc/self/clear_refs '5'), so that VmHWM read later is the peak since now. False where it cannot."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _mapped_mb(status: dict[str, float]) -> float | None:
    """Of this process's RSS, the pages of mapped files and shared memory (RssFile + RssShmem), MB; None without them."""
    return status["RssFile"] + status["RssShmem"] if "RssFile" in status and "RssShmem" in status else None


def file_pages_mb() -> tuple[float, float] | None:
    """Of this process's RSS, the pages that are still a mapped file's (a mapping's Rss less its Anonymous: a page
    written is this process's own copy), split into (libraries and other files, checkpoints: *.safetensors), MB; None
    where /proc/self/smaps cannot be read. Shared memory (/dev/shm, memfd, SysV) is neither. How many pages of a file
    a touch maps is the filesystem's: 64 KiB around the touched page where the page cache holds 4 KiB pages (the
    kernel's fault-around), the whole folio, up to 2 MiB, where it holds large ones (Linux 6.18; measured: 141 MB of a
    rank's libraries before loading on ext4 here, 267 MB from a tmpfs with huge=always, the same anonymous 387 MB)."""
    libraries = checkpoints = 0
    seen = False
    for _start, _end, _perms, path, f in pages.smaps():
        seen = True
        if not path.startswith("/") or path.startswith(("/dev/shm/", "/memfd:", "/SYSV")):
            continue
        own = f.get("Rss", 0) - f.get("Anonymous", 0)
        if path.removesuffix(" (deleted)").endswith(".safetensors"):
            checkpoints += own
        else:
            libraries += own
    return (libraries * 1024 / 1e6, checkpoints * 1024 / 1e6) if seen else None


def growth_mb(m: dict, phase: str, key: str = "peak_mb") -> float:
    """A rank's RSS growth in a phase (of PhaseMemory.gather's record m; key: the phase's peak_mb or end_mb) over its
    RSS before loading, less the libraries' file pages the run mapped since (at the phase's end: they are only ever
    added, so those at its peak are no more): the figure the planner plans on the cpu target, the same whatever
    page-cache folios the filesystem gives the libraries (file_pages_mb). Records without the split: the growth."""
    grew = m[phase][key] - m["baseline_mb"]
    if "end_library_mb" in m[phase] and "baseline_library_mb" in m:
        grew -= m[phase]["end_library_mb"] - m["baseline_library_mb"]
    return grew


def rss_mb() -> float:
    """This process's resident memory now, in MB."""
    return psutil.Process().memory_info().rss / 1e6


class PhaseMemory(TrainerCallback):
    """Each phase's peak resident memory on this rank, from the kernel's high-water mark reset at the phase's start:
    an earlier peak of the process (data preparation, tokenization) never counts in a later phase. Phases, contiguous:
    loading (from_pretrained and what load_model adds), wrapping (the trainer's construction — peft's wrapping — and
    train() up to its first callback: accelerate's prepare, FSDP sharding, ZeRO partitioning, rank-0 broadcast, a
    resume's checkpoint read), first_steps (the first FIRST_STEPS optimizer steps: optimizer states, activations,
    gathers) and later_steps (to the end of training). `baseline_mb` is the RSS just before loading: python, torch,
    the tokenized data. From loading to the end of the first steps glibc's mmap threshold is held fixed
    (heap.hold_steady), so that these phases measure what they hold and not the freed heap glibc keeps; the later steps
    run with glibc's own adaptation, their peak that heap included. A callback so the trainer's events close the
    training phases."""

    def __init__(self):
        self.baseline_mb = self.baseline_mapped_mb = self.baseline_files = None
        self.phases: dict[str, dict] = {}
        self.exact = True  # False where the high-water mark could not be reset (then peaks are lifetime peaks)
        self._open = None
        self._from_step = 0

    def start(self, name: str) -> None:
        self.close()
        if name == "loading":
            heap.hold_steady()  # to the end of the first steps: each phase's RSS is what it uses (heap.hold_steady)
        elif name == "later_steps":
            heap.release()
        if self.baseline_mb is None:
            self.baseline_mb, self.baseline_mapped_mb, self.baseline_files = rss_mb(), _mapped_mb(_status()), file_pages_mb()
        self.exact = _reset_peak() and self.exact
        self._open = (name, rss_mb())

    def close(self) -> None:
        if self._open is None:
            return
        name, start = self._open
        self._open = None
        now, status = rss_mb(), _status()
        hwm = status.get("VmHWM")
        if hwm is None or not self.exact:
            hwm = max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e6, now)  # KiB: the lifetime peak
        peak = max(hwm, start, now)
        self.phases[name] = {"start_mb": round(start, 1), "peak_mb": round(peak, 1), "end_mb": round(now, 1),
                             "grew_mb": round(max(peak - self.baseline_mb, 0.0), 1)}
        mapped, files = _mapped_mb(status), file_pages_mb()
        if mapped is not None:  # of end_mb, the pages of mapped files (a memory-mapped checkpoint, libraries) and shm
            self.phases[name]["end_mapped_mb"] = round(mapped, 1)
        if files is not None:  # of those, the libraries' and the checkpoint's (file_pages_mb)
            self.phases[name]["end_library_mb"], self.phases[name]["end_checkpoint_mb"] = (round(x, 1) for x in files)

    def on_train_begin(self, args, state, control, **kwargs):
        if self._open and self._open[0] == "wrapping":
            self._from_step = state.global_step  # a resumed run counts its first steps from where it resumed
            self.start("first_steps")

    def on_step_end(self, args, state, control, **kwargs):
        if self._open and self._open[0] == "first_steps" and state.global_step - self._from_step >= FIRST_STEPS:
            self.start("later_steps")

    def on_train_end(self, args, state, control, **kwargs):
        self.close()
        heap.release()  # a run shorter than its first steps

    def gather(self, acc) -> list[dict]:
        """Every rank's phases (all ranks call: a collective), by rank. `grew_mb` of a phase is its peak less the
        baseline; `load_grew_mb` the larger of loading's and wrapping's: what holding the model cost this rank."""
        self.close()
        grew = [self.phases[k]["grew_mb"] for k in ("loading", "wrapping") if k in self.phases]
        mine = {"rank": acc.process_index, "baseline_mb": round(self.baseline_mb or 0.0, 1), "exact": self.exact,
                **({"baseline_mapped_mb": round(self.baseline_mapped_mb, 1)} if self.baseline_mapped_mb is not None else {}),
                **({"baseline_library_mb": round(self.baseline_files[0], 1)} if self.baseline_files is not None else {}),
                "load_grew_mb": max(grew, default=0.0), **{k: self.phases[k] for k in PHASES if k in self.phases}}
        return sorted(gather_object([mine]) if acc.num_processes > 1 else [mine], key=lambda d: d["rank"])

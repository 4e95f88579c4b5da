"""sftrecipes.train.metrics: FLOP arithmetic by hand, token counting against the batches really fed, TensorBoard events,
the plot and the per-rank table, single process and 2-process DDP on CPU."""

import json
import os
import struct

import pytest
import torch

import train
from conftest import FAMILIES, ROOT
from sftrecipes.train import flops
from sftrecipes.train import metrics
from sftrecipes.recipe.load import load_recipe
from sftrecipes.facts.config import model_shape

# the tiny Llama's shape (.assets/tiny-llama/config.json), written out so the hand computations below are checkable
TINY = model_shape({"model_type": "llama", "hidden_size": 64, "intermediate_size": 192, "num_hidden_layers": 2,
                    "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512, "tie_word_embeddings": False,
                    "max_position_embeddings": 1024}, name="tiny")


# ----------------------------------------------------------------------------------------------- arithmetic


def test_flops_per_token_by_hand():
    # per layer: q 64x64 + k,v 64x32 each + o 64x64 + gate,up 64x192 each + down 192x64 = 49152; N = 2 layers + head
    n = 2 * 49152 + 512 * 64
    assert flops.matmul_params(TINY) == n == 131072
    attn_causal = 12 * 2 * 64 * 129 / 2  # 12·L·d per pair, 128·129/2 pairs over 128 tokens
    assert flops.flops_per_token(TINY, 128) == 6 * n + attn_causal == 885504
    assert flops.flops_per_token(TINY, 128, causal=False) == 6 * n + 12 * 2 * 64 * 128 == 983040  # PaLM's 12·L·H·Q·T
    a = TINY.lora_params("all-linear", 8)
    assert a == 16 * (128 + 2 * 96 + 128 + 2 * 256 + 256) == 19456
    assert flops.flops_per_token(TINY, 128, trainable=0, adapter=a) == 4 * n + 6 * a + attn_causal == 740096
    # gradient checkpointing: a second forward of the decoder layers (linears + adapters + attention), HFU only
    hfu = flops.flops_per_token(TINY, 128, trainable=0, adapter=a, recompute=True)
    assert hfu == 740096 + 2 * 98304 + 2 * a + 4 * 2 * 64 * 129 / 2
    assert flops.mfu(1e6, 885504, 312) == pytest.approx(885504e6 / 312e12)


def test_step_flops_counts_packed_samples_apart():
    # a packed row of samples 3 and 5 long: 3·4/2 + 5·6/2 = 21 attention pairs, not the 36 of one 8-token sample
    packed = {"input_ids": torch.tensor([[7, 8, 9, 7, 8, 9, 10, 11]]), "position_ids": torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]])}
    assert flops.batch_counts(packed, pad_token_id=3) == (8, 8, 21)
    assert flops.step_flops(TINY, 8, 21) == 8 * 6 * 131072 + 12 * 2 * 64 * 21


def test_batch_counts_padding_and_padding_free():
    padded = {"input_ids": torch.tensor([[5, 6, 7, 3, 3], [5, 6, 7, 8, 9]]),
              "attention_mask": torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])}
    assert flops.batch_counts(padded, pad_token_id=3) == (8, 10, 6 + 15)
    # padding-free + pad_to_multiple_of: trailing pad slots have position 0 and are not tokens (nor samples)
    free = {"input_ids": torch.tensor([[5, 6, 5, 6, 7, 3, 3, 3]]), "position_ids": torch.tensor([[0, 1, 0, 1, 2, 0, 0, 0]])}
    assert flops.batch_counts(free, pad_token_id=3) == (5, 8, 3 + 6)
    # a pad id inside a sample (pad == eos setups) is a real token
    inner = {"input_ids": torch.tensor([[5, 3, 6]]), "position_ids": torch.tensor([[0, 1, 2]])}
    assert flops.batch_counts(inner, pad_token_id=3) == (3, 3, 6)


@pytest.mark.parametrize("name, peak", [("NVIDIA H100 80GB HBM3", 989), ("NVIDIA H100 PCIe", 756), ("NVIDIA H200", 989),
                                        ("NVIDIA A100-SXM4-80GB", 312), ("NVIDIA A10G", 125), ("NVIDIA L4", 121),
                                        ("NVIDIA L40S", 362), ("Some Future Chip", None)])
def test_device_peak_by_name(name, peak):
    assert flops.device_peak_tflops(name) == peak


@pytest.mark.parametrize("family", FAMILIES)
def test_live_config_gives_the_planners_shape(family_models, family):
    """The callback reads the live model's config object; the planner reads config.json: one shape either way."""
    import dataclasses

    from transformers import AutoModelForCausalLM

    folder = family_models[family]
    model = AutoModelForCausalLM.from_pretrained(folder)
    got, want = flops.model_shape_of(model), model_shape(str(folder))
    assert dataclasses.replace(got, name="") == dataclasses.replace(want, name="")
    assert got.params == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_moe_flops_count_the_routed_experts_only(family_models, family):
    """MFU of a mixture of experts: N, T and A hold what a token runs through: the router and k of E experts (and k/E
    of the adapters on fused expert tensors), counted here from the live model's own tensors."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(family_models[family])
    k, E = model.config.num_experts_per_tok, model.config.num_experts
    active = total = 0
    for name, p in model.named_parameters():
        if p.ndim >= 2 and "embed_tokens" not in name:  # matmul weights (the embedding is a lookup)
            total += p.numel()
            active += p.numel() * k // E if ".experts." in name else p.numel()
    if model.config.tie_word_embeddings:
        active, total = active + model.lm_head.weight.numel(), total + model.lm_head.weight.numel()
    cb = metrics.ThroughputCallback()
    cb.on_init_end(None, None, None, model=model)
    assert flops.matmul_params(cb.shape) == active < total
    assert cb._split == (active, 0)  # a full fine-tune trains all of them, per token the routed experts
    assert flops.step_flops(cb.shape, 1, 0, trainable=cb._split[0]) == 6 * active

    peft = get_peft_model(model, LoraConfig(r=4, target_modules="all-linear", task_type="CAUSAL_LM"))
    adapters = sum(p.numel() * (k / E if ".experts." in n else 1) for n, p in peft.named_parameters() if "lora_" in n)
    cb = metrics.ThroughputCallback()
    cb.on_init_end(None, None, None, model=peft)
    assert cb._split == (0, round(adapters)) and round(adapters) < peft.get_nb_trainable_parameters()[0]


def test_phase_memory_peaks_are_each_phases_own(tmp_path):
    """A phase's peak is its own: the high-water mark is reset at each phase's start, so an earlier, larger peak
    (here 300 MB, freed before the next phase) does not count in a later phase that holds 60 MB. The pages of a
    memory-mapped file (a checkpoint loaded in its own dtype) are told apart from the rest: end_mapped_mb. In a fresh
    interpreter, as a rank measures at its start: in this long-lived pytest process earlier tests leave free heap
    chunks that the 60 MB block is cut from, already resident, so the wrapping phase grew by 80 MB, not 100 (CI failed
    on that)."""
    import subprocess
    import sys

    code = """if True:
        import json, mmap, sys
        from types import SimpleNamespace
        import torch
        from sftrecipes.train.probes import PhaseMemory

        mem, state = PhaseMemory(), SimpleNamespace(global_step=0)
        mem.start("loading")
        block = torch.ones(300_000_000 // 4)  # 300 MB, touched
        del block
        mem.start("wrapping")
        held = torch.ones(60_000_000 // 4)
        with open(sys.argv[1], "wb") as f:
            f.write(b"\\1" * 40_000_000)
        with open(sys.argv[1], "rb") as f:
            mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        touched = sum(mapped[i] for i in range(0, len(mapped), 4096))  # every page
        mem.on_train_begin(None, state, None)  # the trainer's first callback: wrapping ends, the first steps begin
        for step in (1, 2, 3):
            state.global_step = step
            mem.on_step_end(None, state, None)
        mem.on_train_end(None, state, None)
        rows = mem.gather(SimpleNamespace(process_index=0, num_processes=1))
        print(json.dumps([touched, len(range(0, len(mapped), 4096)), rows[0]]))
    """
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_MMAP_THRESHOLD_"}
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "weights.bin")], cwd=ROOT, env=env,
                         capture_output=True, text=True, check=True)
    touched, pages, p = json.loads(out.stdout.splitlines()[-1])
    assert touched == pages  # every page of the mapped file was read
    assert p["exact"], "the kernel's high-water mark could not be reset (/proc/self/clear_refs)"
    assert p["loading"]["grew_mb"] > 290, p
    assert 55 < p["wrapping"]["grew_mb"] < 150, p  # 60 MB held; not the 300 MB loading peak
    assert p["load_grew_mb"] == p["loading"]["grew_mb"]
    assert set(p) >= {"first_steps", "later_steps"} and p["wrapping"]["end_mb"] - p["wrapping"]["start_mb"] > 95, p
    assert 38 < p["wrapping"]["end_mapped_mb"] - p["loading"]["end_mapped_mb"] < 45, p  # the 40 MB mapped file
    assert p["loading"]["end_mapped_mb"] - p["baseline_mapped_mb"] < 5, p


def test_loading_heap_hands_back_the_temporaries_it_frees():
    """While the weights load (heap.steady_heap), 8 MB temporaries freed between live small blocks go back to the
    kernel, and in a training run's hold (heap.hold_steady, to the end of its first steps) after the block too; after
    loading or the hold's release (glibc's threshold at its adaptive ceiling, as a long-running process has it) the same pattern
    stays resident: the order of frees decided what a rank held after loading (docs/loading.md). In a fresh interpreter,
    as a rank loads at its start: in this long-lived pytest process earlier tests leave free heap chunks that large
    blocks are cut from whatever the threshold (CI failed on that)."""
    import platform
    import subprocess
    import sys

    if platform.libc_ver()[0] != "glibc":
        pytest.skip("glibc's malloc only")
    code = """if True:
        import json, torch
        from sftrecipes.model.heap import steady_heap
        from sftrecipes.train.probes import rss_mb

        def kept_after_free():  # MB still resident after freeing 6 of 8 blocks of 8 MB, each followed by a small one
            big, small = [], []
            for _ in range(8):
                big.append(torch.ones(2 << 20))  # 8 MB, touched
                small.append(torch.ones(64))
            before = rss_mb()
            del big[:6]
            return 48 - (before - rss_mb())

        if HELD:  # a training run's hold (PhaseMemory: loading to the end of the first steps) around the loading's block
            hold_steady()
        with steady_heap() as acting:
            inside = kept_after_free()
        still = kept_after_free()  # after the block: held on, or glibc's adaptive threshold
        release()
        print(json.dumps([acting, inside, still, kept_after_free()]))
    """
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_MMAP_THRESHOLD_"}
    for held in (False, True):
        prog = code.replace("from sftrecipes.model.heap import steady_heap", "from sftrecipes.model.heap import hold_steady, release, "
                            "steady_heap\n        HELD = " + str(held))
        out = subprocess.run([sys.executable, "-c", prog], cwd=ROOT, env=env, capture_output=True, text=True, check=True)
        acting, inside, still, after = json.loads(out.stdout.splitlines()[-1])
        assert acting and inside < 4 and after > 40, (held, acting, inside, still, after)
        assert (still < 4) if held else (still > 40), (held, acting, inside, still, after)  # the hold outlives the block


def test_checkpoint_pages_dropped_only_where_the_mapping_holds_nothing_of_its_own(tmp_path):
    """heap.drop_checkpoint_pages, which a 4-bit load calls after each layer: the pages a rank has read of a
    safetensors file mapped private and writable (as torch maps it) leave its RSS and read back unchanged from the file;
    a mapping with a page written in it (copied on write) is left alone, the write kept."""
    import mmap

    from sftrecipes.model.heap import drop_checkpoint_pages
    from sftrecipes.core.pages import smaps

    path = tmp_path / "model.safetensors"
    path.write_bytes(bytes(range(256)) * (16 << 12))  # 16 MiB

    def resident_kb() -> int:  # this mapping's resident pages (/proc/self/smaps)
        return next(f["Rss"] for _s, _e, _p, name, f in smaps(("Rss",)) if name.endswith(str(path)))

    with open(path, "r+b") as f:
        m = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    try:
        assert sum(m[i + 1] for i in range(0, len(m), 4096)) == len(m) // 4096 and resident_kb() >= 16 << 10  # every page read
        assert drop_checkpoint_pages() >= len(m)
        assert resident_kb() < 1024 and m[4097] == 1  # gone from the RSS; read again from the file
        sum(m[i + 1] for i in range(0, len(m), 4096))
        m[8192] = 7  # a page of its own: the mapping is no longer the file's
        dropped = drop_checkpoint_pages()
        assert dropped < len(m) and resident_kb() > 8 << 10 and m[8192] == 7, dropped  # not dropped
    finally:
        m.close()


def test_file_pages_split_into_libraries_and_checkpoints(tmp_path):
    """probes.file_pages_mb, which every phase records and growth_mb subtracts: a mapped file's pages count as the
    libraries' or, for a *.safetensors file, the checkpoint's, and only while they are still the file's (a page written
    in a private mapping is the process's own); anonymous memory is neither. growth_mb takes the libraries' growth out
    of a phase's growth and nothing else. pages.fault_bytes: what one touch of a file's mapping makes resident here."""
    import mmap

    from sftrecipes.core.pages import PAGE, fault_bytes
    from sftrecipes.train.probes import file_pages_mb, growth_mb

    def mapped(folder):  # a library-like file mapped read-only and a checkpoint mapped private and writable
        folder.mkdir()
        out = []
        for name, writable in (("libsomething.so", False), ("model.safetensors", True)):
            (folder / name).write_bytes(b"\1" * (8 << 20))
            with open(folder / name, "r+b") as fh:
                out.append(mmap.mmap(fh.fileno(), 0, flags=mmap.MAP_PRIVATE,
                                     prot=mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)))
        return out

    def use(maps):
        for m in maps:
            assert sum(m[i] for i in range(0, len(m), PAGE)) == len(m) // PAGE  # every page read

    # the same steps once on other files first: the interpreter's own code they run is then mapped already (where the
    # page cache holds large folios a first run of a code path maps up to 2 MiB of the interpreter's file)
    warm = mapped(tmp_path / "warm")
    use(warm)
    warm[1][: 4 << 20] = b"\2" * (4 << 20)
    file_pages_mb()
    maps = mapped(tmp_path / "run")
    before = file_pages_mb()
    anon = bytearray(16 << 20)  # 16 MB of the process's own
    try:
        use(maps)
        read = file_pages_mb()
        assert 8.0 <= read[0] - before[0] < 10.5 and 8.0 <= read[1] - before[1] < 10.5, (before, read)
        maps[1][: 4 << 20] = b"\2" * (4 << 20)  # half the checkpoint's pages written: copies of the process's own
        written = file_pages_mb()
        assert abs(written[1] - read[1] + 4.19) < 0.2 and -0.2 < written[0] - read[0] < 2.2, (read, written)
        touch = fault_bytes(tmp_path / "run" / "model.safetensors")
        assert touch % PAGE == 0 and PAGE <= touch <= 2 << 20, touch
    finally:
        for m in maps + warm:
            m.close()
        del anon
    record = {"baseline_mb": 500.0, "baseline_library_mb": 140.0,
              "loading": {"peak_mb": 600.0, "end_mb": 560.0, "end_library_mb": 152.0, "end_checkpoint_mb": 30.0}}
    assert growth_mb(record, "loading") == 88.0 and growth_mb(record, "loading", "end_mb") == 48.0
    assert growth_mb({"baseline_mb": 500.0, "loading": {"peak_mb": 600.0}}, "loading") == 100.0  # an older record


# ----------------------------------------------------------------------------------------------- one process


# Tensor methods that make the host wait for the device (on a GPU: a stream sync), and torch.cuda.synchronize itself.
DEVICE_READS = ("item", "tolist", "__int__", "__float__", "__bool__", "__index__", "nonzero", "cpu", "numpy")
EVENTS = ("on_log", "on_train_begin", "on_train_end", "on_save", "on_evaluate")


def record_device_reads(monkeypatch) -> list[tuple[str, str, str]]:
    """From now on, every device read made by this project's code (sftrecipes/, train.py): (method, where, file:line).
    where: the trainer event it ran in (on_log, on_train_end, ...), 'step' for anything else inside the training loop
    (forward hooks, backward, on_step_begin/end: once per step or micro-batch), 'outside' before or after the loop.
    On CPU these reads cost nothing, so only counting them shows a per-step sync that would stall a GPU."""
    import sys

    ours = (str(ROOT / "sftrecipes") + os.sep, str(ROOT / "train.py"))
    reads = []

    def where() -> str:
        f, loop = sys._getframe(2), False
        while f is not None:
            name, file = f.f_code.co_name, f.f_code.co_filename
            if name in EVENTS and file.endswith("trainer_callback.py"):
                return name
            loop = loop or name == "_inner_training_loop"
            f = f.f_back
        return "step" if loop else "outside"

    def wrap(name, orig):
        def read(*a, **kw):
            caller = sys._getframe(1)
            if caller.f_code.co_filename.startswith(ours):
                reads.append((name, where(), f"{os.path.basename(caller.f_code.co_filename)}:{caller.f_lineno}"))
            return orig(*a, **kw)
        return read

    for name in DEVICE_READS:
        monkeypatch.setattr(torch.Tensor, name, wrap(name, getattr(torch.Tensor, name)))
    monkeypatch.setattr(torch.cuda, "synchronize", wrap("cuda.synchronize", torch.cuda.synchronize))
    return reads


def assert_reads_only_at_logs(reads):
    """No device read per step or micro-batch; the callback's token counts are read at the logs."""
    # attention.py's per-segment path lays its segments out on the host: it serves CPU and fp32 runs only (on a GPU in
    # 16-bit torch's varlen kernel runs, whose call reads nothing: test_attention.py checks that path on its own)
    per_step = [r for r in reads if r[1] == "step" and not r[2].startswith("attention.py:")]
    assert not per_step, f"device reads inside training steps (a host sync per step on a GPU): {sorted(set(per_step))}"
    assert any(w == "on_log" and at.startswith("metrics.py") for _, w, at in reads), reads  # the batched read happened


def run_with_callback(monkeypatch, argv, peak_tflops=None):
    """train.run (which attaches its ThroughputCallback), recording every batch the trainer trains on and every device
    read of this project's code (record_device_reads)."""
    import trl

    reads = record_device_reads(monkeypatch)
    fed = []
    step = trl.SFTTrainer.training_step

    def recording_step(self, model, inputs, *a, **kw):
        fed.append({k: v.detach().clone() for k, v in inputs.items() if k in ("input_ids", "position_ids", "attention_mask")})
        return step(self, model, inputs, *a, **kw)

    monkeypatch.setattr(trl.SFTTrainer, "training_step", recording_step)
    if peak_tflops is not None:
        argv = [*argv, "--launch.peak_tflops", str(peak_tflops)]
    trainer, summary = train.run(load_recipe(argv))
    callbacks = [c for c in trainer.callback_handler.callbacks if isinstance(c, metrics.ThroughputCallback)]
    assert len(callbacks) == 1  # train.py wires exactly one
    assert summary["throughput"] == callbacks[0].summary
    return trainer, callbacks[0], fed, reads


def segments(batch) -> list[int]:
    """Sample lengths of a fed batch, computed here independently: mask row sums, or runs of increasing positions."""
    if "attention_mask" in batch:
        return batch["attention_mask"].sum(-1).tolist()
    lengths = []
    for p in batch["position_ids"].flatten().tolist():
        if p == 0:
            lengths.append(0)
        lengths[-1] += 1
    return lengths


def tb_scalars(folder) -> dict[str, list[float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder))
    acc.Reload()
    return {tag: [e.value for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def check_png(path):
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    assert width > 100 and height > 100


def test_unpacked_run_counts_non_pad_tokens(tiny_model, tmp_path, monkeypatch, capsys):
    out = tmp_path / "unpacked"
    trainer, cb, fed, reads = run_with_callback(monkeypatch, ["recipes/tiny/lora.yaml", "--output_dir", str(out), "--max_steps", "6",
                                                      "--packing", "false", "--sample_max_new_tokens", "0"])
    pad = trainer.processing_class.pad_token_id
    s, rank = cb.summary, cb.summary["ranks"][0]
    assert len(fed) == rank["steps"] == 6
    real = sum(int((b["input_ids"] != pad).sum()) for b in fed)
    slots = sum(b["input_ids"].numel() for b in fed)
    assert rank["real_tokens"] == real and rank["token_slots"] == slots
    assert real < slots  # padded batches: the share is below 1 and is what we measured
    assert s["real_token_share"] == pytest.approx(real / slots)
    # steady-state FLOPs per token from the batches of steps 2..6, LoRA: trainable 0 base weights, all-linear r=8
    toks = sum(sum(segments(b)) for b in fed[1:])
    pairs = sum(x * (x + 1) // 2 for b in fed[1:] for x in segments(b))
    a = TINY.lora_params("all-linear", 8)
    assert rank["flops_per_token"] == pytest.approx(flops.step_flops(TINY, toks, pairs, trainable=0, adapter=a) / toks)
    assert rank["mfu"] is None and s["mfu"] is None  # CPU without a given peak: no MFU
    assert rank["rss_peak_gb"] >= rank["rss_before_gb"] > 0.05 and rank["accelerator_peak_gb"] is None
    # report_to none: our own event file carries the perf scalars and mirrors the trainer's loss
    scalars = tb_scalars(out / "runs" / "throughput")
    for tag in ("perf/step_time_s", "perf/tokens_per_s_per_device", "perf/real_token_share", "perf/model_tflops_per_device",
                "mem/rss_gb", "train/loss"):
        assert tag in scalars, sorted(scalars)
    assert len(scalars["perf/step_time_s"]) == 6
    assert sum(v for v in scalars["perf/real_token_share"]) / 6 == pytest.approx(
        sum(int((b["input_ids"] != pad).sum()) / b["input_ids"].numel() for b in fed) / 6)
    assert scalars["train/loss"] == pytest.approx([e["loss"] for e in trainer.state.log_history if "loss" in e])
    check_png(out / "metrics.png")
    table = capsys.readouterr().out
    assert "real share" in table and table.count("\n   0 ") == 1  # one row, rank 0
    saved = json.loads((out / "metrics.json").read_text())
    assert saved["ranks"][0]["real_tokens"] == real and len(saved["ranks"][0]["series"]) == 6
    assert "series" not in rank  # the returned summary (for run_summary.json) leaves the per-step series out
    assert_reads_only_at_logs(reads)  # padded batches (attention_mask)


def test_packed_run_mfu_and_tensorboard_beside_trainer(tiny_model, tmp_path, monkeypatch):
    out = tmp_path / "packed"
    trainer, cb, fed, reads = run_with_callback(monkeypatch, ["recipes/tiny/lora.yaml", "--output_dir", str(out), "--max_steps", "6",
                                                      "--report_to", "tensorboard", "--sample_max_new_tokens", "0"],
                                         peak_tflops=0.05)
    rank, pad = cb.summary["ranks"][0], trainer.processing_class.pad_token_id
    assert all("attention_mask" not in b and "position_ids" in b for b in fed)  # TRL's padding-free packing
    assert rank["real_tokens"] == sum(int((b["input_ids"] != pad).sum()) for b in fed) == rank["token_slots"]
    assert cb.summary["real_token_share"] == 1.0
    assert rank["mfu"] == pytest.approx(rank["model_tflops"] / 0.05) and 0 < rank["mfu"] < 1
    assert rank["model_tflops"] == pytest.approx(rank["tokens_per_s"] * rank["flops_per_token"] / 1e12)
    assert rank["ms_per_1k_real_tokens"] == pytest.approx(1e6 / rank["tokens_per_s"])
    scalars = tb_scalars(out / "runs" / "throughput")
    assert "perf/mfu" in scalars and "train/loss" not in scalars  # the trainer's TensorBoardCallback writes the loss
    trainer_runs = [p for p in (out / "runs").iterdir() if p.name != "throughput"]
    assert trainer_runs and "train/loss" in tb_scalars(trainer_runs[0])
    check_png(out / "metrics.png")
    assert_reads_only_at_logs(reads)  # padding-free batches (position_ids)


# ----------------------------------------------------------------------------------------------- two processes


def test_ddp_two_ranks_gathered_to_rank0(twin_runs):
    """The DDP twin through its emitted launcher (the session's run, conftest.twin_runs): train.py's callback gathers
    both ranks to rank 0."""
    out, _, log = twin_runs("ddp")
    saved = json.loads((out / "metrics.json").read_text())
    assert saved["world_size"] == 2 and [r["rank"] for r in saved["ranks"]] == [0, 1]
    for r in saved["ranks"]:
        assert r["steps"] == 6 and len(r["series"]) == 6
        assert r["real_tokens"] == sum(s["tokens"] for s in r["series"]) > 0
        assert r["real_token_share"] == 1.0  # the twin packs (padding-free)
    assert saved["ranks"][0]["real_tokens"] != saved["ranks"][1]["real_tokens"]  # each rank its own shard of the data
    assert saved["tokens_per_s"] == pytest.approx(sum(r["tokens_per_s"] for r in saved["ranks"]))
    rows = [line for line in log.splitlines() if line.strip().split(" ")[0] in ("0", "1") and "/" in line]
    assert len(rows) == 2, log[-3000:]  # the table printed once (rank 0) with a row per rank
    check_png(out / "metrics.png")
    summary = json.loads((out / "run_summary.json").read_text())
    assert summary["backend"]["world_size"] == 2

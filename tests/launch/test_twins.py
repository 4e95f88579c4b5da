"""Every shipped setup, for real: each CPU twin runs through the launcher `emit` wrote for it, on 2 processes, and
must show that its backend took effect (read from the live objects), that the loss falls, and that the save loads.

A green run on the wrong backend proves nothing, so each twin states what it must look like: DDP wraps the model;
ZeRO-1/2 halve the fp32 optimizer state per rank; ZeRO-3 and FSDP halve the parameters per rank.
First run on a machine: DeepSpeed JIT-builds its CPU ops (shm comm ~40 s, cpu_adam ~110 s for offload) into
~/.cache/torch_extensions, reused afterwards.
"""

import json
import math
import os
import re
import subprocess

import pytest
import torch

from conftest import ROOT, accelerate_run, free_port, launch_twin, run_cli
from sftrecipes.plan import plan_recipe
from sftrecipes.plan.ranks import loading_of
from sftrecipes.train.probes import growth_mb
from sftrecipes.recipe.load import load_recipe

TWINS = {
    # name: expectations on run_summary["backend"]
    "ddp": dict(distributed_type="MULTI_CPU", wrapper="DistributedDataParallel", shard="none"),
    "zero1": dict(distributed_type="DEEPSPEED", zero_stage=1, shard="optimizer"),
    "zero2": dict(distributed_type="DEEPSPEED", zero_stage=2, shard="optimizer"),
    "zero3": dict(distributed_type="DEEPSPEED", zero_stage=3, shard="params"),
    "offload": dict(distributed_type="DEEPSPEED", zero_stage=3, shard="params", zero_offload_optimizer="cpu",
                    zero_offload_params="cpu", optimizer="DeepSpeedCPUAdam"),
    "fsdp": dict(distributed_type="FSDP", fsdp_version=2, wrapper="FSDPLlamaForCausalLM", shard="params"),
    "fsdp1": dict(distributed_type="FSDP", fsdp_version=1, wrapper="FullyShardedDataParallel", shard="params"),
    "qlora-fsdp": dict(distributed_type="FSDP", fsdp_version=2, wrapper="FSDPPeftModelForCausalLM", shard="params"),
    "qlora-zero3": dict(distributed_type="DEEPSPEED", zero_stage=3, shard="params"),
    # the recipes for today's models, each twin on a tiny model of its own architecture
    "llama3-zero3": dict(distributed_type="DEEPSPEED", zero_stage=3, shard="params"),
    "llama3-qlora-zero3": dict(distributed_type="DEEPSPEED", zero_stage=3, shard="params"),
    "qwen3-qlora-fsdp": dict(distributed_type="FSDP", fsdp_version=2, wrapper="FSDPPeftModelForCausalLM", shard="params"),
    "qwen3moe-zero3": dict(distributed_type="DEEPSPEED", zero_stage=3, shard="params"),
    # long context: both ranks one sequence-parallel group (Ulysses), each row split over them
    "llama3-sp": dict(distributed_type="DEEPSPEED", zero_stage=3, shard="params", sequence_parallel_size=2),
    "qwen3-sp": dict(distributed_type="DEEPSPEED", zero_stage=3, shard="params", sequence_parallel_size=2),
}
BASE_OF = {"llama3-zero3": "llama3", "llama3-qlora-zero3": "llama3", "qwen3-qlora-fsdp": "qwen3",
           "qwen3moe-zero3": "qwen3_moe", "llama3-sp": "llama3", "qwen3-sp": "qwen3"}  # else tiny-llama


def assert_loadable(out, summary, base_dir=".assets/tiny-llama", quantized=False):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    frozen = summary["precision"]["loaded weights (frozen)"]  # the base as the run loaded it (a LoRA run: bf16 here)
    base = lambda: AutoModelForCausalLM.from_pretrained(base_dir, dtype=getattr(torch, frozen, None) or "auto")  # noqa: E731
    if summary["adapter"]:
        model = PeftModel.from_pretrained(base(), out)
        assert sum("lora_" in n for n, _ in model.named_parameters()) == summary["saved_tensors"]
    elif (out / "pytorch_model_fsdp_0").is_dir():  # sharded final save: convert, then load
        from sftrecipes.export import export

        model = AutoModelForCausalLM.from_pretrained(export(out, out.parent / (out.name + "-export")))
    else:
        model = AutoModelForCausalLM.from_pretrained(out)
    ids = torch.tensor([[1, 20, 30, 40]])
    assert torch.isfinite(model(input_ids=ids).logits).all()
    if not quantized:
        assert_sample_is_greedy_reply_of(model, out, summary["sample"])


def assert_sample_is_greedy_reply_of(model, out, sample):
    """The run's sample reply is the trained model's greedy reply: the saved model, reloaded as the run held it
    (the base in its load dtype), generates it again, token for token, stopping where the run stopped. A sample from
    other weights (a rank's shard, the initial model: checked to fail), cut short or run past its stop fails.
    Generated as the run did (generate, KV cache): in bf16 a recomputation without the cache rounds differently
    and flips near-ties (a 0.03 logit gap, 2 bf16 ulps, was seen to). Quantized twins are left out: the run
    generated with the 4-bit base, the model here has the unquantized one."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(out)
    prompt = sample["prompt"]
    if isinstance(prompt, list):
        enc = tok.apply_chat_template(prompt, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    else:
        enc = tok(prompt, return_tensors="pt")
    stop = tok.convert_tokens_to_ids(sample["stopped_on"]) if sample["stopped_on"] else tok.eos_token_id
    model.eval()
    with torch.no_grad():
        out_ = model.generate(**enc, max_new_tokens=sample["new_tokens"], do_sample=False, use_cache=True,
                              pad_token_id=tok.pad_token_id, eos_token_id=stop, output_scores=True,
                              return_dict_in_generate=True)
    new = out_.sequences[0, enc["input_ids"].shape[1]:].tolist()
    text = tok.decode(new, skip_special_tokens=True)
    if len(new) == sample["new_tokens"] and text == sample["reply"]:
        assert (new[-1] == stop) == bool(sample["stopped_on"]), (new, sample)
        return
    # Not the same reply: only a near-tie may explain it. At the first token whose text leaves the run's reply (or
    # that ends the reply early or late), the two best logits must lie within a few bf16 ulps, where the run's
    # ZeRO-3/FSDP forward and this one may round differently; a sample of other weights diverges at a clear choice.
    step = next((i for i in range(len(new) + 1)
                 if not sample["reply"].startswith(tok.decode(new[:i + 1], skip_special_tokens=True))
                 or (i < len(new) and new[i] == stop)), len(new) - 1)
    step = min(step, len(out_.scores) - 1)
    top2 = torch.topk(out_.scores[step][0].float(), 2).values
    gap = (top2[0] - top2[1]).item()
    assert gap <= 0.05 * max(1.0, top2[0].abs().item()), (text, sample, step, gap)


@pytest.mark.parametrize("name", list(TWINS))
def test_twin_runs_through_its_launcher(twin_runs, family_models, name):
    want = TWINS[name]
    out, summary, log = twin_runs(name)
    b = summary["backend"]
    assert b["world_size"] == 2
    for key in ("distributed_type", "wrapper", "zero_stage", "fsdp_version", "zero_offload_optimizer", "zero_offload_params",
                "optimizer", "sequence_parallel_size"):
        if key in want:
            assert b[key] == want[key], (key, b)
    if "zero_stage" in b:  # DeepSpeed's buckets by the model's hidden size h, as the planner counts them (backends.py)
        h = load_recipe([f"recipes/tiny/{name}.yaml"]).model.model_name_or_path
        h = json.loads((ROOT / h / "config.json").read_text())["hidden_size"]
        z = b["zero_buckets"]
        assert z["reduce_bucket_size"] == h * h, z
        if b["zero_stage"] == 3:
            assert z["prefetch_bucket_size"] == int(0.9 * h * h) and z["param_persistence_threshold"] == 10 * h, z
    if want["shard"] == "params":  # each rank holds half the parameters (ZeRO-3 partitions / FSDP shards)
        assert b["param_elements_local"] * 2 == pytest.approx(b["param_elements_full"], rel=0.02), b
    elif want["shard"] == "optimizer":  # ZeRO-1/2: full parameters, half the fp32 optimizer copy
        assert b["param_elements_local"] == b["param_elements_full"]
        assert b["optimizer_fp32_elements_local"] * 2 == pytest.approx(b["trainable_elements_full"], rel=0.02), b
    else:
        assert b["param_elements_local"] == b["param_elements_full"]
    losses = summary["losses"]
    assert len(losses) == 6 and losses[-1] < losses[0] * 0.9, losses
    assert summary["sample"]["new_tokens"] > 0  # every rank generated (under ZeRO-3/FSDP a rank alone would hang)
    # every twin packs without flash-attn: each sample attends within itself (sftrecipes/model/attention.py), read back
    # from the trained model's config, on both ranks
    assert summary["attention"] == "sft_varlen" and log.count("attention: sft_varlen") == 2, log[-3000:]
    base = family_models[BASE_OF[name]] if name in BASE_OF else ".assets/tiny-llama"
    if name == "qwen3moe-zero3":  # all-linear adapts attention and experts, not the router (lora_target_router false)
        assert "router not adapted" in log and ".mlp.gate." not in " ".join(load_file_names(out))
        assert any(".mlp.experts." in n for n in load_file_names(out))
    if name.startswith("llama3-"):  # the template's end of turn, read as the run's eos and stop token
        assert "end of turn is <|eot_id|> (added token)" in log
    if name.endswith("qlora-zero3"):  # zero3_init: each decoder layer partitioned once its 4-bit weights loaded
        layers = json.loads((ROOT / base / "config.json").read_text())["num_hidden_layers"]
        assert f"zero3_init: {layers} of {layers} decoder layers partitioned as their 4-bit weights loaded" in log, log[-3000:]
    if name.endswith("qlora-fsdp"):  # FSDP2: rank 0 sent each decoder layer once quantized, every rank kept its rows
        layers = json.loads((ROOT / base / "config.json").read_text())["num_hidden_layers"]
        assert (f"fsdp_cpu_ram_efficient_loading: {layers} of {layers} decoder layers sent to the other ranks as their "
                "4-bit weights loaded") in log, log[-3000:]
    assert_loadable(out, summary, base, quantized="qlora" in name)


def load_file_names(out) -> list[str]:
    from safetensors import safe_open

    with safe_open(str(out / "adapter_model.safetensors"), framework="pt") as f:
        return list(f.keys())


def test_fsdp_twin_writes_sharded_checkpoints(twin_runs, tmp_path):
    """SHARDED_STATE_DICT checkpoints during training: one piece per rank, no rank-0 gather; they convert to the
    same weights torch's own DCP converter reads."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from safetensors.torch import load_file

    from sftrecipes.export import export

    out = twin_runs("fsdp")[0]
    ckpt = out / "checkpoint-3" / "pytorch_model_fsdp_0"
    assert sorted(p.name for p in ckpt.iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    ours = load_file(export(out / "checkpoint-3", tmp_path / "ck-export") / "model.safetensors")
    dcp_to_torch_save(ckpt, tmp_path / "ref.pt")
    ref = torch.load(tmp_path / "ref.pt")
    ref = ref.get("model", ref)
    assert len(ours) == 21 and all(torch.equal(ours[k], ref[k]) for k in ours)


def test_fsdp2_wraps_the_layer_classes_a_multimodal_gemma3_has(gemma3_multimodal_model, tmp_path):
    """Issue 18: a Gemma-3 multimodal config (Gemma3ForConditionalGeneration: a text and a SigLIP tower) through the
    FSDP2 twin's launcher. accelerate's own wrap list (model._no_split_modules) names SigLIP's pooling head, which
    this tower lacks, and stopped both ranks; the ranks now name the classes the model has, and FSDP shards each
    of them as a unit. The shipped recipe's use_flash_attn: true falls back on this class as on any other."""
    out = tmp_path / "gemma3-multimodal"
    res = run_cli(["-m", "sftrecipes", "launch", "recipes/tiny/fsdp.yaml", "--model_name_or_path", str(gemma3_multimodal_model),
                   "--max_steps", "2", "--sample_max_new_tokens", "4", "--output_dir", str(out)],
                  env={"MAIN_PROCESS_PORT": str(free_port())})
    log = res.stdout + res.stderr
    assert res.returncode == 0, log[-4000:]
    summary = json.loads((out / "run_summary.json").read_text())
    b = summary["backend"]
    assert summary["steps"] == 2 and len(summary["losses"]) == 2 and all(math.isfinite(x) for x in summary["losses"])
    assert b["distributed_type"] == "FSDP" and b["fsdp_version"] == 2 and b["world_size"] == 2
    assert b["wrapper"] == "FSDPGemma3ForConditionalGeneration"
    assert b["param_elements_local"] * 2 == pytest.approx(b["param_elements_full"], rel=0.02), b
    units = b["fsdp_units"]  # (accelerate also shards the input embeddings and the LM head on their own)
    config = json.loads((gemma3_multimodal_model / "config.json").read_text())  # (the tiny one keeps the 5:1 pattern)
    assert {k: units.get(k) for k in ("Gemma3DecoderLayer", "SiglipEncoderLayer", "SiglipVisionEmbeddings")} == {
        "Gemma3DecoderLayer": config["text_config"]["num_hidden_layers"],
        "SiglipEncoderLayer": config["vision_config"]["num_hidden_layers"], "SiglipVisionEmbeddings": 1}, units
    assert log.count("fsdp: wrapping SiglipVisionEmbeddings, SiglipEncoderLayer, Gemma3DecoderLayer "
                     "(Gemma3ForConditionalGeneration's _no_split_modules present in it)") == 2, log[-3000:]
    assert log.count("attention: sft_varlen (use_flash_attn: falling back to sft_varlen: Gemma3ForConditionalGeneration "
                     "does not support flash_attention_2 (_supports_flash_attn False))") == 2, log[-3000:]
    assert summary["attention"] == "sft_varlen" and summary["saved_tensors"] > 0 and summary["sample"]["new_tokens"] > 0


def test_data_is_prepared_once(twin_runs):
    """The main process tokenizes; the other rank waits and reuses its cache (the ddp twin runs with a fresh cache,
    so nothing is reused from earlier runs). A map's progress bar starts once at 0% but may print 100% twice (its
    last update and its close, on a slow host), so the starts are counted."""
    _, _, log = twin_runs("ddp")
    assert len(re.findall(r"Formatting and tokenizing train split:\s+0%\|", log)) == 1, log[-3000:]
    assert "Formatting and tokenizing train split: 100%" in log, log[-3000:]


def test_multinode_launcher_two_machines(tiny_model, tmp_path):
    """The multi-node launcher as two machines (machine rank 0 and 1, one process each) meeting on 127.0.0.1, on the
    port MAIN_PROCESS_PORT names: the recipe's port (set by a flag on both, as a copied recipe would) is held by
    another socket meanwhile, as another run on the same host once held the shipped recipe's and failed this test.
    Both ports are free ones of this host."""
    import socket

    out = tmp_path / "mn"
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        held = str(taken.getsockname()[1])
        env = {**os.environ, "MAIN_PROCESS_IP": "127.0.0.1", "MAIN_PROCESS_PORT": str(free_port())}  # (not `held`)
        procs = [subprocess.Popen(["scripts/run_tiny-multinode.sh", "--output_dir", str(out), "--sample_max_new_tokens", "0",
                                   "--launch.main_process_port", held],
                                  cwd=ROOT, env={**env, "MACHINE_RANK": str(rank)},
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for rank in (0, 1)]
        logs = [p.communicate(timeout=600)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], logs[0][-3000:] + logs[1][-3000:]
    assert all(f"main process at 127.0.0.1:{env['MAIN_PROCESS_PORT']}" in log for log in logs), logs[0][-3000:]
    b = json.loads((out / "run_summary.json").read_text())["backend"]
    assert b["world_size"] == 2 and b["distributed_type"] == "FSDP"
    assert b["param_elements_local"] * 2 == b["param_elements_full"]


@pytest.mark.real_ranks  # each rank's memory held against the plan from its first byte
def test_ram_efficient_loading_only_rank0_reads(tmp_path):
    """FSDP2 with fsdp_cpu_ram_efficient_loading: rank 0 reads the weights, rank 1 starts without them and receives
    its shard by broadcast. The medium model (25.7M params) is stored in bf16 and trained in fp32, so a rank that
    reads it makes a private 103 MB fp32 copy — as 8 ranks loading 70B in fp32 would (2 TB). Its one step runs without
    bf16 autocast: loading is what is measured, and a CPU without AVX-512 emulates bf16 matmuls (45 s a step, not 9)."""
    from sftrecipes.core.paths import ASSETS
    from sftrecipes.tiny import ensure_tiny_model

    medium = ensure_tiny_model(ASSETS / "medium-llama", "medium")
    fp32_mb = 25.7e6 * 4 / 1e6
    grew = {}
    for efficient in (True, False):
        summary = accelerate_run(["recipes/tiny/fsdp.yaml", "--model_name_or_path", str(medium), "--max_steps", "1",
                                  "--save_strategy", "no", "--sample_max_new_tokens", "0", "--bf16", "false",
                                  "--launch.fsdp_cpu_ram_efficient_loading", str(efficient)], tmp_path / f"eff-{efficient}")
        grew[efficient] = {m["rank"]: m["load_grew_mb"] for m in summary["memory"]}
        # the planner's loading figures for the cpu target (plan/ranks.py), rank by rank, against the phase measured:
        # its peak and what is held at its end, as growth over the rank's RSS before loading (probes.growth_mb)
        plan = plan_recipe(load_recipe(["recipes/tiny/fsdp.yaml", "--model_name_or_path", str(medium), "--bf16", "false",
                                        "--launch.fsdp_cpu_ram_efficient_loading", str(efficient)]), _alternatives=False)
        for m in summary["memory"]:
            g = loading_of(plan.rank_loading, m["rank"])
            for planned_gb, up_to_gb, key in ((g.peak_gb, g.peak_up_to_gb, "peak_mb"), (g.held_gb, g.held_up_to_gb, "end_mb")):
                assert_planned(planned_gb, up_to_gb, growth_mb(m, "loading", key), (efficient, m["rank"], g.ranks, key, m))
    print("CPU RSS growth from load to first step (MB):", grew)
    # without it, rank 1 also materialises the whole fp32 model; with it, rank 1 saves most of that (measured
    # 68-102 MB of the 103 MB: allocator arenas blur the rest); reading the model on rank 1 would save ~0
    assert grew[False][1] - grew[True][1] > 0.5 * fp32_mb, grew
    # and rank 1 stays well below rank 0, which holds the full model while broadcasting
    assert grew[True][1] < 0.75 * grew[True][0], grew


# every CPU twin backend of the calibration (bench/bench_loading.py runs the same at 253M for docs/loading.md)
CALIBRATED = ("ddp", "zero1", "zero2", "zero3", "offload", "fsdp1", "fsdp", "qlora-fsdp", "qlora-zero3")


# how far one rank's first steps moved between runs of the same twin at 25.7M, the most over every twin and rank
# (QLoRA ZeRO-3's rank 1: 102.7-116.2 MB over 5 runs on ext4 and tmpfs; offload's ranks 7 MB); at 253M the runs agree
# within 2.2%
RUN_SPREAD_MB = 13.5


def assert_planned(planned_gb: float, up_to_gb: float | None, got: float, what) -> None:
    """A figure the planner plans for the cpu target against the growth measured (probes.growth_mb, MB): within 10%
    and half the spread between runs at this size (RUN_SPREAD_MB), or 10 MB where a rank grows by little more than
    what loading leaves besides weights; a figure with a ceiling (RankLoading.peak_up_to_gb, held_up_to_gb: what a
    filesystem's large folios can add) anywhere up to the ceiling."""
    low, high = planned_gb * 1e3, (up_to_gb or planned_gb) * 1e3
    slack = max(0.10 * got + RUN_SPREAD_MB / 2, 10)
    assert low - slack <= got <= high + slack, (what, round(low), round(high), round(got))


@pytest.mark.real_ranks  # each rank's memory held against the plan from its first byte
@pytest.mark.parametrize("twin", CALIBRATED)
def test_plan_holds_rank_by_rank(twin, tmp_path):
    """The planner's per-rank figures for the cpu target against a 2-rank run of the twin through its launcher, at the
    largest size this suite affords (the medium Llama, 25.7M parameters, 51 MB in bf16; ~12 s a run): loading's peak,
    what a rank holds after loading and the peak of its first steps, each as growth over the rank's RSS before loading
    less the libraries' file pages mapped since (probes.growth_mb: how many a touch maps is the filesystem's), within
    10% on every rank (and half the spread between runs at this size), or 10 MB where a rank grows by little more than
    what loading leaves besides weights; and the RSS before loading less the libraries' file pages, within 10%."""
    from sftrecipes.core.paths import ASSETS
    from sftrecipes.tiny import ensure_tiny_model

    medium = ensure_tiny_model(ASSETS / "medium-llama", "medium")
    flags = ["--model_name_or_path", str(medium), "--max_steps", "3", "--max_length", "64", "--per_device_train_batch_size",
             "1", "--gradient_accumulation_steps", "1", "--save_strategy", "no", "--sample_max_new_tokens", "0"]
    summary, _ = launch_twin(twin, tmp_path / twin, flags, env={"MAIN_PROCESS_PORT": str(free_port())})
    plan = plan_recipe(load_recipe([f"recipes/tiny/{twin}.yaml", *flags]), _alternatives=False)
    assert len(summary["memory"]) == 2 and all(m["exact"] and "baseline_library_mb" in m for m in summary["memory"])
    for m in summary["memory"]:
        g = loading_of(plan.rank_loading, m["rank"])
        own = m["baseline_mb"] - m["baseline_library_mb"]
        assert abs(plan.rank_steps.baseline_gb * 1e3 - own) <= 0.10 * own, (twin, m)
        for what, planned_gb, up_to_gb, phase, key in (
                ("loading", g.peak_gb, g.peak_up_to_gb, "loading", "peak_mb"),
                ("held after loading", g.held_gb, g.held_up_to_gb, "loading", "end_mb"),
                ("first steps", plan.rank_steps.peak_gb, None, "first_steps", "peak_mb")):
            assert_planned(planned_gb, up_to_gb, growth_mb(m, phase, key), (twin, m["rank"], what, m))


# The GRPO recipes' twins (recipes/qwen3-8b/grpo-lora.yaml, recipes/llama3.1-70b/grpo-lora.yaml): their shipped
# settings on 2 CPU ranks, transformers generating (each twin's header names the vLLM keys it leaves out)
GRPO_TWINS = {
    "qwen3-grpo": dict(distributed_type="MULTI_CPU", wrapper="DistributedDataParallel", shard="none", base="qwen3",
                       reference="reference model: the adapter disabled (beta 0.04): the base weights, no second copy"),
    "llama3-grpo-zero3": dict(distributed_type="DEEPSPEED", zero_stage=3, shard="params", base="llama3",
                              reference="reference model: none (beta 0: no KL term)"),
}


@pytest.mark.parametrize("name", list(GRPO_TWINS))
def test_grpo_twin_runs_through_its_launcher(family_models, tmp_path, name):
    """The GRPO twin as shipped (6 steps) through its emitted launcher on 2 ranks: its backend took effect, every step
    scored its completions with spread (a gradient) on both ranks' share, the reference is what beta says (KL logged
    where beta > 0), two completions per step logged with their rewards, the adapter loads on its base."""
    want = GRPO_TWINS[name]
    out = tmp_path / name
    summary, log = launch_twin(name, out, env={"MAIN_PROCESS_PORT": str(free_port())})
    b = summary["backend"]
    assert b["world_size"] == 2 and b["distributed_type"] == want["distributed_type"], b
    assert b.get("wrapper") == want.get("wrapper", b.get("wrapper")) and b.get("zero_stage") == want.get("zero_stage")
    if want["shard"] == "params":
        assert b["param_elements_local"] * 2 == pytest.approx(b["param_elements_full"], rel=0.02), b
    rows = summary["preference"]
    assert summary["method"] == "grpo" and len(rows) == 6, rows
    assert all(math.isfinite(r["rewards/answer_letters/mean"]) and r["reward_std"] > 0 for r in rows), rows
    assert log.count(want["reference"]) == 1, log[-3000:]
    assert ("kl" in rows[-1] and rows[-1]["kl"] > 0) == ("beta 0.04" in want["reference"]), rows[-1]
    assert [c["step"] for c in summary["completions"]] == [6, 6] and log.count("completion (step 6): ") == 2
    assert "answer_letters" in summary["completions"][0]["rewards"]
    assert_loadable(out, summary, base_dir=family_models[want["base"]])

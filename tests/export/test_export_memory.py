"""Exports run in bounded memory, measured: the streaming LoRA merge and the FSDP (DCP) export of a 374 MB bf16
Llama each peak, in a fresh process, under BOUND (0.5) x the model's bytes above that process's RSS just before the
export (measured: merge 0.18x, DCP 0.11x). Holding the whole model, as peft's merge_and_unload + save_pretrained or
torch's dcp_to_torch_save do (bench/bench_export.py: 1.14-1.28x), fails that bound: the control here, every shard
loaded into one state dict and saved, peaks at 1.0x and must exceed 2 x BOUND.

The model is random-init (bf16 normal_, a few seconds; no training), written shard by shard with safetensors (~128
MB shards, 3 of them): vocab 16000 and hidden 1024 make the largest tensor (the embedding, the LM head) 33 MB, 0.09x
the model; 12 layers of 26 MB. What the streaming paths may hold at once (docs/exports.md, "Memory"): one tensor,
for a merged weight also its fp32 copy and the output copy, plus the adapter (13 MB fp32): ~0.15-0.3x here, as
bench/bench_export.py measured at 2.1 and 4.2 GB (0.14-0.28x; `make bench-export`). Each export runs as its own
process (`python -c TASK`; the three side by side), which reports its VmHWM (peak RSS; not ru_maxrss, which a child
inherits from its parent at fork) and its VmRSS just before the export, after every import, so the interpreter and
libraries are not counted. The outputs are checked too (every tensor written, spot values right, the merge's LoRA
delta included), so a path that skipped the work would fail.
"""

import json
import subprocess
import sys

import pytest
import torch

from conftest import ROOT

BOUND = 0.5  # peak RSS above the pre-export RSS, as a fraction of the model's bytes
CONFIG = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=12, num_attention_heads=16, num_key_value_heads=16,
              vocab_size=16000, tie_word_embeddings=False)
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
R, ALPHA = 16, 32
SPOT = ("model.layers.0.self_attn.q_proj.weight", "model.layers.11.mlp.down_proj.weight", "lm_head.weight")

TASK = r"""
import json, sys, time
from pathlib import Path

import peft, torch, transformers  # what the export imports: loaded before the baseline is read
from sftrecipes import export as ex


def status(key):
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024


task, folder, out = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
before, start = status("VmRSS"), time.perf_counter()
if task == "merge":
    ex.merge_lora(folder / "adapter", out, base=str(folder / "base"), dtype="bfloat16")
elif task == "dcp":
    ex.export(folder / "dcp-run", out)
elif task == "whole":  # the control: the whole model in one state dict, then saved (as merge_and_unload + save do)
    from safetensors.torch import load_file, save_file
    sd = {k: v for f in sorted((folder / "base").glob("*.safetensors")) for k, v in load_file(f).items()}
    out.mkdir(exist_ok=True)
    save_file(sd, out / "model.safetensors")
print(json.dumps({"before": before, "peak": status("VmHWM"), "seconds": time.perf_counter() - start}))
"""


@pytest.fixture(scope="module")
def big_model(tmp_path_factory):
    """base/ (sharded safetensors + index), adapter/ (LoRA r=16 on every linear layer), dcp-run/ (the same weights
    as an FSDP SHARDED_STATE_DICT save: pytorch_model_fsdp_0/ + config.json). Returns (folder, model bytes,
    name -> shape, the SPOT tensors, their LoRA A/B)."""
    import torch.distributed.checkpoint as dcp
    from peft import LoraConfig
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, LlamaConfig

    folder = tmp_path_factory.mktemp("export-memory")
    cfg = LlamaConfig(**CONFIG, dtype="bfloat16")
    base = folder / "base"
    cfg.save_pretrained(base)
    with torch.device("meta"):
        layout = [(n, tuple(t.shape)) for n, t in AutoModelForCausalLM.from_config(cfg).state_dict().items()]
    gen = torch.Generator().manual_seed(0)
    weights, shard, weight_map, shards = {}, {}, {}, []
    for name, shape in layout:
        w = torch.empty(shape, dtype=torch.bfloat16)
        weights[name] = w.fill_(1.0) if name.endswith("norm.weight") else w.normal_(0, 0.02, generator=gen)
        shard[name] = weights[name]
        if sum(t.numel() * 2 for t in shard.values()) > 128 * 1024**2 or name == layout[-1][0]:
            shards.append(shard)
            shard = {}
    for i, part in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(part, base / fname, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, fname))
    total = sum(t.numel() * t.element_size() for t in weights.values())
    (base / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))

    adapter = folder / "adapter"
    LoraConfig(r=R, lora_alpha=ALPHA, target_modules=TARGETS, task_type="CAUSAL_LM", base_model_name_or_path=str(base)).save_pretrained(adapter)
    lora = {}
    for name, shape in layout:
        if any(f".{t}." in name for t in TARGETS):
            mod = "base_model.model." + name.removesuffix(".weight")
            lora[f"{mod}.lora_A.weight"] = torch.randn(R, shape[1], generator=gen) * 0.01
            lora[f"{mod}.lora_B.weight"] = torch.randn(shape[0], R, generator=gen) * 0.01
    save_file(lora, adapter / "adapter_model.safetensors")

    run = folder / "dcp-run"
    dcp.save({f"model.{k}": v for k, v in weights.items()}, storage_writer=dcp.FileSystemWriter(str(run / "pytorch_model_fsdp_0")), no_dist=True)
    cfg.save_pretrained(run)
    assert 300 * 1024**2 < total < 600 * 1024**2 and len(shards) >= 3, (total, len(shards))
    shapes = {k: tuple(v.shape) for k, v in weights.items()}
    spot = {k: weights[k] for k in SPOT}  # the rest is let go: the exports run while this process holds little
    spot_lora = {k: v for k, v in lora.items() if any(k.startswith("base_model.model." + n.removesuffix("weight")) for n in SPOT)}
    return folder, total, shapes, spot, spot_lora



@pytest.fixture(scope="module")
def measured(big_model, tmp_path_factory) -> dict:
    """task -> {"before", "peak", "seconds"} (bytes, seconds) and its output folder: the two streaming exports and
    the whole-model control, each its own process, run side by side (each measures only itself)."""
    folder = big_model[0]
    out = tmp_path_factory.mktemp("export-memory-out")
    procs = {task: subprocess.Popen([sys.executable, "-c", TASK, task, str(folder), str(out / task)], cwd=ROOT,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for task in ("merge", "dcp", "whole")}
    results = {}
    for task, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 0, (task, stderr[-3000:])
        results[task] = {**json.loads(stdout.strip().splitlines()[-1]), "out": out / task}
    return results


def read_output(out) -> tuple[dict, dict]:
    """name -> shape of every tensor written, and the tensors SPOT names."""
    from safetensors import safe_open

    shapes, spot = {}, {}
    for f in sorted(out.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as sf:
            for k in sf.keys():
                shapes[k] = tuple(sf.get_slice(k).get_shape())
                if k in SPOT:
                    spot[k] = sf.get_tensor(k)
    return shapes, spot


@pytest.mark.parametrize("task", ["merge", "dcp"])
def test_export_peak_memory_is_a_fraction_of_the_model(big_model, measured, task):
    _, total, shapes_in, weights, lora = big_model
    m = measured[task]
    above = m["peak"] - m["before"]
    print(f"{task}: peak {above / 1e6:.0f} MB above the pre-export RSS = {above / total:.2f}x the {total / 1e6:.0f} MB model, {m['seconds']:.1f}s")
    assert above < BOUND * total, (task, above / total)
    shapes, got = read_output(m["out"])  # the work was done: every tensor, the right values
    assert shapes == shapes_in
    for name in SPOT:
        want = weights[name]
        if task == "merge" and "proj" in name:
            mod = "base_model.model." + name.removesuffix(".weight")
            want = (want.float() + ALPHA / R * (lora[f"{mod}.lora_B.weight"] @ lora[f"{mod}.lora_A.weight"])).to(torch.bfloat16)
            assert not torch.equal(want, weights[name])
        # the same bf16 rounding of the same fp32 sum, but for an ulp here and there; a lost delta changes most
        assert got[name].dtype == torch.bfloat16 and (got[name] != want).float().mean() < 0.01, name


def test_whole_model_export_fails_the_same_bound(big_model, measured):
    """The control: every shard loaded into one state dict, then saved (peft's merge_and_unload + save_pretrained,
    or torch's dcp_to_torch_save, in essence: bench/bench_export.py measured those at 1.14-1.28x) peaks at about 1x
    the model or more above the same baseline, so BOUND tells the two kinds apart."""
    total = big_model[1]
    m = measured["whole"]
    above = m["peak"] - m["before"]
    print(f"whole-model: peak {above / 1e6:.0f} MB above the pre-export RSS = {above / total:.2f}x the model")
    assert above > 2 * BOUND * total, above / total

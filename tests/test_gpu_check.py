"""bench/gpu_check.sh's parts that run without a GPU: the matrix and its skip reasons, the numerics comparison (fp32
on CPU, against the reference varlen and a broken one it must catch), the JSON schema and the table, and the script
end to end on the tiny model (one configuration, sdpa rows, the QLoRA loading rows), so the GPU run does not fail on
code never executed."""

import json
import sys
from pathlib import Path

import pytest

from conftest import ROOT, run_cli

sys.path.insert(0, str(ROOT / "bench"))
import gpu_check  # noqa: E402


def test_matrix_lists_every_row_with_a_reason_for_each_skip():
    rows = gpu_check.matrix([("lora", "8b", True), ("full", "1b", True), ("lora", "8b", False)], "cpu", "no_such_varlen")
    assert len(rows) == 3 * len(gpu_check.KERNELS) * 2
    assert [r["liger"] for r in rows] == [False] * 15 + [True] * 15  # Liger patches the process: its rows come last
    assert [r["attention"] for r in rows[:15]][-3:] == ["flex_attention"] * 3  # compiles per shape: after the others
    by = {(r["run"], r["gradient_checkpointing"], r["attention"], r["packed"], r["liger"]): r["skip"] for r in rows}
    assert by[("lora", True, "sdpa", False, False)] is None and by[("full", True, "sdpa", True, False)] is None
    assert "not registered" in by[("lora", False, "no_such_varlen", True, False)]
    assert "no backward on CPU" in by[("full", True, "flex_attention", True, False)]
    assert "GPU" in by[("lora", True, "sdpa", True, True)]  # Liger on CPU


@pytest.fixture
def broken_varlen():
    """Causal attention over the whole packed row: samples see each other, what a varlen kernel must not do."""
    import torch
    from transformers import AttentionInterface

    def leaky(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        rep = query.shape[1] // key.shape[1]
        out = torch.nn.functional.scaled_dot_product_attention(query, key.repeat_interleave(rep, 1), value.repeat_interleave(rep, 1),
                                                               is_causal=True, scale=scaling)
        return out.transpose(1, 2).contiguous(), None

    AttentionInterface.register("gpucheck_leaky", leaky)
    return "gpucheck_leaky"


def test_numerics_pass_a_correct_varlen_and_catch_a_leaky_one(broken_varlen):
    ref = gpu_check.register_reference_varlen()
    rows = {r["attention"]: r for r in gpu_check.numerics("tiny", "cpu", "float32", [ref, broken_varlen], [40, 7, 64, 17])}
    assert rows[ref]["ok"] and rows[ref]["logits_rel_err"] < 1e-5 and rows[ref]["grad_rel_err"] < 1e-5
    assert not rows[broken_varlen]["ok"] and rows[broken_varlen]["logits_rel_err"] > 1e-2


def test_schema_refuses_a_row_neither_measured_nor_skipped(tmp_path):
    row = {"run": "lora", "size": "8b", "gradient_checkpointing": True, "attention": "sdpa", "packed": True, "liger": False, "skip": None}
    result = {"schema": 1, "date": "d", "device": "cpu", "versions": {}, "settings": {}, "numerics": [], "rows": [row],
              "torch_varlen": True, "varlen_name": "sft_varlen", "seconds": 1.0}
    with pytest.raises(ValueError, match="neither measured nor skipped"):
        gpu_check.check_schema(result)
    row["skip"] = "flash-attn not importable"
    gpu_check.check_schema(result)


def test_gpu_check_cpu_smoke_end_to_end(tiny_model, tmp_path):
    res = run_cli(["bench/gpu_check.py", "--cpu-smoke", "--configs", "full", "--only", "sdpa", "--no-liger-rows", "--steps", "2",
                   "--out", str(tmp_path)], timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    [js] = tmp_path.glob("gpu-check-cpu-smoke-*.json")
    result = json.loads(js.read_text())
    gpu_check.check_schema(result)
    assert [(r["attention"], r["packed"]) for r in result["rows"]] == [("sdpa", False), ("sdpa", True)]
    for r in result["rows"]:
        assert r["skip"] is None and "error" not in r, r
        assert r["ran_attention"] == "sdpa" and r["tokens_per_s_per_device"] > 0 and r["planned_total_gb"] > 0
        assert r["mfu"] is None and r["measured_peak_gb"] is None  # CPU: no device peak, no accelerator memory
    # padded rows carry padding, packed ones nearly none: the two rows really ran different batches
    padded, packed = result["rows"]
    assert packed["real_tokens_per_step"] > padded["real_tokens_per_step"]
    assert result["numerics"] and all(n["ok"] and n["dtype"] == "float32" for n in result["numerics"])
    md = Path(js.with_suffix(".md")).read_text()
    assert "| full tiny | on | sdpa | packed | no |" in md and "logits rel. err" in md
    # (3) QLoRA loading, one process under accelerate (bench/qlora_load_probe.py): both loads measured and planned
    parted, whole = result["qlora_loading"]
    assert parted["load"].startswith("partitioned") and parted["layers_partitioned"] == 2, parted
    assert whole["load"].startswith("whole") and whole["layers_partitioned"] == 0, whole
    assert parted["measured_gb"] > 0 and parted["planned_gb"] > 0 and parted["plan_item"].startswith("cpu target"), parted
    assert "| tiny | partitioned as it loads (zero3_init) |" in md

"""bench/gpu_bench.sh's benchmark runs train.py's own path; here on the tiny model on CPU, so that the GPU run
(made when a GPU is lent) does not fail on code that was never executed."""

import json

from conftest import run_cli


def test_gpu_bench_code_path_on_cpu(tiny_model, tmp_path):
    res = run_cli(["bench/gpu_bench.py", "--size", "tiny", "--full-size", "tiny", "--device", "cpu", "--steps", "2", "--batch", "2", "--seq",
                   "256", "--out", str(tmp_path)], timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    result = json.loads((tmp_path / "results.json").read_text())
    assert [(r["run"], r["gradient_checkpointing"]) for r in result["rows"]] == [("lora", True), ("lora", False), ("full", True)]
    for r in result["rows"]:
        assert r["tokens_per_s_per_device"] > 0 and r["planned_total_gb"] > 0 and r["attention"] == "sft_varlen"  # packed: auto's pick
        assert r["mfu"] is None and r["measured_peak_gb"] is None  # CPU: no device peak, no accelerator memory
    assert "tok/s/dev" in res.stdout

"""bench/grpo_probe.py (the GPU check's GRPO step) without a GPU: its row run in this process on CPU for one step (the
figures it reads from TRL's log history and the run), and the probe's files from its rows, a skipped vLLM row with
its reason and a failed row with its line, so the GPU run does not fail on code never executed."""

import json
import subprocess
import sys

from conftest import ROOT

sys.path.insert(0, str(ROOT / "bench"))
import grpo_probe  # noqa: E402


def test_cpu_smoke_row_and_the_probe_files(tiny_model, tmp_path, monkeypatch):
    out = tmp_path / "probe"
    out.mkdir()
    assert grpo_probe.main(["--cpu-smoke", "--row", "transformers", "--steps", "1", "--out", str(out)]) == 0
    row = json.loads((out / "row-transformers.json").read_text())
    assert row["row"] == "transformers" and row["steps"] == 1 and row["device"] == "cpu"
    assert row["first_step_s"] > 0 and row["step_s_median"] > 0 and row["completions_per_step"] == 16
    assert row["reward_first"] is not None and row["peak_gpu_gb"] is None  # CPU: no GPU peak
    # the parent: each row in a process of its own (stood in for here: the row above, and a row that fails)
    calls = []

    def fake_run(cmd, **kw):
        calls.append(cmd)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(grpo_probe.subprocess, "run", fake_run)
    monkeypatch.setattr(grpo_probe, "ROWS", ("transformers", "vllm_colocate"))
    assert grpo_probe.main(["--cpu-smoke", "--steps", "1", "--out", str(out)]) == 0
    assert [c[c.index("--row") + 1] for c in calls] == ["transformers"]  # vLLM on the cpu target: skipped, not run
    result = json.loads((out / "grpo-probe.json").read_text())
    assert result["rows"][0] == row and result["rows"][1]["skip"].startswith("vLLM generates on GPUs")
    md = (out / "grpo-probe.md").read_text()
    assert f"| transformers | {row['step_s_median']:g} | {row['first_step_s']:g} | - | - |" in md
    assert "| vllm_colocate | skipped: vLLM generates on GPUs" in md
    (out / "row-transformers.json").unlink()  # a row process that left no record: the row fails, the probe exits 1
    monkeypatch.setattr(grpo_probe.subprocess, "run", lambda cmd, **kw: subprocess.CompletedProcess(cmd, 1, "", "boom\n"))
    assert grpo_probe.main(["--cpu-smoke", "--steps", "1", "--out", str(out)]) == 1
    assert "| transformers | failed: boom |" in (out / "grpo-probe.md").read_text()

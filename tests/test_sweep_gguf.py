"""The compatibility sweep's GGUF column (`make sweep-gguf`: bench/sweep.py --gguf, bench/sweep_gguf.py) on
architectures whose outcome differs: each tiny model built by the sweep's own worker (`--gguf-one`, the real
`export --to gguf --quant f32 --verify` in a child process), and the table written from those rows. The tiny Llama
converts and verifies in llama.cpp with its logit error; the tiny Mistral converts and fails --verify, its error figure
read from the export's one line (llama.cpp 0.3.36 leaves Mistral's sliding window of 32 tokens out, and the probe rows
are longer); xLSTM is named as having no class in the converter's registry; the column and its headline count them, and
a row's own result is the same whatever its GGUF cell says."""

import json
import sys

from conftest import ROOT, run_cli

from sftrecipes.export.gguf_verify import tolerance
from sftrecipes.facts import llamacpp

sys.path.insert(0, str(ROOT / "bench"))
import sweep  # noqa: E402 - bench/ put on the path first


def gguf_row(arch: str, tmp_path) -> dict:
    res = run_cli(["bench/sweep.py", "--gguf-one", arch, "--work", str(tmp_path / arch)], timeout=300)
    said = [x for x in res.stdout.splitlines() if x.startswith("SWEEP ")]
    assert res.returncode == 0 and said, res.stderr[-3000:]
    row = json.loads(said[-1][len("SWEEP "):])
    assert row.pop("arch") == arch and row["gguf_release"] == llamacpp.RELEASE
    return row


def test_the_gguf_column_from_real_exports(tiny_model, tmp_path, monkeypatch):
    llama, mistral, xlstm = (gguf_row(a, tmp_path) for a in ("llama", "mistral", "xlstm"))
    assert llama["gguf"] == "verified" and llama["gguf_class"] == "LlamaForCausalLM", llama
    assert 0 <= llama["gguf_error"] <= tolerance("f32")
    assert mistral["gguf"].startswith("logit mismatch: 2/2 rows tokenized alike, max logit error "), mistral
    assert mistral["gguf_error"] > tolerance("f32") and f"max logit error {mistral['gguf_error']:.2e} of scale" in mistral["gguf"]
    # named from the converter's registry (its CLI said only that the model is not supported)
    assert xlstm == {"gguf": "no converter class: llama.cpp's converter has none for xLSTMForCausalLM",
                     "gguf_class": "xLSTMForCausalLM", "gguf_release": llamacpp.RELEASE}, xlstm

    monkeypatch.setattr(sweep, "OUT", tmp_path / "architectures.md")
    monkeypatch.setattr(sweep, "ROWS", tmp_path / "architectures.json")
    one = {"result": "pass", "reason": "", "plan_exact": True, "two_ranks": {"zero3": "pass", "fsdp": "pass"},
           "commit": "abc1234", "two_ranks_commit": {"zero3": "abc1234", "fsdp": "abc1234"}}
    rows = [{**one, "arch": "llama", "class": "LlamaForCausalLM", **llama, "gguf_seconds": 20, "gguf_commit": "abc1234"},
            {**one, "arch": "xlstm", "class": "xLSTMForCausalLM", **xlstm, "gguf_seconds": 40, "gguf_commit": "abc1234"},
            {**one, "arch": "mistral", "class": "MistralForCausalLM", **mistral, "gguf_seconds": 60, "gguf_commit": "abc1234"},
            {**one, "arch": "qwen3", "class": "Qwen3ForCausalLM"},  # not exported yet
            {"arch": "t5", "result": "left out", "reason": "encoder-decoder model (not decoder-only)"}]
    sweep.write_table(rows, 600, 4)
    text = (tmp_path / "architectures.md").read_text()
    assert (f"**GGUF: 1 of 3 convert and verify in llama.cpp (llama-cpp-python {llamacpp.RELEASE})** (`export --to gguf "
            "--quant f32 --verify`, one at a time; 2 min of runs on this machine). Not verified: no converter class (1), "
            "logit mismatch (1). 1 passing in one process not run yet.") in text
    assert "GGUF: abc1234 (3)." in text
    assert "**4 of 4 decoder-only text architectures pass (100%)**" in text  # GGUF is a column, not part of "pass"
    table = {c[0]: c for c in (line[2:-2].split(" | ") for line in text.splitlines() if line.startswith("| "))}
    assert table["architecture"][7] == "GGUF"
    assert table["llama"][2] == "pass" and table["llama"][7] == f"verified ({llama['gguf_error']:.1e})"
    assert table["xlstm"][2] == "pass" and table["xlstm"][7] == xlstm["gguf"]
    assert table["mistral"][2] == "pass" and table["mistral"][7] == mistral["gguf"]
    assert table["qwen3"][2] == "pass" and table["qwen3"][7] == ""

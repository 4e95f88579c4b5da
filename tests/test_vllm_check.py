"""bench/vllm_check.py (the GPU check's vLLM step) without a GPU or vLLM: skipped with its reason where `vllm` is not
on PATH, and its whole path on CPU against a stand-in `vllm` (tests/fake_vllm.py: transformers' greedy decoding behind
vLLM's OpenAI endpoints), so the GPU run does not fail on code never executed."""

import json
import os
import sys
from pathlib import Path

from conftest import ROOT

sys.path.insert(0, str(ROOT / "bench"))
import vllm_check  # noqa: E402


def path_without_vllm() -> str:
    return os.pathsep.join(d for d in os.environ["PATH"].split(os.pathsep) if not (Path(d) / "vllm").exists())


def fake_vllm_on_path(tmp_path: Path) -> str:
    """A bin folder whose `vllm` is tests/fake_vllm.py, first on PATH."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "vllm").write_text(f'#!/bin/sh\nexec "{sys.executable}" "{ROOT / "tests" / "fake_vllm.py"}" "$@"\n')
    (bin_dir / "vllm").chmod(0o755)
    return f"{bin_dir}{os.pathsep}{path_without_vllm()}"


def test_skipped_with_its_reason_where_vllm_is_not_on_path(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("PATH", path_without_vllm())
    assert vllm_check.main(["--out", str(tmp_path / "out")]) == 0
    assert capsys.readouterr().out.strip() == (
        "vllm check: skipped: `vllm` is not on PATH (install it in an environment of its own: pip install "
        "'vllm>=0.19.1'; put its bin/ on PATH)")
    assert not (tmp_path / "out").exists()  # nothing trained, exported or written


def test_cpu_smoke_serves_the_adapter_and_the_export_and_compares_greedy_tokens(tiny_model, monkeypatch, tmp_path):
    """A LoRA adapter (random factors, so it changes the outputs) in a run folder with its tokenizer; the check exports
    it, serves it both ways with serve.py's arguments, and finds the stand-in's tokens identical to transformers'."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run = tmp_path / "run"
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(".assets/tiny-llama"),
                           LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"],
                                      init_lora_weights=False))
    model.save_pretrained(run)
    AutoTokenizer.from_pretrained(".assets/tiny-llama").save_pretrained(run)
    monkeypatch.setenv("PATH", fake_vllm_on_path(tmp_path))
    out = tmp_path / "out"
    assert vllm_check.main(["--cpu-smoke", "--run", str(run), "--out", str(out), "--prompts", "2",
                            "--max-new-tokens", "6"]) == 0
    report = json.loads((out / "vllm_check.json").read_text())
    assert report["vllm"] == "0.0.0+fake"
    lora, export = report["forms"]["lora"], report["forms"]["export"]
    for form in (lora, export):
        assert form["identical"] == form["prompts"] == 2 and form["tokens_agreeing"] == form["tokens"] > 0, form
    assert lora["served"] == [".assets/tiny-llama", "tiny-lora"] and export["served"] == ["tiny-lora"]
    argv = lora["argv"]
    assert argv[:3] == ["vllm", "serve", ".assets/tiny-llama"] and "--enable-lora" in argv
    assert argv[argv.index("--lora-modules") + 1] == f"tiny-lora={run}" and argv[argv.index("--max-lora-rank") + 1] == "8"
    assert export["argv"][2] == str(out / "tiny-lora-export")
    # the adapter changed the answers: the base's greedy tokens differ from the adapter's somewhere
    stops = vllm_check.stop_ids(run, ROOT / ".assets/tiny-llama")
    base = vllm_check.hf_greedy(ROOT / ".assets/tiny-llama", None, vllm_check.chat_prompts(run, 2), 6, stops, "cpu")
    assert [b[:-1] if b and b[-1] in stops else b for b in base] != [row["ref"] for row in lora["rows"]]

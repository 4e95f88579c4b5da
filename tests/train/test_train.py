"""Single-process training on CPU through train.run: LoRA, full, QLoRA 4-bit; save -> reload; resume."""

import json
import shutil
import shlex

import pytest
import torch
from safetensors.torch import load_file

import train
from conftest import ROOT, run_cli
from sftrecipes.recipe.load import load_recipe
from test_recipe import GUIDE_ZERO3

PROMPT = [{"role": "user", "content": "What is 7 plus 5?"}]


def logits_of(model, tok):
    ids = tok.apply_chat_template(PROMPT, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    model.eval()
    with torch.no_grad():
        return model(**ids).logits


def falls(summary):
    return summary["last_loss"] < summary["first_loss"] * 0.9


@pytest.fixture(scope="module")
def lora_run(tiny_model, tmp_path_factory):
    out = tmp_path_factory.mktemp("lora")
    trainer, summary = train.run(load_recipe(["recipes/tiny/lora.yaml", "--output_dir", str(out), "--max_steps", "30"]))
    return trainer, summary, out


def test_lora_loss_falls_and_adapter_saved(lora_run):
    trainer, summary, out = lora_run
    assert falls(summary), summary["losses"]
    assert summary["steps"] == 30
    saved = load_file(out / "adapter_model.safetensors")
    assert len(saved) == summary["saved_tensors"] == 2 * 7 * 2  # A and B for 7 linear modules x 2 layers
    assert all("lora_" in k for k in saved)
    assert json.loads((out / "run_summary.json").read_text())["last_loss"] == summary["last_loss"]
    # each phase's memory on the one rank: the four phases, in order, each peak at least its start and end
    (mem,) = summary["memory"]
    assert mem["exact"] and [k for k in mem if isinstance(mem[k], dict)] == ["loading", "wrapping", "first_steps", "later_steps"], mem
    assert all(mem[k]["peak_mb"] >= max(mem[k]["start_mb"], mem[k]["end_mb"]) for k in ("loading", "wrapping", "first_steps")), mem


def test_lora_reload_gives_identical_logits(lora_run):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    trainer, _, out = lora_run
    tok = AutoTokenizer.from_pretrained(out)
    trained = logits_of(trainer.model, tok)
    reloaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(".assets/tiny-llama"), out)
    assert torch.equal(trained, logits_of(reloaded, tok))
    base = logits_of(AutoModelForCausalLM.from_pretrained(".assets/tiny-llama"), tok)
    assert not torch.allclose(base, trained, atol=1e-3)  # the adapter changed something


def test_streaming_merge_equals_peft_merge(lora_run, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from sftrecipes.export import merge_lora

    _, _, out = lora_run
    merged_dir = merge_lora(out, tmp_path / "merged")
    tok = AutoTokenizer.from_pretrained(merged_dir)
    ours = AutoModelForCausalLM.from_pretrained(merged_dir)
    peft_merged = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(".assets/tiny-llama"), out).merge_and_unload()
    # the written tensors against peft's (a loaded model would hide a tensor the files lack behind a fresh init):
    # the same names (less a tied head, which save_pretrained leaves out too), then the same values
    written = {k: v for f in merged_dir.glob("*.safetensors") for k, v in load_file(f).items()}
    peft_sd = peft_merged.state_dict()
    tied = {"lm_head.weight"} if ours.config.tie_word_embeddings else set()
    assert set(written) == set(peft_sd) - tied, sorted(set(written) ^ (set(peft_sd) - tied))[:5]
    for n, a in written.items():
        torch.testing.assert_close(a, peft_sd[n], atol=1e-6, rtol=1e-6, msg=n)
    torch.testing.assert_close(logits_of(ours, tok), logits_of(peft_merged, tok), atol=1e-5, rtol=1e-5)
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id in ours.generation_config.eos_token_id
    assert not list(tmp_path.glob("merged.tmp-*"))  # the temporary folder was renamed, not left behind


def test_merge_bf16_output_and_bad_inputs(lora_run, tmp_path):
    from sftrecipes.export import merge_lora
    from sftrecipes.core.errors import RecipeError

    _, _, out = lora_run
    merged = merge_lora(out, tmp_path / "m16", dtype="bfloat16")
    assert {t.dtype for t in load_file(merged / "model.safetensors").values()} == {torch.bfloat16}
    assert json.loads((merged / "config.json").read_text())["dtype"] == "bfloat16"
    with pytest.raises(RecipeError, match="no adapter_config.json"):
        merge_lora(tmp_path, tmp_path / "x")
    assert not (tmp_path / "x").exists()


def test_full_fine_tune_loss_falls_and_reloads_identically(tiny_model, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    trainer, summary = train.run(load_recipe(["recipes/tiny/full.yaml", "--output_dir", str(tmp_path), "--max_steps", "20"]))
    assert falls(summary), summary["losses"]
    assert summary["saved_tensors"] == 21  # every weight of the tiny Llama
    tok = AutoTokenizer.from_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert torch.equal(logits_of(trainer.model, tok), logits_of(reloaded, tok))
    assert reloaded.config.use_cache is True


def test_qlora_4bit_on_cpu(tiny_model, tmp_path):
    import bitsandbytes as bnb

    # no end-of-run sample: bitsandbytes' CPU inference kernels repack the 4-bit weights, and this test reads them
    trainer, summary = train.run(load_recipe(["recipes/tiny/qlora.yaml", "--output_dir", str(tmp_path), "--max_steps", "15",
                                              "--sample_max_new_tokens", "0"]))
    model = trainer.model
    four_bit = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert len(four_bit) == 14
    w = four_bit[0].weight
    assert w.quant_state.quant_type == "nf4" and w.quant_state.nested and w.dtype == torch.bfloat16  # quant storage
    assert four_bit[0].compute_dtype == torch.bfloat16
    assert falls(summary), summary["losses"]
    assert len(load_file(tmp_path / "adapter_model.safetensors")) == 28


def test_guide_command_line_runs_on_cpu(tiny_model, tmp_path, caplog):
    """The guide's GPU command line (bf16, flash-attn, eval each epoch, packing, reentrant-free checkpointing)
    runs as written on a CPU machine: the cpu target supplies use_cpu, flash-attn falls back to sft_varlen (packing)."""
    argv = shlex.split(GUIDE_ZERO3.replace("--push_to_hub", "").replace("outputs/guide", str(tmp_path)))
    recipe = load_recipe(argv + ["--max_steps", "3", "--max_seq_len", "256", "--save_strategy", "no"])
    with caplog.at_level("WARNING", logger="sftrecipes"):
        trainer, summary = train.run(recipe)
    assert trainer.args.use_cpu and trainer.args.bf16
    assert trainer.args.activation_checkpointing and trainer.args.activation_checkpointing_kwargs == {"use_reentrant": False}
    assert trainer.model.base_model.model.config._attn_implementation == summary["attention"] == "sft_varlen"
    assert sum("falling back to sft_varlen" in r.getMessage() for r in caplog.records) == 1
    assert any("eval_loss" in e for e in trainer.state.log_history)  # eval_strategy epoch with the test split
    assert summary["steps"] == 3


def test_a_run_that_logs_no_step_still_reports_its_loss(tiny_model, tmp_path, caplog):
    """logging_steps 5 over a 2-step run logs no step: the last line says so and gives the train_loss transformers
    computed at the end (the mean over the steps trained), not `loss None -> None`."""
    import math
    import re

    recipe = load_recipe(["recipes/tiny/lora.yaml", "--output_dir", str(tmp_path), "--max_steps", "2", "--logging_steps", "5",
                          "--sample_max_new_tokens", "0"])
    with caplog.at_level("INFO", logger="sftrecipes"):
        trainer, summary = train.run(recipe)
    assert summary["steps"] == 2 and summary["losses"] == [] and summary["last_loss"] is None
    loss = summary["train_loss"]
    assert loss == trainer.state.log_history[-1]["train_loss"] == json.loads((tmp_path / "run_summary.json").read_text())["train_loss"]
    assert abs(loss - math.log(trainer.model.config.vocab_size)) < 1.5  # two LoRA steps on a random-init model: ~ln(vocab)
    done = [r.getMessage() for r in caplog.records if r.getMessage().startswith("done: ")]
    assert len(done) == 1 and re.fullmatch(
        rf"done: 2 steps in [\d.]+s, no loss logged \(logging_steps 5, 2 steps\), train_loss {re.escape(f'{loss:.4g}')} "
        rf"\(the trainer's mean over the steps trained\), {summary['saved_tensors']} tensors saved to {re.escape(str(tmp_path))}", done[0]), done
    # the other two cases of the line, from the same function
    assert train.loss_words([2.5, 1.25], 1.75, 1, 2) == "loss 2.5 -> 1.25, train_loss 1.75 (the trainer's mean over the steps trained)"
    assert train.loss_words([], None, 5, 12) == "no step trained in this run, no loss logged"


def test_resume_auto_continues_to_the_same_weights(tiny_model, tmp_path):
    common = ["recipes/tiny/lora.yaml", "--max_steps", "12", "--save_strategy", "steps", "--save_steps", "6",
              "--lr_scheduler_type", "linear"]
    straight = tmp_path / "straight"
    train.run(load_recipe(common + ["--output_dir", str(straight)]))
    # an interrupted run: it got as far as checkpoint-6, then died
    broken = tmp_path / "broken"
    shutil.copytree(straight / "checkpoint-6", broken / "checkpoint-6")
    (broken / "checkpoint-12").mkdir()  # a checkpoint that never completed: auto must skip it
    _, summary = train.run(load_recipe(common + ["--output_dir", str(broken), "--resume_from_checkpoint", "auto"]))
    assert summary["resumed_from"] == str(broken / "checkpoint-6")
    assert summary["steps"] == 12
    a = load_file(straight / "adapter_model.safetensors")
    b = load_file(broken / "adapter_model.safetensors")
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-6, rtol=0, msg=k)


def test_resume_auto_without_checkpoint_starts_fresh(tiny_model, tmp_path):
    _, summary = train.run(load_recipe(["recipes/tiny/lora.yaml", "--output_dir", str(tmp_path), "--max_steps", "2",
                                        "--resume_from_checkpoint", "auto"]))
    assert summary["resumed_from"] is None and summary["steps"] == 2


def test_8bit_lora_on_cpu(tiny_model, tmp_path):
    import bitsandbytes as bnb

    trainer, summary = train.run(load_recipe(["recipes/tiny/lora.yaml", "--use_8bit_quantization", "True",
                                              "--output_dir", str(tmp_path), "--max_steps", "4", "--logging_steps", "1"]))
    assert len([m for m in trainer.model.modules() if isinstance(m, bnb.nn.Linear8bitLt)]) == 14
    assert summary["last_loss"] < summary["first_loss"]


def test_checkpoints_are_marked_complete_and_torn_ones_never_load(tiny_model, tmp_path):
    from sftrecipes.run import checkpoints as ck
    from sftrecipes.core.errors import RecipeError

    train.run(load_recipe(["recipes/tiny/lora.yaml", "--output_dir", str(tmp_path), "--max_steps", "6", "--save_strategy",
                           "steps", "--save_steps", "2", "--save_total_limit", "2", "--sample_max_new_tokens", "0"]))
    kept = [p.name for _, p in ck.checkpoints(tmp_path)]
    assert kept == ["checkpoint-4", "checkpoint-6"]  # retention after marking
    assert all(ck.is_complete(tmp_path / k) for k in kept)
    marker = json.loads((tmp_path / "checkpoint-6" / ck.MARKER).read_text())
    assert "adapter_model.safetensors" in marker["files"] and "trainer_state.json" in marker["files"]
    # a truncated shard: detected, skipped by auto, refused when named
    shard = tmp_path / "checkpoint-6" / "adapter_model.safetensors"
    shard.write_bytes(shard.read_bytes()[:100])
    assert "adapter_model.safetensors has 100 bytes" in ck.torn(tmp_path / "checkpoint-6")
    assert ck.latest_checkpoint(tmp_path) == tmp_path / "checkpoint-4"
    with pytest.raises(RecipeError, match="not a complete checkpoint"):
        ck.resolve_resume(str(tmp_path / "checkpoint-6"), str(tmp_path))
    # a deleted file
    (tmp_path / "checkpoint-4" / "optimizer.pt").unlink()
    assert ck.torn(tmp_path / "checkpoint-4") == "optimizer.pt is missing"
    assert ck.latest_checkpoint(tmp_path) is None
    # retention never removes the newest complete checkpoint, even when newer torn ones exist
    for step in (8, 10):
        d = tmp_path / f"checkpoint-{step}"
        d.mkdir()
        (d / "trainer_state.json").write_text("{}")
    ck.write_marker(tmp_path / "checkpoint-8")
    assert ck.rotate(tmp_path, 1) == []  # checkpoint-8 is the only complete one; 10 is torn: both stay
    assert (tmp_path / "checkpoint-8").is_dir() and (tmp_path / "checkpoint-10").is_dir()


@pytest.mark.parametrize("patience", [0, 1])
def test_nonfinite_loss_stops_the_run_and_keeps_the_last_good_checkpoint(tiny_model, tmp_path, monkeypatch, patience):
    import trl

    from sftrecipes.run.checkpoints import TrainingStopped

    compute = trl.SFTTrainer.compute_loss
    calls = {"n": 0}

    def poisoned(self, *a, **kw):  # the loss turns NaN from the 5th micro-step on
        calls["n"] += 1
        out = compute(self, *a, **kw)
        if calls["n"] < 5:
            return out
        return (out[0] * float("nan"), *out[1:]) if isinstance(out, tuple) else out * float("nan")

    monkeypatch.setattr(trl.SFTTrainer, "compute_loss", poisoned)
    argv = ["recipes/tiny/lora.yaml", "--output_dir", str(tmp_path), "--max_steps", "10", "--logging_steps", "1",
            "--save_strategy", "steps", "--save_steps", "2", "--sample_max_new_tokens", "0", "--nan_patience", str(patience)]
    with pytest.raises(TrainingStopped) as e:
        train.run(load_recipe(argv))
    msg = str(e.value)
    # transformers hides NaN losses from the log (logging_nan_inf_filter); the gradient norm gives it away
    assert f"grad_norm is nan at step {5 + patience}" in msg and "checkpoint-4" in msg and "\n" not in msg, msg
    assert not (tmp_path / "adapter_model.safetensors").exists()  # no final save of a poisoned model
    # step 6 would have saved, but its log was already NaN (with patience 1 the run went on to step 6)
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4"]


def test_hub_token_never_written_and_offline_push_keeps_local_result(tiny_model, tmp_path):
    """push_to_hub with the hub unreachable (HF_HUB_OFFLINE=1 here): the run trains and saves locally and says
    what to run later; the token appears in no output: not stdout/stderr, not any file written (training_args.bin
    pickles the arguments)."""
    secret = "hf_NOTREALtokenForTests0123456789"
    out = tmp_path / "run"
    res = run_cli(["train.py", "recipes/tiny/lora.yaml", "--output_dir", str(out), "--max_steps", "2", "--save_strategy",
                   "steps", "--save_steps", "2", "--push_to_hub", "--hub_token", secret, "--hub_private_repo", "True",
                   "--report_to", "tensorboard", "--sample_max_new_tokens", "0"])
    assert res.returncode == 0, res.stderr[-3000:]
    assert secret not in res.stdout + res.stderr
    written = [p for p in out.rglob("*") if p.is_file()]
    assert any(p.name == "training_args.bin" for p in written) and any("events.out.tfevents" in p.name for p in written)
    for p in written:
        assert secret.encode() not in p.read_bytes(), p
    summary = json.loads((out / "run_summary.json").read_text())
    assert summary["push_later"] == f"hf upload run {out} --private"
    assert "push later with: hf upload run" in res.stderr
    assert (out / "adapter_model.safetensors").is_file()


def test_trust_remote_code_is_off_unless_set_and_said(tiny_model, tmp_path, caplog, monkeypatch):
    from transformers import AutoModelForCausalLM

    seen = []
    load = AutoModelForCausalLM.from_pretrained.__func__

    def spy(cls, *a, **kw):
        seen.append(kw.get("trust_remote_code"))
        return load(cls, *a, **kw)

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", classmethod(spy))
    common = ["recipes/tiny/lora.yaml", "--max_steps", "1", "--sample_max_new_tokens", "0"]
    with caplog.at_level("WARNING", logger="sftrecipes"):
        train.run(load_recipe(common + ["--output_dir", str(tmp_path / "off")]))
        assert seen == [False] and not any("trust_remote_code" in r.message for r in caplog.records)
        train.run(load_recipe(common + ["--output_dir", str(tmp_path / "on"), "--trust_remote_code", "True"]))
    assert seen == [False, True]
    assert any("trust_remote_code: on" in r.message for r in caplog.records)


@pytest.mark.parametrize("hardware, installed, names", [("cpu", True, "launch.hardware: gpu"),
                                                          ("gpu", False, "pip install -r requirements-gpu.txt")])
def test_liger_is_refused_without_a_gpu_or_its_package(tmp_path, capsys, hardware, installed, names):
    """use_liger_kernel (Triton kernels) on the cpu target, or on a GPU without liger-kernel: exit 2 with one line
    naming the key and the fix, before any model is loaded or anything written (transformers would fail only at
    trainer construction, after the load)."""
    from unittest import mock

    from sftrecipes.model import load as models
    from sftrecipes.launch import preflight

    out = tmp_path / "out"
    argv = ["recipes/tiny/lora.yaml", "--use_liger_kernel", "true", "--launch.hardware", hardware, "--max_steps", "1",
            "--output_dir", str(out)]
    with mock.patch.object(preflight, "liger_installed", return_value=installed), \
         mock.patch.object(models, "load_model", side_effect=AssertionError("model loaded")):
        assert train.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: use_liger_kernel:") and names in err, err
    assert not out.exists() or not any(p.suffix in (".safetensors", ".json") for p in out.rglob("*"))


def test_packing_under_sdpa_on_a_gpu_is_warned(caplog):
    """Measured on an H200 (docs/benchmarks.md, GPU): packed rows under sdpa attend through a dense mask, 2-3x slower
    per token. A GPU recipe that asks for flash-attn but lacks it falls back to sft_varlen (no mask, no warning about
    one); sdpa chosen for packed rows on a GPU is warned, on a CPU or unpacked it is not."""
    from unittest import mock

    from sftrecipes.model import attnchoice

    def warned(*flags, hardware="gpu"):
        caplog.clear()
        with caplog.at_level("WARNING", logger="sftrecipes"), mock.patch.object(attnchoice, "flash_attn_installed", return_value=False):
            impl = attnchoice.attn_implementation(load_recipe(["recipes/tiny/lora.yaml", *flags]), hardware)
        return impl, any("dense block-diagonal mask" in r.getMessage() for r in caplog.records)

    assert warned("--use_flash_attn", "true", "--packing", "true") == ("sft_varlen", False)
    assert warned("--use_flash_attn", "true", "--packing", "false") == ("sdpa", False)
    assert warned("--attn_implementation", "sdpa", "--packing", "true") == ("sdpa", True)
    assert warned("--attn_implementation", "sdpa", "--packing", "true", hardware="cpu") == ("sdpa", False)


def test_packing_under_sdpa_on_a_gpu_pads_to_a_bounded_set_of_shapes():
    """Measured on an H200: padding the flattened packed batch to a multiple of 256 let cuDNN reuse its attention
    graphs (+44% tokens/s, 1B). Only on a GPU, only with sdpa and packing, never over the recipe's own value; not
    under sft_varlen (auto's choice for packing without flash-attn), where each pad token would be a segment."""
    from unittest import mock

    from sftrecipes.train import args as backends
    from sftrecipes.model import attnchoice
    from sftrecipes.model.attnchoice import SDPA_PACKED_PAD

    def pad(*flags, target="gpu", flash=False):
        with mock.patch.object(attnchoice, "flash_attn_installed", return_value=flash):
            return backends.training_kwargs(load_recipe(["recipes/tiny/lora.yaml", *flags]), target).get("pad_to_multiple_of")

    sdpa = ("--attn_implementation", "sdpa")
    assert pad("--packing", "true", *sdpa) == SDPA_PACKED_PAD == 256
    assert pad("--packing", "true") is None  # auto: sft_varlen
    assert pad("--packing", "true", "--use_flash_attn", "true") is None  # asked for, flash-attn missing: sft_varlen
    assert pad("--packing", "true", "--use_flash_attn", "true", "--bf16", "true", flash=True) is None  # varlen kernels: no mask
    assert pad("--packing", "false", *sdpa) is None
    assert pad("--packing", "true", *sdpa, target="cpu") is None
    assert pad("--packing", "true", *sdpa, "--pad_to_multiple_of", "64") == 64


def _files(folder):
    """Every file under folder with its size and modification time."""
    return {p: (p.stat().st_size, p.stat().st_mtime_ns) for p in folder.rglob("*") if p.is_file()}


def test_evaluation_only_trains_nothing_and_summaries_hold_eval_loss(tiny_model, tmp_path):
    """Issue 37. A training run evaluating at its start and every 2 steps records each evaluation and the last one in
    run_summary.json (eval_loss, perplexity = exp(eval_loss)). do_train: false on its adapter, in its own finished
    output_dir with resume_from_checkpoint: auto, evaluates the adapter on its base: the same eval_loss the run measured
    at its last step, only <output_dir>/eval/run_summary.json written (no merged copy, no checkpoint, the training's
    files and finished marker untouched), the log's last line naming the adapter and the metric. max_steps: 0 with
    eval_on_start (the user's command) on the base model trains no step: the run's step-0 evaluation, one file written."""
    import math

    from sftrecipes.run.checkpoints import FINAL, torn

    common = ["recipes/tiny/lora.yaml", "--max_seq_len", "128", "--sample_max_new_tokens", "0",
              "--per_device_eval_batch_size", "8", "--resume_from_checkpoint", "auto"]
    out = tmp_path / "run"
    res = run_cli(["train.py", *common, "--output_dir", str(out), "--max_steps", "4", "--eval_strategy", "steps",
                   "--eval_steps", "2", "--eval_on_start", "true"])
    assert res.returncode == 0, res.stderr[-3000:]
    evals = json.loads((out / "run_summary.json").read_text())["eval"]
    assert [e["step"] for e in evals["history"]] == [0, 2, 4] and evals["last"] == evals["history"][-1]
    assert all(e["perplexity"] == pytest.approx(math.exp(e["eval_loss"])) for e in evals["history"])
    assert "last eval (step 4): eval_loss" in res.stderr
    before = _files(tmp_path)

    # prepare on the evaluation's recipe: what the evaluation reads (its eval split), no adapter merged into a copy of
    # its base, nothing cached (the run prepares its eval rows itself): nothing written at all
    evaluation = [*common, "--model_name_or_path", str(out), "--output_dir", str(out), "--do_train", "false", "--do_eval", "true"]
    res = run_cli(["-m", "sftrecipes", "prepare", *evaluation, "--data_cache_dir", str(tmp_path / "cache")])
    assert res.returncode == 0, res.stderr[-3000:]
    assert "prepare: do_train: false: evaluation only: dataset_name data/tiny_chat (test): 40 read, 40 kept" in res.stdout
    assert "train split" not in res.stderr and _files(tmp_path) == before

    res = run_cli(["train.py", *evaluation])
    assert res.returncode == 0, res.stderr[-3000:]
    summary = json.loads((out / "eval" / "run_summary.json").read_text())
    assert summary["evaluation_only"] and summary["adapter"] == str(out) and summary["base"] == ".assets/tiny-llama"
    assert summary["eval"]["eval_loss"] == pytest.approx(evals["last"]["eval_loss"], rel=1e-5)
    assert summary["eval"]["perplexity"] == pytest.approx(math.exp(summary["eval"]["eval_loss"]))
    last = res.stderr.strip().splitlines()[-1]
    assert f"evaluated: the adapter {out} on its base .assets/tiny-llama on dataset_name" in last and "eval_loss" in last
    after = _files(tmp_path)
    assert set(after) - set(before) == {out / "eval" / "run_summary.json"}
    assert {p: after[p] for p in before} == before  # nothing else written, nothing rewritten
    assert torn(out, FINAL) is None  # the training run is still finished, and was not marked again

    base_eval = tmp_path / "base"
    res = run_cli(["train.py", *common, "--output_dir", str(base_eval), "--max_steps", "0", "--eval_on_start", "true"])
    assert res.returncode == 0, res.stderr[-3000:]
    assert [p.name for p in base_eval.iterdir()] == ["run_summary.json"]
    summary = json.loads((base_eval / "run_summary.json").read_text())
    assert summary["why"] == "max_steps: 0" and "steps" not in summary
    assert summary["eval"]["eval_loss"] == pytest.approx(evals["history"][0]["eval_loss"], rel=1e-5)


def test_evaluation_only_under_zero2_runs_data_parallel_without_deepspeeds_engine(tiny_model, tmp_path):
    """Issue 37. ZeRO-1/2 partition no weights, and transformers evaluates under DeepSpeed only with ZeRO-3: the
    ZeRO-2 twin's evaluation through its launcher (2 ranks, 8 eval rows, one eval batch of 2 rows per rank and step)
    runs without DeepSpeed's engine, data-parallel (accelerate's MULTI_CPU over 2 processes), says so in one line, and
    measures the eval_loss of the same recipe evaluated in one process. Pre-flight printed the training plan as an
    upper bound of the evaluation's memory, not refused on; the launch's accelerate config went beside the summary."""
    from conftest import free_port, launch_twin

    data = tmp_path / "d"
    data.mkdir()
    (data / "test.jsonl").write_text("".join((ROOT / "data/tiny_chat/test.jsonl").read_text().splitlines(keepends=True)[:8]))
    flags = ["--do_train", "false", "--dataset_name", str(data), "--splits", "test", "--eval_packing", "false",
             "--per_device_eval_batch_size", "2"]
    out = tmp_path / "zero2"
    summary, log = launch_twin("zero2", out, flags, env={"MAIN_PROCESS_PORT": str(free_port())})
    assert summary["evaluation_only"] and (summary["processes"], summary["distributed_type"]) == (2, "MULTI_CPU")
    assert log.count("launch.zero_stage: 2: evaluated without DeepSpeed's engine, data-parallel as under DDP") == 1
    assert "EVALUATION ONLY: do_train: false: no evaluation is planned here" in log
    assert sorted(p.name for p in out.iterdir()) == ["accelerate_config.yaml", "run_summary.json"]
    one = tmp_path / "one"
    res = run_cli(["train.py", "recipes/tiny/zero2.yaml", "--launch.gpus_per_node", "1", "--output_dir", str(one), *flags])
    assert res.returncode == 0, res.stderr[-3000:]
    reference = json.loads((one / "run_summary.json").read_text())
    assert reference["processes"] == 1 and summary["data"]["eval"]["kept"] == reference["data"]["eval"]["kept"] == 8
    assert summary["eval"]["eval_loss"] == pytest.approx(reference["eval"]["eval_loss"], rel=1e-6)


def test_a_signal_interrupts_an_evaluation_only_run_without_a_preemption_record(tiny_model, tmp_path):
    """Issue 37. An evaluation has no checkpoint to resume: SIGTERM during an evaluation-only run ends it with one line
    saying it was interrupted and to run it again, exit 75 (a requeue runs it again), no preempted.json, nothing
    written. Under `launch` (supervised) the rank exits 0 and leaves its line for launch, which exits 75 with it."""
    import os
    import signal
    import subprocess
    import sys

    from sftrecipes.run import lifecycle
    from sftrecipes.launch.supervise import outcome

    notes = tmp_path / "notes"
    notes.mkdir()
    for supervised in (False, True):
        out = tmp_path / f"ev-{supervised}"
        env = {**os.environ, **({lifecycle.SUPERVISED_ENV: "1", lifecycle.REFUSED_ENV: str(notes)} if supervised else {})}
        proc = subprocess.Popen([sys.executable, "train.py", "recipes/tiny/lora.yaml", "--do_train", "false", "--output_dir",
                                 str(out)], cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True)
        for line in proc.stderr:  # the evaluation has begun (tokenizer, data, model and evaluate still to come)
            if "evaluation only" in line:
                proc.send_signal(signal.SIGTERM)
                break
        rest = proc.stderr.read()
        assert proc.wait(timeout=120) == (0 if supervised else 75), rest[-3000:]
        assert "evaluation interrupted by SIGTERM before it finished: nothing was written" in rest.strip().splitlines()[-1]
        assert not (out / lifecycle.PREEMPTED).exists() and not (out / "run_summary.json").exists()
    noted = lifecycle.refusals(notes, "interrupted")
    assert len(noted) == 1 and "run it again" in noted[0]
    assert outcome(0, asked=True, preempted=None, refused=[], ranks=1, interrupted=noted) == (75, noted[0])

"""Preference tuning for real: DPO, KTO, ORPO and CPO (SimPO) from the tiny recipes learn the shipped preference sets
as a bare TRL script does, and a tiny twin recipe with only `method` and the data changed trains on every backend on 2
ranks."""

import json
import math
import shutil

import pytest
import torch

import train
from conftest import free_port, launch_twin
from sftrecipes.train.metrics import save_plot
from sftrecipes.recipe.load import load_recipe
from test_twins import BASE_OF, TWINS, assert_loadable


def rises(rows, key):
    """The metric's mean over the last two logged steps is above that of the first two."""
    values = [r[key] for r in rows]
    assert len(values) >= 4, rows
    return sum(values[-2:]) / 2 > sum(values[:2]) / 2


# the data each method's tiny recipe trains on (orpo and cpo read dpo's pairs)
DATA = {"dpo": "data/tiny_dpo", "kto": "data/tiny_kto", "orpo": "data/tiny_dpo", "cpo": "data/tiny_dpo"}
# the method's own keys a tiny recipe sets, given to the bare trainer as they are
METHOD_KEYS = ("beta", "loss_type", "simpo_gamma", "cpo_alpha")


def bare_trl(method, out, steps, data, keys):
    """TRL's own trainer (trl's, or trl.experimental's for orpo and cpo) on the same rows, model, template (the run's
    saved tokenizer) and settings: LoRA on every linear layer, r 8, the same batch, learning rate and seed, and the
    method's keys the recipe set."""
    import importlib

    from datasets import load_dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer

    module = importlib.import_module({"orpo": "trl.experimental.orpo", "cpo": "trl.experimental.cpo"}.get(method, "trl"))
    Config, Trainer = (getattr(module, f"{method.upper()}{kind}") for kind in ("Config", "Trainer"))
    tok = AutoTokenizer.from_pretrained(out)
    args = Config(output_dir=str(out / "bare"), max_steps=steps, per_device_train_batch_size=8, learning_rate=5e-3,
                  lr_scheduler_type="constant", logging_steps=5, seed=42, report_to="none", use_cpu=True,
                  save_strategy="no", max_length=256, **keys)
    trainer = Trainer(model=AutoModelForCausalLM.from_pretrained(".assets/tiny-llama"), args=args, processing_class=tok,
                      train_dataset=load_dataset("json", data_files=f"{data}/train.jsonl", split="train"),
                      peft_config=LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules="all-linear",
                                             task_type="CAUSAL_LM"))
    trainer.train()
    return [e for e in trainer.state.log_history if "loss" in e and "rewards/margins" in e]


@pytest.mark.parametrize("method", ["dpo", "kto", "orpo", "cpo"])
def test_preference_run_learns_as_bare_trl_does(tiny_model, tmp_path, method):
    """Over 30 steps the reward margin rises in train.py's run and in a bare TRL run of the same data; for the paired
    methods the chosen-over-rejected accuracy too. The run reports them per logging step in run_summary.json (orpo
    and cpo also their NLL term, orpo its log odds), with the data counts TRL's tokenizing gave and a reply sampled
    from the trained adapter."""
    out = tmp_path / method
    data = DATA[method]
    recipe = load_recipe([f"recipes/tiny/{method}.yaml", "--output_dir", str(out), "--max_steps", "30"])
    keys = {k: recipe.trl[k] for k in METHOD_KEYS if k in recipe.trl}
    trainer, summary = train.run(recipe)
    rows = summary["preference"]
    assert summary["method"] == method and [r["step"] for r in rows] == [5, 10, 15, 20, 25, 30]
    assert rises(rows, "rewards/margins"), rows
    if method != "kto":
        assert rises(rows, "rewards/accuracies"), rows
    if method in ("orpo", "cpo"):
        assert all(math.isfinite(r["nll_loss"]) for r in rows) and ("log_odds_ratio" in rows[0]) == (method == "orpo"), rows
    stored = json.loads((out / "run_summary.json").read_text())
    assert stored["preference"] == rows
    # the end-of-run plot: the rewards panel (and the accuracy axis where the method logs it) beside loss and speed
    labels = save_plot(tmp_path / "plot.png", trainer.state.log_history, [])
    assert labels == ["training loss", "reward (chosen, rejected, margin)", "real tokens/s/device",
                      *(["accuracy (chosen over rejected)"] if "rewards/accuracies" in rows[0] else [])]
    assert (out / "metrics.png").stat().st_size > 0
    assert "reward (chosen, rejected, margin)" not in save_plot(tmp_path / "sft.png", [{"step": 1, "loss": 1.0}], [])
    assert stored["data"]["train"]["kept"] == 200 and stored["data"]["train"]["tokenized"]["rows"] == 200
    assert summary["sample"]["new_tokens"] > 0 and summary["adapter"]
    assert_loadable(out, summary)
    bare = bare_trl(method, out, 30, data, keys)
    assert rises(bare, "rewards/margins"), bare
    # both start from the same base and the same data: the first logged loss is within 5% of bare TRL's
    assert rows and bare and abs(summary["losses"][0] - bare[0]["loss"]) <= 0.05 * bare[0]["loss"], (summary["losses"], bare)


def test_orpo_on_qlora_counts_its_tokens_and_samples_after_trls_bf16_cast(tiny_model, tmp_path):
    """ORPOTrainer passes the ids to the model positionally: the throughput still counts each step's real tokens
    (every chosen and rejected sequence's). On a 4-bit model under bf16 it casts the LoRA layers, lm_head and
    embeddings to bf16 and keeps the norms fp32: the end-of-run sample generates under bf16 autocast, as TRL does."""
    trainer, summary = train.run(load_recipe(["recipes/tiny/qlora.yaml", "--method", "orpo", "--dataset_name", "data/tiny_dpo",
                                              "--output_dir", str(tmp_path / "out"), "--max_steps", "3"]))
    assert trainer._peft_has_been_casted_to_bf16 and summary["sample"]["new_tokens"] > 0
    lengths = [len(ids) for c in ("chosen", "rejected") for ids in trainer.train_dataset[f"{c}_input_ids"]]
    per_step = 2 * trainer.args.per_device_train_batch_size
    row = summary["throughput"]["ranks"][0]
    assert row["steps"] == 3 and 3 * per_step * min(lengths) <= row["real_tokens"] <= 3 * per_step * max(lengths), row


@pytest.fixture(scope="module")
def sft_adapter(tiny_model, tmp_path_factory):
    """An SFT run's output (recipes/tiny/lora.yaml, 4 steps): a LoRA adapter with the run's tokenizer."""
    sft = tmp_path_factory.mktemp("pipeline") / "sft"
    train.run(load_recipe(["recipes/tiny/lora.yaml", "--output_dir", str(sft), "--max_steps", "4",
                           "--sample_max_new_tokens", "0"]))
    return sft


def test_sft_then_dpo_from_its_adapter(sft_adapter, tmp_path, caplog):
    """The SFT -> DPO pipeline: the DPO recipe names the SFT run's output (its adapter) as model_name_or_path. The run
    merges the adapter into its base once, beside it (<adapter>-merged: the tensors `merge` makes), and trains from it
    with the SFT run's tokenizer and chat template: at step 1 the policy is its reference (the merged SFT model, the
    new adapter disabled), so the sigmoid loss is log 2; the new adapter's base is the merged folder, and it merges
    with --verify. A second run reuses the merge; a retrained adapter is merged again."""
    import logging

    from safetensors.torch import load_file, save_file

    from sftrecipes import cli

    sft = tmp_path / "sft"
    shutil.copytree(sft_adapter, sft, ignore=shutil.ignore_patterns("checkpoint-*"))
    merged = tmp_path / "sft-merged"
    dpo = ["recipes/tiny/dpo.yaml", "--model_name_or_path", str(sft), "--logging_steps", "1", "--sample_max_new_tokens", "0"]
    with caplog.at_level(logging.INFO, logger="sftrecipes"):
        _, summary = train.run(load_recipe([*dpo, "--output_dir", str(tmp_path / "dpo"), "--max_steps", "2"]))
    assert f"model: merging the LoRA adapter {sft} into its base .assets/tiny-llama -> {merged} (first run from it" in caplog.text
    assert summary["losses"][0] == pytest.approx(math.log(2), abs=1e-4), summary["losses"]
    adapter = json.loads((tmp_path / "dpo" / "adapter_config.json").read_text())
    assert adapter["base_model_name_or_path"] == str(merged)
    assert cli.main(["merge", str(sft), str(tmp_path / "by-hand")]) == 0
    a, b = load_file(merged / "model.safetensors"), load_file(tmp_path / "by-hand" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert cli.main(["merge", str(tmp_path / "dpo"), str(tmp_path / "dpo-merged"), "--verify"]) == 0

    caplog.clear()
    with caplog.at_level(logging.INFO, logger="sftrecipes"):
        train.run(load_recipe([*dpo, "--output_dir", str(tmp_path / "dpo-2"), "--max_steps", "1"]))
    assert "(reused: merged from this adapter before)" in caplog.text and "model: merging" not in caplog.text

    weights = load_file(sft / "adapter_model.safetensors")  # the SFT adapter trained further: another merge
    save_file({k: v * 2 if "lora_B" in k else v for k, v in weights.items()}, sft / "adapter_model.safetensors")
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="sftrecipes"):
        train.run(load_recipe([*dpo, "--output_dir", str(tmp_path / "dpo-3"), "--max_steps", "1"]))
    assert "(the adapter changed since the last merge;" in caplog.text
    again = load_file(merged / "model.safetensors")
    assert any(not torch.equal(a[k], again[k]) for k in a)
    assert not list(tmp_path.glob(".sft-merged.*")) and not (tmp_path / "sft-merged.lock").exists()


def test_a_dead_mergers_lock_is_taken_over(sft_adapter, tmp_path, caplog):
    """A merge killed midway leaves <adapter>-merged.lock naming a process that is gone: the next run takes the lock
    over, merges, and releases it."""
    import logging
    import socket
    import subprocess
    import sys

    from sftrecipes.export import startfrom

    sft = tmp_path / "sft"
    shutil.copytree(sft_adapter, sft, ignore=shutil.ignore_patterns("checkpoint-*"))
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (tmp_path / "sft-merged.lock").write_text(json.dumps({"host": socket.gethostname(), "pid": int(gone.stdout),
                                                          "token": "killed"}))
    with caplog.at_level(logging.INFO, logger="sftrecipes"):
        assert startfrom.ensure(str(sft)) == tmp_path / "sft-merged"
    assert f"model: taking over the merge of {sft} from host {socket.gethostname()} pid {int(gone.stdout)}" in caplog.text
    assert (tmp_path / "sft-merged" / "start_merge.json").is_file() and not (tmp_path / "sft-merged.lock").exists()


def test_a_live_merger_is_waited_for_under_a_short_heartbeat_timeout(sft_adapter, tmp_path, caplog, monkeypatch):
    """The merger's lock is kept alive by its heartbeat, which beats at heartbeat_timeout/10 (0.5 s at least): with
    heartbeat_timeout 1 s a second process waits for a merge that takes 3 s instead of taking a live merger's lock
    over; the merger's lock and heartbeat are gone once it is done."""
    import logging
    import threading
    import time

    from sftrecipes.export import startfrom

    sft = tmp_path / "sft"
    shutil.copytree(sft_adapter, sft, ignore=shutil.ignore_patterns("checkpoint-*"))
    merge = startfrom.merge_lora
    monkeypatch.setattr(startfrom, "merge_lora", lambda adapter, out: (time.sleep(3), merge(adapter, out)))
    got = []
    with caplog.at_level(logging.INFO, logger="sftrecipes"):
        first = threading.Thread(target=lambda: got.append(startfrom.ensure(str(sft), 1)))
        first.start()
        while not (tmp_path / "sft-merged.lock").exists():
            time.sleep(0.02)
        got.append(startfrom.ensure(str(sft), 1))
        first.join()
    assert got == [tmp_path / "sft-merged"] * 2
    assert "taking over" not in caplog.text and "(merged by another process, waited" in caplog.text, caplog.text
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sft", "sft-merged"]


def test_launch_merges_the_adapter_once_before_the_ranks_start(sft_adapter, tmp_path):
    """DPO from the SFT adapter on the ZeRO-3 twin, 2 ranks through its launcher: launch merges the adapter before
    any rank starts, the ranks train from the merged model (DPO's first loss log 2 in bf16)."""
    sft = tmp_path / "sft"
    shutil.copytree(sft_adapter, sft, ignore=shutil.ignore_patterns("checkpoint-*"))
    summary, log = launch_twin("zero3", tmp_path / "dpo", ["--method", "dpo", "--dataset_name", "data/tiny_dpo",
                                                           "--model_name_or_path", str(sft), "--max_steps", "2"],
                               env={"MAIN_PROCESS_PORT": str(free_port())})
    assert log.count("model: merging the LoRA adapter") == 1 and log.count("(reused: merged from this adapter before)") == 1
    assert log.index("model: merging the LoRA adapter") < log.index("launch: ")
    assert summary["losses"][0] == pytest.approx(math.log(2), abs=0.02), summary["losses"]
    assert json.loads((tmp_path / "dpo" / "adapter_config.json").read_text())["base_model_name_or_path"] == str(tmp_path / "sft-merged")


def test_prepare_merges_the_start_adapter_and_leaves_the_pairs_to_trl(sft_adapter, tmp_path, capsys):
    """`prepare` (the SLURM script's step before any rank starts) on a DPO recipe from an SFT adapter: it merges the
    adapter into its base, and says TRL tokenizes the pairs in the run (nothing cached; exit 0, so the script goes on)."""
    from sftrecipes import cli

    sft = tmp_path / "sft"
    shutil.copytree(sft_adapter, sft, ignore=shutil.ignore_patterns("checkpoint-*"))
    assert cli.main(["prepare", "recipes/tiny/dpo.yaml", "--model_name_or_path", str(sft),
                     "--data_cache_dir", str(tmp_path / "cache")]) == 0
    out = capsys.readouterr().out
    assert f"prepare: the start model: {sft} merged into its base in {tmp_path / 'sft-merged'}" in out
    assert "prepare: method dpo: TRL's DPOTrainer tokenizes the rows in the run itself" in out
    assert (tmp_path / "sft-merged" / "start_merge.json").is_file() and not (tmp_path / "cache").exists()


# (method, twin) -> the shipped twin whose backend it must show. A tiny SFT twin with the method and the data
# changed (DDP; FSDP2 full fine-tune, whose reference is a second copy sharded like the policy), and the
# twins of the shipped DPO recipes (ZeRO-3 with LoRA on Llama-3, QLoRA on FSDP2 on Qwen3), which set both themselves.
# orpo and cpo have no reference: their first loss is no constant. ORPO on FSDP2 trains every weight (nothing to
# compare against but the policy), CPO on ZeRO-3 with LoRA. DPO and KTO train on every 2-rank twin.
FIRST_LOSS = {"dpo": math.log(2), "kto": 0.5}
TWIN_RUNS = {("dpo", "ddp"): "ddp", ("dpo", "fsdp"): "fsdp", ("kto", "ddp"): "ddp", ("kto", "fsdp"): "fsdp",
             ("dpo", "llama3-dpo-zero3"): "llama3-zero3", ("dpo", "qwen3-dpo-qlora-fsdp"): "qwen3-qlora-fsdp",
             ("kto", "zero3"): "zero3", ("kto", "qlora-zero3"): "qlora-zero3",
             # the other 2-rank twins, each with both methods: ZeRO-1, ZeRO-2, ZeRO-3 with CPU offload, FSDP1, and
             # the QLoRA twin of the other backend
             **{(m, t): t for m in ("dpo", "kto") for t in ("zero1", "zero2", "offload", "fsdp1")},
             ("dpo", "qlora-zero3"): "qlora-zero3", ("kto", "qlora-fsdp"): "qlora-fsdp",
             ("orpo", "fsdp"): "fsdp", ("cpo", "zero3"): "zero3"}
RESUMED = [("dpo", "llama3-dpo-zero3"), ("dpo", "fsdp"), ("kto", "ddp"), ("kto", "qlora-zero3"),
           ("orpo", "fsdp")]  # from checkpoint-3: the same weights


def method_flags(method, name):
    changed = [] if "-dpo-" in name else ["--method", method, "--dataset_name", DATA[method]]
    return [*changed, "--save_strategy", "steps", "--save_steps", "3"]


@pytest.fixture(scope="module")
def method_runs(tiny_model, tmp_path_factory):
    """(method, twin) -> (output_dir, summary, log) of the twin launched once with the method and its data (6 steps,
    checkpoints at 3 and 6)."""
    root = tmp_path_factory.mktemp("methods")
    done = {}

    def get(method, name):
        if (method, name) not in done:
            out = root / f"{method}-{name}"
            done[method, name] = (out, *launch_twin(name, out, method_flags(method, name),
                                                    env={"MAIN_PROCESS_PORT": str(free_port())}))
        return done[method, name]

    return get


@pytest.mark.parametrize("method,name", list(TWIN_RUNS))
def test_twin_recipe_trains_with_method(method_runs, family_models, method, name):
    """A tiny twin with only the method and the data changed trains on its backend on 2 ranks, through its emitted
    launcher; the backend took effect; the SFT keys its bases set are listed as not used; the save loads."""
    out, summary, log = method_runs(method, name)
    shipped = TWIN_RUNS[method, name]
    want, b = TWINS[shipped], summary["backend"]
    assert b["world_size"] == 2 and b["distributed_type"] == want["distributed_type"], b
    if want["shard"] == "params":
        assert b["param_elements_local"] * 2 == pytest.approx(b["param_elements_full"], rel=0.02), b
    assert summary["method"] == method and len(summary["preference"]) == 6, summary["preference"]
    assert all(math.isfinite(r["rewards/margins"]) for r in summary["preference"])
    # at step 1 the policy is the reference, so DPO's sigmoid loss is log 2 and KTO's 0.5, up to bf16 rounding (the
    # twins compute in bf16: 0.6914); a reference that is not the initial model fails here (FSDP2's second rank built
    # its copy on the meta device and nothing broadcast into it: 0 with a NaN gradient, or 0.652)
    if method in FIRST_LOSS:
        assert summary["losses"][0] == pytest.approx(FIRST_LOSS[method], abs=0.02), summary["losses"]
    assert all(math.isfinite(x) for x in summary["losses"]), summary["losses"]
    # the throughput and precision tables, as an SFT run has them: every rank counted its pairs' tokens in every step,
    # and the optimizer states are fp32 under bf16 mixed precision on every backend
    ranks = summary["throughput"]["ranks"]
    assert len(ranks) == 2 and all(r["steps"] == 6 and r["real_tokens"] > 0 for r in ranks), ranks
    assert summary["precision"]["optimizer states"] == "float32", summary["precision"]
    if shipped == name:  # a base written for SFT: its SFT keys listed once as not used
        assert log.count(f"recipe: packing: true from _common.yaml is a key of SFTConfig; method {method} has none: not used") == 1
    copy = not summary["adapter"]
    said = ("reference model: none" if method not in FIRST_LOSS else
            "reference model: a second copy" if copy else "reference model: the adapter disabled")
    assert log.count(said) == 1, log[-3000:]
    base = family_models[BASE_OF[shipped]] if shipped in BASE_OF else ".assets/tiny-llama"
    assert_loadable(out, summary, base_dir=base, quantized="qlora" in name)


def weights(out, dest):
    """The run's final weights: its adapter, or its sharded save exported to `dest`."""
    from safetensors.torch import load_file

    from sftrecipes.export import export

    if (out / "adapter_model.safetensors").is_file():
        return load_file(out / "adapter_model.safetensors")
    return load_file(export(out, dest) / "model.safetensors")


@pytest.mark.parametrize("method,name", RESUMED)
def test_method_resumes_exactly_and_exports_verified(method_runs, tmp_path, method, name):
    """checkpoint-3 of the run, copied to a new folder and resumed (resume_from_checkpoint: auto), ends with the
    uninterrupted run's weights (optimizer, scheduler, data order and RNG restored under the method's trainer); the
    result exports (a merge for an adapter) with --verify."""
    from sftrecipes import cli

    out, summary, _ = method_runs(method, name)
    again = tmp_path / "again"
    again.mkdir()
    shutil.copytree(out / "checkpoint-3", again / "checkpoint-3")
    resumed, _ = launch_twin(name, again, [*method_flags(method, name), "--resume_from_checkpoint", "auto"],
                             env={"MAIN_PROCESS_PORT": str(free_port())})
    assert resumed["resumed_from"].endswith("checkpoint-3") and resumed["steps"] == 6
    a, b = weights(out, tmp_path / "straight-export"), weights(again, tmp_path / "again-export")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])][:5]
    verb = ["merge", str(again)] if summary["adapter"] else ["export", str(again)]
    assert cli.main([*verb, str(tmp_path / "exported"), "--verify"]) == 0

"""Exports from every backend's checkpoints, for real: each twin runs on 2 processes and saves checkpoint-3 (the
session's twin runs, conftest.twin_runs, or 3-step runs of variants);
its conversion must load with plain transformers/peft and hold exactly the trained fp32 values (checked against the
upstream converters: DeepSpeed's zero_to_fp32, torch's dcp_to_torch_save, peft's merge), or be within the dtype's
tolerance for 16-bit. Bad inputs (torn, missing, wrong base, unknown) are one-line errors that leave nothing behind."""

import hashlib
import json
import os
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file

from conftest import ROOT, accelerate_launch, free_port, launch_twin

from sftrecipes import export as ex
from sftrecipes.export.adapters import _peft_name
from sftrecipes.core.errors import RecipeError
from sftrecipes.model.load import DTYPES

STEPS = ["--max_steps", "3", "--save_strategy", "steps", "--save_steps", "3", "--sample_max_new_tokens", "0"]
IDS = torch.tensor([[1, 20, 30, 40, 50, 60, 70, 80]])
TWINS = {"ddp", "zero1", "offload", "fsdp", "fsdp1", "qlora-fsdp", "qlora-zero3"}  # read from conftest.twin_runs


@pytest.fixture(scope="module")
def runs(tiny_model, twin_runs, tmp_path_factory):
    """name -> output_dir of a run that holds checkpoint-3, launched on first use and shared by the module's tests: a
    shipped twin is the session's run of it (conftest.twin_runs: 6 steps, a checkpoint every 3); the others run 3 steps."""
    root = tmp_path_factory.mktemp("runs")
    done = {}

    def get(name):
        if name in done:
            return done[name]
        if name in TWINS:
            done[name] = twin_runs(name)[0]
            return done[name]
        out = root / name
        if name == "zero2-full":  # the shipped ZeRO-1/2 twins are LoRA: a full fine-tune on ZeRO-2 from the offload recipe
            recipe = root / "zero2-full.yaml"
            recipe.write_text(f"base: [{ROOT}/recipes/tiny/offload.yaml]\nlaunch:\n  zero_stage: 2\n  zero3_init: false\n"
                              "  offload_optimizer: false\n  offload_params: false\n")
            accelerate_launch(str(recipe), out, "train.py", STEPS)
        elif name == "zero3-driver":  # ZeRO-3 LoRA twin ending with merge_in_run
            accelerate_launch("recipes/tiny/zero3.yaml", out, "tests/zero3_merge_driver.py", STEPS,
                              accelerate_config=ROOT / "configs/tiny-zero3.yaml")
        elif name == "qlora":
            import train
            from sftrecipes.recipe.load import load_recipe

            train.run(load_recipe(["recipes/tiny/qlora.yaml", "--output_dir", str(out), "--max_steps", "5", "--sample_max_new_tokens", "0"]))
        else:  # +tokens: the zephyr template adds 3 tokens the tiny tokenizer lacks (as ChatML does to Llama-2)
            assert name.endswith("+tokens"), name
            launch_twin(name.removesuffix("+tokens"), out, STEPS + ["--chat_template_format", "zephyr"],
                        env={"MAIN_PROCESS_PORT": str(free_port())})
        done[name] = out
        return out

    return get


def tiny_logits(model):
    model.eval()
    with torch.no_grad():
        return model(input_ids=IDS).logits


def assert_manifest(folder):
    lines = (folder / ex.MANIFEST).read_text().splitlines()
    listed = {line.split("  ", 1)[1]: line.split("  ", 1)[0] for line in lines}
    assert set(listed) == {p.name for p in folder.iterdir()} - {ex.MANIFEST}
    for name, digest in listed.items():
        assert hashlib.sha256((folder / name).read_bytes()).hexdigest() == digest, name


def assert_equal_tensors(ours: dict, ref: dict):
    assert set(ours) == set(ref), set(ours) ^ set(ref)
    for k in ours:
        assert ours[k].dtype == ref[k].dtype == torch.float32 and torch.equal(ours[k], ref[k]), k


# -------------------------------------------------------------------------------------------- full-model checkpoints

@pytest.mark.parametrize("name", ["zero2-full", "offload", "fsdp1", "fsdp"])
def test_full_checkpoint_exports_exactly(runs, tmp_path, name, capsys, monkeypatch):
    """ZeRO-2 and ZeRO-3 (offload) full fine-tunes: the fp32 master weights, equal to zero_to_fp32's; FSDP1/FSDP2
    sharded checkpoints: equal to torch's DCP converter. verify=True compares logits and prints the difference. The
    progress bar (from 1 GiB; from 0 bytes here) counts every byte written."""
    from transformers import AutoModelForCausalLM

    from sftrecipes.export import rewrite

    monkeypatch.setattr(rewrite, "PROGRESS_BYTES", 0)
    ckpt = runs(name) / "checkpoint-3"
    out = ex.export(ckpt, tmp_path / "out", verify=True)
    said = capsys.readouterr()
    assert "verify: max abs logits difference 0 " in said.out
    written = sum((out / f).stat().st_size for f in os.listdir(out) if f.endswith(".safetensors"))
    bar = re.findall(r"export: writing out: 100%\|[^|]*\| ([\d.]+)k?/([\d.]+)k", said.err)
    assert bar and bar[-1][0] == bar[-1][1] and abs(float(bar[-1][1]) * 1024 - written) < 0.02 * written, (said.err[-500:], written)
    ours = load_file(out / "model.safetensors")
    if name.startswith("fsdp"):
        ref = ex.upstream_state_dict("dcp", ckpt / "pytorch_model_fsdp_0")
    else:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        ref = get_fp32_state_dict_from_zero_checkpoint(str(ckpt))  # 'latest' names the tag
    assert len(ours) == 21
    assert_equal_tensors(ours, {k: v.contiguous() for k, v in ref.items()})
    assert json.loads((out / "config.json").read_text())["dtype"] == "float32"
    assert_manifest(out)
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.dtype == torch.float32 and torch.isfinite(tiny_logits(model)).all()


def test_zero_export_in_bf16_within_tolerance(runs, tmp_path):
    from transformers import AutoModelForCausalLM

    ckpt = runs("zero2-full") / "checkpoint-3"
    fp32 = AutoModelForCausalLM.from_pretrained(ex.export(ckpt, tmp_path / "f32"))
    out = ex.export(ckpt, tmp_path / "b16", dtype="bfloat16", verify=True)
    assert {t.dtype for t in load_file(out / "model.safetensors").values()} == {torch.bfloat16}
    b16 = AutoModelForCausalLM.from_pretrained(out)
    assert b16.dtype == torch.bfloat16
    ref = tiny_logits(fp32)
    diff = (tiny_logits(b16.float()) - ref).abs().max().item()
    assert 0 < diff <= ex.LOGIT_TOL[torch.bfloat16] * ref.abs().max().item()


def test_export_writes_shards_and_index(runs, tmp_path):
    from transformers import AutoModelForCausalLM

    ckpt = runs("offload") / "checkpoint-3"
    out = ex.export(ckpt, tmp_path / "sharded", max_shard_bytes=100_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(files) > 3 and sorted(set(index["weight_map"].values())) == files
    # the files, not loaded models (from_pretrained fills a tensor the files lack with a fresh init): the same names,
    # then the same values
    sharded = {k: v for f in files for k, v in load_file(out / f).items()}
    whole = load_file(ex.export(ckpt, tmp_path / "one") / "model.safetensors")
    assert sharded.keys() == whole.keys() and set(index["weight_map"]) == set(whole)
    assert all(torch.equal(sharded[k], whole[k]) for k in whole)
    AutoModelForCausalLM.from_pretrained(out)  # the index is one transformers reads
    assert_manifest(out)


# ------------------------------------------------------------------------------------------------ LoRA checkpoints

@pytest.mark.parametrize("name", ["fsdp1", "fsdp"])
def test_fsdp_checkpoints_are_read_without_torch_load(runs, name):
    """The bounded-memory DCP reader (sftrecipes.export.dcp) reads the twins' two-rank checkpoints chunk by chunk straight
    into the output tensor — every tensor in two or more chunks — and equals torch's own DCP converter."""
    from unittest import mock

    from sftrecipes.export.dcp import DCPSource

    folder = runs(name) / "checkpoint-3" / "pytorch_model_fsdp_0"
    ref = ex.upstream_state_dict("dcp", folder)
    src = DCPSource(folder)
    assert sum(len(p) >= 2 for p in src.pieces.values()) >= 20  # really sharded across the ranks

    def refuse(*a, **k):
        raise AssertionError("torch.load was called")

    with mock.patch.object(torch, "load", refuse):
        ours = {n: src.get(n) for n in src.names()}
    assert_equal_tensors(ours, {k: v.contiguous() for k, v in ref.items()})


@pytest.mark.parametrize("name, kind", [("zero1", "zero"), ("qlora-fsdp", "dcp"), ("qlora-zero3", "zero")])
def test_lora_checkpoint_exports_an_adapter(runs, tmp_path, name, kind, capsys):
    """A LoRA checkpoint holds only adapter tensors: it becomes an adapter folder PeftModel loads, equal to the
    upstream-read fp32 values (ZeRO, QLoRA+ZeRO-3 too: fp32 masters; FSDP QLoRA: the bf16 adapter as saved)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    ckpt = runs(name) / "checkpoint-3"
    out = ex.export(ckpt, tmp_path / "adapter", verify=True)
    assert "verify: max abs logits difference 0 " in capsys.readouterr().out
    ours = load_file(out / "adapter_model.safetensors")
    folder = ckpt / "pytorch_model_fsdp_0" if kind == "dcp" else ckpt / "global_step3"
    ref = {_peft_name(k): v for k, v in ex.upstream_state_dict(kind, folder).items()}
    assert len(ours) == 28 and set(ours) == set(ref)
    assert all(torch.equal(ours[k], ref[k]) for k in ours)
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(".assets/tiny-llama"), out)
    loaded = {n: p for n, p in model.named_parameters() if "lora_" in n}
    assert len(loaded) == 28 and all(torch.equal(p.detach(), ours[_peft_name(n)].to(p.dtype)) for n, p in loaded.items())
    assert_manifest(out)
    merged = ex.export(out, tmp_path / "merged")  # the adapter folder exports again: merged into its base
    assert AutoModelForCausalLM.from_pretrained(merged).config.vocab_size == 512


@pytest.mark.parametrize("name", ["lora+tokens", "zero3+tokens", "qlora-fsdp+tokens"])
def test_added_tokens_train_save_and_export(runs, tmp_path, name, capsys):
    """A template whose tokens the tokenizer lacks (the shipped recipes: ChatML on Llama-2) resizes the embeddings
    and trains the new rows through peft's trainable tokens, also in the LM head, which TRL's fused head reads as a
    weight (compat.trainable_token_heads_for_trl). The final adapter holds the resized embeddings (under ZeRO-3 they
    are gathered in: finalsave.add_resized_embeddings_under_zero3), every new row moved from its init, and both the
    final save and the checkpoint export and merge into a base of the new size, verified against the source."""
    from transformers import AutoModelForCausalLM

    run = runs(name)
    saved = load_file(run / "adapter_model.safetensors")
    for module in ("model.embed_tokens", "lm_head"):
        base = saved[f"base_model.model.{module}.token_adapter.base_layer.weight"].float()
        rows = saved[f"base_model.model.{module}.token_adapter.trainable_tokens_delta"].float()
        assert base.shape == (515, 64) and rows.shape == (3, 64)
        moved = (rows - base[512:]).abs().amax(dim=1)  # lr 1e-2, Adam, 3 steps: each row moves, by at most ~0.03
        assert ((moved > 1e-3) & (moved < 0.05)).all(), (module, moved)
    merged = ex.export(run, tmp_path / "merged", verify=True)
    assert "verify: max abs logits difference" in capsys.readouterr().out
    assert AutoModelForCausalLM.from_pretrained(merged).config.vocab_size == 515
    out = ex.export(run / "checkpoint-3", tmp_path / "ckpt", verify=True)  # sharded: an adapter; plain: merged
    assert "verify: max abs logits difference" in capsys.readouterr().out
    if (out / "adapter_config.json").is_file():
        out = ex.export(out, tmp_path / "ckpt-merged")
    assert AutoModelForCausalLM.from_pretrained(out).config.vocab_size == 515


def test_zero3_lora_merge_in_run_and_checkpoint(runs, tmp_path):
    """ZeRO-3 LoRA: merge_in_run (all ranks gather, rank 0 writes) equals the offline streaming merge of the same
    adapter into the same (bf16, as ZeRO-3 holds it) base; the checkpoint exports as an exact fp32 adapter."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from transformers import AutoModelForCausalLM

    run = runs("zero3-driver")
    in_run = run / "merged-in-run"
    assert not list(run.glob("merged-in-run.tmp-*"))
    assert_manifest(in_run)
    base16 = ex.rewrite_model(ROOT / ".assets/tiny-llama", tmp_path / "base16", {}, "bfloat16", ROOT / ".assets/tiny-llama")
    offline = ex.merge_lora(run, tmp_path / "offline", base=str(base16), dtype="float32")
    a, b = load_file(in_run / "model.safetensors"), load_file(offline / "model.safetensors")
    assert set(a) == set(b) and len(a) == 21
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-6, rtol=1e-6, msg=k)
    assert torch.isfinite(tiny_logits(AutoModelForCausalLM.from_pretrained(in_run))).all()
    adapter = load_file(ex.export(run / "checkpoint-3", tmp_path / "adapter") / "adapter_model.safetensors")
    ref = get_fp32_state_dict_from_zero_checkpoint(str(run / "checkpoint-3"))
    assert_equal_tensors(adapter, {_peft_name(k): v for k, v in ref.items()})


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_qlora_adapter_merges_into_16bit_base(runs, tmp_path, dtype, capsys):
    """The QLoRA adapter (trained against 4-bit nf4 weights) merged into the unquantized base, output dtype chosen:
    equal to peft's merge_and_unload on the non-quantized base (fp32: 1e-6; bf16: the export's rounding)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    run = runs("qlora")
    out = ex.export(run, tmp_path / "merged", dtype=dtype, verify=True)
    assert "verify: max abs logits difference" in capsys.readouterr().out
    ours = AutoModelForCausalLM.from_pretrained(out)
    assert ours.dtype == DTYPES[dtype]
    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(".assets/tiny-llama"), run).merge_and_unload()
    sd = peft.state_dict()
    for n, t in ours.state_dict().items():
        want = sd[n].to(t.dtype)
        if dtype == "float32":
            torch.testing.assert_close(t, want, atol=1e-6, rtol=1e-6, msg=n)
        else:  # one bf16 rounding of the same fp32 value: at most one ulp apart (merge order differs from peft's)
            torch.testing.assert_close(t.float(), want.float(), atol=0, rtol=2**-7, msg=n)


def test_merge_into_a_bf16_base_verifies_at_the_dtype_it_writes(runs, tmp_path, capsys):
    """A base stored in bf16, as hub checkpoints are, merged without --dtype: written in bf16 and verified at bf16's
    tolerance (it was held to fp32's, and refused a correct merge into every bf16 base)."""
    base16 = ex.rewrite_model(ROOT / ".assets/tiny-llama", tmp_path / "base16", {}, "bfloat16", ROOT / ".assets/tiny-llama")
    out = ex.merge_lora(runs("qlora"), tmp_path / "merged", base=str(base16), verify=True)
    verdict = [line for line in capsys.readouterr().out.splitlines() if line.startswith("verify:")]
    assert len(verdict) == 1 and verdict[0].endswith(", bfloat16)"), verdict
    assert {t.dtype for t in load_file(out / "model.safetensors").values()} == {torch.bfloat16}


def test_ddp_final_adapter_merges_with_verify(runs, tmp_path, capsys):
    out = ex.export(runs("ddp"), tmp_path / "merged", verify=True)
    assert "verify: max abs logits difference" in capsys.readouterr().out
    assert len(load_file(out / "model.safetensors")) == 21


def test_merge_verify_gives_one_verdict_and_a_wrong_merge_one_error_line(runs, tmp_path, monkeypatch, capsys):
    """`python -m sftrecipes merge ADAPTER OUT --verify` (the ddp twin's final adapter): one verdict line against peft's
    unmerged adapter on the base, then the folder. A merge that gets one tensor wrong (zeroed as it is written) exits 2
    with one line on stderr and publishes nothing."""
    from sftrecipes import cli
    from sftrecipes.export import rewrite

    adapter = runs("ddp")
    assert cli.main(["merge", str(adapter), str(tmp_path / "merged"), "--verify"]) == 0
    out, err = capsys.readouterr()
    verdicts = [line for line in out.splitlines() if line.startswith("verify:")]
    assert len(verdicts) == 1 and verdicts[0].endswith(", float32)"), out
    assert float(verdicts[0].split("difference ")[1].split()[0]) <= 1e-4 and out.splitlines()[-1] == str(tmp_path / "merged")
    assert len(load_file(tmp_path / "merged" / "model.safetensors")) == 21

    apply, wrong = rewrite._apply, "model.layers.1.mlp.down_proj.weight"
    monkeypatch.setattr(rewrite, "_apply", lambda w, entry, name, piece: torch.zeros_like(w) if name == wrong else apply(w, entry, name, piece))
    assert cli.main(["merge", str(adapter), str(tmp_path / "bad"), "--verify"]) == 2
    out, err = capsys.readouterr()
    lines = [ln for ln in err.replace("\r", "\n").splitlines() if ln.strip() and not ln.startswith("Loading weights")]
    assert len(lines) == 1 and lines[0].startswith("error: merge: verify failed: logits differ from the source by "), err
    assert "was not published" in err and not list(tmp_path.glob("bad*"))


# -------------------------------------------------------------------------------------------------- bad inputs

def test_unknown_folder_and_unfinished_run_are_named(tmp_path):
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "notes.txt").write_text("x")
    with pytest.raises(RecipeError, match=r"is none of: .*found notes.txt") as e:
        ex.export(tmp_path / "junk", tmp_path / "out")
    assert "\n" not in str(e.value)
    (tmp_path / "run" / "checkpoint-6").mkdir(parents=True)
    (tmp_path / "run" / "checkpoint-12").mkdir()
    with pytest.raises(RecipeError, match=r"no final save .*checkpoint-6, checkpoint-12; export one of them"):
        ex.export(tmp_path / "run", tmp_path / "out")
    assert not list(tmp_path.glob("out*"))


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


@pytest.mark.parametrize("damage", ["truncate", "delete"])
def test_torn_zero_checkpoint_is_refused(runs, tmp_path, damage):
    ckpt = _copy(runs("zero1") / "checkpoint-3", tmp_path / "ck")
    rank1 = ckpt / "global_step3" / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
    if damage == "truncate":
        os.truncate(rank1, rank1.stat().st_size // 2)
        match = "truncated or corrupt"
    else:
        rank1.unlink()
        match = "1 \\*_optim_states.pt files but was saved by 2 ranks"
    with pytest.raises(RecipeError, match=match) as e:
        ex.export(ckpt, tmp_path / "out")
    assert "\n" not in str(e.value) and not list(tmp_path.glob("out*"))


@pytest.mark.parametrize("damage", ["truncate", "delete"])
def test_torn_fsdp_checkpoint_is_refused(runs, tmp_path, damage):
    ckpt = _copy(runs("fsdp1") / "checkpoint-3", tmp_path / "ck")
    shutil.copy(runs("fsdp1") / "config.json", tmp_path)  # the checkpoint's config sits in its parent
    shard = ckpt / "pytorch_model_fsdp_0" / "__1_0.distcp"
    if damage == "truncate":
        os.truncate(shard, shard.stat().st_size - 100)
    else:
        shard.unlink()
    with pytest.raises(RecipeError, match="__1_0.distcp.*" + ("truncated" if damage == "truncate" else "missing")) as e:
        ex.export(ckpt, tmp_path / "out")
    assert "\n" not in str(e.value) and not list(tmp_path.glob("out*"))


@pytest.mark.parametrize("damage", ["truncate", "delete"])
def test_torn_safetensors_shard_is_refused(runs, tmp_path, damage):
    src = ex.export(runs("offload") / "checkpoint-3", tmp_path / "sharded", max_shard_bytes=100_000)
    shard = sorted(src.glob("model-*.safetensors"))[1]
    if damage == "truncate":
        os.truncate(shard, shard.stat().st_size - 8)
    else:
        shard.unlink()
    with pytest.raises(RecipeError, match=shard.name + ".*" + ("truncated" if damage == "truncate" else "missing")) as e:
        ex.export(src, tmp_path / "out")
    assert "\n" not in str(e.value) and not list(tmp_path.glob("out*"))


def test_adapter_on_the_wrong_base_is_refused(runs, tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    wrong = tmp_path / "wrong-base"
    LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, vocab_size=512)).save_pretrained(wrong)
    for src in (runs("ddp"), runs("zero1") / "checkpoint-3"):  # merge of a final adapter; adapter export of a checkpoint
        with pytest.raises(RecipeError, match=r"does not fit the base weight .*wrong base model") as e:
            ex.export(src, tmp_path / "out", base=str(wrong))
        assert "\n" not in str(e.value) and not list(tmp_path.glob("out*"))


def test_crash_mid_write_leaves_nothing_that_looks_finished(runs, tmp_path, monkeypatch):
    calls = []

    def failing_write(self, name, tensor):
        calls.append(name)
        if len(calls) == 5:
            raise OSError(28, "No space left on device")
        self._emit(memoryview(tensor.contiguous().reshape(-1).view(torch.uint8).numpy()))
        self._next += 1

    monkeypatch.setattr(ex.SafetensorsStreamWriter, "write", failing_write)
    with pytest.raises(RecipeError, match=r"^export: no space left on device writing .*free space or give another "
                       r"destination \(nothing was left behind\)$") as e:  # one line naming the cause, not a traceback
        ex.export(runs("offload") / "checkpoint-3", tmp_path / "out")
    assert len(calls) == 5 and list(tmp_path.iterdir()) == [] and "\n" not in str(e.value)


def test_verify_fails_when_one_tensor_differs(runs, tmp_path, capsys):
    """verify can fail: the source with a single weight zeroed is caught even at the (loosest) bf16 tolerance."""
    from transformers import AutoModelForCausalLM

    out = ex.export(runs("offload") / "checkpoint-3", tmp_path / "out")

    def source_with_a_wrong_tensor():
        model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
        torch.nn.init.zeros_(model.model.layers[1].mlp.down_proj.weight)
        return model

    assert ex.verify_logits(out, lambda: AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32), torch.bfloat16) == 0
    with pytest.raises(RecipeError, match="verify failed: logits differ"):
        ex.verify_logits(out, source_with_a_wrong_tensor, torch.bfloat16)


def test_check_model_folder_catches_a_missing_tensor(runs, tmp_path):
    from safetensors.torch import save_file

    out = ex.export(runs("offload") / "checkpoint-3", tmp_path / "out")
    sd = load_file(out / "model.safetensors")
    sd.pop("model.layers.1.mlp.down_proj.weight")
    save_file(sd, out / "model.safetensors")
    with pytest.raises(RecipeError, match=r"1 missing \(e.g. \['model.layers.1.mlp.down_proj.weight'\]\)"):
        ex.check_model_folder(out)

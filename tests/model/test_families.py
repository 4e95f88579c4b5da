"""The models people fine-tune today, each for real on CPU: a recipe from recipes/tiny/ with only model_name_or_path
swapped for a tiny random-init model of the family (sftrecipes.tiny.FAMILIES: its config class, tokenizer habits and
chat template). For every family: single-process LoRA (the recipe's ChatML) and full fine-tuning (the family's own
template), ZeRO-3 LoRA and FSDP2 full with RAM-efficient loading on 2 ranks, QLoRA; every result exported or merged
with --verify and loaded with AutoModelForCausalLM.
"""

import json
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import train
from conftest import FAMILIES, ROOT, run_cli
from sftrecipes.model import load as models
from sftrecipes.model import attnchoice
from sftrecipes.export import export, merge_lora
from sftrecipes.core.errors import RecipeError
from sftrecipes.core.pages import file_mappings
from sftrecipes.recipe.load import load_recipe
from sftrecipes.tiny import FAMILIES as SPECS
from sftrecipes.data.tokenizer import end_of_turn, load_tokenizer, set_generation_stop
from test_launch import sft

MOE = {"qwen3_moe", "mixtral"}
TIED = {"qwen2", "qwen3", "gemma2", "gemma3"}
PROMPT = [{"role": "user", "content": "What is 7 plus 5?"}]


def logits(model, ids):
    model.eval()
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


def probe_ids(folder):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    return tok.apply_chat_template(PROMPT, add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]


def load(folder):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)


# ---------------------------------------------------------------------------------------------- single process


@pytest.mark.parametrize("family", FAMILIES)
def test_lora_copy_of_the_tiny_recipe_trains_merges_and_verifies(family, family_models, tmp_path):
    """recipes/tiny/lora.yaml with only the model swapped: trains; the merged model (streaming, --verify against peft's
    unmerged adapter) loads with AutoModelForCausalLM and gives the trained model's logits."""
    out = tmp_path / "lora"
    trainer, summary = train.run(load_recipe(["recipes/tiny/lora.yaml", "--model_name_or_path", str(family_models[family]),
                                              "--output_dir", str(out), "--max_steps", "8", "--logging_steps", "2", "--sample_max_new_tokens", "0"]))
    assert summary["last_loss"] < summary["first_loss"] * 0.9, summary["losses"]
    assert summary["attention"] == ("eager" if family == "gemma2" else "sft_varlen")  # packed: per-sample attention
    merged = merge_lora(out, tmp_path / "merged", verify=True)
    ids = probe_ids(merged)
    assert torch.allclose(logits(load(merged), ids), logits(trainer.model, ids), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family", FAMILIES)
def test_full_fine_tune_with_the_family_template_reloads_and_stops_at_its_end_of_turn(family, family_models, tmp_path):
    """recipes/tiny/full.yaml on the family's own chat template: the saved model reloads with the trained logits, its
    tokenizer's eos is the template's end of turn, and its saved generation config stops there (and at the original
    eos)."""
    from transformers import AutoTokenizer

    out = tmp_path / "full"
    trainer, summary = train.run(load_recipe(["recipes/tiny/full.yaml", "--model_name_or_path", str(family_models[family]),
                                              "--chat_template_format", "tokenizer", "--output_dir", str(out),
                                              "--max_steps", "6", "--logging_steps", "2", "--sample_max_new_tokens", "4"]))
    assert summary["last_loss"] < summary["first_loss"], summary["losses"]
    reloaded = load(out)
    ids = probe_ids(out)
    assert torch.equal(logits(reloaded, ids), logits(trainer.model, ids))
    tok = AutoTokenizer.from_pretrained(out)
    spec = SPECS[family]
    eot_id = tok.convert_tokens_to_ids(spec.end_of_turn)
    eos = reloaded.generation_config.eos_token_id
    eos = eos if isinstance(eos, list) else [eos]
    assert tok.eos_token == spec.end_of_turn and eos[0] == eot_id
    assert tok.convert_tokens_to_ids(spec.eos) in eos  # the original eos still stops it
    stop = summary["sample"]["stopped_on"]
    assert stop in (None, *tok.convert_ids_to_tokens(eos)) and summary["sample"]["new_tokens"] <= 4


def test_llama3_fine_tune_stops_at_eot_id(family_models, tmp_path):
    """The Llama-3 case: <|eot_id|> is an added special token its tokenizer does not list. Fine-tuned on its own
    template, the saved model, loaded as a user loads it, stops generating at <|eot_id|> using only its saved
    generation config, and the run's own sample says it stopped there."""
    from transformers import AutoTokenizer

    out = tmp_path / "llama3"
    _, summary = train.run(load_recipe(["recipes/tiny/full.yaml", "--model_name_or_path", str(family_models["llama3"]),
                                        "--chat_template_format", "tokenizer", "--output_dir", str(out), "--max_steps", "30"]))
    assert summary["sample"]["stopped_on"] == "<|eot_id|>", summary["sample"]
    tok = AutoTokenizer.from_pretrained(out)
    assert "<|eot_id|>" not in tok.all_special_tokens or tok.eos_token == "<|eot_id|>"
    model = load(out)
    enc = tok.apply_chat_template(PROMPT, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    gen = model.generate(**enc, max_new_tokens=40, do_sample=False)[0, enc["input_ids"].shape[1]:].tolist()
    eot = tok.convert_tokens_to_ids("<|eot_id|>")
    assert gen[-1] == eot and len(gen) < 40, tok.decode(gen)


@pytest.mark.parametrize("family", FAMILIES)
def test_qlora_4bit(family, family_models, tmp_path):
    """recipes/tiny/qlora.yaml with the model swapped: bitsandbytes' CPU backend quantizes every nn.Linear of the
    decoder (MoE expert tensors are parameters, not Linear layers: they stay in the bf16 storage dtype), LoRA trains,
    and the adapter merges into the unquantized base with --verify."""
    import bitsandbytes as bnb

    # a copy saved in bf16 as hub checkpoints are, so its tensors load as views into the file (no other test maps it):
    # loaded, what was not quantized (norms, embeddings, lm_head) no longer holds the checkpoint mapped with every page
    # quantization read still resident (heap.own_checkpoint_views); MoE experts are fused into new tensors as they load
    base = tmp_path / "bf16"
    shutil.copytree(family_models[family], base)
    ckpt = base / "model.safetensors"
    save_file({k: v.to(torch.bfloat16) for k, v in load_file(ckpt).items()}, ckpt, metadata={"format": "pt"})
    (base / "config.json").write_text(json.dumps({**json.loads((base / "config.json").read_text()), "dtype": "bfloat16"}))
    r16 = load_recipe(["recipes/tiny/qlora.yaml", "--model_name_or_path", str(base)])
    loaded = models.load_model(r16, load_tokenizer(r16)[0], "cpu")
    assert not file_mappings(str(ckpt)), family
    del loaded

    out = tmp_path / "qlora"
    trainer, summary = train.run(load_recipe(["recipes/tiny/qlora.yaml", "--model_name_or_path", str(family_models[family]),
                                              "--output_dir", str(out), "--max_steps", "6", "--logging_steps", "2", "--sample_max_new_tokens", "0"]))
    four_bit = [m for m in trainer.model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    per_layer = {"phi3": 4}.get(family, 4 if family in MOE else 7)  # phi3: qkv_proj, o_proj, gate_up_proj, down_proj
    layers = json.loads((family_models[family] / "config.json").read_text())["num_hidden_layers"]  # Gemma-3: 6, else 2
    assert len(four_bit) == layers * per_layer, [type(m).__name__ for m in four_bit]
    assert summary["last_loss"] < summary["first_loss"], summary["losses"]
    merge_lora(out, tmp_path / "merged", verify=True)


# ---------------------------------------------------------------------------------------------- 2 ranks


def _user_data(folder) -> None:
    """The data a user brings, in TRL's and ShareGPT's shapes, written from the shipped chat data into the run folder."""
    rows = [json.loads(line) for line in (ROOT / "data/tiny_chat/train.jsonl").read_text().splitlines()]
    who = {"system": "system", "user": "human", "assistant": "gpt"}
    files = {
        "sharegpt.jsonl": [{"conversations": [{"from": who[m["role"]], "value": m["content"]} for m in r["messages"]]} for r in rows],
        "pc_chat.jsonl": [{"prompt": r["messages"][:-1], "completion": r["messages"][-1:]} for r in rows],
        "qa.jsonl": [{"question": " ".join(m["content"] for m in r["messages"][:-1]), "answer": " " + r["messages"][-1]["content"]}
                     for r in rows],
    }
    for name, data in files.items():
        (folder / name).write_text("".join(json.dumps(r) + "\n" for r in data))


# data edits on top of the model swap, one per backend, so the 2-rank runs also prove the formats and a mixture
DATA_EDITS = {
    ("zero3", "qwen3"): ["dataset_name: null", 'datasets: [{path: sharegpt.jsonl, weight: 0.5}, {path: pc_chat.jsonl, samples: 96}]'],
    ("fsdp", "gemma3"): ["dataset_name: null", "datasets: [{path: qa.jsonl, columns: {question: prompt, answer: completion}}]"],
}
DATA_FORMATS = {("zero3", "qwen3"): {"conversations": 160, "prompt_completion": 96}, ("fsdp", "gemma3"): {"prompt_completion": 320}}


def _launch(twin: str, family, family_models, out, *flags, edits=()):
    """The README's "Your own recipe" for a family: cp the twin into the run's folder, edit the copy's model (and any
    other edit), launch it from there with the one documented command."""
    folder = out.parent
    assert sft(["cp", twin, "recipe.yaml"], cwd=folder).returncode == 0
    data = DATA_EDITS.get((twin.split("/")[-1], family), [])
    if data:
        _user_data(folder)
    with open(folder / "recipe.yaml", "a") as f:
        f.write("".join(f"{line}\n" for line in (f"model_name_or_path: {family_models[family]}", *edits, *data)))
    res = sft(["launch", "recipe.yaml", "--output_dir", out.name, "--sample_max_new_tokens", "0", *flags], cwd=folder, timeout=900)
    assert res.returncode == 0, (res.stdout + res.stderr)[-4000:]
    summary = json.loads((out / "run_summary.json").read_text())
    if data:  # every entry read in its own format, the same mixture on both ranks (main process prepares it)
        assert summary["data"]["train"]["formats"] == DATA_FORMATS[twin.split("/")[-1], family], summary["data"]
    return summary


@pytest.mark.parametrize("family", FAMILIES)
def test_zero3_lora_on_two_ranks_exports_and_merges(family, family_models, tmp_path):
    """The ZeRO-3 LoRA twin, copied with only the family's model changed and launched as README's "Your own recipe"
    says. Its adapter is
    partitioned over 2 ranks; the final adapter merges into the base (--verify) and loads with AutoModelForCausalLM,
    and the adapter export of a mid-run checkpoint (ZeRO-3 fp32 masters) verifies too."""
    out = tmp_path / "z3"  # MoE: the 70B recipe's lora_dropout 0.1 on the modules, none on the expert parameters
    summary = _launch("tiny/zero3", family, family_models, out, "--max_steps", "2", "--save_strategy", "steps",
                      "--save_steps", "2")
    b = summary["backend"]
    assert b["zero_stage"] == 3 and b["param_elements_local"] * 2 == pytest.approx(b["param_elements_full"], rel=0.05), b
    merged = export(out, tmp_path / "merged", verify=True)
    assert torch.isfinite(logits(load(merged), probe_ids(merged))).all()
    adapter = export(out / "checkpoint-2", tmp_path / "ck-adapter", verify=True)
    # the checkpoint holds what trains (LoRA pairs, new token rows: a tied head's once, as the embedding's); the resized
    # frozen embeddings ZeRO-3 leaves out of it are in the final adapter only (the merge grows the base from the rows)
    def trained(names):
        return sorted(n for n in names if not n.endswith(".token_adapter.base_layer.weight")
                      and not (family in TIED and n.endswith("lm_head.token_adapter.trainable_tokens_delta")))

    assert trained(load_file(adapter / "adapter_model.safetensors")) == trained(load_file(out / "adapter_model.safetensors"))


@pytest.mark.parametrize("family", FAMILIES)
def test_fsdp2_full_with_ram_efficient_loading_on_two_ranks(family, family_models, tmp_path):
    """The FSDP2 twin (FULL_SHARD, SHARDED_STATE_DICT, fsdp_cpu_ram_efficient_loading) with the model swapped. The
    first step runs at learning rate 0 (linear warm-up), so checkpoint-1 must hold exactly the weights rank 0 read and
    broadcast: tied embeddings included (rank 1 starts on the meta device). The final sharded save exports (--verify)
    to a folder AutoModelForCausalLM loads, and the run trained."""
    out = tmp_path / "fsdp"
    summary = _launch("tiny/fsdp", family, family_models, out, "--max_steps", "3", "--save_steps", "1",
                      "--warmup_steps", "1", "--lr_scheduler_type", "linear", "--logging_steps", "1")
    b = summary["backend"]
    assert b["fsdp_version"] == 2 and b["param_elements_local"] * 2 == pytest.approx(b["param_elements_full"], rel=0.05), b
    assert summary["losses"][-1] < summary["losses"][0], summary["losses"]
    base = {k: v for f in family_models[family].glob("*.safetensors") for k, v in load_file(f).items()}
    first = load_file(export(out / "checkpoint-1", tmp_path / "ck1") / "model.safetensors")
    # the ChatML tokens the recipe adds grow the embeddings (and an untied head) by new rows: compare the checkpoint's
    assert sorted(first) == sorted(base) and all(torch.equal(first[k][: len(base[k])], base[k]) for k in base)
    final = export(out, tmp_path / "final", verify=True)
    trained = load_file(final / "model.safetensors")
    assert any(not torch.equal(trained[k][: len(base[k])], base[k]) for k in base)
    assert torch.isfinite(logits(load(final), probe_ids(final))).all()


# ---------------------------------------------------------------------------------------------- what is decided before


@pytest.mark.parametrize("family", FAMILIES)
def test_end_of_turn_is_read_from_the_template(family, family_models):
    tok, eot, _ = load_tokenizer(load_recipe(["recipes/tiny/lora.yaml", "--model_name_or_path",
                                                     str(family_models[family]), "--chat_template_format", "tokenizer"]))
    assert eot == SPECS[family].end_of_turn == tok.eos_token
    from transformers import AutoTokenizer

    raw = AutoTokenizer.from_pretrained(family_models[family])  # as shipped: Llama-3 does not list <|eot_id|>
    assert end_of_turn(raw) == (SPECS[family].end_of_turn, "added token" if family == "llama3" else "special token")


@pytest.mark.parametrize("template, want", [
    ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}<END>\n{% endfor %}", ("<END>", "text")),
    ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}", (None, "none")),
    ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\nThe{% endfor %}", ("The", "token")),
])
def test_end_of_turn_as_plain_text_or_nothing(tiny_model, template, want):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    tok.chat_template = template
    assert end_of_turn(tok) == want


def test_textual_end_of_turn_becomes_a_stop_string(tiny_model, tmp_path):
    from transformers import GenerationConfig

    folder = tmp_path / "tok"
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    tok.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}<END>\n{% endfor %}"
    tok.save_pretrained(folder)
    r = load_recipe(["recipes/tiny/lora.yaml", "--tokenizer_name_or_path", str(folder), "--chat_template_format", "tokenizer"])
    tok, eot, _ = load_tokenizer(r)
    gen = GenerationConfig(eos_token_id=2)
    assert eot == "<END>" and set_generation_stop(gen, tok) == [tok.eos_token_id] and gen.stop_strings == ["<END>"]


@pytest.mark.parametrize("family, want", [("gemma2", "eager"), ("gemma3", "sdpa"), ("qwen3_moe", "sdpa"), ("phi3", "sdpa")])
@pytest.mark.parametrize("packing", [True, False])
def test_auto_attention_follows_what_the_model_supports(family, want, packing, family_models):
    """auto: packed batches get sft_varlen (per-sample attention), padded ones sdpa; Gemma-2's soft-capping neither."""
    r = load_recipe(["recipes/tiny/lora.yaml", "--model_name_or_path", str(family_models[family]), "--packing", str(packing).lower()])
    want = "sft_varlen" if packing and want == "sdpa" else want
    assert attnchoice.choose_attention(r, "cpu")[0] == want
    assert attnchoice.choose_attention(r, "gpu")[0] == want  # no flash-attn package here: never flash_attention_2


def test_attention_choices_and_their_errors(family_models):
    gemma2 = ["recipes/tiny/lora.yaml", "--model_name_or_path", str(family_models["gemma2"])]
    with pytest.raises(RecipeError, match="attn_implementation: Gemma2ForCausalLM does not support sdpa"):
        attnchoice.choose_attention(load_recipe([*gemma2, "--attn_implementation", "sdpa"]), "cpu")
    with pytest.raises(RecipeError, match="flex_attention has no backward pass on CPU"):
        attnchoice.choose_attention(load_recipe([*gemma2, "--attn_implementation", "flex_attention"]), "cpu")
    assert attnchoice.choose_attention(load_recipe([*gemma2, "--attn_implementation", "eager"]), "cpu") == ("eager", "recipe")
    # use_flash_attn is the guide's alias; falling back when flash-attn or a GPU is missing picks what auto would
    assert attnchoice.choose_attention(load_recipe([*gemma2, "--use_flash_attn", "true"]), "cpu")[0] == "eager"
    with pytest.raises(RecipeError, match="use_flash_attn: true asks for flash_attention_2 but attn_implementation is eager"):
        load_recipe([*gemma2, "--use_flash_attn", "true", "--attn_implementation", "eager"])


def test_model_init_kwargs_are_taken_not_overwritten(tiny_model):
    r = load_recipe(["recipes/tiny/lora.yaml", "--model_init_kwargs", '{"attn_implementation": "eager", "torch_dtype": "bfloat16", "low_cpu_mem_usage": true}'])
    assert r.model.attn_implementation == "eager" and r.model.dtype == "bfloat16"
    assert r.trl["model_init_kwargs"] == {"low_cpu_mem_usage": True}
    assert r.renamed["model_init_kwargs.attn_implementation"] == "attn_implementation"
    tok, _, _ = load_tokenizer(r)
    model = models.load_model(r, tok, "cpu")
    assert model.config._attn_implementation == "eager" and model.dtype == torch.bfloat16
    for flags, match in (
        (["--model_init_kwargs", '{"attn_implementation": "eager"}', "--attn_implementation", "sdpa"],
         r"model_init_kwargs.attn_implementation \(eager\) and attn_implementation \(sdpa\) disagree"),
        (["--model_init_kwargs", '{"quantization_config": {}}'], "model_init_kwargs.quantization_config: .*use_4bit_quantization"),
        (["--model_init_kwargs", '{"device_map": "auto"}'], "model_init_kwargs.device_map"),
        (["--model_init_kwargs", '{"dtype": "int8"}'], "dtype"),
    ):
        res = run_cli(["train.py", "recipes/tiny/lora.yaml", *flags])
        assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1, res.stderr
        assert re.search(match, res.stderr), res.stderr


def test_gemma3_family_has_the_released_layer_pattern(family_models):
    """Gemma-3 runs 5 sliding-window layers to 1 full: the tiny family has that pattern, which 2 layers would hide,
    and the planner reads its 6 layers from config.json."""
    from sftrecipes.facts.config import model_shape

    config = json.loads((family_models["gemma3"] / "config.json").read_text())
    assert config["layer_types"] == ["sliding_attention"] * 5 + ["full_attention"]
    assert model_shape(str(family_models["gemma3"])).layers == 6


def test_family_assets_are_deterministic_and_rebuilt_when_their_spec_changes(tmp_path, monkeypatch):
    from sftrecipes import tiny

    a = tiny.build_family("qwen3", tmp_path / "a")
    b = tiny.build_family("qwen3", tmp_path / "b")
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    cfg = json.loads((a / "config.json").read_text())
    assert cfg["head_dim"] == 32 != cfg["hidden_size"] // cfg["num_attention_heads"] and cfg["tie_word_embeddings"]
    monkeypatch.setattr(tiny, "ASSETS", tmp_path)
    built = tiny.ensure_family("qwen3")
    (built / tiny.SPEC_FILE).write_text("an older spec")
    stamp = (built / "model.safetensors").stat().st_mtime_ns
    assert tiny.ensure_family("qwen3") == built and (built / tiny.SPEC_FILE).read_text() == tiny._spec("qwen3")
    assert (built / "model.safetensors").stat().st_mtime_ns != stamp

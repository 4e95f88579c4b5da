"""Formatting and tokenization: templates, special tokens, end-of-turn counts, loss masks, packing."""

import json

import pytest
import torch

from sftrecipes import data, model as models
from sftrecipes.recipe import RecipeError, load_recipe

BASE = ["--model_name_or_path", ".assets/tiny-llama", "--dataset_name", "data/tiny_chat", "--output_dir", "outputs/t"]
CONV = {"messages": [
    {"role": "system", "content": "You answer briefly."},
    {"role": "user", "content": "What is 2 plus 3?"},
    {"role": "assistant", "content": "2 plus 3 is 5."},
    {"role": "user", "content": "What color is snow?"},
    {"role": "assistant", "content": "Snow is white."},
]}


def build(*flags):
    r = load_recipe(BASE + list(flags))
    tok, eot, added = models.load_tokenizer(r)
    return r, tok, eot, added


@pytest.mark.parametrize("fmt", ["chatml", "zephyr", "tokenizer"])
@pytest.mark.parametrize("append", [False, True])
@pytest.mark.parametrize("special", [False, True])
def test_exactly_one_end_of_turn_per_turn(tiny_model, fmt, append, special):
    r, tok, eot, _ = build("--chat_template_format", fmt, "--append_concat_token", str(append), "--add_special_tokens", str(special))
    out = data.tokenize_example(CONV, tok, r, eot)
    eot_id = tok.convert_tokens_to_ids(eot)
    assert out["input_ids"].count(eot_id) == len(CONV["messages"]), tok.decode(out["input_ids"])
    assert (out["input_ids"][0] == tok.bos_token_id) == special  # add_special_tokens reaches the tokenizer call
    assert out["labels"] == out["input_ids"]


def test_append_concat_token_on_text_data(tiny_model, tmp_path):
    r, tok, eot, _ = build("--append_concat_token", "True")
    out = data.tokenize_example({"text": "just some text"}, tok, r, eot)
    assert out["input_ids"][-1] == tok.eos_token_id and out["input_ids"].count(tok.eos_token_id) == 1
    r2, *_ = build("--append_concat_token", "False")
    assert tok.eos_token_id not in data.tokenize_example({"text": "just some text"}, tok, r2, eot)["input_ids"]
    # text that already ends with EOS gets no second one
    out = data.tokenize_example({"text": "done</s>"}, tok, r, eot)
    assert out["input_ids"].count(tok.eos_token_id) == 1


def test_chatml_sets_end_of_turn_as_eos_and_zephyr_adds_tokens(tiny_model):
    _, tok, eot, added = build("--chat_template_format", "chatml")
    assert eot == tok.eos_token == "<|im_end|>" and added == []  # tiny tokenizer has the ChatML tokens already
    _, tok, eot, added = build("--chat_template_format", "zephyr")
    assert eot == "</s>" and len(added) == 3 and "<|assistant|>" in tok.get_vocab()


def test_assistant_only_loss_masks_everything_but_assistant_turns(tiny_model):
    r, tok, eot, _ = build("--chat_template_format", "chatml", "--assistant_only_loss", "True")
    out = data.tokenize_example(CONV, tok, r, eot)
    trained = tok.decode([t for t, l in zip(out["input_ids"], out["labels"]) if l != -100])
    assert "2 plus 3 is 5." in trained and "Snow is white." in trained
    assert "What color" not in trained and "You answer briefly" not in trained and "user" not in trained
    assert trained.count("<|im_end|>") == 2  # the model learns to stop


def test_dataset_text_field_holds_the_formatted_text(tiny_model):
    r, tok, eot, _ = build("--chat_template_format", "chatml", "--dataset_text_field", "content")
    train, _ = data.load_raw(r)
    ds = data.prepare(r, tok, eot, train.select(range(4)), "train")
    assert set(ds.column_names) == {"content", "input_ids", "labels"}
    assert ds[0]["content"].startswith("<|im_start|>")


def test_splits_and_local_sources(tiny_model, tmp_path):
    r = load_recipe(BASE + ["--splits", "train"])
    train, evals = data.load_raw(r)
    assert len(train) == 320 and evals is None
    train, evals = data.load_raw(load_recipe(BASE))
    assert len(evals) == 40
    # one jsonl file, and a parquet file
    one = tmp_path / "one.jsonl"
    one.write_text("".join(json.dumps({"text": f"sample {i}"}) + "\n" for i in range(5)))
    r = load_recipe(BASE + ["--dataset_name", str(one), "--splits", "train"])
    assert len(data.load_raw(r)[0]) == 5
    train.to_parquet(str(tmp_path / "d.parquet"))
    r = load_recipe(BASE + ["--dataset_name", str(tmp_path / "d.parquet"), "--splits", "train"])
    assert len(data.load_raw(r)[0]) == 320


@pytest.mark.parametrize("flags,fragment", [
    (["--splits", "train,validation"], "splits: 'validation' not found"),
    (["--chat_template_format", "none"], "the data is conversational"),
    (["--chat_template_format", "chatml", "--dataset_name", "JSONL", "--splits", "train"], "needs a 'messages' column"),
    (["--dataset_name", "nobody-here/not-a-dataset-xyz"], "dataset_name: 'nobody-here/not-a-dataset-xyz'"),
])
def test_data_errors_name_the_key(tiny_model, tmp_path, flags, fragment):
    one = tmp_path / "one.jsonl"
    one.write_text(json.dumps({"text": "x"}) + "\n")
    flags = [str(one) if f == "JSONL" else f for f in flags]
    r, tok, eot, _ = build(*flags)
    with pytest.raises(RecipeError) as e:
        train, _ = data.load_raw(r)
        data.prepare(r, tok, eot, train, "train split")
    assert fragment in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_packed_batch_has_no_cross_sample_attention(tiny_model):
    """TRL's BFD packing sends position_ids and no attention mask; sdpa then builds a block-diagonal mask,
    so a packed sequence gives exactly the logits of its samples run alone. That detection is skipped when a KV
    cache exists (transformers' default use_cache=True), hence load_model turns the cache off for training."""
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    r, tok, _, _ = build("--packing", "True")
    model = models.load_model(r, tok, "cpu").train()  # as the trainer runs it
    assert model.config._attn_implementation == "sdpa"
    a, b = [1, 20, 30, 40, 50], [1, 60, 70, 80]
    batch = DataCollatorForLanguageModeling(pad_token_id=3, padding_free=True)(
        [{"input_ids": a + b, "seq_lengths": [len(a), len(b)]}])
    assert "attention_mask" not in batch and batch["position_ids"].tolist() == [[0, 1, 2, 3, 4, 0, 1, 2, 3]]
    with torch.no_grad():
        packed = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits[0]
        alone = torch.cat([model(input_ids=torch.tensor([a])).logits[0], model(input_ids=torch.tensor([b])).logits[0]])
        leaky = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=True).logits[0]  # the trap
    torch.testing.assert_close(packed, alone, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(leaky[len(a):], alone[len(a):], atol=1e-3)

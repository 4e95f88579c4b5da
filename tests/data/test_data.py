"""Formatting and tokenization: templates, special tokens, end-of-turn counts, loss masks, packing; TRL's data-preparation keys."""

import ast
import dataclasses
import inspect
import json
import os
import textwrap

import datasets
import pytest
import torch
from transformers import AutoTokenizer, TrainingArguments
from trl import SFTConfig, SFTTrainer
from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

import train as train_script
from sftrecipes.train import args as backends
from sftrecipes.data import load as data
from sftrecipes.model import load as models
from sftrecipes.recipe import sources
from sftrecipes.data import tokenization
from sftrecipes.core.errors import RecipeError
from sftrecipes.recipe.load import load_recipe
from sftrecipes.data.tokenizer import load_tokenizer


BASE = ["--model_name_or_path", ".assets/tiny-llama", "--dataset_name", "data/tiny_chat", "--output_dir", "outputs/t"]
CONV = {"messages": [
    {"role": "system", "content": "You answer briefly."},
    {"role": "user", "content": "What is 2 plus 3?"},
    {"role": "assistant", "content": "2 plus 3 is 5."},
    {"role": "user", "content": "What color is snow?"},
    {"role": "assistant", "content": "Snow is white."},
]}


def build(*flags):
    r = load_recipe(BASE + [str(f) for f in flags])
    tok, eot, added = load_tokenizer(r)
    return r, tok, eot, added


@pytest.mark.parametrize("fmt", ["chatml", "zephyr", "tokenizer"])
@pytest.mark.parametrize("append", [False, True])
@pytest.mark.parametrize("special", [False, True])
def test_exactly_one_end_of_turn_per_turn(tiny_model, fmt, append, special):
    r, tok, eot, _ = build("--chat_template_format", fmt, "--append_concat_token", str(append), "--add_special_tokens", str(special))
    out = tokenization.tokenize_example(CONV, tok, r, eot)
    eot_id = tok.convert_tokens_to_ids(eot)
    assert out["input_ids"].count(eot_id) == len(CONV["messages"]), tok.decode(out["input_ids"])
    assert (out["input_ids"][0] == tok.bos_token_id) == special  # add_special_tokens reaches the tokenizer call
    assert out["labels"] == out["input_ids"]


def test_append_concat_token_on_text_data(tiny_model, tmp_path):
    r, tok, eot, _ = build("--append_concat_token", "True")
    out = tokenization.tokenize_example({"text": "just some text"}, tok, r, eot)
    assert out["input_ids"][-1] == tok.eos_token_id and out["input_ids"].count(tok.eos_token_id) == 1
    r2, *_ = build("--append_concat_token", "False")
    assert tok.eos_token_id not in tokenization.tokenize_example({"text": "just some text"}, tok, r2, eot)["input_ids"]
    # text that already ends with EOS gets no second one
    out = tokenization.tokenize_example({"text": "done</s>"}, tok, r, eot)
    assert out["input_ids"].count(tok.eos_token_id) == 1


def test_chatml_sets_end_of_turn_as_eos_and_zephyr_adds_tokens(tiny_model):
    _, tok, eot, added = build("--chat_template_format", "chatml")
    assert eot == tok.eos_token == "<|im_end|>" and added == []  # tiny tokenizer has the ChatML tokens already
    _, tok, eot, added = build("--chat_template_format", "zephyr")
    assert eot == "</s>" and len(added) == 3 and "<|assistant|>" in tok.get_vocab()


def test_assistant_only_loss_masks_everything_but_assistant_turns(tiny_model):
    r, tok, eot, _ = build("--chat_template_format", "chatml", "--assistant_only_loss", "True")
    out = tokenization.tokenize_example(CONV, tok, r, eot)
    trained = tok.decode([t for t, ln in zip(out["input_ids"], out["labels"]) if ln != -100])
    assert "2 plus 3 is 5." in trained and "Snow is white." in trained
    assert "What color" not in trained and "You answer briefly" not in trained and "user" not in trained
    assert trained.count("<|im_end|>") == 2  # the model learns to stop


def test_chat_template_path_is_the_template_the_data_is_tokenized_with(tiny_model, tmp_path):
    """TRL's chat_template_path: the project formats the data itself, so the file's template is the one the data is
    tokenized with and the one saved with the model (it used to reach only SFTConfig: trained with the project's
    template, shipped with the file's). Anything that would make the two differ is refused in one line."""
    template = tmp_path / "mine.jinja"
    template.write_text("{% for m in messages %}[[{{ m['role'] }}]] {{ m['content'] }}<|im_end|>\n{% endfor %}"
                        "{% if add_generation_prompt %}[[assistant]] {% endif %}")
    r, tok, eot, _ = build("--chat_template_format", "tokenizer", "--chat_template_path", str(template))
    assert tok.chat_template == template.read_text() and eot == "<|im_end|>"
    out = tokenization.tokenize_example(CONV, tok, r, eot)
    text = tok.decode(out["input_ids"])
    assert "[[user]] What color is snow?" in text and "[[assistant]] Snow is white.<|im_end|>" in text
    tok.save_pretrained(tmp_path / "saved")

    assert AutoTokenizer.from_pretrained(tmp_path / "saved").chat_template == template.read_text()
    assert "chat_template_path" not in backends.training_kwargs(r, "cpu")  # applied here, not again by TRL
    for flags, says in ((["--chat_template_format", "chatml"], "set chat_template_format: tokenizer"),
                        (["--chat_template_format", "tokenizer", "--chat_template_path", str(tmp_path / "nope.jinja")],
                         "does not exist"),
                        (["--chat_template_format", "tokenizer", "--chat_template_path", str(tiny_model)], "tokenizer_name_or_path")):
        if "--chat_template_path" not in flags:
            flags = [*flags, "--chat_template_path", str(template)]
        with pytest.raises(RecipeError, match="^chat_template_path: .*" + says):
            load_recipe(BASE + flags)


def test_dataset_text_field_holds_the_formatted_text(tiny_model):
    r, tok, eot, _ = build("--chat_template_format", "chatml", "--dataset_text_field", "content")
    train, _ = data.load_raw(r)
    ds = tokenization.prepare(r, tok, eot, train.select(range(4)), "train")
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
    (["--chat_template_format", "none"], "chat_template_format: none, but dataset_name is conversational (messages); set chat_template_format: tokenizer"),
    (["--chat_template_format", "chatml", "--dataset_name", "JSONL", "--splits", "train", "--dataset_text_field", "body"],
     "dataset_format: dataset_name"),
    (["--chat_template_format", "chatml", "--dataset_name", "JSONL", "--splits", "train", "--dataset_format", "messages"],
     "dataset_format: messages needs the column 'messages'"),
    (["--dataset_name", "nobody-here/not-a-dataset-xyz"], "dataset_name: 'nobody-here/not-a-dataset-xyz'"),
])
def test_data_errors_name_the_key(tiny_model, tmp_path, flags, fragment):
    one = tmp_path / "one.jsonl"
    one.write_text(json.dumps({"text": "x"}) + "\n")
    flags = [str(one) if f == "JSONL" else f for f in flags]
    r, tok, eot, _ = build(*flags)
    with pytest.raises(RecipeError) as e:
        data.load_datasets(r, tok, eot)
    assert fragment in str(e.value) and "\n" not in str(e.value), str(e.value)


@pytest.mark.parametrize("attn", ["sdpa", "auto"])
def test_packed_batch_has_no_cross_sample_attention(tiny_model, attn):
    """TRL's BFD packing sends position_ids and no attention mask; sdpa then builds a block-diagonal mask, and auto's
    sft_varlen attends per sample, so a packed sequence gives exactly the logits of its samples run alone. sdpa's
    detection is skipped when a KV cache exists (transformers' default use_cache=True), hence load_model turns the
    cache off for training; sft_varlen reads the boundaries itself, cache or not."""

    r, tok, _, _ = build("--packing", "True", "--attn_implementation", attn)
    model = models.load_model(r, tok, "cpu").train()  # as the trainer runs it
    assert model.config._attn_implementation == {"sdpa": "sdpa", "auto": "sft_varlen"}[attn]
    a, b = [1, 20, 30, 40, 50], [1, 60, 70, 80]
    batch = DataCollatorForLanguageModeling(pad_token_id=3, padding_free=True)(
        [{"input_ids": a + b, "seq_lengths": [len(a), len(b)]}])
    assert "attention_mask" not in batch and batch["position_ids"].tolist() == [[0, 1, 2, 3, 4, 0, 1, 2, 3]]
    with torch.no_grad():
        packed = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits[0]
        alone = torch.cat([model(input_ids=torch.tensor([a])).logits[0], model(input_ids=torch.tensor([b])).logits[0]])
        cached = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=True).logits[0]  # the trap
    torch.testing.assert_close(packed, alone, atol=1e-5, rtol=1e-5)
    if attn == "sdpa":
        assert not torch.allclose(cached[len(a):], alone[len(a):], atol=1e-3)
    else:
        torch.testing.assert_close(cached, alone, atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------------------ formats
# Fixtures built from the shipped chat data: the same conversations as TRL prompt/completion (plain text and
# conversational), ShareGPT and plain text.

ROWS = [json.loads(line) for line in open("data/tiny_chat/train.jsonl")][:24]
SHAREGPT_FROM = {"user": "human", "assistant": "gpt", "system": "system"}


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    d = tmp_path_factory.mktemp("shapes")
    plain = [{"prompt": " ".join(m["content"] for m in r["messages"][:-1]) + "\nAnswer:", "completion": " " + r["messages"][-1]["content"]}
             for r in ROWS]
    return {
        "messages": write_jsonl(d / "messages.jsonl", ROWS),
        "prompt_completion": write_jsonl(d / "pc.jsonl", plain),
        "prompt_completion_chat": write_jsonl(d / "pc_chat.jsonl", [{"prompt": r["messages"][:-1], "completion": r["messages"][-1:]} for r in ROWS]),
        "conversations": write_jsonl(d / "sharegpt.jsonl", [{"conversations": [{"from": SHAREGPT_FROM[m["role"]], "value": m["content"]} for m in r["messages"]]} for r in ROWS]),
        "text": write_jsonl(d / "text.jsonl", [{"text": p["prompt"] + p["completion"]} for p in plain]),
        "qa": write_jsonl(d / "qa.jsonl", [{"question": p["prompt"], "answer": p["completion"]} for p in plain]),
    }


def prepared(*flags):
    r, tok, eot, _ = build(*flags)
    train, evals, prompt, counts = data.load_datasets(r, tok, eot)
    return tok, train, counts


def trained_text(tok, row):
    return tok.decode([t for t, label in zip(row["input_ids"], row["labels"]) if label != -100])


def test_prompt_completion_trains_the_completion_only_as_trl_does(tiny_model, shapes):
    tok, ds, counts = prepared("--dataset_name", shapes["prompt_completion"], "--splits", "train", "--chat_template_format", "none")
    assert counts["train"]["formats"] == {"prompt_completion": len(ROWS)}
    for row, src in zip(ds, ROWS):
        assert trained_text(tok, row) == " " + src["messages"][-1]["content"] + "</s>"  # and it learns to stop
        assert tok.decode(row["input_ids"]).endswith("Answer: " + src["messages"][-1]["content"] + "</s>")
    # completion_only_loss: false = the whole sequence, as in TRL
    tok, ds, _ = prepared("--dataset_name", shapes["prompt_completion"], "--splits", "train", "--completion_only_loss", "false")
    assert all(row["labels"] == row["input_ids"] for row in ds)


def test_conversational_prompt_completion_and_sharegpt_tokenize_like_messages(tiny_model, shapes):
    chat = ("--splits", "train", "--chat_template_format", "chatml")
    tok, msgs, _ = prepared("--dataset_name", shapes["messages"], *chat)
    _, sharegpt, counts = prepared("--dataset_name", shapes["conversations"], *chat)
    assert counts["train"]["formats"] == {"conversations": len(ROWS)}
    assert sharegpt["input_ids"] == msgs["input_ids"] and sharegpt["labels"] == msgs["labels"]
    _, pc, _ = prepared("--dataset_name", shapes["prompt_completion_chat"], *chat)
    assert pc["input_ids"] == msgs["input_ids"]
    for row, src in zip(pc, ROWS):  # the completion (the last assistant turn and its end of turn), nothing else
        assert trained_text(tok, row) == src["messages"][-1]["content"] + "<|im_end|>\n"
    # ShareGPT with assistant_only_loss masks exactly like messages
    _, a, _ = prepared("--dataset_name", shapes["messages"], *chat, "--assistant_only_loss", "True")
    _, b, _ = prepared("--dataset_name", shapes["conversations"], *chat, "--assistant_only_loss", "True")
    assert a["labels"] == b["labels"] and a["labels"] != msgs["labels"]


def test_text_format_and_format_override(tiny_model, shapes, tmp_path, caplog):
    with caplog.at_level("INFO", logger="sftrecipes"):
        tok, ds, counts = prepared("--dataset_name", shapes["text"], "--splits", "train", "--chat_template_format", "chatml")
    assert counts["train"]["formats"] == {"text": len(ROWS)} and all(r["labels"] == r["input_ids"] for r in ds)
    assert "chatml is unused for text data" in caplog.text
    both = write_jsonl(tmp_path / "both.jsonl", [{"prompt": "Q?", "completion": " A.", "text": "Some whole text."}])
    _, ds, counts = prepared("--dataset_name", both, "--splits", "train")  # auto: prompt + completion wins over text
    assert counts["train"]["formats"] == {"prompt_completion": 1}
    tok, ds, counts = prepared("--dataset_name", both, "--splits", "train", "--dataset_format", "text")
    assert counts["train"]["formats"] == {"text": 1} and tok.decode(ds[0]["input_ids"]) == "Some whole text."


@pytest.mark.parametrize("rows,flags,fragment", [
    ([{"question": "q", "answer": "a"}], [], "none of the accepted shapes: messages (column 'messages'"),
    ([{"conversations": [{"from": "bing", "value": "hi"}]}], ["--chat_template_format", "chatml"], "unknown 'from' value 'bing'"),
    ([{"prompt": [{"role": "user", "content": "q"}], "completion": [{"role": "assistant", "content": "a"}]}], [],
     "chat_template_format: none, but dataset_name is conversational (prompt_completion)"),
    ([{"text": "t"}], ["--chat_template_format", "chatml", "--assistant_only_loss", "True"], "assistant_only_loss: train split is text"),
    ([{"text": "t"}], ["--completion_only_loss", "true"], "completion_only_loss: applies to prompt/completion data"),
    ([{"messages": [{"role": "user", "content": "only a question"}]}], ["--chat_template_format", "chatml", "--assistant_only_loss", "True"],
     "assistant_only_loss: every train split sample has no assistant token"),
])
def test_format_errors_are_one_line_with_the_fix(tiny_model, tmp_path, rows, flags, fragment):
    f = write_jsonl(tmp_path / "d.jsonl", rows)
    r, tok, eot, _ = build("--dataset_name", str(f), "--splits", "train", *flags)
    with pytest.raises(RecipeError) as e:
        data.load_datasets(r, tok, eot)
    assert fragment in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_the_fix_each_error_names_trains_what_was_meant(tiny_model, tmp_path):
    """Following the advice of the conversational and shape errors gives a run that trains the answers."""
    f = write_jsonl(tmp_path / "d.jsonl", [{"question": "What is 2 plus 3?", "answer": " 5."}])
    r = load_recipe(BASE[:2] + ["--output_dir", "o", "--datasets", json.dumps([{"path": str(f), "columns": {"question": "prompt", "answer": "completion"}}])])
    tok, eot, _ = load_tokenizer(r)
    train, _, _, _ = data.load_datasets(r, tok, eot)
    assert trained_text(tok, train[0]) == " 5.</s>"
    r, tok, eot, _ = build("--chat_template_format", "tokenizer", "--splits", "train")  # the shipped chat data
    train, _, _, _ = data.load_datasets(r, tok, eot)
    assert "<|im_start|>assistant" in tok.decode(train[0]["input_ids"])


# ------------------------------------------------------------------------------------------ counts


def conv(user_words: int, answer_words: int, answer=True, tail_words=0):
    msgs = [{"role": "user", "content": " ".join(["apple"] * user_words)}]
    if answer:
        msgs.append({"role": "assistant", "content": " ".join(["river"] * answer_words)})
    if tail_words:
        msgs.append({"role": "user", "content": " ".join(["stone"] * tail_words)})
    return {"messages": msgs}


@pytest.mark.parametrize("mode,expect", [
    ("keep_start", {"read": 4, "truncated": 2, "dropped_after_cut": 1, "fully_masked": 1, "kept": 2}),
    ("keep_end", {"read": 4, "truncated": 2, "dropped_after_cut": 0, "fully_masked": 1, "kept": 3}),
])
def test_counts_of_cut_dropped_and_masked_samples(tiny_model, tmp_path, caplog, mode, expect):
    rows = [conv(3, 3), conv(3, 0, answer=False), conv(80, 2), conv(3, 80)]  # short; no answer; answer past the cut; long answer
    f = write_jsonl(tmp_path / "d.jsonl", rows)
    flags = ["--dataset_name", str(f), "--splits", "train", "--chat_template_format", "chatml", "--assistant_only_loss", "True",
             "--max_length", "40", "--truncation_mode", mode]
    with caplog.at_level("INFO", logger="sftrecipes"):
        tok, ds, counts = prepared(*flags)
    got = {k: counts["train"][k] for k in expect}
    assert got == expect
    assert all(len(r["input_ids"]) <= 40 and any(label != -100 for label in r["labels"][1:]) for r in ds)
    lines = [m for m in caplog.messages if m.startswith("data: train split:")]
    assert len(lines) == 1 and f"{expect['truncated']} truncated at max_length 40 ({mode})" in lines[0]
    assert f"{expect['dropped_after_cut']} dropped after the cut" in lines[0] and "1 fully masked" in lines[0]
    if mode == "keep_end":  # the kept tail is the end of the sample, where the answer is
        assert tok.decode(ds[1]["input_ids"]).endswith("river river<|im_end|>\n")


def test_every_sample_lost_to_the_cut_is_an_error(tiny_model, tmp_path):
    f = write_jsonl(tmp_path / "d.jsonl", [conv(80, 2)] * 3)
    r, tok, eot, _ = build("--dataset_name", str(f), "--splits", "train", "--chat_template_format", "chatml",
                           "--assistant_only_loss", "True", "--max_length", "40")
    with pytest.raises(RecipeError, match="max_length: no train split sample keeps a trainable token .* set truncation_mode: keep_end"):
        data.load_datasets(r, tok, eot)


@pytest.mark.parametrize("packing", ["none", "bfd", "wrapped"])
def test_trl_cuts_nothing_twice_and_packed_rows_are_counted(tiny_model, tmp_path, packing):
    """What SFTTrainer does after the project's preparation: no further cut, no drop, and the packed rows the
    counts announce (bfd: none fully masked; wrapped: exactly the counted number)."""

    # masked runs longer than max_length across sample boundaries (a long masked user tail, then a long user
    # prompt), which wrapped packing can cut into rows of their own; and one sample longer than max_length
    rows = [conv(2, 1, tail_words=36) if i % 2 == 0 else conv(38 + i % 3, 1) for i in range(24)] + [conv(3, 60)]
    f = write_jsonl(tmp_path / "d.jsonl", rows)
    flags = ["--dataset_name", str(f), "--splits", "train", "--chat_template_format", "chatml", "--assistant_only_loss", "True",
             "--max_length", "64", "--output_dir", str(tmp_path / "o"), "--launch.hardware", "cpu"]
    if packing != "none":
        flags += ["--packing", "True", "--packing_strategy", packing]
    r, tok, eot, _ = build(*flags)
    ours, _, _, counts = data.load_datasets(r, tok, eot)
    assert counts["train"]["truncated"] == 1 and counts["train"]["kept"] == 25
    trainer = SFTTrainer(model=models.load_model(r, tok, "cpu"), args=backends.training_args(r, "cpu"),
                         train_dataset=ours, processing_class=tok)
    theirs = trainer.train_dataset
    masked_rows = sum(not any(label != -100 for label in row[1:]) for row in theirs["labels"])
    if packing == "none":
        assert theirs["input_ids"] == ours["input_ids"] and theirs["labels"] == ours["labels"]
        assert "packing" not in counts["train"]
    elif packing == "bfd":
        assert sum(map(sum, theirs["seq_lengths"])) == sum(map(len, ours["input_ids"]))  # every sample whole
        assert masked_rows == counts["train"]["packing"]["fully_masked_rows"] == 0
    else:
        assert counts["train"]["packing"]["rows"] == len(theirs)
        assert masked_rows == counts["train"]["packing"]["fully_masked_rows"] > 0


# ------------------------------------------------------------------------------------------ BOS and end tokens

CHAT = {"messages": CONV["messages"][1:]}  # user, assistant, user, assistant
# the end-of-turn token of each family's template (tokenizer.end_of_turn's job; given here so the test checks data.py)
EOT = {"llama3": "<|eot_id|>", "gemma2": "<end_of_turn>", "mistral": "</s>", "qwen2": "<|im_end|>", "phi3": "<|end|>"}


def family_build(folder, *flags):
    r = load_recipe(["--model_name_or_path", str(folder), "--dataset_name", "data/tiny_chat", "--output_dir", "o",
                     "--chat_template_format", "tokenizer", *flags])
    tok, _, _ = load_tokenizer(r)
    return r, tok


@pytest.mark.parametrize("family", ["llama3", "gemma2", "mistral", "qwen2"])
def test_one_bos_whatever_add_special_tokens_says(family_models, family, caplog):
    writes_bos = family != "qwen2"  # Llama-3, Gemma and Mistral templates start with {{ bos_token }}
    r0, tok = family_build(family_models[family], "--add_special_tokens", "False")
    r1, _ = family_build(family_models[family], "--add_special_tokens", "True")
    assert tok.apply_chat_template(CHAT["messages"], tokenize=False).startswith(tok.bos_token or "\0") == writes_bos
    plain = tokenization.tokenize_example(CHAT, tok, r0, EOT[family])
    with caplog.at_level("INFO", logger="sftrecipes"):
        ds = tokenization.prepare(r1, tok, EOT[family], datasets_from([CHAT] * 3), "train split")
    assert ds[0]["input_ids"] == plain["input_ids"]  # one BOS either way (qwen2 has none to add)
    if writes_bos:
        assert plain["input_ids"][0] == tok.bos_token_id != plain["input_ids"][1]
    notes = [m for m in caplog.messages if m.startswith("add_special_tokens:")]
    assert len(notes) == int(writes_bos) and (not notes or "3 samples" in notes[0] and "add_special_tokens: false" in notes[0])
    if tok.bos_token is not None:  # text that starts with BOS: the same
        text = tokenization.tokenize_example({"text": tok.bos_token + "plain words"}, tok, r1, EOT[family], fmt="text")["input_ids"]
        assert text[0] == tok.bos_token_id != text[1]


def datasets_from(rows):
    return datasets.Dataset.from_list(rows)


@pytest.mark.parametrize("family", ["llama3", "gemma2", "mistral", "qwen2", "phi3"])
def test_append_concat_token_never_stacks_a_second_end(family_models, family):
    r_off, tok = family_build(family_models[family], "--append_concat_token", "False")
    r_on, _ = family_build(family_models[family], "--append_concat_token", "True")
    eot = EOT[family]
    # a conversation ends with the end of turn (phi3: then EOS): nothing appended
    assert tokenization.tokenize_example(CHAT, tok, r_on, eot)["input_ids"] == tokenization.tokenize_example(CHAT, tok, r_off, eot)["input_ids"]
    for text in ("some words", "some words" + eot, "some words" + eot + "\n", "some words" + tok.eos_token):
        off = tokenization.tokenize_example({"text": text}, tok, r_off, eot, fmt="text")["input_ids"]
        on = tokenization.tokenize_example({"text": text}, tok, r_on, eot, fmt="text")["input_ids"]
        assert on == (off + [tok.eos_token_id] if text == "some words" else off), (text, on, off)


def test_plain_text_end_of_turn_is_recognised_on_ids_and_text(tiny_model):
    """An end of turn that is not one token (rare templates): a sample ending with it gets no EOS after it, however
    the neighbouring characters merge with it."""
    r, tok, _, _ = build("--append_concat_token", "True")
    eot = "Answer end"
    alone = tok(eot, add_special_tokens=False)["input_ids"]
    assert eot not in tok.get_vocab() and tok("the " + eot, add_special_tokens=False)["input_ids"][-len(alone):] != alone  # merges
    for text in ("yes\nAnswer end", "yes Answer end \n", "the Answer end"):
        assert tok.eos_token_id not in tokenization.tokenize_example({"text": text}, tok, r, eot, fmt="text")["input_ids"], text
    assert tokenization.tokenize_example({"text": "answer"}, tok, r, eot, fmt="text")["input_ids"][-1] == tok.eos_token_id
    # a template that makes another token EOS (chatml: <|im_end|>): text ending with the model's own EOS gets none
    r, tok, eot, _ = build("--append_concat_token", "True", "--chat_template_format", "chatml")
    ids = tokenization.tokenize_example({"text": "done</s>"}, tok, r, eot, fmt="text")["input_ids"]
    assert tok.eos_token == "<|im_end|>" and tok.convert_ids_to_tokens(ids[-1:]) == ["</s>"]


# ------------------------------------------------------------------------------------------ mixtures


def mixture(entries, *flags):
    r = load_recipe(BASE[:2] + ["--output_dir", "o", "--chat_template_format", "chatml", "--datasets", json.dumps(entries), *flags])
    tok, eot, _ = load_tokenizer(r)
    return tok, data.load_datasets(r, tok, eot)


def test_mixture_draws_its_counts_under_the_seed(tiny_model, shapes):
    entries = [{"path": "data/tiny_chat", "weight": 0.25},  # 80 of 320, + its test split for eval
               {"path": str(shapes["prompt_completion"]), "weight": 2.5},  # 24 rows -> 60: each twice + 12
               {"path": str(shapes["conversations"]), "samples": 10}]
    tok, (train, evals, prompt, counts) = mixture(entries)
    drawn = [(s["rows"], s["of"]) for s in counts["mixture"]["sources"]]
    assert drawn == [(80, 320), (60, 24), (10, 24)]
    assert counts["train"]["formats"] == {"messages": 80, "prompt_completion": 60, "conversations": 10}
    assert len(train) == counts["train"]["kept"] == 150 and len(evals) == 40  # eval: the test split of entry 0, whole
    assert prompt[-1]["role"] == "user"
    texts = [tok.decode(ids) for ids in train["input_ids"]]
    plain = [t for t in texts if "Answer:" in t]
    assert len(plain) == 60 and max(plain.count(t) for t in plain) in (2, 3)  # repeats, not more
    # the same under the same seed (every rank, every run); another seed: another order and another draw
    _, (again, *_rest) = mixture(entries)
    assert again["input_ids"] == train["input_ids"]
    _, (other, *_rest) = mixture(entries, "--seed", "7")
    assert other["input_ids"] != train["input_ids"]
    assert sorted(map(tuple, other["input_ids"])) != sorted(map(tuple, train["input_ids"]))  # a different subset too


def test_mixture_columns_and_eval_splits(tiny_model, shapes):
    qa = {"path": str(shapes["qa"]), "columns": {"question": "prompt", "answer": "completion"}}
    tok, (train, evals, _, counts) = mixture([qa, {"path": "data/tiny_chat", "samples": 5, "eval_split": None}], "--splits", "train,test")
    assert counts["train"]["formats"] == {"prompt_completion": 24, "messages": 5} and evals is None
    answers = {" " + r["messages"][-1]["content"] + tok.eos_token for r in ROWS}  # chatml: EOS is <|im_end|>
    assert sum(trained_text(tok, row) in answers for row in train) == 24
    with pytest.raises(RecipeError, match=r"datasets\[0\]\.eval_split: 'test' asked of the single file"):
        mixture([{**qa, "eval_split": "test"}])
    with pytest.raises(RecipeError, match=r"datasets\[0\]\.columns: 'query' is not a column"):
        mixture([{"path": str(shapes["qa"]), "columns": {"query": "prompt"}}])
    with pytest.raises(RecipeError, match=r"eval_strategy: steps needs an eval split, but none of the named eval splits is in the data.*eval_split"):
        mixture([qa], "--eval_strategy", "steps")


@pytest.mark.parametrize("entries,flags,fragment", [
    ([{"path": "data/tiny_chat", "wieght": 2}], [], "datasets[0].wieght: unknown key; did you mean weight?"),
    ([{"path": "data/tiny_chat"}, {"path": "data/tiny_chat", "weight": 0}], [], "datasets[1].weight: must be a number > 0"),
    ([{"path": "data/tiny_chat", "weight": 0.5, "samples": 10}], [], "datasets[0].weight and datasets[0].samples are both set"),
    ([{"path": "./no/such/data.jsonl"}], [], "datasets[0].path: local path './no/such/data.jsonl' does not exist"),
    ([{"split": "train"}], [], "datasets[0].path: required"),
    ([{"path": "data/tiny_chat", "samples": 2.5}], [], "datasets[0].samples: must be a whole number"),
    ([{"path": "data/tiny_chat", "columns": ["prompt"]}], [], "datasets[0].columns: expected a mapping"),
    ([{"path": "data/tiny_chat", "format": "sharegpt"}], [], "datasets[0].format: 'sharegpt' is not a format"),
    ([{"path": "data/tiny_chat"}], ["--dataset_name", "data/tiny_chat"], "dataset_name and datasets are both set"),
    ({"path": "data/tiny_chat"}, [], "--datasets: expected a non-empty list of mappings"),
])
def test_mixture_entries_are_validated_torch_free(entries, flags, fragment):
    with pytest.raises(RecipeError) as e:
        load_recipe(["--model_name_or_path", ".assets/tiny-llama", "--output_dir", "o", "--datasets", json.dumps(entries), *flags])
    assert fragment in str(e.value) and "\n" not in str(e.value), str(e.value)


# ------------------------------------------------------------------------------------------ one short run


def test_prompt_completion_run_trains_on_the_completion_only(tiny_model, shapes, tmp_path):
    trainer, summary = train_script.run(load_recipe(
        ["--model_name_or_path", ".assets/tiny-llama", "--dataset_name", str(shapes["prompt_completion"]), "--splits", "train",
         "--output_dir", str(tmp_path), "--max_steps", "2", "--per_device_train_batch_size", "4", "--logging_steps", "1",
         "--sample_max_new_tokens", "0", "--report_to", "none", "--launch.hardware", "cpu"]))
    saved = json.loads((tmp_path / "run_summary.json").read_text())["data"]
    assert saved == summary["data"] and saved["train"]["formats"] == {"prompt_completion": len(ROWS)} and saved["train"]["kept"] == len(ROWS)
    assert len(summary["losses"]) == 2
    batch = next(iter(trainer.get_train_dataloader()))  # what the model's loss sees
    tok = trainer.processing_class
    answers = {" " + r["messages"][-1]["content"] + "</s>" for r in ROWS}
    for ids, labels in zip(batch["input_ids"].tolist(), batch["labels"].tolist()):
        assert tok.decode([t for t, label in zip(ids, labels) if label != -100]) in answers


# ------------------------------------------------------------------------------------------ TRL's data-preparation keys
# sources.TRL_DATA_KEYS says what becomes of every key TRL reads while it prepares data; these tests keep it complete
# and show each effect where it lands: the tokens and labels made here, the rows SFTTrainer prepares, its batches.

# What SFTTrainer.__init__/_prepare_dataset/evaluate read that is not about the data (covered elsewhere).
NOT_DATA_PREP = {
    "accelerator_config": "accelerate's set-up", "activation_offloading": "activation memory (a model wrapper)",
    "ddp_find_unused_parameters": "DDP wrapping", "deepspeed_plugin": "DeepSpeed set-up", "distributed_state": "process group",
    "gradient_checkpointing": "activation memory", "gradient_checkpointing_kwargs": "activation memory",
    "hub_token": "hub push", "label_smoothing_factor": "the loss (test_options_reach.py effect test)",
    "liger_kernel_config": "Liger kernels (GPU)", "use_liger_kernel": "Liger kernels (GPU)",
    "loss_type": "the loss (test_options_reach.py effect test)", "model_init_kwargs": "model loading (model.py)",
    "n_gpu": "device count", "per_device_train_batch_size": "the batch (read by TRL's data set-up for a warning only)", "router_aux_loss_coef": "MoE loss (test_lora.py / test_families.py)",
    "to_dict": "a method, not a field", "trust_remote_code": "model/tokenizer loading (model.py)",
}


def trl_reads() -> set[str]:
    """Every `args.X` / `self.args.X` SFTTrainer's data set-up reads, plus every field SFTConfig adds to TrainingArguments."""

    names = set()
    for fn in (SFTTrainer.__init__, SFTTrainer._prepare_dataset, SFTTrainer.evaluate):
        for n in ast.walk(ast.parse(textwrap.dedent(inspect.getsource(fn)))):
            if isinstance(n, ast.Attribute) and (
                    (isinstance(n.value, ast.Name) and n.value.id == "args")
                    or (isinstance(n.value, ast.Attribute) and n.value.attr == "args" and getattr(n.value.value, "id", "") == "self")):
                names.add(n.attr)
    own = {f.name for f in dataclasses.fields(SFTConfig)} - {f.name for f in dataclasses.fields(TrainingArguments)}
    return names | (own - {"learning_rate"})


def test_every_trl_data_key_is_classified():
    """A TRL upgrade that reads a new field while preparing data fails here until TRL_DATA_KEYS says what becomes of it."""

    reads = trl_reads()
    unclassified = reads - set(sources.TRL_DATA_KEYS) - set(NOT_DATA_PREP)
    assert not unclassified, f"classify in sources.TRL_DATA_KEYS (pipeline/trainer/refused, with the reason): {sorted(unclassified)}"
    fields = {f.name for f in dataclasses.fields(SFTConfig)}
    assert set(sources.TRL_DATA_KEYS) <= fields and set(sources.TRL_DATA_KEYS) <= reads
    assert {how for how, _ in sources.TRL_DATA_KEYS.values()} == {"pipeline", "trainer", "refused"}
    # applied here, so never handed to TRL to apply again
    assert set(sources.CONSUMED_BY_PIPELINE) <= {k for k, (how, _) in sources.TRL_DATA_KEYS.items() if how == "pipeline"}


@pytest.mark.parametrize("flags, fragment", [
    (["--dataset_kwargs", '{"skip_prepare_dataset": true}'], "dataset_kwargs: .* remove dataset_kwargs"),
    (["--dataset_kwargs", '{"num_proc": 2}'], "dataset_kwargs: .* remove dataset_kwargs"),
    (["--padding_free", "True"], "padding_free: true without packing .* set packing: true .* or max_length: null"),
    (["--eval_packing", "True", "--max_length", "null"], "eval_packing: true needs max_length"),
])
def test_refused_data_keys_are_one_line_errors_and_the_fix_loads(flags, fragment):
    with pytest.raises(RecipeError, match="^" + fragment) as e:
        load_recipe(BASE + flags)
    assert "\n" not in str(e.value)
    fix = {"--padding_free": ["--packing", "True"], "--eval_packing": ["--max_length", "64"]}.get(flags[0])
    if fix:
        load_recipe(BASE + flags[:2] + fix)


def trainer_for(tmp_path, *flags):
    """(trainer, our prepared train split, our eval split or None): SFTTrainer built as train.py builds it."""

    r, tok, eot, _ = build("--chat_template_format", "chatml", "--max_length", "48", "--output_dir", str(tmp_path / "o"),
                           "--launch.hardware", "cpu", "--per_device_train_batch_size", "4", *flags)
    train, evals, _, _ = data.load_datasets(r, tok, eot)
    trainer = SFTTrainer(model=models.load_model(r, tok, "cpu"), args=backends.training_args(r, "cpu"),
                         train_dataset=train, eval_dataset=evals, processing_class=tok)
    return trainer, train, evals


def first_batch(trainer):
    return next(iter(trainer.get_train_dataloader()))


def test_pad_to_multiple_of_and_pad_token_shape_the_batches(tiny_model, tmp_path):
    """Both act in TRL's collator: the batch is padded to a multiple of 13 with the named pad token (the default pads
    to the longest sample with the tokenizer's own pad)."""
    trainer, _, _ = trainer_for(tmp_path, "--splits", "train", "--pad_to_multiple_of", "13", "--pad_token", "<unk>")
    tok = trainer.processing_class
    unk = tok.convert_tokens_to_ids("<unk>")
    for batch in [first_batch(trainer) for _ in range(3)]:
        width, longest = batch["input_ids"].shape[1], int(batch["attention_mask"].sum(1).max())
        assert width == -(-longest // 13) * 13 and width % 13 == 0
        pads = batch["input_ids"][batch["attention_mask"] == 0]
        assert len(pads) and (pads == unk).all() and (batch["labels"][batch["attention_mask"] == 0] == -100).all()
    assert tok.pad_token == "<unk>" and trainer.model.config.pad_token_id == unk
    default, _, _ = trainer_for(tmp_path, "--splits", "train")
    batch = first_batch(default)
    assert batch["input_ids"].shape[1] == int(batch["attention_mask"].sum(1).max())
    assert (batch["input_ids"][batch["attention_mask"] == 0] == default.processing_class.pad_token_id).all()
    assert default.processing_class.pad_token_id != unk


def test_padding_free_flattens_each_batch(tiny_model, tmp_path):
    """padding_free (with wrapped packing, which is not padding-free by itself): one row, position_ids restarting at
    each packed row, no attention mask, no pad."""
    flags = ("--splits", "train", "--packing", "True", "--packing_strategy", "wrapped")
    padded = first_batch(trainer_for(tmp_path, *flags)[0])
    assert padded["input_ids"].shape[0] == 4 and "attention_mask" in padded
    trainer, _, _ = trainer_for(tmp_path, *flags, "--padding_free", "True")
    flat = first_batch(trainer)
    assert flat["input_ids"].shape[0] == 1 and "attention_mask" not in flat
    assert flat["input_ids"].shape[1] == 4 * 48 and (flat["position_ids"][0] == 0).sum() >= 4


def test_shuffle_dataset_orders_the_prepared_rows_under_seed(tiny_model, tmp_path):
    trainer, ours, _ = trainer_for(tmp_path, "--splits", "train", "--shuffle_dataset", "True", "--seed", "5")
    theirs = trainer.train_dataset["input_ids"]
    assert theirs == ours.shuffle(seed=5)["input_ids"] and theirs != ours["input_ids"]
    assert sorted(map(tuple, theirs)) == sorted(map(tuple, ours["input_ids"]))  # the same rows, another order
    plain, ours, _ = trainer_for(tmp_path, "--splits", "train")
    assert plain.train_dataset["input_ids"] == ours["input_ids"]


@pytest.mark.parametrize("packing, eval_packing", [("False", "True"), ("True", "False")])
def test_eval_packing_packs_the_eval_split_alone(tiny_model, tmp_path, packing, eval_packing):
    trainer, train, evals = trainer_for(tmp_path, "--splits", "train,test", "--packing", packing, "--eval_packing", eval_packing)
    packed = {"train": "seq_lengths" in trainer.train_dataset.column_names, "eval": "seq_lengths" in trainer.eval_dataset.column_names}
    assert packed == {"train": packing == "True", "eval": eval_packing == "True"}
    n_eval = len(trainer.eval_dataset)
    assert (n_eval < len(evals)) if eval_packing == "True" else (n_eval == len(evals))


def test_pad_token_outside_the_vocabulary_is_refused_before_the_model_loads(tiny_model):
    r, tok, eot, _ = build("--pad_token", "<nope>")
    with pytest.raises(RecipeError, match="^pad_token: '<nope>' is not in the tokenizer's vocabulary; pick a token it has"):
        data.load_datasets(r, tok, eot)


def test_eos_token_ends_text_samples(tiny_model, tmp_path):
    f = write_jsonl(tmp_path / "t.jsonl", [{"text": "plain words"}])
    for eos in ("<|im_end|>", "<|im_start|>"):
        r, tok, eot, _ = build("--dataset_name", str(f), "--splits", "train", "--append_concat_token", "True", "--eos_token", eos)
        row = tokenization.prepare(r, tok, eot, data.load_raw(r)[0], "train")[0]
        assert row["input_ids"][-1] == tok.convert_tokens_to_ids(eos) and tok.eos_token == eos


def test_dataset_num_proc_maps_in_that_many_processes(tiny_model, tmp_path, monkeypatch):
    seen = tmp_path / "pids"
    seen.mkdir()
    real = tokenization._prepare_table  # the function datasets maps (its closure gives the map a fingerprint of its own,
    # so no earlier run's cache file answers in place of the workers)

    def spy(table, *a, **kw):
        (seen / str(os.getpid())).touch()
        return real(table, *a, **kw)

    monkeypatch.setattr(tokenization, "_prepare_table", spy)
    for n in (1, 2):
        for p in seen.iterdir():
            p.unlink()
        r, tok, eot, _ = build("--splits", "train", "--chat_template_format", "chatml", "--dataset_num_proc", str(n))
        data.load_datasets(r, tok, eot)
        assert len(list(seen.iterdir())) == n


def test_a_template_error_never_suggests_the_template_in_use_and_image_parts_are_named(tiny_model):
    """Issue 37: content given as parts fails under chatml and zephyr; the hint names the recipe's template and
    suggests something else, never the template in use. A row whose content holds an image part is refused as such
    wherever its split was not counted before (a streamed split), not as a template error."""
    from sftrecipes.data.chat import Chat

    parts = [{"role": "user", "content": [{"type": "text", "text": "What is this?"}]},
             {"role": "assistant", "content": [{"type": "text", "text": "A cat."}]}]
    for fmt in ("chatml", "zephyr"):
        r = load_recipe(["recipes/tiny/lora.yaml", "--chat_template_format", fmt])
        tok, _, _ = load_tokenizer(r)
        chat = Chat(tok, r, {}, "row 0 of the test")
        with pytest.raises(RecipeError) as e:
            chat.apply(chat.messages(parts))
        msg = str(e.value)
        assert f"chat_template_format: {fmt} (this recipe's) renders text" in msg and "or zephyr" not in msg, msg
    image = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]}]
    with pytest.raises(RecipeError, match=r"messages: row 0 of the test, message 0 holds an image part"):
        chat.messages(image)

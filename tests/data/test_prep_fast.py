"""Data preparation's batched road (tokenization._prepare_batch: rows rendered by chat.Chat's fast road, a batch
tokenized in one call, labels from the offsets with numpy, worker processes) against the per-row reference
(tokenization._prepare_row / tokenize_example): the same text, input_ids, labels, _status, _bos_removed and
_unrendered, column types included, for every data format and option that shapes them and every tiny family's
tokenizer and template; an error is the same line naming the same row."""

import json
import random

import datasets
import numpy as np
import pytest
from test_tool_calls import QWEN_LIKE, TEXT_ONLY, THINKING_SWITCH, WEATHER
from test_tool_calls import ROWS as TOOL_ROWS

from sftrecipes.data import chat
from sftrecipes.data import load as data
from sftrecipes.data import fastencode
from sftrecipes.data import tokenization
from sftrecipes.core.errors import RecipeError
from sftrecipes.data.formats import detect_format
from sftrecipes.recipe.load import load_recipe
from sftrecipes.data.tokenizer import load_tokenizer, render_plain_turns
from sftrecipes.data.tokenization import CUT_AWAY, CUT_KEPT, FULLY_MASKED, KEPT

TINY = ".assets/tiny-llama"
CHATML = ("--chat_template_format", "chatml")
ROWS = [json.loads(line) for line in open("data/tiny_chat/train.jsonl")][:14]


def words(word: str, n: int) -> str:
    return " ".join([word] * n)


# beside the shipped rows: a long answer (cut), an answer past the cut, no assistant turn, an empty answer, a trailing
# user turn, several turns
MESSAGES = ROWS + [
    {"messages": [{"role": "user", "content": "Tell me."}, {"role": "assistant", "content": words("river", 60)}]},
    {"messages": [{"role": "system", "content": "You answer briefly."}, {"role": "user", "content": words("apple", 50)},
                  {"role": "assistant", "content": "Yes."}]},
    {"messages": [{"role": "user", "content": "only a question"}]},
    {"messages": [{"role": "user", "content": "Say nothing."}, {"role": "assistant", "content": ""}]},
    {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."},
                  {"role": "user", "content": words("stone", 20)}]},
    {"messages": [m for r in ROWS[:4] for m in r["messages"] if m["role"] != "system"]},
]
SHAREGPT = [{"conversations": [{"from": {"user": "human", "assistant": "gpt"}.get(m["role"], m["role"]), "value": m["content"]}
                               for m in r["messages"]]} for r in MESSAGES]
PC_CHAT = [{"prompt": r["messages"][:-1], "completion": r["messages"][-1:]} for r in MESSAGES
           if len(r["messages"]) > 1 and r["messages"][-1]["role"] == "assistant"]
PC_TEXT = ([{"prompt": " ".join(m["content"] for m in r["messages"][:-1]) + "\nAnswer:", "completion": " " + r["messages"][-1]["content"]}
            for r in ROWS] + [{"prompt": words("apple", 60) + "\nAnswer:", "completion": " Yes."},
                              {"prompt": "Q:", "completion": ""}, {"prompt": "Q:", "completion": " done</s>"}])
TEXT = [{"text": p["prompt"] + p["completion"]} for p in PC_TEXT] + [
    {"text": t} for t in ("done</s>", "done<|im_end|>", "done<|im_end|>\n", "<s>starts with BOS", "a", "", words("cloud", 70))]

# the tool rows as Arrow structs (parquet): dict arguments of different names, tools a list (test_tool_calls)
TOOL_STRUCTS = json.loads(json.dumps(TOOL_ROWS))
TOOL_STRUCTS[1]["messages"][1]["tool_calls"][0]["function"]["arguments"] = {"query": "tiny models"}
for _row in TOOL_STRUCTS:
    _row["tools"] = [WEATHER] if "tools" in _row else None

SHAPES = {"messages": MESSAGES, "conversations": SHAREGPT, "pc_chat": PC_CHAT, "pc_text": PC_TEXT, "text": TEXT, "tools": TOOL_ROWS}


@pytest.fixture(autouse=True)
def _no_map_cache():
    """Every map prepares (a cached result would compare an older preparation)."""
    was = datasets.is_caching_enabled()
    datasets.disable_caching()
    yield
    if was:
        datasets.enable_caching()


def setup(tmp_path, rows, flags, model=TINY, name="d.jsonl"):
    f = tmp_path / name
    if name.endswith(".parquet"):
        datasets.Dataset.from_list(rows).to_parquet(str(f))
    else:
        f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    r = load_recipe(["--model_name_or_path", str(model), "--dataset_name", str(f), "--splits", "train",
                     "--output_dir", str(tmp_path / "o"), *flags])
    tok, eot, _ = load_tokenizer(r)
    ds = data.load_raw(r)[0]
    return r, tok, eot, ds, detect_format(r, ds.column_names, "train split", r.data.dataset_format)


def reference(r, tok, eot, ds, fmt, source="train split"):
    kw = dict(tokenizer=tok, recipe=r, eot=eot, fmt=fmt, ends=tokenization.end_ids(tok, eot), source=source, rows=None,
              structs=chat.arrow_structs(ds.features))
    return ds.map(tokenization._prepare_row, with_indices=True, fn_kwargs=kw, remove_columns=ds.column_names)


def outcome(prepare):
    try:
        return prepare(), None
    except RecipeError as e:
        return None, str(e)


def differences(fast, ref) -> list[tuple[int, str]]:
    """(row, column) where the two preparations differ; the column types first (row -1)."""
    if fast.features != ref.features or fast.column_names != ref.column_names:
        return [(-1, f"columns {fast.features} != {ref.features}")]
    a, b = fast.to_dict(), ref.to_dict()
    return [(i, c) for c in b for i, (x, y) in enumerate(zip(a[c], b[c])) if x != y] + [(-1, "rows")] * (len(fast) != len(ref))


def compare(tmp_path, rows, flags, model=TINY, name="d.jsonl"):
    """Both preparations of rows under flags: the reference's dataset when they agree, or the error both raised."""
    r, tok, eot, ds, fmt = setup(tmp_path, rows, flags, model, name)
    ref, ref_error = outcome(lambda: reference(r, tok, eot, ds, fmt))
    fast, fast_error = outcome(lambda: tokenization.tokenize_split(r, tok, eot, ds, "train split", fmt))
    assert fast_error == ref_error
    if ref_error is None:
        diff = differences(fast, ref)
        assert not diff, f"{len(diff)} differences, first {diff[:5]}: {fast[diff[0][0]]} != {ref[diff[0][0]]}"
    return ref, ref_error


def seen(ds) -> dict:
    return {"status": set(ds["_status"]), "bos_removed": any(ds["_bos_removed"]), "unrendered": any(ds["_unrendered"])}


AOL = ("--assistant_only_loss", "True")
CUT = ("--max_length", "48")
ENDS = ("--add_special_tokens", "True", "--append_concat_token", "True")
ALL = {KEPT, FULLY_MASKED, CUT_AWAY, CUT_KEPT}
CASES = [  # (shape, flags, what the reference must show: the case exercises it)
    ("messages", CHATML, {KEPT}),
    ("messages", (*CHATML, *AOL, *CUT), ALL),
    ("messages", (*CHATML, *AOL, *CUT, "--truncation_mode", "keep_end", *ENDS), {KEPT, FULLY_MASKED, CUT_KEPT}),
    ("messages", ("--chat_template_format", "zephyr", *AOL, *ENDS), {KEPT, FULLY_MASKED}),
    ("messages", ("--chat_template_format", "tokenizer", *CUT), {KEPT, CUT_KEPT}),
    ("conversations", (*CHATML, *AOL, *CUT), ALL),
    ("pc_chat", (*CHATML, *CUT), {KEPT, CUT_KEPT, CUT_AWAY}),  # an empty completion still trains its end of turn
    ("pc_chat", (*CHATML, *AOL, "--completion_only_loss", "False", *ENDS), {KEPT}),
    ("pc_text", CUT, {KEPT, CUT_AWAY}),  # an empty completion trains its EOS
    ("pc_text", ("--completion_only_loss", "False", *CUT, "--truncation_mode", "keep_end", *ENDS), {KEPT, CUT_KEPT}),
    ("text", ENDS, {KEPT}),
    ("text", ("--max_length", "16", "--truncation_mode", "keep_end"), {KEPT, CUT_KEPT, FULLY_MASKED}),
    ("text", (*CHATML, "--append_concat_token", "True"), {KEPT, FULLY_MASKED}),  # "": EOS alone
    ("tools", (*CHATML, *AOL), {KEPT}),
    ("tools", ("--chat_template_format", "zephyr", *AOL, *ENDS), {KEPT}),
]


@pytest.mark.parametrize("shape,flags,shows", CASES, ids=[f"{s}-{i}" for i, (s, _, _) in enumerate(CASES)])
def test_every_format_and_option_prepares_as_the_reference(tiny_model, tmp_path, shape, flags, shows):
    ref, error = compare(tmp_path, SHAPES[shape], flags)
    assert error is None and seen(ref)["status"] == shows
    if "--add_special_tokens" in flags and shape != "pc_text":
        assert seen(ref)["bos_removed"] == (shape == "text")  # "<s>starts with BOS": the second BOS removed


@pytest.mark.parametrize("template,flags,name", [
    (QWEN_LIKE, AOL, "d.jsonl"),  # tools in the system turn, reasoning, calls: the compiled template, no plain turns
    (TEXT_ONLY, AOL, "d.jsonl"),  # leaves tool calls, reasoning and tools out: _unrendered
    (QWEN_LIKE, (), "d.parquet"),  # arguments and tools as Arrow structs
])
def test_tool_calls_reasoning_and_templates_of_the_tokenizer(tiny_model, tmp_path, template, flags, name):
    (tmp_path / "t.jinja").write_text(template)
    ref, _ = compare(tmp_path, TOOL_STRUCTS if name.endswith(".parquet") else TOOL_ROWS, ("--chat_template_format", "tokenizer", "--chat_template_path", str(tmp_path / "t.jinja"), *flags),
                     name=name)
    assert seen(ref)["unrendered"] == (template == TEXT_ONLY)


def test_a_rows_template_arguments(tiny_model, tmp_path):
    talk = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]
    rows = [{"messages": talk, "chat_template_kwargs": {"enable_thinking": False}},
            {"messages": talk, "chat_template_kwargs": json.dumps({"enable_thinking": True})},
            {"messages": talk, "chat_template_kwargs": {"enable_thinking": None, "add_generation_prompt": True}}]
    (tmp_path / "t.jinja").write_text(THINKING_SWITCH)
    ref, _ = compare(tmp_path, rows, ("--chat_template_format", "tokenizer", "--chat_template_path", str(tmp_path / "t.jinja"), *AOL))
    assert "<think>" in ref[0]["text"] and ref[2]["text"].endswith("<|im_start|>assistant\n")  # apply's own argument


FAMILY_FLAGS = [(), (*AOL, *ENDS, "--max_length", "40")]


@pytest.mark.parametrize("flags", FAMILY_FLAGS, ids=["plain", "masked-cut-ends"])
def test_every_familys_tokenizer_and_template(family_models, tmp_path, flags):
    for family, folder in family_models.items():
        ref, error = compare(tmp_path, MESSAGES, ("--chat_template_format", "tokenizer", *flags), model=folder)
        if family == "phi3" and AOL[0] in flags:  # its template ends a conversation with eos, a prefix without: refused
            assert error.startswith("assistant_only_loss: the chat template renders a conversation's prefix differently")
            continue
        assert error is None, (family, error)
        if flags and family in ("llama3", "gemma2", "gemma3", "mistral", "mixtral"):  # templates that write BOS
            assert seen(ref)["bos_removed"], family


def test_ids_without_offsets_are_the_tokenizer_calls_ids(family_models):
    """fastencode.encode's road without offsets (the Rust encode_batch_fast) gives every family's tokenizer call's ids,
    with and without special tokens, special tokens in the text split or not; and a tokenizer with its own encoding
    is called as it is."""
    texts = ["<|im_start|>user\nHi there<|im_end|>\n", "", "  two  spaces\tand a tab \u00e9\u4e2d ", "</s><s>a<unk>b"]
    for family, folder in {"tiny": TINY, **family_models}.items():
        tok, _, _ = load_tokenizer(load_recipe(["recipes/tiny/lora.yaml", "--model_name_or_path", str(folder), "--output_dir", "/tmp/x"]))
        assert fastencode._plain_fast(tok), family
        for split in (False, True):
            tok.split_special_tokens = split
            for special in (False, True):
                want = tok(texts, add_special_tokens=special)["input_ids"]
                tok.split_special_tokens = not split  # encode sets the backend's state from the tokenizer's, as the call does
                tok._tokenizer.encode_special_tokens = not split
                tok.split_special_tokens = split
                assert fastencode.encode(tok, texts, special, False) == (want, None), (family, split, special)
        tok.split_special_tokens = False

    class OwnEncoding(type(tok)):
        def _encode_plus(self, *a, **kw):
            calls.append(kw.get("text", a[0] if a else None))
            return super()._encode_plus(*a, **kw)

    calls = []
    tok.__class__ = OwnEncoding
    assert not fastencode._plain_fast(tok)
    assert fastencode.encode(tok, texts, False, False)[0] == tok(texts, add_special_tokens=False)["input_ids"]
    assert calls and calls[0] == texts


def test_worker_processes_prepare_the_same_rows_and_raise_the_same_error(tiny_model, tmp_path, monkeypatch):
    rows = MESSAGES * 3
    monkeypatch.setattr(tokenization, "BATCH_ROWS", 7)  # several batches a worker, the last one short
    compare(tmp_path, rows, (*CHATML, *AOL, *CUT, "--dataset_num_proc", "2"))
    bad = json.loads(json.dumps(rows))
    bad[len(rows) - 2]["messages"][0] = "not a message"  # in the second worker's half
    _, error = compare(tmp_path, bad, (*CHATML, "--dataset_num_proc", "2"))
    assert error == f"messages: row {len(rows) - 2} of train split, message 0 is not a role/content object; fix the data"


@pytest.mark.parametrize("edit,fragment", [
    ({"content": None}, "chat_template_path: the chat template fails on row 3 of train split (UndefinedError"),
    ({"tool_calls": [{"type": "function", "function": {"name": ""}}]}, "tool_calls: row 3 of train split, message 1, tool call 0 has no function name"),
])
def test_an_error_names_the_row_the_reference_names(tiny_model, tmp_path, edit, fragment):
    rows = json.loads(json.dumps(ROWS))
    rows[3]["messages"][1].update(edit)
    (tmp_path / "t.jinja").write_text("{% for m in messages %}{{ m['role'] + m['content'] }}{% endfor %}")
    _, error = compare(tmp_path, rows, ("--chat_template_format", "tokenizer", "--chat_template_path", str(tmp_path / "t.jinja")))
    assert error.startswith(fragment) and "\n" not in error


def test_a_batch_the_fast_road_fails_is_prepared_row_by_row(tiny_model, tmp_path, monkeypatch, caplog):
    def broken(*a, **kw):
        raise RuntimeError("broken")

    monkeypatch.setattr(tokenization, "_fast_batch", broken)
    with caplog.at_level("WARNING", logger="sftrecipes"):
        compare(tmp_path, MESSAGES, (*CHATML, *AOL))
    assert "the batched preparation failed (RuntimeError: broken) where the row-by-row one did not" in caplog.text


def test_the_comparison_catches_an_off_by_one(tiny_model, tmp_path, monkeypatch):
    """The cases above can fail: labels shifted by one token, or a plain turn rendered without its last newline,
    differ from the reference on their rows."""
    real = tokenization._trained
    monkeypatch.setattr(tokenization, "_trained", lambda *a: np.roll(real(*a), 1))
    r, tok, eot, ds, fmt = setup(tmp_path, MESSAGES, (*CHATML, *AOL))
    diff = differences(tokenization.tokenize_split(r, tok, eot, ds, "train split", fmt), reference(r, tok, eot, ds, fmt))
    assert {c for _, c in diff} == {"labels"} and len(diff) > len(MESSAGES) // 2
    monkeypatch.setattr(tokenization, "_trained", real)
    monkeypatch.setattr(chat, "render_plain_turns", lambda *a: (lambda t: t and t[:-1])(render_plain_turns(*a)))
    diff = differences(tokenization.tokenize_split(r, tok, eot, ds, "train split", fmt), reference(r, tok, eot, ds, fmt))
    assert {"text", "input_ids"} <= {c for _, c in diff}


@pytest.mark.parametrize("fmt", ["chatml", "zephyr"])
def test_plain_turns_render_as_the_template(tiny_model, fmt):
    r = load_recipe(["--model_name_or_path", TINY, "--dataset_name", "data/tiny_chat", "--output_dir", "o", "--chat_template_format", fmt])
    tok, _, _ = load_tokenizer(r)
    rng = random.Random(0)
    roles = ["system", "user", "assistant", "tool", "x {role} |>", ""]
    contents = ["", "plain", "{role} {eos_token}", "line\nbreak ", " <|im_end|> </s> ", "ünïcødé ✓", "{{ messages }}{% if %}"]
    for _ in range(200):
        msgs = [{"role": rng.choice(roles), "content": rng.choice(contents)} for _ in range(rng.randint(1, 5))]
        gen = rng.random() < 0.5
        assert render_plain_turns(tok, msgs, gen) == tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)
    for msgs in ([{"role": "user", "content": "a", "name": "x"}], [{"role": "user"}], [{"role": "user", "content": 1}], []):
        assert render_plain_turns(tok, msgs) is None  # not plain turns: the template renders them
    tok.chat_template = tok.chat_template + " "
    assert render_plain_turns(tok, [{"role": "user", "content": "a"}]) is None  # another template


def test_worker_processes_follow_the_cores_and_the_split(tiny_model, monkeypatch):
    r = load_recipe(["--model_name_or_path", TINY, "--dataset_name", "data/tiny_chat", "--output_dir", "o"])
    monkeypatch.setattr(tokenization.os, "sched_getaffinity", lambda pid: set(range(6)), raising=False)
    per = tokenization.ROWS_PER_WORKER
    assert tokenization.workers(r, per) is None and tokenization.workers(r, 2 * per - 1) is None  # this process
    assert tokenization.workers(r, 3 * per) == 3 and tokenization.workers(r, 100 * per) == 6
    r.trl["dataset_num_proc"] = 1
    assert tokenization.workers(r, 100 * per) == 1  # asked: as asked

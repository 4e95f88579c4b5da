"""Tool calls, tool turns, `content: null` and reasoning in chat data (sftrecipes/data/chat.py, docs/chat_data.md): they
reach a template that renders them (the tokenizer's own, with the row's `tools`), the project's templates render them
as documented, a template that leaves them out is counted on the data line, and a row a template cannot render is
one line naming it. Under assistant_only_loss an assistant tool-call turn is trained, a tool turn is not."""

import json
import logging

import datasets
import pytest

from sftrecipes.data import load as data
from sftrecipes.core.errors import RecipeError
from sftrecipes.recipe.load import load_recipe
from sftrecipes.data.tokenizer import load_tokenizer

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
# row 0: content null, dict arguments, reasoning, a tool turn (tool_call_id), the row's tools as a JSON string;
# row 1: content "", arguments as a JSON string, a tool turn (name), reasoning on the final answer, no tools
ROWS = [
    {"messages": [
        {"role": "system", "content": "You answer briefly."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "reasoning_content": "I should ask the weather tool.",
         "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "22 C and clear"},
        {"role": "assistant", "content": "It is clear."}],
     "tools": json.dumps([WEATHER])},
    {"messages": [
        {"role": "user", "content": "Find tiny models."},
        {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": "search", "arguments": '{"query": "tiny models"}'}}]},
        {"role": "tool", "name": "search", "content": "three results"},
        {"role": "assistant", "content": "Found three.", "reasoning_content": "Three came back."}]},
]
WEATHER_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
SEARCH_CALL = '<tool_call>\n{"name": "search", "arguments": {"query": "tiny models"}}\n</tool_call>'

# A tokenizer's own template shaped like Qwen3's: tools in the system turn, reasoning in <think>, calls as JSON in
# <tool_call>, tool results in a user turn as <tool_response>.
QWEN_LIKE = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n<tools>' }}{%- for t in tools %}{{- '\\n' + (t | tojson) }}{%- endfor %}{{- '\\n</tools><|im_end|>\\n' }}{%- endif %}"
    "{%- for m in messages %}{%- if m.role == 'system' and tools %}"
    "{%- elif m.role == 'tool' %}{{- '<|im_start|>user\\n<tool_response>\\n' + m.content + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\\n' }}"
    "{%- if m.reasoning_content %}{{- '<think>\\n' + m.reasoning_content + '\\n</think>\\n\\n' }}{%- endif %}"
    "{%- if m.content is string %}{{- m.content }}{%- endif %}"
    "{%- for tc in m.tool_calls or [] %}{%- set f = tc.function if tc.function is defined else tc %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' + f.name + '\", \"arguments\": ' + (f.arguments if f.arguments is string else f.arguments | tojson) + '}\\n</tool_call>' }}"
    "{%- endfor %}{{- '<|im_end|>\\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# A template that renders role and text only (null content as empty): tool calls, reasoning and tools are lost.
TEXT_ONLY = ("{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' + (m.content if m.content is string else '') + '<|im_end|>\\n' }}"
             "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
# The project's ChatML template before it rendered tool calls: null content is an undefined value to it.
TEXT_STRICT = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
               "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def prepared(tmp_path, rows, *flags, template=None, name="d.jsonl"):
    f = tmp_path / name
    if name.endswith(".parquet"):
        datasets.Dataset.from_list(rows).to_parquet(str(f))
    else:
        write_jsonl(f, rows)
    if template is not None:
        (tmp_path / "t.jinja").write_text(template)
        flags = ("--chat_template_format", "tokenizer", "--chat_template_path", str(tmp_path / "t.jinja"), *flags)
    r = load_recipe(["--model_name_or_path", ".assets/tiny-llama", "--dataset_name", str(f), "--splits", "train",
                     "--output_dir", str(tmp_path / "o"), *flags])
    tok, eot, _ = load_tokenizer(r)
    train, _, _, counts = data.load_datasets(r, tok, eot)
    return tok, train, counts["train"]


def trained(tok, row):
    return tok.decode([t for t, label in zip(row["input_ids"], row["labels"]) if label != -100])


def data_line(caplog):
    lines = [rec for rec in caplog.records if rec.getMessage().startswith("data: train split:")]
    assert len(lines) == 1
    return lines[0]


def test_the_tokenizers_own_template_gets_tool_calls_reasoning_and_tools(tiny_model, tmp_path, caplog):
    with caplog.at_level("INFO", logger="sftrecipes"):
        tok, ds, counts = prepared(tmp_path, ROWS, "--assistant_only_loss", "True", template=QWEN_LIKE)
    first, second = ds["text"]
    assert first.startswith("<|im_start|>system\nYou answer briefly.\n\n# Tools\n<tools>\n" + json.dumps(WEATHER) + "\n</tools><|im_end|>\n")
    assert "<|im_start|>assistant\n<think>\nI should ask the weather tool.\n</think>\n\n\n" + WEATHER_CALL + "<|im_end|>\n" in first
    assert "<|im_start|>user\n<tool_response>\n22 C and clear\n</tool_response><|im_end|>\n" in first
    assert "\n" + SEARCH_CALL + "<|im_end|>" in second  # JSON-string arguments: the same object as dict arguments
    assert "<think>\nThree came back.\n</think>\n\nFound three." in second and "# Tools" not in second  # no tools: none
    assert counts["not_rendered"] == {"tool_calls": 0, "reasoning_content": 0, "tool turns": 0, "tools": 0}
    assert "not rendered" not in data_line(caplog).getMessage()
    # the assistant turns are trained whole (reasoning, calls, end of turn), the tool results, tools and user text not
    assert trained(tok, ds[0]) == "<think>\nI should ask the weather tool.\n</think>\n\n\n" + WEATHER_CALL + "<|im_end|>\nIt is clear.<|im_end|>\n"
    assert trained(tok, ds[1]) == "\n" + SEARCH_CALL + "<|im_end|>\n<think>\nThree came back.\n</think>\n\nFound three.<|im_end|>\n"


def test_the_projects_templates_render_them_as_documented(tiny_model, tmp_path):
    tok, ds, counts = prepared(tmp_path, ROWS, "--chat_template_format", "chatml", "--assistant_only_loss", "True")
    assert ds[0]["text"] == (
        "<|im_start|>system\nYou answer briefly.\n\n# Tools\nThe functions you may call, one JSON schema a line:\n<tools>\n"
        + json.dumps(WEATHER) + "\n</tools>\nA call is a JSON object {\"name\": ..., \"arguments\": {...}} between <tool_call> "
        "and </tool_call>.<|im_end|>\n"
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nI should ask the weather tool.\n</think>\n\n" + WEATHER_CALL + "<|im_end|>\n"
        "<|im_start|>tool\n22 C and clear<|im_end|>\n"
        "<|im_start|>assistant\nIt is clear.<|im_end|>\n")
    assert ds[1]["text"] == (
        "<|im_start|>user\nFind tiny models.<|im_end|>\n<|im_start|>assistant\n" + SEARCH_CALL + "<|im_end|>\n"
        "<|im_start|>tool\nthree results<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nThree came back.\n</think>\n\nFound three.<|im_end|>\n")
    assert not any(counts["not_rendered"].values())
    assert trained(tok, ds[0]) == "<think>\nI should ask the weather tool.\n</think>\n\n" + WEATHER_CALL + "<|im_end|>\nIt is clear.<|im_end|>\n"
    assert trained(tok, ds[1]) == SEARCH_CALL + "<|im_end|>\n<think>\nThree came back.\n</think>\n\nFound three.<|im_end|>\n"
    # ShareGPT turns keep their fields; zephyr renders the same pieces in its own turns
    sharegpt = [{"conversations": [{"from": {"user": "human", "assistant": "gpt"}.get(m["role"], m["role"]),
                                    "value": m["content"], **{k: v for k, v in m.items() if k not in ("role", "content")}}
                                   for m in r["messages"]], **({"tools": r["tools"]} if "tools" in r else {})} for r in ROWS]
    _, conv, _ = prepared(tmp_path, sharegpt, "--chat_template_format", "chatml", "--assistant_only_loss", "True", name="s.jsonl")
    assert conv["input_ids"] == ds["input_ids"] and conv["labels"] == ds["labels"]
    _, zephyr, counts = prepared(tmp_path, ROWS, "--chat_template_format", "zephyr")
    assert "<|assistant|>\n<think>\nI should ask the weather tool.\n</think>\n\n" + WEATHER_CALL + "</s>\n<|tool|>\n22 C and clear</s>\n" in zephyr[0]["text"]
    assert "<tools>\n" + json.dumps(WEATHER) + "\n</tools>" in zephyr[0]["text"] and not any(counts["not_rendered"].values())


def test_arrow_structs_add_no_null_arguments(tiny_model, tmp_path):
    """Dict arguments of different names stored as an Arrow struct (parquet): each call gets every name of the column,
    null where it had none; those nulls are not the data's and are not rendered."""
    rows = json.loads(json.dumps(ROWS))
    rows[1]["messages"][1]["tool_calls"][0]["function"]["arguments"] = {"query": "tiny models"}
    for r in rows:
        r["tools"] = [WEATHER] if "tools" in r else None
    _, from_json, _ = prepared(tmp_path, rows, "--chat_template_format", "chatml")
    _, from_parquet, _ = prepared(tmp_path, rows, "--chat_template_format", "chatml", name="d.parquet")
    assert from_parquet["text"] == from_json["text"] and "null" not in "".join(from_parquet["text"])


def test_a_template_that_leaves_them_out_is_counted(tiny_model, tmp_path, caplog):
    with caplog.at_level("INFO", logger="sftrecipes"):
        tok, ds, counts = prepared(tmp_path, ROWS, "--assistant_only_loss", "True", template=TEXT_ONLY)
    assert counts["not_rendered"] == {"tool_calls": 2, "reasoning_content": 2, "tool turns": 0, "tools": 1}
    line = data_line(caplog)
    assert line.levelno == logging.WARNING
    assert ("; 2 rows: tool_calls not rendered by the template; 2 rows: reasoning_content not rendered by the template; "
            "1 row: tools not rendered by the template (lost from the training text: remove chat_template_path and use "
            "chat_template_format: chatml") in line.getMessage()
    assert "get_weather" not in ds[0]["text"] and trained(tok, ds[0]) == "<|im_end|>\nIt is clear.<|im_end|>\n"
    # a template that drops tool turns: counted too (and the text rendered, no error)
    no_tool = TEXT_ONLY.replace("{%- for m in messages %}", "{%- for m in messages if m.role != 'tool' %}")
    _, _, counts = prepared(tmp_path, ROWS, template=no_tool)
    assert counts["not_rendered"]["tool turns"] == 2
    # reasoning kept on the last turn only (as Qwen3's template keeps it after the last user turn): row 0 lost its
    # reasoning (on a tool-call turn), row 1 kept it (on its last turn)
    last_only = QWEN_LIKE.replace("{%- if m.reasoning_content %}", "{%- if m.reasoning_content and loop.last %}")
    assert last_only != QWEN_LIKE
    _, ds, counts = prepared(tmp_path, ROWS, template=last_only)
    assert counts["not_rendered"] == {"tool_calls": 0, "reasoning_content": 1, "tool turns": 0, "tools": 0}
    assert "<think>" not in ds[0]["text"] and "<think>\nThree came back." in ds[1]["text"]


@pytest.mark.parametrize("edit,template,fragment", [
    (None, TEXT_STRICT, r"^chat_template_path: the chat template fails on row 0 of dataset_name \S+d\.jsonl \(train\) \(UndefinedError: .*\); "
                        r"the row has message 2 \(assistant\): content: null, tool_calls, reasoning_content; message 3 \(tool\): a tool turn; 1 tool \(tools=\); "
                        r"remove chat_template_path and use chat_template_format: chatml"),
    ({"arguments": '{"query": tiny}'}, None, r"^tool_calls: row 1 of dataset_name \S+ \(train\), message 1, tool call 0 \(search\): arguments is not JSON "
                                             r"\(.*\); write arguments as a JSON object"),
    ({"name": ""}, None, r"^tool_calls: row 1 of dataset_name \S+ \(train\), message 1, tool call 0 has no function name; give each call"),
])
def test_a_row_the_template_cannot_take_is_one_line_naming_it(tiny_model, tmp_path, edit, template, fragment):
    rows = json.loads(json.dumps(ROWS))
    if edit:
        rows[1]["messages"][1]["tool_calls"][0]["function"].update(edit)
    with pytest.raises(RecipeError, match=fragment) as e:
        prepared(tmp_path, rows, *([] if template else ["--chat_template_format", "chatml"]), template=template)
    assert "\n" not in str(e.value)


# Qwen3's switch: with enable_thinking false its template opens the answer with an empty <think> block
THINKING_SWITCH = ("{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' }}"
                   "{%- if m.role == 'assistant' and enable_thinking is defined and enable_thinking is false %}"
                   "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{{- m.content + '<|im_end|>\\n' }}{%- endfor %}"
                   "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")


@pytest.mark.parametrize("name", ["d.jsonl", "d.parquet"])
def test_a_rows_chat_template_kwargs_reach_the_template(tiny_model, tmp_path, name):
    """TRL passes a row's chat_template_kwargs to the template: so does the project (an object, or that object as a
    JSON string; Arrow's nulls for keys other rows set are not arguments). A value that is no object is one line."""
    talk = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]
    rows = [{"messages": talk, "chat_template_kwargs": {"enable_thinking": False}},
            {"messages": talk, "chat_template_kwargs": {"enable_thinking": None, "other": "x"}}]
    tok, ds, _ = prepared(tmp_path, rows, "--assistant_only_loss", "True", template=THINKING_SWITCH, name=name)
    assert ds[0]["text"] == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nHello.<|im_end|>\n"
    assert ds[1]["text"] == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello.<|im_end|>\n"
    assert trained(tok, ds[0]) == "<think>\n\n</think>\n\nHello.<|im_end|>\n"
    as_string = [{"messages": talk, "chat_template_kwargs": json.dumps({"enable_thinking": False})}]
    _, ds, _ = prepared(tmp_path, as_string, template=THINKING_SWITCH, name="s.jsonl")
    assert "<think>\n\n</think>" in ds[0]["text"]
    with pytest.raises(RecipeError, match=r"^chat_template_kwargs: row 0 of dataset_name \S+ \(train\): the column is list, not an object") as e:
        prepared(tmp_path, [{"messages": talk, "chat_template_kwargs": [1]}], template=THINKING_SWITCH, name="b.jsonl")
    assert "\n" not in str(e.value)

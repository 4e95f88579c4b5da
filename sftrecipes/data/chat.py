"""Chat rows as a chat template gets them: tool calls, tool turns and reasoning kept, the template applied with a
one-line error naming the row when it fails, and the fields a template leaves out of the text detected.

What reaches the template (the project's chatml/zephyr or the tokenizer's own; docs/chat_data.md): every field of
every message — OpenAI-style `tool_calls` (`{"type": "function", "function": {"name", "arguments"}}`, or name and
arguments on the call itself), `tool` turns (with their `tool_call_id`/`name`), `content: null`, Qwen3-style
`reasoning_content` — and a row's `tools` column (a list of JSON schemas, or that list as a JSON string) as
`tools=`, and its `chat_template_kwargs` column (an object, or that object as a JSON string: e.g.
`{"enable_thinking": false}` for Qwen3's template) as keyword arguments of the template, as TRL passes them. Three
changes only:
- `arguments` given as a JSON string is parsed into the object transformers documents (templates such as
  Llama-3.1's write `arguments | tojson`, which would quote a string a second time); a string that is not a JSON
  object, or a call without a function name, is a one-line error naming the row.
- keys whose value is null are dropped from messages and calls, as transformers drops them from messages (Arrow
  gives every message of a column every key any message has, null where it had none).
- when the column stores arguments (or `tools`) as an Arrow struct (`Dataset.from_list`, parquet, `save_to_disk`
  of dict arguments), every argument name seen in the column is in every call, null where that call had none: null
  arguments are dropped (logged once per split; JSON-string arguments keep explicit nulls).

A template that raises on a row is a RecipeError naming the dataset, the row and what the row holds. A field the
template does not write — a message's tool calls or reasoning, a tool turn's content (each found by a mark appended
to it: one more rendering per kind of field), the row's tools (the same text without them) — is counted per split
(`NOT_RENDERED`) and reported on the data line.
"""

from __future__ import annotations

import inspect
import json

import jinja2
from transformers import PreTrainedTokenizerBase
from transformers.utils.chat_template_utils import render_jinja_template

from sftrecipes.core.errors import RecipeError
from sftrecipes.data.tokenizer import render_plain_turns
from sftrecipes.recipe.images import is_image_part

# bits of a row's `_unrendered` mask: which of its fields the template left out of the text
NOT_RENDERED = {"tool_calls": 1, "reasoning_content": 2, "tool turns": 4, "tools": 8}
# the names a message's reasoning goes by (transformers fills reasoning_content from the other two)
REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")
# what a template can raise on a row it cannot render (a RecipeError is ours and passes through)
TEMPLATE_ERRORS = (jinja2.TemplateError, TypeError, ValueError, KeyError, IndexError, AttributeError)
# apply_chat_template's own arguments: a row's template arguments named so take the tokenizer's road (Chat.apply)
APPLY_ARGUMENTS = frozenset(inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters) - {"kwargs"}


def _parsed(value, key: str, at: str, fix_hint: str):
    """A column or field that may hold JSON as a string: the parsed value, or one line naming where it is not JSON."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError as e:
        raise RecipeError(f"{key}: {at} is not JSON ({e}: {value[:60]!r}); {fix_hint}") from None


def fix(key: str, value: str | None = None) -> str:
    """What to do about a template that fails on, or leaves out, what chat rows hold (key: template_key; value: the
    recipe's setting of it). Never what the recipe already uses: under chatml or zephyr, which render text (or null)
    content, tool calls, tool turns, reasoning and tools, the fix is in the rows or another template."""
    if key == "chat_template_format" and value in ("chatml", "zephyr"):
        return (f"chat_template_format: {value} (this recipe's) renders text or null content, tool_calls, tool turns, "
                "reasoning_content and tools, nothing else (docs/chat_data.md): write each message's content as a "
                "string, or set chat_template_format: tokenizer with a template (chat_template_path) that renders what "
                "the rows hold")
    how = "remove chat_template_path and use" if key == "chat_template_path" else "use"
    return (f"{how} chat_template_format: chatml or zephyr (they render tool_calls, tool turns, reasoning_content and "
            "content: null; docs/chat_data.md), or a template that renders what the rows hold")


def template_key(recipe) -> str:
    """The recipe key that chose the chat template."""
    return "chat_template_path" if recipe.trl.get("chat_template_path") else "chat_template_format"


def _no_nulls(value, deep: bool):
    if isinstance(value, dict):
        return {k: _no_nulls(v, deep) if deep else v for k, v in value.items() if v is not None}
    if isinstance(value, list) and deep:
        return [_no_nulls(v, deep) for v in value]
    return value


def _struct_at(feature, path: tuple[str, ...]) -> bool:
    """Whether the datasets feature holds an Arrow struct (a dict feature) at `path` (lists stepped through)."""
    for key in (*path, None):
        while hasattr(feature, "feature") or isinstance(feature, list):  # List / LargeList / [feature]
            feature = feature[0] if isinstance(feature, list) else feature.feature
        if key is None:
            return isinstance(feature, dict)
        if not isinstance(feature, dict) or key not in feature:
            return False
        feature = feature[key]
    return False


def arrow_structs(features) -> tuple[bool, bool]:
    """(tool-call arguments, tools) stored as Arrow structs in a split's features: their null entries may be Arrow's
    fill for names other rows have, not the data's."""
    calls = ("tool_calls", "function", "arguments"), ("tool_calls", "arguments")
    args = any(_struct_at(features[c], p) for c in ("messages", "conversations", "prompt", "completion") if c in features
               for p in calls)
    return args, "tools" in features and _struct_at(features["tools"], ())


class Chat:
    """One row's conversation as its template gets it: `messages` normalizes, `apply` renders (a template error is a
    RecipeError naming the row), `not_rendered` tells which fields the template left out.

    fast (a split's preparation): the same text by a shorter road — plain turns under the project's templates in
    Python (tokenizer.render_plain_turns), other conversations by the compiled template without
    apply_chat_template's per-call work (render_jinja_template, which it calls); rows from a dataset only (plain
    dicts, lists and strings, as Arrow gives them)."""

    def __init__(self, tokenizer, recipe, row: dict, where: str, structs: tuple[bool, bool] = (False, False),
                 fast: bool = False):
        self.tok, self.where, self.struct_args, self.fast = tokenizer, where, structs[0], fast
        self.key = template_key(recipe)
        self.setting = recipe.model.chat_template_format
        self.tools = self._tools(row.get("tools"), structs[1])
        kwargs = _parsed(row.get("chat_template_kwargs"), "chat_template_kwargs", f"{where}: the column",
                         'write an object such as {"enable_thinking": false}, or that object as a JSON string')
        if kwargs is not None and not (isinstance(kwargs, dict) and all(isinstance(k, str) for k in kwargs)):
            raise RecipeError(f"chat_template_kwargs: {where}: the column is {type(kwargs).__name__}, not an object of "
                              'keyword arguments; write an object such as {"enable_thinking": false}')
        # Arrow gives every row every key any row has, null where it had none: those are not the row's arguments
        self.kwargs = {k: v for k, v in (kwargs or {}).items() if v is not None}

    def _tools(self, tools, struct: bool):
        if tools is None:
            return None
        tools = _parsed(tools, "tools", f"{self.where}: the tools column", "write a list of JSON schemas, or that list as a JSON string")
        if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
            raise RecipeError(f"tools: {self.where}: the tools column is {type(tools).__name__}, not a list of JSON "
                              "schemas; write a list of {\"type\": \"function\", \"function\": {...}} objects")
        return (_no_nulls(tools, deep=True) if struct else tools) or None  # [] as none, as TRL does

    def _call(self, call, i: int, j: int) -> dict:
        at = f"{self.where}, message {i}, tool call {j}"
        shape = 'give each call {"type": "function", "function": {"name": ..., "arguments": {...}}}'
        if not isinstance(call, dict):
            raise RecipeError(f"tool_calls: {at} is {type(call).__name__}, not an object; {shape}")
        call = _no_nulls(call, deep=False)
        nested = isinstance(call.get("function"), dict)
        fn = _no_nulls(call["function"], deep=False) if nested else call
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise RecipeError(f"tool_calls: {at} has no function name; {shape}")
        args = _parsed(fn.get("arguments", {}), "tool_calls", f"{at} ({fn['name']}): arguments",
                       "write arguments as a JSON object, or that object as a JSON string")
        if not isinstance(args, dict):
            raise RecipeError(f"tool_calls: {at} ({fn['name']}): arguments is {type(args).__name__}, not an object; "
                              "write arguments as a JSON object, or that object as a JSON string")
        fn = {**fn, "arguments": _no_nulls(args, deep=False) if self.struct_args else args}
        return {**call, "function": fn} if nested else fn

    def messages(self, msgs: list) -> list[dict]:
        """The messages as the template gets them (see the module docstring)."""
        out = []
        for i, m in enumerate(msgs):
            if not isinstance(m, dict) or "role" not in m:
                raise RecipeError(f"messages: {self.where}, message {i} is not a role/content object; fix the data")
            m = _no_nulls(m, deep=False)
            if isinstance(m.get("content"), list) and any(is_image_part(p) for p in m["content"]):
                raise RecipeError(f"messages: {self.where}, message {i} holds an image part ({{\"type\": \"image\"}}); "
                                  "runs here train on text, so it would be dropped; train on rows without images")
            if "tool_calls" in m:
                if not isinstance(m["tool_calls"], list):
                    raise RecipeError(f"tool_calls: {self.where}, message {i}: tool_calls is {type(m['tool_calls']).__name__}, "
                                      "not a list; write a list of calls")
                m["tool_calls"] = [self._call(c, i, j) for j, c in enumerate(m["tool_calls"])]
            out.append(m)
        return out

    def apply(self, msgs: list[dict], tools="row", **kw) -> str:
        """The template's text of msgs (with this row's tools), or one line naming the row and what it holds."""
        tools = self.tools if tools == "row" else tools
        try:
            if self.fast and msgs and not APPLY_ARGUMENTS.intersection(self.kwargs):
                return self._render(msgs, tools, **kw)
            return self.tok.apply_chat_template(msgs, tools=tools, tokenize=False, **{**self.kwargs, **kw})
        except RecipeError:
            raise
        except TEMPLATE_ERRORS as e:
            said = " ".join(str(e).split())[:200]
            raise RecipeError(f"{self.key}: the chat template fails on {self.where} ({type(e).__name__}: {said}){_holds(msgs, self.tools)}; "
                              f"{fix(self.key, self.setting)}") from None

    def _render(self, msgs: list[dict], tools, add_generation_prompt: bool = False) -> str:
        """apply_chat_template(msgs, tools=tools, tokenize=False, add_generation_prompt=..., **row arguments) for
        messages Chat.messages made from a dataset's row (dicts without null keys: apply's normalization changes
        nothing), without its per-call work; plain turns under the project's templates without jinja."""
        if tools is None and not self.kwargs:
            text = render_plain_turns(self.tok, msgs, add_generation_prompt)
            if text is not None:
                return text
        template = self.tok.get_chat_template(None, tools)
        rendered, _ = render_jinja_template(conversations=[msgs], tools=tools, chat_template=template,
                                            add_generation_prompt=add_generation_prompt,
                                            **{**self.tok.special_tokens_map, **self.kwargs})
        return rendered[0]

    def not_rendered(self, msgs: list[dict], text: str) -> int:
        """The NOT_RENDERED bits of the fields the template left out of `text`. Each kind of field is rendered once more
        with a mark appended to every instance (a call's name, a message's reasoning, a tool turn's content): an
        instance whose mark is not in that text was not written. The row's tools: the same text without them. A
        marked conversation the template cannot render counts as rendered."""
        lost = 0
        keys = set().union(*msgs)  # what no message holds has no instance to mark (the usual row: role and content)
        for field, held in (("tool_calls", "tool_calls" in keys), ("reasoning_content", not keys.isdisjoint(REASONING_KEYS)),
                            ("tool turns", any(m["role"] == "tool" for m in msgs))):
            if not held:
                continue
            marked, marks = _marked(msgs, field)
            if marks:
                try:
                    out = self.tok.apply_chat_template(marked, tools=self.tools, tokenize=False, **self.kwargs)
                except Exception:  # the marks changed what the template does: it reads the field
                    continue
                if any(mark not in out for mark in marks):
                    lost |= NOT_RENDERED[field]
        if self.tools:
            try:
                if self.tok.apply_chat_template(msgs, tools=None, tokenize=False, **self.kwargs) == text:
                    lost |= NOT_RENDERED["tools"]
            except Exception:  # without its tools the row does not render: they matter to the template
                pass
        return lost


def _mark(k: int) -> str:
    return f"\u27e6{730001 + k}\u27e7"  # digits in brackets text does not hold: no case or word change alters it


def _marked(msgs: list[dict], field: str) -> tuple[list[dict], list[str]]:
    """msgs with a mark appended to each instance of `field` (a call's function name, a message's reasoning, a tool
    turn's content), and the marks."""
    marks: list[str] = []

    def mark(value: str) -> str:
        marks.append(_mark(len(marks)))
        return value + marks[-1]

    out = []
    for m in msgs:
        if field == "tool_calls" and m.get("tool_calls"):
            calls = []
            for c in m["tool_calls"]:
                if isinstance(c.get("function"), dict):
                    calls.append({**c, "function": {**c["function"], "name": mark(c["function"]["name"])}})
                else:
                    calls.append({**c, "name": mark(c["name"])})
            m = {**m, "tool_calls": calls}
        elif field == "reasoning_content" and any(isinstance(m.get(k), str) and m[k] for k in REASONING_KEYS):
            value = mark(next(m[k] for k in REASONING_KEYS if isinstance(m.get(k), str) and m[k]))
            m = {**{k: v for k, v in m.items() if k not in REASONING_KEYS}, "reasoning_content": value}
        elif field == "tool turns" and m["role"] == "tool" and isinstance(m.get("content"), str) and m["content"]:
            m = {**m, "content": mark(m["content"])}
        out.append(m)
    return out, marks


def _holds(msgs: list[dict], tools) -> str:
    """What of the row may be what the template cannot take: its messages with tool calls, null content, reasoning,
    tool turns (the first three), and its tools."""
    notes = []
    for i, m in enumerate(msgs):
        content = "content: null" if "content" not in m else None if isinstance(m["content"], str) else f"content: {type(m['content']).__name__}"
        what = [w for w, has in ((content, content is not None), ("tool_calls", bool(m.get("tool_calls"))),
                                 ("reasoning_content", any(m.get(k) for k in REASONING_KEYS))) if has]
        if what or m["role"] == "tool":
            notes.append(f"message {i} ({m['role']}): {', '.join(what) or 'a tool turn'}")
    if tools:
        notes.append(f"{len(tools)} tool{'' if len(tools) == 1 else 's'} (tools=)")
    return f"; the row has {'; '.join(notes[:3])}{' ...' if len(notes) > 3 else ''}" if notes else ""


def describe_not_rendered(counts: dict[str, int], key: str) -> str:
    """'; 3 rows: tool_calls not rendered by the template; ... (the fix)' for the fields some rows lost ('' if none)."""
    lost = [f"{n} row{'' if n == 1 else 's'}: {field} not rendered by the template" for field, n in counts.items() if n]
    return f"; {'; '.join(lost)} (lost from the training text: {fix(key)})" if lost else ""

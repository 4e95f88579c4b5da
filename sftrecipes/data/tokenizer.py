"""Tokenizer: the recipe's tokenizer set up for its chat template (end-of-turn and pad tokens, where generation stops).

The project's templates (chatml, zephyr: `_turns_template`) render plain turns as `<open>content<close>` and, besides
text, a row's tools, an assistant's reasoning and tool calls, and tool turns (docs/chat_data.md)."""

from __future__ import annotations

import logging
import os

from transformers import AutoTokenizer

from sftrecipes.core.errors import RecipeError
from sftrecipes.facts import startmodel
from sftrecipes.recipe.typed import Recipe

log = logging.getLogger("sftrecipes")

def _turns_template(start: str, end: str, generation: str) -> str:
    """A chat template whose turns open with `start` (a jinja expression of `role`) and close with `end`.

    Plain text turns render as `start + content + end`. Besides text it renders (docs/chat_data.md):
    - a row's tools: their JSON schemas, one a line between <tools> and </tools>, in the system turn (one is opened
      when the conversation has none);
    - an assistant's reasoning (`reasoning_content`) first, as `<think>\\n...\\n</think>\\n\\n`;
    - its tool calls after its content, each `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, one a line;
    - `tool` turns as turns of their own role; `content: null` as empty text (another kind of content: an error).
    """
    text = ("{%- macro text(m) -%}{%- if m['content'] is string -%}{{- m['content'] -}}"
            "{%- elif m['content'] is defined and m['content'] is not none -%}"
            "{{- raise_exception('content must be text or null; this template renders no other kind of content') -}}"
            "{%- endif -%}{%- endmacro -%}")
    tools = ("{%- set system_first = messages | length > 0 and messages[0]['role'] == 'system' -%}"
             "{%- if tools -%}{{- " + start.replace("ROLE", "'system'") + " -}}"
             "{%- if system_first and text(messages[0]) -%}{{- text(messages[0]) + '\\n\\n' -}}{%- endif -%}"
             "{{- '# Tools\\nThe functions you may call, one JSON schema a line:\\n<tools>' -}}"
             "{%- for tool in tools -%}{{- '\\n' + (tool | tojson) -}}{%- endfor -%}"
             "{{- '\\n</tools>\\nA call is a JSON object {\"name\": ..., \"arguments\": {...}} between <tool_call> and "
             "</tool_call>.' + " + end + " -}}{%- endif -%}")
    calls = ("{%- if message['role'] == 'assistant' and message['tool_calls'] -%}{%- for tc in message['tool_calls'] -%}"
             "{%- set call = tc['function'] if tc['function'] is defined else tc -%}"
             "{%- set args = call['arguments'] if call['arguments'] is defined else {} -%}"
             "{%- if body or not loop.first -%}{{- '\\n' -}}{%- endif -%}"
             "{{- '<tool_call>\\n{\"name\": ' + (call['name'] | tojson) + ', \"arguments\": ' "
             "+ (args if args is string else (args | tojson)) + '}\\n</tool_call>' -}}"
             "{%- endfor -%}{%- endif -%}")
    turn = ("{%- for message in messages -%}{%- if not (tools and system_first and loop.first) -%}"
            "{{- " + start.replace("ROLE", "message['role']") + " -}}"
            "{%- if message['role'] == 'assistant' and message['reasoning_content'] is string and message['reasoning_content'] -%}"
            "{{- '<think>\\n' + message['reasoning_content'] + '\\n</think>\\n\\n' -}}{%- endif -%}"
            "{%- set body = text(message) -%}{{- body -}}" + calls + "{{- " + end + " -}}"
            "{%- endif -%}{%- endfor -%}")
    return text + tools + turn + "{%- if add_generation_prompt -%}{{- " + generation + " -}}{%- endif -%}"


CHATML_TEMPLATE = _turns_template("'<|im_start|>' + ROLE + '\\n'", "'<|im_end|>\\n'", "'<|im_start|>assistant\\n'")
ZEPHYR_TEMPLATE = _turns_template("'<|' + ROLE + '|>\\n'", "eos_token + '\\n'", "'<|assistant|>\\n'")
# format -> (template, special tokens it needs, end-of-turn token: None = the tokenizer's eos)
TEMPLATES = {
    "chatml": (CHATML_TEMPLATE, ["<|im_start|>", "<|im_end|>"], "<|im_end|>"),
    "zephyr": (ZEPHYR_TEMPLATE, ["<|user|>", "<|assistant|>", "<|system|>"], None),
}
# The same templates for plain turns, in Python: (opening, with {role}; closing, with {eos_token}; generation prompt).
# Data preparation renders plain conversations with them instead of jinja (render_plain_turns); the text is the
# template's (tests/data/test_prep_fast.py compares them).
PLAIN_TURNS = {CHATML_TEMPLATE: ("<|im_start|>{role}\n", "<|im_end|>\n", "<|im_start|>assistant\n"),
               ZEPHYR_TEMPLATE: ("<|{role}|>\n", "{eos_token}\n", "<|assistant|>\n")}


def render_plain_turns(tok, messages: list[dict], add_generation_prompt: bool = False) -> str | None:
    """The text the project's template (chatml, zephyr) renders for a conversation of plain turns (each message a
    text role and text content, nothing else; no tools, no template arguments), without jinja. None when the
    tokenizer's template is another, or a message is not a plain turn: the caller renders with the template."""
    template = tok.chat_template
    pieces = PLAIN_TURNS.get(template) if isinstance(template, str) else None
    if pieces is None or not messages:
        return None
    eos = tok.eos_token
    if not isinstance(eos, str):
        return None
    start, end, generation = pieces
    before, after = start.split("{role}")
    end = end.replace("{eos_token}", eos)
    out = []
    for m in messages:
        role, content = m.get("role"), m.get("content")
        if type(role) is not str or type(content) is not str or len(m) != 2:  # exactly role and content
            return None
        out.append(before + role + after + content + end)
    if add_generation_prompt:
        out.append(generation)
    return "".join(out)


PAD_CANDIDATES = ("<pad>", "<|finetune_right_pad_id|>", "<|pad|>")  # existing pad-like tokens (Llama-3.1 ships the 2nd)


def load_tokenizer(recipe: Recipe):
    """Tokenizer with the recipe's chat template. Returns (tokenizer, end_of_turn, added_token_ids): end_of_turn is the
    token (or, rarely, the text) that closes an assistant turn; when it is a token, it becomes the eos token so
    training data and generation agree, and load_model puts it (with the original eos) into the generation config."""
    m = recipe.model
    name = m.tokenizer_name_or_path or startmodel.tokenizer_source(m.model_name_or_path)  # an adapter: its own, or its base's
    tok = AutoTokenizer.from_pretrained(name, trust_remote_code=bool(recipe.trl_value("trust_remote_code")))
    original_eos = tok.eos_token
    added: list[int] = []
    fmt = m.chat_template_format
    if fmt in TEMPLATES:
        template, specials, _ = TEMPLATES[fmt]
        missing = [t for t in specials if t not in tok.get_vocab()]
        if missing:
            tok.add_special_tokens({"additional_special_tokens": missing}, replace_extra_special_tokens=False)
            added = tok.convert_tokens_to_ids(missing)
        tok.chat_template = template
    elif fmt == "tokenizer" and recipe.trl.get("chat_template_path"):  # the file's template, for the data and the save
        with open(recipe.trl["chat_template_path"], encoding="utf-8") as f:
            tok.chat_template = f.read()
        log.info("chat template: %s", recipe.trl["chat_template_path"])
    elif fmt == "tokenizer" and not tok.chat_template:
        raise RecipeError(f"chat_template_format: 'tokenizer' but {name} has no chat template; use chatml or zephyr")
    eot, kind = None, "none"
    if fmt != "none":
        eot, kind = end_of_turn(tok)
        if kind == "none":
            log.warning("chat template: assistant turns end with no token; generation stops only at eos (%s), which the "
                        "formatted data does not contain: set append_concat_token: true or use a template that closes turns", tok.eos_token)
        elif kind == "text":
            log.warning("chat template: assistant turns end with the text %r, not one token; generation stops on it only through "
                        "the saved generation config's stop_strings (passed to generate with the tokenizer)", eot)
        else:
            if eot != tok.eos_token:
                tok.eos_token = eot
            log.info("chat template: end of turn is %s (%s); eos token: %s%s", eot, kind, eot,
                     f" (was {original_eos})" if original_eos not in (None, eot) else "")
    if recipe.trl.get("eos_token"):
        if recipe.trl["eos_token"] not in tok.get_vocab():
            raise RecipeError(f"eos_token: '{recipe.trl['eos_token']}' is not in the tokenizer's vocabulary; pick a token it has")
        tok.eos_token = recipe.trl["eos_token"]
    if tok.pad_token is None:
        vocab = tok.get_vocab()
        have = next((t for t in PAD_CANDIDATES if t in vocab), None)
        if have is None:
            tok.add_special_tokens({"pad_token": "<pad>"})
            added.append(tok.pad_token_id)
        else:
            tok.pad_token = have
    # what generation must stop on (set_generation_stop): eos as now set, then the original eos; a textual end of turn
    stop_ids = [i for i in (tok.eos_token_id, tok.convert_tokens_to_ids(original_eos) if original_eos else None) if i is not None]
    tok._sftrecipes_stop = (list(dict.fromkeys(stop_ids)), [eot] if kind == "text" else [])
    return tok, tok.eos_token if kind == "none" or recipe.trl.get("eos_token") else eot, added


SENTINELS = ("SENTINEL-ONE", "SENTINEL-TWO")
ONE_TOKEN = ("special token", "added token", "token")  # the kinds of end of turn that are one token (an id)


def end_of_turn_id(tok) -> tuple[int | None, str | None, str]:
    """(its id when the end of turn is one token, else None; the end of turn; its kind): end_of_turn with the id."""
    eot, kind = end_of_turn(tok)
    return (tok.convert_tokens_to_ids(eot) if kind in ONE_TOKEN else None), eot, kind


def end_of_turn(tok) -> tuple[str | None, str]:
    """What a chat template closes an assistant turn with, and what kind of thing it is: ('<|eot_id|>', 'added token')
    for a special token the tokenizer does not list (Llama-3), 'special token' (<|im_end|>, <end_of_turn>, </s>),
    'token' (one ordinary vocabulary entry), 'text' (several tokens), or (None, 'none').

    The same assistant turn is rendered twice: last in the conversation, and followed by another user turn. What both
    renderings put right after its content is the turn's closing text (Phi-3 appends eos after the last turn only; a
    closing newline belongs to the turn); its first special token, else the text itself, is the end of turn."""
    one, two = SENTINELS
    turn = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": one}]
    last = tok.apply_chat_template(turn, tokenize=False)
    more = tok.apply_chat_template(turn + [{"role": "user", "content": "again"}, {"role": "assistant", "content": two}], tokenize=False)
    after_last, after_more = (t[t.index(one) + len(one):] for t in (last, more))
    closing = os.path.commonprefix([after_last, after_more])
    ids = tok(closing, add_special_tokens=False)["input_ids"]
    listed = set(tok.all_special_ids)
    special_added = {i for i, t in tok.added_tokens_decoder.items() if t.special}
    for i in ids:
        if i in listed:
            return tok.convert_ids_to_tokens(i), "special token"
        if i in special_added:
            return tok.convert_ids_to_tokens(i), "added token"
    text = closing.strip()
    if not text:
        return None, "none"
    if text in tok.get_vocab():
        return text, "token"
    return text, "text"



def set_generation_stop(gen, tokenizer) -> list[int]:
    """Generation stops at the end of turn and at eos: the ids load_tokenizer recorded (end of turn, original eos)
    before the model's own eos ids; a multi-token textual end of turn goes to stop_strings. Returns the eos ids."""
    ids, texts = getattr(tokenizer, "_sftrecipes_stop", ([tokenizer.eos_token_id], []))
    own = gen.eos_token_id if isinstance(gen.eos_token_id, list) else [gen.eos_token_id] if gen.eos_token_id is not None else []
    ids = list(dict.fromkeys([i for i in ids if i is not None] + own))
    gen.eos_token_id = ids if len(ids) > 1 else (ids[0] if ids else None)
    if texts:
        gen.stop_strings = texts
    return ids

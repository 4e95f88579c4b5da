"""Data formats: the four shapes a split may have (messages, ShareGPT conversations, prompt/completion, text), told
apart by their columns.

`dataset_format: auto` reads the shape from the columns; an asked format is checked against them. Conversational data
needs a chat template. ShareGPT turns (from/value) become role/content messages, keeping their other fields (tool
calls, reasoning: chat.py).
"""

from __future__ import annotations

from .errors import RecipeError
from .recipe import Recipe

FORMATS = ("messages", "conversations", "prompt_completion", "text")
CONVERSATIONAL = ("messages", "conversations")
# ShareGPT `from` values -> chat roles
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "model": "assistant",
                  "system": "system", "tool": "tool"}
SHAPES = ("messages (column 'messages': role/content turns), conversations (column 'conversations': ShareGPT "
          "from/value turns), prompt_completion (columns 'prompt' + 'completion': text, or lists of messages), "
          "text (the dataset_text_field column, now '{field}')")


def detect_format(recipe: Recipe, columns: list[str], name: str, fmt: str = "auto", key: str = "dataset_format") -> str:
    """The format of a split from its columns (fmt 'auto'), or a check that the columns fit the asked format."""
    field_ = recipe.trl_value("dataset_text_field")
    cols = set(columns)
    has = f"(has {', '.join(columns)})"
    needs = {"messages": ["messages"], "conversations": ["conversations"], "prompt_completion": ["prompt", "completion"],
             "text": [field_]}
    if fmt == "auto":
        if recipe.model.chat_template_format == "none" and "dataset_text_field" in recipe.explicit and field_ in cols:
            return "text"  # no template and a text column named explicitly: that column is the data
        for f in FORMATS:
            if set(needs[f]) <= cols:
                return f
        shapes = SHAPES.format(field=field_)
        raise RecipeError(
            f"dataset_format: {name} {has} is none of the accepted shapes: {shapes}; rename its columns (a datasets "
            f"entry's columns: {{your_column: prompt}}) or set dataset_text_field to its text column"
        )
    missing = [c for c in needs[fmt] if c not in cols]
    if missing:
        if fmt == "text":
            raise RecipeError(f"dataset_text_field: column '{field_}' not in {name} {has}; set dataset_text_field to the text column")
        raise RecipeError(f"{key}: {fmt} needs the column '{missing[0]}', but {name} {has}; rename it (a datasets entry's columns: {{your_column: {missing[0]}}}) or set {key}: auto")
    return fmt


def is_conversational(fmt: str, example: dict) -> bool:
    return fmt in CONVERSATIONAL or (fmt == "prompt_completion" and isinstance(example.get("prompt"), list))


def from_sharegpt(turns: list[dict], where: str) -> list[dict]:
    """ShareGPT turns (from/value) as chat messages (role/content); role/content turns pass through. A turn's other
    fields (tool_calls, reasoning_content, tool_call_id, ...) stay on its message."""
    out = []
    for t in turns:
        if "from" in t:
            role = SHAREGPT_ROLES.get(str(t["from"]).lower())
            if role is None:
                raise RecipeError(
                    f"conversations: unknown 'from' value {t['from']!r} in {where}; the accepted ones are "
                    f"{', '.join(SHAREGPT_ROLES)} — rewrite those turns' 'from' to one of them"
                )
            rest = {k: v for k, v in t.items() if k not in ("from", "value", "role", "content")}
            out.append({"role": role, "content": t.get("value", ""), **rest})
        elif "role" in t:
            out.append({**t, "content": t.get("content", "")})
        else:
            raise RecipeError(f"conversations: a turn in {where} has neither 'from'/'value' nor 'role'/'content' (keys: {', '.join(t)}); fix the data")
    return out


def check_template(recipe: Recipe, fmt: str, key: str, row: dict | None) -> None:
    """Conversational data needs a chat template (also checked on every row by render)."""
    if recipe.model.chat_template_format == "none" and (fmt in CONVERSATIONAL or (row is not None and is_conversational(fmt, row))):
        raise RecipeError(
            f"chat_template_format: none, but {key} is conversational ({fmt}); set chat_template_format: tokenizer "
            f"(the model's own template), chatml or zephyr"
        )


def sample_prompt(fmt: str, row: dict, recipe: Recipe):
    """The prompt of the end-of-run sample: the conversation up to its first user turn, the prompt of a
    prompt/completion row, or the first half of a text."""
    if fmt in CONVERSATIONAL:
        msgs = row["messages"] if fmt == "messages" else from_sharegpt(row["conversations"], "the sample row")
        first_user = next((i for i, m in enumerate(msgs) if m["role"] == "user"), 0)
        return msgs[: first_user + 1]
    if fmt == "prompt_completion":
        return row["prompt"]
    words = str(row[recipe.trl_value("dataset_text_field")]).split()
    return " ".join(words[: max(1, len(words) // 2)])

"""Data formats: the shapes a split may have (SFT's messages, ShareGPT conversations, prompt/completion, text; the
preference methods' paired and unpaired rows), told apart by their columns.

`dataset_format: auto` reads the shape from the columns; an asked format is checked against them. Conversational data
needs a chat template. ShareGPT turns (from/value) become role/content messages, keeping their other fields (tool
calls, reasoning: chat.py).

Preference methods (`method: dpo`, `kto`, `orpo`, `cpo`) read other shapes: `preference` (prompt/chosen/rejected, or chosen/rejected
with the prompt implicit in their shared start) and `unpaired_preference` (prompt/completion/label); the online methods
(`grpo`, `rloo`) read `prompt_only` (a prompt, text or messages, and any columns the reward functions read);
`detect_preference_format` tells them apart the same way (preference.py reads the rows).
"""

from __future__ import annotations

from sftrecipes.core.errors import RecipeError
from sftrecipes.recipe.schema import ONLINE, PAIRED
from sftrecipes.recipe.typed import Recipe

FORMATS = ("messages", "conversations", "prompt_completion", "text")
# The preference methods' formats, and the columns of each shape a method reads, in the order `auto` tries them.
# dpo, orpo and cpo read pairs (schema.PAIRED); kto reads unpaired rows, and pairs too (each made a desirable and an
# undesirable row: preference.py)
PREFERENCE_FORMATS = ("preference", "unpaired_preference", "prompt_only")
PAIRS = (("preference", ("prompt", "chosen", "rejected")), ("preference", ("chosen", "rejected")))
PREFERENCE_SHAPES: dict[str, tuple[tuple[str, tuple[str, ...]], ...]] = {
    **dict.fromkeys(PAIRED, PAIRS),
    "kto": (("unpaired_preference", ("prompt", "completion", "label")), *PAIRS),
    **dict.fromkeys(ONLINE, (("prompt_only", ("prompt",)),)),  # grpo/rloo: TRL's prompt-only rows, text or messages
}
PREFERENCE_METHOD = {"preference": "dpo", "unpaired_preference": "kto", "prompt_only": "grpo"}  # a format's first method
CONVERSATIONAL = ("messages", "conversations")
# ShareGPT `from` values -> chat roles
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "model": "assistant",
                  "system": "system", "tool": "tool"}
SHAPES = ("messages (column 'messages': role/content turns), conversations (column 'conversations': ShareGPT "
          "from/value turns), prompt_completion (columns 'prompt' + 'completion': text, or lists of messages), "
          "text (the dataset_text_field column, now '{field}')")


def detect_format(recipe: Recipe, columns: list[str], name: str, fmt: str = "auto", key: str = "dataset_format") -> str:
    """The format of a split from its columns (fmt 'auto'), or a check that the columns fit the asked format."""
    if fmt in PREFERENCE_FORMATS:
        raise RecipeError(f"{key}: {fmt} is data for the {'online' if fmt == 'prompt_only' else 'preference'} methods, "
                          f"but method is sft; set method: {PREFERENCE_METHOD[fmt]}, or {key}: auto for SFT data")
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
    if fmt in PREFERENCE_FORMATS:  # any of its text columns a list of messages (an implicit prompt has none)
        return any(isinstance(example.get(c), list) for c in ("prompt", "chosen", "rejected", "completion"))
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


def preference_shapes(method: str) -> str:
    """The shapes `method` reads, as error lines list them."""
    shapes = "; ".join("/".join(cols) + (" (the prompt: their shared start)" if "prompt" not in cols else "") + f" [{fmt}]"
                       for fmt, cols in PREFERENCE_SHAPES[method])
    extra = "; label a bool" if method == "kto" else "; its other columns go to the reward functions" if method in ONLINE else ""
    return shapes + " — each text, or lists of role/content (or ShareGPT from/value) messages" + extra


def detect_preference_format(method: str, columns: list[str], name: str, fmt: str = "auto", key: str = "dataset_format",
                             columns_key: str = "dataset_format") -> tuple[str, tuple[str, ...]]:
    """(format, the columns of its shape) of a split a preference method reads, from its columns (fmt 'auto'), or a
    check that they fit the asked format. key: the format's key, columns_key: the key whose fix renames columns
    (a datasets entry's columns)."""
    cols = set(columns)
    has = f"(has {', '.join(columns)})"
    wanted = "chosen" if method in PAIRED else "prompt" if method in ONLINE else "completion"
    fix = f"rename its columns (a datasets entry's columns: {{your_column: {wanted}}})"
    if fmt in FORMATS:
        raise RecipeError(f"{key}: {fmt} is a shape of method sft; method {method} reads {preference_shapes(method)}; "
                          f"set {key}: auto or {PREFERENCE_SHAPES[method][0][0]}")
    if fmt in PREFERENCE_FORMATS and fmt not in {f for f, _ in PREFERENCE_SHAPES[method]}:
        if method in ONLINE or fmt == "prompt_only":
            raise RecipeError(f"{key}: {fmt} is data of method {PREFERENCE_METHOD[fmt]}; method {method} reads "
                              f"{preference_shapes(method)}; set {key}: auto or {PREFERENCE_SHAPES[method][0][0]}")
    if method in PAIRED and fmt == "unpaired_preference":
        raise RecipeError(f"{key}: unpaired_preference (prompt/completion/label) has no pairs, which method {method} compares; "
                          f"set method: kto, or give {method} prompt/chosen/rejected data (dataset_format: preference)")
    for shape_fmt, shape in PREFERENCE_SHAPES[method]:
        if fmt in ("auto", shape_fmt) and set(shape) <= cols:
            return shape_fmt, shape
    if fmt == "auto":
        raise RecipeError(f"{columns_key}: {name} {has} is none of the shapes method {method} reads: "
                          f"{preference_shapes(method)}; {fix}")
    needs = [shape for shape_fmt, shape in PREFERENCE_SHAPES[method] if shape_fmt == fmt][-1]  # its fewest columns
    missing = [c for c in needs if c not in cols]
    raise RecipeError(f"{columns_key}: {fmt} needs the column '{missing[0]}', but {name} {has}; rename it (a datasets "
                      f"entry's columns: {{your_column: {missing[0]}}}) or set {key}: auto")

"""Coercion: one raw option value (from YAML or a command-line word) to its declared type, or a RecipeError naming the key."""

from __future__ import annotations

import difflib
import json
import re
from pathlib import Path
from typing import Any

from sftrecipes.core.errors import RecipeError
from sftrecipes.recipe.snapshots import Option

TRUE = {"true", "yes", "1", "on"}
FALSE = {"false", "no", "0", "off"}


def suggest(name: str, candidates: list[str]) -> str:
    """A hint for a mistyped name: the closest candidates ("did you mean ...?"), or where the valid keys are listed."""
    close = difflib.get_close_matches(name, candidates, n=3, cutoff=0.6)
    if close:
        return "did you mean " + " or ".join(close) + "?"
    return "see `python train.py --help` for the valid keys"


def is_null(opt: Option, value: Any, src: str) -> bool:
    """The value is null: YAML's null (`key: null`, `key: ~` or `key:`), or on the command line the word null, or
    none, where that word is not one of the key's own values (a choice such as chat_template_format's none, or a list
    item such as report_to's none). A list flag's single word counts as that word (`--report_to null`)."""
    if value is None:
        return True
    if not src.startswith("--"):
        return False
    if isinstance(value, list) and len(value) == 1:
        value = value[0]
    if not isinstance(value, str) or value in (opt.choices or ()):
        return False
    word = value.lower()
    return word == "null" or (word == "none" and opt.kind != "list")


def coerce(opt: Option, value: Any, src: str) -> Any:
    """One value of one option to its declared type, or a RecipeError naming the key and the fix. A null value is
    None for a nullable option; recipe.load_recipe reads null as "unset" before it gets here (schema.NULL_IS_A_VALUE)."""
    name = opt.name
    where = src if src.startswith("--") else f"{name} (in {src})"
    from_cli = src.startswith("--")
    if is_null(opt, value, src):
        if opt.nullable:
            return None
        raise RecipeError(f"{where}: may not be empty; give a {opt.kind} value")
    kind = opt.kind

    def bad(expected: str, hint: str = "") -> RecipeError:
        got = f"{value!r} ({type(value).__name__})"
        return RecipeError(f"{where}: expected {expected}, got {got}{hint}")

    if kind == "bool":
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in TRUE | FALSE:
            return value.lower() in TRUE
        raise bad("true or false")
    if kind in ("int", "float"):
        if isinstance(value, bool):
            raise bad("a number", "; YAML reads bare yes/no/on/off as booleans")
        if isinstance(value, str):
            try:
                value = float(value) if kind == "float" or "." in value or "e" in value.lower() else int(value)
            except ValueError:
                raise bad("a number") from None
        if kind == "int":
            if isinstance(value, float) and not value.is_integer():
                raise bad("a whole number")
            value = int(value)
            if opt.choices and value not in opt.choices:
                raise RecipeError(f"{where}: {value} is not one of {', '.join(map(str, opt.choices))}")
            return value
        return float(value)
    if kind in ("str", "int|str"):
        if isinstance(value, bool):
            spellings = ("yes", "on", "true") if value else ("no", "off", "false")
            meant = next((c for c in (opt.choices or ()) if str(c) in spellings), str(value).lower())
            raise bad(
                "a string",
                f"; YAML reads bare yes/no/on/off/true/false as booleans — quote it: {name}: \"{meant}\""
                if not from_cli else "",
            )
        if kind == "int|str" and isinstance(value, int):
            return value
        if kind == "int|str" and isinstance(value, str) and value.strip().lstrip("-").isdigit():
            return int(value)  # a number given on the command line (pad_to_multiple_of 64), not the word 'auto'
        if isinstance(value, (dict, list)):
            raise bad("a string")
        value = str(value)
        if opt.choices and value not in opt.choices:
            raise RecipeError(
                f"{where}: {value!r} is not one of {', '.join(map(str, opt.choices))}; {suggest(value, list(map(str, opt.choices)))}"
            )
        return value
    if kind == "bool|str":
        if isinstance(value, bool):
            return value
        if opt.choices and True in opt.choices:  # a bool or a word (peft's init_lora_weights): CLI 'true' is the bool
            if isinstance(value, str) and value.lower() in TRUE | FALSE:
                return value.lower() in TRUE
            patterns = [re.escape(str(c)).replace(re.escape("[number of iters]"), r"\d+") for c in opt.choices]
            if not any(re.fullmatch(p, str(value)) for p in patterns):  # 'pissa_niter_[number of iters]' is a pattern
                words = [str(c) for c in opt.choices if not isinstance(c, bool)]
                raise RecipeError(f"{where}: {value!r} is not true, false or one of {', '.join(words)}; {suggest(str(value), words)}")
        return str(value)
    if kind == "list|str":  # peft reads a string as one regex and a list as names: each stays what it was written as
        if isinstance(value, str):
            return value
        if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
            return list(value)
        raise bad("a string (a regex) or a list of names")
    if kind == "int|list":  # layer indexes: one, or a list
        items = [s.strip() for s in value.split(",") if s.strip()] if isinstance(value, str) else value
        if isinstance(items, list) and len(items) == 1 and isinstance(value, str):
            items = items[0]
        try:
            if isinstance(items, (list, tuple)):
                if any(isinstance(v, (bool, float)) for v in items):
                    raise ValueError
                return [int(v) for v in items]
            if isinstance(items, (bool, float)):
                raise ValueError
            return int(items)
        except (TypeError, ValueError):
            raise bad("a layer index or a list of them, e.g. [0, 1]") from None
    if kind == "list":
        if isinstance(value, str):
            return [v for v in (s.strip() for s in value.split(",")) if v]
        if isinstance(value, (list, tuple)) and all(isinstance(v, (str, int, float)) and not isinstance(v, bool) for v in value):
            return [str(v) for v in value]
        raise bad("a list of strings (or one comma-separated string)")
    if kind == "list[float]":  # (DPOConfig's loss_weights)
        items = [v for v in (s.strip() for s in value.split(","))] if isinstance(value, str) else value
        try:
            if not isinstance(items, (list, tuple)) or any(isinstance(v, bool) for v in items):
                raise ValueError
            return [float(v) for v in items]
        except (TypeError, ValueError):
            raise bad("a list of numbers, e.g. [1.0, 0.5]") from None
    if kind == "mappings":  # a list of mappings (`datasets:`); on the command line a JSON list
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise RecipeError(f"{where}: not valid JSON ({e.msg}); write a JSON list of mappings, e.g. '[{{\"path\": \"data/a.jsonl\"}}]'") from None
        if not isinstance(value, list) or not value or not all(isinstance(v, dict) for v in value):
            raise bad("a non-empty list of mappings", " (YAML: one '- path: ...' item per dataset; command line: a JSON list)")
        return [dict(v) for v in value]
    if kind == "dict":
        if isinstance(value, dict):
            return value
        if isinstance(value, str):
            if value.strip().startswith("{"):
                try:
                    return json.loads(value)
                except json.JSONDecodeError as e:
                    raise RecipeError(f"{where}: not valid JSON ({e.msg}); write a mapping or a JSON object") from None
            if not Path(value).is_file():
                raise RecipeError(f"{where}: file '{value}' not found; give a mapping, a JSON object or an existing file")
            return value
        raise bad("a mapping, a JSON object string or a file path")
    raise RecipeError(f"{where}: cannot be set from a recipe (type {kind}); remove it")

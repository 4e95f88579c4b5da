"""Options read from config dataclasses: a field becomes an Option (kind, default, help, choices), and TRL's
``SFTConfig``, the other methods' ``DPOConfig`` / ``KTOConfig`` / ``ORPOConfig`` / ``CPOConfig`` / ``GRPOConfig`` / ``RLOOConfig`` and peft's ``LoraConfig`` read that way are kept
as JSON snapshots (``trl_options.json``, ``trl_methods.json``, ``peft_options.json``) so that a recipe is validated and
``--help`` printed before torch is imported.
Torch-free: the classes are read live, and the snapshots rewritten, by train/options.py;
``tests/recipe/test_schema_and_assets.py`` fails when a snapshot differs from the installed package; ``python -m sftrecipes
schema --refresh`` rewrites them."""

from __future__ import annotations

import dataclasses
import enum
import json
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TRL_SNAPSHOT = Path(__file__).with_name("trl_options.json")
METHODS_SNAPSHOT = Path(__file__).with_name("trl_methods.json")
# method -> TRL's config class of its trainer, besides sft's SFTConfig (trl_options.json): read into trl_methods.json
METHOD_CONFIGS = {"dpo": "DPOConfig", "kto": "KTOConfig", "orpo": "ORPOConfig", "cpo": "CPOConfig",
                  "grpo": "GRPOConfig", "rloo": "RLOOConfig"}
# methods whose trainer and config TRL 1.16 keeps outside its top level: the module that holds them
METHOD_MODULES = {"orpo": "trl.experimental.orpo", "cpo": "trl.experimental.cpo"}
PEFT_SNAPSHOT = Path(__file__).with_name("peft_options.json")


@dataclass(frozen=True)
class Option:
    name: str
    kind: str  # bool | int | float | str | dict | list | list[float] | mappings | int|str | str|bool | object
    default: Any
    help: str
    choices: tuple | None = None
    nullable: bool = False
    owner: str = "trl"  # trl | model | data | launch
    methods: tuple | None = None  # TRL keys: the methods (schema.METHODS) whose config class has the key; None: all

    @property
    def scope(self) -> str:
        """'(method dpo, kto only) ' for a TRL key of some methods' config classes, else ''."""
        return f"(method {', '.join(self.methods)} only) " if self.methods else ""

    def describe(self) -> str:
        extra = f" one of {', '.join(map(str, self.choices))}." if self.choices else ""
        return f"{self.scope}{self.help}{extra} [{self.kind}, default {self.default!r}]"


def _kind(tp: Any) -> tuple[str, bool, tuple | None]:
    """(kind, nullable, choices) of a dataclass field annotation."""
    args = typing.get_args(tp)
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        members = [a for a in args if a is not type(None)]
        nullable = len(members) != len(args)
        enums = [a for a in members if isinstance(a, type) and issubclass(a, enum.Enum)]
        if enums:
            return "str", nullable, tuple(e.value for e in enums[0])
        names = set()
        for m in members:
            if typing.get_origin(m) is typing.Literal:
                continue  # e.g. Literal[False] beside str
            names.add(_kind(m)[0])
        if names == {"dict", "str"}:
            return "dict", nullable, None
        if names == {"list[float]"}:
            return "list[float]", nullable, None
        if names <= {"list", "str"}:
            return ("list" if "list" in names else "str"), nullable, None
        if len(names) == 1:
            return names.pop(), nullable, None
        return "|".join(sorted(names)), nullable, None
    if origin in (list, tuple):
        return ("list[float]" if typing.get_args(tp)[:1] == (float,) else "list"), False, None
    if origin is dict or tp is dict:
        return "dict", False, None
    if tp in (bool, int, float, str):
        return tp.__name__, False, None
    return "object", False, None


def options_of(cls: type, owner: str, kind_of=None) -> list[Option]:
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        kind, nullable, choices = (kind_of or _kind)(hints[f.name])
        kind = f.metadata.get("kind", kind)
        choices = f.metadata.get("choices", choices)
        if isinstance(choices, type({}.keys())):
            choices = tuple(choices)
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            default = None
        if isinstance(default, enum.Enum):
            default = default.value
        out.append(
            Option(f.name, kind, default, " ".join(str(f.metadata.get("help", "")).split()),
                   tuple(choices) if choices else None, nullable or default is None, owner)
        )
    return out


def snapshot_rows(options: list[Option]) -> list[dict]:
    """Options as stored in a snapshot file (defaults that JSON cannot hold by their repr)."""
    rows = []
    for o in options:
        default = o.default
        try:
            json.dumps(default)
        except TypeError:
            default = repr(default)
        rows.append({"name": o.name, "kind": o.kind, "default": default, "help": o.help,
                     "choices": list(o.choices) if o.choices else None, "nullable": o.nullable})
    return rows


def load_trl_snapshot(path: Path = TRL_SNAPSHOT) -> dict:
    return json.loads(path.read_text())


def load_methods_snapshot(path: Path = METHODS_SNAPSHOT) -> dict:
    return json.loads(path.read_text())


def peft_kind(tp: Any) -> tuple[str, bool, tuple | None]:
    """(kind, nullable, choices) of a LoraConfig annotation. Literal choices are kept (bias, init_lora_weights);
    'list|str' keeps a string a string (peft reads a str as one regex, a list as names), 'int|list' is layer indexes."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Literal:
        return "str", False, tuple(args)
    if origin in (typing.Union, types.UnionType):
        members = [a for a in args if a is not type(None)]
        nullable = len(members) != len(args)
        literals = [v for a in members if typing.get_origin(a) is typing.Literal for v in typing.get_args(a)]
        others = [a for a in members if typing.get_origin(a) is not typing.Literal]
        if literals:
            if others == [bool]:
                return "bool|str", nullable, (True, False, *literals)
            if not others:
                return "str", nullable, tuple(literals)
        if len(members) == 2 and all(typing.get_origin(a) in (list, None) for a in members):
            inner = {typing.get_args(a)[0] if typing.get_origin(a) is list else a for a in members}
            if inner == {str}:
                return "list|str", nullable, None
            if inner == {int}:
                return "int|list", nullable, None
    return _kind(tp)


def load_peft_snapshot(path: Path = PEFT_SNAPSHOT) -> dict:
    return json.loads(path.read_text())

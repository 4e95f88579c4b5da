"""TRL's and peft's config classes read live (they import torch): a method's TRL class (trainer or config), the option
snapshots recipe/snapshots.py stores read from the installed packages, and rewritten by `schema --refresh`."""

from __future__ import annotations

import importlib
import json
import os
from pathlib import Path

from sftrecipes.recipe.snapshots import (
    METHOD_CONFIGS,
    METHOD_MODULES,
    METHODS_SNAPSHOT,
    PEFT_SNAPSHOT,
    TRL_SNAPSHOT,
    options_of,
    peft_kind,
    snapshot_rows,
)


def _write_snapshot(path: Path, package: str, rows: list[dict]) -> None:
    version = __import__(package).__version__
    path.write_text(json.dumps({f"{package}_version": version, "options": rows}, indent=1, sort_keys=True) + "\n")


def trl_snapshot() -> list[dict]:
    """Read SFTConfig's fields from the installed TRL (imports torch; used to refresh and to test the copy)."""
    from trl import SFTConfig

    return snapshot_rows(options_of(SFTConfig, "trl"))


def write_trl_snapshot(path: Path = TRL_SNAPSHOT) -> None:
    _write_snapshot(path, "trl", trl_snapshot())


def methods_snapshot() -> dict[str, list[dict]]:
    """Each preference method's config class (METHOD_CONFIGS) read from the installed TRL, every field of it."""
    return {method: snapshot_rows(options_of(trl_class(method, cls), "trl")) for method, cls in METHOD_CONFIGS.items()}


def trl_class(method: str, name: str) -> type:
    """TRL's class `name` (a trainer or a config) for `method`: from trl itself, or from the experimental module
    METHOD_MODULES names (orpo, cpo), whose import notice is silenced: the run logs which trainer it uses."""
    module = METHOD_MODULES.get(method, "trl")
    if module != "trl":
        os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    return getattr(importlib.import_module(module), name)


def write_methods_snapshot(path: Path = METHODS_SNAPSHOT) -> None:
    version = __import__("trl").__version__
    path.write_text(json.dumps({"trl_version": version, **methods_snapshot()}, indent=1, sort_keys=True) + "\n")


def peft_snapshot() -> list[dict]:
    """Read LoraConfig's fields from the installed peft (imports torch; used to refresh and to test the copy)."""
    from peft import LoraConfig

    return snapshot_rows(options_of(LoraConfig, "peft", peft_kind))


def write_peft_snapshot(path: Path = PEFT_SNAPSHOT) -> None:
    _write_snapshot(path, "peft", peft_snapshot())

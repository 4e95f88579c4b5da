"""What a model's config.json says, read once: where it is (a local folder, an adapter's base, or the copy shipped for
a hub id in model_configs/), the dict transformers would read, and the model's Shape from it (shape_table.py's
torch-free layouts, or the model transformers builds on the meta device: model/meta.py)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from sftrecipes.core.errors import RecipeError
from sftrecipes.facts import perlayer
from sftrecipes.facts.shape import Shape
from sftrecipes.facts.shape_table import DEFAULTS, table_shape
from sftrecipes.facts.startmodel import torch_free_source

CONFIGS = Path(__file__).with_name("model_configs")


def config_path(name: str) -> Path:
    """config.json of a local model folder, or the copy shipped for a hub id (model_configs/<org>--<name>.json); for
    a LoRA adapter folder, its base's (the model a run from it trains: startmodel.py)."""
    name = torch_free_source(name)
    local = Path(name).expanduser()
    if local.is_dir():
        return local / "config.json"
    return CONFIGS / (name.replace("/", "--") + ".json")


def _special_float(obj: dict):
    """transformers writes inf and nan in config.json as {"__float__": "Infinity"} (Bamba's time_step_limit); read
    back as the float, as its from_pretrained does."""
    tag = obj.get("__float__") if len(obj) == 1 else None
    return float(tag) if tag in ("Infinity", "-Infinity", "NaN") else obj


def read_config(name: str) -> dict:
    """The config dict of a model name (a local folder or a hub id with a shipped config)."""
    path = config_path(name)
    if not path.is_file():
        shipped = ", ".join(sorted(p.stem.replace("--", "/") for p in CONFIGS.glob("*.json")))
        raise RecipeError(f"model_name_or_path: no config.json for '{name}' offline; point it at a local model folder, "
                          f"or add {CONFIGS / (name.replace('/', '--') + '.json')} (shipped: {shipped})")
    try:
        return json.loads(path.read_text(), object_hook=_special_float)
    except json.JSONDecodeError as e:
        raise RecipeError(f"model_name_or_path: {path} is not valid JSON ({e.msg} at line {e.lineno}); fix or replace it") from None


def model_shape(source: str | Path | dict, name: str | None = None) -> Shape:
    """Shape of a model: a local folder or hub id (its config.json), or a config dict (e.g. `config.to_dict()`).

    A flat config of a type shape_table.DEFAULTS holds is read there, torch-free (tests/facts/test_shape.py proves every such
    layout equal to the model transformers builds, and its LoRA counts equal to the run's). Any other config -- another
    of the causal-LM architectures transformers maps, a multimodal config (text_config beside a vision tower), counted
    whole, or one whose sizes vary by layer (per_layer_config) -- is read from the model transformers builds from it on
    the meta device (meta.py: imports torch), which reads each layer's own config."""
    if isinstance(source, dict):
        c, where = source, "the model config"
    else:
        c, where = read_config(str(source)), str(config_path(str(source)))
        name = name or str(source)
    mt = c.get("model_type")
    if not mt:
        raise RecipeError(f"model_name_or_path: {where} has no model_type; a config.json names its architecture "
                          "(e.g. \"model_type\": \"llama\"); fix the file or point at the model's own folder")
    if mt in DEFAULTS and "text_config" not in c and not perlayer.overrides(c):
        shape = table_shape(c, mt, name or c.get("_name_or_path") or mt)
        return dataclasses.replace(shape, config_json=json.dumps(c, sort_keys=True, default=str))
    from sftrecipes.model.meta import meta_shape

    return meta_shape(c, name or c.get("_name_or_path") or mt, where)

"""Per-layer config values: what each decoder layer's config says where transformers lets a value vary by layer
(`per_layer_config`, transformers/integrations/heterogeneity), read layer by layer and never as the global value
transformers refuses for it.

A heterogeneous config holds the global values and each layer's overrides: Gemma-4's default config gives its
full-attention layers `head_dim` 512 beside the sliding layers' 256 (`per_layer_config: {"05": {"head_dim": 512}, ...}`
in config.json), dots3's give some layers other head counts. Reading such an attribute from the config object raises
AmbiguousGlobalPerLayerAttributeError; the layer's own config (`config.per_layer_config[i]`, the global values with its
overrides) holds its value, and that is what each modeling class reads.

    overrides(config_dict)            # {5: {"head_dim": 512}, ...}: the overrides a config.json carries ({}: none)
    layer_config(config, i)           # layer i's config object, as the model's layer i is built from it
    get(config, "max_position_embeddings")   # a global value; None where the key varies by layer
    values(config, "sliding_window")  # the key's value in every layer's config
"""

from __future__ import annotations

from typing import Any


def overrides(c: dict) -> dict[int, dict]:
    """The per-layer overrides a config dict carries (its `per_layer_config`; keys as config.json writes them, zero-padded
    digits, or ints), by layer index; {} where every layer reads the global values."""
    raw = c.get("per_layer_config")
    if not isinstance(raw, dict):
        return {}
    return {int(i): dict(v) for i, v in raw.items() if isinstance(v, dict) and v}


def varies(cfg, key: str) -> bool:
    """Whether `key` is a per-layer attribute of the config object (transformers refuses to read it globally)."""
    name = getattr(type(cfg), "attribute_map", {}).get(key, key)
    return name in (getattr(cfg, "per_layer_attributes", None) or ())


def get(cfg, key: str, default: Any = None) -> Any:
    """The config's value of `key` where it is one for every layer (`default` where unset), `default` where it varies by
    layer: read that per layer (layer_config)."""
    return default if varies(cfg, key) else getattr(cfg, key, default)


def layer_config(cfg, i: int):
    """Layer i's config as transformers resolves it (the global values with the layer's overrides); the config itself
    where nothing varies by layer, or for a layer past its num_hidden_layers (read those with `get`)."""
    if not getattr(cfg, "is_heterogeneous", False):
        return cfg
    view = cfg.per_layer_config
    return view[i] if 0 <= i < len(view) else cfg


def values(cfg, key: str, default: Any = None) -> list:
    """`key`'s value in each layer's config (one value for a config whose layers all read the global values)."""
    if not getattr(cfg, "is_heterogeneous", False):
        return [getattr(cfg, key, default)]
    return [getattr(layer, key, default) for layer in cfg.per_layer_config]

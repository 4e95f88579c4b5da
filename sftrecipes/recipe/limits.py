"""What a recipe asks beyond what its model or its target can give, refused torch-free from the files: a max_length
past the positions the model's config.json declares, and activation offloading where there is no GPU to offload from.

validation.validate calls `check`; train/args.training_kwargs calls `check_offloading` again with the target the run
resolved (`launch.hardware: auto` on a machine without a GPU).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from sftrecipes.core.errors import RecipeError
from sftrecipes.facts.config import config_path, read_config

if TYPE_CHECKING:
    from sftrecipes.recipe.typed import Recipe

ROPE_KEYS = ("rope_scaling", "rope_parameters")  # the config keys of rope scaling (transformers 5 reads both)


def max_positions(model_name_or_path: str) -> tuple[int | None, str]:
    """(positions the model's config.json declares, where) — max_position_embeddings, at the top or in a multimodal
    config's text_config (n_positions for GPT-2-style configs); None when no config is at hand offline."""
    if not config_path(model_name_or_path).is_file():
        return None, ""
    try:
        cfg = read_config(model_name_or_path)
    except RecipeError:
        return None, ""
    for where, c in (("", cfg), ("text_config.", cfg.get("text_config") or {})):
        for key in ("max_position_embeddings", "n_positions"):
            if isinstance(c.get(key), int) and not isinstance(c.get(key), bool):
                return c[key], where + key
    return None, ""


def _rope_scaled(kwargs: dict[str, Any]) -> bool:
    """Whether model_init_kwargs (passed to from_pretrained, which sets them on the config) scale the rope."""
    for key in ROPE_KEYS:
        value = kwargs.get(key)
        if isinstance(value, dict) and value.get("rope_type", value.get("type", "default")) != "default":
            return True
    return False


def check_positions(r: Recipe) -> None:
    """max_length beyond the model's max_position_embeddings: positions the model never saw, refused unless the
    recipe scales the rope (model_init_kwargs) or says it means it (max_length_beyond_positions)."""
    length = r.trl_value("max_length")
    if length is None or r.model.max_length_beyond_positions:
        return
    kwargs = dict(r.trl_value("model_init_kwargs") or {})
    if _rope_scaled(kwargs):
        return
    positions, key = max_positions(r.model.model_name_or_path)
    if isinstance(kwargs.get("max_position_embeddings"), int):
        positions, key = kwargs["max_position_embeddings"], "model_init_kwargs.max_position_embeddings"
    if positions is None or length <= positions:
        return
    raise RecipeError(
        f"max_length: {length} is beyond {r.model.model_name_or_path}'s {key} {positions} (config.json): positions the "
        f"model was never trained on; set max_length: {positions} or less, scale the rope (model_init_kwargs: "
        "{rope_parameters: {rope_type: linear, factor: F, rope_theta: ...}}), or set max_length_beyond_positions: true "
        "to train past them as asked")


def check_offloading(r: Recipe, target: str | None = None) -> None:
    """activation_offloading (TRL: the tensors autograd saves, moved to pinned host memory in forward and back in
    backward) needs an accelerator to offload from: on the cpu target TRL's context fails when the trainer is built
    (torch.accelerator finds none), and there is nothing to move."""
    if not r.trl_value("activation_offloading"):
        return
    target = target or ("cpu" if r.launch.hardware == "cpu" else None)
    if target == "cpu":
        raise RecipeError("activation_offloading: moves the activations autograd keeps from GPU to host memory, and the "
                          "cpu target has no GPU (TRL's offloading fails there: torch finds no accelerator); remove "
                          "activation_offloading, or run on GPUs (launch.hardware: gpu)")


def check(r: Recipe) -> None:
    check_positions(r)
    check_offloading(r)

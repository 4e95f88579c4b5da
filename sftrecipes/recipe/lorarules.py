"""The LoRA rules of a recipe, torch-free: peft's LoraConfig keys and the mixture-of-experts targets checked before any
model loads (what peft would refuse deep in training, or the streaming merge could not export), each failure one line
naming the key and the fix; validation.validate calls `validate_lora`."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from sftrecipes.core.errors import RecipeError
from sftrecipes.facts.config import config_path, model_shape

if TYPE_CHECKING:
    from sftrecipes.recipe.typed import Recipe


def moe_experts(model_name_or_path: str) -> int | None:
    """Routed experts per layer of the model (shape.py, from its config.json: a local folder's or the copy shipped in
    model_configs/ for a hub id): 0 for a dense model, None when no config is at hand offline or transformers cannot
    build it. Torch-free for the layouts shape.py's table holds; another architecture's count is the meta model's
    (meta.py imports torch), so its facts are the model's own."""
    if not config_path(model_name_or_path).is_file():
        return None
    try:
        return model_shape(model_name_or_path).experts
    except RecipeError:
        return None


# Names a target list may use for the fused expert tensors of transformers 5 MoE models: the tensors' own names and
# the per-projection names they were fused from (Llama/Qwen spelling, Mixtral's w1/w2/w3). lora.lora_config maps
# them onto the model's real parameters; here they only tell, before loading, that parameters will be adapted.
EXPERT_TARGET_NAMES = ("gate_up_proj", "down_proj", "gate_proj", "up_proj", "w1", "w2", "w3")
ROUTER_NAMES = ("gate", "router")
# init_lora_weights values that cannot give an adapter the streaming merge (or any later run) can use, and why.
INIT_REFUSED = {
    "pissa": "rewrites the base weights when the adapter is created (W - BA), so the adapter fits only that modified base, not the base model export/merge read",
    "olora": "rewrites the base weights when the adapter is created (W - QR), so the adapter fits only that modified base, not the base model export/merge read",
    "corda": "needs calibration data (peft's preprocess_corda) and rewrites the base weights",
    "loftq": "needs loftq_config and rewrites the (quantized) base weights",
    "eva": "needs a pass over the data before training (peft's initialize_lora_eva_weights), which the trainer does not run",
    "mica": "leaves the frozen lora_B out of the adapter file (peft recomputes it from an SVD of the base weight), which the streaming merge does not reproduce",
}


def parameter_targets(r: Recipe) -> str | None:
    """What the recipe adapts as parameters rather than modules (peft's ParamWrapper: no DoRA; no dropout, which the modules alone get), in
    words, or None. From the keys and the model's config.json, before anything is loaded."""
    m = r.model
    if r.peft.get("target_parameters"):
        return f"target_parameters ({', '.join(r.peft['target_parameters'])})"
    experts = moe_experts(m.model_name_or_path)
    if not experts:
        return None
    targets = m.lora_target_modules.strip()
    if targets == "all-linear":
        return "the expert parameters that all-linear adapts on this mixture-of-experts model"
    listed = [t.strip() for t in targets.split(",") if t.strip().rsplit(".", 1)[-1] in EXPERT_TARGET_NAMES]
    if listed:
        return f"the expert parameters of this mixture-of-experts model ({', '.join(listed)})"
    if m.lora_target_router:
        return "the router (lora_target_router)"
    return None


def validate_lora(r: Recipe) -> None:
    """peft's LoraConfig keys and the MoE rules: what peft would refuse deep inside training, or what the streaming
    merge could not export, is refused here, before any model is loaded."""
    m, p = r.model, r.peft
    init = p.get("init_lora_weights", True)
    if isinstance(init, str):
        family = "pissa" if init.startswith("pissa") else init
        if family in INIT_REFUSED:
            raise RecipeError(f"init_lora_weights: '{init}' is not supported: it {INIT_REFUSED[family]}; use true, gaussian or orthogonal")
    for key in ("rank_pattern", "alpha_pattern"):
        pattern = p.get(key)
        if pattern is None:
            continue
        if not isinstance(pattern, dict):
            raise RecipeError(f"{key}: must be a mapping of module-name regex to a number, e.g. {key}: {{q_proj: 16}}; got {pattern!r}")
        for k, v in pattern.items():
            try:
                re.compile(str(k))
            except re.error as e:
                raise RecipeError(f"{key}: '{k}' is not a valid regex ({e}); peft matches each key as a regex against module names") from None
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise RecipeError(f"{key}: '{k}': {v!r} must be a whole number >= 1")
    if p.get("layers_pattern") and p.get("layers_to_transform") is None:
        raise RecipeError("layers_pattern: only applies with layers_to_transform; set layers_to_transform (e.g. [0, 1]) or remove layers_pattern")
    layers = p.get("layers_to_transform")
    if layers is not None and any(i < 0 for i in (layers if isinstance(layers, list) else [layers])):
        raise RecipeError(f"layers_to_transform: layer indexes start at 0, got {layers}")
    if init == "orthogonal":
        odd = [v for v in [m.lora_r, *(p.get("rank_pattern") or {}).values()] if v % 2]
        if odd:
            raise RecipeError(f"init_lora_weights: orthogonal needs even ranks, got {odd[0]}; make lora_r (and rank_pattern values) even")
    listed = [] if m.lora_target_modules.strip() == "all-linear" else [t.strip() for t in m.lora_target_modules.split(",")]
    for name in p.get("target_parameters") or []:
        module = name.rpartition(".")[0]
        if module and any(module == t or module.endswith("." + t) for t in listed if t):
            raise RecipeError(f"target_parameters: '{name}' belongs to a module lora_target_modules already adapts; adapt it one way: remove it from one of the two")

    what = parameter_targets(r)
    experts = moe_experts(m.model_name_or_path)
    if m.lora_target_router and experts == 0:
        raise RecipeError(f"lora_target_router: {m.model_name_or_path} is not a mixture-of-experts model (it has no router); remove lora_target_router")
    if experts:
        named_router = [t for t in listed if t in ROUTER_NAMES]
        if named_router:
            raise RecipeError(f"lora_target_modules: '{named_router[0]}' is the router of this mixture-of-experts model; remove it from the list and set lora_target_router: true")
    if what is None:
        return
    if p.get("use_dora"):
        raise RecipeError(f"use_dora: DoRA cannot adapt {what} (peft's parameter wrapper has no DoRA); set use_dora: false, or adapt only linear modules")
    if init == "orthogonal":
        raise RecipeError(f"init_lora_weights: orthogonal cannot initialise {what} (it reads a module weight those parameters lack); use true or gaussian")

"""LoRA: the peft LoraConfig a recipe asks for, its targets resolved on the loaded model (dense or mixture-of-experts).

Also describe_adapter: the one line a run logs on what LoRA adapted. (peft's rank/alpha pattern lookup, which
exports need without peft, is shape.pattern_value.)
"""

from __future__ import annotations

import functools
import inspect
import logging
import re
import types

import torch
from peft import LoraConfig
from peft.tuners import tuners_utils
from peft.tuners.lora import LoraLayer, ParamWrapper
from peft.tuners.tuners_utils import check_target_module_exists
from transformers.pytorch_utils import Conv1D

from sftrecipes.core.errors import RecipeError
from sftrecipes.facts.shape import pattern_value
from sftrecipes.recipe.typed import Recipe

log = logging.getLogger("sftrecipes")

# transformers 5 fuses the experts of a mixture-of-experts layer into 3-D parameters (mlp.experts.gate_up_proj
# [E, 2*inter, hidden], mlp.experts.down_proj [E, hidden, inter]) behind a router (mlp.gate, [E, hidden]). peft adapts
# such parameters with its ParamWrapper (target_parameters), which allows no dropout and no DoRA (validation.py
# refuses both before loading). A target list may name the fused tensors, or the projections they were fused from:
EXPERT_ALIASES = {"gate_proj": "gate_up_proj", "up_proj": "gate_up_proj", "w1": "gate_up_proj", "w3": "gate_up_proj", "w2": "down_proj"}
FUSED_FROM = {"gate_up_proj": (("gate_proj", "up_proj"), ("w1", "w3"))}  # two projections in one tensor: rank and alpha x2


def _clean(name: str) -> str:
    """A parameter or module name without peft's wrapper segments (the name it has in the base model)."""
    return re.sub(r"\.base_layer(?=\.|$)", "", name.removeprefix("base_model.model."))


def _is_experts(module) -> bool:
    """A mixture-of-experts block's experts, by structure: transformers' experts classes (those its experts
    implementations decorate carry `is_concatenated`; the others are named *Experts), not a convolution."""
    if isinstance(module, torch.nn.modules.conv._ConvNd):
        return False
    return hasattr(module, "is_concatenated") or type(module).__name__.endswith("Experts")


def moe_layout(model) -> tuple[dict[str, tuple[int, ...]], dict[str, bool]]:
    """(expert parameters: name -> [E, ., .] shape, routers: module name -> is an nn.Linear) of a model, by structure:
    experts are the 3-D parameters of a mixture-of-experts block's experts module (_is_experts; or a module whose 3-D
    parameters share E >= 2 rows with a router beside it) -- never a 3-D tensor for its shape alone (SigLIP's pooling
    `probe` [1, 1, h], a convolution's kernel); a router is a sibling module of the experts' module whose own 2-D
    parameter has E rows. Names as in the base model (peft's wrappers looked through); shapes also under ZeRO-3."""
    params, owners = {}, {}
    for n, p in model.named_parameters():
        if not any(mark in n for mark in ("lora_", ".modules_to_save.", ".original_module.", ".token_adapter.")):
            params[_clean(n)] = tuple(getattr(p, "ds_shape", p.shape))
            owners[_clean(n)] = n.rpartition(".")[0]
    candidates = {n: s for n, s in params.items() if len(s) == 3}

    holders_under: dict[str, int] = {}  # module path -> how many modules at or below it hold parameters
    for h in {n.rpartition(".")[0] for n in params}:
        parts = h.split(".")
        for k in range(1, len(parts) + 1):
            holders_under[".".join(parts[:k])] = holders_under.get(".".join(parts[:k]), 0) + 1

    def routers_of(container: str, rows: set[int]) -> dict[str, bool]:
        block, found = container.rpartition(".")[0], {}
        for n, s in params.items():
            module = n.rpartition(".")[0]
            parent = module.rpartition(".")[0]
            # beside the experts, or the one weighted part of a module beside them (AFMoE's router.gate)
            beside = parent == block or (parent.rpartition(".")[0] == block and parent != container
                                         and holders_under.get(parent) == 1)
            if module != container and beside and len(s) == 2 and s[0] in rows:
                try:
                    found[module] = isinstance(model.get_submodule(module), torch.nn.Linear)
                except AttributeError:  # a peft model: the path runs through wrappers
                    found[module] = False
        return found

    experts: dict[str, tuple[int, ...]] = {}
    routers: dict[str, bool] = {}
    for container in {n.rpartition(".")[0] for n in candidates}:
        mine = {n: s for n, s in candidates.items() if n.rpartition(".")[0] == container}
        rows = {s[0] for s in mine.values()}
        owner = model.get_submodule(owners[next(iter(mine))])
        if isinstance(owner, torch.nn.modules.conv._ConvNd):
            continue
        found = routers_of(container, rows)
        # an experts class may size its tensors apart (LongCat-Flash: gate_up_proj holds its zero-computation
        # experts' rows too, down_proj the routed ones only); a module found by its router alone shares one E
        if (_is_experts(owner) and max(rows) >= 2) or (len(rows) == 1 and min(rows) >= 2 and found):
            experts.update(mine)
            routers.update(found)
    return experts, routers


def _plain_linear(module) -> bool:
    """A linear layer LoRA's x @ A @ B applies to: nn.Linear, GPT-2's Conv1D, a quantized one peft dispatches (bitsandbytes), not a
    subclass built to compute something else (DeepSeek-V4's grouped o_a_proj: one block per head group)."""
    if isinstance(module, Conv1D):  # GPT-2's linear layer, weight [in, out]: peft adapts it with fan_in_fan_out
        return True
    return isinstance(module, torch.nn.Linear) and _linear_class(type(module))


@functools.cache
def _linear_class(cls: type) -> bool:
    """A subclass of nn.Linear built from other arguments computes something else (DeepSeek-V4's GroupedLinear takes
    n_groups); one that only rewrites forward (Falcon's FalconLinear) is a linear layer; read once per class."""
    own = set(inspect.signature(cls.__init__).parameters) <= set(inspect.signature(torch.nn.Linear.__init__).parameters)
    return own or cls.__module__.startswith("bitsandbytes")


def _names(linear: list[str], modules: dict) -> list[str]:
    """The names target_modules (target_parameters) lists for these linear layers (parameters): each one's shortest
    dotted end that matches names of this list only (the leaf, usually; `ffn.0` where a Sequential's index 0 would also
    match layer h.0)."""
    chosen = set()
    mine = set(linear)
    for n in linear:
        parts = n.split(".")
        for k in range(1, len(parts) + 1):
            end = ".".join(parts[-k:])
            if all(m in mine for m in modules if m == end or m.endswith("." + end)):
                chosen.add(end)
                break
    return sorted(chosen)


def _peft_refuses(name: str, model) -> str | None:
    """Why peft refuses LoRA on a module of this name in this model (its own rule: out_proj and conv1d in Mamba
    models), or None; read by asking peft's check, so the rule is peft's."""
    check = getattr(tuners_utils, "_check_lora_target_modules_mamba", None)
    if check is None:
        return None
    try:
        check(types.SimpleNamespace(peft_type="LORA"), model, name)
    except ValueError as e:
        return str(e).split(". ")[0]
    return None


def language_model(model) -> str | None:
    """The module name of a vision-language model's text decoder (transformers' get_decoder), None for a model
    without a vision tower (its config has no vision_config)."""
    if getattr(model.config, "vision_config", None) is None:
        return None
    decoder = model.get_decoder()
    return next((n for n, mod in model.named_modules() if mod is decoder and n), None)


def lora_targets(recipe: Recipe, model) -> dict:
    """target_modules, target_parameters, rank_pattern and alpha_pattern for LoraConfig, resolved on the model.

    Dense models: lora_target_modules as given ('all-linear': every linear layer but the output head, as peft reads
    it), each listed name checked to exist.
    Mixture-of-experts models: 'all-linear' adapts every linear layer but the router, and the fused expert tensors (as
    peft does under all-linear: gate_up_proj at rank 2r and alpha 2*alpha, i.e. r per projection; user rank/alpha
    patterns are merged, and one matching gate_up_proj is doubled the same way). A list may name linear layers, the
    expert tensors (gate_up_proj, down_proj) or the projections fused into them (gate_proj+up_proj, w1+w3, w2: the
    expert tensors). The router is adapted only with lora_target_router: true, never by naming it. layers_to_transform,
    layers_pattern, exclude_modules and modules_to_save also select among expert parameters (peft applies them to
    modules only), by passing the selected parameters by full name."""

    m, p = recipe.model, recipe.peft
    spec = m.lora_target_modules.strip()
    listed = None if spec == "all-linear" else list(dict.fromkeys(t.strip() for t in spec.split(",") if t.strip()))
    experts, routers = moe_layout(model)
    out_emb = model.get_output_embeddings()
    modules = {n: mod for n, mod in model.named_modules() if n}
    # the output head is not adapted: the model's output embeddings, or a linear named lm_head where the model does
    # not say (BLT; TRL refuses LoRA on lm_head: its fused loss reads lm_head.weight itself)
    linear = [n for n, mod in modules.items() if _plain_linear(mod) and mod is not out_emb
              and n.rsplit(".", 1)[-1] != "lm_head"]
    decoder = language_model(model)
    if decoder is not None and listed is None:  # a vision-language model: all-linear is its language model's layers
        linear = [n for n in linear if n.startswith(decoder + ".")]  # (the vision tower and projector stay frozen)

    def hits(t: str, names) -> list[str]:
        return [n for n in names if n == t or n.endswith("." + t)]

    params: list[str] = []
    if not experts:
        # all-linear resolved to the layers' names here, not by peft: peft's resolution (full names) would bypass
        # layers_to_transform, which it applies only to names it matches by suffix
        target_modules: list[str] = _names(linear, modules) if listed is None else listed
        for t in listed or []:
            if not hits(t, modules):
                raise RecipeError(f"lora_target_modules: '{t}' matches no module of {m.model_name_or_path}; "
                                  f"its linear layers are {', '.join(sorted({n.rsplit('.', 1)[-1] for n in linear}))}")
    else:
        expert_leaves = {n.rsplit(".", 1)[-1] for n in experts}
        router_leaves = {r.rsplit(".", 1)[-1] for r in routers}
        if listed is None:
            target_modules = _names([n for n in linear if n not in routers], modules)
            # each expert tensor by its shortest end naming expert tensors only (JetMoE's are input_linear.weight)
            params = _names(list(experts), dict.fromkeys(_clean(n) for n, _ in model.named_parameters() if "lora_" not in n))
        else:
            target_modules, aliases = [], set()
            for t in listed:
                if hits(t, routers) or t in router_leaves:
                    raise RecipeError(f"lora_target_modules: '{t}' is the router of this mixture-of-experts model; remove it and set lora_target_router: true")
                leaf = t.rsplit(".", 1)[-1]
                module_hits = hits(t, [n for n in modules if n not in routers])
                if module_hits:
                    target_modules.append(t)
                if hits(t, experts):
                    params.append(t)
                elif not module_hits and EXPERT_ALIASES.get(leaf) in expert_leaves:
                    aliases.add(leaf)
                    params.append(EXPERT_ALIASES[leaf])
                elif not module_hits:
                    raise RecipeError(f"lora_target_modules: '{t}' matches no module or expert parameter of {m.model_name_or_path}; "
                                      f"its linear layers are {', '.join(sorted({n.rsplit('.', 1)[-1] for n in linear} - router_leaves))}, "
                                      f"its expert parameters {', '.join(sorted(expert_leaves))}")
            for fused, groups in FUSED_FROM.items():
                for group in groups:
                    have = aliases & set(group)
                    if have and have != set(group):
                        raise RecipeError(f"lora_target_modules: {' and '.join(group)} are one tensor ({fused}) in this model; list both, or {fused}")
        if m.lora_target_router:
            for r, is_linear in sorted(routers.items()):
                leaf = r.rsplit(".", 1)[-1]
                if is_linear:
                    target_modules.append(leaf)
                else:
                    params.append(f"{leaf}.weight")
        target_modules = list(dict.fromkeys(target_modules))
    refused = {t: _peft_refuses(t.rsplit(".", 1)[-1], model) for t in target_modules}
    for t, why in refused.items():
        if why and listed is not None and t in listed:
            raise RecipeError(f"lora_target_modules: '{t}' cannot take LoRA here ({why}); remove it")
    if any(refused.values()):
        log.info("LoRA: all-linear leaves out %s (%s)", ", ".join(t for t, w in refused.items() if w), next(w for w in refused.values() if w))
    target_modules = [t for t in target_modules if not refused[t]]
    params = list(dict.fromkeys(params + list(p.get("target_parameters") or [])))

    # the parameters these names select, as peft would match them, narrowed as peft narrows modules
    names = [n for n, _ in model.named_parameters()] if params else []
    names = [_clean(n) for n in names if "lora_" not in n]
    selected = [n for n in names if hits_any(n, params)]
    for t in p.get("target_parameters") or []:
        if not any(hits_any(n, [t]) for n in names):
            raise RecipeError(f"target_parameters: '{t}' matches no parameter of {m.model_name_or_path}; give a parameter's "
                              "name or its dotted end, e.g. mlp.down_proj.weight")
    narrowing = p.get("layers_to_transform") is not None or p.get("exclude_modules") or p.get("modules_to_save")
    if selected and narrowing:
        probe = types.SimpleNamespace(exclude_modules=p.get("exclude_modules"), modules_to_save=p.get("modules_to_save"),
                                      target_modules=[n.rsplit(".", 1)[-1] for n in selected], target_parameters=None,
                                      layers_to_transform=p.get("layers_to_transform"), layers_pattern=p.get("layers_pattern"))
        module_probe = types.SimpleNamespace(**{**vars(probe), "target_modules": [n.rpartition(".")[0] for n in selected]})
        selected = [n for n in selected if check_target_module_exists(probe, n) is True
                    and check_target_module_exists(module_probe, n.rpartition(".")[0]) is True]
        params = selected
    if params and p.get("use_dora"):  # validation.validate catches this when config.json is at hand
        raise RecipeError(f"use_dora: {p.get('use_dora')} cannot apply to the parameters LoRA adapts here ({', '.join(params[:3])}): "
                          "peft's parameter wrapper has no DoRA; set use_dora: false")
    if params and m.lora_dropout and not target_modules:
        raise RecipeError(f"lora_dropout: {m.lora_dropout} applies to no module here: LoRA adapts only parameters ({', '.join(params[:3])}), "
                          "which peft adapts without dropout; set lora_dropout: 0.0")
    adapted = {n for n in modules if hits_any(n, target_modules)}
    for n in selected:
        if n.rpartition(".")[0] in adapted:
            raise RecipeError(f"target_parameters: '{n}' belongs to a module lora_target_modules also adapts; adapt it one way: remove it from one of the two")

    # ranks and alphas: the fused gate/up tensor gets twice the rank and alpha that apply to it (its own pattern, or r)
    rank_pattern, alpha_pattern = dict(p.get("rank_pattern") or {}), dict(p.get("alpha_pattern") or {})
    fused = {n: (2 * pattern_value(rank_pattern, n, m.lora_r), 2 * pattern_value(alpha_pattern, n, m.lora_alpha))
             for n in selected if n.rsplit(".", 1)[-1] in FUSED_FROM}
    if fused:
        keys = ({r".*\.gate_up_proj": next(iter(fused.values()))} if len(set(fused.values())) == 1
                else {re.escape(n): v for n, v in fused.items()})
        # peft takes the first pattern that matches: the fused tensor's own keys go first
        rank_pattern = {**{k: v[0] for k, v in keys.items()}, **{k: v for k, v in rank_pattern.items() if k not in keys}}
        alpha_pattern = {**{k: v[1] for k, v in keys.items()}, **{k: v for k, v in alpha_pattern.items() if k not in keys}}
    return {"target_modules": target_modules, "target_parameters": params or None,
            "rank_pattern": rank_pattern, "alpha_pattern": alpha_pattern}


def hits_any(name: str, targets: list[str]) -> bool:
    """peft's target_parameters match: the full name, or a dotted suffix of it."""
    return any(name == t or name.endswith("." + t) for t in targets)


def lora_config(recipe: Recipe, added_tokens: list[int], model=None):
    """peft's LoraConfig for the recipe: the project's LoRA keys, the recipe's peft keys (recipe.peft) as given, the
    targets resolved on `model` (lora_targets; without a model, lora_target_modules as written), and the rows of
    tokens a chat template added."""
    m = recipe.model
    if not m.use_peft_lora:
        return None

    kwargs = dict(recipe.peft)
    if model is not None:
        kwargs.update(lora_targets(recipe, model))
    else:
        targets = m.lora_target_modules.strip()
        kwargs["target_modules"] = targets if targets == "all-linear" else [t.strip() for t in targets.split(",") if t.strip()]
    if added_tokens:
        # New special tokens start with random rows: train just those rows (input and output embeddings), not the
        # whole matrices. PEFT then saves the resized embeddings with the adapter, so it merges on its own. A matrix
        # the recipe trains whole (modules_to_save) already holds its new rows.
        rows = sorted(set(added_tokens))
        whole = set(recipe.peft.get("modules_to_save") or [])
        heads = ["embed_tokens"]
        if model is None or not model.config.get_text_config().tie_word_embeddings:
            heads.append("lm_head")
        kwargs["trainable_token_indices"] = {h: rows for h in heads if h not in whole} or None
    kwargs.setdefault("bias", "none")
    # peft refuses dropout on any adapter with parameter targets (its parameter wrapper cannot drop out inside
    # x @ (W + BA)); the modules get lora_dropout after injection (module_dropout), the parameters none
    dropout = 0.0 if kwargs.get("target_parameters") else m.lora_dropout
    return LoraConfig(r=m.lora_r, lora_alpha=m.lora_alpha, lora_dropout=dropout, task_type="CAUSAL_LM", **kwargs)


def module_dropout(model, recipe: Recipe) -> int:
    """lora_dropout on the adapted modules of an adapter that also adapts parameters (experts, a router), which
    lora_config built without dropout because peft refuses dropout on such an adapter; the parameter wrappers stay
    without. The number of modules given dropout (0 where peft applied lora_dropout itself). The adapter's saved
    config says lora_dropout 0.0, as peft must load it; dropout only acts in training."""
    p = recipe.model.lora_dropout
    if not (recipe.model.use_peft_lora and p):
        return 0
    layers = [mod for mod in model.modules() if isinstance(mod, LoraLayer) and mod.r]
    if not any(isinstance(mod, ParamWrapper) for mod in layers):
        return 0
    given = 0
    for mod in layers:
        if isinstance(mod, ParamWrapper):
            continue
        for adapter, drop in mod.lora_dropout.items():
            if isinstance(drop, torch.nn.Identity):
                mod.lora_dropout[adapter] = torch.nn.Dropout(p)
                given += 1
    return given


def describe_adapter(model, recipe: Recipe) -> str:
    """One line on what LoRA adapted in the peft model the trainer built: linear modules, expert parameters (with
    their rank), the router or not, and the trainable parameter count."""

    experts, routers = moe_layout(model)
    mods: dict[str, set] = {}
    params: dict[str, set] = {}
    router: dict[str, set] = {}
    for name, module in model.named_modules():
        if not isinstance(module, LoraLayer) or not module.r:
            continue
        ranks = set(module.r.values())
        if isinstance(module, ParamWrapper):
            target = f"{_clean(name)}.{module.parameter_name}"
            owner = target.rpartition(".")[0]
            short = ".".join(target.split(".")[-2:]) if target not in experts else target.rsplit(".", 1)[-1]
            (router if owner in routers else params).setdefault(short, set()).update(ranks)
        else:
            (router if _clean(name) in routers else mods).setdefault(name.rsplit(".", 1)[-1], set()).update(ranks)

    def fmt(d: dict) -> str:
        return ", ".join(f"{k} (r {'/'.join(map(str, sorted(v)))})" for k, v in sorted(d.items()))

    trainable, total = model.get_nb_trainable_parameters()
    parts = [f"LoRA adapts modules {fmt(mods) or 'none'}"]
    if params:
        parts.append(f"{'expert parameters' if experts else 'parameters'} {fmt(params)}")
    if routers:
        parts.append(f"router {fmt(router) if router else 'not adapted'} (lora_target_router: {str(recipe.model.lora_target_router).lower()})")
    drops = {float(d.p) for mod in model.modules() if isinstance(mod, LoraLayer) and not isinstance(mod, ParamWrapper)
             for d in mod.lora_dropout.values() if isinstance(d, torch.nn.Dropout)}
    if drops and params:
        parts.append(f"dropout {'/'.join(map(str, sorted(drops)))} on the modules, none on the parameters (peft cannot drop out inside them)")
    decoder = language_model(model.get_base_model() if hasattr(model, "get_base_model") else model)
    if decoder is not None:
        inside = [n for n, mod in model.named_modules() if isinstance(mod, LoraLayer) and mod.r and f"{decoder}." in n]
        outside = sum(isinstance(mod, LoraLayer) and bool(mod.r) for mod in model.modules()) - len(inside)
        parts.append(f"LoRA on the language model: {len(inside)} modules; " + (
            "vision tower and projector frozen" if not outside else
            f"{outside} modules outside it (vision tower, projector) adapted as lora_target_modules lists"))
    parts.append(f"{trainable:,} trainable parameters of {total:,} ({100 * trainable / max(total, 1):.2f}%)")
    return "; ".join(parts)

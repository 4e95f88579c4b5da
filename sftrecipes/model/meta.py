"""The model transformers builds from a config on the meta device (no weights read, any architecture it maps): its
layout as a shape.Shape, and what LoRA adapts in it -- peft applying the LoraConfig lora.lora_config builds for the
run, so the planner's trainable count is the run's.

    shape = meta_shape(config_dict, "org/name", where)    # every parameter, weight by weight, as the model names them
    layout = lora_layout(recipe, shape)                    # per decoder layer: (Weight, rank multiplier); trainable
    config, model = recipe_model(recipe)                   # a recipe's own model (its folder, its remote code if trusted)

The decoder layers are the layer list of the model's text decoder (`get_decoder()`: the largest ModuleList of one of
its `_no_split_modules` classes); everything else (final norm, vision tower, projector) is `Shape.rest`. Experts are
recognised from the module structure (lora.moe_layout), never from a tensor's shape alone.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import json
import logging
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
from transformers.models.auto.modeling_auto import (
    MODEL_FOR_CAUSAL_LM_MAPPING,
    MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
    MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING,
    MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
)

from sftrecipes.core.errors import RecipeError
from sftrecipes.facts import perlayer
from sftrecipes.facts.config import read_config
from sftrecipes.facts.shape import Layer, Shape, Weight
from sftrecipes.facts.startmodel import torch_free_source
from sftrecipes.recipe.typed import Recipe

log = logging.getLogger("sftrecipes")

# config keys naming the experts each token is routed to, in the spellings transformers' configs use
TOP_K_KEYS = ("num_experts_per_tok", "num_experts_per_token", "moe_topk", "top_k", "router_top_k", "moe_k")


def config_of(c: dict, where: str = "the model config"):
    """The transformers config object of a config dict, or a RecipeError naming why there is none."""
    mt = c.get("model_type")
    if mt not in CONFIG_MAPPING:
        raise RecipeError(f"model_name_or_path: {where} is a '{mt}' model, which transformers {transformers.__version__} "
                          "has no config class for (custom code is not loaded); use a model type it knows, or a "
                          "transformers release that has this one")
    try:
        return AutoConfig.for_model(**c)
    except Exception as e:  # noqa: BLE001 - the config class's own validation: one line naming it
        raise RecipeError(f"model_name_or_path: transformers' {mt} config class rejects {where} "
                          f"({type(e).__name__}: {str(e).splitlines()[0][:160]}); fix the config") from None


def auto_class(model_type: str):
    """The auto class that builds a model of this type: AutoModelForCausalLM, or AutoModelForImageTextToText for a
    vision-language model it does not map (Idefics3, Qwen2.5-VL); model/load.py loads with the same."""
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and model_type in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES:
        return AutoModelForImageTextToText
    return AutoModelForCausalLM


def auto_class_of(model_name_or_path: str | Path):
    """auto_class for a model folder or hub id, from the model_type its config.json says (AutoModelForCausalLM where no
    config is at hand: loading then says what is wrong)."""
    try:
        return auto_class(read_config(str(model_name_or_path)).get("model_type"))
    except RecipeError:
        return AutoModelForCausalLM


def model_class(cfg, where: str = "the model config"):
    """The class auto_class builds for a config (what model.load_model loads), or a RecipeError: this project
    fine-tunes causal language models (vision-language ones included) only."""
    for mapping in (MODEL_FOR_CAUSAL_LM_MAPPING, MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING):
        if type(cfg) in mapping:
            return mapping[type(cfg)]
    raise RecipeError(f"model_name_or_path: {where} is a '{cfg.model_type}' model ({type(cfg).__name__}), which has "
                      f"no causal-LM head in transformers {transformers.__version__} (neither AutoModelForCausalLM nor "
                      "AutoModelForImageTextToText maps it: an encoder, speech or vision-only model); fine-tune a "
                      "decoder-only language model")


@contextlib.contextmanager
def on_meta():
    """Build on the meta device with transformers' ZeRO-3 init off: inside a DeepSpeed ZeRO-3 rank, from_config wraps
    a build in deepspeed.zero.Init, which fails on meta tensors (and the layout read here is then lost: an attention
    kernel or a packing check decided blind). The rank's own model is loaded outside this block, partitioned as before."""
    from transformers.integrations import deepspeed as hf_ds

    ref = hf_ds._hf_deepspeed_config_weak_ref
    held = ref() if ref is not None else None
    hf_ds.unset_hf_deepspeed_config()
    try:
        with torch.device("meta"):
            yield
    finally:
        if held is not None:
            hf_ds.set_hf_deepspeed_config(held)


def build(cfg, **kwargs):
    """The model AutoModelForCausalLM builds from a config object on the meta device (on_meta): the one way this
    project builds one (planner, attention choice, packing checks, export layouts)."""
    with on_meta():
        return auto_class(cfg.model_type).from_config(cfg, **kwargs)


@functools.lru_cache(maxsize=4)
def _meta_model(config_json: str, where: str):
    c = json.loads(config_json)
    cfg = config_of(c, where)
    model_class(cfg, where)
    try:
        return build(cfg)
    except Exception as e:  # noqa: BLE001 - any failure to build is the config's: one line naming it
        mt, varies = c.get("model_type"), re.match(r"'(\w+)' is a per-layer attribute", str(e))
        if varies:  # a modeling class that reads the attribute once for every layer (AmbiguousGlobalPerLayerAttributeError)
            raise RecipeError(f"model_name_or_path: {where} gives decoder layers their own '{varies[1]}' "
                              f"(per_layer_config), which transformers' {mt} model reads as one value for all; remove "
                              f"'{varies[1]}' from per_layer_config") from None
        raise RecipeError(f"model_name_or_path: transformers cannot build a '{mt}' model from {where} "
                          f"({type(e).__name__}: {str(e).splitlines()[0][:160]}); fix the config") from None


def meta_model(shape_or_config: Shape | dict, where: str = "the model config"):
    """The model (on the meta device) of a config dict or of a Shape meta_shape made; one per config, cached: callers
    that change it (peft) take a copy."""
    key = shape_or_config.config_json if isinstance(shape_or_config, Shape) else json.dumps(shape_or_config, sort_keys=True, default=str)
    return _meta_model(key, where)


@functools.lru_cache(maxsize=4)
def _recipe_model(name: str, trust_remote_code: bool):
    """(config, the model AutoModelForCausalLM builds from it on the meta device: no memory, no weights read) for a
    model folder or hub id; a hub id offline falls back to the planner's shipped config of it."""
    try:
        cfg = AutoConfig.from_pretrained(name, trust_remote_code=trust_remote_code)
    except (OSError, ValueError):  # a hub id offline: the planner's shipped config of it
        cfg = AutoConfig.for_model(**read_config(name))
    # the class from_pretrained would instantiate (auto mapping, or the model's own code)
    return cfg, build(cfg, trust_remote_code=trust_remote_code, attn_implementation="eager")


def recipe_model(recipe: Recipe):
    """(config, meta-device model) of the recipe's model (cached per process), or None where it cannot be built
    here (remote code not trusted, no config reachable): loading then says what is wrong."""
    try:
        return _recipe_model(torch_free_source(recipe.model.model_name_or_path), bool(recipe.trl_value("trust_remote_code")))
    except Exception as e:  # noqa: BLE001 - any failure here only means "unknown": loading will say what is wrong
        log.warning("model: %s cannot be built on the meta device (%s: %s)", recipe.model.model_name_or_path, type(e).__name__, e)
        return None



def decoder_layers(model) -> tuple[str, torch.nn.ModuleList]:
    """(full name, module list) of the text decoder's layers: under get_decoder(), the ModuleList of one of the model's
    no-split layer classes holding the most parameters (a vision tower's layers are another list); where no list holds
    such a class (ModernBERT-decoder lists none of its own), the largest ModuleList under the decoder."""
    no_split = set(getattr(model, "_no_split_modules", None) or ())
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
    inside = {id(m) for m in decoder.modules()}
    lists = [(name, mod) for name, mod in model.named_modules() if isinstance(mod, torch.nn.ModuleList) and len(mod)]
    if any(id(mod) in inside for _, mod in lists):  # (ModernBERT-decoder's get_decoder() is its output head)
        lists = [(name, mod) for name, mod in lists if id(mod) in inside]
    for strict in (True, False):
        mine = [(name, mod) for name, mod in lists if not (strict and no_split) or type(mod[0]).__name__ in no_split]
        mine = [x for x in mine if any(True for _ in x[1].parameters())]
        if mine:
            return max(mine, key=lambda x: sum(p.numel() for p in x[1].parameters()))
    raise RecipeError(f"model_name_or_path: {type(model).__name__} has no list of decoder layers this project can "
                      "find (a ModuleList of layers with weights); it cannot be planned or sharded")


def _first(cfg, keys, default=0):
    """The first of `keys` the config holds as an int (a key that varies by layer is read per layer: perlayer)."""
    return next((perlayer.get(cfg, k) for k in keys if isinstance(perlayer.get(cfg, k), int)), default)


def _mlp_width(ws: tuple[Weight, ...]) -> int:
    """A dense layer's MLP width as its own weights have it (Gemma-4's MLPs are twice as wide on its KV-sharing layers,
    which no config key says), or 0 where no MLP projection is named as transformers' models name them."""
    for w in ws:
        if w.kind != "linear" or "shared_expert" in w.name or "attn" in w.name or "attention" in w.name:
            continue
        if w.leaf in ("up_proj", "fc1", "w1", "c_fc", "gate_proj", "w3"):
            return w.fan_out
        if w.leaf == "gate_up_proj":  # gate and up fused (Phi-3)
            return w.fan_out // 2
    return 0


def meta_shape(c: dict, name: str, where: str = "the model config") -> Shape:
    """The Shape of the model transformers builds from config dict `c`: every parameter, each decoder layer's weights
    by kind (lora.moe_layout's experts and routers, nn.Linear weights and biases, norms, others)."""
    from sftrecipes.model.lora import moe_layout

    key = json.dumps(c, sort_keys=True, default=str)
    model = _meta_model(key, where)
    text = model.config.get_text_config()
    prefix, layers = decoder_layers(model)
    experts, routers = moe_layout(model)
    modules = dict(model.named_modules())
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    tied = head is None or head.weight is embed.weight
    expert_modules = {e.rpartition(".")[0] for e in experts}

    def kind(full: str, p) -> str:
        owner_name, _, leaf = full.rpartition(".")
        owner = modules[owner_name]
        if full in experts:
            return "experts"
        if owner_name in routers:
            return "router" if leaf == "weight" else "bias"
        if isinstance(owner, torch.nn.Linear):
            return "linear" if leaf == "weight" else "bias"
        if owner_name in expert_modules:
            return "bias"  # an expert tensor's bias ([E, out]) beside it
        if "norm" in type(owner).__name__.lower() and p.dim() == 1:
            return "norm"
        return "other"

    def weight(full: str, rel: str, p) -> Weight:
        k = kind(full, p)
        return Weight(rel if k in ("experts", "bias", "other") else rel.rpartition(".")[0], k, tuple(p.shape))

    decoder = []
    hidden = embed.weight.shape[1]
    for i, layer in enumerate(layers):
        base = f"{prefix}.{i}."
        ws = tuple(weight(base + n, n, p) for n, p in layer.named_parameters())
        e = max((w.dims[0] for w in ws if w.kind == "experts"), default=0)
        shared = next((w.fan_out for w in ws if w.kind == "linear" and "shared_expert" in w.name
                       and w.leaf in ("up_proj", "gate_proj", "gate_up_proj", "w1", "fc1")), 0)
        own = perlayer.layer_config(text, i)  # the layer's own sizes, as its modules were built from them
        heads = _first(own, ("num_attention_heads", "n_head", "num_heads"), 1)
        kv = _first(own, ("num_key_value_heads", "num_kv_heads", "multi_query_group_num"), heads)
        head_dim = _first(own, ("head_dim", "qk_head_dim"), hidden // max(heads, 1)) or hidden // max(heads, 1)
        width = 0 if e else _mlp_width(ws) or _first(own, ("intermediate_size", "ffn_hidden_size", "n_inner"), 0)
        top_k = min(_first(own, TOP_K_KEYS) or 1, e) if e else 0
        decoder.append(Layer(ws, e, top_k, shared, heads, kv, head_dim, width))
    in_layers = {f"{prefix}.{n}" for n, _ in layers.named_parameters()}
    skip = in_layers | {n for n, p in model.named_parameters() if p is embed.weight or (head is not None and p is head.weight)}
    rest = tuple(Weight(n if kind(n, p) in ("bias", "other", "experts") else n.rpartition(".")[0], kind(n, p), tuple(p.shape))
                 for n, p in model.named_parameters() if n not in skip)
    sparse = [L for L in decoder if L.experts]
    e_inter = 0
    if sparse:
        down = next((w for w in sparse[0].weights if w.kind == "experts" and "down" in w.leaf), None)
        e_inter = (down.numel // down.dims[0] // hidden) if down is not None else _first(text, ("moe_intermediate_size",), 0)
    cls = type(model)
    return Shape(name, c.get("model_type"), hidden, embed.weight.shape[0], tied,
                 _first(text, ("max_position_embeddings", "n_positions", "seq_length"), 0), tuple(decoder),
                 max((L.experts for L in sparse), default=0), max((L.top_k for L in sparse), default=0), e_inter,
                 max((L.shared_intermediate for L in sparse), default=0), rest=rest,
                 supports_sdpa=bool(cls._supports_sdpa), unpacked=unpacked_reason(cls),
                 checkpoints=bool(cls.supports_gradient_checkpointing), reruns=reruns(model), source="meta", config_json=key,
                 head_vocab=0 if tied or head.weight.shape[0] == embed.weight.shape[0] else head.weight.shape[0])


# ----------------------------------------------------------------------------------------------- LoRA


@dataclass(frozen=True)
class LoraLayout:
    """What LoRA adapts: per decoder layer, (the adapted Weight, its rank / lora_r) pairs; the trainable parameters
    peft creates in all (the run's count); and those outside the decoder layers, by top-level module."""

    adapted: tuple[tuple[tuple[Weight, int], ...], ...]
    trainable: int
    outside: tuple[tuple[str, int], ...] = ()


_layouts: dict = {}


def lora_layout(recipe: Recipe, shape: Shape) -> LoraLayout:
    """LoRA as the run applies it: lora.lora_config(recipe, model) on a copy of the meta model, injected by peft (its
    adapters on the meta device too), then read back module by module."""
    from peft import get_peft_model
    from peft.tuners.lora import LoraLayer, ParamWrapper

    from sftrecipes.model import compat
    from sftrecipes.model.lora import _clean, lora_config

    m = recipe.model
    key = (shape.config_json, m.lora_target_modules, m.lora_r, m.lora_alpha, m.lora_target_router,
           json.dumps(recipe.peft, sort_keys=True, default=str), m.lora_dropout)
    if key in _layouts:
        return _layouts[key]
    compat.keep_dense_linears_in_moe_conversion()
    model = copy.deepcopy(meta_model(shape))
    config = lora_config(recipe, [], model)
    if config.target_parameters:  # the run refuses dropout there (validation, one line); the count is the same without
        config.lora_dropout = 0.0
    with torch.device("meta"):
        peft_model = get_peft_model(model, config, low_cpu_mem_usage=True)
    prefix, _ = decoder_layers(model)
    by_layer: list[list[tuple[Weight, int]]] = [[] for _ in shape.decoder]
    for name, module in peft_model.named_modules():
        if not isinstance(module, LoraLayer) or not module.r:
            continue
        clean = _clean(name)
        rank = max(module.r.values())
        if isinstance(module, ParamWrapper):
            clean = f"{clean}.{module.parameter_name}"
        if not clean.startswith(prefix + "."):
            continue
        idx, _, rel = clean.removeprefix(prefix + ".").partition(".")
        layer = shape.decoder[int(idx)]
        w = next((w for w in layer.weights if w.name == rel and w.kind in ("linear", "experts", "router", "other")), None)
        if w is None:
            w = next((w for w in layer.weights if w.param_name == rel), None)
        if w is not None and (w, rank / m.lora_r) not in by_layer[int(idx)]:
            by_layer[int(idx)].append((w, rank / m.lora_r))
    trainable = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
    outside: dict[str, int] = {}
    for n, p in peft_model.named_parameters():
        clean = _clean(n)
        if p.requires_grad and not clean.startswith(prefix + "."):
            top = ".".join(clean.split(".")[:2])
            outside[top] = outside.get(top, 0) + p.numel()
    layout = LoraLayout(tuple(tuple(x) for x in by_layer), trainable, tuple(sorted(outside.items())))
    _layouts[key] = layout
    return layout


# ----------------------------------------------------------------------------------------------- packed batches


def packed_batch_blockers(cls: type) -> list[tuple[str, str]]:
    """(function, package) of the model's kernels that run their PyTorch fallback here, which cannot keep packed
    sequences apart: transformers' hub-kernel wrapper (integrations/hub_kernels.py) raises on `cu_seqlens` / `seq_idx`
    when the package (causal-conv1d, flash-linear-attention, mamba-ssm) is not installed. Read from the model's own
    modeling module: the wrapped functions and whether each found its package."""
    module = sys.modules[cls.__module__]
    out = []
    for name, fn in vars(module).items():
        if not callable(fn) or getattr(fn, "__wrapped__", None) is None or not getattr(fn, "__closure__", None):
            continue
        seen = inspect.getclosurevars(fn).nonlocals
        if seen.get("is_new_implementation") is False and "package" in seen:
            out.append((name, str(seen["package"])))
    return out


def unpacked_reason(cls: type) -> str:
    """Why packed (padding-free) batches cannot reach this model class here, in words, or "": a kernel of the
    model's that cannot keep packed samples apart without its package (packed_batch_blockers)."""
    blockers = packed_batch_blockers(cls)
    if not blockers:
        return ""
    fn, package = blockers[0]
    return (f"{cls.__name__}'s {fn} cannot keep packed samples apart without the {package} package (transformers "
            "falls back to a PyTorch path that refuses packed batches)")


def packing_blocker(recipe: Recipe, cls: type) -> str | None:
    """unpacked_reason where the recipe packs (packing or padding_free), else None."""
    if not (recipe.trl_value("packing") or recipe.trl_value("padding_free")):
        return None
    return unpacked_reason(cls) or None


@functools.cache
def _loop_calls(cls: type) -> tuple[str, ...]:
    """The attributes `cls.forward` calls as self.<name>(...) inside a `for ... in range(...)` loop of a size the
    module fixes (its config's cycle counts, constants), read from the class's own source (empty where there is none
    to read)."""
    import ast
    import textwrap

    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls.forward)))
    except (OSError, TypeError, SyntaxError):
        return ()
    def fixed(node) -> bool:  # a constant, self.<...> (the config's cycle counts), or arithmetic of those
        if isinstance(node, ast.Constant):
            return True
        if isinstance(node, ast.BinOp):
            return fixed(node.left) and fixed(node.right)
        while isinstance(node, ast.Attribute):
            node = node.value
        return isinstance(node, ast.Name) and node.id == "self"

    names: list[str] = []
    for loop in ast.walk(tree):
        it = loop.iter if isinstance(loop, ast.For) else None
        if not (isinstance(it, ast.Call) and isinstance(it.func, ast.Name) and it.func.id == "range" and it.args
                and all(fixed(a) for a in it.args)):
            continue  # (a loop the data sizes calls its submodules as ZeRO-3 leaves: wrapping.zero3_leaves)
        for node in (n for stmt in loop.body for n in ast.walk(stmt)):
            f = node.func if isinstance(node, ast.Call) else None
            if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == "self" and f.attr not in names:
                names.append(f.attr)
    return tuple(names)


def reruns(model) -> str:
    """Where the model runs one of its own submodules (with parameters, not a list of layers) several times in a
    forward -- HRM's H and L stacks, looped over config-sized cycles -- in words, or "". Read from each module class's
    forward source and the module tree (the meta model's or the loaded one's)."""
    found = []
    for module in model.modules():
        called = [a for a in _loop_calls(type(module)) if isinstance(getattr(module, a, None), torch.nn.Module)
                  and not isinstance(getattr(module, a), (torch.nn.ModuleList, torch.nn.ModuleDict))
                  and any(True for _ in getattr(module, a).parameters())]
        if called:
            found.append(f"{type(module).__name__} runs its {' and '.join(called)} several times a forward")
    return "; ".join(dict.fromkeys(found))

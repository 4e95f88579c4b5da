"""Model: loading the model a recipe describes (load dtype, quantization, attention kernel, RAM-efficient ranks).

The same functions load the tiny test model and meta-llama/Llama-2-70b-hf; before loading, folders.check_model_files
names a missing tokenizer file or a cut safetensors file. The tokenizer is tokenizer.py's, LoRA lora.py's.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from transformers import AutoConfig, AutoModelForCausalLM, BitsAndBytesConfig
from transformers.integrations import is_deepspeed_zero3_enabled

from sftrecipes.model import meta
from sftrecipes.facts import perlayer
from sftrecipes.model.attention import register
from sftrecipes.train.args import PARTITIONED, RANK0_READS, weight_reading
from sftrecipes.core.errors import RecipeError
from sftrecipes.model.heap import own_checkpoint_views, steady_heap
from sftrecipes.model.quantload import partition_4bit_layers, receive_4bit_layers, send_4bit_layers
from sftrecipes.recipe.load import Recipe
from sftrecipes.recipe.schema import DTYPES as DTYPE_NAMES
from sftrecipes.facts.shape import load_dtype as load_dtype_name
from sftrecipes.facts.shape import read_config
from sftrecipes.facts.startmodel import torch_free_source, weights_dir
from sftrecipes.data.tokenizer import set_generation_stop

log = logging.getLogger("sftrecipes")

DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}  # the one name -> torch dtype map (export uses it too)


def load_dtype(recipe: Recipe) -> torch.dtype:
    """The dtype weights are loaded in: the rule of shape.load_dtype (the planner counts with the same), as torch."""
    return DTYPES[load_dtype_name(recipe)]


# Packed rows under sdpa on a GPU: transformers builds a dense block-diagonal mask and torch's sdpa picks cuDNN
# attention, which compiles a graph per new sequence length; padding-free packing changes the length every step.
# Padding the flattened batch to a multiple of this bounds the number of shapes (docs/benchmarks.md, GPU: +44%
# tokens/s on a 1B full fine-tune on an H200, at most 255 padded tokens per step).
SDPA_PACKED_PAD = 256
VARLEN = "sft_varlen"  # attention.NAME: the project's varlen kernel (attention.py registers it when a model loads)


def flash_attn_installed() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


def _flash_missing(recipe: Recipe, hardware: str) -> list[str]:
    missing = []
    if not flash_attn_installed():
        missing.append("the flash-attn package (pip install -r requirements-gpu.txt)")
    if hardware != "gpu":
        missing.append("a GPU")
    return missing


def requested_attention(recipe: Recipe) -> str:
    """The recipe's attention request: attn_implementation, with the PEFT guide's use_flash_attn as an alias of
    flash_attention_2 (recipe validation refuses the two disagreeing)."""
    m = recipe.model
    return "flash_attention_2" if _flash_alias(recipe) else m.attn_implementation


def _flash_alias(recipe: Recipe) -> bool:
    """flash_attention_2 is asked for by use_flash_attn (the guide's switch), not by attn_implementation."""
    return recipe.model.use_flash_attn and recipe.model.attn_implementation == "auto"


@functools.lru_cache(maxsize=4)
def _meta_model(name: str, trust_remote_code: bool):
    """(config, the model AutoModelForCausalLM builds from it on the meta device: no memory, no weights read) for a
    model folder or hub id; a hub id offline falls back to the planner's shipped config of it."""
    try:
        cfg = AutoConfig.from_pretrained(name, trust_remote_code=trust_remote_code)
    except (OSError, ValueError):  # a hub id offline: the planner's shipped config of it
        cfg = AutoConfig.for_model(**read_config(name))
    # the class from_pretrained would instantiate (auto mapping, or the model's own code)
    return cfg, meta.build(cfg, trust_remote_code=trust_remote_code, attn_implementation="eager")


def meta_model(recipe: Recipe):
    """(config, meta-device model) of the recipe's model (cached per process), or None where it cannot be built
    here (remote code not trusted, no config reachable): loading then says what is wrong."""
    try:
        return _meta_model(torch_free_source(recipe.model.model_name_or_path), bool(recipe.trl_value("trust_remote_code")))
    except Exception as e:  # noqa: BLE001 - any failure here only means "unknown": loading will say what is wrong
        log.warning("model: %s cannot be built on the meta device (%s: %s)", recipe.model.model_name_or_path, type(e).__name__, e)
        return None


KERNELS = ("sdpa", "eager", "flash_attention_2", "flex_attention", VARLEN)


@dataclass(frozen=True)
class AttentionSupport:
    """What the model class the loader instantiates can attend with: its own flags (_supports_sdpa,
    _supports_flash_attn, _compatible_flash_implementations, _supports_flex_attn, _supports_attention_backend) and
    the traits of its attention that a kernel must implement, read from the config and the meta-device model."""

    cls: str  # the class name, e.g. Gemma3ForConditionalGeneration
    why_not: dict[str, str]  # kernel -> why this model cannot run it; a kernel not listed runs
    traits: tuple[str, ...] = ()  # "attention sinks", "logit soft-capping", "a sparse-attention indexer", "sliding windows"

    def runs(self, impl: str) -> bool:
        return impl not in self.why_not


def attention_traits(cfg, model) -> tuple[str, ...]:
    """What the model's attention does beyond causal softmax attention: learned sinks (GPT-OSS: a `sinks` parameter
    per attention layer, passed to the kernel as s_aux), logit soft-capping (Gemma-2: attn_logit_softcapping), a
    sparse-attention indexer scoring keys from the dense mask (DeepSeek-V3.2: an *Indexer module), sliding windows
    (layer_types, or sliding_window where the config uses it); each read from every layer's config (perlayer.py)."""
    text = cfg.get_text_config()
    traits = []
    if any(n.rsplit(".", 1)[-1] == "sinks" for n, _ in model.named_parameters()):
        traits.append("attention sinks")
    if any(v is not None for v in perlayer.values(text, "attn_logit_softcapping")):
        traits.append("logit soft-capping")
    if any(type(m).__name__.endswith("Indexer") for m in model.modules()):  # DeepSeek-V3.2's DSA, AXK2, Qwen4-Exp
        traits.append("a sparse-attention indexer")
    layer_types = perlayer.get(text, "layer_types") or ()
    if "sliding_attention" in layer_types or (not layer_types and any(perlayer.values(text, "sliding_window"))
                                              and all(perlayer.values(text, "use_sliding_window", True))):
        traits.append("sliding windows")
    return tuple(traits)


def support_of(cls: type, traits: tuple[str, ...]) -> AttentionSupport:
    """The kernels a model class with these attention traits cannot run, each with the reason. sft_varlen
    (attention.py) implements causal attention with GQA, scaling, dropout and sliding windows, not sinks or
    soft-capping; the flash-attn package's kernel has no sinks either (a model that needs another flash kernel lists it
    in _compatible_flash_implementations, GPT-OSS does, and transformers swaps it in from the hub)."""
    name = cls.__name__
    why: dict[str, str] = {}
    if not cls._supports_sdpa:
        why["sdpa"] = f"{name} does not support sdpa (_supports_sdpa False)"
    compatible = getattr(cls, "_compatible_flash_implementations", None)
    if not cls._supports_flash_attn:
        why["flash_attention_2"] = f"{name} does not support flash_attention_2 (_supports_flash_attn False)"
    elif compatible and "flash_attention_2" not in compatible:
        why["flash_attention_2"] = (f"{name} runs flash attention only through {', '.join(compatible)} "
                                    "(_compatible_flash_implementations), not the flash-attn package")
    elif "attention sinks" in traits:  # transformers passes s_aux only to a kernel that takes it: FA2 would drop them
        why["flash_attention_2"] = f"the flash-attn package's kernel cannot apply {name}'s attention sinks"
    elif "a sparse-attention indexer" in traits:
        why["flash_attention_2"] = f"flash_attention_2 gives {name} no dense mask, which its sparse-attention indexer reads"
    if not cls._supports_flex_attn:
        why["flex_attention"] = f"{name} does not support flex_attention (_supports_flex_attn False)"
    if not cls._supports_attention_backend:
        why[VARLEN] = f"{name} does not attend through transformers' attention interface (_supports_attention_backend False)"
    elif "attention sinks" in traits:
        why[VARLEN] = f"{VARLEN} cannot apply {name}'s attention sinks (its sinks parameters)"
    elif "logit soft-capping" in traits:
        why[VARLEN] = f"{VARLEN} cannot apply {name}'s attention logit soft-capping (attn_logit_softcapping)"
    elif "a sparse-attention indexer" in traits:
        why[VARLEN] = f"{VARLEN} gives {name} no dense mask, which its sparse-attention indexer reads (attention_mask[:, 0])"
    return AttentionSupport(name, why, traits)


def attention_support(recipe: Recipe) -> AttentionSupport | None:
    """What the recipe's model can attend with, from the class AutoModelForCausalLM instantiates for its config
    (built on the meta device, without weights); None when it cannot be built here (remote code not trusted, no
    config reachable): transformers then decides at load time."""
    built = meta_model(recipe)
    if built is None:
        return None
    cfg, model = built
    return support_of(type(model), attention_traits(cfg, model))


def _sixteen_bit(recipe: Recipe) -> bool:
    return load_dtype(recipe) != torch.float32 or bool(recipe.trl_value("bf16") or recipe.trl_value("fp16"))


def packing_fallback(recipe: Recipe) -> str | None:
    """Packed batches where the model's kernels cannot keep samples apart on this machine (meta.packing_blocker reads
    the model class's own modeling module): the run pads its rows instead, as use_flash_attn falls back where the
    kernel is missing. Turns packing and padding_free off in the recipe, before the training arguments and the data
    are built from it, on every rank alike; returns the warning line, or None where the batches stay packed."""
    built = meta_model(recipe) if packed(recipe) else None
    why = meta.packing_blocker(recipe, type(built[1])) if built is not None else None
    if why is None:
        return None
    keys = [k for k in ("packing", "padding_free") if recipe.trl_value(k)]
    for k in keys:
        recipe.trl[k] = False
    return (f"WARNING {' and '.join(keys)}: off for this run, rows are padded instead: {why}; install the package "
            f"(GPU) to pack, or set {' and '.join(f'{k}: false' for k in keys)} to silence this")


def checkpointing_fallback(recipe: Recipe) -> str | None:
    """Activation checkpointing asked for where the run cannot have it (shape.checkpointing_off): a model class that
    does not support it (GPT-1, CTRL, XLNet, JetMoE: supports_gradient_checkpointing False; the trainer would raise
    after loading), or a submodule run several times a forward under ZeRO-3 (HRM; DeepSpeed's first backward would
    fail). The run goes without, as packing falls back, on every rank alike; the plan counts it so. Returns the
    warning line, or None."""
    from types import SimpleNamespace

    from sftrecipes.facts.shape import checkpointing_off

    built = meta_model(recipe) if recipe.gradient_checkpointing else None
    if built is None:
        return None
    cfg, model = built
    why = checkpointing_off(recipe, SimpleNamespace(model_type=cfg.model_type, reruns=meta.reruns(model),
                                                    checkpoints=bool(model.supports_gradient_checkpointing)))
    if not why:
        return None
    recipe.trl["gradient_checkpointing"] = False  # (TRL's default is on)
    if "activation_checkpointing" in recipe.trl:
        recipe.trl["activation_checkpointing"] = False
    return (f"WARNING gradient_checkpointing: off for this run: {why} (every layer's activations are kept); set "
            "gradient_checkpointing: false to silence this")


def packed(recipe: Recipe) -> bool:
    """Whether batches reach the model as packed rows (TRL's padding-free packing)."""
    return bool(recipe.trl_value("packing") or recipe.trl_value("padding_free"))


def choose_attention(recipe: Recipe, hardware: str, support: AttentionSupport | None = None) -> tuple[str, str]:
    """(attention kernel, why) for this recipe on this hardware, from what the model class supports
    (attention_support); RecipeError for an explicit choice the model or device cannot run.

    auto: flash_attention_2 where the flash-attn package, a GPU, 16-bit compute and the model allow it; else, for
    packed batches, sft_varlen (attention.py: each sample attends within itself, no dense mask) where the model's
    attention has nothing sft_varlen lacks (sinks: GPT-OSS; soft-capping: Gemma-2); else sdpa where the class supports
    it; else eager. An explicit kernel the model cannot run is refused (one line naming the key and the kernels it
    can run); use_flash_attn (the guide's switch) instead falls back to the auto choice on any model, as does an
    explicit flash_attention_2 without the flash-attn package or a GPU (the caller warns)."""
    want = requested_attention(recipe)
    sup = support or attention_support(recipe)
    key = "use_flash_attn" if _flash_alias(recipe) else "attn_implementation"

    def ok(impl: str) -> bool:
        return sup is None or sup.runs(impl)

    def auto() -> tuple[str, str]:
        if ok("flash_attention_2") and sup is not None and not _flash_missing(recipe, hardware) and _sixteen_bit(recipe):
            return "flash_attention_2", "auto: flash-attn, a GPU and 16-bit compute are present"
        if packed(recipe) and ok(VARLEN):
            return VARLEN, "auto: packed batches attend per sample; flash_attention_2 does not run here"
        if ok("sdpa"):
            return "sdpa", "auto"
        not_here = [sup.why_not[k] for k in (VARLEN, "sdpa") if k in sup.why_not and (k == "sdpa" or packed(recipe))]
        return "eager", "auto: " + "; ".join(not_here)

    if want == "auto":
        return auto()
    if not ok(want):
        if key == "use_flash_attn":  # the guide's switch: the auto choice on a model without flash attention too
            impl, _ = auto()
            return impl, f"fallback: {sup.why_not[want]}"
        runs = [k for k in KERNELS if ok(k) and k != want and not (k == "flex_attention" and hardware == "cpu")]
        raise RecipeError(f"attn_implementation: {sup.why_not[want]}; use attn_implementation: auto (or {_one_of(runs)})")
    if want == "flash_attention_2":
        missing = _flash_missing(recipe, hardware)
        if missing:
            impl, _ = auto()
            return impl, "fallback: flash_attention_2 needs " + " and ".join(missing)
        if not _sixteen_bit(recipe):
            raise RecipeError(f"{key}: flash_attention_2 computes in bf16/fp16 only; set bf16: true (or use sdpa)")
    if want == "flex_attention" and hardware == "cpu":
        runs = [k for k in KERNELS if ok(k) and k != want]
        raise RecipeError(f"attn_implementation: flex_attention has no backward pass on CPU (torch {torch.__version__}); use auto or {_one_of(runs)}")
    return want, "recipe"


def _one_of(names: list[str]) -> str:
    return names[0] if len(names) == 1 else "one of " + ", ".join(names)


def packed_under_sdpa_on_gpu(recipe: Recipe, hardware: str) -> bool:
    """True when a GPU run packs samples (padding-free) and attends with sdpa (flash-attn not asked for or missing)."""
    return hardware == "gpu" and packed(recipe) and choose_attention(recipe, hardware)[0] == "sdpa"


def attn_implementation(recipe: Recipe, hardware: str) -> str:
    """choose_attention, logged (with the warnings a fallback deserves)."""
    impl, why = choose_attention(recipe, hardware)
    log_attention(recipe, hardware, impl, why)
    return impl


def log_attention(recipe: Recipe, hardware: str, ran: str, why: str) -> None:
    """The run's "attention: ..." line: the kernel that runs (load_model passes the loaded model's own
    config._attn_implementation) and why; a fallback is one warning line naming what was asked and why not."""
    if why.startswith("fallback"):
        key = "use_flash_attn" if recipe.model.use_flash_attn else "attn_implementation"
        log.warning("attention: %s (%s: falling back to %s: %s)", ran, key, ran, why.removeprefix("fallback: "))
    else:
        log.info("attention: %s (%s)", ran, why)
    if ran == "sdpa" and packed_under_sdpa_on_gpu(recipe, hardware):
        log.warning("attention: packing under sdpa attends through a dense block-diagonal mask; measured 2-3x slower per "
                    "token than a plain causal step on an H200 (docs/benchmarks.md, GPU); attn_implementation: %s "
                    "attends per sample", VARLEN)


FSDP_WRAP_ENV = "FSDP_TRANSFORMER_CLS_TO_WRAP"  # what accelerate's FSDP plugin reads (the launcher exports it from the config)
_wrap_set_here: dict[str, str] = {}  # the value this process exported (not a launcher's: a later run here may change it)


def fsdp_layer_classes(model) -> list[str]:
    """The layer classes the model says to keep whole (the union of `_no_split_modules` over every PreTrainedModel
    class in it: a multimodal model's text and vision towers each declare theirs), those present in it, in order of
    appearance. A class declared but absent (SigLIP's pooling head, which Gemma-3's vision tower leaves out) would
    stop accelerate's wrapping ("Could not find the transformer layer class")."""
    from transformers import PreTrainedModel

    declared: set[str] = set()
    for m in model.modules():
        if isinstance(m, PreTrainedModel):
            declared.update(type(m)._no_split_modules or ())
    return list(dict.fromkeys(type(m).__name__ for m in model.modules() if type(m).__name__ in declared))


def fsdp_wrap_classes(recipe: Recipe) -> list[str] | None:
    """The layer classes FSDP wraps as units (accelerate's TRANSFORMER_BASED_WRAP): launch.fsdp_transformer_layer_
    cls_to_wrap where the recipe names them (each must be a module class of the model), else the model's own
    (fsdp_layer_classes of the model built on the meta device). Set where accelerate's plugin reads them
    (FSDP_TRANSFORMER_CLS_TO_WRAP) before the trainer builds it, on every rank alike; a model that declares none wraps
    the classes of its decoder layers (meta.decoder_layers). RecipeError (one line) for a named class the model lacks,
    a model without decoder layers to find, or a launcher config naming other classes. None (and
    accelerate's own default) where the model cannot be built here."""
    built = meta_model(recipe)
    named = recipe.launch.wrap_classes
    key = "launch.fsdp_transformer_layer_cls_to_wrap"
    if built is None:
        log.warning("fsdp: %s cannot be built on the meta device here; accelerate wraps the loaded model's "
                    "_no_split_modules", recipe.model.model_name_or_path)
        return None
    model = built[1]
    own = fsdp_layer_classes(model)
    present = sorted({type(m).__name__ for m in model.modules()})
    if named:
        missing = [c for c in named if c not in present]
        if missing:
            raise RecipeError(f"{key}: {', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not a module class of "
                              f"{type(model).__name__} (its classes: {', '.join(present)}); name classes it has, or remove the "
                              f"key to wrap the model's own ({', '.join(own) or 'none declared'})")
        classes, why = list(named), key
    elif own:
        classes, why = own, f"{type(model).__name__}'s _no_split_modules present in it"
    else:  # the model names none (GPT-1, CTRL, XLNet, ...): its decoder layers, read from the structure
        try:
            prefix, layers = meta.decoder_layers(model)
        except RecipeError:
            raise RecipeError(f"{key}: {type(model).__name__} declares no layer classes to keep whole (_no_split_modules) and "
                              f"has no list of decoder layers; name its layer class (its classes: {', '.join(present)})") from None
        classes = sorted({type(m).__name__ for m in layers})
        why = (f"{type(model).__name__} declares no _no_split_modules: the classes of its decoder layers, {prefix}; "
               f"{key} names others")
    exported = os.environ.get(FSDP_WRAP_ENV)
    if exported is not None and exported != _wrap_set_here.get(FSDP_WRAP_ENV) and set(exported.split(",")) != set(classes):
        raise RecipeError(f"{key}: the recipe wraps {', '.join(classes)} but the launcher's accelerate config says {exported} "
                          f"({FSDP_WRAP_ENV}); start it with python -m sftrecipes launch RECIPE, which renders the "
                          "launcher's config from the recipe (or name the classes in the recipe)")
    os.environ[FSDP_WRAP_ENV] = _wrap_set_here[FSDP_WRAP_ENV] = ",".join(classes)
    log.info("fsdp: wrapping %s (%s)", ", ".join(classes), why)
    return classes


def quantization_config(recipe: Recipe):
    m = recipe.model
    if not (m.use_4bit_quantization or m.use_8bit_quantization):
        return None
    if m.use_8bit_quantization:
        return BitsAndBytesConfig(load_in_8bit=True)
    storage = torch.uint8 if m.bnb_4bit_quant_storage_dtype == "uint8" else DTYPES[m.bnb_4bit_quant_storage_dtype]
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=m.bnb_4bit_quant_type,
        bnb_4bit_compute_dtype=DTYPES[m.bnb_4bit_compute_dtype],
        bnb_4bit_use_double_quant=m.use_nested_quant,
        bnb_4bit_quant_storage=storage,
    )


def no_aux_loss_without_experts(model, args) -> None:
    """A config that declares output_router_logits for a model with no experts (Doge with is_moe: false: no fused
    expert tensors, no module named for experts or MoE): TRL 1.16 turns its load-balancing loss on from the config
    alone and fails in the first step over no router logits. Unless the recipe sets router_aux_loss_coef, it is 0 for
    such a model (logged)."""
    from sftrecipes.model.lora import moe_layout

    text = model.config.get_text_config()
    moe_named = any(w in type(m).__name__.lower() for m in model.modules() for w in ("moe", "expert"))  # per-expert lists too
    if (getattr(args, "router_aux_loss_coef", 0) is None and hasattr(text, "output_router_logits") and not moe_named
            and moe_layout(model) == ({}, {})):
        args.router_aux_loss_coef = 0.0
        log.info("model: %s holds no experts: no load-balancing loss (router_aux_loss_coef 0)", type(model).__name__)


def _static_iter(node) -> bool:
    """Whether a for loop's iterable is fixed by the module and its config (self.layers, range(self.n), enumerate of
    those, constants), not by the data (a tensor's rows, a local length)."""
    import ast

    if isinstance(node, ast.Constant):
        return True
    if isinstance(node, (ast.Tuple, ast.List)):
        return all(_static_iter(e) for e in node.elts)
    if isinstance(node, ast.Attribute):
        while isinstance(node, ast.Attribute):
            node = node.value
        return isinstance(node, ast.Name) and node.id == "self"
    if isinstance(node, ast.Subscript):
        return _static_iter(node.value) and _static_iter(node.slice)
    if isinstance(node, ast.Slice):
        return all(x is None or _static_iter(x) for x in (node.lower, node.upper, node.step))
    if isinstance(node, ast.BinOp):
        return _static_iter(node.left) and _static_iter(node.right)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("range", "enumerate", "zip", "reversed", "len"):
        return all(_static_iter(a) for a in node.args)
    return False


@functools.cache
def calls_children_by_data(cls: type, children: frozenset[str]) -> str | None:
    """The first child module `cls.forward` calls inside a loop the data decides (a `while`, or a `for` over anything
    but the module's own lists and config-sized ranges: the rows of a routing mask, a batch's length), or None. Read
    from the class's own source; None where there is none to read."""
    import ast
    import inspect
    import textwrap

    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls.forward)))
    except (OSError, TypeError, SyntaxError):
        return None
    for loop in ast.walk(tree):
        if isinstance(loop, ast.For) and _static_iter(loop.iter) or not isinstance(loop, (ast.For, ast.While)):
            continue
        for node in (n for stmt in loop.body for n in ast.walk(stmt)):
            func = node.func if isinstance(node, ast.Call) else None
            while isinstance(func, ast.Subscript):  # self.layers[i](...)
                func = func.value
            if (isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "self"
                    and func.attr in children):
                return func.attr
    return None


def zero3_leaves(model, recipe: Recipe, main: bool = True) -> list[str]:
    """ZeRO-3 fetches each module's parameters as the module runs, a collective every rank must enter in the same
    order, and requires the order traced in the first step alike on every rank. A module that calls its submodules as
    many times as its data says -- an experts module looping over the experts its tokens chose (LongCat-Flash's
    identity expert), Qwen4-exp's sparse-attention indexer looping over each query -- runs a different sequence on
    each rank ("disagreement on list length", or gloo's "collective mismatch"). Such modules become ZeRO-3 leaves
    (deepspeed's set_z3_leaf_module: parameters fetched together, submodules not traced), as DeepSpeed advises for
    mixture-of-experts blocks: every experts module with submodules, and every module whose forward calls a submodule
    in a data-decided loop (calls_children_by_data), never the decoder-layer list or a module holding it. Before the
    engine is built; the classes marked, logged by the main process."""
    from deepspeed.utils import set_z3_leaf_module

    from sftrecipes.model.lora import moe_layout

    L = recipe.launch
    if L.backend != "deepspeed" or L.zero_stage != 3:
        return []
    prefix, _ = meta.decoder_layers(model)
    holds_layers = {prefix.rsplit(".", k)[0] for k in range(prefix.count(".") + 1)} | {prefix, ""}
    experts = {n.rpartition(".")[0] for n in moe_layout(model)[0]}
    marked: dict[str, str] = {}
    for name, module in model.named_modules():
        children = frozenset(n for n, _ in module.named_children())
        if not children or name in holds_layers or any(name.startswith(m + ".") for m in marked):
            continue
        why = "its experts run by the routing" if name in experts else None
        called = calls_children_by_data(type(module), children) if why is None else None
        if called:
            why = f"calls {called} in a loop its data decides"
        if why:
            set_z3_leaf_module(module, True)
            marked[name] = f"{type(module).__name__} ({why})"
    if marked and main:
        kinds = sorted(set(marked.values()))
        log.info("ZeRO-3: %d module(s) fetched whole, as leaves (every rank must run the same modules in the same "
                 "order): %s", len(marked), "; ".join(kinds))
    return sorted({v.split(" (")[0] for v in marked.values()})


def load_model(recipe: Recipe, tokenizer, hardware: str, every_rank_reads: bool = False):
    """The model as the recipe describes it (weights from the hub id or local folder). every_rank_reads: no rank
    loads on the meta device, RAM-efficient loading or not (a model nothing broadcasts into: methods.py's reference)."""
    m = recipe.model
    kwargs = dict(recipe.trl_value("model_init_kwargs") or {})  # recipe validation took out what the recipe owns
    impl, why = choose_attention(recipe, hardware)
    if impl == VARLEN:
        register()
    kwargs.update(
        dtype=load_dtype(recipe),
        attn_implementation=impl,
        trust_remote_code=bool(recipe.trl_value("trust_remote_code")),
    )
    qc = quantization_config(recipe)
    if qc is not None:
        kwargs["quantization_config"] = qc
    rank = None if every_rank_reads else ram_efficient_rank(recipe, quantized=qc is not None)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1 and dist.get_rank() == 0:
        log.info("loading the weights: %s", weight_reading(recipe, quantized=qc is not None)[1])  # as the plan says
    if rank:  # not rank 0: build on the meta device, read nothing; FSDP receives rank 0's weights when it wraps
        kwargs["device_map"] = "meta"
    # 4-bit under ZeRO-3 with zero3_init: each decoder layer partitioned as soon as it is quantized (quantload.py)
    partition = qc is not None and is_deepspeed_zero3_enabled() and weight_reading(recipe, quantized=True)[0] == PARTITIONED
    # 4-bit under FSDP2, RAM-efficient: rank 0 sends each layer once quantized, every rank keeps its FSDP2 rows
    rows = (dist.get_rank(), dist.get_world_size()) if qc is not None and rank is not None else None
    # steady_heap: what a rank holds after loading is the model, not the order its temporaries were freed in
    with steady_heap(), partition_4bit_layers(partition) as zero3, send_4bit_layers(rank == 0 and rows is not None, rows) as sent:
        model = AutoModelForCausalLM.from_pretrained(weights_dir(m.model_name_or_path), **kwargs)  # an adapter: merged
        if qc is not None and not rank:  # what was not quantized is still a view into the checkpoint's mapping: let it go
            own_checkpoint_views(model)
        if sent is not None:
            sent.send_rest(model)
        elif rank and rows is not None:
            received = receive_4bit_layers(model, rows)
    part = zero3 or sent  # at most one of them acted
    if part is not None and dist.get_rank() == 0:
        if part.layers and part.partitioned == part.layers:
            log.info("%s", part.summary())
        else:  # a weight the checkpoint lacks, or a loader that no longer calls the setter quantload wraps
            log.warning("%s; the rest stayed whole until the backend shards them (more memory while loading than "
                        "planned)", part.summary())
    log_attention(recipe, hardware, model.config._attn_implementation, why)  # what the loaded model really runs
    if rank and rows is not None:  # the 4-bit layers came from rank 0 (receive_4bit_layers), whole where not sent by layer
        model.__dict__.pop("hf_device_map", None)
        log.debug("rank %d: %d decoder layers received", rank, received)
    elif rank:
        # Real but untouched storage: accelerate maps optimizer params to their shards by data_ptr, which is 0 for
        # every meta tensor. Large torch.empty blocks are lazily mapped pages, so this costs address space, not RAM.
        model.to_empty(device="cpu")
        # to_empty gives each module a new Parameter, which unties tied weights (Qwen2.5 small, Gemma: lm_head shares
        # embed_tokens); untied, accelerate's FSDP2 mapping misses lm_head.weight on this rank. Tie them again.
        model.tie_weights()
        # a device map makes the Trainer treat the model as spread over devices (is_model_parallel), which it is not
        model.__dict__.pop("hf_device_map", None)
    if rank is not None:
        _broadcast_buffers(model, rank)
    emb = model.get_input_embeddings().weight
    # the full row count: under ZeRO-3 init a rank holds a 0-row partition (ds_shape is the whole), and read as 0
    # rows a vocabulary padded past the tokenizer (Qwen's 151936 rows for 151665 tokens) was cut to the tokenizer's
    if len(tokenizer) > getattr(emb, "ds_shape", emb.shape)[0]:
        # exact size: every new row is then one of the added tokens, trained and saved (see lora_config). The new rows
        # are drawn from the model's init under the recipe's seed, so every rank draws the same rows (sharded
        # backends keep each rank's own draw for its shard) and a run starts alike at any world size.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(int(recipe.trl_value("seed") or 0))
            model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    model.config.pad_token_id = tokenizer.pad_token_id
    set_generation_stop(model.generation_config, tokenizer)
    # No KV cache while training: with a cache, transformers skips its packed-sequence detection and packed samples
    # would attend to each other under sdpa/eager (tests/test_data.py shows it). Generation turns it back on.
    model.config.use_cache = False
    return model



def ram_efficient_rank(recipe: Recipe, quantized: bool) -> int | None:
    """This process's rank when only rank 0 should read the weights (backends.weight_reading says RANK0_READS: FSDP2
    with fsdp_cpu_ram_efficient_loading, 16-bit) and there is a process group, else None. transformers 5 reads the
    checkpoint on every rank even then (8 ranks x 70B x 4 B is 2 TB of RAM), so the other ranks load on the meta
    device here, and accelerate's FSDP2 preparation broadcasts rank 0's state dict into their shards."""
    if weight_reading(recipe, quantized)[0] != RANK0_READS:
        return None
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return None
    return dist.get_rank()


def _broadcast_buffers(model, rank: int) -> None:
    """Non-persistent buffers (rotary inv_freq) are not in the state dict FSDP broadcasts: send rank 0's (small)
    buffers to the ranks that did not read the checkpoint."""
    for _, buf in model.named_buffers():
        dist.broadcast(buf.data, src=0)  # rank 0 sends; the others receive into their (uninitialised) buffers

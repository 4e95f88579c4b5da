"""Which of a model's modules the sharded backends handle as units: the layer classes FSDP wraps (fsdp_wrap_classes,
named for accelerate before its plugin is built) and the modules ZeRO-3 fetches whole as leaves (zero3_leaves: experts,
and modules whose forward source calls a submodule in a loop the data decides)."""

from __future__ import annotations

import functools
import logging
import os

from sftrecipes.core.errors import RecipeError
from sftrecipes.model import meta
from sftrecipes.recipe.typed import Recipe

log = logging.getLogger("sftrecipes")

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
    built = meta.recipe_model(recipe)
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

"""Which attention kernel a run's model attends with: the recipe's request (recipe/target.requested_attention) held
against what the model class the loader instantiates supports (its own flags and its attention's traits, read from
the model built on the meta device), the device and the packages present; chosen once here for the loader, the
training arguments (pad_to_multiple_of under sdpa) and the run's log line.

The kernels themselves are transformers' and the project's own sft_varlen (attention.py); the planner's torch-free
estimate of the same choice is plan/activations.planned_attention.
"""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass

import torch

from sftrecipes.core.errors import RecipeError
from sftrecipes.facts import perlayer
from sftrecipes.model import attention, meta
from sftrecipes.recipe.target import flash_alias, load_dtype, packed, requested_attention
from sftrecipes.recipe.typed import Recipe

log = logging.getLogger("sftrecipes")

# Packed rows under sdpa on a GPU: transformers builds a dense block-diagonal mask and torch's sdpa picks cuDNN
# attention, which compiles a graph per new sequence length; padding-free packing changes the length every step.
# Padding the flattened batch to a multiple of this bounds the number of shapes (docs/benchmarks.md, GPU: +44%
# tokens/s on a 1B full fine-tune on an H200, at most 255 padded tokens per step).
SDPA_PACKED_PAD = 256

VARLEN = attention.NAME  # the project's varlen kernel (attention.py registers it when a model loads)
KERNELS = ("sdpa", "eager", "flash_attention_2", "flex_attention", VARLEN)


def flash_attn_installed() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


def _flash_missing(recipe: Recipe, hardware: str) -> list[str]:
    missing = []
    if not flash_attn_installed():
        missing.append("the flash-attn package (pip install -r requirements-gpu.txt)")
    if hardware != "gpu":
        missing.append("a GPU")
    return missing


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
    built = meta.recipe_model(recipe)
    if built is None:
        return None
    cfg, model = built
    return support_of(type(model), attention_traits(cfg, model))


def _sixteen_bit(recipe: Recipe) -> bool:
    return load_dtype(recipe) != "float32" or bool(recipe.trl_value("bf16") or recipe.trl_value("fp16"))


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
    key = "use_flash_attn" if flash_alias(recipe) else "attn_implementation"

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

"""Torch-free model shapes: what a config.json says a model is made of, weight by weight as the model names them.

    shape = model_shape("Qwen/Qwen3-30B-A3B")        # config.py: a hub id (model_configs/), a local folder or a config dict
    shape.params, shape.active_params                # 30.53B, 3.35B: every weight, and those one token runs through
    shape.lora_params("all-linear", r=8)             # what peft creates (router left out unless router=True)

Each decoder layer carries its own sizes (heads, kv heads, head_dim, MLP width): transformers lets a config vary them
by layer (`per_layer_config`: Gemma-4's full-attention layers have head_dim 512 beside 256), and every figure reads
them per layer. config.model_shape builds a Shape: a flat config of ten layouts (Llama, Mistral, Qwen2/3, Gemma-2/3,
Phi-3, Mixtral, Qwen2/3-MoE) through shape_table.py without torch; any other config (another architecture, a multimodal
one, per-layer overrides) from the model transformers builds on the meta device (model/meta.py).

What a recipe makes of a shape (the dtype its weights load in, whether checkpointing runs) is recipe/target.py's.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from functools import cached_property

from sftrecipes.core.errors import RecipeError

# peft 0.21 converts LoRA targets of these model types to transformers 5's fused experts (peft.utils.
# transformers_weight_conversion): the v4 module names below become parameters of the fused experts (the two halves of
# gate_up_proj together, at twice the rank and alpha: peft's rank_pattern) or the router. Those names still adapt the
# nn.Linear modules that have them (a dense layer's MLP, a shared expert): compat.keep_dense_linears_in_moe_conversion
# puts them back, in the run and in the planner alike. Every MoE layout's fused experts are adapted under all-linear
# (lora.lora_targets), the router only with lora_target_router.
PEFT_EXPERT_NAMES = {
    "qwen3_moe": {"gate_proj": "gate_up_proj", "up_proj": "gate_up_proj", "down_proj": "down_proj", "gate": "gate"},
    "mixtral": {"w1": "gate_up_proj", "w3": "gate_up_proj", "w2": "down_proj", "gate": "gate"},
}
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# model types whose transformers 5.24 class has no sdpa path (_supports_sdpa False: Gemma-2's attention soft-capping);
# attn_implementation auto gives them eager (model/attnchoice.choose_attention reads the class itself; tests/facts/test_shape.py checks
# this table against it)
NO_SDPA = ("gemma2",)


# ----------------------------------------------------------------------------------------------- structures


@dataclass(frozen=True)
class Weight:
    """One parameter tensor of a decoder layer, named as in the model (relative to `model.layers.N.`).

    kind: "linear" (an nn.Linear weight, dims (out, in)), "bias", "norm", "experts" (a fused expert tensor, dims
    (experts, out, in), or (experts, in, out) where the model stores them transposed), "router" (the router's weight,
    dims (experts, hidden)) or "other" (any other parameter a layer holds: attention sinks, a convolution, gates);
    name: the module's path for linear/norm/router weights, the parameter's path for experts, biases and others."""

    name: str
    kind: str
    dims: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.dims)

    @property
    def param_name(self) -> str:
        return self.name if self.kind in ("experts", "bias", "other") else f"{self.name}.weight"

    @property
    def leaf(self) -> str:
        return self.name.rpartition(".")[2]

    @property
    def fan_in(self) -> int:
        return self.dims[-1]

    @property
    def fan_out(self) -> int:
        return self.dims[-2]

    @property
    def matrices(self) -> int:
        """Matrices in the tensor (experts of a fused tensor, else 1)."""
        return self.dims[0] if self.kind == "experts" else 1


@dataclass(frozen=True)
class Layer:
    """One decoder layer: its weights; experts/top_k > 0 for a sparse (mixture-of-experts) layer; its own attention
    sizes and dense MLP width (a config may vary them by layer: perlayer.py)."""

    weights: tuple[Weight, ...]
    experts: int = 0
    top_k: int = 0
    shared_intermediate: int = 0  # Qwen2-MoE's shared expert (always on), 0 without one
    heads: int = 0
    kv_heads: int = 0
    head_dim: int = 0
    intermediate: int = 0  # the dense MLP's width (0 in a sparse layer: Shape.expert_intermediate, shared_intermediate)

    @property
    def params(self) -> int:
        return sum(w.numel for w in self.weights)

    @property
    def expert_params(self) -> int:
        return sum(w.numel for w in self.weights if w.kind == "experts")

    @property
    def active_params(self) -> int:
        """Weights one token runs through: its top-k experts of all."""
        return self.params - self.expert_params // max(self.experts, 1) * (self.experts - self.top_k)

    @property
    def matmul_params(self) -> int:
        """Matmul weights per token: linears, the router, the top-k experts (biases and norms are no matmuls)."""
        dense = sum(w.numel for w in self.weights if w.kind in ("linear", "router"))
        return dense + self.expert_params // max(self.experts, 1) * self.top_k

    def get(self, name: str) -> Weight | None:
        return next((w for w in self.weights if w.name == name), None)


@dataclass(frozen=True)
class Shape:
    """A model's shape: sizes, every decoder layer's weights (`decoder`), embeddings and head."""

    name: str
    model_type: str
    hidden: int
    vocab: int
    tied: bool
    max_positions: int
    decoder: tuple[Layer, ...]
    experts: int = 0  # routed experts per sparse layer (0: dense model)
    top_k: int = 0  # experts per token
    expert_intermediate: int = 0
    shared_intermediate: int = 0
    # the parameters outside the decoder layers, embeddings and head (full names): None for the table's layouts (the
    # final norm alone); the meta model's (meta.py): the final norm, vision towers, projectors, ... every one
    rest: tuple[Weight, ...] | None = None
    supports_sdpa: bool | None = None  # the model class's own flag (meta.py); None: the table's NO_SDPA
    # why packed batches cannot reach this model here (meta.py: a kernel that runs its PyTorch fallback, which refuses
    # them; the run pads its rows instead: model/fallbacks.packing_fallback), or "" where they can
    unpacked: str = ""
    checkpoints: bool = True  # the model class supports activation checkpointing (meta.py; else the run goes without)
    # a submodule the model runs several times a forward (meta.reruns: HRM's stacks), or "": ZeRO-3 then goes without
    # checkpointing (recipe/target.checkpointing_off)
    reruns: str = ""
    source: str = "table"  # "table" (shape_table.py, torch-free) or "meta" (the model transformers builds: meta.py)
    config_json: str = field(default="", compare=False)  # the config it was read from (meta.py rebuilds the model)
    head_vocab: int = 0  # the output head's rows where they differ from the input embedding's (Mllama: 8 image tokens
    #                      more in the embedding), else 0

    def _same(self, size: str) -> int:
        """A size every decoder layer has alike (heads, kv_heads, head_dim); a ValueError where they differ."""
        sizes = {getattr(L, size) for L in self.decoder}
        if len(sizes) > 1:
            raise ValueError(f"{self.name}: {size} differs by decoder layer ({sorted(sizes)}); read each Layer's")
        return sizes.pop() if sizes else 0

    heads = property(lambda self: self._same("heads"))
    kv_heads = property(lambda self: self._same("kv_heads"))
    head_dim = property(lambda self: self._same("head_dim"))

    @property
    def head_rows(self) -> int:
        return self.head_vocab or self.vocab

    @property
    def layers(self) -> int:
        return len(self.decoder)

    @property
    def moe(self) -> bool:
        return self.experts > 0

    def packs(self, recipe) -> bool:
        """Whether the run's batches reach this model packed: packing (or padding_free) asked for, and the model's
        kernels keep packed samples apart here."""
        return bool(recipe.trl_value("packing") or recipe.trl_value("padding_free")) and not self.unpacked

    @property
    def sdpa(self) -> bool:
        return self.supports_sdpa if self.supports_sdpa is not None else self.model_type not in NO_SDPA

    @property
    def rest_params(self) -> int:
        """Parameters outside the decoder layers, embeddings and head (the table: the final norm)."""
        return self.hidden if self.rest is None else sum(w.numel for w in self.rest)

    @property
    def embed_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def head_params(self) -> int:
        return 0 if self.tied else self.head_rows * self.hidden

    @cached_property
    def params(self) -> int:
        """Every parameter, as sum(p.numel() for p in model.parameters()) counts them (a tied head once)."""
        return sum(L.params for L in self.decoder) + self.embed_params + self.head_params + self.rest_params

    @cached_property
    def active_params(self) -> int:
        """Parameters one token uses (MoE: its top-k experts only; embeddings and head included, as model cards count)."""
        return sum(L.active_params for L in self.decoder) + self.embed_params + self.head_params + self.rest_params

    @cached_property
    def expert_params(self) -> int:
        return sum(L.expert_params for L in self.decoder)

    @cached_property
    def linear_params(self) -> int:
        """nn.Linear weights (decoder layers, and outside them: a vision tower's): what bitsandbytes quantizes (not
        experts, router, lm_head)."""
        return sum(w.numel for w in self._all_weights if w.kind == "linear")

    @property
    def _all_weights(self):
        yield from (w for L in self.decoder for w in L.weights)
        yield from self.rest or ()

    @cached_property
    def linear_rows(self) -> int:
        """Output rows of those nn.Linear weights (8-bit quantization keeps one scale per row)."""
        return sum(w.fan_out for w in self._all_weights if w.kind == "linear")

    @cached_property
    def matmul_params(self) -> int:
        """Matmul weights one token runs through: decoder linears, routers, top-k experts, and the LM head."""
        return sum(L.matmul_params for L in self.decoder) + self.head_rows * self.hidden

    @cached_property
    def largest_weight(self) -> int:
        """Elements of the largest single parameter tensor (embedding or a decoder weight)."""
        return max(self.embed_params, max(w.numel for w in self._all_weights))

    # -- LoRA
    def lora_targets(self, targets: str, router: bool = False) -> tuple[tuple[tuple[Weight, int], ...], ...]:
        """Per decoder layer, the weights LoRA adapts and the rank multiplier of each, as peft 0.21 resolves them.

        'all-linear': every nn.Linear of the decoder (not lm_head); for the MoE types peft converts
        (PEFT_EXPERT_NAMES) also the fused expert tensors (gate_up_proj at twice the rank) and, only with router=True
        (the project's lora_target_router), the router. A comma list: nn.Linears by leaf name (q_proj, qkv_proj, ...);
        on a converted MoE type the v4 names peft maps (gate_proj+up_proj, or w1+w3: gate_up_proj at twice the rank;
        down_proj or w2; gate: the router); on any MoE type the model's own names of the expert tensors (gate_up_proj
        at twice the rank, as lora.lora_targets doubles it; down_proj at the given rank). A name that adapts nothing is a RecipeError naming the ones that would."""
        renamed = PEFT_EXPERT_NAMES.get(self.model_type, {})
        if targets.strip() == "all-linear":
            picks = {"linear": None, "experts": {"gate_up_proj": 2, "down_proj": 1} if self.moe else {},
                     "router": {"gate": 1} if self.moe and router else {}}
        else:
            names = [t.strip() for t in targets.split(",") if t.strip()]
            fused = [n for n in names if renamed.get(n) == "gate_up_proj"]
            if len(fused) == 1:
                other = next(k for k, v in renamed.items() if v == "gate_up_proj" and k != fused[0])
                raise RecipeError(f"lora_target_modules: '{fused[0]}' is half of the fused experts' gate_up_proj in "
                                  f"{self.name}; list '{other}' too (or gate_up_proj)")
            experts = {"gate_up_proj": 2} if fused else {}
            if self.moe:
                experts.update({renamed.get(n, n): 2 if renamed.get(n, n) == "gate_up_proj" else 1 for n in names
                                if renamed.get(n, n) in ("gate_up_proj", "down_proj") and renamed.get(n, n) not in experts})
            picks = {"linear": {n for n in names if n != "gate"}, "experts": experts,
                     "router": {"gate": 1} if self.moe and router else {}}
            if self.moe and "gate" in names:  # as lora.lora_targets refuses it
                raise RecipeError("lora_target_modules: 'gate' is the router of this mixture-of-experts model; remove it "
                                  "and set lora_target_router: true")
            adapted = {w.leaf for L in self.decoder for w in L.weights if w.kind == "linear" and w.leaf in picks["linear"]}
            adapted |= set(picks["experts"]) | set(picks["router"])
            adapted |= {n for n in names if renamed.get(n) in adapted}
            unknown = [n for n in names if n not in adapted]
            if unknown:
                known = sorted({w.leaf for L in self.decoder for w in L.weights if w.kind == "linear"}
                               | ({"gate_up_proj", "down_proj", "gate"} | set(renamed) if renamed else set()))
                raise RecipeError(f"lora_target_modules: '{unknown[0]}' is not a linear layer of {self.name}; "
                                  f"use 'all-linear' or some of {','.join(known)}")
        out = []
        for L in self.decoder:
            picked = []
            for w in L.weights:
                if w.kind == "linear" and (picks["linear"] is None or w.leaf in picks["linear"]):
                    picked.append((w, 1))
                elif w.kind in ("experts", "router") and w.leaf in picks[w.kind]:
                    picked.append((w, picks[w.kind][w.leaf]))
            out.append(tuple(picked))
        return tuple(out)

    def lora_params(self, targets: str, r: int, router: bool = False) -> int:
        """LoRA parameters peft creates: r*(in+out) per adapted matrix; a fused expert tensor has one pair per expert
        (lora_A [r*E, in], lora_B [out, r*E])."""
        return sum(r * mult * w.matrices * (w.fan_in + w.fan_out)
                   for layer in self.lora_targets(targets, router) for w, mult in layer)


# ----------------------------------------------------------------------------------------------- peft's patterns


def pattern_value(pattern: dict | None, key: str, default: int) -> int:
    """peft's rank_pattern/alpha_pattern lookup (peft.utils.other.get_pattern_key): the first key, in order, that
    matches the end of `key` at a dot boundary, as a regex. `key` is the module's name in the base model (a targeted
    parameter's own name for peft's parameter targets)."""
    for k, v in (pattern or {}).items():
        if re.match(rf"(.*\.)?({k})$", key):
            return v
    return default

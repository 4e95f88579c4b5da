"""The planner's reading of a recipe's parallel setup: over how many ranks its backend divides the weights, gradients
and optimizer states, and how many bytes a parameter takes in each (torch-free: plain arithmetic on the recipe).

Every planner module (estimate.py, activations.py, strategies.py, pitfalls.py) counts bytes through `setup(recipe)`
and the functions here, so a precision rule is written once: `load_bytes` follows target.load_dtype, the rule
model.load_dtype loads with.
"""

from __future__ import annotations

from dataclasses import dataclass

from sftrecipes.facts.shape import DTYPE_BYTES
from sftrecipes.recipe.target import load_dtype, mixed_dtype
from sftrecipes.recipe.typed import Recipe

GB = 1e9  # the planner reports decimal gigabytes


@dataclass(frozen=True)
class Setup:
    """What the arithmetic needs from a recipe, read once (dtype rule of model.load_dtype, backend sharding)."""

    world: int
    gpn: int
    load_bytes: int  # bytes/param of float weights as loaded
    act_bytes: int  # activations: 2 under bf16/fp16, else 4
    mixed16: bool
    quant_bits: int  # 4, 8 or 16 (not quantized)
    lora: bool
    shard_w: int  # ranks over which weights / grads / optimizer states are divided
    shard_g: int
    shard_o: int
    gathers: bool  # ZeRO-3 / FSDP gather layers for compute
    deepspeed16: bool  # DeepSpeed casts the module to bf16/fp16 and keeps fp32 master partitions
    gpu: bool
    offload_opt: bool
    offload_params: bool
    expert_bytes: int = 4  # MoE experts compute in their weights' dtype (grouped_mm is not autocast): 2 or 4
    lora_router: bool = False  # lora_target_router


def load_bytes(recipe: Recipe) -> int:
    """Bytes per float weight as loaded (target.load_dtype, the rule model.load_dtype loads with)."""
    return DTYPE_BYTES[load_dtype(recipe)]


def setup(recipe: Recipe) -> Setup:
    m, L = recipe.model, recipe.launch
    world, gpn = L.world_size, L.gpus_per_node
    mixed16 = mixed_dtype(recipe) is not None
    lb = load_bytes(recipe)
    w = g = o = 1
    if L.backend == "deepspeed":
        o = world if L.zero_stage >= 1 else 1
        g = world if L.zero_stage >= 2 else 1
        w = world if L.zero_stage == 3 else 1
    elif L.backend == "fsdp" and L.fsdp_sharding_strategy != "NO_SHARD":
        w = g = o = gpn if L.fsdp_sharding_strategy == "HYBRID_SHARD" else world
    ds16 = L.backend == "deepspeed" and mixed16
    # expert weights as the experts' matmuls see them: DeepSpeed's 16-bit module, FSDP's param_dtype, 16-bit loading
    expert_b = 2 if (ds16 or (L.backend == "fsdp" and mixed16) or lb == 2) else 4
    return Setup(world, gpn, lb, 2 if (mixed16 or lb == 2) else 4, mixed16,
                 4 if m.use_4bit_quantization else 8 if m.use_8bit_quantization else 16, m.use_peft_lora, w, g, o,
                 w > 1, ds16, L.hardware != "cpu",
                 L.backend == "deepspeed" and L.offload_optimizer or L.backend == "fsdp" and L.fsdp_offload_params,
                 L.backend == "deepspeed" and L.offload_params or L.backend == "fsdp" and L.fsdp_offload_params,
                 expert_b, m.use_peft_lora and m.lora_target_router)


def trainable_bytes(recipe: Recipe, s: Setup) -> int:
    """Bytes per trainable parameter at rest: 2 in DeepSpeed's 16-bit module (its fp32 master partitions count with
    the optimizer states); 4 for LoRA adapters (peft keeps them fp32); full fine-tuning: 4 under bf16/fp16 mixed
    precision with precision fp32_trainable (precision.apply_precision_policy upcasts what loaded in 16 bits), else
    the load dtype (memory_constrained, or no mixed precision: the weights stay as loaded)."""
    if s.deepspeed16:
        return 2
    if s.lora or (s.mixed16 and recipe.model.precision != "memory_constrained"):
        return 4
    return s.load_bytes


def quant_bytes_per_param(recipe: Recipe) -> float:
    """Bytes per quantized linear weight, constants included (bitsandbytes)."""
    m = recipe.model
    if m.use_4bit_quantization:
        # 4 bits + one absmax per 64-weight block: fp32, or with nested quant 8-bit + one fp32 per 256 absmax
        return 0.5 + (1 / 64 + 4 / (64 * 256) if m.use_nested_quant else 4 / 64)
    if m.use_8bit_quantization:
        return 1.0  # + one fp32 scale per output row, added by the caller
    raise ValueError("not quantized")


@dataclass(frozen=True)
class Partitioned4bitLoad:
    """Bytes one rank holds while a 4-bit model loads with each decoder layer partitioned once quantized (ZeRO-3 with
    zero3_init: quantload.partition_4bit_layers): its share of the layers, what lies outside them whole (embeddings,
    the final norm, the head, a vision tower: the DeepSpeed engine partitions them later), the one layer being
    quantized whole, and the largest weight in its loaded 16-bit form while bitsandbytes quantizes it. The packed
    bytes are partitioned, but each weight's quantization state stays whole on every rank (bitsandbytes reads it
    after each gather: quantload.py), so `states` is not divided by the ranks."""

    share: float  # the rank's partition of every decoder layer (4-bit linear weights, the rest in floats)
    states: float  # the layers' quantization states (absmax and nested statistics), whole on every rank
    outside: float  # the parameters outside the decoder layers, whole (a vision tower's linear weights in 4-bit)
    layer: float  # the largest decoder layer, whole, while its last weight is set
    largest: int  # elements of the largest linear weight (quantized one at a time)

    @property
    def kept(self) -> float:
        """Held once loaded: the share, the quantization states and what lies outside the layers."""
        return self.share + self.states + self.outside


def partitioned_4bit_load(recipe: Recipe, shape, ranks: int, float_b: int) -> Partitioned4bitLoad:
    """The figures of Partitioned4bitLoad for `shape` over `ranks` (bitsandbytes quantizes nn.Linear weights only:
    experts, routers, norms and embeddings stay in float_b-byte floats)."""
    qb = quant_bytes_per_param(recipe)
    packed = 0.5 if recipe.model.use_4bit_quantization else qb  # the rest of qb: the state beside the packed bytes

    def layer_bytes(layer) -> float:
        lin = sum(w.numel for w in layer.weights if w.kind == "linear")
        return lin * qb + (layer.params - lin) * float_b

    layers = [layer_bytes(layer) for layer in shape.decoder]
    layer_lin = sum(w.numel for layer in shape.decoder for w in layer.weights if w.kind == "linear")
    states = layer_lin * (qb - packed)
    outside_lin = shape.linear_params - layer_lin
    outside = outside_lin * qb + (shape.params - sum(layer.params for layer in shape.decoder) - outside_lin) * float_b
    largest = max((w.numel for layer in shape.decoder for w in layer.weights if w.kind == "linear"), default=0)
    return Partitioned4bitLoad((sum(layers) - states) / ranks, states, outside, max(layers, default=0.0), largest)

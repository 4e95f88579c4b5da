"""One rank's model states, as the plan's first table lists them: the weights (frozen and trainable, in the dtype each
backend keeps them at rest; 4-bit with its quantization constants), gradients and optimizer states of the trainable
parameters, each divided by the ranks that shard it, and a preference run's reference copy (reference.py)."""

from __future__ import annotations

from dataclasses import dataclass

from sftrecipes.facts.shape import Shape
from sftrecipes.plan.activations import layer_lora_params
from sftrecipes.plan.reference import ADAPTER, COPY, FREE, NO_KL, Reference, reference
from sftrecipes.plan.sharding import GB, Setup, quant_bytes_per_param, trainable_bytes
from sftrecipes.recipe.typed import Recipe


@dataclass
class Item:
    """One line of the plan's tables: what, its GB (per GPU, or per node for CPU RAM), how it was counted."""

    name: str
    gb: float
    note: str = ""


@dataclass(frozen=True)
class ModelStates:
    """One rank's model states (the report's items) and the bytes per parameter the later steps count with."""

    items: list[Item]  # per GPU, always resident
    adapted: tuple  # LoRA targets of each decoder layer (empty tuples without LoRA)
    trainable: int  # trainable parameters (LoRA: the adapters)
    frozen: float  # bytes of the frozen base at rest, unsharded (full fine-tuning: 0)
    float_b: int  # bytes per float weight at rest (DeepSpeed's 16-bit module: 2, else the load dtype)
    p_b: int  # bytes per trainable parameter (sharding.trainable_bytes), and per gradient
    g_b: int
    o_b: int  # optimizer state bytes per trainable parameter
    optim: str
    gather_b: float  # bytes per parameter of a gathered (ZeRO-3/FSDP) layer
    grads_total: float  # bytes of one rank's gradients (0 when FSDP offloads them)
    outside: tuple = ()  # LoRA's trainable parameters outside the decoder layers, by module ((name, count), ...)
    ref: Reference = Reference("")  # a preference run's reference model (reference.py)


def lora_layout(recipe: Recipe, shape: Shape) -> tuple[tuple, int, tuple]:
    """(per decoder layer: the adapted weights and their rank multipliers, LoRA's trainable parameters, those outside
    the decoder layers by module): the table's arithmetic for its layouts (shape.lora_targets: tests/facts/test_shape.py
    proves it equal to the run's peft count), else peft applying the run's LoraConfig to the meta model (meta.py)."""
    m = recipe.model
    if shape.source == "table":
        adapted = shape.lora_targets(m.lora_target_modules, m.lora_target_router)
        return adapted, sum(layer_lora_params(ad, m.lora_r) for ad in adapted), ()
    from sftrecipes.model.meta import lora_layout as meta_layout

    layout = meta_layout(recipe, shape)
    return layout.adapted, layout.trainable, layout.outside


def model_states(recipe: Recipe, shape: Shape, s: Setup) -> ModelStates:
    """Weights frozen and trainable, in the dtype each backend keeps them at rest, gradients and optimizer states."""
    m, L = recipe.model, recipe.launch
    lin = shape.linear_params  # what bitsandbytes quantizes: nn.Linear weights (not experts, router, embeddings, head)
    other = shape.params - lin
    adapted, trainable, outside = lora_layout(recipe, shape) if s.lora else (tuple(() for _ in shape.decoder), shape.params, ())
    float_b = 2 if s.deepspeed16 else s.load_bytes  # DeepSpeed bf16/fp16 casts the whole module
    p_b = g_b = trainable_bytes(recipe, s)
    optim = str(recipe.trl_value("optim"))
    o_b = 2 if "8bit" in optim else 2 * p_b  # Adam m, v like the parameter (8-bit optimizers: 1 byte each)
    if s.deepspeed16:
        o_b = (2 if "8bit" in optim else 8) + 4  # + the fp32 master partition DeepSpeed always keeps
    w_on, w_div = not s.offload_params, (f" /{s.shard_w}" if s.shard_w > 1 else "")
    trained = Item("weights" if not s.lora else "trainable params", trainable * p_b / s.shard_w / GB if w_on else 0,
                   f"{trainable / 1e6:.2f}M x {p_b} B" + w_div)
    items = [trained]
    frozen = 0.0
    if s.lora:  # the frozen base: quantized linear weights + the rest in floats, or all in floats
        if s.quant_bits < 16:
            qb = quant_bytes_per_param(recipe)
            frozen = lin * qb + (4 * shape.linear_rows if s.quant_bits == 8 else 0) + other * float_b
            note = (f"{lin / 1e9:.2f}B linear weights in {s.quant_bits}-bit ({qb:.4f} B/param incl. "
                    + ("absmax 8-bit/64 + fp32/256 nested" if m.use_nested_quant else "fp32 absmax/64" if s.quant_bits == 4 else "fp32 row scales")
                    + f", storage {m.bnb_4bit_quant_storage_dtype if s.quant_bits == 4 else 'int8'}) + {other / 1e9:.2f}B others in {float_b}-byte floats")
        else:
            frozen = shape.params * float_b
            note = f"{shape.params / 1e9:.2f}B params, {float_b} B/param"
        items.insert(0, Item("weights (frozen base)", frozen / s.shard_w / GB if w_on else 0,
                             note + (f", /{s.shard_w} ranks" if s.shard_w > 1 else "") + ("" if w_on else " -> on CPU (offload)")))
    fsdp_offloads_grads = s.offload_params and L.backend == "fsdp"
    items.append(Item("gradients", 0 if fsdp_offloads_grads else trainable * g_b / s.shard_g / GB,
                      f"{g_b} B/param" + (f" /{s.shard_g}" if s.shard_g > 1 else "")))
    items.append(Item("optimizer states", 0 if s.offload_opt else trainable * o_b / s.shard_o / GB,
                      f"{optim}: {o_b} B/param" + (" (m, v + fp32 master)" if s.deepspeed16 else " (m, v)")
                      + (f" /{s.shard_o}" if s.shard_o > 1 else "") + (" -> on CPU (offload)" if s.offload_opt else "")))
    # ZeRO-3/FSDP gather in the dtype at rest (LoRA: base and adapters; FSDP mixed precision: its param_dtype)
    gather_b = (frozen + trainable * p_b) / shape.params if s.lora else (2 if s.mixed16 else p_b)
    if s.lora and s.mixed16 and L.backend == "fsdp":
        gather_b = (frozen + trainable * 2) / shape.params
    grads_total = trainable * g_b / s.shard_g if not fsdp_offloads_grads else 0.0
    ref = reference(recipe, shape, s, float_b)
    if ref.kind:  # its own line, after the weights: a frozen copy (no grads, no optimizer states), or why there is none
        items.insert(1 + s.lora, _reference_item(ref, shape))
    return ModelStates(items, adapted, trainable, frozen, float_b, p_b, g_b, o_b, optim, gather_b, grads_total, outside, ref)


def _reference_item(ref: Reference, shape: Shape) -> Item:
    if ref.kind == ADAPTER:
        return Item("reference model", 0.0, "none: the base with the adapter disabled (LoRA)")
    if ref.kind == FREE:
        return Item("reference model", 0.0, "none: the method has no reference model")
    if ref.kind == NO_KL:
        return Item("reference model", 0.0, "none: beta 0 (no KL term)")
    if ref.kind != COPY:
        return Item("reference model", 0.0, "none during training: log-probs computed in a pass before step 1")
    return Item("reference model (frozen copy)", ref.per_gpu / GB,
                f"{shape.params / 1e9:.2f}B params x {ref.bytes_per_param} B" + (f" /{ref.ranks}" if ref.ranks > 1 else ", whole")
                + ", no grads or optimizer states" + (" -> on CPU (offload)" if ref.offloaded else ""))

"""Model FLOPs of training and MFU, the arithmetic: from a model's shape (shape.py) and a batch's real tokens and
causal attention pairs, what the model's work costs, and that over the device's peak.

* Model FLOPs (:func:`step_flops`): matmul FLOPs of the work the model needs, per token

      4·N + 2·T + 6·A      N base matmul weights, T of them trained (N for a full fine-tune, 0 for LoRA), A adapters

  forward 2·N, backward 2·N for activation gradients (also through frozen weights, which LoRA needs) + 2·T for weight
  gradients; adapters 6·A like any trained weight. A full fine-tune gives the standard 6·N (Kaplan et al. 2020,
  "Scaling Laws", sec. 2.1). N is every decoder linear plus the LM head (input embeddings are a lookup, no FLOPs).
  Mixtures of experts count what a token runs through (`Shape.matmul_params`): the router and its top-k experts,
  so N, T and A hold k/E of each fused expert tensor and of its adapters (peft's per-step fold W + s·BA of an
  adapted expert tensor is implementation work, not model work, and is not counted).
  Attention adds 12·Σd FLOPs per (query, key) pair a causal mask lets through (QKᵀ and AV: 2·d each forward, x3 for
  training; d = heads·head_dim of each of the L layers, summed: a config may vary it by layer, Gemma-4's full-attention
  layers have twice the head size); a sample of length s has s(s+1)/2 pairs, i.e. ≈ 6·L·d·s per token: the causal half
  of PaLM's 12·L·H·Q·T (Chowdhery et al. 2022, appendix B), as FlashAttention-2's benchmarks count it. Packed samples
  are counted each with its own length (they do not attend to each other).
* MFU = model FLOPs / step time / device peak. Gradient checkpointing's recomputed forward is not model work: it
  counts only in HFU (hardware FLOPs utilisation), reported when checkpointing is on.
"""

from __future__ import annotations

import logging

import torch

from sftrecipes.core.errors import RecipeError
from sftrecipes.facts.config import model_shape
from sftrecipes.facts.shape import Shape

log = logging.getLogger("sftrecipes")

# Dense 16-bit (bf16/fp16) tensor-core peaks in TFLOP/s, from the vendors' datasheets, matched as substrings of
# torch.cuda.get_device_name() in this order (more specific names first). For fp32/tf32 training pass the peak.
PEAK_TFLOPS: tuple[tuple[str, float], ...] = (
    ("H200", 989.0), ("GH200", 989.0), ("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H100", 989.0), ("H800", 989.0),
    ("B200", 2250.0), ("A100", 312.0), ("A800", 312.0), ("A10G", 125.0), ("A10", 125.0), ("L40S", 362.0),
    ("L40", 181.0), ("L4", 121.0), ("A6000", 155.0), ("RTX 4090", 165.0), ("V100", 125.0), ("T4", 65.0),
    ("MI300X", 1307.0), ("MI250X", 383.0),
)


def device_peak_tflops(name: str | None = None) -> float | None:
    """Dense 16-bit peak of a GPU by its name (default: the current CUDA device); None when unknown or no GPU."""
    if name is None:
        if not torch.cuda.is_available():
            return None
        name = torch.cuda.get_device_name()
    return next((peak for key, peak in PEAK_TFLOPS if key.lower() in name.lower()), None)


def model_shape_of(model) -> Shape | None:
    """The shape of a live model, from its config (under PEFT: the base model's); None for a layout shape.py does
    not know (FLOPs and MFU are then not reported)."""
    try:
        return model_shape(_base_model(model).config.to_dict())
    except RecipeError as e:
        log.warning("metrics: no FLOP count for this model (%s); MFU is not reported", e)
        return None


def matmul_params(shape: Shape) -> int:
    """Weights that take part in a matmul per token: every decoder linear, the router and top-k experts (MoE), and
    the LM head (tied or not)."""
    return shape.matmul_params


def step_flops(shape: Shape, tokens: float, pairs: float, *, trainable: int | None = None, adapter: int = 0,
               recompute: bool = False) -> float:
    """Training FLOPs of `tokens` tokens whose attention covers `pairs` (query, key) pairs (module docstring).

    trainable: base matmul weights that get weight gradients (None = all: full fine-tune; 0: LoRA/frozen base).
    adapter: LoRA (A+B) parameters. recompute: add gradient checkpointing's second forward of the decoder layers
    (hardware FLOPs, for HFU; model FLOPs leave it out)."""
    n = matmul_params(shape)
    t = n if trainable is None else trainable
    d = sum(L.heads * L.head_dim for L in shape.decoder)  # every layer's own attention width, summed
    flops = (4 * n + 2 * t + 6 * adapter) * tokens + 12 * d * pairs
    if recompute:  # the decoder layers' forward again (the LM head is not checkpointed)
        decoder = n - shape.vocab * shape.hidden
        flops += (2 * decoder + 2 * adapter) * tokens + 4 * d * pairs
    return float(flops)


def flops_per_token(shape: Shape, seq_len: float, *, trainable: int | None = None, adapter: int = 0,
                    causal: bool = True, recompute: bool = False) -> float:
    """Training FLOPs per token of samples `seq_len` tokens long. causal=True counts the s(s+1)/2 pairs a causal
    mask keeps (≈ 6·L·d·s per token); causal=False the full s² (PaLM's 12·L·d·s)."""
    pairs = seq_len * (seq_len + 1) / 2 if causal else seq_len * seq_len
    return step_flops(shape, seq_len, pairs, trainable=trainable, adapter=adapter, recompute=recompute) / seq_len


def mfu(tokens_per_s: float, flops_per_tok: float, peak_tflops: float) -> float:
    """Model FLOPs utilisation of one device: achieved model FLOP/s over the device's peak."""
    return tokens_per_s * flops_per_tok / (peak_tflops * 1e12)


def batch_counts(inputs: dict, pad_token_id: int | None) -> tuple[int, int, int]:
    """(real tokens, token slots, causal attention pairs) of one model input (see the module docstring). Reads the
    device: the callback itself uses batch_count_tensor and reads its sums once per logging step."""
    real, pairs = batch_count_tensor(inputs, pad_token_id).tolist()
    return real, int(inputs["input_ids"].numel()), pairs


def batch_count_tensor(inputs: dict, pad_token_id: int | None):
    """[real tokens, causal attention pairs] of one model input as an int64 tensor on the batch's device, computed
    without reading the device (no host sync: on a GPU this runs ahead with the step's kernels). A padded batch: one
    sample per row, its length the row's mask sum. A padding-free batch: a sample starts where position_ids is 0;
    the trailing run of pad ids at position 0 (pad_to_multiple_of's slots) is not tokens; a token i places into its
    sample adds i + 1 pairs (a sample of s tokens: s(s+1)/2)."""
    ids = inputs["input_ids"]
    mask = inputs.get("attention_mask")
    if mask is not None:  # padded rows: one sample (or one 'wrapped' chunk) per row, attending causally within it
        lengths = mask.sum(dim=-1).flatten().to(torch.int64)
        return torch.stack([lengths.sum(), (lengths * (lengths + 1) // 2).sum()])
    pos = inputs.get("position_ids")
    n = ids.numel()
    if pos is None:  # one sample: the whole row
        return torch.tensor([n, n * (n + 1) // 2], dtype=torch.int64, device=ids.device)
    flat_ids, pos = ids.flatten(), pos.flatten().to(ids.device)
    start = pos == 0
    counted = torch.cummax(start.to(torch.int64), 0).values.bool()  # tokens before the first start belong to no sample
    if pad_token_id is not None:
        trailing = ((flat_ids == pad_token_id) & start).to(torch.int64).flip(0).cumprod(0).flip(0).bool()
        counted &= ~trailing
    index = torch.arange(n, device=ids.device)
    sample_start = torch.cummax(torch.where(start, index, torch.zeros_like(index)), 0).values
    within = index - sample_start + 1  # 1-based place of each token in its sample
    return torch.stack([counted.sum(), (within * counted).sum()])


def trainable_split(model, shape: Shape | None = None) -> tuple[int, int]:
    """(trained base matmul weights, LoRA adapter parameters) per token of a model, sharded or not (ZeRO-3 ds_numel,
    DTensor global numel). FSDP1 flattens parameters: count before it wraps (on_init_end does).

    Base weights: nn.Linear weights, and in a mixture of experts the routers (`mlp.gate`) and the fused expert tensors
    (`mlp.experts`); an expert tensor and the adapters peft puts on it count top_k/experts of their size (`shape`),
    what one token runs through."""
    share = shape.top_k / shape.experts if shape is not None and shape.experts else 1.0

    def numel(p):
        return int(getattr(p, "ds_numel", p.numel()))

    expert_adapters = set()  # peft ParamWrapper on a fused expert tensor: its lora_A/lora_B hold one pair per expert
    for module in model.modules():
        if getattr(module, "num_experts", 1) > 1 and isinstance(getattr(module, "lora_A", None), torch.nn.ModuleDict):
            expert_adapters.update(id(sub.weight) for d in (module.lora_A, module.lora_B) for sub in d.values())
    trained = adapter = 0.0
    for name, module in model.named_modules():
        for p in module.parameters(recurse=False):
            if not p.requires_grad:
                continue
            dims = len(getattr(p, "ds_shape", p.shape))
            linear_weight = isinstance(module, torch.nn.Linear) and p is module.weight
            if "lora_" in name:
                adapter += numel(p) * (share if id(p) in expert_adapters else 1.0) if linear_weight else 0
            elif linear_weight:
                trained += numel(p)
            elif dims == 3 and name.endswith("mlp.experts"):
                trained += numel(p) * share
            elif dims == 2 and name.endswith("mlp.gate"):
                trained += numel(p)
    return round(trained), round(adapter)


def _base_model(model):
    """The transformers model under PEFT (its config holds the shape)."""
    get = getattr(model, "get_base_model", None)
    return get() if callable(get) else model

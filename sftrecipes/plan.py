"""Pre-flight memory planner: will a recipe fit its GPUs and CPU RAM, and which strategies would (plus `pitfalls`, the
configuration traps every run logs).

    python -m sftrecipes plan RECIPE.yaml [--key value ...]     exit 0 fits (or no gpu_memory_gb), 2 does not fit

No torch: the model's shape comes from config.json through sftrecipes/shape.py (a local folder, or
sftrecipes/model_configs/ for hub ids) and every byte is arithmetic on that shape and the recipe. The model of one
training step (docs/planner.md):

* model states per rank: weights (by dtype; 4-bit with its quant constants), gradients and Adam states of the
  trainable parameters, each divided by the ranks that shard it (DDP none; ZeRO-1 states; ZeRO-2 +grads;
  ZeRO-3/FSDP everything);
* activations per token per decoder layer, counted from the tensors autograd saves in transformers' decoder layers
  (a sparse MoE block: its router and the k routed copies of each token), PEFT's LoRA layer (and its fold of
  W + s*BA on fused expert tensors) and TRL's chunked LM head (so there are no [tokens, vocab] logits);
* a timeline: the peak is the largest of the start of backward, the backward of the last and of the first layer
  (grads grow while activations shrink, linearly, so the ends are the extremes) and the optimizer step;
* ZeRO-3/FSDP gathered layers (+ prefetch), gradient buckets, optimizer temporaries, and an allowance for the
  CUDA context and allocator fragmentation on GPUs.
"""

from __future__ import annotations

import copy
import sys
from dataclasses import dataclass, field

from .errors import RecipeError
from .recipe import Recipe, load_recipe
from .shape import DTYPE_BYTES, Layer, Shape, Weight, load_dtype, mixed_dtype, model_shape

GB = 1e9
# Runtime allowance on a GPU: CUDA context + cuBLAS/NCCL workspaces (not visible to torch's allocator, visible to
# nvidia-smi), and the caching allocator's fragmentation as a share of the memory that churns each step.
CUDA_CONTEXT_GB = 1.0
FRAGMENTATION = 0.10
PROCESS_CPU_GB = 2.0  # host RAM of one rank besides tensors: python, torch, CUDA host libraries, dataloader
CKPT_SHARD_GB = 10.0  # hub checkpoints ship in ~5-10 GB safetensors shards; a rank reading shard by shard holds one
# bandwidths used only to rank strategies (bytes per second per GPU): NVLink ring, InfiniBand 200 Gb/s, PCIe
NVLINK, INFINIBAND, PCIE = 150e9, 25e9, 20e9
TRL_TOKEN_TILE, TRL_VOCAB_TILE = 4096, 32768  # trl.kernels.chunked_logprob tile of the fused LM head
DS_SUB_GROUP_SIZE = 1_000_000_000  # DeepSpeed's zero_optimization.sub_group_size default (the emitted configs keep it)


# ----------------------------------------------------------------------------------------------- precision, sharding


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
    """Bytes per float weight as loaded (shape.load_dtype, the rule model.load_dtype loads with)."""
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


# ----------------------------------------------------------------------------------------------- plan


@dataclass
class Item:
    name: str
    gb: float
    note: str = ""


@dataclass
class Strategy:
    name: str
    gpus: int
    gpu_gb: float
    fits: bool | None
    comm_gb: float  # per GPU per optimizer step, network
    pcie_gb: float  # per GPU per optimizer step, host <-> device
    seconds: float  # comm + transfer time at the assumed bandwidths, the ranking key
    cpu_gb: float
    note: str = ""


@dataclass
class Plan:
    model: str
    params: int
    trainable: int
    world: int
    gpus_per_node: int
    nodes: int
    backend: str
    states: list[Item]  # per GPU, always resident (weights, grads, optimizer)
    peak: list[Item]  # per GPU, what else is live at the peak phase
    peak_phase: str
    phases: dict[str, float]  # GB per GPU at each phase of one step (tensors only)
    tensor_peak_gb: float  # largest phase: the live-tensor peak (what the calibration measures)
    allowance_gb: float
    gpu_total_gb: float
    gpu_limit_gb: float | None
    fits: bool | None  # None: gpu_memory_gb unknown
    cpu: list[Item]  # per node
    cpu_total_gb: float
    cpu_limit_gb: float | None
    cpu_fits: bool | None
    comm: list[Item]  # network volume per GPU per optimizer step
    comm_gb: float
    global_batch: int
    notes: list[str] = field(default_factory=list)
    alternatives: list[Strategy] = field(default_factory=list)
    pipeline_degree: int | None = None
    bubble: float | None = None
    weights_shard_gb: float = 0.0  # one rank's share of all weights (what offload_params moves over PCIe)
    active_params: int = 0  # parameters one token runs through (MoE: its top-k experts; else all)
    live: dict[str, list[Item]] = field(default_factory=dict)  # per phase: what is live besides the model states

    @property
    def model_states_gb(self) -> float:
        return sum(i.gb for i in self.states)


def pipeline_bubble(p: int, m: int) -> float:
    """Idle share of a GPipe/1F1B pipeline of p stages running m micro-batches per step: (p-1)/(m+p-1)."""
    if p < 1 or m < 1:
        raise ValueError("pipeline degree and micro-batches must be >= 1")
    return (p - 1) / (m + p - 1)


def _norm_width(shape: Shape, w: Weight) -> int:
    """Elements per token a norm weight normalises: q/k norms (Qwen3, Gemma-3) run over every head."""
    return {"q_norm": shape.heads * shape.head_dim, "k_norm": shape.kv_heads * shape.head_dim}.get(w.leaf, shape.hidden)


def _moe_token_bytes(shape: Shape, layer: Layer, s: Setup) -> float:
    """Bytes per token a sparse MoE block saves for its backward (transformers 5: top-k router, then the experts'
    default grouped_mm path, which sorts the token copies by expert and runs each fused tensor as one grouped matmul)."""
    E, k, h, i, a, ae = layer.experts, layer.top_k, shape.hidden, shape.expert_intermediate, s.act_bytes, s.expert_bytes
    # router: the fp32 softmax output, the top-k indices (int64), the normalised top-k weights (fp32) and their sum
    router = 4 * E + 8 * k + 4 * k + 4
    # each of the k routed copies of a token, in the experts' weight dtype: the gathered input, the gate_up output
    # (2i), silu(gate), their product (down's input), the down output (kept for the routing-weight product); three
    # int64 index vectors (gather, routing-weight gather, un-permute) and its routing weight
    experts = k * (ae * (2 * h + 4 * i) + 3 * 8 + 4)
    shared = 0.0
    if layer.shared_intermediate:  # Qwen2-MoE: a dense MLP for every token, scaled by a sigmoid gate
        shared = 4 * a * layer.shared_intermediate + a * h + 2 * a
    return router + experts + shared


def _layer_activation_bytes(shape: Shape, layer: Layer, adapted: tuple, s: Setup, recipe: Recipe, seq: int, attn: str,
                            tokens: int) -> float:
    """Bytes autograd saves in one decoder layer for `tokens` tokens (transformers 5 layers, PEFT LoRA), for its backward."""
    q, kv, nh, a = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim, shape.heads, s.act_bytes
    full = not s.lora
    # RMSNorm computes in fp32: pow/mul save its fp32 input (a copy when activations are 16-bit); the output feeds
    # the projections; with a trainable weight the normalised tensor is saved too. Two per layer (Llama), four
    # (Gemma), plus q/k norms over each head (Qwen3, Gemma-3).
    norms = sum((4 + a + (a if full else 0)) * _norm_width(shape, w) for w in layer.weights if w.kind == "norm")
    # q and k after RoPE, v, the attention output + fp32 logsumexp (flash/sdpa kernels), o_proj's contiguous input
    attn_b = a * (q + 2 * kv) + a * q + 4 * nh + a * q
    if attn == "eager" or (attn == "sdpa" and recipe.trl_value("packing")):
        attn_b += a * 2 * (q - kv)  # a mask keeps sdpa off its GQA path: k and v repeated to every head
    if attn == "sft_varlen" and not (s.gpu and a == 2):  # per-sample sdpa (CPU, fp32): kv repeated to every head
        attn_b += a * (2 * (q - kv) + q)  # and gathered into padded groups, whose output is a copy too
    if attn == "eager":
        attn_b += nh * seq * (4 + a)  # the s x s scores: fp32 softmax output and its cast, per head
    # dense MLP: gate and up outputs, silu(gate), their product (down_proj's input); sparse: _moe_token_bytes
    mlp = _moe_token_bytes(shape, layer, s) if layer.experts else 4 * a * shape.intermediate
    lora, folded = 0.0, 0.0
    if s.lora:
        m = recipe.model
        # PEFT: result + lora_B(lora_A(dropout(x))): dropout makes a copy (+ a 1-byte mask) per adapted module; fp32
        # adapters under autocast (no DeepSpeed/FSDP bf16 cast) save their own 16-bit copy of the input
        cast = recipe.launch.backend in ("none", "ddp") and a == 2
        per_in = (a if (m.lora_dropout > 0 or cast) else 0) + (1 if m.lora_dropout > 0 else 0)
        for w, _ in adapted:
            if w.kind == "linear":
                lora += per_in * w.fan_in + a * m.lora_r
            else:  # peft's ParamWrapper folds W + s*BA into a full-size tensor each forward; the matmul saves it
                folded += w.numel * (s.expert_bytes if w.kind == "experts" else a)
    return tokens * (norms + attn_b + mlp + lora) + folded


def _backward_working_bytes(shape: Shape, layer: Layer, adapted: tuple, s: Setup, tokens: int) -> float:
    """Gradient tensors alive at once inside one layer's backward (MLP: d(product), d(silu), d(up); experts the same
    for each routed copy; an adapted expert tensor: the full-size gradient of its folded W + s*BA)."""
    a, h = s.act_bytes, shape.hidden
    if not layer.experts:
        return tokens * a * (3 * shape.intermediate + 2 * h)
    per_token = s.expert_bytes * layer.top_k * (3 * shape.expert_intermediate + 2 * h) + 3 * a * layer.shared_intermediate
    folded = max((w.numel for w, _ in adapted if w.kind == "experts"), default=0) * s.expert_bytes
    return tokens * per_token + folded


def _layer_lora_params(adapted: tuple, r: int) -> int:
    return sum(r * mult * w.matrices * (w.fan_in + w.fan_out) for w, mult in adapted)


def planned_attention(recipe: Recipe, shape: Shape, gpu: bool) -> str:
    """The attention kernel the run will use, as model.choose_attention decides it, without torch: flash_attention_2
    when asked for on a GPU (its package is assumed installed there), otherwise sft_varlen for packed batches, sdpa,
    or eager where the model has no sdpa path (Gemma-2). flex_attention and sft_varlen (torch's varlen flash kernel on
    a GPU) save what flash does (the output and its logsumexp)."""
    m = recipe.model
    want = "flash_attention_2" if m.use_flash_attn and m.attn_implementation == "auto" else m.attn_implementation
    if want == "flash_attention_2" and not gpu or want in ("auto", "sft_varlen"):
        if not shape.sdpa:
            return "eager"
        return "sft_varlen" if want == "sft_varlen" or recipe.trl_value("packing") or recipe.trl_value("padding_free") else "sdpa"
    return "flash_attention_2" if want == "flex_attention" else want


def plan_recipe(recipe: Recipe, pipeline_degree: int | None = None, _alternatives: bool = True) -> Plan:
    """Memory per GPU and per node for a recipe on its launch hardware, the verdict, and strategies that would fit."""
    shape = model_shape(recipe.model.model_name_or_path)
    s = setup(recipe)
    m, L = recipe.model, recipe.launch
    N, gpn = s.world, s.gpn
    notes: list[str] = []

    # --- weights: frozen + trainable, in the dtype each backend keeps them at rest
    lin = shape.linear_params  # what bitsandbytes quantizes: nn.Linear weights (not experts, router, embeddings, head)
    other = shape.params - lin
    adapted = shape.lora_targets(m.lora_target_modules, s.lora_router) if s.lora else tuple(() for _ in shape.decoder)
    trainable = sum(_layer_lora_params(ad, m.lora_r) for ad in adapted) if s.lora else shape.params
    float_b = 2 if s.deepspeed16 else s.load_bytes  # DeepSpeed bf16/fp16 casts the whole module
    if s.quant_bits < 16:
        qb = quant_bytes_per_param(recipe)
        frozen_b = lin * qb + (4 * shape.linear_rows if s.quant_bits == 8 else 0) + other * float_b
        wnote = (f"{lin / 1e9:.2f}B linear weights in {s.quant_bits}-bit ({qb:.4f} B/param incl. "
                 + ("absmax 8-bit/64 + fp32/256 nested" if m.use_nested_quant else "fp32 absmax/64" if s.quant_bits == 4 else "fp32 row scales")
                 + f", storage {m.bnb_4bit_quant_storage_dtype if s.quant_bits == 4 else 'int8'}) + {other / 1e9:.2f}B others in {float_b}-byte floats")
    else:
        frozen_b = (shape.params - (0 if s.lora else trainable)) * float_b
        wnote = f"{shape.params / 1e9:.2f}B params, {float_b} B/param"
    p_b = trainable_bytes(recipe, s)
    if s.lora:
        frozen_note = wnote
    else:
        frozen_b, frozen_note = 0.0, ""
    g_b = p_b
    optim = str(recipe.trl_value("optim"))
    o_b = 2 if "8bit" in optim else 2 * p_b  # Adam m, v like the parameter (8-bit optimizers: 1 byte each)
    if s.deepspeed16:
        o_b = (2 if "8bit" in optim else 8) + 4  # + the fp32 master partition DeepSpeed always keeps
    states = [
        Item("weights" + (" (frozen base)" if s.lora else ""), 0 if s.offload_params else frozen_b / s.shard_w / GB,
             (frozen_note or wnote) + (f", /{s.shard_w} ranks" if s.shard_w > 1 else "") + (" -> on CPU (offload)" if s.offload_params else "")),
        Item("trainable params", 0 if s.offload_params else trainable * p_b / s.shard_w / GB,
             f"{trainable / 1e6:.2f}M x {p_b} B" + (f" /{s.shard_w}" if s.shard_w > 1 else "")),
        Item("gradients", 0 if (s.offload_params and L.backend == "fsdp") else trainable * g_b / s.shard_g / GB,
             f"{g_b} B/param" + (f" /{s.shard_g}" if s.shard_g > 1 else "")),
        Item("optimizer states", 0 if s.offload_opt else trainable * o_b / s.shard_o / GB,
             f"{optim}: {o_b} B/param" + (" (m, v + fp32 master)" if s.deepspeed16 else " (m, v)")
             + (f" /{s.shard_o}" if s.shard_o > 1 else "") + (" -> on CPU (offload)" if s.offload_opt else "")),
    ]
    if s.lora:
        states[0].gb = 0 if s.offload_params else frozen_b / s.shard_w / GB
    else:
        states[0] = Item("weights", states[1].gb, states[1].note)
        states.pop(1)
    persistent = sum(i.gb for i in states) * GB
    grads_total = trainable * g_b / s.shard_g if not (s.offload_params and L.backend == "fsdp") else 0.0

    # --- activations
    b, seq = recipe.trl_value("per_device_train_batch_size"), recipe.trl_value("max_length") or shape.max_positions
    tokens = b * seq
    attn = planned_attention(recipe, shape, s.gpu)
    a = s.act_bytes
    ckpt = recipe.gradient_checkpointing
    h, V = shape.hidden, shape.vocab
    # per decoder layer (dense and sparse layers differ): saved tensors, backward temporaries, weight grads
    per_layer: dict = {}
    for layer, ad in zip(shape.decoder, adapted):
        if (layer, ad) not in per_layer:
            per_layer[layer, ad] = (_layer_activation_bytes(shape, layer, ad, s, recipe, seq, attn, tokens),
                                    _backward_working_bytes(shape, layer, ad, s, tokens))
    acts = [per_layer[k][0] for k in zip(shape.decoder, adapted)]
    wss = [per_layer[k][1] for k in zip(shape.decoder, adapted)]
    saved_all = shape.layers * tokens * a * h if ckpt else sum(acts)  # checkpointing keeps each layer's input only
    saved_first = tokens * a * h if ckpt else acts[0]
    shared = tokens * (2 * a * shape.head_dim + 16)  # RoPE cos/sin, input ids + labels (int64)
    if attn == "sdpa" and recipe.trl_value("packing"):
        shared += b * seq * seq  # block-diagonal boolean mask of the packed rows
    # final norm + the hidden states TRL's fused LM head saves (a copy: the shifted slice)
    head_saved = tokens * ((4 * h + a * h + (0 if s.lora else a * h)) + a * h)
    head_trainable = not s.lora
    # its backward: fp32 grad of the hidden states (+ its cast), fp32 grad of lm_head, the tile buffer (allocated
    # full width: 4096 tokens x 32768 vocab columns, whatever the vocab); without Triton (CPU) each tile is
    # processed with ~6 fp32 temporaries of the tile's used width
    rows = min(tokens, TRL_TOKEN_TILE)
    head_bwd = tokens * (4 * h + (a * h if a != 4 else 0) + a * h) + rows * TRL_VOCAB_TILE * a
    head_bwd += 0 if s.gpu else rows * min(V, TRL_VOCAB_TILE) * 6 * 4
    head_bwd += V * h * 4 if head_trainable else 0
    if s.quant_bits < 16:  # one weight de-quantized to 16-bit for its matmul
        deq = max(w.numel for L_ in shape.decoder for w in L_.weights if w.kind == "linear") * 2
        wss = [x + deq for x in wss]

    # ZeRO-3/FSDP: the layer being computed + the next one prefetched, in the gather dtype; DS gathers one layer
    # plus its prefetch bucket (0.9 h^2 elements, accelerate's 'auto'); lm_head gathered for the head
    gather_b = (frozen_b + trainable * p_b) / shape.params if s.lora else (2 if s.mixed16 else p_b)
    if s.lora and s.mixed16 and L.backend == "fsdp":
        gather_b = (frozen_b + trainable * 2) / shape.params  # FSDP mixed precision gathers in param_dtype
    layer_params = max(L_.params for L_ in shape.decoder)  # the largest layer (MoE: all its experts)
    layer_gather = layer_params * gather_b
    gathered = 0.0
    if s.gathers:
        prefetch = min(layer_params, 0.9 * h * h) * gather_b if L.backend == "deepspeed" else layer_gather
        gathered = layer_gather + prefetch
        if L.fsdp_sharding_strategy == "SHARD_GRAD_OP" and L.backend == "fsdp":
            gathered = shape.params * gather_b  # unsharded params stay from forward to backward
    head_gather = (shape.head_params or shape.embed_params) * gather_b if s.gathers else 0.0
    # gradient buckets: DDP keeps a flat copy of all grads (gradient_as_bucket_view off); DeepSpeed a reduce bucket of
    # h^2 elements; FSDP the unsharded grads of the current layer before its reduce-scatter
    layer_trainable = max(_layer_lora_params(ad, m.lora_r) for ad in adapted) if s.lora else layer_params
    bucket = {"ddp": trainable * g_b if N > 1 else 0.0, "deepspeed": min(trainable, h * h) * 2 if s.mixed16 else min(trainable, h * h) * 4,
              "fsdp": layer_trainable * (2 if s.mixed16 else g_b)}.get(L.backend, 0.0)
    ga = recipe.trl_value("gradient_accumulation_steps")
    # grads outlive the step's backward only with accumulation (zero_grad(set_to_none) after each step), or when
    # DeepSpeed allocates its partitioned grad buffer up front
    grads_always = L.backend == "deepspeed" or ga > 1
    if s.lora:
        g_layers = [_layer_lora_params(ad, m.lora_r) * g_b / s.shard_g if grads_total else 0.0 for ad in adapted]
    else:
        g_layers = [layer.params * g_b / s.shard_g for layer in shape.decoder]
    # full fine-tuning: lm_head's grad comes first in backward, the embedding's last (after the first layer's)
    g_embed = 0 if s.lora else shape.embed_params * g_b / s.shard_g
    g_head = grads_total - sum(g_layers) - g_embed
    Lr = shape.layers
    # optimizer step temporaries: fused AdamW (TRL's default adamw_torch_fused), DeepSpeed's and bitsandbytes' Adam
    # work in place; torch's foreach AdamW (GPU) allocates a copy of the states' shard, its single-tensor path (CPU)
    # one parameter's worth
    fused = L.backend == "deepspeed" or "fused" in optim or "8bit" in optim
    opt_tmp = 0.0 if fused else (trainable * p_b / s.shard_o if s.gpu else _largest_param(shape, recipe, adapted) * p_b)
    # DeepSpeed's ZeRO optimizers step the fp32 master on an fp32 copy of the 16-bit gradient partition, made for one
    # param group (ZeRO-1/2: stage_1_and_2.step) or one sub-group of at most sub_group_size elements (ZeRO-3:
    # stage3._prepare_fp32_grad_for_sub_group) at a time and freed after its step. DeepSpeed's own estimator counts it
    # as resident (its 18 B/param); it lives only in the step (tests/test_plan_vs_deepspeed.py).
    fp32_step = 0.0
    if s.deepspeed16 and L.zero_stage >= 1 and not s.offload_opt:
        part = trainable / s.shard_o
        fp32_step = 4 * (min(part, DS_SUB_GROUP_SIZE) if L.zero_stage == 3 else part)
    # what is live, besides the resident states, at each phase of a step
    acts_note = (f"{b} x {seq} tokens, {Lr} layers, h {h}, {attn}, "
                 + ("checkpointed: each layer's input kept, one layer recomputed in backward" if ckpt else "every layer's saved tensors"))
    # inside one layer's backward its weight grads appear module by module as its saved tensors are released: count
    # the larger of the two (they overlap little), the grads of the layers below not yet; the largest layer counts
    in_layers = [max((acts[j] if ckpt else 0) + wss[j], g_layers[j] - (0 if ckpt else acts[j])) for j in range(Lr)]
    big = max(range(Lr), key=in_layers.__getitem__)
    in_layer, g_layer = in_layers[big], g_layers[big]
    layer_note = (f"{acts[big] / tokens / 1e3:.1f} kB/token saved + {wss[big] / tokens / 1e3:.1f} kB/token grad temporaries"
                  + (f" (layer {big}, {shape.decoder[big].experts} experts)" if shape.decoder[big].experts else ""))
    buckets = ("gradient buckets", bucket, {"ddp": "DDP flat buckets", "deepspeed": "reduce bucket", "fsdp": "one layer before reduce-scatter"}.get(L.backend, ""))
    def not_yet(present: float) -> tuple:  # grads are freed after each step (zero_grad(set_to_none)) unless accumulating
        return ("gradients not yet produced", 0 if grads_always else present - grads_total, "set_to_none after each step")
    one_layer = ("one layer in backward", in_layer, ("recomputed: " if ckpt else "grad temporaries; ") + layer_note
                 + (f"; or its weight grads, {g_layer / GB:.2f} GB, if larger" if not s.lora else ""))
    gath = ("gathered params (ZeRO-3/FSDP)", gathered, "current layer + prefetch")
    live = {
        "start of backward (LM head)": [
            ("activations", shared + saved_all, acts_note),
            ("LM head (TRL chunked log-probs)", head_saved + head_bwd,
             f"no [tokens, vocab] logits: a {rows} x {TRL_VOCAB_TILE} tile buffer + fp32 grads"),
            ("gathered lm_head", head_gather, ""), not_yet(0), buckets],
        "backward, last layer": [
            ("activations", shared + saved_all, acts_note), one_layer, gath,
            not_yet(g_head), buckets],
        "backward, first layer": [
            ("activations", shared + saved_first, "first layer's only"), one_layer, gath,
            not_yet(grads_total - g_embed - g_layers[0]), buckets],
        "optimizer step": [("optimizer step temporaries", opt_tmp,
                           "in place" if fused else "foreach AdamW" if s.gpu else "single-tensor AdamW"),
                           ("fp32 gradient partition (DeepSpeed step)", fp32_step,
                            "4 B/param" + (f" /{s.shard_o}" if s.shard_o > 1 else "")
                            + (f", one sub-group of <= {DS_SUB_GROUP_SIZE / 1e9:g}B elements at a time" if L.zero_stage == 3 else ""))],
    }
    resident = persistent
    phases = {k: (resident + sum(x[1] for x in v)) / GB for k, v in live.items()}
    load_gb = 0.0
    if s.quant_bits == 4 and L.backend == "deepspeed" and L.zero_stage == 3:
        # bitsandbytes weights cannot be created inside zero.Init: every rank loads the whole 4-bit model first
        load_gb = (lin * quant_bytes_per_param(recipe) + other * float_b) / GB
        phases["loading (whole 4-bit model per GPU)"] = load_gb
        live["loading (whole 4-bit model per GPU)"] = [("whole 4-bit model (replaces the shards above)", load_gb * GB - resident, "")]
        notes.append("QLoRA + ZeRO-3: DeepSpeed cannot partition 4-bit weights while loading; each GPU holds the whole "
                     f"4-bit model ({load_gb:.1f} GB) until the engine partitions it")
    peak_phase = max(phases, key=phases.get)
    tensor_peak = phases[peak_phase]
    churn = tensor_peak - resident / GB if not peak_phase.startswith("loading") else 0.0
    allowance = (CUDA_CONTEXT_GB + FRAGMENTATION * max(churn, 0.0)) if s.gpu else 0.0
    total = tensor_peak + allowance
    peak_items = [Item(n, v / GB, note) for n, v, note in live[peak_phase] if v != 0]
    # --- CPU RAM per node
    cpu = [Item("processes", gpn * PROCESS_CPU_GB, f"{gpn} ranks x {PROCESS_CPU_GB:.0f} GB (python, torch, CUDA libs)")]
    load_float_b = s.load_bytes
    full_model = shape.params * load_float_b
    if L.backend == "fsdp" and L.fsdp_cpu_ram_efficient_loading:
        cpu.append(Item("loading", full_model / GB, "fsdp_cpu_ram_efficient_loading: only local rank 0 reads the weights"))
    elif (L.backend == "deepspeed" and L.zero_stage == 3 and L.zero3_init) or s.quant_bits < 16:
        cpu.append(Item("loading", gpn * min(full_model, CKPT_SHARD_GB * GB) / GB,
                        "weights stream shard by shard into " + ("zero.Init partitions" if s.quant_bits == 16 else "quantized GPU tensors")))
    else:
        cpu.append(Item("loading", gpn * full_model / GB, f"every rank loads the whole model ({full_model / GB:.0f} GB in {load_float_b}-byte floats)"))
    off = 0.0
    if s.offload_opt:
        off += trainable * (12 if s.deepspeed16 else o_b + (0 if L.backend == "fsdp" else 4)) / s.shard_o
    if s.offload_params:
        off += (frozen_b + trainable * p_b) / s.shard_w + (trainable * g_b / s.shard_g if L.backend == "fsdp" else 0)
    if off:
        cpu.append(Item("offloaded states", gpn * off / GB, "per rank x ranks on the node (pinned)"))
    if L.backend == "fsdp" and L.fsdp_state_dict_type == "FULL_STATE_DICT":
        cpu.append(Item("FULL_STATE_DICT save on rank 0", shape.params * (4 if not s.lora else load_float_b) / GB,
                        "the whole model gathered on rank 0's CPU"))
    # loading and training do not overlap: the node peak is processes + max(loading, offload + saving)
    cpu_total = cpu[0].gb + max(cpu[1].gb, sum(i.gb for i in cpu[2:]))

    # --- communication per GPU per optimizer step
    comm, comm_gb = _communication(recipe, shape, s, trainable * (2 if s.mixed16 else g_b), shape.params * gather_b, ga)

    limit = L.gpu_memory_gb
    fits = None if limit is None else total <= limit
    cpu_limit = L.cpu_ram_gb
    cpu_fits = None if cpu_limit is None else cpu_total <= cpu_limit
    if limit is None:
        notes.append("launch.gpu_memory_gb is not set: this is the requirement only (set it, e.g. 80, for a verdict)")
    plan = Plan(shape.name, shape.params, trainable, N, gpn, L.num_machines, _backend_name(recipe), states, peak_items,
                peak_phase, phases, tensor_peak, allowance, total, limit, fits, cpu, cpu_total, cpu_limit, cpu_fits,
                comm, comm_gb, recipe.trl_value("per_device_train_batch_size") * ga * N, notes)
    plan.weights_shard_gb = (frozen_b + trainable * p_b) / s.shard_w / GB
    plan.live = {k: [Item(n, v / GB, note) for n, v, note in items if v != 0] for k, items in live.items()}
    plan.active_params = shape.active_params
    if shape.moe:
        notes += _moe_notes(shape, s, adapted, float_b, m.lora_target_modules)
    if pipeline_degree:
        plan.pipeline_degree, plan.bubble = pipeline_degree, pipeline_bubble(pipeline_degree, ga)
        notes.append(f"pipeline: {pipeline_degree} stages x {ga} micro-batches -> bubble {plan.bubble:.0%} idle "
                     "(memory above is for the whole layer stack; a stage holds 1/p of the layers)")
    if _alternatives and limit is not None:  # without a memory size there is nothing to fit
        plan.alternatives = alternatives(recipe, plan)
    return plan


def _moe_notes(shape: Shape, s: Setup, adapted: tuple, float_b: int, targets: str) -> list[str]:
    sparse = sum(1 for layer in shape.decoder if layer.experts)
    out = [f"MoE: {sparse} of {shape.layers} layers route each token to {shape.top_k} of {shape.experts} experts: weights, "
           f"gradients and optimizer states hold all {shape.params / 1e9:.2f}B parameters, activations the {shape.top_k} "
           f"routed copies of each token ({shape.active_params / 1e9:.2f}B parameters active per token); no expert "
           f"parallelism, so " + ("a gathered layer brings all its experts" if s.gathers else "every rank holds every expert")]
    if s.quant_bits < 16:
        out.append(f"{s.quant_bits}-bit quantization covers nn.Linear weights only: the {shape.expert_params / 1e9:.2f}B "
                   f"expert weights and the routers stay in {float_b}-byte floats")
    if any(w.kind == "experts" for ad in adapted for w, _ in ad):
        out.append("LoRA on fused experts (peft ParamWrapper): each forward folds W + s*BA into a full-size copy of every "
                   "adapted expert tensor, kept for backward (in the layer's activations) and matched by a full-size "
                   "gradient in backward")
    if s.lora and targets.strip() == "all-linear":
        routed = any(w.kind == "router" for ad in adapted for w, _ in ad)
        out.append("router (mlp.gate): " + ("adapted (lora_target_router: true)" if routed else
                                            "not adapted (lora_target_router: false)"))
    return out


def _largest_param(shape: Shape, recipe: Recipe, adapted: tuple) -> int:
    """Elements of the largest trainable tensor (a LoRA matrix: r x the wider side, times the experts of a fused one)."""
    if recipe.model.use_peft_lora:
        r = recipe.model.lora_r
        return max((r * mult * w.matrices * max(w.fan_in, w.fan_out) for ad in adapted for w, mult in ad), default=0)
    return shape.largest_weight


def _backend_name(recipe: Recipe) -> str:
    L = recipe.launch
    if L.backend == "deepspeed":
        off = [k for k in ("offload_optimizer", "offload_params") if getattr(L, k)]
        return f"DeepSpeed ZeRO-{L.zero_stage}" + (f" + {', '.join(off)}" if off else "")
    if L.backend == "fsdp":
        return f"FSDP{L.fsdp_version} {L.fsdp_sharding_strategy}" + (" + offload_params" if L.fsdp_offload_params else "")
    return {"ddp": "DDP", "none": "single process"}[L.backend]


def _communication(recipe: Recipe, shape: Shape, s: Setup, T_grad: float, T_all: float, ga: int):
    """Bytes each GPU sends per optimizer step: ring all-reduce 2T(N-1)/N, all-gather / reduce-scatter T(N-1)/N each."""
    L, N = recipe.launch, s.world
    f = (N - 1) / N if N > 1 else 0.0
    items: list[Item] = []
    if L.backend == "ddp" or (L.backend == "deepspeed" and L.zero_stage == 0) or (L.backend == "fsdp" and L.fsdp_sharding_strategy == "NO_SHARD"):
        items.append(Item("grad all-reduce", 2 * T_grad * f / GB, "once per step (no_sync while accumulating)"))
    elif L.backend == "deepspeed" and L.zero_stage in (1, 2):
        k = ga if L.zero_stage == 2 else 1
        items.append(Item("grad reduce-scatter", k * T_grad * f / GB, "every micro-batch (ZeRO-2)" if k > 1 else "once per step"))
        items.append(Item("updated-param all-gather", T_grad * f / GB, "trainable params after the step"))
    elif s.gathers:
        # forward + backward (a checkpointed layer is recomputed inside its backward gather)
        gathers = 1 if (L.backend == "fsdp" and L.fsdp_sharding_strategy == "SHARD_GRAD_OP") else 2
        items.append(Item("param all-gather", ga * gathers * T_all * f / GB,
                          f"{gathers}x per micro-batch, per layer {T_all / shape.layers * f / 1e6:.0f} MB"))
        items.append(Item("grad reduce-scatter", ga * T_grad * f / GB, f"per micro-batch, per layer {T_grad / shape.layers * f / 1e6:.1f} MB"))
    return items, sum(i.gb for i in items)


# ----------------------------------------------------------------------------------------------- alternatives


def _variant(recipe: Recipe, **changes) -> Recipe:
    r = copy.deepcopy(recipe)
    for k, v in changes.items():
        section, _, name = k.rpartition(".")
        if section:
            setattr(getattr(r, section), name, v)
        elif k in ("use_4bit_quantization", "use_nested_quant", "bnb_4bit_quant_storage_dtype", "bnb_4bit_compute_dtype"):
            setattr(r.model, k, v)
        else:
            r.trl[k] = v
    return r


def alternatives(recipe: Recipe, plan: Plan) -> list[Strategy]:
    """Strategies for the same model and batch, each planned by plan_recipe, ranked: fitting first, then by the time
    their network and host<->device traffic takes at the assumed bandwidths (compute per GPU is the same)."""
    L, N = recipe.launch, plan.world
    ds = {"launch.backend": "deepspeed", "launch.offload_optimizer": False, "launch.offload_params": False}
    fs = {"launch.backend": "fsdp", "launch.fsdp_offload_params": False}
    cands: list[tuple[str, dict]] = []
    if N > 1:
        cands += [("DDP", {"launch.backend": "ddp"}),
                  *[(f"ZeRO-{z}", {**ds, "launch.zero_stage": z}) for z in (1, 2, 3)],
                  ("FSDP FULL_SHARD", {**fs, "launch.fsdp_sharding_strategy": "FULL_SHARD"}),
                  ("FSDP SHARD_GRAD_OP", {**fs, "launch.fsdp_sharding_strategy": "SHARD_GRAD_OP"})]
    cands += [("ZeRO-3 + offload optimizer", {**ds, "launch.zero_stage": 3, "launch.offload_optimizer": True}),
              ("ZeRO-3 + offload optimizer + params", {**ds, "launch.zero_stage": 3, "launch.offload_optimizer": True, "launch.offload_params": True})]
    for mult in (2, 4):
        more = {"launch.num_machines": L.num_machines * mult} if L.num_machines > 1 or L.gpus_per_node >= 8 else {"launch.gpus_per_node": L.gpus_per_node * mult}
        cands += [(f"ZeRO-3 on {N * mult} GPUs", {**ds, "launch.zero_stage": 3, **more}),
                  (f"FSDP FULL_SHARD on {N * mult} GPUs", {**fs, "launch.fsdp_sharding_strategy": "FULL_SHARD", **more})]
    if recipe.model.use_peft_lora and not recipe.model.use_4bit_quantization:
        cands.append(("QLoRA (4-bit nf4 base, nested quant)*", {"use_4bit_quantization": True, "use_nested_quant": True,
                      "bnb_4bit_quant_storage_dtype": "bfloat16", "bnb_4bit_compute_dtype": "bfloat16"}))
    seq = recipe.trl_value("max_length")
    if seq and seq >= 256:
        cands.append((f"max_length {seq // 2}*", {"max_length": seq // 2}))
    out = []
    for name, changes in cands:
        r = _variant(recipe, **changes)
        if r.launch.backend != "deepspeed":
            r.launch.offload_optimizer = r.launch.offload_params = False
        p = plan_recipe(r, _alternatives=False)
        s = setup(r)
        pcie = 0.0
        if s.offload_opt:  # grads down, updated params up, once per step
            pcie += p.trainable * (2 + 2) / s.shard_o / GB
        if s.offload_params:  # every gather fetches the shard from host memory
            pcie += recipe.trl_value("gradient_accumulation_steps") * 2 * p.weights_shard_gb
        bw = NVLINK if r.launch.num_machines == 1 else INFINIBAND
        secs = p.comm_gb * GB / bw + pcie * GB / PCIE
        out.append(Strategy(name, p.world, p.gpu_total_gb, p.fits, p.comm_gb, pcie, secs, p.cpu_total_gb,
                            "" if p.cpu_fits in (None, True) else "needs more CPU RAM than launch.cpu_ram_gb"))
    # * changes what is trained (quantized base, shorter context): after the strategies that train the same thing
    out.sort(key=lambda x: (x.fits is False, x.note != "", x.name.endswith("*"), x.seconds, x.gpus))
    return out


# ----------------------------------------------------------------------------------------------- pitfalls


def pitfalls(recipe: Recipe) -> list[str]:
    """Configuration traps this recipe walks into (plus the global batch, always). Each line says what to do."""
    m, L = recipe.model, recipe.launch
    world = L.world_size
    pdb, ga = recipe.trl_value("per_device_train_batch_size"), recipe.trl_value("gradient_accumulation_steps")
    lr = recipe.trl_value("learning_rate")
    out = [f"global batch = {pdb} per device x {ga} accumulation x {world} ranks = {pdb * ga * world} sequences per step"]
    for base_file in recipe.sources[:-1]:
        try:
            base = load_recipe([base_file])
        except RecipeError:
            continue  # a partial base (e.g. recipes/tiny/base.yaml) is not a run of its own
        bworld = base.launch.world_size
        bbatch = base.trl_value("per_device_train_batch_size") * base.trl_value("gradient_accumulation_steps") * bworld
        if bworld != world and base.trl_value("learning_rate") == lr and bbatch != pdb * ga * world:
            out.append(f"WARNING learning_rate {lr:g} is kept from {base_file} (world {bworld}, global batch {bbatch}) but this "
                       f"recipe runs {world} ranks (global batch {pdb * ga * world}): scale learning_rate (linear or sqrt) "
                       f"or set gradient_accumulation_steps to keep the global batch")
    if world > 1:
        seeded = recipe.trl.get("data_seed", recipe.trl_value("seed"))
        acc = recipe.trl_value("accelerator_config") or {}
        if isinstance(acc, dict) and acc.get("use_seedable_sampler") is False:
            out.append("WARNING accelerator_config.use_seedable_sampler: false: each rank's sampler draws from its own torch RNG, so "
                       "ranks only agree on the permutation while every rank seeds alike; remove it (keep one seed on all ranks)")
        else:
            out.append(f"data order: every rank draws the same permutation (seed {seeded}, data_seed or seed) and takes its "
                       "own shard of it (accelerate's SeedableRandomSampler + BatchSamplerShard); do not seed per rank")
        if recipe.trl_value("average_tokens_across_devices") is False:
            out.append("WARNING average_tokens_across_devices: false with several ranks: each rank divides its loss by its own "
                       "token count (num_items_in_batch), so ranks with fewer tokens weigh more; set it true")
    if L.backend == "ddp" and recipe.gradient_checkpointing and m.use_reentrant and recipe.trl_value("ddp_find_unused_parameters") is not False:
        out.append("WARNING use_reentrant: true under DDP with gradient checkpointing: Trainer sets find_unused_parameters=True "
                   "for a PEFT model and reentrant checkpointing then marks parameters ready twice ('Expected to mark a "
                   "variable ready only once'); set use_reentrant: false (or ddp_find_unused_parameters: false)")
    if m.use_4bit_quantization and L.backend in ("fsdp", "deepspeed"):
        compute = mixed_dtype(recipe) or "float32"
        dtype = load_dtype(recipe)
        if m.bnb_4bit_quant_storage_dtype != compute or (m.dtype != "auto" and m.dtype != m.bnb_4bit_quant_storage_dtype):
            out.append(f"WARNING bnb_4bit_quant_storage_dtype {m.bnb_4bit_quant_storage_dtype} differs from the model/mixed-precision "
                       f"dtype ({dtype}, {compute}): {L.backend} flattens all weights of a unit into one dtype; "
                       f"set bnb_4bit_quant_storage_dtype: {compute}")
    if L.backend == "fsdp" and L.fsdp_state_dict_type == "FULL_STATE_DICT":
        shape = model_shape(m.model_name_or_path)
        need = shape.params * (load_bytes(recipe) if m.use_peft_lora else trainable_bytes(recipe, setup(recipe))) / GB
        if L.cpu_ram_gb is None or need + PROCESS_CPU_GB * L.gpus_per_node > L.cpu_ram_gb:
            have = "launch.cpu_ram_gb is not set" if L.cpu_ram_gb is None else f"rank 0's node has {L.cpu_ram_gb:g} GB"
            out.append(f"WARNING fsdp_state_dict_type FULL_STATE_DICT gathers the whole model ({need:.0f} GB) on rank 0's CPU and "
                       f"{have}; use SHARDED_STATE_DICT for checkpoints")
    return out


# ----------------------------------------------------------------------------------------------- output


def format_plan(plan: Plan, warnings: list[str] | None = None) -> str:
    w = 44
    line = lambda i: f"  {i.name:<{w}} {i.gb:8.2f} GB  {i.note}"  # noqa: E731
    active = f" ({plan.active_params / 1e9:.2f}B active per token)" if plan.active_params not in (0, plan.params) else ""
    out = [f"{plan.model}: {plan.params / 1e9:.2f}B params{active}, {plan.trainable / 1e6:.2f}M trainable; {plan.backend} on "
           f"{plan.nodes} node(s) x {plan.gpus_per_node} GPU(s) = {plan.world}; global batch {plan.global_batch}",
           "", "Per GPU — model states (always resident):"]
    out += [line(i) for i in plan.states]
    out += [f"  {'= model states':<{w}} {plan.model_states_gb:8.2f} GB", "", f"Per GPU — also live at the peak ({plan.peak_phase}):"]
    out += [line(i) for i in plan.peak if i.gb > 0]
    out += ["", "Per GPU — tensors at each phase of a step:"]
    out += [f"  {k:<{w}} {v:8.2f} GB" for k, v in plan.phases.items()]
    out += [f"  {'runtime allowance':<{w}} {plan.allowance_gb:8.2f} GB  CUDA context/workspaces {CUDA_CONTEXT_GB:g} GB + "
            f"{FRAGMENTATION:.0%} of the non-resident peak for allocator fragmentation",
            f"  {'= required per GPU':<{w}} {plan.gpu_total_gb:8.2f} GB"]
    out += ["", "Per node — CPU RAM:"] + [line(i) for i in plan.cpu] + [f"  {'= peak per node':<{w}} {plan.cpu_total_gb:8.2f} GB"]
    if plan.comm:
        out += ["", "Communication per GPU per optimizer step:"] + [line(i) for i in plan.comm]
    out += [""] + [f"note: {n}" for n in plan.notes] + [w_ for w_ in (warnings or [])]
    if plan.fits is None:
        verdict = f"VERDICT: needs {plan.gpu_total_gb:.1f} GB per GPU (no launch.gpu_memory_gb to compare with)"
    else:
        verdict = (f"VERDICT: {'fits' if plan.fits else 'DOES NOT FIT'}: {plan.gpu_total_gb:.1f} GB of "
                   f"{plan.gpu_limit_gb:g} GB per GPU")
    if plan.cpu_fits is not None:
        verdict += f"; CPU RAM {plan.cpu_total_gb:.0f} of {plan.cpu_limit_gb:g} GB per node {'fits' if plan.cpu_fits else 'DOES NOT FIT'}"
    out += ["", verdict]
    if plan.alternatives:
        out += ["", "Strategies (fitting first; same model before * (changes what is trained); then by network + PCIe time "
                f"per step at {NVLINK / 1e9:.0f} GB/s in a node, {INFINIBAND / 1e9:.0f} GB/s across nodes, {PCIE / 1e9:.0f} GB/s PCIe):",
                f"  {'strategy':<38} {'GPUs':>4} {'GB/GPU':>7} {'fits':>5} {'net GB':>7} {'PCIe GB':>7} {'~s/step':>7}"]
        for a in plan.alternatives:
            fits = "?" if a.fits is None else "yes" if a.fits else "no"
            out.append(f"  {a.name:<38} {a.gpus:>4} {a.gpu_gb:7.1f} {fits:>5} {a.comm_gb:7.1f} {a.pcie_gb:7.1f} {a.seconds:7.2f} {a.note}")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    """`plan RECIPE.yaml [--key value ...]`: print the plan; exit 0 when it fits (or no GPU memory is given), 2 when not."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        from .preflight import memory_verdict  # noqa: PLC0415 - preflight imports plan

        recipe = load_recipe(argv)
        ok, text = memory_verdict(recipe)
    except RecipeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(text)
    if not ok:
        L = recipe.launch
        print(f"error: launch.gpu_memory_gb: the plan above does not fit {L.gpu_memory_gb:g} GB per GPU"
              + (f" or {L.cpu_ram_gb:g} GB of CPU RAM per node" if L.cpu_ram_gb else "")
              + "; pick a strategy from its table", file=sys.stderr)
        return 2
    return 0

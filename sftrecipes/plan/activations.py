"""Bytes autograd keeps for the backward of one training step, counted from the model's shape (torch-free): the
tensors each decoder layer and TRL's LM head save, and the temporaries their backward allocates.

The counts follow the tensors saved by transformers 5's decoder layers (a sparse MoE block: its router and the k routed
copies of each token), PEFT's LoRA layer (and its fold of W + s*BA on fused expert tensors) and TRL's chunked LM head
(so there are no [tokens, vocab] logits); docs/planner.md explains each term and tests/plan/test_plan.py calibrates them
against the live-tensor peak of real CPU steps. The preference methods run the same fused head (DPOTrainer and
KTOTrainer install it as SFTTrainer does), on their own batches: DPO's chosen and rejected sequences concatenated,
KTO's completions (`sequences`); their forwards without grad (the reference, KTO's KL batch) hold one layer's tensors
at a time (`no_grad_forward`), tests/plan/test_plan_methods.py calibrates them. ORPO and CPO (TRL's experimental trainers)
run no fused head: their [tokens, vocab] logits are kept (`_logits_head`), calibrated there too.
"""

from __future__ import annotations

from dataclasses import dataclass

from sftrecipes.facts.shape import Layer, Shape, Weight
from sftrecipes.plan.seqsplit import Split, exchange_working, kv_heads, rank_tokens, split
from sftrecipes.plan.sharding import Setup
from sftrecipes.recipe.schema import PAIRED, REFERENCE_FREE
from sftrecipes.recipe.target import checkpointing_off, requested_attention
from sftrecipes.recipe.typed import Recipe

TRL_TOKEN_TILE, TRL_VOCAB_TILE = 4096, 32768  # trl.kernels.chunked_logprob tile of the fused LM head
PAGE = 4096  # bytes of a page of anonymous memory (the cpu target's RSS counts pages written, not bytes allocated)


def planned_attention(recipe: Recipe, shape: Shape, gpu: bool) -> str:
    """The attention kernel the run will use, as model/attnchoice.choose_attention decides it from the same request
    (target.requested_attention), without torch: flash_attention_2 when asked for on a GPU (its package is assumed
    installed there), otherwise sft_varlen for packed batches, sdpa, or eager where the model has no sdpa path
    (Gemma-2). flex_attention and sft_varlen (torch's varlen flash kernel on
    a GPU) save what flash does (the output and its logsumexp)."""
    want = requested_attention(recipe)
    if want == "flash_attention_2" and not gpu or want in ("auto", "sft_varlen"):
        if not shape.sdpa:
            return "eager"
        return "sft_varlen" if want == "sft_varlen" or packs(recipe, shape) else "sdpa"
    return "flash_attention_2" if want == "flex_attention" else want


def packs(recipe: Recipe, shape: Shape) -> bool:
    """Whether the batches reach the model packed (shape.packs): SFT's only. DPOTrainer 1.16 turns padding_free off
    ("temporarily unavailable"), KTOTrainer has none: preference batches are padded rows."""
    return recipe.method == "sft" and shape.packs(recipe)


def sequences(recipe: Recipe) -> int:
    """Sequences per micro-batch whose activations are kept for backward: DPO concatenates each pair's chosen and
    rejected sequences into one forward (2 x per_device_train_batch_size, each prompt + completion, padded to the
    longest of the batch, at most max_length); KTO runs its completions with grad (its KL batch without); SFT its rows."""
    return recipe.trl_value("per_device_train_batch_size") * (2 if recipe.method in PAIRED else 1)


def layer_lora_params(adapted: tuple, r: int) -> int:
    """LoRA parameters of one decoder layer: r x (in + out) per adapted matrix (`adapted`: shape.lora_targets' entry)."""
    return sum(r * mult * w.matrices * (w.fan_in + w.fan_out) for w, mult in adapted)


@dataclass(frozen=True)
class Activations:
    """What one micro-batch keeps for backward and allocates in it, in bytes per GPU (per layer: lists over layers)."""

    batch: int  # sequences per micro-batch
    seq: int  # tokens per sequence
    tokens: int  # tokens of the micro-batch one rank holds (its 1/N of every row under a sequence split)
    attn: str  # the planned attention kernel
    per_layer: list[float]  # tensors each decoder layer saves
    working: list[float]  # temporaries inside each layer's backward (+ a de-quantized weight)
    saved_all: float  # every layer's saved tensors (checkpointing: each layer's input only)
    saved_first: float  # the first layer's (what is left when backward reaches it)
    shared: float  # RoPE cos/sin, ids and labels, a packed sdpa mask
    head_saved: float  # final norm + the hidden states TRL's LM head saves
    head_backward: float  # the LM head's backward: fp32 grads, its tile buffer (+ lm_head's grad when trained)
    head_rows: int  # tokens per tile of TRL's LM head
    no_grad: float = 0.0  # one forward of the same batch without grad (a reference forward): what it holds at once
    full_logits: bool = False  # the head returns [tokens, vocab] logits (orpo, cpo), not TRL's chunked log-probs
    split: Split = Split()  # sequence / context parallelism: over how many ranks each row is split (seqsplit.py)
    tile_unwritten: float = 0.0  # of the LM head's tile buffer, the bytes a vocab narrower than it never writes (tile_unwritten)


def activations(recipe: Recipe, shape: Shape, s: Setup, adapted: tuple, seq: int | None = None) -> Activations:
    """The activation bytes of one micro-batch of the recipe (`adapted`: the LoRA targets of each decoder layer; `seq`:
    tokens per sequence where the recipe's max_length does not say it: an online run's prompt + completion)."""
    b, seq = sequences(recipe), seq or recipe.trl_value("max_length") or shape.max_positions
    sp = split(recipe)
    tokens = rank_tokens(b * seq, sp)  # every per-token term below counts the rank's share of the rows
    attn = planned_attention(recipe, shape, s.gpu)
    a = s.act_bytes
    ckpt = recipe.gradient_checkpointing and not checkpointing_off(recipe, shape)  # (where it cannot: the run goes without)
    h, V = shape.hidden, shape.vocab
    # per decoder layer (dense and sparse layers differ): saved tensors, backward temporaries
    per_layer: dict = {}
    for layer, ad in zip(shape.decoder, adapted):
        if (layer, ad) not in per_layer:
            per_layer[layer, ad] = (_layer_activation_bytes(shape, layer, ad, s, recipe, seq, attn, tokens, sp),
                                    max(_backward_working_bytes(shape, layer, ad, s, tokens),
                                        exchange_working(layer, s.act_bytes, tokens, sp)))
    acts = [per_layer[k][0] for k in zip(shape.decoder, adapted)]
    wss = [per_layer[k][1] for k in zip(shape.decoder, adapted)]
    saved_all = shape.layers * tokens * a * h if ckpt else sum(acts)  # checkpointing keeps each layer's input only
    saved_first = tokens * a * h if ckpt else acts[0]
    # RoPE cos/sin (one pair per head size: Gemma-4's full and sliding layers differ), input ids + labels (int64)
    shared = tokens * (2 * a * sum({L.head_dim for L in shape.decoder}) + 16)
    if recipe.method != "sft":
        shared += tokens * 16  # the preference collators' attention and completion masks (int64)
    if sp.on:  # the adapter's shift_labels and the position_ids the attention layers gather (int64)
        shared += tokens * 16
    elif attn == "sdpa" and (packs(recipe, shape) or _padded(recipe)):  # (a split drops the mask: causal sdpa)
        shared += b * seq * seq  # boolean mask: block-diagonal for packed rows, causal + padding for padded ones
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
    if full_logits(recipe):
        head_saved, head_bwd = _logits_head(tokens, h, V, a, head_trainable)
    if s.quant_bits < 16:  # one weight de-quantized to 16-bit for its matmul
        deq = max(w.numel for L_ in shape.decoder for w in L_.weights if w.kind == "linear") * 2
        wss = [x + deq for x in wss]
    no_grad = no_grad_forward(shape, s, acts, tokens, rows)
    return Activations(b, seq, tokens, attn, acts, wss, saved_all, saved_first, shared, head_saved, head_bwd, rows, no_grad,
                       full_logits(recipe), sp, 0.0 if full_logits(recipe) else tile_unwritten(rows, V, a))


def tile_unwritten(rows: int, vocab: int, a: int) -> float:
    """Bytes of TRL's tile buffer ([rows, 32768] in the compute dtype, torch.empty) that a vocabulary narrower than
    the tile never writes: each row's first vocab x a bytes are written, so only their pages become resident. A GPU
    holds the whole buffer (the planner counts it); on the cpu target, where the plan is held against each rank's RSS,
    the pages never written are not there (ranks.rank_steps takes them off)."""
    row = TRL_VOCAB_TILE * a
    written = min(row, -(-min(vocab, TRL_VOCAB_TILE) * a // PAGE) * PAGE)
    return float(rows * (row - written))


def full_logits(recipe: Recipe) -> bool:
    """ORPOTrainer and CPOTrainer (TRL's experimental ones) install no fused LM head: the model returns its
    [tokens, vocab] logits and their losses are computed from them."""
    return recipe.method in REFERENCE_FREE


def _logits_head(tokens: int, h: int, V: int, a: int, trainable: bool) -> tuple[float, float]:
    """(saved, backward's peak beyond it) of the LM head of orpo and cpo, in L = one [tokens, vocab] logits tensor in
    the act dtype. Saved: the logits (the log-sum-exp of the per-token log-probs keeps them) and the chosen half's
    log-softmax for its NLL (L/2); the forward peaks at 2L while that NLL's contiguous copy of the chosen logits is
    alive. Backward: the grads of the gather (a zero-filled [tokens, vocab] buffer it scatters into), of the
    log-sum-exp, of the NLL's half and their sum reach 3L beyond what is saved, measured on CPU (tests/
    test_plan_methods.py). Beside them the final norm's saved tensors, the hidden states' grad, and lm_head's fp32
    grad when trained."""
    L = tokens * V * a
    saved = tokens * (4 * h + a * h) + 1.5 * L
    peak = tokens * (4 * h + a * h) + 3 * L + (V * h * 4 if trainable else 0)
    return saved, peak


def _padded(recipe: Recipe) -> bool:
    """Preference batches are padded rows (each pair to the longer of chosen and rejected, prompts of different
    lengths flushed left), so transformers passes sdpa a causal + padding mask, which keeps it off its GQA path. (SFT's
    unpacked rows are planned unpadded, as calibrated; a padded SFT batch would add the same.)"""
    return recipe.method != "sft"


def no_grad_forward(shape: Shape, s: Setup, per_layer: list[float], tokens: int, rows: int) -> float:
    """Bytes one forward without grad holds at once (TRL's reference forward; KTO's KL batch): nothing is kept for
    backward, so one decoder layer's temporaries at a time beside the layer's input, then the fused LM head's forward.
    A dense layer peaks in its MLP (the input, the residual after attention, the normed input; silu(gate), up and their
    product: gate is freed once silu has it) or in attention (q and k after RoPE, v, k and v repeated to every head where
    a mask keeps sdpa off its GQA path, the output and its fp32 logsumexp); a sparse MoE layer is bounded by what it
    saves with grad. The head: the final norm's output, the hidden states it scores (a gathered copy), its tile buffer,
    its fp32 per-token statistics, and off Triton (CPU) ~4 fp32 temporaries of the tile's width."""
    a, h = s.act_bytes, shape.hidden
    head = tokens * (2 * a * h + 10 * 4) + rows * TRL_VOCAB_TILE * a
    head += 0 if s.gpu else rows * min(shape.vocab, TRL_VOCAB_TILE) * 4 * 4
    return max(no_grad_layer(shape, s, per_layer, tokens), tokens * a * h + head)


def no_grad_layer(shape: Shape, s: Setup, per_layer: list[float], tokens: int) -> float:
    """The largest decoder layer's temporaries in a forward without grad of `tokens` tokens (no_grad_forward's; the
    prefill of generation.py), `per_layer`: what each layer saves with grad for as many tokens."""
    a, h = s.act_bytes, shape.hidden

    def dense(L: Layer) -> float:  # a dense layer's peak per token: attention or MLP, each with its own sizes
        q, kv = L.heads * L.head_dim, L.kv_heads * L.head_dim
        return max(a * (2 * h + 2 * q + 2 * kv + 2 * (q - kv) + q) + 4 * L.heads, a * (3 * h + 3 * L.intermediate))

    return max(per_layer) if any(L.experts for L in shape.decoder) else tokens * max(map(dense, shape.decoder))


def _norm_width(shape: Shape, layer: Layer, w: Weight) -> int:
    """Elements per token a norm weight normalises: q/k norms (Qwen3, Gemma-3) run over every head of its layer."""
    return {"q_norm": layer.heads * layer.head_dim, "k_norm": layer.kv_heads * layer.head_dim}.get(w.leaf, shape.hidden)


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
                            tokens: int, sp: Split) -> float:
    """Bytes autograd saves in one decoder layer for `tokens` tokens (transformers 5 layers, PEFT LoRA), for its backward.
    Under Ulysses the attention kernel saves the gathered q, k, v (the whole sequence, heads/N heads: per local token
    all heads, key/value heads replicated up to N) and no mask reaches it (seqsplit.py)."""
    q, kv, nh, a = layer.heads * layer.head_dim, kv_heads(layer, sp) * layer.head_dim, layer.heads, s.act_bytes
    full = not s.lora
    # RMSNorm computes in fp32: pow/mul save its fp32 input (a copy when activations are 16-bit); the output feeds
    # the projections; with a trainable weight the normalised tensor is saved too. Two per layer (Llama), four
    # (Gemma), plus q/k norms over each head (Qwen3, Gemma-3).
    norms = sum((4 + a + (a if full else 0)) * _norm_width(shape, layer, w) for w in layer.weights if w.kind == "norm")
    # q and k after RoPE, v, the attention output + fp32 logsumexp (flash/sdpa kernels), o_proj's contiguous input
    attn_b = a * (q + 2 * kv) + a * q + 4 * nh + a * q
    if attn == "eager" or (attn == "sdpa" and not sp.on and (packs(recipe, shape) or _padded(recipe))):
        attn_b += a * 2 * (q - kv)  # a mask keeps sdpa off its GQA path: k and v repeated to every head
    if attn == "sft_varlen" and not (s.gpu and a == 2):  # per-sample sdpa (CPU, fp32): kv repeated to every head (the
        attn_b += a * 2 * (q - kv)  # padded groups' output, made contiguous again, is o_proj's input, counted above)
    if attn == "eager":
        attn_b += nh * seq * (4 + a)  # the s x s scores: fp32 softmax output and its cast, per head
    # dense MLP: gate and up outputs, silu(gate), their product (down_proj's input); sparse: _moe_token_bytes
    mlp = _moe_token_bytes(shape, layer, s) if layer.experts else 4 * a * layer.intermediate
    lora, folded = 0.0, 0.0
    if s.lora:
        m = recipe.model
        # PEFT: result + lora_B(lora_A(dropout(x))): dropout makes a copy (+ a 1-byte mask) per adapted module; fp32
        # adapters under autocast (no DeepSpeed/FSDP bf16 cast) save their own 16-bit copy of the input
        cast = recipe.launch.backend in ("none", "ddp") and a == 2
        # (DPOTrainer / KTOTrainer's disable_dropout sets every nn.Dropout to p=0, which returns its input: no copy)
        drop = m.lora_dropout > 0 and not (recipe.method != "sft" and recipe.trl_value("disable_dropout"))
        per_in = (a if (drop or cast) else 0) + (1 if drop else 0)
        for w, _ in adapted:
            if w.kind == "linear":
                lora += per_in * w.fan_in + a * m.lora_r
            else:  # peft's ParamWrapper folds W + s*BA into a full-size tensor each forward; the matmul saves it
                folded += w.numel * (s.expert_bytes if w.kind == "experts" else a)
    return tokens * (norms + attn_b + mlp + lora) + folded


def _backward_working_bytes(shape: Shape, layer: Layer, adapted: tuple, s: Setup, tokens: int) -> float:
    """Gradient tensors alive at once inside one layer's backward beyond the tensors it saved (a dense MLP: d(product),
    d(silu) and d(up) at the product's backward, by when down_proj's node has freed the product it saved: two of width
    intermediate more than saved, measured at 16k tokens in tests/plan/test_plan_seqpar.py; experts: each routed copy's
    d(product), d(silu), d(up) and the input's grads; an adapted expert tensor: the full-size gradient of its folded
    W + s*BA)."""
    a, h = s.act_bytes, shape.hidden
    if not layer.experts:
        return tokens * a * 2 * layer.intermediate
    per_token = s.expert_bytes * layer.top_k * (3 * shape.expert_intermediate + 2 * h) + 3 * a * layer.shared_intermediate
    folded = max((w.numel for w, _ in adapted if w.kind == "experts"), default=0) * s.expert_bytes
    return tokens * per_token + folded

"""What a GPU holds at each phase of one training step besides the model states: activations (activations.py), the
layers ZeRO-3/FSDP gather (+ prefetch, and what ZeRO-3 keeps gathered for reuse), gradient buckets, the gradients not
yet produced, the optimizer step's temporaries, and a preference run's reference forward.

The phases are an online run's generation and scoring (grpo, rloo: generation.py), the reference forward (dpo, kto:
after the policy's forward, its activations held), the start of backward, the backward of the last and of the first
layer (grads grow while activations shrink, linearly, so the ends are the extremes) and the optimizer step;
estimate.py takes the largest.
"""

from __future__ import annotations

from sftrecipes.facts.shape import Shape
from sftrecipes.plan.activations import TRL_VOCAB_TILE, Activations, layer_lora_params
from sftrecipes.plan.generation import buffered, online, online_phases, plan_generation
from sftrecipes.plan.reference import ADAPTER, COPY, Reference
from sftrecipes.plan.sharding import GB, Setup
from sftrecipes.plan.states import ModelStates
from sftrecipes.recipe.target import checkpointing_off
from sftrecipes.recipe.typed import Recipe

START = "start of backward (LM head)"  # the phase that runs the LM head's backward
DS_SUB_GROUP_SIZE = 1_000_000_000  # DeepSpeed's zero_optimization.sub_group_size default (the emitted configs keep it)
DS_MAX_REUSE_DISTANCE = 1_000_000_000  # zero_optimization.stage3_max_reuse_distance default (the emitted configs keep it)


def live_phases(recipe: Recipe, shape: Shape, s: Setup, st: ModelStates, act: Activations) -> dict[str, list[tuple]]:
    """What is live at each phase of a step besides the model states: (name, bytes, note) per phase."""
    L, ckpt, Lr = recipe.launch, recipe.gradient_checkpointing and not checkpointing_off(recipe, shape), shape.layers
    gathered, head_gather = _gathered(recipe, shape, s, st)
    # grads outlive the step's backward only with accumulation (zero_grad(set_to_none) after each step), or when
    # DeepSpeed allocates its partitioned grad buffer up front
    grads_always = L.backend == "deepspeed" or recipe.trl_value("gradient_accumulation_steps") > 1
    if s.lora:
        g_layers = [layer_lora_params(ad, recipe.model.lora_r) * st.g_b / s.shard_g if st.grads_total else 0.0
                    for ad in st.adapted]
    else:
        g_layers = [layer.params * st.g_b / s.shard_g for layer in shape.decoder]
    # full fine-tuning: lm_head's grad comes first in backward, the embedding's last (after the first layer's)
    g_embed = 0 if s.lora else shape.embed_params * st.g_b / s.shard_g
    g_head = st.grads_total - sum(g_layers) - g_embed
    opt_tmp, fp32_step, fused = _optimizer_step(recipe, shape, s, st)
    acts, wss = act.per_layer, act.working
    rows = (f"{act.batch} x {act.seq} tokens" + (f", {act.tokens} per rank ({act.split.kind} {act.split.degree})"
                                                   if act.split.on else ""))
    acts_note = (f"{rows}, {Lr} layers, h {shape.hidden}, {act.attn}, "
                 + ("checkpointed: each layer's input kept, one layer recomputed in backward" if ckpt else "every layer's saved tensors"))
    # inside one layer's backward its weight grads appear module by module as its saved tensors are released: count
    # the larger of the two (they overlap little), the grads of the layers below not yet; the largest layer counts
    in_layers = [max((acts[j] if ckpt else 0) + wss[j], g_layers[j] - (0 if ckpt else acts[j])) for j in range(Lr)]
    big = max(range(Lr), key=in_layers.__getitem__)
    in_layer, g_layer = in_layers[big], g_layers[big]
    layer_note = (f"{acts[big] / act.tokens / 1e3:.1f} kB/token saved + {wss[big] / act.tokens / 1e3:.1f} kB/token grad temporaries"
                  + (f" (layer {big}, {shape.decoder[big].experts} experts)" if shape.decoder[big].experts else ""))
    buckets = ("gradient buckets", _gradient_buckets(recipe, shape, s, st),
               {"ddp": "DDP flat buckets", "deepspeed": "reduce bucket", "fsdp": "one layer before reduce-scatter"}.get(L.backend, ""))

    def not_yet(present: float) -> tuple:  # grads are freed after each step (zero_grad(set_to_none)) unless accumulating
        return ("gradients not yet produced", 0 if grads_always else present - st.grads_total, "set_to_none after each step")

    # ZeRO-3 from the second step: the layers it keeps gathered from their forward to their backward (the head's
    # backward comes first); in the last layer's backward the larger of them and the current layer + prefetch
    n_kept = _zero3_kept_layers(recipe, shape, ckpt)
    kept_for_reuse = sum(layer.params for layer in shape.decoder[len(shape.decoder) - n_kept:]) * st.gather_b
    reuse = ("gathered params (ZeRO-3)", kept_for_reuse,
            f"{n_kept} decoder layer{'s' * (n_kept != 1)} kept gathered from forward to backward (reused within "
            f"stage3_max_reuse_distance, {DS_MAX_REUSE_DISTANCE:.0e} elements)")
    gath_last = reuse if kept_for_reuse > gathered else ("gathered params (ZeRO-3/FSDP)", gathered, "current layer + prefetch")
    one_layer = ("one layer in backward", in_layer, ("recomputed: " if ckpt else "grad temporaries; ") + layer_note
                 + (f"; or its weight grads, {g_layer / GB:.2f} GB, if larger" if not s.lora else ""))
    gath = ("gathered params (ZeRO-3/FSDP)", gathered, "current layer + prefetch")
    kept = _reference_kept(recipe, shape, s, st.ref)  # FSDP SHARD_GRAD_OP: the copy stays gathered after its forward
    g = plan_generation(recipe, shape, s, st.ref) if online(recipe) else None
    if g:  # grpo, rloo: generation and the scoring forwards before the training forward (generation.py)
        policy = [gath, ("gathered lm_head", head_gather, "")] if s.gathers else []
        phases = online_phases(recipe, shape, s, st, act, g, policy,
                               _reference_gathers(recipe, shape, s, st, gathered, head_gather) if not kept else [], not_yet(0))
    elif st.ref.kind in (ADAPTER, COPY):  # dpo, kto: after the policy's forward, its activations held
        phases = {"reference forward (no grad)": [
            ("activations", act.shared + act.saved_all, acts_note),
            ("LM head (TRL chunked log-probs)", act.head_saved, "the policy's: hidden states saved for its backward"),
            ("reference forward (no grad)", act.no_grad,
             f"{act.batch} x {act.seq} tokens, one layer at a time + the LM head's {act.head_rows} x {TRL_VOCAB_TILE} tile"),
            *([] if kept else _reference_gathers(recipe, shape, s, st, gathered, head_gather)), not_yet(0), buckets]}
    else:
        phases = {}
    phases.update({
        START: [
            ("activations", act.shared + act.saved_all, acts_note),
            (("LM head (full logits)", act.head_saved + act.head_backward,
              f"[{act.tokens}, {shape.vocab}] logits kept, the chosen half's log-softmax and their grads (no fused head)")
             if act.full_logits else
             ("LM head (TRL chunked log-probs)", act.head_saved + act.head_backward,
              f"no [tokens, vocab] logits: a {act.head_rows} x {TRL_VOCAB_TILE} tile buffer + fp32 grads")),
            ("gathered lm_head", head_gather, ""), *([reuse] if kept_for_reuse else []), not_yet(0), buckets],
        "backward, last layer": [
            ("activations", act.shared + act.saved_all, acts_note), one_layer, gath_last,
            not_yet(g_head), buckets],
        "backward, first layer": [
            ("activations", act.shared + act.saved_first, "first layer's only"), one_layer, gath,
            not_yet(st.grads_total - g_embed - g_layers[0]), buckets],
        "optimizer step": [("optimizer step temporaries", opt_tmp,
                           "in place" if fused else "foreach AdamW" if s.gpu else "single-tensor AdamW"),
                           ("fp32 gradient partition (DeepSpeed step)", fp32_step,
                            "4 B/param" + (f" /{s.shard_o}" if s.shard_o > 1 else "")
                            + (f", one sub-group of <= {DS_SUB_GROUP_SIZE / 1e9:g}B elements at a time" if L.zero_stage == 3 else ""))],
    })
    for items in phases.values():
        if kept:
            items.append(("reference copy kept gathered", kept, "SHARD_GRAD_OP: not resharded after its forward (no backward)"))
        if g and not any(i[0] == "completions buffered" for i in items):  # the training phases: kept to the next generation
            items.append(("completions buffered", buffered(g), f"{g.batch} completions of {g.tokens} tokens"))
    return phases


def _reference_gathers(recipe: Recipe, shape: Shape, s: Setup, st: ModelStates, gathered: float, head_gather: float) -> list:
    """ZeRO-3/FSDP during the reference forward: with LoRA the policy's own layers gathered again (the base is the
    reference); a copy gathers its own layer + prefetch (TRL's prepare_deepspeed sizes its prefetch bucket 0.9 h^2,
    as the policy's) and lm_head for its head, in its dtype (FSDP: the mixed-precision param_dtype)."""
    if not s.gathers:
        return []
    if st.ref.kind == ADAPTER:
        return [("gathered params (ZeRO-3/FSDP)", gathered, "the policy's layers again, adapter disabled"),
                ("gathered lm_head", head_gather, "")]
    b = 2 if (s.mixed16 and recipe.launch.backend == "fsdp") else st.ref.bytes_per_param
    layer = max(L_.params for L_ in shape.decoder)
    prefetch = min(layer, 0.9 * shape.hidden * shape.hidden) if recipe.launch.backend == "deepspeed" else layer
    return [("gathered reference params", (layer + prefetch) * b, "the copy's current layer + prefetch"),
            ("gathered reference lm_head", (shape.head_params or shape.embed_params) * b, "")]


def _reference_kept(recipe: Recipe, shape: Shape, s: Setup, ref: Reference) -> float:
    """FSDP SHARD_GRAD_OP keeps a module unsharded from its forward to its backward; the reference copy has no
    backward, so after its first forward it stays whole (in the mixed-precision param_dtype)."""
    L = recipe.launch
    if ref.kind != COPY or L.backend != "fsdp" or L.fsdp_sharding_strategy != "SHARD_GRAD_OP":
        return 0.0
    return shape.params * (2 if s.mixed16 else ref.bytes_per_param)


def _gathered(recipe: Recipe, shape: Shape, s: Setup, st: ModelStates) -> tuple[float, float]:
    """ZeRO-3/FSDP: the layer being computed + the next one prefetched, in the gather dtype (DeepSpeed gathers one
    layer plus its prefetch bucket, 0.9 h^2 elements, as train/args.size_deepspeed_buckets sizes it); and lm_head,
    gathered for the head."""
    L = recipe.launch
    layer_params = max(L_.params for L_ in shape.decoder)  # the largest layer (MoE: all its experts)
    layer_gather = layer_params * st.gather_b
    gathered = 0.0
    if s.gathers:
        prefetch = min(layer_params, 0.9 * shape.hidden * shape.hidden) * st.gather_b if L.backend == "deepspeed" else layer_gather
        gathered = layer_gather + prefetch
        if L.fsdp_sharding_strategy == "SHARD_GRAD_OP" and L.backend == "fsdp":
            gathered = shape.params * st.gather_b  # unsharded params stay from forward to backward
    head_gather = (shape.head_params or shape.embed_params) * st.gather_b if s.gathers else 0.0
    return gathered, head_gather


def _zero3_kept_layers(recipe: Recipe, shape: Shape, ckpt: bool) -> int:
    """How many decoder layers (from the last down) ZeRO-3 keeps gathered from their forward to their backward. From
    the second step, once its trace of the step is complete, DeepSpeed releases a module's parameters after use only
    if they do not come back within stage3_max_reuse_distance elements of the trace ahead
    (partitioned_param_coordinator.__params_to_release). Ahead of layer k's forward lie the layers above it (forward),
    the head (forward and backward), the layers above it again in backward (with checkpointing: their recomputed
    forward and their backward) and then layer k's own recompute or backward. So at 70B (856M elements a layer) only
    the last layer stays; at 253M (16 layers of 16M) every layer does, the whole model gathered on each rank."""
    L = recipe.launch
    if not (L.backend == "deepspeed" and L.zero_stage == 3):
        return 0
    head, passes, above, kept = shape.head_params or shape.embed_params, 3 if ckpt else 2, 0, 0
    for layer in reversed(shape.decoder):
        if passes * above + 2 * head + layer.params >= DS_MAX_REUSE_DISTANCE:
            break
        kept, above = kept + 1, above + layer.params
    return kept


def _gradient_buckets(recipe: Recipe, shape: Shape, s: Setup, st: ModelStates) -> float:
    """DDP keeps a flat copy of all grads (gradient_as_bucket_view off); DeepSpeed a reduce bucket of h^2 elements;
    FSDP the unsharded grads of the current layer before its reduce-scatter."""
    h, trainable = shape.hidden, st.trainable
    layer_trainable = (max(layer_lora_params(ad, recipe.model.lora_r) for ad in st.adapted) if s.lora
                       else max(L_.params for L_ in shape.decoder))
    return {"ddp": trainable * st.g_b if s.world > 1 else 0.0,
            "deepspeed": min(trainable, h * h) * 2 if s.mixed16 else min(trainable, h * h) * 4,
            "fsdp": layer_trainable * (2 if s.mixed16 else st.g_b)}.get(recipe.launch.backend, 0.0)


def _optimizer_step(recipe: Recipe, shape: Shape, s: Setup, st: ModelStates) -> tuple[float, float, bool]:
    """Temporaries of the optimizer step: (bytes of AdamW's temporaries, of DeepSpeed's fp32 gradient copy, fused?).

    Fused AdamW (TRL's default adamw_torch_fused), DeepSpeed's and bitsandbytes' Adam work in place; torch's foreach
    AdamW (GPU) allocates a copy of the states' shard, its single-tensor path (CPU) one parameter's worth. DeepSpeed's
    ZeRO optimizers step the fp32 master on an fp32 copy of the 16-bit gradient partition, made for one param group
    (ZeRO-1/2: stage_1_and_2.step) or one sub-group of at most sub_group_size elements (ZeRO-3:
    stage3._prepare_fp32_grad_for_sub_group) at a time and freed after its step. DeepSpeed's own estimator counts it
    as resident (its 18 B/param); it lives only in the step (tests/plan/test_plan_vs_deepspeed.py)."""
    L = recipe.launch
    fused = L.backend == "deepspeed" or "fused" in st.optim or "8bit" in st.optim
    opt_tmp = 0.0 if fused else (st.trainable * st.p_b / s.shard_o if s.gpu else _largest_param(shape, recipe, st.adapted) * st.p_b)
    fp32_step = 0.0
    if s.deepspeed16 and L.zero_stage >= 1 and not s.offload_opt:
        part = st.trainable / s.shard_o
        fp32_step = 4 * (min(part, DS_SUB_GROUP_SIZE) if L.zero_stage == 3 else part)
    return opt_tmp, fp32_step, fused


def _largest_param(shape: Shape, recipe: Recipe, adapted: tuple) -> int:
    """Elements of the largest trainable tensor (a LoRA matrix: r x the wider side, times the experts of a fused one)."""
    if recipe.model.use_peft_lora:
        r = recipe.model.lora_r
        return max((r * mult * w.matrices * max(w.fan_in, w.fan_out) for ad in adapted for w, mult in ad), default=0)
    return shape.largest_weight

"""What an online run (method grpo, rloo) holds per GPU to generate and score its completions, beside a training
step's tensors (torch-free): the KV cache and temporaries of TRL's transformers generate, the weights ZeRO-3 gathers
whole for it, vLLM's share of a colocated GPU, and the forwards without grad that score the completions.

The rules are TRL 1.16's (GRPOTrainer / RLOOTrainer `_generate_single_turn`, `_generate_and_score_completions`,
`_compute_loss`; trl.models.utils.unwrap_model_for_generation):
- every steps_per_generation x num_iterations micro-steps each rank generates its share of the generation batch at
  once, per_device_train_batch_size x steps_per_generation completions (recipe/online.generation_batch), and keeps them
  (ids, masks, per-token log-probs) until the next generation;
- transformers generate: the prompts left-padded and run at once (the prefill: one layer's temporaries at a time, the
  sdpa mask of the padded prompts), then one token per step for every completion; the KV cache (DynamicCache, grown by
  concatenation: one layer's keys held twice while they grow) ends at layers x 2 x KV heads x head size x (prompt +
  max_completion_length) tokens per completion, in the dtype the weights compute in (DeepSpeed's 16-bit module, FSDP's
  param_dtype, 16-bit weights; else fp32: generate runs outside autocast); each step's next-token logits in fp32,
  warped and turned into probabilities. Every layer is counted whole (a sliding-window layer keeps less: an upper
  bound there);
- under ZeRO-3 with ds3_gather_for_generation (TRL's default) every parameter is gathered on each rank while it
  generates; without it, and under FSDP, each forward gathers layer by layer as in training;
- vllm_mode colocate: vLLM takes vllm_gpu_memory_utilization of each GPU (its weights and KV cache), the training the
  rest (with vllm_enable_sleep_mode it gives it back outside generation); vllm_mode server: the server's GPUs are its
  own and not in this plan;
- the completions are scored without grad in chunks of per_device_train_batch_size: the policy's old log-probs
  (RLOO always; GRPO when gradient_accumulation_steps is not a multiple of steps_per_generation x num_iterations, or
  with vLLM's importance sampling correction), the reference's when beta > 0 (LoRA: the adapter disabled; else the
  frozen copy, plan/reference.py);
- the training forward runs per_device_train_batch_size sequences of prompt + completion through TRL's fused LM head
  (activations.py at that length: no [tokens, vocab] logits; on a GPU the head scores the completion's positions
  only, the plan every position: an upper bound there).
Not planned: an evaluation's generation (per_device_eval_batch_size x num_generations_eval completions).

TRL 1.16 does not cut prompts, so a sequence is planned at the context the run allows: vllm_max_model_length (prompt +
completion, as TRL asks it to be set) where the recipe sets it, else the model's positions.
"""

from __future__ import annotations

from dataclasses import dataclass

from sftrecipes.facts.shape import Shape
from sftrecipes.plan.activations import Activations, no_grad_layer
from sftrecipes.plan.reference import ADAPTER, COPY, Reference
from sftrecipes.plan.sharding import GB, Setup
from sftrecipes.plan.states import Item, ModelStates
from sftrecipes.recipe.online import generation_batch
from sftrecipes.recipe.schema import ONLINE
from sftrecipes.recipe.typed import Recipe

TRANSFORMERS, COLOCATE, SERVER = "transformers", "colocate", "server"
LOGITS_FP32 = 3  # fp32 [completions, vocab] tensors a generate step holds at once: the logits' copy, warped, softmax


@dataclass(frozen=True)
class Generation:
    """One rank's generation of an online run, as planned."""

    engine: str  # TRANSFORMERS, COLOCATE or SERVER
    batch: int  # completions this rank generates at once
    steps_per_generation: int
    prompt: int  # tokens planned per prompt
    completion: int  # max_completion_length
    cap: str  # where prompt + completion comes from, in words
    old_logps: bool  # the policy scores its completions without grad (old per-token log-probs)
    reference: bool  # a reference forward scores them (beta > 0)
    kv_bytes: int  # bytes per element of the KV cache

    @property
    def tokens(self) -> int:
        return self.prompt + self.completion


def online(recipe: Recipe) -> bool:
    """The recipe generates its completions during training (grpo, rloo)."""
    return recipe.method in ONLINE


def context(recipe: Recipe, shape: Shape) -> tuple[int, int, str]:
    """(prompt tokens, completion tokens, why): a completion is at most max_completion_length; prompt + completion at
    most vllm_max_model_length where the recipe sets it, else the model's positions."""
    completion = int(recipe.trl_value("max_completion_length"))
    cap, why = recipe.trl_value("vllm_max_model_length"), "vllm_max_model_length"
    if not cap:
        cap, why = shape.max_positions, "the model's positions, max_position_embeddings"
    return max(int(cap) - completion, 0), completion, why


def plan_generation(recipe: Recipe, shape: Shape, s: Setup, ref: Reference) -> Generation:
    """The recipe's generation as one rank runs it."""
    _, spg = generation_batch(recipe)
    prompt, completion, why = context(recipe, shape)
    vllm = bool(recipe.trl_value("use_vllm"))
    engine = (COLOCATE if recipe.trl_value("vllm_mode") == "colocate" else SERVER) if vllm else TRANSFORMERS
    every = spg * int(recipe.trl_value("num_iterations"))
    old = (recipe.method == "rloo" or recipe.trl_value("gradient_accumulation_steps") % every != 0
           or (vllm and bool(recipe.trl_value("vllm_importance_sampling_correction"))))
    L = recipe.launch
    kv_b = 2 if (s.deepspeed16 or (L.backend == "fsdp" and s.mixed16) or s.load_bytes == 2) else 4
    return Generation(engine, int(recipe.trl_value("per_device_train_batch_size")) * spg, spg, prompt, completion, why,
                      old, ref.kind in (ADAPTER, COPY), kv_b)


def kv_cache(shape: Shape, g: Generation, tokens: int) -> float:
    """Bytes of the KV cache of the rank's completions at `tokens` tokens each: every layer's keys and values."""
    return g.batch * tokens * g.kv_bytes * sum(2 * L.kv_heads * L.head_dim for L in shape.decoder)


def buffered(g: Generation) -> float:
    """Bytes of the completions a rank keeps from one generation to the next: prompt and completion ids and masks
    (int64), the per-token log-probs it scored (fp32: old, reference; with vLLM its sampling log-probs and ratios)."""
    logps = int(g.old_logps) + int(g.reference) + (2 if g.engine != TRANSFORMERS else 0)
    return g.batch * (g.tokens * 4 * 8 + g.completion * 4 * logps)


def vllm_share(recipe: Recipe) -> float:
    """Bytes vLLM takes of each GPU in colocate mode (vllm_gpu_memory_utilization x launch.gpu_memory_gb; 0 where the
    GPU's memory is not given)."""
    gpu = recipe.launch.gpu_memory_gb
    return float(recipe.trl_value("vllm_gpu_memory_utilization")) * gpu * GB if gpu else 0.0


def resident(recipe: Recipe, g: Generation) -> list[Item]:
    """What generation holds through every phase: vLLM's share of a colocated GPU (without sleep mode)."""
    if g.engine != COLOCATE or recipe.trl_value("vllm_enable_sleep_mode"):
        return []
    return [Item("vLLM (colocated)", vllm_share(recipe) / GB, _share_words(recipe))]


def _share_words(recipe: Recipe) -> str:
    util, gpu = recipe.trl_value("vllm_gpu_memory_utilization"), recipe.launch.gpu_memory_gb
    if not gpu:
        return f"vllm_gpu_memory_utilization {util:g} of the GPU: not counted, launch.gpu_memory_gb is not set"
    return f"vllm_gpu_memory_utilization {util:g} x {gpu:g} GB: its weights and KV cache; training gets the rest"


def _server_words(recipe: Recipe) -> str:
    gpus = getattr(recipe.launch, "vllm_server_gpus", 0)
    where = f" (launch.vllm_server_gpus: {gpus} beside the ranks)" if gpus else ""
    return f"vllm_mode server: the server's GPUs{where} are its own, not in this plan"


def online_phases(recipe: Recipe, shape: Shape, s: Setup, st: ModelStates, act: Activations, g: Generation,
                  policy_gathers: list, ref_gathers: list, no_grads: tuple) -> dict[str, list[tuple]]:
    """The phases before an online step's training forward: generation (transformers: its prefill and its last token;
    vLLM with sleep mode: its share while awake) and the scoring forwards without grad; each as (name, bytes, note)."""
    buf = ("completions buffered", buffered(g), f"{g.batch} completions x {g.tokens} tokens: ids, masks, log-probs")
    phases: dict[str, list[tuple]] = {}
    if g.engine == TRANSFORMERS:
        whole = gathered_whole(recipe, shape, s, st)
        gathers = [("gathered for generate (ZeRO-3, whole model)", whole, "ds3_gather_for_generation: every parameter "
                    "gathered on each rank while it generates")] if whole else policy_gathers
        h, a, V = shape.hidden, s.act_bytes, shape.vocab
        # one layer's temporaries a token, less its keys and values: the cache holds them (counted there)
        layer_tok = (no_grad_layer(shape, s, act.per_layer, act.tokens) / act.tokens
                     - max(2 * L.kv_heads * L.head_dim for L in shape.decoder) * g.kv_bytes)
        prefill_tokens = g.batch * g.prompt
        heads = max(L.heads for L in shape.decoder)
        mask = g.batch * g.prompt * g.prompt if act.attn in ("sdpa", "eager") else 0  # the padded prompts' mask
        scores = g.batch * heads * g.prompt * g.prompt * (4 + a) if act.attn == "eager" else 0  # eager: s x s scores
        prefill = prefill_tokens * (layer_tok + a * h) + mask + scores + g.batch * V * (a + 4)
        kv_last = kv_cache(shape, g, g.tokens)
        grow = g.batch * g.tokens * g.kv_bytes * max(L.kv_heads * L.head_dim for L in shape.decoder)
        step = grow + g.batch * (heads * g.tokens * 4 * 2 + V * (a + 4 * LOGITS_FP32) + 8 * a * h)
        phases["generation: prefill (no grad)"] = [
            *gathers, ("KV cache", kv_cache(shape, g, g.prompt), f"{g.batch} completions x {g.prompt} prompt tokens"),
            ("prefill", prefill, f"{g.batch} prompts x {g.prompt} tokens, one layer at a time"
             + (", the padded prompts' mask" if mask else "") + (", eager attention's scores" if scores else "")
             + ", the last token's logits"),
            buf, no_grads]
        phases["generation: last token (no grad)"] = [
            *gathers, ("KV cache", kv_last, f"{g.batch} completions x {g.tokens} tokens x {shape.layers} layers x "
                       f"keys and values, {g.kv_bytes}-byte"),
            ("generate step", step, "one layer's keys copied as they grow, attention scores, the next-token logits "
             f"[{g.batch}, {V}] in fp32"), buf, no_grads]
    elif g.engine == COLOCATE and recipe.trl_value("vllm_enable_sleep_mode"):
        phases["generation (vLLM awake)"] = [("vLLM (colocated)", vllm_share(recipe), _share_words(recipe)), buf, no_grads]
    if g.old_logps or g.reference:
        what = " and ".join(w for w, on in (("old log-probs", g.old_logps), ("reference log-probs", g.reference)) if on)
        uses_copy = g.reference and st.ref.kind == COPY
        runs = ([policy_gathers] if g.old_logps or not uses_copy else []) + ([ref_gathers] if uses_copy else [])
        gathers = max(runs, key=lambda x: sum(i[1] for i in x))  # one forward at a time: the larger gathers
        phases["scoring completions (no grad)"] = [
            buf, ("forward without grad", act.no_grad, f"{what}: {act.batch} x {act.seq} tokens a chunk, one layer at a "
                  "time + the LM head's tile"), *gathers, no_grads]
    return phases


def gathered_whole(recipe: Recipe, shape: Shape, s: Setup, st: ModelStates) -> float:
    """ZeRO-3 with ds3_gather_for_generation: bytes of every parameter gathered on each rank while it generates, in
    the dtype ZeRO-3 holds them (0 otherwise: each forward gathers layer by layer)."""
    if not (s.gathers and recipe.launch.backend == "deepspeed" and recipe.trl_value("ds3_gather_for_generation")):
        return 0.0
    return st.frozen + st.trainable * st.p_b if s.lora else shape.params * st.gather_b


def words(recipe: Recipe, shape: Shape, s: Setup, st: ModelStates, g: Generation) -> list[Item]:
    """The generation's lines of the plan, per GPU (per rank): what it generates and holds, in GB."""
    out = []
    if g.engine == TRANSFORMERS:
        out.append(Item("generation KV cache", kv_cache(shape, g, g.tokens) / GB,
                        f"{g.batch} completions at once x {g.tokens} tokens x {shape.layers} layers x 2 x KV heads x "
                        f"head size x {g.kv_bytes} B"))
        if whole := gathered_whole(recipe, shape, s, st):
            out.append(Item("gathered for generate (ZeRO-3)", whole / GB, "every parameter on each rank while it "
                            "generates (ds3_gather_for_generation: false gathers layer by layer, slower)"))
    elif g.engine == COLOCATE:
        out.append(Item("vLLM share (colocated)", vllm_share(recipe) / GB, _share_words(recipe)
                        + ("; only while it generates (vllm_enable_sleep_mode)" if recipe.trl_value("vllm_enable_sleep_mode") else "")))
    else:
        out.append(Item("vLLM server", 0.0, _server_words(recipe)))
    out.append(Item("completions buffered", buffered(g) / GB, "kept from one generation to the next"))
    return out



def generation_note(recipe: Recipe, g: Generation) -> str:
    """The plan's note on an online run's generation: the engine, the batch, the length planned and why."""
    engine = {TRANSFORMERS: "transformers generate on each rank", COLOCATE: "vLLM colocated on each GPU",
              SERVER: f"a vLLM server ({_server_words(recipe)})"}[g.engine]
    scored = [w for w, on in (("the policy's old log-probs", g.old_logps), ("the reference's", g.reference)) if on]
    return (f"generation ({recipe.method}): {engine}; {g.batch} completions per rank at once (per_device_train_batch_size "
            f"{g.batch // g.steps_per_generation} x steps_per_generation {g.steps_per_generation}), each planned at "
            f"{g.prompt} prompt + {g.completion} completion tokens: TRL does not cut prompts, so prompt + completion is "
            f"planned at {g.tokens} ({g.cap}); " + (f"scored without grad for {' and '.join(scored)}" if scored else
                                                    "no scoring forward (old log-probs are the training forward's)"))


def online_forwards(recipe: Recipe, ref: Reference, g: Generation) -> tuple[int, int]:
    """Forwards without grad an online run adds per micro-batch (each row of the generation batch is scored once):
    (the policy's: old log-probs, the reference with the adapter disabled; the reference copy's)."""
    return int(g.old_logps) + int(g.reference and ref.kind == ADAPTER), int(g.reference and ref.kind == COPY)


def generation_comm(recipe: Recipe, shape: Shape, s: Setup, g: Generation, T_all: float, ga: int, f: float) -> Item | None:
    """The network volume generation adds per GPU per optimizer step: ZeRO-3 gathers every parameter once per
    generation (ds3_gather_for_generation) or each layer at every generated token (without it, and FSDP); vLLM
    receives the updated weights once per optimizer step (colocate: gathered on each rank; server: sent by rank 0)."""
    gens = ga / (g.steps_per_generation * int(recipe.trl_value("num_iterations")))  # generations per optimizer step
    if g.engine == SERVER:
        return Item("weights to the vLLM server", shape.params * 2 / GB, "rank 0 sends the updated weights each step")
    if not s.gathers:
        return None
    if g.engine == COLOCATE:
        return Item("generation all-gather", T_all * f / GB, "the weights gathered for vLLM once per optimizer step")
    if recipe.launch.backend == "deepspeed" and recipe.trl_value("ds3_gather_for_generation"):
        return Item("generation all-gather", gens * T_all * f / GB, f"every parameter once per generation ({gens:g} a step)")
    return Item("generation all-gather", gens * (g.completion + 1) * T_all * f / GB,
                f"every layer at each of {g.completion + 1} forwards of a generation ({gens:g} a step)")

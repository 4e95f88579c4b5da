"""The memory of one training step of a recipe exactly as configured (torch-free arithmetic on the model's shape):
what each GPU holds at each phase, what each node's CPU RAM holds, and the verdict against the launch limits.

`estimate(recipe) -> Plan` runs the steps below in order; plan.py adds the strategies and prints the result:

1. model states per rank: weights (by dtype; 4-bit with its quant constants), gradients and Adam states of the
   trainable parameters, each divided by the ranks that shard it (DDP none; ZeRO-1 states; ZeRO-2 +grads;
   ZeRO-3/FSDP everything), and a preference run's reference copy (reference.py) -- `_model_states`;
2. what else is live at each phase of a step -- `_live_phases`: activations (activations.py), ZeRO-3/FSDP gathered
   layers (+ prefetch), gradient buckets, gradients not yet produced, optimizer temporaries. The peak is the largest
   of the reference forward (dpo, kto: after the policy's forward, its activations held), the start of backward, the
   backward of the last and of the first layer (grads grow while activations shrink, linearly, so the ends are the
   extremes) and the optimizer step;
3. the peak phase plus an allowance for the CUDA context and allocator fragmentation on GPUs -- `_peak`;
4. CPU RAM per node: processes, loading, offloaded states, a FULL_STATE_DICT save -- `_cpu_ram`;
5. the network volume per GPU per optimizer step -- `_communication`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from sftrecipes.plan import offload
from sftrecipes.plan.activations import TRL_VOCAB_TILE, Activations, activations, layer_lora_params
from sftrecipes.train.args import PARTITIONED, RANK0_READS, weight_reading
from sftrecipes.recipe.load import Recipe
from sftrecipes.facts.shape import Shape, checkpointing_off, model_shape
from sftrecipes.facts.startmodel import adapter_of, base_of
from sftrecipes.plan.ranks import RankLoading, RankSteps, rank_loading, rank_steps
from sftrecipes.plan.reference import ADAPTER, COPY, FREE, Reference, describe, forwards, reference
from sftrecipes.plan.sharding import GB, Setup, partitioned_4bit_load, quant_bytes_per_param, setup, trainable_bytes

if TYPE_CHECKING:
    from sftrecipes.plan.strategies import Strategy

# Runtime allowance on a GPU: CUDA context + cuBLAS/NCCL workspaces (not visible to torch's allocator, visible to
# nvidia-smi), and the caching allocator's fragmentation as a share of the memory that churns each step.
CUDA_CONTEXT_GB = 1.0
FRAGMENTATION = 0.10
PROCESS_CPU_GB = 2.0  # host RAM of one rank besides tensors: python, torch, CUDA host libraries, dataloader
CKPT_SHARD_GB = 10.0  # hub checkpoints ship in ~5-10 GB safetensors shards; a rank reading shard by shard holds one
DS_SUB_GROUP_SIZE = 1_000_000_000  # DeepSpeed's zero_optimization.sub_group_size default (the emitted configs keep it)
DS_MAX_REUSE_DISTANCE = 1_000_000_000  # zero_optimization.stage3_max_reuse_distance default (the emitted configs keep it)


@dataclass
class Item:
    name: str
    gb: float
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
    alternatives: list[Strategy] = field(default_factory=list)  # strategies.alternatives (plan.plan_recipe)
    pipeline_degree: int | None = None
    bubble: float | None = None
    weights_shard_gb: float = 0.0  # one rank's share of all weights (what offload_params moves over PCIe)
    active_params: int = 0  # parameters one token runs through (MoE: its top-k experts; else all)
    live: dict[str, list[Item]] = field(default_factory=dict)  # per phase: what is live besides the model states
    # the cpu target (device and host are one process): each group of ranks' RSS growth while loading (ranks.py)
    rank_loading: list[RankLoading] = field(default_factory=list)
    rank_steps: RankSteps | None = None  # the cpu target: a rank's RSS growth at the peak of its first steps
    method: str = "sft"  # what the run trains (recipe.method)
    reference: str = ""  # a preference run's reference and what it holds per GPU, in words (reference.describe)
    reference_kind: str = ""  # reference.Reference.kind

    @property
    def model_states_gb(self) -> float:
        return sum(i.gb for i in self.states)


def _model_words(name: str, shape_name: str) -> str:
    """The plan's first words: the model, or for a LoRA adapter (a run from an SFT run's output) what it trains."""
    adapter = adapter_of(name)
    return f"{name} (a LoRA adapter of {base_of(adapter)}, merged into it at start)" if adapter is not None else shape_name


def estimate(recipe: Recipe) -> Plan:
    """Memory per GPU and per node of one training step of the recipe on its launch hardware, and the verdict."""
    shape, s, L = model_shape(recipe.model.model_name_or_path), setup(recipe), recipe.launch
    notes: list[str] = []
    st = _model_states(recipe, shape, s)  # 1
    act, moved = offload.apply(recipe, activations(recipe, shape, s, st.adapted),  # activation_offloading: to host
                               recipe.gradient_checkpointing and not checkpointing_off(recipe, shape))
    live = _live_phases(recipe, shape, s, st, act)  # 2
    phases, peak_phase, allowance = _peak(recipe, shape, s, st, live, notes)  # 3
    cpu, cpu_total = _cpu_ram(recipe, shape, s, st)  # 4
    if moved:  # (during training, beside the offloaded states: not while loading)
        cpu.append(Item("offloaded activations", s.gpn * moved / GB, "per rank x ranks on the node (pinned; activation_offloading)"))
        cpu_total = cpu[0].gb + max(cpu[1].gb, sum(i.gb for i in cpu[2:]))  # (as _cpu_ram sums: processes + the larger phase)
        notes.append(offload.note(moved, s.gpn, GB))
    ga = recipe.trl_value("gradient_accumulation_steps")
    comm, comm_gb = _communication(recipe, shape, s, st.trainable * (2 if s.mixed16 else st.g_b),  # 5
                                   shape.params * st.gather_b, ga, st.ref)
    total = phases[peak_phase] + allowance
    if L.gpu_memory_gb is None:
        notes.append("launch.gpu_memory_gb is not set: this is the requirement only (set it, e.g. 80, for a verdict)")
    notes += _outside_notes(shape, st, s.lora)
    if shape.unpacked and (recipe.trl_value("packing") or recipe.trl_value("padding_free")):
        notes.append(f"packing: the run pads its rows instead ({shape.unpacked}); planned unpacked")
    if why := checkpointing_off(recipe, shape):
        notes.append(f"gradient_checkpointing: the run goes without: {why}; planned so")
    if st.ref.kind == COPY and not s.gpu:
        notes.append("the per-rank loading table is the policy's; the reference copy then loads the same way")
    if shape.moe:
        notes += _moe_notes(shape, s, st.adapted, st.float_b, recipe.model.lora_target_modules)
    return Plan(
        model=_model_words(recipe.model.model_name_or_path, shape.name), params=shape.params, trainable=st.trainable, world=s.world, gpus_per_node=s.gpn,
        nodes=L.num_machines, backend=_backend_name(recipe), states=st.items, peak=_items(live[peak_phase]),
        peak_phase=peak_phase, phases=phases, tensor_peak_gb=phases[peak_phase], allowance_gb=allowance,
        gpu_total_gb=total, gpu_limit_gb=L.gpu_memory_gb, fits=None if L.gpu_memory_gb is None else total <= L.gpu_memory_gb,
        cpu=cpu, cpu_total_gb=cpu_total, cpu_limit_gb=L.cpu_ram_gb,
        cpu_fits=None if L.cpu_ram_gb is None else cpu_total <= L.cpu_ram_gb, comm=comm, comm_gb=comm_gb,
        global_batch=recipe.trl_value("per_device_train_batch_size") * ga * s.world, notes=notes,
        weights_shard_gb=(st.frozen + st.trainable * st.p_b) / s.shard_w / GB, active_params=shape.active_params,
        live={k: _items(v) for k, v in live.items()},
        rank_loading=[] if s.gpu else rank_loading(recipe, shape, s, st.float_b),
        rank_steps=None if s.gpu else rank_steps(recipe, shape, *_step_peak(phases), _offloaded_per_rank(recipe, shape, s, st) / GB,
                                                     s.quant_bits < 16),
        method=recipe.method, reference=describe(recipe, st.ref), reference_kind=st.ref.kind)


def _step_peak(phases: dict[str, float]) -> tuple[float, str]:
    """The largest phase of a training step (not loading's): GB and its name."""
    name = max((k for k in phases if not k.startswith("loading")), key=phases.get)
    return phases[name], name


def _outside_notes(shape: Shape, st: ModelStates, lora: bool) -> list[str]:
    """What the model holds outside its text decoder (a vision tower, a projector), each part's parameters and
    whether training changes it: multimodal configs are counted whole."""
    parts: dict[str, int] = {}
    for w in shape.rest or ():
        top = ".".join(w.name.split(".")[:2])
        parts[top] = parts.get(top, 0) + w.numel
    big = {k: v for k, v in parts.items() if v > 4 * shape.hidden}  # not just a final norm
    if not big:
        return []
    adapted = dict(st.outside)
    said = []
    for k, v in sorted(big.items(), key=lambda kv: -kv[1]):
        if not lora:
            how = "trained (full fine-tuning)"
        elif adapted.get(k):
            how = f"frozen, LoRA adapts its linear layers ({adapted[k] / 1e6:.2f}M trainable)"
        else:
            how = "frozen, no LoRA"
        said.append(f"{k} {v / 1e6:.2f}M params: {how}")
    return [f"besides the text decoder ({shape.layers} layers) the model holds: " + "; ".join(said)
            + ("; lora_target_modules names the layers to adapt, exclude_modules the ones to leave" if lora else "")]


def _items(live: list[tuple]) -> list[Item]:
    """(name, bytes, note) entries as the report's items in GB, those that are there (not 0) only."""
    return [Item(n, v / GB, note) for n, v, note in live if v != 0]


# ----------------------------------------------------------------------------------------------- 1. model states


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
    the decoder layers by module): the table's arithmetic for its layouts (shape.lora_targets: tests/test_shape.py
    proves it equal to the run's peft count), else peft applying the run's LoraConfig to the meta model (meta.py)."""
    m = recipe.model
    if shape.source == "table":
        adapted = shape.lora_targets(m.lora_target_modules, m.lora_target_router)
        return adapted, sum(layer_lora_params(ad, m.lora_r) for ad in adapted), ()
    from sftrecipes.model.meta import lora_layout as meta_layout

    layout = meta_layout(recipe, shape)
    return layout.adapted, layout.trainable, layout.outside


def _model_states(recipe: Recipe, shape: Shape, s: Setup) -> ModelStates:
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
    if ref.kind != COPY:
        return Item("reference model", 0.0, "none during training: log-probs computed in a pass before step 1")
    return Item("reference model (frozen copy)", ref.per_gpu / GB,
                f"{shape.params / 1e9:.2f}B params x {ref.bytes_per_param} B" + (f" /{ref.ranks}" if ref.ranks > 1 else ", whole")
                + ", no grads or optimizer states" + (" -> on CPU (offload)" if ref.offloaded else ""))


# ----------------------------------------------------------------------------------------------- 2. live at each phase


def _live_phases(recipe: Recipe, shape: Shape, s: Setup, st: ModelStates, act: Activations) -> dict[str, list[tuple]]:
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
    acts_note = (f"{act.batch} x {act.seq} tokens, {Lr} layers, h {shape.hidden}, {act.attn}, "
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
    phases = {} if st.ref.kind not in (ADAPTER, COPY) else {"reference forward (no grad)": [
        ("activations", act.shared + act.saved_all, acts_note),
        ("LM head (TRL chunked log-probs)", act.head_saved, "the policy's: hidden states saved for its backward"),
        ("reference forward (no grad)", act.no_grad,
         f"{act.batch} x {act.seq} tokens, one layer at a time + the LM head's {act.head_rows} x {TRL_VOCAB_TILE} tile"),
        *([] if kept else _reference_gathers(recipe, shape, s, st, gathered, head_gather)), not_yet(0), buckets]}
    phases.update({
        "start of backward (LM head)": [
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
    if kept:
        for items in phases.values():
            items.append(("reference copy kept gathered", kept, "SHARD_GRAD_OP: not resharded after its forward (no backward)"))
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
    layer plus its prefetch bucket, 0.9 h^2 elements, as backends.size_deepspeed_buckets sizes it); and lm_head,
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
    as resident (its 18 B/param); it lives only in the step (tests/test_plan_vs_deepspeed.py)."""
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


# ----------------------------------------------------------------------------------------------- 3. the peak


def _peak(recipe: Recipe, shape: Shape, s: Setup, st: ModelStates, live: dict, notes: list[str]) -> tuple[dict, str, float]:
    """GB per GPU at each phase (model states + what is live), the peak phase, and the runtime allowance on a GPU.
    QLoRA under ZeRO-3 or FSDP adds a loading phase (to `live` and `notes`)."""
    L = recipe.launch
    resident = sum(i.gb for i in st.items) * GB
    phases = {k: (resident + sum(x[1] for x in v)) / GB for k, v in live.items()}
    mode4 = weight_reading(recipe, quantized=True)[0] if s.quant_bits == 4 else None
    if mode4 in (PARTITIONED, RANK0_READS):
        # ZeRO-3 with zero3_init: each decoder layer partitioned once quantized, on each rank's GPU; FSDP2 RAM-efficient:
        # rank 0 quantizes each layer on its GPU and sends it, each rank keeps its rows in host memory until fully_shard
        # moves them to its GPU one layer at a time (quantload.py): at most the same share + outside + one layer
        ld = partitioned_4bit_load(recipe, shape, s.shard_w, st.float_b)
        quantizing = ld.largest * s.load_bytes
        load_gb = (ld.share + ld.states + ld.outside + ld.layer + quantizing) / GB
        name = "loading (4-bit, partitioned per layer)"
        phases[name] = load_gb
        live[name] = [("4-bit layers partitioned as they load (replaces the shards above)", load_gb * GB - resident,
                       f"share {ld.share / GB:.2f} GB + quantization states, whole, {ld.states / GB:.2f} GB + outside "
                       f"the layers {ld.outside / GB:.2f} GB + one layer "
                       f"{ld.layer / GB:.2f} GB + one weight being quantized {quantizing / GB:.2f} GB")]
        how = ("QLoRA + ZeRO-3 (zero3_init): each decoder layer's 4-bit weights are partitioned as soon as they are "
               "quantized" if mode4 == PARTITIONED else
               "QLoRA + FSDP2 (fsdp_cpu_ram_efficient_loading): rank 0 reads the checkpoint and sends each decoder layer "
               "once quantized; each rank keeps its FSDP2 rows of the 4-bit weights")
        notes.append(f"{how}; while loading a GPU holds {'' if mode4 == PARTITIONED else 'at most '}its share of the layers ({ld.share / GB:.1f} GB), "
                     f"their quantization states whole ({ld.states / GB:.2f} GB), what "
                     f"lies outside them whole ({ld.outside / GB:.1f} GB: embeddings, head) and the layer being "
                     f"quantized ({ld.layer / GB:.2f} GB)")
    elif s.quant_bits == 4 and ((L.backend == "deepspeed" and L.zero_stage == 3) or L.backend == "fsdp"):
        # bitsandbytes weights are neither created inside zero.Init nor loaded RAM-efficiently (weight_reading): every
        # rank quantizes the whole model onto its own GPU (transformers' bnb device map) before the backend shards it
        lin = shape.linear_params
        load_gb = (lin * quant_bytes_per_param(recipe) + (shape.params - lin) * st.float_b) / GB
        phases["loading (whole 4-bit model per GPU)"] = load_gb
        live["loading (whole 4-bit model per GPU)"] = [("whole 4-bit model (replaces the shards above)", load_gb * GB - resident, "")]
        engine, fix = ("ZeRO-3", "; zero3_init: true partitions them") if L.backend == "deepspeed" else ("FSDP", "")
        notes.append(f"QLoRA + {engine}: 4-bit weights are not partitioned while loading; each GPU holds the whole "
                     f"4-bit model ({load_gb:.1f} GB) until {engine} shards it{fix}")
    if st.ref.precompute_load:
        # FSDP + precompute_ref_log_probs: before training (the policy still on the host, unprepared), TRL loads a
        # reference copy itself for the pass, whole on the GPU (device_map "auto") until prepare_fsdp shards it
        name = "loading (reference for the precompute pass, whole)"
        phases[name] = st.ref.precompute_load / GB
        live[name] = [("TRL's reference copy before FSDP shards it (replaces the states above)",
                       st.ref.precompute_load - resident, "freed before step 1")]
    peak_phase = max(phases, key=phases.get)
    churn = phases[peak_phase] - resident / GB if not peak_phase.startswith("loading") else 0.0
    allowance = (CUDA_CONTEXT_GB + FRAGMENTATION * max(churn, 0.0)) if s.gpu else 0.0
    return phases, peak_phase, allowance


# ----------------------------------------------------------------------------------------------- 4. CPU RAM per node


def _cpu_ram(recipe: Recipe, shape: Shape, s: Setup, st: ModelStates) -> tuple[list[Item], float]:
    """CPU RAM per node: processes, then the larger of loading and (offloaded states + a FULL_STATE_DICT save)."""
    L, gpn = recipe.launch, s.gpn
    cpu = [Item("processes", gpn * PROCESS_CPU_GB, f"{gpn} ranks x {PROCESS_CPU_GB:.0f} GB (python, torch, CUDA libs)")]
    load_float_b = s.load_bytes
    full_model = shape.params * load_float_b
    mode, why = weight_reading(recipe, quantized=s.quant_bits < 16)  # the loader's own rule (model.load_model)
    if mode == RANK0_READS and s.quant_bits == 4:
        # rank 0 reads shard by shard; every rank keeps its rows of each 4-bit layer in host memory until fully_shard
        ld = partitioned_4bit_load(recipe, shape, s.shard_w, st.float_b)
        cpu.append(Item("loading", (min(full_model, CKPT_SHARD_GB * GB) + gpn * (ld.share + ld.states)) / GB,
                        f"{why}: one checkpoint shard at a time on rank 0, and {gpn} ranks x their rows of the 4-bit "
                        f"layers with the layers' quantization states ({(ld.share + ld.states) / GB:.1f} GB) until FSDP2 "
                        "moves them to the GPU"))
    elif mode == RANK0_READS:
        cpu.append(Item("loading", full_model / GB, why))
    elif mode == PARTITIONED or (s.quant_bits < 16 and s.gpu):
        cpu.append(Item("loading", gpn * min(full_model, CKPT_SHARD_GB * GB) / GB,
                        why if mode == PARTITIONED else f"{why}, shard by shard into quantized GPU tensors"))
    else:
        cpu.append(Item("loading", gpn * full_model / GB, f"{why} ({full_model / GB:.0f} GB in {load_float_b}-byte floats)"))
    if st.ref.kind == COPY:
        # the copy loads as the policy did, right after it (methods.trainer_kwargs, before the trainer exists): the
        # policy is still in host RAM then unless zero3_init partitioned it onto the GPUs as it loaded
        if mode == PARTITIONED:
            cpu[-1].note += "; the reference copy loads the same way after it"
        elif mode == RANK0_READS:  # every rank reads the copy: nothing broadcasts into it (methods.trainer_kwargs)
            cpu[-1] = Item("loading (policy + reference copy)", cpu[-1].gb + gpn * full_model / GB,
                           cpu[-1].note + f"; then the reference copy, read by each of the {gpn} ranks (TRL shards it "
                           "without rank 0's broadcast), the policy still in host RAM")
        else:
            cpu[-1] = Item("loading (policy + reference copy)", 2 * cpu[-1].gb,
                           cpu[-1].note + "; then the reference copy the same way, the policy still in host RAM")
    off = _offloaded_per_rank(recipe, shape, s, st)
    if off:
        cpu.append(Item("offloaded states", gpn * off / GB, "per rank x ranks on the node (pinned)"))
    if L.backend == "fsdp" and L.fsdp_state_dict_type == "FULL_STATE_DICT":
        cpu.append(Item("FULL_STATE_DICT save on rank 0", full_state_dict_bytes(recipe, shape, s) / GB,
                        "the whole model gathered on rank 0's CPU"))
    # loading and training do not overlap: the node peak is processes + max(loading, offload + saving)
    return cpu, cpu[0].gb + max(cpu[1].gb, sum(i.gb for i in cpu[2:]))


def _offloaded_per_rank(recipe: Recipe, shape: Shape, s: Setup, st: ModelStates) -> float:
    """Bytes one rank keeps in host memory for the offloaded states. DeepSpeed's offloaded optimizer steps on the CPU
    with an fp32 master partition, Adam's m and v and an fp32 gradient partition of its own (stage3's
    subgroup_gradient_buffer, stage_1_and_2's single_partition_of_fp32_groups[i].grad): 16 B/param / ranks, measured
    on the ZeRO-3 offload twin at 253M (2 ranks: 0.5 GB more than 12 B/param would be)."""
    L, off = recipe.launch, 0.0
    if s.offload_opt:
        off += st.trainable * (16 if s.deepspeed16 else st.o_b + (0 if L.backend == "fsdp" else 8)) / s.shard_o
    if s.offload_params:
        off += (st.frozen + st.trainable * st.p_b) / s.shard_w + (st.trainable * st.g_b / s.shard_g if L.backend == "fsdp" else 0)
        off += st.ref.per_rank if st.ref.kind == COPY else 0.0  # the reference's engine / FSDP keeps the offload
    return off


def full_state_dict_bytes(recipe: Recipe, shape: Shape, s: Setup) -> float:
    """Bytes an FSDP FULL_STATE_DICT save gathers on rank 0's CPU: every weight in its dtype at rest (LoRA: the base in
    its load dtype; full fine-tuning: sharding.trainable_bytes, so memory_constrained gathers 16-bit weights)."""
    return shape.params * (s.load_bytes if s.lora else trainable_bytes(recipe, s))


# ----------------------------------------------------------------------------------------------- 5. communication


def _communication(recipe: Recipe, shape: Shape, s: Setup, T_grad: float, T_all: float, ga: int, ref: Reference):
    """Bytes each GPU sends per optimizer step: ring all-reduce 2T(N-1)/N, all-gather / reduce-scatter T(N-1)/N each.
    A preference run's forwards without grad gather again (reference.forwards): the policy's (LoRA's reference, KTO's
    KL batch) and a sharded reference copy's."""
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
        grad_op = L.backend == "fsdp" and L.fsdp_sharding_strategy == "SHARD_GRAD_OP"
        gathers = 1 if grad_op else 2
        policy_fwd, ref_fwd = forwards(recipe, ref)
        gathers += policy_fwd
        items.append(Item("param all-gather", ga * gathers * T_all * f / GB,
                          f"{gathers}x per micro-batch, per layer {T_all / shape.layers * f / 1e6:.0f} MB"
                          + (f" ({policy_fwd} without grad)" if policy_fwd else "")))
        items.append(Item("grad reduce-scatter", ga * T_grad * f / GB, f"per micro-batch, per layer {T_grad / shape.layers * f / 1e6:.1f} MB"))
        if ref_fwd and not grad_op:  # (SHARD_GRAD_OP keeps the copy gathered after its first forward)
            b = 2 if (s.mixed16 and L.backend == "fsdp") else ref.bytes_per_param
            items.append(Item("reference all-gather", ga * ref_fwd * shape.params * b * f / GB,
                              f"{ref_fwd}x per micro-batch (the copy's forward)"))
    return items, sum(i.gb for i in items)


# ----------------------------------------------------------------------------------------------- notes


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


def _backend_name(recipe: Recipe) -> str:
    L = recipe.launch
    if L.backend == "deepspeed":
        off = [k for k in ("offload_optimizer", "offload_params") if getattr(L, k)]
        return f"DeepSpeed ZeRO-{L.zero_stage}" + (f" + {', '.join(off)}" if off else "")
    if L.backend == "fsdp":
        return f"FSDP{L.fsdp_version} {L.fsdp_sharding_strategy}" + (" + offload_params" if L.fsdp_offload_params else "")
    return {"ddp": "DDP", "none": "single process"}[L.backend]

"""The memory of one training step of a recipe exactly as configured (torch-free arithmetic on the model's shape):
what each GPU holds at each phase, what each node's CPU RAM holds, and the verdict against the launch limits.

`estimate(recipe) -> Plan` runs the steps below in order; plan/__init__.py adds the strategies and prints the result:

1. model states per rank: weights (by dtype; 4-bit with its quant constants), gradients and Adam states of the
   trainable parameters, each divided by the ranks that shard it (DDP none; ZeRO-1 states; ZeRO-2 +grads;
   ZeRO-3/FSDP everything), a preference or online run's reference copy (reference.py) and a colocated vLLM's share
   of the GPU (generation.py) -- states.model_states;
2. what else is live at each phase of a step -- phases.live_phases: activations (activations.py), ZeRO-3/FSDP gathered
   layers (+ prefetch), gradient buckets, gradients not yet produced, optimizer temporaries. The peak is the largest
   of an online run's generation and scoring (grpo, rloo: generation.py), the reference forward (dpo, kto: after the
   policy's forward, its activations held), the start of backward, the
   backward of the last and of the first layer (grads grow while activations shrink, linearly, so the ends are the
   extremes) and the optimizer step;
3. the peak phase plus an allowance for the CUDA context and allocator fragmentation on GPUs -- `_peak` (here);
4. CPU RAM per node: processes, loading, offloaded states, a FULL_STATE_DICT save -- hostram.cpu_ram;
5. the network volume per GPU per optimizer step -- network.communication.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sftrecipes.facts.config import model_shape
from sftrecipes.facts.shape import Shape
from sftrecipes.facts.startmodel import adapter_of, base_of
from sftrecipes.plan import offload
from sftrecipes.plan.activations import activations
from sftrecipes.plan.generation import generation_note, online, plan_generation, resident, words
from sftrecipes.plan.hostram import cpu_ram, offloaded_per_rank
from sftrecipes.plan.network import communication
from sftrecipes.plan.phases import START, live_phases
from sftrecipes.plan.ranks import RankLoading, RankSteps, rank_loading, rank_steps
from sftrecipes.plan.reference import COPY, describe
from sftrecipes.plan.seqsplit import Split, data_groups
from sftrecipes.plan.seqsplit import describe as split_words
from sftrecipes.plan.sharding import GB, Setup, partitioned_4bit_load, quant_bytes_per_param, setup
from sftrecipes.plan.states import Item, ModelStates, model_states
from sftrecipes.recipe.target import PARTITIONED, RANK0_READS, checkpointing_off, weight_reading
from sftrecipes.recipe.typed import Recipe

# Runtime allowance on a GPU: CUDA context + cuBLAS/NCCL workspaces (not visible to torch's allocator, visible to
# nvidia-smi), and the caching allocator's fragmentation as a share of the memory that churns each step.
CUDA_CONTEXT_GB = 1.0
FRAGMENTATION = 0.10


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
    # strategies.Strategy rows (strategies.alternatives, set by plan.plan_recipe; strategies.py imports this module)
    alternatives: list = field(default_factory=list)
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
    generation: list[Item] = field(default_factory=list)  # grpo, rloo: what generation holds per GPU (generation.words)
    split: Split = Split()  # sequence / context parallelism (seqsplit.py): each row split over split.degree ranks
    rank_tokens: int = 0  # tokens of a micro-batch one rank holds (all of them without a split)

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
    st = model_states(recipe, shape, s)  # 1
    g = plan_generation(recipe, shape, s, st.ref) if online(recipe) else None
    if g:  # grpo, rloo: vLLM's share of a colocated GPU, resident beside the model states
        st.items.extend(resident(recipe, g))
    act = activations(recipe, shape, s, st.adapted, g.tokens if g else None)  # an online run: prompt + completion
    act, moved = offload.apply(recipe, act,  # activation_offloading: to host
                               recipe.gradient_checkpointing and not checkpointing_off(recipe, shape))
    live = live_phases(recipe, shape, s, st, act)  # 2
    phases, peak_phase, allowance = _peak(recipe, shape, s, st, live, notes)  # 3
    cpu, cpu_total = cpu_ram(recipe, shape, s, st)  # 4
    if moved:  # (during training, beside the offloaded states: not while loading)
        cpu.append(Item("offloaded activations", s.gpn * moved / GB, "per rank x ranks on the node (pinned; activation_offloading)"))
        cpu_total = cpu[0].gb + max(cpu[1].gb, sum(i.gb for i in cpu[2:]))  # (as hostram.cpu_ram sums: processes + the larger phase)
        notes.append(offload.note(moved, s.gpn, GB))
    ga = recipe.trl_value("gradient_accumulation_steps")
    comm, comm_gb = communication(recipe, shape, s, st.trainable * (2 if s.mixed16 else st.g_b),  # 5
                                   shape.params * st.gather_b, ga, st.ref, act)
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
    if g:
        notes.append(generation_note(recipe, g))
    if act.split.on:
        notes.append(split_words(act.split, act.batch * act.seq, act.tokens))
    return Plan(
        model=_model_words(recipe.model.model_name_or_path, shape.name), params=shape.params, trainable=st.trainable, world=s.world, gpus_per_node=s.gpn,
        nodes=L.num_machines, backend=_backend_name(recipe), states=st.items, peak=_items(live[peak_phase]),
        peak_phase=peak_phase, phases=phases, tensor_peak_gb=phases[peak_phase], allowance_gb=allowance,
        gpu_total_gb=total, gpu_limit_gb=L.gpu_memory_gb, fits=None if L.gpu_memory_gb is None else total <= L.gpu_memory_gb,
        cpu=cpu, cpu_total_gb=cpu_total, cpu_limit_gb=L.cpu_ram_gb,
        cpu_fits=None if L.cpu_ram_gb is None else cpu_total <= L.cpu_ram_gb, comm=comm, comm_gb=comm_gb,
        global_batch=recipe.trl_value("per_device_train_batch_size") * ga * data_groups(recipe), notes=notes,
        weights_shard_gb=(st.frozen + st.trainable * st.p_b) / s.shard_w / GB, active_params=shape.active_params,
        live={k: _items(v) for k, v in live.items()},
        rank_loading=[] if s.gpu else rank_loading(recipe, shape, s, st.float_b),
        rank_steps=None if s.gpu else rank_steps(recipe, shape, *_step_peak(phases, act.tile_unwritten / GB),
                                                     offloaded_per_rank(recipe, shape, s, st) / GB, s.quant_bits < 16),
        method=recipe.method, reference=describe(recipe, st.ref), reference_kind=st.ref.kind,
        generation=words(recipe, shape, s, st, g) if g else [], split=act.split, rank_tokens=act.tokens)


def _step_peak(phases: dict[str, float], unwritten_gb: float = 0.0) -> tuple[float, str, float]:
    """The largest phase of a training step (not loading's) as a cpu rank's RSS holds it: (its tensors' GB, its name,
    the GB of the LM head's tile buffer it holds but never writes: activations.tile_unwritten, in the phase that runs
    the head's backward)."""
    unwritten = {START: unwritten_gb}
    name = max((k for k in phases if not k.startswith("loading")), key=lambda k: phases[k] - unwritten.get(k, 0.0))
    return phases[name], name, unwritten.get(name, 0.0)


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

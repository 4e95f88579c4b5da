"""The cpu target, rank by rank: what each rank's resident memory grows by while the weights load, planned from the
loader's own rule (recipe/target.weight_reading) and the checkpoint as it is stored (torch-free), and at the peak of its
first steps (rank_steps: the per-GPU accounting of estimate.py on the rank, with what a GPU node offloads to host
memory, since here both are the process). On the cpu target the
device is the process itself, so what a GPU rank would hold on the device and what its host holds while reading are
one RSS; bench/bench_loading.py measures the same two figures per rank (the phase's peak and what is held at its end,
less the RSS before loading) and prints them beside these.

What the loader does, by weight_reading's mode (measured at 253M parameters, docs/loading.md):
- a rank that reads the checkpoint touches every page of it (F, the file's bytes): the pages are mapped, counted in
  its RSS while they stay mapped;
- a 16-bit load in the checkpoint's own dtype copies nothing: the tensors are views into the mapping, whose pages are
  touched when the backend first uses them (wrapping), not while loading;
- a load that converts (a bf16 checkpoint trained in fp32) holds its own copy, params x the load dtype's bytes;
- zero3_init: rank 0 reads the checkpoint, and every rank keeps its 1/N partition in the 16-bit dtype DeepSpeed casts
  to; the mapping goes when loading ends;
- RAM-efficient FSDP2: the other ranks build on the meta device and take untouched storage (0); 4-bit weights: rank 0
  reads and quantizes, sending each layer once quantized, and every rank keeps its FSDP2 rows of the layer's packed
  weights (quantload.py), what lies outside the layers whole;
- a partitioned or sent 4-bit load drops each layer's checkpoint pages from the reading rank once the layer is
  quantized (heap.drop_checkpoint_pages): it holds one layer's pages, not the file's;
- 4-bit: every rank reads the whole checkpoint and keeps the quantized model (the views into the checkpoint that stay
  are copied, so the mapping goes: heap.own_checkpoint_views); under ZeRO-3 with zero3_init it keeps its partition of
  each decoder layer once the layer is quantized (quantload.py), and what lies outside the layers whole.
The figures are each rank's RSS growth over its RSS before loading (the process with its libraries imported), less
the pages of the libraries' files it maps meanwhile (probes.growth_mb), as the benchmark and the tests measure it:
how many pages of a file a touch maps is the filesystem's (pages.py), so the libraries' pages are not planned, and
where a rank touches a mapped checkpoint in places, the pages it maps are planned from what one touch maps on this
machine (pages.fault_bytes on the checkpoint itself).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from sftrecipes.core.pages import FAULT_AROUND, fault_bytes
from sftrecipes.facts.config import read_config
from sftrecipes.facts.folders import check_weights
from sftrecipes.facts.shape import DTYPE_BYTES, Shape
from sftrecipes.plan.activations import TRL_TOKEN_TILE, TRL_VOCAB_TILE
from sftrecipes.plan.sharding import GB, Setup, partitioned_4bit_load, quant_bytes_per_param
from sftrecipes.recipe.target import PARTITIONED, RANK0_READS, weight_reading
from sftrecipes.recipe.typed import Recipe

# Measured on every CPU twin at 25.7M parameters (tests/launch/test_twins.py) and 253M (bench/bench_loading.py), 2 ranks, as
# growth less the libraries' file pages (probes.growth_mb), on ext4 (4 KiB page cache) and from a tmpfs with
# huge=always (2 MiB folios): the same figures within a few MB, where the libraries' pages differed by 50 MB.
#
# what loading leaves in a rank's RSS besides the weights: the modeling modules from_pretrained imports and the
# model's Python objects: 17-19 MB per rank on every twin whose loading copies nothing or partitions; it does not grow
# with the model. It accrues while the weights load, within what the checkpoint's pages give back when the mapping
# goes, so a rank's peak is the larger of reading (pages + its own weights + a quantization's temporaries) and the end
# (its own weights + this).
LOAD_OVERHEAD_GB = 0.019
# under DeepSpeed the RSS before loading already holds those modules and 18 MB more (deepspeed and what accelerate's
# plugin builds are imported before the weights load), and loading leaves 0-3 MB beside the weights
DEEPSPEED_LOAD_OVERHEAD_GB = 0.002
# what the first steps add to a rank's RSS besides the tensors the per-GPU accounting counts (phases.live_phases)
# and what loading left: the optimizer's and autograd's objects, oneDNN's primitive cache (the kernels built for each
# new shape), gloo's buffers, the trainer's own state. Measured with the heap held steady (heap.hold_steady) over the
# planned tensors and the loading overhead: 30-56 MB at 25.7M on every backend but ZeRO-3 and 51-82 MB on ZeRO-3; at
# 253M ~20 MB more on most backends (DDP 71-76, ZeRO-1/2 64-67, QLoRA FSDP2 75-78, ZeRO-3 75-97; FSDP1/FSDP2 19-46,
# whose 2.2 GB plans are within 3% either way). Planned as STEPS_OVERHEAD_GB + STEPS_BYTES_PER_LARGEST per element of
# the model's largest weight (0.8M elements at 25.7M, 4.2M at 253M): a fit over the two sizes, not attributed (a
# 16-bit and an fp32 copy of a weight a step would make: oneDNN's reordered weights, autocast's casts, are candidates);
# ZeRO-3 holds ZERO3_STEPS_OVERHEAD_GB more (not attributed: its coordinator's state and the hooks it hangs on every
# parameter and module)
STEPS_OVERHEAD_GB = 0.043
STEPS_BYTES_PER_LARGEST = 6
ZERO3_STEPS_OVERHEAD_GB = 0.025
# 4-bit weights under FSDP2 hold 8-10 MB more over their first steps than that, at 25.7M (92-98 MB measured in five
# runs across ranks and filesystems, against 87 without it) and at 253M alike (216-219 against 209): not attributed
FSDP2_4BIT_STEPS_OVERHEAD_GB = 0.009
# a rank's RSS before loading, which the figures above grow from, less its libraries' file pages: python's and the
# libraries' own memory, the tokenized data; measured 387 MB on the DDP and FSDP twins and 405 MB under DeepSpeed
# (deepspeed imported first) at 25.7M and 253M alike, on ext4 and tmpfs alike (torch 2.13 CPU, x86_64). The
# libraries' file pages come on top: 141 MB on ext4 here, 245-270 MB where the page cache holds large folios
PROCESS_BASELINE_GB = 0.387
DEEPSPEED_BASELINE_GB = 0.018
# bitsandbytes 0.50.2's CPU quantization of one weight: 14 bytes per element of temporaries besides the weight (its
# float copies and codes), measured at 4.2M and 16.8M elements after the first call's own setup
# (tests/plan/test_plan.py::test_cpu_quantization_temporaries_per_element_as_planned); one weight at a time
QUANTIZE_BYTES_PER_ELEMENT = 14
_STORED = {"F32": 4, "BF16": 2, "F16": 2, "F64": 8, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}


@dataclass
class RankLoading:
    """One group of ranks that load alike: their RSS growth at the loading phase's peak and at its end."""

    ranks: str  # "rank 0", "ranks 1-7", "every rank"
    peak_gb: float
    held_gb: float
    items: list[tuple[str, float, str]] = field(default_factory=list)  # (what, GB, why) making the peak
    # where the filesystem's page cache holds large folios, one touch of a mapped checkpoint maps more than the
    # kernel's 64 KiB fault-around (pages.fault_bytes), and a rank that touches it in places can peak and hold up to:
    peak_up_to_gb: float | None = None
    held_up_to_gb: float | None = None


@dataclass
class RankSteps:
    """Every rank's RSS growth at the peak of its first steps on the cpu target (each rank alike: the per-GPU
    accounting is the same on every rank), and the RSS it grows from."""

    peak_gb: float
    items: list[tuple[str, float, str]] = field(default_factory=list)
    baseline_gb: float = 0.0


def baseline_gb(recipe: Recipe) -> float:
    """A rank's RSS before loading on the cpu target, less its libraries' file pages (PROCESS_BASELINE_GB,
    measured), by backend."""
    return PROCESS_BASELINE_GB + (DEEPSPEED_BASELINE_GB if recipe.launch.backend == "deepspeed" else 0.0)


def loading_left(recipe: Recipe) -> list[tuple[str, float, str]]:
    """What loading leaves in a rank's RSS besides the weights (measured), by backend (LOAD_OVERHEAD_GB,
    DEEPSPEED_LOAD_OVERHEAD_GB); a quantized load leaves no more (bitsandbytes' native library is file pages)."""
    o = DEEPSPEED_LOAD_OVERHEAD_GB if recipe.launch.backend == "deepspeed" else LOAD_OVERHEAD_GB
    return [("loading overhead", o, "modules imported and objects built by from_pretrained (measured)")]


def rank_steps(recipe: Recipe, shape: Shape, tensor_peak_gb: float, peak_phase: str, unwritten_gb: float,
               offloaded_gb: float, quantized: bool) -> RankSteps:
    """A rank's RSS growth at the peak of its first steps on the cpu target, where the device is the process: the
    per-GPU tensors at the step's peak phase, less the pages of the LM head's tile buffer a narrow vocabulary never
    writes (activations.tile_unwritten: allocated, never resident), what a GPU run would offload to host memory (the
    same process here), what loading left and what the steps add besides tensors (STEPS_OVERHEAD_GB,
    STEPS_BYTES_PER_LARGEST)."""
    largest = max((w.numel for layer in shape.decoder for w in layer.weights), default=0)
    items = [(f"tensors at the peak ({peak_phase})", tensor_peak_gb, "the per-GPU accounting above, on this rank"),
             ("LM head tile never written", -unwritten_gb, f"of its {TRL_TOKEN_TILE} x {TRL_VOCAB_TILE} buffer, the columns "
              f"past the vocabulary's {shape.vocab}: allocated, never resident"),
             ("offloaded states", offloaded_gb, "host memory on a GPU node: the same process here"),
             ("loading overhead", sum(i[1] for i in loading_left(recipe)), "left by loading (measured)"),
             ("steps overhead", STEPS_OVERHEAD_GB + largest * STEPS_BYTES_PER_LARGEST / GB,
              f"optimizer and autograd objects, oneDNN's kernels, gloo: {STEPS_OVERHEAD_GB * 1e3:.0f} MB + "
              f"{STEPS_BYTES_PER_LARGEST} B x the largest weight's {largest / 1e6:.1f}M elements (measured)"),
             ("ZeRO-3's own", ZERO3_STEPS_OVERHEAD_GB if recipe.launch.backend == "deepspeed" and recipe.launch.zero_stage == 3
              else 0.0, "what ZeRO-3 holds more than ZeRO-1/2 (measured, not attributed yet)"),
             ("4-bit under FSDP2", FSDP2_4BIT_STEPS_OVERHEAD_GB if quantized and recipe.launch.backend == "fsdp"
              and recipe.launch.fsdp_version == 2 else 0.0, "what 4-bit weights under FSDP2 hold more (measured, not attributed yet)")]
    items = [i for i in items if i[1] != 0]
    return RankSteps(sum(i[1] for i in items), items, baseline_gb(recipe))


def loading_of(groups: list[RankLoading], rank: int) -> RankLoading:
    """The group a rank belongs to: "every rank", "rank 0", "rank 1" or "ranks 1-N"."""
    return next(g for g in groups if g.ranks in ("every rank", f"rank {rank}") or (rank > 0 and g.ranks.startswith("ranks 1-")))


def checkpoint_bytes(name: str, shape: Shape) -> tuple[float, int | None, int, Path | None]:
    """(bytes of the checkpoint's tensors, bytes per stored float, tensors, its largest file): from the safetensors
    headers of a local folder, else the parameters at the config's dtype and the shape's weights (hub ids: the
    shipped config) and no file."""
    headers = check_weights(name)  # whole, or one line naming the file (model_name_or_path: ... is truncated)
    if headers:
        total, count, widths = 0, 0, {}
        for header in headers.values():
            for v in header.values():
                n = v["data_offsets"][1] - v["data_offsets"][0]
                total, count = total + n, count + 1
                widths[_STORED.get(v["dtype"], 0)] = widths.get(_STORED.get(v["dtype"], 0), 0) + n
        return float(total), max(widths, key=widths.get) if widths else None, count, max(headers, key=lambda f: f.stat().st_size)
    cfg = read_config(name)
    dtype = cfg.get("dtype") or cfg.get("torch_dtype") or (cfg.get("text_config") or {}).get("dtype")
    width = DTYPE_BYTES.get(str(dtype)) if dtype else None
    count = sum(len(layer.weights) for layer in shape.decoder) + 2 + (0 if shape.tied else 1)  # + embedding, norm, head
    return float(shape.params * (width or 2)), width, count, None


def rank_loading(recipe: Recipe, shape: Shape, s: Setup, float_b: int) -> list[RankLoading]:
    """Each group of ranks' RSS growth while the weights load on the cpu target (the module docstring's rules)."""
    N = s.world
    mode, why = weight_reading(recipe, quantized=s.quant_bits < 16)
    F, stored_b, tensors, largest_file = checkpoint_bytes(recipe.model.model_name_or_path, shape)
    over = loading_left(recipe)
    o = sum(i[1] for i in over)

    def group(ranks: str, reading: float, own: float, items: list) -> RankLoading:
        return RankLoading(ranks, max(reading, own + o), own + o, items + over)
    read = ("checkpoint pages read", F / GB, f"the {F / 1e6:,.0f} MB checkpoint, mapped while it loads")
    others = f"ranks 1-{N - 1}" if N > 2 else "rank 1"
    if s.quant_bits < 16 and mode in (PARTITIONED, RANK0_READS):
        ld = partitioned_4bit_load(recipe, shape, N, float_b)
        tmp = ld.largest * QUANTIZE_BYTES_PER_ELEMENT / GB
        how = "partitioned" if mode == PARTITIONED else "sent to the other ranks and kept by FSDP2 rows"
        share = ("its partition of the layers", ld.share / GB, f"{shape.layers} decoder layers (4-bit linear weights, the "
                 f"rest in {float_b}-byte floats) / {N} ranks, each {how} once quantized (quantload.py)")
        states = ("quantization states", ld.states / GB, "the layers' absmax (and nested statistics), whole on every rank: "
                  "bitsandbytes reads them after each gather")
        outside = ("outside the layers", ld.outside / GB, "embeddings, final norm, head, whole: "
                   + ("copied out of the mapping at the end (heap.own_checkpoint_views), partitioned later by the engine"
                      if mode == PARTITIONED else "sent by rank 0 once loading ends, sharded later by FSDP2"))
        # the checkpoint's pages are dropped once each layer is quantized (heap.drop_checkpoint_pages): a reader holds
        # those of one layer, and those of what lies outside the layers read before the first layer
        layer_params = max(layer.params for layer in shape.decoder)
        pages = min(F, (layer_params + shape.params - sum(layer.params for layer in shape.decoder)) * (stored_b or 2))
        read = ("checkpoint pages read", pages / GB, f"one decoder layer's of the {F / 1e6:,.0f} MB checkpoint (and what "
                "lies outside the layers): each layer's pages are dropped once it is quantized (heap.drop_checkpoint_pages)")
        items = [read, share, states,
                 ("one layer whole", ld.layer / GB, "the layer being quantized, until its last weight is set"),
                 ("quantizing one weight", tmp, f"the largest, {ld.largest / 1e6:.1f}M elements x {QUANTIZE_BYTES_PER_ELEMENT} B"),
                 outside]
        reader = group("every rank" if mode == PARTITIONED else "rank 0",
                       (pages + ld.share + ld.states) / GB + max(ld.layer / GB + tmp, ld.outside / GB), ld.kept / GB, items)
        if mode == PARTITIONED or N == 1:
            return [reader]
        # the others read nothing: each tensor arrives whole in a buffer, of a layer's packed weights only the rows kept
        return [reader, group(others, ld.kept / GB, ld.kept / GB, [share, states, outside])]
    if s.quant_bits < 16:
        lin = shape.linear_params
        q = (lin * quant_bytes_per_param(recipe) + (shape.params - lin) * float_b) / GB
        kept = ("quantized model", q, f"{lin / 1e6:,.1f}M linear weights in {s.quant_bits}-bit + the rest in {float_b}-byte floats")
        big = max((w.numel for layer in shape.decoder for w in layer.weights if w.kind == "linear"), default=0)
        tmp = ("quantizing one weight", big * QUANTIZE_BYTES_PER_ELEMENT / GB,
               f"the largest, {big / 1e6:.1f}M elements x {QUANTIZE_BYTES_PER_ELEMENT} B (bitsandbytes' CPU quantizer)")
        return [group("every rank", F / GB + q + tmp[1], q, [read, kept, tmp])]
    if mode == PARTITIONED:
        part = shape.params * float_b / N / GB
        kept = ("its partition", part, f"{shape.params / 1e6:,.1f}M x {float_b} B / {N} ranks (zero.Init)")
        return [group("rank 0", F / GB + part, part, [read, kept])] + ([group(others, part, part, [kept])] if N > 1 else [])
    # what one touch of the checkpoint's mapping makes resident here, for the ranks below that touch it in places
    touch = fault_bytes(largest_file) if largest_file is not None else FAULT_AROUND
    if stored_b is not None and stored_b != s.load_bytes:  # converted: a copy of its own
        own = shape.params * s.load_bytes / GB
        mine = group("every rank", F / GB + own, own,
                     [read, ("its own copy", own, f"{shape.params / 1e6:,.1f}M x {s.load_bytes} B (stored in {stored_b}-byte floats)")])
    else:
        around, up_to = min(F, tensors * FAULT_AROUND) / GB, min(F, tensors * max(touch, FAULT_AROUND)) / GB
        mine = group("every rank", around, around,
                     [("checkpoint mapped", around, f"views into the mapped file: {tensors} tensors x the 64 KiB the kernel "
                       "maps around the first page loading touches; up to the whole folio where the page cache holds large "
                       f"ones ({touch >> 10:,} KiB a touch here: pages.fault_bytes); the rest when the backend first uses them")])
        if up_to > around:
            mine.peak_up_to_gb, mine.held_up_to_gb = mine.peak_gb + up_to - around, mine.held_gb + up_to - around
    if mode == RANK0_READS and N > 1:
        mine.ranks = "rank 0"
        meta = group(others, 0.0, 0.0, [("meta device", 0.0, why)])
        # transformers still maps the checkpoint on the meta device and walks its tensors, touching some of their
        # pages, and unmaps it before loading ends: ~0 where a touch maps 64 KiB (measured), up to 17 MB of the 51 MB
        # medium Llama's where it maps 2 MiB folios; planned as up to one touch per tensor
        meta.peak_up_to_gb = meta.peak_gb + min(F, tensors * max(touch, FAULT_AROUND)) / GB
        return [mine, meta]
    return [mine]

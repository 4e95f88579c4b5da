"""The reference model of a preference run (method dpo or kto; orpo and cpo have none) or an online one (grpo, rloo
with beta > 0) as the planner counts it: which reference the run uses, and the bytes it holds per GPU (torch-free).

The rule is methods.needs_reference_copy's and TRL 1.16's (DPOTrainer / KTOTrainer `__init__`, trl.models.utils
prepare_deepspeed / prepare_fsdp):
- grpo / rloo with beta 0 (GRPO's default): no reference model at all (GRPOTrainer / RLOOTrainer `__init__`); with beta
  > 0 as below (they have no precompute_ref_log_probs);
- precompute_ref_log_probs: no copy and no reference forward during training; one forward pass over the data before
  step 1 writes the reference log-probs into the dataset (with LoRA through the base, the adapter disabled). A full
  fine-tune under FSDP: TRL loads a copy itself for that pass (the policy is not sharded until train()):
  `create_model_from_path` in the policy's dtype with device_map "auto", whole on the GPU until prepare_fsdp shards
  it, freed before training;
- LoRA (QLoRA included): no copy; TRL disables the adapter for the reference forward (`use_adapter`), the base is the
  reference: 0 bytes;
- else a second copy loaded exactly as the policy (model.load_model), frozen (no gradients, no optimizer states) and
  prepared like it: ZeRO-3 partitions it over every rank (an inference engine, bf16/fp16 when the run is), ZeRO-1/2
  run it as ZeRO-0 (whole on each GPU, cast to the engine's 16 bits), FSDP shards it over the policy's ranks in its
  load dtype, DDP / one process hold it whole; with parameter offload (DeepSpeed offload_param, FSDP cpu_offload,
  both kept for the reference) it lives in host RAM.
"""

from __future__ import annotations

from dataclasses import dataclass

from sftrecipes.facts.shape import Shape
from sftrecipes.plan.sharding import GB, Setup
from sftrecipes.recipe.schema import ONLINE, REFERENCE_FREE
from sftrecipes.recipe.typed import Recipe

NONE, ADAPTER, COPY, PRECOMPUTED = "", "adapter", "copy", "precomputed"
FREE = "free"  # orpo, cpo: the method has no reference model
NO_KL = "no-kl"  # grpo, rloo with beta 0: no KL term, no reference model


@dataclass(frozen=True)
class Reference:
    """What a run's reference costs: its kind, and the bytes of a copy (whole, and each GPU's share at rest)."""

    kind: str  # NONE (sft), FREE (orpo, cpo), NO_KL (grpo, rloo with beta 0), ADAPTER, COPY or PRECOMPUTED
    bytes_per_param: int = 0  # of a copy, as held
    ranks: int = 1  # ranks a copy is sharded over
    whole: float = 0.0  # bytes of the whole copy
    offloaded: bool = False  # the copy's shards live in host RAM
    precompute_load: float = 0.0  # FSDP + precompute: bytes of the copy TRL loads whole on each GPU for the pass

    @property
    def per_gpu(self) -> float:
        """Bytes of the copy resident on each GPU during training (its shard, or all of it)."""
        return 0.0 if self.offloaded else self.whole / self.ranks

    @property
    def per_rank(self) -> float:
        """Bytes of the copy one rank holds, on the GPU or offloaded."""
        return self.whole / self.ranks


def reference(recipe: Recipe, shape: Shape, s: Setup, float_b: int) -> Reference:
    """The recipe's reference (`float_b`: bytes per weight of the policy at rest: DeepSpeed's 16-bit module or the
    load dtype)."""
    if recipe.method == "sft":
        return Reference(NONE)
    if recipe.method in REFERENCE_FREE:
        return Reference(FREE)
    if recipe.method in ONLINE and not recipe.trl_value("beta"):
        return Reference(NO_KL)
    lora = recipe.model.use_peft_lora
    # (with LoRA the precompute pass runs the base, the adapter disabled)
    if recipe.method not in ONLINE and recipe.trl_value("precompute_ref_log_probs"):
        # a full fine-tune under FSDP: TRL's own copy, in the policy's (load) dtype, whole while it loads
        load = shape.params * s.load_bytes if recipe.launch.backend == "fsdp" and not lora else 0.0
        return Reference(PRECOMPUTED, precompute_load=load)
    if lora:
        return Reference(ADAPTER)
    # a copy sharded like the policy's weights: ZeRO-3 / FSDP over their ranks (s.shard_w), ZeRO-1/2 and DDP whole
    return Reference(COPY, float_b, s.shard_w, shape.params * float_b, s.offload_params)


def forwards(recipe: Recipe, ref: Reference) -> tuple[int, int]:
    """Forward passes per micro-batch besides the policy's forward with grad: (the policy's, run without grad: the
    reference with the adapter disabled, KTO's KL batch; the reference copy's). DPO: one reference forward over the
    chosen and rejected sequences; KTO: the KL batch (mismatched completions) through the policy, then the KL batch
    and the completions through the reference (none of it for apo_zero_unpaired, which has no KL term)."""
    if ref.kind in (NONE, FREE, NO_KL):
        return 0, 0
    kl = recipe.method == "kto" and recipe.trl_value("loss_type") != "apo_zero_unpaired"
    ref_passes = 0 if ref.kind == PRECOMPUTED else 1 + kl
    return int(kl) + (ref_passes if ref.kind == ADAPTER else 0), ref_passes if ref.kind == COPY else 0


def describe(recipe: Recipe, ref: Reference) -> str:
    """The reference in words, with what it holds per GPU ("" for sft): the line printed under the verdict."""
    if ref.kind == NONE:
        return ""
    head = f"reference ({recipe.method}): "
    if ref.kind == FREE:
        return head + "none: the method compares chosen with rejected under the policy alone: 0 GB per GPU"
    if ref.kind == NO_KL:
        return head + "none: beta 0, no KL term, so TRL loads no reference model: 0 GB per GPU"
    if ref.kind == ADAPTER:
        return head + "the base with the adapter disabled (LoRA), no second copy: 0 GB per GPU"
    if ref.kind == PRECOMPUTED:
        out = (head + "precomputed reference log-probs: no copy during training, one extra forward pass over the data "
               "before step 1")
        if ref.precompute_load:
            out += (f"; under FSDP TRL loads its own copy for that pass, whole on each GPU until it shards it "
                    f"({_size(ref.precompute_load)}), freed before step 1")
        return out
    where = (f"sharded over {ref.ranks} ranks" if ref.ranks > 1 else "whole on every GPU")
    held = f"{_size(ref.per_rank)} per GPU" if not ref.offloaded else f"{_size(ref.per_rank)} per rank in host RAM (offload)"
    return head + f"a second copy of the model, frozen, {where} ({ref.bytes_per_param}-byte weights): {held}"


def _size(n: float) -> str:
    return f"{n / GB:.1f} GB" if n >= 0.1 * GB else f"{n / 1e6:.1f} MB"

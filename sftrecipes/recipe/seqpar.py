"""Long context as recipe keys: sequence parallelism (Ulysses, on DeepSpeed) and context parallelism (ring attention,
on FSDP2), `SequenceOptions`, a base of schema.LaunchOptions, and their rules before torch loads (`check_sequence`).

Ulysses splits each sequence over `sequence_parallel_size` ranks; in every attention layer an all-to-all exchange gives
each rank the whole sequence for heads/N of the heads (DeepSpeed's UlyssesSPAttentionHF, set up by accelerate's
ParallelismConfig(sp_backend="deepspeed")). So the query heads must divide by N, and the key/value heads divide by N or
N by them (DeepSpeed replicates too few key/value heads). The rest of the ranks (world / N) are data-parallel groups.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from sftrecipes.core.errors import RecipeError
from sftrecipes.facts.config import config_path, model_shape

if TYPE_CHECKING:
    from sftrecipes.recipe.typed import Recipe

SP_KEY, CP_KEY = "launch.sequence_parallel_size", "launch.context_parallel_size"


def _opt(default, help_: str):
    return field(default=default, metadata={"help": help_})


@dataclass
class SequenceOptions:
    """The launch keys that split each sequence over several ranks (a base of schema.LaunchOptions)."""

    sequence_parallel_size: int = _opt(
        1, "Ulysses sequence parallelism (deepspeed only, ZeRO-1/2/3; method sft): each sequence is split over this "
        "many ranks, and each attention layer exchanges them (all-to-all) so that every rank attends the whole sequence "
        "with heads/N of the heads; activations per rank fall by N. The model's attention heads must divide by N (its "
        "key/value heads by N, or N by them). The world size must divide by N; world/N ranks are data-parallel "
        "groups, so the global batch is per_device_train_batch_size x gradient_accumulation_steps x world/N. Packed "
        "rows keep their samples apart (the project's varlen kernel). 1: off.")
    context_parallel_size: int = _opt(
        1, "Ring context parallelism (fsdp version 2 on GPUs; method sft, no packing): each sequence is split over this "
        "many ranks and attention passes keys/values around a ring (torch's context parallel, sdpa). Refused on the cpu "
        "target (torch's ring attention is broken for causal sdpa on CPU, pytorch#147793): use "
        "launch.sequence_parallel_size there. 1: off.")


def head_counts(model: str) -> list[tuple[int, int]]:
    """(query heads, key/value heads) of the model's decoder layers, each pair once; [] where no config is readable
    here (a hub id without the network: each rank's loader checks again, as DeepSpeed does)."""
    if not model or not config_path(model).is_file():
        return []
    try:
        layers = model_shape(model).decoder
    except RecipeError:
        return []
    return sorted({(lay.heads, lay.kv_heads or lay.heads) for lay in layers if lay.heads})


def sp_degrees(heads: list[tuple[int, int]], most: int = 64) -> list[int]:
    """The sequence-parallel sizes up to `most` the head counts allow (Ulysses' rule)."""
    return [n for n in range(1, most + 1)
            if all(h % n == 0 and (kv % n == 0 or n % kv == 0) for h, kv in heads)]


def check_sequence(r: Recipe) -> None:
    """Sequence/context parallelism only where it runs: its backend, a method whose loss it can split, a world size
    and head counts it divides, attention that takes a split sequence; both at once refused."""
    L = r.launch
    sp, cp = L.sequence_parallel_size, L.context_parallel_size
    for key, n in ((SP_KEY, sp), (CP_KEY, cp)):
        if n < 1:
            raise RecipeError(f"{key}: must be >= 1, got {n}; 1 leaves each sequence on one rank")
    if sp > 1 and cp > 1:
        raise RecipeError(f"{CP_KEY}: {cp} with {SP_KEY} {sp}; the two split the sequence in different ways "
                          "(accelerate runs one at a time): keep one of them")
    n, key = (sp, SP_KEY) if sp > 1 else (cp, CP_KEY)
    if n == 1:
        return
    if r.method != "sft":
        raise RecipeError(f"{key}: splits each sequence for sft's token loss (transformers' Trainer sums it over the "
                          f"sequence's ranks), and method {r.method} computes its loss over whole sequences (TRL "
                          f"supports it for SFT only); remove {key}, or train with method: sft")
    if L.world_size % n:
        raise RecipeError(f"{key}: {n} does not divide the {L.world_size} processes (num_machines x gpus_per_node); "
                          f"the ranks form groups of {n}: set it to a divisor of {L.world_size}")
    trl = r.trl
    if trl.get("loss_type") == "dft" or (trl.get("label_smoothing_factor") or 0) > 0:
        what = "loss_type: dft" if trl.get("loss_type") == "dft" else "label_smoothing_factor"
        raise RecipeError(f"{what}: the loss under {key} is the model's own token loss, summed over the sequence's "
                          f"ranks (TRL refuses the others); remove {what.split(':')[0]}, or {key}")
    pad = trl.get("pad_to_multiple_of")
    if pad and pad % n:
        raise RecipeError(f"pad_to_multiple_of: {pad} is not a multiple of {key} {n}, and every batch's length must "
                          f"divide by it; set pad_to_multiple_of to a multiple of {n}, or remove it (the run then pads "
                          f"to a multiple of {n})")
    if cp > 1:
        _check_context(r, cp)
        return
    if L.backend != "deepspeed":
        raise RecipeError(f"{SP_KEY}: Ulysses runs on DeepSpeed and launch.backend is {L.backend}; set launch.backend: "
                          f"deepspeed (ZeRO-1, 2 or 3){', or ' + CP_KEY + ' for FSDP2 on GPUs' if L.backend == 'fsdp' else ''}")
    if L.zero_stage == 0:
        raise RecipeError(f"{SP_KEY}: runs with ZeRO-1, 2 or 3, and launch.zero_stage is 0; set launch.zero_stage: 1, "
                          "2 or 3")
    if r.model.attn_implementation in ("eager", "flex_attention") and not r.model.use_flash_attn:
        raise RecipeError(f"attn_implementation: {r.model.attn_implementation} cannot attend a sequence split by "
                          f"{SP_KEY} (DeepSpeed's Ulysses drops the dense mask it needs); set attn_implementation: "
                          "auto, sdpa or flash_attention_2")
    from sftrecipes.recipe.target import packed as packs  # (at the top: a cycle, target -> typed -> schema -> here)

    packed = packs(r)
    if packed and r.model.attn_implementation == "sdpa":
        raise RecipeError(f"attn_implementation: sdpa keeps packed samples apart with a mask, which {SP_KEY} drops "
                          "(each rank attends the gathered sequence causally): the samples would attend across their "
                          "boundaries; set attn_implementation: auto (sft_varlen reads them from the positions) or "
                          "flash_attention_2, or packing: false")
    if r.data.streaming:
        raise RecipeError(f"streaming: not proven under {SP_KEY} (the stream's position counts each rank's rows, and a "
                          "sequence-parallel group trains one rank's batch at a time); set streaming: false (the data "
                          f"is prepared once and cached), or remove {SP_KEY}")
    heads = head_counts(r.model.model_name_or_path)
    fits = sp_degrees(heads)
    if heads and sp not in fits:
        h, kv = next((h, kv) for h, kv in heads if h % sp or (kv % sp and sp % kv))
        why = (f"its {h} attention heads" if h % sp else f"its {kv} key/value heads (neither divides the other)")
        raise RecipeError(f"{SP_KEY}: {sp} does not split the model's heads: each rank attends heads/{sp} of them, "
                          f"and {sp} does not divide {why}; set it to one of "
                          f"{', '.join(str(d) for d in fits if d > 1 and L.world_size % d == 0) or '1 (none fits)'}")


def _check_context(r: Recipe, cp: int) -> None:
    L = r.launch
    if L.hardware == "cpu":
        raise RecipeError(f"{CP_KEY}: torch's ring attention needs GPUs (on CPU it is broken for causal sdpa, "
                          f"pytorch#147793) and launch.hardware is cpu; use {SP_KEY} (Ulysses, on DeepSpeed) here, or "
                          "run on GPUs")
    if L.backend != "fsdp" or L.fsdp_version != 2:
        raise RecipeError(f"{CP_KEY}: ring context parallelism runs on FSDP2 and the recipe runs "
                          f"{L.backend if L.backend != 'fsdp' else 'fsdp version 1'}; set launch.backend: fsdp with "
                          f"launch.fsdp_version: 2, or use {SP_KEY} on DeepSpeed")
    from sftrecipes.recipe.target import packed  # (at the top: a cycle, target -> typed -> schema -> here)

    if packed(r):
        raise RecipeError(f"packing: ring context parallelism attends with full causal masks, so packed samples would "
                          f"attend across their boundaries (TRL refuses it); set packing: false, or use {SP_KEY}, "
                          "which keeps packed samples apart")
    if r.model.attn_implementation not in ("auto", "sdpa") or r.model.use_flash_attn:
        raise RecipeError(f"attn_implementation: torch's context parallelism runs sdpa only; set "
                          f"attn_implementation: sdpa (and use_flash_attn: false), or use {SP_KEY}")

"""A sequence split over ranks in the plan's terms (Ulysses' sequence parallelism, the ring's context parallelism):
the tokens one rank holds, the key/value heads its attention kernel holds, what the exchanges hold while they run and
send per step, and the data-parallel groups left (torch-free arithmetic).

Ulysses (launch.sequence_parallel_size N, DeepSpeed's UlyssesSPAttentionHF, deepspeed/runtime/sequence_parallel/
ulysses_sp.py): the data loader adapter hands each rank seq/N tokens of every row (the row padded to a multiple of N),
and everything outside attention -- embeddings, norms, MLP, LoRA, the LM head and its loss, the layer inputs
checkpointing keeps -- runs on those tokens. In each attention layer `_combine_local_sequences` turns q, k and v from
(seq/N tokens, all heads) into (all seq tokens, heads/N heads) by an all-to-all, the attention kernel runs on the whole
sequence for its heads/N heads and saves those (the same bytes as seq/N tokens of all heads), and
`_partition_global_sequence` brings the output back. Key/value heads fewer than N are replicated first
(`kv_replication_factor`: each rank then holds one key/value head), so per local token the kernel holds
max(kv heads, N) key/value heads. Each exchange (`_dim_zero_all_to_all`) makes its input contiguous (a copy laid out
[N, seq/N, batch, heads/N, head size]) and receives into `torch.empty_like(input)`: two buffers of the exchanged
tensor's size live at once, and its backward does the same for the gradient. The attention mask is dropped (sdpa runs
causal, the project's varlen kernel reads the gathered position_ids), so no dense mask and no key/value repeat for a
mask. ZeRO keeps partitioning over every rank (DeepSpeed's sequence-data-parallel group), so the model states do not
change; world/N ranks are data-parallel groups, which is what the global batch counts.

Ring context parallelism (launch.context_parallel_size, torch's context_parallel on FSDP2, GPUs only): each rank holds
seq/cp tokens of every row and attends its queries against every peer's keys/values passed around the ring, one
block in flight beside its own (and in backward the block's gradients too); it saves its own q, k, v, output and
logsumexp. Planned the same way, not measured here (no GPU: recipe/seqpar.py refuses it on the cpu target).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from sftrecipes.facts.shape import Layer
from sftrecipes.recipe.seqpar import CP_KEY, SP_KEY
from sftrecipes.recipe.typed import Recipe

ULYSSES, RING = "sequence parallel", "context parallel"
POSITION_BYTES = 8  # each attention layer all-gathers the int64 position_ids (Ulysses)


@dataclass(frozen=True)
class Split:
    """Over how many ranks each row is split (1: none), by which scheme, set by which recipe key."""

    degree: int = 1
    kind: str = ""
    key: str = ""

    @property
    def on(self) -> bool:
        return self.degree > 1


def split(recipe: Recipe) -> Split:
    """The recipe's split of each row (recipe/seqpar.check_sequence allows one of the two at a time)."""
    L = recipe.launch
    if L.sequence_parallel_size > 1:
        return Split(L.sequence_parallel_size, ULYSSES, SP_KEY)
    if L.context_parallel_size > 1:
        return Split(L.context_parallel_size, RING, CP_KEY)
    return Split()


def data_groups(recipe: Recipe) -> int:
    """Data-parallel groups: the ranks over the split's degree (each group trains on one row at a time)."""
    return recipe.launch.world_size // split(recipe).degree


def rank_tokens(tokens: int, sp: Split) -> int:
    """Tokens of a micro-batch one rank holds: its 1/N of every row (the run pads each row to a multiple of N)."""
    return math.ceil(tokens / sp.degree)


def kv_heads(layer: Layer, sp: Split) -> int:
    """Key/value heads the attention kernel holds per local token: Ulysses replicates fewer than N to N
    (kv_replication_factor), so max(kv, N); the ring and no split: the layer's own."""
    kv = layer.kv_heads or layer.heads
    return max(kv, sp.degree) if sp.kind == ULYSSES else kv


def exchange_working(layer: Layer, a: int, tokens: int, sp: Split) -> float:
    """Bytes one layer's attention holds in its backward beyond what the layer saved, under the split (`tokens`: the
    rank's). Ulysses: the output's gradient, one exchange's two buffers (the contiguous input and the all-to-all's
    output, of the largest exchanged tensor) and the kernel's gradients of the gathered q, k, v. Ring: the keys/values
    of one peer's block and their gradients in flight. 0 without a split."""
    if not sp.on:
        return 0.0
    q, kv = layer.heads * layer.head_dim, kv_heads(layer, sp) * layer.head_dim
    if sp.kind == ULYSSES:
        return a * tokens * (q + 2 * max(q, kv) + q + 2 * kv)
    return a * tokens * 2 * kv * 2


def exchange_sent(layer: Layer, a: int, tokens: int, sp: Split) -> tuple[float, float]:
    """(bytes one rank sends in one layer's forward, in its backward) for a micro-batch of `tokens` tokens per rank.
    Ulysses: an all-to-all keeps 1/N of a tensor and sends the rest, of q, k, v (k and v as replicated) and the output
    each way, plus the position_ids all-gathered in the forward. Ring: the keys/values of its block to the next rank
    N-1 times, in backward with their gradients."""
    if not sp.on:
        return 0.0, 0.0
    n = sp.degree
    q, kv = layer.heads * layer.head_dim, kv_heads(layer, sp) * layer.head_dim
    if sp.kind == ULYSSES:
        moved = a * tokens * (2 * q + 2 * kv) * (n - 1) / n
        return moved + POSITION_BYTES * tokens * (n - 1), moved
    block = a * tokens * 2 * kv
    return block * (n - 1), 2 * block * (n - 1)


def describe(sp: Split, row_tokens: int, tokens: int) -> str:
    """The plan's words for the split: degree, the tokens one rank holds, the data-parallel groups."""
    how = ("Ulysses all-to-all in each attention layer: the whole sequence for heads/N heads" if sp.kind == ULYSSES
           else "ring attention: one peer's keys/values in flight; GPU only, not measured here")
    return f"{sp.kind} {sp.degree} ({sp.key}): {tokens} of each micro-batch's {row_tokens} tokens per rank; {how}"

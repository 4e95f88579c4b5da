"""The network volume each GPU sends per optimizer step, by backend: gradient all-reduce, reduce-scatter, the
all-gathers of sharded parameters (a preference run's forwards without grad included; an online run's generation),
and a sequence split's exchanges in every attention layer (Ulysses' all-to-all, the ring's key/value blocks)."""

from __future__ import annotations

from sftrecipes.facts.shape import Shape
from sftrecipes.plan.activations import Activations
from sftrecipes.plan.generation import generation_comm, online, online_forwards, plan_generation
from sftrecipes.plan.reference import Reference, forwards
from sftrecipes.plan.seqsplit import ULYSSES, exchange_sent
from sftrecipes.plan.sharding import GB, Setup
from sftrecipes.plan.states import Item
from sftrecipes.recipe.target import checkpointing_off
from sftrecipes.recipe.typed import Recipe


def communication(recipe: Recipe, shape: Shape, s: Setup, T_grad: float, T_all: float, ga: int, ref: Reference,
                  act: Activations):
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
        g = plan_generation(recipe, shape, s, ref) if online(recipe) else None
        policy_fwd, ref_fwd = online_forwards(recipe, ref, g) if g else forwards(recipe, ref)
        gathers += policy_fwd
        items.append(Item("param all-gather", ga * gathers * T_all * f / GB,
                          f"{gathers}x per micro-batch, per layer {T_all / shape.layers * f / 1e6:.0f} MB"
                          + (f" ({policy_fwd} without grad)" if policy_fwd else "")))
        items.append(Item("grad reduce-scatter", ga * T_grad * f / GB, f"per micro-batch, per layer {T_grad / shape.layers * f / 1e6:.1f} MB"))
        if ref_fwd and not grad_op:  # (SHARD_GRAD_OP keeps the copy gathered after its first forward)
            b = 2 if (s.mixed16 and L.backend == "fsdp") else ref.bytes_per_param
            items.append(Item("reference all-gather", ga * ref_fwd * shape.params * b * f / GB,
                              f"{ref_fwd}x per micro-batch (the copy's forward)"))
    if online(recipe) and (gen := generation_comm(recipe, shape, s, plan_generation(recipe, shape, s, ref), T_all, ga, f)):
        items.append(gen)
    if act.split.on:
        items.append(_exchanges(recipe, shape, s, act, ga))
    return items, sum(i.gb for i in items)


def _exchanges(recipe: Recipe, shape: Shape, s: Setup, act: Activations, ga: int) -> Item:
    """A sequence split's exchanges per optimizer step: every attention layer's forward and backward of each micro-batch
    (seqsplit.exchange_sent, from the layer's q/k/v/output sizes at the rank's tokens), its forward again where
    checkpointing recomputes the layer inside backward."""
    sp = act.split
    fwd, bwd = (sum(x) for x in zip(*(exchange_sent(L, s.act_bytes, act.tokens, sp) for L in shape.decoder)))
    passes = 2 if recipe.gradient_checkpointing and not checkpointing_off(recipe, shape) else 1
    what = "all-to-all (q, k, v, output)" if sp.kind == ULYSSES else "ring (keys/values)"
    return Item(f"{sp.kind} {what}", ga * (passes * fwd + bwd) / GB,
                f"per micro-batch {fwd / 1e6:,.0f} MB forward{' (x2: recomputed)' if passes == 2 else ''} + "
                f"{bwd / 1e6:,.0f} MB backward over {shape.layers} layers, {act.tokens} tokens per rank")

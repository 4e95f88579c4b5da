"""Sequence parallelism in a rank (launch.sequence_parallel_size, recipe/seqpar.py): accelerate's ParallelismConfig
for the training arguments, and what the run adds to the stack's Ulysses so that N ranks train as one process would.

accelerate registers DeepSpeed's UlyssesSPAttentionHF around the model's attention kernel and wraps the data loader in
UlyssesSPDataLoaderAdapter, which gathers the N ranks' batches and hands each rank its slice of every sequence;
transformers' Trainer then computes the loss (deepspeed_sp_compute_loss). Measured against one process on the same
rows (tests/train/test_seqpar.py), four things needed the run's own hand:
- the gradient: transformers gathers the N losses with a differentiable all_gather, whose backward sums the N ranks'
  copies, and DeepSpeed's ZeRO-1/2 sum the sequence's ranks again: every gradient came out N times too large
  (grad_norm 4.02 against 2.01 at N=2); ZeRO-3's reduce-scatter averages instead, so there it was right. Here each
  rank's loss carries the gradient of its own tokens, counted as often as the stage's reduction needs
  (_gradient_factor), the other ranks' share as a constant; its value is the sequence's whole loss, weighted by
  labelled tokens over the accumulation window and the data-parallel groups as transformers weights a run without it
  (average_tokens_across_devices);
- packed rows: the padding-free collator's cu_seq_lens/max_length keys are not (batch, sequence) tensors, which the
  adapter refuses; they are dropped, and the project's varlen kernel reads the samples' boundaries from the gathered
  position_ids instead, installed in the "sdpa" slot that Ulysses wraps (accelerate takes sdpa or flash attention only);
- gloo (the cpu target) gathers tensors of one shape only: each batch is padded to the longest of its group first
  (labels -100, so no token is added to the loss);
- DeepSpeed's own process groups (deepspeed.comm) are set up on the cpu target before accelerate asks for them.
And two a resumed or longer run needs: skipping the trained batches (transformers counts the adapter's micro-batches,
and accelerate's skip cannot take the adapter), and each epoch's order (the adapter passed no epoch to the sampler).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from sftrecipes.recipe.typed import Recipe

# batch keys the adapter cannot slice (not (batch, sequence) tensors); the kernel reads position_ids instead
UNSLICED = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx")
_window: dict = {"tokens": None}  # labelled tokens of the current accumulation window, all ranks together


def degree(recipe: Recipe) -> int:
    return int(recipe.launch.sequence_parallel_size)


def pad_multiple(recipe: Recipe, other: int | None) -> int:
    """pad_to_multiple_of under sequence parallelism: every batch's length divides by N (with `other`, the multiple the
    run would pad to anyway)."""
    n = degree(recipe)
    return n if not other else other * n // math.gcd(other, n)


def parallelism_config(recipe: Recipe, kernel: str):
    """accelerate's ParallelismConfig for sequence (Ulysses) or context (ring) parallelism, None without either.
    kernel: the attention the model loads with (attnchoice.choose_attention's)."""
    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.utils import DeepSpeedSequenceParallelConfig

    L = recipe.launch
    if L.context_parallel_size > 1:
        return ParallelismConfig(cp_size=L.context_parallel_size, cp_backend="torch",
                                 dp_shard_size=L.world_size // L.context_parallel_size)
    if degree(recipe) == 1:
        return None
    attn = kernel if kernel.startswith("flash_attention") else "sdpa"  # sft_varlen sits in the sdpa slot (model/load.py)
    # dp_replicate_size: the data-parallel groups, which accelerate multiplies into DeepSpeed's train_batch_size (left
    # at 1, a world of 4 in groups of 2 failed DeepSpeed's batch assertion: 4 != 2 x 2 x 2)
    return ParallelismConfig(sp_size=degree(recipe), sp_backend="deepspeed", dp_replicate_size=L.world_size // degree(recipe),
                             sp_handler=DeepSpeedSequenceParallelConfig(sp_seq_length_is_variable=True,
                                                                        sp_attn_implementation=attn))


def setup(recipe: Recipe, target: str) -> None:
    """In each rank, before the trainer exists: DeepSpeed's process groups on the cpu target, the loss and the data
    loader adapter mended (module docstring)."""
    if degree(recipe) == 1:
        return
    if target == "cpu":
        import deepspeed.comm as dscomm

        if not dscomm.is_initialized():
            dscomm.init_distributed(dist_backend="gloo")  # (wraps the process group training_args made)
    import transformers.trainer as hf_trainer
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF, UlyssesSPDataLoaderAdapter

    hf_trainer.deepspeed_sp_compute_loss = sp_compute_loss
    if not getattr(UlyssesSPAttentionHF.forward, "_sftrecipes", False):
        forward = UlyssesSPAttentionHF.forward

        def rows_as_they_come(self, module, query, *args, **kwargs):
            rows = query.shape[0]
            if rows != self.batch_size:  # packed rows: one, not per_device_train_batch_size
                self.batch_size = rows
                for name in ("required_query_shape", "required_key_value_shape", "required_context_shape"):
                    shape = list(getattr(self, name))
                    shape[1] = rows
                    setattr(self, name, torch.Size(shape))
            return forward(self, module, query, *args, **kwargs)

        rows_as_they_come._sftrecipes = True
        UlyssesSPAttentionHF.forward = rows_as_they_come
    if not getattr(UlyssesSPDataLoaderAdapter.refill, "_sftrecipes", False):
        refill = UlyssesSPDataLoaderAdapter.refill

        def mended_refill(self):
            if not isinstance(self.iter, _Even):
                self.iter = _Even(self.iter, self.sp_group, self.device)
            refill(self)
            for _ in range(self.__dict__.pop("_drop", 0)):  # a resume inside a group's turn: its trained micro-batches
                self.micro_batches.popleft()

        def set_epoch(self, epoch: int):
            """The epoch reaches the sampler, and the iterator is made after it (the adapter made its next one when the
            last epoch ended, with the old epoch's order)."""
            if hasattr(self.dl, "set_epoch"):
                self.dl.set_epoch(epoch)
            self.iter = iter(self.dl)
            self.micro_batches.clear()

        mended_refill._sftrecipes = True
        UlyssesSPDataLoaderAdapter.refill = mended_refill
        UlyssesSPDataLoaderAdapter.set_epoch = set_epoch
        skip = hf_trainer.skip_first_batches

        def skip_in_turns(dataloader, num_batches=0):
            """Resuming: transformers counts the adapter's micro-batches, N for each batch of a rank's loader, and
            accelerate's skip needs the loader itself (it failed on the adapter: no attribute 'dataset')."""
            if not isinstance(dataloader, UlyssesSPDataLoaderAdapter):
                return skip(dataloader, num_batches)
            n = dataloader.sp_world_size
            out = UlyssesSPDataLoaderAdapter(skip(dataloader.dl, num_batches // n), sp_rank=dataloader.sp_rank,
                                             sp_group=dataloader.sp_group, sp_world_size=n, device=dataloader.device)
            out._drop = num_batches % n
            return out

        hf_trainer.skip_first_batches = skip_in_turns


def attach(trainer) -> None:
    """On the trainer: the accumulation window's labelled tokens counted from the sliced labels (transformers counts
    `labels`, which the adapter replaces by `shift_labels`), and the loss marked as already scaled for accumulation."""
    count = trainer._get_num_items_in_batch

    def window_tokens(batch_samples, device):
        if not batch_samples or "shift_labels" not in batch_samples[0] or not trainer.model.training:
            return count(batch_samples, device)
        n = sum(b["shift_labels"].ne(-100).sum() for b in batch_samples).to(device=device, dtype=torch.float32)
        dist.all_reduce(n)
        _window["tokens"] = n
        return n

    trainer._get_num_items_in_batch = window_tokens
    trainer.loss_is_scaled_for_ga = True


class _Even:
    """The data loader's batches with the keys the adapter cannot slice dropped and, on gloo, padded to the longest
    batch of the sequence-parallel group (gloo's all_gather takes one shape)."""

    def __init__(self, it, group, device):
        self.it, self.group, self.device = it, group, device
        self.gloo = dist.get_backend(group) == "gloo"

    def __iter__(self):
        return self

    def __next__(self):
        batch = next(self.it)
        for key in UNSLICED:
            batch.pop(key, None)
        if not self.gloo:
            return batch
        length = batch["input_ids"].shape[1]
        longest = torch.tensor([length], dtype=torch.int64)
        dist.all_reduce(longest, op=dist.ReduceOp.MAX, group=self.group)
        extra = int(longest) - length
        if extra:
            fill = {"labels": -100, "position_ids": 0, "attention_mask": 0}
            for key, value in batch.items():
                if torch.is_tensor(value) and value.dim() == 2 and value.shape[1] == length:
                    batch[key] = torch.nn.functional.pad(value, (0, extra), value=fill.get(key, 0))
        return batch


def sp_compute_loss(accelerator, model, inputs, return_outputs, pc):
    """transformers' deepspeed_sp_compute_loss with each rank's gradient its own tokens' (module docstring): the value
    is the labelled-token mean of the whole sequences over the accumulation window, times the data-parallel groups
    that DeepSpeed averages over."""
    from deepspeed.utils import groups

    if "labels" not in inputs and "shift_labels" in inputs:
        inputs["labels"] = inputs["shift_labels"]
    outputs = model(**inputs)
    good = (inputs["shift_labels"] != -100).sum()
    mine = outputs.loss * good.clamp(min=1)  # the fused head's loss: its tokens' sum over their count (0 with none)
    group = groups._get_sequence_parallel_group()
    whole = mine.detach().clone()
    dist.all_reduce(whole, group=group)
    tokens = _window["tokens"]
    if tokens is None:  # (a forward outside the training loop's accumulation: its own sequences' tokens)
        tokens = good.to(torch.float32)
        dist.all_reduce(tokens)
    dp = dist.get_world_size() // dist.get_world_size(group)
    k = _gradient_factor(accelerator, dist.get_world_size(group))
    loss = (k * mine + (whole - k * mine.detach())) * dp / tokens.clamp(min=1)
    return (loss, outputs) if return_outputs else loss


def _gradient_factor(accelerator, n: int) -> int:
    """How many times a rank's own-token gradient must count for DeepSpeed to end with the sequences' gradient:
    ZeRO-1/2 divide the gradients by the data-parallel groups and sum the sequence's N ranks (1); ZeRO-3's
    reduce-scatter averages over every rank, so each rank's share counts N times (N). Measured: with 1 under ZeRO-3
    the gradient norm was half one process's at N=2. (ZeRO-3 without reduce_scatter sums small buckets and averages
    large ones: no single factor; the accelerate config never turns reduce_scatter off.)"""
    if "k" not in _window:
        stage = int(accelerator.state.deepspeed_plugin.zero_stage)
        engine = getattr(accelerator, "deepspeed_engine_wrapped", None)
        optimizer = getattr(getattr(engine, "engine", None), "optimizer", None)
        if stage == 3 and not getattr(optimizer, "reduce_scatter", True):
            raise RuntimeError("sequence parallelism under ZeRO-3 needs DeepSpeed's reduce_scatter: without it some "
                               "gradient buckets are summed over the sequence's ranks and others averaged")
        _window["k"] = n if stage == 3 else 1
    return _window["k"]

"""The online methods' (grpo, rloo) rules on a recipe, before torch loads: reward functions (rewards.check_rewards),
a generation batch made of whole groups of num_generations completions, and generation with vLLM only where a GPU and
vLLM are (`check_vllm`, every rank before loading)."""

from __future__ import annotations

import importlib.util

from sftrecipes.core.errors import RecipeError
from sftrecipes.recipe.rewards import check_rewards
from sftrecipes.recipe.schema import ONLINE, TRAINERS


def generation_batch(r) -> tuple[int, int]:
    """(completions generated at once across the ranks, optimizer micro-steps they feed: steps_per_generation), as
    GRPOConfig derives them from per_device_train_batch_size x processes x steps_per_generation (default:
    gradient_accumulation_steps), or from generation_batch_size."""
    per_step = int(r.trl_value("per_device_train_batch_size")) * r.launch.world_size
    gbs, spg = r.trl_value("generation_batch_size"), r.trl_value("steps_per_generation")
    if gbs is not None and spg is not None:
        raise RecipeError("generation_batch_size: set it or steps_per_generation, not both (each gives the other)")
    if gbs is not None:
        if gbs % per_step:
            raise RecipeError(f"generation_batch_size: {gbs} is not a multiple of the completions one step trains on "
                              f"(per_device_train_batch_size x {r.launch.world_size} processes = {per_step}); set a multiple")
        return int(gbs), int(gbs) // per_step
    spg = int(spg if spg is not None else r.trl_value("gradient_accumulation_steps"))
    return per_step * spg, spg


def check_online(r) -> None:
    """grpo/rloo: the reward functions named, and whole groups in every generation batch; the other methods: no
    reward_funcs, no prompt_only data."""
    is_online = r.method in ONLINE
    check_rewards(r, is_online)
    if not is_online:
        return
    n = int(r.trl_value("num_generations"))
    if n < 2:
        raise RecipeError(f"num_generations: {n}; {TRAINERS[r.method]} compares each completion with the others of its "
                          "prompt, so it needs at least 2 (8 is usual)")
    total, _ = generation_batch(r)
    if total % n:
        raise RecipeError(f"num_generations: {n} does not divide the generation batch of {total} completions "
                          f"(per_device_train_batch_size {r.trl_value('per_device_train_batch_size')} x "
                          f"{r.launch.world_size} processes x steps_per_generation); make the batch a multiple of {n}")
    if r.trl_value("auto_find_batch_size"):
        raise RecipeError("auto_find_batch_size: a smaller batch on out-of-memory would split num_generations' groups; "
                          "set auto_find_batch_size: false and lower per_device_train_batch_size")


def check_vllm(r, target: str) -> None:
    """use_vllm: TRL generates with vLLM (colocate: in each rank; server: a `trl vllm-serve` on GPUs of its own),
    which runs on GPUs and must be importable in the training environment in both modes (TRL's client)."""
    if r.method not in ONLINE or not r.trl_value("use_vllm"):
        return
    if target == "cpu":
        raise RecipeError("use_vllm: vLLM generates on GPUs and this run's hardware target is cpu; set use_vllm: false "
                          "(transformers generates) or run on GPUs")
    if importlib.util.find_spec("vllm") is None:
        raise RecipeError("use_vllm: vLLM is not installed in this environment (TRL's client needs it in both vllm_mode "
                          "colocate and server); pip install -r requirements-vllm.txt, or set use_vllm: false")

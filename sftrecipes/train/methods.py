"""What a recipe's `method` trains with: TRL's trainer for it (SFTTrainer, DPOTrainer, KTOTrainer, TRL's
experimental ORPOTrainer and CPOTrainer, GRPOTrainer and RLOOTrainer), the reference model of the preference methods,
the reward functions of the online ones, and the metrics of each a run reports.

The reference model: with LoRA, none is passed: TRL computes the reference log-probs with the adapter disabled (the
base, no second copy). A full fine-tune gets a second copy loaded exactly as the policy is (model.load_model: dtype,
attention, ZeRO-3 partitioning while loading), which TRL prepares like the policy (DeepSpeed, FSDP); with
precompute_ref_log_probs TRL computes them once before training from the policy's initial weights, and nothing else
is held. orpo and cpo have no reference model (schema.REFERENCE_FREE). grpo and rloo: TRL's trainer decides (none at
beta 0; with LoRA the adapter disabled; else a second copy it loads from the policy's folder), and gets reward_funcs.
"""

from __future__ import annotations

import logging
import os

from sftrecipes.recipe.schema import ONLINE, REFERENCE_FREE, TRAINERS
from sftrecipes.recipe.snapshots import METHOD_MODULES
from sftrecipes.recipe.target import RANK0_READS, weight_reading
from sftrecipes.recipe.typed import Recipe
from sftrecipes.train.options import trl_class

log = logging.getLogger("sftrecipes")

# Logged per step by the preference trainers (their `_metrics`), reported in run_summary.json per logging step: the
# rewards of each; kl of kto; the NLL term of orpo and cpo, and orpo's log odds
PREFERENCE_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen",
                      "logps/rejected", "kl", "nll_loss", "log_odds_ratio", "log_odds_chosen")
# Logged per step by GRPOTrainer/RLOOTrainer (their `_metrics`): the reward in total and per function (rewards/<name>/
# mean, std), completion lengths, the KL to the reference (beta > 0), the clip ratios, the entropy
ONLINE_PREFIXES = ("reward", "rewards/", "completions/", "kl", "clip_ratio", "entropy", "frac_reward_zero_std")


def trainer_class(recipe: Recipe) -> type:
    return trl_class(recipe.method, TRAINERS[recipe.method])


def needs_reference_copy(recipe: Recipe) -> bool:
    """A preference method with a reference, training every weight, its reference not precomputed: a second copy."""
    return (recipe.method not in ("sft", *REFERENCE_FREE, *ONLINE) and not recipe.model.use_peft_lora
            and not recipe.trl_value("precompute_ref_log_probs"))


def trainer_kwargs(recipe: Recipe, load_reference, reward_funcs=None) -> dict:
    """What the method's trainer takes beyond SFTTrainer's arguments: `ref_model`, loaded by `load_reference()`
    where a copy is needed (needs_reference_copy); grpo/rloo: `reward_funcs` (train/rewards.reward_functions)."""
    if recipe.method == "sft":
        return {}
    say = log.info if os.environ.get("RANK", "0") == "0" else log.debug
    if recipe.method in ONLINE:
        beta = float(recipe.trl_value("beta"))
        say("reference model: %s", "none (beta 0: no KL term)" if beta == 0 else
            f"the adapter disabled (beta {beta:g}): the base weights, no second copy" if recipe.model.use_peft_lora else
            f"a second copy (beta {beta:g}), loaded by {TRAINERS[recipe.method]} from the policy's folder and sharded as it is")
        return {"reward_funcs": reward_funcs}
    if recipe.method in REFERENCE_FREE:  # their trainers take no ref_model
        say("reference model: none (%s compares chosen with rejected under the policy alone); %s is TRL's experimental "
            "trainer from %s", recipe.method, TRAINERS[recipe.method], METHOD_MODULES[recipe.method])
        return {}
    if needs_reference_copy(recipe):
        if weight_reading(recipe, quantized=False)[0] == RANK0_READS:
            # TRL shards the reference with fully_shard alone, without the broadcast from rank 0 that accelerate gives
            # the policy: a rank that built it on the meta device would compare against garbage (NaN at step 1)
            say("reference model: a second copy of %s, read by every rank (fsdp_cpu_ram_efficient_loading covers the "
                "policy only: TRL shards the reference without rank 0's broadcast), then sharded", recipe.model.model_name_or_path)
            return {"ref_model": load_reference(every_rank_reads=True)}
        say("reference model: a second copy of %s, loaded and sharded as the policy is (%s)",
            recipe.model.model_name_or_path, recipe.launch.backend)
        return {"ref_model": load_reference()}
    how = ("the adapter disabled: the base weights, no second copy" if recipe.model.use_peft_lora
           else "precompute_ref_log_probs: computed once before training from the initial weights, no copy held")
    say("reference model: %s", how)
    return {"ref_model": None}


def tokenized_counts(recipe: Recipe, trainer, counts: dict) -> dict:
    """After the preference trainer tokenized the splits: what it dropped and what its collator will cut
    (preference.truncation_counts), logged on the main process and added to the data counts of run_summary.json."""
    from sftrecipes.data.prefcuts import truncation_counts

    if recipe.method in ONLINE:  # prompts are tokenized as each batch is generated from: nothing cut up front
        return counts
    splits = {"train": trainer.train_dataset}
    if isinstance(trainer.eval_dataset, dict):
        splits.update({f"eval {k}": v for k, v in trainer.eval_dataset.items()})
    elif trainer.eval_dataset is not None:
        splits["eval"] = trainer.eval_dataset
    out = dict(counts)
    for name, ds in splits.items():
        rows_in = (counts.get(name.split()[0]) or {}).get("kept")
        c = truncation_counts(ds, recipe.trl_value("max_length"), recipe.trl_value("truncation_mode"), recipe.method,
                              rows_in=rows_in, name=f"{name} split")
        if trainer.is_world_process_zero():
            (log.warning if c["warn"] else log.info)("%s", c["line"])
        out[name] = {**out.get(name, {}), "tokenized": {k: v for k, v in c.items() if k not in ("line", "warn")}}
    return out


def preference_log(log_history: list[dict], method: str = "dpo") -> list[dict]:
    """Per logging step of a preference run: the step and each preference metric TRL logged (train, not eval); of an
    online run, its rewards, completion lengths, KL and clip ratios (ONLINE_PREFIXES)."""
    rows = []
    for e in log_history:
        if method in ONLINE:
            found = {k: v for k, v in e.items() if k.startswith(ONLINE_PREFIXES)}
        else:
            found = {k: e[k] for k in PREFERENCE_METRICS if k in e}
        if found and "loss" in e:
            rows.append({"step": e.get("step"), **found})
    return rows

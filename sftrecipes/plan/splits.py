"""The strategies table's sequence-parallel rows: where a recipe does not fit, the Ulysses degrees its model's heads and
its GPUs allow, each planned, the smallest that fits proposed (torch-free).

Ulysses divides what every rank holds per token by N (seqsplit.py) and leaves the model states as they are, so it is
the strategy for a context whose activations do not fit: on the recipe's GPUs the smallest degree N that fits, else
the largest (how far it gets), then the first setup that fits with the optimizer (then the parameters) offloaded, or
on twice or four times the GPUs. N must divide the world size and follow Ulysses' head rule (recipe/seqpar.sp_degrees:
the heads divide by N, the key/value heads by N or N by them); it runs on DeepSpeed (the recipe's ZeRO stage, else
ZeRO-3) for sft. A split leaves world/N data-parallel groups, so gradient accumulation is multiplied by what it takes
away where that keeps the global batch exactly (the row says "accum"): the same model and batch, as the table's other
rows.
"""

from __future__ import annotations

from typing import Callable

from sftrecipes.core.errors import RecipeError
from sftrecipes.plan.seqsplit import data_groups
from sftrecipes.recipe.seqpar import SP_KEY, head_counts, sp_degrees
from sftrecipes.recipe.typed import Recipe


def more_gpus(recipe: Recipe, mult: int) -> dict:
    """The launch keys for `mult` times the recipe's GPUs: more nodes where it has several or full ones, else more GPUs
    on its node (as the table's "on N GPUs" rows)."""
    L = recipe.launch
    if mult == 1:
        return {}
    if L.num_machines > 1 or L.gpus_per_node >= 8:
        return {"launch.num_machines": L.num_machines * mult}
    return {"launch.gpus_per_node": L.gpus_per_node * mult}


def same_batch(recipe: Recipe, world: int, degree: int) -> dict:
    """gradient_accumulation_steps that keeps the recipe's global batch with `world` ranks split by `degree` ({} where
    it already does or cannot exactly)."""
    ga, groups = recipe.trl_value("gradient_accumulation_steps"), world // degree
    want = ga * data_groups(recipe)
    return {"gradient_accumulation_steps": want // groups} if want % groups == 0 and want // groups != ga else {}


def split_candidates(recipe: Recipe, plan, plan_of: Callable[..., object]) -> list[tuple[str, dict]]:
    """(name, changes) rows of sequence parallelism for a recipe that does not fit (the module docstring's search);
    plan_of(**changes) plans a variant (strategies.py: estimate of the recipe with those keys changed). None for a
    recipe that fits, a method other than sft, context parallelism, or a model whose heads are not readable here."""
    L = recipe.launch
    if plan.fits is not False or recipe.method != "sft" or L.context_parallel_size > 1:
        return []
    heads = head_counts(recipe.model.model_name_or_path)
    degrees = [n for n in sp_degrees(heads) if n > 1] if heads else []
    zero = L.zero_stage if L.backend == "deepspeed" and L.zero_stage >= 1 else 3
    ds = {"launch.backend": "deepspeed", "launch.zero_stage": zero, "launch.offload_optimizer": False,
          "launch.offload_params": False}
    offloads = [("", {}), (" + offload optimizer", {"launch.offload_optimizer": True})]
    if zero == 3:
        offloads.append((" + offload optimizer + params", {"launch.offload_optimizer": True, "launch.offload_params": True}))

    def best(mult: int, words: str, off: dict) -> tuple[str, dict, bool] | None:
        """The smallest degree that fits with these GPUs and offload, else the largest that plans."""
        world, found = L.world_size * mult, None
        for n in (d for d in degrees if world % d == 0):
            batch = same_batch(recipe, world, n)
            changes = {**ds, **more_gpus(recipe, mult), **off, SP_KEY: n, **batch}
            try:
                fits = plan_of(**changes).fits
            except RecipeError:
                continue
            where = f" on {world} GPUs" if mult > 1 else ""
            accum = f" (accum {batch['gradient_accumulation_steps']})" if batch else ""
            found = (f"ZeRO-{zero} + sequence parallel {n}{words}{where}{accum}", changes, bool(fits))
            if fits:
                break
        return found

    first = best(1, "", {})
    rows = [first] if first else []
    if first is None or not first[2]:
        for mult in (1, 2, 4):
            hit = next((f for words, off in offloads if (mult, words) != (1, "") and (f := best(mult, words, off)) and f[2]),
                       None)
            if hit:
                rows.append(hit)
                break
    return [(name, changes) for name, changes, _ in rows]

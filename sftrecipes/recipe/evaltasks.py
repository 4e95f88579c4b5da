"""The rules of `eval_tasks` (benchmark tasks scored after training, use/lmeval.py), torch-free: the keys that go with it,
and a final save the harness can load."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from sftrecipes.core.errors import RecipeError
from sftrecipes.recipe import evalonly

if TYPE_CHECKING:
    from sftrecipes.recipe.typed import Recipe


def check(r: Recipe) -> None:
    """eval_include_path and eval_limit only with eval_tasks; the folder there; a positive limit; a final save that
    lm-evaluation-harness loads (an adapter, or a model in safetensors: not an FSDP sharded state dict)."""
    run = r.run
    if not run.eval_tasks:
        stray = [k for k in ("eval_include_path", "eval_limit") if getattr(run, k) is not None]
        if stray:
            raise RecipeError(f"{stray[0]}: only applies with eval_tasks; set eval_tasks (e.g. [hellaswag]) or remove {stray[0]}")
        return
    if evalonly.eval_only(r):
        raise RecipeError(f"eval_tasks: scores what training saves, and {evalonly.why(r)} trains and saves nothing; remove "
                          "eval_tasks, and score a model with `python -m sftrecipes eval FOLDER --tasks ...`")
    if run.eval_include_path is not None and not Path(run.eval_include_path).expanduser().is_dir():
        raise RecipeError(f"eval_include_path: '{run.eval_include_path}' is not a folder; give the folder that holds your task YAML files")
    if run.eval_limit is not None and run.eval_limit <= 0:
        raise RecipeError(f"eval_limit: {run.eval_limit:g} is not positive; give a number of documents a task (or a fraction below 1)")
    L = r.launch
    if L.backend == "fsdp" and L.fsdp_state_dict_type == "SHARDED_STATE_DICT" and not r.model.use_peft_lora:
        raise RecipeError("eval_tasks: this run saves its model as an FSDP sharded state dict, which lm-evaluation-harness "
                          "cannot load; set launch.fsdp_state_dict_type: FULL_STATE_DICT, or remove eval_tasks and run "
                          "`python -m sftrecipes export` then `eval` on the export")

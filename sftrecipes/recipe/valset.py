"""`val_set_size`, torch-free: the rows of the training split held out as the eval split — its rules, how many rows a
value holds out of a split, the seed that draws them, and the record naming them (data/load.read_splits holds them out).
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Any

from sftrecipes.core.errors import RecipeError
from sftrecipes.recipe.images import split_files
from sftrecipes.recipe.sources import split_names

if TYPE_CHECKING:
    from sftrecipes.recipe.typed import Recipe

HELP = (
    "Hold out part of the training split as the eval split, for a source that has none (one JSONL/CSV/parquet file, a "
    "hub dataset with only train); axolotl's val_set_size. A fraction in (0, 1) of the rows (rounded to whole rows) or "
    "a number of rows (1 or more), drawn by a shuffle under data_seed if set, else seed: every rank and a resumed run "
    "hold out the same rows, and they never train. The log's data line and run_summary.json (data.held_out) record "
    "the count, the seed and the rows' digest (sha256 of their 0-based indices in the split, ascending, comma-joined). "
    "They are evaluated at the eval steps eval_strategy asks for and after the last step: eval_loss (and, for sft, "
    "perplexity) in run_summary.json's eval; do_train: false evaluates the same rows. Not with a source that has an "
    "eval split (splits naming one, or the default test split present), a datasets: mixture or streaming."
)


def seed_of(r: Recipe) -> tuple[int, str]:
    """(the seed the held-out rows are drawn under, the key it comes from): data_seed where the recipe sets it, else seed."""
    data_seed = r.trl.get("data_seed")
    return (int(data_seed), "data_seed") if data_seed is not None else (int(r.trl_value("seed")), "seed")


def check(r: Recipe) -> None:
    """The rules that need no data, one line each: the value's range, and what it cannot go with."""
    v = r.data.val_set_size
    if v is None:
        return
    if v <= 0:
        raise RecipeError(f"val_set_size: {v:g} is not positive; give a fraction of the training rows below 1 (0.05) or "
                          "a number of rows (100)")
    if v > 1 and not float(v).is_integer():
        raise RecipeError(f"val_set_size: {v:g} is neither a fraction below 1 nor a whole number of rows; write 0.05 "
                          "(a fraction of the rows) or 100 (rows)")
    if r.data.datasets:
        raise RecipeError("val_set_size: holds rows out of one dataset_name's training split, and datasets: draws a "
                          "mixture (a row drawn twice could both train and evaluate); give the entries an eval_split, "
                          "or use dataset_name with val_set_size")
    if r.data.streaming:
        raise RecipeError("val_set_size: a stream cannot hold rows out without reading it all first; with streaming: "
                          "true name an eval split (splits: train,test), or set streaming: false")
    named = split_names(r)[1]
    if named and "splits" in r.explicit:
        raise RecipeError(f"val_set_size: {v:g} makes held-out rows of the training split the eval split, but splits: "
                          f"'{r.data.splits}' names the eval split '{named}'; use one: splits: {split_names(r)[0]} "
                          f"(the held-out rows evaluate), or remove val_set_size ('{named}' evaluates)")
    if named and split_files(r.data.dataset_name, named):  # a local folder with that split: refused before torch loads
        raise RecipeError(conflict(r, named))


def conflict(r: Recipe, split: str) -> str:
    """The line refusing val_set_size on a source that has the eval split `splits` names by default."""
    train = split_names(r)[0]
    return (f"val_set_size: {r.data.val_set_size:g} makes held-out rows of '{train}' the eval split, but dataset_name "
            f"{r.data.dataset_name} has an eval split '{split}' (splits' default); use one: splits: {train} (the "
            f"held-out rows evaluate), or remove val_set_size ('{split}' evaluates)")


def count(r: Recipe, rows: int, where: str) -> int:
    """The rows val_set_size holds out of a split of `rows` rows: a fraction's share rounded, or the number given; at
    least one, and at least one row left to train, else one line naming the counts."""
    v = r.data.val_set_size
    held = round(v * rows) if v < 1 else int(v)
    asked = f"val_set_size: {v:g} of the {rows} rows of {where}"
    if held < 1:
        raise RecipeError(f"{asked} holds out no row; raise it to at least {1 / rows:.2g}, or give a number of rows (1 or more)")
    if held >= rows:
        raise RecipeError(f"{asked} holds out {held}, leaving no row to train; hold out fewer than {rows} rows "
                          "(e.g. val_set_size: 0.1)")
    return held


def digest(indices) -> str:
    """Which rows, as a short digest: sha256 of their 0-based indices in the split, ascending, comma-joined (16 hex)."""
    return hashlib.sha256(",".join(str(int(i)) for i in indices).encode()).hexdigest()[:16]


def record(r: Recipe, indices, rows: int, where: str) -> dict[str, Any]:
    """What run_summary.json's data.held_out keeps of the held-out rows."""
    seed, seed_key = seed_of(r)
    v = r.data.val_set_size
    return {"val_set_size": v if v < 1 else int(v), "rows": len(indices), "of": rows, "source": where, "seed": seed,
            "seed_key": seed_key, "rows_sha256": digest(indices)}


def words(held: dict[str, Any]) -> str:
    """The log's data line for them."""
    return (f"val_set_size {held['val_set_size']:g}: {held['rows']} of the {held['of']} rows of {held['source']} held "
            f"out as the eval split (drawn under {held['seed_key']} {held['seed']}; rows sha256 {held['rows_sha256']}); "
            f"they never train")


def final_eval_due(r: Recipe, log_history: list[dict], step: int) -> bool:
    """Whether the held-out rows still need their evaluation after the last step (none logged at that step yet)."""
    return r.data.val_set_size is not None and not any("eval_loss" in e and e.get("step") == step for e in log_history)


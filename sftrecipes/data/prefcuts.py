"""After a preference trainer tokenized its data: the rows TRL dropped, the sequences its collator (or ORPO/CPO's own
tokenizing) cuts, counted per split (`truncation_counts`, logged by train/methods.tokenized_counts)."""

from __future__ import annotations

import numpy as np
import pyarrow.compute as pc

from sftrecipes.recipe.schema import ONLINE, PAIRED, REFERENCE_FREE, TRAINERS

def _lengths(table, column: str) -> np.ndarray:
    return pc.list_value_length(table[column]).to_numpy(zero_copy_only=False).astype(np.int64)


def truncation_counts(trainer_dataset, max_length: int | None, truncation_mode: str, method: str,
                      rows_in: int | None = None, name: str = "train split") -> dict:
    """What TRL made of a split (the dataset its trainer prepared: prompt_ids + chosen_ids/rejected_ids for dpo,
    prompt_ids + completion_ids for kto) and what its collator will cut: rows, rows TRL dropped because the prompt
    alone fills max_length (rows_in - rows: pass rows_in, the rows handed to the trainer; DPO drops them under
    keep_start only, KTO always), rows cut at max_length (DPO: chosen and rejected each; KTO keeps the start, it has
    no truncation_mode), under DPO keep_end the rows whose completion alone fills max_length (their prompt cut away
    entirely), token totals before and after the cut. `line`: all that in one log line; `warn`: something was lost."""
    if method not in ("kto", *PAIRED) or method in ONLINE:
        raise ValueError(f"truncation_counts reads what a preference trainer prepared, not method {method}")
    if method in REFERENCE_FREE:
        return _cut_counts(trainer_dataset, max_length, method, rows_in, name)
    completions = ("chosen", "rejected") if method == "dpo" else ("completion",)
    table = trainer_dataset.select_columns(["prompt_ids", *(f"{c}_ids" for c in completions)]).with_format("arrow")[:]
    prompt = _lengths(table, "prompt_ids")
    rows = len(prompt)
    dropped = None if rows_in is None else rows_in - rows
    mode = truncation_mode if method == "dpo" else "keep_start"
    out: dict = {"method": method, "rows": rows, "max_length": max_length, "truncation_mode": mode, "dropped": dropped,
                 "cut": 0, "tokens": {"prompt": int(prompt.sum())}}
    limit = max_length if max_length is not None else np.iinfo(np.int64).max
    cut, prompt_lost = np.zeros(rows, dtype=bool), np.zeros(rows, dtype=bool)
    total = seen = 0
    for c in completions:  # each sequence the collator builds: prompt + completion, cut at max_length
        comp = _lengths(table, f"{c}_ids")
        seq = prompt + comp
        over = seq > limit
        cut |= over
        prompt_lost |= comp >= limit  # keep_end: not one prompt token left
        out["tokens"][c] = int(comp.sum())
        total += int(seq.sum())
        seen += int(np.minimum(seq, limit).sum())
        if method == "dpo":
            out[f"cut_{c}"] = int(over.sum())
    out["cut"] = int(cut.sum())
    if mode == "keep_end":
        out["prompt_cut_away"] = int(prompt_lost.sum())
    out["tokens"].update(total=total, after_cut=seen)
    out["line"] = _truncation_line(out, name)
    out["warn"] = bool(dropped or out["cut"])
    return out


def _truncation_line(c: dict, name: str) -> str:
    trainer = TRAINERS[c["method"]]
    line = f"data: {name} as {trainer} prepared it: {c['rows']} rows"
    if c["max_length"] is None:
        line += ", max_length null: nothing dropped or cut"
    else:
        limit = f"max_length {c['max_length']}"
        if c["dropped"]:
            line += f", {c['dropped']} dropped by TRL (the prompt alone fills {limit})"
        elif c["dropped"] is None and (c["method"] == "kto" or c["truncation_mode"] == "keep_start"):
            line += f" (rows whose prompt alone fills {limit} were dropped by TRL: not counted here)"
        line += f", {c['cut']} cut at {limit} ({c['truncation_mode']}"
        if c["method"] == "dpo":
            line += f"; chosen {c['cut_chosen']}, rejected {c['cut_rejected']}"
        line += ")"
        if c.get("prompt_cut_away"):
            line += f", {c['prompt_cut_away']} with the prompt cut away entirely (the completion alone fills {limit})"
    tokens = c["tokens"]
    parts = ", ".join(f"{k} {tokens[k]}" for k in tokens if k not in ("total", "after_cut"))
    line += f"; tokens: {parts}; {tokens['after_cut']} of {tokens['total']} sequence tokens reach the model"
    return line


def _completion_lengths(table, column: str) -> np.ndarray:
    """Per row: the tokens of a labels column that count (not -100): the completion as the trainer learns it."""
    labels = table[column].combine_chunks()
    flat = pc.list_flatten(labels).to_numpy(zero_copy_only=False)
    parents = pc.list_parent_indices(labels).to_numpy(zero_copy_only=False)
    return np.bincount(parents[flat != -100], minlength=len(labels)).astype(np.int64)


def _cut_counts(trainer_dataset, max_length: int | None, method: str, rows_in: int | None, name: str) -> dict:
    """truncation_counts for ORPOTrainer and CPOTrainer, which tokenize each row themselves and cut it then: the
    prompt stays whole and the completion's end is cut so that prompt + completion fit max_length; no row is
    dropped. What they prepared holds the sequences after the cut (chosen_input_ids: prompt + completion), so a
    sequence at exactly max_length was cut there or was that long; a row whose completion has no token left (the
    prompt alone fills max_length) still reaches the loss, with nothing of the completion in it."""
    if max_length is None:
        raise ValueError(f"{TRAINERS[method]} has no uncut mode (validation refuses max_length: null)")
    cols = ["prompt_input_ids", *(f"{c}_{k}" for c in ("chosen", "rejected") for k in ("input_ids", "labels"))]
    table = trainer_dataset.select_columns(cols).with_format("arrow")[:]
    prompt = _lengths(table, "prompt_input_ids")
    rows = len(prompt)
    out: dict = {"method": method, "rows": rows, "max_length": max_length, "truncation_mode": "keep_start",
                 "dropped": None if rows_in is None else rows_in - rows, "cut": 0, "tokens": {"prompt": int(prompt.sum())}}
    at_limit, empty = np.zeros(rows, dtype=bool), np.zeros(rows, dtype=bool)
    total = 0
    for c in ("chosen", "rejected"):
        seq = _lengths(table, f"{c}_input_ids")
        comp = _completion_lengths(table, f"{c}_labels")
        at_limit |= seq == max_length
        empty |= comp == 0
        out[f"cut_{c}"] = int((seq == max_length).sum())
        out["tokens"][c] = int(comp.sum())
        total += int(seq.sum())
    out["cut"] = int(at_limit.sum())
    out["empty_completion"] = int(empty.sum())
    out["tokens"].update(total=total, after_cut=total)
    line = (f"data: {name} as {TRAINERS[method]} prepared it: {rows} rows, {out['cut']} at max_length {max_length} "
            f"(the completion's end cut to fit, or exactly that long; chosen {out['cut_chosen']}, rejected "
            f"{out['cut_rejected']})")
    if out["empty_completion"]:
        line += (f", {out['empty_completion']} with no completion token left (the prompt alone fills max_length; "
                 f"{TRAINERS[method]} keeps them: raise max_length or shorten those prompts)")
    t = out["tokens"]
    line += f"; tokens after the cut: prompt {t['prompt']}, chosen {t['chosen']}, rejected {t['rejected']}"
    out["line"] = line
    out["warn"] = bool(out["cut"] or out["empty_completion"])
    return out

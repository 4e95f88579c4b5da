"""Preference and prompt data: the rows DPOTrainer, KTOTrainer, ORPOTrainer and CPOTrainer train on, and the prompts
GRPOTrainer and RLOOTrainer generate from (one dataset or a seeded mixture, its splits), in the shapes TRL reads, counted.

Sources, splits, column renames and a mixture's draws are SFT's (sources.py, data.read_splits (val_set_size too), data.draw_entry), and
formats.detect_preference_format reads each split's shape from its columns. TRL 1.16 tokenizes preference data itself
(`_prepare_dataset`: the prompt with the generation prompt, prompt + completion, EOS appended to text completions,
rows whose prompt alone fills max_length dropped), so what is done here is done to rows, never to tokens:
- ShareGPT turns (from/value) become role/content messages (formats.from_sharegpt);
- an implicit prompt (chosen/rejected only) becomes a `prompt` column, by TRL's own `extract_prompt`, so that the
  counts and the end-of-run sample see it;
- for kto, each pair becomes a desirable and an undesirable row, by TRL's own `unpair_preference_dataset`. KTOTrainer
  1.16 would unpair a paired dataset itself, but a mixture may hold paired and unpaired sources, which only
  concatenate once unpaired, and the counts then say what it trains on;
- rows with a null (or a conversation with no messages) where TRL reads, and pairs whose chosen equals rejected
  (nothing to prefer), are dropped and counted;
- only the columns TRL reads stay (the shape's, and `tools`/`chat_template_kwargs`, which it passes to the template);
  grpo/rloo keep every column of a prompt's row: TRL hands the others to the reward functions (an answer column).

What TRL's tokenizing dropped and cut is counted after it by prefcuts.truncation_counts.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import datasets
import numpy as np
from trl.data_utils import extract_prompt, unpair_preference_dataset

from sftrecipes.core.errors import RecipeError
from sftrecipes.data.formats import check_template, detect_preference_format, from_sharegpt
from sftrecipes.data.load import draw_entry, log_mixture, read_splits
from sftrecipes.recipe.images import refuse_split
from sftrecipes.recipe.schema import METHODS, ONLINE, TRAINERS
from sftrecipes.recipe.sources import Source, check_eval_split, sources
from sftrecipes.recipe.typed import Recipe

log = logging.getLogger("sftrecipes")

PREFERENCE_METHODS = tuple(m for m in METHODS if m != "sft")  # the methods whose data is read here
EXTRA_COLUMNS = ("tools", "chat_template_kwargs")  # TRL's tokenization passes them to the chat template
MESSAGE_COLUMNS = ("prompt", "chosen", "rejected", "completion")
SCAN_ROWS = 1000  # rows read at a time by the scan for empty and identical rows


@dataclass(frozen=True)
class Shape:
    """What a split holds: its format (formats.PREFERENCE_FORMATS), the columns of its shape, and whether their values
    are text, role/content messages or ShareGPT turns."""

    fmt: str
    columns: tuple[str, ...]
    kind: str  # "text", "conversational" or "sharegpt"

    @property
    def paired(self) -> bool:
        return "chosen" in self.columns

    @property
    def implicit(self) -> bool:
        return "prompt" not in self.columns

    @property
    def conversational(self) -> bool:
        return self.kind != "text"

    def describe(self) -> str:
        kind = {"sharegpt": "ShareGPT"}.get(self.kind, self.kind)
        return f"{kind} {'/'.join(self.columns)}" + (" (implicit prompt)" if self.implicit else "")


def _value_kind(feature) -> str:
    if isinstance(feature, datasets.Value) and feature.dtype in ("string", "large_string"):
        return "text"
    if isinstance(feature, datasets.List | datasets.LargeList) and isinstance(feature.feature, dict):
        fields = set(feature.feature)
        if {"from", "value"} <= fields:
            return "sharegpt"
        if {"role", "content"} <= fields:
            return "conversational"
    return "other"


def read_shape(recipe: Recipe, method: str, src: Source, ds, split: str) -> Shape:
    """The shape of one split of a source, checked: its columns (formats.detect_preference_format), their values all
    text or all messages, a bool label; conversational data needs a chat template (formats.check_template)."""
    name = f"{src.key} ({src.path}, {split})"
    key = "dataset_format" if src.key == "dataset_name" or src.format == recipe.data.dataset_format else f"{src.key}.format"
    columns_key = "dataset_format" if src.key == "dataset_name" else f"{src.key}.columns"
    fmt, columns = detect_preference_format(method, ds.column_names, name, src.format, key, columns_key)
    kinds = {c: _value_kind(ds.features[c]) for c in columns if c != "label"}
    odd = [c for c, k in kinds.items() if k == "other"]
    if odd:
        raise RecipeError(f"{columns_key}: column '{odd[0]}' of {name} is {ds.features[odd[0]]}, neither text nor a list "
                          "of role/content (or ShareGPT from/value) messages; fix the data or map another column to it")
    if len({k != "text" for k in kinds.values()}) > 1:
        text = next(c for c, k in kinds.items() if k == "text")
        conv = next(c for c, k in kinds.items() if k != "text")
        raise RecipeError(f"{columns_key}: {name} holds '{text}' as text and '{conv}' as messages; a row's "
                          f"{'/'.join(kinds)} are all text or all lists of messages; fix the data")
    kind = "sharegpt" if "sharegpt" in kinds.values() else next(iter(kinds.values()))
    if "label" in columns and ds.features["label"] != datasets.Value("bool"):
        label = ds.features["label"]
        if not (isinstance(label, datasets.Value) and label.dtype.startswith(("int", "uint"))
                and set(ds.unique("label")) <= {0, 1, None}):
            raise RecipeError(f"{columns_key}: column 'label' of {name} is {label}; kto needs a bool (true: a desirable "
                              "completion, false: an undesirable one); fix the data")
    shape = Shape(fmt, columns, kind)
    check_template(recipe, fmt, src.key, {c: [] for c in columns} if shape.conversational else None)
    return shape


# ----------------------------------------------------------------------------------------------- rows


def _scan(ds, shape: Shape) -> tuple[list[int], dict[str, int]]:
    """The rows TRL can use (indices), and how many of the others: `empty` (a null, or a conversation with no messages,
    where TRL reads), `identical` (chosen = rejected: nothing to prefer), `no_prompt` (an implicit prompt whose
    conversations differ from their first message: no shared start, and TRL fails on an empty conversation)."""
    keep: list[int] = []
    dropped = {"empty": 0, "identical": 0, "no_prompt": 0}
    start = 0
    for batch in ds.select_columns(list(shape.columns)).iter(batch_size=SCAN_ROWS):
        n = len(batch[shape.columns[0]])
        for i in range(n):
            row = {c: batch[c][i] for c in shape.columns}
            if any(v is None or (isinstance(v, list) and not v) for v in row.values()):
                dropped["empty"] += 1
            elif shape.paired and row["chosen"] == row["rejected"]:
                dropped["identical"] += 1
            elif shape.implicit and shape.conversational and row["chosen"][0] != row["rejected"][0]:
                dropped["no_prompt"] += 1
            else:
                keep.append(start + i)
        start += n
    return keep, dropped


def _sharegpt_to_messages(example: dict, index: int, columns: tuple[str, ...], where: str) -> dict:
    return {c: from_sharegpt(example[c], f"row {index} of {where} (column '{c}')") if example[c] is not None else None
            for c in columns if c in MESSAGE_COLUMNS}


def prepare_rows(ds, shape: Shape, method: str, where: str):
    """One split of one source in the shape the trainer reads, and its counts (read, empty, identical, no_prompt,
    unpaired, kept)."""
    read = len(ds)
    extras = [c for c in (ds.column_names if method in ONLINE else EXTRA_COLUMNS) if c in ds.column_names and c not in shape.columns]
    ds = ds.select_columns([*shape.columns, *extras])
    if shape.kind == "sharegpt":
        ds = ds.map(_sharegpt_to_messages, with_indices=True, fn_kwargs={"columns": shape.columns, "where": where},
                    desc=f"ShareGPT turns to messages ({where})")
    keep, counts = _scan(ds, shape)
    if len(keep) < read:
        ds = ds.select(keep)
    if shape.implicit:
        ds = ds.map(extract_prompt, desc=f"Extracting the implicit prompt ({where})")  # TRL's own: the same split
    if "label" in shape.columns and ds.features["label"] != datasets.Value("bool"):
        ds = ds.cast_column("label", datasets.Value("bool"))  # 0/1 read as ints
    unpaired = 0
    if method == "kto" and shape.paired:
        unpaired = len(ds)
        ds = unpair_preference_dataset(ds, desc=f"Unpairing ({where})")
    order = ["prompt", *{"kto": ("completion", "label"), **dict.fromkeys(ONLINE, ())}.get(method, ("chosen", "rejected")), *extras]
    ds = ds.select_columns(order)
    return ds, {"read": read, **counts, "unpaired": unpaired, "kept": len(ds)}


# ----------------------------------------------------------------------------------------------- splits


def _merge_feature(a, b):
    """A feature that holds the values of both a and b (message structs: the union of their fields), or None."""
    if a == b:
        return a
    if a == datasets.Value("null"):
        return b
    if b == datasets.Value("null"):
        return a
    if isinstance(a, dict) and isinstance(b, dict):
        out = {}
        for k in {**a, **b}:
            out[k] = _merge_feature(a[k], b[k]) if k in a and k in b else a.get(k, b.get(k))
            if out[k] is None:
                return None
        return out
    if isinstance(a, datasets.List) and isinstance(b, datasets.List):
        inner = _merge_feature(a.feature, b.feature)
        return None if inner is None else datasets.List(inner)
    strings = ("string", "large_string")
    if isinstance(a, datasets.Value) and isinstance(b, datasets.Value) and a.dtype in strings and b.dtype in strings:
        return datasets.Value("string")
    return None


def concat(parts: list, names: list[str]):
    """The parts of a split as one dataset: message structs widened to the union of their fields (Arrow gives the
    missing ones null, which transformers' chat templating leaves out), a missing `tools` column null."""
    if len(parts) == 1:
        return parts[0]
    kwargs = [("chat_template_kwargs" in p.column_names) for p in parts]
    if any(kwargs) and not all(kwargs):
        has, lacks = names[kwargs.index(True)], names[kwargs.index(False)]
        raise RecipeError(f"datasets: {has} has a chat_template_kwargs column and {lacks} has none, which would reach "
                          "the template as null arguments; give every entry that column or none")
    if any("tools" in p.column_names for p in parts):
        parts = [p if "tools" in p.column_names else p.add_column("tools", [None] * len(p)) for p in parts]
    features = dict(parts[0].features)
    for part, name in zip(parts[1:], names[1:]):
        for col, feature in part.features.items():
            merged = _merge_feature(features[col], feature)
            if merged is None:
                raise RecipeError(f"datasets: column '{col}' of {name} is {feature}, of {names[0]} {parts[0].features[col]}; "
                                  "one run's sources are all text or all conversational; fix the data or split the run")
            features[col] = merged
    target = datasets.Features(features)
    parts = [p if p.features == target else p.cast(target) for p in parts]
    return datasets.concatenate_datasets(parts)


def _describe(recipe: Recipe, shape: Shape, tokenizer) -> str:
    template = recipe.model.chat_template_format
    if shape.conversational:
        return f"{shape.describe()}, chat template {template}"
    what = f"{shape.describe()} (TRL appends EOS {tokenizer.eos_token} to each completion)"
    if template != "none":
        return (f"{what}; chat_template_format {template} is unused for text data (set chat_template_format: none to "
                "leave the tokenizer as it is)")
    return what


def count_split(method: str, name: str, parts: list[dict], recipe: Recipe) -> dict:
    """The counts of one split (its sources' summed, each source's kept too), logged in ONE line."""
    keys = ("read", "empty", "identical", "no_prompt", "unpaired", "kept")
    counts = {k: sum(p[k] for p in parts) for k in keys}
    formats: dict[str, int] = {}
    for p in parts:
        formats[p["shape"]] = formats.get(p["shape"], 0) + p["read"]
    counts["formats"] = formats
    counts["sources"] = parts
    if counts["read"] == 0:
        raise RecipeError(f"dataset_name: the {name} has no rows; check the data and splits")
    if counts["kept"] == 0:
        raise RecipeError(f"dataset_name: every {name} row was dropped ({counts['empty']} with an empty field, "
                          f"{counts['identical']} with chosen = rejected, {counts['no_prompt']} with no shared prompt); check the data")
    line = f"data: {name}: {counts['read']} read ({', '.join(f'{v} {k}' for k, v in formats.items())})"
    for k, why in (("empty", "with a null or no messages where TRL reads"), ("identical", "with chosen = rejected: nothing to prefer"),
                   ("no_prompt", "with no shared start of chosen and rejected to be the prompt")):
        if counts[k]:
            line += f", {counts[k]} dropped {why}"
    if counts["unpaired"]:
        line += (f", {counts['unpaired']} pairs made {2 * counts['unpaired']} unpaired rows (TRL's unpair_preference_dataset, "
                 "as KTOTrainer would: each pair a desirable and an undesirable row)")
    line += f", {counts['kept']} {'prompts ' if method in ONLINE else ''}kept for {TRAINERS[method]}"
    if method == "kto":
        counts["desirable"] = sum(p.get("desirable", 0) for p in parts)
        counts["undesirable"] = counts["kept"] - counts["desirable"]
        line += f" ({counts['desirable']} desirable, {counts['undesirable']} undesirable)"
    cut = f"max_length {recipe.trl_value('max_length')}" + {"dpo": f", {recipe.trl_value('truncation_mode')}",
                                                            "orpo": ", the completion's end", "cpo": ", the completion's end"}.get(method, "")
    if method in ONLINE:
        line += (f"; it generates {recipe.trl_value('num_generations')} completions of up to "
                 f"{recipe.trl_value('max_completion_length')} tokens for each prompt")
    else:
        line += f"; it tokenizes them itself ({cut}: what it cuts and drops is logged once it has)"
    (log.warning if counts["empty"] or counts["identical"] or counts["no_prompt"] else log.info)("%s", line)
    return counts


def _sample_prompt(ds):
    return ds[0]["prompt"] if ds is not None and len(ds) else None


def preference_datasets(recipe: Recipe, tokenizer):
    """(train, eval or None, sample prompt, counts) for the recipe's method (dpo, kto, orpo, cpo): the rows of its sources (a
    mixture drawn under the seed, then shuffled) in the shape its TRL trainer reads. The sample prompt: the first eval
    row's prompt, else the first train row's (a string, or a list of messages). counts: per split (read, dropped as
    empty/identical/no_prompt, unpaired pairs, kept, rows per shape, each source's), the mixture's draws."""
    method = recipe.method
    if method not in PREFERENCE_METHODS:
        raise ValueError(f"preference_datasets reads data for {', '.join(PREFERENCE_METHODS)}, and method is {method}: data.prepared_datasets")
    srcs = sources(recipe)
    mixture = bool(recipe.data.datasets)
    seed = int(recipe.trl_value("seed"))
    splits: dict[str, tuple[list, list, list]] = {"train": ([], [], []), "eval": ([], [], [])}  # rows, counts, names
    draws = []
    for i, src in enumerate(srcs):
        got, got_eval, held = read_splits(recipe, src)  # (val_set_size: the eval split held out of the training split)
        raw, raw_eval = got.dataset, got_eval.dataset if got_eval is not None else None
        for split, ds, split_name in (("train", raw, src.split), ("eval", raw_eval, src.split if held else src.eval_split)):
            if ds is None:
                continue
            where = f"{src.key} {src.path} ({split_name})"
            refuse_split(recipe, ds, where)  # rows that carry images: counted, refused in one line (images.py)
            shape = read_shape(recipe, method, src, ds, split_name)
            log.info("data: %s %s (%s): %s", src.key, src.path, split_name, _describe(recipe, shape, tokenizer))
            if split == "train" and mixture:
                ds, _, record = draw_entry(ds, raw_eval, src, seed, i)
                draws.append(record)
            rows, part = prepare_rows(ds, shape, method, where)
            part = {"source": src.key, "path": src.path, "split": split_name, "shape": shape.describe(), **part}
            if method == "kto":
                part["desirable"] = int(np.asarray(rows.with_format("numpy")["label"], dtype=bool).sum())
            for bucket, value in zip(splits[split], (rows, part, where)):
                bucket.append(value)
    train_rows, train_counts, train_names = splits["train"]
    train = concat(train_rows, train_names)
    if mixture:
        train = train.shuffle(seed=seed)
        log_mixture(seed, draws)
    counts = {"method": method, "train": count_split(method, "train split", train_counts, recipe)}
    evals = None
    eval_rows, eval_counts, eval_names = splits["eval"]
    if eval_rows:
        evals = concat(eval_rows, eval_names)
        counts["eval"] = count_split(method, "eval split", eval_counts, recipe)
    if mixture:
        counts["mixture"] = {"seed": seed, "sources": draws}
    if held:
        counts["held_out"] = held.record
    check_eval_split(recipe, evals is not None)
    first = next((p for p in eval_rows if len(p)), None) or next((p for p in train_rows if len(p)), None)
    return train, evals, _sample_prompt(first), counts

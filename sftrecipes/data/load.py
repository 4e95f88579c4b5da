"""Datasets: which rows a run trains on (one dataset or a seeded mixture, its splits), read and prepared for SFTTrainer.

Sources are a hub id, a local folder, a save_to_disk folder or a json/jsonl/parquet/csv/arrow file (a local file or
folder read by datafiles.py: every file of a split whatever its format, counted per format; its splits checked before
any row is read); a `datasets:` mixture draws each entry's rows under the seed; `val_set_size` holds rows of the
training split out as the eval split (`read_splits`). Each split's format is read
(formats.py) and its samples made into tokens and labels (tokenization.py). Which sources and splits a recipe names,
and the data keys checked before anything loads, are sources.py's (torch-free, read by recipe validation).

Entry points: `prepared_datasets` (train.py, `prepare`): the prepared data from its cache entry (prepcache.py), built
there once by one process while the others wait on its files; `load_datasets`: the same rows prepared here and now,
without the cache.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import datasets
import numpy as np

from sftrecipes.core.errors import RecipeError
from sftrecipes.data import datafiles, prepcache
from sftrecipes.data.formats import SHAREGPT_ROLES, check_template, detect_format, is_conversational, sample_prompt
from sftrecipes.data.tokenization import finish_split, log_bos, tokenize_split
from sftrecipes.recipe import valset
from sftrecipes.recipe.images import refuse_split
from sftrecipes.recipe.sources import Source, check_eval_split, sources
from sftrecipes.recipe.typed import Recipe

log = logging.getLogger("sftrecipes")


def _load_split(name: str, split: str, key: str = "dataset_name", split_key: str = "splits", config: str | None = None,
                missing_ok: bool = False, streaming: bool = False) -> datafiles.Read | None:
    """One split of a hub id, local folder, save_to_disk folder or file, as read (datafiles.Read: the dataset and its
    rows per file format); None when missing and missing_ok. streaming: a datasets.IterableDataset read as it is
    iterated (a save_to_disk folder, memory-mapped, as one). A local source's split is checked before anything is
    read; a folder's files are read by datafiles.py (every format of a split)."""
    path = Path(name).expanduser()
    present, names = datafiles.has_split(name, split, key, config)
    if present is False:
        if missing_ok:
            return None
        raise RecipeError(datafiles.missing_split(name, split, split_key, names))
    try:
        if datafiles.is_saved(path):
            ds = datasets.load_from_disk(str(path))
            if isinstance(ds, datasets.DatasetDict):
                ds = ds[split]
            return datafiles.Read(ds.to_iterable_dataset() if streaming else ds, None,
                                  None if streaming else [("save_to_disk", len(ds))])
        files = None if config else datafiles.splits_of(name, key)
        if files is not None:
            have = files["train"] if path.is_file() else files[datafiles.base_split(split)]
            parts = datafiles.parts_of(name, split, have, key)
            if parts is not None:
                return datafiles.read(name, "train" if path.is_file() else split, parts, key, streaming=streaming)
        ds = datasets.load_dataset(str(path) if path.is_dir() else name, config, split=split, streaming=streaming)
        if streaming:
            return datafiles.Read(ds, None, None)
        label = "hub" if not path.exists() else datafiles.label_of((files or {}).get(datafiles.base_split(split), []))
        return datafiles.Read(ds, None, [(label, len(ds))])
    except RecipeError:
        raise
    except ValueError as e:
        if "split" in str(e).lower() or "Unknown split" in str(e):
            if missing_ok:
                return None
            raise RecipeError(f"{split_key}: '{split}' not found in dataset '{name}' ({str(e).splitlines()[0][:160]}); fix {split_key}") from None
        raise
    except FileNotFoundError as e:
        raise RecipeError(f"{key}: '{name}' could not be found ({str(e).splitlines()[0][:160]}); give a local path, or a hub id with network access") from None
    except ConnectionError as e:
        raise RecipeError(f"{key}: '{name}' needs the hub, which is unreachable ({e}); use a local copy") from None


def read_source(src: Source, split: str, required: bool = True, streaming: bool = False) -> datafiles.Read | None:
    """One split of a source as read (datafiles.Read), its columns renamed (`columns`); None when missing and not
    required. Asked for the source's training split, a local source's eval split is checked first too: a split it
    lacks is refused before any row is read. streaming: a datasets.IterableDataset (stream.py; `dataset_name` only,
    which has no `columns`)."""
    key = "dataset_name" if src.key == "dataset_name" else f"{src.key}.path"
    if split == src.split and src.eval_split and src.eval_required:
        present, names = datafiles.has_split(src.path, src.eval_split, key, src.config)
        if present is False:
            raise RecipeError(datafiles.missing_split(src.path, src.eval_split, src.eval_key, names))
    got = _load_split(src.path, split, key, src.split_key if split == src.split else src.eval_key, src.config,
                      missing_ok=not required, streaming=streaming)
    if got is None or not src.columns:
        return got
    ds = got.dataset
    missing = [c for c in src.columns if c not in ds.column_names]
    if missing:
        raise RecipeError(f"{src.key}.columns: '{missing[0]}' is not a column of {src.path} ({split}: has {', '.join(ds.column_names)}); map existing columns")
    clash = [new for old, new in src.columns.items() if new in ds.column_names and new not in src.columns]
    ds = ds.remove_columns(clash)  # the renamed column replaces one of that name
    return datafiles.Read(ds.rename_columns(src.columns), got.parts, got.rows)


def load_source(src: Source, split: str, required: bool = True, streaming: bool = False):
    """read_source's dataset alone (None when missing and not required)."""
    got = read_source(src, split, required, streaming)
    return None if got is None else got.dataset


def load_raw(recipe: Recipe):
    """(train, eval or None) of `dataset_name` as loaded, before formatting (a mixture: see load_datasets)."""
    if recipe.data.datasets:
        raise ValueError("load_raw reads dataset_name; a recipe with datasets is read by load_datasets")
    got, got_eval, _ = read_splits(recipe, sources(recipe)[0])
    evals = got_eval.dataset if got_eval is not None else None
    check_eval_split(recipe, evals is not None)
    return got.dataset, evals


@dataclass
class HeldOut:
    """val_set_size's rows: what run_summary.json records of them, and the split's row indices that train and evaluate."""

    record: dict
    train_rows: list[int]
    eval_rows: list[int]


def read_splits(recipe: Recipe, src: Source) -> tuple[datafiles.Read, datafiles.Read | None, HeldOut | None]:
    """(the training split, the eval split or None, None) of a source as read; with val_set_size (recipe/valset.py) the
    eval split is rows of the training split held out under the seed, which the training split returned lacks. A source
    with an eval split of its own (the one `splits` names by default, looked for) is then refused in one line."""
    got = read_source(src, src.split)
    got_eval = read_source(src, src.eval_split, required=src.eval_required) if src.eval_split else None
    if recipe.data.val_set_size is None:
        return got, got_eval, None
    if got_eval is not None:
        raise RecipeError(valset.conflict(recipe, src.eval_split))
    rows, where = len(got.dataset), f"{src.key} {src.path} ({src.split})"
    picked = np.random.default_rng(valset.seed_of(recipe)[0]).choice(rows, valset.count(recipe, rows, where), replace=False)
    mask = np.zeros(rows, dtype=bool)
    mask[picked] = True
    out = HeldOut(valset.record(recipe, np.flatnonzero(mask), rows, where), np.flatnonzero(~mask).tolist(),
                  np.flatnonzero(mask).tolist())
    log.info("data: %s", valset.words(out.record))

    def part(idx: list[int]) -> datafiles.Read:
        counted = got.counts(idx)
        return datafiles.Read(got.dataset.select(idx), None, list(counted.items()) if counted is not None else None)

    return part(out.train_rows), part(out.eval_rows), out


# ----------------------------------------------------------------------------------------------- mixtures


def draw(n_rows: int, src: Source, seed: int, index: int) -> list[int]:
    """Row indices an entry contributes: all rows once (no weight/samples), round(weight x rows) or `samples` rows;
    beyond the source's size every row repeats, and the remainder is a random subset, under (seed, index)."""
    if n_rows == 0:
        raise RecipeError(f"{src.key}: split '{src.split}' of {src.path} has no rows; fix {src.split_key} or remove the entry")
    target = src.samples if src.samples is not None else round(src.weight * n_rows) if src.weight is not None else n_rows
    if target < 1:
        raise RecipeError(f"{src.key}.weight: {src.weight} of {n_rows} rows draws none; raise it (or use samples)")
    whole, rest = divmod(target, n_rows)
    rng = np.random.default_rng([seed, index])
    picked = np.sort(rng.choice(n_rows, size=rest, replace=False)) if rest else np.empty(0, dtype=np.int64)
    return np.concatenate([np.tile(np.arange(n_rows), whole), picked]).astype(np.int64).tolist()


def draw_entry(raw, raw_eval, src: Source, seed: int, index: int):
    """(the rows a mixture entry contributes, their indices in its split, the record counts["mixture"] keeps). Its eval
    split is not drawn: the record says how many rows it has."""
    idx = draw(len(raw), src, seed, index)
    how = f"samples {src.samples}" if src.samples is not None else f"weight {src.weight}" if src.weight is not None else "all rows"
    record = {"source": src.key, "path": src.path, "split": src.split, "rows": len(idx), "of": len(raw),
              "drawn_by": how, "eval_split": src.eval_split if raw_eval is not None else None,
              "eval_rows": len(raw_eval) if raw_eval is not None else 0}
    return raw.select(idx), idx, record


def log_mixture(seed: int, draws: list[dict]) -> None:
    log.info("data: mixture under seed %d: %s", seed, "; ".join(
        f"{d['source']} {d['path']} ({d['split']}) {d['rows']} of {d['of']} rows ({d['drawn_by']}), eval {d['eval_rows']} rows"
        + (f" ({d['eval_split']})" if d["eval_split"] else "") for d in draws))


def describe_format(recipe: Recipe, src: Source, fmt: str, row: dict | None) -> str:
    template = recipe.model.chat_template_format
    conv = row is not None and is_conversational(fmt, row)
    if fmt == "prompt_completion":
        kind = "conversational" if conv else "plain text: prompt + completion + EOS"
        loss = "the whole sequence" if recipe.trl_value("completion_only_loss") is False else "the completion only"
        what = f"prompt_completion ({kind}; loss on {loss})"
    else:
        what = fmt
    if conv:
        return f"{what}, chat template {template}"
    if template != "none":
        return f"{what}; chat_template_format {template} is unused for text data (set chat_template_format: none to leave the tokenizer as it is)"
    return what


def prepared_datasets(recipe: Recipe, tokenizer, eot: str):
    """(train, eval or None, sample prompt, counts) as load_datasets makes them, through the cache (prepcache.obtain):
    read from the entry of the inputs that shape the rows, or prepared into it by one process while the others wait
    on its files (no collective). counts["preparation"]: how this process got them (built, waited, reused), the
    seconds, rows and rows/s of the preparation, the entry; train.py writes them into run_summary.json."""
    got = prepcache.obtain(recipe, tokenizer, eot, lambda: build_datasets(recipe, tokenizer, eot))
    check_eval_split(recipe, got.eval is not None)  # eval_strategy is not in the key: checked at every use
    return got.train, got.eval, got.prompt, {**got.counts, "preparation": got.info}


def load_datasets(recipe: Recipe, tokenizer, eot: str):
    """(train, eval or None, sample prompt, counts), tokenized here (no cache). counts: per split (read, truncated,
    dropped, fully masked, kept, packing) and the mixture's draws."""
    train, evals, prompt, counts = build_datasets(recipe, tokenizer, eot)
    check_eval_split(recipe, evals is not None)
    return train, evals, prompt, counts


def _add_counts(total: dict[str, int], part: dict[str, int] | None) -> None:
    for label, n in (part or {}).items():
        total[label] = total.get(label, 0) + n


def build_datasets(recipe: Recipe, tokenizer, eot: str):
    """load_datasets' work, which only the inputs of the cache key shape (prepkey.key_inputs): everything but the
    eval split's check against eval_strategy."""
    pad = recipe.trl.get("pad_token")
    if pad and pad not in tokenizer.get_vocab():  # TRL would refuse it after the model load
        raise RecipeError(f"pad_token: '{pad}' is not in the tokenizer's vocabulary; pick a token it has, or remove pad_token")
    srcs = sources(recipe)
    mixture = bool(recipe.data.datasets)
    seed = int(recipe.trl_value("seed"))
    completion_only_set = recipe.trl.get("completion_only_loss") is not None
    train_parts, eval_parts, train_formats, eval_formats, draws, prompt = [], [], {}, {}, [], None
    train_files, eval_files = {}, {}  # rows per file format (datafiles.py)
    sharegpt_logged = False
    for i, src in enumerate(srcs):
        got, got_eval, held = read_splits(recipe, src)  # (val_set_size: the eval split held out of the training split)
        raw, raw_eval = got.dataset, got_eval.dataset if got_eval is not None else None
        for split, ds in ((src.split, raw), (src.eval_split, raw_eval)):  # image rows: refused before tokenizing
            refuse_split(recipe, ds, f"{src.key} {src.path} ({split})")
        fmt = detect_format(recipe, raw.column_names, f"{src.key} ({src.path}, {src.split})", src.format,
                            "dataset_format" if src.key == "dataset_name" or src.format == recipe.data.dataset_format else f"{src.key}.format")
        first = raw[0] if len(raw) else None
        check_template(recipe, fmt, src.key, first)
        if fmt == "conversations" and not sharegpt_logged:
            log.info("data: conversations (ShareGPT) 'from' -> role: %s", ", ".join(f"{k} -> {v}" for k, v in SHAREGPT_ROLES.items()))
            sharegpt_logged = True
        log.info("data: %s %s (%s): %s", src.key, src.path, src.split, describe_format(recipe, src, fmt, first))
        if raw_eval is not None and len(raw_eval) and not eval_parts:  # the first eval row of the run, else the first train row
            prompt = sample_prompt(fmt, raw_eval[0], recipe)
        elif prompt is None and len(raw):
            prompt = sample_prompt(fmt, raw[0], recipe)
        if mixture:
            raw, idx, record = draw_entry(raw, raw_eval, src, seed, i)
            draws.append(record)
        name = f"train split of {src.key}" if mixture else "train split"
        train_parts.append(tokenize_split(recipe, tokenizer, eot, raw, name, fmt, f"{src.key} {src.path} ({src.split})",
                                          idx if mixture else held and held.train_rows))
        train_formats[fmt] = train_formats.get(fmt, 0) + len(raw)
        _add_counts(train_files, got.counts(idx if mixture else None))
        if raw_eval is not None:
            _add_counts(eval_files, got_eval.counts())
            eval_parts.append(tokenize_split(recipe, tokenizer, eot, raw_eval, f"eval split of {src.key}" if mixture else "eval split", fmt,
                                             f"{src.key} {src.path} ({src.split if held else src.eval_split})",
                                             held and held.eval_rows))
            eval_formats[fmt] = eval_formats.get(fmt, 0) + len(raw_eval)
    if completion_only_set and "prompt_completion" not in train_formats:
        raise RecipeError(f"completion_only_loss: applies to prompt/completion data, but the data is {', '.join(train_formats)}; "
                          "remove it (for conversations, assistant_only_loss: true trains on the assistant turns only)")
    train_tok = datasets.concatenate_datasets(train_parts) if len(train_parts) > 1 else train_parts[0]
    if mixture:
        train_tok = train_tok.shuffle(seed=seed)
        log_mixture(seed, draws)
    train, counts_train = finish_split(recipe, train_tok, "train split", train_formats, files=train_files)
    counts = {"train": counts_train}
    evals = None
    if eval_parts:
        eval_tok = datasets.concatenate_datasets(eval_parts) if len(eval_parts) > 1 else eval_parts[0]
        evals, counts["eval"] = finish_split(recipe, eval_tok, "eval split", eval_formats, is_eval=True, files=eval_files)
    log_bos(tokenizer, sum(c["duplicate_bos_removed"] for c in counts.values()))
    if mixture:
        counts["mixture"] = {"seed": seed, "sources": draws}
    if held:
        counts["held_out"] = held.record
    return train, evals, prompt, counts

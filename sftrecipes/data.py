"""Datasets: load (hub id, local folder or file), format (chat template or pre-formatted text), tokenize.

The pipeline tokenizes itself and hands SFTTrainer `input_ids` + `labels`, so that every data option has a
defined effect (TRL 1.16 ignores `add_special_tokens`/`append_concat_token`, and appends a second end-of-turn
token to ChatML text). TRL still truncates (`max_length`, `truncation_mode`), packs (`packing`,
`packing_strategy`) and shuffles (`shuffle_dataset`) the tokenized data.
"""

from __future__ import annotations

import logging
from pathlib import Path

from .recipe import Recipe, RecipeError

log = logging.getLogger("sftrecipes")

FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}
EVAL_MARKERS = ("test", "val", "eval")


def split_names(recipe: Recipe) -> tuple[str, str | None]:
    """(train split, eval split or None) from the `splits` option."""
    names = [s.strip() for s in recipe.data.splits.split(",") if s.strip()]
    train = next(s for s in names if "train" in s)
    evals = [s for s in names if s != train and any(k in s for k in EVAL_MARKERS)]
    return train, (evals[0] if evals else None)


def _load_split(name: str, split: str):
    import datasets  # noqa: PLC0415

    path = Path(name).expanduser()
    try:
        if path.is_file():
            builder = FILE_BUILDERS.get(path.suffix)
            if builder is None:
                raise RecipeError(f"dataset_name: '{name}' has suffix '{path.suffix}'; use one of {', '.join(FILE_BUILDERS)}")
            if "train" not in split:
                raise RecipeError(f"splits: '{split}' asked of the single file '{name}', which is one 'train' split; use a folder with {split}.jsonl")
            return datasets.load_dataset(builder, data_files={"train": str(path)}, split="train")
        if path.is_dir() and ((path / "dataset_dict.json").exists() or (path / "dataset_info.json").exists()):
            ds = datasets.load_from_disk(str(path))
            if isinstance(ds, datasets.DatasetDict):
                if split not in ds:
                    raise RecipeError(f"splits: '{split}' not in '{name}' (has {', '.join(ds)}); fix splits")
                return ds[split]
            return ds
        return datasets.load_dataset(str(path) if path.is_dir() else name, split=split)
    except RecipeError:
        raise
    except ValueError as e:
        if "split" in str(e).lower() or "Unknown split" in str(e):
            raise RecipeError(f"splits: '{split}' not found in dataset '{name}' ({str(e).splitlines()[0][:160]}); fix splits") from None
        raise
    except FileNotFoundError as e:
        raise RecipeError(f"dataset_name: '{name}' could not be found ({str(e).splitlines()[0][:160]}); give a local path, or a hub id with network access") from None
    except ConnectionError as e:
        raise RecipeError(f"dataset_name: '{name}' needs the hub, which is unreachable ({e}); use a local copy") from None


def load_raw(recipe: Recipe):
    """(train, eval or None) as loaded, before formatting."""
    train_split, eval_split = split_names(recipe)
    name = recipe.data.dataset_name
    train = _load_split(name, train_split)
    evals = _load_split(name, eval_split) if eval_split else None
    if str(recipe.trl_value("eval_strategy")) != "no" and evals is None:
        raise RecipeError("eval_strategy: needs an eval split; add one to splits (e.g. train,test)")
    return train, evals


def _assistant_spans(tokenizer, messages: list[dict], text: str) -> list[tuple[int, int]]:
    """Character spans of the assistant turns in the rendered text (content + end-of-turn)."""
    spans = []
    for i, msg in enumerate(messages):
        if msg["role"] != "assistant":
            continue
        before = tokenizer.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True) if i else ""
        through = tokenizer.apply_chat_template(messages[: i + 1], tokenize=False)
        if not text.startswith(through) or not through.startswith(before):
            raise RecipeError(
                "assistant_only_loss: the chat template renders a conversation's prefix differently from the whole "
                "conversation, so assistant turns cannot be located; use chatml/zephyr or set assistant_only_loss: false"
            )
        spans.append((len(before), len(through)))
    return spans


def tokenize_example(example: dict, tokenizer, recipe: Recipe, eot: str) -> dict:
    """One example -> {text field, input_ids, labels}. Pure; mapped over the dataset."""
    fmt = recipe.model.chat_template_format
    field = recipe.trl_value("dataset_text_field")
    messages = example.get("messages")
    text = tokenizer.apply_chat_template(messages, tokenize=False) if fmt != "none" else example[field]
    enc = tokenizer(text, add_special_tokens=recipe.data.add_special_tokens, return_offsets_mapping=True)
    ids, offsets = list(enc["input_ids"]), list(enc["offset_mapping"])
    eot_id = tokenizer.convert_tokens_to_ids(eot)
    if recipe.data.append_concat_token:
        last = next((t for t in reversed(ids) if tokenizer.decode([t]).strip()), None)  # ignore trailing whitespace
        if last != eot_id and last != tokenizer.eos_token_id:
            ids.append(tokenizer.eos_token_id)
            offsets.append((len(text), len(text)))
    if recipe.trl_value("assistant_only_loss"):
        spans = _assistant_spans(tokenizer, messages, text)
        labels = [t if a == b == len(text) or any(s <= a < e for s, e in spans) else -100 for t, (a, b) in zip(ids, offsets)]
    else:
        labels = list(ids)
    return {field: text, "input_ids": ids, "labels": labels}


def prepare(recipe: Recipe, tokenizer, eot: str, dataset, name: str):
    """Format and tokenize one split. Checks the columns first, with a one-line error naming the fix."""
    fmt = recipe.model.chat_template_format
    field = recipe.trl_value("dataset_text_field")
    cols = dataset.column_names
    if fmt != "none" and "messages" not in cols:
        raise RecipeError(
            f"chat_template_format: {fmt} needs a 'messages' column, but {name} has {', '.join(cols)}; "
            f"set chat_template_format: none and dataset_text_field to the text column"
        )
    if fmt == "none" and field not in cols:
        hint = "; the data is conversational: set chat_template_format: chatml (or tokenizer)" if "messages" in cols else ""
        raise RecipeError(f"dataset_text_field: column '{field}' not in {name} (has {', '.join(cols)}){hint}")
    out = dataset.map(
        tokenize_example,
        fn_kwargs={"tokenizer": tokenizer, "recipe": recipe, "eot": eot},
        remove_columns=cols,
        num_proc=recipe.trl_value("dataset_num_proc"),
        desc=f"Formatting and tokenizing {name}",
    )
    if not all(any(label != -100 for label in row) for row in out["labels"]):
        raise RecipeError(f"assistant_only_loss: some {name} samples have no assistant tokens; check the data's roles")
    return out


def sample_prompt(recipe: Recipe, dataset):
    """The prompt of the end-of-run sample: the conversation up to its first user turn, or the first words of text."""
    row = dataset[0]
    if recipe.model.chat_template_format != "none":
        msgs = row["messages"]
        first_user = next(i for i, m in enumerate(msgs) if m["role"] == "user")
        return msgs[: first_user + 1]
    words = str(row[recipe.trl_value("dataset_text_field")]).split()
    return " ".join(words[: max(1, len(words) // 2)])


def load_datasets(recipe: Recipe, tokenizer, eot: str):
    """(train, eval or None, sample prompt), tokenized."""
    train_raw, evals_raw = load_raw(recipe)
    train = prepare(recipe, tokenizer, eot, train_raw, "train split")  # checks the columns first
    evals = prepare(recipe, tokenizer, eot, evals_raw, "eval split") if evals_raw is not None else None
    prompt = sample_prompt(recipe, evals_raw if evals_raw is not None else train_raw)
    log.info("data: %d train / %s eval samples from %s", len(train), len(evals) if evals is not None else 0, recipe.data.dataset_name)
    return train, evals, prompt

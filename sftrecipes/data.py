"""Datasets: the rows a run trains on (one dataset or a seeded mixture), read in their format, made into tokens and labels.

The pipeline formats, tokenizes and truncates itself and hands SFTTrainer `input_ids` + `labels`, so that every
data option has a defined effect (TRL 1.16 ignores `add_special_tokens`/`append_concat_token` and appends a second
end-of-turn token to ChatML text). Formats: `messages`, ShareGPT `conversations` (from/value), TRL's
`prompt`/`completion` (plain text or lists of messages) and `text` (dataset_text_field). Samples are cut at
`max_length` as `truncation_mode` says, and samples with no trainable label are dropped and counted; what reaches
TRL is then never longer than `max_length`, so TRL's own truncation and its drop of fully masked samples change
nothing, and its packing (`bfd`, `bfd_split`) keeps each sample whole. TRL still packs and shuffles.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

from .errors import RecipeError
from .recipe import Recipe

log = logging.getLogger("sftrecipes")

FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}
EVAL_MARKERS = ("test", "val", "eval")
FORMATS = ("messages", "conversations", "prompt_completion", "text")
CONVERSATIONAL = ("messages", "conversations")
# ShareGPT `from` values -> chat roles
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "model": "assistant",
                  "system": "system"}
SHAPES = ("messages (column 'messages': role/content turns), conversations (column 'conversations': ShareGPT "
          "from/value turns), prompt_completion (columns 'prompt' + 'completion': text, or lists of messages), "
          "text (the dataset_text_field column, now '{field}')")
# what became of one sample (the `_status` column while a split is prepared)
KEPT, FULLY_MASKED, CUT_AWAY, CUT_KEPT = 0, 1, 2, 3


# Every SFTConfig/TrainingArguments field TRL 1.16's SFTTrainer reads while it prepares data (__init__'s tokenizer and
# collator set-up, _prepare_dataset, the collator), and what becomes of it here: "pipeline" (applied by this
# package's own tokenization, which TRL then leaves alone: the data reaching TRL already has input_ids + labels),
# "trainer" (still acts inside SFTTrainer on the prepared data: packing, shuffling, collating), "refused" (a one-line
# RecipeError from check_trl_data_keys). tests/test_data.py fails when TRL reads a field this table does not classify,
# and shows each key's effect in the tokens, labels, prepared rows or batches.
TRL_DATA_KEYS: dict[str, tuple[str, str]] = {
    "chat_template_path": ("pipeline", "model.load_tokenizer makes the .jinja file the template the data is rendered "
                           "with (and saved); not passed to TRL, which would apply it to untokenized data only"),
    "dataset_text_field": ("pipeline", "the column text data is read from, and the column the rendered text is kept in"),
    "assistant_only_loss": ("pipeline", "labels of everything but assistant turns are -100 here; not passed to TRL"),
    "completion_only_loss": ("pipeline", "labels of the prompt are -100 here; not passed to TRL"),
    "max_length": ("pipeline", "samples are cut here (counted); TRL's own cut then changes nothing; also the packed "
                   "row length of TRL's packing"),
    "truncation_mode": ("pipeline", "which end the cut here keeps; TRL's cut then changes nothing"),
    "eos_token": ("pipeline", "model.load_tokenizer makes it the tokenizer's eos, the token text samples end with"),
    "dataset_num_proc": ("pipeline", "processes of this package's map over the rows, and of TRL's packing"),
    "dataset_kwargs": ("refused", "its only key, skip_prepare_dataset, would skip TRL's packing and shuffle_dataset, "
                       "and the data is formatted here whatever it says"),
    "packing": ("trainer", "TRL packs the prepared rows (each kept whole by bfd/bfd_split: none exceeds max_length)"),
    "packing_strategy": ("trainer", "how TRL packs the prepared rows; wrapped rows are counted here"),
    "eval_packing": ("trainer", "whether TRL packs the prepared eval rows (None: as packing)"),
    "shuffle_dataset": ("trainer", "TRL shuffles the prepared rows under seed"),
    "seed": ("trainer", "shuffle_dataset's order in TRL; the mixture's draws here"),
    "padding_free": ("trainer", "TRL's collator flattens a batch into one row with position_ids; without packing "
                     "TRL refuses it while max_length is set, so that combination is refused first"),
    "pad_to_multiple_of": ("trainer", "TRL's collator pads each batch to a multiple of it"),
    "pad_token": ("trainer", "TRL's collator pads with it (and the saved tokenizer names it); deprecated by TRL"),
    "per_device_train_batch_size": ("trainer", "read by TRL's data set-up only for a padding-free warning"),
}


def check_trl_data_keys(recipe: Recipe) -> None:
    """The TRL data-preparation keys TRL_DATA_KEYS refuses, or refuses in a combination: one line, before anything runs."""
    kwargs = recipe.trl.get("dataset_kwargs")
    if kwargs:
        raise RecipeError(f"dataset_kwargs: {kwargs} is not used: the data is formatted and tokenized by sftrecipes "
                          "(data.py) and skip_prepare_dataset would skip packing and shuffle_dataset; remove dataset_kwargs")
    packing, max_length = recipe.trl_value("packing"), recipe.trl_value("max_length")
    if recipe.trl_value("padding_free") and not packing and max_length is not None:
        raise RecipeError("padding_free: true without packing is refused by TRL while max_length is set (the data is cut to "
                          "max_length here already); set packing: true (its bfd strategy is padding-free) or max_length: null")
    if recipe.trl_value("eval_packing") and max_length is None:
        raise RecipeError("eval_packing: true needs max_length to set the packed length; set max_length: 2048")


@dataclass
class Source:
    """One dataset of the run: `dataset_name`, or one entry of `datasets` (schema.DATASET_ENTRY_KEYS)."""

    key: str  # how errors name it: 'dataset_name' or 'datasets[i]'
    path: str
    split: str
    eval_split: str | None
    eval_required: bool  # False: the default eval split of a mixture entry, used when the source has it
    config: str | None = None
    weight: float | None = None
    samples: int | None = None
    columns: dict[str, str] = field(default_factory=dict)
    format: str = "auto"

    @property
    def split_key(self) -> str:
        return "splits" if self.key == "dataset_name" else f"{self.key}.split"

    @property
    def eval_key(self) -> str:
        return "splits" if self.key == "dataset_name" else f"{self.key}.eval_split"


def split_names(recipe: Recipe) -> tuple[str, str | None]:
    """(train split, eval split or None) from the `splits` option."""
    names = [s.strip() for s in recipe.data.splits.split(",") if s.strip()]
    train = next(s for s in names if "train" in s)
    evals = [s for s in names if s != train and any(k in s for k in EVAL_MARKERS)]
    return train, (evals[0] if evals else None)


def sources(recipe: Recipe) -> list[Source]:
    """The datasets a recipe names, with their splits: `dataset_name` (splits as `splits` says), or each entry of
    `datasets` (its own `split`/`eval_split`, by default those named in `splits`)."""
    train_split, eval_split = split_names(recipe)
    d = recipe.data
    if not d.datasets:
        return [Source("dataset_name", d.dataset_name, train_split, eval_split, True, format=d.dataset_format)]
    out = []
    for i, e in enumerate(d.datasets):
        explicit = "eval_split" in e
        out.append(Source(f"datasets[{i}]", e["path"], e.get("split", train_split), e["eval_split"] if explicit else eval_split,
                          explicit, e.get("name"), e.get("weight"), e.get("samples"), dict(e.get("columns") or {}),
                          e.get("format", d.dataset_format)))
    return out


def check_eval_split(recipe: Recipe, found: bool | None = None) -> None:
    """The eval-split rule: an eval_strategy other than 'no' needs eval rows. found None (recipe validation): some
    source names an eval split (`splits`, or a `datasets` entry's eval_split or the default one it takes, as `sources`
    resolves them); after loading, `found` says whether any eval rows were read."""
    strategy = str(recipe.trl_value("eval_strategy"))
    if strategy == "no":
        return
    if found is None:
        found = any(src.eval_split for src in sources(recipe))
        why = f"splits is '{recipe.data.splits}'" + (" and no datasets entry has an eval_split" if recipe.data.datasets else "")
    else:
        why = "none of the named eval splits is in the data"
    if not found:
        entries = " or give the datasets entries an eval_split," if recipe.data.datasets else ""
        raise RecipeError(f"eval_strategy: {strategy} needs an eval split, but {why}; add one to splits (e.g. train,test),"
                          f"{entries} or set eval_strategy: no")


def _load_split(name: str, split: str, key: str = "dataset_name", split_key: str = "splits", config: str | None = None,
                missing_ok: bool = False):
    """One split of a hub id, local folder, save_to_disk folder or file; None when missing and missing_ok."""
    import datasets  # noqa: PLC0415

    path = Path(name).expanduser()
    try:
        if path.is_file():
            builder = FILE_BUILDERS.get(path.suffix)
            if builder is None:
                raise RecipeError(f"{key}: '{name}' has suffix '{path.suffix}'; use one of {', '.join(FILE_BUILDERS)}")
            if "train" not in split:
                if missing_ok:
                    return None
                raise RecipeError(f"{split_key}: '{split}' asked of the single file '{name}', which is one 'train' split; use a folder with {split}.jsonl")
            return datasets.load_dataset(builder, data_files={"train": str(path)}, split="train")
        if path.is_dir() and ((path / "dataset_dict.json").exists() or (path / "dataset_info.json").exists()):
            ds = datasets.load_from_disk(str(path))
            if isinstance(ds, datasets.DatasetDict):
                if split not in ds:
                    if missing_ok:
                        return None
                    raise RecipeError(f"{split_key}: '{split}' not in '{name}' (has {', '.join(ds)}); fix {split_key}")
                return ds[split]
            return ds
        return datasets.load_dataset(str(path) if path.is_dir() else name, config, split=split)
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


def load_source(src: Source, split: str, required: bool = True):
    """One split of a source with its columns renamed (`columns`); None when missing and not required."""
    key = src.split_key if split == src.split else src.eval_key
    ds = _load_split(src.path, split, "dataset_name" if src.key == "dataset_name" else f"{src.key}.path", key, src.config,
                     missing_ok=not required)
    if ds is None or not src.columns:
        return ds
    missing = [c for c in src.columns if c not in ds.column_names]
    if missing:
        raise RecipeError(f"{src.key}.columns: '{missing[0]}' is not a column of {src.path} ({split}: has {', '.join(ds.column_names)}); map existing columns")
    clash = [new for old, new in src.columns.items() if new in ds.column_names and new not in src.columns]
    ds = ds.remove_columns(clash)  # the renamed column replaces one of that name
    return ds.rename_columns(src.columns)


def load_raw(recipe: Recipe):
    """(train, eval or None) of `dataset_name` as loaded, before formatting (a mixture: see load_datasets)."""
    if recipe.data.datasets:
        raise ValueError("load_raw reads dataset_name; a recipe with datasets is read by load_datasets")
    src = sources(recipe)[0]
    train = load_source(src, src.split)
    evals = load_source(src, src.eval_split) if src.eval_split else None
    check_eval_split(recipe, evals is not None)
    return train, evals


# ----------------------------------------------------------------------------------------------- formats


def detect_format(recipe: Recipe, columns: list[str], name: str, fmt: str = "auto", key: str = "dataset_format") -> str:
    """The format of a split from its columns (fmt 'auto'), or a check that the columns fit the asked format."""
    field_ = recipe.trl_value("dataset_text_field")
    cols = set(columns)
    has = f"(has {', '.join(columns)})"
    needs = {"messages": ["messages"], "conversations": ["conversations"], "prompt_completion": ["prompt", "completion"],
             "text": [field_]}
    if fmt == "auto":
        if recipe.model.chat_template_format == "none" and "dataset_text_field" in recipe.explicit and field_ in cols:
            return "text"  # no template and a text column named explicitly: that column is the data
        for f in FORMATS:
            if set(needs[f]) <= cols:
                return f
        shapes = SHAPES.format(field=field_)
        raise RecipeError(
            f"dataset_format: {name} {has} is none of the accepted shapes: {shapes}; rename its columns (a datasets "
            f"entry's columns: {{your_column: prompt}}) or set dataset_text_field to its text column"
        )
    missing = [c for c in needs[fmt] if c not in cols]
    if missing:
        if fmt == "text":
            raise RecipeError(f"dataset_text_field: column '{field_}' not in {name} {has}; set dataset_text_field to the text column")
        raise RecipeError(f"{key}: {fmt} needs the column '{missing[0]}', but {name} {has}; rename it (a datasets entry's columns: {{your_column: {missing[0]}}}) or set {key}: auto")
    return fmt


def is_conversational(fmt: str, example: dict) -> bool:
    return fmt in CONVERSATIONAL or (fmt == "prompt_completion" and isinstance(example.get("prompt"), list))


def from_sharegpt(turns: list[dict], where: str) -> list[dict]:
    """ShareGPT turns (from/value) as chat messages (role/content); role/content turns pass through."""
    out = []
    for t in turns:
        if "from" in t:
            role = SHAREGPT_ROLES.get(str(t["from"]).lower())
            if role is None:
                raise RecipeError(
                    f"conversations: unknown 'from' value {t['from']!r} in {where}; the accepted ones are "
                    f"{', '.join(SHAREGPT_ROLES)} — rewrite those turns' 'from' to one of them"
                )
            out.append({"role": role, "content": t.get("value", "")})
        elif "role" in t:
            out.append({"role": t["role"], "content": t.get("content", "")})
        else:
            raise RecipeError(f"conversations: a turn in {where} has neither 'from'/'value' nor 'role'/'content' (keys: {', '.join(t)}); fix the data")
    return out


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


def render(example: dict, fmt: str, tokenizer, recipe: Recipe) -> tuple[str, list[list[tuple[int, int]]], bool]:
    """(text, span sets, ends with EOS). A token is trained when it overlaps a span of every set (no set: every
    token). Plain prompt/completion text always ends with EOS, as TRL writes it."""
    aol = bool(recipe.trl_value("assistant_only_loss"))
    completion_only = recipe.trl_value("completion_only_loss") is not False  # TRL: None and True mean completion only
    if is_conversational(fmt, example):
        _check_template(recipe, fmt, "a row", example)
    if fmt in CONVERSATIONAL:
        msgs = example["messages"] if fmt == "messages" else from_sharegpt(example["conversations"], "a conversations row")
        text = tokenizer.apply_chat_template(msgs, tokenize=False)
        return text, ([_assistant_spans(tokenizer, msgs, text)] if aol else []), False
    if fmt == "prompt_completion":
        prompt, completion = example["prompt"], example["completion"]
        if isinstance(prompt, list) != isinstance(completion, list):
            raise RecipeError("dataset_format: prompt_completion needs prompt and completion both text or both lists of messages; fix the data")
        if not isinstance(prompt, list):
            text = prompt + completion
            return text, ([[(len(prompt), len(text))]] if completion_only else []), True
        msgs = prompt + completion
        text = tokenizer.apply_chat_template(msgs, tokenize=False)
        sets = []
        if completion_only:
            head = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
            if not text.startswith(head):
                raise RecipeError(
                    "completion_only_loss: the chat template renders the prompt differently from the start of prompt + "
                    "completion, so the completion cannot be located; use chatml/zephyr, or completion_only_loss: false to train on the whole sequence"
                )
            sets.append([(len(head), len(text))])
        if aol:
            sets.append(_assistant_spans(tokenizer, msgs, text))
        return text, sets, False
    return example[recipe.trl_value("dataset_text_field")], [], False


def end_ids(tokenizer, eot: str) -> tuple[list[list[int]], str | None]:
    """The id sequences that end a sample (EOS now and as the tokenizer shipped it, the end-of-turn token), and the
    end-of-turn text when it is not one token (then it is also recognised in the text, whatever its tokenization)."""
    seqs = [[tokenizer.eos_token_id]] if tokenizer.eos_token_id is not None else []
    shipped = tokenizer.init_kwargs.get("eos_token")
    shipped = getattr(shipped, "content", shipped)
    if isinstance(shipped, str) and shipped in tokenizer.get_vocab():
        seqs.append([tokenizer.get_vocab()[shipped]])
    if eot in tokenizer.get_vocab():
        return seqs + [[tokenizer.get_vocab()[eot]]], None
    plain = tokenizer(eot, add_special_tokens=False)["input_ids"]
    return seqs + ([plain] if plain else []), eot


def _ends_with_end(ids: list[int], offsets: list, text: str, ends: list[list[int]], eot_text: str | None) -> bool:
    n = len(ids)
    while n and offsets[n - 1][0] < offsets[n - 1][1] and text[offsets[n - 1][0]:offsets[n - 1][1]].isspace():
        n -= 1  # trailing whitespace after the end token (ChatML's '\n')
    if any(seq and ids[:n][-len(seq):] == seq for seq in ends):
        return True
    return bool(eot_text and n and not eot_text.isspace() and text[: offsets[n - 1][1]].endswith(eot_text))


def tokenize_example(example: dict, tokenizer, recipe: Recipe, eot: str, fmt: str | None = None,
                     ends: tuple | None = None) -> dict:
    """One example -> {dataset_text_field: text, input_ids, labels, _bos_removed}. Pure; mapped over the dataset.
    fmt: the example's format (None: read from its keys)."""
    if fmt is None:
        fmt = detect_format(recipe, list(example), "the example")
    text, span_sets, force_eos = render(example, fmt, tokenizer, recipe)
    special = recipe.data.add_special_tokens
    enc = tokenizer(text, add_special_tokens=special, return_offsets_mapping=True)
    ids, offsets = list(enc["input_ids"]), [tuple(o) for o in enc["offset_mapping"]]
    bos = tokenizer.bos_token_id
    bos_removed = bool(special and bos is not None and ids[:2] == [bos, bos])
    if bos_removed:  # the text already starts with BOS (a template's {{ bos_token }}); the tokenizer added another
        ids, offsets = ids[1:], offsets[1:]
    if (recipe.data.append_concat_token or force_eos) and tokenizer.eos_token_id is not None:
        seqs, eot_text = ends if ends is not None else end_ids(tokenizer, eot)
        if not _ends_with_end(ids, offsets, text, seqs, eot_text):
            ids.append(tokenizer.eos_token_id)
            offsets.append((len(text), len(text)))
    end = len(text)

    def trained(a: int, b: int) -> bool:
        if a == b:  # zero-width: special tokens the tokenizer adds (BOS), or the appended EOS at the very end
            return all(any(s <= a < e or a == e == end for s, e in spans) for spans in span_sets)
        return all(any(a < e and b > s for s, e in spans) for spans in span_sets)

    labels = [t if trained(a, b) else -100 for t, (a, b) in zip(ids, offsets)]
    return {recipe.trl_value("dataset_text_field"): text, "input_ids": ids, "labels": labels, "_bos_removed": bos_removed}


def _trainable(labels: list[int]) -> bool:
    """A label the loss uses: position 0 is never predicted (and the packing collator masks it)."""
    return any(label != -100 for label in labels[1:])


def _prepare_row(example: dict, tokenizer, recipe: Recipe, eot: str, fmt: str, ends: tuple) -> dict:
    row = tokenize_example(example, tokenizer, recipe, eot, fmt, ends)
    max_length = recipe.trl_value("max_length")
    if not _trainable(row["labels"]):
        return {**row, "_status": FULLY_MASKED}
    if max_length is None or len(row["input_ids"]) <= max_length:
        return {**row, "_status": KEPT}
    cut = slice(None, max_length) if recipe.trl_value("truncation_mode") == "keep_start" else slice(-max_length, None)
    ids, labels = row["input_ids"][cut], row["labels"][cut]
    return {**row, "input_ids": ids, "labels": labels, "_status": CUT_KEPT if _trainable(labels) else CUT_AWAY}


def tokenize_split(recipe: Recipe, tokenizer, eot: str, dataset, name: str, fmt: str):
    """Format, tokenize and cut one split; rows keep a `_status` (KEPT, FULLY_MASKED, CUT_AWAY, CUT_KEPT) and
    `_bos_removed` until finish_split counts and drops."""
    if recipe.trl_value("assistant_only_loss") and not (fmt in CONVERSATIONAL or (len(dataset) and is_conversational(fmt, dataset[0]))):
        raise RecipeError(f"assistant_only_loss: {name} is {fmt} text, without assistant turns; remove assistant_only_loss"
                          + (" (prompt/completion data trains on the completion only by default)" if fmt == "prompt_completion" else ""))
    return dataset.map(
        _prepare_row,
        fn_kwargs={"tokenizer": tokenizer, "recipe": recipe, "eot": eot, "fmt": fmt, "ends": end_ids(tokenizer, eot)},
        remove_columns=dataset.column_names,
        num_proc=recipe.trl_value("dataset_num_proc"),
        desc=f"Formatting and tokenizing {name}",
    )


def _packed_rows(recipe: Recipe, dataset, is_eval: bool) -> dict | None:
    """What TRL's packing will make of the prepared split: fully masked packed rows (they add no loss)."""
    packing = recipe.trl_value("packing")
    if is_eval and recipe.trl_value("eval_packing") is not None:
        packing = recipe.trl_value("eval_packing")
    if not packing:
        return None
    strategy = recipe.trl_value("packing_strategy")
    if strategy != "wrapped":
        # every kept sample has a trainable label past its first position and is no longer than max_length, and
        # bfd/bfd_split keep such samples whole in one row: no packed row can be fully masked
        return {"strategy": strategy, "rows": None, "fully_masked_rows": 0}
    from trl.data_utils import pack_dataset  # noqa: PLC0415 - the same function, order and batches as SFTTrainer

    ds = dataset.select_columns(["input_ids", "labels"])
    if recipe.trl_value("shuffle_dataset"):
        ds = ds.shuffle(seed=recipe.trl_value("seed"))
    packed = pack_dataset(ds, recipe.trl_value("max_length"), "wrapped", {"num_proc": recipe.trl_value("dataset_num_proc")})
    masked = sum(not _trainable(row) for row in packed["labels"])
    return {"strategy": strategy, "rows": len(packed), "fully_masked_rows": masked}


def finish_split(recipe: Recipe, dataset, name: str, formats: dict[str, int], is_eval: bool = False):
    """Count what the cut and the masks did, drop samples with nothing to train, log ONE line. Returns
    (dataset with text/input_ids/labels, counts)."""
    import numpy as np  # noqa: PLC0415

    status = np.asarray(dataset.with_format("numpy")["_status"], dtype=np.int64)
    n = np.bincount(status, minlength=4)
    bos_removed = int(np.asarray(dataset.with_format("numpy")["_bos_removed"], dtype=bool).sum())
    counts = {
        "read": int(len(status)), "formats": formats, "truncated": int(n[CUT_AWAY] + n[CUT_KEPT]),
        "dropped_after_cut": int(n[CUT_AWAY]), "fully_masked": int(n[FULLY_MASKED]),
        "kept": int(n[KEPT] + n[CUT_KEPT]), "max_length": recipe.trl_value("max_length"),
        "truncation_mode": recipe.trl_value("truncation_mode"), "duplicate_bos_removed": bos_removed,
    }
    if counts["read"] == 0:
        raise RecipeError(f"dataset_name: the {name} has no rows; check the data and splits")
    if counts["kept"] == 0:
        if counts["fully_masked"] == counts["read"]:
            if recipe.trl_value("assistant_only_loss"):
                fix = "assistant_only_loss: every {} sample has no assistant token; check the data's roles or set assistant_only_loss: false"
            elif "prompt_completion" in formats:
                fix = "completion_only_loss: every {} completion is empty; check the data, or set completion_only_loss: false"
            else:
                fix = "dataset_name: every {} sample is empty; check the data"
            raise RecipeError(fix.format(name))
        raise RecipeError(
            f"max_length: no {name} sample keeps a trainable token after the cut at {counts['max_length']} "
            f"({counts['truncation_mode']}); raise max_length or set truncation_mode: keep_end"
        )
    dataset = dataset.filter(lambda s: s in (KEPT, CUT_KEPT), input_columns="_status", desc=f"Dropping untrainable {name} samples")
    dataset = dataset.remove_columns(["_status", "_bos_removed"])
    packed = _packed_rows(recipe, dataset, is_eval)
    if packed is not None:
        counts["packing"] = packed
    line = (f"data: {name}: {counts['read']} read ({', '.join(f'{v} {k}' for k, v in formats.items())}), "
            f"{counts['truncated']} truncated at max_length {counts['max_length']} ({counts['truncation_mode']}), "
            f"{counts['dropped_after_cut']} dropped after the cut (no trainable token left: the answer lay past max_length), "
            f"{counts['fully_masked']} fully masked (no trainable token before any cut, e.g. no assistant turn: dropped), "
            f"{counts['kept']} kept")
    if packed is not None:
        line += (f"; packing {packed['strategy']}: {packed['fully_masked_rows']} of {packed['rows']} packed rows fully masked"
                 if packed["rows"] is not None else f"; packing {packed['strategy']}: every packed row holds whole samples, none fully masked")
    (log.warning if counts["dropped_after_cut"] or counts["fully_masked"] or (packed or {}).get("fully_masked_rows") else log.info)("%s", line)
    return dataset, counts


def prepare(recipe: Recipe, tokenizer, eot: str, dataset, name: str, fmt: str | None = None):
    """Format, tokenize and cut one split, then drop what has nothing to train (counts logged). Checks the format
    first, with a one-line error naming the fix."""
    fmt = detect_format(recipe, dataset.column_names, name, fmt or recipe.data.dataset_format)
    _check_template(recipe, fmt, "dataset_name", dataset[0] if len(dataset) else None)
    out, counts = finish_split(recipe, tokenize_split(recipe, tokenizer, eot, dataset, name, fmt), name, {fmt: len(dataset)})
    _log_bos(tokenizer, counts["duplicate_bos_removed"])
    return out


def _log_bos(tokenizer, removed: int) -> None:
    if removed:
        log.info("add_special_tokens: %d samples already started with BOS %s (the chat template writes it); the second "
                 "BOS the tokenizer added was removed — set add_special_tokens: false to tokenize them as they are",
                 removed, tokenizer.bos_token)


def _check_template(recipe: Recipe, fmt: str, key: str, row: dict | None) -> None:
    """Conversational data needs a chat template (also checked on every row by render)."""
    if recipe.model.chat_template_format == "none" and (fmt in CONVERSATIONAL or (row is not None and is_conversational(fmt, row))):
        raise RecipeError(
            f"chat_template_format: none, but {key} is conversational ({fmt}); set chat_template_format: tokenizer "
            f"(the model's own template), chatml or zephyr"
        )


# ----------------------------------------------------------------------------------------------- mixtures


def draw(n_rows: int, src: Source, seed: int, index: int) -> list[int]:
    """Row indices an entry contributes: all rows once (no weight/samples), round(weight x rows) or `samples` rows;
    beyond the source's size every row repeats, and the remainder is a random subset, under (seed, index)."""
    import numpy as np  # noqa: PLC0415

    if n_rows == 0:
        raise RecipeError(f"{src.key}: split '{src.split}' of {src.path} has no rows; fix {src.split_key} or remove the entry")
    target = src.samples if src.samples is not None else round(src.weight * n_rows) if src.weight is not None else n_rows
    if target < 1:
        raise RecipeError(f"{src.key}.weight: {src.weight} of {n_rows} rows draws none; raise it (or use samples)")
    whole, rest = divmod(target, n_rows)
    rng = np.random.default_rng([seed, index])
    picked = np.sort(rng.choice(n_rows, size=rest, replace=False)) if rest else np.empty(0, dtype=np.int64)
    return np.concatenate([np.tile(np.arange(n_rows), whole), picked]).astype(np.int64).tolist()


def sample_prompt(fmt: str, row: dict, recipe: Recipe):
    """The prompt of the end-of-run sample: the conversation up to its first user turn, the prompt of a
    prompt/completion row, or the first half of a text."""
    if fmt in CONVERSATIONAL:
        msgs = row["messages"] if fmt == "messages" else from_sharegpt(row["conversations"], "the sample row")
        first_user = next((i for i, m in enumerate(msgs) if m["role"] == "user"), 0)
        return msgs[: first_user + 1]
    if fmt == "prompt_completion":
        return row["prompt"]
    words = str(row[recipe.trl_value("dataset_text_field")]).split()
    return " ".join(words[: max(1, len(words) // 2)])


def _describe_format(recipe: Recipe, src: Source, fmt: str, row: dict | None) -> str:
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


def load_datasets(recipe: Recipe, tokenizer, eot: str):
    """(train, eval or None, sample prompt, counts), tokenized. counts: per split (read, truncated, dropped, fully
    masked, kept, packing) and the mixture's draws; train.py writes them into run_summary.json."""
    import datasets  # noqa: PLC0415

    pad = recipe.trl.get("pad_token")
    if pad and pad not in tokenizer.get_vocab():  # TRL would refuse it after the model load
        raise RecipeError(f"pad_token: '{pad}' is not in the tokenizer's vocabulary; pick a token it has, or remove pad_token")
    srcs = sources(recipe)
    mixture = bool(recipe.data.datasets)
    seed = int(recipe.trl_value("seed"))
    completion_only_set = recipe.trl.get("completion_only_loss") is not None
    train_parts, eval_parts, train_formats, eval_formats, draws, prompt = [], [], {}, {}, [], None
    sharegpt_logged = False
    for i, src in enumerate(srcs):
        raw = load_source(src, src.split)
        raw_eval = load_source(src, src.eval_split, required=src.eval_required) if src.eval_split else None
        fmt = detect_format(recipe, raw.column_names, f"{src.key} ({src.path}, {src.split})", src.format,
                            "dataset_format" if src.key == "dataset_name" or src.format == recipe.data.dataset_format else f"{src.key}.format")
        first = raw[0] if len(raw) else None
        _check_template(recipe, fmt, src.key, first)
        if fmt == "conversations" and not sharegpt_logged:
            log.info("data: conversations (ShareGPT) 'from' -> role: %s", ", ".join(f"{k} -> {v}" for k, v in SHAREGPT_ROLES.items()))
            sharegpt_logged = True
        log.info("data: %s %s (%s): %s", src.key, src.path, src.split, _describe_format(recipe, src, fmt, first))
        if raw_eval is not None and len(raw_eval) and not eval_parts:  # the first eval row of the run, else the first train row
            prompt = sample_prompt(fmt, raw_eval[0], recipe)
        elif prompt is None and len(raw):
            prompt = sample_prompt(fmt, raw[0], recipe)
        if mixture:
            idx = draw(len(raw), src, seed, i)
            how = f"samples {src.samples}" if src.samples is not None else f"weight {src.weight}" if src.weight is not None else "all rows"
            draws.append({"source": src.key, "path": src.path, "split": src.split, "rows": len(idx), "of": len(raw),
                          "drawn_by": how, "eval_split": src.eval_split if raw_eval is not None else None,
                          "eval_rows": len(raw_eval) if raw_eval is not None else 0})
            raw = raw.select(idx)
        name = f"train split of {src.key}" if mixture else "train split"
        train_parts.append(tokenize_split(recipe, tokenizer, eot, raw, name, fmt))
        train_formats[fmt] = train_formats.get(fmt, 0) + len(raw)
        if raw_eval is not None:
            eval_parts.append(tokenize_split(recipe, tokenizer, eot, raw_eval, f"eval split of {src.key}" if mixture else "eval split", fmt))
            eval_formats[fmt] = eval_formats.get(fmt, 0) + len(raw_eval)
    if completion_only_set and "prompt_completion" not in train_formats:
        raise RecipeError(f"completion_only_loss: applies to prompt/completion data, but the data is {', '.join(train_formats)}; "
                          "remove it (for conversations, assistant_only_loss: true trains on the assistant turns only)")
    check_eval_split(recipe, bool(eval_parts))
    train_tok = datasets.concatenate_datasets(train_parts) if len(train_parts) > 1 else train_parts[0]
    if mixture:
        train_tok = train_tok.shuffle(seed=seed)
        log.info("data: mixture under seed %d: %s", seed, "; ".join(
            f"{d['source']} {d['path']} ({d['split']}) {d['rows']} of {d['of']} rows ({d['drawn_by']}), eval {d['eval_rows']} rows"
            + (f" ({d['eval_split']})" if d["eval_split"] else "") for d in draws))
    train, counts_train = finish_split(recipe, train_tok, "train split", train_formats)
    counts = {"train": counts_train}
    evals = None
    if eval_parts:
        eval_tok = datasets.concatenate_datasets(eval_parts) if len(eval_parts) > 1 else eval_parts[0]
        evals, counts["eval"] = finish_split(recipe, eval_tok, "eval split", eval_formats, is_eval=True)
    _log_bos(tokenizer, sum(c["duplicate_bos_removed"] for c in counts.values()))
    if mixture:
        counts["mixture"] = {"seed": seed, "sources": draws}
    return train, evals, prompt, counts

"""Data sources, torch-free: which datasets and splits a recipe names, and the data rules recipe validation checks
before anything loads (the eval split, TRL's data-preparation keys: TRL_DATA_KEYS says what becomes of each)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from sftrecipes.core.errors import RecipeError

if TYPE_CHECKING:
    from sftrecipes.recipe.typed import Recipe

EVAL_MARKERS = ("test", "val", "eval")


# Every SFTConfig/TrainingArguments field TRL 1.16's SFTTrainer reads while it prepares data (__init__'s tokenizer and
# collator set-up, _prepare_dataset, the collator), and what becomes of it here: "pipeline" (applied by this
# package's own tokenization, which TRL then leaves alone: the data reaching TRL already has input_ids + labels),
# "trainer" (still acts inside SFTTrainer on the prepared data: packing, shuffling, collating), "refused" (a one-line
# RecipeError from check_trl_data_keys). tests/data/test_data.py fails when TRL reads a field this table does not classify,
# and shows each key's effect in the tokens, labels, prepared rows or batches.
TRL_DATA_KEYS: dict[str, tuple[str, str]] = {
    "chat_template_path": ("pipeline", "tokenizer.load_tokenizer makes the .jinja file the template the data is rendered "
                           "with (and saved); not passed to TRL, which would apply it to untokenized data only"),
    "dataset_text_field": ("pipeline", "the column text data is read from, and the column the rendered text is kept in"),
    "assistant_only_loss": ("pipeline", "labels of everything but assistant turns are -100 here; not passed to TRL"),
    "completion_only_loss": ("pipeline", "labels of the prompt are -100 here; not passed to TRL"),
    "max_length": ("pipeline", "samples are cut here (counted); TRL's own cut then changes nothing; also the packed "
                   "row length of TRL's packing"),
    "truncation_mode": ("pipeline", "which end the cut here keeps; TRL's cut then changes nothing"),
    "eos_token": ("pipeline", "tokenizer.load_tokenizer makes it the tokenizer's eos, the token text samples end with; "
                  "TRL sets the same eos again and mirrors it into the model's config"),
    "dataset_num_proc": ("pipeline", "processes of this package's map over the rows (unset: one per 4,000 rows, at most "
                                        "the usable cores: tokenization.workers), and of TRL's packing"),
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
}


# The "pipeline" keys that are not handed to SFTConfig at all (train/args.training_kwargs leaves them out): applied to
# the data here, TRL would apply them again or refuse them on pre-tokenized data.
CONSUMED_BY_PIPELINE = ("assistant_only_loss", "completion_only_loss", "chat_template_path")


def check_trl_data_keys(recipe: Recipe) -> None:
    """The TRL data-preparation keys TRL_DATA_KEYS refuses, or refuses in a combination: one line, before anything runs."""
    if recipe.method != "sft":  # SFTTrainer's data keys; the preference trainers prepare their data their own way
        return
    kwargs = recipe.trl.get("dataset_kwargs")
    if kwargs:
        raise RecipeError(f"dataset_kwargs: {kwargs} is not used: the data is formatted and tokenized by sftrecipes "
                          "and skip_prepare_dataset would skip packing and shuffle_dataset; remove dataset_kwargs")
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
    if not d.datasets:  # (val_set_size: the default eval split is only looked for, to refuse a source that has it)
        return [Source("dataset_name", d.dataset_name, train_split, eval_split, d.val_set_size is None, format=d.dataset_format)]
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
        found = any(src.eval_split for src in sources(recipe)) or recipe.data.val_set_size is not None
        why = f"splits is '{recipe.data.splits}'" + (" and no datasets entry has an eval_split" if recipe.data.datasets else "")
    else:
        why = "none of the named eval splits is in the data"
    if not found:
        entries = " or give the datasets entries an eval_split," if recipe.data.datasets else ""
        raise RecipeError(f"eval_strategy: {strategy} needs an eval split, but {why}; add one to splits (e.g. train,test),"
                          f"{entries} or set eval_strategy: no")

"""Local data files as a split's rows: which files make each split of a file or folder (datasets' own naming rules),
every file of a split read whatever its format, counted per format, and a row that cannot be parsed named by its file
and line. Torch-free.

A folder's splits are the ones datasets gives it (train.jsonl / test.jsonl, train-*.parquet, data/ and train/ folders;
hidden files and those no split's name matches are not read: counted in one log line). A split whose files are all
parquet, json/jsonl, csv/tsv or arrow is read file format by file format (each format's files together, the formats
in the order their first file sorts), the parts concatenated in that order, streamed or not; their columns must be
the same (one line naming two files otherwise). A split of another kind (text files, images with a metadata file...)
is read by datasets as it reads the folder, when nothing else is in it; any other mix is refused naming the formats.
A file that cannot be read is refused in one line naming it and the line of its first row that cannot be parsed
(badrows.py).
"""

from __future__ import annotations

import contextlib
import csv
import json
import logging
from collections import Counter
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import datasets
import numpy as np
import pyarrow as pa
from datasets.data_files import DataFilesDict, EmptyDatasetError, get_data_patterns
from datasets.exceptions import DatasetGenerationError
from datasets.load import infer_module_for_data_files_list
from datasets.packaged_modules import _ALL_ALLOWED_EXTENSIONS, _EXTENSION_TO_MODULE, _MODULE_TO_METADATA_FILE_NAMES
from datasets.table import table_cast

from sftrecipes.core.errors import RecipeError
from sftrecipes.data import badrows

log = logging.getLogger("sftrecipes")

COMBINED = ("parquet", "json", "csv", "arrow")  # datasets' readers whose files one split may mix
SINGLE_FILE = (".json", ".jsonl", ".parquet", ".csv", ".arrow")  # a data file given as the source itself
PART_COLUMN = "_sft_part"  # a streamed mix's rows carry the index of their part (stream.py counts and drops it)
NOT_DATA = ("README.md", "dataset_infos.json", ".huggingface.yaml")  # what a dataset folder holds besides its data
# errors a reader raises on data it cannot parse (pandas' ParserError and UnicodeDecodeError are ValueErrors; a
# truncated compressed file ends in EOFError)
UNREADABLE = (DatasetGenerationError, pa.ArrowException, ValueError, EOFError, csv.Error)
_noted: set[str] = set()  # folders whose files in no split were logged


@dataclass(frozen=True)
class Part:
    """The files of one format in one split: `label` the format as the files are named (jsonl, parquet...), `module`
    the datasets reader and its keyword arguments (a .tsv: sep)."""

    label: str
    module: str
    kwargs: tuple
    files: tuple[str, ...]


@dataclass
class Read:
    """A split as read: the dataset (an IterableDataset when streamed) and its rows per part in order (label, rows);
    `rows` is None when streamed (counted as the stream reads) or read by datasets as a whole."""

    dataset: object
    parts: list[Part] | None
    rows: list[tuple[str, int]] | None

    def counts(self, indices=None) -> dict[str, int] | None:
        """Rows per format label (of `indices` when a draw took some rows only)."""
        if self.rows is None:
            return None
        sizes = np.array([n for _, n in self.rows], dtype=np.int64)
        if indices is None:
            per = sizes
        else:
            which = np.searchsorted(np.cumsum(sizes), np.asarray(indices, dtype=np.int64), side="right")
            per = np.bincount(which, minlength=len(sizes))
        out: dict[str, int] = {}
        for (label, _), n in zip(self.rows, per.tolist()):
            out[label] = out.get(label, 0) + n
        return out


def file_format(file: str) -> tuple[str, str, dict] | None:
    """(label, datasets module, its kwargs) of a data file by the first of its suffixes datasets knows (a.jsonl.gz:
    jsonl), or None."""
    for suffix in Path(file).name.split(".")[1:]:
        ext = "." + suffix.lower()
        if ext in _EXTENSION_TO_MODULE:
            module, kwargs = _EXTENSION_TO_MODULE[ext]
            return suffix.lower(), module, dict(kwargs)
    return None


def _label(file: str) -> str:
    found = file_format(file)
    return found[0] if found else (Path(file).suffix.lstrip(".").lower() or Path(file).name)


def label_of(files: list[str]) -> str:
    """The format most of a folder's files have ('files' when none is known)."""
    return Counter(_label(f) for f in files).most_common(1)[0][0] if files else "files"


def is_saved(path: Path) -> bool:
    """A save_to_disk folder (a Dataset or a DatasetDict)."""
    return path.is_dir() and ((path / "dataset_dict.json").exists() or (path / "dataset_info.json").exists())


def declares_configs(path: Path) -> bool:
    """A folder whose README.md declares its configs (its YAML block's `configs`), or that has a .huggingface.yaml:
    datasets reads it as they say."""
    import yaml
    from huggingface_hub import metadata_load

    if (path / ".huggingface.yaml").is_file():
        return True
    try:
        meta = metadata_load(path / "README.md") if (path / "README.md").is_file() else None
    except (OSError, ValueError, yaml.YAMLError):  # a card datasets cannot read either: it says so when it reads
        return False
    return bool((meta or {}).get("configs"))


def splits_of(name: str, key: str) -> dict[str, list[str]] | None:
    """split -> its files (sorted as datasets lists them) of a local data file or a folder of data files; None for
    anything else (a hub id, a save_to_disk folder, a folder whose card declares configs)."""
    path = Path(name).expanduser()
    if path.is_file():
        if path.suffix.lower() not in SINGLE_FILE:
            raise RecipeError(f"{key}: '{name}' has suffix '{path.suffix}'; use one of {', '.join(SINGLE_FILE)}")
        return {"train": [str(path)]}
    if not path.is_dir() or is_saved(path) or declares_configs(path):
        return None
    base = str(path.resolve())
    try:
        found = DataFilesDict.from_patterns(get_data_patterns(base), base_path=base, allowed_extensions=_ALL_ALLOWED_EXTENSIONS)
    except EmptyDatasetError:
        raise RecipeError(f"{key}: the folder '{name}' holds no data file (parquet, json/jsonl, csv, arrow...); "
                          "put the data files in it, or point it at the folder that has them") from None
    splits = {str(split): [str(f) for f in files] for split, files in found.items()}
    _note_unread(name, path, splits)
    return splits


def _note_unread(name: str, path: Path, splits: dict[str, list[str]]) -> None:
    """One log line for the data files of a folder that no split holds (datasets reads only those a split's name
    matches once some file is named by a split): counted, never silently left out."""
    key = str(path.resolve())
    if key in _noted:
        return
    _noted.add(key)
    taken = {str(Path(f).resolve()) for files in splits.values() for f in files}
    unread = sorted(str(f.relative_to(path)) for f in path.rglob("*") if f.is_file() and str(f.resolve()) not in taken
                    and not any(p.startswith(".") for p in f.relative_to(path).parts)
                    and not any(p.startswith("__") for p in f.relative_to(path).parent.parts)
                    and f.name not in NOT_DATA and any(f.name.lower().endswith(e) for e in _ALL_ALLOWED_EXTENSIONS))
    if unread:
        log.warning("data: %s: %d file%s in no split, not read (%s%s): datasets makes a folder's splits from its file "
                    "names (%s); rename or move %s to read %s", name, len(unread), "s" if len(unread) > 1 else "",
                    ", ".join(unread[:3]), ", ..." if len(unread) > 3 else "", ", ".join(f"{s}: {len(f)}" for s, f in splits.items()),
                    "it" if len(unread) == 1 else "them", "it" if len(unread) == 1 else "them")


def base_split(split: str) -> str:
    """The split a spec names: 'train[:10%]' -> 'train'."""
    return split.split("[", 1)[0].strip()


def parts_of(name: str, split: str, files: list[str], key: str) -> list[Part] | None:
    """A split's files grouped by format, in the order each format's first file sorts; None when datasets reads the
    folder as it is (one format of another kind: text files, an image folder and its metadata file); one line when
    the split mixes formats that cannot be read together."""
    formats = [file_format(f) for f in files]
    module, _ = infer_module_for_data_files_list(files)  # datasets' choice for the folder: the most common format
    if module not in COMBINED and all(fmt is None and Path(f).suffix.lower() == ".zip" for fmt, f in zip(formats, files)):
        return None  # archives: datasets looks inside them
    if module is not None and module not in COMBINED:
        meta = _MODULE_TO_METADATA_FILE_NAMES.get(module, [])
        if all((fmt and fmt[1] == module) or Path(f).name in meta for fmt, f in zip(formats, files)):
            return None
    if module is None or any(fmt is None or fmt[1] not in COMBINED for fmt in formats):
        found = Counter(_label(f) for f in files)
        other = [f for fmt, f in zip(formats, files) if fmt is None or fmt[1] not in COMBINED]
        raise RecipeError(
            f"{key}: the {base_split(split)} split of '{name}' holds {', '.join(f'{n} {label}' for label, n in found.items())} "
            f"file{'s' if len(files) > 1 else ''} ({', '.join(Path(f).name for f in other[:3])}{', ...' if len(other) > 3 else ''} "
            "cannot be read with the others): one split reads parquet, json/jsonl, csv/tsv and arrow files together, or "
            "a folder of one other kind alone; move the other files out of the folder")
    groups: dict[str, list[str]] = {}
    kinds: dict[str, tuple[str, dict]] = {}
    for (label, mod, kwargs), f in zip(formats, files):
        groups.setdefault(label, []).append(f)
        kinds[label] = (mod, kwargs)
    return [Part(label, kinds[label][0], tuple(sorted(kinds[label][1].items())), tuple(fs)) for label, fs in groups.items()]


# ----------------------------------------------------------------------------------------------- reading


@contextlib.contextmanager
def quiet_readers():
    """datasets' readers log their own error line before raising; the error raised here names the row instead."""
    logger = logging.getLogger("datasets.packaged_modules")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def read(name: str, split: str, parts: list[Part], key: str, streaming: bool = False) -> Read:
    """The rows of a split's parts: each format's files by datasets' reader (into its cache, memory-mapped), the
    parts concatenated; streaming: an IterableDataset over the parts in the same order."""
    base = base_split(split)
    if streaming:
        return Read(stream_parts(name, split, parts, key), parts, None)
    loaded = []
    for part in parts:
        try:
            with quiet_readers():
                loaded.append(datasets.load_dataset(part.module, data_files={base: list(part.files)},
                                                    split=split if len(parts) == 1 else base, **dict(part.kwargs)))
        except UNREADABLE as e:
            raise RecipeError(unreadable(name, split, part, e, key)) from None
    if len(loaded) == 1:
        return Read(loaded[0], parts, [(parts[0].label, len(loaded[0]))])
    _same_columns(name, split, parts, [ds.column_names for ds in loaded], key)
    try:
        whole = datasets.concatenate_datasets(loaded)
    except ValueError as e:
        raise RecipeError(_type_clash(name, split, parts, [ds.features for ds in loaded], key, e)) from None
    rows = [(p.label, len(ds)) for p, ds in zip(parts, loaded)]
    if split != base:  # a slice of the split ('train[:10%]'), over the parts as concatenated
        spans = datasets.ReadInstruction.from_spec(split).to_absolute({base: len(whole)})
        keep = np.concatenate([np.arange(s.from_, s.to, dtype=np.int64) for s in spans]) if spans else np.empty(0, np.int64)
        sizes = Read(None, parts, rows).counts(keep) if len(keep) else {}
        whole = whole.select(keep)
        rows = [(label, sizes.get(label, 0)) for label, _ in rows]
    return Read(whole, parts, rows)


def _same_columns(name: str, split: str, parts: list[Part], columns: list[list[str]], key: str) -> None:
    for part, cols in zip(parts[1:], columns[1:]):
        if sorted(cols) != sorted(columns[0]):
            raise RecipeError(
                f"{key}: the {base_split(split)} split of '{name}' mixes files whose columns differ: "
                f"{Path(parts[0].files[0]).name} has {', '.join(columns[0])}; {Path(part.files[0]).name} has {', '.join(cols)}; "
                "give every file of the split the same columns (or read each format as its own datasets: entry with columns: renames)")


def _type_clash(name: str, split: str, parts: list[Part], features: list, key: str, error: Exception) -> str:
    first = features[0]
    for part, feats in zip(parts[1:], features[1:]):
        for col in first:
            if col in feats and feats[col] != first[col]:
                return (f"{key}: the {base_split(split)} split of '{name}' mixes files whose columns cannot be combined: "
                        f"'{col}' is {str(first[col])[:80]} in {Path(parts[0].files[0]).name} and {str(feats[col])[:80]} in "
                        f"{Path(part.files[0]).name}; give every file of the split the same column types")
    return (f"{key}: the files of the {base_split(split)} split of '{name}' cannot be combined ({str(error).splitlines()[0][:200]}); "
            "give every file of the split the same columns and types")


def stream_parts(name: str, split: str, parts: list[Part], key: str):
    """The parts as one datasets.IterableDataset read in order; several parts: each batch cast to the first part's
    columns (struct fields in its order) and tagged with its part's index (PART_COLUMN)."""
    base = base_split(split)
    streams = [datasets.load_dataset(p.module, data_files={base: list(p.files)}, split=base, streaming=True, **dict(p.kwargs))
               for p in parts]
    if len(streams) == 1:
        return streams[0]
    firsts = []
    for part, s in zip(parts, streams):
        try:
            with quiet_readers():
                firsts.append(next(iter(s.with_format("arrow").iter(batch_size=1)), None))
        except UNREADABLE as e:
            raise RecipeError(unreadable(name, split, part, e, key)) from None
    shown = [(p, t) for p, t in zip(parts, firsts) if t is not None]
    if not shown:
        return streams[0]
    _same_columns(name, split, [p for p, _ in shown], [t.column_names for _, t in shown], key)
    target = datasets.Features.from_arrow_schema(shown[0][1].schema)
    for part, table in shown[1:]:
        try:
            table_cast(table, target.arrow_schema)
        except (ValueError, TypeError, pa.ArrowException) as e:
            raise RecipeError(_type_clash(name, split, [shown[0][0], part], [target, datasets.Features.from_arrow_schema(table.schema)],
                                          key, e)) from None
    tagged = [s.with_format("arrow").map(partial(_tag, schema=target.arrow_schema, index=i), batched=True)
              for i, s in enumerate(streams)]
    return datasets.concatenate_datasets(tagged)


def _tag(table: pa.Table, schema: pa.Schema, index: int) -> pa.Table:
    return table_cast(table, schema).append_column(PART_COLUMN, pa.array(np.full(table.num_rows, index, np.int32)))


def untag(table: pa.Table) -> tuple[pa.Table, np.ndarray | None]:
    """A streamed batch without its part column, and each row's part index (None: one part)."""
    if PART_COLUMN not in table.column_names:
        return table, None
    parts = table.column(PART_COLUMN).to_numpy(zero_copy_only=False)
    return table.drop_columns([PART_COLUMN]), parts


# ----------------------------------------------------------------------------------------------- bad rows


def unreadable(name: str, split: str, parts: Part | list[Part], error: BaseException, key: str) -> str:
    """One line for data datasets could not read (a part, or the parts of a stream, in order): the file and 1-based
    line of the first row that cannot be parsed where one is found (the files scanned again), else the file(s) and
    the reader's message."""
    parts = [parts] if isinstance(parts, Part) else parts
    for part in parts:
        found = badrows.locate(part.module, part.files, dict(part.kwargs).get("sep", ","))
        if found:
            file, line, why = found
            if line is not None:
                return f"{key}: {file} line {line} cannot be read ({why}); fix or remove that line"
            return f"{key}: {file} cannot be read ({why}); replace the file, or move it out of the folder"
    cause = error.__cause__ if isinstance(error, DatasetGenerationError) and error.__cause__ else error
    files = [f for part in parts for f in part.files]
    what = files[0] if len(files) == 1 else f"the {len(files)} files of {name} ({base_split(split)})"
    return (f"{key}: {what} cannot be read ({type(cause).__name__}: {(str(cause).splitlines() or [''])[0][:200]}); "
            "check the data")


# ----------------------------------------------------------------------------------------------- splits


def split_names(name: str, key: str, config: str | None = None) -> list[str] | None:
    """The splits a local source has, without reading its rows: a file's one 'train', a save_to_disk folder's (from
    dataset_dict.json; a saved Dataset answers any), a folder's by its file names; None where only loading says (a
    hub id, a folder whose card declares configs, a config named)."""
    path = Path(name).expanduser()
    if path.is_file():
        return ["train"]
    if is_saved(path):
        try:
            return list(json.loads((path / "dataset_dict.json").read_text())["splits"]) if (path / "dataset_dict.json").exists() else None
        except (OSError, ValueError, KeyError, TypeError):
            return None
    if config:
        return None
    found = splits_of(name, key)
    return None if found is None else list(found)


def missing_split(name: str, split: str, split_key: str, names: list[str]) -> str:
    """The line refusing a split a local source does not have."""
    path = Path(name).expanduser()
    if path.is_file():
        return (f"{split_key}: '{split}' asked of the single file '{name}', which is one 'train' split; use a folder "
                f"with {base_split(split)}.jsonl")
    if is_saved(path):
        return f"{split_key}: '{split}' not in '{name}' (has {', '.join(names)}); fix {split_key}"
    return (f"{split_key}: '{split}' not found in the folder '{name}' (its files make the split{'s' if len(names) > 1 else ''} "
            f"{', '.join(names)}: datasets names a split by its file or folder names, e.g. {base_split(split)}.jsonl or "
            f"{base_split(split)}/); fix {split_key}, or add the {base_split(split)} files")


def has_split(name: str, split: str, key: str, config: str | None = None) -> tuple[bool | None, list[str] | None]:
    """(whether a local source has the split, its splits); (None, None) where only loading can say."""
    names = split_names(name, key, config)
    if names is None:
        return None, None
    path = Path(name).expanduser()
    if path.is_file():
        return "train" in split, names
    return (split if is_saved(path) else base_split(split)) in names, names  # (a saved split is named whole)

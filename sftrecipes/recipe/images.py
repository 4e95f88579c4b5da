"""Rows that carry images (TRL's vision-language rows: an `images` or `image` column, or message content given as
parts with `{"type": "image"}`), counted torch-free and refused in one line where they cannot train: a text model
would never see them and training on the rest of the row would drop them without a word. A vision-language model
(its config.json declares a vision tower) trains on them with method sft, unstreamed, from one dataset
(data/vision.py); packing is refused for them (`check_vision_keys`).

Three places count them: recipe validation, from the local files pyarrow or the json module read without torch (the
first row, or the schema, of a split's first file; every row once it shows images), each run before it tokenizes
a split (`refuse_split`, on the split as loaded: every row, whatever its source — SFT, preference data, an evaluation —
read only where its schema has an image column or content parts), and a streamed split buffer by buffer
(`refuse_buffer`: the rows of the buffer that carry images, of the rows it read).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sftrecipes.core.errors import RecipeError
from sftrecipes.facts.config import config_path, read_config

if TYPE_CHECKING:
    from sftrecipes.recipe.sources import Source
    from sftrecipes.recipe.typed import Recipe

IMAGE_COLUMNS = ("images", "image")  # TRL's vision-language datasets: a list of images per row, or one
IMAGE_PARTS = ("image", "image_url")  # content parts that stand for an image ({"type": "image"}, OpenAI's image_url)
TURN_COLUMNS = ("messages", "conversations", "prompt", "completion", "chosen", "rejected")  # columns holding turns
FILE_SUFFIXES = (".jsonl", ".json", ".parquet")  # what validation reads without torch (others: counted in the run)


def vision_tower(model_name_or_path: str) -> bool | None:
    """Whether the model's config.json declares a vision tower (vision_config), None when no config is at hand."""
    if not config_path(model_name_or_path).is_file():
        return None
    try:
        cfg = read_config(model_name_or_path)
    except RecipeError:
        return None
    return any(k in cfg for k in ("vision_config", "vision_tower", "visual"))


# ----------------------------------------------------------------------------------------------- counting


def is_image_part(part: Any) -> bool:
    return isinstance(part, dict) and (part.get("type") in IMAGE_PARTS or any(part.get(k) is not None for k in IMAGE_PARTS))


def _turns_have_image(turns: Any) -> bool:
    if not isinstance(turns, list):
        return False
    for m in turns:
        if isinstance(m, dict):
            content = m.get("content", m.get("value"))
            if isinstance(content, list) and any(is_image_part(p) for p in content):
                return True
    return False


def row_images(row: dict) -> list[str]:
    """What of one row (a dict) stands for images: its image columns with a value, '<column> content parts'."""
    found = [c for c in IMAGE_COLUMNS if row.get(c) not in (None, [], "")]
    found += [f"{c} content parts" for c in TURN_COLUMNS if _turns_have_image(row.get(c))]
    return found


def count_rows(rows) -> tuple[int, int, dict[str, int]]:
    """(rows read, rows with images, rows per kind: 'images', 'image', '<column> content parts') of dict rows."""
    n, with_images, kinds = 0, 0, {}
    for row in rows:
        n += 1
        found = row_images(row) if isinstance(row, dict) else []
        with_images += bool(found)
        for k in found:
            kinds[k] = kinds.get(k, 0) + 1
    return n, with_images, kinds


def _parts_type(t) -> bool:
    """Whether an Arrow type is a list of messages whose content is a list of parts with a `type` field."""
    import pyarrow as pa

    if not (pa.types.is_list(t) or pa.types.is_large_list(t)) or not pa.types.is_struct(t.value_type):
        return False
    names = [f.name for f in t.value_type]
    key = "content" if "content" in names else "value" if "value" in names else None
    if key is None:
        return False
    content = t.value_type.field(key).type
    return (pa.types.is_list(content) or pa.types.is_large_list(content)) and pa.types.is_struct(content.value_type)


def image_columns(schema) -> list[str]:
    """The columns of an Arrow schema that may hold images: image columns, and turns whose content is a list of parts."""
    return [c for c in schema.names if c in IMAGE_COLUMNS or (c in TURN_COLUMNS and _parts_type(schema.field(c).type))]


def count_table(table) -> tuple[int, int, dict[str, int]]:
    """count_rows for a pyarrow Table, a record batch at a time: image columns read as columns, turns flattened (no
    Python row objects)."""
    n, rows, kinds = 0, 0, {}
    for batch in table.to_batches():
        bn, brows, bkinds = _count_batch(batch)
        n, rows = n + bn, rows + brows
        for k, v in bkinds.items():
            kinds[k] = kinds.get(k, 0) + v
    return n, rows, kinds


def _count_batch(batch) -> tuple[int, int, dict[str, int]]:
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    n = batch.num_rows
    hit = np.zeros(n, dtype=bool)
    kinds: dict[str, int] = {}
    for c in IMAGE_COLUMNS:
        if c not in batch.schema.names:
            continue
        col = batch.column(c)
        has = pc.is_valid(col)
        if pa.types.is_list(col.type) or pa.types.is_large_list(col.type):
            has = pc.and_(has, pc.greater(pc.fill_null(pc.list_value_length(col), 0), 0))
        elif pa.types.is_string(col.type) or pa.types.is_large_string(col.type):
            has = pc.and_(has, pc.not_equal(pc.fill_null(col, ""), ""))
        mask = np.asarray(pc.fill_null(has, False).to_numpy(zero_copy_only=False), dtype=bool)
        if mask.any():
            kinds[c] = int(mask.sum())
            hit |= mask
    for c in TURN_COLUMNS:
        if c not in batch.schema.names or not _parts_type(batch.schema.field(c).type):
            continue
        turns = batch.column(c)
        msgs, msg_row = pc.list_flatten(turns), np.asarray(pc.list_parent_indices(turns))
        key = "content" if "content" in [f.name for f in msgs.type] else "value"
        content = pc.struct_field(msgs, key)
        parts, part_msg = pc.list_flatten(content), np.asarray(pc.list_parent_indices(content))
        names = [f.name for f in parts.type]
        img = np.zeros(len(parts), dtype=bool)
        if "type" in names:
            img |= np.asarray(pc.fill_null(pc.is_in(pc.struct_field(parts, "type"), value_set=pa.array(IMAGE_PARTS)), False)
                              .to_numpy(zero_copy_only=False), dtype=bool)
        for k in IMAGE_PARTS:
            if k in names:
                img |= np.asarray(pc.is_valid(pc.struct_field(parts, k)).to_numpy(zero_copy_only=False), dtype=bool)
        mask = np.zeros(n, dtype=bool)
        mask[msg_row[part_msg[img]]] = True
        if mask.any():
            kinds[f"{c} content parts"] = int(mask.sum())
            hit |= mask
    return n, int(hit.sum()), kinds


# ----------------------------------------------------------------------------------------------- the refusal


def refusal(recipe: Recipe, where: str, counted: tuple[int, int, dict[str, int]]) -> RecipeError:
    """The one line for a split whose rows carry images: which column, how many rows, why, what to do."""
    n, rows, kinds = counted
    what = "; ".join(f"column '{k}': {v} row{'s' * (v != 1)}" if k in IMAGE_COLUMNS else
                     f"{v} row{'s' * (v != 1)} with {{\"type\": \"image\"}} parts in column '{k.split()[0]}'"
                     for k, v in kinds.items())
    first = next(iter(kinds))
    key = first if first in IMAGE_COLUMNS else first.split()[0]
    model = recipe.model.model_name_or_path
    if vision_tower(model):
        why = (f"{model} has a vision tower, but here images train with method sft, unstreamed, from one dataset, "
               "through an image-text-to-text class of transformers "
               f"({images_refused(recipe) or 'transformers maps its config to none'}), so the images would be dropped "
               "without a word")
    else:
        why = (f"{model} has no vision tower (its config.json declares no vision_config): it cannot read images, and "
               "training on the rest of each row would drop them without a word")
    return RecipeError(f"{key}: {rows} of {n} rows of {where} carry images ({what}); {why}; train on rows without "
                       "images (remove the image column and the image parts, or choose a text dataset)")


def refuse_split(recipe: Recipe, ds, where: str) -> None:
    """A loaded split (datasets.Dataset) whose rows carry images: refused, before it is tokenized."""
    if ds is None or not set(ds.column_names) & set(IMAGE_COLUMNS + TURN_COLUMNS):
        return
    cols = image_columns(ds.features.arrow_schema)
    if not cols:  # (text content: nothing to read)
        return
    counted = count_table(ds.select_columns(cols).with_format("arrow")[:])
    if counted[1]:
        raise refusal(recipe, where, counted)


def refuse_buffer(recipe: Recipe, table, where: str) -> None:
    """A streamed buffer (a pyarrow Table of the rows read together) whose rows carry images: refused, every row of
    the buffer counted, before it is prepared (the run stops as on any row the stream cannot use)."""
    cols = image_columns(table.schema)
    if cols:
        counted = count_table(table.select(cols))
        if counted[1]:
            raise refusal(recipe, where, counted)


# ----------------------------------------------------------------------------------------------- torch-free, at validation


def images_refused(recipe: Recipe) -> str | None:
    """Why rows with images cannot train with this recipe on a vision-language model (data/vision.py reads them),
    None where they can."""
    if recipe.method != "sft":
        return f"method {recipe.method}"
    if recipe.data.streaming:
        return "streaming"
    return "a mixture of datasets" if len(recipe.data.datasets or ()) > 1 else None


def image_file(value: str, folder: Path, where: str) -> Path:
    """A local image a row names, absolute or relative to its dataset's folder (`folder`); not a file: one line naming
    it (`where`: which image of which row)."""
    p = Path(value).expanduser()
    p = p if p.is_absolute() else folder / p
    if not p.is_file():
        raise RecipeError(f"images: {where} names {value}, which is not a file ({p}); fix the path or remove the row")
    return p


def check_image_files(path: Path, where: str) -> None:
    """Every local image a JSON-lines file names (an `images` list or one `image`, relative to the file's folder) is a
    file: the first one missing is one line naming it and its row (data/vision.py checks the rest in the run)."""
    if path.suffix not in (".jsonl", ".json"):
        return
    for i, row in enumerate(_jsonl_rows(path)):
        value = row.get("images") if isinstance(row, dict) else None
        value = value if isinstance(value, list) else [row.get("image")] if isinstance(row, dict) else []
        for j, v in enumerate(value):
            if isinstance(v, str) and not v.startswith(("http://", "https://")):
                image_file(v, path.parent, f"image {j + 1} of row {i + 1} of {where}")


def check_vision_keys(recipe: Recipe) -> None:
    """Rows with images for a vision-language model: no packing (TRL has no padding-free batches for images)."""
    for key in ("packing", "padding_free"):
        if recipe.trl_value(key):
            raise RecipeError(f"{key}: rows with images cannot be packed (TRL has no padding-free batches for images); "
                              f"set {key}: false")


def split_files(path: str, split: str) -> list[Path]:
    """The local files a split of `path` is read from, for the layouts read here without datasets: one file (the
    'train' split), a folder with <split>.jsonl/.json/.parquet or <split>-*.<ext> (also under data/). Others: []."""
    p = Path(path).expanduser()
    if p.is_file():
        return [p] if "train" in split and p.suffix in FILE_SUFFIXES else []
    if not p.is_dir() or (p / "dataset_dict.json").exists() or (p / "dataset_info.json").exists():
        return []  # a hub id, or a save_to_disk folder: counted in the run
    for folder in (p, p / "data"):
        for ext in FILE_SUFFIXES:
            found = sorted([*folder.glob(f"{split}{ext}"), *folder.glob(f"{split}-*{ext}")])
            if found:
                return found
    return []


def _jsonl_rows(path: Path):
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                try:
                    yield json.loads(line)
                except ValueError:
                    return  # not JSON lines (a JSON array, a broken line): the run's loader reads it and says


def shows_images(path: Path) -> bool:
    """Whether a file's first row (JSON lines) or its schema (parquet) shows images: an image column, or turns
    whose content is a list of parts (then counted over every row)."""
    if path.suffix in (".jsonl", ".json"):
        first = next(_jsonl_rows(path), None)
        return isinstance(first, dict) and bool(set(first) & set(IMAGE_COLUMNS) or any(
            isinstance(m, dict) and isinstance(m.get("content", m.get("value")), list)
            for c in TURN_COLUMNS if isinstance(first.get(c), list) for m in first[c]))
    import pyarrow.parquet as pq

    return bool(image_columns(pq.read_schema(path)))


def count_file(path: Path) -> tuple[int, int, dict[str, int]]:
    """(rows, rows with images, per kind) of one file, every row read."""
    if path.suffix in (".jsonl", ".json"):
        return count_rows(_jsonl_rows(path))
    import pyarrow.parquet as pq

    cols = image_columns(pq.read_schema(path))
    return count_table(pq.read_table(path, columns=cols)) if cols else (pq.read_metadata(path).num_rows, 0, {})


def check_sources(recipe: Recipe, srcs: list[Source], eval_only: bool = False) -> None:
    """Recipe validation: a split read from local files whose first file shows images (shows_images) is counted, every
    row of every file, and refused before torch loads. eval_only: the eval splits only (an evaluation-only run)."""
    for src in srcs:
        for split in dict.fromkeys(s for s in ([] if eval_only else [src.split]) + [src.eval_split] if s):
            files = split_files(src.path, split)
            if not files or not shows_images(files[0]):  # (the first shard stands for the rest: the run counts every row)
                continue
            n, rows, kinds = 0, 0, {}
            for f in files:
                fn, frows, fkinds = count_file(f)
                n, rows = n + fn, rows + frows
                for k, v in fkinds.items():
                    kinds[k] = kinds.get(k, 0) + v
            if rows and (not vision_tower(recipe.model.model_name_or_path) or images_refused(recipe)):
                raise refusal(recipe, f"{src.key} {src.path} ({split})", (n, rows, kinds))
            if rows:
                check_vision_keys(recipe)
                for f in files:
                    check_image_files(f, f"{src.key} {src.path} ({split})")

"""Rows with images for a vision-language model (TRL's vision format: an `images` list of local paths or bytes, or
one `image`, and `messages` whose content is a string or image and text parts): read, checked and counted once
(`vision_datasets`), each batch then made by the model's own processor (`VisionCollator`: images to pixels, image
tokens expanded, labels -100 on padding, on every image token and, under assistant_only_loss, on all but the
assistant turns).

TRL 1.16 does the same on the fly (DataCollatorForVisionLanguageModeling): pixels are made per batch, not cached,
so these rows skip the text pipeline's tokenize-and-cache step (prepcache.py); TRL's own preparation is skipped
(`skip_prepare_dataset`) and this collator replaces TRL's, whose assistant mask needs `{% generation %}` markers
that released templates (Gemma-3's) lack. Packing is refused: TRL has no padding-free batches for images.
"""

from __future__ import annotations

import io
import logging
from pathlib import Path

import torch
from PIL import Image
from transformers import AutoProcessor
from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

from sftrecipes.core.errors import RecipeError
from sftrecipes.data.load import read_splits
from sftrecipes.facts.config import read_config
from sftrecipes.recipe.images import (IMAGE_COLUMNS, check_vision_keys, image_columns, image_file, images_refused,
                                      is_image_part, refuse_split)
from sftrecipes.recipe.sources import sources
from sftrecipes.recipe.typed import Recipe

log = logging.getLogger("sftrecipes")

PROBE = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "?"}]}]


def is_vision_language(model_name_or_path: str) -> bool:
    """Whether transformers maps the model's config to an image-text-to-text class (read from its config.json)."""
    try:
        return read_config(model_name_or_path).get("model_type") in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES
    except RecipeError:  # no config at hand (a hub id without a shipped copy): the model's loader says what is wrong
        return False


def load_processor(recipe: Recipe, tokenizer):
    """The model's processor with the run's tokenizer (its end of turn, pad token) and the template the recipe
    chooses: the processor's own under chat_template_format tokenizer (or chat_template_path's). A template that
    renders an image part without the processor's image token would train on the text with the images dropped:
    one line."""
    m = recipe.model
    processor = AutoProcessor.from_pretrained(m.tokenizer_name_or_path or m.model_name_or_path,
                                              trust_remote_code=bool(recipe.trl_value("trust_remote_code")))
    own = processor.chat_template
    processor.tokenizer = tokenizer
    processor.chat_template = own if m.chat_template_format == "tokenizer" and not recipe.trl.get("chat_template_path") \
        else tokenizer.chat_template
    token = getattr(processor, "image_token", None)
    try:
        shown = processor.apply_chat_template(PROBE, tokenize=False)
    except Exception as e:  # noqa: BLE001 - a template that cannot take content parts: said in one line
        shown, token = f"{type(e).__name__}: {e}", token or "?"
    if token is None or token not in shown:
        raise RecipeError(f"chat_template_format: the {m.chat_template_format} template renders an image part without "
                          f"{token or 'the image token'} ({shown[:80]!r}), so the images would never reach the model; "
                          "set chat_template_format: tokenizer (the model's own template, from its processor)")
    return processor


def _open(value, where: str) -> Image.Image:
    """One image of a row: a path, bytes, a datasets Image ({"bytes", "path"}) or a PIL image, in RGB."""
    try:
        if isinstance(value, Image.Image):
            return value.convert("RGB")
        if isinstance(value, dict):
            value = value.get("bytes") or value.get("path")
        if isinstance(value, (bytes, bytearray)):
            return Image.open(io.BytesIO(value)).convert("RGB")
        return Image.open(value).convert("RGB")
    except (OSError, ValueError) as e:
        raise RecipeError(f"images: {where} cannot be read as an image ({type(e).__name__}: {str(e)[:120]}); fix or "
                          "remove the row") from None


def _resolve(value, folder: Path, where: str):
    """A path as the row gives it: absolute, or relative to the dataset's folder; missing: one line naming it."""
    if isinstance(value, str):
        if value.startswith(("http://", "https://")):
            raise RecipeError(f"images: {where} is a URL ({value[:80]}); runs here read local files only: download "
                              "it and give its path")
        return str(image_file(value, folder, where))
    return value


def length(processor, text: str, images: list) -> int:
    """Tokens of a rendered text with its images expanded by the processor."""
    return len(processor(text=[text], images=[images] if images else None, add_special_tokens=False)["input_ids"][0])


def _parts(messages) -> int:
    return sum(is_image_part(p) for m in messages if isinstance(m.get("content"), list) for p in m["content"])


def _checked(ds, folder: Path, where: str, processor, max_length: int | None):
    """The split's rows as `messages` + `images` (paths resolved), each row's images counted against its image parts
    and opened once, its tokens counted with the images expanded: rows past max_length dropped (an image cannot be
    cut) and counted; (rows, counts)."""
    if "messages" not in ds.column_names:
        raise RecipeError(f"dataset_name: {where} carries images but no 'messages' column; rows with images are read in "
                          "TRL's vision format: messages (content as image and text parts) with images or image")
    col = next(c for c in IMAGE_COLUMNS if c in ds.column_names)
    images = 0

    def fix(row, i):
        nonlocal images
        got = row[col] if col == "images" else [row[col]] if row[col] is not None else []
        at = f"row {i + 1} of {where}"
        if _parts(row["messages"]) != len(got):
            raise RecipeError(f"images: {at} has {len(got)} image(s) but {_parts(row['messages'])} image part(s) in "
                              "its messages; give one {\"type\": \"image\"} part per image")
        got = [_resolve(v, folder, f"image {j + 1} of {at}") for j, v in enumerate(got)]
        opened = [_open(v, f"image {j + 1} of {at}") for j, v in enumerate(got)]
        images += len(got)
        messages = [{k: v for k, v in m.items() if v is not None} for m in row["messages"]]
        return {"images": got, "_tokens": length(processor, processor.apply_chat_template(messages, tokenize=False), opened)}

    keep = ["messages", "images"]
    out = ds.map(fix, with_indices=True, remove_columns=[c for c in ds.column_names if c not in keep],
                 load_from_cache_file=False)
    long = [i for i, n in enumerate(out["_tokens"]) if max_length is not None and n > max_length]
    if long:
        log.warning("data: %s: %d rows longer than max_length %d with their images expanded dropped (an image "
                    "cannot be cut; raise max_length to keep them)", where, len(long), max_length)
        out = out.select(sorted(set(range(len(out))) - set(long)))
    out = out.remove_columns("_tokens")
    return out, {"read": len(ds), "dropped_too_long": len(long), "kept": len(out), "images": images,
                 "rows_with_images": sum(bool(x) for x in out["images"])}


def vision_datasets(recipe: Recipe, tokenizer):
    """(train, eval or None, counts, collator, processor, the end-of-run sample's (messages, images)) of rows with
    images for a vision-language model; None when
    the model is not one or the training split shows no images (the text pipeline reads it, refusing images for a
    text model)."""
    if not is_vision_language(recipe.model.model_name_or_path):
        return None
    srcs = sources(recipe)
    got, got_eval, _ = read_splits(recipe, srcs[0])
    if not image_columns(got.dataset.features.arrow_schema) or not set(IMAGE_COLUMNS) & set(got.dataset.column_names):
        return None
    src = srcs[0]
    if images_refused(recipe):  # (a mixture: the refusal counts the rows)
        refuse_split(recipe, got.dataset, f"{src.key} {src.path} ({src.split})")
    check_vision_keys(recipe)
    processor = load_processor(recipe, tokenizer)
    folder = Path(src.path) if Path(src.path).is_dir() else Path(src.path).parent
    cut = recipe.trl_value("max_length")
    train, counts = _checked(got.dataset, folder, f"{src.key} {src.path} ({src.split})", processor, cut)
    out = {"train": counts}
    evals = None
    if got_eval is not None:
        evals, out["eval"] = _checked(got_eval.dataset, folder, f"{src.key} {src.path} ({src.eval_split})", processor, cut)
    aol = bool(recipe.trl_value("assistant_only_loss"))
    for split, c in out.items():
        log.info("data: %s split: %d rows read, %d kept, %d images (%d rows with images), %d dropped past max_length; "
                 "batches made by %s; loss on %s, never on image tokens", split, c["read"], c["kept"], c["images"],
                 c["rows_with_images"], c["dropped_too_long"], type(processor).__name__,
                 "the assistant turns" if aol else "every token")
    return train, evals, out, VisionCollator(processor, aol), processor, sample_prompt(evals if evals is not None else train)


def sample_prompt(ds) -> tuple[list[dict] | None, list]:
    """The end-of-run sample's prompt: the first row's conversation up to its first user turn, with the images its
    parts stand for (the eval split's, where there is one), as (messages, images); (None, []) for an empty split."""
    if len(ds) == 0:
        return None, []
    row = ds[0]
    messages = [{k: [{a: b for a, b in part.items() if b is not None} for part in v] if isinstance(v, list) else v
                 for k, v in m.items() if v is not None} for m in row["messages"]]  # (Arrow's None for absent keys)
    first_user = next((i for i, m in enumerate(messages) if m["role"] == "user"), 0)
    messages = messages[: first_user + 1]
    return messages, list(row["images"][: _parts(messages)])


def open_images(images: list) -> list:
    """A prompt's images as the processor takes them (paths, bytes: opened in RGB)."""
    return [_open(v, "an image of the sample prompt") for v in images]


class VisionCollator:
    """A batch of `messages` + `images` rows through the processor: input_ids, attention_mask, pixels (and what else
    the processor gives), labels -100 on padding, image tokens and (assistant_only) all but the assistant turns."""

    def __init__(self, processor, assistant_only: bool):
        self.processor, self.assistant_only = processor, assistant_only
        tok = processor.tokenizer
        probe = processor(text=[processor.apply_chat_template(PROBE, tokenize=False)], images=[[Image.new("RGB", (8, 8))]],
                          add_special_tokens=False)["input_ids"][0]
        plain = set(tok(processor.apply_chat_template([{"role": "user", "content": "?"}], tokenize=False),
                        add_special_tokens=False)["input_ids"])
        # the special tokens one image adds (image tokens, their begin/end marks, row/column tags), read from the
        # processor's own expansion of an image part
        self.image_ids = torch.tensor(sorted((set(probe) - plain) & set(tok.all_special_ids)))

    def _length(self, text: str, images: list) -> int:
        return length(self.processor, text, images)

    def _spans(self, messages: list[dict], images: list) -> list[tuple[int, int]]:
        """Token spans of the assistant turns: the prefix before each (with the generation prompt) and through it."""
        spans = []
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            k = _parts(messages[:i])
            before = self._length(self.processor.apply_chat_template(messages[:i], add_generation_prompt=True,
                                                                     tokenize=False), images[:k]) if i else 0
            through = self._length(self.processor.apply_chat_template(messages[: i + 1], tokenize=False),
                                    images[:_parts(messages[: i + 1])])
            spans.append((before, through))
        return spans

    def __call__(self, rows: list[dict]) -> dict:
        texts, images, spans = [], [], []
        for row in rows:
            messages = [{k: v for k, v in m.items() if v is not None} for m in row["messages"]]
            imgs = [_open(v, "an image of a batch row") for v in row["images"]]
            texts.append(self.processor.apply_chat_template(messages, tokenize=False))
            images.append(imgs)
            spans.append(self._spans(messages, imgs) if self.assistant_only else None)
        out = self.processor(text=texts, images=images if any(images) else None, padding=True, padding_side="right",
                             return_tensors="pt", add_special_tokens=False)
        ids = out["input_ids"]
        labels = ids.clone()
        labels[out["attention_mask"] == 0] = -100
        for b, row_spans in enumerate(spans):
            if row_spans is not None:
                trained = torch.zeros(ids.shape[1], dtype=torch.bool)
                for a, z in row_spans:
                    trained[a:z] = True
                labels[b, ~trained] = -100
        labels[torch.isin(ids, self.image_ids)] = -100
        out["labels"] = labels
        return dict(out)

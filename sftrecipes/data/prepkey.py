"""The cache key of prepared data: exactly the inputs that shape its rows, hashed (prepcache.py keeps the entries).

`key_inputs` collects each source's content (a file's bytes, or size + mtime for large ones; a save_to_disk folder's
files, its fingerprint among them; a hub dataset's revision), its splits, column renames, format and mixture draw,
the tokenizer as configured (its serialized state, chat template, special tokens, end of turn), the recipe keys that
cut, mask or count rows (`KEYED`, each where it acts: `recipe_inputs`), the code that prepares the rows and the
libraries' versions. Nothing else: a changed learning rate, output_dir or LoRA rank finds the same entry. Every
DataOptions key and TRL data key is placed in or out of the key below (tests/data/test_prepcache.py fails on one that is
not). Torch-free; the tokenizer is passed in.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from dataclasses import asdict
from importlib import metadata
from pathlib import Path
from typing import Any

from sftrecipes.recipe.sources import sources
from sftrecipes.recipe.typed import Recipe

# Bump when the layout of an entry or the meaning of a key input changes (the code that prepares rows is hashed too).
PREP_VERSION = 2  # 2: the rows as SFTTrainer reads them (packed, shuffled: trainrows.py), one Arrow file a split
# The modules whose code shapes the prepared rows: their source is part of the key.
CODE = ("data/load.py", "data/datafiles.py", "recipe/sources.py", "data/formats.py", "data/chat.py", "data/tokenization.py",
        "data/fastencode.py", "data/tokenizer.py", "data/trainrows.py", "recipe/valset.py")
LIBRARIES = ("datasets", "tokenizers", "transformers", "trl", "jinja2", "numpy", "pyarrow")

# What becomes of each recipe key the data step reads (tests/data/test_prepcache.py fails on a DataOptions key or TRL data
# key that is in none of these): its value is in the key (KEYED, some only where they act: `recipe_inputs`), it is
# in the key through the sources or the tokenizer, or it does not shape the rows (NOT_KEYED, with the reason).
KEYED = ("add_special_tokens", "append_concat_token", "dataset_text_field", "assistant_only_loss", "completion_only_loss",
         "max_length", "truncation_mode", "chat_template_format", "chat_template_path", "pad_token", "packing",
         "eval_packing", "packing_strategy", "shuffle_dataset", "seed", "val_set_size", "data_seed")
VIA_SOURCES = ("dataset_name", "datasets", "splits", "dataset_format")  # each source's path, splits, columns, format, draw
VIA_TOKENIZER = ("model_name_or_path", "tokenizer_name_or_path", "chat_template_format", "chat_template_path", "eos_token",
                 "trust_remote_code")  # the tokenizer as configured, hashed (tokenizer_fingerprint)
NOT_KEYED = {
    "data_cache_dir": "where the entries are, not what they hold",
    "dataset_num_proc": "how many processes prepare the rows, not what they make (trainrows.py packs in one)",
    "eval_strategy": "needs eval rows: checked against the entry each time it is used",
    "padding_free": "TRL's collator, on the prepared rows",
    "pad_to_multiple_of": "TRL's collator, on the prepared rows",
    "dataset_kwargs": "refused (sources.check_trl_data_keys)",
    "streaming": "a streamed training split is prepared as it is read (stream.py), never cached; its eval split is "
                 "prepared without it",
    "streaming_buffer_rows": "as streaming",
}

# A local source's files up to SMALL_FILE are hashed, up to HASHED_BYTES in all (every rank reads them, from a
# shared filesystem too); the others count by size + mtime_ns.
HASHED_BYTES = 32 << 20
SMALL_FILE = 8 << 20


def _sha(data: bytes | str) -> str:
    return hashlib.sha256(data.encode() if isinstance(data, str) else data).hexdigest()


def _file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _skipped(rel: Path) -> bool:
    """Files in a source folder that are not its data: hidden ones, the map caches `datasets` writes beside a
    save_to_disk folder's arrow files (cache-<fingerprint>.arrow), and its temporary files while it writes one
    (tmpXXXXXXXX, no suffix)."""
    return any(p.startswith(".") for p in rel.parts) or (rel.name.startswith("cache-") and rel.suffix == ".arrow") \
        or (rel.name.startswith("tmp") and not rel.suffix)


def content_fingerprint(path: str, config: str | None = None) -> str:
    """What a source holds, as a digest: a local file or folder by its files (bytes hashed up to HASHED_BYTES in all,
    files over SMALL_FILE or past that by size + mtime_ns; a save_to_disk folder's state.json carries its
    fingerprint), a hub dataset by the revision the local hub cache holds, or the hub's answer when online."""
    p = Path(path).expanduser()
    budget = HASHED_BYTES
    if p.is_file():
        files = [(Path(p.name), p)]
    elif p.is_dir():
        files = sorted((f.relative_to(p), f) for f in p.rglob("*") if f.is_file() and not _skipped(f.relative_to(p)))
    else:
        return _sha(json.dumps({"hub": path, "config": config, "revision": hub_revision(path)}))
    parts = []
    for rel, f in files:
        st = f.stat()
        if st.st_size <= SMALL_FILE and st.st_size <= budget:
            budget -= st.st_size
            parts.append([str(rel), st.st_size, _file_digest(f)])
        else:
            parts.append([str(rel), st.st_size, st.st_mtime_ns])
    return _sha(json.dumps(parts))


def hub_revision(repo: str) -> str:
    """The commit of a hub dataset: the local hub cache's refs/main, else (online) the hub's, else 'unresolved'."""
    hub = os.environ.get("HF_HUB_CACHE") or os.path.join(
        os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME") or "~/.cache", "huggingface"), "hub")
    ref = Path(hub).expanduser() / f"datasets--{repo.replace('/', '--')}" / "refs" / "main"
    with contextlib.suppress(OSError):
        return ref.read_text().strip()
    offline = any(os.environ.get(v, "").upper() in ("1", "ON", "YES", "TRUE") for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))
    if not offline:
        try:
            from huggingface_hub import HfApi

            return HfApi().dataset_info(repo, timeout=10).sha or "unresolved"
        except Exception:  # noqa: BLE001 - unreachable or unknown: loading it will say why
            pass
    return "unresolved"


def tokenizer_fingerprint(tokenizer) -> str:
    """The tokenizer as configured for the run (load_tokenizer's result), as a digest: the fast tokenizer's whole
    serialized state (vocabulary, merges, normalizer, pre/post-processor, added tokens) or a slow one's vocabulary,
    its chat template, special tokens and the init arguments that change how it encodes. Where its files came from
    (a local folder or a hub id) does not matter, what they make does."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    state = backend.to_str() if backend is not None else json.dumps(sorted(tokenizer.get_vocab().items()))
    kwargs = {k: str(v) for k, v in sorted(tokenizer.init_kwargs.items())
              if k not in ("name_or_path", "is_local", "local_files_only", "added_tokens_decoder", "chat_template",
                           "_commit_hash", "auto_map") and not k.endswith(("_file", "_files"))}
    special = {k: str(v) for k, v in sorted(tokenizer.special_tokens_map.items())}
    return _sha(json.dumps({"class": type(tokenizer).__name__, "state": _sha(state), "chat_template": tokenizer.chat_template,
                            "special": special, "init": kwargs, "size": len(tokenizer)}, sort_keys=True))


def recipe_inputs(recipe: Recipe) -> dict[str, Any]:
    """The KEYED recipe keys, each where it acts: the seed draws a mixture's rows and orders the rows under
    shuffle_dataset (the entry holds them packed and shuffled as TRL would: trainrows.py); packing_strategy acts
    under packing; val_set_size's rows are drawn under data_seed where set, else under seed."""
    value = recipe.trl_value
    packing, eval_packing = bool(value("packing")), value("eval_packing")
    packs = packing or bool(eval_packing)
    shuffle = bool(value("shuffle_dataset"))
    held_out, data_seed = recipe.data.val_set_size, recipe.trl.get("data_seed")
    out = {
        "add_special_tokens": recipe.data.add_special_tokens, "append_concat_token": recipe.data.append_concat_token,
        "dataset_text_field": value("dataset_text_field"),
        "dataset_text_field_explicit": "dataset_text_field" in recipe.explicit,  # formats.detect_format reads it
        "assistant_only_loss": bool(value("assistant_only_loss")),
        "completion_only_loss": recipe.trl.get("completion_only_loss"),  # None and True differ (data.py's check)
        "max_length": value("max_length"), "truncation_mode": value("truncation_mode"),
        "chat_template_format": recipe.model.chat_template_format, "chat_template_path": recipe.trl.get("chat_template_path"),
        "pad_token": recipe.trl.get("pad_token"), "packing": packing, "eval_packing": eval_packing,
        "packing_strategy": value("packing_strategy") if packs else None,
        "shuffle_dataset": shuffle,
        "seed": int(value("seed")) if recipe.data.datasets or shuffle or (held_out and data_seed is None) else None,
        "val_set_size": held_out, "data_seed": data_seed if held_out else None,
    }
    return out


def code_digest() -> str:
    here = Path(__file__).parents[1]  # sftrecipes/
    return _sha(json.dumps([PREP_VERSION] + [[name, _file_digest(here / name)] for name in CODE]))


def library_versions() -> dict[str, str]:
    out = {}
    for name in LIBRARIES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "absent"
    return out


def key_inputs(recipe: Recipe, tokenizer, eot: str | None) -> dict[str, Any]:
    """Every input that shapes the prepared rows, as JSON (the entry's inputs.json)."""
    srcs = []
    for src in sources(recipe):
        entry = asdict(src)
        entry["path"] = str(Path(src.path).expanduser().absolute()) if Path(src.path).expanduser().exists() else src.path
        entry["content"] = content_fingerprint(src.path, src.config)
        srcs.append(entry)
    return {"version": PREP_VERSION, "code": code_digest(), "libraries": library_versions(), "sources": srcs,
            "tokenizer": tokenizer_fingerprint(tokenizer), "end_of_turn": eot, "recipe": recipe_inputs(recipe)}


def entry_key(inputs: dict) -> str:
    return _sha(json.dumps(inputs, sort_keys=True, default=str))[:24]


def _flat(inputs: dict) -> dict[str, Any]:
    """The inputs as labelled values, for saying what changed."""
    out = {"preparation code": inputs.get("code"), "tokenizer": inputs.get("tokenizer"), "end of turn": inputs.get("end_of_turn")}
    out.update({f"{k} version": v for k, v in (inputs.get("libraries") or {}).items()})
    out.update(inputs.get("recipe") or {})
    srcs = inputs.get("sources") or []
    out["sources"] = len(srcs)
    for s in srcs:
        for field, v in s.items():
            if field not in ("key",):
                out[f"{s['key']} {'content' if field == 'content' else field}"] = v
    return out


def describe_changes(old: dict, new: dict, limit: int = 6) -> str:
    a, b = _flat(old), _flat(new)
    digests = {"preparation code", "tokenizer"} | {k for k in b if k.endswith(" content")}
    changed = []
    for k in sorted(set(a) | set(b), key=lambda k: (k not in digests, k)):
        if a.get(k) != b.get(k):
            changed.append(f"{k} changed" if k in digests else f"{k} {a.get(k)!r} -> {b.get(k)!r}")
    more = f" and {len(changed) - limit} more" if len(changed) > limit else ""
    return ", ".join(changed[:limit]) + more

"""A run that starts from a LoRA adapter (an SFT run's output, say, for DPO after SFT), read without torch: which base
the adapter names, where its merged copy goes and whether it is this adapter's, where the tokenizer is read.

model_name_or_path names the adapter folder, and the run trains from the adapter merged into its base, a folder that
export/startfrom.py writes once beside the adapter (the merge `python -m sftrecipes merge` does) and every run from
the same adapter reuses:

    <adapter>/                      adapter_config.json, adapter_model.safetensors, the SFT run's tokenizer
    <adapter>-merged/               the merged model (config, safetensors, tokenizer), then start_merge.json, last

start_merge.json holds the adapter's fingerprint (sha256 of its two files): a retrained adapter is merged again, an
unchanged one reused. Torch-free readers (the planner, pre-flight, the weights check) read the base the adapter names,
which has the merged model's config and tensor layout; facts/folders.py checks the adapter at recipe validation.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from sftrecipes.core.errors import RecipeError
from sftrecipes.core.jsonfile import read_json

RECORD = "start_merge.json"


def adapter_of(name_or_path: str | None) -> Path | None:
    """The adapter folder a model_name_or_path names (adapter_config.json and no config.json), else None."""
    if not name_or_path:
        return None
    p = Path(name_or_path).expanduser()
    return p if (p / "adapter_config.json").is_file() and not (p / "config.json").is_file() else None


def base_of(adapter: Path) -> str:
    """The base model the adapter was trained on (its adapter_config.json's base_model_name_or_path), as written: a
    folder (relative to where the SFT run ran, as peft writes it) or a hub id."""
    base = json.loads((adapter / "adapter_config.json").read_text()).get("base_model_name_or_path")
    if not base:
        raise RecipeError(f"model_name_or_path: the adapter '{adapter}' names no base model (adapter_config.json has no "
                          "base_model_name_or_path); set it there, or merge it yourself (python -m sftrecipes merge "
                          f"{adapter} OUT --base BASE) and set model_name_or_path to OUT")
    return base


def torch_free_source(name_or_path: str) -> str:
    """What the torch-free readers (config, tensor layout, weights check) read for model_name_or_path: the adapter's
    base for an adapter folder (the merged model has its config and tensors), else the name itself."""
    adapter = adapter_of(name_or_path)
    return base_of(adapter) if adapter is not None else name_or_path


def merged_dir(adapter: Path) -> Path:
    return adapter.parent / f"{adapter.name}-merged"


def weights_dir(name_or_path: str) -> str:
    """The folder the run loads its weights from: the merged folder for an adapter (startfrom.ensure built it), else
    the name."""
    adapter = adapter_of(name_or_path)
    return str(merged_dir(adapter)) if adapter is not None else name_or_path


def fingerprint(adapter: Path) -> str:
    h = hashlib.sha256()
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        with open(adapter / name, "rb") as f:
            while chunk := f.read(1 << 24):
                h.update(chunk)
    return h.hexdigest()


def merge_record(dest: Path) -> dict | None:
    """The start_merge.json of a merged folder (what it was merged from); None where there is none: not merged there
    by a run, or not finished."""
    return read_json(dest / RECORD)


def tokenizer_source(name_or_path: str) -> str:
    """Where the tokenizer of model_name_or_path is read: an adapter folder's own (the SFT run saved its tokenizer and
    chat template there, and the merge copies them), else its base's; any other name as it is."""
    adapter = adapter_of(name_or_path)
    if adapter is None or (adapter / "tokenizer_config.json").is_file():
        return name_or_path
    return base_of(adapter)

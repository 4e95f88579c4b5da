"""What a folder given to `merge`, `export` or a recipe's model_name_or_path is, read from its files without torch:
cli.py and launch's pre-flight ask before torch loads (a missing, empty, cut or wrong folder is one line, exit 2, in a
fraction of a second), and the export code and every rank ask the same functions, so they never disagree."""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path

from sftrecipes.core.errors import RecipeError
from sftrecipes.facts import startmodel

# adapter_config.json features the streaming merge does not apply, each refused by name: what it is
UNMERGEABLE = {
    "lora_bias": "lora_bias (a bias in lora_B, which the base layers may not have)",
    "layer_replication": "layer_replication (duplicated decoder layers)",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens: it acts only after its invocation tokens)",
    "use_qalora": "QALoRA (use_qalora)",
    "kasa_config": "KaSA (kasa_config: it truncates the base weights)",
    "use_bdlora": "block-diagonal LoRA (use_bdlora)",
    "arrow_config": "Arrow routing (arrow_config)",
    "monteclora_config": "MonteCLoRA (monteclora_config)",
    "megatron_config": "Megatron tensor-parallel layers (megatron_config)",
}


# init_lora_weights whose adapters do not apply to the base as saved: they rewrote the base weights when created
# (peft can convert them: save_pretrained(path_initial_model_for_weight_conversion=...)), or left lora_B out (mica)
UNMERGEABLE_INIT = {"pissa": "rewrote the base weights", "olora": "rewrote the base weights", "corda": "rewrote the base weights",
                    "loftq": "rewrote the base weights", "lora_ga": "rewrote the base weights",
                    "mica": "left the frozen lora_B out of the adapter file"}


def adapter_config(adapter: Path) -> dict:
    """adapter_config.json of a LoRA adapter folder the streaming merge applies, or RecipeError naming why not."""
    cfg_path, weights = adapter / "adapter_config.json", adapter / "adapter_model.safetensors"
    if not cfg_path.is_file() or not weights.is_file():
        raise RecipeError(f"adapter: '{adapter}' has no adapter_config.json + adapter_model.safetensors; give a LoRA adapter folder")
    cfg = json.loads(cfg_path.read_text())
    if cfg.get("peft_type") != "LORA":
        raise RecipeError(f"adapter: peft_type {cfg.get('peft_type')} cannot be merged; only LoRA adapters merge")
    for key, what in UNMERGEABLE.items():
        if cfg.get(key):
            raise RecipeError(f"adapter: {what} is not supported by the streaming merge; merge with peft's merge_and_unload")
    init = cfg.get("init_lora_weights")
    family = "pissa" if isinstance(init, str) and init.startswith("pissa") else init
    if isinstance(family, str) and family in UNMERGEABLE_INIT:
        raise RecipeError(f"adapter: init_lora_weights '{init}' {UNMERGEABLE_INIT[family]}, so the adapter does not apply to the "
                          "base model; convert it with peft (save_pretrained(path_initial_model_for_weight_conversion=...)) first")
    return cfg


def natural_key(p: Path) -> list:
    """Sort key: global_step10 after global_step9."""
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", p.name)]


def ds_tag_dir(folder: Path) -> Path | None:
    """The global_stepN folder of a DeepSpeed checkpoint (the one `latest` names, else the only one), or None."""
    if re.fullmatch(r"global_step\d+", folder.name) and any(folder.glob("*_optim_states.pt")):
        return folder
    steps = sorted((p for p in folder.glob("global_step*") if p.is_dir()), key=natural_key)
    if (folder / "latest").is_file() and (folder / (folder / "latest").read_text().strip()).is_dir():
        return folder / (folder / "latest").read_text().strip()
    return steps[-1] if steps else None


def export_kind(src: Path) -> str:
    """What `export` makes of src, in its order: "zero" (global_stepN/), "dcp" (pytorch_model_fsdp_0/), "adapter"
    (adapter_config.json), "model" (config.json + safetensors); else RecipeError naming what is there."""
    if not src.is_dir():
        raise RecipeError(f"export: '{src}' is not a folder; give the run's output_dir (or a checkpoint-N in it)")
    if ds_tag_dir(src) is not None:
        return "zero"
    if (src / "pytorch_model_fsdp_0").is_dir():
        return "dcp"
    if (src / "adapter_config.json").is_file():
        return "adapter"
    if (src / "config.json").is_file() and ((src / "model.safetensors").is_file() or (src / "model.safetensors.index.json").is_file()):
        return "model"
    found = sorted(p.name for p in src.iterdir())
    ckpts = [n for n in found if re.fullmatch(r"checkpoint-\d+", n)]
    if ckpts:
        raise RecipeError(f"export: '{src}' has no final save (did the run finish?) but holds {', '.join(sorted(ckpts, key=lambda n: int(n.split('-')[1])))}; export one of them: export {src}/{ckpts[-1]} DEST")
    raise RecipeError(
        f"export: '{src}' is none of: DeepSpeed checkpoint (global_stepN/), FSDP sharded checkpoint (pytorch_model_fsdp_0/), "
        f"LoRA adapter (adapter_config.json), safetensors model (config.json + model*.safetensors); found {', '.join(found[:8]) or 'nothing'}"
    )


def start_from(folder: Path) -> None:
    """A model_name_or_path folder a run can start from: a model (config.json), or a LoRA adapter (the run starts from
    it merged into its base: startmodel.py). A previous run's output that is not one yet (a DeepSpeed or FSDP sharded
    checkpoint, checkpoints only) is refused in one line naming the command that makes it one (`export`)."""
    if (folder / "config.json").is_file() or not folder.is_dir():
        return
    key = "model_name_or_path"
    kind = None
    try:
        kind = export_kind(folder)
    except RecipeError:
        pass
    if kind == "adapter":  # trains from the adapter merged into its base: checked here, merged at start (startfrom.py)
        check_start_adapter(folder)
        return
    if kind in ("zero", "dcp"):
        what = "a DeepSpeed ZeRO checkpoint" if kind == "zero" else "an FSDP sharded checkpoint"
        raise RecipeError(f"{key}: '{folder}' is {what}, not a model; export it to full safetensors first "
                          f"(python -m sftrecipes export {folder} {folder.name}-export) and set {key} to that folder")
    ckpts = [p.name for p in sorted((p for p in folder.glob("checkpoint-*") if p.is_dir()), key=natural_key)]
    if ckpts:
        raise RecipeError(f"{key}: '{folder}' holds no final save but {', '.join(ckpts)}; export one "
                          f"(python -m sftrecipes export {folder / ckpts[-1]} {folder.name}-export) and set {key} to that folder")


def check_start_adapter(adapter: Path) -> None:
    """An adapter a run starts from, at recipe validation: it merges (LoRA, an init the base still applies to), its
    base is named and unquantized where it is a local folder, and the place of the merged folder is free or this
    project's (startmodel.py)."""
    cfg = adapter_config(adapter)
    base = startmodel.base_of(adapter)
    if Path(base).expanduser().is_dir():
        merge_base(cfg, None)
    dest = startmodel.merged_dir(adapter)
    if dest.exists() and startmodel.merge_record(dest) is None:
        raise RecipeError(f"model_name_or_path: the adapter '{adapter}' would be merged into '{dest}', which exists and "
                          f"was not merged there by a run ({startmodel.RECORD} is missing); move it away, or set "
                          "model_name_or_path to it if it is this adapter merged")


def local_model_dir(name_or_path: str) -> Path:
    """A base model as a local folder: the folder itself, or the hub's snapshot of the id; RecipeError where neither."""
    p = Path(name_or_path).expanduser()
    if p.is_dir():
        return p
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(name_or_path, allow_patterns=["*.safetensors", "*.json", "tokenizer*"]))
    except Exception as e:  # noqa: BLE001 - any hub failure is the same advice
        raise RecipeError(f"base: '{name_or_path}' is not a local folder and could not be fetched from the hub ({type(e).__name__}); pass --base LOCAL_DIR") from None


def merge_base(cfg: dict, base: str | None) -> Path:
    """The unquantized base a LoRA adapter merges into (--base, else the adapter's base_model_name_or_path)."""
    base_dir = local_model_dir(base or cfg.get("base_model_name_or_path") or "")
    if (base_dir / "config.json").is_file() and "quantization_config" in json.loads((base_dir / "config.json").read_text()):
        raise RecipeError(f"base: '{base_dir}' is quantized (config.json has quantization_config); merge into the unquantized base model (--base)")
    return base_dir


def _st_header(path: Path) -> tuple[dict, int] | None:
    """(header without __metadata__, offset of the data) of one safetensors file, or None where the header itself
    cannot be read (cut, damaged, not safetensors)."""
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                return None
            (n,) = struct.unpack("<Q", head)
            if n > 100 * 2**20:  # no real header is that large: the file is not safetensors
                return None
            header = json.loads(f.read(n))
        header.pop("__metadata__", None)
        if not all(isinstance(v, dict) and len(v.get("data_offsets", ())) == 2 for v in header.values()):
            return None
    except (OSError, ValueError, AttributeError):
        return None
    return header, 8 + n


def _st_length(header: dict, offset: int) -> int:
    """The length the file must have: its data's offset and the end of its last tensor."""
    return offset + max((v["data_offsets"][1] for v in header.values()), default=0)


def read_st_header(path: Path, verb: str = "export") -> tuple[dict, int]:
    """(header without __metadata__, offset of the data) of one safetensors file; a truncated file is refused (a
    RecipeError starting with `verb`, the command that reads it). torch-free: the planner reads it too."""
    got = _st_header(path)
    if got is None:
        raise RecipeError(f"{verb}: '{path}' is not a readable safetensors file; it is truncated or not safetensors — re-copy it")
    end = _st_length(*got)
    if path.stat().st_size < end:
        raise RecipeError(f"{verb}: '{path}' is truncated ({path.stat().st_size} bytes, its header needs {end}); re-copy it")
    return got


# Files a tokenizer can load from (a fast tokenizer's tokenizer.json, a SentencePiece/tiktoken model, BPE or WordPiece
# vocabularies); a folder with none of them makes transformers suggest installing sentencepiece.
TOKENIZER_SOURCES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model", "*.tiktoken", "sentencepiece*.model")


def check_model_files(model) -> None:
    """A recipe's model section (recipe.model): a local tokenizer folder holds tokenizer files, and the local model
    folder's weights are whole (check_weights). A RecipeError names the folder or file and what is missing, where the
    loaders would say "install sentencepiece" or "incomplete metadata". Asked by launch's pre-flight before any rank
    starts, and by every rank before anything is prepared (train.py run directly)."""
    key = "tokenizer_name_or_path" if model.tokenizer_name_or_path else "model_name_or_path"
    tok = Path(model.tokenizer_name_or_path or startmodel.tokenizer_source(model.model_name_or_path)).expanduser()
    if tok.is_dir() and not any(any(tok.glob(pattern)) for pattern in TOKENIZER_SOURCES):
        raise RecipeError(f"{key}: {tok} has no tokenizer files (none of tokenizer.json, tokenizer.model, vocab.json + "
                          "merges.txt); copy them from the model it came from (checkpoints and some exports lack them), or set "
                          "tokenizer_name_or_path to a folder or hub id that has them")
    check_weights(model.model_name_or_path)


def check_weights(model_name_or_path: str) -> dict[Path, dict]:
    """A local model folder's safetensors files (those its index lists, else every one), each whole: as long as its
    header says; file -> its header (without __metadata__). A RecipeError (model_name_or_path: ...) names a listed file
    that is missing, a header that cannot be read, a file cut short or longer than its header. {} for a hub id."""
    folder = Path(startmodel.torch_free_source(model_name_or_path)).expanduser()  # an adapter: its base's
    if not folder.is_dir():
        return {}
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            files = [folder / n for n in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
        except (ValueError, KeyError, TypeError, AttributeError):
            raise RecipeError(f"model_name_or_path: {index} is unreadable (no weight_map); copy it again from the model") from None
    else:
        files = sorted(folder.glob("*.safetensors"))
    headers = {}
    for f in files:
        if not f.is_file():
            raise RecipeError(f"model_name_or_path: {f.name} is listed in {index.name} but missing from {folder}; copy it there")
        size, got = f.stat().st_size, _st_header(f)
        if got is None:
            raise RecipeError(f"model_name_or_path: {f} is not a readable safetensors file ({size:,} bytes; its header is cut "
                              "or damaged); copy it again")
        want = _st_length(*got)
        if size != want:
            what = "truncated" if size < want else "longer than its header describes"
            raise RecipeError(f"model_name_or_path: {f} is {what}: {size:,} bytes, its header says {want:,}; copy it again "
                              "(a download or copy did not finish)")
        headers[f] = got[0]
    return headers

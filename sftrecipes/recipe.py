"""Recipe = YAML file(s) + CLI flags, validated once, before anything heavy is imported.

    recipe.yaml ──base:──► parent.yaml (merged deeply, child wins) ──► CLI flags win ──► coerce + validate

Only the standard library and PyYAML are imported here, so a bad recipe fails in well under a second with
one line that names the key and the fix (`RecipeError`, exit code 2 in the CLI).
"""

from __future__ import annotations

import difflib
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from .errors import RecipeError
from .paths import RECIPES, ROOT
from .schema import ALIASES, DATASET_ENTRY_KEYS, NESTED, DataOptions, LaunchOptions, ModelOptions, RunOptions, all_options
from .snapshots import Option

RESERVED = ("base",)
# Options whose value may be a local path. A relative path means one relative to the current directory, except in
# the shipped recipes (files under recipes/), which are written to run from the repository root: there it means one
# relative to the root, wherever the command runs (see from_repo_root).
PATH_OPTIONS = ("model_name_or_path", "tokenizer_name_or_path", "dataset_name", "output_dir", "resume_from_checkpoint")
TRUE = {"true", "yes", "1", "on"}
FALSE = {"false", "no", "0", "off"}


@dataclass
class Recipe:
    model: ModelOptions
    data: DataOptions
    launch: LaunchOptions
    run: RunOptions
    trl: dict[str, Any]  # SFTConfig keys the recipe sets explicitly; everything else keeps TRL's default
    peft: dict[str, Any] = field(default_factory=dict)  # LoraConfig keys the recipe sets; the rest keep peft's default
    explicit: set[str] = field(default_factory=set)  # every key the user set (flat names, launch.<x>)
    sources: list[str] = field(default_factory=list)  # recipe files, base first
    renamed: dict[str, str] = field(default_factory=dict)  # alias used -> canonical key

    def trl_value(self, name: str) -> Any:
        """The value SFTConfig will see: the recipe's, or TRL's default."""
        if name in self.trl:
            return self.trl[name]
        return all_options()[name].default

    @property
    def gradient_checkpointing(self) -> bool:
        """transformers 5 spells it activation_checkpointing; gradient_checkpointing is its deprecated alias."""
        if self.trl.get("activation_checkpointing") is not None:
            return bool(self.trl["activation_checkpointing"])
        return bool(self.trl_value("gradient_checkpointing"))

    @property
    def checkpointing_kwargs(self) -> dict[str, Any]:
        """Its kwargs under either spelling (activation_checkpointing_kwargs wins a key both set), with the recipe's
        use_reentrant when checkpointing is on."""
        kw = {**(self.trl.get("gradient_checkpointing_kwargs") or {}), **(self.trl.get("activation_checkpointing_kwargs") or {})}
        if self.gradient_checkpointing:
            kw["use_reentrant"] = self.model.use_reentrant
        return kw

    def as_dict(self) -> dict[str, Any]:
        """Flat view of the explicit settings (used to compare a YAML recipe with a command line)."""
        out: dict[str, Any] = {}
        for key in sorted(self.explicit):
            section, _, name = key.rpartition(".")
            if section:
                out[key] = getattr(getattr(self, section), name)
            elif name in self.trl:
                out[key] = self.trl[name]
            elif name in self.peft:
                out[key] = self.peft[name]
            else:
                owner = all_options()[name].owner
                out[key] = getattr(getattr(self, owner), name)
        return out


# ----------------------------------------------------------------------------------------------- loading


def _read_yaml(path: Path) -> dict:
    if not path.is_file():
        raise RecipeError(f"recipe: file '{path}' not found; pass the path of a recipe YAML (see recipes/)")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        raise RecipeError(f"recipe: '{path}'{where} is not valid YAML ({getattr(e, 'problem', e)}); fix the syntax") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise RecipeError(f"recipe: '{path}' must be a mapping of key: value, got {type(data).__name__}")
    return data


def deep_merge(base: dict, over: dict) -> dict:
    """Child values win; mappings (sections, and dict-valued options such as fsdp_config) merge key by key."""
    out = dict(base)
    for k, v in over.items():
        old = out.get(k)
        if isinstance(v, dict) and isinstance(old, dict):
            out[k] = deep_merge(old, v)
        elif isinstance(v, tuple) and isinstance(old, tuple) and isinstance(v[0], dict) and isinstance(old[0], dict):
            out[k] = (deep_merge(old[0], v[0]), v[1])
        else:
            out[k] = v
    return out


def load_yaml_chain(path: str | os.PathLike, _seen: tuple = ()) -> tuple[dict, list[str]]:
    """A recipe with its `base:` ancestors merged in (bases first, in the order listed; the recipe wins).
    `base:` is one relative path or a list of them. Returns (values, files)."""
    p = Path(path).resolve()
    if p in _seen:
        raise RecipeError(f"base: '{path}' extends itself through {' -> '.join(map(str, _seen))}; remove the cycle")
    data = _read_yaml(Path(path))
    bases = data.pop("base", None)
    bases = [] if bases is None else [bases] if isinstance(bases, str) else bases
    if not isinstance(bases, list) or not all(isinstance(b, str) for b in bases):
        raise RecipeError(f"base: in '{path}' must be a relative path or a list of them, got {bases!r}")
    merged: dict = {}
    files: list[str] = []
    for base in bases:
        base_path = Path(os.path.normpath(Path(path).parent / base))
        if not base_path.is_file():
            raise RecipeError(f"base: '{base}' (from '{path}') not found at '{base_path}'; the path is relative to the recipe")
        parent, parent_files = load_yaml_chain(base_path, _seen + (p,))
        merged = deep_merge(merged, parent)
        files += parent_files
    return deep_merge(merged, _tag(data, str(path))), files + [str(path)]


class _Src(str):
    """A value's origin, kept beside it for error messages."""


def _tag(data: dict, src: str) -> dict:
    """Pair each value with its origin, and file aliases under their canonical key, so that a later layer (a child
    recipe, the command line) overrides a base whichever spelling each uses."""
    out: dict = {}
    for k, v in data.items():
        if isinstance(v, dict) and k in NESTED:
            out[k] = _tag(v, src)
            continue
        canonical = ALIASES.get(k, k)
        if canonical in out or (canonical != k and canonical in data):
            raise RecipeError(f"'{k}' and '{canonical}' are the same option ({src}); keep only {canonical}")
        origin = _Src(src)
        origin.alias = k if canonical != k else None
        out[canonical] = (v, origin)
    return out


def is_shipped(path: str | os.PathLike) -> bool:
    """A recipe file under the repository's recipes/ (whose relative paths are relative to the repository root)."""
    p = Path(path)
    return p.is_file() and p.resolve().is_relative_to(RECIPES)


def from_repo_root(key: str, value: Any) -> Any:
    """A value a shipped recipe gives `key` (one of PATH_OPTIONS), as an absolute path when it is a relative local
    path; other values (absolute paths, hub ids such as org/name, 'auto') unchanged."""
    if not isinstance(value, str) or not value or os.path.isabs(value) or value.startswith("~") or value == "auto":
        return value
    target = ROOT / value
    if key in ("model_name_or_path", "tokenizer_name_or_path", "dataset_name") and not (target.exists() or _looks_local(value)):
        return value  # a hub id: there is no such path in the repository
    return os.path.normpath(target)


# ----------------------------------------------------------------------------------------------- CLI


def parse_argv(argv: list[str]) -> tuple[list[str], dict[str, tuple[Any, str]]]:
    """Split a command line into recipe files and `--key value` pairs (values still strings)."""
    options = all_options()
    files: list[str] = []
    flags: dict[str, tuple[Any, str]] = {}
    i = 0
    while i < len(argv):
        tok = argv[i]
        i += 1
        if not tok.startswith("--"):
            files.append(tok)
            continue
        name, eq, value = tok[2:].partition("=")
        if name == "config":  # TRL-style `--config recipe.yaml`
            if not eq:
                if i >= len(argv):
                    raise RecipeError("--config needs a recipe path")
                value, i = argv[i], i + 1
            files.append(value)
            continue
        key = ALIASES.get(name, name)
        opt = options.get(key)
        if opt is None:
            raise RecipeError(f"unknown flag --{name}; {_suggest(name, list(options) + list(ALIASES))}")
        kind = opt.kind
        if eq:
            raw: Any = value
        elif kind in ("list", "list|str"):
            raw = []
            while i < len(argv) and not argv[i].startswith("--"):
                raw.append(argv[i])
                i += 1
            if kind == "list|str" and len(raw) == 1:
                raw = raw[0]  # one word: a string (peft: a regex); several: a list of names
        elif i < len(argv) and not argv[i].startswith("--") and (kind != "bool" or argv[i].lower() in TRUE | FALSE):
            raw, i = argv[i], i + 1
        elif kind == "bool" or name == "fsdp":
            raw = "true"  # bare `--push_to_hub`
        else:
            raise RecipeError(f"--{name} needs a value; write --{name} VALUE")
        flags[name] = (raw, _Src(f"--{name}"))
    return files, flags


# ----------------------------------------------------------------------------------------------- coercion


def _suggest(name: str, candidates: list[str]) -> str:
    close = difflib.get_close_matches(name, candidates, n=3, cutoff=0.6)
    if close:
        return "did you mean " + " or ".join(close) + "?"
    return "see `python train.py --help` for the valid keys"


def coerce(opt: Option, value: Any, src: str) -> Any:
    """One value of one option to its declared type, or a RecipeError naming the key and the fix."""
    name = opt.name
    where = src if src.startswith("--") else f"{name} (in {src})"
    from_cli = src.startswith("--")
    cli_null = (from_cli and isinstance(value, str) and value.lower() in ("none", "null") and opt.kind != "list"
                and opt.nullable and value not in (opt.choices or ()))
    if value is None or cli_null:
        if opt.nullable:
            return None
        raise RecipeError(f"{where}: may not be empty; give a {opt.kind} value")
    kind = opt.kind

    def bad(expected: str, hint: str = "") -> RecipeError:
        got = f"{value!r} ({type(value).__name__})"
        return RecipeError(f"{where}: expected {expected}, got {got}{hint}")

    if kind == "bool":
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in TRUE | FALSE:
            return value.lower() in TRUE
        raise bad("true or false")
    if kind in ("int", "float"):
        if isinstance(value, bool):
            raise bad("a number", "; YAML reads bare yes/no/on/off as booleans")
        if isinstance(value, str):
            try:
                value = float(value) if kind == "float" or "." in value or "e" in value.lower() else int(value)
            except ValueError:
                raise bad("a number") from None
        if kind == "int":
            if isinstance(value, float) and not value.is_integer():
                raise bad("a whole number")
            value = int(value)
            if opt.choices and value not in opt.choices:
                raise RecipeError(f"{where}: {value} is not one of {', '.join(map(str, opt.choices))}")
            return value
        return float(value)
    if kind in ("str", "int|str"):
        if isinstance(value, bool):
            spellings = ("yes", "on", "true") if value else ("no", "off", "false")
            meant = next((c for c in (opt.choices or ()) if str(c) in spellings), str(value).lower())
            raise bad(
                "a string",
                f"; YAML reads bare yes/no/on/off/true/false as booleans — quote it: {name}: \"{meant}\""
                if not from_cli else "",
            )
        if kind == "int|str" and isinstance(value, int):
            return value
        if kind == "int|str" and isinstance(value, str) and value.strip().lstrip("-").isdigit():
            return int(value)  # a number given on the command line (pad_to_multiple_of 64), not the word 'auto'
        if isinstance(value, (dict, list)):
            raise bad("a string")
        value = str(value)
        if opt.choices and value not in opt.choices:
            raise RecipeError(
                f"{where}: {value!r} is not one of {', '.join(map(str, opt.choices))}; {_suggest(value, list(map(str, opt.choices)))}"
            )
        return value
    if kind == "bool|str":
        if isinstance(value, bool):
            return value
        if opt.choices and True in opt.choices:  # a bool or a word (peft's init_lora_weights): CLI 'true' is the bool
            if isinstance(value, str) and value.lower() in TRUE | FALSE:
                return value.lower() in TRUE
            patterns = [re.escape(str(c)).replace(re.escape("[number of iters]"), r"\d+") for c in opt.choices]
            if not any(re.fullmatch(p, str(value)) for p in patterns):  # 'pissa_niter_[number of iters]' is a pattern
                words = [str(c) for c in opt.choices if not isinstance(c, bool)]
                raise RecipeError(f"{where}: {value!r} is not true, false or one of {', '.join(words)}; {_suggest(str(value), words)}")
        return str(value)
    if kind == "list|str":  # peft reads a string as one regex and a list as names: each stays what it was written as
        if isinstance(value, str):
            return value
        if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
            return list(value)
        raise bad("a string (a regex) or a list of names")
    if kind == "int|list":  # layer indexes: one, or a list
        items = [s.strip() for s in value.split(",") if s.strip()] if isinstance(value, str) else value
        if isinstance(items, list) and len(items) == 1 and isinstance(value, str):
            items = items[0]
        try:
            if isinstance(items, (list, tuple)):
                if any(isinstance(v, (bool, float)) for v in items):
                    raise ValueError
                return [int(v) for v in items]
            if isinstance(items, (bool, float)):
                raise ValueError
            return int(items)
        except (TypeError, ValueError):
            raise bad("a layer index or a list of them, e.g. [0, 1]") from None
    if kind == "list":
        if isinstance(value, str):
            return [v for v in (s.strip() for s in value.split(",")) if v]
        if isinstance(value, (list, tuple)) and all(isinstance(v, (str, int, float)) and not isinstance(v, bool) for v in value):
            return [str(v) for v in value]
        raise bad("a list of strings (or one comma-separated string)")
    if kind == "mappings":  # a list of mappings (`datasets:`); on the command line a JSON list
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise RecipeError(f"{where}: not valid JSON ({e.msg}); write a JSON list of mappings, e.g. '[{{\"path\": \"data/a.jsonl\"}}]'") from None
        if not isinstance(value, list) or not value or not all(isinstance(v, dict) for v in value):
            raise bad("a non-empty list of mappings", " (YAML: one '- path: ...' item per dataset; command line: a JSON list)")
        return [dict(v) for v in value]
    if kind == "dict":
        if isinstance(value, dict):
            return value
        if isinstance(value, str):
            if value.strip().startswith("{"):
                try:
                    return json.loads(value)
                except json.JSONDecodeError as e:
                    raise RecipeError(f"{where}: not valid JSON ({e.msg}); write a mapping or a JSON object") from None
            if not Path(value).is_file():
                raise RecipeError(f"{where}: file '{value}' not found; give a mapping, a JSON object or an existing file")
            return value
        raise bad("a mapping, a JSON object string or a file path")
    raise RecipeError(f"{where}: cannot be set from a recipe (type {kind}); remove it")


# ----------------------------------------------------------------------------------------------- build


def load_recipe(argv: list[str] | None = None, files: list[str] | None = None, overrides: dict | None = None) -> Recipe:
    """Recipe from recipe files and/or a command line. CLI flags override files; later files override earlier."""
    options = all_options()
    argv = list(argv or [])
    cli_files, flags = parse_argv(argv)
    paths = list(files or []) + cli_files
    merged: dict[str, Any] = {}
    sources: list[str] = []
    for p in paths:
        data, chain = load_yaml_chain(p)
        merged = deep_merge(merged, data)
        sources += chain
    for k, v in (overrides or {}).items():
        merged = deep_merge(merged, _tag({k: v}, "overrides"))
    # CLI: `--launch.gpus_per_node 2` lands in the nested section
    for name, (raw, src) in flags.items():
        section, dot, sub = name.partition(".")
        if dot and section in NESTED:
            merged.setdefault(section, {})
            merged[section] = deep_merge(merged[section], {sub: (raw, src)})
        else:
            merged = deep_merge(merged, _tag({name: raw}, src))

    if Path.cwd().resolve() != ROOT:  # the shipped recipes' relative paths, as seen from here
        for key in PATH_OPTIONS:
            if isinstance(merged.get(key), tuple) and is_shipped(merged[key][1]):
                merged[key] = (from_repo_root(key, merged[key][0]), merged[key][1])

    values: dict[str, Any] = {}
    renamed: dict[str, str] = {}
    flat_names = [n for n in options if "." not in n] + list(ALIASES)
    for key, entry in merged.items():
        if key in NESTED:
            if not isinstance(entry, dict):
                raise RecipeError(f"{key}: must be a mapping of its options ({entry[1]}), e.g. {key}: {{gpus_per_node: 2}}")
            for sub, (raw, src) in entry.items():
                full = f"{key}.{sub}"
                if full not in options:
                    subs = [n.split(".", 1)[1] for n in options if n.startswith(key + ".")]
                    raise RecipeError(f"unknown key '{full}' ({src}); {_suggest(sub, subs)}")
                values[full] = coerce(options[full], raw, src)
            continue
        raw, src = entry
        alias = getattr(src, "alias", None)  # the spelling used, when it was an old name (see _tag)
        if key not in options:
            nested_hint = [f"{s}.{key}" for s, cls in NESTED.items() if key in cls.__dataclass_fields__]
            hint = f"it belongs under '{nested_hint[0].split('.')[0]}:' ({nested_hint[0]})" if nested_hint else _suggest(key, flat_names)
            raise RecipeError(f"unknown key '{key}' ({src}); {hint}")
        canonical = key
        if alias:
            renamed[alias] = canonical
        values[canonical] = coerce(options[canonical], raw, src)
        if alias == "warmup_ratio" and not 0.0 <= values[canonical] < 1.0:
            raise RecipeError(f"warmup_ratio: {values[canonical]} is not a ratio in [0, 1) ({src}); for a step count use warmup_steps")

    _adopt_model_init_kwargs(values, renamed)
    return _build(values, sources, renamed)


# model_init_kwargs keys the recipe owns under its own name (from_pretrained would otherwise get two values, and the
# project's would silently win): taken over as the recipe key, or refused when the recipe key says otherwise
MODEL_INIT_OWNED = {"attn_implementation": "attn_implementation", "dtype": "dtype", "torch_dtype": "dtype",
                    "trust_remote_code": "trust_remote_code"}
MODEL_INIT_REFUSED = {
    "quantization_config": "the recipe builds it from use_4bit_quantization / use_8bit_quantization and the bnb_4bit_* keys; set those",
    "device_map": "each rank holds the model on its own device and the launch section spreads the ranks; remove it",
}


def _adopt_model_init_kwargs(values: dict[str, Any], renamed: dict[str, str]) -> None:
    """Nothing set in model_init_kwargs is overwritten without a word: keys the recipe owns become the recipe's key
    (an explicit recipe key that disagrees is an error), keys the project builds itself are refused with the fix."""
    mik = values.get("model_init_kwargs")
    if not isinstance(mik, dict):
        return
    mik = dict(mik)
    for k in list(mik):
        if k in MODEL_INIT_REFUSED:
            raise RecipeError(f"model_init_kwargs.{k}: not taken from model_init_kwargs: {MODEL_INIT_REFUSED[k]}")
        key = MODEL_INIT_OWNED.get(k)
        if key is None:
            continue
        value = coerce(all_options()[key], mik.pop(k), "model_init_kwargs")
        if key in values and values[key] != value:
            raise RecipeError(f"model_init_kwargs.{k} ({value}) and {key} ({values[key]}) disagree; keep one, as the recipe key {key}")
        values[key] = value
        renamed[f"model_init_kwargs.{k}"] = key
    values["model_init_kwargs"] = mik


def _build(values: dict[str, Any], sources: list[str], renamed: dict[str, str]) -> Recipe:
    options = all_options()
    kw: dict[str, dict[str, Any]] = {"model": {}, "data": {}, "run": {}, "launch": {}}
    trl: dict[str, Any] = {}
    peft: dict[str, Any] = {}
    for name, v in values.items():
        owner = options[name].owner
        if owner == "trl":
            trl[name] = v
        elif owner == "peft":
            peft[name] = v
        else:
            kw[owner][name.split(".", 1)[-1]] = v
    recipe = Recipe(
        model=ModelOptions(**kw["model"]),
        data=DataOptions(**kw["data"]),
        launch=LaunchOptions(**kw["launch"]),
        run=RunOptions(**kw["run"]),
        trl=trl,
        peft=peft,
        explicit=set(values),
        sources=sources,
        renamed=renamed,
    )
    validate(recipe)
    return recipe


# ----------------------------------------------------------------------------------------------- validation


def _looks_local(s: str) -> bool:
    """Clearly a filesystem path (a hub id is `name` or `org/name`)."""
    return s.startswith((".", "/", "~")) or s.count("/") > 1 or s.endswith((".json", ".jsonl", ".parquet", ".csv"))


def validate(r: Recipe) -> None:
    """Cross-key checks. Each failure is one line naming the key(s) and the fix."""
    m, d, L, ex = r.model, r.data, r.launch, r.explicit

    if not m.model_name_or_path:
        raise RecipeError("model_name_or_path: required; set a hub id (meta-llama/Llama-2-7b-hf) or a local model folder")
    for key, val in (("model_name_or_path", m.model_name_or_path), ("tokenizer_name_or_path", m.tokenizer_name_or_path),
                     ("dataset_name", d.dataset_name)):
        if val and _looks_local(val) and not Path(val).expanduser().exists():
            raise RecipeError(f"{key}: local path '{val}' does not exist; fix the path (or build tiny assets: make assets)")
    if d.dataset_name and d.datasets:
        raise RecipeError("dataset_name and datasets are both set; keep one: put dataset_name into datasets as one more entry (- path: ...), or set dataset_name: null where a base recipe sets it")
    if not d.dataset_name and not d.datasets:
        raise RecipeError("dataset_name: required; set a hub dataset id, a local folder or a json/jsonl/parquet file (or datasets: a list for a mixture)")
    if d.datasets:
        _validate_datasets(d.datasets)

    # quantization
    if m.use_4bit_quantization and m.use_8bit_quantization:
        raise RecipeError("use_4bit_quantization and use_8bit_quantization are both true; keep one of them")
    quant = m.use_4bit_quantization or m.use_8bit_quantization
    four_bit_keys = ["use_nested_quant", "bnb_4bit_compute_dtype", "bnb_4bit_quant_type", "bnb_4bit_quant_storage_dtype"]
    stray = [k for k in four_bit_keys if k in ex and not m.use_4bit_quantization]
    if stray and not (stray == ["use_nested_quant"] and not m.use_nested_quant):
        raise RecipeError(f"{stray[0]}: only applies to 4-bit loading; set use_4bit_quantization: true or remove {stray[0]}")
    if quant and not m.use_peft_lora:
        raise RecipeError("use_4bit_quantization/use_8bit_quantization: quantized weights cannot be trained directly; set use_peft_lora: true (QLoRA)")
    if m.use_4bit_quantization and m.bnb_4bit_quant_storage_dtype != "uint8" and m.dtype not in ("auto", m.bnb_4bit_quant_storage_dtype):
        raise RecipeError(
            f"dtype: {m.dtype} differs from bnb_4bit_quant_storage_dtype {m.bnb_4bit_quant_storage_dtype}; "
            f"FSDP/ZeRO-3 need one dtype for all weights — set dtype: {m.bnb_4bit_quant_storage_dtype} (or auto)"
        )

    # LoRA keys without LoRA would be silently ignored
    lora_keys = ["lora_r", "lora_alpha", "lora_dropout", "lora_target_modules", "lora_target_router", *r.peft]
    stray = [k for k in lora_keys if k in ex and not m.use_peft_lora]
    if stray and not (stray == ["lora_target_router"] and not m.lora_target_router):
        raise RecipeError(f"{stray[0]}: only applies to LoRA; set use_peft_lora: true or remove {stray[0]}")
    if m.use_peft_lora:
        if m.lora_r < 1:
            raise RecipeError(f"lora_r: must be >= 1, got {m.lora_r}")
        if not 0.0 <= m.lora_dropout < 1.0:
            raise RecipeError(f"lora_dropout: must be in [0, 1), got {m.lora_dropout}")
        if not m.lora_target_modules.strip(", "):
            raise RecipeError("lora_target_modules: empty; use 'all-linear' or a comma-separated list like q_proj,v_proj")
        _validate_lora(r)

    if m.use_flash_attn and m.attn_implementation not in ("auto", "flash_attention_2"):
        raise RecipeError(f"use_flash_attn: true asks for flash_attention_2 but attn_implementation is {m.attn_implementation}; keep one of them")

    # precision
    bf16, fp16 = r.trl_value("bf16"), r.trl_value("fp16")
    if bf16 and fp16:
        raise RecipeError("bf16 and fp16 are both true; keep one mixed-precision mode")

    if m.precision == "memory_constrained":
        if not (bf16 or fp16):
            raise RecipeError("precision: memory_constrained keeps weights in the bf16/fp16 load dtype; set bf16: true (or fp16: true)")
        if r.launch.backend == "deepspeed":
            raise RecipeError("precision: memory_constrained does not apply to DeepSpeed, which always keeps fp32 optimizer partitions; use fp32_trainable")
        if m.dtype not in ("auto", "bfloat16" if bf16 else "float16"):
            raise RecipeError(f"dtype: {m.dtype} contradicts precision: memory_constrained (everything in the {'bf16' if bf16 else 'fp16'} load dtype); set dtype: auto")

    # gradient checkpointing: two spellings upstream, one meaning
    gc_old, gc_new = r.trl.get("gradient_checkpointing"), r.trl.get("activation_checkpointing")
    if gc_old is not None and gc_new is not None and gc_old != gc_new:
        raise RecipeError(f"gradient_checkpointing ({gc_old}) and activation_checkpointing ({gc_new}) disagree; they are one option, keep activation_checkpointing")
    if "use_reentrant" in ex and not r.gradient_checkpointing:
        raise RecipeError("use_reentrant: only applies with gradient checkpointing; set gradient_checkpointing: true or remove use_reentrant")
    for kw_key in ("gradient_checkpointing_kwargs", "activation_checkpointing_kwargs"):
        kwv = r.trl.get(kw_key)
        if "use_reentrant" in ex and isinstance(kwv, dict) and "use_reentrant" in kwv and kwv["use_reentrant"] != m.use_reentrant:
            raise RecipeError(f"use_reentrant ({m.use_reentrant}) and {kw_key}.use_reentrant ({kwv['use_reentrant']}) disagree; keep one")

    # data
    splits = [s.strip() for s in d.splits.split(",") if s.strip()]
    if not splits or not any("train" in s for s in splits):
        raise RecipeError(f"splits: '{d.splits}' names no training split; include one with 'train' in its name, e.g. train,test")
    from .data import check_eval_split  # noqa: PLC0415 - data imports this module

    check_eval_split(r)
    if r.trl_value("packing") and r.trl_value("max_length") is None:
        raise RecipeError("packing: true needs max_length (alias max_seq_len) to set the packed length; set max_length: 2048")
    if r.trl_value("max_length") is not None and r.trl_value("max_length") < 8:
        raise RecipeError(f"max_length: {r.trl_value('max_length')} is too short to hold a formatted sample; use at least 8")
    if m.chat_template_format == "none" and r.trl.get("assistant_only_loss"):
        raise RecipeError("assistant_only_loss: needs conversations; set chat_template_format (chatml/zephyr/tokenizer) or remove assistant_only_loss")
    formats = {e.get("format", d.dataset_format) for e in d.datasets} if d.datasets else {d.dataset_format}
    conversational = formats & {"messages", "conversations"}
    if m.chat_template_format == "none" and conversational:
        raise RecipeError(f"chat_template_format: none, but dataset_format {sorted(conversational)[0]} is conversational; set chat_template_format: tokenizer (the model's own template), chatml or zephyr")
    if r.trl.get("completion_only_loss") is not None and not formats & {"auto", "prompt_completion"}:
        raise RecipeError(f"completion_only_loss: applies to prompt/completion data, but dataset_format is {', '.join(sorted(formats))}; remove it (for conversations, assistant_only_loss: true trains on the assistant turns only)")
    if r.trl.get("assistant_only_loss") and formats == {"text"}:
        raise RecipeError("assistant_only_loss: text data has no assistant turns; remove it, or use conversational data (dataset_format: messages)")
    if r.trl.get("dataset_kwargs") and isinstance(r.trl["dataset_kwargs"], dict) and r.trl["dataset_kwargs"].get("skip_prepare_dataset"):
        raise RecipeError("dataset_kwargs.skip_prepare_dataset: would skip truncation and packing of the tokenized data; remove it")

    # resume
    resume = r.trl.get("resume_from_checkpoint")
    if resume not in (None, "auto") and not Path(resume).is_dir():
        raise RecipeError(f"resume_from_checkpoint: '{resume}' is not a folder; give a checkpoint folder or 'auto' (latest complete one in output_dir)")
    if not r.trl.get("output_dir"):
        raise RecipeError("output_dir: required; set the folder for checkpoints and the final model, e.g. output_dir: outputs/my-run")

    # integers that must be positive
    for key in ("per_device_train_batch_size", "gradient_accumulation_steps"):
        if r.trl_value(key) < 1:
            raise RecipeError(f"{key}: must be >= 1, got {r.trl_value(key)}")
    for key in ("sample_max_new_tokens", "nan_patience", "heartbeat_timeout"):
        if getattr(r.run, key) < 0:
            raise RecipeError(f"{key}: must be >= 0, got {getattr(r.run, key)}")
    if r.run.preempt_timeout < 1:
        raise RecipeError(f"preempt_timeout: must be >= 1 (seconds a preempted run may take to save), got {r.run.preempt_timeout}")
    template_path = r.trl.get("chat_template_path")
    if template_path:  # the project tokenizes the data itself: the template must be the one it tokenizes with
        if not str(template_path).endswith((".jinja", ".j2")):
            raise RecipeError(f"chat_template_path: '{template_path}' is not a .jinja/.j2 template file (copying a template "
                              "from another tokenizer also adds its tokens: set tokenizer_name_or_path to it instead)")
        if not Path(template_path).is_file():
            raise RecipeError(f"chat_template_path: file '{template_path}' does not exist; fix the path")
        if r.model.chat_template_format != "tokenizer":
            raise RecipeError(f"chat_template_path: the data is formatted with chat_template_format "
                              f"'{r.model.chat_template_format}'; set chat_template_format: tokenizer to use the file's template")
    if r.trl.get("enable_jit_checkpoint"):
        raise RecipeError("enable_jit_checkpoint: the run handles SIGTERM/SIGUSR1 itself (every rank stops after the same "
                          "step and saves a complete checkpoint; docs/reliability.md); remove the key")
    for key in ("num_machines", "gpus_per_node", "cpu_threads"):
        if getattr(L, key) < 1:
            raise RecipeError(f"launch.{key}: must be >= 1, got {getattr(L, key)}")
    for key in ("gpu_memory_gb", "cpu_ram_gb"):
        if getattr(L, key) is not None and getattr(L, key) <= 0:
            raise RecipeError(f"launch.{key}: must be > 0 GB, got {getattr(L, key)}")
    _validate_launch(r)


def _validate_datasets(entries: list[dict]) -> None:
    """Each `datasets:` entry on its own (torch-free); data.py reads the sources."""
    formats = all_options()["dataset_format"].choices
    for i, e in enumerate(entries):
        at = f"datasets[{i}]"
        for k in e:
            if k not in DATASET_ENTRY_KEYS:
                close = difflib.get_close_matches(str(k), list(DATASET_ENTRY_KEYS), n=1, cutoff=0.6)
                hint = f"did you mean {close[0]}? " if close else ""
                raise RecipeError(f"{at}.{k}: unknown key; {hint}an entry takes {', '.join(DATASET_ENTRY_KEYS)}")
        path = e.get("path")
        if not isinstance(path, str) or not path.strip():
            raise RecipeError(f"{at}.path: required; give the dataset's hub id, local folder or json/jsonl/parquet/csv file")
        if _looks_local(path) and not Path(path).expanduser().exists():
            raise RecipeError(f"{at}.path: local path '{path}' does not exist; fix the path")
        for k in ("name", "split", "eval_split"):
            v = e.get(k)
            if k in e and not (isinstance(v, str) and v.strip()) and not (k == "eval_split" and v is None):
                hint = "; YAML reads bare yes/no/on/off as booleans — quote it" if isinstance(v, bool) else ""
                null = " (or null: no eval rows from this entry)" if k == "eval_split" else ""
                raise RecipeError(f"{at}.{k}: expected a split/config name, got {v!r}{hint}; write a string{null}")
        if "weight" in e and "samples" in e:
            raise RecipeError(f"{at}.weight and {at}.samples are both set; keep one (weight: a fraction of its rows, samples: a row count)")
        w = e.get("weight")
        if "weight" in e and (isinstance(w, bool) or not isinstance(w, (int, float)) or not w > 0):
            raise RecipeError(f"{at}.weight: must be a number > 0 (the fraction of its rows drawn: 0.5 half, 2 twice), got {w!r}; to leave the dataset out, remove the entry")
        n = e.get("samples")
        if "samples" in e and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise RecipeError(f"{at}.samples: must be a whole number >= 1 (rows drawn), got {n!r}")
        cols = e.get("columns")
        if "columns" in e:
            if not isinstance(cols, dict) or not all(isinstance(a, str) and isinstance(b, str) for a, b in cols.items()):
                raise RecipeError(f"{at}.columns: expected a mapping {{column in the data: column the format needs}}, e.g. {{question: prompt, answer: completion}}, got {cols!r}")
            if len(set(cols.values())) != len(cols):
                raise RecipeError(f"{at}.columns: two columns renamed to the same name ({cols}); map each target once")
        if "format" in e and e["format"] not in formats:
            raise RecipeError(f"{at}.format: {e['format']!r} is not a format; use one of {', '.join(formats)} (ShareGPT from/value data is conversations)")


def moe_experts(model_name_or_path: str) -> int | None:
    """Routed experts per layer of the model (shape.py, from its config.json: a local folder's or the copy shipped in
    model_configs/ for a hub id): 0 for a dense model, None when no config is at hand offline or its architecture is
    unknown there. Torch-free, for validation."""
    from .shape import config_path, model_shape  # noqa: PLC0415 - shape imports this module

    if not config_path(model_name_or_path).is_file():
        return None
    try:
        return model_shape(model_name_or_path).experts
    except RecipeError:
        return None


# Names a target list may use for the fused expert tensors of transformers 5 MoE models: the tensors' own names and
# the per-projection names they were fused from (Llama/Qwen spelling, Mixtral's w1/w2/w3). model.lora_config maps
# them onto the model's real parameters; here they only tell, before loading, that parameters will be adapted.
EXPERT_TARGET_NAMES = ("gate_up_proj", "down_proj", "gate_proj", "up_proj", "w1", "w2", "w3")
ROUTER_NAMES = ("gate", "router")
# init_lora_weights values that cannot give an adapter the streaming merge (or any later run) can use, and why.
INIT_REFUSED = {
    "pissa": "rewrites the base weights when the adapter is created (W - BA), so the adapter fits only that modified base, not the base model export/merge read",
    "olora": "rewrites the base weights when the adapter is created (W - QR), so the adapter fits only that modified base, not the base model export/merge read",
    "corda": "needs calibration data (peft's preprocess_corda) and rewrites the base weights",
    "loftq": "needs loftq_config and rewrites the (quantized) base weights",
    "eva": "needs a pass over the data before training (peft's initialize_lora_eva_weights), which the trainer does not run",
    "mica": "leaves the frozen lora_B out of the adapter file (peft recomputes it from an SVD of the base weight), which the streaming merge does not reproduce",
}


def parameter_targets(r: Recipe) -> str | None:
    """What the recipe adapts as parameters rather than modules (peft's ParamWrapper: no dropout, no DoRA), in
    words, or None. From the keys and the model's config.json, before anything is loaded."""
    m = r.model
    if r.peft.get("target_parameters"):
        return f"target_parameters ({', '.join(r.peft['target_parameters'])})"
    experts = moe_experts(m.model_name_or_path)
    if not experts:
        return None
    targets = m.lora_target_modules.strip()
    if targets == "all-linear":
        return "the expert parameters that all-linear adapts on this mixture-of-experts model"
    listed = [t.strip() for t in targets.split(",") if t.strip().rsplit(".", 1)[-1] in EXPERT_TARGET_NAMES]
    if listed:
        return f"the expert parameters of this mixture-of-experts model ({', '.join(listed)})"
    if m.lora_target_router:
        return "the router (lora_target_router)"
    return None


def _validate_lora(r: Recipe) -> None:
    """peft's LoraConfig keys and the MoE rules: what peft would refuse deep inside training, or what the streaming
    merge could not export, is refused here, before any model is loaded."""
    m, p = r.model, r.peft
    init = p.get("init_lora_weights", True)
    if isinstance(init, str):
        family = "pissa" if init.startswith("pissa") else init
        if family in INIT_REFUSED:
            raise RecipeError(f"init_lora_weights: '{init}' is not supported: it {INIT_REFUSED[family]}; use true, gaussian or orthogonal")
    for key in ("rank_pattern", "alpha_pattern"):
        pattern = p.get(key)
        if pattern is None:
            continue
        if not isinstance(pattern, dict):
            raise RecipeError(f"{key}: must be a mapping of module-name regex to a number, e.g. {key}: {{q_proj: 16}}; got {pattern!r}")
        for k, v in pattern.items():
            try:
                re.compile(str(k))
            except re.error as e:
                raise RecipeError(f"{key}: '{k}' is not a valid regex ({e}); peft matches each key as a regex against module names") from None
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise RecipeError(f"{key}: '{k}': {v!r} must be a whole number >= 1")
    if p.get("layers_pattern") and p.get("layers_to_transform") is None:
        raise RecipeError("layers_pattern: only applies with layers_to_transform; set layers_to_transform (e.g. [0, 1]) or remove layers_pattern")
    layers = p.get("layers_to_transform")
    if layers is not None and any(i < 0 for i in (layers if isinstance(layers, list) else [layers])):
        raise RecipeError(f"layers_to_transform: layer indexes start at 0, got {layers}")
    if init == "orthogonal":
        odd = [v for v in [m.lora_r, *(p.get("rank_pattern") or {}).values()] if v % 2]
        if odd:
            raise RecipeError(f"init_lora_weights: orthogonal needs even ranks, got {odd[0]}; make lora_r (and rank_pattern values) even")
    listed = [] if m.lora_target_modules.strip() == "all-linear" else [t.strip() for t in m.lora_target_modules.split(",")]
    for name in p.get("target_parameters") or []:
        module = name.rpartition(".")[0]
        if module and any(module == t or module.endswith("." + t) for t in listed if t):
            raise RecipeError(f"target_parameters: '{name}' belongs to a module lora_target_modules already adapts; adapt it one way: remove it from one of the two")

    what = parameter_targets(r)
    experts = moe_experts(m.model_name_or_path)
    if m.lora_target_router and experts == 0:
        raise RecipeError(f"lora_target_router: {m.model_name_or_path} is not a mixture-of-experts model (it has no router); remove lora_target_router")
    if experts:
        named_router = [t for t in listed if t in ROUTER_NAMES]
        if named_router:
            raise RecipeError(f"lora_target_modules: '{named_router[0]}' is the router of this mixture-of-experts model; remove it from the list and set lora_target_router: true")
    if what is None:
        return
    if m.lora_dropout:
        raise RecipeError(f"lora_dropout: {m.lora_dropout} cannot apply to {what}: peft adapts parameters without dropout; set lora_dropout: 0.0")
    if p.get("use_dora"):
        raise RecipeError(f"use_dora: DoRA cannot adapt {what} (peft's parameter wrapper has no DoRA); set use_dora: false, or adapt only linear modules")
    if init == "orthogonal":
        raise RecipeError(f"init_lora_weights: orthogonal cannot initialise {what} (it reads a module weight those parameters lack); use true or gaussian")


DEEPSPEED_KEYS = ("zero_stage", "offload_optimizer", "offload_params", "zero3_init")
FSDP_KEYS = ("fsdp_version", "fsdp_sharding_strategy", "fsdp_state_dict_type", "fsdp_cpu_ram_efficient_loading",
             "fsdp_sync_module_states", "fsdp_offload_params")


def _validate_launch(r: Recipe) -> None:
    L, ex, m = r.launch, r.explicit, r.model
    if L.backend != "none":  # the launch section renders the accelerate config; transformers' own switches would fight it
        for key in ("fsdp", "fsdp_config", "deepspeed"):
            if r.trl.get(key):
                raise RecipeError(f"{key}: set with launch.backend {L.backend}, whose accelerate config decides the distribution; use the launch: keys (e.g. gradient_checkpointing: true instead of fsdp_config.activation_checkpointing) and remove {key}")
    # these two land in #SBATCH directive lines, which no shell quoting protects: only plain values pass
    if L.slurm_partition is not None and not re.fullmatch(r"[A-Za-z0-9_.,-]+", L.slurm_partition):
        raise RecipeError(f"launch.slurm_partition: {L.slurm_partition!r} is not a partition name (letters, digits, _ . , -)")
    if not re.fullmatch(r"(\d+-)?\d{1,3}(:\d{2}){0,2}", L.slurm_time):
        raise RecipeError(f"launch.slurm_time: {L.slurm_time!r} is not a SLURM time; write HH:MM:SS or D-HH:MM:SS")
    world = L.world_size
    if L.backend == "none" and world > 1:
        raise RecipeError(f"launch.backend: none runs one process, but num_machines x gpus_per_node = {world}; set backend: ddp, deepspeed or fsdp")
    for backend, keys in (("deepspeed", DEEPSPEED_KEYS), ("fsdp", FSDP_KEYS)):
        stray = [k for k in keys if f"launch.{k}" in ex and L.backend != backend]
        if stray:
            raise RecipeError(f"launch.{stray[0]}: only applies to backend {backend}, but backend is {L.backend}; set launch.backend: {backend} or remove it")
    if L.backend == "deepspeed" and L.zero_stage != 3:
        for key in ("offload_optimizer", "offload_params"):
            if getattr(L, key):
                raise RecipeError(f"launch.{key}: offload needs ZeRO-3 here, but zero_stage is {L.zero_stage}; set launch.zero_stage: 3")
        if "launch.zero3_init" in ex and L.zero3_init:
            raise RecipeError(f"launch.zero3_init: only applies to zero_stage 3 (got {L.zero_stage}); remove it")
    if L.backend == "fsdp":
        if L.fsdp_version == 2 and L.fsdp_sharding_strategy not in ("FULL_SHARD", "SHARD_GRAD_OP"):
            raise RecipeError(f"launch.fsdp_sharding_strategy: {L.fsdp_sharding_strategy} needs fsdp_version: 1 (FSDP2 has FULL_SHARD and SHARD_GRAD_OP)")
        if L.hardware == "cpu" and L.fsdp_offload_params:
            raise RecipeError("launch.fsdp_offload_params: offloading to CPU needs a GPU to offload from (it pins memory); set it false on the cpu target")
        if L.hardware == "cpu" and L.fsdp_version == 1:
            # torch 2.13's FSDP1 cannot unshard on a CPU compute device (segfault / "setStorage ... size 0") and its
            # plugin refuses sync_module_states without a GPU: keep to what works on CPU
            if L.fsdp_sync_module_states or L.fsdp_cpu_ram_efficient_loading:
                raise RecipeError("launch.fsdp_sync_module_states: FSDP1 cannot broadcast module states on the cpu target; set fsdp_sync_module_states and fsdp_cpu_ram_efficient_loading to false (or use fsdp_version: 2)")
            if L.fsdp_state_dict_type == "FULL_STATE_DICT" or m.use_peft_lora:
                raise RecipeError("launch.fsdp_version: FSDP1 cannot gather a full state dict on the cpu target (needed for FULL_STATE_DICT and LoRA adapters); use fsdp_version: 2")
        if L.fsdp_cpu_ram_efficient_loading and not L.fsdp_sync_module_states:
            raise RecipeError("launch.fsdp_cpu_ram_efficient_loading: needs fsdp_sync_module_states: true (ranks other than 0 start empty); set it or turn loading off")
    if L.backend in ("fsdp", "deepspeed") and m.use_4bit_quantization and m.bnb_4bit_quant_storage_dtype == "uint8":
        raise RecipeError(
            f"bnb_4bit_quant_storage_dtype: uint8 4-bit weights cannot be sharded with the float weights by {L.backend}; "
            "set bnb_4bit_quant_storage_dtype: bfloat16 (and bf16: true)"
        )
    if L.backend in ("fsdp", "deepspeed") and m.use_8bit_quantization:
        raise RecipeError(f"use_8bit_quantization: 8-bit weights cannot be sharded by {L.backend}; use 4-bit QLoRA with bnb_4bit_quant_storage_dtype: bfloat16")


GROUP_TITLES = {"model": "Model, LoRA, quantization", "peft": "peft `LoraConfig` (LoRA only: with use_peft_lora; defaults as peft sets them)",
                "data": "Data", "run": "Run", "launch": "Launch (`launch:` section)",
                "trl": "TRL `SFTConfig` / transformers `TrainingArguments` (defaults as TRL sets them)"}


def grouped_options() -> list[tuple[str, list[Option]]]:
    """(title, options) per owner, in the order --help and docs/options.md show them."""
    groups: dict[str, list[Option]] = {}
    for o in all_options().values():
        groups.setdefault(o.owner, []).append(o)
    return [(GROUP_TITLES[owner], groups.get(owner, [])) for owner in GROUP_TITLES]


def help_text() -> str:
    lines = ["usage: python train.py RECIPE.yaml [--key value ...]", "",
             "Every key below is a YAML key and a --flag. Launch keys go under `launch:` (flag --launch.KEY).", ""]
    for title, options in grouped_options():
        lines += [f"{title.replace('`', '')}:"] + [f"  --{o.name}  {o.describe()}" for o in options] + [""]
    lines.append("Aliases: " + ", ".join(f"{a} -> {c}" for a, c in ALIASES.items()))
    return "\n".join(lines)


def options_markdown() -> str:
    """docs/options.md: the option table, generated from the schema (tests fail when the file is stale)."""
    out = ["# Recipe options", "",
           "Generated from `sftrecipes/schema.py` and TRL's `SFTConfig` by `make docs`; do not edit by hand.",
           "Every key is a YAML key and a `--flag`; launch keys live under `launch:` (flag `--launch.KEY`).", ""]
    for title, options in grouped_options():
        out += [f"## {title}", "", "| key | type | default | help |", "|---|---|---|---|"]
        for o in options:
            choices = f" One of: {', '.join(f'`{c}`' for c in o.choices)}." if o.choices else ""
            help_ = (o.help + choices).replace("|", "\\|")
            kind = o.kind.replace("|", "\\|")
            out.append(f"| `{o.name}` | {kind} | `{o.default!r}` | {help_} |")
        out.append("")
    out += ["## Aliases", "", "Accepted and mapped (the run logs the mapping):", ""]
    out += [f"- `{a}` → `{c}`" for a, c in ALIASES.items()]
    return "\n".join(out) + "\n"

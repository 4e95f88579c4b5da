"""Recipe: the typed recipe, built from YAML file(s) and CLI flags (load_recipe), validated once before anything heavy loads.

    recipe.yaml ──base:──► parent.yaml (merged deeply, child wins) ──► CLI flags win ──► coerce + validate

`key: null` (`--key null`) unsets a key: it takes its default, whatever a base set (unsets; schema.NULL_IS_A_VALUE
names the keys where null is a value). Coercion of each value lives in coerce.py, the cross-key rules in validation.py. Only the standard library and PyYAML
are imported on this path, so a bad recipe fails in well under a second with one line that names the key and the fix
(`RecipeError`, exit code 2 in the CLI).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml

from sftrecipes.core.errors import RecipeError
from sftrecipes.core.paths import RECIPES, ROOT
from sftrecipes.recipe.coerce import FALSE, TRUE, coerce, is_null, suggest
from sftrecipes.recipe.schema import (
    ALIASES,
    CONFIGS,
    METHODS,
    NESTED,
    NULL_IS_A_VALUE,
    DataOptions,
    LaunchOptions,
    ModelOptions,
    RunOptions,
    all_options,
)
from sftrecipes.recipe.rewards import files_from
from sftrecipes.recipe.snapshots import Option
from sftrecipes.recipe.typed import Recipe
from sftrecipes.recipe.validation import _word, adopt_model_init_kwargs, looks_local, validate

# Options whose value may be a local path. A relative path means one relative to the current directory, except in
# the shipped recipes (files under recipes/), which are written to run from the repository root: there it means one
# relative to the root, wherever the command runs (see from_repo_root).
PATH_OPTIONS = ("model_name_or_path", "tokenizer_name_or_path", "dataset_name", "output_dir", "resume_from_checkpoint")


# ----------------------------------------------------------------------------------------------- loading


class DuplicateKey(yaml.YAMLError):
    """A mapping of a recipe file names one key twice (UniqueKeyLoader)."""

    def __init__(self, where: str, key, lines: tuple[int, int]):
        super().__init__(f"{where}{key}")
        self.where, self.key, self.lines = where, key, lines


class UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a mapping that names a key twice (PyYAML keeps the last silently), at any depth:
    the top level, `launch:`, a `datasets:` entry, a dict-valued option. Keys a merge (`<<: *anchor`) brings in may be
    overridden, as YAML says; only keys written in the mapping itself count."""

    def construct_document(self, node):
        self._unique_keys(node, "", set())
        return super().construct_document(node)

    def _unique_keys(self, node, where: str, seen_nodes: set) -> None:
        if id(node) in seen_nodes:  # an alias to a node already walked
            return
        seen_nodes.add(id(node))
        if isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                self._unique_keys(item, f"{where.rstrip('.')}[{i}].", seen_nodes)
        if not isinstance(node, yaml.MappingNode):
            return
        first: dict = {}
        for key_node, value_node in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True) if isinstance(key_node, yaml.ScalarNode) else key_node.start_mark
            try:
                hash(key)
            except TypeError:
                key = repr(key)
            line = key_node.start_mark.line + 1
            if key in first:
                raise DuplicateKey(where, key, (first[key], line))
            first[key] = line
            self._unique_keys(value_node, f"{where}{key}.", seen_nodes)


def _read_yaml(path: Path) -> dict:
    if not path.is_file():
        raise RecipeError(f"recipe: file '{path}' not found; pass the path of a recipe YAML (see recipes/)")
    try:
        data = yaml.load(path.read_text(), Loader=UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass
    except DuplicateKey as e:
        raise RecipeError(f"{e.where}{e.key}: set twice in '{path}' (lines {e.lines[0]} and {e.lines[1]}; YAML would keep "
                          f"the last silently); keep one") from None
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
    if key in ("model_name_or_path", "tokenizer_name_or_path", "dataset_name") and not (target.exists() or looks_local(value)):
        return value  # a hub id: there is no such path in the repository
    return os.path.normpath(target)


# ----------------------------------------------------------------------------------------------- CLI

LIST_KINDS = ("list", "list|str", "list[float]")  # flags of these kinds take every word up to the next --flag
NULL_WORDS = {"null", "none"}  # a bool flag takes them as its value (`--use_nested_quant null`), not as a file



def _any_kinds() -> dict[str, Option]:
    """Every key, taking a list where the config class of any method does."""
    table = dict(all_options())
    for method in METHODS:
        for name, o in all_options(method).items():
            if o.kind in LIST_KINDS and table[name].kind != o.kind:
                table[name] = o
    return table


def parse_argv(argv: list[str], method: str = "sft") -> tuple[list[str], dict[str, tuple[Any, str]]]:
    """Split a command line into recipe files and `--key value` pairs (values still strings); a flag takes as many
    words as its kind under `method` (DPOConfig's loss_type is a list); "any": a list where any method takes one."""
    options = all_options(method) if method != "any" else _any_kinds()
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
            raise RecipeError(f"unknown flag --{name}; {suggest(name, list(options) + list(ALIASES))}")
        kind = opt.kind
        if eq:
            raw: Any = value
        elif kind in LIST_KINDS:
            raw = []
            while i < len(argv) and not argv[i].startswith("--"):
                raw.append(argv[i])
                i += 1
            if kind == "list|str" and len(raw) == 1:
                raw = raw[0]  # one word: a string (peft: a regex); several: a list of names
        elif i < len(argv) and not argv[i].startswith("--") and (kind != "bool" or argv[i].lower() in TRUE | FALSE | NULL_WORDS):
            raw, i = argv[i], i + 1
        elif kind == "bool" or name == "fsdp":
            raw = "true"  # bare `--push_to_hub`
        else:
            raise RecipeError(f"--{name} needs a value; write --{name} VALUE")
        flags[name] = (raw, _Src(f"--{name}"))
    return files, flags


# ----------------------------------------------------------------------------------------------- build


def unsets(opt: Option, raw: Any, src: str) -> bool:
    """`key: null` (or `--key null`) unsets the key: whatever a base recipe (or an earlier file) set, it takes its
    default, as if never set. On the keys of schema.NULL_IS_A_VALUE null is a value of its own and is kept."""
    return is_null(opt, raw, src) and opt.name not in NULL_IS_A_VALUE


def load_recipe(argv: list[str] | None = None, files: list[str] | None = None, overrides: dict | None = None) -> Recipe:
    """Recipe from recipe files and/or a command line. CLI flags override files; later files override earlier."""
    argv = list(argv or [])
    # the method decides how many words a flag takes (DPOConfig's loss_type is a list, SFTConfig's a string) and it
    # may be set in a file: a first split takes a list wherever any method does, finds the files, reads the method
    cli_files, flags = parse_argv(argv, "any")
    merged, sources = _read_files(list(files or []) + cli_files)
    method = _method(merged, flags, overrides or {})
    again, flags = parse_argv(argv, method)
    if again != cli_files:  # a list-taking word was a file for this method
        merged, sources = _read_files(list(files or []) + again)
    options = all_options(method)
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
        if isinstance(merged.get("reward_funcs"), tuple) and is_shipped(merged["reward_funcs"][1]):  # file.py:function
            merged["reward_funcs"] = (files_from(ROOT, merged["reward_funcs"][0]), merged["reward_funcs"][1])

    values: dict[str, Any] = {}
    renamed: dict[str, str] = {}
    ignored: dict[str, str] = {}
    bases = set(sources) - {str(p) for p in list(files or []) + again}  # files read only as some recipe's base:
    flat_names = [n for n in options if "." not in n] + list(ALIASES)
    for key, entry in merged.items():
        if key in NESTED:
            if not isinstance(entry, dict):
                raise RecipeError(f"{key}: must be a mapping of its options ({entry[1]}), e.g. {key}: {{gpus_per_node: 2}}")
            for sub, (raw, src) in entry.items():
                full = f"{key}.{sub}"
                if full not in options:
                    subs = [n.split(".", 1)[1] for n in options if n.startswith(key + ".")]
                    raise RecipeError(f"unknown key '{full}' ({src}); {suggest(sub, subs)}")
                if not unsets(options[full], raw, src):
                    values[full] = coerce(options[full], raw, src)
            continue
        raw, src = entry
        alias = getattr(src, "alias", None)  # the spelling used, when it was an old name (see _tag)
        if key not in options:
            nested_hint = [f"{s}.{key}" for s, cls in NESTED.items() if key in cls.__dataclass_fields__]
            hint = f"it belongs under '{nested_hint[0].split('.')[0]}:' ({nested_hint[0]})" if nested_hint else suggest(key, flat_names)
            raise RecipeError(f"unknown key '{key}' ({src}); {hint}")
        canonical = key
        if unsets(options[canonical], raw, src):
            continue  # as if never set: the default (and not explicit)
        if options[key].methods and method not in options[key].methods and str(src) in bases:
            # a base written for another method (packing in a tiny SFT recipe a DPO recipe extends): not this run's;
            # the same key in the recipe named, or on the command line, is refused (validation)
            ignored[key] = (f"{_word(raw)} from {Path(src).name} is a key of {CONFIGS[options[key].methods[0]]}; "
                            f"method {method} has none: not used")
            continue
        if alias:
            renamed[alias] = canonical
        values[canonical] = coerce(options[canonical], raw, src)
        if alias == "warmup_ratio" and not 0.0 <= values[canonical] < 1.0:
            raise RecipeError(f"warmup_ratio: {values[canonical]} is not a ratio in [0, 1) ({src}); for a step count use warmup_steps")

    adopt_model_init_kwargs(values, renamed)
    return _build(values, sources, renamed, ignored)


def _read_files(paths: list[str]) -> tuple[dict, list[str]]:
    """The recipe files merged in order (each with its base: chain), and every file read."""
    merged: dict[str, Any] = {}
    sources: list[str] = []
    for p in paths:
        data, chain = load_yaml_chain(p)
        merged = deep_merge(merged, data)
        sources += chain
    return merged, sources


def _method(merged: dict, flags: dict, overrides: dict) -> str:
    """The recipe's `method` (CLI flag, then overrides, then files), read first: it decides which TRL config class
    defines the other keys."""
    option = all_options()["method"]
    if "method" in flags:
        raw, src = flags["method"]
    elif "method" in overrides:
        raw, src = overrides["method"], "overrides"
    elif "method" in merged:
        raw, src = merged["method"]
    else:
        return option.default
    return option.default if is_null(option, raw, src) else coerce(option, raw, src)


def _build(values: dict[str, Any], sources: list[str], renamed: dict[str, str], ignored: dict[str, str] | None = None) -> Recipe:
    options = all_options(values.get("method", "sft"))
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
        ignored=ignored or {},
    )
    validate(recipe)
    return recipe

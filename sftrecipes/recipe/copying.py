"""Copying a recipe (`cp`) so that the copy works from its new folder: its `base:` paths and the shipped recipes'
repository-relative input paths rewritten, its comments and layout kept.

    python -m sftrecipes cp tiny/ddp my-ddp.yaml [--force]      then: python -m sftrecipes launch my-ddp.yaml
"""

from __future__ import annotations

import difflib
import os
import re
import shlex
import sys
from pathlib import Path

import yaml

from sftrecipes.core.errors import RecipeError
from sftrecipes.core.paths import RECIPES, ROOT, runnable_recipes
from sftrecipes.recipe.load import PATH_OPTIONS, from_repo_root, is_shipped
from sftrecipes.recipe.rewards import files_from
from sftrecipes.recipe.schema import ALIASES


def self_command() -> list[str]:
    """This command line as the current directory can call it: `python -m sftrecipes` at the repository root, the
    package folder itself elsewhere (no install needed, see __main__.py)."""
    py = sys.executable
    if Path.cwd().resolve() == ROOT:
        inside = os.path.abspath(py).startswith(str(ROOT) + os.sep)
        return [os.path.relpath(py) if inside else py, "-m", "sftrecipes"]
    return [py, str(ROOT / "sftrecipes")]


def find_recipe(name: str) -> Path:
    """A recipe file, or a recipe's name under recipes/ (tiny/fsdp, tiny/fsdp.yaml)."""
    if Path(name).is_file():
        return Path(name)
    for candidate in (RECIPES / name, RECIPES / f"{name}.yaml"):
        if candidate.is_file() and candidate.resolve().is_relative_to(RECIPES.resolve()):
            return candidate
    names = [p.relative_to(RECIPES).with_suffix("").as_posix() for p in runnable_recipes()]
    close = difflib.get_close_matches(name.removesuffix(".yaml"), names, n=3, cutoff=0.6)
    hint = f"did you mean {' or '.join(close)}?" if close else f"give a recipe file or a name such as {names[0]} (recipes/<name>.yaml)"
    raise RecipeError(f"cp: no recipe file or name '{name}'; {hint}")


def _replace_top_level(text: str, changes: dict) -> str:
    """The YAML text with each top-level key of `changes` (as spelled in the file) set to its new value, the rest of
    the file (comments, layout) kept."""
    lines = text.splitlines(keepends=True)
    out, i = [], 0
    while i < len(lines):
        m = re.match(r"([A-Za-z_][\w.-]*)\s*:", lines[i])
        if not (m and m.group(1) in changes):
            out.append(lines[i])
            i += 1
            continue
        j = i + 1  # the value's continuation lines: a block list, a flow list over several lines
        while j < len(lines) and (lines[j][:1] in (" ", "\t", "-") or not lines[j].strip()):
            j += 1
        while j > i + 1 and not lines[j - 1].strip():
            j -= 1
        value = changes[m.group(1)]  # a list in flow style ([a, b]), a scalar plainly
        out.append(yaml.safe_dump({m.group(1): value}, default_flow_style=None if isinstance(value, list) else False, width=10**6))
        i = j
    return "".join(out)


def copy_recipe(src: str, dest: str, force: bool = False) -> tuple[Path, Path, dict]:
    """Copy a recipe so that it works from its new folder: `base:` paths rewritten relative to DEST's folder; local
    input paths a shipped recipe gives (model, tokenizer, data, resume) made absolute, since outside recipes/ they
    would be relative to the launching directory. output_dir is kept as written: the copy's run writes under the
    directory it is launched from, not over the original's outputs. Returns (source, destination, changes)."""
    source = find_recipe(src)
    target = Path(dest)
    if target.is_dir():
        target = target / source.name
    if target.suffix not in (".yaml", ".yml"):
        raise RecipeError(f"cp: destination '{dest}' must be a .yaml file or an existing folder")
    if target.exists() and target.resolve() == source.resolve():
        raise RecipeError(f"cp: '{dest}' is the source recipe itself; give another destination")
    if target.exists() and not force:
        raise RecipeError(f"cp: '{target}' exists; pass --force to overwrite it, or give another destination")
    text = source.read_text()
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as e:
        raise RecipeError(f"cp: '{source}' is not valid YAML ({getattr(e, 'problem', e)}); fix it first") from None
    if not isinstance(data, dict):
        raise RecipeError(f"cp: '{source}' must be a mapping of key: value")
    changes: dict = {}
    bases = data.get("base")
    if isinstance(bases, (str, list)):
        moved = [os.path.relpath(os.path.normpath(os.path.join(os.path.abspath(source.parent), b)), os.path.abspath(target.parent))
                 for b in ([bases] if isinstance(bases, str) else bases) if isinstance(b, str)]
        changes["base"] = moved[0] if isinstance(bases, str) else moved
    if is_shipped(source) and not os.path.abspath(target).startswith(str(RECIPES) + os.sep):
        for key, value in data.items():
            canonical = ALIASES.get(key, key)
            if canonical in PATH_OPTIONS and canonical != "output_dir" and from_repo_root(canonical, value) != value:
                changes[key] = from_repo_root(canonical, value)
            elif canonical == "reward_funcs" and files_from(ROOT, value) != value:  # its file.py:function entries
                changes[key] = files_from(ROOT, value)
    new_text = _replace_top_level(text, changes)
    if yaml.safe_load(new_text) != {**data, **changes}:  # a layout the line edit does not handle: write the data
        lines = text.splitlines(keepends=True)
        head = "".join(lines[:next((i for i, line in enumerate(lines) if not line.startswith("#")), len(lines))])
        new_text = head + yaml.safe_dump({**data, **changes}, sort_keys=False, default_flow_style=None)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(new_text)
    except OSError as e:
        raise RecipeError(f"cp: cannot write '{target}' ({e.strerror}); give a destination in a writable folder") from None
    return source, target, changes


def main(src: str, dest: str, force: bool = False) -> int:
    """`cp SRC DEST [--force]`: the copy, what was rewritten, and the command that starts it."""
    source, target, changes = copy_recipe(src, dest, force)
    shown = source.resolve().relative_to(ROOT) if source.resolve().is_relative_to(ROOT) else source
    print(f"wrote {target}: a copy of {shown}" + (f" ({', '.join(changes)} rewritten to work from its folder)" if changes else ""))
    if is_shipped(target):
        print("it is under recipes/: its relative paths are relative to the repository root; make emit gives it scripts/run_<name>.sh")
    elif "output_dir" in (yaml.safe_load(target.read_text()) or {}):
        print("its output_dir is relative to the directory you launch it from (edit it to write elsewhere)")
    print(f"next: edit {target}, then start it:\n  {shlex.join([*self_command(), 'launch', str(target)])}")
    return 0

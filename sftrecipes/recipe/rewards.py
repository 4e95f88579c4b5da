"""The reward functions of the online methods (grpo, rloo) as recipe keys, and their check before torch loads: each
`reward_funcs` entry a built-in's name, a `file.py:function` whose file defines that function, a `module:function`, or
a reward model's folder; their weights one per function."""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field
from pathlib import Path

from sftrecipes.core.errors import RecipeError

# The built-in reward functions (train/rewards.py computes them): name -> what it rewards
BUILTINS = {
    "exact_answer": "1.0 when the completion's answer (the text inside its last <answer>...</answer>, else the whole "
                    "completion), stripped, equals the row's reward_answer_column, else 0.0",
    "numeric_answer": "1.0 when the completion's last number (or the last \\boxed{...}) equals the row's "
                      "reward_answer_column as a number (math; 1e-6 relative), else 0.0",
    "format": "1.0 when the whole completion matches reward_format_regex (re.fullmatch, DOTALL), else 0.0",
    "length": "TRL's soft overlong punishment: 0 up to max_completion_length - reward_length_cache tokens, then "
              "falling linearly to -1 at max_completion_length",
}
DEFAULT_FORMAT = r"<think>.*?</think>\s*<answer>.*?</answer>"


def _opt(default, help_: str):
    return field(default=default, metadata={"help": help_})


@dataclass
class RewardOptions:
    """The reward functions of grpo and rloo, read by train/rewards.py (a base of schema.RunOptions: run keys)."""

    reward_funcs: list[str] | None = _opt(
        None, "method grpo/rloo: what scores each completion, a list. Each entry: a built-in ("
        + "; ".join(f"{k}: {v}" for k, v in BUILTINS.items())
        + "), path/to/file.py:function or package.module:function (TRL's signature: f(prompts, completions, "
        "completion_ids, **columns) -> list of float or None; the row's other dataset columns arrive as keyword "
        "arguments), or a reward model's folder (a sequence-classification model, one label). Weights: reward_weights.")
    reward_answer_column: str = _opt("answer", "exact_answer / numeric_answer: the dataset column holding each "
                                               "prompt's answer.")
    reward_format_regex: str = _opt(DEFAULT_FORMAT, "format: the pattern a whole completion must match.")
    reward_length_cache: int = _opt(64, "length: the tokens before max_completion_length where the penalty starts.")


@dataclass(frozen=True)
class RewardSpec:
    """One reward_funcs entry, read: kind builtin | file | module | model; `where` the file, module or folder."""

    entry: str
    kind: str
    where: str = ""
    function: str = ""


def read_spec(entry: str, base: Path | None = None) -> RewardSpec:
    """What an entry names, checked as far as the files tell without importing anything: a built-in; a file that
    exists and defines the function at its top level; a model folder with a config.json; a module:function."""
    entry = str(entry).strip()
    if entry in BUILTINS:
        return RewardSpec(entry, "builtin")
    path, sep, function = entry.rpartition(":")
    if sep and path.endswith(".py"):
        file = Path(path) if Path(path).is_absolute() or base is None else base / path
        if not file.is_file():
            raise RecipeError(f"reward_funcs: {entry}: no file {file}; give the path of a Python file (relative to the "
                              "current folder) and the function's name, e.g. rewards.py:my_reward")
        try:
            tree = ast.parse(file.read_text(), str(file))
        except SyntaxError as e:
            raise RecipeError(f"reward_funcs: {file} does not parse (line {e.lineno}: {e.msg}); fix the file") from None
        defined = {n.name for n in tree.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}
        assigned = {t.id for n in tree.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}
        if function not in defined | assigned:
            hint = f" (it defines {', '.join(sorted(defined))})" if defined else ""
            raise RecipeError(f"reward_funcs: {file} defines no function {function!r} at its top level{hint}; name one "
                              "of its functions after the colon")
        return RewardSpec(entry, "file", str(file), function)
    if sep and re.fullmatch(r"[A-Za-z_][\w.]*", path) and re.fullmatch(r"[A-Za-z_]\w*", function):
        return RewardSpec(entry, "module", path, function)
    folder = Path(entry)
    if folder.is_dir():
        if not (folder / "config.json").is_file():
            raise RecipeError(f"reward_funcs: {entry} is a folder without config.json, not a reward model; give a "
                              "sequence-classification model's folder, or a built-in / file.py:function")
        return RewardSpec(entry, "model", str(folder))
    raise RecipeError(f"reward_funcs: {entry!r} is none of the built-ins ({', '.join(BUILTINS)}), a file.py:function, "
                      "a module:function or a model folder; fix the entry")


def files_from(root: Path, entries):
    """reward_funcs as seen from elsewhere: each `relative/file.py:function` entry of a shipped recipe (relative to the
    repository root, as its other paths are) made absolute; other entries, and anything not a list, unchanged."""
    if not isinstance(entries, list):
        return entries
    out = []
    for entry in entries:
        path, sep, function = str(entry).rpartition(":")
        relative = sep and path.endswith(".py") and not Path(path).is_absolute() and not path.startswith("~")
        out.append(f"{root / path}:{function}" if relative else entry)
    return out


def check_rewards(recipe, online: bool) -> list[RewardSpec]:
    """The recipe's reward_funcs read (read_spec) and held to its method and reward_weights: one line on the first
    fault. Returns the specs ([] for the other methods)."""
    funcs = recipe.run.reward_funcs
    if not online:
        if funcs:
            raise RecipeError(f"reward_funcs: only the online methods (grpo, rloo) score completions; method "
                              f"{recipe.method} trains on its data as it is: remove reward_funcs, or set method: grpo")
        return []
    if not funcs:
        raise RecipeError(f"reward_funcs: method {recipe.method} needs at least one reward function; set reward_funcs, "
                          f"e.g. [numeric_answer] (built-ins: {', '.join(BUILTINS)}) or [rewards.py:my_reward]")
    specs = [read_spec(e) for e in funcs]
    seen = [s.entry for s in specs]
    dup = next((e for e in seen if seen.count(e) > 1), None)
    if dup:
        raise RecipeError(f"reward_funcs: {dup} is named twice; name each function once and weigh it with reward_weights")
    weights = recipe.trl_value("reward_weights")
    if weights is not None and len(weights) != len(specs):
        raise RecipeError(f"reward_weights: {len(weights)} weights for {len(specs)} reward_funcs; give one weight per "
                          "function, in their order")
    if any(s.entry == "format" for s in specs):
        try:
            re.compile(recipe.run.reward_format_regex)
        except re.error as e:
            raise RecipeError(f"reward_format_regex: {e}; fix the pattern") from None
    return specs
